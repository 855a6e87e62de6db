//! A stand-in for the disk interface of a ring-per-queue VMM, in the shape cloud-hypervisor's
//! `block` crate gives it today (`DiskFile`, `AsyncIo`), written here from its documented
//! signatures: a disk hands out one [`AsyncIo`] per virtqueue; a request is an owned
//! operation ([`AsyncIoOp`]: guest memory with the mapping that keeps it alive, or a bounce
//! buffer) that the completion hands back ([`AsyncIoCompletion`]); a refused submission hands
//! it back too.

use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

/// Errors of the disk interface. The VMM's error enums (one variant per call) each wrap an
/// `io::Error`; the stand-in keeps only that.
pub type DiskError = std::io::Error;

/// Guest memory a request reads into or writes from: the mapping (kept alive while the
/// request runs) and the segments in it.
pub struct GuestTarget {
    /// What keeps the memory mapped (the VMM's guest memory object).
    pub memory: Arc<dyn std::any::Any + Send + Sync>,
    /// The segments, in guest order.
    pub iovecs: Vec<libc::iovec>,
}

// SAFETY: `GuestTarget` is `!Send` only because `iovec` holds raw pointers. They point into
// `memory` (`Send + Sync`, moved along with them) and are dereferenced by nobody but the
// kernel and the disk that the target is lent to, one at a time.
unsafe impl Send for GuestTarget {}

/// Where a read's bytes go or a write's come from.
pub enum IoTarget {
    /// Guest memory.
    Guest(GuestTarget),
    /// A buffer of the VMM's own (for example an aligned bounce buffer for `O_DIRECT`).
    Bounce(Vec<u8>),
}

/// A read or a write, owned by the disk until its completion hands it back.
pub struct AsyncIoOp {
    /// Disk offset.
    pub offset: u64,
    /// The memory.
    pub target: IoTarget,
}

/// A finished request.
pub struct AsyncIoCompletion {
    /// The `user_data` it was submitted with.
    pub user_data: u64,
    /// Bytes transferred, or a negated errno.
    pub result: i32,
    /// The read or write operation, handed back (`None` for the others).
    pub op: Option<AsyncIoOp>,
}

/// One request of a batch (reads and writes; flushes go through [`AsyncIo::fsync`]).
pub enum BatchRequest {
    /// A read.
    Read(AsyncIoOp),
    /// A write.
    Write(AsyncIoOp),
}

/// A submission that was refused: the operation back, and why.
pub type Refused<T> = (T, DiskError);

/// One queue of a disk (one per virtqueue), driven from the VMM's thread for that queue.
pub trait AsyncIo: Send {
    /// Signalled whenever a completion may be ready.
    fn notifier(&self) -> &EventFd;
    /// Reads `op.target`'s length at `op.offset`.
    fn read_vectored(&mut self, op: AsyncIoOp, user_data: u64) -> Result<(), Refused<AsyncIoOp>>;
    /// Writes `op.target`'s bytes at `op.offset`.
    fn write_vectored(&mut self, op: AsyncIoOp, user_data: u64) -> Result<(), Refused<AsyncIoOp>>;
    /// With `Some(user_data)`: an asynchronous flush that completes like any request. With
    /// `None`: a synchronous flush, done when the call returns (write-through mode).
    fn fsync(&mut self, user_data: Option<u64>) -> Result<(), DiskError>;
    /// Makes `len` bytes at `offset` read as zeros, keeping the space (write-zeroes).
    fn write_zeroes(&mut self, offset: u64, len: u64, user_data: u64) -> Result<(), DiskError>;
    /// Makes `len` bytes at `offset` read as zeros and releases the space (a guest's discard,
    /// and write-zeroes with unmap).
    fn punch_hole(&mut self, offset: u64, len: u64, user_data: u64) -> Result<(), DiskError>;
    /// Submits a batch at once: all taken, or all handed back.
    fn submit_batch_requests(
        &mut self,
        batch: Vec<(BatchRequest, u64)>,
    ) -> Result<(), Refused<Vec<(BatchRequest, u64)>>>;
    /// The next completion, if any (never blocks).
    fn next_completed_request(&mut self) -> Option<AsyncIoCompletion>;
}

/// A disk image the VMM opened.
pub trait DiskFile: Send {
    /// Virtual size in bytes.
    fn size(&mut self) -> Result<u64, DiskError>;
    /// A new queue with a ring of `ring_depth` entries.
    fn new_async_io(&self, ring_depth: u32) -> Result<Box<dyn AsyncIo>, DiskError>;
}

//! The [`Storage`] trait: what the image engine needs from the file that holds an image.

use std::future::Future;
use std::io::IoSlice;
use std::sync::Arc;

use crate::error::{Op, Result, StorageError};
use crate::image_lock::ImageLock;

/// How [`Storage::write_zeroes`] zeroed a range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ZeroOutcome {
    /// The backend zeroed the range without writing zero bytes (for files:
    /// `fallocate(FALLOC_FL_ZERO_RANGE)`), or the range was empty.
    Efficient,
    /// The backend had no efficient way and wrote zero bytes.
    Written,
}

/// What [`Storage::discard`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DiscardOutcome {
    /// The range was deallocated (for files: `fallocate(FALLOC_FL_PUNCH_HOLE |
    /// FALLOC_FL_KEEP_SIZE)`): it now reads as zeros.
    Deallocated,
    /// The backend cannot discard; nothing changed and the range keeps its old contents.
    Ignored,
}

/// What [`Storage::allocate`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AllocateOutcome {
    /// Space for the range is reserved (for files: `fallocate` with mode 0), and the length of
    /// the storage is at least the end of the range.
    Reserved,
    /// The backend cannot reserve space; nothing changed, not even the length.
    NotReserved,
}

/// Byte-addressed storage with positioned, asynchronous I/O: the seam between the image engine
/// and files, block devices, memory and test doubles.
///
/// # Contract
///
/// * **Futures are `Send`** and tied to no executor: a backend may block the polling thread
///   (see [`FileStorage`](crate::FileStorage) for the trade-off) but must not require a
///   particular runtime to be running. The engine spawns them on tokio.
/// * **Concurrency.** Methods take `&self`; any number of requests may be in flight at once.
///   Requests to disjoint ranges do not affect each other. Overlapping requests in flight at the
///   same time leave the overlap in an unspecified mix of their data; the engine never issues
///   them.
/// * **Ranges.** `offset + len` must not overflow nor exceed [`MAX_OFFSET`](crate::MAX_OFFSET);
///   such requests fail with [`StorageError::OutOfRange`] naming both, before anything is
///   touched.
/// * **Reads.** [`read_at`](Storage::read_at) fills the whole buffer or fails;
///   reaching the end of the file first is [`StorageError::UnexpectedEof`] (kind
///   [`std::io::ErrorKind::UnexpectedEof`]). [`read_at_zero_fill`](Storage::read_at_zero_fill)
///   reads bytes past the end as zeros, which is what a short backing file needs.
///   [`read_at_most`](Storage::read_at_most) is the primitive both are built on. The contents of
///   the buffer after a failed read are unspecified.
/// * **Writes** past the end grow the storage; a gap between the old end and the write reads as
///   zeros. A write either fails or writes every byte (backends loop over short writes).
/// * **Zeroing.** After [`write_zeroes`](Storage::write_zeroes) the range reads as zeros, and
///   the storage is at least as long as the end of the range (like a write).
/// * **Discard is advisory.** [`discard`](Storage::discard) never changes the length. It either
///   deallocates the range, which then reads as zeros, or does nothing; the returned
///   [`DiscardOutcome`] says which. Use `write_zeroes` where zeros are required.
/// * **Allocate** reserves space so later writes to the range do not fail for lack of space and
///   stay contiguous. It never changes data that can be read; see [`AllocateOutcome`] for its
///   effect on the length.
/// * **Flush.** When [`flush`](Storage::flush) returns `Ok`, every modification (write, zeroing,
///   discard, allocation, length change) whose future completed before `flush` was called is
///   durable: it survives a crash or power loss of the host (for files: `fdatasync`). Writes
///   that complete while a flush is running may or may not be covered. Nothing is promised
///   about the order in which unflushed writes reach stable storage.
/// * **Alignment.** [`request_alignment`](Storage::request_alignment) and
///   [`mem_alignment`](Storage::mem_alignment) are 1 for buffered backends. Direct-I/O
///   backends require data requests (reads, writes, `write_zeroes`) to have offsets and
///   lengths that are multiples of `request_alignment`, and buffers (each segment of a
///   vectored write) that start on a multiple of `mem_alignment`; other requests fail with
///   [`StorageError::Misaligned`]. `discard`, `allocate` and `set_len` take any range.
/// * **Errors** are [`StorageError`]s naming the operation, offset and length.
pub trait Storage: Send + Sync {
    /// Reads into `buf` from `offset` until `buf` is full or the end of the storage is reached,
    /// and returns the number of bytes read: `buf.len()` unless the end came first.
    fn read_at_most(
        &self,
        buf: &mut [u8],
        offset: u64,
    ) -> impl Future<Output = Result<usize>> + Send;

    /// Fills `buf` from `offset`; fails with [`StorageError::UnexpectedEof`] if the storage
    /// ends before the end of the range.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> impl Future<Output = Result<()>> + Send {
        async move {
            let len = buf.len() as u64;
            let n = self.read_at_most(buf, offset).await?;
            if (n as u64) < len {
                return Err(StorageError::UnexpectedEof {
                    offset,
                    len,
                    eof: offset.saturating_add(n as u64),
                });
            }
            Ok(())
        }
    }

    /// Fills `buf` from `offset`, treating bytes past the end of the storage as zeros.
    fn read_at_zero_fill(
        &self,
        buf: &mut [u8],
        offset: u64,
    ) -> impl Future<Output = Result<()>> + Send {
        async move {
            let n = self.read_at_most(buf, offset).await?;
            if let Some(tail) = buf.get_mut(n..) {
                tail.fill(0);
            }
            Ok(())
        }
    }

    /// Writes all of `buf` at `offset`, growing the storage if the range ends past its end.
    fn write_at(&self, buf: &[u8], offset: u64) -> impl Future<Output = Result<()>> + Send;

    /// Writes all of `buf` at `offset` and makes that write durable before returning, without
    /// waiting for other writes to become durable where the backend can (`io_uring` writes
    /// with `RWF_DSYNC`: a buffered file's other dirty pages stay in the page cache). The
    /// default writes, then flushes everything ([`flush`](Self::flush)).
    fn write_at_durable(&self, buf: &[u8], offset: u64) -> impl Future<Output = Result<()>> + Send {
        async move {
            self.write_at(buf, offset).await?;
            self.flush().await
        }
    }

    /// Writes the concatenation of `bufs` at `offset`, as one request where the backend can
    /// (for files: `pwritev`). Empty segments are allowed.
    fn write_vectored_at(
        &self,
        bufs: &[IoSlice<'_>],
        offset: u64,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Makes `len` bytes at `offset` read as zeros, efficiently where the backend can, and
    /// grows the storage to the end of the range if it is shorter.
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
    ) -> impl Future<Output = Result<ZeroOutcome>> + Send;

    /// Tells the backend the range is no longer needed. Advisory: see the trait docs.
    fn discard(&self, offset: u64, len: u64)
    -> impl Future<Output = Result<DiscardOutcome>> + Send;

    /// Reserves space for `len` bytes at `offset` (used for whole host clusters). Bytes that
    /// could be read before read the same afterwards; newly covered bytes read as zeros.
    fn allocate(
        &self,
        offset: u64,
        len: u64,
    ) -> impl Future<Output = Result<AllocateOutcome>> + Send;

    /// Makes completed modifications durable. See the trait docs for the exact guarantee.
    fn flush(&self) -> impl Future<Output = Result<()>> + Send;

    /// The current length in bytes.
    fn len(&self) -> impl Future<Output = Result<u64>> + Send;

    /// Whether the length is zero.
    fn is_empty(&self) -> impl Future<Output = Result<bool>> + Send {
        async move { Ok(self.len().await? == 0) }
    }

    /// Truncates or extends to `len` bytes; bytes added by extending read as zeros, even where
    /// the storage held data before an earlier shrink.
    fn set_len(&self, len: u64) -> impl Future<Output = Result<()>> + Send;

    /// Required alignment, in bytes, of offsets and lengths of data requests (1 when none).
    fn request_alignment(&self) -> usize {
        1
    }

    /// Required alignment, in bytes, of buffer addresses (1 when none).
    fn mem_alignment(&self) -> usize {
        1
    }

    /// Takes the image locks QEMU honours for `lock` (see [`ImageLock`]), replacing those
    /// this storage held before, or fails with [`StorageError::Locked`] naming the holder.
    /// Storages that are no file of the host (memory) have nothing to lock and succeed.
    fn lock_image(&self, lock: ImageLock) -> Result<()> {
        let _ = lock;
        Ok(())
    }

    /// Releases the image locks [`lock_image`](Self::lock_image) took (closing the file
    /// releases them too). Other processes may then open the image as they like.
    fn unlock_image(&self) {}

    /// The descriptor that a per-queue ring (`qimg_io::queue::QueueRing`) may read and write
    /// directly, bypassing this storage, with the alignment such requests need. `None` (the
    /// default) for storages that are not one plain file (memory, fault injection), whose
    /// requests must go through the storage itself.
    fn direct_access(&self) -> Option<DirectAccess<'_>> {
        None
    }

    /// Tells the storage what the requests that follow are for, for error injection
    /// ([`BlkdebugStorage`](crate::BlkdebugStorage), QEMU's `blkdebug` events). Storages
    /// that wrap another pass it on; the others ignore it (the default). qimg's engine
    /// announces `l1_update`, `l2_load`, `l2_update`, `l2_alloc_cow_read`, `l2_alloc_write`,
    /// `refblock_load`, `refblock_update_part`, `refblock_alloc`, `refblock_alloc_write`,
    /// `refblock_alloc_hookup`, `refblock_alloc_write_blocks`, `cluster_alloc`, `read_aio`,
    /// `read_backing_aio`, `read_compressed`, `write_aio`, `write_compressed`, `cow_read`,
    /// `cow_write`, `flush_to_os` and `flush_to_disk` (guest flushes and the close), each
    /// just before the requests it names, as QEMU's qcow2 driver does; a
    /// [`BlkdebugStorage`](crate::BlkdebugStorage) adds `pwritev`, `pwritev_zero` and
    /// `pwritev_done` around each write, as QEMU's block layer does.
    fn debug_event(&self, event: crate::DebugEvent) {
        let _ = event;
    }
}

/// A file descriptor requests may use directly, and the alignment they need: offsets and
/// lengths multiples of `request_alignment`, buffer addresses of `mem_alignment` (both 1 for a
/// buffered file, the device's for `O_DIRECT`).
#[derive(Debug, Clone, Copy)]
pub struct DirectAccess<'a> {
    /// The descriptor.
    pub fd: std::os::fd::BorrowedFd<'a>,
    /// Alignment of offsets and lengths.
    pub request_alignment: usize,
    /// Alignment of buffer addresses.
    pub mem_alignment: usize,
}

/// Shares one storage between owners: every call goes to the inner storage.
impl<S: Storage + ?Sized> Storage for Arc<S> {
    fn direct_access(&self) -> Option<DirectAccess<'_>> {
        (**self).direct_access()
    }

    fn debug_event(&self, event: crate::DebugEvent) {
        (**self).debug_event(event)
    }

    fn read_at_most(
        &self,
        buf: &mut [u8],
        offset: u64,
    ) -> impl Future<Output = Result<usize>> + Send {
        (**self).read_at_most(buf, offset)
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> impl Future<Output = Result<()>> + Send {
        (**self).read_at(buf, offset)
    }
    fn read_at_zero_fill(
        &self,
        buf: &mut [u8],
        offset: u64,
    ) -> impl Future<Output = Result<()>> + Send {
        (**self).read_at_zero_fill(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> impl Future<Output = Result<()>> + Send {
        (**self).write_at(buf, offset)
    }

    fn write_at_durable(&self, buf: &[u8], offset: u64) -> impl Future<Output = Result<()>> + Send {
        (**self).write_at_durable(buf, offset)
    }
    fn write_vectored_at(
        &self,
        bufs: &[IoSlice<'_>],
        offset: u64,
    ) -> impl Future<Output = Result<()>> + Send {
        (**self).write_vectored_at(bufs, offset)
    }
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
    ) -> impl Future<Output = Result<ZeroOutcome>> + Send {
        (**self).write_zeroes(offset, len)
    }
    fn discard(
        &self,
        offset: u64,
        len: u64,
    ) -> impl Future<Output = Result<DiscardOutcome>> + Send {
        (**self).discard(offset, len)
    }
    fn allocate(
        &self,
        offset: u64,
        len: u64,
    ) -> impl Future<Output = Result<AllocateOutcome>> + Send {
        (**self).allocate(offset, len)
    }
    fn flush(&self) -> impl Future<Output = Result<()>> + Send {
        (**self).flush()
    }
    fn len(&self) -> impl Future<Output = Result<u64>> + Send {
        (**self).len()
    }
    fn set_len(&self, len: u64) -> impl Future<Output = Result<()>> + Send {
        (**self).set_len(len)
    }
    fn request_alignment(&self) -> usize {
        (**self).request_alignment()
    }
    fn mem_alignment(&self) -> usize {
        (**self).mem_alignment()
    }

    fn lock_image(&self, lock: ImageLock) -> Result<()> {
        (**self).lock_image(lock)
    }
    fn unlock_image(&self) {
        (**self).unlock_image()
    }
}

/// The total length of vectored buffers, as a request length.
pub(crate) fn total_len(op: Op, bufs: &[IoSlice<'_>], offset: u64) -> Result<u64> {
    bufs.iter()
        .try_fold(0u64, |acc, b| acc.checked_add(b.len() as u64))
        .ok_or(StorageError::OutOfRange {
            op,
            offset,
            len: u64::MAX,
        })
}

/// Checks a data request against alignment requirements; `bufs` are the buffer segments as
/// (address, length) pairs.
pub(crate) fn check_aligned(
    op: Op,
    offset: u64,
    len: u64,
    bufs: impl IntoIterator<Item = (usize, usize)>,
    request_alignment: usize,
    mem_alignment: usize,
) -> Result<()> {
    let req = request_alignment.max(1) as u64;
    let mem = mem_alignment.max(1);
    let misaligned = |len: u64, addr: usize| StorageError::Misaligned {
        op,
        offset,
        len,
        addr,
        request_alignment,
        mem_alignment,
    };
    if offset % req != 0 || len % req != 0 {
        return Err(misaligned(len, 0));
    }
    for (addr, seg_len) in bufs {
        if seg_len == 0 {
            continue;
        }
        if addr % mem != 0 || seg_len as u64 % req != 0 {
            return Err(misaligned(seg_len as u64, addr));
        }
    }
    Ok(())
}

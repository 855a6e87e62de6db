//! [`QueueRing`]: one io_uring ring for one guest queue, driven from the caller's thread.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;

use io_uring::{IoUring, opcode, types};
use nix::libc;

use super::buffers::{IoBuffers, Memory};

/// The iovec array of one operation. Boxed so that its address survives moves of the slot
/// table.
struct Iovecs(Box<[libc::iovec]>);

// SAFETY: `libc::iovec` is `!Send` only for its raw pointer. These point into memory an
// `IoBuffers` lent (kept alive by the `Arc<Memory>` in the same slot) and are dereferenced only
// by the kernel.
unsafe impl Send for Iovecs {}

/// An operation the kernel holds: its memory stays here until its completion is reaped.
struct Slot {
    token: u64,
    expected: usize,
    /// The iovec array of a vectored transfer (`None` for one contiguous range, which the
    /// entry addresses directly, and for flushes).
    _iovecs: Option<Iovecs>,
    _memory: Option<Arc<Memory>>,
    /// Addresses of the memory ranges handed to the kernel (tests: proof that lent memory is
    /// used in place).
    #[cfg(test)]
    addresses: Vec<usize>,
}

/// One completed operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingCompletion {
    /// The token given at submission.
    pub token: u64,
    /// Bytes transferred, or a negated errno.
    pub result: i32,
    /// Bytes the operation asked for.
    pub expected: usize,
}

/// One io_uring ring, owned and driven by one thread (a guest queue's event loop): reads and
/// writes from lent memory ([`IoBuffers`]) and flushes, each with a `u64` token, and their
/// completions reaped in that thread. With an eventfd registered, the kernel signals it for
/// every completion, so an epoll loop wakes without any thread of ours in between.
///
/// Operations are queued by [`read`](Self::read), [`write`](Self::write) and
/// [`fsync`](Self::fsync) and handed to the kernel by [`submit`](Self::submit) (one system
/// call for a batch). At most [`capacity`](Self::capacity) operations are in flight; beyond
/// that, queuing fails with [`io::ErrorKind::WouldBlock`]. Dropping the ring waits for every
/// operation still in flight, so lent memory is never released while the kernel uses it.
pub struct QueueRing {
    ring: IoUring,
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    /// Queued and not yet submitted.
    queued: usize,
    submits: u64,
    /// How long [`wait`](Self::wait) watches the completion queue before it sleeps.
    poll: std::time::Duration,
}

impl std::fmt::Debug for QueueRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueRing")
            .field("capacity", &self.slots.len())
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

impl QueueRing {
    /// A ring for up to `depth` operations in flight (1..=4096).
    pub fn new(depth: u32) -> io::Result<Self> {
        Self::check_depth(depth)?;
        let ring = IoUring::new(depth.next_power_of_two())?;
        let n = depth as usize;
        Ok(QueueRing {
            ring,
            slots: (0..n).map(|_| None).collect(),
            free: (0..n).rev().collect(),
            queued: 0,
            submits: 0,
            poll: std::time::Duration::ZERO,
        })
    }

    /// Refuses a depth [`new`](Self::new) would refuse (outside 1..=4096), without making a
    /// ring.
    pub fn check_depth(depth: u32) -> io::Result<()> {
        if depth == 0 || depth > 4096 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("queue depth {depth} is not in 1..=4096"),
            ));
        }
        Ok(())
    }

    /// Has the kernel signal `eventfd` whenever it posts a completion.
    pub fn register_eventfd(&self, eventfd: BorrowedFd<'_>) -> io::Result<()> {
        self.ring.submitter().register_eventfd(eventfd.as_raw_fd())
    }

    /// The most operations in flight at once.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Operations queued or submitted whose completion was not reaped yet.
    pub fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Free places for operations.
    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// The memory addresses the operations in flight hand to the kernel (tests: proof that
    /// lent memory is used in place).
    #[cfg(test)]
    pub(super) fn in_flight_addresses(&self) -> Vec<usize> {
        self.slots
            .iter()
            .flatten()
            .flat_map(|s| s.addresses.iter().copied())
            .collect()
    }

    /// `io_uring_enter` calls made by [`submit`](Self::submit) so far.
    pub fn submit_calls(&self) -> u64 {
        self.submits
    }

    /// Queues a read of `len` bytes at `offset` of `fd` into bytes `[pos, pos + len)` of
    /// `bufs`. The descriptor must stay open until [`submit`](Self::submit) returns.
    pub fn read(
        &mut self,
        fd: BorrowedFd<'_>,
        offset: u64,
        bufs: &mut IoBuffers,
        pos: usize,
        len: usize,
        token: u64,
    ) -> io::Result<()> {
        self.transfer(fd, offset, bufs, pos, len, token, false)
    }

    /// Queues a write of bytes `[pos, pos + len)` of `bufs` at `offset` of `fd`. The descriptor
    /// must stay open until [`submit`](Self::submit) returns.
    pub fn write(
        &mut self,
        fd: BorrowedFd<'_>,
        offset: u64,
        bufs: &IoBuffers,
        pos: usize,
        len: usize,
        token: u64,
    ) -> io::Result<()> {
        self.transfer(fd, offset, bufs, pos, len, token, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn transfer(
        &mut self,
        fd: BorrowedFd<'_>,
        offset: u64,
        bufs: &IoBuffers,
        pos: usize,
        len: usize,
        token: u64,
        write: bool,
    ) -> io::Result<()> {
        let fd = types::Fd(fd.as_raw_fd());
        // One contiguous range (a guest page, an aligned buffer) goes as a plain read or write
        // addressing it directly: no iovec array to allocate.
        if let Some(base) = bufs
            .contiguous(pos, len)
            .filter(|_| len <= u32::MAX as usize)
        {
            let entry = if write {
                opcode::Write::new(fd, base, len as u32)
                    .offset(offset)
                    .build()
            } else {
                opcode::Read::new(fd, base, len as u32)
                    .offset(offset)
                    .build()
            };
            return self.push(
                entry,
                Slot {
                    token,
                    expected: len,
                    _iovecs: None,
                    _memory: Some(bufs.share()),
                    #[cfg(test)]
                    addresses: vec![base as usize],
                },
            );
        }
        let iovecs = bufs.iovecs(pos, len).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "bytes {pos}..{} are outside the {} bytes lent",
                    pos.saturating_add(len),
                    bufs.len()
                ),
            )
        })?;
        let count = u32::try_from(iovecs.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "too many segments"))?;
        let iovecs = Iovecs(iovecs.into_boxed_slice());
        let ptr = iovecs.0.as_ptr();
        let entry = if write {
            opcode::Writev::new(fd, ptr, count).offset(offset).build()
        } else {
            opcode::Readv::new(fd, ptr, count).offset(offset).build()
        };
        self.push(
            entry,
            Slot {
                token,
                expected: len,
                #[cfg(test)]
                addresses: iovecs.0.iter().map(|v| v.iov_base as usize).collect(),
                _iovecs: Some(iovecs),
                _memory: Some(bufs.share()),
            },
        )
    }

    /// Queues a flush of `fd` (`fdatasync` when `data_only`).
    pub fn fsync(&mut self, fd: BorrowedFd<'_>, data_only: bool, token: u64) -> io::Result<()> {
        let mut op = opcode::Fsync::new(types::Fd(fd.as_raw_fd()));
        if data_only {
            op = op.flags(types::FsyncFlags::DATASYNC);
        }
        self.push(
            op.build(),
            Slot {
                token,
                expected: 0,
                _iovecs: None,
                _memory: None,
                #[cfg(test)]
                addresses: Vec::new(),
            },
        )
    }

    fn push(&mut self, entry: io_uring::squeue::Entry, slot: Slot) -> io::Result<()> {
        let Some(idx) = self.free.pop() else {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("all {} places of the queue are in flight", self.slots.len()),
            ));
        };
        let entry = entry.user_data(idx as u64);
        // The slot is filled before the entry is pushed; the pointers in the entry point into
        // the slot's boxed iovecs and lent memory, which moving the slot into the table does
        // not move.
        self.slots[idx] = Some(slot);
        loop {
            // SAFETY: the entry's iovec array (if any) and the memory it addresses are kept
            // alive by the slot at `idx` until the completion with user_data `idx` is reaped (`reap`),
            // and `Drop` waits for every such completion before the slots are freed. The
            // descriptor is valid now (`BorrowedFd`) and the caller keeps it open until
            // `submit` returns. `&mut self` makes this the only access to the submission queue.
            let pushed = unsafe { self.ring.submission().push(&entry) };
            if pushed.is_ok() {
                break;
            }
            // The submission queue is full of queued entries: hand them to the kernel (it
            // cannot be, as it has room for every place, but a refusal must not spin).
            match self.submit() {
                Ok(n) if n > 0 => {}
                Ok(_) => {
                    self.slots[idx] = None;
                    self.free.push(idx);
                    return Err(io::Error::new(
                        io::ErrorKind::WouldBlock,
                        "the submission queue is full",
                    ));
                }
                Err(e) => {
                    self.slots[idx] = None;
                    self.free.push(idx);
                    return Err(e);
                }
            }
        }
        self.queued += 1;
        Ok(())
    }

    /// Hands every queued operation to the kernel (one system call); returns how many.
    pub fn submit(&mut self) -> io::Result<usize> {
        if self.queued == 0 {
            return Ok(0);
        }
        loop {
            match self.ring.submit() {
                Ok(n) => {
                    self.submits += 1;
                    self.queued = self.queued.saturating_sub(n);
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                    // Completions must be reaped first; the caller does that on its next turn.
                    return Ok(0);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Makes [`wait`](Self::wait) watch the completion queue for up to `poll` before it
    /// sleeps in the kernel (zero, the default: sleep at once). A completion that arrives
    /// within the window is seen without a wake-up of the waiting thread, which on a virtual
    /// machine (a halted vCPU to wake) costs microseconds per request at low queue depths; the
    /// price is a core kept busy for up to `poll` per wait. QEMU's iothreads poll the same way
    /// (`poll-max-ns`, 32 µs by default).
    pub fn set_poll(&mut self, poll: std::time::Duration) {
        self.poll = poll;
    }

    /// The window set by [`set_poll`](Self::set_poll).
    pub fn poll(&self) -> std::time::Duration {
        self.poll
    }

    /// Submits what is queued and waits until at least one completion can be reaped (or none
    /// is in flight), first watching the completion queue for the [`poll`](Self::poll)
    /// window.
    pub fn wait(&mut self) -> io::Result<()> {
        if self.in_flight() == 0 {
            return Ok(());
        }
        if !self.poll.is_zero() {
            self.submit()?;
            let start = std::time::Instant::now();
            loop {
                // The kernel posts block I/O completions from task work that interrupts this
                // thread (the ring is set up without COOP_TASKRUN), so user space sees them.
                if !self.ring.completion().is_empty() {
                    return Ok(());
                }
                if start.elapsed() >= self.poll {
                    break;
                }
                std::hint::spin_loop();
            }
        }
        loop {
            if !self.ring.completion().is_empty() {
                return Ok(());
            }
            match self.ring.submit_and_wait(1) {
                Ok(n) => {
                    self.submits += 1;
                    self.queued = self.queued.saturating_sub(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Reaps every completion the kernel has posted, calling `f` for each.
    pub fn reap(&mut self, mut f: impl FnMut(RingCompletion)) -> usize {
        let mut n = 0;
        loop {
            let Some(cqe) = self.ring.completion().next() else {
                return n;
            };
            let idx = cqe.user_data() as usize;
            let Some(slot) = self.slots.get_mut(idx).and_then(Option::take) else {
                continue;
            };
            self.free.push(idx);
            n += 1;
            f(RingCompletion {
                token: slot.token,
                result: cqe.result(),
                expected: slot.expected,
            });
        }
    }
}

impl Drop for QueueRing {
    fn drop(&mut self) {
        // The kernel may still use lent memory: wait for every operation before the slots
        // (and the memory they keep alive) go.
        while self.in_flight() > 0 {
            if self.wait().is_err() {
                // Cannot wait: leak the memory rather than free what the kernel may use.
                std::mem::forget(std::mem::take(&mut self.slots));
                return;
            }
            self.reap(|_| {});
        }
    }
}

//! [`UringStorage`]: a file or block device driven through Linux io_uring.
//!
//! # Design
//!
//! * **One ring per storage**, sized by [`UringOptions::entries`]. Requests take one of
//!   `entries` *slots*; when all are taken, further requests wait for one to free up, so no
//!   more than `entries` requests are ever in flight and the completion queue (twice as
//!   large) cannot overflow.
//! * **Buffers are owned by the slot, not by the future.** A request's memory (a bounce
//!   [`AlignedBuf`] and, for vectored opcodes, its `iovec`) moves into its slot before the
//!   kernel hears of it, and leaves the slot only after the kernel's completion for it has
//!   been reaped. Reads copy from the bounce buffer into the caller's buffer on completion;
//!   writes copy the caller's data in before submission. A future dropped while its request
//!   is in flight marks the slot abandoned; the memory is freed when the completion arrives.
//!   Cancelling a future can therefore never let the kernel touch freed memory.
//! * **Completions** are collected ("reaped") by whichever comes first: a future being polled
//!   (it reaps every completion waiting in the queue and wakes their tasks), or the storage's
//!   single completion thread, which sleeps in `io_uring_enter(GETEVENTS)` and wakes the tasks
//!   whose requests completed. No thread per request, and no runtime needed: the futures work
//!   on any executor, like the rest of the [`Storage`] contract requires.
//! * **Submission** happens outside the driver lock (the system call, which for page-cache
//!   hits does the whole transfer, holds up nobody), and a submitted request is then *handed
//!   over* to the completion thread, which sleeps on a condition variable while nothing is
//!   handed over rather than in the kernel, where every completion would wake it. With
//!   [`UringOptions::collect_inline_completions`] a request the kernel finished inside the
//!   submitting call is collected at once and never handed over: one system call, no thread
//!   wake-up.
//! * **On a tokio runtime** ([`UringOptions::complete_on_runtime`]) a task of the runtime
//!   waits for the ring's descriptor through the runtime's I/O driver instead of the
//!   completion thread (which stays parked unless that runtime goes away), and submissions
//!   are batched: the first request queued yields once, then submits everything queued
//!   meanwhile in one system call.
//! * **Fallbacks.** Opcodes are probed at open; any the kernel lacks (or that
//!   [`UringOptions::fallback_for`] excludes) run through a [`FileStorage`] on the same file
//!   instead, with its semantics. `len` and `set_len` always do (`lseek`/`ftruncate` are cheap
//!   and synchronous).

use std::fmt;
use std::fs::File;
use std::future::Future;
use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;
use std::time::Duration;

use io_uring::{IoUring, Probe, opcode, squeue, types};
use nix::errno::Errno;
use nix::fcntl::FallocateFlags;
use nix::libc;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use crate::aligned::AlignedBuf;
use crate::error::{Op, Result, StorageError, range_end};
use crate::file::{BlockingStrategy, FileOptions, FileStorage};
use crate::storage::{
    AllocateOutcome, DiscardOutcome, Storage, ZeroOutcome, check_aligned, total_len,
};

/// Ring size when none is given.
const DEFAULT_ENTRIES: u32 = 64;
/// Largest piece of a read or write submitted as one request (bounce buffers are at most this
/// large). A multiple of every O_DIRECT alignment.
const CHUNK: usize = 8 << 20;
/// `user_data` of the no-op that wakes the completion thread at shutdown.
const SHUTDOWN: u64 = u64::MAX;

/// How to open a [`UringStorage`]: like [`FileOptions`] (read-only or read-write, creating or
/// not, O_DIRECT or buffered, with or without `fallocate`) plus the ring size and which
/// operations avoid the ring. Starts read-only, buffered, existing file, 64 entries.
#[derive(Debug, Clone)]
pub struct UringOptions {
    file: FileOptions,
    entries: u32,
    fallocate: bool,
    avoid: Vec<Op>,
    inline: bool,
    runtime: bool,
}

impl Default for UringOptions {
    fn default() -> Self {
        UringOptions {
            file: FileOptions::new(),
            entries: DEFAULT_ENTRIES,
            fallocate: true,
            avoid: Vec::new(),
            inline: false,
            runtime: false,
        }
    }
}

impl UringOptions {
    /// Read-only, buffered, the file must exist, a 64-entry ring.
    pub fn new() -> Self {
        Self::default()
    }

    /// Ring size: how many requests may be in flight at once (0 is taken as 1). The kernel
    /// rounds it up to a power of two and caps it at its maximum (32768 today); see
    /// [`UringStorage::entries`] for the size obtained.
    pub fn entries(mut self, entries: u32) -> Self {
        self.entries = entries.max(1);
        self
    }

    /// Open for reading and writing (`true`) or reading only (`false`).
    pub fn read_write(mut self, yes: bool) -> Self {
        self.file = self.file.read_write(yes);
        self
    }

    /// Create the file if it does not exist (needs [`read_write`](UringOptions::read_write)).
    pub fn create(mut self, yes: bool) -> Self {
        self.file = self.file.create(yes);
        self
    }

    /// Create the file, failing if it exists (needs [`read_write`](UringOptions::read_write)).
    pub fn create_new(mut self, yes: bool) -> Self {
        self.file = self.file.create_new(yes);
        self
    }

    /// Truncate the file to length 0 on open (needs [`read_write`](UringOptions::read_write)).
    pub fn truncate(mut self, yes: bool) -> Self {
        self.file = self.file.truncate(yes);
        self
    }

    /// Bypass the page cache with `O_DIRECT`. Data requests must then be aligned as for
    /// [`FileStorage`]; the alignment is probed at open the same way.
    pub fn direct(mut self, yes: bool) -> Self {
        self.file = self.file.direct(yes);
        self
    }

    /// Whether to use `fallocate` where the file system supports it (the default); with
    /// `false`, `write_zeroes` writes zeros, `discard` does nothing and `allocate` reserves
    /// nothing.
    pub fn fallocate(mut self, yes: bool) -> Self {
        self.fallocate = yes;
        self.file = self.file.fallocate(yes);
        self
    }

    /// Runs `op` through the synchronous [`FileStorage`] fallback even if the kernel supports
    /// the opcode, as it does for opcodes the kernel lacks: for kernels with a buggy opcode,
    /// and to test the fallback. [`Op::Read`], [`Op::Write`] (plain, vectored, and the zeros
    /// `write_zeroes` writes), [`Op::Flush`], [`Op::WriteZeroes`], [`Op::Discard`] and
    /// [`Op::Allocate`] have ring paths; other operations always use the fallback.
    pub fn fallback_for(mut self, op: Op) -> Self {
        if !self.avoid.contains(&op) {
            self.avoid.push(op);
        }
        self
    }

    /// Whether a request the kernel completes inside the submitting system call (reads and
    /// writes served by the page cache, with buffered I/O) finishes in the same poll
    /// (`true`), or, as by default, returns `Pending` and is completed through the
    /// completion thread like any other. With `true` such requests cost one system call and
    /// no thread wake-up, and the completion thread only waits in the kernel for requests
    /// that are really still running; `qimg bench` turns it on.
    pub fn collect_inline_completions(mut self, yes: bool) -> Self {
        self.inline = yes;
        self
    }

    /// Wait for completions on the tokio runtime current at open instead of on the
    /// completion thread, and batch submissions. A task spawned on that runtime waits for
    /// the ring's file descriptor through the runtime's I/O driver (which must be enabled:
    /// `enable_io`, as for any tokio I/O object; like them, opening panics otherwise), so a
    /// completion wakes a runtime thread once rather than the completion thread and then a
    /// runtime thread. And the first request put on the submission queue lets the task yield
    /// once before it submits, so the requests of every task ready to run go to the kernel in
    /// one system call. This is QEMU's event-loop model on a tokio runtime.
    ///
    /// Without a current runtime at open, and once the runtime is gone, the completion thread
    /// takes over. The future that submits a batch must be polled again after it wakes itself
    /// (executors do this; dropping it submits the batch too).
    pub fn complete_on_runtime(mut self, yes: bool) -> Self {
        self.runtime = yes;
        self
    }

    /// Opens `path` and sets up the ring. Fails with [`StorageError::Open`] when the file
    /// cannot be opened, and with [`StorageError::UringUnavailable`] when io_uring cannot be
    /// used on this system.
    pub fn open(&self, path: impl AsRef<Path>) -> Result<UringStorage> {
        let file = self.file.open(path)?;
        UringStorage::with_file_storage(file, self)
    }

    /// Sets up a ring for an open file. Whether it is read-only and whether it uses O_DIRECT
    /// are read from its status flags, as for [`FileStorage::from_file`]; the file options of
    /// `self` are ignored, [`entries`](UringOptions::entries),
    /// [`fallocate`](UringOptions::fallocate) and
    /// [`fallback_for`](UringOptions::fallback_for) apply.
    pub fn from_file(&self, file: File) -> Result<UringStorage> {
        let file = FileStorage::from_file(file, BlockingStrategy::Inline)?;
        if !self.fallocate {
            // FileStorage::from_file enables fallocate; the fallback must agree with us.
            file.disable_fallocate();
        }
        UringStorage::with_file_storage(file, self)
    }
}

/// Which read opcode the kernel offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReadOpcode {
    /// `IORING_OP_READ` (Linux 5.6).
    Read,
    /// `IORING_OP_READV` (Linux 5.1), with a one-entry `iovec`.
    Readv,
}

/// What goes through the ring, after probing and the options.
#[derive(Debug, Clone, Copy)]
struct Caps {
    read: Option<ReadOpcode>,
    write: bool,
    fsync: bool,
    zero: bool,
    discard: bool,
    allocate: bool,
}

/// The storage's memory for one in-flight request. The kernel holds raw pointers into it from
/// submission to completion, so it lives in the request's slot for that whole time.
struct Owned {
    /// Bounce buffer: read into, or written from (empty for requests without data).
    buf: AlignedBuf,
    /// The one-entry `iovec` of `IORING_OP_READV` / `IORING_OP_WRITEV`, pointing into `buf`.
    iov: Option<Box<Iovec>>,
}

/// An `iovec` that may move between threads.
struct Iovec(libc::iovec);

// SAFETY: `libc::iovec` is `!Send` only because it holds a raw pointer. Ours always points into
// the `AlignedBuf` of the same `Owned` (a heap block with no thread affinity), and it is
// dereferenced only by the kernel, never by Rust code, so moving it to another thread is as
// safe as moving the buffer itself.
unsafe impl Send for Iovec {}

impl Owned {
    fn new(buf: AlignedBuf) -> Self {
        Owned { buf, iov: None }
    }

    fn empty() -> Self {
        Owned::new(AlignedBuf::empty())
    }
}

/// One request, as the ring sees it.
#[derive(Debug, Clone, Copy)]
enum Kind {
    /// Read `len` bytes at `offset` into the bounce buffer.
    Read {
        opcode: ReadOpcode,
        offset: u64,
        len: u32,
    },
    /// Write the first `len` bytes of the bounce buffer at `offset`.
    Writev { offset: u64, len: u32 },
    /// `fdatasync`.
    Fsync,
    /// `fallocate(mode, offset, len)`.
    Fallocate { offset: u64, len: u64, mode: i32 },
}

impl Kind {
    /// The submission entry for this request, pointing into `owned` (which must already be
    /// where it stays until completion: in its slot). Lengths are capped at the buffer's.
    fn entry(self, fd: RawFd, owned: &mut Owned) -> squeue::Entry {
        let fd = types::Fd(fd);
        match self {
            Kind::Read {
                opcode: ReadOpcode::Read,
                offset,
                len,
            } => {
                let len = capped(len, &owned.buf);
                opcode::Read::new(fd, owned.buf.as_mut_ptr(), len)
                    .offset(offset)
                    .build()
            }
            Kind::Read {
                opcode: ReadOpcode::Readv,
                offset,
                len,
            } => {
                let iov = iovec(owned, len);
                opcode::Readv::new(fd, iov, 1).offset(offset).build()
            }
            Kind::Writev { offset, len } => {
                let iov = iovec(owned, len);
                opcode::Writev::new(fd, iov, 1).offset(offset).build()
            }
            Kind::Fsync => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            Kind::Fallocate { offset, len, mode } => opcode::Fallocate::new(fd, len)
                .offset(offset)
                .mode(mode)
                .build(),
        }
    }
}

fn capped(len: u32, buf: &AlignedBuf) -> u32 {
    len.min(u32::try_from(buf.len()).unwrap_or(u32::MAX))
}

/// Points `owned.iov` at the first `len` bytes of `owned.buf` and returns its address.
fn iovec(owned: &mut Owned, len: u32) -> *const libc::iovec {
    let len = capped(len, &owned.buf) as usize;
    let base = owned.buf.as_mut_ptr().cast::<libc::c_void>();
    let iov = owned.iov.insert(Box::new(Iovec(libc::iovec {
        iov_base: base,
        iov_len: len,
    })));
    &iov.0
}

/// Where a slot's request stands.
enum SlotState {
    /// Submitted; this task wants to hear of the completion.
    Waiting(Waker),
    /// Completed with this result (bytes transferred, or a negated errno); the owning future
    /// has not collected it yet.
    Done(i32),
    /// Submitted, and the future that submitted it was dropped: free the slot (and its
    /// memory) when the completion arrives.
    Abandoned,
}

struct Slot {
    owned: Owned,
    state: SlotState,
    /// Left to the completion thread: its submitter found it unfinished after submitting
    /// (or dropped its future), so somebody must wait in the kernel for its completion.
    handed: bool,
}

/// The ring's bookkeeping, behind the mutex that also gives exclusive access to the ring's
/// submission and completion queues.
struct Driver {
    /// Indexed by `user_data`.
    slots: Vec<Option<Slot>>,
    /// Indices of empty slots.
    free: Vec<usize>,
    /// Tasks waiting for a free slot.
    waiting: Vec<Waker>,
    /// Set when the last handle is dropped: the completion thread ends once the kernel holds
    /// no slot's memory any more.
    shutdown: bool,
    /// Slots with `handed` set: while there are none, the completion thread sleeps on
    /// `Shared::armed` rather than in the kernel, where every completion would wake it (even
    /// those of requests the kernel finished inside the submitting call, which their tasks
    /// collect themselves).
    handed: usize,
    /// The completion thread waits on `Shared::armed`.
    parked: bool,
    /// With batched submission: a request is on the submission queue whose task yielded and
    /// will submit everything queued when polled again.
    submitter: bool,
}

impl Driver {
    fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Slots whose memory the kernel may still be using: submitted and not completed.
    fn kernel_busy(&self) -> usize {
        self.slots
            .iter()
            .flatten()
            .filter(|s| !matches!(s.state, SlotState::Done(_)))
            .count()
    }

    /// Empties slot `idx` and lets waiting tasks compete for it.
    fn release(&mut self, idx: usize, wake: &mut Vec<Waker>) -> Option<Slot> {
        let slot = self.slots.get_mut(idx)?.take()?;
        if slot.handed {
            self.handed -= 1;
        }
        self.free.push(idx);
        wake.append(&mut self.waiting);
        Some(slot)
    }
}

/// What the handles, the futures and the completion thread share.
struct Shared {
    // Field order matters for drop: the ring (and with it any kernel reference to the
    // buffers) goes before the file and the slots. `Drop for Shared` has already waited for
    // every request by then.
    ring: IoUring,
    driver: Mutex<Driver>,
    /// Wakes the completion thread when a request is handed to it (or at shutdown).
    armed: Condvar,
    /// The file, for its descriptor and as the fallback for everything not on the ring.
    file: FileStorage,
    fd: RawFd,
    caps: Caps,
    /// Whether FALLOC_FL_ZERO_RANGE, FALLOC_FL_PUNCH_HOLE and plain fallocate may work
    /// (cleared when the file system says they cannot).
    zero_range: AtomicBool,
    punch_hole: AtomicBool,
    reserve: AtomicBool,
    /// [`UringOptions::collect_inline_completions`].
    inline: bool,
    /// Batched submission ([`UringOptions::complete_on_runtime`]).
    batch: bool,
    /// A task on a tokio runtime waits for completions (the completion thread stays parked).
    reaper: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Driver> {
        // Nothing panics while the lock is held, so a poisoned lock still guards consistent
        // state.
        self.driver.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Collects every completion waiting in the queue. Tasks to wake go to `wake`, to be
    /// woken after the lock is released.
    fn reap(&self, d: &mut Driver, wake: &mut Vec<Waker>) {
        // SAFETY: `completion_shared` requires that no other `CompletionQueue` of this ring
        // exists. Every call in this module happens here, with the driver mutex held (`d` is
        // borrowed from its guard), and the queue is dropped before this function returns.
        let cq = unsafe { self.ring.completion_shared() };
        for cqe in cq {
            let user_data = cqe.user_data();
            if user_data == SHUTDOWN {
                continue;
            }
            let Ok(idx) = usize::try_from(user_data) else {
                continue;
            };
            let Some(Some(slot)) = d.slots.get_mut(idx) else {
                continue;
            };
            let handed = std::mem::take(&mut slot.handed);
            match std::mem::replace(&mut slot.state, SlotState::Done(cqe.result())) {
                SlotState::Waiting(w) => wake.push(w),
                SlotState::Abandoned => {
                    // The kernel is done with the memory and nobody wants the result.
                    d.release(idx, wake);
                }
                // One completion per request: cannot happen, and keeping the first result
                // is harmless.
                SlotState::Done(r) => slot.state = SlotState::Done(r),
            }
            if handed {
                d.handed -= 1;
            }
        }
    }

    /// Leaves slot `idx` to the completion thread, waking it if it sleeps.
    fn hand_over(&self, d: &mut Driver, idx: usize) {
        if let Some(Some(slot)) = d.slots.get_mut(idx) {
            // A completed request needs nobody to wait for it.
            if !slot.handed && !matches!(slot.state, SlotState::Done(_)) {
                slot.handed = true;
                d.handed += 1;
                if d.parked && !self.reaper.load(Ordering::Acquire) {
                    d.parked = false;
                    self.armed.notify_one();
                }
            }
        }
    }

    /// Submits whatever sits in the submission queue. If something stays unsubmitted (the
    /// kernel was short of memory, say), asks to be polled again to retry, so no entry is left
    /// behind while every task sleeps.
    fn submit(&self, d: &mut Driver, cx: &mut Context<'_>) {
        if self.ring.submit().is_err() || self.unsubmitted(d) > 0 {
            cx.waker().wake_by_ref();
        }
    }

    /// Entries in the submission queue the kernel has not consumed yet.
    fn unsubmitted(&self, _d: &mut Driver) -> usize {
        // SAFETY: `submission_shared` requires that no other `SubmissionQueue` of this ring
        // exists. Every call in this module happens with the driver mutex held (`_d` is
        // borrowed from its guard), and the queue is dropped at the end of this statement.
        unsafe { self.ring.submission_shared() }.len()
    }

    /// Puts `entry` on the submission queue; false when the queue is full.
    ///
    /// # Safety
    ///
    /// Every pointer in `entry` must stay valid (and its memory untouched by Rust code, for
    /// reads) until the completion with the entry's `user_data` has been reaped, and the
    /// entry's descriptor must stay open until then.
    unsafe fn push(&self, _d: &mut Driver, entry: &squeue::Entry) -> bool {
        // SAFETY: exclusivity of the submission queue as in `unsubmitted` (the driver mutex is
        // held: `_d` comes from its guard; the queue is dropped, publishing the new tail, at
        // the end of the block). Validity of the entry's memory is this function's
        // precondition, passed on to `push`.
        unsafe {
            let mut sq = self.ring.submission_shared();
            sq.push(entry).is_ok()
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Normally the completion thread has already seen every request complete. Should it
        // not have (it could not be started, say), wait here: the slots' memory must outlive
        // the kernel's use of it.
        let mut wake = Vec::new();
        loop {
            {
                let mut d = self.lock();
                self.reap(&mut d, &mut wake);
                if d.kernel_busy() == 0 {
                    return;
                }
            }
            if self.ring.submit_and_wait(1).is_err() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

/// The completion thread: reaps completions as they come and wakes their tasks, until the
/// storage is dropped and the kernel holds no slot's memory any more.
fn complete(shared: Arc<Shared>) {
    loop {
        let mut wake = Vec::new();
        let stop = {
            let mut d = shared.lock();
            loop {
                shared.reap(&mut d, &mut wake);
                let ours = d.handed > 0 && !shared.reaper.load(Ordering::Acquire);
                if d.shutdown || ours || !wake.is_empty() {
                    break;
                }
                // Nothing is left to us: sleep until a request is handed over or the storage
                // is dropped, instead of in the kernel.
                d.parked = true;
                d = shared.armed.wait(d).unwrap_or_else(|e| e.into_inner());
                d.parked = false;
            }
            d.shutdown && d.kernel_busy() == 0
        };
        let idle = wake.is_empty();
        wake.into_iter().for_each(Waker::wake);
        if stop {
            return;
        }
        if !idle {
            // Look again before sleeping in the kernel: the woken tasks may have handed
            // nothing more over.
            continue;
        }
        // Sleeps until at least one completion is in the queue (returns at once if one already
        // is), submitting anything left in the submission queue on the way.
        match shared.ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            // EBUSY/EAGAIN clear up as completions are reaped; anything else should not
            // happen on a valid ring. Either way, do not spin.
            Err(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

/// The ring's descriptor registered with the I/O driver of the tokio runtime current now, or
/// `None` without a runtime ([`UringOptions::complete_on_runtime`]).
fn runtime_watch(
    ring: &IoUring,
) -> std::io::Result<Option<(tokio::runtime::Handle, AsyncFd<OwnedFd>)>> {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return Ok(None);
    };
    // A descriptor of our own: the registration stays valid whatever happens to the ring's.
    let fd = ring.as_fd().try_clone_to_owned()?;
    let afd = {
        let _in = handle.enter();
        // SAFETY: `register_with_interest` requires the descriptor to stay open and refer to
        // the same file for the life of the `AsyncFd`; it is an `OwnedFd` that the `AsyncFd`
        // owns and closes only when dropped.
        unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
            .map_err(|e| e.into_parts().1)?
    };
    Ok(Some((handle, afd)))
}

/// The runtime task of [`UringOptions::complete_on_runtime`]: collects completions whenever
/// the ring's descriptor is readable and wakes their tasks, until the storage is dropped. If
/// the runtime drops it first, the completion thread takes over.
async fn reaper(weak: Weak<Shared>, afd: AsyncFd<OwnedFd>) {
    struct Handover(Weak<Shared>);
    impl Drop for Handover {
        fn drop(&mut self) {
            if let Some(shared) = self.0.upgrade() {
                shared.reaper.store(false, Ordering::Release);
                let mut d = shared.lock();
                if d.parked {
                    d.parked = false;
                    shared.armed.notify_one();
                }
            }
        }
    }
    let _handover = Handover(weak.clone());
    loop {
        let Ok(mut ready) = afd.readable().await else {
            return;
        };
        let Some(shared) = weak.upgrade() else {
            return;
        };
        let mut wake = Vec::new();
        let stop = {
            let mut d = shared.lock();
            shared.reap(&mut d, &mut wake);
            d.shutdown
        };
        wake.into_iter().for_each(Waker::wake);
        if stop {
            return;
        }
        // Keeps readiness that arrived since `readable` returned (tokio compares ticks).
        ready.clear_ready();
    }
}

/// The handle's owner: shuts the completion thread down when the last handle goes.
struct Owner {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        {
            let mut d = self.shared.lock();
            d.shutdown = true;
            self.shared.armed.notify_all();
            // Wake the completion thread from its wait with a no-op. Every queued entry
            // belongs to a slot and there are as many queue entries as slots, so after
            // submitting there is room unless the kernel refuses entries; then the
            // outstanding requests' completions wake the thread instead.
            let nop = opcode::Nop::new().build().user_data(SHUTDOWN);
            for _ in 0..3 {
                // SAFETY: a no-op carries no pointers and no descriptor.
                if unsafe { self.shared.push(&mut d, &nop) } {
                    break;
                }
                let _ = self.shared.ring.submit();
            }
            let _ = self.shared.ring.submit();
        }
        if let Some(t) = self.thread.take() {
            // A waker run on the completion thread could drop the last handle there; that
            // thread then ends by itself once nothing is in flight.
            if t.thread().id() != std::thread::current().id() {
                // Returns once every request still in flight (of cancelled futures) completed.
                let _ = t.join();
            }
        }
    }
}

/// A file or block device driven through Linux io_uring: reads, writes, `fdatasync` and
/// `fallocate` are submitted to a ring and complete asynchronously, many at once.
///
/// # Behaviour
///
/// The same as [`FileStorage`]'s in every respect the [`Storage`] contract covers (both pass
/// the same conformance suite): short transfers are continued, `EINTR` retried, capabilities
/// the file system lacks are learnt on first use (`write_zeroes` then writes zeros, `discard`
/// does nothing, `allocate` reserves nothing, each saying so), and with O_DIRECT, data
/// requests must be aligned to the probed alignments and misaligned ones fail with
/// [`StorageError::Misaligned`] (no read-modify-write is ever done, so concurrent requests
/// never race on a shared block).
///
/// Operations whose opcode the kernel lacks (probed at open), and `len`/`set_len`, run
/// synchronously through a [`FileStorage`] on the same file ([`uses_ring_for`] tells which).
///
/// # Requests, buffers and cancellation
///
/// The ring has [`entries`](UringStorage::entries) slots; each request takes one from
/// submission until its future collects the completion, and requests beyond that wait for a
/// free slot, so the completion queue never overflows. Reads and writes go through bounce
/// buffers owned by the slot (one copy per request; requests over 8 MiB are split), never
/// through the caller's buffer: the kernel only ever sees memory that stays alive until its
/// completion has been reaped, whatever happens to the future. A request the kernel cancels
/// (it does so when the thread that submitted it exits) is submitted again.
///
/// # Runtime
///
/// The futures are `Send` and need no particular executor: completions are collected by the
/// polled futures themselves and by one completion thread per storage, which wakes tasks
/// through their wakers (no thread per request). Dropping a future cancels nothing in the
/// kernel; its request runs to completion in the background and its slot and memory are freed
/// then.
///
/// # Dropping
///
/// Clones share the ring. Dropping the last one stops the completion thread, first waiting
/// for any request still in flight (only cancelled futures leave such requests), so it can
/// block for as long as those take.
///
/// [`uses_ring_for`]: UringStorage::uses_ring_for
#[derive(Clone)]
pub struct UringStorage {
    owner: Arc<Owner>,
}

impl fmt::Debug for UringStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.owner.shared;
        f.debug_struct("UringStorage")
            .field("file", &s.file)
            .field("entries", &self.entries())
            .field("caps", &s.caps)
            .finish_non_exhaustive()
    }
}

impl UringStorage {
    /// Opens `path` with `options` (see [`UringOptions::open`]).
    pub fn open(path: impl AsRef<Path>, options: &UringOptions) -> Result<Self> {
        options.open(path)
    }

    /// Options for opening a file.
    pub fn options() -> UringOptions {
        UringOptions::new()
    }

    fn with_file_storage(file: FileStorage, options: &UringOptions) -> Result<Self> {
        let unavailable = |source| StorageError::UringUnavailable { source };
        let ring = IoUring::builder()
            .dontfork()
            .setup_clamp()
            .build(options.entries.max(1))
            .map_err(unavailable)?;
        let mut probe = Probe::new();
        let probed = ring.submitter().register_probe(&mut probe).is_ok();
        // Kernels before 5.6 cannot be probed; every kernel with io_uring has READV, WRITEV
        // and FSYNC (5.1).
        let has = |code: u8, baseline: bool| {
            if probed {
                probe.is_supported(code)
            } else {
                baseline
            }
        };
        let wanted = |op: Op| !options.avoid.contains(&op);
        let read = if !wanted(Op::Read) {
            None
        } else if has(opcode::Read::CODE, false) {
            Some(ReadOpcode::Read)
        } else if has(opcode::Readv::CODE, true) {
            Some(ReadOpcode::Readv)
        } else {
            None
        };
        let fallocate = has(opcode::Fallocate::CODE, false);
        let caps = Caps {
            read,
            write: wanted(Op::Write) && has(opcode::Writev::CODE, true),
            fsync: wanted(Op::Flush) && has(opcode::Fsync::CODE, true),
            zero: wanted(Op::WriteZeroes) && fallocate,
            discard: wanted(Op::Discard) && fallocate,
            allocate: wanted(Op::Allocate) && fallocate,
        };
        let entries = ring.params().sq_entries() as usize;
        let fd = file.file().as_raw_fd();
        let watch = if options.runtime {
            runtime_watch(&ring).map_err(unavailable)?
        } else {
            None
        };
        let shared = Arc::new(Shared {
            ring,
            driver: Mutex::new(Driver {
                slots: (0..entries).map(|_| None).collect(),
                free: (0..entries).rev().collect(),
                waiting: Vec::new(),
                shutdown: false,
                handed: 0,
                parked: false,
                submitter: false,
            }),
            armed: Condvar::new(),
            file,
            fd,
            caps,
            zero_range: AtomicBool::new(options.fallocate),
            punch_hole: AtomicBool::new(options.fallocate),
            reserve: AtomicBool::new(options.fallocate),
            inline: options.inline,
            batch: watch.is_some(),
            reaper: AtomicBool::new(watch.is_some()),
        });
        if let Some((handle, afd)) = watch {
            handle.spawn(reaper(Arc::downgrade(&shared), afd));
        }
        let for_thread = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("qimg-uring".into())
            .spawn(move || complete(for_thread))
            .map_err(unavailable)?;
        Ok(UringStorage {
            owner: Arc::new(Owner {
                shared,
                thread: Some(thread),
            }),
        })
    }

    fn shared(&self) -> &Shared {
        &self.owner.shared
    }

    /// The ring size: the most requests in flight at once.
    pub fn entries(&self) -> usize {
        self.shared().lock().slots.len()
    }

    /// Requests holding a ring slot right now: submitted, or completed but not yet collected by
    /// their future (or, for cancelled futures, not yet completed).
    pub fn in_flight(&self) -> usize {
        self.shared().lock().in_flight()
    }

    /// Whether `op` is submitted to the ring (`true`) or runs through the synchronous
    /// [`FileStorage`] fallback (`false`): because the kernel lacks the opcode, because of
    /// [`UringOptions::fallback_for`], or because the operation never uses the ring
    /// ([`Op::Len`], [`Op::SetLen`]).
    pub fn uses_ring_for(&self, op: Op) -> bool {
        let c = &self.shared().caps;
        match op {
            Op::Read => c.read.is_some(),
            Op::Write => c.write,
            Op::Flush => c.fsync,
            Op::WriteZeroes => c.zero,
            Op::Discard => c.discard,
            Op::Allocate => c.allocate,
            Op::Len | Op::SetLen | Op::Probe => false,
        }
    }

    /// Whether modifications are refused (the file was opened read-only).
    pub fn is_read_only(&self) -> bool {
        self.shared().file.is_read_only()
    }

    /// Whether the file was opened with O_DIRECT.
    pub fn is_direct(&self) -> bool {
        self.shared().file.is_direct()
    }

    /// The open file.
    pub fn file(&self) -> &File {
        self.shared().file.file()
    }

    fn writable(&self, op: Op, offset: u64, len: u64) -> Result<()> {
        if self.is_read_only() {
            return Err(StorageError::ReadOnly { op, offset, len });
        }
        Ok(())
    }

    fn aligned<'b>(
        &self,
        op: Op,
        offset: u64,
        len: u64,
        bufs: impl IntoIterator<Item = &'b [u8]>,
    ) -> Result<()> {
        if !self.is_direct() {
            return Ok(());
        }
        check_aligned(
            op,
            offset,
            len,
            bufs.into_iter().map(|b| (b.as_ptr() as usize, b.len())),
            self.request_alignment(),
            self.mem_alignment(),
        )
    }

    /// Submits one request and waits for its completion: the result (bytes, or a negated
    /// errno) and the buffer back.
    fn submit(&self, kind: Kind, buf: AlignedBuf) -> Request<'_> {
        Request {
            shared: self.shared(),
            stage: Stage::Queued(kind, Owned::new(buf)),
        }
    }

    /// A bounce buffer for `len` bytes of a request.
    fn bounce(&self, op: Op, offset: u64, len: u64) -> Result<AlignedBuf> {
        let size = usize::try_from(len).unwrap_or(CHUNK).min(CHUNK);
        AlignedBuf::zeroed(size, self.mem_alignment().max(1)).ok_or(StorageError::OutOfRange {
            op,
            offset,
            len,
        })
    }

    async fn ring_read(&self, opcode: ReadOpcode, buf: &mut [u8], offset: u64) -> Result<usize> {
        let len = buf.len() as u64;
        let mut bounce = self.bounce(Op::Read, offset, len)?;
        let mut done = 0usize;
        while done < buf.len() {
            let want = (buf.len() - done).min(bounce.len());
            let kind = Kind::Read {
                opcode,
                offset: offset + done as u64,
                len: want as u32,
            };
            let c = self.submit(kind, bounce).await;
            bounce = c.owned.buf;
            match c.result {
                0 => break,
                n if n > 0 => {
                    let n = (n as usize).min(want);
                    buf[done..done + n].copy_from_slice(&bounce[..n]);
                    done += n;
                    // As in FileStorage: with O_DIRECT only the end of the file gives a short
                    // read that is not a multiple of the block size.
                    if self.is_direct() && done % self.request_alignment() != 0 {
                        break;
                    }
                }
                e if retryable(e) => {}
                e => return Err(StorageError::io(Op::Read, offset, len, errno(e))),
            }
        }
        Ok(done)
    }

    /// Writes `len` bytes at `offset` through the ring: the concatenation of `data`, or zeros.
    async fn ring_write(
        &self,
        op: Op,
        data: Option<&[IoSlice<'_>]>,
        offset: u64,
        len: u64,
    ) -> Result<()> {
        let mut bounce = self.bounce(op, offset, len)?;
        let mut pos = 0u64;
        while pos < len {
            let n = (len - pos).min(bounce.len() as u64) as usize;
            if let Some(data) = data {
                // `pos` is below the total length of `data`, which fits in memory.
                gather(data, pos as usize, &mut bounce[..n]);
            }
            let kind = Kind::Writev {
                offset: offset + pos,
                len: n as u32,
            };
            let c = self.submit(kind, bounce).await;
            bounce = c.owned.buf;
            match c.result {
                0 => {
                    return Err(StorageError::io(
                        op,
                        offset,
                        len,
                        std::io::Error::from(std::io::ErrorKind::WriteZero),
                    ));
                }
                k if k > 0 => pos += (k as u64).min(n as u64),
                e if retryable(e) => {}
                e => return Err(StorageError::io(op, offset, len, errno(e))),
            }
        }
        Ok(())
    }

    /// Runs fallocate on the ring, retrying as [`retryable`] says.
    async fn ring_fallocate(
        &self,
        mode: FallocateFlags,
        offset: u64,
        len: u64,
    ) -> Result<(), Errno> {
        loop {
            let kind = Kind::Fallocate {
                offset,
                len,
                mode: mode.bits(),
            };
            let c = self.submit(kind, Owned::empty().buf).await;
            match c.result {
                r if r >= 0 => return Ok(()),
                r if retryable(r) => {}
                r => return Err(errno(r)),
            }
        }
    }
}

/// A negated errno from a completion as an [`Errno`].
fn errno(result: i32) -> Errno {
    Errno::from_raw(result.saturating_neg())
}

/// Results after which the request is simply submitted again: interrupted, try again, and
/// cancelled (the kernel cancels a thread's requests when the thread exits, and a future may
/// have been polled last on a thread that has gone since). Every request here is positional
/// and idempotent, so repeating it is safe.
fn retryable(result: i32) -> bool {
    result == -libc::EINTR || result == -libc::EAGAIN || result == -libc::ECANCELED
}

fn unsupported(e: Errno) -> bool {
    matches!(e, Errno::EOPNOTSUPP | Errno::ENOSYS)
}

/// Copies the bytes of the concatenation of `data` starting at `skip` into `out` (as many as
/// fit; the caller asks for no more than there are).
fn gather(data: &[IoSlice<'_>], mut skip: usize, out: &mut [u8]) {
    let mut at = 0;
    for seg in data {
        if at == out.len() {
            break;
        }
        if skip >= seg.len() {
            skip -= seg.len();
            continue;
        }
        let n = (seg.len() - skip).min(out.len() - at);
        out[at..at + n].copy_from_slice(&seg[skip..skip + n]);
        at += n;
        skip = 0;
    }
}

/// A completed request: its result and its memory, back from the slot.
struct Completion {
    result: i32,
    owned: Owned,
}

enum Stage {
    /// Not submitted yet (no free slot so far).
    Queued(Kind, Owned),
    /// On the submission queue in this slot, which this future submits (with whatever else
    /// is queued) when polled again: it yielded so that other tasks can queue theirs.
    Yielded(usize),
    /// On the submission queue in this slot; `poll` submits it after releasing the lock.
    Submit(usize),
    /// Submitted in this slot.
    InFlight(usize),
    /// Completed and collected.
    Finished,
}

/// The future of one ring request.
struct Request<'a> {
    shared: &'a Shared,
    stage: Stage,
}

impl Request<'_> {
    /// One step of the request, with the driver locked.
    fn step(
        &mut self,
        d: &mut Driver,
        cx: &mut Context<'_>,
        wake: &mut Vec<Waker>,
    ) -> Poll<Completion> {
        let shared = self.shared;
        match std::mem::replace(&mut self.stage, Stage::Finished) {
            Stage::Queued(kind, owned) => {
                let Some(idx) = d.free.pop() else {
                    if !d.waiting.iter().any(|w| w.will_wake(cx.waker())) {
                        d.waiting.push(cx.waker().clone());
                    }
                    self.stage = Stage::Queued(kind, owned);
                    return Poll::Pending;
                };
                let slot = d.slots[idx].insert(Slot {
                    owned,
                    state: SlotState::Waiting(cx.waker().clone()),
                    handed: false,
                });
                // The entry points into the slot's memory, which stays put from here on.
                let entry = kind.entry(shared.fd, &mut slot.owned).user_data(idx as u64);
                // SAFETY: the entry's pointers (the bounce buffer and the iovec, with lengths
                // capped at the buffer's) point into the heap blocks of `slots[idx].owned`.
                // That slot is emptied only (a) by this future after the completion for
                // `user_data == idx` was reaped (`Done`), (b) by `reap` on that completion if
                // this future was dropped (`Abandoned`); and (c) the ring and the slots are
                // dropped only after the completion thread and `Drop for Shared` saw no slot
                // left with the kernel (`kernel_busy() == 0`). Moving `Owned`
                // into the slot moved no heap block, and nothing touches them until then. The
                // descriptor belongs to `shared.file`, which lives as long as the ring.
                if !unsafe { shared.push(d, &entry) } {
                    // Queue full (entries that failed to submit earlier): the kernel never saw
                    // this entry, so the memory is ours again. Try again shortly.
                    let owned = d
                        .release(idx, wake)
                        .map(|s| s.owned)
                        .unwrap_or_else(Owned::empty);
                    self.stage = Stage::Queued(kind, owned);
                    let _ = shared.ring.submit();
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                if shared.batch {
                    if d.submitter {
                        // Another task submits the queue soon.
                        self.stage = Stage::InFlight(idx);
                        shared.hand_over(d, idx);
                    } else {
                        d.submitter = true;
                        self.stage = Stage::Yielded(idx);
                        cx.waker().wake_by_ref();
                    }
                    return Poll::Pending;
                }
                // Submitted by `poll` once the driver lock is released: the system call
                // (which, for page-cache hits, does the whole transfer) must not hold up the
                // other tasks and the completion thread.
                self.stage = Stage::Submit(idx);
                Poll::Pending
            }
            Stage::Yielded(idx) => {
                // The batch is whatever is queued now; requests queued from here on start
                // the next one.
                d.submitter = false;
                self.stage = Stage::Submit(idx);
                Poll::Pending
            }
            // Only `poll` sees this stage (it submits and moves on to `InFlight`).
            Stage::Submit(idx) => {
                self.stage = Stage::InFlight(idx);
                self.step(d, cx, wake)
            }
            Stage::InFlight(idx) => {
                let state = d
                    .slots
                    .get_mut(idx)
                    .and_then(|s| s.as_mut())
                    .map(|s| &mut s.state);
                match state {
                    Some(SlotState::Done(result)) => {
                        let result = *result;
                        let owned = d
                            .release(idx, wake)
                            .map(|s| s.owned)
                            .unwrap_or_else(Owned::empty);
                        Poll::Ready(Completion { result, owned })
                    }
                    Some(SlotState::Waiting(w)) => {
                        if !w.will_wake(cx.waker()) {
                            *w = cx.waker().clone();
                        }
                        self.stage = Stage::InFlight(idx);
                        if !d.submitter && shared.unsubmitted(d) > 0 {
                            shared.submit(d, cx);
                        }
                        Poll::Pending
                    }
                    // Only this future empties or abandons its slot, so neither can happen;
                    // report an I/O error rather than panic.
                    Some(SlotState::Abandoned) | None => Poll::Ready(Completion {
                        result: -libc::EIO,
                        owned: Owned::empty(),
                    }),
                }
            }
            // Polled after completion.
            Stage::Finished => Poll::Ready(Completion {
                result: -libc::EIO,
                owned: Owned::empty(),
            }),
        }
    }
}

impl Future for Request<'_> {
    type Output = Completion;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Completion> {
        let this = self.get_mut();
        let mut wake = Vec::new();
        let mut out = {
            let mut d = this.shared.lock();
            this.shared.reap(&mut d, &mut wake);
            this.step(&mut d, cx, &mut wake)
        };
        if let Stage::Submit(idx) = this.stage {
            this.stage = Stage::InFlight(idx);
            out = this.submitted(idx, cx, &mut wake);
        }
        // Woken outside the lock, so a waker that polls inline cannot deadlock.
        wake.into_iter().for_each(Waker::wake);
        out
    }
}

impl Request<'_> {
    /// Submits the queue (without the driver lock, which the system call does not need: the
    /// entry is already published) and hands the request to the completion thread. With
    /// [`UringOptions::collect_inline_completions`] it first collects the completion if the
    /// kernel finished the request inside the call, as it does for reads and writes served by
    /// the page cache; the task then goes on at once instead of sleeping until the
    /// completion thread wakes it.
    fn submitted(
        &mut self,
        idx: usize,
        cx: &mut Context<'_>,
        wake: &mut Vec<Waker>,
    ) -> Poll<Completion> {
        let shared = self.shared;
        let failed = shared.ring.submit().is_err();
        let mut d = shared.lock();
        if !shared.inline {
            // Another task's submission may have taken this entry along, and a poll
            // elsewhere collected its completion already (waking this task, which is
            // running now): then it is finished.
            let done = matches!(
                d.slots.get(idx),
                Some(Some(Slot {
                    state: SlotState::Done(_),
                    ..
                }))
            );
            if done {
                return self.step(&mut d, cx, wake);
            }
            if failed || shared.unsubmitted(&mut d) > 0 {
                cx.waker().wake_by_ref();
            }
            shared.hand_over(&mut d, idx);
            return Poll::Pending;
        }
        // Reaping our own completion must not wake this task (it is running and collects
        // the result now); other tasks' completions are woken as usual.
        let mine = match d.slots.get_mut(idx).and_then(|s| s.as_mut()) {
            Some(Slot {
                state: SlotState::Waiting(w),
                ..
            }) => Some(std::mem::replace(w, Waker::noop().clone())),
            _ => None,
        };
        shared.reap(&mut d, wake);
        if let Some(Some(Slot {
            state: SlotState::Waiting(w),
            ..
        })) = d.slots.get_mut(idx)
        {
            // Still with the kernel: wait for the completion with the real waker.
            if let Some(real) = mine {
                *w = real;
            } else if !w.will_wake(cx.waker()) {
                *w = cx.waker().clone();
            }
            if failed || shared.unsubmitted(&mut d) > 0 {
                // Not (all) submitted: try again on the next poll.
                cx.waker().wake_by_ref();
            }
            shared.hand_over(&mut d, idx);
            return Poll::Pending;
        }
        self.step(&mut d, cx, wake)
    }
}

impl Drop for Request<'_> {
    fn drop(&mut self) {
        let (Stage::InFlight(idx) | Stage::Submit(idx) | Stage::Yielded(idx)) = self.stage else {
            return;
        };
        let mut wake = Vec::new();
        let unsubmitted = matches!(self.stage, Stage::Submit(_) | Stage::Yielded(_));
        if unsubmitted {
            // The batch (or this request) is on the queue: submit it before letting go.
            if matches!(self.stage, Stage::Yielded(_)) {
                self.shared.lock().submitter = false;
            }
            let _ = self.shared.ring.submit();
        }
        {
            let mut d = self.shared.lock();
            let done = match d.slots.get_mut(idx).and_then(|s| s.as_mut()) {
                Some(slot) => match slot.state {
                    SlotState::Done(_) => true,
                    // The kernel may still be using the memory: leave it to `reap`.
                    _ => {
                        slot.state = SlotState::Abandoned;
                        false
                    }
                },
                None => false,
            };
            if !done {
                self.shared.hand_over(&mut d, idx);
            }
            if done {
                // Completed: the kernel is finished with the memory.
                drop(d.release(idx, &mut wake));
            }
        }
        wake.into_iter().for_each(Waker::wake);
    }
}

impl AsFd for UringStorage {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file().as_fd()
    }
}

impl Storage for UringStorage {
    async fn read_at_most(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let len = buf.len() as u64;
        range_end(Op::Read, offset, len)?;
        self.aligned(Op::Read, offset, len, [&*buf])?;
        if buf.is_empty() {
            return Ok(0);
        }
        match self.shared().caps.read {
            Some(opcode) => self.ring_read(opcode, buf, offset).await,
            None => self.shared().file.read_at_most(buf, offset).await,
        }
    }

    async fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        range_end(Op::Write, offset, len)?;
        self.writable(Op::Write, offset, len)?;
        self.aligned(Op::Write, offset, len, [buf])?;
        if buf.is_empty() {
            return Ok(());
        }
        if !self.shared().caps.write {
            return self.shared().file.write_at(buf, offset).await;
        }
        self.ring_write(Op::Write, Some(&[IoSlice::new(buf)]), offset, len)
            .await
    }

    async fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> Result<()> {
        let len = total_len(Op::Write, bufs, offset)?;
        range_end(Op::Write, offset, len)?;
        self.writable(Op::Write, offset, len)?;
        self.aligned(Op::Write, offset, len, bufs.iter().map(|b| &**b))?;
        if len == 0 {
            return Ok(());
        }
        if !self.shared().caps.write {
            return self.shared().file.write_vectored_at(bufs, offset).await;
        }
        self.ring_write(Op::Write, Some(bufs), offset, len).await
    }

    async fn write_zeroes(&self, offset: u64, len: u64) -> Result<ZeroOutcome> {
        range_end(Op::WriteZeroes, offset, len)?;
        self.writable(Op::WriteZeroes, offset, len)?;
        self.aligned(Op::WriteZeroes, offset, len, [])?;
        if len == 0 {
            return Ok(ZeroOutcome::Efficient);
        }
        let s = self.shared();
        if !s.caps.zero {
            return s.file.write_zeroes(offset, len).await;
        }
        if s.zero_range.load(Ordering::Relaxed) {
            match self
                .ring_fallocate(FallocateFlags::FALLOC_FL_ZERO_RANGE, offset, len)
                .await
            {
                Ok(()) => return Ok(ZeroOutcome::Efficient),
                Err(e) if unsupported(e) => s.zero_range.store(false, Ordering::Relaxed),
                // Some file systems and devices refuse particular ranges; writing works.
                Err(Errno::EINVAL) => {}
                Err(e) => return Err(StorageError::io(Op::WriteZeroes, offset, len, e)),
            }
        }
        if s.caps.write {
            self.ring_write(Op::WriteZeroes, None, offset, len).await?;
            Ok(ZeroOutcome::Written)
        } else {
            s.file.write_zeroes(offset, len).await
        }
    }

    async fn discard(&self, offset: u64, len: u64) -> Result<DiscardOutcome> {
        range_end(Op::Discard, offset, len)?;
        self.writable(Op::Discard, offset, len)?;
        let s = self.shared();
        if !s.caps.discard {
            return s.file.discard(offset, len).await;
        }
        if len == 0 {
            return Ok(DiscardOutcome::Deallocated);
        }
        if !s.punch_hole.load(Ordering::Relaxed) {
            return Ok(DiscardOutcome::Ignored);
        }
        let mode = FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE;
        match self.ring_fallocate(mode, offset, len).await {
            Ok(()) => Ok(DiscardOutcome::Deallocated),
            Err(e) if unsupported(e) => {
                s.punch_hole.store(false, Ordering::Relaxed);
                Ok(DiscardOutcome::Ignored)
            }
            Err(Errno::EINVAL) => Ok(DiscardOutcome::Ignored),
            Err(e) => Err(StorageError::io(Op::Discard, offset, len, e)),
        }
    }

    async fn allocate(&self, offset: u64, len: u64) -> Result<AllocateOutcome> {
        range_end(Op::Allocate, offset, len)?;
        self.writable(Op::Allocate, offset, len)?;
        let s = self.shared();
        if !s.caps.allocate {
            return s.file.allocate(offset, len).await;
        }
        if len == 0 || !s.reserve.load(Ordering::Relaxed) {
            return Ok(AllocateOutcome::NotReserved);
        }
        match self
            .ring_fallocate(FallocateFlags::empty(), offset, len)
            .await
        {
            Ok(()) => Ok(AllocateOutcome::Reserved),
            Err(e) if unsupported(e) => {
                s.reserve.store(false, Ordering::Relaxed);
                Ok(AllocateOutcome::NotReserved)
            }
            Err(e) => Err(StorageError::io(Op::Allocate, offset, len, e)),
        }
    }

    async fn flush(&self) -> Result<()> {
        let file = &self.shared().file;
        if !self.shared().caps.fsync {
            return file.flush().await;
        }
        // A failed fsync poisons the file for later flushes, as with `FileStorage` (shared).
        file.refuse_flush_after_failure()?;
        loop {
            let c = self.submit(Kind::Fsync, Owned::empty().buf).await;
            match c.result {
                r if r >= 0 => return Ok(()),
                r if retryable(r) => {}
                r => {
                    let e = StorageError::io(Op::Flush, 0, 0, errno(r));
                    return Err(file.flush_failure(e));
                }
            }
        }
    }

    async fn len(&self) -> Result<u64> {
        self.shared().file.len().await
    }

    async fn set_len(&self, len: u64) -> Result<()> {
        self.shared().file.set_len(len).await
    }

    fn request_alignment(&self) -> usize {
        self.shared().file.request_alignment()
    }

    fn mem_alignment(&self) -> usize {
        self.shared().file.mem_alignment()
    }
}

/// The conformance suite and a concurrency and cancellation stress with
/// [`UringOptions::collect_inline_completions`] and [`UringOptions::complete_on_runtime`] on
/// (the integration tests in `tests/uring.rs` cover the defaults), and the completion thread
/// taking over when the runtime that waited for completions is gone.
#[cfg(all(test, feature = "conformance"))]
mod option_tests {
    use std::sync::atomic::AtomicU32;

    use super::*;
    use crate::conformance::run_all;

    /// Inline collection, completion on the runtime, both.
    const MODES: [(bool, bool); 3] = [(true, false), (false, true), (true, true)];

    fn options(direct: bool, (inline, runtime): (bool, bool)) -> UringOptions {
        UringOptions::new()
            .read_write(true)
            .create_new(true)
            .direct(direct)
            .collect_inline_completions(inline)
            .complete_on_runtime(runtime)
    }

    /// A fresh file in `dir`, or `None` where io_uring or O_DIRECT is unavailable.
    fn make(dir: &tempfile::TempDir, direct: bool, mode: (bool, bool)) -> Option<UringStorage> {
        static N: AtomicU32 = AtomicU32::new(0);
        let path = dir
            .path()
            .join(format!("i{}", N.fetch_add(1, Ordering::Relaxed)));
        match options(direct, mode).open(&path) {
            Ok(s) => Some(s),
            Err(e) => {
                println!("skipped (direct {direct}): {e}");
                None
            }
        }
    }

    async fn conformance() {
        let dir = tempfile::tempdir().unwrap();
        for mode in MODES {
            for direct in [false, true] {
                if make(&dir, direct, mode).is_none() {
                    continue;
                }
                run_all(|| make(&dir, direct, mode).expect("opened once already")).await;
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn conformance_with_options_multi_thread() {
        conformance().await;
    }

    #[tokio::test(flavor = "current_thread")]
    async fn conformance_with_options_current_thread() {
        conformance().await;
    }

    async fn stress() {
        let dir = tempfile::tempdir().unwrap();
        for mode in MODES {
            for direct in [false, true] {
                let Some(s) = make(&dir, direct, mode) else {
                    continue;
                };
                let s = Arc::new(s);
                let block = 4096usize;
                let tasks: Vec<_> = (0..48u64)
                    .map(|t| {
                        let s = Arc::clone(&s);
                        tokio::spawn(async move {
                            let mut back = AlignedBuf::zeroed(block, 4096).unwrap();
                            for round in 0..50u64 {
                                let mut v = AlignedBuf::zeroed(block, 4096).unwrap();
                                v.fill((t * 7 + round) as u8);
                                let at = (t * 4 + round % 4) * block as u64;
                                s.write_at(&v, at).await.unwrap();
                                s.read_at(&mut back, at).await.unwrap();
                                assert!(*back == *v, "task {t} round {round} mode {mode:?}");
                                if round % 10 == 9 {
                                    // Dropped after one poll: queued (possibly as the task
                                    // that submits a batch), in flight, or collected.
                                    let mut r = Box::pin(s.read_at(&mut back, at));
                                    let w = Waker::noop();
                                    let _ = r.as_mut().poll(&mut Context::from_waker(w));
                                }
                            }
                        })
                    })
                    .collect();
                for t in tasks {
                    t.await.unwrap();
                }
                s.flush().await.unwrap();
                for _ in 0..2000 {
                    if s.in_flight() == 0 {
                        break;
                    }
                    tokio::task::yield_now().await;
                    std::thread::sleep(Duration::from_millis(1));
                }
                assert_eq!(s.in_flight(), 0, "direct {direct} mode {mode:?}");
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_tasks_and_cancelled_requests_multi_thread() {
        stress().await;
    }

    #[tokio::test(flavor = "current_thread")]
    async fn many_tasks_and_cancelled_requests_current_thread() {
        stress().await;
    }

    /// Opened on one runtime, which then goes away: the completion thread takes over, and
    /// requests from another runtime (or none) complete.
    #[test]
    fn the_completion_thread_takes_over_from_a_dropped_runtime() {
        let dir = tempfile::tempdir().unwrap();
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let Some(s) = first.block_on(async { make(&dir, false, (false, true)) }) else {
            return;
        };
        assert!(s.shared().reaper.load(Ordering::Acquire));
        let data = vec![7u8; 10000];
        first.block_on(s.write_at(&data, 0)).unwrap();
        drop(first);
        assert!(!s.shared().reaper.load(Ordering::Acquire));
        let second = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let s = Arc::new(s);
        let s2 = Arc::clone(&s);
        second
            .block_on(async move {
                tokio::spawn(async move {
                    let mut back = vec![0u8; 10000];
                    s2.read_at(&mut back, 0).await.unwrap();
                    assert!(back.iter().all(|&b| b == 7));
                    s2.write_at(&[1u8; 4096], 4096).await.unwrap();
                    s2.flush().await.unwrap();
                })
                .await
            })
            .unwrap();
        // And with no runtime at all.
        let mut back = vec![0u8; 4096];
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        let mut f = Box::pin(s.read_at(&mut back, 4096));
        let r = loop {
            if let Poll::Ready(r) = f.as_mut().poll(&mut cx) {
                break r;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        drop(f);
        r.unwrap();
        assert!(back.iter().all(|&b| b == 1));
    }
}

//! [`Queue`]: a per-queue completion handle for VMMs that run their own event loops.
//!
//! A VMM serves each guest queue (virtqueue) from its own thread: it takes requests off the
//! queue, submits them to the disk with a `user_data`, sleeps in `epoll` until an eventfd says
//! that something completed, and collects the completions. [`Image::queue`] gives it a
//! [`Queue`] made for that loop:
//!
//! * each queue has its own io_uring ring (depth chosen by the caller) and an eventfd (the
//!   caller's or one the queue owns) that the kernel signals for every completion; a queue
//!   on storage without a descriptor (memory, an NBD export, error injection), or where
//!   io_uring is refused (`ENOSYS`, `EPERM`), has no ring ([`QueueStats::ring`]) and runs
//!   every request on its engine thread, completing it on the same eventfd;
//! * [`Queue::submit`] takes a [`Request`] and a `user_data`; [`Queue::next_completed`] returns
//!   [`Completion`]s in the caller's thread;
//! * a read or write whose place in the image is known without metadata I/O (its L2 slice is
//!   cached, and a write lands in place on an allocated subcluster) goes from the caller's
//!   thread straight to the ring, with the caller's memory ([`IoBuffers`]) handed to the kernel
//!   as it is when it is aligned for `O_DIRECT` (no copy, no allocation of data buffers);
//!   zero and unallocated ranges are filled in place;
//! * so does a write that allocates without copying anything (whole subclusters on extended
//!   L2, whole clusters otherwise) when its L2 slice and refcount block are cached and the new
//!   cluster lies in space already reserved: the cluster is allocated in the cached refcount
//!   block in the caller's thread, the data goes from the caller's memory to the ring, and the
//!   new entry is linked when the data is on disk, before the completion is returned (on the
//!   engine thread if linking then needs metadata I/O). Allocations past the end of the file
//!   reserve space 32 MiB (at least 64 clusters) ahead, the next step as soon as less than a
//!   step is left;
//! * so does a write inside one cluster that must copy on write (a partly written subcluster
//!   on extended L2, a new cluster on standard L2) from zeros or a raw backing file, under
//!   the same conditions: the queue reads the bytes around the caller's on its own ring into
//!   a bounce buffer that holds the caller's too, writes the whole range at once and links
//!   it when it is on disk ([`QueueStats::cow`]);
//! * a request that would go direct but for an L2 slice not cached waits while the queue
//!   reads the slice on its own ring (when no other thread is loading it and the cache can
//!   take it without writing a dirty slice back), then goes direct (the caller's loop sees
//!   the slice's completion on the eventfd like any other; nobody else waits for it: other
//!   requests for that slice load it on the engine, which supersedes the queue's load);
//! * everything else (other copy-on-write, the other slice misses, backing-file reads,
//!   compressed clusters, unaligned `O_DIRECT` requests, flush, write-zeroes, discard) runs on
//!   the engine on a thread of the queue's own, and its completion is posted to the same
//!   eventfd: the caller's loop never blocks on it.
//!
//! Requests on one queue or several run concurrently; overlapping ones are ordered by the
//! engine's cluster range locks, which direct requests hold until their completion is
//! collected. Completions arrive in any order, also for overlapping requests in flight
//! together (as with a disk: a caller that needs one before the other waits for the first
//! completion before submitting the second). A flush covers every write completed before it
//! was submitted.
//!
//! ## Mapping onto a ring-per-queue VMM disk interface
//!
//! cloud-hypervisor's `AsyncIo` trait (one object per virtqueue) maps one to one. The crate
//! `examples/vmm-adapter` implements a stand-in of it on `Queue` in 150 lines, without a
//! table of requests beside the queue or a second handle; its tests run it from two
//! virtqueue threads against a model and check this table against its code, so that the two
//! cannot drift apart.
//!
//! | `AsyncIo` | `Queue` |
//! |---|---|
//! | `notifier()` | the VMM's `EventFd`, signalled through a duplicate: [`QueueOptions::eventfd_of`] |
//! | `read_vectored(op, user_data)` | `submit(Request::Read { offset, buffers }, user_data)` where `buffers` is `unsafe { IoBuffers::from_raw_owned(&iovecs, op) }`: the VMM's operation rides along and comes back with the completion, or with the refusal ([`Refused`]) |
//! | `write_vectored(op, user_data)` | `submit(Request::Write { offset, buffers }, user_data)`, the same way |
//! | `fsync(Some(user_data))` | `submit(Request::Flush, user_data)` |
//! | `fsync(None)` (write-through, done on return) | [`Queue::flush_blocking`] |
//! | `write_zeroes(offset, len, user_data)` | `Request::WriteZeroes { offset, len, unmap }` with `unmap: false` (reads zeros, space kept) |
//! | `punch_hole(offset, len, user_data)` | `Request::WriteZeroes { offset, len, unmap }` with `unmap: true`: the VMM sends discards and write-zeroes with unmap there, which must read zeros; [`Request::Discard`] leaves parts smaller than a subcluster unchanged |
//! | `submit_batch_requests(batch)` | [`Queue::submit_batch`] (one `io_uring_enter` for the batch; all or nothing: [`BatchRefused`] hands every request back) |
//! | `next_completed_request()` | [`Queue::next_completed`]; the operation comes back from the completion's buffers with [`IoBuffers::take_owner`], and `raw_result()` is the VMM's result |
//!
//! The example `examples/epoll_queue.rs` runs queues from plain `epoll` loops without any
//! async runtime in those threads.
//!
//! ## Threads and system calls (for seccomp filters)
//!
//! [`Image::queue`] starts one thread, `qimg-queue`, which runs the queue's engine work; it
//! and the image's own threads (the io_uring completion thread `qimg-uring` per file, the
//! clean timer `qimg-clean` when enabled) are qimg's, created before the call returns. The
//! whole list, and a start hook every one of them calls first (where a VMM applies its own
//! filter to them), is in [`qimg_io::threads`].
//! On the caller's thread, [`Queue::submit`], [`Queue::submit_batch`],
//! [`Queue::next_completed`], [`Queue::wait`] and [`Queue::flush_blocking`] make only these
//! system calls: `io_uring_enter` (the queue's ring), `poll`/`ppoll` (waiting),
//! `read`/`write` (the eventfd), `futex` (handing work to the engine thread and waiting for
//! it), and memory management (`mmap`, `munmap`, `mremap`, `madvise`, `brk`) when buffers
//! are allocated; there is no spin that yields to the scheduler. The test
//! `a_queue_runs_under_a_seccomp_filter_of_the_documented_system_calls` runs direct reads,
//! writes and a blocking flush under a `seccompiler` filter of exactly that list.

mod cow;
mod direct;
mod fast;
mod loads;
mod own_ring;
mod request;
mod ring;
mod worker;

use self::request::InFlightIds;
pub use self::request::{BatchRefused, Completion, QueueOptions, QueueStats, Refused, Request};

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use qimg_io::queue::{IoBuffers, Notifier, RingCompletion};
use qimg_io::{AlignedBuf, Storage};

use self::cow::CowIo;
use self::fast::Part;
use self::loads::SliceLoad;
use self::own_ring::OwnRing;
use self::worker::Worker;
use super::image::{Image, Inner};
use super::plan::PreparedWrite;
use crate::error::{Error, Result};

/// A direct request between submission and completion, in a slot of `Queue::pending` that
/// stays allocated from request to request (`active` while it is in use): a request is
/// written into its slot and read out of it field by field, never moved whole (at ~300 bytes
/// those moves were a tenth of the direct path's own time), and the slot's vectors keep their
/// capacity for the next request.
#[derive(Default)]
struct Pending {
    /// The slot holds a request.
    active: bool,
    user_data: u64,
    /// Ring operations not completed yet.
    left: usize,
    /// `(position in the request, length)` of each ring operation, by part number.
    parts: Vec<(usize, usize)>,
    /// Ranges of a read to zero-fill because the file ended first.
    short: Vec<(usize, usize)>,
    error: Option<Error>,
    lock: u64,
    /// The caller's buffers (`None` only while the slot is free).
    buffers: Option<IoBuffers>,
    len: u64,
    write: bool,
    /// Writes to link (new clusters, changed bitmaps) once the data is on disk.
    links: Vec<PreparedWrite>,
    /// Ranges of a read that are holes ([`Completion::holes`]).
    holes: Vec<(usize, usize)>,
    /// A write that copies on write on the ring: its bounce buffer and step.
    cow: Option<CowIo>,
}

impl Pending {
    /// Puts a request whose ring operations are `parts` into this free slot, field by field
    /// (its other vectors are empty and keep their capacity).
    #[allow(clippy::too_many_arguments)]
    fn start(
        &mut self,
        user_data: u64,
        parts: Vec<(usize, usize)>,
        error: Option<Error>,
        lock: u64,
        buffers: IoBuffers,
        len: u64,
        write: bool,
        links: Vec<PreparedWrite>,
    ) {
        self.active = true;
        self.user_data = user_data;
        self.left = parts.len();
        self.parts = parts;
        self.error = error;
        self.lock = lock;
        self.buffers = Some(buffers);
        self.len = len;
        self.write = write;
        self.links = links;
    }
}

/// A per-queue completion handle of an [`Image`]; see the [module docs](self).
///
/// `Queue` is `Send`: create it anywhere and move it to the thread that serves the guest
/// queue. Dropping it waits for every request it submitted (direct ones in the kernel, engine
/// ones on its thread). Drop every queue before closing the image.
pub struct Queue<S: Storage + 'static> {
    image: Image<S>,
    /// The image's state, lent to the direct path while it runs (`None` then): a reference
    /// that does not borrow the queue, without touching the reference count shared with
    /// every other queue of the image on each request.
    lent: Option<Arc<Inner<S>>>,
    ring: OwnRing,
    notifier: Notifier,
    pending: Vec<Pending>,
    free: Vec<usize>,
    /// The `user_data` of every request submitted and not collected yet.
    ids: InFlightIds,
    /// A batch of [`submit_batch`](Self::submit_batch) while it is checked (kept for its
    /// capacity).
    batch: Vec<(Request, u64)>,
    done: VecDeque<Completion>,
    engine_done: Arc<Mutex<Vec<Completion>>>,
    engine_in_flight: Arc<AtomicUsize>,
    reaped: Vec<RingCompletion>,
    /// L2 slices being read on the ring, with the requests waiting for them.
    loads: Vec<Option<SliceLoad>>,
    /// Inside [`collect`](Self::collect).
    collecting: bool,
    /// Inside [`submit_batch`](Self::submit_batch): ring entries wait for its one
    /// `io_uring_enter`.
    batching: bool,
    /// The time the batch's cache hits are stamped with (one clock read per batch).
    batch_now: Option<std::time::Duration>,
    /// The direct path's plan, reused from request to request.
    plan: Vec<Part>,
    /// Ring places promised to copy-on-write writes still reading (each writes once its
    /// reads are in, and must find a place then).
    reserved: usize,
    /// Bounce buffers of finished copy-on-write writes, for reuse.
    bounces: Vec<AlignedBuf>,
    stats: QueueStats,
    // Last: dropped after `Drop::drop` waited for the ring, and waits for engine requests.
    worker: Worker,
}

impl<S: Storage + 'static> std::fmt::Debug for Queue<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("ring", &self.ring)
            .field("stats", &self.stats)
            .finish()
    }
}

/// The body of [`Image::queue`].
pub(crate) fn queue<S: Storage + 'static>(
    img: &Image<S>,
    options: QueueOptions,
) -> Result<Queue<S>> {
    let path = &img.inner.shared.path;
    let depth = options.depth.unwrap_or(128);
    let notifier = match options.notifier {
        Some(n) => n,
        None => Notifier::new().map_err(|e| Error::io(path, "creating an eventfd", e))?,
    };
    // A ring only serves storage it can hand descriptors to.
    let wanted = img.inner.shared.file.direct_access().is_some();
    let ring = OwnRing::new(wanted, depth, options.poll, notifier.as_fd()).map_err(|e| {
        Error::io(
            path,
            format!("setting up an io_uring ring of depth {depth}"),
            e,
        )
    })?;
    let worker =
        Worker::start().map_err(|e| Error::io(path, "starting the queue's engine thread", e))?;
    Ok(Queue {
        image: img.clone(),
        lent: Some(img.inner.clone()),
        ring,
        notifier,
        pending: Vec::new(),
        free: Vec::new(),
        ids: InFlightIds::default(),
        batch: Vec::new(),
        done: VecDeque::new(),
        engine_done: Arc::new(Mutex::new(Vec::new())),
        engine_in_flight: Arc::new(AtomicUsize::new(0)),
        reaped: Vec::new(),
        loads: Vec::new(),
        collecting: false,
        batching: false,
        batch_now: None,
        plan: Vec::new(),
        reserved: 0,
        bounces: Vec::new(),
        stats: QueueStats::default(),
        worker,
    })
}

impl<S: Storage + 'static> Queue<S> {
    /// The eventfd signalled when a completion is ready: poll it for readability, read it to
    /// reset it (or call [`Notifier::drain`]), then call [`next_completed`](Self::next_completed)
    /// until it returns `None`.
    pub fn notifier(&self) -> &Notifier {
        &self.notifier
    }

    /// The image.
    pub fn image(&self) -> &Image<S> {
        &self.image
    }

    /// Counters of what the queue did.
    pub fn stats(&self) -> QueueStats {
        QueueStats {
            ring_enters: self.ring.submit_calls(),
            ring: self.ring.exists(),
            ..self.stats
        }
    }

    /// Requests submitted whose completion was not collected yet.
    pub fn in_flight(&self) -> usize {
        self.pending.iter().filter(|p| p.active).count()
            + self.parked()
            + self.engine_in_flight.load(Ordering::Acquire)
            + self.done.len()
    }

    /// Submits `request`; its [`Completion`] carries `user_data`, which must not be that of a
    /// request in flight (submitted, its completion not collected yet). Errors of the request
    /// itself (out of range, read-only image, I/O errors) arrive in the completion. The
    /// request is refused, and handed back whole in [`Refused`] (never to complete), only when
    /// its `user_data` is in flight or the queue cannot run requests any more.
    pub fn submit(&mut self, request: Request, user_data: u64) -> std::result::Result<(), Refused> {
        if let Err(error) = self.admit(user_data) {
            return Err(Refused {
                request,
                user_data,
                error,
            });
        }
        self.start(request, user_data);
        Ok(())
    }

    /// Whether a request with `user_data` may be submitted now; records it in flight if so.
    fn admit(&mut self, user_data: u64) -> Result<()> {
        if !self.worker.is_running() {
            return Err(self.gone("queueing a request"));
        }
        if !self.ids.insert(user_data) {
            return Err(Error::InvalidOption(format!(
                "{}: user_data {user_data} is already in flight on this queue (a request keeps \
                 its user_data until its completion is collected)",
                self.image.inner.shared.path.display()
            )));
        }
        Ok(())
    }

    /// The error of a queue whose engine thread has stopped.
    fn gone(&self, what: &str) -> Error {
        Error::io(
            &self.image.inner.shared.path,
            what,
            io::Error::other("the queue's engine thread has stopped"),
        )
    }

    /// Runs an admitted request: on the direct path when it can, else on the engine thread.
    fn start(&mut self, request: Request, user_data: u64) {
        let request = match request {
            Request::Read { offset, buffers } => {
                match self.try_direct(offset, buffers, user_data, false, 0, true) {
                    Ok(()) => return,
                    Err(buffers) => Request::Read { offset, buffers },
                }
            }
            Request::Write { offset, buffers } => {
                match self.try_direct(offset, buffers, user_data, true, 0, true) {
                    Ok(()) => return,
                    Err(buffers) => Request::Write { offset, buffers },
                }
            }
            other => other,
        };
        self.run_on_engine_thread(request, user_data);
    }

    /// Submits `requests` as [`submit`](Self::submit) does, handing the direct ones to the
    /// kernel with one `io_uring_enter` at the end instead of one each (cloud-hypervisor's
    /// `submit_batch_requests`): a VMM that drains a virtqueue's available ring passes what
    /// it found at once. All or nothing: when one request would be refused (its `user_data`
    /// in flight or repeated in the batch, or the queue cannot run requests any more), none
    /// is submitted and [`BatchRefused`] hands every one back in order.
    pub fn submit_batch<I>(&mut self, requests: I) -> std::result::Result<(), BatchRefused>
    where
        I: IntoIterator<Item = (Request, u64)>,
    {
        let mut batch = std::mem::take(&mut self.batch);
        batch.extend(requests);
        for i in 0..batch.len() {
            if let Err(error) = self.admit(batch[i].1) {
                for (_, user_data) in &batch[..i] {
                    self.ids.remove(user_data);
                }
                let requests = batch;
                return Err(BatchRefused { requests, error });
            }
        }
        self.batching = true;
        self.batch_now = Some(self.image.inner.shared.now());
        // Consecutive reads that go direct keep the metadata lock from one to the next (its
        // release is not free), for at most `BATCH_HOLD` of them so that other queues and
        // the engine get their turn.
        let inner = self.borrow_inner();
        let mut held = None;
        let mut kept = 0;
        for (request, user_data) in batch.drain(..) {
            if kept == BATCH_HOLD {
                held = None;
                kept = 0;
            }
            let request = match request {
                Request::Read { offset, buffers } => {
                    match self.try_direct_in(
                        &inner,
                        Some(&mut held),
                        offset,
                        buffers,
                        user_data,
                        false,
                        0,
                        true,
                    ) {
                        Ok(()) => {
                            kept += usize::from(held.is_some());
                            continue;
                        }
                        Err(buffers) => Request::Read { offset, buffers },
                    }
                }
                other => other,
            };
            held = None;
            kept = 0;
            match request {
                // Already tried: `start` would try the direct path again.
                Request::Read { .. } => self.run_on_engine_thread(request, user_data),
                other => self.start(other, user_data),
            }
        }
        drop(held);
        self.batch = batch;
        self.lent.get_or_insert(inner);
        self.batching = false;
        self.batch_now = None;
        // A failed submission leaves the entries queued: `collect` tries again.
        let _ = self.ring.submit();
        Ok(())
    }

    /// Makes every write whose completion was collected before this call durable (with the
    /// metadata that reaches it), and returns when it is: a VMM's synchronous flush
    /// (cloud-hypervisor's write-through `fsync(None)`). The flush runs on the queue's engine
    /// thread while the caller waits on a channel; completions of other requests are not
    /// touched and stay for [`next_completed`](Self::next_completed).
    pub fn flush_blocking(&mut self) -> Result<()> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let image = self.image.clone();
        let job = Box::pin(async move {
            let _ = tx.send(image.flush().await);
        });
        if !self.worker.run(job) {
            return Err(self.gone("flushing"));
        }
        rx.recv().map_err(|_| self.gone("flushing"))?
    }

    /// The next completed request, if any (never blocks).
    pub fn next_completed(&mut self) -> Option<Completion> {
        if self.done.is_empty() {
            self.collect();
        }
        let c = self.done.pop_front()?;
        self.ids.remove(&c.user_data);
        Some(c)
    }

    /// Blocks until a completion is ready or nothing is in flight (for callers without an
    /// event loop of their own; an epoll loop polls [`notifier`](Self::notifier) instead).
    pub fn wait(&mut self) -> Result<()> {
        loop {
            self.collect();
            if !self.done.is_empty() || self.in_flight() == 0 {
                return Ok(());
            }
            if self.engine_in_flight.load(Ordering::Acquire) == 0 && self.ring.in_flight() > 0 {
                // Only the ring can complete anything (engine requests start only from this
                // thread): wait in io_uring_enter itself, one system call instead of a poll
                // and an eventfd read.
                self.ring.wait().map_err(|e| {
                    Error::io(&self.image.inner.shared.path, "waiting for completions", e)
                })?;
                continue;
            }
            let fd = self.notifier.as_fd();
            let mut fds = [nix::poll::PollFd::new(fd, nix::poll::PollFlags::POLLIN)];
            match nix::poll::poll(&mut fds, nix::poll::PollTimeout::NONE) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    return Err(Error::io(
                        &self.image.inner.shared.path,
                        "waiting for completions",
                        e.into(),
                    ));
                }
            }
            self.notifier
                .drain()
                .map_err(|e| Error::io(&self.image.inner.shared.path, "reading the eventfd", e))?;
        }
    }

    /// Takes what the ring and the engine thread finished into `done`.
    fn collect(&mut self) {
        // Completions made here are seen by the caller, who is collecting: no eventfd write.
        self.collecting = true;
        // Entries a failed submission left queued get another chance.
        let _ = self.ring.submit();
        let mut reaped = std::mem::take(&mut self.reaped);
        self.ring.reap(|c| reaped.push(c));
        for c in reaped.drain(..) {
            self.on_ring(c);
        }
        self.reaped = reaped;
        // What the completions started (copy-on-write writes, requests after slice loads).
        let _ = self.ring.submit();
        let mut engine = self.engine_done.lock().unwrap_or_else(|e| e.into_inner());
        self.done.extend(engine.drain(..));
        drop(engine);
        self.collecting = false;
    }
}

/// Reads of a batch that may go direct under one hold of the metadata lock.
const BATCH_HOLD: usize = 16;

/// The metadata lock if it comes free within a short spin: the direct path's holders (other
/// queues' threads) keep it for about a microsecond, while the engine may hold it across
/// I/O, and then the request goes to the engine rather than wait.
///
/// The spin makes no system call (no `sched_yield`): a VMM that filters its queue threads'
/// system calls with seccomp need not allow one for it.
fn lock_briefly<T>(m: &tokio::sync::Mutex<T>) -> Option<tokio::sync::MutexGuard<'_, T>> {
    for _ in 0..128 {
        if let Ok(g) = m.try_lock() {
            return Some(g);
        }
        std::hint::spin_loop();
    }
    None
}

impl<S: Storage + 'static> Drop for Queue<S> {
    fn drop(&mut self) {
        // Direct requests hold memory the kernel uses and range locks: wait for each.
        while self.pending.iter().any(|p| p.active) || self.loads.iter().any(Option::is_some) {
            if self.ring.wait().is_err() {
                break;
            }
            self.collect();
        }
    }
}

impl<S: Storage + 'static> AsFd for Queue<S> {
    /// The [`notifier`](Queue::notifier)'s eventfd.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.notifier.as_fd()
    }
}

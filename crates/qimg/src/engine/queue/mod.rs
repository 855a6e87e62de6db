//! [`Queue`]: a per-queue completion handle for VMMs that run their own event loops.
//!
//! A VMM serves each guest queue (virtqueue) from its own thread: it takes requests off the
//! queue, submits them to the disk with a `user_data`, sleeps in `epoll` until an eventfd says
//! that something completed, and collects the completions. [`Image::queue`] gives it a
//! [`Queue`] made for that loop:
//!
//! * each queue has its own io_uring ring (depth chosen by the caller) and an eventfd (the
//!   caller's or one the queue owns) that the kernel signals for every completion;
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
mod fast;
mod loads;
mod worker;

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::MutexGuard;

use qimg_io::queue::{IoBuffers, Notifier, QueueRing, RingCompletion};
use qimg_io::{AlignedBuf, Op, Storage, StorageError};

use self::cow::CowIo;
use self::fast::Part;
use self::loads::{LOAD_TOKEN, Parked, SliceLoad};
use self::worker::Worker;
use super::image::{Image, Inner};
use super::meta::Meta;
use super::rw::PreparedWrite;
use crate::error::{Error, Result};

/// A request for [`Queue::submit`].
#[derive(Debug)]
#[non_exhaustive]
pub enum Request {
    /// Reads `buffers.len()` guest bytes at `offset` into the buffers, segment after segment.
    Read {
        /// Guest offset.
        offset: u64,
        /// Where the bytes go.
        buffers: IoBuffers,
    },
    /// Writes the buffers' bytes at guest `offset`.
    Write {
        /// Guest offset.
        offset: u64,
        /// The bytes.
        buffers: IoBuffers,
    },
    /// Makes every write completed before this request was submitted durable, with the
    /// metadata that reaches it.
    Flush,
    /// Makes `len` bytes at `offset` read as zeros. With `unmap` the space may be released
    /// ([`Image::write_zeroes_unmap`]); without it host clusters stay allocated
    /// ([`Image::write_zeroes`]). Either way whole subclusters change only metadata.
    WriteZeroes {
        /// Guest offset.
        offset: u64,
        /// Bytes.
        len: u64,
        /// Whether the space may be released.
        unmap: bool,
    },
    /// Discards `len` bytes at `offset` ([`Image::discard`]: advisory, whole subclusters).
    Discard {
        /// Guest offset.
        offset: u64,
        /// Bytes.
        len: u64,
    },
}

/// A finished request, from [`Queue::next_completed`].
#[derive(Debug)]
#[non_exhaustive]
pub struct Completion {
    /// The `user_data` given to [`Queue::submit`].
    pub user_data: u64,
    /// Bytes read or written (0 for the other requests), or what went wrong.
    pub result: Result<u64>,
    /// The buffers of a read or write, given back (their memory is no longer used).
    pub buffers: Option<IoBuffers>,
    /// For a read that took the direct path: the ranges of the buffers, as `(position,
    /// length)` in order, that read as zeros without being data (zero subclusters, and
    /// unallocated ones without a backing file), as `Image::map` would report them. `None`
    /// for other requests and for reads the engine ran (not known: ask `Image::map`).
    pub holes: Option<Vec<(usize, usize)>>,
}

impl Completion {
    /// The result as a VMM's completion carries it: bytes transferred, or a negated errno.
    pub fn raw_result(&self) -> i32 {
        match &self.result {
            Ok(n) => i32::try_from(*n).unwrap_or(i32::MAX),
            Err(e) => -e.errno(),
        }
    }
}

/// A request [`Queue::submit`] did not take, handed back whole (with its buffers and their
/// owner): it will never complete.
#[derive(Debug)]
#[non_exhaustive]
pub struct Refused {
    /// The request as it was submitted.
    pub request: Request,
    /// Its `user_data`.
    pub user_data: u64,
    /// Why: its `user_data` is already in flight, or the queue cannot run requests any more.
    pub error: Error,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for Refused {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl From<Refused> for Error {
    fn from(r: Refused) -> Error {
        r.error
    }
}

/// A batch [`Queue::submit_batch`] did not take: none of its requests was submitted, and all
/// are handed back in order.
#[derive(Debug)]
#[non_exhaustive]
pub struct BatchRefused {
    /// The requests with their `user_data`, as given.
    pub requests: Vec<(Request, u64)>,
    /// Why (the first reason found).
    pub error: Error,
}

impl std::fmt::Display for BatchRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for BatchRefused {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl From<BatchRefused> for Error {
    fn from(r: BatchRefused) -> Error {
        r.error
    }
}

/// The `user_data` of requests in flight (a multiplicative hash: keys are the caller's
/// tokens, often small consecutive numbers, and need no protection from collisions chosen
/// by an attacker: the caller picks them).
type InFlightIds = std::collections::HashSet<u64, std::hash::BuildHasherDefault<TokenHasher>>;

/// See [`InFlightIds`].
#[derive(Default)]
struct TokenHasher(u64);

impl std::hash::Hasher for TokenHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, n: u64) {
        // Fibonacci hashing: the high bits, which the table uses, depend on every key bit.
        self.0 = (n ^ (n >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// Options of [`Image::queue`].
#[derive(Debug, Default)]
pub struct QueueOptions {
    depth: Option<u32>,
    notifier: Option<Notifier>,
    poll: std::time::Duration,
}

impl QueueOptions {
    /// Defaults: depth 128, an eventfd of the queue's own.
    pub fn new() -> Self {
        Self::default()
    }

    /// The most requests the queue's ring holds at once (1..=4096; default 128). Requests
    /// beyond it still run, on the engine.
    pub fn depth(mut self, depth: u32) -> Self {
        self.depth = Some(depth);
        self
    }

    /// Signal this eventfd (for example one the VMM already polls) instead of one the queue
    /// creates. It should be non-blocking.
    pub fn eventfd(mut self, fd: OwnedFd) -> Self {
        self.notifier = Some(Notifier::from_fd(fd));
        self
    }

    /// [`eventfd`](Self::eventfd) with a descriptor the caller keeps: any `AsRawFd` value, a
    /// `vmm_sys_util::eventfd::EventFd` say. The queue signals a duplicate of it, so the
    /// caller's own object stays as it is. Fails only when the descriptor cannot be duplicated.
    pub fn eventfd_of(mut self, fd: &impl std::os::fd::AsRawFd) -> io::Result<Self> {
        self.notifier = Some(Notifier::duplicate(fd)?);
        Ok(self)
    }

    /// Have [`Queue::wait`] watch the ring for up to `poll` before it sleeps, when only the
    /// ring can complete anything (default zero: sleep at once). See
    /// [`QueueRing::set_poll`](qimg_io::queue::QueueRing::set_poll): it saves the waiting
    /// thread's wake-up per completion at low queue depths, for up to `poll` of a busy core per
    /// wait. An event loop that polls [`Queue::notifier`] instead is not affected.
    pub fn poll(mut self, poll: std::time::Duration) -> Self {
        self.poll = poll;
        self
    }
}

/// What a queue did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueStats {
    /// Reads and writes that went from the caller's thread straight to the ring.
    pub direct: u64,
    /// Bytes those direct requests moved, from or into the caller's memory (the direct path
    /// copies only the guest bytes of a [`cow`](Self::cow) write, into the buffer that
    /// holds the bytes around them).
    pub direct_bytes: u64,
    /// Requests run on the engine (the queue's thread).
    pub engine: u64,
    /// Direct requests that completed without any I/O (zero or unallocated ranges).
    pub immediate: u64,
    /// `io_uring_enter` calls the ring made.
    pub ring_enters: u64,
    /// Direct writes that allocated clusters or changed entries (linked when their data was
    /// on disk, in the caller's thread or, when that needed metadata I/O, on the engine's).
    pub allocating: u64,
    /// Of those, the ones whose linking went to the engine thread.
    pub linked_on_engine: u64,
    /// L2 slices read on the queue's ring for requests that missed them (which then took
    /// the direct path, or the engine when something changed meanwhile).
    pub slice_loads: u64,
    /// Of the allocating direct writes, those that copied on write on the ring: the bytes
    /// around the caller's in a partly written subcluster (or cluster, on standard L2) read
    /// from a raw backing file or filled with zeros, and written with the caller's in one
    /// write.
    pub cow: u64,
    /// Direct reads of a [`submit_batch`](Queue::submit_batch) planned under the metadata
    /// lock an earlier read of the same batch took (consecutive reads share one lock hold,
    /// at most 16 of them).
    pub held_reads: u64,
}

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
    ring: QueueRing,
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

impl<S: Storage + 'static> Image<S> {
    /// A per-queue completion handle on this image: its own io_uring ring and eventfd, and a
    /// thread for the requests that need the engine. See [`Queue`].
    pub fn queue(&self, options: QueueOptions) -> Result<Queue<S>> {
        let path = &self.inner.path;
        let depth = options.depth.unwrap_or(128);
        let mut ring = QueueRing::new(depth).map_err(|e| {
            Error::io(
                path,
                format!("setting up an io_uring ring of depth {depth}"),
                e,
            )
        })?;
        ring.set_poll(options.poll);
        let notifier = match options.notifier {
            Some(n) => n,
            None => Notifier::new().map_err(|e| Error::io(path, "creating an eventfd", e))?,
        };
        ring.register_eventfd(notifier.as_fd())
            .map_err(|e| Error::io(path, "registering the eventfd with the ring", e))?;
        let worker = Worker::start()
            .map_err(|e| Error::io(path, "starting the queue's engine thread", e))?;
        Ok(Queue {
            image: self.clone(),
            lent: Some(self.inner.clone()),
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
                self.image.inner.path.display()
            )));
        }
        Ok(())
    }

    /// The error of a queue whose engine thread has stopped.
    fn gone(&self, what: &str) -> Error {
        Error::io(
            &self.image.inner.path,
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
        self.batch_now = Some(self.image.inner.now());
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
                self.ring
                    .wait()
                    .map_err(|e| Error::io(&self.image.inner.path, "waiting for completions", e))?;
                continue;
            }
            let fd = self.notifier.as_fd();
            let mut fds = [nix::poll::PollFd::new(fd, nix::poll::PollFlags::POLLIN)];
            match nix::poll::poll(&mut fds, nix::poll::PollTimeout::NONE) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    return Err(Error::io(
                        &self.image.inner.path,
                        "waiting for completions",
                        e.into(),
                    ));
                }
            }
            self.notifier
                .drain()
                .map_err(|e| Error::io(&self.image.inner.path, "reading the eventfd", e))?;
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

    /// Tries the direct path (after loading a missing L2 slice on the ring, if that is all
    /// it lacks; `loads` counts the loads the request waited for so far, and `counted` says
    /// whether its cache lookups count: not after a load that counted its miss); gives the
    /// buffers back when the request needs the engine.
    fn try_direct(
        &mut self,
        offset: u64,
        buffers: IoBuffers,
        user_data: u64,
        write: bool,
        loads: u8,
        counted: bool,
    ) -> std::result::Result<(), IoBuffers> {
        let inner = self.borrow_inner();
        let r = self.try_direct_in(
            &inner, None, offset, buffers, user_data, write, loads, counted,
        );
        self.lent.get_or_insert(inner);
        r
    }

    /// The image's state from `lent` (a clone only when the direct path is entered again
    /// while it is out); give it back to `lent` after use.
    fn borrow_inner(&mut self) -> Arc<Inner<S>> {
        self.lent.take().unwrap_or_else(|| self.image.inner.clone())
    }

    /// [`try_direct`](Self::try_direct) on `inner` (the queue's image), where `held` is the
    /// metadata lock [`submit_batch`](Self::submit_batch) keeps from one read to the next:
    /// a read that goes direct leaves it held, anything else lets it go.
    #[allow(clippy::too_many_arguments)]
    fn try_direct_in<'g>(
        &mut self,
        inner: &'g Inner<S>,
        held: Option<&mut Option<MutexGuard<'g, Meta>>>,
        offset: u64,
        buffers: IoBuffers,
        user_data: u64,
        write: bool,
        loads: u8,
        counted: bool,
    ) -> std::result::Result<(), IoBuffers> {
        let mut plan = std::mem::take(&mut self.plan);
        plan.clear();
        let r = self.try_direct_with(
            inner, held, &mut plan, offset, buffers, user_data, write, loads, counted,
        );
        self.plan = plan;
        r
    }

    /// [`try_direct_in`](Self::try_direct_in) with the plan's vector lent.
    #[allow(clippy::too_many_arguments)]
    fn try_direct_with<'g>(
        &mut self,
        inner: &'g Inner<S>,
        held: Option<&mut Option<MutexGuard<'g, Meta>>>,
        plan: &mut Vec<Part>,
        offset: u64,
        mut buffers: IoBuffers,
        user_data: u64,
        write: bool,
        loads: u8,
        counted: bool,
    ) -> std::result::Result<(), IoBuffers> {
        let mut own = None;
        // Reads keep the batch's hold; a write lets it go (its fallbacks take the lock).
        let keep = held.is_some() && !write;
        let meta = match held {
            Some(h) if !write => h,
            Some(h) => {
                *h = None;
                &mut own
            }
            None => &mut own,
        };
        let len = buffers.len() as u64;
        if len == 0 || offset.checked_add(len).is_none_or(|end| end > inner.size()) {
            return Err(buffers);
        }
        if write && (inner.check_writable().is_err() || inner.check_not_halted().is_err()) {
            return Err(buffers);
        }
        // Before anything changes; a crash-consistent bitmap whose bit is not durable yet
        // sends the write to the engine, which makes it durable first.
        let epoch = inner.bitmaps.epoch();
        if write && !inner.bitmaps.mark(offset, len) {
            return Err(buffers);
        }
        let (data, _) = inner.data();
        let Some(access) = data.direct_access() else {
            return Err(buffers);
        };
        let ra = access.request_alignment.max(1);
        let ma = access.mem_alignment.max(1);
        if !buffers.is_aligned(ma, ra) || offset % ra as u64 != 0 {
            return Err(buffers);
        }
        let (first, end) = inner.cluster_span(offset, len);
        // A write shares its clusters with in-place writes as long as it changes no metadata
        // itself (see `lock.rs`); it upgrades below when it does.
        let lock = if write {
            inner.locks.try_acquire_in_place(first, end)
        } else {
            inner.locks.try_acquire(first, end, false)
        };
        let Some(lock) = lock else {
            return Err(buffers);
        };
        // The bitmaps changed since the write recorded itself (a checkpoint): the engine
        // records it again (the rule of `Inner::recorded`).
        if write && !inner.bitmaps.still_current(epoch) {
            inner.locks.release(lock);
            return Err(buffers);
        }
        let reused = meta.is_some();
        if !reused {
            *meta = lock_briefly(&inner.meta);
        }
        if meta.as_ref().is_some_and(|m| m.closed) {
            *meta = None;
        }
        let free = self.free_slots();
        let mut links = Vec::new();
        let stamp = counted.then(|| self.batch_now.unwrap_or_else(|| inner.now()));
        let parts = meta.as_mut().and_then(|m| {
            if !write {
                inner.plan_direct_read(m, offset, len, stamp, plan)?;
                return Some(&*plan);
            }
            // A ring entry per cluster at most, checked before anything is allocated: an
            // allocation cannot be handed to the engine afterwards.
            if (end - first) as usize > free {
                return None;
            }
            links = inner.plan_direct_write(m, offset, len, stamp, plan)?;
            Some(&*plan)
        });
        // A write that allocates or relinks needs its clusters to itself: upgraded, or handed
        // to the engine (which waits for them) with what it took given back.
        if write && !links.is_empty() && !inner.locks.try_upgrade(lock) {
            if let Some(m) = meta.as_mut() {
                for l in links.iter().filter(|l| l.fresh) {
                    inner.try_unalloc_cached(m, l.host);
                }
            }
            *meta = None;
            inner.locks.release(lock);
            return Err(buffers);
        }
        let ios = parts.as_ref().map_or(0, |p| {
            p.iter().filter(|p| matches!(p, Part::Io { .. })).count()
        });
        let fits = parts.as_ref().is_some_and(|parts| {
            ios <= free
                && parts.iter().all(|p| match *p {
                    Part::Io { host, pos, len } => {
                        host % ra as u64 == 0 && pos % ra == 0 && len % ra == 0
                    }
                    Part::Zero { .. } => true,
                })
        });
        let unplanned = parts.is_none() && meta.is_some();
        let (true, Some(parts)) = (fits, parts) else {
            if let Some(m) = meta.as_mut() {
                // Not reached (the checks above come first), but never leak a cluster.
                for l in links.iter().filter(|l| l.fresh) {
                    inner.try_unalloc_cached(m, l.host);
                }
            }
            // Released before the fallbacks, which take it themselves.
            *meta = None;
            // A write that only needs copy-on-write the ring can do itself.
            let buffers = if write && unplanned && inner.locks.try_upgrade(lock) {
                match self.try_cow(offset, buffers, user_data, lock) {
                    Ok(()) => return Ok(()),
                    Err(buffers) => buffers,
                }
            } else {
                buffers
            };
            inner.locks.release(lock);
            if unplanned {
                // Perhaps only an L2 slice is missing: load it here and come back.
                let p = Parked {
                    offset,
                    buffers,
                    user_data,
                    write,
                    loads,
                    joined: false,
                };
                return self.park_on_slice_load(p).map_err(|p| p.buffers);
            }
            return Err(buffers);
        };
        if !keep {
            *meta = None;
        } else if reused {
            self.stats.held_reads += 1;
        }
        if !links.is_empty() {
            self.stats.allocating += 1;
            if let Some(host) = links.iter().filter(|l| l.fresh).map(|l| l.host).max() {
                self.reserve_ahead(host);
            }
        }
        let mut holes = Vec::new();
        for p in parts {
            if let Part::Zero { pos, len } = *p {
                buffers.fill_zero(pos, len);
                holes.push((pos, len));
            }
        }
        // `slot()` inline: `inner` borrows the image.
        let idx = match self.free.pop() {
            Some(i) => i,
            None => {
                self.pending.push(Pending::default());
                self.pending.len() - 1
            }
        };
        // The slot's own vector (empty), with the capacity of earlier requests.
        let mut positions = std::mem::take(&mut self.pending[idx].parts);
        positions.reserve(ios);
        let mut error = None;
        for p in parts {
            let Part::Io { host, pos, len: n } = *p else {
                continue;
            };
            let token = ((idx as u64) << 32) | positions.len() as u64;
            let queued = if write {
                self.ring.write(access.fd, host, &buffers, pos, n, token)
            } else {
                self.ring.read(access.fd, host, &mut buffers, pos, n, token)
            };
            match queued {
                Ok(()) => positions.push((pos, n)),
                Err(e) => {
                    error = Some(ring_error(&inner.path, write, host, n as u64, e));
                    break;
                }
            }
        }
        let left = positions.len();
        let p = &mut self.pending[idx];
        p.start(
            user_data, positions, error, lock, buffers, len, write, links,
        );
        p.holes = holes;
        self.stats.direct += 1;
        self.stats.direct_bytes += len;
        if left == 0 {
            self.stats.immediate += 1;
            self.finish(idx);
            if !self.collecting {
                let _ = self.notifier.notify();
            }
        } else if !self.batching {
            let _ = self.ring.submit();
        }
        Ok(())
    }

    /// A free slot of `pending`.
    fn slot(&mut self) -> usize {
        match self.free.pop() {
            Some(i) => i,
            None => {
                self.pending.push(Pending::default());
                self.pending.len() - 1
            }
        }
    }

    /// Ring places a new request may take: those not promised to copy-on-write writes.
    fn free_slots(&self) -> usize {
        self.ring.available().saturating_sub(self.reserved)
    }

    /// After the direct path allocated the cluster at `host`: asks the engine thread to
    /// reserve the next step past the end of the file as soon as less than a step is left, so
    /// that the direct path never waits for a `fallocate`.
    fn reserve_ahead(&self, host: u64) {
        let inner = &self.image.inner;
        if !inner.claim_extension(host) {
            return;
        }
        let image = self.image.clone();
        let job = Box::pin(async move { image.inner.extend_reservation().await });
        if !self.worker.run(job) {
            inner.reservation.extending.store(false, Ordering::Release);
        }
    }

    /// One ring operation completed.
    fn on_ring(&mut self, c: RingCompletion) {
        if c.token & LOAD_TOKEN != 0 {
            self.on_slice_load(c);
            return;
        }
        let idx = (c.token >> 32) as usize;
        let part = (c.token & 0xffff_ffff) as usize;
        if self.on_cow_read(idx, part, c.result, c.expected) {
            return;
        }
        let path = &self.image.inner.path;
        let Some(p) = self.pending.get_mut(idx).filter(|p| p.active) else {
            return;
        };
        let (pos, len) = p.parts.get(part).copied().unwrap_or((0, 0));
        // The merged write of a copy-on-write is named by its place in the file.
        let at = p.cow.as_ref().map_or(pos as u64, |cow| cow.host);
        if c.result < 0 {
            let e = io::Error::from_raw_os_error(-c.result);
            p.error
                .get_or_insert_with(|| ring_error(path, p.write, at, len as u64, e));
        } else if (c.result as usize) < c.expected {
            let got = c.result as usize;
            if p.write {
                let e = io::Error::new(
                    io::ErrorKind::WriteZero,
                    format!("short write: {got} of {} bytes", c.expected),
                );
                p.error
                    .get_or_insert_with(|| ring_error(path, true, at, len as u64, e));
            } else {
                // The file ended: the rest reads as zeros, as everywhere in the engine.
                p.short.push((pos + got, len - got));
            }
        }
        p.left -= 1;
        if p.left == 0 {
            self.finish(idx);
        }
    }

    /// Completes the direct request in slot `idx`.
    fn finish(&mut self, idx: usize) {
        let Some(slot) = self.pending.get_mut(idx).filter(|p| p.active) else {
            return;
        };
        slot.active = false;
        slot.parts.clear();
        self.free.push(idx);
        if slot.cow.is_none() && slot.links.is_empty() {
            // Reads and in-place writes: read out of the slot, nothing moved whole.
            let mut buffers = slot.buffers.take();
            if let Some(b) = buffers.as_mut() {
                for (pos, len) in slot.short.drain(..) {
                    b.fill_zero(pos, len);
                }
            }
            let result = match slot.error.take() {
                Some(e) => Err(e),
                None => Ok(slot.len),
            };
            let holes = std::mem::take(&mut slot.holes);
            let (user_data, write, lock) = (slot.user_data, slot.write, slot.lock);
            self.image.inner.locks.release(lock);
            self.done.push_back(Completion {
                user_data,
                result,
                buffers,
                holes: (!write).then_some(holes),
            });
            return;
        }
        // Writes with clusters to link: owned from here (they may go to the engine thread).
        let parts = std::mem::take(&mut slot.parts);
        let mut p = std::mem::take(slot);
        self.pending[idx].parts = parts;
        if let Some(cow) = p.cow.take() {
            self.end_cow(cow);
        }
        if !p.links.is_empty() && !self.link_here(&mut p) {
            self.link_on_engine(p);
            return;
        }
        self.image.inner.locks.release(p.lock);
        let mut buffers = p.buffers;
        if let Some(b) = buffers.as_mut() {
            for (pos, len) in p.short {
                b.fill_zero(pos, len);
            }
        }
        let result = match p.error {
            Some(e) => Err(e),
            None => Ok(p.len),
        };
        self.done.push_back(Completion {
            user_data: p.user_data,
            result,
            buffers,
            holes: (!p.write).then_some(p.holes),
        });
    }

    /// Links (or, after a failed write, gives back the clusters of) the writes of a direct
    /// request in the caller's thread; `false` leaves what is left in `p.links` to the engine.
    fn link_here(&mut self, p: &mut Pending) -> bool {
        let inner = &self.image.inner;
        let Some(mut m) = lock_briefly(&inner.meta) else {
            return false;
        };
        let failed = p.error.is_some();
        while let Some(l) = p.links.first() {
            let done = if failed {
                !l.fresh || inner.try_unalloc_cached(&mut m, l.host)
            } else {
                inner.try_link_cached(&mut m, l)
            };
            if !done {
                return false;
            }
            p.links.remove(0);
        }
        true
    }

    /// Finishes a direct request whose linking needs metadata I/O on the engine thread.
    fn link_on_engine(&mut self, p: Pending) {
        self.stats.linked_on_engine += 1;
        // If the engine thread is gone (the queue is being torn down) the range lock and the
        // unlinked clusters stay as they are; check reports the leak.
        self.post_from_engine(move |image| async move {
            let inner = &image.inner;
            let result = match p.error {
                Some(e) => {
                    inner.abandon_chunks(&p.links).await;
                    Err(e)
                }
                None => inner.link_chunks(&p.links).await.map(|()| p.len),
            };
            inner.locks.release(p.lock);
            Completion {
                user_data: p.user_data,
                result,
                buffers: p.buffers,
                holes: None,
            }
        });
    }

    /// Runs `request` on the engine thread. Should the thread have died since the request was
    /// admitted (only a panic of its runtime could do that), the request completes with that
    /// error, its buffers dropped (the kernel never saw them).
    fn run_on_engine_thread(&mut self, request: Request, user_data: u64) {
        self.stats.engine += 1;
        let queued = self.post_from_engine(move |image| async move {
            let (result, buffers) = run_on_engine(&image, request).await;
            Completion {
                user_data,
                result,
                buffers,
                holes: None,
            }
        });
        if !queued {
            self.done.push_back(Completion {
                user_data,
                result: Err(self.gone("queueing a request")),
                buffers: None,
                holes: None,
            });
            if !self.collecting {
                let _ = self.notifier.notify();
            }
        }
    }

    /// Runs `work` on the engine thread and posts the completion it returns (counted in
    /// flight until then); `false` if the thread is gone.
    fn post_from_engine<F, Fut>(&mut self, work: F) -> bool
    where
        F: FnOnce(Image<S>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Completion> + Send + 'static,
    {
        let image = self.image.clone();
        let done = self.engine_done.clone();
        let in_flight = self.engine_in_flight.clone();
        let notifier = self.notifier.clone();
        in_flight.fetch_add(1, Ordering::AcqRel);
        let job = Box::pin(async move {
            let completion = work(image).await;
            done.lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(completion);
            in_flight.fetch_sub(1, Ordering::AcqRel);
            let _ = notifier.notify();
        });
        let queued = self.worker.run(job);
        if !queued {
            self.engine_in_flight.fetch_sub(1, Ordering::AcqRel);
        }
        queued
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

async fn run_on_engine<S: Storage + 'static>(
    image: &Image<S>,
    request: Request,
) -> (Result<u64>, Option<IoBuffers>) {
    let path = &image.inner.path;
    let busy = || {
        Error::io(
            path,
            "lending buffers",
            io::Error::other("the buffers are still in use by the ring"),
        )
    };
    match request {
        Request::Read {
            offset,
            mut buffers,
        } => {
            let len = buffers.len() as u64;
            let r = if buffers.is_guest_memory() {
                // Guest memory is never borrowed as a slice: read into a buffer, copy in.
                let mut tmp = vec![0u8; buffers.len()];
                match image.read(&mut tmp, offset).await {
                    Ok(()) if buffers.copy_in(0, &tmp) => Ok(()),
                    Ok(()) => Err(busy()),
                    Err(e) => Err(e),
                }
            } else {
                match buffers.slices_mut() {
                    Some(mut slices) => image.read_vectored(&mut slices, offset).await,
                    None => Err(busy()),
                }
            };
            (r.map(|()| len), Some(buffers))
        }
        Request::Write { offset, buffers } => {
            let len = buffers.len() as u64;
            let r = if buffers.is_guest_memory() {
                let mut tmp = vec![0u8; buffers.len()];
                if buffers.copy_out(0, &mut tmp) {
                    image.write(&tmp, offset).await
                } else {
                    Err(busy())
                }
            } else {
                match buffers.slices() {
                    Some(slices) => image.write_vectored(&slices, offset).await,
                    None => Err(busy()),
                }
            };
            (r.map(|()| len), Some(buffers))
        }
        Request::Flush => (image.flush().await.map(|()| 0), None),
        Request::WriteZeroes { offset, len, unmap } => {
            let done = match unmap {
                true => image.write_zeroes_unmap(offset, len).await,
                false => image.write_zeroes(offset, len).await,
            };
            (done.map(|()| 0), None)
        }
        Request::Discard { offset, len } => (image.discard(offset, len).await.map(|()| 0), None),
    }
}

fn ring_error(
    path: &std::path::Path,
    write: bool,
    offset: u64,
    len: u64,
    source: io::Error,
) -> Error {
    Error::storage(
        path,
        StorageError::Io {
            op: if write { Op::Write } else { Op::Read },
            offset,
            len,
            source,
        },
    )
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

//! What a queue takes and gives back: [`Request`], [`Completion`], the refusals, the options
//! of [`Image::queue`](crate::Image::queue) and the counters.

use std::io;
use std::os::fd::OwnedFd;

use qimg_io::queue::{IoBuffers, Notifier};

use crate::error::{Error, Result};

/// A request for [`Queue::submit`](super::Queue::submit).
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
    /// ([`Image::write_zeroes_unmap`](crate::Image::write_zeroes_unmap)); without it host clusters stay allocated
    /// ([`Image::write_zeroes`](crate::Image::write_zeroes)). Either way whole subclusters change only metadata.
    WriteZeroes {
        /// Guest offset.
        offset: u64,
        /// Bytes.
        len: u64,
        /// Whether the space may be released.
        unmap: bool,
    },
    /// Discards `len` bytes at `offset` ([`Image::discard`](crate::Image::discard): advisory, whole subclusters).
    Discard {
        /// Guest offset.
        offset: u64,
        /// Bytes.
        len: u64,
    },
}

/// A finished request, from [`Queue::next_completed`](super::Queue::next_completed).
#[derive(Debug)]
#[non_exhaustive]
pub struct Completion {
    /// The `user_data` given to [`Queue::submit`](super::Queue::submit).
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

/// A request [`Queue::submit`](super::Queue::submit) did not take, handed back whole (with its buffers and their
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

/// A batch [`Queue::submit_batch`](super::Queue::submit_batch) did not take: none of its requests was submitted, and all
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
pub(super) type InFlightIds =
    std::collections::HashSet<u64, std::hash::BuildHasherDefault<TokenHasher>>;

/// See [`InFlightIds`].
#[derive(Default)]
pub(super) struct TokenHasher(u64);

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

/// Options of [`Image::queue`](crate::Image::queue).
#[derive(Debug, Default)]
pub struct QueueOptions {
    pub(super) depth: Option<u32>,
    pub(super) notifier: Option<Notifier>,
    pub(super) poll: std::time::Duration,
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

    /// Have [`Queue::wait`](super::Queue::wait) watch the ring for up to `poll` before it sleeps, when only the
    /// ring can complete anything (default zero: sleep at once). See
    /// [`QueueRing::set_poll`](qimg_io::queue::QueueRing::set_poll): it saves the waiting
    /// thread's wake-up per completion at low queue depths, for up to `poll` of a busy core per
    /// wait. An event loop that polls [`Queue::notifier`](super::Queue::notifier) instead is not affected.
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
    /// Direct reads of a [`submit_batch`](super::Queue::submit_batch) planned under the metadata
    /// lock an earlier read of the same batch took (consecutive reads share one lock hold,
    /// at most 16 of them).
    pub held_reads: u64,
    /// Whether the queue has an io_uring ring of its own. Without one (storage without a
    /// descriptor, a kernel or filter refusing io_uring) every request runs on the engine
    /// thread.
    pub ring: bool,
}

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
//!   Cancelling a future can therefore never let the kernel touch freed memory. A request
//!   that finishes normally hands its bounce buffer back for reuse by the next request of
//!   the same size (a few small ones are kept), so the data path does not allocate and zero
//!   a buffer per request; stale bytes in a reused buffer are never read (reads copy out
//!   only what the kernel transferred, writes fill what they write, zeros clear it first).
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
//!
//! # Layout
//!
//! * [`options`]: [`UringOptions`], the builder.
//! * [`submission`]: what a request is on the ring (its opcode, its memory) and the
//!   submission entry built from it.
//! * [`driver`]: the slot table and the state shared by handles, futures and the completion
//!   side, with the ring's queue accesses.
//! * [`completion`]: the completion thread, the runtime task that replaces it on tokio, and
//!   shutdown.
//! * [`request`]: the future of one request, and what dropping it does (cancellation).
//! * [`storage`], [`transfer`], [`storage_impl`]: [`UringStorage`], its transfers through the
//!   ring, and its [`Storage`] implementation.
//!
//! [`AlignedBuf`]: crate::AlignedBuf
//! [`Storage`]: crate::Storage
//! [`FileStorage`]: crate::FileStorage

mod completion;
mod driver;
#[cfg(all(test, feature = "conformance"))]
mod option_tests;
mod options;
mod request;
mod storage;
mod storage_impl;
mod submission;
mod transfer;

pub use options::UringOptions;
pub use storage::UringStorage;

/// Largest piece of a read or write submitted as one request (bounce buffers are at most this
/// large). A multiple of every O_DIRECT alignment.
const CHUNK: usize = 8 << 20;
/// `user_data` of the no-op that wakes the completion thread at shutdown.
const SHUTDOWN: u64 = u64::MAX;

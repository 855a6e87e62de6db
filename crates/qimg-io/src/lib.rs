//! # qimg-io: async storage backends for qimg
//!
//! The image engine reads and writes its image file through the [`Storage`] trait: positioned
//! reads and writes (vectored too), efficient zeroing, discard, space reservation, flush,
//! length, and the alignment that O_DIRECT needs. This crate defines the trait and its
//! backends:
//!
//! * [`FileStorage`]: a file or block device through positioned system calls (`nix`),
//!   buffered or O_DIRECT, with system calls run inline or on tokio's blocking pool
//!   ([`BlockingStrategy`]).
//! * [`MemStorage`]: a sparse in-memory file for tests, optionally enforcing O_DIRECT-style
//!   alignment.
//! * [`FaultyStorage`]: a wrapper over any backend for crash and error tests. It counts
//!   operations, fails chosen ones with `EIO` or `ENOSPC`, tears writes, and simulates power
//!   loss: [`FaultController::power_cut`] returns what the disk could hold after a crash (the
//!   last flushed contents plus some, all or none of the unflushed modifications, per
//!   [`CrashPolicy`]).
//!
//! * [`UringStorage`] (Linux): a file or block device driven through io_uring, with many
//!   requests in flight at once, falling back to the [`FileStorage`] code path for opcodes
//!   the kernel lacks. Opening fails with [`StorageError::UringUnavailable`] where io_uring is
//!   disabled or missing; use [`FileStorage`] there.
//! * [`queue`] (Linux): [`queue::QueueRing`], one io_uring ring owned by one thread (a VMM's
//!   virtqueue loop) with an eventfd ([`queue::Notifier`]) the kernel signals per completion,
//!   reading and writing memory a request lends ([`queue::IoBuffers`]: the caller's iovecs or
//!   owned buffers) in place. [`Storage::direct_access`] says which descriptor such a ring may
//!   use for a storage and with what alignment. `qimg::Queue` is built on it.
//! * [`BounceStorage`]: a wrapper that makes an O_DIRECT backend accept any request, bouncing
//!   unaligned ones through aligned buffers (read-modify-write for writes, ordered by block
//!   range locks).
//!
//! Every backend passes the same conformance suite (`qimg_io::conformance`, behind the
//! `conformance` feature).
//!
//! ## The contract in brief
//!
//! The full contract is on [`Storage`]. In short:
//!
//! * Futures are `Send` and need no particular executor (the io_uring backend collects
//!   completions on its own thread and wakes tasks through their wakers).
//! * [`Storage::read_at`] fills the whole buffer or fails with
//!   [`StorageError::UnexpectedEof`]; [`Storage::read_at_zero_fill`] reads past the end as
//!   zeros (for short backing files).
//! * [`Storage::flush`] makes every modification completed before it durable (`fdatasync`).
//! * [`Storage::discard`] is advisory: it deallocates (the range then reads as zeros) or does
//!   nothing, and says which. Use [`Storage::write_zeroes`] when zeros are needed.
//! * With O_DIRECT, data requests must be aligned to [`Storage::request_alignment`] and
//!   buffers to [`Storage::mem_alignment`] ([`AlignedBuf`] provides such buffers); otherwise
//!   they fail with [`StorageError::Misaligned`]. Buffered backends report 1 for both.
//! * Every error is a [`StorageError`] naming the operation, offset and length; it converts
//!   into [`std::io::Error`] with a matching [`std::io::ErrorKind`].
//!
//! ## Unsafe code
//!
//! The crate denies `unsafe` everywhere except the io_uring backend (`src/uring/`) and the
//! per-queue rings (`src/queue/`), both allowed with `#[allow(unsafe_code)]` on the module; the file backend uses `nix`'s safe wrappers and
//! [`AlignedBuf`] aligns by over-allocating. Each block has a `// SAFETY:` comment; in short:
//!
//! 1. **`unsafe impl Send for Iovec`** (`uring/submission.rs`; the `iovec` handed to
//!    `READV`/`WRITEV`). `libc::iovec` is `!Send` only because it holds a raw pointer; ours points
//!    into the bounce buffer of the same request, is dereferenced only by the kernel, and moves
//!    with that buffer.
//! 2. **`completion_shared()` in `Shared::reap`** (`uring/driver.rs`). It requires that no other
//!    view of the completion queue exists at the same time. It is called only with the ring's
//!    driver mutex held (the function takes `&mut Driver`, which only the mutex guard provides),
//!    and the view is dropped before the function returns.
//! 3. **`submission_shared()` in `Shared::unsubmitted`** (`uring/driver.rs`): the same argument for
//!    the submission queue.
//! 4. **`Shared::push`** (`uring/driver.rs`, an `unsafe fn`) wraps `submission_shared()` (exclusive
//!    as above) and `SubmissionQueue::push`, passing on the latter's contract to its callers: the
//!    entry's memory and descriptor must stay valid until its completion is reaped.
//! 5. **`push` of a request in `Request::step`** (`uring/request.rs`). The entry points only into
//!    the request's bounce buffer and boxed `iovec`, which were moved into the request's slot
//!    *before* the pointers were taken (moving them moves no heap block) and lengths are capped at
//!    the buffer's. A slot is emptied only after the completion with its index was reaped: by its
//!    future (state `Done`), by the reaper if the future was dropped (state `Abandoned`), and the
//!    ring and slots are dropped only after the completion thread (and `Drop for Shared`) saw no
//!    slot left with the kernel. Dropping a future early therefore cannot free memory the kernel
//!    still writes to or reads from. The descriptor belongs to the storage's [`FileStorage`], which
//!    lives as long as the ring.
//! 6. **`push` of the shutdown no-op in `Drop for Owner`** (`uring/completion.rs`): a `NOP` entry
//!    carries no pointer and no descriptor.
//! 7. **`AsyncFd::register_with_interest` in `runtime_watch`** (`uring/completion.rs`)
//!    ([`UringOptions::complete_on_runtime`]): tokio requires the descriptor to stay open and the
//!    same for the life of the `AsyncFd`; it is an `OwnedFd` (a duplicate of the ring's) owned by
//!    the `AsyncFd` itself.
//! 8. **`unsafe impl Send`/`Sync` for `Memory`** (`queue/buffers.rs`): the segment pointers of
//!    [`queue::IoBuffers`] point into owned buffers that move with the value, or into memory the
//!    caller of the `unsafe fn IoBuffers::from_raw` promised valid and unaliased until the
//!    request completes. Rust references to the bytes are made only while no ring operation
//!    holds the memory (`Arc` uniqueness), and a ring read (the kernel writes) needs `&mut`.
//! 9. **`slice::from_raw_parts(_mut)` in `IoBuffers::slices(_mut)`**: under the same
//!    uniqueness check, over segments valid by construction (owned) or by `from_raw`'s contract.
//! 10. **`unsafe impl Send for Iovecs`** and **`SubmissionQueue::push` in `QueueRing::push`**
//!     (`queue/ring.rs`): the entry points into the slot's boxed iovec array and the lent
//!     memory, which the slot keeps (an `Arc`) until the completion with that slot's index is
//!     reaped; `Drop` waits for every completion (and leaks the slots rather than free them if
//!     it cannot wait). `&mut self` makes each push the only access to the submission queue.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod aligned;
mod any;
pub mod blkdebug;
mod bounce;
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod error;
mod faulty;
mod file;
pub mod holes;
mod image_lock;
mod mem;
pub mod nbd;
pub mod null;
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
pub mod queue;
mod storage;
pub mod threads;
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
mod uring;
pub mod window;

pub use aligned::AlignedBuf;
pub use any::{AnyStorage, Backend};
pub use blkdebug::{BlkdebugConfig, BlkdebugStorage, DebugEvent};
pub use bounce::BounceStorage;
pub use error::{MAX_OFFSET, Op, Result, StorageError};
pub use faulty::{
    CRASH_SECTOR, CrashPolicy, FaultAction, FaultController, FaultPlan, FaultyStorage, OpCounts,
    OpFilter,
};
pub use file::{BlockingStrategy, FileOptions, FileStorage};
pub use image_lock::{HeldImageLock, ImageLock};
pub use mem::MemStorage;
pub use nbd::NbdStorage;
pub use null::{NullOptions, NullStorage};
pub use storage::{AllocateOutcome, DirectAccess, DiscardOutcome, Storage, ZeroOutcome};
#[cfg(target_os = "linux")]
pub use uring::{UringOptions, UringStorage};
pub use window::{WindowOptions, WindowStorage};

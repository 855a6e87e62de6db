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
//! An io_uring backend comes later; every backend passes the same conformance suite
//! (`qimg_io::conformance`, behind the `conformance` feature).
//!
//! ## The contract in brief
//!
//! The full contract is on [`Storage`]. In short:
//!
//! * Futures are `Send` and need no particular executor.
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
//! None yet: the file backend uses `nix`'s safe wrappers and [`AlignedBuf`] aligns by
//! over-allocating. The io_uring backend will need `unsafe`; it will be the only module
//! allowed it, each block with a `// SAFETY:` proof.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod aligned;
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod error;
mod faulty;
mod file;
mod mem;
mod storage;

pub use aligned::AlignedBuf;
pub use error::{MAX_OFFSET, Op, Result, StorageError};
pub use faulty::{
    CRASH_SECTOR, CrashPolicy, FaultAction, FaultController, FaultPlan, FaultyStorage, OpCounts,
    OpFilter,
};
pub use file::{BlockingStrategy, FileOptions, FileStorage};
pub use mem::MemStorage;
pub use storage::{AllocateOutcome, DiscardOutcome, Storage, ZeroOutcome};

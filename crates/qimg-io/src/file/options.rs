//! How a file is opened: [`FileOptions`] and the [`BlockingStrategy`] of its system calls.

use super::*;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use nix::fcntl::OFlag;

use crate::error::{Result, StorageError};

/// Where [`FileStorage`] runs its blocking system calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum BlockingStrategy {
    /// In the future's `poll`, on the thread that polls it (the default). Cheapest: no copy,
    /// no thread hop, and page-cache hits return in microseconds. A request that waits on a
    /// disk blocks that executor thread meanwhile, so use a multi-threaded runtime and keep
    /// latency-sensitive tasks off the threads doing storage I/O.
    #[default]
    Inline,
    /// On tokio's blocking thread pool (`spawn_blocking`, a bounded pool that reuses threads),
    /// with buffers copied to and from an owned buffer. Keeps executor threads free at the cost
    /// of a copy and a thread hop per request. Outside a tokio runtime it behaves like
    /// [`Inline`](BlockingStrategy::Inline). Dropping the future does not cancel a request
    /// already handed to the pool: it runs to completion in the background.
    SpawnBlocking,
}

/// How to open a [`FileStorage`]: read-only or read-write, creating or not, with O_DIRECT or
/// through the page cache, and where system calls run. Starts read-only, buffered, existing
/// file, [`BlockingStrategy::Inline`].
#[derive(Debug, Clone, Default)]
pub struct FileOptions {
    pub(super) write: bool,
    pub(super) create: bool,
    pub(super) create_new: bool,
    pub(super) truncate: bool,
    pub(super) direct: bool,
    pub(super) no_fallocate: bool,
    pub(super) blocking: BlockingStrategy,
}

impl FileOptions {
    /// Read-only, buffered, the file must exist, inline system calls.
    pub fn new() -> Self {
        Self::default()
    }

    /// Open for reading and writing (`true`) or reading only (`false`).
    pub fn read_write(mut self, yes: bool) -> Self {
        self.write = yes;
        self
    }

    /// Create the file if it does not exist (needs [`read_write`](FileOptions::read_write)).
    pub fn create(mut self, yes: bool) -> Self {
        self.create = yes;
        self
    }

    /// Create the file, failing if it exists (needs [`read_write`](FileOptions::read_write)).
    pub fn create_new(mut self, yes: bool) -> Self {
        self.create_new = yes;
        self
    }

    /// Truncate the file to length 0 on open (needs [`read_write`](FileOptions::read_write)).
    pub fn truncate(mut self, yes: bool) -> Self {
        self.truncate = yes;
        self
    }

    /// Bypass the page cache with `O_DIRECT`. Data requests must then be aligned; the
    /// alignment is probed at open (see [`FileStorage::request_alignment`]).
    pub fn direct(mut self, yes: bool) -> Self {
        self.direct = yes;
        self
    }

    /// Where system calls run.
    pub fn blocking(mut self, strategy: BlockingStrategy) -> Self {
        self.blocking = strategy;
        self
    }

    /// Whether to use `fallocate` where the file system supports it (the default). With
    /// `false`, `write_zeroes` always writes zeros, `discard` does nothing and `allocate`
    /// reserves nothing, as on a file system without `fallocate`.
    pub fn fallocate(mut self, yes: bool) -> Self {
        self.no_fallocate = !yes;
        self
    }

    /// Opens `path` with these options.
    pub fn open(&self, path: impl AsRef<Path>) -> Result<FileStorage> {
        let path = path.as_ref();
        let mut o = std::fs::OpenOptions::new();
        o.read(true)
            .write(self.write)
            .create(self.create)
            .create_new(self.create_new)
            .truncate(self.truncate);
        if self.direct {
            o.custom_flags(OFlag::O_DIRECT.bits());
        }
        let file = o.open(path).map_err(|source| StorageError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let s = FileStorage::from_file(file, self.blocking)?;
        if self.no_fallocate {
            s.disable_fallocate();
        }
        Ok(s)
    }
}

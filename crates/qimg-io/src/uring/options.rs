//! [`UringOptions`]: how to open a [`UringStorage`](super::UringStorage) (file options, ring size, fallbacks,
//! inline completions, completion on the runtime). The calls that open with them,
//! [`UringOptions::open`] and [`UringOptions::from_file`], are beside [`UringStorage`](super::UringStorage).

use crate::error::Op;
use crate::file::FileOptions;

/// Ring size when none is given.
const DEFAULT_ENTRIES: u32 = 64;

/// How to open a [`UringStorage`](super::UringStorage): like [`FileOptions`] (read-only or read-write, creating or
/// not, O_DIRECT or buffered, with or without `fallocate`) plus the ring size and which
/// operations avoid the ring. Starts read-only, buffered, existing file, 64 entries.
#[derive(Debug, Clone)]
pub struct UringOptions {
    pub(super) file: FileOptions,
    pub(super) entries: u32,
    pub(super) fallocate: bool,
    pub(super) avoid: Vec<Op>,
    pub(super) inline: bool,
    pub(super) runtime: bool,
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
    /// [`UringStorage::entries`](super::UringStorage::entries) for the size obtained.
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
    /// [`FileStorage`](crate::FileStorage); the alignment is probed at open the same way.
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

    /// Runs `op` through the synchronous [`FileStorage`](crate::FileStorage) fallback even if the kernel supports
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
}

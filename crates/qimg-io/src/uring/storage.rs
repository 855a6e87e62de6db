//! [`UringStorage`]: the handle, setting up the ring (probing opcodes, starting the completion
//! side), and its accessors and request checks.

use std::fmt;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex};

use io_uring::{IoUring, Probe, opcode};

use crate::error::{Op, Result, StorageError};
use crate::file::{BlockingStrategy, FileStorage};
use crate::storage::{Storage, check_aligned};

use super::completion::{Owner, complete, reaper, runtime_watch};
use super::driver::{Driver, Shared};
use super::options::UringOptions;
use super::submission::{ReadOpcode, RingOps};

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

    pub(super) fn with_file_storage(file: FileStorage, options: &UringOptions) -> Result<Self> {
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
        let caps = RingOps {
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
            spare: Mutex::new(Vec::new()),
        });
        if let Some((handle, afd)) = watch {
            handle.spawn(reaper(Arc::downgrade(&shared), afd));
        }
        let for_thread = Arc::clone(&shared);
        let thread = crate::threads::spawn("qimg-uring", move || complete(for_thread))
            .map_err(unavailable)?;
        Ok(UringStorage {
            owner: Arc::new(Owner {
                shared,
                thread: Some(thread),
            }),
        })
    }

    pub(super) fn shared(&self) -> &Shared {
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
        let caps = &self.shared().caps;
        match op {
            Op::Read => caps.read.is_some(),
            Op::Write => caps.write,
            Op::Flush => caps.fsync,
            Op::WriteZeroes => caps.zero,
            Op::Discard => caps.discard,
            Op::Allocate => caps.allocate,
            Op::Len | Op::SetLen | Op::Probe | Op::Lock => false,
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

    pub(super) fn writable(&self, op: Op, offset: u64, len: u64) -> Result<()> {
        if self.is_read_only() {
            return Err(StorageError::ReadOnly { op, offset, len });
        }
        Ok(())
    }

    pub(super) fn aligned<'b>(
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
}

impl UringOptions {
    /// Opens `path` and sets up the ring. Fails with [`StorageError::Open`] when the file
    /// cannot be opened, and with [`StorageError::UringUnavailable`] when io_uring cannot be
    /// used on this system.
    ///
    /// [`StorageError::Open`]: crate::StorageError::Open
    /// [`StorageError::UringUnavailable`]: crate::StorageError::UringUnavailable
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

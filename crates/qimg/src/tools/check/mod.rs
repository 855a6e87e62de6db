//! Consistency check and repair of qcow2 images: what `qemu-img check [-r leaks|all]` does
//! (QEMU's `qcow2_co_check` and `qcow2_check_refcounts`, qcow2-format.md section 10).
//!
//! [`check`] (on a file) and [`check_storage`] (on any [`Storage`]) walk the header, the active L1 table and its L2 tables, every snapshot's L1 and
//! L2 tables, the snapshot table, the refcount table and blocks, a LUKS header and persistent
//! bitmaps; counts the references to every host cluster; compares them with the refcounts on
//! disk; checks the COPIED flags of the active tables; and reports the same categories,
//! counters and messages as `qemu-img check`.
//!
//! # Memory
//!
//! The computed references are kept per host cluster of the image *file* (never per cluster
//! of the virtual disk), in chunks of 16-bit counters allocated only where references exist,
//! so a sparse multi-terabyte image costs what its allocated clusters cost. Tables are read
//! one at a time: an L2 table or refcount block is one cluster, an L1 table at most 32 MiB
//! (checked before reading), the refcount table at most 8 MiB.
//!
//! # Repairs
//!
//! `Repair::Leaks` lowers refcounts that are too high (freed clusters are punched out of the
//! file). `Repair::All` also raises refcounts that are too low, rebuilds the refcount
//! structure when it is damaged (QEMU's algorithm: new blocks and table go into the first free
//! clusters, the old structure is then freed as leaks), fixes COPIED flags, and makes the dirty
//! and corrupt bits clear when nothing is left to fix. After a repair a second pass checks the
//! image again, as `qemu-img check` does.
//!
//! Where QEMU reports a corruption but cannot repair it, `Repair::All` goes further, always
//! without touching guest data that can still be read:
//!
//! * reserved bits in L1 and L2 entries are cleared, and the COPIED flag of compressed entries;
//! * a non-zero subcluster bitmap of a compressed entry is cleared (QEMU ignores it on reads);
//! * subclusters marked both allocated and zero become zero (QEMU refuses to read the whole
//!   cluster), and allocation bits of an unallocated entry become zero bits;
//! * entries QEMU cannot read at all (a data cluster at an unaligned offset, a data or
//!   compressed cluster lying one cluster or more past the end of the file, a compressed
//!   cluster in an image with an external data file) are made to read as zeros, as QEMU itself
//!   does for unaligned preallocated clusters; an L1 entry whose L2 table is unaligned or past
//!   the end of the file is cleared;
//! * a persistent bitmap QEMU cannot load (QEMU then refuses to open the image at all; the
//!   rules live in the engine's `judge_bitmaps`), one whose table lies past the end of the
//!   file, or a whole directory that does not decode, is dropped from the directory (the
//!   clusters only it held are freed as leaks by the same pass); a bitmap table entry whose
//!   data cluster lies past the end of the file becomes "all set" (QEMU's repair keeps it
//!   as "all clear", so a backup would skip what it tracked);
//! * the refcount structure is rebuilt without reusing the clusters of the damaged one (QEMU
//!   may try to and fail), and a refcount block past the end of the file leads to a rebuild
//!   instead of growing the file to reach it;
//! * a rebuild never places its structure in a cluster of a region left uncounted because it
//!   runs past the end of the file (the check still reads the part inside, e.g. a snapshot's
//!   L1 table), and is refused before anything is written (the pass fails with an
//!   input/output error, the image untouched) when it would have to grow the file so far
//!   that such a region comes within a cluster of its end: either would leave more
//!   corruptions than it found.
//!
//! Entries are only ever rewritten inside tables used as nothing but tables: a silent walk
//! before the repairing one (pretending the repairs, so that references from entries about to
//! be cleared do not count) finds them. An L2 table that is also guest data or other metadata
//! is left alone, even where QEMU would rewrite it.
//!
//! A dirty bit stays set when corruptions remain (QEMU clears it when it closes the image).
//!
//! Not repaired (reported, as QEMU does): snapshot table entries with too little extra data
//! and snapshots with too much (QEMU rewrites the whole snapshot table), refcount overflows,
//! an active L1 table past the end of the file.
//!
//! # Layout
//!
//! | module | what it holds |
//! |---|---|
//! | `report` | the public report and QEMU's signed counters |
//! | `checker` | the state of a check, its I/O and header updates |
//! | `pass` | one pass: reference counting over the whole image, refcount blocks, bitmaps |
//! | `snapshots` | reading (and trimming) the snapshot table |
//! | `l1l2` | the L1 and L2 walks, judging every entry |
//! | `entries` | rewriting single entries where a repair is safe |
//! | `overlap` | the overlap check of repair writes, on the engine's overlap index |
//! | `compare` | comparing computed references with the refcounts on disk, and fixing them |
//! | `copied` | the COPIED flags of the active tables |
//! | `rebuild` | QEMU's rebuild of the refcount structure |
//!
//! Every table is read through the engine's metadata walker (`engine::walk`) and decoded by
//! `qimg-format`; nothing here knows a byte offset or an entry mask.

mod checker;
mod compare;
mod copied;
mod entries;
mod l1l2;
mod overlap;
mod pass;
mod rebuild;
mod report;
mod snapshots;
#[cfg(test)]
mod tests;

use std::future::Future;
use std::path::Path;
use std::task::{Context, Poll, Waker};

use qimg_format::cluster0::Cluster0;
use qimg_format::header::SnapshotPointer;
use qimg_format::validate::{OpenMode, validate_cluster0};
use qimg_io::{BlockingStrategy, FileStorage, ImageLock, Storage, StorageError};
use tokio::runtime::Builder;

use checker::Checker;
pub use report::CheckReport;
use report::Counters;

use crate::error::{Error, Result};

/// What `check` may repair (`qemu-img check -r leaks|all`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repair {
    /// Lower refcounts that are higher than the references (leaked clusters).
    Leaks,
    /// Repair leaks and corruptions.
    All,
}

/// Options of [`check`].
#[derive(Debug, Clone, Default)]
pub struct CheckOptions {
    /// Repair what was found (the image is opened for writing), or only report it.
    pub repair: Option<Repair>,
    /// Check without keeping other processes from writing the image (`qemu-img check -U`):
    /// by default [`check`] takes QEMU's image locks (read, or read-write when repairing) and
    /// refuses an image another process writes. Only without `repair`.
    pub force_share: bool,
}

/// Something [`check`] reports while it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckEvent<'a> {
    /// One diagnostic line, as `qemu-img check` prints it on stderr
    /// (`Leaked cluster 5 refcount=2 reference=1`, `ERROR cluster 3 refcount=1 reference=2`,
    /// `Repairing ...`).
    Message(&'a str),
    /// The first pass repaired something; a second pass checks the repaired image now.
    Repaired {
        /// Leaked clusters freed.
        leaks_fixed: u64,
        /// Corruptions repaired.
        corruptions_fixed: u64,
    },
    /// Progress of the walk over the active L1 table of the current pass.
    Progress {
        /// L1 entries done.
        done: u64,
        /// L1 entries in all.
        total: u64,
    },
}

/// Checks (and with `opts.repair`, repairs) the qcow2 image at `path` as `qemu-img check`
/// does. Diagnostics and progress go to `events`.
///
/// Fails (`Err`) only when the image cannot be opened: not qcow2, a header QEMU would refuse
/// in check mode, an unreadable file. A check that starts but cannot complete returns a
/// report with [`CheckReport::failure`] set.
///
/// A thin wrapper over [`check_storage`]: the file is opened (for writing only when
/// repairing) as a [`FileStorage`] and the check runs on a private current-thread runtime.
pub fn check(
    path: &Path,
    opts: &CheckOptions,
    events: &mut dyn FnMut(CheckEvent<'_>),
) -> Result<CheckReport> {
    let open = |write: bool| -> Result<FileStorage> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(write)
            .open(path)
            .map_err(|e| Error::io(path, "open", e))?;
        FileStorage::from_file(file, BlockingStrategy::Inline).map_err(|e| Error::storage(path, e))
    };
    // Cluster 0 is validated before the image is opened for writing, so that an image that
    // is not qcow2 (or one QEMU refuses) is reported as such even when it is not writable.
    let read_only = open(false)?;
    let lock = match (opts.repair, opts.force_share) {
        (None, true) => ImageLock::SharedRead,
        (None, false) => ImageLock::Read,
        (Some(_), false) => ImageLock::ReadWrite,
        (Some(_), true) => {
            return Err(Error::InvalidOption(format!(
                "{}: force-share (-U) can only be used without repairing",
                path.display()
            )));
        }
    };
    // The external data file must open, as at QEMU's open (the check does not read it).
    if let Ok(c0) = block_on(path, read_cluster0(&read_only, path))? {
        if let Some(name) = c0.data_file() {
            let data = crate::chain::resolve_backing(path, &String::from_utf8_lossy(name));
            std::fs::OpenOptions::new()
                .read(true)
                .write(opts.repair.is_some())
                .open(&data)
                .map_err(|source| {
                    Error::storage(
                        &data,
                        StorageError::Open {
                            path: data.clone(),
                            source,
                        },
                    )
                })?;
        }
    }
    if opts.repair.is_none() {
        read_only
            .lock_image(lock)
            .map_err(|e| Error::storage(path, e))?;
        return block_on(path, check_storage(&read_only, path, opts, events))?;
    }
    block_on(path, read_cluster0(&read_only, path))??;
    drop(read_only);
    let writable = open(true)?;
    writable
        .lock_image(lock)
        .map_err(|e| Error::storage(path, e))?;
    block_on(path, check_storage(&writable, path, opts, events))?
}

/// Runs `fut` to completion on the calling thread: on a private current-thread runtime, or,
/// when called from inside a runtime (tokio refuses to nest them: an async caller, a test
/// harness), by polling it here. The latter never spins: the file storage is opened with
/// [`BlockingStrategy::Inline`], so every call completes when first polled.
fn block_on<F: Future>(path: &Path, fut: F) -> Result<F::Output> {
    if tokio::runtime::Handle::try_current().is_err() {
        let rt = Builder::new_current_thread()
            .build()
            .map_err(|e| Error::io(path, "start the I/O runtime", e))?;
        return Ok(rt.block_on(fut));
    }
    let mut fut = std::pin::pin!(fut);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return Ok(v);
        }
        std::thread::yield_now();
    }
}

/// [`check`] on any storage: checks (and with `opts.repair`, repairs) the qcow2 image held by
/// `file`; `name` is the file name the report and errors carry. `file` must be writable when
/// `opts.repair` is set. Freed clusters are discarded through [`Storage::discard`].
pub async fn check_storage<S: Storage>(
    file: &S,
    name: &Path,
    opts: &CheckOptions,
    events: &mut dyn FnMut(CheckEvent<'_>),
) -> Result<CheckReport> {
    let c0 = read_cluster0(file, name).await?;
    let writable = opts.repair.is_some();
    let mut ck = Checker::open(file, name, &c0, writable, events).await?;
    let fix = match opts.repair {
        None => RepairScope::NONE,
        Some(Repair::Leaks) => RepairScope {
            leaks: true,
            corruptions: false,
        },
        Some(Repair::All) => RepairScope {
            leaks: true,
            corruptions: true,
        },
    };
    let name = name.display().to_string();
    if let Err(f) = ck.drop_unknown_autoclear(&c0.header).await {
        return Ok(failed(name, f));
    }
    let first = ck.check_pass(fix).await;
    let mut report = match first {
        Err(f) => return Ok(failed(name, f)),
        Ok(r) => r,
    };
    if report.corruptions_fixed > 0 || report.leaks_fixed > 0 {
        let (leaks_fixed, corruptions_fixed) = (report.leaks_fixed, report.corruptions_fixed);
        (ck.events)(CheckEvent::Repaired {
            leaks_fixed,
            corruptions_fixed,
        });
        report = match ck.check_pass(RepairScope::NONE).await {
            Err(f) => return Ok(failed(name, f)),
            Ok(r) => r,
        };
        report.leaks_fixed = leaks_fixed;
        report.corruptions_fixed = corruptions_fixed;
        // Beyond QEMU: a first pass that needed a rebuild keeps its check errors (refcounts
        // that could not be read before the rebuild) and so does not clear the flags; the
        // second pass proves the image consistent, so clear them now.
        if report.corruptions == 0 && report.check_errors == 0 {
            if let Err(f) = ck.mark_clean_and_consistent().await {
                return Ok(failed(name, f));
            }
        }
    }
    if writable {
        // QEMU also clears the dirty bit when it closes the image, even when corruptions
        // remain; qimg keeps it then, so that the next writable open still rebuilds refcounts.
        if let Err(e) = ck.file.flush().await {
            let e = storage_io_error(e);
            return Ok(failed(name, Failure(format!("flush failed: {e}"))));
        }
    }
    report.filename = name;
    report.format = "qcow2".into();
    Ok(report)
}

/// Cluster 0, validated as QEMU opens an image for a check: the snapshot table pointer is
/// not looked at (the check reads and validates it itself, and `-r all` may repair it).
async fn read_cluster0<S: Storage>(file: &S, path: &Path) -> Result<Cluster0> {
    let len = file
        .len()
        .await
        .map_err(|e| Error::io(path, "stat", storage_io_error(e)))?;
    let bytes = crate::chain::cluster0_bytes(file, len)
        .await
        .map_err(|e| Error::io(path, "read cluster 0", storage_io_error(e)))?;
    let mut masked = bytes.clone();
    SnapshotPointer::clear_in(&mut masked);
    validate_cluster0(&masked, OpenMode::Check).map_err(|e| Error::format(path, e))?;
    // The same bytes again, snapshot pointer included (nothing else depends on it).
    let mut c0 = Cluster0::decode(&bytes).map_err(|e| Error::format(path, e))?;
    c0.header.nb_snapshots = 0;
    Ok(c0)
}

fn failed(filename: String, f: Failure) -> CheckReport {
    CheckReport {
        filename,
        format: "qcow2".into(),
        failure: Some(f.0),
        ..Default::default()
    }
}

/// Why a pass stopped (QEMU: a negative errno, printed with `strerror`).
#[derive(Debug, Clone)]
struct Failure(String);

const EIO: &str = "Input/output error";
const EFBIG: &str = "File too large";
const EINVAL: &str = "Invalid argument";

fn io_failure(e: &std::io::Error) -> Failure {
    Failure(strerror(e))
}

/// A storage error as the `std::io::Error` QEMU's errno would be: the OS error where there
/// is one, `EINVAL` for a range the kernel would refuse (an offset past `i64::MAX`), so that
/// messages read as they did when check used `pread`/`pwrite` directly.
fn storage_io_error(e: StorageError) -> std::io::Error {
    match e {
        StorageError::Io { source, .. }
        | StorageError::Open { source, .. }
        | StorageError::UringUnavailable { source } => source,
        StorageError::OutOfRange { .. } | StorageError::Misaligned { .. } => {
            std::io::Error::from_raw_os_error(22)
        }
        StorageError::ReadOnly { .. } => std::io::Error::other("the image is open read-only"),
        other => std::io::Error::other(other.to_string()),
    }
}

fn strerror(e: &std::io::Error) -> String {
    let s = e.to_string();
    match s.find(" (os error") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

/// What a pass may fix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RepairScope {
    /// Lower refcounts that are too high.
    leaks: bool,
    /// Repair corruptions (refcounts too low, damaged entries, COPIED flags).
    corruptions: bool,
}

impl RepairScope {
    const NONE: Self = Self {
        leaks: false,
        corruptions: false,
    };

    fn any(self) -> bool {
        self.leaks || self.corruptions
    }
}

//! Consistency check and repair of qcow2 images: what `qemu-img check [-r leaks|all]` does
//! (QEMU's `qcow2_co_check` and `qcow2_check_refcounts`, qcow2-format.md section 10).
//!
//! [`check`] walks the header, the active L1 table and its L2 tables, every snapshot's L1 and
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
//! * the refcount structure is rebuilt without reusing the clusters of the damaged one (QEMU
//!   may try to and fail), and a refcount block past the end of the file leads to a rebuild
//!   instead of growing the file to reach it.
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

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use serde::Serialize;

use qimg_format::bitmap::{TABLE_ENTRY_RESERVED, decode_directory};
use qimg_format::extensions::{Cluster0, Extension};
use qimg_format::features::{
    AUTOCLEAR_BITMAPS, INCOMPAT_CORRUPT, INCOMPAT_DATA_FILE, INCOMPAT_DIRTY,
};
use qimg_format::l1::{L1E_OFFSET_MASK, L1E_RESERVED_MASK, QCOW_OFLAG_COPIED};
use qimg_format::l2::{
    L2E_OFFSET_MASK, L2E_STD_RESERVED_MASK, QCOW_OFLAG_COMPRESSED, QCOW_OFLAG_ZERO,
};
use qimg_format::refcount::{self, REFT_OFFSET_MASK, REFT_RESERVED_MASK};
use qimg_format::validate::{MAX_L1_BYTES, MAX_REFTABLE_BYTES, OpenMode, validate_cluster0};

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

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// The result of a check, with `qemu-img check --output=json`'s field names (QAPI
/// `ImageCheck`). Counters that are zero are left out of the JSON, except `check-errors`;
/// the fields are in the order qemu-img prints them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CheckReport {
    /// End of the last cluster in use (referenced or with a refcount), in bytes.
    #[serde(rename = "image-end-offset", skip_serializing_if = "is_zero")]
    pub image_end_offset: u64,
    /// Compressed clusters among the allocated ones.
    #[serde(rename = "compressed-clusters", skip_serializing_if = "is_zero")]
    pub compressed_clusters: u64,
    /// Clusters of the virtual disk.
    #[serde(rename = "total-clusters", skip_serializing_if = "is_zero")]
    pub total_clusters: u64,
    /// Corruptions found and not repaired.
    #[serde(skip_serializing_if = "is_zero")]
    pub corruptions: u64,
    /// Corruptions repaired.
    #[serde(rename = "corruptions-fixed", skip_serializing_if = "is_zero")]
    pub corruptions_fixed: u64,
    /// Internal errors (I/O errors, impossible repairs): the check is not complete.
    #[serde(rename = "check-errors")]
    pub check_errors: u64,
    /// Leaked clusters found and not freed.
    #[serde(skip_serializing_if = "is_zero")]
    pub leaks: u64,
    /// Leaked clusters freed.
    #[serde(rename = "leaks-fixed", skip_serializing_if = "is_zero")]
    pub leaks_fixed: u64,
    /// Guest clusters mapped by the active L1 table (data, preallocated or compressed).
    #[serde(rename = "allocated-clusters", skip_serializing_if = "is_zero")]
    pub allocated_clusters: u64,
    /// The image file name as given.
    pub filename: String,
    /// Always `qcow2`.
    pub format: String,
    /// Allocated clusters not contiguous with the previous one of their L2 table (every
    /// compressed cluster counts).
    #[serde(rename = "fragmented-clusters", skip_serializing_if = "is_zero")]
    pub fragmented_clusters: u64,
    /// Set when the check could not be completed (qemu-img prints `Check failed: ...` and
    /// nothing else); the counters are then meaningless.
    #[serde(skip)]
    pub failure: Option<String>,
}

impl CheckReport {
    /// `qemu-img check`'s exit code: 0 clean, 1 check not completed (failure or check
    /// errors), 2 corruptions, 3 leaks only.
    pub fn exit_code(&self) -> u8 {
        if self.failure.is_some() || self.check_errors > 0 {
            1
        } else if self.corruptions > 0 {
            2
        } else if self.leaks > 0 {
            3
        } else {
            0
        }
    }
}

/// Checks (and with `opts.repair`, repairs) the qcow2 image at `path` as `qemu-img check`
/// does. Diagnostics and progress go to `events`.
///
/// Fails (`Err`) only when the image cannot be opened: not qcow2, a header QEMU would refuse
/// in check mode, an unreadable file. A check that starts but cannot complete returns a
/// report with [`CheckReport::failure`] set.
pub fn check(
    path: &Path,
    opts: &CheckOptions,
    events: &mut dyn FnMut(CheckEvent<'_>),
) -> Result<CheckReport> {
    let c0 = read_cluster0(path)?;
    let writable = opts.repair.is_some();
    let mut ck = Checker::open(path, &c0, writable, events)?;
    let fix = match opts.repair {
        None => Fix::NONE,
        Some(Repair::Leaks) => Fix {
            leaks: true,
            errors: false,
        },
        Some(Repair::All) => Fix {
            leaks: true,
            errors: true,
        },
    };
    let name = path.display().to_string();
    let first = ck.check_pass(fix);
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
        report = match ck.check_pass(Fix::NONE) {
            Err(f) => return Ok(failed(name, f)),
            Ok(r) => r,
        };
        report.leaks_fixed = leaks_fixed;
        report.corruptions_fixed = corruptions_fixed;
        // Beyond QEMU: a first pass that needed a rebuild keeps its check errors (refcounts
        // that could not be read before the rebuild) and so does not clear the flags; the
        // second pass proves the image consistent, so clear them now.
        if report.corruptions == 0 && report.check_errors == 0 {
            if let Err(f) = ck.mark_clean_and_consistent() {
                return Ok(failed(name, f));
            }
        }
    }
    if writable {
        // QEMU also clears the dirty bit when it closes the image, even when corruptions
        // remain; qimg keeps it then, so that the next writable open still rebuilds refcounts.
        if let Err(e) = ck.file.sync_all() {
            return Ok(failed(name, Fail(format!("flush failed: {e}"))));
        }
    }
    report.filename = name;
    report.format = "qcow2".into();
    Ok(report)
}

/// Cluster 0, validated as QEMU opens an image for a check: the snapshot table pointer is
/// not looked at (the check reads and validates it itself, and `-r all` may repair it).
fn read_cluster0(path: &Path) -> Result<Cluster0> {
    const MAX_CLUSTER0: u64 = 2 << 20;
    let f = File::open(path).map_err(|e| Error::io(path, "open", e))?;
    let len = f.metadata().map_err(|e| Error::io(path, "stat", e))?.len();
    let mut bytes = vec![0u8; len.clamp(512, MAX_CLUSTER0) as usize];
    let n = len.min(MAX_CLUSTER0) as usize;
    f.read_exact_at(&mut bytes[..n], 0)
        .map_err(|e| Error::io(path, format!("read {n} bytes at 0x0"), e))?;
    if let Ok(h) = qimg_format::header::Header::decode(&bytes) {
        if let Some(cs) = h.cluster_size().filter(|&c| c <= MAX_CLUSTER0) {
            bytes.resize(cs as usize, 0);
        }
    }
    let mut masked = bytes.clone();
    if masked.len() >= 72 {
        masked[60..72].fill(0);
    }
    validate_cluster0(&masked, OpenMode::Check).map_err(|e| Error::format(path, e))?;
    // The same bytes again, snapshot pointer included (nothing else depends on it).
    let mut c0 = Cluster0::decode(&bytes).map_err(|e| Error::format(path, e))?;
    c0.header.nb_snapshots = 0;
    Ok(c0)
}

fn failed(filename: String, f: Fail) -> CheckReport {
    CheckReport {
        filename,
        format: "qcow2".into(),
        failure: Some(f.0),
        ..Default::default()
    }
}

/// Why a pass stopped (QEMU: a negative errno, printed with `strerror`).
#[derive(Debug, Clone)]
struct Fail(String);

const EIO: &str = "Input/output error";
const EFBIG: &str = "File too large";
const EINVAL: &str = "Invalid argument";

fn io_fail(e: &std::io::Error) -> Fail {
    Fail(strerror(e))
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
struct Fix {
    leaks: bool,
    errors: bool,
}

impl Fix {
    const NONE: Self = Self {
        leaks: false,
        errors: false,
    };

    fn any(self) -> bool {
        self.leaks || self.errors
    }
}

/// QEMU's `BdrvCheckResult` (signed: QEMU counts up and back down).
#[derive(Debug, Clone, Copy, Default)]
struct Res {
    corruptions: i64,
    leaks: i64,
    check_errors: i64,
    corruptions_fixed: i64,
    leaks_fixed: i64,
    image_end_offset: u64,
    total_clusters: u64,
    allocated_clusters: u64,
    fragmented_clusters: u64,
    compressed_clusters: u64,
}

impl Res {
    fn add(&mut self, o: &Res, allocation_info: bool) {
        self.corruptions += o.corruptions;
        self.leaks += o.leaks;
        self.check_errors += o.check_errors;
        self.corruptions_fixed += o.corruptions_fixed;
        self.leaks_fixed += o.leaks_fixed;
        if allocation_info {
            self.image_end_offset = o.image_end_offset;
            self.total_clusters = o.total_clusters;
            self.allocated_clusters = o.allocated_clusters;
            self.fragmented_clusters = o.fragmented_clusters;
            self.compressed_clusters = o.compressed_clusters;
        }
    }

    fn report(&self) -> CheckReport {
        let n = |v: i64| v.max(0) as u64;
        CheckReport {
            image_end_offset: self.image_end_offset,
            compressed_clusters: self.compressed_clusters,
            total_clusters: self.total_clusters,
            corruptions: n(self.corruptions),
            corruptions_fixed: n(self.corruptions_fixed),
            check_errors: n(self.check_errors),
            leaks: n(self.leaks),
            leaks_fixed: n(self.leaks_fixed),
            allocated_clusters: self.allocated_clusters,
            filename: String::new(),
            format: String::new(),
            fragmented_clusters: self.fragmented_clusters,
            failure: None,
        }
    }
}

// ----- the computed references -----

const CHUNK: u64 = 4096;

/// Computed references per host cluster: 16-bit counters in chunks allocated where references
/// exist, with larger values kept aside. `size` is QEMU's `nb_clusters`: the clusters of the
/// file, grown by references just past its end and by rebuild allocations.
#[derive(Debug, Default)]
struct Refs {
    chunks: BTreeMap<u64, Box<[u16]>>,
    big: HashMap<u64, u64>,
    size: u64,
}

impl Refs {
    fn get(&self, c: u64) -> u64 {
        match self.chunks.get(&(c / CHUNK)) {
            None => 0,
            Some(ch) => {
                let v = ch[(c % CHUNK) as usize];
                if v == u16::MAX {
                    self.big.get(&c).copied().unwrap_or(u64::from(u16::MAX))
                } else {
                    u64::from(v)
                }
            }
        }
    }

    fn set(&mut self, c: u64, v: u64) {
        if v == 0 && !self.chunks.contains_key(&(c / CHUNK)) {
            return;
        }
        let ch = self
            .chunks
            .entry(c / CHUNK)
            .or_insert_with(|| vec![0u16; CHUNK as usize].into_boxed_slice());
        let i = (c % CHUNK) as usize;
        if v >= u64::from(u16::MAX) {
            ch[i] = u16::MAX;
            self.big.insert(c, v);
        } else {
            ch[i] = v as u16;
            self.big.remove(&c);
        }
    }

    fn clear(&mut self) {
        self.chunks.clear();
        self.big.clear();
    }

    /// The parts of `[from, to)` that lie in allocated chunks, ascending (at most one per
    /// chunk: [`nonzero_in`](Self::nonzero_in) on each returns at most `CHUNK` clusters).
    fn windows(&self, from: u64, to: u64) -> Vec<(u64, u64)> {
        if from >= to {
            return Vec::new();
        }
        self.chunks
            .range(from / CHUNK..=(to - 1) / CHUNK)
            .map(|(&k, _)| (from.max(k * CHUNK), to.min((k + 1) * CHUNK)))
            .collect()
    }

    /// Clusters in `[from, to)` with a non-zero count, ascending.
    fn nonzero_in(&self, from: u64, to: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        if from >= to {
            return out;
        }
        for (&k, ch) in self.chunks.range(from / CHUNK..=(to - 1) / CHUNK) {
            let base = k * CHUNK;
            for (i, &v) in ch.iter().enumerate() {
                let c = base + i as u64;
                if v != 0 && c >= from && c < to {
                    out.push((c, self.get(c)));
                }
            }
        }
        out
    }

    /// The first cluster in `[from, to)` with a non-zero count.
    fn next_nonzero(&self, from: u64, to: u64) -> Option<u64> {
        if from >= to {
            return None;
        }
        for (&k, ch) in self.chunks.range(from / CHUNK..=(to - 1) / CHUNK) {
            let base = k * CHUNK;
            let start = from.saturating_sub(base) as usize;
            for (i, &v) in ch.get(start..).unwrap_or(&[]).iter().enumerate() {
                let c = base + (start + i) as u64;
                if c >= to {
                    return None;
                }
                if v != 0 {
                    return Some(c);
                }
            }
        }
        None
    }
}

// ----- cluster types -----

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClusterType {
    Unallocated,
    ZeroPlain,
    ZeroAlloc,
    Normal,
    Compressed,
}

const ALL_ALLOC: u64 = 0x0000_0000_FFFF_FFFF;
const ALL_ZEROES: u64 = 0xFFFF_FFFF_0000_0000;
/// Bitmap table entry: offset bits.
const BME_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// Largest snapshot table (QEMU).
const MAX_SNAPSHOTS_SIZE: u64 = 1024 * 65536;
const MAX_SNAPSHOTS: u32 = 65536;
const SNAPSHOT_HEADER: u64 = 40;
/// QEMU's known snapshot extra data (vm state size, disk size, icount).
const KNOWN_EXTRA: u64 = 24;
/// Clusters past the end of the file remembered as referenced by uncounted ranges.
const BEYOND_EOF_WINDOW: u64 = 4096;

/// `%#x` as C prints it: `0` for zero.
fn c_hex(v: u64) -> String {
    if v == 0 {
        "0".into()
    } else {
        format!("{v:#x}")
    }
}

/// Metadata areas a repair write must not touch (QEMU's overlap check, "cached" template).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Area {
    ActiveL1,
    ActiveL2,
    InactiveL1,
    InactiveL2,
}

#[derive(Debug, Clone)]
struct Snap {
    l1_offset: u64,
    l1_size: u32,
    id: String,
    name: String,
    extra_data_size: u32,
}

enum ZeroFix {
    /// The L2 table is also used as something else: not touched.
    Shared,
    Done,
    Overlap,
    Failed,
}

struct Checker<'a> {
    file: File,
    writable: bool,
    file_len: u64,
    cb: u32,
    cs: u64,
    extended: bool,
    entry_size: u64,
    version: u32,
    data_file: bool,
    total_sectors: u64,
    order: u32,
    refcount_max: u64,
    /// Refcounts per refcount block.
    entries: u64,
    l1_offset: u64,
    l1_size: u32,
    /// The active L1 table as loaded at open (QEMU's `s->l1_table`), raw.
    l1: Vec<u64>,
    reftable_offset: u64,
    reftable: Vec<u64>,
    /// Index of `l1` and `reftable` for the overlap check; `None` until first use and
    /// whenever a whole table was replaced.
    starts: Option<TableStarts>,
    incompatible: u64,
    nb_snapshots: u32,
    snapshots_offset: u64,
    snapshots_size: u64,
    snapshots: Vec<Snap>,
    bitmaps: Option<(u64, u64, u32)>,
    crypto: Option<(u64, u64)>,
    refs: Refs,
    /// Clusters just past the end of the file that entries refer to although their ranges
    /// were not counted (past the end): a rebuild must not place its structure there.
    beyond_eof: BTreeSet<u64>,
    /// How often each cluster is used as (part of) an L1 or L2 table in the current walk.
    table_uses: HashMap<u64, u64>,
    /// With `-r all`: the clusters of tables referenced as nothing else (from a silent walk
    /// before the repairing one). Entries are only rewritten inside those, so that a table
    /// that is also guest data or other metadata is never changed.
    exclusive: Option<HashSet<u64>>,
    /// The silent walk: messages and progress are not reported, and repairs are only
    /// pretended (nothing is written), so that the references corrupt entries would lose are
    /// not counted.
    mute: bool,
    cache: HashMap<u64, Vec<u8>>,
    signaled_corruption: bool,
    /// Entry repairs were written since the last sync (`sync_entries`).
    unsynced: bool,
    /// Clusters whose refcount repairs must not change what COPIED says (named by entries
    /// of shared tables, see `mismatch`).
    keep_copied: HashSet<u64>,
    events: &'a mut dyn FnMut(CheckEvent<'_>),
}

impl<'a> Checker<'a> {
    fn open(
        path: &Path,
        c0: &Cluster0,
        writable: bool,
        events: &'a mut dyn FnMut(CheckEvent<'_>),
    ) -> Result<Self> {
        let h = &c0.header;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(writable)
            .open(path)
            .map_err(|e| Error::io(path, "open", e))?;
        let file_len = file
            .metadata()
            .map_err(|e| Error::io(path, "stat", e))?
            .len();
        let cb = h.cluster_bits;
        let cs = 1u64 << cb;
        let extended = h.extended_l2();
        let order = if h.version >= 3 { h.refcount_order } else { 4 };
        let bits = 1u32 << order;
        let refcount_max = if bits >= 64 {
            u64::MAX
        } else {
            (1u64 << bits) - 1
        };
        let entries = cs * 8 / u64::from(bits);
        let mut ck = Self {
            file,
            writable,
            file_len,
            cb,
            cs,
            extended,
            entry_size: if extended { 16 } else { 8 },
            version: h.version,
            data_file: h.incompatible_features & INCOMPAT_DATA_FILE != 0,
            total_sectors: h.size / 512,
            order,
            refcount_max,
            entries,
            l1_offset: h.l1_table_offset,
            l1_size: h.l1_size,
            l1: Vec::new(),
            reftable_offset: h.refcount_table_offset,
            reftable: Vec::new(),
            starts: None,
            incompatible: h.incompatible_features,
            nb_snapshots: h.nb_snapshots,
            snapshots_offset: h.snapshots_offset,
            snapshots_size: 0,
            snapshots: Vec::new(),
            bitmaps: None,
            crypto: None,
            refs: Refs::default(),
            beyond_eof: BTreeSet::new(),
            table_uses: HashMap::new(),
            exclusive: None,
            mute: false,
            cache: HashMap::new(),
            signaled_corruption: false,
            unsynced: false,
            keep_copied: HashSet::new(),
            events,
        };
        // Both sizes were bounded by the header validation (32 MiB and 8 MiB).
        let l1_bytes = u64::from(h.l1_size) * 8;
        let rt_bytes = u64::from(h.refcount_table_clusters) * cs;
        if l1_bytes > MAX_L1_BYTES || rt_bytes > MAX_REFTABLE_BYTES {
            return Err(Error::corrupt(
                path,
                format!(
                    "L1 table of {} entries or refcount table of {} clusters is too large",
                    h.l1_size, h.refcount_table_clusters
                ),
            ));
        }
        ck.l1 = ck.read_words(h.l1_table_offset, l1_bytes).map_err(|e| {
            Error::io(
                path,
                format!("read the L1 table at {:#x}", h.l1_table_offset),
                e,
            )
        })?;
        ck.reftable = ck
            .read_words(h.refcount_table_offset, rt_bytes)
            .map_err(|e| {
                Error::io(
                    path,
                    format!("read the refcount table at {:#x}", h.refcount_table_offset),
                    e,
                )
            })?;
        if h.autoclear_features & AUTOCLEAR_BITMAPS != 0 {
            if let Some(b) = c0.bitmaps() {
                ck.bitmaps = Some((b.directory_offset, b.directory_size, b.nb_bitmaps));
            }
        }
        if h.crypt_method == 2 {
            ck.crypto = c0.extensions.iter().find_map(|e| match e {
                Extension::Crypto { offset, length } => Some((*offset, *length)),
                _ => None,
            });
        }
        Ok(ck)
    }

    // ----- I/O -----

    fn msg(&mut self, s: String) {
        if self.mute {
            return;
        }
        (self.events)(CheckEvent::Message(&s));
    }

    /// Reads `buf` at `off`; bytes past the end of the file read as zeros (as QEMU's block
    /// layer does).
    fn read_zero(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        let mut done = 0usize;
        while done < buf.len() {
            let Some(at) = off.checked_add(done as u64) else {
                break;
            };
            match self.file.read_at(&mut buf[done..], at) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        buf[done..].fill(0);
        Ok(())
    }

    fn read_words(&self, off: u64, bytes: u64) -> std::io::Result<Vec<u64>> {
        let mut raw = vec![0u8; bytes as usize];
        self.read_zero(&mut raw, off)?;
        Ok(raw
            .chunks_exact(8)
            .map(|c| u64::from_be_bytes(c.try_into().unwrap_or([0; 8])))
            .collect())
    }

    fn write(&mut self, buf: &[u8], off: u64) -> std::io::Result<()> {
        if self.mute {
            return Ok(());
        }
        if !self.writable {
            return Err(std::io::Error::other("the image is open read-only"));
        }
        self.file.write_all_at(buf, off)?;
        self.file_len = self.file_len.max(off + buf.len() as u64);
        Ok(())
    }

    fn sync(&self) -> std::io::Result<()> {
        self.file.sync_data()
    }

    fn size_to_clusters(&self, bytes: u64) -> u64 {
        bytes.div_ceil(self.cs)
    }

    fn write_incompatible(&mut self, bits: u64) -> std::result::Result<(), Fail> {
        self.write(&bits.to_be_bytes(), 72)
            .map_err(|e| io_fail(&e))?;
        self.sync().map_err(|e| io_fail(&e))?;
        self.incompatible = bits;
        Ok(())
    }

    fn clear_incompatible(&mut self, bits: u64) -> std::result::Result<(), Fail> {
        if self.incompatible & bits != 0 {
            self.sync().map_err(|e| io_fail(&e))?;
            self.write_incompatible(self.incompatible & !bits)?;
        }
        Ok(())
    }

    fn mark_clean_and_consistent(&mut self) -> std::result::Result<(), Fail> {
        self.clear_incompatible(INCOMPAT_DIRTY)?;
        self.clear_incompatible(INCOMPAT_CORRUPT)
    }

    /// QEMU's `qcow2_signal_corruption`: fatal events on a writable image set the corrupt bit.
    fn signal_corruption(&mut self, fatal: bool, what: String) {
        let fatal = fatal && self.writable;
        if self.signaled_corruption && (!fatal || self.incompatible & INCOMPAT_CORRUPT != 0) {
            return;
        }
        if fatal {
            self.msg(format!(
                "qcow2: Marking image as corrupt: {what}; further corruption events will be suppressed"
            ));
            let bits = self.incompatible | INCOMPAT_CORRUPT;
            let _ = self.write_incompatible(bits);
        } else {
            self.msg(format!(
                "qcow2: Image is corrupt: {what}; further non-fatal corruption events will be suppressed"
            ));
        }
        self.signaled_corruption = true;
    }

    // ----- on-disk refcounts -----

    /// QEMU's `qcow2_get_refcount`.
    fn get_refcount(&mut self, cluster: u64) -> std::result::Result<u64, String> {
        let j = cluster / self.entries;
        let Some(&raw) = self.reftable.get(j as usize) else {
            return Ok(0);
        };
        let block = raw & REFT_OFFSET_MASK;
        if block == 0 {
            return Ok(0);
        }
        if block % self.cs != 0 {
            self.signal_corruption(
                true,
                format!(
                    "Refblock offset {block:#x} unaligned (reftable index: {})",
                    c_hex(j)
                ),
            );
            return Err(EIO.into());
        }
        if !self.cache.contains_key(&block) {
            let mut buf = vec![0u8; self.cs as usize];
            self.read_zero(&mut buf, block).map_err(|e| strerror(&e))?;
            // A small cache: the walks are mostly sequential.
            if self.cache.len() >= 64 {
                self.cache.clear();
            }
            self.cache.insert(block, buf);
        }
        let data = &self.cache[&block];
        refcount::get(data, self.order, cluster % self.entries).map_err(|e| e.to_string())
    }

    // ----- the pass -----

    /// One `qcow2_co_check_locked`.
    fn check_pass(&mut self, fix: Fix) -> std::result::Result<CheckReport, Fail> {
        let mut result = Res::default();
        let mut snapshot_res = Res::default();
        self.check_read_snapshot_table(&mut snapshot_res, fix)?;
        let mut refcount_res = Res::default();
        let r = self.check_refcounts(&mut refcount_res, fix);
        result.add(&refcount_res, true);
        r?;
        // QEMU rewrites the snapshot table here when -r all found incomplete entries or
        // dropped extra data (qcow2_check_fix_snapshot_table); qimg leaves them reported.
        result.add(&snapshot_res, false);
        if fix.any() && result.check_errors == 0 && result.corruptions == 0 {
            self.mark_clean_and_consistent()?;
        }
        Ok(result.report())
    }

    fn check_read_snapshot_table(
        &mut self,
        res: &mut Res,
        fix: Fix,
    ) -> std::result::Result<(), Fail> {
        let mut hdr = [0u8; 12];
        if let Err(e) = self.read_zero(&mut hdr, 60) {
            res.check_errors += 1;
            self.msg(format!(
                "ERROR failed to read the snapshot table pointer from the image header: {}",
                strerror(&e)
            ));
            return Err(io_fail(&e));
        }
        self.nb_snapshots = u32::from_be_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
        self.snapshots_offset = u64::from_be_bytes(hdr[4..12].try_into().unwrap_or([0; 8]));
        let mut reduced: u32 = 0;
        let mut dropped: u32 = 0;
        if self.nb_snapshots > MAX_SNAPSHOTS && fix.errors {
            self.msg(format!(
                "Discarding {} overhanging snapshots",
                self.nb_snapshots - MAX_SNAPSHOTS
            ));
            reduced += self.nb_snapshots - MAX_SNAPSHOTS;
            self.nb_snapshots = MAX_SNAPSHOTS;
        }
        // qcow2_validate_table
        let invalid = if self.nb_snapshots > MAX_SNAPSHOTS {
            Some(("snapshot table too large", EFBIG))
        } else if (i64::MAX as u64 - u64::from(self.nb_snapshots) * SNAPSHOT_HEADER)
            < self.snapshots_offset
            || self.snapshots_offset % self.cs != 0
        {
            Some(("snapshot table offset invalid", EINVAL))
        } else {
            None
        };
        if let Some((what, errno)) = invalid {
            res.check_errors += 1;
            self.msg(format!("ERROR {what}"));
            if self.nb_snapshots > MAX_SNAPSHOTS {
                self.msg(format!(
                    "You can force-remove all {} overhanging snapshots with qemu-img check -r all",
                    self.nb_snapshots - MAX_SNAPSHOTS
                ));
            }
            self.snapshots_offset = 0;
            self.nb_snapshots = 0;
            self.snapshots.clear();
            self.starts = None;
            self.snapshots_size = 0;
            return Err(Fail(errno.into()));
        }
        if let Err((text, hint, errno)) =
            self.read_snapshots(fix.errors, &mut reduced, &mut dropped)
        {
            res.check_errors += 1;
            self.msg(format!("ERROR failed to read the snapshot table: {text}"));
            if let Some(h) = hint {
                self.msg(h);
            }
            self.snapshots_offset = 0;
            self.nb_snapshots = 0;
            self.snapshots.clear();
            self.starts = None;
            self.snapshots_size = 0;
            return Err(Fail(errno));
        }
        res.corruptions += i64::from(reduced) + i64::from(dropped);
        if reduced > 0 {
            let nb = self.nb_snapshots.to_be_bytes();
            if let Err(e) = self.write(&nb, 60).and_then(|()| self.sync()) {
                res.check_errors += 1;
                self.msg(format!(
                    "ERROR failed to update the snapshot count in the image header: {}",
                    strerror(&e)
                ));
                return Err(io_fail(&e));
            }
            res.corruptions_fixed += i64::from(reduced);
            res.corruptions -= i64::from(reduced);
        }
        if self.version >= 3 {
            for i in 0..self.snapshots.len() {
                if u64::from(self.snapshots[i].extra_data_size) < 16 {
                    res.corruptions += 1;
                    // QEMU rewrites the snapshot table here; qimg does not (yet).
                    self.msg(format!("ERROR snapshot table entry {i} is incomplete"));
                }
            }
        }
        Ok(())
    }

    /// QEMU's `qcow2_do_read_snapshots` (errors: message, hint, errno text).
    fn read_snapshots(
        &mut self,
        repair: bool,
        reduced: &mut u32,
        dropped: &mut u32,
    ) -> std::result::Result<(), (String, Option<String>, String)> {
        self.snapshots.clear();
        self.starts = None;
        self.snapshots_size = 0;
        if self.nb_snapshots == 0 {
            return Ok(());
        }
        let io = |e: std::io::Error| {
            (
                format!("Failed to read snapshot table: {}", strerror(&e)),
                None,
                strerror(&e),
            )
        };
        let start = self.snapshots_offset;
        let mut offset = start;
        let mut table_length: u64 = 0;
        let nb = self.nb_snapshots;
        for i in 0..nb {
            let pre = offset;
            table_length = table_length.next_multiple_of(8);
            offset = offset.next_multiple_of(8);
            let mut h = [0u8; 40];
            self.read_zero(&mut h, offset).map_err(io)?;
            offset += SNAPSHOT_HEADER;
            let be64 = |b: &[u8]| u64::from_be_bytes(b.try_into().unwrap_or([0; 8]));
            let be32 = |b: &[u8]| u32::from_be_bytes(b.try_into().unwrap_or([0; 4]));
            let l1_offset = be64(&h[0..8]);
            let l1_size = be32(&h[8..12]);
            let id_len = u64::from(u16::from_be_bytes([h[12], h[13]]));
            let name_len = u64::from(u16::from_be_bytes([h[14], h[15]]));
            let mut extra = be32(&h[36..40]);
            let mut truncate = false;
            if extra > 1024 {
                if !repair {
                    return Err((
                        format!("Too much extra metadata in snapshot table entry {i}"),
                        Some(
                            "You can force-remove this extra metadata with qemu-img check -r all"
                                .into(),
                        ),
                        EFBIG.into(),
                    ));
                }
                self.msg(format!(
                    "Discarding too much extra metadata in snapshot table entry {i} ({extra} > 1024)"
                ));
                *dropped += 1;
                truncate = true;
            }
            offset += u64::from(extra).min(KNOWN_EXTRA);
            if u64::from(extra) > KNOWN_EXTRA {
                let end = offset + u64::from(extra) - KNOWN_EXTRA;
                if truncate {
                    extra = 1024;
                }
                offset = end;
            }
            let mut id = vec![0u8; id_len as usize];
            self.read_zero(&mut id, offset).map_err(io)?;
            offset += id_len;
            let mut name = vec![0u8; name_len as usize];
            self.read_zero(&mut name, offset).map_err(io)?;
            offset += name_len;
            table_length += SNAPSHOT_HEADER + u64::from(extra) + id_len + name_len;
            if table_length > MAX_SNAPSHOTS_SIZE || offset - start > i32::MAX as u64 {
                if !repair {
                    return Err((
                        "Snapshot table is too big".into(),
                        Some(format!(
                            "You can force-remove all {} overhanging snapshots with qemu-img check -r all",
                            nb - i
                        )),
                        EFBIG.into(),
                    ));
                }
                self.msg(format!(
                    "Discarding {} overhanging snapshots (snapshot table is too big)",
                    nb - i
                ));
                *reduced += nb - i;
                self.nb_snapshots = i;
                offset = pre;
                break;
            }
            let text = |b: &[u8]| {
                let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
                String::from_utf8_lossy(&b[..end]).into_owned()
            };
            self.starts = None;
            self.snapshots.push(Snap {
                l1_offset,
                l1_size,
                id: text(&id),
                name: text(&name),
                extra_data_size: extra,
            });
        }
        self.snapshots_size = offset - start;
        Ok(())
    }

    /// `qcow2_check_refcounts`.
    fn check_refcounts(&mut self, res: &mut Res, fix: Fix) -> std::result::Result<(), Fail> {
        let nb_clusters = self.size_to_clusters(self.file_len);
        if nb_clusters > i32::MAX as u64 {
            res.check_errors += 1;
            return Err(Fail(EFBIG.into()));
        }
        res.total_clusters = self.size_to_clusters(self.total_sectors * 512);
        self.refs.clear();
        self.refs.size = nb_clusters;
        self.beyond_eof.clear();
        let mut rebuild = false;
        self.exclusive = None;
        if fix.errors {
            // A silent walk that changes nothing finds the tables that are safe to edit.
            let signaled = self.signaled_corruption;
            let incompatible = self.incompatible;
            let l1 = self.l1.clone();
            self.mute = true;
            let walked = self.calculate_refcounts(&mut Res::default(), fix, &mut rebuild);
            self.mute = false;
            self.signaled_corruption = signaled;
            self.incompatible = incompatible;
            self.l1 = l1;
            self.starts = None;
            rebuild = false;
            if walked.is_ok() {
                let exclusive = self
                    .table_uses
                    .iter()
                    .filter(|&(&c, &n)| self.refs.get(c) == n)
                    .map(|(&c, _)| c)
                    .collect();
                self.exclusive = Some(exclusive);
            }
            self.refs.clear();
            self.refs.size = nb_clusters;
            self.beyond_eof.clear();
        }
        self.calculate_refcounts(res, fix, &mut rebuild)?;
        let pre_compare = *res;
        let mut highest = 0u64;
        self.compare_refcounts(res, Fix::NONE, &mut rebuild, &mut highest);
        if rebuild && fix.errors {
            let old = *res;
            let mut fresh_leaks = 0;
            self.msg("Rebuilding refcount structure".into());
            self.rebuild_refcount_structure(res)?;
            res.corruptions = 0;
            res.leaks = 0;
            rebuild = false;
            self.refs.clear();
            self.calculate_refcounts(res, Fix::NONE, &mut rebuild)?;
            if fix.leaks {
                let saved = *res;
                *res = Res::default();
                self.compare_refcounts(
                    res,
                    Fix {
                        leaks: true,
                        errors: false,
                    },
                    &mut rebuild,
                    &mut highest,
                );
                if rebuild {
                    self.msg("ERROR rebuilt refcount structure is still broken".into());
                }
                fresh_leaks = res.leaks;
                *res = saved;
            }
            if res.corruptions < old.corruptions {
                res.corruptions_fixed += old.corruptions - res.corruptions;
            }
            if res.leaks < old.leaks {
                res.leaks_fixed += old.leaks - res.leaks;
            }
            res.leaks += fresh_leaks;
        } else if fix.any() {
            if rebuild {
                self.msg("ERROR need to rebuild refcount structures".into());
                res.check_errors += 1;
                return Err(Fail(EIO.into()));
            }
            if res.leaks != 0 || res.corruptions != 0 {
                *res = pre_compare;
                self.keep_copied = self.behind_shared_tables();
                self.compare_refcounts(res, fix, &mut rebuild, &mut highest);
                self.keep_copied.clear();
            }
        }
        self.check_oflag_copied(res, fix)?;
        res.image_end_offset = (highest + 1) * self.cs;
        Ok(())
    }

    fn calculate_refcounts(
        &mut self,
        res: &mut Res,
        fix: Fix,
        rebuild: &mut bool,
    ) -> std::result::Result<(), Fail> {
        self.table_uses.clear();
        self.inc_refcounts(res, 0, self.cs);
        self.check_refcounts_l1(res, self.l1_offset, self.l1_size, true, fix, true)?;
        if self.data_file && self.nb_snapshots > 0 {
            self.msg(format!(
                "ERROR {} snapshots in image with data file",
                self.nb_snapshots
            ));
            res.corruptions += 1;
        }
        for i in 0..self.snapshots.len() {
            let sn = self.snapshots[i].clone();
            if sn.l1_offset % self.cs != 0 {
                self.msg(format!(
                    "ERROR snapshot {} ({}) l1_offset={}: L1 table is not cluster aligned; \
                     snapshot table entry corrupted",
                    sn.id,
                    sn.name,
                    c_hex(sn.l1_offset)
                ));
                res.corruptions += 1;
                continue;
            }
            if u64::from(sn.l1_size) > MAX_L1_BYTES / 8 {
                self.msg(format!(
                    "ERROR snapshot {} ({}) l1_size={}: L1 table is too large; snapshot table \
                     entry corrupted",
                    sn.id,
                    sn.name,
                    c_hex(u64::from(sn.l1_size))
                ));
                res.corruptions += 1;
                continue;
            }
            self.check_refcounts_l1(res, sn.l1_offset, sn.l1_size, false, fix, false)?;
        }
        self.inc_refcounts(res, self.snapshots_offset, self.snapshots_size);
        self.inc_refcounts(res, self.reftable_offset, self.reftable.len() as u64 * 8);
        if let Some((off, len)) = self.crypto {
            self.inc_refcounts(res, off, len);
        }
        self.check_bitmaps_refcounts(res)?;
        self.check_refblocks(res, fix, rebuild)
    }

    /// `qcow2_inc_refcounts_imrt`: returns false when the range lies past the end of the file.
    fn inc_refcounts(&mut self, res: &mut Res, offset: u64, size: u64) -> bool {
        if size == 0 {
            return true;
        }
        if self.past_eof(offset, size) {
            self.msg(format!(
                "ERROR: counting reference for region exceeding the end of the file by one \
                 cluster or more: offset {offset:#x} size {size:#x}"
            ));
            res.corruptions += 1;
            let end_cluster = self.file_len.div_ceil(self.cs);
            let window = end_cluster.saturating_sub(1)..end_cluster + BEYOND_EOF_WINDOW;
            let last = (offset.saturating_add(size - 1) / self.cs).min(window.end);
            for k in (offset / self.cs).max(window.start)..=last {
                if window.contains(&k) {
                    self.beyond_eof.insert(k);
                }
            }
            return false;
        }
        let first = offset / self.cs;
        let last = (offset + size - 1) / self.cs;
        for k in first..=last {
            if k >= self.refs.size {
                self.refs.size = k + 1;
            }
            let v = self.refs.get(k);
            if v == self.refcount_max {
                self.msg(format!("ERROR: overflow cluster offset={:#x}", k * self.cs));
                self.msg(
                    "Use qemu-img amend to increase the refcount entry width or qemu-img \
                     convert to create a clean copy if the image cannot be opened for writing"
                        .into(),
                );
                res.corruptions += 1;
                continue;
            }
            self.refs.set(k, v + 1);
        }
        true
    }

    fn past_eof(&self, offset: u64, size: u64) -> bool {
        i128::from(offset) + i128::from(size) - i128::from(self.file_len) >= i128::from(self.cs)
    }

    fn progress(&mut self, done: u64, total: u64) {
        if self.mute {
            return;
        }
        (self.events)(CheckEvent::Progress { done, total });
    }

    fn check_refcounts_l1(
        &mut self,
        res: &mut Res,
        l1_offset: u64,
        l1_size: u32,
        frag: bool,
        fix: Fix,
        active: bool,
    ) -> std::result::Result<(), Fail> {
        if l1_size == 0 {
            return Ok(());
        }
        let bytes = u64::from(l1_size) * 8;
        if self.inc_refcounts(res, l1_offset, bytes) {
            self.note_table(l1_offset, bytes);
        }
        let table = match self.read_words(l1_offset, bytes) {
            Ok(t) => t,
            Err(e) => {
                self.msg("ERROR: I/O error in check_refcounts_l1".into());
                res.check_errors += 1;
                return Err(io_fail(&e));
            }
        };
        let total = table.len() as u64;
        let ign = if active {
            Area::ActiveL1
        } else {
            Area::InactiveL1
        };
        for (i, &raw) in table.iter().enumerate() {
            if active && i % 64 == 0 {
                self.progress(i as u64, total);
            }
            let mut e = raw;
            if e == 0 {
                continue;
            }
            let at = l1_offset + i as u64 * 8;
            if e & L1E_RESERVED_MASK != 0 {
                let fixed = e & !L1E_RESERVED_MASK;
                let fixed = if fixed & L1E_OFFSET_MASK == 0 {
                    0
                } else {
                    fixed
                };
                if fix.errors && self.write_l1_entry(at, fixed, ign, active.then_some(i)) {
                    self.msg(format!("Repairing L1 entry with reserved bits set: {e:x}"));
                    res.corruptions_fixed += 1;
                    e = fixed;
                    if e == 0 {
                        continue;
                    }
                } else {
                    self.msg(format!(
                        "ERROR found L1 entry with reserved bits set: {e:x}"
                    ));
                    res.corruptions += 1;
                }
            }
            let l2_offset = e & L1E_OFFSET_MASK;
            if fix.errors {
                let why = if l2_offset == 0 {
                    Some("COPIED flag without an L2 table")
                } else if l2_offset % self.cs != 0 {
                    Some("Table is not cluster aligned")
                } else if self.past_eof(l2_offset, self.cs) {
                    Some("Table lies past the end of the file")
                } else {
                    None
                };
                if let Some(why) = why {
                    if self.write_l1_entry(at, 0, ign, active.then_some(i)) {
                        self.msg(format!(
                            "Repairing l2_offset={l2_offset:x}: {why}; L1 entry corrupted"
                        ));
                        res.corruptions_fixed += 1;
                        continue;
                    }
                }
            }
            if self.inc_refcounts(res, l2_offset, self.cs) {
                self.note_table(l2_offset, self.cs);
            }
            if l2_offset % self.cs != 0 {
                self.msg(format!(
                    "ERROR l2_offset={l2_offset:x}: Table is not cluster aligned; L1 entry corrupted"
                ));
                res.corruptions += 1;
            }
            self.check_refcounts_l2(res, l2_offset, frag, fix, active)?;
        }
        if active {
            self.progress(total, total);
        }
        self.sync_entries(res)
    }

    /// Makes the entry repairs of a table walk durable with one sync, before anything that
    /// depends on them (the refcount repairs) is written.
    fn sync_entries(&mut self, res: &mut Res) -> std::result::Result<(), Fail> {
        if !std::mem::take(&mut self.unsynced) {
            return Ok(());
        }
        self.sync().map_err(|e| {
            self.msg(format!(
                "ERROR: Could not sync repaired entries: {}",
                strerror(&e)
            ));
            res.check_errors += 1;
            io_fail(&e)
        })
    }

    fn note_table(&mut self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        for c in offset / self.cs..=(offset + len - 1) / self.cs {
            *self.table_uses.entry(c).or_insert(0) += 1;
        }
    }

    /// Whether the table entry at `at` may be rewritten by the repairing walk: its cluster is
    /// used only as a table.
    fn may_edit(&self, at: u64) -> bool {
        self.mute
            || self
                .exclusive
                .as_ref()
                .is_some_and(|s| s.contains(&(at / self.cs)))
    }

    /// After a whole walk: the clusters that entries of active tables shared with something
    /// else name (the COPIED repair leaves such tables alone, see `check_oflag_copied`).
    /// Empty, and nothing read, when no table is shared.
    fn behind_shared_tables(&mut self) -> HashSet<u64> {
        let mut out = HashSet::new();
        if self
            .table_uses
            .iter()
            .all(|(&c, &uses)| uses == self.refs.get(c))
        {
            return out;
        }
        let cs = self.cs;
        let l1_shared = !self.only_table(self.l1_offset, u64::from(self.l1_size) * 8);
        let mut seen = HashSet::new();
        let es = self.entry_size as usize;
        for i in 0..self.l1.len() {
            let l2_offset = self.l1[i] & L1E_OFFSET_MASK;
            if l2_offset == 0 {
                continue;
            }
            if l1_shared {
                out.insert(l2_offset >> self.cb);
            }
            if (l2_offset % cs == 0 && self.only_table(l2_offset, cs)) || !seen.insert(l2_offset) {
                continue;
            }
            let mut table = vec![0u8; cs as usize];
            if self.read_zero(&mut table, l2_offset).is_err() {
                continue;
            }
            for e in table.chunks_exact(es) {
                let entry = u64::from_be_bytes(e[..8].try_into().unwrap_or([0; 8]));
                if matches!(
                    self.cluster_type(entry),
                    ClusterType::Normal | ClusterType::ZeroAlloc
                ) {
                    out.insert((entry & L2E_OFFSET_MASK) >> self.cb);
                }
            }
        }
        out
    }

    /// After a whole walk: whether the table in `[offset, offset + len)` is referenced as
    /// nothing else.
    fn only_table(&self, offset: u64, len: u64) -> bool {
        len > 0
            && (offset / self.cs..=(offset + len - 1) / self.cs)
                .all(|c| self.table_uses.get(&c).copied().unwrap_or(0) == self.refs.get(c))
    }

    /// Writes an L1 entry (a repair beyond QEMU's); false when refused or failed.
    fn write_l1_entry(
        &mut self,
        at: u64,
        value: u64,
        ign: Area,
        active_index: Option<usize>,
    ) -> bool {
        if !self.may_edit(at) || self.overlaps(ign, at, 8).is_some() {
            return false;
        }
        if self.write(&value.to_be_bytes(), at).is_err() {
            return false;
        }
        self.unsynced |= !self.mute;
        if let Some(i) = active_index {
            self.set_l1_entry(i, value);
        }
        true
    }

    /// Replaces entry `i` of the in-memory active L1 table, keeping the overlap index current.
    fn set_l1_entry(&mut self, i: usize, value: u64) {
        let Some(slot) = self.l1.get_mut(i) else {
            return;
        };
        let old = std::mem::replace(slot, value);
        if let Some(starts) = &mut self.starts {
            TableStarts::remove(&mut starts.l2, old & L1E_OFFSET_MASK);
            TableStarts::add(&mut starts.l2, value & L1E_OFFSET_MASK);
        }
    }

    fn cluster_type(&self, entry: u64) -> ClusterType {
        if entry & QCOW_OFLAG_COMPRESSED != 0 {
            ClusterType::Compressed
        } else if entry & QCOW_OFLAG_ZERO != 0 && !self.extended {
            if entry & L2E_OFFSET_MASK != 0 {
                ClusterType::ZeroAlloc
            } else {
                ClusterType::ZeroPlain
            }
        } else if entry & L2E_OFFSET_MASK == 0 {
            if self.data_file && entry & QCOW_OFLAG_COPIED != 0 {
                ClusterType::Normal
            } else {
                ClusterType::Unallocated
            }
        } else {
            ClusterType::Normal
        }
    }

    /// QEMU's `qcow2_parse_compressed_l2_entry`: (byte offset, bytes).
    fn parse_compressed(&self, entry: u64) -> (u64, u64) {
        let shift = 62 - (self.cb - 8);
        let offset = entry & ((1u64 << shift) - 1);
        let sectors = ((entry >> shift) & ((1u64 << (self.cb - 8)) - 1)) + 1;
        (offset, sectors * 512 - (offset & 511))
    }

    /// Writes one L2 entry (both words with extended L2); false when refused or failed.
    fn write_l2_entry(&mut self, at: u64, entry: u64, bitmap: u64, active: bool) -> bool {
        let ign = if active {
            Area::ActiveL2
        } else {
            Area::InactiveL2
        };
        if !self.may_edit(at) || self.overlaps(ign, at, self.entry_size).is_some() {
            return false;
        }
        self.write_l2_entry_unchecked(at, entry, bitmap)
    }

    fn write_l2_entry_unchecked(&mut self, at: u64, entry: u64, bitmap: u64) -> bool {
        let mut b = entry.to_be_bytes().to_vec();
        if self.extended {
            b.extend_from_slice(&bitmap.to_be_bytes());
        }
        let written = self.write(&b, at).is_ok();
        self.unsynced |= written && !self.mute;
        written
    }

    /// QEMU's `fix_l2_entry_by_zero`: the entry reads as zeros and owns no cluster.
    fn zero_entry(&mut self, at: u64, bitmap: u64, active: bool) -> ZeroFix {
        let (entry, bitmap) = if self.extended {
            (0, (bitmap | (bitmap << 32)) & ALL_ZEROES)
        } else {
            (QCOW_OFLAG_ZERO, 0)
        };
        let ign = if active {
            Area::ActiveL2
        } else {
            Area::InactiveL2
        };
        if !self.may_edit(at) {
            return ZeroFix::Shared;
        }
        if self.overlaps(ign, at, self.entry_size).is_some() {
            return ZeroFix::Overlap;
        }
        if self.write_l2_entry_unchecked(at, entry, bitmap) {
            ZeroFix::Done
        } else {
            ZeroFix::Failed
        }
    }

    #[allow(clippy::too_many_lines)]
    fn check_refcounts_l2(
        &mut self,
        res: &mut Res,
        l2_offset: u64,
        frag: bool,
        fix: Fix,
        active: bool,
    ) -> std::result::Result<(), Fail> {
        let mut table = vec![0u8; self.cs as usize];
        if let Err(e) = self.read_zero(&mut table, l2_offset) {
            self.msg("ERROR: I/O error in check_refcounts_l2".into());
            res.check_errors += 1;
            return Err(io_fail(&e));
        }
        let es = self.entry_size as usize;
        let mut next_contiguous = 0u64;
        let cs = self.cs;
        for (i, raw) in table.chunks_exact(es).enumerate() {
            let at = l2_offset + (i * es) as u64;
            let mut entry = u64::from_be_bytes(raw[..8].try_into().unwrap_or([0; 8]));
            let mut bitmap = if self.extended {
                u64::from_be_bytes(raw[8..16].try_into().unwrap_or([0; 8]))
            } else {
                0
            };
            let ty = self.cluster_type(entry);
            if ty != ClusterType::Compressed && entry & L2E_STD_RESERVED_MASK != 0 {
                let cleared = entry & !L2E_STD_RESERVED_MASK;
                if fix.errors && self.write_l2_entry(at, cleared, bitmap, active) {
                    self.msg(format!(
                        "Repairing l2 entry with reserved bits set: {entry:x}"
                    ));
                    res.corruptions_fixed += 1;
                    entry = cleared;
                } else {
                    self.msg(format!(
                        "ERROR found l2 entry with reserved bits set: {entry:x}"
                    ));
                    res.corruptions += 1;
                }
            }
            match ty {
                ClusterType::Compressed => {
                    if entry & QCOW_OFLAG_COPIED != 0 {
                        let (coff, _) = self.parse_compressed(entry);
                        let cleared = entry & !QCOW_OFLAG_COPIED;
                        if fix.errors && self.write_l2_entry(at, cleared, bitmap, active) {
                            self.msg(format!(
                                "Repairing coffset={coff:#x}: copied flag must never be set for \
                                 compressed clusters"
                            ));
                            res.corruptions_fixed += 1;
                        } else {
                            self.msg(format!(
                                "ERROR: coffset={coff:#x}: copied flag must never be set for \
                                 compressed clusters"
                            ));
                            res.corruptions += 1;
                        }
                        entry = cleared;
                    }
                    if self.data_file {
                        if fix.errors {
                            if let ZeroFix::Done = self.zero_entry(at, 0, active) {
                                self.msg(format!(
                                    "Repairing compressed cluster {i} with data file, entry={entry:#x}"
                                ));
                                res.corruptions_fixed += 1;
                                continue;
                            }
                        }
                        self.msg(format!(
                            "ERROR compressed cluster {i} with data file, entry={entry:#x}"
                        ));
                        res.corruptions += 1;
                        continue;
                    }
                    if bitmap != 0 {
                        if fix.errors && self.write_l2_entry(at, entry, 0, active) {
                            self.msg(format!(
                                "Repairing compressed cluster {i} with non-zero subcluster \
                                 allocation bitmap, entry={entry:#x}"
                            ));
                            res.corruptions_fixed += 1;
                        } else {
                            self.msg(format!(
                                "ERROR compressed cluster {i} with non-zero subcluster \
                                 allocation bitmap, entry={entry:#x}"
                            ));
                            res.corruptions += 1;
                            // QEMU does not count the compressed data then, which makes it a
                            // leak that a repair would free although reads ignore the bitmap:
                            // when repairing, count its references (not its statistics).
                            if fix.any() {
                                let (coffset, csize) = self.parse_compressed(entry);
                                self.inc_refcounts(res, coffset, csize);
                            }
                            continue;
                        }
                    }
                    let (coffset, csize) = self.parse_compressed(entry);
                    if fix.errors && self.past_eof(coffset, csize) {
                        if let ZeroFix::Done = self.zero_entry(at, 0, active) {
                            self.msg(format!(
                                "Repairing compressed cluster {i}: data at offset {coffset:#x} \
                                 size {csize:#x} lies past the end of the file; the entry now \
                                 reads as zeros"
                            ));
                            res.corruptions_fixed += 1;
                            continue;
                        }
                    }
                    self.inc_refcounts(res, coffset, csize);
                    if frag {
                        res.allocated_clusters += 1;
                        res.compressed_clusters += 1;
                        res.fragmented_clusters += 1;
                    }
                }
                ClusterType::ZeroAlloc | ClusterType::Normal => {
                    let offset = entry & L2E_OFFSET_MASK;
                    let conflict = (bitmap >> 32) & bitmap;
                    if conflict != 0 {
                        let repaired = bitmap & !conflict;
                        if fix.errors && self.write_l2_entry(at, entry, repaired, active) {
                            self.msg(format!(
                                "Repairing offset={offset:x}: Allocated cluster has corrupted \
                                 subcluster allocation bitmap"
                            ));
                            res.corruptions_fixed += 1;
                            bitmap = repaired;
                        } else {
                            res.corruptions += 1;
                            self.msg(format!(
                                "ERROR offset={offset:x}: Allocated cluster has corrupted \
                                 subcluster allocation bitmap"
                            ));
                        }
                    }
                    if offset % cs != 0 {
                        res.corruptions += 1;
                        let contains_data = if self.extended {
                            bitmap & ALL_ALLOC != 0
                        } else {
                            entry & QCOW_OFLAG_ZERO == 0
                        };
                        if !contains_data {
                            self.msg(format!(
                                "{} offset={offset:x}: Preallocated cluster is not properly \
                                 aligned; L2 entry corrupted.",
                                if fix.errors { "Repairing" } else { "ERROR" }
                            ));
                            if fix.errors {
                                match self.zero_entry(at, bitmap, active) {
                                    ZeroFix::Done => {
                                        res.corruptions -= 1;
                                        res.corruptions_fixed += 1;
                                        continue;
                                    }
                                    ZeroFix::Overlap => {
                                        self.msg("ERROR: Overlap check failed".into());
                                        res.check_errors += 1;
                                        let what = self.overlap_name(at, self.entry_size, active);
                                        self.signal_corruption(
                                            true,
                                            format!(
                                                "Preventing invalid write on metadata (overlaps \
                                                 with {what})"
                                            ),
                                        );
                                        return Err(Fail(EIO.into()));
                                    }
                                    ZeroFix::Failed => {
                                        self.msg(
                                            "ERROR: Failed to overwrite L2 table entry".into(),
                                        );
                                        res.check_errors += 1;
                                    }
                                    ZeroFix::Shared => {
                                        self.msg(format!(
                                            "ERROR: not repaired: the L2 table at {:#x} is also                                              used as something else",
                                            l2_offset
                                        ));
                                    }
                                }
                            }
                        } else if fix.errors
                            && matches!(self.zero_entry(at, bitmap, active), ZeroFix::Done)
                        {
                            // Beyond QEMU: QEMU cannot read such a cluster at all.
                            self.msg(format!(
                                "Repairing offset={offset:x}: Data cluster is not properly \
                                 aligned; L2 entry corrupted (it now reads as zeros)."
                            ));
                            res.corruptions -= 1;
                            res.corruptions_fixed += 1;
                            continue;
                        } else {
                            self.msg(format!(
                                "ERROR offset={offset:x}: Data cluster is not properly \
                                 aligned; L2 entry corrupted."
                            ));
                        }
                    }
                    if fix.errors && !self.data_file && self.past_eof(offset, cs) {
                        if let ZeroFix::Done = self.zero_entry(at, bitmap, active) {
                            self.msg(format!(
                                "Repairing offset={offset:x}: Data cluster lies past the end of \
                                 the file; L2 entry corrupted (it now reads as zeros)."
                            ));
                            res.corruptions_fixed += 1;
                            continue;
                        }
                    }
                    if frag {
                        res.allocated_clusters += 1;
                        if next_contiguous != 0 && offset != next_contiguous {
                            res.fragmented_clusters += 1;
                        }
                        next_contiguous = offset + cs;
                    }
                    if !self.data_file {
                        self.inc_refcounts(res, offset, cs);
                    }
                }
                ClusterType::ZeroPlain => {}
                ClusterType::Unallocated => {
                    if bitmap & ALL_ALLOC != 0 {
                        if fix.errors
                            && matches!(self.zero_entry(at, bitmap, active), ZeroFix::Done)
                        {
                            self.msg(
                                "Repairing: Unallocated cluster has non-zero subcluster \
                                 allocation map (its allocated subclusters now read as zeros)"
                                    .into(),
                            );
                            res.corruptions_fixed += 1;
                        } else {
                            res.corruptions += 1;
                            self.msg(
                                "ERROR: Unallocated cluster has non-zero subcluster allocation map"
                                    .into(),
                            );
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// `qcow2_check_bitmaps_refcounts`.
    fn check_bitmaps_refcounts(&mut self, res: &mut Res) -> std::result::Result<(), Fail> {
        let Some((dir_offset, dir_size, nb)) = self.bitmaps else {
            return Ok(());
        };
        self.inc_refcounts(res, dir_offset, dir_size);
        // The extension was validated at open: the directory is at most 64 MiB.
        let mut dir = vec![0u8; dir_size as usize];
        let list = self
            .read_zero(&mut dir, dir_offset)
            .map_err(|e| e.to_string())
            .and_then(|()| {
                let ext = qimg_format::bitmap::BitmapsExtension {
                    nb_bitmaps: nb,
                    directory_size: dir_size,
                    directory_offset: dir_offset,
                };
                decode_directory(&dir, &ext).map_err(|e| e.to_string())
            });
        let Ok(list) = list else {
            res.corruptions += 1;
            return Err(Fail(EINVAL.into()));
        };
        const PIECE: u64 = 65536;
        for bm in list {
            let size = u64::from(bm.table_size);
            self.inc_refcounts(res, bm.table_offset, size * 8);
            let mut done = 0;
            while done < size {
                let n = (size - done).min(PIECE);
                let at = bm
                    .table_offset
                    .checked_add(done * 8)
                    .filter(|&a| a <= i64::MAX as u64);
                let read = match at {
                    Some(at) => self.read_words(at, n * 8),
                    None => Err(std::io::Error::from_raw_os_error(22)),
                };
                let words = match read {
                    Ok(w) => w,
                    Err(e) => {
                        res.corruptions += 1;
                        return Err(io_fail(&e));
                    }
                };
                for entry in words {
                    let offset = entry & BME_OFFSET_MASK;
                    let bad = entry & TABLE_ENTRY_RESERVED != 0
                        || (offset != 0 && (entry & 1 != 0 || offset % self.cs != 0));
                    if bad {
                        res.corruptions += 1;
                        continue;
                    }
                    if offset != 0 {
                        self.inc_refcounts(res, offset, self.cs);
                    }
                }
                done += n;
            }
        }
        Ok(())
    }

    /// `check_refblocks`.
    fn check_refblocks(
        &mut self,
        res: &mut Res,
        fix: Fix,
        rebuild: &mut bool,
    ) -> std::result::Result<(), Fail> {
        for i in 0..self.reftable.len() {
            let raw = self.reftable[i];
            let offset = raw & REFT_OFFSET_MASK;
            let cluster = offset >> self.cb;
            if raw & REFT_RESERVED_MASK != 0 {
                self.msg(format!(
                    "ERROR refcount table entry {i} has reserved bits set"
                ));
                res.corruptions += 1;
                *rebuild = true;
                continue;
            }
            if offset % self.cs != 0 {
                self.msg(format!(
                    "ERROR refcount block {i} is not cluster aligned; refcount table entry corrupted"
                ));
                res.corruptions += 1;
                *rebuild = true;
                continue;
            }
            if cluster >= self.refs.size {
                res.corruptions += 1;
                self.msg(format!(
                    "{} refcount block {i} is outside image",
                    if fix.errors { "Repairing" } else { "ERROR" }
                ));
                // QEMU grows the file to cover the block, which then reads as zeros and so
                // always needs a rebuild anyway; a garbage offset would grow the file by
                // terabytes. qimg rebuilds without growing the file.
                if fix.errors {
                    *rebuild = true;
                }
                continue;
            }
            if offset != 0 {
                self.inc_refcounts(res, offset, self.cs);
                let n = self.refs.get(cluster);
                if n != 1 {
                    self.msg(format!("ERROR refcount block {i} refcount={n}"));
                    res.corruptions += 1;
                    *rebuild = true;
                }
            }
        }
        Ok(())
    }

    /// `compare_refcounts`, one refcount block's range at a time.
    fn compare_refcounts(
        &mut self,
        res: &mut Res,
        fix: Fix,
        rebuild: &mut bool,
        highest: &mut u64,
    ) {
        *highest = 0;
        let e = self.entries;
        let nb = self.refs.size;
        for j in 0..nb.div_ceil(e) {
            let lo = j * e;
            let hi = ((j + 1) * e).min(nb);
            let raw = self.reftable.get(j as usize).copied().unwrap_or(0);
            let block = raw & REFT_OFFSET_MASK;
            if block == 0 {
                for (a, b) in self.refs.windows(lo, hi) {
                    for (c, r2) in self.refs.nonzero_in(a, b) {
                        *highest = c;
                        self.mismatch(res, fix, rebuild, c, 0, r2, None);
                    }
                }
                continue;
            }
            let data = if block % self.cs != 0 {
                self.signal_corruption(
                    true,
                    format!(
                        "Refblock offset {block:#x} unaligned (reftable index: {})",
                        c_hex(j)
                    ),
                );
                Err(EIO.to_string())
            } else {
                let mut buf = vec![0u8; self.cs as usize];
                self.read_zero(&mut buf, block)
                    .map(|()| buf)
                    .map_err(|e| strerror(&e))
            };
            let mut data = match data {
                Ok(d) => d,
                Err(why) => {
                    for c in lo..hi {
                        self.msg(format!("Can't get refcount for cluster {c}: {why}"));
                        res.check_errors += 1;
                    }
                    continue;
                }
            };
            for c in lo..hi {
                let r1 = refcount::get(&data, self.order, c - lo).unwrap_or(0);
                let r2 = self.refs.get(c);
                if r1 > 0 || r2 > 0 {
                    *highest = c;
                }
                if r1 != r2 {
                    self.mismatch(res, fix, rebuild, c, r1, r2, Some((block, &mut data)));
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn mismatch(
        &mut self,
        res: &mut Res,
        fix: Fix,
        rebuild: &mut bool,
        c: u64,
        r1: u64,
        r2: u64,
        block: Option<(u64, &mut Vec<u8>)>,
    ) {
        let fixing = if r1 == 0 {
            *rebuild = true;
            false
        } else if r2 > 0 && (r1 == 1) != (r2 == 1) && self.keep_copied.contains(&c) {
            // Whether the cluster's entries must carry COPIED would change, and an entry
            // naming it lies in a table shared with something else, which the COPIED repair
            // will not rewrite: the fix would trade this error for more of them.
            false
        } else {
            (r1 > r2 && fix.leaks) || (r1 < r2 && fix.errors)
        };
        self.msg(format!(
            "{} cluster {c} refcount={r1} reference={r2}",
            if fixing {
                "Repairing"
            } else if r1 < r2 {
                "ERROR"
            } else {
                "Leaked"
            }
        ));
        if fixing {
            if let Some((at, data)) = block {
                if self.update_refcount(at, data, c, r2) {
                    if r1 > r2 {
                        res.leaks_fixed += 1;
                    } else {
                        res.corruptions_fixed += 1;
                    }
                    return;
                }
            }
        }
        if r1 < r2 {
            res.corruptions += 1;
        } else {
            res.leaks += 1;
        }
    }

    /// Sets the refcount of cluster `c` in the refcount block at `at` (held in `data`).
    fn update_refcount(&mut self, at: u64, data: &mut [u8], c: u64, value: u64) -> bool {
        let index = c % self.entries;
        if refcount::set(data, self.order, index, value).is_err() {
            return false;
        }
        let bits = 1u64 << self.order;
        let first = (index * bits / 8) as usize;
        let last = ((index + 1) * bits).div_ceil(8) as usize;
        if self.write(&data[first..last], at + first as u64).is_err() {
            return false;
        }
        self.cache.remove(&at);
        if value == 0 {
            // QCOW2_DISCARD_ALWAYS: a freed cluster is punched out of the file, unless known
            // metadata lies there. A cluster found leaked may still hold a table the walk
            // could not count (the part inside the file of an L1 table running past its end:
            // a fuzz finding); QEMU punches it and loses those entries.
            let (offset, cs) = (c * self.cs, self.cs);
            if self.overlaps(Area::InactiveL2, offset, cs).is_none() {
                self.punch(offset, cs);
            }
        }
        true
    }

    fn punch(&self, offset: u64, len: u64) {
        use nix::fcntl::{FallocateFlags, fallocate};
        let (Ok(o), Ok(l)) = (i64::try_from(offset), i64::try_from(len)) else {
            return;
        };
        // Advisory: a failed punch only costs space.
        let _ = fallocate(
            &self.file,
            FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE,
            o,
            l,
        );
    }

    /// `check_oflag_copied`.
    fn check_oflag_copied(&mut self, res: &mut Res, fix: Fix) -> std::result::Result<(), Fail> {
        let repair = if fix.errors {
            true
        } else if fix.leaks {
            res.check_errors == 0 && res.corruptions == 0 && res.leaks == 0
        } else {
            false
        };
        let cs = self.cs;
        let es = self.entry_size as usize;
        for i in 0..self.l1.len() {
            let l1_entry = self.l1[i];
            let l2_offset = l1_entry & L1E_OFFSET_MASK;
            if l2_offset == 0 {
                continue;
            }
            let Ok(refcount) = self.get_refcount(l2_offset >> self.cb) else {
                continue;
            };
            if (refcount == 1) != (l1_entry & QCOW_OFLAG_COPIED != 0) {
                res.corruptions += 1;
                // Never rewrite a table that is also something else (guest data, metadata).
                let repair = repair && self.only_table(self.l1_offset, u64::from(self.l1_size) * 8);
                self.msg(format!(
                    "{} OFLAG_COPIED L2 cluster: l1_index={i} l1_entry={l1_entry:x} refcount={refcount}",
                    if repair { "Repairing" } else { "ERROR" }
                ));
                if repair {
                    let new = if refcount == 1 {
                        l1_entry | QCOW_OFLAG_COPIED
                    } else {
                        l1_entry & !QCOW_OFLAG_COPIED
                    };
                    self.set_l1_entry(i, new);
                    let at = self.l1_offset + i as u64 * 8;
                    if let Err(e) = self.write(&new.to_be_bytes(), at) {
                        res.check_errors += 1;
                        return Err(io_fail(&e));
                    }
                    res.corruptions -= 1;
                    res.corruptions_fixed += 1;
                }
            }
            let mut table = vec![0u8; cs as usize];
            if let Err(e) = self.read_zero(&mut table, l2_offset) {
                self.msg(format!("ERROR: Could not read L2 table: {}", strerror(&e)));
                res.check_errors += 1;
                return Err(io_fail(&e));
            }
            let mut dirty = 0i64;
            let repair = repair && l2_offset % cs == 0 && self.only_table(l2_offset, cs);
            for j in 0..(cs as usize / es) {
                let entry =
                    u64::from_be_bytes(table[j * es..j * es + 8].try_into().unwrap_or([0; 8]));
                let ty = self.cluster_type(entry);
                if !matches!(ty, ClusterType::Normal | ClusterType::ZeroAlloc) {
                    continue;
                }
                let refcount = if self.data_file {
                    1
                } else {
                    match self.get_refcount((entry & L2E_OFFSET_MASK) >> self.cb) {
                        Ok(r) => r,
                        Err(_) => continue,
                    }
                };
                if (refcount == 1) != (entry & QCOW_OFLAG_COPIED != 0) {
                    res.corruptions += 1;
                    self.msg(format!(
                        "{} OFLAG_COPIED data cluster: l2_entry={entry:x} refcount={refcount}",
                        if repair { "Repairing" } else { "ERROR" }
                    ));
                    if repair {
                        let new = if refcount == 1 {
                            entry | QCOW_OFLAG_COPIED
                        } else {
                            entry & !QCOW_OFLAG_COPIED
                        };
                        table[j * es..j * es + 8].copy_from_slice(&new.to_be_bytes());
                        dirty += 1;
                    }
                }
            }
            if dirty > 0 {
                if let Some(what) = self.overlaps(Area::ActiveL2, l2_offset, cs) {
                    self.msg(format!(
                        "ERROR: Could not write L2 table; metadata overlap check failed: {EIO}"
                    ));
                    res.check_errors += 1;
                    self.signal_corruption(
                        true,
                        format!("Preventing invalid write on metadata (overlaps with {what})"),
                    );
                    return Err(Fail(EIO.into()));
                }
                if let Err(e) = self.write(&table, l2_offset) {
                    self.msg(format!("ERROR: Could not write L2 table: {}", strerror(&e)));
                    res.check_errors += 1;
                    return Err(io_fail(&e));
                }
                res.corruptions -= dirty;
                res.corruptions_fixed += dirty;
            }
        }
        Ok(())
    }

    // ----- overlap check -----

    fn overlap_name(&mut self, at: u64, len: u64, active: bool) -> &'static str {
        let ign = if active {
            Area::ActiveL2
        } else {
            Area::InactiveL2
        };
        self.overlaps(ign, at, len).unwrap_or("metadata")
    }

    /// QEMU's `qcow2_check_metadata_overlap` with the default "cached" checks (every area
    /// but inactive L2 tables), ignoring `ign`; names the first area hit.
    fn overlaps(&mut self, ign: Area, offset: u64, size: u64) -> Option<&'static str> {
        if size == 0 {
            return None;
        }
        let cs = self.cs;
        if offset < cs {
            return Some("qcow2_header");
        }
        let start = offset / cs * cs;
        let end = (offset % cs + size)
            .next_multiple_of(cs)
            .saturating_add(start);
        let hit = |o: u64, l: u64| l > 0 && o < end && start < o.saturating_add(l);
        if ign != Area::ActiveL1
            && self.l1_size > 0
            && hit(self.l1_offset, u64::from(self.l1_size) * 8)
        {
            return Some("active L1 table");
        }
        if !self.reftable.is_empty() && hit(self.reftable_offset, self.reftable.len() as u64 * 8) {
            return Some("refcount table");
        }
        if hit(self.snapshots_offset, self.snapshots_size) {
            return Some("snapshot table");
        }
        let starts = self
            .starts
            .get_or_insert_with(|| TableStarts::new(&self.l1, &self.reftable, &self.snapshots, cs));
        if ign != Area::InactiveL1 && starts.inactive_l1_meets(start, end) {
            return Some("inactive L1 table");
        }
        // A table of one cluster at `o` meets [start, end) when start - cs < o < end (`start`
        // and `end` are cluster-aligned and start >= cs, the header having been ruled out).
        if ign != Area::ActiveL2 && starts.l2.range(start - cs + 1..end).next().is_some() {
            return Some("active L2 table");
        }
        if starts.refblocks.range(start..end).next().is_some() {
            return Some("refcount block");
        }
        if let Some((o, l, _)) = self.bitmaps {
            if hit(o, l) {
                return Some("bitmap directory");
            }
        }
        None
    }

    // ----- rebuild -----

    /// `alloc_clusters_imrt`, never handing out a cluster in `avoid`.
    fn alloc_imrt(&mut self, count: u64, first_free: &mut u64, avoid: &BTreeSet<u64>) -> u64 {
        let mut cluster = *first_free;
        let mut contiguous = 0u64;
        let mut first_gap = true;
        while cluster < self.refs.size && contiguous < count {
            if self.refs.get(cluster) == 0 && !avoid.contains(&cluster) {
                contiguous += 1;
                if first_gap {
                    *first_free = cluster;
                    first_gap = false;
                }
            } else {
                contiguous = 0;
            }
            cluster += 1;
        }
        if contiguous < count {
            self.refs.size = cluster + count - contiguous;
        }
        let start = cluster - contiguous;
        if first_gap {
            // No free cluster from *first_free up to `start`: the next search may begin here
            // (same result as QEMU's, without rescanning the image for every refcount block).
            *first_free = (*first_free).max(start);
        }
        for k in start..start + count {
            self.refs.set(k, 1);
        }
        start * self.cs
    }

    fn encode_block(&self, j: u64) -> Vec<u8> {
        let mut block = vec![0u8; self.cs as usize];
        let e = self.entries;
        for (a, b) in self.refs.windows(j * e, (j + 1) * e) {
            for (c, v) in self.refs.nonzero_in(a, b) {
                let _ = refcount::set(&mut block, self.order, c - j * e, v.min(self.refcount_max));
            }
        }
        block
    }

    /// `rebuild_refcounts_write_refblocks`: returns whether the table grew.
    fn write_refblocks(
        &mut self,
        first: u64,
        end: u64,
        table: &mut Vec<u64>,
        avoid: &BTreeSet<u64>,
    ) -> std::result::Result<bool, Fail> {
        let e = self.entries;
        let cs = self.cs;
        let mut first_free = 0u64;
        let mut grown = false;
        let mut end = end;
        let mut cluster = first;
        while cluster < end {
            let Some(c) = self.refs.next_nonzero(cluster, end) else {
                break;
            };
            let j = c / e;
            let start = j * e;
            let offset = match table.get(j as usize) {
                Some(&o) if o != 0 => o,
                _ => {
                    first_free = first_free.max(start);
                    let o = self.alloc_imrt(1, &mut first_free, avoid);
                    if o / cs >= end {
                        end = o / cs + 1;
                    }
                    if table.len() as u64 <= j {
                        let len = ((j + 1) * 8).next_multiple_of(cs) / 8;
                        if len * 8 > MAX_REFTABLE_BYTES {
                            self.msg(format!("ERROR allocating refblock: {EFBIG}"));
                            return Err(Fail(EFBIG.into()));
                        }
                        table.resize(len as usize, 0);
                        grown = true;
                    }
                    table[j as usize] = o;
                    o
                }
            };
            let block = self.encode_block(j);
            if let Err(e) = self.write(&block, offset) {
                self.msg(format!("ERROR writing refblock: {}", strerror(&e)));
                return Err(io_fail(&e));
            }
            cluster = start + e;
        }
        Ok(grown)
    }

    /// `rebuild_refcount_structure`: new blocks and table in the first free clusters (never in
    /// a cluster of the current structure), then the header is switched to them.
    fn rebuild_refcount_structure(&mut self, res: &mut Res) -> std::result::Result<(), Fail> {
        self.cache.clear();
        let cs = self.cs;
        let mut avoid = self.beyond_eof.clone();
        let rt_clusters = (self.reftable.len() as u64 * 8).div_ceil(cs);
        for k in 0..rt_clusters {
            avoid.insert(self.reftable_offset / cs + k);
        }
        for &e in &self.reftable {
            let o = e & REFT_OFFSET_MASK;
            if o != 0 {
                avoid.insert(o / cs);
            }
        }
        // An active L1 table past the end of the file is not counted as in use, so the new
        // structure could land on it; QEMU's overlap check refuses that write and the repair
        // fails. Refuse before writing anything, leaving the image as it was.
        let l1_end = self.l1_offset.saturating_add(u64::from(self.l1_size) * 8);
        if self.l1_size > 0 && l1_end > self.file_len {
            self.msg(format!(
                "ERROR the active L1 table ({} entries at {}) lies past the end of the file; \
                 the refcount structure cannot be rebuilt around it",
                self.l1_size,
                c_hex(self.l1_offset)
            ));
            res.check_errors += 1;
            return Err(Fail(EIO.into()));
        }
        let mut table = Vec::new();
        let size = self.refs.size;
        if let Err(f) = self.write_refblocks(0, size, &mut table, &avoid) {
            res.check_errors += 1;
            return Err(f);
        }
        let mut table_offset;
        let mut table_clusters;
        loop {
            let mut first_free = 0;
            table_clusters = (table.len() as u64 * 8).div_ceil(cs);
            table_offset = self.alloc_imrt(table_clusters, &mut first_free, &avoid);
            let start = table_offset / cs;
            match self.write_refblocks(start, start + table_clusters, &mut table, &avoid) {
                Err(f) => {
                    res.check_errors += 1;
                    return Err(f);
                }
                Ok(true) => continue,
                Ok(false) => break,
            }
        }
        let mut bytes: Vec<u8> = table.iter().flat_map(|v| v.to_be_bytes()).collect();
        bytes.resize((table_clusters * cs) as usize, 0);
        let mut hdr = [0u8; 12];
        hdr[..8].copy_from_slice(&table_offset.to_be_bytes());
        hdr[8..].copy_from_slice(&(table_clusters as u32).to_be_bytes());
        let written = self
            .write(&bytes, table_offset)
            .and_then(|()| self.sync())
            .and_then(|()| self.write(&hdr, 48))
            .and_then(|()| self.sync());
        if let Err(e) = written {
            self.msg(format!("ERROR writing reftable: {}", strerror(&e)));
            return Err(io_fail(&e));
        }
        table.resize((table_clusters * cs / 8) as usize, 0);
        self.reftable = table;
        self.reftable_offset = table_offset;
        self.starts = None;
        Ok(())
    }
}

/// The offsets at which the active L2 tables (from the L1 table) and the refcount blocks (from
/// the refcount table) start, each with the number of entries naming it, and the snapshots' L1
/// tables as disjoint sorted ranges. The overlap check looks a written range up here instead
/// of scanning the tables, which made a repair that rewrites many entries quadratic in the
/// table size (a fuzz finding).
struct TableStarts {
    l2: BTreeMap<u64, u32>,
    refblocks: BTreeMap<u64, u32>,
    /// `[start, end)` of the inactive L1 tables, merged where they meet.
    inactive_l1: Vec<(u64, u64)>,
}

impl TableStarts {
    fn new(l1: &[u64], reftable: &[u64], snapshots: &[Snap], cs: u64) -> Self {
        let mut ranges: Vec<(u64, u64)> = snapshots
            .iter()
            .filter(|s| s.l1_size > 0)
            .map(|s| {
                let end = s.l1_offset.saturating_add(u64::from(s.l1_size) * 8);
                (s.l1_offset, end)
            })
            .collect();
        ranges.sort_unstable();
        let mut inactive_l1: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
        for (a, b) in ranges {
            match inactive_l1.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => inactive_l1.push((a, b)),
            }
        }
        let mut t = TableStarts {
            l2: BTreeMap::new(),
            refblocks: BTreeMap::new(),
            inactive_l1,
        };
        for &e in l1 {
            Self::add(&mut t.l2, e & L1E_OFFSET_MASK);
        }
        for &e in reftable {
            // An unaligned offset cannot be a refcount block (QEMU refuses to read it).
            let o = e & REFT_OFFSET_MASK;
            if o % cs == 0 {
                Self::add(&mut t.refblocks, o);
            }
        }
        t
    }

    /// Whether an inactive L1 table meets `[start, end)`.
    fn inactive_l1_meets(&self, start: u64, end: u64) -> bool {
        // The last range starting before `end` is the only candidate: the ranges are disjoint
        // and sorted, so every earlier one also ends before it starts.
        let i = self.inactive_l1.partition_point(|&(a, _)| a < end);
        i > 0 && self.inactive_l1[i - 1].1 > start
    }

    fn add(set: &mut BTreeMap<u64, u32>, offset: u64) {
        if offset != 0 {
            *set.entry(offset).or_insert(0) += 1;
        }
    }

    fn remove(set: &mut BTreeMap<u64, u32>, offset: u64) {
        if let std::collections::btree_map::Entry::Occupied(mut e) = set.entry(offset) {
            *e.get_mut() -= 1;
            if *e.get() == 0 {
                e.remove();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::create::{CreateOptions, create};
    use std::path::PathBuf;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("qimg-check-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn run(path: &Path, repair: Option<Repair>) -> (CheckReport, Vec<String>) {
        let mut lines = Vec::new();
        let r = check(path, &CheckOptions { repair }, &mut |e| {
            if let CheckEvent::Message(m) = e {
                lines.push(m.to_string());
            }
        })
        .unwrap();
        (r, lines)
    }

    fn set_refcount16(path: &Path, cluster: u64, value: u16) {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        let mut b = [0u8; 8];
        f.read_exact_at(&mut b, 48).unwrap();
        let rt = u64::from_be_bytes(b);
        f.read_exact_at(&mut b, rt).unwrap();
        let block = u64::from_be_bytes(b);
        f.write_all_at(&value.to_be_bytes(), block + cluster * 2)
            .unwrap();
    }

    #[test]
    fn refs_count_past_16_bits_and_iterate_in_order() {
        let mut r = Refs::default();
        r.set(5, 1);
        r.set(70_000, 70_000);
        r.set(4095, 2);
        assert_eq!(r.get(70_000), 70_000);
        assert_eq!(r.get(6), 0);
        assert_eq!(
            r.nonzero_in(0, 100_000),
            vec![(5, 1), (4095, 2), (70_000, 70_000)]
        );
        assert_eq!(r.next_nonzero(6, 100_000), Some(4095));
        assert_eq!(r.next_nonzero(4096, 70_000), None);
        r.set(70_000, 3);
        assert_eq!(r.get(70_000), 3);
    }

    #[test]
    fn a_fresh_image_checks_clean_and_a_leak_is_found_and_freed() {
        let d = scratch("leak");
        let p = d.join("a.qcow2");
        let o = CreateOptions {
            size: Some(64 << 20),
            ..Default::default()
        };
        create(&p, &o, &mut |_, _| {}).unwrap();
        let (r, lines) = run(&p, None);
        assert_eq!(
            (r.corruptions, r.leaks, r.check_errors),
            (0, 0, 0),
            "{lines:?}"
        );
        assert_eq!(r.total_clusters, 1024);
        assert_eq!(r.image_end_offset, 0x40000);
        // Cluster 5 is past the end of a fresh image; extend the file so it counts.
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.set_len(0x60000).unwrap();
        set_refcount16(&p, 5, 1);
        let (r, lines) = run(&p, None);
        assert_eq!(
            (r.corruptions, r.leaks, r.exit_code()),
            (0, 1, 3),
            "{lines:?}"
        );
        assert_eq!(lines, vec!["Leaked cluster 5 refcount=1 reference=0"]);
        let (r, _) = run(&p, Some(Repair::Leaks));
        assert_eq!((r.leaks, r.leaks_fixed, r.exit_code()), (0, 1, 0));
        let (r, _) = run(&p, None);
        assert_eq!((r.corruptions, r.leaks), (0, 0));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_refcount_of_zero_needs_a_rebuild_which_repairs_it() {
        let d = scratch("rebuild");
        let p = d.join("a.qcow2");
        let o = CreateOptions {
            size: Some(64 << 20),
            ..Default::default()
        };
        create(&p, &o, &mut |_, _| {}).unwrap();
        // The L1 table (cluster 3) loses its refcount.
        set_refcount16(&p, 3, 0);
        let (r, lines) = run(&p, None);
        assert_eq!((r.corruptions, r.exit_code()), (1, 2), "{lines:?}");
        let (r, lines) = run(&p, Some(Repair::Leaks));
        assert_eq!(r.failure.as_deref(), Some(EIO), "{lines:?}");
        let (r, lines) = run(&p, Some(Repair::All));
        assert!(
            lines.iter().any(|l| l == "Rebuilding refcount structure"),
            "{lines:?}"
        );
        assert_eq!(
            (r.corruptions, r.leaks, r.check_errors),
            (0, 0, 0),
            "{lines:?}"
        );
        assert_eq!(r.corruptions_fixed, 1);
        let (r, lines) = run(&p, None);
        assert_eq!(
            (r.corruptions, r.leaks, r.check_errors),
            (0, 0, 0),
            "{lines:?}"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn json_leaves_out_zero_counters_but_not_check_errors() {
        let r = CheckReport {
            image_end_offset: 65536,
            total_clusters: 16,
            filename: "a".into(),
            format: "qcow2".into(),
            ..Default::default()
        };
        let v = serde_json::to_value(&r).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "image-end-offset",
                "total-clusters",
                "check-errors",
                "filename",
                "format"
            ]
        );
    }
}

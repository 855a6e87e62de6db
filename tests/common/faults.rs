//! Helpers for the crash and I/O error tests (`tests/engine/crash.rs`, `tests/engine/io_errors.rs`):
//! images built in memory, a storage recorder, seeded guest workloads, and the library check
//! on image bytes. The flat model (and what each request may have left behind), the generator
//! and the patterns are the test kit's.
#![allow(dead_code)]

use std::io::IoSlice;
use std::path::Path;
use std::sync::{Arc, Mutex};

use qimg::io::{
    AllocateOutcome, DiscardOutcome, FaultPlan, FaultyStorage, MemStorage, Result as IoResult,
    Storage, ZeroOutcome,
};
use qimg::tools::check::{CheckOptions, CheckReport, Repair, check};
use qimg::tools::create::{Compat, CreateOptions, create};
use qimg::{Allocation, Backing, BitmapInfo, CacheOptions, DirtyBitmap, Image, OpenOptions};

use qimg_testkit::model::{GuestModel, GuestOp};
use qimg_testkit::pattern::{cached_pattern, pattern};
use qimg_testkit::qemu::{Scratch, qemu_check_counts};
use qimg_testkit::rng::Rng;

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * KIB;

// ----- recording storage -----

/// One storage operation as it reached the storage, in order.
#[derive(Debug, Clone)]
pub enum TraceOp {
    Read { offset: u64, len: u64 },
    Write { offset: u64, data: Arc<[u8]> },
    WriteZeroes { offset: u64, len: u64 },
    Discard { offset: u64, len: u64 },
    Allocate { offset: u64, len: u64 },
    Flush,
    SetLen { len: u64 },
}

impl TraceOp {
    pub fn is_flush(&self) -> bool {
        matches!(self, TraceOp::Flush)
    }

    pub fn modifies(&self) -> bool {
        !matches!(self, TraceOp::Read { .. } | TraceOp::Flush)
    }
}

/// A shared, append-only log of storage operations.
pub type Trace = Arc<Mutex<Vec<TraceOp>>>;

/// A [`MemStorage`] that appends every operation it serves to a [`Trace`] (when it has one).
/// Put under a [`FaultyStorage`], it sees exactly the operations the fault layer counts and
/// lets through, in the same order, so trace index `k` is the fault layer's operation `k`.
#[derive(Debug, Clone)]
pub struct Recorder {
    inner: MemStorage,
    log: Option<Trace>,
}

impl Recorder {
    pub fn new(inner: MemStorage, log: Option<Trace>) -> Self {
        Self { inner, log }
    }

    fn push(&self, op: TraceOp) {
        if let Some(l) = &self.log {
            l.lock().unwrap().push(op);
        }
    }
}

impl Storage for Recorder {
    async fn read_at_most(&self, buf: &mut [u8], offset: u64) -> IoResult<usize> {
        let n = self.inner.read_at_most(buf, offset).await?;
        self.push(TraceOp::Read {
            offset,
            len: buf.len() as u64,
        });
        Ok(n)
    }

    async fn write_at(&self, buf: &[u8], offset: u64) -> IoResult<()> {
        self.inner.write_at(buf, offset).await?;
        self.push(TraceOp::Write {
            offset,
            data: buf.into(),
        });
        Ok(())
    }

    async fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> IoResult<()> {
        self.inner.write_vectored_at(bufs, offset).await?;
        let data: Vec<u8> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
        self.push(TraceOp::Write {
            offset,
            data: data.into(),
        });
        Ok(())
    }

    async fn write_zeroes(&self, offset: u64, len: u64) -> IoResult<ZeroOutcome> {
        let o = self.inner.write_zeroes(offset, len).await?;
        self.push(TraceOp::WriteZeroes { offset, len });
        Ok(o)
    }

    async fn discard(&self, offset: u64, len: u64) -> IoResult<DiscardOutcome> {
        let o = self.inner.discard(offset, len).await?;
        self.push(TraceOp::Discard { offset, len });
        Ok(o)
    }

    async fn allocate(&self, offset: u64, len: u64) -> IoResult<AllocateOutcome> {
        let o = self.inner.allocate(offset, len).await?;
        self.push(TraceOp::Allocate { offset, len });
        Ok(o)
    }

    async fn flush(&self) -> IoResult<()> {
        self.inner.flush().await?;
        self.push(TraceOp::Flush);
        Ok(())
    }

    async fn len(&self) -> IoResult<u64> {
        self.inner.len().await
    }

    async fn set_len(&self, len: u64) -> IoResult<()> {
        self.inner.set_len(len).await?;
        self.push(TraceOp::SetLen { len });
        Ok(())
    }
}

/// Issues a recorded operation again on `s` (reads are skipped).
pub async fn replay<S: Storage>(s: &S, op: &TraceOp) -> IoResult<()> {
    match op {
        TraceOp::Read { .. } => Ok(()),
        TraceOp::Write { offset, data } => s.write_at(data, *offset).await,
        TraceOp::WriteZeroes { offset, len } => s.write_zeroes(*offset, *len).await.map(|_| ()),
        TraceOp::Discard { offset, len } => s.discard(*offset, *len).await.map(|_| ()),
        TraceOp::Allocate { offset, len } => s.allocate(*offset, *len).await.map(|_| ()),
        TraceOp::Flush => s.flush().await,
        TraceOp::SetLen { len } => s.set_len(*len).await,
    }
}

/// The disk a power cut before operation `k` of `trace` can leave, starting from `initial`:
/// everything up to the last flush before `k`, plus the unflushed modifications `policy`
/// keeps (replayed through a fresh [`FaultyStorage`]).
pub async fn disk_after_power_cut(
    initial: &[u8],
    trace: &[TraceOp],
    k: usize,
    policy: qimg::io::CrashPolicy,
) -> Vec<u8> {
    let durable = MemStorage::from_bytes(initial);
    let last_flush = trace[..k].iter().rposition(TraceOp::is_flush);
    let from = match last_flush {
        Some(p) => {
            for op in &trace[..=p] {
                replay(&durable, op).await.unwrap();
            }
            p + 1
        }
        None => 0,
    };
    let s = FaultyStorage::with_baseline(MemStorage::new(), &durable);
    let ctl = s.controller();
    for op in &trace[from..k] {
        replay(&s, op).await.unwrap();
    }
    ctl.power_cut(policy).snapshot()
}

/// The storage the engine runs on in these tests.
pub type Disk = FaultyStorage<Recorder>;

/// A fault-injecting disk holding `bytes` (durable), recording into `log` if given.
pub fn faulty_disk(bytes: &[u8], log: Option<Trace>) -> Disk {
    let mem = MemStorage::from_bytes(bytes);
    let baseline = mem.deep_copy();
    FaultyStorage::with_baseline(Recorder::new(mem, log), &baseline)
}

// ----- image shapes -----

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackingKind {
    None,
    Raw,
    Qcow2,
}

/// An image configuration.
#[derive(Debug, Clone)]
pub struct Shape {
    pub name: &'static str,
    pub cluster_size: u64,
    pub extended: bool,
    pub refcount_bits: u64,
    pub lazy: bool,
    pub v2: bool,
    pub backing: BackingKind,
    /// Virtual size (a partial last cluster is fine).
    pub size: u64,
    /// Two 512-byte L2 slices and the minimum refcount cache in 512-byte slices: constant
    /// eviction, and refcount blocks of several slices.
    pub small_cache: bool,
    pub sparse: bool,
    /// Two enabled persistent dirty bitmaps ([`BITMAPS`]) in the image before the workload.
    pub bitmaps: bool,
    /// Keep them as QEMU does (in use while open) instead of crash-consistent.
    pub qemu_bitmaps: bool,
}

/// The bitmaps of a shape with `bitmaps`: (name, granularity).
pub const BITMAPS: [(&str, Option<u64>); 2] = [("fine", Some(512)), ("default", None)];

impl Shape {
    pub fn new(name: &'static str, cluster_size: u64, extended: bool, size: u64) -> Self {
        Self {
            name,
            cluster_size,
            extended,
            refcount_bits: 16,
            lazy: false,
            v2: false,
            backing: BackingKind::None,
            size,
            small_cache: false,
            sparse: false,
            bitmaps: false,
            qemu_bitmaps: false,
        }
    }

    pub fn subcluster_size(&self) -> u64 {
        if self.extended {
            self.cluster_size / 32
        } else {
            self.cluster_size
        }
    }

    pub fn open_options(&self) -> OpenOptions {
        let mut o = OpenOptions::new().writable(true);
        o = o
            .clean_timer(false)
            .crash_consistent_bitmaps(!self.qemu_bitmaps);
        if self.small_cache {
            o = o.cache(CacheOptions {
                l2_cache_size: Some(1024),
                l2_cache_entry_size: Some(512),
                refcount_cache_size: Some(4 * self.cluster_size),
                refcount_cache_entry_size: Some(512),
                ..CacheOptions::default()
            });
        }
        if self.sparse {
            o = o.allocation(Allocation::Sparse);
        }
        o
    }
}

/// The bytes of an image (and of its backing file), made once and reopened from memory.
#[derive(Debug, Clone)]
pub struct Images {
    pub shape: Shape,
    pub image: Vec<u8>,
    /// The backing file's bytes (a qcow2 or raw image).
    pub backing_file: Option<Vec<u8>>,
    /// What the guest sees where nothing is allocated: the backing file's contents, padded
    /// with zeros to the virtual size.
    pub backing_guest: Vec<u8>,
}

fn create_opts(shape: &Shape, size: u64) -> CreateOptions {
    CreateOptions {
        size: Some(size),
        cluster_size: shape.cluster_size,
        compat: if shape.v2 { Compat::V2 } else { Compat::V3 },
        extended_l2: shape.extended,
        refcount_bits: shape.refcount_bits,
        lazy_refcounts: shape.lazy,
        ..CreateOptions::default()
    }
}

fn create_bytes(dir: &Path, name: &str, opts: &CreateOptions) -> Vec<u8> {
    let path = dir.join(name);
    create(&path, opts, &mut |_, _| {}).unwrap_or_else(|e| panic!("create {name}: {e}"));
    std::fs::read(&path).unwrap()
}

/// Makes the image of `shape` with `qimg::create` (and its backing file: raw, or qcow2
/// written through the engine with a hole in the middle), then keeps only the bytes.
pub async fn make_images(shape: &Shape) -> Images {
    let dir = Scratch::new("faults-create");
    let size = shape.size;
    // The backing file is shorter than the overlay: its tail reads as zeros.
    let bsize = (size * 2 / 3) / 512 * 512;
    let mut backing_guest = vec![0u8; size as usize];
    let backing_file = match shape.backing {
        BackingKind::None => None,
        BackingKind::Raw => {
            let data = pattern(0xBAC4, 0, bsize as usize);
            backing_guest[..data.len()].copy_from_slice(&data);
            std::fs::write(dir.path("base.raw"), &data).unwrap();
            Some(data)
        }
        BackingKind::Qcow2 => {
            let mut opts = create_opts(shape, bsize);
            opts.lazy_refcounts = false;
            let raw = create_bytes(&dir.0, "base.qcow2", &opts);
            let mem = MemStorage::from_bytes(&raw);
            let img = shape
                .open_options()
                .open_storage(mem.clone(), "base.qcow2", None, None)
                .await
                .unwrap();
            // Data in the first and last thirds of the backing file, a hole between.
            let third = bsize / 3;
            for (at, len) in [(0, third), (2 * third, bsize - 2 * third)] {
                let data = pattern(0xBAC4, at, len as usize);
                img.write(&data, at).await.unwrap();
                backing_guest[at as usize..(at + len) as usize].copy_from_slice(&data);
            }
            img.close().await.unwrap();
            Some(mem.snapshot())
        }
    };
    let mut opts = create_opts(shape, size);
    match shape.backing {
        BackingKind::None => {}
        BackingKind::Raw => {
            opts.backing_file = Some("base.raw".into());
            opts.backing_fmt = Some("raw".into());
        }
        BackingKind::Qcow2 => {
            opts.backing_file = Some("base.qcow2".into());
            opts.backing_fmt = Some("qcow2".into());
        }
    }
    let image = create_bytes(&dir.0, "img.qcow2", &opts);
    let mut images = Images {
        shape: shape.clone(),
        image,
        backing_file,
        backing_guest,
    };
    if shape.bitmaps {
        let (img, mem) = images.open_mem(&images.image).await;
        let img = img.expect("open to add bitmaps");
        for (name, g) in BITMAPS {
            img.add_bitmap(name, g, true).unwrap();
        }
        img.close().await.unwrap();
        images.image = mem.snapshot();
    }
    images
}

impl Images {
    /// The flat model of the new image: the backing file's contents everywhere.
    pub fn model(&self) -> GuestModel {
        GuestModel::new(
            self.shape.size,
            self.backing_guest.clone(),
            self.shape.subcluster_size(),
        )
    }

    /// The backing image for an engine over storages made by `wrap`.
    pub async fn backing<S: Storage + 'static>(
        &self,
        wrap: impl Fn(&[u8]) -> S,
    ) -> Option<Backing<S>> {
        let bytes = self.backing_file.as_ref()?;
        Some(match self.shape.backing {
            BackingKind::None => return None,
            BackingKind::Raw => Backing::Raw {
                storage: wrap(bytes),
                path: "base.raw".into(),
            },
            BackingKind::Qcow2 => {
                let mut o = self.shape.open_options();
                o = o.writable(false);
                let img = o
                    .open_storage(wrap(bytes), "base.qcow2", None, None)
                    .await
                    .expect("open the backing image");
                Backing::Qcow2(img)
            }
        })
    }

    /// Writes the backing file next to where the image will be checked (qemu-img check
    /// opens it).
    pub fn write_backing(&self, dir: &Path) {
        if let Some(b) = &self.backing_file {
            let name = match self.shape.backing {
                BackingKind::Qcow2 => "base.qcow2",
                _ => "base.raw",
            };
            std::fs::write(dir.join(name), b).unwrap();
        }
    }

    /// Opens `image` read-write over a fresh [`MemStorage`] (returned too, to see the bytes).
    pub async fn open_mem(&self, image: &[u8]) -> (qimg::Result<Image<MemStorage>>, MemStorage) {
        let mem = MemStorage::from_bytes(image);
        let backing = self.backing(MemStorage::from_bytes).await;
        let img = self
            .shape
            .open_options()
            .open_storage(mem.clone(), "img.qcow2", backing, None)
            .await;
        (img, mem)
    }

    /// The guest contents of snapshot `name` of `image`, if it has one of that name.
    pub async fn snapshot_of(&self, image: &[u8], name: &str) -> Option<Vec<u8>> {
        let backing = self.backing(MemStorage::from_bytes).await;
        let img = self
            .shape
            .open_options()
            .writable(false)
            .open_storage(MemStorage::from_bytes(image), "img.qcow2", backing, None)
            .await
            .expect("a read-only open for the snapshot");
        img.snapshots()
            .await
            .unwrap()
            .iter()
            .find(|s| s.name == name)?;
        img.view_snapshot(None, Some(name)).await.unwrap();
        Some(read_all(&img).await.unwrap())
    }

    /// The bitmaps of `image` as a read-only open finds them, each with its bits when it is
    /// consistent.
    pub async fn bitmaps_of(&self, image: &[u8]) -> Vec<(BitmapInfo, Option<DirtyBitmap>)> {
        let backing = self.backing(MemStorage::from_bytes).await;
        let img = self
            .shape
            .open_options()
            .writable(false)
            .open_storage(MemStorage::from_bytes(image), "img.qcow2", backing, None)
            .await
            .expect("a read-only open for the bitmaps");
        let mut out = Vec::new();
        for info in img.bitmaps() {
            let bits = if info.inconsistent {
                None
            } else {
                Some(img.dirty_bitmap(&info.name).await.unwrap())
            };
            out.push((info, bits));
        }
        out
    }

    /// Opens `image` read-write over a [`Disk`] with `plan` armed before the open, recording
    /// into `log`; returns the live contents too (what the storage holds, flushed or not).
    pub async fn open_armed(
        &self,
        image: &[u8],
        plan: Option<FaultPlan>,
        log: Option<Trace>,
    ) -> (
        qimg::Result<Image<Disk>>,
        qimg::io::FaultController,
        MemStorage,
    ) {
        let mem = MemStorage::from_bytes(image);
        let baseline = mem.deep_copy();
        let disk = FaultyStorage::with_baseline(Recorder::new(mem.clone(), log), &baseline);
        let ctl = disk.controller();
        if let Some(p) = plan {
            ctl.arm(p);
        }
        let backing = self.backing(|b| faulty_disk(b, None)).await;
        let img = self
            .shape
            .open_options()
            .open_storage(disk, "img.qcow2", backing, None)
            .await;
        (img, ctl, mem)
    }

    /// Opens `image` read-write over a [`Disk`] (fault injection), recording into `log`.
    pub async fn open_faulty(
        &self,
        image: &[u8],
        log: Option<Trace>,
    ) -> (qimg::Result<Image<Disk>>, qimg::io::FaultController) {
        let (img, ctl, _) = self.open_armed(image, None, log).await;
        (img, ctl)
    }
}

// ----- guest workloads -----

/// A seeded workload: writes (subcluster-sized, multi-cluster, small unaligned), write-zeroes,
/// discards, reads and flushes, mostly in the first quarter of the disk so that clusters are
/// rewritten, copied on write, freed and reused.
pub fn workload(shape: &Shape, seed: u64, n: usize) -> Vec<GuestOp> {
    let mut rng = Rng(seed ^ 0x5EED_F0B5);
    let size = shape.size;
    let scs = shape.subcluster_size();
    let cs = shape.cluster_size;
    let mut ops = Vec::with_capacity(n);
    for _ in 0..n {
        let span = if rng.chance(3, 4) { size / 4 } else { size };
        let sc = rng.below(span.div_ceil(scs));
        let within = match rng.below(4) {
            0 | 1 => 0,
            2 => rng.below(scs / 512) * 512,
            _ => rng.below(scs),
        };
        let at = (sc * scs + within).min(size - 1);
        let len = match rng.below(6) {
            0 => scs,
            1 => scs * (1 + rng.below(6)),
            2 => 1 + rng.below(4096),
            3 => 512 * (1 + rng.below(16)),
            4 => cs,
            _ => 1 + rng.below(3 * cs),
        };
        let len = len.min(size - at).max(1);
        let op = match rng.below(20) {
            0..=8 => GuestOp::Write {
                at,
                len,
                seed: rng.next(),
            },
            9..=10 => GuestOp::Zero { at, len },
            11..=13 => GuestOp::Discard { at, len },
            14..=15 => GuestOp::Read { at, len },
            _ => GuestOp::Flush,
        };
        ops.push(op);
    }
    ops
}

/// Runs one guest request.
pub async fn run_op<S: Storage + 'static>(img: &Image<S>, op: &GuestOp) -> qimg::Result<()> {
    match *op {
        GuestOp::Write { at, len, seed } => img.write(&cached_pattern(seed, at, len), at).await,
        GuestOp::Zero { at, len } => img.write_zeroes(at, len).await,
        GuestOp::Discard { at, len } => img.discard(at, len).await,
        GuestOp::Read { at, len } => {
            let mut buf = vec![0u8; len as usize];
            img.read(&mut buf, at).await
        }
        GuestOp::Flush => img.flush().await,
        GuestOp::Close => img.close().await,
        // A reopen needs the storage the image was opened on, which only the caller has.
        GuestOp::Reopen => unreachable!("crash and I/O-error workloads never reopen"),
    }
}

// ----- checking image bytes -----

/// Whether the header of `image` has the dirty bit (incompatible bit 0) set.
pub fn dirty_bit(image: &[u8]) -> bool {
    image.len() >= 80 && image[79] & 1 != 0
}

/// The library check (no repair) of `image`, written to `path`.
pub fn qimg_check(path: &Path, image: &[u8]) -> CheckReport {
    std::fs::write(path, image).unwrap();
    qimg_check_file(path, None)
}

/// The library check of the file at `path`, repairing as asked.
pub fn qimg_check_file(path: &Path, repair: Option<Repair>) -> CheckReport {
    check(
        path,
        &CheckOptions {
            repair,
            ..Default::default()
        },
        &mut |_| {},
    )
    .unwrap_or_else(|e| panic!("qimg check {} cannot start: {e}", path.display()))
}

/// Panics unless `qemu-img check` reports what `report` does.
pub fn assert_qemu_agrees(path: &Path, report: &CheckReport, what: &str) {
    let theirs = qemu_check_counts(path);
    let ours = (report.corruptions, report.leaks, report.check_errors);
    assert_eq!(
        ours, theirs,
        "{what}: qimg check (corruptions, leaks, check-errors) = {ours:?}, qemu-img check = {theirs:?}"
    );
}

/// Reads the whole guest disk.
pub async fn read_all<S: Storage + 'static>(img: &Image<S>) -> qimg::Result<Vec<u8>> {
    let mut buf = vec![0u8; img.size() as usize];
    img.read(&mut buf, 0).await?;
    Ok(buf)
}

/// A runtime for one test: current thread, timers enabled (for timeouts).
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
}

/// `QIMG_<NAME>` as a number, or `default`.
pub fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

//! Helpers for the crash and I/O error tests (`tests/crash.rs`, `tests/io_errors.rs`):
//! images built in memory, a storage recorder, seeded guest workloads, a flat byte model that
//! also knows what each operation may have left behind, and the library check on image bytes.
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
use qimg::{Allocation, Backing, CacheOptions, Image, OpenOptions};

use super::engine::pattern;
use super::{Scratch, qemu_img};

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * KIB;

/// splitmix64: small, fast, deterministic.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform enough in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }
}

// ----- recording storage -----

/// One storage operation as it reached the storage, in order.
#[derive(Debug, Clone)]
pub enum TraceOp {
    Read,
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
        !matches!(self, TraceOp::Read | TraceOp::Flush)
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
        self.push(TraceOp::Read);
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
        TraceOp::Read => Ok(()),
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
    /// Two 512-byte L2 slices and the minimum refcount cache: constant eviction.
    pub small_cache: bool,
    pub sparse: bool,
}

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
        o = o.clean_timer(false);
        if self.small_cache {
            o = o.cache(CacheOptions {
                l2_cache_size: Some(1024),
                l2_cache_entry_size: Some(512),
                refcount_cache_size: Some(4 * self.cluster_size),
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
    Images {
        shape: shape.clone(),
        image,
        backing_file,
        backing_guest,
    }
}

impl Images {
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
        let disk = faulty_disk(image, log);
        let ctl = disk.controller();
        let backing = self.backing(|b| faulty_disk(b, None)).await;
        let img = self
            .shape
            .open_options()
            .open_storage(disk, "img.qcow2", backing, None)
            .await;
        (img, ctl)
    }
}

// ----- guest workloads -----

/// One guest request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuestOp {
    Write {
        at: u64,
        len: u64,
        seed: u64,
    },
    Zero {
        at: u64,
        len: u64,
    },
    Discard {
        at: u64,
        len: u64,
    },
    Read {
        at: u64,
        len: u64,
    },
    Flush,
    /// Flush and close (the last operation of a crash workload).
    Close,
}

impl GuestOp {
    /// The guest range the request names, if any.
    pub fn range(&self) -> Option<(u64, u64)> {
        match *self {
            GuestOp::Write { at, len, .. }
            | GuestOp::Zero { at, len }
            | GuestOp::Discard { at, len }
            | GuestOp::Read { at, len } => Some((at, at + len)),
            _ => None,
        }
    }

    pub fn is_barrier(&self) -> bool {
        matches!(self, GuestOp::Flush | GuestOp::Close)
    }
}

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

/// `pattern(seed, at, len)`, remembered per thread: workloads replay the same requests many
/// times, and the pattern costs more than the rest of a request in a debug build.
pub fn data(seed: u64, at: u64, len: u64) -> Arc<Vec<u8>> {
    use std::cell::RefCell;
    use std::collections::HashMap;
    type Cache = HashMap<(u64, u64, u64), Arc<Vec<u8>>>;
    thread_local! {
        static CACHE: RefCell<Cache> = RefCell::new(HashMap::new());
    }
    CACHE.with(|c| {
        let mut c = c.borrow_mut();
        if c.len() > 512 {
            c.clear();
        }
        c.entry((seed, at, len))
            .or_insert_with(|| Arc::new(pattern(seed, at, len as usize)))
            .clone()
    })
}

/// Runs one guest request.
pub async fn run_op<S: Storage + 'static>(img: &Image<S>, op: &GuestOp) -> qimg::Result<()> {
    match *op {
        GuestOp::Write { at, len, seed } => img.write(&data(seed, at, len), at).await,
        GuestOp::Zero { at, len } => img.write_zeroes(at, len).await,
        GuestOp::Discard { at, len } => img.discard(at, len).await,
        GuestOp::Read { at, len } => {
            let mut buf = vec![0u8; len as usize];
            img.read(&mut buf, at).await
        }
        GuestOp::Flush => img.flush().await,
        GuestOp::Close => img.close().await,
    }
}

// ----- the model -----

/// What one request leaves in the guest range `[start, start + bytes.len())`.
#[derive(Debug, Clone)]
pub struct Effect {
    pub start: u64,
    pub bytes: Vec<u8>,
}

impl Effect {
    pub fn end(&self) -> u64 {
        self.start + self.bytes.len() as u64
    }
}

/// A flat model of the guest disk.
#[derive(Debug, Clone)]
pub struct Model {
    pub data: Vec<u8>,
    pub backing: Arc<Vec<u8>>,
    pub scs: u64,
}

impl Model {
    pub fn new(images: &Images) -> Self {
        Self {
            data: images.backing_guest.clone(),
            backing: Arc::new(images.backing_guest.clone()),
            scs: images.shape.subcluster_size(),
        }
    }

    pub fn size(&self) -> u64 {
        self.data.len() as u64
    }

    /// The range a discard of `[at, at + len)` drops: its whole subclusters, the last one
    /// counting as whole when the range reaches the end of the disk.
    fn discarded(&self, at: u64, len: u64) -> Option<(u64, u64)> {
        let size = self.size();
        let end = at + len;
        let first = at.div_ceil(self.scs) * self.scs;
        let mut last = first;
        while last < size {
            let e = (last + self.scs).min(size);
            if e > end {
                break;
            }
            last = e;
        }
        (last > first).then_some((first, last))
    }

    /// What `op` leaves on the disk where it changes anything.
    pub fn effect(&self, op: &GuestOp) -> Option<Effect> {
        match *op {
            GuestOp::Write { at, len, seed } => Some(Effect {
                start: at,
                bytes: data(seed, at, len).to_vec(),
            }),
            GuestOp::Zero { at, len } => Some(Effect {
                start: at,
                bytes: vec![0; len as usize],
            }),
            GuestOp::Discard { at, len } => self.discarded(at, len).map(|(s, e)| Effect {
                start: s,
                bytes: self.backing[s as usize..e as usize].to_vec(),
            }),
            _ => None,
        }
    }

    pub fn apply_effect(&mut self, e: &Effect) {
        self.data[e.start as usize..e.end() as usize].copy_from_slice(&e.bytes);
    }

    pub fn apply(&mut self, op: &GuestOp) {
        if let Some(e) = self.effect(op) {
            self.apply_effect(&e);
        }
    }
}

/// Checks guest contents `read` read after a crash: outside the ranges the `window` requests
/// touched, every byte must equal `flushed` (the model as of the last completed flush);
/// inside them, each byte must be its flushed value or a value one of those requests left
/// there. Compares 512-byte sectors whole where it can.
pub fn check_possible(
    read: &[u8],
    flushed: &[u8],
    window: &[&Effect],
) -> Result<(), (u64, String)> {
    assert_eq!(read.len(), flushed.len());
    let mut ranges: Vec<(u64, u64)> = window.iter().map(|e| (e.start, e.end())).collect();
    ranges.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for (s, e) in ranges {
        match merged.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    let mut pos = 0u64;
    let gap = |from: u64, to: u64| -> Result<(), (u64, String)> {
        let (a, b) = (from as usize, to as usize);
        if read[a..b] != flushed[a..b] {
            let i = a + (a..b).position(|i| read[i] != flushed[i]).unwrap_or(0);
            return Err((
                i as u64,
                format!(
                    "guest byte {i:#x} reads {:#04x}, but nothing touched it since the last \
                     flush, which left {:#04x}",
                    read[i], flushed[i]
                ),
            ));
        }
        Ok(())
    };
    for &(s, e) in &merged {
        gap(pos, s)?;
        let mut c = s;
        while c < e {
            let ce = ((c / 512 + 1) * 512).min(e);
            let (a, b) = (c as usize, ce as usize);
            let whole = read[a..b] == flushed[a..b]
                || window.iter().any(|w| {
                    w.start <= c
                        && ce <= w.end()
                        && read[a..b] == w.bytes[(c - w.start) as usize..(ce - w.start) as usize]
                });
            if !whole {
                for i in c..ce {
                    let v = read[i as usize];
                    let ok = v == flushed[i as usize]
                        || window.iter().any(|w| {
                            w.start <= i && i < w.end() && w.bytes[(i - w.start) as usize] == v
                        });
                    if !ok {
                        let mut cands: Vec<u8> = window
                            .iter()
                            .filter(|w| w.start <= i && i < w.end())
                            .map(|w| w.bytes[(i - w.start) as usize])
                            .collect();
                        cands.dedup();
                        return Err((
                            i,
                            format!(
                                "guest byte {i:#x} reads {v:#04x}: neither its flushed value \
                                 {:#04x} nor any value written to it since ({cands:02x?})",
                                flushed[i as usize]
                            ),
                        ));
                    }
                }
            }
            c = ce;
        }
        pos = e;
    }
    gap(pos, read.len() as u64)
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
    check(path, &CheckOptions { repair }, &mut |_| {})
        .unwrap_or_else(|e| panic!("qimg check {} cannot start: {e}", path.display()))
}

/// `qemu-img check --output=json` of the file at `path`: (corruptions, leaks, check-errors).
pub fn qemu_check_counts(path: &Path) -> (u64, u64, u64) {
    let dir = path.parent().unwrap();
    let name = path.file_name().unwrap().to_str().unwrap();
    let o = qemu_img(dir, &["check", "--output=json", name]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|_| {
        panic!(
            "qemu-img check printed no JSON (exit {:?}): {}{}",
            o.status.code(),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    });
    let n = |f: &str| v.get(f).and_then(|x| x.as_u64()).unwrap_or(0);
    (n("corruptions"), n("leaks"), n("check-errors"))
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

/// A scratch directory in `/dev/shm` when there is one (the check reads files; a tmpfs keeps
/// thousands of them cheap), else in the temporary directory.
pub fn scratch_in_memory(tag: &str) -> Scratch {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        return Scratch::new(tag);
    }
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let dir = shm.join(format!(
        "qimg-test-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    match std::fs::create_dir_all(&dir) {
        Ok(()) => Scratch(dir),
        Err(_) => Scratch::new(tag),
    }
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

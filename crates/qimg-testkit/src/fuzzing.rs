//! Entry points of the engine-level cargo-fuzz targets in `fuzz/` (`open_read`, `ops`,
//! `check`), also run by `cargo test` (`tests/fuzz_corpus.rs`) on the committed seed corpus
//! and on saved findings.
//!
//! Each function takes arbitrary bytes and must return normally whatever they are; a panic is
//! a finding. The functions need no fuzzing library: they run the engine on a current-thread
//! tokio runtime over [`MemStorage`], and the check target (whose library function works on a
//! path) writes its files under one fixed directory per process in the system temporary
//! directory (`qimg-fuzz-<pid>`), removing each file after use.
//!
//! Work per input is bounded so that one input runs in milliseconds: reads and maps cover at
//! most [`READ_WINDOW`] bytes at the start of the disk plus a few sampled windows of
//! [`SAMPLE_WINDOW`] bytes, and [`ops`] runs at most [`MAX_OPS`] operations on a disk of a
//! few MiB.

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use qimg::io::MemStorage;
use qimg::tools::check::{CheckEvent, CheckOptions, CheckReport, Repair};
use qimg::tools::create::{Compat, CreateOptions};
use qimg::{Allocation, Backing, CacheOptions, Extent, ExtentKind, Image, OpenOptions};

use crate::model::{Geometry, GuestModel, GuestOp, OpCode};
use crate::pattern::{first_difference, word_pattern as pattern};

/// Bytes read and mapped from the start of the virtual disk by [`open_read`].
pub const READ_WINDOW: u64 = 1 << 20;
/// Bytes read and mapped around each sampled offset by [`open_read`].
pub const SAMPLE_WINDOW: u64 = 64 << 10;
/// Most operations [`ops`] decodes from one input.
pub const MAX_OPS: usize = 64;
/// Bytes of the raw backing file [`open_read`] gives every image.
const OPEN_READ_BACKING: usize = 96 << 10;
/// Read chunk of [`open_read`]: deliberately not a multiple of 512.
const READ_CHUNK: usize = (48 << 10) + 123;

/// Runs `f` to completion on this thread's current-thread runtime.
fn block_on<F: Future>(f: F) -> F::Output {
    thread_local! {
        static RT: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a current-thread tokio runtime");
    }
    RT.with(|rt| rt.block_on(f))
}

/// Open options with caches small enough to evict all the time: two 512-byte L2 slices and
/// the smallest refcount cache (four clusters) in 512-byte slices, so that a refcount block
/// of 4 KiB clusters is eight slices. No clean timer task.
fn small_cache(writable: bool) -> OpenOptions {
    OpenOptions::new()
        .writable(writable)
        .cache(CacheOptions {
            l2_cache_size: Some(1024),
            l2_cache_entry_size: Some(512),
            refcount_cache_entry_size: Some(512),
            ..CacheOptions::default()
        })
        .clean_timer(false)
}

/// Checks that `extents` cover `[offset, offset + len)` in order, without gaps or empty
/// extents, as [`Image::map`] promises.
fn assert_extents_cover(extents: &[Extent], offset: u64, len: u64) {
    let mut at = offset;
    for e in extents {
        assert_eq!(
            e.start, at,
            "map: extent {e:?} does not start where the last ended"
        );
        assert!(e.length > 0, "map: empty extent {e:?}");
        at = e
            .start
            .checked_add(e.length)
            .expect("map: extent end overflows");
    }
    assert_eq!(
        at,
        offset + len,
        "map: extents end at {at:#x}, not at the range end"
    );
}

/// Opens `data` as a qcow2 image from memory and reads it, never panicking, hanging or
/// allocating without bound, whatever the bytes.
///
/// Read-only (on a read-only storage, with `small_cache` caches): [`Image::map`] and reads in
/// unaligned chunks of the first [`READ_WINDOW`] bytes and of [`SAMPLE_WINDOW`] bytes at the
/// middle, the end and the first L2 table boundary of the disk. The image gets a raw backing
/// file (a pattern) whatever its header says, and a copy of `data` as its external data file
/// when it wants one. Where both the map and the reads of a window succeed, each extent must
/// read as its kind says: data extents as the file bytes at their host offset (zeros past the
/// end), zero extents as zeros, unallocated ones as the backing file (compressed extents are
/// not compared).
///
/// Then read-write on a copy: one 4 KiB write, a flush and a close, which may fail but must
/// not panic ([`open_write`]).
pub fn open_read(data: &[u8]) {
    block_on(open_read_async(data));
}

fn open_read_backing() -> &'static [u8] {
    static B: OnceLock<Vec<u8>> = OnceLock::new();
    B.get_or_init(|| pattern(0xBAC4, 0, OPEN_READ_BACKING))
}

fn raw_backing(bytes: &[u8]) -> Backing<MemStorage> {
    Backing::Raw {
        storage: MemStorage::from_bytes(bytes).read_only(),
        path: PathBuf::from("backing.raw"),
    }
}

async fn open_read_async(data: &[u8]) {
    let backing = open_read_backing();
    let storage = MemStorage::from_bytes(data).read_only();
    let opened = small_cache(false)
        .open_storage(
            storage,
            "fuzz.qcow2",
            Some(raw_backing(backing)),
            Some(MemStorage::from_bytes(data).read_only()),
        )
        .await;
    if let Ok(img) = opened {
        read_windows(&img, data, backing).await;
        let _ = img.close().await;
    }

    open_write_async(data).await;
}

/// The read-write part of [`open_read`] alone: opens a copy of
/// `data` for writing (with the same backing and data files), writes 4 KiB at a third of the
/// disk, flushes and closes. Errors are fine; panics, hangs and unbounded allocations are
/// findings.
pub fn open_write(data: &[u8]) {
    block_on(open_write_async(data));
}

async fn open_write_async(data: &[u8]) {
    let backing = open_read_backing();
    let storage = MemStorage::from_bytes(data);
    let opened = small_cache(true)
        .open_storage(
            storage,
            "fuzz.qcow2",
            Some(raw_backing(backing)),
            Some(MemStorage::from_bytes(data)),
        )
        .await;
    if let Ok(img) = opened {
        let size = img.size();
        let at = (size / 3) & !511;
        let len = (size - at).min(4096) as usize;
        let _ = img.write(&pattern(7, at, len), at).await;
        let _ = img.flush().await;
        let _ = img.close().await;
    }
}

/// The windows [`open_read`] reads: the start of the disk and a few sampled ones.
fn windows(size: u64, cluster_size: u64, extended: bool) -> Vec<(u64, u64)> {
    let entry = if extended { 16 } else { 8 };
    // One L2 table covers cluster_size / entry clusters.
    let l2_coverage = (cluster_size / entry).saturating_mul(cluster_size);
    let mut w = vec![(0, size.min(READ_WINDOW))];
    for mid in [size / 2, size, l2_coverage] {
        let start = (mid.saturating_sub(SAMPLE_WINDOW / 2) & !511).min(size);
        let len = (size - start).min(SAMPLE_WINDOW);
        if len > 0 && !w.contains(&(start, len)) {
            w.push((start, len));
        }
    }
    w
}

async fn read_windows(img: &Image<MemStorage>, data: &[u8], backing: &[u8]) {
    let size = img.size();
    for (offset, len) in windows(size, img.cluster_size(), img.extended_l2()) {
        let map = img.map(offset, len).await;
        if let Ok(extents) = &map {
            assert_extents_cover(extents, offset, len);
        }
        let mut buf = vec![0u8; len as usize];
        let mut all_read = true;
        for (i, chunk) in buf.chunks_mut(READ_CHUNK).enumerate() {
            let at = offset + (i * READ_CHUNK) as u64;
            all_read &= img.read(chunk, at).await.is_ok();
        }
        let (Ok(extents), true) = (map, all_read) else {
            continue;
        };
        for e in extents {
            let got = &buf[(e.start - offset) as usize..(e.start - offset + e.length) as usize];
            let (src, at) = match e.kind {
                ExtentKind::Data { host_offset } => (data, host_offset),
                ExtentKind::Zero { .. } => (&[][..], 0),
                ExtentKind::Unallocated { .. } => (backing, e.start),
                ExtentKind::Compressed { .. } => continue,
            };
            assert_reads(got, src, at, &e);
        }
    }
}

/// Asserts that `got` equals the bytes of `src` from `at`, reading zeros past its end.
fn assert_reads(got: &[u8], src: &[u8], at: u64, e: &Extent) {
    static ZEROS: [u8; 4096] = [0; 4096];
    let start = usize::try_from(at).unwrap_or(usize::MAX).min(src.len());
    let n = (src.len() - start).min(got.len());
    let (head, tail) = got.split_at(n);
    let same =
        head == &src[start..start + n] && tail.chunks(ZEROS.len()).all(|c| c == &ZEROS[..c.len()]);
    if !same {
        let want = |i: usize| src.get(start + i).copied().filter(|_| i < n).unwrap_or(0);
        let i = (0..got.len()).find(|&i| got[i] != want(i)).unwrap_or(0);
        panic!(
            "guest byte {:#x} of extent {e:?} reads {:#x}, not {:#x}",
            e.start + i as u64,
            got[i],
            want(i)
        );
    }
}

/// The image a sequence of [`ops`] runs on, chosen by the first two input bytes.
///
/// Byte 0: bit 0 extended L2 entries; bits 1..=2 the cluster size (4, 16, 32 or 64 KiB; 16 KiB
/// instead of 4 with extended L2); bits 3..=5 `refcount_order` (value modulo 7, i.e. 1 to 64
/// bits); bits 6..=7 the backing file (0 and 3 none, 1 raw, 2 qcow2), shorter than the disk.
/// Byte 1: bit 0 small caches (`small_cache`); bit 1 sparse allocation; bit 2 lazy
/// refcounts; bit 3 version 2 (ignored with extended L2; forces 16-bit refcounts and no lazy
/// refcounts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OpsShape {
    /// `log2` of the cluster size.
    pub cluster_bits: u32,
    /// Extended L2 entries.
    pub extended: bool,
    /// `log2` of the refcount width.
    pub refcount_order: u32,
    /// 0 none, 1 raw, 2 qcow2.
    pub backing: u8,
    /// Small caches.
    pub small_cache: bool,
    /// [`Allocation::Sparse`].
    pub sparse: bool,
    /// Lazy refcounts.
    pub lazy: bool,
    /// Version 2.
    pub v2: bool,
}

impl OpsShape {
    /// Decodes the two shape bytes.
    pub fn decode(b0: u8, b1: u8) -> Self {
        let extended = b0 & 1 != 0;
        let mut cluster_bits = [12, 14, 15, 16][usize::from(b0 >> 1 & 3)];
        if extended && cluster_bits < 14 {
            cluster_bits = 14;
        }
        let v2 = b1 & 8 != 0 && !extended;
        Self {
            cluster_bits,
            extended,
            refcount_order: if v2 { 4 } else { u32::from(b0 >> 3 & 7) % 7 },
            backing: match b0 >> 6 {
                3 => 0,
                b => b,
            },
            small_cache: b1 & 1 != 0,
            sparse: b1 & 2 != 0,
            lazy: b1 & 4 != 0 && !v2,
            v2,
        }
    }

    /// Cluster size in bytes.
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// Subcluster size in bytes (the cluster size without extended L2 entries).
    pub fn subcluster_size(&self) -> u64 {
        if self.extended {
            self.cluster_size() / 32
        } else {
            self.cluster_size()
        }
    }

    /// The virtual disk size: 2 MiB and three and a half clusters, so that 4 KiB clusters span
    /// two L2 tables and the last cluster is partial.
    pub fn size(&self) -> u64 {
        (2 << 20) + 3 * self.cluster_size() + self.cluster_size() / 2
    }

    /// The backing file size (two thirds of the disk, a multiple of 512), or 0 without one.
    pub fn backing_size(&self) -> u64 {
        if self.backing == 0 {
            0
        } else {
            self.size() * 2 / 3 / 512 * 512
        }
    }

    /// The sizes the model and the operation decoder need.
    pub fn geometry(&self) -> Geometry {
        Geometry::new(self.size(), self.cluster_size(), self.extended)
    }

    fn open_options(&self) -> OpenOptions {
        let mut o = if self.small_cache {
            small_cache(true)
        } else {
            OpenOptions::new().writable(true).clean_timer(false)
        };
        if self.sparse {
            o = o.allocation(Allocation::Sparse);
        }
        o
    }
}

/// Bytes per encoded operation of [`ops`].
pub const OP_BYTES: usize = 8;

/// Decodes one operation of [`ops`] from 8 bytes `[kind, m, s1, s0, l, n1, n0, w]` for a
/// disk of `shape`: [`GuestOp::decode`] of kind `kind`, start mode `m`, subcluster `s1s0`,
/// offset `w m` inside it, length mode `l` and length `n1n0`, with the 8 bytes as the seed of
/// a write. Never [`GuestOp::Close`].
pub fn decode_op(b: [u8; OP_BYTES], shape: &OpsShape) -> GuestOp {
    let code = OpCode {
        kind: b[0],
        start_mode: b[1],
        subcluster: u16::from_be_bytes([b[2], b[3]]),
        within: u16::from_be_bytes([b[7], b[1]]),
        len_mode: b[4],
        len: u16::from_be_bytes([b[5], b[6]]),
        seed: u64::from_le_bytes(b),
    };
    GuestOp::decode(&code, &shape.geometry())
}

/// The shape and operations `data` encodes for [`ops`] (at most [`MAX_OPS`]; a partial last
/// operation is ignored). `None` for inputs shorter than the two shape bytes.
pub fn decode_ops(data: &[u8]) -> Option<(OpsShape, Vec<GuestOp>)> {
    let [b0, b1, rest @ ..] = data else {
        return None;
    };
    let shape = OpsShape::decode(*b0, *b1);
    let ops = rest
        .chunks_exact(OP_BYTES)
        .take(MAX_OPS)
        .map(|c| decode_op(c.try_into().expect("8 bytes"), &shape))
        .collect();
    Some((shape, ops))
}

/// Runs a sequence of writes, write-zeroes, discards, reads, flushes and reopens decoded from
/// `data` (see [`decode_ops`]) on a fresh image made by [`qimg::tools::create::create`], in memory,
/// against the flat model ([`GuestModel`]), and panics on any difference.
///
/// Every operation must succeed and every read must equal the model: written bytes, zeros, or
/// for discarded subclusters (whole ones only; the last one counts as whole when the range
/// reaches the end of the disk) the backing file's bytes (zeros without one or past its end).
/// At the end the whole disk must equal the model, and after close the library
/// [`check`](qimg::tools::check::check) must report no corruption, no leak and no check error.
pub fn ops(data: &[u8]) {
    if let Some((shape, ops)) = decode_ops(data) {
        block_on(run_ops(shape, &ops));
    }
}

/// Per-process scratch directory for the files of [`ops`] and [`check`].
fn scratch_dir() -> PathBuf {
    std::env::temp_dir().join(format!("qimg-fuzz-{}", std::process::id()))
}

/// A file in the scratch directory, removed (with the directory when it is empty) on drop.
struct ScratchFile(PathBuf);

impl ScratchFile {
    fn new(data: &[u8]) -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = scratch_dir();
        let path = dir.join(format!("{}.qcow2", N.fetch_add(1, Ordering::Relaxed)));
        // Another thread dropping the last file may remove the directory in between: retry.
        for _ in 0..100 {
            std::fs::create_dir_all(&dir).expect("create the scratch directory");
            match std::fs::write(&path, data) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                r => {
                    r.expect("write a scratch file");
                    return Self(path);
                }
            }
        }
        panic!("{}: the directory keeps disappearing", path.display());
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        if let Some(dir) = self.0.parent() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// The bytes of a new image of `size` bytes made by [`qimg::tools::create::create`], cached per
/// options.
fn template(opts: &CreateOptions) -> Vec<u8> {
    static CACHE: OnceLock<Mutex<HashMap<String, Vec<u8>>>> = OnceLock::new();
    let key = format!("{opts:?}");
    let cache = CACHE.get_or_init(Mutex::default);
    if let Some(t) = cache.lock().expect("template cache").get(&key) {
        return t.clone();
    }
    let file = ScratchFile::new(&[]);
    qimg::tools::create::create(file.path(), opts, &mut |_, _| {})
        .expect("create a template image");
    let bytes = std::fs::read(file.path()).expect("read a template image");
    cache
        .lock()
        .expect("template cache")
        .insert(key, bytes.clone());
    bytes
}

fn create_options(shape: &OpsShape) -> CreateOptions {
    CreateOptions {
        size: Some(shape.size()),
        cluster_size: shape.cluster_size(),
        compat: if shape.v2 { Compat::V2 } else { Compat::V3 },
        extended_l2: shape.extended,
        refcount_bits: 1 << shape.refcount_order,
        lazy_refcounts: shape.lazy,
        ..CreateOptions::default()
    }
}

/// `pattern(0xBAC4, 0, size)`, the contents of every backing file of [`ops`], made once per
/// size.
fn backing_pattern(size: u64) -> Vec<u8> {
    static CACHE: OnceLock<Mutex<HashMap<u64, Vec<u8>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Mutex::default);
    cache
        .lock()
        .expect("backing pattern cache")
        .entry(size)
        .or_insert_with(|| pattern(0xBAC4, 0, size as usize))
        .clone()
}

/// A qcow2 backing image of `size` bytes (64 KiB clusters) holding `pattern(0xBAC4, ..)`, made
/// once per size through the engine.
async fn qcow2_backing_bytes(size: u64) -> Vec<u8> {
    static CACHE: OnceLock<Mutex<HashMap<u64, Vec<u8>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Mutex::default);
    if let Some(b) = cache.lock().expect("backing cache").get(&size) {
        return b.clone();
    }
    let opts = CreateOptions {
        size: Some(size),
        ..CreateOptions::default()
    };
    let storage = MemStorage::from_bytes(&template(&opts));
    let o = OpenOptions::new().writable(true).clean_timer(false);
    let img = o
        .open_storage(storage.clone(), "base.qcow2", None, None)
        .await
        .expect("open the new backing image");
    img.write(&backing_pattern(size), 0)
        .await
        .expect("fill the backing image");
    img.close().await.expect("close the backing image");
    let bytes = storage.snapshot();
    cache
        .lock()
        .expect("backing cache")
        .insert(size, bytes.clone());
    bytes
}

struct OpsWorld {
    shape: OpsShape,
    storage: MemStorage,
    backing: Vec<u8>,
    qcow2_backing: Option<Vec<u8>>,
    model: GuestModel,
}

impl OpsWorld {
    async fn open(&self) -> Image<MemStorage> {
        let backing = match (self.shape.backing, &self.qcow2_backing) {
            (0, _) => None,
            (2, Some(bytes)) => {
                let o = OpenOptions::new().clean_timer(false);
                let s = MemStorage::from_bytes(bytes).read_only();
                let img = o
                    .open_storage(s, "base.qcow2", None, None)
                    .await
                    .expect("open the qcow2 backing image");
                Some(Backing::Qcow2(img))
            }
            _ => Some(raw_backing(&self.backing)),
        };
        self.shape
            .open_options()
            .open_storage(self.storage.clone(), "img.qcow2", backing, None)
            .await
            .unwrap_or_else(|e| panic!("{:?}: open: {e}", self.shape))
    }
}

async fn run_ops(shape: OpsShape, ops: &[GuestOp]) {
    let what = format!("{shape:?}");
    let storage = MemStorage::from_bytes(&template(&create_options(&shape)));
    let bsize = shape.backing_size();
    let backing = backing_pattern(bsize);
    let qcow2_backing = if shape.backing == 2 {
        Some(qcow2_backing_bytes(bsize).await)
    } else {
        None
    };
    let model = GuestModel::new(shape.size(), backing.clone(), shape.subcluster_size());
    let mut w = OpsWorld {
        shape,
        storage,
        backing,
        qcow2_backing,
        model,
    };
    let mut img = w.open().await;
    for (i, op) in ops.iter().enumerate() {
        let fail = |e: qimg::Error| -> ! { panic!("{what}: op {i} {op:?}: {e}") };
        match *op {
            GuestOp::Write { at, len, seed } => {
                let data = pattern(seed, at, len as usize);
                img.write(&data, at).await.unwrap_or_else(|e| fail(e));
                w.model.write(at, &data);
            }
            GuestOp::Zero { at, len } => {
                img.write_zeroes(at, len).await.unwrap_or_else(|e| fail(e));
                w.model.write_zeroes(at, len);
            }
            GuestOp::Discard { at, len } => {
                img.discard(at, len).await.unwrap_or_else(|e| fail(e));
                w.model.discard(at, len);
            }
            GuestOp::Read { at, len } => {
                let mut buf = vec![0u8; len as usize];
                img.read(&mut buf, at).await.unwrap_or_else(|e| fail(e));
                let want = w.model.read(at, len);
                if let Some(j) = first_difference(&buf, want) {
                    panic!(
                        "{what}: op {i} {op:?}: guest byte {:#x} reads {:#x}, the model has {:#x}",
                        at + j as u64,
                        buf[j],
                        want[j]
                    );
                }
            }
            GuestOp::Flush => img.flush().await.unwrap_or_else(|e| fail(e)),
            // `decode_op` never makes a Close; treat one as a reopen all the same.
            GuestOp::Reopen | GuestOp::Close => {
                img.close().await.unwrap_or_else(|e| fail(e));
                img = w.open().await;
            }
        }
    }
    let mut all = vec![0u8; w.model.data.len()];
    img.read(&mut all, 0)
        .await
        .unwrap_or_else(|e| panic!("{what}: final read: {e}"));
    if let Some(j) = first_difference(&all, &w.model.data) {
        panic!(
            "{what}: after {} ops guest byte {j:#x} reads {:#x}, the model has {:#x}",
            ops.len(),
            all[j],
            w.model.data[j]
        );
    }
    img.close()
        .await
        .unwrap_or_else(|e| panic!("{what}: close: {e}"));
    drop(img);
    let file = ScratchFile::new(&w.storage.snapshot());
    let mut messages = Vec::new();
    let report = qimg::tools::check::check(file.path(), &CheckOptions::default(), &mut |ev| {
        if let CheckEvent::Message(m) = ev {
            messages.push(m.to_string());
        }
    })
    .unwrap_or_else(|e| panic!("{what}: check: {e}"));
    assert!(
        report.failure.is_none()
            && report.corruptions == 0
            && report.leaks == 0
            && report.check_errors == 0,
        "{what}: after {} ops check reports {report:?}: {messages:?}",
        ops.len()
    );
}

/// Runs the library check of `data` written to a file, then `check -r all` on it and a
/// read-only check of the repaired file, and returns the three results. Besides never
/// panicking:
///
/// * when the image can be checked at all (and the repair completes), it can still be checked
///   after the repair;
/// * when all three checks complete (no failure, no check error), the check after the repair
///   agrees with the repair's own final pass (same corruptions and leaks), and reports no
///   more corruptions than the first check: a repair never makes the image worse.
pub fn check(data: &[u8]) -> [qimg::Result<CheckReport>; 3] {
    let file = ScratchFile::new(data);
    let path = file.path();
    let none = CheckOptions::default();
    let all = CheckOptions {
        repair: Some(Repair::All),
        ..Default::default()
    };
    let quiet = &mut |_: CheckEvent<'_>| {};
    let before = qimg::tools::check::check(path, &none, quiet);
    let repaired = qimg::tools::check::check(path, &all, quiet);
    let after = qimg::tools::check::check(path, &none, quiet);
    fn complete(r: &qimg::Result<CheckReport>) -> Option<&CheckReport> {
        r.as_ref()
            .ok()
            .filter(|r| r.failure.is_none() && r.check_errors == 0)
    }
    if let (Ok(b), Ok(r)) = (&before, &repaired) {
        if b.failure.is_none() && r.failure.is_none() {
            assert!(
                after.is_ok(),
                "the repaired image cannot be checked any more: {after:?}\n\
                 before: {b:?}\nrepair: {r:?}"
            );
        }
    }
    if let (Some(b), Some(r), Some(a)) = (complete(&before), complete(&repaired), complete(&after))
    {
        assert_eq!(
            (a.corruptions, a.leaks),
            (r.corruptions, r.leaks),
            "a check after the repair disagrees with the repair's final pass\n\
             before: {b:?}\nrepair: {r:?}\nafter: {a:?}"
        );
        assert!(
            a.corruptions <= b.corruptions,
            "the repair made the image worse\nbefore: {b:?}\nrepair: {r:?}\nafter: {a:?}"
        );
    }
    [before, repaired, after]
}

/// The folder `fuzz/<kind>/<target>/` of the workspace (`kind` is `corpus` for the seed
/// corpus made by `fuzz/make-corpus.sh`, `regressions` for saved findings).
pub fn inputs_dir(kind: &str, target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz")
        .join(kind)
        .join(target)
}

/// The files of `fuzz/<kind>/<target>/` as (name, bytes), sorted by name; none when the
/// folder is missing (a target without saved findings has none).
pub fn inputs(kind: &str, target: &str) -> Vec<(String, Vec<u8>)> {
    let d = inputs_dir(kind, target);
    let Ok(entries) = std::fs::read_dir(&d) else {
        return Vec::new();
    };
    let mut v: Vec<(String, Vec<u8>)> = entries
        .map(|e| e.expect("read a fuzz input folder").path())
        .filter(|p| p.is_file())
        .map(|p| {
            let data = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p.file_name().unwrap().to_string_lossy().into_owned(), data)
        })
        .collect();
    v.sort();
    v
}

/// The committed seed corpus of `target` (`fuzz/corpus/<target>/`), which must not be empty.
pub fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let v = inputs("corpus", target);
    assert!(
        !v.is_empty(),
        "{}: no seeds (run fuzz/make-corpus.sh)",
        inputs_dir("corpus", target).display()
    );
    v
}

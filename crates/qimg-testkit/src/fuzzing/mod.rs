//! Entry points of the engine-level cargo-fuzz targets in `fuzz/` (`open_read`, `ops`,
//! `check`; the format-level ones, `header`, `l2_slice` and `refcount_block`, are in
//! [`format`](mod@format)), also run by `cargo test` (`tests/engine/fuzz_corpus.rs`) on the committed seed corpus
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

pub mod format;
mod guest_ops;

use guest_ops::*;
pub use guest_ops::{MAX_OPS, OP_BYTES, OpsShape, decode_op, decode_ops, ops};

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use qimg::io::MemStorage;
use qimg::tools::check::{CheckEvent, CheckOptions, CheckReport, Repair};
use qimg::tools::create::CreateOptions;
use qimg::{Backing, CacheOptions, Extent, ExtentKind, Image, OpenOptions};

use crate::pattern::word_pattern as pattern;

/// Bytes read and mapped from the start of the virtual disk by [`open_read`].
pub const READ_WINDOW: u64 = 1 << 20;

/// Bytes read and mapped around each sampled offset by [`open_read`].
pub const SAMPLE_WINDOW: u64 = 64 << 10;

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

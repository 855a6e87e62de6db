//! How reads fetch metadata and data. Parallel L2 slice loads: a read's cache miss reads its
//! slice without holding the metadata lock, so that misses on different slices proceed at once, and a second miss on a slice
//! being loaded waits for that load instead of reading it again. Counted through a storage
//! that watches the slice reads, never timed. Then many tasks reading and writing through a
//! two-slice cache (constant eviction, loads superseded by writers' loads) must leave the
//! image clean and equal to a model. And the data of clusters that follow one another in the
//! file is read in one request.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use qimg::{CacheOptions, OpenOptions};
use qimg_io::{AllocateOutcome, DiscardOutcome, MemStorage, Storage, ZeroOutcome};
use qimg_testkit::pattern;

const MIB: u64 = 1 << 20;
/// Bytes of L2 entries one 4 KiB slice holds (standard entries, 64 KiB clusters): 32 MiB of
/// guest space per slice.
const SLICE: usize = 4096;
const PER_SLICE: u64 = 32 * MIB;

/// A storage that counts the reads of exactly one slice's size while armed: how many are under
/// way at once (the peak), and in all. Each such read waits until `want` of them were under way
/// (or `hold` passes), so that loads that can overlap do.
#[derive(Clone)]
struct Watch {
    inner: MemStorage,
    state: Arc<WatchState>,
}

struct WatchState {
    armed: std::sync::atomic::AtomicBool,
    want: AtomicUsize,
    hold: std::sync::Mutex<Duration>,
    now: AtomicUsize,
    peak: AtomicUsize,
    total: AtomicUsize,
}

impl Watch {
    fn new(inner: MemStorage) -> Self {
        Self {
            inner,
            state: Arc::new(WatchState {
                armed: false.into(),
                want: AtomicUsize::new(1),
                hold: std::sync::Mutex::new(Duration::ZERO),
                now: AtomicUsize::new(0),
                peak: AtomicUsize::new(0),
                total: AtomicUsize::new(0),
            }),
        }
    }

    /// Starts counting: each slice read waits for `want` under way, at most `hold`.
    fn arm(&self, want: usize, hold: Duration) {
        let s = &self.state;
        s.want.store(want, Ordering::SeqCst);
        *s.hold.lock().unwrap() = hold;
        s.peak.store(0, Ordering::SeqCst);
        s.total.store(0, Ordering::SeqCst);
        s.armed.store(true, Ordering::SeqCst);
    }

    fn peak(&self) -> usize {
        self.state.peak.load(Ordering::SeqCst)
    }

    fn total(&self) -> usize {
        self.state.total.load(Ordering::SeqCst)
    }
}

impl Storage for Watch {
    async fn read_at_most(&self, buf: &mut [u8], offset: u64) -> qimg_io::Result<usize> {
        let s = &self.state;
        if s.armed.load(Ordering::SeqCst) && buf.len() == SLICE {
            s.total.fetch_add(1, Ordering::SeqCst);
            let now = s.now.fetch_add(1, Ordering::SeqCst) + 1;
            s.peak.fetch_max(now, Ordering::SeqCst);
            let hold = *s.hold.lock().unwrap();
            let want = s.want.load(Ordering::SeqCst);
            let _ = tokio::time::timeout(hold, async {
                while s.peak.load(Ordering::SeqCst) < want {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
            .await;
            let r = self.inner.read_at_most(buf, offset).await;
            s.now.fetch_sub(1, Ordering::SeqCst);
            return r;
        }
        self.inner.read_at_most(buf, offset).await
    }
    async fn write_at(&self, buf: &[u8], offset: u64) -> qimg_io::Result<()> {
        self.inner.write_at(buf, offset).await
    }
    async fn write_vectored_at(
        &self,
        bufs: &[std::io::IoSlice<'_>],
        offset: u64,
    ) -> qimg_io::Result<()> {
        self.inner.write_vectored_at(bufs, offset).await
    }
    async fn write_zeroes(&self, offset: u64, len: u64) -> qimg_io::Result<ZeroOutcome> {
        self.inner.write_zeroes(offset, len).await
    }
    async fn discard(&self, offset: u64, len: u64) -> qimg_io::Result<DiscardOutcome> {
        self.inner.discard(offset, len).await
    }
    async fn allocate(&self, offset: u64, len: u64) -> qimg_io::Result<AllocateOutcome> {
        self.inner.allocate(offset, len).await
    }
    async fn flush(&self) -> qimg_io::Result<()> {
        self.inner.flush().await
    }
    async fn len(&self) -> qimg_io::Result<u64> {
        self.inner.len().await
    }
    async fn set_len(&self, len: u64) -> qimg_io::Result<()> {
        self.inner.set_len(len).await
    }
}

/// A 256 MiB image (64 KiB clusters, standard L2 entries: one L2 table, eight 4 KiB slices)
/// with 512 bytes written at the start of each slice's range, opened on a [`Watch`] with 4 KiB
/// L2 slices and room for all of them.
async fn image_with_eight_slices() -> (qimg::Image<Watch>, Watch) {
    let mem = {
        let dir = Scratch::new("slice-loads");
        let path = dir.path("a.qcow2");
        let opts = qimg::tools::create::CreateOptions {
            size: Some(8 * PER_SLICE),
            ..Default::default()
        };
        qimg::tools::create::create(&path, &opts, &mut |_, _| {}).unwrap();
        let img = OpenOptions::new().writable(true).open(&path).await.unwrap();
        for i in 0..8u64 {
            img.write(&pattern(i, 0, 512), i * PER_SLICE).await.unwrap();
        }
        img.close().await.unwrap();
        MemStorage::from_bytes(&std::fs::read(&path).unwrap())
    };
    let watch = Watch::new(mem);
    let img = OpenOptions::new()
        .writable(true)
        .cache(CacheOptions {
            l2_cache_size: Some(8 * SLICE as u64),
            l2_cache_entry_size: Some(SLICE as u64),
            ..CacheOptions::default()
        })
        .open_storage(watch.clone(), "a.qcow2", None, None)
        .await
        .unwrap();
    (img, watch)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misses_on_different_slices_load_in_parallel() {
    let (img, watch) = image_with_eight_slices().await;
    // Each slice read waits until all four are under way (or 10 s, which only serialised
    // loads would need: then the peak stays at 1 and the test fails).
    watch.arm(4, Duration::from_secs(10));
    let mut tasks = Vec::new();
    for i in 0..4u64 {
        let img = img.clone();
        tasks.push(tokio::spawn(async move {
            let mut buf = vec![0u8; 512];
            img.read(&mut buf, i * PER_SLICE).await.unwrap();
            assert_eq!(buf, pattern(i, 0, 512), "slice {i}");
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(watch.total(), 4, "one load per slice");
    assert_eq!(
        watch.peak(),
        4,
        "the four slice loads were not under way at once"
    );
    let stats = img.stats().await;
    assert_eq!(stats.l2_cache.entries, 4, "{stats:?}");
    img.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misses_on_one_slice_wait_for_its_load() {
    let (img, watch) = image_with_eight_slices().await;
    // The load is held for a moment so that the other requests find it under way.
    watch.arm(usize::MAX, Duration::from_millis(300));
    let mut tasks = Vec::new();
    for i in 0..8u64 {
        let img = img.clone();
        tasks.push(tokio::spawn(async move {
            let mut buf = vec![0u8; 512];
            // Eight reads in the range of slice 5 (its first 512 bytes were written).
            img.read(&mut buf, 5 * PER_SLICE + i * 4 * MIB)
                .await
                .unwrap();
            if i == 0 {
                assert_eq!(buf, pattern(5, 0, 512));
            } else {
                assert!(buf.iter().all(|&b| b == 0));
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(watch.total(), 1, "the slice was read more than once");
    img.close().await.unwrap();
}

/// Sixteen tasks, each owning 1 MiB spread over all eight slices' ranges, write and read
/// through a cache of two 4 KiB slices: every read misses or races a writer's load of the same
/// slice. The image must check clean and equal the model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_and_writes_through_a_tiny_cache_match_the_model() {
    qimg_testkit::require_qemu!();
    for extended in [false, true] {
        let dir = Scratch::new("slice-loads-model");
        let size = 8 * PER_SLICE;
        let opts = if extended {
            "extended_l2=on,cluster_size=64k"
        } else {
            "cluster_size=64k"
        };
        qemu_create(&dir.0, "m.qcow2", opts, size, None);
        let img = OpenOptions::new()
            .writable(true)
            .cache(CacheOptions {
                l2_cache_size: Some(2 * SLICE as u64),
                l2_cache_entry_size: Some(SLICE as u64),
                ..CacheOptions::default()
            })
            .open(dir.path("m.qcow2"))
            .await
            .unwrap();
        // Task t owns 64 KiB at the start of every 16 MiB step: (step * 16 MiB + t * 64 KiB).
        let piece = 64 * 1024u64;
        let steps = size / (16 * MIB);
        let mut tasks = Vec::new();
        for t in 0..16u64 {
            let img = img.clone();
            tasks.push(tokio::spawn(async move {
                let mut model = vec![0u8; (steps * piece) as usize];
                let mut seed = t * 2_654_435_761 + 1;
                let mut next = move || {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed
                };
                for i in 0..80u64 {
                    let step = next() % steps;
                    let within = next() % (piece - 4096);
                    let len = 1 + next() % 4096;
                    let at = step * 16 * MIB + t * piece + within;
                    let m = (step * piece + within) as usize;
                    if next() % 2 == 0 {
                        let data = pattern(t * 1000 + i, at, len as usize);
                        img.write(&data, at).await.unwrap();
                        model[m..m + len as usize].copy_from_slice(&data);
                    } else {
                        let mut buf = vec![0u8; len as usize];
                        img.read(&mut buf, at).await.unwrap();
                        assert!(
                            buf == model[m..m + len as usize],
                            "task {t}: read of {len} at {at} differs from the model"
                        );
                    }
                }
                model
            }));
        }
        let mut whole = vec![0u8; size as usize];
        for (t, task) in tasks.into_iter().enumerate() {
            let model = task.await.unwrap();
            for step in 0..steps {
                let from = (step * 16 * MIB + t as u64 * piece) as usize;
                let m = (step * piece) as usize;
                whole[from..from + piece as usize].copy_from_slice(&model[m..m + piece as usize]);
            }
        }
        img.close().await.unwrap();
        assert_clean(
            &dir.0,
            "m.qcow2",
            "after reads and writes through a tiny cache",
        );
        assert_same_as_model(
            &dir.0,
            "m.qcow2",
            &whole,
            "reads and writes through a tiny cache",
        );
    }
}

/// A read issues one data request per run of clusters that follow one another in the file,
/// as `map` reports them (sixteen clusters written in one request; a zeroed cluster between
/// data; four clusters written last to first, so reversed in the file).
#[tokio::test]
async fn consecutive_clusters_are_read_in_one_request() {
    let dir = Scratch::new("read-merge");
    let path = dir.path("a.qcow2");
    let opts = qimg::tools::create::CreateOptions {
        size: Some(8 * MIB),
        ..Default::default()
    };
    qimg::tools::create::create(&path, &opts, &mut |_, _| {}).unwrap();
    let img = OpenOptions::new().writable(true).open(&path).await.unwrap();
    let cs = 65536u64;
    let data = pattern(1, 0, MIB as usize);
    img.write(&data, 0).await.unwrap();
    img.write(&data[..(4 * cs) as usize], 3 * MIB)
        .await
        .unwrap();
    img.write_zeroes(3 * MIB + cs, cs).await.unwrap();
    for c in (0..4u64).rev() {
        let at = 2 * MIB + c * cs;
        img.write(&data[(c * cs) as usize..((c + 1) * cs) as usize], at)
            .await
            .unwrap();
    }
    img.close().await.unwrap();
    let storage = qimg_io::FaultyStorage::in_memory(&std::fs::read(&path).unwrap());
    let faults = storage.controller();
    let img = OpenOptions::new()
        .open_storage(storage, "a.qcow2", None, None)
        .await
        .unwrap();
    // Warm the L2 cache: the counts below are data reads only.
    let mut buf = vec![0u8; 512];
    img.read(&mut buf, 0).await.unwrap();
    for (at, len, want_runs) in [(0, MIB, 2), (3 * MIB, 4 * cs, 2), (2 * MIB, 4 * cs, 4)] {
        let runs = img
            .map(at, len)
            .await
            .unwrap()
            .iter()
            .filter(|e| matches!(e.kind, qimg::ExtentKind::Data { .. }))
            .count();
        let before = faults.counts().reads;
        let mut buf = vec![0u8; len as usize];
        img.read(&mut buf, at).await.unwrap();
        let reads = faults.counts().reads - before;
        assert_eq!(
            reads as usize, runs,
            "read of {len} at {at}: one request per run"
        );
        // The layouts this test means to cover: sixteen clusters in at most two runs (the
        // L2 table may be allocated after the first data cluster), split by zeros, reversed.
        assert!(
            runs <= want_runs,
            "{runs} runs at {at}: the allocator changed?"
        );
        match at {
            0 => assert_eq!(buf, data),
            a if a == 3 * MIB => {
                assert_eq!(buf[..cs as usize], data[..cs as usize]);
                assert!(buf[cs as usize..2 * cs as usize].iter().all(|&b| b == 0));
                assert_eq!(
                    buf[2 * cs as usize..],
                    data[2 * cs as usize..4 * cs as usize]
                );
            }
            _ => assert_eq!(buf, data[..(4 * cs) as usize]),
        }
    }
    img.close().await.unwrap();
}

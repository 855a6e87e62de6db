//! What the engine itself writes and reads for its metadata, counted at the storage: a
//! write-back writes only the blocks of a table or refcount block that changed (a 2 MiB table
//! with one new entry costs 4 KiB, not 2 MiB), allocations racing past the end of the file
//! reserve the space once rather than once each, a table just created is zeroed as a range
//! and its slice taken from memory instead of being read back, and refcounts are read in
//! slices of 4 KiB, not whole 2 MiB blocks. Each image is then checked by `qemu-img check`
//! and compared with a model by `qemu-img compare`.

use crate::common;

use std::io::IoSlice;
use std::sync::{Arc, Mutex};

use common::faults::*;
use common::have_qemu;
use qimg::Image;
use qimg::io::{
    AllocateOutcome, DiscardOutcome, MemStorage, Result as IoResult, Storage, ZeroOutcome,
};
use qimg_testkit::pattern;
use qimg_testkit::qemu::{Scratch, assert_clean, assert_same_as_model};

/// 2 MiB clusters with extended L2 entries: tables and refcount blocks of 2 MiB each.
fn large_clusters() -> Shape {
    Shape::new("2m-extended", 2 * MIB, true, 256 * MIB)
}

/// Opens `image` over a [`Recorder`] logging into `log`, wrapped by `wrap`.
async fn open_logged<S: Storage + 'static>(
    shape: &Shape,
    image: &[u8],
    log: &Trace,
    wrap: impl FnOnce(Recorder) -> S,
) -> (Image<S>, MemStorage) {
    let mem = MemStorage::from_bytes(image);
    let storage = wrap(Recorder::new(mem.clone(), Some(log.clone())));
    let img = shape
        .open_options()
        .open_storage(storage, "img.qcow2", None, None)
        .await
        .expect("open");
    (img, mem)
}

/// Writes the bytes `mem` holds to a file and has qemu-img check it and compare its guest
/// data with `model`.
fn assert_qemu_sees(mem: &MemStorage, model: &[u8], what: &str) {
    if !have_qemu(what) {
        return;
    }
    let bytes = mem.snapshot();
    let dir = Scratch::new("metadata-io");
    std::fs::write(dir.path("img.qcow2"), &bytes).unwrap();
    assert_clean(&dir.0, "img.qcow2", what);
    assert_same_as_model(&dir.0, "img.qcow2", model, what);
}

/// The guest data of a disk of `shape` written only with `data` at `at`.
fn written_once(shape: &Shape, at: u64, data: &[u8]) -> Vec<u8> {
    let mut model = vec![0u8; shape.size as usize];
    model[at as usize..at as usize + data.len()].copy_from_slice(data);
    model
}

/// The storage operations [`ops`] picks out.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Read,
    Write,
    WriteZeroes,
}

/// `(offset, length)` of each operation of `kind` in `log`.
fn ops(log: &Trace, kind: Kind) -> Vec<(u64, u64)> {
    log.lock()
        .unwrap()
        .iter()
        .filter_map(|op| match (op, kind) {
            (TraceOp::Read { offset, len }, Kind::Read) => Some((*offset, *len)),
            (TraceOp::Write { offset, data }, Kind::Write) => Some((*offset, data.len() as u64)),
            (TraceOp::WriteZeroes { offset, len }, Kind::WriteZeroes) => Some((*offset, *len)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_flush_writes_back_only_the_blocks_of_a_large_table_that_changed() {
    runtime().block_on(async {
        let shape = large_clusters();
        let images = make_images(&shape).await;
        let log = Trace::default();
        let (img, mem) = open_logged(&shape, &images.image, &log, |r| r).await;
        let mut model = vec![0u8; shape.size as usize];
        let mut write = async |k: u64| {
            let at = k * shape.cluster_size + 8 * KIB;
            let data = pattern(0x5EED + k, at, 4096);
            img.write(&data, at).await.expect("write");
            model[at as usize..at as usize + data.len()].copy_from_slice(&data);
        };
        // The first writes create the table (zeroed whole) and load the refcount block.
        for k in 0..4 {
            write(k).await;
        }
        img.flush().await.expect("flush");
        log.lock().unwrap().clear();
        // Four more new clusters under the same table and refcount block.
        for k in 4..8 {
            write(k).await;
        }
        img.flush().await.expect("flush");
        let written = ops(&log, Kind::Write);
        // Four 4 KiB data writes into fresh clusters (nothing to copy: no backing file),
        // then the 4 KiB block of the table holding the four new entries and the 4 KiB block
        // of the refcount block holding their refcounts: not the 2 MiB table and block.
        assert_eq!(
            written.len(),
            6,
            "writes after the second round: {written:x?}"
        );
        for &(offset, len) in &written {
            assert_eq!(
                len, 4096,
                "a write of {len} bytes at {offset:#x}: {written:x?}"
            );
        }
        let total: u64 = written.iter().map(|w| w.1).sum();
        assert_eq!(total, 6 * 4096);
        img.close().await.expect("close");
        assert_qemu_sees(&mem, &model, "partial write-back");
    });
}

/// A [`Recorder`] whose `allocate` lets other tasks run before it reserves, as a real
/// `fallocate` on a ring does: the window in which concurrent allocations find the space
/// past the end of the file not yet reserved.
#[derive(Debug, Clone)]
struct SlowReserve(Recorder);

impl Storage for SlowReserve {
    async fn read_at_most(&self, buf: &mut [u8], offset: u64) -> IoResult<usize> {
        self.0.read_at_most(buf, offset).await
    }

    async fn write_at(&self, buf: &[u8], offset: u64) -> IoResult<()> {
        self.0.write_at(buf, offset).await
    }

    async fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> IoResult<()> {
        self.0.write_vectored_at(bufs, offset).await
    }

    async fn write_zeroes(&self, offset: u64, len: u64) -> IoResult<ZeroOutcome> {
        self.0.write_zeroes(offset, len).await
    }

    async fn discard(&self, offset: u64, len: u64) -> IoResult<DiscardOutcome> {
        self.0.discard(offset, len).await
    }

    async fn allocate(&self, offset: u64, len: u64) -> IoResult<AllocateOutcome> {
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
        self.0.allocate(offset, len).await
    }

    async fn flush(&self) -> IoResult<()> {
        self.0.flush().await
    }

    async fn len(&self) -> IoResult<u64> {
        self.0.len().await
    }

    async fn set_len(&self, len: u64) -> IoResult<()> {
        self.0.set_len(len).await
    }
}

#[test]
fn allocating_writes_racing_past_the_end_of_the_file_reserve_it_once() {
    runtime().block_on(async {
        let shape = large_clusters();
        let images = make_images(&shape).await;
        let file_end = images.image.len() as u64;
        let log = Trace::default();
        let (img, mem) = open_logged(&shape, &images.image, &log, SlowReserve).await;
        let model = Arc::new(Mutex::new(vec![0u8; shape.size as usize]));
        let mut tasks = tokio::task::JoinSet::new();
        for k in 0..32u64 {
            let (img, model) = (img.clone(), model.clone());
            tasks.spawn(async move {
                let at = k * 2 * MIB + 64 * KIB;
                let data = pattern(0xA110C + k, at, 4096);
                img.write(&data, at).await.expect("write");
                model.lock().unwrap()[at as usize..at as usize + 4096].copy_from_slice(&data);
            });
        }
        while let Some(done) = tasks.join_next().await {
            done.expect("task");
        }
        let reservations: Vec<(u64, u64)> = log
            .lock()
            .unwrap()
            .iter()
            .filter_map(|op| match op {
                TraceOp::Allocate { offset, len } if *offset >= file_end => Some((*offset, *len)),
                _ => None,
            })
            .collect();
        // One step of 64 clusters covers the 32 data clusters and the table; each request
        // reserving its own step made 32 `fallocate`s of 128 MiB.
        assert_eq!(
            reservations.len(),
            1,
            "reservations past the end of the file: {reservations:x?}"
        );
        assert_eq!(reservations[0].1, 64 * shape.cluster_size);
        for k in 0..32u64 {
            let at = k * 2 * MIB + 64 * KIB;
            let mut back = vec![0u8; 4096];
            img.read(&mut back, at).await.expect("read");
            assert_eq!(back, pattern(0xA110C + k, at, 4096), "cluster {k}");
        }
        img.close().await.expect("close");
        let model = model.lock().unwrap().clone();
        assert_qemu_sees(&mem, &model, "one reservation");
    });
}

#[test]
fn the_slice_of_a_table_just_created_is_not_read_back() {
    runtime().block_on(async {
        let shape = large_clusters();
        let images = make_images(&shape).await;
        let log = Trace::default();
        let (img, mem) = open_logged(&shape, &images.image, &log, |r| r).await;
        let at = 3 * shape.cluster_size + 4 * KIB;
        let data = pattern(0x7AB1E, at, 4096);
        img.write(&data, at).await.expect("write");
        let stats = img.stats().await;
        // Its slice went into the cache as the zeros just written: no miss, no read.
        assert_eq!(stats.l2_cache.misses, 0, "{:?}", stats.l2_cache);
        assert_eq!(stats.l2_cache.entries, 1, "{:?}", stats.l2_cache);
        let mut back = vec![0u8; 8192];
        img.read(&mut back, at - 4 * KIB).await.expect("read");
        assert_eq!(&back[..4096], &[0u8; 4096][..]);
        assert_eq!(&back[4096..], &data[..]);
        // The table was zeroed as a range (`fallocate(FALLOC_FL_ZERO_RANGE)` on a file), not
        // written as 2 MiB of zero bytes.
        let (written, zeroed) = (ops(&log, Kind::Write), ops(&log, Kind::WriteZeroes));
        assert_eq!(zeroed.len(), 1, "{zeroed:x?}");
        assert_eq!(zeroed[0].1, shape.cluster_size);
        let largest = written.iter().map(|w| w.1).max();
        assert_eq!(largest, Some(4096), "{written:x?}");
        img.close().await.expect("close");
        assert_qemu_sees(&mem, &written_once(&shape, at, &data), "fresh table");
    });
}

#[test]
fn the_first_allocation_reads_one_refcount_slice_not_the_block() {
    runtime().block_on(async {
        let shape = large_clusters();
        let images = make_images(&shape).await;
        let log = Trace::default();
        let (img, mem) = open_logged(&shape, &images.image, &log, |r| r).await;
        log.lock().unwrap().clear();
        let at = 5 * shape.cluster_size + 12 * KIB;
        let data = pattern(0x5_11CE, at, 4096);
        img.write(&data, at).await.expect("write");
        // The refcount of the new cluster comes from the 4 KiB slice holding it: not the
        // 2 MiB refcount block (QEMU reads the whole block).
        let read = ops(&log, Kind::Read);
        assert!(!read.is_empty(), "the refcount block was never read");
        assert!(read.iter().all(|&(_, len)| len <= 4096), "{read:x?}");
        let stats = img.stats().await;
        assert_eq!(stats.refcount_cache.misses, 1, "{:?}", stats.refcount_cache);
        img.close().await.expect("close");
        assert_qemu_sees(&mem, &written_once(&shape, at, &data), "one refcount slice");
    });
}

/// Refcount blocks of several slices, a cache of few of them: 8 KiB clusters with 64-bit
/// refcounts make each block two 4 KiB slices of 512 refcounts (4 MiB of host clusters
/// each); a 40 MiB image spans eleven slices of six blocks, the cache holds eight. Writes,
/// frees and rewrites go through slices evicted and loaded again; qemu-img then finds every
/// refcount right.
#[test]
fn refcounts_in_many_slices_stay_right() {
    runtime().block_on(async {
        let mut shape = Shape::new("8k-rb64-refcount-slices", 8 * KIB, false, 40 * MIB);
        shape.refcount_bits = 64;
        shape.small_cache = true;
        let images = make_images(&shape).await;
        let (img, mem) = open_logged(&shape, &images.image, &Trace::default(), |r| r).await;
        let size = shape.size;
        let mut model = vec![0u8; size as usize];
        let chunk = 256 * KIB;
        // Fill everything (over 5,000 host clusters), in an order that jumps about.
        let n = size / chunk;
        for k in 0..n {
            let at = (k * 7 % n) * chunk;
            let data = pattern(0xF111 + k, at, chunk as usize);
            img.write(&data, at).await.expect("write");
            model[at as usize..(at + chunk) as usize].copy_from_slice(&data);
        }
        // Free every third chunk (refcounts back to 0 in many slices), then write half of
        // those again (clusters reused from the lowest free one up).
        for k in (0..n).step_by(3) {
            let at = k * chunk;
            img.discard(at, chunk).await.expect("discard");
            model[at as usize..(at + chunk) as usize].fill(0);
        }
        img.flush().await.expect("flush");
        for k in (0..n).step_by(6) {
            let at = k * chunk + 8 * KIB;
            let data = pattern(0xA6A1 + k, at, 64 * KIB as usize);
            img.write(&data, at).await.expect("rewrite");
            model[at as usize..at as usize + data.len()].copy_from_slice(&data);
        }
        let stats = img.stats().await;
        assert!(
            stats.refcount_cache.evictions > 0,
            "the refcount cache never evicted: {:?}",
            stats.refcount_cache
        );
        img.close().await.expect("close");
        let mut back = vec![0u8; size as usize];
        let (img, _) = open_logged(&shape, &mem.snapshot(), &Trace::default(), |r| r).await;
        img.read(&mut back, 0).await.expect("read");
        assert!(back == model, "guest data differs from the model");
        img.close().await.expect("close");
        assert_qemu_sees(&mem, &model, "refcount slices");
    });
}

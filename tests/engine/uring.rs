//! The engine on io_uring: `UringStorage` buffered, and `BounceStorage` over `UringStorage` and
//! `FileStorage` with O_DIRECT (every metadata and guest request of any size and offset goes
//! through the bounce layer), opened through `Image::open_with` with an opener closure so that
//! backing files use the same backend.
//!
//! * A seeded random sequence of writes, write-zeroes, discards, reads, flushes and reopens
//!   against a flat model, on extended-L2 and standard images over a backing file; then
//!   `qemu-img check` must be clean and `qemu-img compare` must find the image equal to the
//!   model.
//! * Multi-queue stress: 4 queues (image handles) of 8 tasks each, on a ring of 64 entries,
//!   writing, zeroing, discarding and flushing private ranges and one shared range; private
//!   ranges must read back exactly, the shared range must equal one task's last operation as a
//!   whole, and `qemu-img check` must be clean.
//!
//! Where io_uring is unavailable or the scratch file system refuses O_DIRECT, the affected
//! backend prints "skipped: ..." and the test goes on with the others.
#![cfg(target_os = "linux")]

use crate::common;

use std::path::Path;
use std::sync::Arc;

use common::*;
use qimg::{OpenOptions, Opener};
use qimg_io::{
    BounceStorage, FileOptions, FileStorage, Storage, StorageError, UringOptions, UringStorage,
};
use qimg_testkit::pattern::{first_difference, pattern};
use qimg_testkit::{GuestModel, Rng};

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
/// The ring size (queue depth) of every UringStorage here.
const DEPTH: u32 = 64;

fn uring_buffered(path: &Path, writable: bool) -> Result<UringStorage, StorageError> {
    UringOptions::new()
        .read_write(writable)
        .entries(DEPTH)
        .open(path)
}

fn uring_direct(path: &Path, writable: bool) -> Result<BounceStorage<UringStorage>, StorageError> {
    let u = UringOptions::new()
        .read_write(writable)
        .direct(true)
        .entries(DEPTH)
        .open(path)?;
    Ok(BounceStorage::new(u))
}

fn file_direct(path: &Path, writable: bool) -> Result<BounceStorage<FileStorage>, StorageError> {
    let f = FileOptions::new()
        .read_write(writable)
        .direct(true)
        .open(path)?;
    Ok(BounceStorage::new(f))
}

/// Whether `opener` works on a file in `dir` (printing why not when it does not).
fn usable<S: Storage>(dir: &Scratch, name: &str, opener: &dyn Opener<S>) -> bool {
    let probe = dir.path(&format!("probe-{name}"));
    std::fs::write(&probe, vec![0u8; 4096]).unwrap();
    let r = opener.open(&probe, true);
    let _ = std::fs::remove_file(&probe);
    match r {
        Ok(_) => true,
        Err(e @ StorageError::UringUnavailable { .. }) => {
            let reason = std::error::Error::source(&e).map_or(e.to_string(), |s| s.to_string());
            println!("skipped {name}: io_uring unavailable: {reason}");
            false
        }
        Err(e) => {
            let reason = std::error::Error::source(&e).map_or(e.to_string(), |s| s.to_string());
            println!("skipped {name}: O_DIRECT unsupported: {e}: {reason}");
            false
        }
    }
}

struct Shape {
    opts: &'static str,
    cluster: u64,
    extended: bool,
    qcow2_backing: bool,
}

impl Shape {
    fn scs(&self) -> u64 {
        if self.extended {
            self.cluster / 32
        } else {
            self.cluster
        }
    }
}

const SHAPES: [Shape; 2] = [
    Shape {
        opts: "cluster_size=64k,extended_l2=on",
        cluster: 64 * KIB,
        extended: true,
        qcow2_backing: false,
    },
    Shape {
        opts: "cluster_size=4k",
        cluster: 4 * KIB,
        extended: false,
        qcow2_backing: true,
    },
];

/// Creates `img.qcow2` of `size` over a backing file holding a pattern over its first two
/// thirds (raw, or converted to qcow2), and returns the backing contents.
fn make_image(dir: &Scratch, shape: &Shape, size: u64) -> Vec<u8> {
    let bsize = (size * 2 / 3) / 512 * 512;
    let backing = pattern(0xBAC4, 0, bsize as usize);
    let fmt = if shape.qcow2_backing { "qcow2" } else { "raw" };
    let name = make_backing_file(&dir.0, &backing, fmt);
    qemu_create(&dir.0, "img.qcow2", shape.opts, size, Some((name, fmt)));
    backing
}

async fn random_ops<S: Storage + 'static>(
    name: &str,
    opener: &dyn Opener<S>,
    shape: &Shape,
    seed: u64,
) {
    let dir = Scratch::new("uring-model");
    let what = format!("{name} {} seed {seed}", shape.opts);
    let cs = shape.cluster;
    let scs = shape.scs();
    let size = (6 * cs + cs / 2).max(3 * MIB + cs / 2);
    let backing = make_image(&dir, shape, size);
    let mut model = GuestModel::new(size, backing, scs);
    let path = dir.path("img.qcow2");
    let opts = OpenOptions::new().writable(true);
    let open = || opts.open_with(&path, opener);
    let mut img = open().await.unwrap_or_else(|e| panic!("{what}: open: {e}"));
    let mut rng = Rng(seed);
    for step in 0..70 {
        let sub = rng.below(size.div_ceil(scs));
        let within = match rng.below(4) {
            0 => 0,
            1 => rng.below(scs / 512) * 512,
            _ => rng.below(scs),
        };
        let at = (sub * scs + within).min(size - 1);
        let len = match rng.below(5) {
            0 => scs,
            1 => scs * (1 + rng.below(40)),
            2 => 1 + rng.below(4096),
            _ => 1 + rng.below(3 * cs),
        };
        let len = len.min(size - at).max(1);
        let ctx = |op: &str, err: qimg::Error| {
            format!("{what}: step {step}: {op} {at:#x}+{len:#x}: {err}")
        };
        match rng.below(16) {
            0..=5 => {
                let data = pattern(seed ^ step, at, len as usize);
                img.write(&data, at)
                    .await
                    .unwrap_or_else(|err| panic!("{}", ctx("write", err)));
                model.write(at, &data);
            }
            6..=7 => {
                img.write_zeroes(at, len)
                    .await
                    .unwrap_or_else(|err| panic!("{}", ctx("write_zeroes", err)));
                model.write_zeroes(at, len);
            }
            8..=10 => {
                img.discard(at, len)
                    .await
                    .unwrap_or_else(|err| panic!("{}", ctx("discard", err)));
                model.discard(at, len);
            }
            11..=12 => {
                let mut buf = vec![0u8; len as usize];
                img.read(&mut buf, at)
                    .await
                    .unwrap_or_else(|err| panic!("{}", ctx("read", err)));
                assert!(
                    buf == model.read(at, len),
                    "{what}: step {step}: read {at:#x}+{len:#x} differs from the model"
                );
            }
            13..=14 => img
                .flush()
                .await
                .unwrap_or_else(|err| panic!("{}", ctx("flush", err))),
            _ => {
                img.close()
                    .await
                    .unwrap_or_else(|err| panic!("{}", ctx("close", err)));
                img = open()
                    .await
                    .unwrap_or_else(|err| panic!("{}", ctx("reopen", err)));
            }
        }
    }
    let mut all = vec![0u8; size as usize];
    img.read(&mut all, 0).await.unwrap();
    if let Some(i) = first_difference(&all, &model.data) {
        panic!("{what}: full read differs from the model first at {i:#x}");
    }
    img.close().await.unwrap();
    drop(img);
    assert_clean(&dir.0, "img.qcow2", &what);
    assert_same_as_model(&dir.0, "img.qcow2", &model.data, &what);
}

async fn model_on<S: Storage + 'static>(name: &str, opener: &dyn Opener<S>) {
    let probe = Scratch::new("uring-probe");
    if !usable(&probe, name, opener) {
        return;
    }
    for shape in &SHAPES {
        for seed in 1..=3 {
            random_ops(name, opener, shape, seed * 0x1234_5678_9abc).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_operations_match_a_flat_model_on_uring_buffered() {
    qimg_testkit::require_qemu!();
    model_on("uring", &uring_buffered).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_operations_match_a_flat_model_on_bounced_uring_direct() {
    qimg_testkit::require_qemu!();
    model_on("bounce(uring O_DIRECT)", &uring_direct).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_operations_match_a_flat_model_on_bounced_file_direct() {
    qimg_testkit::require_qemu!();
    model_on("bounce(file O_DIRECT)", &file_direct).await;
}

const QUEUES: u64 = 4;
const TASKS_PER_QUEUE: u64 = 8;

/// One task's operation on the shared range, to tell which task wrote it last.
#[derive(Clone, Copy, Debug, PartialEq)]
enum SharedOp {
    Write(u64),
    Zero,
}

async fn stress<S: Storage + 'static>(name: &str, opener: &dyn Opener<S>, shape: &Shape) {
    let dir = Scratch::new("uring-stress");
    let what = format!("{name} {}", shape.opts);
    let size = 16 * MIB;
    let backing = Arc::new(make_image(&dir, shape, size));
    let scs = shape.scs();
    let img = OpenOptions::new()
        .writable(true)
        .open_with(&dir.path("img.qcow2"), opener)
        .await
        .unwrap_or_else(|e| panic!("{what}: open: {e}"));
    // Private ranges of 200 KiB + 1000 bytes at unaligned offsets, and one shared range.
    let private = |k: u64| (k * 400 * KIB + 1000, 200 * KIB + 1000);
    let shared = (13 * MIB + 3000, 150 * KIB);
    let mut tasks = Vec::new();
    for q in 0..QUEUES {
        // A queue: its own handle on the shared image.
        let queue = img.clone();
        for t in 0..TASKS_PER_QUEUE {
            let img = queue.clone();
            let backing = Arc::clone(&backing);
            let what = what.clone();
            let k = q * TASKS_PER_QUEUE + t;
            tasks.push(tokio::spawn(async move {
                let (base, plen) = private(k);
                let mut mine = GuestModel::window(size, base, plen, backing, scs);
                let mut rng = Rng(0xC0FFEE ^ (k + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                let mut last_shared = None;
                for step in 0..16u64 {
                    let at = base + rng.below(plen);
                    let len = 1 + rng.below((base + plen - at).min(3 * scs));
                    match rng.below(6) {
                        0 | 1 => {
                            let data = pattern(k * 100 + step, at, len as usize);
                            img.write(&data, at)
                                .await
                                .unwrap_or_else(|err| panic!("{what}: task {k} write: {err}"));
                            mine.write(at, &data);
                        }
                        2 => {
                            img.write_zeroes(at, len).await.unwrap_or_else(|err| {
                                panic!("{what}: task {k} write_zeroes: {err}")
                            });
                            mine.write_zeroes(at, len);
                        }
                        3 => {
                            img.discard(at, len)
                                .await
                                .unwrap_or_else(|err| panic!("{what}: task {k} discard: {err}"));
                            mine.discard(at, len);
                        }
                        4 => img
                            .flush()
                            .await
                            .unwrap_or_else(|err| panic!("{what}: task {k} flush: {err}")),
                        _ => {
                            let op = if rng.below(3) == 0 {
                                SharedOp::Zero
                            } else {
                                SharedOp::Write(k)
                            };
                            match op {
                                SharedOp::Zero => img.write_zeroes(shared.0, shared.1).await,
                                SharedOp::Write(k) => {
                                    img.write(
                                        &pattern(1000 + k, shared.0, shared.1 as usize),
                                        shared.0,
                                    )
                                    .await
                                }
                            }
                            .unwrap_or_else(|err| panic!("{what}: task {k} shared {op:?}: {err}"));
                            last_shared = Some(op);
                        }
                    }
                }
                let mut back = vec![0u8; plen as usize];
                img.read(&mut back, base).await.unwrap();
                if let Some(i) = first_difference(&back, &mine.data) {
                    panic!(
                        "{what}: task {k} reads back something else first at {:#x}",
                        base + i as u64
                    );
                }
                (k, mine.data, last_shared)
            }));
        }
    }
    // The tasks' windows and the shared range are put in by hand below.
    let mut model = GuestModel::new(size, backing, scs).data;
    let mut candidates = Vec::new();
    for t in tasks {
        let (k, mine, last) = t.await.expect("stress task");
        let (base, plen) = private(k);
        model[base as usize..(base + plen) as usize].copy_from_slice(&mine);
        candidates.extend(last);
    }
    let mut got = vec![0u8; shared.1 as usize];
    img.read(&mut got, shared.0).await.unwrap();
    let winner = candidates.iter().find(|op| match op {
        SharedOp::Zero => got.iter().all(|&b| b == 0),
        SharedOp::Write(k) => got == pattern(1000 + k, shared.0, shared.1 as usize),
    });
    if candidates.is_empty() {
        let orig = &model[shared.0 as usize..(shared.0 + shared.1) as usize];
        assert!(
            got == orig,
            "{what}: nobody wrote the shared range, yet it changed"
        );
    } else {
        assert!(
            winner.is_some(),
            "{what}: the shared range is not any task's last operation as a whole ({} candidates)",
            candidates.len()
        );
        model[shared.0 as usize..(shared.0 + shared.1) as usize].copy_from_slice(&got);
    }
    let mut all = vec![0u8; size as usize];
    img.read(&mut all, 0).await.unwrap();
    if let Some(i) = all.iter().zip(&model).position(|(x, y)| x != y) {
        panic!("{what}: contents differ from the model first at {i:#x}");
    }
    img.close().await.unwrap();
    drop(img);
    assert_clean(&dir.0, "img.qcow2", &what);
    assert_same_as_model(&dir.0, "img.qcow2", &model, &what);
}

async fn stress_on<S: Storage + 'static>(name: &str, opener: &dyn Opener<S>) {
    let probe = Scratch::new("uring-probe");
    if !usable(&probe, name, opener) {
        return;
    }
    for shape in &SHAPES {
        stress(name, opener, shape).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_queues_of_eight_tasks_on_uring_buffered() {
    qimg_testkit::require_qemu!();
    stress_on("uring", &uring_buffered).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_queues_of_eight_tasks_on_bounced_uring_direct() {
    qimg_testkit::require_qemu!();
    stress_on("bounce(uring O_DIRECT)", &uring_direct).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_queues_of_eight_tasks_on_bounced_file_direct() {
    qimg_testkit::require_qemu!();
    stress_on("bounce(file O_DIRECT)", &file_direct).await;
}

/// `Image::open_any` picks the backend and O_DIRECT from `OpenOptions`, for the image and its
/// backing file alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_any_runs_every_backend_from_options() {
    qimg_testkit::require_qemu!();
    use qimg::io::{AnyStorage, Backend};
    for backend in [Backend::Threads, Backend::IoUring] {
        for direct in [false, true] {
            let what = format!("{backend:?} direct={direct}");
            let dir = Scratch::new("open-any");
            let base = pattern(11, 0, MIB as usize);
            std::fs::write(dir.path("base.raw"), &base).unwrap();
            qemu_create(
                &dir.0,
                "a.qcow2",
                "extended_l2=on,cluster_size=64k",
                2 * MIB,
                Some(("base.raw", "raw")),
            );
            let opts = OpenOptions::new()
                .writable(true)
                .backend(backend)
                .direct(direct);
            let img = match opts.open(dir.path("a.qcow2")).await {
                Ok(img) => img,
                Err(e) if direct => {
                    eprintln!("skipped {what}: {e}");
                    continue;
                }
                Err(e) => panic!("{what}: {e}"),
            };
            let mut model = base.clone();
            model.resize((2 * MIB) as usize, 0);
            for (i, (at, len)) in [(100u64, 3000usize), (70_000, 512), (MIB - 10, 40)]
                .into_iter()
                .enumerate()
            {
                let data = pattern(i as u64, at, len);
                img.write(&data, at).await.unwrap();
                model[at as usize..at as usize + len].copy_from_slice(&data);
            }
            let mut back = vec![0u8; model.len()];
            img.read(&mut back, 0).await.unwrap();
            assert!(back == model, "{what}: read back differs");
            let used = match (img.storage(), img.backing()) {
                (
                    AnyStorage::File(_),
                    Some(qimg::Backing::Raw {
                        storage: AnyStorage::File(_),
                        ..
                    }),
                ) => (Backend::Threads, false),
                (
                    AnyStorage::FileDirect(_),
                    Some(qimg::Backing::Raw {
                        storage: AnyStorage::FileDirect(_),
                        ..
                    }),
                ) => (Backend::Threads, true),
                (
                    AnyStorage::Uring(_),
                    Some(qimg::Backing::Raw {
                        storage: AnyStorage::Uring(_),
                        ..
                    }),
                ) => (Backend::IoUring, false),
                (
                    AnyStorage::UringDirect(_),
                    Some(qimg::Backing::Raw {
                        storage: AnyStorage::UringDirect(_),
                        ..
                    }),
                ) => (Backend::IoUring, true),
                other => panic!("{what}: opened {other:?}"),
            };
            assert_eq!(used, (backend, direct), "{what}");
            img.close().await.unwrap();
            assert_clean(&dir.0, "a.qcow2", &what);
            assert_same_as_model(&dir.0, "a.qcow2", &model, &what);
        }
    }
}

//! The engine's hot paths through the public API, on an in-memory image (so the figures are
//! the engine's own cost, not the disk's): 4 KiB requests with the whole L2 table cached.
//!
//! * `read_cached`: a read of allocated data (range lock, metadata lock, L2 lookup, copy).
//! * `overwrite_in_place`: a write to an allocated subcluster (the same plus write planning).
//! * `allocating_write`: a write to an unallocated cluster (planning, allocation, refcount and
//!   L2 updates, linking).
//! * `zero_subcluster`: write-zeroes of one whole subcluster (metadata only).
//!
//! Each iteration issues 256 requests on a current-thread runtime; throughput is per request.
//! The image is created with free space already in memory, so new clusters cost the engine's
//! work, not the memory backend's page faults.
//! `cargo bench -p qimg --bench engine`.

// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use qimg::io::MemStorage;
use qimg::tools::create::{CreateOptions, create};
use qimg::{Image, OpenOptions};
use tokio::runtime::Runtime;

const SIZE: u64 = 1 << 30;
const CLUSTER: u64 = 64 << 10;
const REQUESTS: u64 = 256;
const REQUEST: usize = 4096;

/// The bytes of a fresh 1 GiB image with 64 KiB clusters split into 2 KiB subclusters.
fn image_bytes() -> Vec<u8> {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("bench.qcow2");
    let opts = CreateOptions {
        size: Some(SIZE),
        extended_l2: true,
        cluster_size: CLUSTER,
        ..Default::default()
    };
    create(&path, &opts, &mut |_, _| {}).expect("create");
    let mut bytes = std::fs::read(&path).expect("read image");
    // Free clusters (refcount 0) already present in memory after the metadata: allocations
    // reuse them, so the figures do not include `MemStorage` zero-filling a new chunk per
    // cluster (which a profile showed to be most of the time otherwise).
    bytes.resize(((REQUESTS + 16) * CLUSTER) as usize, 0xa5);
    bytes
}

fn open(rt: &Runtime, bytes: &[u8]) -> Image<MemStorage> {
    rt.block_on(
        OpenOptions::new()
            .writable(true)
            .clean_timer(false)
            .open_storage(MemStorage::from_bytes(bytes), "bench.qcow2", None, None),
    )
    .expect("open")
}

/// Offsets of the requests of one iteration: spread over `REQUESTS` clusters.
fn offsets() -> impl Iterator<Item = u64> {
    (0..REQUESTS).map(|i| (i * 37 % REQUESTS) * CLUSTER + (i % 16) * REQUEST as u64)
}

fn engine(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let fresh = image_bytes();
    // An image whose first REQUESTS clusters are allocated, for reads and overwrites.
    let allocated = open(&rt, &fresh);
    rt.block_on(async {
        for i in 0..REQUESTS {
            allocated
                .write(&vec![1u8; CLUSTER as usize], i * CLUSTER)
                .await
                .expect("fill");
        }
        allocated.flush().await.expect("flush");
    });

    let mut group = c.benchmark_group("engine");
    group.throughput(Throughput::Elements(REQUESTS));
    group.measurement_time(Duration::from_secs(3));
    group.warm_up_time(Duration::from_secs(1));

    let mut buf = vec![0u8; REQUEST];
    group.bench_function("read_cached", |b| {
        b.iter(|| {
            rt.block_on(async {
                for at in offsets() {
                    allocated.read(&mut buf, at).await.expect("read");
                }
            });
            black_box(&buf);
        })
    });

    let data = vec![2u8; REQUEST];
    group.bench_function("overwrite_in_place", |b| {
        b.iter(|| {
            rt.block_on(async {
                for at in offsets() {
                    allocated.write(&data, at).await.expect("write");
                }
            })
        })
    });

    group.bench_function("allocating_write", |b| {
        b.iter_batched(
            || open(&rt, &fresh),
            |img| {
                rt.block_on(async {
                    for at in offsets() {
                        img.write(&data, at).await.expect("write");
                    }
                });
                img
            },
            BatchSize::LargeInput,
        )
    });

    group.bench_function("zero_subcluster", |b| {
        b.iter(|| {
            rt.block_on(async {
                for at in offsets() {
                    allocated.write_zeroes(at, 2048).await.expect("zero");
                }
            })
        })
    });
    group.finish();
}

criterion_group!(benches, engine);
criterion_main!(benches);

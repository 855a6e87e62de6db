//! Lookup cost of the slice cache: hits, and misses that insert and evict,
//! at a few cache sizes (4 KiB slices, as QEMU uses for large disks).

// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use qimg_cache::{SliceCache, SliceKey};

const SLICE: u64 = 4096;
/// Slices per 64 KiB L2 table with 4 KiB slices.
const SLICES_PER_TABLE: u64 = 16;

fn key(n: u64) -> SliceKey {
    let table = (n / SLICES_PER_TABLE) * 0x10000;
    // n % 16 always fits.
    let slice = u32::try_from(n % SLICES_PER_TABLE).unwrap_or(0);
    SliceKey::new(0x100000 + table, slice)
}

fn full_cache(entries: u64) -> SliceCache {
    let mut cache = SliceCache::new(entries * SLICE, SLICE).expect("cache shape");
    for n in 0..entries {
        cache
            .insert(key(n), vec![0; SLICE as usize].into(), Duration::ZERO)
            .expect("room");
    }
    cache
}

fn lookup(c: &mut Criterion) {
    let sizes = [64u64, 1024, 8192];

    let mut hits = c.benchmark_group("hit");
    hits.throughput(Throughput::Elements(1));
    for entries in sizes {
        let mut cache = full_cache(entries);
        // A stride coprime with the size walks every slice in scrambled order.
        let mut n = 0u64;
        hits.bench_with_input(BenchmarkId::from_parameter(entries), &entries, |b, &e| {
            b.iter(|| {
                n = (n + 7919) % e;
                let slice = cache.get(black_box(key(n)), Duration::from_secs(1));
                black_box(slice.map(|s| s[0]))
            });
        });
    }
    hits.finish();

    let mut misses = c.benchmark_group("miss_insert_evict");
    misses.throughput(Throughput::Elements(1));
    for entries in sizes {
        let mut cache = full_cache(entries);
        let mut n = entries;
        misses.bench_with_input(BenchmarkId::from_parameter(entries), &entries, |b, _| {
            b.iter(|| {
                n += 1;
                let k = key(n);
                let now = Duration::from_secs(1);
                let miss = cache.get(black_box(k), now).is_none();
                // Allocating the slice is part of a real miss (the load buffer).
                let evicted = cache.insert(k, vec![0; SLICE as usize].into(), now);
                black_box((miss, evicted.is_ok()))
            });
        });
    }
    misses.finish();

    let mut dirty = c.benchmark_group("miss_insert_evict_dirty");
    dirty.throughput(Throughput::Elements(1));
    for entries in sizes {
        let mut cache = full_cache(entries);
        for n in 0..entries {
            cache.mark_dirty(key(n)).expect("cached");
        }
        let mut n = entries;
        let mut spare: Box<[u8]> = vec![0; SLICE as usize].into();
        dirty.bench_with_input(BenchmarkId::from_parameter(entries), &entries, |b, _| {
            b.iter(|| {
                n += 1;
                let k = key(n);
                let now = Duration::from_secs(1);
                // Reuse the evicted buffer as the next load buffer, as an engine would.
                let buffer = std::mem::take(&mut spare);
                let buffer = if buffer.len() == SLICE as usize {
                    buffer
                } else {
                    vec![0; SLICE as usize].into()
                };
                if let Ok(Some(evicted)) = cache.insert(k, buffer, now) {
                    spare = evicted.data;
                }
                let _ = cache.mark_dirty(k);
            });
        });
    }
    dirty.finish();
}

criterion_group!(benches, lookup);
criterion_main!(benches);

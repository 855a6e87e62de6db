//! An embedder's lifecycle without async: synchronous open and close (`open_blocking`), the
//! clean timer on a thread of the image's own, and `close_on_drop`.

mod common;

use std::time::{Duration, Instant};

use common::{Scratch, assert_clean, assert_same_as_model, have_qemu, qemu_create};
use qimg::{CacheOptions, OpenOptions};

const MIB: u64 = 1 << 20;

#[test]
fn the_clean_timer_runs_without_a_runtime_of_the_callers() {
    let dir = Scratch::new("timer");
    if !have_qemu("the_clean_timer_runs_without_a_runtime_of_the_callers") {
        return;
    }
    qemu_create(&dir.0, "a.qcow2", "cluster_size=64k", 64 * MIB, None);
    let cache = CacheOptions {
        cache_clean_interval: Some(1),
        ..Default::default()
    };
    let img = OpenOptions::new()
        .writable(true)
        .cache(cache)
        .open_blocking(dir.path("a.qcow2"))
        .unwrap();
    for i in 0..16 {
        img.write(&[1u8; 4096], i * 4 * MIB).unwrap();
    }
    assert!(img.stats().l2_cache.entries > 0);
    // Nobody calls into the image now: only the timer's own thread can empty the cache.
    let start = Instant::now();
    while img.stats().l2_cache.entries > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the clean timer did not run: {:?}",
            img.stats().l2_cache
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(img.stats().l2_cache.idle_drops > 0);
    img.close().unwrap();
    assert_clean(&dir.0, "a.qcow2", "clean timer thread");
}

#[test]
fn close_on_drop_flushes_and_releases_the_image() {
    if !have_qemu("close_on_drop_flushes_and_releases_the_image") {
        return;
    }
    let dir = Scratch::new("drop-close");
    qemu_create(
        &dir.0,
        "a.qcow2",
        "extended_l2=on,cluster_size=64k,lazy_refcounts=on",
        8 * MIB,
        None,
    );
    let mut model = vec![0u8; 8 * MIB as usize];
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let img = OpenOptions::new()
            .writable(true)
            .close_on_drop(true)
            .open(dir.path("a.qcow2"))
            .await
            .unwrap();
        for i in 0..20u64 {
            let at = i * 300_000;
            img.write(&[i as u8 + 1; 5000], at).await.unwrap();
            model[at as usize..at as usize + 5000].fill(i as u8 + 1);
        }
        // Dropped inside an async task, without flush or close.
        drop(img);
    });
    // Closed: unlocked, clean (lazy refcounts: the dirty bit is cleared), data durable.
    assert_clean(&dir.0, "a.qcow2", "close on drop");
    assert_same_as_model(&dir.0, "a.qcow2", &model, "close on drop");
}

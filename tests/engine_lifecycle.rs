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
        // A hang guard: with a 1 s clean interval the cache empties within about 2 s.
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

/// A VMM that opened the disk itself: `qimg::probe` reads what the image is from its
/// descriptor (what qemu-img info says), and `OpenOptions::open_file` works on that same
/// descriptor (no second open by name), resolving the backing file next to `name`.
#[test]
fn a_vmm_probes_and_opens_its_own_descriptor() {
    if !common::have_qemu("a_vmm_probes_and_opens_its_own_descriptor") {
        return;
    }
    let dir = Scratch::new("open-file");
    common::qemu_create(&dir.0, "base.qcow2", "cluster_size=64k", 4 << 20, None);
    common::qemu_io(&dir.0, "qcow2", "base.qcow2", &["write -P 3 0 1M"]);
    common::qemu_create(
        &dir.0,
        "top.qcow2",
        "extended_l2=on,cluster_size=128k",
        4 << 20,
        Some(("base.qcow2", "qcow2")),
    );
    common::qemu_io(&dir.0, "qcow2", "top.qcow2", &["write -P 4 64k 4k"]);
    std::fs::write(dir.path("raw.img"), vec![0u8; 8192]).unwrap();
    let raw = std::fs::File::open(dir.path("raw.img")).unwrap();
    assert_eq!(qimg::probe(&raw).unwrap(), None);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.path("top.qcow2"))
        .unwrap();
    let p = qimg::probe(&file).unwrap().expect("a qcow2 image");
    let info = common::info(&dir.0, "top.qcow2");
    assert_eq!(p.version, 3);
    assert!(p.extended_l2);
    assert_eq!(p.cluster_size, info["cluster-size"].as_u64().unwrap());
    assert_eq!(p.size, info["virtual-size"].as_u64().unwrap());
    assert_eq!(p.backing_file.as_deref(), Some("base.qcow2"));
    assert_eq!(p.backing_format.as_deref(), Some("qcow2"));
    assert_eq!(p.data_file, None);
    let img = OpenOptions::new()
        .writable(true)
        .open_file_blocking(file, dir.path("top.qcow2"))
        .unwrap();
    let mut buf = vec![0u8; 8192];
    img.read(&mut buf, 60 * 1024).unwrap();
    assert!(buf[..4096].iter().all(|&b| b == 3), "from the backing file");
    assert!(buf[4096..].iter().all(|&b| b == 4), "from the image");
    img.write(&[5u8; 4096], 1 << 20).unwrap();
    img.close().unwrap();
    common::assert_clean(&dir.0, "top.qcow2", "open_file");
    // A descriptor opened read-only cannot give a writable image.
    let ro = std::fs::File::open(dir.path("top.qcow2")).unwrap();
    let e = match OpenOptions::new()
        .writable(true)
        .open_file_blocking(ro, dir.path("top.qcow2"))
    {
        Ok(_) => panic!("a writable image on a read-only descriptor"),
        Err(e) => e,
    };
    assert!(e.to_string().contains("read-only"), "{e}");
}

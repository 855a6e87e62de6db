//! The engine against qemu-img: basic reads and writes, subcluster copy-on-write counters,
//! the cache clean interval, and many concurrent tasks.

use crate::common;

use common::*;
use qimg::{CacheOptions, OpenOptions};
use qimg_testkit::pattern;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_read_back_and_the_image_checks_clean() {
    qimg_testkit::require_qemu!();
    for opts in [
        "extended_l2=on,cluster_size=128k",
        "cluster_size=64k",
        "compat=0.10,cluster_size=4k",
    ] {
        let dir = Scratch::new("basic");
        qemu_create(&dir.0, "a.qcow2", opts, 8 * MIB, None);
        let img = OpenOptions::new()
            .writable(true)
            .open(dir.path("a.qcow2"))
            .await
            .unwrap();
        let mut model = vec![0u8; 8 * MIB as usize];
        for (i, (at, len)) in [
            (0u64, 512usize),
            (1000, 70000),
            (3 * MIB - 7, 9000),
            (8 * MIB - 100, 100),
        ]
        .into_iter()
        .enumerate()
        {
            let data = pattern(i as u64, at, len);
            img.write(&data, at).await.unwrap();
            model[at as usize..at as usize + len].copy_from_slice(&data);
        }
        let mut back = vec![0u8; model.len()];
        img.read(&mut back, 0).await.unwrap();
        assert!(back == model, "{opts}: read back differs");
        img.close().await.unwrap();
        assert_clean(&dir.0, "a.qcow2", opts);
        assert_same_as_model(&dir.0, "a.qcow2", &model, opts);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aligned_subcluster_writes_over_a_full_backing_file_copy_nothing() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("cow");
    let size = 16 * MIB;
    let backing = pattern(0xBA5E, 0, size as usize);
    std::fs::write(dir.path("base.raw"), &backing).unwrap();
    qemu_create(
        &dir.0,
        "sub.qcow2",
        "extended_l2=on,cluster_size=128k",
        size,
        Some(("base.raw", "raw")),
    );
    qemu_create(
        &dir.0,
        "std.qcow2",
        "cluster_size=128k",
        size,
        Some(("base.raw", "raw")),
    );
    let mut model = backing.clone();
    let sub = OpenOptions::new()
        .writable(true)
        .open(dir.path("sub.qcow2"))
        .await
        .unwrap();
    let std = OpenOptions::new()
        .writable(true)
        .open(dir.path("std.qcow2"))
        .await
        .unwrap();
    // Pseudo-random 4 KiB-aligned offsets, a few landing in the same cluster.
    let mut rng = qimg_testkit::Rng(12345);
    for i in 0..200u64 {
        let at = rng.aligned(size, 4 * KIB);
        let data = pattern(i, at, 4096);
        sub.write(&data, at).await.unwrap();
        std.write(&data, at).await.unwrap();
        model[at as usize..at as usize + 4096].copy_from_slice(&data);
    }
    let s = sub.stats().await;
    assert_eq!(
        s.cow_bytes, 0,
        "4 KiB-aligned writes on 4 KiB subclusters copied {} bytes",
        s.cow_bytes
    );
    assert!(s.clusters_allocated > 0);
    let standard = std.stats().await;
    assert!(
        standard.cow_bytes >= standard.clusters_allocated * (124 * KIB),
        "standard clusters copy the rest of each cluster: {standard:?}"
    );
    // A 2 KiB write into an untouched subcluster copies exactly the other 2 KiB of it.
    let at = 8 * MIB + 64 * KIB + 1024;
    let data = pattern(999, at, 2048);
    sub.write(&data, at).await.unwrap();
    model[at as usize..at as usize + 2048].copy_from_slice(&data);
    assert_eq!(sub.stats().await.cow_bytes, 2048);
    std.close().await.unwrap();
    let mut back = vec![0u8; size as usize];
    sub.read(&mut back, 0).await.unwrap();
    assert!(back == model, "contents differ from the model");
    sub.close().await.unwrap();
    assert_clean(&dir.0, "sub.qcow2", "subclusters");
    assert_same_as_model(&dir.0, "sub.qcow2", &model, "subclusters");
}

#[tokio::test(start_paused = true)]
async fn idle_slices_are_dropped_after_the_clean_interval() {
    qimg_testkit::require_qemu!();
    for interval in [0u64, 2] {
        let dir = Scratch::new("clean");
        qemu_create(
            &dir.0,
            "c.qcow2",
            "extended_l2=on,cluster_size=64k",
            64 * MIB,
            None,
        );
        let opts = OpenOptions::new().writable(true).cache(CacheOptions {
            cache_clean_interval: Some(interval),
            ..CacheOptions::default()
        });
        let img = opts.open(dir.path("c.qcow2")).await.unwrap();
        for i in 0..32u64 {
            img.write(&pattern(i, 0, 4096), i * 2 * MIB).await.unwrap();
        }
        let busy = img.stats().await;
        assert!(
            busy.l2_cache.entries > 0 && busy.refcount_cache.entries > 0,
            "{busy:?}"
        );
        // Idle for more than two intervals (the clock is paused and advances by itself).
        tokio::time::sleep(std::time::Duration::from_secs(7)).await;
        let idle = img.stats().await;
        if interval == 0 {
            assert_eq!(
                idle.l2_cache.entries, busy.l2_cache.entries,
                "disabled timer dropped slices"
            );
        } else {
            assert_eq!(idle.l2_cache.entries, 0, "L2 slices left: {idle:?}");
            assert_eq!(
                idle.refcount_cache.entries, 0,
                "refcount blocks left: {idle:?}"
            );
            assert_eq!(idle.l2_cache.bytes_held, 0);
            // Still correct after the slices were dropped (dirty ones were written first).
            let mut buf = vec![0u8; 4096];
            img.read(&mut buf, 6 * MIB).await.unwrap();
            assert_eq!(buf, pattern(3, 0, 4096));
        }
        img.close().await.unwrap();
        assert_clean(&dir.0, "c.qcow2", "after the clean timer");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_tasks_leave_a_serialisable_result() {
    qimg_testkit::require_qemu!();
    for opts in ["extended_l2=on,cluster_size=64k", "cluster_size=64k"] {
        let dir = Scratch::new("concurrent");
        let size = 32 * MIB;
        std::fs::write(dir.path("base.raw"), pattern(0xB, 0, size as usize)).unwrap();
        qemu_create(&dir.0, "m.qcow2", opts, size, Some(("base.raw", "raw")));
        let img = OpenOptions::new()
            .writable(true)
            .open(dir.path("m.qcow2"))
            .await
            .unwrap();
        // Private regions of 200 KiB (unaligned), and one shared range every task writes.
        let private = |k: u64| (k * 300 * KIB + 1000, 200 * KIB as usize);
        let shared = (25 * MIB + 3000, 150 * KIB as usize);
        let mut tasks = Vec::new();
        for k in 0..64u64 {
            let img = img.clone();
            tasks.push(tokio::spawn(async move {
                let (at, len) = private(k);
                // In pieces, interleaved with the shared writes of others.
                for piece in 0..4u64 {
                    let p = at + piece * (len as u64 / 4);
                    img.write(&pattern(k, p, len / 4), p).await.unwrap();
                    if piece == 1 {
                        img.write(&pattern(1000 + k, shared.0, shared.1), shared.0)
                            .await
                            .unwrap();
                    }
                }
                if k % 8 == 0 {
                    img.flush().await.unwrap();
                }
                let mut back = vec![0u8; len];
                img.read(&mut back, at).await.unwrap();
                assert!(
                    back == pattern(k, at, len),
                    "task {k} reads back something else"
                );
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let mut model = pattern(0xB, 0, size as usize);
        for k in 0..64u64 {
            let (at, len) = private(k);
            model[at as usize..at as usize + len].copy_from_slice(&pattern(k, at, len));
        }
        let mut got = vec![0u8; shared.1];
        img.read(&mut got, shared.0).await.unwrap();
        let winner = (0..64u64)
            .find(|k| got == pattern(1000 + k, shared.0, shared.1))
            .unwrap_or_else(|| panic!("{opts}: the shared range is a mix of several writes"));
        model[shared.0 as usize..shared.0 as usize + shared.1].copy_from_slice(&got);
        let _ = winner;
        let mut all = vec![0u8; size as usize];
        img.read(&mut all, 0).await.unwrap();
        assert!(
            all == model,
            "{opts}: contents differ from the serial model"
        );
        img.close().await.unwrap();
        assert_clean(&dir.0, "m.qcow2", opts);
        assert_same_as_model(&dir.0, "m.qcow2", &model, opts);
    }
}

/// Overwrites bytes of an image file in place (damage made at test time).
fn poke(path: &std::path::Path, at: u64, bytes: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    std::os::unix::fs::FileExt::write_at(&f, bytes, at).unwrap();
}

fn header_u32(path: &std::path::Path, at: usize) -> u32 {
    let b = std::fs::read(path).unwrap();
    u32::from_be_bytes(b[at..at + 4].try_into().unwrap())
}

#[tokio::test]
async fn the_refcount_table_grows_when_the_file_outgrows_it() {
    qimg_testkit::require_qemu!();
    // 512-byte clusters with 64-bit refcounts: one table cluster covers 2 MiB of file.
    let dir = Scratch::new("reftable");
    qemu_create(
        &dir.0,
        "g.qcow2",
        "cluster_size=512,refcount_bits=64",
        6 * MIB,
        None,
    );
    assert_eq!(header_u32(&dir.path("g.qcow2"), 56), 1);
    let img = OpenOptions::new()
        .writable(true)
        .open(dir.path("g.qcow2"))
        .await
        .unwrap();
    let data = pattern(5, 0, 5 * MIB as usize);
    img.write(&data, 123).await.unwrap();
    img.close().await.unwrap();
    assert!(
        header_u32(&dir.path("g.qcow2"), 56) > 1,
        "the refcount table did not grow"
    );
    let mut model = vec![0u8; 6 * MIB as usize];
    model[123..123 + data.len()].copy_from_slice(&data);
    assert_clean(&dir.0, "g.qcow2", "grown refcount table");
    assert_same_as_model(&dir.0, "g.qcow2", &model, "grown refcount table");
}

#[tokio::test]
async fn a_dirty_image_is_repaired_when_opened_read_write() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("dirty");
    let path = dir.path("d.qcow2");
    qemu_create(
        &dir.0,
        "d.qcow2",
        "lazy_refcounts=on,extended_l2=on",
        8 * MIB,
        None,
    );
    let img = OpenOptions::new().writable(true).open(&path).await.unwrap();
    let data = pattern(1, 0, 3 * MIB as usize);
    img.write(&data, 512 * KIB).await.unwrap();
    img.flush().await.unwrap();
    // A crash: the handle goes away without close, so the dirty bit stays set.
    drop(img);
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(bytes[79] & 1, 1, "lazy refcounts did not set the dirty bit");
    // Make the refcounts really stale: zero the refcount block's entries for data clusters.
    let reftable = u64::from_be_bytes(bytes[48..56].try_into().unwrap());
    let block = u64::from_be_bytes(
        bytes[reftable as usize..reftable as usize + 8]
            .try_into()
            .unwrap(),
    );
    poke(&path, block + 16, &[0u8; 64]);
    let o = common::qemu_img(&dir.0, &["check", "--output=json", "d.qcow2"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        v["corruptions"].as_u64().unwrap_or(0) > 0,
        "tampering did not show: {v}"
    );

    let img = OpenOptions::new().writable(true).open(&path).await.unwrap();
    let mut back = vec![0u8; data.len()];
    img.read(&mut back, 512 * KIB).await.unwrap();
    assert!(back == data);
    img.close().await.unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap()[79] & 1,
        0,
        "dirty bit left set"
    );
    assert_clean(&dir.0, "d.qcow2", "repaired");
    let mut model = vec![0u8; 8 * MIB as usize];
    model[512 * KIB as usize..512 * KIB as usize + data.len()].copy_from_slice(&data);
    assert_same_as_model(&dir.0, "d.qcow2", &model, "repaired");
}

#[tokio::test]
async fn a_corrupt_image_opens_read_only_but_not_read_write() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("corrupt");
    let path = dir.path("c.qcow2");
    qemu_create(&dir.0, "c.qcow2", "cluster_size=64k", MIB, None);
    poke(&path, 79, &[2u8]);
    let err = OpenOptions::new()
        .writable(true)
        .open(&path)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("corrupt"), "{err}");
    let img = OpenOptions::new().open(&path).await.unwrap();
    let mut buf = [1u8; 512];
    img.read(&mut buf, 0).await.unwrap();
    assert_eq!(buf, [0u8; 512]);
    assert!(matches!(
        img.write(&buf, 0).await,
        Err(qimg::Error::ReadOnly { .. })
    ));
}

/// Corruption found while writing makes the image unusable (QEMU ejects its driver): every
/// later request fails with `Error::Unusable` (errno `ENOMEDIUM`); read-only, it is only
/// reported and the rest of the image reads on.
#[tokio::test]
async fn corruption_found_while_writing_makes_the_image_unusable() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("unusable");
    let path = dir.path("u.qcow2");
    qemu_create(&dir.0, "u.qcow2", "extended_l2=on", MIB, None);
    let img = OpenOptions::new().writable(true).open(&path).await.unwrap();
    img.write(&pattern(1, 0, 68 * KIB as usize), 0)
        .await
        .unwrap();
    img.close().await.unwrap();
    // Subcluster 0 of cluster 0 both allocated and zero (the L2 table is at 0x40000).
    poke(&path, 0x4000b, &[1]);
    poke(&path, 0x4000f, &[1]);
    let mut buf = vec![0u8; 2048];

    let ro = OpenOptions::new().open(&path).await.unwrap();
    assert!(matches!(
        ro.read(&mut buf, 0).await,
        Err(qimg::Error::Corrupt { .. })
    ));
    ro.read(&mut buf, 64 * KIB).await.unwrap();
    ro.check_usable().unwrap();
    drop(ro);

    let img = OpenOptions::new().writable(true).open(&path).await.unwrap();
    img.check_usable().unwrap();
    img.read(&mut buf, 64 * KIB).await.unwrap();
    assert!(matches!(
        img.read(&mut buf, 0).await,
        Err(qimg::Error::Corrupt { .. })
    ));
    let e = img.check_usable().unwrap_err();
    assert!(matches!(e, qimg::Error::Unusable { .. }), "{e}");
    assert_eq!(e.errno(), 123);
    for r in [
        img.read(&mut buf, 64 * KIB).await,
        img.write(&buf, 128 * KIB).await,
        img.write_zeroes(192 * KIB, 4096).await,
        img.discard(256 * KIB, 4096).await,
        img.map(0, MIB).await.map(|_| ()),
        img.resize(2 * MIB).await,
    ] {
        assert!(matches!(r, Err(qimg::Error::Unusable { .. })), "{r:?}");
    }
    drop(img);
    assert!(
        std::fs::read(&path).unwrap()[79] & 2 != 0,
        "not marked corrupt"
    );
}

#[tokio::test]
async fn resize_grows_the_l1_table_and_the_new_area_is_writable() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("resize");
    qemu_create(&dir.0, "r.qcow2", "cluster_size=4k", MIB, None);
    let img = OpenOptions::new()
        .writable(true)
        .open(dir.path("r.qcow2"))
        .await
        .unwrap();
    img.write(&pattern(1, 0, 10_000), 5).await.unwrap();
    let new_size = 40 * MIB + 512;
    img.resize(new_size).await.unwrap();
    assert!(img.resize(MIB).await.is_err(), "shrinking must be refused");
    img.write(&pattern(2, 0, 9000), new_size - 9000)
        .await
        .unwrap();
    img.close().await.unwrap();
    let v = info(&dir.0, "r.qcow2");
    assert_eq!(v["virtual-size"].as_u64(), Some(new_size));
    let mut model = vec![0u8; new_size as usize];
    model[5..10_005].copy_from_slice(&pattern(1, 0, 10_000));
    model[(new_size - 9000) as usize..].copy_from_slice(&pattern(2, 0, 9000));
    assert_clean(&dir.0, "r.qcow2", "resized");
    assert_same_as_model(&dir.0, "r.qcow2", &model, "resized");
}

#[tokio::test]
async fn a_backing_chain_that_loops_is_refused() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("loop");
    qemu_create(&dir.0, "a.qcow2", "cluster_size=64k", MIB, None);
    qemu_create(
        &dir.0,
        "b.qcow2",
        "cluster_size=64k",
        MIB,
        Some(("a.qcow2", "qcow2")),
    );
    common::ok(
        "qemu-img rebase -u",
        &common::qemu_img(
            &dir.0,
            &["rebase", "-u", "-F", "qcow2", "-b", "b.qcow2", "a.qcow2"],
        ),
    );
    let err = OpenOptions::new()
        .open(dir.path("b.qcow2"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("loops"), "{err}");
    // Without following the backing file it opens.
    let opts = OpenOptions::new().follow_backing(false);
    opts.open(dir.path("b.qcow2")).await.unwrap();
}

#[tokio::test]
async fn a_backing_chain_deeper_than_the_limit_is_refused_clearly() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("deep");
    qemu_create(&dir.0, "0.qcow2", "cluster_size=64k", MIB, None);
    let depth = qimg::chain::MAX_CHAIN_DEPTH + 1;
    for i in 1..=depth {
        let below = format!("{}.qcow2", i - 1);
        qemu_create(
            &dir.0,
            &format!("{i}.qcow2"),
            "cluster_size=64k",
            MIB,
            Some((&below, "qcow2")),
        );
    }
    // Exactly at the limit it opens and reads through the whole chain.
    let at_limit = OpenOptions::new()
        .open(dir.path(&format!("{}.qcow2", depth - 1)))
        .await
        .unwrap();
    let mut buf = [1u8; 512];
    at_limit.read(&mut buf, 0).await.unwrap();
    assert_eq!(buf, [0u8; 512]);
    let err = OpenOptions::new()
        .open(dir.path(&format!("{depth}.qcow2")))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("deeper than 64"), "{err}");
}

#[tokio::test]
async fn an_overlay_cannot_be_written_without_its_backing_file() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("nobacking");
    qemu_create(&dir.0, "a.qcow2", "cluster_size=64k", MIB, None);
    qemu_create(
        &dir.0,
        "b.qcow2",
        "cluster_size=64k",
        MIB,
        Some(("a.qcow2", "qcow2")),
    );
    let opts = OpenOptions::new().writable(true).follow_backing(false);
    let err = opts.open(dir.path("b.qcow2")).await.unwrap_err();
    assert!(err.to_string().contains("backing file"), "{err}");
}

/// Fragmentation (issue 34 item 14): requests in flight together each allocate their clusters
/// as one host run, as QEMU does, instead of taking turns cluster by cluster (which left a
/// guest's sequential writes scattered over the host file). Counted from the map: every 1 MiB
/// request is one host extent, and `qemu-img check` counts few fragmented clusters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_in_flight_together_each_land_as_one_host_extent() {
    qimg_testkit::require_qemu!();
    for opts in ["extended_l2=on,cluster_size=64k", "cluster_size=64k"] {
        let dir = Scratch::new("contiguous");
        let size = 64 * MIB;
        qemu_create(&dir.0, "f.qcow2", opts, size, None);
        let img = OpenOptions::new()
            .writable(true)
            .open(dir.path("f.qcow2"))
            .await
            .unwrap();
        // Eight writers, each writing its own 1 MiB requests in turn: eight requests in flight.
        let mut tasks = Vec::new();
        for k in 0..8u64 {
            let img = img.clone();
            tasks.push(tokio::spawn(async move {
                for r in 0..4u64 {
                    let at = (r * 8 + k) * MIB;
                    img.write(&pattern(k, at, MIB as usize), at).await.unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        for r in 0..32u64 {
            let extents = img.map(r * MIB, MIB).await.unwrap();
            assert_eq!(
                extents.len(),
                1,
                "{opts}: the 1 MiB request at {r} MiB landed in {} host pieces: {extents:?}",
                extents.len()
            );
        }
        img.close().await.unwrap();
        assert_clean(&dir.0, "f.qcow2", opts);
        // The check counts a cluster fragmented when it does not follow the one before it in
        // guest order: at most one per request here.
        let out = std::process::Command::new("qemu-img")
            .args(["check", "--output=json"])
            .arg(dir.path("f.qcow2"))
            .output()
            .unwrap();
        let json = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            json.contains("\"allocated-clusters\": 512"),
            "{opts}: {json}"
        );
        // qemu-img leaves the key out when the count is 0.
        let fragmented: u64 = match json.split("\"fragmented-clusters\":").nth(1) {
            None => 0,
            Some(rest) => rest
                .trim()
                .split([',', '\n', '}'])
                .next()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or_else(|| panic!("{opts}: unreadable fragmented-clusters in {json}")),
        };
        assert!(
            fragmented <= 32,
            "{opts}: {fragmented} of 512 clusters fragmented (at most one per request expected)"
        );
    }
}

//! Images written by QEMU read back byte-identical in qimg, and qimg's writes over what QEMU
//! made (compressed clusters, internal snapshots, external data files) keep them consistent.

use crate::common;

use common::*;
use qimg::OpenOptions;
use qimg_testkit::pattern;
use std::path::Path;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

fn qemu_io(dir: &Path, file: &str, cmds: &[&str]) {
    common::qemu_io(dir, "qcow2", file, cmds);
}

async fn read_all(path: &Path) -> Vec<u8> {
    let img = OpenOptions::new().open(path).await.unwrap();
    let mut buf = vec![0u8; img.size() as usize];
    img.read(&mut buf, 0).await.unwrap();
    img.close().await.unwrap();
    buf
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.iter().zip(b).position(|(x, y)| x != y)
}

/// qemu-io commands touching subclusters, unaligned ranges, zero writes (with and without
/// unmap) and discards.
const QEMU_IO_SCRIPT: &[&str] = &[
    "write -P 0x11 0 4k",
    "write -P 0x22 6k 3000",
    "write -P 0x33 65000 70000",
    "write -z 128k 64k",
    "write -P 0x44 200k 512",
    "write -z 201k 2k",
    "write -P 0x55 300k 256k",
    "discard 320k 128k",
    "write -z -u 600k 128k",
    "write -P 0x66 1023k 3k",
    "write -P 0x77 3m 2m",
    "discard 3m 1m",
    "write -P 0x78 7m 1m",
];

#[tokio::test]
async fn images_written_by_qemu_io_read_back_identically() {
    qimg_testkit::require_qemu!();
    let shapes = [
        "extended_l2=on,cluster_size=64k",
        "extended_l2=on,cluster_size=128k",
        "extended_l2=on,cluster_size=32k,refcount_bits=1",
        "extended_l2=on,cluster_size=2M",
        "cluster_size=64k",
        "cluster_size=4k,refcount_bits=64",
        "compat=0.10",
    ];
    for opts in shapes {
        for with_backing in [false, true] {
            let dir = Scratch::new("qemu-io");
            let backing = if with_backing {
                // A backing file shorter than the overlay, written by qemu-io too.
                qemu_create(&dir.0, "base.qcow2", "cluster_size=64k", 6 * MIB, None);
                qemu_io(
                    &dir.0,
                    "base.qcow2",
                    &["write -P 0xb1 0 6m", "write -z 1m 64k"],
                );
                Some(("base.qcow2", "qcow2"))
            } else {
                None
            };
            qemu_create(&dir.0, "top.qcow2", opts, 8 * MIB, backing);
            qemu_io(&dir.0, "top.qcow2", QEMU_IO_SCRIPT);
            let expected = qemu_raw(&dir.0, "top.qcow2");
            let got = read_all(&dir.path("top.qcow2")).await;
            assert_eq!(
                first_difference(&got, &expected),
                None,
                "{opts}, backing {with_backing}: qimg reads differently from qemu-img"
            );
        }
    }
}

fn compressible(len: usize) -> Vec<u8> {
    // Text-like runs, some zero clusters, and a stretch of noise that does not compress.
    let mut out = Vec::with_capacity(len);
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    for i in 0..len {
        let block = i / 65536;
        let b = match block % 5 {
            0 | 3 => b"qcow2 subclusters compress well. "[i % 33],
            1 => 0,
            2 => {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            }
            _ => (i / 700) as u8,
        };
        out.push(b);
    }
    out
}

#[tokio::test]
async fn compressed_images_read_back_and_take_writes() {
    qimg_testkit::require_qemu!();
    for (ctype, extra) in [
        ("zlib", ""),
        ("zstd", ""),
        ("zlib", ",extended_l2=on"),
        ("zstd", ",extended_l2=on,cluster_size=32k"),
    ] {
        let what = format!("{ctype}{extra}");
        let dir = Scratch::new("compressed");
        let data = compressible((3 * MIB + 5 * KIB) as usize);
        std::fs::write(dir.path("src.raw"), &data).unwrap();
        let o = format!("compression_type={ctype}{extra}");
        ok(
            "qemu-img convert -c",
            &common::qemu_img(
                &dir.0,
                &[
                    "convert", "-c", "-f", "raw", "-O", "qcow2", "-o", &o, "src.raw", "c.qcow2",
                ],
            ),
        );
        let check = common::qemu_img(&dir.0, &["check", "--output=json", "c.qcow2"]);
        let v: serde_json::Value = serde_json::from_slice(&check.stdout).unwrap();
        let compressed = v["compressed-clusters"].as_u64().unwrap_or(0);
        assert!(
            compressed >= 20,
            "{what}: only {compressed} compressed clusters: {v}"
        );
        let got = read_all(&dir.path("c.qcow2")).await;
        assert_eq!(
            first_difference(&got, &data),
            None,
            "{what}: decompressed data differs"
        );

        // Writes over compressed clusters decompress into fresh clusters; zeroing and
        // discarding whole compressed clusters frees them.
        let mut model = data.clone();
        let img = OpenOptions::new()
            .writable(true)
            .open(dir.path("c.qcow2"))
            .await
            .unwrap();
        let cs = img.cluster_size();
        let patch = pattern(7, 0, 3000);
        for at in [100u64, cs * 3 + 5, cs * 7 - 1500] {
            img.write(&patch, at).await.unwrap();
            model[at as usize..at as usize + patch.len()].copy_from_slice(&patch);
        }
        img.write_zeroes(cs * 10, cs * 2).await.unwrap();
        model[(cs * 10) as usize..(cs * 12) as usize].fill(0);
        img.discard(cs * 14, cs).await.unwrap();
        model[(cs * 14) as usize..(cs * 15) as usize].fill(0);
        let mut back = vec![0u8; model.len()];
        img.read(&mut back, 0).await.unwrap();
        assert_eq!(
            first_difference(&back, &model),
            None,
            "{what}: after writes"
        );
        img.close().await.unwrap();
        assert_clean(&dir.0, "c.qcow2", &what);
        assert_same_as_model(&dir.0, "c.qcow2", &model, &what);
    }
}

#[tokio::test]
async fn clusters_qimg_compresses_check_clean_and_read_back() {
    qimg_testkit::require_qemu!();
    for (opts, size) in [
        ("compression_type=zlib", 3 * MIB + 5 * KIB),
        ("compression_type=zstd", 3 * MIB),
        ("compression_type=zlib,extended_l2=on", 3 * MIB + 5 * KIB),
        (
            "compression_type=zstd,extended_l2=on,cluster_size=32k",
            3 * MIB,
        ),
        ("compat=0.10,cluster_size=4k", 2 * MIB + 512),
    ] {
        let dir = Scratch::new("qimg-compressed");
        qemu_create(&dir.0, "c.qcow2", opts, size, None);
        let data = compressible(size as usize);
        let img = OpenOptions::new()
            .writable(true)
            .open(dir.path("c.qcow2"))
            .await
            .unwrap();
        let cs = img.cluster_size();
        let mut at = 0;
        while at < size {
            let n = cs.min(size - at) as usize;
            let chunk = &data[at as usize..at as usize + n];
            if chunk.iter().any(|&b| b != 0) {
                img.write_compressed(at, chunk).await.unwrap();
            }
            at += cs;
        }
        // Misuse is refused without touching anything.
        assert!(img.write_compressed(1, &data[..cs as usize]).await.is_err());
        assert!(img.write_compressed(0, &data[..100]).await.is_err());
        let mut model = data.clone();
        // Overwrite, recompress, zero and discard some of them: packed host clusters are
        // shared, so each reference must be counted and released exactly once.
        let patch = pattern(3, 0, 5000);
        img.write(&patch, cs + 7).await.unwrap();
        model[(cs + 7) as usize..(cs + 7) as usize + 5000].copy_from_slice(&patch);
        let again = vec![0x5au8; cs as usize];
        img.write_compressed(3 * cs, &again).await.unwrap();
        model[(3 * cs) as usize..(4 * cs) as usize].copy_from_slice(&again);
        img.write_zeroes(5 * cs, 2 * cs).await.unwrap();
        model[(5 * cs) as usize..(7 * cs) as usize].fill(0);
        img.discard(8 * cs, cs).await.unwrap();
        model[(8 * cs) as usize..(9 * cs) as usize].fill(0);
        let mut back = vec![0u8; model.len()];
        img.read(&mut back, 0).await.unwrap();
        assert_eq!(first_difference(&back, &model), None, "{opts}: read back");
        img.close().await.unwrap();
        assert_clean(&dir.0, "c.qcow2", opts);
        assert_same_as_model(&dir.0, "c.qcow2", &model, opts);
        let v = info(&dir.0, "c.qcow2");
        let check = common::qemu_img(&dir.0, &["check", "--output=json", "c.qcow2"]);
        let c: serde_json::Value = serde_json::from_slice(&check.stdout).unwrap();
        let compressed = c["compressed-clusters"].as_u64().unwrap_or(0);
        assert!(compressed >= 10, "{opts}: {compressed} compressed: {c}");
        let used = v["actual-size"].as_u64().unwrap_or(u64::MAX);
        assert!(used < size, "{opts}: {used} bytes on disk for {size}");
    }
}

#[tokio::test]
async fn clusters_shared_with_an_internal_snapshot_are_never_written_in_place() {
    qimg_testkit::require_qemu!();
    for opts in ["cluster_size=64k", "extended_l2=on,cluster_size=64k"] {
        let dir = Scratch::new("snapshot");
        qemu_create(&dir.0, "s.qcow2", opts, 4 * MIB, None);
        qemu_io(
            &dir.0,
            "s.qcow2",
            &["write -P 0x5a 0 4m", "write -z 1m 64k"],
        );
        ok(
            "qemu-img snapshot -c",
            &common::qemu_img(&dir.0, &["snapshot", "-c", "before", "s.qcow2"]),
        );
        let before = qemu_raw(&dir.0, "s.qcow2");
        let img = OpenOptions::new()
            .writable(true)
            .open(dir.path("s.qcow2"))
            .await
            .unwrap();
        let mut model = before.clone();
        for (i, at) in [0u64, 70 * KIB, 2 * MIB + 3, 4 * MIB - 4 * KIB]
            .into_iter()
            .enumerate()
        {
            let data = pattern(i as u64, at, 4096);
            img.write(&data, at).await.unwrap();
            model[at as usize..at as usize + 4096].copy_from_slice(&data);
        }
        img.discard(3 * MIB, 64 * KIB).await.unwrap();
        model[(3 * MIB) as usize..(3 * MIB + 64 * KIB) as usize].fill(0);
        img.close().await.unwrap();
        assert_clean(&dir.0, "s.qcow2", opts);
        assert_same_as_model(&dir.0, "s.qcow2", &model, opts);
        // The snapshot still holds the old contents.
        ok(
            "qemu-img convert -l",
            &common::qemu_img(
                &dir.0,
                &[
                    "convert",
                    "-l",
                    "snapshot.name=before",
                    "-O",
                    "raw",
                    "s.qcow2",
                    "snap.raw",
                ],
            ),
        );
        let snap = std::fs::read(dir.path("snap.raw")).unwrap();
        assert_eq!(
            first_difference(&snap, &before),
            None,
            "{opts}: snapshot changed"
        );
    }
}

#[tokio::test]
async fn external_data_files_are_written_in_place() {
    qimg_testkit::require_qemu!();
    for raw in ["off", "on"] {
        let dir = Scratch::new("datafile");
        let opts = format!("data_file=d.raw,data_file_raw={raw},extended_l2=on");
        qemu_create(&dir.0, "x.qcow2", &opts, 2 * MIB, None);
        qemu_io(&dir.0, "x.qcow2", &["write -P 0x21 0 100k"]);
        let mut model = qemu_raw(&dir.0, "x.qcow2");
        let img = OpenOptions::new()
            .writable(true)
            .open(dir.path("x.qcow2"))
            .await
            .unwrap();
        let data = pattern(3, 0, 5000);
        img.write(&data, 150_000).await.unwrap();
        model[150_000..155_000].copy_from_slice(&data);
        img.write_zeroes(0, 64 * KIB).await.unwrap();
        model[..64 * KIB as usize].fill(0);
        img.close().await.unwrap();
        assert_clean(&dir.0, "x.qcow2", &opts);
        assert_same_as_model(&dir.0, "x.qcow2", &model, &opts);
        if raw == "on" {
            // The data file alone is the disk.
            let d = std::fs::read(dir.path("d.raw")).unwrap();
            assert_eq!(
                first_difference(&d[..model.len()], &model),
                None,
                "raw data file"
            );
        }
    }
}

#[tokio::test]
async fn map_extents_point_at_the_bytes_a_read_returns() {
    qimg_testkit::require_qemu!();
    for opts in ["extended_l2=on,cluster_size=64k", "cluster_size=64k"] {
        let dir = Scratch::new("map");
        qemu_create(&dir.0, "base.qcow2", "cluster_size=64k", 6 * MIB, None);
        qemu_io(&dir.0, "base.qcow2", &["write -P 0xb1 0 6m"]);
        qemu_create(
            &dir.0,
            "top.qcow2",
            opts,
            8 * MIB,
            Some(("base.qcow2", "qcow2")),
        );
        qemu_io(&dir.0, "top.qcow2", QEMU_IO_SCRIPT);
        let img = OpenOptions::new()
            .open(dir.path("top.qcow2"))
            .await
            .unwrap();
        let extents = img.map(0, img.size()).await.unwrap();
        let file = std::fs::read(dir.path("top.qcow2")).unwrap();
        let mut covered = 0;
        let mut data_extents = 0;
        for e in &extents {
            assert_eq!(e.start, covered, "{opts}: extents must tile the range");
            covered += e.length;
            let mut guest = vec![0u8; e.length as usize];
            img.read(&mut guest, e.start).await.unwrap();
            match e.kind {
                qimg::ExtentKind::Data { host_offset } => {
                    data_extents += 1;
                    let host = &file[host_offset as usize..(host_offset + e.length) as usize];
                    assert!(
                        host == guest.as_slice(),
                        "{opts}: data extent {e:?} maps elsewhere"
                    );
                }
                qimg::ExtentKind::Zero { .. } => {
                    assert!(
                        guest.iter().all(|&b| b == 0),
                        "{opts}: zero extent {e:?} is not zero"
                    )
                }
                _ => {}
            }
        }
        assert_eq!(covered, img.size());
        assert!(
            data_extents >= 5,
            "{opts}: only {data_extents} data extents"
        );
        // qemu-img map agrees on where the top image's own data is.
        let v = common::json(
            "qemu-img map",
            &common::qemu_img(&dir.0, &["map", "--output=json", "top.qcow2"]),
        );
        for q in v.as_array().unwrap() {
            if q["depth"] == 0 && q["data"] == true {
                let start = q["start"].as_u64().unwrap();
                let len = q["length"].as_u64().unwrap();
                let off = q["offset"].as_u64().unwrap();
                let mine = img.map(start, len).await.unwrap();
                let mut pos = start;
                for e in mine {
                    let qimg::ExtentKind::Data { host_offset } = e.kind else {
                        panic!("{opts}: qemu maps {start:#x}+{len:#x} as data, qimg says {e:?}");
                    };
                    assert_eq!(host_offset, off + (pos - start), "{opts}: {e:?}");
                    pos += e.length;
                }
            }
        }
    }
}

/// Allocating writes past the end of the file reserve space ahead in steps (one `fallocate`
/// for many clusters); close cuts the unused tail off, so the file ends where `qemu-img check`
/// says the image ends. A tail left by a crash (reserved, never trimmed) is harmless: the
/// image checks clean and its clusters are used by later allocations.
#[tokio::test]
async fn space_reserved_ahead_is_cut_off_at_close() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("reserve-ahead");
    qemu_create(
        &dir.0,
        "r.qcow2",
        "extended_l2=on,cluster_size=64k",
        64 * MIB,
        None,
    );
    let path = dir.path("r.qcow2");
    let file_len = || std::fs::metadata(&path).unwrap().len();
    let mut model = vec![0u8; (64 * MIB) as usize];
    let img = OpenOptions::new().writable(true).open(&path).await.unwrap();
    for k in 0..20u64 {
        let at = k * 3 * 64 * KIB + 8 * KIB;
        let data = vec![k as u8 + 1; 4096];
        img.write(&data, at).await.unwrap();
        model[at as usize..at as usize + 4096].copy_from_slice(&data);
    }
    img.flush().await.unwrap();
    let reserved = file_len();
    img.close().await.unwrap();
    let closed = file_len();
    let check = json(
        "qemu-img check",
        &qemu_img(&dir.0, &["check", "--output=json", "r.qcow2"]),
    );
    let end = check["image-end-offset"].as_u64().unwrap();
    assert_eq!(closed, end, "the file ends where the image ends: {check}");
    // 20 clusters of data and an L2 table: far less than one reservation step (32 MiB).
    assert!(
        reserved >= closed + 4 * MIB,
        "nothing was reserved ahead: {reserved} bytes before close, {closed} after"
    );
    assert_clean(&dir.0, "r.qcow2", "after close");
    assert_same_as_model(&dir.0, "r.qcow2", &model, "after close");

    // A crash after a reservation: the tail stays; reopening and writing uses it.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(closed + 8 * MIB)
        .unwrap();
    assert_clean(&dir.0, "r.qcow2", "with a reserved tail");
    let img = OpenOptions::new().writable(true).open(&path).await.unwrap();
    for k in 0..10u64 {
        let at = 32 * MIB + k * 64 * KIB;
        let data = vec![0xa0 + k as u8; 8192];
        img.write(&data, at).await.unwrap();
        model[at as usize..at as usize + 8192].copy_from_slice(&data);
    }
    img.close().await.unwrap();
    assert!(
        file_len() <= closed + 8 * MIB,
        "the new clusters went into the tail, not past it ({} bytes)",
        file_len()
    );
    assert_clean(&dir.0, "r.qcow2", "after writing into the tail");
    assert_same_as_model(&dir.0, "r.qcow2", &model, "after writing into the tail");
}

/// A new cluster that has never held data reads as zeros, so copy-on-write parts that would
/// only copy zeros into it (no backing file, zero clusters) are not written; a cluster reused
/// inside the file, or parts that come from a backing file, are still copied.
#[tokio::test]
async fn zeros_are_not_copied_into_clusters_that_never_held_data() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("zero-cow");
    qemu_create(&dir.0, "z.qcow2", "cluster_size=64k", 16 * MIB, None);
    std::fs::write(dir.path("base.raw"), vec![0x3cu8; (16 * MIB) as usize]).unwrap();
    qemu_create(
        &dir.0,
        "b.qcow2",
        "cluster_size=64k",
        16 * MIB,
        Some(("base.raw", "raw")),
    );
    let mut model = vec![0u8; (16 * MIB) as usize];
    let img = OpenOptions::new()
        .writable(true)
        .open(dir.path("z.qcow2"))
        .await
        .unwrap();
    for k in 0..8u64 {
        let at = k * 64 * KIB + 8 * KIB;
        img.write(&[k as u8 + 1; 4096], at).await.unwrap();
        model[at as usize..at as usize + 4096].fill(k as u8 + 1);
    }
    assert_eq!(img.stats().await.cow_bytes, 0, "zeros were copied");
    // A cluster freed and reused inside the file may still hold old bytes: copied.
    img.write(&[0xee; 65536], 8 * 64 * KIB).await.unwrap();
    img.discard(8 * 64 * KIB, 64 * KIB).await.unwrap();
    img.flush().await.unwrap();
    img.write(&[0x77; 4096], 12 * 64 * KIB).await.unwrap();
    model[(12 * 64 * KIB) as usize..(12 * 64 * KIB + 4096) as usize].fill(0x77);
    assert_eq!(
        img.stats().await.cow_bytes,
        60 * KIB,
        "a reused cluster was not copied"
    );
    img.close().await.unwrap();
    assert_clean(&dir.0, "z.qcow2", "no backing");
    assert_same_as_model(&dir.0, "z.qcow2", &model, "no backing");

    // Over a backing file the parts around the guest bytes come from it: copied.
    let img = OpenOptions::new()
        .writable(true)
        .open(dir.path("b.qcow2"))
        .await
        .unwrap();
    img.write(&[0x11; 4096], 8 * KIB).await.unwrap();
    assert_eq!(img.stats().await.cow_bytes, 60 * KIB);
    img.close().await.unwrap();
    let mut model = vec![0x3cu8; (16 * MIB) as usize];
    model[(8 * KIB) as usize..(12 * KIB) as usize].fill(0x11);
    assert_clean(&dir.0, "b.qcow2", "raw backing");
    assert_same_as_model(&dir.0, "b.qcow2", &model, "raw backing");
}

/// `qemu-img map --output=json` of `file`.
fn map_json(dir: &Path, file: &str) -> String {
    String::from_utf8(
        qemu_img(dir, &["map", "--output=json", file])
            .stdout
            .clone(),
    )
    .unwrap()
}

/// Write-zeroes without unmap keeps the host clusters (preallocation survives, as with
/// qemu-io's `write -z`): the same map as qemu-io leaves, 100 % allocated, and later writes
/// land in place; with unmap (`write -z -u`) the space goes, as with qemu-io.
#[tokio::test]
async fn write_zeroes_without_unmap_keeps_preallocation_as_qemu_does() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("zero-keep");
    for opts in [
        "preallocation=falloc",
        "preallocation=falloc,extended_l2=on",
        "preallocation=metadata,cluster_size=4k",
    ] {
        for unmap in [false, true] {
            qemu_create(&dir.0, "q.qcow2", opts, 8 * MIB, None);
            qemu_create(&dir.0, "m.qcow2", opts, 8 * MIB, None);
            let z = if unmap { "write -z -u" } else { "write -z" };
            qemu_io(
                &dir.0,
                "q.qcow2",
                &[&format!("{z} 0 8M"), &format!("{z} 64k 128k")],
            );
            let img = OpenOptions::new()
                .writable(true)
                .open(dir.path("m.qcow2"))
                .await
                .unwrap();
            for (at, len) in [(0, 8 * MIB), (64 * KIB, 128 * KIB)] {
                match unmap {
                    true => img.write_zeroes_unmap(at, len).await.unwrap(),
                    false => img.write_zeroes(at, len).await.unwrap(),
                }
            }
            img.close().await.unwrap();
            let what = format!("{opts}, unmap {unmap}");
            assert_clean(&dir.0, "m.qcow2", &what);
            assert_eq!(
                map_json(&dir.0, "m.qcow2"),
                map_json(&dir.0, "q.qcow2"),
                "{what}: qemu-img map differs from qemu-io's"
            );
            // Writes after it reuse the kept clusters: the file does not grow.
            let len = std::fs::metadata(dir.path("m.qcow2")).unwrap().len();
            let img = OpenOptions::new()
                .writable(true)
                .open(dir.path("m.qcow2"))
                .await
                .unwrap();
            img.write(&pattern(5, 0, 8 * MIB as usize), 0)
                .await
                .unwrap();
            img.close().await.unwrap();
            if !unmap {
                assert_eq!(
                    std::fs::metadata(dir.path("m.qcow2")).unwrap().len(),
                    len,
                    "{what}: writes over kept clusters grew the file"
                );
            }
            assert_clean(&dir.0, "m.qcow2", &what);
        }
    }
}

/// A guest's discard over a backing file reads zeros afterwards (QEMU sets the zero flag),
/// never the backing file's old data: standard and extended L2, v3 and v2, whole clusters
/// and single subclusters; `qemu-img compare` with the model.
#[tokio::test]
async fn discard_over_a_backing_file_reads_zeros() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("discard-backing");
    qemu_create(&dir.0, "base.qcow2", "compat=1.1", 4 * MIB, None);
    qemu_io(&dir.0, "base.qcow2", &["write -P 0x77 0 4M"]);
    for opts in ["compat=1.1", "extended_l2=on", "compat=0.10"] {
        qemu_create(
            &dir.0,
            "top.qcow2",
            opts,
            4 * MIB,
            Some(("base.qcow2", "qcow2")),
        );
        let mut model = vec![0x77u8; 4 * MIB as usize];
        let img = OpenOptions::new()
            .writable(true)
            .open(dir.path("top.qcow2"))
            .await
            .unwrap();
        let data = pattern(9, 0, MIB as usize);
        img.write(&data, 0).await.unwrap();
        model[..MIB as usize].copy_from_slice(&data);
        // Whole clusters, written and not; then a part (a 2 KiB subcluster with extended L2,
        // nothing of a 64 KiB cluster without).
        img.discard(0, 512 * KIB).await.unwrap();
        model[..512 * KIB as usize].fill(0);
        img.discard(2 * MIB, 256 * KIB).await.unwrap();
        model[2 * MIB as usize..2 * MIB as usize + 256 * KIB as usize].fill(0);
        img.discard(600 * KIB, 2 * KIB).await.unwrap();
        if opts == "extended_l2=on" {
            model[600 * KIB as usize..602 * KIB as usize].fill(0);
        }
        let mut back = vec![0u8; 4 * MIB as usize];
        img.read(&mut back, 0).await.unwrap();
        assert_eq!(first_difference(&back, &model), None, "{opts}: read back");
        img.close().await.unwrap();
        assert_clean(&dir.0, "top.qcow2", opts);
        assert_same_as_model(&dir.0, "top.qcow2", &model, opts);
    }
}

/// Clusters freed by a discard are reused by the next writes without a flush in between
/// (the free is made durable first, when reuse would otherwise grow the file): discard and
/// rewrite the same 4 MiB five times, as qemu-io does, and the file stays put.
#[tokio::test]
async fn freed_clusters_are_reused_before_the_next_flush() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("reuse-freed");
    qemu_create(&dir.0, "a.qcow2", "compat=1.1", 64 * MIB, None);
    let img = OpenOptions::new()
        .writable(true)
        .open(dir.path("a.qcow2"))
        .await
        .unwrap();
    img.write(&pattern(1, 0, 4 * MIB as usize), 0)
        .await
        .unwrap();
    img.flush().await.unwrap();
    let len = std::fs::metadata(dir.path("a.qcow2")).unwrap().len();
    for round in 0..5u64 {
        img.discard(0, 4 * MIB).await.unwrap();
        // Elsewhere, so that nothing is overwritten in place.
        let at = (round % 2 + 1) * 8 * MIB;
        img.write(&pattern(round + 2, at, 4 * MIB as usize), at)
            .await
            .unwrap();
        img.discard(at, 4 * MIB).await.unwrap();
        img.write(&pattern(round + 9, 0, 4 * MIB as usize), 0)
            .await
            .unwrap();
    }
    img.close().await.unwrap();
    let grown = std::fs::metadata(dir.path("a.qcow2")).unwrap().len();
    // One L2 table for each of the two other areas is all that may be new.
    assert!(
        grown <= len + 2 * 64 * KIB,
        "the file grew from {len} to {grown} bytes"
    );
    assert_clean(&dir.0, "a.qcow2", "reuse");
}

/// A 3 MiB write to an empty image lands as QEMU puts it: the new L2 table first, then the
/// data as one host extent (`qemu-img map` equal to qemu-io's, offsets included).
#[tokio::test]
async fn a_fresh_write_maps_as_one_extent_after_its_l2_table() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("l2-first");
    for opts in ["cluster_size=64k", "cluster_size=64k,extended_l2=on"] {
        qemu_create(&dir.0, "q.qcow2", opts, 64 * MIB, None);
        qemu_create(&dir.0, "m.qcow2", opts, 64 * MIB, None);
        qemu_io(&dir.0, "q.qcow2", &["write -P 1 0 3M"]);
        let img = OpenOptions::new()
            .writable(true)
            .open(dir.path("m.qcow2"))
            .await
            .unwrap();
        img.write(&vec![1u8; 3 * MIB as usize], 0).await.unwrap();
        img.close().await.unwrap();
        assert_clean(&dir.0, "m.qcow2", opts);
        let map = map_json(&dir.0, "m.qcow2");
        assert_eq!(map, map_json(&dir.0, "q.qcow2"), "{opts}");
        assert_eq!(
            map.lines().filter(|l| l.contains("\"data\": true")).count(),
            1,
            "{map}"
        );
    }
}

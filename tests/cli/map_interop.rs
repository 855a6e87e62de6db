//! `qimg map` against `qemu-img map`: the same JSON (byte for byte) and human output over a
//! matrix of images made by qemu-img/qemu-io and by the qimg library at test time: data,
//! zero and discarded clusters, subclusters, every preallocation mode, compressed clusters
//! (zlib, zstd), backing chains up to three deep with shorter backing files, raw images with
//! holes, external data files, internal snapshots, offsets and lengths; damaged images fail
//! cleanly.

use crate::common;

use std::path::Path;
use std::process::Output;

use common::{Scratch, ok, qemu_img, qimg};

use common::qemu_img_create as create;
use common::qemu_io;
use qimg_testkit::pattern;

fn text(o: &Output) -> (String, String, Option<i32>) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
        o.status.code(),
    )
}

/// Asserts `qimg map ARGS` prints exactly what `qemu-img map ARGS` prints (JSON parsed and as
/// text); returns the number of entries.
fn same_json(dir: &Path, name: &str, args: &[&str]) -> usize {
    let mut q = vec!["map", "--output=json"];
    q.extend(args);
    let mut m = vec!["map", "--output", "json"];
    m.extend(args);
    let want = qemu_img(dir, &q);
    let got = qimg(dir, &m);
    let want_s = ok(&format!("qemu-img map ({name})"), &want);
    let got_s = ok(&format!("qimg map ({name})"), &got);
    let a: serde_json::Value = serde_json::from_str(&want_s).unwrap();
    let b: serde_json::Value = serde_json::from_str(&got_s)
        .unwrap_or_else(|e| panic!("{name}: qimg map printed bad JSON ({e}):\n{got_s}"));
    assert_eq!(
        a, b,
        "{name}: map differs\nqemu-img:\n{want_s}\nqimg:\n{got_s}"
    );
    assert_eq!(want_s, got_s, "{name}: same JSON, different text");
    a.as_array().map_or(0, Vec::len)
}

/// Asserts the human output (and for a failure, the exit code and message) is qemu-img's.
fn same_human(dir: &Path, name: &str, file: &str) {
    let (qo, qe, qc) = text(&qemu_img(dir, &["map", file]));
    let (io, ie, ic) = text(&qimg(dir, &["map", file]));
    assert_eq!(qo, io, "{name}: human map differs");
    assert_eq!(qc, ic, "{name}: exit code differs ({qe} / {ie})");
    if qc != Some(0) {
        assert_eq!(
            qe.trim_start_matches("qemu-img: "),
            ie.trim_start_matches("qimg: "),
            "{name}: error message differs"
        );
    }
}

/// Writes through the qimg library: (offset, len) data, zeroes and discards.
fn qimg_writes(path: &Path, data: &[(u64, usize)], zeroes: &[(u64, u64)], discards: &[(u64, u64)]) {
    let img = qimg::OpenOptions::new()
        .writable(true)
        .open_blocking(path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    for (i, &(off, len)) in data.iter().enumerate() {
        img.write(&pattern(i as u64 + 1, off, len), off).unwrap();
    }
    for &(off, len) in zeroes {
        img.write_zeroes(off, len).unwrap();
    }
    for &(off, len) in discards {
        img.discard(off, len).unwrap();
    }
    img.close().unwrap();
}

/// Builds one image of the matrix in `dir`; returns the file to map.
type Build = fn(&Path) -> &'static str;

fn cases() -> Vec<(&'static str, Build)> {
    vec![
        ("empty", |d| {
            create(d, "qcow2", "", &[], "a.qcow2", "64M");
            "a.qcow2"
        }),
        ("size0", |d| {
            create(d, "qcow2", "", &[], "a.qcow2", "0");
            "a.qcow2"
        }),
        ("standard-patterns", |d| {
            create(d, "qcow2", "", &[], "a.qcow2", "64M");
            qemu_io(
                d,
                "qcow2",
                "a.qcow2",
                &[
                    "write -P 1 0 64k",
                    "write -P 2 64k 64k",
                    "write -z 128k 128k",
                    "write -P 3 1M 4k",
                    "write -P 4 2M 1M",
                    "discard 2176k 128k",
                    "write -P 5 63M 1M",
                    "write -z 40M 64k",
                ],
            );
            "a.qcow2"
        }),
        ("cow-zero-ranges", |d| {
            // Partial-cluster writes make qemu zero the rest of each cluster with
            // FALLOC_FL_ZERO_RANGE, and compressed clusters share host clusters: the file
            // holds fewer blocks than it refcounts, so qemu treats the image as metadata
            // preallocated and reports the unwritten parts of data clusters as zeros.
            create(d, "qcow2", "", &[], "a.qcow2", "8M");
            qemu_io(
                d,
                "qcow2",
                "a.qcow2",
                &[
                    "write -P 5 5261824 65536",
                    "write -c -P 3 4521984 65536",
                    "write -P 5 144384 102400",
                    "write -z 5462016 8192",
                    "write -P 5 7580160 8192",
                    "write -P 7 941056 4096",
                    "write -c -P 3 4194304 65536",
                    "discard 5681152 8192",
                    "write -P 9 6209536 65536",
                ],
            );
            "a.qcow2"
        }),
        ("cs512", |d| {
            create(d, "qcow2", "cluster_size=512", &[], "a.qcow2", "4M");
            qemu_io(
                d,
                "qcow2",
                "a.qcow2",
                &[
                    "write -P 1 0 1536",
                    "write -z 2k 1k",
                    "write -P 2 1M 700",
                    "write -P 3 3M 64k",
                ],
            );
            "a.qcow2"
        }),
        ("cs2M", |d| {
            create(d, "qcow2", "cluster_size=2M", &[], "a.qcow2", "64M");
            qemu_io(
                d,
                "qcow2",
                "a.qcow2",
                &["write -P 1 4k 4k", "write -z 4M 2M", "write -P 2 10M 3M"],
            );
            "a.qcow2"
        }),
        ("ext-64k", |d| {
            create(d, "qcow2", "extended_l2=on", &[], "a.qcow2", "16M");
            qemu_io(
                d,
                "qcow2",
                "a.qcow2",
                &[
                    "write -P 1 0 2k",
                    "write -P 2 6k 6k",
                    "write -z 16k 4k",
                    "write -P 3 64k 64k",
                    "write -z 72k 8k",
                    "write -z 1M 2k",
                    "write -P 4 8M 100k",
                ],
            );
            "a.qcow2"
        }),
        ("ext-128k-alloc-states", |d| {
            create(
                d,
                "qcow2",
                "extended_l2=on,cluster_size=128k",
                &[],
                "a.qcow2",
                "8M",
            );
            // Partial writes leave unallocated subclusters in allocated clusters (qemu
            // reports their reserved offsets); write -z on allocated ones gives zero+alloc.
            qemu_io(
                d,
                "qcow2",
                "a.qcow2",
                &[
                    "write -P 1 0 4k",
                    "write -P 1 8k 8k",
                    "write -z 16k 4k",
                    "write -P 5 128k 128k",
                    "write -z 136k 8k",
                    "discard 512k 128k",
                    "write -P 6 1M 12k",
                ],
            );
            "a.qcow2"
        }),
        ("prealloc-metadata", |d| {
            create(d, "qcow2", "preallocation=metadata", &[], "a.qcow2", "4M");
            qemu_io(
                d,
                "qcow2",
                "a.qcow2",
                &[
                    "write -P 1 64k 4k",
                    "write -z 256k 64k",
                    "write -P 2 3M 200k",
                ],
            );
            "a.qcow2"
        }),
        ("prealloc-metadata-ext", |d| {
            create(
                d,
                "qcow2",
                "preallocation=metadata,extended_l2=on",
                &[],
                "a.qcow2",
                "4M",
            );
            qemu_io(
                d,
                "qcow2",
                "a.qcow2",
                &["write -P 1 64k 4k", "write -z 256k 64k"],
            );
            "a.qcow2"
        }),
        ("prealloc-falloc", |d| {
            create(d, "qcow2", "preallocation=falloc", &[], "a.qcow2", "4M");
            qemu_io(
                d,
                "qcow2",
                "a.qcow2",
                &["write -P 1 64k 4k", "write -z 1M 64k"],
            );
            "a.qcow2"
        }),
        ("prealloc-full-ext", |d| {
            create(
                d,
                "qcow2",
                "preallocation=full,extended_l2=on,cluster_size=32k",
                &[],
                "a.qcow2",
                "2M",
            );
            qemu_io(
                d,
                "qcow2",
                "a.qcow2",
                &["write -P 1 33k 2k", "write -z 64k 1k"],
            );
            "a.qcow2"
        }),
        ("compressed-zlib", |d| {
            create(d, "qcow2", "", &[], "s.qcow2", "8M");
            qemu_io(
                d,
                "qcow2",
                "s.qcow2",
                &[
                    "write -P 1 0 16k",
                    "write -P 2 128k 256k",
                    "write -P 3 5M 64k",
                ],
            );
            ok(
                "convert -c",
                &qemu_img(d, &["convert", "-c", "-O", "qcow2", "s.qcow2", "a.qcow2"]),
            );
            qemu_io(d, "qcow2", "a.qcow2", &["write -P 9 192k 4k"]);
            "a.qcow2"
        }),
        ("compressed-zstd-ext", |d| {
            create(
                d,
                "qcow2",
                "compression_type=zstd,extended_l2=on",
                &[],
                "a.qcow2",
                "8M",
            );
            qemu_io(
                d,
                "qcow2",
                "a.qcow2",
                &[
                    "write -c -P 1 0 64k",
                    "write -c -P 2 64k 64k",
                    "write -P 3 1M 4k",
                ],
            );
            "a.qcow2"
        }),
        ("chain-2", |d| {
            create(d, "qcow2", "", &[], "base.qcow2", "16M");
            qemu_io(
                d,
                "qcow2",
                "base.qcow2",
                &["write -P 1 0 1M", "write -z 4M 1M", "write -P 2 8M 64k"],
            );
            create(
                d,
                "qcow2",
                "",
                &["-b", "base.qcow2", "-F", "qcow2"],
                "a.qcow2",
                "",
            );
            qemu_io(
                d,
                "qcow2",
                "a.qcow2",
                &[
                    "write -P 3 64k 64k",
                    "write -z 512k 64k",
                    "write -P 4 8M 64k",
                ],
            );
            "a.qcow2"
        }),
        ("chain-3-shorter-backings", |d| {
            create(d, "raw", "", &[], "base.raw", "1M");
            qemu_io(d, "raw", "base.raw", &["write -P 7 128k 64k"]);
            create(
                d,
                "qcow2",
                "",
                &["-b", "base.raw", "-F", "raw"],
                "mid.qcow2",
                "2M",
            );
            qemu_io(
                d,
                "qcow2",
                "mid.qcow2",
                &["write -P 8 0 64k", "write -z 1536k 64k"],
            );
            create(
                d,
                "qcow2",
                "extended_l2=on",
                &["-b", "mid.qcow2", "-F", "qcow2"],
                "a.qcow2",
                "4M",
            );
            qemu_io(
                d,
                "qcow2",
                "a.qcow2",
                &["write -P 9 4k 4k", "write -z 3M 4k", "write -P 1 2044k 8k"],
            );
            "a.qcow2"
        }),
        ("chain-ext-over-ext", |d| {
            create(d, "qcow2", "extended_l2=on", &[], "base.qcow2", "8M");
            qemu_io(
                d,
                "qcow2",
                "base.qcow2",
                &["write -P 1 0 256k", "write -z 1M 64k"],
            );
            create(
                d,
                "qcow2",
                "extended_l2=on",
                &["-b", "base.qcow2", "-F", "qcow2"],
                "a.qcow2",
                "",
            );
            qemu_io(
                d,
                "qcow2",
                "a.qcow2",
                &["write -P 2 2k 2k", "write -z 66k 2k", "write -P 3 1M 4k"],
            );
            "a.qcow2"
        }),
        ("v2", |d| {
            create(d, "qcow2", "compat=0.10", &[], "a.qcow2", "8M");
            qemu_io(
                d,
                "qcow2",
                "a.qcow2",
                &["write -P 1 0 64k", "write -z 64k 64k", "write -P 2 1M 1k"],
            );
            "a.qcow2"
        }),
        ("data-file", |d| {
            create(d, "qcow2", "data_file=a.data", &[], "a.qcow2", "4M");
            qemu_io(
                d,
                "qcow2",
                "a.qcow2",
                &["write -P 1 64k 4k", "write -z 256k 64k", "write -P 2 1M 1M"],
            );
            "a.qcow2"
        }),
        ("data-file-raw", |d| {
            create(
                d,
                "qcow2",
                "data_file=a.data,data_file_raw=on",
                &[],
                "a.qcow2",
                "4M",
            );
            qemu_io(
                d,
                "qcow2",
                "a.qcow2",
                &["write -P 1 64k 4k", "write -z 256k 64k"],
            );
            "a.qcow2"
        }),
        ("snapshot-shared", |d| {
            create(d, "qcow2", "", &[], "a.qcow2", "8M");
            qemu_io(d, "qcow2", "a.qcow2", &["write -P 1 0 1M"]);
            ok(
                "snapshot",
                &qemu_img(d, &["snapshot", "-c", "s1", "a.qcow2"]),
            );
            qemu_io(
                d,
                "qcow2",
                "a.qcow2",
                &["write -P 2 128k 64k", "write -z 512k 64k"],
            );
            "a.qcow2"
        }),
        ("raw-holes", |d| {
            create(d, "raw", "", &[], "a.raw", "8M");
            qemu_io(
                d,
                "raw",
                "a.raw",
                &["write -P 1 1M 64k", "write -P 2 7M 1M", "write -z 1M 4k"],
            );
            "a.raw"
        }),
        ("raw-odd-size", |d| {
            std::fs::write(d.join("a.raw"), pattern(5, 0, 1000)).unwrap();
            "a.raw"
        }),
        ("qimg-made-ext", |d| {
            let o = qimg(
                d,
                &[
                    "create",
                    "-q",
                    "-f",
                    "qcow2",
                    "-o",
                    "extended_l2=on,cluster_size=128k",
                    "a.qcow2",
                    "16M",
                ],
            );
            ok("qimg create", &o);
            qimg_writes(
                &d.join("a.qcow2"),
                &[
                    (0, 4096),
                    (12 << 10, 20 << 10),
                    (1 << 20, 300 << 10),
                    (9 << 20, 1),
                ],
                &[(4 << 20, 1 << 20), (1 << 20, 8192)],
                &[(1_179_648, 65536)],
            );
            "a.qcow2"
        }),
        ("qimg-made-standard", |d| {
            ok(
                "qimg create",
                &qimg(d, &["create", "-q", "-f", "qcow2", "a.qcow2", "16M"]),
            );
            qimg_writes(
                &d.join("a.qcow2"),
                &[(0, 65536), (200 << 10, 100 << 10), (15 << 20, 4096)],
                &[(2 << 20, 2 << 20)],
                &[(0, 65536)],
            );
            "a.qcow2"
        }),
        ("qimg-overlay", |d| {
            create(d, "qcow2", "", &[], "base.qcow2", "8M");
            qemu_io(
                d,
                "qcow2",
                "base.qcow2",
                &["write -P 1 0 2M", "write -z 4M 1M"],
            );
            ok(
                "qimg create",
                &qimg(
                    d,
                    &[
                        "create",
                        "-q",
                        "-f",
                        "qcow2",
                        "-o",
                        "extended_l2=on",
                        "-b",
                        "base.qcow2",
                        "-F",
                        "qcow2",
                        "a.qcow2",
                    ],
                ),
            );
            qimg_writes(
                &d.join("a.qcow2"),
                &[(2048, 2048), (1 << 20, 70_000)],
                &[(4 << 20, 64 << 10), (6 << 20, 1 << 20)],
                &[],
            );
            "a.qcow2"
        }),
    ]
}

#[test]
fn json_matches_qemu_img_over_the_matrix() {
    qimg_testkit::require_qemu!();
    let cases = cases();
    assert!(cases.len() >= 15);
    let mut entries = 0;
    for (name, build) in cases {
        let s = Scratch::new(&format!("map-{name}"));
        let file = build(&s.0);
        entries += same_json(&s.0, name, &[file]);
        // The same through -f, -U and a window of the disk.
        let fmt = if file.ends_with(".raw") {
            "raw"
        } else {
            "qcow2"
        };
        same_json(&s.0, name, &["-f", fmt, "-U", file]);
        same_json(
            &s.0,
            name,
            &["--start-offset", "12345", "--max-length", "3M", file],
        );
    }
    assert!(entries > 60, "the matrix compared only {entries} entries");
}

#[test]
fn human_output_matches_qemu_img() {
    qimg_testkit::require_qemu!();
    let wanted = [
        "standard-patterns",
        "cow-zero-ranges",
        "ext-128k-alloc-states",
        "prealloc-metadata",
        "chain-3-shorter-backings",
        "data-file",
        "raw-holes",
        "compressed-zlib",
        "size0",
        "qimg-overlay",
    ];
    for (name, build) in cases().into_iter().filter(|(n, _)| wanted.contains(n)) {
        let s = Scratch::new(&format!("maph-{name}"));
        let file = build(&s.0);
        same_human(&s.0, name, file);
    }
}

#[test]
fn a_qcow2_file_mapped_as_raw() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("map-as-raw");
    create(&s.0, "qcow2", "", &[], "a.qcow2", "4M");
    qemu_io(&s.0, "qcow2", "a.qcow2", &["write -P 1 1M 64k"]);
    same_json(&s.0, "as-raw", &["-f", "raw", "a.qcow2"]);
}

#[test]
fn bad_arguments_and_damaged_images_fail_cleanly() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("map-bad");
    let d = &s.0;
    let fails = |args: &[&str], needle: &str| {
        let o = qimg(d, args);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err:?} lacks {needle:?}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    };
    fails(
        &["map", "missing.qcow2"],
        "Could not open 'missing.qcow2': No such file or directory",
    );
    create(d, "qcow2", "", &[], "a.qcow2", "64M");
    qemu_io(d, "qcow2", "a.qcow2", &["write -P 1 0 64k"]);
    fails(&["map", "--output=xml", "a.qcow2"], "--output expects");
    fails(&["map", "-f", "vmdk", "a.qcow2"], "Unknown driver 'vmdk'");
    fails(
        &["map", "--start-offset", "-5", "a.qcow2"],
        "Invalid start offset",
    );

    let l1 = {
        let h = std::fs::read(d.join("a.qcow2")).unwrap();
        u64::from_be_bytes(h[40..48].try_into().unwrap())
    };
    let poke = |name: &str, entry: u64| {
        std::fs::copy(d.join("a.qcow2"), d.join(name)).unwrap();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(d.join(name))
            .unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &entry.to_be_bytes(), l1).unwrap();
    };
    // An unaligned L2 table offset: both refuse.
    poke("unaligned.qcow2", (1 << 63) | 0x50200);
    fails(&["map", "unaligned.qcow2"], "unaligned.qcow2");
    assert!(!qemu_img(d, &["map", "unaligned.qcow2"]).status.success());
    // An L2 table past the end of the file: qemu reads zeros there; qimg either agrees or
    // refuses cleanly.
    poke("past-end.qcow2", (1 << 63) | (1 << 40));
    let o = qimg(d, &["map", "--output=json", "past-end.qcow2"]);
    if o.status.success() {
        same_json(d, "past-end", &["past-end.qcow2"]);
    } else {
        fails(
            &["map", "--output=json", "past-end.qcow2"],
            "Could not read file metadata",
        );
    }
    // Garbage that is not an image is mapped as raw, like qemu-img does.
    std::fs::write(d.join("junk.bin"), b"QFI\xfbnot really").unwrap();
    let o = qimg(d, &["map", "junk.bin"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(
        o.status.success(),
        qemu_img(d, &["map", "junk.bin"]).status.success(),
        "{err}"
    );
}

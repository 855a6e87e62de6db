//! `qimg compare` and `qimg measure` against qemu-img's own commands: over pairs of images
//! made by qemu-img/qemu-io (standard and extended L2, 64 KiB and 2 MiB clusters, v2 and v3,
//! with a backing file, raw files, different sizes) both must print the same lines and exit
//! with the same status, with and without `-s`; refusals print qemu-img's messages.

use crate::common;

use common::text;

use std::path::Path;

use common::{Scratch, ok, qemu_img, qemu_img_create, qemu_io, qimg};

/// Runs `compare ARGS` with both programs and requires the same output and status; returns
/// the status.
fn same_compare(dir: &Path, what: &str, args: &[&str]) -> Option<i32> {
    let mut a = vec!["compare"];
    a.extend(args);
    let want = text(&qemu_img(dir, &a));
    let got = text(&qimg(dir, &a));
    assert_eq!(want, got, "{what}: compare {args:?}: qemu-img / qimg");
    want.2
}

/// The image shapes of the compare matrix: (name, create options).
const SHAPES: &[(&str, &str)] = &[
    ("std-64k", "cluster_size=64k"),
    ("ext-64k", "cluster_size=64k,extended_l2=on"),
    ("std-2m", "cluster_size=2M"),
    ("ext-2m", "cluster_size=2M,extended_l2=on"),
    ("v2", "compat=0.10"),
];

#[test]
fn compare_matches_qemu_img() {
    qimg_testkit::require_qemu!();
    let mut statuses = [0usize; 3];
    for (name, opts) in SHAPES {
        let s = Scratch::new(&format!("compare-{name}"));
        let d = &s.0;
        let backed = !name.starts_with("v2");
        // a: data, a zeroed range and (for most shapes) a backing file with data.
        let mut extra: Vec<&str> = Vec::new();
        if backed {
            qemu_img_create(d, "qcow2", opts, &[], "base.qcow2", "8M");
            qemu_io(
                d,
                "qcow2",
                "base.qcow2",
                &["write -P 7 1M 256k", "write -P 9 6M 64k"],
            );
            extra = vec!["-b", "base.qcow2", "-F", "qcow2"];
        }
        qemu_img_create(d, "qcow2", opts, &extra, "a.qcow2", "8M");
        qemu_io(
            d,
            "qcow2",
            "a.qcow2",
            &["write -P 1 0 100k", "write -z 1M 64k", "write -P 3 3M 4k"],
        );
        // The same guest data, flattened into a raw file and into a standalone qcow2 image.
        ok(
            "convert",
            &qemu_img(d, &["convert", "-O", "raw", "a.qcow2", "flat.raw"]),
        );
        ok(
            "convert",
            &qemu_img(
                d,
                &[
                    "convert",
                    "-O",
                    "qcow2",
                    "-o",
                    opts,
                    "a.qcow2",
                    "flat.qcow2",
                ],
            ),
        );
        // b: one byte different, in the middle of a subcluster.
        ok(
            "cp",
            &qemu_img(
                d,
                &["convert", "-O", "qcow2", "-o", opts, "a.qcow2", "b.qcow2"],
            ),
        );
        qemu_io(d, "qcow2", "b.qcow2", &["write -P 5 3000100 1"]);
        // c: zeros written as data where a reads zeros.
        ok(
            "cp",
            &qemu_img(
                d,
                &["convert", "-O", "qcow2", "-o", opts, "a.qcow2", "c.qcow2"],
            ),
        );
        qemu_io(d, "qcow2", "c.qcow2", &["write -P 0 5M 64k"]);
        // long: larger, with zeros in its tail; longdata: larger with data in its tail.
        ok(
            "cp",
            &qemu_img(
                d,
                &[
                    "convert",
                    "-O",
                    "qcow2",
                    "-o",
                    opts,
                    "a.qcow2",
                    "long.qcow2",
                ],
            ),
        );
        ok("resize", &qemu_img(d, &["resize", "long.qcow2", "12M"]));
        qemu_io(d, "qcow2", "long.qcow2", &["write -z 9M 64k"]);
        ok(
            "cp",
            &qemu_img(
                d,
                &[
                    "convert",
                    "-O",
                    "qcow2",
                    "-o",
                    opts,
                    "long.qcow2",
                    "longdata.qcow2",
                ],
            ),
        );
        qemu_io(d, "qcow2", "longdata.qcow2", &["write -P 2 10000000 3"]);
        let pairs: &[&[&str]] = &[
            &["a.qcow2", "a.qcow2"],
            &["a.qcow2", "flat.raw"],
            &["-F", "raw", "a.qcow2", "flat.raw"],
            &["flat.raw", "flat.qcow2"],
            &["a.qcow2", "flat.qcow2"],
            &["a.qcow2", "b.qcow2"],
            &["b.qcow2", "a.qcow2"],
            &["a.qcow2", "c.qcow2"],
            &["a.qcow2", "long.qcow2"],
            &["long.qcow2", "a.qcow2"],
            &["a.qcow2", "longdata.qcow2"],
            &["-q", "a.qcow2", "b.qcow2"],
            &["-f", "qcow2", "-F", "qcow2", "-U", "b.qcow2", "c.qcow2"],
            &["-f", "raw", "a.qcow2", "a.qcow2"],
        ];
        for p in pairs {
            let st = same_compare(d, name, p);
            statuses[st.unwrap_or(2).clamp(0, 2) as usize] += 1;
            let mut strict = vec!["-s"];
            strict.extend(p.iter());
            same_compare(d, name, &strict);
        }
    }
    // Both outcomes occur over the matrix.
    assert!(statuses[0] >= 10 && statuses[1] >= 10, "{statuses:?}");
}

#[test]
fn compare_refusals_match_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("compare-refusals");
    let d = &s.0;
    qemu_img_create(d, "qcow2", "", &[], "a.qcow2", "1M");
    std::fs::write(d.join("junk"), b"not an image").unwrap();
    for args in [
        &["missing", "a.qcow2"][..],
        &["a.qcow2", "missing"],
        &["a.qcow2"],
        &["-f", "qcow2", "junk", "a.qcow2"],
        &["-f", "foo", "a.qcow2", "a.qcow2"],
        &["-T", "bogus", "a.qcow2", "a.qcow2"],
    ] {
        let st = same_compare(d, "refusal", args);
        assert_ne!(st, Some(0), "{args:?} must fail");
    }
}

#[test]
fn compare_progress_reaches_the_end() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("compare-progress");
    let d = &s.0;
    qemu_img_create(d, "qcow2", "", &[], "a.qcow2", "4M");
    qemu_io(d, "qcow2", "a.qcow2", &["write -P 1 0 4M"]);
    let o = qimg(d, &["compare", "-p", "a.qcow2", "a.qcow2"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("(100.00/100%)"), "{out}");
    assert!(out.contains("Images are identical."), "{out}");
}

/// Runs `measure ARGS` with both programs and requires the same output and status.
fn same_measure(dir: &Path, what: &str, args: &[&str]) -> Option<i32> {
    let mut a = vec!["measure"];
    a.extend(args);
    let want = text(&qemu_img(dir, &a));
    let got = text(&qimg(dir, &a));
    assert_eq!(want, got, "{what}: measure {args:?}: qemu-img / qimg");
    want.2
}

/// Target options of the measure matrix.
const TARGETS: &[&str] = &[
    "",
    "cluster_size=512",
    "cluster_size=2M",
    "cluster_size=64k,extended_l2=on",
    "cluster_size=2M,extended_l2=on",
    "cluster_size=16k,extended_l2=on,refcount_bits=1",
    "refcount_bits=64",
    "refcount_bits=8,cluster_size=4k",
    "compat=0.10",
    "preallocation=metadata",
    "preallocation=falloc",
    "preallocation=full,extended_l2=on",
    "backing_file=x.qcow2",
];

#[test]
fn measure_matches_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("measure");
    let d = &s.0;
    // Sources: a qcow2 image with scattered data, zeros, a compressed cluster and bitmaps on
    // a backing file; an extended-L2 one with subclusters; a v2 one; a sparse raw file.
    qemu_img_create(d, "qcow2", "", &[], "base.qcow2", "20M");
    qemu_io(
        d,
        "qcow2",
        "base.qcow2",
        &["write -P 1 0 1M", "write -P 2 15M 100k"],
    );
    qemu_img_create(
        d,
        "qcow2",
        "",
        &["-b", "base.qcow2", "-F", "qcow2"],
        "top.qcow2",
        "33M",
    );
    qemu_io(
        d,
        "qcow2",
        "top.qcow2",
        &[
            "write -P 3 2M 3M",
            "write -z 8M 1M",
            "write -P 4 9000k 7k",
            "write -c -P 5 30M 64k",
        ],
    );
    common::add_bitmaps(d, "top.qcow2");
    qemu_img_create(
        d,
        "qcow2",
        "cluster_size=128k,extended_l2=on",
        &[],
        "ext.qcow2",
        "17M",
    );
    qemu_io(
        d,
        "qcow2",
        "ext.qcow2",
        &[
            "write -P 6 4k 4k",
            "write -P 7 1M 100k",
            "write -P 8 16M 8k",
        ],
    );
    qemu_img_create(d, "qcow2", "compat=0.10", &[], "v2.qcow2", "5M");
    qemu_io(d, "qcow2", "v2.qcow2", &["write -P 9 1M 10k"]);
    qemu_img_create(d, "raw", "", &[], "sparse.raw", "6M");
    qemu_io(
        d,
        "raw",
        "sparse.raw",
        &["write -P 1 1M 512k", "write -P 2 5M 4k"],
    );
    std::fs::write(d.join("odd.raw"), vec![7u8; 1000]).unwrap();
    let sources: &[&[&str]] = &[
        &["top.qcow2"],
        &["-f", "qcow2", "-U", "top.qcow2"],
        &["ext.qcow2"],
        &["v2.qcow2"],
        &["sparse.raw"],
        &["-f", "raw", "odd.raw"],
        &["-f", "raw", "top.qcow2"],
        &["--size", "0"],
        &["--size", "1000"],
        &["--size", "1G"],
        &["--size", "5000001"],
        &["--size", "3T"],
    ];
    let mut runs = 0;
    for src in sources {
        for out in ["raw", "qcow2"] {
            for (i, t) in TARGETS.iter().enumerate() {
                if out == "raw" && i > 0 {
                    break;
                }
                let mut args = vec!["-O", out];
                if !t.is_empty() {
                    args.extend(["-o", t]);
                }
                args.extend(src.iter());
                // Refusals (3T with 512-byte clusters) must match too.
                if same_measure(d, "matrix", &args) == Some(0) {
                    runs += 1;
                }
            }
        }
    }
    // The JSON form and the default output format.
    same_measure(d, "json", &["--output", "json", "-O", "qcow2", "top.qcow2"]);
    same_measure(d, "json", &["--output=json", "-O", "qcow2", "--size", "7G"]);
    same_measure(d, "default", &["top.qcow2"]);
    assert!(runs > 100);
}

#[test]
fn measure_refusals_match_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("measure-refusals");
    let d = &s.0;
    qemu_img_create(d, "qcow2", "", &[], "a.qcow2", "1M");
    for args in [
        &[][..],
        &["--size", "1G", "a.qcow2"],
        &["-O", "vmdk", "--size", "1G"],
        &["-O", "qcow2", "-o", "foo=bar", "--size", "1G"],
        &["-O", "raw", "-o", "backing_file=a", "--size", "1G"],
        &["-O", "qcow2", "-o", "cluster_size=3k", "--size", "1G"],
        &["-O", "qcow2", "-o", "cluster_size=foo", "--size", "1G"],
        &["-O", "qcow2", "-o", "cluster_size=512", "--size", "100T"],
        &[
            "-O",
            "qcow2",
            "-o",
            "cluster_size=4k,extended_l2=on",
            "--size",
            "1G",
        ],
        &["-O", "qcow2", "-o", "extended_l2=maybe", "--size", "1G"],
        &["-O", "qcow2", "-o", "compat=0.9", "--size", "1G"],
        &["-O", "qcow2", "-o", "refcount_bits=3", "--size", "1G"],
        &["-O", "qcow2", "-o", "refcount_bits=x", "--size", "1G"],
        &[
            "-O",
            "qcow2",
            "-o",
            "refcount_bits=64,compat=0.10",
            "--size",
            "1G",
        ],
        &["-O", "qcow2", "-o", "preallocation=bogus", "--size", "1G"],
        &["--size", "-1"],
        &["--size", "1x"],
        &["--size", "9E"],
        &["--output", "yaml", "--size", "1G"],
        &["-O", "qcow2", "missing.qcow2"],
    ] {
        assert_eq!(same_measure(d, "refusal", args), Some(1), "{args:?}");
    }
}

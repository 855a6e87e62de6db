//! `qimg resize` (and `qimg amend`) against qemu-img's own commands: each command runs on one
//! copy of the same images, qemu-img on another; both must print the same lines and exit
//! with the same status, the images must then hold the same guest data (`qemu-img compare`),
//! the same virtual size, and qimg's must pass `qemu-img check`. The matrix: standard and
//! extended L2, 64 KiB and 2 MiB clusters, v2 and v3, with and without a backing file, raw
//! files.

use crate::common;

use common::{copy_dir, text};

use std::path::{Path, PathBuf};

use common::{Scratch, assert_clean, info, ok, qemu_img, qemu_img_create, qemu_io, qimg};

/// Runs `args` with qemu-img in a copy of `src` and with qimg in another; requires the same
/// output and status, and for `file` (if the command succeeded) the same guest data and
/// virtual size, and a clean `qemu-img check` of qimg's result. Returns qimg's directory.
fn same_run(
    src: &Path,
    work: &Path,
    what: &str,
    args: &[&str],
    file: &str,
) -> (PathBuf, Option<i32>) {
    let q = work.join("q");
    let m = work.join("m");
    copy_dir(src, &q);
    copy_dir(src, &m);
    let want = text(&qemu_img(&q, args));
    let got = text(&qimg(&m, args));
    assert_eq!(want, got, "{what}: {args:?}: qemu-img / qimg");
    if file.ends_with(".qcow2") {
        assert_clean(&m, file, &format!("{what}: {args:?}"));
    }
    let a = q.join(file);
    let b = m.join(file);
    let data_file = match file {
        "df.qcow2" => Some("data.raw"),
        "dfr.qcow2" => Some("dfr.raw"),
        _ => None,
    };
    if let Some(data) = data_file {
        // qemu resolves a relative data file name against the working directory, so the two
        // copies cannot be compared from one place: their data files must be equal.
        assert_eq!(
            std::fs::read(q.join(data)).unwrap(),
            std::fs::read(m.join(data)).unwrap(),
            "{what}: {args:?}: data files differ"
        );
        let (iq, im) = (info(&q, file), info(&m, file));
        assert_eq!(iq["virtual-size"], im["virtual-size"], "{what}: {args:?}");
        let raw = |i: &serde_json::Value| i["format-specific"]["data"]["data-file-raw"].clone();
        assert_eq!(raw(&iq), raw(&im), "{what}: {args:?}: data-file-raw");
        return (m, want.2);
    }
    let o = qemu_img(work, &["compare", a.to_str().unwrap(), b.to_str().unwrap()]);
    assert!(
        o.status.success(),
        "{what}: {args:?}: guest data differ: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    let (iq, im) = (info(&q, file), info(&m, file));
    assert_eq!(iq["virtual-size"], im["virtual-size"], "{what}: {args:?}");
    (m, want.2)
}

/// Shapes of the resize matrix: (name, create options, backing file).
const SHAPES: &[(&str, &str, bool)] = &[
    ("std-64k", "cluster_size=64k", false),
    ("ext-64k", "cluster_size=64k,extended_l2=on", false),
    ("std-2m", "cluster_size=2M", false),
    ("ext-2m-backing", "cluster_size=2M,extended_l2=on", true),
    ("ext-128k-backing", "cluster_size=128k,extended_l2=on", true),
    ("v2-backing", "compat=0.10", true),
];

/// Makes `img.qcow2` (12 MiB, data spread over it) in `dir`, on a longer backing file.
fn make_image(dir: &Path, opts: &str, backing: bool) {
    let mut extra: Vec<&str> = Vec::new();
    if backing {
        qemu_img_create(dir, "qcow2", "", &[], "base.qcow2", "20M");
        qemu_io(dir, "qcow2", "base.qcow2", &["write -P 9 0 20M"]);
        extra = vec!["-b", "base.qcow2", "-F", "qcow2"];
    }
    qemu_img_create(dir, "qcow2", opts, &extra, "img.qcow2", "12M");
    qemu_io(
        dir,
        "qcow2",
        "img.qcow2",
        &[
            "write -P 1 0 1M",
            "write -P 2 3M 2M",
            "write -z 5M 512k",
            "write -P 3 7000k 12k",
            "write -P 4 11M 1M",
        ],
    );
    // A compressed cluster (whole clusters only).
    let cs = if opts.contains("2M") {
        "2M"
    } else if opts.contains("128k") {
        "128k"
    } else {
        "64k"
    };
    qemu_io(
        dir,
        "qcow2",
        "img.qcow2",
        &[&format!("write -c -P 5 8M {cs}")],
    );
}

#[test]
fn resize_matches_qemu_img() {
    qimg_testkit::require_qemu!();
    for (name, opts, backing) in SHAPES {
        let s = Scratch::new(&format!("resize-{name}"));
        let src = s.path("src");
        std::fs::create_dir_all(&src).unwrap();
        make_image(&src, opts, *backing);
        let ops: &[&[&str]] = &[
            &["resize", "img.qcow2", "16M"],
            &["resize", "img.qcow2", "+5000k"],
            &["resize", "-q", "-f", "qcow2", "img.qcow2", "30M"],
            &["resize", "--shrink", "img.qcow2", "6M"],
            &["resize", "--shrink", "img.qcow2", "7001k"],
            &["resize", "--shrink", "img.qcow2", "--", "-100k"],
            &["resize", "--shrink", "img.qcow2", "512"],
            &["resize", "--preallocation=metadata", "img.qcow2", "13M"],
            &["resize", "--preallocation=falloc", "img.qcow2", "14000k"],
            &["resize", "--preallocation=full", "img.qcow2", "17M"],
            &["resize", "img.qcow2", "12M"],
        ];
        for op in ops {
            same_run(&src, &s.0, name, op, "img.qcow2");
        }
    }
}

#[test]
fn shrinking_frees_everything_past_the_end() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("resize-free");
    let d = &s.0;
    qemu_img_create(d, "qcow2", "cluster_size=64k", &[], "img.qcow2", "64M");
    qemu_io(d, "qcow2", "img.qcow2", &["write -P 1 0 64M"]);
    ok(
        "shrink",
        &qimg(d, &["resize", "--shrink", "img.qcow2", "1M"]),
    );
    assert_clean(d, "img.qcow2", "shrink to 1M");
    let map = common::map_json(d, "img.qcow2");
    let data: u64 = map
        .iter()
        .filter(|e| e["data"] == true)
        .map(|e| e["length"].as_u64().unwrap())
        .sum();
    assert_eq!(data, 1 << 20, "{map:?}");
    // The freed clusters are free: qemu-img check counts only what is left allocated.
    let o = qemu_img(d, &["check", "--output=json", "img.qcow2"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["allocated-clusters"], 16, "{v}");
}

#[test]
fn a_cut_extended_cluster_reads_zeros_after_growing_again() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("resize-ext-tail");
    let d = &s.0;
    qemu_img_create(
        d,
        "qcow2",
        "cluster_size=128k,extended_l2=on",
        &[],
        "img.qcow2",
        "4M",
    );
    qemu_io(d, "qcow2", "img.qcow2", &["write -P 7 0 4M"]);
    ok(
        "shrink",
        &qimg(d, &["resize", "--shrink", "img.qcow2", "1000k"]),
    );
    ok("grow", &qimg(d, &["resize", "img.qcow2", "4M"]));
    assert_clean(d, "img.qcow2", "shrink and grow");
    let mut model = vec![7u8; 1000 << 10];
    model.resize(4 << 20, 0);
    common::assert_same_as_model(d, "img.qcow2", &model, "shrink and grow");
}

#[test]
fn resize_refusals_match_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("resize-refusals");
    let src = s.path("src");
    std::fs::create_dir_all(&src).unwrap();
    qemu_img_create(&src, "qcow2", "", &[], "img.qcow2", "8M");
    qemu_img_create(&src, "qcow2", "compat=0.10", &[], "v2.qcow2", "8M");
    ok(
        "snapshot",
        &qemu_img(&src, &["snapshot", "-c", "s1", "v2.qcow2"]),
    );
    qemu_img_create(&src, "qcow2", "cluster_size=512", &[], "small.qcow2", "1M");
    qemu_img_create(&src, "raw", "", &[], "r.raw", "8M");
    let refusals: &[(&[&str], &str)] = &[
        (&["resize", "img.qcow2", "4M"], "img.qcow2"),
        (&["resize", "img.qcow2", "-1M"], "img.qcow2"),
        (&["resize", "img.qcow2"], "img.qcow2"),
        (&["resize", "img.qcow2", "1x"], "img.qcow2"),
        (&["resize", "--shrink", "img.qcow2", "0"], "img.qcow2"),
        (&["resize", "img.qcow2", "9E"], "img.qcow2"),
        (&["resize", "--shrink", "img.qcow2", "1000"], "img.qcow2"),
        (
            &["resize", "--preallocation=bogus", "img.qcow2", "9M"],
            "img.qcow2",
        ),
        (
            &[
                "resize",
                "--shrink",
                "--preallocation=full",
                "img.qcow2",
                "4M",
            ],
            "img.qcow2",
        ),
        (&["resize", "v2.qcow2", "16M"], "v2.qcow2"),
        (&["resize", "small.qcow2", "100T"], "small.qcow2"),
        (&["resize", "-f", "qcow2", "r.raw", "9M"], "r.raw"),
        (&["resize", "-f", "raw", "r.raw", "4M"], "r.raw"),
        (
            &[
                "resize",
                "-f",
                "raw",
                "--preallocation=metadata",
                "r.raw",
                "9M",
            ],
            "r.raw",
        ),
        (&["resize", "missing.qcow2", "9M"], "img.qcow2"),
    ];
    for (args, file) in refusals {
        let (_, st) = same_run(&src, &s.0, "refusal", args, file);
        assert_eq!(st, Some(1), "{args:?}");
    }
}

#[test]
fn raw_files_resize_as_with_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("resize-raw");
    let src = s.path("src");
    std::fs::create_dir_all(&src).unwrap();
    qemu_img_create(&src, "raw", "", &[], "r.raw", "8M");
    qemu_io(&src, "raw", "r.raw", &["write -P 1 1M 6M"]);
    for op in [
        &["resize", "-f", "raw", "r.raw", "16M"][..],
        &["resize", "r.raw", "+1M"],
        &["resize", "-f", "raw", "--shrink", "r.raw", "3M"],
        &[
            "resize",
            "-f",
            "raw",
            "--preallocation=falloc",
            "r.raw",
            "10M",
        ],
        &[
            "resize",
            "-f",
            "raw",
            "--preallocation=full",
            "r.raw",
            "10M",
        ],
    ] {
        let (m, _) = same_run(&src, &s.0, "raw", op, "r.raw");
        let q = s.path("q");
        assert_eq!(
            std::fs::metadata(q.join("r.raw")).unwrap().len(),
            std::fs::metadata(m.join("r.raw")).unwrap().len(),
            "{op:?}"
        );
    }
}

/// The `format-specific` fields amend changes, as qemu-img info prints them.
fn amended_fields(dir: &Path, file: &str) -> Vec<serde_json::Value> {
    let v = info(dir, file);
    let d = &v["format-specific"]["data"];
    [
        "compat",
        "lazy-refcounts",
        "refcount-bits",
        "data-file",
        "compression-type",
        "extended-l2",
        "bitmaps",
    ]
    .iter()
    .map(|k| d[*k].clone())
    .chain([v["virtual-size"].clone(), v["backing-filename"].clone()])
    .collect()
}

#[test]
fn amend_matches_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("amend");
    let src = s.path("src");
    std::fs::create_dir_all(&src).unwrap();
    let d = &src;
    // v3 images: on a backing file, with zero clusters and a compressed cluster; standalone
    // with preallocated zero clusters; extended L2; zstd with and without compressed
    // clusters; lazy refcounts; a data file; bitmaps. v2 images: plain and with a backing
    // file.
    qemu_img_create(d, "qcow2", "", &[], "base.qcow2", "8M");
    qemu_io(d, "qcow2", "base.qcow2", &["write -P 9 0 8M"]);
    let backed = ["-b", "base.qcow2", "-F", "qcow2"];
    qemu_img_create(d, "qcow2", "", &backed, "a.qcow2", "8M");
    qemu_io(
        d,
        "qcow2",
        "a.qcow2",
        &[
            "write -z 0 64k",
            "write -P 1 64k 64k",
            "write -z 128k 64k",
            "write -c -P 2 1M 64k",
        ],
    );
    qemu_img_create(d, "qcow2", "preallocation=metadata", &[], "p.qcow2", "4M");
    qemu_io(
        d,
        "qcow2",
        "p.qcow2",
        &["write -P 3 0 1M", "write -z 64k 128k", "write -z 3M 1M"],
    );
    qemu_img_create(d, "qcow2", "cluster_size=2M", &[], "big.qcow2", "16M");
    qemu_io(
        d,
        "qcow2",
        "big.qcow2",
        &["write -P 4 1M 3M", "write -z 8M 2M"],
    );
    qemu_img_create(d, "qcow2", "extended_l2=on", &[], "ext.qcow2", "8M");
    qemu_io(d, "qcow2", "ext.qcow2", &["write -P 5 4k 8k"]);
    qemu_img_create(d, "qcow2", "compression_type=zstd", &[], "zc.qcow2", "8M");
    qemu_io(d, "qcow2", "zc.qcow2", &["write -c -P 1 0 64k"]);
    qemu_img_create(d, "qcow2", "compression_type=zstd", &[], "z.qcow2", "8M");
    qemu_io(d, "qcow2", "z.qcow2", &["write -P 1 0 64k"]);
    qemu_img_create(d, "qcow2", "lazy_refcounts=on", &[], "lazy.qcow2", "8M");
    qemu_io(d, "qcow2", "lazy.qcow2", &["write -P 6 0 100k"]);
    qemu_img_create(d, "qcow2", "data_file=data.raw", &[], "df.qcow2", "8M");
    qemu_io(d, "qcow2", "df.qcow2", &["write -P 7 0 100k"]);
    qemu_img_create(
        d,
        "qcow2",
        "data_file=dfr.raw,data_file_raw=on",
        &[],
        "dfr.qcow2",
        "8M",
    );
    qemu_img_create(d, "qcow2", "", &[], "bm.qcow2", "8M");
    common::add_bitmaps(d, "bm.qcow2");
    qemu_img_create(d, "qcow2", "compat=0.10", &[], "v2.qcow2", "8M");
    qemu_io(d, "qcow2", "v2.qcow2", &["write -P 8 64k 200k"]);
    qemu_img_create(d, "qcow2", "compat=0.10", &backed, "v2b.qcow2", "8M");
    qemu_io(d, "qcow2", "v2b.qcow2", &["write -P 8 1M 64k"]);
    let v2_snap = ["snapshot", "-c", "s1", "v2.qcow2"];
    let cases: &[(&str, &[&str])] = &[
        ("a.qcow2", &["-o", "compat=0.10"]),
        ("a.qcow2", &["-o", "compat=v2,refcount_bits=16"]),
        ("a.qcow2", &["-o", "compat=1.1"]),
        ("a.qcow2", &["-o", "lazy_refcounts=on"]),
        ("a.qcow2", &["-o", "refcount_bits=1"]),
        ("a.qcow2", &["-o", "refcount_bits=64"]),
        ("a.qcow2", &["-o", "refcount_bits=8"]),
        ("a.qcow2", &["-q", "-o", "size=16M"]),
        ("a.qcow2", &["-o", "size=6000k"]),
        (
            "a.qcow2",
            &["-o", "size=12M,lazy_refcounts=on,refcount_bits=32"],
        ),
        ("p.qcow2", &["-o", "compat=0.10"]),
        ("p.qcow2", &["-o", "refcount_bits=2"]),
        ("big.qcow2", &["-o", "compat=0.10"]),
        // (A refcount width change on 2 MiB clusters keeps qemu-img busy for minutes: not in
        // the matrix.)
        ("big.qcow2", &["-o", "size=5M"]),
        ("ext.qcow2", &["-o", "refcount_bits=8"]),
        ("z.qcow2", &["-o", "compat=0.10"]),
        ("lazy.qcow2", &["-o", "lazy_refcounts=off"]),
        ("lazy.qcow2", &["-o", "compat=0.10"]),
        ("df.qcow2", &["-o", "refcount_bits=8"]),
        ("dfr.qcow2", &["-o", "data_file_raw=off"]),
        ("dfr.qcow2", &["-o", "data_file_raw=on"]),
        ("v2.qcow2", &["-o", "compat=1.1"]),
        (
            "v2.qcow2",
            &["-o", "compat=1.1,lazy_refcounts=on,refcount_bits=1"],
        ),
        ("v2.qcow2", &["-f", "qcow2", "-o", "size=9M"]),
        ("v2b.qcow2", &["-o", "compat=v3"]),
    ];
    for (file, opts) in cases {
        let mut args = vec!["amend"];
        args.extend(opts.iter());
        args.push(file);
        let (m, st) = same_run(&src, &s.0, file, &args, file);
        assert_eq!(st, Some(0), "{args:?}");
        assert_eq!(
            amended_fields(&s.path("q"), file),
            amended_fields(&m, file),
            "{args:?}: qemu-img info differs"
        );
    }
    // Persistent bitmaps are kept through a refcount width change, as qemu-img keeps them
    // (they and their clusters are counted), and the same dirty extents are there after.
    for opts in ["refcount_bits=8", "refcount_bits=1"] {
        let args = ["amend", "-o", opts, "bm.qcow2"];
        let (m, st) = same_run(&src, &s.0, "bm.qcow2", &args, "bm.qcow2");
        assert_eq!(st, Some(0), "{args:?}");
        assert_eq!(
            amended_fields(&s.path("q"), "bm.qcow2"),
            amended_fields(&m, "bm.qcow2"),
            "{args:?}: qemu-img info differs"
        );
        assert_clean(&m, "bm.qcow2", opts);
        let info = ok(
            "qemu-img info",
            &qemu_img(&m, &["info", "--output=json", "bm.qcow2"]),
        );
        assert!(info.contains("\"b0\"") && info.contains("\"b1\""), "{info}");
        assert!(!info.contains("in-use"), "{info}");
    }
    // -p shows progress up to 100% (qemu-img's steps differ: not compared).
    let m = s.path("m");
    let o = qimg(&m, &["amend", "-p", "-o", "refcount_bits=2", "a.qcow2"]);
    assert!(ok("amend -p", &o).contains("(100.00/100%)"), "{o:?}");
    assert_clean(&m, "a.qcow2", "amend -p");
    // Refusals: both refuse, with the same message, and leave the image as it was.
    ok("snapshot", &qemu_img(d, &v2_snap));
    qemu_img_create(d, "raw", "", &[], "r.raw", "1M");
    let refusals: &[(&str, &[&str])] = &[
        ("a.qcow2", &["-o", "cluster_size=4k"]),
        ("a.qcow2", &["-o", "extended_l2=on"]),
        ("a.qcow2", &["-o", "preallocation=full"]),
        ("a.qcow2", &["-o", "compression_type=zstd"]),
        ("a.qcow2", &["-o", "foo=bar"]),
        ("a.qcow2", &["-o", "backing_file=x.qcow2"]),
        ("a.qcow2", &["-o", "backing_fmt=raw"]),
        ("a.qcow2", &["-o", "data_file=x.raw"]),
        ("a.qcow2", &["-o", "data_file_raw=on"]),
        ("a.qcow2", &["-o", "compat=0.9"]),
        ("a.qcow2", &["-o", "refcount_bits=3"]),
        ("a.qcow2", &["-o", "lazy_refcounts=maybe"]),
        ("a.qcow2", &["-o", "size=1x"]),
        ("a.qcow2", &["-o", "compat=0.10,lazy_refcounts=on"]),
        ("a.qcow2", &["-o", "compat=0.10,refcount_bits=8"]),
        ("a.qcow2", &[]),
        ("ext.qcow2", &["-o", "compat=0.10"]),
        ("zc.qcow2", &["-o", "compat=0.10"]),
        ("df.qcow2", &["-o", "compat=0.10"]),
        ("df.qcow2", &["-o", "data_file_raw=on"]),
        ("v2.qcow2", &["-o", "lazy_refcounts=on"]),
        ("v2.qcow2", &["-o", "refcount_bits=8"]),
        ("v2.qcow2", &["-o", "size=16M"]),
        ("r.raw", &["-o", "size=2M"]),
        ("r.raw", &["-f", "raw", "-o", "size=2M"]),
        ("missing.qcow2", &["-o", "compat=0.10"]),
    ];
    for (file, opts) in refusals {
        let mut args = vec!["amend"];
        args.extend(opts.iter());
        args.push(file);
        let checked = if file.starts_with("missing") {
            "a.qcow2"
        } else {
            file
        };
        let (_, st) = same_run(&src, &s.0, file, &args, checked);
        assert_eq!(st, Some(1), "{args:?}");
    }
}

/// A v2 image whose snapshot entries carry 0 and 8 bytes of extra data: `compat=1.1` must
/// rewrite the table with v3's extra data (both checkers call such entries incomplete
/// otherwise), and `compat=1.1,size=...` upgrades, then resizes, as qemu-img does.
#[test]
fn amend_upgrades_v2_snapshots_with_short_extra_data_as_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("amend-v2-snapshots");
    let src = s.path("src");
    std::fs::create_dir_all(&src).unwrap();
    let d = &src;
    qemu_img_create(d, "qcow2", "compat=0.10", &[], "v2.qcow2", "8M");
    qemu_io(d, "qcow2", "v2.qcow2", &["write -P 8 64k 200k"]);
    ok(
        "snapshot",
        &qemu_img(d, &["snapshot", "-c", "s1", "v2.qcow2"]),
    );
    qemu_io(d, "qcow2", "v2.qcow2", &["write -P 9 0 100k"]);
    ok(
        "snapshot",
        &qemu_img(d, &["snapshot", "-c", "s2", "v2.qcow2"]),
    );
    common::shorten_snapshot_extra(&d.join("v2.qcow2"), &[0, 8]);
    assert_clean(d, "v2.qcow2", "the shortened v2 image");
    let snapshots = |dir: &Path| info(dir, "v2.qcow2")["snapshots"].clone();
    for opts in ["compat=1.1", "compat=1.1,size=16M"] {
        let args = ["amend", "-o", opts, "v2.qcow2"];
        let (m, st) = same_run(&src, &s.0, opts, &args, "v2.qcow2");
        assert_eq!(st, Some(0), "{args:?}");
        let q = s.path("q");
        assert_eq!(
            amended_fields(&q, "v2.qcow2"),
            amended_fields(&m, "v2.qcow2")
        );
        assert_eq!(
            snapshots(&q),
            snapshots(&m),
            "{opts}: snapshot lists differ"
        );
        // Each snapshot still reads as it was written.
        ok(
            "snapshot -a",
            &qimg(&m, &["snapshot", "-a", "s1", "v2.qcow2"]),
        );
        qemu_io(
            &m,
            "qcow2",
            "v2.qcow2",
            &["read -P 8 64k 200k", "read -P 0 0 64k"],
        );
        assert_clean(&m, "v2.qcow2", "after applying s1");
    }
}

/// `resize --shrink` cuts the file and drops refcount blocks that count nothing, as
/// qemu-img does: the same file length and the same `qemu-img check` counters (64 KiB
/// clusters 8 MiB -> 5 MiB; 512-byte clusters 3 MiB -> 1 MiB, many refcount blocks).
#[test]
fn shrinking_cuts_the_file_as_qemu_img_does() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("shrink-file");
    let src = s.path("src");
    std::fs::create_dir_all(&src).unwrap();
    for (opts, size, cut) in [
        ("cluster_size=64k", "8M", "5M"),
        ("cluster_size=512", "3M", "1M"),
    ] {
        qemu_img_create(&src, "qcow2", opts, &[], "a.qcow2", size);
        qemu_io(&src, "qcow2", "a.qcow2", &[&format!("write -P 1 0 {size}")]);
        let args = ["resize", "--shrink", "a.qcow2", cut];
        let (m, st) = same_run(&src, &s.0, opts, &args, "a.qcow2");
        assert_eq!(st, Some(0), "{opts}");
        let q = s.path("q");
        let len = |d: &Path| std::fs::metadata(d.join("a.qcow2")).unwrap().len();
        assert_eq!(len(&m), len(&q), "{opts}: file length after the shrink");
        let check = |d: &Path| {
            let o = qemu_img(d, &["check", "--output=json", "a.qcow2"]);
            let mut v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            v.as_object_mut().unwrap().remove("filename");
            v
        };
        assert_eq!(check(&m), check(&q), "{opts}: qemu-img check");
    }
}

/// `amend -o compat=0.10` on an image with internal snapshots expands the zero clusters of
/// every L2 table in place, the snapshots' too, as QEMU's `qcow2_expand_zero_clusters` (it was
/// refused): with and without a backing file, in a table the active tree shares with a
/// snapshot and in one only a snapshot uses. The files check, map and read as QEMU's.
#[test]
fn amend_downgrades_images_with_snapshots_as_qemu_img() {
    use crate::qemu_dropin::{Ours, Prep, side_by_side};
    qimg_testkit::require_qemu!();
    let s = Scratch::new("amend-snapshots");
    let ours = Ours::new(&s);
    let v3 = ["create", "-q", "-f", "qcow2", "-o", "compat=1.1"];
    let with = |rest: &'static [&'static str]| -> Vec<&'static str> {
        v3.iter().chain(rest).copied().collect()
    };
    let (inactive, shared, backed) = (
        with(&["i.qcow2", "64M"]),
        with(&["s.qcow2", "1M"]),
        with(&["-b", "b.qcow2", "-F", "qcow2", "t.qcow2"]),
    );
    let prepare: Prep = &[
        ("qemu-img", &inactive),
        ("qemu-io", &["-c", "write -z 0 256k", "i.qcow2"]),
        ("qemu-img", &["snapshot", "-c", "foo", "i.qcow2"]),
        ("qemu-io", &["-c", "write -P 0x2a 0 128k", "i.qcow2"]),
        ("qemu-img", &shared),
        (
            "qemu-io",
            &[
                "-c",
                "write -P 7 0 192k",
                "-c",
                "write -z 0 64k",
                "-c",
                "write -z -u 64k 64k",
                "s.qcow2",
            ],
        ),
        ("qemu-img", &["snapshot", "-c", "foo", "s.qcow2"]),
        ("qemu-img", &["snapshot", "-c", "bar", "s.qcow2"]),
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "b.qcow2", "64M"],
        ),
        ("qemu-io", &["-c", "write -P 0x2a 0 128k", "b.qcow2"]),
        ("qemu-img", &backed),
        ("qemu-io", &["-c", "write -z 0 64k", "t.qcow2"]),
        ("qemu-img", &["snapshot", "-c", "foo", "t.qcow2"]),
        ("qemu-io", &["-c", "write -P 0x42 0 64k", "t.qcow2"]),
    ];
    let mut steps: Vec<(&str, Vec<&str>)> = Vec::new();
    for f in ["i.qcow2", "s.qcow2", "t.qcow2"] {
        steps.push(("qemu-img", vec!["amend", "-o", "compat=0.10", f]));
        steps.push(("qemu-img", vec!["check", f]));
        steps.push(("qemu-img", vec!["snapshot", "-a", "foo", f]));
        steps.push(("qemu-img", vec!["check", f]));
        // Map before reading: a zero-range cluster maps as data once some process has its
        // pages cached (the page cache answers SEEK_DATA then), as zeros before.
        steps.push(("qemu-img", vec!["map", f]));
        steps.push(("qemu-io", vec!["-c", "read -q -P 0 0 64k", f]));
    }
    let steps: Vec<(&str, &[&str])> = steps.iter().map(|(t, a)| (*t, &a[..])).collect();
    let outs = side_by_side(&s, &ours, &[], prepare, &steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(
        !outs[0].contains("ERROR") && !outs[0].contains("failed"),
        "{}",
        outs[0]
    );
}

/// Shrinking into an extended-L2 cluster whose only data lies past the new end keeps the
/// cluster allocated, as QEMU's (its discard starts at the next cluster): `check` counts
/// and ends the file as qemu-img's, and `map` shows the same. Growing again, qimg reads
/// zeros there (QEMU shows the old bytes again).
#[test]
fn shrinking_into_an_extended_cluster_keeps_it_as_qemu_img() {
    use crate::qemu_dropin::{Ours, Prep, side_by_side};
    qimg_testkit::require_qemu!();
    let s = Scratch::new("shrink-cut-cluster");
    let ours = Ours::new(&s);
    let prepare: Prep = &[
        (
            "qemu-img",
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-o",
                "cluster_size=2M,extended_l2=on",
                "h.qcow2",
                "64M",
            ],
        ),
        (
            "qemu-io",
            &[
                "-c",
                "write -P 1 0 100k",
                "-c",
                "write -P 2 3M 1k",
                "h.qcow2",
            ],
        ),
    ];
    let steps: Prep = &[
        ("qemu-img", &["resize", "--shrink", "h.qcow2", "3M"]),
        ("qemu-img", &["check", "h.qcow2"]),
        ("qemu-img", &["map", "--output=json", "h.qcow2"]),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    let dir = s.path("qimg");
    ok("grow", &qimg(&dir, &["resize", "h.qcow2", "4M"]));
    let o = ours.io(&dir, &["-c", "read -P 0 3M 1k", "h.qcow2"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && !text.contains("fail"), "{text}");
    assert_clean(&dir, "h.qcow2", "grown again");
}

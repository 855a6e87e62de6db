//! `qimg resize` (and `qimg amend`) against qemu-img's own commands: each command runs on one
//! copy of the same images, qemu-img on another; both must print the same lines and exit
//! with the same status, the images must then hold the same guest data (`qemu-img compare`),
//! the same virtual size, and qimg's must pass `qemu-img check`. The matrix: standard and
//! extended L2, 64 KiB and 2 MiB clusters, v2 and v3, with and without a backing file, raw
//! files.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::{
    Scratch, assert_clean, have_qemu, info, ok, qemu_img, qemu_img_create, qemu_io, qimg,
};

/// (stdout, stderr without the program name, exit status).
fn text(o: &Output) -> (String, String, Option<i32>) {
    let err = String::from_utf8_lossy(&o.stderr)
        .lines()
        .map(|l| {
            l.trim_start_matches("qemu-img: ")
                .trim_start_matches("qimg: ")
                .replace("qemu-img ", "qimg ")
        })
        .collect::<Vec<_>>()
        .join("\n");
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        err,
        o.status.code(),
    )
}

/// Copies every file of `src` into a fresh directory `dst`.
fn copy_dir(src: &Path, dst: &Path) {
    let _ = std::fs::remove_dir_all(dst);
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
        }
    }
}

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
    if !have_qemu("resize_matches_qemu_img") {
        return;
    }
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
    if !have_qemu("shrinking_frees_everything_past_the_end") {
        return;
    }
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
    if !have_qemu("a_cut_extended_cluster_reads_zeros_after_growing_again") {
        return;
    }
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
    if !have_qemu("resize_refusals_match_qemu_img") {
        return;
    }
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
    if !have_qemu("raw_files_resize_as_with_qemu_img") {
        return;
    }
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

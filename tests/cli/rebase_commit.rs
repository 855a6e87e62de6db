//! `qimg rebase` and `qimg commit` against qemu-img's own commands: each runs on one copy of
//! the same chain, qemu-img on another; both must print the same lines and exit with the same
//! status; afterwards every image of the chain must hold the same guest data as qemu-img's
//! (`qemu-img compare`), name the same backing file and format, and pass `qemu-img check`.
//! The matrix: standard and extended L2 (64 KiB and 2 MiB clusters), v2 and v3, qcow2 and raw
//! backing files, chains of three.

use crate::common;

use common::{copy_dir, text};

use std::path::Path;

use common::{Scratch, assert_clean, info, qemu_img, qemu_img_create, qemu_io, qimg};

/// The files of every chain.
const FILES: &[&str] = &["b1.qcow2", "b2.qcow2", "mid.qcow2", "top.qcow2", "r.raw"];

/// Runs `args` with both programs on copies of `src`; requires the same output and status
/// and, file by file, the same guest data, backing file name and format, and a clean check.
fn same_run(src: &Path, work: &Path, what: &str, args: &[&str]) -> Option<i32> {
    let q = work.join("q");
    let m = work.join("m");
    copy_dir(src, &q);
    copy_dir(src, &m);
    let want = text(&qemu_img(&q, args));
    let got = text(&qimg(&m, args));
    assert_eq!(want, got, "{what}: {args:?}: qemu-img / qimg");
    for f in FILES {
        if !q.join(f).exists() {
            continue;
        }
        let fmt = if f.ends_with(".raw") { "raw" } else { "qcow2" };
        // Compared from inside each directory so that relative backing names resolve.
        let qa = qemu_img(
            &q,
            &[
                "compare",
                "-f",
                fmt,
                "-F",
                fmt,
                f,
                m.join(f).to_str().unwrap(),
            ],
        );
        assert!(
            qa.status.success(),
            "{what}: {args:?}: {f} differs: {}{}",
            String::from_utf8_lossy(&qa.stdout),
            String::from_utf8_lossy(&qa.stderr)
        );
        if fmt == "qcow2" {
            let (iq, im) = (info(&q, f), info(&m, f));
            for k in [
                "backing-filename",
                "backing-filename-format",
                "virtual-size",
            ] {
                assert_eq!(iq[k], im[k], "{what}: {args:?}: {f}: {k}");
            }
            assert_clean(&m, f, &format!("{what}: {args:?}: {f}"));
        }
    }
    want.2
}

/// Makes the chain b1 <- mid <- top (and a second backing file b2, a raw file r.raw), all
/// with `opts`, in `dir`.
fn make_chain(dir: &Path, opts: &str) {
    let cs = if opts.contains("2M") { "2M" } else { "64k" };
    qemu_img_create(dir, "qcow2", opts, &[], "b1.qcow2", "8M");
    qemu_io(
        dir,
        "qcow2",
        "b1.qcow2",
        &["write -P 1 0 4M", "write -P 4 7M 100k"],
    );
    qemu_img_create(dir, "qcow2", opts, &[], "b2.qcow2", "6M");
    qemu_io(
        dir,
        "qcow2",
        "b2.qcow2",
        &["write -P 1 0 2M", "write -P 2 5M 1M", "write -P 1 2100k 4k"],
    );
    qemu_img_create(dir, "raw", "", &[], "r.raw", "5M");
    qemu_io(
        dir,
        "raw",
        "r.raw",
        &["write -P 7 0 1M", "write -P 1 2M 4k"],
    );
    let b1 = ["-b", "b1.qcow2", "-F", "qcow2"];
    qemu_img_create(dir, "qcow2", opts, &b1, "mid.qcow2", "8M");
    qemu_io(
        dir,
        "qcow2",
        "mid.qcow2",
        &[
            "write -P 5 512k 32k",
            "write -z 6M 64k",
            &format!("write -c -P 6 4M {cs}"),
        ],
    );
    let mid = ["-b", "mid.qcow2", "-F", "qcow2"];
    qemu_img_create(dir, "qcow2", opts, &mid, "top.qcow2", "8M");
    qemu_io(
        dir,
        "qcow2",
        "top.qcow2",
        &[
            "write -P 3 1M 64k",
            "write -z 3M 64k",
            "write -P 8 3500k 5k",
        ],
    );
}

const SHAPES: &[(&str, &str)] = &[
    ("std-64k", "cluster_size=64k"),
    ("ext-64k", "cluster_size=64k,extended_l2=on"),
    ("ext-2m", "cluster_size=2M,extended_l2=on"),
    ("std-2m", "cluster_size=2M"),
    ("v2", "compat=0.10"),
];

#[test]
fn rebase_matches_qemu_img() {
    qimg_testkit::require_qemu!();
    for (name, opts) in SHAPES {
        let s = Scratch::new(&format!("rebase-{name}"));
        let src = s.path("src");
        std::fs::create_dir_all(&src).unwrap();
        make_chain(&src, opts);
        let ops: &[&[&str]] = &[
            &["rebase", "-b", "b2.qcow2", "-F", "qcow2", "top.qcow2"],
            &["rebase", "-b", "b1.qcow2", "-F", "qcow2", "top.qcow2"],
            &["rebase", "-b", "", "top.qcow2"],
            &["rebase", "-b", "r.raw", "-F", "raw", "mid.qcow2"],
            &[
                "rebase",
                "-q",
                "-f",
                "qcow2",
                "-b",
                "b2.qcow2",
                "-F",
                "qcow2",
                "mid.qcow2",
            ],
            &["rebase", "-u", "-b", "b2.qcow2", "-F", "qcow2", "top.qcow2"],
            &["rebase", "-u", "-b", "", "mid.qcow2"],
        ];
        for op in ops {
            assert_eq!(same_run(&src, &s.0, name, op), Some(0), "{name}: {op:?}");
        }
    }
}

#[test]
fn rebase_refusals_match_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("rebase-refusals");
    let src = s.path("src");
    std::fs::create_dir_all(&src).unwrap();
    make_chain(&src, "");
    for op in [
        &["rebase", "-b", "b2.qcow2", "top.qcow2"][..],
        &["rebase", "top.qcow2"],
        &["rebase", "-F", "qcow2", "top.qcow2"],
        &["rebase", "-b", "missing.qcow2", "-F", "qcow2", "top.qcow2"],
        &[
            "rebase", "-f", "raw", "-b", "b2.qcow2", "-F", "qcow2", "r.raw",
        ],
        &[
            "rebase",
            "-t",
            "bogus",
            "-b",
            "b2.qcow2",
            "-F",
            "qcow2",
            "top.qcow2",
        ],
    ] {
        assert_eq!(same_run(&src, &s.0, "refusal", op), Some(1), "{op:?}");
    }
}

#[test]
fn commit_matches_qemu_img() {
    qimg_testkit::require_qemu!();
    for (name, opts) in SHAPES {
        let s = Scratch::new(&format!("commit-{name}"));
        let src = s.path("src");
        std::fs::create_dir_all(&src).unwrap();
        make_chain(&src, opts);
        let ops: &[&[&str]] = &[
            &["commit", "top.qcow2"],
            &["commit", "-d", "top.qcow2"],
            &["commit", "-b", "b1.qcow2", "top.qcow2"],
            &["commit", "-q", "-t", "none", "mid.qcow2"],
            &["commit", "-f", "qcow2", "-b", "mid.qcow2", "top.qcow2"],
        ];
        for op in ops {
            assert_eq!(same_run(&src, &s.0, name, op), Some(0), "{name}: {op:?}");
        }
    }
}

#[test]
fn commit_into_raw_and_refusals_match_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("commit-raw");
    let src = s.path("src");
    std::fs::create_dir_all(&src).unwrap();
    make_chain(&src, "");
    // A qcow2 image on the raw file, longer than it: the raw file grows.
    qemu_img_create(
        &src,
        "qcow2",
        "",
        &["-b", "r.raw", "-F", "raw"],
        "top.qcow2",
        "6M",
    );
    qemu_io(
        &src,
        "qcow2",
        "top.qcow2",
        &["write -P 9 1M 2M", "write -P 9 5500k 8k"],
    );
    assert_eq!(
        same_run(&src, &s.0, "raw base", &["commit", "top.qcow2"]),
        Some(0)
    );
    for op in [
        &["commit", "b1.qcow2"][..],
        &["commit", "-b", "missing.qcow2", "top.qcow2"],
        &["commit", "-b", "top.qcow2", "top.qcow2"],
        &["commit", "-t", "bogus", "top.qcow2"],
        &["commit", "-f", "raw", "top.qcow2"],
        &["commit", "missing.qcow2"],
    ] {
        assert_eq!(same_run(&src, &s.0, "refusal", op), Some(1), "{op:?}");
    }
}

/// `commit -b NAME` finds NAME as qemu-img does: a relative name from the directory of the
/// image that names it, not from the working directory (a chain in `sub/`: `-b mid.qcow2`
/// works, `-b sub/mid.qcow2` is refused with qemu-img's message).
#[test]
fn commit_base_names_resolve_along_the_chain_as_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("commit-subdir");
    let src = s.path("src");
    let sub = src.join("sub");
    std::fs::create_dir_all(&sub).unwrap();
    qemu_img_create(&sub, "qcow2", "", &[], "base.qcow2", "4M");
    qemu_io(&sub, "qcow2", "base.qcow2", &["write -P 1 0 4M"]);
    let on = |b: &'static str| ["-b", b, "-F", "qcow2"];
    qemu_img_create(&sub, "qcow2", "", &on("base.qcow2"), "mid.qcow2", "4M");
    qemu_io(&sub, "qcow2", "mid.qcow2", &["write -P 2 1M 1M"]);
    qemu_img_create(&sub, "qcow2", "", &on("mid.qcow2"), "top.qcow2", "4M");
    qemu_io(&sub, "qcow2", "top.qcow2", &["write -P 3 2M 64k"]);
    for (base, status) in [
        ("mid.qcow2", Some(0)),
        ("base.qcow2", Some(0)),
        ("sub/mid.qcow2", Some(1)),
    ] {
        let op = ["commit", "-b", base, "sub/top.qcow2"];
        assert_eq!(same_run(&src, &s.0, base, &op), status, "{op:?}");
        let (q, m) = (s.path("q/sub"), s.path("m/sub"));
        for f in ["base.qcow2", "mid.qcow2", "top.qcow2"] {
            let o = qemu_img(&q, &["compare", f, m.join(f).to_str().unwrap()]);
            assert!(o.status.success(), "{op:?}: {f} differs");
        }
        assert_clean(&m, "mid.qcow2", base);
        assert_clean(&m, "base.qcow2", base);
    }
}

/// Past the end of a shorter old backing file, where the new one has data, rebase writes
/// zero clusters, as qemu-img does, not clusters of zero bytes (before it, the old chain's
/// zeros are written as data, as qemu-img writes them): the same `qemu-img map`.
#[test]
fn rebase_writes_zeros_as_zero_clusters_as_qemu_img() {
    qimg_testkit::require_qemu!();
    for opts in ["cluster_size=64k", "extended_l2=on"] {
        let s = Scratch::new("rebase-zeros");
        let src = s.path("src");
        std::fs::create_dir_all(&src).unwrap();
        qemu_img_create(&src, "qcow2", opts, &[], "old.qcow2", "2M");
        qemu_io(&src, "qcow2", "old.qcow2", &["write -P 1 1M 512k"]);
        qemu_img_create(&src, "qcow2", opts, &[], "new.qcow2", "4M");
        qemu_io(&src, "qcow2", "new.qcow2", &["write -P 2 0 4M"]);
        let on = ["-b", "old.qcow2", "-F", "qcow2"];
        qemu_img_create(&src, "qcow2", opts, &on, "top.qcow2", "4M");
        qemu_io(&src, "qcow2", "top.qcow2", &["write -P 3 1M 64k"]);
        let op = ["rebase", "-b", "new.qcow2", "-F", "qcow2", "top.qcow2"];
        assert_eq!(same_run(&src, &s.0, opts, &op), Some(0), "{opts}");
        let map = |d: &Path| text(&qemu_img(d, &["map", "--output=json", "top.qcow2"])).0;
        assert_eq!(map(&s.path("m")), map(&s.path("q")), "{opts}: qemu-img map");
    }
}

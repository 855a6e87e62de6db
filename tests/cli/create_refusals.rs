//! Every option combination qemu-img refuses, qimg refuses too, naming the option.

use crate::common;
use common::*;

#[test]
fn qimg_refuses_what_qemu_img_refuses_and_names_the_option() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("refuse");
    ok(
        "base",
        &qemu_img(&s.0, &["create", "-q", "-f", "qcow2", "base.qcow2", "1M"]),
    );
    for (args, word) in CASES {
        let mut full = vec!["create", "-f", "qcow2"];
        full.extend_from_slice(args);
        let q = qemu_img(&s.0, &full);
        assert!(
            !q.status.success(),
            "qemu-img accepted {args:?}; the table is wrong"
        );
        let o = qimg(&s.0, &full);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "qimg accepted {args:?}: {err}");
        assert!(
            err.contains(word),
            "qimg's error for {args:?} does not name {word}: {err}"
        );
        assert!(
            !s.path("x").exists()
                || std::fs::metadata(s.path("x")).unwrap().len() == 0
                || q.status.success(),
            "qimg left an image behind for {args:?}"
        );
        let _ = std::fs::remove_file(s.path("x"));
    }
}

/// (arguments after `create -f qcow2`, a word qimg's error must contain)
const CASES: &[(&[&str], &str)] = &[
    (
        &["-o", "extended_l2=on,compat=0.10", "x", "1M"],
        "extended_l2",
    ),
    (
        &["-o", "extended_l2=on,cluster_size=8k", "x", "1M"],
        "extended_l2",
    ),
    (&["-o", "cluster_size=3000", "x", "1M"], "cluster_size"),
    (&["-o", "cluster_size=4M", "x", "1M"], "cluster_size"),
    (&["-o", "cluster_size=256", "x", "1M"], "cluster_size"),
    (&["-o", "refcount_bits=3", "x", "1M"], "refcount_bits"),
    (&["-o", "refcount_bits=128", "x", "1M"], "refcount_bits"),
    (&["-o", "refcount_bits=0", "x", "1M"], "refcount_bits"),
    (
        &["-o", "compat=0.10,refcount_bits=8", "x", "1M"],
        "refcount_bits",
    ),
    (
        &["-o", "compat=0.10,lazy_refcounts=on", "x", "1M"],
        "lazy_refcounts",
    ),
    (
        &["-o", "compat=0.10,compression_type=zstd", "x", "1M"],
        "compression_type",
    ),
    (
        &["-o", "compat=0.10,data_file=d.raw", "x", "1M"],
        "data_file",
    ),
    (&["-o", "data_file_raw=on", "x", "1M"], "data_file_raw"),
    (
        &[
            "-o",
            "data_file=d.raw,data_file_raw=on",
            "-b",
            "base.qcow2",
            "-F",
            "qcow2",
            "x",
            "1M",
        ],
        "data_file_raw",
    ),
    (
        &[
            "-o",
            "preallocation=metadata",
            "-b",
            "base.qcow2",
            "-F",
            "qcow2",
            "x",
            "1M",
        ],
        "preallocation",
    ),
    (
        &[
            "-o",
            "preallocation=full",
            "-b",
            "base.qcow2",
            "-F",
            "qcow2",
            "x",
            "1M",
        ],
        "preallocation",
    ),
    (&["-F", "qcow2", "x", "1M"], "backing_fmt"),
    (&["-b", "base.qcow2", "x", "1M"], "backing_fmt"),
    (
        &["-b", "missing.qcow2", "-F", "qcow2", "x", "1M"],
        "missing.qcow2",
    ),
    (&["-o", "compat=2.0", "x", "1M"], "compat"),
    (&["-o", "foo=1", "x", "1M"], "foo"),
    (&["-o", "preallocation=bar", "x", "1M"], "preallocation"),
    (
        &["-o", "compression_type=lz4", "x", "1M"],
        "compression_type",
    ),
    (&["-o", "extended_l2=maybe", "x", "1M"], "extended_l2"),
    (&["-o", "cluster_size=512", "x", "1P"], "size"),
    (
        &["-o", "extended_l2=on,cluster_size=16k", "x", "1E"],
        "size",
    ),
    (&["x", "--", "-5"], "size"),
    (&["x", "10X"], "10X"),
    (&["x"], "size"),
    (&["-o", "cluster_size=abc", "x", "1M"], "cluster_size"),
];

#[test]
fn o_help_lists_every_create_option() {
    let s = Scratch::new("help");
    let out = ok(
        "qimg create -o help",
        &qimg(&s.0, &["create", "-f", "qcow2", "-o", "help"]),
    );
    for opt in [
        "cluster_size",
        "extended_l2",
        "compat",
        "refcount_bits",
        "lazy_refcounts",
        "backing_file",
        "backing_fmt",
        "compression_type",
        "preallocation",
        "data_file",
        "data_file_raw",
        "size",
    ] {
        assert!(
            out.contains(&format!("{opt}=")),
            "-o help lacks {opt}:\n{out}"
        );
    }
}

/// Installed as `qemu-img` (a symlink to the qimg binary), every refusal prints what
/// qemu-img prints, stdout and stderr byte for byte (the `Formatting` line first where
/// qemu-img prints it), with its exit status; so do a repeated `-f` (the last counts) and a
/// hexadecimal size.
#[test]
fn as_qemu_img_the_refusals_print_qemu_imgs_words() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("refuse-as-qemu-img");
    let bin = s.path("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::os::unix::fs::symlink(qimg_bin(), bin.join("qemu-img")).unwrap();
    ok(
        "base",
        &qemu_img(&s.0, &["create", "-q", "-f", "qcow2", "base.qcow2", "1M"]),
    );
    let ours = |args: &[&str]| run(&s.0, &bin.join("qemu-img"), args);
    // Every refusal: the arguments given to both tools.
    let mut all: Vec<Vec<String>> = CASES
        .iter()
        .map(|(args, _)| {
            let mut full = vec!["create", "-f", "qcow2"];
            full.extend_from_slice(args);
            full.iter().map(|a| a.to_string()).collect()
        })
        .collect();
    // Raw files: the file driver's order and words.
    for pre in ["bar", "metadata"] {
        let o = format!("preallocation={pre}");
        all.push(
            ["create", "-f", "raw", "-o", &o, "x", "1M"]
                .iter()
                .map(|a| a.to_string())
                .collect(),
        );
    }
    // `convert` creating its output refuses in the same words, after its own prefix.
    for o in [
        "cluster_size=4k,extended_l2=on",
        "compat=0.10,refcount_bits=8",
    ] {
        all.push(
            ["convert", "-O", "qcow2", "-o", o, "base.qcow2", "x"]
                .iter()
                .map(|a| a.to_string())
                .collect(),
        );
    }
    // Sizes: past 63 bits (suffixed, decimal) is out of range; what does not parse is invalid.
    for size in [
        "9E",
        "18446744073709551615",
        "99999999999999999999999",
        "-1",
        "1e3",
    ] {
        for cmd in [
            &["create", "-f", "qcow2", "x"][..],
            &["measure", "-O", "qcow2", "--size"],
        ] {
            let mut v: Vec<String> = cmd.iter().map(|a| a.to_string()).collect();
            if v[0] == "create" {
                v.push("--".into());
            }
            v.push(size.into());
            all.push(v);
        }
    }
    // `-o` strings qemu-img's `accumulate_options` refuses, on every command that takes
    // them; amend's pointer to rebase names the tool.
    for args in [
        &["create", "-f", "qcow2", "-o", "", "x", "1M"][..],
        &["create", "-f", "qcow2", "-o", "cluster_size=4k,", "x", "1M"],
        &["convert", "-O", "qcow2", "-o", ",", "base.qcow2", "x"],
        &["amend", "-o", ",,", "base.qcow2"],
        &["measure", "-O", "qcow2", "-o", "", "--size", "1M"],
        &["amend", "-o", "backing_file=y", "base.qcow2"],
        // What the driver refuses at creation, when convert creates its output.
        &[
            "convert",
            "-O",
            "raw",
            "-o",
            "preallocation=bogus",
            "base.qcow2",
            "x",
        ],
        &[
            "convert",
            "-O",
            "qcow2",
            "-o",
            "compat=bogus",
            "base.qcow2",
            "x",
        ],
        // Unknown formats and an operand too many, in each command's words.
        &["create", "-f", "bogus", "x", "1M"],
        &["create", "-f", "bogus"],
        &["info", "-f", "bogus", "base.qcow2"],
        &["bench", "-f", "bogus", "base.qcow2"],
        &["info", "base.qcow2", "base.qcow2"],
        &["check", "base.qcow2", "base.qcow2"],
        &["map", "base.qcow2", "base.qcow2"],
        &["create", "-f", "qcow2", "x", "1M", "2M"],
        &["resize", "base.qcow2", "1M", "2M"],
        &["resize", "-p", "base.qcow2", "2M"],
        &["resize", "--bogus", "base.qcow2", "2M"],
        &["measure", "-O", "qcow2", "base.qcow2", "base.qcow2"],
        &["amend", "-o", "compat=1.1", "base.qcow2", "base.qcow2"],
    ] {
        all.push(args.iter().map(|a| a.to_string()).collect());
    }
    // No command, an unknown one.
    all.push(Vec::new());
    all.push(vec!["bogus".into(), "x".into()]);
    let mut differ = Vec::new();
    for full in &all {
        let full: Vec<&str> = full.iter().map(String::as_str).collect();
        let want = raw(&qemu_img(&s.0, &full));
        let _ = std::fs::remove_file(s.path("x"));
        let got = raw(&ours(&full));
        let _ = std::fs::remove_file(s.path("x"));
        assert_eq!(got.2, want.2, "{full:?}: exit status");
        if got != want {
            differ.push(format!(
                "{full:?}\n  qemu-img: {want:?}\n  qimg:     {got:?}"
            ));
        }
    }
    assert!(differ.is_empty(), "differ:\n{}", differ.join("\n"));
    for args in [
        &["create", "-f", "raw", "-f", "qcow2", "r.qcow2", "1M"][..],
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "cluster_size=0x10000",
            "h.qcow2",
            "0x100000",
        ],
        &[
            "create",
            "-f",
            "raw",
            "-o",
            "preallocation=falloc",
            "p.raw",
            "1M",
        ],
    ] {
        let want = raw(&qemu_img(&s.0, args));
        let name = args[args.len() - 2];
        let theirs = std::fs::read(s.path(name)).unwrap();
        std::fs::remove_file(s.path(name)).unwrap();
        let got = raw(&ours(args));
        assert_eq!(got, want, "{args:?}");
        assert_eq!(
            std::fs::read(s.path(name)).unwrap(),
            theirs,
            "{args:?}: images differ"
        );
    }
}

/// Standard output, standard error and exit status, as they are (no prefix rewritten).
fn raw(o: &std::process::Output) -> (String, String, Option<i32>) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
        o.status.code(),
    )
}

/// As qemu-img, a create the qcow2 driver refuses (after the `Formatting` line) deletes the
/// file it had made: a file of that name that existed before is gone, as with QEMU's tool; a
/// refusal of the option parser leaves it. Sizes out of range and an image size given twice
/// are refused in QEMU's words, and a missing backing file is reported before its format.
#[test]
fn as_qemu_img_a_refused_create_deletes_the_file_as_qemu_img_does() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("refuse-deletes");
    let bin = s.path("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::os::unix::fs::symlink(qimg_bin(), bin.join("qemu-img")).unwrap();
    let ours = |args: &[&str]| run(&s.0, &bin.join("qemu-img"), args);
    ok(
        "source",
        &qemu_img(&s.0, &["create", "-q", "-f", "qcow2", "s.qcow2", "1M"]),
    );
    let mut differ = Vec::new();
    for o in [
        "cluster_size=3k",
        "compat=bogus",
        "compat=0.10,extended_l2=on",
        "refcount_bits=3",
        "preallocation=bogus",
        "data_file_raw=on",
        "compression_type=bogus",
        "data_file=d.raw,compat=0.10",
        "bogus=1",
        "cluster_size=abc",
        "cluster_size=-1",
        "cluster_size=99999999999999999999",
        "size=1k",
        "backing_file=nx.qcow2",
    ] {
        let mut outs = Vec::new();
        let create = ["create", "-f", "qcow2", "-o", o, "x.qcow2", "1M"];
        let convert = ["convert", "-O", "qcow2", "-o", o, "s.qcow2", "x.qcow2"];
        for (theirs, args) in [
            (true, &create[..]),
            (false, &create),
            (true, &convert),
            (false, &convert),
        ] {
            ok(
                "pre-existing",
                &qemu_img(&s.0, &["create", "-q", "-f", "qcow2", "x.qcow2", "1M"]),
            );
            let out = if theirs {
                qemu_img(&s.0, args)
            } else {
                ours(args)
            };
            outs.push((raw(&out), s.path("x.qcow2").exists()));
            let _ = std::fs::remove_file(s.path("x.qcow2"));
        }
        for pair in outs.chunks(2) {
            if pair[0] != pair[1] {
                differ.push(format!(
                    "{o}\n  qemu-img: {:?}\n  qimg:     {:?}",
                    pair[0], pair[1]
                ));
            }
        }
    }
    assert!(differ.is_empty(), "differ:\n{}", differ.join("\n"));
    // As qimg, nothing is touched: the options are checked before the file is made.
    ok(
        "pre-existing",
        &qemu_img(&s.0, &["create", "-q", "-f", "qcow2", "x.qcow2", "1M"]),
    );
    let o = qimg(
        &s.0,
        &[
            "create",
            "-f",
            "qcow2",
            "-o",
            "cluster_size=3k",
            "x.qcow2",
            "1M",
        ],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(s.path("x.qcow2").exists(), "qimg deleted the file");
}

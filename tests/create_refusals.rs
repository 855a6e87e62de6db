//! Every option combination qemu-img refuses, qimg refuses too, naming the option.

mod common;
use common::*;

#[test]
fn qimg_refuses_what_qemu_img_refuses_and_names_the_option() {
    if !have_qemu("qimg_refuses_what_qemu_img_refuses_and_names_the_option") {
        return;
    }
    let s = Scratch::new("refuse");
    ok(
        "base",
        &qemu_img(&s.0, &["create", "-q", "-f", "qcow2", "base.qcow2", "1M"]),
    );
    // (arguments after `create -f qcow2`, a word the error must contain)
    let cases: &[(&[&str], &str)] = &[
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
    for (args, word) in cases {
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

//! What only the whole-system tests share: the `qimg` binary under test, the interop matrix
//! of image options, and (in `faults`) the crash and I/O-error machinery. The qemu-img /
//! qemu-io helpers, the model, the generator and the patterns are the test kit's
//! (`qimg-testkit`); they are re-exported here so that `common::qemu_img` and friends keep
//! one name in every test.
#![allow(dead_code)]

pub mod faults;

use std::path::{Path, PathBuf};
use std::process::Output;

pub use qimg_testkit::qemu::*;

/// The qimg binary under test.
pub fn qimg_bin() -> PathBuf {
    match option_env!("CARGO_BIN_EXE_qimg") {
        Some(path) => PathBuf::from(path),
        None => panic!("the qimg binary is only built for the qimg-cli package's tests"),
    }
}

/// Runs the qimg binary with `args` in `dir`.
pub fn qimg(dir: &Path, args: &[&str]) -> Output {
    run(dir, &qimg_bin(), args)
}

/// One image of the interop matrix: qemu-img create options and what to do afterwards.
#[derive(Debug, Clone)]
pub struct Case {
    pub name: String,
    /// `-o` string (may be empty).
    pub opts: String,
    pub size: &'static str,
    /// Backing file format: a `base.<fmt>` made by qemu-img is passed with `-b` and `-F`.
    pub backing: Option<&'static str>,
    /// Add an internal snapshot with `qemu-img snapshot -c` afterwards.
    pub snapshot: bool,
    /// Add a persistent bitmap with `qemu-img bitmap --add` afterwards.
    pub bitmap: bool,
}

fn case(name: &str, opts: &str, size: &'static str) -> Case {
    Case {
        name: name.to_string(),
        opts: opts.to_string(),
        size,
        backing: None,
        snapshot: false,
        bitmap: false,
    }
}

/// The option matrix: every cluster size with extended L2 on and off, both compat levels,
/// every refcount width, lazy refcounts, zstd, backing files, data files, every
/// preallocation mode, odd sizes, internal snapshots and bitmaps.
pub fn matrix() -> Vec<Case> {
    let mut m = Vec::new();
    let sizes = [
        "512", "1k", "2k", "4k", "8k", "16k", "32k", "64k", "128k", "256k", "512k", "1M", "2M",
    ];
    for cs in sizes {
        m.push(case(
            &format!("cs{cs}"),
            &format!("cluster_size={cs}"),
            "64M",
        ));
    }
    for cs in &sizes[5..] {
        m.push(case(
            &format!("cs{cs}-ext"),
            &format!("cluster_size={cs},extended_l2=on"),
            "64M",
        ));
    }
    for cs in ["512", "64k", "2M"] {
        m.push(case(
            &format!("v2-cs{cs}"),
            &format!("compat=0.10,cluster_size={cs}"),
            "64M",
        ));
    }
    for rb in [1, 2, 4, 8, 32, 64] {
        m.push(case(
            &format!("rb{rb}"),
            &format!("refcount_bits={rb}"),
            "1G",
        ));
    }
    m.push(case(
        "rb1-ext",
        "refcount_bits=1,extended_l2=on,cluster_size=128k",
        "1G",
    ));
    m.push(case(
        "rb64-cs512",
        "refcount_bits=64,cluster_size=512",
        "16M",
    ));
    m.push(case("lazy", "lazy_refcounts=on", "1G"));
    m.push(case("lazy-ext", "lazy_refcounts=on,extended_l2=on", "1G"));
    m.push(case("zstd", "compression_type=zstd", "1G"));
    m.push(case(
        "zstd-ext-v3",
        "compression_type=zstd,extended_l2=on,compat=v3",
        "1G",
    ));
    for (name, opts, fmt) in [
        ("backing", "", "qcow2"),
        ("backing-ext", "extended_l2=on,cluster_size=128k", "qcow2"),
        ("backing-v2", "compat=0.10", "qcow2"),
        ("backing-raw", "", "raw"),
        (
            "backing-ext-prealloc",
            "extended_l2=on,preallocation=metadata",
            "qcow2",
        ),
    ] {
        let mut c = case(name, opts, "64M");
        c.backing = Some(fmt);
        m.push(c);
    }
    m.push(case("datafile", "data_file=data.raw", "64M"));
    m.push(case(
        "datafile-raw",
        "data_file=data.raw,data_file_raw=on",
        "64M",
    ));
    m.push(case(
        "datafile-ext",
        "data_file=data.raw,extended_l2=on",
        "64M",
    ));
    for p in ["metadata", "falloc", "full"] {
        m.push(case(
            &format!("prealloc-{p}"),
            &format!("preallocation={p}"),
            "8M",
        ));
        m.push(case(
            &format!("prealloc-{p}-ext"),
            &format!("preallocation={p},extended_l2=on"),
            "8M",
        ));
    }
    m.push(case(
        "prealloc-metadata-cs512",
        "preallocation=metadata,cluster_size=512",
        "4M",
    ));
    m.push(case("size0", "", "0"));
    m.push(case("size1000", "", "1000"));
    m.push(case("size1T", "", "1T"));
    m.push(case(
        "size-odd-ext",
        "extended_l2=on,cluster_size=2M",
        "5000000",
    ));
    let mut s = case("snapshot", "", "64M");
    s.snapshot = true;
    m.push(s);
    let mut s = case("snapshot-ext", "extended_l2=on", "64M");
    s.snapshot = true;
    m.push(s);
    let mut b = case("bitmaps", "", "64M");
    b.bitmap = true;
    m.push(b);
    m
}

/// Makes the backing file a case needs in `dir` (with qemu-img).
pub fn make_backing(dir: &Path, c: &Case) {
    if let Some(fmt) = c.backing {
        let name = format!("base.{fmt}");
        ok(
            "qemu-img create base",
            &qemu_img(dir, &["create", "-q", "-f", fmt, &name, c.size]),
        );
    }
}

/// `create` arguments for a case (for qemu-img and qimg alike), image named `img.qcow2`.
pub fn create_args(c: &Case) -> Vec<String> {
    let mut a = vec![
        "create".to_string(),
        "-q".into(),
        "-f".into(),
        "qcow2".into(),
    ];
    if !c.opts.is_empty() {
        a.push("-o".into());
        a.push(c.opts.clone());
    }
    if let Some(fmt) = c.backing {
        a.extend(["-b".into(), format!("base.{fmt}"), "-F".into(), fmt.into()]);
    }
    a.push("img.qcow2".into());
    a.push(c.size.into());
    a
}

/// Makes the whole case with qemu-img in `dir`.
pub fn make_with_qemu(dir: &Path, c: &Case) {
    make_backing(dir, c);
    let args = create_args(c);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    ok(
        &format!("qemu-img create ({})", c.name),
        &qemu_img(dir, &args),
    );
    if c.snapshot {
        ok(
            "qemu-img snapshot",
            &qemu_img(dir, &["snapshot", "-c", "first", "img.qcow2"]),
        );
        ok(
            "qemu-img snapshot",
            &qemu_img(dir, &["snapshot", "-c", "second", "img.qcow2"]),
        );
    }
    if c.bitmap {
        add_bitmaps(dir, "img.qcow2");
    }
}

/// Adds two persistent bitmaps to `file` with qemu-img: `b0` (default granularity, enabled)
/// and `b1` (128 KiB granularity, disabled).
pub fn add_bitmaps(dir: &Path, file: &str) {
    ok(
        "qemu-img bitmap",
        &qemu_img(dir, &["bitmap", "--add", file, "b0"]),
    );
    ok(
        "qemu-img bitmap",
        &qemu_img(
            dir,
            &["bitmap", "--add", "-g", "128k", "--disable", file, "b1"],
        ),
    );
}

/// `(stdout, stderr, exit status)` with the program name taken off stderr's lines (`qemu-img: `,
/// `qimg: `) and `qemu-img ` read as `qimg `, so that qemu-img's and qimg's messages compare.
pub fn text(o: &Output) -> (String, String, Option<i32>) {
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

/// Copies every file of `src`, and of its folders, into a fresh directory `dst` (not inside
/// `src`).
pub fn copy_dir(src: &Path, dst: &Path) {
    let _ = std::fs::remove_dir_all(dst);
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let kind = e.file_type().unwrap();
        if kind.is_file() {
            std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
        } else if kind.is_dir() {
            copy_dir(&e.path(), &dst.join(e.file_name()));
        }
    }
}

/// Gives the snapshot entries of the image at `path` the extra data lengths in `lens` (older
/// writers left entries with less than v3 asks for), rewriting the table in place: it only
/// shrinks.
pub fn shorten_snapshot_extra(path: &Path, lens: &[usize]) {
    use qimg::format::snapshot::{decode_table, encode_table};
    let mut bytes = std::fs::read(path).unwrap();
    let nb = u32::from_be_bytes(bytes[60..64].try_into().unwrap());
    let at = u64::from_be_bytes(bytes[64..72].try_into().unwrap()) as usize;
    let mut snaps = decode_table(&bytes[at..], at as u64, nb).unwrap();
    let old_len: usize = snaps.iter().map(|s| s.encoded_len()).sum();
    for (s, &len) in snaps.iter_mut().zip(lens) {
        s.extra_data.truncate(len);
    }
    let table = encode_table(&snaps);
    // (The last entry's padding may lie past the end of the file.)
    let end = (at + old_len).min(bytes.len());
    bytes[at..end].fill(0);
    bytes[at..at + table.len()].copy_from_slice(&table);
    std::fs::write(path, bytes).unwrap();
}

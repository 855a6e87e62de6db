//! Helpers shared by the whole-system tests: finding qemu-img, scratch directories, running
//! commands, comparing qemu-img JSON.
#![allow(dead_code)]

pub mod engine;
pub mod faults;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU64, Ordering};

/// Set to 1 (as `.ci/run` does) to turn "qemu-img is missing" into a failure.
pub const REQUIRE_ENV: &str = "QIMG_REQUIRE_QEMU";

/// Whether qemu-img is usable. When it is not, says so on stderr, and panics if
/// `QIMG_REQUIRE_QEMU=1`, so that CI can never skip the interop tests silently.
pub fn have_qemu(test: &str) -> bool {
    let ok = Command::new("qemu-img")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        if std::env::var(REQUIRE_ENV).as_deref() == Ok("1") {
            panic!(
                "{test}: qemu-img is not installed but {REQUIRE_ENV}=1 requires the interop tests to run"
            );
        }
        eprintln!(
            "SKIPPED {test}: qemu-img not found (install qemu-utils to run the interop tests)"
        );
    }
    ok
}

/// A fresh scratch directory under the target directory, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let base = std::env::temp_dir().join(format!(
            "qimg-test-{}-{}-{}",
            tag,
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        Self(base)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The qimg binary under test.
pub fn qimg_bin() -> PathBuf {
    match option_env!("CARGO_BIN_EXE_qimg") {
        Some(path) => PathBuf::from(path),
        None => panic!("the qimg binary is only built for the qimg-cli package's tests"),
    }
}

/// Runs `prog args` in `dir`.
pub fn run(dir: &Path, prog: &Path, args: &[&str]) -> Output {
    Command::new(prog)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", prog.display()))
}

pub fn qemu_img(dir: &Path, args: &[&str]) -> Output {
    run(dir, Path::new("qemu-img"), args)
}

pub fn qimg(dir: &Path, args: &[&str]) -> Output {
    run(dir, &qimg_bin(), args)
}

/// Panics with both streams unless the command succeeded.
pub fn ok(what: &str, o: &Output) -> String {
    if !o.status.success() {
        panic!(
            "{what} failed ({}):\nstdout: {}\nstderr: {}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn json(what: &str, o: &Output) -> serde_json::Value {
    let s = ok(what, o);
    serde_json::from_str(&s).unwrap_or_else(|e| panic!("{what}: bad JSON ({e}): {s}"))
}

/// Compares every field both values have, recursively; returns the differing paths.
/// Arrays must have the same length. Keys in `ignore` are skipped at any depth.
pub fn common_fields_differ(
    a: &serde_json::Value,
    b: &serde_json::Value,
    ignore: &[&str],
) -> Vec<String> {
    let mut out = Vec::new();
    walk(a, b, "", ignore, &mut out);
    out
}

fn walk(
    a: &serde_json::Value,
    b: &serde_json::Value,
    at: &str,
    ignore: &[&str],
    out: &mut Vec<String>,
) {
    use serde_json::Value::*;
    match (a, b) {
        (Object(x), Object(y)) => {
            for (k, va) in x {
                if ignore.contains(&k.as_str()) {
                    continue;
                }
                if let Some(vb) = y.get(k) {
                    walk(va, vb, &format!("{at}/{k}"), ignore, out);
                }
            }
        }
        (Array(x), Array(y)) => {
            if x.len() != y.len() {
                out.push(format!("{at}: {} vs {} elements", x.len(), y.len()));
            } else {
                for (i, (va, vb)) in x.iter().zip(y).enumerate() {
                    walk(va, vb, &format!("{at}[{i}]"), ignore, out);
                }
            }
        }
        _ => {
            if a != b {
                out.push(format!("{at}: {a} vs {b}"));
            }
        }
    }
}

/// Counts the fields of `a` that `b` also has (to show the comparison compared something).
pub fn count_common(a: &serde_json::Value, b: &serde_json::Value) -> usize {
    use serde_json::Value::*;
    match (a, b) {
        (Object(x), Object(y)) => x
            .iter()
            .filter_map(|(k, va)| y.get(k).map(|vb| 1 + count_common(va, vb)))
            .sum(),
        (Array(x), Array(y)) => x.iter().zip(y).map(|(p, q)| count_common(p, q)).sum(),
        _ => 0,
    }
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
        ok(
            "qemu-img bitmap",
            &qemu_img(dir, &["bitmap", "--add", "img.qcow2", "b0"]),
        );
        ok(
            "qemu-img bitmap",
            &qemu_img(
                dir,
                &[
                    "bitmap",
                    "--add",
                    "-g",
                    "128k",
                    "--disable",
                    "img.qcow2",
                    "b1",
                ],
            ),
        );
    }
}

/// `qemu-io -f FMT -c CMD ... FILE`, which must succeed.
pub fn qemu_io(dir: &Path, fmt: &str, file: &str, cmds: &[&str]) {
    let mut args: Vec<&str> = vec!["-f", fmt];
    for c in cmds {
        args.push("-c");
        args.push(c);
    }
    args.push(file);
    ok("qemu-io", &run(dir, Path::new("qemu-io"), &args));
}

/// `qemu-img create -q -f FMT [-o OPTS] EXTRA... FILE [SIZE]`, which must succeed.
pub fn qemu_img_create(dir: &Path, fmt: &str, opts: &str, extra: &[&str], file: &str, size: &str) {
    let mut args = vec!["create", "-q", "-f", fmt];
    if !opts.is_empty() {
        args.extend(["-o", opts]);
    }
    args.extend(extra);
    args.push(file);
    if !size.is_empty() {
        args.push(size);
    }
    ok("qemu-img create", &qemu_img(dir, &args));
}

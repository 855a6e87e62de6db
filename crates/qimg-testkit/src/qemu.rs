//! The qemu-img / qemu-io helpers: whether the tools are there (and the `QIMG_REQUIRE_QEMU`
//! rule that turns their absence into a failure), running them, create / check / compare /
//! convert / info / map wrappers, comparing their JSON, and scratch directories.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU64, Ordering};

/// The qemu-img program (looked up on `PATH`).
pub const QEMU_IMG: &str = "qemu-img";
/// The qemu-io program (looked up on `PATH`).
pub const QEMU_IO: &str = "qemu-io";

/// Set to 1 (as `.ci/run` does) to turn "qemu-img is missing" into a failure.
pub const REQUIRE_ENV: &str = "QIMG_REQUIRE_QEMU";

/// Whether qemu-img is usable. When it is not, says so on stderr, and panics if
/// `QIMG_REQUIRE_QEMU=1`, so that CI can never skip the interop tests silently.
pub fn have_qemu(test: &str) -> bool {
    let ok = Command::new(QEMU_IMG)
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

/// Returns from the calling test when qemu-img is not usable ([`have_qemu`]: it says so on
/// stderr, or panics under `QIMG_REQUIRE_QEMU=1`), naming the test by its function's path:
///
/// ```
/// fn images_match_qemus() {
///     qimg_testkit::require_qemu!();
///     // ... drive qemu-img ...
/// }
/// ```
#[macro_export]
macro_rules! require_qemu {
    () => {
        if !$crate::qemu::have_qemu($crate::qemu::function_path({
            fn here() {}
            here
        })) {
            return;
        }
    };
}

/// The path of the function that defines `f` (a local `fn here() {}`): what
/// [`require_qemu!`] names a skipped test by.
pub fn function_path<F>(_f: F) -> &'static str {
    let name = std::any::type_name::<F>();
    name.strip_suffix("::here").unwrap_or(name)
}

/// A fresh scratch directory in the system temporary directory, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    /// A new, empty directory whose name has `tag`, the process id and a counter.
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

    /// The path of `name` inside the directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
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

/// Runs `qemu-img args` in `dir`.
pub fn qemu_img(dir: &Path, args: &[&str]) -> Output {
    run(dir, Path::new(QEMU_IMG), args)
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

/// The standard output of a command that must have succeeded, parsed as JSON.
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

/// `qemu-io -f FMT -c CMD ... FILE`, which must succeed.
pub fn qemu_io(dir: &Path, fmt: &str, file: &str, cmds: &[&str]) {
    let mut args: Vec<&str> = vec!["-f", fmt];
    for c in cmds {
        args.push("-c");
        args.push(c);
    }
    args.push(file);
    ok("qemu-io", &run(dir, Path::new(QEMU_IO), &args));
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

/// `qemu-img create -f qcow2 -o OPTS FILE SIZE` (plus `-b`/`-F` when `backing` is given).
pub fn qemu_create(dir: &Path, file: &str, opts: &str, size: u64, backing: Option<(&str, &str)>) {
    let size = size.to_string();
    let mut args = vec!["create", "-q", "-f", "qcow2", "-o", opts];
    if let Some((b, fmt)) = backing {
        args.extend(["-b", b, "-F", fmt]);
    }
    args.extend([file, size.as_str()]);
    ok("qemu-img create", &qemu_img(dir, &args));
}

/// Runs `qemu-img check --output=json` and panics unless it reports no corruption, no leak
/// and no check error.
pub fn assert_clean(dir: &Path, file: &str, what: &str) {
    let o = qemu_img(dir, &["check", "--output=json", file]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|_| {
        panic!(
            "{what}: qemu-img check printed no JSON (exit {:?}): {}{}",
            o.status.code(),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    });
    for field in ["corruptions", "leaks", "check-errors"] {
        let n = v.get(field).and_then(|x| x.as_u64()).unwrap_or(0);
        assert_eq!(n, 0, "{what}: qemu-img check reports {field}={n}: {v}");
    }
    assert!(
        o.status.success(),
        "{what}: qemu-img check exit {:?}: {v}",
        o.status.code()
    );
}

/// Writes `model` as a raw file and runs `qemu-img compare` against the image.
pub fn assert_same_as_model(dir: &Path, file: &str, model: &[u8], what: &str) {
    let raw = dir.join("model.raw");
    std::fs::write(&raw, model).unwrap();
    let o = qemu_img(
        dir,
        &["compare", "-f", "qcow2", "-F", "raw", file, "model.raw"],
    );
    assert!(
        o.status.success(),
        "{what}: qemu-img compare says the image differs from the model: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The guest contents of an image as raw bytes, by `qemu-img convert -O raw`.
pub fn qemu_raw(dir: &Path, file: &str) -> Vec<u8> {
    let out = dir.join(format!("{file}.as-raw"));
    ok(
        "qemu-img convert -O raw",
        &qemu_img(dir, &["convert", "-O", "raw", file, out.to_str().unwrap()]),
    );
    let data = std::fs::read(&out).unwrap();
    let _ = std::fs::remove_file(&out);
    data
}

/// The `qemu-img info --output=json` of a file.
pub fn info(dir: &Path, file: &str) -> serde_json::Value {
    json(
        "qemu-img info",
        &qemu_img(dir, &["info", "--output=json", file]),
    )
}

/// `qemu-img check --output=json` of the file at `path`: (corruptions, leaks, check-errors).
pub fn qemu_check_counts(path: &Path) -> (u64, u64, u64) {
    let dir = path.parent().unwrap();
    let name = path.file_name().unwrap().to_str().unwrap();
    let o = qemu_img(dir, &["check", "--output=json", name]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|_| {
        panic!(
            "qemu-img check printed no JSON (exit {:?}): {}{}",
            o.status.code(),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    });
    let n = |f: &str| v.get(f).and_then(|x| x.as_u64()).unwrap_or(0);
    (n("corruptions"), n("leaks"), n("check-errors"))
}

/// A scratch directory in `/dev/shm` when there is one (the check reads files; a tmpfs keeps
/// thousands of them cheap), else in the temporary directory.
pub fn scratch_in_memory(tag: &str) -> Scratch {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        return Scratch::new(tag);
    }
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = shm.join(format!(
        "qimg-test-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    match std::fs::create_dir_all(&dir) {
        Ok(()) => Scratch(dir),
        Err(_) => Scratch::new(tag),
    }
}

/// Writes `data` as the backing file `base.<fmt>` in `dir` (`fmt` is `raw`, or `qcow2`:
/// converted from raw by qemu-img, so that a qcow2 made by QEMU backs the image) and returns
/// its name, for [`qemu_create`]'s `backing`.
pub fn make_backing_file(dir: &Path, data: &[u8], fmt: &str) -> &'static str {
    std::fs::write(dir.join("base.raw"), data).unwrap();
    match fmt {
        "raw" => "base.raw",
        "qcow2" => {
            ok(
                "qemu-img convert",
                &qemu_img(
                    dir,
                    &[
                        "convert",
                        "-f",
                        "raw",
                        "-O",
                        "qcow2",
                        "base.raw",
                        "base.qcow2",
                    ],
                ),
            );
            std::fs::remove_file(dir.join("base.raw")).unwrap();
            "base.qcow2"
        }
        _ => panic!("backing file format {fmt}: only raw and qcow2"),
    }
}

/// The extents of `qemu-img map --output=json` of `file`.
pub fn map_json(dir: &Path, file: &str) -> Vec<serde_json::Value> {
    json(
        "qemu-img map",
        &qemu_img(dir, &["map", "--output=json", file]),
    )
    .as_array()
    .cloned()
    .unwrap_or_default()
}

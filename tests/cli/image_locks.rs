//! Image locking against QEMU, both ways: while qimg has an image open for writing, qemu-io
//! and qemu-img cannot open it (except qemu-img with `-U`); while QEMU has it open, qimg
//! refuses as QEMU would, and `force_share` (`-U`) reads anyway; two qimg writers refuse each
//! other; `locking(false)` takes no lock.

use crate::common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};

use common::{QEMU_IMG, QEMU_IO, Scratch, qemu_create};
use qimg::OpenOptions;

/// A qemu-io process that keeps an image open until dropped.
struct QemuHolder {
    child: Child,
    stdin: ChildStdin,
}

impl QemuHolder {
    /// Opens `file` in qemu-io (read-only with `read_only`) and waits until it has read from
    /// it, so the image is certainly open (and locked) when this returns.
    fn open(dir: &Path, file: &str, read_only: bool) -> Self {
        Self::open_with(dir, Path::new(QEMU_IO), "qcow2", file, read_only)
    }

    /// [`open`](Self::open) with `program` (QEMU's qemu-io or ours) and format `fmt`.
    fn open_with(dir: &Path, program: &Path, fmt: &str, file: &str, read_only: bool) -> Self {
        let mut cmd = Command::new(program);
        cmd.current_dir(dir).args(["-f", fmt]);
        if read_only {
            cmd.arg("-r");
        }
        let mut child = cmd
            .arg(file)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start qemu-io");
        let mut stdin = child.stdin.take().expect("stdin");
        writeln!(stdin, "read 0 512").expect("talk to qemu-io");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        loop {
            line.clear();
            let n = out.read_line(&mut line).expect("read qemu-io");
            assert!(n > 0, "qemu-io exited before opening {file}");
            if line.contains("read 512/512 bytes at offset 0") {
                break;
            }
        }
        Self { child, stdin }
    }
}

impl Drop for QemuHolder {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.child.wait();
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn image(tag: &str) -> Scratch {
    let dir = Scratch::new(tag);
    qemu_create(
        &dir.0,
        "a.qcow2",
        "extended_l2=on,cluster_size=64k",
        64 << 20,
        None,
    );
    dir
}

fn stderr_of(dir: &Path, prog: &str, args: &[&str]) -> (bool, String) {
    let o = Command::new(prog)
        .current_dir(dir)
        .args(args)
        .output()
        .expect("run");
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn qemu_is_refused_while_qimg_writes_and_reads_with_force_share() {
    qimg_testkit::require_qemu!();
    let dir = image("locks-qimg-holds");
    let p = dir.path("a.qcow2");
    let rt = runtime();
    let img = rt
        .block_on(OpenOptions::new().writable(true).open(&p))
        .unwrap();
    rt.block_on(img.write(&[7u8; 4096], 0)).unwrap();
    rt.block_on(img.flush()).unwrap();

    let (ok, err) = stderr_of(
        &dir.0,
        QEMU_IO,
        &["-f", "qcow2", "-c", "read 0 512", "a.qcow2"],
    );
    assert!(!ok, "qemu-io opened an image qimg writes");
    assert!(err.contains("Failed to get \"write\" lock"), "{err}");
    let (ok, err) = stderr_of(&dir.0, QEMU_IMG, &["info", "a.qcow2"]);
    assert!(!ok, "qemu-img info opened an image qimg writes");
    assert!(err.contains("Failed to get shared \"write\" lock"), "{err}");
    let (ok, err) = stderr_of(&dir.0, QEMU_IMG, &["info", "-U", "a.qcow2"]);
    assert!(ok, "qemu-img info -U was refused: {err}");

    rt.block_on(img.close()).unwrap();
    drop(img);
    let (ok, err) = stderr_of(
        &dir.0,
        QEMU_IO,
        &["-f", "qcow2", "-c", "read -P 7 0 4096", "a.qcow2"],
    );
    assert!(ok, "qemu-io after qimg closed: {err}");
}

#[test]
fn qimg_is_refused_while_qemu_writes_and_reads_with_force_share() {
    qimg_testkit::require_qemu!();
    let dir = image("locks-qemu-writes");
    let p = dir.path("a.qcow2");
    let holder = QemuHolder::open(&dir.0, "a.qcow2", false);
    let rt = runtime();
    for (what, opts) in [
        ("read-write", OpenOptions::new().writable(true)),
        ("read-only", OpenOptions::new()),
    ] {
        let err = rt.block_on(opts.open(&p)).expect_err(what).to_string();
        assert!(
            err.contains("in use") && err.contains("open for writing"),
            "{what}: {err}"
        );
    }
    let img = rt
        .block_on(OpenOptions::new().force_share(true).open(&p))
        .expect("force-share read");
    let mut buf = vec![1u8; 512];
    rt.block_on(img.read(&mut buf, 0)).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    let err = rt
        .block_on(OpenOptions::new().writable(true).force_share(true).open(&p))
        .expect_err("force-share with writing")
        .to_string();
    assert!(err.contains("read-only"), "{err}");
    // The CLI: map needs -U while QEMU writes, as qemu-img map does.
    let qimg = common::qimg_bin();
    let (ok, err) = stderr_of(&dir.0, qimg.to_str().unwrap(), &["map", "a.qcow2"]);
    assert!(!ok && err.contains("in use"), "qimg map without -U: {err}");
    let (ok, err) = stderr_of(&dir.0, qimg.to_str().unwrap(), &["map", "-U", "a.qcow2"]);
    assert!(ok, "qimg map -U: {err}");
    // check takes the read lock, a repair the write lock; -U checks anyway.
    for args in [
        &["check", "a.qcow2"][..],
        &["check", "-r", "all", "a.qcow2"][..],
    ] {
        let (ok, err) = stderr_of(&dir.0, qimg.to_str().unwrap(), args);
        assert!(!ok && err.contains("in use"), "qimg {args:?}: {err}");
    }
    let (ok, err) = stderr_of(&dir.0, qimg.to_str().unwrap(), &["check", "-U", "a.qcow2"]);
    assert!(ok, "qimg check -U: {err}");
    // info too, as qemu-img info.
    let (ok, err) = stderr_of(&dir.0, qimg.to_str().unwrap(), &["info", "a.qcow2"]);
    assert!(!ok && err.contains("in use"), "qimg info without -U: {err}");
    let (ok, err) = stderr_of(&dir.0, qimg.to_str().unwrap(), &["info", "-U", "a.qcow2"]);
    assert!(ok, "qimg info -U: {err}");
    drop(holder);
    rt.block_on(OpenOptions::new().writable(true).open(&p))
        .expect("open after qemu-io quit");
}

#[test]
fn a_qemu_reader_keeps_qimg_from_writing_but_not_from_reading() {
    qimg_testkit::require_qemu!();
    let dir = image("locks-qemu-reads");
    let p = dir.path("a.qcow2");
    let holder = QemuHolder::open(&dir.0, "a.qcow2", true);
    let rt = runtime();
    let err = rt
        .block_on(OpenOptions::new().writable(true).open(&p))
        .expect_err("writing under a qemu reader")
        .to_string();
    assert!(err.contains("does not let others write"), "{err}");
    rt.block_on(OpenOptions::new().open(&p))
        .expect("reading beside a qemu reader");
    drop(holder);
}

#[test]
fn two_qimg_writers_refuse_each_other_and_locking_off_takes_no_lock() {
    qimg_testkit::require_qemu!();
    let dir = image("locks-two-writers");
    let p = dir.path("a.qcow2");
    let rt = runtime();
    let first = rt
        .block_on(OpenOptions::new().writable(true).open(&p))
        .unwrap();
    let err = rt
        .block_on(OpenOptions::new().writable(true).open(&p))
        .expect_err("second writer")
        .to_string();
    assert!(err.contains("open for writing"), "{err}");
    rt.block_on(first.close()).unwrap();
    drop(first);
    let unlocked = rt
        .block_on(OpenOptions::new().writable(true).locking(false).open(&p))
        .unwrap();
    // No lock taken: QEMU is not kept out (as with its own file.locking=off).
    let (ok, err) = stderr_of(&dir.0, QEMU_IMG, &["info", "a.qcow2"]);
    assert!(ok, "qemu-img info beside an unlocked qimg: {err}");
    rt.block_on(unlocked.close()).unwrap();
}

/// Every qemu-img command that writes an image, run while qemu-io holds it for writing:
/// refused as qemu-img refuses it (the same words, run as `qemu-img`), and the image and its
/// backing file are left byte for byte as they were. Before,
/// `rebase -u`, `create`, `convert` (with and without `-n`) and `dd` wrote into the held
/// files (a header rewritten, files truncated).
#[test]
fn commands_that_write_refuse_an_image_qemu_holds_and_leave_it_alone() {
    qimg_testkit::require_qemu!();
    let dir = image("locks-writers-refused");
    let ours = crate::qemu_dropin::Ours::new(&dir);
    let run = |prog: &Path, args: &[&str]| {
        let o = Command::new(prog)
            .current_dir(&dir.0)
            .args(args)
            .output()
            .expect("run");
        let status = o.status.code();
        (status, String::from_utf8_lossy(&o.stderr).into_owned())
    };
    assert!(
        Command::new(QEMU_IMG)
            .current_dir(&dir.0)
            .args(["create", "-q", "-f", "qcow2", "b.qcow2", "1M"])
            .status()
            .unwrap()
            .success()
    );
    assert!(
        Command::new(QEMU_IMG)
            .current_dir(&dir.0)
            .args([
                "create", "-q", "-f", "qcow2", "-b", "b.qcow2", "-F", "qcow2", "t.qcow2"
            ])
            .status()
            .unwrap()
            .success()
    );
    let holder = QemuHolder::open(&dir.0, "t.qcow2", false);
    let files = ["t.qcow2", "b.qcow2"];
    let before: Vec<Vec<u8>> = files
        .iter()
        .map(|f| std::fs::read(dir.path(f)).unwrap())
        .collect();
    let cases: &[&[&str]] = &[
        &["snapshot", "-c", "s", "t.qcow2"],
        &["commit", "t.qcow2"],
        &["rebase", "-u", "-b", "", "t.qcow2"],
        &["rebase", "-b", "", "t.qcow2"],
        &["bitmap", "--add", "t.qcow2", "bm"],
        &["amend", "-o", "lazy_refcounts=on", "t.qcow2"],
        &["resize", "t.qcow2", "2M"],
        &["create", "-q", "-f", "qcow2", "t.qcow2", "1M"],
        &["create", "-q", "-f", "raw", "t.qcow2", "1M"],
        &["convert", "-n", "-O", "qcow2", "a.qcow2", "t.qcow2"],
        &["convert", "-O", "qcow2", "a.qcow2", "t.qcow2"],
        &["convert", "-O", "raw", "a.qcow2", "t.qcow2"],
        &["dd", "if=a.qcow2", "of=t.qcow2", "-O", "qcow2"],
        &["dd", "if=a.qcow2", "of=t.qcow2"],
        &["check", "-r", "all", "t.qcow2"],
    ];
    for args in cases {
        let theirs = run(Path::new(QEMU_IMG), args);
        let mine = run(&ours.bin().join("qemu-img"), args);
        assert_eq!(mine, theirs, "qemu-img {args:?}: qimg (left), QEMU (right)");
        assert_ne!(theirs.0, Some(0), "QEMU took {args:?}");
        let now: Vec<Vec<u8>> = files
            .iter()
            .map(|f| std::fs::read(dir.path(f)).unwrap())
            .collect();
        assert!(now == before, "qemu-img {args:?} changed a held file");
    }
    drop(holder);
}

/// QEMU's raw driver passes qemu-io's permissions through and shares them all: a raw image
/// held for writing by qemu-io takes bytes 100-101 only and refuses nobody: a second raw
/// writer, readers and `info` (which refuses the writers of a qcow2 image) all get in. Ours
/// holds and is held alike. Before, our qemu-io and info took qcow2's locks on a raw image
/// (refusing others' writes, and refused beside a raw writer).
#[test]
fn raw_images_lock_as_qemus_raw_driver() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("locks-raw");
    let ours = crate::qemu_dropin::Ours::new(&dir);
    assert!(
        Command::new(QEMU_IMG)
            .current_dir(&dir.0)
            .args(["create", "-q", "-f", "raw", "r.raw", "1M"])
            .status()
            .unwrap()
            .success()
    );
    assert!(
        Command::new(QEMU_IMG)
            .current_dir(&dir.0)
            .args(["create", "-q", "-f", "raw", "s.raw", "1M"])
            .status()
            .unwrap()
            .success()
    );
    let probes: &[(&str, &[&str])] = &[
        ("qemu-io", &["-f", "raw", "-c", "write 0 512", "r.raw"]),
        ("qemu-io", &["-f", "raw", "-r", "-c", "read 0 512", "r.raw"]),
        ("qemu-img", &["info", "-U", "r.raw"]),
        ("qemu-img", &["info", "r.raw"]),
        // Writers of a raw image: let in beside a raw holder, as QEMU's.
        (
            "qemu-img",
            &["convert", "-n", "-f", "raw", "-O", "raw", "s.raw", "r.raw"],
        ),
        (
            "qemu-img",
            &["dd", "-f", "raw", "-O", "raw", "if=s.raw", "of=r.raw"],
        ),
        ("qemu-img", &["create", "-f", "raw", "r.raw", "1M"]),
    ];
    let mut seen = Vec::new();
    for holder_prog in [PathBuf::from(QEMU_IO), ours.bin().join("qemu-io")] {
        for read_only in [false, true] {
            let holder = QemuHolder::open_with(&dir.0, &holder_prog, "raw", "r.raw", read_only);
            let mut row = Vec::new();
            for (tool, args) in probes {
                for prog in [PathBuf::from(tool), ours.bin().join(tool)] {
                    let (ok, err) = stderr_of(&dir.0, prog.to_str().unwrap(), args);
                    let why = err.lines().last().unwrap_or("").replace("qimg", "qemu-img");
                    row.push(format!("{tool} {args:?}: {ok} {why}"));
                }
            }
            drop(holder);
            seen.push((holder_prog.clone(), read_only, row));
        }
    }
    for (holder, read_only, row) in &seen {
        // Each probe ran with QEMU's tool, then ours: the same outcome.
        for pair in row.chunks(2) {
            assert_eq!(
                pair[0], pair[1],
                "held by {holder:?} (read-only {read_only}): QEMU's (left) vs ours"
            );
        }
    }
    // Both holders were seen alike, and a raw writer let another writer and info in.
    assert_eq!(seen[0].2, seen[2].2);
    assert!(seen[0].2[0].contains(": true"), "{:?}", seen[0].2);
    assert!(seen[0].2[6].contains(": true"), "{:?}", seen[0].2);
}

//! `qimg serve --nbd` against real NBD clients: qemu-io, qemu-img (map, also of the
//! `qemu:allocation-depth` context), nbdinfo and nbdcopy; block status compared with
//! qemu-nbd serving a copy of the same image. After each run the server is stopped with
//! SIGTERM and the image must pass `qemu-img check` and hold what the clients wrote.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

/// Whether `tool` runs; the same rule as `have_qemu`: skip with a message, or fail when
/// `QIMG_REQUIRE_QEMU=1`.
fn have_tool(test: &str, tool: &str, package: &str) -> bool {
    // openssl has a `version` command instead of the option.
    let version = if tool == "openssl" {
        "version"
    } else {
        "--version"
    };
    let ok = Command::new(tool)
        .arg(version)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        if std::env::var(REQUIRE_ENV).as_deref() == Ok("1") {
            panic!(
                "{test}: {tool} is not installed but {REQUIRE_ENV}=1 requires the interop tests to run"
            );
        }
        eprintln!("SKIPPED {test}: {tool} not found (install {package})");
    }
    ok
}

pub(crate) fn have_qemu_tools(test: &str) -> bool {
    have_qemu(test)
        && have_tool(test, "qemu-io", "qemu-utils")
        && have_tool(test, "qemu-nbd", "qemu-utils")
}

/// A server process (qimg serve or qemu-nbd) that is stopped with SIGTERM.
pub(crate) struct Server {
    child: Child,
    what: String,
}

impl Server {
    /// Starts `prog args` and waits (bounded) until `pidfile` exists.
    fn start(dir: &Path, prog: &Path, args: &[&str], pidfile: &Path) -> Server {
        let child = Command::new(prog)
            .args(args)
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", prog.display()));
        let mut s = Server {
            child,
            what: format!("{} {}", prog.display(), args.join(" ")),
        };
        let guard = qimg_testkit::HangGuard::start(
            format!("{} writing its pid file", s.what),
            Duration::from_millis(500),
            Duration::from_secs(20),
        );
        while !pidfile.exists() {
            if let Some(status) = s.child.try_wait().unwrap() {
                panic!("{} exited before serving: {status}", s.what);
            }
            guard.check();
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    /// Sends SIGTERM and requires a clean exit within 30 seconds.
    pub(crate) fn stop(mut self) {
        let pid = self.child.id().to_string();
        let st = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(st.success());
        let guard = qimg_testkit::HangGuard::start(
            format!("{} stopping on SIGTERM", self.what),
            Duration::from_millis(500),
            Duration::from_secs(30),
        );
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "{} ended with {status}", self.what);
                return;
            }
            guard.check();
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // A failed test must not leave a server running.
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `qimg serve --nbd unix:SOCK IMAGE --persistent` with `extra` options.
pub(crate) fn qimg_serve(dir: &Path, image: &str, sock: &Path, extra: &[&str]) -> Server {
    let pid = dir.join(format!("{image}.qimg.pid"));
    let nbd = format!("unix:{}", sock.display());
    let pid_s = pid.display().to_string();
    let mut args = vec!["serve", "--nbd", &nbd, "--persistent", "--pidfile", &pid_s];
    args.extend_from_slice(extra);
    args.push(image);
    Server::start(dir, &qimg_bin(), &args, &pid)
}

/// `qemu-nbd --socket=SOCK --format=qcow2 --persistent IMAGE` with `extra` options.
pub(crate) fn qemu_nbd(dir: &Path, image: &str, sock: &Path, extra: &[&str]) -> Server {
    let pid = dir.join(format!("{image}.qemu.pid"));
    let sock_o = format!("--socket={}", sock.display());
    let pid_o = format!("--pid-file={}", pid.display());
    let mut args = vec![sock_o.as_str(), "--format=qcow2", "--persistent", &pid_o];
    args.extend_from_slice(extra);
    args.push(image);
    Server::start(dir, Path::new("qemu-nbd"), &args, &pid)
}

pub(crate) fn uri(name: &str, sock: &Path) -> String {
    format!("nbd+unix:///{name}?socket={}", sock.display())
}

/// Runs qemu-io with `cmds` on `target` (`-f fmt`); output must not report an error.
fn qemu_io(dir: &Path, fmt: &str, target: &str, cmds: &[String]) -> String {
    let mut args = vec!["-f".to_string(), fmt.to_string(), target.to_string()];
    for c in cmds {
        args.push("-c".into());
        args.push(c.clone());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = run(dir, Path::new("qemu-io"), &args);
    let out = ok("qemu-io", &o);
    assert!(
        !out.contains("failed") && !out.contains("Pattern verification failed"),
        "qemu-io {args:?}: {out}"
    );
    out
}

pub(crate) fn create(dir: &Path, name: &str, extended_l2: bool, backing: Option<&str>) {
    let mut o = format!("extended_l2={}", if extended_l2 { "on" } else { "off" });
    if let Some(b) = backing {
        let fmt = if b.ends_with(".raw") { "raw" } else { "qcow2" };
        o.push_str(&format!(",backing_file={b},backing_fmt={fmt}"));
    }
    ok(
        "qemu-img create",
        &qemu_img(dir, &["create", "-q", "-f", "qcow2", "-o", &o, name, "64M"]),
    );
}

fn assert_check_clean(dir: &Path, image: &str) {
    ok("qemu-img check", &qemu_img(dir, &["check", image]));
}

fn assert_same_content(dir: &Path, a: &str, b: &str) {
    ok(
        "qemu-img compare",
        &qemu_img(dir, &["compare", "-f", "qcow2", "-F", "qcow2", a, b]),
    );
}

/// The writes of the qemu-io test: patterns (aligned and not), zeroes with and without
/// unmap, discards, and many asynchronous writes in flight at once.
fn workload() -> Vec<String> {
    let mut c = vec![
        "write -P 0x11 0 64k".to_string(),
        "write -P 0x22 100k 3k".into(),
        "write -P 0x33 1M 256k".into(),
        "write -z 1M 64k".into(),
        "write -z -u 1088k 64k".into(),
        "write -P 0x44 2M 128k".into(),
        "discard 2M 64k".into(),
        "write -z 5M 1000".into(),
    ];
    for i in 0..64u64 {
        c.push(format!(
            "aio_write -P {} {} 4k",
            0x50 + i % 16,
            8 * 1024 * 1024 + i * 12 * 1024
        ));
    }
    c.push("aio_flush".into());
    c.push("flush".into());
    c
}

/// Reads that verify the workload through the export.
fn verification() -> Vec<String> {
    let mut c = vec![
        "read -P 0x11 0 64k".to_string(),
        "read -P 0x22 100k 3k".into(),
        "read -P 0 1M 128k".into(),
        "read -P 0x33 1152k 128k".into(),
        "read -P 0x44 2112k 64k".into(),
    ];
    for i in 0..64u64 {
        c.push(format!(
            "read -P {} {} 4k",
            0x50 + i % 16,
            8 * 1024 * 1024 + i * 12 * 1024
        ));
    }
    c
}

fn qemu_io_workload(extended_l2: bool) {
    let test = "qemu_io_workload";
    if !have_qemu_tools(test) {
        return;
    }
    let s = Scratch::new("nbd-io");
    let dir = &s.0;
    create(dir, "served.qcow2", extended_l2, None);
    create(dir, "model.qcow2", extended_l2, None);
    let sock = dir.join("s.sock");
    let server = qimg_serve(dir, "served.qcow2", &sock, &["--export-name", "disk"]);
    qemu_io(dir, "raw", &uri("disk", &sock), &workload());
    qemu_io(dir, "raw", &uri("disk", &sock), &verification());
    server.stop();
    // The same writes straight into a model image by qemu-io.
    qemu_io(dir, "qcow2", "model.qcow2", &workload());
    assert_check_clean(dir, "served.qcow2");
    assert_same_content(dir, "served.qcow2", "model.qcow2");
}

#[test]
fn qemu_io_writes_through_the_export_extended_l2() {
    qemu_io_workload(true);
}

#[test]
fn qemu_io_writes_through_the_export_standard_l2() {
    qemu_io_workload(false);
}

/// A two-layer chain with data, zeros and unallocated ranges in each layer.
/// A qcow2 image over a qcow2 base, or over a sparse raw file (`raw_base`: its holes are
/// zeros to block status, at the raw layer's depth).
fn make_chain(dir: &Path, extended_l2: bool, raw_base: bool) {
    let base = if raw_base { "base.raw" } else { "base.qcow2" };
    if raw_base {
        std::fs::File::create(dir.join(base))
            .and_then(|f| f.set_len(32 << 20))
            .unwrap();
    } else {
        create(dir, base, extended_l2, None);
    }
    let base_writes: &[String] = if raw_base {
        &["write -P 1 0 192k".into(), "write -P 2 1M 4k".into()]
    } else {
        &[
            "write -P 1 0 192k".into(),
            "write -P 2 1M 4k".into(),
            "write -z 2M 64k".into(),
        ]
    };
    let fmt = if raw_base { "raw" } else { "qcow2" };
    qemu_io(dir, fmt, base, base_writes);
    create(dir, "top.qcow2", extended_l2, Some(base));
    qemu_io(
        dir,
        "qcow2",
        "top.qcow2",
        &[
            "write -P 3 64k 64k".into(),
            "write -P 4 4M 8k".into(),
            "write -z 128k 64k".into(),
            "write -z -u 3M 64k".into(),
        ],
    );
}

fn map_json(dir: &Path, args: &[&str]) -> serde_json::Value {
    let mut a = vec!["map", "--output=json"];
    a.extend_from_slice(args);
    json("qemu-img map", &qemu_img(dir, &a))
}

fn block_status_matches_qemu_nbd(extended_l2: bool, raw_base: bool) {
    let test = "block_status_matches_qemu_nbd";
    if !have_qemu_tools(test) {
        return;
    }
    let s = Scratch::new("nbd-map");
    let (src, ours, theirs) = (s.path("src"), s.path("ours"), s.path("theirs"));
    std::fs::create_dir_all(&src).unwrap();
    make_chain(&src, extended_l2, raw_base);
    // Both servers get a copy made the same way (cp turns unwritten extents into holes).
    ok("cp", &run(&s.0, Path::new("cp"), &["-r", "src/.", "ours"]));
    ok(
        "cp",
        &run(&s.0, Path::new("cp"), &["-r", "src/.", "theirs"]),
    );
    let (sq, sn) = (s.path("q.sock"), s.path("n.sock"));
    let q = qimg_serve(
        &ours,
        "top.qcow2",
        &sq,
        &["--readonly", "--allocation-depth"],
    );
    let n = qemu_nbd(
        &theirs,
        "top.qcow2",
        &sn,
        &["--read-only", "--allocation-depth"],
    );
    let q_map = map_json(&s.0, &[&uri("", &sq)]);
    let n_map = map_json(&s.0, &[&uri("", &sn)]);
    assert_eq!(q_map, n_map, "base:allocation through qemu-img map");
    let opts = |sock: &PathBuf| {
        format!(
            "driver=nbd,server.type=unix,server.path={},x-dirty-bitmap=qemu:allocation-depth",
            sock.display()
        )
    };
    let q_depth = map_json(&s.0, &["--image-opts", &opts(&sq)]);
    let n_depth = map_json(&s.0, &["--image-opts", &opts(&sn)]);
    assert_eq!(
        q_depth, n_depth,
        "qemu:allocation-depth through x-dirty-bitmap"
    );
    if have_tool(test, "nbdinfo", "libnbd-bin") {
        for ctx in ["base:allocation", "qemu:allocation-depth"] {
            let m = format!("--map={ctx}");
            let qo = ok(
                "nbdinfo",
                &run(&s.0, Path::new("nbdinfo"), &[&m, &uri("", &sq)]),
            );
            let no = ok(
                "nbdinfo",
                &run(&s.0, Path::new("nbdinfo"), &[&m, &uri("", &sn)]),
            );
            assert_eq!(qo, no, "nbdinfo {m}");
            assert!(
                qo.lines().count() >= 4,
                "too few extents to prove anything: {qo}"
            );
        }
    }
    q.stop();
    n.stop();
    assert_check_clean(&ours, "top.qcow2");
    assert_same_content(&ours, "top.qcow2", "../theirs/top.qcow2");
}

/// A qcow2 image read from an NBD export (qemu-nbd serving the file as raw) cannot grow: a
/// write that needs a new cluster fails, through `qimg serve` (whose engine zeroes a new L2
/// table with write-zeroes), and the image stays consistent. Write-zeroes past the end of an
/// export used to "succeed" without sending anything, and the L1 table then named a table
/// past the end of the file (`qemu-img check`: a reference past the end of the file).
#[test]
fn a_qcow2_image_on_an_nbd_export_cannot_grow_and_stays_consistent() {
    if !have_qemu_tools("a_qcow2_image_on_an_nbd_export_cannot_grow_and_stays_consistent") {
        return;
    }
    let s = Scratch::new("nbd-no-growth");
    create(&s.0, "d.qcow2", true, None);
    let (inner, outer) = (s.path("inner.sock"), s.path("outer.sock"));
    let n = qemu_nbd(&s.0, "d.qcow2", &inner, &["--format=raw"]);
    let pid = s.path("outer.pid");
    let (nbd, pid_s, image) = (
        format!("unix:{}", outer.display()),
        pid.display().to_string(),
        uri("", &inner),
    );
    let q = Server::start(
        &s.0,
        &qimg_bin(),
        &[
            "serve",
            "--nbd",
            &nbd,
            "--persistent",
            "--pidfile",
            &pid_s,
            &image,
        ],
        &pid,
    );
    let o = run(
        &s.0,
        Path::new("qemu-io"),
        &[
            "-f",
            "raw",
            "-c",
            "write -P 7 0 4k",
            "-c",
            "read -P 0 0 4k",
            &uri("", &outer),
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("write failed"), "the write must fail: {out}");
    assert!(
        out.contains("read 4096/4096"),
        "and the image still reads: {out}"
    );
    q.stop();
    n.stop();
    assert_check_clean(&s.0, "d.qcow2");
}

/// An NBD export as the backing file of a new image, named by its URI: `create -b URI -F
/// raw` as qemu-img (the export must answer, in qemu-img's words when it does not; its name
/// is not a path to resolve), against qemu-nbd at its defaults, which serves one client and
/// exits (the create connects once); then the image reads through to it, and qemu-img maps
/// it as qimg does.
#[test]
fn an_nbd_export_is_a_backing_file_by_its_uri() {
    if !have_qemu_tools("an_nbd_export_is_a_backing_file_by_its_uri") {
        return;
    }
    let s = Scratch::new("nbd-backing");
    create(&s.0, "b.qcow2", false, None);
    qemu_io(&s.0, "qcow2", "b.qcow2", &["write -P 1 0 1M".into()]);
    let sock = s.path("b.sock");
    let bin = s.path("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::os::unix::fs::symlink(qimg_bin(), bin.join("qemu-img")).unwrap();
    let backing = uri("", &sock);
    let create_args = [
        "create", "-q", "-f", "qcow2", "-b", &backing, "-F", "raw", "t.qcow2", "4M",
    ];
    // Nothing serves the socket yet: both refuse, in the same words.
    let theirs = run(&s.0, Path::new("qemu-img"), &create_args);
    let mine = run(&s.0, &bin.join("qemu-img"), &create_args);
    assert!(!mine.status.success(), "no export, no image");
    assert_eq!(
        String::from_utf8_lossy(&mine.stderr),
        String::from_utf8_lossy(&theirs.stderr)
    );
    let _ = std::fs::remove_file(s.path("t.qcow2"));
    // qemu-nbd at its defaults: one client, then it exits.
    let pid = s.path("once.pid");
    let (sock_o, pid_o) = (
        format!("--socket={}", sock.display()),
        format!("--pid-file={}", pid.display()),
    );
    let once = Server::start(
        &s.0,
        Path::new("qemu-nbd"),
        &[&sock_o, "--format=qcow2", "--read-only", &pid_o, "b.qcow2"],
        &pid,
    );
    ok(
        "create with an NBD backing file",
        &run(&s.0, &bin.join("qemu-img"), &create_args),
    );
    drop(once);
    let n = qemu_nbd(&s.0, "b.qcow2", &sock, &["--read-only"]);
    let o = run(
        &s.0,
        &qimg_bin(),
        &[
            "io",
            "-c",
            "read -P 1 0 64k",
            "-c",
            "write -P 2 64k 64k",
            "t.qcow2",
        ],
    );
    let out = ok("qimg io", &o);
    assert!(!out.contains("failed"), "{out}");
    let theirs = map_json(&s.0, &["t.qcow2"]);
    let mine = run(
        &s.0,
        &bin.join("qemu-img"),
        &["map", "--output=json", "t.qcow2"],
    );
    assert_eq!(json("qimg map", &mine), theirs);
    // qemu-img check opens the backing file too: the export is still served.
    assert_check_clean(&s.0, "t.qcow2");
    n.stop();
}

#[test]
fn block_status_matches_qemu_nbd_extended_l2() {
    block_status_matches_qemu_nbd(true, false);
}

#[test]
fn block_status_matches_qemu_nbd_standard_l2() {
    block_status_matches_qemu_nbd(false, false);
}

/// The holes of a raw backing file are zeros at its depth, as qemu-nbd reports them (they
/// were reported as data).
#[test]
fn block_status_matches_qemu_nbd_over_a_sparse_raw_file() {
    block_status_matches_qemu_nbd(true, true);
}

#[test]
fn nbdinfo_lists_and_nbdcopy_copies_both_ways() {
    let test = "nbdinfo_lists_and_nbdcopy_copies_both_ways";
    if have_nbd_tools(test) {
        nbdcopy_both_ways(Some("4"), &["--connections=4"]);
    }
}

/// nbdcopy at its defaults against the default export (one client at a time): the export
/// must not advertise multi-conn (nbdcopy's second connection would wait for the first
/// forever), as qemu-nbd does not.
#[test]
fn nbdcopy_at_its_defaults_copies_both_ways_with_one_client_at_a_time() {
    let test = "nbdcopy_at_its_defaults_copies_both_ways_with_one_client_at_a_time";
    if have_nbd_tools(test) {
        nbdcopy_both_ways(None, &[]);
    }
}

fn have_nbd_tools(test: &str) -> bool {
    have_qemu(test)
        && have_tool(test, "nbdinfo", "libnbd-bin")
        && have_tool(test, "nbdcopy", "libnbd-bin")
}

/// Copies 64 MiB into an export of `qimg serve --nbd` (with `--shared N` if given) and out
/// again with nbdcopy and `nbdcopy_args`; `can_multi_conn` must be what qemu-nbd says with
/// the same `-e`.
fn nbdcopy_both_ways(shared: Option<&str>, nbdcopy_args: &[&str]) {
    let s = Scratch::new(&format!("nbd-copy-{}", shared.unwrap_or("1")));
    let dir = &s.0;
    create(dir, "a.qcow2", true, None);
    // 64 MiB of input: a pattern with runs of zeros (which nbdcopy may send as zeroing).
    let mut data = vec![0u8; 64 << 20];
    for (i, chunk) in data.chunks_mut(1 << 16).enumerate() {
        if i % 3 != 0 {
            for (j, b) in chunk.iter_mut().enumerate() {
                *b = (i * 7 + j / 512) as u8 | 1;
            }
        }
    }
    std::fs::write(s.path("in.raw"), &data).unwrap();
    let multi_conn = |server: Server, sock: &Path| {
        let list = ok(
            "nbdinfo --list",
            &run(dir, Path::new("nbdinfo"), &["--list", &uri("", sock)]),
        );
        server.stop();
        let line = list
            .lines()
            .find(|l| l.contains("can_multi_conn"))
            .unwrap_or_else(|| panic!("no can_multi_conn in {list}"))
            .trim()
            .to_string();
        (line, list)
    };
    let mut extra = vec!["--export-name", "vol", "--description", "a test volume"];
    let mut qemu_extra = vec!["-x", "vol"];
    if let Some(n) = shared {
        extra.extend(["--shared", n]);
        qemu_extra.extend(["-e", n]);
    }
    let qsock = s.path("q.sock");
    let (theirs, _) = multi_conn(qemu_nbd(dir, "a.qcow2", &qsock, &qemu_extra), &qsock);
    let sock = s.path("s.sock");
    let (ours, list) = multi_conn(qimg_serve(dir, "a.qcow2", &sock, &extra), &sock);
    assert!(list.contains("export=\"vol\""), "{list}");
    assert!(list.contains("a test volume"), "{list}");
    assert_eq!(ours, theirs, "multi-conn differs from qemu-nbd's");
    let server = qimg_serve(dir, "a.qcow2", &sock, &extra);
    let u = uri("vol", &sock);
    // A hang guard, not a time limit: each copy takes about a second when it works.
    let nbdcopy = |args: &[&str]| {
        let mut all = vec!["300", "nbdcopy"];
        all.extend(nbdcopy_args);
        all.extend(args);
        run(dir, Path::new("timeout"), &all)
    };
    ok("nbdcopy in", &nbdcopy(&["in.raw", &u]));
    ok("nbdcopy out", &nbdcopy(&[&u, "out.raw"]));
    let map = ok(
        "nbdinfo --map",
        &run(dir, Path::new("nbdinfo"), &["--map", &u]),
    );
    assert!(map.contains("data") && map.contains("hole,zero"), "{map}");
    server.stop();
    assert_eq!(
        std::fs::read(s.path("out.raw")).unwrap(),
        data,
        "nbdcopy out differs"
    );
    assert_check_clean(dir, "a.qcow2");
    ok(
        "qemu-img compare",
        &qemu_img(
            dir,
            &["compare", "-f", "raw", "-F", "qcow2", "in.raw", "a.qcow2"],
        ),
    );
}

#[test]
fn a_read_only_export_refuses_writes_and_leaves_the_image_unchanged() {
    let test = "a_read_only_export_refuses_writes";
    if !have_qemu_tools(test) {
        return;
    }
    let s = Scratch::new("nbd-ro");
    let dir = &s.0;
    create(dir, "a.qcow2", true, None);
    qemu_io(dir, "qcow2", "a.qcow2", &["write -P 9 0 64k".into()]);
    let before = std::fs::read(s.path("a.qcow2")).unwrap();
    let sock = s.path("s.sock");
    let server = qimg_serve(dir, "a.qcow2", &sock, &["--readonly"]);
    // qemu-io refuses to open the export for writing once it sees NBD_FLAG_READ_ONLY (the
    // server's EPERM for writes that do arrive is tested in qimg-serve's hostile tests).
    for cmd in ["write -P 1 0 4k", "write -z 0 4k", "discard 0 64k"] {
        let o = run(
            dir,
            Path::new("qemu-io"),
            &["-f", "raw", "-c", cmd, &uri("", &sock)],
        );
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(
            text.contains("read-only")
                || text.contains("not permitted")
                || text.contains("Permission denied")
                || text.contains("failed"),
            "{cmd} on a read-only export: {text}"
        );
    }
    let u = uri("", &sock);
    let o = run(
        dir,
        Path::new("qemu-io"),
        &["-r", "-f", "raw", "-c", "read -P 9 0 64k", &u],
    );
    let out = ok("qemu-io -r", &o);
    assert!(!out.contains("failed"), "{out}");
    server.stop();
    assert_eq!(std::fs::read(s.path("a.qcow2")).unwrap(), before);
}

/// Makes, under `dir`, credentials as QEMU's tls-creds-x509 reads them: `srv` (CA 1's
/// server), `cli` (CA 1's client), `bad` (a client of CA 2 trusting only CA 2) and `mixed`
/// (a client of CA 2 that trusts both CAs, so that only the server can refuse it).
fn make_credentials(dir: &Path) {
    let script = r#"set -e
mkca() { mkdir -p $1; openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -keyout $1/ca-key.pem -out $1/ca-cert.pem -days 2 -subj /CN=$1 \
  -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign; }
leaf() { mkdir -p $2; openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -keyout $2/$3-key.pem -out $2/$3.csr -subj /CN=$3
  printf "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=${3}Auth\nsubjectAltName=DNS:localhost\n" > $2/$3.ext
  openssl x509 -req -in $2/$3.csr -CA $1/ca-cert.pem -CAkey $1/ca-key.pem -set_serial $4 \
    -out $2/$3-cert.pem -days 2 -extfile $2/$3.ext
  cp $1/ca-cert.pem $2/ca-cert.pem; }
mkca ca1; mkca ca2
leaf ca1 srv server 11; leaf ca1 cli client 12; leaf ca2 bad client 21; leaf ca2 mixed client 22
cat ca1/ca-cert.pem ca2/ca-cert.pem > mixed/ca-cert.pem
"#;
    ok("openssl", &run(dir, Path::new("sh"), &["-c", script]));
}

/// qemu's image options for the export over TLS with the client credentials in `creds`.
fn tls_args(dir: &Path, sock: &Path, creds: &str) -> [String; 4] {
    [
        "--object".into(),
        format!(
            "tls-creds-x509,id=tls0,endpoint=client,dir={}",
            dir.join(creds).display()
        ),
        "--image-opts".into(),
        format!(
            "driver=nbd,path={},tls-creds=tls0,tls-hostname=localhost",
            sock.display()
        ),
    ]
}

#[test]
fn tls_is_required_and_only_clients_of_the_ca_get_in() {
    let test = "tls_is_required_and_only_clients_of_the_ca_get_in";
    if !have_qemu_tools(test) || !have_tool(test, "openssl", "openssl") {
        return;
    }
    let s = Scratch::new("nbd-tls");
    let dir = &s.0;
    make_credentials(dir);
    create(dir, "a.qcow2", true, None);
    create(dir, "model.qcow2", true, None);
    let sock = s.path("s.sock");
    let server = qimg_serve(
        dir,
        "a.qcow2",
        &sock,
        &["--tls-creds", "srv", "--shared", "2"],
    );
    let io = |creds: &str, cmds: &[&str]| {
        let mut args: Vec<String> = tls_args(dir, &sock, creds).into();
        for c in cmds {
            args.push("-c".into());
            args.push((*c).into());
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run(dir, Path::new("qemu-io"), &args)
    };
    let writes = [
        "write -P 0x5a 0 1M",
        "write -P 0x6b 3M 100k",
        "write -z 512k 64k",
    ];
    let out = ok("qemu-io over TLS", &io("cli", &writes));
    assert!(!out.contains("failed"), "{out}");
    let out = ok(
        "qemu-io over TLS",
        &io("cli", &["read -P 0x6b 3M 100k", "read -P 0 512k 64k"]),
    );
    assert!(!out.contains("failed"), "{out}");
    // Without TLS: refused during the handshake.
    let o = qemu_img(dir, &["info", &uri("", &sock)]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("TLS"),
        "plain client: {err}"
    );
    // A server certificate from a CA the client does not trust: the client refuses.
    let o = io("bad", &["read 0 4k"]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        !o.status.success() || text.contains("failed"),
        "client of CA 2: {text}"
    );
    assert!(
        !text.contains("read 4096/4096"),
        "client of CA 2 read data: {text}"
    );
    // A client certificate from another CA: the server refuses.
    let o = io("mixed", &["read 0 4k"]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        !text.contains("read 4096/4096"),
        "client certificate of CA 2 got in: {text}"
    );
    // The server still serves clients of its CA.
    let mut info: Vec<String> = vec!["info".into()];
    info.extend(tls_args(dir, &sock, "cli"));
    let info: Vec<&str> = info.iter().map(String::as_str).collect();
    let out = ok("qemu-img info over TLS", &qemu_img(dir, &info));
    assert!(out.contains("virtual size: 64 MiB"), "{out}");
    server.stop();
    let w: Vec<String> = writes.iter().map(|w| w.to_string()).collect();
    qemu_io(dir, "qcow2", "model.qcow2", &w);
    assert_check_clean(dir, "a.qcow2");
    assert_same_content(dir, "a.qcow2", "model.qcow2");
}

#[test]
fn without_persistent_the_server_exits_after_its_client_and_leaves_the_image_clean() {
    let test = "without_persistent_the_server_exits_after_its_client";
    if !have_qemu_tools(test) {
        return;
    }
    let s = Scratch::new("nbd-once");
    let dir = &s.0;
    create(dir, "a.qcow2", false, None);
    let (sock, pid) = (s.path("s.sock"), s.path("pid"));
    let nbd = format!("unix:{}", sock.display());
    let pid_s = pid.display().to_string();
    let args = ["serve", "--nbd", &nbd, "--pidfile", &pid_s, "a.qcow2"];
    let mut server = Server::start(dir, &qimg_bin(), &args, &pid);
    let text = std::fs::read_to_string(&pid).unwrap();
    assert_eq!(text.trim(), server.child.id().to_string());
    qemu_io(
        dir,
        "raw",
        &uri("", &sock),
        &["write -P 7 100k 300k".into()],
    );
    let guard = qimg_testkit::HangGuard::start(
        "the server's exit",
        Duration::from_millis(500),
        Duration::from_secs(30),
    );
    let status = loop {
        if let Some(st) = server.child.try_wait().unwrap() {
            break st;
        }
        guard.check();
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
    assert!(
        !sock.exists() && !pid.exists(),
        "socket or pid file left behind"
    );
    assert_check_clean(dir, "a.qcow2");
    create(dir, "model.qcow2", false, None);
    qemu_io(
        dir,
        "qcow2",
        "model.qcow2",
        &["write -P 7 100k 300k".into()],
    );
    assert_same_content(dir, "a.qcow2", "model.qcow2");
}

#[test]
fn tcp_exports_bind_the_address_given() {
    let test = "tcp_exports_bind_the_address_given";
    if !have_qemu_tools(test) {
        return;
    }
    let s = Scratch::new("nbd-tcp");
    let dir = &s.0;
    create(dir, "a.qcow2", true, None);
    // A free loopback port (the kernel's choice; released just before the server binds it).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let pid = s.path("pid");
    let pid_s = pid.display().to_string();
    let args = [
        "serve",
        "--nbd",
        &addr,
        "--persistent",
        "--pidfile",
        &pid_s,
        "-x",
        "t",
        "a.qcow2",
    ];
    let server = Server::start(dir, &qimg_bin(), &args, &pid);
    let url = format!("nbd://127.0.0.1:{port}/t");
    qemu_io(
        dir,
        "raw",
        &url,
        &["write -P 0x77 0 64k".into(), "read -P 0x77 0 64k".into()],
    );
    server.stop();
    assert_check_clean(dir, "a.qcow2");
    create(dir, "model.qcow2", true, None);
    qemu_io(dir, "qcow2", "model.qcow2", &["write -P 0x77 0 64k".into()]);
    assert_same_content(dir, "a.qcow2", "model.qcow2");
}

/// SIGTERM while clients write: the server finishes what is in flight, flushes and closes, so
/// the image is clean (no corruption, no leak) and every write a client saw acknowledged
/// before the signal is there. `--shared 2` serves two clients at once; a third waits in the
/// listen queue and is served once one leaves.
#[test]
fn sigterm_under_load_leaves_the_image_clean_and_shared_limits_clients() {
    let test = "sigterm_under_load_leaves_the_image_clean_and_shared_limits_clients";
    if !have_qemu_tools(test) {
        return;
    }
    let s = Scratch::new("nbd-term");
    let dir = &s.0;
    create(dir, "a.qcow2", true, None);
    let sock = s.path("s.sock");
    let server = qimg_serve(dir, "a.qcow2", &sock, &["--shared", "2"]);
    let target = uri("", &sock);
    // Two long-lived clients hold both slots...
    let hold = |cmds: &[&str]| {
        let mut c = Command::new("qemu-io");
        c.args(["-f", "raw", &target]).current_dir(dir);
        for cmd in cmds {
            c.args(["-c", cmd]);
        }
        c.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut writers: Vec<Child> = (0..2)
        .map(|w| {
            let cmds: Vec<String> = (0..64)
                .map(|i| format!("aio_write -P {} {}k 64k", w + 1, (w * 64 + i) * 128))
                .chain(std::iter::once("aio_flush".to_string()))
                .chain(std::iter::once("sleep 3000".to_string()))
                .collect();
            let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
            hold(&cmds)
        })
        .collect();
    // ...so a third client is not served while they are connected: its read does not finish.
    std::thread::sleep(Duration::from_millis(500));
    let mut third = hold(&["read 0 4k"]);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        third.try_wait().unwrap().is_none(),
        "a third client was served with --shared 2"
    );
    // Signal the server while the writers may still have requests in flight and the third
    // client waits.
    server.stop();
    let mut acknowledged = Vec::new();
    for (w, writer) in writers.drain(..).enumerate() {
        let out = writer.wait_with_output().unwrap();
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            // "wrote 65536/65536 bytes at offset 131072"
            if let Some(at) = line
                .strip_prefix("wrote 65536/65536 bytes at offset ")
                .and_then(|n| n.trim().parse::<u64>().ok())
            {
                acknowledged.push(format!("read -P {} {at} 64k", w + 1));
            }
        }
    }
    let _ = third.kill();
    let _ = third.wait();
    assert_check_clean(dir, "a.qcow2");
    assert!(!acknowledged.is_empty(), "no write was acknowledged");
    qemu_io(dir, "qcow2", "a.qcow2", &acknowledged);
}

/// Issue 31: qimg's NBD client. Installed as qemu-io and qemu-img, qimg opens
/// `nbd+unix://` exports of qemu-nbd and of `qimg serve --nbd` as images: qemu-io commands
/// print what qemu-io prints on the same export, `convert` copies an export to the same
/// image qemu-img makes, and `compare` reads the export against a file.
#[test]
fn the_nbd_client_reads_and_writes_exports_of_qemu_nbd_and_qimg_serve() {
    let name = "the_nbd_client_reads_and_writes_exports_of_qemu_nbd_and_qimg_serve";
    if !have_qemu_tools(name) {
        return;
    }
    let dir = Scratch::new("nbd-client");
    let bin = dir.path("bin");
    std::fs::create_dir_all(&bin).unwrap();
    for tool in ["qemu-img", "qemu-io"] {
        std::os::unix::fs::symlink(qimg_bin(), bin.join(tool)).unwrap();
    }
    let mask = |o: &std::process::Output| {
        let text = |b: &[u8]| {
            String::from_utf8_lossy(b)
                .lines()
                .filter(|l| !l.contains("ops/sec"))
                .collect::<Vec<_>>()
                .join("\n")
        };
        (text(&o.stdout), text(&o.stderr), o.status.code())
    };
    for server in ["qemu-nbd", "qimg"] {
        let image = format!("{server}.qcow2");
        ok(
            "create",
            &qemu_img(
                &dir.0,
                &[
                    "create",
                    "-q",
                    "-f",
                    "qcow2",
                    "-o",
                    "extended_l2=on",
                    &image,
                    "8M",
                ],
            ),
        );
        common::qemu_io(
            &dir.0,
            "qcow2",
            &image,
            &["write -P 0x42 0 1M", "write -z 2M 1M", "write -P 7 5M 4k"],
        );
        let sock = dir.path(&format!("{server}.sock"));
        let srv = match server {
            "qemu-nbd" => qemu_nbd(&dir.0, &image, &sock, &[]),
            _ => qimg_serve(&dir.0, &image, &sock, &[]),
        };
        let export = uri("", &sock);
        let io = |prog: &Path, cmds: &[&str]| {
            let mut args = vec!["-f", "raw"];
            for c in cmds {
                args.extend_from_slice(&["-c", c]);
            }
            args.push(&export);
            mask(&run(&dir.0, prog, &args))
        };
        // Reads, then writes read back, then the same reads again: each tool's run on the
        // export as the other left it.
        let cmds = [
            "read -P 0x42 0 64k",
            "read -P 0 2M 4k",
            "read -P 7 5M 4k",
            "write -P 9 1M 64k",
            "read -P 9 1M 64k",
            "length",
        ];
        let want = io(Path::new("qemu-io"), &cmds);
        let got = io(&bin.join("qemu-io"), &cmds);
        assert_eq!(got, want, "{server}: qemu-io commands on the export");
        // info says what qemu-img says of an export (no disk size, protocol nbd).
        for args in [
            &["info", "-f", "raw", export.as_str()][..],
            &["info", "--output=json", &export],
        ] {
            let want = mask(&run(&dir.0, Path::new("qemu-img"), args));
            let got = mask(&run(&dir.0, &bin.join("qemu-img"), args));
            assert_eq!(got, want, "{server}: {args:?}");
        }
        // The map from the server's block status, as qemu-img prints it.
        for args in [
            &["map", "-f", "raw", export.as_str()][..],
            &["map", "-f", "raw", "--output=json", &export],
        ] {
            let want = mask(&run(&dir.0, Path::new("qemu-img"), args));
            let got = mask(&run(&dir.0, &bin.join("qemu-img"), args));
            assert_eq!(got, want, "{server}: {args:?}");
        }
        // convert and compare read the export.
        for (who, prog) in [
            ("qemu", PathBuf::from("qemu-img")),
            ("qimg", bin.join("qemu-img")),
        ] {
            let out = format!("{server}-{who}.qcow2");
            let o = run(
                &dir.0,
                &prog,
                &["convert", "-f", "raw", "-O", "qcow2", &export, &out],
            );
            assert!(o.status.success(), "{who} convert from {server}: {o:?}");
        }
        let a = format!("{server}-qemu.qcow2");
        let b = format!("{server}-qimg.qcow2");
        ok("compare", &qemu_img(&dir.0, &["compare", &a, &b]));
        let o = run(
            &dir.0,
            &bin.join("qemu-img"),
            &["compare", "-f", "raw", "-F", "qcow2", &export, &a],
        );
        assert!(o.status.success(), "{server}: compare of the export: {o:?}");
        srv.stop();
        assert_clean(&dir.0, &image, server);
    }
    // Servers that are not there, and an export that is not: QEMU's words.
    let gone = format!("nbd+unix:///x?socket={}", dir.path("none.sock").display());
    for args in [
        &["info", "nbd://localhost:1/x"][..],
        &["info", gone.as_str()],
        &["convert", "-O", "raw", "nbd://localhost:1/", "o.raw"],
    ] {
        let want = mask(&run(&dir.0, Path::new("qemu-img"), args));
        let got = mask(&run(&dir.0, &bin.join("qemu-img"), args));
        assert_eq!(got, want, "{args:?}");
    }
    // A TLS URI without credentials is refused in words, not attempted.
    let o = run(
        &dir.0,
        &bin.join("qemu-img"),
        &["info", "nbds://localhost/x"],
    );
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("tls-certificates=DIR"), "{o:?}");
}

/// Issue 31: the NBD client over TLS. Installed as qemu-io and qemu-img, qimg takes QEMU's
/// `--object tls-creds-x509,...,endpoint=client` and `--image-opts driver=nbd,...,tls-creds=`
/// (and the `json:` form) against qemu-nbd and `qimg serve` requiring TLS: qemu-io commands
/// print what qemu-io prints, `qemu-img map` and `compare` agree; a server certificate from
/// another CA, missing credentials and a plain client are refused; libnbd's
/// `nbds+unix://...?tls-certificates=DIR` URI works too.
#[test]
fn the_nbd_client_speaks_tls_as_qemus_does() {
    let name = "the_nbd_client_speaks_tls_as_qemus_does";
    if !have_qemu_tools(name) || !have_tool(name, "openssl", "openssl") {
        return;
    }
    let s = Scratch::new("nbd-tls-client");
    let dir = &s.0;
    make_credentials(dir);
    let bin = s.path("bin");
    std::fs::create_dir_all(&bin).unwrap();
    for tool in ["qemu-img", "qemu-io"] {
        std::os::unix::fs::symlink(qimg_bin(), bin.join(tool)).unwrap();
    }
    let mask = |o: &std::process::Output| {
        let text = |b: &[u8]| {
            String::from_utf8_lossy(b)
                .lines()
                .filter(|l| !l.contains("ops/sec"))
                .collect::<Vec<_>>()
                .join("\n")
        };
        (text(&o.stdout), text(&o.stderr), o.status.code())
    };
    for server in ["qemu-nbd", "qimg"] {
        let image = format!("{server}.qcow2");
        create(dir, &image, true, None);
        let sock = s.path(&format!("{server}.sock"));
        let srv_dir = s.path("srv").display().to_string();
        let srv_obj = format!("tls-creds-x509,id=tls0,endpoint=server,dir={srv_dir}");
        let srv = match server {
            "qemu-nbd" => qemu_nbd(
                dir,
                &image,
                &sock,
                &["--object", &srv_obj, "--tls-creds", "tls0", "--shared=4"],
            ),
            _ => qimg_serve(dir, &image, &sock, &["--tls-creds", "srv", "--shared", "4"]),
        };
        let run_tool = |prog: &Path, creds: &str, tail: &[&str]| {
            let mut args: Vec<String> = tls_args(dir, &sock, creds).into();
            args.extend(tail.iter().map(|t| t.to_string()));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            mask(&run(dir, prog, &args))
        };
        // qemu-io: writes, then reads of what each tool wrote.
        let io = |prog: &Path, creds: &str, cmds: &[&str]| {
            let mut tail = Vec::new();
            for c in cmds {
                tail.extend(["-c", *c]);
            }
            run_tool(prog, creds, &tail)
        };
        let cmds = [
            "write -P 0x5a 0 1M",
            "write -z 512k 64k",
            "read -P 0x5a 0 512k",
            "read -P 0 512k 64k",
            "length",
        ];
        let want = io(Path::new("qemu-io"), "cli", &cmds);
        assert_eq!(want.2, Some(0), "{server}: {want:?}");
        let got = io(&bin.join("qemu-io"), "cli", &cmds);
        assert_eq!(got, want, "{server}: qemu-io over TLS");
        // qemu-img map of the export over TLS.
        for tail in [&["map"][..], &["map", "--output=json"]] {
            let mut t = vec![tail[0]];
            let rest: Vec<&str> = tail[1..].to_vec();
            t.extend(rest);
            let want = run_tool(Path::new("qemu-img"), "cli", &t);
            let got = run_tool(&bin.join("qemu-img"), "cli", &t);
            assert_eq!(got.0, want.0, "{server}: {t:?}");
            assert_eq!(got.2, want.2, "{server}: {t:?}");
        }
        // A server certificate of a CA the client does not trust: refused, nothing read.
        let got = io(&bin.join("qemu-io"), "bad", &["read 0 4k"]);
        assert_eq!(got.2, Some(1), "{server}: untrusted server: {got:?}");
        assert!(got.1.contains("certificate"), "{server}: {got:?}");
        // No such credentials object; credentials of the server's endpoint.
        for (obj, opts, want) in [
            (
                "tls-creds-x509,id=tls0,endpoint=client,dir=cli",
                format!("driver=nbd,path={},tls-creds=nope", sock.display()),
                "No TLS credentials with id 'nope'",
            ),
            (
                "tls-creds-x509,id=tls0,endpoint=server,dir=srv",
                format!("driver=nbd,path={},tls-creds=tls0", sock.display()),
                "Expected TLS credentials for a client endpoint",
            ),
        ] {
            let args = ["--object", obj, "--image-opts", &opts, "-c", "read 0 4k"];
            let theirs = mask(&run(dir, Path::new("qemu-io"), &args));
            let ours = mask(&run(dir, &bin.join("qemu-io"), &args));
            assert!(theirs.1.contains(want), "{theirs:?}");
            assert_eq!(ours, theirs);
        }
        // libnbd's URI, and the json: form.
        let cli = s.path("cli").display().to_string();
        let url = format!(
            "nbds+unix:///?socket={}&tls-certificates={cli}&tls-hostname=localhost",
            sock.display()
        );
        let got = mask(&run(
            dir,
            &bin.join("qemu-io"),
            &["-f", "raw", "-c", "read -P 0x5a 0 4k", &url],
        ));
        assert_eq!(got.2, Some(0), "{server}: {got:?}");
        assert!(!got.0.contains("fail"), "{server}: {got:?}");
        let json = format!(
            r#"json:{{"driver":"raw","file":{{"driver":"nbd","server":{{"type":"unix","path":"{}"}},"tls-creds":"tls0"}}}}"#,
            sock.display()
        );
        let obj = format!("tls-creds-x509,id=tls0,endpoint=client,dir={cli}");
        let args = ["--object", obj.as_str(), "-c", "read -P 0 512k 64k", &json];
        let want = mask(&run(dir, Path::new("qemu-io"), &args));
        let got = mask(&run(dir, &bin.join("qemu-io"), &args));
        // (A Unix socket without tls-hostname has no name to check the certificate
        // against: QEMU refuses it, and so does qimg.)
        assert!(
            want.1.contains("No hostname for certificate validation"),
            "{want:?}"
        );
        assert_eq!(got, want, "{server}: json: over TLS without tls-hostname");
        let json = json.replace(
            r#""tls-creds""#,
            r#""tls-hostname":"localhost","tls-creds""#,
        );
        let args = ["--object", obj.as_str(), "-c", "read -P 0 512k 64k", &json];
        let want = mask(&run(dir, Path::new("qemu-io"), &args));
        let got = mask(&run(dir, &bin.join("qemu-io"), &args));
        assert_eq!(want.2, Some(0), "{want:?}");
        assert_eq!(got, want, "{server}: json: over TLS");
        drop(srv);
        // What both tools wrote over TLS is in the image.
        common::qemu_io(dir, "qcow2", &image, &["read -P 0x5a 0 512k"]);
    }
}

/// `qemu-img bench` on an export (it was refused: bench opened only files), qemu-io's raw
/// probe warning naming the export by its canonical URI, and a missing export refused
/// without qemu-nbd reporting a client that vanished mid-negotiation (QEMU's client ends
/// the handshake with `NBD_OPT_ABORT`): the same output as QEMU's tools.
#[test]
fn bench_and_refusals_on_an_export_speak_as_qemu_tools() {
    if !have_qemu_tools("bench_and_refusals_on_an_export_speak_as_qemu_tools") {
        return;
    }
    use crate::qemu_dropin::{Ours, masked};
    let s = Scratch::new("nbd-bench");
    let ours = Ours::new(&s);
    create(&s.0, "a.qcow2", false, None);
    qemu_io(&s.0, "qcow2", "a.qcow2", &["write -P 1 0 1M".into()]);
    let sock = s.path("a.sock");
    // qemu-nbd's own messages (stderr) are kept, so a complaint shows in the comparison.
    let log = s.path("qemu-nbd.log");
    let mut server = Command::new("qemu-nbd")
        .args([
            &format!("--socket={}", sock.display()),
            "--format=qcow2",
            "--persistent",
            "a.qcow2",
        ])
        .current_dir(&s.0)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    // Hang guard: qemu-nbd listens within milliseconds; 10 s is far more.
    for _ in 0..1000 {
        if sock.exists() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let export = uri("", &sock);
    let missing = uri("nope", &sock);
    let timing = |o: &std::process::Output| {
        let (out, err, status) = masked(o);
        let out: Vec<&str> = out
            .lines()
            .filter(|l| !l.starts_with("Run completed"))
            .collect();
        (out.join("\n"), err, status)
    };
    let cases: &[(&str, Vec<&str>)] = &[
        ("qemu-img", vec!["bench", "-c", "100", "-d", "4", &export]),
        (
            "qemu-img",
            vec!["bench", "-w", "-c", "10", "-f", "raw", &export],
        ),
        ("qemu-io", vec!["-c", "read -P 0 1M 4k", &export]),
        ("qemu-img", vec!["info", &missing]),
    ];
    for (tool, args) in cases {
        let theirs = run(&s.0, Path::new(tool), args);
        let before = std::fs::read_to_string(&log).unwrap_or_default();
        let mine = if *tool == "qemu-img" {
            ours.img(&s.0, args)
        } else {
            ours.io(&s.0, args)
        };
        let after = std::fs::read_to_string(&log).unwrap_or_default();
        assert_eq!(timing(&mine), timing(&theirs), "{tool} {args:?}");
        assert_eq!(
            after, before,
            "qemu-nbd complained about qimg: {tool} {args:?}"
        );
    }
    let _ = server.kill();
    let _ = server.wait();
}

/// `convert -n` into an NBD export (the export is the output, opened, not created): as
/// qemu-img, the export then holds the source's data. Before, qimg looked for a file named
/// by the URI and failed ("No such file or directory").
#[test]
fn convert_n_writes_into_an_nbd_export() {
    if !have_qemu_tools("convert_n_writes_into_an_nbd_export") {
        return;
    }
    let s = Scratch::new("nbd-convert-n");
    create(&s.0, "out.qcow2", false, None);
    create(&s.0, "src.qcow2", true, None);
    qemu_io(&s.0, "qcow2", "src.qcow2", &["write -P 5 64k 1M".into()]);
    let sock = s.path("out.sock");
    let n = qemu_nbd(&s.0, "out.qcow2", &sock, &[]);
    let target = uri("", &sock);
    ok(
        "convert -n into the export",
        &run(
            &s.0,
            &qimg_bin(),
            &[
                "convert",
                "-n",
                "-f",
                "qcow2",
                "-O",
                "raw",
                "src.qcow2",
                &target,
            ],
        ),
    );
    n.stop();
    assert_same_content(&s.0, "src.qcow2", "out.qcow2");
    assert_check_clean(&s.0, "out.qcow2");
}

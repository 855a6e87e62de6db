//! `qimg serve --vhost-user-blk` driven by a real vhost-user frontend: the `blkio` crate's
//! `virtio-blk-vhost-user` driver (libblkio), which connects like a VMM without a VM, with
//! memory regions it allocates and shares. A seeded mix of writes, write-zeroes (with and
//! without unmap), discards, flushes and reads on 2 and 4 queues over a 64 MiB extended-L2
//! overlay with a backing file, checked against a model as it runs; then the daemon is stopped
//! with SIGTERM, `qemu-img check` is clean and `qemu-img compare` equals the model. A
//! read-only export fails every write and leaves the image unchanged; a frontend that
//! disconnects with requests in flight and reconnects finds every acknowledged write.
//!
//! The `unsafe` blocks hand raw buffers to the blkio client (its API takes raw pointers into
//! the memory region it allocated and shares with the daemon).

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use common::{Scratch, assert_clean, assert_same_as_model, have_qemu, qemu_create, qimg_bin};
use qimg_testkit::model::GuestModel;
use qimg_testkit::pattern::pattern;
use qimg_testkit::rng::Rng;

const SIZE: u64 = 64 << 20;
/// Bytes of the shared memory region each queue thread uses for its buffers.
const PER_QUEUE: usize = 4 << 20;
const DEPTH: usize = 8;

/// A running `qimg serve --vhost-user-blk`, killed if a test fails before stopping it.
struct Daemon {
    child: Option<Child>,
    socket: PathBuf,
}

impl Daemon {
    fn start(dir: &Path, image: &str, extra: &[&str]) -> Daemon {
        let socket = dir.join("vhost.sock");
        let pid = dir.join("qimg.pid");
        let mut args: Vec<String> = vec![
            "serve".into(),
            "--vhost-user-blk".into(),
            socket.display().to_string(),
            "--pidfile".into(),
            pid.display().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        args.push(dir.join(image).display().to_string());
        Self::spawn(Command::new(qimg_bin()).args(&args), socket, pid)
    }

    /// `qemu-storage-daemon` exporting `image` the same way (O_DIRECT on io_uring).
    fn start_qsd(dir: &Path, image: &str, queues: usize) -> Option<Daemon> {
        if Command::new("qemu-storage-daemon")
            .arg("--version")
            .output()
            .is_err()
        {
            if std::env::var("QIMG_REQUIRE_QEMU").as_deref() == Ok("1") {
                panic!("qemu-storage-daemon is not installed but QIMG_REQUIRE_QEMU=1");
            }
            eprintln!("SKIPPED: qemu-storage-daemon not found");
            return None;
        }
        let socket = dir.join("qsd.sock");
        let pid = dir.join("qsd.pid");
        let file = dir.join(image).display().to_string();
        let mut cmd = Command::new("qemu-storage-daemon");
        cmd.arg("--blockdev")
            .arg(format!("driver=file,node-name=file,filename={file},cache.direct=on,aio=io_uring"))
            .arg("--blockdev")
            .arg("driver=qcow2,node-name=disk,file=file")
            .arg("--export")
            .arg(format!(
                "type=vhost-user-blk,id=exp,node-name=disk,addr.type=unix,addr.path={},writable=on,num-queues={queues}",
                socket.display()
            ))
            .arg("--pidfile")
            .arg(&pid);
        Some(Self::spawn(&mut cmd, socket, pid))
    }

    fn spawn(cmd: &mut Command, socket: PathBuf, pid: PathBuf) -> Daemon {
        let _ = std::fs::remove_file(&pid);
        let child = cmd
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the daemon starts");
        let guard = qimg_testkit::HangGuard::start(
            "the daemon's pid file",
            Duration::from_millis(500),
            Duration::from_secs(30),
        );
        while !pid.exists() {
            guard.check();
            std::thread::sleep(Duration::from_millis(20));
        }
        Daemon {
            child: Some(child),
            socket,
        }
    }

    /// SIGTERM, then the exit status must be success.
    fn stop(mut self) {
        let mut child = self.child.take().expect("running");
        let pid = child.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .unwrap()
                .success()
        );
        let guard = qimg_testkit::HangGuard::start(
            "qimg serve stopping on SIGTERM",
            Duration::from_millis(500),
            Duration::from_secs(60),
        );
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                assert!(status.success(), "qimg serve exited with {status}");
                return;
            }
            guard.check();
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A connected frontend with `queues` queues and one shared memory region.
struct Frontend {
    blkio: Blkio,
    queues: Vec<Blkioq>,
    region: MemoryRegion,
}

fn connect(socket: &Path, queues: usize, read_only: bool) -> Frontend {
    let mut blkio = Blkio::new("virtio-blk-vhost-user").unwrap();
    blkio
        .set_str("path", &socket.display().to_string())
        .unwrap();
    if read_only {
        blkio.set_bool("read-only", true).unwrap();
    }
    blkio.connect().unwrap();
    blkio.set_i32("num-queues", queues as i32).unwrap();
    let started = blkio.start().unwrap();
    assert_eq!(blkio.get_u64("capacity").unwrap(), SIZE);
    let region = blkio.alloc_mem_region(PER_QUEUE * queues).unwrap();
    blkio.map_mem_region(&region).unwrap();
    Frontend {
        blkio,
        queues: started.queues,
        region,
    }
}

/// One queue's part of the region, as a byte slice.
fn buffer(region: &MemoryRegion, q: usize) -> &'static mut [u8] {
    assert!(region.len >= (q + 1) * PER_QUEUE);
    // SAFETY: the region is `region.len` bytes of memory blkio allocated for us and keeps
    // mapped until the `Blkio` is dropped (after every use here); each queue thread takes its
    // own disjoint `PER_QUEUE` bytes, and the daemon only touches them for requests the thread
    // submitted and waits for.
    unsafe { std::slice::from_raw_parts_mut((region.addr + q * PER_QUEUE) as *mut u8, PER_QUEUE) }
}

/// Submits what `kind` says at `offset`, waits for its completion; the completion's `ret`.
struct Op {
    kind: u64,
    offset: u64,
    len: u64,
    slot: usize,
    step: u64,
}

fn wait_all(q: &mut Blkioq, n: usize) -> Vec<Completion> {
    let mut done = Vec::new();
    while done.len() < n {
        let mut c: Vec<std::mem::MaybeUninit<Completion>> = (0..n - done.len())
            .map(|_| std::mem::MaybeUninit::uninit())
            .collect();
        let mut timeout = Duration::from_secs(60);
        let got = q.do_io(&mut c, 1, Some(&mut timeout), None).unwrap();
        assert!(got > 0, "no completion within 60 s");
        for slot in c.into_iter().take(got) {
            // SAFETY: do_io initialised the first `got` entries.
            done.push(unsafe { slot.assume_init() });
        }
    }
    done
}

/// One queue: batches of up to DEPTH non-overlapping requests in `[lo, hi)`.
fn drive(
    q: &mut Blkioq,
    mem: &mut [u8],
    mut model: GuestModel,
    (lo, hi): (u64, u64),
    seed: u64,
    read_only: bool,
    discards: bool,
) -> GuestModel {
    let mut rng = Rng(seed);
    let slot_len = PER_QUEUE / DEPTH;
    for batch in 0..40u64 {
        let mut ops: Vec<Op> = Vec::new();
        while ops.len() < DEPTH {
            let len = rng.range(1, 33) * 4096;
            let offset = lo + rng.aligned(hi - lo - len, 4096);
            if ops
                .iter()
                .any(|o| o.offset < offset + len && offset < o.offset + o.len)
            {
                continue;
            }
            let mut kind = rng.below(10);
            if kind == 8 && !discards {
                // What a discarded range reads afterwards is up to the device.
                kind = 9;
            }
            let step = batch * 100 + ops.len() as u64;
            ops.push(Op {
                kind,
                offset,
                len,
                slot: ops.len(),
                step,
            });
        }
        let mut expect = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            let buf = &mut mem[op.slot * slot_len..op.slot * slot_len + op.len as usize];
            let ptr = buf.as_mut_ptr();
            match op.kind {
                0..=3 => {
                    let data = pattern(seed ^ op.step, op.offset, op.len as usize);
                    buf.copy_from_slice(&data);
                    if !read_only {
                        model.write(op.offset, &data);
                    }
                    q.write(op.offset, ptr, op.len as usize, i, ReqFlags::empty());
                }
                4..=6 => {
                    expect.push((i, model.read(op.offset, op.len).to_vec()));
                    buf.fill(0xcc);
                    q.read(op.offset, ptr, op.len as usize, i, ReqFlags::empty());
                }
                7 => {
                    let unmap = rng.chance(1, 2);
                    if !read_only {
                        model.write_zeroes(op.offset, op.len);
                    }
                    let flags = if unmap {
                        ReqFlags::empty()
                    } else {
                        ReqFlags::NO_UNMAP
                    };
                    q.write_zeroes(op.offset, op.len, i, flags);
                }
                8 => {
                    if !read_only {
                        model.discard(op.offset, op.len);
                    }
                    q.discard(op.offset, op.len, i, ReqFlags::empty());
                }
                _ => q.flush(i, ReqFlags::empty()),
            }
        }
        for c in wait_all(q, ops.len()) {
            let op = &ops[c.user_data];
            let writes = matches!(op.kind, 0..=3 | 7 | 8);
            if read_only && writes {
                assert!(c.ret < 0, "a write to a read-only export succeeded");
            } else {
                assert_eq!(
                    c.ret, 0,
                    "request {} (kind {}) at {:#x} failed",
                    op.step, op.kind, op.offset
                );
            }
        }
        for (i, want) in expect {
            let op = &ops[i];
            let got = &mem[op.slot * slot_len..op.slot * slot_len + op.len as usize];
            assert!(
                got == &want[..],
                "read of {} bytes at {:#x} (seed {seed}) differs from the model",
                op.len,
                op.offset
            );
        }
    }
    model
}

/// The workload of [`run`] against a connected frontend; the model of the final disk.
fn workload(
    fe: &mut Frontend,
    model: &GuestModel,
    queues: usize,
    read_only: bool,
    seed: u64,
    discards: bool,
) -> Vec<u8> {
    let span = SIZE / queues as u64;
    let results: Vec<(u64, GuestModel)> = std::thread::scope(|s| {
        let region = &fe.region;
        let handles: Vec<_> = fe
            .queues
            .iter_mut()
            .enumerate()
            .map(|(i, q)| {
                let mem = buffer(region, i);
                let model = model.clone();
                s.spawn(move || {
                    let (lo, hi) = (i as u64 * span, (i as u64 + 1) * span);
                    (
                        lo,
                        drive(
                            q,
                            mem,
                            model,
                            (lo, hi),
                            seed * 10 + i as u64,
                            read_only,
                            discards,
                        ),
                    )
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("queue thread"))
            .collect()
    });
    let mut merged = vec![0u8; SIZE as usize];
    for (lo, m) in &results {
        merged[*lo as usize..(*lo + span) as usize].copy_from_slice(m.read(*lo, span));
    }
    merged
}

fn make_overlay(dir: &Scratch) -> Vec<u8> {
    let backing: Vec<u8> = (0..SIZE).map(|i| (i / 4096 % 251) as u8 | 1).collect();
    std::fs::write(dir.path("base.raw"), &backing).unwrap();
    qemu_create(
        &dir.0,
        "top.qcow2",
        "extended_l2=on,cluster_size=64k",
        SIZE,
        Some(("base.raw", "raw")),
    );
    backing
}

fn run(queues: usize, read_only: bool, seed: u64) {
    let dir = Scratch::new("vhost");
    let backing: Vec<u8> = (0..SIZE).map(|i| (i / 4096 % 251) as u8 | 1).collect();
    std::fs::write(dir.path("base.raw"), &backing).unwrap();
    qemu_create(
        &dir.0,
        "top.qcow2",
        "extended_l2=on,cluster_size=64k",
        SIZE,
        Some(("base.raw", "raw")),
    );
    if read_only {
        // Something to read besides the backing file.
        common::qemu_io(&dir.0, "qcow2", "top.qcow2", &["write -P 0x33 1M 64k"]);
    }
    let before = std::fs::read(dir.path("top.qcow2")).unwrap();
    let qs = queues.to_string();
    let mut extra = vec!["--num-queues", qs.as_str(), "-t", "none", "-i", "io_uring"];
    if read_only {
        extra.push("--readonly");
    }
    let daemon = Daemon::start(&dir.0, "top.qcow2", &extra);
    let mut model = GuestModel::new(SIZE, backing, 2048);
    if read_only {
        model.write(1 << 20, &[0x33; 65536]);
    }
    let mut fe = connect(&daemon.socket, queues, read_only);
    assert_eq!(fe.region.len, PER_QUEUE * queues);
    let merged = workload(&mut fe, &model, queues, read_only, seed, true);
    drop(fe.queues);
    drop(fe.blkio);
    daemon.stop();
    let what = format!("vhost-user-blk, {queues} queues, read-only {read_only}");
    assert_clean(&dir.0, "top.qcow2", &what);
    assert_same_as_model(&dir.0, "top.qcow2", &merged, &what);
    if read_only {
        assert!(
            std::fs::read(dir.path("top.qcow2")).unwrap() == before,
            "a read-only export changed the image"
        );
    }
}

fn usable(test: &str) -> bool {
    if !have_qemu(test) {
        return false;
    }
    true
}

#[test]
fn two_queues_match_the_model_and_leave_the_image_clean() {
    if usable("two_queues_match_the_model_and_leave_the_image_clean") {
        run(2, false, 1);
    }
}

#[test]
fn four_queues_match_the_model_and_leave_the_image_clean() {
    if usable("four_queues_match_the_model_and_leave_the_image_clean") {
        run(4, false, 2);
    }
}

#[test]
fn a_read_only_export_fails_every_write_and_changes_nothing() {
    if usable("a_read_only_export_fails_every_write_and_changes_nothing") {
        run(2, true, 3);
    }
}

#[test]
fn qemu_storage_daemon_and_qimg_end_with_equal_images() {
    if !usable("qemu_storage_daemon_and_qimg_end_with_equal_images") {
        return;
    }
    let dir = Scratch::new("vhost-qsd");
    let backing = make_overlay(&dir);
    std::fs::copy(dir.path("top.qcow2"), dir.path("qsd.qcow2")).unwrap();
    let model = GuestModel::new(SIZE, backing, 2048);
    let Some(qsd) = Daemon::start_qsd(&dir.0, "qsd.qcow2", 2) else {
        return;
    };
    let mut fe = connect(&qsd.socket, 2, false);
    // Without discards: what a discarded range reads afterwards differs between devices (QEMU
    // ignores them by default; qimg makes whole subclusters read from the backing file).
    let theirs = workload(&mut fe, &model, 2, false, 4, false);
    drop(fe);
    qsd.stop();
    let daemon = Daemon::start(&dir.0, "top.qcow2", &["--num-queues", "2"]);
    let mut fe = connect(&daemon.socket, 2, false);
    let ours = workload(&mut fe, &model, 2, false, 4, false);
    drop(fe);
    daemon.stop();
    assert!(ours == theirs, "the same workload gave different models");
    assert_clean(&dir.0, "top.qcow2", "qimg's export");
    assert_clean(&dir.0, "qsd.qcow2", "qemu-storage-daemon's export");
    let out = common::qemu_img(
        &dir.0,
        &[
            "compare",
            "-f",
            "qcow2",
            "-F",
            "qcow2",
            "top.qcow2",
            "qsd.qcow2",
        ],
    );
    assert!(
        out.status.success(),
        "qemu-img compare: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn a_frontend_that_disconnects_mid_request_and_reconnects_loses_no_acknowledged_write() {
    if !usable("a_frontend_that_disconnects_mid_request_and_reconnects_loses_no_acknowledged_write")
    {
        return;
    }
    let dir = Scratch::new("vhost-reconnect");
    make_overlay(&dir);
    let daemon = Daemon::start(&dir.0, "top.qcow2", &["--num-queues", "1"]);
    let mut fe = connect(&daemon.socket, 1, false);
    let mem = buffer(&fe.region, 0);
    let q = &mut fe.queues[0];
    // Acknowledged: 16 writes of 64 KiB, each waited for.
    for i in 0..16u64 {
        let buf = &mut mem[..65536];
        buf.fill(i as u8 + 1);
        q.write(i * (1 << 20), buf.as_ptr(), 65536, 0, ReqFlags::empty());
        let c = wait_all(q, 1);
        assert_eq!(c[0].ret, 0);
    }
    // In flight when the frontend goes: allocating writes elsewhere, not waited for.
    for i in 0..8usize {
        let at = 32 * (1 << 20) + i as u64 * (1 << 20);
        let buf = &mut mem[i * 65536..(i + 1) * 65536];
        buf.fill(0xee);
        q.write(at, buf.as_ptr(), 65536, i, ReqFlags::empty());
    }
    let mut none: Vec<std::mem::MaybeUninit<Completion>> = Vec::new();
    let mut zero = Duration::ZERO;
    let _ = q.do_io(&mut none, 0, Some(&mut zero), None);
    drop(fe);
    // The same daemon takes the next frontend.
    let mut fe = connect(&daemon.socket, 1, false);
    let mem = buffer(&fe.region, 0);
    let q = &mut fe.queues[0];
    for i in 0..16u64 {
        let buf = &mut mem[..65536];
        buf.fill(0);
        q.read(i * (1 << 20), buf.as_mut_ptr(), 65536, 0, ReqFlags::empty());
        assert_eq!(wait_all(q, 1)[0].ret, 0);
        assert!(
            mem[..65536].iter().all(|&b| b == i as u8 + 1),
            "acknowledged write {i} lost"
        );
    }
    drop(fe);
    daemon.stop();
    assert_clean(&dir.0, "top.qcow2", "reconnect");
}

#[test]
fn the_device_reports_block_size_topology_and_limits_as_configured() {
    if !usable("the_device_reports_block_size_topology_and_limits_as_configured") {
        return;
    }
    let dir = Scratch::new("vhost-config");
    qemu_create(
        &dir.0,
        "d.qcow2",
        "extended_l2=on,cluster_size=128k",
        SIZE,
        None,
    );
    let daemon = Daemon::start(
        &dir.0,
        "d.qcow2",
        &[
            "--num-queues",
            "3",
            "--logical-block-size",
            "4096",
            "--serial",
            "qimg-disk-0",
        ],
    );
    let mut b = Blkio::new("virtio-blk-vhost-user").unwrap();
    b.set_str("path", &daemon.socket.display().to_string())
        .unwrap();
    b.connect().unwrap();
    assert_eq!(b.get_i32("max-queues").unwrap(), 3);
    assert_eq!(b.get_u64("capacity").unwrap(), SIZE);
    assert_eq!(b.get_i32("request-alignment").unwrap(), 4096);
    // The cluster is the optimal I/O size; discard works on 4 KiB subclusters.
    assert_eq!(b.get_i32("optimal-io-size").unwrap(), 128 * 1024);
    assert_eq!(b.get_i32("discard-alignment").unwrap(), 4096);
    assert_eq!(b.get_i32("max-segments").unwrap(), 126);
    drop(b);
    daemon.stop();
    assert_clean(&dir.0, "d.qcow2", "config");
    // Impossible options are refused before anything is served.
    for (opt, val) in [
        ("--num-queues", "0"),
        ("--logical-block-size", "1024"),
        ("--serial", "an-id-longer-than-twenty"),
    ] {
        let o = common::qimg(
            &dir.0,
            &["serve", "--vhost-user-blk", "x.sock", opt, val, "d.qcow2"],
        );
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{opt} {val}: {err}");
        assert!(err.contains(opt) && err.contains(val), "{opt} {val}: {err}");
        assert!(
            !dir.path("x.sock").exists(),
            "{opt} {val}: the socket was bound"
        );
    }
}

/// `-t writethrough` and `-t directsync`: every write the frontend saw complete survives a
/// SIGKILL of the daemon (no close, no flush of its metadata cache), as with
/// qemu-storage-daemon's `writethrough=on`. 256 allocating 64 KiB writes in batches of
/// DEPTH, each batch waited for, then `kill -9`; `qemu-io` reads every block back.
fn acknowledged_writes_survive_sigkill(mode: &str) {
    let dir = Scratch::new(&format!("vhost-durable-{mode}"));
    qemu_create(
        &dir.0,
        "d.qcow2",
        "extended_l2=on,cluster_size=64k",
        SIZE,
        None,
    );
    let mut daemon = Daemon::start(&dir.0, "d.qcow2", &["-t", mode, "--num-queues", "1"]);
    let mut fe = connect(&daemon.socket, 1, false);
    let mem = buffer(&fe.region, 0);
    let q = &mut fe.queues[0];
    const BLOCKS: u64 = 256;
    const BLOCK: usize = 65536;
    for batch in 0..BLOCKS / DEPTH as u64 {
        for i in 0..DEPTH {
            let n = batch * DEPTH as u64 + i as u64;
            let buf = &mut mem[i * BLOCK..(i + 1) * BLOCK];
            buf.copy_from_slice(&pattern(n, 0, BLOCK));
            // Every other 128 KiB: each write allocates a cluster (and new L2 entries).
            q.write(
                n * 2 * BLOCK as u64,
                buf.as_ptr(),
                BLOCK,
                i,
                ReqFlags::empty(),
            );
        }
        for c in wait_all(q, DEPTH) {
            assert_eq!(c.ret, 0, "write {} of batch {batch} failed", c.user_data);
        }
    }
    // Every write above was acknowledged: kill the daemon without letting it close.
    let mut child = daemon.child.take().expect("running");
    child.kill().unwrap();
    child.wait().unwrap();
    drop(fe);
    let mut lost = Vec::new();
    let image = dir.path("d.qcow2");
    let img = qimg::OpenOptions::new()
        .open_blocking(&image)
        .expect("the image opens after the kill");
    let mut got = vec![0u8; BLOCK];
    for n in 0..BLOCKS {
        img.read(&mut got, n * 2 * BLOCK as u64).unwrap();
        if got != pattern(n, 0, BLOCK) {
            lost.push(n);
        }
    }
    drop(img);
    assert!(
        lost.is_empty(),
        "-t {mode}: {} of {BLOCKS} acknowledged writes lost after SIGKILL (first: {:?})",
        lost.len(),
        &lost[..lost.len().min(8)]
    );
    let out = common::qemu_img(&dir.0, &["check", "d.qcow2"]);
    assert!(
        out.status.success() || out.status.code() == Some(3),
        "qemu-img check after the kill: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn writethrough_writes_survive_sigkill() {
    if usable("writethrough_writes_survive_sigkill") {
        acknowledged_writes_survive_sigkill("writethrough");
    }
}

#[test]
fn directsync_writes_survive_sigkill() {
    if usable("directsync_writes_survive_sigkill") {
        acknowledged_writes_survive_sigkill("directsync");
    }
}

//! Incremental backup of a running disk (issue 32): checkpoints taken by one transaction
//! between guest requests, the control socket of `qimg serve --monitor`, and `qimg backup`.

use crate::common;
use common::*;

use qimg::{Action, OpenOptions, SnapshotOptions};

/// A write that recorded itself in the bitmaps before a checkpoint and runs after it is in
/// the checkpoint's new bitmap: every cluster is then either in the snapshot and in the old
/// bitmap, or not in the snapshot and in the new one. The writers are made to wait for their
/// range lock behind a checkpoint (a lease holds their clusters, the checkpoint asks for
/// every range first), so the test fails without the rule of `Inner::recorded`.
#[test]
fn a_write_waiting_behind_a_checkpoint_is_in_the_new_bitmap() {
    let d = Scratch::new("checkpoint-order");
    let out = qimg(
        &d.0,
        &[
            "create",
            "-f",
            "qcow2",
            "-o",
            "extended_l2=on",
            "a.qcow2",
            "8M",
        ],
    );
    assert!(out.status.success(), "{out:?}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let img = OpenOptions::new()
            .writable(true)
            .open(d.path("a.qcow2"))
            .await
            .unwrap();
        img.add_bitmap("b0", Some(65536), true).unwrap();
        let cs = img.cluster_size();
        // Holds clusters 0..8 until dropped.
        let lease = img.write_lease(0, 8 * cs).await.unwrap();
        let checkpoint = tokio::spawn({
            let img = img.clone();
            async move {
                img.transaction(&[
                    Action::Snapshot {
                        name: "ck1".into(),
                        options: SnapshotOptions::new(),
                    },
                    Action::EnableBitmap {
                        name: "b0".into(),
                        enabled: false,
                    },
                    Action::AddBitmap {
                        name: "b1".into(),
                        granularity: Some(65536),
                        enabled: true,
                    },
                ])
                .await
            }
        });
        // The checkpoint reaches its wait for every range before the writers start.
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        let writers: Vec<_> = (0..8u64)
            .map(|i| {
                let img = img.clone();
                tokio::spawn(async move { img.write(&[i as u8 + 1; 4096], i * cs).await })
            })
            .collect();
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        lease.abort().await;
        checkpoint.await.unwrap().unwrap();
        for w in writers {
            w.await.unwrap().unwrap();
        }
        let b0 = img.dirty_bitmap("b0").await.unwrap();
        let b1 = img.dirty_bitmap("b1").await.unwrap();
        for i in 0..8u64 {
            // The writes ran after the checkpoint (it held every range first): each must be
            // in b1, or the next incremental backup would miss it. (b0 has them too: they
            // recorded themselves before; a superset is what a bitmap may be.)
            assert!(
                !b1.extents(i * cs, cs).is_empty(),
                "cluster {i}: written after the checkpoint, not in b1"
            );
            assert!(!b0.extents(i * cs, cs).is_empty());
        }
        img.close().await.unwrap();
    });
    // The snapshot holds none of the writes: they came after the checkpoint.
    let out = qimg(
        &d.0,
        &["convert", "-l", "ck1", "-O", "raw", "a.qcow2", "ck1.raw"],
    );
    assert!(out.status.success(), "{out:?}");
    let ck1 = std::fs::read(d.path("ck1.raw")).unwrap();
    assert!(
        ck1.iter().all(|&b| b == 0),
        "the snapshot saw a later write"
    );
}

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use qimg::io::Storage;
use qimg::io::nbd::NbdStorage;
use qimg_testkit::HangGuard;
use qimg_testkit::rng::Rng;
use serde_json::{Value, json};

const SIZE: u64 = 32 << 20;
const GRANULE: u64 = 64 << 10;

fn have_tools(test: &str) -> bool {
    if !have_qemu(test) {
        return false;
    }
    for tool in ["nbdinfo", "nbdcopy"] {
        let found = Command::new(tool)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            if std::env::var(qimg_testkit::qemu::REQUIRE_ENV).as_deref() == Ok("1") {
                panic!("{test}: {tool} is not installed but QIMG_REQUIRE_QEMU=1 requires it");
            }
            eprintln!("SKIPPED {test}: {tool} not found");
            return false;
        }
    }
    true
}

/// `qimg serve`, killed when dropped.
struct Served(Child);

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits for `path` to exist (a server listens within 100 ms on a quiet machine).
fn wait_for(path: &Path) {
    let guard = HangGuard::start(
        format!("{} to appear", path.display()),
        Duration::from_millis(100),
        Duration::from_secs(60),
    );
    while !path.exists() {
        guard.check();
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A QMP client of `qimg serve --monitor`.
struct Qmp {
    rd: BufReader<UnixStream>,
    wr: UnixStream,
}

impl Qmp {
    fn connect(path: &Path) -> Self {
        let s = UnixStream::connect(path).unwrap();
        let mut q = Qmp {
            rd: BufReader::new(s.try_clone().unwrap()),
            wr: s,
        };
        let greeting = q.line();
        assert!(greeting.get("QMP").is_some(), "{greeting}");
        q.ok("qmp_capabilities", json!({}));
        q
    }

    fn line(&mut self) -> Value {
        let mut l = String::new();
        self.rd.read_line(&mut l).unwrap();
        serde_json::from_str(&l).unwrap_or_else(|e| panic!("{e}: {l:?}"))
    }

    /// The reply to a command (events before it are skipped).
    fn cmd(&mut self, name: &str, args: Value) -> Value {
        let c = json!({"execute": name, "arguments": args, "id": name});
        writeln!(self.wr, "{c}").unwrap();
        loop {
            let v = self.line();
            if v.get("event").is_none() {
                assert_eq!(v["id"], json!(name), "{v}");
                return v;
            }
        }
    }

    fn ok(&mut self, name: &str, args: Value) -> Value {
        let v = self.cmd(name, args);
        v.get("return")
            .cloned()
            .unwrap_or_else(|| panic!("{name}: {v}"))
    }
}

/// One write of the load: its offset and data.
type Write1 = (u64, Vec<u8>);

/// How the load reaches the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transport {
    /// The NBD client of the library, on the server's default export.
    Nbd,
    /// libblkio's virtio-blk-vhost-user driver, as a VMM's guest would.
    VhostUser,
}

/// Writes one request at a time through `transport`.
enum Writer {
    Nbd(NbdStorage, tokio::runtime::Runtime),
    /// (The `Blkio` owns the connection and the memory: kept while the writer lives.)
    Vhost(#[allow(dead_code)] Blkio, Blkioq, MemoryRegion),
}

impl Writer {
    fn connect(transport: Transport, target: &str) -> Self {
        match transport {
            Transport::Nbd => Writer::Nbd(
                NbdStorage::connect(target, true).unwrap(),
                tokio::runtime::Builder::new_current_thread()
                    .build()
                    .unwrap(),
            ),
            Transport::VhostUser => {
                let mut blkio = Blkio::new("virtio-blk-vhost-user").unwrap();
                blkio.set_str("path", target).unwrap();
                blkio.connect().unwrap();
                blkio.set_i32("num-queues", 1).unwrap();
                let mut started = blkio.start().unwrap();
                let region = blkio.alloc_mem_region(MAX_WRITE as usize).unwrap();
                blkio.map_mem_region(&region).unwrap();
                let q = started.queues.remove(0);
                Writer::Vhost(blkio, q, region)
            }
        }
    }

    /// Writes `data` at `off`: whether the device acknowledged it.
    fn write(&mut self, off: u64, data: &[u8]) -> bool {
        match self {
            Writer::Nbd(nbd, rt) => rt.block_on(nbd.write_at(data, off)).is_ok(),
            Writer::Vhost(_, q, region) => {
                assert!(data.len() <= region.len);
                // SAFETY: the region is `region.len` bytes blkio allocated and keeps mapped
                // while the `Blkio` lives (as long as this writer); only this thread uses it,
                // and the device reads it only for the request submitted here and waited for.
                let mem =
                    unsafe { std::slice::from_raw_parts_mut(region.addr as *mut u8, data.len()) };
                mem.copy_from_slice(data);
                q.write(off, mem.as_mut_ptr(), data.len(), 0, ReqFlags::empty());
                let mut c = [std::mem::MaybeUninit::<Completion>::uninit()];
                // Hang guard: a write completes in milliseconds; 60 s is far over ten times.
                let mut timeout = Duration::from_secs(60);
                match q.do_io(&mut c, 1, Some(&mut timeout), None) {
                    // SAFETY: do_io initialised the one entry it reported.
                    Ok(1) => unsafe { c[0].assume_init_ref() }.ret == 0,
                    _ => false,
                }
            }
        }
    }
}

/// The largest write of the load.
const MAX_WRITE: u64 = 48 * 4096;

/// The seeded guest: writes (data and zeroes) one at a time, logging each before it is sent.
/// `started`/`done` count writes sent and acknowledged; a write that fails (the server was
/// killed) ends the load. It sends no more than it was granted (so that what changes between
/// two checkpoints stays a part of the disk, whatever the machine's speed).
struct Load {
    log: Arc<Mutex<Vec<Write1>>>,
    allowed: Arc<AtomicU64>,
    started: Arc<AtomicU64>,
    done: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Load {
    fn start(transport: Transport, target: String, seed: u64) -> Self {
        let log = Arc::new(Mutex::new(Vec::new()));
        let started = Arc::new(AtomicU64::new(0));
        let done = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let allowed = Arc::new(AtomicU64::new(0));
        let (l, s, d, st) = (log.clone(), started.clone(), done.clone(), stop.clone());
        let a = allowed.clone();
        let thread = std::thread::spawn(move || {
            let mut w = Writer::connect(transport, &target);
            let mut rng = Rng(seed);
            while !st.load(Ordering::Acquire) {
                if s.load(Ordering::Acquire) >= a.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
                let len = rng.range(1, MAX_WRITE / 4096) * 4096;
                let off = rng.aligned(SIZE - len, 4096);
                let data = if rng.chance(1, 5) {
                    vec![0u8; len as usize]
                } else {
                    vec![rng.range(1, 255) as u8; len as usize]
                };
                l.lock().unwrap().push((off, data.clone()));
                s.fetch_add(1, Ordering::AcqRel);
                if !w.write(off, &data) {
                    return;
                }
                d.fetch_add(1, Ordering::AcqRel);
            }
        });
        Load {
            log,
            allowed,
            started,
            done,
            stop,
            thread: Some(thread),
        }
    }

    /// Lets the load send `n` more writes.
    fn grant(&self, n: u64) {
        self.allowed.fetch_add(n, Ordering::AcqRel);
    }

    /// Waits until `n` more writes were answered (the load answers hundreds a second on a
    /// quiet machine: `n` of them take well under a second).
    fn wait_more(&self, n: u64) {
        let want = self.done.load(Ordering::Acquire) + n;
        let guard = HangGuard::start(
            format!("{n} writes of the load"),
            Duration::from_secs(1),
            Duration::from_secs(120),
        );
        while self.done.load(Ordering::Acquire) < want {
            guard.check();
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn finish(mut self) {
        self.stop.store(true, Ordering::Release);
        self.thread.take().unwrap().join().unwrap();
    }
}

/// The 64 KiB granules writes `[from, to)` of the log touch.
fn granules(log: &[Write1], from: usize, to: usize) -> std::collections::BTreeSet<u64> {
    let mut set = std::collections::BTreeSet::new();
    for (off, data) in &log[from..to] {
        for g in off / GRANULE..(off + data.len() as u64).div_ceil(GRANULE) {
            set.insert(g);
        }
    }
    set
}

fn read_export(uri: &str) -> Vec<u8> {
    let nbd = NbdStorage::connect(uri, false).unwrap();
    let mut buf = vec![0u8; SIZE as usize];
    nbd.read_blocking(&mut buf, 0).unwrap();
    buf
}

fn bytes_copied(out: &std::process::Output) -> u64 {
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("Backed up"))
        .unwrap_or_else(|| panic!("{out:?}"));
    let after = line.split(": ").last().unwrap();
    after.split(' ').next().unwrap().parse().unwrap()
}

/// The model of the disk and how many writes of the load's log it has applied.
struct Tracked {
    model: Vec<u8>,
    applied: usize,
}

impl Tracked {
    /// The model at a checkpoint: the state after the first `k` writes, for the `k` between
    /// the writes answered before the checkpoint (`lo`) and those sent by its end (`hi`) for
    /// which the checkpoint's view reads so. Returns the smallest and largest such `k` (a
    /// write of what was there already changes nothing: the checkpoint may be before or
    /// after it); the model is left at the smallest.
    fn at_checkpoint(&mut self, log: &[Write1], view: &[u8], lo: u64, hi: u64) -> (usize, usize) {
        while (self.applied as u64) < lo {
            self.apply(&log[self.applied]);
        }
        while view != self.model {
            assert!(
                (self.applied as u64) < hi,
                "the view is no state of the writes between {lo} and {hi}"
            );
            self.apply(&log[self.applied]);
        }
        let (first, model) = (self.applied, self.model.clone());
        let mut last = first;
        while (self.applied as u64) < hi {
            self.apply(&log[self.applied]);
            if view == self.model {
                last = self.applied;
            }
        }
        self.model = model;
        self.applied = first;
        (first, last)
    }

    fn apply(&mut self, (off, data): &Write1) {
        self.model[*off as usize..*off as usize + data.len()].copy_from_slice(data);
        self.applied += 1;
    }
}

/// `qimg serve --nbd --vhost-user-blk --monitor` on `disk.qcow2`.
fn serve_disk(d: &Scratch) -> Served {
    for s in ["nbd.sock", "vhost.sock", "qmp.sock"] {
        let _ = std::fs::remove_file(d.path(s));
    }
    let nbd_arg = format!("unix:{}", d.path("nbd.sock").display());
    let child = Command::new(qimg_bin())
        .current_dir(&d.0)
        .args(["serve", "--nbd", &nbd_arg, "--vhost-user-blk", "vhost.sock"])
        .args(["--monitor", "qmp.sock", "disk.qcow2"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let served = Served(child);
    for s in ["nbd.sock", "vhost.sock", "qmp.sock"] {
        wait_for(&d.path(s));
    }
    served
}

/// Issue 32: an extended-L2 overlay served under a seeded write load (over `transport`); a
/// full backup and three incremental ones, each from a checkpoint taken through the control
/// socket while the load runs, copied by `qimg backup` from the checkpoint's view. Each chain
/// restores the disk exactly as it was at its checkpoint (`qemu-img compare` against the
/// model), each incremental backup copies exactly the granules written between its two
/// checkpoints (the write in flight at a checkpoint may be counted in both), and the same
/// incremental backup made with QEMU's and libnbd's tools (nbdinfo --map of the dirty-bitmap
/// context, nbdcopy, qemu-io) restores equally. With `kill`, the server is killed (SIGKILL)
/// under load after the second backup and started again: the next incremental backup, from
/// the bitmap the dead server was recording, still restores its checkpoint. At the end the
/// image is clean in `qemu-img check`: deleted checkpoints freed their clusters.
fn scenario(transport: Transport, kill: bool) {
    let d = Scratch::new("backup-live");
    let size = SIZE.to_string();
    let out = qemu_img(&d.0, &["create", "-f", "qcow2", "base.qcow2", &size]);
    assert!(out.status.success(), "{out:?}");
    let out = run(
        &d.0,
        Path::new("qemu-io"),
        &[
            "-c",
            "write -P 0x11 0 8M",
            "-c",
            "write -P 0x22 20M 3M",
            "base.qcow2",
        ],
    );
    assert!(out.status.success(), "{out:?}");
    let out = qemu_img(
        &d.0,
        &[
            "create",
            "-f",
            "qcow2",
            "-o",
            "extended_l2=on",
            "-b",
            "base.qcow2",
            "-F",
            "qcow2",
            "disk.qcow2",
        ],
    );
    assert!(out.status.success(), "{out:?}");
    let mut tracked = Tracked {
        model: vec![0u8; SIZE as usize],
        applied: 0,
    };
    tracked.model[..8 << 20].fill(0x11);
    tracked.model[20 << 20..23 << 20].fill(0x22);

    let mut served = serve_disk(&d);
    let nbd = d.path("nbd.sock");
    let uri = |name: &str| format!("nbd+unix:///{name}?socket={}", nbd.display());
    let target = match transport {
        Transport::Nbd => uri(""),
        Transport::VhostUser => d.path("vhost.sock").display().to_string(),
    };
    let mut qmp = Qmp::connect(&d.path("qmp.sock"));
    let mut load = Load::start(transport, target.clone(), 0x32);

    let mut prev_k = (0usize, 0usize);
    // The previous checkpoint's view is exported (not after a restart).
    let mut prev_exported = false;
    let mut restarted = false;
    let mut chain = String::new();
    for i in 0..4 {
        // The checkpoint is taken with about 30 of these writes still to go.
        load.grant(60);
        load.wait_more(30);
        let ck = format!("ck{i}");
        let mut actions = vec![json!({"type": "blockdev-snapshot-internal-sync",
                                      "data": {"device": "disk", "name": ck}})];
        if i > 0 {
            actions.push(json!({"type": "block-dirty-bitmap-disable",
                                "data": {"node": "disk", "name": format!("b{}", i - 1)}}));
        }
        actions.push(json!({"type": "block-dirty-bitmap-add",
                            "data": {"node": "disk", "name": format!("b{i}")}}));
        let lo = load.done.load(Ordering::Acquire);
        qmp.ok("transaction", json!({"actions": actions}));
        let hi = load.started.load(Ordering::Acquire);
        let mut export = json!({"type": "nbd", "id": format!("v{i}"), "node-name": "disk",
                                "name": ck, "x-snapshot": ck});
        if i > 0 {
            export["bitmaps"] = json!([format!("b{}", i - 1)]);
        }
        qmp.ok("block-export-add", export);
        let log = load.log.lock().unwrap().clone();
        let k = tracked.at_checkpoint(&log, &read_export(&uri(&ck)), lo, hi);
        let (k_min, k_max) = k;
        let file = format!("backup{i}.qcow2");
        let out = if i == 0 {
            qimg(&d.0, &["backup", "full", &uri(&ck), &file])
        } else {
            let bitmap = format!("b{}", i - 1);
            qimg(
                &d.0,
                &[
                    "backup",
                    "incremental",
                    "--bitmap",
                    &bitmap,
                    &uri(&ck),
                    "-B",
                    &chain,
                    &file,
                ],
            )
        };
        assert!(out.status.success(), "{out:?}");
        if i > 0 && !std::mem::take(&mut restarted) {
            let log = load.log.lock().unwrap().clone();
            let (prev_min, prev_max) = prev_k;
            let exact = granules(&log, prev_max, k_min).len() as u64 * GRANULE;
            let upper = granules(&log, prev_min, (k_max + 1).min(log.len())).len() as u64 * GRANULE;
            let copied = bytes_copied(&out);
            assert!(exact > 0 && upper < SIZE, "checkpoint {i}: {exact} {upper}");
            assert!(
                (exact..=upper).contains(&copied),
                "checkpoint {i}: copied {copied} bytes; the writes between the checkpoints \
                 touched {exact} (up to {upper} with the writes in flight)"
            );
        }
        // The chain restores the disk as it was at the checkpoint.
        std::fs::write(d.path("model.raw"), &tracked.model).unwrap();
        let out = qemu_img(
            &d.0,
            &["compare", "-f", "qcow2", "-F", "raw", &file, "model.raw"],
        );
        assert!(out.status.success(), "checkpoint {i}: {out:?}");
        let out = qemu_img(&d.0, &["check", &file]);
        assert!(out.status.success(), "checkpoint {i}: {out:?}");

        if i == 1 && !kill {
            qemu_tools_backup(&d, &uri("ck0"), &uri(&ck));
        }
        // The previous checkpoint is no longer needed: its view, snapshot and bitmap go.
        if i > 0 {
            let prev = i - 1;
            if std::mem::take(&mut prev_exported) {
                qmp.ok("block-export-del", json!({"id": format!("v{prev}")}));
            }
            qmp.ok(
                "blockdev-snapshot-delete-internal-sync",
                json!({"device": "disk", "name": format!("ck{prev}")}),
            );
            if prev > 0 {
                // (b{prev - 1} was offered by the view just removed.)
                qmp.ok(
                    "block-dirty-bitmap-remove",
                    json!({"node": "disk", "name": format!("b{}", prev - 1)}),
                );
            }
        }
        prev_exported = true;
        prev_k = k;
        chain = file;
        if kill && i == 1 {
            // SIGKILL under load; the load ends at its first failed write.
            load.grant(40);
            load.wait_more(20);
            served.0.kill().unwrap();
            served.0.wait().unwrap();
            load.finish();
            served = serve_disk(&d);
            qmp = Qmp::connect(&d.path("qmp.sock"));
            // What the dead server left is the disk now.
            tracked = Tracked {
                model: read_export(&uri("")),
                applied: 0,
            };
            load = Load::start(transport, target.clone(), 0x33);
            prev_exported = false;
            restarted = true;
            prev_k = (0, 0);
        }
    }
    // Refusals in QMP's form.
    let v = qmp.cmd(
        "blockdev-snapshot-delete-internal-sync",
        json!({"device": "disk", "name": "ck3"}),
    );
    assert_eq!(v["error"]["class"], "GenericError", "{v}");
    let v = qmp.cmd(
        "block-dirty-bitmap-remove",
        json!({"node": "disk", "name": "b2"}),
    );
    assert!(
        v["error"]["desc"].as_str().unwrap().contains("in use"),
        "{v}"
    );
    let v = qmp.cmd(
        "block-dirty-bitmap-add",
        json!({"node": "other", "name": "x"}),
    );
    assert_eq!(
        v["error"]["desc"], "Cannot find device='other' nor node-name='other'",
        "{v}"
    );
    load.finish();
    qmp.ok("block-export-del", json!({"id": "v3"}));
    qmp.ok(
        "blockdev-snapshot-delete-internal-sync",
        json!({"device": "disk", "name": "ck3"}),
    );
    qmp.ok("quit", json!({}));
    let guard = HangGuard::start(
        "the server's exit after quit",
        Duration::from_secs(1),
        Duration::from_secs(60),
    );
    while served.0.try_wait().unwrap().is_none() {
        guard.check();
        std::thread::sleep(Duration::from_millis(20));
    }
    // After a SIGKILL, clusters allocated for writes not yet linked are leaked (exit 3),
    // as QEMU leaves them; nothing is corrupt.
    let out = qemu_img(&d.0, &["check", "disk.qcow2"]);
    let leaks_only = kill && out.status.code() == Some(3);
    assert!(out.status.success() || leaks_only, "{out:?}");
    let out = qemu_img(&d.0, &["snapshot", "-l", "disk.qcow2"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).trim().is_empty(),
        "{out:?}"
    );
}

/// The incremental backup of checkpoint 1 made with QEMU's and libnbd's tools from our
/// exports: `qemu-img convert` of the first view, an overlay, `nbdinfo --map` of the
/// dirty-bitmap context, `nbdcopy` of the second view and `qemu-io write -s` of each dirty
/// extent; it restores `model.raw` (checkpoint 1) too.
fn qemu_tools_backup(d: &Scratch, view0: &str, view1: &str) {
    let out = qemu_img(
        &d.0,
        &["convert", "-f", "raw", "-O", "qcow2", view0, "q0.qcow2"],
    );
    assert!(out.status.success(), "{out:?}");
    let out = qemu_img(
        &d.0,
        &[
            "create", "-f", "qcow2", "-b", "q0.qcow2", "-F", "qcow2", "q1.qcow2",
        ],
    );
    assert!(out.status.success(), "{out:?}");
    let out = run(&d.0, Path::new("nbdcopy"), &[view1, "view.raw"]);
    assert!(out.status.success(), "{out:?}");
    let view = std::fs::read(d.path("view.raw")).unwrap();
    let map = run(
        &d.0,
        Path::new("nbdinfo"),
        &["--json", "--map=qemu:dirty-bitmap:b0", view1],
    );
    assert!(map.status.success(), "{map:?}");
    let extents: Value = serde_json::from_slice(&map.stdout).unwrap();
    let mut cmds = Vec::new();
    for (n, e) in extents.as_array().unwrap().iter().enumerate() {
        if e["type"].as_u64().unwrap() & 1 == 0 {
            continue;
        }
        let (off, len) = (e["offset"].as_u64().unwrap(), e["length"].as_u64().unwrap());
        let piece = format!("piece{n}");
        std::fs::write(d.path(&piece), &view[off as usize..(off + len) as usize]).unwrap();
        cmds.push("-c".to_string());
        cmds.push(format!("write -q -s {piece} {off} {len}"));
    }
    assert!(!cmds.is_empty());
    let mut args: Vec<&str> = cmds.iter().map(String::as_str).collect();
    args.extend(["-f", "qcow2", "q1.qcow2"]);
    let out = run(&d.0, Path::new("qemu-io"), &args);
    assert!(out.status.success(), "{out:?}");
    let out = qemu_img(
        &d.0,
        &[
            "compare",
            "-f",
            "qcow2",
            "-F",
            "raw",
            "q1.qcow2",
            "model.raw",
        ],
    );
    assert!(out.status.success(), "QEMU's tools: {out:?}");
}

#[test]
fn incremental_backups_of_a_disk_written_over_nbd_restore_each_checkpoint() {
    if have_tools("incremental_backups_of_a_disk_written_over_nbd_restore_each_checkpoint") {
        scenario(Transport::Nbd, false);
    }
}

#[test]
fn incremental_backups_of_a_disk_written_over_vhost_user_restore_each_checkpoint() {
    if have_tools("incremental_backups_of_a_disk_written_over_vhost_user_restore_each_checkpoint") {
        scenario(Transport::VhostUser, false);
    }
}

/// QEMU's writer leaves every bitmap inconsistent when it is killed, so the backup after it
/// must be full (`bitmaps_interop::a_killed_server_leaves_bitmaps_an_incremental_backup_can_use`
/// runs QEMU's side); qimg's recording bitmap survives and the next incremental restores.
#[test]
fn an_incremental_backup_after_the_server_was_killed_restores_its_checkpoint() {
    if have_tools("an_incremental_backup_after_the_server_was_killed_restores_its_checkpoint") {
        scenario(Transport::Nbd, true);
    }
}

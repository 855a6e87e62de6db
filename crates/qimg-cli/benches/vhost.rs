//! `qimg serve --vhost-user-blk` against `qemu-storage-daemon --export type=vhost-user-blk` on
//! the same image, through the same vhost-user frontend (libblkio's `virtio-blk-vhost-user`
//! driver, as a VMM connects): 4 KiB random reads of a fully allocated extended-L2 image (every
//! L2 slice cached after a warm-up) and allocating 4 KiB writes (one per 64 KiB cluster) on an
//! overlay over a raw backing file, at QD1 and QD32, both daemons with `O_DIRECT` on io_uring.
//! Runs alternate between the daemons; medians of 3. Prints requests per second and the ratio.
//!
//! `cargo bench -p qimg-cli --bench vhost` (needs qemu-img, qemu-io, qemu-storage-daemon; set
//! `QIMG_BENCH_DIR` to a directory on a file system with O_DIRECT, default `target/`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, ReqFlags};

const SIZE: u64 = 1 << 30;
const BLOCK: usize = 4096;
const ROUNDS: usize = 3;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn sh(cmd: &mut Command) {
    let st = cmd.stdout(Stdio::null()).status().expect("command runs");
    assert!(st.success(), "{cmd:?} failed");
}

struct Daemon(Child, PathBuf);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

fn start(qimg: bool, image: &Path, dir: &Path) -> Daemon {
    let sock = dir.join(if qimg { "q.sock" } else { "s.sock" });
    let pid = dir.join(if qimg { "q.pid" } else { "s.pid" });
    let _ = std::fs::remove_file(&pid);
    let child = if qimg {
        Command::new(env!("CARGO_BIN_EXE_qimg"))
            .args(["serve", "--vhost-user-blk"])
            .arg(&sock)
            .args(["-t", "none", "-i", "io_uring", "--pidfile"])
            .arg(&pid)
            .arg(image)
            .spawn()
    } else {
        Command::new("qemu-storage-daemon")
            .arg("--blockdev")
            .arg(format!(
                "driver=file,node-name=file,filename={},cache.direct=on,aio=io_uring",
                image.display()
            ))
            .arg("--blockdev")
            .arg("driver=qcow2,node-name=disk,file=file")
            .arg("--export")
            .arg(format!(
                "type=vhost-user-blk,id=e,node-name=disk,addr.type=unix,addr.path={},writable=on",
                sock.display()
            ))
            .arg("--pidfile")
            .arg(&pid)
            .spawn()
    }
    .expect("daemon starts");
    let t = Instant::now();
    while !pid.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "daemon did not start"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    Daemon(child, sock)
}

/// Runs `count` requests at depth `qd` on one queue; requests per second.
fn run(
    socket: &Path,
    qd: usize,
    count: usize,
    write: bool,
    offsets: &mut dyn FnMut() -> u64,
) -> f64 {
    let mut b = Blkio::new("virtio-blk-vhost-user").unwrap();
    b.set_str("path", &socket.display().to_string()).unwrap();
    b.connect().unwrap();
    b.set_i32("num-queues", 1).unwrap();
    let mut started = b.start().unwrap();
    let region = b.alloc_mem_region(qd * BLOCK).unwrap();
    b.map_mem_region(&region).unwrap();
    let q: &mut Blkioq = &mut started.queues[0];
    let mut completions: Vec<std::mem::MaybeUninit<Completion>> =
        (0..qd).map(|_| std::mem::MaybeUninit::uninit()).collect();
    let (mut sent, mut done) = (0usize, 0usize);
    let mut free: Vec<usize> = (0..qd).collect();
    let t = Instant::now();
    while done < count {
        while sent < count {
            let Some(slot) = free.pop() else { break };
            let ptr = (region.addr + slot * BLOCK) as *mut u8;
            let at = offsets();
            if write {
                q.write(at, ptr, BLOCK, slot, ReqFlags::empty());
            } else {
                q.read(at, ptr, BLOCK, slot, ReqFlags::empty());
            }
            sent += 1;
        }
        let n = q.do_io(&mut completions, 1, None, None).unwrap();
        for c in completions.iter().take(n) {
            // SAFETY: do_io initialised the first `n` entries.
            let c = unsafe { c.assume_init_ref() };
            assert_eq!(
                c.ret,
                0,
                "{} request failed on {}",
                if write { "write" } else { "read" },
                socket.display()
            );
            free.push(c.user_data);
        }
        done += n;
    }
    count as f64 / t.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    if Command::new("qemu-storage-daemon")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("vhost bench: qemu-storage-daemon not found");
        return;
    }
    let dir = std::env::var_os("QIMG_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/vhost-bench")
        });
    std::fs::create_dir_all(&dir).unwrap();
    let full = dir.join("full.qcow2");
    sh(Command::new("qemu-img")
        .args([
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "extended_l2=on,cluster_size=64k",
        ])
        .arg(&full)
        .arg(SIZE.to_string()));
    sh(Command::new("qemu-io")
        .args(["-f", "qcow2", "-c"])
        .arg(format!("write -P 0x5a 0 {SIZE}"))
        .arg(&full));
    let base = dir.join("base.raw");
    sh(Command::new("qemu-img")
        .args(["create", "-q", "-f", "raw"])
        .arg(&base)
        .arg(SIZE.to_string()));
    // QIMG_BENCH_ONLY=TEXT runs only the rows whose name contains TEXT; QIMG_BENCH_SCALE=N
    // multiplies the request counts (for profiling one daemon with `perf record -p`).
    let only = std::env::var("QIMG_BENCH_ONLY").unwrap_or_default();
    let scale: usize = std::env::var("QIMG_BENCH_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    println!(
        "vhost-user-blk through libblkio, one queue, 4 KiB requests, O_DIRECT on io_uring; medians of {ROUNDS} alternating rounds"
    );
    println!("| workload | qemu-storage-daemon (req/s) | qimg serve (req/s) | qimg / QEMU |");
    println!("|---|---:|---:|---:|");
    for (what, write, qd, count) in [
        ("random reads, QD1", false, 1usize, 20_000usize),
        ("random reads, QD32", false, 32, 100_000),
        ("allocating writes over a backing file, QD1", true, 1, 8_000),
        (
            "allocating writes over a backing file, QD32",
            true,
            32,
            16_000,
        ),
    ] {
        if !only.is_empty() && !what.contains(only.as_str()) {
            continue;
        }
        let count = count * scale;
        let mut r = [Vec::new(), Vec::new()];
        for round in 0..ROUNDS {
            for (i, qimg) in [false, true].into_iter().enumerate() {
                let image = if write {
                    let top = dir.join("top.qcow2");
                    let _ = std::fs::remove_file(&top);
                    sh(Command::new("qemu-img")
                        .args([
                            "create",
                            "-q",
                            "-f",
                            "qcow2",
                            "-o",
                            "extended_l2=on,cluster_size=64k",
                            "-F",
                            "raw",
                            "-b",
                        ])
                        .arg(&base)
                        .arg(&top));
                    top
                } else {
                    full.clone()
                };
                let d = start(qimg, &image, &dir);
                let mut rng = Rng(0x9e37_79b9 + round as u64);
                if !write {
                    // Warm-up: every L2 slice into the daemon's cache.
                    let mut c = 0u64;
                    run(&d.1, 32, (SIZE / 65536) as usize, false, &mut || {
                        c += 65536;
                        c - 65536
                    });
                }
                let mut next = 0u64;
                let mut offsets = || {
                    if write {
                        next += 65536;
                        next - 65536
                    } else {
                        rng.next() % (SIZE / BLOCK as u64) * BLOCK as u64
                    }
                };
                r[i].push(run(&d.1, qd, count, write, &mut offsets));
                drop(d);
            }
        }
        let (qemu, ours) = (median(r[0].clone()), median(r[1].clone()));
        println!("| {what} | {qemu:.0} | {ours:.0} | {:.2} |", ours / qemu);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

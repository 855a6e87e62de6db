//! Per-queue completion handles against a plain ring: 4 KiB `O_DIRECT` random reads at QD1
//! and QD32 on a fully allocated extended-L2 image (every L2 slice cached), through
//! `qimg::Queue` and through a bare `QueueRing` reading the same host offsets from the image
//! file, in one run, alternating. Prints requests per second, the ratio, and eventfd wake-ups
//! per request.
//!
//! `cargo bench -p qimg --bench queue` (needs `qemu-img` and `qemu-io` to make the image; set
//! `QIMG_BENCH_DIR` to a directory on a file system with `O_DIRECT`, default `target/`).

use std::os::fd::AsFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use qimg::io::queue::{IoBuffers, Notifier, QueueRing};
use qimg::io::{AlignedBuf, Backend, FileOptions, Storage};
use qimg::{ExtentKind, OpenOptions, QueueOptions, Request};

const SIZE: u64 = 512 << 20;
const BLOCK: usize = 4096;
const ROUNDS: usize = 5;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn wait(n: &Notifier, wakeups: &mut u64) {
    let mut fds = [nix::poll::PollFd::new(
        n.as_fd(),
        nix::poll::PollFlags::POLLIN,
    )];
    match nix::poll::poll(&mut fds, nix::poll::PollTimeout::NONE) {
        Ok(_) | Err(nix::errno::Errno::EINTR) => {}
        Err(e) => panic!("poll: {e}"),
    }
    *wakeups += 1;
    n.drain().unwrap();
}

fn buf() -> IoBuffers {
    IoBuffers::from_aligned(AlignedBuf::zeroed(BLOCK, BLOCK).unwrap())
}

/// Reads `count` random blocks at depth `qd` through the bare ring; (seconds, wake-ups).
fn plain(path: &PathBuf, host: &[u64], count: usize, qd: usize, seed: u64) -> (f64, u64) {
    let file = FileOptions::new().direct(true).open(path).unwrap();
    let access = file.direct_access().unwrap();
    let mut ring = QueueRing::new(qd as u32).unwrap();
    let notifier = Notifier::new().unwrap();
    ring.register_eventfd(notifier.as_fd()).unwrap();
    let mut bufs: Vec<IoBuffers> = (0..qd).map(|_| buf()).collect();
    let mut rng = Rng(seed);
    let (mut sent, mut done, mut wakeups) = (0usize, 0usize, 0u64);
    let start = Instant::now();
    let mut free: Vec<usize> = (0..qd).collect();
    while done < count {
        while sent < count {
            let Some(i) = free.pop() else { break };
            let at = host[(rng.next() % host.len() as u64) as usize];
            ring.read(access.fd, at, &mut bufs[i], 0, BLOCK, i as u64)
                .unwrap();
            sent += 1;
        }
        ring.submit().unwrap();
        wait(&notifier, &mut wakeups);
        ring.reap(|c| {
            assert_eq!(c.result, BLOCK as i32);
            free.push(c.token as usize);
            done += 1;
        });
    }
    (start.elapsed().as_secs_f64(), wakeups)
}

/// The same reads through `qimg::Queue` at the guest offsets; (seconds, wake-ups, direct).
fn queued(
    image: &qimg::Image<qimg::io::AnyStorage>,
    guest: &[u64],
    count: usize,
    qd: usize,
    seed: u64,
) -> (f64, u64, u64) {
    let mut queue = image.queue(QueueOptions::new().depth(qd as u32)).unwrap();
    let notifier = queue.notifier().clone();
    let mut spare: Vec<IoBuffers> = (0..qd).map(|_| buf()).collect();
    let mut rng = Rng(seed);
    let (mut sent, mut done, mut wakeups) = (0usize, 0usize, 0u64);
    let start = Instant::now();
    while done < count {
        while sent < count {
            let Some(b) = spare.pop() else { break };
            let offset = guest[(rng.next() % guest.len() as u64) as usize];
            queue
                .submit(Request::Read { offset, buffers: b }, sent as u64)
                .unwrap();
            sent += 1;
        }
        wait(&notifier, &mut wakeups);
        while let Some(c) = queue.next_completed() {
            assert_eq!(*c.result.as_ref().unwrap(), BLOCK as u64);
            spare.push(c.buffers.unwrap());
            done += 1;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    (secs, wakeups, queue.stats().direct)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let dir = std::env::var_os("QIMG_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target"));
    let path = dir.join("queue-bench.qcow2");
    let made = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-o"])
        .arg("extended_l2=on,cluster_size=64k")
        .arg(&path)
        .arg(SIZE.to_string())
        .status();
    let filled = made.is_ok_and(|s| s.success())
        && std::process::Command::new("qemu-io")
            .args(["-f", "qcow2", "-c"])
            .arg(format!("write -P 0x5a 0 {SIZE}"))
            .arg(&path)
            .stdout(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    if !filled {
        eprintln!("queue bench: qemu-img could not create {}", path.display());
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let image = rt
        .block_on(
            OpenOptions::new()
                .direct(true)
                .backend(Backend::IoUring)
                .open(&path),
        )
        .expect("open with O_DIRECT on io_uring");
    // Guest offsets and the host offsets they map to; one read per cluster caches every slice.
    let extents = rt.block_on(image.map(0, SIZE)).unwrap();
    let mut guest = Vec::new();
    let mut host = Vec::new();
    for e in &extents {
        if let ExtentKind::Data { host_offset } = e.kind {
            let mut at = 0;
            while at < e.length {
                guest.push(e.start + at);
                host.push(host_offset + at);
                at += BLOCK as u64;
            }
        }
    }
    assert_eq!(
        guest.len() as u64,
        SIZE / BLOCK as u64,
        "image fully allocated"
    );
    let mut warm = vec![0u8; BLOCK];
    for c in (0..SIZE).step_by(65536) {
        rt.block_on(image.read(&mut warm, c)).unwrap();
    }
    println!(
        "4 KiB O_DIRECT random reads, io_uring, 512 MiB extended-L2 image (64 KiB clusters), L2 cached; medians of {ROUNDS} alternating rounds"
    );
    println!(
        "| QD | plain ring (req/s) | qimg::Queue (req/s) | Queue / ring | wake-ups per request (ring / Queue) | direct share |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    for (qd, count) in [(1usize, 20_000usize), (32, 100_000)] {
        let (mut a, mut b, mut wa, mut wb, mut direct) = (vec![], vec![], 0u64, 0u64, 0u64);
        for round in 0..ROUNDS {
            let seed = 0x9e37_79b9 + round as u64;
            let (s, w) = plain(&path, &host, count, qd, seed);
            a.push(count as f64 / s);
            wa += w;
            let (s, w, d) = queued(&image, &guest, count, qd, seed);
            b.push(count as f64 / s);
            wb += w;
            direct += d;
            std::thread::sleep(Duration::from_millis(50));
        }
        let (ma, mb) = (median(a), median(b));
        let total = (count * ROUNDS) as f64;
        println!(
            "| {qd} | {ma:.0} | {mb:.0} | {:.2} | {:.2} / {:.2} | {:.0}% |",
            mb / ma,
            wa as f64 / total,
            wb as f64 / total,
            100.0 * direct as f64 / total
        );
    }
    rt.block_on(image.close()).unwrap();
    let _ = std::fs::remove_file(&path);
}

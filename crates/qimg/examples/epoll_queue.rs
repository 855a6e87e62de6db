//! A VMM's virtqueue threads on `qimg::Queue`: plain `epoll` loops, no async runtime.
//!
//! ```sh
//! cargo run -p qimg --example epoll_queue [DIR]
//! ```
//!
//! Creates a 64 MiB extended-L2 qcow2 image, opens it, and gives each of two threads its own
//! [`Queue`] (its own io_uring ring and eventfd). Each thread acts as one guest queue: it
//! keeps up to 16 requests in flight on its half of the disk (4 KiB writes, then reads of the
//! same blocks, a write-zeroes and a flush), sleeps in `epoll_wait` on the queue's eventfd, and
//! collects completions with `next_completed()`, checking every byte read. The first writes
//! allocate clusters (the engine does that on the queue's own thread); the rewrites and reads
//! land on allocated clusters and go from the loop's thread straight to the kernel. The
//! counters printed at the end show the split.
//!
//! Files go to DIR or to a fresh directory under the system temporary directory (removed
//! afterwards).

use std::collections::HashMap;
use std::error::Error;
use std::path::PathBuf;
use std::time::Duration;

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use qimg::io::AnyStorage;
use qimg::tools::create::{CreateOptions, create};
use qimg::{IoBuffers, OpenOptions, Queue, QueueOptions, Request};

type AnyResult<T> = Result<T, Box<dyn Error + Send + Sync>>;

const DISK: u64 = 64 << 20;
const BLOCK: usize = 4096;
const DEPTH: usize = 16;

/// What a guest queue asked for, remembered until its completion arrives.
enum Pending {
    Write,
    Read { offset: u64 },
    Flush,
}

fn byte(offset: u64, pass: u64) -> u8 {
    ((offset / BLOCK as u64).wrapping_mul(31) + pass) as u8
}

/// One guest queue: `passes` rounds of write-then-read over `[lo, hi)`.
fn serve(mut queue: Queue<AnyStorage>, lo: u64, hi: u64) -> AnyResult<String> {
    let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
    epoll.add(queue.notifier(), EpollEvent::new(EpollFlags::EPOLLIN, 0))?;
    let mut pending: HashMap<u64, Pending> = HashMap::new();
    let mut next_id = 0u64;
    let mut wakeups = 0u64;
    let blocks: Vec<u64> = (lo..hi).step_by(BLOCK * 4).collect();
    for pass in 0..3u64 {
        // Writes, then reads, then a write-zeroes of the first block and a flush.
        let mut work: Vec<(Request, Pending)> = Vec::new();
        for &offset in &blocks {
            let data = vec![byte(offset, pass); BLOCK];
            work.push((
                Request::Write {
                    offset,
                    buffers: IoBuffers::from_vec(data),
                },
                Pending::Write,
            ));
        }
        work.push((Request::Flush, Pending::Flush));
        for &offset in &blocks {
            work.push((
                Request::Read {
                    offset,
                    buffers: IoBuffers::from_vec(vec![0; BLOCK]),
                },
                Pending::Read { offset },
            ));
        }
        work.reverse();
        while !work.is_empty() || !pending.is_empty() {
            // Refill the queue. A flush waits for the writes before it and the reads wait for
            // the flush: nothing is submitted while one is in flight.
            while pending.len() < DEPTH && !pending.values().any(|p| matches!(p, Pending::Flush)) {
                let Some((req, what)) = work.pop() else { break };
                if matches!(what, Pending::Flush) && !pending.is_empty() {
                    work.push((req, what));
                    break;
                }
                next_id += 1;
                pending.insert(next_id, what);
                queue.submit(req, next_id)?;
            }
            // Sleep until the eventfd says something completed.
            let mut events = [EpollEvent::empty(); 1];
            match epoll.wait(
                &mut events,
                EpollTimeout::try_from(Duration::from_secs(30))?,
            ) {
                Ok(0) => return Err("no completion within 30 s".into()),
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(e.into()),
            }
            wakeups += 1;
            queue.notifier().drain()?;
            while let Some(c) = queue.next_completed() {
                let what = pending.remove(&c.user_data).ok_or("unknown completion")?;
                if let Err(e) = &c.result {
                    return Err(format!("request {} failed: {e}", c.user_data).into());
                }
                if let Pending::Read { offset } = what {
                    let bufs = c.buffers.ok_or("read without buffers")?;
                    let owner = bufs.into_owner().map_err(|_| "buffers still busy")?;
                    let got = owner
                        .ok_or("owned buffer")?
                        .downcast::<Vec<u8>>()
                        .map_err(|_| "a Vec<u8>")?;
                    if got.iter().any(|&b| b != byte(offset, pass)) {
                        return Err(format!("block at {offset:#x} reads back wrong").into());
                    }
                }
            }
        }
    }
    let s = queue.stats();
    Ok(format!(
        "{} requests: {} direct from this thread, {} on the engine, {wakeups} epoll wake-ups, {} ring enters",
        next_id, s.direct, s.engine, s.ring_enters
    ))
}

fn main() -> AnyResult<()> {
    let (dir, keep) = match std::env::args_os().nth(1) {
        Some(d) => (PathBuf::from(d), true),
        None => {
            let d = std::env::temp_dir().join(format!("qimg-epoll-queue-{}", std::process::id()));
            std::fs::create_dir_all(&d)?;
            (d, false)
        }
    };
    let disk = dir.join("epoll-queue.qcow2");
    let _ = std::fs::remove_file(&disk);
    let opts = CreateOptions {
        size: Some(DISK),
        cluster_size: 64 * 1024,
        extended_l2: true,
        ..Default::default()
    };
    create(&disk, &opts, &mut |_, _| {})?;
    // Synchronous open; the queues need no runtime of the caller's.
    let image = OpenOptions::new().writable(true).open_blocking(&disk)?;
    let threads: Vec<_> = (0..2u64)
        .map(|q| {
            let queue = image
                .as_async()
                .queue(QueueOptions::new().depth(DEPTH as u32))?;
            let (lo, hi) = (q * DISK / 2, (q + 1) * DISK / 2);
            Ok(std::thread::spawn(move || serve(queue, lo, hi)))
        })
        .collect::<qimg::Result<_>>()?;
    for (q, t) in threads.into_iter().enumerate() {
        let report = t.join().map_err(|_| "queue thread panicked")??;
        println!("queue {q}: {report}");
    }
    image.close()?;
    println!(
        "closed {}; every block read back as written",
        disk.display()
    );
    if !keep {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}

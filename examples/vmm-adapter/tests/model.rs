//! The adapter driven as a VMM drives its disk: the VMM opens the image itself and takes its
//! own whole-file lock, the adapter opens qimg on that descriptor, and two virtqueue threads,
//! each with its own `AsyncIo` and an epoll loop on its eventfd, run a seeded mix of reads
//! and writes (guest memory of one to three segments, aligned or not, and bounce buffers;
//! single and batched), write-zeroes with and without unmap, discards (which a VMM sends to
//! `punch_hole`), asynchronous flushes and blocking flushes, several requests in flight.
//! Every read is checked against a model when it completes, every operation comes back with
//! its completion, and at the end `qemu-img check` is clean and `qemu-img compare` finds the
//! model. Runs on `O_DIRECT` and buffered files.
//!
//! A second test checks the mapping table in `qimg::queue`'s docs against this adapter.

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;

use qimg::OpenOptions;
use qimg::io::AlignedBuf;
use qimg_testkit::pattern::pattern;
use qimg_testkit::qemu::{Scratch, assert_clean, assert_same_as_model, have_qemu, qemu_create};
use qimg_testkit::rng::Rng;
use qimg_vmm_adapter::adapter::QcowDisk;
use qimg_vmm_adapter::vmm::{AsyncIo, AsyncIoOp, BatchRequest, DiskFile, GuestTarget, IoTarget};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

const SIZE: u64 = 16 << 20;
const DEPTH: usize = 8;
const OPS: u64 = 400;

/// The stand-in's guest memory: one aligned block the iovecs point into.
struct GuestMemory(AlignedBuf);

/// A request in flight: its range, and for a read the bytes it must find.
struct InFlight {
    offset: u64,
    len: u64,
    expect: Option<Vec<u8>>,
    what: &'static str,
}

/// A read or write operation over `len` bytes: guest memory in 1-3 segments (aligned for
/// `O_DIRECT` or not) or a bounce buffer; for a write, holding `data`.
fn operation(rng: &mut Rng, offset: u64, len: usize, data: Option<&[u8]>) -> AsyncIoOp {
    if rng.chance(1, 4) {
        let buf = data.map_or_else(|| vec![0xcc; len], <[u8]>::to_vec);
        return AsyncIoOp {
            offset,
            target: IoTarget::Bounce(buf),
        };
    }
    let aligned = len % 4096 == 0 && rng.chance(3, 4);
    // Segments at page boundaries when aligned, at odd places inside the block otherwise.
    let skip = if aligned {
        0
    } else {
        rng.range(1, 64) as usize
    };
    let mut block = AlignedBuf::zeroed(len + skip + 8192, 4096).unwrap();
    if let Some(d) = data {
        block[skip..skip + len].copy_from_slice(d);
    }
    let base = block.as_mut_ptr();
    let cuts = if len >= 8192 && rng.chance(1, 2) {
        let step = if aligned { 4096 } else { 1 };
        let a = rng.range(1, (len / step) as u64) as usize * step;
        vec![(0, a), (a, len - a)]
    } else {
        vec![(0, len)]
    };
    let iovecs = cuts
        .into_iter()
        .map(|(at, n)| libc::iovec {
            iov_base: base.wrapping_add(skip + at).cast(),
            iov_len: n,
        })
        .collect();
    let memory = Arc::new((GuestMemory(block), skip));
    AsyncIoOp {
        offset,
        target: IoTarget::Guest(GuestTarget { memory, iovecs }),
    }
}

/// The bytes an operation holds, in disk order.
fn bytes_of(op: AsyncIoOp) -> Vec<u8> {
    match op.target {
        IoTarget::Bounce(b) => b,
        IoTarget::Guest(g) => {
            let len: usize = g.iovecs.iter().map(|v| v.iov_len).sum();
            let (mem, skip) = match Arc::downcast::<(GuestMemory, usize)>(g.memory) {
                Ok(m) => Arc::try_unwrap(m)
                    .ok()
                    .expect("the disk kept the guest memory"),
                Err(_) => panic!("another guest memory came back"),
            };
            mem.0[skip..skip + len].to_vec()
        }
    }
}

/// Runs one virtqueue thread over `[lo, hi)` of the disk: returns the region's final bytes.
fn virtqueue(mut io: Box<dyn AsyncIo>, mut model: Vec<u8>, lo: u64, seed: u64) -> Vec<u8> {
    let hi = lo + model.len() as u64;
    let mut rng = Rng(seed);
    let epoll = Epoll::new().unwrap();
    let fd = io.notifier().as_raw_fd();
    epoll
        .ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, 0))
        .unwrap();
    let mut in_flight: HashMap<u64, InFlight> = HashMap::new();
    let mut next = 0u64;
    let mut done = 0u64;
    let mut counts: HashMap<&str, u64> = HashMap::new();
    while done < OPS || !in_flight.is_empty() {
        // Submit while there is room and the next request overlaps nothing in flight.
        while done + (in_flight.len() as u64) < OPS && in_flight.len() < DEPTH {
            let kind = rng.below(100);
            let len = if rng.chance(1, 2) {
                rng.range(1, 33) * 4096
            } else {
                rng.range(1, 70_000)
            };
            let offset = lo + rng.below(hi - lo - len);
            let overlaps = |f: &InFlight| offset < f.offset + f.len && f.offset < offset + len;
            if in_flight.values().any(overlaps) {
                break;
            }
            let (at, n) = ((offset - lo) as usize, len as usize);
            let user_data = next;
            next += 1;
            let (what, expect) = match kind {
                0..=34 => {
                    let op = operation(&mut rng, offset, n, None);
                    io.read_vectored(op, user_data).map_err(|(_, e)| e).unwrap();
                    ("read", Some(model[at..at + n].to_vec()))
                }
                35..=64 => {
                    let data = pattern(seed ^ user_data, offset, n);
                    model[at..at + n].copy_from_slice(&data);
                    let op = operation(&mut rng, offset, n, Some(&data));
                    io.write_vectored(op, user_data)
                        .map_err(|(_, e)| e)
                        .unwrap();
                    ("write", None)
                }
                65..=74 => {
                    // A batch of a write and a read of other bytes, submitted at once.
                    let half = n / 2;
                    let data = pattern(seed ^ user_data, offset, half);
                    model[at..at + half].copy_from_slice(&data);
                    let w = operation(&mut rng, offset, half, Some(&data));
                    let r = operation(&mut rng, offset + half as u64, n - half, None);
                    let batch = vec![
                        (BatchRequest::Write(w), user_data),
                        (BatchRequest::Read(r), next),
                    ];
                    let read = InFlight {
                        offset: offset + half as u64,
                        len: (n - half) as u64,
                        expect: Some(model[at + half..at + n].to_vec()),
                        what: "batched read",
                    };
                    in_flight.insert(next, read);
                    next += 1;
                    io.submit_batch_requests(batch).map_err(|(_, e)| e).unwrap();
                    ("batched write", None)
                }
                75..=81 => {
                    model[at..at + n].fill(0);
                    io.write_zeroes(offset, len, user_data).unwrap();
                    ("write-zeroes", None)
                }
                82..=88 => {
                    // A guest's write-zeroes with unmap, or its discard: both to punch_hole,
                    // and both must read zeros afterwards.
                    model[at..at + n].fill(0);
                    io.punch_hole(offset, len, user_data).unwrap();
                    (
                        if kind % 2 == 0 {
                            "write-zeroes-unmap"
                        } else {
                            "discard"
                        },
                        None,
                    )
                }
                89..=94 => {
                    io.fsync(Some(user_data)).unwrap();
                    ("flush", None)
                }
                _ => {
                    // Write-through: done on return, other completions kept.
                    io.fsync(None).unwrap();
                    *counts.entry("blocking flush").or_default() += 1;
                    done += 1;
                    continue;
                }
            };
            let (offset, len) = if what == "flush" {
                (0, 0)
            } else {
                (offset, len)
            };
            in_flight.insert(
                user_data,
                InFlight {
                    offset,
                    len,
                    expect,
                    what,
                },
            );
        }
        // Collect; sleep in epoll when nothing is ready.
        let mut got = false;
        while let Some(c) = io.next_completed_request() {
            got = true;
            let f = in_flight
                .remove(&c.user_data)
                .expect("a completion nobody submitted");
            assert!(
                c.result >= 0,
                "{} at {} ({} bytes) failed: {}",
                f.what,
                f.offset,
                f.len,
                c.result
            );
            *counts.entry(f.what).or_default() += 1;
            done += 1;
            match (f.expect, c.op) {
                (Some(want), Some(op)) => {
                    assert_eq!(c.result as u64, f.len, "{} length", f.what);
                    let got = bytes_of(op);
                    if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
                        panic!(
                            "{} at {}: byte {i} is {:#x}, want {:#x}",
                            f.what, f.offset, got[i], want[i]
                        );
                    }
                }
                (None, Some(op)) => assert!(f.what.contains("write"), "{}: {}", f.what, op.offset),
                (None, None) => assert!(!f.what.contains("write") || f.what.contains("zeroes")),
                (Some(_), None) => panic!("{} came back without its operation", f.what),
            }
        }
        if !got && !in_flight.is_empty() {
            let mut events = [EpollEvent::default(); 1];
            // Hang guard: a completion takes milliseconds; 60 s is far over ten times that.
            match epoll.wait(60_000, &mut events) {
                Ok(n) => assert!(
                    n > 0,
                    "no completion within 60 s: {} in flight",
                    in_flight.len()
                ),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => panic!("epoll: {e}"),
            }
            let _ = io.notifier().read();
        }
    }
    println!("virtqueue at {lo}: {counts:?}");
    for what in [
        "read",
        "write",
        "batched write",
        "write-zeroes",
        "flush",
        "blocking flush",
    ] {
        assert!(
            counts.get(what).copied().unwrap_or(0) > 0,
            "no {what} ran: {counts:?}"
        );
    }
    model
}

fn run(direct: bool, seed: u64) {
    let dir = Scratch::new("vmm-adapter");
    let backing: Vec<u8> = (0..SIZE).map(|i| (i / 4096 % 251) as u8 | 1).collect();
    std::fs::write(dir.path("base.raw"), &backing).unwrap();
    let options = "extended_l2=on,cluster_size=64k";
    qemu_create(
        &dir.0,
        "top.qcow2",
        options,
        SIZE,
        Some(("base.raw", "raw")),
    );
    // The VMM opens the disk itself, O_DIRECT or not, and locks the whole file.
    let path = dir.path("top.qcow2");
    let flags = if direct { libc::O_DIRECT } else { 0 };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(flags)
        .open(&path)
        .unwrap();
    let lock = libc::flock {
        l_type: libc::F_WRLCK as libc::c_short,
        l_whence: libc::SEEK_SET as libc::c_short,
        l_start: 0,
        l_len: 0,
        l_pid: 0,
    };
    let locked = nix::fcntl::fcntl(&file, nix::fcntl::FcntlArg::F_OFD_SETLK(&lock));
    locked.expect("the VMM's whole-file lock");
    let mut disk = QcowDisk::open(
        file.try_clone().unwrap(),
        &path,
        OpenOptions::new().writable(true),
    )
    .unwrap()
    .expect("an extended-L2 image goes to qimg");
    assert_eq!(disk.size().unwrap(), SIZE);
    let half = SIZE / 2;
    let threads: Vec<_> = (0..2u64)
        .map(|q| {
            let io = disk.new_async_io(64).unwrap();
            let model = backing[(q * half) as usize..((q + 1) * half) as usize].to_vec();
            std::thread::spawn(move || virtqueue(io, model, q * half, seed * 10 + q))
        })
        .collect();
    let mut merged = Vec::new();
    for t in threads {
        merged.extend(t.join().expect("virtqueue thread"));
    }
    // The queues are gone with their threads; dropping the disk closes the image.
    drop(disk);
    drop(file);
    let what = format!("adapter direct={direct}");
    assert_clean(&dir.0, "top.qcow2", &what);
    assert_same_as_model(&dir.0, "top.qcow2", &merged, &what);
}

#[test]
fn two_virtqueues_match_the_model_buffered() {
    if !have_qemu("two_virtqueues_match_the_model_buffered") {
        return;
    }
    run(false, 1);
}

#[test]
fn two_virtqueues_match_the_model_with_o_direct() {
    if !have_qemu("two_virtqueues_match_the_model_with_o_direct") {
        return;
    }
    run(true, 2);
}

//! UringStorage: conformance in every configuration, many requests in flight, cancelled
//! futures, executor independence, fallbacks, and agreement with the in-memory model.
//!
//! Every test first checks that io_uring works here; where it does not (old kernel, seccomp,
//! `kernel.io_uring_disabled`), it prints "skipped: io_uring unavailable: <reason>" and passes.
#![cfg(target_os = "linux")]

use qimg_testkit::Rng;
use std::future::Future;
use std::io::IoSlice;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use qimg_io::conformance::{assert_futures_are_send, run_all};
use qimg_io::{
    AlignedBuf, FileStorage, MemStorage, Op, Storage, StorageError, UringOptions, UringStorage,
};

/// Opens `path`, or says why io_uring is unusable here and returns `None`.
fn open(opts: &UringOptions, path: &Path) -> Option<UringStorage> {
    match opts.open(path) {
        Ok(s) => Some(s),
        Err(e @ StorageError::UringUnavailable { .. }) => {
            let reason = std::error::Error::source(&e).map_or(String::new(), |s| s.to_string());
            println!("skipped: io_uring unavailable: {reason}");
            None
        }
        Err(e) => panic!("open {}: {e}", path.display()),
    }
}

fn rw() -> UringOptions {
    UringOptions::new().read_write(true).create(true)
}

/// Whether the ring works and the directory's file system takes O_DIRECT.
fn usable(dir: &tempfile::TempDir, direct: bool) -> bool {
    let path = dir.path().join(format!("probe-{direct}"));
    match rw().direct(direct).open(&path) {
        Ok(_) => true,
        Err(e @ StorageError::UringUnavailable { .. }) => {
            let reason = std::error::Error::source(&e).map_or(String::new(), |s| s.to_string());
            println!("skipped: io_uring unavailable: {reason}");
            false
        }
        Err(e) => {
            println!(
                "skipping O_DIRECT: {e} ({:?})",
                std::error::Error::source(&e)
            );
            false
        }
    }
}

/// A factory of fresh, empty files in one temporary directory.
fn files(dir: &tempfile::TempDir, opts: UringOptions) -> impl Fn() -> UringStorage + '_ {
    static N: AtomicU32 = AtomicU32::new(0);
    move || {
        let path = dir
            .path()
            .join(format!("u{}", N.fetch_add(1, Ordering::Relaxed)));
        opts.clone()
            .read_write(true)
            .create_new(true)
            .open(&path)
            .expect("create test file")
    }
}

/// Compile-time: the futures are `Send`, and spawnable.
#[allow(dead_code)]
fn futures_are_send(u: &UringStorage) {
    assert_futures_are_send(u);
    fn spawnable<T: Send + 'static>(_: T) {}
    let u = u.clone();
    spawnable(async move {
        let mut b = [0u8; 4];
        u.read_at(&mut b, 0).await
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uring_storage_conforms() {
    let dir = tempfile::tempdir().unwrap();
    if !usable(&dir, false) {
        return;
    }
    run_all(files(&dir, UringOptions::new())).await;
    // A ring far smaller than the 64 concurrent tasks of the suite: requests queue for slots.
    run_all(files(&dir, UringOptions::new().entries(2))).await;
    run_all(files(&dir, UringOptions::new().fallocate(false))).await;
}

#[tokio::test(flavor = "current_thread")]
async fn uring_storage_conforms_on_a_current_thread_runtime() {
    let dir = tempfile::tempdir().unwrap();
    if !usable(&dir, false) {
        return;
    }
    run_all(files(&dir, UringOptions::new().entries(4))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uring_storage_with_o_direct_conforms() {
    // tempdir() is on the file system of TMPDIR; O_DIRECT needs one that takes it (not
    // tmpfs on older kernels), so this skips with a message where it does not.
    let dir = tempfile::tempdir().unwrap();
    if !usable(&dir, true) {
        return;
    }
    run_all(files(&dir, UringOptions::new().direct(true))).await;
    run_all(files(
        &dir,
        UringOptions::new().direct(true).fallocate(false),
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_synchronous_fallback_conforms() {
    let dir = tempfile::tempdir().unwrap();
    if !usable(&dir, false) {
        return;
    }
    let all = [
        Op::Read,
        Op::Write,
        Op::Flush,
        Op::WriteZeroes,
        Op::Discard,
        Op::Allocate,
    ];
    let mut opts = UringOptions::new();
    for op in all {
        opts = opts.fallback_for(op);
    }
    let s = files(&dir, opts.clone())();
    for op in all {
        assert!(!s.uses_ring_for(op), "{op}");
    }
    run_all(files(&dir, opts)).await;
    // Half and half: reads and flushes on the ring, the rest not, and the other way round.
    run_all(files(
        &dir,
        UringOptions::new()
            .fallback_for(Op::Write)
            .fallback_for(Op::WriteZeroes),
    ))
    .await;
    run_all(files(
        &dir,
        UringOptions::new()
            .fallback_for(Op::Read)
            .fallback_for(Op::Flush),
    ))
    .await;
}

#[test]
fn the_kernel_here_supports_every_opcode_used() {
    let dir = tempfile::tempdir().unwrap();
    let Some(s) = open(&rw(), &dir.path().join("img")) else {
        return;
    };
    for op in [
        Op::Read,
        Op::Write,
        Op::Flush,
        Op::WriteZeroes,
        Op::Discard,
        Op::Allocate,
    ] {
        // io_uring has had all of these since Linux 5.6; on older kernels some fall back.
        println!("{op}: ring {}", s.uses_ring_for(op));
    }
    assert!(!s.uses_ring_for(Op::SetLen) && !s.uses_ring_for(Op::Len));
    assert_eq!(s.entries(), 64);
    let small = open(&rw().entries(0), &dir.path().join("small")).unwrap();
    assert_eq!(small.entries(), 1, "0 entries is taken as 1");
    let odd = open(&rw().entries(5), &dir.path().join("odd")).unwrap();
    assert_eq!(odd.entries(), 8, "rounded up to a power of two");
}

/// Polls `f` once with a waker that does nothing.
fn poll_once<F: Future + ?Sized>(f: Pin<&mut F>) -> Poll<F::Output> {
    f.poll(&mut Context::from_waker(Waker::noop()))
}

type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// 64 requests in flight at once on a 64-entry ring: every one is submitted before any is
/// collected; a 65th waits for a slot and proceeds when one frees up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_requests_in_flight_at_once() {
    let dir = tempfile::tempdir().unwrap();
    for direct in [false, true] {
        if !usable(&dir, direct) {
            continue;
        }
        let path = dir.path().join(format!("img-{direct}"));
        let s = open(&rw().entries(64).direct(direct), &path).unwrap();
        assert_eq!(s.entries(), 64);
        let block = 64 * 1024usize;
        let data: Vec<AlignedBuf> = (0..65)
            .map(|i| {
                let mut b = AlignedBuf::zeroed(block, 4096).unwrap();
                b.iter_mut()
                    .enumerate()
                    .for_each(|(j, x)| *x = (i * 7 + j / 4096) as u8);
                b
            })
            .collect();
        let mut writes: Vec<BoxFut<'_, qimg_io::Result<()>>> = data
            .iter()
            .enumerate()
            .map(|(i, b)| Box::pin(s.write_at(b, (i * block) as u64)) as BoxFut<'_, _>)
            .collect();
        // The first poll submits. It may also collect the completion when the completion
        // thread was faster than the poll (the page cache serves buffered requests inside the
        // submission): such a request is finished and holds no slot.
        let mut done = vec![false; writes.len()];
        for (w, d) in writes.iter_mut().zip(done.iter_mut()).take(64) {
            if let Poll::Ready(r) = poll_once(w.as_mut()) {
                r.unwrap();
                *d = true;
            }
        }
        let finished = done.iter().filter(|&&d| d).count();
        assert_eq!(s.in_flight(), 64 - finished, "direct {direct}");
        if finished == 0 {
            assert!(poll_once(writes[64].as_mut()).is_pending());
            assert_eq!(s.in_flight(), 64, "the 65th waits for a slot");
        } else {
            println!("{finished} of 64 writes completed at submission (direct {direct})");
        }
        for (w, d) in writes.into_iter().zip(done) {
            if !d {
                w.await.unwrap();
            }
        }
        assert_eq!(s.in_flight(), 0);

        // The same for reads, each into its own buffer.
        let mut bufs: Vec<AlignedBuf> = (0..64)
            .map(|_| AlignedBuf::zeroed(block, 4096).unwrap())
            .collect();
        let mut reads: Vec<BoxFut<'_, qimg_io::Result<()>>> = bufs
            .iter_mut()
            .enumerate()
            .map(|(i, b)| Box::pin(s.read_at(b, (i * block) as u64)) as BoxFut<'_, _>)
            .collect();
        let mut done = vec![false; reads.len()];
        for (r, d) in reads.iter_mut().zip(done.iter_mut()) {
            if let Poll::Ready(r) = poll_once(r.as_mut()) {
                r.unwrap();
                *d = true;
            }
        }
        let finished = done.iter().filter(|&&d| d).count();
        assert_eq!(s.in_flight(), 64 - finished);
        for (r, d) in reads.into_iter().zip(done) {
            if !d {
                r.await.unwrap();
            }
        }
        for (i, b) in bufs.iter().enumerate() {
            assert!(**b == *data[i], "block {i}, direct {direct}");
        }
    }
}

/// Tasks spread over the runtime's threads, 64 at once, with a ring smaller than that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_tasks_share_a_small_ring() {
    let dir = tempfile::tempdir().unwrap();
    let Some(s) = open(&rw().entries(8), &dir.path().join("img")) else {
        return;
    };
    let s = Arc::new(s);
    let tasks: Vec<_> = (0..64u64)
        .map(|i| {
            let s = Arc::clone(&s);
            tokio::spawn(async move {
                for round in 0..10u64 {
                    let v = vec![(i + round) as u8; 3000];
                    s.write_at(&v, i * 3000).await.unwrap();
                    let mut back = vec![0u8; 3000];
                    s.read_at(&mut back, i * 3000).await.unwrap();
                    assert_eq!(back, v, "task {i} round {round}");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(s.in_flight(), 0);
    s.flush().await.unwrap();
}

/// Dropping futures with their requests in flight is safe: the memory stays with the ring
/// until the kernel is done, later requests work, and dropping the storage waits for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_requests_are_safe() {
    let dir = tempfile::tempdir().unwrap();
    for direct in [false, true] {
        if !usable(&dir, direct) {
            continue;
        }
        let path = dir.path().join(format!("img-{direct}"));
        let s = open(&rw().direct(direct), &path).unwrap();
        let big = AlignedBuf::copy_from(&vec![0x5a; 16 << 20], 4096).unwrap();
        s.write_at(&big, 0).await.unwrap();
        s.flush().await.unwrap();
        for round in 0..5 {
            let mut bufs: Vec<AlignedBuf> = (0..8)
                .map(|_| AlignedBuf::zeroed(4 << 20, 4096).unwrap())
                .collect();
            {
                let mut reads: Vec<BoxFut<'_, qimg_io::Result<()>>> = bufs
                    .iter_mut()
                    .enumerate()
                    .map(|(i, b)| Box::pin(s.read_at(b, (i as u64 % 4) << 20)) as BoxFut<'_, _>)
                    .collect();
                let mut w = Box::pin(s.write_at(&big[..1 << 20], 12 << 20));
                // Usually in flight now (it may already be finished: see above).
                let _ = poll_once(w.as_mut());
                for r in reads.iter_mut() {
                    let _ = poll_once(r.as_mut());
                }
                // Cancel everything mid-flight.
            }
            // The caller's buffers are free to reuse at once.
            for b in bufs.iter_mut() {
                b.fill(round);
            }
            let mut check = AlignedBuf::zeroed(1 << 20, 4096).unwrap();
            s.read_at(&mut check, 1 << 20).await.unwrap();
            assert!(check.iter().all(|&x| x == 0x5a));
        }
        // Abandoned requests free their slots when they complete.
        for _ in 0..1000 {
            if s.in_flight() == 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(s.in_flight(), 0, "direct {direct}");
        // And dropping with requests in flight returns once they are done.
        let mut b = AlignedBuf::zeroed(8 << 20, 4096).unwrap();
        {
            let mut r = Box::pin(s.read_at(&mut b, 0));
            let _ = poll_once(r.as_mut());
        }
        drop(s);
    }
}

/// A minimal executor, to show the futures need no tokio: completions wake the thread
/// through the task's waker.
fn block_on<F: Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

#[test]
fn futures_run_on_any_executor() {
    let dir = tempfile::tempdir().unwrap();
    let Some(s) = open(&rw().entries(4), &dir.path().join("img")) else {
        return;
    };
    block_on(async {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
        s.write_vectored_at(&[IoSlice::new(&data[..7]), IoSlice::new(&data[7..])], 3)
            .await
            .unwrap();
        s.flush().await.unwrap();
        let mut back = vec![0u8; data.len()];
        s.read_at(&mut back, 3).await.unwrap();
        assert!(back == data);
        assert_eq!(s.len().await.unwrap(), 100_003);
    });
    // Several requests at once, each waiting on its own waker, on several threads.
    let s = Arc::new(s);
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let s = Arc::clone(&s);
            std::thread::spawn(move || {
                block_on(async {
                    for i in 0..50u64 {
                        let v = [(t * 50 + i) as u8; 512];
                        s.write_at(&v, (t * 50 + i) * 512).await.unwrap();
                    }
                })
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let mut back = vec![0u8; 200 * 512];
    block_on(s.read_at(&mut back, 0)).unwrap();
    for (i, c) in back.chunks(512).enumerate() {
        assert!(c.iter().all(|&x| x == i as u8), "sector {i}");
    }
}

#[tokio::test]
async fn requests_larger_than_one_ring_request_are_split() {
    let dir = tempfile::tempdir().unwrap();
    for direct in [false, true] {
        if !usable(&dir, direct) {
            continue;
        }
        let s = open(
            &rw().direct(direct).entries(2),
            &dir.path().join(format!("img-{direct}")),
        )
        .unwrap();
        let len = 20 << 20; // more than the 8 MiB bounce buffer
        let mut data = AlignedBuf::zeroed(len, 4096).unwrap();
        data.iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = (i / 4096 % 251) as u8);
        s.write_at(&data, 4096).await.unwrap();
        let mut back = AlignedBuf::zeroed(len + 8192, 4096).unwrap();
        let n = s.read_at_most(&mut back, 0).await.unwrap();
        assert_eq!(n, len + 4096);
        assert!(back[..4096].iter().all(|&x| x == 0));
        assert!(back[4096..4096 + len] == *data, "direct {direct}");
        s.write_zeroes(4096, len as u64).await.unwrap();
        s.read_at(&mut back[..len], 4096).await.unwrap();
        assert!(back[..len].iter().all(|&x| x == 0));
    }
}

#[tokio::test]
async fn flushed_data_is_seen_by_a_fresh_open_and_read_only_refuses_writes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("img");
    let Some(s) = open(&rw(), &path) else {
        return;
    };
    s.write_at(b"durable", 4096).await.unwrap();
    s.flush().await.unwrap();
    drop(s);
    let again = FileStorage::open(&path).unwrap();
    let mut b = [0u8; 7];
    again.read_at(&mut b, 4096).await.unwrap();
    assert_eq!(&b, b"durable");

    let ro = UringStorage::open(&path, &UringOptions::new()).unwrap();
    assert!(ro.is_read_only() && !ro.is_direct());
    let e = ro.write_at(b"x", 0).await.unwrap_err();
    assert!(matches!(e, StorageError::ReadOnly { .. }), "{e:?}");
    assert!(ro.write_zeroes(0, 1).await.is_err());
    assert!(ro.discard(0, 1).await.is_err());
    assert!(ro.allocate(0, 1).await.is_err());
    assert!(ro.set_len(0).await.is_err());
    ro.flush().await.unwrap();
    ro.read_at(&mut b, 4096).await.unwrap();
    assert_eq!(&b, b"durable");

    let e = UringStorage::open(dir.path().join("missing"), &UringOptions::new()).unwrap_err();
    assert!(e.to_string().contains("missing"), "{e}");
    assert_eq!(e.kind(), std::io::ErrorKind::NotFound);

    // from_file reads the access mode from the descriptor.
    let f = std::fs::File::open(&path).unwrap();
    let ro = UringOptions::new().from_file(f).unwrap();
    assert!(ro.is_read_only());
}

#[tokio::test]
async fn without_fallocate_the_outcomes_say_so() {
    let dir = tempfile::tempdir().unwrap();
    let Some(s) = open(&rw().fallocate(false), &dir.path().join("img")) else {
        return;
    };
    s.write_at(&[9; 8192], 0).await.unwrap();
    assert_eq!(
        s.write_zeroes(0, 4096).await.unwrap(),
        qimg_io::ZeroOutcome::Written
    );
    assert_eq!(
        s.discard(4096, 4096).await.unwrap(),
        qimg_io::DiscardOutcome::Ignored
    );
    assert_eq!(
        s.allocate(0, 1 << 20).await.unwrap(),
        qimg_io::AllocateOutcome::NotReserved
    );
    let mut b = [1u8; 8192];
    s.read_at(&mut b, 0).await.unwrap();
    assert!(b[..4096].iter().all(|&x| x == 0) && b[4096..].iter().all(|&x| x == 9));
    // The same through from_file.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.path().join("img"))
        .unwrap();
    let s = UringOptions::new()
        .fallocate(false)
        .fallback_for(Op::Discard)
        .from_file(f)
        .unwrap();
    assert_eq!(
        s.discard(0, 4096).await.unwrap(),
        qimg_io::DiscardOutcome::Ignored
    );
}

/// Random operations on a UringStorage and a MemStorage leave both alike.
#[tokio::test]
async fn random_operations_agree_with_memory() {
    let dir = tempfile::tempdir().unwrap();
    let Some(file) = open(&rw().entries(4), &dir.path().join("img")) else {
        return;
    };
    let mem = MemStorage::new();
    let mut rng = Rng(0x9e37_79b9);
    for step in 0..400 {
        let offset = rng.below(300_000);
        let max = if rng.below(4) == 0 { 70_000 } else { 5000 };
        let len = rng.below(max);
        let fill = rng.below(256) as u8;
        match rng.below(7) {
            0 | 1 => {
                let data = vec![fill; len as usize];
                file.write_at(&data, offset).await.unwrap();
                mem.write_at(&data, offset).await.unwrap();
            }
            2 => {
                let a = vec![fill; (len / 3) as usize];
                let b = vec![!fill; (len - len / 3) as usize];
                let iov = [IoSlice::new(&a), IoSlice::new(&[]), IoSlice::new(&b)];
                file.write_vectored_at(&iov, offset).await.unwrap();
                mem.write_vectored_at(&iov, offset).await.unwrap();
            }
            3 => {
                file.write_zeroes(offset, len).await.unwrap();
                mem.write_zeroes(offset, len).await.unwrap();
            }
            4 => {
                if file.discard(offset, len).await.unwrap() == qimg_io::DiscardOutcome::Deallocated
                {
                    mem.discard(offset, len).await.unwrap();
                }
            }
            5 => {
                if file.allocate(offset, len).await.unwrap() == qimg_io::AllocateOutcome::Reserved {
                    mem.allocate(offset, len).await.unwrap();
                }
            }
            _ => {
                file.set_len(offset).await.unwrap();
                mem.set_len(offset).await.unwrap();
            }
        }
        let flen = file.len().await.unwrap();
        assert_eq!(flen, mem.len().await.unwrap(), "length after step {step}");
        if step % 20 == 0 {
            let mut a = vec![0u8; flen as usize];
            file.read_at(&mut a, 0).await.unwrap();
            assert!(a == mem.snapshot(), "contents after step {step}");
        }
    }
}

/// A failed fsync poisons the ring's file for later flushes, as with `FileStorage`:
/// `/dev/null` refuses fsync with EINVAL.
#[tokio::test]
async fn a_failed_flush_makes_every_later_flush_fail() {
    let Some(s) = open(
        &UringOptions::new().read_write(true),
        Path::new("/dev/null"),
    ) else {
        return;
    };
    let first = s.flush().await.unwrap_err();
    assert_eq!(first.op(), Some(Op::Flush));
    assert_eq!(
        first.raw_os_error(),
        Some(nix::errno::Errno::EINVAL as i32),
        "{first}"
    );
    let e = s.flush().await.unwrap_err();
    let why = std::error::Error::source(&e).unwrap().to_string();
    assert!(
        why.contains("an earlier flush of this file failed"),
        "{why}"
    );
}

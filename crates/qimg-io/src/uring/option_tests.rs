//! The conformance suite and a concurrency and cancellation stress with
//! [`UringOptions::collect_inline_completions`] and [`UringOptions::complete_on_runtime`] on
//! (the integration tests in `tests/io/uring.rs` cover the defaults), and the completion thread
//! taking over when the runtime that waited for completions is gone.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use super::{UringOptions, UringStorage};
use crate::aligned::AlignedBuf;
use crate::conformance::run_all;
use crate::storage::Storage;

/// Inline collection, completion on the runtime, both.
const MODES: [(bool, bool); 3] = [(true, false), (false, true), (true, true)];

fn options(direct: bool, (inline, runtime): (bool, bool)) -> UringOptions {
    UringOptions::new()
        .read_write(true)
        .create_new(true)
        .direct(direct)
        .collect_inline_completions(inline)
        .complete_on_runtime(runtime)
}

/// A fresh file in `dir`, or `None` where io_uring or O_DIRECT is unavailable.
fn make(dir: &tempfile::TempDir, direct: bool, mode: (bool, bool)) -> Option<UringStorage> {
    static N: AtomicU32 = AtomicU32::new(0);
    let path = dir
        .path()
        .join(format!("i{}", N.fetch_add(1, Ordering::Relaxed)));
    match options(direct, mode).open(&path) {
        Ok(s) => Some(s),
        Err(e) => {
            println!("skipped (direct {direct}): {e}");
            None
        }
    }
}

async fn conformance() {
    let dir = tempfile::tempdir().unwrap();
    for mode in MODES {
        for direct in [false, true] {
            if make(&dir, direct, mode).is_none() {
                continue;
            }
            run_all(|| make(&dir, direct, mode).expect("opened once already")).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_with_options_multi_thread() {
    conformance().await;
}

#[tokio::test(flavor = "current_thread")]
async fn conformance_with_options_current_thread() {
    conformance().await;
}

async fn stress() {
    let dir = tempfile::tempdir().unwrap();
    for mode in MODES {
        for direct in [false, true] {
            let Some(s) = make(&dir, direct, mode) else {
                continue;
            };
            let s = Arc::new(s);
            let block = 4096usize;
            let tasks: Vec<_> = (0..48u64)
                .map(|t| {
                    let s = Arc::clone(&s);
                    tokio::spawn(async move {
                        let mut back = AlignedBuf::zeroed(block, 4096).unwrap();
                        for round in 0..50u64 {
                            let mut v = AlignedBuf::zeroed(block, 4096).unwrap();
                            v.fill((t * 7 + round) as u8);
                            let at = (t * 4 + round % 4) * block as u64;
                            s.write_at(&v, at).await.unwrap();
                            s.read_at(&mut back, at).await.unwrap();
                            assert!(*back == *v, "task {t} round {round} mode {mode:?}");
                            if round % 10 == 9 {
                                // Dropped after one poll: queued (possibly as the task
                                // that submits a batch), in flight, or collected.
                                let mut r = Box::pin(s.read_at(&mut back, at));
                                let w = Waker::noop();
                                let _ = r.as_mut().poll(&mut Context::from_waker(w));
                            }
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
            s.flush().await.unwrap();
            for _ in 0..2000 {
                if s.in_flight() == 0 {
                    break;
                }
                tokio::task::yield_now().await;
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(s.in_flight(), 0, "direct {direct} mode {mode:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_tasks_and_cancelled_requests_multi_thread() {
    stress().await;
}

#[tokio::test(flavor = "current_thread")]
async fn many_tasks_and_cancelled_requests_current_thread() {
    stress().await;
}

/// Opened on one runtime, which then goes away: the completion thread takes over, and
/// requests from another runtime (or none) complete.
#[test]
fn the_completion_thread_takes_over_from_a_dropped_runtime() {
    let dir = tempfile::tempdir().unwrap();
    let first = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let Some(s) = first.block_on(async { make(&dir, false, (false, true)) }) else {
        return;
    };
    assert!(s.shared().reaper.load(Ordering::Acquire));
    let data = vec![7u8; 10000];
    first.block_on(s.write_at(&data, 0)).unwrap();
    drop(first);
    assert!(!s.shared().reaper.load(Ordering::Acquire));
    let second = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let s = Arc::new(s);
    let s2 = Arc::clone(&s);
    second
        .block_on(async move {
            tokio::spawn(async move {
                let mut back = vec![0u8; 10000];
                s2.read_at(&mut back, 0).await.unwrap();
                assert!(back.iter().all(|&b| b == 7));
                s2.write_at(&[1u8; 4096], 4096).await.unwrap();
                s2.flush().await.unwrap();
            })
            .await
        })
        .unwrap();
    // And with no runtime at all.
    let mut back = vec![0u8; 4096];
    let waker = std::task::Waker::noop();
    let mut cx = Context::from_waker(waker);
    let mut f = Box::pin(s.read_at(&mut back, 4096));
    let r = loop {
        if let Poll::Ready(r) = f.as_mut().poll(&mut cx) {
            break r;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    drop(f);
    r.unwrap();
    assert!(back.iter().all(|&b| b == 1));
}

/// Bounce buffers start on a page whatever the device's own memory alignment (file systems
/// serialise direct writes whose memory is not aligned to their block size).
#[test]
fn bounce_buffers_start_on_a_page() {
    let dir = tempfile::tempdir().unwrap();
    let Some(s) = make(&dir, true, (false, false)) else {
        return;
    };
    for len in [512u64, 4096, 65536] {
        let b = s.bounce(crate::Op::Write, 0, len).unwrap();
        assert_eq!(b.as_ptr() as usize % crate::aligned::BUFFER_ALIGNMENT, 0);
    }
}

/// Bounce buffers are reused: a write of zeros through a buffer another request left behind
/// still writes zeros, and reads see only what the kernel read.
#[tokio::test(flavor = "current_thread")]
async fn reused_bounce_buffers_never_leak_stale_bytes() {
    let dir = tempfile::tempdir().unwrap();
    for direct in [false, true] {
        let Some(s) = make(&dir, direct, (true, false)) else {
            continue;
        };
        let data = AlignedBuf::copy_from(&[0xab; 8192], 4096).unwrap();
        s.write_at(&data, 0).await.unwrap();
        assert_eq!(
            s.shared().spare.lock().unwrap().len(),
            1,
            "the buffer was kept"
        );
        // Zeros by writing (as where FALLOC_FL_ZERO_RANGE is refused), through that buffer.
        s.shared().zero_range.store(false, Ordering::Relaxed);
        s.write_zeroes(0, 8192).await.unwrap();
        let mut back = AlignedBuf::zeroed(8192, 4096).unwrap();
        s.read_at(&mut back, 0).await.unwrap();
        assert!(back.iter().all(|&b| b == 0), "stale bytes written as zeros");
        let other = AlignedBuf::copy_from(&[0x5c; 8192], 4096).unwrap();
        s.write_at(&other, 0).await.unwrap();
        s.read_at(&mut back, 0).await.unwrap();
        assert!(back.iter().all(|&b| b == 0x5c));
        assert_eq!(
            s.shared().spare.lock().unwrap().len(),
            1,
            "one buffer, reused"
        );
    }
}

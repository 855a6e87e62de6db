//! BounceStorage: the conformance suite (with odd offsets and lengths) over O_DIRECT backends
//! and alignment-enforcing memory, and many concurrent unaligned writes into the same blocks
//! checked against a model.
//!
//! Where the file system refuses O_DIRECT (or io_uring is unavailable) the affected test prints
//! "skipped: ..." and passes.

use qimg_testkit::Rng;
use std::io::IoSlice;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use qimg_io::conformance::run_all;
use qimg_io::{BounceStorage, FileOptions, FileStorage, MemStorage, Storage, StorageError};

/// A fresh O_DIRECT file in `dir`, or `None` (with the reason printed) if O_DIRECT is refused.
fn direct_file(dir: &Path) -> Option<FileStorage> {
    static N: AtomicU32 = AtomicU32::new(0);
    let path = dir.join(format!("f{}", N.fetch_add(1, Ordering::Relaxed)));
    match FileOptions::new()
        .read_write(true)
        .create_new(true)
        .direct(true)
        .open(&path)
    {
        Ok(s) => {
            assert!(s.request_alignment() > 1, "O_DIRECT requires alignment");
            Some(s)
        }
        Err(e) => {
            println!("skipped: O_DIRECT unsupported: {e}");
            None
        }
    }
}

#[cfg(target_os = "linux")]
fn direct_uring(dir: &Path) -> Option<qimg_io::UringStorage> {
    static N: AtomicU32 = AtomicU32::new(0);
    let path = dir.join(format!("u{}", N.fetch_add(1, Ordering::Relaxed)));
    match qimg_io::UringOptions::new()
        .read_write(true)
        .create_new(true)
        .direct(true)
        .open(&path)
    {
        Ok(s) => Some(s),
        Err(e @ StorageError::UringUnavailable { .. }) => {
            println!("skipped: io_uring unavailable: {e}");
            None
        }
        Err(e) => {
            println!("skipped: O_DIRECT unsupported: {e}");
            None
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn conformance_over_aligned_memory() {
    run_all(|| BounceStorage::new(MemStorage::new().with_alignment(4096, 4096))).await;
    run_all(|| BounceStorage::new(MemStorage::new().with_alignment(512, 512))).await;
    run_all(|| BounceStorage::new(MemStorage::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn conformance_over_direct_file() {
    let dir = tempfile::tempdir().unwrap();
    if direct_file(dir.path()).is_none() {
        return;
    }
    run_all(|| BounceStorage::new(direct_file(dir.path()).unwrap())).await;
}

#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn conformance_over_direct_uring() {
    let dir = tempfile::tempdir().unwrap();
    match direct_uring(dir.path()) {
        Some(u) => assert!(u.request_alignment() > 1),
        None => return,
    }
    run_all(|| BounceStorage::new(direct_uring(dir.path()).unwrap())).await;
}

const TASKS: u64 = 32;
/// Each task owns every TASKS-th chunk of this many bytes, so all tasks share every block.
const CHUNK: u64 = 37;
const AREA: u64 = 4 * 4096;

/// 32 tasks write and zero random pieces of the chunks they own in four 4 KiB blocks, all at
/// once, starting from an empty file (so the end of the file moves under them too). Each task
/// keeps a model of its own bytes; afterwards the storage must equal the merged model and be
/// exactly as long as the furthest byte written.
async fn concurrent_unaligned_writes<S: Storage + 'static>(s: Arc<BounceStorage<S>>, seed: u64) {
    let mut handles = Vec::new();
    for t in 0..TASKS {
        let s = Arc::clone(&s);
        handles.push(tokio::spawn(async move {
            let mut rng = Rng(seed ^ (t + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let chunks: Vec<u64> = (0..AREA / CHUNK)
                .filter(|c| c % TASKS == t)
                .map(|c| c * CHUNK)
                .collect();
            let mut model = vec![None::<u8>; AREA as usize];
            for round in 0..60u64 {
                let start = chunks[rng.below(chunks.len() as u64) as usize];
                let off = start + rng.below(CHUNK);
                let len = 1 + rng.below(start + CHUNK - off);
                match rng.below(4) {
                    0 => {
                        s.write_zeroes(off, len).await.expect("write_zeroes");
                        for b in &mut model[off as usize..(off + len) as usize] {
                            *b = Some(0);
                        }
                    }
                    1 if len > 1 => {
                        // A vectored write split in two.
                        let data: Vec<u8> =
                            (0..len).map(|i| (t * 7 + round + i) as u8 | 1).collect();
                        let (x, y) = data.split_at(len as usize / 2);
                        s.write_vectored_at(&[IoSlice::new(x), IoSlice::new(y)], off)
                            .await
                            .expect("vectored write");
                        for (i, b) in data.iter().enumerate() {
                            model[off as usize + i] = Some(*b);
                        }
                    }
                    _ => {
                        let data: Vec<u8> =
                            (0..len).map(|i| (t * 13 + round + i) as u8 | 1).collect();
                        s.write_at(&data, off).await.expect("write");
                        for (i, b) in data.iter().enumerate() {
                            model[off as usize + i] = Some(*b);
                        }
                    }
                }
                if rng.below(8) == 0 {
                    // Reads of own bytes see the latest writes, while others write around.
                    let mut back = vec![0u8; len as usize];
                    s.read_at(&mut back, off).await.expect("read back");
                    let want: Vec<u8> = model[off as usize..(off + len) as usize]
                        .iter()
                        .map(|b| b.unwrap())
                        .collect();
                    assert_eq!(back, want, "task {t} round {round}: read back at {off}");
                }
            }
            model
        }));
    }
    let mut model = vec![None::<u8>; AREA as usize];
    for h in handles {
        let m = h.await.expect("writer task");
        for (i, b) in m.into_iter().enumerate() {
            if b.is_some() {
                assert!(model[i].is_none(), "byte {i} owned by two tasks");
                model[i] = b;
            }
        }
    }
    let end = model.iter().rposition(Option::is_some).unwrap() as u64 + 1;
    assert_eq!(
        s.len().await.unwrap(),
        end,
        "length is the furthest byte written"
    );
    let mut back = vec![0u8; end as usize];
    s.read_at(&mut back, 0).await.unwrap();
    let expect: Vec<u8> = model[..end as usize]
        .iter()
        .map(|b| b.unwrap_or(0))
        .collect();
    if let Some(i) = back.iter().zip(&expect).position(|(a, e)| a != e) {
        panic!(
            "byte {i} is {:#04x}, expected {:#04x} ({} bytes differ)",
            back[i],
            expect[i],
            back.iter().zip(&expect).filter(|(a, e)| a != e).count()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_unaligned_writes_over_aligned_memory() {
    for seed in 1..=4 {
        let s = BounceStorage::new(MemStorage::new().with_alignment(4096, 4096));
        concurrent_unaligned_writes(Arc::new(s), seed).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_unaligned_writes_over_direct_file() {
    let dir = tempfile::tempdir().unwrap();
    for seed in 1..=3 {
        let Some(f) = direct_file(dir.path()) else {
            return;
        };
        concurrent_unaligned_writes(Arc::new(BounceStorage::new(f)), seed).await;
    }
}

#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_unaligned_writes_over_direct_uring() {
    let dir = tempfile::tempdir().unwrap();
    for seed in 1..=3 {
        let Some(u) = direct_uring(dir.path()) else {
            return;
        };
        concurrent_unaligned_writes(Arc::new(BounceStorage::new(u)), seed).await;
    }
}

/// Aligned requests with aligned buffers reach the inner storage unchanged: an O_DIRECT file
/// sees them, and the result is the same as through the wrapper.
#[tokio::test]
async fn aligned_requests_pass_through_and_report_no_alignment() {
    let dir = tempfile::tempdir().unwrap();
    let Some(f) = direct_file(dir.path()) else {
        return;
    };
    let req = f.request_alignment();
    let s = BounceStorage::new(f);
    assert_eq!((s.request_alignment(), s.mem_alignment()), (1, 1));
    let data = qimg_io::AlignedBuf::copy_from(&vec![0x5a; 2 * req], req).unwrap();
    s.write_at(&data, req as u64).await.unwrap();
    let mut back = qimg_io::AlignedBuf::zeroed(2 * req, req).unwrap();
    s.inner().read_at(&mut back, req as u64).await.unwrap();
    assert_eq!(&*back, &*data);
    s.set_len(3 * req as u64 + 5).await.unwrap();
    assert_eq!(s.len().await.unwrap(), 3 * req as u64 + 5);
    let mut tail = [0u8; 9];
    s.read_at_zero_fill(&mut tail, 3 * req as u64 - 2)
        .await
        .unwrap();
    assert_eq!(tail, [0x5a, 0x5a, 0, 0, 0, 0, 0, 0, 0]);
    let e = s.read_at(&mut tail, 3 * req as u64 - 2).await.unwrap_err();
    assert!(matches!(e, StorageError::UnexpectedEof { .. }), "{e:?}");
}

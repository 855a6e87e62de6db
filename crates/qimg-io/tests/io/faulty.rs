//! FaultyStorage: operation counting, each fault mode, and power-loss images.

use qimg_testkit::Rng;
use std::future::Future;
use std::io::IoSlice;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use qimg_io::{
    AllocateOutcome, CrashPolicy, DiscardOutcome, FaultAction, FaultPlan, FaultyStorage,
    FileOptions, MemStorage, Op, OpCounts, OpFilter, Storage, StorageError, ZeroOutcome,
};

const EIO: i32 = 5;
const ENOSPC: i32 = 28;

fn assert_errno(r: Result<impl std::fmt::Debug, StorageError>, op: Op, errno: i32) {
    match r {
        Err(e) => {
            assert_eq!(e.op(), Some(op), "{e}");
            assert_eq!(e.raw_os_error(), Some(errno), "{e}");
        }
        Ok(v) => panic!("{op}: expected errno {errno}, got Ok({v:?})"),
    }
}

fn is_power_loss(e: &StorageError) -> bool {
    let chain = std::error::Error::source(e).map(|s| s.to_string());
    chain.is_some_and(|s| s.contains("simulated power loss"))
}

async fn read(s: &impl Storage, offset: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    s.read_at(&mut b, offset).await.unwrap();
    b
}

#[tokio::test]
async fn every_operation_but_len_is_counted() {
    let s = FaultyStorage::in_memory(b"");
    let ctl = s.controller();
    s.write_at(b"abc", 0).await.unwrap();
    s.write_vectored_at(&[IoSlice::new(b"d"), IoSlice::new(b"e")], 3)
        .await
        .unwrap();
    s.read_at(&mut [0; 2], 0).await.unwrap();
    s.read_at_zero_fill(&mut [0; 20], 0).await.unwrap();
    s.write_zeroes(0, 1).await.unwrap();
    s.discard(0, 1).await.unwrap();
    s.allocate(0, 100).await.unwrap();
    s.flush().await.unwrap();
    s.set_len(10).await.unwrap();
    s.len().await.unwrap();
    s.is_empty().await.unwrap();
    // Refused before reaching the storage: not counted.
    s.write_at(b"x", u64::MAX).await.unwrap_err();
    assert_eq!(
        ctl.counts(),
        OpCounts {
            reads: 2,
            writes: 2,
            write_zeroes: 1,
            discards: 1,
            allocates: 1,
            flushes: 1,
            set_lens: 1,
        }
    );
    assert_eq!(ctl.counts().total(), 9);
    assert_eq!(ctl.injected(), 0);
}

#[tokio::test]
async fn the_nth_operation_fails_once_with_eio_and_changes_nothing() {
    let s = FaultyStorage::in_memory(b"0123456789");
    let ctl = s.controller();
    ctl.arm(FaultPlan::new(OpFilter::All, FaultAction::Eio).after(2));
    assert_eq!(ctl.armed(), 1);
    s.write_at(b"a", 0).await.unwrap();
    s.flush().await.unwrap();
    let e = s.write_at(b"zz", 0x1234).await.unwrap_err();
    assert_eq!(e.raw_os_error(), Some(EIO));
    let msg = e.to_string();
    assert!(
        msg.contains("write") && msg.contains("0x1234") && msg.contains("2 bytes"),
        "{msg}"
    );
    assert_eq!(ctl.armed(), 0, "a used-up plan is dropped");
    assert_eq!(ctl.injected(), 1);
    // Later operations succeed, and the failed write left no trace.
    s.write_at(b"b", 1).await.unwrap();
    assert_eq!(s.len().await.unwrap(), 10);
    assert_eq!(read(&s, 0, 10).await, b"ab23456789");
    assert_eq!(
        ctl.power_cut(CrashPolicy::KeepAll).snapshot(),
        b"ab23456789"
    );
}

#[tokio::test]
async fn forever_plans_fail_every_matching_operation_from_n_on() {
    let s = FaultyStorage::in_memory(b"");
    let ctl = s.controller();
    ctl.arm(
        FaultPlan::new(OpFilter::Writes, FaultAction::NoSpace)
            .after(1)
            .forever(),
    );
    s.write_at(b"first", 0).await.unwrap();
    for i in 0..5 {
        assert_errno(s.write_at(b"more", 100 * i).await, Op::Write, ENOSPC);
        assert_errno(
            s.write_vectored_at(&[IoSlice::new(b"v")], 7).await,
            Op::Write,
            ENOSPC,
        );
        // Other operations are not writes and pass.
        s.flush().await.unwrap();
        assert_eq!(read(&s, 0, 5).await, b"first");
        s.allocate(0, 5).await.unwrap();
        // Even an empty write is a write.
        assert_errno(s.write_at(&[], 0).await, Op::Write, ENOSPC);
    }
    assert_eq!(s.len().await.unwrap(), 5);
    assert_eq!(ctl.armed(), 1, "forever plans stay armed");
    ctl.disarm_all();
    s.write_at(b"ok", 0).await.unwrap();
}

#[tokio::test]
async fn filters_pick_operation_kinds() {
    let s = FaultyStorage::in_memory(&[1; 4096]);
    let ctl = s.controller();
    ctl.arm(FaultPlan::new(OpFilter::Reads, FaultAction::Eio).times(2));
    ctl.arm(FaultPlan::new(
        OpFilter::Only(Op::Discard),
        FaultAction::NoSpace,
    ));
    ctl.arm(FaultPlan::new(OpFilter::Modifications, FaultAction::Eio).after(3));
    s.write_at(b"x", 0).await.unwrap(); // modification 1
    assert_errno(s.read_at(&mut [0; 4], 0).await, Op::Read, EIO);
    assert_errno(s.read_at_zero_fill(&mut [0; 4], 0).await, Op::Read, EIO);
    assert_eq!(read(&s, 0, 1).await, b"x", "only two reads fail");
    assert_errno(s.discard(0, 512).await, Op::Discard, ENOSPC); // modification 2
    s.allocate(0, 8192).await.unwrap(); // modification 3
    assert_errno(s.set_len(0).await, Op::SetLen, EIO); // modification 4
    assert_eq!(s.len().await.unwrap(), 8192);
    assert_eq!(ctl.injected(), 4);
    assert_eq!(ctl.armed(), 0);
}

#[tokio::test]
async fn a_failed_flush_makes_nothing_durable_and_the_next_one_does() {
    let s = FaultyStorage::in_memory(b"");
    let ctl = s.controller();
    s.write_at(b"data", 0).await.unwrap();
    assert_eq!((ctl.unflushed(), ctl.unflushed_bytes()), (1, 4));
    ctl.arm(FaultPlan::new(OpFilter::Flushes, FaultAction::Eio));
    assert_errno(s.flush().await, Op::Flush, EIO);
    assert_eq!(ctl.unflushed(), 1);
    assert_eq!(ctl.flushed_image().snapshot(), b"");
    s.flush().await.unwrap();
    assert_eq!((ctl.unflushed(), ctl.unflushed_bytes()), (0, 0));
    assert_eq!(ctl.flushed_image().snapshot(), b"data");
    assert!(!ctl.is_crashed(), "flushed_image does not crash");
}

#[tokio::test]
async fn torn_writes_land_a_prefix_then_fail() {
    let s = FaultyStorage::in_memory(&[b'.'; 12]);
    let ctl = s.controller();
    ctl.arm(FaultPlan::new(OpFilter::Writes, FaultAction::TornWrite { keep: 4 }).times(2));
    assert_errno(s.write_at(b"abcdefgh", 0).await, Op::Write, EIO);
    assert_eq!(read(&s, 0, 12).await, b"abcd........");
    // Vectored: the prefix crosses segments.
    let segs = [IoSlice::new(b"XY"), IoSlice::new(b""), IoSlice::new(b"ZWV")];
    assert_errno(s.write_vectored_at(&segs, 7).await, Op::Write, EIO);
    assert_eq!(read(&s, 0, 12).await, b"abcd...XYZW.");
    // write_zeroes tears too.
    ctl.arm(FaultPlan::new(
        OpFilter::All,
        FaultAction::TornWrite { keep: 2 },
    ));
    assert_errno(s.write_zeroes(1, 5).await, Op::WriteZeroes, EIO);
    assert_eq!(read(&s, 0, 12).await, b"a\0\0d...XYZW.");
    // A keep longer than the request: everything lands, and the error still comes.
    ctl.arm(FaultPlan::new(
        OpFilter::All,
        FaultAction::TornWrite { keep: 100 },
    ));
    assert_errno(s.write_at(b"!", 11).await, Op::Write, EIO);
    assert_eq!(read(&s, 11, 1).await, b"!");
    // On anything else a torn write is a plain EIO.
    ctl.arm(FaultPlan::new(
        OpFilter::Flushes,
        FaultAction::TornWrite { keep: 1 },
    ));
    assert_errno(s.flush().await, Op::Flush, EIO);
    // The prefixes are unflushed modifications.
    assert_eq!(ctl.unflushed(), 4);
    assert_eq!(
        ctl.power_cut(CrashPolicy::KeepAll).snapshot(),
        b"a\0\0d...XYZW!"
    );
}

#[tokio::test]
async fn torn_writes_respect_the_request_alignment() {
    let inner = MemStorage::new().with_alignment(512, 512);
    let s = FaultyStorage::with_baseline(inner, &MemStorage::new());
    let ctl = s.controller();
    let data = qimg_io::AlignedBuf::copy_from(&[7; 2048], 512).unwrap();
    ctl.arm(FaultPlan::new(
        OpFilter::Writes,
        FaultAction::TornWrite { keep: 1500 },
    ));
    assert_errno(s.write_at(&data, 0).await, Op::Write, EIO);
    assert_eq!(s.len().await.unwrap(), 1024, "1500 rounds down to 1024");
    ctl.arm(FaultPlan::new(
        OpFilter::Writes,
        FaultAction::TornWrite { keep: 100 },
    ));
    assert_errno(s.write_at(&data, 0).await, Op::Write, EIO);
    assert_eq!(ctl.unflushed(), 1, "nothing landed: nothing journalled");
    // Misaligned requests are refused before they are counted.
    let before = ctl.counts();
    assert!(matches!(
        s.write_at(&data[..100], 0).await,
        Err(StorageError::Misaligned { .. })
    ));
    assert_eq!(ctl.counts(), before);
}

#[tokio::test]
async fn a_power_cut_keeps_only_flushed_state_and_stops_everything() {
    let s = FaultyStorage::in_memory(b"");
    let ctl = s.controller();
    s.write_at(&[1; 1000], 0).await.unwrap();
    s.write_zeroes(100, 100).await.unwrap();
    s.flush().await.unwrap();
    s.write_at(&[2; 1000], 500).await.unwrap();
    s.set_len(300).await.unwrap();
    s.discard(0, 50).await.unwrap();
    let disk = ctl.power_cut(CrashPolicy::DropUnflushed);
    let mut expect = vec![1u8; 1000];
    expect[100..200].fill(0);
    assert_eq!(disk.snapshot(), expect);
    assert!(ctl.is_crashed());
    let before = ctl.counts();
    let mut b = [0u8; 4];
    let results = [
        s.read_at(&mut b, 0).await.unwrap_err(),
        s.write_at(b"x", 0).await.unwrap_err(),
        s.write_vectored_at(&[], 0).await.unwrap_err(),
        s.write_zeroes(0, 1).await.unwrap_err(),
        s.discard(0, 1).await.unwrap_err(),
        s.allocate(0, 1).await.unwrap_err(),
        s.flush().await.unwrap_err(),
        s.set_len(0).await.unwrap_err(),
        s.len().await.unwrap_err(),
    ];
    for e in &results {
        assert!(is_power_loss(e), "{e:?}");
    }
    assert_eq!(ctl.counts(), before, "nothing reaches the storage any more");
    // The image is independent of the (dead) storage and writable.
    disk.write_at(b"reopened", 0).await.unwrap();
    assert_eq!(
        ctl.power_cut(CrashPolicy::DropUnflushed).snapshot(),
        expect,
        "the same crash gives the same flushed state again"
    );
}

#[tokio::test]
async fn keep_all_and_keep_first_apply_unflushed_changes_in_order() {
    let s = FaultyStorage::in_memory(b"");
    let ctl = s.controller();
    s.write_at(b"aaaa", 0).await.unwrap();
    s.flush().await.unwrap();
    s.write_at(b"bb", 0).await.unwrap(); // 1
    s.write_at(b"c", 1).await.unwrap(); // 2
    s.allocate(0, 6).await.unwrap(); // 3
    s.write_zeroes(3, 1).await.unwrap(); // 4
    s.set_len(5).await.unwrap(); // 5
    s.discard(0, 1).await.unwrap(); // 6
    assert_eq!(ctl.unflushed(), 6);
    let live = read(&s, 0, 5).await;
    assert_eq!(live, b"\0ca\0\0");
    let img = |n| ctl.power_cut(CrashPolicy::KeepFirst(n)).snapshot();
    assert_eq!(img(0), b"aaaa");
    assert_eq!(img(1), b"bbaa");
    assert_eq!(img(2), b"bcaa");
    assert_eq!(img(3), b"bcaa\0\0");
    assert_eq!(img(4), b"bca\0\0\0");
    assert_eq!(img(5), b"bca\0\0");
    assert_eq!(img(6), live);
    assert_eq!(img(100), live);
    assert_eq!(ctl.power_cut(CrashPolicy::KeepAll).snapshot(), live);
}

/// After every successful flush the durable image equals the live storage, and a KeepAll
/// crash at any point equals it too: the journal replays every kind of modification the way
/// the storage applied it.
#[tokio::test]
async fn the_durable_model_tracks_every_kind_of_modification() {
    for seed in 1..=8u64 {
        let s = FaultyStorage::in_memory(b"");
        let ctl = s.controller();
        let mut rng = Rng(seed);
        for _ in 0..300 {
            let offset = rng.below(200_000);
            let max = if rng.below(5) == 0 { 150_000 } else { 3000 };
            let len = rng.below(max);
            let fill = rng.below(255) as u8 + 1;
            match rng.below(8) {
                0 | 1 => s.write_at(&vec![fill; len as usize], offset).await.unwrap(),
                2 => {
                    let a = vec![fill; (len / 2) as usize];
                    let b = vec![!fill; (len - len / 2) as usize];
                    s.write_vectored_at(&[IoSlice::new(&a), IoSlice::new(&b)], offset)
                        .await
                        .unwrap();
                }
                3 => assert_eq!(
                    s.write_zeroes(offset, len).await.unwrap(),
                    ZeroOutcome::Efficient
                ),
                4 => assert_eq!(
                    s.discard(offset, len).await.unwrap(),
                    DiscardOutcome::Deallocated
                ),
                5 => assert_eq!(
                    s.allocate(offset, len).await.unwrap(),
                    AllocateOutcome::Reserved
                ),
                6 => s.set_len(offset).await.unwrap(),
                _ => {
                    s.flush().await.unwrap();
                    assert_eq!(ctl.unflushed(), 0);
                    assert_eq!(
                        ctl.flushed_image().snapshot(),
                        s.inner().snapshot(),
                        "seed {seed}"
                    );
                }
            }
        }
        assert_eq!(
            ctl.power_cut(CrashPolicy::KeepAll).snapshot(),
            s.inner().snapshot(),
            "seed {seed}"
        );
    }
}

/// Random crashes: each 512-byte sector of the image holds the flushed data or the data of
/// one unflushed write covering it; equal seeds give equal images; across seeds a write is
/// seen dropped, kept and torn.
#[tokio::test]
async fn random_crashes_are_seeded_subsets_torn_at_sectors() {
    const SECTORS: usize = 16;
    let s = FaultyStorage::in_memory(&[0xff; SECTORS * 512]);
    let ctl = s.controller();
    // Write A: sectors 0..8 with 1; write B: sectors 4..12 with 2 (overlaps A on 4..8);
    // write C: sectors 12..16 with 3.
    s.write_at(&[1; 8 * 512], 0).await.unwrap();
    s.write_at(&[2; 8 * 512], 4 * 512).await.unwrap();
    s.write_at(&[3; 4 * 512], 12 * 512).await.unwrap();
    let mut seen_dropped = false;
    let mut seen_whole = false;
    let mut seen_torn = false;
    for seed in 0..200 {
        let img = ctl.power_cut(CrashPolicy::Random { seed }).snapshot();
        assert_eq!(img.len(), SECTORS * 512);
        assert_eq!(
            img,
            ctl.power_cut(CrashPolicy::Random { seed }).snapshot(),
            "seed {seed} is deterministic"
        );
        let sectors: Vec<u8> = img
            .chunks(512)
            .map(|c| {
                assert!(
                    c.iter().all(|&x| x == c[0]),
                    "seed {seed}: torn inside a sector"
                );
                c[0]
            })
            .collect();
        for (i, &v) in sectors.iter().enumerate() {
            let allowed: &[u8] = match i {
                0..4 => &[0xff, 1],
                4..8 => &[0xff, 1, 2],
                8..12 => &[0xff, 2],
                _ => &[0xff, 3],
            };
            assert!(allowed.contains(&v), "seed {seed}: sector {i} is {v}");
        }
        let c = &sectors[12..16];
        let c_kept = c.iter().filter(|&&v| v == 3).count();
        seen_dropped |= c_kept == 0;
        seen_whole |= c_kept == 4;
        seen_torn |= c_kept > 0 && c_kept < 4;
    }
    assert!(seen_dropped && seen_whole && seen_torn);
    assert_ne!(
        ctl.power_cut(CrashPolicy::Random { seed: 1 }).snapshot(),
        ctl.power_cut(CrashPolicy::Random { seed: 2 }).snapshot(),
        "different seeds usually differ"
    );
}

/// Random crashes apply what they keep in a shuffled order: an older write can land over a
/// newer `write_zeroes` whose effect is visible elsewhere (zeroing is never torn), which no
/// in-order subset could produce. Other seeds keep the order.
#[tokio::test]
async fn random_crashes_reorder_unflushed_modifications() {
    let s = FaultyStorage::in_memory(&[0xff; 1024]);
    let ctl = s.controller();
    s.write_at(&[1; 512], 0).await.unwrap();
    s.write_zeroes(0, 1024).await.unwrap();
    let (mut reordered, mut in_order) = (false, false);
    for seed in 0..200 {
        let img = ctl.power_cut(CrashPolicy::Random { seed }).snapshot();
        let (first, second) = (img[0], img[512]);
        reordered |= first == 1 && second == 0;
        in_order |= first == 0 && second == 0;
        assert!(
            matches!((first, second), (0xff | 1, 0xff) | (0 | 1, 0)),
            "seed {seed}"
        );
    }
    assert!(reordered && in_order);
}

#[tokio::test]
async fn a_crash_plan_stops_the_workload_after_n_operations() {
    for n in 0..12u64 {
        let s = FaultyStorage::in_memory(b"");
        let ctl = s.controller();
        ctl.arm(FaultPlan::crash_after(n));
        let mut done = 0u64;
        let r: Result<(), StorageError> = async {
            for i in 0..6u64 {
                s.write_at(&[i as u8 + 1; 512], i * 512).await?;
                done += 1;
                s.flush().await?;
                done += 1;
            }
            Ok(())
        }
        .await;
        assert_eq!(done, n, "exactly n operations succeed");
        let e = r.unwrap_err();
        assert!(is_power_loss(&e), "{e}");
        assert!(ctl.is_crashed());
        assert_eq!(ctl.counts().total(), n + 1, "the crashing one is counted");
        // Every completed write was flushed, so every policy gives the same image.
        let expect: Vec<u8> = (0..n.div_ceil(2))
            .flat_map(|i| [i as u8 + 1; 512])
            .collect();
        let drop = ctl.power_cut(CrashPolicy::DropUnflushed).snapshot();
        let writes_flushed = n / 2;
        assert_eq!(drop, expect[..writes_flushed as usize * 512]);
        assert_eq!(ctl.power_cut(CrashPolicy::KeepAll).snapshot(), expect);
    }
}

#[tokio::test]
async fn new_copies_the_wrapped_storage_as_the_durable_state() {
    let mem = MemStorage::new();
    mem.write_at(&[5; 3000], 10).await.unwrap();
    mem.write_at(&[6; 100], 3 << 20).await.unwrap();
    mem.set_len(5 << 20).await.unwrap();
    let s = FaultyStorage::new(mem.clone()).await.unwrap();
    let ctl = s.controller();
    s.write_at(b"unflushed", 0).await.unwrap();
    let disk = ctl.power_cut(CrashPolicy::DropUnflushed);
    assert_eq!(disk.len().await.unwrap(), 5 << 20);
    let head = disk.snapshot_range(0, 4000);
    assert!(
        head[..10].iter().all(|&b| b == 0),
        "the unflushed write is lost"
    );
    assert!(head[10..3010].iter().all(|&b| b == 5));
    assert!(head[3010..].iter().all(|&b| b == 0));
    let tail = disk.snapshot_range(3 << 20, 101);
    assert!(tail[..100].iter().all(|&b| b == 6) && tail[100] == 0);
    assert!(
        disk.allocated_bytes() <= 4 * 65536,
        "zero ranges stay sparse"
    );

    // And over a file, with O_DIRECT where the file system has it.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("img");
    std::fs::write(&path, [9u8; 10_000]).unwrap();
    for direct in [false, true] {
        let file = match FileOptions::new()
            .read_write(true)
            .direct(direct)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) => {
                println!("skipping O_DIRECT: {e}");
                continue;
            }
        };
        let s = FaultyStorage::new(file).await.unwrap();
        let img = s.controller().flushed_image().snapshot();
        assert!(
            img.len() == 10_000 && img.iter().all(|&b| b == 9),
            "direct: {direct}"
        );
    }
}

/// A storage whose every operation yields once before reaching a MemStorage, to have
/// operations in flight.
struct Slow(MemStorage);

struct YieldOnce(bool);
impl Future for YieldOnce {
    type Output = ();
    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            return Poll::Ready(());
        }
        self.0 = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

impl Storage for Slow {
    async fn read_at_most(&self, buf: &mut [u8], offset: u64) -> qimg_io::Result<usize> {
        YieldOnce(false).await;
        self.0.read_at_most(buf, offset).await
    }
    async fn write_at(&self, buf: &[u8], offset: u64) -> qimg_io::Result<()> {
        YieldOnce(false).await;
        self.0.write_at(buf, offset).await
    }
    async fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> qimg_io::Result<()> {
        YieldOnce(false).await;
        self.0.write_vectored_at(bufs, offset).await
    }
    async fn write_zeroes(&self, offset: u64, len: u64) -> qimg_io::Result<ZeroOutcome> {
        YieldOnce(false).await;
        self.0.write_zeroes(offset, len).await
    }
    async fn discard(&self, offset: u64, len: u64) -> qimg_io::Result<DiscardOutcome> {
        YieldOnce(false).await;
        self.0.discard(offset, len).await
    }
    async fn allocate(&self, offset: u64, len: u64) -> qimg_io::Result<AllocateOutcome> {
        YieldOnce(false).await;
        self.0.allocate(offset, len).await
    }
    async fn flush(&self) -> qimg_io::Result<()> {
        YieldOnce(false).await;
        self.0.flush().await
    }
    async fn len(&self) -> qimg_io::Result<u64> {
        self.0.len().await
    }
    async fn set_len(&self, len: u64) -> qimg_io::Result<()> {
        YieldOnce(false).await;
        self.0.set_len(len).await
    }
}

fn poll_once<F: Future>(f: std::pin::Pin<&mut F>) -> Poll<F::Output> {
    f.poll(&mut Context::from_waker(Waker::noop()))
}

#[test]
fn writes_completing_during_a_flush_stay_unflushed() {
    let s = FaultyStorage::with_baseline(Slow(MemStorage::new()), &MemStorage::new());
    let ctl = s.controller();
    let mut flush = pin!(s.flush());
    assert!(poll_once(flush.as_mut()).is_pending());
    let mut write = pin!(s.write_at(b"late", 0));
    assert!(poll_once(write.as_mut()).is_pending());
    assert!(matches!(poll_once(write.as_mut()), Poll::Ready(Ok(()))));
    assert!(matches!(poll_once(flush.as_mut()), Poll::Ready(Ok(()))));
    assert_eq!(ctl.unflushed(), 1, "the write was not covered by the flush");
    assert_eq!(ctl.flushed_image().snapshot(), b"");
}

#[test]
fn operations_in_flight_at_a_crash_fail_but_may_have_landed() {
    let s = FaultyStorage::with_baseline(Slow(MemStorage::new()), &MemStorage::new());
    let ctl = s.controller();
    let mut write = pin!(s.write_at(b"in flight", 0));
    assert!(poll_once(write.as_mut()).is_pending());
    let mut flush = pin!(s.flush());
    assert!(poll_once(flush.as_mut()).is_pending());
    ctl.crash();
    match poll_once(write.as_mut()) {
        Poll::Ready(Err(e)) => assert!(is_power_loss(&e), "{e}"),
        other => panic!("expected a power-loss error, got {other:?}"),
    }
    match poll_once(flush.as_mut()) {
        Poll::Ready(Err(e)) => assert!(is_power_loss(&e), "{e}"),
        other => panic!("expected a power-loss error, got {other:?}"),
    }
    assert_eq!(ctl.power_cut(CrashPolicy::DropUnflushed).snapshot(), b"");
    assert_eq!(ctl.power_cut(CrashPolicy::KeepAll).snapshot(), b"in flight");
}

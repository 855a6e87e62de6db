//! The conformance suite every [`Storage`] backend must pass.
//!
//! [`run_all`] runs every case, each on a fresh, empty storage from the factory it is given.
//! Failures panic with a message naming the case, as test assertions do. Cases adapt to the
//! backend's alignment: with `request_alignment` 1 they also exercise odd offsets and lengths;
//! otherwise every request is aligned, and misaligned requests are checked to fail with
//! [`StorageError::Misaligned`].
//!
//! Must run inside a tokio runtime (the concurrency case spawns tasks); a multi-threaded one
//! makes that case meaningful.
//!
//! ```no_run
//! # async fn example() {
//! // In a #[tokio::test(flavor = "multi_thread")] of a backend:
//! qimg_io::conformance::run_all(qimg_io::MemStorage::new).await;
//! # }
//! ```

use std::io::{ErrorKind, IoSlice};
use std::sync::Arc;

use crate::{AlignedBuf, AllocateOutcome, DiscardOutcome, MAX_OFFSET, Storage, StorageError};

/// Runs every case, each on a fresh empty storage made by `make`.
pub async fn run_all<S, F>(make: F)
where
    S: Storage + 'static,
    F: Fn() -> S,
{
    assert_futures_are_send(&make());
    write_then_read_back(&make()).await;
    writes_past_the_end_grow_and_leave_zeros(&make()).await;
    unaligned_writes_and_reads(&make()).await;
    vectored_writes_land_in_order(&make()).await;
    reads_past_the_end(&make()).await;
    write_zeroes_inside_and_over_the_end(&make()).await;
    discard_reads_back_zeros_or_leaves_data(&make()).await;
    allocate_keeps_data_and_reports_length(&make()).await;
    set_len_grows_and_shrinks(&make()).await;
    huge_sparse_lengths_work(&make()).await;
    flush_keeps_data(&make()).await;
    durable_writes_land(&make()).await;
    out_of_range_requests_fail_without_panicking(&make()).await;
    misaligned_requests_fail_when_alignment_is_required(&make()).await;
    concurrent_disjoint_writes(Arc::new(make())).await;
}

/// Compile-time check that every future of the trait is `Send` for this `S` (the futures are
/// built, never polled).
pub fn assert_futures_are_send<S: Storage>(s: &S) {
    fn is_send<T: Send>(_: &T) {}
    let mut buf = [0u8; 1];
    is_send(&s.read_at_most(&mut buf, 0));
    is_send(&s.read_at(&mut buf, 0));
    is_send(&s.read_at_zero_fill(&mut buf, 0));
    is_send(&s.write_at(&buf, 0));
    is_send(&s.write_vectored_at(&[IoSlice::new(&buf)], 0));
    is_send(&s.write_zeroes(0, 1));
    is_send(&s.discard(0, 1));
    is_send(&s.allocate(0, 1));
    is_send(&s.flush());
    is_send(&s.len());
    is_send(&s.is_empty());
    is_send(&s.set_len(0));
}

/// The block size cases work in: the request alignment, at least 512.
fn blk<S: Storage>(s: &S) -> u64 {
    s.request_alignment().max(512) as u64
}

fn unaligned_ok<S: Storage>(s: &S) -> bool {
    s.request_alignment() == 1 && s.mem_alignment() == 1
}

/// A buffer of `len` bytes aligned for `s`.
fn buf<S: Storage>(s: &S, len: u64) -> AlignedBuf {
    AlignedBuf::zeroed(len as usize, s.mem_alignment().max(1)).expect("test buffer")
}

/// A buffer of `len` bytes of a pattern that differs per `seed` and per byte position.
fn pattern<S: Storage>(s: &S, len: u64, seed: u8) -> AlignedBuf {
    let mut b = buf(s, len);
    for (i, x) in b.iter_mut().enumerate() {
        *x = (i as u8).wrapping_mul(31).wrapping_add(seed) | 1;
    }
    b
}

async fn read<S: Storage>(s: &S, offset: u64, len: u64) -> Vec<u8> {
    let mut b = buf(s, len);
    s.read_at(&mut b, offset)
        .await
        .unwrap_or_else(|e| panic!("read of {len} at {offset:#x}: {e}"));
    b.to_vec()
}

async fn write<S: Storage>(s: &S, data: &[u8], offset: u64) {
    s.write_at(data, offset)
        .await
        .unwrap_or_else(|e| panic!("write of {} at {offset:#x}: {e}", data.len()));
}

async fn len<S: Storage>(s: &S) -> u64 {
    s.len().await.expect("len")
}

/// Panics, naming `what` and the first differing byte, unless `actual == expected` (without
/// printing whole buffers).
#[track_caller]
fn same(actual: &[u8], expected: &[u8], what: &str) {
    if actual.len() != expected.len() {
        panic!(
            "{what}: {} bytes where {} were expected",
            actual.len(),
            expected.len()
        );
    }
    if let Some(i) = actual.iter().zip(expected).position(|(a, e)| a != e) {
        let n = actual.iter().zip(expected).filter(|(a, e)| a != e).count();
        panic!(
            "{what}: byte {i} is {:#04x}, expected {:#04x} ({n} of {} bytes differ)",
            actual[i],
            expected[i],
            actual.len()
        );
    }
}

fn zeros(len: u64) -> Vec<u8> {
    vec![0; len as usize]
}

/// Write then read back, whole and in parts.
pub async fn write_then_read_back<S: Storage>(s: &S) {
    let b = blk(s);
    assert_eq!(len(s).await, 0, "fresh storage is empty");
    assert!(s.is_empty().await.expect("is_empty"));
    let data = pattern(s, 3 * b, 1);
    write(s, &data, b).await;
    assert_eq!(len(s).await, 4 * b);
    same(&read(s, b, 3 * b).await, &data, "read(s, b, 3 * b)");
    same(
        &read(s, 2 * b, b).await,
        &data[b as usize..2 * b as usize],
        "read(s, 2 * b, b)",
    );
    // Overwrite the middle block.
    let other = pattern(s, b, 2);
    write(s, &other, 2 * b).await;
    let mut expect = data.to_vec();
    expect[b as usize..2 * b as usize].copy_from_slice(&other);
    same(&read(s, b, 3 * b).await, &expect, "read(s, b, 3 * b)");
    assert_eq!(len(s).await, 4 * b, "overwrite keeps the length");
    // Empty reads and writes are no-ops, even past the end.
    s.write_at(&[], 100 * b).await.expect("empty write");
    assert_eq!(len(s).await, 4 * b, "empty write does not grow");
    s.read_at(&mut [], 100 * b).await.expect("empty read");
}

/// Writes past the end grow the storage, and the gap reads as zeros.
pub async fn writes_past_the_end_grow_and_leave_zeros<S: Storage>(s: &S) {
    let b = blk(s);
    let data = pattern(s, b, 3);
    write(s, &data, 4 * b).await;
    assert_eq!(len(s).await, 5 * b);
    same(&read(s, 0, 4 * b).await, &zeros(4 * b), "read(s, 0, 4 * b)");
    same(&read(s, 4 * b, b).await, &data, "read(s, 4 * b, b)");
}

/// Odd offsets and lengths, on backends that take them.
pub async fn unaligned_writes_and_reads<S: Storage>(s: &S) {
    if !unaligned_ok(s) {
        return;
    }
    let data: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8 + 1).collect();
    write(s, &data, 7).await;
    assert_eq!(len(s).await, 1007);
    same(&read(s, 0, 7).await, &zeros(7), "read(s, 0, 7)");
    same(&read(s, 7, 1000).await, &data, "read(s, 7, 1000)");
    same(&read(s, 500, 3).await, &data[493..496], "read(s, 500, 3)");
    write(s, b"xyz", 1006).await;
    assert_eq!(len(s).await, 1009);
    same(
        &read(s, 1005, 4).await,
        &[data[998], b'x', b'y', b'z'],
        "read(s, 1005, 4)",
    );
}

/// Vectored writes put their segments one after another, across more segments than one
/// system call takes.
pub async fn vectored_writes_land_in_order<S: Storage>(s: &S) {
    let b = blk(s);
    let segs: Vec<AlignedBuf> = (0..3).map(|i| pattern(s, b, 10 + i)).collect();
    let mut iov: Vec<IoSlice<'_>> = segs.iter().map(|x| IoSlice::new(x)).collect();
    if unaligned_ok(s) {
        iov.insert(1, IoSlice::new(&[]));
    }
    s.write_vectored_at(&iov, b).await.expect("vectored write");
    assert_eq!(len(s).await, 4 * b);
    for (i, seg) in segs.iter().enumerate() {
        same(
            &read(s, b * (1 + i as u64), b).await,
            seg,
            &format!("segment {i}"),
        );
    }
    s.write_vectored_at(&[], 50 * b)
        .await
        .expect("empty vectored write");
    assert_eq!(len(s).await, 4 * b, "empty vectored write does not grow");

    // More segments than IOV_MAX (1024).
    let n = 1100u64;
    let seg_len = if unaligned_ok(s) { 3 } else { b };
    let many: Vec<AlignedBuf> = (0..n).map(|i| pattern(s, seg_len, i as u8)).collect();
    let iov: Vec<IoSlice<'_>> = many.iter().map(|x| IoSlice::new(x)).collect();
    s.write_vectored_at(&iov, 0)
        .await
        .expect("long vectored write");
    let back = read(s, 0, n * seg_len).await;
    let expect: Vec<u8> = many.iter().flat_map(|x| x.iter().copied()).collect();
    same(&back, &expect, "1100-segment vectored write");
}

/// Past the end: `read_at` fails with UnexpectedEof, `read_at_most` stops short,
/// `read_at_zero_fill` fills zeros.
pub async fn reads_past_the_end<S: Storage>(s: &S) {
    let b = blk(s);
    let data = pattern(s, 2 * b, 4);
    write(s, &data, 0).await;

    let mut across = buf(s, 2 * b);
    let e = s
        .read_at(&mut across, b)
        .await
        .expect_err("read across the end must fail");
    assert_eq!(e.kind(), ErrorKind::UnexpectedEof, "{e}");
    assert!(
        matches!(e, StorageError::UnexpectedEof { offset, len, eof } if offset == b && len == 2 * b && eof == 2 * b),
        "{e:?}"
    );
    let mut beyond = buf(s, b);
    let e = s
        .read_at(&mut beyond, 10 * b)
        .await
        .expect_err("read beyond the end must fail");
    assert_eq!(e.kind(), ErrorKind::UnexpectedEof);

    let mut most = buf(s, 2 * b);
    let n = s.read_at_most(&mut most, b).await.expect("read_at_most");
    assert_eq!(n as u64, b);
    same(&most[..n], &data[b as usize..], "&most[..n]");
    assert_eq!(s.read_at_most(&mut most, 10 * b).await.expect("at_most"), 0);

    let mut zf = pattern(s, 2 * b, 9);
    s.read_at_zero_fill(&mut zf, b).await.expect("zero fill");
    same(&zf[..b as usize], &data[b as usize..], "&zf[..b as usize]");
    same(&zf[b as usize..], &zeros(b), "&zf[b as usize..]");
    let mut zf = pattern(s, b, 9);
    s.read_at_zero_fill(&mut zf, 100 * b)
        .await
        .expect("zero fill beyond");
    same(&zf, &zeros(b), "&*zf");
    assert_eq!(len(s).await, 2 * b, "reads never change the length");

    if unaligned_ok(s) {
        let mut odd = vec![0xee; 10];
        s.read_at_zero_fill(&mut odd, 2 * b - 3).await.expect("odd");
        same(&odd[..3], &data[2 * b as usize - 3..], "&odd[..3]");
        assert_eq!(&odd[3..], &[0; 7]);
    }
}

/// `write_zeroes` zeroes inside the storage and grows it like a write over the end.
pub async fn write_zeroes_inside_and_over_the_end<S: Storage>(s: &S) {
    let b = blk(s);
    let data = pattern(s, 4 * b, 5);
    write(s, &data, 0).await;
    s.write_zeroes(b, 2 * b).await.expect("zero inside");
    assert_eq!(len(s).await, 4 * b, "zeroing inside keeps the length");
    same(&read(s, 0, b).await, &data[..b as usize], "read(s, 0, b)");
    same(&read(s, b, 2 * b).await, &zeros(2 * b), "read(s, b, 2 * b)");
    same(
        &read(s, 3 * b, b).await,
        &data[3 * b as usize..],
        "read(s, 3 * b, b)",
    );

    s.write_zeroes(3 * b, 3 * b)
        .await
        .expect("zero over the end");
    assert_eq!(len(s).await, 6 * b, "zeroing over the end grows");
    same(
        &read(s, 3 * b, 3 * b).await,
        &zeros(3 * b),
        "read(s, 3 * b, 3 * b)",
    );
    same(&read(s, 0, b).await, &data[..b as usize], "read(s, 0, b)");

    s.write_zeroes(100 * b, 0).await.expect("empty zeroing");
    assert_eq!(len(s).await, 6 * b, "empty zeroing does not grow");

    // A large range, to cover chunked fallbacks.
    s.write_zeroes(8 * b, 4 << 20).await.expect("large zeroing");
    assert_eq!(len(s).await, 8 * b + (4 << 20));
    same(
        &read(s, 8 * b + (2 << 20), b).await,
        &zeros(b),
        "read(s, 8 * b + (2 << 20), b)",
    );

    if unaligned_ok(s) {
        write(s, &[0xaa; 10], 0).await;
        s.write_zeroes(3, 4).await.expect("odd zeroing");
        same(
            &read(s, 0, 10).await,
            &[0xaa, 0xaa, 0xaa, 0, 0, 0, 0, 0xaa, 0xaa, 0xaa],
            "read(s, 0, 10)",
        );
    }
}

/// `discard` never changes the length; when it deallocates, the range reads as zeros,
/// otherwise the data stays.
pub async fn discard_reads_back_zeros_or_leaves_data<S: Storage>(s: &S) {
    let b = blk(s);
    // Large enough to cover whole file system blocks and whole memory chunks.
    let total = 64 * b + (256 << 10);
    let data = pattern(s, total, 6);
    write(s, &data, 0).await;
    let (lo, hi) = (b, total - b);
    let outcome = s.discard(lo, hi - lo).await.expect("discard");
    assert_eq!(len(s).await, total, "discard keeps the length");
    same(
        &read(s, 0, lo).await,
        &data[..lo as usize],
        "before the range",
    );
    same(
        &read(s, hi, b).await,
        &data[hi as usize..],
        "after the range",
    );
    let middle = read(s, lo, hi - lo).await;
    match outcome {
        DiscardOutcome::Deallocated => same(&middle, &zeros(hi - lo), "discarded range"),
        DiscardOutcome::Ignored => {
            same(&middle, &data[lo as usize..hi as usize], "ignored discard")
        }
    }
    s.discard(total, 10 * b)
        .await
        .expect("discard past the end");
    s.discard(total - b, 10 * b)
        .await
        .expect("discard over the end");
    assert_eq!(len(s).await, total, "discard past the end does not grow");
    s.discard(0, 0).await.expect("empty discard");
}

/// `allocate` keeps readable data; when it reserves, the length covers the range and the new
/// bytes read as zeros; otherwise nothing changes.
pub async fn allocate_keeps_data_and_reports_length<S: Storage>(s: &S) {
    let b = blk(s);
    let data = pattern(s, 2 * b, 7);
    write(s, &data, 0).await;
    s.allocate(0, b).await.expect("allocate inside");
    assert_eq!(len(s).await, 2 * b, "allocating inside keeps the length");
    match s.allocate(b, 3 * b).await.expect("allocate over the end") {
        AllocateOutcome::Reserved => {
            assert_eq!(len(s).await, 4 * b, "reserved range is inside the length");
            same(
                &read(s, 2 * b, 2 * b).await,
                &zeros(2 * b),
                "read(s, 2 * b, 2 * b)",
            );
        }
        AllocateOutcome::NotReserved => assert_eq!(len(s).await, 2 * b),
    }
    same(&read(s, 0, 2 * b).await, &data, "allocate keeps data");
    assert_eq!(
        s.allocate(100 * b, 0).await.expect("empty allocate"),
        AllocateOutcome::NotReserved
    );
}

/// `set_len` grows with zeros and shrinks; data cut off by a shrink does not come back.
pub async fn set_len_grows_and_shrinks<S: Storage>(s: &S) {
    let b = blk(s);
    s.set_len(3 * b).await.expect("grow");
    assert_eq!(len(s).await, 3 * b);
    same(&read(s, 0, 3 * b).await, &zeros(3 * b), "read(s, 0, 3 * b)");
    let data = pattern(s, 3 * b, 8);
    write(s, &data, 0).await;
    s.set_len(b).await.expect("shrink");
    assert_eq!(len(s).await, b);
    same(&read(s, 0, b).await, &data[..b as usize], "read(s, 0, b)");
    s.set_len(3 * b).await.expect("grow again");
    same(
        &read(s, b, 2 * b).await,
        &zeros(2 * b),
        "shrunk data is gone",
    );
    s.set_len(0).await.expect("to zero");
    assert_eq!(len(s).await, 0);
    assert!(s.is_empty().await.expect("is_empty"));
    if unaligned_ok(s) {
        write(s, &[0x55; 100], 0).await;
        s.set_len(37).await.expect("odd shrink");
        s.set_len(100).await.expect("odd grow");
        let back = read(s, 0, 100).await;
        assert_eq!(&back[..37], &[0x55; 37]);
        assert_eq!(&back[37..], &[0; 63]);
    }
}

/// Multi-terabyte lengths cost nothing and work at both ends.
pub async fn huge_sparse_lengths_work<S: Storage>(s: &S) {
    let b = blk(s);
    let big = 2u64 << 40;
    s.set_len(big).await.expect("set_len 2 TiB");
    assert_eq!(len(s).await, big);
    same(&read(s, big / 2, b).await, &zeros(b), "read(s, big / 2, b)");
    let data = pattern(s, b, 11);
    write(s, &data, big - b).await;
    same(&read(s, big - b, b).await, &data, "read(s, big - b, b)");
    let outcome = s.discard(0, big).await.expect("discard 2 TiB");
    if outcome == DiscardOutcome::Deallocated {
        same(&read(s, big - b, b).await, &zeros(b), "read(s, big - b, b)");
    }
    s.set_len(0).await.expect("shrink from 2 TiB");
    assert_eq!(len(s).await, 0);
}

/// `flush` succeeds and leaves the data readable.
pub async fn flush_keeps_data<S: Storage>(s: &S) {
    let b = blk(s);
    s.flush().await.expect("flush of empty storage");
    let data = pattern(s, 2 * b, 12);
    write(s, &data, 0).await;
    s.write_zeroes(2 * b, b).await.expect("zeroes");
    s.flush().await.expect("flush");
    same(&read(s, 0, 2 * b).await, &data, "read(s, 0, 2 * b)");
    assert_eq!(len(s).await, 3 * b);
}

/// `write_at_durable` writes like `write_at` (past the end too, growing the storage).
pub async fn durable_writes_land<S: Storage>(s: &S) {
    let b = blk(s);
    let data = pattern(s, 2 * b, 13);
    s.write_at_durable(&data, b)
        .await
        .expect("durable write past the end");
    same(&read(s, b, 2 * b).await, &data, "read(s, b, 2 * b)");
    assert_eq!(len(s).await, 3 * b);
    let again = pattern(s, b, 14);
    s.write_at_durable(&again, 0).await.expect("durable write");
    same(&read(s, 0, b).await, &again, "read(s, 0, b)");
    same(&read(s, b, 2 * b).await, &data, "read(s, b, 2 * b)");
}

/// Ranges whose end overflows or passes [`MAX_OFFSET`] fail with `OutOfRange` naming offset
/// and length.
pub async fn out_of_range_requests_fail_without_panicking<S: Storage>(s: &S) {
    let b = blk(s);
    let mut rbuf = buf(s, b);
    let wbuf = buf(s, b);
    let huge = u64::MAX - b + 1; // aligned, and offset + len overflows
    let near = MAX_OFFSET - MAX_OFFSET % b; // aligned, and offset + len passes MAX_OFFSET
    let check = |what: &str, r: crate::Result<()>, offset: u64, len: u64| match r {
        Err(StorageError::OutOfRange {
            offset: o, len: l, ..
        }) if o == offset && l == len => {
            let msg = format!("{}", r.unwrap_err());
            assert!(msg.contains(&format!("{offset:#x}")), "{what}: {msg}");
        }
        other => panic!("{what}: expected OutOfRange, got {other:?}"),
    };
    for offset in [huge, near] {
        check("read", s.read_at(&mut rbuf, offset).await, offset, b);
        check(
            "read_at_zero_fill",
            s.read_at_zero_fill(&mut rbuf, offset).await,
            offset,
            b,
        );
        check("write", s.write_at(&wbuf, offset).await, offset, b);
        check(
            "write_vectored",
            s.write_vectored_at(&[IoSlice::new(&wbuf)], offset).await,
            offset,
            b,
        );
        check(
            "write_zeroes",
            s.write_zeroes(offset, b).await.map(drop),
            offset,
            b,
        );
        check("discard", s.discard(offset, b).await.map(drop), offset, b);
        check("allocate", s.allocate(offset, b).await.map(drop), offset, b);
    }
    check("set_len", s.set_len(u64::MAX).await, u64::MAX, 0);
    check(
        "write_zeroes u64::MAX",
        s.write_zeroes(b, u64::MAX).await.map(drop),
        b,
        u64::MAX,
    );
    assert_eq!(len(s).await, 0, "failed requests change nothing");
}

/// With alignment required, misaligned data requests fail with `Misaligned` (kind
/// InvalidInput) and change nothing.
pub async fn misaligned_requests_fail_when_alignment_is_required<S: Storage>(s: &S) {
    let req = s.request_alignment() as u64;
    let mem = s.mem_alignment();
    let b = blk(s);
    let data = pattern(s, 2 * b, 13);
    write(s, &data, 0).await;
    let is_misaligned = |what: &str, r: crate::Result<()>| match r {
        Err(e @ StorageError::Misaligned { .. }) => {
            assert_eq!(e.kind(), ErrorKind::InvalidInput, "{what}")
        }
        other => panic!("{what}: expected Misaligned, got {other:?}"),
    };
    if req > 1 {
        let mut rb = buf(s, b);
        is_misaligned("read at odd offset", s.read_at(&mut rb, 1).await);
        let mut short = buf(s, b - 1);
        is_misaligned("read of odd length", s.read_at(&mut short, 0).await);
        is_misaligned("write at odd offset", s.write_at(&buf(s, b), 1).await);
        is_misaligned("zeroes at odd offset", s.write_zeroes(1, b).await.map(drop));
        is_misaligned(
            "vectored with odd segment",
            s.write_vectored_at(&[IoSlice::new(&buf(s, b - 1)), IoSlice::new(&[0])], 0)
                .await,
        );
    }
    if mem > 1 {
        let mut big = buf(s, 2 * b);
        is_misaligned(
            "read into odd buffer",
            s.read_at(&mut big[1..=b as usize], 0).await,
        );
        is_misaligned(
            "write from odd buffer",
            s.write_at(&big[1..=b as usize], 0).await,
        );
    }
    assert_eq!(len(s).await, 2 * b);
    same(
        &read(s, 0, 2 * b).await,
        &data,
        "misaligned requests change nothing",
    );
}

/// Many tasks writing disjoint ranges at once through an `Arc`, then reading back at once.
pub async fn concurrent_disjoint_writes<S: Storage + 'static>(s: Arc<S>) {
    let b = blk(&*s);
    let tasks = 64u64;
    let mut handles = Vec::new();
    for i in 0..tasks {
        let s = Arc::clone(&s);
        handles.push(tokio::spawn(async move {
            let data = pattern(&*s, 2 * b, i as u8);
            s.write_at(&data, 2 * i * b)
                .await
                .expect("concurrent write");
            if i % 4 == 0 {
                s.write_zeroes(2 * i * b, b)
                    .await
                    .expect("concurrent zeroes");
            }
        }));
    }
    for h in handles {
        h.await.expect("writer task");
    }
    assert_eq!(len(&*s).await, 2 * tasks * b);
    let mut handles = Vec::new();
    for i in 0..tasks {
        let s = Arc::clone(&s);
        handles.push(tokio::spawn(async move {
            let mut expect = pattern(&*s, 2 * b, i as u8).to_vec();
            if i % 4 == 0 {
                expect[..b as usize].fill(0);
            }
            same(
                &read(&*s, 2 * i * b, 2 * b).await,
                &expect,
                &format!("block {i}"),
            );
        }));
    }
    for h in handles {
        h.await.expect("reader task");
    }
}

//! FileStorage behaviour the generic conformance suite cannot see: durability across reopen,
//! read-only files, open errors, O_DIRECT alignment probing, and what the file system did.

use std::os::unix::fs::MetadataExt;

use qimg_io::{
    AlignedBuf, AllocateOutcome, BlockingStrategy, DiscardOutcome, FileOptions, FileStorage, Op,
    Storage, StorageError, ZeroOutcome,
};

fn rw() -> FileOptions {
    FileOptions::new().read_write(true).create(true)
}

#[tokio::test]
async fn flushed_data_is_seen_by_a_fresh_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("img");
    let s = rw().open(&path).unwrap();
    s.write_at(b"durable", 4096).await.unwrap();
    s.flush().await.unwrap();
    drop(s);
    let again = FileStorage::open(&path).unwrap();
    let mut b = [0u8; 7];
    again.read_at(&mut b, 4096).await.unwrap();
    assert_eq!(&b, b"durable");
    assert_eq!(again.len().await.unwrap(), 4103);
}

#[tokio::test]
async fn read_only_files_refuse_every_modification_and_still_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("img");
    std::fs::write(&path, b"backing").unwrap();
    let s = FileStorage::open(&path).unwrap();
    assert!(s.is_read_only());
    let refused = |r: Result<(), StorageError>, op: Op| match r {
        Err(e @ StorageError::ReadOnly { .. }) => {
            assert_eq!(e.op(), Some(op));
            assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied);
        }
        other => panic!("{op}: expected ReadOnly, got {other:?}"),
    };
    refused(s.write_at(b"x", 0).await, Op::Write);
    refused(
        s.write_vectored_at(&[std::io::IoSlice::new(b"x")], 0).await,
        Op::Write,
    );
    refused(s.write_zeroes(0, 1).await.map(drop), Op::WriteZeroes);
    refused(s.discard(0, 1).await.map(drop), Op::Discard);
    refused(s.allocate(0, 1).await.map(drop), Op::Allocate);
    refused(s.set_len(0).await, Op::SetLen);
    s.flush().await.unwrap();
    let mut b = [0u8; 7];
    s.read_at(&mut b, 0).await.unwrap();
    assert_eq!(&b, b"backing");
}

#[test]
fn opening_a_missing_file_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("missing.qcow2");
    let e = FileStorage::open(&path).unwrap_err();
    assert!(e.to_string().contains("missing.qcow2"), "{e}");
    assert_eq!(e.kind(), std::io::ErrorKind::NotFound);
    assert_eq!(e.op(), None);
}

#[test]
fn from_file_reads_the_access_mode() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("img");
    std::fs::write(&path, b"x").unwrap();
    let ro = FileStorage::from_file(
        std::fs::File::open(&path).unwrap(),
        BlockingStrategy::Inline,
    )
    .unwrap();
    assert!(ro.is_read_only() && !ro.is_direct());
    assert_eq!((ro.request_alignment(), ro.mem_alignment()), (1, 1));
    let w = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let rw = FileStorage::from_file(w, BlockingStrategy::SpawnBlocking).unwrap();
    assert!(!rw.is_read_only());
    assert_eq!(rw.blocking_strategy(), BlockingStrategy::SpawnBlocking);
}

fn blocks(path: &std::path::Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks()
}

/// On file systems with fallocate (ext4, xfs, btrfs, tmpfs), the efficient paths are taken and
/// change the space used the way they should; elsewhere the outcomes say they were not.
#[tokio::test]
async fn fallocate_paths_change_allocation_when_supported() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("img");
    let s = rw().open(&path).unwrap();
    let mib = 1u64 << 20;
    match s.allocate(0, 4 * mib).await.unwrap() {
        AllocateOutcome::Reserved => {
            assert_eq!(s.len().await.unwrap(), 4 * mib);
            assert!(blocks(&path) * 512 >= 4 * mib, "allocate reserved space");
        }
        AllocateOutcome::NotReserved => println!("fallocate unsupported here"),
    }
    s.write_at(&vec![0xab; 4 * mib as usize], 0).await.unwrap();
    let before = blocks(&path);
    match s.discard(mib, 2 * mib).await.unwrap() {
        DiscardOutcome::Deallocated => assert!(blocks(&path) < before, "discard freed space"),
        DiscardOutcome::Ignored => println!("punch hole unsupported here"),
    }
    let outcome = s.write_zeroes(0, mib).await.unwrap();
    println!("write_zeroes: {outcome:?}");
    let mut b = vec![1u8; mib as usize];
    s.read_at(&mut b, 0).await.unwrap();
    assert!(b.iter().all(|&x| x == 0));
    assert!(matches!(
        outcome,
        ZeroOutcome::Efficient | ZeroOutcome::Written
    ));
}

#[tokio::test]
async fn o_direct_alignment_is_probed_and_enforced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("img");
    std::fs::write(&path, vec![7u8; 8192]).unwrap();
    let s = match FileOptions::new().read_write(true).direct(true).open(&path) {
        Ok(s) => s,
        Err(e) => {
            println!("skipping: O_DIRECT unsupported here: {e}");
            return;
        }
    };
    assert!(s.is_direct());
    let (req, mem) = (s.request_alignment(), s.mem_alignment());
    println!("O_DIRECT alignment: request {req}, memory {mem}");
    assert!(req.is_power_of_two() && (512..=4096).contains(&req));
    assert!(mem.is_power_of_two() && (512..=4096).contains(&mem));
    let mut b = AlignedBuf::zeroed(req, mem).unwrap();
    s.read_at(&mut b, req as u64).await.unwrap();
    assert!(b.iter().all(|&x| x == 7));
    let e = s.read_at(&mut b[..req - 1], 0).await.unwrap_err();
    assert!(matches!(e, StorageError::Misaligned { .. }), "{e:?}");
    assert!(e.to_string().contains("not aligned"), "{e}");

    // An empty file cannot be probed and gets the conservative 4096.
    let empty = dir.path().join("empty");
    let s = FileOptions::new()
        .read_write(true)
        .create_new(true)
        .direct(true)
        .open(&empty)
        .unwrap();
    assert_eq!((s.request_alignment(), s.mem_alignment()), (4096, 4096));
}

#[tokio::test]
async fn without_fallocate_the_outcomes_say_so() {
    let dir = tempfile::tempdir().unwrap();
    let s = rw().fallocate(false).open(dir.path().join("img")).unwrap();
    s.write_at(&[9; 8192], 0).await.unwrap();
    assert_eq!(s.write_zeroes(0, 4096).await.unwrap(), ZeroOutcome::Written);
    assert_eq!(
        s.discard(4096, 4096).await.unwrap(),
        DiscardOutcome::Ignored
    );
    assert_eq!(
        s.allocate(0, 1 << 20).await.unwrap(),
        AllocateOutcome::NotReserved
    );
    assert_eq!(s.len().await.unwrap(), 8192);
    let mut b = [1u8; 8192];
    s.read_at(&mut b, 0).await.unwrap();
    assert!(b[..4096].iter().all(|&x| x == 0) && b[4096..].iter().all(|&x| x == 9));
}

/// A failed flush poisons the storage and its clones: later flushes fail too, with a message
/// that says why, even where the system call would now succeed (QEMU's file driver does the
/// same; Linux may have dropped the pages the failed fsync could not write). `/dev/null`
/// refuses fdatasync with EINVAL.
#[tokio::test]
async fn a_failed_flush_makes_every_later_flush_fail() {
    let s = FileOptions::new()
        .read_write(true)
        .open("/dev/null")
        .unwrap();
    let clone = s.clone();
    let first = s.flush().await.unwrap_err();
    assert_eq!(first.op(), Some(Op::Flush));
    assert_eq!(
        first.raw_os_error(),
        Some(nix::errno::Errno::EINVAL as i32),
        "{first}"
    );
    for again in [s.flush().await, clone.flush().await] {
        let e = again.unwrap_err();
        assert_eq!(e.op(), Some(Op::Flush));
        let why = std::error::Error::source(&e).unwrap().to_string();
        assert!(
            why.contains("an earlier flush of this file failed"),
            "{why}"
        );
    }
    // Another open of the same file starts over.
    let fresh = FileOptions::new()
        .read_write(true)
        .open("/dev/null")
        .unwrap();
    assert_eq!(
        fresh.flush().await.unwrap_err().raw_os_error(),
        Some(nix::errno::Errno::EINVAL as i32)
    );
}

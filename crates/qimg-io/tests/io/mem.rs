//! MemStorage behaviour beyond the conformance suite: sparseness, snapshots, shared clones.

use qimg_io::{MemStorage, Storage, StorageError};

#[tokio::test]
async fn terabyte_lengths_allocate_nothing_and_discard_frees_chunks() {
    let m = MemStorage::new();
    m.set_len(8 << 40).await.unwrap();
    assert_eq!(m.allocated_bytes(), 0);
    m.write_at(&[1; 200_000], 1 << 40).await.unwrap();
    let used = m.allocated_bytes();
    assert!(used > 0 && used <= 4 * 65536, "{used}");
    m.discard(1 << 40, 200_000).await.unwrap();
    assert!(m.allocated_bytes() < used, "whole chunks freed");
    m.write_zeroes(0, 8 << 40).await.unwrap();
    assert_eq!(m.allocated_bytes(), 0);
    assert_eq!(m.len().await.unwrap(), 8 << 40);
}

#[tokio::test]
async fn clones_share_contents_and_snapshots_copy_them() {
    let m = MemStorage::from_bytes(b"hello");
    let seen = m.clone();
    m.write_at(b" world", 5).await.unwrap();
    assert_eq!(seen.snapshot(), b"hello world");
    assert_eq!(seen.snapshot_range(6, 8), b"world\0\0\0");
    let ro = seen.clone().read_only();
    assert!(ro.is_read_only() && !seen.is_read_only());
    assert!(matches!(
        ro.write_at(b"x", 0).await,
        Err(StorageError::ReadOnly { .. })
    ));
    m.set_len(3).await.unwrap();
    assert_eq!(ro.snapshot(), b"hel");
}

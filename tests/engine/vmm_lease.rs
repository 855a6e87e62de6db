//! The VMM data path: `Image::write_lease` hands out host extents, the "VMM" writes the guest
//! bytes there through its own file descriptor, and `commit` links them. Checked against a flat
//! model, `qemu-img check` and `qemu-img compare`, over standard and extended L2 images with a
//! backing file, with leases mixed with ordinary writes, aborted leases and `map()` reads.

use crate::common;

use std::fs::File;
use std::os::unix::fs::FileExt;

use common::*;
use qimg::{ExtentKind, Image, OpenOptions};
use qimg_testkit::{Rng, pattern};

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

/// Writes `data` at guest `offset` the way a VMM would: lease, own I/O, commit.
async fn vmm_write(img: &Image<qimg::io::AnyStorage>, fd: &File, offset: u64, data: &[u8]) {
    let lease = img.write_lease(offset, data.len() as u64).await.unwrap();
    let mut covered = 0;
    for e in lease.extents() {
        let from = (e.guest_offset - offset) as usize;
        fd.write_all_at(&data[from..from + e.length as usize], e.host_offset)
            .unwrap();
        covered += e.length;
    }
    assert_eq!(covered, data.len() as u64, "extents cover the range");
    lease.commit().await.unwrap();
}

#[tokio::test]
async fn leased_writes_match_the_model_and_check_clean() {
    qimg_testkit::require_qemu!();
    for (opts, seed) in [
        ("cluster_size=64k", 1u64),
        ("extended_l2=on,cluster_size=64k", 2),
        ("extended_l2=on,cluster_size=16k,refcount_bits=1", 3),
        ("compat=0.10,cluster_size=4k", 4),
    ] {
        let dir = Scratch::new("lease");
        let size = 8 * MIB;
        let backing = pattern(99, 0, (6 * MIB) as usize);
        std::fs::write(dir.path("base.raw"), &backing).unwrap();
        qemu_create(&dir.0, "a.qcow2", opts, size, Some(("base.raw", "raw")));
        let mut model = backing.clone();
        model.resize(size as usize, 0);
        let img = OpenOptions::new()
            .writable(true)
            .open(dir.path("a.qcow2"))
            .await
            .unwrap();
        assert_eq!(img.data_path(), dir.path("a.qcow2"));
        let fd = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(img.data_path())
            .unwrap();
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        for step in 0..300u64 {
            let len = match rng.below(4) {
                0 => 1 + rng.below(600),
                1 => 4 * KIB,
                2 => 1 + rng.below(200 * KIB),
                _ => 512 * (1 + rng.below(16)),
            };
            let offset = rng.below(size - len);
            let data = pattern(seed * 1000 + step, offset, len as usize);
            match rng.below(10) {
                0..=5 => {
                    vmm_write(&img, &fd, offset, &data).await;
                    model[offset as usize..(offset + len) as usize].copy_from_slice(&data);
                }
                6 => {
                    img.write(&data, offset).await.unwrap();
                    model[offset as usize..(offset + len) as usize].copy_from_slice(&data);
                }
                7 => {
                    // The VMM's write failed: abort, nothing changes, nothing leaks.
                    let lease = img.write_lease(offset, len).await.unwrap();
                    lease.abort().await;
                }
                8 => img.flush().await.unwrap(),
                _ => {
                    // Read through map(): data extents straight from the file.
                    let mut got = vec![0u8; len as usize];
                    img.read(&mut got, offset).await.unwrap();
                    let want = &model[offset as usize..(offset + len) as usize];
                    assert!(got == want, "{opts}: read at {offset:#x}+{len} differs");
                    for e in img.map(offset, len).await.unwrap() {
                        if let ExtentKind::Data { host_offset } = e.kind {
                            let mut buf = vec![0u8; e.length as usize];
                            fd.read_exact_at(&mut buf, host_offset).unwrap();
                            let at = e.start as usize;
                            assert!(buf == model[at..at + buf.len()], "{opts}: map at {at:#x}");
                        }
                    }
                }
            }
        }
        img.close().await.unwrap();
        assert_clean(&dir.0, "a.qcow2", opts);
        assert_same_as_model(&dir.0, "a.qcow2", &model, opts);
    }
}

#[tokio::test]
async fn a_subcluster_lease_copies_nothing_and_a_standard_one_copies_the_cluster() {
    qimg_testkit::require_qemu!();
    for (opts, cow) in [
        ("extended_l2=on,cluster_size=128k", 0u64),
        ("cluster_size=128k", 128 * KIB - 4 * KIB),
    ] {
        let dir = Scratch::new("lease-cow");
        std::fs::write(dir.path("base.raw"), pattern(5, 0, MIB as usize)).unwrap();
        qemu_create(&dir.0, "a.qcow2", opts, MIB, Some(("base.raw", "raw")));
        let img = OpenOptions::new()
            .writable(true)
            .open(dir.path("a.qcow2"))
            .await
            .unwrap();
        let lease = img.write_lease(256 * KIB, 4 * KIB).await.unwrap();
        assert_eq!(lease.extents().len(), 1);
        let e = lease.extents()[0];
        assert_eq!((e.guest_offset, e.length), (256 * KIB, 4 * KIB));
        assert_eq!(e.host_offset % (4 * KIB), 0);
        let fd = std::fs::OpenOptions::new()
            .write(true)
            .open(img.data_path())
            .unwrap();
        fd.write_all_at(&[0xee; 4096], e.host_offset).unwrap();
        lease.commit().await.unwrap();
        assert_eq!(img.stats().await.cow_bytes, cow, "{opts}");
        let mut buf = vec![0u8; 4096];
        img.read(&mut buf, 256 * KIB).await.unwrap();
        assert_eq!(buf, vec![0xee; 4096]);
        img.close().await.unwrap();
        assert_clean(&dir.0, "a.qcow2", opts);
    }
}

#[tokio::test]
async fn dropped_leases_leak_nothing_once_the_image_is_closed() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("lease-drop");
    qemu_create(&dir.0, "a.qcow2", "cluster_size=64k", MIB, None);
    let img = OpenOptions::new()
        .writable(true)
        .open(dir.path("a.qcow2"))
        .await
        .unwrap();
    // Each reserves a fresh cluster; neither is committed nor aborted.
    drop(img.write_lease(0, 4096).await.unwrap());
    drop(img.write_lease(MIB / 2, 65536).await.unwrap());
    // Closed at once: nothing else gets to run between the drops and the close.
    img.close().await.unwrap();
    assert_clean(&dir.0, "a.qcow2", "dropped leases");
}

#[tokio::test]
async fn a_lease_holds_its_range_until_commit() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("lease-lock");
    qemu_create(&dir.0, "a.qcow2", "cluster_size=64k", MIB, None);
    let img = OpenOptions::new()
        .writable(true)
        .open(dir.path("a.qcow2"))
        .await
        .unwrap();
    let lease = img.write_lease(0, 4096).await.unwrap();
    let reader = img.clone();
    let read = tokio::spawn(async move {
        let mut buf = vec![0u8; 4096];
        reader.read(&mut buf, 0).await.unwrap();
        buf
    });
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert!(!read.is_finished(), "a read went through a held lease");
    let fd = std::fs::OpenOptions::new()
        .write(true)
        .open(img.data_path())
        .unwrap();
    fd.write_all_at(&[7; 4096], lease.extents()[0].host_offset)
        .unwrap();
    lease.commit().await.unwrap();
    assert_eq!(
        read.await.unwrap(),
        vec![7; 4096],
        "the read saw the whole write"
    );
    // A dropped lease releases its range at once; its cluster goes back at the next flush.
    drop(img.write_lease(MIB / 2, 4096).await.unwrap());
    img.write(&[1; 4096], MIB / 2).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    img.close().await.unwrap();
    assert_clean(&dir.0, "a.qcow2", "lease lock");
    // Read-only images and out-of-range leases are refused.
    let ro = OpenOptions::new().open(dir.path("a.qcow2")).await.unwrap();
    assert!(ro.write_lease(0, 1).await.is_err());
    ro.close().await.unwrap();
    let img = OpenOptions::new()
        .writable(true)
        .open(dir.path("a.qcow2"))
        .await
        .unwrap();
    assert!(img.write_lease(MIB - 1, 2).await.is_err());
    img.close().await.unwrap();
}

#[tokio::test]
async fn a_read_lease_pins_its_range_against_discard_and_names_aligned_host_bytes() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("read-lease");
    qemu_create(
        &dir.0,
        "a.qcow2",
        "extended_l2=on,cluster_size=64k",
        MIB,
        None,
    );
    let img = OpenOptions::new()
        .writable(true)
        .open(dir.path("a.qcow2"))
        .await
        .unwrap();
    let data = pattern(5, 0, 96 * 1024);
    img.write(&data, 8192).await.unwrap();
    let lease = img.read_lease(4096, 128 * 1024).await.unwrap();
    // The extents cover the range exactly and keep each offset's place in its cluster.
    let covered: u64 = lease.extents().iter().map(|e| e.length).sum();
    assert_eq!(covered, 128 * 1024);
    assert_eq!(lease.extents()[0].start, 4096);
    for e in lease.extents() {
        if let ExtentKind::Data { host_offset }
        | ExtentKind::Zero {
            host_offset: Some(host_offset),
        }
        | ExtentKind::Unallocated {
            host_offset: Some(host_offset),
        } = e.kind
        {
            assert_eq!(host_offset % 65536, e.start % 65536, "{e:?}");
        }
    }
    // A discard of the pinned range waits.
    let other = img.clone();
    let discard = tokio::spawn(async move { other.discard(0, 2 * 65536).await.unwrap() });
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert!(
        !discard.is_finished(),
        "a discard went through a read lease"
    );
    // Meanwhile the VMM reads the data extents from the file itself.
    let fd = File::open(img.data_path()).unwrap();
    let mut seen = 0u64;
    for (guest, host, len) in lease.data() {
        let mut buf = vec![0u8; len as usize];
        fd.read_exact_at(&mut buf, host).unwrap();
        let at = (guest - 8192) as usize;
        assert!(
            buf == data[at..at + len as usize],
            "extent at guest {guest:#x}"
        );
        seen += len;
    }
    assert_eq!(seen, 96 * 1024, "every written byte is in a data extent");
    // Reads through qimg do not wait for a read lease.
    let mut buf = vec![0u8; 4096];
    tokio::time::timeout(std::time::Duration::from_secs(5), img.read(&mut buf, 8192))
        .await
        .expect("a read waited for a read lease")
        .unwrap();
    lease.release();
    tokio::time::timeout(std::time::Duration::from_secs(5), discard)
        .await
        .expect("the discard ran once the lease was released")
        .unwrap();
    img.close().await.unwrap();
    assert_clean(&dir.0, "a.qcow2", "read lease");
}

use std::io::Write;
use std::os::fd::AsFd;

use nix::sys::eventfd::EventFd;

use super::Notifier;

use super::*;
use crate::AlignedBuf;

#[test]
fn reads_and_writes_lent_memory_and_signals_the_eventfd() {
    let mut file = tempfile::tempfile().unwrap();
    file.write_all(&[7u8; 8192]).unwrap();
    let mut ring = match QueueRing::new(4) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("SKIPPED: io_uring unavailable: {e}");
            return;
        }
    };
    let efd = EventFd::new().unwrap();
    ring.register_eventfd(efd.as_fd()).unwrap();

    let out = IoBuffers::from_vecs(vec![vec![1u8; 100], vec![2u8; 412]]);
    ring.write(file.as_fd(), 4096, &out, 0, 512, 11).unwrap();
    // Two segments: a vectored write, one iovec per segment.
    assert_eq!(ring.in_flight_addresses().len(), 2);
    let mut back = IoBuffers::from_vec(vec![0u8; 1024]);
    ring.submit().unwrap();
    ring.wait().unwrap();
    let mut seen = Vec::new();
    ring.reap(|c| seen.push(c));
    assert_eq!(
        seen,
        [RingCompletion {
            token: 11,
            result: 512,
            expected: 512
        }]
    );
    assert!(efd.read().unwrap() >= 1, "the kernel signalled the eventfd");

    ring.read(file.as_fd(), 4000, &mut back, 24, 1000, 12)
        .unwrap();
    assert!(!back.is_idle(), "the ring holds the memory while in flight");
    ring.submit().unwrap();
    ring.wait().unwrap();
    seen.clear();
    ring.reap(|c| seen.push(c));
    assert_eq!(seen[0].result, 1000);
    let owner = back.into_owner().unwrap().unwrap();
    let v = owner.downcast::<Vec<u8>>().unwrap();
    assert!(v[..24].iter().all(|&b| b == 0));
    assert!(v[24..24 + 96].iter().all(|&b| b == 7));
    assert!(v[120..220].iter().all(|&b| b == 1));
    assert!(v[220..632].iter().all(|&b| b == 2));
    assert!(v[632..1024].iter().all(|&b| b == 7));
    assert!(v.len() == 1024);
    drop(out);
}

#[test]
fn a_full_queue_refuses_and_drop_waits_for_the_kernel() {
    let file = tempfile::tempfile().unwrap();
    let Ok(mut ring) = QueueRing::new(2) else {
        return;
    };
    let a = IoBuffers::from_aligned(AlignedBuf::zeroed(4096, 4096).unwrap());
    ring.write(file.as_fd(), 0, &a, 0, 4096, 1).unwrap();
    ring.fsync(file.as_fd(), true, 2).unwrap();
    let err = ring.write(file.as_fd(), 0, &a, 0, 4096, 3).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::WouldBlock);
    let err = ring.write(file.as_fd(), 0, &a, 4000, 200, 3).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
    ring.submit().unwrap();
    drop(ring);
    assert!(
        a.is_idle(),
        "dropping the ring waited and released the memory"
    );
}

#[test]
fn depth_out_of_range_is_refused_with_the_value() {
    let err = QueueRing::new(0).unwrap_err();
    assert!(err.to_string().contains("queue depth 0"), "{err}");
}

#[test]
fn the_notifier_counts_signals_and_drains_to_zero() {
    let n = Notifier::new().unwrap();
    assert_eq!(n.drain().unwrap(), 0);
    n.notify().unwrap();
    n.clone().notify().unwrap();
    assert_eq!(n.drain().unwrap(), 2);
    assert_eq!(n.drain().unwrap(), 0);
}

#[test]
fn an_aligned_write_goes_to_the_kernel_from_the_callers_buffer() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("direct");
    std::fs::write(&path, vec![0u8; 65536]).unwrap();
    let file = match crate::FileOptions::new()
        .read_write(true)
        .direct(true)
        .open(&path)
    {
        Ok(f) => f,
        Err(e) => {
            eprintln!("SKIPPED: O_DIRECT unavailable here: {e}");
            return;
        }
    };
    let Ok(mut ring) = QueueRing::new(4) else {
        return;
    };
    let mut data = AlignedBuf::zeroed(8192, 4096).unwrap();
    data.fill(0x42);
    let address = data.as_ptr() as usize;
    let lent = IoBuffers::from_aligned(data);
    let access = crate::Storage::direct_access(&file).unwrap();
    ring.write(access.fd, 4096, &lent, 0, 8192, 1).unwrap();
    // The iovec the kernel gets is the caller's buffer itself: no bounce copy.
    assert_eq!(ring.in_flight_addresses(), [address]);
    ring.submit().unwrap();
    ring.wait().unwrap();
    let mut res = Vec::new();
    ring.reap(|c| res.push(c.result));
    assert_eq!(res, [8192]);
    let back = std::fs::read(&path).unwrap();
    assert!(back[4096..12288].iter().all(|&b| b == 0x42));
    assert!(back[..4096].iter().all(|&b| b == 0));
}

#[cfg(feature = "vm-memory")]
#[test]
fn guest_memory_is_lent_in_place_across_regions_and_copied_never_borrowed() {
    use std::sync::Arc;
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    let mem: GuestMemoryMmap<()> = GuestMemoryMmap::from_ranges(&[
        (GuestAddress(0), 0x1_0000),
        (GuestAddress(0x1_0000), 0x1_0000),
    ])
    .unwrap();
    let mem = Arc::new(mem);
    mem.write_slice(&[9u8; 0x2000], GuestAddress(0xf000))
        .unwrap();
    // 0xf800..0x10800 crosses the two regions: two segments.
    let mut b = IoBuffers::from_guest(mem.clone(), &[(0xf800, 0x1000), (0x100, 16)]).unwrap();
    assert!(b.is_guest_memory());
    assert_eq!((b.len(), b.segments()), (0x1010, 3));
    assert!(
        b.slices().is_none() && b.slices_mut().is_none(),
        "no references to guest memory"
    );
    let mut out = [0u8; 4];
    assert!(b.copy_out(0x7fe, &mut out));
    assert_eq!(out, [9; 4]);
    assert!(b.copy_in(0x7ff, &[1, 2]));
    assert!(b.fill_zero(0x1000, 16));
    let mut back = [0u8; 3];
    mem.read_slice(&mut back, GuestAddress(0xffff)).unwrap();
    assert_eq!(back, [1, 2, 9]);

    let mut file = tempfile::tempfile().unwrap();
    file.write_all(&[5u8; 0x1010]).unwrap();
    let Ok(mut ring) = QueueRing::new(2) else {
        return;
    };
    ring.read(file.as_fd(), 0, &mut b, 0, 0x1010, 1).unwrap();
    ring.submit().unwrap();
    ring.wait().unwrap();
    let mut res = Vec::new();
    ring.reap(|c| res.push(c.result));
    assert_eq!(res, [0x1010]);
    let mut seen = vec![0u8; 0x1000];
    mem.read_slice(&mut seen, GuestAddress(0xf800)).unwrap();
    assert!(
        seen.iter().all(|&x| x == 5),
        "the kernel wrote the guest's memory in place"
    );
    // Out of the guest's memory: refused, naming the address.
    let err = IoBuffers::from_guest(mem, &[(0x1_f000, 0x2000)]).unwrap_err();
    assert!(err.to_string().contains("0x1f000"), "{err}");
}

#[test]
fn a_polling_wait_sees_completions_without_sleeping_first() {
    let mut file = tempfile::tempfile().unwrap();
    file.write_all(&[5u8; 65536]).unwrap();
    let Ok(mut ring) = QueueRing::new(4) else {
        eprintln!("SKIPPED: io_uring unavailable");
        return;
    };
    ring.set_poll(std::time::Duration::from_micros(500));
    assert_eq!(ring.poll(), std::time::Duration::from_micros(500));
    for k in 0..16u64 {
        let mut back = IoBuffers::from_vec(vec![0u8; 4096]);
        // Queued only: the polling wait hands it to the kernel itself.
        ring.read(file.as_fd(), k * 4096, &mut back, 0, 4096, k)
            .unwrap();
        ring.wait().unwrap();
        let mut seen = Vec::new();
        // The wait returned, so the completion is there (polled, or after sleeping).
        ring.reap(|c| seen.push(c));
        assert_eq!(seen.len(), 1, "request {k}");
        assert_eq!(seen[0].token, k);
        assert_eq!(seen[0].result, 4096);
        let owner = back.into_owner().unwrap().unwrap();
        let v = owner.downcast::<Vec<u8>>().unwrap();
        assert!(v.iter().all(|&b| b == 5));
    }
    assert_eq!(ring.in_flight(), 0);
    // Nothing in flight: the wait returns at once, polling or not.
    ring.wait().unwrap();
}

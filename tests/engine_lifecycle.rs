//! An embedder's lifecycle without async: synchronous open and close (`open_blocking`), the
//! clean timer on a thread of the image's own, and `close_on_drop`.

mod common;

use std::time::Duration;

use common::{Scratch, assert_clean, assert_same_as_model, have_qemu, qemu_create};
use qimg::{CacheOptions, OpenOptions};

const MIB: u64 = 1 << 20;

#[test]
fn the_clean_timer_runs_without_a_runtime_of_the_callers() {
    let dir = Scratch::new("timer");
    qimg_testkit::require_qemu!();
    qemu_create(&dir.0, "a.qcow2", "cluster_size=64k", 64 * MIB, None);
    let cache = CacheOptions {
        cache_clean_interval: Some(1),
        ..Default::default()
    };
    let img = OpenOptions::new()
        .writable(true)
        .cache(cache)
        .open_blocking(dir.path("a.qcow2"))
        .unwrap();
    for i in 0..16 {
        img.write(&[1u8; 4096], i * 4 * MIB).unwrap();
    }
    assert!(img.stats().l2_cache.entries > 0);
    // Nobody calls into the image now: only the timer's own thread can empty the cache.
    // With a 1 s clean interval the cache empties within about 2 s.
    let guard = qimg_testkit::HangGuard::start(
        "the clean timer emptying the L2 cache",
        Duration::from_secs(2),
        Duration::from_secs(20),
    );
    while img.stats().l2_cache.entries > 0 {
        guard.check();
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(img.stats().l2_cache.idle_drops > 0);
    img.close().unwrap();
    assert_clean(&dir.0, "a.qcow2", "clean timer thread");
}

#[test]
fn close_on_drop_flushes_and_releases_the_image() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("drop-close");
    qemu_create(
        &dir.0,
        "a.qcow2",
        "extended_l2=on,cluster_size=64k,lazy_refcounts=on",
        8 * MIB,
        None,
    );
    let mut model = vec![0u8; 8 * MIB as usize];
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let img = OpenOptions::new()
            .writable(true)
            .close_on_drop(true)
            .open(dir.path("a.qcow2"))
            .await
            .unwrap();
        for i in 0..20u64 {
            let at = i * 300_000;
            img.write(&[i as u8 + 1; 5000], at).await.unwrap();
            model[at as usize..at as usize + 5000].fill(i as u8 + 1);
        }
        // Dropped inside an async task, without flush or close.
        drop(img);
    });
    // Closed: unlocked, clean (lazy refcounts: the dirty bit is cleared), data durable.
    assert_clean(&dir.0, "a.qcow2", "close on drop");
    assert_same_as_model(&dir.0, "a.qcow2", &model, "close on drop");
}

/// A VMM that opened the disk itself: `qimg::probe` reads what the image is from its
/// descriptor (what qemu-img info says), and `OpenOptions::open_file` works on that same
/// descriptor (no second open by name), resolving the backing file next to `name`.
#[test]
fn a_vmm_probes_and_opens_its_own_descriptor() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("open-file");
    common::qemu_create(&dir.0, "base.qcow2", "cluster_size=64k", 4 << 20, None);
    common::qemu_io(&dir.0, "qcow2", "base.qcow2", &["write -P 3 0 1M"]);
    common::qemu_create(
        &dir.0,
        "top.qcow2",
        "extended_l2=on,cluster_size=128k",
        4 << 20,
        Some(("base.qcow2", "qcow2")),
    );
    common::qemu_io(&dir.0, "qcow2", "top.qcow2", &["write -P 4 64k 4k"]);
    std::fs::write(dir.path("raw.img"), vec![0u8; 8192]).unwrap();
    let raw = std::fs::File::open(dir.path("raw.img")).unwrap();
    assert_eq!(qimg::probe(&raw).unwrap(), None);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.path("top.qcow2"))
        .unwrap();
    let p = qimg::probe(&file).unwrap().expect("a qcow2 image");
    // The same through an O_DIRECT descriptor, as VMMs open their disks (the probe's reads
    // must be aligned in memory, offset and length).
    let direct = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_DIRECT)
            .open(dir.path("top.qcow2"))
            .unwrap()
    };
    assert_eq!(qimg::probe(&direct).unwrap().as_ref(), Some(&p));
    let info = common::info(&dir.0, "top.qcow2");
    assert_eq!(p.version, 3);
    assert!(p.extended_l2);
    assert_eq!(p.cluster_size, info["cluster-size"].as_u64().unwrap());
    assert_eq!(p.size, info["virtual-size"].as_u64().unwrap());
    assert_eq!(p.backing_file.as_deref(), Some("base.qcow2"));
    assert_eq!(p.backing_format.as_deref(), Some("qcow2"));
    assert_eq!(p.data_file, None);
    let img = OpenOptions::new()
        .writable(true)
        .open_file_blocking(file, dir.path("top.qcow2"))
        .unwrap();
    let mut buf = vec![0u8; 8192];
    img.read(&mut buf, 60 * 1024).unwrap();
    assert!(buf[..4096].iter().all(|&b| b == 3), "from the backing file");
    assert!(buf[4096..].iter().all(|&b| b == 4), "from the image");
    img.write(&[5u8; 4096], 1 << 20).unwrap();
    img.close().unwrap();
    common::assert_clean(&dir.0, "top.qcow2", "open_file");
    // A descriptor opened read-only cannot give a writable image.
    let ro = std::fs::File::open(dir.path("top.qcow2")).unwrap();
    let e = match OpenOptions::new()
        .writable(true)
        .open_file_blocking(ro, dir.path("top.qcow2"))
    {
        Ok(_) => panic!("a writable image on a read-only descriptor"),
        Err(e) => e,
    };
    assert!(e.to_string().contains("read-only"), "{e}");
}

/// A whole-file write lock as cloud-hypervisor takes it on its disk's descriptor
/// (`F_OFD_SETLK`, `F_WRLCK`, start 0, length 0).
fn vmm_whole_file_lock(f: &std::fs::File) -> nix::Result<()> {
    use nix::fcntl::{FcntlArg, fcntl};
    let lock = nix::libc::flock {
        l_type: nix::libc::F_WRLCK as nix::libc::c_short,
        l_whence: nix::libc::SEEK_SET as nix::libc::c_short,
        l_start: 0,
        l_len: 0,
        l_pid: 0,
    };
    fcntl(f, FcntlArg::F_OFD_SETLK(&lock)).map(drop)
}

/// Issue 33: qimg's QEMU-compatible lock on a descriptor the VMM opened (and locked whole, as
/// cloud-hypervisor does) refuses qemu-io's and qemu-img's writers with QEMU's words; the
/// VMM's own lock coexists on the same open file description (another VMM is still refused,
/// `qemu-img info -U` still reads), and closing the image gives the VMM its whole lock back.
#[test]
fn a_vmm_descriptor_holds_qemus_lock_beside_its_own_whole_file_lock() {
    let name = "a_vmm_descriptor_holds_qemus_lock_beside_its_own_whole_file_lock";
    if !have_qemu(name) {
        return;
    }
    let dir = Scratch::new("vmm-lock");
    qemu_create(&dir.0, "d.qcow2", "extended_l2=on", 4 * MIB, None);
    let path = dir.path("d.qcow2");
    let open = || {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap()
    };
    let qemu_io_write =
        || common::run(&dir.0, "qemu-io".as_ref(), &["-c", "write 0 4k", "d.qcow2"]);
    let qemu_img = |args: &[&str]| common::qemu_img(&dir.0, args);
    let refused = |o: &std::process::Output, what: &str| {
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(!o.status.success(), "{what} was let in");
        err
    };
    // The VMM's lock alone: QEMU's tools cannot take their byte locks, and say so in words
    // that name no holder; `-U` takes no lock and reads.
    let vmm = open();
    vmm_whole_file_lock(&vmm).unwrap();
    let e = refused(&qemu_io_write(), "qemu-io beside a whole-file lock");
    assert!(e.contains("Failed to lock byte 100"), "{e}");
    common::ok("qemu-img info -U", &qemu_img(&["info", "-U", "d.qcow2"]));
    // qimg on the VMM's descriptor (a duplicate: the same open file description).
    let img = OpenOptions::new()
        .writable(true)
        .open_file_blocking(vmm.try_clone().unwrap(), &path)
        .unwrap();
    img.write(&[7u8; 4096], 0).unwrap();
    let e = refused(&qemu_io_write(), "qemu-io's writer");
    assert!(e.contains("Failed to get \"write\" lock"), "{e}");
    let e = refused(&qemu_img(&["resize", "d.qcow2", "8M"]), "qemu-img resize");
    assert!(e.contains("Failed to get \"write\" lock"), "{e}");
    let e = refused(&qemu_img(&["info", "d.qcow2"]), "qemu-img info without -U");
    assert!(e.contains("Failed to get shared \"write\" lock"), "{e}");
    common::ok("qemu-img info -U", &qemu_img(&["info", "-U", "d.qcow2"]));
    // The VMM's lock still guards the rest of the file: another VMM is refused.
    assert!(
        vmm_whole_file_lock(&open()).is_err(),
        "a second VMM was let in"
    );
    img.close().unwrap();
    // Closed: the VMM's lock is whole again (not holed at QEMU's bytes).
    let e = refused(&qemu_io_write(), "qemu-io's writer after close");
    assert!(e.contains("Failed to lock byte 100"), "{e}");
    assert!(
        vmm_whole_file_lock(&open()).is_err(),
        "a second VMM was let in"
    );
    drop(vmm);
    assert_clean(&dir.0, "d.qcow2", "vmm lock");
    assert_same_as_model(
        &dir.0,
        "d.qcow2",
        &{
            let mut m = vec![0u8; 4 * MIB as usize];
            m[..4096].fill(7);
            m
        },
        "vmm lock",
    );
}

/// The threads of this process whose name starts with `qimg-`, as `(thread id, name)`.
fn qimg_threads() -> std::collections::BTreeSet<(u64, String)> {
    let mut out = std::collections::BTreeSet::new();
    for e in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let Ok(tid) = e.file_name().to_string_lossy().parse::<u64>() else {
            continue;
        };
        let Ok(comm) = std::fs::read_to_string(e.path().join("comm")) else {
            continue; // ended meanwhile
        };
        let comm = comm.trim().to_string();
        if comm.starts_with("qimg-") {
            out.insert((tid, comm));
        }
    }
    out
}

/// The calling thread's id, from `/proc/thread-self` (`PID/task/TID`).
fn thread_id() -> u64 {
    let link = std::fs::read_link("/proc/thread-self").unwrap();
    link.file_name().unwrap().to_string_lossy().parse().unwrap()
}

/// Issue 33: a VMM that filters its threads' system calls registers a start hook, and every
/// thread qimg starts (the io_uring completion thread, a queue's engine thread, the clean
/// timer, the close of an image dropped with `close_on_drop`) calls it first, on itself,
/// under the name the docs list.
#[test]
fn every_thread_qimg_starts_calls_the_embedders_start_hook_first() {
    let name = "every_thread_qimg_starts_calls_the_embedders_start_hook_first";
    if !have_qemu(name) {
        return;
    }
    use std::sync::{Arc, Mutex};
    let dir = Scratch::new("thread-hook");
    qemu_create(&dir.0, "a.qcow2", "extended_l2=on", 8 * MIB, None);
    let seen: Arc<Mutex<Vec<(u64, String)>>> = Arc::default();
    let record = seen.clone();
    // Other tests of this binary run meanwhile: their threads call the hook too, which is
    // harmless here (only recorded).
    qimg::io::threads::set_start_hook(move |name| {
        record.lock().unwrap().push((thread_id(), name.to_string()));
    });
    let before = qimg_threads();
    let cache = CacheOptions {
        cache_clean_interval: Some(1),
        ..Default::default()
    };
    let img = OpenOptions::new()
        .writable(true)
        .backend(qimg::io::Backend::IoUring)
        .cache(cache)
        .close_on_drop(true)
        .open_blocking(dir.path("a.qcow2"))
        .expect("io_uring must work here");
    let mut queue = img.as_async().queue(qimg::QueueOptions::new()).unwrap();
    queue.submit(qimg::Request::Flush, 1).unwrap();
    queue.wait().unwrap();
    assert!(queue.next_completed().unwrap().result.is_ok());
    img.write(&[9u8; 65536], 0).unwrap();
    let during = qimg_threads();
    drop(queue);
    // Dropped without close: `close_on_drop` closes it on a `qimg-close` thread.
    drop(img);
    qimg::io::threads::clear_start_hook();
    let seen = seen.lock().unwrap().clone();
    let new: Vec<_> = during.difference(&before).cloned().collect();
    assert!(!new.is_empty(), "no qimg thread started");
    for (tid, comm) in &new {
        assert!(
            seen.iter().any(|(t, n)| t == tid && n == comm),
            "thread {tid} ({comm}) did not call the start hook; seen: {seen:?}"
        );
    }
    let names: std::collections::BTreeSet<&str> = seen.iter().map(|(_, n)| n.as_str()).collect();
    for want in ["qimg-uring", "qimg-queue", "qimg-clean", "qimg-close"] {
        assert!(
            names.contains(want),
            "no {want} thread called the hook: {names:?}"
        );
    }
    assert_clean(&dir.0, "a.qcow2", "start hook");
}

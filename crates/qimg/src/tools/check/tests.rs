//! The check's unit tests: on files through [`check`], and on memory through
//! [`check_storage`].

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use qimg_io::{MemStorage, Storage};

use super::*;
use crate::tools::create::{CreateOptions, create};

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("qimg-check-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The report and the diagnostic lines of one check (`run_check` gets the options and the
/// event sink).
fn with_messages(
    repair: Option<Repair>,
    run_check: impl FnOnce(&CheckOptions, &mut dyn FnMut(CheckEvent<'_>)) -> Result<CheckReport>,
) -> (CheckReport, Vec<String>) {
    let mut lines = Vec::new();
    let opts = CheckOptions {
        repair,
        ..Default::default()
    };
    let r = run_check(&opts, &mut |e| {
        if let CheckEvent::Message(m) = e {
            lines.push(m.to_string());
        }
    })
    .unwrap();
    (r, lines)
}

fn run(path: &Path, repair: Option<Repair>) -> (CheckReport, Vec<String>) {
    with_messages(repair, |opts, events| check(path, opts, events))
}

fn set_refcount16(path: &Path, cluster: u64, value: u16) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8; 8];
    f.read_exact_at(&mut b, 48).unwrap();
    let rt = u64::from_be_bytes(b);
    f.read_exact_at(&mut b, rt).unwrap();
    let block = u64::from_be_bytes(b);
    f.write_all_at(&value.to_be_bytes(), block + cluster * 2)
        .unwrap();
}

#[test]
fn a_fresh_image_checks_clean_and_a_leak_is_found_and_freed() {
    let d = scratch("leak");
    let p = d.join("a.qcow2");
    let o = CreateOptions {
        size: Some(64 << 20),
        ..Default::default()
    };
    create(&p, &o, &mut |_, _| {}).unwrap();
    let (r, lines) = run(&p, None);
    assert_eq!(
        (r.corruptions, r.leaks, r.check_errors),
        (0, 0, 0),
        "{lines:?}"
    );
    assert_eq!(r.total_clusters, 1024);
    assert_eq!(r.image_end_offset, 0x40000);
    // Cluster 5 is past the end of a fresh image; extend the file so it counts.
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(0x60000).unwrap();
    set_refcount16(&p, 5, 1);
    let (r, lines) = run(&p, None);
    assert_eq!(
        (r.corruptions, r.leaks, r.exit_code()),
        (0, 1, 3),
        "{lines:?}"
    );
    assert_eq!(lines, vec!["Leaked cluster 5 refcount=1 reference=0"]);
    let (r, _) = run(&p, Some(Repair::Leaks));
    assert_eq!((r.leaks, r.leaks_fixed, r.exit_code()), (0, 1, 0));
    let (r, _) = run(&p, None);
    assert_eq!((r.corruptions, r.leaks), (0, 0));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_refcount_of_zero_needs_a_rebuild_which_repairs_it() {
    let d = scratch("rebuild");
    let p = d.join("a.qcow2");
    let o = CreateOptions {
        size: Some(64 << 20),
        ..Default::default()
    };
    create(&p, &o, &mut |_, _| {}).unwrap();
    // The L1 table (cluster 3) loses its refcount.
    set_refcount16(&p, 3, 0);
    let (r, lines) = run(&p, None);
    assert_eq!((r.corruptions, r.exit_code()), (1, 2), "{lines:?}");
    let (r, lines) = run(&p, Some(Repair::Leaks));
    assert_eq!(r.failure.as_deref(), Some(EIO), "{lines:?}");
    let (r, lines) = run(&p, Some(Repair::All));
    assert!(
        lines.iter().any(|l| l == "Rebuilding refcount structure"),
        "{lines:?}"
    );
    assert_eq!(
        (r.corruptions, r.leaks, r.check_errors),
        (0, 0, 0),
        "{lines:?}"
    );
    assert_eq!(r.corruptions_fixed, 1);
    let (r, lines) = run(&p, None);
    assert_eq!(
        (r.corruptions, r.leaks, r.check_errors),
        (0, 0, 0),
        "{lines:?}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[cfg(feature = "json")]
#[test]
fn json_leaves_out_zero_counters_but_not_check_errors() {
    let r = CheckReport {
        image_end_offset: 65536,
        total_clusters: 16,
        filename: "a".into(),
        format: "qcow2".into(),
        ..Default::default()
    };
    let v = serde_json::to_value(&r).unwrap();
    let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "image-end-offset",
            "total-clusters",
            "check-errors",
            "filename",
            "format"
        ]
    );
}

/// Runs `check_storage` on `storage` to completion on a current-thread runtime.
fn run_on(storage: &MemStorage, repair: Option<Repair>) -> (CheckReport, Vec<String>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    with_messages(repair, |opts, events| {
        rt.block_on(check_storage(storage, Path::new("mem.qcow2"), opts, events))
    })
}

#[test]
fn a_leak_in_an_image_in_memory_is_found_and_repaired() {
    let d = scratch("mem");
    let p = d.join("a.qcow2");
    let o = CreateOptions {
        size: Some(64 << 20),
        ..Default::default()
    };
    create(&p, &o, &mut |_, _| {}).unwrap();
    // Grow the file so that cluster 5 lies inside it, then give it a refcount nothing uses.
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(0x60000).unwrap();
    set_refcount16(&p, 5, 1);
    let storage = MemStorage::from_bytes(&std::fs::read(&p).unwrap());
    let _ = std::fs::remove_dir_all(&d);

    let (r, lines) = run_on(&storage, None);
    assert_eq!((r.leaks, r.exit_code()), (1, 3), "{lines:?}");
    assert_eq!(lines, vec!["Leaked cluster 5 refcount=1 reference=0"]);
    assert_eq!(r.filename, "mem.qcow2");

    let (r, lines) = run_on(&storage, Some(Repair::Leaks));
    assert_eq!(
        (r.leaks, r.leaks_fixed, r.exit_code()),
        (0, 1, 0),
        "{lines:?}"
    );
    let (r, lines) = run_on(&storage, None);
    assert_eq!(
        (r.corruptions, r.leaks, r.check_errors),
        (0, 0, 0),
        "{lines:?}"
    );
}

#[test]
fn a_read_only_storage_is_checked_but_not_repaired() {
    let d = scratch("mem-ro");
    let p = d.join("a.qcow2");
    let o = CreateOptions {
        size: Some(1 << 20),
        ..Default::default()
    };
    create(&p, &o, &mut |_, _| {}).unwrap();
    let storage = MemStorage::from_bytes(&std::fs::read(&p).unwrap()).read_only();
    let _ = std::fs::remove_dir_all(&d);
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    assert!(rt.block_on(storage.len()).unwrap() > 0);
    let (r, lines) = run_on(&storage, None);
    assert_eq!(
        (r.corruptions, r.leaks, r.exit_code()),
        (0, 0, 0),
        "{lines:?}"
    );
}

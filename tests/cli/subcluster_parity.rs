//! What QEMU's tools leave in an image, subcluster by subcluster, compared with ours on the
//! same steps: the L2 entries and their allocation bitmaps (read raw with `qemu-io -f raw
//! read -v`), `map` and `check`. Covers what the allocation does beyond the guest data a
//! compare sees: `commit` (QEMU's mirror job copies whole chunks of its granularity),
//! `convert` (an extent's trailing zeros stay out).

use crate::common::*;
use crate::qemu_dropin::{Ours, Prep, side_by_side};

/// The L2 entry (with its bitmap) of guest cluster `index` of a fresh image whose first L2
/// table is at `l2`, in qemu-io's hex dump.
fn dump_entry(l2: u64, index: u64) -> String {
    format!("read -v {} 16", l2 + index * 16)
}

#[test]
fn commit_leaves_the_base_allocated_as_qemus_mirror_job_does() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("commit-granularity");
    let ours = Ours::new(&s);
    let prepare: Prep = &[
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "extended_l2=on",
                "a.qcow2",
                "4M",
            ],
        ),
        ("qemu-io", &["-c", "write -P 2 0 4M", "a.qcow2"]),
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "extended_l2=on",
                "-b",
                "a.qcow2",
                "-F",
                "qcow2",
                "b.qcow2",
            ],
        ),
        (
            "qemu-io",
            &[
                "-c",
                "write -z 0 64k",
                "-c",
                "write -z 128k 128k",
                "-c",
                "write -z 1M 4k",
                "-c",
                "write -z -u 2M 64k",
                "-c",
                "write -z 3M 60k",
                "-c",
                "write -P 5 3200k 1k",
                "b.qcow2",
            ],
        ),
        // A second chain: a base with data in part of two clusters, an overlay with 4 KiB
        // clusters writing 1 KiB into each.
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "extended_l2=on",
                "c.qcow2",
                "4M",
            ],
        ),
        (
            "qemu-io",
            &[
                "-c",
                "write -P 1 1k 3k",
                "-c",
                "write -P 1 200k 3k",
                "c.qcow2",
            ],
        ),
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "cluster_size=4k",
                "-b",
                "c.qcow2",
                "-F",
                "qcow2",
                "d.qcow2",
            ],
        ),
        (
            "qemu-io",
            &[
                "-c",
                "write -P 3 2k 1k",
                "-c",
                "write -z 200k 1k",
                "d.qcow2",
            ],
        ),
    ];
    let a = [0u64, 2, 3, 16, 32, 48, 50].map(|i| dump_entry(0x40000, i));
    let c = [0u64, 3].map(|i| dump_entry(0x40000, i));
    let mut dump_a: Vec<&str> = Vec::new();
    for cmd in &a {
        dump_a.extend(["-c", cmd.as_str()]);
    }
    dump_a.extend(["-f", "raw", "a.qcow2"]);
    let mut dump_c: Vec<&str> = Vec::new();
    for cmd in &c {
        dump_c.extend(["-c", cmd.as_str()]);
    }
    dump_c.extend(["-f", "raw", "c.qcow2"]);
    let steps: Prep = &[
        (
            "qemu-img",
            &["convert", "-O", "raw", "b.qcow2", "before.raw"],
        ),
        ("qemu-img", &["commit", "b.qcow2"]),
        ("qemu-io", &dump_a),
        ("qemu-img", &["map", "--output=json", "a.qcow2"]),
        ("qemu-img", &["compare", "a.qcow2", "before.raw"]),
        ("qemu-img", &["check", "a.qcow2"]),
        ("qemu-img", &["commit", "d.qcow2"]),
        ("qemu-io", &dump_c),
        ("qemu-img", &["map", "--output=json", "c.qcow2"]),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    // The partial zero write at 1 MiB became a whole cluster of data in the base.
    assert!(
        outs[0].contains("\"start\": 262144, \"length\": 1835008"),
        "{}",
        outs[0]
    );
}

#[test]
fn convert_leaves_an_extents_trailing_zeros_out_as_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("convert-trailing-zeros");
    let ours = Ours::new(&s);
    let prepare: Prep = &[
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "extended_l2=on",
                "a.qcow2",
                "4M",
            ],
        ),
        // 33 KiB of data: the base allocates 17 subclusters, the last half zeros.
        (
            "qemu-io",
            &[
                "-c",
                "write -P 1 1k 3k",
                "-c",
                "write -P 2 1M 33k",
                "a.qcow2",
            ],
        ),
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "extended_l2=on",
                "-b",
                "a.qcow2",
                "-F",
                "qcow2",
                "b.qcow2",
            ],
        ),
        (
            "qemu-io",
            &[
                "-c",
                "write -P 3 2k 2k",
                "-c",
                "write -z 1M 4k",
                "-c",
                "discard 1028k 4k",
                "b.qcow2",
            ],
        ),
    ];
    let d = [0u64, 16].map(|i| dump_entry(0x50000, i));
    let mut dump: Vec<&str> = Vec::new();
    for cmd in &d {
        dump.extend(["-c", cmd.as_str()]);
    }
    dump.extend(["-f", "raw", "d.qcow2"]);
    let steps: Prep = &[
        (
            "qemu-img",
            &[
                "convert",
                "-O",
                "qcow2",
                "-o",
                "extended_l2=on",
                "b.qcow2",
                "d.qcow2",
            ],
        ),
        ("qemu-img", &["map", "--output=json", "d.qcow2"]),
        ("qemu-io", &dump),
        ("qemu-img", &["compare", "b.qcow2", "d.qcow2"]),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(
        outs[0].contains("\"start\": 1052672, \"length\": 30720"),
        "{}",
        outs[0]
    );
}

#[test]
fn a_write_after_a_snapshot_copies_the_l2_table_before_the_data_as_qemu() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("l2-copy-first");
    let ours = Ours::new(&s);
    let prepare: Prep = &[
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "extended_l2=on",
                "t.qcow2",
                "4M",
            ],
        ),
        ("qemu-io", &["-c", "write -P 3 4k 4k", "t.qcow2"]),
        ("qemu-img", &["snapshot", "-c", "s1", "t.qcow2"]),
    ];
    let steps: Prep = &[
        // The L2 table is shared with the snapshot: the write copies it, then allocates the
        // data cluster after it (8 KiB written: the file ends there).
        ("qemu-io", &["-c", "write -P 4 0 4k", "t.qcow2"]),
        ("qemu-img", &["map", "--output=json", "t.qcow2"]),
        (
            "qemu-io",
            &["-f", "raw", "-c", "read -v 0x30000 8", "t.qcow2"],
        ),
        // (Not `info`: it shows the snapshot's date, which differs by a second at times.)
        ("qemu-io", &["-f", "raw", "-c", "length", "t.qcow2"]),
        ("qemu-img", &["check", "t.qcow2"]),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(outs[0].contains("584 KiB"), "{}", outs[0]);
}

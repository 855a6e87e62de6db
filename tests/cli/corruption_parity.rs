//! Damaged images as QEMU's tools meet them (iotest 060's cases): what opens, which request
//! finds the damage, the words of the corruption event, and that the image is unusable
//! afterwards (every request fails with "No medium found", as QEMU's ejected driver) and
//! marked corrupt. Side by side with qemu-img and qemu-io, output compared.

use crate::common::*;
use crate::qemu_dropin::{Ours, Prep, side_by_side};

#[test]
fn a_corrupt_bitmap_makes_the_image_unusable_as_qemu_does() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("unusable-after-corruption");
    let ours = Ours::new(&s);
    // Subcluster 0 of cluster 0 both allocated and zero: bytes 3 and 7 of the bitmap.
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
                "1M",
            ],
        ),
        (
            "qemu-io",
            &[
                "-c",
                "write -P 1 0 64k",
                "-c",
                "write -P 2 64k 4k",
                "a.qcow2",
            ],
        ),
        (
            "qemu-io",
            &[
                "-f",
                "raw",
                "-c",
                "write -P 1 0x4000b 1",
                "-c",
                "write -P 1 0x4000f 1",
                "a.qcow2",
            ],
        ),
    ];
    let steps: Prep = &[
        // Read-only: reported once, not marked, the rest of the image still reads.
        (
            "qemu-io",
            &[
                "-r",
                "-c",
                "read 0 2k",
                "-c",
                "read 64k 2k",
                "-c",
                "read 0 2k",
                "a.qcow2",
            ],
        ),
        (
            "qemu-io",
            &[
                "-c",
                "read 0 2k",
                "-c",
                "read 64k 2k",
                "-c",
                "write 128k 4k",
                "-c",
                "write -z 192k 4k",
                "-c",
                "discard 256k 4k",
                "-c",
                "flush",
                "-c",
                "map",
                "-c",
                "alloc 0 64k",
                "-c",
                "info",
                "-c",
                "length",
                "-c",
                "truncate 2M",
                "-c",
                "aio_write 0 4k",
                "-c",
                "aio_flush",
                "-c",
                "readv 64k 512",
                "-c",
                "write -c 0 64k",
                "-c",
                "write -b 0 512",
                "a.qcow2",
            ],
        ),
        ("qemu-img", &["info", "a.qcow2"]),
        ("qemu-img", &["check", "a.qcow2"]),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(
        outs[0].contains("read failed: No medium found"),
        "{}",
        outs[0]
    );
    assert!(
        outs[0].contains("found  (L2 offset: 0x40000"),
        "{}",
        outs[0]
    );
}

/// `qemu-io -f raw` steps that write the 8 bytes of `value` at `at`.
fn poke_u64(at: u64, value: u64) -> Vec<String> {
    let mut v = Vec::new();
    for (i, b) in value.to_be_bytes().iter().enumerate() {
        v.push("-c".to_string());
        v.push(format!("write -P {b} {} 1", at + i as u64));
    }
    v
}

#[test]
fn metadata_pointing_at_metadata_is_found_by_the_first_write_as_qemu_finds_it() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("metadata-overlaps");
    let ours = Ours::new(&s);
    // A 64 MiB image with one write: refcount table at 0x10000, refcount block at 0x20000,
    // L1 table at 0x30000, L2 table at 0x40000.
    let cases: [(&str, u64, u64, &str); 3] = [
        (
            "l1-into-l1",
            0x30000,
            0x8000_0000_0003_0000,
            "write -P 2 0 512",
        ),
        (
            "l2-into-l2",
            0x40000,
            0x8000_0000_0004_0000,
            "write -P 2 0 512",
        ),
        (
            "refblock-onto-reftable",
            0x10000,
            0x0000_0000_0001_0000,
            "write 64k 512",
        ),
    ];
    for (name, at, value, write) in cases {
        let mut poke: Vec<String> = vec!["-f".into(), "raw".into()];
        poke.extend(poke_u64(at, value));
        poke.push("t.qcow2".into());
        let poke: Vec<&str> = poke.iter().map(String::as_str).collect();
        let prepare: Prep = &[
            ("qemu-img", &["create", "-f", "qcow2", "t.qcow2", "64M"]),
            ("qemu-io", &["-c", "write -P 1 0 512", "t.qcow2"]),
            ("qemu-io", &poke),
        ];
        let steps: Prep = &[
            ("qemu-img", &["check", "t.qcow2"]),
            ("qemu-io", &["-c", write, "-c", "read 0 512", "t.qcow2"]),
            ("qemu-img", &["info", "t.qcow2"]),
            ("qemu-io", &["-c", "read 0 512", "t.qcow2"]),
            ("qemu-io", &["-r", "-c", "read 0 512", "t.qcow2"]),
        ];
        let outs = side_by_side(&s, &ours, &[], prepare, steps);
        assert_eq!(
            outs[1], outs[0],
            "{name}: qimg (left) differs from QEMU (right)"
        );
        assert!(
            outs[0].contains("Preventing invalid write on metadata"),
            "{name}: {}",
            outs[0]
        );
    }
}

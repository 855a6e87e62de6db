//! `qimg check` against `qemu-img check`: the same counters, JSON, messages and exit codes on
//! clean images of every kind and on images damaged at test time (bytes of qemu-made images
//! edited at offsets computed from their headers); after `qimg check -r all`, `qemu-img check`
//! finds nothing and the guest data that was intact is unchanged.

use crate::common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Output;

use common::qemu_raw;
use common::{Scratch, add_bitmaps, ok, qemu_img, qemu_img_create, qimg};
use qimg::format::refcount;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const L1E_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
const COPIED: u64 = 1 << 63;
const COMPRESSED: u64 = 1 << 62;

/// `qemu-io -f qcow2 -c CMD... FILE`, which must succeed.
fn qemu_io(dir: &Path, file: &str, cmds: &[&str]) {
    common::qemu_io(dir, "qcow2", file, cmds);
}

/// `qemu-img create -f qcow2 [-o OPTS] FILE SIZE`.
fn create(dir: &Path, opts: &str, file: &str, size: &str) {
    qemu_img_create(dir, "qcow2", opts, &[], file, size);
}

/// A qcow2 file whose metadata the tests edit in place.
struct Img {
    path: PathBuf,
    cs: u64,
    extended: bool,
    l1: u64,
    reftable: u64,
    order: u32,
}

impl Img {
    fn open(path: &Path) -> Self {
        let f = std::fs::File::open(path).unwrap();
        let mut h = [0u8; 112];
        f.read_exact_at(&mut h, 0).unwrap();
        let be32 = |o: usize| u32::from_be_bytes(h[o..o + 4].try_into().unwrap());
        let be64 = |o: usize| u64::from_be_bytes(h[o..o + 8].try_into().unwrap());
        let version = be32(4);
        Self {
            path: path.to_path_buf(),
            cs: 1 << be32(20),
            extended: version >= 3 && be64(72) & (1 << 4) != 0,
            l1: be64(40),
            reftable: be64(48),
            order: if version >= 3 { be32(96) } else { 4 },
        }
    }

    fn r64(&self, off: u64) -> u64 {
        let mut b = [0u8; 8];
        std::fs::File::open(&self.path)
            .unwrap()
            .read_exact_at(&mut b, off)
            .unwrap();
        u64::from_be_bytes(b)
    }

    fn w64(&self, off: u64, v: u64) {
        self.write(off, &v.to_be_bytes());
    }

    fn write(&self, off: u64, b: &[u8]) {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&self.path)
            .unwrap()
            .write_all_at(b, off)
            .unwrap();
    }

    fn len(&self) -> u64 {
        std::fs::metadata(&self.path).unwrap().len()
    }

    fn set_len(&self, len: u64) {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&self.path)
            .unwrap()
            .set_len(len)
            .unwrap();
    }

    fn entry_size(&self) -> u64 {
        if self.extended { 16 } else { 8 }
    }

    /// File offset of L1 entry `i`.
    fn l1_entry(&self, i: u64) -> u64 {
        self.l1 + i * 8
    }

    /// File offset of the L2 entry mapping guest offset `guest`.
    fn l2_entry(&self, guest: u64) -> u64 {
        let per_table = self.cs / self.entry_size();
        let cluster = guest / self.cs;
        let table = self.r64(self.l1_entry(cluster / per_table)) & L1E_OFFSET_MASK;
        assert_ne!(table, 0, "guest offset {guest:#x} has no L2 table");
        table + (cluster % per_table) * self.entry_size()
    }

    /// The host cluster index guest offset `guest` is mapped to.
    fn host_cluster(&self, guest: u64) -> u64 {
        (self.r64(self.l2_entry(guest)) & L1E_OFFSET_MASK) / self.cs
    }

    /// (file offset of the refcount block, index in it) of host cluster `c`.
    fn refcount_slot(&self, c: u64) -> (u64, u64) {
        let per_block = (self.cs * 8) >> self.order;
        let block = self.r64(self.reftable + c / per_block * 8);
        assert_ne!(block, 0, "cluster {c} has no refcount block");
        (block, c % per_block)
    }

    fn refcount(&self, c: u64) -> u64 {
        let (block, i) = self.refcount_slot(c);
        let mut b = vec![0u8; self.cs as usize];
        std::fs::File::open(&self.path)
            .unwrap()
            .read_exact_at(&mut b, block)
            .unwrap();
        refcount::get(&b, self.order, i).unwrap()
    }

    fn set_refcount(&self, c: u64, v: u64) {
        let (block, i) = self.refcount_slot(c);
        let mut b = vec![0u8; self.cs as usize];
        std::fs::File::open(&self.path)
            .unwrap()
            .read_exact_at(&mut b, block)
            .unwrap();
        refcount::set(&mut b, self.order, i, v).unwrap();
        self.write(block, &b);
    }
}

/// The JSON of a check (whatever the exit code) and the exit code.
fn check_json(o: &Output, what: &str) -> (serde_json::Value, i32) {
    let v = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "{what}: no JSON ({e}), exit {:?}:\n{}{}",
            o.status.code(),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    });
    (v, o.status.code().unwrap_or(-1))
}

/// stderr lines without the program name.
fn diagnostics(o: &Output) -> Vec<String> {
    String::from_utf8_lossy(&o.stderr)
        .lines()
        .map(|l| {
            l.strip_prefix("qemu-img: ")
                .or_else(|| l.strip_prefix("qimg: "))
                .unwrap_or(l)
                .to_string()
        })
        .collect()
}

fn count(v: &serde_json::Value, field: &str) -> u64 {
    v.get(field).and_then(|x| x.as_u64()).unwrap_or(0)
}

/// Both tools on `file` (read-only): same exit code, JSON, diagnostics and human text.
/// Returns qimg's JSON and exit code.
fn compare(dir: &Path, file: &str, extra: &[&str], what: &str) -> (serde_json::Value, i32) {
    assert!(
        !extra.contains(&"-r"),
        "repairs need two copies: use compare_repair"
    );
    compare_on(dir, file, file, extra, what)
}

/// Both tools repairing their own copy of `file` (`q-FILE` for qemu-img, `FILE` itself for
/// qimg): same exit code, JSON (but for the file name) and diagnostics.
fn compare_repair(dir: &Path, file: &str, extra: &[&str], what: &str) -> (serde_json::Value, i32) {
    let theirs = format!("q-{file}");
    copy(dir, file, &theirs);
    compare_on(dir, &theirs, file, extra, what)
}

fn compare_on(
    dir: &Path,
    qemu_file: &str,
    qimg_file: &str,
    extra: &[&str],
    what: &str,
) -> (serde_json::Value, i32) {
    let args = |file| {
        let mut a = vec!["check", "--output=json"];
        a.extend_from_slice(extra);
        a.push(file);
        a
    };
    let theirs = qemu_img(dir, &args(qemu_file));
    let ours = qimg(dir, &args(qimg_file));
    let (mut tv, tc) = check_json(&theirs, &format!("{what}: qemu-img"));
    let (ov, oc) = check_json(&ours, &format!("{what}: qimg"));
    let mut ov_cmp = ov.clone();
    if qemu_file != qimg_file {
        tv.as_object_mut().unwrap().remove("filename");
        ov_cmp.as_object_mut().unwrap().remove("filename");
    }
    assert_eq!(
        ov_cmp,
        tv,
        "{what} {extra:?}: JSON differs\nqimg stderr: {}\nqemu-img stderr: {}",
        String::from_utf8_lossy(&ours.stderr),
        String::from_utf8_lossy(&theirs.stderr)
    );
    assert_eq!(oc, tc, "{what} {extra:?}: exit codes differ: {ov}");
    assert_eq!(
        diagnostics(&ours),
        diagnostics(&theirs),
        "{what} {extra:?}: diagnostics differ"
    );
    if extra.is_empty() {
        let t = qemu_img(dir, &["check", qemu_file]);
        let o = qimg(dir, &["check", qimg_file]);
        assert_eq!(
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&t.stdout),
            "{what}: human output differs"
        );
        assert_eq!(o.status.code(), t.status.code(), "{what}: human exit codes");
    }
    (ov, oc)
}

fn copy(dir: &Path, from: &str, to: &str) {
    std::fs::copy(dir.join(from), dir.join(to)).unwrap();
}

/// Bytes of `a` and `b` equal outside the guest ranges `skip`.
fn assert_intact(a: &[u8], b: &[u8], skip: &[(u64, u64)], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: virtual sizes differ");
    let mut keep = vec![true; a.len().div_ceil(512)];
    for &(s, l) in skip {
        for k in s / 512..(s + l).div_ceil(512) {
            if let Some(x) = keep.get_mut(k as usize) {
                *x = false;
            }
        }
    }
    for (k, chunk) in a.chunks(512).enumerate() {
        if keep[k] && chunk != &b[k * 512..k * 512 + chunk.len()] {
            panic!(
                "{what}: guest sector {k} (offset {:#x}) changed by the repair",
                k * 512
            );
        }
    }
}

/// One damaged image.
struct Damage {
    name: &'static str,
    /// `qemu-img create -o` options.
    opts: &'static str,
    /// qemu-io commands that write the guest data.
    writes: &'static [&'static str],
    /// Make the image compressed (`qemu-img convert -c`) before damaging it.
    compress: bool,
    /// Internal snapshot taken after the writes, followed by `after_snapshot` writes.
    snapshot: bool,
    after_snapshot: &'static [&'static str],
    /// Edits the file; returns the guest ranges whose contents the damage affects.
    inject: fn(&Img) -> Vec<(u64, u64)>,
    /// `qemu-img check -r all` repairs it the way qimg does (same counters afterwards).
    same_repair: bool,
    /// Expected (corruptions, leaks, check-errors, exit code) of the read-only check.
    expect: (u64, u64, u64, i32),
}

const WRITES: &[&str] = &[
    "write -P 0x11 0 1M",
    "write -P 0x22 10M 64k",
    "write -P 0x33 300M 200k",
];

fn damages() -> Vec<Damage> {
    let d = |name, inject, same_repair, expect| Damage {
        name,
        opts: "",
        writes: WRITES,
        compress: false,
        snapshot: false,
        after_snapshot: &[],
        inject,
        same_repair,
        expect,
    };
    let mut v = vec![
        // A leaked cluster: one past everything, with a refcount.
        d(
            "leak-extra-cluster",
            |i| {
                let c = i.len().div_ceil(i.cs);
                i.set_len((c + 1) * i.cs);
                i.set_refcount(c, 1);
                vec![]
            },
            true,
            (0, 1, 0, 3),
        ),
        // A data cluster's refcount bumped: a leak and a COPIED flag that is now wrong.
        d(
            "leak-bumped-refcount",
            |i| {
                let c = i.host_cluster(64 * KIB);
                i.set_refcount(c, 2);
                vec![]
            },
            true,
            (1, 1, 0, 2),
        ),
        // A data cluster's refcount cleared: too low, the refcounts are rebuilt.
        d(
            "refcount-zero",
            |i| {
                let c = i.host_cluster(128 * KIB);
                i.set_refcount(c, 0);
                vec![]
            },
            true,
            (2, 0, 0, 2),
        ),
        // An L2 entry pointing far past the end of the file.
        d(
            "l2-entry-past-eof",
            |i| {
                let at = i.l2_entry(192 * KIB);
                i.w64(at, COPIED | (0x1000 * i.cs));
                vec![(192 * KIB, i.cs)]
            },
            false,
            (2, 1, 0, 2),
        ),
        // Overlapping metadata: a data cluster entry pointing at the L1 table.
        d(
            "data-entry-on-l1-table",
            |i| {
                let at = i.l2_entry(256 * KIB);
                i.w64(at, COPIED | i.l1);
                vec![(256 * KIB, i.cs)]
            },
            true,
            (1, 1, 0, 2),
        ),
        // Overlapping metadata: a data cluster entry pointing at the refcount table.
        d(
            "data-entry-on-refcount-table",
            |i| {
                let at = i.l2_entry(320 * KIB);
                i.w64(at, COPIED | i.reftable);
                vec![(320 * KIB, i.cs)]
            },
            true,
            (1, 1, 0, 2),
        ),
        // A data cluster offset not aligned to the cluster size.
        d(
            "unaligned-data-offset",
            |i| {
                let at = i.l2_entry(512 * KIB);
                i.w64(at, i.r64(at) + 0x200);
                vec![(512 * KIB, i.cs)]
            },
            false,
            (2, 0, 0, 2),
        ),
        // An L2 table offset not aligned to the cluster size (the whole table is unreadable).
        d(
            "unaligned-l2-table",
            |i| {
                let l1 = i.l1_entry(0);
                i.w64(l1, i.r64(l1) + 0x200);
                vec![(0, i.cs * i.cs / i.entry_size())]
            },
            false,
            (193, 15, 0, 2),
        ),
        // A refcount block offset not aligned: refcounts cannot be read (check errors).
        d(
            "unaligned-refcount-block",
            |i| {
                i.w64(i.reftable, i.r64(i.reftable) + 0x200);
                vec![]
            },
            false,
            (1, 0, 26, 1),
        ),
        // Reserved bits in an L1 entry, an L2 entry and a refcount table entry.
        d(
            "reserved-bits",
            |i| {
                let l1 = i.l1_entry(0);
                i.w64(l1, i.r64(l1) | 1 << 60);
                let l2 = i.l2_entry(0);
                i.w64(l2, i.r64(l2) | 1 << 57);
                i.w64(i.reftable, i.r64(i.reftable) | 1);
                vec![]
            },
            false,
            (3, 1, 0, 2),
        ),
        // A refcount table entry pointing past the end of the file (QEMU grows the file to
        // cover it before rebuilding; qimg rebuilds without growing it).
        d(
            "refcount-block-outside-image",
            |i| {
                i.w64(i.reftable + 8, 0x4000 * i.cs);
                vec![]
            },
            false,
            (1, 0, 0, 2),
        ),
        // Two refcount table entries naming the same block.
        d(
            "refcount-block-twice",
            |i| {
                let first = i.r64(i.reftable);
                i.w64(i.reftable + 8, first);
                vec![]
            },
            true,
            (2, 0, 0, 2),
        ),
        // A zero cluster with a preallocated, unaligned offset (QEMU repairs it itself).
        d(
            "unaligned-preallocated-zero-cluster",
            |i| {
                let at = i.l2_entry(576 * KIB);
                i.w64(at, COPIED | ((i.r64(at) & L1E_OFFSET_MASK) + 0x200) | 1);
                vec![(576 * KIB, i.cs)]
            },
            true,
            (2, 0, 0, 2),
        ),
    ];
    // Extended L2: subclusters both allocated and zero, allocation bits without a cluster.
    v.push(Damage {
        opts: "extended_l2=on",
        ..d(
            "ext-invalid-subcluster-bits",
            |i| {
                let at = i.l2_entry(64 * KIB) + 8;
                i.w64(at, i.r64(at) | 1 << 35);
                let at = i.l2_entry(100 * MIB) + 8;
                i.w64(at, i.r64(at) | 0b101);
                vec![(64 * KIB, i.cs), (100 * MIB, i.cs)]
            },
            false,
            (2, 0, 0, 2),
        )
    });
    // Extended L2, unaligned offset of a cluster with data.
    v.push(Damage {
        opts: "extended_l2=on,cluster_size=128k",
        ..d(
            "ext-unaligned-data-offset",
            |i| {
                let at = i.l2_entry(256 * KIB);
                i.w64(at, i.r64(at) + 0x1000);
                vec![(256 * KIB, i.cs)]
            },
            false,
            (2, 0, 0, 2),
        )
    });
    // Compressed extended L2 entries: COPIED set, a non-zero subcluster bitmap.
    v.push(Damage {
        opts: "extended_l2=on",
        compress: true,
        ..d(
            "ext-compressed-bad-flags",
            |i| {
                let at = i.l2_entry(0);
                assert_ne!(i.r64(at) & COMPRESSED, 0);
                i.w64(at, i.r64(at) | COPIED);
                let at = i.l2_entry(64 * KIB) + 8;
                i.w64(at, 1);
                vec![]
            },
            false,
            (2, 1, 0, 2),
        )
    });
    // A shared cluster (internal snapshot) whose refcount dropped from 2 to 1.
    v.push(Damage {
        snapshot: true,
        after_snapshot: &["write -P 0x44 0 64k"],
        ..d(
            "snapshot-shared-refcount-low",
            |i| {
                let c = i.host_cluster(128 * KIB);
                assert_eq!(i.refcount(c), 2);
                i.set_refcount(c, 1);
                vec![]
            },
            true,
            (2, 0, 0, 2),
        )
    });
    // Leaks with 1-bit and 64-bit refcounts.
    for (name, opts) in [
        ("leak-rb1", "refcount_bits=1"),
        ("leak-rb64", "refcount_bits=64"),
    ] {
        v.push(Damage {
            opts,
            ..d(
                name,
                |i| {
                    let c = i.len().div_ceil(i.cs);
                    i.set_len((c + 2) * i.cs);
                    i.set_refcount(c + 1, 1);
                    vec![]
                },
                true,
                (0, 1, 0, 3),
            )
        });
    }
    v
}

fn make(dir: &Path, d: &Damage) {
    let size = "320M";
    create(dir, d.opts, "made.qcow2", size);
    qemu_io(dir, "made.qcow2", d.writes);
    if d.compress {
        ok(
            "qemu-img convert -c",
            &qemu_img(
                dir,
                &[
                    "convert",
                    "-c",
                    "-O",
                    "qcow2",
                    "-o",
                    d.opts,
                    "made.qcow2",
                    "img.qcow2",
                ],
            ),
        );
    } else {
        copy(dir, "made.qcow2", "img.qcow2");
    }
    if d.snapshot {
        ok(
            "qemu-img snapshot",
            &qemu_img(dir, &["snapshot", "-c", "s1", "img.qcow2"]),
        );
        qemu_io(dir, "img.qcow2", d.after_snapshot);
    }
}

#[test]
fn damaged_images_are_reported_and_repaired_like_qemu_img() {
    qimg_testkit::require_qemu!();
    for d in damages() {
        let s = Scratch::new(&format!("check-{}", d.name));
        let dir = &s.0;
        make(dir, &d);
        let before = qemu_raw(dir, "img.qcow2");
        let affected = (d.inject)(&Img::open(&dir.join("img.qcow2")));

        // Read-only: the same report, messages and exit code.
        let (v, code) = compare(dir, "img.qcow2", &[], d.name);
        let got = (
            count(&v, "corruptions"),
            count(&v, "leaks"),
            count(&v, "check-errors"),
            code,
        );
        assert_eq!(
            got, d.expect,
            "{}: (corruptions, leaks, check-errors, exit): {v}",
            d.name
        );

        // -r leaks: the same as qemu-img when it can fix everything it found.
        copy(dir, "img.qcow2", "leaks.qcow2");
        if d.expect.0 == 0 && d.expect.2 == 0 {
            compare_repair(dir, "leaks.qcow2", &["-r", "leaks"], d.name);
            let (v, code) = check_json(
                &qemu_img(dir, &["check", "--output=json", "leaks.qcow2"]),
                d.name,
            );
            assert_eq!(code, 0, "{}: after qimg check -r leaks: {v}", d.name);
        }

        // -r all: qemu-img finds nothing afterwards, intact guest data is unchanged.
        copy(dir, "img.qcow2", "all.qcow2");
        if d.same_repair {
            compare_repair(dir, "all.qcow2", &["-r", "all"], d.name);
        } else {
            let o = qimg(dir, &["check", "-r", "all", "--output=json", "all.qcow2"]);
            let (v, code) = check_json(&o, d.name);
            assert_eq!(
                code,
                0,
                "{}: qimg check -r all left: {v}\n{}",
                d.name,
                String::from_utf8_lossy(&o.stderr)
            );
            assert!(
                count(&v, "corruptions-fixed") + count(&v, "leaks-fixed") > 0,
                "{}: {v}",
                d.name
            );
        }
        let after = qemu_img(dir, &["check", "--output=json", "all.qcow2"]);
        let (v, code) = check_json(&after, d.name);
        assert_eq!(
            (
                count(&v, "corruptions"),
                count(&v, "leaks"),
                count(&v, "check-errors"),
                code
            ),
            (0, 0, 0, 0),
            "{}: qemu-img check after qimg check -r all: {v}\n{}",
            d.name,
            String::from_utf8_lossy(&after.stderr)
        );
        // The header flags are clear and qimg agrees with qemu-img on the repaired image.
        let i = Img::open(&dir.join("all.qcow2"));
        assert_eq!(
            i.r64(72) & 0b11,
            0,
            "{}: dirty or corrupt bit left set",
            d.name
        );
        compare(dir, "all.qcow2", &[], &format!("{} (repaired)", d.name));
        let repaired = qemu_raw(dir, "all.qcow2");
        assert_intact(&before, &repaired, &affected, d.name);
    }
}

/// Clean images of every kind: `qimg check --output json` equals qemu-img's on every field.
#[test]
fn clean_images_report_exactly_what_qemu_img_reports() {
    qimg_testkit::require_qemu!();
    let writes: &[&str] = &[
        "write -P 1 0 3M",
        "write -P 2 40M 100k",
        "write -z 50M 1M",
        "discard 1M 512k",
        "write -P 3 63M 1M",
    ];
    let cases: &[(&str, &str)] = &[
        ("standard", ""),
        ("extended", "extended_l2=on"),
        ("extended-2M", "extended_l2=on,cluster_size=2M"),
        ("rb1", "refcount_bits=1"),
        ("rb16", "refcount_bits=16"),
        ("rb64", "refcount_bits=64"),
        ("rb2-cs512", "refcount_bits=2,cluster_size=512"),
        ("v2", "compat=0.10"),
        ("lazy", "lazy_refcounts=on"),
        ("prealloc-metadata", "preallocation=metadata"),
        ("prealloc-full-ext", "preallocation=full,extended_l2=on"),
        ("data-file", "data_file=data.raw"),
    ];
    for (name, opts) in cases {
        let s = Scratch::new(&format!("check-clean-{name}"));
        let dir = &s.0;
        create(dir, opts, "img.qcow2", "64M");
        qemu_io(dir, "img.qcow2", writes);
        let (v, code) = compare(dir, "img.qcow2", &[], name);
        assert_eq!(code, 0, "{name}: {v}");
        assert!(count(&v, "image-end-offset") > 0, "{name}: {v}");
    }

    // Compressed (zlib and zstd), internal snapshots, a backing file, persistent bitmaps.
    let s = Scratch::new("check-clean-more");
    let dir = &s.0;
    ok(
        "qemu-img create",
        &qemu_img(dir, &["create", "-q", "-f", "qcow2", "base.qcow2", "64M"]),
    );
    qemu_io(dir, "base.qcow2", writes);
    ok(
        "convert -c",
        &qemu_img(
            dir,
            &["convert", "-c", "-O", "qcow2", "base.qcow2", "zlib.qcow2"],
        ),
    );
    ok(
        "convert -c zstd",
        &qemu_img(
            dir,
            &[
                "convert",
                "-c",
                "-O",
                "qcow2",
                "-o",
                "compression_type=zstd,extended_l2=on",
                "base.qcow2",
                "zstd.qcow2",
            ],
        ),
    );
    copy(dir, "base.qcow2", "snap.qcow2");
    ok(
        "snapshot",
        &qemu_img(dir, &["snapshot", "-c", "s1", "snap.qcow2"]),
    );
    qemu_io(dir, "snap.qcow2", &["write -P 7 1M 2M"]);
    ok(
        "snapshot",
        &qemu_img(dir, &["snapshot", "-c", "s2", "snap.qcow2"]),
    );
    qemu_io(dir, "snap.qcow2", &["write -P 8 0 64k"]);
    qemu_img_create(
        dir,
        "qcow2",
        "",
        &["-b", "base.qcow2", "-F", "qcow2"],
        "top.qcow2",
        "",
    );
    qemu_io(dir, "top.qcow2", &["write -P 9 100k 8k"]);
    copy(dir, "base.qcow2", "bitmaps.qcow2");
    add_bitmaps(dir, "bitmaps.qcow2");
    for file in [
        "zlib.qcow2",
        "zstd.qcow2",
        "snap.qcow2",
        "top.qcow2",
        "bitmaps.qcow2",
    ] {
        let (v, code) = compare(dir, file, &[], file);
        assert_eq!(code, 0, "{file}: {v}");
        if file.starts_with('z') {
            assert!(count(&v, "compressed-clusters") > 0, "{file}: {v}");
        }
        // A repair of a clean image changes nothing and reports nothing.
        copy(dir, file, "again.qcow2");
        let (r, code) = compare_repair(dir, "again.qcow2", &["-r", "all"], file);
        assert_eq!(
            (
                code,
                count(&r, "corruptions-fixed"),
                count(&r, "leaks-fixed")
            ),
            (0, 0, 0)
        );
        assert_eq!(
            std::fs::read(dir.join(file)).unwrap(),
            std::fs::read(dir.join("again.qcow2")).unwrap(),
            "{file}: -r all on a clean image changed it"
        );
    }
}

/// A dirty (lazy refcounts) image with a leak: reported like qemu-img; a repair clears the
/// dirty bit; a corrupt-marked image is repaired and unmarked.
#[test]
fn dirty_and_corrupt_bits_are_cleared_by_a_successful_repair() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("check-flags");
    let dir = &s.0;
    for (file, bit) in [("dirty.qcow2", 1u64), ("corrupt.qcow2", 2)] {
        ok(
            "qemu-img create",
            &qemu_img(
                dir,
                &[
                    "create",
                    "-q",
                    "-f",
                    "qcow2",
                    "-o",
                    "lazy_refcounts=on",
                    file,
                    "64M",
                ],
            ),
        );
        qemu_io(dir, file, &["write -P 5 0 1M"]);
        let i = Img::open(&dir.join(file));
        i.w64(72, i.r64(72) | bit);
        let c = i.len().div_ceil(i.cs);
        i.set_len((c + 1) * i.cs);
        i.set_refcount(c, 1);
        compare(dir, file, &[], file);
        copy(dir, file, "fixed.qcow2");
        let (v, code) = compare_repair(dir, "fixed.qcow2", &["-r", "leaks"], file);
        assert_eq!((code, count(&v, "leaks-fixed")), (0, 1), "{file}: {v}");
        assert_eq!(Img::open(&dir.join("fixed.qcow2")).r64(72) & 3, 0, "{file}");
    }
}

#[test]
fn options_and_refusals_follow_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("check-cli");
    let dir = &s.0;
    ok(
        "qemu-img create",
        &qemu_img(dir, &["create", "-q", "-f", "qcow2", "img.qcow2", "64M"]),
    );
    ok(
        "qemu-img create raw",
        &qemu_img(dir, &["create", "-q", "-f", "raw", "img.raw", "1M"]),
    );
    for args in [
        vec!["check", "-r", "foo", "img.qcow2"],
        vec!["check", "--output=xml", "img.qcow2"],
        vec!["check", "-U", "-r", "all", "img.qcow2"],
        vec!["check", "img.raw"],
        vec!["check", "-f", "raw", "img.raw"],
        vec!["check", "missing.qcow2"],
        vec!["check", "-q", "img.qcow2"],
        vec!["check", "-q", "--output=json", "img.qcow2"],
        vec!["check", "-U", "img.qcow2"],
    ] {
        let t = qemu_img(dir, &args);
        let o = qimg(dir, &args);
        assert_eq!(o.status.code(), t.status.code(), "{args:?}: exit codes");
        assert_eq!(
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&t.stdout),
            "{args:?}: stdout"
        );
        assert_eq!(o.stderr.is_empty(), t.stderr.is_empty(), "{args:?}: stderr");
    }
}

/// An L1 entry pointing at a guest data cluster makes that cluster look like an L2 table full
/// of broken entries. `-r all` must not "repair" those entries: they are guest data.
#[test]
fn a_table_that_is_also_guest_data_is_never_rewritten() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("check-table-is-data");
    let dir = &s.0;
    create(dir, "cluster_size=4k", "img.qcow2", "64M");
    qemu_io(
        dir,
        "img.qcow2",
        &["write -P 0x11 0 64k", "write -P 0x5a 1M 8k"],
    );
    let before = qemu_raw(dir, "img.qcow2");
    let i = Img::open(&dir.join("img.qcow2"));
    let data = i.host_cluster(0) * i.cs;
    // Guest 32M is L1 entry 16 with 4 KiB clusters (2 MiB per L2 table).
    i.w64(i.l1_entry(16), COPIED | data);
    let (v, code) = compare(dir, "img.qcow2", &[], "table-is-data");
    assert_eq!(code, 2, "{v}");
    assert!(count(&v, "corruptions") > 2, "{v}");
    let o = qimg(dir, &["check", "-r", "all", "--output=json", "img.qcow2"]);
    check_json(&o, "table-is-data -r all");
    let f = std::fs::File::open(dir.join("img.qcow2")).unwrap();
    let mut cluster = vec![0u8; i.cs as usize];
    f.read_exact_at(&mut cluster, data).unwrap();
    assert!(
        cluster.iter().all(|&b| b == 0x11),
        "the data cluster used as an L2 table was rewritten"
    );
    let after = qemu_raw(dir, "img.qcow2");
    assert_intact(&before, &after, &[(32 * MIB, 2 * MIB)], "table-is-data");
}

/// Reserved bits in every entry of a 16,384-entry L1 table (512-byte clusters, 512 MiB, every
/// L2 table allocated): both tools report the same; qimg repairs them (qemu-img only reports
/// them), after which qemu-img finds the image clean and the guest data unchanged. (Each
/// repaired entry used to rescan the whole L1 table for the overlap check: a fuzz finding.)
#[test]
fn reserved_bits_in_every_l1_entry_are_repaired_like_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("check-l1-reserved");
    let dir = &s.0;
    create(dir, "cluster_size=512", "a.qcow2", "512M");
    qemu_io(
        dir,
        "a.qcow2",
        &[
            "write -z 0 512M",
            "write -P 7 0 64k",
            "write -P 9 256M 64k",
            "write -P 3 511M 4k",
        ],
    );
    copy(dir, "a.qcow2", "orig.qcow2");
    let i = Img::open(&dir.join("a.qcow2"));
    let entries = 16_384u64;
    let mut table = vec![0u8; entries as usize * 8];
    std::fs::File::open(&i.path)
        .unwrap()
        .read_exact_at(&mut table, i.l1)
        .unwrap();
    for e in table.chunks_exact_mut(8) {
        let v = u64::from_be_bytes(e.try_into().unwrap());
        assert_ne!(v & L1E_OFFSET_MASK, 0, "every L2 table is allocated");
        e.copy_from_slice(&(v | 1 << 60).to_be_bytes());
    }
    i.write(i.l1, &table);
    let (v, code) = compare(dir, "a.qcow2", &[], "l1-reserved");
    assert_eq!((code, count(&v, "corruptions")), (2, entries), "{v}");
    let repair = qimg(dir, &["check", "--output=json", "-r", "all", "a.qcow2"]);
    let (v, code) = check_json(&repair, "l1-reserved: qimg check -r all");
    let fixed = (count(&v, "corruptions-fixed"), count(&v, "corruptions"));
    assert_eq!((code, fixed), (0, (entries, 0)), "{v}");
    let (v, code) = compare(dir, "a.qcow2", &[], "l1-reserved repaired");
    assert_eq!((code, count(&v, "corruptions")), (0, 0), "{v}");
    ok(
        "qemu-img compare",
        &qemu_img(dir, &["compare", "-q", "orig.qcow2", "a.qcow2"]),
    );
}

/// A repair writes to the image, so it first clears the autoclear bits it does not know, as
/// qemu-img's does (bit 1, data-file-raw, is kept where it means something): with a leak
/// to repair, `-r leaks` and `-r all` leave the same autoclear field as qemu-img.
#[test]
fn a_repair_clears_unknown_autoclear_bits_as_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("check-autoclear");
    let dir = &s.0;
    for repair in ["leaks", "all"] {
        create(dir, "", "a.qcow2", "64M");
        qemu_io(dir, "a.qcow2", &["write -P 5 0 1M"]);
        let i = Img::open(&dir.join("a.qcow2"));
        i.w64(88, 0x8000_0000_0000_0020);
        let c = i.len().div_ceil(i.cs);
        i.set_len((c + 1) * i.cs);
        i.set_refcount(c, 1);
        let (v, code) = compare_repair(dir, "a.qcow2", &["-r", repair], repair);
        assert_eq!((code, count(&v, "leaks-fixed")), (0, 1), "{repair}: {v}");
        let ours = Img::open(&dir.join("a.qcow2")).r64(88);
        let theirs = Img::open(&dir.join("q-a.qcow2")).r64(88);
        assert_eq!(ours, theirs, "-r {repair}: autoclear bits");
        assert_eq!(ours, 0, "-r {repair}");
    }
}

/// Images QEMU still reads, made at test time from qemu-img's: a refcount block offset not
/// aligned to the cluster, two backing-format extensions (the last counts), a compressed
/// extended-L2 entry with reserved bitmap bits, an L2 table past the end of the file. `info`,
/// `convert -O raw` and `check` give what qemu-img gives (output, status and converted bytes).
#[test]
fn images_qemu_still_reads_are_read_as_qemu_img_reads_them() {
    qimg_testkit::require_qemu!();
    use qimg::format::extensions::{Cluster0, Extension};
    let s = Scratch::new("qemu-reads");
    let dir = &s.0;
    let mut cases: Vec<&str> = Vec::new();
    // An unaligned refcount block.
    create(dir, "", "refblock.qcow2", "4M");
    qemu_io(dir, "refblock.qcow2", &["write -P 1 0 1M"]);
    let i = Img::open(&dir.join("refblock.qcow2"));
    i.w64(i.reftable, i.r64(i.reftable) + 0x200);
    cases.push("refblock.qcow2");
    // Two backing-format extensions: raw, then qcow2 (the right one).
    create(dir, "", "base.qcow2", "4M");
    qemu_io(dir, "base.qcow2", &["write -P 2 0 4M"]);
    qemu_img_create(
        dir,
        "qcow2",
        "",
        &["-b", "base.qcow2", "-F", "qcow2"],
        "twofmt.qcow2",
        "4M",
    );
    qemu_io(dir, "twofmt.qcow2", &["write -P 3 1M 64k"]);
    let path = dir.join("twofmt.qcow2");
    let mut bytes = std::fs::read(&path).unwrap();
    let mut c0 = Cluster0::decode(&bytes).unwrap();
    let at = c0
        .extensions
        .iter()
        .position(|e| matches!(e, Extension::BackingFormat(_)))
        .unwrap();
    c0.extensions
        .insert(at, Extension::BackingFormat(b"raw".to_vec()));
    let head = c0.encode().unwrap();
    bytes[..head.len()].copy_from_slice(&head);
    std::fs::write(&path, bytes).unwrap();
    cases.push("twofmt.qcow2");
    // A compressed extended-L2 entry with bitmap bits set.
    create(dir, "extended_l2=on", "cbits.qcow2", "4M");
    qemu_io(
        dir,
        "cbits.qcow2",
        &["write -c -P 4 0 64k", "write -P 5 64k 64k"],
    );
    let i = Img::open(&dir.join("cbits.qcow2"));
    let e = i.l2_entry(0);
    i.w64(e + 8, 0x0000_00ff_0000_0f00);
    cases.push("cbits.qcow2");
    // An L2 table past the end of the file (L1 entry 1 of a 64 KiB-cluster image).
    create(dir, "", "l2eof.qcow2", "1G");
    qemu_io(
        dir,
        "l2eof.qcow2",
        &["write -P 6 0 64k", "write -P 7 512M 64k"],
    );
    let i = Img::open(&dir.join("l2eof.qcow2"));
    let past = i.len().next_multiple_of(i.cs) + 16 * i.cs;
    i.w64(i.l1_entry(1), past | 1 << 63);
    cases.push("l2eof.qcow2");
    for file in cases {
        for args in [
            vec!["info", file],
            vec!["convert", "-O", "raw", file, "out.raw"],
            vec!["check", file],
        ] {
            let _ = std::fs::remove_file(dir.join("out.raw"));
            let theirs = common::text(&qemu_img(dir, &args));
            let theirs_raw = std::fs::read(dir.join("out.raw")).ok();
            let _ = std::fs::remove_file(dir.join("out.raw"));
            let ours = common::text(&qimg(dir, &args));
            let ours_raw = std::fs::read(dir.join("out.raw")).ok();
            if args[0] == "convert" && file == "refblock.qcow2" {
                // qemu-img convert also warns about the block on stderr (a corruption event
                // it raises while converting); qimg does not: the rest must agree.
                assert_eq!((&ours.0, ours.2), (&theirs.0, theirs.2), "{args:?}");
            } else {
                assert_eq!(ours, theirs, "{args:?}");
            }
            assert!(ours_raw == theirs_raw, "{args:?}: converted bytes differ");
        }
    }
}

/// Compressed clusters whose size fields were raised so that their data overlaps their own
/// L2 table and the data cluster that table maps (2 MiB clusters, zlib): `-r all` repairs
/// the refcounts and the COPIED flags fully, as qemu-img does (it used to leave `cluster 7
/// refcount=1 reference=2`, which frees a cluster in use as soon as one reference goes).
#[test]
fn compressed_data_overlapping_its_own_l2_table_is_repaired_as_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("check-compressed-overlap");
    let dir = &s.0;
    create(
        dir,
        "cluster_size=2M,compression_type=zlib",
        "c.qcow2",
        "1T",
    );
    qemu_io(
        dir,
        "c.qcow2",
        &[
            "write -c -P 1 0 2M",
            "write -c -P 2 512G 2M",
            "write -P 3 514G 2M",
        ],
    );
    let i = Img::open(&dir.join("c.qcow2"));
    // Both compressed entries claim the most sectors their field holds (4 MiB of data).
    for guest in [0, 512 << 30] {
        let at = i.l2_entry(guest);
        i.w64(at, i.r64(at) | 0x1fff << 49);
    }
    compare(dir, "c.qcow2", &[], "raised compressed sizes");
    let (v, code) = compare_repair(dir, "c.qcow2", &["-r", "all"], "raised compressed sizes");
    assert_eq!(code, 0, "{v}");
    compare_on(dir, "q-c.qcow2", "c.qcow2", &[], "after the repair");
}

/// v3 snapshot entries with less extra data than v3 asks for: `check` reports them as
/// qemu-img does, and `-r all` completes them ("Repairing snapshot table entry N is
/// incomplete"), after which both checkers find the image clean and the snapshots intact.
#[test]
fn incomplete_snapshot_entries_are_completed_by_a_repair() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("check-incomplete-snapshots");
    let dir = &s.0;
    create(dir, "", "s.qcow2", "8M");
    qemu_io(dir, "s.qcow2", &["write -P 1 0 1M"]);
    ok(
        "snapshot",
        &qemu_img(dir, &["snapshot", "-c", "one", "s.qcow2"]),
    );
    qemu_io(dir, "s.qcow2", &["write -P 2 0 64k"]);
    ok(
        "snapshot",
        &qemu_img(dir, &["snapshot", "-c", "two", "s.qcow2"]),
    );
    // Entry 0 keeps no extra data, entry 1 eight bytes.
    common::shorten_snapshot_extra(&dir.join("s.qcow2"), &[0, 8]);
    compare(dir, "s.qcow2", &[], "incomplete entries");
    copy(dir, "s.qcow2", "q-s.qcow2");
    let theirs = qemu_img(dir, &["check", "-r", "all", "q-s.qcow2"]);
    let ours = qimg(dir, &["check", "-r", "all", "s.qcow2"]);
    assert_eq!(ours.status.code(), theirs.status.code());
    assert_eq!(
        diagnostics(&ours),
        diagnostics(&theirs),
        "-r all diagnostics"
    );
    for f in ["s.qcow2", "q-s.qcow2"] {
        common::assert_clean(dir, f, "after -r all");
    }
    let list = |f: &str| {
        let v = common::info(dir, f);
        v["snapshots"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (s["name"].clone(), s["vm-state-size"].clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(list("s.qcow2"), list("q-s.qcow2"));
    ok("apply", &qimg(dir, &["snapshot", "-a", "one", "s.qcow2"]));
    qemu_io(dir, "s.qcow2", &["read -P 1 0 1M"]);
}

//! Internal snapshots (`qimg snapshot`, `Image::{create,apply,delete}_snapshot`) against
//! qemu-img 10:
//!
//! * a matrix (standard and extended L2, 64 KiB and 2 MiB clusters, with and without a
//!   backing file, v2 and v3): data written, a snapshot made by qimg, more data, a second
//!   snapshot, overwrites; then `qemu-img check` finds nothing, `qemu-img snapshot -l` prints
//!   what `qimg snapshot -l` prints, and every snapshot applied by qimg on one copy and by
//!   qemu-img on another gives two images `qemu-img compare` finds identical, holding what the
//!   model says the snapshot held;
//! * crossovers: qemu-img's snapshots (on an image with compressed clusters too) applied and
//!   deleted by qimg, qimg's applied and deleted by qemu-img;
//! * deletion in every order, check clean after each step, the active data unchanged;
//! * refusals and messages equal to qemu-img's;
//! * writes, write-zeroes and discards through the engine after a snapshot (lazy refcounts
//!   too) leave the snapshot's data intact.

use crate::common;

use std::path::Path;
use std::process::Output;
use std::time::{Duration, UNIX_EPOCH};

use common::{
    Scratch, assert_clean, assert_same_as_model, make_backing_file, ok, qemu_create, qemu_img,
    qemu_io, qimg,
};
use qimg::{OpenOptions, SnapshotOptions};
use qimg_testkit::pattern;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

fn text(o: &Output) -> (String, String, Option<i32>) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
        o.status.code(),
    )
}

/// An image under test and the model of its guest contents.
struct Disk<'a> {
    dir: &'a Path,
    file: &'a str,
    model: Vec<u8>,
}

impl Disk<'_> {
    /// qemu-io writes of byte `p` at each `(offset, len)`.
    fn fill(&mut self, p: u8, ranges: &[(u64, u64)]) {
        let cmds: Vec<String> = ranges
            .iter()
            .map(|(o, l)| format!("write -P {p} {o} {l}"))
            .collect();
        let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
        qemu_io(self.dir, "qcow2", self.file, &cmds);
        for &(o, l) in ranges {
            self.model[o as usize..(o + l) as usize].fill(p);
        }
    }

    /// qemu-io write-zeroes at `(offset, len)`.
    fn zero(&mut self, o: u64, l: u64) {
        qemu_io(
            self.dir,
            "qcow2",
            self.file,
            &[&format!("write -z {o} {l}")],
        );
        self.model[o as usize..(o + l) as usize].fill(0);
    }
}

fn qimg_ok(dir: &Path, args: &[&str]) -> String {
    ok(&format!("qimg {args:?}"), &qimg(dir, args))
}

fn qemu_ok(dir: &Path, args: &[&str]) -> String {
    ok(&format!("qemu-img {args:?}"), &qemu_img(dir, args))
}

/// `qimg snapshot -l` and `qemu-img snapshot -l` print the same bytes; returns the text.
fn same_list(dir: &Path, file: &str, what: &str) -> String {
    let want = qemu_ok(dir, &["snapshot", "-l", file]);
    let got = qimg_ok(dir, &["snapshot", "-l", file]);
    assert_eq!(want, got, "{what}: snapshot lists differ");
    got
}

/// Applies `name` with qimg on one copy of `file` and with qemu-img on another: both must be
/// check clean, identical and equal to `expect`.
fn apply_both(dir: &Path, file: &str, name: &str, expect: &[u8], what: &str) {
    std::fs::copy(dir.join(file), dir.join("by-qimg.qcow2")).unwrap();
    std::fs::copy(dir.join(file), dir.join("by-qemu.qcow2")).unwrap();
    qimg_ok(dir, &["snapshot", "-a", name, "by-qimg.qcow2"]);
    qemu_ok(dir, &["snapshot", "-a", name, "by-qemu.qcow2"]);
    let what = format!("{what}, snapshot {name} applied");
    assert_clean(dir, "by-qimg.qcow2", &what);
    qemu_ok(dir, &["compare", "by-qimg.qcow2", "by-qemu.qcow2"]);
    assert_same_as_model(dir, "by-qimg.qcow2", expect, &what);
    // The applied image keeps working: a write copies the shared cluster first.
    qemu_io(dir, "qcow2", "by-qimg.qcow2", &["write -P 99 4096 4096"]);
    assert_clean(dir, "by-qimg.qcow2", &format!("{what}, then written"));
}

struct Shape {
    name: String,
    opts: String,
    cs: u64,
    backing: bool,
}

fn shapes() -> Vec<Shape> {
    let mut v = Vec::new();
    for (compat, ext) in [("1.1", false), ("1.1", true), ("0.10", false)] {
        for cs in [64 * KIB, 2 * MIB] {
            for backing in [false, true] {
                v.push(Shape {
                    name: format!(
                        "compat={compat} {} cs={}k{}",
                        if ext { "extended" } else { "standard" },
                        cs / KIB,
                        if backing { " backing" } else { "" }
                    ),
                    opts: format!(
                        "compat={compat},cluster_size={cs}{}",
                        if ext { ",extended_l2=on" } else { "" }
                    ),
                    cs,
                    backing,
                });
            }
        }
    }
    v
}

#[test]
fn snapshots_made_by_qimg_match_qemu_img_across_the_matrix() {
    qimg_testkit::require_qemu!();
    for shape in shapes() {
        let dir = Scratch::new("snap-matrix");
        let d = dir.0.as_path();
        let size = 4 * shape.cs.max(2 * MIB);
        let base = pattern(7, 0, size as usize);
        let backing = shape.backing.then(|| make_backing_file(d, &base, "qcow2"));
        qemu_create(
            d,
            "img.qcow2",
            &shape.opts,
            size,
            backing.map(|b| (b, "qcow2")),
        );
        let mut disk = Disk {
            dir: d,
            file: "img.qcow2",
            model: if shape.backing {
                base.clone()
            } else {
                vec![0; size as usize]
            },
        };
        let cs = shape.cs;
        disk.fill(1, &[(0, cs + 5000), (2 * cs + 512, 3000), (size - cs, cs)]);
        qimg_ok(d, &["snapshot", "-c", "first", "img.qcow2"]);
        let s1 = disk.model.clone();
        disk.fill(2, &[(1000, 2 * cs), (3 * cs - 700, 1400)]);
        disk.zero(size - cs, cs / 2);
        qimg_ok(d, &["snapshot", "-c", "second", "img.qcow2"]);
        let s2 = disk.model.clone();
        disk.fill(3, &[(0, 4 * cs), (size - 3000, 3000)]);
        disk.zero(cs, cs);
        let what = shape.name.as_str();
        assert_clean(d, "img.qcow2", what);
        assert_same_as_model(d, "img.qcow2", &disk.model, what);
        let list = same_list(d, "img.qcow2", what);
        assert!(
            list.contains("\n1       first ") && list.contains("\n2       second "),
            "{what}: {list}"
        );
        apply_both(d, "img.qcow2", "first", &s1, what);
        apply_both(d, "img.qcow2", "2", &s2, what);
    }
}

#[test]
fn snapshots_cross_between_qemu_img_and_qimg() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("snap-cross");
    let d = dir.0.as_path();
    let size = 4 * MIB;
    // Compressed clusters (made by qemu-img convert -c) under a snapshot made by qemu-img.
    let data = pattern(3, 0, size as usize);
    let mut raw = data.clone();
    raw[MIB as usize..2 * MIB as usize].fill(0);
    std::fs::write(d.join("src.raw"), &raw).unwrap();
    qemu_ok(
        d,
        &[
            "convert",
            "-c",
            "-f",
            "raw",
            "-O",
            "qcow2",
            "-o",
            "cluster_size=65536",
            "src.raw",
            "img.qcow2",
        ],
    );
    let mut disk = Disk {
        dir: d,
        file: "img.qcow2",
        model: raw.clone(),
    };
    qemu_ok(d, &["snapshot", "-c", "by-qemu", "img.qcow2"]);
    let s_qemu = disk.model.clone();
    disk.fill(4, &[(100, 200 * KIB), (3 * MIB, 64 * KIB)]);
    qimg_ok(d, &["snapshot", "-c", "by-qimg", "img.qcow2"]);
    let s_qimg = disk.model.clone();
    disk.fill(5, &[(0, MIB + 3)]);
    let active = disk.model.clone();
    assert_clean(d, "img.qcow2", "two snapshots");
    same_list(d, "img.qcow2", "two snapshots");

    // qemu-img's snapshot applied by qimg, qimg's by qemu-img, on copies.
    apply_both(d, "img.qcow2", "by-qemu", &s_qemu, "crossover");
    apply_both(d, "img.qcow2", "by-qimg", &s_qimg, "crossover");

    // qimg deletes qemu-img's snapshot; qemu-img's view of the other stays intact.
    std::fs::copy(d.join("img.qcow2"), d.join("a.qcow2")).unwrap();
    qimg_ok(d, &["snapshot", "-d", "by-qemu", "a.qcow2"]);
    assert_clean(d, "a.qcow2", "qemu-img's snapshot deleted by qimg");
    assert_same_as_model(d, "a.qcow2", &active, "after qimg -d");
    let list = same_list(d, "a.qcow2", "after qimg -d");
    assert!(
        !list.contains("by-qemu") && list.contains("by-qimg"),
        "{list}"
    );
    apply_both(d, "a.qcow2", "by-qimg", &s_qimg, "after qimg -d");

    // qemu-img deletes qimg's snapshot; qimg applies qemu-img's.
    std::fs::copy(d.join("img.qcow2"), d.join("b.qcow2")).unwrap();
    qemu_ok(d, &["snapshot", "-d", "by-qimg", "b.qcow2"]);
    assert_clean(d, "b.qcow2", "qimg's snapshot deleted by qemu-img");
    assert_same_as_model(d, "b.qcow2", &active, "after qemu-img -d");
    qimg_ok(d, &["snapshot", "-a", "by-qemu", "b.qcow2"]);
    assert_clean(d, "b.qcow2", "qemu-img's snapshot applied by qimg");
    assert_same_as_model(d, "b.qcow2", &s_qemu, "qemu-img's snapshot applied by qimg");
    qimg_ok(d, &["snapshot", "-d", "by-qemu", "b.qcow2"]);
    assert_clean(d, "b.qcow2", "the last snapshot deleted by qimg");
    assert_same_as_model(d, "b.qcow2", &s_qemu, "the last snapshot deleted by qimg");
    assert_eq!(qimg_ok(d, &["snapshot", "-l", "b.qcow2"]), "");
    assert_eq!(qemu_ok(d, &["snapshot", "-l", "b.qcow2"]), "");
}

/// All orders of `n` items.
fn permutations(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![vec![]];
    }
    let mut out = Vec::new();
    for p in permutations(n - 1) {
        for i in 0..=p.len() {
            let mut q = p.clone();
            q.insert(i, n - 1);
            out.push(q);
        }
    }
    out
}

#[test]
fn snapshots_delete_cleanly_in_every_order() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("snap-delete");
    let d = dir.0.as_path();
    let size = 2 * MIB;
    qemu_create(
        d,
        "img.qcow2",
        "cluster_size=65536,extended_l2=on",
        size,
        None,
    );
    let mut disk = Disk {
        dir: d,
        file: "img.qcow2",
        model: vec![0; size as usize],
    };
    let names = ["a", "b", "c"];
    for (i, n) in names.iter().enumerate() {
        let i = i as u64;
        disk.fill(
            10 + i as u8,
            &[(i * 70 * KIB, 100 * KIB), (MIB + i * 4096, 2048)],
        );
        qimg_ok(d, &["snapshot", "-c", n, "img.qcow2"]);
    }
    disk.fill(20, &[(0, 300 * KIB)]);
    let active = disk.model.clone();
    let start_len = std::fs::metadata(d.join("img.qcow2")).unwrap().len();
    for order in permutations(names.len()) {
        std::fs::copy(d.join("img.qcow2"), d.join("t.qcow2")).unwrap();
        for &k in &order {
            qimg_ok(d, &["snapshot", "-d", names[k], "t.qcow2"]);
            let what = format!("order {order:?}, {} deleted", names[k]);
            assert_clean(d, "t.qcow2", &what);
            same_list(d, "t.qcow2", &what);
        }
        assert_same_as_model(d, "t.qcow2", &active, &format!("order {order:?}"));
        assert_eq!(qimg_ok(d, &["snapshot", "-l", "t.qcow2"]), "");
        // Everything the snapshots held alone was freed: qemu-img sees no leak (above), and
        // the file did not grow past what the deletions needed for new tables.
        let len = std::fs::metadata(d.join("t.qcow2")).unwrap().len();
        assert!(len <= start_len + 3 * 65536, "order {order:?}: {len} bytes");
    }
}

#[test]
fn refusals_and_messages_are_qemu_imgs() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("snap-refusals");
    let d = dir.0.as_path();
    qemu_create(d, "q.qcow2", "cluster_size=65536", MIB, None);
    std::fs::write(d.join("r.raw"), vec![0u8; MIB as usize]).unwrap();
    qemu_create(d, "dup-qemu.qcow2", "cluster_size=65536", MIB, None);
    qemu_create(d, "dup-qimg.qcow2", "cluster_size=65536", MIB, None);
    // Duplicate names: qemu-img accepts them (two entries, IDs 1 and 2); so does qimg.
    for _ in 0..2 {
        qemu_ok(d, &["snapshot", "-c", "same", "dup-qemu.qcow2"]);
        qimg_ok(d, &["snapshot", "-c", "same", "dup-qimg.qcow2"]);
    }
    let a = qemu_ok(d, &["snapshot", "-l", "dup-qemu.qcow2"]);
    let b = qimg_ok(d, &["snapshot", "-l", "dup-qimg.qcow2"]);
    let strip = |s: &str| -> Vec<String> {
        // The dates differ (made at different times): compare ID, tag and size columns.
        s.lines().map(|l| l.chars().take(34).collect()).collect()
    };
    assert_eq!(strip(&a), strip(&b));
    assert_eq!(b.lines().count(), 4, "{b}");
    // -d by name removes the first of the two, in both.
    qemu_ok(d, &["snapshot", "-d", "same", "dup-qemu.qcow2"]);
    qimg_ok(d, &["snapshot", "-d", "same", "dup-qimg.qcow2"]);
    assert_eq!(
        strip(&qemu_ok(d, &["snapshot", "-l", "dup-qemu.qcow2"])),
        strip(&qimg_ok(d, &["snapshot", "-l", "dup-qimg.qcow2"]))
    );
    assert_clean(d, "dup-qimg.qcow2", "duplicate names");

    let cases: &[&[&str]] = &[
        &["snapshot", "-a", "nope", "q.qcow2"],
        &["snapshot", "-d", "nope", "q.qcow2"],
        // -d takes names only: an ID is not found.
        &["snapshot", "-d", "1", "dup-qemu.qcow2"],
        &["snapshot", "-l", "q.qcow2"],
        &["snapshot", "q.qcow2"],
        &["snapshot", "-f", "raw", "-l", "r.raw"],
        &["snapshot", "-f", "raw", "-c", "x", "r.raw"],
        &["snapshot", "-f", "raw", "-a", "x", "r.raw"],
        &["snapshot", "-f", "raw", "-d", "x", "r.raw"],
        &["snapshot", "-c", "x", "r.raw"],
        &["snapshot", "-U", "-c", "x", "q.qcow2"],
        &["snapshot", "-U", "-l", "q.qcow2"],
        &["snapshot", "-l", "-c", "x", "q.qcow2"],
        &["snapshot", "-c", "x", "-c", "y", "q.qcow2"],
        &["snapshot", "-l"],
        &["snapshot", "-l", "q.qcow2", "r.raw"],
        &["snapshot", "-c", "x", "missing.qcow2"],
    ];
    for args in cases {
        let (qo, qe, qc) = text(&qemu_img(d, args));
        let (io, ie, ic) = text(&qimg(d, args));
        assert_eq!(qc, ic, "{args:?}: exit codes differ: {qe} / {ie}");
        assert_eq!(qo, io, "{args:?}: outputs differ");
        let last = |e: &str, tool: &str| -> String {
            e.lines()
                .filter(|l| !l.starts_with("Try "))
                .map(|l| l.trim_start_matches(tool).to_string())
                .collect::<Vec<_>>()
                .join("\n")
        };
        assert_eq!(
            last(&qe, "qemu-img: "),
            last(&ie, "qimg: "),
            "{args:?}: messages differ"
        );
    }
    // Nothing above changed the images.
    assert_clean(d, "q.qcow2", "after the refusals");
    assert_eq!(qimg_ok(d, &["snapshot", "-l", "q.qcow2"]), "");
}

/// Writes, write-zeroes and discards through the engine after a snapshot copy shared
/// clusters first: the snapshot, applied afterwards, reads what it held.
async fn engine_writes_keep_snapshots(d: &Path, opts: &str, what: &str) {
    let size = 3 * MIB;
    qemu_create(d, "e.qcow2", opts, size, None);
    let path = d.join("e.qcow2");
    let img = OpenOptions::new().writable(true).open(&path).await.unwrap();
    img.write(&pattern(1, 0, (MIB + 7000) as usize), 0)
        .await
        .unwrap();
    img.write(&pattern(2, 2 * MIB, 300_000), 2 * MIB)
        .await
        .unwrap();
    let before = img.create_snapshot("snap").await.unwrap();
    assert_eq!(before.id, "1");
    assert_eq!(before.disk_size, Some(size));
    let mut held = vec![0u8; size as usize];
    img.read(&mut held, 0).await.unwrap();
    // In place of shared data: partial subclusters, whole clusters, zeroes, discards.
    img.write(&pattern(3, 1000, 5000), 1000).await.unwrap();
    img.write(&pattern(4, 64 * KIB, 200 * KIB as usize), 64 * KIB)
        .await
        .unwrap();
    img.write_zeroes(300 * KIB, 200 * KIB).await.unwrap();
    img.discard(512 * KIB, 256 * KIB).await.unwrap();
    img.discard(2 * MIB, MIB).await.unwrap();
    img.write(&pattern(5, 2 * MIB + 4096, 512), 2 * MIB + 4096)
        .await
        .unwrap();
    let mut now = vec![0u8; size as usize];
    img.read(&mut now, 0).await.unwrap();
    assert_ne!(now, held);
    // A second snapshot with a VMM's date and guest clock.
    let date = UNIX_EPOCH + Duration::from_secs(1_000_000_000);
    let opts = SnapshotOptions::new()
        .date(date)
        .vm_clock_nsec(3_723_456_000_000);
    img.create_snapshot_with("clocked", &opts).await.unwrap();
    let list = img.snapshots().await.unwrap();
    assert_eq!(list.len(), 2);
    assert_eq!((list[0].id.as_str(), list[0].name.as_str()), ("1", "snap"));
    assert_eq!(
        (list[1].id.as_str(), list[1].name.as_str()),
        ("2", "clocked")
    );
    img.close().await.unwrap();
    let shown = qemu_ok(d, &["snapshot", "-l", "e.qcow2"]);
    assert!(
        shown.contains(
            "\n2       clocked               0 B 2001-09-09 01:46:40  0001:02:03.456          0\n"
        ),
        "{what}: {shown}"
    );
    assert_clean(d, "e.qcow2", &format!("{what}: after writes"));
    assert_same_as_model(d, "e.qcow2", &now, &format!("{what}: after writes"));

    // Applied by qemu-img on a copy and by the engine on the image itself.
    std::fs::copy(&path, d.join("e-qemu.qcow2")).unwrap();
    qemu_ok(d, &["snapshot", "-a", "snap", "e-qemu.qcow2"]);
    assert_same_as_model(d, "e-qemu.qcow2", &held, &format!("{what}: qemu-img -a"));
    let img = OpenOptions::new().writable(true).open(&path).await.unwrap();
    img.apply_snapshot("snap").await.unwrap();
    let mut back = vec![0u8; size as usize];
    img.read(&mut back, 0).await.unwrap();
    assert!(back == held, "{what}: the snapshot's data changed");
    // Unknown snapshots are refused without touching anything.
    assert!(matches!(
        img.apply_snapshot("nope").await,
        Err(qimg::Error::SnapshotNotFound { .. })
    ));
    img.delete_snapshot("1").await.unwrap();
    img.delete_snapshot("clocked").await.unwrap();
    assert!(img.snapshots().await.unwrap().is_empty());
    img.close().await.unwrap();
    assert_clean(d, "e.qcow2", &format!("{what}: applied and deleted"));
    assert_same_as_model(d, "e.qcow2", &held, &format!("{what}: applied and deleted"));
}

#[test]
fn engine_writes_after_a_snapshot_leave_it_intact() {
    qimg_testkit::require_qemu!();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for (opts, what) in [
        ("cluster_size=65536,extended_l2=on", "extended"),
        ("cluster_size=65536", "standard"),
        ("cluster_size=65536,lazy_refcounts=on", "lazy refcounts"),
        ("compat=0.10,cluster_size=4096", "v2 4k"),
    ] {
        let dir = Scratch::new("snap-engine");
        rt.block_on(engine_writes_keep_snapshots(&dir.0, opts, what));
    }
}

/// A snapshot taken before the disk grew brings the old size back when applied, and one taken
/// after brings the larger size back, as qemu-img does.
#[test]
fn applying_restores_the_snapshots_disk_size() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("snap-resize");
    let d = dir.0.as_path();
    for ext in ["off", "on"] {
        qemu_create(
            d,
            "img.qcow2",
            &format!("cluster_size=65536,extended_l2={ext}"),
            2 * MIB,
            None,
        );
        let mut disk = Disk {
            dir: d,
            file: "img.qcow2",
            model: vec![0; 2 * MIB as usize],
        };
        disk.fill(1, &[(0, 300 * KIB)]);
        qimg_ok(d, &["snapshot", "-c", "small", "img.qcow2"]);
        let small = disk.model.clone();
        qemu_ok(d, &["resize", "-q", "img.qcow2", "6M"]);
        disk.model.resize(6 * MIB as usize, 0);
        disk.fill(2, &[(100 * KIB, 5 * MIB)]);
        qimg_ok(d, &["snapshot", "-c", "big", "img.qcow2"]);
        let big = disk.model.clone();
        let what = format!("extended_l2={ext}");
        same_list(d, "img.qcow2", &what);
        apply_both(
            d,
            "img.qcow2",
            "small",
            &small,
            &format!("{what}: to 2 MiB"),
        );
        // From the small size back to the large one, on the image applied above.
        std::fs::copy(d.join("by-qemu.qcow2"), d.join("back.qcow2")).unwrap();
        apply_both(
            d,
            "back.qcow2",
            "big",
            &big,
            &format!("{what}: back to 6 MiB"),
        );
        let size = |f: &str| common::info(d, f)["virtual-size"].as_u64().unwrap();
        assert_eq!(size("by-qimg.qcow2"), 6 * MIB, "{what}");
        qimg_ok(d, &["snapshot", "-a", "small", "by-qimg.qcow2"]);
        assert_eq!(size("by-qimg.qcow2"), 2 * MIB, "{what}");
        assert_clean(d, "by-qimg.qcow2", &what);
        std::fs::remove_file(d.join("img.qcow2")).unwrap();
    }
}

/// An entry written by an older QEMU (16 bytes of extra data: no icount) with a guest clock
/// lists as qemu-img lists it (`--` for the icount, the clock as hours:minutes:seconds), and
/// qimg applies and deletes it.
#[test]
fn older_entries_list_apply_and_delete_as_in_qemu_img() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("snap-old-entry");
    let d = dir.0.as_path();
    qemu_create(d, "img.qcow2", "cluster_size=65536", MIB, None);
    qemu_io(d, "qcow2", "img.qcow2", &["write -P 5 0 100k"]);
    qemu_ok(d, &["snapshot", "-c", "old-style", "img.qcow2"]);
    qemu_io(d, "qcow2", "img.qcow2", &["write -P 6 0 200k"]);
    let path = d.join("img.qcow2");
    let mut f = std::fs::read(&path).unwrap();
    let be32 = |b: &[u8], at: usize| u32::from_be_bytes(b[at..at + 4].try_into().unwrap());
    let be16 = |b: &[u8], at: usize| u16::from_be_bytes(b[at..at + 2].try_into().unwrap());
    let off = u64::from_be_bytes(f[64..72].try_into().unwrap()) as usize;
    let e = &f[off..];
    let (id_len, name_len, extra) = (
        be16(e, 12) as usize,
        be16(e, 14) as usize,
        be32(e, 36) as usize,
    );
    assert_eq!(extra, 24, "qemu-img 10 writes 24 bytes of extra data");
    let mut new = e[..40].to_vec();
    // 1 h 2 min 3.456 s of guest time, 16 bytes of extra data.
    new[24..32].copy_from_slice(&3_723_456_000_000u64.to_be_bytes());
    new[36..40].copy_from_slice(&16u32.to_be_bytes());
    new.extend_from_slice(&e[40..56]);
    new.extend_from_slice(&e[40 + extra..40 + extra + id_len + name_len]);
    new.resize(new.len().next_multiple_of(8), 0);
    f[off..off + new.len()].copy_from_slice(&new);
    std::fs::write(&path, &f).unwrap();
    assert_clean(d, "img.qcow2", "patched entry");
    let list = same_list(d, "img.qcow2", "an entry without icount");
    assert!(
        list.contains("0001:02:03.456         --\n"),
        "unexpected list:\n{list}"
    );
    let mut model = vec![0u8; MIB as usize];
    model[..100 * KIB as usize].fill(5);
    apply_both(
        d,
        "img.qcow2",
        "old-style",
        &model,
        "an entry without icount",
    );
    qimg_ok(d, &["snapshot", "-d", "old-style", "img.qcow2"]);
    assert_clean(d, "img.qcow2", "an entry without icount, deleted");
}

/// A snapshot entry with an absurd L1 size is refused with a message naming it, as qemu-img
/// refuses it ("Snapshot L1 table too large"), and the file is left exactly as it was.
#[test]
fn an_absurd_snapshot_l1_size_is_refused_without_touching_the_image() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("snap-hostile");
    let d = dir.0.as_path();
    qemu_create(d, "img.qcow2", "cluster_size=65536", MIB, None);
    qemu_io(d, "qcow2", "img.qcow2", &["write -P 1 0 64k"]);
    qemu_ok(d, &["snapshot", "-c", "s", "img.qcow2"]);
    let path = d.join("img.qcow2");
    let mut f = std::fs::read(&path).unwrap();
    let off = u64::from_be_bytes(f[64..72].try_into().unwrap()) as usize;
    f[off + 8..off + 12].copy_from_slice(&0x1000_0000u32.to_be_bytes());
    std::fs::write(&path, &f).unwrap();
    for args in [
        ["snapshot", "-a", "s", "img.qcow2"],
        ["snapshot", "-d", "s", "img.qcow2"],
        ["snapshot", "-c", "t", "img.qcow2"],
    ] {
        let (_, ie, ic) = text(&qimg(d, &args));
        assert!(ie.contains("268435456 entries"), "{args:?}: {ie}");
        assert_eq!(
            std::fs::read(&path).unwrap(),
            f,
            "{args:?} changed the file"
        );
        // qemu-img fails too (for -c it marks the image corrupt first: its overlap check
        // catches its own write; qimg refuses the image at open instead).
        let (_, qe, qc) = text(&qemu_img(d, &args));
        assert_eq!((qc, ic), (Some(1), Some(1)), "{args:?}: {qe} / {ie}");
        std::fs::write(&path, &f).unwrap();
    }
}

/// A snapshot whose L1 table names an L2 table past the end of the file is refused by `-a`
/// and `-d` before anything changes (the table read fails before a reference is counted or
/// the snapshot table is rewritten). (qemu-img applies it: its block layer reads zeros past
/// the end of the file, where the engine, strict everywhere, refuses.)
#[test]
fn a_snapshot_with_an_unreadable_l2_table_is_refused_without_touching_the_image() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("snap-hostile-l2");
    let d = dir.0.as_path();
    qemu_create(d, "img.qcow2", "cluster_size=65536", MIB, None);
    qemu_io(d, "qcow2", "img.qcow2", &["write -P 1 0 64k"]);
    qemu_ok(d, &["snapshot", "-c", "s", "img.qcow2"]);
    let path = d.join("img.qcow2");
    let mut f = std::fs::read(&path).unwrap();
    let off = u64::from_be_bytes(f[64..72].try_into().unwrap()) as usize;
    let l1 = u64::from_be_bytes(f[off..off + 8].try_into().unwrap()) as usize;
    f[l1..l1 + 8].copy_from_slice(&0x7fff_0000u64.to_be_bytes());
    std::fs::write(&path, &f).unwrap();
    for args in [
        ["snapshot", "-a", "s", "img.qcow2"],
        ["snapshot", "-d", "s", "img.qcow2"],
    ] {
        let (_, ie, ic) = text(&qimg(d, &args));
        assert_eq!(ic, Some(1), "{args:?}: {ie}");
        assert!(ie.contains("0x7fff0000"), "{args:?}: {ie}");
        assert_eq!(
            std::fs::read(&path).unwrap(),
            f,
            "{args:?} changed the file"
        );
    }
}

/// Snapshots taken while other tasks write: each write is in a snapshot whole or not at all
/// (the operation waits for requests in flight and holds new ones back), and the image stays
/// clean.
#[test]
fn snapshots_taken_during_concurrent_writes_hold_whole_writes() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("snap-concurrent");
    let d = dir.0.as_path();
    let cs = 64 * KIB;
    let n = 24u64;
    qemu_create(
        d,
        "c.qcow2",
        "cluster_size=65536,extended_l2=on",
        n * cs,
        None,
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let path = d.join("c.qcow2");
    rt.block_on(async {
        let img = OpenOptions::new().writable(true).open(&path).await.unwrap();
        let mut tasks = Vec::new();
        for k in 0..n {
            let img = img.clone();
            tasks.push(tokio::spawn(async move {
                // Three generations of each cluster, written across a subcluster boundary.
                for g in 1..=3u64 {
                    let data = vec![(k * 8 + g) as u8; (cs - 3000) as usize];
                    img.write(&data, k * cs + 1000).await.unwrap();
                    tokio::task::yield_now().await;
                }
            }));
        }
        for s in 0..3 {
            img.create_snapshot(&format!("s{s}")).await.unwrap();
            tokio::task::yield_now().await;
        }
        for t in tasks {
            t.await.unwrap();
        }
        img.close().await.unwrap();
    });
    assert_clean(d, "c.qcow2", "snapshots during writes");
    for s in 0..3 {
        let name = format!("s{s}");
        std::fs::copy(&path, d.join("a.qcow2")).unwrap();
        qimg_ok(d, &["snapshot", "-a", &name, "a.qcow2"]);
        assert_clean(d, "a.qcow2", &name);
        let raw = common::qemu_raw(d, "a.qcow2");
        for k in 0..n {
            let at = (k * cs) as usize;
            let body = &raw[at + 1000..at + (cs - 2000) as usize];
            let first = body[0];
            assert!(
                body.iter().all(|&b| b == first)
                    && (first == 0 || (first as u64 / 8 == k && (1..=3).contains(&(first % 8)))),
                "{name}: cluster {k} holds a torn or foreign write"
            );
            assert!(raw[at..at + 1000].iter().all(|&b| b == 0), "{name}: {k}");
        }
    }
}

/// A snapshot whose L1 copy needs more contiguous clusters than one refcount block covers, in
/// file space no refcount block covers yet (512-byte clusters, 64-bit refcounts: 64 clusters a
/// block; a 1 GiB disk's L1 table is 512 clusters). The allocator used to place each new
/// block at the start of its own range, inside the run it was making room for, and chased
/// the run forever. Now each block goes before the run. Hang guard: the snapshot takes well
/// under a second; the guard allows 120 s.
#[test]
fn a_snapshot_larger_than_a_refcount_block_range_is_allocated_in_fresh_space() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("bigl1");
    let opts = "cluster_size=512,refcount_bits=64";
    qemu_create(&dir.0, "a.qcow2", opts, 1024 * MIB, None);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let img = rt.block_on(async {
        let img = OpenOptions::new()
            .writable(true)
            .open(dir.path("a.qcow2"))
            .await
            .unwrap();
        img.write(&pattern(7, 300 * MIB, 100_000), 300 * MIB)
            .await
            .unwrap();
        img
    });
    // On its own task, timed from this thread: the old allocator spun without yielding (and a
    // runtime with a spinning task cannot be dropped, so it is leaked when the guard fires).
    let (tx, rx) = std::sync::mpsc::channel();
    let task = img.clone();
    rt.spawn(async move {
        let _ = tx.send(task.create_snapshot("s1").await.map(|_| ()));
    });
    let Ok(made) = rx.recv_timeout(Duration::from_secs(120)) else {
        std::mem::forget(rt);
        panic!("hang guard: the snapshot did not finish in 120 s");
    };
    made.unwrap();
    rt.block_on(async {
        // And a write over the snapshot (copy-on-write of the L2 table and the data).
        img.write(&pattern(8, 300 * MIB, 4096), 300 * MIB)
            .await
            .unwrap();
        img.close().await.unwrap();
    });
    assert_clean(&dir.0, "a.qcow2", opts);
    let list = qemu_ok(&dir.0, &["snapshot", "-l", "a.qcow2"]);
    assert!(list.contains("s1"), "{list}");
}

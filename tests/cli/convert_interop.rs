//! `qimg convert` checked with qemu-img: every output compares equal to its source with
//! `qemu-img compare`, qcow2 outputs pass `qemu-img check`, compressed outputs are compressed
//! in `qemu-img map`, zeros are never written (sparse raw, few clusters allocated), every
//! create option applies to the output, progress looks like qemu-img's, and bad input is
//! refused with a clear message and exit code 1. A backing file for the output (`-B`/`-F`)
//! leaves unallocated what qemu-img leaves unallocated, cache modes (`-t`/`-T`) change nothing
//! in the result, and several sources are concatenated as qemu-img concatenates them.

use crate::common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use common::{Scratch, assert_clean, info, map_json, ok, qemu_img, qimg};

const MIB: u64 = 1 << 20;

use common::qemu_img_create as create;
use common::qemu_io;
use qimg_testkit::{Rng, pattern};

/// `qimg convert ARGS`, which must succeed; returns stdout.
fn convert(dir: &Path, args: &[&str]) -> String {
    let mut a = vec!["convert"];
    a.extend(args);
    ok(&format!("qimg {a:?}"), &qimg(dir, &a))
}

fn assert_same(dir: &Path, a: &str, b: &str) {
    let o = qemu_img(dir, &["compare", a, b]);
    assert!(
        o.status.success(),
        "qemu-img compare {a} {b}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Guest bytes `qemu-img map` reports as data present in the image itself (depth 0).
fn allocated_data(dir: &Path, file: &str) -> u64 {
    map_json(dir, file)
        .iter()
        .filter(|e| e["data"] == true && e["depth"] == 0 && e["zero"] == false)
        .map(|e| e["length"].as_u64().unwrap())
        .sum()
}

/// Incompressible bytes.
fn noise(len: usize) -> Vec<u8> {
    Rng(0x9E37_79B9_7F4A_7C15).bytes(len)
}

fn allocated_bytes(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks() * 512
}

/// A three-deep chain made by qemu: raw base (shorter), qcow2 middle, qcow2 top, with data
/// patterns, zero clusters and discards at every level. Returns the top's name.
fn qemu_chain(d: &Path) -> &'static str {
    create(d, "raw", "", &[], "base.raw", "6M");
    qemu_io(
        d,
        "raw",
        "base.raw",
        &["write -P 1 0 1M", "write -P 2 5M 512k"],
    );
    create(
        d,
        "qcow2",
        "",
        &["-b", "base.raw", "-F", "raw"],
        "mid.qcow2",
        "12M",
    );
    qemu_io(
        d,
        "qcow2",
        "mid.qcow2",
        &[
            "write -P 3 512k 1M",
            "write -z 5M 128k",
            "write -P 4 8M 64k",
            "write -P 0 9M 1M",
        ],
    );
    create(
        d,
        "qcow2",
        "extended_l2=on",
        &["-b", "mid.qcow2", "-F", "qcow2"],
        "top.qcow2",
        "16M",
    );
    qemu_io(
        d,
        "qcow2",
        "top.qcow2",
        &[
            "write -P 5 4k 4k",
            "write -z 600k 200k",
            "write -P 6 8200k 100k",
            "write -P 7 15M 1M",
            "discard 15M 64k",
        ],
    );
    "top.qcow2"
}

#[test]
fn round_trip_qcow2_raw_extended_standard() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("conv-roundtrip");
    let d = &s.0;
    let src = qemu_chain(d);
    let before = std::fs::read(d.join(src)).unwrap();

    convert(d, &["-O", "raw", src, "a.raw"]);
    assert_same(d, src, "a.raw");
    assert_eq!(std::fs::metadata(d.join("a.raw")).unwrap().len(), 16 * MIB);

    convert(
        d,
        &[
            "-f",
            "raw",
            "-O",
            "qcow2",
            "-o",
            "extended_l2=on,cluster_size=128k",
            "a.raw",
            "b.qcow2",
        ],
    );
    assert_same(d, src, "b.qcow2");
    assert_clean(d, "b.qcow2", "b.qcow2");
    let i = info(d, "b.qcow2");
    assert_eq!(i["cluster-size"], 128 * 1024);
    assert_eq!(i["format-specific"]["data"]["extended-l2"], true, "{i}");
    assert!(i.get("backing-filename").is_none());

    convert(d, &["-O", "qcow2", "b.qcow2", "c.qcow2"]);
    assert_same(d, src, "c.qcow2");
    assert_clean(d, "c.qcow2", "c.qcow2");
    let i = info(d, "c.qcow2");
    assert_eq!(i["cluster-size"], 65536);
    assert_eq!(i["format-specific"]["data"]["extended-l2"], false, "{i}");

    // Straight from the chain to qcow2 too, and with every flag spelled out.
    convert(
        d,
        &[
            "-f", "qcow2", "-O", "qcow2", "-U", "-q", "-m", "3", src, "d.qcow2",
        ],
    );
    assert_same(d, src, "d.qcow2");
    assert_clean(d, "d.qcow2", "d.qcow2");
    convert(
        d,
        &["-W", "-O", "qcow2", "-o", "compat=0.10", src, "v2.qcow2"],
    );
    assert_same(d, src, "v2.qcow2");
    assert_clean(d, "v2.qcow2", "v2.qcow2");
    assert_eq!(
        info(d, "v2.qcow2")["format-specific"]["data"]["compat"],
        "0.10"
    );

    // The source chain is untouched, and the outputs hold only data (the 1 MiB of zeros
    // written as data in the middle image is not copied).
    assert_eq!(std::fs::read(d.join(src)).unwrap(), before);
    let data = allocated_data(d, "c.qcow2");
    assert!(data <= 5 * MIB, "{data} bytes of data allocated");
}

#[test]
fn compressed_outputs_zlib_and_zstd() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("conv-compress");
    let d = &s.0;
    create(d, "qcow2", "", &[], "src.qcow2", "5M");
    // Compressible patterns, an incompressible cluster, zeros and an odd tail.
    qemu_io(
        d,
        "qcow2",
        "src.qcow2",
        &["write -P 1 0 1M", "write -P 2 2M 192k", "write -z 3M 1M"],
    );
    let img = qimg::OpenOptions::new()
        .writable(true)
        .open_blocking(d.join("src.qcow2"))
        .unwrap();
    img.write(&noise(65536), 4 * MIB + 65536).unwrap();
    img.close().unwrap();
    for (name, opts) in [
        ("zlib.qcow2", "compression_type=zlib"),
        ("zstd.qcow2", "compression_type=zstd"),
        ("zstd-ext.qcow2", "compression_type=zstd,extended_l2=on"),
    ] {
        convert(d, &["-c", "-O", "qcow2", "-o", opts, "src.qcow2", name]);
        assert_same(d, "src.qcow2", name);
        assert_clean(d, name, name);
        let want = opts.split(',').next().unwrap().split('=').nth(1).unwrap();
        assert_eq!(
            info(d, name)["format-specific"]["data"]["compression-type"],
            want
        );
        let m = map_json(d, name);
        let compressed: u64 = m
            .iter()
            .filter(|e| e["compressed"] == true)
            .map(|e| e["length"].as_u64().unwrap())
            .sum();
        assert!(
            compressed >= MIB + 192 * 1024,
            "{name}: {compressed} compressed bytes: {m:?}"
        );
        // The random cluster does not shrink: it is stored as plain data.
        let plain = m.iter().any(|e| {
            e["compressed"] == false
                && e["data"] == true
                && e["start"].as_u64().unwrap() <= 4 * MIB + 65536
                && e["start"].as_u64().unwrap() + e["length"].as_u64().unwrap() >= 4 * MIB + 131072
        });
        assert!(
            plain,
            "{name}: the incompressible cluster is not plain data: {m:?}"
        );
        let len = std::fs::metadata(d.join(name)).unwrap().len();
        assert!(len < 1024 * 1024, "{name} is {len} bytes");
    }
    // Compressed back to plain.
    convert(d, &["-O", "qcow2", "zstd.qcow2", "plain.qcow2"]);
    assert_same(d, "src.qcow2", "plain.qcow2");
    assert_clean(d, "plain.qcow2", "plain.qcow2");
    assert!(
        map_json(d, "plain.qcow2")
            .iter()
            .all(|e| e["compressed"] == false)
    );
}

#[test]
fn zeros_are_never_written() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("conv-zeros");
    let d = &s.0;
    // 1 GiB, 3 MiB of data, 10 MiB of zeros written as data, zero clusters.
    create(d, "qcow2", "", &[], "big.qcow2", "1G");
    qemu_io(
        d,
        "qcow2",
        "big.qcow2",
        &[
            "write -P 1 0 1M",
            "write -P 0 100M 10M",
            "write -z 200M 100M",
            "write -P 2 700M 2M",
            "write -P 3 1023M 4k",
        ],
    );
    let data = 3 * MIB + 4096;
    convert(d, &["-O", "qcow2", "big.qcow2", "out.qcow2"]);
    assert_same(d, "big.qcow2", "out.qcow2");
    assert_clean(d, "out.qcow2", "out.qcow2");
    let got = allocated_data(d, "out.qcow2");
    assert!(
        (data..=data + 64 * 1024).contains(&got),
        "{got} bytes of data allocated"
    );
    let size = std::fs::metadata(d.join("out.qcow2")).unwrap().len();
    assert!(size < 4 * MIB, "output is {size} bytes");

    // Subcluster granularity: 4 KiB pieces land in 4 KiB subclusters.
    convert(
        d,
        &[
            "-O",
            "qcow2",
            "-o",
            "extended_l2=on,cluster_size=128k",
            "big.qcow2",
            "ext.qcow2",
        ],
    );
    assert_same(d, "big.qcow2", "ext.qcow2");
    assert_clean(d, "ext.qcow2", "ext.qcow2");
    assert_eq!(allocated_data(d, "ext.qcow2"), data);

    // Raw output is sparse: holes instead of zeros.
    convert(d, &["big.qcow2", "out.raw"]);
    assert_same(d, "big.qcow2", "out.raw");
    let a = allocated_bytes(&d.join("out.raw"));
    assert_eq!(std::fs::metadata(d.join("out.raw")).unwrap().len(), 1 << 30);
    assert!(a <= data + 64 * 1024, "raw output allocates {a} bytes");

    // -S 0 writes everything.
    create(d, "qcow2", "", &[], "small.qcow2", "4M");
    qemu_io(d, "qcow2", "small.qcow2", &["write -P 1 0 64k"]);
    convert(d, &["-S", "0", "-O", "qcow2", "small.qcow2", "full.qcow2"]);
    assert_same(d, "small.qcow2", "full.qcow2");
    assert_eq!(allocated_data(d, "full.qcow2"), 4 * MIB);
}

#[test]
fn raw_sources_and_qimg_made_images() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("conv-raw");
    let d = &s.0;
    // A raw file with holes and an odd size (read as rounded up to 512, like qemu).
    let f = std::fs::File::create(d.join("src.raw")).unwrap();
    f.set_len(3 * MIB + 1000).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &pattern(1, 0, 70_000), MIB).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &pattern(2, 0, 1000), 3 * MIB).unwrap();
    drop(f);
    convert(d, &["-O", "qcow2", "src.raw", "a.qcow2"]);
    assert_same(d, "src.raw", "a.qcow2");
    assert_clean(d, "a.qcow2", "a.qcow2");
    assert_eq!(info(d, "a.qcow2")["virtual-size"], 3 * MIB + 1024);
    convert(d, &["-O", "raw", "a.qcow2", "b.raw"]);
    assert_same(d, "src.raw", "b.raw");

    // An image written by the qimg library, converted with options qemu then reads.
    ok(
        "qimg create",
        &qimg(
            d,
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-o",
                "extended_l2=on,cluster_size=64k",
                "q.qcow2",
                "8M",
            ],
        ),
    );
    let img = qimg::OpenOptions::new()
        .writable(true)
        .open_blocking(d.join("q.qcow2"))
        .unwrap();
    img.write(&pattern(3, 0, 5000), 12_345).unwrap();
    img.write(&pattern(4, 0, MIB as usize), 3 * MIB).unwrap();
    img.write_zeroes(3 * MIB + 4096, 8192).unwrap();
    img.close().unwrap();
    for (name, opts) in [
        ("p-meta.qcow2", "preallocation=metadata"),
        ("p-falloc.qcow2", "preallocation=falloc,cluster_size=4k"),
        ("rb1.qcow2", "refcount_bits=1,lazy_refcounts=on"),
        ("df.qcow2", "data_file=df.data"),
    ] {
        convert(d, &["-O", "qcow2", "-o", opts, "q.qcow2", name]);
        assert_same(d, "q.qcow2", name);
        assert_clean(d, name, name);
    }
}

#[test]
fn into_an_existing_image_with_n() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("conv-n");
    let d = &s.0;
    let src = qemu_chain(d);
    create(d, "qcow2", "", &[], "old.qcow2", "16M");
    qemu_io(d, "qcow2", "old.qcow2", &["write -P 9 0 16M"]);
    convert(d, &["-n", "-O", "qcow2", src, "old.qcow2"]);
    assert_same(d, src, "old.qcow2");
    assert_clean(d, "old.qcow2", "old.qcow2");
    std::fs::write(d.join("old.raw"), vec![0xa5u8; 16 << 20]).unwrap();
    convert(d, &["-n", src, "old.raw"]);
    assert_same(d, src, "old.raw");
}

#[test]
fn progress_is_printed_like_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("conv-progress");
    let d = &s.0;
    create(d, "qcow2", "", &[], "src.qcow2", "64M");
    qemu_io(
        d,
        "qcow2",
        "src.qcow2",
        &["write -P 1 0 20M", "write -P 2 40M 10M"],
    );
    let out = convert(d, &["-p", "-O", "qcow2", "src.qcow2", "a.qcow2"]);
    let want = ok(
        "qemu-img convert -p",
        &qemu_img(d, &["convert", "-p", "-O", "qcow2", "src.qcow2", "b.qcow2"]),
    );
    for text in [&out, &want] {
        assert!(text.starts_with("    (0.00/100%)\r"), "{text:?}");
        assert!(text.ends_with("    (100.00/100%)\r\n"), "{text:?}");
    }
    let steps = out.split('\r').count();
    assert!(steps > 10, "only {steps} progress updates: {out:?}");
    assert_same(d, "src.qcow2", "a.qcow2");
    // -q silences it; without -p nothing is printed.
    assert_eq!(
        convert(d, &["-p", "-q", "-O", "qcow2", "src.qcow2", "c.qcow2"]),
        ""
    );
    assert_eq!(convert(d, &["-O", "qcow2", "src.qcow2", "e.qcow2"]), "");
}

#[test]
fn bad_input_is_refused_clearly() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("conv-bad");
    let d = &s.0;
    create(d, "qcow2", "", &[], "src.qcow2", "4M");
    qemu_io(d, "qcow2", "src.qcow2", &["write -P 1 0 64k"]);
    let before = std::fs::read(d.join("src.qcow2")).unwrap();
    let fails = |args: &[&str], needle: &str| {
        let mut a = vec!["convert"];
        a.extend(args);
        let o = qimg(d, &a);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err:?} lacks {needle:?}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    };
    fails(
        &["-O", "qcow2", "missing.qcow2", "x.qcow2"],
        "Could not open 'missing.qcow2': No such file or directory",
    );
    fails(
        &["-O", "vmdk", "src.qcow2", "x"],
        "Unknown file format 'vmdk'",
    );
    fails(&["-f", "vmdk", "src.qcow2", "x"], "Unknown driver 'vmdk'");
    fails(
        &["-O", "qcow2", "-o", "bogus=1", "src.qcow2", "x"],
        "Invalid parameter 'bogus'",
    );
    fails(
        &["-O", "qcow2", "-o", "cluster_size=3k", "src.qcow2", "x"],
        "Cluster size must be a power of two",
    );
    fails(
        &[
            "-O",
            "qcow2",
            "-o",
            "extended_l2=on,compat=0.10",
            "src.qcow2",
            "x",
        ],
        "Extended L2 entries are only supported with compatibility level 1.1",
    );
    fails(
        &["-c", "-O", "raw", "src.qcow2", "x"],
        "Compression not supported for this file format",
    );
    fails(
        &["-S", "100", "src.qcow2", "x"],
        "Invalid buffer size for sparse output",
    );
    fails(
        &["-m", "0", "src.qcow2", "x"],
        "Invalid number of coroutines",
    );
    fails(&["src.qcow2"], "Must specify image file name");
    fails(
        &["-n", "-O", "qcow2", "src.qcow2", "none.qcow2"],
        "Could not open 'none.qcow2': No such file or directory",
    );
    create(d, "qcow2", "", &[], "tiny.qcow2", "1M");
    fails(
        &["-n", "-O", "qcow2", "src.qcow2", "tiny.qcow2"],
        "output file is smaller than input file",
    );
    // Never overwrite the source (or a file of its chain) while reading it.
    fails(
        &["-O", "qcow2", "src.qcow2", "./src.qcow2"],
        "the output is the source image",
    );
    create(
        d,
        "qcow2",
        "",
        &["-b", "src.qcow2", "-F", "qcow2"],
        "top.qcow2",
        "",
    );
    fails(
        &["-O", "raw", "top.qcow2", "src.qcow2"],
        "the output is the source image or a file of its backing chain",
    );
    assert_eq!(std::fs::read(d.join("src.qcow2")).unwrap(), before);
    // A damaged source: an L2 table offset that is not aligned. It opens (as in QEMU) and
    // the read that needs the table fails, naming it.
    let mut bytes = before.clone();
    let l1 = u64::from_be_bytes(bytes[40..48].try_into().unwrap()) as usize;
    bytes[l1..l1 + 8].copy_from_slice(&((1u64 << 63) | 0x50200).to_be_bytes());
    std::fs::write(d.join("bad.qcow2"), &bytes).unwrap();
    fails(
        &["-O", "raw", "bad.qcow2", "y.raw"],
        "bad.qcow2: L2 table offset 0x50200 unaligned (L1 index: 0)",
    );
    // -o help lists the options and converts nothing.
    let help = convert(d, &["-O", "qcow2", "-o", "help", "src.qcow2", "z"]);
    assert!(help.contains("extended_l2"), "{help}");
    assert!(!d.join("z").exists());
}

/// `qemu-img map` of `file` without host offsets, adjacent entries that agree merged (where
/// clusters land in the file differs between qemu and qimg; what is allocated where must not).
fn layout(dir: &Path, file: &str) -> Vec<(u64, u64, u64, bool, bool, bool, bool)> {
    let mut v: Vec<(u64, u64, u64, bool, bool, bool, bool)> = Vec::new();
    for e in map_json(dir, file) {
        let f = |k: &str| e[k].as_bool().unwrap();
        let (start, len) = (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap());
        let key = (
            e["depth"].as_u64().unwrap(),
            f("present"),
            f("zero"),
            f("data"),
            f("compressed"),
        );
        if let Some(last) = v.last_mut() {
            if (last.2, last.3, last.4, last.5, last.6) == key && last.0 + last.1 == start {
                last.1 += len;
                continue;
            }
        }
        v.push((start, len, key.0, key.1, key.2, key.3, key.4));
    }
    v
}

/// Runs `qemu-img convert ARGS QEMU_OUT` and `qimg convert ARGS QIMG_OUT` (both must succeed).
fn convert_both(dir: &Path, args: &[&str], qemu_out: &str, qimg_out: &str) {
    let mut a = vec!["convert"];
    a.extend(args);
    a.push(qemu_out);
    ok(&format!("qemu-img {a:?}"), &qemu_img(dir, &a));
    let mut b = args.to_vec();
    b.push(qimg_out);
    convert(dir, &b);
}

/// Both `qemu-img convert ARGS` and `qimg convert ARGS` fail with exit code 1 and the same
/// message (after the program name).
fn refused_like_qemu(dir: &Path, args: &[&str]) {
    let mut a = vec!["convert"];
    a.extend(args);
    let q = qemu_img(dir, &a);
    let i = qimg(dir, &a);
    let msg = |o: &std::process::Output, prefix: &str| {
        let e = String::from_utf8_lossy(&o.stderr).into_owned();
        e.lines()
            .next()
            .unwrap_or("")
            .strip_prefix(prefix)
            .unwrap_or(&e)
            .to_string()
    };
    assert_eq!(q.status.code(), Some(1), "qemu-img {a:?} did not fail");
    assert_eq!(i.status.code(), Some(1), "qimg {a:?} did not fail");
    assert_eq!(
        msg(&i, "qimg: "),
        msg(&q, "qemu-img: "),
        "qimg {a:?} fails unlike qemu-img"
    );
}

/// A base and an overlay made by qemu: the overlay (16 KiB clusters, subclusters) is larger
/// than its base and holds data, zeros, data that reads as zeros and a discard, some of each
/// past the end of the base; `other.qcow2` is a full image of another pattern.
fn overlay_over_base(d: &Path) {
    create(d, "qcow2", "", &[], "base.qcow2", "3M");
    qemu_io(
        d,
        "qcow2",
        "base.qcow2",
        &["write -P 1 0 2M", "write -P 2 2560k 512k"],
    );
    create(
        d,
        "qcow2",
        "cluster_size=16384,extended_l2=on",
        &["-b", "base.qcow2", "-F", "qcow2"],
        "ov.qcow2",
        "5M",
    );
    qemu_io(
        d,
        "qcow2",
        "ov.qcow2",
        &[
            "write -P 5 1k 2k",
            "write -z 100k 8k",
            "write -P 0 960k 128k",
            "write -P 6 2900k 300k",
            "discard 2600k 16k",
            "write -P 0 4M 4k",
            "write -P 7 4100k 5k",
            "write -z 4400k 64k",
        ],
    );
    create(d, "qcow2", "", &[], "other.qcow2", "5M");
    qemu_io(d, "qcow2", "other.qcow2", &["write -P 9 0 5M"]);
}

#[test]
fn backing_file_for_the_output_like_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("conv-backing");
    let d = &s.0;
    overlay_over_base(d);
    let cases: [&[&str]; 7] = [
        &["-O", "qcow2", "-B", "base.qcow2", "-F", "qcow2"],
        // Another backing file than the source's: only the source's top is copied.
        &["-O", "qcow2", "-B", "other.qcow2", "-F", "qcow2"],
        &["-O", "qcow2", "-B", "base.qcow2", "-F", "raw"],
        &["-O", "qcow2", "-c", "-B", "other.qcow2", "-F", "qcow2"],
        &["-O", "qcow2", "-S", "0", "-B", "base.qcow2", "-F", "qcow2"],
        &[
            "-O",
            "qcow2",
            "-o",
            "cluster_size=16384,extended_l2=on",
            "-B",
            "other.qcow2",
            "-F",
            "qcow2",
        ],
        // -o backing_file is -B, and -F wins over -o backing_fmt.
        &[
            "-O",
            "qcow2",
            "-o",
            "backing_file=base.qcow2,backing_fmt=raw",
            "-F",
            "qcow2",
        ],
    ];
    for (i, args) in cases.iter().enumerate() {
        let mut args = args.to_vec();
        args.push("ov.qcow2");
        let (q, m) = (format!("q{i}.qcow2"), format!("m{i}.qcow2"));
        convert_both(d, &args, &q, &m);
        assert_same(d, &q, &m);
        if [0, 4, 6].contains(&i) {
            // Over the source's own base, the guest sees the source.
            assert_same(d, "ov.qcow2", &m);
        }
        assert_clean(d, &m, &m);
        assert_eq!(layout(d, &m), layout(d, &q), "{args:?}");
        let (qi, mi) = (info(d, &q), info(d, &m));
        for k in [
            "virtual-size",
            "backing-filename",
            "backing-filename-format",
            "full-backing-filename",
        ] {
            assert_eq!(mi[k], qi[k], "{args:?}: {k}");
        }
    }
    // The backing file really is used: only the top's ranges are allocated.
    assert!(allocated_data(d, "m0.qcow2") < 1 << 20);

    // With -n, -B keeps the target's header and copies only the top's ranges.
    for f in ["nq.qcow2", "nm.qcow2"] {
        create(d, "qcow2", "", &[], f, "5M");
    }
    let mut a = vec!["convert", "-n", "-O", "qcow2", "-B", "other.qcow2"];
    a.extend(["ov.qcow2", "nq.qcow2"]);
    ok("qemu-img convert -n -B", &qemu_img(d, &a));
    convert(
        d,
        &[
            "-n",
            "-O",
            "qcow2",
            "-B",
            "other.qcow2",
            "ov.qcow2",
            "nm.qcow2",
        ],
    );
    assert_same(d, "nq.qcow2", "nm.qcow2");
    assert_clean(d, "nm.qcow2", "nm.qcow2");
    assert!(info(d, "nm.qcow2").get("backing-filename").is_none());

    // Refusals, with qemu-img's messages.
    create(d, "raw", "", &[], "r.raw", "1M");
    for args in [
        &["-O", "raw", "-B", "base.qcow2", "ov.qcow2", "x1"][..],
        &["-O", "raw", "-F", "qcow2", "ov.qcow2", "x2"],
        &["-O", "qcow2", "-F", "qcow2", "ov.qcow2", "x3.qcow2"],
        &["-O", "qcow2", "-B", "base.qcow2", "ov.qcow2", "x4.qcow2"],
        &[
            "-O",
            "qcow2",
            "-B",
            "base.qcow2",
            "-F",
            "qcow2",
            "ov.qcow2",
            "r.raw",
            "x5.qcow2",
        ],
    ] {
        refused_like_qemu(d, args);
    }
    let o = qimg(
        d,
        &[
            "convert",
            "-O",
            "qcow2",
            "-B",
            "none.qcow2",
            "-F",
            "qcow2",
            "ov.qcow2",
            "x6",
        ],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("none.qcow2"));
}

#[test]
fn cache_modes_change_nothing_in_the_output() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("conv-cache");
    let d = &s.0;
    let src = qemu_chain(d);
    create(d, "raw", "", &[], "plain.raw", "3M");
    qemu_io(d, "raw", "plain.raw", &["write -P 3 4k 1M"]);
    convert(d, &["-O", "qcow2", src, "ref.qcow2"]);
    convert(d, &["-O", "qcow2", "plain.raw", "ref2.qcow2"]);
    let mut direct_ok = true;
    for mode in ["none", "writeback", "writethrough", "directsync", "unsafe"] {
        for (fmt, ext) in [("qcow2", "qcow2"), ("raw", "raw")] {
            for (input, reference) in [(src, "ref.qcow2"), ("plain.raw", "ref2.qcow2")] {
                let out = format!("{mode}-{input}.{ext}");
                let o = qimg(
                    d,
                    &["convert", "-O", fmt, "-t", mode, "-T", mode, input, &out],
                );
                let err = String::from_utf8_lossy(&o.stderr).into_owned();
                if !o.status.success()
                    && (mode == "none" || mode == "directsync")
                    && (err.contains("O_DIRECT") || err.contains("Invalid argument"))
                {
                    direct_ok = false;
                    println!("skipped -t {mode}: O_DIRECT unsupported here: {err}");
                    continue;
                }
                assert!(
                    o.status.success(),
                    "-t {mode} -T {mode} {input} -> {fmt}: {err}"
                );
                assert_same(d, reference, &out);
                if fmt == "qcow2" {
                    assert_clean(d, &out, &out);
                    assert_eq!(layout(d, &out), layout(d, reference), "-t {mode}");
                }
            }
        }
    }
    if direct_ok {
        // The same with qemu-img's O_DIRECT conversion.
        convert_both(
            d,
            &["-O", "qcow2", "-t", "none", "-T", "none", src],
            "qn.qcow2",
            "mn.qcow2",
        );
        assert_same(d, "qn.qcow2", "mn.qcow2");
    }
    refused_like_qemu(d, &["-t", "bogus", src, "x.raw"]);
    refused_like_qemu(d, &["-T", "fast", src, "y.raw"]);
    assert!(!d.join("y.raw").exists());
}

#[test]
fn several_sources_are_concatenated() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("conv-concat");
    let d = &s.0;
    // Sizes are multiples of 512 but not of any cluster size; data touches every end.
    create(d, "qcow2", "", &[], "a.qcow2", "1025k");
    qemu_io(
        d,
        "qcow2",
        "a.qcow2",
        &["write -P 1 0 64k", "write -P 2 1000k 25k"],
    );
    create(d, "raw", "", &[], "b.raw", "6655k");
    qemu_io(
        d,
        "raw",
        "b.raw",
        &[
            "write -P 3 0 3k",
            "write -P 4 1M 2M",
            "write -P 5 4M 2M",
            "write -P 6 6654k 1k",
        ],
    );
    create(d, "raw", "", &[], "c-base.raw", "200k");
    qemu_io(d, "raw", "c-base.raw", &["write -P 7 0 200k"]);
    create(
        d,
        "qcow2",
        "cluster_size=16384,extended_l2=on",
        &["-b", "c-base.raw", "-F", "raw"],
        "c.qcow2",
        "333k",
    );
    qemu_io(
        d,
        "qcow2",
        "c.qcow2",
        &["write -z 0 4k", "write -P 8 300k 33k"],
    );
    let srcs = ["a.qcow2", "b.raw", "c.qcow2"];
    for (i, extra) in [
        &["-O", "qcow2"][..],
        &["-O", "raw"],
        &["-O", "qcow2", "-c"],
        &["-O", "qcow2", "-o", "cluster_size=4096", "-W"],
        &["-O", "qcow2", "-S", "0"],
    ]
    .iter()
    .enumerate()
    {
        let mut args = extra.to_vec();
        args.extend(srcs);
        let (q, m) = (format!("q{i}"), format!("m{i}"));
        convert_both(d, &args, &q, &m);
        assert_same(d, &q, &m);
        assert_eq!(info(d, &m)["virtual-size"], info(d, &q)["virtual-size"]);
        if extra.contains(&"qcow2") {
            assert_clean(d, &m, &m);
        }
    }
    // Two sources of the same format, and -n into a larger image holding old data.
    convert_both(d, &["-O", "qcow2", "c.qcow2", "a.qcow2"], "q5", "m5");
    assert_same(d, "q5", "m5");
    for f in ["nq.qcow2", "nm.qcow2"] {
        create(d, "qcow2", "", &[], f, "9M");
        qemu_io(d, "qcow2", f, &["write -P 9 0 9M"]);
    }
    let mut a = vec!["convert", "-n", "-O", "qcow2"];
    a.extend(srcs);
    a.push("nq.qcow2");
    ok("qemu-img convert -n", &qemu_img(d, &a));
    let mut b = vec!["-n", "-O", "qcow2"];
    b.extend(srcs);
    b.push("nm.qcow2");
    convert(d, &b);
    assert_same(d, "nq.qcow2", "nm.qcow2");
    assert_clean(d, "nm.qcow2", "nm.qcow2");
    // Too small a target for all of them.
    create(d, "qcow2", "", &[], "small.qcow2", "7M");
    let mut c = vec!["-n", "-O", "qcow2"];
    c.extend(srcs);
    c.push("small.qcow2");
    let o = qimg(d, &[&["convert"][..], &c].concat());
    assert_eq!(o.status.code(), Some(1));
    // Progress counts every source: the small first one does not take it to 100%.
    let out = convert(
        d,
        &[
            "-p", "-m", "1", "-O", "qcow2", "a.qcow2", "b.raw", "p.qcow2",
        ],
    );
    let pcts: Vec<f64> = out
        .split('\r')
        .filter_map(|s| {
            s.trim()
                .strip_prefix('(')?
                .strip_suffix("/100%)")?
                .parse()
                .ok()
        })
        .collect();
    assert!(
        pcts.iter().any(|&p| p > 0.0 && p < 100.0),
        "no progress between 0 and 100%: {out:?}"
    );
    assert!(pcts.windows(2).all(|w| w[0] <= w[1]), "{out:?}");
    assert_eq!(pcts.last(), Some(&100.0), "{out:?}");
}

#[test]
fn copy_offloading_with_c_like_qemu_img() {
    qimg_testkit::require_qemu!();
    let d = Scratch::new("convert-offload");
    let dir = &d.0;
    // A chain (data in every layer, zeros, a discard), a compressed cluster, a raw source.
    let top = qemu_chain(dir);
    create(dir, "qcow2", "cluster_size=64k", &[], "c.qcow2", "8M");
    qemu_io(
        dir,
        "qcow2",
        "c.qcow2",
        &[
            "write -P 0 0 64k",
            "write -c -P 9 1M 64k",
            "write -P 8 3M 200k",
        ],
    );
    create(dir, "raw", "", &[], "r.raw", "3M");
    qemu_io(dir, "raw", "r.raw", &["write -P 4 1M 512k"]);
    for (src, fmt) in [(top, "qcow2"), ("c.qcow2", "qcow2"), ("r.raw", "raw")] {
        for (out_fmt, t) in [
            ("raw", "writeback"),
            ("raw", "none"),
            ("qcow2", "writeback"),
        ] {
            let (q, i) = (format!("q-{src}.{out_fmt}"), format!("i-{src}.{out_fmt}"));
            convert_both(dir, &["-C", "-f", fmt, "-O", out_fmt, "-t", t, src], &q, &i);
            let o = qemu_img(dir, &["compare", "-f", fmt, "-F", out_fmt, src, &i]);
            assert!(
                o.status.success(),
                "{src} -> {out_fmt} ({t}): {}",
                String::from_utf8_lossy(&o.stdout)
            );
            // Data ranges are copied whole, zero ranges left out: what is data and what is a
            // hole in the output is what qemu-img -C makes. (With O_DIRECT qemu-img falls
            // back to writing zeros where the source file has a hole inside a data cluster,
            // which the kernel's copy keeps a hole: the same guest bytes either way. A qcow2
            // output's clusters differ in what their host file holds: qimg leaves the unwritten
            // part of a new cluster as reserved space, qemu-img writes zeros there.)
            if t != "none" && out_fmt == "raw" {
                assert_eq!(
                    layout(dir, &i),
                    layout(dir, &q),
                    "{src} -> {out_fmt} ({t}): allocation differs from qemu-img -C"
                );
            }
            if out_fmt == "qcow2" {
                assert_clean(dir, &i, "convert -C");
            }
        }
    }
    refused_like_qemu(dir, &["-C", "-c", "-O", "qcow2", "c.qcow2", "x.qcow2"]);
    refused_like_qemu(dir, &["-C", "-S", "8k", "c.qcow2", "x.raw"]);
    refused_like_qemu(dir, &["-C", "-S", "0", "c.qcow2", "x.raw"]);
}

/// `qimg dd` as `qemu-img dd`, run through the binary linked as qemu-img: on a qcow2 image
/// over a backing file and on a raw file, with block sizes, counts and skips (a skip past the
/// end warns and leaves an empty output), raw and qcow2 outputs, and each refusal: the same
/// stdout, stderr and exit status, the same output bytes (raw) or guest data (qcow2).
#[test]
fn dd_matches_qemu_img_dd() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("dd");
    let d = &s.0;
    let bin = s.path("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::os::unix::fs::symlink(common::qimg_bin(), bin.join("qemu-img")).unwrap();
    common::qemu_img_create(d, "qcow2", "", &[], "base.qcow2", "3M");
    qemu_io(d, "qcow2", "base.qcow2", &["write -P 1 0 3M"]);
    common::qemu_img_create(
        d,
        "qcow2",
        "extended_l2=on",
        &["-b", "base.qcow2", "-F", "qcow2"],
        "top.qcow2",
        "4M",
    );
    qemu_io(
        d,
        "qcow2",
        "top.qcow2",
        &["write -P 2 1M 100k", "write -z 2M 64k"],
    );
    std::fs::write(s.path("in.raw"), pattern(3, 0, 300_000)).unwrap();
    let cases: Vec<Vec<&str>> = vec![
        vec!["dd", "if=top.qcow2", "of=out"],
        vec!["dd", "if=top.qcow2", "of=out", "bs=64k", "count=20"],
        vec!["dd", "if=top.qcow2", "of=out", "bs=1.5k", "skip=700"],
        vec![
            "dd",
            "if=top.qcow2",
            "of=out",
            "bs=64k",
            "skip=2",
            "count=30",
        ],
        vec!["dd", "if=top.qcow2", "of=out", "bs=1M", "skip=9"],
        vec![
            "dd",
            "-O",
            "qcow2",
            "if=top.qcow2",
            "of=out",
            "bs=256k",
            "skip=3",
        ],
        vec![
            "dd",
            "-f",
            "raw",
            "if=in.raw",
            "of=out",
            "bs=4096",
            "count=7",
        ],
        vec!["dd", "if=in.raw", "of=out", "bs=3"],
        vec!["dd", "if=top.qcow2"],
        vec!["dd", "if=top.qcow2", "of=out", "bs=0"],
        vec!["dd", "if=top.qcow2", "of=out", "bs=abc"],
        vec!["dd", "if=top.qcow2", "of=out", "count=1k"],
        vec!["dd", "if=top.qcow2", "of=out", "skip=-1"],
        vec!["dd", "if=top.qcow2", "of=out", "foo=1"],
        vec!["dd", "if=missing.qcow2", "of=out"],
    ];
    for args in cases {
        let _ = std::fs::remove_file(s.path("out"));
        let theirs = qemu_img(d, &args);
        let theirs_out = std::fs::read(s.path("out")).ok();
        if theirs_out.is_some() {
            std::fs::rename(s.path("out"), s.path("theirs")).unwrap();
        }
        let ours = common::run(d, &bin.join("qemu-img"), &args);
        let ours_out = std::fs::read(s.path("out")).ok();
        let text = |o: &std::process::Output| {
            (
                String::from_utf8_lossy(&o.stdout).into_owned(),
                String::from_utf8_lossy(&o.stderr).into_owned(),
                o.status.code(),
            )
        };
        assert_eq!(text(&ours), text(&theirs), "{args:?}");
        assert_eq!(
            ours_out.is_some(),
            theirs_out.is_some(),
            "{args:?}: output file"
        );
        if ours_out.is_none() {
            continue;
        }
        if args.contains(&"qcow2") && args[1] == "-O" {
            let o = qemu_img(d, &["compare", "out", "theirs"]);
            assert!(
                o.status.success(),
                "{args:?}: {}",
                String::from_utf8_lossy(&o.stdout)
            );
            assert_clean(d, "out", &format!("{args:?}"));
        } else {
            assert!(ours_out == theirs_out, "{args:?}: output bytes differ");
        }
    }
}

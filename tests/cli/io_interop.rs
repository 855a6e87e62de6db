//! `qimg io` against `qemu-io`: the same command scripts run through both on copies of the
//! same image (standard and extended L2 entries, 64 KiB and 2 MiB clusters, with and
//! without a backing file) must print the same standard output and error (once the timing
//! figures of the rate lines are masked), exit with the same status, leave images that
//! `qemu-img compare` finds equal, that `qemu-img check` finds clean and whose
//! `qemu-img map --output=json` agrees but for host offsets. Version 2 images
//! run the write-zeroes and discard scripts too.
//!
//! Where qimg's engine cannot do what QEMU does, a test says so explicitly: `write -z`
//! without `-u` frees the host cluster (QEMU keeps it), zeroing the last allocated
//! subclusters of a cluster frees it too (QEMU keeps it), and `truncate` cannot shrink.

use crate::common;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::{QEMU_IO, Scratch, assert_clean, ok, qemu_img, qimg_bin, run};

/// The image layouts every script runs on: name and qemu-img create options.
const LAYOUTS: &[(&str, &str)] = &[
    ("std-64k", "cluster_size=64k"),
    ("ext-64k", "cluster_size=64k,extended_l2=on"),
    ("std-2m", "cluster_size=2M"),
    ("ext-2m", "cluster_size=2M,extended_l2=on"),
];

/// Disk size of the test images.
const SIZE: &str = "8M";

/// The command scripts, by name.
const SCRIPTS: &[(&str, &[&str])] = &[
    (
        "patterns",
        &[
            "write -P 0xab 0 64k",
            "read -P 0xab 0 64k",
            "write -P 0x5a 100k 3k",
            "read -v 100k 40",
            "read -v 102390 20",
            "read -P 0x5a -s 1k -l 1k 100k 3k",
            "read -C 0 4k",
            "write -C -P 0x41 4k 16",
            "read -v 4k 20",
            "read -q -P 0xab 8k 4k",
            "write -q 200k 512",
            "read -P 0xcd 200k 512",
            "r -P 0xab 0 1",
            "w -P 0xab 1 1",
            "write -s pattern.bin 300k 10",
            "read -v 300k 16",
            "write -s pattern.bin 301k 1k",
            "write -s empty.bin 0 1",
            "write -s nonexist.bin 0 1",
            "write -s pattern.bin -P 1 0 1",
            "length",
            "info",
            "i",
        ],
    ),
    (
        "overwrite",
        &[
            "write -P 1 0 256k",
            "write -P 2 64k 64k",
            "write -P 3 4k 1k",
            "read -P 1 0 4k",
            "read -P 3 4k 1k",
            "read -P 2 64k 64k",
            "read -P 1 128k 128k",
            "write -P 4 2M 3M",
            "write -P 5 2100k 1k",
            "read -P 4 2M 100k",
            "read -P 5 2100k 1k",
            "read -P 4 2101k 2M",
            "map",
            "alloc 0 512k",
            "alloc 2M 4M",
        ],
    ),
    (
        "zero",
        &[
            "write -P 7 0 3M",
            "write -z 0 64k",
            "write -z 1M 2M",
            "write -z 8k 4k",
            "write -z 5M 1M",
            "read -P 0 0 64k",
            "read -P 0 1M 2M",
            "read -P 7 64k 8k",
            "read -P 0 5M 1M",
            "map",
            "alloc 0 8M",
        ],
    ),
    (
        "zero-unmap",
        &[
            "write -P 7 0 3M",
            "write -z -u 0 2M",
            "write -z -u 2M 64k",
            "write -z -u 4k 4k",
            "write -z -u 6M 2M",
            "read -P 0 0 2M",
            "read -P 0 2M 64k",
            "read -P 0 6M 2M",
            "read -P 7 2240k 128k",
            "map",
            "alloc 0 8M",
        ],
    ),
    (
        "discard",
        &[
            "write -P 9 0 4M",
            "discard 0 64k",
            "discard 1M 2M",
            "discard 100k 1k",
            "discard 6M 2M",
            "discard -q 4M 64k",
            "discard -C 3M 1",
            "read -P 0 1M 2M",
            "read -P 9 3M 1M",
            "read -P 9 64k 64k",
            "map",
            "alloc 0 8M",
            "alloc 6M 2M",
        ],
    ),
    (
        "compressed",
        &[
            "write -c -P 0x33 2M 2M",
            "read -P 0x33 2M 2M",
            "write -c 4M 64k",
            "write -c 4k 64k",
            "write -c -P 0x33 2M 2M",
            "write -c 0x7f0000 64k",
            "write -c -q 6M 2M",
            "read -P 0xcd 6M 2M",
            "write -P 0x34 2M 4k",
            "read -P 0x34 2M 4k",
            "read -P 0x33 2052k 60k",
            "map",
            "alloc 0 8M",
        ],
    ),
    (
        "vectored",
        &[
            "writev -P 0x44 0 1k 3k 60k",
            "readv -P 0x44 0 32k 32k",
            "readv -v 0 8 8",
            "writev 64k 512 512",
            "readv -P 0xcd 64k 1k",
            "writev -q -P 0x45 2M 100k 1",
            "readv -P 0x45 2M 50k 50k 1",
            "aio_write -P 0x66 128k 4k 4k",
            "aio_flush",
            "aio_read -P 0x66 128k 8k",
            "aio_flush",
            "aio_read -P 0x67 128k 4k 4k",
            "aio_flush",
            "aio_read -v 128k 20",
            "aio_flush",
            "aio_write -q 1M 4k",
            "aio_flush",
            "aio_read -q -P 0xcd 1M 4k",
            "aio_flush",
            "map",
        ],
    ),
    (
        "verification-failures",
        &[
            "write -P 1 0 64k",
            "read -P 2 0 64k",
            "read -P 1 -s 4k -l 4k 0 64k",
            "read -P 2 -s 60k 0 64k",
            "read -q -P 2 0 4k",
            "read -v -P 2 0 20",
            "readv -P 2 0 4k 4k",
            "read -P 1 -l 65k 0 64k",
            "read -P 1 -s 2 0 1",
        ],
    ),
    (
        "map-alloc",
        &[
            "write 0 4k",
            "write 1M 512",
            "write -z 2M 64k",
            "write -P 3 5M 2M",
            "map",
            "alloc 0",
            "alloc 512 4k",
            "alloc 0 4M",
            "alloc 4M 4M",
            "alloc 6M 4M",
            "alloc 100M",
            "alloc 1M 1",
            "alloc 0 0x10000",
            "alloc 8M",
        ],
    ),
    (
        "out-of-range",
        &[
            "read 8M 1",
            "read 8M 0",
            "write 8388607 2",
            "write 9M 1",
            "write 8M 0",
            "write -z 8M 64k",
            "discard 8M 64k",
            "discard 8M 0",
            "readv 8388600 8 8",
            "writev 8388600 8 8",
            "aio_read 9M 1",
            "aio_flush",
            "aio_write 9M 1",
            "aio_flush",
            "write -c 9M 64k",
            "alloc 9M",
            "read 0 3G",
            "write 0 3G",
            "readv 0 3G",
            "read 0 1G",
            "length",
        ],
    ),
    (
        "parse-errors",
        &[
            "read x 1",
            "read 0 1x",
            "read 0x10k 1",
            "read 1.5 1",
            "read 1M-1 1",
            "alloc 8E",
            "alloc 99999999999999999999",
            "read -P 256 0 1",
            "read -P 0x 0 1",
            "write -z -P 1 0 1",
            "write -u 0 1",
            "write -n 0 1",
            "bogus",
            "read 0",
            "writev 0",
            "map 1",
            "alloc",
            "alloc 1 2 3",
            "flush 1",
            "truncate 1 2 3 4",
            "help bogus",
            "length",
        ],
    ),
    (
        "sizes",
        &[
            "write -P 0x21 0x1000 0X800",
            "read -P 0x21 4096 2048",
            "write -P 0x22 1.5k .5k",
            "read -P 0x22 1536 512",
            "write -P 0x23 +8k 1.k",
            "read -P 0x23 8192 1024",
            "write -P 0x24 1.0009k 0.1k",
            "read -P 0x24 1025 102",
            "read -P 010 0 1",
            "alloc 0 1.5k",
            "alloc 0 0.00048828125k",
        ],
    ),
    (
        "truncate",
        &[
            "truncate 16M",
            "length",
            "write -P 5 12M 64k",
            "read -P 5 12M 64k",
            "read -P 0 13M 3M",
            "truncate 0x1000001",
            "truncate 16M",
            "t 24M",
            "length",
            "map",
            "info",
        ],
    ),
    (
        "open-close",
        &[
            "close",
            "length",
            "read 0 1",
            "open img.qcow2",
            "length",
            "open img.qcow2",
            "write -P 8 0 4k",
            "close",
            "o -r img.qcow2",
            "read -P 8 0 4k",
            "write 0 1",
            "writev 0 1",
            "discard 0 64k",
            "truncate 16M",
            "write -z 0 1",
            "flush",
            "f",
            "c",
            "open nonexist.qcow2",
            "open -U img.qcow2",
            "close",
            "open -r -U img.qcow2",
            "map",
            "close",
            "open -t none img.qcow2",
            "write -P 9 4k 4k",
            "close",
            "open -t unsafe -i threads img.qcow2",
            "write -P 10 8k 4k",
            "read -P 9 4k 4k",
            "flush",
            "close",
            "open -n img.qcow2",
            "read -P 10 8k 4k",
            "quit",
            "length",
        ],
    ),
];

/// Masks what differs from run to run: the time and rates of the rate line
/// (`N KiB, 1 ops; 00.00 sec (X MiB/sec and Y ops/sec)`) and of `-C`'s CSV line. Panics on a
/// rate line whose shape is not qemu-io's.
fn mask_timing(out: &str) -> String {
    let mut s = String::new();
    for line in out.split_inclusive('\n') {
        let (body, nl) = match line.strip_suffix('\n') {
            Some(b) => (b, "\n"),
            None => (line, ""),
        };
        if let Some(i) = body.find(" ops; ") {
            let rest = &body[i + 6..];
            let (time, rates) = rest
                .split_once(" (")
                .unwrap_or_else(|| panic!("rate line without rates: {body:?}"));
            assert!(
                time.ends_with(" sec") || time.matches(':').count() == 2,
                "rate line with a bad time: {body:?}"
            );
            assert!(
                rates.contains("/sec and ") && rates.ends_with(" ops/sec)"),
                "rate line with bad rates: {body:?}"
            );
            s.push_str(&body[..i + 6]);
            s.push_str("TIME");
        } else if is_csv(body) {
            let mut f = body.split(',');
            s.push_str(&format!("{},{},CSV", f.next().unwrap(), f.next().unwrap()));
        } else {
            s.push_str(body);
        }
        s.push_str(nl);
    }
    s
}

/// `bytes,ops,H:MM:SS.ss,bytes/sec,ops/sec`.
fn is_csv(line: &str) -> bool {
    let f: Vec<&str> = line.split(',').collect();
    f.len() == 5
        && f[0].parse::<u64>().is_ok()
        && f[1].parse::<u64>().is_ok()
        && f[2].matches(':').count() == 2
        && f[3].parse::<f64>().is_ok()
        && f[4].parse::<f64>().is_ok()
}

/// Makes `img.qcow2` (and its `base.qcow2` when `backing`) in `dir`.
fn make_image(dir: &Path, opts: &str, backing: bool) {
    make_image_sized(dir, opts, backing, SIZE);
}

/// [`make_image`] with a disk size (the backing file is 8 MiB, 6 MiB of it written).
fn make_image_sized(dir: &Path, opts: &str, backing: bool, size: &str) {
    // Pattern files for `write -s`.
    std::fs::write(dir.join("pattern.bin"), b"Ab3").unwrap();
    std::fs::write(dir.join("empty.bin"), b"").unwrap();
    let mut args = vec!["create", "-q", "-f", "qcow2", "-o", opts];
    if backing {
        ok(
            "qemu-img create base",
            &qemu_img(dir, &["create", "-q", "-f", "qcow2", "base.qcow2", SIZE]),
        );
        ok(
            "qemu-io base",
            &run(
                dir,
                Path::new(QEMU_IO),
                &["-c", "write -P 0x11 0 6M", "base.qcow2"],
            ),
        );
        args.extend(["-b", "base.qcow2", "-F", "qcow2"]);
    }
    args.extend(["img.qcow2", size]);
    ok("qemu-img create", &qemu_img(dir, &args));
}

/// Copies the files of `from` into the new directory `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// (stdout, stderr, exit code) of a run.
fn streams(o: &Output) -> (String, String, Option<i32>) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
        o.status.code(),
    )
}

/// The `-c` arguments of a script, then the image.
fn script_args<'a>(cmds: &[&'a str]) -> Vec<&'a str> {
    let mut args = Vec::new();
    for c in cmds {
        args.push("-c");
        args.push(*c);
    }
    args.push("img.qcow2");
    args
}

/// Runs `cmds` through qemu-io in `dir/qemu` and qimg io in `dir/qimg` (copies of `template`)
/// and asserts the same output, status and image contents, and clean images.
fn same_run(dir: &Path, template: &Path, what: &str, cmds: &[&str]) {
    let q = dir.join("qemu");
    let m = dir.join("qimg");
    for d in [&q, &m] {
        if d.exists() {
            std::fs::remove_dir_all(d).unwrap();
        }
    }
    copy_dir(template, &q);
    copy_dir(template, &m);
    let qemu = run(&q, Path::new(QEMU_IO), &script_args(cmds));
    let mut qargs = vec!["io"];
    qargs.extend(script_args(cmds));
    let ours = run(&m, &qimg_bin(), &qargs);
    let (qo, qe, qc) = streams(&qemu);
    let (mo, me, mc) = streams(&ours);
    let (qo, mo) = (mask_timing(&qo), mask_timing(&mo));
    assert_eq!(
        qo, mo,
        "{what}: stdout differs\n--- qemu-io:\n{qo}--- qimg io:\n{mo}"
    );
    assert_eq!(
        qe, me,
        "{what}: stderr differs\n--- qemu-io:\n{qe}--- qimg io:\n{me}"
    );
    assert_eq!(qc, mc, "{what}: exit status differs");
    let cmp = qemu_img(dir, &["compare", "qemu/img.qcow2", "qimg/img.qcow2"]);
    assert!(
        cmp.status.success(),
        "{what}: qemu-img compare: {}{}",
        String::from_utf8_lossy(&cmp.stdout),
        String::from_utf8_lossy(&cmp.stderr)
    );
    assert_clean(&m, "img.qcow2", what);
    assert_clean(&q, "img.qcow2", what);
    // What each guest range is (data, zero, unallocated, compressed, at which depth) agrees
    // too; only where the allocators put host clusters may differ.
    let (qm, mm) = (map_without_offsets(&q), map_without_offsets(&m));
    assert_eq!(qm, mm, "{what}: qemu-img map differs");
}

/// `qemu-img map --output=json` of `dir/img.qcow2` without the host offsets (where the two
/// allocators place clusters differs; what each guest range is must not).
fn map_without_offsets(dir: &Path) -> serde_json::Value {
    let o = qemu_img(dir, &["map", "--output=json", "img.qcow2"]);
    let v: serde_json::Value = serde_json::from_str(&ok("qemu-img map", &o)).unwrap();
    let mut out: Vec<serde_json::Value> = Vec::new();
    for mut e in v.as_array().unwrap().iter().cloned() {
        e.as_object_mut().unwrap().remove("offset");
        // Entries split only by where their host clusters lie merge again.
        if let Some(last) = out.last_mut() {
            let kind = |x: &serde_json::Value| {
                let mut x = x.clone();
                let o = x.as_object_mut().unwrap();
                o.remove("start");
                o.remove("length");
                x
            };
            let end = last["start"].as_u64().unwrap() + last["length"].as_u64().unwrap();
            if kind(last) == kind(&e) && end == e["start"].as_u64().unwrap() {
                let len = last["length"].as_u64().unwrap() + e["length"].as_u64().unwrap();
                last["length"] = len.into();
                continue;
            }
        }
        out.push(e);
    }
    serde_json::Value::Array(out)
}

/// Runs the scripts whose names `pick` accepts over every layout, with and without a backing
/// file; returns how many runs compared.
fn run_scripts(tag: &str, pick: impl Fn(&str) -> bool) -> usize {
    run_scripts_on(tag, LAYOUTS, pick)
}

/// [`run_scripts`] on the given layouts.
fn run_scripts_on(tag: &str, layouts: &[(&str, &str)], pick: impl Fn(&str) -> bool) -> usize {
    let mut runs = 0;
    for &(layout, opts) in layouts {
        for backing in [false, true] {
            let s = Scratch::new(&format!("io-{tag}-{layout}-{backing}"));
            let template = s.path("template");
            std::fs::create_dir_all(&template).unwrap();
            make_image(&template, opts, backing);
            for &(name, cmds) in SCRIPTS.iter().filter(|(n, _)| pick(n)) {
                let what = format!(
                    "{name} on {layout}{}",
                    if backing { "+backing" } else { "" }
                );
                same_run(&s.0, &template, &what, cmds);
                runs += 1;
            }
        }
    }
    runs
}

#[test]
fn data_scripts_match_qemu_io() {
    qimg_testkit::require_qemu!();
    let names = [
        "patterns",
        "overwrite",
        "vectored",
        "verification-failures",
        "sizes",
    ];
    let n = run_scripts("data", |s| names.contains(&s));
    assert_eq!(n, names.len() * LAYOUTS.len() * 2);
}

#[test]
fn zero_discard_and_compressed_scripts_match_qemu_io() {
    qimg_testkit::require_qemu!();
    let names = ["zero", "zero-unmap", "discard", "compressed", "map-alloc"];
    let n = run_scripts("zero", |s| names.contains(&s));
    assert_eq!(n, names.len() * LAYOUTS.len() * 2);
}

/// A disk whose size is not a multiple of the cluster size: the last, short cluster can be
/// written compressed, discarded and zeroed whole.
#[test]
fn short_last_cluster_matches_qemu_io() {
    qimg_testkit::require_qemu!();
    let cmds = [
        "write -P 1 0 2M",
        "write -c -P 2 2M 1088k",
        "write -c -P 2 3M 64k",
        "read -P 2 3M 64k",
        "write -c -P 3 2M 1088k",
        "discard 3M 64k",
        "discard 2M 1088k",
        "map",
        "write -c 3072k 64k",
        "write -c 2M 1M",
        "write -z -u 3100k 36k",
        "write -z 1M 1M",
        "read -P 0 3100k 36k",
        "map",
        "alloc 0 4M",
        "length",
        "info",
    ];
    for &(layout, opts) in LAYOUTS {
        for backing in [false, true] {
            let s = Scratch::new(&format!("io-short-{layout}-{backing}"));
            let template = s.path("template");
            std::fs::create_dir_all(&template).unwrap();
            make_image_sized(&template, opts, backing, "3136k");
            let what = format!(
                "short cluster on {layout}{}",
                if backing { "+backing" } else { "" }
            );
            same_run(&s.0, &template, &what, &cmds);
        }
    }
}

/// A raw backing file: its holes read as zeros, so a partial write-zeroes over one becomes
/// a zero subcluster, over its data a write of zeros.
#[test]
fn raw_backing_file_matches_qemu_io() {
    qimg_testkit::require_qemu!();
    let cmds = [
        "write -z 2M 4k",
        "write -z 8k 4k",
        "write -z 1020k 8k",
        "discard 3M 64k",
        "write -P 2 5M 4k",
        "read -P 0x11 0 8k",
        "read -P 0 8k 4k",
        "read -P 0 2M 1M",
        "map",
        "alloc 0 8M",
    ];
    for &(layout, opts) in LAYOUTS {
        let s = Scratch::new(&format!("io-rawback-{layout}"));
        let template = s.path("template");
        std::fs::create_dir_all(&template).unwrap();
        ok(
            "qemu-img create raw",
            &qemu_img(&template, &["create", "-q", "-f", "raw", "base.raw", SIZE]),
        );
        ok(
            "qemu-io raw",
            &run(
                &template,
                Path::new(QEMU_IO),
                &["-f", "raw", "-c", "write -P 0x11 0 1M", "base.raw"],
            ),
        );
        let args = [
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            opts,
            "-b",
            "base.raw",
            "-F",
            "raw",
            "img.qcow2",
            SIZE,
        ];
        ok("qemu-img create", &qemu_img(&template, &args));
        same_run(&s.0, &template, &format!("raw backing on {layout}"), &cmds);
    }
}

/// Raw images (named with `-f raw` or probed, which makes qemu-io warn): every byte is
/// allocated, the size rounds up to 512 bytes, discards and write-zeroes read back as
/// zeros, `truncate` takes any size, compressed writes are refused.
#[test]
fn raw_images_match_qemu_io() {
    qimg_testkit::require_qemu!();
    let cmds: &[&str] = &[
        "length",
        "read 0 1024",
        "read -v 1000 24",
        "write -P 1 1020 4",
        "length",
        "truncate 1001",
        "length",
        "truncate 2048",
        "length",
        "write -z -u 0 512",
        "discard 512 100",
        "read -P 0 0 512",
        "map",
        "alloc 0 2k",
        "flush",
        "write -c 0 512",
        "write 2048 1",
        "writev -P 3 1k 100 200",
        "readv -P 3 1k 300",
        "write -z 1500 1000",
        "read -P 0 1500 548",
        "truncate 1M",
        "write -P 4 0 8k",
        "discard 0 4k",
        "discard 4097 100",
        "read -P 0 0 4k",
        "read -P 4 4096 1",
        "read -P 0 4097 100",
        "read -P 4 4197 1",
        "aio_write -P 5 512k 4k",
        "aio_flush",
        "aio_read -P 5 512k 4k",
        "aio_flush",
        "info",
        "map",
    ];
    for named in [false, true] {
        let s = Scratch::new(&format!("io-raw-{named}"));
        let template = s.path("template");
        std::fs::create_dir_all(&template).unwrap();
        // 1000 bytes: not a multiple of 512, and no format's magic.
        let bytes: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8 | 0x80).collect();
        std::fs::write(template.join("disk.raw"), &bytes).unwrap();
        let mut args: Vec<&str> = Vec::new();
        if named {
            args.extend(["-f", "raw"]);
        }
        for c in cmds {
            args.extend(["-c", c]);
        }
        args.push("disk.raw");
        for d in ["qemu", "qimg"] {
            copy_dir(&template, &s.path(d));
        }
        let q = run(&s.path("qemu"), Path::new(QEMU_IO), &args);
        let mut margs = vec!["io"];
        margs.extend(&args);
        let m = run(&s.path("qimg"), &qimg_bin(), &margs);
        let (qo, qe, qc) = streams(&q);
        let (mo, me, mc) = streams(&m);
        let what = format!("raw (named: {named})");
        assert_eq!(mask_timing(&qo), mask_timing(&mo), "{what}: stdout");
        assert_eq!(qe, me, "{what}: stderr");
        assert_eq!(qc, mc, "{what}: exit status");
        assert_eq!(
            std::fs::read(s.path("qemu").join("disk.raw")).unwrap(),
            std::fs::read(s.path("qimg").join("disk.raw")).unwrap(),
            "{what}: the files differ"
        );
    }
}

/// Version 2 images have no zero clusters: write-zeroes and discard take other paths there.
#[test]
fn zero_and_discard_scripts_match_qemu_io_on_version_2() {
    qimg_testkit::require_qemu!();
    let names = ["zero", "zero-unmap", "discard"];
    let v2 = [("v2-64k", "compat=0.10,cluster_size=64k")];
    let n = run_scripts_on("v2", &v2, |s| names.contains(&s));
    assert_eq!(n, names.len() * 2);
}

#[test]
fn error_and_session_scripts_match_qemu_io() {
    qimg_testkit::require_qemu!();
    let names = ["out-of-range", "parse-errors", "truncate", "open-close"];
    let n = run_scripts("errors", |s| names.contains(&s));
    assert_eq!(n, names.len() * LAYOUTS.len() * 2);
}

#[test]
fn every_script_runs() {
    // The three tests above cover every script of the list.
    let covered = [
        "patterns",
        "overwrite",
        "vectored",
        "verification-failures",
        "sizes",
        "zero",
        "zero-unmap",
        "discard",
        "compressed",
        "map-alloc",
        "out-of-range",
        "parse-errors",
        "truncate",
        "open-close",
    ];
    for (name, _) in SCRIPTS {
        assert!(covered.contains(name), "script {name} is run by no test");
    }
    assert_eq!(covered.len(), SCRIPTS.len());
}

/// Runs `prog args` in `dir` with `input` on standard input.
fn run_stdin(dir: &Path, prog: &Path, args: &[&str], input: &str) -> Output {
    use std::io::Write;
    let mut child = Command::new(prog)
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", prog.display()));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn commands_from_standard_input_match_qemu_io() {
    qimg_testkit::require_qemu!();
    let inputs = [
        "write -P 3 0 4k\n\nread -P 3 0 4k\n  length  \nbogus\nquit\nlength\n",
        "length",
        "write -P 1 0 64k\nmap\nread -P 2 0 1\n",
        "",
    ];
    for (i, input) in inputs.iter().enumerate() {
        let s = Scratch::new(&format!("io-stdin-{i}"));
        let template = s.path("template");
        std::fs::create_dir_all(&template).unwrap();
        make_image(&template, "cluster_size=64k", false);
        copy_dir(&template, &s.path("qemu"));
        copy_dir(&template, &s.path("qimg"));
        let q = run_stdin(&s.path("qemu"), Path::new(QEMU_IO), &["img.qcow2"], input);
        let m = run_stdin(&s.path("qimg"), &qimg_bin(), &["io", "img.qcow2"], input);
        let (qo, qe, qc) = streams(&q);
        let (mo, me, mc) = streams(&m);
        assert_eq!(
            mask_timing(&qo),
            mask_timing(&mo),
            "input {input:?}: stdout"
        );
        assert!(mo.starts_with("qemu-io> "), "no prompt: {mo:?}");
        assert_eq!(qe, me, "input {input:?}: stderr");
        assert_eq!(qc, mc, "input {input:?}: exit status");
        let cmp = qemu_img(&s.0, &["compare", "qemu/img.qcow2", "qimg/img.qcow2"]);
        assert!(cmp.status.success(), "input {input:?}: images differ");
    }
}

#[test]
fn bad_options_print_getopt_lines_and_usage() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("io-badopt");
    make_image(&s.0, "cluster_size=64k", false);
    // The usage text is our own words; the getopt line and the status are qemu-io's.
    for (cmd, name) in [
        ("read -Z 0 1", "read"),
        ("read 0 1 -P", "read"),
        ("readv -s 0 0 1", "readv"),
        ("write -v 0 1", "write"),
        ("discard -x 0 1", "discard"),
        ("read -v 0", "read"),
        ("read -s 0 0 4k", "read"),
        ("write 0 1 2", "write"),
    ] {
        let q = run(&s.0, Path::new(QEMU_IO), &["-c", cmd, "img.qcow2"]);
        let m = run(&s.0, &qimg_bin(), &["io", "-c", cmd, "img.qcow2"]);
        let (qo, qe, qc) = streams(&q);
        let (mo, me, mc) = streams(&m);
        assert_eq!(qe, me, "{cmd}: stderr");
        assert_eq!(qc, mc, "{cmd}: exit status");
        assert_eq!(qc, Some(1), "{cmd}: qemu-io status");
        let prefix = format!("{name} [");
        assert!(
            qo.starts_with(&prefix) && mo.starts_with(&prefix),
            "{cmd}: {qo:?} / {mo:?}"
        );
        assert_eq!(mo.lines().count(), 1, "{cmd}: one usage line: {mo:?}");
    }
}

#[test]
fn command_line_errors_match_qemu_io() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("io-cmdline");
    make_image(&s.0, "cluster_size=64k", false);
    for args in [
        &["-c", "length", "nonexist.qcow2"][..],
        &["-t", "bogus", "-c", "length", "img.qcow2"],
        &["-i", "bogus", "-c", "length", "img.qcow2"],
        &["-f", "bogus", "-c", "length", "img.qcow2"],
        &["-U", "-c", "length", "img.qcow2"],
        &["-c", "length"],
        &["-r", "-U", "-c", "length", "-c", "write 0 1", "img.qcow2"],
        &[
            "-n",
            "-c",
            "write -P 1 0 4k",
            "-c",
            "read -P 1 0 4k",
            "img.qcow2",
        ],
        &[
            "-t",
            "writeback",
            "-i",
            "io_uring",
            "-c",
            "read 0 4k",
            "img.qcow2",
        ],
        &["-f", "qcow2", "-c", "info", "img.qcow2"],
    ] {
        let q = run(&s.0, Path::new(QEMU_IO), args);
        let mut margs = vec!["io"];
        margs.extend(args);
        let m = run(&s.0, &qimg_bin(), &margs);
        let (qo, qe, qc) = streams(&q);
        let (mo, me, mc) = streams(&m);
        if args.contains(&"io_uring") && qc != Some(0) {
            // A kernel or sandbox without io_uring: nothing to compare.
            eprintln!("io_uring unavailable to qemu-io: {qe}");
            continue;
        }
        assert_eq!(mask_timing(&qo), mask_timing(&mo), "{args:?}: stdout");
        assert_eq!(qe, me, "{args:?}: stderr");
        assert_eq!(qc, mc, "{args:?}: exit status");
    }
    assert_clean(&s.0, "img.qcow2", "command line errors");
}

/// `write -z` without `-u` on allocated data keeps the host cluster, as QEMU does (a zero
/// cluster with an offset; with extended L2 the zero bits and the offset); with `-u` both free
/// it. Output, guest data and `qemu-img map --output=json` agree either way.
#[test]
fn write_zeroes_without_unmap_keeps_the_host_cluster_as_qemu() {
    qimg_testkit::require_qemu!();
    for (opts, unmap) in [
        ("cluster_size=64k", false),
        ("cluster_size=64k", true),
        ("cluster_size=64k,extended_l2=on", false),
        ("cluster_size=64k,extended_l2=on", true),
    ] {
        let s = Scratch::new("io-zero-keep");
        let template = s.path("template");
        std::fs::create_dir_all(&template).unwrap();
        make_image(&template, opts, false);
        let zero = if unmap {
            "write -z -u 0 64k"
        } else {
            "write -z 0 64k"
        };
        let what = format!("{zero} on {opts}");
        let cmds = ["write -P 1 0 128k", zero, "map"];
        // Output, status, contents and check agree.
        same_run(&s.0, &template, &what, &cmds);
        // The host layout: run again, keep the images and compare their maps.
        copy_dir(&template, &s.path("qemu"));
        copy_dir(&template, &s.path("qimg"));
        ok(
            "qemu-io",
            &run(&s.path("qemu"), Path::new(QEMU_IO), &script_args(&cmds)),
        );
        let mut a = vec!["io"];
        a.extend(script_args(&cmds));
        ok("qimg io", &run(&s.path("qimg"), &qimg_bin(), &a));
        let map = |dir: &str| -> serde_json::Value {
            let o = qemu_img(&s.path(dir), &["map", "--output=json", "img.qcow2"]);
            serde_json::from_str(&ok("qemu-img map", &o)).unwrap()
        };
        let (qm, mm) = (map("qemu"), map("qimg"));
        assert_eq!(qm[0]["zero"], true, "{what}: {qm}");
        assert_eq!(
            qm[0].get("offset").is_some(),
            !unmap,
            "{what}: QEMU's map changed: {qm}"
        );
        // Where each tool places the new L2 table differs (qimg: after the first data
        // cluster), so the offsets themselves are not compared, only whether there is one.
        let kinds = |m: &serde_json::Value| -> Vec<serde_json::Value> {
            let mut m = m.as_array().unwrap().clone();
            for e in &mut m {
                let e = e.as_object_mut().unwrap();
                let has = e.remove("offset").is_some();
                e.insert("offset".into(), has.into());
            }
            m
        };
        assert_eq!(kinds(&qm), kinds(&mm), "{what}: maps differ");
    }
}

/// Write-zeroes with `-u` and on ranges without data leaves the same kinds of ranges as QEMU
/// (zero, data, unallocated, at which depth): partial subclusters that already read as zeros
/// become zero subclusters, others are written with zeros.
#[test]
fn write_zeroes_leaves_qemus_layout() {
    qimg_testkit::require_qemu!();
    let cmds = [
        "write -z 8k 4k",
        "write -z -u 6200k 1k",
        "write -P 1 1M 64k",
        "write -z 1052672 4k",
        "write -z -u 7M 100k",
        "write -z 4000k 200k",
        "write -P 2 2M 2M",
        "write -z -u 2M 1M",
        "write -z -u 3100k 3k",
        "map",
    ];
    let mut layouts = LAYOUTS.to_vec();
    layouts.push(("v2-64k", "compat=0.10,cluster_size=64k"));
    for (layout, opts) in layouts {
        for backing in [false, true] {
            let s = Scratch::new(&format!("io-zero-layout-{layout}-{backing}"));
            let template = s.path("template");
            std::fs::create_dir_all(&template).unwrap();
            make_image(&template, opts, backing);
            let what = format!(
                "zero layout on {layout}{}",
                if backing { "+backing" } else { "" }
            );
            same_run(&s.0, &template, &what, &cmds);
            let (qm, mm) = (
                map_without_offsets(&s.path("qemu")),
                map_without_offsets(&s.path("qimg")),
            );
            assert_eq!(qm, mm, "{what}: qemu-img map differs");
        }
    }
}

/// Where the engine differs from QEMU with extended L2 entries: zeroing every allocated
/// subcluster of a cluster (not the whole cluster) frees its host cluster in the engine,
/// while QEMU keeps it. A compressed write there then fails in qemu-io (the cluster still
/// has a host cluster) and succeeds in qimg io; a discard of the cluster zeroes all of it in
/// QEMU and leaves the unallocated subclusters in qimg.
#[test]
fn zeroed_subclusters_free_the_host_cluster_unlike_qemu() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("io-subcluster-free");
    let template = s.path("template");
    std::fs::create_dir_all(&template).unwrap();
    make_image(&template, "cluster_size=64k,extended_l2=on", false);
    for (last, qemu_line, qimg_line) in [
        (
            "write -c 0 64k",
            "write failed: Input/output error",
            "wrote 65536/65536 bytes at offset 0",
        ),
        (
            "discard 0 64k",
            "64 KiB (0x10000) bytes     allocated at offset 0 bytes (0x0)",
            "4 KiB (0x1000) bytes     allocated at offset 0 bytes (0x0)",
        ),
    ] {
        let cmds = ["write -P 1 0 4k", "write -z -u 0 4k", last, "map"];
        let mut out = Vec::new();
        for (dir, prog, pre) in [
            ("qemu", Path::new(QEMU_IO).to_path_buf(), None),
            ("qimg", qimg_bin(), Some("io")),
        ] {
            let d = s.path(dir);
            if d.exists() {
                std::fs::remove_dir_all(&d).unwrap();
            }
            copy_dir(&template, &d);
            let mut args: Vec<&str> = pre.into_iter().collect();
            args.extend(script_args(&cmds));
            let (o, _, _) = streams(&run(&d, &prog, &args));
            assert_clean(&d, "img.qcow2", last);
            out.push(o);
        }
        assert!(
            out[0].contains(qemu_line),
            "{last}: qemu-io printed {}",
            out[0]
        );
        assert!(
            out[1].contains(qimg_line),
            "{last}: qimg io printed {}",
            out[1]
        );
    }
}

/// While qemu-io or qimg io holds the image (read-write or read-only), opening it again
/// fails (or works) as with qemu-io, with QEMU's lock messages.
#[test]
fn image_locks_match_qemu_io() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("io-locks");
    make_image(&s.0, "cluster_size=64k", false);
    let qemu = Path::new(QEMU_IO).to_path_buf();
    for (holder, ro) in [
        (&qemu, false),
        (&qemu, true),
        (&qimg_bin(), false),
        (&qimg_bin(), true),
    ] {
        let mut args: Vec<&str> = Vec::new();
        if holder != &qemu {
            args.push("io");
        }
        if ro {
            args.push("-r");
        }
        args.extend(["-c", "sleep 20000", "img.qcow2"]);
        let mut child = Command::new(holder)
            .args(&args)
            .current_dir(&s.0)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Wait until the holder has the image open, seen in /proc/locks (QEMU's and qimg's
        // OFD locks on the image's inode). Probing with another opener instead would race:
        // a probe that opens the image while the holder starts keeps the holder out.
        let ino =
            std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(s.0.join("img.qcow2")).unwrap());
        let needle = format!(":{ino} ");
        let mut held = false;
        for _ in 0..600 {
            if let Some(status) = child.try_wait().unwrap() {
                let mut err = String::new();
                use std::io::Read;
                let _ = child.stderr.take().unwrap().read_to_string(&mut err);
                panic!("the holder {} exited ({status}): {err}", holder.display());
            }
            let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
            if locks.lines().any(|l| l.contains(&needle)) {
                held = true;
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        assert!(held, "the holder never locked the image");
        for opener in [
            &["-c", "length", "img.qcow2"][..],
            &["-r", "-c", "length", "img.qcow2"],
        ] {
            let q = run(&s.0, &qemu, opener);
            let mut margs = vec!["io"];
            margs.extend(opener);
            let m = run(&s.0, &qimg_bin(), &margs);
            let what = format!(
                "held by {} (ro {ro}), opened with {opener:?}",
                holder.display()
            );
            assert_eq!(streams(&q), streams(&m), "{what}");
        }
        child.kill().unwrap();
        child.wait().unwrap();
    }
}

/// `truncate` shrinks a qcow2 image as qemu-io does (the engine's `Image::shrink`): the same
/// output, a clean image, and the same guest data as qemu-io's.
#[test]
fn truncate_shrinks_as_qemu_io_does() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("io-shrink");
    make_image(&s.0, "cluster_size=64k", false);
    std::fs::copy(s.0.join("img.qcow2"), s.0.join("q.qcow2")).unwrap();
    let cmds = [
        "write -P 6 0 64k",
        "write -P 7 5M 64k",
        "truncate 4M",
        "length",
        "read -P 6 0 64k",
    ];
    let mut a = vec!["io"];
    a.extend(script_args(&cmds));
    let m = run(&s.0, &qimg_bin(), &a);
    let mut qa = script_args(&cmds);
    let last = qa.len() - 1;
    qa[last] = "q.qcow2";
    let q = run(&s.0, Path::new(QEMU_IO), &qa);
    assert_eq!(mask_timing(&streams(&m).0), mask_timing(&streams(&q).0));
    assert_eq!(
        (streams(&m).1, streams(&m).2),
        (streams(&q).1, streams(&q).2)
    );
    assert!(streams(&m).0.contains("4 MiB\n"), "{}", streams(&m).0);
    assert_clean(&s.0, "img.qcow2", "shrink");
    let o = qemu_img(&s.0, &["compare", "img.qcow2", "q.qcow2"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
}

#[test]
fn timing_mask_keeps_everything_else() {
    let a = "wrote 4096/4096 bytes at offset 0\n4 KiB, 1 ops; 00.01 sec (1.2 MiB/sec and 3.0000 ops/sec)\n4096,1,0:00:00.00,1.000,2.000\n";
    assert_eq!(
        mask_timing(a),
        "wrote 4096/4096 bytes at offset 0\n4 KiB, 1 ops; TIME\n4096,1,CSV\n"
    );
    assert_ne!(
        mask_timing("4 KiB, 1 ops; 00.00 sec (1 MiB/sec and 1.0000 ops/sec)\n"),
        mask_timing("8 KiB, 1 ops; 00.00 sec (1 MiB/sec and 1.0000 ops/sec)\n")
    );
}

//! `qimg bench`: the same options write the same bytes as `qemu-img bench` (odd offsets and
//! steps, wrap-around, depth 1 and more, standard and extended L2, over a backing file, raw),
//! the same first lines, a sane JSON report (counts, latency order, copy-on-write and
//! allocation counters, flushes), reproducible `--random`, `--time` that stops, and clear
//! errors with exit code 1 for bad options. Every image written is `qemu-img check`ed.
//!
//! Counts are small: the point is behaviour, not speed (see benches/compare.sh for that).

use crate::common;

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use common::{Scratch, have_qemu, json, ok, qemu_img, qimg};

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn create(dir: &Path, name: &str, opts: &str, size: &str) {
    let mut args = vec!["create", "-q", "-f", "qcow2"];
    if !opts.is_empty() {
        args.extend(["-o", opts]);
    }
    args.extend([name, size]);
    ok("qimg create", &qimg(dir, &args));
}

fn check_clean(dir: &Path, name: &str) {
    let o = qemu_img(dir, &["check", name]);
    assert!(
        o.status.success(),
        "qemu-img check {name}: {}{}",
        stdout(&o),
        stderr(&o)
    );
}

fn bench_json(dir: &Path, args: &[&str]) -> serde_json::Value {
    let mut a = vec!["bench", "--output", "json"];
    a.extend_from_slice(args);
    json(&format!("qimg {a:?}"), &qimg(dir, &a))
}

fn f(v: &serde_json::Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing or not a number in {v:#}"))
}

fn u(v: &serde_json::Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} missing or not an integer in {v:#}"))
}

/// One case: how to make the image, then the bench options.
struct Case {
    name: &'static str,
    /// `qemu-img create` options (qcow2), or "raw".
    create: &'static str,
    size: &'static str,
    backing: bool,
    args: &'static [&'static str],
}

const CASES: &[Case] = &[
    Case {
        name: "odd step and offset, wraps several times, depth 7",
        create: "cluster_size=64k",
        size: "3M",
        backing: false,
        args: &[
            "-c",
            "700",
            "-d",
            "7",
            "-s",
            "1.5k",
            "-S",
            "7000",
            "-o",
            "12345",
            "--pattern",
            "0x5a",
        ],
    },
    Case {
        name: "extended L2, unaligned requests, depth 1",
        create: "cluster_size=64k,extended_l2=on",
        size: "2M",
        backing: false,
        args: &[
            "-c", "300", "-d", "1", "-s", "3000", "-S", "9999", "-o", "777",
        ],
    },
    Case {
        name: "overlay on a backing file, 128k subclusters, the whole disk and the last block",
        create: "cluster_size=128k,extended_l2=on",
        size: "1M",
        backing: true,
        args: &["-c", "300", "-d", "16", "--pattern", "0x33"],
    },
    Case {
        name: "step 0 means the buffer size; the default pattern",
        create: "cluster_size=4k",
        size: "1M",
        backing: false,
        args: &["-c", "100", "-S", "0", "-s", "8k", "-o", "520k"],
    },
    Case {
        name: "raw file",
        create: "raw",
        size: "1M",
        backing: false,
        args: &[
            "-f",
            "raw",
            "-c",
            "500",
            "-d",
            "8",
            "-s",
            "2k",
            "-S",
            "6k",
            "--pattern",
            "9",
        ],
    },
];

fn make(dir: &Path, c: &Case, name: &str) {
    if c.create == "raw" {
        ok(
            "qemu-img create raw",
            &qemu_img(dir, &["create", "-q", "-f", "raw", name, c.size]),
        );
        return;
    }
    let mut args = vec!["create", "-q", "-f", "qcow2", "-o", c.create];
    if c.backing {
        args.extend(["-b", "base.qcow2", "-F", "qcow2"]);
    }
    args.extend([name, c.size]);
    ok("qemu-img create", &qemu_img(dir, &args));
}

#[test]
fn writes_the_same_bytes_as_qemu_img_bench() {
    qimg_testkit::require_qemu!();
    for c in CASES {
        let d = Scratch::new("bench-same");
        let dir = &d.0;
        if c.backing {
            ok(
                "base",
                &qemu_img(dir, &["create", "-q", "-f", "qcow2", "base.qcow2", c.size]),
            );
            ok(
                "fill base",
                &qemu_img(
                    dir,
                    &[
                        "bench",
                        "-w",
                        "-c",
                        "64",
                        "-s",
                        "16k",
                        "--pattern",
                        "0x77",
                        "base.qcow2",
                    ],
                ),
            );
        }
        make(dir, c, "q.img");
        let mut qa = vec!["bench", "-w"];
        qa.extend_from_slice(c.args);
        qa.push("q.img");
        let qo = ok(&format!("qemu-img bench ({})", c.name), &qemu_img(dir, &qa));
        // The task loop (the default, -i threads), then the queue loop (-i io_uring), the
        // latter buffered and with O_DIRECT.
        for (img, extra) in [
            ("m.img", &[][..]),
            ("u.img", &["-i", "io_uring"][..]),
            ("n.img", &["-i", "io_uring", "-t", "none"][..]),
        ] {
            make(dir, c, img);
            let mut ma = vec!["bench", "-w"];
            ma.extend_from_slice(extra);
            ma.extend_from_slice(c.args);
            ma.push(img);
            let mo = ok(
                &format!("qimg bench {extra:?} ({})", c.name),
                &qimg(dir, &ma),
            );
            // The first line is qemu-img's, word for word.
            assert_eq!(
                qo.lines().next(),
                mo.lines().next(),
                "{} {extra:?}: first line",
                c.name
            );
            assert!(
                mo.lines().nth(1).is_some_and(
                    |l| l.starts_with("Run completed in ") && l.ends_with(" seconds.")
                ),
                "{} {extra:?}: {mo}",
                c.name
            );
            let mut cmp = vec!["compare"];
            if c.create == "raw" {
                cmp.extend(["-f", "raw", "-F", "raw"]);
            }
            cmp.extend(["q.img", img]);
            let o = qemu_img(dir, &cmp);
            assert!(
                o.status.success(),
                "{} {extra:?}: images differ: {}{}",
                c.name,
                stdout(&o),
                stderr(&o)
            );
            if c.create != "raw" {
                check_clean(dir, img);
            }
        }
    }
}

#[test]
fn sparse_allocation_writes_only_the_subclusters() {
    // Extended L2, 2 MiB clusters: a 4 KiB write per cluster fills one 64 KiB subcluster.
    // contiguous reserves whole clusters (and 32 MiB steps) with fallocate; sparse leaves the
    // rest of each cluster a hole, as qemu-img does.
    use std::os::unix::fs::MetadataExt;
    let d = Scratch::new("bench-alloc");
    let dir = &d.0;
    let mut used = Vec::new();
    for mode in ["contiguous", "sparse"] {
        let name = format!("{mode}.qcow2");
        create(dir, &name, "cluster_size=2M,extended_l2=on", "64M");
        let v = bench_json(
            dir,
            &["-w", "-c", "16", "-S", "2M", "--allocation", mode, &name],
        );
        assert_eq!(u(&v, "requests"), 16, "{v:#}");
        used.push(std::fs::metadata(dir.join(&name)).unwrap().blocks() * 512);
        if have_qemu("sparse_allocation_writes_only_the_subclusters") {
            check_clean(dir, &name);
        }
    }
    // 16 clusters reserved whole: 32 MiB; sparse: 16 subclusters (each zeroed whole before
    // its 4 KiB, as QEMU does) and the metadata: the header, refcount table, refcount block
    // and L2 table clusters, written whole as QEMU writes them (2 MiB each), and the L1 table.
    let sparse_most = 4 * (2 << 20) + 16 * (64 << 10) + (1 << 20);
    assert!(used[0] >= 32 << 20, "contiguous: {used:?}");
    assert!(used[1] <= sparse_most, "sparse: {used:?}");
}

#[test]
fn the_queue_api_reads_into_the_callers_buffers() {
    // O_DIRECT reads of written clusters go from the bench's buffers straight to the ring,
    // not through the engine's bounce buffers.
    let d = Scratch::new("bench-queue");
    let dir = &d.0;
    create(dir, "a.qcow2", "cluster_size=64k,extended_l2=on", "8M");
    let w = bench_json(dir, &["-w", "-c", "128", "-s", "64k", "a.qcow2"]);
    assert_eq!(w["api"], "async", "{w:#}");
    let v = bench_json(
        dir,
        &[
            "-c", "2000", "-d", "8", "-S", "20k", "-i", "io_uring", "-t", "none", "a.qcow2",
        ],
    );
    assert_eq!(v["api"], "queue", "{v:#}");
    assert_eq!(u(&v, "requests"), 2000, "{v:#}");
    // Only the first requests, which find the L2 slice not loaded yet (8 in flight), run on
    // the engine.
    let q = &v["queue"];
    let direct = q["direct"].as_u64().unwrap();
    assert_eq!(direct + q["engine"].as_u64().unwrap(), 2000, "{v:#}");
    assert!(direct >= 2000 - 8, "{v:#}");
    assert_eq!(q["direct-bytes"], direct * 4096, "{v:#}");
    // With --poll the waits watch the ring first: the same requests, the same split.
    let p = bench_json(
        dir,
        &[
            "-c", "2000", "-d", "1", "-S", "20k", "-i", "io_uring", "-t", "none", "--poll", "50",
            "a.qcow2",
        ],
    );
    assert_eq!(u(&p, "requests"), 2000, "{p:#}");
    let pq = &p["queue"];
    assert!(pq["direct"].as_u64().unwrap() >= 2000 - 1, "{p:#}");
    // --api async on the same backend takes the task loop (no queue counters).
    let a = bench_json(
        dir,
        &[
            "-c", "200", "-i", "io_uring", "-t", "none", "--api", "async", "a.qcow2",
        ],
    );
    assert_eq!(a["api"], "async", "{a:#}");
    assert!(a["queue"].is_null(), "{a:#}");
}

#[test]
fn a_request_past_the_end_fails_as_in_qemu_img() {
    // qemu-img 10.0 wraps the offset modulo the image size, so with a buffer size that does
    // not divide it a request eventually runs past the end and the run fails.
    let d = Scratch::new("bench-end");
    let dir = &d.0;
    create(dir, "a.qcow2", "", "1M");
    let args = ["bench", "-c", "700", "-d", "1", "-s", "1.5k", "a.qcow2"];
    let o = qimg(dir, &args);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    let e = stderr(&o);
    assert!(
        e.contains("Failed request") && e.contains("past the end") && e.contains("1048576"),
        "{e}"
    );
    if have_qemu("a_request_past_the_end_fails_as_in_qemu_img") {
        let q = qemu_img(dir, &args);
        assert_eq!(q.status.code(), Some(1), "qemu-img: {}", stderr(&q));
        // 681 requests fit; qimg stops at the same one (request 683 at 1047552 + 1536).
        let ok = qimg(
            dir,
            &["bench", "-c", "682", "-d", "1", "-s", "1.5k", "a.qcow2"],
        );
        assert!(ok.status.success(), "{}", stderr(&ok));
        let q = qemu_img(
            dir,
            &["bench", "-c", "682", "-d", "1", "-s", "1.5k", "a.qcow2"],
        );
        assert!(q.status.success(), "{}", stderr(&q));
    }
}

#[test]
fn json_report_fields_are_present_and_sane() {
    let d = Scratch::new("bench-json");
    let dir = &d.0;
    for ext in [false, true] {
        let name = format!("img-{ext}.qcow2");
        let opts = format!(
            "cluster_size=64k,extended_l2={}",
            if ext { "on" } else { "off" }
        );
        create(dir, &name, &opts, "8M");
        // 256 sequential 4 KiB writes fill 16 clusters of 64 KiB.
        let v = bench_json(dir, &["-w", "-c", "256", "-d", "8", &name]);
        assert_eq!(v["format"], "qcow2");
        assert_eq!(v["operation"], "write");
        assert_eq!(u(&v, "requests"), 256);
        assert_eq!(u(&v, "bytes"), 256 * 4096);
        assert_eq!(u(&v, "depth"), 8);
        assert_eq!(u(&v, "buffer-size"), 4096);
        assert!(f(&v, "seconds") > 0.0);
        let iops = f(&v, "iops");
        assert!(
            (iops - 256.0 / f(&v, "seconds")).abs() < 1e-6 * iops,
            "{v:#}"
        );
        assert!((f(&v, "mib-per-second") - iops * 4096.0 / 1048576.0).abs() < 1e-6 * iops);
        let l = &v["latency-us"];
        let (min, p50, p99, p999, max) = (
            f(l, "min"),
            f(l, "p50"),
            f(l, "p99"),
            f(l, "p99.9"),
            f(l, "max"),
        );
        assert!(
            0.0 < min && min <= p50 && p50 <= p99 && p99 <= p999 && p999 <= max,
            "{l:#}"
        );
        let c = &v["l2-cache"];
        let rate = f(c, "hit-rate");
        assert!((0.0..=1.0).contains(&rate), "{c:#}");
        assert!(u(c, "hits") + u(c, "misses") > 0);
        assert_eq!(u(&v, "clusters-allocated"), 16, "{v:#}");
        // Nothing is copied. Extended L2 (2 KiB subclusters): 4 KiB writes cover whole
        // subclusters. Standard L2: the rest of each new cluster would be zeros, and a cluster
        // that never held data already reads as zeros (`tests/engine/interop.rs` has the
        // writes that do copy).
        assert_eq!(u(&v, "cow-bytes"), 0, "{v:#}");
        if have_qemu("json_report_fields_are_present_and_sane") {
            check_clean(dir, &name);
        }
    }
    // A read test on raw: no engine counters.
    std::fs::write(dir.join("r.raw"), vec![1u8; 1 << 20]).unwrap();
    let v = bench_json(dir, &["-c", "100", "-f", "raw", "r.raw"]);
    assert_eq!(v["format"], "raw");
    assert_eq!(u(&v, "requests"), 100);
    assert!(v["l2-cache"].is_null() && v["cow-bytes"].is_null());
}

#[test]
fn flush_interval_drains_and_flushes_like_qemu() {
    let d = Scratch::new("bench-flush");
    let dir = &d.0;
    create(dir, "a.qcow2", "", "8M");
    // The task loop (-i threads) and the queue loop (-i io_uring), on qcow2 and raw.
    ok(
        "raw",
        &qimg(dir, &["create", "-q", "-f", "raw", "r.img", "8M"]),
    );
    for (aio, img) in [
        ("threads", "a.qcow2"),
        ("io_uring", "a.qcow2"),
        ("threads", "r.img"),
        ("io_uring", "r.img"),
    ] {
        let interval = |extra: &[&str]| {
            let mut a = vec!["-w", "-c", "1000", "-d", "16", "--flush-interval", "128"];
            a.extend_from_slice(extra);
            a.extend(["-i", aio, img]);
            bench_json(dir, &a)
        };
        // Flushes whenever the requests not yet issued are a multiple of 128: 896, ..., 0.
        let v = interval(&[]);
        assert_eq!(u(&v, "flushes"), 8, "{aio} {img}: {v:#}");
        assert_eq!(u(&v, "requests"), 1000, "{aio} {img}");
        if aio == "io_uring" && img == "a.qcow2" {
            // The queue runs each flush on the engine.
            assert!(v["queue"]["engine"].as_u64().unwrap() >= 8, "{v:#}");
        }
        let v = interval(&["--no-drain"]);
        assert!(u(&v, "flushes") >= 8, "{aio} {img}: {v:#}");
        assert_eq!(u(&v, "requests"), 1000, "{aio} {img}");
        // Writethrough: every write is followed by its flush (on the engine, with a queue).
        let v = bench_json(
            dir,
            &[
                "-w",
                "-c",
                "300",
                "-d",
                "4",
                "-t",
                "writethrough",
                "-i",
                aio,
                img,
            ],
        );
        assert_eq!(u(&v, "requests"), 300, "{aio} {img}");
        if aio == "io_uring" && img == "a.qcow2" {
            assert!(v["queue"]["engine"].as_u64().unwrap() >= 300, "{v:#}");
        }
    }
    let o = qimg(
        dir,
        &[
            "bench",
            "-w",
            "-c",
            "300",
            "-d",
            "4",
            "--flush-interval",
            "100",
            "-t",
            "writethrough",
            "a.qcow2",
        ],
    );
    let out = ok("writethrough", &o);
    assert_eq!(out.lines().nth(1), Some("Sending flush every 100 requests"));
    if have_qemu("flush_interval_drains_and_flushes_like_qemu") {
        check_clean(dir, "a.qcow2");
    }
}

#[test]
fn random_offsets_are_reproducible_with_a_seed() {
    let d = Scratch::new("bench-random");
    let dir = &d.0;
    for n in ["a", "b", "c"] {
        create(
            dir,
            &format!("{n}.qcow2"),
            "cluster_size=64k,extended_l2=on",
            "16M",
        );
    }
    let run = |name: &str, seed: &str| {
        let v = bench_json(
            dir,
            &[
                "-w",
                "--random",
                "--seed",
                seed,
                "-c",
                "200",
                "-d",
                "8",
                "--pattern",
                "0xc3",
                name,
            ],
        );
        assert_eq!(v["random"], true);
        assert_eq!(u(&v, "seed"), seed.parse::<u64>().unwrap());
        v
    };
    let va = run("a.qcow2", "7");
    let vb = run("b.qcow2", "7");
    run("c.qcow2", "8");
    // Same seed: the same clusters, the same bytes.
    assert_eq!(u(&va, "clusters-allocated"), u(&vb, "clusters-allocated"));
    if have_qemu("random_offsets_are_reproducible_with_a_seed") {
        let same = qemu_img(dir, &["compare", "a.qcow2", "b.qcow2"]);
        assert!(same.status.success(), "{}", stdout(&same));
        let other = qemu_img(dir, &["compare", "a.qcow2", "c.qcow2"]);
        assert_eq!(other.status.code(), Some(1), "another seed, other offsets");
        for n in ["a", "b", "c"] {
            check_clean(dir, &format!("{n}.qcow2"));
        }
    }
    // Offsets are aligned to the buffer size and inside the image: a read run over the
    // same sequence succeeds, and the line says it is random.
    let o = qimg(
        dir,
        &[
            "bench", "--random", "--seed", "7", "-c", "50", "-s", "64k", "a.qcow2",
        ],
    );
    let out = ok("random read", &o);
    assert!(
        out.lines()
            .next()
            .unwrap()
            .contains("random offsets from 0, seed 7"),
        "{out}"
    );
}

#[test]
fn time_limit_stops_the_run() {
    let d = Scratch::new("bench-time");
    let dir = &d.0;
    create(dir, "a.qcow2", "", "64M");
    for aio in ["threads", "io_uring"] {
        // --time must end the run: a run of 0.3 s takes under a second in all on a quiet
        // machine.
        let guard = qimg_testkit::HangGuard::start(
            format!("bench --time 0.3 on {aio}"),
            Duration::from_secs(1),
            Duration::from_secs(60),
        );
        let v = bench_json(dir, &["--time", "0.3", "-d", "4", "-i", aio, "a.qcow2"]);
        guard.check();
        let secs = f(&v, "seconds");
        assert!((0.3..5.0).contains(&secs), "{aio}: {v:#}");
        assert!(u(&v, "requests") > 0, "{aio}");
        assert!(v["requested-count"].is_null());
    }
    // With a count as well, whichever comes first.
    let v = bench_json(dir, &["--time", "30", "-c", "10", "a.qcow2"]);
    assert_eq!(u(&v, "requests"), 10);
    assert!(f(&v, "seconds") < 20.0);
}

#[test]
fn backends_and_runtimes_agree() {
    // threads, io_uring (completions on the runtime or the storage's thread) and O_DIRECT
    // (bounced) on both runtimes write the same bytes.
    let d = Scratch::new("bench-backends");
    let dir = &d.0;
    create(dir, "ref.qcow2", "cluster_size=64k,extended_l2=on", "4M");
    ok(
        "reference",
        &qimg(
            dir,
            &[
                "bench",
                "-w",
                "-c",
                "400",
                "-s",
                "3k",
                "-S",
                "5k",
                "-o",
                "100",
                "--pattern",
                "0x42",
                "ref.qcow2",
            ],
        ),
    );
    let mut i = 0;
    for aio in ["threads", "io_uring"] {
        for cache in ["writeback", "none"] {
            for (rt, completions, api) in [
                ("multi", "runtime", "async"),
                ("current", "runtime", "async"),
                ("multi", "thread", "async"),
                ("current", "thread", "async"),
                ("current", "runtime", "queue"),
                ("multi", "thread", "queue"),
            ] {
                if aio == "threads" && (completions == "thread" || api == "queue") {
                    continue;
                }
                i += 1;
                let name = format!("b{i}.qcow2");
                create(dir, &name, "cluster_size=64k,extended_l2=on", "4M");
                let o = qimg(
                    dir,
                    &[
                        "bench",
                        "-w",
                        "-c",
                        "400",
                        "-s",
                        "3k",
                        "-S",
                        "5k",
                        "-o",
                        "100",
                        "--pattern",
                        "0x42",
                        "-i",
                        aio,
                        "-t",
                        cache,
                        "--runtime",
                        rt,
                        "--completions",
                        completions,
                        "--api",
                        api,
                        &name,
                    ],
                );
                if !o.status.success() {
                    let e = stderr(&o);
                    // Where io_uring or O_DIRECT is unavailable, say so and go on.
                    if e.contains("io_uring")
                        || e.contains("O_DIRECT")
                        || e.contains("Invalid argument")
                    {
                        println!("skipped {aio}/{cache}: {e}");
                        continue;
                    }
                    panic!("{aio} {cache} {rt} {completions} {api}: {e}");
                }
                assert!(
                    stdout(&o).contains(&format!("cache={cache}")),
                    "{}",
                    stdout(&o)
                );
                // Read back through the same backend.
                ok(
                    "read",
                    &qimg(
                        dir,
                        &[
                            "bench", "-c", "400", "-s", "3k", "-S", "5k", "-o", "100", "-i", aio,
                            "-t", cache, "--api", api, &name,
                        ],
                    ),
                );
                if have_qemu("backends_and_runtimes_agree") {
                    let same = qemu_img(dir, &["compare", "ref.qcow2", &name]);
                    assert!(
                        same.status.success(),
                        "{aio} {cache} {rt} {completions} {api}: {}",
                        stdout(&same)
                    );
                    check_clean(dir, &name);
                }
            }
        }
    }
}

#[test]
fn bad_options_fail_clearly_with_exit_code_1() {
    let d = Scratch::new("bench-bad");
    let dir = &d.0;
    create(dir, "a.qcow2", "", "1M");
    let cases: &[(&[&str], &str)] = &[
        (
            &["-d", "0"],
            "Invalid queue depth specified. Must be between 1 and 2147483647.",
        ),
        (
            &["-c", "0"],
            "Invalid request count specified. Must be between 1 and 2147483647.",
        ),
        (&["-c", "abc"], "Invalid request count specified: 'abc'."),
        (&["-s", "abc"], "Invalid buffer size specified: 'abc'."),
        (
            &["-s", "0"],
            "Invalid buffer size specified. Must be between 1 and 2147483647.",
        ),
        (
            &["-S", "-1"],
            "Invalid step size specified. Must be between 0 and 2147483647.",
        ),
        (&["-o", "1e3"], "Invalid offset specified: '1e3'."),
        (
            &["--pattern", "256", "-w"],
            "Invalid pattern byte specified. Must be between 0 and 255.",
        ),
        (
            &["--flush-interval", "100"],
            "--flush-interval is only available in write tests",
        ),
        (
            &["-w", "--flush-interval", "10"],
            "Flush interval can't be smaller than depth",
        ),
        (
            &["-w", "-U"],
            "force-share=on can only be used with read-only images",
        ),
        (&["-i", "bogus"], "Invalid aio option: bogus"),
        (&["-t", "bogus"], "Invalid cache mode"),
        (
            &["-n"],
            "aio=native was specified, but it requires cache.direct=on",
        ),
        (&["-f", "vmdk"], "Unknown file format 'vmdk'"),
        (&["--output", "xml"], "--output expects 'human' or 'json'"),
        (
            &["--runtime", "fast"],
            "--runtime expects 'multi' or 'current'",
        ),
        (
            &["--api", "fast"],
            "--api expects 'queue' or 'async' not 'fast'",
        ),
        (
            &["--api", "queue"],
            "--api queue runs on io_uring: add -i io_uring",
        ),
        (&["--time", "0"], "Invalid time specified: '0'"),
        (&["--time", "soon"], "Invalid time specified: 'soon'"),
        (&["--seed", "3"], "--seed is only meaningful with --random"),
        (&["--poll", "50"], "--poll needs the queue API"),
        (
            &["--random", "-s", "2M"],
            "--random: no 2097152-byte request fits",
        ),
        (&["--l2-cache-entry-size", "3k"], "l2-cache-entry-size"),
        (
            &["--l2-cache-size", "lots"],
            "Invalid l2-cache-size specified: 'lots'.",
        ),
        (&["-o", "2M", "-c", "1"], "runs past the end of the image"),
        (
            &["-o", "2M", "-c", "1", "-i", "io_uring"],
            "runs past the end of the image",
        ),
    ];
    for (args, want) in cases {
        let mut a = vec!["bench"];
        a.extend_from_slice(args);
        a.push("a.qcow2");
        let o = qimg(dir, &a);
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {e}");
        assert!(e.contains(want), "{args:?}: {e}");
        assert!(!e.contains("panicked"), "{args:?}: {e}");
    }
    for (args, want) in [
        (vec!["bench"], "Expecting one image file name"),
        (
            vec!["bench", "missing.qcow2"],
            "Could not open 'missing.qcow2'",
        ),
        (
            vec![
                "bench",
                "--image-opts",
                "driver=qcow2,file.filename=a.qcow2,bogus=1",
            ],
            "Invalid parameter 'bogus'",
        ),
        (
            vec!["bench", "-f", "qcow2", "not.qcow2"],
            "Could not open 'not.qcow2'",
        ),
    ] {
        std::fs::write(dir.join("not.qcow2"), b"plain bytes, not an image").unwrap();
        let o = qimg(dir, &args);
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {e}");
        assert!(e.contains(want), "{args:?}: {e}");
    }
    // -w on a file we may not write.
    let ro = dir.join("ro.qcow2");
    create(dir, "ro.qcow2", "", "1M");
    let mut perm = std::fs::metadata(&ro).unwrap().permissions();
    perm.set_readonly(true);
    std::fs::set_permissions(&ro, perm).unwrap();
    if std::fs::OpenOptions::new().write(true).open(&ro).is_ok() {
        println!("skipped the read-only file case: running with permission to write anyway (root)");
    } else {
        let o = qimg(dir, &["bench", "-w", "-c", "1", "ro.qcow2"]);
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{e}");
        assert!(
            e.contains("Could not open 'ro.qcow2'") && e.contains("ermission"),
            "{e}"
        );
    }
    // -w on an overlay whose backing file is missing is refused at open.
    create(dir, "base.qcow2", "", "1M");
    ok(
        "overlay",
        &qimg(
            dir,
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-b",
                "base.qcow2",
                "-F",
                "qcow2",
                "ov.qcow2",
            ],
        ),
    );
    std::fs::remove_file(dir.join("base.qcow2")).unwrap();
    let o = qimg(dir, &["bench", "-w", "-c", "1", "ov.qcow2"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("Could not open 'ov.qcow2'"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn image_opts_and_cache_options_are_honoured() {
    let d = Scratch::new("bench-opts");
    let dir = &d.0;
    create(dir, "a.qcow2", "cluster_size=64k", "256M");
    // Fill it, then read with strides of 1 MiB (16 L2 entries apart... and slices).
    ok(
        "fill",
        &qimg(
            dir,
            &[
                "bench",
                "-w",
                "-c",
                "4096",
                "-s",
                "64k",
                "-d",
                "8",
                "--pattern",
                "1",
                "a.qcow2",
            ],
        ),
    );
    let small = bench_json(
        dir,
        &[
            "-c",
            "2000",
            "-S",
            "1M",
            "-d",
            "1",
            "--l2-cache-size",
            "8k",
            "--l2-cache-entry-size",
            "4k",
            "a.qcow2",
        ],
    );
    let whole = bench_json(dir, &["-c", "2000", "-S", "1M", "-d", "1", "a.qcow2"]);
    let misses = |v: &serde_json::Value| u(&v["l2-cache"], "misses");
    assert!(misses(&small) > misses(&whole), "{small:#} vs {whole:#}");
    let io = bench_json(
        dir,
        &[
            "-c",
            "2000",
            "-S",
            "1M",
            "-d",
            "1",
            "--image-opts",
            "driver=qcow2,file.filename=a.qcow2,l2-cache-size=8k,l2-cache-entry-size=4k",
        ],
    );
    assert_eq!(io["filename"], "a.qcow2");
    assert_eq!(misses(&io), misses(&small));
}

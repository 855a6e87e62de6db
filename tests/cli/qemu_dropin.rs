//! qimg installed as `qemu-img` and `qemu-io` (symlinks to the one binary), run side by side
//! with QEMU's tools on the same inputs: command-line refusals in getopt's and QEMU's words,
//! `--version`, `--object`, `create -o extent_size_hint`, `convert -l` / `--target-is-zero`,
//! `rebase -c`, `dd` with options after its operands, and qemu-io's `open -o`, `reopen`,
//! `-s`, `sigraise` and `abort`. Output is compared after masking timings.

use crate::common;
use common::*;

use std::path::{Path, PathBuf};
use std::process::Output;

/// The two tools under test: `bin/qemu-img` and `bin/qemu-io`, links to qimg.
pub(crate) struct Ours {
    bin: PathBuf,
}

impl Ours {
    pub(crate) fn new(s: &Scratch) -> Self {
        let bin = s.path("bin");
        std::fs::create_dir_all(&bin).unwrap();
        for name in ["qemu-img", "qemu-io"] {
            std::os::unix::fs::symlink(qimg_bin(), bin.join(name)).unwrap();
        }
        Ours { bin }
    }

    /// The directory of the `qemu-img` and `qemu-io` links to qimg.
    pub(crate) fn bin(&self) -> &Path {
        &self.bin
    }

    pub(crate) fn img(&self, dir: &Path, args: &[&str]) -> Output {
        run(dir, &self.bin.join("qemu-img"), args)
    }

    pub(crate) fn io(&self, dir: &Path, args: &[&str]) -> Output {
        run(dir, &self.bin.join("qemu-io"), args)
    }
}

fn qemu_io_run(dir: &Path, args: &[&str]) -> Output {
    run(dir, Path::new("qemu-io"), args)
}

/// Standard output and error with timing lines masked, and the exit status (or the signal).
pub(crate) fn masked(o: &Output) -> (String, String, String) {
    use std::os::unix::process::ExitStatusExt;
    let mask = |b: &[u8]| {
        String::from_utf8_lossy(b)
            .lines()
            .map(|l| if l.contains("ops/sec") { "TIMING" } else { l })
            .collect::<Vec<_>>()
            .join("\n")
    };
    let status = match (o.status.code(), o.status.signal()) {
        (Some(c), _) => format!("exit {c}"),
        (None, Some(s)) => format!("signal {s}"),
        _ => "?".into(),
    };
    (mask(&o.stdout), mask(&o.stderr), status)
}

/// Runs `args` with QEMU's tool and ours in `dir` (fresh copies of `files` for each) and
/// returns both results.
fn both(
    s: &Scratch,
    ours: &Ours,
    tool: &str,
    files: &[&str],
    args: &[&str],
) -> ((String, String, String), (String, String, String)) {
    let mut results = Vec::new();
    for who in ["qemu", "qimg"] {
        let dir = s.path(who);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for f in files {
            std::fs::copy(s.path(f), dir.join(f)).unwrap();
        }
        let o = match (who, tool) {
            ("qemu", "qemu-img") => qemu_img(&dir, args),
            ("qemu", _) => qemu_io_run(&dir, args),
            (_, "qemu-img") => ours.img(&dir, args),
            _ => ours.io(&dir, args),
        };
        results.push(masked(&o));
    }
    let b = results.pop().unwrap();
    (results.pop().unwrap(), b)
}

#[test]
fn command_line_refusals_and_version_speak_as_qemus_tools() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("dropin-cli");
    let ours = Ours::new(&s);
    ok(
        "a",
        &qemu_img(&s.0, &["create", "-q", "-f", "qcow2", "a.qcow2", "1M"]),
    );
    // An image whose backing file is missing.
    ok(
        "nb",
        &qemu_img(
            &s.0,
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-u",
                "-b",
                "gone.qcow2",
                "-F",
                "qcow2",
                "nb.qcow2",
                "1M",
            ],
        ),
    );
    ok(
        "r",
        &qemu_img(&s.0, &["create", "-q", "-f", "raw", "r.raw", "1M"]),
    );
    let mut differ = Vec::new();
    for args in [
        &["convert", "--foo", "a.qcow2", "b.raw"][..],
        &["convert", "-Z", "a.qcow2", "b.raw"],
        &["convert", "a.qcow2", "b.raw", "-O"],
        &["info", "--bogus", "a.qcow2"],
        &["check", "-Q", "a.qcow2"],
        // Refused values and missing names, with qemu-img's hint.
        &["info", "--output=xml", "a.qcow2"],
        &["map", "--output", "xml", "a.qcow2"],
        &["check", "-r", "bogus", "a.qcow2"],
        // Backing names qemu-img refuses before anything else.
        &[
            "create", "-f", "qcow2", "-b", "y.qcow2", "-F", "qcow2", "y.qcow2", "1M",
        ],
        &["create", "-f", "qcow2", "-b", "", "z.qcow2", "1M"],
        &["create", "-f", "raw", "-b", "a.qcow2", "r2.raw", "1M"],
        &["create", "-f", "raw", "-F", "raw", "r2.raw", "1M"],
        // A backing file that does not open, one level per image (QEMU's nested words);
        // check opens the chain too.
        &["check", "nb.qcow2"],
        &["map", "nb.qcow2"],
        &["convert", "-O", "raw", "nb.qcow2", "x.raw"],
        // A file that is not qcow2 opened as qcow2, and a probed raw file.
        &["info", "-f", "qcow2", "r.raw"],
        &["map", "-f", "qcow2", "r.raw"],
        &["amend", "-f", "qcow2", "-o", "compat=1.1", "r.raw"],
        &[
            "rebase", "-f", "qcow2", "-u", "-b", "x.raw", "-F", "raw", "r.raw",
        ],
        &["bench", "-f", "qcow2", "-c", "1", "r.raw"],
        &["snapshot", "-l", "r.raw"],
        &["snapshot", "-c", "s", "r.raw"],
        // A format qemu-img does not know, and a file that is not there.
        &["check", "-f", "foo", "a.qcow2"],
        &["check", "-f", "foo", "gone.qcow2"],
        &["check", "gone.qcow2"],
        &["bench", "-c", "1", "gone.qcow2"],
        &["info"],
        &["check"],
        &["map"],
        &["compare", "a.qcow2"],
        &["create", "-f", "qcow2"],
        &["map", "-s", "64k", "-l", "128k", "--output=json", "a.qcow2"],
        &["info", "--backing-chain", "nb.qcow2"],
        &["convert", "-s", "x", "a.qcow2", "b.raw"],
        &["info", "--object", "foo,id=x", "a.qcow2"],
        &["info", "--object", "secret,id=x", "a.qcow2"],
        // `-o help`: the format's options alone, or with the file protocol's once the
        // target is named.
        &["create", "-f", "qcow2", "-o", "help"],
        &["create", "-f", "qcow2", "-o", "help", "h.qcow2"],
        &["create", "-f", "raw", "-o", "?", "h.raw"],
        &["convert", "-O", "qcow2", "-o", "help", "a.qcow2", "h.qcow2"],
        &["convert", "-O", "raw", "-o", "help"],
        &["amend", "-o", "help", "a.qcow2"],
        // A negative size is an option to getopt, unless after `--`.
        &["create", "-f", "qcow2", "n.qcow2", "-1"],
        &["create", "-f", "qcow2", "n.qcow2", "--", "-1"],
        &["resize", "a.qcow2", "--", "-512"],
        &[
            "create",
            "-f",
            "qcow2",
            "-o",
            "extent_size_hint=2M",
            "e.qcow2",
            "1M",
        ],
        &[
            "create",
            "-f",
            "raw",
            "-o",
            "extent_size_hint=1M,preallocation=falloc",
            "e.raw",
            "1M",
        ],
        &[
            "create",
            "-f",
            "qcow2",
            "-o",
            "extent_size_hint=5G",
            "f.qcow2",
            "1M",
        ],
        &[
            "create",
            "-f",
            "raw",
            "-o",
            "extent_size_hint=abc",
            "f.raw",
            "1M",
        ],
    ] {
        let (want, got) = both(
            &s,
            &ours,
            "qemu-img",
            &["a.qcow2", "r.raw", "nb.qcow2"],
            args,
        );
        if want != got {
            differ.push(format!(
                "{args:?}\n  qemu-img: {want:?}\n  qimg:     {got:?}"
            ));
        }
    }
    for args in [
        &["-f", "qcow2", "-c", "read 0 1", "r.raw"][..],
        &["-c", "read 0 1", "nb.qcow2"],
    ] {
        let (want, got) = both(&s, &ours, "qemu-io", &["r.raw", "nb.qcow2"], args);
        if want != got {
            differ.push(format!(
                "qemu-io {args:?}\n  qemu-io: {want:?}\n  qimg:    {got:?}"
            ));
        }
    }
    // A secret is taken (and the command runs); qemu-io refuses as qemu-io.
    let (want, got) = both(
        &s,
        &ours,
        "qemu-img",
        &["a.qcow2"],
        &[
            "info",
            "--object",
            "secret,id=s0,data=pw",
            "--output=json",
            "a.qcow2",
        ],
    );
    assert_eq!(want.2, got.2, "info with a secret: {got:?}");
    for args in [
        &["-Z", "a.qcow2"][..],
        &["--bogus", "a.qcow2"],
        &["a.qcow2", "-f"],
    ] {
        let (want, got) = both(&s, &ours, "qemu-io", &["a.qcow2"], args);
        // The first line (getopt's) and the status; qemu-io's full usage text follows.
        let first = |t: &(String, String, String)| {
            (t.1.lines().next().unwrap_or("").to_string(), t.2.clone())
        };
        if first(&want) != first(&got) {
            differ.push(format!(
                "qemu-io {args:?}\n  qemu-io: {want:?}\n  qimg:    {got:?}"
            ));
        }
    }
    assert!(differ.is_empty(), "differ:\n{}", differ.join("\n"));
    for (tool, args) in [
        ("qemu-img", &["--version"][..]),
        ("qemu-io", &["--version"]),
        ("qemu-io", &["-V"]),
    ] {
        let o = if tool == "qemu-img" {
            ours.img(&s.0, args)
        } else {
            ours.io(&s.0, args)
        };
        let out = ok(tool, &o);
        assert!(
            out.starts_with(&format!("{tool} version 10.")),
            "{tool} {args:?}: {out}"
        );
    }
    // `qemu-img --help`: the usage and the list of commands as qemu-img prints them (qimg
    // has every command of qemu-img 10), and qcow2 and raw among the formats.
    let commands = |out: &str| -> String {
        let from = out.find("QEMU disk image utility").unwrap_or(out.len());
        let to = out.find("Supported image formats").unwrap_or(out.len());
        out[from..to.max(from)]
            .lines()
            .filter(|l| {
                !l.contains("-T,--trace")
                    && !l.contains("specify tracing")
                    && !l.contains("[[enable=")
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    for flag in ["--help", "-h"] {
        let theirs = ok(
            "qemu-img --help",
            &run(&s.0, Path::new("qemu-img"), &[flag]),
        );
        let mine = ok("qemu-img --help", &ours.img(&s.0, &[flag]));
        assert_eq!(commands(&mine), commands(&theirs), "qemu-img {flag}");
        let formats = mine.split("Supported image formats:").nth(1).unwrap_or("");
        assert!(
            formats.contains(" qcow2 ") && formats.contains(" raw"),
            "{mine}"
        );
    }
    // The standard option `-T` (tracing) before the command: taken, the command runs as
    // without it (QEMU may warn that the event does not exist; its output is the same).
    for args in [
        &["-T", "no_such_event", "check", "a.qcow2"][..],
        &["--trace=enable=no_such_event", "-Tx", "info", "a.qcow2"],
    ] {
        let theirs = ok("qemu-img -T", &run(&s.0, Path::new("qemu-img"), args));
        let mine = ok("qemu-img -T", &ours.img(&s.0, args));
        let stable = |o: &str| -> String {
            o.lines()
                .filter(|l| !l.starts_with("disk size"))
                .collect::<Vec<_>>()
                .join("\n")
        };
        assert_eq!(stable(&mine), stable(&theirs), "qemu-img {args:?}");
    }
    // `-T` without its value: getopt's words.
    for args in [&["-T"][..], &["--trace"]] {
        let theirs = run(&s.0, Path::new("qemu-img"), args);
        let mine = ours.img(&s.0, args);
        assert_eq!(masked(&mine), masked(&theirs), "qemu-img {args:?}");
    }
    // Options after dd's operands, as getopt permutes them.
    let (want, got) = both(
        &s,
        &ours,
        "qemu-img",
        &["a.qcow2"],
        &[
            "dd",
            "if=a.qcow2",
            "of=d.qcow2",
            "bs=64k",
            "count=4",
            "-O",
            "qcow2",
            "-f",
            "qcow2",
        ],
    );
    assert_eq!(want, got, "dd with options last");
    // bench prints qemu-img's lines and no more (timings masked).
    let (want, got) = both(
        &s,
        &ours,
        "qemu-img",
        &["a.qcow2"],
        &["bench", "-c", "10", "-w", "a.qcow2"],
    );
    let unclocked = |o: &(String, String, String)| {
        let out: Vec<&str> =
            o.0.lines()
                .filter(|l| !l.starts_with("Run completed in"))
                .collect();
        (out.join("\n"), o.1.clone(), o.2.clone())
    };
    assert_eq!(unclocked(&want), unclocked(&got), "bench");
}

#[test]
fn convert_from_a_snapshot_and_onto_a_zeroed_target_as_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("dropin-convert");
    let ours = Ours::new(&s);
    ok(
        "s",
        &qemu_img(
            &s.0,
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-o",
                "extended_l2=on",
                "s.qcow2",
                "8M",
            ],
        ),
    );
    qemu_io(
        &s.0,
        "qcow2",
        "s.qcow2",
        &["write -P 7 0 1M", "write -P 8 3M 100k", "write -z 5M 64k"],
    );
    ok(
        "snap",
        &qemu_img(&s.0, &["snapshot", "-c", "s1", "s.qcow2"]),
    );
    qemu_io(
        &s.0,
        "qcow2",
        "s.qcow2",
        &["write -P 9 512k 2M", "discard 3M 64k"],
    );
    ok(
        "snap2",
        &qemu_img(&s.0, &["snapshot", "-c", "s2", "s.qcow2"]),
    );
    ok(
        "resize",
        &qemu_img(&s.0, &["resize", "-q", "s.qcow2", "16M"]),
    );
    qemu_io(&s.0, "qcow2", "s.qcow2", &["write -P 10 12M 1M"]);
    for l in [
        "s1",
        "2",
        "snapshot.name=s2",
        "snapshot.id=1",
        "snapshot.id=1,snapshot.name=s1",
        "snapshot.id=1,snapshot.name=s2",
        "nosuch",
        "snapshot.foo=1",
    ] {
        for fmt in ["raw", "qcow2"] {
            let (want, got) = both(
                &s,
                &ours,
                "qemu-img",
                &["s.qcow2"],
                &["convert", "-l", l, "-O", fmt, "s.qcow2", "out"],
            );
            assert_eq!(want, got, "convert -l {l} -O {fmt}");
            let (a, b) = (s.path("qemu/out"), s.path("qimg/out"));
            match (a.exists(), b.exists()) {
                (true, true) => {
                    let o = qemu_img(
                        &s.0,
                        &[
                            "compare",
                            "-f",
                            fmt,
                            "-F",
                            fmt,
                            a.to_str().unwrap(),
                            b.to_str().unwrap(),
                        ],
                    );
                    assert!(
                        o.status.success(),
                        "convert -l {l} -O {fmt}: outputs differ: {o:?}"
                    );
                }
                (false, false) => {}
                other => panic!("convert -l {l}: outputs exist {other:?}"),
            }
        }
    }
    let (want, got) = both(
        &s,
        &ours,
        "qemu-img",
        &["s.qcow2"],
        &[
            "convert", "-l", "s1", "-O", "raw", "s.qcow2", "s.qcow2", "out",
        ],
    );
    assert_eq!(want, got, "-l with two sources");
    // --target-is-zero: refused without -n; with -n onto a zeroed target, the same image.
    let (want, got) = both(
        &s,
        &ours,
        "qemu-img",
        &["s.qcow2"],
        &[
            "convert",
            "--target-is-zero",
            "-O",
            "qcow2",
            "s.qcow2",
            "t.qcow2",
        ],
    );
    assert_eq!(want, got, "--target-is-zero without -n");
    ok(
        "t",
        &qemu_img(&s.0, &["create", "-q", "-f", "qcow2", "t.qcow2", "16M"]),
    );
    let args = [
        "convert",
        "-n",
        "--target-is-zero",
        "-O",
        "qcow2",
        "s.qcow2",
        "t.qcow2",
    ];
    let (want, got) = both(&s, &ours, "qemu-img", &["s.qcow2", "t.qcow2"], &args);
    assert_eq!(want, got, "--target-is-zero -n");
    assert_clean(&s.path("qimg"), "t.qcow2", "--target-is-zero");
    let o = qemu_img(&s.0, &["compare", "qemu/t.qcow2", "qimg/t.qcow2"]);
    assert!(o.status.success(), "--target-is-zero outputs differ: {o:?}");
    let args = [
        "convert",
        "-n",
        "--target-is-zero",
        "-B",
        "s.qcow2",
        "-O",
        "qcow2",
        "s.qcow2",
        "t.qcow2",
    ];
    let (want, got) = both(&s, &ours, "qemu-img", &["s.qcow2", "t.qcow2"], &args);
    assert_eq!(want, got, "--target-is-zero -n -B");
}

#[test]
fn rebase_compressed_writes_compressed_clusters_with_the_same_guest_data() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("dropin-rebase");
    let ours = Ours::new(&s);
    ok(
        "base",
        &qemu_img(&s.0, &["create", "-q", "-f", "qcow2", "base.qcow2", "4M"]),
    );
    qemu_io(
        &s.0,
        "qcow2",
        "base.qcow2",
        &["write -P 3 0 1M", "write -P 4 2M 192k"],
    );
    ok(
        "top",
        &qemu_img(
            &s.0,
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-b",
                "base.qcow2",
                "-F",
                "qcow2",
                "top.qcow2",
            ],
        ),
    );
    qemu_io(
        &s.0,
        "qcow2",
        "top.qcow2",
        &["write -P 5 64k 4k", "write -P 6 2M 64k"],
    );
    let (want, got) = both(
        &s,
        &ours,
        "qemu-img",
        &["base.qcow2", "top.qcow2"],
        &["rebase", "-c", "-b", "", "top.qcow2"],
    );
    assert_eq!(want, got, "rebase -c -b ''");
    for who in ["qemu", "qimg"] {
        assert_clean(&s.path(who), "top.qcow2", who);
        let v = json(
            who,
            &qemu_img(&s.path(who), &["check", "--output=json", "top.qcow2"]),
        );
        let compressed = v["compressed-clusters"].as_u64().unwrap_or(0);
        assert!(compressed > 0, "{who}: no compressed cluster: {v}");
    }
    let o = qemu_img(&s.0, &["compare", "qemu/top.qcow2", "qimg/top.qcow2"]);
    assert!(o.status.success(), "rebase -c: guest data differ: {o:?}");
}

#[test]
fn qemu_io_open_options_reopen_snapshot_mode_and_crashes_as_qemu_io() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("dropin-io");
    let ours = Ours::new(&s);
    ok(
        "a",
        &qemu_img(&s.0, &["create", "-q", "-f", "qcow2", "a.qcow2", "4M"]),
    );
    qemu_io(&s.0, "qcow2", "a.qcow2", &["write -P 1 0 64k"]);
    let cases: &[&[&str]] = &[
        &["-c", "open -o driver=qcow2 a.qcow2", "-c", "read -P 1 0 4k"],
        &[
            "-c",
            "open -o driver=qcow2,file.filename=a.qcow2",
            "-c",
            "read -P 1 0 4k",
        ],
        &["-c", "open -o driver=bogus a.qcow2"],
        &["-c", "open -o driver=qcow2,foo=1 a.qcow2"],
        &[
            "-c",
            "reopen -r",
            "-c",
            "write 0 4k",
            "-c",
            "reopen -w",
            "-c",
            "write -P 2 0 4k",
            "a.qcow2",
        ],
        &["-c", "reopen -r -w", "a.qcow2"],
        // A qcow2 image is no zoned device: each zone command fails once its arguments
        // parsed.
        &[
            "-c",
            "zone_report 0 1",
            "-c",
            "zrp 0 1",
            "-c",
            "zone_open 0 64k",
            "-c",
            "zo 0 64k",
            "-c",
            "zone_close 0 64k",
            "-c",
            "zone_finish 0 64k",
            "-c",
            "zone_reset 0 64k",
            "-c",
            "zap -p 0 0 512",
            "-c",
            "zone_append 0 64k",
            "-c",
            "zone_report",
            "-c",
            "zone_report x 1",
            "a.qcow2",
        ],
        &[
            "-s",
            "-c",
            "write -P 9 0 4k",
            "-c",
            "read -P 9 0 4k",
            "a.qcow2",
        ],
        &[
            "-c",
            "open -s a.qcow2",
            "-c",
            "write -P 9 0 4k",
            "-c",
            "read -P 9 0 4k",
        ],
        &[
            "-c",
            "write -P 5 8k 4k",
            "-c",
            "sigraise 9",
            "-c",
            "write -P 6 0 4k",
            "a.qcow2",
        ],
        &["-c", "write -P 5 16k 4k", "-c", "abort", "a.qcow2"],
        &[
            "--object",
            "secret,id=s0,data=x",
            "-c",
            "read -P 1 0 4k",
            "a.qcow2",
        ],
    ];
    for args in cases {
        let (want, got) = both(&s, &ours, "qemu-io", &["a.qcow2"], args);
        if args.contains(&"abort") {
            // qemu-io's output to a pipe is lost in its buffer when it aborts; qimg's was
            // already written (Rust flushes stdout by lines). The rest must agree.
            assert_eq!((&want.1, &want.2), (&got.1, &got.2), "qemu-io {args:?}");
        } else {
            assert_eq!(want, got, "qemu-io {args:?}");
        }
        // The image as each left it: the same guest data, and consistent (a killed qemu-io in
        // write-through mode leaves every completed write on disk).
        let o = qemu_img(&s.0, &["compare", "qemu/a.qcow2", "qimg/a.qcow2"]);
        assert!(o.status.success(), "qemu-io {args:?}: images differ: {o:?}");
        assert_clean(&s.path("qimg"), "a.qcow2", &format!("{args:?}"));
    }
}

/// Writers with lazy refcounts killed mid-session (iotest 039's scenario), twice, the second
/// time after the first repair moved the refcount structure to the end of the file: what
/// `qemu-img check` reports of each crashed image (data clusters' refcounts missing: a flush
/// leaves them cached, as QEMU does, while new tables' are written), the repair messages the
/// next read-write open prints, the repaired image's check and the file's length are QEMU's,
/// line for line. (Before: qimg's flush wrote the refcounts, its open printed nothing, the
/// rebuild placed the new structure past a crash's allocation reservation, and the second
/// rebuild wrote over the table in use, which the overlap check refused.)
#[test]
fn a_killed_lazy_refcount_writer_is_repaired_as_qemu_repairs_it() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("dropin-lazy");
    let ours = Ours::new(&s);
    ok(
        "l",
        &qemu_img(
            &s.0,
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-o",
                "lazy_refcounts=on",
                "l.qcow2",
                "1M",
            ],
        ),
    );
    let steps: &[(&str, &[&str])] = &[
        (
            "qemu-io",
            &["-c", "write -P 0x5a 0 512", "-c", "sigraise 9", "l.qcow2"],
        ),
        ("qemu-img", &["check", "l.qcow2"]),
        ("qemu-io", &["-c", "read -P 0x5a 0 512", "l.qcow2"]),
        ("qemu-img", &["check", "l.qcow2"]),
        ("qemu-img", &["resize", "l.qcow2", "512M"]),
        (
            "qemu-io",
            &[
                "-c",
                "write -P 1 1M 64k",
                "-c",
                "write -P 2 300M 64k",
                "-c",
                "sigraise 9",
                "l.qcow2",
            ],
        ),
        ("qemu-img", &["check", "l.qcow2"]),
        (
            "qemu-io",
            &[
                "-c",
                "read -P 1 1M 64k",
                "-c",
                "read -P 2 300M 64k",
                "l.qcow2",
            ],
        ),
        ("qemu-img", &["check", "l.qcow2"]),
    ];
    let mut runs = Vec::new();
    for who in ["qemu", "qimg"] {
        let dir = s.path(who);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(s.path("l.qcow2"), dir.join("l.qcow2")).unwrap();
        let mut outs = Vec::new();
        for (tool, args) in steps {
            let o = match (who, *tool) {
                ("qemu", "qemu-io") => qemu_io_run(&dir, args),
                ("qemu", _) => qemu_img(&dir, args),
                (_, "qemu-io") => ours.io(&dir, args),
                _ => ours.img(&dir, args),
            };
            outs.push(masked(&o));
        }
        outs.push((
            std::fs::metadata(dir.join("l.qcow2"))
                .unwrap()
                .len()
                .to_string(),
            String::new(),
            String::new(),
        ));
        runs.push(outs);
    }
    for (i, (want, got)) in runs[0].iter().zip(&runs[1]).enumerate() {
        assert_eq!(want, got, "step {i}: {:?}", steps.get(i));
    }
}

#[test]
fn copy_on_read_copies_what_qemu_io_copies() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("dropin-cor");
    let ours = Ours::new(&s);
    ok(
        "b",
        &qemu_img(&s.0, &["create", "-q", "-f", "qcow2", "b.qcow2", "4M"]),
    );
    qemu_io(
        &s.0,
        "qcow2",
        "b.qcow2",
        &["write -P 1 0 1M", "write -z 2M 64k"],
    );
    for (opts, file) in [
        ("extended_l2=on", "x.qcow2"),
        ("cluster_size=4k", "s.qcow2"),
        ("extended_l2=off", "n.qcow2"),
    ] {
        let backing: &[&str] = if file == "n.qcow2" {
            &[]
        } else {
            &["-b", "b.qcow2", "-F", "qcow2"]
        };
        let mut args = vec!["create", "-q", "-f", "qcow2", "-o", opts];
        args.extend_from_slice(backing);
        args.extend_from_slice(&[file, "4M"]);
        ok(file, &qemu_img(&s.0, &args));
        for run in [
            &[
                "-C",
                "-c",
                "read 1000 100",
                "-c",
                "read 1M 4k",
                "-c",
                "readv 2000k 4k 4k",
                "-c",
                "map",
                file,
            ][..],
            &[
                "-c",
                format!("open -C {file}").as_str(),
                "-c",
                "read 63k 2k",
                "-c",
                "map",
            ],
        ] {
            let (want, got) = both(&s, &ours, "qemu-io", &["b.qcow2", file], run);
            assert_eq!(want, got, "qemu-io {run:?}");
            let map = |who: &str| {
                ok(
                    who,
                    &qemu_img(&s.path(who), &["map", "--output=json", file]),
                )
            };
            assert_eq!(map("qemu"), map("qimg"), "{run:?}: maps differ");
            assert_clean(&s.path("qimg"), file, &format!("{run:?}"));
        }
    }
}

#[test]
fn image_names_as_qemu_takes_them() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("dropin-names");
    let ours = Ours::new(&s);
    ok(
        "b",
        &qemu_img(&s.0, &["create", "-q", "-f", "qcow2", "b.qcow2", "4M"]),
    );
    qemu_io(&s.0, "qcow2", "b.qcow2", &["write -P 1 0 1M"]);
    ok(
        "t",
        &qemu_img(
            &s.0,
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-o",
                "extended_l2=on",
                "-b",
                "b.qcow2",
                "-F",
                "qcow2",
                "t.qcow2",
            ],
        ),
    );
    qemu_io(&s.0, "qcow2", "t.qcow2", &["write -P 2 64k 4k"]);
    let no_backing =
        r#"json:{"driver":"qcow2","file":{"driver":"file","filename":"t.qcow2"},"backing":null}"#;
    let probed = r#"json:{"file.driver":"file","file.filename":"t.qcow2"}"#;
    let as_raw = r#"json:{"driver":"raw","file":{"driver":"file","filename":"t.qcow2"}}"#;
    let cases: &[&[&str]] = &[
        &[
            "-c",
            "write -P 5 100k 1k",
            "-c",
            "read -P 0 0 4k",
            "-c",
            "read -P 2 64k 4k",
            "-c",
            "map",
            no_backing,
        ],
        &["-c", "read -P 1 0 4k", "-c", "map", probed],
        &["-c", "read -P 1 0 4k", "file:t.qcow2"],
        &["-c", "read -v 0 16", as_raw],
        &[
            "--image-opts",
            "-c",
            "read -P 0 0 4k",
            "driver=qcow2,file.filename=t.qcow2,backing=",
        ],
    ];
    for args in cases {
        let (want, got) = both(&s, &ours, "qemu-io", &["b.qcow2", "t.qcow2"], args);
        assert_eq!(want, got, "qemu-io {args:?}");
        let o = qemu_img(&s.0, &["compare", "qemu/t.qcow2", "qimg/t.qcow2"]);
        assert!(o.status.success(), "qemu-io {args:?}: images differ: {o:?}");
    }
    for args in [
        &["map", "--output=json", no_backing][..],
        &["info", probed],
        &["compare", no_backing, "b.qcow2"],
        &["convert", "-O", "raw", no_backing, "out.raw"],
    ] {
        let (want, got) = both(&s, &ours, "qemu-img", &["b.qcow2", "t.qcow2"], args);
        let strip = |t: &(String, String, String)| {
            let out: Vec<&str> = t.0.lines().filter(|l| !l.contains("disk size")).collect();
            (out.join("\n"), t.1.clone(), t.2.clone())
        };
        assert_eq!(strip(&want), strip(&got), "qemu-img {args:?}");
    }
    assert_eq!(
        std::fs::read(s.path("qemu/out.raw")).unwrap(),
        std::fs::read(s.path("qimg/out.raw")).unwrap(),
        "convert of an image without its backing file"
    );
}

/// Runs `program args` under `sh` with standard error merged into standard output (`2>&1`,
/// as scripts filter them) and returns that one stream, timings masked.
fn merged(dir: &Path, program: &Path, args: &[&str]) -> String {
    let o = std::process::Command::new("sh")
        .arg("-c")
        .arg("\"$0\" \"$@\" 2>&1")
        .arg(program)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    masked(&o).0
}

#[test]
fn merged_streams_come_out_in_qemus_order() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("merged-streams");
    let ours = Ours::new(&s);
    let cases: &[(&str, &[&str])] = &[
        // stdio buffers standard output in a pipe: the errors come first.
        (
            "qemu-io",
            &[
                "-c",
                "write 0 64k",
                "-c",
                "open -r nonexist",
                "-c",
                "read 0 1",
                "-c",
                "foo",
                "-c",
                "read 0 1",
                "t.qcow2",
            ],
        ),
        // The header is printed, then the error: the error comes first.
        ("qemu-img", &["map", "c.qcow2"]),
        // qemu-img flushes the Formatting line before the driver refuses.
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "cluster_size=3",
                "x.qcow2",
                "1M",
            ],
        ),
        // sigraise flushes standard output before the signal.
        (
            "qemu-io",
            &["-c", "write 0 512", "-c", "sigraise 9", "t.qcow2"],
        ),
    ];
    for (tool, args) in cases {
        let mut outs = Vec::new();
        for who in ["qemu", "qimg"] {
            let dir = s.path(who);
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            for made in [
                qemu_img(&dir, &["create", "-f", "qcow2", "t.qcow2", "1M"]),
                qemu_img(&dir, &["create", "-f", "qcow2", "c.qcow2", "1M"]),
                qemu_io_run(&dir, &["-c", "write -c 0 64k", "c.qcow2"]),
            ] {
                assert!(made.status.success(), "{made:?}");
            }
            let program = match who {
                "qemu" => PathBuf::from(tool),
                _ => ours.bin.join(tool),
            };
            outs.push(merged(&dir, &program, args));
        }
        assert_eq!(
            outs[1], outs[0],
            "{tool} {args:?}: qimg's merged output (right) differs from QEMU's (left)"
        );
        assert!(!outs[0].is_empty());
    }
}

#[test]
fn blkdebug_injects_errors_where_qemus_does() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("blkdebug");
    let ours = Ours::new(&s);
    let commands = [
        "-c",
        "write 0 128k",
        "-c",
        "write 70k 8k",
        "-c",
        "read 0 4k",
    ];
    // (event, once, errno): each fails a different request of the same three commands.
    let rules: &[(&str, &str, u32)] = &[
        ("write_aio", "on", 5),
        ("write_aio", "off", 28),
        ("l2_alloc_write", "on", 28),
        ("l2_alloc_write", "off", 5),
        ("refblock_update_part", "on", 5),
        ("cluster_alloc", "on", 28),
        ("read_aio", "off", 28),
        ("flush_to_os", "off", 5),
    ];
    let mut names: Vec<(String, String)> = Vec::new();
    for (event, once, errno) in rules {
        let config = format!(
            "# {event}\n[inject-error]\nevent = \"{event}\"\nerrno = \"{errno}\"\nonce = \"{once}\"\n"
        );
        names.push((config, "blkdebug:rules.cfg:t.qcow2".into()));
    }
    // The same rules as a json: name and as --image-opts, with a state machine.
    names.push((
        String::new(),
        r#"json:{"driver":"qcow2","file":{"driver":"blkdebug","image":{"driver":"file","filename":"t.qcow2"},"set-state":[{"event":"l2_alloc_write","new_state":2}],"inject-error":[{"event":"write_aio","state":2,"errno":28,"once":true}]}}"#
            .into(),
    ));
    names.push((
        String::new(),
        "--image-opts\ndriver=qcow2,file.driver=blkdebug,file.image.filename=t.qcow2,\
         file.inject-error.0.event=refblock_update_part,file.inject-error.0.errno=28,\
         file.inject-error.0.once=on"
            .into(),
    ));
    let prepare: Prep = &[("qemu-img", &["create", "-f", "qcow2", "t.qcow2", "1G"])];
    for (config, name) in &names {
        let mut args: Vec<&str> = commands.to_vec();
        // Several arguments are given one per line.
        args.extend(name.lines());
        let steps: Prep = &[("qemu-io", &args)];
        let files = [("rules.cfg", config.as_str())];
        let mut outs = side_by_side(&s, &ours, &files, prepare, steps);
        // The image each left, as QEMU's check sees it.
        for (out, who) in outs.iter_mut().zip(["qemu", "qimg"]) {
            let check = qemu_img(&s.path(who), &["check", "t.qcow2"]);
            let check = String::from_utf8_lossy(&check.stdout)
                .lines()
                .filter(|l| !l.starts_with("Image end offset") && !l.contains("allocated"))
                .collect::<Vec<_>>()
                .join("\n");
            out.push_str(&format!("--- check:\n{check}"));
        }
        assert_eq!(
            outs[1], outs[0],
            "{name} with {config:?}: qimg (left) differs from QEMU (right)"
        );
        assert!(
            outs[0].contains("failed"),
            "{config}: nothing failed: {}",
            outs[0]
        );
    }
}

#[test]
fn the_vm_state_area_is_read_and_written_as_qemu_io_does() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("vmstate");
    let ours = Ours::new(&s);
    // Each step: (tool, arguments); the image is made by qemu-img in each directory.
    let steps: &[(&str, &[&str])] = &[
        (
            "qemu-io",
            &[
                "-c",
                "write -b -P 0x11 0 64k",
                "-c",
                "read -b -P 0x11 0 64k",
                "-c",
                "read -b -P 0 64k 64k",
                "-c",
                "write -b -P 0x22 100k 200k",
                "-c",
                "read -b -P 0x22 100k 200k",
                "-c",
                "read -P 0 0 1M",
                "-c",
                "read -b 1M 1",
                "-c",
                "write -b 3 512",
                "t.qcow2",
            ],
        ),
        ("qemu-io", &["-r", "-c", "read -b -v 99k 1k", "t.qcow2"]),
        ("qemu-img", &["check", "t.qcow2"]),
        ("qemu-img", &["map", "--output=json", "t.qcow2"]),
        ("qemu-img", &["snapshot", "-c", "s1", "t.qcow2"]),
        ("qemu-img", &["check", "t.qcow2"]),
        ("qemu-io", &["-f", "raw", "-c", "write -b 0 64k", "t.qcow2"]),
        ("qemu-img", &["resize", "t.qcow2", "2M"]),
        (
            "qemu-io",
            &["-c", "read -b -P 0 0 64k", "-c", "info", "t.qcow2"],
        ),
        ("qemu-img", &["check", "t.qcow2"]),
    ];
    let prepare: Prep = &[("qemu-img", &["create", "-f", "qcow2", "t.qcow2", "1M"])];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    // Each reads what the other saved.
    let dir = s.path("qemu");
    let read = [
        "-r",
        "-c",
        "read -b -P 0x22 100k 200k",
        "-c",
        "read -b -P 0x11 0 64k",
        "t.qcow2",
    ];
    let o = ours.io(&dir, &read);
    assert!(
        o.status.success() && !String::from_utf8_lossy(&o.stdout).contains("fail"),
        "{o:?}"
    );
    let dir = s.path("qimg");
    let o = qemu_io_run(&dir, &read);
    assert!(
        o.status.success() && !String::from_utf8_lossy(&o.stdout).contains("fail"),
        "{o:?}"
    );
}

/// Steps run with QEMU's tools or ours: `(tool, arguments)`.
pub(crate) type Prep<'a> = &'a [(&'a str, &'a [&'a str])];

/// Runs `steps` in a directory for QEMU's tools and one for ours, each prepared alike (the
/// `files` written, the `prepare` steps run with QEMU's tools), and returns the merged
/// output of every step, QEMU's then ours.
/// `outs` without the lines that contain any of `noise` (timings, disk usage).
pub(crate) fn without_lines(outs: &[String], noise: &[&str]) -> Vec<String> {
    outs.iter()
        .map(|o| {
            o.lines()
                .filter(|l| !noise.iter().any(|n| l.contains(n)))
                .collect::<Vec<_>>()
                .join("\n")
        })
        .collect()
}

pub(crate) fn side_by_side(
    s: &Scratch,
    ours: &Ours,
    files: &[(&str, &str)],
    prepare: Prep<'_>,
    steps: Prep<'_>,
) -> Vec<String> {
    let mut outs = Vec::new();
    for who in ["qemu", "qimg"] {
        let dir = s.path(who);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for (name, text) in files {
            std::fs::write(dir.join(name), text).unwrap();
        }
        for (tool, args) in prepare {
            let done = merged(&dir, Path::new(tool), args);
            assert!(!done.contains("rror"), "{tool} {args:?}: {done}");
        }
        let mut out = String::new();
        for (tool, args) in steps {
            let program = match who {
                "qemu" => PathBuf::from(tool),
                _ => ours.bin.join(tool),
            };
            out.push_str(&format!(
                "$ {tool} {args:?}\n{}\n",
                merged(&dir, &program, args)
            ));
        }
        outs.push(out);
    }
    outs
}

#[test]
fn convert_salvage_copies_what_can_be_read_as_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("salvage");
    let ours = Ours::new(&s);
    // One sector of the source's data (host byte 1 MiB) cannot be read.
    let files = [(
        "rd.cfg",
        "[inject-error]\nevent = \"read_aio\"\nerrno = \"5\"\nsector = \"2048\"\n",
    )];
    let prepare: Prep = &[
        ("qemu-img", &["create", "-f", "qcow2", "s.qcow2", "4M"]),
        ("qemu-io", &["-c", "write -P 0x11 0 4M", "s.qcow2"]),
    ];
    let steps: Prep = &[
        (
            "qemu-img",
            &[
                "convert",
                "--salvage",
                "-O",
                "qcow2",
                "blkdebug:rd.cfg:s.qcow2",
                "d1.qcow2",
            ],
        ),
        ("qemu-img", &["compare", "s.qcow2", "d1.qcow2"]),
        ("qemu-img", &["check", "d1.qcow2"]),
        (
            "qemu-io",
            &[
                "-c",
                "read -P 0 720896 512",
                "-c",
                "read -P 0x11 721408 512",
                "-c",
                "read -P 0x11 720384 512",
                "d1.qcow2",
            ],
        ),
        (
            "qemu-img",
            &[
                "convert",
                "-O",
                "qcow2",
                "blkdebug:rd.cfg:s.qcow2",
                "d2.qcow2",
            ],
        ),
        (
            "qemu-img",
            &[
                "convert",
                "--salvage",
                "-C",
                "-O",
                "qcow2",
                "s.qcow2",
                "d5.qcow2",
            ],
        ),
        (
            "qemu-img",
            &[
                "convert",
                "--salvage",
                "-q",
                "-O",
                "raw",
                "blkdebug:rd.cfg:s.qcow2",
                "d6.raw",
            ],
        ),
        (
            "qemu-img",
            &["compare", "-f", "qcow2", "-F", "raw", "d1.qcow2", "d6.raw"],
        ),
    ];
    let outs = side_by_side(&s, &ours, &files, prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(
        outs[0].contains("warning: error while reading offset 720896"),
        "{}",
        outs[0]
    );
}

#[test]
fn a_second_open_of_a_locked_image_is_refused_in_qemus_words() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("lock-words");
    let ours = Ours::new(&s);
    let prepare: Prep = &[
        ("qemu-img", &["create", "-f", "qcow2", "t.qcow2", "1M"]),
        ("qemu-img", &["bitmap", "--add", "t.qcow2", "b0"]),
        ("qemu-img", &["bitmap", "--add", "t.qcow2", "b1"]),
    ];
    // The merge source is the image being changed: its second open meets the first's lock.
    let steps: Prep = &[
        (
            "qemu-img",
            &["bitmap", "--merge", "b0", "-b", "t.qcow2", "t.qcow2", "b1"],
        ),
        ("qemu-img", &["bitmap", "--remove", "t.qcow2", "b0"]),
        ("qemu-img", &["bitmap", "--remove", "t.qcow2", "b0"]),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(outs[0].contains("lock"), "{}", outs[0]);
}

#[test]
fn corruption_is_reported_and_repaired_in_qemus_words() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("corruption-words");
    let ours = Ours::new(&s);
    let prepare: Prep = &[
        ("qemu-img", &["create", "-f", "qcow2", "t.qcow2", "8M"]),
        ("qemu-io", &["-c", "write -P 1 0 128k", "t.qcow2"]),
        ("qemu-img", &["create", "-f", "qcow2", "c.qcow2", "8M"]),
        ("qemu-io", &["-c", "write -P 1 0 64k", "c.qcow2"]),
    ];
    let steps: Prep = &[
        // The refcount of data cluster 5 (entry at 0x2000a of the refcount block) dropped.
        (
            "qemu-io",
            &["-f", "raw", "-c", "write -P 0 0x2000a 2", "t.qcow2"],
        ),
        ("qemu-img", &["check", "t.qcow2"]),
        ("qemu-img", &["check", "-r", "leaks", "t.qcow2"]),
        ("qemu-img", &["check", "-r", "all", "t.qcow2"]),
        ("qemu-img", &["check", "t.qcow2"]),
        // A free cluster counted: a leak.
        (
            "qemu-io",
            &["-f", "raw", "-c", "write -P 1 0x20015 1", "t.qcow2"],
        ),
        ("qemu-img", &["check", "--output=json", "t.qcow2"]),
        ("qemu-img", &["check", "-r", "leaks", "t.qcow2"]),
        // The L2 entry of guest cluster 0 pointed at the refcount table (0x10000): the write
        // is refused and the image marked corrupt; a read-write open is then refused.
        (
            "qemu-io",
            &[
                "-f",
                "raw",
                "-c",
                "write -P 0 0x40000 8",
                "-c",
                "write -P 0x80 0x40000 1",
                "-c",
                "write -P 0x01 0x40005 1",
                "c.qcow2",
            ],
        ),
        ("qemu-io", &["-c", "write -P 2 0 4k", "c.qcow2"]),
        ("qemu-io", &["-c", "read 0 4k", "c.qcow2"]),
        ("qemu-io", &["-r", "-c", "read 0 4k", "c.qcow2"]),
        ("qemu-img", &["check", "c.qcow2"]),
        ("qemu-img", &["check", "-r", "all", "c.qcow2"]),
        ("qemu-io", &["-c", "read 0 4k", "c.qcow2"]),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(outs[0].contains("Marking image as corrupt"), "{}", outs[0]);
}

/// qemu-io's `reopen -o` checks the qcow2 runtime options' values as an open does (QEMU's
/// `qcow2_update_options` runs on reopen), in QEMU's words, and refuses options reopen
/// cannot change.
#[test]
fn reopen_checks_runtime_options_as_qemu_io() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("reopen-options");
    let ours = Ours::new(&s);
    let prepare: Prep = &[(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", "a.qcow2", "64M"],
    )];
    let steps: Prep = &[(
        "qemu-io",
        &[
            "-c",
            "reopen -o lazy-refcounts=42",
            "-c",
            "reopen -o cache-clean-interval=-1",
            "-c",
            "reopen -o overlap-check=foo",
            "-c",
            "reopen -o overlap-check=none",
            "-c",
            "reopen -o l2-cache-size=1M,refcount-cache-size=1M,cache-size=1M",
            "-c",
            "reopen -o cache-size=1M,l2-cache-size=2M",
            "-c",
            "reopen -o l2-cache-size=-1",
            "-c",
            "reopen -o foo=bar",
            "-c",
            "write -P 1 0 64k",
            "-c",
            "reopen -r",
            "-c",
            "read -P 1 0 64k",
            "a.qcow2",
        ],
    )];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(
        outs[0].contains("Cache clean interval too big"),
        "{}",
        outs[0]
    );
}

/// `commit` looks for a base named with `-b` before it asks whether there is a backing file
/// at all (QEMU's `bdrv_find_backing_image`), and warns of a probed raw image first; a safe
/// `rebase` without `-F` reports a new backing file that is not there before the format.
#[test]
fn commit_refuses_a_missing_base_as_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("commit-base");
    let ours = Ours::new(&s);
    let prepare: Prep = &[
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "nb.qcow2", "1M"],
        ),
        ("qemu-img", &["create", "-q", "-f", "raw", "rr.raw", "1M"]),
        (
            "qemu-img",
            &[
                "create", "-q", "-f", "qcow2", "-b", "nb.qcow2", "-F", "qcow2", "tp.qcow2",
            ],
        ),
    ];
    let steps: Prep = &[
        ("qemu-img", &["commit", "nb.qcow2"]),
        ("qemu-img", &["commit", "-b", "x", "nb.qcow2"]),
        ("qemu-img", &["commit", "-b", "nb.qcow2", "nb.qcow2"]),
        ("qemu-img", &["commit", "-b", "x", "tp.qcow2"]),
        ("qemu-img", &["commit", "-b", "x", "rr.raw"]),
        ("qemu-img", &["commit", "rr.raw"]),
        ("qemu-img", &["commit", "-f", "raw", "rr.raw"]),
        // rebase: a safe one opens the new backing file first; -u only names it.
        ("qemu-img", &["rebase", "-b", "nx.qcow2", "tp.qcow2"]),
        ("qemu-img", &["rebase", "-u", "-b", "nx.qcow2", "tp.qcow2"]),
        (
            "qemu-img",
            &["rebase", "-b", "nx.qcow2", "-F", "qcow2", "tp.qcow2"],
        ),
        ("qemu-img", &["rebase", "-b", "nb.qcow2", "tp.qcow2"]),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(
        outs[0].contains("Did not find 'x' in the backing chain of 'nb.qcow2'"),
        "{}",
        outs[0]
    );
}

/// A safe `rebase` without `-F` runs as qemu-img's: the image (with its backing chain) opens
/// first, then the new backing file (probed), the differing clusters are copied, and only
/// then is the change refused; the image keeps its old backing file with the copied clusters
/// (map compared). `-f raw` with a missing new backing file reports that file first.
#[test]
fn rebase_without_a_backing_format_copies_then_refuses_as_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("rebase-no-fmt");
    let ours = Ours::new(&s);
    let prepare: Prep = &[
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "b0.qcow2", "1M"],
        ),
        ("qemu-io", &["-c", "write -P 1 0 256k", "b0.qcow2"]),
        (
            "qemu-img",
            &[
                "create", "-q", "-f", "qcow2", "-b", "b0.qcow2", "-F", "qcow2", "b1.qcow2",
            ],
        ),
        ("qemu-io", &["-c", "write -P 2 128k 128k", "b1.qcow2"]),
        (
            "qemu-img",
            &[
                "create", "-q", "-f", "qcow2", "-b", "b1.qcow2", "-F", "qcow2", "t.qcow2",
            ],
        ),
        (
            "qemu-img",
            &[
                "create", "-q", "-f", "qcow2", "-b", "b1.qcow2", "-F", "qcow2", "t2.qcow2",
            ],
        ),
        ("qemu-img", &["create", "-q", "-f", "raw", "r.raw", "1M"]),
    ];
    let steps: Prep = &[
        ("qemu-img", &["rebase", "-b", "b0.qcow2", "t.qcow2"]),
        ("qemu-img", &["map", "t.qcow2"]),
        (
            "qemu-img",
            &[
                "rebase",
                "-u",
                "-b",
                "nope.qcow2",
                "-F",
                "qcow2",
                "t2.qcow2",
            ],
        ),
        ("qemu-img", &["rebase", "-b", "b0.qcow2", "t2.qcow2"]),
        ("qemu-img", &["rebase", "-f", "raw", "-b", "x", "r.raw"]),
        (
            "qemu-img",
            &["rebase", "-u", "-f", "raw", "-b", "x", "r.raw"],
        ),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(outs[0].contains("t.qcow2\n"), "{}", outs[0]);
}

/// Size arguments as qemu-img's `cvtnum`: what does not parse is invalid, what parses past
/// 63 bits is out of range, each in its words (`convert -S`/`-r`, `map --max-length`, `commit
/// -r`); `convert -r RATE` and `commit -r RATE` copy the same bytes.
#[test]
fn size_arguments_are_refused_in_qemu_imgs_words() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("size-arguments");
    let ours = Ours::new(&s);
    let prepare: Prep = &[
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "z.qcow2", "4M"],
        ),
        ("qemu-io", &["-c", "write -P 1 0 3M", "z.qcow2"]),
        (
            "qemu-img",
            &[
                "create", "-q", "-f", "qcow2", "-b", "z.qcow2", "-F", "qcow2", "ov.qcow2",
            ],
        ),
        ("qemu-io", &["-c", "write -P 2 1M 2M", "ov.qcow2"]),
    ];
    let steps: Prep = &[
        (
            "qemu-img",
            &["convert", "-r", "9E", "-O", "raw", "z.qcow2", "o.raw"],
        ),
        (
            "qemu-img",
            &["convert", "-r", "1x", "-O", "raw", "z.qcow2", "o.raw"],
        ),
        (
            "qemu-img",
            &["convert", "-S", "9E", "-O", "raw", "z.qcow2", "o.raw"],
        ),
        (
            "qemu-img",
            &["convert", "-S", "1x", "-O", "raw", "z.qcow2", "o.raw"],
        ),
        (
            "qemu-img",
            &["convert", "-S", "100", "-O", "raw", "z.qcow2", "o.raw"],
        ),
        ("qemu-img", &["map", "--max-length=1x", "z.qcow2"]),
        (
            "qemu-img",
            &["map", "--start-offset=99999999999999999999", "z.qcow2"],
        ),
        ("qemu-img", &["commit", "-r", "1x", "z.qcow2"]),
        (
            "qemu-img",
            &["convert", "-r", "64M", "-O", "raw", "z.qcow2", "o.raw"],
        ),
        (
            "qemu-img",
            &["compare", "-f", "qcow2", "-F", "raw", "z.qcow2", "o.raw"],
        ),
        // A request past the end fails the run with the block layer's EIO.
        ("qemu-img", &["bench", "-c", "10", "-o", "4M", "z.qcow2"]),
        (
            "qemu-img",
            &["bench", "-c", "10", "-d", "4", "-s", "5M", "z.qcow2"],
        ),
        ("qemu-img", &["commit", "-r", "64M", "ov.qcow2"]),
        (
            "qemu-io",
            &["-c", "read -P 1 0 1M", "-c", "read -P 2 1M 2M", "z.qcow2"],
        ),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(
        outs[0].contains("Invalid rate limit specified: '1x'.")
            && outs[0].contains("Images are identical."),
        "{}",
        outs[0]
    );
}

/// qemu-io warns of a probed raw image only where a write could reach block 0: not with `-r`,
/// `open -r` or `-s`.
#[test]
fn a_probed_raw_image_is_warned_of_only_when_writable() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("raw-probe-warning");
    let ours = Ours::new(&s);
    let prepare: Prep = &[("qemu-img", &["create", "-q", "-f", "raw", "pr.img", "1M"])];
    let steps: Prep = &[
        ("qemu-io", &["-r", "-c", "read 0 1", "pr.img"]),
        ("qemu-io", &["-c", "open -r pr.img", "-c", "read 0 1"]),
        ("qemu-io", &["-s", "-c", "read 0 1", "pr.img"]),
        ("qemu-io", &["-c", "read 0 1", "pr.img"]),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert_eq!(
        outs[0].matches("probing guessed raw").count(),
        1,
        "{}",
        outs[0]
    );
}

/// A `json:` name that does not parse is refused in the words of QEMU's JSON parser.
#[test]
fn bad_json_names_are_refused_in_qemus_words() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("bad-json");
    let ours = Ours::new(&s);
    let names = [
        r#"json:{"driver":"qcow2""#,
        r#"json:{"driver":}"#,
        r#"json:{"driver" "x"}"#,
        "json:[1]",
        r#"json:{"driver":"qcow2",}"#,
        "json:",
        r#"json:{"a":1}x"#,
    ];
    let mut steps: Vec<(&str, Vec<&str>)> = Vec::new();
    for n in &names {
        steps.push(("qemu-io", vec!["-c", "read 0 1", n]));
        steps.push(("qemu-img", vec!["info", n]));
    }
    let steps: Vec<(&str, &[&str])> = steps.iter().map(|(t, a)| (*t, a.as_slice())).collect();
    let outs = side_by_side(&s, &ours, &[], &[], &steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(
        outs[0].contains("JSON parse error, premature EOI"),
        "{}",
        outs[0]
    );
}

/// Incompatible feature bits qimg does not know refuse the image in QEMU's words: the names
/// the image's own feature table gives them, then the rest as a mask (iotest 036's case).
#[test]
fn unknown_incompatible_features_are_named_as_qemu_names_them() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("unknown-features");
    let ours = Ours::new(&s);
    let prepare: Prep = &[
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "a.qcow2", "4M"],
        ),
        // The table's first entry (at 120: "dirty bit") now names bit 63; bits 63, 62
        // and 61 are set.
        (
            "qemu-io",
            &[
                "-f",
                "raw",
                "-c",
                "write -P 0x3f 121 1",
                "-c",
                "write -P 0xe0 72 1",
                "a.qcow2",
            ],
        ),
    ];
    let steps: Prep = &[
        ("qemu-img", &["info", "a.qcow2"]),
        ("qemu-io", &["-c", "read 0 1", "a.qcow2"]),
        ("qemu-img", &["check", "a.qcow2"]),
        ("qemu-img", &["map", "a.qcow2"]),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(
        outs[0].contains(
            "Unsupported qcow2 feature(s): dirty bit, Unknown incompatible feature: \
             6000000000000000"
        ),
        "{}",
        outs[0]
    );
}

/// A header QEMU refuses at open is refused in QEMU's words (iotest 080's cases), by
/// qemu-img and qemu-io alike: cluster size, L1 and refcount table sizes and offsets,
/// refcount width, version, header length, snapshot count, backing file offset, compression
/// type.
#[test]
fn refused_headers_are_refused_in_qemus_words() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("refused-headers");
    let ours = Ours::new(&s);
    // (byte pattern, header offset) written over a fresh image.
    let patches = [
        ("0x20", "23"),
        ("0x08", "23"),
        ("0xff", "36"),
        ("0x01", "47"),
        ("0x01", "55"),
        ("0xff", "56"),
        ("0x07", "99"),
        ("0x04", "7"),
        ("0x00", "103"),
        ("0xff", "60"),
        ("0x00", "39"),
        ("0x10", "9"),
        ("0xff", "104"),
    ];
    let names: Vec<String> = (0..patches.len()).map(|i| format!("h{i}.qcow2")).collect();
    let writes: Vec<String> = patches
        .iter()
        .map(|(p, at)| format!("write -P {p} {at} 1"))
        .collect();
    let mut prepare: Vec<(&str, Vec<&str>)> = Vec::new();
    let mut steps: Vec<(&str, Vec<&str>)> = Vec::new();
    for (name, write) in names.iter().zip(&writes) {
        prepare.push(("qemu-img", vec!["create", "-q", "-f", "qcow2", name, "4M"]));
        prepare.push(("qemu-io", vec!["-f", "raw", "-c", write, name]));
        steps.push(("qemu-img", vec!["info", name]));
        steps.push(("qemu-io", vec!["-c", "read 0 1", name]));
    }
    let prepare: Vec<(&str, &[&str])> = prepare.iter().map(|(t, a)| (*t, a.as_slice())).collect();
    let steps: Vec<(&str, &[&str])> = steps.iter().map(|(t, a)| (*t, a.as_slice())).collect();
    let outs = side_by_side(&s, &ours, &[], &prepare, &steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(
        outs[0].contains("Unsupported cluster size: 2^32"),
        "{}",
        outs[0]
    );
}

/// A file that is not there: every command says so in qemu-img's words (the name twice,
/// the block layer's and the command's), whichever way it opens the file.
#[test]
fn a_missing_file_is_refused_in_qemu_imgs_words() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("missing-file");
    let ours = Ours::new(&s);
    let steps: Prep = &[
        ("qemu-img", &["info", "nx.qcow2"]),
        ("qemu-img", &["map", "nx.qcow2"]),
        ("qemu-img", &["check", "nx.qcow2"]),
        ("qemu-img", &["snapshot", "-l", "nx.qcow2"]),
        ("qemu-img", &["compare", "nx.qcow2", "nx.qcow2"]),
        ("qemu-img", &["convert", "-O", "raw", "nx.qcow2", "o.raw"]),
        ("qemu-img", &["bench", "-c", "1", "nx.qcow2"]),
        ("qemu-img", &["measure", "-O", "qcow2", "nx.qcow2"]),
        ("qemu-img", &["resize", "nx.qcow2", "1M"]),
        ("qemu-img", &["commit", "nx.qcow2"]),
        ("qemu-io", &["-c", "read 0 1", "nx.qcow2"]),
    ];
    let outs = side_by_side(&s, &ours, &[], &[], steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert_eq!(
        outs[0]
            .matches("Could not open 'nx.qcow2': Could not open 'nx.qcow2': No such file")
            .count(),
        10,
        "{}",
        outs[0]
    );
}

/// `convert` over an L2 entry that does not decode (cluster 3 of 64 KiB): without
/// `--salvage` the error names the first sector whose block status fails; with it every such
/// sector is warned of in the counting pass and again, with its failed read, in the copy,
/// and copied as zeros (the output's other data intact); `-q` silences the warnings.
#[test]
fn convert_salvage_walks_around_unreadable_block_status() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("salvage-status");
    let ours = Ours::new(&s);
    let prepare: Prep = &[
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "b.qcow2", "4M"],
        ),
        (
            "qemu-io",
            &[
                "-c",
                "write -P 5 0 1M",
                "-c",
                "write -P 6 2M 64k",
                "b.qcow2",
            ],
        ),
        // L2[3] (at 0x40018) = 0x8000000000080200: an unaligned data cluster.
        (
            "qemu-io",
            &["-f", "raw", "-c", "write -P 0x02 0x4001e 1", "b.qcow2"],
        ),
    ];
    let steps: Prep = &[
        (
            "qemu-img",
            &["convert", "-O", "qcow2", "b.qcow2", "plain.qcow2"],
        ),
        (
            "qemu-img",
            &[
                "convert",
                "--salvage",
                "-O",
                "qcow2",
                "b.qcow2",
                "out.qcow2",
            ],
        ),
        (
            "qemu-io",
            &[
                "-c",
                "read -P 5 0 192k",
                "-c",
                "read -P 0 192k 64k",
                "-c",
                "read -P 5 256k 768k",
                "-c",
                "read -P 0 1M 1M",
                "-c",
                "read -P 6 2M 64k",
                "out.qcow2",
            ],
        ),
        ("qemu-img", &["check", "out.qcow2"]),
        (
            "qemu-img",
            &[
                "convert",
                "-q",
                "--salvage",
                "-O",
                "raw",
                "b.qcow2",
                "out.raw",
            ],
        ),
        (
            "qemu-img",
            &[
                "compare",
                "-f",
                "qcow2",
                "-F",
                "raw",
                "out.qcow2",
                "out.raw",
            ],
        ),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(
        outs[0].contains("error while reading block status at offset 196608")
            && outs[0].contains("warning: error while reading offset 261632"),
        "{}",
        outs[0]
    );
}

#[test]
fn damaged_tables_open_and_fail_where_qemus_do() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("damaged-tables");
    let ours = Ours::new(&s);
    // 64 KiB clusters: refcount table 0x10000, its block 0x20000, L1 0x30000, and after the
    // first write the L2 table 0x40000 and the data cluster 0x50000.
    let prepare: Prep = &[
        ("qemu-img", &["create", "-f", "qcow2", "l1.qcow2", "8M"]),
        ("qemu-img", &["create", "-f", "qcow2", "l2.qcow2", "8M"]),
        ("qemu-img", &["create", "-f", "qcow2", "rb.qcow2", "8M"]),
        ("qemu-io", &["-c", "write -P 1 0 64k", "l1.qcow2"]),
        ("qemu-io", &["-c", "write -P 1 0 64k", "l2.qcow2"]),
        ("qemu-io", &["-c", "write -P 1 0 64k", "rb.qcow2"]),
        // L1[0] = 0x8000000000042a00: an unaligned L2 table.
        (
            "qemu-io",
            &[
                "-f",
                "raw",
                "-c",
                "write -P 0x80 0x30000 1",
                "-c",
                "write -P 0x04 0x30005 1",
                "-c",
                "write -P 0x2a 0x30006 1",
                "l1.qcow2",
            ],
        ),
        // L2[0] = 0x8000000000052a00: an unaligned data cluster.
        (
            "qemu-io",
            &[
                "-f",
                "raw",
                "-c",
                "write -P 0x05 0x40005 1",
                "-c",
                "write -P 0x2a 0x40006 1",
                "l2.qcow2",
            ],
        ),
        // Refcount table entry 0 = 0x22a00: an unaligned refcount block.
        (
            "qemu-io",
            &["-f", "raw", "-c", "write -P 0x2a 0x10006 1", "rb.qcow2"],
        ),
        // Copies of the damaged L1 for qemu-img's commands.
        (
            "qemu-img",
            &["convert", "-f", "raw", "-O", "raw", "l1.qcow2", "l1m.qcow2"],
        ),
        (
            "qemu-img",
            &["convert", "-f", "raw", "-O", "raw", "l1.qcow2", "l1s.qcow2"],
        ),
        (
            "qemu-img",
            &["convert", "-f", "raw", "-O", "raw", "l1.qcow2", "l1r.qcow2"],
        ),
        (
            "qemu-img",
            &["convert", "-f", "raw", "-O", "raw", "l1.qcow2", "l1c.qcow2"],
        ),
    ];
    let steps: Prep = &[
        // qemu-img prints the driver's line, then the command's error with EIO.
        ("qemu-img", &["map", "l1m.qcow2"]),
        ("qemu-img", &["snapshot", "-c", "s1", "l1s.qcow2"]),
        ("qemu-img", &["resize", "--shrink", "l1r.qcow2", "4M"]),
        (
            "qemu-img",
            &["convert", "-O", "raw", "l1c.qcow2", "out.raw"],
        ),
        ("qemu-img", &["compare", "l1c.qcow2", "l1m.qcow2"]),
        // Opens; the read that needs the table fails (non-fatal form when read-only).
        ("qemu-io", &["-r", "-c", "read 0 64k", "l1.qcow2"]),
        ("qemu-io", &["-c", "read 64k 64k", "l1.qcow2"]),
        ("qemu-io", &["-c", "read 0 64k", "l1.qcow2"]),
        ("qemu-io", &["-c", "write 0 64k", "l1.qcow2"]),
        ("qemu-io", &["-c", "read -P 0 1M 64k", "l2.qcow2"]),
        ("qemu-io", &["-c", "read 0 64k", "l2.qcow2"]),
        ("qemu-io", &["-c", "write 0 64k", "l2.qcow2"]),
        ("qemu-img", &["check", "l2.qcow2"]),
        // Reads need no refcount; the allocating write does.
        ("qemu-io", &["-c", "read -P 1 0 64k", "rb.qcow2"]),
        ("qemu-io", &["-c", "write 64k 64k", "rb.qcow2"]),
        ("qemu-io", &["-c", "write 64k 64k", "rb.qcow2"]),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    for event in [
        "Image is corrupt: L2 table offset 0x42a00 unaligned (L1 index: 0)",
        "qemu-img: Could not read file metadata: Input/output error",
        "qemu-img: Could not create snapshot 's1': Input/output error",
        "qemu-img: Failed to discard cropped clusters: Input/output error",
        "qemu-img: error while reading block status at offset 0: Input/output error",
        "qemu-img: Sector allocation test failed for l1c.qcow2",
        "Marking image as corrupt: Cluster allocation offset 0x52a00 unaligned",
        "Marking image as corrupt: Refblock offset 0x22a00 unaligned (reftable index: 0)",
    ] {
        assert!(outs[0].contains(event), "{event}: {}", outs[0]);
    }
}

#[test]
fn qemu_io_help_and_discard_modes_as_qemu_io() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("help-discard");
    let ours = Ours::new(&s);
    let prepare: Prep = &[("qemu-img", &["create", "-f", "qcow2", "d.qcow2", "1M"])];
    let steps: Prep = &[
        (
            "qemu-io",
            &[
                "-c",
                "help",
                "-c",
                "help map",
                "-c",
                "help sleep",
                "d.qcow2",
            ],
        ),
        // Every command's long help, as qemu-io prints it.
        (
            "qemu-io",
            &[
                "-c",
                "help aio_read",
                "-c",
                "help aio_write",
                "-c",
                "help discard",
                "-c",
                "help open",
                "-c",
                "help read",
                "-c",
                "help readv",
                "-c",
                "help reopen",
                "-c",
                "help sigraise",
                "-c",
                "help write",
                "-c",
                "help writev",
                "d.qcow2",
            ],
        ),
        ("qemu-io", &["-h"]),
        // Linux AIO only with O_DIRECT, as QEMU's.
        (
            "qemu-io",
            &["-i", "native", "-c", "read -q 0 512", "d.qcow2"],
        ),
        (
            "qemu-io",
            &[
                "-c",
                "open -i native d.qcow2",
                "-c",
                "open -k -n d.qcow2",
                "-c",
                "read -q 0 512",
            ],
        ),
        // `-i` counts an invalid request and stops there.
        (
            "qemu-io",
            &[
                "-c",
                "aio_read -i 0 512",
                "-c",
                "aio_write -i -P 1 0 x",
                "-c",
                "read -P 0 0 512",
                "d.qcow2",
            ],
        ),
        (
            "qemu-io",
            &[
                "-d",
                "ignore",
                "-c",
                "write -P 1 0 64k",
                "-c",
                "discard 0 64k",
                "-c",
                "read -P 1 0 64k",
                "-c",
                "close",
                "-c",
                "open -d off d.qcow2",
                "-c",
                "discard 0 64k",
                "-c",
                "read -P 1 0 64k",
                "-c",
                "close",
                "-c",
                "open -d unmap d.qcow2",
                "-c",
                "discard 0 64k",
                "-c",
                "read -P 0 0 64k",
                "-c",
                "open -d bogus d.qcow2",
                "d.qcow2",
            ],
        ),
        ("qemu-io", &["-d", "bad", "d.qcow2"]),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
}

#[test]
fn image_files_hold_what_qemus_hold() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("file-layout");
    let ours = Ours::new(&s);
    // `info` prints the file's length and its allocated size ("disk size"); `map` depends on
    // the allocation through QEMU's metadata-preallocation heuristic.
    let steps: Prep = &[
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "a.qcow2", "1M"],
        ),
        ("qemu-img", &["info", "a.qcow2"]),
        (
            "qemu-img",
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-o",
                "cluster_size=2M,preallocation=falloc",
                "y.qcow2",
                "5M",
            ],
        ),
        ("qemu-img", &["map", "--output=json", "y.qcow2"]),
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "e.qcow2", "4M"],
        ),
        (
            "qemu-io",
            &["-c", "write -P 1 0 4k", "-c", "write -c 64k 64k", "e.qcow2"],
        ),
        ("qemu-img", &["map", "--output=json", "e.qcow2"]),
        ("qemu-img", &["info", "e.qcow2"]),
        (
            "qemu-img",
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-o",
                "extended_l2=on,cluster_size=128k",
                "x.qcow2",
                "8M",
            ],
        ),
        (
            "qemu-io",
            &[
                "-c",
                "write -P 0x11 0 64k",
                "-c",
                "write -P 0x22 3 5",
                "-c",
                "write -z 4k 4k",
                "x.qcow2",
            ],
        ),
        ("qemu-img", &["info", "x.qcow2"]),
        ("qemu-img", &["check", "x.qcow2"]),
        // A snapshot writes its L1 copy and table as QEMU does (the table's last entry
        // unpadded), and a grown L1 table (the VM-state area) 512-byte rounded.
        ("qemu-img", &["snapshot", "-c", "s1", "e.qcow2"]),
        ("qemu-io", &["-c", "write -b 0 512", "x.qcow2"]),
        // A compressed cluster goes after the L2 table that maps it.
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "z.qcow2", "1M"],
        ),
        ("qemu-io", &["-c", "write -c -P 3 0 64k", "z.qcow2"]),
        ("qemu-img", &["map", "--output=json", "z.qcow2"]),
        // `commit` empties the top image to its four first clusters (QEMU's
        // make_completely_empty); an image with a snapshot keeps its clusters.
        (
            "qemu-img",
            &[
                "create", "-q", "-f", "qcow2", "-b", "z.qcow2", "-F", "qcow2", "t.qcow2",
            ],
        ),
        (
            "qemu-io",
            &[
                "-c",
                "write -P 4 64k 4k",
                "-c",
                "write -c 128k 64k",
                "t.qcow2",
            ],
        ),
        ("qemu-img", &["commit", "t.qcow2"]),
        ("qemu-img", &["check", "t.qcow2"]),
        ("qemu-io", &["-c", "write -P 5 0 4k", "t.qcow2"]),
        ("qemu-img", &["check", "t.qcow2"]),
        ("qemu-img", &["snapshot", "-c", "s", "t.qcow2"]),
        ("qemu-img", &["commit", "t.qcow2"]),
        ("qemu-img", &["check", "t.qcow2"]),
        // A grown L1 table is written to its last entry; shrinking ends the file after the
        // last cluster in use, even when that lengthens it.
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "r.qcow2", "1G"],
        ),
        ("qemu-img", &["resize", "r.qcow2", "+1G"]),
        ("qemu-img", &["check", "r.qcow2"]),
        ("qemu-img", &["resize", "--shrink", "r.qcow2", "512M"]),
        ("qemu-img", &["check", "r.qcow2"]),
        // Persistent bitmaps move at every read-write close as QEMU moves them: new data
        // clusters, tables and directory, the old ones freed after (data punched, tables and
        // directory kept); a removed bitmap leaves through a directory of its own.
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "b.qcow2", "1M"],
        ),
        ("qemu-io", &["-c", "write -P 1 0 64k", "b.qcow2"]),
        ("qemu-img", &["bitmap", "--add", "b.qcow2", "b0"]),
        ("qemu-io", &["-c", "write -P 2 128k 64k", "b.qcow2"]),
        ("qemu-img", &["check", "b.qcow2"]),
        ("qemu-img", &["bitmap", "--disable", "b.qcow2", "b0"]),
        (
            "qemu-img",
            &["bitmap", "--add", "-g", "128k", "b.qcow2", "b1"],
        ),
        ("qemu-io", &["-c", "write -P 3 256k 64k", "b.qcow2"]),
        ("qemu-img", &["bitmap", "--remove", "b.qcow2", "b0"]),
        ("qemu-img", &["check", "b.qcow2"]),
        ("qemu-img", &["info", "b.qcow2"]),
        // `convert` leaves zero runs of `-S` bytes out and a new subcluster holds what was
        // written (the rest a hole of the file, as QEMU zeroes it).
        (
            "qemu-io",
            &["-c", "write -P 2 3M 4k", "-c", "write -z 1M 1M", "e.qcow2"],
        ),
        (
            "qemu-img",
            &[
                "convert",
                "-O",
                "qcow2",
                "-o",
                "cluster_size=2M,extended_l2=on",
                "e.qcow2",
                "c.qcow2",
            ],
        ),
        ("qemu-img", &["map", "--output=json", "c.qcow2"]),
        ("qemu-img", &["check", "c.qcow2"]),
        // A writer killed leaves its bitmaps in use, as QEMU's does (qimg's own default,
        // crash-consistent bitmaps, is for the library and `qimg` itself).
        ("qemu-img", &["bitmap", "--add", "b.qcow2", "k"]),
        (
            "qemu-io",
            &["-c", "write -P 1 0 64k", "-c", "sigraise 9", "b.qcow2"],
        ),
        ("qemu-img", &["info", "b.qcow2"]),
    ];
    let outs = side_by_side(&s, &ours, &[], &[], steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(outs[0].contains("disk size"), "{}", outs[0]);
    use std::os::unix::fs::MetadataExt;
    for file in [
        "a.qcow2", "y.qcow2", "e.qcow2", "x.qcow2", "z.qcow2", "t.qcow2", "r.qcow2",
    ] {
        let layout = |who: &str| {
            let m = std::fs::metadata(s.path(who).join(file)).unwrap();
            (m.len(), m.blocks())
        };
        let (ours, qemus) = (layout("qimg"), layout("qemu"));
        assert_eq!(
            ours.0, qemus.0,
            "{file}: length of qimg's (left) and QEMU's (right)"
        );
        // The allocated size also counts the file system's own bookkeeping: ext4 spends a
        // 4 KiB block on its extent tree once a file has more than four physical extents,
        // which depends on where the free space was (seen: QEMU's copy 8 sectors larger on a
        // busy machine). Within two such blocks is the same allocation; a cluster written
        // where QEMU leaves a hole is 16 sectors or more. (`SEEK_DATA` is no better judge:
        // on ext4 it reports a preallocated range as data while its pages are cached.)
        assert!(
            ours.1.abs_diff(qemus.1) <= 16,
            "{file}: 512-byte blocks of qimg's {} and QEMU's {}",
            ours.1,
            qemus.1
        );
    }
}

#[test]
fn breakpoints_hold_requests_as_qemu_ios_blkdebug() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("breakpoints");
    let ours = Ours::new(&s);
    let files = [("b.cfg", "")];
    let prepare: Prep = &[(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", "t.qcow2", "1M"],
    )];
    let image = "blkdebug:b.cfg:t.qcow2";
    let steps: Prep = &[
        // A request stops at its breakpoint and goes on when resumed.
        (
            "qemu-io",
            &[
                "-c",
                "break write_aio A",
                "-c",
                "aio_write -P 1 0 4k",
                "-c",
                "wait_break A",
                "-c",
                "resume A",
                "-c",
                "aio_flush",
                "-c",
                "read -P 1 0 4k",
                image,
            ],
        ),
        // Refusals, and a breakpoint removed before any request reaches it.
        (
            "qemu-io",
            &[
                "-c",
                "break nosuch A",
                "-c",
                "resume B",
                "-c",
                "remove_break B",
                "-c",
                "break write_aio A",
                "-c",
                "remove_break A",
                "-c",
                "aio_write -P 2 0 4k",
                "-c",
                "aio_flush",
                image,
            ],
        ),
        // A request held at its allocation (two requests completing together print in an
        // order that varies from run to run for QEMU too: not compared).
        (
            "qemu-io",
            &[
                "-c",
                "break cluster_alloc A",
                "-c",
                "aio_write -P 3 128k 4k",
                "-c",
                "wait_break A",
                "-c",
                "resume A",
                "-c",
                "aio_flush",
                "-c",
                "read -P 3 128k 4k",
                image,
            ],
        ),
        // remove_break resumes the request but reports that no breakpoint was left.
        (
            "qemu-io",
            &[
                "-c",
                "break write_aio A",
                "-c",
                "aio_write -P 5 0 4k",
                "-c",
                "wait_break A",
                "-c",
                "remove_break A",
                "-c",
                "aio_flush",
                "-c",
                "read -P 5 0 4k",
                image,
            ],
        ),
        (
            "qemu-io",
            &[
                "-c",
                "break read_aio A",
                "-c",
                "aio_read -P 5 0 4k",
                "-c",
                "wait_break A",
                "-c",
                "resume A",
                "-c",
                "aio_flush",
                image,
            ],
        ),
        ("qemu-img", &["check", "t.qcow2"]),
    ];
    let outs = side_by_side(&s, &ours, &files, prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert_eq!(
        outs[0].matches("Suspended request 'A'").count(),
        4,
        "{}",
        outs[0]
    );
}

#[test]
fn runtime_option_values_are_checked_as_qemu_checks_them() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("runtime-options");
    let ours = Ours::new(&s);
    let prepare: Prep = &[(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", "t.qcow2", "1M"],
    )];
    let steps: Prep = &[
        (
            "qemu-io",
            &[
                "-c",
                "open -o driver=qcow2,overlap-check=bogus t.qcow2",
                "-c",
                "open -o driver=qcow2,l2-cache-size=1M,cache-size=512k t.qcow2",
                "-c",
                "open -o driver=qcow2,refcount-cache-size=abc t.qcow2",
                "-c",
                "open -o driver=qcow2,l2-cache-size=-1 t.qcow2",
                "-c",
                "open -o driver=qcow2,cache-clean-interval=abc t.qcow2",
                "-c",
                "open -o driver=qcow2,lazy-refcounts=maybe t.qcow2",
                "-c",
                "open -o driver=qcow2,discard-no-unmap=on t.qcow2",
                "-c",
                "open -o driver=qcow2,l2-cache-entry-size=100 t.qcow2",
                "-c",
                "open -o driver=qcow2,cache-size=1M,l2-cache-size=512k,refcount-cache-size=1k \
                 t.qcow2",
                "-c",
                "open -o driver=qcow2,overlap-check.template=all,cache-clean-interval=0x10 \
                 t.qcow2",
                "-c",
                "read -q 0 512",
            ],
        ),
        (
            "qemu-img",
            &[
                "info",
                "--image-opts",
                "driver=qcow2,file.filename=t.qcow2,l2-cache-entry-size=128k",
            ],
        ),
        (
            "qemu-img",
            &[
                "info",
                "--image-opts",
                "driver=qcow2,file.filename=t.qcow2,cache-size=64k,refcount-cache-size=128k",
            ],
        ),
        // `file=NAME` names a block node, which these tools never have.
        (
            "qemu-img",
            &["info", "--image-opts", "driver=qcow2,file=t.qcow2"],
        ),
        (
            "qemu-img",
            &["info", r#"json:{"driver":"qcow2","file":"t.qcow2"}"#],
        ),
        ("qemu-io", &["-c", "open -o driver=qcow2,file=t.qcow2"]),
        // What names the file, and `read-only`, decide before the other options.
        (
            "qemu-io",
            &[
                "-c",
                "open -o driver=qcow2,bogus=1",
                "-c",
                "open -o l2-cache-size=1M",
                "-c",
                "open -o file.driver=file",
                "-c",
                "open -o driver=qcow2,file.filename=nope.qcow2",
                "-c",
                "open -o read-only=on t.qcow2",
                "-c",
                "open -r -o read-only=off t.qcow2",
                "-c",
                "write -q 0 512",
            ],
        ),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(outs[0].contains("may not exceed"), "{}", outs[0]);
    assert!(
        outs[0].contains("Cannot find device='t.qcow2' nor node-name='t.qcow2'"),
        "{}",
        outs[0]
    );
    // A blkdebug node's request limits.
    let node = "driver=qcow2,file.driver=blkdebug,file.image.filename=t.qcow2,file.";
    let limits: Vec<String> = [
        "align=4095",
        "align=3G",
        "align=abc",
        "max-transfer=1000",
        "align=8192,file.max-transfer=4096",
        "align=4096,file.opt-write-zero=1024",
        "opt-write-zero=4096,file.max-write-zero=6144",
        "opt-discard=4096,file.max-discard=6144",
    ]
    .iter()
    .map(|l| format!("{node}{l}"))
    .collect();
    let steps: Vec<(&str, Vec<&str>)> = limits
        .iter()
        .map(|l| {
            (
                "qemu-io",
                vec!["-c", "read -q 0 512", "--image-opts", l.as_str()],
            )
        })
        .collect();
    let steps: Vec<(&str, &[&str])> = steps.iter().map(|(p, a)| (*p, a.as_slice())).collect();
    let outs = side_by_side(&s, &ours, &[], prepare, &steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(
        outs[0].contains("Cannot meet constraints with align 4095"),
        "{}",
        outs[0]
    );
}

#[test]
fn convert_targets_and_missing_files_are_named_as_qemu_names_them() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("convert-targets");
    let ours = Ours::new(&s);
    let prepare: Prep = &[
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "top.qcow2", "1M"],
        ),
        ("qemu-io", &["-c", "write -P 2 64k 64k", "top.qcow2"]),
        ("qemu-img", &["create", "-q", "-f", "raw", "t.raw", "1M"]),
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "t2.qcow2", "1M"],
        ),
    ];
    let json_missing =
        r#"json:{"driver":"qcow2","file":{"driver":"file","filename":"gone.qcow2"}}"#;
    let steps: Prep = &[
        // --target-image-opts: with -n only, the format from the option string.
        (
            "qemu-img",
            &[
                "convert",
                "-n",
                "--target-image-opts",
                "top.qcow2",
                "driver=raw,file.filename=t.raw",
            ],
        ),
        (
            "qemu-img",
            &["compare", "-f", "qcow2", "-F", "raw", "top.qcow2", "t.raw"],
        ),
        (
            "qemu-img",
            &[
                "convert",
                "-n",
                "--target-image-opts",
                "top.qcow2",
                "driver=qcow2,file.filename=t2.qcow2",
            ],
        ),
        ("qemu-img", &["map", "t2.qcow2"]),
        (
            "qemu-img",
            &[
                "convert",
                "--target-image-opts",
                "top.qcow2",
                "driver=qcow2,file.filename=t3.qcow2",
            ],
        ),
        (
            "qemu-img",
            &[
                "convert",
                "-n",
                "-O",
                "qcow2",
                "--target-image-opts",
                "top.qcow2",
                "driver=qcow2,file.filename=t2.qcow2",
            ],
        ),
        // The output is the source: its lock is held.
        (
            "qemu-img",
            &["convert", "-O", "qcow2", "top.qcow2", "top.qcow2"],
        ),
        (
            "qemu-img",
            &["convert", "-n", "-O", "raw", "top.qcow2", "top.qcow2"],
        ),
        // rebase -p steps as qemu-img's (a step per unallocated run of at most 2 MiB, 100
        // again at the end; -u: 0 and 100), and a missing -F is refused before a raw image.
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "big.qcow2", "9M"],
        ),
        ("qemu-io", &["-c", "write 3M 1M", "big.qcow2"]),
        (
            "qemu-img",
            &[
                "rebase",
                "-p",
                "-b",
                "top.qcow2",
                "-F",
                "qcow2",
                "big.qcow2",
            ],
        ),
        (
            "qemu-img",
            &[
                "rebase",
                "-u",
                "-p",
                "-b",
                "t2.qcow2",
                "-F",
                "qcow2",
                "big.qcow2",
            ],
        ),
        (
            "qemu-img",
            &["rebase", "-f", "raw", "-b", "top.qcow2", "t.raw"],
        ),
        (
            "qemu-img",
            &[
                "rebase",
                "-f",
                "raw",
                "-b",
                "top.qcow2",
                "-F",
                "qcow2",
                "t.raw",
            ],
        ),
        // commit's rate limit is checked as qemu-img checks it.
        (
            "qemu-img",
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-b",
                "top.qcow2",
                "-F",
                "qcow2",
                "o.qcow2",
            ],
        ),
        ("qemu-img", &["commit", "-r", "abc", "o.qcow2"]),
        ("qemu-img", &["commit", "-r", "-5", "o.qcow2"]),
        ("qemu-img", &["commit", "-r", "1M", "o.qcow2"]),
        // measure -l measures a snapshot, as convert -l copies it.
        ("qemu-img", &["snapshot", "-c", "s1", "top.qcow2"]),
        ("qemu-io", &["-c", "write -P 3 512k 512k", "top.qcow2"]),
        ("qemu-img", &["measure", "-O", "qcow2", "top.qcow2"]),
        (
            "qemu-img",
            &["measure", "-l", "s1", "-O", "qcow2", "top.qcow2"],
        ),
        (
            "qemu-img",
            &["measure", "-l", "snapshot.id=1", "-O", "raw", "top.qcow2"],
        ),
        (
            "qemu-img",
            &["measure", "-l", "nosuch", "-O", "qcow2", "top.qcow2"],
        ),
        // Files that are not there, named as typed.
        (
            "qemu-img",
            &["convert", "-n", "-O", "qcow2", "top.qcow2", "gone.qcow2"],
        ),
        (
            "qemu-img",
            &["convert", "-f", "raw", "-O", "qcow2", "gone", "x.qcow2"],
        ),
        ("qemu-img", &["map", "-f", "qcow2", "gone"]),
        ("qemu-img", &["info", json_missing]),
        (
            "qemu-img",
            &[
                "info",
                "--image-opts",
                "driver=qcow2,file.filename=gone.qcow2",
            ],
        ),
        ("qemu-io", &["-c", "read 0 512", json_missing]),
        (
            "qemu-io",
            &[
                "-c",
                "read 0 512",
                "--image-opts",
                "driver=qcow2,file.filename=gone.qcow2",
            ],
        ),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(outs[0].contains("Images are identical"), "{}", outs[0]);
}

/// qemu-io's `truncate -m MODE` grows with preallocation (it was refused before): with
/// `full` the new area is written (`qemu-img map` shows QEMU's data extents), with `falloc`
/// and `metadata` it is allocated too (qimg writes it, where QEMU leaves holes: the map's
/// `zero` flags differ, so only the length and the data are compared there); a bad mode is
/// refused in QEMU's words.
#[test]
fn qemu_io_truncate_preallocates_as_qemu_io() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("truncate-prealloc");
    let ours = Ours::new(&s);
    let prepare: Prep = &[
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "t.qcow2", "512k"],
        ),
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "u.qcow2", "512k"],
        ),
        ("qemu-io", &["-c", "write -P 7 0 4k", "t.qcow2"]),
        ("qemu-io", &["-c", "write -P 7 0 4k", "u.qcow2"]),
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "m.qcow2", "1M"],
        ),
        ("qemu-io", &["-c", "write -P 7 0 64k", "m.qcow2"]),
        (
            "qemu-img",
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-o",
                "extended_l2=on",
                "e.qcow2",
                "1M",
            ],
        ),
        ("qemu-io", &["-c", "write -P 7 0 4k", "e.qcow2"]),
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "s.qcow2", "4M"],
        ),
        ("qemu-img", &["create", "-q", "-f", "raw", "r.raw", "1M"]),
    ];
    let steps: Prep = &[
        // A raw file grows with the mode (falloc, full) and never shrinks with one;
        // `metadata` is no mode of a file.
        (
            "qemu-io",
            &[
                "-f",
                "raw",
                "-c",
                "truncate -m falloc 3M",
                "-c",
                "truncate -m full 5M",
                "-c",
                "truncate -m full 5M",
                "-c",
                "truncate -m metadata 8M",
                "-c",
                "truncate -m full 1000000",
                "-c",
                "truncate -m falloc 4M",
                "-c",
                "length",
                "-c",
                "read -P 0 0 5M",
                "r.raw",
            ],
        ),
        // qcow2 refuses to shrink with a mode, and nothing changes.
        (
            "qemu-io",
            &["-c", "truncate -m falloc 1M", "-c", "length", "s.qcow2"],
        ),
        (
            "qemu-io",
            &["-c", "truncate -m full 1M", "-c", "length", "t.qcow2"],
        ),
        (
            "qemu-io",
            &["-c", "truncate -m bogus 4M", "-c", "length", "t.qcow2"],
        ),
        (
            "qemu-io",
            &[
                "-c",
                "read -P 7 0 4k",
                "-c",
                "read -P 0 4k 1020k",
                "t.qcow2",
            ],
        ),
        // The new area is data (the ranges only: host offsets may differ).
        ("qemu-img", &["map", "--output=json", "t.qcow2"]),
        (
            "qemu-io",
            &["-c", "truncate -m falloc 2M", "-c", "length", "u.qcow2"],
        ),
        (
            "qemu-io",
            &["-c", "truncate -m metadata 3M", "-c", "length", "u.qcow2"],
        ),
        (
            "qemu-io",
            &[
                "-c",
                "read -P 7 0 4k",
                "-c",
                "read -P 0 4k 3068k",
                "u.qcow2",
            ],
        ),
        // Metadata preallocation links host clusters and writes nothing: the new area is
        // data that reads as zeros (holes in the file), at QEMU's offsets.
        ("qemu-io", &["-c", "truncate -m metadata 3M", "m.qcow2"]),
        ("qemu-img", &["map", "--output=json", "m.qcow2"]),
        ("qemu-img", &["check", "m.qcow2"]),
        (
            "qemu-io",
            &["-c", "write -P 9 2M 4k", "-c", "read -P 0 1M 1M", "m.qcow2"],
        ),
        ("qemu-img", &["map", "--output=json", "m.qcow2"]),
        // Extended entries take the host cluster and keep their subclusters unallocated.
        (
            "qemu-img",
            &["resize", "--preallocation=metadata", "e.qcow2", "3M"],
        ),
        ("qemu-img", &["map", "--output=json", "e.qcow2"]),
        ("qemu-img", &["check", "e.qcow2"]),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    // The metadata steps compare whole: offsets, zero flags and the file's end.
    let metadata =
        |out: &str| out[out.find("truncate -m metadata 3M\", \"m.qcow2").unwrap()..].to_string();
    assert_eq!(
        metadata(&outs[1]),
        metadata(&outs[0]),
        "qimg (left) differs from QEMU (right)"
    );
    let strip = |out: &str| {
        out.lines()
            .map(|l| match l.find(", \"offset\"") {
                Some(i) => format!("{}}}", &l[..i]),
                None => l.to_string(),
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(
        strip(&outs[1]),
        strip(&outs[0]),
        "qimg (left) differs from QEMU (right)"
    );
    for refusal in [
        "qemu-io: Invalid preallocation mode 'bogus'",
        "qemu-io: Cannot use preallocation for shrinking files",
        "qemu-io: Unsupported preallocation mode: metadata",
        "qemu-io: Preallocation can't be used for shrinking an image",
    ] {
        assert!(outs[0].contains(refusal), "{refusal}: {}", outs[0]);
    }
}

#[test]
fn a_file_of_the_bare_magic_is_raw_and_raw_files_resize_to_the_byte() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("bare-magic");
    let ours = Ours::new(&s);
    // "QFI\xfb" and nothing else: QEMU's probe wants a version (2 or more) after the magic.
    let files = [("short.img", "QFIx"), ("odd.raw", "")];
    let prepare: Prep = &[
        (
            "qemu-io",
            &["-f", "raw", "-c", "write -P 0xfb 3 1", "short.img"],
        ),
        ("qemu-img", &["resize", "-f", "raw", "odd.raw", "1000"]),
    ];
    let steps: Prep = &[
        ("qemu-img", &["info", "short.img"]),
        ("qemu-io", &["-c", "read -v 0 4", "short.img"]),
        ("qemu-img", &["check", "short.img"]),
        ("qemu-img", &["info", "odd.raw"]),
        ("qemu-img", &["resize", "-f", "raw", "odd.raw", "2000"]),
        ("qemu-img", &["info", "-f", "raw", "odd.raw"]),
        (
            "qemu-img",
            &["resize", "-f", "raw", "--shrink", "odd.raw", "100"],
        ),
        ("qemu-img", &["resize", "-f", "raw", "odd.raw", "50"]),
        ("qemu-img", &["resize", "-f", "raw", "odd.raw", "+3"]),
        ("qemu-img", &["info", "-f", "raw", "odd.raw"]),
    ];
    let outs = side_by_side(&s, &ours, &files, prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(outs[0].contains("file format: raw"), "{}", outs[0]);
    assert!(outs[0].contains("Image resized."), "{}", outs[0]);
}

#[test]
fn a_missing_data_file_is_named_as_qemu_names_it() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("missing-data-file");
    let ours = Ours::new(&s);
    let prepare: Prep = &[
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "data_file=d.raw,data_file_raw=on",
                "a.qcow2",
                "4M",
            ],
        ),
        ("qemu-io", &["-c", "write -P 1 0 64k", "a.qcow2"]),
        ("qemu-img", &["amend", "-o", "data_file=e.raw", "a.qcow2"]),
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "data_file=f.raw",
                "c.qcow2",
                "4M",
            ],
        ),
        ("qemu-img", &["amend", "-o", "data_file=g.raw", "c.qcow2"]),
    ];
    let steps: Prep = &[
        ("qemu-img", &["info", "a.qcow2"]),
        ("qemu-img", &["check", "a.qcow2"]),
        ("qemu-io", &["-c", "read 0 512", "a.qcow2"]),
        ("qemu-img", &["check", "c.qcow2"]),
        ("qemu-img", &["check", "-r", "all", "c.qcow2"]),
        ("qemu-img", &["convert", "-O", "raw", "a.qcow2", "o.raw"]),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(
        outs[0].contains("Could not open 'e.raw': No such file"),
        "{}",
        outs[0]
    );
}

#[test]
fn growth_with_falloc_and_full_preallocation_lays_out_the_file_as_qemu() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("prealloc-growth");
    let ours = Ours::new(&s);
    let prepare: Prep = &[
        ("qemu-img", &["create", "-f", "qcow2", "b.qcow2", "2M"]),
        ("qemu-io", &["-c", "write -P 9 0 2M", "b.qcow2"]),
        // 512-byte clusters: several L2 tables and refcount blocks.
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "cluster_size=512",
                "s.qcow2",
                "1M",
            ],
        ),
        ("qemu-io", &["-c", "write -P 1 0 100k", "s.qcow2"]),
        // Extended entries over a longer backing file, an old end inside a cluster, and a
        // snapshot sharing the L2 table.
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "extended_l2=on",
                "-b",
                "b.qcow2",
                "-F",
                "qcow2",
                "e.qcow2",
                "1000k",
            ],
        ),
        (
            "qemu-io",
            &[
                "-c",
                "write -P 1 0 100k",
                "-c",
                "write -P 2 900k 90k",
                "e.qcow2",
            ],
        ),
        ("qemu-img", &["snapshot", "-c", "s", "e.qcow2"]),
        // A file longer than its clusters in use (a hole past them).
        ("qemu-img", &["create", "-f", "qcow2", "h.qcow2", "1M"]),
        ("qemu-img", &["resize", "--shrink", "h.qcow2", "512k"]),
        ("qemu-img", &["resize", "-f", "raw", "h.qcow2", "2M"]),
    ];
    let steps: Prep = &[
        (
            "qemu-img",
            &["resize", "--preallocation=falloc", "s.qcow2", "+3M"],
        ),
        ("qemu-img", &["map", "--output=json", "s.qcow2"]),
        ("qemu-img", &["check", "s.qcow2"]),
        (
            "qemu-io",
            &[
                "-c",
                "truncate -m full 40M",
                "-c",
                "read -P 0 1M 39M",
                "s.qcow2",
            ],
        ),
        ("qemu-img", &["check", "s.qcow2"]),
        (
            "qemu-img",
            &["resize", "--preallocation=falloc", "e.qcow2", "+1100k"],
        ),
        ("qemu-img", &["map", "--output=json", "e.qcow2"]),
        ("qemu-img", &["check", "e.qcow2"]),
        (
            "qemu-io",
            &[
                "-c",
                "read -P 1 0 100k",
                "-c",
                "read -P 9 100k 800k",
                "-c",
                "read -P 2 900k 90k",
                "-c",
                "read -P 9 990k 10k",
                "-c",
                "read -P 0 1000k 1100k",
                "e.qcow2",
            ],
        ),
        ("qemu-io", &["-c", "truncate -m falloc 3333k", "e.qcow2"]),
        ("qemu-img", &["map", "--output=json", "e.qcow2"]),
        (
            "qemu-img",
            &["resize", "--preallocation=full", "h.qcow2", "4M"],
        ),
        ("qemu-img", &["info", "h.qcow2"]),
        ("qemu-img", &["map", "h.qcow2"]),
        ("qemu-img", &["check", "h.qcow2"]),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(outs[0].contains("Image end offset: 4063232"), "{}", outs[0]);
}

#[test]
fn shrinking_keeps_the_l2_table_of_the_new_end_as_qemu() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("shrink-boundary-table");
    let ours = Ours::new(&s);
    let prepare: Prep = &[
        ("qemu-img", &["create", "-f", "qcow2", "t.qcow2", "1M"]),
        ("qemu-img", &["create", "-f", "qcow2", "u.qcow2", "4M"]),
        ("qemu-io", &["-c", "write -P 1 0 64k", "u.qcow2"]),
        ("qemu-img", &["snapshot", "-c", "s", "u.qcow2"]),
    ];
    let steps: Prep = &[
        // No L2 table yet: QEMU's discard of the cut range makes an empty one.
        ("qemu-img", &["resize", "--shrink", "t.qcow2", "512k"]),
        ("qemu-img", &["check", "t.qcow2"]),
        ("qemu-img", &["info", "t.qcow2"]),
        // A table a snapshot shares: copied.
        ("qemu-img", &["resize", "--shrink", "u.qcow2", "1M"]),
        ("qemu-img", &["check", "u.qcow2"]),
        ("qemu-img", &["map", "--output=json", "u.qcow2"]),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(outs[0].contains("Image end offset: 327680"), "{}", outs[0]);
}

#[test]
fn resizing_a_v2_image_with_snapshots_and_snapshots_of_1_bit_refcounts_are_refused_as_qemu() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("v2-snapshot-resize");
    let ours = Ours::new(&s);
    let prepare: Prep = &[
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "compat=0.10",
                "v2.qcow2",
                "1M",
            ],
        ),
        ("qemu-io", &["-c", "write -P 1 0 64k", "v2.qcow2"]),
        ("qemu-img", &["snapshot", "-c", "s", "v2.qcow2"]),
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "refcount_bits=1",
                "r1.qcow2",
                "1M",
            ],
        ),
        ("qemu-io", &["-c", "write -P 1 0 64k", "r1.qcow2"]),
    ];
    let steps: Prep = &[
        (
            "qemu-io",
            &[
                "-c",
                "truncate 2M",
                "-c",
                "truncate -m falloc 3M",
                "v2.qcow2",
            ],
        ),
        ("qemu-img", &["resize", "v2.qcow2", "2M"]),
        ("qemu-img", &["resize", "--shrink", "v2.qcow2", "512k"]),
        // (Not `info`: it shows the snapshot's date, which differs by a second at times.)
        ("qemu-io", &["-c", "length", "v2.qcow2"]),
        ("qemu-img", &["snapshot", "-c", "s", "r1.qcow2"]),
        ("qemu-img", &["snapshot", "-l", "r1.qcow2"]),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(
        outs[0].contains("qemu-io: Can't resize a v2 image which has snapshots"),
        "{}",
        outs[0]
    );
}

/// QEMU's discard and zeroing make the L2 table of what they cover writable before looking at
/// the entries: a discard over a fresh image allocates its tables (`Image end offset` grows),
/// a discard where a snapshot shares the table copies it, and a version 2 image zeroes by
/// discarding (and discards nothing over a backing file). Ours leaves the same files.
#[test]
fn discard_and_zeroing_leave_qemus_l2_tables() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("discard-tables");
    let ours = Ours::new(&s);
    let prepare: Prep = &[
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "compat=1.1",
                "v3.qcow2",
                "4M",
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
                "x.qcow2",
                "4M",
            ],
        ),
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "compat=0.10",
                "v2.qcow2",
                "4M",
            ],
        ),
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "compat=0.10",
                "-b",
                "v2.qcow2",
                "-F",
                "qcow2",
                "v2top.qcow2",
            ],
        ),
        ("qemu-io", &["-c", "write -P 5 0 128k", "v2.qcow2"]),
        ("qemu-io", &["-c", "write -P 6 0 64k", "v2top.qcow2"]),
    ];
    let steps: Prep = &[
        ("qemu-io", &["-c", "discard 0 1M", "v3.qcow2"]),
        ("qemu-img", &["check", "v3.qcow2"]),
        ("qemu-io", &["-c", "discard 1M 64k", "-c", "map", "x.qcow2"]),
        ("qemu-img", &["check", "x.qcow2"]),
        ("qemu-img", &["snapshot", "-c", "s", "v3.qcow2"]),
        ("qemu-io", &["-c", "discard 0 64k", "v3.qcow2"]),
        ("qemu-img", &["check", "v3.qcow2"]),
        (
            "qemu-io",
            &["-c", "write -z 2M 64k", "-c", "map", "v2.qcow2"],
        ),
        ("qemu-img", &["check", "v2.qcow2"]),
        (
            "qemu-io",
            &[
                "-c",
                "discard 0 64k",
                "-c",
                "read -P 6 0 64k",
                "v2top.qcow2",
            ],
        ),
        ("qemu-img", &["map", "--output=json", "v2top.qcow2"]),
        ("qemu-img", &["check", "v2top.qcow2"]),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
}

/// Opening an image reads its header cluster, not the first 2 MiB of the file: a small
/// image's data stays out of the page cache, where it would make the unwritten extents QEMU
/// leaves in its clusters read as data to `SEEK_DATA`, so QEMU's own `map` of the file after
/// our `info`, `check` or `map` answers as after QEMU's (it found data everywhere before).
#[test]
fn opening_an_image_leaves_its_data_out_of_the_page_cache() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("open-reads");
    let ours = Ours::new(&s);
    // QEMU's tool in both runs (a path, which `side_by_side` does not replace with ours).
    let path = std::env::var_os("PATH").unwrap_or_default();
    let qemu = std::env::split_paths(&path)
        .map(|d| d.join("qemu-img"))
        .find(|f| f.is_file())
        .expect("qemu-img on PATH");
    let qemu = qemu.to_str().unwrap();
    let prepare: Prep = &[
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "a.qcow2", "16M"],
        ),
        (
            "qemu-img",
            &[
                "bench", "-w", "-c", "100", "-s", "8k", "-S", "16k", "-o", "4k", "a.qcow2",
            ],
        ),
    ];
    let steps: Prep = &[
        ("qemu-img", &["info", "a.qcow2"]),
        ("qemu-img", &["check", "a.qcow2"]),
        (qemu, &["map", "-f", "raw", "a.qcow2"]),
        // A write bench run as qemu-img leaves the file as QEMU's does.
        (
            "qemu-img",
            &[
                "bench", "-w", "-c", "50", "-s", "8k", "-S", "16k", "-o", "2M", "a.qcow2",
            ],
        ),
        (qemu, &["map", "-f", "raw", "a.qcow2"]),
        ("qemu-img", &["check", "a.qcow2"]),
    ];
    let timing = |out: &String| -> String {
        out.lines()
            .map(|l| {
                if l.starts_with("Run completed in") {
                    "TIMING"
                } else {
                    l
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    let outs: Vec<String> = side_by_side(&s, &ours, &[], prepare, steps)
        .iter()
        .map(timing)
        .collect();
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
}

/// `commit -p` prints qemu-img's progress skeleton: its line starts before anything is
/// opened (so a refused commit prints `(0.00/100%)` and the newline too) and ends with
/// `(100.00/100%)` when the job completes; the lines between depend on QEMU's job timing and
/// are not compared.
#[test]
fn commit_progress_starts_and_ends_as_qemu_imgs() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("commit-progress");
    let ours = Ours::new(&s);
    ok(
        "b",
        &qemu_img(&s.0, &["create", "-q", "-f", "qcow2", "b.qcow2", "64M"]),
    );
    ok(
        "t",
        &qemu_img(
            &s.0,
            &[
                "create", "-q", "-f", "qcow2", "-b", "b.qcow2", "-F", "qcow2", "t.qcow2",
            ],
        ),
    );
    ok(
        "w",
        &qemu_io_run(&s.0, &["-c", "write -P 1 0 3M", "t.qcow2"]),
    );
    // Refused: the same output, progress included.
    let (q, o) = both(
        &s,
        &ours,
        "qemu-img",
        &["b.qcow2"],
        &["commit", "-p", "b.qcow2"],
    );
    assert_eq!(o, q, "commit -p without a backing file");
    // Done: the first and the last progress lines, and what follows them.
    let (q, o) = both(
        &s,
        &ours,
        "qemu-img",
        &["b.qcow2", "t.qcow2"],
        &["commit", "-p", "t.qcow2"],
    );
    let skeleton = |out: &str| {
        let lines: Vec<String> = out
            .split(['\r', '\n'])
            .map(|l| l.trim().to_string())
            .filter(|l| !l.is_empty())
            .collect();
        (
            lines.first().cloned(),
            lines.iter().rev().nth(1).cloned(),
            lines.last().cloned(),
        )
    };
    assert_eq!(skeleton(&o.0), skeleton(&q.0), "{o:?} {q:?}");
    assert_eq!(
        skeleton(&q.0),
        (
            Some("(0.00/100%)".into()),
            Some("(100.00/100%)".into()),
            Some("Image committed.".into()),
        )
    );
    assert_eq!((&o.1, &o.2), (&q.1, &q.2));
}

/// Error injection as QEMU's blkdebug, image state included: a failed write of a new L2
/// table (`l2_update`, which QEMU's cache flush announces) gives the table's cluster back and
/// maps nothing; a failed write still counts as a change, so the flush at close meets the
/// active rule and fails as QEMU's (its two messages); refusals of a config in QEMU's words.
#[test]
fn blkdebug_failures_leave_the_image_as_qemus() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("blkdebug-state");
    let ours = Ours::new(&s);
    let files = [
        (
            "l2.cfg",
            "[inject-error]\nevent = \"l2_update\"\nerrno = \"5\"\nonce = \"on\"\n",
        ),
        (
            "st.cfg",
            "[set-state]\nstate = \"1\"\nevent = \"write_aio\"\nnew_state = \"2\"\n\
             [inject-error]\nstate = \"2\"\nevent = \"write_aio\"\nerrno = \"5\"\n",
        ),
        ("bad.cfg", "[inject-error]\nevent = \"bogus\"\n"),
    ];
    let prepare: Prep = &[
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "a.qcow2", "1M"],
        ),
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "b.qcow2", "1M"],
        ),
    ];
    let steps: Prep = &[
        (
            "qemu-io",
            &["-c", "write -P 1 0 64k", "blkdebug:l2.cfg:a.qcow2"],
        ),
        ("qemu-img", &["check", "a.qcow2"]),
        ("qemu-img", &["map", "a.qcow2"]),
        (
            "qemu-io",
            &[
                "-c",
                "write -P 1 0 64k",
                "-c",
                "read -P 1 0 64k",
                "blkdebug:l2.cfg:a.qcow2",
            ],
        ),
        (
            "qemu-io",
            &[
                "-c",
                "write 0 512",
                "-c",
                "write 512 512",
                "-c",
                "write 1024 512",
                "blkdebug:st.cfg:b.qcow2",
            ],
        ),
        ("qemu-img", &["check", "b.qcow2"]),
        ("qemu-io", &["-c", "read 0 512", "blkdebug:bad.cfg:a.qcow2"]),
        (
            "qemu-io",
            &["-c", "read 0 512", "blkdebug:nope.cfg:a.qcow2"],
        ),
        ("qemu-io", &["-c", "read 0 512", "blkdebug:a.qcow2"]),
    ];
    let outs = side_by_side(&s, &ours, &files, prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(
        outs[0].contains("Failed to flush the L2 table cache"),
        "{}",
        outs[0]
    );
}

/// `create` with qcow2's encryption options: the `Formatting` line shows them in qemu-img's
/// order, then QEMU's refusal (no format, no secret, an unknown secret, an unknown format);
/// `encryption=off` makes a plain image; raw refuses the option outright.
#[test]
fn create_refuses_encryption_options_in_qemu_imgs_words() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("create-encrypt");
    let ours = Ours::new(&s);
    let steps: Prep = &[
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "encrypt.format=luks",
                "a.qcow2",
                "1M",
            ],
        ),
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "encrypt.key-secret=s",
                "b.qcow2",
                "1M",
            ],
        ),
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "--object",
                "secret,id=s0,data=x",
                "-o",
                "encrypt.key-secret=nosuch,encrypt.format=luks,encrypt.cipher-alg=aes-256",
                "c.qcow2",
                "1M",
            ],
        ),
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "encryption=on",
                "d.qcow2",
                "1M",
            ],
        ),
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "encrypt.format=foo",
                "e.qcow2",
                "1M",
            ],
        ),
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "encryption=off,cluster_size=4k",
                "f.qcow2",
                "1M",
            ],
        ),
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "raw",
                "-o",
                "encrypt.format=luks",
                "g.raw",
                "1M",
            ],
        ),
    ];
    let outs = side_by_side(&s, &ours, &[], &[], steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(
        outs[0].contains("No secret with id 'nosuch'"),
        "{}",
        outs[0]
    );
    for who in ["qemu", "qimg"] {
        let made: Vec<bool> = ["a.qcow2", "c.qcow2", "f.qcow2", "g.raw"]
            .iter()
            .map(|f| s.path(who).join(f).exists())
            .collect();
        assert_eq!(made, [false, false, true, false], "{who}: files left");
    }
}

/// QEMU's null device (`null-co://`, `json:{"driver":"null-co",...}`, `--image-opts
/// driver=null-co,...`): qemu-io reads that leave the buffer (or zeros with `read-zeroes`),
/// writes that keep nothing, its allocation, `info` (twice the format name, as qemu-io
/// prints it), no resize; qemu-img's `info` (a node of its own, or raw over the protocol,
/// named as QEMU renders the options), `map`, `convert`, `compare`, `measure`; names QEMU
/// refuses.
#[test]
fn the_null_device_behaves_as_qemus_null_co() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("null-co");
    let ours = Ours::new(&s);
    let zeroes = r#"json:{"driver":"null-co","size":4096,"read-zeroes":true}"#;
    let mib = r#"json:{"driver":"null-co","size":1048576,"read-zeroes":true}"#;
    let raw_over = r#"json:{"driver":"raw","file":{"driver":"null-co","size":4096}}"#;
    let steps: Prep = &[
        ("qemu-io", &["-c", "read -P 0xab 0 512", "null-co://"]),
        (
            "qemu-io",
            &[
                "-f",
                "raw",
                "-c",
                "read -v 0 16",
                "-c",
                "write -P 1 0 512",
                "-c",
                "length",
                "-c",
                "info",
                "-c",
                "map",
                "-c",
                "alloc 0 4k",
                "null-co://",
            ],
        ),
        (
            "qemu-io",
            &["-c", "read -P 0 0 512", "-c", "info", "-c", "map", zeroes],
        ),
        (
            "qemu-io",
            &["-c", "read 0 512", "null-co://?read-zeroes=on"],
        ),
        (
            "qemu-io",
            &[
                "--image-opts",
                "-c",
                "read -P 0 0 4k",
                "-c",
                "length",
                "driver=null-co,read-zeroes=on,size=8k",
            ],
        ),
        ("qemu-io", &["-c", "truncate 1M", "null-co://"]),
        ("qemu-img", &["info", "null-co://"]),
        ("qemu-img", &["info", "--output=json", zeroes]),
        (
            "qemu-img",
            &["info", "--image-opts", "driver=null-co,read-zeroes=on"],
        ),
        ("qemu-img", &["info", raw_over]),
        ("qemu-img", &["info", "-f", "null-co", "null-co://"]),
        ("qemu-img", &["info", "-f", "null-co", "x.qcow2"]),
        ("qemu-img", &["map", "--output=json", zeroes]),
        ("qemu-img", &["convert", "-O", "qcow2", mib, "n.qcow2"]),
        ("qemu-img", &["map", "n.qcow2"]),
        ("qemu-img", &["compare", mib, "n.qcow2"]),
        ("qemu-img", &["measure", "-O", "qcow2", mib]),
        (
            "qemu-img",
            &[
                "info",
                r#"json:{"driver":"null-co","filename":"null-co://x"}"#,
            ],
        ),
        (
            "qemu-img",
            &["info", r#"json:{"driver":"null-co","size":"1M"}"#],
        ),
    ];
    let outs = side_by_side(&s, &ours, &[], &[], steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(
        outs[0].contains("format name: null-co\nformat name: null-co"),
        "{}",
        outs[0]
    );
}

#[test]
fn metadata_preallocation_takes_one_contiguous_run_as_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("prealloc-run");
    let ours = Ours::new(&s);
    // Growing with falloc and full leaves a free cluster before the end of the file; QEMU's
    // metadata preallocation allocates each L2 table's run in one piece past that hole.
    let prepare: Prep = &[
        ("qemu-img", &["create", "-f", "qcow2", "t.qcow2", "10M"]),
        (
            "qemu-img",
            &["resize", "--preallocation=falloc", "t.qcow2", "12M"],
        ),
        (
            "qemu-img",
            &["resize", "--preallocation=full", "t.qcow2", "13M"],
        ),
    ];
    let steps: Prep = &[
        (
            "qemu-img",
            &["resize", "--preallocation=metadata", "t.qcow2", "14M"],
        ),
        ("qemu-img", &["map", "--output=json", "t.qcow2"]),
        ("qemu-io", &["-c", "truncate -m metadata 15M", "t.qcow2"]),
        ("qemu-img", &["map", "--output=json", "t.qcow2"]),
        ("qemu-img", &["check", "t.qcow2"]),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(
        outs[0].contains("\"start\": 13631488, \"length\": 1048576"),
        "{}",
        outs[0]
    );
}

#[test]
fn the_file_driver_as_the_image_and_plain_names_under_image_opts_as_qemus() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("file-driver");
    let ours = Ours::new(&s);
    let prepare: Prep = &[("qemu-img", &["create", "-f", "qcow2", "t.qcow2", "1M"])];
    let steps: Prep = &[
        // A plain name where an option string is wanted: qemu-img reads it as `file=NAME`,
        // qemu-io as the short-form boolean `NAME=on`.
        ("qemu-img", &["info", "--image-opts", "t.qcow2"]),
        ("qemu-img", &["map", "--image-opts", "t.qcow2"]),
        ("qemu-io", &["--image-opts", "t.qcow2", "-c", "read 0 512"]),
        (
            "qemu-io",
            &["--image-opts", "t.qcow2,driver=qcow2", "-c", "read 0 512"],
        ),
        // QEMU's file driver named as the image: the file's own bytes, format `file`.
        (
            "qemu-io",
            &[
                "--image-opts",
                "driver=file,filename=t.qcow2",
                "-c",
                "read -v 0 16",
                "-c",
                "length",
                "-c",
                "info",
            ],
        ),
        (
            "qemu-img",
            &["info", "--image-opts", "driver=file,filename=t.qcow2"],
        ),
        (
            "qemu-img",
            &[
                "info",
                "--output=json",
                "json:{\"driver\":\"file\",\"filename\":\"t.qcow2\"}",
            ],
        ),
        ("qemu-img", &["info", "-f", "file", "t.qcow2"]),
        ("qemu-img", &["create", "-f", "file", "c.img", "1M"]),
        ("qemu-img", &["info", "c.img"]),
        // Under --image-opts a `json:` name is an option string too.
        (
            "qemu-img",
            &[
                "compare",
                "--image-opts",
                "driver=qcow2,file.filename=t.qcow2",
                "json:{\"driver\":\"qcow2\",\"file\":{\"driver\":\"file\",\"filename\":\"t.qcow2\"}}",
            ],
        ),
        // A new data file that does not exist: the header changes, the reopen fails.
        (
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "data_file=d.raw",
                "e.qcow2",
                "1M",
            ],
        ),
        ("qemu-img", &["amend", "-o", "data_file=d2.raw", "e.qcow2"]),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    let masked = without_lines(&outs, &["ops/sec", "disk size", "actual-size"]);
    assert_eq!(
        masked[1], masked[0],
        "qimg (left) differs from QEMU (right)"
    );
    assert!(masked[0].contains("file format: file"), "{}", masked[0]);
    assert!(masked[0].contains("short-form boolean"), "{}", masked[0]);
}

#[test]
fn raw_offset_and_size_make_a_window_as_qemus_raw_driver() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("raw-window");
    let ours = Ours::new(&s);
    let prepare: Prep = &[
        ("qemu-img", &["create", "-f", "raw", "r.raw", "1M"]),
        (
            "qemu-io",
            &[
                "-f",
                "raw",
                "-c",
                "write -P 1 0 64k",
                "-c",
                "write -P 2 512k 64k",
                "r.raw",
            ],
        ),
    ];
    const W: &str = "driver=raw,offset=32k,size=512k,file.filename=r.raw";
    let steps: Prep = &[
        (
            "qemu-io",
            &[
                "--image-opts",
                W,
                "-c",
                "length",
                "-c",
                "map",
                "-c",
                "read -P 1 0 32k",
                "-c",
                "read -P 2 480k 32k",
                "-c",
                "write -P 3 4k 4k",
                "-c",
                "read 500k 20k",
                "-c",
                "truncate 1M",
            ],
        ),
        ("qemu-io", &["-f", "raw", "-c", "read -P 3 36k 4k", "r.raw"]),
        ("qemu-img", &["info", "--image-opts", W]),
        ("qemu-img", &["map", "--output=json", "--image-opts", W]),
        (
            "qemu-img",
            &["convert", "--image-opts", W, "-O", "qcow2", "c.qcow2"],
        ),
        ("qemu-img", &["info", "c.qcow2"]),
        (
            "qemu-io",
            &[
                "--image-opts",
                "driver=raw,offset=32k,file.filename=r.raw",
                "-c",
                "truncate 128k",
                "-c",
                "length",
            ],
        ),
        ("qemu-img", &["info", "-f", "raw", "r.raw"]),
        // Refusals, in QEMU's words and order.
        ("qemu-io", &["--image-opts", W, "-c", "length"]),
        (
            "qemu-io",
            &[
                "--image-opts",
                "driver=raw,size=1000,file.filename=r.raw",
                "-c",
                "length",
            ],
        ),
        (
            "qemu-io",
            &[
                "--image-opts",
                "driver=raw,offset=-1,file.filename=r.raw",
                "-c",
                "length",
            ],
        ),
        (
            "qemu-img",
            &[
                "info",
                "json:{\"driver\":\"raw\",\"offset\":\"abc\",\"file\":{\"driver\":\"file\",\"filename\":\"r.raw\"}}",
            ],
        ),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    let masked = without_lines(&outs, &["ops/sec", "disk size"]);
    assert_eq!(
        masked[1], masked[0],
        "qimg (left) differs from QEMU (right)"
    );
    assert!(masked[0].contains("fixed-size raw disks"), "{}", masked[0]);
    assert!(masked[0].contains("\"offset\": 524288"), "{}", masked[0]);
}

#[test]
fn qemu_io_usage_errors_print_its_whole_usage() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("io-usage");
    let ours = Ours::new(&s);
    let cases: &[&[&str]] = &[
        &["-Z"],
        &["--bogus"],
        // A short option whose long name starts with another letter.
        &["-t"],
        &["-d"],
        // An operand too many: the usage, and no reason.
        &["a.qcow2", "b.qcow2"],
    ];
    for args in cases {
        let (qemu, mine) = both(&s, &ours, "qemu-io", &[], args);
        assert_eq!(mine, qemu, "qemu-io {args:?}: ours (left) vs QEMU's");
        assert!(qemu.0.contains("QEMU Disk exerciser"), "{qemu:?}");
    }
    for args in [&["rebase", "-b"][..], &["create", "-F"]] {
        let (qemu, mine) = both(&s, &ours, "qemu-img", &[], args);
        assert_eq!(mine, qemu, "qemu-img {args:?}: ours (left) vs QEMU's");
    }
}

#[test]
fn create_without_a_format_makes_raw_as_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("create-default-raw");
    let ours = Ours::new(&s);
    let steps: Prep = &[
        ("qemu-img", &["create", "t.img", "1M"]),
        ("qemu-img", &["info", "t.img"]),
        ("qemu-img", &["create", "-o", "help"]),
        ("qemu-img", &["create", "-f", "file", "-o", "help"]),
    ];
    let outs = side_by_side(&s, &ours, &[], &[], steps);
    let masked = without_lines(&outs, &["disk size"]);
    assert_eq!(
        masked[1], masked[0],
        "qimg (left) differs from QEMU (right)"
    );
    assert!(masked[0].contains("fmt=raw size=1048576"), "{}", masked[0]);
}

#[test]
fn a_discard_on_a_raw_file_punches_a_hole_as_qemu_io() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("raw-discard");
    let ours = Ours::new(&s);
    let prepare: Prep = &[
        ("qemu-img", &["create", "-f", "raw", "t.img", "1M"]),
        ("qemu-io", &["-f", "raw", "-c", "write -P 1 0 64k", "t.img"]),
    ];
    let steps: Prep = &[
        // Discard gives the space back (the file's disk size shrinks); write-zeroes keeps it.
        (
            "qemu-io",
            &[
                "-f",
                "raw",
                "-c",
                "discard 32k 32k",
                "-c",
                "write -z 0 4k",
                "-c",
                "write -z -u 8k 4k",
                "t.img",
            ],
        ),
        ("qemu-img", &["info", "-f", "raw", "t.img"]),
        ("qemu-img", &["map", "--output=json", "-f", "raw", "t.img"]),
        (
            "qemu-io",
            &[
                "-f",
                "raw",
                "-c",
                "read -P 0 0 4k",
                "-c",
                "read -P 1 4k 4k",
                "-c",
                "read -P 0 8k 4k",
                "-c",
                "read -P 1 12k 20k",
                "-c",
                "read -P 0 32k 32k",
                "t.img",
            ],
        ),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert_eq!(outs[1], outs[0], "qimg (left) differs from QEMU (right)");
    assert!(outs[0].contains("disk size: 28 KiB"), "{}", outs[0]);
    assert!(!outs[0].contains("verification failed"), "{}", outs[0]);
}

/// Encrypted images (made by QEMU: qimg does not encrypt): `info` shows them as qemu-img does
/// (`encrypted: yes`, the LUKS header's `encrypt` block, `aes`), with no key; every command
/// that reads them refuses as QEMU's tools refuse without a key (`encrypt.key-secret`
/// missing, naming no secret, a format or option the header does not take), also for an
/// encrypted backing file and qemu-io's `open -o`. (With the right key QEMU goes on; qimg
/// refuses in its own words, which no step here compares.)
#[test]
fn encrypted_images_show_and_refuse_as_qemus_tools_without_a_key() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("encrypted");
    let ours = Ours::new(&s);
    let secret = "secret,id=sec0,data=123456";
    let prepare: Prep = &[
        (
            "qemu-img",
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "--object",
                secret,
                "-o",
                "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10",
                "l.qcow2",
                "16M",
            ],
        ),
        (
            "qemu-img",
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "--object",
                secret,
                "-o",
                "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10,\
                 encrypt.cipher-alg=aes-128,encrypt.cipher-mode=cbc,encrypt.ivgen-alg=essiv,\
                 encrypt.hash-alg=sha1",
                "c.qcow2",
                "16M",
            ],
        ),
        (
            "qemu-img",
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "--object",
                secret,
                "-o",
                "encrypt.format=aes,encrypt.key-secret=sec0",
                "a.qcow2",
                "16M",
            ],
        ),
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "p.qcow2", "16M"],
        ),
        (
            "qemu-img",
            &[
                "create", "-q", "-f", "qcow2", "-b", "l.qcow2", "-F", "qcow2", "t.qcow2",
            ],
        ),
    ];
    let mut steps: Vec<(&str, Vec<String>)> = Vec::new();
    let v = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    for f in ["l.qcow2", "c.qcow2", "a.qcow2"] {
        let opts = |extra: &str| format!("driver=qcow2,file.filename={f},{extra}");
        steps.push(("qemu-img", v(&["info", f])));
        steps.push(("qemu-img", v(&["info", "--output=json", f])));
        for cmd in [
            v(&["check", f]),
            v(&["map", f]),
            v(&["compare", f, f]),
            v(&["convert", "-O", "raw", f, "x.raw"]),
            v(&["snapshot", "-l", f]),
            v(&["resize", f, "32M"]),
            v(&["info", "--image-opts", &opts("encrypt.key-secret=sec9")]),
            v(&["info", "--image-opts", &opts("encrypt.format=foo")]),
            v(&["check", "--image-opts", &opts("encrypt.bogus=1")]),
            v(&["check", "--image-opts", &opts("encrypt.key-secret=sec9")]),
            v(&[
                "check",
                "--object",
                secret,
                "--image-opts",
                &opts("encrypt.format=aes"),
            ]),
        ] {
            steps.push(("qemu-img", cmd));
        }
        let json = format!(
            "json:{{\"driver\":\"qcow2\",\"file\":{{\"filename\":\"{f}\"}},\"encrypt\":{{\"key-secret\":\"sec9\"}}}}"
        );
        steps.push(("qemu-img", v(&["check", &json])));
        steps.push(("qemu-io", v(&["-c", "read 0 4k", f])));
        steps.push(("qemu-io", v(&["-r", "-c", "read 0 4k", f])));
        steps.push((
            "qemu-io",
            v(&[
                "-c",
                &format!("open -o driver=qcow2,encrypt.key-secret=sec9 {f}"),
            ]),
        ));
    }
    // An unencrypted image: a key secret is taken (and named in info), a format is refused.
    steps.push((
        "qemu-img",
        v(&[
            "info",
            "--object",
            secret,
            "--image-opts",
            "driver=qcow2,file.filename=p.qcow2,encrypt.key-secret=sec0",
        ]),
    ));
    steps.push((
        "qemu-img",
        v(&[
            "check",
            "--image-opts",
            "driver=qcow2,file.filename=p.qcow2,encrypt.format=luks",
        ]),
    ));
    steps.push((
        "qemu-io",
        v(&[
            "--object",
            secret,
            "-c",
            "open -o encrypt.key-secret=sec0 p.qcow2",
            "-c",
            "read -P 0 0 4k",
        ]),
    ));
    // An encrypted backing file.
    steps.push(("qemu-img", v(&["info", "--backing-chain", "t.qcow2"])));
    steps.push(("qemu-img", v(&["map", "t.qcow2"])));
    steps.push(("qemu-io", v(&["-c", "read 0 4k", "t.qcow2"])));
    let owned: Vec<(&str, Vec<&str>)> = steps
        .iter()
        .map(|(t, a)| (*t, a.iter().map(String::as_str).collect()))
        .collect();
    let refs: Vec<(&str, &[&str])> = owned.iter().map(|(t, a)| (*t, a.as_slice())).collect();
    let outs = side_by_side(&s, &ours, &[], prepare, &refs);
    // Each image has its own random UUID and the iterations QEMU measured while making it.
    let outs = without_lines(&outs, &["uuid", "iters"]);
    assert!(outs[0].contains("encrypted: yes") && outs[0].contains("cipher mode: cbc"));
    assert!(outs[0].contains("Parameter 'encrypt.key-secret' is required for cipher"));
    assert_eq!(outs[0], outs[1]);
}

/// A bitmaps extension that autoclear bit 0 does not vouch for (here: a v2 image made by
/// QEMU's downgrade of an image with a bitmap): every open warns as QEMU's (without a final
/// newline), a read-write open drops the extension from the header (later opens are quiet,
/// the clusters stay leaked until `check -r`), and the upgrade back to v3 keeps no bitmap.
/// Also `bitmap --merge` looking its target up before its source, and the raw-probe warning
/// of `bitmap` and `rebase` on a raw image, as qemu-img.
#[test]
fn unvouched_bitmaps_warn_and_a_writer_drops_them_as_qemu() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("stale-bitmaps");
    let ours = Ours::new(&s);
    let prepare: Prep = &[
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "t.qcow2", "4M"],
        ),
        ("qemu-io", &["-c", "write -P 3 2M 1M", "t.qcow2"]),
        ("qemu-img", &["bitmap", "--add", "t.qcow2", "b0"]),
        ("qemu-img", &["amend", "-o", "compat=0.10", "t.qcow2"]),
        ("qemu-img", &["create", "-q", "-f", "raw", "r.img", "1M"]),
        (
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "m.qcow2", "4M"],
        ),
        ("qemu-img", &["bitmap", "--add", "m.qcow2", "a"]),
    ];
    let steps: Prep = &[
        ("qemu-img", &["info", "t.qcow2"]),
        ("qemu-img", &["check", "t.qcow2"]),
        ("qemu-io", &["-r", "-c", "read -P 3 2M 1M", "t.qcow2"]),
        ("qemu-img", &["map", "--output=json", "t.qcow2"]),
        // The writer: warns, then drops the extension.
        ("qemu-io", &["-c", "read -P 3 2M 1M", "t.qcow2"]),
        ("qemu-io", &["-c", "read -P 3 2M 1M", "t.qcow2"]),
        ("qemu-img", &["check", "t.qcow2"]),
        ("qemu-img", &["amend", "-o", "compat=1.1", "t.qcow2"]),
        ("qemu-img", &["info", "t.qcow2"]),
        ("qemu-img", &["check", "-r", "all", "t.qcow2"]),
        ("qemu-img", &["check", "t.qcow2"]),
        // Merge: the missing target is named before the missing source.
        (
            "qemu-img",
            &["bitmap", "--merge", "nosrc", "m.qcow2", "nodst"],
        ),
        ("qemu-img", &["bitmap", "--merge", "nosrc", "m.qcow2", "a"]),
        (
            "qemu-img",
            &[
                "bitmap", "--merge", "a", "-b", "m.qcow2", "m.qcow2", "nodst",
            ],
        ),
        // A probed raw image.
        ("qemu-img", &["rebase", "-b", "x", "r.img"]),
    ];
    let outs = side_by_side(&s, &ours, &[], prepare, steps);
    assert!(
        outs[0].contains("This qcow2 v2 image contains bitmaps"),
        "{}",
        outs[0]
    );
    assert!(
        outs[0].contains("Dirty bitmap 'nodst' not found"),
        "{}",
        outs[0]
    );
    assert_eq!(outs[0], outs[1]);
}

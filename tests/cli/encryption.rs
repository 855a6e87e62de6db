//! LUKS-encrypted qcow2 images (`encrypt.format=luks`) between qimg and QEMU 10: images
//! either makes are read and written by the other with the same passphrase, guest data
//! compared with a model (a raw file both tools write the same bytes to), `qemu-img check`
//! clean, and the refusals (a wrong passphrase) in QEMU's words. Every cipher qimg
//! implements is made by each tool; writes cover unaligned bytes (the cipher works on
//! 512-byte sectors), copy-on-write from a backing file, subclusters (extended L2), zeroes
//! and discards. PBKDF2 runs with `encrypt.iter-time=10` so that a debug build's unlock is
//! quick.

use crate::common;
use crate::qemu_dropin::Ours;

use std::path::Path;
use std::process::Output;

use common::*;

const SECRET: &str = "secret,id=sec0,data=correct horse";
const WRONG: &str = "secret,id=sec0,data=battery staple";

/// `--image-opts` naming `file` with the key secret `sec0`.
fn opts(file: &str) -> String {
    format!("driver=qcow2,file.filename={file},encrypt.key-secret=sec0")
}

fn qemu_io(dir: &Path, args: &[&str]) -> Output {
    run(dir, Path::new("qemu-io"), args)
}

/// Runs qemu-io (QEMU's, or ours) on the encrypted `file` with `cmds`; fails the test when
/// anything fails.
fn io(dir: &Path, ours: Option<&Ours>, file: &str, cmds: &[&str]) -> String {
    let o = opts(file);
    let mut args = vec!["--object", SECRET];
    for c in cmds {
        args.extend(["-c", c]);
    }
    args.extend(["--image-opts", &o]);
    let out = match ours {
        Some(ours) => ours.io(dir, &args),
        None => qemu_io(dir, &args),
    };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let who = if ours.is_some() { "qimg" } else { "QEMU" };
    assert!(
        out.status.success() && !text.contains("fail") && !text.contains("rror"),
        "{who} qemu-io {cmds:?} on {file}: {text}"
    );
    text
}

/// Writes that exercise the sector cipher: unaligned bytes in one sector and across
/// sectors and clusters, a whole cluster, zeroes (unaligned and whole) and a discard, a
/// vectored write; the same bytes go to the raw model.
const WRITES: &[&str] = &[
    "write -P 0x11 0 64k",
    "write -P 0x22 100 1000",
    "write -P 0x33 65000 2000",
    "write -P 0x44 130k 3",
    "write -z 70000 5000",
    "write -z 192k 64k",
    "writev -P 0x55 300k 1k 511 513",
    "discard 448k 64k",
    "write -P 0x66 1M 1",
];

/// Checks that `file` (encrypted, `sec0`) and the raw `model` hold the same guest data, with
/// QEMU's compare and with ours, and that QEMU's check finds the image clean.
fn same_as_model(dir: &Path, ours: &Ours, file: &str, model: &str) {
    let o = opts(file);
    let m = format!("driver=raw,file.filename={model}");
    let args = ["compare", "--object", SECRET, "--image-opts", &o, &m];
    for (who, out) in [
        ("QEMU", qemu_img(dir, &args)),
        ("qimg", ours.img(dir, &args)),
    ] {
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("Images are identical"),
            "{who} compare {file} {model}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    ok(
        "qemu-img check",
        &qemu_img(dir, &["check", "--object", SECRET, "--image-opts", &o]),
    );
}

/// The raw model of `WRITES` (written by QEMU's qemu-io on a raw file of `size`).
fn model(dir: &Path, name: &str, size: &str) {
    ok(
        "model",
        &qemu_img(dir, &["create", "-q", "-f", "raw", name, size]),
    );
    let mut args = vec!["-f", "raw"];
    for c in WRITES {
        args.extend(["-c", c]);
    }
    args.push(name);
    let out = qemu_io(dir, &args);
    assert!(out.status.success(), "{out:?}");
}

/// `encrypt.*` create options for a cipher.
fn create_opts(cipher: &str) -> String {
    format!("encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10{cipher}")
}

const CIPHERS: &[&str] = &[
    "",
    ",encrypt.cipher-alg=aes-128",
    ",encrypt.cipher-alg=aes-128,encrypt.cipher-mode=cbc,encrypt.ivgen-alg=essiv",
    ",encrypt.cipher-alg=aes-192,encrypt.ivgen-alg=plain,encrypt.hash-alg=sha1",
    ",encrypt.cipher-alg=aes-256,encrypt.cipher-mode=cbc,encrypt.ivgen-alg=plain64,encrypt.hash-alg=sha512",
];

#[test]
fn images_either_tool_encrypts_read_and_write_in_the_other() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("luks-both-ways");
    let dir = &s.0;
    let ours = Ours::new(&s);
    model(dir, "model.raw", "2M");
    for (i, cipher) in CIPHERS.iter().enumerate() {
        let o = create_opts(cipher);
        for (maker, writer) in [("qemu", "qimg"), ("qimg", "qemu")] {
            let file = format!("{maker}-{i}.qcow2");
            let args = [
                "create", "-q", "-f", "qcow2", "--object", SECRET, "-o", &o, &file, "2M",
            ];
            match maker {
                "qemu" => ok("qemu-img create", &qemu_img(dir, &args)),
                _ => ok("qimg create", &ours.img(dir, &args)),
            };
            // The header either made says the same thing in both tools' info.
            let theirs = ok("qemu-img info", &qemu_img(dir, &["info", &file]));
            let mine = ok("qimg info", &ours.img(dir, &["info", &file]));
            let strip = |t: &str| {
                t.lines()
                    .filter(|l| {
                        !l.contains("uuid") && !l.contains("iters") && !l.contains("disk size")
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            };
            assert_eq!(strip(&theirs), strip(&mine), "info of {file}");
            assert!(theirs.contains("encrypted: yes"), "{theirs}");
            let writer_tool = (writer == "qimg").then_some(&ours);
            io(dir, writer_tool, &file, WRITES);
            same_as_model(dir, &ours, &file, "model.raw");
            // And the other tool reads what was written, pattern by pattern.
            let reader = if writer == "qimg" { None } else { Some(&ours) };
            io(
                dir,
                reader,
                &file,
                &[
                    "read -P 0x11 0 100",
                    "read -P 0x22 100 1000",
                    "read -P 0x33 65000 2000",
                    "read -P 0 70000 5000",
                    "read -P 0x44 130k 3",
                ],
            );
        }
    }
}

#[test]
fn a_wrong_passphrase_is_refused_in_qemus_words() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("luks-wrong");
    let dir = &s.0;
    let ours = Ours::new(&s);
    let o = create_opts("");
    ok(
        "qimg create",
        &ours.img(
            dir,
            &[
                "create", "-q", "-f", "qcow2", "--object", SECRET, "-o", &o, "e.qcow2", "1M",
            ],
        ),
    );
    let io_opts = opts("e.qcow2");
    for args in [
        vec![
            "--object",
            WRONG,
            "-c",
            "read 0 512",
            "--image-opts",
            &io_opts,
        ],
        vec![
            "--object",
            SECRET,
            "-c",
            "read -P 0 0 512",
            "--image-opts",
            &io_opts,
        ],
    ] {
        let theirs = text(&qemu_io(dir, &args));
        let mine = text(&ours.io(dir, &args));
        let mask = |t: (String, String, Option<i32>)| {
            (
                t.0.lines()
                    .filter(|l| !l.contains("ops/sec"))
                    .collect::<Vec<_>>()
                    .join("\n"),
                t.1,
                t.2,
            )
        };
        assert_eq!(mask(theirs), mask(mine), "qemu-io {args:?}");
    }
    let theirs = text(&qemu_img(
        dir,
        &["check", "--object", WRONG, "--image-opts", &io_opts],
    ));
    assert!(
        theirs
            .1
            .contains("Invalid password, cannot unlock any keyslot"),
        "{theirs:?}"
    );
    assert_eq!(
        theirs,
        text(&ours.img(dir, &["check", "--object", WRONG, "--image-opts", &io_opts])),
    );
}

/// Copy-on-write from a plain backing file into an encrypted overlay (standard and extended
/// L2 entries: whole clusters and subclusters), `convert` into an encrypted image and out of
/// one, `map` without host offsets as QEMU's.
#[test]
fn overlays_subclusters_and_convert_of_encrypted_images_as_qemu() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("luks-cow");
    let dir = &s.0;
    let ours = Ours::new(&s);
    ok(
        "base",
        &qemu_img(dir, &["create", "-q", "-f", "raw", "base.raw", "2M"]),
    );
    let out = qemu_io(dir, &["-f", "raw", "-c", "write -P 0x77 0 2M", "base.raw"]);
    assert!(out.status.success());
    let o = create_opts("");
    for (name, extra) in [("std", ""), ("ext", ",extended_l2=on")] {
        let file = format!("{name}.qcow2");
        let opts_with = format!("{o}{extra},backing_file=base.raw,backing_fmt=raw");
        ok(
            "qimg create overlay",
            &ours.img(
                dir,
                &[
                    "create", "-q", "-f", "qcow2", "--object", SECRET, "-o", &opts_with, &file,
                ],
            ),
        );
        // The model: the backing file's bytes with the writes over them.
        let model = format!("{name}.raw");
        std::fs::copy(dir.join("base.raw"), dir.join(&model)).unwrap();
        let mut args = vec!["-f", "raw"];
        for c in WRITES {
            args.extend(["-c", c]);
        }
        args.push(&model);
        assert!(qemu_io(dir, &args).status.success());
        io(dir, Some(&ours), &file, WRITES);
        same_as_model(dir, &ours, &file, &model);
        // map: data without offsets, as QEMU prints it for an encrypted image.
        let io_opts = opts(&file);
        let map = [
            "map",
            "--output=json",
            "--object",
            SECRET,
            "--image-opts",
            &io_opts,
        ];
        let theirs = ok("qemu-img map", &qemu_img(dir, &map));
        assert!(
            theirs
                .lines()
                .filter(|l| l.contains("\"depth\": 0"))
                .all(|l| !l.contains("\"offset\"")),
            "{theirs}"
        );
        assert_eq!(
            theirs,
            ok("qimg map", &ours.img(dir, &map)),
            "map of {file}"
        );
    }
    // convert into an encrypted image (ours), out of it (QEMU's), both compared.
    let to = [
        "convert",
        "--object",
        SECRET,
        "-O",
        "qcow2",
        "-o",
        &o,
        "std.raw",
        "conv.qcow2",
    ];
    ok("qimg convert", &ours.img(dir, &to));
    same_as_model(dir, &ours, "conv.qcow2", "std.raw");
    let io_opts = opts("conv.qcow2");
    ok(
        "qemu-img convert",
        &qemu_img(
            dir,
            &[
                "convert",
                "--object",
                SECRET,
                "--image-opts",
                &io_opts,
                "-O",
                "raw",
                "back.raw",
            ],
        ),
    );
    assert_eq!(
        std::fs::read(dir.join("back.raw")).unwrap(),
        std::fs::read(dir.join("std.raw")).unwrap()
    );
}

/// `measure` of an encrypted target counts the LUKS header area, as qemu-img's.
#[test]
fn measure_counts_the_luks_header_as_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("luks-measure");
    let dir = &s.0;
    let ours = Ours::new(&s);
    for cipher in CIPHERS {
        let o = create_opts(cipher);
        let args = [
            "measure", "--object", SECRET, "--size", "1G", "-O", "qcow2", "-o", &o,
        ];
        let theirs = ok("qemu-img measure", &qemu_img(dir, &args));
        assert_eq!(theirs, ok("qimg measure", &ours.img(dir, &args)), "{o}");
    }
}

/// The commands around an encrypted image, side by side with QEMU's tools (its images made by
/// QEMU in both runs): qemu-io through the key, `check`, `map`, snapshots, `resize`,
/// `convert`, an encrypted backing file opened with `backing.encrypt.key-secret`, `amend`
/// with the key (and QEMU's refusal of key slot options without `encrypt.state`), `bench`
/// (which takes no `--object` in qemu-img), `dd`.
#[test]
fn commands_on_an_encrypted_image_speak_as_qemus() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("luks-commands");
    let ours = Ours::new(&s);
    let o = "driver=qcow2,file.filename=t.qcow2,encrypt.key-secret=sec0";
    let create = create_opts("");
    let prepare: crate::qemu_dropin::Prep = &[
        (
            "qemu-img",
            &[
                "create", "-q", "-f", "qcow2", "--object", SECRET, "-o", &create, "t.qcow2", "4M",
            ],
        ),
        (
            "qemu-io",
            &[
                "--object",
                SECRET,
                "-c",
                "write -P 0xa 0 64k",
                "--image-opts",
                o,
            ],
        ),
        (
            "qemu-img",
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-b",
                "t.qcow2",
                "-F",
                "qcow2",
                "top.qcow2",
            ],
        ),
    ];
    let top = "driver=qcow2,file.filename=top.qcow2,backing.encrypt.key-secret=sec0";
    let steps: crate::qemu_dropin::Prep = &[
        (
            "qemu-io",
            &[
                "--object",
                SECRET,
                "-c",
                "write -P 0xb 1000 100",
                "-c",
                "read -P 0xb 1000 100",
                "-c",
                "write -z 4k 4k",
                "-c",
                "discard 64k 64k",
                "-c",
                "alloc 0 128k",
                "-c",
                "map",
                "--image-opts",
                o,
            ],
        ),
        (
            "qemu-img",
            &["check", "--object", SECRET, "--image-opts", o],
        ),
        ("qemu-img", &["map", "--object", SECRET, "--image-opts", o]),
        (
            "qemu-img",
            &[
                "map",
                "--output=json",
                "--object",
                SECRET,
                "--image-opts",
                o,
            ],
        ),
        (
            "qemu-img",
            &[
                "snapshot",
                "--object",
                SECRET,
                "-c",
                "s1",
                "--image-opts",
                o,
            ],
        ),
        (
            "qemu-io",
            &[
                "--object",
                SECRET,
                "-c",
                "write -P 0xc 0 4k",
                "--image-opts",
                o,
            ],
        ),
        (
            "qemu-img",
            &[
                "snapshot",
                "--object",
                SECRET,
                "-a",
                "s1",
                "--image-opts",
                o,
            ],
        ),
        (
            "qemu-io",
            &[
                "--object",
                SECRET,
                "-c",
                "read -P 0xa 0 4k",
                "--image-opts",
                o,
            ],
        ),
        (
            "qemu-img",
            &["resize", "--object", SECRET, "--image-opts", o, "8M"],
        ),
        (
            "qemu-img",
            &[
                "convert",
                "--object",
                SECRET,
                "-O",
                "raw",
                "--image-opts",
                o,
                "out.raw",
            ],
        ),
        (
            "qemu-img",
            &[
                "compare",
                "--object",
                SECRET,
                "--image-opts",
                o,
                "driver=raw,file.filename=out.raw",
            ],
        ),
        (
            "qemu-io",
            &[
                "--object",
                SECRET,
                "-c",
                "read -P 0xa 0 4k",
                "--image-opts",
                top,
            ],
        ),
        ("qemu-io", &["-c", "read -P 0xa 0 4k", "top.qcow2"]),
        (
            "qemu-img",
            &[
                "amend",
                "--object",
                SECRET,
                "-o",
                "lazy_refcounts=on",
                "--image-opts",
                o,
            ],
        ),
        (
            "qemu-img",
            &[
                "amend",
                "--object",
                SECRET,
                "-o",
                "encrypt.iter-time=10",
                "--image-opts",
                o,
            ],
        ),
        (
            "qemu-img",
            &["check", "--object", SECRET, "--image-opts", o],
        ),
        (
            "qemu-img",
            &["bench", "--object", SECRET, "-c", "10", "--image-opts", o],
        ),
        (
            "qemu-img",
            &[
                "dd",
                "--object",
                SECRET,
                "if=t.qcow2",
                "of=dd.raw",
                "bs=64k",
                "count=2",
                "-O",
                "raw",
            ],
        ),
    ];
    let outs = crate::qemu_dropin::side_by_side(&s, &ours, &[], prepare, steps);
    let outs = crate::qemu_dropin::without_lines(&outs, &["ops/sec", "Run completed"]);
    assert!(
        outs[0].contains("Parameter 'state' is missing"),
        "{}",
        outs[0]
    );
    assert_eq!(outs[0], outs[1]);
}

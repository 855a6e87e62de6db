//! `qimg info --output json` agrees with `qemu-img info --output=json` on qemu-made images.

use crate::common;
use common::*;

#[test]
fn info_json_matches_qemu_img_on_the_whole_matrix() {
    qimg_testkit::require_qemu!();
    let cases = matrix();
    assert!(
        cases.len() >= 40,
        "the matrix has only {} images",
        cases.len()
    );
    let mut failures = Vec::new();
    for c in &cases {
        let s = Scratch::new(&c.name);
        make_with_qemu(&s.0, c);
        let mut variants = vec![vec!["info", "--output=json", "img.qcow2"]];
        if c.backing.is_some() {
            variants.push(vec![
                "info",
                "--output=json",
                "--backing-chain",
                "img.qcow2",
            ]);
        }
        for args in variants {
            let theirs = json("qemu-img info", &qemu_img(&s.0, &args));
            let mut ours_args: Vec<&str> = args.clone();
            ours_args[1] = "--output=json";
            let ours = json("qimg info", &qimg(&s.0, &ours_args));
            let diff = common_fields_differ(&ours, &theirs, &[]);
            if !diff.is_empty() {
                failures.push(format!("{} {:?}: {diff:?}", c.name, args));
            }
            // And the text itself, byte for byte: QEMU's member order and indentation.
            let (theirs_text, ours_text) =
                (qemu_img(&s.0, &args).stdout, qimg(&s.0, &ours_args).stdout);
            if ours_text != theirs_text {
                failures.push(format!(
                    "{} {:?}: the JSON text differs:\n{}\nqemu-img:\n{}",
                    c.name,
                    args,
                    String::from_utf8_lossy(&ours_text),
                    String::from_utf8_lossy(&theirs_text)
                ));
            }
            // The comparison must have compared the fields the issue names.
            let top = if ours.is_array() { &ours[0] } else { &ours };
            let theirs_top = if theirs.is_array() {
                &theirs[0]
            } else {
                &theirs
            };
            for key in [
                "virtual-size",
                "filename",
                "cluster-size",
                "format",
                "actual-size",
                "dirty-flag",
                "format-specific",
            ] {
                assert!(
                    top.get(key).is_some() && theirs_top.get(key).is_some(),
                    "{}: {key} missing",
                    c.name
                );
            }
            if c.backing.is_some() {
                for key in [
                    "backing-filename",
                    "full-backing-filename",
                    "backing-filename-format",
                ] {
                    assert!(top.get(key).is_some(), "{}: {key} missing", c.name);
                }
            }
            if c.snapshot {
                assert_eq!(
                    top["snapshots"].as_array().map(Vec::len),
                    Some(2),
                    "{}",
                    c.name
                );
            }
            if c.bitmap {
                assert_eq!(
                    top["format-specific"]["data"]["bitmaps"]
                        .as_array()
                        .map(Vec::len),
                    Some(2)
                );
            }
            assert!(
                count_common(&ours, &theirs) >= 15,
                "{}: too few common fields",
                c.name
            );
        }
    }
    assert!(
        failures.is_empty(),
        "qimg info differs from qemu-img info:\n{}",
        failures.join("\n")
    );
}

#[test]
fn info_never_changes_the_image() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("info-ro");
    let c = matrix()
        .into_iter()
        .find(|c| c.name == "snapshot-ext")
        .unwrap();
    make_with_qemu(&s.0, &c);
    let before = std::fs::read(s.path("img.qcow2")).unwrap();
    for args in [
        vec!["info", "img.qcow2"],
        vec!["info", "--output=json", "--backing-chain", "img.qcow2"],
    ] {
        ok("qimg info", &qimg(&s.0, &args));
    }
    assert_eq!(before, std::fs::read(s.path("img.qcow2")).unwrap());
}

#[test]
fn human_info_matches_qemu_img_line_for_line_on_plain_images() {
    qimg_testkit::require_qemu!();
    for name in [
        "cs64k",
        "cs128k-ext",
        "backing-ext",
        "v2-cs64k",
        "zstd",
        "datafile-raw",
        "bitmaps",
    ] {
        let c = matrix().into_iter().find(|c| c.name == name).unwrap();
        let s = Scratch::new(name);
        make_with_qemu(&s.0, &c);
        let theirs = ok("qemu-img info", &qemu_img(&s.0, &["info", "img.qcow2"]));
        let ours = ok("qimg info", &qimg(&s.0, &["info", "img.qcow2"]));
        assert_eq!(ours, theirs, "{name}");
    }
}

#[test]
fn info_on_damaged_images_fails_cleanly_naming_the_problem() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("damaged");
    ok(
        "qemu-img",
        &qemu_img(&s.0, &["create", "-q", "-f", "qcow2", "img.qcow2", "64M"]),
    );
    let good = std::fs::read(s.path("img.qcow2")).unwrap();
    let mut cases: Vec<(&str, Vec<u8>, &str)> = Vec::new();
    cases.push(("truncated", good[..50].to_vec(), "truncated"));
    let mut snaps = good.clone();
    snaps[60..64].copy_from_slice(&1000u32.to_be_bytes());
    snaps[64..72].copy_from_slice(&0x7000_0000u64.to_be_bytes());
    cases.push(("snapshots past EOF", snaps, "snapshot table entry"));
    let mut ext = good.clone();
    ext[116..120].copy_from_slice(&0x00ff_ffffu32.to_be_bytes());
    cases.push(("extension too long", ext, "0x6803f857"));
    let mut bits = good.clone();
    bits[20..24].copy_from_slice(&30u32.to_be_bytes());
    cases.push(("cluster_bits 30", bits, "cluster_bits 30"));
    for (what, bytes, want) in cases {
        std::fs::write(s.path("bad.qcow2"), &bytes).unwrap();
        let o = qimg(&s.0, &["info", "-f", "qcow2", "--output=json", "bad.qcow2"]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{what}: {err}");
        assert!(
            err.contains(want) && !err.contains("panicked"),
            "{what}: {err}"
        );
        assert_eq!(
            std::fs::read(s.path("bad.qcow2")).unwrap(),
            bytes,
            "{what}: file changed"
        );
    }
}

/// Every saved finding (`fuzz/regressions/check/`, `open_read/`): `qimg info` and `qimg
/// check` print what qemu-img prints, byte for byte, with the same exit status (among them
/// an encrypted v3 image whose snapshot entries lack their extra data, which QEMU reads and
/// qimg used to refuse).
#[test]
fn info_and_check_on_saved_findings_print_what_qemu_img_prints() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("findings-info");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/regressions");
    let mut n = 0;
    for kind in ["check", "open_read"] {
        let mut files: Vec<_> = std::fs::read_dir(root.join(kind))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        for f in files {
            std::fs::copy(&f, s.path("f.img")).unwrap();
            for cmd in ["info", "check"] {
                let want = text(&qemu_img(&s.0, &[cmd, "f.img"]));
                let got = text(&qimg(&s.0, &[cmd, "f.img"]));
                assert_eq!(got, want, "{cmd} {}", f.display());
            }
            n += 1;
        }
    }
    assert!(n >= 8, "{n} findings");
}

/// Image names as QEMU takes them: `--image-opts` option strings and `json:` names, on
/// `info`, `check`, `map` and `compare`, through the binary installed as qemu-img: the same
/// stdout, stderr and exit status as qemu-img's, refusals included.
#[test]
fn image_opts_and_json_names_work_as_with_qemu_img() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("image-opts");
    let bin = s.path("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::os::unix::fs::symlink(qimg_bin(), bin.join("qemu-img")).unwrap();
    ok(
        "create",
        &qemu_img(
            &s.0,
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-o",
                "extended_l2=on",
                "a.qcow2",
                "8M",
            ],
        ),
    );
    qemu_io(&s.0, "qcow2", "a.qcow2", &["write -P 7 0 1M"]);
    let opts = "driver=qcow2,file.filename=a.qcow2,l2-cache-size=1M";
    let json = r#"json:{"driver":"qcow2","file":{"driver":"file","filename":"a.qcow2"}}"#;
    let cases: Vec<Vec<&str>> = vec![
        vec!["info", "--image-opts", opts],
        vec!["info", "--output=json", json],
        vec!["check", "--image-opts", opts],
        vec!["check", json],
        vec!["map", "--output=json", json],
        vec!["compare", json, "a.qcow2"],
        vec![
            "info",
            "--image-opts",
            "driver=qcow2,file.filename=a.qcow2,bogus=1",
        ],
    ];
    for args in cases {
        let theirs = qemu_img(&s.0, &args);
        let ours = run(&s.0, &bin.join("qemu-img"), &args);
        assert_eq!(
            (
                String::from_utf8_lossy(&ours.stdout),
                String::from_utf8_lossy(&ours.stderr),
                ours.status.code()
            ),
            (
                String::from_utf8_lossy(&theirs.stdout),
                String::from_utf8_lossy(&theirs.stderr),
                theirs.status.code()
            ),
            "{args:?}"
        );
    }
}

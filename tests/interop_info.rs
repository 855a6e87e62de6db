//! `qimg info --output json` agrees with `qemu-img info --output=json` on qemu-made images.

mod common;
use common::*;

#[test]
fn info_json_matches_qemu_img_on_the_whole_matrix() {
    if !have_qemu("info_json_matches_qemu_img_on_the_whole_matrix") {
        return;
    }
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
    if !have_qemu("info_never_changes_the_image") {
        return;
    }
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
    if !have_qemu("human_info_matches_qemu_img_line_for_line_on_plain_images") {
        return;
    }
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

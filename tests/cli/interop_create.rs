//! Images made by `qimg create` pass `qemu-img check` and look to qemu-img exactly like the
//! images qemu-img itself makes with the same options.

use crate::common;
use common::*;

#[test]
fn qimg_images_pass_qemu_img_check_and_match_qemu_img_info() {
    qimg_testkit::require_qemu!();
    let cases: Vec<Case> = matrix()
        .into_iter()
        .filter(|c| !c.snapshot && !c.bitmap)
        .collect();
    assert!(cases.len() >= 40);
    let mut failures = Vec::new();
    let mut identical = 0;
    for c in &cases {
        let theirs = Scratch::new(&format!("{}-qemu", c.name));
        let ours = Scratch::new(&format!("{}-qimg", c.name));
        make_with_qemu(&theirs.0, c);
        make_backing(&ours.0, c);
        let args = create_args(c);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        ok(&format!("qimg create ({})", c.name), &qimg(&ours.0, &args));
        assert_clean(&ours.0, "img.qcow2", &c.name);
        let a = json(
            "qemu-img info",
            &qemu_img(&ours.0, &["info", "--output=json", "img.qcow2"]),
        );
        let b = json(
            "qemu-img info",
            &qemu_img(&theirs.0, &["info", "--output=json", "img.qcow2"]),
        );
        // actual-size depends on the layout of preallocated data; the file's own length too.
        let diff = common_fields_differ(&a, &b, &["actual-size"]);
        let child_len_differs =
            a["children"][0]["info"]["virtual-size"] != b["children"][0]["info"]["virtual-size"];
        if !diff.is_empty() {
            failures.push(format!("{}: {diff:?}", c.name));
        }
        if c.opts.contains("preallocation") || c.opts.contains("data_file_raw") {
            // Our preallocated layout differs from QEMU's (QEMU grows its refcount table while
            // allocating); the guest view and the metadata must still be equal.
            let m1 = ok(
                "qemu-img map",
                &qemu_img(&ours.0, &["map", "--output=json", "img.qcow2"]),
            );
            let m2 = ok(
                "qemu-img map",
                &qemu_img(&theirs.0, &["map", "--output=json", "img.qcow2"]),
            );
            // Below 4 KiB clusters (and for raw data files, whose status QEMU derives partly
            // from the image file's own holes), whether a range reports "zero" depends on
            // which file system blocks are allocated, i.e. on the layout, not on metadata.
            let small = c.opts.contains("cluster_size=512") || c.opts.contains("data_file_raw");
            let strip = |s: &str| -> Vec<serde_json::Value> {
                let mut v: Vec<serde_json::Value> = serde_json::from_str(s).unwrap();
                for e in &mut v {
                    let o = e.as_object_mut().unwrap();
                    o.remove("offset");
                    if small {
                        o.remove("zero");
                    }
                }
                if small {
                    // Merge neighbours that only differed in "zero".
                    let mut merged: Vec<serde_json::Value> = Vec::new();
                    for e in v {
                        if let Some(last) = merged.last_mut() {
                            let mut a = last.clone();
                            let mut b = e.clone();
                            for k in ["start", "length"] {
                                a.as_object_mut().unwrap().remove(k);
                                b.as_object_mut().unwrap().remove(k);
                            }
                            if a == b {
                                let len = last["length"].as_u64().unwrap()
                                    + e["length"].as_u64().unwrap();
                                last["length"] = len.into();
                                continue;
                            }
                        }
                        merged.push(e);
                    }
                    return merged;
                }
                v
            };
            if strip(&m1) != strip(&m2) {
                failures.push(format!("{}: qemu-img map differs:\n{m1}\n{m2}", c.name));
            }
        } else {
            if child_len_differs {
                failures.push(format!("{}: file length differs", c.name));
            }
            let x = std::fs::read(ours.path("img.qcow2")).unwrap();
            let y = std::fs::read(theirs.path("img.qcow2")).unwrap();
            if x == y {
                identical += 1;
            } else {
                failures.push(format!("{}: image bytes differ from qemu-img's", c.name));
            }
        }
        if c.opts.contains("data_file") {
            let x = std::fs::metadata(ours.path("data.raw")).unwrap().len();
            let y = std::fs::metadata(theirs.path("data.raw")).unwrap().len();
            if x != y {
                failures.push(format!("{}: data file length {x} vs {y}", c.name));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        identical >= 30,
        "only {identical} images were byte-identical"
    );
}

#[test]
fn create_prints_qemu_imgs_formatting_line() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("fmtline");
    ok(
        "base",
        &qemu_img(&s.0, &["create", "-q", "-f", "qcow2", "base.qcow2", "1G"]),
    );
    for args in [
        vec!["create", "-f", "qcow2", "x.qcow2", "1G"],
        vec![
            "create",
            "-f",
            "qcow2",
            "-o",
            "cluster_size=128k,extended_l2=on,preallocation=metadata,compression_type=zstd",
            "x.qcow2",
            "1000",
        ],
        vec![
            "create",
            "-f",
            "qcow2",
            "-o",
            "compat=v3,lazy_refcounts=yes,refcount_bits=8",
            "-o",
            "data_file=d.raw,data_file_raw=on",
            "x.qcow2",
            "1.5M",
        ],
        vec![
            "create",
            "-f",
            "qcow2",
            "-b",
            "base.qcow2",
            "-F",
            "qcow2",
            "-o",
            "extended_l2=on",
            "x.qcow2",
        ],
        vec!["create", "-f", "raw", "x.raw", "1M"],
    ] {
        let a = ok("qemu-img create", &qemu_img(&s.0, &args));
        let b = ok("qimg create", &qimg(&s.0, &args));
        assert_eq!(b, a, "{args:?}");
    }
}

#[test]
fn size_comes_from_the_backing_file_when_omitted() {
    qimg_testkit::require_qemu!();
    let s = Scratch::new("backsize");
    ok(
        "base",
        &qemu_img(&s.0, &["create", "-q", "-f", "qcow2", "base.qcow2", "3G"]),
    );
    ok(
        "raw",
        &qemu_img(&s.0, &["create", "-q", "-f", "raw", "base.raw", "5M"]),
    );
    ok(
        "qimg",
        &qimg(
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
                "a.qcow2",
            ],
        ),
    );
    ok(
        "qimg",
        &qimg(
            &s.0,
            &[
                "create", "-q", "-f", "qcow2", "-b", "base.raw", "-F", "raw", "b.qcow2",
            ],
        ),
    );
    let a = json(
        "info",
        &qemu_img(&s.0, &["info", "--output=json", "a.qcow2"]),
    );
    let b = json(
        "info",
        &qemu_img(&s.0, &["info", "--output=json", "b.qcow2"]),
    );
    assert_eq!(a["virtual-size"], 3u64 << 30);
    assert_eq!(b["virtual-size"], 5u64 << 20);
    // A relative backing name is resolved next to the image, not in the working directory.
    std::fs::create_dir(s.path("sub")).unwrap();
    ok(
        "base",
        &qemu_img(
            &s.0,
            &["create", "-q", "-f", "qcow2", "sub/inner.qcow2", "7M"],
        ),
    );
    ok(
        "qimg",
        &qimg(
            &s.0,
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-b",
                "inner.qcow2",
                "-F",
                "qcow2",
                "sub/top.qcow2",
            ],
        ),
    );
    let t = json(
        "info",
        &qemu_img(&s.0, &["info", "--output=json", "sub/top.qcow2"]),
    );
    assert_eq!(t["virtual-size"], 7u64 << 20);
}

#[test]
fn preallocation_full_on_a_big_image_is_readable_and_clean() {
    qimg_testkit::require_qemu!();
    // 512-byte clusters and 64-bit refcounts need several refcount blocks and table clusters.
    let s = Scratch::new("bigprealloc");
    ok(
        "qimg",
        &qimg(
            &s.0,
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-o",
                "cluster_size=512,refcount_bits=64,preallocation=full",
                "img.qcow2",
                "6M",
            ],
        ),
    );
    assert_clean(&s.0, "img.qcow2", "bigprealloc");
    // Every byte of the guest disk reads back as zero through qemu.
    let raw = s.path("img.raw");
    ok(
        "convert",
        &qemu_img(
            &s.0,
            &["convert", "-O", "raw", "img.qcow2", raw.to_str().unwrap()],
        ),
    );
    let data = std::fs::read(&raw).unwrap();
    assert_eq!(data.len(), 6 << 20);
    assert!(data.iter().all(|&b| b == 0));
}

/// QEMU resolves an external data file name against the current directory (not the image's,
/// as it does for backing files); qimg creates it there too, so qemu-io opened from the same
/// directory finds it. The engine also finds a data file moved next to its image.
#[test]
fn data_file_names_are_relative_to_the_current_directory_as_in_qemu() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("datafile-cwd");
    std::fs::create_dir(dir.path("sub")).unwrap();
    ok(
        "qimg create",
        &qimg(
            &dir.0,
            &[
                "create",
                "-q",
                "-o",
                "data_file=dd.raw",
                "sub/x.qcow2",
                "1M",
            ],
        ),
    );
    assert!(
        dir.path("dd.raw").exists(),
        "data file not in the current directory"
    );
    assert!(!dir.path("sub/dd.raw").exists());
    ok(
        "qemu-io",
        &run(
            &dir.0,
            std::path::Path::new("qemu-io"),
            &["-f", "qcow2", "-c", "write -P 9 0 4k", "sub/x.qcow2"],
        ),
    );
    std::fs::rename(dir.path("dd.raw"), dir.path("sub/dd.raw")).unwrap();
    let img = qimg::OpenOptions::new()
        .open_blocking(dir.path("sub/x.qcow2"))
        .unwrap();
    let mut buf = vec![0u8; 4096];
    img.read(&mut buf, 0).unwrap();
    assert_eq!(buf, vec![9u8; 4096]);
}

//! Helpers for the engine tests: qemu-img made images, check and compare against a model.
#![allow(dead_code)]

use std::path::Path;

use super::{json, ok, qemu_img};

/// `qemu-img create -f qcow2 -o OPTS FILE SIZE` (plus `-b`/`-F` when `backing` is given).
pub fn qemu_create(dir: &Path, file: &str, opts: &str, size: u64, backing: Option<(&str, &str)>) {
    let size = size.to_string();
    let mut args = vec!["create", "-q", "-f", "qcow2", "-o", opts];
    if let Some((b, fmt)) = backing {
        args.extend(["-b", b, "-F", fmt]);
    }
    args.extend([file, size.as_str()]);
    ok("qemu-img create", &qemu_img(dir, &args));
}

/// Runs `qemu-img check --output=json` and panics unless it reports no corruption, no leak
/// and no check error.
pub fn assert_clean(dir: &Path, file: &str, what: &str) {
    let o = qemu_img(dir, &["check", "--output=json", file]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|_| {
        panic!(
            "{what}: qemu-img check printed no JSON (exit {:?}): {}{}",
            o.status.code(),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    });
    for field in ["corruptions", "leaks", "check-errors"] {
        let n = v.get(field).and_then(|x| x.as_u64()).unwrap_or(0);
        assert_eq!(n, 0, "{what}: qemu-img check reports {field}={n}: {v}");
    }
    assert!(
        o.status.success(),
        "{what}: qemu-img check exit {:?}: {v}",
        o.status.code()
    );
}

/// Writes `model` as a raw file and runs `qemu-img compare` against the image.
pub fn assert_same_as_model(dir: &Path, file: &str, model: &[u8], what: &str) {
    let raw = dir.join("model.raw");
    std::fs::write(&raw, model).unwrap();
    let o = qemu_img(
        dir,
        &["compare", "-f", "qcow2", "-F", "raw", file, "model.raw"],
    );
    assert!(
        o.status.success(),
        "{what}: qemu-img compare says the image differs from the model: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The guest contents of an image as raw bytes, by `qemu-img convert -O raw`.
pub fn qemu_raw(dir: &Path, file: &str) -> Vec<u8> {
    let out = dir.join(format!("{file}.as-raw"));
    ok(
        "qemu-img convert -O raw",
        &qemu_img(dir, &["convert", "-O", "raw", file, out.to_str().unwrap()]),
    );
    let data = std::fs::read(&out).unwrap();
    let _ = std::fs::remove_file(&out);
    data
}

/// The `qemu-img info --output=json` of a file.
pub fn info(dir: &Path, file: &str) -> serde_json::Value {
    json(
        "qemu-img info",
        &qemu_img(dir, &["info", "--output=json", file]),
    )
}

/// A deterministic byte pattern for offset `at` with seed `seed`.
pub fn pattern(seed: u64, at: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            let x = (at + i).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ seed.wrapping_mul(0xD1B5_4A32_D192_ED03);
            (x >> 29) as u8 | 1
        })
        .collect()
}

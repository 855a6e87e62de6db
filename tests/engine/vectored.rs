//! Vectored reads and writes (`Image::read_vectored`, `Image::write_vectored`) against a flat
//! model: 1 to 3 segments per request, aligned and not, mixed with single-buffer requests,
//! write-zeroes and discards, on extended and standard L2 overlays over a backing file; then
//! `qemu-img check` is clean and `qemu-img compare` finds the model's bytes.

use crate::common;

use std::io::{IoSlice, IoSliceMut};

use common::{Scratch, assert_clean, assert_same_as_model, qemu_create};
use qimg::OpenOptions;
use qimg_testkit::model::GuestModel;
use qimg_testkit::pattern::pattern;
use qimg_testkit::rng::Rng;

const SIZE: u64 = 8 << 20;

/// A segment length: often a multiple of 4 KiB (what guest memory pages give), sometimes not.
fn segment_len(rng: &mut Rng) -> usize {
    if rng.chance(2, 3) {
        (rng.range(1, 17) * 4096) as usize
    } else {
        rng.range(1, 20_000) as usize
    }
}

fn request(rng: &mut Rng) -> (u64, Vec<usize>) {
    let segments: Vec<usize> = (0..rng.range(1, 4)).map(|_| segment_len(rng)).collect();
    let total: u64 = segments.iter().map(|&n| n as u64).sum();
    let offset = if rng.chance(1, 2) {
        rng.aligned(SIZE - total, 4096)
    } else {
        rng.below(SIZE - total)
    };
    (offset, segments)
}

async fn run(options: &str, seed: u64) {
    let dir = Scratch::new("vectored");
    let backing: Vec<u8> = (0..SIZE).map(|i| (i / 4096 % 251) as u8 | 1).collect();
    std::fs::write(dir.path("base.raw"), &backing).unwrap();
    qemu_create(
        &dir.0,
        "top.qcow2",
        options,
        SIZE,
        Some(("base.raw", "raw")),
    );
    let img = OpenOptions::new()
        .writable(true)
        .open(dir.path("top.qcow2"))
        .await
        .unwrap();
    let subcluster = img.subcluster_size();
    let mut model = GuestModel::new(SIZE, backing, subcluster);
    let mut rng = Rng(seed);
    for step in 0..300u64 {
        let (offset, segments) = request(&mut rng);
        let total: usize = segments.iter().sum();
        match rng.below(6) {
            0 | 1 => {
                let data = pattern(seed ^ step, offset, total);
                let mut parts = Vec::new();
                let mut at = 0;
                for &n in &segments {
                    parts.push(IoSlice::new(&data[at..at + n]));
                    at += n;
                }
                img.write_vectored(&parts, offset).await.unwrap();
                model.write(offset, &data);
            }
            2 | 3 => {
                let mut bufs: Vec<Vec<u8>> = segments.iter().map(|&n| vec![0xcc; n]).collect();
                let mut parts: Vec<IoSliceMut<'_>> =
                    bufs.iter_mut().map(|b| IoSliceMut::new(b)).collect();
                img.read_vectored(&mut parts, offset).await.unwrap();
                let got: Vec<u8> = bufs.concat();
                assert!(
                    got == model.read(offset, total as u64),
                    "step {step}: vectored read of {segments:?} at {offset:#x} differs"
                );
            }
            4 => {
                let data = pattern(seed ^ step ^ 0x55, offset, total);
                img.write(&data, offset).await.unwrap();
                model.write(offset, &data);
            }
            _ => {
                if rng.chance(1, 2) {
                    img.write_zeroes(offset, total as u64).await.unwrap();
                    model.write_zeroes(offset, total as u64);
                } else {
                    img.discard(offset, total as u64).await.unwrap();
                    model.discard(offset, total as u64);
                }
            }
        }
    }
    // An empty request and one past the end.
    img.write_vectored(&[], 0).await.unwrap();
    let mut one = [0u8; 1];
    assert!(
        img.read_vectored(&mut [IoSliceMut::new(&mut one)], SIZE)
            .await
            .is_err()
    );
    img.close().await.unwrap();
    assert_clean(&dir.0, "top.qcow2", options);
    assert_same_as_model(&dir.0, "top.qcow2", model.read(0, SIZE), options);
}

#[tokio::test]
async fn vectored_requests_match_the_model_with_extended_l2() {
    qimg_testkit::require_qemu!();
    run("extended_l2=on,cluster_size=64k", 1).await;
}

#[tokio::test]
async fn vectored_requests_match_the_model_with_standard_l2() {
    qimg_testkit::require_qemu!();
    run("cluster_size=4k", 2).await;
}

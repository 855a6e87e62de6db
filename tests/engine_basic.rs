//! The engine against qemu-img: basic reads and writes, subcluster copy-on-write counters,
//! the cache clean interval, and many concurrent tasks.

mod common;

use common::engine::*;
use common::{Scratch, have_qemu};
use qimg::{Image, OpenOptions};

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_read_back_and_the_image_checks_clean() {
    if !have_qemu("writes_read_back_and_the_image_checks_clean") {
        return;
    }
    for opts in ["extended_l2=on,cluster_size=128k", "cluster_size=64k", "compat=0.10,cluster_size=4k"] {
        let dir = Scratch::new("basic");
        qemu_create(&dir.0, "a.qcow2", opts, 8 * MIB, None);
        let img = Image::open(dir.path("a.qcow2"), &OpenOptions::read_write()).await.unwrap();
        let mut model = vec![0u8; 8 * MIB as usize];
        for (i, (at, len)) in [(0u64, 512usize), (1000, 70000), (3 * MIB - 7, 9000), (8 * MIB - 100, 100)]
            .into_iter()
            .enumerate()
        {
            let data = pattern(i as u64, at, len);
            img.write(&data, at).await.unwrap();
            model[at as usize..at as usize + len].copy_from_slice(&data);
        }
        let mut back = vec![0u8; model.len()];
        img.read(&mut back, 0).await.unwrap();
        assert!(back == model, "{opts}: read back differs");
        img.close().await.unwrap();
        assert_clean(&dir.0, "a.qcow2", opts);
        assert_same_as_model(&dir.0, "a.qcow2", &model, opts);
    }
}

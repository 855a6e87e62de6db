//! Hostile images through the engine: the committed header corpus, small images made by
//! qemu-img and qemu-io at test time, and thousands of seeded random corruptions of each, are
//! opened and read (and mapped) from memory. Nothing may panic or hang; damage gives errors.

use crate::common;

use qimg_testkit::fuzzing::corpus;

use qimg::OpenOptions;
use qimg::io::MemStorage;

/// Opens `data` as an image and reads and maps up to 1 MiB of it; returns whether every
/// step succeeded.
async fn open_and_read(data: &[u8]) -> bool {
    let storage = MemStorage::from_bytes(data);
    let opts = OpenOptions::new().clean_timer(false);
    let Ok(img) = opts
        .open_storage(storage, "hostile.qcow2", None, None)
        .await
    else {
        return false;
    };
    let len = img.size().min(1 << 20);
    let mut buf = vec![0u8; len as usize];
    let read = img.read(&mut buf, 0).await.is_ok();
    let mapped = img.map(0, len).await.is_ok();
    read && mapped
}

#[tokio::test]
async fn the_corpus_and_random_damage_never_panic() {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut inputs = corpus("header");
    let mut made = 0;
    let dir = common::Scratch::new("hostile");
    if common::have_qemu("the_corpus_and_random_damage_never_panic") {
        for (name, opts, script) in [
            ("ext", "extended_l2=on,cluster_size=16k", "write -P 1 0 40k"),
            (
                "std",
                "cluster_size=4k,refcount_bits=1",
                "write -P 2 5k 20k",
            ),
            ("zero", "cluster_size=8k", "write -z 0 64k"),
        ] {
            common::qemu_create(&dir.0, name, opts, 1 << 20, None);
            for cmd in [script, "write -P 9 100k 3k", "discard 16k 16k"] {
                common::ok(
                    "qemu-io",
                    &common::run(
                        &dir.0,
                        std::path::Path::new("qemu-io"),
                        &["-f", "qcow2", "-c", cmd, name],
                    ),
                );
            }
            inputs.push((name.to_string(), std::fs::read(dir.path(name)).unwrap()));
            made += 1;
        }
        common::ok(
            "qemu-img convert -c",
            &common::qemu_img(&dir.0, &["convert", "-c", "-O", "qcow2", "ext", "comp"]),
        );
        inputs.push(("comp".into(), std::fs::read(dir.path("comp")).unwrap()));
        made += 1;
    }
    let mut opened = 0;
    for (name, data) in inputs {
        if open_and_read(&data).await {
            opened += 1;
        }
        for _ in 0..300 {
            let mut d = data.clone();
            for _ in 0..1 + next() % 4 {
                let at = (next() % d.len() as u64) as usize;
                d[at] = next() as u8;
            }
            let _ = open_and_read(&d).await;
        }
        let _ = name;
    }
    assert!(
        opened >= made,
        "only {opened} of the {made} qemu-made images open and read"
    );
}

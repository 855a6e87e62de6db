//! Hostile images, one named test each: every image is made by qemu-img at test time and then
//! damaged in one precise way. Each must give a clear error naming what is wrong (and where),
//! never a panic, a hang or an unbounded allocation; an image found corrupt while open for
//! writing is marked corrupt on disk, as QEMU does, and the damaged metadata is not written.
//!
//! Memory: this test binary counts every heap allocation (the `cap` allocator). Each test runs
//! alone under a limit of what was allocated before it plus [`BUDGET`], which is the cache
//! budget the tests configure plus a small constant; exceeding it aborts the binary, so a
//! passing run proves the bound.

mod common;

use std::alloc::System;
use std::path::Path;
use std::sync::Mutex;

use cap::Cap;
use common::{Scratch, ok, qemu_img};
use qimg::{CacheOptions, Error, OpenOptions};

#[global_allocator]
static ALLOCATOR: Cap<System> = Cap::new(System, usize::MAX);

/// Configured cache budget: L2 and refcount caches.
const CACHE_BUDGET: u64 = 256 << 10;
/// Heap allowed above what was in use when a test started: the caches, the largest cluster 0
/// read at open (2 MiB), buffers of the test itself (at most 1 MiB) and runtime overhead.
const BUDGET: usize = CACHE_BUDGET as usize * 2 + (8 << 20);

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs `f` on a current-thread runtime with the heap limited to [`BUDGET`] more than now.
fn bounded<F: std::future::Future<Output = ()>>(f: F) {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        // A failing assertion must be able to format its message: lift the limit first.
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            ALLOCATOR.set_limit(usize::MAX).unwrap();
            default(info);
        }));
    });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    ALLOCATOR
        .set_limit(ALLOCATOR.allocated() + BUDGET)
        .expect("limit above the current use");
    rt.block_on(f);
    ALLOCATOR.set_limit(usize::MAX).unwrap();
}

fn opts(writable: bool) -> OpenOptions {
    OpenOptions::new()
        .writable(writable)
        .clean_timer(false)
        .cache(CacheOptions {
            l2_cache_size: Some(CACHE_BUDGET / 2),
            refcount_cache_size: Some(CACHE_BUDGET / 2),
            ..CacheOptions::default()
        })
}

fn poke(path: &Path, at: u64, bytes: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    std::os::unix::fs::FileExt::write_at(&f, bytes, at).unwrap();
}

fn peek_u64(path: &Path, at: u64) -> u64 {
    let f = std::fs::File::open(path).unwrap();
    let mut b = [0u8; 8];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut b, at).unwrap();
    u64::from_be_bytes(b)
}

fn peek_u32(path: &Path, at: u64) -> u32 {
    (peek_u64(path, at) >> 32) as u32
}

fn qemu_io(dir: &Path, file: &str, cmds: &[&str]) {
    common::qemu_io(dir, "qcow2", file, cmds);
}

fn create(dir: &Path, file: &str, o: &str, size: &str) {
    ok(
        "qemu-img create",
        &qemu_img(dir, &["create", "-q", "-f", "qcow2", "-o", o, file, size]),
    );
}

/// Whether qemu-img info says the image is marked corrupt.
fn marked_corrupt(dir: &Path, file: &str) -> bool {
    let o = qemu_img(dir, &["info", "-U", "--output=json", file]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
    v["format-specific"]["data"]["corrupt"] == serde_json::Value::Bool(true)
}

/// The error text of `r`, which must be an error.
fn err_text<T: std::fmt::Debug>(r: qimg::Result<T>, what: &str) -> String {
    match r {
        Ok(v) => panic!("{what}: expected an error, got {v:?}"),
        Err(e) => e.to_string(),
    }
}

fn assert_mentions(text: &str, words: &[&str]) {
    for w in words {
        assert!(text.contains(w), "error {text:?} does not mention {w:?}");
    }
}

/// First L2 table offset (from L1 entry 0) of an image.
fn l2_of_first_cluster(path: &Path) -> u64 {
    let l1 = peek_u64(path, 40);
    peek_u64(path, l1) & 0x00ff_ffff_ffff_fe00
}

#[test]
fn refcount_table_overlapping_the_l1_table() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("overlap-rt-l1");
    create(&dir.0, "a.qcow2", "cluster_size=64k", "64M");
    qemu_io(&dir.0, "a.qcow2", &["write -P 7 0 64k"]);
    let p = dir.path("a.qcow2");
    let l1 = peek_u64(&p, 40);
    poke(&p, 48, &l1.to_be_bytes());
    let before = std::fs::read(&p).unwrap();
    bounded(async {
        // Read-only: reads still work (the data path does not touch refcounts).
        let img = opts(false).open(&p).await.unwrap();
        let mut buf = vec![0u8; 65536];
        img.read(&mut buf, 0).await.unwrap();
        assert!(buf.iter().all(|&b| b == 7));
        // The read-only handle's image lock would keep the writer out: close it first
        // (close releases the locks at once; a drop only when the last I/O lets go).
        img.close().await.unwrap();
        // Read-write, it opens as in QEMU; the first write that needs the refcounts fails
        // and changes nothing (QEMU's fails with EIO too).
        let img = opts(true).open(&p).await.unwrap();
        img.read(&mut buf, 0).await.unwrap();
        assert!(buf.iter().all(|&b| b == 7));
        assert!(img.write(&[1u8; 4096], 1 << 20).await.is_err());
        let _ = img.close().await;
    });
    let after = std::fs::read(&p).unwrap();
    assert_eq!(before[..72], after[..72], "only the corrupt bit may change");
    assert_eq!(before[80..], after[80..]);
}

#[test]
fn l1_table_past_the_end_of_the_file() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("l1-past-end");
    create(&dir.0, "a.qcow2", "cluster_size=64k", "1G");
    let p = dir.path("a.qcow2");
    poke(&p, 40, &(1u64 << 40).to_be_bytes());
    bounded(async {
        for w in [false, true] {
            let text = err_text(opts(w).open(&p).await, "open");
            assert_mentions(&text, &["L1 table", "0x10000000000"]);
        }
    });
}

#[test]
fn l2_table_past_the_end_of_the_file() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("l2-past-end");
    create(&dir.0, "a.qcow2", "cluster_size=64k", "64M");
    qemu_io(&dir.0, "a.qcow2", &["write -P 7 0 64k"]);
    let p = dir.path("a.qcow2");
    let l1 = peek_u64(&p, 40);
    let far = (1u64 << 40) | (1 << 63);
    poke(&p, l1, &far.to_be_bytes());
    bounded(async {
        // Read-only, the table past the end reads as zeros, as in QEMU (qemu-io -r reads
        // zeros there, qemu-img convert copies zeros).
        let img = opts(false).open(&p).await.unwrap();
        let mut buf = vec![1u8; 4096];
        img.read(&mut buf, 0).await.unwrap();
        assert!(buf.iter().all(|&b| b == 0));
        img.close().await.unwrap();
        // Writing would need that table: refused, and the image marked corrupt (QEMU would
        // write a table 1 TiB into the file).
        let img = opts(true).open(&p).await.unwrap();
        let text = err_text(img.write(&buf, 0).await, "write");
        assert_mentions(&text, &["L2 table", "0x10000000000", "marked corrupt"]);
        // Marked: every later write is refused up front.
        let text = err_text(img.write(&buf, 32 << 20).await, "second write");
        assert_mentions(&text, &["marked corrupt"]);
    });
    assert!(marked_corrupt(&dir.0, "a.qcow2"));
    // And a corrupt-marked image is refused read-write until repaired.
    bounded(async {
        let text = err_text(opts(true).open(&p).await, "reopen");
        assert!(text.contains("corrupt"), "{text}");
    });
}

#[test]
fn l1_size_in_the_billions() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("l1-huge");
    create(&dir.0, "a.qcow2", "cluster_size=64k", "64M");
    let p = dir.path("a.qcow2");
    poke(&p, 36, &3_000_000_000u32.to_be_bytes());
    bounded(async {
        for w in [false, true] {
            let text = err_text(opts(w).open(&p).await, "open");
            assert_mentions(&text, &["l1_size", "3000000000"]);
        }
    });
}

#[test]
fn backing_chain_that_loops() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("loop");
    create(&dir.0, "a.qcow2", "cluster_size=64k", "64M");
    ok(
        "create b",
        &qemu_img(
            &dir.0,
            &[
                "create", "-q", "-f", "qcow2", "-b", "a.qcow2", "-F", "qcow2", "b.qcow2",
            ],
        ),
    );
    ok(
        "rebase a onto b",
        &qemu_img(
            &dir.0,
            &["rebase", "-u", "-b", "b.qcow2", "-F", "qcow2", "a.qcow2"],
        ),
    );
    bounded(async {
        let text = err_text(opts(false).open(dir.path("b.qcow2")).await, "open");
        assert_mentions(&text, &["loops", "b.qcow2"]);
    });
}

#[test]
fn backing_names_that_escape_are_refused_when_names_are_confined() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("escape");
    std::fs::create_dir(dir.path("sub")).unwrap();
    std::fs::create_dir(dir.path("sub/x")).unwrap();
    std::fs::write(dir.path("secret.raw"), vec![0x5au8; 65536]).unwrap();
    let abs = dir.path("secret.raw").display().to_string();
    for (file, backing) in [
        ("sub/dotdot.qcow2", "../secret.raw"),
        ("sub/abs.qcow2", abs.as_str()),
        ("sub/nested.qcow2", "x/../../secret.raw"),
    ] {
        ok(
            "create",
            &qemu_img(
                &dir.0,
                &[
                    "create", "-q", "-f", "qcow2", "-u", "-b", backing, "-F", "raw", file, "64k",
                ],
            ),
        );
    }
    ok(
        "create inside",
        &qemu_img(
            &dir.0,
            &["create", "-q", "-f", "raw", "sub/inside.raw", "64k"],
        ),
    );
    ok(
        "create fine",
        &qemu_img(
            &dir.0,
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-b",
                "inside.raw",
                "-F",
                "raw",
                "sub/fine.qcow2",
            ],
        ),
    );
    let confined = opts(false).trust(qimg::Trust::untrusted());
    bounded(async {
        for file in ["sub/dotdot.qcow2", "sub/abs.qcow2", "sub/nested.qcow2"] {
            let p = dir.path(file);
            // Trusted by default, as QEMU: the guest sees the file.
            let img = opts(false).open(&p).await.unwrap();
            let mut buf = vec![0u8; 512];
            img.read(&mut buf, 0).await.unwrap();
            assert_eq!(buf[0], 0x5a, "{file}");
            let text = err_text(confined.open(&p).await, file);
            assert_mentions(
                &text,
                &["backing file name", "secret.raw", "Trust::Untrusted"],
            );
        }
        // A name inside the image's directory is fine either way.
        confined.open(dir.path("sub/fine.qcow2")).await.unwrap();
    });
}

#[test]
fn an_l2_table_named_twice_stays_guarded_after_one_entry_unshares_it() {
    qimg_testkit::require_qemu!();
    // 64 KiB clusters: one L1 entry covers 512 MiB, so a 1 GiB image has two. Entry 1 is made
    // to name entry 0's L2 table without the COPIED flag (refcount stays 1): a damaged image.
    let dir = Scratch::new("l2-named-twice");
    create(&dir.0, "t.qcow2", "cluster_size=64k", "1G");
    qemu_io(&dir.0, "t.qcow2", &["write -P 0x5a 0 64k"]);
    let p = dir.path("t.qcow2");
    let l1 = peek_u64(&p, 40);
    let table = l2_of_first_cluster(&p);
    poke(&p, l1 + 8, &table.to_be_bytes());
    bounded(async {
        let img = opts(true).open(&p).await.unwrap();
        // A write through entry 1 copies the shared table (before its data, QEMU's order) and
        // drops one reference to it: its refcount falls to 0 although entry 0 still uses it.
        // The data cluster then goes to the lowest free cluster, once the frees are flushed:
        // the table entry 0 still uses, with this write or a later one. The overlap index
        // must still know it as an active L2 table.
        let mut refused = None;
        if let Err(e) = img.write(&[1u8; 4096], (512 << 20) + (5 << 16)).await {
            refused = Some(e.to_string());
        } else {
            img.flush().await.unwrap();
            for i in 1..8u64 {
                if let Err(e) = img.write(&[2u8; 4096], i << 20).await {
                    refused = Some(e.to_string());
                    break;
                }
            }
        }
        let text = refused.expect("a data write landed on a live L2 table");
        assert_mentions(&text, &["overlap", "active L2 table"]);
        // The image is unusable from now on (as QEMU's): read it again read-only.
        let mut buf = vec![0u8; 65536];
        assert!(matches!(
            img.read(&mut buf, 0).await,
            Err(Error::Unusable { .. })
        ));
        img.close().await.unwrap();
        let ro = opts(false).open(&p).await.unwrap();
        ro.read(&mut buf, 0).await.unwrap();
        assert!(
            buf.iter().all(|&b| b == 0x5a),
            "guest data under entry 0 changed"
        );
    });
    assert!(marked_corrupt(&dir.0, "t.qcow2"));
}

#[test]
fn untrusted_limits_bound_the_chain_depth_and_the_l1_table() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("untrusted-limits");
    create(&dir.0, "c0.qcow2", "cluster_size=64k", "1G");
    for i in 1..=3 {
        let (below, file) = (format!("c{}.qcow2", i - 1), format!("c{i}.qcow2"));
        ok(
            "create overlay",
            &qemu_img(
                &dir.0,
                &[
                    "create", "-q", "-f", "qcow2", "-b", &below, "-F", "qcow2", &file,
                ],
            ),
        );
    }
    let top = dir.path("c3.qcow2");
    let limits = |max_chain_depth, max_l1_bytes| {
        opts(false).trust(qimg::Trust::Untrusted(qimg::UntrustedLimits {
            max_chain_depth,
            max_l1_bytes,
        }))
    };
    bounded(async {
        // Three images below the top: a limit of 3 opens it, 2 refuses it.
        limits(3, 1 << 20).open(&top).await.unwrap();
        let text = err_text(limits(2, 1 << 20).open(&top).await, "depth 2");
        assert_mentions(&text, &["backing chain deeper than 2"]);
        // 1 GiB with 64 KiB clusters: 2 L1 entries, 16 bytes. The limit holds for every image
        // of the chain, the base included.
        limits(16, 16).open(&top).await.unwrap();
        let text = err_text(limits(16, 8).open(&top).await, "l1 8 bytes");
        assert_mentions(&text, &["L1 table of 2 entries", "max_l1_bytes", "c"]);
        // Trusted (the default), neither limit applies.
        opts(false).open(&top).await.unwrap();
        assert_eq!(
            qimg::UntrustedLimits::default(),
            qimg::UntrustedLimits {
                max_chain_depth: 16,
                max_l1_bytes: 8 << 20
            }
        );
    });
}

#[test]
fn cluster_bits_out_of_range() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("cluster-bits");
    create(&dir.0, "a.qcow2", "cluster_size=64k", "64M");
    let p = dir.path("a.qcow2");
    for bits in [0u32, 8, 22, 63, u32::MAX] {
        poke(&p, 20, &bits.to_be_bytes());
        bounded(async {
            let text = err_text(opts(false).open(&p).await, "open");
            assert_mentions(&text, &["cluster_bits", &bits.to_string()]);
        });
    }
}

/// An image of compressed clusters (4 KiB clusters so that one L2 table covers it all).
fn compressed_image(dir: &Path, ctype: &str) -> std::path::PathBuf {
    let data: Vec<u8> = (0..256 * 1024u32)
        .map(|i| b"compressible text "[(i % 18) as usize])
        .collect();
    std::fs::write(dir.join("src.raw"), &data).unwrap();
    let o = format!("cluster_size=4k,compression_type={ctype}");
    ok(
        "convert -c",
        &qemu_img(
            dir,
            &[
                "convert", "-c", "-f", "raw", "-O", "qcow2", "-o", &o, "src.raw", "c.qcow2",
            ],
        ),
    );
    dir.join("c.qcow2")
}

#[test]
fn compressed_descriptor_past_the_end() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("compressed-past-end");
    let p = compressed_image(&dir.0, "zlib");
    let l2 = l2_of_first_cluster(&p);
    let d = peek_u64(&p, l2);
    assert_eq!(d >> 62, 1, "entry 0 is compressed: {d:#x}");
    // cluster_bits 12: the offset field is bits 0..58; keep the sector count above it.
    let offset_bits = 62 - (12 - 8);
    let far = 1u64 << 40;
    let e = (d & !((1u64 << offset_bits) - 1)) | far;
    poke(&p, l2, &e.to_be_bytes());
    bounded(async {
        let img = opts(false).open(&p).await.unwrap();
        let mut buf = vec![0u8; 4096];
        let text = err_text(img.read(&mut buf, 0).await, "read");
        assert_mentions(&text, &["compressed", "0x10000000000"]);
        // The next cluster is intact.
        img.read(&mut buf, 4096).await.unwrap();
    });
}

#[test]
fn compressed_cluster_that_inflates_beyond_the_cluster_size() {
    qimg_testkit::require_qemu!();
    for (ctype, kind) in [
        ("zlib", qimg::format::header::CompressionType::Zlib),
        ("zstd", qimg::format::header::CompressionType::Zstd),
    ] {
        let dir = Scratch::new("inflate-beyond");
        let p = compressed_image(&dir.0, ctype);
        // 16 KiB of data compressed as one "cluster" of a 4 KiB-cluster image.
        let big: Vec<u8> = (0..16384u32).map(|i| (i / 97) as u8).collect();
        let packed = qimg::engine::compress(kind, &big, big.len()).unwrap();
        let len = std::fs::metadata(&p).unwrap().len();
        let at = len.div_ceil(4096) * 4096;
        poke(&p, at, &packed);
        let desc = qimg::format::compressed::CompressedDescriptor::new(at, packed.len() as u64, 12)
            .unwrap();
        let l2 = l2_of_first_cluster(&p);
        poke(&p, l2, &((1u64 << 62) | desc.encode()).to_be_bytes());
        bounded(async {
            let img = opts(false).open(&p).await.unwrap();
            let mut buf = vec![0u8; 4096];
            let text = err_text(img.read(&mut buf, 0).await, ctype);
            assert_mentions(&text, &["beyond the cluster size", "4096"]);
        });
    }
}

#[test]
fn extended_l2_entries_with_invalid_bit_combinations() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("ext-bits");
    create(&dir.0, "a.qcow2", "extended_l2=on,cluster_size=64k", "64M");
    qemu_io(&dir.0, "a.qcow2", &["write -P 7 0 8k"]);
    let p = dir.path("a.qcow2");
    let l2 = l2_of_first_cluster(&p);
    // Subcluster 0 both allocated and zero.
    let bitmap = peek_u64(&p, l2 + 8) | (1 << 32);
    poke(&p, l2 + 8, &bitmap.to_be_bytes());
    bounded(async {
        let img = opts(false).open(&p).await.unwrap();
        let mut buf = vec![0u8; 4096];
        let text = err_text(img.read(&mut buf, 0).await, "read");
        assert_mentions(&text, &[&format!("{l2:#x}")]);
        img.close().await.unwrap();
        let img = opts(true).open(&p).await.unwrap();
        let text = err_text(img.read(&mut buf, 0).await, "read-write read");
        assert_mentions(&text, &["marked corrupt"]);
    });
    assert!(marked_corrupt(&dir.0, "a.qcow2"));
}

#[test]
fn snapshot_tables_with_absurd_counts() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("snapshots");
    create(&dir.0, "a.qcow2", "cluster_size=64k", "64M");
    ok(
        "snapshot",
        &qemu_img(&dir.0, &["snapshot", "-c", "s1", "a.qcow2"]),
    );
    let p = dir.path("a.qcow2");
    assert_eq!(peek_u32(&p, 60), 1);
    for (count, words) in [
        (u32::MAX, vec!["nb_snapshots", "4294967295"]),
        (65536, vec!["snapshot"]),
    ] {
        poke(&p, 60, &count.to_be_bytes());
        bounded(async {
            let text = err_text(opts(true).open(&p).await, "read-write open");
            assert_mentions(&text, &words);
        });
    }
}

#[test]
fn a_write_that_would_land_on_metadata_is_refused_and_marks_the_image_corrupt() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("overlap-write");
    create(&dir.0, "a.qcow2", "cluster_size=64k", "64M");
    qemu_io(&dir.0, "a.qcow2", &["write -P 7 0 64k"]);
    let p = dir.path("a.qcow2");
    let l1 = peek_u64(&p, 40);
    let l2 = l2_of_first_cluster(&p);
    // Guest cluster 0 now claims to live on the L1 table's cluster.
    poke(&p, l2, &(l1 | (1 << 63)).to_be_bytes());
    let l1_before = std::fs::read(&p).unwrap()[l1 as usize..l1 as usize + 65536].to_vec();
    bounded(async {
        let img = opts(true).open(&p).await.unwrap();
        let text = err_text(img.write(&[1u8; 4096], 0).await, "write");
        assert_mentions(
            &text,
            &[
                "metadata overlap",
                "guest data",
                "active L1 table",
                "marked corrupt",
            ],
        );
        assert!(matches!(
            img.write(&[1u8; 4096], 1 << 20).await,
            Err(Error::Unusable { .. })
        ));
        let _ = img.close().await;
    });
    let l1_after = std::fs::read(&p).unwrap()[l1 as usize..l1 as usize + 65536].to_vec();
    assert_eq!(l1_before, l1_after, "the L1 table was overwritten");
    assert!(marked_corrupt(&dir.0, "a.qcow2"));
}

#[test]
fn an_allocation_steered_onto_an_l2_table_by_a_bad_refcount_is_refused() {
    qimg_testkit::require_qemu!();
    let dir = Scratch::new("overlap-alloc");
    create(&dir.0, "a.qcow2", "cluster_size=64k", "64M");
    qemu_io(&dir.0, "a.qcow2", &["write -P 7 0 64k"]);
    let p = dir.path("a.qcow2");
    let l2 = l2_of_first_cluster(&p);
    // The refcount of the L2 table's cluster drops to zero: it looks free.
    let rt = peek_u64(&p, 48);
    let block = peek_u64(&p, rt);
    poke(&p, block + (l2 / 65536) * 2, &0u16.to_be_bytes());
    let table_before = std::fs::read(&p).unwrap()[l2 as usize..l2 as usize + 65536].to_vec();
    bounded(async {
        let img = opts(true).open(&p).await.unwrap();
        // A write elsewhere in the same L2 table allocates a data cluster.
        let text = err_text(img.write(&[1u8; 4096], 1 << 20).await, "write");
        assert_mentions(
            &text,
            &["metadata overlap", "active L2 table", "marked corrupt"],
        );
        let _ = img.close().await;
    });
    let table_after = std::fs::read(&p).unwrap()[l2 as usize..l2 as usize + 65536].to_vec();
    assert_eq!(table_before, table_after, "the L2 table was overwritten");
    assert!(marked_corrupt(&dir.0, "a.qcow2"));
    // qimg check -r all repairs it and clears the mark; qemu-img then finds it clean.
    let o = qimg::tools::check::CheckOptions {
        repair: Some(qimg::tools::check::Repair::All),
        ..Default::default()
    };
    qimg::tools::check::check(&p, &o, &mut |_| {}).unwrap();
    assert!(!marked_corrupt(&dir.0, "a.qcow2"));
    ok("qemu-img check", &qemu_img(&dir.0, &["check", "a.qcow2"]));
}

//! The model test: random sequences of unaligned writes, write-zeroes, discards, flushes and
//! reopens against a flat byte model, over every image shape that matters (extended L2 on and
//! off, cluster sizes 4 KiB to 2 MiB, refcount widths 1 to 64 bits, version 2 and 3, no
//! backing file / raw / qcow2 backing shorter than the overlay, caches small enough to evict).
//! Every read must equal the model; after each sequence `qemu-img check` must find no
//! corruption and no leak, and `qemu-img compare` must find the image equal to the model.

mod common;

use common::Scratch;
use common::engine::*;
use proptest::prelude::*;
use qimg::{Allocation, CacheOptions, OpenOptions};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BackingKind {
    None,
    Raw,
    Qcow2,
}

#[derive(Debug, Clone)]
struct Shape {
    cluster_bits: u32,
    extended: bool,
    refcount_bits: u32,
    v2: bool,
    backing: BackingKind,
    small_cache: bool,
    sparse: bool,
    lazy: bool,
}

impl Shape {
    fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    fn subcluster_size(&self) -> u64 {
        if self.extended {
            self.cluster_size() / 32
        } else {
            self.cluster_size()
        }
    }

    /// Six and a half clusters, at least 3 MiB (so that small clusters span L2 tables), and
    /// never a multiple of the cluster size: the last cluster is partial.
    fn size(&self) -> u64 {
        let cs = self.cluster_size();
        (6 * cs + cs / 2).max(3 * 1024 * 1024 + cs / 2)
    }

    fn create_opts(&self) -> String {
        let mut o = format!(
            "cluster_size={},refcount_bits={}",
            self.cluster_size(),
            self.refcount_bits
        );
        if self.extended {
            o.push_str(",extended_l2=on");
        }
        if self.v2 {
            o.push_str(",compat=0.10");
        }
        if self.lazy {
            o.push_str(",lazy_refcounts=on");
        }
        o
    }
}

fn shape() -> impl Strategy<Value = Shape> {
    (
        prop_oneof![Just(12u32), Just(14), Just(16), Just(17), Just(21)],
        any::<bool>(),
        prop_oneof![Just(1u32), Just(4), Just(16), Just(64)],
        any::<u8>(),
        prop_oneof![
            Just(BackingKind::None),
            Just(BackingKind::Raw),
            Just(BackingKind::Qcow2)
        ],
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(cluster_bits, ext, refcount_bits, flavour, backing, small_cache, sparse)| {
                // Extended L2 needs clusters of at least 16 KiB; version 2 has neither extended
                // L2, other refcount widths nor lazy refcounts.
                let extended = ext && cluster_bits >= 14;
                let v2 = flavour % 5 == 0 && !extended;
                let lazy = flavour % 3 == 0 && !v2;
                Shape {
                    cluster_bits,
                    extended,
                    refcount_bits: if v2 { 16 } else { refcount_bits },
                    v2,
                    backing,
                    small_cache,
                    sparse,
                    lazy,
                }
            },
        )
}

#[derive(Debug, Clone)]
enum Op {
    Write { at: u64, len: u64, seed: u64 },
    Zero { at: u64, len: u64 },
    Discard { at: u64, len: u64 },
    Read { at: u64, len: u64 },
    Flush,
    Reopen,
}

/// Ranges in units of the shape's geometry: a start and length expressed as fractions that
/// are scaled later, biased toward (sub)cluster boundaries.
#[derive(Debug, Clone)]
struct RawOp {
    kind: u8,
    start: (u8, u16, u16),
    len: (u8, u16),
    seed: u64,
}

fn raw_op() -> impl Strategy<Value = RawOp> {
    (
        any::<u8>(),
        (any::<u8>(), any::<u16>(), any::<u16>()),
        (any::<u8>(), any::<u16>()),
        any::<u64>(),
    )
        .prop_map(|(kind, start, len, seed)| RawOp {
            kind,
            start,
            len,
            seed,
        })
}

fn scale(shape: &Shape, r: &RawOp) -> Op {
    let size = shape.size();
    let scs = shape.subcluster_size();
    let sub_count = size.div_ceil(scs);
    // Start: a subcluster, then an offset inside it that is often 0 or 512-aligned.
    let sc = u64::from(r.start.1) % sub_count;
    let within = match r.start.0 % 4 {
        0 => 0,
        1 => (u64::from(r.start.2) * 512) % scs,
        _ => u64::from(r.start.2) % scs,
    };
    let at = (sc * scs + within).min(size - 1);
    let len = match r.len.0 % 5 {
        0 => scs,
        1 => scs * (1 + u64::from(r.len.1) % 40),
        2 => 1 + u64::from(r.len.1) % 4096,
        _ => 1 + u64::from(r.len.1) * 97 % (3 * shape.cluster_size()),
    };
    let len = len.min(size - at).max(1);
    match r.kind % 16 {
        0..=5 => Op::Write {
            at,
            len,
            seed: r.seed,
        },
        6..=7 => Op::Zero { at, len },
        8..=10 => Op::Discard { at, len },
        11..=12 => Op::Read { at, len },
        13..=14 => Op::Flush,
        _ => Op::Reopen,
    }
}

struct World {
    dir: Scratch,
    shape: Shape,
    backing: Vec<u8>,
    model: Vec<u8>,
}

impl World {
    fn new(shape: Shape) -> Self {
        let dir = Scratch::new("model");
        let size = shape.size();
        // The backing file is shorter than the overlay: its tail reads as zeros.
        let bsize = (size * 2 / 3) / 512 * 512;
        let backing = match shape.backing {
            BackingKind::None => Vec::new(),
            _ => pattern(0xBAC4, 0, bsize as usize),
        };
        match shape.backing {
            BackingKind::None => qemu_create(&dir.0, "img.qcow2", &shape.create_opts(), size, None),
            BackingKind::Raw => {
                std::fs::write(dir.path("base.raw"), &backing).unwrap();
                qemu_create(
                    &dir.0,
                    "img.qcow2",
                    &shape.create_opts(),
                    size,
                    Some(("base.raw", "raw")),
                );
            }
            BackingKind::Qcow2 => {
                std::fs::write(dir.path("base.raw"), &backing).unwrap();
                common::ok(
                    "qemu-img convert",
                    &common::qemu_img(
                        &dir.0,
                        &[
                            "convert",
                            "-f",
                            "raw",
                            "-O",
                            "qcow2",
                            "base.raw",
                            "base.qcow2",
                        ],
                    ),
                );
                std::fs::remove_file(dir.path("base.raw")).unwrap();
                qemu_create(
                    &dir.0,
                    "img.qcow2",
                    &shape.create_opts(),
                    size,
                    Some(("base.qcow2", "qcow2")),
                );
            }
        }
        let mut model = vec![0u8; size as usize];
        model[..backing.len()].copy_from_slice(&backing);
        Self {
            dir,
            shape,
            backing,
            model,
        }
    }

    fn opts(&self) -> OpenOptions {
        let mut o = OpenOptions::new().writable(true);
        if self.shape.small_cache {
            // Two 512-byte L2 slices and four refcount blocks: constant eviction.
            o = o.cache(CacheOptions {
                l2_cache_size: Some(1024),
                l2_cache_entry_size: Some(512),
                refcount_cache_size: Some(4 * self.shape.cluster_size()),
                ..CacheOptions::default()
            });
        }
        if self.shape.sparse {
            o = o.allocation(Allocation::Sparse);
        }
        o
    }

    fn backing_byte(&self, at: u64) -> u8 {
        self.backing.get(at as usize).copied().unwrap_or(0)
    }

    /// What a discard of `[at, at+len)` does to the model: whole subclusters (the last one
    /// counting as whole when the range reaches the end of the disk) fall through to the
    /// backing file.
    fn discard_model(&mut self, at: u64, len: u64) {
        let scs = self.shape.subcluster_size();
        let size = self.shape.size();
        let end = at + len;
        let mut sc = at.div_ceil(scs);
        while sc * scs < size {
            let s = sc * scs;
            let e = (s + scs).min(size);
            if e > end {
                break;
            }
            for b in s..e {
                self.model[b as usize] = self.backing_byte(b);
            }
            sc += 1;
        }
    }
}

async fn run(shape: Shape, raw: Vec<RawOp>) -> Result<(), TestCaseError> {
    let mut w = World::new(shape);
    let path = w.dir.path("img.qcow2");
    let what = format!("{:?}", w.shape);
    let mut img = w.opts().open(&path).await.map_err(fail)?;
    for r in &raw {
        let op = scale(&w.shape, r);
        match op {
            Op::Write { at, len, seed } => {
                let data = pattern(seed, at, len as usize);
                img.write(&data, at).await.map_err(|e| fail_op(&op, e))?;
                w.model[at as usize..(at + len) as usize].copy_from_slice(&data);
            }
            Op::Zero { at, len } => {
                img.write_zeroes(at, len)
                    .await
                    .map_err(|e| fail_op(&op, e))?;
                w.model[at as usize..(at + len) as usize].fill(0);
            }
            Op::Discard { at, len } => {
                img.discard(at, len).await.map_err(|e| fail_op(&op, e))?;
                w.discard_model(at, len);
            }
            Op::Read { at, len } => {
                let mut buf = vec![0u8; len as usize];
                img.read(&mut buf, at).await.map_err(|e| fail_op(&op, e))?;
                prop_assert!(
                    buf == w.model[at as usize..(at + len) as usize],
                    "{what}: read {at:#x}+{len:#x} differs from the model"
                );
            }
            Op::Flush => img.flush().await.map_err(|e| fail_op(&op, e))?,
            Op::Reopen => {
                img.close().await.map_err(|e| fail_op(&op, e))?;
                img = w.opts().open(&path).await.map_err(fail)?;
            }
        }
    }
    let mut all = vec![0u8; w.model.len()];
    img.read(&mut all, 0).await.map_err(fail)?;
    if let Some(i) = all.iter().zip(&w.model).position(|(a, b)| a != b) {
        return Err(TestCaseError::fail(format!(
            "{what}: full read differs from the model first at {i:#x}"
        )));
    }
    img.close().await.map_err(fail)?;
    drop(img);
    assert_clean(&w.dir.0, "img.qcow2", &what);
    assert_same_as_model(&w.dir.0, "img.qcow2", &w.model, &what);
    Ok(())
}

fn fail(e: qimg::Error) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

fn fail_op(op: &Op, e: qimg::Error) -> TestCaseError {
    TestCaseError::fail(format!("{op:?}: {e}"))
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("QIMG_MODEL_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(48),
        max_shrink_iters: 64,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_operations_match_a_flat_model(shape in shape(), ops in prop::collection::vec(raw_op(), 1..40)) {
        if !common::have_qemu("random_operations_match_a_flat_model") {
            return Ok(());
        }
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        rt.block_on(run(shape, ops))?;
    }
}

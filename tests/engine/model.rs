//! The model test: random sequences of unaligned writes, write-zeroes, discards, flushes and
//! reopens against a flat byte model, over every image shape that matters (extended L2 on and
//! off, cluster sizes 4 KiB to 2 MiB, refcount widths 1 to 64 bits, version 2 and 3, no
//! backing file / raw / qcow2 backing shorter than the overlay, caches small enough to evict).
//! Every read must equal the model; after each sequence `qemu-img check` must find no
//! corruption and no leak, and `qemu-img compare` must find the image equal to the model.
//! Half the version 3 shapes carry two enabled persistent dirty bitmaps and a disabled one:
//! after the sequence (stored at every reopen and at the close) each enabled one holds
//! exactly the granules the writes, write-zeroes and discards touched, the disabled one
//! nothing, and `qemu-img info` lists them consistent.

use crate::common;

use common::*;
use proptest::prelude::*;
use qimg::{Allocation, CacheOptions, OpenOptions};
use qimg_testkit::model::{Geometry, GuestModel, GuestOp, OpCode};
use qimg_testkit::pattern::{first_difference, pattern};

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
    /// Two enabled persistent bitmaps (512 B and the default granularity) and a disabled
    /// one, added at the first open: every write, write-zeroes and discard must be in the
    /// enabled ones, nothing else, across reopens.
    bitmaps: bool,
}

impl Shape {
    fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    fn geometry(&self) -> Geometry {
        Geometry::new(self.size(), self.cluster_size(), self.extended)
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
                let bitmaps = flavour % 4 < 2 && !v2;
                Shape {
                    cluster_bits,
                    extended,
                    refcount_bits: if v2 { 16 } else { refcount_bits },
                    v2,
                    backing,
                    small_cache,
                    sparse,
                    lazy,
                    bitmaps,
                }
            },
        )
}

/// A request before it is scaled to a shape's geometry (see [`GuestOp::decode`]): a start
/// and length expressed as fractions that are scaled later, biased toward (sub)cluster
/// boundaries.
fn op_code() -> impl Strategy<Value = OpCode> {
    (
        any::<u8>(),
        (any::<u8>(), any::<u16>(), any::<u16>()),
        (any::<u8>(), any::<u16>()),
        any::<u64>(),
    )
        .prop_map(
            |(kind, (start_mode, subcluster, within), (len_mode, len), seed)| OpCode {
                kind,
                start_mode,
                subcluster,
                within,
                len_mode,
                len,
                seed,
            },
        )
}

struct World {
    dir: Scratch,
    shape: Shape,
    model: GuestModel,
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
        let backing_file = match shape.backing {
            BackingKind::None => None,
            BackingKind::Raw => Some((make_backing_file(&dir.0, &backing, "raw"), "raw")),
            BackingKind::Qcow2 => Some((make_backing_file(&dir.0, &backing, "qcow2"), "qcow2")),
        };
        qemu_create(
            &dir.0,
            "img.qcow2",
            &shape.create_opts(),
            size,
            backing_file,
        );
        let model = GuestModel::new(size, backing, shape.geometry().subcluster_size);
        Self { dir, shape, model }
    }

    fn opts(&self) -> OpenOptions {
        let mut o = OpenOptions::new().writable(true);
        if self.shape.small_cache {
            // Two 512-byte L2 slices and four refcount blocks in 512-byte slices: constant
            // eviction, and refcount blocks of several slices.
            o = o.cache(CacheOptions {
                l2_cache_size: Some(1024),
                l2_cache_entry_size: Some(512),
                refcount_cache_size: Some(4 * self.shape.cluster_size()),
                refcount_cache_entry_size: Some(512),
                ..CacheOptions::default()
            });
        }
        if self.shape.sparse {
            o = o.allocation(Allocation::Sparse);
        }
        o
    }
}

async fn run(shape: Shape, codes: Vec<OpCode>) -> Result<(), TestCaseError> {
    let mut w = World::new(shape);
    let path = w.dir.path("img.qcow2");
    let what = format!("{:?}", w.shape);
    let mut img = w.opts().open(&path).await.map_err(fail)?;
    let geometry = w.shape.geometry();
    // Every range a write, write-zeroes or discard touched (what the bitmaps must hold).
    let mut touched: Vec<(u64, u64)> = Vec::new();
    if w.shape.bitmaps {
        for (name, g, on) in BITMAPS {
            img.add_bitmap(name, g, on).map_err(fail)?;
        }
    }
    for code in &codes {
        let op = GuestOp::decode(code, &geometry);
        if let Some(r) = op.range().filter(|_| !matches!(op, GuestOp::Read { .. })) {
            touched.push(r);
        }
        match op {
            GuestOp::Write { at, len, seed } => {
                let data = pattern(seed, at, len as usize);
                img.write(&data, at).await.map_err(|e| fail_op(&op, e))?;
                w.model.write(at, &data);
            }
            GuestOp::Zero { at, len } => {
                img.write_zeroes(at, len)
                    .await
                    .map_err(|e| fail_op(&op, e))?;
                w.model.write_zeroes(at, len);
            }
            GuestOp::Discard { at, len } => {
                img.discard(at, len).await.map_err(|e| fail_op(&op, e))?;
                w.model.discard(at, len);
            }
            GuestOp::Read { at, len } => {
                let mut buf = vec![0u8; len as usize];
                img.read(&mut buf, at).await.map_err(|e| fail_op(&op, e))?;
                prop_assert!(
                    buf == w.model.read(at, len),
                    "{what}: read {at:#x}+{len:#x} differs from the model"
                );
            }
            GuestOp::Flush => img.flush().await.map_err(|e| fail_op(&op, e))?,
            // `decode` makes no Close; it would end the sequence like a reopen does.
            GuestOp::Reopen | GuestOp::Close => {
                img.close().await.map_err(|e| fail_op(&op, e))?;
                img = w.opts().open(&path).await.map_err(fail)?;
            }
        }
    }
    let mut all = vec![0u8; w.model.data.len()];
    img.read(&mut all, 0).await.map_err(fail)?;
    if let Some(i) = first_difference(&all, &w.model.data) {
        return Err(TestCaseError::fail(format!(
            "{what}: full read differs from the model first at {i:#x}"
        )));
    }
    img.close().await.map_err(fail)?;
    drop(img);
    if w.shape.bitmaps {
        check_bitmaps(&path, w.model.data.len() as u64, &touched, &what).await?;
    }
    assert_clean(&w.dir.0, "img.qcow2", &what);
    assert_same_as_model(&w.dir.0, "img.qcow2", &w.model.data, &what);
    Ok(())
}

/// The bitmaps of a shape with bitmaps: (name, granularity, enabled).
const BITMAPS: [(&str, Option<u64>, bool); 3] = [
    ("fine", Some(512), true),
    ("default", None, true),
    ("off", Some(65536), false),
];

/// The granules of `g` bytes that `ranges` touch on a `size`-byte disk, as merged extents.
fn granules(ranges: &[(u64, u64)], g: u64, size: u64) -> Vec<(u64, u64)> {
    let mut dirty = vec![false; size.div_ceil(g) as usize];
    for &(a, b) in ranges.iter().filter(|(a, b)| a < b) {
        for i in a / g..b.div_ceil(g) {
            dirty[i as usize] = true;
        }
    }
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (i, _) in dirty.iter().enumerate().filter(|(_, d)| **d) {
        let (at, end) = (i as u64 * g, ((i as u64 + 1) * g).min(size));
        match out.last_mut() {
            Some((s, l)) if *s + *l == at => *l = end - *s,
            _ => out.push((at, end - at)),
        }
    }
    out
}

/// After the close: the bitmaps were stored consistent (qimg's read-only open and
/// `qemu-img info` agree), each enabled one holds exactly the touched granules, the disabled
/// one none.
async fn check_bitmaps(
    path: &std::path::Path,
    size: u64,
    touched: &[(u64, u64)],
    what: &str,
) -> Result<(), TestCaseError> {
    let img = OpenOptions::new().open(path).await.map_err(fail)?;
    let listed = img.bitmaps();
    prop_assert_eq!(listed.len(), BITMAPS.len(), "{}: {:?}", what, listed);
    for ((name, _, on), info) in BITMAPS.iter().zip(&listed) {
        prop_assert!(
            info.name == *name && info.enabled == *on && !info.inconsistent,
            "{}: {:?}",
            what,
            info
        );
        let bits = img.dirty_bitmap(name).await.map_err(fail)?;
        let want = if *on {
            granules(touched, bits.granularity, size)
        } else {
            Vec::new()
        };
        prop_assert_eq!(bits.extents(0, size), want, "{}: bitmap {}", what, name);
    }
    let dir = path.parent().unwrap();
    let info = qemu_img(dir, &["info", "--output=json", "img.qcow2"]);
    let json = String::from_utf8_lossy(&info.stdout).to_string();
    prop_assert!(
        info.status.success() && json.contains("\"fine\""),
        "{}: {}",
        what,
        json
    );
    prop_assert!(
        !json.contains("in-use"),
        "{}: stored in use: {}",
        what,
        json
    );
    Ok(())
}

fn fail(e: qimg::Error) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

fn fail_op(op: &GuestOp, e: qimg::Error) -> TestCaseError {
    TestCaseError::fail(format!("{op:?}: {e}"))
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("QIMG_MODEL_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(48),
        max_shrink_iters: 64,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_operations_match_a_flat_model(shape in shape(), ops in prop::collection::vec(op_code(), 1..40)) {
        if !common::have_qemu("random_operations_match_a_flat_model") {
            return Ok(());
        }
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        rt.block_on(run(shape, ops))?;
    }
}

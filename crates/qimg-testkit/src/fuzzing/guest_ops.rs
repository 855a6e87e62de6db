//! The `ops` target: a small image shaped by the input's first bytes, then guest operations
//! decoded from the rest, each checked against a model.

use super::*;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use qimg::io::MemStorage;
use qimg::tools::check::{CheckEvent, CheckOptions};
use qimg::tools::create::{Compat, CreateOptions};
use qimg::{Allocation, Backing, Image, OpenOptions};

use crate::model::{Geometry, GuestModel, GuestOp, OpCode};
use crate::pattern::{first_difference, word_pattern as pattern};

/// Most operations [`ops`] decodes from one input.
pub const MAX_OPS: usize = 64;

/// The image a sequence of [`ops`] runs on, chosen by the first two input bytes.
///
/// Byte 0: bit 0 extended L2 entries; bits 1..=2 the cluster size (4, 16, 32 or 64 KiB; 16 KiB
/// instead of 4 with extended L2); bits 3..=5 `refcount_order` (value modulo 7, i.e. 1 to 64
/// bits); bits 6..=7 the backing file (0 and 3 none, 1 raw, 2 qcow2), shorter than the disk.
/// Byte 1: bit 0 small caches (`small_cache`); bit 1 sparse allocation; bit 2 lazy
/// refcounts; bit 3 version 2 (ignored with extended L2; forces 16-bit refcounts and no lazy
/// refcounts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OpsShape {
    /// `log2` of the cluster size.
    pub cluster_bits: u32,
    /// Extended L2 entries.
    pub extended: bool,
    /// `log2` of the refcount width.
    pub refcount_order: u32,
    /// 0 none, 1 raw, 2 qcow2.
    pub backing: u8,
    /// Small caches.
    pub small_cache: bool,
    /// [`Allocation::Sparse`].
    pub sparse: bool,
    /// Lazy refcounts.
    pub lazy: bool,
    /// Version 2.
    pub v2: bool,
}

impl OpsShape {
    /// Decodes the two shape bytes.
    pub fn decode(b0: u8, b1: u8) -> Self {
        let extended = b0 & 1 != 0;
        let mut cluster_bits = [12, 14, 15, 16][usize::from(b0 >> 1 & 3)];
        if extended && cluster_bits < 14 {
            cluster_bits = 14;
        }
        let v2 = b1 & 8 != 0 && !extended;
        Self {
            cluster_bits,
            extended,
            refcount_order: if v2 { 4 } else { u32::from(b0 >> 3 & 7) % 7 },
            backing: match b0 >> 6 {
                3 => 0,
                b => b,
            },
            small_cache: b1 & 1 != 0,
            sparse: b1 & 2 != 0,
            lazy: b1 & 4 != 0 && !v2,
            v2,
        }
    }

    /// Cluster size in bytes.
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// Subcluster size in bytes (the cluster size without extended L2 entries).
    pub fn subcluster_size(&self) -> u64 {
        if self.extended {
            self.cluster_size() / 32
        } else {
            self.cluster_size()
        }
    }

    /// The virtual disk size: 2 MiB and three and a half clusters, so that 4 KiB clusters span
    /// two L2 tables and the last cluster is partial.
    pub fn size(&self) -> u64 {
        (2 << 20) + 3 * self.cluster_size() + self.cluster_size() / 2
    }

    /// The backing file size (two thirds of the disk, a multiple of 512), or 0 without one.
    pub fn backing_size(&self) -> u64 {
        if self.backing == 0 {
            0
        } else {
            self.size() * 2 / 3 / 512 * 512
        }
    }

    /// The sizes the model and the operation decoder need.
    pub fn geometry(&self) -> Geometry {
        Geometry::new(self.size(), self.cluster_size(), self.extended)
    }

    fn open_options(&self) -> OpenOptions {
        let mut o = if self.small_cache {
            small_cache(true)
        } else {
            OpenOptions::new().writable(true).clean_timer(false)
        };
        if self.sparse {
            o = o.allocation(Allocation::Sparse);
        }
        o
    }
}

/// Bytes per encoded operation of [`ops`].
pub const OP_BYTES: usize = 8;

/// Decodes one operation of [`ops`] from 8 bytes `[kind, m, s1, s0, l, n1, n0, w]` for a
/// disk of `shape`: [`GuestOp::decode`] of kind `kind`, start mode `m`, subcluster `s1s0`,
/// offset `w m` inside it, length mode `l` and length `n1n0`, with the 8 bytes as the seed of
/// a write. Never [`GuestOp::Close`].
pub fn decode_op(b: [u8; OP_BYTES], shape: &OpsShape) -> GuestOp {
    let code = OpCode {
        kind: b[0],
        start_mode: b[1],
        subcluster: u16::from_be_bytes([b[2], b[3]]),
        within: u16::from_be_bytes([b[7], b[1]]),
        len_mode: b[4],
        len: u16::from_be_bytes([b[5], b[6]]),
        seed: u64::from_le_bytes(b),
    };
    GuestOp::decode(&code, &shape.geometry())
}

/// The shape and operations `data` encodes for [`ops`] (at most [`MAX_OPS`]; a partial last
/// operation is ignored). `None` for inputs shorter than the two shape bytes.
pub fn decode_ops(data: &[u8]) -> Option<(OpsShape, Vec<GuestOp>)> {
    let [b0, b1, rest @ ..] = data else {
        return None;
    };
    let shape = OpsShape::decode(*b0, *b1);
    let ops = rest
        .chunks_exact(OP_BYTES)
        .take(MAX_OPS)
        .map(|c| decode_op(c.try_into().expect("8 bytes"), &shape))
        .collect();
    Some((shape, ops))
}

/// Runs a sequence of writes, write-zeroes, discards, reads, flushes and reopens decoded from
/// `data` (see [`decode_ops`]) on a fresh image made by [`qimg::tools::create::create`], in memory,
/// against the flat model ([`GuestModel`]), and panics on any difference.
///
/// Every operation must succeed and every read must equal the model: written bytes, zeros, or
/// for discarded subclusters (whole ones only; the last one counts as whole when the range
/// reaches the end of the disk) the backing file's bytes (zeros without one or past its end).
/// At the end the whole disk must equal the model, and after close the library
/// [`check`](qimg::tools::check::check) must report no corruption, no leak and no check error.
pub fn ops(data: &[u8]) {
    if let Some((shape, ops)) = decode_ops(data) {
        block_on(run_ops(shape, &ops));
    }
}

/// The bytes of a new image of `size` bytes made by [`qimg::tools::create::create`], cached per
/// options.
pub(super) fn template(opts: &CreateOptions) -> Vec<u8> {
    static CACHE: OnceLock<Mutex<HashMap<String, Vec<u8>>>> = OnceLock::new();
    let key = format!("{opts:?}");
    let cache = CACHE.get_or_init(Mutex::default);
    if let Some(t) = cache.lock().expect("template cache").get(&key) {
        return t.clone();
    }
    let file = ScratchFile::new(&[]);
    qimg::tools::create::create(file.path(), opts, &mut |_, _| {})
        .expect("create a template image");
    let bytes = std::fs::read(file.path()).expect("read a template image");
    cache
        .lock()
        .expect("template cache")
        .insert(key, bytes.clone());
    bytes
}

pub(super) fn create_options(shape: &OpsShape) -> CreateOptions {
    CreateOptions {
        size: Some(shape.size()),
        cluster_size: shape.cluster_size(),
        compat: if shape.v2 { Compat::V2 } else { Compat::V3 },
        extended_l2: shape.extended,
        refcount_bits: 1 << shape.refcount_order,
        lazy_refcounts: shape.lazy,
        ..CreateOptions::default()
    }
}

/// `pattern(0xBAC4, 0, size)`, the contents of every backing file of [`ops`], made once per
/// size.
pub(super) fn backing_pattern(size: u64) -> Vec<u8> {
    static CACHE: OnceLock<Mutex<HashMap<u64, Vec<u8>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Mutex::default);
    cache
        .lock()
        .expect("backing pattern cache")
        .entry(size)
        .or_insert_with(|| pattern(0xBAC4, 0, size as usize))
        .clone()
}

pub(super) struct OpsWorld {
    shape: OpsShape,
    storage: MemStorage,
    backing: Vec<u8>,
    qcow2_backing: Option<Vec<u8>>,
    model: GuestModel,
}

impl OpsWorld {
    async fn open(&self) -> Image<MemStorage> {
        let backing = match (self.shape.backing, &self.qcow2_backing) {
            (0, _) => None,
            (2, Some(bytes)) => {
                let o = OpenOptions::new().clean_timer(false);
                let s = MemStorage::from_bytes(bytes).read_only();
                let img = o
                    .open_storage(s, "base.qcow2", None, None)
                    .await
                    .expect("open the qcow2 backing image");
                Some(Backing::Qcow2(img))
            }
            _ => Some(raw_backing(&self.backing)),
        };
        self.shape
            .open_options()
            .open_storage(self.storage.clone(), "img.qcow2", backing, None)
            .await
            .unwrap_or_else(|e| panic!("{:?}: open: {e}", self.shape))
    }
}

pub(super) async fn run_ops(shape: OpsShape, ops: &[GuestOp]) {
    let what = format!("{shape:?}");
    let storage = MemStorage::from_bytes(&template(&create_options(&shape)));
    let bsize = shape.backing_size();
    let backing = backing_pattern(bsize);
    let qcow2_backing = if shape.backing == 2 {
        Some(qcow2_backing_bytes(bsize).await)
    } else {
        None
    };
    let model = GuestModel::new(shape.size(), backing.clone(), shape.subcluster_size());
    let mut w = OpsWorld {
        shape,
        storage,
        backing,
        qcow2_backing,
        model,
    };
    let mut img = w.open().await;
    for (i, op) in ops.iter().enumerate() {
        let fail = |e: qimg::Error| -> ! { panic!("{what}: op {i} {op:?}: {e}") };
        match *op {
            GuestOp::Write { at, len, seed } => {
                let data = pattern(seed, at, len as usize);
                img.write(&data, at).await.unwrap_or_else(|e| fail(e));
                w.model.write(at, &data);
            }
            GuestOp::Zero { at, len } => {
                img.write_zeroes(at, len).await.unwrap_or_else(|e| fail(e));
                w.model.write_zeroes(at, len);
            }
            GuestOp::Discard { at, len } => {
                img.discard(at, len).await.unwrap_or_else(|e| fail(e));
                w.model.discard(at, len);
            }
            GuestOp::Read { at, len } => {
                let mut buf = vec![0u8; len as usize];
                img.read(&mut buf, at).await.unwrap_or_else(|e| fail(e));
                let want = w.model.read(at, len);
                if let Some(j) = first_difference(&buf, want) {
                    panic!(
                        "{what}: op {i} {op:?}: guest byte {:#x} reads {:#x}, the model has {:#x}",
                        at + j as u64,
                        buf[j],
                        want[j]
                    );
                }
            }
            GuestOp::Flush => img.flush().await.unwrap_or_else(|e| fail(e)),
            // `decode_op` never makes a Close; treat one as a reopen all the same.
            GuestOp::Reopen | GuestOp::Close => {
                img.close().await.unwrap_or_else(|e| fail(e));
                img = w.open().await;
            }
        }
    }
    let mut all = vec![0u8; w.model.data.len()];
    img.read(&mut all, 0)
        .await
        .unwrap_or_else(|e| panic!("{what}: final read: {e}"));
    if let Some(j) = first_difference(&all, &w.model.data) {
        panic!(
            "{what}: after {} ops guest byte {j:#x} reads {:#x}, the model has {:#x}",
            ops.len(),
            all[j],
            w.model.data[j]
        );
    }
    img.close()
        .await
        .unwrap_or_else(|e| panic!("{what}: close: {e}"));
    drop(img);
    let file = ScratchFile::new(&w.storage.snapshot());
    let mut messages = Vec::new();
    let report = qimg::tools::check::check(file.path(), &CheckOptions::default(), &mut |ev| {
        if let CheckEvent::Message(m) = ev {
            messages.push(m.to_string());
        }
    })
    .unwrap_or_else(|e| panic!("{what}: check: {e}"));
    assert!(
        report.failure.is_none()
            && report.corruptions == 0
            && report.leaks == 0
            && report.check_errors == 0,
        "{what}: after {} ops check reports {report:?}: {messages:?}",
        ops.len()
    );
}

//! The metadata walker: every user that visits all of an image's metadata (`check` and its
//! repairs, the dirty-image refcount rebuild, the overlap index `check` builds) reads the
//! tables through here, over any [`Storage`], and gets `qimg-format` entries back.
//!
//! Two shapes serve the users:
//!
//! * **Table reads** ([`Walker::read_l1`], [`Walker::read_l2`], [`Walker::read_reftable`],
//!   [`Walker::read_refblock`], [`Walker::read_bitmap_table`], [`Walker::read_snapshot_entry`]
//!   and friends) return lenient entry views ([`qimg_format::lenient`]) with their file
//!   positions, for `check`, which judges and rewrites single entries of damaged images.
//! * **Reference visits** ([`Walker::visit_tree`], [`Walker::visit_snapshots`]) decode strictly
//!   and report every host range a tree references and as what ([`Reference`]), for the
//!   rebuild, which must refuse a damaged image rather than guess.
//!
//! Both count into one [`ReferenceCounts`], and refcount blocks are encoded from it by one
//! function, [`encode_refblock`], whichever rebuild writes them.
//!
//! Every table size is bounded before anything is allocated: an L1 table by
//! [`MAX_L1_BYTES`], the refcount table by [`MAX_REFTABLE_BYTES`], an L2 table or refcount
//! block by the cluster size, a snapshot table by [`MAX_TABLE_SIZE`], bitmap tables by reading
//! them in pieces.

use std::collections::{BTreeMap, HashMap};

use qimg_format::geometry::RefcountGeometry;
use qimg_format::l1::{self, L1Entry};
use qimg_format::l2::{AnyL2Entry, L2Context, L2Entry, decode_slice};
use qimg_format::lenient::{
    L2Layout, RawBitmapTableEntry, RawL1Entry, RawL2Entry, RawReftableEntry, TABLE_WORD,
    decode_words,
};
use qimg_format::refcount;
use qimg_format::snapshot::{self, ENTRY_HEADER_LEN, EntryHeader, MAX_TABLE_SIZE};
use qimg_format::validate::{MAX_L1_BYTES, MAX_REFTABLE_BYTES};
use qimg_format::{FormatError, snapshot::Snapshot};
use qimg_io::{Storage, StorageError};

/// Why a walk stopped.
#[derive(Debug)]
pub(crate) enum WalkError {
    /// Reading the image failed.
    Storage(StorageError),
    /// A strict decode refused an entry.
    Format(FormatError),
    /// A table is larger than any image may hold (the walk refuses to allocate it).
    TooLarge {
        /// What table.
        what: &'static str,
        /// Its size in bytes.
        bytes: u64,
    },
}

impl std::fmt::Display for WalkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Storage(e) => write!(f, "{e}"),
            Self::Format(e) => write!(f, "{e}"),
            Self::TooLarge { what, bytes } => write!(f, "a {what} of {bytes} bytes is too large"),
        }
    }
}

impl From<StorageError> for WalkError {
    fn from(e: StorageError) -> Self {
        Self::Storage(e)
    }
}

impl From<FormatError> for WalkError {
    fn from(e: FormatError) -> Self {
        Self::Format(e)
    }
}

/// What a referenced host range is used as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Structure {
    /// The header cluster.
    Header,
    /// An L1 table (active or a snapshot's).
    L1Table,
    /// An L2 table.
    L2Table,
    /// A guest data cluster.
    Data,
    /// Compressed guest data.
    Compressed,
    /// The snapshot table.
    SnapshotTable,
    /// The bitmap directory, a bitmap table or a bitmap data cluster.
    Bitmap,
}

/// One host range a walk found referenced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reference {
    /// What references it.
    pub(crate) structure: Structure,
    /// First byte.
    pub(crate) offset: u64,
    /// Bytes (at least 1).
    pub(crate) len: u64,
}

/// Reads an image's metadata through a [`Storage`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Walker<'a, S> {
    file: &'a S,
    layout: L2Layout,
    /// Bytes past the end of the file read as zeros (QEMU's block layer, what `check`
    /// sees) instead of failing (what the engine expects of a healthy image).
    zero_fill: bool,
}

impl<'a, S: Storage> Walker<'a, S> {
    /// A walker over `file` for tables laid out as `layout`.
    pub(crate) fn new(file: &'a S, layout: L2Layout) -> Self {
        Self {
            file,
            layout,
            zero_fill: false,
        }
    }

    /// Makes reads past the end of the file return zeros instead of failing.
    pub(crate) fn zero_fill(mut self, yes: bool) -> Self {
        self.zero_fill = yes;
        self
    }

    /// Reads `buf` at `offset`, as [`zero_fill`](Self::zero_fill) says.
    pub(crate) async fn read(&self, buf: &mut [u8], offset: u64) -> Result<(), StorageError> {
        if self.zero_fill {
            self.file.read_at_zero_fill(buf, offset).await
        } else {
            self.file.read_at(buf, offset).await
        }
    }

    /// Reads `bytes` at `offset` as 64-bit table words. The caller bounds `bytes`.
    async fn read_words(&self, offset: u64, bytes: u64) -> Result<Vec<u64>, StorageError> {
        let mut raw = vec![0u8; usize::try_from(bytes).unwrap_or(0)];
        self.read(&mut raw, offset).await?;
        Ok(decode_words(&raw))
    }

    /// An L1 table of `entries` entries at `offset`: each entry with its file position.
    pub(crate) async fn read_l1(
        &self,
        offset: u64,
        entries: u32,
    ) -> Result<Vec<(u64, RawL1Entry)>, WalkError> {
        let bytes = u64::from(entries) * TABLE_WORD;
        if bytes > MAX_L1_BYTES {
            return Err(WalkError::TooLarge {
                what: "L1 table",
                bytes,
            });
        }
        let words = self.read_words(offset, bytes).await?;
        Ok(positioned(
            offset,
            TABLE_WORD,
            words.into_iter().map(RawL1Entry),
        ))
    }

    /// The L2 table at `offset` (one cluster), to iterate over its entries.
    pub(crate) async fn read_l2(&self, offset: u64) -> Result<L2Table, WalkError> {
        let bytes = self.read_cluster(offset).await?;
        Ok(L2Table {
            offset,
            bytes,
            layout: self.layout,
        })
    }

    /// One cluster at `offset`, as bytes (an L2 table to rewrite whole, a refcount block).
    pub(crate) async fn read_cluster(&self, offset: u64) -> Result<Vec<u8>, StorageError> {
        let mut buf = vec![0u8; self.layout.cluster_size() as usize];
        self.read(&mut buf, offset).await?;
        Ok(buf)
    }

    /// The refcount table of `clusters` clusters at `offset`.
    pub(crate) async fn read_reftable(
        &self,
        offset: u64,
        clusters: u32,
    ) -> Result<Vec<RawReftableEntry>, WalkError> {
        let bytes = u64::from(clusters) * self.layout.cluster_size();
        if bytes > MAX_REFTABLE_BYTES {
            return Err(WalkError::TooLarge {
                what: "refcount table",
                bytes,
            });
        }
        let words = self.read_words(offset, bytes).await?;
        Ok(words.into_iter().map(RawReftableEntry).collect())
    }

    /// The refcount block at `offset`, as bytes (read with [`qimg_format::refcount::get`]).
    pub(crate) async fn read_refblock(&self, offset: u64) -> Result<Vec<u8>, StorageError> {
        self.read_cluster(offset).await
    }

    /// `count` entries of a bitmap table at `offset` (callers read big tables in pieces).
    pub(crate) async fn read_bitmap_table(
        &self,
        offset: u64,
        count: u64,
    ) -> Result<Vec<RawBitmapTableEntry>, WalkError> {
        let bytes = count.saturating_mul(TABLE_WORD);
        if bytes > MAX_L1_BYTES {
            return Err(WalkError::TooLarge {
                what: "bitmap table piece",
                bytes,
            });
        }
        let words = self.read_words(offset, bytes).await?;
        Ok(words.into_iter().map(RawBitmapTableEntry).collect())
    }

    /// `len` bytes at `offset` (a bitmap directory, a snapshot ID or name); `len` must have
    /// been bounded by the caller (u16 sizes, a validated directory size).
    pub(crate) async fn read_bytes(&self, offset: u64, len: u64) -> Result<Vec<u8>, WalkError> {
        if len > MAX_TABLE_SIZE {
            return Err(WalkError::TooLarge {
                what: "metadata structure",
                bytes: len,
            });
        }
        let mut buf = vec![0u8; len as usize];
        self.read(&mut buf, offset).await?;
        Ok(buf)
    }

    /// The fixed part of the snapshot table entry at `offset`, decoded leniently.
    pub(crate) async fn read_snapshot_entry(&self, offset: u64) -> Result<EntryHeader, WalkError> {
        let mut h = [0u8; ENTRY_HEADER_LEN as usize];
        self.read(&mut h, offset).await?;
        Ok(EntryHeader::decode(&h))
    }

    /// The whole snapshot table, strictly decoded (at most [`MAX_TABLE_SIZE`] bytes are read,
    /// never past the end of the file).
    pub(crate) async fn read_snapshot_table(
        &self,
        offset: u64,
        nb: u32,
    ) -> Result<Vec<Snapshot>, WalkError> {
        let len = self.file.len().await?;
        let want = len.saturating_sub(offset).min(MAX_TABLE_SIZE) as usize;
        let mut raw = vec![0u8; want];
        self.file.read_at_zero_fill(&mut raw, offset).await?;
        Ok(snapshot::decode_table(&raw, offset, nb)?)
    }

    /// Visits the references of the tree under `l1` (strictly decoded): each L2 table, and
    /// each data or compressed cluster it maps. With `external_data`, data clusters live in
    /// another file and are not reported.
    pub(crate) async fn visit_tree(
        &self,
        l1: &[L1Entry],
        ctx: &L2Context,
        external_data: bool,
        visit: &mut impl FnMut(Reference),
    ) -> Result<(), WalkError> {
        let cs = self.layout.cluster_size();
        let mut table = vec![0u8; cs as usize];
        for entry in l1 {
            let Some(t) = entry.l2_offset else { continue };
            visit(Reference {
                structure: Structure::L2Table,
                offset: t.0,
                len: 1,
            });
            self.read(&mut table, t.0).await?;
            for e in decode_slice(&table, ctx, t.0)? {
                let first = match &e {
                    AnyL2Entry::Standard(e) => e,
                    AnyL2Entry::Extended(x) => &x.entry,
                };
                match first {
                    L2Entry::Compressed(d) => visit(Reference {
                        structure: Structure::Compressed,
                        offset: d.host_offset().0,
                        len: d.compressed_size_bytes(),
                    }),
                    other => {
                        if let (Some(h), false) = (other.host_cluster(), external_data) {
                            visit(Reference {
                                structure: Structure::Data,
                                offset: h.0,
                                len: 1,
                            });
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Visits the snapshot table at `offset` and every snapshot's L1 table and tree.
    pub(crate) async fn visit_snapshots(
        &self,
        offset: u64,
        nb: u32,
        ctx: &L2Context,
        external_data: bool,
        visit: &mut impl FnMut(Reference),
    ) -> Result<(), WalkError> {
        if nb == 0 {
            return Ok(());
        }
        let snaps = self.read_snapshot_table(offset, nb).await?;
        let table_len: usize = snaps.iter().map(Snapshot::encoded_len).sum();
        visit(Reference {
            structure: Structure::SnapshotTable,
            offset,
            len: table_len as u64,
        });
        let cs = self.layout.cluster_size();
        for s in &snaps {
            let bytes = u64::from(s.l1_size) * TABLE_WORD;
            if bytes > MAX_L1_BYTES {
                return Err(WalkError::TooLarge {
                    what: "snapshot L1 table",
                    bytes,
                });
            }
            visit(Reference {
                structure: Structure::L1Table,
                offset: s.l1_table_offset,
                len: bytes,
            });
            let mut raw = vec![0u8; bytes as usize];
            self.read(&mut raw, s.l1_table_offset).await?;
            let table = l1::decode_table(&raw, cs, s.l1_table_offset)?;
            self.visit_tree(&table, ctx, external_data, visit).await?;
        }
        Ok(())
    }
}

/// An L2 table as read, decoded entry by entry as it is iterated (a table is walked once per
/// L1 entry naming it: materialising its entries would cost an allocation per table entry).
#[derive(Debug, Clone)]
pub(crate) struct L2Table {
    offset: u64,
    bytes: Vec<u8>,
    layout: L2Layout,
}

impl L2Table {
    /// The entries with their file positions.
    pub(crate) fn entries(&self) -> impl Iterator<Item = (u64, RawL2Entry)> + '_ {
        let offset = self.offset;
        self.layout
            .entries(&self.bytes)
            .map(move |(at, e)| (offset.saturating_add(at as u64), e))
    }
}

/// Pairs table entries with their file positions.
fn positioned<T>(base: u64, size: u64, items: impl Iterator<Item = T>) -> Vec<(u64, T)> {
    items
        .enumerate()
        .map(|(i, e)| (base.saturating_add(i as u64 * size), e))
        .collect()
}

/// Clusters per chunk of [`ReferenceCounts`].
const CHUNK: u64 = 4096;

/// Computed references per host cluster: 16-bit counters in chunks allocated only where
/// references exist (so a sparse multi-terabyte image costs what its allocated clusters
/// cost), with larger values kept aside. `size` is QEMU's `nb_clusters`: the clusters of the
/// file, grown by references just past its end and by rebuild allocations.
#[derive(Debug, Default, Clone)]
pub(crate) struct ReferenceCounts {
    chunks: BTreeMap<u64, Box<[u16]>>,
    big: HashMap<u64, u64>,
    pub(crate) size: u64,
}

impl ReferenceCounts {
    /// The count of cluster `c`.
    pub(crate) fn get(&self, c: u64) -> u64 {
        match self.chunks.get(&(c / CHUNK)) {
            None => 0,
            Some(ch) => {
                let v = ch[(c % CHUNK) as usize];
                if v == u16::MAX {
                    self.big.get(&c).copied().unwrap_or(u64::from(u16::MAX))
                } else {
                    u64::from(v)
                }
            }
        }
    }

    /// Sets the count of cluster `c`.
    pub(crate) fn set(&mut self, c: u64, v: u64) {
        if v == 0 && !self.chunks.contains_key(&(c / CHUNK)) {
            return;
        }
        let ch = self
            .chunks
            .entry(c / CHUNK)
            .or_insert_with(|| vec![0u16; CHUNK as usize].into_boxed_slice());
        let i = (c % CHUNK) as usize;
        if v >= u64::from(u16::MAX) {
            ch[i] = u16::MAX;
            self.big.insert(c, v);
        } else {
            ch[i] = v as u16;
            self.big.remove(&c);
        }
    }

    /// Adds one reference to every cluster of `[offset, offset + len)` (nothing when `len` is
    /// 0), growing `size` to cover them.
    pub(crate) fn add_range(&mut self, offset: u64, len: u64, cluster_size: u64) {
        if len == 0 {
            return;
        }
        let last = offset.saturating_add(len - 1) / cluster_size;
        for c in offset / cluster_size..=last {
            self.size = self.size.max(c + 1);
            let v = self.get(c);
            self.set(c, v.saturating_add(1));
        }
    }

    /// Forgets every count (keeps `size`).
    pub(crate) fn clear(&mut self) {
        self.chunks.clear();
        self.big.clear();
    }

    /// The highest cluster with a non-zero count.
    pub(crate) fn max_cluster(&self) -> Option<u64> {
        let (&k, ch) = self
            .chunks
            .iter()
            .rev()
            .find(|(_, ch)| ch.iter().any(|&v| v != 0))?;
        let i = ch.iter().rposition(|&v| v != 0)?;
        Some(k * CHUNK + i as u64)
    }

    /// The parts of `[from, to)` that lie in allocated chunks, ascending (at most one per
    /// chunk: [`nonzero_in`](Self::nonzero_in) on each returns at most `CHUNK` clusters).
    pub(crate) fn windows(&self, from: u64, to: u64) -> Vec<(u64, u64)> {
        if from >= to {
            return Vec::new();
        }
        self.chunks
            .range(from / CHUNK..=(to - 1) / CHUNK)
            .map(|(&k, _)| (from.max(k * CHUNK), to.min((k + 1) * CHUNK)))
            .collect()
    }

    /// Clusters in `[from, to)` with a non-zero count, ascending.
    pub(crate) fn nonzero_in(&self, from: u64, to: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        if from >= to {
            return out;
        }
        for (&k, ch) in self.chunks.range(from / CHUNK..=(to - 1) / CHUNK) {
            let base = k * CHUNK;
            for (i, &v) in ch.iter().enumerate() {
                let c = base + i as u64;
                if v != 0 && c >= from && c < to {
                    out.push((c, self.get(c)));
                }
            }
        }
        out
    }

    /// The first cluster in `[from, to)` with a non-zero count.
    pub(crate) fn next_nonzero(&self, from: u64, to: u64) -> Option<u64> {
        if from >= to {
            return None;
        }
        for (&k, ch) in self.chunks.range(from / CHUNK..=(to - 1) / CHUNK) {
            let base = k * CHUNK;
            let start = from.saturating_sub(base) as usize;
            for (i, &v) in ch.get(start..).unwrap_or(&[]).iter().enumerate() {
                let c = base + (start + i) as u64;
                if c >= to {
                    return None;
                }
                if v != 0 {
                    return Some(c);
                }
            }
        }
        None
    }
}

/// A refcount value larger than the refcount width holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Overflow {
    /// The cluster.
    pub(crate) cluster: u64,
    /// Its count.
    pub(crate) value: u64,
}

/// Encodes refcount block `j` (covering clusters `j * geometry.refblock_entries() ..`) from
/// `counts`, plus `extra` (clusters, with their counts, of the block's range not in `counts`,
/// such as a new refcount area). With `clamp`, counts above the refcount width's maximum are
/// stored as that maximum (QEMU's check rebuild); without it they are refused.
pub(crate) fn encode_refblock(
    counts: &ReferenceCounts,
    geometry: &RefcountGeometry,
    j: u64,
    extra: impl Iterator<Item = (u64, u64)>,
    clamp: bool,
) -> Result<Vec<u8>, Overflow> {
    let entries = geometry.refblock_entries();
    let max = geometry.max_refcount();
    let mut block = vec![0u8; geometry.cluster_size() as usize];
    let from = j * entries;
    let to = from + entries;
    let counted = counts
        .windows(from, to)
        .into_iter()
        .flat_map(|(a, b)| counts.nonzero_in(a, b));
    for (c, v) in counted.chain(extra) {
        let value = if v > max {
            if !clamp {
                return Err(Overflow {
                    cluster: c,
                    value: v,
                });
            }
            max
        } else {
            v
        };
        // The index is below `entries`, so the block holds it.
        let _ = refcount::set(&mut block, geometry.refcount_order(), c - from, value);
    }
    Ok(block)
}

#[cfg(test)]
mod tests {
    use super::*;
    use qimg_format::l1::QCOW_OFLAG_COPIED;
    use qimg_io::MemStorage;

    #[test]
    fn reference_counts_pass_16_bits_and_iterate_in_order() {
        let mut r = ReferenceCounts::default();
        r.set(5, 1);
        r.set(70_000, 70_000);
        r.set(4095, 2);
        assert_eq!(r.get(70_000), 70_000);
        assert_eq!(r.get(6), 0);
        assert_eq!(
            r.nonzero_in(0, 100_000),
            vec![(5, 1), (4095, 2), (70_000, 70_000)]
        );
        assert_eq!(r.next_nonzero(6, 100_000), Some(4095));
        assert_eq!(r.next_nonzero(4096, 70_000), None);
        assert_eq!(r.max_cluster(), Some(70_000));
        r.set(70_000, 3);
        assert_eq!(r.get(70_000), 3);
        r.add_range(0x1_0000, 0x1_0001, 0x1_0000);
        assert_eq!((r.get(1), r.get(2), r.size), (1, 1, 3));
    }

    #[test]
    fn refblocks_are_encoded_from_the_counts() {
        let mut r = ReferenceCounts::default();
        r.set(1, 2);
        r.set(600, 70_000);
        let g = RefcountGeometry::new(9, 4).unwrap();
        let b = encode_refblock(&r, &g, 0, [(3, 1)].into_iter(), true).unwrap();
        assert_eq!(refcount::get(&b, 4, 1).unwrap(), 2);
        assert_eq!(refcount::get(&b, 4, 3).unwrap(), 1);
        let b = encode_refblock(&r, &g, 2, std::iter::empty(), true).unwrap();
        assert_eq!(refcount::get(&b, 4, 600 - 512).unwrap(), 65535);
        let e = encode_refblock(&r, &g, 2, std::iter::empty(), false);
        assert_eq!(
            e,
            Err(Overflow {
                cluster: 600,
                value: 70_000
            })
        );
    }

    #[tokio::test]
    async fn tables_are_read_with_their_positions_and_bounded() {
        let m = MemStorage::new();
        let l1 = [QCOW_OFLAG_COPIED | 0x2_0000, 0];
        let bytes = qimg_format::lenient::encode_words(&l1);
        m.write_at(&bytes, 0x1_0000).await.unwrap();
        let layout = L2Layout {
            cluster_bits: 16,
            extended: false,
            external_data: false,
        };
        let w = Walker::new(&m, layout).zero_fill(true);
        let t = w.read_l1(0x1_0000, 2).await.unwrap();
        assert_eq!(t[0], (0x1_0000, RawL1Entry(l1[0])));
        assert_eq!(t[1].0, 0x1_0008);
        // Past the end of the file: zeros.
        let l2: Vec<_> = w.read_l2(0x2_0000).await.unwrap().entries().collect();
        assert_eq!(l2.len(), 8192);
        assert_eq!(l2[1].0, 0x2_0008);
        assert!(matches!(
            w.read_l1(0, u32::MAX).await,
            Err(WalkError::TooLarge { .. })
        ));
        assert!(matches!(
            w.read_reftable(0, u32::MAX).await,
            Err(WalkError::TooLarge { .. })
        ));
        let strict = Walker::new(&m, layout);
        assert!(strict.read_l2(0x2_0000).await.is_err());
    }
}

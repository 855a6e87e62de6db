//! Lenient views of table entries, for tools that must look at damaged images.
//!
//! The strict decoders ([`crate::l1::L1Entry::decode`], [`crate::l2::L2Entry::decode`],
//! [`crate::refcount::RefcountTableEntry::decode`]) refuse an entry with reserved bits or a
//! misaligned offset. `qemu-img check` must instead say what such an entry names, report what
//! is wrong with it and possibly rewrite it. The types here wrap the raw words and classify
//! them the way QEMU does (`qcow2_get_cluster_type`, `qcow2_parse_compressed_l2_entry`),
//! never failing: every bit pattern has an answer.

use crate::l1::{L1E_OFFSET_MASK, L1E_RESERVED_MASK, L1Entry, QCOW_OFLAG_COPIED};
use crate::l2::{L2E_OFFSET_MASK, L2E_STD_RESERVED_MASK, QCOW_OFLAG_COMPRESSED, QCOW_OFLAG_ZERO};
use crate::refcount::{REFT_OFFSET_MASK, REFT_RESERVED_MASK};

/// Size in bytes of an entry of the L1 table, the refcount table and a bitmap table.
pub const TABLE_WORD: u64 = 8;

/// Splits big-endian bytes into 64-bit words; a trailing partial word is ignored (callers
/// read whole tables, whose lengths are multiples of 8).
pub fn decode_words(bytes: &[u8]) -> Vec<u64> {
    bytes
        .chunks_exact(8)
        .map(|c| {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            u64::from_be_bytes(w)
        })
        .collect()
}

/// The big-endian word in `bytes` (8 bytes; a shorter slice is padded with zeros).
fn word_of(bytes: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    let n = bytes.len().min(8);
    w[..n].copy_from_slice(&bytes[..n]);
    u64::from_be_bytes(w)
}

/// Decodes an L1 table with [`L1Entry::decode_lenient`] (as QEMU's data path reads it); a
/// trailing partial word is ignored.
pub fn decode_l1_table(bytes: &[u8]) -> Vec<L1Entry> {
    decode_words(bytes)
        .into_iter()
        .map(L1Entry::decode_lenient)
        .collect()
}

/// Encodes words as big-endian bytes (the inverse of [`decode_words`]).
pub fn encode_words(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_be_bytes()).collect()
}

/// An L1 table entry as stored, whatever its bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RawL1Entry(pub u64);

impl RawL1Entry {
    /// Whether the entry is all zeros (no L2 table).
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The L2 table offset bits (0: no table). May be unaligned in a damaged image.
    pub fn l2_offset(self) -> u64 {
        self.0 & L1E_OFFSET_MASK
    }

    /// The reserved bits that are set (0 in a valid entry).
    pub fn reserved_bits(self) -> u64 {
        self.0 & L1E_RESERVED_MASK
    }

    /// The COPIED flag: the L2 table's refcount is exactly 1.
    pub fn copied(self) -> bool {
        self.0 & QCOW_OFLAG_COPIED != 0
    }

    /// The entry with its reserved bits cleared; an entry that then names no table becomes
    /// all zeros (a lone COPIED flag means nothing).
    pub fn without_reserved_bits(self) -> Self {
        let cleared = self.0 & !L1E_RESERVED_MASK;
        if cleared & L1E_OFFSET_MASK == 0 {
            Self(0)
        } else {
            Self(cleared)
        }
    }

    /// The entry with the COPIED flag set or cleared.
    pub fn with_copied(self, copied: bool) -> Self {
        if copied {
            Self(self.0 | QCOW_OFLAG_COPIED)
        } else {
            Self(self.0 & !QCOW_OFLAG_COPIED)
        }
    }

    /// The big-endian bytes of the entry.
    pub fn encode(self) -> [u8; 8] {
        self.0.to_be_bytes()
    }
}

/// What an L2 entry makes of its cluster, as QEMU's `qcow2_get_cluster_type` classifies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterKind {
    /// No data here: reads go to the backing file (or zeros).
    Unallocated,
    /// Reads as zeros, no host cluster (standard L2 only).
    ZeroPlain,
    /// Reads as zeros, with a preallocated host cluster (standard L2 only).
    ZeroAlloc,
    /// Data (or, with extended L2, subclusters) in a host cluster.
    Normal,
    /// A compressed cluster.
    Compressed,
}

impl ClusterKind {
    /// Whether the entry names a whole host cluster (`Normal` or `ZeroAlloc`).
    pub fn has_host_cluster(self) -> bool {
        matches!(self, Self::Normal | Self::ZeroAlloc)
    }
}

/// The subcluster bitmap word meaning "every subcluster allocated" (its low half).
pub const SUBCLUSTERS_ALLOC: u64 = 0x0000_0000_FFFF_FFFF;
/// The subcluster bitmap word meaning "every subcluster reads as zeros" (its high half).
pub const SUBCLUSTERS_ZERO: u64 = 0xFFFF_FFFF_0000_0000;

/// How an L2 table is laid out: what [`RawL2Entry::kind`] needs to know about the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct L2Layout {
    /// log2 of the cluster size.
    pub cluster_bits: u32,
    /// Extended L2 entries (16 bytes, with a subcluster bitmap).
    pub extended: bool,
    /// The image has an external data file (incompatible bit 2).
    pub external_data: bool,
}

impl L2Layout {
    /// Bytes per L2 entry: 8, or 16 with extended L2.
    pub fn entry_size(self) -> u64 {
        if self.extended { 16 } else { 8 }
    }

    /// The cluster size in bytes.
    pub fn cluster_size(self) -> u64 {
        1u64 << self.cluster_bits
    }

    /// The entries of an L2 table (or part of one) held in `bytes`, with their byte position
    /// in `bytes`; a trailing partial entry is ignored.
    pub fn entries(self, bytes: &[u8]) -> impl Iterator<Item = (usize, RawL2Entry)> + '_ {
        let es = self.entry_size() as usize;
        bytes.chunks_exact(es).enumerate().map(move |(i, c)| {
            // `c` holds one (8 bytes) or two (16 bytes) whole words.
            let (word, bitmap) = c.split_at(8);
            let entry = RawL2Entry {
                word: word_of(word),
                bitmap: if bitmap.is_empty() {
                    0
                } else {
                    word_of(bitmap)
                },
            };
            (i * es, entry)
        })
    }

    /// The bytes of `entry` as stored: the entry word, and with extended L2 the bitmap.
    pub fn encode(self, entry: RawL2Entry) -> Vec<u8> {
        let mut b = entry.word.to_be_bytes().to_vec();
        if self.extended {
            b.extend_from_slice(&entry.bitmap.to_be_bytes());
        }
        b
    }

    /// The entry QEMU's `fix_l2_entry_by_zero` writes: the cluster reads as zeros and owns no
    /// host cluster. `bitmap` is the old subcluster bitmap (extended L2): its allocated and zero
    /// subclusters all become zero ones.
    pub fn zero_entry(self, bitmap: u64) -> RawL2Entry {
        if self.extended {
            RawL2Entry {
                word: 0,
                bitmap: (bitmap | (bitmap << 32)) & SUBCLUSTERS_ZERO,
            }
        } else {
            RawL2Entry {
                word: QCOW_OFLAG_ZERO,
                bitmap: 0,
            }
        }
    }
}

/// An L2 entry as stored, whatever its bits: the entry word and (extended L2) the subcluster
/// bitmap word (0 with standard L2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RawL2Entry {
    /// The 64-bit entry word.
    pub word: u64,
    /// The subcluster bitmap: allocation bits low, zero bits high.
    pub bitmap: u64,
}

impl RawL2Entry {
    /// The cluster kind, as QEMU classifies it (COMPRESSED first; the ZERO flag only counts
    /// with standard L2; an entry without offset in an image with an external data file and
    /// COPIED set maps the data file 1:1).
    pub fn kind(self, layout: L2Layout) -> ClusterKind {
        let w = self.word;
        if w & QCOW_OFLAG_COMPRESSED != 0 {
            ClusterKind::Compressed
        } else if w & QCOW_OFLAG_ZERO != 0 && !layout.extended {
            if w & L2E_OFFSET_MASK != 0 {
                ClusterKind::ZeroAlloc
            } else {
                ClusterKind::ZeroPlain
            }
        } else if w & L2E_OFFSET_MASK == 0 {
            if layout.external_data && w & QCOW_OFLAG_COPIED != 0 {
                ClusterKind::Normal
            } else {
                ClusterKind::Unallocated
            }
        } else {
            ClusterKind::Normal
        }
    }

    /// The host offset bits of an uncompressed entry (may be unaligned when damaged).
    pub fn host_offset(self) -> u64 {
        self.word & L2E_OFFSET_MASK
    }

    /// The reserved bits of an uncompressed entry that are set.
    pub fn reserved_bits(self) -> u64 {
        self.word & L2E_STD_RESERVED_MASK
    }

    /// The entry with the reserved bits of an uncompressed entry cleared.
    pub fn without_reserved_bits(self) -> Self {
        Self {
            word: self.word & !L2E_STD_RESERVED_MASK,
            ..self
        }
    }

    /// The COPIED flag.
    pub fn copied(self) -> bool {
        self.word & QCOW_OFLAG_COPIED != 0
    }

    /// The entry with the COPIED flag set or cleared.
    pub fn with_copied(self, copied: bool) -> Self {
        let word = if copied {
            self.word | QCOW_OFLAG_COPIED
        } else {
            self.word & !QCOW_OFLAG_COPIED
        };
        Self { word, ..self }
    }

    /// The ZERO flag (standard L2: the cluster reads as zeros).
    pub fn zero_flag(self) -> bool {
        self.word & QCOW_OFLAG_ZERO != 0
    }

    /// Of a compressed entry, QEMU's `qcow2_parse_compressed_l2_entry`: the byte offset of
    /// the compressed data and its length in bytes (up to the end of its last sector).
    pub fn compressed_range(self, cluster_bits: u32) -> (u64, u64) {
        let cluster_bits = cluster_bits.clamp(9, 62);
        let shift = 62 - (cluster_bits - 8);
        let offset = self.word & ((1u64 << shift) - 1);
        let sectors = ((self.word >> shift) & ((1u64 << (cluster_bits - 8)) - 1)) + 1;
        (offset, sectors * 512 - (offset & 511))
    }

    /// Subclusters marked both allocated and zero (a corruption), as allocation bits.
    pub fn alloc_zero_conflict(self) -> u64 {
        (self.bitmap >> 32) & self.bitmap
    }

    /// Whether any subcluster is marked allocated.
    pub fn any_subcluster_allocated(self) -> bool {
        self.bitmap & SUBCLUSTERS_ALLOC != 0
    }
}

/// A refcount table entry as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RawReftableEntry(pub u64);

impl RawReftableEntry {
    /// The refcount block offset bits (0: no block). May be unaligned when damaged.
    pub fn block_offset(self) -> u64 {
        self.0 & REFT_OFFSET_MASK
    }

    /// The reserved bits that are set.
    pub fn reserved_bits(self) -> u64 {
        self.0 & REFT_RESERVED_MASK
    }
}

/// A bitmap table entry as stored (qcow2-format.md, bitmaps).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RawBitmapTableEntry(pub u64);

impl RawBitmapTableEntry {
    /// The data cluster offset (0: no cluster).
    pub fn offset(self) -> u64 {
        self.0 & crate::bitmap::TABLE_ENTRY_OFFSET_MASK
    }

    /// Whether QEMU's check calls the entry corrupt: reserved bits set, or a data cluster that
    /// is unaligned or combined with the all-ones flag.
    pub fn is_invalid(self, cluster_size: u64) -> bool {
        (cluster_size == 0 && self.offset() != 0)
            || crate::bitmap::TableEntry::decode(self.0, cluster_size, 0, 0).is_err()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const STD: L2Layout = L2Layout {
        cluster_bits: 16,
        extended: false,
        external_data: false,
    };
    const EXT: L2Layout = L2Layout {
        cluster_bits: 16,
        extended: true,
        external_data: false,
    };

    fn l2(word: u64) -> RawL2Entry {
        RawL2Entry { word, bitmap: 0 }
    }

    #[test]
    fn l2_entries_are_classified_as_qemu_does() {
        assert_eq!(l2(0).kind(STD), ClusterKind::Unallocated);
        assert_eq!(l2(1).kind(STD), ClusterKind::ZeroPlain);
        assert_eq!(l2(0x5_0000 | 1).kind(STD), ClusterKind::ZeroAlloc);
        assert_eq!(l2(0x5_0000 | 1).kind(EXT), ClusterKind::Normal);
        assert_eq!(l2(1).kind(EXT), ClusterKind::Unallocated);
        assert_eq!(l2(0x5_0000).kind(STD), ClusterKind::Normal);
        assert_eq!(
            l2(QCOW_OFLAG_COMPRESSED | 1).kind(STD),
            ClusterKind::Compressed
        );
        let ext_data = L2Layout {
            external_data: true,
            ..STD
        };
        assert_eq!(l2(QCOW_OFLAG_COPIED).kind(ext_data), ClusterKind::Normal);
        assert_eq!(l2(QCOW_OFLAG_COPIED).kind(STD), ClusterKind::Unallocated);
        assert!(ClusterKind::ZeroAlloc.has_host_cluster());
        assert!(!ClusterKind::Compressed.has_host_cluster());
    }

    #[test]
    fn damaged_l2_entries_show_their_damage() {
        let e = l2(0x5_0200 | (1 << 60) | QCOW_OFLAG_COPIED);
        assert_eq!(e.host_offset(), 0x5_0200);
        assert_eq!(e.reserved_bits(), 1 << 60);
        assert_eq!(e.without_reserved_bits().word, 0x5_0200 | QCOW_OFLAG_COPIED);
        assert!(e.copied());
        assert!(!e.with_copied(false).copied());
        let x = RawL2Entry {
            word: 0x5_0000,
            bitmap: 0x0000_0003_0000_0006,
        };
        assert_eq!(x.alloc_zero_conflict(), 2);
        assert!(x.any_subcluster_allocated());
    }

    #[test]
    fn compressed_ranges_follow_qemu() {
        // 64 KiB clusters: 8 bits of additional sectors above bit 54.
        let e = l2(QCOW_OFLAG_COMPRESSED | (3 << 54) | 0x1_0200);
        assert_eq!(e.compressed_range(16), (0x1_0200, 4 * 512));
        let e = l2(QCOW_OFLAG_COMPRESSED | 0x1_0010);
        assert_eq!(e.compressed_range(16), (0x1_0010, 512 - 0x10));
    }

    #[test]
    fn zero_entries_replace_damaged_ones() {
        assert_eq!(STD.zero_entry(0), l2(QCOW_OFLAG_ZERO));
        assert_eq!(
            EXT.zero_entry(0x0000_0001_0000_0002).bitmap,
            0x0000_0003_0000_0000
        );
        assert_eq!(EXT.encode(EXT.zero_entry(0)).len(), 16);
        assert_eq!(STD.encode(l2(7)), 7u64.to_be_bytes().to_vec());
    }

    #[test]
    fn l1_and_reftable_entries_show_their_damage() {
        let e = RawL1Entry(QCOW_OFLAG_COPIED | 0x3_0000 | 0x10);
        assert_eq!(e.l2_offset(), 0x3_0000);
        assert_eq!(e.reserved_bits(), 0x10);
        assert_eq!(
            e.without_reserved_bits(),
            RawL1Entry(QCOW_OFLAG_COPIED | 0x3_0000)
        );
        assert_eq!(
            RawL1Entry(QCOW_OFLAG_COPIED | 1).without_reserved_bits(),
            RawL1Entry(0)
        );
        assert!(!e.with_copied(false).copied());
        let r = RawReftableEntry(0x2_0000 | 0x3);
        assert_eq!((r.block_offset(), r.reserved_bits()), (0x2_0000, 3));
    }

    #[test]
    fn bitmap_table_entries_are_judged_as_qemu_does() {
        assert!(!RawBitmapTableEntry(0).is_invalid(65536));
        assert!(!RawBitmapTableEntry(1).is_invalid(65536));
        assert!(!RawBitmapTableEntry(0x3_0000).is_invalid(65536));
        assert!(RawBitmapTableEntry(0x3_0001).is_invalid(65536));
        assert!(RawBitmapTableEntry(0x3_0200).is_invalid(65536));
        assert!(RawBitmapTableEntry(1 << 60).is_invalid(65536));
        assert_eq!(RawBitmapTableEntry(0x3_0000).offset(), 0x3_0000);
    }

    proptest! {
        #[test]
        fn words_round_trip(words in proptest::collection::vec(any::<u64>(), 0..64)) {
            prop_assert_eq!(decode_words(&encode_words(&words)), words);
        }

        #[test]
        fn l2_entries_round_trip(word in any::<u64>(), bitmap in any::<u64>(), ext in any::<bool>()) {
            let layout = if ext { EXT } else { STD };
            let e = RawL2Entry { word, bitmap: if ext { bitmap } else { 0 } };
            let bytes = layout.encode(e);
            let back: Vec<_> = layout.entries(&bytes).collect();
            prop_assert_eq!(back, vec![(0usize, e)]);
            // Classification never panics, whatever the cluster size.
            for bits in 0..70 {
                let _ = e.compressed_range(bits);
                let _ = e.kind(L2Layout { cluster_bits: bits, ..layout });
            }
        }
    }
}

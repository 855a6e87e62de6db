//! L1 table entries (spec §3.1): each points at one L2 table.
//!
//! ```text
//! bit 63      COPIED (the L2 table's refcount is exactly 1)
//! bits 56-62  reserved, 0
//! bits 9-55   L2 table offset, cluster aligned; 0 = no L2 table
//! bits 0-8    reserved, 0
//! ```

use crate::error::{FormatError, Result};
use crate::units::{HostOffset, is_multiple_of};

/// Bits of an L1 entry holding the L2 table offset.
pub const L1E_OFFSET_MASK: u64 = 0x00FF_FFFF_FFFF_FE00;
/// Bits of an L1 entry that must be zero.
pub const L1E_RESERVED_MASK: u64 = 0x7F00_0000_0000_01FF;
/// The COPIED flag (bit 63), shared by L1 and L2 entries.
pub const QCOW_OFLAG_COPIED: u64 = 1 << 63;
/// Size of one L1 entry in bytes.
pub const L1_ENTRY_SIZE: usize = 8;

/// Bytes of an L1 table of `entries` entries.
pub fn table_bytes(entries: u64) -> u64 {
    entries * L1_ENTRY_SIZE as u64
}

/// Where entry `index` of the L1 table at `table` is.
pub fn table_entry_offset(table: u64, index: u64) -> u64 {
    table + index * L1_ENTRY_SIZE as u64
}

/// A decoded L1 entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct L1Entry {
    /// Where the L2 table is, or `None` when the whole range it would describe is unallocated.
    pub l2_offset: Option<HostOffset>,
    /// The COPIED flag: the L2 table may be modified in place (refcount exactly 1).
    pub copied: bool,
}

impl L1Entry {
    /// An entry with no L2 table and no flags.
    pub const UNALLOCATED: Self = Self {
        l2_offset: None,
        copied: false,
    };

    /// Decodes the raw entry `raw` read at file offset `at` (used only in errors).
    ///
    /// Rejects reserved bits and an L2 table offset that is not a multiple of `cluster_size`.
    pub fn decode(raw: u64, cluster_size: u64, at: u64) -> Result<Self> {
        let reserved = raw & L1E_RESERVED_MASK;
        if reserved != 0 {
            return Err(FormatError::ReservedBits {
                what: "L1 entry",
                offset: at,
                bits: reserved,
                value: raw,
            });
        }
        let offset = raw & L1E_OFFSET_MASK;
        if !is_multiple_of(offset, cluster_size) {
            return Err(FormatError::Unaligned {
                what: "L2 table offset in L1 entry",
                offset: at,
                value: offset,
                align: cluster_size,
            });
        }
        Ok(Self {
            l2_offset: (offset != 0).then_some(HostOffset(offset)),
            copied: raw & QCOW_OFLAG_COPIED != 0,
        })
    }

    /// Decodes `raw` as QEMU's data path reads it: reserved bits are ignored and the L2 table
    /// offset is kept as found, aligned or not (an engine refuses an unaligned table when a
    /// request needs it, marking the image corrupt, instead of refusing the whole image).
    pub fn decode_lenient(raw: u64) -> Self {
        let offset = raw & L1E_OFFSET_MASK;
        Self {
            l2_offset: (offset != 0).then_some(HostOffset(offset)),
            copied: raw & QCOW_OFLAG_COPIED != 0,
        }
    }

    /// The raw 64-bit entry.
    ///
    /// Offset bits outside bits 9..=55 cannot be represented and are dropped; offsets built by
    /// [`L1Entry::decode`] always fit.
    pub fn encode(&self) -> u64 {
        let offset = self.l2_offset.map_or(0, |o| o.0 & L1E_OFFSET_MASK);
        offset | if self.copied { QCOW_OFLAG_COPIED } else { 0 }
    }
}

/// File offset of entry `index` of a table of 8-byte entries starting at `base`.
pub(crate) fn entry_offset(base: u64, index: usize, entry_size: usize) -> u64 {
    let rel = u64::try_from(index)
        .unwrap_or(u64::MAX)
        .saturating_mul(u64::try_from(entry_size).unwrap_or(u64::MAX));
    base.saturating_add(rel)
}

/// Splits `bytes` into big-endian 64-bit words, failing if a partial word is left over.
pub(crate) fn be_words<'a>(
    bytes: &'a [u8],
    what: &'static str,
    base: u64,
) -> Result<impl Iterator<Item = (usize, u64)> + 'a> {
    let chunks = bytes.chunks_exact(8);
    let rest = chunks.remainder().len();
    if rest != 0 {
        let whole = bytes.len() - rest;
        return Err(FormatError::Truncated {
            what,
            offset: entry_offset(base, whole, 1),
            need: 8,
            have: rest as u64,
        });
    }
    Ok(chunks.enumerate().map(|(i, c)| {
        let mut word = [0u8; 8];
        word.copy_from_slice(c);
        (i, u64::from_be_bytes(word))
    }))
}

/// Decodes an L1 table (or part of one) from big-endian bytes that start at file offset
/// `base`. An error names the file offset of the offending entry.
pub fn decode_table(bytes: &[u8], cluster_size: u64, base: u64) -> Result<Vec<L1Entry>> {
    be_words(bytes, "L1 table entry", base)?
        .map(|(i, raw)| L1Entry::decode(raw, cluster_size, entry_offset(base, i, L1_ENTRY_SIZE)))
        .collect()
}

/// Encodes L1 entries as big-endian bytes.
pub fn encode_table(entries: &[L1Entry]) -> Vec<u8> {
    entries
        .iter()
        .flat_map(|e| e.encode().to_be_bytes())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const CS: u64 = 0x10000;

    #[test]
    fn the_lenient_decoder_keeps_an_unaligned_table_and_drops_reserved_bits() {
        let e = L1Entry::decode_lenient(0xff00_0000_0004_2bff);
        assert_eq!(e.l2_offset, Some(HostOffset(0x4_2a00)));
        assert!(e.copied);
        assert_eq!(L1Entry::decode_lenient(0x1ff), L1Entry::UNALLOCATED);
        let t = crate::lenient::decode_l1_table(&[0, 0, 0, 0, 0, 3, 0, 0, 1]);
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].l2_offset, Some(HostOffset(0x30000)));
    }

    proptest! {
        #[test]
        fn the_lenient_decoder_agrees_with_the_strict_one_where_it_decodes(raw in any::<u64>()) {
            if let Ok(strict) = L1Entry::decode(raw, CS, 0) {
                prop_assert_eq!(L1Entry::decode_lenient(raw), strict);
            }
            let lenient = L1Entry::decode_lenient(raw);
            prop_assert_eq!(lenient.l2_offset.map_or(0, |o| o.0), raw & L1E_OFFSET_MASK);
            prop_assert_eq!(lenient.copied, raw & QCOW_OFLAG_COPIED != 0);
        }
    }

    #[test]
    fn zero_is_an_unallocated_entry() {
        assert_eq!(L1Entry::decode(0, CS, 0).unwrap(), L1Entry::UNALLOCATED);
    }

    #[test]
    fn copied_l2_table_at_0x30000_decodes() {
        let e = L1Entry::decode(0x8000_0000_0003_0000, CS, 0).unwrap();
        assert_eq!(
            e,
            L1Entry {
                l2_offset: Some(HostOffset(0x30000)),
                copied: true
            }
        );
    }

    #[test]
    fn reserved_low_bits_are_rejected_naming_bits_and_offset() {
        let msg = L1Entry::decode(0x3_0001, CS, 0x5_0008)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("reserved bits 0x1 ") && msg.contains("0x50008"),
            "{msg}"
        );
    }

    #[test]
    fn reserved_high_bits_are_rejected_naming_bits_and_offset() {
        let raw = 0x0100_0000_0003_0000;
        let msg = L1Entry::decode(raw, CS, 0x40).unwrap_err().to_string();
        assert!(
            msg.contains("0x100000000000000") && msg.contains("0x40"),
            "{msg}"
        );
    }

    #[test]
    fn an_l2_offset_not_aligned_to_the_cluster_size_is_rejected_naming_it() {
        let msg = L1Entry::decode(0x3_0200, CS, 0x48).unwrap_err().to_string();
        assert!(msg.contains("0x30200") && msg.contains("0x48") && msg.contains("0x10000"));
    }

    #[test]
    fn a_zero_cluster_size_rejects_offsets_without_panicking() {
        assert!(L1Entry::decode(0x200, 0, 0).is_err());
    }

    #[test]
    fn a_table_error_names_the_offset_of_the_bad_entry() {
        let mut bytes = encode_table(&[L1Entry::UNALLOCATED; 4]);
        bytes[2 * 8 + 7] = 0x01;
        let msg = decode_table(&bytes, CS, 0x3_0000).unwrap_err().to_string();
        assert!(msg.contains("offset 0x30010"), "{msg}");
    }

    #[test]
    fn a_table_with_a_partial_entry_is_truncated_at_that_entry() {
        let msg = decode_table(&[0; 13], CS, 0x1000).unwrap_err().to_string();
        assert!(msg.contains("0x1008") && msg.contains("truncated"), "{msg}");
    }

    fn valid_entry(cluster_bits: u32) -> impl Strategy<Value = L1Entry> {
        (0u64..(1 << (56 - cluster_bits)), any::<bool>()).prop_map(move |(c, copied)| L1Entry {
            l2_offset: (c != 0).then_some(HostOffset(c << cluster_bits)),
            copied,
        })
    }

    proptest! {
        #[test]
        fn decode_of_encode_is_identity(
            (bits, e) in (9u32..=21).prop_flat_map(|b| (Just(b), valid_entry(b))),
        ) {
            prop_assert_eq!(L1Entry::decode(e.encode(), 1 << bits, 0).unwrap(), e);
        }

        #[test]
        fn encode_of_decode_keeps_every_bit_of_a_valid_word(bits in 9u32..=21, raw in any::<u64>()) {
            let valid = raw & (L1E_OFFSET_MASK | QCOW_OFLAG_COPIED) & !((1u64 << bits) - 1);
            let e = L1Entry::decode(valid, 1 << bits, 0).unwrap();
            prop_assert_eq!(e.encode(), valid);
        }

        #[test]
        fn tables_round_trip(entries in prop::collection::vec(valid_entry(16), 0..64)) {
            let bytes = encode_table(&entries);
            prop_assert_eq!(decode_table(&bytes, CS, 0).unwrap(), entries);
        }

        #[test]
        fn decoding_never_panics(raw in any::<u64>(), cs in any::<u64>(), at in any::<u64>()) {
            let _ = L1Entry::decode(raw, cs, at);
        }
    }
}

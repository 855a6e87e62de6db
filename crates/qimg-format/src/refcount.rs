//! Refcount table entries and refcount blocks (spec §5).
//!
//! The refcount table is an array of 64-bit entries, each pointing at one refcount block (bits
//! 9..=63, cluster aligned; bits 0..=8 reserved; 0 = no block, all its refcounts are 0). A
//! refcount block is one cluster of densely packed `2^refcount_order`-bit refcounts: 8 bits and
//! wider are big-endian integers, narrower ones share a byte with the first entry in the least
//! significant bits.

use crate::error::{FormatError, Result};
use crate::geometry::MAX_REFCOUNT_ORDER;
use crate::l1::{be_words, entry_offset};
use crate::units::{HostOffset, is_multiple_of};

/// Bits of a refcount table entry holding the refcount block offset.
pub const REFT_OFFSET_MASK: u64 = 0xFFFF_FFFF_FFFF_FE00;
/// Bits of a refcount table entry that must be zero.
pub const REFT_RESERVED_MASK: u64 = 0x1FF;
/// Size of one refcount table entry in bytes.
pub const REFTABLE_ENTRY_SIZE: usize = 8;

/// Bytes of a refcount table of `entries` entries.
pub fn table_bytes(entries: u64) -> u64 {
    entries * REFTABLE_ENTRY_SIZE as u64
}

/// Where entry `index` of the refcount table at `table` is.
pub fn table_entry_offset(table: u64, index: u64) -> u64 {
    table + index * REFTABLE_ENTRY_SIZE as u64
}

/// A decoded refcount table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RefcountTableEntry {
    /// Where the refcount block is, or `None` when it is not allocated (all refcounts 0).
    pub block_offset: Option<HostOffset>,
}

impl RefcountTableEntry {
    /// An entry without a refcount block.
    pub const UNALLOCATED: Self = Self { block_offset: None };

    /// Decodes the raw entry `raw` read at file offset `at` (used only in errors).
    ///
    /// Rejects reserved bits and a block offset that is not a multiple of `cluster_size`.
    pub fn decode(raw: u64, cluster_size: u64, at: u64) -> Result<Self> {
        let reserved = raw & REFT_RESERVED_MASK;
        if reserved != 0 {
            return Err(FormatError::ReservedBits {
                what: "refcount table entry",
                offset: at,
                bits: reserved,
                value: raw,
            });
        }
        if !is_multiple_of(raw, cluster_size) {
            return Err(FormatError::Unaligned {
                what: "refcount block offset",
                offset: at,
                value: raw,
                align: cluster_size,
            });
        }
        Ok(Self {
            block_offset: (raw != 0).then_some(HostOffset(raw)),
        })
    }

    /// The raw 64-bit entry (offset bits 0..=8, which cannot be represented, are dropped).
    pub fn encode(&self) -> u64 {
        self.block_offset.map_or(0, |o| o.0 & REFT_OFFSET_MASK)
    }
}

/// Decodes refcount table entries from big-endian bytes starting at file offset `base`. An
/// error names the file offset of the offending entry.
pub fn decode_table(bytes: &[u8], cluster_size: u64, base: u64) -> Result<Vec<RefcountTableEntry>> {
    be_words(bytes, "refcount table entry", base)?
        .map(|(i, raw)| {
            RefcountTableEntry::decode(
                raw,
                cluster_size,
                entry_offset(base, i, REFTABLE_ENTRY_SIZE),
            )
        })
        .collect()
}

/// Encodes refcount table entries as big-endian bytes.
pub fn encode_table(entries: &[RefcountTableEntry]) -> Vec<u8> {
    entries
        .iter()
        .flat_map(|e| e.encode().to_be_bytes())
        .collect()
}

/// Width in bits of a refcount of `order`, or an error for orders above 6.
fn width(order: u32) -> Result<u32> {
    if order > MAX_REFCOUNT_ORDER {
        return Err(FormatError::InvalidArgument {
            what: "refcount_order",
            value: order.into(),
            reason: format!("refcount widths are 1 to 64 bits (order 0..={MAX_REFCOUNT_ORDER})"),
        });
    }
    Ok(1 << order)
}

/// Largest refcount of a `bits`-wide entry.
fn max_of(bits: u32) -> u64 {
    u64::MAX >> (64 - bits)
}

/// Where entry `index` lives: (first byte, bit shift within it for sub-byte widths).
fn locate(len: usize, bits: u32, index: u64) -> Result<(usize, u32)> {
    let entries = (len as u64).saturating_mul(8) / u64::from(bits);
    if index >= entries {
        return Err(FormatError::InvalidArgument {
            what: "refcount block index",
            value: index,
            reason: format!("the block holds only {entries} refcounts of {bits} bits"),
        });
    }
    // index < entries <= len * 8, so the byte position fits in usize.
    let bit = index.saturating_mul(u64::from(bits));
    let byte = usize::try_from(bit / 8).unwrap_or(usize::MAX);
    Ok((byte, (bit % 8) as u32))
}

/// Reads refcount `index` of a refcount block with `2^order`-bit entries.
///
/// Fails for an order above 6 or an index past the end of `block`.
pub fn get(block: &[u8], order: u32, index: u64) -> Result<u64> {
    let bits = width(order)?;
    let (byte, shift) = locate(block.len(), bits, index)?;
    if bits < 8 {
        return Ok(u64::from(block[byte] >> shift) & max_of(bits));
    }
    let n = (bits / 8) as usize;
    Ok(block[byte..byte + n]
        .iter()
        .fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
}

/// Writes `value` as refcount `index` of a refcount block with `2^order`-bit entries.
///
/// Fails for an order above 6, an index past the end of `block`, or a value above the width's
/// maximum (the error names the value and the width). Nothing is written on failure.
pub fn set(block: &mut [u8], order: u32, index: u64, value: u64) -> Result<()> {
    let bits = width(order)?;
    check_value(value, bits)?;
    let (byte, shift) = locate(block.len(), bits, index)?;
    if bits < 8 {
        let mask = (max_of(bits) as u8) << shift;
        block[byte] = (block[byte] & !mask) | ((value as u8) << shift);
    } else {
        let n = (bits / 8) as usize;
        block[byte..byte + n].copy_from_slice(&value.to_be_bytes()[8 - n..]);
    }
    Ok(())
}

/// The bytes of a refcount block that hold refcount `index` with `2^order`-bit entries (a
/// whole byte for entries narrower than 8 bits): what to write back after [`set`]. An order
/// above 6 is taken as 6.
pub fn entry_bytes(order: u32, index: u64) -> std::ops::Range<usize> {
    let bits = 1u64 << order.min(6);
    let first = index.saturating_mul(bits) / 8;
    let last = index.saturating_add(1).saturating_mul(bits).div_ceil(8);
    usize::try_from(first).unwrap_or(usize::MAX)..usize::try_from(last).unwrap_or(usize::MAX)
}

/// [`set`] on just the bytes [`entry_bytes`] names (`entry`, cut from a block at
/// `entry_bytes(order, index)`): the same bits change as `set` on the whole block would.
/// Fails as `set` does, and for `entry` of another length than those bytes.
pub fn set_in_entry_bytes(entry: &mut [u8], order: u32, index: u64, value: u64) -> Result<()> {
    // Entries narrower than a byte share it: the entry's place among them.
    let within = if order < 3 { index % (8 >> order) } else { 0 };
    if entry.len() != entry_bytes(order, index).len() {
        return Err(FormatError::InvalidArgument {
            what: "refcount entry bytes",
            value: entry.len() as u64,
            reason: format!("refcount {index} of order {order} is not held by that many bytes"),
        });
    }
    set(entry, order, within, value)
}

fn check_value(value: u64, bits: u32) -> Result<()> {
    let max = max_of(bits);
    if value > max {
        return Err(FormatError::Overflow {
            what: "refcount",
            reason: format!(
                "value {value:#x} does not fit in a {bits}-bit refcount (max {max:#x})"
            ),
        });
    }
    Ok(())
}

/// Decodes every refcount of a refcount block with `2^order`-bit entries.
///
/// Fails for an order above 6 or a block that is not a whole number of entries.
pub fn decode_block(block: &[u8], order: u32) -> Result<Vec<u64>> {
    let bits = width(order)?;
    check_block_len(block.len(), bits)?;
    Ok(match bits {
        1 | 2 | 4 => {
            let mask = max_of(bits) as u8;
            block
                .iter()
                .flat_map(|&b| (0..8 / bits).map(move |k| u64::from((b >> (k * bits)) & mask)))
                .collect()
        }
        _ => block
            .chunks_exact((bits / 8) as usize)
            .map(|c| c.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
            .collect(),
    })
}

/// Encodes refcounts into a refcount block with `2^order`-bit entries.
///
/// Sub-byte entries are padded with zero refcounts up to a whole byte. Fails for an order
/// above 6 or any value above the width's maximum.
pub fn encode_block(values: &[u64], order: u32) -> Result<Vec<u8>> {
    let bits = width(order)?;
    for &v in values {
        check_value(v, bits)?;
    }
    Ok(match bits {
        1 | 2 | 4 => values
            .chunks(8 / bits as usize)
            .map(|group| {
                group
                    .iter()
                    .zip((0..).step_by(bits as usize))
                    .fold(0u8, |acc, (&v, shift)| acc | ((v as u8) << shift))
            })
            .collect(),
        _ => {
            let n = (bits / 8) as usize;
            values
                .iter()
                .flat_map(|v| v.to_be_bytes()[8 - n..].to_vec())
                .collect()
        }
    })
}

fn check_block_len(len: usize, bits: u32) -> Result<()> {
    if bits >= 8 && len % (bits / 8) as usize != 0 {
        return Err(FormatError::InvalidArgument {
            what: "refcount block length",
            value: len as u64,
            reason: format!("not a whole number of {bits}-bit refcounts"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const CS: u64 = 0x10000;

    #[test]
    fn four_bit_byte_zero_holds_entry_one_high_and_entry_zero_low() {
        let mut block = [0u8; 4];
        set(&mut block, 2, 0, 0x3).unwrap();
        set(&mut block, 2, 1, 0xA).unwrap();
        assert_eq!(block[0], (0xA << 4) | 0x3);
        assert_eq!(get(&block, 2, 0).unwrap(), 0x3);
        assert_eq!(get(&block, 2, 1).unwrap(), 0xA);
    }

    #[test]
    fn one_bit_entries_fill_a_byte_from_the_least_significant_bit() {
        let block = [0b0000_0101u8, 0x80];
        let values = decode_block(&block, 0).unwrap();
        assert_eq!(&values[..8], &[1, 0, 1, 0, 0, 0, 0, 0]);
        assert_eq!(values[15], 1);
        assert_eq!(values.len(), 16);
    }

    #[test]
    fn two_bit_entries_pack_four_to_a_byte() {
        assert_eq!(
            encode_block(&[1, 2, 3, 0, 3], 1).unwrap(),
            vec![0b00_11_10_01, 0b11]
        );
    }

    #[test]
    fn sixteen_bit_entries_are_big_endian_at_twice_the_index() {
        let mut block = [0u8; 8];
        set(&mut block, 4, 2, 0x1234).unwrap();
        assert_eq!(block, [0, 0, 0, 0, 0x12, 0x34, 0, 0]);
        assert_eq!(get(&block, 4, 2).unwrap(), 0x1234);
    }

    #[test]
    fn sixty_four_bit_entries_hold_u64_max() {
        let mut block = [0u8; 16];
        set(&mut block, 6, 1, u64::MAX).unwrap();
        assert_eq!(get(&block, 6, 1).unwrap(), u64::MAX);
        assert_eq!(get(&block, 6, 0).unwrap(), 0);
    }

    #[test]
    fn a_value_above_the_width_is_rejected_naming_value_and_width() {
        let mut block = [0u8; 8];
        let msg = set(&mut block, 4, 0, 0x1_0000).unwrap_err().to_string();
        assert!(msg.contains("0x10000") && msg.contains("16-bit"), "{msg}");
        let msg = set(&mut block, 0, 3, 2).unwrap_err().to_string();
        assert!(msg.contains("0x2") && msg.contains("1-bit"), "{msg}");
        assert_eq!(block, [0; 8]);
        let msg = encode_block(&[0, 0x100], 3).unwrap_err().to_string();
        assert!(msg.contains("0x100") && msg.contains("8-bit"), "{msg}");
    }

    #[test]
    fn an_index_past_the_block_is_an_error_not_a_panic() {
        let mut block = [0u8; 4];
        assert!(get(&block, 2, 8).is_err());
        assert!(get(&block, 2, 7).is_ok());
        assert!(get(&block, 6, 0).is_err());
        assert!(get(&block, 5, u64::MAX).is_err());
        assert!(set(&mut block, 4, 2, 1).is_err());
        let msg = get(&block, 7, 0).unwrap_err().to_string();
        assert!(msg.contains("refcount_order 0x7"), "{msg}");
    }

    #[test]
    fn a_block_of_partial_wide_entries_is_rejected() {
        assert!(decode_block(&[0; 12], 6).is_err());
        assert_eq!(decode_block(&[0; 12], 5).unwrap().len(), 3);
    }

    #[test]
    fn reftable_reserved_bits_are_rejected_naming_bits_and_offset() {
        let msg = RefcountTableEntry::decode(0x2_0001, CS, 0x1_0008)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("reserved bits 0x1 ") && msg.contains("0x10008"),
            "{msg}"
        );
    }

    #[test]
    fn an_unaligned_refcount_block_offset_is_rejected_naming_it() {
        let msg = RefcountTableEntry::decode(0x2_0200, CS, 0x1_0010)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("0x20200") && msg.contains("0x10010"), "{msg}");
    }

    #[test]
    fn reftable_entries_have_no_upper_reserved_bits() {
        let e = RefcountTableEntry::decode(0xFF00_0000_0002_0000, CS, 0).unwrap();
        assert_eq!(e.block_offset, Some(HostOffset(0xFF00_0000_0002_0000)));
        assert_eq!(
            RefcountTableEntry::decode(0, CS, 0).unwrap(),
            RefcountTableEntry::UNALLOCATED
        );
    }

    #[test]
    fn a_reftable_error_names_the_offset_of_the_bad_entry() {
        let mut bytes = encode_table(&[RefcountTableEntry::UNALLOCATED; 3]);
        bytes[15] = 0x10;
        let msg = decode_table(&bytes, CS, 0x1_0000).unwrap_err().to_string();
        assert!(msg.contains("offset 0x10008"), "{msg}");
    }

    fn order_and_values() -> impl Strategy<Value = (u32, Vec<u64>)> {
        (0u32..=6).prop_flat_map(|order| {
            let max = u64::MAX >> (64 - (1 << order));
            // A whole number of bytes' worth of entries.
            let per_byte = if order < 3 { 8 >> order } else { 1 };
            (
                Just(order),
                prop::collection::vec(0..=max, 0..32).prop_map(move |mut v| {
                    v.truncate(v.len() / per_byte * per_byte);
                    v
                }),
            )
        })
    }

    proptest! {
        #[test]
        fn blocks_round_trip_for_every_width((order, values) in order_and_values()) {
            let bytes = encode_block(&values, order).unwrap();
            prop_assert_eq!(bytes.len() * 8, values.len() << order);
            prop_assert_eq!(&decode_block(&bytes, order).unwrap(), &values);
            for (i, &v) in values.iter().enumerate() {
                prop_assert_eq!(get(&bytes, order, i as u64).unwrap(), v);
            }
        }

        #[test]
        fn raw_blocks_round_trip_for_every_width(
            order in 0u32..=6, bytes in prop::collection::vec(any::<u8>(), 0..8),
        ) {
            let bytes: Vec<u8> = bytes.repeat(8);
            let values = decode_block(&bytes, order).unwrap();
            prop_assert_eq!(encode_block(&values, order).unwrap(), bytes);
        }

        #[test]
        fn set_changes_only_its_own_entry(
            (order, values) in order_and_values(), index in any::<prop::sample::Index>(),
            value in any::<u64>(),
        ) {
            prop_assume!(!values.is_empty());
            let i = index.index(values.len());
            let value = value & (u64::MAX >> (64 - (1 << order)));
            let mut bytes = encode_block(&values, order).unwrap();
            set(&mut bytes, order, i as u64, value).unwrap();
            let mut expected = values.clone();
            expected[i] = value;
            prop_assert_eq!(decode_block(&bytes, order).unwrap(), expected);
        }

        #[test]
        fn reftable_entries_round_trip(bits in 9u32..=21, raw in any::<u64>()) {
            let valid = raw & !((1u64 << bits) - 1);
            let e = RefcountTableEntry::decode(valid, 1 << bits, 0).unwrap();
            prop_assert_eq!(e.encode(), valid);
            prop_assert_eq!(RefcountTableEntry::decode(e.encode(), 1 << bits, 0).unwrap(), e);
            let bytes = encode_table(&[e, RefcountTableEntry::UNALLOCATED]);
            prop_assert_eq!(decode_table(&bytes, 1 << bits, 0).unwrap(), vec![e, RefcountTableEntry::UNALLOCATED]);
        }

        #[test]
        fn block_access_never_panics(
            len in 0usize..20, order in 0u32..8, index in any::<u64>(), value in any::<u64>(),
        ) {
            let mut block = vec![0u8; len];
            let _ = get(&block, order, index);
            let _ = set(&mut block, order, index, value);
            let _ = decode_block(&block, order);
        }
    }

    #[test]
    fn entry_bytes_cover_the_entry_set_writes() {
        assert_eq!(entry_bytes(4, 3), 6..8);
        assert_eq!(entry_bytes(0, 9), 1..2);
        assert_eq!(entry_bytes(6, 1), 8..16);
        for order in 0..=6 {
            for index in 0..64 {
                let mut a = vec![0u8; 512];
                set(&mut a, order, index, 1).unwrap();
                let r = entry_bytes(order, index);
                assert!(a.iter().enumerate().all(|(i, &b)| b == 0 || r.contains(&i)));
            }
        }
    }

    #[test]
    fn setting_the_entry_bytes_alone_changes_what_setting_the_block_does() {
        for order in 0..=6 {
            let max = if order == 6 {
                u64::MAX
            } else {
                (1u64 << (1 << order)) - 1
            };
            for index in 0..40 {
                let mut whole = vec![0xA5u8; 512];
                let mut part = whole.clone();
                set(&mut whole, order, index, max / 3).unwrap();
                let r = entry_bytes(order, index);
                set_in_entry_bytes(&mut part[r.clone()], order, index, max / 3).unwrap();
                assert_eq!(whole, part, "order {order}, index {index}");
                assert_eq!(get(&part, order, index).unwrap(), max / 3);
            }
        }
        let mut short = [0u8; 1];
        assert!(set_in_entry_bytes(&mut short, 4, 3, 1).is_err());
    }
}

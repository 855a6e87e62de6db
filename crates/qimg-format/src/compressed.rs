//! Compressed cluster descriptors (spec §3.3): bits 0..=61 of an L2 entry whose bit 62 is set.
//!
//! With `x = 62 - (cluster_bits - 8)`, bits `0..x` hold the host *byte* offset of the compressed
//! data and bits `x..62` the number of 512-byte sectors it occupies beyond the first one. The
//! offset field is wider than 56 bits for clusters below 16 KiB; those extra bits must be 0.

use crate::error::{FormatError, Result};
use crate::geometry::{MAX_CLUSTER_BITS, MIN_CLUSTER_BITS, QCOW_MAX_CLUSTER_OFFSET};
use crate::units::{ClusterIndex, HostOffset};

/// Bits 0..=61 of an L2 entry: the descriptor proper.
pub const DESCRIPTOR_MASK: u64 = (1 << 62) - 1;
/// Sector size the count field is expressed in.
pub const SECTOR_SIZE: u64 = 512;

/// Widths of the two fields of a descriptor for one cluster size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CompressedLayout {
    /// `x`: the offset occupies bits `0..x`.
    pub offset_bits: u32,
    /// The additional-sector count occupies bits `x..62` (`cluster_bits - 8` bits).
    pub count_bits: u32,
}

impl CompressedLayout {
    /// The layout for `cluster_bits` (9..=21).
    pub fn new(cluster_bits: u32) -> Result<Self> {
        if !(MIN_CLUSTER_BITS..=MAX_CLUSTER_BITS).contains(&cluster_bits) {
            return Err(FormatError::InvalidArgument {
                what: "cluster_bits for a compressed descriptor",
                value: cluster_bits.into(),
                reason: format!("must be {MIN_CLUSTER_BITS}..={MAX_CLUSTER_BITS}"),
            });
        }
        let count_bits = cluster_bits - 8;
        Ok(Self {
            offset_bits: 62 - count_bits,
            count_bits,
        })
    }

    /// Largest host byte offset the descriptor can hold (also bounded by `2^56 - 1`).
    pub fn max_offset(&self) -> u64 {
        ((1u64 << self.offset_bits) - 1).min(QCOW_MAX_CLUSTER_OFFSET)
    }

    /// Largest value of the additional-sector count.
    pub fn max_additional_sectors(&self) -> u64 {
        (1 << self.count_bits) - 1
    }
}

/// A decoded compressed cluster descriptor.
///
/// Fields are private so that every value is known to fit its on-disk fields; the cluster size
/// is kept alongside because it decides where the fields are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CompressedDescriptor {
    host_offset: u64,
    additional_sectors: u64,
    cluster_bits: u32,
}

impl CompressedDescriptor {
    /// Decodes the descriptor in bits 0..=61 of `raw` (bits 62 and 63 belong to the L2 entry
    /// and are ignored) for an image with `cluster_bits`; `at` is the entry's file offset, used
    /// only in errors.
    pub fn decode(raw: u64, cluster_bits: u32, at: u64) -> Result<Self> {
        let layout = CompressedLayout::new(cluster_bits)?;
        let desc = raw & DESCRIPTOR_MASK;
        let host_offset = desc & ((1u64 << layout.offset_bits) - 1);
        let high = host_offset & !QCOW_MAX_CLUSTER_OFFSET;
        if high != 0 {
            return Err(FormatError::ReservedBits {
                what: "compressed cluster descriptor (offset bits above 55)",
                offset: at,
                bits: high,
                value: raw,
            });
        }
        Ok(Self {
            host_offset,
            additional_sectors: desc >> layout.offset_bits,
            cluster_bits,
        })
    }

    /// The descriptor bits (0..=61); the caller adds the L2 entry's compressed flag.
    pub fn encode(&self) -> u64 {
        let x = 62 - (self.cluster_bits - 8);
        self.host_offset | (self.additional_sectors << x)
    }

    /// Describes `compressed_len` bytes of compressed data stored at byte `host_offset`, the
    /// way QEMU's writer does: the count is the number of 512-byte sectors touched after the
    /// one holding the first byte.
    ///
    /// Fails if the data is empty, if the offset does not fit its field, or if the data spans
    /// more sectors than the count field can express.
    pub fn new(host_offset: u64, compressed_len: u64, cluster_bits: u32) -> Result<Self> {
        let layout = CompressedLayout::new(cluster_bits)?;
        if compressed_len == 0 {
            return Err(FormatError::InvalidArgument {
                what: "compressed length",
                value: 0,
                reason: "compressed data cannot be empty".into(),
            });
        }
        if host_offset > layout.max_offset() {
            return Err(FormatError::Overflow {
                what: "compressed cluster descriptor",
                reason: format!(
                    "host offset {host_offset:#x} exceeds the largest offset {:#x} the \
                     descriptor holds for cluster_bits {cluster_bits}",
                    layout.max_offset()
                ),
            });
        }
        // host_offset < 2^56, so this only fails for absurd lengths.
        let last = host_offset.checked_add(compressed_len - 1);
        let additional = last.map(|l| l / SECTOR_SIZE - host_offset / SECTOR_SIZE);
        match additional {
            Some(n) if n <= layout.max_additional_sectors() => Ok(Self {
                host_offset,
                additional_sectors: n,
                cluster_bits,
            }),
            _ => Err(FormatError::Overflow {
                what: "compressed cluster descriptor",
                reason: format!(
                    "{compressed_len:#x} bytes at host offset {host_offset:#x} need more than \
                     the {} additional sectors the {}-bit count field holds",
                    layout.max_additional_sectors(),
                    layout.count_bits
                ),
            }),
        }
    }

    /// Host byte offset where the compressed data starts.
    pub fn host_offset(&self) -> HostOffset {
        HostOffset(self.host_offset)
    }

    /// The raw count field: 512-byte sectors used beyond the one holding the first byte.
    pub fn additional_sectors(&self) -> u64 {
        self.additional_sectors
    }

    /// `log2` of the cluster size this descriptor was decoded for.
    pub fn cluster_bits(&self) -> u32 {
        self.cluster_bits
    }

    /// Bytes to read starting at [`host_offset`](Self::host_offset): up to the end of the last
    /// sector, `(additional_sectors + 1) * 512 - (host_offset % 512)`. Always at least 1.
    pub fn compressed_size_bytes(&self) -> u64 {
        // additional_sectors < 2^13: no overflow.
        (self.additional_sectors + 1) * SECTOR_SIZE - (self.host_offset % SECTOR_SIZE)
    }

    /// The host clusters the compressed bytes touch, as (first cluster, number of clusters).
    /// Each of them carries one reference for this descriptor.
    pub fn host_clusters(&self) -> (ClusterIndex, u64) {
        // host_offset < 2^56 and the size < 2^22, so the sum cannot overflow.
        let last_byte = self
            .host_offset
            .saturating_add(self.compressed_size_bytes() - 1);
        let first = self.host_offset >> self.cluster_bits;
        let last = last_byte >> self.cluster_bits;
        (ClusterIndex(first), last - first + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn field_widths_match_the_spec_table() {
        for (bits, x, width) in [
            (9, 61, 1),
            (12, 58, 4),
            (14, 56, 6),
            (16, 54, 8),
            (21, 49, 13),
        ] {
            let l = CompressedLayout::new(bits).unwrap();
            assert_eq!(
                (l.offset_bits, l.count_bits),
                (x, width),
                "cluster_bits {bits}"
            );
        }
    }

    #[test]
    fn with_64k_clusters_the_count_starts_at_bit_54() {
        let raw = (3u64 << 54) | 0x12_3456;
        let d = CompressedDescriptor::decode(raw, 16, 0).unwrap();
        assert_eq!(d.host_offset(), HostOffset(0x12_3456));
        assert_eq!(d.additional_sectors(), 3);
        assert_eq!(d.compressed_size_bytes(), 4 * 512 - 0x56);
        assert_eq!(d.encode(), raw);
    }

    #[test]
    fn with_2m_clusters_offsets_are_limited_to_49_bits() {
        let d = CompressedDescriptor::decode((1u64 << 49) | ((1 << 49) - 1), 21, 0).unwrap();
        assert_eq!(d.host_offset().0, (1 << 49) - 1);
        assert_eq!(d.additional_sectors(), 1);
    }

    #[test]
    fn bits_62_and_63_are_not_part_of_the_descriptor() {
        let d = CompressedDescriptor::decode((1 << 62) | (1 << 63) | 0x200, 16, 0).unwrap();
        assert_eq!(d.encode(), 0x200);
    }

    #[test]
    fn offset_bits_above_55_are_rejected_with_512_byte_clusters_naming_them() {
        let raw = (1u64 << 60) | 0x1000;
        let msg = CompressedDescriptor::decode(raw, 9, 0x2_0010)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("reserved bits 0x1000000000000000"), "{msg}");
        assert!(msg.contains("0x20010"), "{msg}");
        // For 512-byte clusters, bit 61 is the count field and fine.
        assert_eq!(
            CompressedDescriptor::decode(1u64 << 61, 9, 0)
                .unwrap()
                .additional_sectors(),
            1
        );
    }

    #[test]
    fn offset_bits_56_and_57_are_rejected_with_4k_clusters() {
        let msg = CompressedDescriptor::decode(1u64 << 57, 12, 0x88)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("0x200000000000000") && msg.contains("0x88"),
            "{msg}"
        );
        assert!(CompressedDescriptor::decode(1u64 << 58, 12, 0).is_ok());
    }

    #[test]
    fn new_counts_the_sectors_after_the_first_like_qemu() {
        // 900 bytes starting 100 bytes into a sector end in the next sector...
        let d = CompressedDescriptor::new(0x1_0064, 900, 16).unwrap();
        assert_eq!(d.additional_sectors(), 1);
        assert_eq!(d.compressed_size_bytes(), 1024 - 100);
        // ... 1000 bytes spill into the one after.
        assert_eq!(
            CompressedDescriptor::new(0x1_0064, 1000, 16)
                .unwrap()
                .additional_sectors(),
            2
        );
        // Exactly one sector, aligned.
        assert_eq!(
            CompressedDescriptor::new(0x200, 512, 16)
                .unwrap()
                .additional_sectors(),
            0
        );
    }

    #[test]
    fn new_rejects_a_count_that_does_not_fit_naming_the_length() {
        // 512-byte clusters: at most one additional sector.
        let msg = CompressedDescriptor::new(0x100, 0x301, 9)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("0x301") && msg.contains("0x100") && msg.contains("1-bit"),
            "{msg}"
        );
    }

    #[test]
    fn new_rejects_an_offset_beyond_the_field_naming_it() {
        let msg = CompressedDescriptor::new(1 << 49, 10, 21)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("0x2000000000000"), "{msg}");
        assert!(CompressedDescriptor::new(1 << 56, 10, 9).is_err());
        assert!(CompressedDescriptor::new(0, 0, 16).is_err());
        assert!(CompressedDescriptor::new(0, 1, 22).is_err());
    }

    #[test]
    fn data_crossing_a_cluster_boundary_touches_two_host_clusters() {
        let d = CompressedDescriptor::new(0x1_FF00, 0x200, 16).unwrap();
        assert_eq!(d.host_clusters(), (ClusterIndex(1), 2));
        let inside = CompressedDescriptor::new(0x1_0000, 0x200, 16).unwrap();
        assert_eq!(inside.host_clusters(), (ClusterIndex(1), 1));
    }

    fn bits_and_descriptor() -> impl Strategy<Value = (u32, u64, u64)> {
        (9u32..=21).prop_flat_map(|bits| {
            let l = CompressedLayout::new(bits).unwrap();
            (
                Just(bits),
                0..=l.max_offset(),
                0..=l.max_additional_sectors(),
            )
        })
    }

    proptest! {
        #[test]
        fn encode_of_decode_keeps_every_bit_of_a_valid_word((bits, off, n) in bits_and_descriptor()) {
            let x = 62 - (bits - 8);
            let raw = off | (n << x);
            let d = CompressedDescriptor::decode(raw, bits, 0).unwrap();
            prop_assert_eq!((d.host_offset().0, d.additional_sectors()), (off, n));
            prop_assert_eq!(d.encode(), raw);
            prop_assert_eq!(CompressedDescriptor::decode(d.encode(), bits, 0).unwrap(), d);
        }

        #[test]
        fn new_covers_the_data_and_touches_only_its_clusters(
            bits in 9u32..=21, off in 0u64..(1 << 48), len in 1u64..(1 << 21),
        ) {
            if let Ok(d) = CompressedDescriptor::new(off, len, bits) {
                prop_assert!(d.compressed_size_bytes() >= len);
                prop_assert!(d.compressed_size_bytes() < len + 512);
                let (first, count) = d.host_clusters();
                prop_assert_eq!(first.0, off >> bits);
                prop_assert_eq!(first.0 + count - 1, (off + d.compressed_size_bytes() - 1) >> bits);
                prop_assert_eq!(CompressedDescriptor::decode(d.encode(), bits, 0).unwrap(), d);
            } else {
                // Only a length that cannot fit from any start offset may fail.
                let max_add = CompressedLayout::new(bits).unwrap().max_additional_sectors();
                prop_assert!(len > max_add * 512 + 1);
            }
        }

        #[test]
        fn decoding_never_panics(raw in any::<u64>(), bits in any::<u32>()) {
            let _ = CompressedDescriptor::decode(raw, bits, 0);
        }
    }
}

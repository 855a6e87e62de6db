//! Newtypes for the units qcow2 mixes up easily.
//!
//! A guest offset (position on the virtual disk) and a host offset (position in the image or
//! data file) are both byte counts held in a `u64`; a cluster index and a subcluster index are
//! counts of something else again. Each gets its own type so that a function that wants one
//! cannot silently be handed another. Offsets display as hexadecimal, indices as decimal.

use std::fmt;

/// A byte offset on the virtual disk, as the guest sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct GuestOffset(pub u64);

/// A byte offset in the image file (or in the external data file, for data clusters of an
/// image that has one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct HostOffset(pub u64);

/// The index of a cluster: `offset >> cluster_bits`, for host or guest offsets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ClusterIndex(pub u64);

/// The index of a subcluster inside its cluster, `0..32` in images with extended L2 entries and
/// always `0` in standard images (where each cluster is its own single subcluster).
///
/// Functions that turn the index into a bitmap bit use only its low five bits, so an index of
/// 32 or more can never cause a panic; it simply names `index % 32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct SubclusterIndex(pub u32);

impl GuestOffset {
    /// `self + bytes`, or `None` on overflow.
    pub fn checked_add(self, bytes: u64) -> Option<Self> {
        self.0.checked_add(bytes).map(Self)
    }
}

impl HostOffset {
    /// `self + bytes`, or `None` on overflow.
    pub fn checked_add(self, bytes: u64) -> Option<Self> {
        self.0.checked_add(bytes).map(Self)
    }

    /// The host cluster this offset lies in.
    ///
    /// `cluster_bits` above 63 yields cluster 0 rather than panicking.
    pub fn cluster(self, cluster_bits: u32) -> ClusterIndex {
        ClusterIndex(self.0.checked_shr(cluster_bits).unwrap_or(0))
    }

    /// Whether the offset is a multiple of `align`. An `align` of zero is never satisfied.
    pub fn is_aligned(self, align: u64) -> bool {
        is_multiple_of(self.0, align)
    }
}

impl ClusterIndex {
    /// The byte offset where this cluster starts, or `None` if it does not fit in a `u64`.
    pub fn host_offset(self, cluster_bits: u32) -> Option<HostOffset> {
        shl_exact(self.0, cluster_bits).map(HostOffset)
    }

    /// The byte offset where this guest cluster starts, or `None` if it does not fit in a `u64`.
    pub fn guest_offset(self, cluster_bits: u32) -> Option<GuestOffset> {
        shl_exact(self.0, cluster_bits).map(GuestOffset)
    }
}

impl SubclusterIndex {
    /// Number of subclusters in a cluster of an image with extended L2 entries.
    pub const COUNT: u32 = 32;

    /// The index as a bit position `0..32` (its low five bits).
    pub fn bit(self) -> u32 {
        self.0 & (Self::COUNT - 1)
    }
}

/// `value << bits`, or `None` when bits would be shifted out.
fn shl_exact(value: u64, bits: u32) -> Option<u64> {
    let shifted = value.checked_shl(bits)?;
    (shifted.checked_shr(bits) == Some(value)).then_some(shifted)
}

/// Whether `value` is a multiple of `align` (false for `align == 0`).
pub(crate) fn is_multiple_of(value: u64, align: u64) -> bool {
    value.checked_rem(align) == Some(0)
}

impl fmt::Display for GuestOffset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl fmt::Display for HostOffset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl fmt::Display for ClusterIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl fmt::Display for SubclusterIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn offsets_display_as_hex_and_indices_as_decimal() {
        assert_eq!(GuestOffset(0x1000).to_string(), "0x1000");
        assert_eq!(HostOffset(0x30000).to_string(), "0x30000");
        assert_eq!(ClusterIndex(3).to_string(), "3");
        assert_eq!(SubclusterIndex(31).to_string(), "31");
    }

    #[test]
    fn a_cluster_index_too_large_for_a_byte_offset_gives_none() {
        assert_eq!(ClusterIndex(1 << 48).host_offset(16), None);
        assert_eq!(
            ClusterIndex(1 << 47).host_offset(16),
            Some(HostOffset(1 << 63))
        );
        assert_eq!(ClusterIndex(1).guest_offset(64), None);
    }

    #[test]
    fn zero_alignment_is_never_satisfied() {
        assert!(!HostOffset(0).is_aligned(0));
        assert!(HostOffset(0x20000).is_aligned(0x10000));
        assert!(!HostOffset(0x20200).is_aligned(0x10000));
    }

    #[test]
    fn subcluster_bits_wrap_instead_of_panicking() {
        assert_eq!(SubclusterIndex(5).bit(), 5);
        assert_eq!(SubclusterIndex(37).bit(), 5);
    }

    proptest! {
        #[test]
        fn cluster_of_a_host_offset_round_trips_to_its_start(off in any::<u64>(), bits in 9u32..=21) {
            let c = HostOffset(off).cluster(bits);
            let start = c.host_offset(bits).unwrap();
            prop_assert!(start.0 <= off && off - start.0 < (1 << bits));
        }
    }
}

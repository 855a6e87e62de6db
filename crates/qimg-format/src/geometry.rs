//! Cluster geometry: every size and index that follows from `cluster_bits`, the extended-L2 flag
//! and `refcount_order`, plus QEMU's size limits.
//!
//! [`Geometry`] answers "where is guest offset X described" (L1 index, L2 index, subcluster) and
//! [`RefcountGeometry`] answers "where is the refcount of host offset Y" (refcount table index,
//! refcount block index). Both are validated on construction, so their methods cannot fail and
//! cannot overflow.

use crate::error::{FormatError, Result};
use crate::units::{ClusterIndex, GuestOffset, HostOffset, SubclusterIndex};

/// Smallest `cluster_bits` QEMU accepts (512-byte clusters).
pub const MIN_CLUSTER_BITS: u32 = 9;
/// Largest `cluster_bits` QEMU accepts (2 MiB clusters).
pub const MAX_CLUSTER_BITS: u32 = 21;
/// Smallest `cluster_bits` allowed with extended L2 entries (512-byte subclusters).
pub const MIN_EXTENDED_L2_CLUSTER_BITS: u32 = 14;
/// Subclusters per cluster in an image with extended L2 entries.
pub const SUBCLUSTERS_PER_EXTENDED_CLUSTER: u32 = 32;
/// QEMU's limit on the size of an L1 table in bytes (32 MiB, i.e. 4 Mi entries).
pub const QCOW_MAX_L1_SIZE: u64 = 32 << 20;
/// QEMU's limit on the size of the refcount table in bytes (8 MiB, i.e. 1 Mi entries).
pub const QCOW_MAX_REFTABLE_SIZE: u64 = 8 << 20;
/// Largest host offset an L1 or L2 entry can hold (`2^56 - 1`).
pub const QCOW_MAX_CLUSTER_OFFSET: u64 = (1 << 56) - 1;
/// Largest `refcount_order` (64-bit refcounts).
pub const MAX_REFCOUNT_ORDER: u32 = 6;
/// Size in bytes of one L1 entry and of one refcount table entry.
pub const TABLE_ENTRY_SIZE: u64 = 8;

/// Header offset of `cluster_bits`, named in errors.
const CLUSTER_BITS_FIELD: u64 = 0x14;
/// Header offset of `size`, named in errors.
const SIZE_FIELD: u64 = 0x18;
/// Header offset of `refcount_order`, named in errors.
const REFCOUNT_ORDER_FIELD: u64 = 0x60;

fn check_cluster_bits(cluster_bits: u32) -> Result<()> {
    if (MIN_CLUSTER_BITS..=MAX_CLUSTER_BITS).contains(&cluster_bits) {
        Ok(())
    } else {
        Err(FormatError::InvalidField {
            what: "cluster_bits",
            offset: CLUSTER_BITS_FIELD,
            value: cluster_bits.into(),
            reason: format!(
                "cluster sizes from 512 bytes to 2 MiB are supported \
                 (cluster_bits {MIN_CLUSTER_BITS}..={MAX_CLUSTER_BITS})"
            ),
        })
    }
}

/// The mapping geometry of an image: cluster size and L2 entry format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Geometry {
    cluster_bits: u32,
    extended_l2: bool,
}

/// Where the L2 entry of a guest offset lives when L2 tables are handled in slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct L2SlicePosition {
    /// Index into the L1 table (which L2 table).
    pub l1_index: u64,
    /// Which slice of that L2 table.
    pub slice_index: u64,
    /// Index of the entry inside the slice.
    pub index_in_slice: u64,
}

impl Geometry {
    /// Validates `cluster_bits` (9..=21) and the extended-L2 requirement (`cluster_bits >= 14`).
    pub fn new(cluster_bits: u32, extended_l2: bool) -> Result<Self> {
        check_cluster_bits(cluster_bits)?;
        if extended_l2 && cluster_bits < MIN_EXTENDED_L2_CLUSTER_BITS {
            return Err(FormatError::InvalidField {
                what: "cluster_bits",
                offset: CLUSTER_BITS_FIELD,
                value: cluster_bits.into(),
                reason: format!(
                    "extended L2 entries need cluster_bits >= {MIN_EXTENDED_L2_CLUSTER_BITS} \
                     (subclusters of at least 512 bytes)"
                ),
            });
        }
        Ok(Self {
            cluster_bits,
            extended_l2,
        })
    }

    /// `log2(cluster_size)`.
    pub fn cluster_bits(&self) -> u32 {
        self.cluster_bits
    }

    /// Whether L2 entries are the 128-bit extended kind.
    pub fn extended_l2(&self) -> bool {
        self.extended_l2
    }

    /// Cluster size in bytes.
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// Size of one L2 entry in bytes: 8, or 16 with extended L2 entries.
    pub fn l2_entry_size(&self) -> u64 {
        if self.extended_l2 { 16 } else { 8 }
    }

    /// `log2(l2_entries)`.
    pub fn l2_bits(&self) -> u32 {
        self.cluster_bits - if self.extended_l2 { 4 } else { 3 }
    }

    /// Entries in one L2 table (one cluster).
    pub fn l2_entries(&self) -> u64 {
        1 << self.l2_bits()
    }

    /// Guest bytes described by one L2 table.
    pub fn l2_coverage(&self) -> u64 {
        1 << (self.cluster_bits + self.l2_bits())
    }

    /// Subclusters per cluster: 32 with extended L2 entries, else 1.
    pub fn subclusters_per_cluster(&self) -> u32 {
        if self.extended_l2 {
            SUBCLUSTERS_PER_EXTENDED_CLUSTER
        } else {
            1
        }
    }

    /// `log2(subcluster_size)`; equals `cluster_bits` in standard images.
    pub fn subcluster_bits(&self) -> u32 {
        if self.extended_l2 {
            self.cluster_bits - 5
        } else {
            self.cluster_bits
        }
    }

    /// Subcluster size in bytes; the cluster size in standard images.
    pub fn subcluster_size(&self) -> u64 {
        1 << self.subcluster_bits()
    }

    /// The guest cluster containing `guest`.
    pub fn guest_cluster(&self, guest: GuestOffset) -> ClusterIndex {
        ClusterIndex(guest.0 >> self.cluster_bits)
    }

    /// Index into the L1 table of the L2 table describing `guest`.
    pub fn l1_index(&self, guest: GuestOffset) -> u64 {
        guest.0 >> (self.cluster_bits + self.l2_bits())
    }

    /// Index of the entry for `guest` inside its L2 table.
    pub fn l2_index(&self, guest: GuestOffset) -> u64 {
        (guest.0 >> self.cluster_bits) & (self.l2_entries() - 1)
    }

    /// Byte offset of `guest` inside its cluster.
    pub fn offset_in_cluster(&self, guest: GuestOffset) -> u64 {
        guest.0 & (self.cluster_size() - 1)
    }

    /// Subcluster of `guest` inside its cluster (always 0 in standard images).
    pub fn subcluster_index(&self, guest: GuestOffset) -> SubclusterIndex {
        let within = self.offset_in_cluster(guest) >> self.subcluster_bits();
        // At most 31, so the conversion cannot fail.
        SubclusterIndex(u32::try_from(within).unwrap_or(0))
    }

    /// Number of L2 entries in a slice of `slice_bytes` bytes.
    ///
    /// The slice size must be a power of two from 512 bytes up to the cluster size (QEMU's rule
    /// for `l2-cache-entry-size`).
    pub fn l2_slice_entries(&self, slice_bytes: u64) -> Result<u64> {
        if !slice_bytes.is_power_of_two() || slice_bytes < 512 || slice_bytes > self.cluster_size()
        {
            return Err(FormatError::InvalidArgument {
                what: "L2 slice size",
                value: slice_bytes,
                reason: format!(
                    "must be a power of two between 0x200 and the cluster size {:#x}",
                    self.cluster_size()
                ),
            });
        }
        Ok(slice_bytes / self.l2_entry_size())
    }

    /// Which L2 table, which slice of it, and which entry in that slice describe `guest`.
    pub fn l2_slice_position(
        &self,
        guest: GuestOffset,
        slice_bytes: u64,
    ) -> Result<L2SlicePosition> {
        let per_slice = self.l2_slice_entries(slice_bytes)?;
        let l2_index = self.l2_index(guest);
        Ok(L2SlicePosition {
            l1_index: self.l1_index(guest),
            slice_index: l2_index / per_slice,
            index_in_slice: l2_index % per_slice,
        })
    }

    /// The minimum number of L1 entries for a virtual disk of `virtual_size` bytes,
    /// `ceil(virtual_size / l2_coverage)`.
    ///
    /// Fails like `qemu-img create` when the table would exceed [`QCOW_MAX_L1_SIZE`].
    pub fn l1_size_for(&self, virtual_size: u64) -> Result<u64> {
        let entries = virtual_size.div_ceil(self.l2_coverage());
        let max_entries = QCOW_MAX_L1_SIZE / TABLE_ENTRY_SIZE;
        if entries > max_entries {
            return Err(FormatError::InvalidField {
                what: "size",
                offset: SIZE_FIELD,
                value: virtual_size,
                reason: format!(
                    "the image size {virtual_size:#x} is too large (try using a larger cluster \
                     size): it needs {entries} L1 entries, at most {max_entries} are allowed; \
                     the maximum with these clusters is {:#x}",
                    self.max_virtual_size()
                ),
            });
        }
        Ok(entries)
    }

    /// The largest virtual size QEMU's L1 limit allows with this geometry.
    pub fn max_virtual_size(&self) -> u64 {
        // 2^22 entries * 2^(cluster_bits + l2_bits) <= 2^22 * 2^39 = 2^61: no overflow.
        (QCOW_MAX_L1_SIZE / TABLE_ENTRY_SIZE) << (self.cluster_bits + self.l2_bits())
    }
}

/// The refcount geometry of an image: cluster size and refcount width.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RefcountGeometry {
    cluster_bits: u32,
    refcount_order: u32,
}

/// Clusters of refcount metadata computed by [`RefcountGeometry::refcount_metadata_for`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RefcountMetadata {
    /// Clusters of refcount table.
    pub table_clusters: u64,
    /// Refcount blocks.
    pub block_clusters: u64,
}

impl RefcountMetadata {
    /// Table plus blocks, in clusters.
    pub fn total_clusters(&self) -> u64 {
        // Both are at most the input cluster count (validated by the computation).
        self.table_clusters.saturating_add(self.block_clusters)
    }
}

impl RefcountGeometry {
    /// Validates `cluster_bits` (9..=21) and `refcount_order` (0..=6).
    pub fn new(cluster_bits: u32, refcount_order: u32) -> Result<Self> {
        check_cluster_bits(cluster_bits)?;
        if refcount_order > MAX_REFCOUNT_ORDER {
            return Err(FormatError::InvalidField {
                what: "refcount_order",
                offset: REFCOUNT_ORDER_FIELD,
                value: refcount_order.into(),
                reason: format!(
                    "refcount widths are 1 to 64 bits (order 0..={MAX_REFCOUNT_ORDER})"
                ),
            });
        }
        Ok(Self {
            cluster_bits,
            refcount_order,
        })
    }

    /// `log2(cluster_size)`.
    pub fn cluster_bits(&self) -> u32 {
        self.cluster_bits
    }

    /// `log2(refcount_bits)`.
    pub fn refcount_order(&self) -> u32 {
        self.refcount_order
    }

    /// Cluster size in bytes.
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// Width of one refcount in bits (1, 2, 4, ..., 64).
    pub fn refcount_bits(&self) -> u32 {
        1 << self.refcount_order
    }

    /// Largest representable refcount, `2^refcount_bits - 1`.
    pub fn max_refcount(&self) -> u64 {
        u64::MAX >> (64 - self.refcount_bits())
    }

    /// `log2(refblock_entries)`.
    pub fn refblock_bits(&self) -> u32 {
        self.cluster_bits + 3 - self.refcount_order
    }

    /// Refcounts in one refcount block (one cluster).
    pub fn refblock_entries(&self) -> u64 {
        1 << self.refblock_bits()
    }

    /// Refcount table entries in one cluster of the refcount table.
    pub fn reftable_entries_per_cluster(&self) -> u64 {
        self.cluster_size() / TABLE_ENTRY_SIZE
    }

    /// Index into the refcount table of the block holding the refcount of `host`.
    pub fn reftable_index(&self, host: HostOffset) -> u64 {
        host.cluster(self.cluster_bits).0 >> self.refblock_bits()
    }

    /// Index inside its refcount block of the refcount of `host`.
    pub fn refblock_index(&self, host: HostOffset) -> u64 {
        host.cluster(self.cluster_bits).0 & (self.refblock_entries() - 1)
    }

    /// Most refcount table entries QEMU accepts ([`QCOW_MAX_REFTABLE_SIZE`] / 8).
    pub fn max_reftable_entries(&self) -> u64 {
        QCOW_MAX_REFTABLE_SIZE / TABLE_ENTRY_SIZE
    }

    /// Host bytes a maximal refcount table can describe, saturating at `u64::MAX`.
    pub fn max_host_size(&self) -> u64 {
        let bits = 20 + self.refblock_bits() + self.cluster_bits;
        1u64.checked_shl(bits).unwrap_or(u64::MAX)
    }

    /// How much refcount metadata (table and blocks) is needed to refcount `clusters` clusters of
    /// other data *and* the metadata itself.
    ///
    /// Refcount blocks and table clusters need refcounts too, which may need more blocks, which
    /// may need a bigger table. There is no neat closed form, so this starts from no metadata
    /// and repeatedly recomputes blocks = ceil((data + table + blocks) / refblock_entries) and
    /// table = ceil(blocks / entries_per_table_cluster) until the total stops changing. Each
    /// round only grows the estimate, by a factor of at most `1 / refblock_entries` of the
    /// previous growth, so this settles within a few rounds (this is the same fixed point QEMU
    /// computes when sizing a new image or a preallocated one; QEMU's optional "generous"
    /// extra for growing an existing table is left to the caller).
    ///
    /// Fails with [`FormatError::Overflow`] if the totals do not fit in a `u64`.
    pub fn refcount_metadata_for(&self, clusters: u64) -> Result<RefcountMetadata> {
        let overflow = || FormatError::Overflow {
            what: "refcount metadata size",
            reason: format!("covering {clusters} clusters does not fit in 64 bits"),
        };
        let per_block = self.refblock_entries();
        let per_table_cluster = self.reftable_entries_per_cluster();
        let mut meta = RefcountMetadata {
            table_clusters: 0,
            block_clusters: 0,
        };
        // 64 rounds are far more than ever needed; the bound only guards against a bug.
        for _ in 0..64 {
            let covered = clusters
                .checked_add(meta.table_clusters)
                .and_then(|n| n.checked_add(meta.block_clusters))
                .ok_or_else(overflow)?;
            let block_clusters = covered.div_ceil(per_block);
            let next = RefcountMetadata {
                block_clusters,
                table_clusters: block_clusters.div_ceil(per_table_cluster),
            };
            if next == meta {
                return Ok(meta);
            }
            meta = next;
        }
        Err(overflow())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const KIB: u64 = 1 << 10;
    const GIB: u64 = 1 << 30;
    const PIB: u64 = 1 << 50;
    const EIB: u64 = 1 << 60;

    #[test]
    fn default_geometry_has_64k_clusters_and_8192_l2_entries() {
        let g = Geometry::new(16, false).unwrap();
        assert_eq!(g.cluster_size(), 64 * KIB);
        assert_eq!(g.l2_entry_size(), 8);
        assert_eq!(g.l2_entries(), 8192);
        assert_eq!(g.l2_bits(), 13);
        assert_eq!(g.subclusters_per_cluster(), 1);
        assert_eq!(g.subcluster_size(), 64 * KIB);
    }

    #[test]
    fn extended_geometry_halves_l2_entries_and_splits_clusters_in_32() {
        let g = Geometry::new(16, true).unwrap();
        assert_eq!(g.l2_entry_size(), 16);
        assert_eq!(g.l2_entries(), 4096);
        assert_eq!(g.l2_bits(), 12);
        assert_eq!(g.subclusters_per_cluster(), 32);
        assert_eq!(g.subcluster_size(), 2 * KIB);
        assert_eq!(g.subcluster_bits(), 11);
        assert_eq!(Geometry::new(14, true).unwrap().subcluster_size(), 512);
        assert_eq!(Geometry::new(21, true).unwrap().subcluster_size(), 64 * KIB);
    }

    #[test]
    fn cluster_bits_outside_9_to_21_are_rejected_naming_the_value_and_offset() {
        for bad in [0, 8, 22, 63] {
            let msg = Geometry::new(bad, false).unwrap_err().to_string();
            assert!(msg.contains(&format!("cluster_bits {bad} ")), "{msg}");
            assert!(msg.contains("0x14"), "{msg}");
        }
    }

    #[test]
    fn extended_l2_with_clusters_below_16k_is_rejected_naming_the_value() {
        let msg = Geometry::new(13, true).unwrap_err().to_string();
        assert!(
            msg.contains("cluster_bits 13 ") && msg.contains("extended L2"),
            "{msg}"
        );
        assert!(msg.contains("0x14"), "{msg}");
    }

    #[test]
    fn guest_offset_splits_into_l1_l2_cluster_and_subcluster_parts() {
        let g = Geometry::new(16, true).unwrap();
        // l1 index 3, l2 index 5, subcluster 7, 0x123 bytes in.
        let guest = GuestOffset((3 << 28) | (5 << 16) | (7 << 11) | 0x123);
        assert_eq!(g.l1_index(guest), 3);
        assert_eq!(g.l2_index(guest), 5);
        assert_eq!(g.offset_in_cluster(guest), (7 << 11) | 0x123);
        assert_eq!(g.subcluster_index(guest), SubclusterIndex(7));
        assert_eq!(g.guest_cluster(guest), ClusterIndex((3 << 12) | 5));
        let std = Geometry::new(16, false).unwrap();
        assert_eq!(std.subcluster_index(guest), SubclusterIndex(0));
    }

    #[test]
    fn slice_position_splits_the_l2_index() {
        let g = Geometry::new(16, false).unwrap();
        // 4 KiB slices hold 512 standard entries.
        let guest = GuestOffset((2 << 29) | (1000 << 16));
        let pos = g.l2_slice_position(guest, 4096).unwrap();
        assert_eq!(
            pos,
            L2SlicePosition {
                l1_index: 2,
                slice_index: 1,
                index_in_slice: 488
            }
        );
        let ext = Geometry::new(16, true).unwrap();
        assert_eq!(ext.l2_slice_entries(4096).unwrap(), 256);
    }

    #[test]
    fn slice_sizes_not_a_power_of_two_or_out_of_range_are_rejected_naming_the_size() {
        let g = Geometry::new(16, false).unwrap();
        for bad in [0, 256, 3000, 128 * KIB] {
            let msg = g.l2_slice_entries(bad).unwrap_err().to_string();
            assert!(msg.contains(&format!("{bad:#x}")), "{msg}");
        }
    }

    #[test]
    fn max_virtual_sizes_match_the_spec_table() {
        assert_eq!(
            Geometry::new(9, false).unwrap().max_virtual_size(),
            128 * GIB
        );
        assert_eq!(
            Geometry::new(16, false).unwrap().max_virtual_size(),
            2 * PIB
        );
        assert_eq!(
            Geometry::new(21, false).unwrap().max_virtual_size(),
            2 * EIB
        );
        assert_eq!(Geometry::new(16, true).unwrap().max_virtual_size(), PIB);
    }

    #[test]
    fn l1_size_is_the_ceiling_of_size_over_l2_coverage() {
        let g = Geometry::new(16, false).unwrap();
        assert_eq!(g.l1_size_for(0).unwrap(), 0);
        assert_eq!(g.l1_size_for(1).unwrap(), 1);
        assert_eq!(g.l1_size_for(512 << 20).unwrap(), 1);
        assert_eq!(g.l1_size_for((512 << 20) + 1).unwrap(), 2);
        assert_eq!(g.l1_size_for(g.max_virtual_size()).unwrap(), 4 << 20);
    }

    #[test]
    fn a_size_needing_more_than_32_mib_of_l1_is_too_large_and_names_the_size() {
        let g = Geometry::new(16, false).unwrap();
        let size = g.max_virtual_size() + 1;
        let msg = g.l1_size_for(size).unwrap_err().to_string();
        assert!(
            msg.contains("too large (try using a larger cluster size)"),
            "{msg}"
        );
        assert!(
            msg.contains(&format!("{size:#x}")) && msg.contains("0x18"),
            "{msg}"
        );
        assert!(g.l1_size_for(u64::MAX).is_err());
    }

    #[test]
    fn refcount_geometry_of_the_default_image() {
        let r = RefcountGeometry::new(16, 4).unwrap();
        assert_eq!(r.refcount_bits(), 16);
        assert_eq!(r.max_refcount(), 0xffff);
        assert_eq!(r.refblock_entries(), 32768);
        let host = HostOffset((5 << 31) | (77 << 16) | 0x42);
        assert_eq!(r.reftable_index(host), 5);
        assert_eq!(r.refblock_index(host), 77);
        assert_eq!(r.max_reftable_entries(), 1 << 20);
    }

    #[test]
    fn refcount_widths_and_maxima_for_every_order() {
        for order in 0..=6 {
            let r = RefcountGeometry::new(16, order).unwrap();
            assert_eq!(r.refcount_bits(), 1 << order);
            assert_eq!(
                r.refblock_entries() * u64::from(r.refcount_bits()),
                64 * KIB * 8
            );
            assert_eq!(u128::from(r.max_refcount()), (1u128 << (1 << order)) - 1);
        }
    }

    #[test]
    fn max_host_sizes_match_the_spec_examples() {
        assert_eq!(
            RefcountGeometry::new(21, 4).unwrap().max_host_size(),
            2 * EIB
        );
        assert_eq!(
            RefcountGeometry::new(9, 6).unwrap().max_host_size(),
            32 * GIB
        );
        assert_eq!(
            RefcountGeometry::new(21, 0).unwrap().max_host_size(),
            u64::MAX
        );
    }

    #[test]
    fn refcount_order_above_6_is_rejected_naming_the_value_and_offset() {
        let msg = RefcountGeometry::new(16, 7).unwrap_err().to_string();
        assert!(
            msg.contains("refcount_order 7 ") && msg.contains("0x60"),
            "{msg}"
        );
        assert!(RefcountGeometry::new(8, 4).is_err());
    }

    #[test]
    fn refcount_metadata_for_a_small_image_is_one_table_cluster_and_one_block() {
        let r = RefcountGeometry::new(16, 4).unwrap();
        let m = r.refcount_metadata_for(3).unwrap();
        assert_eq!(
            m,
            RefcountMetadata {
                table_clusters: 1,
                block_clusters: 1
            }
        );
        assert_eq!(m.total_clusters(), 2);
        assert_eq!(r.refcount_metadata_for(0).unwrap().total_clusters(), 0);
    }

    #[test]
    fn refcount_metadata_counts_the_block_needed_for_the_metadata_itself() {
        // 512-byte clusters, 64-bit refcounts: 64 refcounts per block, 64 entries per table
        // cluster. 63 data clusters + 1 block + 1 table cluster = 65 > 64: a second block.
        let r = RefcountGeometry::new(9, 6).unwrap();
        assert_eq!(
            r.refcount_metadata_for(63).unwrap(),
            RefcountMetadata {
                table_clusters: 1,
                block_clusters: 2
            }
        );
        assert_eq!(
            r.refcount_metadata_for(62).unwrap(),
            RefcountMetadata {
                table_clusters: 1,
                block_clusters: 1
            }
        );
    }

    #[test]
    fn refcount_metadata_for_an_impossible_count_overflows_with_an_error() {
        let r = RefcountGeometry::new(9, 6).unwrap();
        let msg = r.refcount_metadata_for(u64::MAX).unwrap_err().to_string();
        assert!(msg.contains("overflows"), "{msg}");
    }

    proptest! {
        #[test]
        fn refcount_metadata_is_a_self_covering_fixed_point(
            clusters in 0u64..(1 << 40), bits in 9u32..=21, order in 0u32..=6,
        ) {
            let r = RefcountGeometry::new(bits, order).unwrap();
            let m = r.refcount_metadata_for(clusters).unwrap();
            let total = clusters + m.total_clusters();
            prop_assert!(m.block_clusters * r.refblock_entries() >= total);
            prop_assert!(m.table_clusters * r.reftable_entries_per_cluster() >= m.block_clusters);
            // Minimal: one block fewer would not cover everything.
            if m.block_clusters > 0 {
                prop_assert!((m.block_clusters - 1) * r.refblock_entries() < total);
            }
        }

        #[test]
        fn l1_l2_and_in_cluster_offset_rebuild_the_guest_offset(
            guest in any::<u64>(), bits in 9u32..=21, extended in any::<bool>(),
        ) {
            prop_assume!(!extended || bits >= 14);
            let g = Geometry::new(bits, extended).unwrap();
            let off = GuestOffset(guest);
            let rebuilt = (g.l1_index(off) << (bits + g.l2_bits()))
                | (g.l2_index(off) << bits)
                | g.offset_in_cluster(off);
            prop_assert_eq!(rebuilt, guest);
            let sc = u64::from(g.subcluster_index(off).0);
            prop_assert!(sc < u64::from(g.subclusters_per_cluster()));
            prop_assert_eq!(sc, g.offset_in_cluster(off) / g.subcluster_size());
        }

        #[test]
        fn reftable_and_refblock_index_rebuild_the_host_cluster(
            host in any::<u64>(), bits in 9u32..=21, order in 0u32..=6,
        ) {
            let r = RefcountGeometry::new(bits, order).unwrap();
            let h = HostOffset(host);
            let cluster = (r.reftable_index(h) << r.refblock_bits()) | r.refblock_index(h);
            prop_assert_eq!(cluster, host >> bits);
        }
    }
}

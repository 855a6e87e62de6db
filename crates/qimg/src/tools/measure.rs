//! `qemu-img measure`'s arithmetic: how large a qcow2 file with given options gets when every
//! cluster is allocated (metadata included), and how much room persistent bitmaps copied
//! into it take. The data a source image holds is counted by the caller (it walks the
//! source's block status); [`MeasureOptions::required`] combines the two as qemu-img does.

use qimg_format::geometry::RefcountGeometry;
use qimg_format::l1::L1_ENTRY_SIZE;
use qimg_format::validate::MAX_L1_BYTES;

use crate::error::{Error, Result};

/// The options of the measured qcow2 image that change its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeasureOptions {
    /// Cluster size in bytes (a power of two, 512 to 2 MiB).
    pub cluster_size: u64,
    /// Refcount width in bits (a power of two up to 64).
    pub refcount_bits: u64,
    /// 128-bit L2 entries.
    pub extended_l2: bool,
    /// The LUKS header area of an encrypted image (`crypto::area_len`; 0 for none), held in
    /// whole clusters.
    pub luks_bytes: u64,
}

impl MeasureOptions {
    fn l2_entry_size(&self) -> u64 {
        if self.extended_l2 { 16 } else { 8 }
    }

    /// Refuses a virtual size whose L1 table would exceed QEMU's limit, with qemu-img's
    /// message.
    pub fn check_size(&self, virtual_size: u64) -> Result<()> {
        let cs = self.cluster_size;
        let clusters = virtual_size.div_ceil(cs);
        let l2_tables = clusters.div_ceil(cs / self.l2_entry_size());
        if l2_tables.saturating_mul(L1_ENTRY_SIZE as u64) > MAX_L1_BYTES {
            return Err(Error::InvalidOption(
                "The image size is too large (try using a larger cluster size)".into(),
            ));
        }
        Ok(())
    }

    /// The file size of an image of `virtual_size` bytes with every cluster allocated: one
    /// header cluster, L2 tables for every cluster, the L1 table (whole clusters), the
    /// refcount table and blocks covering all of it, and the data.
    pub fn fully_allocated(&self, virtual_size: u64) -> Result<u64> {
        let cs = self.cluster_size;
        let overflow = || Error::InvalidOption(format!("size {virtual_size}: too large"));
        let aligned = virtual_size
            .checked_next_multiple_of(cs)
            .ok_or_else(overflow)?;
        let l2e = self.l2_entry_size();
        let mut meta = cs;
        let l2_entries = (aligned / cs).next_multiple_of(cs / l2e);
        meta += l2_entries * l2e;
        let l1_entries = (l2_entries * l2e / cs).next_multiple_of(cs / L1_ENTRY_SIZE as u64);
        meta += l1_entries * L1_ENTRY_SIZE as u64;
        let rg = RefcountGeometry::new(cs.trailing_zeros(), self.refcount_bits.trailing_zeros())
            .map_err(|e| {
                Error::InvalidOption(format!("refcount_bits {}: {e}", self.refcount_bits))
            })?;
        let covered = meta.checked_add(aligned).ok_or_else(overflow)? / cs;
        let rc = rg
            .refcount_metadata_for(covered)
            .map_err(|e| Error::InvalidOption(format!("size {virtual_size}: {e}")))?;
        let rc_bytes = (rc.table_clusters + rc.block_clusters)
            .checked_mul(cs)
            .ok_or_else(overflow)?;
        meta.checked_add(rc_bytes)
            .and_then(|m| m.checked_add(aligned))
            .and_then(|m| m.checked_add(self.luks_bytes.next_multiple_of(cs)))
            .ok_or_else(overflow)
    }

    /// The required size: the fully allocated size without the data clusters the image
    /// would not hold (`data` bytes of data are held, counted in whole clusters).
    pub fn required(&self, virtual_size: u64, data: u64) -> Result<u64> {
        let full = self.fully_allocated(virtual_size)?;
        let aligned = virtual_size.next_multiple_of(self.cluster_size);
        Ok(full - aligned + data)
    }

    /// The room persistent bitmaps of a `disk_size`-byte disk take in the image: each
    /// bitmap's data fully allocated, its bitmap table, and the bitmap directory, each
    /// rounded up to clusters. `bitmaps` holds each bitmap's (name length, granularity).
    pub fn bitmaps_size(&self, disk_size: u64, bitmaps: &[(usize, u64)]) -> u64 {
        let cs = self.cluster_size;
        let mut size = 0u64;
        let mut dir = 0u64;
        for &(name_len, granularity) in bitmaps {
            let bits = disk_size.div_ceil(granularity.max(1));
            let bytes = bits.div_ceil(8);
            let clusters = bytes.div_ceil(cs);
            size += clusters * cs;
            size += (clusters * 8).next_multiple_of(cs);
            dir += (24 + name_len as u64).next_multiple_of(8);
        }
        size + dir.next_multiple_of(cs)
    }
}

/// Counts the data clusters a copy of a source holds, as qemu-img measure does: `runs` are
/// the source's allocated data runs (start, length) in guest order; each run is extended to
/// the end of its cluster, and a run starting inside a cluster counts that cluster's start
/// too (qemu-img's arithmetic, which may count a shared cluster twice).
pub fn data_bytes(runs: impl IntoIterator<Item = (u64, u64)>, cluster_size: u64) -> u64 {
    let mut total = 0u64;
    let mut next_from = 0u64;
    for (start, len) in runs {
        // qemu-img walks on from the end of the previous run rounded up to a cluster: a run
        // that starts inside the counted part is counted from there.
        let (start, len) = if start < next_from {
            let end = start + len;
            if end <= next_from {
                continue;
            }
            (next_from, end - next_from)
        } else {
            (start, len)
        };
        let pnum = (start + len).next_multiple_of(cluster_size) - start;
        total += start % cluster_size + pnum;
        next_from = start + pnum;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qemu_img_figures_for_empty_images() {
        let o = MeasureOptions {
            cluster_size: 65536,
            refcount_bits: 16,
            extended_l2: false,
            luks_bytes: 0,
        };
        // `qemu-img measure -O qcow2 --size 1G`.
        assert_eq!(o.fully_allocated(1 << 30).unwrap(), 1_074_135_040);
        assert_eq!(o.required(1 << 30, 0).unwrap(), 393_216);
        // `--size 1000`.
        assert_eq!(o.required(1000, 0).unwrap(), 327_680);
        assert_eq!(o.fully_allocated(1000).unwrap(), 393_216);
        let ext = MeasureOptions {
            cluster_size: 2 << 20,
            refcount_bits: 16,
            extended_l2: true,
            luks_bytes: 0,
        };
        assert_eq!(ext.required(1 << 30, 0).unwrap(), 10_485_760);
        assert_eq!(ext.fully_allocated(1 << 30).unwrap(), 1_084_227_584);
        // One bitmap "b0" of a 64 MiB disk at 64 KiB granularity.
        assert_eq!(o.bitmaps_size(64 << 20, &[(2, 65536)]), 196_608);
        let small = MeasureOptions {
            cluster_size: 512,
            ..o
        };
        assert!(small.check_size(100 << 40).is_err());
        assert!(o.check_size(100 << 40).is_ok());
    }

    #[test]
    fn data_runs_count_whole_clusters() {
        assert_eq!(data_bytes([(0, 3 << 20)], 65536), 3 << 20);
        assert_eq!(data_bytes([(4096, 512)], 65536), 65536);
        // Two runs in one cluster: the second starts inside the counted part.
        assert_eq!(data_bytes([(0, 512), (4096, 512)], 65536), 65536);
    }
}

//! QEMU's `qcow2_detect_metadata_preallocation`: whether a qcow2 image refcounts far more
//! clusters than its file really holds (metadata preallocation), in which case the holes of
//! its host file read as zeros.

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

use crate::chain::read_cluster0;
use qimg_format::geometry::RefcountGeometry;
use qimg_format::refcount::{self, REFTABLE_ENTRY_SIZE};
use qimg_format::validate::OpenMode;

/// The unit of `st_blocks` (POSIX: 512 bytes, whatever the file system's block size).
const ST_BLOCK_UNIT: u64 = 512;

/// Whether the image file refcounts at least `max(allocated * 10 / 9, allocated + 2)`
/// clusters, `allocated` being the clusters the file system really holds. Errors count as
/// "no", as in QEMU.
pub fn metadata_preallocated(path: &Path) -> bool {
    detect(path).unwrap_or(false)
}

fn detect(path: &Path) -> Option<bool> {
    let c0 = read_cluster0(path, OpenMode::ReadOnly).ok()?;
    let header = &c0.header;
    let geometry = RefcountGeometry::new(header.cluster_bits, header.refcount_order).ok()?;
    let cluster_size = geometry.cluster_size();
    let file = File::open(path).ok()?;
    let meta = file.metadata().ok()?;
    let real_clusters = meta.blocks().saturating_mul(ST_BLOCK_UNIT) / cluster_size;
    let threshold = (real_clusters * 10 / 9).max(real_clusters + 2);
    let end_cluster = meta.len().div_ceil(cluster_size);
    let per_block = geometry.refblock_entries();
    // Only the refcount blocks of clusters inside the file matter.
    let table_entries = (u64::from(header.refcount_table_clusters)
        * geometry.reftable_entries_per_cluster())
    .min(end_cluster.div_ceil(per_block));
    let table_bytes = usize::try_from(table_entries)
        .ok()?
        .checked_mul(REFTABLE_ENTRY_SIZE)?;
    let mut raw = vec![0u8; table_bytes];
    file.read_exact_at(&mut raw, header.refcount_table_offset)
        .ok()?;
    let table = refcount::decode_table(&raw, cluster_size, header.refcount_table_offset).ok()?;
    let mut count = 0u64;
    let mut block = vec![0u8; usize::try_from(cluster_size).ok()?];
    for (index, entry) in (0u64..).zip(&table) {
        if count >= threshold {
            break;
        }
        // No block: every refcount in its range is 0.
        let Some(block_offset) = entry.block_offset else {
            continue;
        };
        let first = index * per_block;
        let last = (first + per_block).min(end_cluster);
        file.read_exact_at(&mut block, block_offset.0).ok()?;
        for cluster in first..last {
            if count >= threshold {
                break;
            }
            if refcount::get(&block, header.refcount_order, cluster - first).ok()? != 0 {
                count += 1;
            }
        }
    }
    Some(count >= threshold)
}

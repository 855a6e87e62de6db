//! Where everything goes in a new image: refcount table and blocks, L1 table, and with
//! preallocation each L2 table followed by the data it maps, computed to a fixed point so that
//! every cluster is covered and refcounted exactly once.

use qimg_format::geometry::RefcountGeometry;
use qimg_format::validate::l1_entries_for;

use super::options::{CreateOptions, Preallocation};
use crate::error::{Error, Result};

/// Where everything goes in a fresh image, in clusters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Layout {
    pub(super) cluster_size: u64,
    pub(super) reftable_clusters: u64,
    pub(super) refblocks: u64,
    pub(super) l1_entries: u64,
    pub(super) l1_clusters: u64,
    /// Clusters of L2 tables plus mapped data, in the order they are laid out.
    pub(super) prealloc_clusters: u64,
    /// Clusters of the LUKS header area of an encrypted image, after everything else (QEMU
    /// sets up encryption last).
    pub(super) luks_clusters: u64,
}

impl Layout {
    pub(super) fn reftable_at(&self) -> u64 {
        1
    }
    pub(super) fn refblocks_at(&self) -> u64 {
        1 + self.reftable_clusters
    }
    pub(super) fn l1_at(&self) -> u64 {
        self.refblocks_at() + self.refblocks
    }
    pub(super) fn prealloc_at(&self) -> u64 {
        self.l1_at() + self.l1_clusters
    }
    pub(super) fn luks_at(&self) -> u64 {
        self.prealloc_at() + self.prealloc_clusters
    }
    pub(super) fn total(&self) -> u64 {
        self.luks_at() + self.luks_clusters
    }
}

/// `luks_bytes`: the LUKS header area of an encrypted image (0 for none).
pub(super) fn plan(opts: &CreateOptions, size: u64, luks_bytes: u64) -> Result<Layout> {
    let cs = opts.cluster_size;
    let bits = cs.trailing_zeros();
    let l1_entries = l1_entries_for(size, bits, opts.extended_l2);
    let l1_clusters = qimg_format::l1::table_bytes(l1_entries).div_ceil(cs);
    let prealloc_clusters = if opts.preallocation != Preallocation::Off || opts.data_file_raw {
        let data = if opts.data_file.is_some() {
            0
        } else {
            size.div_ceil(cs)
        };
        l1_entries + data
    } else {
        0
    };
    // Refcount table and blocks must cover everything, themselves included.
    let rg = RefcountGeometry::new(bits, rb_order(opts.refcount_bits))
        .map_err(|e| Error::InvalidOption(format!("refcount_bits {}: {e}", opts.refcount_bits)))?;
    let luks_clusters = luks_bytes.div_ceil(cs);
    let others = 1 + l1_clusters + prealloc_clusters + luks_clusters;
    let meta = rg
        .refcount_metadata_for(others)
        .map_err(|e| Error::InvalidOption(format!("size {size}: {e}")))?;
    let layout = Layout {
        cluster_size: cs,
        reftable_clusters: meta.table_clusters.max(1),
        refblocks: meta.block_clusters.max(1),
        l1_entries,
        l1_clusters,
        prealloc_clusters,
        luks_clusters,
    };
    if layout.reftable_clusters * cs > qimg_format::validate::MAX_REFTABLE_BYTES {
        return Err(Error::InvalidOption(format!(
            "size {size}: the refcount table would exceed 8 MiB (try a larger cluster size or refcount_bits)"
        )));
    }
    Ok(layout)
}

pub(super) fn rb_order(bits: u64) -> u32 {
    bits.trailing_zeros()
}

//! The guest data paths: read, write with subcluster copy-on-write, write-zeroes, discard,
//! resize.
//!
//! | module | what |
//! |---|---|
//! | this one | request splitting, subcluster masks (the types a write carries from planning to linking are the planner's, `engine/plan.rs`) |
//! | `read` | reads: data, zeros, compressed clusters, the backing chain |
//! | `cow` | copy-on-write planning: what one write does to one cluster |
//! | `write` | writes: allocation, copy-on-write and guest data, linking; the pieces write leases use |
//! | `compressed` | compressed cluster writes |
//! | `zero` | write-zeroes and discard, whole subclusters by bitmap |
//! | `prealloc` | metadata preallocation: host clusters linked without data written |
//! | `resize` | growing and shrinking the virtual disk |
//! | `empty` | making every cluster unallocated (`qemu-img commit`'s make-empty) |
//!
//! Every request first takes its guest clusters in the range lock (shared for reads, exclusive
//! otherwise), then works cluster by cluster: look the L2 entry up under the metadata lock,
//! release it, do the data I/O, and take it again only to link what was written.

use std::io::{IoSlice, IoSliceMut};
use std::sync::atomic::Ordering;

use qimg_format::compressed::CompressedDescriptor;
use qimg_format::l2::{AnyL2Entry, ExtendedL2Entry, L2Entry, SubclusterBitmap, SubclusterState};
use qimg_format::units::SubclusterIndex;
use qimg_io::Storage;

use super::compress;
use super::image::Backing;
use super::image::Inner;
use super::meta::{CacheKind, Meta};
use super::overlap::Writing;
use crate::error::{Error, Result};

use super::plan::{Destination, Freed, PreparedWrite, WritePlan};

mod compressed;
mod cow;
pub(crate) use cow::CowSource;
pub(super) mod empty;
mod prealloc;
mod read;
mod resize;
mod vmstate;
mod write;
mod zero;

pub(super) const ALL: u32 = u32::MAX;

/// The requests that drop data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Unmap {
    /// Read as zeros; with `unmap`, host clusters no subcluster uses any more are freed,
    /// without it they stay allocated (preallocation is kept, as QEMU keeps it).
    Zero { unmap: bool },
    /// A guest's discard: whole subclusters read as zeros afterwards (over a backing file
    /// too, as QEMU's discard sets the zero flag there) and give their space back.
    Discard,
    /// Whole subclusters become unallocated: the backing file shows through again.
    Unallocate,
}

pub(super) fn old_reference(e: &L2Entry) -> Option<Freed> {
    match *e {
        L2Entry::Compressed(d) => Some(Freed::Compressed(d)),
        other => other.host_cluster().map(|h| Freed::Cluster(h.0)),
    }
}

/// The per-cluster pieces of a range: see [`Inner::pieces`].
pub(crate) struct Pieces {
    cs: u64,
    offset: u64,
    len: u64,
    pos: u64,
}

impl Iterator for Pieces {
    type Item = (u64, usize, usize, usize);

    fn next(&mut self) -> Option<Self::Item> {
        if self.pos >= self.len {
            return None;
        }
        let at = self.offset + self.pos;
        let within = at % self.cs;
        let n = (self.cs - within).min(self.len - self.pos);
        let piece = (at - within, within as usize, n as usize, self.pos as usize);
        self.pos += n;
        Some(piece)
    }
}

pub(super) fn lowest(mask: u32) -> usize {
    mask.trailing_zeros() as usize
}

pub(super) fn highest(mask: u32) -> usize {
    31 - mask.leading_zeros() as usize
}

pub(super) fn subcluster_mask(first: usize, end: usize) -> u32 {
    SubclusterBitmap::range_mask(SubclusterIndex(first as u32), (end - first) as u32)
}

impl<S: Storage> Inner<S> {
    /// Splits `[offset, offset + len)` into per-cluster pieces `(cluster start, offset in
    /// cluster, length, position in the request)`, without allocating.
    pub(crate) fn pieces(&self, offset: u64, len: u64) -> Pieces {
        Pieces {
            cs: self.shared.geo.cluster_size(),
            offset,
            len,
            pos: 0,
        }
    }

    /// The total length of a request's segments, checked against the disk.
    pub(super) fn request_len(
        &self,
        segments: impl Iterator<Item = usize>,
        offset: u64,
    ) -> Result<u64> {
        let len = segments
            .map(|n| n as u64)
            .try_fold(0u64, u64::checked_add)
            .unwrap_or(u64::MAX);
        self.shared.check_range(offset, len)?;
        Ok(len)
    }

    pub(crate) fn cluster_span(&self, offset: u64, len: u64) -> (u64, u64) {
        let bits = self.shared.geo.cluster_bits();
        (offset >> bits, ((offset + len.max(1) - 1) >> bits) + 1)
    }

    pub(crate) fn ensure_open(&self, m: &Meta) -> Result<()> {
        if m.is_closed() {
            return Err(Error::InvalidOption(format!(
                "{}: the image is closed",
                self.shared.path.display()
            )));
        }
        Ok(())
    }

    /// Drops the reference a rewritten entry held (after the entry changed).
    pub(super) async fn release(&self, m: &mut Meta, freed: Freed) -> Result<()> {
        if self.shared.data_file.is_some() {
            return Ok(());
        }
        self.shared
            .set_dependency(m, CacheKind::Refcount, CacheKind::L2)
            .await?;
        match freed {
            Freed::Cluster(h) => self.shared.free_clusters(m, h, 1).await,
            Freed::Compressed(d) => {
                let (first, n) = d.host_clusters();
                self.shared
                    .free_clusters(m, first.0 * self.shared.geo.cluster_size(), n)
                    .await
            }
        }
    }
}

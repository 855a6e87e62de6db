//! [`Image::map`](crate::Image::map): where each part of a guest range lives, from cached metadata.
//!
//! This is the read side of the data path a VMM can drive itself: for [`ExtentKind::Data`]
//! extents it may read the host file (or the external data file) directly at `host_offset`,
//! for zero extents fill zeros, and for unallocated ones go to the backing chain (or zeros).
//! The mapping is a snapshot: a write, write-zeroes or discard issued after `map` returned
//! may change it, so a caller that mixes its own I/O with qimg's writes must order them.

use qimg_format::compressed::CompressedDescriptor;
use qimg_format::units::GuestOffset;
use qimg_io::Storage;

use super::image::Inner;
use super::plan::{ReadSource, piece_parts};
use crate::error::Result;

/// What one extent of a guest range is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExtentKind {
    /// Guest data stored at `host_offset` (in the external data file when the image has one).
    Data {
        /// Host byte offset of the extent's first byte.
        host_offset: u64,
    },
    /// Reads as zeros. `host_offset` is set when host space stays reserved for it.
    Zero {
        /// Host byte offset of the reserved space, if any.
        host_offset: Option<u64>,
    },
    /// Not allocated in this image: reads from the backing chain, or zeros without one.
    /// `host_offset` is set when host space is reserved for it: by preallocation, or because
    /// it is an unallocated subcluster of an extended-L2 cluster whose other subclusters hold
    /// data (a write there lands at that offset without allocating).
    Unallocated {
        /// Host byte offset of the reserved space, if any.
        host_offset: Option<u64>,
    },
    /// Part of a compressed cluster (`offset_in_cluster` into its inflated bytes).
    Compressed {
        /// The cluster's descriptor.
        descriptor: CompressedDescriptor,
        /// Where the extent starts inside the inflated cluster.
        offset_in_cluster: u64,
    },
}

/// A run of guest bytes with one [`ExtentKind`].
///
/// Wherever an extent has a host offset, that offset keeps the guest offset's position within
/// its cluster: `host_offset % cluster_size == start % cluster_size` (clusters are mapped
/// whole). So a guest request aligned for `O_DIRECT` maps to host requests with the same
/// alignment, up to the cluster size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Extent {
    /// First guest byte.
    pub start: u64,
    /// Length in bytes.
    pub length: u64,
    /// What it is.
    pub kind: ExtentKind,
}

impl Extent {
    /// Whether `next` continues this extent (adjacent, same kind, contiguous host bytes).
    fn continues(&self, next: &Extent) -> bool {
        if self.start + self.length != next.start {
            return false;
        }
        let contiguous = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (None, None) => true,
            (Some(a), Some(b)) => a + self.length == b,
            _ => false,
        };
        match (self.kind, next.kind) {
            (ExtentKind::Data { host_offset: a }, ExtentKind::Data { host_offset: b }) => {
                a + self.length == b
            }
            (ExtentKind::Zero { host_offset: a }, ExtentKind::Zero { host_offset: b }) => {
                contiguous(a, b)
            }
            (
                ExtentKind::Unallocated { host_offset: a },
                ExtentKind::Unallocated { host_offset: b },
            ) => contiguous(a, b),
            _ => false,
        }
    }
}

fn push(out: &mut Vec<Extent>, e: Extent) {
    if let Some(last) = out.last_mut() {
        if last.continues(&e) {
            last.length += e.length;
            return;
        }
    }
    out.push(e);
}

impl<S: Storage> Inner<S> {
    pub(crate) async fn map(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.shared.check_range(offset, len)?;
        let mut out = Vec::new();
        if len == 0 {
            return Ok(out);
        }
        let cs = self.shared.geo.cluster_size();
        let scs = self.shared.geo.subcluster_size();
        let bits = self.shared.geo.cluster_bits();
        let _guard = self
            .locks
            .lock(offset >> bits, ((offset + len - 1) >> bits) + 1, false)
            .await;
        let end = offset + len;
        let mut at = offset;
        while at < end {
            let gc = at - at % cs;
            let entry = {
                let mut m = self.meta.lock().await;
                let l1i = self.shared.geo.l1_index(GuestOffset(gc)) as usize;
                if m.l2_table(l1i).is_none() {
                    // No L2 table: the whole range it would cover is unallocated.
                    let span = cs * (cs / self.shared.geo.l2_entry_size());
                    let table_end = (at - at % span).saturating_add(span).min(end);
                    drop(m);
                    push(
                        &mut out,
                        Extent {
                            start: at,
                            length: table_end - at,
                            kind: ExtentKind::Unallocated { host_offset: None },
                        },
                    );
                    at = table_end;
                    continue;
                }
                self.shared.lookup(&mut m, gc).await?
            };
            let cluster_end = (gc + cs).min(end);
            // The read planner's parts of this piece, as extents.
            let piece = (gc, (at - gc) as usize, (cluster_end - at) as usize, 0);
            for part in piece_parts(&entry, scs as usize, piece) {
                let kind = match part.source {
                    ReadSource::Data(host_offset) => ExtentKind::Data { host_offset },
                    ReadSource::Zero { reserved } => ExtentKind::Zero {
                        host_offset: reserved,
                    },
                    ReadSource::Backing { reserved, .. } => ExtentKind::Unallocated {
                        host_offset: reserved,
                    },
                    ReadSource::Compressed {
                        descriptor, within, ..
                    } => ExtentKind::Compressed {
                        descriptor,
                        offset_in_cluster: within as u64,
                    },
                };
                push(
                    &mut out,
                    Extent {
                        start: at + part.pos as u64,
                        length: part.len as u64,
                        kind,
                    },
                );
            }
            at = cluster_end;
        }
        Ok(out)
    }
}

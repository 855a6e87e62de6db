//! The read side of the data path a VMM drives itself: [`Image::read_lease`] pins a guest
//! range and says where its bytes are, so that the VMM can read them with its own I/O while no
//! discard, write-zeroes, copy-on-write or reallocation moves or frees them.
//!
//! # Contract
//!
//! 1. `read_lease(offset, len)` holds the guest clusters of the range *shared* until the lease
//!    is dropped (or [`release`](ReadLease::release)d): reads (qimg's and other leases') go on,
//!    while writes, write-zeroes and discards of those clusters wait. Keep leases short, and
//!    never take a write lease or write through qimg to a range you hold a read lease on from
//!    the same task (it would wait for itself).
//! 2. Read each [`ExtentKind::Data`] extent's bytes from
//!    [`Image::data_path`] at its host offset; fill [`ExtentKind::Zero`] extents with zeros;
//!    read [`ExtentKind::Unallocated`] extents from the backing chain (or use
//!    [`Image::read`] for them, which takes the same shared hold and so does not wait), and
//!    [`ExtentKind::Compressed`] extents through [`Image::read`] too.
//! 3. The extents keep each guest offset's position within its cluster (see
//!    [`Extent`]): an `O_DIRECT`-aligned guest range gives aligned host reads.

use qimg_io::Storage;

use super::image::Image;
use super::map::{Extent, ExtentKind};
use crate::error::Result;

/// A guest range pinned for reading with the caller's own I/O; see the
/// [module documentation](self).
#[derive(Debug)]
#[must_use = "a read lease pins its guest range until it is dropped"]
pub struct ReadLease<S: Storage + 'static> {
    image: Image<S>,
    lock_id: Option<u64>,
    extents: Vec<Extent>,
}

/// The body of [`Image::read_lease`].
pub(crate) async fn read_lease<S: Storage + 'static>(
    img: &Image<S>,
    offset: u64,
    len: u64,
) -> Result<ReadLease<S>> {
    let inner = &img.inner;
    inner.shared.check_range(offset, len)?;
    inner.shared.check_not_encrypted("a read lease")?;
    let mut lease = ReadLease {
        image: img.clone(),
        lock_id: None,
        extents: Vec::new(),
    };
    if len == 0 {
        return Ok(lease);
    }
    let (first, end) = inner.cluster_span(offset, len);
    lease.lock_id = Some(inner.locks.acquire(first, end, false).await);
    // `map` takes the same clusters shared again, which a shared hold never waits for.
    lease.extents = inner.map(offset, len).await?;
    Ok(lease)
}

impl<S: Storage + 'static> ReadLease<S> {
    /// Where the bytes of the range are, in guest order, covering it exactly.
    pub fn extents(&self) -> &[Extent] {
        &self.extents
    }

    /// The data extents only: `(guest offset, host offset, length)`.
    pub fn data(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.extents.iter().filter_map(|e| match e.kind {
            ExtentKind::Data { host_offset } => Some((e.start, host_offset, e.length)),
            _ => None,
        })
    }

    /// Unpins the range (as dropping does).
    pub fn release(mut self) {
        self.unpin();
    }

    fn unpin(&mut self) {
        if let Some(id) = self.lock_id.take() {
            self.image.inner.locks.release(id);
        }
    }
}

impl<S: Storage + 'static> Drop for ReadLease<S> {
    fn drop(&mut self) {
        self.unpin();
    }
}

//! The write side of the data path a VMM drives itself: [`Image::write_lease`] allocates the
//! host space for a guest range (copying on write what the guest does not overwrite) and says
//! where the guest bytes go; the VMM writes them with its own I/O (its own io_uring, say); then
//! [`WriteLease::commit`] links them into the image.
//!
//! # Contract
//!
//! 1. `write_lease(offset, len)` holds the guest clusters of the range exclusively until the
//!    lease is committed or aborted: qimg's own reads and writes of those clusters wait, so
//!    nobody sees the range half written. Keep leases short and never take two overlapping
//!    leases from one task (the second waits for the first forever).
//! 2. Write exactly the bytes of each [`HostExtent`] to `host_offset` in
//!    [`Image::data_path`] (the image file, or its external data file), and wait for those
//!    writes to *complete* before calling [`commit`](WriteLease::commit). Writing outside the
//!    extents may destroy metadata.
//! 3. `commit` updates the L2 tables. The new mapping is visible to reads at once; it becomes
//!    durable with the next [`Image::flush`], which first fsyncs the file (an fsync covers every
//!    completed write to the file, whichever descriptor issued it) and only then writes the
//!    metadata that points at the new data. So after a crash before that flush, the guest
//!    range reads its old contents, never garbage. A VMM that must report its guest write as
//!    durable calls `flush` after `commit`, exactly as for [`Image::write`].
//! 4. If the data write fails, call [`abort`](WriteLease::abort): freshly allocated clusters
//!    are given back and the range keeps its old contents. Dropping a lease without either
//!    releases the range at once; its fresh clusters are given back by the next
//!    [`Image::flush`] or [`Image::close`] (no runtime needed).
//!
//! Compressed clusters and clusters shared with snapshots are copied into fresh clusters like
//! any write; an in-place cluster (already allocated to this image) is handed out directly.

use qimg_io::Storage;

use super::image::Image;
use super::plan::PreparedWrite;
use crate::error::Result;

/// Where one part of a leased guest range goes in the host file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HostExtent {
    /// First guest byte of the part.
    pub guest_offset: u64,
    /// Byte offset in [`Image::data_path`] where that guest byte goes.
    pub host_offset: u64,
    /// Length in bytes.
    pub length: u64,
}

/// Host space reserved for a guest write; see the [module documentation](self) for the
/// contract.
#[derive(Debug)]
#[must_use = "a lease holds its guest range until it is committed or aborted"]
pub struct WriteLease<S: Storage + 'static> {
    image: Image<S>,
    lock_id: Option<u64>,
    pieces: Vec<PreparedWrite>,
    extents: Vec<HostExtent>,
}

/// The body of [`Image::write_lease`].
pub(crate) async fn write_lease<S: Storage + 'static>(
    img: &Image<S>,
    offset: u64,
    len: u64,
) -> Result<WriteLease<S>> {
    let inner = &img.inner;
    inner.shared.check_writable()?;
    inner.shared.check_range(offset, len)?;
    inner.shared.check_not_encrypted("a write lease")?;
    let mut lease = WriteLease {
        image: img.clone(),
        lock_id: None,
        pieces: Vec::new(),
        extents: Vec::new(),
    };
    if len == 0 {
        return Ok(lease);
    }
    let recorded = inner.record_change(offset, len).await?;
    let bits = inner.shared.geo.cluster_bits();
    let (first, end) = (offset >> bits, ((offset + len - 1) >> bits) + 1);
    lease.lock_id = Some(inner.locks.acquire(first, end, true).await);
    if let Err(e) = inner.recorded(recorded, offset, len).await {
        lease.abort().await;
        return Err(e);
    }
    let cs = inner.shared.geo.cluster_size();
    let mut spans = Vec::new();
    let mut pos = 0u64;
    while pos < len {
        let at = offset + pos;
        let within = at % cs;
        let n = (cs - within).min(len - pos);
        spans.push((at - within, within as usize, (within + n) as usize));
        pos += n;
    }
    lease.pieces = match inner.prepare_chunks(&spans).await {
        Ok(p) => p,
        Err(e) => {
            lease.abort().await;
            return Err(e);
        }
    };
    for p in &lease.pieces {
        if let Err(e) = inner.write_cow(p).await {
            lease.abort().await;
            return Err(e);
        }
    }
    lease.extents = merge(lease.pieces.iter().map(PreparedWrite::guest_span));
    Ok(lease)
}

fn merge(spans: impl Iterator<Item = (u64, u64, u64)>) -> Vec<HostExtent> {
    let mut out: Vec<HostExtent> = Vec::new();
    for (guest_offset, host_offset, length) in spans {
        if let Some(last) = out.last_mut() {
            if last.guest_offset + last.length == guest_offset
                && last.host_offset + last.length == host_offset
            {
                last.length += length;
                continue;
            }
        }
        out.push(HostExtent {
            guest_offset,
            host_offset,
            length,
        });
    }
    out
}

impl<S: Storage + 'static> WriteLease<S> {
    /// Where the guest bytes go, in guest order; adjacent parts that are contiguous on the
    /// host are merged.
    pub fn extents(&self) -> &[HostExtent] {
        &self.extents
    }

    /// Links the written range into the image (call only after your data writes completed).
    pub async fn commit(mut self) -> Result<()> {
        let pieces = std::mem::take(&mut self.pieces);
        let result = self.image.inner.link_chunks(&pieces).await;
        self.unlock();
        result
    }

    /// Gives the reserved clusters back without linking them; the range keeps its contents.
    pub async fn abort(mut self) {
        let pieces = std::mem::take(&mut self.pieces);
        self.image.inner.abandon_chunks(&pieces).await;
        self.unlock();
    }

    fn unlock(&mut self) {
        if let Some(id) = self.lock_id.take() {
            self.image.inner.locks.release(id);
        }
    }
}

impl<S: Storage + 'static> Drop for WriteLease<S> {
    fn drop(&mut self) {
        self.unlock();
        // Neither committed nor aborted: the next flush or close gives the fresh clusters
        // back (they were never linked, so this is always safe), with or without a runtime.
        let fresh = self.pieces.iter().filter(|p| p.fresh).map(|p| p.host);
        self.image
            .inner
            .shared
            .abandoned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(fresh);
    }
}

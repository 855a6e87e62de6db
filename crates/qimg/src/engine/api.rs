//! The public async API of [`Image`]: accessors, reads, writes, write-zeroes, discards,
//! flushes, resizing, statistics and closing. Each call takes the locks it needs and runs the
//! data path in `rw`.

use std::io::{IoSlice, IoSliceMut};
use std::path::Path;
use std::sync::atomic::Ordering;

use qimg_io::Storage;

use super::bitmaps::{BitmapInfo, DirtyBitmap};
use super::image::{Backing, Image, Stats};
use crate::error::Result;

impl<S: Storage + 'static> Image<S> {
    /// The virtual disk size in bytes.
    pub fn size(&self) -> u64 {
        self.inner.shared.size.load(Ordering::Acquire)
    }

    /// The cluster size in bytes.
    pub fn cluster_size(&self) -> u64 {
        self.inner.shared.geo.cluster_size()
    }

    /// The subcluster size in bytes (the cluster size without extended L2 entries).
    pub fn subcluster_size(&self) -> u64 {
        self.inner.shared.geo.subcluster_size()
    }

    /// Whether the image has extended L2 entries (32 subclusters per cluster).
    pub fn extended_l2(&self) -> bool {
        self.inner.shared.geo.extended_l2()
    }

    /// Whether the image is open for writing.
    pub fn is_writable(&self) -> bool {
        self.inner.shared.writable
    }

    /// `Err(`[`Error::Unusable`](crate::Error::Unusable)`)` once corruption was found while the image was open for
    /// writing: from then on every request fails with that error (QEMU's driver ejects its
    /// medium the same way), else `Ok`.
    pub fn check_usable(&self) -> Result<()> {
        self.inner.shared.check_usable()
    }

    /// The image file's name as given at open.
    pub fn path(&self) -> &Path {
        &self.inner.shared.path
    }

    /// The storage holding the image file (for a VMM that issues its own I/O on the same
    /// file, or to see which backend [`OpenOptions::open`](crate::OpenOptions::open) chose).
    pub fn storage(&self) -> &S {
        &self.inner.shared.file
    }

    /// The backing image, if one is open.
    pub fn backing(&self) -> Option<&Backing<S>> {
        self.inner.backing.as_ref()
    }

    /// Counters and cache statistics.
    pub async fn stats(&self) -> Stats {
        let (l2_cache, refcount_cache) = self.inner.meta.lock().await.cache_stats();
        let c = &self.inner.shared.counters;
        Stats {
            cow_bytes: c.cow_bytes.load(Ordering::Relaxed),
            clusters_allocated: c.clusters_allocated.load(Ordering::Relaxed),
            clusters_freed: c.clusters_freed.load(Ordering::Relaxed),
            l2_cache,
            refcount_cache,
        }
    }

    /// Fills `buf` with guest data from `offset`.
    pub async fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.inner.read(buf, offset).await
    }

    /// Fills the segments in turn with guest data from `offset` (as a virtio or NBD request
    /// with several buffers): one request, the data read straight into each segment.
    pub async fn read_vectored(&self, bufs: &mut [IoSliceMut<'_>], offset: u64) -> Result<()> {
        self.inner.read_vectored(bufs, offset).await
    }

    /// Reads `buf` from position `pos` of the VM-state area (where QEMU saves a VM's state
    /// with an internal snapshot: guest offsets past the disk; qemu-io's `read -b`). Zeros
    /// where nothing was saved.
    pub async fn read_vmstate(&self, buf: &mut [u8], pos: u64) -> Result<()> {
        self.inner.read_vmstate(buf, pos).await
    }

    /// Writes `buf` at position `pos` of the VM-state area (qemu-io's `write -b`), growing
    /// the L1 table to map it. Dirty bitmaps do not track it.
    pub async fn write_vmstate(&self, buf: &[u8], pos: u64) -> Result<()> {
        self.inner.write_vmstate(buf, pos).await
    }

    /// Writes `buf` at guest `offset`, allocating (and copying on write) as needed.
    pub async fn write(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.inner.write(buf, offset).await
    }

    /// Writes the segments in turn at consecutive guest offsets from `offset`: one request
    /// (no other request sees it half done), the data written straight from each segment.
    pub async fn write_vectored(&self, bufs: &[IoSlice<'_>], offset: u64) -> Result<()> {
        self.inner.write_vectored(bufs, offset).await
    }

    /// Writes one whole guest cluster compressed with the image's compression type (zlib or
    /// zstd), as `qemu-img convert -c` does: `offset` must be cluster aligned and `data` one
    /// cluster long, or shorter only for the last cluster of a disk whose size is not a
    /// multiple of the cluster size. Several compressed clusters share a host cluster. Data
    /// that does not shrink is stored uncompressed. Images with an external data file cannot
    /// hold compressed clusters.
    pub async fn write_compressed(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.inner.write_compressed(offset, data).await
    }

    /// Makes `len` bytes at `offset` read as zeros, keeping the space allocated (QEMU's
    /// write-zeroes without `BDRV_REQ_MAY_UNMAP`): whole subclusters (clusters without
    /// extended L2) only change metadata and keep their host clusters, so preallocation
    /// survives and later writes land in place; partial ones are written with zeros.
    pub async fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.write_zeroes(offset, len, false).await
    }

    /// [`write_zeroes`](Self::write_zeroes) that may release space (NBD write-zeroes without
    /// `NO_HOLE`, virtio-blk's with unmap, `qemu-io write -z -u`): a host cluster left with
    /// no allocated subcluster is freed and its space punched.
    pub async fn write_zeroes_unmap(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.write_zeroes(offset, len, true).await
    }

    /// Discards `len` bytes at `offset`: every whole subcluster (cluster without extended L2)
    /// in the range reads as zeros afterwards, over a backing file too (a zero subcluster
    /// there, as QEMU sets the zero flag; a v2 image, which has no zero clusters, gets zeros
    /// written); a host cluster left with no allocated subcluster is freed and its space
    /// punched. Parts of the range smaller than a subcluster are left as they are (discard
    /// is advisory).
    pub async fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.discard(offset, len).await
    }

    /// The persistent dirty bitmaps, in directory order.
    pub fn bitmaps(&self) -> Vec<BitmapInfo> {
        self.inner.bitmap_list()
    }

    /// Adds an empty persistent bitmap (`qemu-img bitmap --add`): `granularity` (a power of
    /// two, 512 bytes to 2 GiB) defaults to the cluster size within 4 to 64 KiB, as QEMU's;
    /// `enabled` records every write from now on. It reaches the file when the image is
    /// closed. Refused on a version 2 image, as by QEMU, and with QEMU's words.
    pub fn add_bitmap(&self, name: &str, granularity: Option<u64>, enabled: bool) -> Result<()> {
        self.inner.add_bitmap(name, granularity, enabled)
    }

    /// Removes bitmap `name` (an inconsistent one too); its clusters are freed at close.
    pub fn remove_bitmap(&self, name: &str) -> Result<()> {
        self.inner.remove_bitmap(name)
    }

    /// Clears every bit of bitmap `name`: "nothing changed since now".
    pub fn clear_bitmap(&self, name: &str) -> Result<()> {
        self.inner.clear_bitmap(name)
    }

    /// Makes bitmap `name` record writes (`true`) or stop recording them (`false`).
    pub fn enable_bitmap(&self, name: &str, enabled: bool) -> Result<()> {
        self.inner.enable_bitmap(name, enabled)
    }

    /// Sets in bitmap `name` everything `source` has set (from this image or another; see
    /// [`dirty_bitmap`](Self::dirty_bitmap)).
    pub fn merge_bitmap(&self, name: &str, source: &DirtyBitmap) -> Result<()> {
        self.inner.merge_bitmap(name, source)
    }

    /// The bits of bitmap `name`: what changed since it was added or cleared, while it was
    /// enabled. [`DirtyBitmap::extents`] lists the changed ranges. An inconsistent bitmap is
    /// refused (it may have missed writes).
    pub async fn dirty_bitmap(&self, name: &str) -> Result<DirtyBitmap> {
        self.inner.dirty_bitmap(name).await
    }

    /// The changed ranges `(offset, length)` of bitmap `name` within `[offset, offset +
    /// len)`, merged and clipped to the range: [`dirty_bitmap`](Self::dirty_bitmap)'s
    /// extents without copying the bitmap (an NBD export's `qemu:dirty-bitmap:` context).
    pub async fn bitmap_extents(
        &self,
        name: &str,
        offset: u64,
        len: u64,
    ) -> Result<Vec<(u64, u64)>> {
        self.inner.bitmap_extents(name, offset, len).await
    }

    /// Records `[offset, offset + len)` as changed in every enabled persistent dirty bitmap,
    /// without changing anything else. Every write, write-zeroes and discard does this
    /// itself; a caller that answers a request without calling them (QEMU's block layer
    /// marks a whole discard request even where the format ignores part of it, and
    /// `qimg io`'s `discard` does the same) records it here.
    pub fn mark_dirty(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.shared.check_writable()?;
        self.inner.shared.check_range(offset, len)?;
        // In memory only: nothing on disk changes with it.
        let _ = self.inner.shared.bitmaps.mark(offset, len);
        Ok(())
    }

    /// Writes back every cached metadata change in the safe order and makes everything
    /// written so far durable. On an image with lazy refcounts (marked dirty by its first
    /// allocation) the refcount blocks are the exception, as in QEMU: they stay cached until
    /// the close, and a crash is repaired by rebuilding them at the next read-write open.
    ///
    /// After a failed flush nothing written since the last successful one is promised. The
    /// engine keeps its write-back order, so a later flush that works makes everything
    /// durable on storage that keeps what it could not write; files do not (Linux may drop
    /// the pages a failed fsync could not write), so on [`qimg_io::FileStorage`] and
    /// [`qimg_io::UringStorage`] every later flush fails too, as in QEMU: reopen the image.
    pub async fn flush(&self) -> Result<()> {
        let mut m = self.inner.meta.lock().await;
        self.inner.shared.free_abandoned(&mut m).await?;
        self.inner.shared.flush_guest(&mut m).await
    }

    /// The lines QEMU's qcow2 driver prints on standard error for what happened since the
    /// last call, each once: the repair of a dirty image at a read-write open (lazy refcounts
    /// after a crash), and the moment the image was marked corrupt (`qcow2: Marking image as
    /// corrupt: ...`). Empty when nothing happened. `qimg io` prints them as qemu-io does.
    ///
    /// Never waits: while a request holds the metadata (one stopped at a `blkdebug`
    /// breakpoint, say) the messages stay for a later call.
    pub async fn take_messages(&self) -> Vec<String> {
        match self.inner.meta.try_lock() {
            Ok(mut m) => m.take_messages(),
            Err(_) => Vec::new(),
        }
    }

    /// Grows the virtual disk to `new_size` bytes (shrinking is refused).
    pub async fn resize(&self, new_size: u64) -> Result<()> {
        self.inner.resize(new_size).await
    }

    /// Preallocates metadata for `[offset, offset + len)`, as qemu-img's
    /// `--preallocation=metadata` does for the area a resize adds: every guest cluster
    /// without a host cluster gets one, linked without guest data written, so that later
    /// writes there allocate nothing. What the guest reads does not change: clusters never
    /// used are holes past the old end of the file, reused ones are zeroed first; a standard
    /// entry that shows the backing file keeps it (extended entries keep every subcluster's
    /// state and take the host cluster).
    pub async fn preallocate(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.preallocate(offset, len).await
    }

    /// Grows the virtual disk to `new_size` bytes as qemu-img's `resize
    /// --preallocation=falloc` (`full == false`) or `full` does, in QEMU's layout: a new
    /// refcount table after the last cluster in use, then the new area's data clusters in one
    /// run (the cluster holding the old end moves there too, its bytes copied), reserved with
    /// `fallocate` or (`full`) written with zeros, linked as clusters reading zeros (extended
    /// entries keep their subclusters' states, or count them written where a longer backing
    /// file would otherwise show through). With an external data file, or clusters of the
    /// new area already allocated, zeros are written over the new area instead.
    pub async fn resize_preallocated(&self, new_size: u64, full: bool) -> Result<()> {
        self.inner.resize_preallocated(new_size, full).await
    }

    /// Runs one pass of the cache-clean timer now: slices unused for a whole clean interval
    /// are written back if dirty and dropped. The timer task does this by itself when a tokio
    /// runtime was running at open; returns the bytes freed.
    pub async fn clean_idle_caches(&self) -> Result<u64> {
        let mut m = self.inner.meta.lock().await;
        self.inner.shared.clean_idle(&mut m).await
    }

    /// Flushes and, for images with lazy refcounts, marks the image clean, then releases the
    /// image locks of every file of the chain. Further requests on any handle of this image
    /// fail.
    pub async fn close(&self) -> Result<()> {
        self.inner.close().await
    }
}

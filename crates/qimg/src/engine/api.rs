//! Every public method of [`Image`], in one place: accessors, reads, writes, write-zeroes,
//! discards, flushes, resizing, statistics and closing (their bodies are the engine's), then
//! snapshots, queues, transactions, the map, leases, emptying and shrinking, whose bodies live
//! with their mechanism (`snapshot`, `queue`, `checkpoint`, `map`, `lease`, `read_lease`,
//! `rw/empty.rs`, `rw/resize.rs`) as functions of the image.

use std::io::{IoSlice, IoSliceMut};
use std::path::Path;
use std::sync::atomic::Ordering;

use qimg_io::Storage;

use super::bitmap_set::{BitmapInfo, DirtyBitmap};
use super::checkpoint::{self, Action};
use super::image::{Backing, Image, Stats};
use super::lease::{self, WriteLease};
use super::map::Extent;
#[cfg(target_os = "linux")]
use super::queue::{self, Queue, QueueOptions};
use super::read_lease::{self, ReadLease};
use super::rw::empty;
use super::snapshot::{self, InternalSnapshot, SnapshotOptions};
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

    /// Whether the image is encrypted (LUKS, opened with its passphrase): its host bytes are
    /// ciphertext, so host offsets (`map`, leases) mean nothing to a reader of the file.
    pub fn is_encrypted(&self) -> bool {
        self.inner.shared.crypt.is_some()
    }

    /// The persistent dirty bitmaps, in directory order.
    pub fn bitmaps(&self) -> Vec<BitmapInfo> {
        self.inner.bitmap_list()
    }

    /// Persistent dirty bitmap `name`, or QEMU's refusal ("Dirty bitmap 'NAME' not found").
    pub fn bitmap(&self, name: &str) -> Result<BitmapInfo> {
        self.inner.bitmap_info(name)
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
        // Preallocated clusters are holes of the file, which decrypt to noise.
        self.inner.shared.check_not_encrypted("preallocation")?;
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
        self.inner.shared.check_not_encrypted("preallocation")?;
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

/// The rest of the public API; each body lives with its mechanism (`snapshot`, `queue`,
/// `checkpoint`, `map`, the leases, `rw/empty.rs`, `rw/resize.rs`).
impl<S: Storage + 'static> Image<S> {
    /// The internal snapshots, in table order (as `qemu-img snapshot -l` lists them).
    pub async fn snapshots(&self) -> Result<Vec<InternalSnapshot>> {
        snapshot::snapshots(self).await
    }

    /// Creates a disk-only internal snapshot named `name` of the current contents, as
    /// `qemu-img snapshot -c` does: its ID is one more than the largest numeric ID, its date
    /// the system clock. Names need not be unique (qemu-img does not refuse duplicates).
    /// Images with an external data file cannot have snapshots.
    pub async fn create_snapshot(&self, name: &str) -> Result<InternalSnapshot> {
        snapshot::create_snapshot(self, name).await
    }

    /// [`create_snapshot`](Self::create_snapshot) recording the date and guest clock of
    /// `opts` (a VMM's own clock, or a fixed date for reproducible images).
    pub async fn create_snapshot_with(
        &self,
        name: &str,
        opts: &SnapshotOptions,
    ) -> Result<InternalSnapshot> {
        snapshot::create_snapshot_with(self, name, opts).await
    }

    /// Reverts the disk to snapshot `name_or_id` (an ID, else the first snapshot with that
    /// name), as `qemu-img snapshot -a` does: the snapshot's L1 table becomes the active one
    /// and the virtual size becomes the snapshot's. The snapshot stays. Refused, as by QEMU,
    /// while the image has persistent dirty bitmaps (reverting would leave them wrong).
    pub async fn apply_snapshot(&self, name_or_id: &str) -> Result<()> {
        snapshot::apply_snapshot(self, name_or_id).await
    }

    /// Makes this read-only image show snapshot `id` and/or `name` (both, when both are
    /// given, must match one snapshot; one alone is matched against the IDs, then the names,
    /// when `id` and `name` are the same string) instead of the active disk, until the image
    /// is closed. The virtual size stays the disk's, as in QEMU (past the snapshot's own
    /// size the disk reads as unallocated). QEMU's `bdrv_snapshot_load_tmp`, as
    /// `qemu-img convert -l` uses it. Nothing is written; a writable image is refused.
    pub async fn view_snapshot(&self, id: Option<&str>, name: Option<&str>) -> Result<()> {
        snapshot::view_snapshot(self, id, name).await
    }

    /// Deletes snapshot `name_or_id` (an ID, else the first snapshot with that name): its
    /// entry leaves the table and every cluster only it used is freed.
    pub async fn delete_snapshot(&self, name_or_id: &str) -> Result<()> {
        snapshot::delete_snapshot(self, name_or_id).await
    }

    /// A per-queue completion handle on this image: its own io_uring ring and eventfd, and a
    /// thread for the requests that need the engine. See [`Queue`].
    pub fn queue(&self, options: QueueOptions) -> Result<Queue<S>> {
        queue::queue(self, options)
    }

    /// Applies `actions` in order, all at one instant: every guest request (through any
    /// handle: the engine, a [`Queue`](crate::Queue), a lease) either finished before them or
    /// starts after them, and runs as if they all happened together. So a transaction that
    /// takes a snapshot, disables bitmap `b0` and adds an enabled `b1` makes a checkpoint:
    /// `b0` holds every change up to the snapshot, `b1` every change after it.
    ///
    /// All or nothing: every action is checked first (QEMU's refusals, in its words), the
    /// snapshots are taken next (the only actions that write; when one fails, the actions
    /// after it are not applied and those before stay), then the bitmap changes, which
    /// cannot fail once checked. With crash-consistent bitmaps (the default) the bitmaps are
    /// then stored on disk, so that a crash at any later point finds a bitmap added here
    /// recording and one disabled here consistent with its final bits; a failure of that
    /// store is returned after the actions took effect in memory. Returns the snapshots made,
    /// in order.
    pub async fn transaction(&self, actions: &[Action]) -> Result<Vec<InternalSnapshot>> {
        checkpoint::transaction(self, actions).await
    }

    /// The extents of `[offset, offset + len)` in this image (not its backing chain), merged
    /// where adjacent extents have the same kind and contiguous host bytes. Compressed
    /// extents are reported per cluster.
    pub async fn map(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.inner.map(offset, len).await
    }

    /// Pins `len` guest bytes at `offset` for reading and returns where they are. A
    /// zero-length range gives a lease with no extents.
    pub async fn read_lease(&self, offset: u64, len: u64) -> Result<ReadLease<S>> {
        read_lease::read_lease(self, offset, len).await
    }

    /// Makes every cluster of the image unallocated: reads then come from the backing file
    /// (or are zeros without one). Data, zero and compressed clusters alike are dropped and
    /// their host clusters freed. Where QEMU's `qcow2_make_empty` resets the whole image
    /// (version 3, no snapshots, bitmaps or data file) so does this, leaving the same four
    /// clusters; otherwise only ranges the image allocates are visited.
    pub async fn make_empty(&self) -> Result<()> {
        empty::make_empty(self).await
    }

    /// Changes the virtual disk size to `new_size` bytes, shrinking included (growing is as
    /// [`Image::resize`]). Shrinking drops every cluster past the new end (see the module
    /// documentation); `new_size` must be a multiple of 512.
    pub async fn shrink(&self, new_size: u64) -> Result<()> {
        self.inner.shrink(new_size).await
    }

    /// Reserves host space for writing `len` guest bytes at `offset` yourself: allocates new
    /// clusters where needed, performs the copy-on-write around the range (from the old
    /// cluster, the backing file or zeros), and returns where each part of the range goes.
    /// A zero-length range gives a lease with no extents.
    pub async fn write_lease(&self, offset: u64, len: u64) -> Result<WriteLease<S>> {
        lease::write_lease(self, offset, len).await
    }

    /// The file that [`HostExtent::host_offset`](super::lease::HostExtent::host_offset)s of write leases and
    /// [`ExtentKind::Data`](crate::ExtentKind::Data) offsets of [`map`](Image::map) refer to:
    /// the external data file when the image has one, else the image file.
    pub fn data_path(&self) -> &Path {
        self.inner.shared.data().1
    }
}

//! Metadata: the L1 table, the L2 and refcount caches, cluster allocation and freeing, and
//! write-back in the crash-safe order (qcow2-format.md section 12).
//!
//! Everything here runs with the metadata lock held ([`Meta`] is what it guards). Metadata I/O
//! happens under it; guest data I/O never does.
//!
//! | module | what |
//! |---|---|
//! | this one | [`Meta`] and its loading at open, the overlap guard, corruption marking |
//! | `slices` | L2 entry lookup and update through the slice caches; write-back in dependency order, flush, the clean interval |
//! | `refcounts` | refcounts, cluster allocation and freeing, refcount blocks and table growth |
//! | `tables` | L2 table creation and un-sharing, L1 entries and growth, header switches and flags |

mod alloc;
mod refcounts;
mod slices;
mod tables;

pub(crate) use refcounts::plan_refcount_area;

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::atomic::Ordering;

use qimg_cache::{ResolvedCache, SliceCache};
use qimg_format::features::{INCOMPAT_CORRUPT, INCOMPAT_DIRTY};
use qimg_format::geometry::{Geometry, QCOW_MAX_CLUSTER_OFFSET};
use qimg_format::header::Header;
use qimg_format::l1::{self, L1Entry};
use qimg_format::l2::AnyL2Entry;
use qimg_format::refcount;
use qimg_io::Storage;

use super::overlap::{OverlapIndex, Region, Writing};
use super::state::Shared;
use crate::error::{Error, Result};

/// Host offsets in L1/L2 entries must stay below 2^56.
const MAX_HOST_OFFSET: u64 = QCOW_MAX_CLUSTER_OFFSET + 1;
/// Punches queued before a flush forces them out.
const MAX_PENDING_PUNCHES: usize = 4096;

/// CacheKind of the two caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CacheKind {
    L2,
    Refcount,
}

impl CacheKind {
    fn other(self) -> Self {
        match self {
            Self::L2 => Self::Refcount,
            Self::Refcount => Self::L2,
        }
    }
}

/// What a metadata change needs before it can be made without I/O. Each change has one body
/// that makes it from cached metadata or names what it lacks (`set_entry_now`,
/// `set_dependency_now`, `link_now`): the engine resolves the need with I/O
/// ([`resolve`](Shared::resolve)) and asks again; a queue's direct path, which must not wait,
/// leaves the change to its engine thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Need {
    /// `kind` is to wait for `on`, but `on` already waits for `kind`: write `kind` back and
    /// flush first (QEMU's `qcow2_cache_set_dependency`), so the two never wait for each other.
    WriteBack { kind: CacheKind, on: CacheKind },
    /// The L2 slice of the guest cluster at this offset, cached, in a table of its own (created
    /// or un-shared from a snapshot first).
    WritableSlice(u64),
    /// The dirty bit on disk before the first refcount change (lazy refcounts).
    DirtyBit,
    /// Refcount block `index`, created at host cluster `at` (free) if missing.
    Refblock { index: u64, at: u64 },
    /// A refcount table with room for this many blocks (moved to the end of the file).
    Reftable(u64),
    /// A flush, so that clusters freed since the last one may be reused.
    Flush,
    /// Free clusters only past the window a caller's thread searches (see
    /// `find_free_now`); the engine never sets a window.
    Far,
    /// This refcount slice in the cache.
    RefcountSlice(qimg_cache::SliceKey),
    /// This L2 slice in the cache.
    L2Slice(qimg_cache::SliceKey),
}

/// The answer of a change made without I/O: done (`Ok`), or what it needs first (`Err`).
pub(crate) type Needs<T> = std::result::Result<T, Need>;

/// State guarded by the metadata lock.
#[derive(Debug)]
pub(crate) struct Meta {
    l1: Vec<L1Entry>,
    l1_offset: u64,
    reftable: Vec<u64>,
    reftable_offset: u64,
    l2: SliceCache,
    rc: SliceCache,
    l2_slice: u64,
    /// Lowest cluster that may be free.
    free_hint: u64,
    /// First cluster past everything allocated and past the end of the file at open.
    end_cluster: u64,
    /// The dirty bit is set in the header on disk.
    dirty_on_disk: bool,
    /// QEMU's messages of what happened (the repair of a dirty image at open, the image
    /// marked corrupt), not yet taken (see
    /// [`Image::take_messages`](crate::Image::take_messages)).
    messages: Vec<String>,
    /// The incompatible feature bits as on disk.
    incompatible: u64,
    /// Freed clusters to punch once the metadata that stopped using them is durable.
    pending_punch: BTreeSet<u64>,
    closed: bool,
    snapshots: (u64, u32),
    /// Where the next compressed cluster may go: the first unused byte of the host cluster
    /// compressed writes are packing into (QEMU packs them the same way).
    compressed_tail: Option<u64>,
    /// Where the metadata is, for the overlap checks before every write.
    overlap: OverlapIndex,
    /// Changes with every change of the active L1 table: a slice read without the metadata
    /// lock is kept only if its table was the active one throughout.
    l1_epoch: u64,
    cluster_size: u64,
}

impl Meta {
    /// The crash-ordering rule of every L2 entry that points at guest data just written: the
    /// L2 slices may be written back only after that data is durable (a flush of the data
    /// file first), so that no entry on disk ever points at data that is not. Both linking
    /// paths (`link_now`, compressed writes) state it here.
    pub(crate) fn entries_wait_for_data(&mut self) {
        self.l2.depend_on_flush();
    }

    /// Marks the image closed (see [`is_closed`](Self::is_closed)).
    pub(crate) fn mark_closed(&mut self) {
        self.closed = true;
    }

    /// The first cluster past everything allocated and past the end of the file at open.
    pub(crate) fn end_cluster(&self) -> u64 {
        self.end_cluster
    }

    /// Where the next compressed cluster may be packed (see the field).
    pub(crate) fn compressed_tail(&self) -> Option<u64> {
        self.compressed_tail
    }

    /// Sets where the next compressed cluster may be packed.
    pub(crate) fn set_compressed_tail(&mut self, tail: Option<u64>) {
        self.compressed_tail = tail;
    }

    /// Notes that the dirty bit is set on disk.
    pub(crate) fn note_dirty_on_disk(&mut self) {
        self.dirty_on_disk = true;
    }

    /// Records metadata of `region` at `[at, at + len)` for the overlap checks.
    pub(crate) fn note_metadata(&mut self, region: Region, at: u64, len: u64) {
        self.overlap.insert(region, at, len);
    }

    /// Forgets the metadata of `region` that starts at `at`.
    pub(crate) fn forget_metadata(&mut self, region: Region, at: u64) {
        self.overlap.remove(region, at);
    }

    /// The statistics of the L2 and the refcount caches.
    pub(crate) fn cache_stats(&self) -> (qimg_cache::CacheStats, qimg_cache::CacheStats) {
        (self.l2.stats(), self.rc.stats())
    }

    /// Takes the driver's messages not taken yet.
    pub(crate) fn take_messages(&mut self) -> Vec<String> {
        std::mem::take(&mut self.messages)
    }

    /// Whether the image was closed: nothing may use its metadata any more.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed
    }

    /// The L2 table the active L1 table names at `l1_index` (`None`: none, or past the table).
    pub(crate) fn l2_table(&self, l1_index: usize) -> Option<u64> {
        self.l1.get(l1_index)?.l2_offset.map(|o| o.0)
    }

    /// Entries in the active L1 table.
    pub(crate) fn l1_len(&self) -> usize {
        self.l1.len()
    }

    /// The active L1 table as in memory. It changes only through
    /// [`set_l1_entry`](Self::set_l1_entry) and [`replace_l1`](Self::replace_l1).
    pub(crate) fn l1(&self) -> &[L1Entry] {
        &self.l1
    }

    /// Where the active L1 table is in the file.
    pub(crate) fn l1_offset(&self) -> u64 {
        self.l1_offset
    }

    /// Changes entry `i` of the active L1 table in memory (the caller wrote it to disk).
    /// With [`replace_l1`](Self::replace_l1), the one place the table changes, and so the
    /// one place its epoch moves: a slice read without the lock while the table changed is
    /// not kept (see [`unlocked_load_usable`](Shared::unlocked_load_usable)).
    pub(crate) fn set_l1_entry(&mut self, i: usize, entry: L1Entry) {
        self.l1[i] = entry;
        self.l1_epoch += 1;
    }

    /// Replaces the active L1 table in memory with `l1`, whose place in the file is `at`
    /// (the caller wrote it there, or over the old one when `at` is the old place, and
    /// switched the header); returns the old table. The epoch moves (see
    /// [`set_l1_entry`](Self::set_l1_entry)).
    pub(crate) fn replace_l1(&mut self, l1: Vec<L1Entry>, at: u64) -> Vec<L1Entry> {
        self.l1_epoch += 1;
        self.l1_offset = at;
        std::mem::replace(&mut self.l1, l1)
    }

    /// The refcount table as in memory: the offset of each refcount block (0: none).
    pub(crate) fn reftable(&self) -> &[u64] {
        &self.reftable
    }

    /// Where the refcount table is in the file.
    pub(crate) fn reftable_offset(&self) -> u64 {
        self.reftable_offset
    }

    /// The snapshot table the header names: its offset and its number of entries.
    pub(crate) fn snapshot_table(&self) -> (u64, u32) {
        self.snapshots
    }

    /// The header names the snapshot table of `nb` entries at `at`, `len` bytes, now: it
    /// replaces the old one in memory and in the overlap checks. Returns the old offset and
    /// count.
    pub(crate) fn set_snapshot_table(&mut self, at: u64, nb: u32, len: u64) -> (u64, u32) {
        self.overlap.remove_all(Region::SnapshotTable);
        if nb > 0 {
            self.overlap.insert(Region::SnapshotTable, at, len);
        }
        std::mem::replace(&mut self.snapshots, (at, nb))
    }

    /// The active tree stops using L2 table `table` (one reference less in the overlap
    /// checks); with `uncache`, its slices leave the L2 cache unwritten (the caller wrote
    /// back what was dirty).
    pub(crate) fn forget_l2_table(&mut self, table: u64, uncache: bool) {
        self.overlap.remove_one(Region::ActiveL2, table);
        if uncache {
            let _ = self.l2.remove(table);
        }
    }

    /// The slices of L2 table `table` leave the cache unwritten (the caller wrote back what
    /// was dirty, and changes the table in the file).
    pub(crate) fn uncache_l2_table(&mut self, table: u64) {
        let _ = self.l2.remove(table);
    }

    /// The active tree uses L2 table `table` (one reference more in the overlap checks).
    pub(crate) fn note_l2_table(&mut self, table: u64) {
        self.overlap
            .insert_counted(Region::ActiveL2, table, self.cluster_size);
    }

    /// The bytes of cached L2 slice `key` (an uncounted look); `None` when it is not cached.
    pub(crate) fn l2_slice(&self, key: qimg_cache::SliceKey) -> Option<&[u8]> {
        self.l2.peek(key)
    }

    /// The bytes of cached L2 slice `key`, to change in place (marked dirty, stamped `now`);
    /// `None` when it is not cached.
    pub(crate) fn l2_slice_mut(
        &mut self,
        key: qimg_cache::SliceKey,
        now: std::time::Duration,
    ) -> Option<&mut [u8]> {
        self.l2.get_mut(key, now)
    }

    /// Messages for [`take_messages`](Self::take_messages), replacing any not taken.
    pub(crate) fn set_messages(&mut self, messages: Vec<String>) {
        self.messages = messages;
    }

    /// After a rebuild of the refcounts: the refcount cache starts empty (same budget), the
    /// search for free clusters from the start, and `end` is the first cluster past
    /// everything in use.
    pub(crate) fn refcounts_rebuilt(
        &mut self,
        end: u64,
    ) -> std::result::Result<(), qimg_cache::CacheError> {
        let slice = self.rc.slice_size() as u64;
        self.rc = SliceCache::new(self.rc.capacity() as u64 * slice, slice)?;
        self.end_cluster = end;
        self.free_hint = 0;
        Ok(())
    }

    /// Puts an L2 slice read without the lock into the cache, after
    /// [`unlocked_load_usable`](Shared::unlocked_load_usable) said it may go there; gives
    /// back a dirty victim, which the caller must write back.
    pub(crate) fn insert_l2_slice(
        &mut self,
        key: qimg_cache::SliceKey,
        data: Box<[u8]>,
        now: std::time::Duration,
    ) -> std::result::Result<Option<qimg_cache::DirtySlice>, qimg_cache::CacheError> {
        self.l2.insert(key, data, now)
    }

    /// Whether L2 slice `key` is cached (an uncounted look).
    pub(crate) fn l2_cached(&self, key: qimg_cache::SliceKey) -> bool {
        self.l2.contains(key)
    }

    /// The size of an L2 slice in bytes.
    pub(crate) fn l2_slice_size(&self) -> usize {
        self.l2.slice_size()
    }

    /// Where clusters start that have never held data: past everything allocated since open
    /// and past the end of the file at open. A new cluster there reads as zeros, so a write
    /// into it need not copy zeros around the guest's bytes (both executors' rule).
    pub(crate) fn never_used_from(&self) -> u64 {
        self.end_cluster * self.cluster_size
    }

    /// Whether guest data of `len` bytes at host offset `at` would land on metadata. The
    /// queues' direct path asks this and leaves a hit to the engine, whose
    /// [`guard_write`](Shared::guard_write) refuses the write and marks the image corrupt.
    pub(crate) fn data_overlaps_metadata(&self, at: u64, len: u64) -> bool {
        self.overlap.find(at, len, Writing::Data).is_some()
    }

    /// Whether the L2 cache's next victim is dirty: a slice loaded now would first have to
    /// write it back, which only the locked path may do.
    pub(crate) fn l2_victim_dirty(&self) -> bool {
        self.l2
            .victim()
            .is_some_and(|v| self.l2.is_dirty(v) == Some(true))
    }

    pub(crate) async fn load<S: Storage>(
        file: &S,
        path: &Path,
        h: &Header,
        geo: &Geometry,
        cache: &ResolvedCache,
        writable: bool,
    ) -> Result<Self> {
        let cs = geo.cluster_size();
        let l1_bytes = l1::table_bytes(u64::from(h.l1_size));
        let mut raw = vec![0u8; l1_bytes as usize];
        file.read_at(&mut raw, h.l1_table_offset)
            .await
            .map_err(|e| {
                Error::corrupt(
                    path,
                    format!(
                        "L1 table at {:#x} ({} entries) cannot be read: {e}",
                        h.l1_table_offset, h.l1_size
                    ),
                )
            })?;
        // Read as QEMU reads it: reserved bits are ignored, and an unaligned L2 table is
        // refused (the image marked corrupt) when a request needs it (`Shared::l2_table`).
        let l1 = qimg_format::lenient::decode_l1_table(&raw);
        let rt_bytes = u64::from(h.refcount_table_clusters) * cs;
        let mut raw = vec![0u8; rt_bytes as usize];
        file.read_at_zero_fill(&mut raw, h.refcount_table_offset)
            .await
            .map_err(|e| Error::storage(path, e))?;
        // Read as QEMU reads it: a damaged entry (an unaligned block) is only refused when a
        // refcount in that block is needed, which reads and conversions never do.
        let reftable = qimg_format::lenient::decode_words(&raw)
            .into_iter()
            .map(|w| qimg_format::lenient::RawReftableEntry(w).block_offset())
            .collect();
        let cache_err = |source| Error::Cache {
            path: path.to_path_buf(),
            source,
        };
        let len = file.len().await.map_err(|e| Error::storage(path, e))?;
        let mut overlap = OverlapIndex::new(cs);
        overlap.insert(Region::Header, 0, cs);
        overlap.insert(Region::ActiveL1, h.l1_table_offset, l1_bytes);
        for e in &l1 {
            if let Some(t) = e.l2_offset {
                // Counted: a damaged image may name one L2 table from several entries.
                overlap.insert_counted(Region::ActiveL2, t.0, cs);
            }
        }
        if writable && h.nb_snapshots > 0 {
            let want = len
                .saturating_sub(h.snapshots_offset)
                .min(qimg_format::snapshot::MAX_TABLE_SIZE) as usize;
            let mut raw = vec![0u8; want];
            file.read_at_zero_fill(&mut raw, h.snapshots_offset)
                .await
                .map_err(|e| Error::storage(path, e))?;
            let snaps =
                qimg_format::snapshot::decode_table(&raw, h.snapshots_offset, h.nb_snapshots)
                    .map_err(|e| Error::format(path, e))?;
            let table_len: u64 = snaps.iter().map(|s| s.encoded_len() as u64).sum();
            overlap.insert(Region::SnapshotTable, h.snapshots_offset, table_len);
            for s in &snaps {
                let bytes = l1::table_bytes(u64::from(s.l1_size));
                if bytes > qimg_format::validate::MAX_L1_BYTES {
                    // QEMU refuses such an image at open ("Snapshot L1 table too large").
                    return Err(Error::corrupt(
                        path,
                        format!(
                            "snapshot '{}' has an L1 table of {} entries at {:#x}: too large \
                             (at most {} bytes)",
                            qimg_format::snapshot::decode_text(&s.id),
                            s.l1_size,
                            s.l1_table_offset,
                            qimg_format::validate::MAX_L1_BYTES
                        ),
                    ));
                }
                overlap.insert(
                    Region::SnapshotL1,
                    s.l1_table_offset,
                    l1::table_bytes(u64::from(s.l1_size)),
                );
            }
        }
        let mut meta = Self {
            l1,
            l1_offset: h.l1_table_offset,
            reftable,
            reftable_offset: h.refcount_table_offset,
            l2: cache.new_l2_cache().map_err(cache_err)?,
            rc: cache.new_refcount_cache().map_err(cache_err)?,
            l2_slice: cache.l2_slice_size,
            free_hint: 0,
            end_cluster: len.div_ceil(cs),
            dirty_on_disk: h.incompatible_features & INCOMPAT_DIRTY != 0,
            messages: Vec::new(),
            incompatible: h.incompatible_features,
            pending_punch: BTreeSet::new(),
            closed: false,
            snapshots: (h.snapshots_offset, h.nb_snapshots),
            compressed_tail: None,
            overlap,
            l1_epoch: 0,
            cluster_size: cs,
        };
        meta.index_refcounts();
        Ok(meta)
    }

    /// Re-indexes the refcount table and every block it points at (after it moved).
    pub(crate) fn index_refcounts(&mut self) {
        let cs = self.cluster_size;
        self.overlap.remove_all(Region::RefcountTable);
        self.overlap.remove_all(Region::RefcountBlock);
        let table_len = refcount::table_bytes(self.reftable.len() as u64).div_ceil(cs) * cs;
        self.overlap
            .insert(Region::RefcountTable, self.reftable_offset, table_len);
        // An unaligned block is never read or written (`Shared::load` refuses it, marking the
        // image corrupt, when a refcount in it is needed): it guards nothing.
        for &b in self.reftable.iter().filter(|&&b| b % cs == 0) {
            self.overlap.insert(Region::RefcountBlock, b, cs);
        }
    }

    pub(crate) fn cache(&mut self, kind: CacheKind) -> &mut SliceCache {
        match kind {
            CacheKind::L2 => &mut self.l2,
            CacheKind::Refcount => &mut self.rc,
        }
    }
}

impl<S: Storage> Shared<S> {
    pub(crate) fn fmt_err(&self, e: qimg_format::FormatError) -> Error {
        Error::format(&self.path, e)
    }

    /// Refuses a write of `len` bytes at `at` in the image file that would land on metadata
    /// other than `writing`'s own structure (QEMU's `cached` overlap check), marking the image
    /// corrupt.
    pub(crate) async fn guard_write(
        &self,
        m: &mut Meta,
        at: u64,
        len: u64,
        writing: Writing,
    ) -> Result<()> {
        let Some(hit) = m.overlap.find(at, len, writing) else {
            return Ok(());
        };
        let what = match writing {
            Writing::Data => "guest data".to_string(),
            Writing::Own(r, s) => format!("an update of {r} at {s:#x}"),
        };
        Err(self
            .signal_corruption_as(
                m,
                format!(
                    "Preventing invalid write on metadata (overlaps with {})",
                    hit.region.qemu_name()
                ),
                format!(
                    "metadata overlap: {what} ({len} bytes at host offset {at:#x}) would overwrite {} at {:#x}..{:#x}; the write was refused",
                    hit.region, hit.start, hit.end
                ),
            )
            .await)
    }

    /// Writes `bytes` at `at` in the image file after [`guard_write`](Self::guard_write)
    /// allowed it: how a new or moved metadata structure reaches the file.
    pub(crate) async fn write_guarded(
        &self,
        m: &mut Meta,
        at: u64,
        bytes: &[u8],
        writing: Writing,
    ) -> Result<()> {
        self.guard_write(m, at, bytes.len() as u64, writing).await?;
        self.file
            .write_at(bytes, at)
            .await
            .map_err(|e| self.storage_error(e))
    }

    /// Reports corruption found while using the image. A writable image is marked corrupt on
    /// disk (incompatible bit 1) and refuses further writes, as QEMU does; `qimg check -r all`
    /// repairs it and clears the mark.
    pub(crate) async fn signal_corruption(&self, m: &mut Meta, what: String) -> Error {
        self.signal_corruption_as(m, what.clone(), what).await
    }

    /// [`signal_corruption`](Self::signal_corruption) where QEMU words the event (`event`,
    /// the line [`Image::take_messages`](crate::Image::take_messages) gives) differently
    /// from qimg's error (`what`).
    pub(crate) async fn signal_corruption_as(
        &self,
        m: &mut Meta,
        event: String,
        what: String,
    ) -> Error {
        let first = !self.marked_corrupt.swap(true, Ordering::AcqRel);
        if first && !self.writable {
            // QEMU's non-fatal form: a read-only image is not marked, only reported once.
            self.report(
                m,
                format!(
                    "qcow2: Image is corrupt: {event}; further non-fatal corruption events will \
                     be suppressed"
                ),
            );
        } else if first {
            self.report(
                m,
                format!(
                    "qcow2: Marking image as corrupt: {event}; further corruption events will be \
                     suppressed"
                ),
            );
            let bits = m.incompatible | INCOMPAT_CORRUPT;
            // Best effort: the error below is what matters if this write fails too.
            if self.write_incompatible(m, bits).await.is_ok() {
                return Error::Corrupt {
                    path: self.path.clone(),
                    what: format!("{what}; the image is now marked corrupt"),
                };
            }
        }
        Error::Corrupt {
            path: self.path.clone(),
            what,
        }
    }

    /// A message of the driver: to the open's sink, or kept for `take_messages`.
    pub(crate) fn report(&self, m: &mut Meta, line: String) {
        match &self.on_message {
            Some(sink) => (sink.0)(&line),
            None => m.messages.push(line),
        }
    }

    pub(crate) fn cache_err(&self, source: qimg_cache::CacheError) -> Error {
        Error::Cache {
            path: self.path.clone(),
            source,
        }
    }

    pub(crate) fn unallocated_entry(&self) -> AnyL2Entry {
        AnyL2Entry::unallocated(self.geo.extended_l2())
    }
}

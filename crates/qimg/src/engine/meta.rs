//! Metadata: the L1 table, the L2 and refcount caches, cluster allocation and freeing, and
//! write-back in the crash-safe order (qcow2-format.md section 12).
//!
//! Everything here runs with the metadata lock held ([`Meta`] is what it guards). Metadata I/O
//! happens under it; guest data I/O never does.

use std::collections::BTreeSet;
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::time::Duration;

use qimg_cache::{Dependencies, DirtySlice, ResolvedCache, SliceCache, SliceKey};
use qimg_format::features::{INCOMPAT_CORRUPT, INCOMPAT_DIRTY};
use qimg_format::geometry::Geometry;
use qimg_format::header::Header;
use qimg_format::l1::{self, L1Entry};
use qimg_format::l2::{AnyL2Entry, ExtendedL2Entry, L2Entry, SubclusterBitmap, write_entry};
use qimg_format::refcount;
use qimg_format::units::{GuestOffset, HostOffset};
use qimg_io::Storage;

use super::image::Inner;
use super::overlap::{OverlapIndex, Region, Writing};
use crate::error::{Error, Result};

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Host offsets in L1/L2 entries must stay below 2^56.
const MAX_HOST_OFFSET: u64 = 1 << 56;
/// Punches queued before a flush forces them out.
const MAX_PENDING_PUNCHES: usize = 4096;

/// Which of the two caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Which {
    L2,
    Refcount,
}

impl Which {
    fn other(self) -> Self {
        match self {
            Self::L2 => Self::Refcount,
            Self::Refcount => Self::L2,
        }
    }
}

/// State guarded by the metadata lock.
#[derive(Debug)]
pub(crate) struct Meta {
    pub(crate) l1: Vec<L1Entry>,
    pub(crate) l1_offset: u64,
    pub(crate) reftable: Vec<u64>,
    pub(crate) reftable_offset: u64,
    pub(crate) l2: SliceCache,
    pub(crate) rc: SliceCache,
    pub(crate) l2_slice: u64,
    /// Lowest cluster that may be free.
    pub(crate) free_hint: u64,
    /// First cluster past everything allocated and past the end of the file at open.
    pub(crate) end_cluster: u64,
    /// The dirty bit is set in the header on disk.
    pub(crate) dirty_on_disk: bool,
    /// The incompatible feature bits as on disk.
    pub(crate) incompatible: u64,
    /// Freed clusters to punch once the metadata that stopped using them is durable.
    pub(crate) pending_punch: BTreeSet<u64>,
    pub(crate) closed: bool,
    pub(crate) snapshots: (u64, u32),
    /// Where the next compressed cluster may go: the first unused byte of the host cluster
    /// compressed writes are packing into (QEMU packs them the same way).
    pub(crate) compressed_tail: Option<u64>,
    /// Where the metadata is, for the overlap checks before every write.
    pub(crate) overlap: OverlapIndex,
    cluster_size: u64,
}

impl Meta {
    pub(crate) async fn load<S: Storage>(
        file: &S,
        path: &Path,
        h: &Header,
        geo: &Geometry,
        cache: &ResolvedCache,
        writable: bool,
    ) -> Result<Self> {
        let cs = geo.cluster_size();
        let l1_bytes = u64::from(h.l1_size) * 8;
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
        let l1 =
            l1::decode_table(&raw, cs, h.l1_table_offset).map_err(|e| Error::format(path, e))?;
        let rt_bytes = u64::from(h.refcount_table_clusters) * cs;
        let mut raw = vec![0u8; rt_bytes as usize];
        file.read_at_zero_fill(&mut raw, h.refcount_table_offset)
            .await
            .map_err(|e| Error::storage(path, e))?;
        let reftable = refcount::decode_table(&raw, cs, h.refcount_table_offset)
            .map_err(|e| Error::format(path, e))?
            .iter()
            .map(|e| e.block_offset.map_or(0, |o| o.0))
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
                overlap.insert(Region::ActiveL2, t.0, cs);
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
            let snaps = qimg_format::snapshot::decode_table(
                &raw,
                h.snapshots_offset,
                h.nb_snapshots,
                h.version,
            )
            .map_err(|e| Error::format(path, e))?;
            let table_len: u64 = snaps.iter().map(|s| s.encoded_len() as u64).sum();
            overlap.insert(Region::SnapshotTable, h.snapshots_offset, table_len);
            for s in &snaps {
                overlap.insert(
                    Region::SnapshotL1,
                    s.l1_table_offset,
                    u64::from(s.l1_size) * 8,
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
            incompatible: h.incompatible_features,
            pending_punch: BTreeSet::new(),
            closed: false,
            snapshots: (h.snapshots_offset, h.nb_snapshots),
            compressed_tail: None,
            overlap,
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
        let table_len = (self.reftable.len() as u64 * 8).div_ceil(cs) * cs;
        self.overlap
            .insert(Region::RefcountTable, self.reftable_offset, table_len);
        for &b in &self.reftable {
            self.overlap.insert(Region::RefcountBlock, b, cs);
        }
    }

    pub(crate) fn cache(&mut self, which: Which) -> &mut SliceCache {
        match which {
            Which::L2 => &mut self.l2,
            Which::Refcount => &mut self.rc,
        }
    }
}

impl<S: Storage> Inner<S> {
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
            .signal_corruption(
                m,
                format!(
                    "metadata overlap: {what} ({len} bytes at host offset {at:#x}) would overwrite {} at {:#x}..{:#x}; the write was refused",
                    hit.region, hit.start, hit.end
                ),
            )
            .await)
    }

    /// Reports corruption found while using the image. A writable image is marked corrupt on
    /// disk (incompatible bit 1) and refuses further writes, as QEMU does; `qimg check -r all`
    /// repairs it and clears the mark.
    pub(crate) async fn signal_corruption(&self, m: &mut Meta, what: String) -> Error {
        if self.writable && !self.marked_corrupt.swap(true, Ordering::AcqRel) {
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

    fn cache_err(&self, source: qimg_cache::CacheError) -> Error {
        Error::Cache {
            path: self.path.clone(),
            source,
        }
    }

    pub(crate) fn unallocated_entry(&self) -> AnyL2Entry {
        if self.geo.extended_l2() {
            AnyL2Entry::Extended(ExtendedL2Entry {
                entry: L2Entry::Unallocated,
                bitmap: SubclusterBitmap::default(),
            })
        } else {
            AnyL2Entry::Standard(L2Entry::Unallocated)
        }
    }

    /// Slice key and index in the slice of the L2 entry for `guest` in table `table`.
    fn l2_position(&self, m: &Meta, table: u64, guest: u64) -> (SliceKey, usize) {
        let per_slice = m.l2_slice / self.geo.l2_entry_size();
        let index = self.geo.l2_index(GuestOffset(guest));
        let slice = index / per_slice;
        (
            SliceKey::new(table, slice as u32),
            (index % per_slice) as usize,
        )
    }

    fn slice_location(&self, m: &Meta, which: Which, key: SliceKey) -> u64 {
        match which {
            Which::L2 => key.table + u64::from(key.slice) * m.l2_slice,
            Which::Refcount => key.table,
        }
    }

    /// The L2 entry describing the guest cluster containing `guest`.
    pub(crate) async fn lookup(&self, m: &mut Meta, guest: u64) -> Result<AnyL2Entry> {
        let l1i = self.geo.l1_index(GuestOffset(guest)) as usize;
        let Some(table) = m.l1.get(l1i).and_then(|e| e.l2_offset) else {
            return Ok(self.unallocated_entry());
        };
        let (key, idx) = self.l2_position(m, table.0, guest);
        self.load(m, Which::L2, key).await?;
        let es = self.geo.l2_entry_size() as usize;
        let slice =
            m.l2.peek(key)
                .ok_or_else(|| Error::corrupt(&self.path, format!("L2 slice {key} vanished")))?;
        let at = self.slice_location(m, Which::L2, key) + (idx * es) as u64;
        match AnyL2Entry::decode(&slice[idx * es..(idx + 1) * es], &self.ctx, at) {
            Ok(e) => Ok(e),
            Err(e) if self.writable => Err(self.signal_corruption(m, e.to_string()).await),
            Err(e) => Err(self.fmt_err(e)),
        }
    }

    /// Replaces the L2 entry of the guest cluster containing `guest`, creating (or
    /// un-sharing) its L2 table first.
    pub(crate) async fn set_entry(
        &self,
        m: &mut Meta,
        guest: u64,
        entry: &AnyL2Entry,
    ) -> Result<()> {
        let l1i = self.geo.l1_index(GuestOffset(guest)) as usize;
        let table = self.ensure_l2(m, l1i).await?;
        let (key, idx) = self.l2_position(m, table, guest);
        self.load(m, Which::L2, key).await?;
        let now = self.now();
        let slice =
            m.l2.get_mut(key, now)
                .ok_or_else(|| Error::corrupt(&self.path, format!("L2 slice {key} vanished")))?;
        write_entry(slice, idx, entry).map_err(|e| self.fmt_err(e))
    }

    /// Makes sure the slice `key` is cached, writing back a dirty victim first.
    pub(crate) async fn load(&self, m: &mut Meta, which: Which, key: SliceKey) -> Result<()> {
        // A counted lookup: hits and misses in the statistics come from here.
        let now = self.now();
        if m.cache(which).get(key, now).is_some() {
            return Ok(());
        }
        if let Some(victim) = m.cache(which).victim() {
            if m.cache(which).is_dirty(victim) == Some(true) {
                // Written back while still cached: if the write fails, nothing is lost.
                self.write_back(m, which).await?;
            }
        }
        let size = m.cache(which).slice_size();
        let mut buf = vec![0u8; size];
        let at = self.slice_location(m, which, key);
        if let Err(e) = self.file.read_at(&mut buf, at).await {
            let what = format!(
                "{} at {at:#x} cannot be read: {e}",
                match which {
                    Which::L2 => "L2 table slice",
                    Which::Refcount => "refcount block",
                }
            );
            let past_end = self
                .file
                .len()
                .await
                .is_ok_and(|len| at.saturating_add(size as u64) > len);
            if past_end && self.writable {
                return Err(self.signal_corruption(m, what).await);
            }
            return Err(Error::corrupt(&self.path, what));
        }
        let now = self.now();
        let evicted = m
            .cache(which)
            .insert(key, buf.into_boxed_slice(), now)
            .map_err(|e| self.cache_err(e))?;
        if let Some(d) = evicted {
            self.write_evicted(m, which, d).await?;
        }
        Ok(())
    }

    fn own(which: Which, key: SliceKey) -> Writing {
        match which {
            Which::L2 => Writing::Own(Region::ActiveL2, key.table),
            Which::Refcount => Writing::Own(Region::RefcountBlock, key.table),
        }
    }

    async fn write_evicted(&self, m: &mut Meta, which: Which, d: DirtySlice) -> Result<()> {
        self.honour_dependencies(m, which).await?;
        let at = self.slice_location(m, which, d.key);
        self.guard_write(m, at, d.data.len() as u64, Self::own(which, d.key))
            .await?;
        self.file
            .write_at(&d.data, at)
            .await
            .map_err(|e| self.st(e))
    }

    /// Before writing any slice of `which`: flush what it depends on.
    async fn honour_dependencies(&self, m: &mut Meta, which: Which) -> Result<()> {
        let deps = m.cache(which).take_dependencies();
        let other = which.other();
        let mut theirs = Dependencies::default();
        let done = async {
            if deps.other_cache {
                theirs = m.cache(other).take_dependencies();
                if theirs.flush {
                    self.flush_data().await?;
                }
                self.write_slices(m, other).await?;
                self.file.flush().await.map_err(|e| self.st(e))?;
            }
            if deps.flush {
                self.flush_data().await?;
            }
            Ok(())
        }
        .await;
        if done.is_err() {
            // Nothing is known to be durable: the ordering still has to happen next time.
            restore(m.cache(which), deps);
            restore(m.cache(other), theirs);
        }
        done
    }

    async fn write_slices(&self, m: &mut Meta, which: Which) -> Result<()> {
        for entry in m.cache(which).dirty_entries() {
            let at = self.slice_location(m, which, entry.key);
            let Some(data) = m.cache(which).peek(entry.key).map(<[u8]>::to_vec) else {
                continue;
            };
            self.guard_write(m, at, data.len() as u64, Self::own(which, entry.key))
                .await?;
            self.file
                .write_at(&data, at)
                .await
                .map_err(|e| self.st(e))?;
            m.cache(which)
                .mark_clean(entry)
                .map_err(|e| self.cache_err(e))?;
        }
        Ok(())
    }

    /// Writes back every dirty slice of `which`, after what it depends on.
    pub(crate) async fn write_back(&self, m: &mut Meta, which: Which) -> Result<()> {
        self.honour_dependencies(m, which).await?;
        self.write_slices(m, which).await
    }

    /// Records that `which` must not be written before `on` is flushed (QEMU's
    /// `qcow2_cache_set_dependency`): a dependency the other way is resolved first, by
    /// flushing, so the two never wait for each other.
    pub(crate) async fn set_dependency(&self, m: &mut Meta, which: Which, on: Which) -> Result<()> {
        if self.lazy {
            return Ok(());
        }
        if m.cache(on).dependencies().other_cache {
            self.write_back(m, which).await?;
            self.file.flush().await.map_err(|e| self.st(e))?;
            let kept = m.cache(on).take_dependencies();
            if kept.flush {
                m.cache(on).depend_on_flush();
            }
        }
        m.cache(which).depend_on_other_cache();
        Ok(())
    }

    pub(crate) async fn flush_data(&self) -> Result<()> {
        if let Some((p, s)) = &self.data_file {
            s.flush().await.map_err(|e| Error::storage(p, e))?;
        }
        self.file.flush().await.map_err(|e| self.st(e))
    }

    /// Guest flush: L2 slices, refcount blocks, then a storage flush; then queued punches.
    pub(crate) async fn flush_meta(&self, m: &mut Meta) -> Result<()> {
        self.write_back(m, Which::L2).await?;
        self.write_back(m, Which::Refcount).await?;
        self.flush_data().await?;
        let punches = std::mem::take(&mut m.pending_punch);
        let cs = self.geo.cluster_size();
        for c in punches {
            if m.overlap.find(c * cs, cs, Writing::Data).is_some() {
                // A freed cluster that is still metadata: the refcounts are wrong. Keep it.
                continue;
            }
            // Advisory: a failed punch only costs space.
            let _ = self.file.discard(c * cs, cs).await;
        }
        Ok(())
    }

    /// One pass of the cache-clean timer; returns the bytes freed.
    pub(crate) async fn clean_idle(&self, m: &mut Meta) -> Result<u64> {
        let Some(interval) = self.clean_interval else {
            return Ok(0);
        };
        self.clean_idle_with(m, interval).await
    }

    pub(crate) async fn clean_idle_with(&self, m: &mut Meta, interval: Duration) -> Result<u64> {
        let mut freed = 0;
        for which in [Which::L2, Which::Refcount] {
            let now = self.now();
            let report = m.cache(which).clean_idle(now, interval);
            freed += report.bytes_freed;
            if !report.dirty_idle.is_empty() {
                // Written back in dependency order, then dropped by a second pass (a
                // write-back is not a use).
                self.write_back(m, which).await?;
                freed += m.cache(which).clean_idle(now, interval).bytes_freed;
            }
        }
        Ok(freed)
    }

    // ----- refcounts -----

    fn refblock_of(&self, m: &Meta, cluster: u64) -> (u64, u64) {
        let e = self.rgeo.refblock_entries();
        let i = cluster / e;
        let block = m.reftable.get(i as usize).copied().unwrap_or(0);
        (block, cluster % e)
    }

    /// The refcount of host cluster `cluster` (0 where no refcount block exists).
    pub(crate) async fn refcount(&self, m: &mut Meta, cluster: u64) -> Result<u64> {
        let (block, index) = self.refblock_of(m, cluster);
        if block == 0 {
            return Ok(0);
        }
        let key = SliceKey::new(block, 0);
        self.load(m, Which::Refcount, key).await?;
        let data =
            m.rc.peek(key)
                .ok_or_else(|| Error::corrupt(&self.path, "refcount block vanished"))?;
        refcount::get(data, self.rgeo.refcount_order(), index).map_err(|e| self.fmt_err(e))
    }

    /// Adds `delta` (+1 or -1) to the refcount of `cluster`; returns the new value.
    pub(crate) async fn update_refcount(
        &self,
        m: &mut Meta,
        cluster: u64,
        delta: i64,
    ) -> Result<u64> {
        self.mark_dirty_if_lazy(m).await?;
        let (mut block, mut index) = self.refblock_of(m, cluster);
        if block == 0 {
            if delta < 0 {
                return Err(Error::corrupt(
                    &self.path,
                    format!(
                        "cluster {cluster} (offset {:#x}) is freed but has no refcount",
                        cluster * self.geo.cluster_size()
                    ),
                ));
            }
            self.ensure_refblock(m, cluster / self.rgeo.refblock_entries())
                .await?;
            (block, index) = self.refblock_of(m, cluster);
        }
        let key = SliceKey::new(block, 0);
        self.load(m, Which::Refcount, key).await?;
        let order = self.rgeo.refcount_order();
        let max = self.rgeo.max_refcount();
        let now = self.now();
        let path = &self.path;
        let data =
            m.rc.get_mut(key, now)
                .ok_or_else(|| Error::corrupt(path, "refcount block vanished"))?;
        let old = refcount::get(data, order, index).map_err(|e| Error::format(path, e))?;
        let new = if delta >= 0 {
            old.checked_add(delta as u64).filter(|&v| v <= max)
        } else {
            old.checked_sub(delta.unsigned_abs())
        };
        let Some(new) = new else {
            return Err(Error::corrupt(
                path,
                format!(
                    "refcount of cluster {cluster} (offset {:#x}) would go from {old} by {delta} \
                     (maximum {max})",
                    cluster * self.geo.cluster_size()
                ),
            ));
        };
        refcount::set(data, order, index, new).map_err(|e| Error::format(path, e))?;
        Ok(new)
    }

    /// Allocates `n` contiguous free host clusters (refcount 1 each); returns the offset.
    pub(crate) async fn alloc_clusters(&self, m: &mut Meta, n: u64) -> Result<u64> {
        // After a failed header switch memory and disk may name different tables: nothing
        // may be allocated (a request that passed its entry check before the switch failed
        // ends here).
        self.check_not_halted()?;
        let cs = self.geo.cluster_size();
        let entries = self.rgeo.refblock_entries();
        'search: loop {
            let mut start = m.free_hint;
            let mut c = start;
            // The first free cluster seen: everything below it (from the hint) is in use.
            let mut first_free = None;
            while c - start < n {
                // A cluster freed since the last flush may still be referenced by the L2
                // entry on disk: reusing it before that changes is durable would let a crash
                // show the new data through the old entry.
                if m.pending_punch.contains(&c) || self.refcount(m, c).await? != 0 {
                    start = c + 1;
                } else if first_free.is_none() {
                    first_free = Some(c);
                }
                c += 1;
            }
            if (start + n).saturating_mul(cs) > MAX_HOST_OFFSET {
                return Err(Error::corrupt(
                    &self.path,
                    "no free host cluster below 64 PiB: the image file is full",
                ));
            }
            for i in start / entries..=(start + n - 1) / entries {
                if m.reftable.get(i as usize).copied().unwrap_or(0) == 0 {
                    self.ensure_refblock(m, i).await?;
                    // The new block may sit inside the run: search again.
                    continue 'search;
                }
            }
            for k in start..start + n {
                self.update_refcount(m, k, 1).await?;
            }
            m.free_hint = match first_free {
                Some(f) if f < start => f,
                _ => start + n,
            };
            m.end_cluster = m.end_cluster.max(start + n);
            return Ok(start * cs);
        }
    }

    /// Drops one reference to each of `n` clusters from `offset`; clusters reaching zero are
    /// dropped from the caches and queued for punching.
    pub(crate) async fn free_clusters(&self, m: &mut Meta, offset: u64, n: u64) -> Result<()> {
        let cs = self.geo.cluster_size();
        let first = offset / cs;
        for c in first..first + n {
            if self.update_refcount(m, c, -1).await? == 0 {
                if m.compressed_tail.is_some_and(|t| t / cs == c) {
                    m.compressed_tail = None;
                }
                self.counters.clusters_freed.fetch_add(1, Ordering::Relaxed);
                m.free_hint = m.free_hint.min(c);
                let _ = m.l2.remove(c * cs);
                let _ = m.rc.remove(c * cs);
                m.pending_punch.insert(c);
            }
        }
        if m.pending_punch.len() > MAX_PENDING_PUNCHES {
            self.flush_meta(m).await?;
        }
        Ok(())
    }

    /// Creates refcount block `index` (self-describing, at the first cluster it covers).
    async fn ensure_refblock(&self, m: &mut Meta, index: u64) -> Result<()> {
        if index as usize >= m.reftable.len() {
            self.grow_reftable(m, index + 1).await?;
        }
        if m.reftable[index as usize] != 0 {
            return Ok(());
        }
        let cs = self.geo.cluster_size();
        let first = index * self.rgeo.refblock_entries();
        let mut block = vec![0u8; cs as usize];
        refcount::set(&mut block, self.rgeo.refcount_order(), 0, 1).map_err(|e| self.fmt_err(e))?;
        let at = first * cs;
        self.guard_write(m, at, cs, Writing::Data).await?;
        let entry_at = m.reftable_offset + index * 8;
        let own = Writing::Own(Region::RefcountTable, m.reftable_offset);
        self.guard_write(m, entry_at, 8, own).await?;
        self.file
            .write_at(&block, at)
            .await
            .map_err(|e| self.st(e))?;
        self.file.flush().await.map_err(|e| self.st(e))?;
        m.overlap.insert(Region::RefcountBlock, at, cs);
        self.file
            .write_at(&at.to_be_bytes(), entry_at)
            .await
            .map_err(|e| self.st(e))?;
        // The entry becomes durable with the next flush, which comes before any L2 entry
        // that relies on the block (the L2 cache depends on the refcount cache).
        m.reftable[index as usize] = at;
        m.end_cluster = m.end_cluster.max(first + 1);
        if first == m.free_hint {
            m.free_hint = first + 1;
        }
        Ok(())
    }

    /// Moves the refcount table to the end of the file with room for `min_entries` blocks,
    /// creating blocks that cover the new table itself.
    fn grow_reftable<'a>(&'a self, m: &'a mut Meta, min_entries: u64) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let cs = self.geo.cluster_size();
            let start = m.end_cluster.max(m.free_hint);
            // Leave room to grow: half as much again.
            let want = min_entries.max(m.reftable.len() as u64 * 3 / 2);
            let plan = plan_refcount_area(
                &m.reftable,
                start,
                start,
                want,
                cs,
                self.rgeo.refblock_entries(),
            );
            if plan.table_clusters * cs / 8 > qimg_format::validate::MAX_REFTABLE_BYTES / 8 {
                return Err(Error::corrupt(
                    &self.path,
                    "the refcount table would exceed 8 MiB: the image file is full",
                ));
            }
            let end = plan.end();
            let mut table = m.reftable.clone();
            table.resize((plan.table_clusters * cs / 8) as usize, 0);
            for (k, &j) in plan.blocks.iter().enumerate() {
                table[j as usize] = (start + k as u64) * cs;
            }
            let order = self.rgeo.refcount_order();
            let e = self.rgeo.refblock_entries();
            for (k, &j) in plan.blocks.iter().enumerate() {
                let mut block = vec![0u8; cs as usize];
                for c in (j * e).max(start)..((j + 1) * e).min(end) {
                    refcount::set(&mut block, order, c % e, 1).map_err(|e| self.fmt_err(e))?;
                }
                let at = (start + k as u64) * cs;
                self.guard_write(m, at, cs, Writing::Data).await?;
                self.file
                    .write_at(&block, at)
                    .await
                    .map_err(|e| self.st(e))?;
            }
            // New clusters under existing blocks are counted through the cache.
            for c in start..end {
                let j = c / e;
                if !plan.blocks.contains(&j) {
                    self.update_refcount(m, c, 1).await?;
                }
            }
            self.write_back(m, Which::Refcount).await?;
            let table_at = plan.table_offset(cs);
            let old_at = m.reftable_offset;
            let old_clusters = (m.reftable.len() as u64 * 8).div_ceil(cs);
            self.install_reftable(m, table, table_at, plan.table_clusters)
                .await?;
            m.end_cluster = m.end_cluster.max(end);
            if m.free_hint >= start {
                m.free_hint = end;
            }
            self.free_clusters(m, old_at, old_clusters).await
        })
    }

    /// Writes `table` at `table_at`, flushes, and switches the header to it (synchronously):
    /// the blocks it points at must already be on disk.
    pub(crate) async fn install_reftable(
        &self,
        m: &mut Meta,
        table: Vec<u64>,
        table_at: u64,
        clusters: u64,
    ) -> Result<()> {
        let bytes: Vec<u8> = table.iter().flat_map(|v| v.to_be_bytes()).collect();
        self.guard_write(m, table_at, bytes.len() as u64, Writing::Data)
            .await?;
        self.file
            .write_at(&bytes, table_at)
            .await
            .map_err(|e| self.st(e))?;
        self.file.flush().await.map_err(|e| self.st(e))?;
        let mut hdr = [0u8; 12];
        hdr[..8].copy_from_slice(&table_at.to_be_bytes());
        hdr[8..].copy_from_slice(&(clusters as u32).to_be_bytes());
        self.switch_header(&hdr, 48, || {
            format!("the switch to a new refcount table at {table_at:#x} failed")
        })
        .await?;
        m.reftable = table;
        m.reftable_offset = table_at;
        m.index_refcounts();
        Ok(())
    }

    // ----- L1 / L2 tables -----

    /// The L2 table for L1 index `l1i`, allocated (zeroed) or un-shared (copied) if needed.
    pub(crate) async fn ensure_l2(&self, m: &mut Meta, l1i: usize) -> Result<u64> {
        let entry = *m.l1.get(l1i).ok_or_else(|| {
            Error::corrupt(
                &self.path,
                format!(
                    "L1 index {l1i} is past the L1 table ({} entries)",
                    m.l1.len()
                ),
            )
        })?;
        if let (Some(off), true) = (entry.l2_offset, entry.copied) {
            return Ok(off.0);
        }
        self.mark_dirty_if_lazy(m).await?;
        let cs = self.geo.cluster_size();
        let new = self.alloc_clusters(m, 1).await?;
        let mut content = vec![0u8; cs as usize];
        if let Some(old) = entry.l2_offset {
            self.write_back(m, Which::L2).await?;
            self.file
                .read_at(&mut content, old.0)
                .await
                .map_err(|e| self.st(e))?;
        }
        self.guard_write(m, new, cs, Writing::Data).await?;
        self.file
            .write_at(&content, new)
            .await
            .map_err(|e| self.st(e))?;
        if !self.lazy {
            self.write_back(m, Which::Refcount).await?;
        }
        self.file.flush().await.map_err(|e| self.st(e))?;
        let linked = L1Entry {
            l2_offset: Some(HostOffset(new)),
            copied: true,
        };
        // On failure the entry on disk may or may not point at the new table (a torn or
        // failed write can still land): keep the table's reference so that either way the
        // image stays consistent; at worst the cluster leaks.
        self.write_l1_entry(m, l1i, linked).await?;
        m.l1[l1i] = linked;
        m.overlap.insert(Region::ActiveL2, new, cs);
        if let Some(old) = entry.l2_offset {
            m.overlap.remove(Region::ActiveL2, old.0);
            self.file.flush().await.map_err(|e| self.st(e))?;
            let _ = m.l2.remove(old.0);
            self.free_clusters(m, old.0, 1).await?;
        }
        Ok(new)
    }

    /// Writes `hdr` at header offset `at` and flushes: the switch to a new table, whose
    /// contents must already be durable. When either step fails the file may name the old or
    /// the new table, and memory keeps the old one: the image halts ([`Error::Halted`]) so
    /// that the two cannot drift apart.
    async fn switch_header(
        &self,
        hdr: &[u8],
        at: u64,
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        self.check_not_halted()?;
        let done = match self.file.write_at(hdr, at).await {
            Ok(()) => self.file.flush().await,
            Err(e) => Err(e),
        };
        done.map_err(|e| {
            let e = self.st(e);
            let _ = self.halted.set(format!("{} ({e})", what()));
            e
        })
    }

    async fn write_l1_entry(&self, m: &mut Meta, l1i: usize, entry: L1Entry) -> Result<()> {
        self.check_not_halted()?;
        let raw = entry.encode().to_be_bytes();
        let at = m.l1_offset + l1i as u64 * 8;
        let own = Writing::Own(Region::ActiveL1, m.l1_offset);
        self.guard_write(m, at, 8, own).await?;
        self.file.write_at(&raw, at).await.map_err(|e| self.st(e))
    }

    /// Replaces the L1 table with one of `entries` entries (growing only).
    pub(crate) async fn grow_l1(&self, m: &mut Meta, entries: u64) -> Result<()> {
        let cs = self.geo.cluster_size();
        if entries <= m.l1.len() as u64 {
            return Ok(());
        }
        let bytes = entries * 8;
        let clusters = bytes.div_ceil(cs);
        let at = self.alloc_clusters(m, clusters).await?;
        let mut l1 = m.l1.clone();
        l1.resize(entries as usize, L1Entry::UNALLOCATED);
        let mut raw = l1::encode_table(&l1);
        raw.resize((clusters * cs) as usize, 0);
        self.guard_write(m, at, raw.len() as u64, Writing::Data)
            .await?;
        self.file.write_at(&raw, at).await.map_err(|e| self.st(e))?;
        if !self.lazy {
            self.write_back(m, Which::Refcount).await?;
        }
        self.file.flush().await.map_err(|e| self.st(e))?;
        let mut hdr = [0u8; 12];
        hdr[..4].copy_from_slice(&(entries as u32).to_be_bytes());
        hdr[4..].copy_from_slice(&at.to_be_bytes());
        self.switch_header(&hdr, 36, || {
            format!("the switch to a new L1 table of {entries} entries at {at:#x} failed")
        })
        .await?;
        let old_at = m.l1_offset;
        let old_clusters = (m.l1.len() as u64 * 8).div_ceil(cs);
        m.l1 = l1;
        m.l1_offset = at;
        m.overlap.remove_all(Region::ActiveL1);
        m.overlap.insert(Region::ActiveL1, at, entries * 8);
        if old_clusters > 0 && old_at != 0 {
            self.free_clusters(m, old_at, old_clusters).await?;
        }
        Ok(())
    }

    // ----- header flags -----

    async fn write_incompatible(&self, m: &mut Meta, bits: u64) -> Result<()> {
        self.file
            .write_at(&bits.to_be_bytes(), 72)
            .await
            .map_err(|e| self.st(e))?;
        self.file.flush().await.map_err(|e| self.st(e))?;
        m.incompatible = bits;
        Ok(())
    }

    /// Lazy refcounts: sets the dirty bit before the first metadata change.
    pub(crate) async fn mark_dirty_if_lazy(&self, m: &mut Meta) -> Result<()> {
        if self.lazy && !m.dirty_on_disk && self.version >= 3 {
            let bits = m.incompatible | INCOMPAT_DIRTY;
            self.write_incompatible(m, bits).await?;
            m.dirty_on_disk = true;
        }
        Ok(())
    }

    /// Clears the dirty bit once refcounts on disk are accurate (after a flush).
    pub(crate) async fn mark_clean(&self, m: &mut Meta) -> Result<()> {
        if m.dirty_on_disk {
            let bits = m.incompatible & !INCOMPAT_DIRTY;
            self.write_incompatible(m, bits).await?;
            m.dirty_on_disk = false;
        }
        Ok(())
    }
}

fn restore(cache: &mut SliceCache, deps: Dependencies) {
    if deps.other_cache {
        cache.depend_on_other_cache();
    }
    if deps.flush {
        cache.depend_on_flush();
    }
}

/// Where new refcount blocks and a new refcount table go: blocks at `start..`, then the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RefcountArea {
    pub(crate) start: u64,
    /// Reftable indices of the new blocks, in placement order.
    pub(crate) blocks: Vec<u64>,
    pub(crate) table_clusters: u64,
}

impl RefcountArea {
    pub(crate) fn end(&self) -> u64 {
        self.start + self.blocks.len() as u64 + self.table_clusters
    }

    pub(crate) fn table_offset(&self, cs: u64) -> u64 {
        (self.start + self.blocks.len() as u64) * cs
    }
}

/// Lays out new refcount blocks and a table from cluster `start`: blocks for every reftable
/// index covering `cover_from..end` that `existing` lacks, and a table with at least
/// `min_entries` entries covering all of them, where `end` includes the new clusters
/// themselves. Iterates to the (monotone) fixed point.
pub(crate) fn plan_refcount_area(
    existing: &[u64],
    cover_from: u64,
    start: u64,
    min_entries: u64,
    cs: u64,
    entries: u64,
) -> RefcountArea {
    let per_table_cluster = cs / 8;
    let mut area = RefcountArea {
        start,
        blocks: Vec::new(),
        table_clusters: 1,
    };
    loop {
        let end = area.end();
        let last = (end - 1) / entries;
        let blocks: Vec<u64> = (cover_from / entries..=last)
            .filter(|&j| existing.get(j as usize).copied().unwrap_or(0) == 0)
            .collect();
        let needed = min_entries.max(last + 1).max(existing.len() as u64);
        let table_clusters = needed.div_ceil(per_table_cluster).max(1);
        if blocks == area.blocks && table_clusters == area.table_clusters {
            return area;
        }
        area.blocks = blocks;
        area.table_clusters = table_clusters;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refcount_area_covers_itself() {
        // 512-byte clusters, 64-bit refcounts: 64 entries per block, 64 per table cluster.
        let existing = vec![1024u64; 64];
        let area = plan_refcount_area(&existing, 4096, 4096, 65, 512, 64);
        let end = area.end();
        for c in 4096..end {
            let j = c / 64;
            assert!(
                area.blocks.contains(&j) || existing.get(j as usize).is_some_and(|&b| b != 0),
                "cluster {c} uncovered"
            );
        }
        assert!(area.table_clusters * 64 > (end - 1) / 64);
    }

    #[test]
    fn a_rebuild_area_covers_everything_from_zero() {
        let area = plan_refcount_area(&[], 0, 100, 1, 65536, 32768);
        assert_eq!(area.blocks, vec![0]);
        assert_eq!(area.table_clusters, 1);
        assert_eq!(area.end(), 102);
    }
}

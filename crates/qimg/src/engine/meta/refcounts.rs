//! Refcounts: reading and updating them through the refcount cache, allocating and freeing
//! host clusters, creating refcount blocks and growing the refcount table.

use qimg_io::DebugEvent;
use std::future::Future;
use std::pin::Pin;

use qimg_cache::{SliceCache, SliceKey};
use qimg_format::header;
use qimg_format::lenient::encode_words;
use qimg_format::refcount;
use std::sync::atomic::Ordering;

use qimg_io::Storage;

use super::{CacheKind, MAX_HOST_OFFSET, MAX_PENDING_PUNCHES, Meta, Need, Needs};
use crate::engine::overlap::{Region, Writing};
use crate::engine::state::Shared;
use crate::error::{Error, Result};

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Where a search for free clusters stopped for a refcount slice (see
/// [`find_free_now`](Shared::find_free_now)).
#[derive(Debug, Clone, Copy)]
pub(crate) struct FreeSearch {
    /// The hint the search started from: a search resumes only if it has not moved.
    hint: u64,
    n: u64,
    start: u64,
    c: u64,
    first_free: Option<u64>,
}

impl<S: Storage> Shared<S> {
    // ----- refcounts -----

    /// Where the refcount of host cluster `cluster` is cached: the key of its refcount slice
    /// and its index in that slice; `None` where no refcount block covers the cluster.
    /// Refcount slices are [`REFCOUNT_SLICE_SIZE`](qimg_cache::REFCOUNT_SLICE_SIZE) bytes of
    /// the block (the whole block with smaller clusters).
    fn refcount_slot(&self, m: &Meta, cluster: u64) -> Option<(SliceKey, u64)> {
        let e = self.rgeo.refblock_entries();
        let block = m.reftable.get((cluster / e) as usize).copied().unwrap_or(0);
        if block == 0 {
            return None;
        }
        // At least 512 B slices of at most 64-bit refcounts: never zero.
        let per_slice = (m.rc.slice_size() as u64 * 8) >> self.rgeo.refcount_order();
        let index = cluster % e;
        // At most 2 MiB / 512 B slices per block: fits.
        let slice = (index / per_slice) as u32;
        Some((SliceKey::new(block, slice), index % per_slice))
    }

    /// The refcount of host cluster `cluster` (0 where no refcount block exists).
    pub(crate) async fn refcount(&self, m: &mut Meta, cluster: u64) -> Result<u64> {
        let Some((key, index)) = self.refcount_slot(m, cluster) else {
            return Ok(0);
        };
        self.load(m, CacheKind::Refcount, key).await?;
        let data =
            m.rc.peek(key)
                .ok_or_else(|| Error::corrupt(&self.path, "refcount slice vanished"))?;
        refcount::get(data, self.rgeo.refcount_order(), index).map_err(|e| self.fmt_err(e))
    }

    /// Adds `delta` (+1 or -1) to the refcount of `cluster`; returns the new value.
    pub(crate) async fn update_refcount(
        &self,
        m: &mut Meta,
        cluster: u64,
        delta: i64,
    ) -> Result<u64> {
        // What the change needs, made ready with I/O in the order it uses it (the dirty bit,
        // a new refcount block, the slice: a counted lookup), then the change itself.
        self.mark_dirty_if_lazy(m).await?;
        if self.refcount_slot(m, cluster).is_none() && delta >= 0 {
            let index = cluster / self.rgeo.refblock_entries();
            self.ensure_refblock(m, index, index * self.rgeo.refblock_entries())
                .await?;
        }
        if let Some((key, _)) = self.refcount_slot(m, cluster) {
            self.load(m, CacheKind::Refcount, key).await?;
        }
        self.until_done(m, |m| self.update_refcount_now(m, cluster, delta))
            .await?
    }

    /// The one body of a refcount change ([`update_refcount`](Self::update_refcount), and
    /// the queues' allocation and give-back in the caller's thread): adds `delta` to the
    /// refcount of `cluster` in its cached slice and returns the new value, or (nothing
    /// changed) names what it needs first: the dirty bit of lazy refcounts, a refcount block
    /// for the cluster, its slice in the cache. The inner result refuses a refcount that
    /// would overflow or go below zero, or a cluster freed without one.
    pub(crate) fn update_refcount_now(
        &self,
        m: &mut Meta,
        cluster: u64,
        delta: i64,
    ) -> Needs<Result<u64>> {
        if self.needs_dirty_bit(m) {
            return Err(Need::DirtyBit);
        }
        let path = &self.path;
        let Some((key, index)) = self.refcount_slot(m, cluster) else {
            if delta < 0 {
                return Ok(Err(Error::corrupt(
                    path,
                    format!(
                        "cluster {cluster} (offset {:#x}) is freed but has no refcount",
                        cluster * self.geo.cluster_size()
                    ),
                )));
            }
            let index = cluster / self.rgeo.refblock_entries();
            let at = index * self.rgeo.refblock_entries();
            return Err(Need::Refblock { index, at });
        };
        let order = self.rgeo.refcount_order();
        let max = self.rgeo.max_refcount();
        let now = self.now();
        let data = m.rc.peek(key).ok_or(Need::RefcountSlice(key))?;
        let old = match refcount::get(data, order, index) {
            Ok(v) => v,
            Err(e) => return Ok(Err(Error::format(path, e))),
        };
        let new = if delta >= 0 {
            old.checked_add(delta as u64).filter(|&v| v <= max)
        } else {
            old.checked_sub(delta.unsigned_abs())
        };
        let Some(new) = new else {
            return Ok(Err(Error::corrupt(
                path,
                format!(
                    "refcount of cluster {cluster} (offset {:#x}) would go from {old} by {delta} \
                     (maximum {max})",
                    cluster * self.geo.cluster_size()
                ),
            )));
        };
        match set_cached(&mut m.rc, key, order, index, new, now) {
            Some(Ok(())) => Ok(Ok(new)),
            Some(Err(e)) => Ok(Err(Error::format(path, e))),
            None => Err(Need::RefcountSlice(key)),
        }
    }

    /// Allocates `n` contiguous free host clusters (refcount 1 each); returns the offset.
    /// The search is [`find_free_now`](Self::find_free_now), its needs resolved with I/O.
    pub(crate) async fn alloc_clusters(&self, m: &mut Meta, n: u64) -> Result<u64> {
        self.file.debug_event(DebugEvent::ClusterAlloc);
        let mut resume = None;
        let start = loop {
            // Each need resolved is progress (a slice loaded, the search going on after it; a
            // block or table created; the frees flushed): no round bound.
            match self.find_free_now(m, n, u64::MAX, &mut resume) {
                Ok(found) => break found?,
                Err(need) => self.resolve(m, need).await?,
            }
        };
        for k in start..start + n {
            self.update_refcount(m, k, 1).await?;
        }
        self.claimed(m, start, n);
        Ok(start * self.geo.cluster_size())
    }

    /// The one search for free host clusters, without I/O: the first run of `n` free clusters
    /// from the hint (the cluster, not yet claimed), or what the search needs first: the dirty
    /// bit, a refcount slice, a refcount block for the run, a larger refcount table, a flush
    /// (to reuse clusters freed since the last one rather than grow the file), or
    /// [`Need::Far`] when the run starts `window` clusters or more past the hint. Found, the
    /// hint moves past the clusters in use before the run (the only change). Clusters freed since the last
    /// flush count as in use: the L2 entry on disk may still name them, and reusing one before
    /// that changes is durable would let a crash show new data through the old entry.
    ///
    /// A search that needs a refcount slice leaves where it stopped in `resume`, and goes on
    /// from there when called again with it (nothing else changed): the slices it searched
    /// before may have left the cache to make room.
    pub(crate) fn find_free_now(
        &self,
        m: &mut Meta,
        n: u64,
        window: u64,
        resume: &mut Option<FreeSearch>,
    ) -> Needs<Result<u64>> {
        let resumed = resume.take();
        // After a failed header switch memory and disk may name different tables: nothing
        // may be allocated (a request that passed its entry check before the switch failed
        // ends here).
        if let Err(e) = self.check_not_halted() {
            return Ok(Err(e));
        }
        if self.needs_dirty_bit(m) {
            return Err(Need::DirtyBit);
        }
        if n == 0 {
            return Ok(Ok(m.free_hint));
        }
        let cs = self.geo.cluster_size();
        let entries = self.rgeo.refblock_entries();
        let order = self.rgeo.refcount_order();
        let hint = m.free_hint;
        // The first free cluster seen: everything below it (from the hint) is in use.
        let (mut start, mut c, mut first_free) = match resumed {
            Some(r) if r.hint == hint && r.n == n => (r.start, r.c, r.first_free),
            _ => (hint, hint, None),
        };
        while c - start < n {
            if c - hint >= window {
                return Err(Need::Far);
            }
            let used = m.pending_punch.contains(&c)
                || match self.refcount_slot(m, c) {
                    // No block: refcount 0 (the block is created below).
                    None => false,
                    Some((key, index)) => {
                        let Some(data) = m.rc.peek(key) else {
                            *resume = Some(FreeSearch {
                                hint,
                                n,
                                start,
                                c,
                                first_free,
                            });
                            return Err(Need::RefcountSlice(key));
                        };
                        match refcount::get(data, order, index) {
                            Ok(r) => r != 0,
                            Err(e) => return Ok(Err(self.fmt_err(e))),
                        }
                    }
                };
            if used {
                start = c + 1;
            } else if first_free.is_none() {
                first_free = Some(c);
            }
            c += 1;
        }
        if (start + n).saturating_mul(cs) > MAX_HOST_OFFSET {
            return Ok(Err(Error::corrupt(
                &self.path,
                "no free host cluster below 64 PiB: the image file is full",
            )));
        }
        // Growing the file while clusters freed since the last flush wait below its end:
        // make those frees durable (a flush) so that they can be reused instead.
        if start + n > m.end_cluster && m.pending_punch.first().is_some_and(|&p| p < m.end_cluster)
        {
            return Err(Need::Flush);
        }
        let missing = |i: u64| m.reftable.get(i as usize).copied().unwrap_or(0) == 0;
        if let Some(i) = (start / entries..=(start + n - 1) / entries).find(|&i| missing(i)) {
            // A missing block goes to the first cluster of the run (the block covering that
            // cluster first, which then covers itself), and the search starts again after
            // it: each round takes one cluster, so a run of any length ends up after the
            // blocks it needs (placing each block at the start of its own range instead would
            // split every run longer than one block's range).
            let last = (start + n - 1) / entries;
            if last as usize >= m.reftable.len() {
                // A larger table first (it moves to the end of the file, with blocks that
                // cover itself); the run is searched again around it.
                return Err(Need::Reftable(last + 1));
            }
            let own = start / entries;
            let index = if missing(own) { own } else { i };
            return Err(Need::Refblock { index, at: start });
        }
        // Only now: a flush (above) makes clusters kept back below `start` free again.
        m.free_hint = first_free.unwrap_or(start);
        Ok(Ok(start))
    }

    /// Notes `n` clusters from `start` (found by [`find_free_now`](Self::find_free_now)) as
    /// taken, their refcounts set: the hint moves past them if they were the first free ones.
    fn claimed(&self, m: &mut Meta, start: u64, n: u64) {
        if m.free_hint == start {
            m.free_hint = start + n;
        }
        m.end_cluster = m.end_cluster.max(start + n);
    }

    /// `n` single clusters without I/O, for the queues' direct path (the caller's thread):
    /// each found by [`find_free_now`](Self::find_free_now) within a short window of the
    /// hint and counted by [`update_refcount_now`](Self::update_refcount_now). `None`, with
    /// nothing changed, when that needs I/O, or a cluster found is not accepted by `accept`
    /// (given its host offset) or lies on metadata (damaged refcounts, which the engine
    /// reports).
    pub(crate) fn alloc_near_now(
        &self,
        m: &mut Meta,
        n: usize,
        accept: impl Fn(u64) -> bool,
    ) -> Option<Vec<u64>> {
        /// How far past the hint the search looks before leaving it to the engine.
        const WINDOW: u64 = 64;
        let cs = self.geo.cluster_size();
        let mut found = Vec::with_capacity(n);
        while found.len() < n {
            let taken = match self.find_free_now(m, 1, WINDOW, &mut None) {
                Ok(Ok(c)) if accept(c * cs) && !m.data_overlaps_metadata(c * cs, cs) => {
                    // The search saw its slice and the dirty bit is set: cannot need I/O.
                    matches!(self.update_refcount_now(m, c, 1), Ok(Ok(1))).then_some(c)
                }
                _ => None,
            };
            let Some(c) = taken else {
                for &host in &found {
                    self.give_back_now(m, host);
                }
                return None;
            };
            self.claimed(m, c, 1);
            found.push(c * cs);
        }
        Some(found)
    }

    /// Gives back, without I/O, a cluster allocated and never linked (its refcount is 1):
    /// `false` (nothing changed) when its refcount slice left the cache or its refcount is
    /// not 1 (the caller then frees it with [`free_clusters`](Self::free_clusters)). The
    /// refcount change is [`release_now`](Self::release_now), as every free's.
    pub(crate) fn give_back_now(&self, m: &mut Meta, host: u64) -> bool {
        let c = host / self.geo.cluster_size();
        let one = self.refcount_slot(m, c).is_some_and(|(key, index)| {
            m.rc.peek(key)
                .and_then(|data| refcount::get(data, self.rgeo.refcount_order(), index).ok())
                == Some(1)
        });
        one && matches!(self.release_now(m, c), Ok(Ok(0)))
    }

    /// The one body of dropping a reference to host cluster `cluster` without I/O: its
    /// refcount minus one (see [`update_refcount_now`](Self::update_refcount_now)), and a
    /// cluster reaching zero may be found again from the hint. Returns the new refcount.
    pub(crate) fn release_now(&self, m: &mut Meta, cluster: u64) -> Needs<Result<u64>> {
        let left = self.update_refcount_now(m, cluster, -1)?;
        if let Ok(0) = left {
            m.free_hint = m.free_hint.min(cluster);
        }
        Ok(left)
    }

    /// Frees the clusters of write leases dropped without commit or abort (see
    /// [`Shared::abandoned`]): they were never linked, so this is always safe.
    pub(crate) async fn free_abandoned(&self, m: &mut Meta) -> Result<()> {
        let hosts = std::mem::take(&mut *self.abandoned.lock().unwrap_or_else(|e| e.into_inner()));
        for host in hosts {
            self.free_clusters(m, host, 1).await?;
        }
        Ok(())
    }

    /// Drops one reference to each of `n` clusters from `offset`; clusters reaching zero are
    /// dropped from the caches and queued for punching.
    pub(crate) async fn free_clusters(&self, m: &mut Meta, offset: u64, n: u64) -> Result<()> {
        self.free_clusters_as(m, offset, n, true).await
    }

    /// [`free_clusters`](Self::free_clusters), punching the clusters that reach zero only
    /// when `punch`: QEMU passes a discard down for data, snapshot and bitmap clusters, and
    /// keeps the bytes of the metadata it moves (an old L1 table, a bitmap directory: its
    /// `discard-other` is off), so `disk size` counts them as QEMU's does.
    pub(crate) async fn free_clusters_as(
        &self,
        m: &mut Meta,
        offset: u64,
        n: u64,
        punch: bool,
    ) -> Result<()> {
        let cs = self.geo.cluster_size();
        let first = offset / cs;
        for c in first..first + n {
            self.mark_dirty_if_lazy(m).await?;
            if let Some((key, _)) = self.refcount_slot(m, c) {
                self.load(m, CacheKind::Refcount, key).await?;
            }
            if self.until_done(m, |m| self.release_now(m, c)).await?? == 0 {
                if m.compressed_tail.is_some_and(|t| t / cs == c) {
                    m.compressed_tail = None;
                }
                self.counters.clusters_freed.fetch_add(1, Ordering::Relaxed);
                let _ = m.l2.remove(c * cs);
                let _ = m.rc.remove(c * cs);
                if punch {
                    m.pending_punch.insert(c);
                }
            }
        }
        if m.pending_punch.len() > MAX_PENDING_PUNCHES {
            self.flush_meta(m).await?;
        }
        Ok(())
    }

    /// After a shrink, as QEMU's `qcow2_shrink_reftable` and the truncation after it: every
    /// refcount block that counts nothing but itself leaves the refcount table, and the file
    /// is cut after its last cluster in use. Everything is flushed first, so no cluster past
    /// the cut is still referenced on disk.
    pub(crate) async fn trim_file(&self, m: &mut Meta) -> Result<()> {
        self.flush_meta(m).await?;
        let cs = self.geo.cluster_size();
        let entries = self.rgeo.refblock_entries();
        for i in 0..m.reftable.len() {
            let block = m.reftable[i];
            if block == 0 {
                continue;
            }
            let own = block / cs;
            let covered = i as u64 * entries..(i as u64 + 1) * entries;
            let mut used = false;
            for c in covered.clone() {
                let r = self.refcount(m, c).await?;
                if r != 0 && !(c == own && r == 1) {
                    used = true;
                    break;
                }
            }
            if used {
                continue;
            }
            let entry_at = refcount::table_entry_offset(m.reftable_offset, i as u64);
            let table = Writing::Own(Region::RefcountTable, m.reftable_offset);
            self.guard_write(m, entry_at, refcount::REFTABLE_ENTRY_SIZE as u64, table)
                .await?;
            self.file
                .write_at(&encode_words(&[0]), entry_at)
                .await
                .map_err(|e| self.storage_error(e))?;
            self.file.flush().await.map_err(|e| self.storage_error(e))?;
            m.reftable[i] = 0;
            let _ = m.rc.remove(block);
            m.overlap.remove_one(Region::RefcountBlock, block);
            if covered.contains(&own) {
                // Its own refcount went with it.
                m.pending_punch.insert(own);
                m.free_hint = m.free_hint.min(own);
            } else {
                self.free_clusters(m, block, 1).await?;
            }
        }
        self.flush_meta(m).await?;
        // The last cluster in use; blocks that are not there count nothing.
        let file_len = self.file.len().await.map_err(|e| self.storage_error(e))?;
        let mut c = file_len.div_ceil(cs);
        let mut end = 0;
        while c > 0 {
            c -= 1;
            if m.reftable.get((c / entries) as usize).copied().unwrap_or(0) == 0 {
                c -= c % entries;
                continue;
            }
            if self.refcount(m, c).await? != 0 {
                end = c + 1;
                break;
            }
        }
        // QEMU's `qcow2_co_truncate` sets the file's length to the end of that cluster,
        // which lengthens a file whose last table was written short (a grown L1 table).
        if end * cs != file_len {
            self.file
                .set_len(end * cs)
                .await
                .map_err(|e| self.storage_error(e))?;
            m.end_cluster = end;
            m.free_hint = m.free_hint.min(end);
            m.pending_punch.retain(|&p| p < end);
        }
        Ok(())
    }

    /// Creates refcount block `index` (if missing) at host cluster `place`, which must be
    /// free: either in the block's own range (the block then counts itself) or in the range
    /// of an existing block (whose count for it is written back before the new block is
    /// linked, so that no crash leaves a linked block with refcount 0).
    pub(super) async fn ensure_refblock(&self, m: &mut Meta, index: u64, place: u64) -> Result<()> {
        if index as usize >= m.reftable.len() {
            self.grow_reftable(m, index + 1).await?;
        }
        if m.reftable[index as usize] != 0 {
            return Ok(());
        }
        let cs = self.geo.cluster_size();
        let entries = self.rgeo.refblock_entries();
        // Where the table grew, `place` may now hold it: the search must start again.
        if self.refcount(m, place).await? != 0 {
            return Ok(());
        }
        self.file.debug_event(DebugEvent::RefblockAlloc);
        let covers_itself = place / entries == index;
        let mut block = self.io_buf(cs as usize)?;
        if covers_itself {
            refcount::set(&mut block, self.rgeo.refcount_order(), place % entries, 1)
                .map_err(|e| self.fmt_err(e))?;
        }
        let at = place * cs;
        self.guard_write(m, at, cs, Writing::Data).await?;
        let entry_at = refcount::table_entry_offset(m.reftable_offset, index);
        let own = Writing::Own(Region::RefcountTable, m.reftable_offset);
        self.guard_write(m, entry_at, refcount::REFTABLE_ENTRY_SIZE as u64, own)
            .await?;
        if !covers_itself {
            // Boxed: counting never creates a block here (the covering one exists).
            Box::pin(self.update_refcount(m, place, 1)).await?;
            self.write_back(m, CacheKind::Refcount).await?;
        }
        self.file.debug_event(DebugEvent::RefblockAllocWrite);
        self.file
            .write_at(&block, at)
            .await
            .map_err(|e| self.storage_error(e))?;
        self.file.flush().await.map_err(|e| self.storage_error(e))?;
        m.overlap.insert(Region::RefcountBlock, at, cs);
        self.file.debug_event(DebugEvent::RefblockAllocHookup);
        self.file
            .write_at(&encode_words(&[at]), entry_at)
            .await
            .map_err(|e| self.storage_error(e))?;
        // The entry becomes durable with the next flush, which comes before any L2 entry
        // that relies on the block (the L2 cache depends on the refcount cache).
        m.reftable[index as usize] = at;
        m.end_cluster = m.end_cluster.max(place + 1);
        if place == m.free_hint {
            m.free_hint = place + 1;
        }
        Ok(())
    }

    /// Moves the refcount table to the end of the file with room for `min_entries` blocks,
    /// creating blocks that cover the new table itself.
    pub(super) fn grow_reftable<'a>(
        &'a self,
        m: &'a mut Meta,
        min_entries: u64,
    ) -> BoxFuture<'a, Result<()>> {
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
            self.file.debug_event(DebugEvent::RefblockAllocWriteBlocks);
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
                    .map_err(|e| self.storage_error(e))?;
            }
            // New clusters under existing blocks are counted through the cache.
            for c in start..end {
                let j = c / e;
                if !plan.blocks.contains(&j) {
                    self.update_refcount(m, c, 1).await?;
                }
            }
            self.write_back(m, CacheKind::Refcount).await?;
            let table_at = plan.table_offset(cs);
            let old_at = m.reftable_offset;
            let old_clusters = refcount::table_bytes(m.reftable.len() as u64).div_ceil(cs);
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
        let bytes = encode_words(&table);
        self.write_guarded(m, table_at, &bytes, Writing::Data)
            .await?;
        self.file.flush().await.map_err(|e| self.storage_error(e))?;
        let pointer = header::encode_refcount_table_pointer(table_at, clusters as u32);
        self.switch_header(&pointer, header::field::REFCOUNT_TABLE, || {
            format!("the switch to a new refcount table at {table_at:#x} failed")
        })
        .await?;
        m.reftable = table;
        m.reftable_offset = table_at;
        m.index_refcounts();
        Ok(())
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

    pub(crate) fn table_offset(&self, cluster_size: u64) -> u64 {
        (self.start + self.blocks.len() as u64) * cluster_size
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
    cluster_size: u64,
    entries: u64,
) -> RefcountArea {
    let per_table_cluster = cluster_size / 8;
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

/// Sets refcount `index` (`2^order`-bit entries) of the cached refcount slice `key` to
/// `value`, marking only the entry's bytes dirty, so that writing the slice back writes one
/// 4 KiB block. `None` when the slice is not cached.
fn set_cached(
    rc: &mut SliceCache,
    key: SliceKey,
    order: u32,
    index: u64,
    value: u64,
    now: std::time::Duration,
) -> Option<std::result::Result<(), qimg_format::FormatError>> {
    let entry = rc.get_mut_range(key, refcount::entry_bytes(order, index), now)?;
    Some(refcount::set_in_entry_bytes(entry, order, index, value))
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

//! Refcounts: reading and updating them through the refcount cache, creating refcount
//! blocks, growing the refcount table, trimming the file after a shrink (allocating and
//! freeing host clusters is `alloc`).

use qimg_io::DebugEvent;
use std::future::Future;
use std::pin::Pin;

use qimg_cache::{SliceCache, SliceKey};
use qimg_format::header;
use qimg_format::lenient::encode_words;
use qimg_format::refcount;

use qimg_io::Storage;

use super::{CacheKind, Meta, Need, Needs};
use crate::engine::overlap::{Region, Writing};
use crate::engine::state::Shared;
use crate::error::{Error, Result};

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

impl<S: Storage> Shared<S> {
    // ----- refcounts -----

    /// Where the refcount of host cluster `cluster` is cached: the key of its refcount slice
    /// and its index in that slice; `None` where no refcount block covers the cluster.
    /// Refcount slices are [`REFCOUNT_SLICE_SIZE`](qimg_cache::REFCOUNT_SLICE_SIZE) bytes of
    /// the block (the whole block with smaller clusters).
    pub(super) fn refcount_slot(&self, m: &Meta, cluster: u64) -> Option<(SliceKey, u64)> {
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
        self.ready_refcount_change(m, cluster, delta).await?;
        self.until_done(m, |m| self.update_refcount_now(m, cluster, delta))
            .await?
    }

    /// What a change of `delta` to the refcount of `cluster` needs, made ready with I/O in
    /// the order the change uses it (the dirty bit, a new refcount block, the slice: a
    /// counted lookup), before its body runs ([`update_refcount`](Self::update_refcount),
    /// `free_clusters_as`).
    pub(super) async fn ready_refcount_change(
        &self,
        m: &mut Meta,
        cluster: u64,
        delta: i64,
    ) -> Result<()> {
        self.mark_dirty_if_lazy(m).await?;
        if self.refcount_slot(m, cluster).is_none() && delta >= 0 {
            let index = cluster / self.rgeo.refblock_entries();
            self.ensure_refblock(m, index, index * self.rgeo.refblock_entries())
                .await?;
        }
        if let Some((key, _)) = self.refcount_slot(m, cluster) {
            self.load(m, CacheKind::Refcount, key).await?;
        }
        Ok(())
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
            self.flush_file().await?;
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
        let file_len = self.file_len().await?;
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
        self.flush_file().await?;
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
            let start = m.end_cluster.max(m.free_hint);
            // Leave room to grow: half as much again.
            let want = min_entries.max(m.reftable.len() as u64 * 3 / 2);
            self.refcount_area(m, start, want, 0).await.map(drop)
        })
    }

    /// QEMU's `qcow2_refcount_area`: from cluster `start` (past every cluster in use), new
    /// refcount blocks for every reftable index up to the one covering cluster `cover_end`
    /// (or the area itself) that has none, then a new refcount table of at least
    /// `min_entries` entries naming them; the header switches to it and the old table is
    /// freed. Returns the cluster after the area.
    pub(crate) async fn refcount_area(
        &self,
        m: &mut Meta,
        start: u64,
        min_entries: u64,
        cover_end: u64,
    ) -> Result<u64> {
        let cs = self.geo.cluster_size();
        let plan = plan_refcount_area(
            &m.reftable,
            start,
            start,
            min_entries,
            cover_end,
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
        // The area is in use before the switch: a switch that fails after its write was
        // issued may leave the header naming the new table (the image halts), and the file
        // must not be cut short of it at close.
        m.end_cluster = m.end_cluster.max(end);
        self.install_reftable(m, table, table_at, plan.table_clusters)
            .await?;
        if m.free_hint >= start {
            m.free_hint = end;
        }
        // Nothing names the old table once the switch is durable: its clusters may be
        // reused at once, and keep their bytes (QEMU frees it with `discard-other`, off).
        self.free_clusters_as(m, old_at, old_clusters, false)
            .await?;
        Ok(end)
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
        self.flush_file().await?;
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
/// index covering `cover_from..max(end, cover_end)` that `existing` lacks, and a table with
/// at least `min_entries` entries covering all of them, where `end` includes the new
/// clusters themselves. Iterates to the (monotone) fixed point.
pub(crate) fn plan_refcount_area(
    existing: &[u64],
    cover_from: u64,
    start: u64,
    min_entries: u64,
    cover_end: u64,
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
        let end = area.end().max(cover_end);
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
        let area = plan_refcount_area(&existing, 4096, 4096, 65, 0, 512, 64);
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
        let area = plan_refcount_area(&[], 0, 100, 1, 0, 65536, 32768);
        assert_eq!(area.blocks, vec![0]);
        assert_eq!(area.table_clusters, 1);
        assert_eq!(area.end(), 102);
    }
}

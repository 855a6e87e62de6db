//! L1 and L2 tables: creating an L2 table (or un-sharing one a snapshot shares), writing L1
//! entries, growing the L1 table, switching the header to a new table, and the header's
//! dirty and corrupt flags.

use qimg_format::features::INCOMPAT_DIRTY;
use qimg_format::header;
use qimg_format::l1::{self, L1Entry};
use qimg_format::units::HostOffset;
use qimg_io::DebugEvent;
use qimg_io::Storage;

use super::{CacheKind, Meta};
use crate::engine::overlap::{Region, Writing};
use crate::engine::state::Shared;
use crate::error::{Error, Result};

impl<S: Storage> Shared<S> {
    // ----- L1 / L2 tables -----

    /// The L2 table for L1 index `l1i`, allocated (zeroed) or un-shared (copied) if needed;
    /// `true` with it when the table was just created and holds only zeros.
    pub(crate) async fn ensure_l2(&self, m: &mut Meta, l1i: usize) -> Result<(u64, bool)> {
        let entry = *m.l1.get(l1i).ok_or_else(|| {
            Error::corrupt(
                &self.path,
                format!(
                    "L1 index {l1i} is past the L1 table ({} entries)",
                    m.l1.len()
                ),
            )
        })?;
        if let Some(what) = entry.l2_offset.and_then(|t| self.unaligned_l2(m, t.0)) {
            return Err(self.signal_corruption(m, what).await);
        }
        if let (Some(off), true) = (entry.l2_offset, entry.copied) {
            return Ok((off.0, false));
        }
        self.mark_dirty_if_lazy(m).await?;
        let cs = self.geo.cluster_size();
        let new = self.alloc_clusters(m, 1).await?;
        self.guard_write(m, new, cs, Writing::Data).await?;
        if let Err(e) = self.fill_new_l2(m, new, entry.l2_offset).await {
            // Nothing names the new table yet: give its cluster back (as QEMU's
            // `l2_allocate` does) instead of leaking it.
            let _ = self.free_clusters(m, new, 1).await;
            return Err(e);
        }
        let linked = L1Entry {
            l2_offset: Some(HostOffset(new)),
            copied: true,
        };
        // On failure the entry on disk may or may not point at the new table (a torn or
        // failed write can still land): keep the table's reference so that either way the
        // image stays consistent; at worst the cluster leaks.
        self.write_l1_entry(m, l1i, linked, Some(DebugEvent::L1Update))
            .await?;
        m.overlap.insert_counted(Region::ActiveL2, new, cs);
        if let Some(old) = entry.l2_offset {
            m.overlap.remove_one(Region::ActiveL2, old.0);
            self.flush_file().await?;
            let _ = m.l2.remove(old.0);
            self.free_clusters(m, old.0, 1).await?;
        }
        Ok((new, entry.l2_offset.is_none()))
    }

    /// Writes the new L2 table at `new` (a copy of the table at `old`, or zeros) and makes it
    /// and its refcount durable, before the L1 table names it.
    async fn fill_new_l2(&self, m: &mut Meta, new: u64, old: Option<HostOffset>) -> Result<()> {
        let cs = self.geo.cluster_size();
        if let Some(old) = old {
            let mut content = self.io_buf(cs as usize)?;
            self.write_back(m, CacheKind::L2).await?;
            self.file.debug_event(DebugEvent::L2AllocCowRead);
            self.file
                .read_at(&mut content, old.0)
                .await
                .map_err(|e| self.storage_error(e))?;
            self.file.debug_event(DebugEvent::L2AllocWrite);
            // QEMU writes the new table through its L2 cache: a write-back event.
            self.file.debug_event(DebugEvent::L2Update);
            self.file
                .write_at(&content, new)
                .await
                .map_err(|e| self.storage_error(e))?;
        } else {
            // A table of zeros: `fallocate(FALLOC_FL_ZERO_RANGE)` where the file takes it
            // (a 2 MiB table costs an extent change, not a 2 MiB write), zero bytes otherwise.
            // With sparse allocation (QEMU's layout) the zeros are written, as QEMU writes a
            // new table, so the file's extents are QEMU's.
            self.file.debug_event(DebugEvent::L2AllocWrite);
            self.file.debug_event(DebugEvent::L2Update);
            let zeroed = if self.allocation == crate::Allocation::Sparse {
                let zeros = self.io_buf(cs as usize)?;
                self.file.write_at(&zeros, new).await
            } else {
                self.file.write_zeroes(new, cs).await.map(|_| ())
            };
            zeroed.map_err(|e| self.storage_error(e))?;
        }
        // The new table's refcount durable before anything names it, with lazy refcounts
        // too (QEMU's `l2_allocate` flushes the refcount cache here either way): only data
        // clusters' refcounts are left to the rebuild after a crash.
        self.write_back(m, CacheKind::Refcount).await?;
        self.flush_file().await?;
        Ok(())
    }

    /// Writes `hdr` at header offset `at` and flushes: the switch to a new table, whose
    /// contents must already be durable. When either step fails the file may name the old or
    /// the new table, and memory keeps the old one: the image halts ([`Error::Halted`]) so
    /// that the two cannot drift apart.
    pub(crate) async fn switch_header(
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
            let e = self.storage_error(e);
            let _ = self.halted.set(format!("{} ({e})", what()));
            e
        })
    }

    /// Changes entry `l1i` of the active L1 table on disk (not flushed; `event` for blkdebug
    /// before the write) and then in memory: a failed write leaves memory as it was.
    pub(crate) async fn write_l1_entry(
        &self,
        m: &mut Meta,
        l1i: usize,
        entry: L1Entry,
        event: Option<DebugEvent>,
    ) -> Result<()> {
        self.check_not_halted()?;
        let raw = l1::encode_table(&[entry]);
        let at = l1::table_entry_offset(m.l1_offset, l1i as u64);
        let own = Writing::Own(Region::ActiveL1, m.l1_offset);
        self.guard_write(m, at, raw.len() as u64, own).await?;
        if let Some(event) = event {
            self.file.debug_event(event);
        }
        self.file
            .write_at(&raw, at)
            .await
            .map_err(|e| self.storage_error(e))?;
        m.set_l1_entry(l1i, entry);
        Ok(())
    }

    /// Replaces the L1 table with one of `entries` entries (growing only).
    pub(crate) async fn grow_l1(&self, m: &mut Meta, entries: u64) -> Result<()> {
        let cs = self.geo.cluster_size();
        if entries <= m.l1.len() as u64 {
            return Ok(());
        }
        let bytes = l1::table_bytes(entries);
        let clusters = bytes.div_ceil(cs);
        let at = self.alloc_clusters(m, clusters).await?;
        let mut l1 = m.l1.clone();
        l1.resize(entries as usize, L1Entry::UNALLOCATED);
        // Exactly the table's bytes, as QEMU's `qcow2_grow_l1_table` writes it.
        let raw = l1::encode_table(&l1);
        self.write_guarded(m, at, &raw, Writing::Data).await?;
        // As for a new L2 table (QEMU's `qcow2_grow_l1_table` flushes the refcount cache
        // here, lazy refcounts or not).
        self.write_back(m, CacheKind::Refcount).await?;
        self.flush_file().await?;
        let pointer = header::encode_l1_table_pointer(entries as u32, at);
        self.switch_header(&pointer, header::field::L1_TABLE, || {
            format!("the switch to a new L1 table of {entries} entries at {at:#x} failed")
        })
        .await?;
        let old_at = m.l1_offset;
        let old_clusters = l1::table_bytes(m.l1.len() as u64).div_ceil(cs);
        m.replace_l1(l1, at);
        m.overlap.remove_all(Region::ActiveL1);
        m.overlap
            .insert(Region::ActiveL1, at, l1::table_bytes(entries));
        if old_clusters > 0 && old_at != 0 {
            self.free_clusters_as(m, old_at, old_clusters, false)
                .await?;
        }
        Ok(())
    }

    // ----- header flags -----

    pub(super) async fn write_incompatible(&self, m: &mut Meta, bits: u64) -> Result<()> {
        self.file
            .write_at(
                &header::encode_incompatible(bits),
                header::field::INCOMPATIBLE_FEATURES,
            )
            .await
            .map_err(|e| self.storage_error(e))?;
        self.flush_file().await?;
        m.incompatible = bits;
        Ok(())
    }

    /// Lazy refcounts: sets the dirty bit before the first metadata change.
    pub(crate) async fn mark_dirty_if_lazy(&self, m: &mut Meta) -> Result<()> {
        if self.needs_dirty_bit(m) {
            let bits = m.incompatible | INCOMPAT_DIRTY;
            self.write_incompatible(m, bits).await?;
            m.dirty_on_disk = true;
        }
        Ok(())
    }

    /// Whether a refcount change must first set the dirty bit on disk (lazy refcounts, not
    /// yet marked).
    pub(crate) fn needs_dirty_bit(&self, m: &Meta) -> bool {
        self.lazy && !m.dirty_on_disk && self.version >= 3
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

impl<S: Storage> Shared<S> {
    /// QEMU's `make_completely_empty` (what `qemu-img commit` does to the top image when it
    /// can): the image becomes the header, a one-cluster refcount table at cluster 1, its one
    /// refcount block at cluster 2 and an all-zero L1 table from cluster 3, and the file ends
    /// there. Only where QEMU does it: version 3 (the dirty bit covers the moment the
    /// refcounts are wrong: a crash leaves an image whose next open rebuilds them), no
    /// snapshots, no persistent bitmaps, no external data file, and the L1 table and three
    /// clusters counted by one refcount block. `false` (nothing done) otherwise.
    pub(crate) async fn empty_completely(&self, m: &mut Meta) -> Result<bool> {
        self.refuse_unaligned_l2(m).await?;
        let cs = self.geo.cluster_size();
        let l1_bytes = l1::table_bytes(m.l1.len() as u64);
        let l1_clusters = l1_bytes.div_ceil(cs);
        let (directory, tables) = self.bitmaps.layout();
        if self.version < 3
            || m.snapshots.1 != 0
            || directory.is_some()
            || !tables.is_empty()
            || self.data_file.is_some()
            || 3 + l1_clusters > self.rgeo.refblock_entries()
        {
            return Ok(false);
        }
        self.check_not_halted()?;
        self.flush_meta(m).await?;
        let io = |e| self.storage_error(e);
        // Refcounts will be wrong until the end: the dirty bit first.
        self.write_incompatible(m, m.incompatible | INCOMPAT_DIRTY)
            .await?;
        m.dirty_on_disk = true;
        self.file.debug_event(DebugEvent::L1Update);
        self.file
            .write_zeroes(m.l1_offset, l1_clusters * cs)
            .await
            .map_err(io)?;
        self.file
            .write_zeroes(cs, (2 + l1_clusters) * cs)
            .await
            .map_err(io)?;
        self.file.debug_event(DebugEvent::L1Update);
        self.file.debug_event(DebugEvent::ReftableUpdate);
        let mut pointers = header::encode_l1_table_pointer(m.l1.len() as u32, 3 * cs).to_vec();
        pointers.extend(header::encode_refcount_table_pointer(cs, 1));
        self.file
            .write_at(&pointers, header::field::L1_TABLE)
            .await
            .map_err(io)?;
        self.file.flush().await.map_err(io)?;
        self.file.debug_event(DebugEvent::RefblockAlloc);
        let first = qimg_format::refcount::RefcountTableEntry {
            block_offset: Some(HostOffset(2 * cs)),
        };
        self.file
            .write_at(&qimg_format::refcount::encode_table(&[first]), cs)
            .await
            .map_err(io)?;
        self.file.flush().await.map_err(io)?;

        // The tables in memory as on disk now: the old ones' slices leave the caches (their
        // dirty slices were written back above), and every unlocked load is stale.
        for table in m.l1.iter().filter_map(|e| e.l2_offset) {
            let _ = m.l2.remove(table.0);
        }
        for &block in m.reftable.iter().filter(|&&b| b != 0) {
            let _ = m.rc.remove(block);
        }
        let entries = m.l1.len();
        m.replace_l1(vec![L1Entry::UNALLOCATED; entries], 3 * cs);
        m.reftable = vec![0; (cs / qimg_format::refcount::REFTABLE_ENTRY_SIZE as u64) as usize];
        m.reftable[0] = 2 * cs;
        m.reftable_offset = cs;
        m.overlap = crate::engine::overlap::OverlapIndex::new(cs);
        m.overlap.insert(Region::Header, 0, cs);
        m.overlap.insert(Region::RefcountTable, cs, cs);
        m.overlap.insert(Region::RefcountBlock, 2 * cs, cs);
        m.overlap.insert(Region::ActiveL1, 3 * cs, l1_bytes);
        m.pending_punch.clear();
        m.compressed_tail = None;
        m.free_hint = 0;
        m.end_cluster = 3 + l1_clusters;
        for c in 0..3 + l1_clusters {
            self.update_refcount(m, c, 1).await?;
        }
        self.flush_meta(m).await?;
        self.mark_clean(m).await?;
        self.file
            .set_len((3 + l1_clusters) * cs)
            .await
            .map_err(io)?;
        Ok(true)
    }
}

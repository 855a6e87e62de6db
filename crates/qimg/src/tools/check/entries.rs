//! Rewriting single table entries during a repair: only inside tables used as nothing but
//! tables (found by the silent walk), never over other metadata (the overlap check), and made
//! durable with one sync per table walk.

use qimg_format::lenient::{RawL1Entry, RawL2Entry, TABLE_WORD};
use qimg_io::Storage;

use super::checker::{Checker, ZeroingOutcome};
use super::{Counters, Failure, io_failure, strerror};
use crate::engine::overlap::Region;

impl<S: Storage> Checker<'_, S> {
    /// Makes the entry repairs of a table walk durable with one sync, before anything that
    /// depends on them (the refcount repairs) is written.
    pub(super) async fn sync_entries(
        &mut self,
        res: &mut Counters,
    ) -> std::result::Result<(), Failure> {
        if !std::mem::take(&mut self.unsynced) {
            return Ok(());
        }
        self.sync().await.map_err(|e| {
            self.msg(format!(
                "ERROR: Could not sync repaired entries: {}",
                strerror(&e)
            ));
            res.check_errors += 1;
            io_failure(&e)
        })
    }

    pub(super) fn note_table(&mut self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        for c in offset / self.cluster_size..=(offset + len - 1) / self.cluster_size {
            *self.table_uses.entry(c).or_insert(0) += 1;
        }
    }

    /// Counts the clusters a compressed cluster's data `[offset, offset + len)` touches.
    pub(super) fn note_compressed(&mut self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        for c in offset / self.cluster_size..=(offset + len - 1) / self.cluster_size {
            *self.compressed_uses.entry(c).or_insert(0) += 1;
        }
    }

    /// Whether the table entry at `at` may be rewritten by the repairing walk: its cluster is
    /// used only as a table.
    pub(super) fn may_edit(&self, at: u64) -> bool {
        self.mute
            || self
                .exclusive
                .as_ref()
                .is_some_and(|s| s.contains(&(at / self.cluster_size)))
    }

    /// After a whole walk: whether the table in `[offset, offset + len)` is referenced as
    /// nothing else.
    pub(super) fn only_table(&self, offset: u64, len: u64) -> bool {
        self.table_uses_are(offset, len, false)
    }

    /// After a whole walk: whether the COPIED repair may rewrite the table in `[offset,
    /// offset + len)`: referenced as nothing but tables and compressed data (whose size field
    /// may claim more than the stream takes), as QEMU's `check_oflag_copied` rewrites it; never
    /// a table that is also guest data or other metadata.
    pub(super) fn copied_may_rewrite(&self, offset: u64, len: u64) -> bool {
        self.table_uses_are(offset, len, true)
    }

    /// After a whole walk: whether every cluster of `[offset, offset + len)` is referenced
    /// once (by the structure that lies there, and nothing else).
    pub(super) fn referenced_once(&self, offset: u64, len: u64) -> bool {
        len > 0
            && (offset / self.cluster_size..=(offset + len - 1) / self.cluster_size)
                .all(|c| self.refs.get(c) == 1)
    }

    fn table_uses_are(&self, offset: u64, len: u64, with_compressed: bool) -> bool {
        let uses = |c: u64| {
            let t = self.table_uses.get(&c).copied().unwrap_or(0);
            let z = match with_compressed {
                true => self.compressed_uses.get(&c).copied().unwrap_or(0),
                false => 0,
            };
            t + z
        };
        len > 0
            && (offset / self.cluster_size..=(offset + len - 1) / self.cluster_size)
                .all(|c| uses(c) == self.refs.get(c))
    }

    /// Writes an L1 entry (a repair beyond QEMU's); false when refused or failed.
    pub(super) async fn write_l1_entry(
        &mut self,
        at: u64,
        value: RawL1Entry,
        ignore: Region,
        active_index: Option<usize>,
    ) -> bool {
        if !self.may_edit(at) || self.overlaps(ignore, at, TABLE_WORD).is_some() {
            return false;
        }
        if self.write(&value.encode(), at).await.is_err() {
            return false;
        }
        self.unsynced |= !self.mute;
        if let Some(i) = active_index {
            self.set_l1_entry(i, value);
        }
        true
    }

    /// Writes one L2 entry (both words with extended L2); false when refused or failed.
    pub(super) async fn write_l2_entry(
        &mut self,
        at: u64,
        entry: u64,
        bitmap: u64,
        active: bool,
    ) -> bool {
        let ignore = if active {
            Region::ActiveL2
        } else {
            Region::SnapshotL2
        };
        let entry_size = self.layout.entry_size();
        if !self.may_edit(at) || self.overlaps(ignore, at, entry_size).is_some() {
            return false;
        }
        self.write_l2_entry_unchecked(at, entry, bitmap).await
    }

    pub(super) async fn write_l2_entry_unchecked(
        &mut self,
        at: u64,
        entry: u64,
        bitmap: u64,
    ) -> bool {
        let b = self.layout.encode(RawL2Entry {
            word: entry,
            bitmap,
        });
        let written = self.write(&b, at).await.is_ok();
        self.unsynced |= written && !self.mute;
        written
    }

    /// QEMU's `fix_l2_entry_by_zero`: the entry reads as zeros and owns no cluster.
    pub(super) async fn zero_entry(
        &mut self,
        at: u64,
        bitmap: u64,
        active: bool,
    ) -> ZeroingOutcome {
        let zero = self.layout.zero_entry(bitmap);
        let ignore = if active {
            Region::ActiveL2
        } else {
            Region::SnapshotL2
        };
        if !self.may_edit(at) {
            return ZeroingOutcome::Shared;
        }
        if self
            .overlaps(ignore, at, self.layout.entry_size())
            .is_some()
        {
            return ZeroingOutcome::Overlap;
        }
        if self
            .write_l2_entry_unchecked(at, zero.word, zero.bitmap)
            .await
        {
            ZeroingOutcome::Done
        } else {
            ZeroingOutcome::Failed
        }
    }
}

//! The overlap check of repair writes (QEMU's `qcow2_check_metadata_overlap`, "cached"
//! template), on the engine's [`OverlapIndex`] built from the tables the check loaded.

use qimg_format::lenient::{RawL1Entry, TABLE_WORD};
use qimg_io::Storage;

use super::checker::Checker;
use crate::engine::overlap::{OverlapIndex, Region};

/// QEMU's overlap check order ("cached" template: every kind but snapshots' L2 tables).
const OVERLAP_ORDER: [Region; 7] = [
    Region::ActiveL1,
    Region::RefcountTable,
    Region::SnapshotTable,
    Region::SnapshotL1,
    Region::ActiveL2,
    Region::RefcountBlock,
    Region::BitmapDirectory,
];

impl<S: Storage> Checker<'_, S> {
    /// The index of every metadata place a repair write must not touch, built on first use.
    pub(super) fn index(&mut self) -> &OverlapIndex {
        let cluster_size = self.cluster_size;
        if self.index.is_none() {
            let mut ix = OverlapIndex::new(cluster_size);
            if self.l1_size > 0 {
                let len = u64::from(self.l1_size) * TABLE_WORD;
                ix.insert_counted(Region::ActiveL1, self.l1_offset, len);
            }
            let reftable_len = self.reftable.len() as u64 * TABLE_WORD;
            ix.insert_counted(Region::RefcountTable, self.reftable_offset, reftable_len);
            ix.insert_counted(
                Region::SnapshotTable,
                self.snapshots_offset,
                self.snapshots_size,
            );
            for s in self.snapshots.iter().filter(|s| s.l1_size > 0) {
                let len = u64::from(s.l1_size) * TABLE_WORD;
                ix.insert_counted(Region::SnapshotL1, s.l1_offset, len);
            }
            for (_, e) in &self.l1 {
                if e.l2_offset() != 0 {
                    ix.insert_counted(Region::ActiveL2, e.l2_offset(), cluster_size);
                }
            }
            for e in &self.reftable {
                // An unaligned offset cannot be a refcount block (QEMU refuses to read it).
                let o = e.block_offset();
                if o != 0 && o % cluster_size == 0 {
                    ix.insert_counted(Region::RefcountBlock, o, cluster_size);
                }
            }
            if let Some(b) = self.bitmaps {
                ix.insert_counted(Region::BitmapDirectory, b.offset, b.size);
            }
            self.index = Some(ix);
        }
        self.index
            .get_or_insert_with(|| OverlapIndex::new(cluster_size))
    }

    /// Replaces entry `i` of the in-memory active L1 table, keeping the overlap index current.
    pub(super) fn set_l1_entry(&mut self, i: usize, value: RawL1Entry) {
        let Some(slot) = self.l1.get_mut(i) else {
            return;
        };
        let old = std::mem::replace(&mut slot.1, value);
        if let Some(ix) = &mut self.index {
            if old.l2_offset() != 0 {
                ix.remove_one(Region::ActiveL2, old.l2_offset());
            }
            if value.l2_offset() != 0 {
                ix.insert_counted(Region::ActiveL2, value.l2_offset(), self.cluster_size);
            }
        }
    }

    pub(super) fn overlap_name(&mut self, at: u64, len: u64, active: bool) -> &'static str {
        let ignore = if active {
            Region::ActiveL2
        } else {
            Region::SnapshotL2
        };
        self.overlaps(ignore, at, len).unwrap_or("metadata")
    }

    /// QEMU's `qcow2_check_metadata_overlap` with the default "cached" checks (every kind
    /// but snapshots' L2 tables), ignoring `ignore`; names the first kind hit. The range is
    /// widened to whole clusters, as QEMU does.
    pub(super) fn overlaps(
        &mut self,
        ignore: Region,
        offset: u64,
        size: u64,
    ) -> Option<&'static str> {
        if size == 0 {
            return None;
        }
        let cluster_size = self.cluster_size;
        if offset < cluster_size {
            return Some(Region::Header.qemu_name());
        }
        let start = offset / cluster_size * cluster_size;
        let end = (offset % cluster_size + size)
            .next_multiple_of(cluster_size)
            .saturating_add(start);
        self.index()
            .first_of(&OVERLAP_ORDER, ignore, start, end - start)
            .map(Region::qemu_name)
    }
}

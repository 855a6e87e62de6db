//! The L1 and L2 walks of a pass (QEMU's `check_refcounts_l1` and `check_refcounts_l2`):
//! every entry counted as a reference and judged, and with `-r all` repaired where that is
//! safe (see the module docs of `check`).

use qimg_format::lenient::{ClusterKind, RawL1Entry, RawL2Entry, TABLE_WORD};
use qimg_io::Storage;

use super::checker::{Checker, ZeroingOutcome};
use super::{Counters, EIO, Failure, RepairScope, io_failure};
use crate::engine::overlap::Region;

/// Of a compressed L2 entry: where its data lies and how many bytes it takes.
fn compressed_range(entry: u64, cluster_bits: u32) -> (u64, u64) {
    RawL2Entry {
        word: entry,
        bitmap: 0,
    }
    .compressed_range(cluster_bits)
}

impl<S: Storage> Checker<'_, S> {
    pub(super) async fn check_refcounts_l1(
        &mut self,
        res: &mut Counters,
        l1_offset: u64,
        l1_size: u32,
        frag: bool,
        fix: RepairScope,
        active: bool,
    ) -> std::result::Result<(), Failure> {
        if l1_size == 0 {
            return Ok(());
        }
        let bytes = u64::from(l1_size) * TABLE_WORD;
        if self.inc_refcounts(res, l1_offset, bytes) {
            self.note_table(l1_offset, bytes);
        }
        let table = match self.read_l1(l1_offset, l1_size).await {
            Ok(t) => t,
            Err(e) => {
                self.msg("ERROR: I/O error in check_refcounts_l1".into());
                res.check_errors += 1;
                return Err(io_failure(&e));
            }
        };
        let total = table.len() as u64;
        let ignore = if active {
            Region::ActiveL1
        } else {
            Region::SnapshotL1
        };
        for (i, &(at, raw)) in table.iter().enumerate() {
            if active && i % 64 == 0 {
                self.progress(i as u64, total);
            }
            let mut e = raw;
            if e.is_empty() {
                continue;
            }
            if e.reserved_bits() != 0 {
                let fixed = e.without_reserved_bits();
                if fix.corruptions
                    && self
                        .write_l1_entry(at, fixed, ignore, active.then_some(i))
                        .await
                {
                    self.msg(format!(
                        "Repairing L1 entry with reserved bits set: {:x}",
                        e.0
                    ));
                    res.corruptions_fixed += 1;
                    e = fixed;
                    if e.is_empty() {
                        continue;
                    }
                } else {
                    self.msg(format!(
                        "ERROR found L1 entry with reserved bits set: {:x}",
                        e.0
                    ));
                    res.corruptions += 1;
                }
            }
            let l2_offset = e.l2_offset();
            if fix.corruptions {
                let why = if l2_offset == 0 {
                    Some("COPIED flag without an L2 table")
                } else if l2_offset % self.cluster_size != 0 {
                    Some("Table is not cluster aligned")
                } else if self.past_eof(l2_offset, self.cluster_size) {
                    Some("Table lies past the end of the file")
                } else {
                    None
                };
                if let Some(why) = why {
                    let empty = RawL1Entry::default();
                    if self
                        .write_l1_entry(at, empty, ignore, active.then_some(i))
                        .await
                    {
                        self.msg(format!(
                            "Repairing l2_offset={l2_offset:x}: {why}; L1 entry corrupted"
                        ));
                        res.corruptions_fixed += 1;
                        continue;
                    }
                }
            }
            if self.inc_refcounts(res, l2_offset, self.cluster_size) {
                self.note_table(l2_offset, self.cluster_size);
            }
            if l2_offset % self.cluster_size != 0 {
                self.msg(format!(
                    "ERROR l2_offset={l2_offset:x}: Table is not cluster aligned; L1 entry corrupted"
                ));
                res.corruptions += 1;
            }
            self.check_refcounts_l2(res, l2_offset, frag, fix, active)
                .await?;
        }
        if active {
            self.progress(total, total);
        }
        self.sync_entries(res).await
    }

    #[allow(clippy::too_many_lines)]
    pub(super) async fn check_refcounts_l2(
        &mut self,
        res: &mut Counters,
        l2_offset: u64,
        frag: bool,
        fix: RepairScope,
        active: bool,
    ) -> std::result::Result<(), Failure> {
        let table = match self.read_l2(l2_offset).await {
            Ok(t) => t,
            Err(e) => {
                self.msg("ERROR: I/O error in check_refcounts_l2".into());
                res.check_errors += 1;
                return Err(io_failure(&e));
            }
        };
        let mut next_contiguous = 0u64;
        let cluster_size = self.cluster_size;
        let cluster_bits = self.cluster_bits;
        for (i, (at, raw)) in table.entries().enumerate() {
            if raw == RawL2Entry::default() {
                // Unallocated, nothing set: nothing to count or judge.
                continue;
            }
            let mut entry = raw.word;
            let mut bitmap = raw.bitmap;
            let ty = raw.kind(self.layout);
            if ty != ClusterKind::Compressed && raw.reserved_bits() != 0 {
                let cleared = raw.without_reserved_bits().word;
                if fix.corruptions && self.write_l2_entry(at, cleared, bitmap, active).await {
                    self.msg(format!(
                        "Repairing l2 entry with reserved bits set: {entry:x}"
                    ));
                    res.corruptions_fixed += 1;
                    entry = cleared;
                } else {
                    self.msg(format!(
                        "ERROR found l2 entry with reserved bits set: {entry:x}"
                    ));
                    res.corruptions += 1;
                }
            }
            match ty {
                ClusterKind::Compressed => {
                    if raw.copied() {
                        let (coff, _) = raw.compressed_range(cluster_bits);
                        let cleared = raw.with_copied(false).word;
                        if fix.corruptions && self.write_l2_entry(at, cleared, bitmap, active).await
                        {
                            self.msg(format!(
                                "Repairing coffset={coff:#x}: copied flag must never be set for \
                                 compressed clusters"
                            ));
                            res.corruptions_fixed += 1;
                        } else {
                            self.msg(format!(
                                "ERROR: coffset={coff:#x}: copied flag must never be set for \
                                 compressed clusters"
                            ));
                            res.corruptions += 1;
                        }
                        entry = cleared;
                    }
                    if self.data_file {
                        if fix.corruptions {
                            if let ZeroingOutcome::Done = self.zero_entry(at, 0, active).await {
                                self.msg(format!(
                                    "Repairing compressed cluster {i} with data file, entry={entry:#x}"
                                ));
                                res.corruptions_fixed += 1;
                                continue;
                            }
                        }
                        self.msg(format!(
                            "ERROR compressed cluster {i} with data file, entry={entry:#x}"
                        ));
                        res.corruptions += 1;
                        continue;
                    }
                    if bitmap != 0 {
                        if fix.corruptions && self.write_l2_entry(at, entry, 0, active).await {
                            self.msg(format!(
                                "Repairing compressed cluster {i} with non-zero subcluster \
                                 allocation bitmap, entry={entry:#x}"
                            ));
                            res.corruptions_fixed += 1;
                        } else {
                            self.msg(format!(
                                "ERROR compressed cluster {i} with non-zero subcluster \
                                 allocation bitmap, entry={entry:#x}"
                            ));
                            res.corruptions += 1;
                            // QEMU does not count the compressed data then, which makes it a
                            // leak that a repair would free although reads ignore the bitmap:
                            // when repairing, count its references (not its statistics).
                            if fix.any() {
                                let (coffset, csize) = compressed_range(entry, cluster_bits);
                                self.inc_refcounts(res, coffset, csize);
                                self.note_compressed(coffset, csize);
                            }
                            continue;
                        }
                    }
                    let (coffset, csize) = compressed_range(entry, cluster_bits);
                    if fix.corruptions && self.past_eof(coffset, csize) {
                        if let ZeroingOutcome::Done = self.zero_entry(at, 0, active).await {
                            self.msg(format!(
                                "Repairing compressed cluster {i}: data at offset {coffset:#x} \
                                 size {csize:#x} lies past the end of the file; the entry now \
                                 reads as zeros"
                            ));
                            res.corruptions_fixed += 1;
                            continue;
                        }
                    }
                    self.inc_refcounts(res, coffset, csize);
                    self.note_compressed(coffset, csize);
                    if frag {
                        res.allocated_clusters += 1;
                        res.compressed_clusters += 1;
                        res.fragmented_clusters += 1;
                    }
                }
                ClusterKind::ZeroAlloc | ClusterKind::Normal => {
                    let offset = raw.host_offset();
                    let conflict = raw.alloc_zero_conflict();
                    if conflict != 0 {
                        let repaired = bitmap & !conflict;
                        if fix.corruptions && self.write_l2_entry(at, entry, repaired, active).await
                        {
                            self.msg(format!(
                                "Repairing offset={offset:x}: Allocated cluster has corrupted \
                                 subcluster allocation bitmap"
                            ));
                            res.corruptions_fixed += 1;
                            bitmap = repaired;
                        } else {
                            res.corruptions += 1;
                            self.msg(format!(
                                "ERROR offset={offset:x}: Allocated cluster has corrupted \
                                 subcluster allocation bitmap"
                            ));
                        }
                    }
                    if offset % cluster_size != 0 {
                        res.corruptions += 1;
                        let now = RawL2Entry {
                            word: entry,
                            bitmap,
                        };
                        let contains_data = if self.layout.extended {
                            now.any_subcluster_allocated()
                        } else {
                            !now.zero_flag()
                        };
                        if !contains_data {
                            self.msg(format!(
                                "{} offset={offset:x}: Preallocated cluster is not properly \
                                 aligned; L2 entry corrupted.",
                                if fix.corruptions {
                                    "Repairing"
                                } else {
                                    "ERROR"
                                }
                            ));
                            if fix.corruptions {
                                match self.zero_entry(at, bitmap, active).await {
                                    ZeroingOutcome::Done => {
                                        res.corruptions -= 1;
                                        res.corruptions_fixed += 1;
                                        continue;
                                    }
                                    ZeroingOutcome::Overlap => {
                                        self.msg("ERROR: Overlap check failed".into());
                                        res.check_errors += 1;
                                        let entry_size = self.layout.entry_size();
                                        let what = self.overlap_name(at, entry_size, active);
                                        self.signal_corruption(
                                            true,
                                            format!(
                                                "Preventing invalid write on metadata (overlaps \
                                                 with {what})"
                                            ),
                                        )
                                        .await;
                                        return Err(Failure(EIO.into()));
                                    }
                                    ZeroingOutcome::Failed => {
                                        self.msg(
                                            "ERROR: Failed to overwrite L2 table entry".into(),
                                        );
                                        res.check_errors += 1;
                                    }
                                    ZeroingOutcome::Shared => {
                                        self.msg(format!(
                                            "ERROR: not repaired: the L2 table at {:#x} is also                                              used as something else",
                                            l2_offset
                                        ));
                                    }
                                }
                            }
                        } else if fix.corruptions
                            && matches!(
                                self.zero_entry(at, bitmap, active).await,
                                ZeroingOutcome::Done
                            )
                        {
                            // Beyond QEMU: QEMU cannot read such a cluster at all.
                            self.msg(format!(
                                "Repairing offset={offset:x}: Data cluster is not properly \
                                 aligned; L2 entry corrupted (it now reads as zeros)."
                            ));
                            res.corruptions -= 1;
                            res.corruptions_fixed += 1;
                            continue;
                        } else {
                            self.msg(format!(
                                "ERROR offset={offset:x}: Data cluster is not properly \
                                 aligned; L2 entry corrupted."
                            ));
                        }
                    }
                    if fix.corruptions && !self.data_file && self.past_eof(offset, cluster_size) {
                        if let ZeroingOutcome::Done = self.zero_entry(at, bitmap, active).await {
                            self.msg(format!(
                                "Repairing offset={offset:x}: Data cluster lies past the end of \
                                 the file; L2 entry corrupted (it now reads as zeros)."
                            ));
                            res.corruptions_fixed += 1;
                            continue;
                        }
                    }
                    if frag {
                        res.allocated_clusters += 1;
                        if next_contiguous != 0 && offset != next_contiguous {
                            res.fragmented_clusters += 1;
                        }
                        next_contiguous = offset + cluster_size;
                    }
                    if !self.data_file {
                        self.inc_refcounts(res, offset, cluster_size);
                    }
                }
                ClusterKind::ZeroPlain => {}
                ClusterKind::Unallocated => {
                    if raw.any_subcluster_allocated() {
                        if fix.corruptions
                            && matches!(
                                self.zero_entry(at, bitmap, active).await,
                                ZeroingOutcome::Done
                            )
                        {
                            self.msg(
                                "Repairing: Unallocated cluster has non-zero subcluster \
                                 allocation map (its allocated subclusters now read as zeros)"
                                    .into(),
                            );
                            res.corruptions_fixed += 1;
                        } else {
                            res.corruptions += 1;
                            self.msg(
                                "ERROR: Unallocated cluster has non-zero subcluster allocation map"
                                    .into(),
                            );
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

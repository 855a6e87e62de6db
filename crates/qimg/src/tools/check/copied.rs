//! The COPIED flags of the active tables (QEMU's `check_oflag_copied`): an L1 or L2 entry
//! carries COPIED exactly when its cluster's refcount is 1.

use std::collections::HashSet;

use qimg_format::lenient::TABLE_WORD;
use qimg_io::Storage;

use super::checker::Checker;
use super::{Counters, EIO, Failure, RepairScope, io_failure, strerror};
use crate::engine::overlap::Region;

impl<S: Storage> Checker<'_, S> {
    /// After a whole walk: the clusters that entries of active tables shared with something
    /// else name (the COPIED repair leaves such tables alone, see `check_oflag_copied`).
    /// Empty, and nothing read, when no table is shared.
    pub(super) async fn behind_shared_tables(&mut self) -> HashSet<u64> {
        let mut out = HashSet::new();
        if self
            .table_uses
            .iter()
            .all(|(&c, &uses)| uses == self.refs.get(c))
        {
            return out;
        }
        let cluster_size = self.cluster_size;
        let l1_shared = !self.only_table(self.l1_offset, u64::from(self.l1_size) * TABLE_WORD);
        let mut seen = HashSet::new();
        for i in 0..self.l1.len() {
            let l2_offset = self.l1[i].1.l2_offset();
            if l2_offset == 0 {
                continue;
            }
            if l1_shared {
                out.insert(l2_offset >> self.cluster_bits);
            }
            if (l2_offset % cluster_size == 0 && self.copied_may_rewrite(l2_offset, cluster_size))
                || !seen.insert(l2_offset)
            {
                continue;
            }
            let Ok(table) = self.read_l2(l2_offset).await else {
                continue;
            };
            for (_, entry) in table.entries() {
                if entry.kind(self.layout).has_host_cluster() {
                    out.insert(entry.host_offset() >> self.cluster_bits);
                }
            }
        }
        out
    }

    /// `check_oflag_copied`.
    pub(super) async fn check_oflag_copied(
        &mut self,
        res: &mut Counters,
        fix: RepairScope,
    ) -> std::result::Result<(), Failure> {
        let repair = if fix.corruptions {
            true
        } else if fix.leaks {
            res.check_errors == 0 && res.corruptions == 0 && res.leaks == 0
        } else {
            false
        };
        let cluster_size = self.cluster_size;
        for i in 0..self.l1.len() {
            let (at, l1_entry) = self.l1[i];
            let l2_offset = l1_entry.l2_offset();
            if l2_offset == 0 {
                continue;
            }
            let Ok(refcount) = self.get_refcount(l2_offset >> self.cluster_bits).await else {
                continue;
            };
            if (refcount == 1) != l1_entry.copied() {
                res.corruptions += 1;
                // Never rewrite a table that is also something else (guest data, metadata).
                let l1_len = u64::from(self.l1_size) * TABLE_WORD;
                let repair = repair && self.only_table(self.l1_offset, l1_len);
                self.msg(format!(
                    "{} OFLAG_COPIED L2 cluster: l1_index={i} l1_entry={:x} refcount={refcount}",
                    if repair { "Repairing" } else { "ERROR" },
                    l1_entry.0
                ));
                if repair {
                    let new = l1_entry.with_copied(refcount == 1);
                    self.set_l1_entry(i, new);
                    if let Err(e) = self.write(&new.encode(), at).await {
                        res.check_errors += 1;
                        return Err(io_failure(&e));
                    }
                    res.corruptions -= 1;
                    res.corruptions_fixed += 1;
                }
            }
            let mut table: Vec<_> = match self.read_l2(l2_offset).await {
                Ok(t) => t.entries().collect(),
                Err(e) => {
                    self.msg(format!("ERROR: Could not read L2 table: {}", strerror(&e)));
                    res.check_errors += 1;
                    return Err(io_failure(&e));
                }
            };
            let mut dirty = 0i64;
            let repair = repair
                && l2_offset % cluster_size == 0
                && self.copied_may_rewrite(l2_offset, cluster_size);
            for (_, slot) in table.iter_mut() {
                let entry = *slot;
                if !entry.kind(self.layout).has_host_cluster() {
                    continue;
                }
                let refcount = if self.data_file {
                    1
                } else {
                    match self
                        .get_refcount(entry.host_offset() >> self.cluster_bits)
                        .await
                    {
                        Ok(r) => r,
                        Err(_) => continue,
                    }
                };
                if (refcount == 1) != entry.copied() {
                    res.corruptions += 1;
                    self.msg(format!(
                        "{} OFLAG_COPIED data cluster: l2_entry={:x} refcount={refcount}",
                        if repair { "Repairing" } else { "ERROR" },
                        entry.word
                    ));
                    if repair {
                        *slot = entry.with_copied(refcount == 1);
                        dirty += 1;
                    }
                }
            }
            if dirty > 0 {
                if let Some(what) = self.overlaps(Region::ActiveL2, l2_offset, cluster_size) {
                    self.msg(format!(
                        "ERROR: Could not write L2 table; metadata overlap check failed: {EIO}"
                    ));
                    res.check_errors += 1;
                    self.signal_corruption(
                        true,
                        format!("Preventing invalid write on metadata (overlaps with {what})"),
                    )
                    .await;
                    return Err(Failure(EIO.into()));
                }
                let layout = self.layout;
                let bytes: Vec<u8> = table.iter().flat_map(|&(_, e)| layout.encode(e)).collect();
                if let Err(e) = self.write(&bytes, l2_offset).await {
                    self.msg(format!("ERROR: Could not write L2 table: {}", strerror(&e)));
                    res.check_errors += 1;
                    return Err(io_failure(&e));
                }
                res.corruptions -= dirty;
                res.corruptions_fixed += dirty;
            }
        }
        Ok(())
    }
}

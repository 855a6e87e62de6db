//! Comparing the computed references with the refcounts on disk (QEMU's
//! `compare_refcounts`), and the refcount repairs of `-r leaks` and `-r all`.

use qimg_format::refcount;
use qimg_io::Storage;

use super::checker::{Checker, c_hex};
use super::{Counters, EIO, RepairScope, strerror};
use crate::engine::overlap::Region;

impl<S: Storage> Checker<'_, S> {
    /// `compare_refcounts`, one refcount block's range at a time.
    pub(super) async fn compare_refcounts(
        &mut self,
        res: &mut Counters,
        fix: RepairScope,
        rebuild: &mut bool,
        highest: &mut u64,
    ) {
        *highest = 0;
        let e = self.entries;
        let nb = self.refs.size;
        for j in 0..nb.div_ceil(e) {
            let lo = j * e;
            let hi = ((j + 1) * e).min(nb);
            let entry = self.reftable.get(j as usize).copied().unwrap_or_default();
            let block = entry.block_offset();
            if block == 0 {
                for (a, b) in self.refs.windows(lo, hi) {
                    for (c, r2) in self.refs.nonzero_in(a, b) {
                        *highest = c;
                        self.mismatch(res, fix, rebuild, c, 0, r2, None).await;
                    }
                }
                continue;
            }
            let data = if block % self.cluster_size != 0 {
                self.signal_corruption(
                    true,
                    format!(
                        "Refblock offset {block:#x} unaligned (reftable index: {})",
                        c_hex(j)
                    ),
                )
                .await;
                Err(EIO.to_string())
            } else {
                self.read_refblock(block).await.map_err(|e| strerror(&e))
            };
            let mut data = match data {
                Ok(d) => d,
                Err(why) => {
                    for c in lo..hi {
                        self.msg(format!("Can't get refcount for cluster {c}: {why}"));
                        res.check_errors += 1;
                    }
                    continue;
                }
            };
            for c in lo..hi {
                let r1 = refcount::get(&data, self.order, c - lo).unwrap_or(0);
                let r2 = self.refs.get(c);
                if r1 > 0 || r2 > 0 {
                    *highest = c;
                }
                if r1 != r2 {
                    self.mismatch(res, fix, rebuild, c, r1, r2, Some((block, &mut data)))
                        .await;
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) async fn mismatch(
        &mut self,
        res: &mut Counters,
        fix: RepairScope,
        rebuild: &mut bool,
        c: u64,
        r1: u64,
        r2: u64,
        block: Option<(u64, &mut Vec<u8>)>,
    ) {
        let fixing = if r1 == 0 {
            *rebuild = true;
            false
        } else if r2 > 0 && (r1 == 1) != (r2 == 1) && self.keep_copied.contains(&c) {
            // Whether the cluster's entries must carry COPIED would change, and an entry
            // naming it lies in a table shared with something else, which the COPIED repair
            // will not rewrite: the fix would trade this error for more of them.
            false
        } else {
            (r1 > r2 && fix.leaks) || (r1 < r2 && fix.corruptions)
        };
        self.msg(format!(
            "{} cluster {c} refcount={r1} reference={r2}",
            if fixing {
                "Repairing"
            } else if r1 < r2 {
                "ERROR"
            } else {
                "Leaked"
            }
        ));
        if fixing {
            if let Some((at, data)) = block {
                if self.update_refcount(at, data, c, r2).await {
                    if r1 > r2 {
                        res.leaks_fixed += 1;
                    } else {
                        res.corruptions_fixed += 1;
                    }
                    return;
                }
            }
        }
        if r1 < r2 {
            res.corruptions += 1;
        } else {
            res.leaks += 1;
        }
    }

    /// Sets the refcount of cluster `c` in the refcount block at `at` (held in `data`).
    pub(super) async fn update_refcount(
        &mut self,
        at: u64,
        data: &mut [u8],
        c: u64,
        value: u64,
    ) -> bool {
        let index = c % self.entries;
        if refcount::set(data, self.order, index, value).is_err() {
            return false;
        }
        let bytes = refcount::entry_bytes(self.order, index);
        let Some(changed) = data.get(bytes.clone()) else {
            return false;
        };
        if self.write(changed, at + bytes.start as u64).await.is_err() {
            return false;
        }
        self.cache.remove(&at);
        if value == 0 {
            // QCOW2_DISCARD_ALWAYS: a freed cluster is punched out of the file, unless known
            // metadata lies there. A cluster found leaked may still hold a table the walk
            // could not count (the part inside the file of an L1 table running past its end:
            // a fuzz finding); QEMU punches it and loses those entries.
            let (offset, cluster_size) = (c * self.cluster_size, self.cluster_size);
            if self
                .overlaps(Region::SnapshotL2, offset, cluster_size)
                .is_none()
            {
                self.punch(offset, cluster_size).await;
            }
        }
        true
    }

    /// Deallocates a freed cluster (for files: a punched hole, the size kept).
    pub(super) async fn punch(&self, offset: u64, len: u64) {
        // Advisory: a failed punch only costs space.
        let _ = self.file.discard(offset, len).await;
    }
}

//! One pass of the check (QEMU's `qcow2_co_check_locked` and `qcow2_check_refcounts`): the
//! snapshot table, then every reference counted over the whole image (through the L1/L2
//! walks, the snapshot, refcount and bitmap structures), compared with the refcounts on disk,
//! a rebuild of the refcount structure where needed, and the COPIED flags.

use qimg_format::bitmap::{
    BitmapEntry, BitmapsExtension, TableEntry, decode_directory, encode_directory, encode_table,
};
use qimg_format::lenient::TABLE_WORD;
use qimg_format::validate::MAX_L1_BYTES;
use qimg_io::Storage;

use crate::engine::bitmaps::{Judged, entry_offsets, judge_bitmaps};

use super::checker::{BEYOND_EOF_WINDOW, BitmapDirectory, Checker, c_hex, walk_io_error};
use super::{CheckEvent, CheckReport, Counters, EFBIG, EIO, Failure, RepairScope, io_failure};

impl<S: Storage> Checker<'_, S> {
    // ----- the pass -----

    /// One `qcow2_co_check_locked`.
    pub(super) async fn check_pass(
        &mut self,
        fix: RepairScope,
    ) -> std::result::Result<CheckReport, Failure> {
        let mut result = Counters::default();
        let mut snapshot_res = Counters::default();
        self.check_read_snapshot_table(&mut snapshot_res, fix)
            .await?;
        let mut refcount_res = Counters::default();
        let r = self.check_refcounts(&mut refcount_res, fix).await;
        result.add(&refcount_res, true);
        r?;
        // QEMU rewrites the snapshot table here (qcow2_check_fix_snapshot_table); qimg does
        // for incomplete entries (dropped extra data stays reported).
        if fix.corruptions {
            self.fix_incomplete_snapshots(&mut snapshot_res).await?;
        } else {
            self.incomplete_snapshots = 0;
        }
        result.add(&snapshot_res, false);
        if fix.any() && result.check_errors == 0 && result.corruptions == 0 {
            self.mark_clean_and_consistent().await?;
        }
        Ok(result.report())
    }
    /// `qcow2_check_refcounts`.
    pub(super) async fn check_refcounts(
        &mut self,
        res: &mut Counters,
        fix: RepairScope,
    ) -> std::result::Result<(), Failure> {
        let nb_clusters = self.size_to_clusters(self.file_len);
        if nb_clusters > i32::MAX as u64 {
            res.check_errors += 1;
            return Err(Failure(EFBIG.into()));
        }
        res.total_clusters = self.size_to_clusters(self.total_sectors * 512);
        self.refs.clear();
        self.refs.size = nb_clusters;
        self.beyond_eof.clear();
        self.uncounted.clear();
        self.grow_limit = u64::MAX;
        let mut rebuild = false;
        self.exclusive = None;
        if fix.corruptions {
            // A silent walk that changes nothing finds the tables that are safe to edit.
            let signaled = self.signaled_corruption;
            let incompatible = self.incompatible;
            let l1 = self.l1.clone();
            self.mute = true;
            let walked = self
                .calculate_refcounts(&mut Counters::default(), fix, &mut rebuild)
                .await;
            self.mute = false;
            self.signaled_corruption = signaled;
            self.incompatible = incompatible;
            self.l1 = l1;
            self.index = None;
            rebuild = false;
            if walked.is_ok() {
                let exclusive = self
                    .table_uses
                    .iter()
                    .filter(|&(&c, &n)| self.refs.get(c) == n)
                    .map(|(&c, _)| c)
                    .collect();
                self.exclusive = Some(exclusive);
            }
            self.refs.clear();
            self.refs.size = nb_clusters;
            self.beyond_eof.clear();
            self.uncounted.clear();
            self.grow_limit = u64::MAX;
        }
        self.calculate_refcounts(res, fix, &mut rebuild).await?;
        let pre_compare = *res;
        let mut highest = 0u64;
        self.compare_refcounts(res, RepairScope::NONE, &mut rebuild, &mut highest)
            .await;
        if rebuild && fix.corruptions {
            let old = *res;
            let mut fresh_leaks = 0;
            self.msg("Rebuilding refcount structure".into());
            self.rebuild_refcount_structure(res).await?;
            res.corruptions = 0;
            res.leaks = 0;
            rebuild = false;
            self.refs.clear();
            self.calculate_refcounts(res, RepairScope::NONE, &mut rebuild)
                .await?;
            if fix.leaks {
                let saved = *res;
                *res = Counters::default();
                self.compare_refcounts(
                    res,
                    RepairScope {
                        leaks: true,
                        corruptions: false,
                    },
                    &mut rebuild,
                    &mut highest,
                )
                .await;
                if rebuild {
                    self.msg("ERROR rebuilt refcount structure is still broken".into());
                }
                fresh_leaks = res.leaks;
                *res = saved;
            }
            if res.corruptions < old.corruptions {
                res.corruptions_fixed += old.corruptions - res.corruptions;
            }
            if res.leaks < old.leaks {
                res.leaks_fixed += old.leaks - res.leaks;
            }
            res.leaks += fresh_leaks;
        } else if fix.any() {
            if rebuild {
                self.msg("ERROR need to rebuild refcount structures".into());
                res.check_errors += 1;
                return Err(Failure(EIO.into()));
            }
            if res.leaks != 0 || res.corruptions != 0 {
                *res = pre_compare;
                self.keep_copied = self.behind_shared_tables().await;
                self.compare_refcounts(res, fix, &mut rebuild, &mut highest)
                    .await;
                self.keep_copied.clear();
            }
        }
        self.check_oflag_copied(res, fix).await?;
        res.image_end_offset = (highest + 1) * self.cluster_size;
        Ok(())
    }

    pub(super) async fn calculate_refcounts(
        &mut self,
        res: &mut Counters,
        fix: RepairScope,
        rebuild: &mut bool,
    ) -> std::result::Result<(), Failure> {
        self.table_uses.clear();
        self.compressed_uses.clear();
        self.inc_refcounts(res, 0, self.cluster_size);
        self.check_refcounts_l1(res, self.l1_offset, self.l1_size, true, fix, true)
            .await?;
        if self.data_file && self.nb_snapshots > 0 {
            self.msg(format!(
                "ERROR {} snapshots in image with data file",
                self.nb_snapshots
            ));
            res.corruptions += 1;
        }
        for i in 0..self.snapshots.len() {
            let sn = self.snapshots[i].clone();
            if sn.l1_offset % self.cluster_size != 0 {
                self.msg(format!(
                    "ERROR snapshot {} ({}) l1_offset={}: L1 table is not cluster aligned; \
                     snapshot table entry corrupted",
                    sn.id,
                    sn.name,
                    c_hex(sn.l1_offset)
                ));
                res.corruptions += 1;
                continue;
            }
            if u64::from(sn.l1_size) > MAX_L1_BYTES / TABLE_WORD {
                self.msg(format!(
                    "ERROR snapshot {} ({}) l1_size={}: L1 table is too large; snapshot table \
                     entry corrupted",
                    sn.id,
                    sn.name,
                    c_hex(u64::from(sn.l1_size))
                ));
                res.corruptions += 1;
                continue;
            }
            self.check_refcounts_l1(res, sn.l1_offset, sn.l1_size, false, fix, false)
                .await?;
        }
        self.inc_refcounts(res, self.snapshots_offset, self.snapshots_size);
        self.inc_refcounts(
            res,
            self.reftable_offset,
            self.reftable.len() as u64 * TABLE_WORD,
        );
        if let Some((off, len)) = self.crypto {
            self.inc_refcounts(res, off, len);
        }
        self.check_bitmaps_refcounts(res, fix).await?;
        self.check_refblocks(res, fix, rebuild)
    }

    /// `qcow2_inc_refcounts_imrt`: returns false when the range lies past the end of the file.
    pub(super) fn inc_refcounts(&mut self, res: &mut Counters, offset: u64, size: u64) -> bool {
        if size == 0 {
            return true;
        }
        if self.past_eof(offset, size) {
            self.msg(format!(
                "ERROR: counting reference for region exceeding the end of the file by one \
                 cluster or more: offset {offset:#x} size {size:#x}"
            ));
            res.corruptions += 1;
            let end_cluster = self.file_len.div_ceil(self.cluster_size);
            let first = offset / self.cluster_size;
            if first < end_cluster {
                self.uncounted.push((first, end_cluster));
            }
            // past_eof() holds while the file is at most this long.
            let limit = i128::from(offset) + i128::from(size) - i128::from(self.cluster_size);
            self.grow_limit = self
                .grow_limit
                .min(u64::try_from(limit.max(0)).unwrap_or(u64::MAX));
            let window = end_cluster.saturating_sub(1)..end_cluster + BEYOND_EOF_WINDOW;
            let last = (offset.saturating_add(size - 1) / self.cluster_size).min(window.end);
            for k in (offset / self.cluster_size).max(window.start)..=last {
                if window.contains(&k) {
                    self.beyond_eof.insert(k);
                }
            }
            return false;
        }
        let first = offset / self.cluster_size;
        let last = (offset + size - 1) / self.cluster_size;
        for k in first..=last {
            if k >= self.refs.size {
                self.refs.size = k + 1;
            }
            let v = self.refs.get(k);
            if v == self.refcount_max {
                self.msg(format!(
                    "ERROR: overflow cluster offset={:#x}",
                    k * self.cluster_size
                ));
                self.msg(
                    "Use qemu-img amend to increase the refcount entry width or qemu-img \
                     convert to create a clean copy if the image cannot be opened for writing"
                        .into(),
                );
                res.corruptions += 1;
                continue;
            }
            self.refs.set(k, v + 1);
        }
        true
    }

    pub(super) fn past_eof(&self, offset: u64, size: u64) -> bool {
        i128::from(offset) + i128::from(size) - i128::from(self.file_len)
            >= i128::from(self.cluster_size)
    }

    pub(super) fn progress(&mut self, done: u64, total: u64) {
        if self.mute {
            return;
        }
        (self.events)(CheckEvent::Progress { done, total });
    }
    /// `qcow2_check_bitmaps_refcounts`, and beyond QEMU: a bitmap QEMU's loader refuses
    /// ([`judge_bitmaps`]) makes QEMU refuse to open the image at all, so nothing QEMU has can
    /// remove it. Here it is a corruption, and `-r all` drops it from the directory (its
    /// clusters are then leaks, which the same pass frees).
    pub(super) async fn check_bitmaps_refcounts(
        &mut self,
        res: &mut Counters,
        fix: RepairScope,
    ) -> std::result::Result<(), Failure> {
        let Some(BitmapDirectory {
            offset: dir_offset,
            size: dir_size,
            count: nb,
        }) = self.bitmaps
        else {
            return Ok(());
        };
        // The extension was validated at open: the directory is at most 64 MiB.
        let list = self
            .read_bytes(dir_offset, dir_size)
            .await
            .map_err(|e| e.to_string())
            .and_then(|dir| {
                let ext = BitmapsExtension {
                    nb_bitmaps: nb,
                    directory_size: dir_size,
                    directory_offset: dir_offset,
                };
                decode_directory(&dir, &ext).map_err(|e| e.to_string())
            });
        // A directory that does not decode (QEMU: "Broken bitmap directory" and the like, and
        // no open) is a corruption; `-r all` drops the extension, and every cluster only
        // the bitmaps held is then a leak the same pass frees.
        let mut list = match list {
            Ok(list) => list,
            Err(why) => {
                let verb = if fix.corruptions {
                    "Repairing"
                } else {
                    "ERROR"
                };
                self.msg(format!("{verb} bitmap directory at {dir_offset:#x}: {why}"));
                res.corruptions += 1;
                if fix.corruptions {
                    self.drop_bitmaps(dir_offset, &[]).await?;
                    res.corruptions_fixed += 1;
                } else {
                    self.inc_refcounts(res, dir_offset, dir_size);
                }
                return Ok(());
            }
        };
        let disk_size = self.total_sectors * 512;
        let judged = judge_bitmaps(&self.walker(), &list, self.cluster_size, disk_size).await;
        let judged = match judged {
            Ok(j) => j,
            Err(e) => {
                res.corruptions += 1;
                return Err(io_failure(&walk_io_error(e)));
            }
        };
        let offsets = entry_offsets(&list, dir_offset);
        let mut refused = Vec::new();
        for (i, mut j) in judged.into_iter().enumerate() {
            // A table past the end of the file reads as zeros (QEMU then keeps the bitmap
            // with every bit clear: what it tracked is lost without a trace). A repair drops
            // the bitmap; a check reports it below as QEMU does.
            let table_len = u64::from(list[i].table_size) * TABLE_WORD;
            if fix.corruptions && self.past_eof(list[i].table_offset, table_len) {
                j = Judged::Refused(format!(
                    "the table of bitmap '{}' at {:#x} lies past the end of the file",
                    String::from_utf8_lossy(&list[i].name),
                    list[i].table_offset
                ));
            }
            if let Judged::Refused(why) = j {
                let verb = if fix.corruptions {
                    "Repairing"
                } else {
                    "ERROR"
                };
                self.msg(format!(
                    "{verb} bitmap directory entry at {:#x}: {why}",
                    offsets[i]
                ));
                res.corruptions += 1;
                refused.push(i);
            }
        }
        let mut dir_size = dir_size;
        if fix.corruptions && !refused.is_empty() {
            let keep: Vec<BitmapEntry> = (0..list.len())
                .filter(|i| !refused.contains(i))
                .map(|i| list[i].clone())
                .collect();
            self.drop_bitmaps(dir_offset, &keep).await?;
            res.corruptions_fixed += refused.len() as i64;
            dir_size = encode_directory(&keep).len() as u64;
            list = keep;
            if list.is_empty() {
                return Ok(());
            }
        }
        self.inc_refcounts(res, dir_offset, dir_size);
        const PIECE: u64 = 65536;
        for bm in list {
            let size = u64::from(bm.table_size);
            self.inc_refcounts(res, bm.table_offset, size * TABLE_WORD);
            let mut done = 0;
            while done < size {
                let n = (size - done).min(PIECE);
                let at = bm
                    .table_offset
                    .checked_add(done * TABLE_WORD)
                    .filter(|&a| a <= i64::MAX as u64);
                let read = match at {
                    Some(at) => self
                        .walker()
                        .read_bitmap_table(at, n)
                        .await
                        .map_err(walk_io_error),
                    None => Err(std::io::Error::from_raw_os_error(22)),
                };
                let words = match read {
                    Ok(w) => w,
                    Err(e) => {
                        res.corruptions += 1;
                        return Err(io_failure(&e));
                    }
                };
                for (i, entry) in words.into_iter().enumerate() {
                    let offset = entry.offset();
                    if entry.is_invalid(self.cluster_size) {
                        res.corruptions += 1;
                        continue;
                    }
                    if offset != 0
                        && !self.inc_refcounts(res, offset, self.cluster_size)
                        && fix.corruptions
                    {
                        // Beyond QEMU (whose repair keeps the bitmap with those bits clear,
                        // so a backup would skip what they tracked): the bits are lost, so
                        // they all read as changed.
                        let at = at.unwrap_or(0) + i as u64 * TABLE_WORD;
                        let ones = encode_table(&[TableEntry::Ones]);
                        self.write(&ones, at).await.map_err(|e| io_failure(&e))?;
                        self.msg(format!(
                            "Repairing bitmap table entry at {at:#x}: its data cluster \
                             {offset:#x} lies past the end of the file; every bit it held \
                             now reads as set"
                        ));
                        res.corruptions_fixed += 1;
                    }
                }
                done += n;
            }
        }
        Ok(())
    }

    /// `check_refblocks`.
    pub(super) fn check_refblocks(
        &mut self,
        res: &mut Counters,
        fix: RepairScope,
        rebuild: &mut bool,
    ) -> std::result::Result<(), Failure> {
        for i in 0..self.reftable.len() {
            let entry = self.reftable[i];
            let offset = entry.block_offset();
            let cluster = offset >> self.cluster_bits;
            if entry.reserved_bits() != 0 {
                self.msg(format!(
                    "ERROR refcount table entry {i} has reserved bits set"
                ));
                res.corruptions += 1;
                *rebuild = true;
                continue;
            }
            if offset % self.cluster_size != 0 {
                self.msg(format!(
                    "ERROR refcount block {i} is not cluster aligned; refcount table entry corrupted"
                ));
                res.corruptions += 1;
                *rebuild = true;
                continue;
            }
            if cluster >= self.refs.size {
                res.corruptions += 1;
                self.msg(format!(
                    "{} refcount block {i} is outside image",
                    if fix.corruptions {
                        "Repairing"
                    } else {
                        "ERROR"
                    }
                ));
                // QEMU grows the file to cover the block, which then reads as zeros and so
                // always needs a rebuild anyway; a garbage offset would grow the file by
                // terabytes. qimg rebuilds without growing the file.
                if fix.corruptions {
                    *rebuild = true;
                }
                continue;
            }
            if offset != 0 {
                self.inc_refcounts(res, offset, self.cluster_size);
                let n = self.refs.get(cluster);
                if n != 1 {
                    self.msg(format!("ERROR refcount block {i} refcount={n}"));
                    res.corruptions += 1;
                    *rebuild = true;
                }
            }
        }
        Ok(())
    }
}

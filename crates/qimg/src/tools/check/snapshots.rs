//! The snapshot table: QEMU's `qcow2_check_read_snapshot_table` and
//! `qcow2_do_read_snapshots`, which read it leniently, trim what `-r all` may trim and report
//! the rest.

use qimg_format::header::{SnapshotPointer, field};
use qimg_format::snapshot::{
    ENTRY_HEADER_LEN, KNOWN_EXTRA_DATA, MAX_EXTRA_DATA, MAX_SNAPSHOTS, MAX_TABLE_SIZE, decode_text,
    encode_table,
};
use qimg_io::Storage;

use super::checker::{Checker, SnapshotEntry, walk_io_error};
use super::{Counters, EFBIG, EINVAL, Failure, RepairScope, io_failure, strerror};

impl<S: Storage> Checker<'_, S> {
    pub(super) async fn check_read_snapshot_table(
        &mut self,
        res: &mut Counters,
        fix: RepairScope,
    ) -> std::result::Result<(), Failure> {
        let pointer = match self
            .read_bytes(field::SNAPSHOTS, field::SNAPSHOTS_LEN as u64)
            .await
        {
            Ok(b) => {
                let mut p = [0u8; field::SNAPSHOTS_LEN];
                p.copy_from_slice(&b);
                SnapshotPointer::decode(&p)
            }
            Err(e) => {
                res.check_errors += 1;
                self.msg(format!(
                    "ERROR failed to read the snapshot table pointer from the image header: {}",
                    strerror(&e)
                ));
                return Err(io_failure(&e));
            }
        };
        self.nb_snapshots = pointer.nb_snapshots;
        self.snapshots_offset = pointer.snapshots_offset;
        self.incomplete_snapshots = 0;
        let mut reduced: u32 = 0;
        let mut dropped: u32 = 0;
        if self.nb_snapshots > MAX_SNAPSHOTS && fix.corruptions {
            self.msg(format!(
                "Discarding {} overhanging snapshots",
                self.nb_snapshots - MAX_SNAPSHOTS
            ));
            reduced += self.nb_snapshots - MAX_SNAPSHOTS;
            self.nb_snapshots = MAX_SNAPSHOTS;
        }
        // qcow2_validate_table
        let invalid = if self.nb_snapshots > MAX_SNAPSHOTS {
            Some(("snapshot table too large", EFBIG))
        } else if (i64::MAX as u64 - u64::from(self.nb_snapshots) * ENTRY_HEADER_LEN)
            < self.snapshots_offset
            || self.snapshots_offset % self.cluster_size != 0
        {
            Some(("snapshot table offset invalid", EINVAL))
        } else {
            None
        };
        if let Some((what, errno)) = invalid {
            res.check_errors += 1;
            self.msg(format!("ERROR {what}"));
            if self.nb_snapshots > MAX_SNAPSHOTS {
                self.msg(format!(
                    "You can force-remove all {} overhanging snapshots with qemu-img check -r all",
                    self.nb_snapshots - MAX_SNAPSHOTS
                ));
            }
            self.snapshots_offset = 0;
            self.nb_snapshots = 0;
            self.snapshots.clear();
            self.index = None;
            self.snapshots_size = 0;
            return Err(Failure(errno.into()));
        }
        if let Err((text, hint, errno)) = self
            .read_snapshots(fix.corruptions, &mut reduced, &mut dropped)
            .await
        {
            res.check_errors += 1;
            self.msg(format!("ERROR failed to read the snapshot table: {text}"));
            if let Some(h) = hint {
                self.msg(h);
            }
            self.snapshots_offset = 0;
            self.nb_snapshots = 0;
            self.snapshots.clear();
            self.index = None;
            self.snapshots_size = 0;
            return Err(Failure(errno));
        }
        res.corruptions += i64::from(reduced) + i64::from(dropped);
        if reduced > 0 {
            let nb = SnapshotPointer::encode_count(self.nb_snapshots);
            let written = match self.write(&nb, field::SNAPSHOTS).await {
                Ok(()) => self.sync().await,
                Err(e) => Err(e),
            };
            if let Err(e) = written {
                res.check_errors += 1;
                self.msg(format!(
                    "ERROR failed to update the snapshot count in the image header: {}",
                    strerror(&e)
                ));
                return Err(io_failure(&e));
            }
            res.corruptions_fixed += i64::from(reduced);
            res.corruptions -= i64::from(reduced);
        }
        if self.version >= 3 {
            for i in 0..self.snapshots.len() {
                if u64::from(self.snapshots[i].extra_data_size) < 16 {
                    res.corruptions += 1;
                    self.incomplete_snapshots += 1;
                    // Rewritten after the refcounts (fix_incomplete_snapshots), as QEMU does.
                    self.msg(format!(
                        "{} snapshot table entry {i} is incomplete",
                        if fix.corruptions {
                            "Repairing"
                        } else {
                            "ERROR"
                        }
                    ));
                }
            }
        }
        Ok(())
    }

    /// QEMU's `qcow2_check_fix_snapshot_table` for incomplete entries: every entry gets the
    /// extra data v3 asks for ([`Snapshot::complete_extra`]). The table is rewritten where it
    /// is, when it still fits in the clusters it holds (a few bytes more per entry); QEMU
    /// moves it to new clusters instead, which a check cannot allocate. When it does not fit,
    /// the entries stay reported.
    ///
    /// [`Snapshot::complete_extra`]: qimg_format::snapshot::Snapshot::complete_extra
    pub(super) async fn fix_incomplete_snapshots(
        &mut self,
        res: &mut Counters,
    ) -> std::result::Result<(), Failure> {
        let n = i64::from(std::mem::take(&mut self.incomplete_snapshots));
        if n == 0 {
            return Ok(());
        }
        let Ok(mut snaps) = self
            .walker()
            .read_snapshot_table(self.snapshots_offset, self.nb_snapshots)
            .await
        else {
            return Ok(());
        };
        for sn in &mut snaps {
            sn.complete_extra(self.total_sectors * 512);
        }
        let table = encode_table(&snaps);
        let room = self.snapshots_size.next_multiple_of(self.cluster_size);
        let held = self.referenced_once(self.snapshots_offset, room);
        if table.len() as u64 > room || !held {
            self.msg(format!(
                "ERROR failed to update the snapshot table: the completed table of {} bytes \
                 does not fit where it is",
                table.len()
            ));
            return Ok(());
        }
        let written = match self.write(&table, self.snapshots_offset).await {
            Ok(()) => self.sync().await,
            Err(e) => Err(e),
        };
        if let Err(e) = written {
            res.check_errors += 1;
            self.msg(format!(
                "ERROR failed to update the snapshot table: {}",
                strerror(&e)
            ));
            return Err(io_failure(&e));
        }
        self.snapshots_size = table.len() as u64;
        for e in &mut self.snapshots {
            e.extra_data_size = e.extra_data_size.max(KNOWN_EXTRA_DATA as u32);
        }
        res.corruptions -= n;
        res.corruptions_fixed += n;
        Ok(())
    }

    /// QEMU's `qcow2_do_read_snapshots` (errors: message, hint, errno text).
    pub(super) async fn read_snapshots(
        &mut self,
        repair: bool,
        reduced: &mut u32,
        dropped: &mut u32,
    ) -> std::result::Result<(), (String, Option<String>, String)> {
        self.snapshots.clear();
        self.index = None;
        self.snapshots_size = 0;
        if self.nb_snapshots == 0 {
            return Ok(());
        }
        let io = |e: std::io::Error| {
            (
                format!("Failed to read snapshot table: {}", strerror(&e)),
                None,
                strerror(&e),
            )
        };
        let start = self.snapshots_offset;
        let mut offset = start;
        let mut table_length: u64 = 0;
        let nb = self.nb_snapshots;
        for i in 0..nb {
            let pre = offset;
            table_length = table_length.next_multiple_of(8);
            offset = offset.next_multiple_of(8);
            let h = self
                .walker()
                .read_snapshot_entry(offset)
                .await
                .map_err(|e| io(walk_io_error(e)))?;
            offset += ENTRY_HEADER_LEN;
            let l1_offset = h.l1_table_offset;
            let l1_size = h.l1_size;
            let id_len = u64::from(h.id_size);
            let name_len = u64::from(h.name_size);
            let mut extra = h.extra_data_size;
            let mut truncate = false;
            if extra > MAX_EXTRA_DATA {
                if !repair {
                    return Err((
                        format!("Too much extra metadata in snapshot table entry {i}"),
                        Some(
                            "You can force-remove this extra metadata with qemu-img check -r all"
                                .into(),
                        ),
                        EFBIG.into(),
                    ));
                }
                self.msg(format!(
                    "Discarding too much extra metadata in snapshot table entry {i} ({extra} > 1024)"
                ));
                *dropped += 1;
                truncate = true;
            }
            offset += u64::from(extra).min(KNOWN_EXTRA_DATA);
            if u64::from(extra) > KNOWN_EXTRA_DATA {
                let end = offset + u64::from(extra) - KNOWN_EXTRA_DATA;
                if truncate {
                    extra = MAX_EXTRA_DATA;
                }
                offset = end;
            }
            let id = self.read_bytes(offset, id_len).await.map_err(io)?;
            offset += id_len;
            let name = self.read_bytes(offset, name_len).await.map_err(io)?;
            offset += name_len;
            table_length += ENTRY_HEADER_LEN + u64::from(extra) + id_len + name_len;
            if table_length > MAX_TABLE_SIZE || offset - start > i32::MAX as u64 {
                if !repair {
                    return Err((
                        "Snapshot table is too big".into(),
                        Some(format!(
                            "You can force-remove all {} overhanging snapshots with qemu-img check -r all",
                            nb - i
                        )),
                        EFBIG.into(),
                    ));
                }
                self.msg(format!(
                    "Discarding {} overhanging snapshots (snapshot table is too big)",
                    nb - i
                ));
                *reduced += nb - i;
                self.nb_snapshots = i;
                offset = pre;
                break;
            }
            self.index = None;
            self.snapshots.push(SnapshotEntry {
                l1_offset,
                l1_size,
                id: decode_text(&id),
                name: decode_text(&name),
                extra_data_size: extra,
            });
        }
        self.snapshots_size = offset - start;
        self.index = None;
        Ok(())
    }
}

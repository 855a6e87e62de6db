//! The snapshot table and the trees snapshots share: reading and installing the table,
//! reading a snapshot's L1 table, refcounts of whole trees, COPIED flags.

use qimg_cache::SliceKey;
use qimg_format::header::{self, SnapshotPointer};
use qimg_format::l1::{self, L1Entry};
use qimg_format::l2::{self, L2Entry, decode_slice};
use qimg_format::snapshot::{self as fsnap, KNOWN_EXTRA_DATA, MAX_TABLE_SIZE, Snapshot};
use qimg_format::validate::MAX_L1_BYTES;
use qimg_io::Storage;

use crate::engine::image::Inner;
use crate::engine::meta::{CacheKind, Meta};
use crate::engine::overlap::{Region, Writing};
use crate::error::{Error, Result};

impl<S: Storage> Inner<S> {
    /// Refuses a new snapshot named `name` before anything is locked: snapshots not possible
    /// here, or a name too long for the table.
    pub(crate) fn check_new_snapshot(&self, name: &str) -> Result<()> {
        self.check_snapshots_possible()?;
        if name.len() > usize::from(u16::MAX) {
            return Err(Error::InvalidOption(format!(
                "snapshot name of {} bytes: at most {} are allowed",
                name.len(),
                u16::MAX
            )));
        }
        Ok(())
    }

    /// Refuses snapshot changes on read-only images and images with an external data file
    /// (QEMU does not support them).
    pub(super) fn check_snapshots_possible(&self) -> Result<()> {
        self.shared.check_writable()?;
        if self.shared.data_file.is_some() {
            return Err(Error::Unsupported {
                path: self.shared.path.clone(),
                what: "internal snapshots of an image with an external data file".into(),
            });
        }
        Ok(())
    }

    /// Refuses to share the tree under `l1` when refcounts cannot reach 2 (1-bit refcounts;
    /// an empty tree can still be snapshotted, as in QEMU).
    pub(super) fn check_shareable(&self, l1: &[L1Entry]) -> Result<()> {
        if self.shared.rgeo.max_refcount() < 2 && l1.iter().any(|e| e.l2_offset.is_some()) {
            // EINVAL, as QEMU's refcount overflow (which leaks a cluster; this refuses first).
            return Err(Error::InvalidOption(format!(
                "{}: internal snapshots with 1-bit refcounts (a shared cluster needs a \
                 refcount of 2)",
                self.shared.path.display()
            )));
        }
        Ok(())
    }

    /// The snapshot table the header names now.
    pub(super) async fn read_snapshot_table(&self, m: &Meta) -> Result<Vec<Snapshot>> {
        let (offset, nb) = m.snapshot_table();
        if nb == 0 {
            return Ok(Vec::new());
        }
        let len = self.shared.file_len().await?;
        let want = len.saturating_sub(offset).min(MAX_TABLE_SIZE) as usize;
        let mut raw = vec![0u8; want];
        self.shared
            .file
            .read_at_zero_fill(&mut raw, offset)
            .await
            .map_err(|e| self.shared.storage_error(e))?;
        fsnap::decode_table(&raw, offset, nb).map_err(|e| self.shared.fmt_err(e))
    }

    /// A snapshot's L1 table, bounded and strictly decoded.
    pub(super) async fn read_snapshot_l1(&self, sn: &Snapshot) -> Result<Vec<L1Entry>> {
        let bytes = l1::table_bytes(u64::from(sn.l1_size));
        if bytes > MAX_L1_BYTES {
            return Err(Error::corrupt(
                &self.shared.path,
                format!(
                    "snapshot '{}' has an L1 table of {} entries ({bytes} bytes, at most \
                     {MAX_L1_BYTES})",
                    fsnap::decode_text(&sn.id),
                    sn.l1_size
                ),
            ));
        }
        let mut raw = vec![0u8; bytes as usize];
        self.shared
            .file
            .read_at(&mut raw, sn.l1_table_offset)
            .await
            .map_err(|e| {
                Error::corrupt(
                    &self.shared.path,
                    format!(
                        "the L1 table of snapshot '{}' at {:#x} ({} entries) cannot be read: {e}",
                        fsnap::decode_text(&sn.id),
                        sn.l1_table_offset,
                        sn.l1_size
                    ),
                )
            })?;
        l1::decode_table(&raw, self.shared.geo.cluster_size(), sn.l1_table_offset)
            .map_err(|e| self.shared.fmt_err(e))
    }

    /// Reads and strictly decodes every L2 table of the tree under `l1`, changing nothing:
    /// a damaged snapshot is refused before its references are counted or dropped (a
    /// failure half way would leave the operation half done).
    pub(super) async fn check_tree(&self, l1: &[L1Entry]) -> Result<()> {
        let cs = self.shared.geo.cluster_size();
        let mut table = vec![0u8; cs as usize];
        for e in l1 {
            let Some(t) = e.l2_offset else { continue };
            self.shared
                .file
                .read_at(&mut table, t.0)
                .await
                .map_err(|e| {
                    Error::corrupt(
                        &self.shared.path,
                        format!("the snapshot's L2 table at {:#x} cannot be read: {e}", t.0),
                    )
                })?;
            decode_slice(&table, &self.shared.ctx, t.0).map_err(|e| self.shared.fmt_err(e))?;
        }
        Ok(())
    }

    /// Adds `delta` (+1 or -1) to the refcount of every cluster the tree under `l1` reaches:
    /// its L2 tables, and the data and compressed clusters they map. Tables are read from
    /// the file: the L2 cache must have been written back. Clusters reaching 0 are freed.
    pub(super) async fn tree_refcounts(
        &self,
        m: &mut Meta,
        l1: &[L1Entry],
        delta: i64,
    ) -> Result<()> {
        let cs = self.shared.geo.cluster_size();
        let mut table = vec![0u8; cs as usize];
        for e in l1 {
            let Some(t) = e.l2_offset else { continue };
            self.shared
                .file
                .read_at(&mut table, t.0)
                .await
                .map_err(|e| self.shared.storage_error(e))?;
            let entries =
                decode_slice(&table, &self.shared.ctx, t.0).map_err(|e| self.shared.fmt_err(e))?;
            self.add_refcount(m, t.0, 1, delta).await?;
            for entry in &entries {
                match *entry.entry() {
                    L2Entry::Compressed(d) => {
                        let (first, n) = d.host_clusters();
                        self.add_refcount(m, first.0 * cs, n, delta).await?;
                    }
                    other => {
                        if let Some(h) = other.host_cluster() {
                            self.add_refcount(m, h.0, 1, delta).await?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    pub(super) async fn add_refcount(
        &self,
        m: &mut Meta,
        offset: u64,
        n: u64,
        delta: i64,
    ) -> Result<()> {
        if delta < 0 {
            return self.shared.free_clusters(m, offset, n).await;
        }
        let first = offset / self.shared.geo.cluster_size();
        for c in first..first + n {
            self.shared.update_refcount(m, c, delta).await?;
        }
        Ok(())
    }

    /// Makes the COPIED flags of the active tree agree with the refcounts: cleared where a
    /// refcount is above 1, set where it is 1 (in L2 tables only when the table itself is
    /// not shared). Refcounts must be durable first; the flags are durable on return.
    pub(crate) async fn sync_copied(&self, m: &mut Meta) -> Result<()> {
        self.shared.refuse_unaligned_l2(m).await?;
        let cs = self.shared.geo.cluster_size();
        let es = self.shared.geo.l2_entry_size() as usize;
        let slice_bytes = m.l2_slice_size() as u64;
        let slices = (cs / slice_bytes) as u32;
        let mut l1_changed = false;
        for i in 0..m.l1_len() {
            let e = m.l1()[i];
            let Some(t) = e.l2_offset else { continue };
            let rt = self.shared.refcount(m, t.0 / cs).await?;
            if e.copied != (rt == 1) {
                m.set_l1_entry(
                    i,
                    L1Entry {
                        copied: rt == 1,
                        ..e
                    },
                );
                l1_changed = true;
            }
            for s in 0..slices {
                let key = SliceKey::new(t.0, s);
                self.shared.load(m, CacheKind::L2, key).await?;
                let base = t.0 + u64::from(s) * slice_bytes;
                let data = m
                    .l2_slice(key)
                    .ok_or_else(|| {
                        Error::corrupt(&self.shared.path, format!("L2 slice {key} vanished"))
                    })?
                    .to_vec();
                let entries = decode_slice(&data, &self.shared.ctx, base)
                    .map_err(|e| self.shared.fmt_err(e))?;
                let mut changes = Vec::new();
                for (j, entry) in entries.iter().enumerate() {
                    let first = entry.entry();
                    let Some(h) = first.host_cluster() else {
                        continue;
                    };
                    let want = self.shared.refcount(m, h.0 / cs).await? == 1;
                    if first.copied() != want && (!want || rt == 1) {
                        changes.push((j, want));
                    }
                }
                if changes.is_empty() {
                    continue;
                }
                let now = self.shared.now();
                let slice = m.l2_slice_mut(key, now).ok_or_else(|| {
                    Error::corrupt(&self.shared.path, format!("L2 slice {key} vanished"))
                })?;
                for (j, want) in changes {
                    l2::set_copied(slice, j, es, want).map_err(|e| self.shared.fmt_err(e))?;
                }
            }
        }
        self.shared.write_back(m, CacheKind::L2).await?;
        if l1_changed {
            let l1 = m.l1().to_vec();
            self.write_active_l1(m, &l1).await?;
        }
        self.shared.flush_file().await
    }

    /// Writes `entries` over the active L1 table in one write (not flushed).
    pub(super) async fn write_active_l1(&self, m: &mut Meta, entries: &[L1Entry]) -> Result<()> {
        self.shared.check_not_halted()?;
        let raw = l1::encode_table(entries);
        let at = m.l1_offset();
        self.shared
            .guard_write(m, at, raw.len() as u64, Writing::Own(Region::ActiveL1, at))
            .await?;
        self.shared
            .file
            .write_at(&raw, at)
            .await
            .map_err(|e| self.shared.storage_error(e))
    }

    /// Rewrites the snapshot table with every entry's extra data complete
    /// ([`Snapshot::complete_extra`]), as QEMU does when it upgrades an image to v3 or
    /// repairs incomplete entries; nothing is written when every entry is complete.
    pub(crate) async fn complete_snapshot_table(&self) -> Result<()> {
        let _guard = self.locks.lock(0, u64::MAX, true).await;
        let mut m = self.meta.lock().await;
        self.ensure_open(&m)?;
        let snaps = self.read_snapshot_table(&m).await?;
        if !snaps
            .iter()
            .any(|s| s.extra_data.len() < KNOWN_EXTRA_DATA as usize)
        {
            return Ok(());
        }
        self.shared.free_abandoned(&mut m).await?;
        self.shared.flush_meta(&mut m).await?;
        self.install_snapshot_table(&mut m, &snaps, &snaps).await?;
        self.shared.flush_meta(&mut m).await
    }

    /// Writes `snaps` as the new snapshot table in new clusters (each entry's extra data
    /// completed as QEMU writes it), switches the header to it in one write and frees
    /// `old`'s clusters.
    pub(super) async fn install_snapshot_table(
        &self,
        m: &mut Meta,
        old: &[Snapshot],
        snaps: &[Snapshot],
    ) -> Result<()> {
        let cs = self.shared.geo.cluster_size();
        let size = self.shared.size();
        let snaps: Vec<Snapshot> = snaps
            .iter()
            .map(|s| {
                let mut s = s.clone();
                s.complete_extra(size);
                s
            })
            .collect();
        let raw = fsnap::encode_table(&snaps);
        let len = raw.len() as u64;
        if len > MAX_TABLE_SIZE {
            return Err(Error::Unsupported {
                path: self.shared.path.clone(),
                what: format!(
                    "a snapshot table of {len} bytes (at most {MAX_TABLE_SIZE}): delete \
                     snapshots first"
                ),
            });
        }
        let at = if snaps.is_empty() {
            0
        } else {
            let clusters = len.div_ceil(cs);
            let at = self.shared.alloc_clusters(m, clusters).await?;
            // The table's bytes only, as QEMU writes them.
            self.shared
                .write_guarded(m, at, &raw, Writing::Data)
                .await?;
            at
        };
        self.shared.write_back(m, CacheKind::Refcount).await?;
        self.shared.flush_file().await?;
        let nb = snaps.len() as u32;
        let pointer = SnapshotPointer {
            nb_snapshots: nb,
            snapshots_offset: at,
        };
        self.shared
            .switch_header(&pointer.encode(), header::field::SNAPSHOTS, || {
                format!("the switch to a snapshot table of {nb} entries at {at:#x} failed")
            })
            .await?;
        let (old_at, old_nb) = m.set_snapshot_table(at, nb, len);
        if old_nb > 0 && old_at != 0 {
            let old_len: u64 = old.iter().map(|s| s.encoded_len() as u64).sum();
            let first = old_at / cs * cs;
            let end = old_at + old_len;
            self.shared
                .free_clusters(m, first, (end - first).div_ceil(cs))
                .await?;
        }
        Ok(())
    }
}

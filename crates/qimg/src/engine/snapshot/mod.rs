//! Internal snapshots: listing, creating, applying (reverting to) and deleting them.
//!
//! A snapshot is an entry of the snapshot table naming a copy of the L1 table; the L2 tables
//! and data clusters it reaches are shared with the active tree (and other snapshots) and
//! counted once per tree that reaches them. Writes to shared clusters copy them first (the
//! COPIED flag is clear on every entry whose cluster has a refcount above 1: `rw/cow.rs`,
//! `meta/tables.rs::ensure_l2`).
//!
//! Crash ordering. Every step below is made durable before the next one starts:
//!
//! * create: the copy of the L1 table is written to new clusters; the refcount of every
//!   cluster the active tree reaches goes up; the COPIED flags of the active tree are cleared
//!   where the refcount is now above 1; the new snapshot table is written to new clusters;
//!   the header switches to it in one write; the old table is freed.
//! * apply: the refcounts of the snapshot's tree go up; the L1 table grows if it must; the
//!   snapshot's L1 entries are written over the active L1 table in one write; the virtual
//!   size changes if the snapshot's differs; the refcounts of the old active tree go down;
//!   COPIED flags are set where a refcount came back to 1.
//! * delete: the table without the entry is written and the header switched to it; the
//!   refcounts of the snapshot's tree go down and its L1 table is freed; COPIED flags are set
//!   where a refcount came back to 1.
//!
//! References therefore never outnumber refcounts: a power cut leaves at worst leaked
//! clusters, except inside the COPIED update that follows a refcount change (between the
//! refcount write and the flag write a flag disagrees with its refcount, which `check -r all`
//! repairs; QEMU has the same window, the two cannot change in one write).

mod expand;
mod tables;

use std::time::{SystemTime, UNIX_EPOCH};

use qimg_format::l1::{self, L1Entry};
use qimg_format::snapshot::{self as fsnap, MAX_SNAPSHOTS, MAX_TABLE_SIZE, Snapshot};
use qimg_io::Storage;

use super::image::Image;
use super::meta::CacheKind;
use super::overlap::{Region, Writing};
use crate::error::{Error, Result};

/// One internal snapshot, with what `qemu-img snapshot -l` shows of it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InternalSnapshot {
    /// The unique ID (a decimal number for snapshots QEMU or qimg made).
    pub id: String,
    /// The name (not necessarily unique).
    pub name: String,
    /// Bytes of saved VM state (0 for disk-only snapshots).
    pub vm_state_size: u64,
    /// Creation time: seconds since the Unix epoch.
    pub date_sec: u32,
    /// Creation time: nanoseconds.
    pub date_nsec: u32,
    /// Guest run time when the snapshot was taken, in nanoseconds.
    pub vm_clock_nsec: u64,
    /// Record/replay instruction count, if recorded.
    pub icount: Option<u64>,
    /// Virtual disk size when the snapshot was taken, if recorded (v3 images always do).
    pub disk_size: Option<u64>,
    /// Entries of the snapshot's L1 table.
    pub l1_size: u32,
}

impl InternalSnapshot {
    fn from_entry(s: &Snapshot) -> Self {
        Self {
            id: fsnap::decode_text(&s.id),
            name: fsnap::decode_text(&s.name),
            vm_state_size: s.vm_state_size(),
            date_sec: s.date_sec,
            date_nsec: s.date_nsec,
            vm_clock_nsec: s.vm_clock_nsec,
            icount: s.icount(),
            disk_size: s.disk_size(),
            l1_size: s.l1_size,
        }
    }
}

/// What a new snapshot records besides its name (see [`Image::create_snapshot_with`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SnapshotOptions {
    /// The creation time; the system clock when `None`.
    pub date: Option<SystemTime>,
    /// The guest run time in nanoseconds (0 for a disk-only snapshot of a stopped guest).
    pub vm_clock_nsec: u64,
}

impl SnapshotOptions {
    /// The system clock and a zero guest clock, as `qemu-img snapshot -c`.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records `date` as the creation time.
    pub fn date(mut self, date: SystemTime) -> Self {
        self.date = Some(date);
        self
    }

    /// Records `nsec` as the guest run time.
    pub fn vm_clock_nsec(mut self, nsec: u64) -> Self {
        self.vm_clock_nsec = nsec;
        self
    }
}

/// Index of the snapshot with ID `key`, else the first one named `key` (QEMU's lookup).
fn find(snaps: &[Snapshot], key: &str) -> Option<usize> {
    let key = key.as_bytes();
    snaps
        .iter()
        .position(|s| s.id == key)
        .or_else(|| snaps.iter().position(|s| s.name == key))
}

/// The ID a new snapshot gets: one more than the largest numeric ID.
fn next_id(snaps: &[Snapshot]) -> String {
    let max = snaps
        .iter()
        .filter_map(|s| fsnap::decode_text(&s.id).parse::<u64>().ok())
        .max()
        .unwrap_or(0);
    (max + 1).to_string()
}

/// The body of [`Image::snapshots`].
pub(crate) async fn snapshots<S: Storage>(img: &Image<S>) -> Result<Vec<InternalSnapshot>> {
    let m = img.inner.meta.lock().await;
    let snaps = img.inner.read_snapshot_table(&m).await?;
    Ok(snaps.iter().map(InternalSnapshot::from_entry).collect())
}

/// The body of [`Image::create_snapshot`].
pub(crate) async fn create_snapshot<S: Storage>(
    img: &Image<S>,
    name: &str,
) -> Result<InternalSnapshot> {
    create_snapshot_with(img, name, &SnapshotOptions::new()).await
}

/// The body of [`Image::create_snapshot_with`].
pub(crate) async fn create_snapshot_with<S: Storage>(
    img: &Image<S>,
    name: &str,
    opts: &SnapshotOptions,
) -> Result<InternalSnapshot> {
    img.inner.check_new_snapshot(name)?;
    let _guard = img.inner.locks.lock(0, u64::MAX, true).await;
    create_snapshot_locked(img, name, opts).await
}

/// [`create_snapshot_with`](Self::create_snapshot_with) with every range lock held by
/// the caller (and [`Inner::check_new_snapshot`] passed).
pub(crate) async fn create_snapshot_locked<S: Storage>(
    img: &Image<S>,
    name: &str,
    opts: &SnapshotOptions,
) -> Result<InternalSnapshot> {
    let inner = &*img.inner;
    let mut m = inner.meta.lock().await;
    inner.ensure_open(&m)?;
    inner.shared.refuse_unaligned_l2(&mut m).await?;
    let mut snaps = inner.read_snapshot_table(&m).await?;
    if snaps.len() as u64 >= u64::from(MAX_SNAPSHOTS) {
        return Err(Error::Unsupported {
            path: inner.shared.path.clone(),
            what: format!("more than {MAX_SNAPSHOTS} snapshots"),
        });
    }
    // Refused before anything changes: a table past QEMU's limit.
    let id = next_id(&snaps);
    let table_len = snaps.iter().map(|s| s.encoded_len() as u64).sum::<u64>()
        + (40 + 24 + id.len() + name.len()).next_multiple_of(8) as u64;
    if table_len > MAX_TABLE_SIZE {
        return Err(Error::Unsupported {
            path: inner.shared.path.clone(),
            what: format!(
                "a snapshot table of {table_len} bytes (at most {MAX_TABLE_SIZE}): delete \
                 snapshots first"
            ),
        });
    }
    let active = m.l1().to_vec();
    inner.check_shareable(&active)?;
    inner.shared.free_abandoned(&mut m).await?;
    inner.shared.flush_meta(&mut m).await?;
    m.set_compressed_tail(None);

    // The copy of the active L1 table (every entry shared from now on).
    let cs = inner.shared.geo.cluster_size();
    let sn_l1: Vec<L1Entry> = m
        .l1()
        .iter()
        .map(|e| L1Entry {
            l2_offset: e.l2_offset,
            copied: false,
        })
        .collect();
    let l1_bytes = l1::table_bytes(sn_l1.len() as u64);
    let l1_at = if sn_l1.is_empty() {
        0
    } else {
        let clusters = l1_bytes.div_ceil(cs);
        let at = inner.shared.alloc_clusters(&mut m, clusters).await?;
        // The table's bytes only, as QEMU writes them (the file then ends where QEMU's
        // does); the rest of the cluster is never read.
        let raw = l1::encode_table(&sn_l1);
        inner
            .shared
            .guard_write(&mut m, at, raw.len() as u64, Writing::Data)
            .await?;
        inner
            .shared
            .file
            .write_at(&raw, at)
            .await
            .map_err(|e| inner.shared.storage_error(e))?;
        at
    };
    // Refcounts first (a reference the switch below adds is then already counted).
    inner.tree_refcounts(&mut m, &active, 1).await?;
    inner.shared.write_back(&mut m, CacheKind::Refcount).await?;
    inner.shared.flush_file().await?;
    inner.sync_copied(&mut m).await?;

    let now = opts
        .date
        .unwrap_or_else(SystemTime::now)
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let size = inner.shared.size();
    // No VM state; icount 0, as qemu-img writes it.
    let extra = fsnap::known_extra(0, size, 0);
    let entry = Snapshot {
        l1_table_offset: l1_at,
        l1_size: sn_l1.len() as u32,
        id: id.into_bytes(),
        name: name.as_bytes().to_vec(),
        date_sec: now.as_secs() as u32,
        // qemu-img takes the time in microseconds.
        date_nsec: now.subsec_micros() * 1000,
        vm_clock_nsec: opts.vm_clock_nsec,
        vm_state_size32: 0,
        extra_data: extra,
    };
    let info = InternalSnapshot::from_entry(&entry);
    let old = snaps.clone();
    snaps.push(entry);
    inner.install_snapshot_table(&mut m, &old, &snaps).await?;
    if !sn_l1.is_empty() {
        m.note_metadata(Region::SnapshotL1, l1_at, l1_bytes);
    }
    inner.shared.flush_meta(&mut m).await?;
    Ok(info)
}

/// The body of [`Image::apply_snapshot`].
pub(crate) async fn apply_snapshot<S: Storage>(img: &Image<S>, name_or_id: &str) -> Result<()> {
    let inner = &*img.inner;
    inner.check_snapshots_possible()?;
    // As QEMU: reverting the disk would leave every bitmap wrong (enabled or not).
    if !inner.bitmap_list().is_empty() {
        return Err(Error::InvalidOption(
            "Device has active dirty bitmaps".into(),
        ));
    }
    let _guard = inner.locks.lock(0, u64::MAX, true).await;
    let mut m = inner.meta.lock().await;
    inner.ensure_open(&m)?;
    let snaps = inner.read_snapshot_table(&m).await?;
    let i = find(&snaps, name_or_id).ok_or_else(|| Error::SnapshotNotFound {
        path: inner.shared.path.clone(),
        name: name_or_id.to_string(),
    })?;
    let sn = snaps[i].clone();
    let sn_l1 = inner.read_snapshot_l1(&sn).await?;
    inner.check_shareable(&sn_l1)?;
    inner.check_tree(&sn_l1).await?;
    let size = sn.disk_size().unwrap_or_else(|| inner.shared.size());
    let needed = inner.shared.geo.l1_size_for(size).map_err(|e| {
        Error::corrupt(
            &inner.shared.path,
            format!(
                "snapshot '{}' records a disk size of {size} bytes: {e}",
                fsnap::decode_text(&sn.id)
            ),
        )
    })?;
    if size != inner.shared.size() && inner.shared.version < 3 {
        return Err(Error::Unsupported {
            path: inner.shared.path.clone(),
            what: "a version 2 image whose snapshot has another disk size".into(),
        });
    }
    inner.shared.free_abandoned(&mut m).await?;
    inner.shared.flush_meta(&mut m).await?;
    m.set_compressed_tail(None);

    inner.tree_refcounts(&mut m, &sn_l1, 1).await?;
    inner.shared.write_back(&mut m, CacheKind::Refcount).await?;
    inner.shared.flush_file().await?;
    let len = (m.l1_len() as u64).max(sn_l1.len() as u64).max(needed);
    inner.shared.grow_l1(&mut m, len).await?;

    let old = m.l1().to_vec();
    let mut new: Vec<L1Entry> = sn_l1
        .iter()
        .map(|e| L1Entry {
            l2_offset: e.l2_offset,
            copied: false,
        })
        .collect();
    new.resize(old.len(), L1Entry::UNALLOCATED);
    inner.write_active_l1(&mut m, &new).await?;
    inner.shared.flush_file().await?;
    for e in &old {
        if let Some(t) = e.l2_offset {
            m.forget_l2_table(t.0, true);
        }
    }
    for e in &new {
        if let Some(t) = e.l2_offset {
            m.note_l2_table(t.0);
        }
    }
    let at = m.l1_offset();
    m.replace_l1(new, at);
    if size != inner.shared.size() {
        inner.write_size(size).await?;
    }
    inner.tree_refcounts(&mut m, &old, -1).await?;
    inner.shared.write_back(&mut m, CacheKind::Refcount).await?;
    inner.shared.flush_file().await?;
    inner.sync_copied(&mut m).await?;
    inner.shared.flush_meta(&mut m).await
}

/// The body of [`Image::view_snapshot`].
pub(crate) async fn view_snapshot<S: Storage>(
    img: &Image<S>,
    id: Option<&str>,
    name: Option<&str>,
) -> Result<()> {
    let inner = &*img.inner;
    if inner.shared.writable {
        return Err(Error::InvalidOption(format!(
            "{}: only a read-only image can show a snapshot in place of its disk",
            inner.shared.path.display()
        )));
    }
    let _guard = inner.locks.lock(0, u64::MAX, true).await;
    let mut m = inner.meta.lock().await;
    inner.ensure_open(&m)?;
    let snaps = inner.read_snapshot_table(&m).await?;
    let i = match (id, name) {
        (Some(i), Some(n)) if i == n => find(&snaps, i),
        (Some(i), Some(n)) => snaps
            .iter()
            .position(|s| s.id == i.as_bytes() && s.name == n.as_bytes()),
        (Some(i), None) => snaps.iter().position(|s| s.id == i.as_bytes()),
        (None, Some(n)) => snaps.iter().position(|s| s.name == n.as_bytes()),
        (None, None) => None,
    };
    let i = i.ok_or_else(|| Error::SnapshotNotFound {
        path: inner.shared.path.clone(),
        name: id.or(name).unwrap_or_default().to_string(),
    })?;
    let sn = snaps[i].clone();
    let sn_l1 = inner.read_snapshot_l1(&sn).await?;
    inner.check_tree(&sn_l1).await?;
    // As QEMU's `bdrv_snapshot_load_tmp`: the snapshot's table, the disk's current size
    // (past the snapshot's own size the disk reads as unallocated).
    let needed = inner
        .shared
        .geo
        .l1_size_for(inner.shared.size())
        .map_err(|e| Error::corrupt(&inner.shared.path, e.to_string()))?;
    let mut view: Vec<L1Entry> = sn_l1;
    view.truncate(needed as usize);
    if (view.len() as u64) < needed {
        view.resize(needed as usize, L1Entry::UNALLOCATED);
    }
    // L2 slices are cached by their place in the file, which the snapshot's tree shares
    // or does not use: the cache stays valid. Requests planned on the old table see the
    // new epoch and plan again.
    let at = m.l1_offset();
    m.replace_l1(view, at);
    Ok(())
}

/// The body of [`Image::delete_snapshot`].
pub(crate) async fn delete_snapshot<S: Storage>(img: &Image<S>, name_or_id: &str) -> Result<()> {
    let inner = &*img.inner;
    inner.check_snapshots_possible()?;
    let _guard = inner.locks.lock(0, u64::MAX, true).await;
    let mut m = inner.meta.lock().await;
    inner.ensure_open(&m)?;
    let snaps = inner.read_snapshot_table(&m).await?;
    let i = find(&snaps, name_or_id).ok_or_else(|| Error::SnapshotNotFound {
        path: inner.shared.path.clone(),
        name: name_or_id.to_string(),
    })?;
    let sn = snaps[i].clone();
    let sn_l1 = inner.read_snapshot_l1(&sn).await?;
    inner.check_tree(&sn_l1).await?;
    inner.shared.free_abandoned(&mut m).await?;
    inner.shared.flush_meta(&mut m).await?;
    m.set_compressed_tail(None);

    let mut rest = snaps.clone();
    rest.remove(i);
    inner.install_snapshot_table(&mut m, &snaps, &rest).await?;
    let cs = inner.shared.geo.cluster_size();
    let l1_bytes = l1::table_bytes(u64::from(sn.l1_size));
    if sn.l1_size > 0 {
        m.forget_metadata(Region::SnapshotL1, sn.l1_table_offset);
    }
    inner.tree_refcounts(&mut m, &sn_l1, -1).await?;
    if sn.l1_size > 0 && sn.l1_table_offset != 0 {
        let first = sn.l1_table_offset / cs * cs;
        let end = sn.l1_table_offset + l1_bytes;
        inner
            .shared
            .free_clusters(&mut m, first, (end - first).div_ceil(cs))
            .await?;
    }
    inner.shared.write_back(&mut m, CacheKind::Refcount).await?;
    inner.shared.flush_file().await?;
    inner.sync_copied(&mut m).await?;
    inner.shared.flush_meta(&mut m).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: &str, name: &str) -> Snapshot {
        Snapshot {
            l1_table_offset: 0,
            l1_size: 0,
            id: id.as_bytes().to_vec(),
            name: name.as_bytes().to_vec(),
            date_sec: 0,
            date_nsec: 0,
            vm_clock_nsec: 0,
            vm_state_size32: 0,
            extra_data: vec![0; 16],
        }
    }

    #[test]
    fn lookups_try_ids_before_names_and_take_the_first_name() {
        let snaps = [entry("1", "2"), entry("2", "a"), entry("7", "a")];
        assert_eq!(find(&snaps, "2"), Some(1));
        assert_eq!(find(&snaps, "a"), Some(1));
        assert_eq!(find(&snaps, "x"), None);
        assert_eq!(next_id(&snaps), "8");
        assert_eq!(next_id(&[entry("x", "y")]), "1");
    }

    #[test]
    fn the_size_checked_before_a_create_is_the_encoded_size() {
        for (id, name) in [("1", ""), ("12", "abc"), ("7", "a name of 21 bytes...")] {
            let mut e = entry(id, name);
            e.extra_data = vec![0; 24];
            let checked = (40 + 24 + id.len() + name.len()).next_multiple_of(8);
            assert_eq!(e.encoded_len(), checked);
        }
    }
}

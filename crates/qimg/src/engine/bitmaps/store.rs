//! Loading, storing and changing the bitmaps: the parts that read and write the file.

use std::sync::atomic::{AtomicU64, Ordering};

use qimg_format::bitmap::{
    self, BitmapEntry, BitmapsExtension, FLAG_AUTO, FLAG_IN_USE, MAX_GRANULARITY_BITS,
    TYPE_DIRTY_TRACKING, TableEntry,
};
use qimg_format::lenient::decode_words;
use qimg_format::validate::OpenMode;
use qimg_io::Storage;

use crate::engine::bitmap_set::{
    Bitmap, BitmapInfo, Bitmaps, DirtyBitmap, MAX_NAME, State, inconsistent, not_found,
};
use crate::engine::checkpoint::Action;
use crate::engine::image::Inner;
use crate::engine::meta::Meta;
use crate::engine::overlap::{Region, Writing};
use crate::engine::walk::{WalkError, Walker};
use crate::error::{Error, Result};

/// How QEMU's loader takes one entry of a bitmap directory ([`judge_bitmaps`]).
#[derive(Debug)]
pub(crate) enum Judged {
    /// Consistent and loadable: its table, every entry valid.
    Loads(Vec<TableEntry>),
    /// Marked in use (a writer did not store it): kept as it is; QEMU does not read its
    /// table.
    InUse,
    /// QEMU refuses to open the image because of it: why, in QEMU's words, then the value.
    Refused(String),
}

/// Judges every entry of a bitmap directory as QEMU's `qcow2_load_dirty_bitmaps` does when
/// it opens an image (read-only too): the entry's constraints, a name used twice, the table
/// size of a consistent bitmap and every entry of its table (read through `walker`; bytes
/// past the end of the file read as zeros, as QEMU's block layer returns them). The one
/// place these rules live: the engine's open and the check both call it.
pub(crate) async fn judge_bitmaps<S: Storage>(
    walker: &Walker<'_, S>,
    entries: &[BitmapEntry],
    cluster_size: u64,
    disk_size: u64,
) -> std::result::Result<Vec<Judged>, WalkError> {
    let mut out = Vec::with_capacity(entries.len());
    let mut names = std::collections::HashSet::new();
    for e in entries {
        let judged = if !names.insert(e.name.as_slice()) {
            Judged::Refused(format!(
                "Bitmap already exists: {}",
                String::from_utf8_lossy(&e.name)
            ))
        } else if let Some(why) = e.refusal(cluster_size, disk_size) {
            Judged::Refused(why)
        } else if e.flags & FLAG_IN_USE != 0 {
            Judged::InUse
        } else if let Some(why) = e.table_size_refusal(cluster_size, disk_size) {
            Judged::Refused(why)
        } else {
            let raw = walker
                .read_bitmap_table(e.table_offset, u64::from(e.table_size))
                .await?;
            let table: std::result::Result<Vec<TableEntry>, _> = raw
                .iter()
                .enumerate()
                .map(|(i, w)| TableEntry::decode(w.0, cluster_size, e.table_offset, i as u64))
                .collect();
            match table {
                Ok(t) => Judged::Loads(t),
                Err(err) => Judged::Refused(format!(
                    "Could not read bitmap_table table from image for bitmap '{}': {err}",
                    String::from_utf8_lossy(&e.name)
                )),
            }
        };
        out.push(judged);
    }
    Ok(out)
}

/// The file offset of each entry of a directory read at `dir_at`.
pub(crate) fn entry_offsets(entries: &[BitmapEntry], dir_at: u64) -> Vec<u64> {
    let mut at = dir_at;
    entries
        .iter()
        .map(|e| {
            let here = at;
            at += e.encoded_len() as u64;
            here
        })
        .collect()
}

impl<S: Storage> Inner<S> {
    /// Loads the bitmaps of an image opened for writing and marks them `in_use` on disk
    /// (read-write open, before any write). Refuses, naming the value and its offset, a
    /// bitmap QEMU would not load ([`judge_bitmaps`]). A read-only open judges them the same
    /// way and only lists them (`writable` false; their bits are read when asked for).
    pub(crate) async fn load_bitmaps(
        &self,
        m: &mut Meta,
        ext: &BitmapsExtension,
        writable: bool,
    ) -> Result<()> {
        let (dir_at, dir_len) = (ext.directory_offset, ext.directory_size);
        let mut dir = vec![0u8; dir_len as usize];
        self.shared
            .file
            .read_at(&mut dir, dir_at)
            .await
            .map_err(|e| self.shared.storage_error(e))?;
        let entries = bitmap::decode_directory(&dir, ext).map_err(|e| Error::Unsupported {
            path: self.shared.path.clone(),
            what: format!("{e}; `qimg check -r all` drops the bitmaps"),
        })?;
        let cs = self.shared.geo.cluster_size();
        let walker = self.walker().zero_fill(true);
        let judged = judge_bitmaps(&walker, &entries, cs, self.shared.size())
            .await
            .map_err(|e| self.walk_error(e))?;
        let offsets = entry_offsets(&entries, dir_at);
        // Crash-consistent bitmaps stay as they are on disk (see `live.rs`); otherwise, as
        // QEMU, they are marked in use until the close stores them.
        let live = writable && self.shared.bitmaps.crash_consistent();
        let mut list = Vec::with_capacity(entries.len());
        for ((entry, judged), at) in entries.into_iter().zip(judged).zip(offsets) {
            let mut b = Bitmap {
                entry,
                inconsistent: false,
                table: Vec::new(),
                words: Vec::new(),
                bits: 0,
                durable: Vec::new(),
            };
            match judged {
                Judged::Refused(why) => {
                    return Err(Error::Unsupported {
                        path: self.shared.path.clone(),
                        what: format!(
                            "{why} (bitmap directory entry at {at:#x}); `qimg check -r all` \
                             drops the bitmap"
                        ),
                    });
                }
                Judged::InUse => b.inconsistent = true,
                Judged::Loads(table) => {
                    if writable {
                        let (words, bits) = self.read_bitmap(&b.entry, &table).await?;
                        if live {
                            // What the disk holds is durable.
                            b.durable = words.iter().map(|&w| AtomicU64::new(w)).collect();
                        }
                        b.words = words.into_iter().map(AtomicU64::new).collect();
                        b.bits = bits;
                    }
                    b.table = table;
                }
            }
            list.push(b);
        }
        if writable {
            m.note_metadata(Region::BitmapDirectory, dir_at, dir_len);
        }
        if writable && !live {
            // In use from here on: a crash leaves them inconsistent, as QEMU's writer does.
            for b in list.iter_mut().filter(|b| !b.inconsistent) {
                b.entry.flags |= FLAG_IN_USE;
            }
            let entries: Vec<BitmapEntry> = list.iter().map(|b| b.entry.clone()).collect();
            self.write_directory(m, dir_at, &bitmap::encode_directory(&entries))
                .await?;
            self.shared.flush_file().await?;
        }
        let mut state = self.shared.bitmaps.write();
        state.disk = list.iter().map(|b| b.entry.clone()).collect();
        state.directory = Some((dir_at, dir_len));
        state.list = list;
        state.read_only = !writable;
        self.shared.bitmaps.note_recording(&state);
        Ok(())
    }

    /// Lets a read-write open of a version 3 image add bitmaps (QEMU stores none in v2).
    pub(crate) fn maintain_bitmaps(&self) {
        let mut state = self.shared.bitmaps.write();
        state.maintained = true;
    }

    /// Reads the bits of a bitmap [`judge_bitmaps`] found loadable, from its `table`.
    async fn read_bitmap(
        &self,
        entry: &BitmapEntry,
        table: &[TableEntry],
    ) -> Result<(Vec<u64>, u64)> {
        let cs = self.shared.geo.cluster_size();
        let bits = bitmap::bit_count(self.shared.size(), entry.granularity_bits);
        let mut words = vec![0u64; bits.div_ceil(64) as usize];
        let mut data = vec![0u8; cs as usize];
        for (t, e) in table.iter().enumerate() {
            match *e {
                TableEntry::Zeros => continue,
                TableEntry::Ones => data.fill(0xff),
                TableEntry::Data(at) => self
                    .shared
                    .file
                    .read_at(&mut data, at)
                    .await
                    .map_err(|e| self.shared.storage_error(e))?,
            }
            bitmap::bytes_to_words(&data, t * cs as usize, &mut words);
        }
        // Bits past the disk's end stay clear.
        if bits % 64 != 0 {
            if let Some(last) = words.last_mut() {
                *last &= (1u64 << (bits % 64)) - 1;
            }
        }
        Ok((words, bits))
    }

    /// The `entries` entries of the bitmap table at `at`, decoded (QEMU's checks).
    async fn read_bitmap_table(&self, at: u64, entries: u64) -> Result<Vec<TableEntry>> {
        let cs = self.shared.geo.cluster_size();
        let mut raw = vec![0u8; (entries * 8) as usize];
        self.shared
            .file
            .read_at(&mut raw, at)
            .await
            .map_err(|e| self.shared.storage_error(e))?;
        decode_words(&raw)
            .into_iter()
            .enumerate()
            .map(|(i, w)| TableEntry::decode(w, cs, at, i as u64))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| self.shared.fmt_err(e))
    }

    pub(super) async fn write_directory(&self, m: &mut Meta, at: u64, bytes: &[u8]) -> Result<()> {
        let own = Writing::Own(Region::BitmapDirectory, at);
        self.shared.write_guarded(m, at, bytes, own).await
    }

    /// Stores the bitmaps (close), as QEMU's `qcow2_store_persistent_dirty_bitmaps` lays
    /// them out: bitmaps removed since the open leave first (a new directory without them,
    /// as `qemu-img bitmap --remove` writes at once, then their clusters are freed); then
    /// each consistent bitmap, in directory order, gets new clusters for the data clusters
    /// that are not all clear and a new table (its exact bytes), then a new directory
    /// (`in_use` cleared) that the header names once all of it and its refcounts are
    /// durable; the old directory, tables and data clusters are freed last. A crash before
    /// the header switch leaves the old directory (bitmaps in use); after it, leaked
    /// clusters at worst. Inconsistent bitmaps are left as they are.
    pub(crate) async fn store_bitmaps(&self, m: &mut Meta) -> Result<()> {
        let cs = self.shared.geo.cluster_size();
        let (mut old_dir, mut list, removed) = {
            let mut state = self.shared.bitmaps.write();
            if state.read_only || (state.directory.is_none() && !state.reshaped) {
                return Ok(());
            }
            state.reshaped = false;
            (
                state.directory,
                std::mem::take(&mut state.list),
                std::mem::take(&mut state.removed),
            )
        };
        self.shared
            .bitmaps
            .recording
            .store(false, Ordering::Release);
        self.shared.bitmaps.changed.store(false, Ordering::Release);
        if !removed.is_empty() {
            // The directory without them, the bitmaps still there as on disk (in use).
            let entries: Vec<BitmapEntry> = list
                .iter()
                .map(|b| b.entry.clone())
                .filter(|e| !removed.iter().any(|r| r.name == e.name))
                .collect();
            let mut on_disk: Vec<BitmapEntry> = self.shared.bitmaps.read().disk.clone();
            on_disk.retain(|e| entries.iter().any(|k| k.name == e.name));
            old_dir = self.switch_directory(m, old_dir, &on_disk).await?;
            for gone in &removed {
                self.free_bitmap_table(m, gone.table_offset, gone.table_size)
                    .await?;
            }
            // Their clusters free for the bitmaps stored next, as after QEMU's removal.
            self.shared.flush_meta(m).await?;
        }
        let mut data = vec![0u8; cs as usize];
        let mut dropped: Vec<(u64, Vec<TableEntry>, u64)> = Vec::new();
        for b in list.iter_mut().filter(|b| !b.inconsistent) {
            let n = bitmap::table_entries(b.bits, cs) as usize;
            let words: Vec<u64> = b.words.iter().map(|w| w.load(Ordering::Relaxed)).collect();
            let mut table = Vec::with_capacity(n);
            for t in 0..n {
                bitmap::words_to_bytes(&words, t * cs as usize, &mut data);
                if data.iter().all(|&x| x == 0) {
                    table.push(TableEntry::Zeros);
                    continue;
                }
                let at = self.shared.alloc_clusters(m, 1).await?;
                self.shared
                    .write_guarded(m, at, &data, Writing::Data)
                    .await?;
                table.push(TableEntry::Data(at));
            }
            let bytes = bitmap::encode_table(&table);
            let at = self
                .shared
                .alloc_clusters(m, (bytes.len() as u64).div_ceil(cs).max(1))
                .await?;
            self.shared
                .write_guarded(m, at, &bytes, Writing::Data)
                .await?;
            if b.entry.table_offset != 0 {
                let old_clusters = (u64::from(b.entry.table_size) * 8).div_ceil(cs).max(1);
                let old = std::mem::take(&mut b.table);
                dropped.push((b.entry.table_offset, old, old_clusters));
            }
            b.entry.table_offset = at;
            b.entry.table_size = n as u32;
            b.entry.flags &= !FLAG_IN_USE;
            b.table = table;
        }
        let entries: Vec<BitmapEntry> = list.iter().map(|b| b.entry.clone()).collect();
        let new_dir = self.switch_directory(m, old_dir, &entries).await?;
        for (at, table, clusters) in dropped {
            for e in table {
                if let TableEntry::Data(o) = e {
                    self.shared.free_clusters(m, o, 1).await?;
                }
            }
            self.shared.free_clusters_as(m, at, clusters, false).await?;
        }
        let mut state = self.shared.bitmaps.write();
        state.disk = entries;
        state.list = list;
        state.directory = new_dir;
        Ok(())
    }

    /// QEMU's `update_ext_header_and_dir`: a new directory of `entries` (none: no extension),
    /// durable with every refcount before the header names it; then the old one is freed.
    async fn switch_directory(
        &self,
        m: &mut Meta,
        old_dir: Option<(u64, u64)>,
        entries: &[BitmapEntry],
    ) -> Result<Option<(u64, u64)>> {
        let cs = self.shared.geo.cluster_size();
        let new_dir = if entries.is_empty() {
            None
        } else {
            let dir = bitmap::encode_directory(entries);
            let at = self
                .shared
                .alloc_clusters(m, (dir.len() as u64).div_ceil(cs))
                .await?;
            self.shared
                .write_guarded(m, at, &dir, Writing::Data)
                .await?;
            Some((at, dir.len() as u64))
        };
        self.shared.flush_meta(m).await?;
        self.point_header_at_directory(new_dir, entries.len() as u32)
            .await?;
        if let Some((at, len)) = old_dir {
            m.forget_metadata(Region::BitmapDirectory, at);
            self.shared
                .free_clusters_as(m, at, len.div_ceil(cs), false)
                .await?;
        }
        if let Some((at, len)) = new_dir {
            m.note_metadata(Region::BitmapDirectory, at, len);
        }
        Ok(new_dir)
    }

    /// Frees a bitmap table of `entries` entries at `at` read from disk, and the data
    /// clusters it names (QEMU's `free_bitmap_clusters`: the data clusters punched, the
    /// table's bytes kept).
    async fn free_bitmap_table(&self, m: &mut Meta, at: u64, entries: u32) -> Result<()> {
        if at == 0 || entries == 0 {
            return Ok(());
        }
        let n = u64::from(entries);
        for e in self.read_bitmap_table(at, n).await? {
            if let TableEntry::Data(o) = e {
                self.shared.free_clusters(m, o, 1).await?;
            }
        }
        let clusters = (n * 8).div_ceil(self.shared.geo.cluster_size());
        self.shared.free_clusters_as(m, at, clusters, false).await
    }

    /// Rewrites the header cluster so that its bitmaps extension names the directory at
    /// `dir` (`(offset, size)`, `nb` bitmaps) with autoclear bit 0 set, or drops the
    /// extension and the bit (`None`), and makes it durable.
    pub(crate) async fn point_header_at_directory(
        &self,
        dir: Option<(u64, u64)>,
        nb: u32,
    ) -> Result<()> {
        let mut c0 = crate::engine::open::read_cluster0(
            &self.shared.file,
            &self.shared.path,
            OpenMode::ReadWrite,
        )
        .await?;
        c0.set_bitmaps(
            dir.map(|(directory_offset, directory_size)| BitmapsExtension {
                nb_bitmaps: nb,
                directory_size,
                directory_offset,
            }),
        );
        let bytes = c0.encode().map_err(|e| self.shared.fmt_err(e))?;
        self.shared
            .switch_header(&bytes, 0, || {
                "the switch of the header to a new bitmap directory failed".to_string()
            })
            .await
    }
}
impl<S: Storage> Inner<S> {
    /// The bitmaps in directory order (as on disk at open, with what this open changed).
    pub(crate) fn bitmap_list(&self) -> Vec<BitmapInfo> {
        let state = self.shared.bitmaps.read();
        state.list.iter().map(Bitmap::info).collect()
    }

    /// Bitmap `name`, or QEMU's "not found" refusal.
    pub(crate) fn bitmap_info(&self, name: &str) -> Result<BitmapInfo> {
        let state = self.shared.bitmaps.read();
        Ok(state.list[state.index(name)?].info())
    }

    /// Runs `change` on the consistent bitmap `name` of an image opened for writing.
    fn change_bitmap<T>(&self, name: &str, change: impl FnOnce(&mut Bitmap) -> T) -> Result<T> {
        self.shared.check_writable()?;
        let mut state = self.shared.bitmaps.write();
        let at = state.index(name)?;
        let b = &mut state.list[at];
        if b.inconsistent {
            return Err(inconsistent(name));
        }
        let out = change(b);
        if !state.list[at].enabled() {
            // Disabled: until the close stores that, a crash must not find it consistent
            // (the disk would claim it recorded what follows).
            Bitmaps::want_in_use(
                &mut state,
                name.as_bytes(),
                &self.shared.bitmaps.in_use_pending,
            );
        }
        self.shared.bitmaps.note_recording(&state);
        self.shared.bitmaps.changed.store(true, Ordering::Release);
        Ok(out)
    }

    /// Adds an empty bitmap (`qemu-img bitmap --add`): `granularity` defaults to the cluster
    /// size within 4 KiB..=64 KiB, as QEMU's; `enabled` records writes from now on.
    pub(crate) fn add_bitmap(
        &self,
        name: &str,
        granularity: Option<u64>,
        enabled: bool,
    ) -> Result<()> {
        self.shared.check_writable()?;
        let cs = self.shared.geo.cluster_size();
        let mut state = self.shared.bitmaps.write();
        let exists = state.list.iter().any(|b| b.named(name));
        let granularity_bits = self.check_new_bitmap(&state, name, exists, granularity)?;
        let bits = bitmap::bit_count(self.shared.size(), granularity_bits);
        let entries = bitmap::table_entries(bits, cs);
        state.list.push(Bitmap {
            entry: BitmapEntry {
                table_offset: 0,
                table_size: entries as u32,
                flags: if enabled { FLAG_AUTO } else { 0 },
                kind: TYPE_DIRTY_TRACKING,
                granularity_bits,
                extra_data: Vec::new(),
                name: name.as_bytes().to_vec(),
            },
            inconsistent: false,
            table: Vec::new(),
            words: (0..bits.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            bits,
            // Not on disk before the close stores it: a crash loses it (no bitmap is safe).
            durable: Vec::new(),
        });
        state.reshaped = true;
        self.shared.bitmaps.note_recording(&state);
        self.shared.bitmaps.changed.store(true, Ordering::Release);
        Ok(())
    }

    /// Every refusal of adding bitmap `name` (`exists`: one of that name is there), in
    /// QEMU's words; the granularity's bits otherwise.
    fn check_new_bitmap(
        &self,
        state: &State,
        name: &str,
        exists: bool,
        granularity: Option<u64>,
    ) -> Result<u8> {
        let cs = self.shared.geo.cluster_size();
        if exists {
            return Err(Error::InvalidOption(format!(
                "Bitmap already exists: {name}"
            )));
        }
        let g = granularity.unwrap_or(cs.clamp(4096, 65536));
        let max = 1u64 << MAX_GRANULARITY_BITS;
        if !g.is_power_of_two() || g < 512 || g > max {
            return Err(Error::InvalidOption(
                "Granularity must be power of 2 and at least 512".into(),
            ));
        }
        let persistent = |why: &str| {
            Error::InvalidOption(format!(
                "Can't make bitmap '{name}' persistent in '{}': {why}",
                self.shared.path.display()
            ))
        };
        if name.is_empty() {
            return Err(Error::InvalidOption("Bitmap name cannot be empty".into()));
        }
        if !state.maintained {
            return Err(persistent("Cannot store dirty bitmaps in qcow2 v2 files"));
        }
        if name.len() > MAX_NAME {
            return Err(persistent(&format!(
                "Name length exceeds maximum ({MAX_NAME} characters)"
            )));
        }
        if state.list.len() >= bitmap::MAX_BITMAPS as usize {
            return Err(persistent("Too many persistent bitmaps"));
        }
        Ok(g.trailing_zeros() as u8)
    }

    /// Refuses `actions` (those on bitmaps) as the bitmap operations would, each seeing the
    /// bitmaps as the actions before it leave them, without changing anything: a
    /// transaction applies its actions only once all of them passed.
    pub(crate) fn check_bitmap_actions(&self, actions: &[Action]) -> Result<()> {
        let state = self.shared.bitmaps.read();
        // (name, consistent) as the actions go.
        let mut names: Vec<(String, bool)> = state
            .list
            .iter()
            .map(|b| (b.info().name, !b.inconsistent))
            .collect();
        let usable = |names: &[(String, bool)], name: &str| -> Result<()> {
            match names.iter().find(|(n, _)| n == name) {
                None => Err(not_found(name)),
                Some((_, false)) => Err(inconsistent(name)),
                Some(_) => Ok(()),
            }
        };
        for a in actions {
            match a {
                Action::Snapshot { .. } => {}
                Action::AddBitmap {
                    name, granularity, ..
                } => {
                    self.shared.check_writable()?;
                    let exists = names.iter().any(|(n, _)| n == name);
                    self.check_new_bitmap(&state, name, exists, *granularity)?;
                    names.push((name.clone(), true));
                }
                Action::RemoveBitmap { name } => {
                    self.shared.check_writable()?;
                    if !names.iter().any(|(n, _)| n == name) {
                        return Err(not_found(name));
                    }
                    names.retain(|(n, _)| n != name);
                }
                Action::ClearBitmap { name } | Action::EnableBitmap { name, .. } => {
                    self.shared.check_writable()?;
                    usable(&names, name)?;
                }
                Action::MergeBitmaps { target, sources } => {
                    self.shared.check_writable()?;
                    usable(&names, target)?;
                    for s in sources {
                        usable(&names, s)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Removes bitmap `name` (inconsistent ones too); its clusters are freed at close.
    pub(crate) fn remove_bitmap(&self, name: &str) -> Result<()> {
        self.shared.check_writable()?;
        let mut state = self.shared.bitmaps.write();
        let at = state.index(name)?;
        let b = state.list.remove(at);
        state.removed.push(b.entry);
        state.reshaped = true;
        // Until the close drops it from the disk, a crash must not find it consistent.
        Bitmaps::want_in_use(
            &mut state,
            name.as_bytes(),
            &self.shared.bitmaps.in_use_pending,
        );
        self.shared.bitmaps.note_recording(&state);
        Ok(())
    }

    /// Clears every bit of bitmap `name`.
    pub(crate) fn clear_bitmap(&self, name: &str) -> Result<()> {
        self.change_bitmap(name, |b| {
            for w in &b.words {
                w.store(0, Ordering::Relaxed);
            }
        })
    }

    /// Enables (records writes) or disables bitmap `name`.
    pub(crate) fn enable_bitmap(&self, name: &str, enabled: bool) -> Result<()> {
        self.change_bitmap(name, |b| match enabled {
            true => b.entry.flags |= FLAG_AUTO,
            false => b.entry.flags &= !FLAG_AUTO,
        })
    }

    /// Sets in bitmap `name` every range `source` has set (granularities may differ: a
    /// coarser target marks whole granules).
    pub(crate) fn merge_bitmap(&self, name: &str, source: &DirtyBitmap) -> Result<()> {
        self.change_bitmap(name, |b| {
            let size = self.shared.size().min(source.size);
            for (at, len) in source.extents(0, size) {
                b.set(at, len);
            }
        })
    }

    /// Runs `f` on the consistent bitmap `name`, its bits in memory (a read-only open reads
    /// them from the file at the first use and keeps them: nothing changes them).
    async fn with_bits<T>(&self, name: &str, f: impl FnOnce(&Bitmap) -> T) -> Result<T> {
        let load = {
            let state = self.shared.bitmaps.read();
            let b = &state.list[state.index(name)?];
            if b.inconsistent {
                return Err(inconsistent(name));
            }
            (state.read_only && b.words.is_empty()).then(|| (b.entry.clone(), b.table.clone()))
        };
        if let Some((entry, table)) = load {
            let (words, bits) = self.read_bitmap(&entry, &table).await?;
            let mut state = self.shared.bitmaps.write();
            if let Ok(at) = state.index(name) {
                let b = &mut state.list[at];
                b.words = words.into_iter().map(AtomicU64::new).collect();
                b.bits = bits;
            }
        }
        let state = self.shared.bitmaps.read();
        let b = &state.list[state.index(name)?];
        Ok(f(b))
    }

    /// The bits of bitmap `name`.
    pub(crate) async fn dirty_bitmap(&self, name: &str) -> Result<DirtyBitmap> {
        let size = self.shared.size();
        self.with_bits(name, |b| DirtyBitmap {
            granularity: b.entry.granularity(),
            size,
            words: b.words.iter().map(|w| w.load(Ordering::Relaxed)).collect(),
        })
        .await
    }

    /// The dirty ranges of bitmap `name` within `[offset, offset + len)`, without copying
    /// the bitmap (what an NBD block status asks for).
    pub(crate) async fn bitmap_extents(
        &self,
        name: &str,
        offset: u64,
        len: u64,
    ) -> Result<Vec<(u64, u64)>> {
        let size = self.shared.size();
        self.with_bits(name, |b| {
            let word = |i: usize| b.words.get(i).map_or(0, |w| w.load(Ordering::Relaxed));
            crate::engine::bitmap_set::extents(word, b.entry.granularity(), size, offset, len)
        })
        .await
    }
}

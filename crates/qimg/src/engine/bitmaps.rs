//! Persistent dirty bitmaps kept by a writer, as QEMU keeps them.
//!
//! A read-write open loads every bitmap of the image (the bitmaps extension, autoclear bit 0
//! set). One already marked `in_use` is *inconsistent* (its writer did not store it): it is
//! kept exactly as it is, never recorded into. The others are loaded into memory, and before
//! the first write the directory marks them all `in_use` on disk, so that a crash leaves them
//! inconsistent, as QEMU's writer does. Enabled (`auto`) bitmaps record every write,
//! write-zeroes and discard at their granularity ([`Bitmaps::mark`], called by every write
//! path before it changes anything); disabled ones are kept unchanged. Closing stores them:
//! the data clusters (an all-clear cluster needs none), the tables, then the directory with
//! `in_use` cleared.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use qimg_format::bitmap::{
    self, BitmapEntry, BitmapsExtension, FLAG_AUTO, FLAG_IN_USE, MAX_DATA_BYTES,
    MAX_GRANULARITY_BITS, MAX_TABLE_ENTRIES, MIN_GRANULARITY_BITS, TYPE_DIRTY_TRACKING, TableEntry,
};
use qimg_format::lenient::decode_words;
use qimg_io::Storage;

use super::image::Inner;
use super::meta::Meta;
use super::overlap::{Region, Writing};
use crate::error::{Error, Result};

/// A bitmap table on disk: `(offset, entries)`.
pub(crate) type Table = (u64, u64);

/// The bitmaps of an image opened for writing.
#[derive(Debug, Default)]
pub(crate) struct Bitmaps {
    state: std::sync::RwLock<State>,
    /// Whether any bitmap records writes: checked without the lock on every write.
    recording: AtomicBool,
    /// Whether any bit may have changed since the open (a write was recorded, or a resize):
    /// without, closing only clears `in_use`.
    changed: AtomicBool,
}

#[derive(Debug, Default)]
struct State {
    /// The directory on disk: `(offset, size)`.
    directory: Option<(u64, u64)>,
    list: Vec<Bitmap>,
}

/// One bitmap of the directory.
#[derive(Debug)]
struct Bitmap {
    /// The directory entry as on disk (flags included).
    entry: BitmapEntry,
    /// `in_use` at open: kept as it is, never recorded into or stored.
    inconsistent: bool,
    /// The table entries as on disk (empty for an inconsistent bitmap).
    table: Vec<TableEntry>,
    /// The bits: bit `n` is bit `n % 64` of word `n / 64` (empty for an inconsistent one).
    words: Vec<AtomicU64>,
    /// How many bits the bitmap has.
    bits: u64,
}

impl Bitmap {
    fn enabled(&self) -> bool {
        !self.inconsistent && self.entry.flags & FLAG_AUTO != 0
    }

    /// Sets the bits of the granules `[offset, offset + len)` touches.
    fn set(&self, offset: u64, len: u64) {
        let g = u32::from(self.entry.granularity_bits);
        let first = offset >> g;
        let end = (((offset + len - 1) >> g) + 1).min(self.bits);
        let mut n = first;
        while n < end {
            let word = (n / 64) as usize;
            let lo = n % 64;
            let hi = (end - n + lo).min(64);
            let mask = if hi - lo == 64 {
                u64::MAX
            } else {
                ((1u64 << (hi - lo)) - 1) << lo
            };
            self.words[word].fetch_or(mask, Ordering::Relaxed);
            n += hi - lo;
        }
    }
}

impl Bitmaps {
    /// Follows a resize of the disk to `size` bytes: bits past the old end start clear, bits
    /// past the new end are dropped (as QEMU resizes its bitmaps).
    pub(crate) fn resize(&self, size: u64) {
        self.changed.store(true, Ordering::Release);
        let mut state = self.state.write().unwrap_or_else(|e| e.into_inner());
        for b in state.list.iter_mut().filter(|b| !b.inconsistent) {
            let bits = bitmap::bit_count(size, b.entry.granularity_bits);
            let mut words: Vec<u64> = b.words.iter().map(|w| w.load(Ordering::Relaxed)).collect();
            words.resize(bits.div_ceil(64) as usize, 0);
            if bits % 64 != 0 {
                if let Some(last) = words.last_mut() {
                    *last &= (1u64 << (bits % 64)) - 1;
                }
            }
            b.words = words.into_iter().map(AtomicU64::new).collect();
            b.bits = bits;
        }
    }

    /// Where the loaded directory is and each bitmap's table `(offset, entries)`, as on disk
    /// (for counting references when refcounts are rebuilt).
    pub(crate) fn layout(&self) -> (Option<(u64, u64)>, Vec<Table>) {
        let state = self.state.read().unwrap_or_else(|e| e.into_inner());
        let tables = state
            .list
            .iter()
            .map(|b| (b.entry.table_offset, u64::from(b.entry.table_size)))
            .collect();
        (state.directory, tables)
    }

    /// Records a write, write-zeroes or discard of `[offset, offset + len)` in every enabled
    /// bitmap. Every path that changes guest data calls this before it changes anything.
    pub(crate) fn mark(&self, offset: u64, len: u64) {
        if len == 0 || !self.recording.load(Ordering::Acquire) {
            return;
        }
        self.changed.store(true, Ordering::Release);
        let state = self.state.read().unwrap_or_else(|e| e.into_inner());
        for b in state.list.iter().filter(|b| b.enabled()) {
            b.set(offset, len);
        }
    }
}

impl<S: Storage> Inner<S> {
    /// Loads the bitmaps of an image opened for writing and marks them `in_use` on disk
    /// (read-write open, before any write). Refuses, naming the value and its offset, a
    /// bitmap QEMU would not load.
    pub(crate) async fn load_bitmaps(&self, m: &mut Meta, ext: &BitmapsExtension) -> Result<()> {
        let cs = self.geo.cluster_size();
        let (dir_at, dir_len) = (ext.directory_offset, ext.directory_size);
        let mut dir = vec![0u8; dir_len as usize];
        self.file
            .read_at(&mut dir, dir_at)
            .await
            .map_err(|e| self.storage_error(e))?;
        let entries = bitmap::decode_directory(&dir, ext).map_err(|e| self.fmt_err(e))?;
        let size = self.size();
        let mut list = Vec::with_capacity(entries.len());
        for entry in entries {
            let name = String::from_utf8_lossy(&entry.name).into_owned();
            if entry.flags & FLAG_IN_USE != 0 {
                list.push(Bitmap {
                    entry,
                    inconsistent: true,
                    table: Vec::new(),
                    words: Vec::new(),
                    bits: 0,
                });
                continue;
            }
            let refuse = |what: String| Error::Unsupported {
                path: self.path.clone(),
                what: format!("bitmap '{name}' (directory at {dir_at:#x}): {what}"),
            };
            if entry.kind != TYPE_DIRTY_TRACKING {
                return Err(refuse(format!("unknown type {}", entry.kind)));
            }
            let g = entry.granularity_bits;
            if !(MIN_GRANULARITY_BITS..=MAX_GRANULARITY_BITS).contains(&g) {
                return Err(refuse(format!(
                    "granularity_bits {g} is outside {MIN_GRANULARITY_BITS}..={MAX_GRANULARITY_BITS}"
                )));
            }
            let bits = bitmap::bit_count(size, g);
            let want = bitmap::table_entries(bits, cs);
            if u64::from(entry.table_size) != want {
                return Err(refuse(format!(
                    "its table has {} entries where a {size}-byte disk needs {want}",
                    entry.table_size
                )));
            }
            if want > MAX_TABLE_ENTRIES || bitmap::data_bytes(bits) > MAX_DATA_BYTES {
                return Err(refuse(format!(
                    "{} bytes of bitmap data exceed QEMU's limit of {MAX_DATA_BYTES}",
                    bitmap::data_bytes(bits)
                )));
            }
            if entry.table_offset % cs != 0 || (want > 0 && entry.table_offset == 0) {
                return Err(refuse(format!(
                    "its table offset {:#x} is not a cluster",
                    entry.table_offset
                )));
            }
            let mut raw = vec![0u8; (want * 8) as usize];
            self.file
                .read_at(&mut raw, entry.table_offset)
                .await
                .map_err(|e| self.storage_error(e))?;
            let table = decode_words(&raw)
                .into_iter()
                .enumerate()
                .map(|(i, w)| TableEntry::decode(w, cs, entry.table_offset, i as u64))
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| self.fmt_err(e))?;
            let mut words = vec![0u64; bits.div_ceil(64) as usize];
            let mut data = vec![0u8; cs as usize];
            for (t, e) in table.iter().enumerate() {
                let first = t * cs as usize;
                match *e {
                    TableEntry::Zeros => continue,
                    TableEntry::Ones => data.fill(0xff),
                    TableEntry::Data(at) => self
                        .file
                        .read_at(&mut data, at)
                        .await
                        .map_err(|e| self.storage_error(e))?,
                }
                bitmap::bytes_to_words(&data, first, &mut words);
            }
            // Bits past the disk's end stay clear.
            if bits % 64 != 0 {
                if let Some(last) = words.last_mut() {
                    *last &= (1u64 << (bits % 64)) - 1;
                }
            }
            list.push(Bitmap {
                entry,
                inconsistent: false,
                table,
                words: words.into_iter().map(AtomicU64::new).collect(),
                bits,
            });
        }
        m.overlap.insert(Region::BitmapDirectory, dir_at, dir_len);
        // In use from here on: a crash leaves them inconsistent, as QEMU's writer does.
        for b in list.iter_mut().filter(|b| !b.inconsistent) {
            b.entry.flags |= FLAG_IN_USE;
        }
        let entries: Vec<BitmapEntry> = list.iter().map(|b| b.entry.clone()).collect();
        self.write_directory(m, dir_at, &bitmap::encode_directory(&entries))
            .await?;
        self.file.flush().await.map_err(|e| self.storage_error(e))?;
        let recording = list.iter().any(Bitmap::enabled);
        let mut state = self
            .bitmaps
            .state
            .write()
            .unwrap_or_else(|e| e.into_inner());
        *state = State {
            directory: Some((dir_at, dir_len)),
            list,
        };
        self.bitmaps.recording.store(recording, Ordering::Release);
        Ok(())
    }

    async fn write_directory(&self, m: &mut Meta, at: u64, bytes: &[u8]) -> Result<()> {
        let own = Writing::Own(Region::BitmapDirectory, at);
        self.guard_write(m, at, bytes.len() as u64, own).await?;
        self.file
            .write_at(bytes, at)
            .await
            .map_err(|e| self.storage_error(e))
    }

    /// Stores the loaded bitmaps (close): each one's data clusters (an all-clear cluster needs
    /// none) and table, durable, then the directory with `in_use` cleared; then frees what
    /// the old tables held and the new ones do not. Inconsistent bitmaps are left as they are.
    pub(crate) async fn store_bitmaps(&self, m: &mut Meta) -> Result<()> {
        let cs = self.geo.cluster_size();
        let (dir_at, mut list) = {
            let mut state = self
                .bitmaps
                .state
                .write()
                .unwrap_or_else(|e| e.into_inner());
            let Some((at, _)) = state.directory else {
                return Ok(());
            };
            (at, std::mem::take(&mut state.list))
        };
        self.bitmaps.recording.store(false, Ordering::Release);
        let changed = self.bitmaps.changed.swap(false, Ordering::AcqRel);
        let mut to_free: Vec<(u64, u64)> = Vec::new();
        let mut data = vec![0u8; cs as usize];
        for b in list.iter_mut().filter(|b| !b.inconsistent) {
            if !changed {
                // As loaded: only `in_use` goes.
                b.entry.flags &= !FLAG_IN_USE;
                continue;
            }
            let n = bitmap::table_entries(b.bits, cs) as usize;
            let words: Vec<u64> = b.words.iter().map(|w| w.load(Ordering::Relaxed)).collect();
            let mut table = Vec::with_capacity(n);
            for t in 0..n {
                bitmap::words_to_bytes(&words, t * cs as usize, &mut data);
                let old = b.table.get(t).copied().unwrap_or(TableEntry::Zeros);
                if data.iter().all(|&x| x == 0) {
                    if let TableEntry::Data(o) = old {
                        to_free.push((o, 1));
                    }
                    table.push(TableEntry::Zeros);
                    continue;
                }
                let at = match old {
                    TableEntry::Data(o) => o,
                    _ => self.alloc_clusters(m, 1).await?,
                };
                self.guard_write(m, at, cs, Writing::Data).await?;
                self.file
                    .write_at(&data, at)
                    .await
                    .map_err(|e| self.storage_error(e))?;
                table.push(TableEntry::Data(at));
            }
            for old in b.table.iter().skip(n) {
                if let TableEntry::Data(o) = *old {
                    to_free.push((o, 1));
                }
            }
            let bytes = bitmap::encode_table(&table);
            let clusters = (bytes.len() as u64).div_ceil(cs);
            let old_clusters = (u64::from(b.entry.table_size) * 8).div_ceil(cs);
            let table_at = if b.entry.table_offset != 0 && clusters == old_clusters {
                b.entry.table_offset
            } else {
                if b.entry.table_offset != 0 && old_clusters > 0 {
                    to_free.push((b.entry.table_offset, old_clusters));
                }
                self.alloc_clusters(m, clusters.max(1)).await?
            };
            self.guard_write(m, table_at, bytes.len() as u64, Writing::Data)
                .await?;
            self.file
                .write_at(&bytes, table_at)
                .await
                .map_err(|e| self.storage_error(e))?;
            b.entry.table_offset = table_at;
            b.entry.table_size = n as u32;
            b.entry.flags &= !FLAG_IN_USE;
            b.table = table;
        }
        // Data, tables and their refcounts durable before the directory names them.
        self.flush_meta(m).await?;
        let entries: Vec<BitmapEntry> = list.iter().map(|b| b.entry.clone()).collect();
        self.write_directory(m, dir_at, &bitmap::encode_directory(&entries))
            .await?;
        self.file.flush().await.map_err(|e| self.storage_error(e))?;
        for (at, n) in to_free {
            self.free_clusters(m, at, n).await?;
        }
        let mut state = self
            .bitmaps
            .state
            .write()
            .unwrap_or_else(|e| e.into_inner());
        state.list = list;
        Ok(())
    }
}

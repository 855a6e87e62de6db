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

use qimg_format::bitmap::{self, BitmapEntry, FLAG_AUTO, TableEntry};

use crate::error::Error;

mod store;

pub(crate) use store::{Judged, entry_offsets, judge_bitmaps};

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
    /// A read-write open of a version 3 image: bitmaps can be added and are stored at close.
    maintained: bool,
    /// Bitmaps removed since the open (their clusters are freed when the directory no
    /// longer names them).
    removed: Vec<BitmapEntry>,
    /// Bitmaps were added or removed: the directory is written anew at close.
    reshaped: bool,
    /// A read-only open: bits are read from the file when asked for.
    read_only: bool,
}

impl State {
    /// Where bitmap `name` is in the list, or QEMU's "not found" refusal.
    fn index(&self, name: &str) -> crate::error::Result<usize> {
        self.list
            .iter()
            .position(|b| b.named(name))
            .ok_or_else(|| not_found(name))
    }
}

/// One persistent dirty bitmap, as [`Image::bitmaps`](crate::Image::bitmaps) lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BitmapInfo {
    /// Its name.
    pub name: String,
    /// Bytes of guest data one bit covers.
    pub granularity: u64,
    /// Whether it records writes (QEMU's `auto` flag).
    pub enabled: bool,
    /// Marked in use when the image was opened: its last writer did not store it (it
    /// crashed), so it may have missed writes. It is kept as it is and can only be removed.
    pub inconsistent: bool,
}

/// The bits of one bitmap (see [`Image::dirty_bitmap`](crate::Image::dirty_bitmap)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirtyBitmap {
    /// Bytes of guest data one bit covers.
    pub granularity: u64,
    /// The disk size the bitmap covers.
    pub size: u64,
    /// Bit `n` (bit `n % 64` of word `n / 64`) set: guest bytes `[n * granularity, (n + 1) *
    /// granularity)` changed.
    pub words: Vec<u64>,
}

impl DirtyBitmap {
    /// The dirty ranges `(offset, length)` within `[offset, offset + len)`, merged, clipped
    /// to the range and to the disk.
    pub fn extents(&self, offset: u64, len: u64) -> Vec<(u64, u64)> {
        let word = |i: usize| self.words.get(i).copied().unwrap_or(0);
        extents(word, self.granularity, self.size, offset, len)
    }
}

/// The dirty ranges within `[offset, offset + len)` of a bitmap whose word `i` is `word(i)`.
fn extents(
    word: impl Fn(usize) -> u64,
    granularity: u64,
    size: u64,
    offset: u64,
    len: u64,
) -> Vec<(u64, u64)> {
    let end = offset.saturating_add(len).min(size);
    let g = granularity;
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut n = offset / g;
    while n * g < end {
        let word = word((n / 64) as usize);
        if word == 0 && n % 64 == 0 {
            n += 64;
            continue;
        }
        if word >> (n % 64) & 1 == 1 {
            let (a, b) = ((n * g).max(offset), ((n + 1) * g).min(end));
            match out.last_mut() {
                Some(last) if last.0 + last.1 == a => last.1 += b - a,
                _ => out.push((a, b - a)),
            }
        }
        n += 1;
    }
    out
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
    fn info(&self) -> BitmapInfo {
        BitmapInfo {
            name: String::from_utf8_lossy(&self.entry.name).into_owned(),
            granularity: self.entry.granularity(),
            enabled: self.entry.flags & FLAG_AUTO != 0,
            inconsistent: self.inconsistent,
        }
    }

    fn named(&self, name: &str) -> bool {
        self.entry.name == name.as_bytes()
    }

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
    fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Notes whether any bitmap of `state` records writes (what [`mark`](Self::mark) checks
    /// before taking the lock).
    fn note_recording(&self, state: &State) {
        let on = state.list.iter().any(Bitmap::enabled);
        self.recording.store(on, Ordering::Release);
    }

    /// Follows a resize of the disk to `size` bytes: bits past the old end start clear, bits
    /// past the new end are dropped (as QEMU resizes its bitmaps).
    pub(crate) fn resize(&self, size: u64) {
        self.changed.store(true, Ordering::Release);
        let mut state = self.write();
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
        let state = self.read();
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
        let state = self.read();
        for b in state.list.iter().filter(|b| b.enabled()) {
            b.set(offset, len);
        }
    }
}

// QEMU's limit on a bitmap name's length.
use qimg_format::bitmap::MAX_NAME_BYTES as MAX_NAME;

/// QEMU's refusal of an inconsistent bitmap, with its hint.
fn inconsistent(name: &str) -> Error {
    Error::InvalidOption(format!(
        "Bitmap '{name}' is inconsistent and cannot be used\n\
         Try block-dirty-bitmap-remove to delete this bitmap from disk"
    ))
}

fn not_found(name: &str) -> Error {
    Error::InvalidOption(format!("Dirty bitmap '{name}' not found"))
}

//! The dirty bitmaps of an image opened for writing, in memory: which bitmaps there are, their
//! bits, what is durable on disk, and the group commit's bookkeeping. The engine's
//! `bitmaps` module loads, stores and keeps them consistent on disk; this one holds no I/O,
//! so that the image's shared state can own it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use qimg_format::bitmap::{self, BitmapEntry, FLAG_AUTO, FLAG_IN_USE, TableEntry};

use crate::error::Error;

/// A bitmap table on disk: `(offset, entries)`.
pub(crate) type Table = (u64, u64);

/// The bitmaps of an image opened for writing.
#[derive(Debug, Default)]
pub(crate) struct Bitmaps {
    pub(super) state: std::sync::RwLock<State>,
    /// Whether any bitmap records writes: checked without the lock on every write.
    pub(super) recording: AtomicBool,
    /// Whether any bit may have changed since the open (a write was recorded, or a resize):
    /// without, closing only clears `in_use`.
    pub(super) changed: AtomicBool,
    /// Keep the bitmaps on disk consistent while writing (see `live.rs`); set before the
    /// read-write open loads them.
    pub(super) crash_consistent: AtomicBool,
    /// The group commit of durable bits: one at a time.
    pub(super) sync: tokio::sync::Mutex<Commits>,
    /// Guest ranges whose bits wait for the next durable write.
    pub(super) pending: std::sync::Mutex<Vec<(u64, u64)>>,
    /// Some crash-consistent bitmaps must be marked `in_use` on disk before the next write.
    pub(super) in_use_pending: AtomicBool,
    /// Bumped by every change of which bitmaps record or of their bits other than by a
    /// write (add, remove, enable, disable, clear, merge): a write that recorded itself
    /// before such a change and runs after it records itself again (see
    /// [`Inner::recorded`](crate::engine::image::Inner)).
    pub(super) epoch: AtomicU64,
}

#[derive(Debug, Default)]
pub(super) struct State {
    /// The directory on disk: `(offset, size)`.
    pub(super) directory: Option<(u64, u64)>,
    pub(super) list: Vec<Bitmap>,
    /// A read-write open of a version 3 image: bitmaps can be added and are stored at close.
    pub(super) maintained: bool,
    /// Bitmaps removed since the open (their clusters are freed when the directory no
    /// longer names them).
    pub(super) removed: Vec<BitmapEntry>,
    /// Bitmaps were added or removed: the directory is written anew at close.
    pub(super) reshaped: bool,
    /// A read-only open: bits are read from the file when asked for.
    pub(super) read_only: bool,
    /// The directory entries as on disk (flags included), for marking some `in_use` in place.
    pub(super) disk: Vec<BitmapEntry>,
    /// Names of crash-consistent bitmaps to mark `in_use` on disk before the next write.
    pub(super) in_use_wanted: Vec<Vec<u8>>,
}

impl State {
    /// Where bitmap `name` is in the list, or QEMU's "not found" refusal.
    pub(super) fn index(&self, name: &str) -> crate::error::Result<usize> {
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
pub(super) fn extents(
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
pub(super) struct Bitmap {
    /// The directory entry as on disk (flags included).
    pub(super) entry: BitmapEntry,
    /// `in_use` at open: kept as it is, never recorded into or stored.
    pub(super) inconsistent: bool,
    /// The table entries as on disk (empty for an inconsistent bitmap).
    pub(super) table: Vec<TableEntry>,
    /// The bits: bit `n` is bit `n % 64` of word `n / 64` (empty for an inconsistent one).
    pub(super) words: Vec<AtomicU64>,
    /// How many bits the bitmap has.
    pub(super) bits: u64,
    /// For a crash-consistent bitmap (empty otherwise): the bits known set on disk, which
    /// include every bit of `words` a write depends on.
    pub(super) durable: Vec<AtomicU64>,
}

impl Bitmap {
    pub(super) fn info(&self) -> BitmapInfo {
        BitmapInfo {
            name: String::from_utf8_lossy(&self.entry.name).into_owned(),
            granularity: self.entry.granularity(),
            enabled: self.entry.flags & FLAG_AUTO != 0,
            inconsistent: self.inconsistent,
        }
    }

    pub(super) fn named(&self, name: &str) -> bool {
        self.entry.name == name.as_bytes()
    }

    pub(super) fn enabled(&self) -> bool {
        !self.inconsistent && self.entry.flags & FLAG_AUTO != 0
    }

    /// Kept consistent on disk while the image is written.
    pub(super) fn live(&self) -> bool {
        !self.durable.is_empty()
    }

    /// The granules `[first, end)` that `[offset, offset + len)` touches.
    pub(super) fn granules(&self, offset: u64, len: u64) -> (u64, u64) {
        let g = u32::from(self.entry.granularity_bits);
        (offset >> g, (((offset + len - 1) >> g) + 1).min(self.bits))
    }

    /// Whether every granule `[offset, offset + len)` touches has its bit durable on disk.
    pub(super) fn durable_covers(&self, offset: u64, len: u64) -> bool {
        let (mut n, end) = self.granules(offset, len);
        while n < end {
            let lo = n % 64;
            let hi = (end - n + lo).min(64);
            let mask = mask(lo, hi);
            let word = self.durable[(n / 64) as usize].load(Ordering::Acquire);
            if word & mask != mask {
                return false;
            }
            n += hi - lo;
        }
        true
    }

    /// Sets the bits of the granules `[offset, offset + len)` touches.
    pub(super) fn set(&self, offset: u64, len: u64) {
        let (mut n, end) = self.granules(offset, len);
        while n < end {
            let lo = n % 64;
            let hi = (end - n + lo).min(64);
            self.words[(n / 64) as usize].fetch_or(mask(lo, hi), Ordering::Relaxed);
            n += hi - lo;
        }
    }
}

/// Bits `[lo, hi)` of a word (`hi` at most 64).
pub(super) fn mask(lo: u64, hi: u64) -> u64 {
    if hi - lo == 64 {
        u64::MAX
    } else {
        ((1u64 << (hi - lo)) - 1) << lo
    }
}

impl Bitmaps {
    pub(super) fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn write(&self) -> std::sync::RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Notes whether any bitmap of `state` records writes (what [`mark`](Self::mark) checks
    /// before taking the lock).
    pub(super) fn note_recording(&self, state: &State) {
        let on = state.list.iter().any(Bitmap::enabled);
        self.recording.store(on, Ordering::Release);
        self.epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// The current epoch: read it before [`mark`](Self::mark), compare it with
    /// [`still_current`](Self::still_current) once the request holds its range lock.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Whether no bitmap changed (other than by writes) since `epoch` was read: a write
    /// that recorded itself at `epoch` and now holds its range lock is recorded in the
    /// bitmaps as they are. When false it must record itself again before it changes
    /// anything; a change of the bitmaps that holds every range lock (a checkpoint, see
    /// [`Image::transaction`](crate::Image::transaction)) then sees every write either
    /// finished before it or recorded after it.
    pub(crate) fn still_current(&self, epoch: u64) -> bool {
        self.epoch() == epoch
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
    /// bitmap, in memory. Returns whether that is enough: false when a crash-consistent
    /// bitmap's bit is not durable yet or some bitmaps wait to be marked `in_use` on disk
    /// (then [`Inner::record_change`](crate::engine::image::Inner) must finish the job before
    /// the write; the queue's direct path hands such a write to the engine).
    pub(crate) fn mark(&self, offset: u64, len: u64) -> bool {
        let pending = self.in_use_pending.load(Ordering::Acquire);
        if len == 0 || !self.recording.load(Ordering::Acquire) {
            return !pending;
        }
        self.changed.store(true, Ordering::Release);
        let state = self.read();
        let mut durable = !pending;
        for b in state.list.iter().filter(|b| b.enabled()) {
            b.set(offset, len);
            if durable && b.live() && !b.durable_covers(offset, len) {
                durable = false;
            }
        }
        durable
    }

    /// Uses crash-consistent bitmaps (set before the read-write open loads them).
    pub(crate) fn set_crash_consistent(&self, on: bool) {
        self.crash_consistent.store(on, Ordering::Release);
    }

    /// Whether the bitmaps are kept consistent on disk while writing.
    pub(crate) fn crash_consistent(&self) -> bool {
        self.crash_consistent.load(Ordering::Acquire)
    }

    pub(super) fn push_pending(&self, offset: u64, len: u64) {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        p.push((offset, len));
    }

    pub(super) fn take_pending(&self) -> Vec<(u64, u64)> {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::take(&mut *p)
    }

    /// Whether every enabled crash-consistent bitmap has the bits of the range durable.
    pub(super) fn durable_covers(&self, offset: u64, len: u64) -> bool {
        if len == 0 {
            return true;
        }
        let state = self.read();
        state
            .list
            .iter()
            .filter(|b| b.enabled() && b.live())
            .all(|b| b.durable_covers(offset, len))
    }

    /// What bitmap `name`'s words `[first, end)` are to be on disk: the bits in memory and
    /// those already durable, with every bit of the words of `set` (ranges of word indices)
    /// set (past the bitmap's last bit, clear). `None` when the bitmap is gone or no longer
    /// kept consistent.
    pub(super) fn disk_words(
        &self,
        name: &str,
        first: usize,
        end: usize,
        set: &[(usize, usize)],
    ) -> Option<Vec<u64>> {
        let state = self.read();
        let b = &state.list[state.index(name).ok()?];
        if !b.live() {
            return None;
        }
        let last_word = (b.bits / 64) as usize;
        let tail = if b.bits % 64 == 0 {
            0
        } else {
            mask(0, b.bits % 64)
        };
        let words = (first..end)
            .map(|i| {
                let ones = if i < last_word {
                    u64::MAX
                } else if i == last_word {
                    tail
                } else {
                    0
                };
                let all = set.iter().any(|&(a, z)| (a..z).contains(&i));
                match (b.words.get(i), b.durable.get(i)) {
                    _ if all => ones,
                    (Some(w), Some(d)) => w.load(Ordering::Relaxed) | d.load(Ordering::Relaxed),
                    _ => 0,
                }
            })
            .collect();
        Some(words)
    }

    /// Notes bitmap `name`'s words from `first` durable on disk as `words`.
    pub(super) fn note_durable(&self, name: &str, first: usize, words: &[u64]) {
        let state = self.read();
        let Ok(i) = state.index(name) else {
            return;
        };
        let b = &state.list[i];
        for (k, w) in words.iter().enumerate() {
            if let Some(d) = b.durable.get(first + k) {
                d.fetch_or(*w, Ordering::Release);
            }
        }
    }

    /// Asks for crash-consistent bitmap `name` to be marked `in_use` on disk before the next
    /// write (it was disabled or removed: the disk would claim it records).
    pub(super) fn want_in_use(state: &mut State, name: &[u8], flag: &AtomicBool) {
        let on_disk = state
            .disk
            .iter()
            .any(|e| e.name == name && !in_use(e.flags) && e.flags & FLAG_AUTO != 0);
        let live = state.list.iter().any(|b| b.entry.name == name && b.live())
            || state.removed.iter().any(|e| e.name == name);
        if on_disk && live && !state.in_use_wanted.iter().any(|n| n == name) {
            state.in_use_wanted.push(name.to_vec());
            flag.store(true, Ordering::Release);
        }
    }

    /// Before a resize: every crash-consistent bitmap.
    pub(super) fn want_all_in_use(&self) {
        let mut state = self.write();
        let names: Vec<Vec<u8>> = state
            .list
            .iter()
            .filter(|b| b.live())
            .map(|b| b.entry.name.clone())
            .collect();
        for n in names {
            Self::want_in_use(&mut state, &n, &self.in_use_pending);
        }
    }

    /// The directory as on disk with `in_use` set for the bitmaps asked for, and where it is.
    pub(super) fn disk_directory_with_in_use(&self) -> Option<(u64, Vec<BitmapEntry>)> {
        let state = self.read();
        let (at, _) = state.directory?;
        let entries = state
            .disk
            .iter()
            .map(|e| {
                let mut e = e.clone();
                if state.in_use_wanted.contains(&e.name) {
                    e.flags |= qimg_format::bitmap::FLAG_IN_USE;
                }
                e
            })
            .collect();
        Some((at, entries))
    }

    /// After [`Inner::persist_bitmaps`](crate::engine::image::Inner) stored the bitmaps
    /// (`ok`): each consistent one is on disk exactly as in memory, not `in_use`, so it is
    /// kept crash-consistent from here (its durable bits are its bits). Recording resumes
    /// either way.
    pub(super) fn stored(&self, ok: bool) {
        let mut state = self.write();
        if ok {
            state.in_use_wanted.clear();
            self.in_use_pending.store(false, Ordering::Release);
            for b in state.list.iter_mut().filter(|b| !b.inconsistent) {
                b.durable = b
                    .words
                    .iter()
                    .map(|w| AtomicU64::new(w.load(Ordering::Acquire)))
                    .collect();
            }
        }
        self.note_recording(&state);
    }

    /// The directory `entries` are on disk now: the bitmaps marked `in_use` are no longer
    /// kept consistent (the close stores them).
    pub(super) fn in_use_done(&self, entries: &[BitmapEntry]) {
        let mut state = self.write();
        let wanted = std::mem::take(&mut state.in_use_wanted);
        for b in state
            .list
            .iter_mut()
            .filter(|b| wanted.contains(&b.entry.name))
        {
            b.durable = Vec::new();
        }
        state.disk = entries.to_vec();
        self.in_use_pending.store(false, Ordering::Release);
    }
}

// QEMU's limit on a bitmap name's length.
pub(super) use qimg_format::bitmap::MAX_NAME_BYTES as MAX_NAME;

/// QEMU's refusal of an inconsistent bitmap, with its hint.
pub(super) fn inconsistent(name: &str) -> Error {
    Error::InvalidOption(format!(
        "Bitmap '{name}' is inconsistent and cannot be used\n\
         Try block-dirty-bitmap-remove to delete this bitmap from disk"
    ))
}

pub(super) fn not_found(name: &str) -> Error {
    Error::InvalidOption(format!("Dirty bitmap '{name}' not found"))
}

/// Bytes of bitmap data one durable write covers: 4096 bits.
pub(super) const SECTOR: u64 = 512;
/// Words of bitmap data a sector holds.
pub(super) const SECTOR_WORDS: usize = (SECTOR / 8) as usize;
/// Durable writes a sector takes word by word; the next one sets the whole sector.
pub(super) const ESCALATE: u8 = 3;
/// The first window of marks ahead of a request, and the largest (sequential writes), in
/// guest bytes.
pub(super) const AHEAD_MIN: u64 = 0;
pub(super) const AHEAD_MAX: u64 = 64 << 20;

/// How close after the reach of the previous marked request a request must start to count as
/// continuing it.
pub(super) const CONTINUES_WITHIN: u64 = 8 << 20;

/// What the group commit remembers between commits (under its lock).
#[derive(Debug, Default)]
pub(crate) struct Commits {
    /// The previous request that needed a durable write: its start and how far its marks
    /// reached; and the window of marks ahead.
    pub(super) prev_start: u64,
    pub(super) prev_reach: u64,
    pub(super) window: u64,
    /// Durable writes so far, by bitmap name and sector.
    pub(super) per_sector: std::collections::HashMap<(Vec<u8>, usize), u8>,
}

impl Commits {
    /// The end of the marks for a request `[start, end)` on a `size`-byte disk: nothing ahead
    /// for a request that does not continue the previous one; a window that doubles (1 MiB,
    /// then up to 64 MiB) while requests keep moving forward from where the previous marks
    /// reached (sequential writes).
    pub(super) fn ahead(&mut self, start: u64, end: u64, size: u64) -> (u64, bool) {
        let continues = self.prev_reach > 0
            && start >= self.prev_start
            && start <= self.prev_reach.saturating_add(CONTINUES_WITHIN);
        self.window = if continues {
            (self.window * 2).clamp(1 << 20, AHEAD_MAX)
        } else {
            AHEAD_MIN
        };
        let ahead = end.saturating_add(self.window).min(size);
        self.prev_start = start;
        self.prev_reach = ahead;
        (ahead, continues)
    }

    /// Notes one more durable write of bitmap `name`'s sector `s`; true when the sector has
    /// taken enough word by word and is to be set whole.
    pub(super) fn escalate(&mut self, name: &[u8], s: usize) -> bool {
        let n = self.per_sector.entry((name.to_vec(), s)).or_insert(0);
        *n = n.saturating_add(1);
        *n > ESCALATE
    }
}

/// Whether a bitmap's on-disk directory entry says `in_use`.
pub(super) fn in_use(flags: u32) -> bool {
    flags & FLAG_IN_USE != 0
}

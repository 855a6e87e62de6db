//! The slice cache: LRU over a byte budget with dirty tracking and pins.

use std::fmt;
use std::ops::Range;
use std::time::Duration;

use lru::LruCache;

use crate::CacheError;

/// Smallest slice size accepted by [`SliceCache::new`] (QEMU's smallest cluster).
pub const MIN_SLICE_SIZE: u64 = 512;
/// Largest slice size accepted by [`SliceCache::new`] (qcow2's largest cluster).
pub const MAX_SLICE_SIZE: u64 = 2 * 1024 * 1024;
/// Fewest slices any cache holds (QEMU's `MIN_L2_CACHE_SIZE`).
pub const MIN_CACHE_ENTRIES: u64 = 2;
/// Largest byte budget accepted anywhere in this crate (1 TiB).
pub const MAX_CACHE_BYTES: u64 = 1 << 40;

/// Names one slice: the host offset of the table (an L2 table or a refcount
/// block) and the index of the slice inside it.
///
/// Keys order by table, then by slice, which is the order
/// [`SliceCache::dirty_entries`] hands them out in (ascending host offsets,
/// so write-back tends to be sequential).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SliceKey {
    /// Host offset of the table the slice belongs to.
    pub table: u64,
    /// Index of the slice inside the table (0 when slices are whole tables).
    pub slice: u32,
}

impl SliceKey {
    /// A key for slice `slice` of the table at host offset `table`.
    pub const fn new(table: u64, slice: u32) -> Self {
        Self { table, slice }
    }
}

impl fmt::Display for SliceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} of table 0x{:x}", self.slice, self.table)
    }
}

/// A dirty slice handed back by the cache (evicted by [`SliceCache::insert`] or
/// removed by [`SliceCache::remove`]); its bytes have not reached storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirtySlice {
    /// Which slice this is.
    pub key: SliceKey,
    /// Its bytes, exactly one slice long.
    pub data: Box<[u8]>,
}

/// A dirty slice still in the cache, with the version of its contents.
///
/// The version changes every time the slice is made dirty, so
/// [`SliceCache::mark_clean`] with a stale `DirtyEntry` (the slice was
/// modified again while its write-back was in flight) leaves it dirty.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DirtyEntry {
    /// Which slice this is.
    pub key: SliceKey,
    /// Version of the contents as of this report.
    pub version: u64,
}

/// What [`SliceCache::clean_idle`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CleanReport {
    /// Clean idle slices dropped.
    pub dropped: usize,
    /// Bytes those slices held.
    pub bytes_freed: u64,
    /// Idle slices kept because they are dirty. The engine writes them back and
    /// calls [`SliceCache::mark_clean`]; since that does not count as a use,
    /// the next pass drops them unless they are used in between.
    pub dirty_idle: Vec<DirtyEntry>,
}

/// Write-back ordering flags (QEMU's `depends` and `depends_on_flush`).
///
/// The cache only stores them; the engine sets them when it creates an
/// ordering constraint and honours and clears them before writing back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Dependencies {
    /// Another cache must be written back and flushed before any dirty slice
    /// of this one is written (e.g. the L2 cache depends on the refcount cache).
    pub other_cache: bool,
    /// Storage must be flushed once before any dirty slice of this cache is
    /// written (e.g. after a copy-on-write, data before L2 entries).
    pub flush: bool,
}

/// Counters and gauges of one cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CacheStats {
    /// Lookups ([`SliceCache::get`], [`SliceCache::get_mut`]) that found the slice.
    pub hits: u64,
    /// Lookups that did not find the slice.
    pub misses: u64,
    /// Slices evicted to make room for an insert, clean or dirty.
    pub evictions: u64,
    /// Evicted slices that were dirty and so were handed back for write-back.
    pub dirty_evictions: u64,
    /// Clean slices dropped by [`SliceCache::clean_idle`].
    pub idle_drops: u64,
    /// Bytes of slice data held now.
    pub bytes_held: u64,
    /// Slices held now.
    pub entries: u64,
    /// Dirty slices held now.
    pub dirty_entries: u64,
    /// Pinned slices held now.
    pub pinned_entries: u64,
}

#[derive(Debug)]
struct Entry {
    data: Box<[u8]>,
    dirty: bool,
    /// While dirty: the bytes `[start, end)` that may differ from storage (the hull of every
    /// change since the slice was last clean).
    span: (usize, usize),
    version: u64,
    pins: u32,
    last_used: Duration,
}

/// A slice-granular LRU cache over a byte budget. See the crate docs for the
/// design; time is a [`Duration`] since an epoch of the caller's choice.
#[derive(Debug)]
pub struct SliceCache {
    /// Unbounded in the `lru` sense: eviction is ours, because it must skip
    /// pinned slices and hand dirty ones back.
    slices: LruCache<SliceKey, Entry>,
    slice_size: usize,
    capacity: usize,
    pinned: usize,
    dirty: usize,
    next_version: u64,
    dependencies: Dependencies,
    hits: u64,
    misses: u64,
    evictions: u64,
    dirty_evictions: u64,
    idle_drops: u64,
}

impl SliceCache {
    /// A cache of slices of `slice_size` bytes holding at most
    /// `budget / slice_size` of them.
    ///
    /// `slice_size` must be a power of two from 512 bytes to 2 MiB; the budget
    /// must hold at least [`MIN_CACHE_ENTRIES`] slices and be at most
    /// [`MAX_CACHE_BYTES`]. Nothing is allocated up front: memory grows with
    /// the slices inserted.
    pub fn new(budget: u64, slice_size: u64) -> Result<Self, CacheError> {
        if !slice_size.is_power_of_two() || !(MIN_SLICE_SIZE..=MAX_SLICE_SIZE).contains(&slice_size)
        {
            return Err(CacheError::InvalidSliceSize { slice_size });
        }
        if budget > MAX_CACHE_BYTES {
            return Err(CacheError::BudgetTooLarge {
                budget,
                max: MAX_CACHE_BYTES,
            });
        }
        let entries = budget / slice_size;
        if entries < MIN_CACHE_ENTRIES {
            return Err(CacheError::BudgetTooSmall {
                budget,
                slice_size,
                min_entries: MIN_CACHE_ENTRIES,
            });
        }
        let too_large = CacheError::BudgetTooLarge {
            budget,
            max: MAX_CACHE_BYTES,
        };
        Ok(Self {
            slices: LruCache::unbounded(),
            slice_size: usize::try_from(slice_size).map_err(|_| too_large.clone())?,
            capacity: usize::try_from(entries).map_err(|_| too_large)?,
            pinned: 0,
            dirty: 0,
            next_version: 0,
            dependencies: Dependencies::default(),
            hits: 0,
            misses: 0,
            evictions: 0,
            dirty_evictions: 0,
            idle_drops: 0,
        })
    }

    /// Bytes per slice.
    pub fn slice_size(&self) -> usize {
        self.slice_size
    }

    /// Most slices the cache holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Slices held now.
    pub fn len(&self) -> usize {
        self.slices.len()
    }

    /// Whether no slice is held.
    pub fn is_empty(&self) -> bool {
        self.slices.is_empty()
    }

    /// Whether the next [`insert`](Self::insert) has to evict.
    pub fn is_full(&self) -> bool {
        self.slices.len() >= self.capacity
    }

    /// Whether `key` is cached (no recency update, no statistics).
    pub fn contains(&self, key: SliceKey) -> bool {
        self.slices.contains(&key)
    }

    /// Looks `key` up. A hit makes the slice the most recently used and stamps
    /// it with `now`; hits and misses are counted.
    pub fn get(&mut self, key: SliceKey, now: Duration) -> Option<&[u8]> {
        match self.slices.get_mut(&key) {
            Some(entry) => {
                self.hits = self.hits.saturating_add(1);
                entry.last_used = now;
                Some(&entry.data)
            }
            None => {
                self.misses = self.misses.saturating_add(1);
                None
            }
        }
    }

    /// [`get`](Self::get) for a caller that does not count a miss here because the load
    /// that follows counts it: a hit is counted and refreshes the slice; a miss changes
    /// nothing. One lookup where `peek` then `get` would take two.
    pub fn get_if_cached(&mut self, key: SliceKey, now: Duration) -> Option<&[u8]> {
        let entry = self.slices.get_mut(&key)?;
        self.hits = self.hits.saturating_add(1);
        entry.last_used = now;
        Some(&entry.data)
    }

    /// Looks `key` up for modification: like [`get`](Self::get), and a hit
    /// also marks the slice dirty (with a new version), so a slice changed
    /// through this reference can never be dropped unwritten.
    pub fn get_mut(&mut self, key: SliceKey, now: Duration) -> Option<&mut [u8]> {
        match self.slices.get_mut(&key) {
            Some(entry) => {
                self.hits = self.hits.saturating_add(1);
                entry.last_used = now;
                if !entry.dirty {
                    entry.dirty = true;
                    self.dirty += 1;
                }
                entry.span = (0, entry.data.len());
                entry.version = self.next_version;
                self.next_version = self.next_version.wrapping_add(1);
                Some(&mut entry.data)
            }
            None => {
                self.misses = self.misses.saturating_add(1);
                None
            }
        }
    }

    /// [`get_mut`](Self::get_mut) for a change to the bytes `range` of the slice alone: hands
    /// out just those bytes and marks only them dirty, so that a write-back of a large slice
    /// (a whole 2 MiB table or refcount block) can write only what changed (see
    /// [`dirty_span`](Self::dirty_span)). `None` on a miss (counted) and for a range outside
    /// the slice (not counted: a caller's mistake, not a lookup).
    pub fn get_mut_range(
        &mut self,
        key: SliceKey,
        range: Range<usize>,
        now: Duration,
    ) -> Option<&mut [u8]> {
        if range.start > range.end || range.end > self.slice_size {
            return None;
        }
        match self.slices.get_mut(&key) {
            Some(entry) => {
                self.hits = self.hits.saturating_add(1);
                entry.last_used = now;
                if entry.dirty {
                    entry.span = (entry.span.0.min(range.start), entry.span.1.max(range.end));
                } else {
                    entry.dirty = true;
                    self.dirty += 1;
                    entry.span = (range.start, range.end);
                }
                entry.version = self.next_version;
                self.next_version = self.next_version.wrapping_add(1);
                entry.data.get_mut(range)
            }
            None => {
                self.misses = self.misses.saturating_add(1);
                None
            }
        }
    }

    /// The bytes of dirty slice `key` that may differ from storage: every byte changed
    /// through [`get_mut_range`](Self::get_mut_range) since the slice was last clean, or
    /// the whole slice once [`get_mut`](Self::get_mut) or [`mark_dirty`](Self::mark_dirty)
    /// touched it. Writing these bytes back is as good as writing the whole slice. `None`
    /// when `key` is clean or not cached.
    pub fn dirty_span(&self, key: SliceKey) -> Option<Range<usize>> {
        self.slices
            .peek(&key)
            .filter(|entry| entry.dirty)
            .map(|entry| entry.span.0..entry.span.1)
    }

    /// The bytes of `key` without touching recency, time or statistics
    /// (for write-back).
    pub fn peek(&self, key: SliceKey) -> Option<&[u8]> {
        self.slices.peek(&key).map(|entry| &*entry.data)
    }

    /// The slice the next [`insert`](Self::insert) would evict: `None` when the
    /// cache has room, or when it is full and every slice is pinned.
    ///
    /// An engine that prefers to write a dirty victim back *before* loading
    /// the new slice asks this first, writes it, and calls
    /// [`mark_clean`](Self::mark_clean).
    pub fn victim(&self) -> Option<SliceKey> {
        if !self.is_full() {
            return None;
        }
        self.lru_unpinned()
    }

    /// Scans from the least recently used end, skipping pinned slices: O(1)
    /// unless many slices are pinned at once.
    fn lru_unpinned(&self) -> Option<SliceKey> {
        if self.pinned >= self.slices.len() {
            return None;
        }
        self.slices
            .iter()
            .rev()
            .find(|(_, entry)| entry.pins == 0)
            .map(|(key, _)| *key)
    }

    /// Adds a freshly loaded (clean) slice as the most recently used, stamped
    /// with `now`.
    ///
    /// When the cache is full the least recently used unpinned slice is evicted
    /// first: a clean one is dropped, a dirty one is returned and the caller
    /// must write it back before anyone can load that slice again from storage
    /// (holding the metadata lock across the write does it). The byte budget is
    /// never exceeded: if every slice is pinned the insert fails with
    /// [`CacheError::AllPinned`] and changes nothing.
    ///
    /// To add a slice that is new rather than loaded (a fresh, zeroed table),
    /// insert it and then [`mark_dirty`](Self::mark_dirty) it.
    pub fn insert(
        &mut self,
        key: SliceKey,
        data: Box<[u8]>,
        now: Duration,
    ) -> Result<Option<DirtySlice>, CacheError> {
        if data.len() != self.slice_size {
            return Err(CacheError::WrongSliceLength {
                key,
                expected: self.slice_size,
                actual: data.len(),
            });
        }
        if self.slices.contains(&key) {
            return Err(CacheError::AlreadyCached { key });
        }
        let mut evicted = None;
        if self.is_full() {
            let victim = self.lru_unpinned().ok_or(CacheError::AllPinned {
                capacity: self.capacity,
            })?;
            if let Some(entry) = self.slices.pop(&victim) {
                self.evictions = self.evictions.saturating_add(1);
                if entry.dirty {
                    self.dirty = self.dirty.saturating_sub(1);
                    self.dirty_evictions = self.dirty_evictions.saturating_add(1);
                    evicted = Some(DirtySlice {
                        key: victim,
                        data: entry.data,
                    });
                }
            }
        }
        self.slices.push(
            key,
            Entry {
                data,
                dirty: false,
                span: (0, 0),
                version: 0,
                pins: 0,
                last_used: now,
            },
        );
        Ok(evicted)
    }

    /// Marks `key` dirty with a new version (its bytes differ from storage).
    /// Does not change recency.
    pub fn mark_dirty(&mut self, key: SliceKey) -> Result<(), CacheError> {
        let entry = self
            .slices
            .peek_mut(&key)
            .ok_or(CacheError::NotCached { key })?;
        if !entry.dirty {
            entry.dirty = true;
            self.dirty += 1;
        }
        entry.span = (0, entry.data.len());
        entry.version = self.next_version;
        self.next_version = self.next_version.wrapping_add(1);
        Ok(())
    }

    /// Whether `key` is dirty; `None` if it is not cached.
    pub fn is_dirty(&self, key: SliceKey) -> Option<bool> {
        self.slices.peek(&key).map(|entry| entry.dirty)
    }

    /// Every dirty slice with its current version, ordered by key (table
    /// offset, then slice index).
    pub fn dirty_entries(&self) -> Vec<DirtyEntry> {
        let mut out: Vec<DirtyEntry> = self
            .slices
            .iter()
            .filter(|(_, entry)| entry.dirty)
            .map(|(key, entry)| DirtyEntry {
                key: *key,
                version: entry.version,
            })
            .collect();
        out.sort_unstable();
        out
    }

    /// Records that the contents described by `written` reached storage.
    ///
    /// Returns `Ok(true)` if the slice became clean, `Ok(false)` if it was
    /// made dirty again since `written` was taken (the newer contents still
    /// need a write-back) or is already clean, and
    /// [`CacheError::NotCached`] if it left the cache.
    pub fn mark_clean(&mut self, written: DirtyEntry) -> Result<bool, CacheError> {
        let key = written.key;
        let entry = self
            .slices
            .peek_mut(&key)
            .ok_or(CacheError::NotCached { key })?;
        if !entry.dirty || entry.version != written.version {
            return Ok(false);
        }
        entry.dirty = false;
        self.dirty = self.dirty.saturating_sub(1);
        Ok(true)
    }

    /// Drops every slice of the table at host offset `table` (the table was
    /// freed). Returns the dirty ones, ordered by slice index, so nothing
    /// dirty disappears unseen; for a freed table the caller normally
    /// discards them, since writing them would scribble on a free cluster.
    ///
    /// If any slice of the table is pinned nothing is removed and
    /// [`CacheError::Pinned`] names the lowest-indexed pinned one.
    pub fn remove(&mut self, table: u64) -> Result<Vec<DirtySlice>, CacheError> {
        let mut keys: Vec<(SliceKey, u32)> = self
            .slices
            .iter()
            .filter(|(key, _)| key.table == table)
            .map(|(key, entry)| (*key, entry.pins))
            .collect();
        keys.sort_unstable();
        if let Some(&(key, pins)) = keys.iter().find(|(_, pins)| *pins > 0) {
            return Err(CacheError::Pinned { key, pins });
        }
        let mut dirty = Vec::new();
        for (key, _) in keys {
            let Some(entry) = self.slices.pop(&key) else {
                continue;
            };
            if entry.dirty {
                self.dirty = self.dirty.saturating_sub(1);
                dirty.push(DirtySlice {
                    key,
                    data: entry.data,
                });
            }
        }
        Ok(dirty)
    }

    /// Pins `key` so it is never evicted, idle-dropped or removed; pins
    /// nest. Returns the new pin count. Does not change recency.
    pub fn pin(&mut self, key: SliceKey) -> Result<u32, CacheError> {
        let entry = self
            .slices
            .peek_mut(&key)
            .ok_or(CacheError::NotCached { key })?;
        let pins = entry
            .pins
            .checked_add(1)
            .ok_or(CacheError::PinOverflow { key })?;
        entry.pins = pins;
        if pins == 1 {
            self.pinned += 1;
        }
        Ok(pins)
    }

    /// Releases one pin of `key`. Returns the remaining pin count.
    pub fn unpin(&mut self, key: SliceKey) -> Result<u32, CacheError> {
        let entry = self
            .slices
            .peek_mut(&key)
            .ok_or(CacheError::NotCached { key })?;
        let pins = entry
            .pins
            .checked_sub(1)
            .ok_or(CacheError::NotPinned { key })?;
        entry.pins = pins;
        if pins == 0 {
            self.pinned = self.pinned.saturating_sub(1);
        }
        Ok(pins)
    }

    /// The pin count of `key`; `None` if it is not cached.
    pub fn pin_count(&self, key: SliceKey) -> Option<u32> {
        self.slices.peek(&key).map(|entry| entry.pins)
    }

    /// The time `key` was last inserted or looked up; `None` if not cached.
    pub fn last_used(&self, key: SliceKey) -> Option<Duration> {
        self.slices.peek(&key).map(|entry| entry.last_used)
    }

    /// Unpinned slices, clean or dirty, not used for at least `interval`
    /// before `now`, ordered by key. An `interval` of zero means the clean
    /// timer is disabled: nothing is idle.
    pub fn idle_since(&self, now: Duration, interval: Duration) -> Vec<SliceKey> {
        let mut out: Vec<SliceKey> = self
            .slices
            .iter()
            .filter(|(_, entry)| entry.pins == 0 && is_idle(entry.last_used, now, interval))
            .map(|(key, _)| *key)
            .collect();
        out.sort_unstable();
        out
    }

    /// One pass of QEMU's `cache-clean-interval` timer.
    ///
    /// Drops every slice that is unpinned, clean, and not used for at least
    /// `interval` before `now` (`now - last_used >= interval`). Called every
    /// `interval`, that is QEMU's "not used since the previous pass". Dirty
    /// idle slices are never dropped: they are reported in
    /// [`CleanReport::dirty_idle`] for write-back, and the next pass drops
    /// them if they stay unused. An `interval` of zero disables the pass.
    /// A `last_used` later than `now` (a clock that went backwards) counts as
    /// recent.
    pub fn clean_idle(&mut self, now: Duration, interval: Duration) -> CleanReport {
        let mut report = CleanReport::default();
        if interval.is_zero() {
            return report;
        }
        let slice_size = self.slice_size as u64;
        self.slices.retain(|key, entry| {
            if entry.pins > 0 || !is_idle(entry.last_used, now, interval) {
                return true;
            }
            if entry.dirty {
                report.dirty_idle.push(DirtyEntry {
                    key: *key,
                    version: entry.version,
                });
                return true;
            }
            report.dropped += 1;
            report.bytes_freed = report.bytes_freed.saturating_add(slice_size);
            false
        });
        report.dirty_idle.sort_unstable();
        self.idle_drops = self.idle_drops.saturating_add(report.dropped as u64);
        report
    }

    /// The write-back ordering flags set so far.
    pub fn dependencies(&self) -> Dependencies {
        self.dependencies
    }

    /// Records that another cache must be flushed before this one is written.
    pub fn depend_on_other_cache(&mut self) {
        self.dependencies.other_cache = true;
    }

    /// Records that storage must be flushed before this cache is written.
    pub fn depend_on_flush(&mut self) {
        self.dependencies.flush = true;
    }

    /// Clears the ordering flags once the engine has honoured them, returning
    /// what they were.
    pub fn take_dependencies(&mut self) -> Dependencies {
        std::mem::take(&mut self.dependencies)
    }

    /// Counters since creation and gauges as of now.
    pub fn stats(&self) -> CacheStats {
        let entries = self.slices.len() as u64;
        CacheStats {
            hits: self.hits,
            misses: self.misses,
            evictions: self.evictions,
            dirty_evictions: self.dirty_evictions,
            idle_drops: self.idle_drops,
            bytes_held: entries.saturating_mul(self.slice_size as u64),
            entries,
            dirty_entries: self.dirty as u64,
            pinned_entries: self.pinned as u64,
        }
    }
}

fn is_idle(last_used: Duration, now: Duration, interval: Duration) -> bool {
    !interval.is_zero()
        && now
            .checked_sub(last_used)
            .is_some_and(|idle| idle >= interval)
}

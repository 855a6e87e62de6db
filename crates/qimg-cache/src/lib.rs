//! Slice-granular LRU cache policy for qcow2 metadata: L2 tables and
//! refcount blocks.
//!
//! This crate decides *what* to keep, evict, write back and drop; it never
//! does I/O, never reads a clock and never blocks. The engine owns loading
//! (one load per slice even when several requests miss at once), write-back,
//! write ordering between caches and the clean timer, and drives a
//! [`SliceCache`] with the results.
//!
//! # The cache
//!
//! A [`SliceCache`] holds *slices*: fixed-size pieces of metadata tables,
//! keyed by [`SliceKey`] = (host offset of the table, slice index). Its byte
//! budget fixes a capacity of `budget / slice_size` slices; memory is
//! allocated only as slices are inserted. Replacement is least recently used,
//! where a use is an [`insert`](SliceCache::insert), [`get`](SliceCache::get)
//! or [`get_mut`](SliceCache::get_mut).
//!
//! * **Dirty slices are never dropped silently.** `get_mut` and
//!   [`mark_dirty`](SliceCache::mark_dirty) make a slice dirty. Evicting a
//!   dirty slice hands its bytes back ([`DirtySlice`]) for write-back; so does
//!   [`remove`](SliceCache::remove) of a freed table; the clean timer reports
//!   dirty idle slices instead of dropping them.
//! * **Only what changed needs writing back.**
//!   [`get_mut_range`](SliceCache::get_mut_range) hands out just the bytes of a
//!   change (an L2 entry, a refcount) and dirties only those;
//!   [`dirty_span`](SliceCache::dirty_span) is the hull of every such change
//!   since the slice was last clean (the whole slice after `get_mut` or
//!   `mark_dirty`). Writing the span back is as good as writing the slice: a
//!   2 MiB table or refcount block with one new entry costs a 4 KiB write.
//! * **Versions make write-back safe while requests go on.** Each dirtying
//!   gives the slice a new version; [`dirty_entries`](SliceCache::dirty_entries)
//!   reports `(key, version)` and [`mark_clean`](SliceCache::mark_clean) only
//!   cleans the slice if its version is unchanged, so a modification made
//!   while its write-back was in flight is not lost.
//! * **Pins** ([`pin`](SliceCache::pin) / [`unpin`](SliceCache::unpin), a
//!   nesting count) keep a slice the engine is using from being evicted,
//!   idle-dropped or removed. The budget is never exceeded: when the cache is
//!   full and everything is pinned, `insert` fails with
//!   [`CacheError::AllPinned`].
//! * **Time** is a [`std::time::Duration`] since an epoch the caller picks
//!   (for example `Instant::now() - start`, or QEMU-style virtual time), passed
//!   to every call that records a use.
//!   [`clean_idle(now, interval)`](SliceCache::clean_idle) drops clean,
//!   unpinned slices unused for at least `interval`.
//! * [`Dependencies`] stores QEMU's two write-back ordering flags ("another
//!   cache first", "flush first") for the engine to honour.
//!
//! # QEMU equivalence
//!
//! This follows `block/qcow2-cache.c`: QEMU's cache entries are L2 slices of
//! `l2-cache-entry-size` bytes (refcount entries are whole clusters), replaced
//! by an LRU counter updated on release, with a reference count per entry
//! that keeps it from being replaced (our pins), a dirty flag written back on
//! eviction, per-cache `depends`/`depends_on_flush` flags, and
//! `qcow2_cache_clean_unused`, which every `cache-clean-interval` drops entries
//! that are unreferenced, clean and unused since the previous pass. Budgets
//! come from QEMU's option names and rules ([`CacheOptions::resolve`], after
//! `read_cache_sizes` in `block/qcow2.c`), with two differences: an L2 share
//! larger than the whole disk needs is capped at that need, and refcount blocks
//! are cached in slices of [`REFCOUNT_SLICE_SIZE`] (4 KiB), where QEMU caches
//! them whole.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use qimg_cache::{CacheOptions, ImageFacts, SliceKey};
//!
//! let facts = ImageFacts { virtual_size: 1 << 40, cluster_size: 65536, extended_l2: true };
//! let budgets = CacheOptions::default().resolve(facts)?;
//! assert_eq!(budgets.l2_slice_size, 4096);
//! let mut l2 = budgets.new_l2_cache()?;
//!
//! let key = SliceKey::new(0x50000, 3);
//! let now = Duration::from_secs(1);
//! assert!(l2.get(key, now).is_none()); // miss: the engine loads the slice
//! let evicted = l2.insert(key, vec![0u8; 4096].into_boxed_slice(), now)?;
//! assert!(evicted.is_none());
//! l2.get_mut_range(key, 16..32, now).unwrap().fill(1); // one entry: now dirty
//! assert_eq!(l2.dirty_span(key), Some(16..32));
//! for written in l2.dirty_entries() {
//!     // ... the engine writes the dirty span of l2.peek(written.key) to storage ...
//!     assert!(l2.mark_clean(written)?);
//! }
//! let report = l2.clean_idle(now + Duration::from_secs(600), Duration::from_secs(600));
//! assert_eq!(report.dropped, 1);
//! # Ok::<(), qimg_cache::CacheError>(())
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod error;
mod options;
mod slice_cache;

pub use error::CacheError;
pub use options::{
    CacheOptions, DEFAULT_CACHE_CLEAN_INTERVAL_SECS, DEFAULT_L2_CACHE_MAX_SIZE, ImageFacts,
    MAX_CACHE_CLEAN_INTERVAL_SECS, MIN_L2_CACHE_ENTRIES, MIN_L2_CACHE_ENTRY_SIZE,
    MIN_REFCOUNT_CACHE_ENTRIES, REFCOUNT_SLICE_SIZE, ResolvedCache, SMALL_L2_CACHE_ENTRY_SIZE,
};
pub use slice_cache::{
    CacheStats, CleanReport, Dependencies, DirtyEntry, DirtySlice, MAX_CACHE_BYTES, MAX_SLICE_SIZE,
    MIN_CACHE_ENTRIES, MIN_SLICE_SIZE, SliceCache, SliceKey,
};

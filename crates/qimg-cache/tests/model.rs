//! State-machine test: `SliceCache` against a plain model with an explicit
//! recency order, over random operation sequences.

use std::collections::BTreeMap;
use std::time::Duration;

use proptest::prelude::*;
use qimg_cache::{CacheError, DirtyEntry, DirtySlice, SliceCache, SliceKey};

const SLICE: usize = 512;
const TABLES: [u64; 3] = [0x10000, 0x20000, 0x30000];

#[derive(Debug, Clone)]
enum CacheOp {
    Advance(u64),
    /// `get` (`true`: a miss counts) or `get_if_cached` (`false`: the caller's load counts it).
    Get(SliceKey, bool),
    GetMut(SliceKey, u16, u8),
    GetMutRange(SliceKey, u16, u16, u8),
    Insert(SliceKey),
    MarkDirty(SliceKey),
    SnapshotDirty,
    MarkClean(usize),
    Pin(SliceKey),
    Unpin(SliceKey),
    Remove(u64),
    CleanIdle(u64),
}

fn key() -> impl Strategy<Value = SliceKey> {
    (0..TABLES.len(), 0u32..3).prop_map(|(t, s)| SliceKey::new(TABLES[t], s))
}

fn op() -> impl Strategy<Value = CacheOp> {
    prop_oneof![
        2 => (0u64..40).prop_map(CacheOp::Advance),
        4 => key().prop_map(|k| CacheOp::Get(k, true)),
        2 => key().prop_map(|k| CacheOp::Get(k, false)),
        2 => (key(), 0u16..SLICE as u16, any::<u8>()).prop_map(|(k, at, b)| CacheOp::GetMut(k, at, b)),
        3 => (key(), 0u16..SLICE as u16 + 8, 0u16..24, any::<u8>())
            .prop_map(|(k, at, n, b)| CacheOp::GetMutRange(k, at, n, b)),
        5 => key().prop_map(CacheOp::Insert),
        2 => key().prop_map(CacheOp::MarkDirty),
        1 => Just(CacheOp::SnapshotDirty),
        2 => (0usize..8).prop_map(CacheOp::MarkClean),
        2 => key().prop_map(CacheOp::Pin),
        2 => key().prop_map(CacheOp::Unpin),
        1 => (0..TABLES.len()).prop_map(|t| CacheOp::Remove(TABLES[t])),
        1 => (0u64..100).prop_map(CacheOp::CleanIdle),
    ]
}

#[derive(Debug, Clone)]
struct ModelEntry {
    key: SliceKey,
    data: Vec<u8>,
    /// What storage holds for the slice: its bytes when inserted or last marked clean.
    disk: Vec<u8>,
    dirty: bool,
    version: u64,
    pins: u32,
    last_used: u64,
}

/// The obviously correct version: a Vec in recency order (index 0 is least
/// recently used) and linear scans.
#[derive(Debug, Default)]
struct Model {
    capacity: usize,
    entries: Vec<ModelEntry>,
    next_version: u64,
    hits: u64,
    misses: u64,
    evictions: u64,
    dirty_evictions: u64,
    idle_drops: u64,
}

impl Model {
    fn position(&self, key: SliceKey) -> Option<usize> {
        self.entries.iter().position(|e| e.key == key)
    }

    fn find(&mut self, key: SliceKey) -> Option<&mut ModelEntry> {
        self.entries.iter_mut().find(|e| e.key == key)
    }

    /// Moves `key` to most recently used and returns it.
    fn touch(&mut self, key: SliceKey, now: u64) -> Option<&mut ModelEntry> {
        let i = self.position(key)?;
        let mut entry = self.entries.remove(i);
        entry.last_used = now;
        self.entries.push(entry);
        self.entries.last_mut()
    }

    fn dirty(&mut self, key: SliceKey) -> bool {
        let version = self.next_version;
        match self.find(key) {
            Some(entry) => {
                entry.dirty = true;
                entry.version = version;
                self.next_version += 1;
                true
            }
            None => false,
        }
    }

    fn victim(&self) -> Option<SliceKey> {
        if self.entries.len() < self.capacity {
            return None;
        }
        self.entries.iter().find(|e| e.pins == 0).map(|e| e.key)
    }

    fn dirty_entries(&self) -> Vec<DirtyEntry> {
        let mut out: Vec<DirtyEntry> = self
            .entries
            .iter()
            .filter(|e| e.dirty)
            .map(|e| DirtyEntry {
                key: e.key,
                version: e.version,
            })
            .collect();
        out.sort();
        out
    }
}

fn idle(last_used: u64, now: u64, interval: u64) -> bool {
    interval > 0 && now >= last_used && now - last_used >= interval
}

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

/// Every dirty content the cache was given and has not handed back or
/// been told was written: it must still be in the cache, dirty.
type Ledger = BTreeMap<SliceKey, Vec<u8>>;

fn settle(ledger: &mut Ledger, handed_back: &[DirtySlice]) -> Result<(), TestCaseError> {
    for slice in handed_back {
        let expected = ledger.remove(&slice.key);
        prop_assert_eq!(expected.as_deref(), Some(&*slice.data));
    }
    Ok(())
}

fn run(capacity: usize, ops: Vec<CacheOp>) -> Result<(), TestCaseError> {
    let budget = (capacity * SLICE) as u64 + (SLICE as u64 - 1);
    let mut cache = SliceCache::new(budget, SLICE as u64).expect("valid cache");
    prop_assert_eq!(cache.capacity(), capacity);
    let mut model = Model {
        capacity,
        ..Model::default()
    };
    let mut ledger = Ledger::new();
    let mut snapshot: Vec<DirtyEntry> = Vec::new();
    let mut now = 0u64;
    let mut fill = 0u8;

    for op in ops {
        match op {
            CacheOp::Advance(by) => now += by,
            CacheOp::Get(key, counted) => {
                let got = if counted {
                    cache.get(key, ms(now))
                } else {
                    cache.get_if_cached(key, ms(now))
                }
                .map(<[u8]>::to_vec);
                match model.touch(key, now) {
                    Some(entry) => {
                        prop_assert_eq!(got.as_ref(), Some(&entry.data));
                        model.hits += 1;
                    }
                    None => {
                        prop_assert_eq!(got, None);
                        model.misses += u64::from(counted);
                    }
                }
            }
            CacheOp::GetMut(key, at, byte) => {
                let got = cache.get_mut(key, ms(now)).map(|data| {
                    data[usize::from(at)] = byte;
                    data.to_vec()
                });
                if model.touch(key, now).is_some() {
                    model.hits += 1;
                    model.dirty(key);
                    let entry = model.find(key).expect("just touched");
                    entry.data[usize::from(at)] = byte;
                    prop_assert_eq!(got.as_ref(), Some(&entry.data));
                    ledger.insert(key, entry.data.clone());
                } else {
                    model.misses += 1;
                    prop_assert_eq!(got, None);
                }
            }
            CacheOp::GetMutRange(key, at, n, byte) => {
                let range = usize::from(at)..usize::from(at) + usize::from(n);
                let fits = range.end <= SLICE;
                let got = cache
                    .get_mut_range(key, range.clone(), ms(now))
                    .map(|data| {
                        data.fill(byte);
                        data.len()
                    });
                if !fits {
                    prop_assert_eq!(got, None, "a range past the slice is refused");
                } else if model.touch(key, now).is_some() {
                    model.hits += 1;
                    model.dirty(key);
                    let entry = model.find(key).expect("just touched");
                    entry.data[range.clone()].fill(byte);
                    prop_assert_eq!(got, Some(range.len()));
                    ledger.insert(key, entry.data.clone());
                } else {
                    model.misses += 1;
                    prop_assert_eq!(got, None);
                }
            }
            CacheOp::Insert(key) => {
                fill = fill.wrapping_add(1);
                let data = vec![fill; SLICE];
                let result = cache.insert(key, data.clone().into_boxed_slice(), ms(now));
                if model.position(key).is_some() {
                    prop_assert_eq!(result, Err(CacheError::AlreadyCached { key }));
                } else if model.entries.len() >= capacity {
                    match model.victim() {
                        None => {
                            prop_assert_eq!(result, Err(CacheError::AllPinned { capacity }));
                        }
                        Some(victim) => {
                            let i = model.position(victim).expect("victim is cached");
                            let gone = model.entries.remove(i);
                            model.evictions += 1;
                            let expected = if gone.dirty {
                                model.dirty_evictions += 1;
                                Some(DirtySlice {
                                    key: victim,
                                    data: gone.data.into_boxed_slice(),
                                })
                            } else {
                                None
                            };
                            let evicted = result.expect("insert evicts");
                            prop_assert_eq!(&evicted, &expected);
                            settle(&mut ledger, evicted.as_slice())?;
                        }
                    }
                } else {
                    prop_assert_eq!(result, Ok(None));
                }
                if model.position(key).is_none() && model.entries.len() < capacity {
                    model.entries.push(ModelEntry {
                        key,
                        disk: data.clone(),
                        data,
                        dirty: false,
                        version: 0,
                        pins: 0,
                        last_used: now,
                    });
                }
            }
            CacheOp::MarkDirty(key) => {
                let result = cache.mark_dirty(key);
                if model.dirty(key) {
                    prop_assert_eq!(result, Ok(()));
                    let entry = model.find(key).expect("dirtied");
                    ledger.insert(key, entry.data.clone());
                } else {
                    prop_assert_eq!(result, Err(CacheError::NotCached { key }));
                }
            }
            CacheOp::SnapshotDirty => snapshot = cache.dirty_entries(),
            CacheOp::MarkClean(i) => {
                let Some(&written) = snapshot.get(i) else {
                    continue;
                };
                let result = cache.mark_clean(written);
                match model.find(written.key) {
                    None => {
                        prop_assert_eq!(result, Err(CacheError::NotCached { key: written.key }))
                    }
                    Some(entry) => {
                        let cleans = entry.dirty && entry.version == written.version;
                        if cleans {
                            entry.dirty = false;
                            entry.disk = entry.data.clone();
                            ledger.remove(&written.key);
                        }
                        prop_assert_eq!(result, Ok(cleans));
                    }
                }
            }
            CacheOp::Pin(key) => {
                let result = cache.pin(key);
                match model.find(key) {
                    Some(entry) => {
                        entry.pins += 1;
                        prop_assert_eq!(result, Ok(entry.pins));
                    }
                    None => prop_assert_eq!(result, Err(CacheError::NotCached { key })),
                }
            }
            CacheOp::Unpin(key) => {
                let result = cache.unpin(key);
                match model.find(key) {
                    Some(entry) if entry.pins > 0 => {
                        entry.pins -= 1;
                        prop_assert_eq!(result, Ok(entry.pins));
                    }
                    Some(_) => prop_assert_eq!(result, Err(CacheError::NotPinned { key })),
                    None => prop_assert_eq!(result, Err(CacheError::NotCached { key })),
                }
            }
            CacheOp::Remove(table) => {
                let result = cache.remove(table);
                let mut of_table: Vec<&ModelEntry> = model
                    .entries
                    .iter()
                    .filter(|e| e.key.table == table)
                    .collect();
                of_table.sort_by_key(|e| e.key);
                if let Some(pinned) = of_table.iter().find(|e| e.pins > 0) {
                    prop_assert_eq!(
                        result,
                        Err(CacheError::Pinned {
                            key: pinned.key,
                            pins: pinned.pins
                        })
                    );
                } else {
                    let expected: Vec<DirtySlice> = of_table
                        .iter()
                        .filter(|e| e.dirty)
                        .map(|e| DirtySlice {
                            key: e.key,
                            data: e.data.clone().into_boxed_slice(),
                        })
                        .collect();
                    let removed = result.expect("nothing pinned");
                    prop_assert_eq!(&removed, &expected);
                    settle(&mut ledger, &removed)?;
                    model.entries.retain(|e| e.key.table != table);
                }
            }
            CacheOp::CleanIdle(interval) => {
                let idle_keys = cache.idle_since(ms(now), ms(interval));
                let mut expected_idle: Vec<SliceKey> = model
                    .entries
                    .iter()
                    .filter(|e| e.pins == 0 && idle(e.last_used, now, interval))
                    .map(|e| e.key)
                    .collect();
                expected_idle.sort();
                prop_assert_eq!(idle_keys, expected_idle);

                let report = cache.clean_idle(ms(now), ms(interval));
                let droppable =
                    |e: &ModelEntry| e.pins == 0 && !e.dirty && idle(e.last_used, now, interval);
                let dropped = model.entries.iter().filter(|e| droppable(e)).count();
                let mut dirty_idle: Vec<DirtyEntry> = model
                    .entries
                    .iter()
                    .filter(|e| e.pins == 0 && e.dirty && idle(e.last_used, now, interval))
                    .map(|e| DirtyEntry {
                        key: e.key,
                        version: e.version,
                    })
                    .collect();
                dirty_idle.sort();
                model.entries.retain(|e| !droppable(e));
                model.idle_drops += dropped as u64;
                prop_assert_eq!(report.dropped, dropped);
                prop_assert_eq!(report.bytes_freed, (dropped * SLICE) as u64);
                prop_assert_eq!(report.dirty_idle, dirty_idle);
            }
        }

        // The cache agrees with the model after every step.
        let stats = cache.stats();
        prop_assert_eq!(stats.hits, model.hits);
        prop_assert_eq!(stats.misses, model.misses);
        prop_assert_eq!(stats.evictions, model.evictions);
        prop_assert_eq!(stats.dirty_evictions, model.dirty_evictions);
        prop_assert_eq!(stats.idle_drops, model.idle_drops);
        prop_assert_eq!(stats.entries, model.entries.len() as u64);
        prop_assert_eq!(stats.bytes_held, (model.entries.len() * SLICE) as u64);
        prop_assert!(stats.bytes_held <= budget, "byte budget exceeded");
        prop_assert!(cache.len() <= capacity);
        prop_assert_eq!(
            stats.pinned_entries,
            model.entries.iter().filter(|e| e.pins > 0).count() as u64
        );
        prop_assert_eq!(
            stats.dirty_entries,
            model.entries.iter().filter(|e| e.dirty).count() as u64
        );
        prop_assert_eq!(cache.dirty_entries(), model.dirty_entries());
        prop_assert_eq!(cache.victim(), model.victim());
        for entry in &model.entries {
            prop_assert_eq!(cache.peek(entry.key), Some(&*entry.data));
            prop_assert_eq!(cache.pin_count(entry.key), Some(entry.pins));
            prop_assert_eq!(cache.last_used(entry.key), Some(ms(entry.last_used)));
            // Writing back the dirty span alone would leave storage equal to the slice.
            match cache.dirty_span(entry.key) {
                Some(span) => {
                    prop_assert!(entry.dirty, "a span for clean {}", entry.key);
                    prop_assert!(span.start <= span.end && span.end <= SLICE);
                    let mut written = entry.disk.clone();
                    written[span.clone()].copy_from_slice(&entry.data[span]);
                    prop_assert_eq!(
                        &written,
                        &entry.data,
                        "{} changed outside its span",
                        entry.key
                    );
                }
                None => {
                    prop_assert!(!entry.dirty, "no span for dirty {}", entry.key);
                    prop_assert_eq!(&entry.disk, &entry.data, "clean {} differs", entry.key);
                }
            }
        }
        // Nothing dirty vanished: every unwritten change is still cached, dirty,
        // with exactly the bytes last written.
        for (key, data) in &ledger {
            prop_assert_eq!(cache.is_dirty(*key), Some(true), "dirty {} vanished", key);
            prop_assert_eq!(cache.peek(*key), Some(&data[..]));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn the_cache_behaves_like_a_recency_ordered_list(
        capacity in 2usize..6,
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        run(capacity, ops)?;
    }
}

#[test]
fn the_least_recently_used_unpinned_slice_is_evicted_and_a_dirty_one_handed_back() {
    let mut cache = SliceCache::new(2 * 512, 512).unwrap();
    let (a, b, c) = (
        SliceKey::new(0, 0),
        SliceKey::new(0, 1),
        SliceKey::new(0, 2),
    );
    let t = Duration::ZERO;
    cache.insert(a, vec![1; 512].into(), t).unwrap();
    cache.insert(b, vec![2; 512].into(), t).unwrap();
    cache.mark_dirty(a).unwrap();
    let evicted = cache.insert(c, vec![3; 512].into(), t).unwrap();
    assert_eq!(evicted.map(|s| s.key), Some(a));
    assert_eq!(cache.stats().dirty_evictions, 1);
}

#[test]
fn a_pinned_slice_is_skipped_by_eviction() {
    let mut cache = SliceCache::new(2 * 512, 512).unwrap();
    let (a, b, c) = (
        SliceKey::new(0, 0),
        SliceKey::new(0, 1),
        SliceKey::new(0, 2),
    );
    let t = Duration::ZERO;
    cache.insert(a, vec![1; 512].into(), t).unwrap();
    cache.insert(b, vec![2; 512].into(), t).unwrap();
    cache.pin(a).unwrap();
    assert_eq!(cache.victim(), Some(b));
    cache.insert(c, vec![3; 512].into(), t).unwrap();
    assert!(cache.contains(a) && !cache.contains(b));
}

#[test]
fn a_full_cache_of_pinned_slices_refuses_an_insert_rather_than_exceed_its_budget() {
    let mut cache = SliceCache::new(2 * 512, 512).unwrap();
    let t = Duration::ZERO;
    for slice in 0..2 {
        let key = SliceKey::new(0, slice);
        cache.insert(key, vec![0; 512].into(), t).unwrap();
        cache.pin(key).unwrap();
    }
    let err = cache
        .insert(SliceKey::new(0, 2), vec![0; 512].into(), t)
        .unwrap_err();
    assert_eq!(err, CacheError::AllPinned { capacity: 2 });
    assert_eq!(cache.len(), 2);
}

#[test]
fn a_slice_modified_during_its_write_back_stays_dirty() {
    let mut cache = SliceCache::new(2 * 512, 512).unwrap();
    let key = SliceKey::new(0x10000, 0);
    let t = Duration::ZERO;
    cache.insert(key, vec![0; 512].into(), t).unwrap();
    cache.get_mut(key, t).unwrap()[0] = 1;
    let written = cache.dirty_entries()[0];
    cache.get_mut(key, t).unwrap()[0] = 2; // while the write is in flight
    assert_eq!(cache.mark_clean(written), Ok(false));
    assert_eq!(cache.is_dirty(key), Some(true));
    let written = cache.dirty_entries()[0];
    assert_eq!(cache.mark_clean(written), Ok(true));
}

#[test]
fn the_clean_timer_reports_dirty_idle_slices_and_drops_them_on_the_next_pass_once_written() {
    let mut cache = SliceCache::new(4 * 512, 512).unwrap();
    let (clean, dirty) = (SliceKey::new(0, 0), SliceKey::new(0, 1));
    let interval = Duration::from_secs(600);
    cache
        .insert(clean, vec![0; 512].into(), Duration::ZERO)
        .unwrap();
    cache
        .insert(dirty, vec![0; 512].into(), Duration::ZERO)
        .unwrap();
    cache.mark_dirty(dirty).unwrap();

    let first = cache.clean_idle(Duration::from_secs(599), interval);
    assert_eq!(
        first.dropped, 0,
        "nothing has been idle for a whole interval"
    );

    let second = cache.clean_idle(Duration::from_secs(600), interval);
    assert_eq!(second.dropped, 1);
    assert_eq!(second.bytes_freed, 512);
    assert_eq!(second.dirty_idle.len(), 1);
    assert!(cache.contains(dirty) && !cache.contains(clean));

    assert_eq!(cache.mark_clean(second.dirty_idle[0]), Ok(true));
    let third = cache.clean_idle(Duration::from_secs(1200), interval);
    assert_eq!(third.dropped, 1);
    assert!(cache.is_empty());
    assert_eq!(cache.stats().bytes_held, 0);
}

#[test]
fn a_zero_clean_interval_drops_nothing() {
    let mut cache = SliceCache::new(2 * 512, 512).unwrap();
    cache
        .insert(SliceKey::new(0, 0), vec![0; 512].into(), Duration::ZERO)
        .unwrap();
    let report = cache.clean_idle(Duration::from_secs(1 << 30), Duration::ZERO);
    assert_eq!(report.dropped, 0);
    assert_eq!(cache.len(), 1);
}

#[test]
fn removing_a_freed_table_hands_back_its_dirty_slices_only() {
    let mut cache = SliceCache::new(4 * 512, 512).unwrap();
    let t = Duration::ZERO;
    for slice in 0..3 {
        cache
            .insert(SliceKey::new(0x10000, slice), vec![0; 512].into(), t)
            .unwrap();
    }
    cache
        .insert(SliceKey::new(0x20000, 0), vec![0; 512].into(), t)
        .unwrap();
    cache.mark_dirty(SliceKey::new(0x10000, 2)).unwrap();
    let removed = cache.remove(0x10000).unwrap();
    assert_eq!(
        removed.iter().map(|s| s.key).collect::<Vec<_>>(),
        [SliceKey::new(0x10000, 2)]
    );
    assert_eq!(cache.len(), 1);
}

#[test]
fn bad_shapes_are_refused() {
    assert_eq!(
        SliceCache::new(4096, 1000).unwrap_err(),
        CacheError::InvalidSliceSize { slice_size: 1000 }
    );
    assert!(matches!(
        SliceCache::new(4096, 4096),
        Err(CacheError::BudgetTooSmall { .. })
    ));
    assert!(matches!(
        SliceCache::new(u64::MAX, 4096),
        Err(CacheError::BudgetTooLarge { .. })
    ));
    let mut cache = SliceCache::new(4096, 512).unwrap();
    let key = SliceKey::new(0, 0);
    assert_eq!(
        cache.insert(key, vec![0; 100].into(), Duration::ZERO),
        Err(CacheError::WrongSliceLength {
            key,
            expected: 512,
            actual: 100
        })
    );
}

#[test]
fn dependency_flags_are_kept_until_taken() {
    let mut cache = SliceCache::new(4096, 512).unwrap();
    cache.depend_on_other_cache();
    cache.depend_on_flush();
    let deps = cache.take_dependencies();
    assert!(deps.other_cache && deps.flush);
    assert_eq!(cache.dependencies(), Default::default());
}

#[test]
fn a_range_change_dirties_only_its_bytes_until_the_slice_is_clean() {
    let mut cache = SliceCache::new(2 * 4096, 4096).unwrap();
    let key = SliceKey::new(0x10000, 0);
    let t = Duration::ZERO;
    cache.insert(key, vec![0; 4096].into(), t).unwrap();
    assert_eq!(cache.dirty_span(key), None);
    cache.get_mut_range(key, 100..108, t).unwrap().fill(1);
    assert_eq!(cache.dirty_span(key), Some(100..108));
    assert_eq!(
        cache.peek(key).unwrap()[99..109],
        [0, 1, 1, 1, 1, 1, 1, 1, 1, 0]
    );
    let written = cache.dirty_entries()[0];
    // Changed again while the write-back of the first change is in flight: the stale
    // write-back leaves it dirty, with the hull of both changes.
    cache.get_mut_range(key, 3000..3016, t).unwrap().fill(2);
    assert_eq!(cache.dirty_span(key), Some(100..3016));
    assert_eq!(cache.mark_clean(written), Ok(false));
    assert_eq!(cache.dirty_span(key), Some(100..3016));
    let written = cache.dirty_entries()[0];
    assert_eq!(cache.mark_clean(written), Ok(true));
    assert_eq!(cache.dirty_span(key), None);
    // A whole-slice change dirties everything; a range past the end is refused.
    cache.get_mut_range(key, 8..16, t).unwrap();
    cache.get_mut(key, t).unwrap();
    assert_eq!(cache.dirty_span(key), Some(0..4096));
    assert!(cache.get_mut_range(key, 4090..4100, t).is_none());
    cache.mark_clean(cache.dirty_entries()[0]).unwrap();
    cache.get_mut_range(key, 8..16, t).unwrap();
    cache.mark_dirty(key).unwrap();
    assert_eq!(cache.dirty_span(key), Some(0..4096));
}

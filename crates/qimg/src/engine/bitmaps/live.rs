//! Crash-consistent bitmaps (the default; [`OpenOptions::crash_consistent_bitmaps`]): the
//! bitmaps on disk stay consistent while the image is written, so that after a crash or a
//! power cut at any point QEMU and qimg read them as consistent and each one's set bits are
//! a superset of what changed.
//!
//! The rule, in one place ([`Inner::record_change`], which every path that changes guest
//! data calls before it changes anything): a granule's bit is durable on disk before any
//! write that changes the granule is submitted. Bits already durable cost one atomic check
//! per bitmap. A request that touches a granule whose bit is not durable yet waits for one
//! durable write of the bitmap data that holds its bit, shared with every request waiting
//! meanwhile (a group commit under one lock). That write sets on disk (not in memory) the
//! bits of whole 64-bit words (64 granules: 4 MiB of guest data at 64 KiB granularity); for
//! a request that continues the previous one (sequential writes, which will fill it) the
//! whole 512-byte sector of bitmap data (4096 granules: 256 MiB at 64 KiB) and a window
//! ahead that doubles up to 64 MiB; and a sector that has taken three durable writes is set
//! whole on the fourth, so that a session pays a few durable writes per sector at most,
//! whatever the pattern. A bitmap data
//! cluster that does not exist yet (its table entry says "all clear") is allocated, written
//! and counted durably before the table entry (rewritten in place) names it.
//!
//! The bits in memory stay exact and a clean close stores them as they are: the bits set
//! ahead matter only after a crash, where the bitmap then claims every granule of each word
//! (or sector) written to since the open (still an incremental backup, where QEMU's writer leaves
//! every bitmap inconsistent and the next backup must be full). Changes that would make the
//! disk claim more than it may (disabling or removing a bitmap, resizing the disk) first mark
//! the bitmaps concerned `in_use` on disk, durably: a crash then leaves those inconsistent,
//! as QEMU's writer leaves every bitmap. Adding, clearing and merging need nothing: until
//! the close stores them, the disk holds the state before them, which is still a superset of
//! what changed since then.
//!
//! [`OpenOptions::crash_consistent_bitmaps`]: crate::OpenOptions::crash_consistent_bitmaps

use std::sync::atomic::Ordering;

use qimg_format::bitmap::{self, TableEntry};
use qimg_io::Storage;

use crate::engine::bitmap_set::SECTOR_WORDS;
use crate::engine::image::Inner;
use crate::engine::overlap::Writing;
use crate::error::Result;

/// What [`Inner::record_change`] saw: the bitmaps' epoch before it recorded.
#[derive(Debug, Clone, Copy)]
#[must_use = "pass it to `Inner::recorded` once the range lock is held"]
pub(crate) struct Recorded(u64);

/// One durable write to make for a bitmap: its words `[first, end)` (a sector) in place, or,
/// for a data cluster not allocated yet (table entry `t`), the whole cluster; with the words
/// of `set` (ranges of word indices) all set.
#[derive(Debug)]
enum Piece {
    Sectors {
        first: usize,
        end: usize,
        at: u64,
        set: Vec<(usize, usize)>,
    },
    NewCluster {
        t: usize,
        set: Vec<(usize, usize)>,
    },
}

impl<S: Storage> Inner<S> {
    /// Records a write, write-zeroes or discard of `[offset, offset + len)` in every enabled
    /// bitmap and, for crash-consistent bitmaps, makes the bits durable before returning.
    /// Every path that changes guest data calls this before it changes anything.
    ///
    /// The caller then takes its range lock and calls [`recorded`](Self::recorded) with
    /// what this returned before it changes anything.
    pub(crate) async fn record_change(&self, offset: u64, len: u64) -> Result<Recorded> {
        let epoch = self.shared.bitmaps.epoch();
        if !self.shared.bitmaps.mark(offset, len) {
            self.sync_bitmaps(offset, len).await?;
        }
        Ok(Recorded(epoch))
    }

    /// Called with the range lock of `[offset, offset + len)` held, after
    /// [`record_change`](Self::record_change): when the bitmaps changed meanwhile (a
    /// checkpoint added, cleared or enabled one while the request waited for its lock),
    /// records the change again in the bitmaps as they are now, so that a bitmap started by a
    /// checkpoint misses no write that runs after it. The rule for the queue's direct path
    /// is the same check ([`Bitmaps::still_current`](super::Bitmaps::still_current)), which
    /// hands such a write to the engine.
    pub(crate) async fn recorded(&self, r: Recorded, offset: u64, len: u64) -> Result<()> {
        if self.shared.bitmaps.still_current(r.0) {
            return Ok(());
        }
        self.record_change(offset, len).await.map(drop)
    }

    /// Makes the bits of `[offset, offset + len)` durable in every crash-consistent bitmap
    /// (the group commit, see the module notes).
    async fn sync_bitmaps(&self, offset: u64, len: u64) -> Result<()> {
        self.shared.bitmaps.push_pending(offset, len);
        let mut commits = self.shared.bitmaps.sync.lock().await;
        self.mark_in_use_pending().await?;
        if self.shared.bitmaps.durable_covers(offset, len) {
            // A commit that ran while this one waited wrote it.
            return Ok(());
        }
        let size = self.shared.size();
        let ranges: Vec<(u64, u64, (u64, bool))> = self
            .shared
            .bitmaps
            .take_pending()
            .into_iter()
            .filter(|r| r.1 > 0)
            .map(|(a, l)| (a, l, commits.ahead(a, a + l, size)))
            .collect();
        let cs = self.shared.geo.cluster_size();
        let words_per_cluster = (cs / 8) as usize;
        // Phase 1, under the bitmaps' lock: the words to set on disk, sector by sector, and
        // where each sector goes (by name: the list may change before phase 2).
        let plan: Vec<(String, Vec<Piece>)> = {
            let state = self.shared.bitmaps.read();
            let mut plan = Vec::new();
            for b in state.list.iter().filter(|b| b.live() && b.enabled()) {
                // Sector -> (word ranges to set, whole sector).
                let mut sectors: std::collections::BTreeMap<usize, (Vec<(usize, usize)>, bool)> =
                    Default::default();
                for &(a, l, (ahead_end, continues)) in &ranges {
                    if b.durable_covers(a, l) {
                        continue;
                    }
                    let (g0, g1) = b.granules(a, ahead_end - a);
                    if g1 <= g0 {
                        continue;
                    }
                    let (w0, w1) = ((g0 / 64) as usize, (g1 - 1) as usize / 64 + 1);
                    let mut w = w0;
                    while w < w1 {
                        let s = w / SECTOR_WORDS;
                        let z = w1.min((s + 1) * SECTOR_WORDS);
                        let e = sectors.entry(s).or_default();
                        e.0.push((w, z));
                        // Sequential writes fill the sector: set it whole at once.
                        e.1 |= continues;
                        w = z;
                    }
                }
                let mut pieces: Vec<Piece> = Vec::new();
                for (s, (mut set, whole)) in sectors {
                    let first = s * SECTOR_WORDS;
                    if first >= b.words.len() {
                        continue;
                    }
                    let end = (first + SECTOR_WORDS).min(b.words.len());
                    if commits.escalate(&b.entry.name, s) || whole {
                        set = vec![(first, end)];
                    }
                    let t = first / words_per_cluster;
                    match b.table.get(t) {
                        Some(TableEntry::Data(at)) => pieces.push(Piece::Sectors {
                            first,
                            end,
                            at: at + (first % words_per_cluster) as u64 * 8,
                            set,
                        }),
                        Some(TableEntry::Zeros) => match pieces.last_mut() {
                            Some(Piece::NewCluster { t: u, set: more }) if *u == t => {
                                more.extend(set);
                            }
                            _ => pieces.push(Piece::NewCluster { t, set }),
                        },
                        // All set on disk already.
                        Some(TableEntry::Ones) | None => {}
                    }
                }
                plan.push((String::from_utf8_lossy(&b.entry.name).into_owned(), pieces));
            }
            plan
        };
        // Phase 2: each write durable; then the bits are.
        let mut written: Vec<(String, usize, Vec<u64>)> = Vec::new();
        for (name, pieces) in plan {
            for p in pieces {
                match p {
                    Piece::Sectors {
                        first,
                        end,
                        at,
                        set,
                    } => {
                        let Some(words) = self.shared.bitmaps.disk_words(&name, first, end, &set)
                        else {
                            continue;
                        };
                        let mut bytes = vec![0u8; (end - first) * 8];
                        bitmap::words_to_bytes(&words, 0, &mut bytes);
                        let mut m = self.meta.lock().await;
                        self.shared
                            .guard_write(&mut m, at, bytes.len() as u64, Writing::Data)
                            .await?;
                        drop(m);
                        // Durable on its own (RWF_DSYNC where the storage can): the data
                        // writes in flight elsewhere need not reach the disk for it.
                        self.shared
                            .file
                            .write_at_durable(&bytes, at)
                            .await
                            .map_err(|e| self.shared.storage_error(e))?;
                        written.push((name.clone(), first, words));
                    }
                    Piece::NewCluster { t, set } => {
                        let (first, end) = (t * words_per_cluster, (t + 1) * words_per_cluster);
                        let Some(words) = self.shared.bitmaps.disk_words(&name, first, end, &set)
                        else {
                            continue;
                        };
                        self.new_bitmap_cluster(&name, t, &words).await?;
                        written.push((name.clone(), first, words));
                    }
                }
            }
        }
        for (name, first, words) in written {
            self.shared.bitmaps.note_durable(&name, first, &words);
        }
        Ok(())
    }

    /// Gives bitmap `name` a data cluster for its table entry `t` (which said "all clear"):
    /// allocated, written with `words`, counted durably, then named by the table entry
    /// (rewritten in place), durably.
    async fn new_bitmap_cluster(&self, name: &str, t: usize, words: &[u64]) -> Result<()> {
        let cs = self.shared.geo.cluster_size();
        let table_at = {
            let state = self.shared.bitmaps.read();
            let Ok(i) = state.index(name) else {
                return Ok(());
            };
            state.list[i].entry.table_offset
        };
        let mut data = vec![0u8; cs as usize];
        bitmap::words_to_bytes(words, 0, &mut data);
        let mut m = self.meta.lock().await;
        let at = self.shared.alloc_clusters(&mut m, 1).await?;
        self.shared
            .write_guarded(&mut m, at, &data, Writing::Data)
            .await?;
        self.shared.flush_meta(&mut m).await?;
        let entry = bitmap::encode_table(&[TableEntry::Data(at)]);
        self.shared
            .write_guarded(&mut m, table_at + t as u64 * 8, &entry, Writing::Data)
            .await?;
        drop(m);
        self.shared.flush_file().await?;
        let mut state = self.shared.bitmaps.write();
        if let Ok(i) = state.index(name) {
            if let Some(e) = state.list[i].table.get_mut(t) {
                *e = TableEntry::Data(at);
            }
        }
        Ok(())
    }

    /// Marks `in_use` on disk, durably, every crash-consistent bitmap the disk would
    /// otherwise misstate (disabled or removed since the open; all of them before a resize),
    /// and treats them as QEMU treats its own from then on: stored at close.
    pub(crate) async fn mark_in_use_pending(&self) -> Result<()> {
        if !self.shared.bitmaps.in_use_pending.load(Ordering::Acquire) {
            return Ok(());
        }
        let Some((dir_at, entries)) = self.shared.bitmaps.disk_directory_with_in_use() else {
            return Ok(());
        };
        let mut m = self.meta.lock().await;
        self.write_directory(&mut m, dir_at, &bitmap::encode_directory(&entries))
            .await?;
        drop(m);
        self.shared.flush_file().await?;
        self.shared.bitmaps.in_use_done(&entries);
        Ok(())
    }

    /// Stores every bitmap on disk now, as a close does, and keeps them crash-consistent
    /// from there (a transaction's checkpoint: the bitmap it adds survives a crash, the one
    /// it disables is kept consistent with its final bits). The caller holds every range
    /// lock, so no request is between recording itself and changing data; this holds the
    /// group commit, so no durable write of bits runs meanwhile. A write that records itself
    /// during the store (its bitmaps are out of the list then) records itself again once it
    /// holds its range lock (the epoch moves, see [`recorded`](Self::recorded)).
    pub(crate) async fn persist_bitmaps(&self) -> Result<()> {
        if !self.shared.bitmaps.crash_consistent() {
            return Ok(());
        }
        let _commits = self.shared.bitmaps.sync.lock().await;
        let mut m = self.meta.lock().await;
        let stored = self.store_bitmaps(&mut m).await;
        drop(m);
        // Whatever happened, the list is back: recording resumes (and the epoch moves).
        self.shared.bitmaps.stored(stored.is_ok());
        stored
    }

    /// Before a resize: every crash-consistent bitmap goes `in_use` on disk (its table no
    /// longer fits the disk until the close stores it).
    pub(crate) async fn bitmaps_in_use_before_resize(&self) -> Result<()> {
        if !self.shared.bitmaps.crash_consistent() {
            return Ok(());
        }
        let _guard = self.shared.bitmaps.sync.lock().await;
        self.shared.bitmaps.want_all_in_use();
        self.mark_in_use_pending().await
    }
}

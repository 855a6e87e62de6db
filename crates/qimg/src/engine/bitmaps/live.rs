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
//! meanwhile (a group commit under one lock), and that write sets on disk (not in memory)
//! every bit of the 512-byte sector it writes: 4096 granules (256 MiB of guest data at
//! 64 KiB granularity, 2 MiB at 512 bytes), whose later writes then cost nothing. A bitmap
//! data cluster that does not exist yet (its table entry says "all clear") is allocated,
//! written and counted durably before the table entry (rewritten in place) names it.
//!
//! The bits in memory stay exact and a clean close stores them as they are: the sectors set
//! ahead matter only after a crash, where the bitmap then claims every granule of each
//! sector written to since the open (still an incremental backup, where QEMU's writer leaves
//! every bitmap inconsistent and the next backup must be full). Changes that would make the
//! disk claim more than it may (disabling or removing a bitmap, resizing the disk) first mark
//! the bitmaps concerned `in_use` on disk, durably: a crash then leaves those inconsistent,
//! as QEMU's writer leaves every bitmap. Adding, clearing and merging need nothing: until
//! the close stores them, the disk holds the state before them, which is still a superset of
//! what changed since then.
//!
//! [`OpenOptions::crash_consistent_bitmaps`]: crate::OpenOptions::crash_consistent_bitmaps

use std::sync::atomic::Ordering;

use qimg_format::bitmap::{self, FLAG_IN_USE, TableEntry};
use qimg_io::Storage;

use crate::engine::image::Inner;
use crate::engine::overlap::Writing;
use crate::error::Result;

/// Bytes of bitmap data one durable write covers (4096 bits), all set on disk.
const SECTOR: u64 = 512;

/// One durable write to make for a bitmap: its words `[first, end)` (a sector) in place, or,
/// for a data cluster not allocated yet (table entry `t`), the whole cluster with the words
/// of `sectors` set.
#[derive(Debug)]
enum Piece {
    Sectors {
        first: usize,
        end: usize,
        at: u64,
    },
    NewCluster {
        t: usize,
        sectors: Vec<(usize, usize)>,
    },
}

impl<S: Storage> Inner<S> {
    /// Records a write, write-zeroes or discard of `[offset, offset + len)` in every enabled
    /// bitmap and, for crash-consistent bitmaps, makes the bits durable before returning.
    /// Every path that changes guest data calls this before it changes anything.
    pub(crate) async fn record_change(&self, offset: u64, len: u64) -> Result<()> {
        if self.bitmaps.mark(offset, len) {
            return Ok(());
        }
        self.sync_bitmaps(offset, len).await
    }

    /// Makes the bits of `[offset, offset + len)` durable in every crash-consistent bitmap
    /// (the group commit, see the module notes).
    async fn sync_bitmaps(&self, offset: u64, len: u64) -> Result<()> {
        self.bitmaps.push_pending(offset, len);
        let _commit = self.bitmaps.sync.lock().await;
        self.mark_in_use_pending().await?;
        if self.bitmaps.durable_covers(offset, len) {
            // A commit that ran while this one waited wrote it.
            return Ok(());
        }
        let ranges = self.bitmaps.take_pending();
        let cs = self.geo.cluster_size();
        let words_per_cluster = (cs / 8) as usize;
        let words_per_sector = (SECTOR / 8) as usize;
        // Phase 1: the sectors to write, bitmap by bitmap (by name: the list may change
        // meanwhile), and the data clusters to create.
        let plan: Vec<(String, Vec<Piece>)> = {
            let state = self.bitmaps.read();
            state
                .list
                .iter()
                .filter(|b| b.live() && b.enabled())
                .map(|b| {
                    let mut sectors: Vec<usize> = Vec::new();
                    for &(a, l) in ranges.iter().filter(|r| r.1 > 0) {
                        if b.durable_covers(a, l) {
                            continue;
                        }
                        let (g0, g1) = b.granules(a, l);
                        let (s0, s1) = (g0 / 4096, (g1 - 1) / 4096);
                        sectors.extend(s0 as usize..=s1 as usize);
                    }
                    sectors.sort_unstable();
                    sectors.dedup();
                    let mut pieces: Vec<Piece> = Vec::new();
                    for s in sectors {
                        let first = s * words_per_sector;
                        if first >= b.words.len() {
                            continue;
                        }
                        let end = ((s + 1) * words_per_sector).min(b.words.len());
                        let t = first / words_per_cluster;
                        match b.table.get(t) {
                            Some(TableEntry::Data(at)) => pieces.push(Piece::Sectors {
                                first,
                                end,
                                at: at + (first % words_per_cluster) as u64 * 8,
                            }),
                            Some(TableEntry::Zeros) => match pieces.last_mut() {
                                Some(Piece::NewCluster { t: u, sectors }) if *u == t => {
                                    sectors.push((first, end));
                                }
                                _ => pieces.push(Piece::NewCluster {
                                    t,
                                    sectors: vec![(first, end)],
                                }),
                            },
                            // All set on disk already.
                            Some(TableEntry::Ones) | None => {}
                        }
                    }
                    (String::from_utf8_lossy(&b.entry.name).into_owned(), pieces)
                })
                .collect()
        };
        // Phase 2: the writes, then one flush; then the bits are durable.
        let mut written: Vec<(String, usize, Vec<u64>)> = Vec::new();
        for (name, pieces) in plan {
            for p in pieces {
                match p {
                    Piece::Sectors { first, end, at } => {
                        let Some(words) =
                            self.bitmaps.disk_words(&name, first, end, &[(first, end)])
                        else {
                            continue;
                        };
                        let mut bytes = vec![0u8; (end - first) * 8];
                        bitmap::words_to_bytes(&words, 0, &mut bytes);
                        let mut m = self.meta.lock().await;
                        self.write_guarded(&mut m, at, &bytes, Writing::Data)
                            .await?;
                        drop(m);
                        written.push((name.clone(), first, words));
                    }
                    Piece::NewCluster { t, sectors } => {
                        let (first, end) = (t * words_per_cluster, (t + 1) * words_per_cluster);
                        let Some(words) = self.bitmaps.disk_words(&name, first, end, &sectors)
                        else {
                            continue;
                        };
                        self.new_bitmap_cluster(&name, t, &words).await?;
                        written.push((name.clone(), first, words));
                    }
                }
            }
        }
        self.file.flush().await.map_err(|e| self.storage_error(e))?;
        for (name, first, words) in written {
            self.bitmaps.note_durable(&name, first, &words);
        }
        Ok(())
    }

    /// Gives bitmap `name` a data cluster for its table entry `t` (which said "all clear"):
    /// allocated, written with `words`, counted durably, then named by the table entry
    /// (rewritten in place), durably.
    async fn new_bitmap_cluster(&self, name: &str, t: usize, words: &[u64]) -> Result<()> {
        let cs = self.geo.cluster_size();
        let table_at = {
            let state = self.bitmaps.read();
            let Ok(i) = state.index(name) else {
                return Ok(());
            };
            state.list[i].entry.table_offset
        };
        let mut data = vec![0u8; cs as usize];
        bitmap::words_to_bytes(words, 0, &mut data);
        let mut m = self.meta.lock().await;
        let at = self.alloc_clusters(&mut m, 1).await?;
        self.write_guarded(&mut m, at, &data, Writing::Data).await?;
        self.flush_meta(&mut m).await?;
        let entry = TableEntry::Data(at).encode().to_be_bytes();
        self.write_guarded(&mut m, table_at + t as u64 * 8, &entry, Writing::Data)
            .await?;
        drop(m);
        self.file.flush().await.map_err(|e| self.storage_error(e))?;
        let mut state = self.bitmaps.write();
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
        if !self.bitmaps.in_use_pending.load(Ordering::Acquire) {
            return Ok(());
        }
        let Some((dir_at, entries)) = self.bitmaps.disk_directory_with_in_use() else {
            return Ok(());
        };
        let mut m = self.meta.lock().await;
        self.write_directory(&mut m, dir_at, &bitmap::encode_directory(&entries))
            .await?;
        drop(m);
        self.file.flush().await.map_err(|e| self.storage_error(e))?;
        self.bitmaps.in_use_done(&entries);
        Ok(())
    }

    /// Before a resize: every crash-consistent bitmap goes `in_use` on disk (its table no
    /// longer fits the disk until the close stores it).
    pub(crate) async fn bitmaps_in_use_before_resize(&self) -> Result<()> {
        if !self.bitmaps.crash_consistent() {
            return Ok(());
        }
        let _guard = self.bitmaps.sync.lock().await;
        self.bitmaps.want_all_in_use();
        self.mark_in_use_pending().await
    }
}

/// Whether a bitmap's on-disk directory entry says `in_use`.
pub(super) fn in_use(flags: u32) -> bool {
    flags & FLAG_IN_USE != 0
}

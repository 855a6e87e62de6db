//! QEMU's rebuild of the refcount structure (`rebuild_refcount_structure`), for `-r all`
//! when the refcount table or a block is damaged: new blocks and table go into the first free
//! clusters (never into the clusters of the damaged structure), the blocks are encoded from
//! the computed references by the engine's one refblock encoder, and the header is switched.

use std::collections::BTreeSet;

use qimg_format::header::{encode_refcount_table_pointer, field};
use qimg_format::lenient::{RawReftableEntry, TABLE_WORD, encode_words};
use qimg_format::validate::MAX_REFTABLE_BYTES;
use qimg_io::Storage;

use super::checker::{Checker, c_hex};
use super::{Counters, EFBIG, EIO, Failure, io_failure, strerror};
use crate::engine::walk::encode_refblock;

/// The clusters a rebuild must not place its structure in: single clusters and ranges.
pub(super) struct Avoid {
    clusters: BTreeSet<u64>,
    /// Sorted, merged `[start, end)` cluster ranges.
    ranges: Vec<(u64, u64)>,
}

impl Avoid {
    fn new(clusters: BTreeSet<u64>, ranges: &[(u64, u64)]) -> Self {
        let mut sorted = ranges.to_vec();
        sorted.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(sorted.len());
        for (start, end) in sorted {
            match merged.last_mut() {
                Some(last) if start <= last.1 => last.1 = last.1.max(end),
                _ => merged.push((start, end)),
            }
        }
        Self {
            clusters,
            ranges: merged,
        }
    }

    fn insert(&mut self, cluster: u64) {
        self.clusters.insert(cluster);
    }

    fn contains(&self, cluster: u64) -> bool {
        if self.clusters.contains(&cluster) {
            return true;
        }
        let i = self.ranges.partition_point(|&(start, _)| start <= cluster);
        i > 0 && cluster < self.ranges[i - 1].1
    }
}

impl<S: Storage> Checker<'_, S> {
    // ----- rebuild -----

    /// `alloc_clusters_imrt`, never handing out a cluster in `avoid`.
    pub(super) fn alloc_imrt(&mut self, count: u64, first_free: &mut u64, avoid: &Avoid) -> u64 {
        let mut cluster = *first_free;
        let mut contiguous = 0u64;
        let mut first_gap = true;
        // Past the end of the references every cluster is free but for the avoided ones
        // (finitely many): the search goes on over those too, where stopping at the end of
        // the references would have placed the structure on them.
        while contiguous < count {
            if self.refs.get(cluster) == 0 && !avoid.contains(cluster) {
                contiguous += 1;
                if first_gap {
                    *first_free = cluster;
                    first_gap = false;
                }
            } else {
                contiguous = 0;
            }
            cluster += 1;
        }
        self.refs.size = self.refs.size.max(cluster);
        let start = cluster - contiguous;
        if first_gap {
            // No free cluster from *first_free up to `start`: the next search may begin here
            // (same result as QEMU's, without rescanning the image for every refcount block).
            *first_free = (*first_free).max(start);
        }
        for k in start..start + count {
            self.refs.set(k, 1);
        }
        start * self.cluster_size
    }

    /// Refcount block `j` as the computed references say (counts above the refcount width
    /// are stored as its maximum: the overflow was reported).
    pub(super) fn encode_block(&self, j: u64) -> Vec<u8> {
        let block = encode_refblock(
            &self.refs,
            &self.refcount_geometry,
            j,
            std::iter::empty(),
            true,
        );
        block.unwrap_or_else(|_| vec![0u8; self.cluster_size as usize])
    }

    /// `rebuild_refcounts_write_refblocks`: returns whether the table grew.
    pub(super) async fn write_refblocks(
        &mut self,
        first: u64,
        end: u64,
        table: &mut Vec<u64>,
        avoid: &Avoid,
    ) -> std::result::Result<bool, Failure> {
        let e = self.entries;
        let cluster_size = self.cluster_size;
        let mut first_free = 0u64;
        let mut grown = false;
        let mut end = end;
        let mut cluster = first;
        while cluster < end {
            let Some(c) = self.refs.next_nonzero(cluster, end) else {
                break;
            };
            let j = c / e;
            let start = j * e;
            let offset = match table.get(j as usize) {
                Some(&o) if o != 0 => o,
                _ => {
                    first_free = first_free.max(start);
                    let o = self.alloc_imrt(1, &mut first_free, avoid);
                    if o / cluster_size >= end {
                        end = o / cluster_size + 1;
                    }
                    if table.len() as u64 <= j {
                        let len =
                            ((j + 1) * TABLE_WORD).next_multiple_of(cluster_size) / TABLE_WORD;
                        if len * TABLE_WORD > MAX_REFTABLE_BYTES {
                            self.msg(format!("ERROR allocating refblock: {EFBIG}"));
                            return Err(Failure(EFBIG.into()));
                        }
                        table.resize(len as usize, 0);
                        grown = true;
                    }
                    table[j as usize] = o;
                    o
                }
            };
            let block = self.encode_block(j);
            if let Err(e) = self.write(&block, offset).await {
                self.msg(format!("ERROR writing refblock: {}", strerror(&e)));
                return Err(io_failure(&e));
            }
            cluster = start + e;
        }
        Ok(grown)
    }

    /// `rebuild_refcount_structure`: new blocks and table in the first free clusters (never in
    /// a cluster of the current structure), then the header is switched to them.
    pub(super) async fn rebuild_refcount_structure(
        &mut self,
        res: &mut Counters,
    ) -> std::result::Result<(), Failure> {
        self.cache.clear();
        let cluster_size = self.cluster_size;
        // Besides the damaged structure: clusters past the end of the file that entries
        // name, and the part inside the file of every region that was not counted because it
        // runs past the end (a snapshot's L1 table at offset 0 with a huge size: a fuzz
        // finding). Such clusters may have refcount 0, yet the check reads them as tables;
        // a refcount block written there turns into entries that the next check reports,
        // and the repair would leave more corruptions than it found.
        let mut avoid = Avoid::new(self.beyond_eof.clone(), &self.uncounted);
        let rt_clusters = (self.reftable.len() as u64 * TABLE_WORD).div_ceil(cluster_size);
        for k in 0..rt_clusters {
            avoid.insert(self.reftable_offset / cluster_size + k);
        }
        for e in &self.reftable {
            let o = e.block_offset();
            if o != 0 {
                avoid.insert(o / cluster_size);
            }
        }
        // An active L1 table past the end of the file is not counted as in use, so the new
        // structure could land on it; QEMU's overlap check refuses that write and the repair
        // fails. Refuse before writing anything, leaving the image as it was.
        let l1_end = self
            .l1_offset
            .saturating_add(u64::from(self.l1_size) * TABLE_WORD);
        if self.l1_size > 0 && l1_end > self.file_len {
            self.msg(format!(
                "ERROR the active L1 table ({} entries at {}) lies past the end of the file; \
                 the refcount structure cannot be rebuilt around it",
                self.l1_size,
                c_hex(self.l1_offset)
            ));
            res.check_errors += 1;
            return Err(Failure(EIO.into()));
        }
        // Where the structure would go, found without writing anything (the walk is muted
        // and the references restored). A structure that must grow the file so far that an
        // uncounted region comes within one cluster of its end is not written at all: the
        // next check would count that region and find refcount 0 for each of its clusters,
        // so the repair would leave more corruptions than it found. The image is left as it
        // was and the pass fails, as when the active L1 table lies past the end.
        let saved = self.refs.clone();
        let mute = std::mem::replace(&mut self.mute, true);
        let plan = self.place_structure(&avoid).await;
        self.mute = mute;
        self.refs = saved;
        if let Ok((table, table_offset, table_clusters)) = &plan {
            let end = table
                .iter()
                .filter(|&&o| o != 0)
                .map(|&o| o / cluster_size + 1)
                .chain([table_offset / cluster_size + table_clusters])
                .max()
                .unwrap_or(0)
                .saturating_mul(cluster_size);
            if end > self.file_len && end > self.grow_limit {
                self.msg(format!(
                    "ERROR the refcount structure cannot be rebuilt without growing the file \
                     to {} bytes, which would bring regions past its end into it",
                    end
                ));
                res.check_errors += 1;
                return Err(Failure(EIO.into()));
            }
        }
        let (mut table, table_offset, table_clusters) = match self.place_structure(&avoid).await {
            Ok(p) => p,
            Err(f) => {
                res.check_errors += 1;
                return Err(f);
            }
        };
        let mut bytes = encode_words(&table);
        bytes.resize((table_clusters * cluster_size) as usize, 0);
        let pointer = encode_refcount_table_pointer(table_offset, table_clusters as u32);
        if let Err(e) = self.switch_reftable(&bytes, table_offset, &pointer).await {
            self.msg(format!("ERROR writing reftable: {}", strerror(&e)));
            return Err(io_failure(&e));
        }
        table.resize((table_clusters * cluster_size / TABLE_WORD) as usize, 0);
        self.reftable = table.into_iter().map(RawReftableEntry).collect();
        self.reftable_offset = table_offset;
        self.index = None;
        Ok(())
    }

    /// `rebuild_refcounts_write_refblocks` over the whole image, then the table placed
    /// (and the blocks it needs written) until it stops growing: returns the table, its
    /// offset and its length in clusters. Writes nothing while the checker is muted.
    async fn place_structure(
        &mut self,
        avoid: &Avoid,
    ) -> std::result::Result<(Vec<u64>, u64, u64), Failure> {
        let cluster_size = self.cluster_size;
        let mut table = Vec::new();
        let size = self.refs.size;
        self.write_refblocks(0, size, &mut table, avoid).await?;
        loop {
            let mut first_free = 0;
            let table_clusters = (table.len() as u64 * TABLE_WORD).div_ceil(cluster_size);
            let table_offset = self.alloc_imrt(table_clusters, &mut first_free, avoid);
            let start = table_offset / cluster_size;
            if self
                .write_refblocks(start, start + table_clusters, &mut table, avoid)
                .await?
            {
                continue;
            }
            return Ok((table, table_offset, table_clusters));
        }
    }

    /// Writes the new refcount table, then points the header at it, each made durable before
    /// the next step.
    async fn switch_reftable(
        &mut self,
        table: &[u8],
        table_offset: u64,
        pointer: &[u8],
    ) -> std::io::Result<()> {
        self.write(table, table_offset).await?;
        self.sync().await?;
        self.write(pointer, field::REFCOUNT_TABLE).await?;
        self.sync().await
    }
}

//! Zero clusters expanded in every L2 table, the active tree's and each snapshot's, before a
//! downgrade to version 2 (which has no zero clusters): QEMU's `qcow2_expand_zero_clusters`,
//! in its order, so that the file ends where QEMU's does.

use qimg_format::l2::{AnyL2Entry, L2Entry, write_entry};
use qimg_format::units::HostOffset;
use qimg_io::Storage;

use crate::engine::image::Inner;
use crate::engine::meta::Meta;
use crate::engine::overlap::Writing;
use crate::error::{Error, Result};

impl<S: Storage> Inner<S> {
    /// Rewrites the zero clusters of every L2 table in place, the active L1 table's first,
    /// then each snapshot's in the table's order: a zero cluster without host space becomes
    /// unallocated without a backing file, and otherwise gets a new cluster (counted once for
    /// each table that shares the L2 table); each is then written with zeros and its entry
    /// made a plain data entry (`COPIED` where its table has one reference). Standard L2
    /// entries only (a version 2 image has no extended ones; the caller refuses them).
    pub(crate) async fn expand_zero_clusters(&self) -> Result<()> {
        let _all = self.locks.lock(0, u64::MAX, true).await;
        let mut m = self.meta.lock().await;
        self.ensure_open(&m)?;
        // Tables shared between trees are changed in the file: the cache written back and
        // emptied of L2 slices first (QEMU empties it before the inactive tables).
        self.shared.flush_meta(&mut m).await?;
        let mut trees = vec![m.l1().to_vec()];
        for sn in self.read_snapshot_table(&m).await? {
            trees.push(self.read_snapshot_l1(&sn).await?);
        }
        let tables: Vec<u64> = trees
            .iter()
            .flatten()
            .filter_map(|e| e.l2_offset.map(|o| o.0))
            .collect();
        for &table in &tables {
            m.uncache_l2_table(table);
        }
        for tree in &trees {
            for table in tree.iter().filter_map(|e| e.l2_offset.map(|o| o.0)) {
                self.expand_in_table(&mut m, table).await?;
            }
        }
        self.shared.flush_meta(&mut m).await
    }

    /// [`expand_zero_clusters`](Self::expand_zero_clusters) for the L2 table at `table`.
    async fn expand_in_table(&self, m: &mut Meta, table: u64) -> Result<()> {
        let shared = &self.shared;
        let cs = shared.geo.cluster_size();
        let references = shared.refcount(m, table / cs).await?;
        let mut raw = vec![0u8; cs as usize];
        shared
            .file
            .read_at_zero_fill(&mut raw, table)
            .await
            .map_err(|e| shared.storage_error(e))?;
        let es = shared.geo.l2_entry_size() as usize;
        let mut dirty = false;
        for j in 0..raw.len() / es {
            let at = table + (j * es) as u64;
            let entry = AnyL2Entry::decode(&raw[j * es..(j + 1) * es], &shared.ctx, at)
                .map_err(|e| shared.fmt_err(e))?;
            let AnyL2Entry::Standard(L2Entry::Zero { preallocated, .. }) = entry else {
                continue;
            };
            let host = match preallocated {
                Some(h) => h.0,
                None if self.backing.is_none() => {
                    self.set_raw_entry(&mut raw, j, L2Entry::Unallocated)?;
                    dirty = true;
                    continue;
                }
                None => {
                    let host = shared.alloc_clusters(m, 1).await?;
                    // Counted once for each tree that shares the table.
                    for _ in 1..references {
                        shared.update_refcount(m, host / cs, 1).await?;
                    }
                    host
                }
            };
            shared.guard_write(m, host, cs, Writing::Data).await?;
            shared
                .file
                .write_zeroes(host, cs)
                .await
                .map_err(|e| shared.storage_error(e))?;
            let entry = L2Entry::Normal {
                host: HostOffset(host),
                copied: references == 1,
            };
            self.set_raw_entry(&mut raw, j, entry)?;
            dirty = true;
        }
        if dirty {
            // The zeros and the refcounts first, then the entries that name them.
            shared.flush_meta(m).await?;
            shared
                .file
                .write_at(&raw, table)
                .await
                .map_err(|e| shared.storage_error(e))?;
        }
        Ok(())
    }

    /// Entry `j` of the L2 table `raw` becomes `entry`.
    fn set_raw_entry(&self, raw: &mut [u8], j: usize, entry: L2Entry) -> Result<()> {
        write_entry(raw, j, &AnyL2Entry::Standard(entry))
            .map_err(|e| Error::corrupt(&self.shared.path, e.to_string()))
    }
}

//! Rebuilding refcounts from the L1/L2 trees: what a writable open does with an image whose
//! dirty bit is set (lazy refcounts after a crash), as QEMU does.
//!
//! Every reference is counted (header, L1 tables, L2 tables, data and compressed clusters,
//! the snapshot table); then a fresh refcount structure is written past the end of everything
//! in use and the header is switched to it. The old structure becomes free space.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use qimg_cache::SliceCache;
use qimg_format::l1;
use qimg_format::l2::{AnyL2Entry, L2Entry, decode_slice};
use qimg_format::refcount;
use qimg_format::snapshot::{MAX_TABLE_SIZE, decode_table};
use qimg_io::Storage;

use super::image::Inner;
use super::meta::{Meta, plan_refcount_area};
use crate::error::{Error, Result};

/// Counted references per host cluster.
#[derive(Debug, Default)]
pub(crate) struct References {
    pub(crate) counts: HashMap<u64, u64>,
}

impl References {
    fn add_range(&mut self, offset: u64, len: u64, cs: u64) {
        if len == 0 {
            return;
        }
        for c in offset / cs..=(offset + len - 1) / cs {
            *self.counts.entry(c).or_insert(0) += 1;
        }
    }

    fn max_cluster(&self) -> Option<u64> {
        self.counts.keys().copied().max()
    }
}

impl<S: Storage> Inner<S> {
    /// Counts every reference in the image (refcount structures excluded).
    pub(crate) async fn count_references(&self, m: &Meta) -> Result<References> {
        let cs = self.geo.cluster_size();
        let mut refs = References::default();
        refs.add_range(0, 1, cs);
        refs.add_range(m.l1_offset, m.l1.len() as u64 * 8, cs);
        self.count_tree(&m.l1, &mut refs).await?;
        let (snap_offset, nb) = m.snapshots;
        if nb > 0 {
            let len = self.file.len().await.map_err(|e| self.storage_error(e))?;
            let want = len.saturating_sub(snap_offset).min(MAX_TABLE_SIZE) as usize;
            let mut raw = vec![0u8; want];
            self.file
                .read_at_zero_fill(&mut raw, snap_offset)
                .await
                .map_err(|e| self.storage_error(e))?;
            let snaps = decode_table(&raw, snap_offset, nb, self.version)
                .map_err(|e| Error::format(&self.path, e))?;
            let table_len: usize = snaps.iter().map(|s| s.encoded_len()).sum();
            refs.add_range(snap_offset, table_len as u64, cs);
            for s in &snaps {
                let bytes = u64::from(s.l1_size) * 8;
                if bytes > qimg_format::validate::MAX_L1_BYTES {
                    return Err(Error::corrupt(
                        &self.path,
                        format!("snapshot L1 table of {} entries is too large", s.l1_size),
                    ));
                }
                refs.add_range(s.l1_table_offset, bytes, cs);
                let mut raw = vec![0u8; bytes as usize];
                self.file
                    .read_at(&mut raw, s.l1_table_offset)
                    .await
                    .map_err(|e| self.storage_error(e))?;
                let table = l1::decode_table(&raw, cs, s.l1_table_offset)
                    .map_err(|e| Error::format(&self.path, e))?;
                self.count_tree(&table, &mut refs).await?;
            }
        }
        Ok(refs)
    }

    async fn count_tree(&self, l1: &[l1::L1Entry], refs: &mut References) -> Result<()> {
        let cs = self.geo.cluster_size();
        let external = self.data_file.is_some() || self.ctx.external_data_file;
        let mut table = vec![0u8; cs as usize];
        for entry in l1 {
            let Some(t) = entry.l2_offset else { continue };
            refs.add_range(t.0, 1, cs);
            self.file
                .read_at(&mut table, t.0)
                .await
                .map_err(|e| self.storage_error(e))?;
            let entries =
                decode_slice(&table, &self.ctx, t.0).map_err(|e| Error::format(&self.path, e))?;
            for e in entries {
                let first = match &e {
                    AnyL2Entry::Standard(e) => e,
                    AnyL2Entry::Extended(x) => &x.entry,
                };
                match first {
                    L2Entry::Compressed(d) => {
                        refs.add_range(d.host_offset().0, d.compressed_size_bytes(), cs);
                    }
                    other => {
                        if let (Some(h), false) = (other.host_cluster(), external) {
                            refs.add_range(h.0, 1, cs);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Replaces the refcount structure with one computed from the references.
    ///
    /// Bounded by what the image holds: a reference lying wholly past the end of the file is
    /// refused as corruption (QEMU does not count such references either), and refcount
    /// blocks are written only where something is referenced, so the work and memory follow
    /// the number of references, not the largest offset.
    pub(crate) async fn rebuild_refcounts(&self, m: &mut Meta) -> Result<()> {
        let cs = self.geo.cluster_size();
        let e = self.rgeo.refblock_entries();
        let order = self.rgeo.refcount_order();
        let max = self.rgeo.max_refcount();
        let refs = self.count_references(m).await?;
        let file_len = self.file.len().await.map_err(|e| self.storage_error(e))?;
        let file_clusters = file_len.div_ceil(cs);
        if let Some(c) = refs.max_cluster().filter(|&c| c >= file_clusters) {
            let what = format!(
                "the image is dirty and host cluster {c} (offset {:#x}) is referenced but lies \
                 past the end of the file ({file_len} bytes): the refcounts cannot be rebuilt \
                 (run qimg check -r all)",
                c * cs
            );
            return Err(self.signal_corruption(m, what).await);
        }
        let sorted: BTreeMap<u64, u64> = refs.counts.into_iter().collect();
        let start = m
            .end_cluster
            .max(sorted.last_key_value().map_or(0, |(&c, _)| c + 1));
        // Blocks below the new area that would hold only zeros are left out: mark them as
        // present for the planner, then clear them from the table.
        let used: BTreeSet<u64> = sorted.keys().map(|c| c / e).collect();
        let mut skip = vec![0u64; (start / e) as usize];
        for (j, slot) in skip.iter_mut().enumerate() {
            if !used.contains(&(j as u64)) {
                *slot = 1;
            }
        }
        let area = plan_refcount_area(&skip, 0, start, 1, cs, e);
        let end = area.end();
        let mut table = vec![0u64; (area.table_clusters * cs / 8) as usize];
        for (k, &j) in area.blocks.iter().enumerate() {
            let at = (area.start + k as u64) * cs;
            table[j as usize] = at;
            let mut block = vec![0u8; cs as usize];
            let area_here = (start.max(j * e)..end.min((j + 1) * e)).map(|c| (c, 1));
            let refs_here = sorted.range(j * e..(j + 1) * e).map(|(&c, &v)| (c, v));
            for (c, value) in refs_here.chain(area_here) {
                if value > max {
                    return Err(Error::corrupt(
                        &self.path,
                        format!(
                            "cluster {c} (offset {:#x}) has {value} references, more than \
                             {}-bit refcounts hold",
                            c * cs,
                            self.rgeo.refcount_bits()
                        ),
                    ));
                }
                refcount::set(&mut block, order, c % e, value)
                    .map_err(|e| Error::format(&self.path, e))?;
            }
            self.file
                .write_at(&block, at)
                .await
                .map_err(|e| self.storage_error(e))?;
        }
        self.install_reftable(m, table, area.table_offset(cs), area.table_clusters)
            .await?;
        let budget = m.rc.capacity() as u64 * cs;
        m.rc = SliceCache::new(budget, cs).map_err(|source| Error::Cache {
            path: self.path.clone(),
            source,
        })?;
        m.end_cluster = m.end_cluster.max(end);
        m.free_hint = 0;
        Ok(())
    }
}

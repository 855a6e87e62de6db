//! Rebuilding refcounts from the L1/L2 trees: what a writable open does with an image whose
//! dirty bit is set (lazy refcounts after a crash), as QEMU does.
//!
//! Every reference is counted (header, L1 tables, L2 tables, data and compressed clusters,
//! the snapshot table); then a fresh refcount structure is written past the end of everything
//! in use and the header is switched to it. The old structure becomes free space.

use std::collections::BTreeSet;

use qimg_format::lenient::{L2Layout, TABLE_WORD};
use qimg_io::Storage;

use super::image::Inner;
use super::meta::{Meta, plan_refcount_area};
use super::walk::{Overflow, ReferenceCounts, WalkError, Walker, encode_refblock};
use crate::error::{Error, Result};

impl<S: Storage> Inner<S> {
    /// The walker over the image file, reading strictly (a table past the end of the file
    /// is an error, as everywhere in the engine).
    pub(crate) fn walker(&self) -> Walker<'_, S> {
        let layout = L2Layout {
            cluster_bits: self.shared.geo.cluster_bits(),
            extended: self.shared.geo.extended_l2(),
            external_data: self.shared.data_file.is_some() || self.shared.ctx.external_data_file,
        };
        Walker::new(&self.shared.file, layout)
    }

    pub(crate) fn walk_error(&self, e: WalkError) -> Error {
        match e {
            WalkError::Storage(e) => self.shared.storage_error(e),
            WalkError::Format(e) => Error::format(&self.shared.path, e),
            WalkError::TooLarge { bytes, .. } => Error::corrupt(
                &self.shared.path,
                format!(
                    "snapshot L1 table of {} entries is too large",
                    bytes / TABLE_WORD
                ),
            ),
        }
    }

    /// Counts every reference in the image (refcount structures excluded), through the
    /// metadata walker.
    pub(crate) async fn count_references(&self, m: &Meta) -> Result<ReferenceCounts> {
        let cs = self.shared.geo.cluster_size();
        let external = self.shared.data_file.is_some() || self.shared.ctx.external_data_file;
        let walker = self.walker();
        let mut refs = ReferenceCounts::default();
        let mut count = |r: super::walk::Reference| refs.add_range(r.offset, r.len, cs);
        count(super::walk::Reference {
            structure: super::walk::Structure::Header,
            offset: 0,
            len: 1,
        });
        count(super::walk::Reference {
            structure: super::walk::Structure::L1Table,
            offset: m.l1_offset(),
            len: m.l1_len() as u64 * TABLE_WORD,
        });
        walker
            .visit_tree(m.l1(), &self.shared.ctx, external, &mut count)
            .await
            .map_err(|e| self.walk_error(e))?;
        let (snap_offset, nb) = m.snapshot_table();
        walker
            .visit_snapshots(snap_offset, nb, &self.shared.ctx, external, &mut count)
            .await
            .map_err(|e| self.walk_error(e))?;
        // The bitmaps the open loaded (consistent or not): directory, tables, data clusters.
        let (directory, tables) = self.shared.bitmaps.layout();
        if let Some((at, len)) = directory {
            let bitmap = |offset, len| super::walk::Reference {
                structure: super::walk::Structure::Bitmap,
                offset,
                len,
            };
            count(bitmap(at, len));
            for (table_at, entries) in tables.into_iter().filter(|&(_, n)| n > 0) {
                count(bitmap(table_at, entries * TABLE_WORD));
                let table = walker
                    .read_bitmap_table(table_at, entries)
                    .await
                    .map_err(|e| self.walk_error(e))?;
                for e in table.into_iter().filter(|e| e.offset() != 0) {
                    count(bitmap(e.offset(), cs));
                }
            }
        }
        Ok(refs)
    }

    /// The first cluster past the refcount table and every block it names.
    fn structure_end(m: &Meta, cs: u64) -> u64 {
        let table_clusters = (m.reftable().len() as u64 * TABLE_WORD).div_ceil(cs).max(1);
        let blocks = m
            .reftable()
            .iter()
            .filter(|&&b| b != 0)
            .map(|&b| b / cs + 1);
        blocks
            .chain(std::iter::once(m.reftable_offset() / cs + table_clusters))
            .max()
            .unwrap_or(0)
    }

    /// What QEMU's repair of this dirty image prints (`qcow2_check` with both fixes, run by
    /// its read-write open, which qemu-io shows): a line per cluster whose refcount on disk
    /// differs from its references (`ERROR` where the disk says 0, which makes QEMU rebuild
    /// the structure; `Repairing` otherwise), then, after a rebuild, `Rebuilding refcount
    /// structure` and the old table's and blocks' clusters left behind as leaks. The old
    /// structure counts as referenced until then, as QEMU counts it. Bounded by the blocks
    /// the table names within the file.
    async fn repair_messages(
        &self,
        m: &Meta,
        refs: &ReferenceCounts,
        file_len: u64,
    ) -> Result<Vec<String>> {
        use qimg_format::refcount;
        let cs = self.shared.geo.cluster_size();
        let e = self.shared.rgeo.refblock_entries();
        let order = self.shared.rgeo.refcount_order();
        let mut old: BTreeSet<u64> = BTreeSet::new();
        let table_clusters = (m.reftable().len() as u64 * TABLE_WORD).div_ceil(cs).max(1);
        old.extend((0..table_clusters).map(|k| m.reftable_offset() / cs + k));
        let mut disk: std::collections::BTreeMap<u64, u64> = Default::default();
        let mut block = vec![0u8; cs as usize];
        for (j, &at) in m.reftable().iter().enumerate() {
            if at == 0 || at % cs != 0 || at + cs > file_len {
                continue;
            }
            old.insert(at / cs);
            self.shared
                .file
                .read_at(&mut block, at)
                .await
                .map_err(|e| self.shared.storage_error(e))?;
            let values =
                refcount::decode_block(&block, order).map_err(|e| self.shared.fmt_err(e))?;
            for (k, v) in values.into_iter().enumerate().filter(|&(_, v)| v != 0) {
                disk.insert(j as u64 * e + k as u64, v);
            }
        }
        let referenced = |c: u64| refs.get(c) + u64::from(old.contains(&c));
        let mut clusters: BTreeSet<u64> = disk.keys().copied().collect();
        if let Some(max) = refs.max_cluster() {
            clusters.extend(refs.nonzero_in(0, max + 1).into_iter().map(|(c, _)| c));
        }
        clusters.extend(old.iter().copied());
        let mut lines = Vec::new();
        let mut rebuild = false;
        for c in clusters {
            let (r1, r2) = (disk.get(&c).copied().unwrap_or(0), referenced(c));
            if r1 == r2 {
                continue;
            }
            let word = if r1 == 0 {
                rebuild = true;
                "ERROR"
            } else {
                "Repairing"
            };
            lines.push(format!("{word} cluster {c} refcount={r1} reference={r2}"));
        }
        if rebuild {
            lines.push("Rebuilding refcount structure".into());
            lines.extend(
                old.iter()
                    .map(|c| format!("Repairing cluster {c} refcount=1 reference=0")),
            );
        }
        Ok(lines)
    }

    /// Replaces the refcount structure with one computed from the references.
    ///
    /// Bounded by what the image holds: a reference lying wholly past the end of the file is
    /// refused as corruption (QEMU does not count such references either), and refcount
    /// blocks are written only where something is referenced, so the work and memory follow
    /// the number of references, not the largest offset.
    pub(crate) async fn rebuild_refcounts(&self, m: &mut Meta) -> Result<()> {
        self.shared.refuse_unaligned_l2(m).await?;
        let cs = self.shared.geo.cluster_size();
        let e = self.shared.rgeo.refblock_entries();
        let refs = self.count_references(m).await?;
        let file_len = self.shared.file_len().await?;
        let file_clusters = file_len.div_ceil(cs);
        if let Some(c) = refs.max_cluster().filter(|&c| c >= file_clusters) {
            let what = format!(
                "the image is dirty and host cluster {c} (offset {:#x}) is referenced but lies \
                 past the end of the file ({file_len} bytes): the refcounts cannot be rebuilt \
                 (run qimg check -r all)",
                c * cs
            );
            return Err(self.shared.signal_corruption(m, what).await);
        }
        let messages = self.repair_messages(m, &refs, file_len).await?;
        m.set_messages(messages);
        // Right after the last referenced cluster: what lies past it is referenced by nothing
        // (a crash can leave a writer's reservation there, zeros), so the new structure goes
        // where QEMU's rebuild puts it and the file is cut after it below.
        // The structure in use stays until the new one replaces it: after it, too.
        let live_end = Self::structure_end(m, cs);
        let start = refs.max_cluster().map_or(0, |c| c + 1).max(live_end);
        // Blocks below the new area that would hold only zeros are left out: mark them as
        // present for the planner, then clear them from the table.
        let used: BTreeSet<u64> = refs
            .windows(0, start)
            .into_iter()
            .filter(|&(a, b)| refs.next_nonzero(a, b).is_some())
            .flat_map(|(a, b)| refs.nonzero_in(a, b))
            .map(|(c, _)| c / e)
            .collect();
        let mut skip = vec![0u64; (start / e) as usize];
        for (j, slot) in skip.iter_mut().enumerate() {
            if !used.contains(&(j as u64)) {
                *slot = 1;
            }
        }
        let area = plan_refcount_area(&skip, 0, start, 1, 0, cs, e);
        let end = area.end();
        let mut table = vec![0u64; (area.table_clusters * cs / TABLE_WORD) as usize];
        for (k, &j) in area.blocks.iter().enumerate() {
            let at = (area.start + k as u64) * cs;
            table[j as usize] = at;
            let area_here = (start.max(j * e)..end.min((j + 1) * e)).map(|c| (c, 1));
            let block = encode_refblock(&refs, &self.shared.rgeo, j, area_here, false).map_err(
                |Overflow { cluster: c, value }| {
                    Error::corrupt(
                        &self.shared.path,
                        format!(
                            "cluster {c} (offset {:#x}) has {value} references, more than \
                             {}-bit refcounts hold",
                            c * cs,
                            self.shared.rgeo.refcount_bits()
                        ),
                    )
                },
            )?;
            self.shared
                .file
                .write_at(&block, at)
                .await
                .map_err(|e| self.shared.storage_error(e))?;
        }
        self.shared
            .install_reftable(m, table, area.table_offset(cs), area.table_clusters)
            .await?;
        m.refcounts_rebuilt(end).map_err(|source| Error::Cache {
            path: self.shared.path.clone(),
            source,
        })?;
        if file_len > end * cs {
            self.shared
                .file
                .set_len(end * cs)
                .await
                .map_err(|e| self.shared.storage_error(e))?;
        }
        Ok(())
    }
}

//! Write-zeroes and discard: whole subclusters change state by bitmap; partial ones are
//! written with zeros (write-zeroes) or left alone (discard); host clusters no subcluster
//! uses any more are freed when the caller allows unmapping.

use qimg_io::Storage;

use super::*;

impl<S: Storage> Inner<S> {
    pub(crate) async fn write_zeroes(&self, offset: u64, len: u64, unmap: bool) -> Result<()> {
        self.unmap(offset, len, Unmap::Zero { unmap }).await
    }

    pub(crate) async fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.unmap(offset, len, Unmap::Discard).await
    }

    /// Whole subclusters of the range become unallocated (reading from the backing file).
    pub(crate) async fn unallocate(&self, offset: u64, len: u64) -> Result<()> {
        self.unmap(offset, len, Unmap::Unallocate).await
    }

    /// Write-zeroes and discard: cluster by cluster, with the whole range held exclusively.
    pub(super) async fn unmap(&self, offset: u64, len: u64, how: Unmap) -> Result<()> {
        self.shared.check_writable()?;
        self.shared.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let recorded = self.record_change(offset, len).await?;
        let (first, end) = self.cluster_span(offset, len);
        let _guard = self.locks.lock(first, end, true).await;
        self.recorded(recorded, offset, len).await?;
        for (gc, a, n, _) in self.pieces(offset, len) {
            match how {
                Unmap::Zero { unmap } => self.zero_chunk(gc, a, a + n, unmap).await?,
                // Over a backing file a discarded subcluster becomes a zero subcluster, so
                // that the backing file's old data does not show again.
                Unmap::Discard if self.backing.is_some() => {
                    let b = self.extend_to_cluster_end_at_eof(gc, a + n);
                    let (first, end) = self.whole_subclusters(a, b);
                    let scs = self.shared.geo.subcluster_size() as usize;
                    if first < end {
                        self.zero_chunk(gc, first * scs, end * scs, true).await?;
                    }
                }
                Unmap::Discard | Unmap::Unallocate => self.discard_chunk(gc, a, a + n).await?,
            }
        }
        Ok(())
    }

    /// Subclusters `[first, end)` wholly inside `[a, b)`.
    pub(super) fn whole_subclusters(&self, a: usize, b: usize) -> (usize, usize) {
        let scs = self.shared.geo.subcluster_size() as usize;
        let first = a.div_ceil(scs);
        let end = b / scs;
        // The last cluster of an image whose size is not cluster aligned: its tail subcluster
        // counts as whole when the range reaches the end of the disk.
        (first, end.max(first))
    }

    /// Zeros `[a, b)` of guest cluster `gc`; with `unmap`, a host cluster no subcluster uses
    /// any more is freed, without it the host cluster stays linked (a standard entry becomes
    /// a preallocated zero cluster, an extended one keeps its offset with zero bits).
    pub(super) async fn zero_chunk(&self, gc: u64, a: usize, b: usize, unmap: bool) -> Result<()> {
        let scs = self.shared.geo.subcluster_size() as usize;
        let b_eff = self.extend_to_cluster_end_at_eof(gc, b);
        let (first, end) = self.whole_subclusters(a, b_eff);
        if first >= end {
            return self.write_chunk(gc, a, &vec![0u8; b - a]).await;
        }
        if a < first * scs {
            self.write_chunk(gc, a, &vec![0u8; first * scs - a]).await?;
        }
        if end * scs < b {
            self.write_chunk(gc, end * scs, &vec![0u8; b - end * scs])
                .await?;
        }
        let mut m = self.meta.lock().await;
        self.ensure_open(&m)?;
        let old = self.shared.lookup(&mut m, gc).await?;
        let (new, freed) = match old {
            AnyL2Entry::Standard(e) => {
                // v3 keeps the host cluster unless unmapping is allowed. (v2 has no zero
                // clusters: as QEMU, it unallocates without a backing file, whatever `unmap`
                // says, and writes zeros with one.)
                let kept = match e {
                    _ if unmap || self.shared.version == 2 => None,
                    L2Entry::Normal { host, copied } => Some((host, copied)),
                    L2Entry::Zero {
                        preallocated: Some(host),
                        copied,
                    } => Some((host, copied)),
                    _ => None,
                };
                let new = if self.shared.version == 2 {
                    if self.backing.is_some() {
                        drop(m);
                        return self
                            .write_chunk(gc, first * scs, &vec![0u8; (end - first) * scs])
                            .await;
                    }
                    L2Entry::Unallocated
                } else {
                    L2Entry::Zero {
                        preallocated: kept.map(|(host, _)| host),
                        copied: kept.is_some_and(|(_, copied)| copied),
                    }
                };
                let freed = match kept {
                    Some(_) => None,
                    None => old_reference(&e),
                };
                (AnyL2Entry::Standard(new), freed)
            }
            AnyL2Entry::Extended(x) => {
                let mask = subcluster_mask(first, end);
                match x.entry {
                    L2Entry::Compressed(_) if mask != ALL => {
                        drop(m);
                        return self
                            .write_chunk(gc, first * scs, &vec![0u8; (end - first) * scs])
                            .await;
                    }
                    L2Entry::Compressed(d) => (
                        AnyL2Entry::Extended(ExtendedL2Entry {
                            entry: L2Entry::Unallocated,
                            bitmap: SubclusterBitmap {
                                alloc: 0,
                                zero: ALL,
                            },
                        }),
                        Some(Freed::Compressed(d)),
                    ),
                    entry if !unmap => (
                        AnyL2Entry::Extended(ExtendedL2Entry {
                            entry,
                            bitmap: x.bitmap.with_zero(mask),
                        }),
                        None,
                    ),
                    entry => self.unlink_if_empty(entry, x.bitmap.with_zero(mask)),
                }
            }
        };
        if new == old {
            // QEMU makes the table writable (a missing one allocated, one a snapshot
            // shares copied) before it looks at the entries, so its file holds the table.
            return self.table_before_data(&mut m, gc).await;
        }
        if self.shared.data_file_raw {
            self.zero_raw_data(gc, first * scs, end * scs).await?;
        }
        self.shared.set_entry(&mut m, gc, &new).await?;
        if let Some(freed) = freed.filter(|_| self.shared.data_file.is_none()) {
            self.release(&mut m, freed).await?;
        }
        Ok(())
    }

    /// Extended entry with a new bitmap; a host cluster left without allocated subclusters is
    /// unlinked (and returned to be freed).
    pub(super) fn unlink_if_empty(
        &self,
        entry: L2Entry,
        bitmap: SubclusterBitmap,
    ) -> (AnyL2Entry, Option<Freed>) {
        match entry {
            L2Entry::Normal { host, .. } if bitmap.alloc == 0 => (
                AnyL2Entry::Extended(ExtendedL2Entry {
                    entry: L2Entry::Unallocated,
                    bitmap,
                }),
                Some(Freed::Cluster(host.0)),
            ),
            other => (
                AnyL2Entry::Extended(ExtendedL2Entry {
                    entry: other,
                    bitmap,
                }),
                None,
            ),
        }
    }

    /// At the end of a disk whose size is not a multiple of the cluster size, a range reaching
    /// the end covers the rest of the last (sub)cluster too.
    pub(super) fn extend_to_cluster_end_at_eof(&self, gc: u64, b: usize) -> usize {
        let size = self.shared.size();
        if gc + b as u64 == size {
            self.shared.geo.cluster_size() as usize
        } else {
            b
        }
    }

    pub(super) async fn zero_raw_data(&self, gc: u64, from: usize, to: usize) -> Result<()> {
        let (storage, path) = self.shared.data();
        let start = gc + from as u64;
        let len = (to - from) as u64;
        let len = len.min(self.shared.size().saturating_sub(start));
        storage
            .write_zeroes(start, len)
            .await
            .map(|_| ())
            .map_err(|e| Error::storage(path, e))
    }

    pub(super) async fn discard_chunk(&self, gc: u64, a: usize, b: usize) -> Result<()> {
        let scs = self.shared.geo.subcluster_size() as usize;
        let b = self.extend_to_cluster_end_at_eof(gc, b);
        let (first, end) = self.whole_subclusters(a, b);
        if first >= end {
            return Ok(());
        }
        let mut m = self.meta.lock().await;
        self.ensure_open(&m)?;
        let old = self.shared.lookup(&mut m, gc).await?;
        let (new, freed) = match old {
            AnyL2Entry::Standard(e) => (
                AnyL2Entry::Standard(L2Entry::Unallocated),
                old_reference(&e),
            ),
            AnyL2Entry::Extended(x) => {
                let mask = subcluster_mask(first, end);
                match x.entry {
                    L2Entry::Compressed(_) if mask != ALL => return Ok(()),
                    L2Entry::Compressed(d) => {
                        (self.shared.unallocated_entry(), Some(Freed::Compressed(d)))
                    }
                    entry => self.unlink_if_empty(entry, x.bitmap.with_unallocated(mask)),
                }
            }
        };
        if new == old {
            // As QEMU's discard (`discard_in_l2_slice`), which makes the table of a whole
            // discarded cluster writable first: a missing one allocated, a shared one copied.
            let whole = first == 0 && end * scs >= self.shared.geo.cluster_size() as usize;
            if whole {
                self.table_before_data(&mut m, gc).await?;
            }
            return Ok(());
        }
        if self.shared.data_file_raw {
            self.zero_raw_data(gc, first * scs, end * scs).await?;
        }
        self.shared.set_entry(&mut m, gc, &new).await?;
        if let Some(freed) = freed {
            if self.shared.data_file.is_none() {
                self.release(&mut m, freed).await?;
            } else if !self.shared.data_file_raw {
                let (storage, _) = self.shared.data();
                let _ = storage
                    .discard(gc + (first * scs) as u64, ((end - first) * scs) as u64)
                    .await;
            }
        }
        Ok(())
    }
}

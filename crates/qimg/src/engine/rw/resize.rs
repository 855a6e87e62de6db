//! Resizing the virtual disk: growing (a larger L1 table if needed, then the size in the
//! header; where a longer backing file would show through the new area it is zeroed, as
//! QEMU does) and shrinking ([`Image::shrink`]).
//!
//! Shrinking, as `qemu-img resize --shrink`: with extended L2 entries the whole subclusters of
//! a partly cut last cluster are made to read as zeros (so that growing again shows zeros
//! there); the new size is written to the header; then every cluster past the new end is
//! dropped: the entries of an L2 table that stays are made unallocated, and an L2 table
//! wholly past the end is unlinked from the L1 table (which keeps its size) before the
//! clusters it mapped and the table itself are freed. An L2 table shared with an internal
//! snapshot only loses this image's reference. A crash part way leaves at worst leaked
//! clusters (`qimg check -r leaks`), never an entry pointing at a freed cluster.

use qimg_format::header;
use qimg_format::l1::L1Entry;
use qimg_io::Storage;

use super::*;

impl<S: Storage> Inner<S> {
    pub(crate) async fn resize(&self, new_size: u64) -> Result<()> {
        self.resize_as(new_size, true).await
    }

    /// [`resize`](Self::resize) for QEMU's `falloc` and `full` growth: the data clusters
    /// come in QEMU's layout ([`preallocate_data`](Self::preallocate_data), which also makes
    /// the new area read zeros over a longer backing file), or where that layout does not
    /// apply, zeros are written over the new area.
    pub(crate) async fn resize_preallocated(&self, new_size: u64, full: bool) -> Result<()> {
        let old = self.shared.size();
        self.resize_as(new_size, false).await?;
        if new_size <= old || self.preallocate_data(old, new_size - old, full).await? {
            return Ok(());
        }
        let zeros = vec![0u8; 1 << 20];
        let mut at = old;
        while at < new_size {
            let n = (new_size - at).min(zeros.len() as u64 - at % zeros.len() as u64);
            self.write(&zeros[..n as usize], at).await?;
            at += n;
        }
        Ok(())
    }

    /// The length of the backing file as QEMU sees it when it grows an image (a raw file in
    /// whole sectors), 0 without one: where a longer one would show through a new area.
    pub(super) async fn backing_len(&self) -> Result<u64> {
        Ok(match &self.backing {
            None => 0,
            Some(Backing::Qcow2(b)) => b.inner.shared.size(),
            Some(Backing::Raw { storage, path }) => storage
                .len()
                .await
                .map_err(|e| Error::storage(path, e))?
                .next_multiple_of(512),
        })
    }

    /// QEMU's refusal to change the size of a version 2 image with internal snapshots (their
    /// size is not recorded in its snapshot table): one rule for growing and shrinking.
    fn check_resizable(&self, m: &Meta) -> Result<()> {
        if self.shared.version < 3 && m.snapshot_table().1 > 0 {
            return Err(Error::Unsupported {
                path: self.shared.path.clone(),
                what: "Can't resize a v2 image which has snapshots".into(),
            });
        }
        Ok(())
    }

    async fn resize_as(&self, new_size: u64, zero_backing: bool) -> Result<()> {
        self.shared.check_writable()?;
        let size = self.shared.size();
        if new_size < size {
            return Err(Error::Unsupported {
                path: self.shared.path.clone(),
                what: format!("shrinking from {size} to {new_size} bytes"),
            });
        }
        if new_size == size {
            return Ok(());
        }
        self.bitmaps_in_use_before_resize().await?;
        let entries = self
            .shared
            .geo
            .l1_size_for(new_size)
            .map_err(|e| Error::InvalidOption(format!("size {new_size}: {e}")))?;
        let _guard = self.locks.lock(0, u64::MAX, true).await;
        let mut m = self.meta.lock().await;
        self.ensure_open(&m)?;
        self.check_resizable(&m)?;
        self.shared.grow_l1(&mut m, entries).await?;
        if self.shared.data_file_raw {
            let (storage, path) = self.shared.data();
            let len = storage.len().await.map_err(|e| Error::storage(path, e))?;
            if len < new_size {
                storage
                    .set_len(new_size)
                    .await
                    .map_err(|e| Error::storage(path, e))?;
            }
        }
        self.write_size(new_size).await?;
        drop(m);
        drop(_guard);
        // As QEMU: where a longer backing file would show through the new area, it reads as
        // zeros instead.
        let zero_end = self.backing_len().await?.min(new_size);
        if zero_backing && zero_end > size {
            self.write_zeroes(size, zero_end - size, true).await?;
        }
        Ok(())
    }

    /// Writes the virtual size to the header, flushes, and makes it the size requests see.
    pub(crate) async fn write_size(&self, new_size: u64) -> Result<()> {
        self.shared
            .file
            .write_at(&header::encode_size(new_size), header::field::SIZE)
            .await
            .map_err(|e| self.shared.storage_error(e))?;
        self.shared.flush_file().await?;
        self.shared.size.store(new_size, Ordering::Release);
        self.shared.bitmaps.resize(new_size);
        Ok(())
    }

    pub(crate) async fn shrink(&self, new_size: u64) -> Result<()> {
        self.shared.check_writable()?;
        let size = self.shared.size();
        if new_size >= size {
            return self.resize(new_size).await;
        }
        if new_size % 512 != 0 {
            return Err(Error::InvalidOption(format!(
                "size {new_size}: the new size must be a multiple of 512"
            )));
        }
        let cs = self.shared.geo.cluster_size();
        let scs = self.shared.geo.subcluster_size();
        self.bitmaps_in_use_before_resize().await?;
        let _guard = self.locks.lock(0, u64::MAX, true).await;
        {
            let m = self.meta.lock().await;
            self.ensure_open(&m)?;
            self.check_resizable(&m)?;
        }
        // The whole subclusters past the new end of a partly cut cluster read as zeros (so
        // that growing again shows zeros there). The host cluster stays, as QEMU keeps every
        // cluster the new end falls in (its discard starts at the next cluster), so `check`
        // counts and ends the file as QEMU's.
        let within = new_size % cs;
        if self.shared.geo.extended_l2() && within != 0 {
            let gc = new_size - within;
            let first = within.div_ceil(scs) * scs;
            if first < cs && gc + first < size {
                self.zero_chunk(gc, first as usize, cs as usize, false)
                    .await?;
            }
        }
        self.write_size(new_size).await?;

        let keep_end = new_size.next_multiple_of(cs);
        let span = self.shared.geo.l2_coverage();
        let mut m = self.meta.lock().await;
        self.shared.refuse_unaligned_l2(&mut m).await?;
        // QEMU's discard of the cut range takes the L2 table of its first cluster for
        // writing (`get_cluster_table`): made if missing, copied if a snapshot shares it. The
        // table stays where the new end falls inside its range.
        if keep_end < size && keep_end % span != 0 {
            self.shared.writable_l2_slice(&mut m, keep_end).await?;
        }
        let first_table = keep_end / span;
        let tables = m.l1_len() as u64;
        for index in first_table..tables {
            let i = index as usize;
            let Some(table) = m.l1()[i].l2_offset else {
                continue;
            };
            let table_start = index * span;
            let from = keep_end.max(table_start);
            let to = (table_start + span).min(size.next_multiple_of(cs));
            if from == table_start {
                // The whole table goes: collect what it maps, unlink it, then free.
                let mut freed = Vec::new();
                if m.l1()[i].copied {
                    let mut gc = from;
                    while gc < to {
                        let e = self.shared.lookup(&mut m, gc).await?;
                        freed.extend(old_reference(e.entry()));
                        gc += cs;
                    }
                }
                self.shared
                    .write_l1_entry(&mut m, i, L1Entry::UNALLOCATED, None)
                    .await?;
                self.shared.flush_file().await?;
                m.forget_l2_table(table.0, false);
                if self.shared.data_file.is_none() {
                    for f in freed {
                        self.release(&mut m, f).await?;
                    }
                }
                self.shared.free_clusters(&mut m, table.0, 1).await?;
            } else {
                let unallocated = self.shared.unallocated_entry();
                let mut gc = from;
                while gc < to {
                    let old = self.shared.lookup(&mut m, gc).await?;
                    if old != unallocated {
                        self.shared.set_entry(&mut m, gc, &unallocated).await?;
                        if let Some(f) = old_reference(old.entry()) {
                            self.release(&mut m, f).await?;
                        }
                    }
                    gc += cs;
                }
            }
        }
        // The file shrinks too, as with qemu-img: refcount blocks that count nothing leave
        // the table and the file ends after its last cluster in use.
        self.shared.trim_file(&mut m).await
    }
}

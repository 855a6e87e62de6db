//! Metadata preallocation: a host cluster for every guest cluster of a range that has none,
//! linked without guest data written (qemu-img's `resize --preallocation=metadata`, qemu-io's
//! `truncate -m metadata`), so that later writes there allocate nothing.

use qimg_io::Storage;

use super::*;

impl<S: Storage> Inner<S> {
    /// Gives every guest cluster of `[offset, offset + len)` without a host cluster one,
    /// reading as before: a cluster never used reads as zeros (the file grows over it as a
    /// hole, as QEMU's does); a reused one is zeroed first. With extended L2 entries the host
    /// cluster is recorded and the subclusters keep their states (QEMU's layout); a standard
    /// entry becomes a normal cluster only where it read as zeros (a zero cluster, or
    /// unallocated without a backing file); where it shows the backing file it stays.
    pub(crate) async fn preallocate(&self, offset: u64, len: u64) -> Result<()> {
        self.shared.check_writable()?;
        self.shared.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let cs = self.shared.geo.cluster_size();
        let first = offset / cs * cs;
        let end = (offset + len)
            .next_multiple_of(cs)
            .min(self.shared.size().next_multiple_of(cs));
        let _guard = self.locks.lock(first, end - first, true).await;
        let mut m = self.meta.lock().await;
        self.ensure_open(&m)?;
        let backing = self.backing.is_some();
        let mut file_end = 0;
        let mut gc = first;
        let coverage = self.shared.geo.l2_coverage();
        while gc < end {
            // The run of clusters that want one, up to the end of their L2 table: allocated
            // in one contiguous piece, as QEMU's `handle_alloc` does (a free hole shorter
            // than the run is left alone).
            let table_end = (gc / coverage + 1) * coverage;
            let mut run = Vec::new();
            while gc < end && gc < table_end {
                let old = self.shared.lookup(&mut m, gc).await?;
                if !self.wants_preallocation(&old, backing) {
                    if run.is_empty() {
                        gc += cs;
                        continue;
                    }
                    break;
                }
                run.push(old);
                gc += cs;
            }
            if run.is_empty() {
                continue;
            }
            let run_start = gc - run.len() as u64 * cs;
            let n = run.len() as u64;
            let base = if self.shared.data_file.is_some() {
                // An external data file maps guest offsets to themselves.
                None
            } else {
                self.table_before_data(&mut m, run_start).await?;
                let unused_from = m.never_used_from();
                let host = self.shared.alloc_clusters(&mut m, n).await?;
                self.shared
                    .counters
                    .clusters_allocated
                    .fetch_add(n, Ordering::Relaxed);
                self.shared
                    .guard_write(&mut m, host, n * cs, Writing::Data)
                    .await?;
                Some((host, unused_from))
            };
            for (k, old) in run.into_iter().enumerate() {
                let g = run_start + k as u64 * cs;
                let host = match base {
                    None => g,
                    Some((start, unused_from)) => {
                        let host = start + k as u64 * cs;
                        // Subclusters of an extended entry keep their states: nothing reads
                        // the cluster's bytes until a write allocates them.
                        if host < unused_from && matches!(old, AnyL2Entry::Standard(_)) {
                            self.shared
                                .file
                                .write_zeroes(host, cs)
                                .await
                                .map_err(|e| self.shared.storage_error(e))?;
                        }
                        file_end = file_end.max(host + cs);
                        // Refcount increments reach the disk before the entry that uses them.
                        self.shared
                            .set_dependency(&mut m, CacheKind::L2, CacheKind::Refcount)
                            .await?;
                        host
                    }
                };
                // Extended: the subclusters keep their states.
                let entry = self.linked_entry(host, old.bitmap());
                self.shared.set_entry(&mut m, g, &entry).await?;
                // The grown file (below) and any zeros are durable before the entry.
                m.entries_wait_for_data();
            }
        }
        // The clusters past the end of the file become part of it, holes: an entry never
        // names a cluster past the end (`qemu-img check` would report it).
        let len = self.shared.file_len().await?;
        if file_end > len {
            // Zeros written over the last cluster only ever grow the file.
            self.shared
                .file
                .write_zeroes(file_end - cs, cs)
                .await
                .map_err(|e| self.shared.storage_error(e))?;
        }
        Ok(())
    }

    /// Whether metadata preallocation gives the cluster whose entry is `old` a host cluster:
    /// one without (not compressed); with standard entries only where it reads as zeros.
    fn wants_preallocation(&self, old: &AnyL2Entry, backing: bool) -> bool {
        match old {
            AnyL2Entry::Extended(x) => {
                x.entry.host_cluster().is_none() && !matches!(x.entry, L2Entry::Compressed(_))
            }
            AnyL2Entry::Standard(e) => match e {
                L2Entry::Zero {
                    preallocated: None, ..
                } => true,
                L2Entry::Unallocated => !backing,
                _ => false,
            },
        }
    }

    /// QEMU's growth with `falloc` or `full` preallocation (`qcow2_co_truncate`) of the
    /// guest range `[offset, offset + len)`, which must be unallocated (the area a resize
    /// just added): a new refcount table (and blocks, covering the data to come) after the
    /// last cluster in use, then one run of data clusters after it, reserved with
    /// `fallocate` (`full`: written with zeros) and linked as normal clusters (extended
    /// entries keep their subclusters unallocated, as QEMU's). A range starting inside a
    /// cluster takes that cluster too: it moves into the new run with its bytes before
    /// `offset` copied (QEMU's copy-on-write of the head). `Ok(false)`, nothing done, where
    /// QEMU's layout does not apply (an external data file, clusters of the range already
    /// allocated, a compressed head cluster): the caller writes zeros instead.
    pub(crate) async fn preallocate_data(&self, offset: u64, len: u64, full: bool) -> Result<bool> {
        self.shared.check_writable()?;
        self.shared.check_range(offset, len)?;
        let cs = self.shared.geo.cluster_size();
        if len == 0 {
            return Ok(true);
        }
        if self.shared.data_file.is_some() {
            return Ok(false);
        }
        let head = offset / cs * cs;
        let end = (offset + len).next_multiple_of(cs);
        let _guard = self.locks.lock(head, end - head, true).await;
        let mut m = self.meta.lock().await;
        self.ensure_open(&m)?;
        let mut gc = offset.next_multiple_of(cs);
        while gc < end {
            let old = self.shared.lookup(&mut m, gc).await?;
            if !matches!(
                old.entry(),
                L2Entry::Unallocated
                    | L2Entry::Zero {
                        preallocated: None,
                        ..
                    }
            ) {
                return Ok(false);
            }
            gc += cs;
        }
        // The head cluster's bytes before `offset`, as the guest reads them.
        let head_entry = self.shared.lookup(&mut m, head).await?;
        let mut head_bytes = self.shared.io_buf((offset - head) as usize)?;
        if offset > head {
            if matches!(head_entry.entry(), L2Entry::Compressed(_)) {
                return Ok(false);
            }
            drop(m);
            self.read_entry_range(&head_entry, head, 0, &mut head_bytes)
                .await?;
            m = self.meta.lock().await;
            self.ensure_open(&m)?;
        }
        let n_data = (end - head) / cs;
        let per_l2 = cs / self.shared.geo.l2_entry_size();
        // QEMU's overestimate: a table for a head and a tail too.
        let n_l2 = n_data.div_ceil(per_l2) + 1;
        // Past the last cluster in use (`qcow2_get_last_cluster`).
        let mut first = m.end_cluster();
        while first > 0 && self.shared.refcount(&mut m, first - 1).await? == 0 {
            first -= 1;
        }
        // QEMU's exact refcount metadata size (`qcow2_refcount_metadata_size`).
        let blocks = self
            .shared
            .rgeo
            .refcount_metadata_for(first + n_data + n_l2)
            .map_err(|e| self.shared.fmt_err(e))?
            .block_clusters;
        let e = self.shared.rgeo.refblock_entries();
        let data = self
            .shared
            .refcount_area(&mut m, first, blocks, blocks * e)
            .await?;
        self.shared.mark_dirty_if_lazy(&mut m).await?;
        for c in data..data + n_data {
            self.shared.update_refcount(&mut m, c, 1).await?;
        }
        self.shared.claimed(&mut m, data, n_data);
        self.shared
            .counters
            .clusters_allocated
            .fetch_add(n_data, Ordering::Relaxed);
        // The data area: what lies inside the file already is made to read zeros (QEMU's
        // file driver leaves it as it is: a hole where nothing was written, but stale bytes
        // where something was); past the end of the file it is reserved (falloc) or written
        // with zeros (full), as QEMU's file driver grows the file.
        let (at, bytes) = (data * cs, n_data * cs);
        self.shared
            .guard_write(&mut m, at, bytes, Writing::Data)
            .await?;
        let file_len = self.shared.file_len().await?;
        let inside = file_len.clamp(at, at + bytes) - at;
        if inside > 0 {
            // A hole (as a never-written area stays in QEMU's file), or zeros written where
            // the file cannot punch one.
            let punched = self.shared.file.discard(at, inside).await;
            if !matches!(punched, Ok(qimg_io::DiscardOutcome::Deallocated)) {
                self.shared
                    .file
                    .write_zeroes(at, inside)
                    .await
                    .map_err(|e| self.shared.storage_error(e))?;
            }
        }
        let (at_end, rest) = (at + inside, bytes - inside);
        let grown = if rest == 0 {
            Ok(())
        } else if full {
            let zeros = self.shared.io_buf((1u64 << 20).min(rest) as usize)?;
            let mut done = 0;
            let mut r = Ok(());
            while done < rest && r.is_ok() {
                let n = (rest - done).min(zeros.len() as u64) as usize;
                r = self.shared.file.write_at(&zeros[..n], at_end + done).await;
                done += n as u64;
            }
            r
        } else {
            self.shared.file.allocate(at_end, rest).await.map(drop)
        };
        grown.map_err(|e| self.shared.storage_error(e))?;
        if self.shared.file_len().await? < at + bytes {
            self.shared
                .file
                .set_len(at + bytes)
                .await
                .map_err(|e| self.shared.storage_error(e))?;
        }
        if offset > head {
            self.shared
                .file
                .write_at(&head_bytes, at)
                .await
                .map_err(|e| self.shared.storage_error(e))?;
        }
        // Refcount increments reach the disk before the entries that use them.
        self.shared
            .set_dependency(&mut m, CacheKind::L2, CacheKind::Refcount)
            .await?;
        // Where a backing file reaches past the old end, QEMU asks for the new area to read
        // zeros and then counts every subcluster as written; otherwise extended entries keep
        // their subclusters' states.
        let written = (self.backing_len().await? > offset).then_some(SubclusterBitmap {
            alloc: u32::MAX,
            zero: 0,
        });
        let mut host = at;
        let mut gc = head;
        while gc < end {
            let old = self.shared.lookup(&mut m, gc).await?;
            let bitmap = old.bitmap().map(|b| written.unwrap_or(b));
            let entry = self.linked_entry(host, bitmap);
            self.shared.set_entry(&mut m, gc, &entry).await?;
            m.entries_wait_for_data();
            gc += cs;
            host += cs;
        }
        // The head cluster's old host cluster loses the reference the entry held, once the
        // new entry is on disk (`release`: the refcount cache waits for the L2 cache).
        if offset > head {
            if let Some(freed) = old_reference(head_entry.entry()) {
                self.release(&mut m, freed).await?;
            }
        }
        Ok(true)
    }
}

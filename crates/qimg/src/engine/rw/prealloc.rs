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
        while gc < end {
            let old = self.shared.lookup(&mut m, gc).await?;
            let wanted = match old {
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
            };
            if !wanted {
                gc += cs;
                continue;
            }
            let host = if self.shared.data_file.is_some() {
                // An external data file maps guest offsets to themselves.
                gc
            } else {
                self.table_before_data(&mut m, gc).await?;
                let unused_from = m.never_used_from();
                let host = self.shared.alloc_clusters(&mut m, 1).await?;
                self.shared
                    .counters
                    .clusters_allocated
                    .fetch_add(1, Ordering::Relaxed);
                self.shared
                    .guard_write(&mut m, host, cs, Writing::Data)
                    .await?;
                // Subclusters of an extended entry keep their states: nothing reads the
                // cluster's bytes until a write allocates them.
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
            };
            // Extended: the subclusters keep their states.
            let entry = self.linked_entry(host, old.bitmap());
            self.shared.set_entry(&mut m, gc, &entry).await?;
            // The grown file (below) and any zeros are durable before the entry.
            m.entries_wait_for_data();
            gc += cs;
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
}

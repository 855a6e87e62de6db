//! Writes: allocating and copying on write, writing the guest data, and linking the new
//! cluster into the L2 table, in the order crash safety needs (data before the entry). Write
//! leases use the same three steps (prepare, write copy-on-write, link).

use qimg_io::Storage;

use super::*;

impl<S: Storage> Inner<S> {
    /// Writes `buf` at guest `offset` (one segment).
    pub(crate) async fn write(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.write_vectored(&[IoSlice::new(buf)], offset).await
    }

    /// Writes the segments in turn at consecutive guest offsets from `offset`, straight from
    /// each segment, with the whole range held exclusively at once (one request).
    pub(crate) async fn write_vectored(&self, bufs: &[IoSlice<'_>], offset: u64) -> Result<()> {
        self.check_writable()?;
        let len = self.request_len(bufs.iter().map(|b| b.len()), offset)?;
        if len == 0 {
            return Ok(());
        }
        let (first, end) = self.cluster_span(offset, len);
        let _guard = self.locks.lock(first, end, true).await;
        let mut at = offset;
        for buf in bufs {
            let segment_len = buf.len() as u64;
            for (gc, a, n, pos) in self.pieces(at, segment_len) {
                self.write_chunk(gc, a, &buf[pos..pos + n]).await?;
            }
            at += segment_len;
        }
        Ok(())
    }

    pub(super) fn linked_entry(&self, host: u64, bitmap: Option<SubclusterBitmap>) -> AnyL2Entry {
        let entry = L2Entry::Normal {
            host: qimg_format::units::HostOffset(host),
            copied: true,
        };
        match bitmap {
            Some(bitmap) => AnyL2Entry::Extended(ExtendedL2Entry { entry, bitmap }),
            None => AnyL2Entry::Standard(entry),
        }
    }

    /// Writes `data` at offset `a` of the guest cluster at `gc` (the caller holds the cluster
    /// exclusively).
    pub(super) async fn write_chunk(&self, gc: u64, a: usize, data: &[u8]) -> Result<()> {
        let p = self.prepare_chunk(gc, a, a + data.len()).await?;
        let written = self
            .write_data(&p.old, gc, a, data, &p.plan, p.host, p.fresh)
            .await;
        if let Err(e) = written {
            self.abandon_chunk(&p).await;
            return Err(e);
        }
        self.link_chunk(&p).await
    }

    /// First half of a write to `[a, b)` of guest cluster `gc`: look the entry up, plan the
    /// write, and allocate (under the metadata lock). Nothing is linked yet.
    pub(crate) async fn prepare_chunk(&self, gc: u64, a: usize, b: usize) -> Result<PreparedWrite> {
        let mut m = self.meta.lock().await;
        self.ensure_open(&m)?;
        let old = self.lookup(&mut m, gc).await?;
        let mut plan = self.plan_write(&old, a, b);
        let (host, fresh) = match plan.target {
            Destination::InPlace(h) => (h, false),
            Destination::New if self.data_file.is_some() => (gc, false),
            Destination::New => {
                // QEMU's order: a missing L2 table is made before the data clusters it maps,
                // so that a large write to an empty area lands as one host extent after it.
                let l1i = (gc / self.geo.l2_coverage()) as usize;
                if m.l1.get(l1i).is_some_and(|e| e.l2_offset.is_none()) {
                    self.writable_l2_slice(&mut m, gc).await?;
                }
                // Clusters past everything allocated since open and past the end of the file
                // at open have never held data: they read as zeros.
                let unused_from = m.end_cluster * self.geo.cluster_size();
                let h = self.alloc_clusters(&mut m, 1).await?;
                self.counters
                    .clusters_allocated
                    .fetch_add(1, Ordering::Relaxed);
                if h >= unused_from && self.cow_reads_zero(&old, gc, &plan, a, b) {
                    (plan.start, plan.end) = (a, b);
                }
                (h, true)
            }
        };
        if self.data_file.is_none() {
            let span = (plan.end - plan.start) as u64;
            self.guard_write(&mut m, host + plan.start as u64, span, Writing::Data)
                .await?;
        }
        Ok(PreparedWrite {
            gc,
            a,
            b,
            old,
            plan,
            host,
            fresh,
        })
    }

    /// Gives back what [`prepare_chunk`](Self::prepare_chunk) allocated when the data could
    /// not be written (never linked, so freeing it cannot lose anything).
    pub(crate) async fn abandon_chunk(&self, p: &PreparedWrite) {
        if p.fresh {
            let mut m = self.meta.lock().await;
            let _ = self.free_clusters(&mut m, p.host, 1).await;
        }
    }

    /// Second half: links the written cluster into the L2 table, after the refcounts and the
    /// data (cache dependencies), and drops the old reference.
    pub(crate) async fn link_chunk(&self, p: &PreparedWrite) -> Result<()> {
        let plan = &p.plan;
        let mut m = self.meta.lock().await;
        let cow = (p.a - plan.start) + (plan.end - p.b);
        self.counters
            .cow_bytes
            .fetch_add(cow as u64, Ordering::Relaxed);
        if !plan.relink {
            return Ok(());
        }
        if p.fresh {
            // Refcount increments reach the disk before the entry that uses them.
            self.set_dependency(&mut m, CacheKind::L2, CacheKind::Refcount)
                .await?;
        }
        self.set_entry(&mut m, p.gc, &self.linked_entry(p.host, plan.bitmap))
            .await?;
        // The data must be durable before the entry that points at it.
        m.l2.depend_on_flush();
        if let Some(freed) = plan.freed {
            self.release(&mut m, freed).await?;
        }
        Ok(())
    }

    /// [`link_chunk`](Self::link_chunk) without I/O, for the queues' direct path: `false`
    /// when linking needs the engine (a slice to load or a dependency to write back); the
    /// entry is then unchanged (the refcount dependency may already be recorded, which
    /// [`link_chunk`](Self::link_chunk) records anyway).
    pub(crate) fn try_link_cached(&self, m: &mut Meta, p: &PreparedWrite) -> bool {
        let plan = &p.plan;
        debug_assert!(plan.freed.is_none());
        if !plan.relink {
            return true;
        }
        if p.fresh && !self.try_set_dependency(m, CacheKind::L2, CacheKind::Refcount) {
            return false;
        }
        if !self.try_set_entry_cached(m, p.gc, &self.linked_entry(p.host, plan.bitmap)) {
            return false;
        }
        m.l2.depend_on_flush();
        let cow = (p.a - plan.start) + (plan.end - p.b);
        self.counters
            .cow_bytes
            .fetch_add(cow as u64, Ordering::Relaxed);
        true
    }

    /// The copy-on-write part of a prepared write: reserves a fresh cluster and writes the
    /// head `[plan.start, a)` and tail `[b, plan.end)` around the guest bytes, which the caller
    /// writes itself.
    pub(crate) async fn write_cow(&self, p: &PreparedWrite) -> Result<()> {
        let (storage, path) = self.data();
        if p.fresh {
            self.reserve_fresh(p.host).await?;
        }
        let plan = &p.plan;
        for (from, to) in [(plan.start, p.a), (p.b, plan.end)] {
            if from < to {
                let mut buf = self.io_buf(to - from)?;
                self.read_entry_range(&p.old, p.gc, from, &mut buf).await?;
                storage
                    .write_at(&buf, p.host + from as u64)
                    .await
                    .map_err(|e| Error::storage(path, e))?;
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) async fn write_data(
        &self,
        old: &AnyL2Entry,
        gc: u64,
        a: usize,
        data: &[u8],
        plan: &WritePlan,
        host: u64,
        fresh: bool,
    ) -> Result<()> {
        let (storage, path) = self.data();
        if fresh {
            self.reserve_fresh(host).await?;
        }
        let b = a + data.len();
        if plan.start == a && plan.end == b {
            return storage
                .write_at(data, host + a as u64)
                .await
                .map_err(|e| Error::storage(path, e));
        }
        let mut buf = self.io_buf(plan.end - plan.start)?;
        if plan.start < a {
            self.read_entry_range(old, gc, plan.start, &mut buf[..a - plan.start])
                .await?;
        }
        buf[a - plan.start..b - plan.start].copy_from_slice(data);
        if b < plan.end {
            self.read_entry_range(old, gc, b, &mut buf[b - plan.start..])
                .await?;
        }
        storage
            .write_at(&buf, host + plan.start as u64)
            .await
            .map_err(|e| Error::storage(path, e))
    }
}

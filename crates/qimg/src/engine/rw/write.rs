//! Writes: allocating and copying on write, writing the guest data, and linking the new
//! cluster into the L2 table, in the order crash safety needs (data before the entry). Write
//! leases use the same three steps (prepare, write copy-on-write, link).

use qimg_io::DebugEvent;
use qimg_io::Storage;

use super::*;
use crate::engine::meta::Needs;
use crate::engine::plan::Planned;

/// The most clusters [`Inner::prepare_chunks`] allocates as one run (4096 clusters: 256 MiB
/// at 64 KiB; requests are rarely larger, and a larger one continues in a second run).
const MAX_RUN: u64 = 4096;

impl<S: Storage> Inner<S> {
    /// Writes `buf` at guest `offset` (one segment).
    pub(crate) async fn write(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.write_vectored(&[IoSlice::new(buf)], offset).await
    }

    /// Writes the segments in turn at consecutive guest offsets from `offset`, with the whole
    /// range held exclusively at once (one request). The request's new clusters are allocated
    /// together, as one host run in guest order (as QEMU does), so that requests in flight
    /// together do not interleave their clusters on the host; all data is written before
    /// anything is linked.
    pub(crate) async fn write_vectored(&self, bufs: &[IoSlice<'_>], offset: u64) -> Result<()> {
        self.shared.check_writable()?;
        let len = self.request_len(bufs.iter().map(|b| b.len()), offset)?;
        if len == 0 {
            return Ok(());
        }
        let recorded = self.record_change(offset, len).await?;
        let (first, end) = self.cluster_span(offset, len);
        let _guard = self.locks.lock(first, end, true).await;
        self.recorded(recorded, offset, len).await?;
        self.write_locked(bufs, offset, len).await
    }

    /// Writes `len` bytes of `bufs` at `offset`, a range the caller checked and holds
    /// exclusively: prepare, write, link.
    pub(super) async fn write_locked(
        &self,
        bufs: &[IoSlice<'_>],
        offset: u64,
        len: u64,
    ) -> Result<()> {
        let spans: Vec<(u64, usize, usize)> = self
            .pieces(offset, len)
            .map(|(gc, a, n, _)| (gc, a, a + n))
            .collect();
        let prepared = self.prepare_chunks(&spans).await?;
        let mut data = Gather::new(bufs);
        for (i, p) in prepared.iter().enumerate() {
            let bytes = data.take(p.b - p.a);
            let written = self
                .write_data(&p.old, p.gc, p.a, &bytes, &p.plan, p.host, p.fresh)
                .await;
            if let Err(e) = written {
                self.abandon_chunks(&prepared[i..]).await;
                // The pieces before were written but not linked: the range keeps its contents.
                self.abandon_chunks(&prepared[..i]).await;
                return Err(e);
            }
        }
        self.link_chunks(&prepared).await
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
        let prepared = self.prepare_chunks(&[(gc, a, a + data.len())]).await?;
        let p = &prepared[0];
        let written = self
            .write_data(&p.old, gc, a, data, &p.plan, p.host, p.fresh)
            .await;
        if let Err(e) = written {
            self.abandon_chunks(&prepared).await;
            return Err(e);
        }
        self.link_chunks(&prepared).await
    }

    /// First half of a write: for each piece `(gc, a, b)` (bytes `[a, b)` of the guest cluster
    /// at `gc`, at most one piece per cluster, in guest order) look the entry up and plan the
    /// write, then allocate every new cluster the pieces need at once, as one contiguous host
    /// run in the pieces' order (a missing L2 table first, as QEMU orders them), all under one
    /// hold of the metadata lock. Nothing is linked yet; on an error nothing stays allocated.
    pub(crate) async fn prepare_chunks(
        &self,
        pieces: &[(u64, usize, usize)],
    ) -> Result<Vec<PreparedWrite>> {
        let mut m = self.meta.lock().await;
        self.ensure_open(&m)?;
        let cs = self.shared.geo.cluster_size();
        let mut prepared = Vec::with_capacity(pieces.len());
        let mut pieces = pieces.iter().map(|&(gc, a, b)| (gc, a, b - a, 0));
        // The planner from the cache; an entry it lacks is looked up with I/O.
        loop {
            let now = Some(self.shared.now());
            let lookup = |gc| self.shared.lookup_cached(&mut m, gc, now);
            match self.plan_writes(&mut pieces, lookup, &mut prepared) {
                Planned::Lacks(piece) => {
                    let old = self.shared.lookup(&mut m, piece.0).await?;
                    prepared.push(self.prepare_piece(old, piece));
                }
                Planned::Done | Planned::Refused => break,
            }
        }
        // QEMU's order, one L2 table at a time: a missing (or shared) table, then the data
        // clusters it maps, as one run; then the next table.
        let coverage = self.shared.geo.l2_coverage();
        // (index of the piece, its L2 table's L1 index)
        let fresh: Vec<(usize, u64)> = (0..prepared.len())
            .filter(|&i| prepared[i].fresh)
            .map(|i| (i, prepared[i].gc / coverage))
            .collect();
        for group in fresh.chunk_by(|x, y| x.1 == y.1) {
            if let Err(e) = self
                .table_before_data(&mut m, prepared[group[0].0].gc)
                .await
            {
                self.abandon_allocated(&mut m, &prepared).await;
                return Err(e);
            }
            // Clusters that never held data read as zeros.
            let unused_from = m.never_used_from();
            let (mut next, mut left, mut to_come) = (0, 0, group.len() as u64);
            for &(k, _) in group {
                if left == 0 {
                    let run = to_come.min(MAX_RUN);
                    next = match self.shared.alloc_clusters(&mut m, run).await {
                        Ok(host) => host,
                        Err(e) => {
                            self.abandon_allocated(&mut m, &prepared).await;
                            return Err(e);
                        }
                    };
                    self.shared
                        .counters
                        .clusters_allocated
                        .fetch_add(run, Ordering::Relaxed);
                    left = run;
                    to_come -= run;
                }
                let p = &mut prepared[k];
                p.host = next;
                next += cs;
                left -= 1;
                // Fresh space reads as zeros, so zero copy-on-write parts need no writing;
                // not in an encrypted image, where a hole decrypts to noise.
                if p.host >= unused_from
                    && self.shared.crypt.is_none()
                    && self.cow_reads_zero(&p.old, p.gc, &p.plan, p.a, p.b)
                {
                    (p.plan.start, p.plan.end) = (p.a, p.b);
                }
            }
        }
        if self.shared.data_file.is_none() {
            for i in 0..prepared.len() {
                let p = &prepared[i];
                let span = (p.plan.end - p.plan.start) as u64;
                let at = p.host + p.plan.start as u64;
                if let Err(e) = self
                    .shared
                    .guard_write(&mut m, at, span, Writing::Data)
                    .await
                {
                    self.abandon_allocated(&mut m, &prepared).await;
                    return Err(e);
                }
            }
        }
        Ok(prepared)
    }

    /// Frees the clusters given to fresh pieces so far (host 0: none yet), under the lock.
    async fn abandon_allocated(&self, m: &mut Meta, prepared: &[PreparedWrite]) {
        for p in prepared.iter().filter(|p| p.fresh && p.host != 0) {
            let _ = self.shared.free_clusters(m, p.host, 1).await;
        }
    }

    /// Gives back what [`prepare_chunks`](Self::prepare_chunks) allocated when the data could
    /// not be written (never linked, so freeing it cannot lose anything).
    pub(crate) async fn abandon_chunks(&self, prepared: &[PreparedWrite]) {
        if prepared.iter().any(|p| p.fresh) {
            let mut m = self.meta.lock().await;
            for p in prepared.iter().filter(|p| p.fresh) {
                let _ = self.shared.free_clusters(&mut m, p.host, 1).await;
            }
        }
    }

    /// Links prepared pieces whose data is written, in order; when one fails, the pieces
    /// after it are given back (never linked) and the error returned.
    pub(crate) async fn link_chunks(&self, prepared: &[PreparedWrite]) -> Result<()> {
        for (i, p) in prepared.iter().enumerate() {
            if let Err(e) = self.link_chunk(p).await {
                self.abandon_chunks(&prepared[i + 1..]).await;
                return Err(e);
            }
        }
        Ok(())
    }

    /// Second half: links the written cluster into the L2 table, after the refcounts and the
    /// data (cache dependencies), and drops the old reference.
    pub(crate) async fn link_chunk(&self, p: &PreparedWrite) -> Result<()> {
        let plan = &p.plan;
        let mut m = self.meta.lock().await;
        if plan.relink {
            // What linking needs, made ready with I/O in the order linking uses it (the
            // dependency's write-back, then the slice, a counted lookup), then the link.
            if p.fresh {
                self.shared
                    .set_dependency(&mut m, CacheKind::L2, CacheKind::Refcount)
                    .await?;
            }
            self.shared.writable_l2_slice(&mut m, p.gc).await?;
        }
        self.shared
            .until_done(&mut m, |m| self.link_now(m, p))
            .await??;
        if let Some(freed) = plan.freed {
            self.release(&mut m, freed).await?;
        }
        Ok(())
    }

    /// The one body of linking a written piece (the engine's [`link_chunk`]
    /// (Self::link_chunk), a queue's link in its caller's thread): after the refcounts
    /// (a cache dependency) the new entry goes into the cached slice, and the slice waits for
    /// the data to be durable. Without I/O: nothing is linked when it names a need (the
    /// refcount dependency may already be recorded, which linking records anyway). Freeing
    /// what the piece replaces is the caller's (the direct path never replaces anything).
    pub(crate) fn link_now(&self, m: &mut Meta, p: &PreparedWrite) -> Needs<Result<()>> {
        let plan = &p.plan;
        if plan.relink {
            if p.fresh {
                // Refcount increments reach the disk before the entry that uses them.
                self.shared
                    .set_dependency_now(m, CacheKind::L2, CacheKind::Refcount)?;
            }
            if let Err(e) =
                self.shared
                    .set_entry_now(m, p.gc, &self.linked_entry(p.host, plan.bitmap))?
            {
                return Ok(Err(e));
            }
            m.entries_wait_for_data();
        }
        let cow = (p.a - plan.start) + (plan.end - p.b);
        self.shared
            .counters
            .cow_bytes
            .fetch_add(cow as u64, Ordering::Relaxed);
        Ok(Ok(()))
    }

    /// The copy-on-write part of a prepared write: reserves a fresh cluster and writes the
    /// head `[plan.start, a)` and tail `[b, plan.end)` around the guest bytes, which the caller
    /// writes itself.
    pub(crate) async fn write_cow(&self, p: &PreparedWrite) -> Result<()> {
        let (storage, _) = self.shared.data();
        if p.fresh {
            self.prepare_fresh(p.host, &p.plan).await?;
        }
        let plan = &p.plan;
        for (from, to) in [(plan.start, p.a), (p.b, plan.end)] {
            if from < to {
                let mut buf = self.shared.io_buf(to - from)?;
                storage.debug_event(DebugEvent::CowRead);
                self.read_entry_range(&p.old, p.gc, from, &mut buf).await?;
                storage.debug_event(DebugEvent::CowWrite);
                self.shared
                    .write_guest_data(&buf, p.host + from as u64)
                    .await?;
            }
        }
        Ok(())
    }

    /// QEMU's order: a missing L2 table for guest cluster `gc`, or the copy of one a snapshot
    /// shares, is made before the data clusters it maps are allocated, so that a large write
    /// to an empty area lands as one host extent after it (and the file ends where QEMU's
    /// does). Write-zeroes and discard call it too where QEMU makes the table writable
    /// although no entry changes (`get_cluster_table`).
    pub(super) async fn table_before_data(&self, m: &mut Meta, gc: u64) -> Result<()> {
        let l1i = (gc / self.shared.geo.l2_coverage()) as usize;
        if m.l1()
            .get(l1i)
            .is_some_and(|e| e.l2_offset.is_none() || !e.copied)
        {
            self.shared.writable_l2_slice(m, gc).await?;
        }
        Ok(())
    }

    /// Before the first write of a new cluster at `host`, which writes `plan`'s range of it:
    /// reserves the cluster ([`Allocation::Contiguous`](crate::Allocation::Contiguous)), or,
    /// with [`Allocation::Sparse`](crate::Allocation::Sparse), does what QEMU does to a
    /// cluster a write covers only in part and whose other bytes read as zeros
    /// (`handle_alloc_space`): one zero-range request over what the write allocates (the
    /// cluster; with extended L2 entries the subclusters it touches), so the file holds (and
    /// counts) what QEMU's holds. A write that covers all of that needs none, nor does one to
    /// an external data file.
    async fn prepare_fresh(&self, host: u64, plan: &WritePlan) -> Result<()> {
        // An encrypted image's plan for a new cluster covers all it allocates (its zero parts
        // are not dropped in `prepare_chunks`: a hole would decrypt to noise), so nothing is
        // left to zero here.
        if self.shared.allocation != crate::Allocation::Sparse {
            return self.shared.reserve_fresh(host).await;
        }
        if self.shared.data_file.is_some() || self.shared.crypt.is_some() {
            return Ok(());
        }
        // What the write allocates: the cluster, or with extended L2 entries the subclusters
        // it touches.
        let cs = self.shared.geo.cluster_size() as usize;
        let (start, end) = if self.shared.geo.extended_l2() {
            let scs = self.shared.geo.subcluster_size() as usize;
            (
                plan.start / scs * scs,
                plan.end.next_multiple_of(scs).min(cs),
            )
        } else {
            (0, cs)
        };
        if plan.start > start || plan.end < end {
            self.shared
                .file
                .write_zeroes(host + start as u64, (end - start) as u64)
                .await
                .map_err(|e| self.shared.storage_error(e))?;
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
        let (storage, _) = self.shared.data();
        if fresh {
            self.prepare_fresh(host, plan).await?;
        }
        let b = a + data.len();
        if plan.start == a && plan.end == b {
            storage.debug_event(DebugEvent::WriteAio);
            return self.shared.write_guest_data(data, host + a as u64).await;
        }
        let mut buf = self.shared.io_buf(plan.end - plan.start)?;
        // QEMU's events for a write merged with its copy-on-write (`merge_cow`).
        storage.debug_event(DebugEvent::CowRead);
        if plan.start < a {
            self.read_entry_range(old, gc, plan.start, &mut buf[..a - plan.start])
                .await?;
        }
        buf[a - plan.start..b - plan.start].copy_from_slice(data);
        if b < plan.end {
            self.read_entry_range(old, gc, b, &mut buf[b - plan.start..])
                .await?;
        }
        storage.debug_event(DebugEvent::CowWrite);
        self.shared
            .write_guest_data(&buf, host + plan.start as u64)
            .await
    }
}

/// The bytes of a vectored request, taken in order piece by piece: borrowed when a piece lies
/// within one segment, gathered into one buffer when it spans several.
struct Gather<'a> {
    bufs: &'a [IoSlice<'a>],
    segment: usize,
    within: usize,
}

impl<'a> Gather<'a> {
    fn new(bufs: &'a [IoSlice<'a>]) -> Self {
        Gather {
            bufs,
            segment: 0,
            within: 0,
        }
    }

    /// The next `n` bytes (the caller never asks past the end: pieces cover the request).
    fn take(&mut self, n: usize) -> std::borrow::Cow<'a, [u8]> {
        while self.bufs[self.segment].len() == self.within {
            (self.segment, self.within) = (self.segment + 1, 0);
        }
        let bufs: &'a [IoSlice<'a>] = self.bufs;
        let first: &'a [u8] = &bufs[self.segment];
        if first.len() - self.within >= n {
            let out = &first[self.within..self.within + n];
            self.within += n;
            return std::borrow::Cow::Borrowed(out);
        }
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let seg: &'a [u8] = &bufs[self.segment];
            let k = (seg.len() - self.within).min(n - out.len());
            out.extend_from_slice(&seg[self.within..self.within + k]);
            self.within += k;
            if self.within == seg.len() && out.len() < n {
                (self.segment, self.within) = (self.segment + 1, 0);
            }
        }
        std::borrow::Cow::Owned(out)
    }
}

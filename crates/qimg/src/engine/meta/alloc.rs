//! Allocating and freeing host clusters: the one search for free clusters
//! ([`find_free_now`](Shared::find_free_now)) and the one release
//! ([`release_now`](Shared::release_now)), with the engine's and the queues' callers.

use std::sync::atomic::Ordering;

use qimg_format::refcount;
use qimg_io::{DebugEvent, Storage};

use super::{MAX_HOST_OFFSET, MAX_PENDING_PUNCHES, Meta, Need, Needs};
use crate::engine::state::Shared;
use crate::error::{Error, Result};

/// Where a search for free clusters stopped for a refcount slice (see
/// [`find_free_now`](Shared::find_free_now)).
#[derive(Debug, Clone, Copy)]
pub(crate) struct FreeSearch {
    /// The hint the search started from: a search resumes only if it has not moved.
    hint: u64,
    n: u64,
    start: u64,
    c: u64,
    first_free: Option<u64>,
}

impl<S: Storage> Shared<S> {
    /// Allocates `n` contiguous free host clusters (refcount 1 each); returns the offset.
    /// The search is [`find_free_now`](Self::find_free_now), its needs resolved with I/O.
    pub(crate) async fn alloc_clusters(&self, m: &mut Meta, n: u64) -> Result<u64> {
        self.file.debug_event(DebugEvent::ClusterAlloc);
        let mut resume = None;
        let start = loop {
            // Each need resolved is progress (a slice loaded, the search going on after it; a
            // block or table created; the frees flushed): no round bound.
            match self.find_free_now(m, n, u64::MAX, &mut resume) {
                Ok(found) => break found?,
                Err(need) => self.resolve(m, need).await?,
            }
        };
        for k in start..start + n {
            self.update_refcount(m, k, 1).await?;
        }
        self.claimed(m, start, n);
        Ok(start * self.geo.cluster_size())
    }

    /// The one search for free host clusters, without I/O: the first run of `n` free clusters
    /// from the hint (the cluster, not yet claimed), or what the search needs first: the dirty
    /// bit, a refcount slice, a refcount block for the run, a larger refcount table, a flush
    /// (to reuse clusters freed since the last one rather than grow the file), or
    /// [`Need::Far`] when the run starts `window` clusters or more past the hint. Found, the
    /// hint moves past the clusters in use before the run (the only change). Clusters freed since the last
    /// flush count as in use: the L2 entry on disk may still name them, and reusing one before
    /// that changes is durable would let a crash show new data through the old entry.
    ///
    /// A search that needs a refcount slice leaves where it stopped in `resume`, and goes on
    /// from there when called again with it (nothing else changed): the slices it searched
    /// before may have left the cache to make room.
    pub(crate) fn find_free_now(
        &self,
        m: &mut Meta,
        n: u64,
        window: u64,
        resume: &mut Option<FreeSearch>,
    ) -> Needs<Result<u64>> {
        let resumed = resume.take();
        // After a failed header switch memory and disk may name different tables: nothing
        // may be allocated (a request that passed its entry check before the switch failed
        // ends here).
        if let Err(e) = self.check_not_halted() {
            return Ok(Err(e));
        }
        if self.needs_dirty_bit(m) {
            return Err(Need::DirtyBit);
        }
        if n == 0 {
            return Ok(Ok(m.free_hint));
        }
        let cs = self.geo.cluster_size();
        let entries = self.rgeo.refblock_entries();
        let order = self.rgeo.refcount_order();
        let hint = m.free_hint;
        // The first free cluster seen: everything below it (from the hint) is in use.
        let (mut start, mut c, mut first_free) = match resumed {
            Some(r) if r.hint == hint && r.n == n => (r.start, r.c, r.first_free),
            _ => (hint, hint, None),
        };
        while c - start < n {
            if c - hint >= window {
                return Err(Need::Far);
            }
            let used = m.pending_punch.contains(&c)
                || match self.refcount_slot(m, c) {
                    // No block: refcount 0 (the block is created below).
                    None => false,
                    Some((key, index)) => {
                        let Some(data) = m.rc.peek(key) else {
                            *resume = Some(FreeSearch {
                                hint,
                                n,
                                start,
                                c,
                                first_free,
                            });
                            return Err(Need::RefcountSlice(key));
                        };
                        match refcount::get(data, order, index) {
                            Ok(r) => r != 0,
                            Err(e) => return Ok(Err(self.fmt_err(e))),
                        }
                    }
                };
            if used {
                start = c + 1;
            } else if first_free.is_none() {
                first_free = Some(c);
            }
            c += 1;
        }
        if (start + n).saturating_mul(cs) > MAX_HOST_OFFSET {
            return Ok(Err(Error::corrupt(
                &self.path,
                "no free host cluster below 64 PiB: the image file is full",
            )));
        }
        // Growing the file while clusters freed since the last flush wait below its end:
        // make those frees durable (a flush) so that they can be reused instead.
        if start + n > m.end_cluster && m.pending_punch.first().is_some_and(|&p| p < m.end_cluster)
        {
            return Err(Need::Flush);
        }
        let missing = |i: u64| m.reftable.get(i as usize).copied().unwrap_or(0) == 0;
        if let Some(i) = (start / entries..=(start + n - 1) / entries).find(|&i| missing(i)) {
            // A missing block goes to the first cluster of the run (the block covering that
            // cluster first, which then covers itself), and the search starts again after
            // it: each round takes one cluster, so a run of any length ends up after the
            // blocks it needs (placing each block at the start of its own range instead would
            // split every run longer than one block's range).
            let last = (start + n - 1) / entries;
            if last as usize >= m.reftable.len() {
                // A larger table first (it moves to the end of the file, with blocks that
                // cover itself); the run is searched again around it.
                return Err(Need::Reftable(last + 1));
            }
            let own = start / entries;
            let index = if missing(own) { own } else { i };
            return Err(Need::Refblock { index, at: start });
        }
        // Only now: a flush (above) makes clusters kept back below `start` free again.
        m.free_hint = first_free.unwrap_or(start);
        Ok(Ok(start))
    }

    /// Notes `n` clusters from `start` (found by [`find_free_now`](Self::find_free_now)) as
    /// taken, their refcounts set: the hint moves past them if they were the first free ones.
    /// Records `n` clusters from `start`, counted by the caller, as taken (the search hint
    /// and the end of the clusters in use move past them).
    pub(crate) fn claimed(&self, m: &mut Meta, start: u64, n: u64) {
        if m.free_hint == start {
            m.free_hint = start + n;
        }
        m.end_cluster = m.end_cluster.max(start + n);
    }

    /// `n` single clusters without I/O, for the queues' direct path (the caller's thread):
    /// each found by [`find_free_now`](Self::find_free_now) within a short window of the
    /// hint and counted by [`update_refcount_now`](Self::update_refcount_now). `None`, with
    /// nothing changed, when that needs I/O, or a cluster found is not accepted by `accept`
    /// (given its host offset) or lies on metadata (damaged refcounts, which the engine
    /// reports).
    pub(crate) fn alloc_near_now(
        &self,
        m: &mut Meta,
        n: usize,
        accept: impl Fn(u64) -> bool,
    ) -> Option<Vec<u64>> {
        /// How far past the hint the search looks before leaving it to the engine.
        const WINDOW: u64 = 64;
        let cs = self.geo.cluster_size();
        let mut found = Vec::with_capacity(n);
        while found.len() < n {
            let taken = match self.find_free_now(m, 1, WINDOW, &mut None) {
                Ok(Ok(c)) if accept(c * cs) && !m.data_overlaps_metadata(c * cs, cs) => {
                    // The search saw its slice and the dirty bit is set: cannot need I/O.
                    matches!(self.update_refcount_now(m, c, 1), Ok(Ok(1))).then_some(c)
                }
                _ => None,
            };
            let Some(c) = taken else {
                for &host in &found {
                    self.give_back_now(m, host);
                }
                return None;
            };
            self.claimed(m, c, 1);
            found.push(c * cs);
        }
        Some(found)
    }

    /// Gives back, without I/O, a cluster allocated and never linked (its refcount is 1):
    /// `false` (nothing changed) when its refcount slice left the cache or its refcount is
    /// not 1 (the caller then frees it with [`free_clusters`](Self::free_clusters)). The
    /// refcount change is [`release_now`](Self::release_now), as every free's.
    pub(crate) fn give_back_now(&self, m: &mut Meta, host: u64) -> bool {
        let c = host / self.geo.cluster_size();
        let one = self.refcount_slot(m, c).is_some_and(|(key, index)| {
            m.rc.peek(key)
                .and_then(|data| refcount::get(data, self.rgeo.refcount_order(), index).ok())
                == Some(1)
        });
        one && matches!(self.release_now(m, c), Ok(Ok(0)))
    }

    /// The one body of dropping a reference to host cluster `cluster` without I/O: its
    /// refcount minus one (see [`update_refcount_now`](Self::update_refcount_now)), and a
    /// cluster reaching zero may be found again from the hint. Returns the new refcount.
    pub(crate) fn release_now(&self, m: &mut Meta, cluster: u64) -> Needs<Result<u64>> {
        let left = self.update_refcount_now(m, cluster, -1)?;
        if let Ok(0) = left {
            m.free_hint = m.free_hint.min(cluster);
        }
        Ok(left)
    }

    /// Frees the clusters of write leases dropped without commit or abort (see
    /// [`Shared::abandoned`]): they were never linked, so this is always safe.
    pub(crate) async fn free_abandoned(&self, m: &mut Meta) -> Result<()> {
        let hosts = std::mem::take(&mut *self.abandoned.lock().unwrap_or_else(|e| e.into_inner()));
        for host in hosts {
            self.free_clusters(m, host, 1).await?;
        }
        Ok(())
    }

    /// Drops one reference to each of `n` clusters from `offset`; clusters reaching zero are
    /// dropped from the caches and queued for punching.
    pub(crate) async fn free_clusters(&self, m: &mut Meta, offset: u64, n: u64) -> Result<()> {
        self.free_clusters_as(m, offset, n, true).await
    }

    /// [`free_clusters`](Self::free_clusters), punching the clusters that reach zero only
    /// when `punch`: QEMU passes a discard down for data, snapshot and bitmap clusters, and
    /// keeps the bytes of the metadata it moves (an old L1 table, a bitmap directory: its
    /// `discard-other` is off), so `disk size` counts them as QEMU's does.
    pub(crate) async fn free_clusters_as(
        &self,
        m: &mut Meta,
        offset: u64,
        n: u64,
        punch: bool,
    ) -> Result<()> {
        let cs = self.geo.cluster_size();
        let first = offset / cs;
        for c in first..first + n {
            self.ready_refcount_change(m, c, -1).await?;
            if self.until_done(m, |m| self.release_now(m, c)).await?? == 0 {
                if m.compressed_tail.is_some_and(|t| t / cs == c) {
                    m.compressed_tail = None;
                }
                self.counters.clusters_freed.fetch_add(1, Ordering::Relaxed);
                let _ = m.l2.remove(c * cs);
                let _ = m.rc.remove(c * cs);
                if punch {
                    m.pending_punch.insert(c);
                }
            }
        }
        if m.pending_punch.len() > MAX_PENDING_PUNCHES {
            self.flush_meta(m).await?;
        }
        Ok(())
    }
}

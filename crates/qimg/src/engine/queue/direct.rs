//! The direct path: a request planned from cached metadata in the caller's thread and handed
//! to the queue's ring, or sent to the engine thread when it needs more.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::MutexGuard;

use qimg_io::Storage;
use qimg_io::queue::IoBuffers;

use super::fast::Part;
use super::loads::Parked;
use super::ring::ring_error;
use super::{Pending, Queue, lock_briefly};
use crate::engine::image::Inner;
use crate::engine::meta::Meta;

impl<S: Storage + 'static> Queue<S> {
    /// Tries the direct path (after loading a missing L2 slice on the ring, if that is all
    /// it lacks; `loads` counts the loads the request waited for so far, and `counted` says
    /// whether its cache lookups count: not after a load that counted its miss); gives the
    /// buffers back when the request needs the engine.
    pub(super) fn try_direct(
        &mut self,
        offset: u64,
        buffers: IoBuffers,
        user_data: u64,
        write: bool,
        loads: u8,
        counted: bool,
    ) -> std::result::Result<(), IoBuffers> {
        let inner = self.borrow_inner();
        let r = self.try_direct_in(
            &inner, None, offset, buffers, user_data, write, loads, counted,
        );
        self.lent.get_or_insert(inner);
        r
    }

    /// The image's state from `lent` (a clone only when the direct path is entered again
    /// while it is out); give it back to `lent` after use.
    pub(super) fn borrow_inner(&mut self) -> Arc<Inner<S>> {
        self.lent.take().unwrap_or_else(|| self.image.inner.clone())
    }

    /// [`try_direct`](Self::try_direct) on `inner` (the queue's image), where `held` is the
    /// metadata lock [`submit_batch`](Self::submit_batch) keeps from one read to the next:
    /// a read that goes direct leaves it held, anything else lets it go.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn try_direct_in<'g>(
        &mut self,
        inner: &'g Inner<S>,
        held: Option<&mut Option<MutexGuard<'g, Meta>>>,
        offset: u64,
        buffers: IoBuffers,
        user_data: u64,
        write: bool,
        loads: u8,
        counted: bool,
    ) -> std::result::Result<(), IoBuffers> {
        let mut plan = std::mem::take(&mut self.plan);
        plan.clear();
        let r = self.try_direct_with(
            inner, held, &mut plan, offset, buffers, user_data, write, loads, counted,
        );
        self.plan = plan;
        r
    }

    /// [`try_direct_in`](Self::try_direct_in) with the plan's vector lent.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn try_direct_with<'g>(
        &mut self,
        inner: &'g Inner<S>,
        held: Option<&mut Option<MutexGuard<'g, Meta>>>,
        plan: &mut Vec<Part>,
        offset: u64,
        mut buffers: IoBuffers,
        user_data: u64,
        write: bool,
        loads: u8,
        counted: bool,
    ) -> std::result::Result<(), IoBuffers> {
        let mut own = None;
        // Reads keep the batch's hold; a write lets it go (its fallbacks take the lock).
        let keep = held.is_some() && !write;
        let meta = match held {
            Some(h) if !write => h,
            Some(h) => {
                *h = None;
                &mut own
            }
            None => &mut own,
        };
        let len = buffers.len() as u64;
        if len == 0
            || inner.shared.check_usable().is_err()
            || offset
                .checked_add(len)
                .is_none_or(|end| end > inner.shared.size())
        {
            return Err(buffers);
        }
        if write
            && (inner.shared.check_writable().is_err() || inner.shared.check_not_halted().is_err())
        {
            return Err(buffers);
        }
        // Before anything changes; a crash-consistent bitmap whose bit is not durable yet
        // sends the write to the engine, which makes it durable first.
        let epoch = inner.shared.bitmaps.epoch();
        if write && !inner.shared.bitmaps.mark(offset, len) {
            return Err(buffers);
        }
        let (data, _) = inner.shared.data();
        // An encrypted image's data goes through the engine, which decrypts it.
        let Some(access) = data
            .direct_access()
            .filter(|_| inner.shared.crypt.is_none())
        else {
            return Err(buffers);
        };
        let ra = access.request_alignment.max(1);
        let ma = access.mem_alignment.max(1);
        if !buffers.is_aligned(ma, ra) || offset % ra as u64 != 0 {
            return Err(buffers);
        }
        let (first, end) = inner.cluster_span(offset, len);
        // A write shares its clusters with in-place writes as long as it changes no metadata
        // itself (see `lock.rs`); it upgrades below when it does.
        let lock = if write {
            inner.locks.try_acquire_in_place(first, end)
        } else {
            inner.locks.try_acquire(first, end, false)
        };
        let Some(lock) = lock else {
            return Err(buffers);
        };
        // The bitmaps changed since the write recorded itself (a checkpoint): the engine
        // records it again (the rule of `Inner::recorded`).
        if write && !inner.shared.bitmaps.still_current(epoch) {
            inner.locks.release(lock);
            return Err(buffers);
        }
        let reused = meta.is_some();
        if !reused {
            *meta = lock_briefly(&inner.meta);
        }
        if meta.as_ref().is_some_and(|m| m.is_closed()) {
            *meta = None;
        }
        let free = self.free_slots();
        let mut links = Vec::new();
        let stamp = counted.then(|| self.batch_now.unwrap_or_else(|| inner.shared.now()));
        let parts = meta.as_mut().and_then(|m| {
            if !write {
                inner.plan_direct_read(m, offset, len, stamp, plan)?;
                return Some(&*plan);
            }
            // A ring entry per cluster at most, checked before anything is allocated: an
            // allocation cannot be handed to the engine afterwards.
            if (end - first) as usize > free {
                return None;
            }
            links = inner.plan_direct_write(m, offset, len, stamp, plan)?;
            Some(&*plan)
        });
        // A write that allocates or relinks needs its clusters to itself: upgraded, or handed
        // to the engine (which waits for them) with what it took given back.
        if write && !links.is_empty() && !inner.locks.try_upgrade(lock) {
            if let Some(m) = meta.as_mut() {
                for l in links.iter().filter(|l| l.fresh) {
                    inner.shared.give_back_now(m, l.host);
                }
            }
            *meta = None;
            inner.locks.release(lock);
            return Err(buffers);
        }
        let ios = parts.as_ref().map_or(0, |p| {
            p.iter().filter(|p| matches!(p, Part::Io { .. })).count()
        });
        let fits = parts.as_ref().is_some_and(|parts| {
            ios <= free
                && parts.iter().all(|p| match *p {
                    Part::Io { host, pos, len } => {
                        host % ra as u64 == 0 && pos % ra == 0 && len % ra == 0
                    }
                    Part::Zero { .. } => true,
                })
        });
        let unplanned = parts.is_none() && meta.is_some();
        let (true, Some(parts)) = (fits, parts) else {
            if let Some(m) = meta.as_mut() {
                // Not reached (the checks above come first), but never leak a cluster.
                for l in links.iter().filter(|l| l.fresh) {
                    inner.shared.give_back_now(m, l.host);
                }
            }
            // Released before the fallbacks, which take it themselves.
            *meta = None;
            // A write that only needs copy-on-write the ring can do itself.
            let buffers = if write && unplanned && inner.locks.try_upgrade(lock) {
                match self.try_cow(offset, buffers, user_data, lock) {
                    Ok(()) => return Ok(()),
                    Err(buffers) => buffers,
                }
            } else {
                buffers
            };
            inner.locks.release(lock);
            if unplanned {
                // Perhaps only an L2 slice is missing: load it here and come back.
                let p = Parked {
                    offset,
                    buffers,
                    user_data,
                    write,
                    loads,
                    joined: false,
                };
                return self.park_on_slice_load(p).map_err(|p| p.buffers);
            }
            return Err(buffers);
        };
        if !keep {
            *meta = None;
        } else if reused {
            self.stats.held_reads += 1;
        }
        if !links.is_empty() {
            self.stats.allocating += 1;
            if let Some(host) = links.iter().filter(|l| l.fresh).map(|l| l.host).max() {
                self.reserve_ahead(host);
            }
        }
        let mut holes = Vec::new();
        for p in parts {
            if let Part::Zero { pos, len } = *p {
                buffers.fill_zero(pos, len);
                holes.push((pos, len));
            }
        }
        // `slot()` inline: `inner` borrows the image.
        let idx = match self.free.pop() {
            Some(i) => i,
            None => {
                self.pending.push(Pending::default());
                self.pending.len() - 1
            }
        };
        // The slot's own vector (empty), with the capacity of earlier requests.
        let mut positions = std::mem::take(&mut self.pending[idx].parts);
        positions.reserve(ios);
        let mut error = None;
        for p in parts {
            let Part::Io { host, pos, len: n } = *p else {
                continue;
            };
            let token = ((idx as u64) << 32) | positions.len() as u64;
            let queued = if write {
                self.ring.write(access.fd, host, &buffers, pos, n, token)
            } else {
                self.ring.read(access.fd, host, &mut buffers, pos, n, token)
            };
            match queued {
                Ok(()) => positions.push((pos, n)),
                Err(e) => {
                    error = Some(ring_error(&inner.shared.path, write, host, n as u64, e));
                    break;
                }
            }
        }
        let left = positions.len();
        let p = &mut self.pending[idx];
        p.start(
            user_data, positions, error, lock, buffers, len, write, links,
        );
        p.holes = holes;
        self.stats.direct += 1;
        self.stats.direct_bytes += len;
        if left == 0 {
            self.stats.immediate += 1;
            self.finish(idx);
            if !self.collecting {
                let _ = self.notifier.notify();
            }
        } else if !self.batching {
            let _ = self.ring.submit();
        }
        Ok(())
    }

    /// A free slot of `pending`.
    pub(super) fn slot(&mut self) -> usize {
        match self.free.pop() {
            Some(i) => i,
            None => {
                self.pending.push(Pending::default());
                self.pending.len() - 1
            }
        }
    }

    /// Ring places a new request may take: those not promised to copy-on-write writes.
    pub(super) fn free_slots(&self) -> usize {
        self.ring.available().saturating_sub(self.reserved)
    }

    /// After the direct path allocated the cluster at `host`: asks the engine thread to
    /// reserve the next step past the end of the file as soon as less than a step is left, so
    /// that the direct path never waits for a `fallocate`.
    pub(super) fn reserve_ahead(&self, host: u64) {
        let inner = &self.image.inner;
        if !inner.shared.claim_extension(host) {
            return;
        }
        let image = self.image.clone();
        let job = Box::pin(async move { image.inner.shared.extend_reservation().await });
        if !self.worker.run(job) {
            inner
                .shared
                .reservation
                .extending
                .store(false, Ordering::Release);
        }
    }
}

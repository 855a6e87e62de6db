//! One virtqueue's requests: taken from the available ring, parsed, submitted to the
//! virtqueue's `qimg::Queue`, and completed into the used ring.

use super::*;
use std::io;
use std::sync::atomic::Ordering;

use qimg::{IoBuffers, Request};
use vhost_user_backend::{VringRwLock, VringT};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK};
use virtio_queue::{DescriptorChain, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace, GuestMemory};

use self::request::{BlkRequest, Desc, parse};

impl Backend {
    /// Takes every available chain of virtqueue `q` and submits it.
    pub(super) fn process_queue(&self, q: usize, vring: &VringRwLock<Mem>) -> io::Result<()> {
        let event_idx = self.event_idx.load(Ordering::Acquire);
        let mut state = self.device.queues[q]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut answered = false;
        loop {
            if event_idx {
                vring.disable_notification().map_err(io::Error::other)?;
            }
            let (mem, chains) = {
                let mut v = vring.get_mut();
                available_chains(v.get_queue_mut(), || self.mem.memory())
                    .map_err(io::Error::other)?
            };
            let found = !chains.is_empty();
            // The chains' engine requests, handed to the queue at once below (one
            // `io_uring_enter` for all of them).
            let mut batch = Vec::new();
            for chain in chains {
                let head = chain.head_index();
                let descs: Vec<Desc> = chain
                    .clone()
                    .take(SEG_MAX as usize + 3)
                    .map(|d| Desc {
                        addr: d.addr().0,
                        len: d.len(),
                        write_only: d.is_write_only(),
                    })
                    .collect();
                let too_long = chain.count() > descs.len();
                let parsed = if too_long {
                    request::Parsed {
                        request: Err(VIRTIO_BLK_S_IOERR as u8),
                        status: None,
                    }
                } else {
                    parse(&*mem, &descs, &self.device.limits)
                };
                if let Some(done) = self.start(q, &mut state, &mem, head, parsed, &mut batch) {
                    let (status, used) = done;
                    if let Some(at) = status {
                        let _ = mem.write_obj(used.1, GuestAddress(at));
                    }
                    vring.add_used(head, used.0).map_err(io::Error::other)?;
                    answered = true;
                }
            }
            if !batch.is_empty() {
                // A batch the queue refused (its engine thread is gone; the tokens are
                // counters, never in flight twice) never completes: answer it now.
                if let Err(refused) = state.queue.submit_batch(batch) {
                    for (_, token) in refused.requests {
                        if let Some(p) = state.pending.remove(&token) {
                            let _ = mem.write_obj(VIRTIO_BLK_S_IOERR as u8, GuestAddress(p.status));
                            vring.add_used(p.head, 1).map_err(io::Error::other)?;
                            answered = true;
                        }
                    }
                }
            }
            let more = if event_idx {
                vring.enable_notification().map_err(io::Error::other)?
            } else {
                found
            };
            if !more {
                break;
            }
        }
        if answered && vring.needs_notification().map_err(io::Error::other)? {
            vring.signal_used_queue()?;
        }
        Ok(())
    }

    /// Starts one parsed request: adds it to `batch` for the engine queue, or answers it at
    /// once, returning `(status address, (used length, status))`.
    #[allow(clippy::type_complexity)]
    pub(super) fn start(
        &self,
        q: usize,
        state: &mut QueueState,
        mem: &GuestMemoryLoadGuardOf,
        head: u16,
        parsed: request::Parsed,
        batch: &mut Vec<(Request, u64)>,
    ) -> Option<(Option<u64>, (u32, u8))> {
        let status = parsed.status;
        let req = match parsed.request {
            Err(code) => return Some((status, (u32::from(status.is_some()), code))),
            Ok(r) => r,
        };
        let status_at = status?;
        let used = req.device_writes() as u32 + 1;
        let durable = matches!(
            req,
            BlkRequest::Write { .. } | BlkRequest::WriteZeroes { .. }
        ) && !self.device.write_cache.load(Ordering::Acquire)
            && !self.device.options.no_flush;
        let engine_req = match req {
            BlkRequest::GetId { data } => {
                let mut id = [0u8; VIRTIO_BLK_ID_BYTES as usize];
                let serial = self.device.options.serial.as_bytes();
                id[..serial.len()].copy_from_slice(serial);
                let mut done = 0usize;
                for (addr, n) in &data {
                    if mem
                        .write_slice(&id[done..done + n], GuestAddress(*addr))
                        .is_err()
                    {
                        return Some((status, (1, VIRTIO_BLK_S_IOERR as u8)));
                    }
                    done += n;
                }
                return Some((status, (done as u32 + 1, VIRTIO_BLK_S_OK as u8)));
            }
            BlkRequest::Read { offset, data } => {
                match IoBuffers::from_guest(mem.clone().into_inner(), &data) {
                    Ok(buffers) => Request::Read { offset, buffers },
                    Err(e) => {
                        state.report(q, &e);
                        return Some((status, (1, VIRTIO_BLK_S_IOERR as u8)));
                    }
                }
            }
            BlkRequest::Write { offset, data } => {
                match IoBuffers::from_guest(mem.clone().into_inner(), &data) {
                    Ok(buffers) => Request::Write { offset, buffers },
                    Err(e) => {
                        state.report(q, &e);
                        return Some((status, (1, VIRTIO_BLK_S_IOERR as u8)));
                    }
                }
            }
            BlkRequest::Flush if self.device.options.no_flush => {
                return Some((status, (1, VIRTIO_BLK_S_OK as u8)));
            }
            BlkRequest::Flush => Request::Flush,
            BlkRequest::Discard { ranges } => {
                let (offset, len) = ranges[0];
                Request::Discard { offset, len }
            }
            BlkRequest::WriteZeroes { ranges, unmap } => {
                let (offset, len) = ranges[0];
                Request::WriteZeroes { offset, len, unmap }
            }
        };
        state.next += 1;
        let token = state.next;
        state.pending.insert(
            token,
            InFlight {
                head,
                status: status_at,
                used,
                generation: self.generation,
                durable,
                then: Vec::new(),
            },
        );
        batch.push((engine_req, token));
        None
    }

    /// Collects virtqueue `q`'s completions and answers them. Write-through writes are
    /// answered after a flush the device submits for all of them at once.
    pub(super) fn complete(&self, q: usize, vring: &VringRwLock<Mem>) -> io::Result<()> {
        let mem = self.mem.memory();
        let mut state = self.device.queues[q]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let _ = state.queue.notifier().drain();
        let mut answered = false;
        let mut waiting = Vec::new();
        while let Some(c) = state.queue.next_completed() {
            let Some(p) = state.pending.remove(&c.user_data) else {
                continue;
            };
            if p.generation != self.generation {
                continue;
            }
            let ok = c.result.is_ok();
            if let Err(e) = &c.result {
                state.report(q, e);
            }
            if ok && p.durable {
                waiting.push((p.head, p.status, p.used));
                continue;
            }
            let answers = std::iter::once((p.head, p.status, p.used)).chain(p.then);
            for (head, status, used) in answers {
                let (code, used) = match ok {
                    true => (VIRTIO_BLK_S_OK, used),
                    false => (VIRTIO_BLK_S_IOERR, 1),
                };
                let _ = mem.write_obj(code as u8, GuestAddress(status));
                vring.add_used(head, used).map_err(io::Error::other)?;
                answered = true;
            }
        }
        if !waiting.is_empty() {
            // One flush makes every write completed before it durable (group commit): it
            // answers for the first write, the others ride along.
            state.next += 1;
            let token = state.next;
            let rest = waiting.split_off(1);
            let first = waiting[0];
            state.pending.insert(
                token,
                InFlight {
                    head: first.0,
                    status: first.1,
                    used: first.2,
                    generation: self.generation,
                    durable: false,
                    then: rest,
                },
            );
            if state.queue.submit(Request::Flush, token).is_err() {
                let p = state.pending.remove(&token).expect("just inserted");
                for (head, status, _) in std::iter::once(first).chain(p.then) {
                    let _ = mem.write_obj(VIRTIO_BLK_S_IOERR as u8, GuestAddress(status));
                    vring.add_used(head, 1).map_err(io::Error::other)?;
                }
                answered = true;
            }
        }
        if answered && vring.needs_notification().map_err(io::Error::other)? {
            vring.signal_used_queue()?;
        }
        Ok(())
    }
}

/// The chains the driver has made available, with a view of guest memory that holds every
/// region they use; `fresh` takes the current view.
///
/// A driver maps a memory region (`VHOST_USER_ADD_MEM_REG`, acknowledged only once the
/// daemon has replaced the shared memory) before it publishes a request that uses it. So a
/// view taken *after* the available index was read holds the regions of every request up to
/// that index, and only those requests are taken (later ones wait for the next pass). A view
/// taken before reading the index may lack a region mapped in between, and a request using it
/// failed with `VIRTIO_BLK_S_IOERR` (a front-end mapping its buffers just after `start` and
/// writing at once hit this about once in ten runs).
pub(super) fn available_chains<G>(
    queue: &mut virtio_queue::Queue,
    fresh: impl Fn() -> G,
) -> Result<(G, Vec<DescriptorChain<G>>), virtio_queue::Error>
where
    G: std::ops::Deref + Clone,
    G::Target: GuestMemory,
{
    let seen = queue.avail_idx(&*fresh(), Ordering::Acquire)?;
    let mem = fresh();
    let ready = (seen - std::num::Wrapping(queue.next_avail())).0;
    let chains = queue.iter(mem.clone())?.take(usize::from(ready)).collect();
    Ok((mem, chains))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::sync::Arc;
    use vm_memory::{GuestMemoryMmap, GuestRegionMmap, MmapRegion};

    const RINGS: u64 = 0;
    const AVAIL: u64 = 0x1000;
    const USED: u64 = 0x2000;
    const BUFFERS: u64 = 1 << 30;

    fn ring_memory() -> Arc<GuestMemoryMmap<()>> {
        Arc::new(GuestMemoryMmap::from_ranges(&[(GuestAddress(RINGS), 0x10000)]).unwrap())
    }

    fn queue() -> virtio_queue::Queue {
        let mut q = virtio_queue::Queue::new(16).unwrap();
        q.set_desc_table_address(Some(RINGS as u32), Some(0));
        q.set_avail_ring_address(Some(AVAIL as u32), Some(0));
        q.set_used_ring_address(Some(USED as u32), Some(0));
        q.set_ready(true);
        q
    }

    /// The driver publishes request `n` (one descriptor at `addr`): descriptor `n`, ring slot
    /// `n`, then the index.
    fn publish(mem: &GuestMemoryMmap<()>, n: u16, addr: u64) {
        let desc = RINGS + u64::from(n) * 16;
        mem.write_obj(addr, GuestAddress(desc)).unwrap();
        mem.write_obj(4096u32, GuestAddress(desc + 8)).unwrap();
        mem.write_obj(0u16, GuestAddress(desc + 12)).unwrap();
        mem.write_obj(n, GuestAddress(AVAIL + 4 + 2 * u64::from(n)))
            .unwrap();
        mem.write_obj(n + 1, GuestAddress(AVAIL + 2)).unwrap();
    }

    /// A driver maps a region and publishes a request in it just after the backend looked at
    /// its memory: the view the chains come with holds the region (before the fix, the view
    /// was taken first and the request's buffers were "invalid guest address", answered EIO).
    #[test]
    fn a_region_mapped_before_its_request_is_published_is_in_the_view() {
        let old = ring_memory();
        let region = GuestRegionMmap::new(MmapRegion::new(0x10000).unwrap(), GuestAddress(BUFFERS));
        let new = Arc::new(old.insert_region(Arc::new(region.unwrap())).unwrap());
        let mut q = queue();
        let calls = Cell::new(0);
        let fresh = || {
            calls.set(calls.get() + 1);
            if calls.get() == 1 {
                // The driver acts right after this view is taken: the region is added (the
                // daemon's memory becomes `new`), then the request is published.
                publish(&new, 0, BUFFERS);
                old.clone()
            } else {
                new.clone()
            }
        };
        let (mem, chains) = available_chains(&mut q, fresh).unwrap();
        assert_eq!(chains.len(), 1);
        let addr = chains[0].clone().next().unwrap().addr();
        assert_eq!(addr, GuestAddress(BUFFERS));
        assert!(
            mem.read_slice(&mut [0u8; 4096], addr).is_ok(),
            "the request's buffer is not in the view it came with"
        );
    }

    /// Requests published after the index was read wait for the next pass: their regions may
    /// be newer than the view.
    #[test]
    fn requests_published_after_the_index_was_read_wait_for_the_next_pass() {
        let mem = ring_memory();
        let mut q = queue();
        publish(&mem, 0, RINGS + 0x8000);
        let calls = Cell::new(0);
        let fresh = || {
            calls.set(calls.get() + 1);
            if calls.get() == 2 {
                publish(&mem, 1, RINGS + 0x9000);
            }
            mem.clone()
        };
        let (_, chains) = available_chains(&mut q, fresh).unwrap();
        assert_eq!(chains.len(), 1);
        let (_, chains) = available_chains(&mut q, || mem.clone()).unwrap();
        assert_eq!(chains.len(), 1);
        assert_eq!(chains[0].head_index(), 1);
        let (_, chains) = available_chains(&mut q, || mem.clone()).unwrap();
        assert!(chains.is_empty());
    }
}

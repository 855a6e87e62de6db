//! One virtqueue's requests: taken from the available ring, parsed, submitted to the
//! virtqueue's `qimg::Queue`, and completed into the used ring.

use super::*;
use std::io;
use std::sync::atomic::Ordering;

use qimg::{IoBuffers, Request};
use vhost_user_backend::{VringRwLock, VringT};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK};
use virtio_queue::QueueOwnedT;
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};

use self::request::{BlkRequest, Desc, parse};

impl Backend {
    /// Takes every available chain of virtqueue `q` and submits it.
    pub(super) fn process_queue(&self, q: usize, vring: &VringRwLock<Mem>) -> io::Result<()> {
        let mem = self.mem.memory();
        let event_idx = self.event_idx.load(Ordering::Acquire);
        let mut state = self.device.queues[q]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut answered = false;
        loop {
            if event_idx {
                vring.disable_notification().map_err(io::Error::other)?;
            }
            let chains: Vec<_> = {
                let mut v = vring.get_mut();
                match v.get_queue_mut().iter(mem.clone()) {
                    Ok(iter) => iter.collect(),
                    Err(e) => return Err(io::Error::other(e)),
                }
            };
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
                if let Some(done) = self.start(&mut state, &mem, head, parsed, &mut batch) {
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
            if !event_idx || !vring.enable_notification().map_err(io::Error::other)? {
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
                    Err(_) => return Some((status, (1, VIRTIO_BLK_S_IOERR as u8))),
                }
            }
            BlkRequest::Write { offset, data } => {
                match IoBuffers::from_guest(mem.clone().into_inner(), &data) {
                    Ok(buffers) => Request::Write { offset, buffers },
                    Err(_) => return Some((status, (1, VIRTIO_BLK_S_IOERR as u8))),
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

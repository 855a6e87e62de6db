//! Completions on the queue's ring: a direct request's parts, its copy-on-write steps, and
//! the link of what it allocated (here, or on the engine thread when that needs I/O).

use std::io;

use qimg_io::queue::RingCompletion;
use qimg_io::{Op, Storage, StorageError};

use super::loads::LOAD_TOKEN;
use super::{Completion, Pending, Queue, lock_briefly};
use crate::error::Error;

impl<S: Storage + 'static> Queue<S> {
    /// One ring operation completed.
    pub(super) fn on_ring(&mut self, c: RingCompletion) {
        if c.token & LOAD_TOKEN != 0 {
            self.on_slice_load(c);
            return;
        }
        let idx = (c.token >> 32) as usize;
        let part = (c.token & 0xffff_ffff) as usize;
        if self.on_cow_read(idx, part, c.result, c.expected) {
            return;
        }
        let path = &self.image.inner.shared.path;
        let Some(p) = self.pending.get_mut(idx).filter(|p| p.active) else {
            return;
        };
        let (pos, len) = p.parts.get(part).copied().unwrap_or((0, 0));
        // The merged write of a copy-on-write is named by its place in the file.
        let at = p.cow.as_ref().map_or(pos as u64, |cow| cow.host);
        if c.result < 0 {
            let e = io::Error::from_raw_os_error(-c.result);
            p.error
                .get_or_insert_with(|| ring_error(path, p.write, at, len as u64, e));
        } else if (c.result as usize) < c.expected {
            let got = c.result as usize;
            if p.write {
                let e = io::Error::new(
                    io::ErrorKind::WriteZero,
                    format!("short write: {got} of {} bytes", c.expected),
                );
                p.error
                    .get_or_insert_with(|| ring_error(path, true, at, len as u64, e));
            } else {
                // The file ended: the rest reads as zeros, as everywhere in the engine.
                p.short.push((pos + got, len - got));
            }
        }
        p.left -= 1;
        if p.left == 0 {
            self.finish(idx);
        }
    }

    /// Completes the direct request in slot `idx`.
    pub(super) fn finish(&mut self, idx: usize) {
        let Some(slot) = self.pending.get_mut(idx).filter(|p| p.active) else {
            return;
        };
        slot.active = false;
        slot.parts.clear();
        self.free.push(idx);
        if slot.cow.is_none() && slot.links.is_empty() {
            // Reads and in-place writes: read out of the slot, nothing moved whole.
            let mut buffers = slot.buffers.take();
            if let Some(b) = buffers.as_mut() {
                for (pos, len) in slot.short.drain(..) {
                    b.fill_zero(pos, len);
                }
            }
            let result = match slot.error.take() {
                Some(e) => Err(e),
                None => Ok(slot.len),
            };
            let holes = std::mem::take(&mut slot.holes);
            let (user_data, write, lock) = (slot.user_data, slot.write, slot.lock);
            self.image.inner.locks.release(lock);
            self.done.push_back(Completion {
                user_data,
                result,
                buffers,
                holes: (!write).then_some(holes),
            });
            return;
        }
        // Writes with clusters to link: owned from here (they may go to the engine thread).
        let parts = std::mem::take(&mut slot.parts);
        let mut p = std::mem::take(slot);
        self.pending[idx].parts = parts;
        if let Some(cow) = p.cow.take() {
            self.end_cow(cow);
        }
        if !p.links.is_empty() && !self.link_here(&mut p) {
            self.link_on_engine(p);
            return;
        }
        self.image.inner.locks.release(p.lock);
        let mut buffers = p.buffers;
        if let Some(b) = buffers.as_mut() {
            for (pos, len) in p.short {
                b.fill_zero(pos, len);
            }
        }
        let result = match p.error {
            Some(e) => Err(e),
            None => Ok(p.len),
        };
        self.done.push_back(Completion {
            user_data: p.user_data,
            result,
            buffers,
            holes: (!p.write).then_some(p.holes),
        });
    }

    /// Links (or, after a failed write, gives back the clusters of) the writes of a direct
    /// request in the caller's thread; `false` leaves what is left in `p.links` to the engine.
    pub(super) fn link_here(&mut self, p: &mut Pending) -> bool {
        let inner = &self.image.inner;
        let Some(mut m) = lock_briefly(&inner.meta) else {
            return false;
        };
        let failed = p.error.is_some();
        while let Some(l) = p.links.first() {
            let done = if failed {
                !l.fresh || inner.shared.give_back_now(&mut m, l.host)
            } else {
                // The direct path never replaces a cluster: nothing to free after the link.
                debug_assert!(l.plan.freed.is_none());
                matches!(inner.link_now(&mut m, l), Ok(Ok(())))
            };
            if !done {
                return false;
            }
            p.links.remove(0);
        }
        true
    }

    /// Finishes a direct request whose linking needs metadata I/O on the engine thread.
    pub(super) fn link_on_engine(&mut self, p: Pending) {
        self.stats.linked_on_engine += 1;
        // If the engine thread is gone (the queue is being torn down) the range lock and the
        // unlinked clusters stay as they are; check reports the leak.
        self.post_from_engine(move |image| async move {
            let inner = &image.inner;
            let result = match p.error {
                Some(e) => {
                    inner.abandon_chunks(&p.links).await;
                    Err(e)
                }
                None => inner.link_chunks(&p.links).await.map(|()| p.len),
            };
            inner.locks.release(p.lock);
            Completion {
                user_data: p.user_data,
                result,
                buffers: p.buffers,
                holes: None,
            }
        });
    }
}

pub(super) fn ring_error(
    path: &std::path::Path,
    write: bool,
    offset: u64,
    len: u64,
    source: io::Error,
) -> Error {
    Error::storage(
        path,
        StorageError::Io {
            op: if write { Op::Write } else { Op::Read },
            offset,
            len,
            source,
        },
    )
}

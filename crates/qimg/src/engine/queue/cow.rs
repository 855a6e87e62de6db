//! Copy-on-write on the queue's own ring: a write into part of a subcluster that must be
//! completed from the backing file or with zeros (a 4 KiB guest write into a 64 KiB
//! subcluster of a 2 MiB-cluster extended-L2 overlay, or into a new cluster of a standard-L2
//! one) runs in the caller's thread like the other direct writes, instead of on the engine's
//! thread (where each I/O step costs a thread switch each way):
//!
//! 1. under the metadata lock, the write is planned from the cached L2 entry and its new
//!    cluster allocated from a cached refcount block in reserved space (as allocating direct
//!    writes are); the caller's bytes are copied into an aligned bounce buffer the size of
//!    the copied range, and the parts that read as zeros are cleared;
//! 2. the backing file's bytes around them are read on the ring into the same buffer;
//! 3. when the reads are in, the whole range goes to the image in one write;
//! 4. when it is on disk, the new entry is linked as for any direct write (on the engine
//!    thread if that needs metadata I/O), and the completion returns the caller's buffers.
//!
//! A read that ends early (the backing file is shorter) leaves zeros, as everywhere. A failed
//! read or write gives the cluster back and the completion carries the error; nothing is
//! linked. Each such write holds one ring place for its write from the start (`reserved`),
//! so step 3 never waits for room.

use qimg_io::queue::IoBuffers;
use qimg_io::{AlignedBuf, Op, Storage, StorageError};

use super::Queue;
use super::fast::Fill;
use crate::engine::image::Backing;
use crate::error::Error;

/// Bounce buffers kept for the next copy-on-write write, and the largest kept.
const SPARE_BOUNCES: usize = 16;
const SPARE_BOUNCE_MAX: usize = 2 << 20;

/// The copy-on-write state of a direct write.
pub(super) struct CowIo {
    /// The merged range: the copied bytes around the caller's.
    bounce: IoBuffers,
    /// Where it goes in the image file.
    pub(super) host: u64,
    /// Still reading the copied bytes (step 2).
    reading: bool,
    /// Ranges of the bounce buffer whose read ended early: zeros.
    short: Vec<(usize, usize)>,
    /// Backing-file offsets of the reads, by part number (for errors).
    sources: Vec<u64>,
}

impl<S: Storage + 'static> Queue<S> {
    /// Tries `buffers` (a write at `offset`, range lock `lock` held) as a copy-on-write write
    /// on the ring; gives the buffers back, nothing changed, when it needs the engine.
    pub(super) fn try_cow(
        &mut self,
        offset: u64,
        buffers: IoBuffers,
        user_data: u64,
        lock: u64,
    ) -> std::result::Result<(), IoBuffers> {
        let inner = self.image.inner.clone();
        let len = buffers.len();
        let (data, _) = inner.shared.data();
        // An encrypted image's data goes through the engine, which encrypts it.
        let Some(access) = data
            .direct_access()
            .filter(|_| inner.shared.crypt.is_none())
        else {
            return Err(buffers);
        };
        let backing = match &inner.backing {
            Some(Backing::Raw { storage, .. }) => storage.direct_access(),
            _ => None,
        };
        let Some(mut m) = super::lock_briefly(&inner.meta).filter(|m| !m.is_closed()) else {
            return Err(buffers);
        };
        let Some(mut cow) = inner.plan_direct_cow(&mut m, offset, len as u64, None) else {
            return Err(buffers);
        };
        let reads = cow
            .fills
            .iter()
            .filter(|f| matches!(f.2, Fill::Backing(_)))
            .count();
        let (ra, ma) = (access.request_alignment.max(1), access.mem_alignment.max(1));
        let (span, start) = (cow.span(), cow.link.plan.start);
        let mut align = ma.max(4096);
        let mut fits = reads < self.free_slots() && start % ra == 0 && span % ra == 0;
        if reads > 0 {
            match backing {
                Some(b) => {
                    let (bra, bma) = (b.request_alignment.max(1), b.mem_alignment.max(1));
                    align = align.max(bma);
                    fits &= cow.fills.iter().all(|&(pos, n, fill)| match fill {
                        Fill::Backing(o) => o % bra as u64 == 0 && pos % bra == 0 && n % bra == 0,
                        Fill::Zero => true,
                    });
                }
                None => fits = false,
            }
        }
        if !fits {
            return Err(buffers);
        }
        let Some(mut bounce) = self.take_bounce(span, align) else {
            return Err(buffers);
        };
        let at = cow.guest_pos();
        if !buffers.copy_out(0, &mut bounce[at..at + len]) {
            self.recycle_bounce(IoBuffers::from_aligned(bounce));
            return Err(buffers);
        }
        if inner.alloc_direct_cow(&mut m, &mut cow).is_none() {
            self.recycle_bounce(IoBuffers::from_aligned(bounce));
            return Err(buffers);
        }
        drop(m);
        for &(pos, n, fill) in &cow.fills {
            if fill == Fill::Zero {
                bounce[pos..pos + n].fill(0);
            }
        }
        let mut bounce = IoBuffers::from_aligned(bounce);
        let idx = self.slot();
        // The slot's own vector (empty), with the capacity of earlier requests.
        let mut positions = std::mem::take(&mut self.pending[idx].parts);
        let mut sources = Vec::with_capacity(reads);
        let mut error = None;
        if let Some(b) = backing {
            for &(pos, n, fill) in &cow.fills {
                let Fill::Backing(from) = fill else {
                    continue;
                };
                let token = ((idx as u64) << 32) | positions.len() as u64;
                match self.ring.read(b.fd, from, &mut bounce, pos, n, token) {
                    Ok(()) => {
                        positions.push((pos, n));
                        sources.push(from);
                    }
                    Err(e) => {
                        error = Some(backing_error(&inner, from, n, e));
                        break;
                    }
                }
            }
        }
        let left = positions.len();
        if cow.fresh() {
            self.reserve_ahead(cow.link.host);
        }
        let host = cow.host();
        let p = &mut self.pending[idx];
        p.start(
            user_data,
            positions,
            error,
            lock,
            buffers,
            len as u64,
            true,
            vec![cow.link],
        );
        p.cow = Some(CowIo {
            bounce,
            host,
            reading: true,
            short: Vec::new(),
            sources,
        });
        // The write's place, kept from now on.
        self.reserved += 1;
        self.stats.direct += 1;
        self.stats.direct_bytes += len as u64;
        self.stats.allocating += 1;
        self.stats.cow += 1;
        if left == 0 {
            self.cow_reads_done(idx);
        } else if !self.batching {
            let _ = self.ring.submit();
        }
        Ok(())
    }

    /// A ring operation of a copy-on-write write in its reading step completed; `false` if
    /// the request in slot `idx` is not one.
    pub(super) fn on_cow_read(
        &mut self,
        idx: usize,
        part: usize,
        result: i32,
        expected: usize,
    ) -> bool {
        let inner = self.image.inner.clone();
        let Some(p) = self.pending.get_mut(idx).filter(|p| p.active) else {
            return false;
        };
        let Some(cow) = p.cow.as_mut().filter(|c| c.reading) else {
            return false;
        };
        let (pos, len) = p.parts.get(part).copied().unwrap_or((0, 0));
        let from = cow.sources.get(part).copied().unwrap_or(0);
        if result < 0 {
            let e = std::io::Error::from_raw_os_error(-result);
            p.error
                .get_or_insert_with(|| backing_error(&inner, from, len, e));
        } else if (result as usize) < expected {
            // The backing file ended: the rest reads as zeros.
            let got = result as usize;
            cow.short.push((pos + got, len - got));
        }
        p.left -= 1;
        if p.left == 0 {
            self.cow_reads_done(idx);
        }
        true
    }

    /// Step 3: the copied bytes are in; writes the merged range (or, after a failed read,
    /// finishes the request with its error).
    fn cow_reads_done(&mut self, idx: usize) {
        self.reserved -= 1;
        let inner = self.image.inner.clone();
        let Some(p) = self.pending.get_mut(idx).filter(|p| p.active) else {
            return;
        };
        let Some(cow) = p.cow.as_mut() else {
            return;
        };
        cow.reading = false;
        if p.error.is_none() {
            for (pos, n) in cow.short.drain(..) {
                cow.bounce.fill_zero(pos, n);
            }
            let span = cow.bounce.len();
            let (data, path) = inner.shared.data();
            let token = ((idx as u64) << 32) | p.parts.len() as u64;
            let queued = match data.direct_access() {
                Some(a) => self.ring.write(a.fd, cow.host, &cow.bounce, 0, span, token),
                None => Err(std::io::Error::other("the image file has no descriptor")),
            };
            match queued {
                Ok(()) => {
                    p.parts.push((0, span));
                    p.left = 1;
                    if !self.batching && !self.collecting {
                        let _ = self.ring.submit();
                    }
                    return;
                }
                Err(e) => {
                    p.error = Some(super::ring::ring_error(
                        path,
                        true,
                        cow.host,
                        span as u64,
                        e,
                    ));
                }
            }
        }
        self.finish(idx);
        if !self.collecting {
            let _ = self.notifier.notify();
        }
    }

    /// An aligned buffer of `len` bytes (contents undefined: the caller writes every byte).
    fn take_bounce(&mut self, len: usize, align: usize) -> Option<AlignedBuf> {
        if let Some(i) = self
            .bounces
            .iter()
            .position(|b| b.len() == len && b.align() >= align)
        {
            return Some(self.bounces.swap_remove(i));
        }
        AlignedBuf::zeroed(len, align)
    }

    /// Keeps a finished request's bounce buffer for the next one, within bounds.
    pub(super) fn recycle_bounce(&mut self, bounce: IoBuffers) {
        if bounce.len() > SPARE_BOUNCE_MAX || self.bounces.len() >= SPARE_BOUNCES {
            return;
        }
        if let Ok(Some(owner)) = bounce.into_owner()
            && let Ok(buf) = owner.downcast::<AlignedBuf>()
        {
            self.bounces.push(*buf);
        }
    }

    /// Finishes with the copy-on-write state of a request (its bounce buffer kept for reuse).
    pub(super) fn end_cow(&mut self, cow: CowIo) {
        self.recycle_bounce(cow.bounce);
    }
}

fn backing_error<S: Storage>(
    inner: &crate::engine::image::Inner<S>,
    offset: u64,
    len: usize,
    source: std::io::Error,
) -> Error {
    let path = match &inner.backing {
        Some(Backing::Raw { path, .. }) => path.as_path(),
        _ => inner.shared.path.as_path(),
    };
    Error::storage(
        path,
        StorageError::Io {
            op: Op::Read,
            offset,
            len: len as u64,
            source,
        },
    )
}

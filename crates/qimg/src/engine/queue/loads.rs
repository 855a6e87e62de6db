//! L2 slice loads on the queue's own ring: a read or write whose L2 slice is not cached waits
//! for the slice to be read on the ring, in the caller's thread, and then takes the direct
//! path, instead of going to the engine thread (two thread hops and a context switch each
//! way). It follows the engine's parallel loads ([`Inner::lookup_for_read`]): the load is
//! registered in the image's `SliceLoads` as a queue's (`QUEUE_LOAD`: engine reads do not
//! wait for it, since it ends only when this queue's caller collects; they load the slice
//! under the lock, which supersedes it), and the slice is inserted only if the load was not
//! superseded, its table is still the active one and the cache can take it without writing a
//! dirty slice back. Any doubt sends the waiting requests to the engine, which decides as
//! always.
//!
//! [`Inner::lookup_for_read`]: crate::engine::image::Inner

use qimg_format::units::GuestOffset;
use qimg_io::queue::{IoBuffers, RingCompletion};
use qimg_io::{AlignedBuf, Storage};

use super::{Queue, Request};
use crate::engine::meta::{CacheKind, Meta};

/// Ring tokens of slice loads have this bit set (requests' tokens are `slot << 32 | part`
/// with far fewer than 2^31 slots).
pub(super) const LOAD_TOKEN: u64 = 1 << 63;

/// Loads a request may wait for before it goes to the engine (a request whose clusters
/// span two slices of a cache too small for both would otherwise load them in turn forever).
const MAX_LOADS_PER_REQUEST: u8 = 2;

/// A slice being read on the ring, and the requests waiting for it.
pub(super) struct SliceLoad {
    key: qimg_cache::SliceKey,
    /// The image's `SliceLoads` registration.
    token: u64,
    /// The active L1 table's generation when the read started.
    epoch: u64,
    buffers: IoBuffers,
    size: usize,
    waiting: Vec<Parked>,
}

/// A request waiting for a slice.
pub(super) struct Parked {
    pub(super) offset: u64,
    pub(super) buffers: IoBuffers,
    pub(super) user_data: u64,
    pub(super) write: bool,
    pub(super) loads: u8,
    /// It joined a load another request started: its lookup after the load counts as a
    /// hit (as a request waiting for the engine's load of a slice finds it cached after).
    pub(super) joined: bool,
}

impl<S: Storage + 'static> Queue<S> {
    /// Parks `p` on a load of the first L2 slice its range misses (joining this queue's load
    /// of it if one is under way); gives it back when the slice cannot be loaded here.
    pub(super) fn park_on_slice_load(&mut self, p: Parked) -> std::result::Result<(), Parked> {
        if p.loads >= MAX_LOADS_PER_REQUEST {
            return Err(p);
        }
        let inner = self.image.inner.clone();
        let Some(mut m) = super::lock_briefly(&inner.meta) else {
            return Err(p);
        };
        if m.is_closed() {
            return Err(p);
        }
        let m = &mut *m;
        let Some(key) = missing_slice(&inner, m, p.offset, p.buffers.len() as u64) else {
            return Err(p);
        };
        if let Some(load) = self.loads.iter_mut().flatten().find(|l| l.key == key) {
            load.waiting.push(Parked { joined: true, ..p });
            return Ok(());
        }
        // Another load of it under way (an engine read's or another queue's), or a dirty
        // victim to write back first: the engine deals with both.
        if inner.shared.slice_loads.loading(key) || m.l2_victim_dirty() || self.free_slots() == 0 {
            return Err(p);
        }
        let Some(access) = inner.shared.file.direct_access() else {
            return Err(p);
        };
        let at = inner.shared.slice_location(m, CacheKind::L2, key);
        let size = m.l2_slice_size();
        let (ra, ma) = (access.request_alignment.max(1), access.mem_alignment.max(1));
        if at % ra as u64 != 0 || size % ra != 0 {
            return Err(p);
        }
        // Page-aligned, as the storage's own bounce buffers (see qimg-io's `aligned`).
        let Some(buf) = AlignedBuf::zeroed(size, ma.max(4096)) else {
            return Err(p);
        };
        let mut buffers = IoBuffers::from_aligned(buf);
        let idx = match self.loads.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.loads.push(None);
                self.loads.len() - 1
            }
        };
        let (token, epoch) = inner.shared.start_unlocked_load(m, key, true);
        if self
            .ring
            .read(
                access.fd,
                at,
                &mut buffers,
                0,
                size,
                LOAD_TOKEN | idx as u64,
            )
            .is_err()
        {
            inner.shared.slice_loads.end(token);
            return Err(p);
        }
        self.loads[idx] = Some(SliceLoad {
            key,
            token,
            epoch,
            buffers,
            size,
            waiting: vec![Parked { joined: false, ..p }],
        });
        self.stats.slice_loads += 1;
        if !self.batching {
            let _ = self.ring.submit();
        }
        Ok(())
    }

    /// A slice read on the ring completed: insert it if nothing changed, then retry its
    /// waiting requests (direct path, else engine).
    pub(super) fn on_slice_load(&mut self, c: RingCompletion) {
        let idx = (c.token & !LOAD_TOKEN) as usize;
        let Some(load) = self.loads.get_mut(idx).and_then(Option::take) else {
            return;
        };
        let inner = self.image.inner.clone();
        let read = c.result >= 0 && c.result as usize == load.size;
        let cached = match super::lock_briefly(&inner.meta) {
            Some(mut m) => {
                let current = inner.shared.slice_loads.end(load.token);
                if !inner
                    .shared
                    .unlocked_load_usable(&m, current, load.epoch, read)
                {
                    false
                } else if m.l2_cached(load.key) {
                    true
                } else if m.l2_victim_dirty() {
                    false
                } else {
                    let mut data = vec![0u8; load.size];
                    let now = inner.shared.now();
                    load.buffers.copy_out(0, &mut data)
                        && match m.insert_l2_slice(load.key, data.into_boxed_slice(), now) {
                            Ok(None) => true,
                            // Not reached: the victim was clean under this same lock. Never
                            // drop a dirty slice, though: the engine writes it back.
                            Ok(Some(dirty)) => {
                                self.write_back_on_engine(dirty);
                                true
                            }
                            Err(_) => false,
                        }
                }
            }
            None => {
                inner.shared.slice_loads.end(load.token);
                false
            }
        };
        for mut p in load.waiting {
            p.loads += 1;
            let retry = if cached {
                let counted = p.joined;
                self.try_direct(p.offset, p.buffers, p.user_data, p.write, p.loads, counted)
            } else {
                Err(p.buffers)
            };
            if let Err(buffers) = retry {
                let request = if p.write {
                    Request::Write {
                        offset: p.offset,
                        buffers,
                    }
                } else {
                    Request::Read {
                        offset: p.offset,
                        buffers,
                    }
                };
                self.run_on_engine_thread(request, p.user_data);
            }
        }
    }

    /// Writes an evicted dirty L2 slice back on the engine thread (a failure there marks the
    /// image as the engine's own write-backs do).
    fn write_back_on_engine(&self, dirty: qimg_cache::DirtySlice) {
        let image = self.image.clone();
        let job = Box::pin(async move {
            let inner = &image.inner;
            let mut m = inner.meta.lock().await;
            if let Err(e) = inner
                .shared
                .write_evicted(&mut m, CacheKind::L2, dirty)
                .await
            {
                let _ = inner.shared.signal_corruption(&mut m, e.to_string()).await;
            }
        });
        let _ = self.worker.run(job);
    }

    /// Requests waiting for slice loads.
    pub(super) fn parked(&self) -> usize {
        self.loads.iter().flatten().map(|l| l.waiting.len()).sum()
    }
}

/// The first L2 slice (in a table that exists) that a `len`-byte request at `offset` needs
/// and the cache does not hold.
fn missing_slice<S: Storage>(
    inner: &crate::engine::image::Inner<S>,
    m: &Meta,
    offset: u64,
    len: u64,
) -> Option<qimg_cache::SliceKey> {
    for (gc, ..) in inner.pieces(offset, len) {
        let l1i = inner.shared.geo.l1_index(GuestOffset(gc)) as usize;
        if l1i >= m.l1_len() {
            return None;
        }
        let Some(table) = m.l2_table(l1i) else {
            continue;
        };
        if inner.shared.unaligned_l2(m, table).is_some() {
            // The engine refuses it (and marks the image corrupt).
            return None;
        }
        let (key, _) = inner.shared.l2_position(m, table, gc);
        if !m.l2_cached(key) {
            return Some(key);
        }
    }
    None
}

//! Reads: allocated data, zeros, compressed clusters, and what the backing chain holds.

use qimg_io::DebugEvent;
use qimg_io::Storage;

use super::*;
use crate::engine::plan::{Planned, ReadPart, ReadSource, piece_parts, plan_read};
use std::future::Future;
use std::pin::Pin;

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

impl<S: Storage> Inner<S> {
    /// Reads guest bytes from `offset` into `buf` (one segment).
    pub(crate) async fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.read_vectored(&mut [IoSliceMut::new(buf)], offset)
            .await
    }

    /// Reads consecutive guest bytes from `offset` into the segments in turn, straight into
    /// each segment, with the whole range held at once (one request, as a virtio or NBD
    /// request with several buffers is).
    pub(crate) async fn read_vectored(
        &self,
        bufs: &mut [IoSliceMut<'_>],
        offset: u64,
    ) -> Result<()> {
        let len = self.request_len(bufs.iter().map(|b| b.len()), offset)?;
        self.read_span(bufs, offset, len).await
    }

    /// [`read_vectored`](Self::read_vectored) of `len` bytes at `offset`, which the caller
    /// checked (the disk, or the VM-state area past it).
    pub(super) async fn read_span(
        &self,
        bufs: &mut [IoSliceMut<'_>],
        offset: u64,
        len: u64,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let (first, end) = self.cluster_span(offset, len);
        let _guard = self.locks.lock(first, end, false).await;
        let scs = self.shared.geo.subcluster_size() as usize;
        let mut parts = Vec::new();
        let mut at = offset;
        for buf in bufs.iter_mut() {
            let segment_len = buf.len() as u64;
            let mut pieces = self.pieces(at, segment_len);
            parts.clear();
            // Planned from the cache under the metadata lock; a cluster whose entry is not
            // cached is looked up with I/O (without the lock), then the plan resumes.
            loop {
                let planned = {
                    let mut m = self.meta.lock().await;
                    self.ensure_open(&m)?;
                    let now = Some(self.shared.now());
                    plan_read(
                        &mut pieces,
                        scs,
                        |gc| self.shared.lookup_cached(&mut m, gc, now),
                        |part| {
                            parts.push(part);
                            true
                        },
                    )
                };
                match planned {
                    Planned::Lacks(piece) => {
                        let entry = self.lookup_for_read(piece.0).await?;
                        parts.extend(piece_parts(&entry, scs, piece));
                    }
                    Planned::Done | Planned::Refused => break,
                }
            }
            self.read_parts(&parts, buf).await?;
            at += segment_len;
        }
        Ok(())
    }

    /// Executes a read plan into `out`: each part's bytes at its position. Data that lies
    /// one after another in the file and in `out` is read in one request.
    pub(super) async fn read_parts(&self, parts: &[ReadPart], out: &mut [u8]) -> Result<()> {
        // `(host offset, position in out, length)` of the data run so far.
        let mut run: Option<(u64, usize, usize)> = None;
        for part in parts {
            if let (ReadSource::Data(h), Some((rh, rp, rl))) = (part.source, &mut run) {
                if *rh + *rl as u64 == h && *rp + *rl == part.pos {
                    *rl += part.len;
                    continue;
                }
            }
            if let Some((rh, rp, rl)) = run.take() {
                self.read_data(&mut out[rp..rp + rl], rh).await?;
            }
            let dst = &mut out[part.pos..part.pos + part.len];
            match part.source {
                ReadSource::Data(h) => run = Some((h, part.pos, part.len)),
                ReadSource::Zero { .. } => dst.fill(0),
                ReadSource::Backing { guest, .. } => self.read_backing(dst, guest).await?,
                ReadSource::Compressed {
                    descriptor,
                    gc,
                    within,
                } => {
                    let inflated = self.read_compressed(&descriptor, gc).await?;
                    dst.copy_from_slice(&inflated[within..within + part.len]);
                }
            }
        }
        if let Some((rh, rp, rl)) = run {
            self.read_data(&mut out[rp..rp + rl], rh).await?;
        }
        Ok(())
    }

    /// Reads guest data at host offset `host` of the data file (zeros past its end).
    async fn read_data(&self, dst: &mut [u8], host: u64) -> Result<()> {
        self.shared.data().0.debug_event(DebugEvent::ReadAio);
        self.shared.read_guest_data(dst, host).await
    }

    /// The L2 entry of the guest cluster at `gc`, for a read. As [`lookup`](Self::lookup),
    /// except that a cache miss reads its slice without holding the metadata lock: misses of
    /// different slices load in parallel, a second miss on a slice being loaded waits for that
    /// load, and the slice is inserted (within the cache's budget, evicting as a locked load
    /// does) only if its table stayed the active one and nobody inserted the slice meanwhile;
    /// otherwise the locked lookup runs. Dropping the request mid-load ends the load.
    pub(crate) async fn lookup_for_read(&self, gc: u64) -> Result<AnyL2Entry> {
        // Each turn either answers or waits for another load to end; a bounded number of
        // waits, then the locked path.
        for _ in 0..8 {
            // Before looking (under the lock), so that a load ending after the look wakes it.
            let ended = self.shared.slice_loads.done.notified();
            let (key, idx, at, size, epoch, token) = {
                let mut m = self.meta.lock().await;
                self.ensure_open(&m)?;
                let l1i =
                    self.shared
                        .geo
                        .l1_index(qimg_format::units::GuestOffset(gc)) as usize;
                let Some(table) = m.l2_table(l1i) else {
                    return self.shared.lookup(&mut m, gc).await;
                };
                if self.shared.unaligned_l2(&m, table).is_some() {
                    return self.shared.lookup(&mut m, gc).await;
                }
                let (key, idx) = self.shared.l2_position(&m, table, gc);
                // A hit, or a miss whose victim must be written back first: the locked path.
                if m.l2_cached(key) || m.l2_victim_dirty() {
                    return self.shared.lookup(&mut m, gc).await;
                }
                if self.shared.slice_loads.engine_loading(key) {
                    drop(m);
                    ended.await;
                    continue;
                }
                if self.shared.slice_loads.loading(key) {
                    // A queue's load, which ends only when its caller collects: load under
                    // the lock instead (which supersedes it).
                    return self.shared.lookup(&mut m, gc).await;
                }
                let at = self.shared.slice_location(&m, CacheKind::L2, key);
                let size = m.l2_slice_size();
                let (token, epoch) = self.shared.start_unlocked_load(&mut m, key, false);
                (key, idx, at, size, epoch, token)
            };
            let load = LoadGuard {
                loads: &self.shared.slice_loads,
                token: Some(token),
            };
            let mut buf = vec![0u8; size];
            self.shared.file.debug_event(DebugEvent::L2Load);
            let read = self.shared.file.read_at(&mut buf, at).await;
            let mut m = self.meta.lock().await;
            let current = load.end();
            if !self
                .shared
                .unlocked_load_usable(&m, current, epoch, read.is_ok())
                || m.l2_cached(key)
            {
                // Something changed, or the read failed: the locked lookup decides (and reports
                // a failure as it always has).
                self.ensure_open(&m)?;
                return self.shared.lookup(&mut m, gc).await;
            }
            self.shared.make_room(&mut m, CacheKind::L2).await?;
            self.shared
                .insert_slice(&mut m, CacheKind::L2, key, buf)
                .await?;
            return self.shared.entry_in_slice(&mut m, key, idx).await;
        }
        let mut m = self.meta.lock().await;
        self.ensure_open(&m)?;
        self.shared.lookup(&mut m, gc).await
    }

    /// Reads `out.len()` bytes from offset `a` of the guest cluster at `gc` as `entry`
    /// describes it (the planner's parts of that one piece, executed).
    pub(super) async fn read_entry_range(
        &self,
        entry: &AnyL2Entry,
        gc: u64,
        a: usize,
        out: &mut [u8],
    ) -> Result<()> {
        let scs = self.shared.geo.subcluster_size() as usize;
        let parts: Vec<ReadPart> = piece_parts(entry, scs, (gc, a, out.len(), 0)).collect();
        self.read_parts(&parts, out).await
    }

    pub(super) async fn read_compressed(
        &self,
        d: &CompressedDescriptor,
        gc: u64,
    ) -> Result<Vec<u8>> {
        let mut input = vec![0u8; d.compressed_size_bytes() as usize];
        let at = d.host_offset().0;
        self.shared.file.debug_event(DebugEvent::ReadCompressed);
        self.shared
            .file
            .read_at_zero_fill(&mut input, at)
            .await
            .map_err(|e| self.shared.storage_error(e))?;
        let mut out = vec![0u8; self.shared.geo.cluster_size() as usize];
        compress::decompress(self.shared.compression, &input, &mut out).map_err(|e| {
            Error::corrupt(
                &self.shared.path,
                format!(
                    "compressed cluster for guest offset {gc:#x} ({} bytes at host offset {at:#x}) \
                     cannot be decompressed: {e}",
                    input.len()
                ),
            )
        })?;
        Ok(out)
    }

    /// Reads guest bytes from the backing chain; zeros without one or past its end.
    pub(super) fn read_backing<'a>(
        &'a self,
        buf: &'a mut [u8],
        offset: u64,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            if self.backing.is_some() {
                self.shared.file.debug_event(DebugEvent::ReadBackingAio);
            }
            match &self.backing {
                None => {
                    buf.fill(0);
                    Ok(())
                }
                Some(Backing::Raw { storage, path }) => storage
                    .read_at_zero_fill(buf, offset)
                    .await
                    .map_err(|e| Error::storage(path, e)),
                Some(Backing::Qcow2(img)) => {
                    let size = img.inner.shared.size();
                    let n = size.saturating_sub(offset).min(buf.len() as u64) as usize;
                    buf[n..].fill(0);
                    if n > 0 {
                        // Straight to the body (the range is inside the backing disk): one
                        // future fewer per level keeps a deep chain's stack small.
                        let mut part = [IoSliceMut::new(&mut buf[..n])];
                        img.inner.read_span(&mut part, offset, n as u64).await?;
                    }
                    Ok(())
                }
            }
        })
    }
}

/// Ends a slice load started by [`Inner::lookup_for_read`], also when the request is dropped
/// mid-load, so that waiters for the slice never wait for a load that will not finish.
struct LoadGuard<'a> {
    loads: &'a crate::engine::state::SliceLoads,
    token: Option<u64>,
}

impl LoadGuard<'_> {
    /// Ends the load: whether it was still current (nobody superseded it).
    fn end(mut self) -> bool {
        self.token.take().is_some_and(|t| self.loads.end(t))
    }
}

impl Drop for LoadGuard<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.token.take() {
            self.loads.end(t);
        }
    }
}

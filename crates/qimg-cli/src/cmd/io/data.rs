//! The requests of qemu-io's data commands on the open image (see the session's module
//! docs for how each maps onto the engine or the storage layer).

use super::errors::*;
use super::raw::*;
use super::session::*;

use qimg::io::{AnyStorage, Storage};
use qimg::{Backing, ExtentKind, Image};

impl Session {
    /// `EIO` for a request that does not lie within the disk.
    pub fn check_request(&self, offset: u64, len: u64) -> Result<(), i32> {
        let size = self.size();
        if offset > size || len > size - offset {
            return Err(EIO);
        }
        Ok(())
    }

    /// The flush a write is followed by in writethrough mode.
    pub(super) async fn after_write(&self, fua: bool) -> Result<(), i32> {
        if (self.cache.writethrough || fua) && !self.cache.no_flush {
            self.flush_now().await?;
        }
        Ok(())
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub async fn read(&self, buf: &mut [u8], offset: u64) -> Result<(), i32> {
        self.check_request(offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(());
        }
        if let Some(r) = &self.raw {
            return r
                .storage
                .read_at_zero_fill(buf, offset)
                .await
                .map_err(storage_errno);
        }
        self.image()
            .read(buf, offset)
            .await
            .map_err(|e| e.errno())?;
        self.copy_on_read(offset, buf.len() as u64).await
    }

    /// Prints what the qcow2 driver reported since the last call, on standard error, as
    /// QEMU's does while it works (the repair of a dirty image, the image marked corrupt).
    pub async fn print_messages(&self) {
        if let Some(img) = &self.img {
            for line in img.take_messages().await {
                complain!("{line}");
            }
        }
    }

    /// The image whose VM-state area `read -b`/`write -b` use: qcow2 only (a raw image has
    /// none, as QEMU's).
    pub(super) fn vm_state_image(&self) -> Result<&Image<AnyStorage>, i32> {
        match self.raw {
            Some(_) => Err(nix::errno::Errno::EOPNOTSUPP as i32),
            None => Ok(self.image()),
        }
    }

    /// `read -b`: the VM-state area.
    pub async fn read_vmstate(&self, buf: &mut [u8], pos: u64) -> Result<(), i32> {
        let img = self.vm_state_image()?;
        img.read_vmstate(buf, pos).await.map_err(|e| e.errno())
    }

    /// `write -b`: the VM-state area.
    pub async fn write_vmstate(&self, buf: &[u8], pos: u64) -> Result<(), i32> {
        let img = self.vm_state_image()?;
        img.write_vmstate(buf, pos).await.map_err(|e| e.errno())
    }

    /// `-C`: what the image does not hold itself in the (sub)clusters a read touched is
    /// written into it, as QEMU's copy-on-read does (zeros as zero (sub)clusters). A raw
    /// image, or one opened without `-C`, is left alone.
    pub(super) async fn copy_on_read(&self, offset: u64, len: u64) -> Result<(), i32> {
        let Some(img) = self.img.as_ref().filter(|_| self.copy_on_read) else {
            return Ok(());
        };
        let unit = img.subcluster_size();
        let lo = offset / unit * unit;
        let hi = (offset + len)
            .div_ceil(unit)
            .saturating_mul(unit)
            .min(img.size());
        let extents = img.map(lo, hi - lo).await.map_err(|e| e.errno())?;
        for e in extents {
            if !matches!(e.kind, ExtentKind::Unallocated { .. }) {
                continue;
            }
            let mut at = e.start;
            let end = e.start + e.length;
            while at < end {
                let n = (end - at).min(1 << 20);
                let mut buf = vec![0u8; n as usize];
                img.read(&mut buf, at).await.map_err(|e| e.errno())?;
                let done = if buf.iter().all(|&b| b == 0) {
                    img.write_zeroes(at, n).await
                } else {
                    img.write(&buf, at).await
                };
                done.map_err(|e| e.errno())?;
                at += n;
            }
        }
        Ok(())
    }

    /// Reads into several buffers from `offset`.
    pub async fn read_vectored(&self, bufs: &mut [Vec<u8>], offset: u64) -> Result<(), i32> {
        let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        self.check_request(offset, total)?;
        if total == 0 {
            return Ok(());
        }
        if let Some(r) = &self.raw {
            let mut at = offset;
            for b in bufs.iter_mut() {
                r.storage
                    .read_at_zero_fill(b, at)
                    .await
                    .map_err(storage_errno)?;
                at += b.len() as u64;
            }
            return Ok(());
        }
        let mut slices: Vec<std::io::IoSliceMut<'_>> = bufs
            .iter_mut()
            .map(|b| std::io::IoSliceMut::new(b))
            .collect();
        self.image()
            .read_vectored(&mut slices, offset)
            .await
            .map_err(|e| e.errno())?;
        self.copy_on_read(offset, total).await
    }

    /// Writes `buf` at `offset` (`fua`: flush afterwards).
    pub async fn write(&self, buf: &[u8], offset: u64, fua: bool) -> Result<(), i32> {
        self.check_request(offset, buf.len() as u64)?;
        if let Some(r) = &self.raw {
            r.storage
                .write_at(buf, offset)
                .await
                .map_err(storage_errno)?;
            r.grew_to(offset + buf.len() as u64);
        } else if !buf.is_empty() {
            self.image()
                .write(buf, offset)
                .await
                .map_err(|e| e.errno())?;
        }
        self.after_write(fua).await
    }

    /// Writes several buffers from `offset`.
    pub async fn write_vectored(
        &self,
        bufs: &[Vec<u8>],
        offset: u64,
        fua: bool,
    ) -> Result<(), i32> {
        let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        self.check_request(offset, total)?;
        if self.raw.is_some() {
            return self.write(&bufs.concat(), offset, fua).await;
        }
        if total > 0 {
            let slices: Vec<std::io::IoSlice<'_>> =
                bufs.iter().map(|b| std::io::IoSlice::new(b)).collect();
            self.image()
                .write_vectored(&slices, offset)
                .await
                .map_err(|e| e.errno())?;
        }
        self.after_write(fua).await
    }

    /// `write -z`: the range reads as zeros (see the module notes for `-u`).
    pub async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        unmap: bool,
        fua: bool,
    ) -> Result<(), i32> {
        self.check_request(offset, len)?;
        if let Some(r) = &self.raw {
            // `-u` lets the file give the space back, as QEMU's file driver punches a hole
            // for a zero write that may unmap; past the end of the file zeros grow it.
            let inside = len.min(r.len.get().saturating_sub(offset));
            if unmap {
                self.raw_punch(r, offset, inside).await?;
                self.raw_zeroes(r, offset + inside, len - inside).await?;
            } else {
                self.raw_zeroes(r, offset, len).await?;
            }
        } else if len > 0 {
            self.zero_range(offset, len, unmap).await?;
        }
        self.after_write(fua).await
    }

    /// The pieces of a write-zeroes as QEMU issues them: whole subclusters (the end of the
    /// disk counts as a subcluster end) at once; a partial head or tail becomes its whole
    /// subcluster when that holds no data and the rest of it already reads as zeros, and is
    /// written with zeros otherwise.
    pub(super) async fn zero_range(&self, offset: u64, len: u64, unmap: bool) -> Result<(), i32> {
        let img = self.image();
        let scs = img.subcluster_size();
        let size = img.size();
        let end = offset + len;
        let mut at = offset;
        while at < end {
            let sc_start = at - at % scs;
            let sc_end = (sc_start + scs).min(size);
            let piece_end = end.min(sc_end);
            let (from, to) = if at == sc_start && piece_end == sc_end {
                // Whole subclusters up to the last one the request covers.
                let body_end = if end == size { end } else { end - end % scs };
                (at, body_end.max(piece_end))
            } else if self.zero_expands(sc_start, sc_end, at, piece_end).await? {
                (sc_start, sc_end)
            } else {
                (at, piece_end)
            };
            let done = match unmap {
                true => img.write_zeroes_unmap(from, to - from).await,
                false => img.write_zeroes(from, to - from).await,
            };
            done.map_err(|e| e.errno())?;
            at = to.max(piece_end);
        }
        Ok(())
    }

    /// Whether QEMU zeroes the whole subcluster `[sc_start, sc_end)` for a write-zeroes of
    /// `[from, to)` inside it: no data in it, and the rest reads as zeros.
    pub(super) async fn zero_expands(
        &self,
        sc_start: u64,
        sc_end: u64,
        from: u64,
        to: u64,
    ) -> Result<bool, i32> {
        let extents = self
            .image()
            .map(sc_start, sc_end - sc_start)
            .await
            .map_err(|e| e.errno())?;
        if !extents.iter().all(|e| {
            matches!(
                e.kind,
                ExtentKind::Zero { .. } | ExtentKind::Unallocated { .. }
            )
        }) {
            return Ok(false);
        }
        Ok(self.reads_zero(sc_start, from - sc_start).await?
            && self.reads_zero(to, sc_end - to).await?)
    }

    /// Whether `[offset, offset + len)` reads as zeros by the metadata of the chain (zero
    /// clusters, or unallocated down to the bottom or past a shorter backing file); data
    /// that happens to be zero does not count, as in QEMU's block status.
    pub(super) async fn reads_zero(&self, offset: u64, len: u64) -> Result<bool, i32> {
        let mut layer = self.image();
        let mut ranges = vec![(offset, len)];
        loop {
            let mut below = Vec::new();
            for (o, l) in ranges.into_iter().filter(|&(_, l)| l > 0) {
                for e in layer.map(o, l).await.map_err(|e| e.errno())? {
                    match e.kind {
                        ExtentKind::Zero { .. } => {}
                        ExtentKind::Unallocated { .. } => below.push((e.start, e.length)),
                        _ => return Ok(false),
                    }
                }
            }
            if below.is_empty() {
                return Ok(true);
            }
            match layer.backing() {
                None => return Ok(true),
                Some(Backing::Qcow2(b)) => {
                    let bs = b.size();
                    ranges = below
                        .into_iter()
                        .filter(|&(o, _)| o < bs)
                        .map(|(o, l)| (o, l.min(bs - o)))
                        .collect();
                    layer = b;
                }
                // A raw backing file: its holes (and what lies past its end) read as zeros.
                Some(Backing::Raw { path, .. }) => {
                    for (o, l) in below {
                        if !raw_hole(path, o, l) {
                            return Ok(false);
                        }
                    }
                    return Ok(true);
                }
            }
        }
    }

    /// `write -c`: compressed clusters, with QEMU's rules (module notes).
    pub async fn write_compressed(&self, buf: &[u8], offset: u64, fua: bool) -> Result<(), i32> {
        self.check_request(offset, buf.len() as u64)?;
        if self.raw.is_some() {
            return Err(ENOTSUP);
        }
        let img = self.image();
        let cs = img.cluster_size();
        if img.data_path() != img.path() {
            return Err(ENOTSUP);
        }
        if offset % cs != 0 {
            return Err(EINVAL);
        }
        let mut first_error = None;
        for (i, chunk) in buf.chunks(cs as usize).enumerate() {
            let at = offset + i as u64 * cs;
            let r = self.compress_cluster(chunk, at).await;
            if let Err(e) = r {
                first_error.get_or_insert(e);
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        self.after_write(fua).await
    }

    /// One cluster of [`write_compressed`](Self::write_compressed).
    pub(super) async fn compress_cluster(&self, chunk: &[u8], at: u64) -> Result<(), i32> {
        let img = self.image();
        let cs = img.cluster_size();
        if chunk.len() as u64 != cs && at + chunk.len() as u64 != img.size() {
            return Err(EINVAL);
        }
        if self.has_host_cluster(at, cs.min(img.size() - at)).await? {
            return Err(EIO);
        }
        img.write_compressed(at, chunk).await.map_err(|e| e.errno())
    }

    /// Whether the cluster at `at` (`len` bytes of it lie in the disk) has a host cluster.
    pub(super) async fn has_host_cluster(&self, at: u64, len: u64) -> Result<bool, i32> {
        let extents = self.image().map(at, len).await.map_err(|e| e.errno())?;
        Ok(extents.iter().any(|e| {
            !matches!(
                e.kind,
                ExtentKind::Zero { host_offset: None }
                    | ExtentKind::Unallocated { host_offset: None }
            )
        }))
    }

    /// `discard`: QEMU's qcow2 discard (module notes).
    pub async fn discard(&self, offset: u64, len: u64) -> Result<(), i32> {
        self.check_request(offset, len)?;
        if self.discard_ignored {
            return Ok(());
        }
        if let Some(r) = &self.raw {
            // QEMU punches the range out of a raw file: past the end of the file there is
            // nothing to punch (the file does not grow).
            let inside = len.min(r.len.get().saturating_sub(offset));
            self.raw_punch(r, offset, inside).await?;
            return self.after_write(false).await;
        }
        let img = self.image();
        // QEMU's block layer marks the bitmaps for the whole request.
        img.mark_dirty(offset, len).map_err(|e| e.errno())?;
        let cs = img.cluster_size();
        let size = img.size();
        let end = offset + len;
        let first = offset.next_multiple_of(cs);
        let last = if end == size { end } else { end - end % cs };
        if self.version < 3 {
            // Version 2 cannot mark a cluster zero: QEMU unallocates it (the engine's
            // discard) when that reads zeros, and leaves it when a backing file would show.
            if first < last && img.backing().is_none() {
                img.discard(first, last - first)
                    .await
                    .map_err(|e| e.errno())?;
            }
            return self.after_write(false).await;
        }
        let backing = img.backing().is_some();
        let mut at = first;
        // Runs of clusters to zero (`true`) or to leave unallocated (`false`), each issued as
        // one request. QEMU leaves a cluster that is unallocated (or zero) without a backing
        // file as it is, but makes its L2 table writable first (allocated when missing,
        // copied when a snapshot shares it): the engine's discard of an unallocated cluster
        // does just that.
        let mut run: Option<(bool, u64, u64)> = None;
        let mut runs = Vec::new();
        while at < last {
            let n = cs.min(last - at);
            let kind = if backing || self.has_host_cluster(at, n).await? {
                Some(true)
            } else if self.unallocated(at, n).await? {
                Some(false)
            } else {
                None
            };
            run = match (run, kind) {
                (Some((k, s, l)), Some(kind)) if k == kind && s + l == at => Some((k, s, l + n)),
                (r, kind) => {
                    runs.extend(r);
                    kind.map(|k| (k, at, n))
                }
            };
            at += n;
        }
        runs.extend(run);
        for (zero, s, l) in runs {
            let done = if zero {
                img.write_zeroes_unmap(s, l).await
            } else {
                img.discard(s, l).await
            };
            done.map_err(|e| e.errno())?;
        }
        self.after_write(false).await
    }

    /// Whether every byte of `[at, at + len)` is unallocated in the image itself (neither
    /// data nor a zero cluster).
    async fn unallocated(&self, at: u64, len: u64) -> Result<bool, i32> {
        let extents = self.image().map(at, len).await.map_err(|e| e.errno())?;
        Ok(extents
            .iter()
            .all(|e| matches!(e.kind, ExtentKind::Unallocated { host_offset: None })))
    }

    /// Bytes from `offset` (up to `len`) with the same allocation state in the image itself
    /// (data, zero or compressed clusters count as allocated; the backing file does not),
    /// and that state.
    pub async fn allocation(&self, offset: u64, len: u64) -> Result<(bool, u64), i32> {
        const STEP: u64 = 1 << 30;
        if let Some(r) = &self.raw {
            // A raw file holds every byte (holes read as zeros): all allocated, as QEMU says;
            // QEMU's null device holds none, unless it reads zeros.
            if let qimg::io::AnyStorage::Null(n) = &r.storage {
                return Ok((n.options().read_zeroes, len));
            }
            return Ok((true, len));
        }
        let img = self.image();
        let mut state = None;
        let mut n = 0;
        let mut at = offset;
        let end = offset + len;
        while at < end {
            let step = STEP.min(end - at);
            let extents = img.map(at, step).await.map_err(|e| e.errno())?;
            for e in extents {
                let allocated = !matches!(e.kind, ExtentKind::Unallocated { .. });
                match state {
                    None => state = Some(allocated),
                    Some(s) if s != allocated => return Ok((s, n)),
                    Some(_) => {}
                }
                n += e.length;
            }
            at += step;
        }
        Ok((state.unwrap_or(false), n))
    }

    /// `flush`.
    pub async fn flush(&self) -> Result<(), i32> {
        if self.cache.no_flush {
            return Ok(());
        }
        self.flush_now().await
    }

    /// Flushes the open image.
    pub(super) async fn flush_now(&self) -> Result<(), i32> {
        match &self.raw {
            Some(r) => r.storage.flush().await.map_err(storage_errno),
            None => self.image().flush().await.map_err(|e| e.errno()),
        }
    }
}

//! Reads: allocated data, zeros, compressed clusters, and what the backing chain holds.

use qimg_io::Storage;

use super::*;
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
        if len == 0 {
            return Ok(());
        }
        let (first, end) = self.cluster_span(offset, len);
        let _guard = self.locks.lock(first, end, false).await;
        let mut at = offset;
        for buf in bufs.iter_mut() {
            let segment_len = buf.len() as u64;
            for (gc, a, n, pos) in self.pieces(at, segment_len) {
                let entry = {
                    let mut m = self.meta.lock().await;
                    self.ensure_open(&m)?;
                    self.lookup(&mut m, gc).await?
                };
                self.read_entry_range(&entry, gc, a, &mut buf[pos..pos + n])
                    .await?;
            }
            at += segment_len;
        }
        Ok(())
    }

    /// Reads `out.len()` bytes from offset `a` of the guest cluster at `gc` as `entry`
    /// describes it.
    pub(super) async fn read_entry_range(
        &self,
        entry: &AnyL2Entry,
        gc: u64,
        a: usize,
        out: &mut [u8],
    ) -> Result<()> {
        let scs = self.geo.subcluster_size() as usize;
        let end = a + out.len();
        let state_at = |off: usize| entry.state(SubclusterIndex((off / scs) as u32));
        let mut pos = a;
        let mut inflated: Option<Vec<u8>> = None;
        while pos < end {
            let state = state_at(pos);
            let mut run_end = ((pos / scs + 1) * scs).min(end);
            while run_end < end && state_at(run_end) == state {
                run_end = (run_end + scs).min(end);
            }
            let dst = &mut out[pos - a..run_end - a];
            match state {
                SubclusterState::Normal => {
                    let host = entry.entry().host_cluster().map_or(0, |h| h.0);
                    let (data, path) = self.data();
                    data.read_at_zero_fill(dst, host + pos as u64)
                        .await
                        .map_err(|e| Error::storage(path, e))?;
                }
                SubclusterState::ZeroAlloc | SubclusterState::ZeroPlain => dst.fill(0),
                SubclusterState::UnallocatedAlloc | SubclusterState::UnallocatedPlain => {
                    self.read_backing(dst, gc + pos as u64).await?;
                }
                SubclusterState::Compressed => {
                    if inflated.is_none() {
                        let L2Entry::Compressed(d) = *entry.entry() else {
                            return Err(Error::corrupt(
                                &self.path,
                                "compressed state without descriptor",
                            ));
                        };
                        inflated = Some(self.read_compressed(&d, gc).await?);
                    }
                    if let Some(c) = &inflated {
                        dst.copy_from_slice(&c[pos..run_end]);
                    }
                }
            }
            pos = run_end;
        }
        Ok(())
    }

    pub(super) async fn read_compressed(
        &self,
        d: &CompressedDescriptor,
        gc: u64,
    ) -> Result<Vec<u8>> {
        let mut input = vec![0u8; d.compressed_size_bytes() as usize];
        let at = d.host_offset().0;
        self.file
            .read_at_zero_fill(&mut input, at)
            .await
            .map_err(|e| self.storage_error(e))?;
        let mut out = vec![0u8; self.geo.cluster_size() as usize];
        compress::decompress(self.compression, &input, &mut out).map_err(|e| {
            Error::corrupt(
                &self.path,
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
                    let size = img.inner.size();
                    let n = size.saturating_sub(offset).min(buf.len() as u64) as usize;
                    buf[n..].fill(0);
                    if n > 0 {
                        img.inner.read(&mut buf[..n], offset).await?;
                    }
                    Ok(())
                }
            }
        })
    }
}

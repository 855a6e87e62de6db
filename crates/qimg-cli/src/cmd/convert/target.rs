//! The output of `qimg convert`: its storage (cache mode applied), the image on it, and the
//! writes the copy makes.

use std::io::IoSlice;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Result, anyhow, bail};
use qimg::Image;
use qimg::chain::ImageFormat;
use qimg::io::{
    AllocateOutcome, AnyStorage, Backend, DiscardOutcome, Storage, StorageError, ZeroOutcome,
};

use crate::cache_mode::CacheMode;
use crate::chain::raw_virtual_size;
use crate::status::{lib_msg, os_msg};

/// The output's file: buffered or `O_DIRECT` (any alignment, bounced), and with `-t unsafe`
/// a flush that does nothing.
#[derive(Clone)]
pub(super) struct OutStorage {
    inner: Arc<AnyStorage>,
    no_flush: bool,
    /// Through the page cache with a flush at the end: write-back is started as the copy goes.
    kick: Option<Arc<WriteBehind>>,
}

/// Bytes written to a buffered output between two starts of the kernel's write-back.
const WRITE_BEHIND: u64 = 32 << 20;

/// Starts the kernel's write-back of what a buffered output was given, every
/// [`WRITE_BEHIND`] bytes, so that the disk writes while the copy goes on rather than all at
/// the final flush (the page cache would otherwise hold up to a tenth of memory unwritten).
/// `posix_fadvise(POSIX_FADV_DONTNEED)` on the range written since the last start: Linux
/// starts writing its dirty pages without waiting for them and drops the pages already
/// written, which the copy does not read again. Advisory: errors are ignored, and the final
/// flush still makes everything durable.
#[derive(Debug, Default)]
struct WriteBehind {
    /// Hull of the offsets written since the last start, and the bytes written.
    since: std::sync::Mutex<(u64, u64, u64)>,
    /// Starts made (for the tests).
    starts: std::sync::atomic::AtomicU64,
}

impl OutStorage {
    fn open(path: &Path, writable: bool, mode: CacheMode) -> Result<Self, StorageError> {
        Ok(Self {
            inner: Arc::new(AnyStorage::open(
                path,
                writable,
                Backend::Threads,
                mode.direct,
            )?),
            no_flush: mode.no_flush,
            kick: (writable && !mode.direct && !mode.no_flush)
                .then(|| Arc::new(WriteBehind::default())),
        })
    }

    /// Counts `len` bytes written at `offset` (by the storage or by `copy_file_range`), and
    /// starts their write-back once [`WRITE_BEHIND`] bytes were written since the last start.
    pub(super) async fn wrote(&self, offset: u64, len: u64) {
        let Some(kick) = &self.kick else {
            return;
        };
        let range = {
            let mut since = kick.since.lock().unwrap_or_else(|e| e.into_inner());
            let (lo, hi, bytes) = *since;
            let (lo, hi) = if bytes == 0 {
                (offset, offset + len)
            } else {
                (lo.min(offset), hi.max(offset + len))
            };
            if bytes + len < WRITE_BEHIND {
                *since = (lo, hi, bytes + len);
                None
            } else {
                *since = (0, 0, 0);
                Some((lo, hi))
            }
        };
        let Some((lo, hi)) = range else {
            return;
        };
        let Some(fd) = self
            .inner
            .direct_access()
            .and_then(|a| a.fd.try_clone_to_owned().ok())
        else {
            return;
        };
        kick.starts
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (Ok(lo), Ok(len)) = (i64::try_from(lo), i64::try_from(hi - lo)) else {
            return;
        };
        let _ = tokio::task::spawn_blocking(move || {
            nix::fcntl::posix_fadvise(
                &fd,
                lo,
                len,
                nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
            )
        })
        .await;
    }

    /// The write-back starts made so far (none for `O_DIRECT`, `-t unsafe` or read-only).
    #[cfg(test)]
    fn write_behind_starts(&self) -> u64 {
        self.kick
            .as_ref()
            .map_or(0, |k| k.starts.load(std::sync::atomic::Ordering::Relaxed))
    }
}

impl Storage for OutStorage {
    fn read_at_most(
        &self,
        buf: &mut [u8],
        offset: u64,
    ) -> impl Future<Output = qimg::io::Result<usize>> + Send {
        self.inner.read_at_most(buf, offset)
    }
    fn read_at(
        &self,
        buf: &mut [u8],
        offset: u64,
    ) -> impl Future<Output = qimg::io::Result<()>> + Send {
        self.inner.read_at(buf, offset)
    }
    fn read_at_zero_fill(
        &self,
        buf: &mut [u8],
        offset: u64,
    ) -> impl Future<Output = qimg::io::Result<()>> + Send {
        self.inner.read_at_zero_fill(buf, offset)
    }
    async fn write_at(&self, buf: &[u8], offset: u64) -> qimg::io::Result<()> {
        self.inner.write_at(buf, offset).await?;
        self.wrote(offset, buf.len() as u64).await;
        Ok(())
    }
    async fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> qimg::io::Result<()> {
        self.inner.write_vectored_at(bufs, offset).await?;
        let len = bufs.iter().map(|b| b.len() as u64).sum();
        self.wrote(offset, len).await;
        Ok(())
    }
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
    ) -> impl Future<Output = qimg::io::Result<ZeroOutcome>> + Send {
        self.inner.write_zeroes(offset, len)
    }
    fn discard(
        &self,
        offset: u64,
        len: u64,
    ) -> impl Future<Output = qimg::io::Result<DiscardOutcome>> + Send {
        self.inner.discard(offset, len)
    }
    fn allocate(
        &self,
        offset: u64,
        len: u64,
    ) -> impl Future<Output = qimg::io::Result<AllocateOutcome>> + Send {
        self.inner.allocate(offset, len)
    }
    fn flush(&self) -> impl Future<Output = qimg::io::Result<()>> + Send {
        let flush = (!self.no_flush).then(|| self.inner.flush());
        async move {
            match flush {
                Some(f) => f.await,
                None => Ok(()),
            }
        }
    }
    fn len(&self) -> impl Future<Output = qimg::io::Result<u64>> + Send {
        self.inner.len()
    }
    fn set_len(&self, len: u64) -> impl Future<Output = qimg::io::Result<()>> + Send {
        self.inner.set_len(len)
    }
    fn request_alignment(&self) -> usize {
        self.inner.request_alignment()
    }
    fn mem_alignment(&self) -> usize {
        self.inner.mem_alignment()
    }
    fn direct_access(&self) -> Option<qimg::io::DirectAccess<'_>> {
        self.inner.direct_access()
    }
    // The image locks (the engine takes QEMU's write lock through these: without them an
    // image another process holds was written) and error injection's events go through.
    fn lock_image(&self, lock: qimg::io::ImageLock) -> qimg::io::Result<()> {
        self.inner.lock_image(lock)
    }
    fn unlock_image(&self) {
        self.inner.unlock_image()
    }
    fn debug_event(&self, event: qimg::io::DebugEvent) {
        self.inner.debug_event(event)
    }
}

/// The output image.
#[derive(Clone)]
pub(super) enum OutputImage {
    Qcow2(Image<OutStorage>),
    Raw(OutStorage),
}

/// Where it is written; with `writethrough` every write is followed by a flush.
#[derive(Clone)]
pub(super) struct ConvertOutput {
    pub(super) out: OutputImage,
    writethrough: bool,
}

impl ConvertOutput {
    /// A descriptor of a raw output file (for copy offloading); `None` for a qcow2 output.
    pub(super) fn raw_fd(&self) -> Option<std::os::fd::OwnedFd> {
        match &self.out {
            OutputImage::Raw(f) => f.direct_access()?.fd.try_clone_to_owned().ok(),
            OutputImage::Qcow2(_) => None,
        }
    }

    /// Bytes `copy_file_range` wrote at `offset` of a raw output, for its write-behind (see
    /// [`OutStorage::wrote`]).
    pub(super) async fn wrote(&self, offset: u64, len: u64) {
        if let OutputImage::Raw(f) = &self.out {
            f.wrote(offset, len).await;
        }
    }

    /// The flush of a writethrough cache mode.
    pub(super) async fn written(&self) -> Result<()> {
        if self.writethrough {
            self.flush().await?;
        }
        Ok(())
    }

    pub(super) async fn flush(&self) -> Result<()> {
        match &self.out {
            OutputImage::Qcow2(img) => img.flush().await.map_err(|e| anyhow!("{e}")),
            OutputImage::Raw(f) => f.flush().await.map_err(|e| anyhow!("{e}")),
        }
    }

    pub(super) async fn write(&self, buf: &[u8], offset: u64) -> Result<()> {
        match &self.out {
            OutputImage::Qcow2(img) => img.write(buf, offset).await.map_err(|e| anyhow!("{e}"))?,
            OutputImage::Raw(f) => f.write_at(buf, offset).await.map_err(|e| anyhow!("{e}"))?,
        }
        self.written().await
    }

    pub(super) async fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        match &self.out {
            OutputImage::Qcow2(img) => img
                .write_zeroes_unmap(offset, len)
                .await
                .map_err(|e| anyhow!("{e}"))?,
            OutputImage::Raw(f) => {
                f.write_zeroes(offset, len)
                    .await
                    .map_err(|e| anyhow!("{e}"))?;
            }
        }
        self.written().await
    }

    pub(super) async fn write_compressed(&self, buf: &[u8], offset: u64) -> Result<()> {
        match &self.out {
            OutputImage::Qcow2(img) => img
                .write_compressed(offset, buf)
                .await
                .map_err(|e| anyhow!("{e}"))?,
            OutputImage::Raw(_) => bail!("Compression not supported for this file format"),
        }
        self.written().await
    }

    pub(super) async fn finish(&self) -> Result<()> {
        match &self.out {
            OutputImage::Qcow2(img) => img.close().await.map_err(|e| anyhow!("{e}")),
            OutputImage::Raw(f) => f.flush().await.map_err(|e| anyhow!("{e}")),
        }
    }
}

/// The virtual size of the output's backing file (raw files round up to 512 bytes, as in
/// QEMU).
pub(super) async fn backing_len(img: &Image<OutStorage>) -> Result<u64> {
    Ok(match img.backing() {
        Some(qimg::Backing::Qcow2(b)) => b.size(),
        Some(qimg::Backing::Raw { storage, path }) => raw_virtual_size(
            storage
                .len()
                .await
                .map_err(|e| anyhow!("{}: {e}", path.display()))?,
        ),
        None => u64::MAX,
    })
}

/// Opens the existing output `file` (created or not by this run) with cache mode `cache`,
/// refusing one smaller than the copy.
pub(super) async fn open_target(
    path: &Path,
    file: &str,
    fmt: ImageFormat,
    size: u64,
    cache: CacheMode,
) -> Result<ConvertOutput> {
    // An NBD export or the null device is no file to look for.
    let file_name = !qimg::io::nbd::is_nbd_name(file) && qimg::chain::null_device(path).is_none();
    if let (true, Err(e)) = (file_name, std::fs::metadata(path)) {
        return Err(crate::status::open_msg(
            anyhow!("Could not open '{file}': {}", os_msg(&e)),
            file,
        ));
    }
    let out = match fmt {
        ImageFormat::Qcow2 => {
            let o = crate::image_spec::options_for(path)
                .writable(true)
                .direct(cache.direct)
                .clean_timer(false);
            let opener = move |p: &Path, writable: bool| OutStorage::open(p, writable, cache);
            let img = o
                .open_with(path, &opener)
                .await
                .map_err(|e| anyhow!("Could not open '{file}': {}", lib_msg(&e, file)))?;
            if img.size() < size {
                bail!("output file is smaller than input file");
            }
            OutputImage::Qcow2(img)
        }
        ImageFormat::Raw => {
            let f = OutStorage::open(path, true, cache)
                .map_err(|e| anyhow!("Could not open '{file}': {e}"))?;
            // QEMU's raw driver's lock on a raw output: what it uses, refusing nobody.
            f.lock_image(qimg::io::ImageLock::SharedReadWrite)
                .map_err(|e| crate::status::storage_open_error(e, file))?;
            let len = f.len().await.map_err(|e| anyhow!("{file}: {e}"))?;
            if len < size {
                bail!("output file is smaller than input file");
            }
            OutputImage::Raw(f)
        }
    };
    Ok(ConvertOutput {
        out,
        writethrough: cache.writethrough,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use qimg_testkit::{Scratch, pattern};

    /// Writes 80 MiB in 4 MiB pieces through an output opened with `mode`; returns the
    /// write-back starts it made, after checking the file holds what was written.
    fn write_80_mib(mode: &str) -> u64 {
        let dir = Scratch::new("write-behind");
        let path = dir.path("out.raw");
        std::fs::File::create(&path).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let mode = CacheMode::parse(mode).unwrap();
            let out = OutStorage::open(&path, true, mode).unwrap();
            for k in 0..20u64 {
                let at = k * (4 << 20);
                let data = pattern(k, at, 4 << 20);
                if k % 2 == 0 {
                    out.write_at(&data, at).await.unwrap();
                } else {
                    out.write_vectored_at(&[IoSlice::new(&data)], at)
                        .await
                        .unwrap();
                }
            }
            out.flush().await.unwrap();
            let starts = out.write_behind_starts();
            let bytes = std::fs::read(&path).unwrap();
            assert_eq!(bytes.len(), 80 << 20);
            for k in 0..20u64 {
                let at = k * (4 << 20);
                let piece = &bytes[at as usize..(at + (4 << 20)) as usize];
                assert!(
                    piece == pattern(k, at, 4 << 20),
                    "piece {k} differs ({mode:?})"
                );
            }
            starts
        })
    }

    #[test]
    fn a_buffered_output_starts_write_back_every_32_mib() {
        // 80 MiB: at 32 and 64 MiB.
        assert_eq!(write_80_mib("writeback"), 2);
    }

    #[test]
    fn unsafe_and_direct_outputs_leave_write_back_to_the_kernel() {
        // -t unsafe never flushes: nothing to overlap with. O_DIRECT has no page cache.
        assert_eq!(write_80_mib("unsafe"), 0);
        assert_eq!(write_80_mib("none"), 0);
    }
}

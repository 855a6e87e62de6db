//! The output of `qimg convert`: its storage (cache mode applied), the image on it, and the
//! writes the copy makes.

use std::io::IoSlice;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Result, anyhow, bail};
use qimg::chain::ImageFormat;
use qimg::io::{
    AllocateOutcome, AnyStorage, Backend, DiscardOutcome, Storage, StorageError, ZeroOutcome,
};
use qimg::{Image, OpenOptions};

use crate::cache_mode::CacheMode;
use crate::chain::raw_virtual_size;
use crate::status::{lib_msg, os_msg};

/// The output's file: buffered or `O_DIRECT` (any alignment, bounced), and with `-t unsafe`
/// a flush that does nothing.
#[derive(Clone)]
pub(super) struct OutStorage {
    inner: Arc<AnyStorage>,
    no_flush: bool,
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
        })
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
    fn write_at(
        &self,
        buf: &[u8],
        offset: u64,
    ) -> impl Future<Output = qimg::io::Result<()>> + Send {
        self.inner.write_at(buf, offset)
    }
    fn write_vectored_at(
        &self,
        bufs: &[IoSlice<'_>],
        offset: u64,
    ) -> impl Future<Output = qimg::io::Result<()>> + Send {
        self.inner.write_vectored_at(bufs, offset)
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
                .write_zeroes(offset, len)
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
    if let Err(e) = std::fs::metadata(path) {
        bail!("Could not open '{file}': {}", os_msg(&e));
    }
    let out = match fmt {
        ImageFormat::Qcow2 => {
            let o = OpenOptions::new()
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

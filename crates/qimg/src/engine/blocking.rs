//! The blocking facade: the same engine, driven by a private current-thread tokio runtime.
//!
//! For command-line tools, fuzzers and embedders without an async runtime. Each call blocks
//! the calling thread until the request completes. Do not call these from inside an async
//! task (tokio refuses to block inside a runtime); use [`crate::Image`] there.

use std::path::Path;

use qimg_io::AnyStorage;
use tokio::runtime::Runtime;

use super::image::{Image, Stats};
use super::options::OpenOptions;
use crate::error::{Error, Result};

/// A blocking handle to an image on files, opened by [`OpenOptions::open_blocking`].
#[derive(Debug)]
pub struct BlockingImage {
    image: Option<Image<AnyStorage>>,
    rt: Runtime,
}

impl BlockingImage {
    /// Opens the image at `path` (see [`OpenOptions::open_blocking`]).
    fn open(path: impl AsRef<Path>, opts: &OpenOptions) -> Result<Self> {
        Self::open_in(path.as_ref(), opts, None)
    }

    /// Opens `file` (when given) or the image at `path` on a runtime of the image's own.
    fn open_in(path: &Path, opts: &OpenOptions, file: Option<std::fs::File>) -> Result<Self> {
        let rt = qimg_io::threads::runtime()
            .build()
            .map_err(|e| Error::io(path, "start the I/O runtime", e))?;
        let mut opts = opts.clone();
        opts.timer_thread = true;
        let image = match file {
            Some(file) => rt.block_on(opts.open_file(file, path))?,
            None => rt.block_on(opts.open(path))?,
        };
        Ok(Self {
            image: Some(image),
            rt,
        })
    }

    fn image(&self) -> &Image<AnyStorage> {
        // Only `close` takes the image, and it consumes `self`.
        self.image.as_ref().expect("image present until close")
    }

    /// The async image underneath.
    pub fn as_async(&self) -> &Image<AnyStorage> {
        self.image()
    }

    /// The virtual disk size in bytes.
    pub fn size(&self) -> u64 {
        self.image().size()
    }

    /// See [`Image::read`].
    pub fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.rt.block_on(self.image().read(buf, offset))
    }

    /// See [`Image::write`].
    pub fn write(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.rt.block_on(self.image().write(buf, offset))
    }

    /// See [`Image::write_zeroes`].
    pub fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.rt.block_on(self.image().write_zeroes(offset, len))
    }

    /// See [`Image::write_zeroes_unmap`].
    pub fn write_zeroes_unmap(&self, offset: u64, len: u64) -> Result<()> {
        self.rt
            .block_on(self.image().write_zeroes_unmap(offset, len))
    }

    /// See [`Image::discard`].
    pub fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.rt.block_on(self.image().discard(offset, len))
    }

    /// See [`Image::flush`].
    pub fn flush(&self) -> Result<()> {
        self.rt.block_on(self.image().flush())
    }

    /// See [`Image::resize`].
    pub fn resize(&self, new_size: u64) -> Result<()> {
        self.rt.block_on(self.image().resize(new_size))
    }

    /// See [`Image::stats`].
    pub fn stats(&self) -> Stats {
        self.rt.block_on(self.image().stats())
    }

    /// Flushes and closes (see [`Image::close`]).
    pub fn close(mut self) -> Result<()> {
        let image = self.image.take().expect("image present until close");
        self.rt.block_on(image.close())
    }
}

impl Drop for BlockingImage {
    fn drop(&mut self) {
        if let Some(image) = self.image.take() {
            // Best effort: a caller who needs the error calls `close`.
            let _ = self.rt.block_on(image.close());
        }
    }
}

impl OpenOptions {
    /// Opens the image at `path` as [`open`](Self::open) does, behind a blocking handle driven
    /// by a private current-thread runtime. Not for use inside an async task.
    pub fn open_blocking(&self, path: impl AsRef<Path>) -> Result<BlockingImage> {
        BlockingImage::open(path, self)
    }

    /// [`open_file`](Self::open_file) for programs without a runtime.
    pub fn open_file_blocking(
        &self,
        file: std::fs::File,
        name: impl AsRef<Path>,
    ) -> Result<BlockingImage> {
        BlockingImage::open_in(name.as_ref(), self, Some(file))
    }
}

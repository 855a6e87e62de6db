//! [`Image`]: an open qcow2 image, its shared state, and its public async API.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use qimg_cache::CacheStats;
use qimg_format::geometry::{Geometry, RefcountGeometry};
use qimg_format::header::CompressionType;
use qimg_format::l2::L2Context;
use qimg_io::{Storage, StorageError};

use super::lock::RangeLocks;
use super::meta::Meta;
use super::open::Backing;
use super::options::Allocation;
use crate::error::{Error, Result};

/// Counters and cache statistics of an open image.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Bytes copied on write: the parts of newly allocated (sub)clusters the guest did not
    /// write, read from the old cluster, the backing file or zeros.
    pub cow_bytes: u64,
    /// Host clusters allocated for guest data.
    pub clusters_allocated: u64,
    /// Host clusters whose refcount dropped to zero.
    pub clusters_freed: u64,
    /// The L2 slice cache.
    pub l2_cache: CacheStats,
    /// The refcount block cache.
    pub refcount_cache: CacheStats,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) cow_bytes: AtomicU64,
    pub(crate) clusters_allocated: AtomicU64,
    pub(crate) clusters_freed: AtomicU64,
}

/// An open qcow2 image: reads, writes, write-zeroes, discards and flushes on an async core.
///
/// `Image` is a cheap handle (`Clone` shares the image); requests may be issued from many tasks
/// at once. Call [`close`](Image::close) (or at least [`flush`](Image::flush)) before dropping
/// the last handle of a writable image: caches are written back only then.
#[derive(Debug)]
pub struct Image<S: Storage> {
    pub(crate) inner: Arc<Inner<S>>,
}

impl<S: Storage> Clone for Image<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

#[derive(Debug)]
pub(crate) struct Inner<S: Storage> {
    pub(crate) path: PathBuf,
    pub(crate) file: S,
    pub(crate) data_file: Option<(PathBuf, S)>,
    pub(crate) backing: Option<Backing<S>>,
    pub(crate) geo: Geometry,
    pub(crate) rgeo: RefcountGeometry,
    pub(crate) ctx: L2Context,
    pub(crate) writable: bool,
    pub(crate) compression: CompressionType,
    pub(crate) data_file_raw: bool,
    pub(crate) lazy: bool,
    pub(crate) allocation: Allocation,
    pub(crate) version: u32,
    pub(crate) size: AtomicU64,
    pub(crate) meta: tokio::sync::Mutex<Meta>,
    pub(crate) locks: RangeLocks,
    pub(crate) counters: Counters,
    pub(crate) epoch: tokio::time::Instant,
    pub(crate) clean_interval: Option<Duration>,
    /// Corruption was found while writing: further writes are refused.
    pub(crate) marked_corrupt: AtomicBool,
    /// A header switch failed (see [`Error::Halted`]): further writes are refused until the
    /// image is reopened. Holds what failed.
    pub(crate) halted: std::sync::OnceLock<String>,
}

impl<S: Storage + 'static> Image<S> {
    /// The virtual disk size in bytes.
    pub fn size(&self) -> u64 {
        self.inner.size.load(Ordering::Acquire)
    }

    /// The cluster size in bytes.
    pub fn cluster_size(&self) -> u64 {
        self.inner.geo.cluster_size()
    }

    /// The subcluster size in bytes (the cluster size without extended L2 entries).
    pub fn subcluster_size(&self) -> u64 {
        self.inner.geo.subcluster_size()
    }

    /// Whether the image has extended L2 entries (32 subclusters per cluster).
    pub fn extended_l2(&self) -> bool {
        self.inner.geo.extended_l2()
    }

    /// Whether the image is open for writing.
    pub fn is_writable(&self) -> bool {
        self.inner.writable
    }

    /// The image file's name as given at open.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// The storage holding the image file (for a VMM that issues its own I/O on the same
    /// file, or to see which backend [`OpenOptions::open`](crate::OpenOptions::open) chose).
    pub fn storage(&self) -> &S {
        &self.inner.file
    }

    /// The backing image, if one is open.
    pub fn backing(&self) -> Option<&Backing<S>> {
        self.inner.backing.as_ref()
    }

    /// Counters and cache statistics.
    pub async fn stats(&self) -> Stats {
        let m = self.inner.meta.lock().await;
        let c = &self.inner.counters;
        Stats {
            cow_bytes: c.cow_bytes.load(Ordering::Relaxed),
            clusters_allocated: c.clusters_allocated.load(Ordering::Relaxed),
            clusters_freed: c.clusters_freed.load(Ordering::Relaxed),
            l2_cache: m.l2.stats(),
            refcount_cache: m.rc.stats(),
        }
    }

    /// Fills `buf` with guest data from `offset`.
    pub async fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.inner.read(buf, offset).await
    }

    /// Writes `buf` at guest `offset`, allocating (and copying on write) as needed.
    pub async fn write(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.inner.write(buf, offset).await
    }

    /// Writes one whole guest cluster compressed with the image's compression type (zlib or
    /// zstd), as `qemu-img convert -c` does: `offset` must be cluster aligned and `data` one
    /// cluster long, or shorter only for the last cluster of a disk whose size is not a
    /// multiple of the cluster size. Several compressed clusters share a host cluster. Data
    /// that does not shrink is stored uncompressed. Images with an external data file cannot
    /// hold compressed clusters.
    pub async fn write_compressed(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.inner.write_compressed(offset, data).await
    }

    /// Makes `len` bytes at `offset` read as zeros: whole subclusters (clusters without
    /// extended L2) only change metadata, partial ones are written with zeros.
    pub async fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.write_zeroes(offset, len).await
    }

    /// Discards `len` bytes at `offset`: every whole subcluster (cluster without extended L2)
    /// in the range becomes unallocated, reading from the backing file or as zeros; a host
    /// cluster left with no allocated subcluster is freed and its space punched. Parts of the
    /// range smaller than a subcluster are left as they are (discard is advisory).
    pub async fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.discard(offset, len).await
    }

    /// Writes back every cached metadata change in the safe order and makes everything
    /// written so far durable.
    ///
    /// After a failed flush nothing written since the last successful one is promised. The
    /// engine keeps its write-back order, so a later flush that works makes everything
    /// durable on storage that keeps what it could not write; files do not (Linux may drop
    /// the pages a failed fsync could not write), so on [`qimg_io::FileStorage`] and
    /// [`qimg_io::UringStorage`] every later flush fails too, as in QEMU: reopen the image.
    pub async fn flush(&self) -> Result<()> {
        let mut m = self.inner.meta.lock().await;
        self.inner.flush_meta(&mut m).await
    }

    /// Grows the virtual disk to `new_size` bytes (shrinking is refused).
    pub async fn resize(&self, new_size: u64) -> Result<()> {
        self.inner.resize(new_size).await
    }

    /// Runs one pass of the cache-clean timer now: slices unused for a whole clean interval
    /// are written back if dirty and dropped. The timer task does this by itself when a tokio
    /// runtime was running at open; returns the bytes freed.
    pub async fn clean_idle_caches(&self) -> Result<u64> {
        let mut m = self.inner.meta.lock().await;
        self.inner.clean_idle(&mut m).await
    }

    /// Flushes and, for images with lazy refcounts, marks the image clean. Further requests
    /// on any handle of this image fail.
    pub async fn close(&self) -> Result<()> {
        let mut m = self.inner.meta.lock().await;
        if m.closed {
            return Ok(());
        }
        if self.inner.writable {
            self.inner.flush_meta(&mut m).await?;
            self.inner.mark_clean(&mut m).await?;
        }
        m.closed = true;
        Ok(())
    }
}

impl<S: Storage> Inner<S> {
    pub(crate) fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    pub(crate) fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    pub(crate) fn storage_error(&self, e: StorageError) -> Error {
        Error::storage(&self.path, e)
    }

    /// Where guest data lives: the external data file, or the image file.
    pub(crate) fn data(&self) -> (&S, &Path) {
        match &self.data_file {
            Some((p, s)) => (s, p),
            None => (&self.file, &self.path),
        }
    }

    /// Refuses changes after a failed header switch ([`Error::Halted`]).
    pub(crate) fn check_not_halted(&self) -> Result<()> {
        match self.halted.get() {
            Some(what) => Err(Error::Halted {
                path: self.path.clone(),
                what: what.clone(),
            }),
            None => Ok(()),
        }
    }

    pub(crate) fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        let size = self.size();
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::OutOfRange {
                path: self.path.clone(),
                offset,
                len,
                size,
            });
        }
        Ok(())
    }

    pub(crate) fn check_writable(&self) -> Result<()> {
        self.check_not_halted()?;
        if self.marked_corrupt.load(Ordering::Acquire) {
            return Err(Error::Corrupt {
                path: self.path.clone(),
                what: "the image was marked corrupt after an inconsistency was found; \
                       writes are refused (run qimg check -r all)"
                    .into(),
            });
        }
        if self.writable {
            Ok(())
        } else {
            Err(Error::ReadOnly {
                path: self.path.clone(),
            })
        }
    }
}

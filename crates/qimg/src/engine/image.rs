//! [`Image`]: the handle of an open qcow2 image, and [`Inner`], what the handle shares: the
//! [`Shared`] state, the backing image, the metadata lock and the range locks.

use std::path::PathBuf;
use std::sync::Arc;

use qimg_cache::CacheStats;
use qimg_io::Storage;

use super::lock::RangeLocks;
use super::meta::Meta;
use super::state::Shared;

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

/// A backing file below an image.
#[derive(Debug)]
pub enum Backing<S: Storage> {
    /// A qcow2 image (opened read-only, with its own chain).
    Qcow2(Image<S>),
    /// A raw image: bytes past its end read as zeros.
    Raw {
        /// The storage.
        storage: S,
        /// Its name, for errors.
        path: PathBuf,
    },
}

/// What an [`Image`] handle shares.
#[derive(Debug)]
pub(crate) struct Inner<S: Storage> {
    /// Files, geometry, options and flags: what the metadata code works on.
    pub(crate) shared: Shared<S>,
    pub(crate) backing: Option<Backing<S>>,
    /// The metadata lock: the L1 table, the slice caches, allocation state.
    pub(crate) meta: tokio::sync::Mutex<Meta>,
    /// Guest-cluster range locks of requests in flight and write leases.
    pub(crate) locks: RangeLocks,
}

impl<S: Storage> Inner<S> {
    /// [`Image::close`]: flush, mark clean, release the image locks; requests fail after it.
    pub(crate) async fn close(&self) -> crate::error::Result<()> {
        let mut m = self.meta.lock().await;
        if m.is_closed() {
            return Ok(());
        }
        // An image made unusable by corruption writes nothing more (QEMU's ejected driver
        // does not write back its caches either): it is marked corrupt and wants a repair.
        if self.shared.writable && self.shared.check_usable().is_ok() {
            self.shared.free_abandoned(&mut m).await?;
            self.store_bitmaps(&mut m).await?;
            self.shared.flush_closing(&mut m).await?;
            self.shared.trim_reservation(m.end_cluster()).await?;
            self.shared.mark_clean(&mut m).await?;
        }
        m.mark_closed();
        // As QEMU on close: other processes may open the files from now on.
        self.release_locks();
        Ok(())
    }

    /// Releases the image locks of every file of the chain (see
    /// [`OpenOptions::locking`](super::OpenOptions::locking)).
    pub(crate) fn release_locks(&self) {
        self.shared.file.unlock_image();
        if let Some((_, data)) = &self.shared.data_file {
            data.unlock_image();
        }
        match &self.backing {
            Some(Backing::Qcow2(image)) => image.inner.release_locks(),
            Some(Backing::Raw { storage, .. }) => storage.unlock_image(),
            None => {}
        }
    }
}

/// [`OpenOptions::close_on_drop`](super::OpenOptions::close_on_drop): the last handle's drop
/// closes the image, on a thread of its own with a runtime of its own (a drop inside an async
/// task must not block that task's runtime on itself).
impl<S: Storage> Drop for Inner<S> {
    fn drop(&mut self) {
        if !self.shared.close_on_drop {
            return;
        }
        let this = &*self;
        std::thread::scope(|s| {
            let close = std::thread::Builder::new()
                .name("qimg-close".into())
                .spawn_scoped(s, move || {
                    qimg_io::threads::started("qimg-close");
                    if let Ok(rt) = qimg_io::threads::runtime().build() {
                        let _ = rt.block_on(this.close());
                    }
                });
            if let Ok(t) = close {
                let _ = t.join();
            }
        });
    }
}

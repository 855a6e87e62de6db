//! [`Shared`]: the state of an open image that the metadata code needs (files, geometry,
//! options, counters, the corrupt and halted flags), and the checks every request makes.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use qimg_format::geometry::{Geometry, RefcountGeometry};
use qimg_format::header::CompressionType;
use qimg_format::l2::L2Context;
use qimg_io::{Storage, StorageError};

use super::options::Allocation;
use crate::error::{Error, Result};

/// Event counters behind [`Stats`](super::Stats).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) cow_bytes: AtomicU64,
    pub(crate) clusters_allocated: AtomicU64,
    pub(crate) clusters_freed: AtomicU64,
}

/// What every part of the engine reads: the image's files, geometry, options and flags.
/// The metadata code ([`super::meta`]) works on this alone; [`Inner`](super::image::Inner)
/// adds the backing image, the metadata lock and the range locks.
#[derive(Debug)]
pub(crate) struct Shared<S: Storage> {
    pub(crate) path: PathBuf,
    pub(crate) file: S,
    pub(crate) data_file: Option<(PathBuf, S)>,
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
    pub(crate) counters: Counters,
    pub(crate) epoch: tokio::time::Instant,
    pub(crate) clean_interval: Option<Duration>,
    /// Corruption was found while writing: further writes are refused.
    pub(crate) marked_corrupt: AtomicBool,
    /// A header switch failed (see [`Error::Halted`]): further writes are refused until the
    /// image is reopened. Holds what failed.
    pub(crate) halted: std::sync::OnceLock<String>,
    /// Host clusters reserved by write leases that were dropped without commit or abort:
    /// freed by the next flush (or close) under the metadata lock. A drop cannot wait for the
    /// lock, and a task spawned for it could run after `close`.
    pub(crate) abandoned: std::sync::Mutex<Vec<u64>>,
    /// [`OpenOptions::close_on_drop`](super::OpenOptions::close_on_drop).
    pub(crate) close_on_drop: bool,
}

impl<S: Storage> Shared<S> {
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

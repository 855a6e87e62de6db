//! A raw image as qemu-io's target: opened on the storage layer, its holes, zeroes and
//! truncation.

use super::errors::*;
use super::session::*;

use std::path::Path;

use qimg::io::{AnyStorage, ImageLock, Storage, StorageError};

use crate::cmd::resize::Prealloc;

/// Whether `[offset, offset + len)` of the raw file at `path` is a hole or past its end, as
/// the file system reports it (`SEEK_DATA`); `false` when that cannot be told.
pub(super) fn raw_hole(path: &Path, offset: u64, len: u64) -> bool {
    use nix::unistd::{Whence, lseek};
    if let Some(null) = qimg::chain::null_device(path) {
        // QEMU's null device has no data; with `read-zeroes` it reports zeros.
        let _ = (offset, len);
        return !null.read_zeroes;
    }
    let Ok(file) = std::fs::File::open(path) else {
        return false;
    };
    let Ok(file_len) = file.metadata().map(|m| m.len()) else {
        return false;
    };
    if offset >= file_len {
        return true;
    }
    let Ok(at) = i64::try_from(offset) else {
        return false;
    };
    match lseek(&file, at, Whence::SeekData) {
        // The next data starts at or after the end of the range (or of the file).
        Ok(next) => u64::try_from(next).is_ok_and(|n| n >= (offset + len).min(file_len)),
        // No data after `offset`.
        Err(nix::errno::Errno::ENXIO) => true,
        Err(_) => false,
    }
}

impl Session {
    /// Opens a raw image with the locks QEMU takes on it.
    pub(super) async fn open_raw(
        &mut self,
        path: &Path,
        spec: &OpenSpec,
    ) -> Result<(), StorageError> {
        let storage = AnyStorage::open(path, !spec.read_only, spec.backend, spec.cache.direct)?;
        // QEMU's raw driver passes qemu-io's permissions through to the file, and qemu-io
        // shares them all: a raw image takes only the locks of what it uses (bytes 100 and,
        // read-write, 101) and refuses nobody.
        let lock = if spec.read_only {
            ImageLock::SharedRead
        } else {
            ImageLock::SharedReadWrite
        };
        storage.lock_image(lock)?;
        let len = storage.len().await?;
        self.raw = Some(std::rc::Rc::new(RawFile {
            storage,
            len: std::cell::Cell::new(len),
        }));
        self.cache = spec.cache;
        self.read_only = spec.read_only;
        Ok(())
    }

    /// Punches `[offset, offset + len)`, which the file holds, out of a raw file, as QEMU's
    /// file driver (`FALLOC_FL_PUNCH_HOLE`): it reads as zeros and no longer takes space;
    /// where the file cannot punch, zeros are written instead.
    pub(super) async fn raw_punch(&self, r: &RawFile, offset: u64, len: u64) -> Result<(), i32> {
        if len == 0 {
            return Ok(());
        }
        let punched = r.storage.discard(offset, len).await;
        if !matches!(punched, Ok(qimg::io::DiscardOutcome::Deallocated)) {
            self.raw_zeroes(r, offset, len).await?;
        }
        Ok(())
    }

    /// Zeroes of a raw file (growing it when they reach past its end).
    pub(super) async fn raw_zeroes(&self, r: &RawFile, offset: u64, len: u64) -> Result<(), i32> {
        if len == 0 {
            return Ok(());
        }
        let file_len = r.len.get();
        // Past the end of the file only the part inside it needs zeroing; the rest is
        // written so that the file grows to the end of the request.
        let inside = len.min(file_len.saturating_sub(offset));
        if inside > 0 {
            r.storage
                .write_zeroes(offset, inside)
                .await
                .map_err(storage_errno)?;
        }
        if inside < len {
            let from = offset + inside;
            r.storage
                .write_at(&vec![0; (len - inside) as usize], from)
                .await
                .map_err(storage_errno)?;
            r.grew_to(offset + len);
        }
        Ok(())
    }

    /// `truncate` of a raw image, as QEMU's file driver (`raw_regular_truncate`): any size
    /// without preallocation; with it only growing (`falloc` reserves the new area, `full`
    /// writes it with zeros, `metadata` is not a mode of a file). `false`: not a raw image.
    /// The error is in QEMU's words.
    pub async fn truncate_raw(&self, size: u64, prealloc: Prealloc) -> Result<bool, String> {
        let Some(r) = &self.raw else {
            return Ok(false);
        };
        if matches!(r.storage, AnyStorage::Null(_)) {
            // QEMU's null driver has no truncate.
            return Err("Image format driver does not support resize".into());
        }
        // An error that is not the system's carries its own words (a fixed-size window).
        let failed = |e: StorageError| match &e {
            StorageError::Io { source, .. } if source.raw_os_error().is_none() => {
                source.to_string()
            }
            _ => strerror(storage_errno(e)),
        };
        let old = r.storage.len().await.map_err(failed)?;
        if prealloc != Prealloc::Off && size < old {
            return Err("Cannot use preallocation for shrinking files".into());
        }
        match prealloc {
            Prealloc::Metadata => return Err("Unsupported preallocation mode: metadata".into()),
            Prealloc::Off => {}
            Prealloc::Falloc => {
                if size > old {
                    r.storage
                        .allocate(old, size - old)
                        .await
                        .map_err(|e| format!("Could not preallocate new data: {}", failed(e)))?;
                }
            }
            Prealloc::Full => {
                r.storage.set_len(size).await.map_err(failed)?;
                let zeros = vec![0u8; 1 << 20];
                let mut at = old;
                while at < size {
                    let n = (size - at).min(zeros.len() as u64);
                    r.storage
                        .write_at(&zeros[..n as usize], at)
                        .await
                        .map_err(|e| {
                            format!("Could not write zeros for preallocation: {}", failed(e))
                        })?;
                    at += n;
                }
            }
        }
        r.storage.set_len(size).await.map_err(failed)?;
        r.len.set(size);
        Ok(true)
    }
}

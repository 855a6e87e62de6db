//! File work of creation: opening the new file, reserving or writing its space.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::options::{Preallocation, Progress};
use crate::error::{Error, Result};

/// Writes zeros over the first 4 KiB of a new raw file, as QEMU does so that the first block
/// is allocated and O_DIRECT alignment can be probed on it later.
pub(super) fn allocate_first_block(file: &File, path: &Path, len: u64) -> Result<()> {
    let n = len.min(4096);
    if n > 0 {
        file.write_all_at(&vec![0u8; n as usize], 0)
            .map_err(|e| Error::io(path, format!("write {n} zero bytes at 0x0"), e))?;
    }
    Ok(())
}

/// A file being created, with QEMU's write lock on it until creation ends.
#[derive(Debug)]
pub(super) struct NewFile {
    file: File,
    _lock: qimg_io::HeldImageLock,
}

impl std::ops::Deref for NewFile {
    type Target = File;
    fn deref(&self) -> &File {
        &self.file
    }
}

/// Opens `path` for creation: made if missing, QEMU's lock taken (`lock`: a qcow2 image's
/// write lock, which refuses other writers; a raw image's, which refuses nobody, as QEMU's
/// raw driver), as QEMU's file driver takes it before truncating, then emptied. A file
/// another process holds against `lock` (a VM's disk, a `qemu-io` session) is refused with
/// [`qimg_io::StorageError::Locked`] and left as it was.
pub(super) fn open_new(path: &Path, lock: qimg_io::ImageLock) -> Result<NewFile> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| Error::io(path, "create", e))?;
    let lock = lock.lock(&file).map_err(|e| Error::storage(path, e))?;
    file.set_len(0)
        .map_err(|e| Error::io(path, "truncate to 0 bytes", e))?;
    Ok(NewFile { file, _lock: lock })
}

/// Reserves (`Falloc`) or zero-fills (`Full`) the given byte runs, reporting progress.
pub(super) fn fill(
    file: &File,
    path: &Path,
    runs: &[(u64, u64)],
    mode: Preallocation,
    total: u64,
    progress: Progress<'_>,
) -> Result<()> {
    const CHUNK: u64 = 8 << 20;
    let zeros = vec![0u8; CHUNK as usize];
    let mut done = 0;
    progress(0, total);
    for &(start, len) in runs {
        let mut off = start;
        while off < start + len {
            let n = CHUNK.min(start + len - off);
            match mode {
                Preallocation::Full => {
                    file.write_all_at(&zeros[..n as usize], off).map_err(|e| {
                        Error::io(path, format!("write {n} zero bytes at {off:#x}"), e)
                    })?;
                }
                _ => reserve(file, off, n)
                    .map_err(|e| Error::io(path, format!("fallocate {n} bytes at {off:#x}"), e))?,
            }
            off += n;
            done += n;
            progress(done, total);
        }
    }
    Ok(())
}

/// Reserves space without changing the contents: `posix_fallocate`-like, falling back to
/// writing zeros where the file system cannot allocate.
pub(super) fn reserve(file: &File, off: u64, len: u64) -> std::io::Result<()> {
    use nix::fcntl::{FallocateFlags, fallocate};
    let (Ok(o), Ok(l)) = (i64::try_from(off), i64::try_from(len)) else {
        return Err(std::io::Error::other("range beyond i64"));
    };
    match fallocate(file, FallocateFlags::empty(), o, l) {
        Ok(()) => Ok(()),
        Err(_) => file.write_all_at(&vec![0u8; len as usize], off),
    }
}

//! The system calls on the descriptor: positioned reads and writes, `fallocate`, `fsync`,
//! `O_DIRECT` alignment probing, and what a failed flush leaves (nothing is flushed again).

use super::*;
use std::fs::File;
use std::io::IoSlice;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::errno::Errno;
use nix::fcntl::{FallocateFlags, fallocate};
use nix::sys::uio::{pread, pwrite, pwritev};
use nix::unistd::{Whence, fdatasync, ftruncate, lseek};

use crate::aligned::AlignedBuf;
use crate::error::{Op, Result, StorageError};
use crate::storage::{AllocateOutcome, DiscardOutcome, ZeroOutcome};

#[derive(Debug)]
pub(super) struct Inner {
    pub(super) file: File,
    pub(super) read_only: bool,
    pub(super) direct: bool,
    pub(super) request_alignment: usize,
    pub(super) mem_alignment: usize,
    /// Whether FALLOC_FL_ZERO_RANGE may work (cleared when the file system says it cannot).
    pub(super) zero_range: AtomicBool,
    /// Whether FALLOC_FL_PUNCH_HOLE may work.
    pub(super) punch_hole: AtomicBool,
    /// Whether plain fallocate may work.
    pub(super) reserve: AtomicBool,
    /// A flush failed: every later flush fails too (see [`FileStorage`]).
    pub(super) flush_failed: AtomicBool,
    /// Image locks were taken on the file (see [`Storage::lock_image`]): `Some(restore)`,
    /// where `restore` says the description held a whole-file write lock of the caller's
    /// before, given back on release (see `image_lock`).
    pub(super) locked: std::sync::Mutex<Option<bool>>,
}

pub(super) fn off(pos: u64) -> i64 {
    // Every position passed here is at most MAX_OFFSET (= i64::MAX), checked by range_end.
    i64::try_from(pos).unwrap_or(i64::MAX)
}

pub(super) fn unsupported(e: Errno) -> bool {
    matches!(e, Errno::EOPNOTSUPP | Errno::ENOSYS)
}

impl Drop for Inner {
    /// Releases the image locks before the descriptor closes: the locks belong to the open
    /// file description, which a process forking in another thread shares until its `exec`,
    /// so a plain close could leave them held a moment longer than this storage.
    fn drop(&mut self) {
        let locked = self.locked.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(restore) = locked.take() {
            crate::image_lock::release(self.file.as_fd(), restore);
        }
    }
}

impl Inner {
    pub(super) fn read_at_most(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            match pread(&self.file, &mut buf[done..], off(offset + done as u64)) {
                Ok(0) => break,
                Ok(n) => {
                    done += n;
                    // With O_DIRECT only the end of the file yields a short read that is not
                    // a multiple of the block size; asking again from there would be a
                    // misaligned request.
                    if self.direct && done % self.request_alignment != 0 {
                        break;
                    }
                }
                Err(Errno::EINTR) => {}
                Err(e) => return Err(StorageError::io(Op::Read, offset, buf.len() as u64, e)),
            }
        }
        Ok(done)
    }

    pub(super) fn write_all(&self, op: Op, buf: &[u8], offset: u64) -> Result<()> {
        let mut done = 0;
        while done < buf.len() {
            match pwrite(&self.file, &buf[done..], off(offset + done as u64)) {
                Ok(0) => return Err(write_zero(op, offset, buf.len() as u64)),
                Ok(n) => done += n,
                Err(Errno::EINTR) => {}
                Err(e) => return Err(StorageError::io(op, offset, buf.len() as u64, e)),
            }
        }
        Ok(())
    }

    pub(super) fn write_vectored(&self, bufs: &[IoSlice<'_>], offset: u64, len: u64) -> Result<()> {
        let mut iov: Vec<IoSlice<'_>> = bufs.iter().copied().filter(|b| !b.is_empty()).collect();
        let mut rest: &mut [IoSlice<'_>] = &mut iov;
        let mut pos = offset;
        while !rest.is_empty() {
            let window = &rest[..rest.len().min(IOV_MAX)];
            match pwritev(&self.file, window, off(pos)) {
                Ok(0) => return Err(write_zero(Op::Write, offset, len)),
                Ok(n) => {
                    pos += n as u64;
                    // n is at most the window's length, itself at most the rest's.
                    IoSlice::advance_slices(&mut rest, n);
                }
                Err(Errno::EINTR) => {}
                Err(e) => return Err(StorageError::io(Op::Write, offset, len, e)),
            }
        }
        Ok(())
    }

    /// Runs fallocate, retrying on EINTR.
    pub(super) fn fallocate(
        &self,
        mode: FallocateFlags,
        offset: u64,
        len: u64,
    ) -> Result<(), Errno> {
        loop {
            match fallocate(&self.file, mode, off(offset), off(len)) {
                Err(Errno::EINTR) => {}
                r => return r,
            }
        }
    }

    pub(super) fn write_zeroes(&self, offset: u64, len: u64) -> Result<ZeroOutcome> {
        if len == 0 {
            return Ok(ZeroOutcome::Efficient);
        }
        if self.zero_range.load(Ordering::Relaxed) {
            match self.fallocate(FallocateFlags::FALLOC_FL_ZERO_RANGE, offset, len) {
                Ok(()) => return Ok(ZeroOutcome::Efficient),
                Err(e) if unsupported(e) => self.zero_range.store(false, Ordering::Relaxed),
                // Some file systems and block devices refuse particular ranges with EINVAL;
                // writing zeros still works there.
                Err(Errno::EINVAL) => {}
                Err(e) => return Err(StorageError::io(Op::WriteZeroes, offset, len, e)),
            }
        }
        let chunk = ZERO_CHUNK.min(usize::try_from(len).unwrap_or(ZERO_CHUNK));
        let zeros = aligned_buf(Op::WriteZeroes, offset, len, chunk, self.mem_alignment)?;
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let n = (end - pos).min(chunk as u64) as usize;
            self.write_all(Op::WriteZeroes, &zeros[..n], pos)
                .map_err(|e| retarget(e, offset, len))?;
            pos += n as u64;
        }
        Ok(ZeroOutcome::Written)
    }

    pub(super) fn discard(&self, offset: u64, len: u64) -> Result<DiscardOutcome> {
        if len == 0 {
            return Ok(DiscardOutcome::Deallocated);
        }
        if !self.punch_hole.load(Ordering::Relaxed) {
            return Ok(DiscardOutcome::Ignored);
        }
        let mode = FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE;
        match self.fallocate(mode, offset, len) {
            Ok(()) => Ok(DiscardOutcome::Deallocated),
            Err(e) if unsupported(e) => {
                self.punch_hole.store(false, Ordering::Relaxed);
                Ok(DiscardOutcome::Ignored)
            }
            Err(Errno::EINVAL) => Ok(DiscardOutcome::Ignored),
            Err(e) => Err(StorageError::io(Op::Discard, offset, len, e)),
        }
    }

    pub(super) fn allocate(&self, offset: u64, len: u64) -> Result<AllocateOutcome> {
        if len == 0 || !self.reserve.load(Ordering::Relaxed) {
            return Ok(AllocateOutcome::NotReserved);
        }
        match self.fallocate(FallocateFlags::empty(), offset, len) {
            Ok(()) => Ok(AllocateOutcome::Reserved),
            Err(e) if unsupported(e) => {
                self.reserve.store(false, Ordering::Relaxed);
                Ok(AllocateOutcome::NotReserved)
            }
            Err(e) => Err(StorageError::io(Op::Allocate, offset, len, e)),
        }
    }

    pub(super) fn flush(&self) -> Result<()> {
        self.refuse_flush_after_failure()?;
        loop {
            match fdatasync(&self.file) {
                Err(Errno::EINTR) => {}
                r => {
                    return r.map_err(|e| self.flush_failure(StorageError::io(Op::Flush, 0, 0, e)));
                }
            }
        }
    }

    /// The error of every flush after one failed.
    pub(super) fn refuse_flush_after_failure(&self) -> Result<()> {
        if self.flush_failed.load(Ordering::Acquire) {
            return Err(StorageError::io(
                Op::Flush,
                0,
                0,
                std::io::Error::other(
                    "an earlier flush of this file failed, so data written before it may be \
                     lost although later flushes would succeed; reopen the file",
                ),
            ));
        }
        Ok(())
    }

    /// Records a failed flush and passes its error on.
    pub(super) fn flush_failure(&self, e: StorageError) -> StorageError {
        self.flush_failed.store(true, Ordering::Release);
        e
    }

    pub(super) fn len(&self) -> Result<u64> {
        // lseek(SEEK_END) gives the size of block devices too (fstat says 0 for them). Moving
        // the file position is harmless: every transfer here is positioned.
        let end = lseek(&self.file, 0, Whence::SeekEnd)
            .map_err(|e| StorageError::io(Op::Len, 0, 0, e))?;
        Ok(u64::try_from(end).unwrap_or(0))
    }

    pub(super) fn set_len(&self, len: u64) -> Result<()> {
        loop {
            match ftruncate(&self.file, off(len)) {
                Err(Errno::EINTR) => {}
                r => return r.map_err(|e| StorageError::io(Op::SetLen, len, 0, e)),
            }
        }
    }
}

pub(super) fn write_zero(op: Op, offset: u64, len: u64) -> StorageError {
    StorageError::io(
        op,
        offset,
        len,
        std::io::Error::from(std::io::ErrorKind::WriteZero),
    )
}

/// Reports a failure of one piece of a request as a failure of the whole request.
pub(super) fn retarget(e: StorageError, offset: u64, len: u64) -> StorageError {
    match e {
        StorageError::Io { op, source, .. } => StorageError::Io {
            op,
            offset,
            len,
            source,
        },
        other => other,
    }
}

pub(super) fn aligned_buf(
    op: Op,
    offset: u64,
    len: u64,
    size: usize,
    align: usize,
) -> Result<AlignedBuf> {
    AlignedBuf::zeroed(size, align.max(crate::aligned::BUFFER_ALIGNMENT))
        .ok_or(StorageError::OutOfRange { op, offset, len })
}

/// Finds the O_DIRECT alignments of an open file by reading its first bytes: first the
/// smallest request size that works (with a generously aligned buffer), then the smallest
/// buffer alignment that works for that size. Gives [`FALLBACK_ALIGNMENT`] for both when the
/// file is empty, because reads at the end of a file succeed whatever their alignment.
pub(super) fn probe_alignment(file: &File) -> Result<(usize, usize)> {
    let len = lseek(file, 0, Whence::SeekEnd).map_err(|e| StorageError::io(Op::Probe, 0, 0, e))?;
    if len <= 0 {
        return Ok((FALLBACK_ALIGNMENT, FALLBACK_ALIGNMENT));
    }
    let max = FALLBACK_ALIGNMENT;
    // Aligned to 2 * max, so `buf[a..]` starts on a multiple of `a` but not of `2 * a` for
    // every probed `a`.
    let mut buf = aligned_buf(Op::Probe, 0, 0, 3 * max, 2 * max)?;
    let works = |buf: &mut [u8]| -> Result<bool> {
        loop {
            match pread(file, buf, 0) {
                Ok(_) => return Ok(true),
                Err(Errno::EINVAL) => return Ok(false),
                Err(Errno::EINTR) => {}
                Err(e) => return Err(StorageError::io(Op::Probe, 0, buf.len() as u64, e)),
            }
        }
    };
    let mut request = FALLBACK_ALIGNMENT;
    for a in PROBE_ALIGNMENTS {
        if works(&mut buf[..a])? {
            request = a;
            break;
        }
    }
    let mut mem = FALLBACK_ALIGNMENT;
    for a in PROBE_ALIGNMENTS {
        if works(&mut buf[a..a + request])? {
            mem = a;
            break;
        }
    }
    Ok((request, mem))
}

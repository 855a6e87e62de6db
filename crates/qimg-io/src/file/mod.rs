//! [`FileStorage`]: positioned I/O on a file or block device through `nix`.

mod options;
mod sys;

pub use options::{BlockingStrategy, FileOptions};
use sys::*;

use std::fs::File;
use std::io::IoSlice;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::fcntl::{FcntlArg, OFlag, fcntl};

use crate::aligned::AlignedBuf;
use crate::error::{Op, Result, StorageError, range_end};
use crate::image_lock::ImageLock;
use crate::storage::{
    AllocateOutcome, DiscardOutcome, Storage, ZeroOutcome, check_aligned, total_len,
};

/// Most segments one `pwritev` call accepts on Linux (`UIO_MAXIOV`).
const IOV_MAX: usize = 1024;

/// Size of the zero buffer used when zeroing falls back to writing.
const ZERO_CHUNK: usize = 1 << 20;

/// Alignments tried, smallest first, when probing an O_DIRECT file.
const PROBE_ALIGNMENTS: [usize; 4] = [512, 1024, 2048, 4096];

/// Alignment assumed when probing is impossible (empty file) or finds nothing that works.
const FALLBACK_ALIGNMENT: usize = 4096;

/// A file or block device accessed with positioned system calls (`pread`, `pwrite`,
/// `pwritev`, `fallocate`, `fdatasync`, `ftruncate`) through `nix`; no `unsafe` here.
///
/// Short transfers and `EINTR` are retried until the request is complete. Which thread makes
/// the calls is chosen by [`BlockingStrategy`]. Capabilities the file system lacks are learnt
/// on first use and not tried again: `write_zeroes` then writes zeros, `discard` does nothing
/// and `allocate` reserves nothing, each saying so in its outcome.
///
/// With O_DIRECT, data requests must be aligned (offsets and lengths to
/// [`request_alignment`](Storage::request_alignment), buffers to
/// [`mem_alignment`](Storage::mem_alignment)) and fail with
/// [`StorageError::Misaligned`] otherwise; both are probed at open by reading the start of
/// the file at alignments from 512 to 4096 bytes, and are 4096 when the file is empty.
///
/// A failed `fdatasync` poisons the storage, as QEMU's file driver does: Linux may drop the
/// dirty pages it could not write and mark them clean, so a retry could succeed although the
/// data never reached the disk. Every later [`flush`](Storage::flush) of this storage (and of
/// its clones) therefore fails too; reopen the file to start over.
///
/// Clones share the file descriptor.
#[derive(Debug, Clone)]
pub struct FileStorage {
    inner: Arc<Inner>,
    blocking: BlockingStrategy,
}

impl FileStorage {
    /// Fails once a flush of this file has failed (see [`FileStorage`]).
    pub(crate) fn refuse_flush_after_failure(&self) -> Result<()> {
        self.inner.refuse_flush_after_failure()
    }

    /// Records a failed flush of this file (by any path) and passes its error on.
    pub(crate) fn flush_failure(&self, e: StorageError) -> StorageError {
        self.inner.flush_failure(e)
    }

    /// Opens an existing file read-only, buffered. See [`FileOptions`] for the rest.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        FileOptions::new().open(path)
    }

    /// Options for opening a file.
    pub fn options() -> FileOptions {
        FileOptions::new()
    }

    /// Wraps an open file. Whether it is read-only and whether it uses O_DIRECT are read from
    /// its status flags; O_DIRECT alignment is probed as for [`FileOptions::open`].
    pub fn from_file(file: File, blocking: BlockingStrategy) -> Result<Self> {
        let flags =
            fcntl(&file, FcntlArg::F_GETFL).map_err(|e| StorageError::io(Op::Probe, 0, 0, e))?;
        let flags = OFlag::from_bits_truncate(flags);
        let read_only = (flags & OFlag::O_ACCMODE) == OFlag::O_RDONLY;
        let direct = flags.contains(OFlag::O_DIRECT);
        let (request_alignment, mem_alignment) = if direct {
            probe_alignment(&file)?
        } else {
            (1, 1)
        };
        Ok(FileStorage {
            inner: Arc::new(Inner {
                file,
                read_only,
                direct,
                request_alignment,
                mem_alignment,
                zero_range: AtomicBool::new(true),
                punch_hole: AtomicBool::new(true),
                flush_failed: AtomicBool::new(false),
                reserve: AtomicBool::new(true),
                locked: std::sync::Mutex::new(None),
            }),
            blocking,
        })
    }

    /// Whether modifications are refused (the file was opened read-only).
    pub fn is_read_only(&self) -> bool {
        self.inner.read_only
    }

    /// Stops using `fallocate`, as [`FileOptions::fallocate`] with `false` does (shared by
    /// clones).
    pub(crate) fn disable_fallocate(&self) {
        for flag in [
            &self.inner.zero_range,
            &self.inner.punch_hole,
            &self.inner.reserve,
        ] {
            flag.store(false, Ordering::Relaxed);
        }
    }

    /// Whether the file was opened with O_DIRECT.
    pub fn is_direct(&self) -> bool {
        self.inner.direct
    }

    /// Where system calls run.
    pub fn blocking_strategy(&self) -> BlockingStrategy {
        self.blocking
    }

    /// The open file.
    pub fn file(&self) -> &File {
        &self.inner.file
    }

    fn writable(&self, op: Op, offset: u64, len: u64) -> Result<()> {
        if self.inner.read_only {
            return Err(StorageError::ReadOnly { op, offset, len });
        }
        Ok(())
    }

    fn aligned<'b>(
        &self,
        op: Op,
        offset: u64,
        len: u64,
        bufs: impl IntoIterator<Item = &'b [u8]>,
    ) -> Result<()> {
        if !self.inner.direct {
            return Ok(());
        }
        check_aligned(
            op,
            offset,
            len,
            bufs.into_iter().map(|b| (b.as_ptr() as usize, b.len())),
            self.inner.request_alignment,
            self.inner.mem_alignment,
        )
    }

    /// The runtime to offload to, if offloading is chosen and a tokio runtime is running.
    fn offload(&self) -> Option<tokio::runtime::Handle> {
        match self.blocking {
            BlockingStrategy::Inline => None,
            BlockingStrategy::SpawnBlocking => tokio::runtime::Handle::try_current().ok(),
        }
    }

    /// Runs `f` inline or on the blocking pool, per the strategy.
    async fn run<T: Send + 'static>(
        &self,
        op: Op,
        offset: u64,
        len: u64,
        f: impl FnOnce(&Inner) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        match self.offload() {
            None => f(&self.inner),
            Some(rt) => {
                let inner = Arc::clone(&self.inner);
                rt.spawn_blocking(move || f(&inner))
                    .await
                    .map_err(|e| StorageError::io(op, offset, len, std::io::Error::other(e)))?
            }
        }
    }
}

impl AsFd for FileStorage {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.file.as_fd()
    }
}

impl Storage for FileStorage {
    async fn read_at_most(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let len = buf.len() as u64;
        range_end(Op::Read, offset, len)?;
        self.aligned(Op::Read, offset, len, [&*buf])?;
        if buf.is_empty() {
            return Ok(0);
        }
        if self.offload().is_none() {
            return self.inner.read_at_most(buf, offset);
        }
        let mut owned = aligned_buf(Op::Read, offset, len, buf.len(), self.inner.mem_alignment)?;
        let (owned, n) = self
            .run(Op::Read, offset, len, move |inner| {
                let n = inner.read_at_most(&mut owned, offset)?;
                Ok((owned, n))
            })
            .await?;
        buf[..n].copy_from_slice(&owned[..n]);
        Ok(n)
    }

    async fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        range_end(Op::Write, offset, len)?;
        self.writable(Op::Write, offset, len)?;
        self.aligned(Op::Write, offset, len, [buf])?;
        if buf.is_empty() {
            return Ok(());
        }
        if self.offload().is_none() {
            return self.inner.write_all(Op::Write, buf, offset);
        }
        let owned = AlignedBuf::copy_from(
            buf,
            self.inner
                .mem_alignment
                .max(crate::aligned::BUFFER_ALIGNMENT),
        )
        .ok_or(StorageError::OutOfRange {
            op: Op::Write,
            offset,
            len,
        })?;
        self.run(Op::Write, offset, len, move |inner| {
            inner.write_all(Op::Write, &owned, offset)
        })
        .await
    }

    async fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> Result<()> {
        let len = total_len(Op::Write, bufs, offset)?;
        range_end(Op::Write, offset, len)?;
        self.writable(Op::Write, offset, len)?;
        self.aligned(Op::Write, offset, len, bufs.iter().map(|b| &**b))?;
        if len == 0 {
            return Ok(());
        }
        if self.offload().is_none() {
            return self.inner.write_vectored(bufs, offset, len);
        }
        let size = usize::try_from(len).map_err(|_| StorageError::OutOfRange {
            op: Op::Write,
            offset,
            len,
        })?;
        let mut owned = aligned_buf(Op::Write, offset, len, size, self.inner.mem_alignment)?;
        let mut at = 0;
        for b in bufs {
            owned[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        }
        self.run(Op::Write, offset, len, move |inner| {
            inner.write_all(Op::Write, &owned, offset)
        })
        .await
    }

    async fn write_zeroes(&self, offset: u64, len: u64) -> Result<ZeroOutcome> {
        range_end(Op::WriteZeroes, offset, len)?;
        self.writable(Op::WriteZeroes, offset, len)?;
        self.aligned(Op::WriteZeroes, offset, len, [])?;
        self.run(Op::WriteZeroes, offset, len, move |inner| {
            inner.write_zeroes(offset, len)
        })
        .await
    }

    async fn discard(&self, offset: u64, len: u64) -> Result<DiscardOutcome> {
        range_end(Op::Discard, offset, len)?;
        self.writable(Op::Discard, offset, len)?;
        self.run(Op::Discard, offset, len, move |inner| {
            inner.discard(offset, len)
        })
        .await
    }

    async fn allocate(&self, offset: u64, len: u64) -> Result<AllocateOutcome> {
        range_end(Op::Allocate, offset, len)?;
        self.writable(Op::Allocate, offset, len)?;
        self.run(Op::Allocate, offset, len, move |inner| {
            inner.allocate(offset, len)
        })
        .await
    }

    async fn flush(&self) -> Result<()> {
        self.run(Op::Flush, 0, 0, |inner| inner.flush()).await
    }

    async fn len(&self) -> Result<u64> {
        self.run(Op::Len, 0, 0, |inner| inner.len()).await
    }

    async fn set_len(&self, len: u64) -> Result<()> {
        range_end(Op::SetLen, len, 0)?;
        self.writable(Op::SetLen, len, 0)?;
        self.run(Op::SetLen, len, 0, move |inner| inner.set_len(len))
            .await
    }

    fn lock_image(&self, lock: ImageLock) -> Result<()> {
        let mut locked = self.inner.locked.lock().unwrap_or_else(|e| e.into_inner());
        let before = locked.unwrap_or(false);
        match crate::image_lock::apply(self.file().as_fd(), lock, before) {
            Ok(restore) => {
                *locked = Some(restore);
                Ok(())
            }
            Err(failure) => {
                // A failed attempt holds nothing of ours and gave the bytes back as they
                // were (see `apply`).
                *locked = None;
                Err(failure.into_storage())
            }
        }
    }

    fn unlock_image(&self) {
        let mut locked = self.inner.locked.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(restore) = locked.take() {
            crate::image_lock::release(self.file().as_fd(), restore);
        }
    }

    fn request_alignment(&self) -> usize {
        self.inner.request_alignment
    }

    fn mem_alignment(&self) -> usize {
        self.inner.mem_alignment
    }

    fn direct_access(&self) -> Option<crate::storage::DirectAccess<'_>> {
        Some(crate::storage::DirectAccess {
            fd: self.as_fd(),
            request_alignment: self.inner.request_alignment,
            mem_alignment: self.inner.mem_alignment,
        })
    }
}

#[cfg(test)]
mod alignment_tests {
    use super::*;

    #[test]
    fn io_buffers_start_on_a_page_even_when_the_device_takes_less() {
        for align in [1, 512, 4096] {
            let b = aligned_buf(Op::Read, 0, 0, 4096, align).unwrap();
            assert_eq!(b.as_ptr() as usize % crate::aligned::BUFFER_ALIGNMENT, 0);
        }
    }
}

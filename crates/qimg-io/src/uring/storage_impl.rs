//! The [`Storage`] implementation of [`UringStorage`]: checks, then the ring or the
//! [`FileStorage`](crate::FileStorage) fallback per operation.

use std::io::IoSlice;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::Ordering;

use nix::errno::Errno;
use nix::fcntl::FallocateFlags;
use nix::libc;

use crate::error::{Op, Result, StorageError, range_end};
use crate::storage::{AllocateOutcome, DiscardOutcome, Storage, ZeroOutcome, total_len};

use super::storage::UringStorage;
use super::submission::{RequestKind, RequestMemory};
use super::transfer::{errno, retryable, unsupported};

impl AsFd for UringStorage {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file().as_fd()
    }
}

impl Storage for UringStorage {
    async fn read_at_most(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let len = buf.len() as u64;
        range_end(Op::Read, offset, len)?;
        self.aligned(Op::Read, offset, len, [&*buf])?;
        if buf.is_empty() {
            return Ok(0);
        }
        match self.shared().caps.read {
            Some(opcode) => self.ring_read(opcode, buf, offset).await,
            None => self.shared().file.read_at_most(buf, offset).await,
        }
    }

    async fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        let len = self.check_write(buf, offset)?;
        if len == 0 {
            return Ok(());
        }
        if !self.shared().caps.write {
            return self.shared().file.write_at(buf, offset).await;
        }
        self.ring_write(Op::Write, Some(&[IoSlice::new(buf)]), offset, len, false)
            .await
    }

    async fn write_at_durable(&self, buf: &[u8], offset: u64) -> Result<()> {
        let len = self.check_write(buf, offset)?;
        if len == 0 {
            return Ok(());
        }
        if self.shared().caps.write && self.shared().caps.fsync {
            // A failed flush poisons the file: so does a failed durable write.
            self.shared().file.refuse_flush_after_failure()?;
            let one = [IoSlice::new(buf)];
            match self
                .ring_write(Op::Write, Some(&one), offset, len, true)
                .await
            {
                Ok(()) => return Ok(()),
                // A kernel without RWF_DSYNC for io_uring: write, then flush.
                Err(StorageError::Io { source, .. })
                    if matches!(source.raw_os_error(), Some(libc::EINVAL | libc::EOPNOTSUPP)) => {}
                Err(e) => return Err(self.shared().file.flush_failure(e)),
            }
        }
        self.write_at(buf, offset).await?;
        self.flush().await
    }

    async fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> Result<()> {
        let len = total_len(Op::Write, bufs, offset)?;
        range_end(Op::Write, offset, len)?;
        self.writable(Op::Write, offset, len)?;
        self.aligned(Op::Write, offset, len, bufs.iter().map(|b| &**b))?;
        if len == 0 {
            return Ok(());
        }
        if !self.shared().caps.write {
            return self.shared().file.write_vectored_at(bufs, offset).await;
        }
        self.ring_write(Op::Write, Some(bufs), offset, len, false)
            .await
    }

    async fn write_zeroes(&self, offset: u64, len: u64) -> Result<ZeroOutcome> {
        range_end(Op::WriteZeroes, offset, len)?;
        self.writable(Op::WriteZeroes, offset, len)?;
        self.aligned(Op::WriteZeroes, offset, len, [])?;
        if len == 0 {
            return Ok(ZeroOutcome::Efficient);
        }
        let shared = self.shared();
        if !shared.caps.zero {
            return shared.file.write_zeroes(offset, len).await;
        }
        if shared.zero_range.load(Ordering::Relaxed) {
            match self
                .ring_fallocate(FallocateFlags::FALLOC_FL_ZERO_RANGE, offset, len)
                .await
            {
                Ok(()) => return Ok(ZeroOutcome::Efficient),
                Err(e) if unsupported(e) => shared.zero_range.store(false, Ordering::Relaxed),
                // Some file systems and devices refuse particular ranges; writing works.
                Err(Errno::EINVAL) => {}
                Err(e) => return Err(StorageError::io(Op::WriteZeroes, offset, len, e)),
            }
        }
        if shared.caps.write {
            self.ring_write(Op::WriteZeroes, None, offset, len, false)
                .await?;
            Ok(ZeroOutcome::Written)
        } else {
            shared.file.write_zeroes(offset, len).await
        }
    }

    async fn discard(&self, offset: u64, len: u64) -> Result<DiscardOutcome> {
        range_end(Op::Discard, offset, len)?;
        self.writable(Op::Discard, offset, len)?;
        let shared = self.shared();
        if !shared.caps.discard {
            return shared.file.discard(offset, len).await;
        }
        if len == 0 {
            return Ok(DiscardOutcome::Deallocated);
        }
        if !shared.punch_hole.load(Ordering::Relaxed) {
            return Ok(DiscardOutcome::Ignored);
        }
        let mode = FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE;
        match self.ring_fallocate(mode, offset, len).await {
            Ok(()) => Ok(DiscardOutcome::Deallocated),
            Err(e) if unsupported(e) => {
                shared.punch_hole.store(false, Ordering::Relaxed);
                Ok(DiscardOutcome::Ignored)
            }
            Err(Errno::EINVAL) => Ok(DiscardOutcome::Ignored),
            Err(e) => Err(StorageError::io(Op::Discard, offset, len, e)),
        }
    }

    async fn allocate(&self, offset: u64, len: u64) -> Result<AllocateOutcome> {
        range_end(Op::Allocate, offset, len)?;
        self.writable(Op::Allocate, offset, len)?;
        let shared = self.shared();
        if !shared.caps.allocate {
            return shared.file.allocate(offset, len).await;
        }
        if len == 0 || !shared.reserve.load(Ordering::Relaxed) {
            return Ok(AllocateOutcome::NotReserved);
        }
        match self
            .ring_fallocate(FallocateFlags::empty(), offset, len)
            .await
        {
            Ok(()) => Ok(AllocateOutcome::Reserved),
            Err(e) if unsupported(e) => {
                shared.reserve.store(false, Ordering::Relaxed);
                Ok(AllocateOutcome::NotReserved)
            }
            Err(e) => Err(StorageError::io(Op::Allocate, offset, len, e)),
        }
    }

    async fn flush(&self) -> Result<()> {
        let file = &self.shared().file;
        if !self.shared().caps.fsync {
            return file.flush().await;
        }
        // A failed fsync poisons the file for later flushes, as with `FileStorage` (shared).
        file.refuse_flush_after_failure()?;
        loop {
            let completion = self
                .submit(RequestKind::Fsync, RequestMemory::empty().buf)
                .await;
            match completion.result {
                r if r >= 0 => return Ok(()),
                r if retryable(r) => {}
                r => {
                    let e = StorageError::io(Op::Flush, 0, 0, errno(r));
                    return Err(file.flush_failure(e));
                }
            }
        }
    }

    async fn len(&self) -> Result<u64> {
        self.shared().file.len().await
    }

    async fn set_len(&self, len: u64) -> Result<()> {
        self.shared().file.set_len(len).await
    }

    fn unlock_image(&self) {
        self.shared().file.unlock_image()
    }

    fn lock_image(&self, lock: crate::ImageLock) -> Result<()> {
        self.shared().file.lock_image(lock)
    }

    fn request_alignment(&self) -> usize {
        self.shared().file.request_alignment()
    }

    fn mem_alignment(&self) -> usize {
        self.shared().file.mem_alignment()
    }

    fn direct_access(&self) -> Option<crate::storage::DirectAccess<'_>> {
        self.shared().file.direct_access()
    }
}

impl UringStorage {
    /// The checks of a one-buffer write (range, writability, alignment): its length.
    fn check_write(&self, buf: &[u8], offset: u64) -> Result<u64> {
        let len = buf.len() as u64;
        range_end(Op::Write, offset, len)?;
        self.writable(Op::Write, offset, len)?;
        self.aligned(Op::Write, offset, len, [buf])?;
        Ok(len)
    }
}

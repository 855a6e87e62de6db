//! [`FileStorage`]: positioned I/O on a file or block device through `nix`.

use std::fs::File;
use std::io::IoSlice;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::errno::Errno;
use nix::fcntl::{FallocateFlags, FcntlArg, OFlag, fallocate, fcntl};
use nix::sys::uio::{pread, pwrite, pwritev};
use nix::unistd::{Whence, fdatasync, ftruncate, lseek};

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

/// Where [`FileStorage`] runs its blocking system calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum BlockingStrategy {
    /// In the future's `poll`, on the thread that polls it (the default). Cheapest: no copy,
    /// no thread hop, and page-cache hits return in microseconds. A request that waits on a
    /// disk blocks that executor thread meanwhile, so use a multi-threaded runtime and keep
    /// latency-sensitive tasks off the threads doing storage I/O.
    #[default]
    Inline,
    /// On tokio's blocking thread pool (`spawn_blocking`, a bounded pool that reuses threads),
    /// with buffers copied to and from an owned buffer. Keeps executor threads free at the cost
    /// of a copy and a thread hop per request. Outside a tokio runtime it behaves like
    /// [`Inline`](BlockingStrategy::Inline). Dropping the future does not cancel a request
    /// already handed to the pool: it runs to completion in the background.
    SpawnBlocking,
}

/// How to open a [`FileStorage`]: read-only or read-write, creating or not, with O_DIRECT or
/// through the page cache, and where system calls run. Starts read-only, buffered, existing
/// file, [`BlockingStrategy::Inline`].
#[derive(Debug, Clone, Default)]
pub struct FileOptions {
    write: bool,
    create: bool,
    create_new: bool,
    truncate: bool,
    direct: bool,
    no_fallocate: bool,
    blocking: BlockingStrategy,
}

impl FileOptions {
    /// Read-only, buffered, the file must exist, inline system calls.
    pub fn new() -> Self {
        Self::default()
    }

    /// Open for reading and writing (`true`) or reading only (`false`).
    pub fn read_write(mut self, yes: bool) -> Self {
        self.write = yes;
        self
    }

    /// Create the file if it does not exist (needs [`read_write`](FileOptions::read_write)).
    pub fn create(mut self, yes: bool) -> Self {
        self.create = yes;
        self
    }

    /// Create the file, failing if it exists (needs [`read_write`](FileOptions::read_write)).
    pub fn create_new(mut self, yes: bool) -> Self {
        self.create_new = yes;
        self
    }

    /// Truncate the file to length 0 on open (needs [`read_write`](FileOptions::read_write)).
    pub fn truncate(mut self, yes: bool) -> Self {
        self.truncate = yes;
        self
    }

    /// Bypass the page cache with `O_DIRECT`. Data requests must then be aligned; the
    /// alignment is probed at open (see [`FileStorage::request_alignment`]).
    pub fn direct(mut self, yes: bool) -> Self {
        self.direct = yes;
        self
    }

    /// Where system calls run.
    pub fn blocking(mut self, strategy: BlockingStrategy) -> Self {
        self.blocking = strategy;
        self
    }

    /// Whether to use `fallocate` where the file system supports it (the default). With
    /// `false`, `write_zeroes` always writes zeros, `discard` does nothing and `allocate`
    /// reserves nothing, as on a file system without `fallocate`.
    pub fn fallocate(mut self, yes: bool) -> Self {
        self.no_fallocate = !yes;
        self
    }

    /// Opens `path` with these options.
    pub fn open(&self, path: impl AsRef<Path>) -> Result<FileStorage> {
        let path = path.as_ref();
        let mut o = std::fs::OpenOptions::new();
        o.read(true)
            .write(self.write)
            .create(self.create)
            .create_new(self.create_new)
            .truncate(self.truncate);
        if self.direct {
            o.custom_flags(OFlag::O_DIRECT.bits());
        }
        let file = o.open(path).map_err(|source| StorageError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let s = FileStorage::from_file(file, self.blocking)?;
        if self.no_fallocate {
            s.disable_fallocate();
        }
        Ok(s)
    }
}

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

#[derive(Debug)]
struct Inner {
    file: File,
    read_only: bool,
    direct: bool,
    request_alignment: usize,
    mem_alignment: usize,
    /// Whether FALLOC_FL_ZERO_RANGE may work (cleared when the file system says it cannot).
    zero_range: AtomicBool,
    /// Whether FALLOC_FL_PUNCH_HOLE may work.
    punch_hole: AtomicBool,
    /// Whether plain fallocate may work.
    reserve: AtomicBool,
    /// A flush failed: every later flush fails too (see [`FileStorage`]).
    flush_failed: AtomicBool,
    /// Image locks were taken on the file (see [`Storage::lock_image`]): `Some(restore)`,
    /// where `restore` says the description held a whole-file write lock of the caller's
    /// before, given back on release (see `image_lock`).
    locked: std::sync::Mutex<Option<bool>>,
}

fn off(pos: u64) -> i64 {
    // Every position passed here is at most MAX_OFFSET (= i64::MAX), checked by range_end.
    i64::try_from(pos).unwrap_or(i64::MAX)
}

fn unsupported(e: Errno) -> bool {
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
    fn read_at_most(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
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

    fn write_all(&self, op: Op, buf: &[u8], offset: u64) -> Result<()> {
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

    fn write_vectored(&self, bufs: &[IoSlice<'_>], offset: u64, len: u64) -> Result<()> {
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
    fn fallocate(&self, mode: FallocateFlags, offset: u64, len: u64) -> Result<(), Errno> {
        loop {
            match fallocate(&self.file, mode, off(offset), off(len)) {
                Err(Errno::EINTR) => {}
                r => return r,
            }
        }
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<ZeroOutcome> {
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

    fn discard(&self, offset: u64, len: u64) -> Result<DiscardOutcome> {
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

    fn allocate(&self, offset: u64, len: u64) -> Result<AllocateOutcome> {
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

    fn flush(&self) -> Result<()> {
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
    fn refuse_flush_after_failure(&self) -> Result<()> {
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
    fn flush_failure(&self, e: StorageError) -> StorageError {
        self.flush_failed.store(true, Ordering::Release);
        e
    }

    fn len(&self) -> Result<u64> {
        // lseek(SEEK_END) gives the size of block devices too (fstat says 0 for them). Moving
        // the file position is harmless: every transfer here is positioned.
        let end = lseek(&self.file, 0, Whence::SeekEnd)
            .map_err(|e| StorageError::io(Op::Len, 0, 0, e))?;
        Ok(u64::try_from(end).unwrap_or(0))
    }

    fn set_len(&self, len: u64) -> Result<()> {
        loop {
            match ftruncate(&self.file, off(len)) {
                Err(Errno::EINTR) => {}
                r => return r.map_err(|e| StorageError::io(Op::SetLen, len, 0, e)),
            }
        }
    }
}

fn write_zero(op: Op, offset: u64, len: u64) -> StorageError {
    StorageError::io(
        op,
        offset,
        len,
        std::io::Error::from(std::io::ErrorKind::WriteZero),
    )
}

/// Reports a failure of one piece of a request as a failure of the whole request.
fn retarget(e: StorageError, offset: u64, len: u64) -> StorageError {
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

fn aligned_buf(op: Op, offset: u64, len: u64, size: usize, align: usize) -> Result<AlignedBuf> {
    AlignedBuf::zeroed(size, align.max(crate::aligned::BUFFER_ALIGNMENT))
        .ok_or(StorageError::OutOfRange { op, offset, len })
}

/// Finds the O_DIRECT alignments of an open file by reading its first bytes: first the
/// smallest request size that works (with a generously aligned buffer), then the smallest
/// buffer alignment that works for that size. Gives [`FALLBACK_ALIGNMENT`] for both when the
/// file is empty, because reads at the end of a file succeed whatever their alignment.
fn probe_alignment(file: &File) -> Result<(usize, usize)> {
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

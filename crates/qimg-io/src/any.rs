//! [`AnyStorage`]: one storage type for every file backend, chosen at run time.
//!
//! The engine is generic over [`Storage`]; a program that picks its backend from a command
//! line or a configuration file (threads or io_uring, buffered or `O_DIRECT`) uses this enum
//! so that one `Image<AnyStorage>` type covers every choice.

use std::io::IoSlice;
use std::path::Path;

use crate::blkdebug::BlkdebugStorage;
use crate::bounce::BounceStorage;
use crate::error::Result;
use crate::file::{FileOptions, FileStorage};
use crate::nbd::NbdStorage;
use crate::null::NullStorage;
use crate::storage::{AllocateOutcome, DiscardOutcome, Storage, ZeroOutcome};
#[cfg(target_os = "linux")]
use crate::uring::{UringOptions, UringStorage};

/// Which backend [`AnyStorage::open`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// Positioned system calls ([`FileStorage`] with [`BlockingStrategy::Inline`]: on the
    /// thread that polls the request, no thread pool), qemu-img's `aio=threads`. Use a
    /// multi-threaded runtime so that a request waiting on the disk does not hold up others.
    ///
    /// [`BlockingStrategy::Inline`]: crate::BlockingStrategy::Inline
    #[default]
    Threads,
    /// io_uring ([`UringStorage`]), qemu-img's `aio=io_uring`. Opcodes the kernel lacks fall
    /// back to the thread pool.
    IoUring,
}

/// A file storage of any backend, with or without `O_DIRECT`. With `O_DIRECT` requests of
/// any alignment are accepted (a [`BounceStorage`] does the read-modify-write).
#[derive(Debug)]
pub enum AnyStorage {
    /// [`FileStorage`], buffered.
    File(FileStorage),
    /// [`FileStorage`] with `O_DIRECT`, any alignment.
    FileDirect(BounceStorage<FileStorage>),
    /// [`UringStorage`], buffered.
    #[cfg(target_os = "linux")]
    Uring(UringStorage),
    /// [`UringStorage`] with `O_DIRECT`, any alignment.
    #[cfg(target_os = "linux")]
    UringDirect(BounceStorage<UringStorage>),
    /// An export of an NBD server ([`NbdStorage`]), for an NBD name: the process's one
    /// connection to it ([`NbdStorage::shared`]).
    Nbd(std::sync::Arc<NbdStorage>),
    /// QEMU's `null-co` device ([`NullStorage`]), for a null name (`null-co://`).
    Null(NullStorage),
    /// A buffered file with error injection ([`BlkdebugStorage`]): a path given rules with
    /// [`blkdebug::attach`](crate::blkdebug::attach).
    Blkdebug(Box<BlkdebugStorage<FileStorage>>),
    /// The same with `O_DIRECT`, any alignment.
    BlkdebugDirect(Box<BlkdebugStorage<BounceStorage<FileStorage>>>),
    /// A part of a buffered file ([`WindowStorage`](crate::WindowStorage)): a path given a
    /// window with [`window::attach`](crate::window::attach), on the thread backend.
    Window(Box<crate::WindowStorage<FileStorage>>),
    /// The same with `O_DIRECT`, any alignment.
    WindowDirect(Box<crate::WindowStorage<BounceStorage<FileStorage>>>),
}

impl AnyStorage {
    /// Opens `path` (read-only unless `writable`) with `backend`, with `O_DIRECT` if `direct`.
    pub fn open(
        path: impl AsRef<Path>,
        writable: bool,
        backend: Backend,
        direct: bool,
    ) -> Result<Self> {
        if let Some(window) = crate::window::attached(path.as_ref()) {
            // Over the file itself, on the thread backend (as error injection).
            let s = FileOptions::new()
                .read_write(writable)
                .direct(direct)
                .open(path)?;
            return Ok(if direct {
                Self::WindowDirect(Box::new(crate::WindowStorage::new(
                    BounceStorage::new(s),
                    window,
                )))
            } else {
                Self::Window(Box::new(crate::WindowStorage::new(s, window)))
            });
        }
        // An NBD name (`nbd://`, `nbd+unix://`, `nbd:`) is an export, not a file.
        if let Some(name) = path.as_ref().to_str() {
            if crate::nbd::is_nbd_name(name) {
                return Ok(Self::Nbd(NbdStorage::shared(name, writable)?));
            }
            if let Some(opts) = crate::null::parse_name(name) {
                return Ok(Self::Null(NullStorage::new(opts)));
            }
        }
        if let Some((config, breaks)) = crate::blkdebug::attached(path.as_ref()) {
            // Error injection over the file, always on the thread backend (QEMU's blkdebug
            // sits over its file node whatever its aio mode).
            let s = FileOptions::new()
                .read_write(writable)
                .direct(direct)
                .open(path)?;
            return Ok(if direct {
                Self::BlkdebugDirect(Box::new(
                    BlkdebugStorage::new(BounceStorage::new(s), config).with_breakpoints(breaks),
                ))
            } else {
                Self::Blkdebug(Box::new(
                    BlkdebugStorage::new(s, config).with_breakpoints(breaks),
                ))
            });
        }
        match backend {
            Backend::Threads => {
                let s = FileOptions::new()
                    .read_write(writable)
                    .direct(direct)
                    .open(path)?;
                Ok(if direct {
                    Self::FileDirect(BounceStorage::new(s))
                } else {
                    Self::File(s)
                })
            }
            #[cfg(target_os = "linux")]
            Backend::IoUring => {
                let s = UringOptions::new()
                    .read_write(writable)
                    .direct(direct)
                    .open(path)?;
                Ok(if direct {
                    Self::UringDirect(BounceStorage::new(s))
                } else {
                    Self::Uring(s)
                })
            }
            #[cfg(not(target_os = "linux"))]
            Backend::IoUring => Self::open(path, writable, Backend::Threads, direct),
        }
    }

    /// Wraps a file the caller opened (a VMM that opened and probed the image itself) with
    /// `backend`. Whether it is writable and whether it uses `O_DIRECT` come from its status
    /// flags: open it with `O_DIRECT` for direct I/O (any request alignment is then accepted,
    /// as [`open`](Self::open) gives it).
    pub fn from_file(file: std::fs::File, backend: Backend) -> Result<Self> {
        match backend {
            Backend::Threads => {
                let s = FileStorage::from_file(file, crate::file::BlockingStrategy::default())?;
                Ok(if s.is_direct() {
                    Self::FileDirect(BounceStorage::new(s))
                } else {
                    Self::File(s)
                })
            }
            #[cfg(target_os = "linux")]
            Backend::IoUring => {
                let s = UringOptions::new().from_file(file)?;
                Ok(if s.is_direct() {
                    Self::UringDirect(BounceStorage::new(s))
                } else {
                    Self::Uring(s)
                })
            }
            #[cfg(not(target_os = "linux"))]
            Backend::IoUring => Self::from_file(file, Backend::Threads),
        }
    }
}

macro_rules! each {
    ($self:ident, $s:ident => $e:expr) => {
        match $self {
            AnyStorage::File($s) => $e,
            AnyStorage::FileDirect($s) => $e,
            #[cfg(target_os = "linux")]
            AnyStorage::Uring($s) => $e,
            #[cfg(target_os = "linux")]
            AnyStorage::UringDirect($s) => $e,
            AnyStorage::Nbd($s) => $e,
            AnyStorage::Null($s) => $e,
            AnyStorage::Blkdebug($s) => $e,
            AnyStorage::BlkdebugDirect($s) => $e,
            AnyStorage::Window($s) => $e,
            AnyStorage::WindowDirect($s) => $e,
        }
    };
}

impl Storage for AnyStorage {
    async fn read_at_most(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        each!(self, s => s.read_at_most(buf, offset).await)
    }

    async fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        each!(self, s => s.read_at(buf, offset).await)
    }

    async fn read_at_zero_fill(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        each!(self, s => s.read_at_zero_fill(buf, offset).await)
    }

    async fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        each!(self, s => s.write_at(buf, offset).await)
    }

    async fn write_at_durable(&self, buf: &[u8], offset: u64) -> Result<()> {
        each!(self, s => s.write_at_durable(buf, offset).await)
    }

    async fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> Result<()> {
        each!(self, s => s.write_vectored_at(bufs, offset).await)
    }

    async fn write_zeroes(&self, offset: u64, len: u64) -> Result<ZeroOutcome> {
        each!(self, s => s.write_zeroes(offset, len).await)
    }

    async fn discard(&self, offset: u64, len: u64) -> Result<DiscardOutcome> {
        each!(self, s => s.discard(offset, len).await)
    }

    async fn allocate(&self, offset: u64, len: u64) -> Result<AllocateOutcome> {
        each!(self, s => s.allocate(offset, len).await)
    }

    async fn flush(&self) -> Result<()> {
        each!(self, s => s.flush().await)
    }

    async fn len(&self) -> Result<u64> {
        each!(self, s => s.len().await)
    }

    async fn set_len(&self, len: u64) -> Result<()> {
        each!(self, s => s.set_len(len).await)
    }

    fn request_alignment(&self) -> usize {
        each!(self, s => s.request_alignment())
    }

    fn mem_alignment(&self) -> usize {
        each!(self, s => s.mem_alignment())
    }

    fn lock_image(&self, lock: crate::ImageLock) -> Result<()> {
        each!(self, s => s.lock_image(lock))
    }

    fn unlock_image(&self) {
        each!(self, s => s.unlock_image())
    }

    fn direct_access(&self) -> Option<crate::DirectAccess<'_>> {
        each!(self, s => s.direct_access())
    }

    fn debug_event(&self, event: crate::DebugEvent) {
        each!(self, s => s.debug_event(event))
    }
}

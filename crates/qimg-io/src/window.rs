//! [`WindowStorage`]: a part of another storage seen as a whole one, QEMU's raw format with
//! its `offset` and `size` options (a partition of a disk image, an image inside a larger
//! file).
//!
//! Byte 0 of the window is byte `offset` of the storage under it. With a size the window
//! is that long, fixed (it cannot be resized, as QEMU's "fixed-size raw disks"); without
//! one it reaches to the end of the storage under it, and resizing it resizes that. A
//! request that reaches past the window's end fails (`EIO`) and touches nothing outside it.

use std::io::IoSlice;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::{Op, Result, StorageError};
use crate::storage::{AllocateOutcome, DiscardOutcome, Storage, ZeroOutcome};
use crate::{DebugEvent, ImageLock};

/// Where a window lies in the storage under it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WindowOptions {
    /// Its first byte in the storage under it.
    pub offset: u64,
    /// Its length; `None`: to the end of the storage under it.
    pub size: Option<u64>,
}

/// A window onto `S` (see the module documentation).
#[derive(Debug)]
pub struct WindowStorage<S> {
    inner: S,
    opts: WindowOptions,
}

impl<S: Storage> WindowStorage<S> {
    /// The window `opts` describes onto `inner`.
    pub fn new(inner: S, opts: WindowOptions) -> Self {
        WindowStorage { inner, opts }
    }

    /// Where the window lies.
    pub fn options(&self) -> WindowOptions {
        self.opts
    }

    /// `[offset, offset + len)` of the window as an offset in the storage under it, or the
    /// error of a request `op` that reaches past the window's end.
    async fn place(&self, op: Op, offset: u64, len: u64) -> Result<u64> {
        let end = offset
            .checked_add(len)
            .ok_or(StorageError::OutOfRange { op, offset, len })?;
        if end > self.len().await? {
            return Err(StorageError::Io {
                op,
                offset,
                len,
                source: std::io::Error::from_raw_os_error(libc_eio()),
            });
        }
        self.opts
            .offset
            .checked_add(offset)
            .ok_or(StorageError::OutOfRange { op, offset, len })
    }
}

/// `EIO`: what QEMU's block layer answers a request past the end of a node.
fn libc_eio() -> i32 {
    5
}

impl<S: Storage> Storage for WindowStorage<S> {
    async fn read_at_most(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let len = self.len().await?;
        let n = (buf.len() as u64).min(len.saturating_sub(offset)) as usize;
        if n == 0 {
            return Ok(0);
        }
        // Inside the window (`n` is clamped to its end): one length lookup, not two.
        let at = self
            .opts
            .offset
            .checked_add(offset)
            .ok_or(StorageError::OutOfRange {
                op: Op::Read,
                offset,
                len: n as u64,
            })?;
        self.inner.read_at_most(&mut buf[..n], at).await
    }

    async fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let at = self.place(Op::Read, offset, buf.len() as u64).await?;
        self.inner.read_at(buf, at).await
    }

    async fn read_at_zero_fill(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let at = self.place(Op::Read, offset, buf.len() as u64).await?;
        self.inner.read_at_zero_fill(buf, at).await
    }

    async fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        let at = self.place(Op::Write, offset, buf.len() as u64).await?;
        self.inner.write_at(buf, at).await
    }

    async fn write_at_durable(&self, buf: &[u8], offset: u64) -> Result<()> {
        let at = self.place(Op::Write, offset, buf.len() as u64).await?;
        self.inner.write_at_durable(buf, at).await
    }

    async fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> Result<()> {
        let len = bufs.iter().map(|b| b.len() as u64).sum();
        let at = self.place(Op::Write, offset, len).await?;
        self.inner.write_vectored_at(bufs, at).await
    }

    async fn write_zeroes(&self, offset: u64, len: u64) -> Result<ZeroOutcome> {
        let at = self.place(Op::WriteZeroes, offset, len).await?;
        self.inner.write_zeroes(at, len).await
    }

    async fn discard(&self, offset: u64, len: u64) -> Result<DiscardOutcome> {
        let at = self.place(Op::Discard, offset, len).await?;
        self.inner.discard(at, len).await
    }

    async fn allocate(&self, offset: u64, len: u64) -> Result<AllocateOutcome> {
        let at = self.place(Op::Allocate, offset, len).await?;
        self.inner.allocate(at, len).await
    }

    async fn flush(&self) -> Result<()> {
        self.inner.flush().await
    }

    async fn len(&self) -> Result<u64> {
        match self.opts.size {
            Some(size) => Ok(size),
            None => Ok(self.inner.len().await?.saturating_sub(self.opts.offset)),
        }
    }

    async fn set_len(&self, len: u64) -> Result<()> {
        if self.opts.size.is_some() {
            return Err(StorageError::Io {
                op: Op::SetLen,
                offset: len,
                len: 0,
                source: std::io::Error::other("Cannot resize fixed-size raw disks"),
            });
        }
        let at = self
            .opts
            .offset
            .checked_add(len)
            .ok_or(StorageError::OutOfRange {
                op: Op::SetLen,
                offset: self.opts.offset,
                len,
            })?;
        self.inner.set_len(at).await
    }

    fn request_alignment(&self) -> usize {
        self.inner.request_alignment()
    }

    fn mem_alignment(&self) -> usize {
        self.inner.mem_alignment()
    }

    fn lock_image(&self, lock: ImageLock) -> Result<()> {
        self.inner.lock_image(lock)
    }

    fn unlock_image(&self) {
        self.inner.unlock_image()
    }

    fn debug_event(&self, event: DebugEvent) {
        self.inner.debug_event(event)
    }
}

/// Files opened through [`AnyStorage::open`](crate::AnyStorage::open) as windows.
static ATTACHED: Mutex<Vec<(PathBuf, WindowOptions)>> = Mutex::new(Vec::new());

/// Makes every later [`AnyStorage::open`](crate::AnyStorage::open) of `path` in this process
/// a window onto the file (QEMU's raw `offset`/`size` options given with the name). For
/// command-line tools; a program that builds its own storage wraps it with
/// [`WindowStorage::new`].
pub fn attach(path: impl Into<PathBuf>, opts: WindowOptions) {
    let mut all = ATTACHED.lock().unwrap_or_else(|p| p.into_inner());
    let path = path.into();
    all.retain(|(p, _)| *p != path);
    all.push((path, opts));
}

/// The window [`attach`] made of `path`, if any.
pub fn attached(path: &Path) -> Option<WindowOptions> {
    let all = ATTACHED.lock().unwrap_or_else(|p| p.into_inner());
    all.iter().find(|(p, _)| p == path).map(|(_, o)| *o)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemStorage;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
    }

    #[test]
    fn a_window_maps_its_bytes_and_refuses_requests_past_its_end() {
        rt().block_on(async {
            let mem = MemStorage::new();
            mem.write_at(&[1u8; 8192], 0).await.unwrap();
            let w = WindowStorage::new(
                mem,
                WindowOptions {
                    offset: 1024,
                    size: Some(2048),
                },
            );
            assert_eq!(w.len().await.unwrap(), 2048);
            w.write_at(&[2u8; 512], 1536).await.unwrap();
            assert!(w.write_at(&[3u8; 512], 1537).await.is_err());
            assert!(w.read_at(&mut [0u8; 2049], 0).await.is_err());
            let mut buf = [0u8; 4096];
            assert_eq!(w.read_at_most(&mut buf, 1024).await.unwrap(), 1024);
            assert!(w.set_len(4096).await.is_err());
            let mut all = [0u8; 8192];
            w.inner.read_at(&mut all, 0).await.unwrap();
            assert!(all[..2560].iter().all(|&b| b == 1));
            assert!(all[2560..3072].iter().all(|&b| b == 2));
            assert!(all[3072..].iter().all(|&b| b == 1));
        });
    }

    #[test]
    fn a_window_without_a_size_reaches_the_end_and_resizes_what_is_under_it() {
        rt().block_on(async {
            let mem = MemStorage::new();
            mem.set_len(4096).await.unwrap();
            let w = WindowStorage::new(
                mem,
                WindowOptions {
                    offset: 1000,
                    size: None,
                },
            );
            assert_eq!(w.len().await.unwrap(), 3096);
            w.set_len(24).await.unwrap();
            assert_eq!(w.inner.len().await.unwrap(), 1024);
            assert_eq!(w.len().await.unwrap(), 24);
        });
    }
}

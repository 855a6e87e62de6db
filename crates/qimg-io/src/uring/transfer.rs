//! Reads, writes and `fallocate` through the ring: bounce buffers, requests of at most
//! [`CHUNK`] bytes, short transfers continued and interrupted requests retried.

use std::io::IoSlice;

use nix::errno::Errno;
use nix::fcntl::FallocateFlags;
use nix::libc;

use crate::aligned::{AlignedBuf, BUFFER_ALIGNMENT};
use crate::error::{Op, Result, StorageError};
use crate::storage::Storage;

use super::CHUNK;
use super::request::{Request, Stage};
use super::storage::UringStorage;
use super::submission::{ReadOpcode, RequestKind, RequestMemory};

/// Bounce buffers kept for reuse per storage.
const SPARE_BUFFERS: usize = 32;
/// The largest bounce buffer kept for reuse (32 of them: 8 MiB at most).
const SPARE_BYTES: usize = 256 << 10;

impl UringStorage {
    /// Submits one request and waits for its completion: the result (bytes, or a negated
    /// errno) and the buffer back.
    pub(super) fn submit(&self, kind: RequestKind, buf: AlignedBuf) -> Request<'_> {
        Request {
            shared: self.shared(),
            stage: Stage::Queued(kind, RequestMemory::new(buf)),
        }
    }

    /// A bounce buffer for `len` bytes of a request: one a finished request left behind
    /// when one of that size is there (its bytes are stale: callers write before they read,
    /// and read only what the kernel transferred), else a new zeroed one.
    pub(super) fn bounce(&self, op: Op, offset: u64, len: u64) -> Result<AlignedBuf> {
        let size = usize::try_from(len).unwrap_or(CHUNK).min(CHUNK);
        {
            let mut spare = self
                .shared()
                .spare
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if let Some(i) = spare.iter().position(|b| b.len() == size) {
                return Ok(spare.swap_remove(i));
            }
        }
        AlignedBuf::zeroed(size, self.mem_alignment().max(BUFFER_ALIGNMENT))
            .ok_or(StorageError::OutOfRange { op, offset, len })
    }

    /// Keeps a finished request's bounce buffer for the next one of its size (small ones
    /// only, a few of them: at most [`SPARE_BUFFERS`] of at most [`SPARE_BYTES`] each).
    pub(super) fn recycle(&self, buf: AlignedBuf) {
        if buf.len() > SPARE_BYTES {
            return;
        }
        let mut spare = self
            .shared()
            .spare
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if spare.len() < SPARE_BUFFERS {
            spare.push(buf);
        }
    }

    pub(super) async fn ring_read(
        &self,
        opcode: ReadOpcode,
        buf: &mut [u8],
        offset: u64,
    ) -> Result<usize> {
        let len = buf.len() as u64;
        let mut bounce = self.bounce(Op::Read, offset, len)?;
        let mut done = 0usize;
        while done < buf.len() {
            let want = (buf.len() - done).min(bounce.len());
            let kind = RequestKind::Read {
                opcode,
                offset: offset + done as u64,
                len: want as u32,
            };
            let completion = self.submit(kind, bounce).await;
            bounce = completion.owned.buf;
            match completion.result {
                0 => break,
                n if n > 0 => {
                    let n = (n as usize).min(want);
                    buf[done..done + n].copy_from_slice(&bounce[..n]);
                    done += n;
                    // As in FileStorage: with O_DIRECT only the end of the file gives a short
                    // read that is not a multiple of the block size.
                    if self.is_direct() && done % self.request_alignment() != 0 {
                        break;
                    }
                }
                e if retryable(e) => {}
                e => return Err(StorageError::io(Op::Read, offset, len, errno(e))),
            }
        }
        self.recycle(bounce);
        Ok(done)
    }

    /// Writes `len` bytes at `offset` through the ring: the concatenation of `data`, or zeros.
    pub(super) async fn ring_write(
        &self,
        op: Op,
        data: Option<&[IoSlice<'_>]>,
        offset: u64,
        len: u64,
        dsync: bool,
    ) -> Result<()> {
        let mut bounce = self.bounce(op, offset, len)?;
        if data.is_none() {
            // Zeros are written from the buffer itself (a reused one holds stale bytes).
            bounce.fill(0);
        }
        let mut pos = 0u64;
        while pos < len {
            let n = (len - pos).min(bounce.len() as u64) as usize;
            if let Some(data) = data {
                // `pos` is below the total length of `data`, which fits in memory.
                gather(data, pos as usize, &mut bounce[..n]);
            }
            let kind = RequestKind::Writev {
                offset: offset + pos,
                len: n as u32,
                dsync,
            };
            let completion = self.submit(kind, bounce).await;
            bounce = completion.owned.buf;
            match completion.result {
                0 => {
                    return Err(StorageError::io(
                        op,
                        offset,
                        len,
                        std::io::Error::from(std::io::ErrorKind::WriteZero),
                    ));
                }
                k if k > 0 => pos += (k as u64).min(n as u64),
                e if retryable(e) => {}
                e => return Err(StorageError::io(op, offset, len, errno(e))),
            }
        }
        self.recycle(bounce);
        Ok(())
    }

    /// Runs fallocate on the ring, retrying as [`retryable`] says.
    pub(super) async fn ring_fallocate(
        &self,
        mode: FallocateFlags,
        offset: u64,
        len: u64,
    ) -> Result<(), Errno> {
        loop {
            let kind = RequestKind::Fallocate {
                offset,
                len,
                mode: mode.bits(),
            };
            let completion = self.submit(kind, RequestMemory::empty().buf).await;
            match completion.result {
                r if r >= 0 => return Ok(()),
                r if retryable(r) => {}
                r => return Err(errno(r)),
            }
        }
    }
}

/// A negated errno from a completion as an [`Errno`].
pub(super) fn errno(result: i32) -> Errno {
    Errno::from_raw(result.saturating_neg())
}

/// Results after which the request is simply submitted again: interrupted, try again, and
/// cancelled (the kernel cancels a thread's requests when the thread exits, and a future may
/// have been polled last on a thread that has gone since). Every request here is positional
/// and idempotent, so repeating it is safe.
pub(super) fn retryable(result: i32) -> bool {
    result == -libc::EINTR || result == -libc::EAGAIN || result == -libc::ECANCELED
}

/// Whether the file system (or kernel) cannot do this `fallocate` mode at all.
pub(super) fn unsupported(e: Errno) -> bool {
    matches!(e, Errno::EOPNOTSUPP | Errno::ENOSYS)
}

/// Copies the bytes of the concatenation of `data` starting at `skip` into `out` (as many as
/// fit; the caller asks for no more than there are).
fn gather(data: &[IoSlice<'_>], mut skip: usize, out: &mut [u8]) {
    let mut at = 0;
    for seg in data {
        if at == out.len() {
            break;
        }
        if skip >= seg.len() {
            skip -= seg.len();
            continue;
        }
        let n = (seg.len() - skip).min(out.len() - at);
        out[at..at + n].copy_from_slice(&seg[skip..skip + n]);
        at += n;
        skip = 0;
    }
}

//! A request as the ring sees it: the opcodes probed at open ([`RingOps`]), the memory the kernel
//! points into while the request is in flight ([`RequestMemory`]), and the submission entry built
//! from a [`RequestKind`].

use std::os::fd::RawFd;

use io_uring::{opcode, squeue, types};
use nix::libc;

use crate::aligned::AlignedBuf;

/// Which read opcode the kernel offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ReadOpcode {
    /// `IORING_OP_READ` (Linux 5.6).
    Read,
    /// `IORING_OP_READV` (Linux 5.1), with a one-entry `iovec`.
    Readv,
}

/// What goes through the ring, after probing and the options.
#[derive(Debug, Clone, Copy)]
pub(super) struct RingOps {
    pub(super) read: Option<ReadOpcode>,
    pub(super) write: bool,
    pub(super) fsync: bool,
    pub(super) zero: bool,
    pub(super) discard: bool,
    pub(super) allocate: bool,
}

/// The storage's memory for one in-flight request. The kernel holds raw pointers into it from
/// submission to completion, so it lives in the request's slot for that whole time.
pub(super) struct RequestMemory {
    /// Bounce buffer: read into, or written from (empty for requests without data).
    pub(super) buf: AlignedBuf,
    /// The one-entry `iovec` of `IORING_OP_READV` / `IORING_OP_WRITEV`, pointing into `buf`.
    pub(super) iov: Option<Box<Iovec>>,
}

/// An `iovec` that may move between threads.
pub(super) struct Iovec(libc::iovec);

// SAFETY: `libc::iovec` is `!Send` only because it holds a raw pointer. Ours always points into
// the `AlignedBuf` of the same `RequestMemory` (a heap block with no thread affinity), and it is
// dereferenced only by the kernel, never by Rust code, so moving it to another thread is as
// safe as moving the buffer itself.
unsafe impl Send for Iovec {}

impl RequestMemory {
    pub(super) fn new(buf: AlignedBuf) -> Self {
        RequestMemory { buf, iov: None }
    }

    pub(super) fn empty() -> Self {
        RequestMemory::new(AlignedBuf::empty())
    }
}

/// One request, as the ring sees it.
#[derive(Debug, Clone, Copy)]
pub(super) enum RequestKind {
    /// Read `len` bytes at `offset` into the bounce buffer.
    Read {
        opcode: ReadOpcode,
        offset: u64,
        len: u32,
    },
    /// Write the first `len` bytes of the bounce buffer at `offset` (with `dsync`: durable
    /// on completion, `RWF_DSYNC`).
    Writev { offset: u64, len: u32, dsync: bool },
    /// `fdatasync`.
    Fsync,
    /// `fallocate(mode, offset, len)`.
    Fallocate { offset: u64, len: u64, mode: i32 },
}

impl RequestKind {
    /// The submission entry for this request, pointing into `owned` (which must already be
    /// where it stays until completion: in its slot). Lengths are capped at the buffer's.
    pub(super) fn entry(self, fd: RawFd, owned: &mut RequestMemory) -> squeue::Entry {
        let fd = types::Fd(fd);
        match self {
            RequestKind::Read {
                opcode: ReadOpcode::Read,
                offset,
                len,
            } => {
                let len = capped(len, &owned.buf);
                opcode::Read::new(fd, owned.buf.as_mut_ptr(), len)
                    .offset(offset)
                    .build()
            }
            RequestKind::Read {
                opcode: ReadOpcode::Readv,
                offset,
                len,
            } => {
                let iov = iovec(owned, len);
                opcode::Readv::new(fd, iov, 1).offset(offset).build()
            }
            RequestKind::Writev { offset, len, dsync } => {
                let iov = iovec(owned, len);
                let flags = if dsync { libc::RWF_DSYNC } else { 0 };
                opcode::Writev::new(fd, iov, 1)
                    .offset(offset)
                    .rw_flags(flags)
                    .build()
            }
            RequestKind::Fsync => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            RequestKind::Fallocate { offset, len, mode } => opcode::Fallocate::new(fd, len)
                .offset(offset)
                .mode(mode)
                .build(),
        }
    }
}

/// `len`, or the buffer's length if that is less.
fn capped(len: u32, buf: &AlignedBuf) -> u32 {
    len.min(u32::try_from(buf.len()).unwrap_or(u32::MAX))
}

/// Points `owned.iov` at the first `len` bytes of `owned.buf` and returns its address.
fn iovec(owned: &mut RequestMemory, len: u32) -> *const libc::iovec {
    let len = capped(len, &owned.buf) as usize;
    let base = owned.buf.as_mut_ptr().cast::<libc::c_void>();
    let iov = owned.iov.insert(Box::new(Iovec(libc::iovec {
        iov_base: base,
        iov_len: len,
    })));
    &iov.0
}

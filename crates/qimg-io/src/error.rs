//! The error type of every storage operation.
//!
//! Each error names the operation that failed and the byte range it was asked to touch, so a
//! message such as "write of 4096 bytes at offset 0x30000 failed" reaches the user even when it
//! passes through several layers. The operating system's error, when there is one, is the
//! [`source`](std::error::Error::source) of the error rather than part of its message, so error
//! reporters that walk the chain print it once.

use std::fmt;
use std::io;
use std::path::PathBuf;

/// The largest byte offset any backend accepts: the end of every request (offset plus length)
/// and every file length must be at most this, because Linux file offsets are signed 64-bit.
pub const MAX_OFFSET: u64 = i64::MAX as u64;

/// A storage operation, as named in error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Op {
    /// [`Storage::read_at`](crate::Storage::read_at) and the other reads.
    Read,
    /// [`Storage::write_at`](crate::Storage::write_at) and
    /// [`Storage::write_vectored_at`](crate::Storage::write_vectored_at).
    Write,
    /// [`Storage::write_zeroes`](crate::Storage::write_zeroes).
    WriteZeroes,
    /// [`Storage::discard`](crate::Storage::discard).
    Discard,
    /// [`Storage::allocate`](crate::Storage::allocate).
    Allocate,
    /// [`Storage::flush`](crate::Storage::flush).
    Flush,
    /// [`Storage::len`](crate::Storage::len).
    Len,
    /// [`Storage::set_len`](crate::Storage::set_len).
    SetLen,
    /// Probing the O_DIRECT alignment of a freshly opened file.
    Probe,
    /// [`Storage::lock_image`](crate::Storage::lock_image).
    Lock,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::WriteZeroes => "write_zeroes",
            Op::Discard => "discard",
            Op::Allocate => "allocate",
            Op::Flush => "flush",
            Op::Len => "len",
            Op::SetLen => "set_len",
            Op::Probe => "alignment probe",
            Op::Lock => "image lock",
        })
    }
}

/// Why a storage operation failed.
///
/// Every variant carries the operation and the byte range of the request (for
/// [`Op::SetLen`] the requested length is reported as `offset` with `len` 0, for
/// [`Op::Flush`] and [`Op::Len`] both are 0). [`StorageError::kind`] maps each variant to the
/// closest [`io::ErrorKind`], and the error converts into an [`io::Error`] for callers that
/// want one.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StorageError {
    /// The operating system (or the runtime that ran the system call) reported an error.
    #[error("{op} of {len} bytes at offset {offset:#x} failed")]
    Io {
        /// The operation.
        op: Op,
        /// First byte of the request.
        offset: u64,
        /// Length of the request in bytes.
        len: u64,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// `offset + len` overflows, or ends past [`MAX_OFFSET`].
    #[error(
        "{op} at offset {offset:#x} with length {len:#x} ends past the largest supported offset {max:#x}",
        max = MAX_OFFSET
    )]
    OutOfRange {
        /// The operation.
        op: Op,
        /// First byte of the request.
        offset: u64,
        /// Length of the request in bytes.
        len: u64,
    },
    /// A read that must fill its whole buffer reached the end of the file first.
    #[error("read of {len} bytes at offset {offset:#x} reached the end of the file at {eof:#x}")]
    UnexpectedEof {
        /// First byte of the request.
        offset: u64,
        /// Length of the request in bytes.
        len: u64,
        /// Where the end of the file was met.
        eof: u64,
    },
    /// An O_DIRECT request whose offset, length or buffer address is not aligned as the
    /// backend requires (see [`Storage::request_alignment`](crate::Storage::request_alignment)
    /// and [`Storage::mem_alignment`](crate::Storage::mem_alignment)). The kernel would answer
    /// `EINVAL`; this names what was wrong instead.
    #[error(
        "{op} of {len} bytes at offset {offset:#x} from buffer address {addr:#x} is not aligned: \
         offsets and lengths must be multiples of {request_alignment} bytes and buffers must \
         start on a multiple of {mem_alignment} bytes"
    )]
    Misaligned {
        /// The operation.
        op: Op,
        /// First byte of the request.
        offset: u64,
        /// Length of the request (or of the misaligned buffer segment) in bytes.
        len: u64,
        /// Address of the (first misaligned) buffer, 0 when no buffer is involved.
        addr: usize,
        /// Required alignment of offsets and lengths.
        request_alignment: usize,
        /// Required alignment of buffer addresses.
        mem_alignment: usize,
    },
    /// A modifying operation on storage opened read-only.
    #[error("{op} of {len} bytes at offset {offset:#x} refused: the storage is read-only")]
    ReadOnly {
        /// The operation.
        op: Op,
        /// First byte of the request.
        offset: u64,
        /// Length of the request in bytes.
        len: u64,
    },
    /// Opening a file failed.
    #[error("cannot open {}", path.display())]
    Open {
        /// The path given to the open call.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The io_uring backend cannot run here: setting up a ring (or its completion thread)
    /// failed, for example on a kernel without io_uring, under a seccomp filter, with the
    /// `kernel.io_uring_disabled` sysctl set, or past the locked-memory limit. The file backend
    /// still works.
    #[error("io_uring is unavailable")]
    UringUnavailable {
        /// The underlying error (the `io_uring_setup` failure, typically `ENOSYS` or `EPERM`).
        #[source]
        source: io::Error,
    },
    /// Another process holds the image in a way the requested access conflicts with (QEMU's
    /// image locking, see [`ImageLock`](crate::ImageLock)).
    #[error("the image is in use: {holder}; use force-share (-U) to read it anyway")]
    Locked {
        /// Who holds the image, and how.
        holder: String,
    },
}

impl StorageError {
    /// The closest [`io::ErrorKind`]: the kind of the operating system's error for
    /// [`StorageError::Io`], [`StorageError::Open`] and [`StorageError::UringUnavailable`],
    /// `UnexpectedEof` for a short read,
    /// `InvalidInput` for out-of-range and misaligned requests, `PermissionDenied` for writes to
    /// read-only storage.
    pub fn kind(&self) -> io::ErrorKind {
        match self {
            StorageError::Io { source, .. }
            | StorageError::Open { source, .. }
            | StorageError::UringUnavailable { source } => source.kind(),
            StorageError::OutOfRange { .. } | StorageError::Misaligned { .. } => {
                io::ErrorKind::InvalidInput
            }
            StorageError::UnexpectedEof { .. } => io::ErrorKind::UnexpectedEof,
            StorageError::ReadOnly { .. } => io::ErrorKind::PermissionDenied,
            StorageError::Locked { .. } => io::ErrorKind::ResourceBusy,
        }
    }

    /// The operation that failed, or `None` for [`StorageError::Open`] and
    /// [`StorageError::UringUnavailable`] ([`Op::Lock`] for [`StorageError::Locked`]).
    pub fn op(&self) -> Option<Op> {
        match self {
            StorageError::Io { op, .. }
            | StorageError::OutOfRange { op, .. }
            | StorageError::Misaligned { op, .. }
            | StorageError::ReadOnly { op, .. } => Some(*op),
            StorageError::UnexpectedEof { .. } => Some(Op::Read),
            StorageError::Locked { .. } => Some(Op::Lock),
            StorageError::Open { .. } | StorageError::UringUnavailable { .. } => None,
        }
    }

    /// The operating system's error number, if the failure came from a system call.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            StorageError::Io { source, .. }
            | StorageError::Open { source, .. }
            | StorageError::UringUnavailable { source } => source.raw_os_error(),
            StorageError::Locked { .. } => Some(nix::libc::EAGAIN),
            _ => None,
        }
    }

    pub(crate) fn io(op: Op, offset: u64, len: u64, source: impl Into<io::Error>) -> Self {
        StorageError::Io {
            op,
            offset,
            len,
            source: source.into(),
        }
    }
}

impl From<StorageError> for io::Error {
    fn from(e: StorageError) -> Self {
        io::Error::new(e.kind(), e)
    }
}

/// The result of a storage operation.
pub type Result<T, E = StorageError> = std::result::Result<T, E>;

/// Checks that `offset + len` neither overflows nor ends past [`MAX_OFFSET`], and returns the
/// end of the range.
pub(crate) fn range_end(op: Op, offset: u64, len: u64) -> Result<u64> {
    match offset.checked_add(len) {
        Some(end) if end <= MAX_OFFSET => Ok(end),
        _ => Err(StorageError::OutOfRange { op, offset, len }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflowing_range_is_an_error_naming_offset_and_length() {
        let e = range_end(Op::Write, u64::MAX - 1, 4).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("0xfffffffffffffffe"), "{msg}");
        assert!(msg.contains("0x4"), "{msg}");
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert_eq!(range_end(Op::Read, MAX_OFFSET, 0).unwrap(), MAX_OFFSET);
        assert!(range_end(Op::Read, MAX_OFFSET, 1).is_err());
    }

    #[test]
    fn uring_unavailable_says_so_and_keeps_the_errno() {
        let e = StorageError::UringUnavailable {
            source: io::Error::from_raw_os_error(1),
        };
        assert_eq!(e.to_string(), "io_uring is unavailable");
        assert_eq!(e.op(), None);
        assert_eq!(e.raw_os_error(), Some(1));
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        assert!(std::error::Error::source(&e).is_some());
    }

    #[test]
    fn io_errors_keep_the_os_error_as_source() {
        let e = StorageError::io(Op::Flush, 0, 0, io::Error::from_raw_os_error(5));
        assert_eq!(e.raw_os_error(), Some(5));
        assert!(std::error::Error::source(&e).is_some());
        let io: io::Error = e.into();
        assert_eq!(io.kind(), io::Error::from_raw_os_error(5).kind());
    }
}

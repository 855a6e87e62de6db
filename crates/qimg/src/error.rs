//! The engine's error type.

use std::io;
use std::path::PathBuf;

use thiserror::Error;

/// Everything that can go wrong in the `qimg` library.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// The image's metadata is malformed.
    #[error("{path}: {source}")]
    Format {
        /// The image file.
        path: PathBuf,
        /// What is wrong with it.
        #[source]
        source: qimg_format::FormatError,
    },
    /// An I/O operation failed.
    #[error("{path}: {op} failed: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done ("open", "read 4096 bytes at 0x30000", ...).
        op: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// An option or option combination is not valid; the message names the option.
    #[error("{0}")]
    InvalidOption(String),
    /// The image uses a feature this version does not implement.
    #[error("{path}: {what}")]
    Unsupported {
        /// The image file.
        path: PathBuf,
        /// The missing feature.
        what: String,
    },
    /// The image is encrypted (`crypt_method` 1, AES, or 2, LUKS, at header offset 32) and
    /// cannot be opened: no passphrase was given
    /// ([`OpenOptions::encryption_key`](crate::OpenOptions::encryption_key)), or it is the
    /// legacy AES method, which qimg does not decrypt.
    #[error(
        "{path}: encrypted image (crypt_method {method} at offset 32): {}",
        if *method == 2 { "no passphrase was given" } else { "qimg does not decrypt AES-CBC (crypt_method 1) images" }
    )]
    Encrypted {
        /// The image file.
        path: PathBuf,
        /// `crypt_method`.
        method: u32,
    },
    /// A LUKS header that does not open: a wrong passphrase (QEMU's "Invalid password,
    /// cannot unlock any keyslot"), an algorithm qimg lacks, or a damaged header.
    #[error("{path}: {source}")]
    Crypto {
        /// The image file.
        path: PathBuf,
        /// What went wrong.
        #[source]
        source: crate::crypto::CryptoError,
    },
    /// A storage operation of the engine failed.
    #[error("{path}: {source}")]
    Storage {
        /// The file (image, data file or backing file).
        path: PathBuf,
        /// What failed, with operation, offset and length.
        #[source]
        source: qimg_io::StorageError,
    },
    /// The backing file an image names could not be opened (the error of that open, which
    /// may itself be one of a deeper backing file).
    #[error("{path}: cannot open its backing file: {source}")]
    Backing {
        /// The image that names the backing file.
        path: PathBuf,
        /// Why the backing file did not open.
        #[source]
        source: Box<Error>,
    },
    /// A write-side request on an image opened read-only.
    #[error("{path}: the image is open read-only")]
    ReadOnly {
        /// The image file.
        path: PathBuf,
    },
    /// A request reaches outside the virtual disk.
    #[error(
        "{path}: request of {len} bytes at offset {offset} is outside the virtual disk of {size} bytes"
    )]
    OutOfRange {
        /// The image file.
        path: PathBuf,
        /// First byte of the request.
        offset: u64,
        /// Length of the request.
        len: u64,
        /// Virtual disk size.
        size: u64,
    },
    /// The image's metadata is inconsistent (found while using it, not while decoding it).
    #[error("{path}: {what}")]
    Corrupt {
        /// The image file.
        path: PathBuf,
        /// What is inconsistent, with offsets.
        what: String,
    },
    /// A switch of the header to a new L1 or refcount table failed after its write was
    /// issued, so the file may name either table. Both describe the image as long as nothing
    /// else changes, so writes are refused until the image is reopened (the open reads
    /// whichever table the file names; at worst the other one's clusters leak).
    #[error("{path}: writes are refused until the image is reopened: {what}")]
    Halted {
        /// The image file.
        path: PathBuf,
        /// The switch that failed, and why.
        what: String,
    },
    /// Corruption was found while the image was open for writing: the image is marked
    /// corrupt on disk and takes no further requests (reads included), as QEMU's driver
    /// ejects its medium. Repair it (`qimg check -r all`) and open it again.
    #[error(
        "{path}: the image was marked corrupt after an inconsistency was found and takes no \
         more requests (repair it with qimg check -r all, then reopen it)"
    )]
    Unusable {
        /// The image file.
        path: PathBuf,
    },
    /// No internal snapshot has the ID or name asked for.
    #[error("{path}: no snapshot has the ID or name '{name}'")]
    SnapshotNotFound {
        /// The image file.
        path: PathBuf,
        /// The ID or name asked for.
        name: String,
    },
    /// The cache options cannot be applied to this image.
    #[error("{path}: {source}")]
    Cache {
        /// The image file.
        path: PathBuf,
        /// What is wrong with the options.
        #[source]
        source: qimg_cache::CacheError,
    },
}

impl Error {
    pub(crate) fn io(
        path: impl Into<PathBuf>,
        op: impl Into<String>,
        source: std::io::Error,
    ) -> Self {
        Self::Io {
            path: path.into(),
            op: op.into(),
            source,
        }
    }

    pub(crate) fn storage(path: impl Into<PathBuf>, source: qimg_io::StorageError) -> Self {
        Self::Storage {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn corrupt(path: impl Into<PathBuf>, what: impl Into<String>) -> Self {
        Self::Corrupt {
            path: path.into(),
            what: what.into(),
        }
    }

    pub(crate) fn format(path: impl Into<PathBuf>, source: qimg_format::FormatError) -> Self {
        Self::Format {
            path: path.into(),
            source,
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The closest [`io::ErrorKind`]: the system's for failed system calls, `InvalidData` for
    /// damaged images, `InvalidInput` for bad requests and options, `PermissionDenied` for
    /// writes to a read-only image, `Unsupported` for what qimg cannot do, `NotFound` for
    /// an unknown snapshot, `ResourceBusy`
    /// when another process holds the image.
    pub fn kind(&self) -> io::ErrorKind {
        match self {
            Self::Backing { source, .. } => source.kind(),
            Self::Io { source, .. } => source.kind(),
            Self::Storage { source, .. } => source.kind(),
            Self::Format { .. } | Self::Corrupt { .. } | Self::Unusable { .. } => {
                io::ErrorKind::InvalidData
            }
            Self::InvalidOption(_) | Self::OutOfRange { .. } | Self::Cache { .. } => {
                io::ErrorKind::InvalidInput
            }
            Self::Unsupported { .. } | Self::Encrypted { .. } => io::ErrorKind::Unsupported,
            Self::Crypto { .. } => io::ErrorKind::PermissionDenied,
            Self::ReadOnly { .. } => io::ErrorKind::PermissionDenied,
            Self::SnapshotNotFound { .. } => io::ErrorKind::NotFound,
            Self::Halted { .. } => io::ErrorKind::Other,
        }
    }

    /// The operating system's error number when a system call failed, else `None`.
    pub fn os_error(&self) -> Option<i32> {
        match self {
            Self::Backing { source, .. } => source.os_error(),
            Self::Io { source, .. } => source.raw_os_error(),
            Self::Storage { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }

    /// An errno for every error, for a device model or an export that must answer a guest
    /// or a client with one: the system's when a system call failed; else `EPERM` for writes
    /// to a read-only image, `EINVAL` for requests outside the disk and bad options,
    /// `ENOTSUP` for what qimg cannot do, `ENOENT` for an unknown snapshot, `ENOMEDIUM` for
    /// an image made unusable by corruption ([`Error::Unusable`], QEMU's errno for it), `EIO`
    /// for damaged images and everything else.
    pub fn errno(&self) -> i32 {
        if let Some(e) = self.os_error() {
            return e;
        }
        match self {
            Self::Backing { source, .. } => source.errno(),
            Self::ReadOnly { .. } => libc_errno::EPERM,
            Self::OutOfRange { .. } | Self::InvalidOption(_) | Self::Cache { .. } => {
                libc_errno::EINVAL
            }
            Self::Unsupported { .. } | Self::Encrypted { .. } => libc_errno::ENOTSUP,
            Self::Crypto { .. } => libc_errno::EPERM,
            Self::SnapshotNotFound { .. } => libc_errno::ENOENT,
            Self::Unusable { .. } => libc_errno::ENOMEDIUM,
            _ => libc_errno::EIO,
        }
    }
}

/// The errno values [`Error::errno`] uses (Linux numbering, which qimg targets).
mod libc_errno {
    pub(super) const EPERM: i32 = 1;
    pub(super) const ENOENT: i32 = 2;
    pub(super) const EIO: i32 = 5;
    pub(super) const EINVAL: i32 = 22;
    pub(super) const ENOTSUP: i32 = 95;
    pub(super) const ENOMEDIUM: i32 = 123;
}

impl From<Error> for io::Error {
    /// Keeps the kind (see [`Error::kind`]) and the whole error as the source.
    fn from(e: Error) -> Self {
        io::Error::new(e.kind(), e)
    }
}

/// `%#x` as C prints it (`0` for zero): for messages in QEMU's words.
pub(crate) fn c_hex(v: u64) -> String {
    if v == 0 {
        "0".into()
    } else {
        format!("{v:#x}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_has_a_kind_and_an_errno() {
        let p = PathBuf::from("d.qcow2");
        let enoent = Error::io(&p, "open", io::Error::from_raw_os_error(2));
        assert_eq!(
            (enoent.kind(), enoent.errno()),
            (io::ErrorKind::NotFound, 2)
        );
        assert_eq!(enoent.os_error(), Some(2));
        let ro = Error::ReadOnly { path: p.clone() };
        assert_eq!(
            (ro.kind(), ro.errno()),
            (io::ErrorKind::PermissionDenied, 1)
        );
        let range = Error::OutOfRange {
            path: p.clone(),
            offset: 1,
            len: 2,
            size: 0,
        };
        assert_eq!(
            (range.kind(), range.errno()),
            (io::ErrorKind::InvalidInput, 22)
        );
        let corrupt = Error::corrupt(&p, "bad");
        assert_eq!(
            (corrupt.kind(), corrupt.errno()),
            (io::ErrorKind::InvalidData, 5)
        );
        assert_eq!(corrupt.os_error(), None);
        let as_io: io::Error = corrupt.into();
        assert_eq!(as_io.kind(), io::ErrorKind::InvalidData);
        assert!(as_io.to_string().contains("bad"));
    }
}

//! The engine's error type.

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
    /// A storage operation of the engine failed.
    #[error("{path}: {source}")]
    Storage {
        /// The file (image, data file or backing file).
        path: PathBuf,
        /// What failed, with operation, offset and length.
        #[source]
        source: qimg_io::StorageError,
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

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

    pub(crate) fn format(path: impl Into<PathBuf>, source: qimg_format::FormatError) -> Self {
        Self::Format {
            path: path.into(),
            source,
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

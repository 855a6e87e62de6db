//! How a failed qemu-io command and a failed open are told: errno texts and QEMU's words.

use qimg::io::StorageError;

use crate::status::{lib_msg, lock_error, os_msg};

/// `EIO`.
pub const EIO: i32 = 5;

/// `EINVAL`.
pub const EINVAL: i32 = 22;

/// A command failed (its message is already printed).
#[derive(Debug)]
pub struct Failed;

/// The outcome of one command.
pub type Outcome = Result<(), Failed>;

/// The errno of a storage error (`EIO` when it has none).
pub(super) fn storage_errno(e: StorageError) -> i32 {
    e.raw_os_error().unwrap_or(EIO)
}

/// C's `strerror` text of `errno`.
pub fn strerror(errno: i32) -> String {
    os_msg(&std::io::Error::from_raw_os_error(errno))
}

/// Why `file` did not open, as QEMU words it: a system error names the file it happened on
/// (the image, its data file or a backing file).
pub(super) fn open_error(e: &qimg::Error, file: &str) -> String {
    // The format's refusal, without the protocol's "Could not open" (QEMU's words).
    if let Some(words) = crate::status::qemu_header_words(e) {
        return words;
    }
    // A backing file that does not open, a LUKS header that does not: the chain's or the
    // crypto layer's words, without the image's name.
    if let qimg::Error::Backing { .. } | qimg::Error::Crypto { .. } = e {
        return crate::status::lib_msg(e, file);
    }
    // A read-write open of an image marked corrupt, in QEMU's words.
    if let qimg::Error::Format {
        source:
            qimg::format::FormatError::InvalidField {
                what,
                offset,
                value,
                reason,
            },
        ..
    } = e
    {
        let corrupt = value & qimg::format::features::INCOMPAT_CORRUPT != 0;
        if *what == "incompatible_features"
            && *offset == 72
            && corrupt
            && reason.starts_with("the corrupt bit")
        {
            return "qcow2: Image is corrupt; cannot be opened read/write".into();
        }
    }
    if let qimg::Error::Storage {
        path,
        source: StorageError::Locked { holder },
    } = e
    {
        return lock_error(holder, &path.display().to_string());
    }
    let failed_on = match e {
        qimg::Error::Storage { path, .. } | qimg::Error::Io { path, .. } => Some(path),
        _ => None,
    };
    match (failed_on, e.os_error()) {
        (Some(path), Some(errno)) => {
            format!("Could not open '{}': {}", path.display(), strerror(errno))
        }
        _ => format!("Could not open '{file}': {}", lib_msg(e, file)),
    }
}

/// A storage error at open, as QEMU words it.
pub(super) fn storage_open_error(e: &StorageError, file: &str) -> String {
    match e {
        StorageError::Locked { holder } => lock_error(holder, file),
        // An NBD export's refusals, in QEMU's words where it has them.
        StorageError::Open { source, .. } if qimg::io::nbd::is_nbd_name(file) => {
            match source.kind() {
                std::io::ErrorKind::PermissionDenied => {
                    "Could not open image: Permission denied".to_string()
                }
                std::io::ErrorKind::NotFound if source.to_string().contains("export") => {
                    source.to_string()
                }
                _ => format!("Could not open '{file}': {source}"),
            }
        }
        other => match other.raw_os_error() {
            Some(errno) => format!("Could not open '{file}': {}", strerror(errno)),
            None => format!("Could not open '{file}': {other}"),
        },
    }
}

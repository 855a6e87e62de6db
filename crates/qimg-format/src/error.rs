//! The one error type of the format crate.

use thiserror::Error;

/// Everything that can be wrong with bytes that claim to be qcow2 metadata.
///
/// Every variant names the offending value and, where the bytes came from a file, the file
/// offset at which they were found, so that a user can find the damage with a hex editor.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum FormatError {
    /// Fewer bytes were available than the structure needs.
    #[error("{what} at offset {offset:#x} is truncated: needs {need} bytes, only {have} available")]
    Truncated {
        /// The structure being decoded.
        what: &'static str,
        /// File offset at which it starts.
        offset: u64,
        /// Bytes needed.
        need: u64,
        /// Bytes available.
        have: u64,
    },
    /// The first four bytes are not `QFI\xfb`.
    #[error(
        "not a qcow2 image: magic at offset 0x0 is {found:#010x}, expected 0x514649fb (\"QFI\\xfb\")"
    )]
    BadMagic {
        /// The magic found.
        found: u32,
    },
    /// Version other than 2 or 3.
    #[error("unsupported qcow2 version {version} at offset 0x4 (only 2 and 3 exist)")]
    UnsupportedVersion {
        /// The version found.
        version: u32,
    },
    /// Reserved bits of an entry or field are set.
    #[error("{what} at offset {offset:#x} has reserved bits {bits:#x} set (value {value:#x})")]
    ReservedBits {
        /// The structure (e.g. "L2 entry").
        what: &'static str,
        /// File offset of the entry (or 0 when unknown).
        offset: u64,
        /// The reserved bits that are set.
        bits: u64,
        /// The whole raw value.
        value: u64,
    },
    /// An offset that must be aligned is not.
    #[error("{what} {value:#x} (at offset {offset:#x}) is not aligned to {align:#x}")]
    Unaligned {
        /// Which offset.
        what: &'static str,
        /// File offset where the value was read.
        offset: u64,
        /// The unaligned value.
        value: u64,
        /// The required alignment.
        align: u64,
    },
    /// A field holds a value outside what the format (or QEMU's limits) allow.
    #[error("invalid {what} {value} (at offset {offset:#x}): {reason}")]
    InvalidField {
        /// Field name as in the specification (e.g. "cluster_bits").
        what: &'static str,
        /// File offset of the field.
        offset: u64,
        /// The value found.
        value: u64,
        /// Why it is refused.
        reason: String,
    },
    /// Incompatible feature bits this implementation does not know are set.
    #[error("unsupported incompatible feature bits {bits:#x} at offset 0x48: {names}")]
    UnknownIncompatibleFeatures {
        /// The unknown bits.
        bits: u64,
        /// Their names from the feature name table, or "bit N" when unnamed.
        names: String,
        /// The bits the image's feature name table names, with their names, in the table's
        /// order (QEMU names these and counts the rest as unknown).
        named: Vec<(u8, String)>,
    },
    /// An extended L2 entry whose bitmap is impossible.
    #[error(
        "extended L2 entry at offset {offset:#x} is invalid: {reason} (entry {entry:#018x}, bitmap {bitmap:#018x})"
    )]
    InvalidSubclusterBitmap {
        /// File offset of the entry.
        offset: u64,
        /// First 64-bit word.
        entry: u64,
        /// Subcluster bitmap word.
        bitmap: u64,
        /// What is wrong.
        reason: &'static str,
    },
    /// A header extension is malformed.
    #[error("header extension {kind:#010x} at offset {offset:#x} is invalid: {reason}")]
    BadExtension {
        /// Extension type.
        kind: u32,
        /// File offset of the extension header.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// A value would overflow the arithmetic it feeds.
    #[error("{what} overflows: {reason}")]
    Overflow {
        /// What was being computed.
        what: &'static str,
        /// Details including the values involved.
        reason: String,
    },
    /// A value passed in by the caller (not read from a file) is outside what the format allows.
    #[error("invalid {what} {value:#x}: {reason}")]
    InvalidArgument {
        /// What the value is (e.g. "L2 slice size").
        what: &'static str,
        /// The value passed.
        value: u64,
        /// Why it is refused.
        reason: String,
    },
}

/// Result alias of this crate.
pub type Result<T, E = FormatError> = std::result::Result<T, E>;

//! Header extensions (the area after the header in cluster 0) and the backing file name: one
//! [`Extension`] per extension, and the decoding of the extension area. (The older path
//! `qimg_format::extensions` re-exports this module with [`crate::cluster0::Cluster0`].)
//!
//! Each extension is `type: u32, len: u32, data[len]`, padded to a multiple of 8. Unknown
//! extensions are kept byte for byte and written back.

use crate::be::u32_at;
use crate::bitmap::BitmapsExtension;
use crate::error::{FormatError, Result};
use crate::features::{FeatureName, decode_feature_table, encode_feature_table};
use crate::header::Header;

pub use crate::magic::{
    EXT_BACKING_FORMAT, EXT_BITMAPS, EXT_CRYPTO, EXT_DATA_FILE, EXT_END, EXT_FEATURE_TABLE,
};

/// Longest backing file name QEMU accepts.
pub const MAX_BACKING_NAME: usize = 1023;
/// Backing format names must be shorter than this (QEMU).
pub const MAX_BACKING_FORMAT: usize = 16;

/// One header extension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Extension {
    /// Backing file format name, e.g. `qcow2` or `raw`.
    BackingFormat(Vec<u8>),
    /// Names of feature bits.
    FeatureTable(Vec<FeatureName>),
    /// Where the bitmap directory is.
    Bitmaps(BitmapsExtension),
    /// Full disk encryption (LUKS) header location.
    Crypto {
        /// Cluster-aligned file offset of the LUKS header.
        offset: u64,
        /// Its length in bytes.
        length: u64,
    },
    /// External data file name.
    DataFile(Vec<u8>),
    /// An extension this implementation does not know, kept as read.
    Unknown {
        /// Its type.
        kind: u32,
        /// Its data, without padding.
        data: Vec<u8>,
    },
}

impl Extension {
    /// The type number.
    pub fn kind(&self) -> u32 {
        match self {
            Self::BackingFormat(_) => EXT_BACKING_FORMAT,
            Self::FeatureTable(_) => EXT_FEATURE_TABLE,
            Self::Bitmaps(_) => EXT_BITMAPS,
            Self::Crypto { .. } => EXT_CRYPTO,
            Self::DataFile(_) => EXT_DATA_FILE,
            Self::Unknown { kind, .. } => *kind,
        }
    }

    /// Rank in QEMU's write order: backing format, data file, crypto, feature table, bitmaps,
    /// unknown.
    pub(crate) fn qemu_rank(&self) -> u8 {
        match self {
            Self::BackingFormat(_) => 0,
            Self::DataFile(_) => 1,
            Self::Crypto { .. } => 2,
            Self::FeatureTable(_) => 3,
            Self::Bitmaps(_) => 4,
            Self::Unknown { .. } => 5,
        }
    }

    pub(crate) fn data(&self) -> Vec<u8> {
        match self {
            Self::BackingFormat(d) | Self::DataFile(d) => d.clone(),
            Self::FeatureTable(t) => encode_feature_table(t),
            Self::Bitmaps(b) => b.encode().to_vec(),
            Self::Crypto { offset, length } => {
                let mut d = offset.to_be_bytes().to_vec();
                d.extend_from_slice(&length.to_be_bytes());
                d
            }
            Self::Unknown { data, .. } => data.clone(),
        }
    }

    fn decode(kind: u32, data: &[u8], at: u64, cluster_size: u64) -> Result<Self> {
        let bad = |reason: String| FormatError::BadExtension {
            kind,
            offset: at,
            reason,
        };
        Ok(match kind {
            EXT_BACKING_FORMAT => {
                if data.len() >= MAX_BACKING_FORMAT {
                    return Err(bad(format!(
                        "backing format name is {} bytes, at most {} allowed",
                        data.len(),
                        MAX_BACKING_FORMAT - 1
                    )));
                }
                Self::BackingFormat(data.to_vec())
            }
            EXT_FEATURE_TABLE => Self::FeatureTable(decode_feature_table(data, at)?),
            EXT_BITMAPS => Self::Bitmaps(BitmapsExtension::decode(data, at, cluster_size)?),
            EXT_CRYPTO => {
                if data.len() != 16 {
                    return Err(bad(format!(
                        "crypto header pointer is {} bytes, expected 16",
                        data.len()
                    )));
                }
                let offset = crate::be::u64_at(data, 0);
                let length = crate::be::u64_at(data, 8);
                if offset % cluster_size != 0 {
                    return Err(bad(format!(
                        "crypto header offset {offset:#x} is not aligned to the cluster size {cluster_size:#x}"
                    )));
                }
                Self::Crypto { offset, length }
            }
            EXT_DATA_FILE => Self::DataFile(data.to_vec()),
            _ => Self::Unknown {
                kind,
                data: data.to_vec(),
            },
        })
    }
}

pub(crate) fn decode_extensions(
    bytes: &[u8],
    header: &Header,
    cluster_size: u64,
) -> Result<Vec<Extension>> {
    let start = header.extensions_start();
    let area_end = if header.backing_file_offset != 0 {
        header.backing_file_offset
    } else {
        cluster_size
    };
    // A short file simply has fewer bytes; QEMU reads zeros (an end marker) past EOF.
    let end = area_end.min(bytes.len() as u64);
    let mut off = start;
    let mut out: Vec<Extension> = Vec::new();
    while off < end {
        if end - off < 8 {
            return Err(FormatError::BadExtension {
                kind: 0,
                offset: off,
                reason: format!(
                    "extension header needs 8 bytes but the extension area ends at {end:#x}"
                ),
            });
        }
        let o = off as usize;
        let kind = u32_at(bytes, o);
        let len = u64::from(u32_at(bytes, o + 4));
        if kind == EXT_END {
            break;
        }
        let data_at = off + 8;
        if len > end - data_at {
            return Err(FormatError::BadExtension {
                kind,
                offset: off,
                reason: format!(
                    "data length {len} runs past the end of the extension area at {end:#x}"
                ),
            });
        }
        let data = &bytes[data_at as usize..(data_at + len) as usize];
        let e = Extension::decode(kind, data, off, cluster_size)?;
        // A known extension given twice: the last one counts, as in QEMU (which overwrites
        // what it read before); a rewrite of cluster 0 keeps only that one.
        if !matches!(e, Extension::Unknown { .. }) {
            out.retain(|x| x.kind() != kind);
        }
        out.push(e);
        off = data_at + ((len + 7) & !7);
    }
    Ok(out)
}

pub(crate) fn decode_backing_name(
    bytes: &[u8],
    header: &Header,
    cluster_size: u64,
) -> Result<Option<Vec<u8>>> {
    if header.backing_file_offset == 0 {
        return Ok(None);
    }
    let len = u64::from(header.backing_file_size);
    if len > MAX_BACKING_NAME as u64 {
        return Err(FormatError::InvalidField {
            what: "backing_file_size",
            offset: 16,
            value: len,
            reason: format!("a backing file name is at most {MAX_BACKING_NAME} bytes"),
        });
    }
    let off = header.backing_file_offset;
    let end = off.saturating_add(len);
    if end > cluster_size {
        return Err(FormatError::InvalidField {
            what: "backing_file_offset",
            offset: 8,
            value: off,
            reason: format!(
                "the backing file name ({len} bytes) must end within cluster 0 ({cluster_size:#x} bytes)"
            ),
        });
    }
    if end > bytes.len() as u64 {
        return Err(FormatError::Truncated {
            what: "backing file name",
            offset: off,
            need: len,
            have: (bytes.len() as u64).saturating_sub(off),
        });
    }
    Ok(Some(bytes[off as usize..end as usize].to_vec()))
}

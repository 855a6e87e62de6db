//! Header extensions (the area after the header in cluster 0) and the backing file name.
//!
//! Each extension is `type: u32, len: u32, data[len]`, padded to a multiple of 8. Unknown
//! extensions are kept byte for byte and written back. The aggregate of everything in cluster 0
//! is [`crate::cluster0::Cluster0`].

use crate::be::u32_at;
use crate::bitmap::BitmapsExtension;
use crate::error::{FormatError, Result};
use crate::features::{FeatureName, decode_feature_table, encode_feature_table};
use crate::header::Header;

/// Kept so that `qimg_format::extensions::Cluster0` still names the aggregate, which now lives
/// in [`crate::cluster0`] (nothing in this module uses it: the dependency runs from `cluster0`
/// to here only).
pub use crate::cluster0::Cluster0;

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
        if !matches!(e, Extension::Unknown { .. }) && out.iter().any(|x| x.kind() == kind) {
            return Err(FormatError::BadExtension {
                kind,
                offset: off,
                reason: "this extension appears more than once".into(),
            });
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::be::pad8;
    use crate::features::{FeatureKind, qemu_feature_table};
    use proptest::prelude::*;

    fn arb_ext() -> impl Strategy<Value = Extension> {
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..15).prop_map(Extension::BackingFormat),
            proptest::collection::vec(any::<u8>(), 0..200).prop_map(Extension::DataFile),
            (0u64..1 << 40, any::<u64>()).prop_map(|(o, length)| Extension::Crypto {
                offset: o << 16,
                length
            }),
            Just(Extension::FeatureTable(qemu_feature_table())),
            (1u32..65536, any::<u64>(), 0u64..1 << 30).prop_map(|(n, size, o)| {
                Extension::Bitmaps(BitmapsExtension {
                    nb_bitmaps: n,
                    directory_size: size % (1024 * 65535) + 1,
                    directory_offset: o << 16,
                })
            }),
            (1u32.., proptest::collection::vec(any::<u8>(), 0..100)).prop_filter_map(
                "known type",
                |(kind, data)| {
                    let known = [
                        EXT_BACKING_FORMAT,
                        EXT_FEATURE_TABLE,
                        EXT_BITMAPS,
                        EXT_CRYPTO,
                        EXT_DATA_FILE,
                    ];
                    (!known.contains(&kind)).then_some(Extension::Unknown { kind, data })
                }
            ),
        ]
    }

    proptest! {
        #[test]
        fn cluster_zero_round_trips(
            exts in proptest::collection::vec(arb_ext(), 0..6),
            backing in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..300)),
            v3 in any::<bool>(),
        ) {
            // Each known extension at most once.
            let mut seen = Vec::new();
            let exts: Vec<_> = exts.into_iter().filter(|e| {
                if matches!(e, Extension::Unknown{..}) { return true; }
                let k = e.kind();
                if seen.contains(&k) { false } else { seen.push(k); true }
            }).collect();
            let header = if v3 { Header::new_v3(16, 1 << 30, 4) } else { Header::new_v2(16, 1 << 30) };
            let mut c = Cluster0 { header, extensions: exts, backing_file: backing };
            let bytes = c.encode().unwrap();
            let mut cluster = bytes.clone();
            cluster.resize(65536, 0xa5);
            prop_assert_eq!(Cluster0::decode(&cluster).unwrap(), c.clone());
            // A file exactly as long as the encoded bytes decodes too.
            if c.backing_file.is_some() {
                prop_assert_eq!(Cluster0::decode(&bytes).unwrap(), c);
            }
        }

        #[test]
        fn decoding_garbage_after_a_valid_header_never_panics(tail in proptest::collection::vec(any::<u8>(), 0..600)) {
            let mut bytes = Header::new_v3(9, 1 << 20, 4).encode().unwrap();
            bytes.extend_from_slice(&tail);
            let _ = Cluster0::decode(&bytes);
        }
    }

    fn image_with(exts: &[(u32, Vec<u8>)]) -> Vec<u8> {
        let mut b = Header::new_v3(16, 1 << 20, 4).encode().unwrap();
        for (k, d) in exts {
            b.extend_from_slice(&k.to_be_bytes());
            b.extend_from_slice(&(d.len() as u32).to_be_bytes());
            b.extend_from_slice(d);
            b.resize(pad8(b.len()), 0);
        }
        b.resize(65536, 0);
        b
    }

    #[test]
    fn an_extension_longer_than_the_area_is_refused() {
        let mut b = image_with(&[(0x1234, vec![1, 2, 3])]);
        b[116..120].copy_from_slice(&100_000u32.to_be_bytes());
        let err = Cluster0::decode(&b).unwrap_err().to_string();
        assert!(err.contains("0x00001234"), "{err}");
        assert!(err.contains("0x70"), "{err}");
        assert!(err.contains("100000"), "{err}");
    }

    #[test]
    fn unknown_extensions_are_kept_byte_for_byte() {
        let b = image_with(&[(0xcafe, vec![9; 13]), (EXT_BACKING_FORMAT, b"raw".to_vec())]);
        let mut c = Cluster0::decode(&b).unwrap();
        assert_eq!(
            c.extensions[0],
            Extension::Unknown {
                kind: 0xcafe,
                data: vec![9; 13]
            }
        );
        assert_eq!(c.backing_format(), Some(&b"raw"[..]));
        let again = c.encode().unwrap();
        assert_eq!(&again[..], &b[..again.len()]);
    }

    #[test]
    fn a_backing_format_of_16_bytes_is_refused() {
        let b = image_with(&[(EXT_BACKING_FORMAT, vec![b'x'; 16])]);
        let err = Cluster0::decode(&b).unwrap_err().to_string();
        assert!(err.contains("16 bytes"), "{err}");
    }

    #[test]
    fn a_duplicate_data_file_extension_is_refused() {
        let b = image_with(&[
            (EXT_DATA_FILE, b"a".to_vec()),
            (EXT_DATA_FILE, b"b".to_vec()),
        ]);
        let err = Cluster0::decode(&b).unwrap_err().to_string();
        assert!(err.contains("more than once"), "{err}");
    }

    #[test]
    fn a_crypto_pointer_of_the_wrong_length_or_alignment_is_refused() {
        let err = Cluster0::decode(&image_with(&[(EXT_CRYPTO, vec![0; 8])]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("8 bytes, expected 16"), "{err}");
        let mut d = 0x1200u64.to_be_bytes().to_vec();
        d.extend_from_slice(&[0; 8]);
        let err = Cluster0::decode(&image_with(&[(EXT_CRYPTO, d)]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("0x1200"), "{err}");
    }

    #[test]
    fn a_backing_name_beyond_cluster_zero_is_refused() {
        let mut b = image_with(&[]);
        b[8..16].copy_from_slice(&65530u64.to_be_bytes());
        b[16..20].copy_from_slice(&10u32.to_be_bytes());
        let err = Cluster0::decode(&b).unwrap_err().to_string();
        assert!(err.contains("backing_file_offset 65530"), "{err}");
        b[16..20].copy_from_slice(&1024u32.to_be_bytes());
        let err = Cluster0::decode(&b).unwrap_err().to_string();
        assert!(err.contains("backing_file_size 1024"), "{err}");
    }

    #[test]
    fn extensions_sort_into_qemu_order() {
        let mut c = Cluster0 {
            header: Header::new_v3(16, 0, 4),
            extensions: vec![
                Extension::Unknown {
                    kind: 7,
                    data: vec![],
                },
                Extension::FeatureTable(vec![FeatureName::new(FeatureKind::Compatible, 0, "x")]),
                Extension::DataFile(b"d".to_vec()),
                Extension::BackingFormat(b"raw".to_vec()),
            ],
            backing_file: None,
        };
        c.sort_like_qemu();
        let kinds: Vec<u32> = c.extensions.iter().map(Extension::kind).collect();
        assert_eq!(
            kinds,
            vec![EXT_BACKING_FORMAT, EXT_DATA_FILE, EXT_FEATURE_TABLE, 7]
        );
    }

    #[test]
    fn cluster_zero_that_overflows_is_refused() {
        let mut c = Cluster0 {
            header: Header::new_v3(9, 0, 4),
            extensions: vec![Extension::FeatureTable(qemu_feature_table())],
            backing_file: Some(b"base".to_vec()),
        };
        let err = c.encode().unwrap_err().to_string();
        assert!(err.contains("cluster size 512"), "{err}");
    }
}

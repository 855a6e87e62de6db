//! [`Cluster0`]: everything stored in cluster 0 (header, header extensions, backing file name),
//! decoded and encoded as one aggregate. It sits above `header`, `extensions`, `features` and
//! `bitmap`, which do not import it, so the format modules form no cycle.

use crate::be::pad8;
use crate::bitmap::BitmapsExtension;
use crate::error::{FormatError, Result};
use crate::extension::{Extension, MAX_BACKING_NAME, decode_backing_name, decode_extensions};
use crate::features::FeatureName;
use crate::header::Header;

/// Everything stored in cluster 0: header, extensions and backing file name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cluster0 {
    /// The header.
    pub header: Header,
    /// Extensions in the order they were found (or are to be written).
    pub extensions: Vec<Extension>,
    /// Backing file name (raw bytes, not NUL-terminated), if any.
    pub backing_file: Option<Vec<u8>>,
}

impl Cluster0 {
    /// Decodes header, extensions and backing file name from `bytes`, the start of the file
    /// (normally all of cluster 0; fewer bytes are fine when the file is shorter).
    ///
    /// Extension parsing follows QEMU: it runs from `header_length` up to the backing file name
    /// (or the end of cluster 0) and stops at an end marker. An extension running past the area,
    /// or a backing name that does not fit in cluster 0 is an error; of a known extension given
    /// twice the last counts, as in QEMU.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let header = Header::decode(bytes)?;
        let cluster_size = header.cluster_size().ok_or(FormatError::InvalidField {
            what: "cluster_bits",
            offset: 20,
            value: u64::from(header.cluster_bits),
            reason: "a cluster size must fit in 64 bits".into(),
        })?;
        let extensions = decode_extensions(bytes, &header, cluster_size)?;
        let backing_file = decode_backing_name(bytes, &header, cluster_size)?;
        Ok(Self {
            header,
            extensions,
            backing_file,
        })
    }

    /// The backing format name, if the extension is present.
    pub fn backing_format(&self) -> Option<&[u8]> {
        self.extensions.iter().find_map(|e| match e {
            Extension::BackingFormat(f) => Some(f.as_slice()),
            _ => None,
        })
    }

    /// The external data file name, if the extension is present.
    pub fn data_file(&self) -> Option<&[u8]> {
        self.extensions.iter().find_map(|e| match e {
            Extension::DataFile(f) => Some(f.as_slice()),
            _ => None,
        })
    }

    /// The feature name table (empty when absent).
    pub fn feature_table(&self) -> &[FeatureName] {
        self.extensions
            .iter()
            .find_map(|e| match e {
                Extension::FeatureTable(t) => Some(t.as_slice()),
                _ => None,
            })
            .unwrap_or(&[])
    }

    /// The bitmaps extension, if present.
    pub fn bitmaps(&self) -> Option<&BitmapsExtension> {
        self.extensions.iter().find_map(|e| match e {
            Extension::Bitmaps(b) => Some(b),
            _ => None,
        })
    }

    /// Points the header at a bitmap directory (the extension, in QEMU's order, and
    /// autoclear bit 0 set), or at none (`None`: no extension, the bit clear).
    pub fn set_bitmaps(&mut self, ext: Option<BitmapsExtension>) {
        self.extensions
            .retain(|e| !matches!(e, Extension::Bitmaps(_)));
        match ext {
            Some(b) => {
                self.extensions.push(Extension::Bitmaps(b));
                self.sort_like_qemu();
                self.header.autoclear_features |= crate::features::AUTOCLEAR_BITMAPS;
            }
            None => self.header.autoclear_features &= !crate::features::AUTOCLEAR_BITMAPS,
        }
    }

    /// Sorts the extensions into the order QEMU writes them (stable among unknown ones).
    pub fn sort_like_qemu(&mut self) {
        self.extensions.sort_by_key(Extension::qemu_rank);
    }

    /// Encodes cluster 0 up to the end of the backing file name, updating
    /// `backing_file_offset`/`backing_file_size` in the header to where the name lands.
    /// The extensions are written in their current order, then an end marker, then the name.
    /// Fails when the result would not fit in one cluster.
    pub fn encode(&mut self) -> Result<Vec<u8>> {
        let cluster_size = self.header.cluster_size().unwrap_or(0);
        let mut ext = Vec::new();
        for e in &self.extensions {
            let data = e.data();
            let len = u32::try_from(data.len()).map_err(|_| FormatError::Overflow {
                what: "header extension length",
                reason: format!("{} bytes do not fit in 32 bits", data.len()),
            })?;
            ext.extend_from_slice(&e.kind().to_be_bytes());
            ext.extend_from_slice(&len.to_be_bytes());
            ext.extend_from_slice(&data);
            ext.resize(pad8(ext.len()), 0);
        }
        ext.extend_from_slice(&[0u8; 8]);
        let name_at = u64::from(self.header.header_length) + ext.len() as u64;
        match &self.backing_file {
            Some(name) => {
                if name.len() > MAX_BACKING_NAME {
                    return Err(FormatError::InvalidField {
                        what: "backing_file_size",
                        offset: 16,
                        value: name.len() as u64,
                        reason: format!("a backing file name is at most {MAX_BACKING_NAME} bytes"),
                    });
                }
                self.header.backing_file_offset = name_at;
                self.header.backing_file_size = name.len() as u32;
            }
            None => {
                self.header.backing_file_offset = 0;
                self.header.backing_file_size = 0;
            }
        }
        let mut out = self.header.encode()?;
        out.extend_from_slice(&ext);
        if let Some(name) = &self.backing_file {
            out.extend_from_slice(name);
        }
        if out.len() as u64 > cluster_size {
            return Err(FormatError::Overflow {
                what: "cluster 0",
                reason: format!(
                    "header, extensions and backing name take {} bytes, more than the cluster size {cluster_size}",
                    out.len()
                ),
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::be::pad8;
    use crate::extension::{
        EXT_BACKING_FORMAT, EXT_BITMAPS, EXT_CRYPTO, EXT_DATA_FILE, EXT_FEATURE_TABLE,
    };
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
    fn of_a_known_extension_given_twice_the_last_counts() {
        let b = image_with(&[
            (EXT_DATA_FILE, b"a".to_vec()),
            (EXT_BACKING_FORMAT, b"raw".to_vec()),
            (EXT_DATA_FILE, b"b".to_vec()),
            (EXT_BACKING_FORMAT, b"qcow2".to_vec()),
        ]);
        let mut c0 = Cluster0::decode(&b).unwrap();
        assert_eq!(c0.data_file(), Some(&b"b"[..]));
        assert_eq!(c0.backing_format(), Some(&b"qcow2"[..]));
        assert_eq!(c0.extensions.len(), 2);
        // Written back, each once.
        let again = Cluster0::decode(&c0.encode().unwrap()).unwrap();
        assert_eq!(again.extensions, c0.extensions);
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

//! The qcow2 header (cluster 0, bytes 0 to `header_length`).
//!
//! Decoding checks only what is needed to read the fields (magic, version, length); the
//! open-time rules QEMU applies, in QEMU's order, live in [`crate::validate`].

use crate::be::{u32_at, u64_at};
use crate::error::{FormatError, Result};
use crate::features::{INCOMPAT_COMPRESSION, INCOMPAT_EXTENDED_L2};

/// `QFI\xfb`.
pub const MAGIC: u32 = 0x5146_49fb;

/// Whether `bytes` start with the qcow2 magic (`QFI\xfb`): how a file is recognised as qcow2.
pub fn has_magic(bytes: &[u8]) -> bool {
    bytes.len() >= 4 && bytes[..4] == MAGIC.to_be_bytes()
}
/// Whether a file starting with `bytes` is taken for qcow2 when no format is named: the
/// magic and a version other than 0 (bytes past the end of a short file read as zeros). QEMU's
/// probe wants version 2 or 3 for qcow2 and takes version 1 for its older qcow format, which
/// qimg does not read: such a file is named as an unsupported qcow2 version rather than
/// taken for raw; a version 0 file (or one of only the magic) is raw to both.
pub fn probes_as_qcow2(bytes: &[u8]) -> bool {
    let mut version = [0u8; 4];
    for (i, b) in bytes.iter().skip(4).take(4).enumerate() {
        version[i] = *b;
    }
    has_magic(bytes) && u32::from_be_bytes(version) != 0
}
/// Length of a version 2 header.
pub const V2_HEADER_LEN: u32 = 72;
/// Smallest legal version 3 header.
pub const V3_MIN_HEADER_LEN: u32 = 104;
/// Offset of the `compression_type` additional field.
pub const COMPRESSION_TYPE_OFFSET: u32 = 104;
/// The header length QEMU writes for version 3 (with the compression type field).
pub const QEMU_V3_HEADER_LEN: u32 = 112;

/// Compression algorithm of compressed clusters (header byte 104).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CompressionType {
    /// Raw deflate, window bits 12 (type 0, the default).
    Zlib,
    /// Zstandard frames (type 1).
    Zstd,
}

impl CompressionType {
    /// The name qemu-img uses (`zlib`, `zstd`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Zlib => "zlib",
            Self::Zstd => "zstd",
        }
    }

    /// The on-disk byte.
    pub fn to_byte(self) -> u8 {
        match self {
            Self::Zlib => 0,
            Self::Zstd => 1,
        }
    }
}

/// A decoded qcow2 header, version 2 or 3.
///
/// Fields that do not exist in version 2 hold the values the specification implies
/// (`refcount_order` 4, `header_length` 72, no features).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// 2 or 3.
    pub version: u32,
    /// File offset of the backing file name, 0 when there is none.
    pub backing_file_offset: u64,
    /// Length of the backing file name in bytes.
    pub backing_file_size: u32,
    /// log2 of the cluster size.
    pub cluster_bits: u32,
    /// Virtual disk size in bytes.
    pub size: u64,
    /// 0 none, 1 AES-CBC, 2 LUKS.
    pub crypt_method: u32,
    /// Entries in the active L1 table.
    pub l1_size: u32,
    /// File offset of the active L1 table.
    pub l1_table_offset: u64,
    /// File offset of the refcount table.
    pub refcount_table_offset: u64,
    /// Size of the refcount table in clusters.
    pub refcount_table_clusters: u32,
    /// Number of internal snapshots.
    pub nb_snapshots: u32,
    /// File offset of the snapshot table.
    pub snapshots_offset: u64,
    /// Incompatible feature bits (v3).
    pub incompatible_features: u64,
    /// Compatible feature bits (v3).
    pub compatible_features: u64,
    /// Autoclear feature bits (v3).
    pub autoclear_features: u64,
    /// `refcount_bits = 1 << refcount_order`.
    pub refcount_order: u32,
    /// Header length in bytes (72 for v2).
    pub header_length: u32,
    /// Bytes 104 up to `header_length` when `header_length > 104`: byte 104 is
    /// `compression_type`, the rest is padding or fields unknown to us, kept byte for byte.
    pub additional: Vec<u8>,
}

impl Header {
    /// A fresh version 3 header as QEMU writes it (length 112), with everything else zero.
    pub fn new_v3(cluster_bits: u32, size: u64, refcount_order: u32) -> Self {
        Self {
            version: 3,
            backing_file_offset: 0,
            backing_file_size: 0,
            cluster_bits,
            size,
            crypt_method: 0,
            l1_size: 0,
            l1_table_offset: 0,
            refcount_table_offset: 0,
            refcount_table_clusters: 0,
            nb_snapshots: 0,
            snapshots_offset: 0,
            incompatible_features: 0,
            compatible_features: 0,
            autoclear_features: 0,
            refcount_order,
            header_length: QEMU_V3_HEADER_LEN,
            additional: vec![0; (QEMU_V3_HEADER_LEN - COMPRESSION_TYPE_OFFSET) as usize],
        }
    }

    /// A fresh version 2 header (length 72, refcount order 4).
    pub fn new_v2(cluster_bits: u32, size: u64) -> Self {
        Self {
            version: 2,
            header_length: V2_HEADER_LEN,
            refcount_order: 4,
            additional: Vec::new(),
            ..Self::new_v3(cluster_bits, size, 4)
        }
    }

    /// Decodes a header from the start of the image. `bytes` may be longer than the header
    /// (typically all of cluster 0). Fails on a bad magic, an unknown version, or a length
    /// that is too small or runs past `bytes`.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let have = bytes.len() as u64;
        let truncated = |need: u64| FormatError::Truncated {
            what: "qcow2 header",
            offset: 0,
            need,
            have,
        };
        if bytes.len() < 8 {
            if bytes.len() >= 4 && u32_at(bytes, 0) != MAGIC {
                return Err(FormatError::BadMagic {
                    found: u32_at(bytes, 0),
                });
            }
            return Err(truncated(u64::from(V2_HEADER_LEN)));
        }
        let magic = u32_at(bytes, 0);
        if magic != MAGIC {
            return Err(FormatError::BadMagic { found: magic });
        }
        let version = u32_at(bytes, 4);
        if version != 2 && version != 3 {
            return Err(FormatError::UnsupportedVersion { version });
        }
        let fixed = if version == 2 {
            V2_HEADER_LEN
        } else {
            V3_MIN_HEADER_LEN
        } as usize;
        if bytes.len() < fixed {
            return Err(truncated(fixed as u64));
        }
        let mut h = Self {
            version,
            backing_file_offset: u64_at(bytes, 8),
            backing_file_size: u32_at(bytes, 16),
            cluster_bits: u32_at(bytes, 20),
            size: u64_at(bytes, 24),
            crypt_method: u32_at(bytes, 32),
            l1_size: u32_at(bytes, 36),
            l1_table_offset: u64_at(bytes, 40),
            refcount_table_offset: u64_at(bytes, 48),
            refcount_table_clusters: u32_at(bytes, 56),
            nb_snapshots: u32_at(bytes, 60),
            snapshots_offset: u64_at(bytes, 64),
            incompatible_features: 0,
            compatible_features: 0,
            autoclear_features: 0,
            refcount_order: 4,
            header_length: V2_HEADER_LEN,
            additional: Vec::new(),
        };
        if version == 3 {
            h.incompatible_features = u64_at(bytes, 72);
            h.compatible_features = u64_at(bytes, 80);
            h.autoclear_features = u64_at(bytes, 88);
            h.refcount_order = u32_at(bytes, 96);
            h.header_length = u32_at(bytes, 100);
            if h.header_length < V3_MIN_HEADER_LEN {
                return Err(FormatError::InvalidField {
                    what: "header_length",
                    offset: 100,
                    value: u64::from(h.header_length),
                    reason: format!("a version 3 header is at least {V3_MIN_HEADER_LEN} bytes"),
                });
            }
            let len = h.header_length as usize;
            if bytes.len() < len {
                return Err(truncated(len as u64));
            }
            h.additional = bytes[V3_MIN_HEADER_LEN as usize..len].to_vec();
        }
        Ok(h)
    }

    /// Encodes the header: exactly `header_length` bytes (72 for v2).
    ///
    /// Fails when `header_length` disagrees with the version or the additional bytes.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let len = self.encoded_len()?;
        let mut b = Vec::with_capacity(len);
        b.extend_from_slice(&MAGIC.to_be_bytes());
        b.extend_from_slice(&self.version.to_be_bytes());
        b.extend_from_slice(&self.backing_file_offset.to_be_bytes());
        b.extend_from_slice(&self.backing_file_size.to_be_bytes());
        b.extend_from_slice(&self.cluster_bits.to_be_bytes());
        b.extend_from_slice(&self.size.to_be_bytes());
        b.extend_from_slice(&self.crypt_method.to_be_bytes());
        b.extend_from_slice(&self.l1_size.to_be_bytes());
        b.extend_from_slice(&self.l1_table_offset.to_be_bytes());
        b.extend_from_slice(&self.refcount_table_offset.to_be_bytes());
        b.extend_from_slice(&self.refcount_table_clusters.to_be_bytes());
        b.extend_from_slice(&self.nb_snapshots.to_be_bytes());
        b.extend_from_slice(&self.snapshots_offset.to_be_bytes());
        if self.version == 3 {
            b.extend_from_slice(&self.incompatible_features.to_be_bytes());
            b.extend_from_slice(&self.compatible_features.to_be_bytes());
            b.extend_from_slice(&self.autoclear_features.to_be_bytes());
            b.extend_from_slice(&self.refcount_order.to_be_bytes());
            b.extend_from_slice(&self.header_length.to_be_bytes());
            b.extend_from_slice(&self.additional);
        }
        debug_assert_eq!(b.len(), len);
        Ok(b)
    }

    fn encoded_len(&self) -> Result<usize> {
        match self.version {
            2 => {
                if self.header_length != V2_HEADER_LEN || !self.additional.is_empty() {
                    return Err(FormatError::InvalidField {
                        what: "header_length",
                        offset: 100,
                        value: u64::from(self.header_length),
                        reason: "a version 2 header is exactly 72 bytes".into(),
                    });
                }
                Ok(V2_HEADER_LEN as usize)
            }
            3 => {
                let want = V3_MIN_HEADER_LEN as usize + self.additional.len();
                if self.header_length as usize != want {
                    return Err(FormatError::InvalidField {
                        what: "header_length",
                        offset: 100,
                        value: u64::from(self.header_length),
                        reason: format!("does not match the {} bytes the header holds", want),
                    });
                }
                Ok(want)
            }
            v => Err(FormatError::UnsupportedVersion { version: v }),
        }
    }

    /// Cluster size in bytes (`1 << cluster_bits`), or `None` when `cluster_bits` is absurd.
    pub fn cluster_size(&self) -> Option<u64> {
        1u64.checked_shl(self.cluster_bits)
    }

    /// The raw `compression_type` byte: 0 when the field is absent.
    pub fn compression_type_byte(&self) -> u8 {
        self.additional.first().copied().unwrap_or(0)
    }

    /// The compression type, when the byte is one this implementation knows.
    pub fn compression_type(&self) -> Option<CompressionType> {
        match self.compression_type_byte() {
            0 => Some(CompressionType::Zlib),
            1 => Some(CompressionType::Zstd),
            _ => None,
        }
    }

    /// Sets the compression type, growing a v3 header to 112 bytes if needed and keeping
    /// incompatible bit 3 consistent with the field.
    pub fn set_compression_type(&mut self, t: CompressionType) {
        if self.version != 3 {
            return;
        }
        if self.additional.is_empty() {
            self.additional = vec![0; (QEMU_V3_HEADER_LEN - COMPRESSION_TYPE_OFFSET) as usize];
            self.header_length = QEMU_V3_HEADER_LEN;
        }
        self.additional[0] = t.to_byte();
        if t == CompressionType::Zlib {
            self.incompatible_features &= !INCOMPAT_COMPRESSION;
        } else {
            self.incompatible_features |= INCOMPAT_COMPRESSION;
        }
    }

    /// Whether the image uses 128-bit extended L2 entries.
    pub fn extended_l2(&self) -> bool {
        self.incompatible_features & INCOMPAT_EXTENDED_L2 != 0
    }

    /// Refcount width in bits, or `None` when `refcount_order` is out of range.
    pub fn refcount_bits(&self) -> Option<u32> {
        if self.refcount_order <= 6 {
            Some(1 << self.refcount_order)
        } else {
            None
        }
    }

    /// Where the header extension area starts (`header_length`, 72 for v2).
    pub fn extensions_start(&self) -> u64 {
        u64::from(self.header_length)
    }
}

/// Byte offsets in the header of the fields tools rewrite in place (qcow2-format.md section 1).
pub mod field {
    /// `size` (u64): the virtual disk size.
    pub const SIZE: u64 = 24;
    /// `l1_size` (u32), followed by `l1_table_offset` (u64) at 40.
    pub const L1_TABLE: u64 = 36;
    /// `refcount_table_offset` (u64), followed by `refcount_table_clusters` (u32) at 56.
    pub const REFCOUNT_TABLE: u64 = 48;
    /// `nb_snapshots` (u32), followed by `snapshots_offset` (u64) at 64.
    pub const SNAPSHOTS: u64 = 60;
    /// Bytes of the snapshot table pointer (`nb_snapshots` and `snapshots_offset`).
    pub const SNAPSHOTS_LEN: usize = 12;
    /// `incompatible_features` (u64, version 3).
    pub const INCOMPATIBLE_FEATURES: u64 = 72;
    /// `compatible_features` (u64, version 3).
    pub const COMPATIBLE_FEATURES: u64 = 80;
    /// `autoclear_features` (u64, version 3).
    pub const AUTOCLEAR_FEATURES: u64 = 88;
}

/// The bytes of `incompatible_features`, to be written at [`field::INCOMPATIBLE_FEATURES`].
pub fn encode_incompatible(bits: u64) -> [u8; 8] {
    bits.to_be_bytes()
}

/// The bytes of `size`, to be written at [`field::SIZE`].
pub fn encode_size(size: u64) -> [u8; 8] {
    size.to_be_bytes()
}

/// The bytes of the L1 table pointer (`l1_size` and `l1_table_offset`), to be written at
/// [`field::L1_TABLE`].
pub fn encode_l1_table_pointer(entries: u32, offset: u64) -> [u8; 12] {
    let mut b = [0u8; 12];
    b[..4].copy_from_slice(&entries.to_be_bytes());
    b[4..].copy_from_slice(&offset.to_be_bytes());
    b
}

/// The bytes of `autoclear_features`, to be written at [`field::AUTOCLEAR_FEATURES`].
pub fn encode_autoclear(bits: u64) -> [u8; 8] {
    bits.to_be_bytes()
}

/// The bytes of the refcount table pointer (`refcount_table_offset` and
/// `refcount_table_clusters`), to be written at [`field::REFCOUNT_TABLE`].
pub fn encode_refcount_table_pointer(offset: u64, clusters: u32) -> [u8; 12] {
    let mut b = [0u8; 12];
    b[..8].copy_from_slice(&offset.to_be_bytes());
    b[8..].copy_from_slice(&clusters.to_be_bytes());
    b
}

/// The snapshot table pointer of the header: where the table is and how many entries it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SnapshotPointer {
    /// `nb_snapshots`.
    pub nb_snapshots: u32,
    /// `snapshots_offset`.
    pub snapshots_offset: u64,
}

impl SnapshotPointer {
    /// Decodes the [`field::SNAPSHOTS_LEN`] bytes at [`field::SNAPSHOTS`].
    pub fn decode(bytes: &[u8; field::SNAPSHOTS_LEN]) -> Self {
        Self {
            nb_snapshots: u32_at(bytes, 0),
            snapshots_offset: u64_at(bytes, 4),
        }
    }

    /// The bytes of `nb_snapshots` alone, to be written at [`field::SNAPSHOTS`].
    pub fn encode_count(nb_snapshots: u32) -> [u8; 4] {
        nb_snapshots.to_be_bytes()
    }

    /// Encodes the pointer (the inverse of [`decode`](Self::decode)).
    pub fn encode(&self) -> [u8; field::SNAPSHOTS_LEN] {
        let mut b = [0u8; field::SNAPSHOTS_LEN];
        b[..4].copy_from_slice(&self.nb_snapshots.to_be_bytes());
        b[4..].copy_from_slice(&self.snapshots_offset.to_be_bytes());
        b
    }

    /// Zeroes the snapshot table pointer inside the start of an image, `bytes`, if it reaches
    /// that far: for validating a header whose snapshot table is looked at separately.
    pub fn clear_in(bytes: &mut [u8]) {
        let at = field::SNAPSHOTS as usize;
        if let Some(p) = bytes.get_mut(at..at + field::SNAPSHOTS_LEN) {
            p.fill(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_probe_wants_the_magic_and_a_version() {
        assert!(probes_as_qcow2(b"QFI\xfb\0\0\0\x03"));
        assert!(probes_as_qcow2(b"QFI\xfb\0\0\0\x02rest"));
        assert!(probes_as_qcow2(b"QFI\xfb\0\0\0\x01"));
        // Version 0, or a file of only the magic (zeros past its end): raw, as QEMU's probe.
        assert!(!probes_as_qcow2(b"QFI\xfb\0\0\0\0"));
        assert!(!probes_as_qcow2(b"QFI\xfb"));
        assert!(!probes_as_qcow2(b"QFI\xfb\0\0"));
        assert!(!probes_as_qcow2(b"\0\0\0\0\0\0\0\x03"));
    }

    #[test]
    fn the_magic_is_recognised_in_the_first_four_bytes_only() {
        assert!(has_magic(b"QFI\xfb"));
        assert!(has_magic(b"QFI\xfb\0\0\0\x03"));
        assert!(!has_magic(b"QFI"));
        assert!(!has_magic(b"\0QFI\xfb"));
        assert!(!has_magic(b""));
    }

    pub(crate) fn arb_header() -> impl Strategy<Value = Header> {
        let v2 = (any::<[u64; 6]>(), any::<[u32; 6]>()).prop_map(|(a, b)| Header {
            backing_file_offset: a[0],
            size: a[1],
            l1_table_offset: a[2],
            refcount_table_offset: a[3],
            snapshots_offset: a[4],
            backing_file_size: b[0],
            cluster_bits: b[1],
            crypt_method: b[2],
            l1_size: b[3],
            refcount_table_clusters: b[4],
            nb_snapshots: b[5],
            ..Header::new_v2(16, 0)
        });
        let v3 = (
            v2.clone(),
            any::<[u64; 3]>(),
            any::<u32>(),
            proptest::collection::vec(any::<u8>(), 0..40),
        )
            .prop_map(|(base, f, order, extra)| {
                // header_length is a multiple of 8 in valid images: 104 + 8k bytes.
                let extra_len = extra.len() / 8 * 8;
                Header {
                    version: 3,
                    incompatible_features: f[0],
                    compatible_features: f[1],
                    autoclear_features: f[2],
                    refcount_order: order,
                    header_length: V3_MIN_HEADER_LEN + extra_len as u32,
                    additional: extra[..extra_len].to_vec(),
                    ..base
                }
            });
        prop_oneof![v2, v3]
    }

    proptest! {
        #[test]
        fn headers_round_trip(h in arb_header(), trailing in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut bytes = h.encode().unwrap();
            prop_assert_eq!(bytes.len(), h.header_length as usize);
            bytes.extend_from_slice(&trailing);
            prop_assert_eq!(Header::decode(&bytes).unwrap(), h);
        }

        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = Header::decode(&bytes);
        }
    }

    #[test]
    fn unknown_trailing_header_bytes_are_preserved() {
        let mut h = Header::new_v3(16, 1 << 20, 4);
        h.additional = vec![1, 0, 0, 0, 0, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4];
        h.header_length = 120;
        let bytes = h.encode().unwrap();
        assert_eq!(&bytes[112..120], &[0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4]);
        let back = Header::decode(&bytes).unwrap();
        assert_eq!(back.compression_type(), Some(CompressionType::Zstd));
        assert_eq!(back.additional, h.additional);
    }

    #[test]
    fn a_bad_magic_is_named() {
        let mut b = Header::new_v3(16, 0, 4).encode().unwrap();
        b[0] = 0x7f;
        let err = Header::decode(&b).unwrap_err().to_string();
        assert!(err.contains("0x7f4649fb"), "{err}");
    }

    #[test]
    fn version_4_is_refused_naming_it() {
        let mut b = Header::new_v3(16, 0, 4).encode().unwrap();
        b[7] = 4;
        let err = Header::decode(&b).unwrap_err().to_string();
        assert!(err.contains("version 4"), "{err}");
    }

    #[test]
    fn a_truncated_header_names_what_it_needs() {
        let b = Header::new_v3(16, 0, 4).encode().unwrap();
        let err = Header::decode(&b[..90]).unwrap_err().to_string();
        assert!(err.contains("needs 104 bytes"), "{err}");
        assert!(err.contains("only 90"), "{err}");
        let err = Header::decode(&b[..106]).unwrap_err().to_string();
        assert!(err.contains("needs 112 bytes"), "{err}");
        assert!(Header::decode(&b[..3]).is_err());
        assert!(Header::decode(&[]).is_err());
    }

    #[test]
    fn a_v3_header_shorter_than_104_bytes_is_refused() {
        let mut b = Header::new_v3(16, 0, 4).encode().unwrap();
        b[100..104].copy_from_slice(&96u32.to_be_bytes());
        let err = Header::decode(&b).unwrap_err().to_string();
        assert!(err.contains("header_length 96"), "{err}");
        assert!(err.contains("0x64"), "{err}");
    }

    #[test]
    fn compression_type_keeps_bit_3_in_step() {
        let mut h = Header::new_v3(16, 0, 4);
        h.set_compression_type(CompressionType::Zstd);
        assert_eq!(h.incompatible_features, INCOMPAT_COMPRESSION);
        assert_eq!(h.encode().unwrap()[104], 1);
        h.set_compression_type(CompressionType::Zlib);
        assert_eq!(h.incompatible_features, 0);
    }

    #[test]
    fn a_v2_header_is_exactly_72_bytes() {
        let h = Header::new_v2(16, 1 << 30);
        assert_eq!(h.encode().unwrap().len(), 72);
        assert_eq!(h.refcount_bits(), Some(16));
    }

    #[test]
    fn in_place_field_encoders_match_the_header_layout() {
        let mut h = Header::new_v3(16, 1 << 30, 4);
        h.incompatible_features = 0x11;
        h.autoclear_features = 0x1;
        h.refcount_table_offset = 0x1_0000;
        h.refcount_table_clusters = 3;
        h.nb_snapshots = 7;
        h.snapshots_offset = 0x9_0000;
        h.l1_size = 5;
        h.l1_table_offset = 0x3_0000;
        let b = h.encode().unwrap();
        let at = |o: u64, n: usize| b[o as usize..o as usize + n].to_vec();
        assert_eq!(
            at(field::INCOMPATIBLE_FEATURES, 8),
            encode_incompatible(0x11)
        );
        assert_eq!(at(field::AUTOCLEAR_FEATURES, 8), encode_autoclear(1));
        assert_eq!(at(field::SIZE, 8), encode_size(1 << 30));
        assert_eq!(
            at(field::L1_TABLE, 12),
            encode_l1_table_pointer(5, 0x3_0000)
        );
        assert_eq!(
            at(field::REFCOUNT_TABLE, 12),
            encode_refcount_table_pointer(0x1_0000, 3)
        );
        let mut p = [0u8; field::SNAPSHOTS_LEN];
        p.copy_from_slice(&at(field::SNAPSHOTS, field::SNAPSHOTS_LEN));
        let sp = SnapshotPointer::decode(&p);
        assert_eq!((sp.nb_snapshots, sp.snapshots_offset), (7, 0x9_0000));
        assert_eq!(sp.encode(), p);
        assert_eq!(SnapshotPointer::encode_count(7), p[..4]);
        let mut c = b.clone();
        SnapshotPointer::clear_in(&mut c);
        let d = Header::decode(&c).unwrap();
        assert_eq!((d.nb_snapshots, d.snapshots_offset), (0, 0));
        SnapshotPointer::clear_in(&mut [0u8; 10]);
    }

    proptest::proptest! {
        #[test]
        fn snapshot_pointers_round_trip(nb in proptest::prelude::any::<u32>(), off in proptest::prelude::any::<u64>()) {
            let p = SnapshotPointer { nb_snapshots: nb, snapshots_offset: off };
            proptest::prop_assert_eq!(SnapshotPointer::decode(&p.encode()), p);
        }
    }
}

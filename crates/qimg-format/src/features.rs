//! Feature bits (header bytes 72–95) and the feature name table extension (0x6803F857).

use crate::error::{FormatError, Result};

/// Incompatible bit 0: refcounts may be inconsistent.
pub const INCOMPAT_DIRTY: u64 = 1 << 0;
/// Incompatible bit 1: the image may be corrupt; write only to repair.
pub const INCOMPAT_CORRUPT: u64 = 1 << 1;
/// Incompatible bit 2: guest data lives in an external data file.
pub const INCOMPAT_DATA_FILE: u64 = 1 << 2;
/// Incompatible bit 3: a non-default compression type is in use.
pub const INCOMPAT_COMPRESSION: u64 = 1 << 3;
/// Incompatible bit 4: 128-bit extended L2 entries with subcluster bitmaps.
pub const INCOMPAT_EXTENDED_L2: u64 = 1 << 4;
/// Every incompatible bit this implementation understands.
pub const INCOMPAT_KNOWN: u64 = 0x1f;

/// Compatible bit 0: lazy refcounts may be used.
pub const COMPAT_LAZY_REFCOUNTS: u64 = 1 << 0;
/// Every compatible bit this implementation understands.
pub const COMPAT_KNOWN: u64 = 0x1;

/// Autoclear bit 0: the bitmaps extension is consistent.
pub const AUTOCLEAR_BITMAPS: u64 = 1 << 0;
/// Autoclear bit 1: the external data file is a consistent standalone raw image.
pub const AUTOCLEAR_DATA_FILE_RAW: u64 = 1 << 1;
/// Every autoclear bit this implementation understands.
pub const AUTOCLEAR_KNOWN: u64 = 0x3;

/// The autoclear bits a writer may leave set when it opens an image for writing: a writer
/// that does not know a bit cannot keep what it stands for consistent, so the specification
/// has it clear the unknown ones before its first write (QEMU does at every read-write open).
/// `maintains_bitmaps` says whether the writer keeps the bitmaps extension up to date.
pub fn autoclear_for_writer(bits: u64, maintains_bitmaps: bool) -> u64 {
    let kept = bits & AUTOCLEAR_KNOWN;
    match maintains_bitmaps {
        true => kept,
        false => kept & !AUTOCLEAR_BITMAPS,
    }
}

/// Size of one feature name table entry.
pub const FEATURE_NAME_ENTRY_LEN: usize = 48;
/// Bytes available for the name in a feature name table entry.
pub const FEATURE_NAME_LEN: usize = 46;

/// Which of the three feature bitmaps a bit belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FeatureKind {
    /// Unknown set bits refuse the image.
    Incompatible,
    /// Unknown set bits may be ignored.
    Compatible,
    /// Unknown set bits must be cleared by a writer that does not know them.
    Autoclear,
}

impl FeatureKind {
    fn from_byte(b: u8) -> Option<Self> {
        match b {
            0 => Some(Self::Incompatible),
            1 => Some(Self::Compatible),
            2 => Some(Self::Autoclear),
            _ => None,
        }
    }

    fn to_byte(self) -> u8 {
        match self {
            Self::Incompatible => 0,
            Self::Compatible => 1,
            Self::Autoclear => 2,
        }
    }
}

/// One entry of the feature name table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeatureName {
    /// Bitmap the bit belongs to. Entries of an unknown type are kept in `raw_kind`.
    pub kind: Option<FeatureKind>,
    /// The raw type byte (0 incompatible, 1 compatible, 2 autoclear, others unknown).
    pub raw_kind: u8,
    /// Bit number, 0 to 63 (other values are kept as read).
    pub bit: u8,
    /// The name, exactly the 46 bytes on disk (zero padded).
    pub name: [u8; FEATURE_NAME_LEN],
}

impl FeatureName {
    /// Builds an entry from a kind, a bit and a name (truncated to 46 bytes).
    pub fn new(kind: FeatureKind, bit: u8, name: &str) -> Self {
        let mut n = [0u8; FEATURE_NAME_LEN];
        let src = name.as_bytes();
        let len = src.len().min(FEATURE_NAME_LEN);
        n[..len].copy_from_slice(&src[..len]);
        Self {
            kind: Some(kind),
            raw_kind: kind.to_byte(),
            bit,
            name: n,
        }
    }

    /// The name up to its first NUL byte, lossily converted to UTF-8.
    pub fn name_str(&self) -> String {
        let end = self
            .name
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(FEATURE_NAME_LEN);
        String::from_utf8_lossy(&self.name[..end]).into_owned()
    }
}

/// The table QEMU writes into v3 images with clusters larger than 4 KiB.
pub fn qemu_feature_table() -> Vec<FeatureName> {
    use FeatureKind::*;
    vec![
        FeatureName::new(Incompatible, 0, "dirty bit"),
        FeatureName::new(Incompatible, 1, "corrupt bit"),
        FeatureName::new(Incompatible, 2, "external data file"),
        FeatureName::new(Incompatible, 3, "compression type"),
        FeatureName::new(Incompatible, 4, "extended L2 entries"),
        FeatureName::new(Compatible, 0, "lazy refcounts"),
        FeatureName::new(Autoclear, 0, "bitmaps"),
        FeatureName::new(Autoclear, 1, "raw external data"),
    ]
}

/// Decodes the data of a feature name table extension found at file offset `at`.
///
/// The data length must be a multiple of 48 bytes.
pub fn decode_feature_table(data: &[u8], at: u64) -> Result<Vec<FeatureName>> {
    if data.len() % FEATURE_NAME_ENTRY_LEN != 0 {
        return Err(FormatError::BadExtension {
            kind: crate::magic::EXT_FEATURE_TABLE,
            offset: at,
            reason: format!(
                "feature name table length {} is not a multiple of {FEATURE_NAME_ENTRY_LEN}",
                data.len()
            ),
        });
    }
    Ok(data
        .chunks_exact(FEATURE_NAME_ENTRY_LEN)
        .map(|e| {
            let mut name = [0u8; FEATURE_NAME_LEN];
            name.copy_from_slice(&e[2..]);
            FeatureName {
                kind: FeatureKind::from_byte(e[0]),
                raw_kind: e[0],
                bit: e[1],
                name,
            }
        })
        .collect())
}

/// Encodes a feature name table as extension data.
pub fn encode_feature_table(table: &[FeatureName]) -> Vec<u8> {
    let mut out = Vec::with_capacity(table.len() * FEATURE_NAME_ENTRY_LEN);
    for e in table {
        out.push(e.raw_kind);
        out.push(e.bit);
        out.extend_from_slice(&e.name);
    }
    out
}

/// Names the set bits of `bits` from the incompatible features, using the table when it has a
/// name for a bit and "bit N" otherwise, as in "bit 5, frobnication (bit 6)".
pub fn describe_incompatible(bits: u64, table: &[FeatureName]) -> String {
    let mut parts = Vec::new();
    for bit in 0..64u8 {
        if bits & (1u64 << bit) == 0 {
            continue;
        }
        let named = table
            .iter()
            .find(|e| e.kind == Some(FeatureKind::Incompatible) && e.bit == bit)
            .map(FeatureName::name_str);
        parts.push(match named {
            Some(n) if !n.is_empty() => format!("{n} (bit {bit})"),
            _ => format!("bit {bit}"),
        });
    }
    parts.join(", ")
}

/// Fails when `incompatible` has bits this implementation does not know, naming them.
pub fn check_incompatible(incompatible: u64, table: &[FeatureName]) -> Result<()> {
    let unknown = incompatible & !INCOMPAT_KNOWN;
    if unknown != 0 {
        // As QEMU's `report_unsupported_feature`: the table's order, each bit once.
        let mut left = unknown;
        let mut named = Vec::new();
        for e in table {
            if e.kind == Some(FeatureKind::Incompatible)
                && e.bit < 64
                && left & (1u64 << e.bit) != 0
            {
                named.push((e.bit, e.name_str()));
                left &= !(1u64 << e.bit);
            }
        }
        return Err(FormatError::UnknownIncompatibleFeatures {
            bits: unknown,
            names: describe_incompatible(unknown, table),
            named,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_entry() -> impl Strategy<Value = FeatureName> {
        (
            any::<u8>(),
            any::<u8>(),
            proptest::collection::vec(any::<u8>(), 46),
        )
            .prop_map(|(k, bit, n)| {
                let mut name = [0u8; FEATURE_NAME_LEN];
                name.copy_from_slice(&n);
                FeatureName {
                    kind: FeatureKind::from_byte(k),
                    raw_kind: k,
                    bit,
                    name,
                }
            })
    }

    proptest! {
        #[test]
        fn feature_tables_round_trip(table in proptest::collection::vec(arb_entry(), 0..20)) {
            let bytes = encode_feature_table(&table);
            prop_assert_eq!(bytes.len(), table.len() * 48);
            prop_assert_eq!(decode_feature_table(&bytes, 0x70).unwrap(), table);
        }
    }

    #[test]
    fn a_table_of_odd_length_is_rejected_naming_its_length() {
        let err = decode_feature_table(&[0u8; 50], 0x78)
            .unwrap_err()
            .to_string();
        assert!(err.contains("50"), "{err}");
        assert!(err.contains("0x78"), "{err}");
    }

    #[test]
    fn unknown_incompatible_bits_are_named_from_the_table() {
        let mut table = qemu_feature_table();
        table.push(FeatureName::new(
            FeatureKind::Incompatible,
            6,
            "frobnication",
        ));
        let err = check_incompatible(INCOMPAT_DIRTY | (1 << 5) | (1 << 6), &table)
            .unwrap_err()
            .to_string();
        assert!(err.contains("bit 5"), "{err}");
        assert!(err.contains("frobnication (bit 6)"), "{err}");
        assert!(err.contains("0x60"), "{err}");
        assert!(!err.contains("dirty"), "{err}");
    }

    #[test]
    fn known_incompatible_bits_are_accepted() {
        check_incompatible(INCOMPAT_KNOWN, &[]).unwrap();
    }

    #[test]
    fn a_full_46_byte_name_has_no_terminator() {
        let long = "x".repeat(60);
        let e = FeatureName::new(FeatureKind::Compatible, 3, &long);
        assert_eq!(e.name_str(), "x".repeat(46));
    }
}

//! QEMU's open-time validation of cluster 0, in QEMU's order (qcow2-format.md §1.2, §9).
//!
//! [`validate_cluster0`] decodes the header, runs every check QEMU runs before it reads any
//! table, then decodes the header extensions and the backing file name. The first rule broken
//! is the error reported, so an image QEMU refuses for a reason is refused by us for the same
//! reason. (One deviation: a v3 `header_length` below 104 is reported before an out-of-range
//! `cluster_bits`, because the header cannot be decoded at all without a sane length.)

use crate::cluster0::Cluster0;
use crate::error::{FormatError, Result};
use crate::features::{
    AUTOCLEAR_DATA_FILE_RAW, INCOMPAT_COMPRESSION, INCOMPAT_CORRUPT, INCOMPAT_DATA_FILE,
    check_incompatible,
};
use crate::header::Header;

/// Smallest cluster_bits QEMU accepts.
pub const MIN_CLUSTER_BITS: u32 = 9;
/// Largest cluster_bits QEMU accepts.
pub const MAX_CLUSTER_BITS: u32 = 21;
/// Largest refcount table QEMU accepts, in bytes.
pub const MAX_REFTABLE_BYTES: u64 = 8 << 20;
/// Largest L1 table QEMU accepts, in bytes.
pub const MAX_L1_BYTES: u64 = 32 << 20;
/// Smallest subcluster size (extended L2).
pub const MIN_SUBCLUSTER_SIZE: u64 = 512;

/// Why the image is being opened: some rules are relaxed for check/repair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// Reading only.
    ReadOnly,
    /// Reading and writing: a corrupt image is refused.
    ReadWrite,
    /// `check`, with or without repair: corrupt images and some broken fields are tolerated.
    Check,
}

fn field(what: &'static str, offset: u64, value: u64, reason: impl Into<String>) -> FormatError {
    FormatError::InvalidField {
        what,
        offset,
        value,
        reason: reason.into(),
    }
}

/// Validates and decodes cluster 0 (`bytes` = the start of the file, ideally a whole cluster
/// with anything past EOF read as zeros).
pub fn validate_cluster0(bytes: &[u8], mode: OpenMode) -> Result<Cluster0> {
    let h = Header::decode(bytes)?;
    check_header(&h, mode, || {
        // The feature table is only needed to name unknown bits; a broken extension area
        // must not hide the real reason, so fall back to an empty table.
        Cluster0::decode(bytes)
            .map(|c| c.feature_table().to_vec())
            .unwrap_or_default()
    })?;
    let c0 = Cluster0::decode(bytes)?;
    check_extensions(&c0)?;
    Ok(c0)
}

/// The header-only rules, in QEMU's order. `feature_table` is consulted only to name unknown
/// incompatible bits.
pub fn check_header(
    h: &Header,
    mode: OpenMode,
    feature_table: impl FnOnce() -> Vec<crate::features::FeatureName>,
) -> Result<()> {
    if !(MIN_CLUSTER_BITS..=MAX_CLUSTER_BITS).contains(&h.cluster_bits) {
        return Err(field(
            "cluster_bits",
            20,
            u64::from(h.cluster_bits),
            format!(
                "must be between {MIN_CLUSTER_BITS} and {MAX_CLUSTER_BITS} (512 B to 2 MiB clusters)"
            ),
        ));
    }
    let cs = 1u64 << h.cluster_bits;
    if u64::from(h.header_length) > cs {
        return Err(field(
            "header_length",
            100,
            u64::from(h.header_length),
            format!("the header must fit in the first cluster ({cs} bytes)"),
        ));
    }
    if h.backing_file_offset > cs {
        return Err(field(
            "backing_file_offset",
            8,
            h.backing_file_offset,
            format!("the backing file name must be in the first cluster ({cs} bytes)"),
        ));
    }
    // Compression type consistency.
    let ct = h.compression_type_byte();
    let bit = h.incompatible_features & INCOMPAT_COMPRESSION != 0;
    if ct > 1 {
        return Err(field(
            "compression_type",
            104,
            u64::from(ct),
            "unknown compression type (0 zlib and 1 zstd exist)",
        ));
    }
    if ct == 0 && bit {
        return Err(field(
            "compression_type",
            104,
            0,
            "incompatible bit 3 (compression type) is set but the type is the default zlib",
        ));
    }
    if ct != 0 && !bit {
        return Err(field(
            "compression_type",
            104,
            u64::from(ct),
            "a non-default compression type needs incompatible bit 3 (compression type) set",
        ));
    }
    check_incompatible(h.incompatible_features, &feature_table())?;
    if h.incompatible_features & INCOMPAT_CORRUPT != 0 && mode == OpenMode::ReadWrite {
        return Err(field(
            "incompatible_features",
            72,
            h.incompatible_features,
            "the corrupt bit is set: the image may be opened read-only, or repaired with check -r",
        ));
    }
    if h.extended_l2() && (cs / 32) < MIN_SUBCLUSTER_SIZE {
        return Err(field(
            "cluster_bits",
            20,
            u64::from(h.cluster_bits),
            "extended L2 entries need clusters of at least 16 KiB (subclusters of at least 512 bytes)",
        ));
    }
    if h.refcount_order > 6 {
        return Err(field(
            "refcount_order",
            96,
            u64::from(h.refcount_order),
            "refcount_order must be at most 6 (64-bit refcounts)",
        ));
    }
    if h.crypt_method > 2 {
        return Err(field(
            "crypt_method",
            32,
            u64::from(h.crypt_method),
            "unsupported encryption method (0 none, 1 AES, 2 LUKS)",
        ));
    }
    if h.refcount_table_clusters == 0 && mode != OpenMode::Check {
        return Err(field(
            "refcount_table_clusters",
            56,
            0,
            "the image has no refcount table",
        ));
    }
    let reft_bytes = u64::from(h.refcount_table_clusters) * cs;
    if reft_bytes > MAX_REFTABLE_BYTES {
        return Err(field(
            "refcount_table_clusters",
            56,
            u64::from(h.refcount_table_clusters),
            format!("the refcount table ({reft_bytes} bytes) exceeds {MAX_REFTABLE_BYTES} bytes"),
        ));
    }
    check_table(
        "refcount_table_offset",
        48,
        h.refcount_table_offset,
        reft_bytes,
        cs,
    )?;
    if h.nb_snapshots > crate::snapshot::MAX_SNAPSHOTS && mode != OpenMode::Check {
        return Err(field(
            "nb_snapshots",
            60,
            u64::from(h.nb_snapshots),
            format!(
                "at most {} snapshots are supported",
                crate::snapshot::MAX_SNAPSHOTS
            ),
        ));
    }
    if h.nb_snapshots > 0 {
        check_table("snapshots_offset", 64, h.snapshots_offset, 0, cs)?;
    }
    let l1_bytes = u64::from(h.l1_size) * 8;
    if l1_bytes > MAX_L1_BYTES {
        return Err(field(
            "l1_size",
            36,
            u64::from(h.l1_size),
            format!("the active L1 table ({l1_bytes} bytes) exceeds {MAX_L1_BYTES} bytes"),
        ));
    }
    check_table("l1_table_offset", 40, h.l1_table_offset, l1_bytes, cs)?;
    let needed = l1_entries_for(h.size, h.cluster_bits, h.extended_l2());
    if needed > i32::MAX as u64 {
        return Err(field(
            "size",
            24,
            h.size,
            "image is too big for its cluster size",
        ));
    }
    if u64::from(h.l1_size) < needed {
        return Err(field(
            "l1_size",
            36,
            u64::from(h.l1_size),
            format!(
                "L1 table is too small: a virtual size of {} bytes needs {needed} entries",
                h.size
            ),
        ));
    }
    Ok(())
}

/// `ceil(size / bytes covered by one L2 table)`, QEMU's `size_to_l1`.
pub fn l1_entries_for(size: u64, cluster_bits: u32, extended_l2: bool) -> u64 {
    let l2_bits = cluster_bits - if extended_l2 { 4 } else { 3 };
    let shift = cluster_bits + l2_bits;
    if shift >= 64 {
        return u64::from(size > 0);
    }
    let covered = 1u64 << shift;
    size.div_ceil(covered)
}

fn check_table(what: &'static str, at: u64, offset: u64, len: u64, cs: u64) -> Result<()> {
    if offset % cs != 0 {
        return Err(FormatError::Unaligned {
            what,
            offset: at,
            value: offset,
            align: cs,
        });
    }
    if offset
        .checked_add(len)
        .is_none_or(|end| end > i64::MAX as u64)
    {
        return Err(field(
            what,
            at,
            offset,
            format!("the table ({len} bytes) would end past the largest file offset"),
        ));
    }
    Ok(())
}

/// Rules on the extensions and their agreement with the header.
pub fn check_extensions(c: &Cluster0) -> Result<()> {
    let h = &c.header;
    let has_data_bit = h.incompatible_features & INCOMPAT_DATA_FILE != 0;
    if c.data_file().is_some() && !has_data_bit {
        return Err(field(
            "incompatible_features",
            72,
            h.incompatible_features,
            "a data file name extension is present but the external data file bit (2) is clear",
        ));
    }
    if h.autoclear_features & AUTOCLEAR_DATA_FILE_RAW != 0 && !has_data_bit {
        return Err(field(
            "autoclear_features",
            88,
            h.autoclear_features,
            "raw external data (autoclear bit 1) needs the external data file bit (2)",
        ));
    }
    if h.crypt_method == 2
        && !c
            .extensions
            .iter()
            .any(|e| matches!(e, crate::extension::Extension::Crypto { .. }))
    {
        return Err(field(
            "crypt_method",
            32,
            2,
            "LUKS encryption needs the full disk encryption header extension",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extension::Extension;
    use crate::features::{INCOMPAT_EXTENDED_L2, qemu_feature_table};

    /// A minimal valid v3 image header as qemu-img would write (64 KiB clusters, 1 GiB).
    fn good() -> Header {
        let mut h = Header::new_v3(16, 1 << 30, 4);
        h.l1_size = 2;
        h.l1_table_offset = 0x30000;
        h.refcount_table_offset = 0x10000;
        h.refcount_table_clusters = 1;
        h
    }

    fn err_of(h: &Header, mode: OpenMode) -> String {
        let mut c = Cluster0 {
            header: h.clone(),
            extensions: vec![Extension::FeatureTable(qemu_feature_table())],
            backing_file: None,
        };
        let mut b = c.encode().unwrap();
        b.resize(1 << h.cluster_bits.clamp(9, 21), 0);
        validate_cluster0(&b, mode).unwrap_err().to_string()
    }

    #[test]
    fn a_good_header_validates() {
        let mut c = Cluster0 {
            header: good(),
            extensions: vec![],
            backing_file: Some(b"base.qcow2".to_vec()),
        };
        let mut b = c.encode().unwrap();
        b.resize(65536, 0);
        let back = validate_cluster0(&b, OpenMode::ReadWrite).unwrap();
        assert_eq!(back.backing_file.as_deref(), Some(&b"base.qcow2"[..]));
    }

    #[test]
    fn cluster_bits_out_of_range_are_refused() {
        for bits in [8u32, 22, 40] {
            let mut h = good();
            h.cluster_bits = bits;
            let mut b = h.encode().unwrap();
            b.resize(4096, 0);
            let e = validate_cluster0(&b, OpenMode::ReadOnly)
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("cluster_bits {bits}")), "{e}");
        }
    }

    #[test]
    fn a_header_longer_than_a_cluster_is_refused() {
        let mut h = good();
        h.cluster_bits = 9;
        h.l1_size = 1 << 20;
        h.additional = vec![0; 512];
        h.header_length = 104 + 512;
        let mut b = h.encode().unwrap();
        b.resize(2048, 0);
        let e = validate_cluster0(&b, OpenMode::ReadOnly)
            .unwrap_err()
            .to_string();
        assert!(e.contains("header_length 616"), "{e}");
    }

    #[test]
    fn compression_type_rules_follow_qemu() {
        let mut h = good();
        h.additional[0] = 2;
        h.incompatible_features |= INCOMPAT_COMPRESSION;
        assert!(err_of(&h, OpenMode::ReadOnly).contains("compression_type 2"));
        let mut h = good();
        h.incompatible_features |= INCOMPAT_COMPRESSION;
        assert!(err_of(&h, OpenMode::ReadOnly).contains("bit 3"));
        let mut h = good();
        h.additional[0] = 1;
        assert!(err_of(&h, OpenMode::ReadOnly).contains("compression_type 1"));
    }

    #[test]
    fn unknown_incompatible_bits_refuse_the_open() {
        let mut h = good();
        h.incompatible_features |= 1 << 9;
        let e = err_of(&h, OpenMode::ReadOnly);
        assert!(e.contains("bit 9"), "{e}");
    }

    #[test]
    fn a_corrupt_image_is_refused_read_write_only() {
        let mut h = good();
        h.incompatible_features |= INCOMPAT_CORRUPT;
        assert!(err_of(&h, OpenMode::ReadWrite).contains("corrupt bit"));
        let mut b = h.encode().unwrap();
        b.resize(65536, 0);
        validate_cluster0(&b, OpenMode::ReadOnly).unwrap();
        validate_cluster0(&b, OpenMode::Check).unwrap();
    }

    #[test]
    fn extended_l2_with_8k_clusters_is_refused() {
        let mut h = good();
        h.cluster_bits = 13;
        h.l1_size = 1 << 20;
        h.incompatible_features |= INCOMPAT_EXTENDED_L2;
        let e = err_of(&h, OpenMode::ReadOnly);
        assert!(e.contains("cluster_bits 13"), "{e}");
        assert!(e.contains("16 KiB"), "{e}");
    }

    #[test]
    fn refcount_order_7_is_refused() {
        let mut h = good();
        h.refcount_order = 7;
        assert!(err_of(&h, OpenMode::ReadOnly).contains("refcount_order 7"));
    }

    #[test]
    fn crypt_method_3_is_refused() {
        let mut h = good();
        h.crypt_method = 3;
        assert!(err_of(&h, OpenMode::ReadOnly).contains("crypt_method 3"));
    }

    #[test]
    fn a_missing_refcount_table_is_refused_except_in_check_mode() {
        let mut h = good();
        h.refcount_table_clusters = 0;
        assert!(err_of(&h, OpenMode::ReadOnly).contains("refcount_table_clusters 0"));
        let mut b = h.encode().unwrap();
        b.resize(65536, 0);
        validate_cluster0(&b, OpenMode::Check).unwrap();
    }

    #[test]
    fn an_oversized_refcount_table_is_refused() {
        let mut h = good();
        h.refcount_table_clusters = 129;
        assert!(err_of(&h, OpenMode::ReadOnly).contains("refcount_table_clusters 129"));
    }

    #[test]
    fn unaligned_tables_are_refused_naming_the_offset() {
        let mut h = good();
        h.refcount_table_offset = 0x10200;
        let e = err_of(&h, OpenMode::ReadOnly);
        assert!(e.contains("refcount_table_offset 0x10200"), "{e}");
        let mut h = good();
        h.l1_table_offset = 0x30008;
        assert!(err_of(&h, OpenMode::ReadOnly).contains("l1_table_offset 0x30008"));
        let mut h = good();
        h.nb_snapshots = 1;
        h.snapshots_offset = 0x777;
        assert!(err_of(&h, OpenMode::ReadOnly).contains("snapshots_offset 0x777"));
    }

    #[test]
    fn too_many_snapshots_are_refused() {
        let mut h = good();
        h.nb_snapshots = 70000;
        h.snapshots_offset = 0x40000;
        assert!(err_of(&h, OpenMode::ReadOnly).contains("nb_snapshots 70000"));
    }

    #[test]
    fn an_l1_table_in_the_billions_is_refused() {
        let mut h = good();
        h.l1_size = 3_000_000_000;
        let e = err_of(&h, OpenMode::ReadOnly);
        assert!(e.contains("l1_size 3000000000"), "{e}");
    }

    #[test]
    fn a_table_ending_past_the_largest_offset_is_refused() {
        let mut h = good();
        h.l1_table_offset = u64::MAX - 0xffff;
        let e = err_of(&h, OpenMode::ReadOnly);
        assert!(e.contains("l1_table_offset"), "{e}");
    }

    #[test]
    fn an_l1_table_too_small_for_the_size_is_refused() {
        let mut h = good();
        h.size = 1 << 40;
        let e = err_of(&h, OpenMode::ReadOnly);
        assert!(e.contains("l1_size 2"), "{e}");
        assert!(e.contains("needs 2048 entries"), "{e}");
    }

    #[test]
    fn an_absurd_size_is_too_big() {
        let mut h = good();
        h.cluster_bits = 9;
        h.size = u64::MAX;
        h.l1_size = 0;
        let e = err_of(&h, OpenMode::ReadOnly);
        assert!(e.contains("too big"), "{e}");
    }

    #[test]
    fn raw_external_data_without_a_data_file_is_refused() {
        let mut h = good();
        h.autoclear_features |= AUTOCLEAR_DATA_FILE_RAW;
        assert!(err_of(&h, OpenMode::ReadOnly).contains("autoclear bit 1"));
    }

    #[test]
    fn a_data_file_name_without_the_bit_is_refused() {
        let mut c = Cluster0 {
            header: good(),
            extensions: vec![Extension::DataFile(b"d.raw".to_vec())],
            backing_file: None,
        };
        let mut b = c.encode().unwrap();
        b.resize(65536, 0);
        let e = validate_cluster0(&b, OpenMode::ReadOnly)
            .unwrap_err()
            .to_string();
        assert!(e.contains("data file"), "{e}");
    }

    #[test]
    fn l1_entries_follow_size_to_l1() {
        assert_eq!(l1_entries_for(1 << 30, 16, false), 2);
        assert_eq!(l1_entries_for(1 << 30, 16, true), 4);
        assert_eq!(l1_entries_for(0, 16, false), 0);
        assert_eq!(l1_entries_for((512 << 20) + 1, 16, false), 2);
        assert_eq!(l1_entries_for(u64::MAX, 21, false), 1 << 25);
    }
}

//! Entry points of the format-level cargo-fuzz targets in `fuzz/` (`header`, `l2_slice`,
//! `refcount_block`), also run by `cargo test`, which replays the committed seed corpus
//! through them. Each drives `qimg-format`'s public API only (they live here, not in the
//! published crate) and must never panic on any input; a panic is a finding.

use qimg::format::cluster0::Cluster0;
use qimg::format::compressed::CompressedDescriptor;
use qimg::format::error::{FormatError, Result};
use qimg::format::geometry::{Geometry, MAX_REFCOUNT_ORDER};
use qimg::format::header::Header;
use qimg::format::l2::{
    AnyL2Entry, L2Context, L2Entry, QCOW_OFLAG_COPIED, QCOW_OFLAG_ZERO, SubclusterBitmap,
    SubclusterState, decode_slice, encode_slice, write_entry,
};
use qimg::format::refcount;
use qimg::format::units::SubclusterIndex;
use qimg::format::validate::{OpenMode, validate_cluster0};

/// Decodes `data` as the start of an image: header, extensions, backing name, with QEMU's
/// open-time validation in every mode. Whatever decodes must encode and decode back to the
/// same value.
pub fn header_and_extensions(data: &[u8]) {
    if let Ok(h) = Header::decode(data) {
        if let Ok(bytes) = h.encode() {
            let back = Header::decode(&bytes).expect("an encoded header decodes");
            assert_eq!(back, h, "header round trip");
        }
    }
    let mut decoded = None;
    for mode in [OpenMode::ReadOnly, OpenMode::ReadWrite, OpenMode::Check] {
        if let Ok(c) = validate_cluster0(data, mode) {
            decoded = Some(c);
        }
    }
    let Some(c) = decoded.or_else(|| Cluster0::decode(data).ok()) else {
        return;
    };
    let mut again = c.clone();
    if let Ok(bytes) = again.encode() {
        let mut cluster = bytes;
        if let Some(cs) = again.header.cluster_size() {
            if cs <= 2 << 20 {
                cluster.resize(cs as usize, 0);
            }
        }
        let back = Cluster0::decode(&cluster).expect("an encoded cluster 0 decodes");
        assert_eq!(back.header, again.header, "cluster 0 header round trip");
        assert_eq!(back.extensions, again.extensions, "extension round trip");
        assert_eq!(
            back.backing_file, again.backing_file,
            "backing name round trip"
        );
    }
}

/// The L2 geometry and decoding context chosen by the first byte of an `l2_slice` input.
///
/// Bit 0: extended L2 entries. Bits 1..=4 (`x`): `cluster_bits` is `14 + x % 8` with extended
/// entries, else `9 + x % 13`. Bit 5: external data file. Bit 6: version 2. Bit 7: the slice
/// is read near the end of the offset space (error offsets saturate), else at 0x50000.
pub fn l2_context(selector: u8) -> (L2Context, u64) {
    let extended = selector & 1 != 0;
    let x = u32::from(selector >> 1 & 0xF);
    let cluster_bits = if extended { 14 + x % 8 } else { 9 + x % 13 };
    let geometry = Geometry::new(cluster_bits, extended).expect("cluster_bits in range");
    let ctx = L2Context {
        geometry,
        external_data_file: selector & 0x20 != 0,
        v2: selector & 0x40 != 0,
    };
    let base = if selector & 0x80 != 0 {
        u64::MAX - 0x100
    } else {
        0x50000
    };
    (ctx, base)
}

/// Decodes the bytes after the first one as a slice of an L2 table, standard or extended (see
/// [`l2_context`] for the first byte), and exercises every accessor of every entry:
///
/// * slice decoding agrees entry by entry with [`AnyL2Entry::decode`], and its error is the
///   first entry's error; a partial trailing entry is an error;
/// * `state` agrees with `runs`, which are maximal and cover the cluster (32 subclusters, or
///   one for a standard entry); decoded extended entries pass `validate`; host offsets are
///   cluster aligned; compressed descriptors are self-consistent;
/// * re-encoding gives back the input bytes except for the bits decoding drops (bit 0 of an
///   extended entry's first word, the COPIED flag of an unallocated entry), and encoded
///   entries decode to the same values, also when written one by one with `write_entry`.
pub fn l2_slice(data: &[u8]) {
    let Some((&selector, bytes)) = data.split_first() else {
        return;
    };
    let (ctx, base) = l2_context(selector);
    let size = ctx.geometry.l2_entry_size() as usize;
    let whole = bytes.len() / size * size;
    let bytes_whole = &bytes[..whole];
    if whole != bytes.len() {
        assert!(
            matches!(
                decode_slice(bytes, &ctx, base),
                Err(FormatError::Truncated { .. })
            ),
            "a partial trailing entry must be refused"
        );
    }
    let at = |i: usize| base.saturating_add((i * size) as u64);
    let each: Vec<Result<AnyL2Entry>> = bytes_whole
        .chunks_exact(size)
        .enumerate()
        .map(|(i, c)| AnyL2Entry::decode(c, &ctx, at(i)))
        .collect();
    let slice = decode_slice(bytes_whole, &ctx, base);
    match &slice {
        Ok(v) => {
            assert_eq!(v.len(), each.len());
            for (a, b) in v.iter().zip(&each) {
                assert_eq!(Ok(a), b.as_ref(), "slice and entry decoding differ");
            }
        }
        Err(e) => {
            let first = each.iter().find_map(|r| r.as_ref().err());
            assert_eq!(Some(e), first, "the slice error is the first entry's error");
        }
    }
    // Entry-level checks for every entry that decodes, even when another one does not.
    for (i, (r, raw)) in each.iter().zip(bytes_whole.chunks_exact(size)).enumerate() {
        let Ok(entry) = r else { continue };
        check_l2_entry(entry, &ctx, at(i));
        let mut again = Vec::new();
        entry.encode_into(&mut again);
        assert_eq!(again.len(), entry.encoded_len());
        assert_eq!(again.len(), size);
        let word = u64::from_be_bytes(raw[..8].try_into().expect("8 bytes"));
        let mut dropped = 0;
        // Bit 0 of an extended entry is ignored, except in a compressed descriptor (where
        // it is part of the host offset).
        if ctx.geometry.extended_l2() && !matches!(entry.entry(), L2Entry::Compressed(_)) {
            dropped |= QCOW_OFLAG_ZERO;
        }
        if *entry.entry() == L2Entry::Unallocated {
            dropped |= QCOW_OFLAG_COPIED;
        }
        assert_eq!(
            again[..8],
            (word & !dropped).to_be_bytes(),
            "re-encoding changes more than the dropped bits"
        );
        assert_eq!(again[8..], raw[8..], "the bitmap re-encodes as read");
        assert_eq!(
            AnyL2Entry::decode(&again, &ctx, at(i)).as_ref(),
            Ok(entry),
            "an encoded entry decodes back"
        );
    }
    let Ok(v) = slice else { return };
    let encoded = encode_slice(&v);
    assert_eq!(encoded.len(), bytes_whole.len());
    assert_eq!(
        decode_slice(&encoded, &ctx, base).as_ref(),
        Ok(&v),
        "slice round trip"
    );
    let mut rewritten = vec![0u8; encoded.len()];
    for (i, e) in v.iter().enumerate() {
        write_entry(&mut rewritten, i, e).expect("the entry fits");
    }
    assert_eq!(
        rewritten, encoded,
        "write_entry writes what encode_slice does"
    );
    if let Some(e) = v.first() {
        assert!(write_entry(&mut rewritten, v.len(), e).is_err());
        assert!(write_entry(&mut rewritten, usize::MAX, e).is_err());
        assert_eq!(rewritten, encoded, "a failed write_entry writes nothing");
    }
}

/// Every accessor of one decoded L2 entry read at file offset `at`.
fn check_l2_entry(entry: &AnyL2Entry, ctx: &L2Context, at: u64) {
    let g = ctx.geometry;
    let e = *entry.entry();
    assert_eq!(entry.bitmap().is_some(), g.extended_l2());
    if let Some(h) = e.host_cluster() {
        assert!(
            h.0 % g.cluster_size() == 0,
            "unaligned host cluster {:#x}",
            h.0
        );
    }
    match e {
        L2Entry::Unallocated | L2Entry::Compressed(_) => {
            assert!(!e.copied());
            assert_eq!(e.host_cluster(), None);
        }
        L2Entry::Zero { .. } => {
            assert!(!g.extended_l2(), "zero flag decoded in an extended entry");
            assert!(!ctx.v2, "zero flag decoded in a version 2 image");
        }
        L2Entry::Normal { host, .. } => {
            assert!(host.0 != 0 || ctx.external_data_file);
        }
    }
    if let L2Entry::Compressed(d) = e {
        assert!(!ctx.external_data_file);
        assert_eq!(d.cluster_bits(), g.cluster_bits());
        let size = d.compressed_size_bytes();
        assert!(size >= 1 && size <= (d.additional_sectors() + 1) * 512);
        let (first, count) = d.host_clusters();
        assert!(count >= 1);
        assert_eq!(first.0, d.host_offset().0 >> g.cluster_bits());
        let back = CompressedDescriptor::decode(d.encode(), g.cluster_bits(), at);
        assert_eq!(back, Ok(d), "descriptor round trip");
    }
    let subclusters = g.subclusters_per_cluster();
    if let AnyL2Entry::Extended(x) = entry {
        assert_eq!(x.validate(at), Ok(()), "a decoded extended entry is valid");
        let bm = x.bitmap;
        assert_eq!(SubclusterBitmap::from_word(bm.to_word()), bm);
        let mut next = 0;
        for (first, count, bits) in bm.runs() {
            assert_eq!(first.0, next);
            assert!(count >= 1);
            for sc in first.0..first.0 + count {
                assert_eq!(bm.bits(SubclusterIndex(sc)), bits);
            }
            next += count;
        }
        assert_eq!(next, 32, "bitmap runs cover the cluster");
        // Bitmap edits with a range taken from the entry itself.
        let first = SubclusterIndex(bm.alloc % 40);
        let mask = SubclusterBitmap::range_mask(first, bm.zero % 40);
        let a = bm.with_allocated(mask);
        assert!(a.alloc & mask == mask && a.zero & mask == 0);
        let z = bm.with_zero(mask);
        assert!(z.zero & mask == mask && z.alloc & mask == 0);
        let u = bm.with_unallocated(mask);
        assert!(u.zero & mask == 0 && u.alloc & mask == 0);
        for b in [a, z, u] {
            assert_eq!(b.alloc & !mask, bm.alloc & !mask);
            assert_eq!(b.zero & !mask, bm.zero & !mask);
        }
    }
    // state() agrees with runs(), which are maximal and cover every subcluster.
    let mut next = 0;
    let mut prev = None;
    for (first, count, state) in entry.runs() {
        assert_eq!(first.0, next, "runs are contiguous");
        assert!(count >= 1);
        assert_ne!(prev, Some(state), "runs are maximal");
        prev = Some(state);
        for sc in first.0..first.0 + count {
            assert_eq!(entry.state(SubclusterIndex(sc)), state);
        }
        next += count;
    }
    assert_eq!(next, subclusters, "runs cover the cluster");
    for sc in 0..40 {
        let s = entry.state(SubclusterIndex(sc));
        assert!(!(s.reads_zeros() && s.reads_backing()));
        if s.has_host_cluster() {
            assert!(e.host_cluster().is_some(), "{s:?} without a host cluster");
        }
        if s == SubclusterState::Compressed {
            assert!(matches!(e, L2Entry::Compressed(_)));
        }
        if let AnyL2Entry::Standard(_) = entry {
            assert_eq!(s, e.cluster_state());
        }
    }
}

/// Decodes the bytes after the first one as a refcount block with `2^(first byte % 8)`-bit
/// entries (orders 7 is refused, every other order is a width from 1 to 64 bits), and as a
/// refcount table:
///
/// * `decode_block` agrees with `get` at every index and re-encodes to the same bytes; an
///   index past the end is an error;
/// * `set` at indices and values taken from the input changes only its own entry, reads back
///   with `get`, and refuses a value too wide for the entry, writing nothing;
/// * refcount table entries that decode encode back to the same bytes.
pub fn refcount_block(data: &[u8]) {
    let Some((&selector, block)) = data.split_first() else {
        return;
    };
    let order = u32::from(selector % 8);
    let cluster_size = 1u64 << (9 + u32::from(selector >> 3) % 13);
    if let Ok(table) = refcount::decode_table(block, cluster_size, 0x30000) {
        assert_eq!(
            refcount::encode_table(&table),
            block,
            "refcount table round trip"
        );
    }
    let decoded = refcount::decode_block(block, order);
    if order > MAX_REFCOUNT_ORDER {
        assert!(decoded.is_err());
        assert!(refcount::get(block, order, 0).is_err());
        assert!(refcount::set(&mut block.to_vec(), order, 0, 0).is_err());
        return;
    }
    let bits = 1u64 << order;
    let entries = block.len() as u64 * 8 / bits;
    let Ok(values) = decoded else {
        assert!(bits >= 8 && block.len() as u64 % (bits / 8) != 0);
        return;
    };
    assert_eq!(values.len() as u64, entries);
    let max = u64::MAX >> (64 - bits);
    for (i, &v) in values.iter().enumerate() {
        assert!(v <= max);
        assert_eq!(refcount::get(block, order, i as u64), Ok(v));
    }
    assert!(refcount::get(block, order, entries).is_err());
    assert!(refcount::get(block, order, u64::MAX).is_err());
    assert_eq!(
        refcount::encode_block(&values, order).as_deref(),
        Ok(block),
        "refcount block round trip"
    );
    if entries == 0 {
        assert!(refcount::set(&mut block.to_vec(), order, 0, 0).is_err());
        return;
    }
    // A few set/get round trips at indices and values taken from the block itself.
    let mut work = block.to_vec();
    let mut expected = values;
    for (k, chunk) in block.chunks(8).take(16).enumerate() {
        let mut word = [0u8; 8];
        word[..chunk.len()].copy_from_slice(chunk);
        let raw = u64::from_le_bytes(word);
        let index = (raw ^ k as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) % entries;
        let value = raw.rotate_left(k as u32) & max;
        refcount::set(&mut work, order, index, value).expect("an in-range set");
        expected[index as usize] = value;
        assert_eq!(refcount::get(&work, order, index), Ok(value));
        if bits < 64 {
            let before = work.clone();
            assert!(refcount::set(&mut work, order, index, max + 1).is_err());
            assert_eq!(work, before, "a refused set writes nothing");
        }
    }
    assert_eq!(
        refcount::decode_block(&work, order).as_ref(),
        Ok(&expected),
        "set changes only its own entry"
    );
}

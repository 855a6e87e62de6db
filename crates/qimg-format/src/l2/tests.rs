//! Tests of L2 entries: the §3.2 type table, the §4.1 subcluster table row by row, every
//! rejection rule, slices, and round trips.

use super::*;
use proptest::prelude::*;

const CS: u64 = 0x10000;

fn std_ctx() -> L2Context {
    L2Context::new(Geometry::new(16, false).unwrap())
}

fn ext_ctx() -> L2Context {
    L2Context::new(Geometry::new(16, true).unwrap())
}

fn with_data_file(mut ctx: L2Context) -> L2Context {
    ctx.external_data_file = true;
    ctx
}

fn err(raw: u64, ctx: &L2Context, at: u64) -> String {
    L2Entry::decode(raw, ctx, at).unwrap_err().to_string()
}

fn ext(word: u64, bitmap: u64) -> Result<ExtendedL2Entry> {
    ExtendedL2Entry::decode(word, bitmap, &ext_ctx(), 0x4_0010)
}

fn ext_err(word: u64, bitmap: u64) -> String {
    ext(word, bitmap).unwrap_err().to_string()
}

fn assert_names(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "{msg:?} should contain {p:?}");
    }
}

// ---- §3.2 standard cluster types, in QEMU's order ----

#[test]
fn compressed_bit_makes_a_compressed_cluster() {
    let e = L2Entry::decode(QCOW_OFLAG_COMPRESSED | (2 << 54) | 0x1234, &std_ctx(), 0).unwrap();
    let L2Entry::Compressed(d) = e else {
        panic!("{e:?}")
    };
    assert_eq!(
        (d.host_offset(), d.additional_sectors()),
        (HostOffset(0x1234), 2)
    );
    assert_eq!(e.cluster_state(), SubclusterState::Compressed);
}

#[test]
fn zero_flag_with_an_offset_is_zero_alloc() {
    let e = L2Entry::decode(QCOW_OFLAG_COPIED | 0x5_0000 | 1, &std_ctx(), 0).unwrap();
    assert_eq!(
        e,
        L2Entry::Zero {
            preallocated: Some(HostOffset(0x5_0000)),
            copied: true
        }
    );
    assert_eq!(e.cluster_state(), SubclusterState::ZeroAlloc);
    assert_eq!(e.host_cluster(), Some(HostOffset(0x5_0000)));
}

#[test]
fn zero_flag_without_an_offset_is_zero_plain() {
    let e = L2Entry::decode(1, &std_ctx(), 0).unwrap();
    assert_eq!(
        e,
        L2Entry::Zero {
            preallocated: None,
            copied: false
        }
    );
    assert_eq!(e.cluster_state(), SubclusterState::ZeroPlain);
}

#[test]
fn offset_zero_is_unallocated_even_with_copied_set() {
    assert_eq!(
        L2Entry::decode(0, &std_ctx(), 0).unwrap(),
        L2Entry::Unallocated
    );
    let e = L2Entry::decode(QCOW_OFLAG_COPIED, &std_ctx(), 0).unwrap();
    assert_eq!(e, L2Entry::Unallocated);
    assert_eq!(e.cluster_state(), SubclusterState::UnallocatedPlain);
}

#[test]
fn offset_zero_with_copied_is_normal_at_host_zero_with_an_external_data_file() {
    let ctx = with_data_file(std_ctx());
    let e = L2Entry::decode(QCOW_OFLAG_COPIED, &ctx, 0).unwrap();
    assert_eq!(
        e,
        L2Entry::Normal {
            host: HostOffset(0),
            copied: true
        }
    );
    assert_eq!(L2Entry::decode(0, &ctx, 0).unwrap(), L2Entry::Unallocated);
    // The zero flag is looked at first, as in QEMU.
    let z = L2Entry::decode(QCOW_OFLAG_COPIED | 1, &ctx, 0).unwrap();
    assert_eq!(z.cluster_state(), SubclusterState::ZeroPlain);
}

#[test]
fn an_aligned_offset_is_a_normal_cluster() {
    let e = L2Entry::decode(QCOW_OFLAG_COPIED | 0x7_0000, &std_ctx(), 0).unwrap();
    assert_eq!(
        e,
        L2Entry::Normal {
            host: HostOffset(0x7_0000),
            copied: true
        }
    );
    assert!(e.copied());
    let shared = L2Entry::decode(0x7_0000, &std_ctx(), 0).unwrap();
    assert!(!shared.copied());
}

// ---- rejections ----

#[test]
fn reserved_bits_1_to_8_are_rejected_naming_bits_and_offset() {
    let msg = err(0x7_0000 | 0x100, &std_ctx(), 0x3_0018);
    assert_names(&msg, &["reserved bits 0x100 ", "0x30018", "0x70100"]);
}

#[test]
fn reserved_bits_56_to_61_are_rejected_naming_bits_and_offset() {
    let msg = err(0x7_0000 | (1 << 61), &std_ctx(), 0x3_0020);
    assert_names(&msg, &["reserved bits 0x2000000000000000 ", "0x30020"]);
}

#[test]
fn the_zero_flag_in_a_version_2_image_is_rejected() {
    let mut ctx = std_ctx();
    ctx.v2 = true;
    let msg = err(0x7_0001, &ctx, 0x3_0008);
    assert_names(&msg, &["version 2", "reserved bits 0x1 ", "0x30008"]);
}

#[test]
fn an_unaligned_host_offset_is_rejected_naming_it() {
    let msg = err(0x7_0200, &std_ctx(), 0x3_0028);
    assert_names(&msg, &["0x70200", "0x30028", "0x10000"]);
    let msg = err(0x7_0200 | 1, &std_ctx(), 0x3_0028);
    assert_names(&msg, &["0x70200"]);
}

#[test]
fn a_compressed_entry_with_copied_is_rejected() {
    let msg = err(
        QCOW_OFLAG_COMPRESSED | QCOW_OFLAG_COPIED | 0x1234,
        &std_ctx(),
        0x3_0030,
    );
    assert_names(
        &msg,
        &[
            "COPIED",
            "0x8000000000000000",
            "0x30030",
            "0xc000000000001234",
        ],
    );
}

#[test]
fn a_compressed_entry_with_an_external_data_file_is_rejected() {
    let msg = err(
        QCOW_OFLAG_COMPRESSED | 0x1234,
        &with_data_file(std_ctx()),
        0x3_0038,
    );
    assert_names(
        &msg,
        &["external data file", "0x4000000000001234", "0x30038"],
    );
}

#[test]
fn high_compressed_offset_bits_are_rejected_with_small_clusters() {
    let ctx = L2Context::new(Geometry::new(9, false).unwrap());
    let msg = err(QCOW_OFLAG_COMPRESSED | (1 << 57), &ctx, 0x600);
    assert_names(&msg, &["0x200000000000000", "0x600"]);
}

// ---- extended entries, §4.1 row by row ----

#[test]
fn bit_0_of_an_extended_entry_is_ignored_and_never_means_zero() {
    let e = ext(0x7_0001, 0xFFFF_FFFF).unwrap();
    assert_eq!(
        e.entry,
        L2Entry::Normal {
            host: HostOffset(0x7_0000),
            copied: false
        }
    );
    assert_eq!(ext(1, 0).unwrap().entry, L2Entry::Unallocated);
    assert_eq!(ext(1, 0).unwrap().encode(), [0, 0]);
}

#[test]
fn a_compressed_cluster_with_a_zero_bitmap_is_compressed_in_every_subcluster() {
    let e = ext(QCOW_OFLAG_COMPRESSED | 0x1234, 0).unwrap();
    for sc in 0..32 {
        assert_eq!(e.state(SubclusterIndex(sc)), SubclusterState::Compressed);
    }
    let runs: Vec<_> = e.runs().collect();
    assert_eq!(
        runs,
        vec![(SubclusterIndex(0), 32, SubclusterState::Compressed)]
    );
}

#[test]
fn a_compressed_cluster_with_a_non_zero_bitmap_reads_as_qemu_reads_it_but_is_never_written() {
    // QEMU reads a compressed cluster whatever its (reserved) bitmap holds.
    let e = ext(QCOW_OFLAG_COMPRESSED | 0x1234, 1 << 40).unwrap();
    assert!(matches!(e.entry, L2Entry::Compressed(_)));
    assert_eq!(e.bitmap, SubclusterBitmap::EMPTY);
    assert_eq!(e.state(SubclusterIndex(7)), SubclusterState::Compressed);
    // A writer cannot build one.
    let bad = ExtendedL2Entry {
        entry: e.entry,
        bitmap: SubclusterBitmap::from_word(1 << 40),
    };
    let msg = bad.validate(0x4_0010).unwrap_err().to_string();
    assert_names(&msg, &["compressed", "0x40010", "0x0000010000000000"]);
}

#[test]
fn alloc_and_zero_bit_on_the_same_subcluster_is_rejected() {
    let bitmap = (1u64 << (32 + 5)) | (1 << 5);
    let msg = ext_err(0x7_0000, bitmap);
    assert_names(
        &msg,
        &[
            "same subcluster",
            "0x40010",
            "0x0000000000070000",
            "0x0000002000000020",
        ],
    );
}

#[test]
fn a_zero_bit_on_a_normal_cluster_is_zero_alloc() {
    let e = ext(0x7_0000, 1 << 35).unwrap();
    assert_eq!(e.state(SubclusterIndex(3)), SubclusterState::ZeroAlloc);
}

#[test]
fn an_alloc_bit_on_a_normal_cluster_is_normal() {
    let e = ext(0x7_0000, 1 << 3).unwrap();
    assert_eq!(e.state(SubclusterIndex(3)), SubclusterState::Normal);
}

#[test]
fn neither_bit_on_a_normal_cluster_is_unallocated_alloc() {
    let e = ext(0x7_0000, 1 << 3).unwrap();
    assert_eq!(
        e.state(SubclusterIndex(4)),
        SubclusterState::UnallocatedAlloc
    );
}

#[test]
fn alloc_bits_on_an_unallocated_cluster_are_rejected() {
    let msg = ext_err(0, 1 << 31);
    assert_names(&msg, &["unallocated", "0x40010", "0x0000000080000000"]);
}

#[test]
fn a_zero_bit_on_an_unallocated_cluster_is_zero_plain() {
    let e = ext(0, 1 << 63).unwrap();
    assert_eq!(e.state(SubclusterIndex(31)), SubclusterState::ZeroPlain);
}

#[test]
fn no_bit_on_an_unallocated_cluster_is_unallocated_plain() {
    let e = ext(0, 1 << 63).unwrap();
    assert_eq!(
        e.state(SubclusterIndex(30)),
        SubclusterState::UnallocatedPlain
    );
}

#[test]
fn alloc_bits_at_host_zero_are_normal_with_an_external_data_file_and_copied() {
    let ctx = with_data_file(ext_ctx());
    let e = ExtendedL2Entry::decode(QCOW_OFLAG_COPIED, 1, &ctx, 0).unwrap();
    assert_eq!(e.state(SubclusterIndex(0)), SubclusterState::Normal);
    assert!(ExtendedL2Entry::decode(0, 1, &ctx, 0).is_err());
}

#[test]
fn a_hand_built_zero_entry_fails_validation() {
    let e = ExtendedL2Entry {
        entry: L2Entry::Zero {
            preallocated: None,
            copied: false,
        },
        bitmap: SubclusterBitmap::EMPTY,
    };
    assert!(
        e.validate(0x10)
            .unwrap_err()
            .to_string()
            .contains("zero flag")
    );
    assert_eq!(e.state(SubclusterIndex(0)), SubclusterState::ZeroPlain);
}

#[test]
fn runs_of_a_mixed_extended_entry_are_maximal() {
    // sc 0-3 allocated, 4-7 zero, 8-31 neither.
    let e = ext(0x7_0000, (0xF0 << 32) | 0x0F).unwrap();
    let runs: Vec<_> = e.runs().collect();
    assert_eq!(
        runs,
        vec![
            (SubclusterIndex(0), 4, SubclusterState::Normal),
            (SubclusterIndex(4), 4, SubclusterState::ZeroAlloc),
            (SubclusterIndex(8), 24, SubclusterState::UnallocatedAlloc),
        ]
    );
}

#[test]
fn runs_merge_bits_that_mean_the_same_state() {
    // Hand-built: alloc bits on an unallocated cluster do not change its states.
    let e = ExtendedL2Entry {
        entry: L2Entry::Unallocated,
        bitmap: SubclusterBitmap {
            alloc: 0b1100,
            zero: 0,
        },
    };
    let runs: Vec<_> = e.runs().collect();
    assert_eq!(
        runs,
        vec![(SubclusterIndex(0), 32, SubclusterState::UnallocatedPlain)]
    );
}

// ---- AnyL2Entry and slices ----

#[test]
fn a_standard_entry_is_one_subcluster_whatever_the_index() {
    let e = AnyL2Entry::Standard(L2Entry::Normal {
        host: HostOffset(CS),
        copied: true,
    });
    assert_eq!(e.state(SubclusterIndex(0)), SubclusterState::Normal);
    assert_eq!(e.state(SubclusterIndex(17)), SubclusterState::Normal);
    assert_eq!(
        e.runs().collect::<Vec<_>>(),
        vec![(SubclusterIndex(0), 1, SubclusterState::Normal)]
    );
    assert_eq!(e.bitmap(), None);
}

#[test]
fn extended_entries_keep_the_bitmap_in_the_second_big_endian_word() {
    // Byte 8 = zero bits of subclusters 24-31, byte 15 = alloc bits of subclusters 0-7.
    let mut bytes = vec![0u8; 16];
    bytes[5] = 0x07; // host 0x70000
    bytes[8] = 0x80; // zero bit of subcluster 31
    bytes[15] = 0x01; // alloc bit of subcluster 0
    let e = AnyL2Entry::decode(&bytes, &ext_ctx(), 0).unwrap();
    assert_eq!(e.state(SubclusterIndex(31)), SubclusterState::ZeroAlloc);
    assert_eq!(e.state(SubclusterIndex(0)), SubclusterState::Normal);
    assert_eq!(
        e.bitmap(),
        Some(SubclusterBitmap {
            alloc: 1,
            zero: 1 << 31
        })
    );
    assert_eq!(encode_slice(&[e]), bytes);
}

#[test]
fn a_slice_error_names_the_offset_of_the_bad_entry() {
    let good = AnyL2Entry::Extended(ext(0x7_0000, 1).unwrap());
    let mut bytes = encode_slice(&[good; 4]);
    bytes[2 * 16 + 8] = 0x01; // entry 2: zero bit of subcluster 24
    bytes[2 * 16 + 12] = 0x01; // and its alloc bit: overlap
    let msg = decode_slice(&bytes, &ext_ctx(), 0x8_0000)
        .unwrap_err()
        .to_string();
    assert_names(&msg, &["offset 0x80020", "same subcluster"]);

    let mut std_bytes = encode_slice(&[AnyL2Entry::Standard(L2Entry::Unallocated); 4]);
    std_bytes[3 * 8 + 6] = 0x01; // entry 3: reserved bit 8
    let msg = decode_slice(&std_bytes, &std_ctx(), 0x8_0000)
        .unwrap_err()
        .to_string();
    assert_names(&msg, &["offset 0x80018", "0x100"]);
}

#[test]
fn a_slice_with_a_partial_entry_is_truncated_at_that_entry() {
    let msg = decode_slice(&[0; 40], &ext_ctx(), 0x1000)
        .unwrap_err()
        .to_string();
    assert_names(&msg, &["truncated", "0x1020"]);
    assert!(AnyL2Entry::decode(&[0; 12], &ext_ctx(), 0).is_err());
}

#[test]
fn write_entry_replaces_one_entry_and_refuses_out_of_range() {
    let mut bytes = encode_slice(&[AnyL2Entry::Standard(L2Entry::Unallocated); 2]);
    let e = AnyL2Entry::Standard(L2Entry::Normal {
        host: HostOffset(CS),
        copied: true,
    });
    write_entry(&mut bytes, 1, &e).unwrap();
    assert_eq!(decode_slice(&bytes, &std_ctx(), 0).unwrap()[1], e);
    assert!(write_entry(&mut bytes, 2, &e).is_err());
    assert!(write_entry(&mut bytes, usize::MAX, &e).is_err());
}

// ---- round trips ----

/// A context valid per the spec: extended L2 needs v3 and >= 16 KiB clusters; so does a data file.
fn arb_ctx() -> impl Strategy<Value = L2Context> {
    (9u32..=21, any::<bool>(), any::<bool>(), any::<bool>()).prop_map(|(bits, ext, df, v2)| {
        let extended = ext && bits >= 14;
        L2Context {
            geometry: Geometry::new(bits, extended).unwrap(),
            external_data_file: df && !v2,
            v2: v2 && !extended,
        }
    })
}

fn arb_entry(ctx: L2Context) -> impl Strategy<Value = L2Entry> {
    let bits = ctx.geometry.cluster_bits();
    let cluster = 0u64..(1 << (56 - bits));
    let df = ctx.external_data_file;
    let mut options = vec![
        Just(L2Entry::Unallocated).boxed(),
        (cluster.clone(), any::<bool>())
            .prop_map(move |(c, copied)| {
                let c = if c == 0 && !(df && copied) { 1 } else { c };
                L2Entry::Normal {
                    host: HostOffset(c << bits),
                    copied,
                }
            })
            .boxed(),
    ];
    if !ctx.geometry.extended_l2() && !ctx.v2 {
        options.push(
            (cluster, any::<bool>())
                .prop_map(move |(c, copied)| L2Entry::Zero {
                    preallocated: (c != 0).then_some(HostOffset(c << bits)),
                    copied,
                })
                .boxed(),
        );
    }
    if !df {
        let layout = crate::compressed::CompressedLayout::new(bits).unwrap();
        options.push(
            (0..=layout.max_offset(), 0..=layout.max_additional_sectors())
                .prop_map(move |(off, n)| {
                    let raw = off | (n << layout.offset_bits);
                    L2Entry::Compressed(CompressedDescriptor::decode(raw, bits, 0).unwrap())
                })
                .boxed(),
        );
    }
    prop::strategy::Union::new(options)
}

fn arb_ctx_and_entry() -> impl Strategy<Value = (L2Context, L2Entry)> {
    arb_ctx().prop_flat_map(|ctx| (Just(ctx), arb_entry(ctx)))
}

/// A valid bitmap for `entry`: anything for normal clusters (overlap removed), zero bits only
/// for unallocated ones, nothing for compressed ones.
fn valid_bitmap(entry: &L2Entry, word: u64) -> SubclusterBitmap {
    let b = SubclusterBitmap::from_word(word);
    match entry {
        L2Entry::Normal { .. } => SubclusterBitmap {
            alloc: b.alloc & !b.zero,
            zero: b.zero,
        },
        L2Entry::Unallocated => SubclusterBitmap {
            alloc: 0,
            zero: b.zero,
        },
        _ => SubclusterBitmap::EMPTY,
    }
}

proptest! {
    #[test]
    fn standard_entries_decode_what_they_encode((ctx, e) in arb_ctx_and_entry()) {
        prop_assert_eq!(L2Entry::decode(e.encode(), &ctx, 0).unwrap(), e);
    }

    #[test]
    fn valid_raw_words_encode_back_bit_for_bit(ctx in arb_ctx(), raw in any::<u64>()) {
        let cs = ctx.geometry.cluster_size();
        let zero_ok = !ctx.geometry.extended_l2() && !ctx.v2;
        let mut valid = raw & (L2E_OFFSET_MASK | QCOW_OFLAG_COPIED) & !(cs - 1);
        if zero_ok {
            valid |= raw & QCOW_OFLAG_ZERO;
        }
        // COPIED on an entry without a host cluster carries no information and is dropped.
        if valid & (L2E_OFFSET_MASK | QCOW_OFLAG_ZERO) == 0 && !ctx.external_data_file {
            valid &= !QCOW_OFLAG_COPIED;
        }
        let e = L2Entry::decode(valid, &ctx, 0).unwrap();
        prop_assert_eq!(e.encode(), valid);
    }

    #[test]
    fn valid_compressed_words_encode_back_bit_for_bit(ctx in arb_ctx(), raw in any::<u64>()) {
        prop_assume!(!ctx.external_data_file);
        let layout = crate::compressed::CompressedLayout::new(ctx.geometry.cluster_bits()).unwrap();
        let count = (raw >> layout.offset_bits) & layout.max_additional_sectors();
        let valid = QCOW_OFLAG_COMPRESSED | (raw & layout.max_offset()) | (count << layout.offset_bits);
        let e = L2Entry::decode(valid, &ctx, 0).unwrap();
        prop_assert_eq!(e.encode(), valid);
    }

    #[test]
    fn extended_entries_decode_what_they_encode(
        (ctx, entry) in arb_ctx_and_entry(), word in any::<u64>(),
    ) {
        prop_assume!(ctx.geometry.extended_l2());
        let e = ExtendedL2Entry { entry, bitmap: valid_bitmap(&entry, word) };
        let [w, b] = e.encode();
        prop_assert_eq!(ExtendedL2Entry::decode(w, b, &ctx, 0).unwrap(), e);
        let any = AnyL2Entry::Extended(e);
        prop_assert_eq!(decode_slice(&encode_slice(&[any, any]), &ctx, 0).unwrap(), vec![any, any]);
    }

    #[test]
    fn standard_slices_round_trip(
        (ctx, entries) in arb_ctx().prop_flat_map(|ctx| {
            (Just(ctx), prop::collection::vec(arb_entry(ctx), 0..16))
        }),
    ) {
        prop_assume!(!ctx.geometry.extended_l2());
        let any: Vec<_> = entries.into_iter().map(AnyL2Entry::Standard).collect();
        prop_assert_eq!(decode_slice(&encode_slice(&any), &ctx, 0).unwrap(), any);
    }

    #[test]
    fn runs_cover_every_subcluster_with_its_state_and_are_maximal(
        (ctx, entry) in arb_ctx_and_entry(), word in any::<u64>(),
    ) {
        prop_assume!(ctx.geometry.extended_l2());
        let e = ExtendedL2Entry { entry, bitmap: SubclusterBitmap::from_word(word) };
        let runs: Vec<_> = e.runs().collect();
        let mut next = 0;
        for (i, &(first, count, state)) in runs.iter().enumerate() {
            prop_assert_eq!(first.0, next);
            prop_assert!(count > 0);
            for sc in first.0..first.0 + count {
                prop_assert_eq!(e.state(SubclusterIndex(sc)), state);
            }
            if i > 0 {
                prop_assert_ne!(runs[i - 1].2, state);
            }
            next += count;
        }
        prop_assert_eq!(next, 32);
    }

    #[test]
    fn decoding_arbitrary_words_never_panics(
        ctx in arb_ctx(), word in any::<u64>(), bitmap in any::<u64>(), at in any::<u64>(),
    ) {
        let _ = L2Entry::decode(word, &ctx, at);
        if let Ok(e) = ExtendedL2Entry::decode(word, bitmap, &ctx, at) {
            prop_assert!(e.validate(at).is_ok());
        }
    }
}

#[test]
fn set_copied_flips_only_bit_63_of_the_entry() {
    let mut slice = vec![0u8; 32];
    slice[16..24].copy_from_slice(&0x0000_0000_0001_0201u64.to_be_bytes());
    set_copied(&mut slice, 1, 16, true).unwrap();
    assert_eq!(
        u64::from_be_bytes(slice[16..24].try_into().unwrap()),
        0x8000_0000_0001_0201
    );
    set_copied(&mut slice, 1, 16, false).unwrap();
    assert_eq!(
        u64::from_be_bytes(slice[16..24].try_into().unwrap()),
        0x0000_0000_0001_0201
    );
    assert!(slice[..16].iter().chain(&slice[24..]).all(|&b| b == 0));
    assert!(set_copied(&mut slice, 2, 16, true).is_err());
    assert!(set_copied(&mut slice, 4, 8, true).is_err());
}

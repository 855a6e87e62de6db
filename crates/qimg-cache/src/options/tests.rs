use super::*;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const GIB: u64 = 1024 * MIB;
const TIB: u64 = 1024 * GIB;

fn image(virtual_size: u64, cluster_size: u64, extended_l2: bool) -> ImageFacts {
    ImageFacts {
        virtual_size,
        cluster_size,
        extended_l2,
    }
}

fn standard(virtual_size: u64) -> ImageFacts {
    image(virtual_size, 64 * KIB, false)
}

fn extended(virtual_size: u64) -> ImageFacts {
    image(virtual_size, 64 * KIB, true)
}

fn l2_only(bytes: u64) -> CacheOptions {
    CacheOptions {
        l2_cache_size: Some(bytes),
        ..CacheOptions::default()
    }
}

fn resolve(options: CacheOptions, facts: ImageFacts) -> ResolvedCache {
    options.resolve(facts).expect("options resolve")
}

#[test]
fn a_10_gib_image_gets_all_the_l2_cache_it_needs_in_cluster_sized_slices() {
    let r = resolve(CacheOptions::default(), standard(10 * GIB));
    assert_eq!(r.l2_cache_bytes, 1280 * KIB);
    assert_eq!(r.l2_slice_size, 64 * KIB);
    assert_eq!(r.l2_entries(), 20);
    assert_eq!(r.refcount_cache_bytes, 4 * 64 * KIB);
    assert_eq!(r.refcount_slice_size, 4 * KIB);
    assert_eq!(r.clean_interval, Some(Duration::from_secs(600)));
}

#[test]
fn a_1_tib_image_defaults_to_32_mib_of_l2_cache_in_4_kib_slices() {
    let r = resolve(CacheOptions::default(), standard(TIB));
    assert_eq!(r.l2_cache_bytes, 32 * MIB);
    assert_eq!(r.l2_slice_size, 4096);
    assert_eq!(r.l2_entries(), 8192);
}

#[test]
fn one_mib_of_l2_cache_covers_8_gib_at_64_kib_clusters() {
    let facts = standard(8 * GIB);
    assert_eq!(facts.l2_bytes_needed(), Ok(MIB));
    let r = resolve(l2_only(MIB), facts);
    assert_eq!(r.l2_cache_bytes, MIB);
    assert_eq!(r.l2_slice_size, 64 * KIB, "covers the disk: whole tables");
}

#[test]
fn one_mib_of_l2_cache_covers_only_4_gib_with_extended_l2() {
    let covered = resolve(l2_only(MIB), extended(4 * GIB));
    assert_eq!(covered.l2_cache_bytes, MIB);
    assert_eq!(covered.l2_slice_size, 64 * KIB);

    let not_covered = resolve(l2_only(MIB), extended(8 * GIB));
    assert_eq!(not_covered.l2_cache_bytes, MIB);
    assert_eq!(not_covered.l2_slice_size, 4096);
}

#[test]
fn extended_l2_images_need_twice_the_l2_cache() {
    assert_eq!(standard(10 * GIB).l2_bytes_needed(), Ok(1280 * KIB));
    assert_eq!(extended(10 * GIB).l2_bytes_needed(), Ok(2560 * KIB));
    let r = resolve(CacheOptions::default(), extended(10 * GIB));
    assert_eq!(r.l2_cache_bytes, 2560 * KIB);
    let r = resolve(CacheOptions::default(), extended(TIB));
    assert_eq!(r.l2_cache_bytes, 32 * MIB, "still capped at 32 MiB");
}

#[test]
fn l2_needed_rounds_up_to_whole_clusters() {
    // 1 MiB at 64 KiB clusters is 16 entries = 128 bytes -> one cluster.
    assert_eq!(standard(MIB).l2_bytes_needed(), Ok(64 * KIB));
    // A partial cluster of guest data still needs an entry.
    assert_eq!(standard(1).l2_bytes_needed(), Ok(64 * KIB));
    assert_eq!(standard(0).l2_bytes_needed(), Ok(0));
}

#[test]
fn the_l2_cache_never_grows_beyond_what_the_disk_needs() {
    let r = resolve(l2_only(64 * MIB), standard(10 * GIB));
    assert_eq!(r.l2_cache_bytes, 1280 * KIB);
}

#[test]
fn the_l2_cache_holds_at_least_two_slices() {
    let r = resolve(l2_only(1), standard(TIB));
    assert_eq!(r.l2_entries(), 2);
    assert_eq!(r.l2_cache_bytes, 2 * 4096);

    let tiny = resolve(CacheOptions::default(), standard(MIB));
    assert_eq!(tiny.l2_slice_size, 64 * KIB);
    assert_eq!(tiny.l2_entries(), 2, "even though one table maps the disk");

    let empty = resolve(CacheOptions::default(), standard(0));
    assert_eq!(empty.l2_entries(), 2);
}

#[test]
fn refcount_cache_entry_size_sets_the_refcount_slices() {
    let asked = |size| CacheOptions {
        refcount_cache_entry_size: Some(size),
        ..CacheOptions::default()
    };
    let r = resolve(asked(512), standard(GIB));
    assert_eq!(r.refcount_slice_size, 512);
    assert_eq!(
        r.refcount_cache_bytes,
        4 * 64 * KIB,
        "the budget does not change"
    );
    assert_eq!(r.refcount_entries(), 512);
    assert_eq!(
        resolve(asked(64 * KIB), standard(GIB)).refcount_slice_size,
        64 * KIB
    );
    for bad in [0, 256, 3000, 128 * KIB] {
        let e = asked(bad).resolve(standard(GIB)).unwrap_err();
        assert_eq!(
            e,
            CacheError::InvalidRefcountEntrySize {
                value: bad,
                cluster_size: 64 * KIB
            }
        );
        assert!(e.to_string().contains("refcount-cache-entry-size"), "{e}");
    }
}

#[test]
fn the_refcount_cache_holds_at_least_four_clusters() {
    let options = CacheOptions {
        refcount_cache_size: Some(1),
        ..CacheOptions::default()
    };
    let r = resolve(options, standard(GIB));
    assert_eq!(r.refcount_entries(), 64, "four clusters of 4 KiB slices");
    assert_eq!(r.refcount_cache_bytes, 4 * 64 * KIB);
}

#[test]
fn setting_all_three_sizes_is_refused_naming_them() {
    let options = CacheOptions {
        l2_cache_size: Some(MIB),
        refcount_cache_size: Some(MIB),
        cache_size: Some(4 * MIB),
        ..CacheOptions::default()
    };
    let err = options.resolve(standard(GIB)).unwrap_err();
    assert_eq!(err, CacheError::ConflictingSizes);
    assert_eq!(
        err.to_string(),
        "cache-size, l2-cache-size and refcount-cache-size may not be set at the same time"
    );
}

#[test]
fn a_lone_cache_size_above_the_need_gives_l2_its_need_and_refcount_the_rest() {
    let options = CacheOptions {
        cache_size: Some(4 * MIB),
        ..CacheOptions::default()
    };
    let r = resolve(options, standard(10 * GIB));
    assert_eq!(r.l2_cache_bytes, 1280 * KIB);
    assert_eq!(r.l2_slice_size, 64 * KIB);
    assert_eq!(r.refcount_cache_bytes, 4 * MIB - 1280 * KIB);
}

#[test]
fn a_lone_cache_size_below_the_need_gives_refcount_four_clusters_and_l2_the_rest() {
    let options = CacheOptions {
        cache_size: Some(2 * MIB),
        ..CacheOptions::default()
    };
    let r = resolve(options, standard(TIB));
    assert_eq!(r.refcount_cache_bytes, 256 * KIB);
    assert_eq!(r.l2_cache_bytes, 2 * MIB - 256 * KIB);
    assert_eq!(r.l2_slice_size, 4096);
}

#[test]
fn a_lone_cache_size_just_short_of_need_plus_four_clusters_takes_the_small_branch() {
    let need = 1280 * KIB;
    let options = CacheOptions {
        cache_size: Some(need + 4 * 64 * KIB - 1),
        ..CacheOptions::default()
    };
    let r = resolve(options, standard(10 * GIB));
    assert_eq!(r.refcount_cache_bytes, 256 * KIB);
    // L2 gets need - 1 bytes, does not cover the disk, so 4 KiB slices.
    assert_eq!(r.l2_slice_size, 4096);
    assert_eq!(r.l2_cache_bytes, (need - 1) / 4096 * 4096);
}

#[test]
fn a_tiny_cache_size_still_gets_the_minimum_of_both_caches() {
    let options = CacheOptions {
        cache_size: Some(100 * KIB),
        ..CacheOptions::default()
    };
    let r = resolve(options, standard(TIB));
    assert_eq!(r.refcount_cache_bytes, 4 * 64 * KIB);
    assert_eq!(r.l2_entries(), 2);
}

#[test]
fn cache_size_with_l2_cache_size_gives_refcount_the_rest() {
    let options = CacheOptions {
        cache_size: Some(8 * MIB),
        l2_cache_size: Some(2 * MIB),
        ..CacheOptions::default()
    };
    let r = resolve(options, standard(TIB));
    assert_eq!(r.l2_cache_bytes, 2 * MIB);
    assert_eq!(r.refcount_cache_bytes, 6 * MIB);

    // L2 capped at its need: refcount gets what L2 could not use, as in QEMU.
    let r = resolve(options, standard(10 * GIB));
    assert_eq!(r.l2_cache_bytes, 1280 * KIB);
    assert_eq!(r.refcount_cache_bytes, 8 * MIB - 1280 * KIB);
}

#[test]
fn cache_size_with_refcount_cache_size_gives_l2_the_rest_up_to_its_need() {
    let options = CacheOptions {
        cache_size: Some(8 * MIB),
        refcount_cache_size: Some(MIB),
        ..CacheOptions::default()
    };
    let r = resolve(options, standard(TIB));
    assert_eq!(r.l2_cache_bytes, 7 * MIB);
    assert_eq!(r.refcount_cache_bytes, MIB);

    let r = resolve(options, standard(10 * GIB));
    assert_eq!(r.l2_cache_bytes, 1280 * KIB);
}

#[test]
fn l2_cache_size_above_cache_size_is_refused() {
    let options = CacheOptions {
        cache_size: Some(MIB),
        l2_cache_size: Some(2 * MIB),
        ..CacheOptions::default()
    };
    let err = options.resolve(standard(TIB)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "l2-cache-size (2097152) may not exceed cache-size (1048576)"
    );
}

#[test]
fn refcount_cache_size_above_cache_size_is_refused() {
    let options = CacheOptions {
        cache_size: Some(MIB),
        refcount_cache_size: Some(2 * MIB),
        ..CacheOptions::default()
    };
    let err = options.resolve(standard(TIB)).unwrap_err();
    assert_eq!(
        err,
        CacheError::RefcountExceedsCacheSize {
            refcount_cache_size: 2 * MIB,
            cache_size: MIB
        }
    );
}

#[test]
fn an_entry_size_that_is_not_a_power_of_two_in_range_is_refused_naming_it() {
    for bad in [0, 256, 3000, 128 * KIB] {
        let options = CacheOptions {
            l2_cache_entry_size: Some(bad),
            ..CacheOptions::default()
        };
        let err = options.resolve(standard(GIB)).unwrap_err();
        assert_eq!(
            err,
            CacheError::InvalidEntrySize {
                value: bad,
                cluster_size: 64 * KIB
            }
        );
        assert!(err.to_string().contains(&format!("({bad})")), "{err}");
    }
}

#[test]
fn an_explicit_entry_size_is_used_even_when_the_cache_covers_the_disk() {
    let options = CacheOptions {
        l2_cache_entry_size: Some(512),
        ..CacheOptions::default()
    };
    let r = resolve(options, standard(10 * GIB));
    assert_eq!(r.l2_slice_size, 512);
    assert_eq!(r.l2_cache_bytes, 1280 * KIB);
    assert_eq!(r.l2_entries(), 2560);
}

#[test]
fn small_clusters_use_cluster_sized_slices_even_when_the_disk_is_not_covered() {
    let r = resolve(CacheOptions::default(), image(TIB, 512, false));
    assert_eq!(r.l2_slice_size, 512);
    assert_eq!(r.l2_cache_bytes, 32 * MIB);
    assert_eq!(r.refcount_cache_bytes, 4 * 512);
}

#[test]
fn the_clean_interval_defaults_to_600_seconds_and_zero_disables_it() {
    let r = resolve(CacheOptions::default(), standard(GIB));
    assert_eq!(r.clean_interval, Some(Duration::from_secs(600)));
    let off = CacheOptions {
        cache_clean_interval: Some(0),
        ..CacheOptions::default()
    };
    assert_eq!(resolve(off, standard(GIB)).clean_interval, None);
    let five = CacheOptions {
        cache_clean_interval: Some(5),
        ..CacheOptions::default()
    };
    assert_eq!(
        resolve(five, standard(GIB)).clean_interval,
        Some(Duration::from_secs(5))
    );
}

#[test]
fn silly_sizes_are_refused_naming_the_option() {
    let cases = [
        (
            "l2-cache-size",
            CacheOptions {
                l2_cache_size: Some(u64::MAX),
                ..CacheOptions::default()
            },
        ),
        (
            "refcount-cache-size",
            CacheOptions {
                refcount_cache_size: Some(MAX_CACHE_BYTES + 1),
                ..CacheOptions::default()
            },
        ),
        (
            "cache-size",
            CacheOptions {
                cache_size: Some(1 << 50),
                ..CacheOptions::default()
            },
        ),
        (
            "l2-cache-entry-size",
            CacheOptions {
                l2_cache_entry_size: Some(u64::MAX),
                ..CacheOptions::default()
            },
        ),
        (
            "cache-clean-interval",
            CacheOptions {
                cache_clean_interval: Some(u64::from(u32::MAX) + 1),
                ..CacheOptions::default()
            },
        ),
    ];
    for (name, options) in cases {
        match options.resolve(standard(TIB)) {
            Err(CacheError::OptionTooLarge { option, .. }) => assert_eq!(option, name),
            other => panic!("{name}: expected OptionTooLarge, got {other:?}"),
        }
    }
}

#[test]
fn a_one_tib_budget_is_accepted() {
    let r = resolve(l2_only(MAX_CACHE_BYTES), standard(u64::MAX));
    assert_eq!(r.l2_cache_bytes, MAX_CACHE_BYTES);
}

#[test]
fn an_invalid_cluster_size_is_refused() {
    for bad in [0, 256, 3 * 4096, 4 * MIB] {
        assert_eq!(
            CacheOptions::default().resolve(image(GIB, bad, false)),
            Err(CacheError::InvalidClusterSize { cluster_size: bad })
        );
    }
}

#[test]
fn the_largest_virtual_size_does_not_overflow() {
    for cluster_size in [512, 64 * KIB, 2 * MIB] {
        for extended_l2 in [false, true] {
            let facts = image(u64::MAX, cluster_size, extended_l2);
            let r = resolve(CacheOptions::default(), facts);
            assert_eq!(r.l2_cache_bytes, 32 * MIB);
            let all = CacheOptions {
                cache_size: Some(MAX_CACHE_BYTES),
                ..CacheOptions::default()
            };
            resolve(all, facts);
        }
    }
}

#[test]
fn resolved_budgets_build_caches_of_the_resolved_shape() {
    let r = resolve(CacheOptions::default(), standard(TIB));
    let l2 = r.new_l2_cache().expect("l2 cache");
    assert_eq!(l2.slice_size(), 4096);
    assert_eq!(l2.capacity(), 8192);
    let refcount = r.new_refcount_cache().expect("refcount cache");
    assert_eq!(refcount.slice_size(), 4096);
    assert_eq!(
        refcount.capacity(),
        64,
        "four 64 KiB clusters of 4 KiB slices"
    );
    let small = resolve(CacheOptions::default(), image(TIB, 1024, false));
    let refcount = small.new_refcount_cache().expect("refcount cache");
    assert_eq!(
        refcount.slice_size(),
        1024,
        "a whole block when clusters are smaller"
    );
}

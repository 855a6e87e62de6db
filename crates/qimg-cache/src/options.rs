//! Cache budgets from QEMU's option names (`qcow2.c`, `read_cache_sizes`).

use std::time::Duration;

use crate::slice_cache::{MAX_CACHE_BYTES, MIN_CACHE_ENTRIES};
use crate::{CacheError, SliceCache};

/// Default upper bound of the L2 cache (QEMU's `DEFAULT_L2_CACHE_MAX_SIZE` on Linux).
pub const DEFAULT_L2_CACHE_MAX_SIZE: u64 = 32 * 1024 * 1024;
/// Fewest L2 slices a cache holds (QEMU's `MIN_L2_CACHE_SIZE`).
pub const MIN_L2_CACHE_ENTRIES: u64 = MIN_CACHE_ENTRIES;
/// Fewest refcount blocks a cache holds (QEMU's `MIN_REFCOUNT_CACHE_SIZE`).
pub const MIN_REFCOUNT_CACHE_ENTRIES: u64 = 4;
/// Default `cache-clean-interval`, in seconds (QEMU's default on Linux).
pub const DEFAULT_CACHE_CLEAN_INTERVAL_SECS: u64 = 600;
/// Largest `cache-clean-interval` accepted, in seconds (QEMU's `UINT_MAX`).
pub const MAX_CACHE_CLEAN_INTERVAL_SECS: u64 = u32::MAX as u64;
/// Smallest `l2-cache-entry-size`.
pub const MIN_L2_CACHE_ENTRY_SIZE: u64 = 512;
/// Largest slice size used when the L2 cache cannot cover the whole disk.
pub const SMALL_L2_CACHE_ENTRY_SIZE: u64 = 4096;
/// Bytes per refcount slice (smaller clusters: the whole block). QEMU caches whole refcount
/// blocks; with 2 MiB clusters its first allocation reads 2 MiB where 4 KiB serve.
pub const REFCOUNT_SLICE_SIZE: u64 = 4096;

/// The cache options an image is opened with, named and measured as QEMU's
/// qcow2 driver options (`None` = not given).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheOptions {
    /// `l2-cache-size`: most bytes of L2 slices.
    pub l2_cache_size: Option<u64>,
    /// `l2-cache-entry-size`: bytes per L2 slice.
    pub l2_cache_entry_size: Option<u64>,
    /// `refcount-cache-size`: most bytes of refcount blocks.
    pub refcount_cache_size: Option<u64>,
    /// `refcount-cache-entry-size`: bytes per refcount slice, a power of two from 512 to the
    /// cluster size; [`REFCOUNT_SLICE_SIZE`] (or the cluster, if smaller) when not given.
    /// qimg's own option: QEMU has none and caches whole refcount blocks.
    pub refcount_cache_entry_size: Option<u64>,
    /// `cache-size`: most bytes of both caches together.
    pub cache_size: Option<u64>,
    /// `cache-clean-interval`: seconds between passes dropping idle slices; 0 disables.
    pub cache_clean_interval: Option<u64>,
}

/// What the budgets depend on in the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageFacts {
    /// Guest-visible size in bytes.
    pub virtual_size: u64,
    /// Cluster size in bytes (a power of two from 512 to 2 MiB).
    pub cluster_size: u64,
    /// Whether L2 entries are extended (16 bytes instead of 8).
    pub extended_l2: bool,
}

impl ImageFacts {
    /// Bytes per L2 entry: 16 with extended L2 entries, else 8.
    pub fn l2_entry_size(&self) -> u64 {
        if self.extended_l2 { 16 } else { 8 }
    }

    /// Bytes of L2 tables needed to map the whole virtual disk, rounded up to
    /// whole clusters: the largest useful L2 cache.
    pub fn l2_bytes_needed(&self) -> Result<u64, CacheError> {
        self.check_cluster_size()?;
        let overflow = CacheError::VirtualSizeTooLarge {
            virtual_size: self.virtual_size,
        };
        let clusters = self.virtual_size.div_ceil(self.cluster_size);
        clusters
            .checked_mul(self.l2_entry_size())
            .and_then(|bytes| bytes.checked_next_multiple_of(self.cluster_size))
            .ok_or(overflow)
    }

    fn check_cluster_size(&self) -> Result<(), CacheError> {
        let cluster_size = self.cluster_size;
        if cluster_size.is_power_of_two()
            && (crate::MIN_SLICE_SIZE..=crate::MAX_SLICE_SIZE).contains(&cluster_size)
        {
            Ok(())
        } else {
            Err(CacheError::InvalidClusterSize { cluster_size })
        }
    }
}

/// Budgets ready to build the two caches with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResolvedCache {
    /// Bytes of the L2 cache: a whole number of slices, at least two.
    pub l2_cache_bytes: u64,
    /// Bytes per L2 slice.
    pub l2_slice_size: u64,
    /// Bytes of the refcount cache: a whole number of clusters, at least four.
    pub refcount_cache_bytes: u64,
    /// Bytes per refcount slice: [`REFCOUNT_SLICE_SIZE`], or the cluster (a whole refcount
    /// block) where clusters are smaller.
    pub refcount_slice_size: u64,
    /// Period of the idle-slice clean pass; `None` when disabled.
    pub clean_interval: Option<Duration>,
}

impl ResolvedCache {
    /// Number of L2 slices.
    pub fn l2_entries(&self) -> u64 {
        self.l2_cache_bytes / self.l2_slice_size.max(1)
    }

    /// Number of refcount slices.
    pub fn refcount_entries(&self) -> u64 {
        self.refcount_cache_bytes / self.refcount_slice_size.max(1)
    }

    /// An empty L2 cache with these budgets.
    pub fn new_l2_cache(&self) -> Result<SliceCache, CacheError> {
        SliceCache::new(self.l2_cache_bytes, self.l2_slice_size)
    }

    /// An empty refcount cache with these budgets.
    pub fn new_refcount_cache(&self) -> Result<SliceCache, CacheError> {
        SliceCache::new(self.refcount_cache_bytes, self.refcount_slice_size)
    }
}

fn bounded(option: &'static str, value: Option<u64>, max: u64) -> Result<Option<u64>, CacheError> {
    match value {
        Some(value) if value > max => Err(CacheError::OptionTooLarge { option, value, max }),
        other => Ok(other),
    }
}

impl CacheOptions {
    /// Resolves the options against an image the way QEMU does.
    ///
    /// * At most two of `cache-size`, `l2-cache-size`, `refcount-cache-size`.
    /// * L2 gets `min(l2-cache-size or 32 MiB, needed)`, where `needed` is
    ///   [`ImageFacts::l2_bytes_needed`]: more could never be used.
    /// * With `cache-size` and one of the others, the other gets the rest
    ///   (the L2 share again capped at `needed`; QEMU leaves that excess
    ///   allocated but unused). With `cache-size` alone: if it is at least
    ///   `needed` plus four clusters, L2 gets `needed` and refcount the rest;
    ///   else refcount gets `min(cache-size, 4 clusters)` and L2 the rest.
    /// * Slice size: `l2-cache-entry-size` if given, else the cluster size if
    ///   the L2 cache covers the whole disk, else `min(cluster size, 4096)`;
    ///   a power of two from 512 to the cluster size.
    /// * Refcount slices: `refcount-cache-entry-size` if given (qimg's own),
    ///   else [`REFCOUNT_SLICE_SIZE`] or the cluster size if smaller, where QEMU
    ///   caches whole blocks; a power of two from 512 to the cluster size.
    /// * Sizes round down to whole slices, then up to at least two L2 slices
    ///   and four refcount clusters.
    /// * `cache-clean-interval` defaults to 600 seconds; 0 disables it.
    /// * Sizes above 1 TiB and intervals above `u32::MAX` seconds are errors.
    pub fn resolve(&self, facts: ImageFacts) -> Result<ResolvedCache, CacheError> {
        let cluster_size = facts.cluster_size;
        let needed = facts.l2_bytes_needed()?;

        let l2_set = bounded("l2-cache-size", self.l2_cache_size, MAX_CACHE_BYTES)?;
        let refcount_set = bounded(
            "refcount-cache-size",
            self.refcount_cache_size,
            MAX_CACHE_BYTES,
        )?;
        let combined = bounded("cache-size", self.cache_size, MAX_CACHE_BYTES)?;
        let entry_size_set = bounded(
            "l2-cache-entry-size",
            self.l2_cache_entry_size,
            MAX_CACHE_BYTES,
        )?;
        let refcount_entry_size_set = bounded(
            "refcount-cache-entry-size",
            self.refcount_cache_entry_size,
            MAX_CACHE_BYTES,
        )?;
        let interval = bounded(
            "cache-clean-interval",
            self.cache_clean_interval,
            MAX_CACHE_CLEAN_INTERVAL_SECS,
        )?
        .unwrap_or(DEFAULT_CACHE_CLEAN_INTERVAL_SECS);

        let min_refcount = MIN_REFCOUNT_CACHE_ENTRIES * cluster_size;
        let mut l2 = needed.min(l2_set.unwrap_or(DEFAULT_L2_CACHE_MAX_SIZE));
        let mut refcount = refcount_set.unwrap_or(0);

        if let Some(combined) = combined {
            match (l2_set, refcount_set) {
                (Some(_), Some(_)) => return Err(CacheError::ConflictingSizes),
                (Some(l2_cache_size), None) => {
                    if l2_cache_size > combined {
                        return Err(CacheError::L2ExceedsCacheSize {
                            l2_cache_size,
                            cache_size: combined,
                        });
                    }
                    // l2 <= l2_cache_size <= combined.
                    refcount = combined - l2;
                }
                (None, Some(refcount_cache_size)) => {
                    if refcount_cache_size > combined {
                        return Err(CacheError::RefcountExceedsCacheSize {
                            refcount_cache_size,
                            cache_size: combined,
                        });
                    }
                    l2 = needed.min(combined - refcount_cache_size);
                }
                (None, None) => {
                    // needed <= 2^59 and min_refcount <= 2^23, so no overflow.
                    if combined >= needed.saturating_add(min_refcount) {
                        l2 = needed;
                        refcount = combined - needed;
                    } else {
                        refcount = combined.min(min_refcount);
                        l2 = combined - refcount;
                    }
                }
            }
        }

        let l2_slice_size = match entry_size_set {
            Some(size) => size,
            None if l2 >= needed => cluster_size,
            None => cluster_size.min(SMALL_L2_CACHE_ENTRY_SIZE),
        };
        if !l2_slice_size.is_power_of_two()
            || !(MIN_L2_CACHE_ENTRY_SIZE..=cluster_size).contains(&l2_slice_size)
        {
            return Err(CacheError::InvalidEntrySize {
                value: l2_slice_size,
                cluster_size,
            });
        }

        let refcount_slice_size =
            refcount_entry_size_set.unwrap_or(cluster_size.min(REFCOUNT_SLICE_SIZE));
        if !refcount_slice_size.is_power_of_two()
            || !(MIN_L2_CACHE_ENTRY_SIZE..=cluster_size).contains(&refcount_slice_size)
        {
            return Err(CacheError::InvalidRefcountEntrySize {
                value: refcount_slice_size,
                cluster_size,
            });
        }

        // At most 2^40 / 512 = 2^31 slices of at most 2^21 bytes: no overflow.
        let l2_entries = (l2 / l2_slice_size).max(MIN_L2_CACHE_ENTRIES);
        let refcount_clusters = (refcount / cluster_size).max(MIN_REFCOUNT_CACHE_ENTRIES);

        Ok(ResolvedCache {
            l2_cache_bytes: l2_entries * l2_slice_size,
            l2_slice_size,
            refcount_cache_bytes: refcount_clusters * cluster_size,
            refcount_slice_size,
            clean_interval: (interval != 0).then(|| Duration::from_secs(interval)),
        })
    }
}

#[cfg(test)]
mod tests {
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
}

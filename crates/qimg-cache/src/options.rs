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
mod tests;

//! The crate's one error type.

use crate::SliceKey;

/// Everything that can go wrong when resolving cache options or driving a
/// [`SliceCache`](crate::SliceCache).
///
/// Option errors name the option the way QEMU spells it (`l2-cache-size`, ...)
/// and carry the offending value; cache errors carry the slice concerned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CacheError {
    /// `cache-size`, `l2-cache-size` and `refcount-cache-size` were all given.
    #[error("cache-size, l2-cache-size and refcount-cache-size may not be set at the same time")]
    ConflictingSizes,

    /// `l2-cache-size` is larger than `cache-size`.
    #[error("l2-cache-size ({l2_cache_size}) may not exceed cache-size ({cache_size})")]
    L2ExceedsCacheSize {
        /// The `l2-cache-size` value given.
        l2_cache_size: u64,
        /// The `cache-size` value given.
        cache_size: u64,
    },

    /// `refcount-cache-size` is larger than `cache-size`.
    #[error("refcount-cache-size ({refcount_cache_size}) may not exceed cache-size ({cache_size})")]
    RefcountExceedsCacheSize {
        /// The `refcount-cache-size` value given.
        refcount_cache_size: u64,
        /// The `cache-size` value given.
        cache_size: u64,
    },

    /// A size or interval option is beyond what this crate accepts.
    #[error("{option} ({value}) is too large: at most {max} is accepted")]
    OptionTooLarge {
        /// QEMU's name of the option.
        option: &'static str,
        /// The value given.
        value: u64,
        /// The largest value accepted.
        max: u64,
    },

    /// `l2-cache-entry-size` is not a power of two between 512 and the cluster size.
    #[error(
        "l2-cache-entry-size ({value}) must be a power of two between 512 and the cluster size ({cluster_size})"
    )]
    InvalidEntrySize {
        /// The entry size given.
        value: u64,
        /// The image's cluster size.
        cluster_size: u64,
    },

    /// `refcount-cache-entry-size` is not a power of two between 512 and the cluster size.
    #[error(
        "refcount-cache-entry-size ({value}) must be a power of two between 512 and the cluster size ({cluster_size})"
    )]
    InvalidRefcountEntrySize {
        /// The entry size given.
        value: u64,
        /// The image's cluster size.
        cluster_size: u64,
    },

    /// The image facts name a cluster size qcow2 cannot have.
    #[error("cluster size {cluster_size} is not a power of two between 512 and 2 MiB")]
    InvalidClusterSize {
        /// The cluster size given.
        cluster_size: u64,
    },

    /// A slice size handed to [`SliceCache::new`](crate::SliceCache::new) is not a
    /// power of two between 512 bytes and 2 MiB.
    #[error("slice size {slice_size} is not a power of two between 512 and 2 MiB")]
    InvalidSliceSize {
        /// The slice size given.
        slice_size: u64,
    },

    /// The byte budget holds fewer slices than the minimum a cache needs.
    #[error(
        "a budget of {budget} bytes holds fewer than {min_entries} slices of {slice_size} bytes"
    )]
    BudgetTooSmall {
        /// The budget given, in bytes.
        budget: u64,
        /// The slice size given, in bytes.
        slice_size: u64,
        /// The fewest slices a cache must be able to hold.
        min_entries: u64,
    },

    /// A byte budget beyond what this crate accepts.
    #[error("a budget of {budget} bytes is too large: at most {max} is accepted")]
    BudgetTooLarge {
        /// The budget given, in bytes.
        budget: u64,
        /// The largest budget accepted, in bytes.
        max: u64,
    },

    /// Slice bytes of the wrong length were offered to the cache.
    #[error("slice {key} has {actual} bytes, but this cache holds slices of {expected} bytes")]
    WrongSliceLength {
        /// The slice concerned.
        key: SliceKey,
        /// The cache's slice size.
        expected: usize,
        /// The length offered.
        actual: usize,
    },

    /// The slice is already cached; inserting it again could lose a dirty copy.
    #[error("slice {key} is already cached")]
    AlreadyCached {
        /// The slice concerned.
        key: SliceKey,
    },

    /// The slice is not in the cache.
    #[error("slice {key} is not cached")]
    NotCached {
        /// The slice concerned.
        key: SliceKey,
    },

    /// The cache is full and every slice in it is pinned, so nothing can be evicted.
    #[error("all {capacity} cached slices are pinned; nothing can be evicted")]
    AllPinned {
        /// The cache's capacity in slices.
        capacity: usize,
    },

    /// The slice is pinned, so it cannot be removed.
    #[error("slice {key} is pinned ({pins} pins) and cannot be removed")]
    Pinned {
        /// The slice concerned.
        key: SliceKey,
        /// Its pin count.
        pins: u32,
    },

    /// `unpin` was called on a slice that is not pinned.
    #[error("slice {key} is not pinned")]
    NotPinned {
        /// The slice concerned.
        key: SliceKey,
    },

    /// A slice was pinned more than `u32::MAX` times.
    #[error("slice {key} cannot be pinned more than {} times", u32::MAX)]
    PinOverflow {
        /// The slice concerned.
        key: SliceKey,
    },

    /// The virtual size is so large that the L2 size computation overflows.
    #[error("virtual size {virtual_size} is too large to compute an L2 cache size for")]
    VirtualSizeTooLarge {
        /// The virtual size given.
        virtual_size: u64,
    },
}

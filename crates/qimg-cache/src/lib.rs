//! Slice-granular LRU cache policy (in progress).

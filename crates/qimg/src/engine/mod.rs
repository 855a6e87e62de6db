//! The engine: an open [`Image`] and everything a request goes through.
//!
//! | module | what it holds |
//! |---|---|
//! | `open` | [`OpenOptions`], the [`Opener`] for referenced files, the backing-chain walk |
//! | `image` | the shared state behind an [`Image`] handle and its public async API |
//! | `meta` | the metadata lock: L1 table, L2 and refcount slice caches, allocation, write ordering |
//! | `rw` | read, write with copy-on-write planning, compressed writes, zero, discard, resize |
//! | `lock` | range locks that serialise overlapping guest requests |
//! | `overlap` | the index of metadata ranges that every metadata write is checked against |
//! | `rebuild` | the refcount rebuild of a dirty (lazy-refcounts) image |
//! | [`map`] | where guest data lives ([`Image::map`]) |
//! | [`lease`] | the VMM data path: write leases over host extents |
//! | [`blocking`] | a blocking facade over the async API |

pub mod blocking;
pub(crate) mod compress;
mod image;
pub mod lease;
mod lock;
pub mod map;
mod meta;
mod open;
pub(crate) mod overlap;
mod rebuild;
mod rw;
pub(crate) mod walk;

pub use blocking::BlockingImage;
pub use compress::{DecompressError, compress, decompress};
pub use image::{Image, Stats};
pub use lease::{HostExtent, WriteLease};
pub use map::{Extent, ExtentKind};
pub use open::{Allocation, Backing, FileOpener, OpenOptions, Opener};

//! The engine: an open [`Image`] and everything a request goes through.
//!
//! | module | what it holds |
//! |---|---|
//! | `options` | [`OpenOptions`] (the open builder), [`Trust`], [`Allocation`] |
//! | `open` | the [`Opener`] for referenced files, the backing-chain walk, checks at open |
//! | `state` | what the metadata code works on: files, geometry, options, flags, request checks |
//! | `bitmap_set` | the dirty bitmaps in memory (no I/O): what `state` holds of them |
//! | `image` | the [`Image`] handle and what it shares: state, backing image, metadata lock, range locks |
//! | `api` | every public method of [`Image`] (the bodies of some live with their mechanism below) |
//! | `meta` | the metadata lock: L1 table, L2 and refcount slice caches, allocation, write ordering |
//! | `rw` | read, write with copy-on-write planning, compressed writes, zero, discard, resize |
//! | `lock` | range locks that serialise overlapping guest requests |
//! | `overlap` | the index of metadata ranges that every metadata write is checked against |
//! | `walk` | the one metadata walker: every table read leniently from any `Storage`, every reference visited; reference counting and refcount block encoding shared by both rebuilds |
//! | `rebuild` | the refcount rebuild of a dirty (lazy-refcounts) image |
//! | [`map`] | where guest data lives ([`Image::map`]) |
//! | [`lease`] | the VMM data path: write leases over host extents |
//! | `checkpoint` | [`Image::transaction`]: snapshot and bitmap changes at one instant ([`Action`]) |
//! | `snapshot` | internal snapshots: list, create, apply, delete ([`InternalSnapshot`]) |
//! | `blocking` | `BlockingImage`: a blocking facade over the async API (feature `blocking`) |

mod api;
pub(crate) mod bitmap_set;
pub(crate) mod bitmaps;
#[cfg(feature = "blocking")]
pub mod blocking;
pub(crate) mod checkpoint;
pub(crate) mod compress;
mod image;
pub mod lease;
mod lock;
pub mod map;
mod meta;
mod open;
mod options;
pub(crate) mod overlap;
mod plan;
#[cfg(target_os = "linux")]
pub mod queue;
pub mod read_lease;
mod rebuild;
mod rw;
mod snapshot;
mod state;
pub(crate) mod walk;

pub use bitmap_set::{BitmapInfo, DirtyBitmap};
#[cfg(feature = "blocking")]
pub use blocking::BlockingImage;
pub use checkpoint::Action;
pub use compress::{DecompressError, compress, decompress};
pub use image::{Backing, Image, Stats};
pub use lease::{HostExtent, WriteLease};
pub use map::{Extent, ExtentKind};
pub use open::{FileOpener, Opener};
pub use options::{Allocation, OpenOptions, Trust, UntrustedLimits};
#[cfg(target_os = "linux")]
pub use queue::{Completion, Queue, QueueOptions, QueueStats, Request};
pub use read_lease::ReadLease;
pub use snapshot::{InternalSnapshot, SnapshotOptions};

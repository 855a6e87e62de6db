//! Persistent dirty bitmaps kept by a writer, as QEMU keeps them: loading, storing and keeping
//! them crash-consistent on disk (the in-memory set they work on is `engine/bitmap_set.rs`).
//!
//! A read-write open loads every bitmap of the image (the bitmaps extension, autoclear bit 0
//! set). One already marked `in_use` is *inconsistent* (its writer did not store it): it is
//! kept exactly as it is, never recorded into. The others are loaded into memory, and before
//! the first write the directory marks them all `in_use` on disk, so that a crash leaves them
//! inconsistent, as QEMU's writer does. Enabled (`auto`) bitmaps record every write,
//! write-zeroes and discard at their granularity ([`Bitmaps::mark`], called by every write
//! path before it changes anything); disabled ones are kept unchanged. Closing stores them:
//! the data clusters (an all-clear cluster needs none), the tables, then the directory with
//! `in_use` cleared.

mod live;
mod store;

pub(crate) use store::{Judged, entry_offsets, judge_bitmaps};

//! # qimg: qcow2 disk images with subcluster allocation
//!
//! `qimg` reads and writes qcow2 images, including images with extended L2 entries
//! (32 subclusters per cluster). This release provides image creation with every
//! `qemu-img create` option and read-only inspection (`qemu-img info`); the read/write
//! engine builds on the same format crate.
//!
//! ```no_run
//! use qimg::create::{create, CreateOptions};
//! use std::path::Path;
//!
//! let opts = CreateOptions {
//!     size: Some(10 << 30),
//!     extended_l2: true,
//!     cluster_size: 128 << 10,
//!     ..Default::default()
//! };
//! create(Path::new("disk.qcow2"), &opts, &mut |_, _| {})?;
//! let info = qimg::info::image_info(Path::new("disk.qcow2"), None)?;
//! assert_eq!(info.virtual_size, 10 << 30);
//! # Ok::<(), qimg::Error>(())
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod blocking;
pub mod check;
pub mod compress;
pub mod create;
pub mod error;
pub mod fuzzing;
mod image;
pub mod info;
pub mod lease;
mod lock;
pub mod map;
mod meta;
mod overlap;
mod rebuild;
mod rw;

pub use blocking::BlockingImage;
pub use error::{Error, Result};
pub use image::{
    Allocation, Backing, FileOpener, Image, MAX_BACKING_DEPTH, OpenOptions, Opener, Stats,
};
pub use lease::{HostExtent, WriteLease};
pub use map::{Extent, ExtentKind};
pub use qimg_cache::{CacheOptions, CacheStats};
/// The on-disk format crate, re-exported.
pub use qimg_format as format;
pub use qimg_io as io;

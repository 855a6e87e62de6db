//! # qimg: qcow2 disk images with subcluster allocation
//!
//! `qimg` reads and writes qcow2 images, including images with extended L2 entries
//! (32 subclusters per cluster). This release provides image creation with every
//! `qemu-img create` option and read-only inspection (`qemu-img info`); the read/write
//! engine builds on the same format crate.
//!
//! ```no_run
//! use qimg::tools::create::{create, CreateOptions};
//! use std::path::Path;
//!
//! let opts = CreateOptions {
//!     size: Some(10 << 30),
//!     extended_l2: true,
//!     cluster_size: 128 << 10,
//!     ..Default::default()
//! };
//! create(Path::new("disk.qcow2"), &opts, &mut |_, _| {})?;
//! let info = qimg::tools::info::image_info(Path::new("disk.qcow2"), None)?;
//! assert_eq!(info.virtual_size, 10 << 30);
//! # Ok::<(), qimg::Error>(())
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod chain;
pub mod engine;
pub mod error;
#[doc(hidden)]
pub mod fuzzing;
pub mod tools;

pub use engine::{
    Allocation, Backing, BlockingImage, Extent, ExtentKind, FileOpener, HostExtent, Image,
    OpenOptions, Opener, Stats, WriteLease,
};
pub use error::{Error, Result};
pub use qimg_cache::{CacheOptions, CacheStats};
/// The on-disk format crate, re-exported.
pub use qimg_format as format;
/// The storage crate, re-exported.
pub use qimg_io as io;

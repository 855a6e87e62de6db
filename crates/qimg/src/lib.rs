//! # qimg: qcow2 disk images with subcluster allocation
//!
//! `qimg` reads and writes qcow2 images (versions 2 and 3), including images with extended
//! L2 entries, where each cluster is split into 32 subclusters that are allocated, zeroed and
//! copied on write one by one. It is built for VMMs: an async engine many requests drive at
//! once, io_uring and `O_DIRECT` storage, and a data path the VMM drives with its own I/O.
//!
//! ## Which API
//!
//! | You have | Use | Requests run |
//! |---|---|---|
//! | an async runtime (tokio) | [`Image`] (`read`, `write`, `write_zeroes`, `discard`, `flush`, `map`, ...) | as futures, many at once, on your runtime |
//! | no runtime (tools, fuzzers, simple embedders) | `BlockingImage` (feature `blocking`, [`OpenOptions::open_blocking`]) | on a private current-thread runtime; each call blocks |
//! | a VMM thread per guest queue with its own `epoll` loop | [`Queue`] ([`Image::queue`]) | on the queue's io_uring ring from your thread when the metadata is cached, else on the queue's engine thread; completions on an eventfd |
//! | your own I/O engine for guest data | [`Image::map`] and [`Image::write_lease`] ([`lease`]) | your reads and writes at host offsets qimg gives; qimg only does metadata |
//!
//! Threads: an [`Image`] handle is `Send + Sync` and cheap to clone, and any thread may use
//! it; one metadata lock orders allocation and table changes, guest data I/O runs outside it.
//! A [`Queue`] is used by one thread at a time and runs what needs metadata I/O on one
//! engine thread of its own; every thread qimg starts is listed in [`io::threads`].
//!
//! ## Open, read, write, flush, close
//!
//! ```
//! use qimg::OpenOptions;
//! use qimg::tools::create::{CreateOptions, create};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let path = dir.path().join("disk.qcow2");
//! // A 1 GiB image with 128 KiB clusters split into 4 KiB subclusters.
//! let opts = CreateOptions {
//!     size: Some(1 << 30),
//!     extended_l2: true,
//!     cluster_size: 128 << 10,
//!     ..Default::default()
//! };
//! create(&path, &opts, &mut |_, _| {})?;
//!
//! let rt = tokio::runtime::Runtime::new()?;
//! rt.block_on(async {
//!     let img = OpenOptions::new().writable(true).open(&path).await?;
//!     // A 4 KiB write allocates one subcluster: nothing else is copied.
//!     img.write(&[0xab; 4096], 1 << 20).await?;
//!     let mut buf = vec![0; 8192];
//!     img.read(&mut buf, 1 << 20).await?;
//!     assert!(buf[..4096].iter().all(|&b| b == 0xab));
//!     assert!(buf[4096..].iter().all(|&b| b == 0)); // never written: zeros
//!     img.flush().await?; // durable from here on
//!     img.close().await // writes back the caches; the image is clean
//! })?;
//! # Ok(()) }
//! ```
//!
//! ## The VMM data path: map and write leases
//!
//! A VMM can do the guest I/O itself, on its own rings, at host offsets qimg gives it:
//! [`Image::map`] says where guest data lives for reads, and [`Image::write_lease`] allocates
//! (copying on write what the guest does not overwrite) and says where a write goes. The
//! VMM writes there, then [`WriteLease::commit`] links the new data into the image. The
//! contract (what to write, when to commit, what a flush makes durable) is in [`lease`].
//!
//! ```
//! use std::os::unix::fs::FileExt;
//! use qimg::{ExtentKind, OpenOptions};
//! # use qimg::tools::create::{CreateOptions, create};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let path = dir.path().join("disk.qcow2");
//! # let opts = CreateOptions { size: Some(1 << 30), extended_l2: true, cluster_size: 128 << 10, ..Default::default() };
//! # create(&path, &opts, &mut |_, _| {})?;
//! let rt = tokio::runtime::Runtime::new()?;
//! rt.block_on(async {
//!     let img = OpenOptions::new().writable(true).open(&path).await?;
//!     let lease = img.write_lease(64 << 10, 4096).await?;
//!     let host = std::fs::OpenOptions::new().write(true).open(img.data_path())?;
//!     for extent in lease.extents() {
//!         // The VMM's own write (here a plain pwrite) of the guest bytes.
//!         host.write_all_at(&vec![7u8; extent.length as usize], extent.host_offset)?;
//!     }
//!     lease.commit().await?;
//!     let extents = img.map(64 << 10, 4096).await?;
//!     assert!(matches!(extents[0].kind, ExtentKind::Data { .. }));
//!     img.close().await?;
//!     Ok::<_, Box<dyn std::error::Error>>(())
//! })?;
//! # Ok(()) }
//! ```
//!
//! ## Changed-block tracking: persistent dirty bitmaps
//!
//! A bitmap records which parts of the disk changed (one bit per `granularity` bytes) and is
//! stored in the image, as QEMU stores it: QEMU's tools read what qimg records and the other
//! way round. An image opened for writing keeps its bitmaps up to date on every write path;
//! a backup tool asks what changed since it last cleared one.
//!
//! ```
//! use qimg::OpenOptions;
//! # use qimg::tools::create::{CreateOptions, create};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let path = dir.path().join("disk.qcow2");
//! # let opts = CreateOptions { size: Some(1 << 30), extended_l2: true, cluster_size: 128 << 10, ..Default::default() };
//! # create(&path, &opts, &mut |_, _| {})?;
//! let rt = tokio::runtime::Runtime::new()?;
//! rt.block_on(async {
//!     let img = OpenOptions::new().writable(true).open(&path).await?;
//!     // Track changes from now on, 64 KiB a bit (`qemu-img bitmap --add -g 64k`).
//!     img.add_bitmap("backup", Some(64 << 10), true)?;
//!     img.write(&[1; 4096], 10 << 20).await?;
//!     img.discard(20 << 20, 1 << 20).await?;
//!     // What changed since the bitmap was added (or last cleared).
//!     let changed = img.bitmap_extents("backup", 0, img.size()).await?;
//!     assert_eq!(changed, vec![(10 << 20, 64 << 10), (20 << 20, 1 << 20)]);
//!     // After copying those ranges away, start the next increment.
//!     img.clear_bitmap("backup")?;
//!     img.close().await?; // stores the bitmap (`qemu-img info` lists it)
//!     Ok::<_, Box<dyn std::error::Error>>(())
//! })?;
//! # Ok(()) }
//! ```
//!
//! The bitmaps stay consistent on disk while the image is written
//! ([`OpenOptions::crash_consistent_bitmaps`], the default): a writer killed or cut off by a
//! power loss leaves each bitmap usable by qimg and QEMU, its set bits a superset of what
//! changed, so the next backup is still incremental. QEMU's own writer leaves them marked in
//! use instead, inconsistent ([`BitmapInfo::inconsistent`]); `crash_consistent_bitmaps(false)`
//! does the same.
//!
//! ## Layout
//!
//! | module | what |
//! |---|---|
//! | [`engine`] | the open [`Image`]: options ([`OpenOptions`]), reads, writes, copy-on-write, zero, discard, flush, caches, [`map`](engine::map), [`lease`], the `BlockingImage` facade (feature `blocking`) |
//! | [`tools`] | what `qemu-img` does to whole images: [`create`](tools::create), `info` (feature `json`), [`check`](tools::check) |
//! | [`chain`] | backing chains: format probing, stored-name resolution, the depth limit |
//! | [`format`](mod@format) | the on-disk structures (the `qimg-format` crate) |
//! | [`io`] | the storage backends (the `qimg-io` crate) |
//!
//! The engine never imports a tool. Images from an untrusted source should be opened with
//! [`Trust::untrusted`], so that their headers cannot make qimg open other files.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod block_status;
pub mod chain;
pub mod crypto;
pub mod engine;
pub mod error;
mod probe;
pub mod tools;

pub use engine::lease;

#[cfg(feature = "blocking")]
pub use engine::BlockingImage;
#[cfg(target_os = "linux")]
pub use engine::queue::{
    self, BatchRefused, Completion, Queue, QueueOptions, QueueStats, Refused, Request,
};
pub use engine::{
    Action, Allocation, Backing, BitmapInfo, DirtyBitmap, Extent, ExtentKind, FileOpener,
    HostExtent, Image, InternalSnapshot, OpenOptions, Opener, ReadLease, SnapshotOptions, Stats,
    Trust, UntrustedLimits, WriteLease,
};
pub use error::{Error, Result};
pub use probe::{ImageProbe, probe};
pub use qimg_cache::{CacheOptions, CacheStats};
/// The on-disk format crate, re-exported.
pub use qimg_format as format;
/// The storage crate, re-exported.
pub use qimg_io as io;
#[cfg(target_os = "linux")]
pub use qimg_io::queue::{IoBuffers, Notifier};

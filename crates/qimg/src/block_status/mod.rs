//! Block status through a whole backing chain: what each guest range is (data, zeros,
//! compressed, unallocated), in which layer and at which host offset, as QEMU's
//! `bdrv_co_block_status_above` answers it over qcow2, raw and file-posix.
//!
//! The one walk behind `qimg map`, the copy plans of `convert`, `commit`, `compare` and
//! `measure`, and an NBD export's `base:allocation` and `qemu:allocation-depth` contexts.
//! Build a [`Chain`] from an open image (its backing chain as opened) or a raw file, then ask
//! [`Chain::status`] for a range.
//!
//! ```no_run
//! # async fn f() -> qimg::Result<()> {
//! use qimg::block_status::{Chain, DataHoles};
//! let img = qimg::OpenOptions::new().open("disk.qcow2").await?;
//! let chain = Chain::of_image(&img, DataHoles::WhenPreallocated)?;
//! let mut out = Vec::new();
//! chain.status(0, img.size(), &mut out).await?;
//! for s in &out {
//!     println!("{} +{}: layer {} data {} zero {}", s.start, s.length, s.depth, s.data, s.zero);
//! }
//! # Ok(()) }
//! ```

mod host;
mod prealloc;

use std::future::Future;
use std::pin::Pin;

use qimg_io::Storage;

use crate::engine::{Backing, ExtentKind, Image};
use crate::error::Result;

pub use host::HostExtents;
pub use prealloc::metadata_preallocated;

/// QEMU's sector: a raw layer's virtual size is its length rounded up to it.
pub const SECTOR_SIZE: u64 = 512;

/// When a walk asks the file holding a qcow2 layer's data for the holes inside its data
/// clusters (parts never written read as zeros, and are reported as zeros).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataHoles {
    /// Only for a metadata-preallocated image (QEMU's `BDRV_BLOCK_RECURSE`, what
    /// `qemu-img map` shows); the cached pages of each range are dropped first, so that the
    /// answer is the one a process that never read the file gets.
    WhenPreallocated,
    /// For every data cluster, where the file can be opened (an export's block status: the
    /// zeros inside a partly written cluster are worth telling a copying client).
    Always,
}

/// One layer of a [`Chain`].
#[derive(Debug)]
pub enum Layer<S: Storage + 'static> {
    /// A qcow2 image.
    Qcow2 {
        /// The open image (its backing is the next layer).
        image: Image<S>,
        /// The file holding its data, when the walk asks it for holes ([`DataHoles`]).
        holes: Option<HostExtents>,
    },
    /// A raw image: its file's data and holes are its status.
    Raw(HostExtents),
}

impl<S: Storage + 'static> Layer<S> {
    /// The virtual size as QEMU sees it (a raw file's length rounded up to [`SECTOR_SIZE`]).
    pub fn size(&self) -> u64 {
        match self {
            Layer::Qcow2 { image, .. } => image.size(),
            Layer::Raw(host) => host.len().next_multiple_of(SECTOR_SIZE),
        }
    }
}

/// A run of guest bytes with one status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status {
    /// First guest byte.
    pub start: u64,
    /// Length in bytes.
    pub length: u64,
    /// Index in the chain (0: the top) of the layer the status comes from.
    pub depth: usize,
    /// Allocated at that depth; `false`: no layer has it, it reads as zeros.
    pub present: bool,
    /// Reads as zeros.
    pub zero: bool,
    /// Holds data (possibly also reading as zeros: a hole of a preallocated file).
    pub data: bool,
    /// Part of a compressed cluster.
    pub compressed: bool,
    /// Offset in the file of layer `depth` (its data file for a qcow2 image with one).
    pub offset: Option<u64>,
}

/// The layers of a chain, top first, and the walk over them.
#[derive(Debug)]
pub struct Chain<S: Storage + 'static> {
    layers: Vec<Layer<S>>,
}

type BoxFut<'a> = Pin<Box<dyn Future<Output = Result<()>> + Send + 'a>>;

impl<S: Storage + 'static> Chain<S> {
    /// The chain of `image` and the backing images opened with it. The data file of a layer
    /// is opened for its holes as `holes` says: with [`DataHoles::WhenPreallocated`] a file
    /// that does not open is an error, with [`DataHoles::Always`] it counts as all data.
    /// A raw backing file is opened for its holes (an error if it does not open).
    pub fn of_image(image: &Image<S>, holes: DataHoles) -> Result<Self> {
        let mut layers = Vec::new();
        let mut next = Some(image.clone());
        while let Some(image) = next.take() {
            let host = match holes {
                DataHoles::WhenPreallocated if metadata_preallocated(image.path()) => {
                    Some(HostExtents::open(image.data_path())?.drop_cache(true))
                }
                DataHoles::WhenPreallocated => None,
                DataHoles::Always => HostExtents::open(image.data_path()).ok(),
            };
            let below = match image.backing() {
                Some(Backing::Qcow2(b)) => {
                    next = Some(b.clone());
                    None
                }
                Some(Backing::Raw { path, .. }) => Some(HostExtents::open(path)?),
                None => None,
            };
            layers.push(Layer::Qcow2 { image, holes: host });
            layers.extend(below.map(Layer::Raw));
        }
        Ok(Self { layers })
    }

    /// A chain of one raw file (or NBD export).
    pub fn raw(host: HostExtents) -> Self {
        Self {
            layers: vec![Layer::Raw(host)],
        }
    }

    /// The layers, top first.
    pub fn layers(&self) -> &[Layer<S>] {
        &self.layers
    }

    /// The top layer's virtual size.
    pub fn size(&self) -> u64 {
        self.layers.first().map_or(0, Layer::size)
    }

    /// Appends the status of `[start, start + len)` (inside the top layer) to `out`, in
    /// order, covering the range once.
    pub async fn status(&self, start: u64, len: u64, out: &mut Vec<Status>) -> Result<()> {
        self.walk_from(0, start, len, out).await
    }

    /// [`status`](Self::status) as seen from layer `depth` down. Boxed: an unallocated range
    /// asks the layer below.
    fn walk_from<'a>(
        &'a self,
        depth: usize,
        start: u64,
        len: u64,
        out: &'a mut Vec<Status>,
    ) -> BoxFut<'a> {
        Box::pin(async move {
            let at = |start: u64, length: u64| Status {
                start,
                length,
                depth,
                present: true,
                zero: false,
                data: false,
                compressed: false,
                offset: None,
            };
            let (image, holes) = match &self.layers[depth] {
                Layer::Raw(host) => {
                    for (s, l, data) in host.runs(start, start + len) {
                        out.push(Status {
                            zero: !data,
                            data,
                            offset: Some(s + host.shift()),
                            ..at(s, l)
                        });
                    }
                    return Ok(());
                }
                Layer::Qcow2 { image, holes } => (image, holes),
            };
            // An encrypted layer's host bytes are ciphertext: no offset is reported (QEMU
            // leaves BDRV_BLOCK_OFFSET_VALID out) and a hole in the file says nothing.
            let encrypted = image.is_encrypted();
            let holes = holes.as_ref().filter(|_| !encrypted);
            let first = out.len();
            for x in image.map(start, len).await? {
                match x.kind {
                    ExtentKind::Data { host_offset } => match holes {
                        Some(host) => {
                            for (s, l, data) in host.runs(host_offset, host_offset + x.length) {
                                out.push(Status {
                                    zero: !data,
                                    data: true,
                                    offset: Some(s),
                                    ..at(x.start + (s - host_offset), l)
                                });
                            }
                        }
                        None => out.push(Status {
                            data: true,
                            offset: Some(host_offset),
                            ..at(x.start, x.length)
                        }),
                    },
                    ExtentKind::Zero { host_offset } => out.push(Status {
                        zero: true,
                        offset: host_offset,
                        ..at(x.start, x.length)
                    }),
                    ExtentKind::Compressed { .. } => out.push(Status {
                        data: true,
                        compressed: true,
                        ..at(x.start, x.length)
                    }),
                    ExtentKind::Unallocated { host_offset } => {
                        let end = x.start + x.length;
                        let below = match self.layers.get(depth + 1) {
                            Some(b) => b.size().clamp(x.start, end),
                            None => x.start,
                        };
                        if below > x.start {
                            self.walk_from(depth + 1, x.start, below - x.start, out)
                                .await?;
                        }
                        if end > below {
                            out.push(Status {
                                present: false,
                                zero: true,
                                offset: host_offset.map(|h| h + (below - x.start)),
                                ..at(below, end - below)
                            });
                        }
                    }
                }
            }
            if encrypted {
                for s in out[first..].iter_mut().filter(|s| s.depth == depth) {
                    s.offset = None;
                }
            }
            Ok(())
        })
    }
}

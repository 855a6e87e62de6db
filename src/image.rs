//! [`Image`]: an open qcow2 image, its options, and its public async API.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use qimg_cache::{CacheOptions, CacheStats, ImageFacts};
use qimg_format::extensions::Cluster0;
use qimg_format::features::{
    AUTOCLEAR_BITMAPS, AUTOCLEAR_DATA_FILE_RAW, AUTOCLEAR_KNOWN, COMPAT_LAZY_REFCOUNTS,
    INCOMPAT_DATA_FILE, INCOMPAT_DIRTY,
};
use qimg_format::geometry::{Geometry, RefcountGeometry};
use qimg_format::header::{CompressionType, Header};
use qimg_format::l2::L2Context;
use qimg_format::validate::{OpenMode, validate_cluster0};
use qimg_io::{AnyStorage, Backend, FileStorage, Storage, StorageError};

use crate::error::{Error, Result};
use crate::lock::RangeLocks;
use crate::meta::Meta;

/// Most images in a backing chain below the opened one (QEMU has no fixed limit; a chain
/// deeper than this is almost certainly a loop through differently spelled names).
pub const MAX_BACKING_DEPTH: usize = 64;

/// Largest cluster 0 read at open (the largest cluster size).
const MAX_CLUSTER0: usize = 2 << 20;

/// How a newly allocated host cluster is reserved in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Allocation {
    /// Reserve the whole cluster with `fallocate` so later subcluster writes land contiguously
    /// (QEMU's behaviour).
    #[default]
    Contiguous,
    /// Write only what the guest wrote; the rest of the cluster stays a hole (saves space).
    Sparse,
}

/// How to open an image. `OpenOptions::default()` opens read-only with QEMU's cache defaults.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// Open for writing (the backing chain is always opened read-only).
    pub writable: bool,
    /// Cache budgets and the clean interval, with QEMU's option names and defaults.
    pub cache: CacheOptions,
    /// Reservation of new host clusters.
    pub allocation: Allocation,
    /// Do not open the backing file: unallocated clusters read as zeros (`-U`-like inspection).
    pub no_backing: bool,
    /// The external data file, overriding the name stored in the image.
    pub data_file: Option<PathBuf>,
    /// Open files with `O_DIRECT` (file backends that support it).
    pub direct: bool,
    /// Do not spawn the cache-clean timer task even when a tokio runtime is running; call
    /// [`Image::clean_idle_caches`] yourself.
    pub no_clean_timer: bool,
    /// Refuse backing file and external data file names stored in the image that are
    /// absolute or climb out of the image's directory with `..`. Set this when the image comes
    /// from an untrusted source: otherwise its header can make qimg open any file the process
    /// can read (`/etc/shadow` as a raw backing file, say) and expose it to the guest.
    pub confine_names: bool,
    /// The I/O backend [`Image::open_any`] uses for the image and every file it refers to.
    pub backend: Backend,
}

impl OpenOptions {
    /// Read-only with defaults.
    pub fn read_only() -> Self {
        Self::default()
    }

    /// Read-write with defaults.
    pub fn read_write() -> Self {
        Self {
            writable: true,
            ..Self::default()
        }
    }
}

/// A backing file below an image.
#[derive(Debug)]
pub enum Backing<S: Storage> {
    /// A qcow2 image (opened read-only, with its own chain).
    Qcow2(Image<S>),
    /// A raw image: bytes past its end read as zeros.
    Raw {
        /// The storage.
        storage: S,
        /// Its name, for errors.
        path: PathBuf,
    },
}

/// Counters and cache statistics of an open image.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Bytes copied on write: the parts of newly allocated (sub)clusters the guest did not
    /// write, read from the old cluster, the backing file or zeros.
    pub cow_bytes: u64,
    /// Host clusters allocated for guest data.
    pub clusters_allocated: u64,
    /// Host clusters whose refcount dropped to zero.
    pub clusters_freed: u64,
    /// The L2 slice cache.
    pub l2_cache: CacheStats,
    /// The refcount block cache.
    pub refcount_cache: CacheStats,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) cow_bytes: AtomicU64,
    pub(crate) clusters_allocated: AtomicU64,
    pub(crate) clusters_freed: AtomicU64,
}

/// An open qcow2 image: reads, writes, write-zeroes, discards and flushes on an async core.
///
/// `Image` is a cheap handle (`Clone` shares the image); requests may be issued from many tasks
/// at once. Call [`close`](Image::close) (or at least [`flush`](Image::flush)) before dropping
/// the last handle of a writable image: caches are written back only then.
#[derive(Debug)]
pub struct Image<S: Storage> {
    pub(crate) inner: Arc<Inner<S>>,
}

impl<S: Storage> Clone for Image<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

#[derive(Debug)]
pub(crate) struct Inner<S: Storage> {
    pub(crate) path: PathBuf,
    pub(crate) file: S,
    pub(crate) data_file: Option<(PathBuf, S)>,
    pub(crate) backing: Option<Backing<S>>,
    pub(crate) geo: Geometry,
    pub(crate) rgeo: RefcountGeometry,
    pub(crate) ctx: L2Context,
    pub(crate) writable: bool,
    pub(crate) compression: CompressionType,
    pub(crate) data_file_raw: bool,
    pub(crate) lazy: bool,
    pub(crate) allocation: Allocation,
    pub(crate) version: u32,
    pub(crate) size: AtomicU64,
    pub(crate) meta: tokio::sync::Mutex<Meta>,
    pub(crate) locks: RangeLocks,
    pub(crate) counters: Counters,
    pub(crate) epoch: tokio::time::Instant,
    pub(crate) clean_interval: Option<Duration>,
    /// Corruption was found while writing: further writes are refused.
    pub(crate) marked_corrupt: AtomicBool,
    /// A header switch failed (see [`Error::Halted`]): further writes are refused until the
    /// image is reopened. Holds what failed.
    pub(crate) halted: std::sync::OnceLock<String>,
}

/// Opens the files an image refers to (backing files, external data files) as storages of the
/// same kind as the image.
pub trait Opener<S>: Send + Sync {
    /// Opens `path`, for writing when `writable`.
    fn open(&self, path: &Path, writable: bool) -> std::result::Result<S, StorageError>;
}

impl<S, F> Opener<S> for F
where
    F: Fn(&Path, bool) -> std::result::Result<S, StorageError> + Send + Sync,
{
    fn open(&self, path: &Path, writable: bool) -> std::result::Result<S, StorageError> {
        self(path, writable)
    }
}

/// Opens files with [`FileStorage`], honouring [`OpenOptions::direct`].
#[derive(Debug, Clone, Copy, Default)]
pub struct FileOpener {
    /// Use `O_DIRECT`.
    pub direct: bool,
}

impl Opener<FileStorage> for FileOpener {
    fn open(&self, path: &Path, writable: bool) -> std::result::Result<FileStorage, StorageError> {
        FileStorage::options()
            .read_write(writable)
            .direct(self.direct)
            .open(path)
    }
}

impl Image<FileStorage> {
    /// Opens the qcow2 image at `path` with its backing chain and data file.
    pub async fn open(path: impl AsRef<Path>, opts: &OpenOptions) -> Result<Self> {
        let opener = FileOpener {
            direct: opts.direct,
        };
        Self::open_with(path.as_ref(), opts, &opener).await
    }
}

impl Image<AnyStorage> {
    /// Opens the qcow2 image at `path`, its backing chain and data file with the backend
    /// [`OpenOptions::backend`] names (blocking calls on a thread pool, or io_uring), with
    /// `O_DIRECT` when [`OpenOptions::direct`] is set (any request alignment is accepted; a
    /// bounce buffer covers unaligned ones).
    ///
    /// ```no_run
    /// # async fn demo() -> qimg::Result<()> {
    /// use qimg::{Image, OpenOptions, io::Backend};
    /// let opts = OpenOptions {
    ///     backend: Backend::IoUring,
    ///     direct: true,
    ///     ..OpenOptions::read_write()
    /// };
    /// let img = Image::open_any("disk.qcow2", &opts).await?;
    /// img.write(&[1u8; 4096], 0).await?;
    /// img.close().await?;
    /// # Ok(()) }
    /// ```
    pub async fn open_any(path: impl AsRef<Path>, opts: &OpenOptions) -> Result<Self> {
        let (backend, direct) = (opts.backend, opts.direct);
        let opener = move |p: &Path, writable: bool| AnyStorage::open(p, writable, backend, direct);
        Self::open_with(path.as_ref(), opts, &opener).await
    }
}

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

impl<S: Storage + 'static> Image<S> {
    /// Opens the image at `path` through `opener`, which also opens its backing chain and
    /// external data file.
    pub async fn open_with(
        path: &Path,
        opts: &OpenOptions,
        opener: &dyn Opener<S>,
    ) -> Result<Self> {
        let file = opener
            .open(path, opts.writable)
            .map_err(|e| Error::storage(path, e))?;
        let mut seen = Vec::new();
        open_chain(
            file,
            path.to_path_buf(),
            opts,
            Some(opener),
            None,
            0,
            &mut seen,
        )
        .await
    }

    /// Opens an image held in `file` (named `name` in errors and for resolving relative
    /// names), with the backing image given explicitly (or none). The backing name stored in
    /// the image is not followed; an external data file must be given in `data_file` when the
    /// image needs one.
    pub async fn from_storage(
        file: S,
        name: impl Into<PathBuf>,
        opts: &OpenOptions,
        backing: Option<Backing<S>>,
        data_file: Option<S>,
    ) -> Result<Self> {
        let name = name.into();
        let mut seen = Vec::new();
        let given = Given { backing, data_file };
        open_chain(file, name, opts, None, Some(given), 0, &mut seen).await
    }
}

struct Given<S: Storage> {
    backing: Option<Backing<S>>,
    data_file: Option<S>,
}

fn open_chain<'a, S: Storage + 'static>(
    file: S,
    path: PathBuf,
    opts: &'a OpenOptions,
    opener: Option<&'a dyn Opener<S>>,
    given: Option<Given<S>>,
    depth: usize,
    seen: &'a mut Vec<PathBuf>,
) -> BoxFuture<'a, Result<Image<S>>> {
    Box::pin(async move {
        let mode = if opts.writable {
            OpenMode::ReadWrite
        } else {
            OpenMode::ReadOnly
        };
        let c0 = read_cluster0(&file, &path, mode).await?;
        let h = &c0.header;
        if h.crypt_method != 0 {
            return Err(Error::Unsupported {
                path,
                what: format!(
                    "encrypted images (crypt_method {} at offset 32) are not supported",
                    h.crypt_method
                ),
            });
        }
        if opts.writable && h.autoclear_features & AUTOCLEAR_BITMAPS != 0 && c0.bitmaps().is_some()
        {
            return Err(Error::Unsupported {
                path,
                what: "the image has persistent dirty bitmaps, which qimg cannot keep up to date; \
                       open it read-only or remove them with qemu-img bitmap --remove"
                    .into(),
            });
        }
        let geo =
            Geometry::new(h.cluster_bits, h.extended_l2()).map_err(|e| Error::format(&path, e))?;
        let rgeo = RefcountGeometry::new(h.cluster_bits, h.refcount_order)
            .map_err(|e| Error::format(&path, e))?;
        let external = h.incompatible_features & INCOMPAT_DATA_FILE != 0;
        let ctx = L2Context {
            geometry: geo,
            external_data_file: external,
            v2: h.version == 2,
        };

        // Canonical name for loop detection.
        let canon = std::fs::canonicalize(&path).unwrap_or_else(|_| path.clone());
        if seen.contains(&canon) {
            return Err(Error::Corrupt {
                path: path.clone(),
                what: format!(
                    "backing chain loops back to {} (already opened above it)",
                    canon.display()
                ),
            });
        }
        seen.push(canon);

        let (given_backing, given_data) = match given {
            Some(g) => (g.backing, g.data_file),
            None => (None, None),
        };

        let data_file = if external {
            let name = match (&opts.data_file, c0.data_file()) {
                (Some(p), _) => p.clone(),
                (None, Some(n)) => {
                    let n = String::from_utf8_lossy(n);
                    confined(opts, &path, "external data file", &n)?;
                    data_file_path(&path, &n)
                }
                (None, None) => PathBuf::new(),
            };
            match (given_data, opener) {
                (Some(s), _) => Some((name, s)),
                (None, Some(op)) if !name.as_os_str().is_empty() => {
                    let s = op
                        .open(&name, opts.writable)
                        .map_err(|e| Error::storage(&name, e))?;
                    Some((name, s))
                }
                _ => {
                    return Err(Error::InvalidOption(format!(
                        "{}: the image keeps its data in an external data file, and none was given",
                        path.display()
                    )));
                }
            }
        } else {
            None
        };

        let backing = match (given_backing, &c0.backing_file, opener) {
            (Some(b), _, _) => Some(b),
            (None, Some(name), Some(op)) if !opts.no_backing => {
                if depth + 1 > MAX_BACKING_DEPTH {
                    return Err(Error::Unsupported {
                        path,
                        what: format!("backing chain deeper than {MAX_BACKING_DEPTH} images"),
                    });
                }
                let name = String::from_utf8_lossy(name).into_owned();
                confined(opts, &path, "backing file", &name)?;
                let bpath = crate::create::resolve_backing(&path, &name);
                let fmt = match c0.backing_format() {
                    Some(b"raw") => crate::info::ImageFormat::Raw,
                    Some(b"qcow2") => crate::info::ImageFormat::Qcow2,
                    Some(other) => {
                        return Err(Error::Unsupported {
                            path,
                            what: format!(
                                "backing format {:?} (only qcow2 and raw are supported)",
                                String::from_utf8_lossy(other)
                            ),
                        });
                    }
                    None => crate::info::probe_format(&bpath)?,
                };
                let storage = op
                    .open(&bpath, false)
                    .map_err(|e| Error::storage(&bpath, e))?;
                Some(match fmt {
                    crate::info::ImageFormat::Raw => Backing::Raw {
                        storage,
                        path: bpath,
                    },
                    crate::info::ImageFormat::Qcow2 => {
                        let bopts = OpenOptions {
                            writable: false,
                            data_file: None,
                            ..opts.clone()
                        };
                        let img =
                            open_chain(storage, bpath, &bopts, Some(op), None, depth + 1, seen)
                                .await?;
                        Backing::Qcow2(img)
                    }
                })
            }
            _ => None,
        };

        if opts.writable && backing.is_none() && c0.backing_file.is_some() {
            // Copy-on-write would fill new clusters with zeros instead of the backing data.
            return Err(Error::InvalidOption(format!(
                "{}: the image has a backing file that was not opened; it cannot be opened \
                 for writing without it",
                path.display()
            )));
        }
        let facts = ImageFacts {
            virtual_size: h.size,
            cluster_size: geo.cluster_size(),
            extended_l2: geo.extended_l2(),
        };
        let resolved = opts.cache.resolve(facts).map_err(|source| Error::Cache {
            path: path.clone(),
            source,
        })?;
        let meta = Meta::load(&file, &path, h, &geo, &resolved, opts.writable).await?;
        let inner = Arc::new(Inner {
            file,
            data_file,
            backing,
            geo,
            rgeo,
            ctx,
            writable: opts.writable,
            compression: h.compression_type().unwrap_or(CompressionType::Zlib),
            data_file_raw: h.autoclear_features & AUTOCLEAR_DATA_FILE_RAW != 0,
            lazy: h.compatible_features & COMPAT_LAZY_REFCOUNTS != 0,
            allocation: opts.allocation,
            version: h.version,
            size: AtomicU64::new(h.size),
            meta: tokio::sync::Mutex::new(meta),
            locks: RangeLocks::default(),
            counters: Counters::default(),
            epoch: tokio::time::Instant::now(),
            clean_interval: resolved.clean_interval,
            marked_corrupt: AtomicBool::new(false),
            halted: std::sync::OnceLock::new(),
            path,
        });
        if opts.writable {
            inner.prepare_for_writing(&c0.header).await?;
        }
        if !opts.no_clean_timer {
            if let (Some(interval), Ok(handle)) =
                (inner.clean_interval, tokio::runtime::Handle::try_current())
            {
                spawn_cleaner(&handle, Arc::downgrade(&inner), interval);
            }
        }
        Ok(Image { inner })
    })
}

/// Where the external data file named `name` in `image` is. QEMU resolves the name against
/// the current directory (unlike backing file names); qimg does too, and when nothing is
/// there, tries the image's directory, so an image and its data file can move together.
fn data_file_path(image: &Path, name: &str) -> PathBuf {
    let as_qemu = PathBuf::from(name);
    if as_qemu.exists() {
        return as_qemu;
    }
    let beside = crate::create::resolve_backing(image, name);
    if beside.exists() { beside } else { as_qemu }
}

/// With [`OpenOptions::confine_names`], refuses a stored file name that is absolute or
/// contains a `..` component (or is a protocol-style name such as `nbd:...` or `json:{...}`).
fn confined(opts: &OpenOptions, image: &Path, what: &str, name: &str) -> Result<()> {
    if !opts.confine_names {
        return Ok(());
    }
    let p = Path::new(name);
    let escapes = p.is_absolute()
        || p.components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
        || name.starts_with("json:")
        || name.is_empty();
    if escapes {
        return Err(Error::Unsupported {
            path: image.to_path_buf(),
            what: format!(
                "{what} name {name:?} is absolute or leaves the image's directory, and \
                 names are confined (OpenOptions::confine_names)"
            ),
        });
    }
    Ok(())
}

fn spawn_cleaner<S: Storage + 'static>(
    handle: &tokio::runtime::Handle,
    weak: Weak<Inner<S>>,
    interval: Duration,
) {
    handle.spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let Some(inner) = weak.upgrade() else { break };
            let mut m = inner.meta.lock().await;
            if m.closed {
                break;
            }
            // Errors surface on the next request or flush; the timer just tries again.
            let _ = inner.clean_idle(&mut m).await;
        }
    });
}

async fn read_cluster0<S: Storage>(file: &S, path: &Path, mode: OpenMode) -> Result<Cluster0> {
    let len = file.len().await.map_err(|e| Error::storage(path, e))?;
    let want = usize::try_from(len.min(MAX_CLUSTER0 as u64)).unwrap_or(MAX_CLUSTER0);
    let mut bytes = vec![0u8; want.max(512)];
    file.read_at_zero_fill(&mut bytes, 0)
        .await
        .map_err(|e| Error::storage(path, e))?;
    if let Ok(h) = Header::decode(&bytes) {
        if let Some(cs) = h
            .cluster_size()
            .filter(|&c| (512..=MAX_CLUSTER0 as u64).contains(&c))
        {
            bytes.resize(cs as usize, 0);
        }
    }
    validate_cluster0(&bytes, mode).map_err(|e| Error::format(path, e))
}

impl<S: Storage + 'static> Image<S> {
    /// The virtual disk size in bytes.
    pub fn size(&self) -> u64 {
        self.inner.size.load(Ordering::Acquire)
    }

    /// The cluster size in bytes.
    pub fn cluster_size(&self) -> u64 {
        self.inner.geo.cluster_size()
    }

    /// The subcluster size in bytes (the cluster size without extended L2 entries).
    pub fn subcluster_size(&self) -> u64 {
        self.inner.geo.subcluster_size()
    }

    /// Whether the image has extended L2 entries (32 subclusters per cluster).
    pub fn extended_l2(&self) -> bool {
        self.inner.geo.extended_l2()
    }

    /// Whether the image is open for writing.
    pub fn is_writable(&self) -> bool {
        self.inner.writable
    }

    /// The image file's name as given at open.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// The storage holding the image file (for a VMM that issues its own I/O on the same
    /// file, or to see which backend [`Image::open_any`] chose).
    pub fn storage(&self) -> &S {
        &self.inner.file
    }

    /// The backing image, if one is open.
    pub fn backing(&self) -> Option<&Backing<S>> {
        self.inner.backing.as_ref()
    }

    /// Counters and cache statistics.
    pub async fn stats(&self) -> Stats {
        let m = self.inner.meta.lock().await;
        let c = &self.inner.counters;
        Stats {
            cow_bytes: c.cow_bytes.load(Ordering::Relaxed),
            clusters_allocated: c.clusters_allocated.load(Ordering::Relaxed),
            clusters_freed: c.clusters_freed.load(Ordering::Relaxed),
            l2_cache: m.l2.stats(),
            refcount_cache: m.rc.stats(),
        }
    }

    /// Fills `buf` with guest data from `offset`.
    pub async fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.inner.read(buf, offset).await
    }

    /// Writes `buf` at guest `offset`, allocating (and copying on write) as needed.
    pub async fn write(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.inner.write(buf, offset).await
    }

    /// Writes one whole guest cluster compressed with the image's compression type (zlib or
    /// zstd), as `qemu-img convert -c` does: `offset` must be cluster aligned and `data` one
    /// cluster long, or shorter only for the last cluster of a disk whose size is not a
    /// multiple of the cluster size. Several compressed clusters share a host cluster. Data
    /// that does not shrink is stored uncompressed. Images with an external data file cannot
    /// hold compressed clusters.
    pub async fn write_compressed(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.inner.write_compressed(offset, data).await
    }

    /// Makes `len` bytes at `offset` read as zeros: whole subclusters (clusters without
    /// extended L2) only change metadata, partial ones are written with zeros.
    pub async fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.write_zeroes(offset, len).await
    }

    /// Discards `len` bytes at `offset`: every whole subcluster (cluster without extended L2)
    /// in the range becomes unallocated, reading from the backing file or as zeros; a host
    /// cluster left with no allocated subcluster is freed and its space punched. Parts of the
    /// range smaller than a subcluster are left as they are (discard is advisory).
    pub async fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.discard(offset, len).await
    }

    /// Writes back every cached metadata change in the safe order and makes everything
    /// written so far durable.
    ///
    /// After a failed flush nothing written since the last successful one is promised. The
    /// engine keeps its write-back order, so a later flush that works makes everything
    /// durable on storage that keeps what it could not write; files do not (Linux may drop
    /// the pages a failed fsync could not write), so on [`qimg_io::FileStorage`] and
    /// [`qimg_io::UringStorage`] every later flush fails too, as in QEMU: reopen the image.
    pub async fn flush(&self) -> Result<()> {
        let mut m = self.inner.meta.lock().await;
        self.inner.flush_meta(&mut m).await
    }

    /// Grows the virtual disk to `new_size` bytes (shrinking is refused).
    pub async fn resize(&self, new_size: u64) -> Result<()> {
        self.inner.resize(new_size).await
    }

    /// Runs one pass of the cache-clean timer now: slices unused for a whole clean interval
    /// are written back if dirty and dropped. The timer task does this by itself when a tokio
    /// runtime was running at open; returns the bytes freed.
    pub async fn clean_idle_caches(&self) -> Result<u64> {
        let mut m = self.inner.meta.lock().await;
        self.inner.clean_idle(&mut m).await
    }

    /// Flushes and, for images with lazy refcounts, marks the image clean. Further requests
    /// on any handle of this image fail.
    pub async fn close(&self) -> Result<()> {
        let mut m = self.inner.meta.lock().await;
        if m.closed {
            return Ok(());
        }
        if self.inner.writable {
            self.inner.flush_meta(&mut m).await?;
            self.inner.mark_clean(&mut m).await?;
        }
        m.closed = true;
        Ok(())
    }
}

impl<S: Storage> Inner<S> {
    pub(crate) fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    pub(crate) fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    pub(crate) fn st(&self, e: StorageError) -> Error {
        Error::storage(&self.path, e)
    }

    /// Where guest data lives: the external data file, or the image file.
    pub(crate) fn data(&self) -> (&S, &Path) {
        match &self.data_file {
            Some((p, s)) => (s, p),
            None => (&self.file, &self.path),
        }
    }

    /// Refuses changes after a failed header switch ([`Error::Halted`]).
    pub(crate) fn check_not_halted(&self) -> Result<()> {
        match self.halted.get() {
            Some(what) => Err(Error::Halted {
                path: self.path.clone(),
                what: what.clone(),
            }),
            None => Ok(()),
        }
    }

    pub(crate) fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        let size = self.size();
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::OutOfRange {
                path: self.path.clone(),
                offset,
                len,
                size,
            });
        }
        Ok(())
    }

    pub(crate) fn check_writable(&self) -> Result<()> {
        self.check_not_halted()?;
        if self.marked_corrupt.load(Ordering::Acquire) {
            return Err(Error::Corrupt {
                path: self.path.clone(),
                what: "the image was marked corrupt after an inconsistency was found; \
                       writes are refused (run qimg check -r all)"
                    .into(),
            });
        }
        if self.writable {
            Ok(())
        } else {
            Err(Error::ReadOnly {
                path: self.path.clone(),
            })
        }
    }

    /// Read-write open: repair a dirty image, drop autoclear bits we do not maintain.
    async fn prepare_for_writing(&self, h: &Header) -> Result<()> {
        let mut m = self.meta.lock().await;
        if let Some((a, b)) = m.overlap.first_conflict() {
            let what = format!(
                "metadata overlap: {} at {:#x}..{:#x} and {} at {:#x}..{:#x} share host bytes",
                a.region, a.start, a.end, b.region, b.start, b.end
            );
            return Err(self.signal_corruption(&mut m, what).await);
        }
        if h.incompatible_features & INCOMPAT_DIRTY != 0 {
            self.rebuild_refcounts(&mut m).await?;
            m.dirty_on_disk = true;
            self.mark_clean(&mut m).await?;
        }
        let keep = h.autoclear_features & AUTOCLEAR_KNOWN & !AUTOCLEAR_BITMAPS;
        if h.version >= 3 && h.autoclear_features != keep {
            self.file
                .write_at(&keep.to_be_bytes(), 88)
                .await
                .map_err(|e| self.st(e))?;
            self.file.flush().await.map_err(|e| self.st(e))?;
        }
        Ok(())
    }
}

//! Opening an image: [`OpenOptions`], the [`Opener`] that opens the files an image refers
//! to, and the walk down the backing chain.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Weak};
use std::time::Duration;

use qimg_cache::{CacheOptions, ImageFacts};
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

use super::image::{Counters, Image, Inner};
use super::lock::RangeLocks;
use super::meta::Meta;
use crate::chain::{ImageFormat, MAX_CHAIN_DEPTH, data_file_path, probe_format, resolve_backing};
use crate::error::{Error, Result};

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
                if depth + 1 > MAX_CHAIN_DEPTH {
                    return Err(Error::Unsupported {
                        path,
                        what: format!("backing chain deeper than {MAX_CHAIN_DEPTH} images"),
                    });
                }
                let name = String::from_utf8_lossy(name).into_owned();
                confined(opts, &path, "backing file", &name)?;
                let bpath = resolve_backing(&path, &name);
                let fmt = match c0.backing_format() {
                    None => probe_format(&bpath)?,
                    Some(name) => {
                        ImageFormat::from_name(name).ok_or_else(|| Error::Unsupported {
                            path: path.clone(),
                            what: format!(
                                "backing format {:?} (only qcow2 and raw are supported)",
                                String::from_utf8_lossy(name)
                            ),
                        })?
                    }
                };
                let storage = op
                    .open(&bpath, false)
                    .map_err(|e| Error::storage(&bpath, e))?;
                Some(match fmt {
                    ImageFormat::Raw => Backing::Raw {
                        storage,
                        path: bpath,
                    },
                    ImageFormat::Qcow2 => {
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

impl<S: Storage> Inner<S> {
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

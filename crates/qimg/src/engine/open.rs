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
use qimg_format::l1::L1_ENTRY_SIZE;
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

/// How far qimg trusts what an image's header asks it to open and load.
///
/// A qcow2 header names other files (a backing file, an external data file) and sizes tables
/// that are loaded into memory. For an image you made, QEMU's rules apply. For an image from
/// an untrusted source (a guest, an upload, a download) use [`Trust::untrusted`]: otherwise its
/// header can make qimg open any file the process can read (`/etc/shadow` as a raw backing
/// file, say) and expose it to the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Trust {
    /// Stored names are followed as QEMU follows them (absolute names and `..` included),
    /// down to [`MAX_CHAIN_DEPTH`] images; L1 tables up to QEMU's own limit are loaded.
    #[default]
    Trusted,
    /// Stored backing and data file names must stay inside the image's directory (no absolute
    /// name, no `..`, no `json:` pseudo-name), and the given limits hold for every image of
    /// the chain.
    Untrusted(UntrustedLimits),
}

/// The limits [`Trust::Untrusted`] puts on an image and its chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UntrustedLimits {
    /// Most images opened below the untrusted one.
    pub max_chain_depth: usize,
    /// Largest active L1 table (in bytes) of any image in the chain; the L1 table is kept in
    /// memory while the image is open.
    pub max_l1_bytes: u64,
}

impl Default for UntrustedLimits {
    /// 16 images and 8 MiB of L1 table (1 Mi entries: 8 TiB of guest disk with 64 KiB
    /// clusters, 64 TiB with 2 MiB clusters).
    fn default() -> Self {
        Self {
            max_chain_depth: 16,
            max_l1_bytes: 8 << 20,
        }
    }
}

impl Trust {
    /// [`Trust::Untrusted`] with the default limits.
    pub fn untrusted() -> Self {
        Self::Untrusted(UntrustedLimits::default())
    }

    fn max_chain_depth(self) -> usize {
        match self {
            Self::Trusted => MAX_CHAIN_DEPTH,
            Self::Untrusted(l) => l.max_chain_depth.min(MAX_CHAIN_DEPTH),
        }
    }
}

/// How to open an image, and the calls that open it: a builder.
///
/// [`OpenOptions::new`] opens read-only, with QEMU's cache defaults, following the backing
/// chain, on the thread-pool backend without `O_DIRECT`, trusting the image. Options are set
/// by chaining; the options are then used (and may be reused) by one of the opening calls:
///
/// | call | storage | opens referenced files with |
/// |---|---|---|
/// | [`open`](Self::open) | [`AnyStorage`]: the [`backend`](Self::backend), with or without [`direct`](Self::direct) | the same backend |
/// | [`open_with`](Self::open_with) | whatever the [`Opener`] returns | the opener |
/// | [`open_storage`](Self::open_storage) | a storage you opened | nothing: backing and data file are given |
/// | [`open_blocking`](Self::open_blocking) | a [`BlockingImage`](super::BlockingImage) over [`AnyStorage`] | the same backend |
///
/// ```no_run
/// # async fn demo() -> qimg::Result<()> {
/// use qimg::{OpenOptions, io::Backend};
/// let img = OpenOptions::new()
///     .writable(true)
///     .backend(Backend::IoUring)
///     .direct(true)
///     .open("disk.qcow2")
///     .await?;
/// img.write(&[1u8; 4096], 0).await?;
/// img.close().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[must_use = "options do nothing until one of the open calls uses them"]
pub struct OpenOptions {
    pub(super) writable: bool,
    pub(super) cache: CacheOptions,
    pub(super) allocation: Allocation,
    follow_backing: bool,
    data_file: Option<PathBuf>,
    direct: bool,
    backend: Backend,
    clean_timer: bool,
    trust: Trust,
}

impl Default for OpenOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl OpenOptions {
    /// Read-only, QEMU's cache defaults, backing chain followed, thread-pool backend without
    /// `O_DIRECT`, clean timer on, image trusted.
    pub fn new() -> Self {
        Self {
            writable: false,
            cache: CacheOptions::default(),
            allocation: Allocation::default(),
            follow_backing: true,
            data_file: None,
            direct: false,
            backend: Backend::default(),
            clean_timer: true,
            trust: Trust::default(),
        }
    }

    /// Open for writing (the backing chain is always opened read-only).
    pub fn writable(mut self, writable: bool) -> Self {
        self.writable = writable;
        self
    }

    /// Cache budgets and the clean interval, with QEMU's option names and defaults.
    pub fn cache(mut self, cache: CacheOptions) -> Self {
        self.cache = cache;
        self
    }

    /// How new host clusters are reserved in the file.
    pub fn allocation(mut self, allocation: Allocation) -> Self {
        self.allocation = allocation;
        self
    }

    /// Open the backing chain (the default). Without it unallocated clusters read as zeros,
    /// which is only good for inspection; an image with a backing file then cannot be opened
    /// for writing.
    pub fn follow_backing(mut self, follow: bool) -> Self {
        self.follow_backing = follow;
        self
    }

    /// The external data file, overriding the name stored in the image.
    pub fn data_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.data_file = Some(path.into());
        self
    }

    /// Open files with `O_DIRECT` ([`open`](Self::open) and
    /// [`open_blocking`](Self::open_blocking); requests of any alignment are accepted, a
    /// bounce buffer covers unaligned ones). With [`open_with`](Self::open_with) the opener
    /// decides.
    pub fn direct(mut self, direct: bool) -> Self {
        self.direct = direct;
        self
    }

    /// The I/O backend of [`open`](Self::open) and [`open_blocking`](Self::open_blocking)
    /// for the image and every file it refers to.
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// Run the cache-clean timer (the default): when a tokio runtime is running at open, a
    /// task writes back and drops cache entries idle for the clean interval. Without it, call
    /// [`Image::clean_idle_caches`] yourself.
    pub fn clean_timer(mut self, run: bool) -> Self {
        self.clean_timer = run;
        self
    }

    /// How far the image is trusted (see [`Trust`]).
    pub fn trust(mut self, trust: Trust) -> Self {
        self.trust = trust;
        self
    }

    /// Whether the image will be opened for writing.
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    /// Opens the qcow2 image at `path`, its backing chain and data file on the
    /// [`backend`](Self::backend), with `O_DIRECT` when [`direct`](Self::direct) is set.
    pub async fn open(&self, path: impl AsRef<Path>) -> Result<Image<AnyStorage>> {
        let (backend, direct) = (self.backend, self.direct);
        let opener = move |p: &Path, writable: bool| AnyStorage::open(p, writable, backend, direct);
        self.open_with(path.as_ref(), &opener).await
    }

    /// Opens the image at `path` through `opener`, which also opens its backing chain and
    /// external data file ([`backend`](Self::backend) and [`direct`](Self::direct) do not
    /// apply: the opener decides).
    pub async fn open_with<S: Storage + 'static>(
        &self,
        path: impl AsRef<Path>,
        opener: &dyn Opener<S>,
    ) -> Result<Image<S>> {
        let path = path.as_ref();
        let file = opener
            .open(path, self.writable)
            .map_err(|e| Error::storage(path, e))?;
        let mut seen = Vec::new();
        open_chain(
            file,
            path.to_path_buf(),
            self,
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
    pub async fn open_storage<S: Storage + 'static>(
        &self,
        file: S,
        name: impl Into<PathBuf>,
        backing: Option<Backing<S>>,
        data_file: Option<S>,
    ) -> Result<Image<S>> {
        let name = name.into();
        let mut seen = Vec::new();
        let given = Given { backing, data_file };
        open_chain(file, name, self, None, Some(given), 0, &mut seen).await
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

/// Opens files with [`FileStorage`], for [`OpenOptions::open_with`] when the storage type
/// must be [`FileStorage`] itself.
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

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

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
        within_limits(opts, &path, h)?;
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
            (None, Some(name), Some(op)) if opts.follow_backing => {
                let max_depth = opts.trust.max_chain_depth();
                if depth + 1 > max_depth {
                    return Err(Error::Unsupported {
                        path,
                        what: format!("backing chain deeper than {max_depth} images"),
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
                        let mut bopts = opts.clone();
                        bopts.writable = false;
                        bopts.data_file = None;
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
        if opts.clean_timer {
            if let (Some(interval), Ok(handle)) =
                (inner.clean_interval, tokio::runtime::Handle::try_current())
            {
                spawn_cleaner(&handle, Arc::downgrade(&inner), interval);
            }
        }
        Ok(Image { inner })
    })
}

/// For an untrusted image ([`Trust::Untrusted`]), refuses a stored file name that is
/// absolute or contains a `..` component (or is a protocol-style name such as `json:{...}`).
fn confined(opts: &OpenOptions, image: &Path, what: &str, name: &str) -> Result<()> {
    if opts.trust == Trust::Trusted {
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
                "{what} name {name:?} is absolute or leaves the image's directory, and the \
                 image is untrusted (Trust::Untrusted)"
            ),
        });
    }
    Ok(())
}

/// For an untrusted image, refuses an active L1 table larger than the limit before it is
/// loaded into memory.
fn within_limits(opts: &OpenOptions, image: &Path, header: &Header) -> Result<()> {
    let Trust::Untrusted(limits) = opts.trust else {
        return Ok(());
    };
    let l1_bytes = u64::from(header.l1_size) * L1_ENTRY_SIZE as u64;
    if l1_bytes > limits.max_l1_bytes {
        return Err(Error::Unsupported {
            path: image.to_path_buf(),
            what: format!(
                "L1 table of {} entries ({l1_bytes} bytes, l1_size at offset 36) is larger than \
                 the {} bytes an untrusted image may have (UntrustedLimits::max_l1_bytes)",
                header.l1_size, limits.max_l1_bytes
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

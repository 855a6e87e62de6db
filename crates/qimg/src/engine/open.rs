//! Opening an image: the [`Opener`] that opens the files an image refers to, the walk down
//! the backing chain, and the checks and repairs made before an image is handed out.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Weak};
use std::time::Duration;

use qimg_cache::ImageFacts;
use qimg_format::extensions::Cluster0;
use qimg_format::features::{
    AUTOCLEAR_BITMAPS, AUTOCLEAR_DATA_FILE_RAW, COMPAT_LAZY_REFCOUNTS, INCOMPAT_DATA_FILE,
    INCOMPAT_DIRTY, autoclear_for_writer,
};
use qimg_format::geometry::{Geometry, RefcountGeometry};
use qimg_format::header::{self, CompressionType, Header};
use qimg_format::l1;
use qimg_format::l2::L2Context;
use qimg_format::validate::{OpenMode, validate_cluster0};
use qimg_io::{AnyStorage, FileStorage, ImageLock, Storage, StorageError};

use super::image::{Backing, Image, Inner};
use super::lock::RangeLocks;
use super::meta::Meta;
use super::options::{OpenOptions, Trust};
use super::state::{Counters, Reservation, Shared};
use crate::chain::{self, ImageFormat, data_file_path, probe_format, resolve_backing};
use crate::error::{Error, Result};

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

/// What [`OpenOptions::open_storage`] is given in place of opening referenced files.
pub(super) struct Given<S: Storage> {
    pub(super) backing: Option<Backing<S>>,
    pub(super) data_file: Option<S>,
}

pub(super) fn open_chain<'a, S: Storage + 'static>(
    file: S,
    path: PathBuf,
    opts: &'a OpenOptions,
    opener: Option<&'a dyn Opener<S>>,
    given: Option<Given<S>>,
    depth: usize,
    seen: &'a mut Vec<PathBuf>,
) -> BoxFuture<'a, Result<Image<S>>> {
    Box::pin(async move {
        if opts.writable && opts.force_share {
            return Err(Error::InvalidOption(format!(
                "{}: force-share (-U) can only be used with read-only opens",
                path.display()
            )));
        }
        lock(&file, &path, opts.image_lock(opts.writable))?;
        let mode = if opts.writable {
            OpenMode::ReadWrite
        } else {
            OpenMode::ReadOnly
        };
        let c0 = read_cluster0(&file, &path, mode).await?;
        let h = &c0.header;
        within_limits(opts, &path, h)?;
        let crypt = unlock(&file, &path, &c0, opts).await?;
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
                (Some(s), _) => {
                    lock(&s, &name, opts.image_lock(opts.writable))?;
                    Some((name, s))
                }
                (None, Some(op)) if !name.as_os_str().is_empty() => {
                    let s = op
                        .open(&name, opts.writable)
                        .map_err(|e| Error::storage(&name, e))?;
                    lock(&s, &name, opts.image_lock(opts.writable))?;
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
                // What fails in opening the backing file is wrapped: the error says which
                // image names it (one level per image, as QEMU's messages nest).
                // qimg's own limits (chain depth, loops) pass through as they are.
                let backing_err = |e: Error| match e {
                    e @ Error::Unsupported { .. } => e,
                    e => Error::Backing {
                        path: path.clone(),
                        source: Box::new(e),
                    },
                };
                let fmt = match c0.backing_format() {
                    None => probe_format(&bpath).map_err(backing_err)?,
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
                    .map_err(|e| backing_err(Error::storage(&bpath, e)))?;
                Some(match fmt {
                    ImageFormat::Raw => {
                        lock(&storage, &bpath, opts.image_lock(false)).map_err(backing_err)?;
                        Backing::Raw {
                            storage,
                            path: bpath,
                        }
                    }
                    ImageFormat::Qcow2 => {
                        let mut bopts = opts.clone();
                        bopts.writable = false;
                        bopts.data_file = None;
                        let img =
                            open_chain(storage, bpath, &bopts, Some(op), None, depth + 1, seen)
                                .await
                                .map_err(backing_err)?;
                        Backing::Qcow2(img)
                    }
                })
            }
            _ => None,
        };

        // Boxed: this function recurses down the backing chain, and everything after the
        // backing file is open (metadata, caches, state) would otherwise count in the stack
        // frame of every level.
        Box::pin(assemble(
            Parts {
                file,
                path,
                c0,
                geo,
                rgeo,
                ctx,
                data_file,
                backing,
                crypt,
            },
            opts,
        ))
        .await
    })
}

/// What [`open_chain`] found before it builds the image: the file, its first cluster,
/// geometry, data file and (opened) backing file.
struct Parts<S: Storage> {
    file: S,
    path: PathBuf,
    c0: Cluster0,
    geo: Geometry,
    rgeo: RefcountGeometry,
    ctx: L2Context,
    data_file: Option<(PathBuf, S)>,
    backing: Option<Backing<S>>,
    crypt: Option<Arc<dyn crate::crypto::SectorCipher>>,
}

/// The rest of [`open_chain`] once the backing chain is open: the metadata loaded, the
/// image assembled and prepared for writing.
async fn assemble<S: Storage + 'static>(parts: Parts<S>, opts: &OpenOptions) -> Result<Image<S>> {
    let Parts {
        file,
        path,
        c0,
        geo,
        rgeo,
        ctx,
        data_file,
        backing,
        crypt,
    } = parts;
    let h = &c0.header;
    if opts.writable && backing.is_none() && c0.backing_file.is_some() && !opts.backing_null {
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
    let reservation = Reservation::new(meta.end_cluster() * geo.cluster_size());
    let shared = Shared {
        file,
        data_file,
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
        counters: Counters::default(),
        epoch: tokio::time::Instant::now(),
        clean_interval: resolved.clean_interval,
        marked_corrupt: AtomicBool::new(false),
        on_message: opts.on_message.clone(),
        halted: std::sync::OnceLock::new(),
        abandoned: std::sync::Mutex::new(Vec::new()),
        close_on_drop: opts.close_on_drop && opts.writable,
        reservation,
        slice_loads: Default::default(),
        bitmaps: Default::default(),
        crypt,
        path,
    };
    let inner = Arc::new(Inner {
        shared,
        backing,
        meta: tokio::sync::Mutex::new(meta),
        locks: RangeLocks::default(),
    });
    // Boxed: this function recurses down the backing chain, and every level's frame
    // counts.
    inner
        .shared
        .bitmaps
        .set_crash_consistent(opts.crash_consistent_bitmaps);
    if opts.writable {
        Box::pin(inner.prepare_for_writing(&c0.header, c0.bitmaps())).await?;
    } else if let Some(ext) = c0.bitmaps() {
        if c0.header.autoclear_features & AUTOCLEAR_BITMAPS != 0 {
            Box::pin(inner.list_bitmaps(ext)).await;
        }
    }
    if let (true, Some(interval)) = (opts.clean_timer, inner.shared.clean_interval) {
        match tokio::runtime::Handle::try_current() {
            Ok(handle) if !opts.timer_thread => {
                handle.spawn(cleaner(Arc::downgrade(&inner), interval));
            }
            _ => cleaner_thread(&inner.shared.path, Arc::downgrade(&inner), interval)?,
        }
    }
    Ok(Image { inner })
}

/// The largest LUKS header area read at an open (QEMU's default area is 2 MiB; eight slots
/// of 4000 stripes of a 64-byte key need 2 MiB).
const MAX_LUKS_AREA: u64 = 64 << 20;

/// The sector cipher of an encrypted image, unlocked with the passphrase `opts` carries;
/// `None` for an image that is not encrypted. Refused: an encrypted image without a
/// passphrase, the legacy AES method, a passphrase no key slot takes (QEMU's "Invalid
/// password, cannot unlock any keyslot"), a LUKS header qimg cannot use.
async fn unlock<S: Storage>(
    file: &S,
    path: &Path,
    c0: &Cluster0,
    opts: &OpenOptions,
) -> Result<Option<Arc<dyn crate::crypto::SectorCipher>>> {
    let method = c0.header.crypt_method;
    if method == 0 {
        return Ok(None);
    }
    let key = match (&opts.key, method) {
        (Some(key), 2) => key.clone(),
        _ => {
            return Err(Error::Encrypted {
                path: path.to_path_buf(),
                method,
            });
        }
    };
    let crypto_err = |source| Error::Crypto {
        path: path.to_path_buf(),
        source,
    };
    // The extension is there (the header's validation requires it for LUKS).
    let (offset, length) = c0
        .extensions
        .iter()
        .find_map(|e| match e {
            qimg_format::extension::Extension::Crypto { offset, length } => {
                Some((*offset, *length))
            }
            _ => None,
        })
        .unwrap_or((0, 0));
    if length < qimg_format::luks::LUKS_HEADER_LEN as u64 || length > MAX_LUKS_AREA {
        return Err(crypto_err(crate::crypto::CryptoError::Invalid(format!(
            "the full disk encryption header extension gives the LUKS header {length} bytes \
             at {offset:#x} (at least {} and at most {MAX_LUKS_AREA} expected)",
            qimg_format::luks::LUKS_HEADER_LEN
        ))));
    }
    let mut area = vec![0u8; length as usize];
    file.read_at_zero_fill(&mut area, offset)
        .await
        .map_err(|e| Error::storage(path, e))?;
    let header =
        qimg_format::luks::LuksHeader::decode(&area, offset).map_err(|e| Error::format(path, e))?;
    // PBKDF2 runs on this thread (as long as the header's iteration counts ask: QEMU's
    // default is two seconds for a key slot), once per open.
    let cipher = crate::crypto::unlock(&header, &area, &key.0).map_err(crypto_err)?;
    Ok(Some(Arc::from(cipher)))
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
    let l1_bytes = l1::table_bytes(u64::from(header.l1_size));
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

/// Takes QEMU's image locks on a file of the chain (see [`OpenOptions::locking`]).
fn lock<S: Storage>(file: &S, path: &Path, lock: Option<ImageLock>) -> Result<()> {
    match lock {
        Some(l) => file.lock_image(l).map_err(|e| Error::storage(path, e)),
        None => Ok(()),
    }
}

/// The clean timer on a thread of its own, for embedders without a running runtime. It holds
/// only a weak reference: it ends at the first tick after the image is closed or dropped.
fn cleaner_thread<S: Storage + 'static>(
    path: &Path,
    weak: Weak<Inner<S>>,
    interval: Duration,
) -> Result<()> {
    let rt = qimg_io::threads::runtime()
        .build()
        .map_err(|e| Error::io(path, "start the clean timer's runtime", e))?;
    qimg_io::threads::spawn("qimg-clean", move || rt.block_on(cleaner(weak, interval)))
        .map_err(|e| Error::io(path, "start the clean timer's thread", e))?;
    Ok(())
}

async fn cleaner<S: Storage + 'static>(weak: Weak<Inner<S>>, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(inner) = weak.upgrade() else { break };
        let mut m = inner.meta.lock().await;
        if m.is_closed() {
            break;
        }
        // Errors surface on the next request or flush; the timer just tries again.
        let _ = inner.shared.clean_idle(&mut m).await;
    }
}

pub(crate) async fn read_cluster0<S: Storage>(
    file: &S,
    path: &Path,
    mode: OpenMode,
) -> Result<Cluster0> {
    let len = file.len().await.map_err(|e| Error::storage(path, e))?;
    let bytes = chain::cluster0_bytes(file, len)
        .await
        .map_err(|e| Error::storage(path, e))?;
    validate_cluster0(&bytes, mode).map_err(|e| Error::format(path, e))
}

impl<S: Storage> Inner<S> {
    /// Read-only open: the bitmaps are listed (their bits are read when asked for); a
    /// directory QEMU would refuse leaves the list empty: reading the disk does not need it.
    async fn list_bitmaps(&self, ext: &qimg_format::bitmap::BitmapsExtension) {
        let mut m = self.meta.lock().await;
        let _ = self.load_bitmaps(&mut m, ext, false).await;
    }

    /// Read-write open: repair a dirty image, load the bitmaps (marking them in use), drop
    /// autoclear bits we do not maintain.
    async fn prepare_for_writing(
        &self,
        h: &Header,
        bitmaps: Option<&qimg_format::bitmap::BitmapsExtension>,
    ) -> Result<()> {
        let mut m = self.meta.lock().await;
        // Structures that share host bytes do not stop the open (QEMU opens such an image
        // too): the first write that would land on another structure is refused and marks
        // the image corrupt (`guard_write`), and reads go on.
        // Bitmaps are consistent only with autoclear bit 0; without it QEMU ignores them (and
        // drops the bit's meaning): so does the engine. Loaded before a dirty image's
        // refcounts are rebuilt, which must count their clusters.
        let loaded = match bitmaps {
            Some(ext) if h.version >= 3 && h.autoclear_features & AUTOCLEAR_BITMAPS != 0 => {
                self.load_bitmaps(&mut m, ext, true).await?;
                true
            }
            _ => false,
        };
        if h.version >= 3 {
            self.maintain_bitmaps();
        }
        if h.incompatible_features & INCOMPAT_DIRTY != 0 {
            // Boxed: a large future, rarely run, that every open of a backing chain would
            // otherwise nest once per file on the caller's stack.
            Box::pin(self.rebuild_refcounts(&mut m)).await?;
            // A crash inside a snapshot change can leave COPIED flags that disagree with the
            // refcounts (QEMU's dirty-open repair fixes them too).
            self.sync_copied(&mut m).await?;
            m.note_dirty_on_disk();
            self.shared.mark_clean(&mut m).await?;
        }
        let keep = autoclear_for_writer(h.autoclear_features, loaded);
        if h.version >= 3 && h.autoclear_features != keep {
            self.shared
                .file
                .write_at(
                    &header::encode_autoclear(keep),
                    header::field::AUTOCLEAR_FEATURES,
                )
                .await
                .map_err(|e| self.shared.storage_error(e))?;
            self.shared.flush_file().await?;
        }
        if bitmaps.is_some() && !loaded {
            // A bitmaps extension that autoclear bit 0 does not vouch for (a v2 image, or a
            // writer without bitmap support cleared the bit): its bitmaps are lost, and the
            // header drops it as QEMU's read-write open does (their clusters stay leaked
            // until `check -r`).
            drop(m);
            self.point_header_at_directory(None, 0).await?;
        }
        Ok(())
    }
}

impl OpenOptions {
    /// Opens the qcow2 image at `path`, its backing chain and data file on the
    /// [`backend`](Self::backend), with `O_DIRECT` when [`direct`](Self::direct) is set.
    pub async fn open(&self, path: impl AsRef<Path>) -> Result<Image<AnyStorage>> {
        let (backend, direct) = (self.backend, self.direct);
        let opener = move |p: &Path, writable: bool| AnyStorage::open(p, writable, backend, direct);
        self.open_with(path.as_ref(), &opener).await
    }

    /// Opens the image held by `file`, a descriptor the caller opened (and perhaps probed with
    /// [`crate::probe`]): qimg works on that descriptor, not on a second one opened by name,
    /// so the name cannot come to mean another file in between. `name` is what errors say and
    /// what relative backing and data file names are resolved against; those are opened by
    /// name on the [`backend`](Self::backend). Open `file` for writing when
    /// [`writable`](Self::writable) is set, and with `O_DIRECT` for direct I/O (its status
    /// flags decide). The QEMU-compatible image lock is taken on `file` as on any image.
    pub async fn open_file(
        &self,
        file: std::fs::File,
        name: impl AsRef<Path>,
    ) -> Result<Image<AnyStorage>> {
        let name = name.as_ref();
        let (backend, direct) = (self.backend, self.direct);
        let flags = nix::fcntl::fcntl(&file, nix::fcntl::FcntlArg::F_GETFL)
            .map_err(|e| Error::io(name, "read the file's status flags", e.into()))?;
        let read_only = nix::fcntl::OFlag::from_bits_truncate(flags) & nix::fcntl::OFlag::O_ACCMODE
            == nix::fcntl::OFlag::O_RDONLY;
        let storage = AnyStorage::from_file(file, backend).map_err(|e| Error::storage(name, e))?;
        if self.writable && read_only {
            return Err(Error::InvalidOption(format!(
                "{}: the file was opened read-only but a writable image was asked for",
                name.display()
            )));
        }
        let opener = move |p: &Path, writable: bool| AnyStorage::open(p, writable, backend, direct);
        let mut seen = Vec::new();
        open_chain(
            storage,
            name.to_path_buf(),
            self,
            Some(&opener),
            None,
            0,
            &mut seen,
        )
        .await
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

//! The open image of a `qimg io` run and how qemu-io's requests map onto the engine (qcow2)
//! or the storage layer (raw: the size rounds up to 512 bytes, every byte counts as
//! allocated, discard and write-zeroes leave zeros, `truncate` takes any size, compressed
//! writes are refused; a probed raw image gets qemu-io's warning).
//!
//! - Requests past the end of the disk fail with `EIO`, as QEMU's block layer fails them,
//!   before the engine sees them.
//! - `write -z` (with or without `-u`) is the engine's `write_zeroes`: whole (sub)clusters
//!   become zero clusters and give their host cluster back, as QEMU does with `-u`. A
//!   partial head or tail covers its whole subcluster when that holds no data and the rest
//!   of it already reads as zeros (as QEMU's qcow2 does), and is written with zeros
//!   otherwise. Two engine differences remain: without `-u` QEMU keeps the host cluster of
//!   a whole cluster (a zero cluster with an offset), and with extended L2 entries it keeps
//!   a host cluster whose last allocated subclusters were zeroed; the engine frees both.
//!   Guest data and qemu-io's `map`/`alloc` agree; later compressed writes and discards on
//!   such a cluster can differ (tests/io_interop.rs shows it).
//! - `discard` is what QEMU's qcow2 does for a discard request: only whole clusters count
//!   (the last, partial cluster of the disk included), and each becomes a zero cluster when
//!   it has a host cluster or the image has a backing file (else it stays unallocated). The
//!   engine's `discard` would instead make the range read from the backing file. Version 2
//!   images have no zero clusters: QEMU unallocates (the engine's `discard`) without a
//!   backing file and leaves the clusters alone with one.
//! - `write -c` compresses cluster by cluster; like QEMU it refuses images with an external
//!   data file (`ENOTSUP`), an unaligned start or a short chunk that does not end the disk
//!   (`EINVAL`) and a cluster that already has a host cluster (`EIO`), trying every cluster
//!   of the request and reporting the first failure. (QEMU compresses up to 8 clusters at
//!   once and stops starting new ones after a failure, so how many clusters after a failing
//!   one it writes depends on timing.)
//! - With `writethrough` (qemu-io's default cache mode) and `directsync` every write is
//!   followed by a flush; `unsafe` ignores flushes.

use std::path::Path;

use qimg::chain::{ImageFormat, probe_format, read_cluster0};
use qimg::format::validate::OpenMode;
use qimg::io::{AnyStorage, Backend, ImageLock, Storage, StorageError};
use qimg::{Backing, ExtentKind, Image, OpenOptions};

use crate::args::image_format;
use crate::cache_mode::CacheMode;
use crate::status::{lib_msg, lock_error, os_msg};

/// `EIO`.
pub const EIO: i32 = 5;
/// `EINVAL`.
pub const EINVAL: i32 = 22;
/// `ENOTSUP`.
pub const ENOTSUP: i32 = 95;

/// How to open an image (command line or `open` command).
#[derive(Debug, Clone)]
pub struct OpenSpec {
    /// `-f`.
    pub fmt: Option<String>,
    /// `-r`.
    pub read_only: bool,
    /// `-U`.
    pub force_share: bool,
    /// `-t` / `-n`.
    pub cache: CacheMode,
    /// `-i`.
    pub backend: Backend,
    /// `-i native` / `-k`: Linux AIO, which QEMU allows only with `O_DIRECT` (qimg serves it
    /// with io_uring).
    pub native_aio: bool,
    /// `-s`: writes go to a temporary overlay, the image itself is only read.
    pub snapshot: bool,
    /// `-C`: what reads find below the image is copied into it.
    pub copy_on_read: bool,
    /// `-d ignore` / `-d off`: discard requests succeed and do nothing (QEMU's open without
    /// `BDRV_O_UNMAP`); qemu-io's default is `unmap`.
    pub discard_ignored: bool,
}

/// qemu-io's default cache mode, `writethrough`.
pub fn default_cache() -> CacheMode {
    CacheMode {
        name: "writethrough",
        direct: false,
        writethrough: true,
        no_flush: false,
    }
}

/// A `-t` value, or the line qemu-io prints for a bad one.
pub fn cache_mode(value: &str) -> Result<CacheMode, String> {
    CacheMode::parse(value).map_err(|_| format!("qemu-io: Invalid cache option: {value}"))
}

/// A `-d` value: whether discards are ignored, or the line qemu-io prints for a bad one.
pub fn discard_mode(value: &str) -> Result<bool, String> {
    match value {
        "ignore" | "off" => Ok(true),
        "unmap" | "on" => Ok(false),
        other => Err(format!("qemu-io: Invalid discard option: {other}")),
    }
}

/// An `-i` value, or the line qemu-io prints for a bad one.
pub fn aio_mode(value: &str) -> Result<Backend, String> {
    match value {
        "threads" => Ok(Backend::Threads),
        "io_uring" | "native" => Ok(Backend::IoUring),
        other => Err(format!("qemu-io: Invalid aio option: {other}")),
    }
}

/// A command failed (its message is already printed).
#[derive(Debug)]
pub struct Failed;

/// The outcome of one command.
pub type Outcome = Result<(), Failed>;

/// The errno of a storage error (`EIO` when it has none).
fn storage_errno(e: StorageError) -> i32 {
    e.raw_os_error().unwrap_or(EIO)
}

/// C's `strerror` text of `errno`.
pub fn strerror(errno: i32) -> String {
    os_msg(&std::io::Error::from_raw_os_error(errno))
}

/// Why `file` did not open, as QEMU words it: a system error names the file it happened on
/// (the image, its data file or a backing file).
fn open_error(e: &qimg::Error, file: &str) -> String {
    // A read-write open of an image marked corrupt, in QEMU's words.
    if let qimg::Error::Format {
        source:
            qimg::format::FormatError::InvalidField {
                what,
                offset,
                value,
                reason,
            },
        ..
    } = e
    {
        let corrupt = value & qimg::format::features::INCOMPAT_CORRUPT != 0;
        if *what == "incompatible_features"
            && *offset == 72
            && corrupt
            && reason.starts_with("the corrupt bit")
        {
            return "qcow2: Image is corrupt; cannot be opened read/write".into();
        }
    }
    if let qimg::Error::Storage {
        path,
        source: StorageError::Locked { holder },
    } = e
    {
        return lock_error(holder, &path.display().to_string());
    }
    let failed_on = match e {
        qimg::Error::Storage { path, .. } | qimg::Error::Io { path, .. } => Some(path),
        _ => None,
    };
    match (failed_on, e.os_error()) {
        (Some(path), Some(errno)) => {
            format!("Could not open '{}': {}", path.display(), strerror(errno))
        }
        _ => format!("Could not open '{file}': {}", lib_msg(e, file)),
    }
}

/// Whether `[offset, offset + len)` of the raw file at `path` is a hole or past its end, as
/// the file system reports it (`SEEK_DATA`); `false` when that cannot be told.
fn raw_hole(path: &Path, offset: u64, len: u64) -> bool {
    use nix::unistd::{Whence, lseek};
    let Ok(file) = std::fs::File::open(path) else {
        return false;
    };
    let Ok(file_len) = file.metadata().map(|m| m.len()) else {
        return false;
    };
    if offset >= file_len {
        return true;
    }
    let Ok(at) = i64::try_from(offset) else {
        return false;
    };
    match lseek(&file, at, Whence::SeekData) {
        // The next data starts at or after the end of the range (or of the file).
        Ok(next) => u64::try_from(next).is_ok_and(|n| n >= (offset + len).min(file_len)),
        // No data after `offset`.
        Err(nix::errno::Errno::ENXIO) => true,
        Err(_) => false,
    }
}

/// A raw image: the file itself, through the storage layer.
pub struct RawFile {
    /// The file.
    storage: AnyStorage,
    /// Its length in bytes (the virtual size rounds it up to 512, as QEMU's).
    len: std::cell::Cell<u64>,
}

impl RawFile {
    /// The virtual size.
    fn size(&self) -> u64 {
        self.len.get().next_multiple_of(512)
    }

    /// Notes that the file now reaches at least `end`.
    fn grew_to(&self, end: u64) {
        self.len.set(self.len.get().max(end));
    }
}

/// A storage error at open, as QEMU words it.
fn storage_open_error(e: &StorageError, file: &str) -> String {
    match e {
        StorageError::Locked { holder } => lock_error(holder, file),
        // An NBD export's refusals, in QEMU's words where it has them.
        StorageError::Open { source, .. } if qimg::io::nbd::is_nbd_name(file) => {
            match source.kind() {
                std::io::ErrorKind::PermissionDenied => {
                    "Could not open image: Permission denied".to_string()
                }
                std::io::ErrorKind::NotFound if source.to_string().contains("export") => {
                    source.to_string()
                }
                _ => format!("Could not open '{file}': {source}"),
            }
        }
        other => match other.raw_os_error() {
            Some(errno) => format!("Could not open '{file}': {}", strerror(errno)),
            None => format!("Could not open '{file}': {other}"),
        },
    }
}

/// The open image and the state of the run.
pub struct Session {
    /// The qcow2 image, when one is open.
    pub img: Option<Image<AnyStorage>>,
    /// The raw image, when one is open.
    pub raw: Option<std::rc::Rc<RawFile>>,
    /// The cache mode it was opened with.
    pub cache: CacheMode,
    /// Whether it was opened read-only.
    pub read_only: bool,
    /// Its qcow2 version (2 has no zero clusters: a discard unallocates).
    pub version: u32,
    /// Whether any command failed.
    pub failed: bool,
    /// The name and options of the last open that succeeded (for `reopen`).
    pub opened: Option<(String, OpenSpec)>,
    /// Copy-on-read (`-C`).
    pub copy_on_read: bool,
    /// Discards ignored (`-d ignore`).
    pub discard_ignored: bool,
    /// `aio_read`/`aio_write` requests in flight, each answering whether its command line
    /// was good (see [`Session::drain`]).
    pub aio: Vec<tokio::task::JoinHandle<bool>>,
}

impl Session {
    /// A session with no image open.
    pub fn new() -> Self {
        Session {
            img: None,
            raw: None,
            cache: default_cache(),
            read_only: false,
            version: 3,
            failed: false,
            opened: None,
            copy_on_read: false,
            discard_ignored: false,
            aio: Vec::new(),
        }
    }

    /// A session on the same open image, for one asynchronous request to run on by itself
    /// (qemu-io's `aio_read`/`aio_write`).
    pub fn for_request(&self) -> Session {
        Session {
            img: self.img.clone(),
            raw: self.raw.clone(),
            cache: self.cache,
            read_only: self.read_only,
            version: self.version,
            failed: false,
            opened: None,
            copy_on_read: self.copy_on_read,
            discard_ignored: self.discard_ignored,
            aio: Vec::new(),
        }
    }

    /// Waits until every asynchronous request has completed (qemu-io's `aio_flush`, and what
    /// closing the image or ending the run does first); one whose command line was bad
    /// fails the run, as it would have failed its command.
    pub async fn drain(&mut self) {
        for request in std::mem::take(&mut self.aio) {
            if !request.await.unwrap_or(false) {
                self.failed = true;
            }
        }
    }

    /// Opens `file` as `spec` says; errors are printed as qemu-io prints them.
    pub async fn open(&mut self, file: &str, spec: &OpenSpec) -> Outcome {
        if self.is_open() {
            complain!("qemu-io: file open already, try 'help close'");
            return Err(Failed);
        }
        let fail = |msg: String| {
            // Named as typed: a `json:` name is the device; an option string has none.
            match crate::status::typed_name(file) {
                Some(t) if !t.starts_with("json:") => complain!("qemu-io: can't open: {msg}"),
                Some(t) => complain!("qemu-io: can't open device {t}: {msg}"),
                None => complain!("qemu-io: can't open device {file}: {msg}"),
            }
            Err(Failed)
        };
        if spec.force_share && !spec.read_only {
            return fail("force-share=on can only be used with read-only images".into());
        }
        if spec.native_aio && !spec.cache.direct {
            return fail(
                "aio=native was specified, but it requires cache.direct=on, which was not \
                 specified."
                    .into(),
            );
        }
        self.opened = Some((file.to_string(), spec.clone()));
        self.copy_on_read = spec.copy_on_read;
        self.discard_ignored = spec.discard_ignored;
        let path = Path::new(file);
        let given = crate::image_spec::format_for(file);
        let fmt = match spec.fmt.as_ref().or(given.as_ref()) {
            Some(name) => match image_format(name) {
                Some(f) => f,
                None => return fail(format!("Unknown driver '{name}'")),
            },
            None => match probe_format(path) {
                Ok(f) => f,
                Err(e) => return fail(format!("Could not open '{file}': {}", lib_msg(&e, file))),
            },
        };
        if spec.snapshot {
            return match self.open_snapshot(path, fmt, spec).await {
                Ok(()) => Ok(()),
                Err(e) => fail(e),
            };
        }
        if fmt == ImageFormat::Raw {
            if spec.fmt.is_none() && given.is_none() {
                complain!(
                    "WARNING: Image format was not specified for '{file}' and probing guessed raw.\n         \
                     Automatically detecting the format is dangerous for raw images, write operations on block 0 will be restricted.\n         \
                     Specify the 'raw' format explicitly to remove the restrictions."
                );
            }
            return match self.open_raw(path, spec).await {
                Ok(()) => Ok(()),
                Err(e) => fail(storage_open_error(&e, file)),
            };
        }
        let opts = crate::image_spec::options_for(path)
            .writable(!spec.read_only)
            .force_share(spec.force_share)
            .direct(spec.cache.direct)
            .backend(spec.backend)
            .clean_timer(false);
        match opts.open(path).await {
            Ok(img) => {
                self.version =
                    read_cluster0(path, OpenMode::ReadOnly).map_or(3, |c0| c0.header.version);
                self.img = Some(img);
                self.cache = spec.cache;
                self.read_only = spec.read_only;
                // What QEMU's open prints when it repairs a dirty image.
                self.print_messages().await;
                Ok(())
            }
            Err(e) => fail(open_error(&e, file)),
        }
    }

    /// `-s` (QEMU's `snapshot=on`): a temporary qcow2 overlay over the image (opened
    /// read-only as its backing file) takes the writes; its file is removed at once, so
    /// nothing is left behind however the run ends.
    async fn open_snapshot(
        &mut self,
        path: &Path,
        fmt: ImageFormat,
        spec: &OpenSpec,
    ) -> Result<(), String> {
        let backing = std::fs::canonicalize(path).map_err(|e| os_msg(&e))?;
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let overlay =
            std::env::temp_dir().join(format!("qimg-io-{}-{n}.qcow2", std::process::id()));
        let opts = qimg::tools::create::CreateOptions {
            backing_file: Some(backing.display().to_string()),
            backing_fmt: Some(
                if fmt == ImageFormat::Raw {
                    "raw"
                } else {
                    "qcow2"
                }
                .into(),
            ),
            ..Default::default()
        };
        let made = qimg::tools::create::create(&overlay, &opts, &mut |_, _| {});
        if let Err(e) = made {
            let _ = std::fs::remove_file(&overlay);
            return Err(format!(
                "Could not create temporary overlay: {}",
                lib_msg(&e, "")
            ));
        }
        let opened = OpenOptions::new()
            .writable(true)
            .direct(spec.cache.direct)
            .backend(spec.backend)
            .clean_timer(false)
            .open(&overlay)
            .await;
        let _ = std::fs::remove_file(&overlay);
        let img = opened.map_err(|e| open_error(&e, &path.display().to_string()))?;
        self.version = 3;
        self.img = Some(img);
        self.cache = spec.cache;
        self.read_only = false;
        Ok(())
    }

    /// Opens a raw image with the locks QEMU takes on it.
    async fn open_raw(&mut self, path: &Path, spec: &OpenSpec) -> Result<(), StorageError> {
        let storage = AnyStorage::open(path, !spec.read_only, spec.backend, spec.cache.direct)?;
        let lock = match (spec.read_only, spec.force_share) {
            (false, _) => ImageLock::ReadWrite,
            (true, false) => ImageLock::Read,
            (true, true) => ImageLock::SharedRead,
        };
        storage.lock_image(lock)?;
        let len = storage.len().await?;
        self.raw = Some(std::rc::Rc::new(RawFile {
            storage,
            len: std::cell::Cell::new(len),
        }));
        self.cache = spec.cache;
        self.read_only = spec.read_only;
        Ok(())
    }

    /// Whether an image is open.
    pub fn is_open(&self) -> bool {
        self.img.is_some() || self.raw.is_some()
    }

    /// The virtual size of the open image.
    pub fn size(&self) -> u64 {
        match &self.raw {
            Some(r) => r.size(),
            None => self.image().size(),
        }
    }

    /// Closes the image (writing back its caches).
    pub async fn close(&mut self) -> Outcome {
        // The blkdebug node's breakpoints go with the image; a request stopped at one goes
        // on (QEMU's close would wait for it for ever).
        if let Some(bp) = qimg::io::blkdebug::attached_breakpoints() {
            bp.release_all();
        }
        self.close_keeping_breakpoints().await
    }

    /// [`close`](Self::close) for a reopen: the blkdebug node, and its breakpoints, stay.
    pub async fn close_keeping_breakpoints(&mut self) -> Outcome {
        self.drain().await;
        if let Some(r) = self.raw.take() {
            r.storage.unlock_image();
        }
        if let Some(img) = self.img.take() {
            if let Err(e) = img.close().await {
                if let qimg::Error::Storage { source, .. } = &e {
                    // QEMU's close writes back its two caches and reports each failure; a
                    // failing file fails both.
                    let why = strerror(source.raw_os_error().unwrap_or(EIO));
                    complain!("qemu-io: Failed to flush the L2 table cache: {why}");
                    complain!("qemu-io: Failed to flush the refcount block cache: {why}");
                    return Err(Failed);
                }
                let name = img.path().display().to_string();
                complain!("qemu-io: closing the image failed: {}", lib_msg(&e, &name));
                return Err(Failed);
            }
        }
        Ok(())
    }

    /// Closes the image at the end of the run; whether every command succeeded.
    pub async fn finish(&mut self) -> bool {
        if self.close().await.is_err() {
            self.failed = true;
        }
        !self.failed
    }

    /// The open image (commands that need one are only dispatched when it is open).
    pub fn image(&self) -> &Image<AnyStorage> {
        self.img
            .as_ref()
            .expect("dispatch checks that an image is open")
    }

    /// `EIO` for a request that does not lie within the disk.
    pub fn check_request(&self, offset: u64, len: u64) -> Result<(), i32> {
        let size = self.size();
        if offset > size || len > size - offset {
            return Err(EIO);
        }
        Ok(())
    }

    /// The flush a write is followed by in writethrough mode.
    async fn after_write(&self, fua: bool) -> Result<(), i32> {
        if (self.cache.writethrough || fua) && !self.cache.no_flush {
            self.flush_now().await?;
        }
        Ok(())
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub async fn read(&self, buf: &mut [u8], offset: u64) -> Result<(), i32> {
        self.check_request(offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(());
        }
        if let Some(r) = &self.raw {
            return r
                .storage
                .read_at_zero_fill(buf, offset)
                .await
                .map_err(storage_errno);
        }
        self.image()
            .read(buf, offset)
            .await
            .map_err(|e| e.errno())?;
        self.copy_on_read(offset, buf.len() as u64).await
    }

    /// Prints what the qcow2 driver reported since the last call, on standard error, as
    /// QEMU's does while it works (the repair of a dirty image, the image marked corrupt).
    pub async fn print_messages(&self) {
        if let Some(img) = &self.img {
            for line in img.take_messages().await {
                complain!("{line}");
            }
        }
    }

    /// The image whose VM-state area `read -b`/`write -b` use: qcow2 only (a raw image has
    /// none, as QEMU's).
    fn vm_state_image(&self) -> Result<&Image<AnyStorage>, i32> {
        match self.raw {
            Some(_) => Err(nix::errno::Errno::EOPNOTSUPP as i32),
            None => Ok(self.image()),
        }
    }

    /// `read -b`: the VM-state area.
    pub async fn read_vmstate(&self, buf: &mut [u8], pos: u64) -> Result<(), i32> {
        let img = self.vm_state_image()?;
        img.read_vmstate(buf, pos).await.map_err(|e| e.errno())
    }

    /// `write -b`: the VM-state area.
    pub async fn write_vmstate(&self, buf: &[u8], pos: u64) -> Result<(), i32> {
        let img = self.vm_state_image()?;
        img.write_vmstate(buf, pos).await.map_err(|e| e.errno())
    }

    /// `-C`: what the image does not hold itself in the (sub)clusters a read touched is
    /// written into it, as QEMU's copy-on-read does (zeros as zero (sub)clusters). A raw
    /// image, or one opened without `-C`, is left alone.
    async fn copy_on_read(&self, offset: u64, len: u64) -> Result<(), i32> {
        let Some(img) = self.img.as_ref().filter(|_| self.copy_on_read) else {
            return Ok(());
        };
        let unit = img.subcluster_size();
        let lo = offset / unit * unit;
        let hi = (offset + len)
            .div_ceil(unit)
            .saturating_mul(unit)
            .min(img.size());
        let extents = img.map(lo, hi - lo).await.map_err(|e| e.errno())?;
        for e in extents {
            if !matches!(e.kind, ExtentKind::Unallocated { .. }) {
                continue;
            }
            let mut at = e.start;
            let end = e.start + e.length;
            while at < end {
                let n = (end - at).min(1 << 20);
                let mut buf = vec![0u8; n as usize];
                img.read(&mut buf, at).await.map_err(|e| e.errno())?;
                let done = if buf.iter().all(|&b| b == 0) {
                    img.write_zeroes(at, n).await
                } else {
                    img.write(&buf, at).await
                };
                done.map_err(|e| e.errno())?;
                at += n;
            }
        }
        Ok(())
    }

    /// Reads into several buffers from `offset`.
    pub async fn read_vectored(&self, bufs: &mut [Vec<u8>], offset: u64) -> Result<(), i32> {
        let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        self.check_request(offset, total)?;
        if total == 0 {
            return Ok(());
        }
        if let Some(r) = &self.raw {
            let mut at = offset;
            for b in bufs.iter_mut() {
                r.storage
                    .read_at_zero_fill(b, at)
                    .await
                    .map_err(storage_errno)?;
                at += b.len() as u64;
            }
            return Ok(());
        }
        let mut slices: Vec<std::io::IoSliceMut<'_>> = bufs
            .iter_mut()
            .map(|b| std::io::IoSliceMut::new(b))
            .collect();
        self.image()
            .read_vectored(&mut slices, offset)
            .await
            .map_err(|e| e.errno())?;
        self.copy_on_read(offset, total).await
    }

    /// Writes `buf` at `offset` (`fua`: flush afterwards).
    pub async fn write(&self, buf: &[u8], offset: u64, fua: bool) -> Result<(), i32> {
        self.check_request(offset, buf.len() as u64)?;
        if let Some(r) = &self.raw {
            r.storage
                .write_at(buf, offset)
                .await
                .map_err(storage_errno)?;
            r.grew_to(offset + buf.len() as u64);
        } else if !buf.is_empty() {
            self.image()
                .write(buf, offset)
                .await
                .map_err(|e| e.errno())?;
        }
        self.after_write(fua).await
    }

    /// Writes several buffers from `offset`.
    pub async fn write_vectored(
        &self,
        bufs: &[Vec<u8>],
        offset: u64,
        fua: bool,
    ) -> Result<(), i32> {
        let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        self.check_request(offset, total)?;
        if self.raw.is_some() {
            return self.write(&bufs.concat(), offset, fua).await;
        }
        if total > 0 {
            let slices: Vec<std::io::IoSlice<'_>> =
                bufs.iter().map(|b| std::io::IoSlice::new(b)).collect();
            self.image()
                .write_vectored(&slices, offset)
                .await
                .map_err(|e| e.errno())?;
        }
        self.after_write(fua).await
    }

    /// `write -z`: the range reads as zeros (see the module notes for `-u`).
    pub async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        unmap: bool,
        fua: bool,
    ) -> Result<(), i32> {
        self.check_request(offset, len)?;
        if let Some(r) = &self.raw {
            self.raw_zeroes(r, offset, len).await?;
        } else if len > 0 {
            self.zero_range(offset, len, unmap).await?;
        }
        self.after_write(fua).await
    }

    /// The pieces of a write-zeroes as QEMU issues them: whole subclusters (the end of the
    /// disk counts as a subcluster end) at once; a partial head or tail becomes its whole
    /// subcluster when that holds no data and the rest of it already reads as zeros, and is
    /// written with zeros otherwise.
    async fn zero_range(&self, offset: u64, len: u64, unmap: bool) -> Result<(), i32> {
        let img = self.image();
        let scs = img.subcluster_size();
        let size = img.size();
        let end = offset + len;
        let mut at = offset;
        while at < end {
            let sc_start = at - at % scs;
            let sc_end = (sc_start + scs).min(size);
            let piece_end = end.min(sc_end);
            let (from, to) = if at == sc_start && piece_end == sc_end {
                // Whole subclusters up to the last one the request covers.
                let body_end = if end == size { end } else { end - end % scs };
                (at, body_end.max(piece_end))
            } else if self.zero_expands(sc_start, sc_end, at, piece_end).await? {
                (sc_start, sc_end)
            } else {
                (at, piece_end)
            };
            let done = match unmap {
                true => img.write_zeroes_unmap(from, to - from).await,
                false => img.write_zeroes(from, to - from).await,
            };
            done.map_err(|e| e.errno())?;
            at = to.max(piece_end);
        }
        Ok(())
    }

    /// Whether QEMU zeroes the whole subcluster `[sc_start, sc_end)` for a write-zeroes of
    /// `[from, to)` inside it: no data in it, and the rest reads as zeros.
    async fn zero_expands(
        &self,
        sc_start: u64,
        sc_end: u64,
        from: u64,
        to: u64,
    ) -> Result<bool, i32> {
        let extents = self
            .image()
            .map(sc_start, sc_end - sc_start)
            .await
            .map_err(|e| e.errno())?;
        if !extents.iter().all(|e| {
            matches!(
                e.kind,
                ExtentKind::Zero { .. } | ExtentKind::Unallocated { .. }
            )
        }) {
            return Ok(false);
        }
        Ok(self.reads_zero(sc_start, from - sc_start).await?
            && self.reads_zero(to, sc_end - to).await?)
    }

    /// Whether `[offset, offset + len)` reads as zeros by the metadata of the chain (zero
    /// clusters, or unallocated down to the bottom or past a shorter backing file); data
    /// that happens to be zero does not count, as in QEMU's block status.
    async fn reads_zero(&self, offset: u64, len: u64) -> Result<bool, i32> {
        let mut layer = self.image();
        let mut ranges = vec![(offset, len)];
        loop {
            let mut below = Vec::new();
            for (o, l) in ranges.into_iter().filter(|&(_, l)| l > 0) {
                for e in layer.map(o, l).await.map_err(|e| e.errno())? {
                    match e.kind {
                        ExtentKind::Zero { .. } => {}
                        ExtentKind::Unallocated { .. } => below.push((e.start, e.length)),
                        _ => return Ok(false),
                    }
                }
            }
            if below.is_empty() {
                return Ok(true);
            }
            match layer.backing() {
                None => return Ok(true),
                Some(Backing::Qcow2(b)) => {
                    let bs = b.size();
                    ranges = below
                        .into_iter()
                        .filter(|&(o, _)| o < bs)
                        .map(|(o, l)| (o, l.min(bs - o)))
                        .collect();
                    layer = b;
                }
                // A raw backing file: its holes (and what lies past its end) read as zeros.
                Some(Backing::Raw { path, .. }) => {
                    for (o, l) in below {
                        if !raw_hole(path, o, l) {
                            return Ok(false);
                        }
                    }
                    return Ok(true);
                }
            }
        }
    }

    /// `write -c`: compressed clusters, with QEMU's rules (module notes).
    pub async fn write_compressed(&self, buf: &[u8], offset: u64, fua: bool) -> Result<(), i32> {
        self.check_request(offset, buf.len() as u64)?;
        if self.raw.is_some() {
            return Err(ENOTSUP);
        }
        let img = self.image();
        let cs = img.cluster_size();
        if img.data_path() != img.path() {
            return Err(ENOTSUP);
        }
        if offset % cs != 0 {
            return Err(EINVAL);
        }
        let mut first_error = None;
        for (i, chunk) in buf.chunks(cs as usize).enumerate() {
            let at = offset + i as u64 * cs;
            let r = self.compress_cluster(chunk, at).await;
            if let Err(e) = r {
                first_error.get_or_insert(e);
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        self.after_write(fua).await
    }

    /// One cluster of [`write_compressed`](Self::write_compressed).
    async fn compress_cluster(&self, chunk: &[u8], at: u64) -> Result<(), i32> {
        let img = self.image();
        let cs = img.cluster_size();
        if chunk.len() as u64 != cs && at + chunk.len() as u64 != img.size() {
            return Err(EINVAL);
        }
        if self.has_host_cluster(at, cs.min(img.size() - at)).await? {
            return Err(EIO);
        }
        img.write_compressed(at, chunk).await.map_err(|e| e.errno())
    }

    /// Whether the cluster at `at` (`len` bytes of it lie in the disk) has a host cluster.
    async fn has_host_cluster(&self, at: u64, len: u64) -> Result<bool, i32> {
        let extents = self.image().map(at, len).await.map_err(|e| e.errno())?;
        Ok(extents.iter().any(|e| {
            !matches!(
                e.kind,
                ExtentKind::Zero { host_offset: None }
                    | ExtentKind::Unallocated { host_offset: None }
            )
        }))
    }

    /// `discard`: QEMU's qcow2 discard (module notes).
    pub async fn discard(&self, offset: u64, len: u64) -> Result<(), i32> {
        self.check_request(offset, len)?;
        if self.discard_ignored {
            return Ok(());
        }
        if let Some(r) = &self.raw {
            // QEMU punches the range out of a raw file: it reads as zeros.
            self.raw_zeroes(r, offset, len).await?;
            return self.after_write(false).await;
        }
        let img = self.image();
        // QEMU's block layer marks the bitmaps for the whole request.
        img.mark_dirty(offset, len).map_err(|e| e.errno())?;
        let cs = img.cluster_size();
        let size = img.size();
        let end = offset + len;
        let first = offset.next_multiple_of(cs);
        let last = if end == size { end } else { end - end % cs };
        if self.version < 3 {
            // Version 2 cannot mark a cluster zero: QEMU unallocates it (the engine's
            // discard) when that reads zeros, and leaves it when a backing file would show.
            if first < last && img.backing().is_none() {
                img.discard(first, last - first)
                    .await
                    .map_err(|e| e.errno())?;
            }
            return self.after_write(false).await;
        }
        let backing = img.backing().is_some();
        let mut at = first;
        // Runs of clusters to zero, issued as one request each.
        let mut run: Option<(u64, u64)> = None;
        while at < last {
            let n = cs.min(last - at);
            let zero = backing || self.has_host_cluster(at, n).await?;
            if zero {
                run = match run {
                    Some((s, l)) if s + l == at => Some((s, l + n)),
                    Some((s, l)) => {
                        img.write_zeroes_unmap(s, l).await.map_err(|e| e.errno())?;
                        Some((at, n))
                    }
                    None => Some((at, n)),
                };
            }
            at += n;
        }
        if let Some((s, l)) = run {
            img.write_zeroes_unmap(s, l).await.map_err(|e| e.errno())?;
        }
        self.after_write(false).await
    }

    /// Bytes from `offset` (up to `len`) with the same allocation state in the image itself
    /// (data, zero or compressed clusters count as allocated; the backing file does not),
    /// and that state.
    pub async fn allocation(&self, offset: u64, len: u64) -> Result<(bool, u64), i32> {
        const STEP: u64 = 1 << 30;
        if self.raw.is_some() {
            // A raw file holds every byte (holes read as zeros): all allocated, as QEMU says.
            return Ok((true, len));
        }
        let img = self.image();
        let mut state = None;
        let mut n = 0;
        let mut at = offset;
        let end = offset + len;
        while at < end {
            let step = STEP.min(end - at);
            let extents = img.map(at, step).await.map_err(|e| e.errno())?;
            for e in extents {
                let allocated = !matches!(e.kind, ExtentKind::Unallocated { .. });
                match state {
                    None => state = Some(allocated),
                    Some(s) if s != allocated => return Ok((s, n)),
                    Some(_) => {}
                }
                n += e.length;
            }
            at += step;
        }
        Ok((state.unwrap_or(false), n))
    }

    /// `flush`.
    pub async fn flush(&self) -> Result<(), i32> {
        if self.cache.no_flush {
            return Ok(());
        }
        self.flush_now().await
    }

    /// Flushes the open image.
    async fn flush_now(&self) -> Result<(), i32> {
        match &self.raw {
            Some(r) => r.storage.flush().await.map_err(storage_errno),
            None => self.image().flush().await.map_err(|e| e.errno()),
        }
    }

    /// Zeroes of a raw file (growing it when they reach past its end).
    async fn raw_zeroes(&self, r: &RawFile, offset: u64, len: u64) -> Result<(), i32> {
        if len == 0 {
            return Ok(());
        }
        let file_len = r.len.get();
        // Past the end of the file only the part inside it needs zeroing; the rest is
        // written so that the file grows to the end of the request.
        let inside = len.min(file_len.saturating_sub(offset));
        if inside > 0 {
            r.storage
                .write_zeroes(offset, inside)
                .await
                .map_err(storage_errno)?;
        }
        if inside < len {
            let from = offset + inside;
            r.storage
                .write_at(&vec![0; (len - inside) as usize], from)
                .await
                .map_err(storage_errno)?;
            r.grew_to(offset + len);
        }
        Ok(())
    }

    /// `truncate` of a raw image: any size, as QEMU's file driver.
    pub async fn truncate_raw(&self, size: u64) -> Result<bool, i32> {
        let Some(r) = &self.raw else {
            return Ok(false);
        };
        r.storage.set_len(size).await.map_err(storage_errno)?;
        r.len.set(size);
        Ok(true)
    }
}

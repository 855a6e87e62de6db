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
//!   such a cluster can differ (tests/cli/io_interop.rs shows it).
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

use super::errors::*;

use std::path::Path;

use qimg::chain::{ImageFormat, read_cluster0};
use qimg::format::validate::OpenMode;
use qimg::io::{AnyStorage, Backend, Storage};
use qimg::{Image, OpenOptions};

use crate::cache_mode::CacheMode;
use crate::chain::{FormatError, raw_probe_warning};
use crate::status::{lib_msg, os_msg};

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
    /// The file name came from `open -o file.filename=...`, not an operand: qemu-io then
    /// names no device when the open fails.
    pub named_by_options: bool,
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

/// A raw image: the file itself, through the storage layer.
pub struct RawFile {
    /// The file.
    pub(super) storage: AnyStorage,
    /// Its length in bytes (the virtual size rounds it up to 512, as QEMU's).
    pub(super) len: std::cell::Cell<u64>,
}

impl RawFile {
    /// The virtual size.
    pub(super) fn size(&self) -> u64 {
        self.len.get().next_multiple_of(512)
    }

    /// Notes that the file now reaches at least `end`.
    pub(super) fn grew_to(&self, end: u64) {
        self.len.set(self.len.get().max(end));
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
                _ if spec.named_by_options => complain!("qemu-io: can't open: {msg}"),
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
        // qemu-io's words: the driver without the file's name.
        let fmt = match crate::chain::format_of(path, file, spec.fmt.as_deref(), true) {
            Ok(f) => f,
            Err(FormatError::UnknownDriver(name)) => {
                return fail(format!("Unknown driver '{name}'"));
            }
            Err(FormatError::Refused(why)) => return fail(why),
            Err(FormatError::Probe(e)) => {
                return fail(format!("Could not open '{file}': {}", lib_msg(&e, file)));
            }
        };
        if spec.snapshot {
            return match self.open_snapshot(path, fmt, spec).await {
                Ok(()) => Ok(()),
                Err(e) => fail(e),
            };
        }
        if fmt == ImageFormat::Raw {
            // QEMU warns only where a write could reach block 0: not on a read-only open.
            let warning = raw_probe_warning(file, spec.fmt.as_deref(), fmt);
            if let Some(warning) = warning.filter(|_| !spec.read_only) {
                complain!("{warning}");
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

    /// `Err(errno)` (`ENOMEDIUM`) once the open image was made unusable by corruption
    /// found while writing ([`qimg::Error::Unusable`]), as QEMU's node without a driver.
    pub fn usable(&self) -> Result<(), i32> {
        match (&self.raw, &self.img) {
            (None, Some(img)) => img.check_usable().map_err(|e| e.errno()),
            _ => Ok(()),
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
}

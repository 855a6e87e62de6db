//! [`OpenOptions`]: how to open an image (a builder) and the calls that open it; the
//! [`Trust`] policy for images from untrusted sources; how new clusters are reserved. The
//! calls that open an image with these options are in `open`.

use std::path::PathBuf;

use qimg_cache::CacheOptions;
use qimg_io::{Backend, ImageLock};

use crate::chain::MAX_CHAIN_DEPTH;

/// How a newly allocated host cluster is reserved in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Allocation {
    /// Reserve the whole cluster with `fallocate` so later subcluster writes land contiguously.
    /// Past the end of the file space is reserved 32 MiB (at least 64 clusters) at a time (one
    /// `fallocate` for many clusters, like QEMU's `preallocate` filter), so that allocating writes land in space
    /// the file system has already reserved instead of extending the file each time; close
    /// cuts off what was not used.
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

    pub(super) fn max_chain_depth(self) -> usize {
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
/// | [`open`](Self::open) | [`AnyStorage`](qimg_io::AnyStorage): the [`backend`](Self::backend), with or without [`direct`](Self::direct) | the same backend |
/// | [`open_with`](Self::open_with) | whatever the [`Opener`](super::Opener) returns | the opener |
/// | [`open_storage`](Self::open_storage) | a storage you opened | nothing: backing and data file are given |
/// | `open_blocking` (feature `blocking`) | a `BlockingImage` over [`AnyStorage`](qimg_io::AnyStorage) | the same backend |
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
    pub(super) follow_backing: bool,
    /// [`without_backing`](OpenOptions::without_backing): writable without the chain.
    pub(super) backing_null: bool,
    pub(super) data_file: Option<PathBuf>,
    pub(super) direct: bool,
    pub(super) backend: Backend,
    pub(super) clean_timer: bool,
    pub(super) trust: Trust,
    pub(super) force_share: bool,
    pub(super) locking: bool,
    pub(super) close_on_drop: bool,
    pub(super) crash_consistent_bitmaps: bool,
    /// Run the clean timer on a thread of its own even when a runtime is current (set by
    /// `open_blocking`, whose runtime runs only inside its calls).
    pub(super) timer_thread: bool,
    /// Where the driver's messages go as they happen ([`OpenOptions::on_message`]).
    pub(super) on_message: Option<MessageSink>,
    /// The passphrase of an encrypted image ([`OpenOptions::encryption_key`]).
    pub(super) key: Option<Passphrase>,
}

/// A LUKS passphrase; its `Debug` shows nothing of it.
#[derive(Clone)]
pub(crate) struct Passphrase(pub(crate) std::sync::Arc<Vec<u8>>);

impl std::fmt::Debug for Passphrase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Passphrase(..)")
    }
}

/// A callback taking the driver's messages (see [`OpenOptions::on_message`]).
#[derive(Clone)]
pub(crate) struct MessageSink(pub(crate) std::sync::Arc<dyn Fn(&str) + Send + Sync>);

impl std::fmt::Debug for MessageSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MessageSink")
    }
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
            backing_null: false,
            data_file: None,
            direct: false,
            backend: Backend::default(),
            clean_timer: true,
            trust: Trust::default(),
            force_share: false,
            locking: true,
            close_on_drop: false,
            crash_consistent_bitmaps: true,
            timer_thread: false,
            on_message: None,
            key: None,
        }
    }

    /// Flush and close the image when its last handle is dropped (default: off; then call
    /// [`Image::close`](super::Image::close), or at least flush, before dropping a writable
    /// image). The close runs synchronously in the dropping thread (on a short-lived thread
    /// of its own, so dropping inside an async task is fine); its errors cannot be reported,
    /// so an embedder that needs them still calls `close`.
    pub fn close_on_drop(mut self, close: bool) -> Self {
        self.close_on_drop = close;
        self
    }

    /// Open for writing (the backing chain is always opened read-only).
    pub fn writable(mut self, writable: bool) -> Self {
        self.writable = writable;
        self
    }

    /// The passphrase of a LUKS-encrypted image (QEMU's `encrypt.key-secret`): its key slots
    /// are tried with it at the open, which fails with QEMU's "Invalid password, cannot
    /// unlock any keyslot" when none opens; guest data is then decrypted as it is read and
    /// encrypted as it is written. An image that is not encrypted ignores it. Without it an
    /// encrypted image does not open ([`Error::Encrypted`](crate::Error::Encrypted)).
    pub fn encryption_key(mut self, passphrase: impl Into<Vec<u8>>) -> Self {
        self.key = Some(Passphrase(std::sync::Arc::new(passphrase.into())));
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

    /// QEMU's `"backing": null`: the image is opened without its backing chain, also for
    /// writing, as if it had none. Unallocated ranges read as zeros and a partial write into
    /// one copies zeros around it, so data the backing file holds there is not seen; the
    /// header still names the backing file.
    pub fn without_backing(mut self) -> Self {
        self.follow_backing = false;
        self.backing_null = true;
        self
    }

    /// Open the backing chain (the default). Without it unallocated clusters read as zeros,
    /// which is only good for inspection; an image with a backing file then cannot be opened
    /// for writing (see [`without_backing`](Self::without_backing)).
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
    /// `open_blocking`; requests of any alignment are accepted, a
    /// bounce buffer covers unaligned ones). With [`open_with`](Self::open_with) the opener
    /// decides.
    pub fn direct(mut self, direct: bool) -> Self {
        self.direct = direct;
        self
    }

    /// The I/O backend of [`open`](Self::open) and `open_blocking`
    /// for the image and every file it refers to.
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// Run the cache-clean timer (the default): cache entries idle for the clean interval are
    /// written back and dropped. When a tokio runtime is running at open, the timer is a task
    /// on it; without one (and for `open_blocking`) it is a thread of the image's own that
    /// ends with the image. Without the timer, call
    /// [`Image::clean_idle_caches`](super::Image::clean_idle_caches) yourself.
    pub fn clean_timer(mut self, run: bool) -> Self {
        self.clean_timer = run;
        self
    }

    /// Let other processes do anything with the files meanwhile, even write them (`qemu-img
    /// -U`, QEMU's `force-share=on`): for inspecting an image a VM is running on. Only for
    /// read-only opens; what is read may be changing underneath.
    pub fn force_share(mut self, share: bool) -> Self {
        self.force_share = share;
        self
    }

    /// Take the image locks QEMU honours (the default; QEMU's `file.locking=on`): a writable
    /// open refuses to proceed while another process (QEMU or qimg) has the image open, and
    /// keeps others from writing it; a read-only open refuses while a process writes it and
    /// keeps others from starting to. See [`ImageLock`](qimg_io::ImageLock). `false` takes
    /// no lock at all (QEMU's `file.locking=off`).
    ///
    /// With [`open_file`](Self::open_file) the locks go on the caller's open file description
    /// and compose with a whole-file write lock the caller already holds there (a VMM's):
    /// see [`HeldImageLock`](qimg_io::HeldImageLock); [`ImageLock::lock`](qimg_io::ImageLock::lock)
    /// takes them on any descriptor without opening an image.
    pub fn locking(mut self, lock: bool) -> Self {
        self.locking = lock;
        self
    }

    /// Keep the persistent dirty bitmaps consistent on disk while writing (the default): a
    /// crash or power cut at any point leaves each bitmap consistent, its set bits a superset
    /// of what changed (granules next to written ones may read as changed too, until a clean
    /// close stores the exact bits), so that the next incremental backup can still use it. A
    /// write that touches a granule whose bit is not on disk yet first waits for one durable
    /// write of the bitmap (shared by the requests waiting meanwhile, and marking the
    /// granules that follow ahead); see `docs/ARCHITECTURE.md`. `false` does what QEMU does:
    /// the bitmaps are marked in use at open and a crash leaves them inconsistent (unusable
    /// until removed). Bitmaps QEMU itself left in use stay inconsistent either way.
    pub fn crash_consistent_bitmaps(mut self, on: bool) -> Self {
        self.crash_consistent_bitmaps = on;
        self
    }

    /// Hands the messages QEMU's qcow2 driver would print on standard error (`qcow2: Marking
    /// image as corrupt: ...`) to `sink` as they happen, instead of keeping them for
    /// [`Image::take_messages`](super::Image::take_messages).
    pub fn on_message(mut self, sink: impl Fn(&str) + Send + Sync + 'static) -> Self {
        self.on_message = Some(MessageSink(std::sync::Arc::new(sink)));
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

    /// The lock a file opened with these options takes (`writable` for the file itself:
    /// backing files are always read), or `None` without locking.
    pub(super) fn image_lock(&self, writable: bool) -> Option<ImageLock> {
        if !self.locking {
            None
        } else if writable {
            Some(ImageLock::ReadWrite)
        } else if self.force_share {
            Some(ImageLock::SharedRead)
        } else {
            Some(ImageLock::Read)
        }
    }
}

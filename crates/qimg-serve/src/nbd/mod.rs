//! An NBD server for one [`Image`]: the fixed newstyle handshake ([`handshake`]) and the
//! transmission phase ([`transmission`]), over any tokio stream.
//!
//! One [`Export`] is shared by every connection (the image handle is cheap to clone and the
//! engine runs many requests at once); [`serve_connection`] runs one client to the end.
//! Requests of one connection run concurrently (through the connection's [`qimg::Queue`], or
//! as tasks on the image) and their replies go out as they complete, at most
//! [`MAX_IN_FLIGHT`] requests and [`IN_FLIGHT_BYTES`] of payload at a time: a client that
//! stops reading replies stops the server reading its requests, and nothing more is
//! buffered for it.
//!
//! Extended headers (`NBD_OPT_EXTENDED_HEADERS`) are offered: 32-byte requests and replies,
//! 64-bit effect lengths for trim, write-zeroes and block status (`BLOCK_STATUS_EXT`).
//!
//! Choices the specification leaves open:
//! - `NBD_CMD_WRITE_ZEROES` without `NO_HOLE` is [`Image::write_zeroes_unmap`] (whole subclusters
//!   change metadata only, partial ones are written: bounded work whatever the length), so
//!   `FAST_ZERO` succeeds; with `NO_HOLE` zeros are written as data, whose cost grows with
//!   the length, so `FAST_ZERO | NO_HOLE` fails at once with `ENOTSUP`.
//! - `NBD_CMD_CACHE` maps the range (loading its L2 slices into the cache) and reads nothing.
//! - `CAN_MULTI_CONN` is advertised when [`Export::multi_conn`] says several clients are
//!   served at once (qemu-nbd's `-e N`, N > 1, as qemu-nbd does): every connection works on
//!   the one shared image, so each sees every other's completed writes and a flush on any of
//!   them flushes everything any of them wrote. With one client at a time it is not: a client
//!   that opened a second connection would wait for the first to end.
//! - The minimum block size is 1: the engine takes requests of any alignment.
//! - With extended headers a `WRITE` without `NBD_CMD_FLAG_PAYLOAD_LEN` still carries its
//!   payload (QEMU's client sends it so, and qemu-nbd accepts it).
//! - Block status answers at most 1 GiB per request (the client asks again for the rest).

mod execute;
pub mod handshake;
pub mod proto;
#[cfg(target_os = "linux")]
mod queued;
mod reply;
mod request;
mod status;
pub mod tls;
pub mod transmission;

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;

use qimg::Image;
use qimg::io::{AnyStorage, Storage};
use tokio::io::{AsyncRead, AsyncWrite};

pub use handshake::Negotiated;

/// Requests of one connection running at once.
pub const MAX_IN_FLIGHT: usize = 64;
/// Payload bytes (write data received, read data to send) one connection may hold at once.
pub const IN_FLIGHT_BYTES: usize = 64 << 20;

/// How long a client may take from connecting to choosing an export (as qemu-nbd's
/// default handshake limit): a client that idles cannot hold a `--shared` slot forever.
pub const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A byte stream the server can run on (a socket, an in-memory pipe, a TLS session).
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Stream for T {}

/// A boxed [`Stream`], so that `NBD_OPT_STARTTLS` can replace the stream mid-handshake.
pub type BoxStream = Box<dyn Stream>;

/// What `NBD_OPT_STARTTLS` runs: the TLS handshake as a server on the client's stream.
pub trait StartTls: Send + Sync + std::fmt::Debug {
    /// Wraps `stream` in a TLS session once the handshake succeeded.
    fn accept(
        &self,
        stream: BoxStream,
    ) -> Pin<Box<dyn Future<Output = io::Result<BoxStream>> + Send>>;
}

/// Why a connection ended other than by the client's choice.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading from or writing to the client failed (including a message cut short).
    #[error("NBD connection: {0}")]
    Io(#[from] io::Error),
    /// A magic number is not what the protocol requires.
    #[error("the client sent magic {found:#x} where {expected:#x} was due")]
    BadMagic {
        /// What was received.
        found: u64,
        /// What the protocol requires.
        expected: u64,
    },
    /// The client flags have bits this server does not know.
    #[error("the client flags {0:#x} have unknown bits")]
    ClientFlags(u32),
    /// An option is longer than the server reads.
    #[error("option {option} carries {len} bytes, over the limit of {limit}")]
    OptionTooBig {
        /// The option number.
        option: u32,
        /// Its announced length.
        len: u32,
        /// [`proto::MAX_OPTION`].
        limit: u32,
    },
    /// The client sent more options than one handshake may have.
    #[error("the client sent over {0} options")]
    TooManyOptions(usize),
    /// `NBD_OPT_EXPORT_NAME` named an export that does not exist (the protocol closes).
    #[error("the client asked for export {0:?}, which does not exist")]
    UnknownExport(String),
    /// `NBD_OPT_EXPORT_NAME` before TLS on a server that requires it.
    #[error("the client asked for an export without TLS on a server that requires TLS")]
    TlsRequired,
    /// `NBD_OPT_EXPORT_NAME` after `NBD_OPT_EXTENDED_HEADERS`, which the protocol forbids.
    #[error("the client asked for an export by NBD_OPT_EXPORT_NAME after extended headers")]
    ExportNameWithExtendedHeaders,
    /// A write payload over the maximum cannot be skipped safely: the connection is closed.
    #[error("the client sent a write of {len} bytes, over the maximum of {max}")]
    PayloadTooBig {
        /// The request's length.
        len: u64,
        /// [`proto::MAX_PAYLOAD`].
        max: u32,
    },
    /// The client did not finish the handshake within [`HANDSHAKE_TIMEOUT`].
    #[error("the client did not finish the handshake within {0:?}")]
    HandshakeTimeout(std::time::Duration),
    /// The TLS handshake failed.
    #[error("TLS handshake: {0}")]
    Tls(io::Error),
}

/// One exported image and how it is offered.
#[derive(Debug)]
pub struct Export<S: Storage + 'static = AnyStorage> {
    /// The image (read-only exports may hold a writable handle; the server refuses writes).
    pub image: Image<S>,
    /// The export name clients ask for (`NBD_OPT_GO`, `NBD_OPT_EXPORT_NAME`).
    pub name: String,
    /// Text sent as `NBD_INFO_DESCRIPTION`.
    pub description: Option<String>,
    /// Refuse writes (`NBD_FLAG_READ_ONLY`; write commands get `EPERM`).
    pub read_only: bool,
    /// Offer the `qemu:allocation-depth` metadata context.
    pub allocation_depth: bool,
    /// Persistent dirty bitmaps offered as `qemu:dirty-bitmap:NAME` metadata contexts (block
    /// status flag 1: dirty), as qemu-nbd's `-B NAME` (at most 32).
    pub bitmaps: Vec<String>,
    /// The image whose bitmaps [`bitmaps`](Self::bitmaps) names: `image` when `None`. A
    /// checkpoint's frozen view (a read-only image showing a snapshot) offers the bitmaps
    /// of the live disk it was taken from, which are in that disk's memory.
    pub bitmap_source: Option<Image<S>>,
    /// Flush after every write (cache mode `writethrough`, `directsync`).
    pub writethrough: bool,
    /// Ignore flushes (cache mode `unsafe`).
    pub no_flush: bool,
    /// When set, the client must run `NBD_OPT_STARTTLS` before anything else (a server of
    /// several exports takes its TLS from [`Exports::new`] instead).
    pub tls: Option<Arc<dyn StartTls>>,
    /// Advertise `NBD_FLAG_CAN_MULTI_CONN`: set it only when the server takes several
    /// connections at once (a client that opens more waits otherwise).
    pub multi_conn: bool,
    /// Serve each connection's reads, writes, flushes, trims and write-zeroes through a
    /// [`qimg::Queue`] of its own (Linux): requests whose metadata is cached go to the
    /// queue's io_uring ring without the engine (when the image file has a descriptor the
    /// ring can use; otherwise the queue runs them on its engine thread). Needs a runtime with I/O enabled
    /// (`enable_io`, or `enable_all`); off by default.
    pub per_connection_queue: bool,
}

impl<S: Storage + 'static> Export<S> {
    /// A writable export named "" (read-only when the image is), without description,
    /// `qemu:allocation-depth` or TLS.
    pub fn new(image: Image<S>) -> Self {
        let read_only = !image.is_writable();
        Self {
            image,
            name: String::new(),
            description: None,
            read_only,
            allocation_depth: false,
            bitmaps: Vec::new(),
            bitmap_source: None,
            writethrough: false,
            no_flush: false,
            tls: None,
            multi_conn: false,
            per_connection_queue: false,
        }
    }

    /// The transmission flags of this export (`structured`: structured replies negotiated,
    /// which `NBD_FLAG_SEND_DF` needs).
    pub fn transmission_flags(&self, structured: bool) -> u16 {
        use proto::*;
        let mut f = TF_HAS_FLAGS | TF_SEND_FLUSH | TF_SEND_CACHE;
        if self.multi_conn {
            f |= TF_CAN_MULTI_CONN;
        }
        if structured {
            f |= TF_SEND_DF;
        }
        if self.read_only {
            f |= TF_READ_ONLY;
        } else {
            f |= TF_SEND_FUA | TF_SEND_TRIM | TF_SEND_WRITE_ZEROES | TF_SEND_FAST_ZERO;
        }
        f
    }
}

/// The exports of one server, by name; exports may come and go while it serves (the
/// control socket's `block-export-add` and `block-export-del`). A client picks one in the
/// handshake; `NBD_OPT_LIST` lists them all. Connections keep the export they chose even
/// after it is removed here.
#[derive(Debug)]
pub struct Exports<S: Storage + 'static = AnyStorage> {
    list: std::sync::RwLock<Vec<Arc<Export<S>>>>,
    tls: Option<Arc<dyn StartTls>>,
}

impl<S: Storage + 'static> Exports<S> {
    /// No exports yet; with `tls`, every client must run `NBD_OPT_STARTTLS` first.
    pub fn new(tls: Option<Arc<dyn StartTls>>) -> Self {
        Self {
            list: std::sync::RwLock::new(Vec::new()),
            tls,
        }
    }

    /// A server of one export, with that export's TLS.
    pub fn single(export: Arc<Export<S>>) -> Self {
        let me = Self::new(export.tls.clone());
        me.write().push(export);
        me
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<Arc<Export<S>>>> {
        self.list.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Vec<Arc<Export<S>>>> {
        self.list.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds `export`; refused (and handed back) when one of that name is there.
    pub fn add(&self, export: Arc<Export<S>>) -> Result<(), Arc<Export<S>>> {
        let mut list = self.write();
        if list.iter().any(|e| e.name == export.name) {
            return Err(export);
        }
        list.push(export);
        Ok(())
    }

    /// Removes the export named `name` (clients connected to it keep it until they leave).
    pub fn remove(&self, name: &str) -> Option<Arc<Export<S>>> {
        let mut list = self.write();
        let at = list.iter().position(|e| e.name == name)?;
        Some(list.remove(at))
    }

    /// The export named `name`.
    pub fn get(&self, name: &[u8]) -> Option<Arc<Export<S>>> {
        self.read()
            .iter()
            .find(|e| e.name.as_bytes() == name)
            .cloned()
    }

    /// Every export, in the order they were added.
    pub fn all(&self) -> Vec<Arc<Export<S>>> {
        self.read().clone()
    }

    /// The TLS every client must start, if any.
    pub fn tls(&self) -> Option<&Arc<dyn StartTls>> {
        self.tls.as_ref()
    }
}

/// Tells connections to stop: they finish the requests in flight and close.
#[derive(Debug, Clone)]
pub struct Shutdown(tokio::sync::watch::Receiver<bool>);

impl Shutdown {
    /// A shutdown signal and the sender that triggers it (`send(true)`).
    pub fn new() -> (tokio::sync::watch::Sender<bool>, Self) {
        let (tx, rx) = tokio::sync::watch::channel(false);
        (tx, Self(rx))
    }

    /// A signal that never fires.
    pub fn never() -> Self {
        let (tx, rx) = tokio::sync::watch::channel(false);
        // Dropping the sender makes `changed` fail, which `wait` reads as "never".
        drop(tx);
        Self(rx)
    }

    /// Resolves once shutdown was asked for.
    pub async fn wait(&mut self) {
        loop {
            if *self.0.borrow_and_update() {
                return;
            }
            if self.0.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }
}

/// Runs one client: the handshake, then requests until the client disconnects, `shutdown`
/// fires or the client breaks the protocol. Ends with `Ok` when the client ended the
/// connection (`NBD_OPT_ABORT`, `NBD_CMD_DISC`, or closing between messages).
pub async fn serve_connection<S: Storage + 'static>(
    stream: BoxStream,
    export: Arc<Export<S>>,
    shutdown: Shutdown,
) -> Result<(), Error> {
    serve_client(stream, &Exports::single(export), shutdown).await
}

/// [`serve_connection`] on a server of several exports: the client picks one of
/// `exports` in the handshake.
pub async fn serve_client<S: Storage + 'static>(
    stream: BoxStream,
    exports: &Exports<S>,
    shutdown: Shutdown,
) -> Result<(), Error> {
    let negotiated = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake::negotiate(stream, exports))
        .await
        .map_err(|_| Error::HandshakeTimeout(HANDSHAKE_TIMEOUT))??;
    match negotiated {
        None => Ok(()),
        Some((stream, negotiated, export)) => {
            transmission::run(stream, export, negotiated, shutdown).await
        }
    }
}

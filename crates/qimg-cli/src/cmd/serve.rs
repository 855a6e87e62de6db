//! `qimg serve --nbd ADDR IMAGE`: exports an image over NBD (the server is
//! [`qimg_serve::nbd`]), with qemu-nbd's options where they exist; `qimg serve
//! --vhost-user-blk SOCKET IMAGE` serves it to a VMM as a vhost-user-blk device
//! ([`qimg_serve::vhost_user_blk`]), as `qemu-storage-daemon --export type=vhost-user-blk`
//! does. Both may run in one process on the same open image.
//!
//! With `--tls-creds` every client must run `NBD_OPT_STARTTLS` first.
//!
//! `--monitor PATH` adds a control socket speaking QMP ([`qimg_serve::monitor`]): bitmaps,
//! snapshots, checkpoints and NBD exports of a checkpoint's frozen view, while the disk is
//! served. The server then keeps serving when clients leave (until `quit`, SIGINT or
//! SIGTERM) and, unless `--shared` says otherwise, serves up to 64 clients at once.
//!
//! The socket is bound to exactly the address given (`unix:PATH` or `HOST:PORT`); at most
//! `--shared` clients are served at once (more wait in the listen queue, as with qemu-nbd).
//! Without `--persistent` the server exits once its last client has left. SIGINT and SIGTERM
//! stop accepting, let the connections finish their requests in flight, then flush and close
//! the image so that it is left clean.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use qimg::io::Backend;
use qimg::{CacheOptions, OpenOptions};
use qimg_serve::monitor::{ExportDefaults, Monitor};
use qimg_serve::nbd::tls::TlsCreds;
use qimg_serve::nbd::{BoxStream, Export, Exports, Shutdown, StartTls, serve_client};
use qimg_serve::vhost_user_blk;
use tokio::net::{TcpListener, UnixListener};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::cache_mode::CacheMode;

/// `qimg serve` arguments.
#[derive(Args, Debug)]
#[command(group(
    clap::ArgGroup::new("export")
        .required(true)
        .multiple(true)
        .args(["nbd", "vhost_user_blk"])
))]
pub struct ServeArgs {
    /// Serve NBD on ADDR: `unix:PATH` or `HOST:PORT`.
    #[arg(
        long = "nbd",
        value_name = "ADDR",
        required_unless_present = "vhost_user_blk"
    )]
    pub nbd: Option<String>,
    /// Serve a vhost-user-blk device on the unix socket SOCKET (for cloud-hypervisor, QEMU,
    /// Firecracker).
    #[arg(long = "vhost-user-blk", value_name = "SOCKET")]
    pub vhost_user_blk: Option<PathBuf>,
    /// vhost-user-blk: virtqueues offered to the guest (1 to 64).
    #[arg(long = "num-queues", default_value_t = 1)]
    pub num_queues: u16,
    /// vhost-user-blk: the serial number the guest reads (at most 20 bytes).
    #[arg(long = "serial", value_name = "ID", default_value = "")]
    pub serial: String,
    /// vhost-user-blk: logical block size, 512 or 4096.
    #[arg(long = "logical-block-size", default_value_t = 512)]
    pub logical_block_size: u32,
    /// The qcow2 image to export.
    pub image: PathBuf,
    /// The export name clients ask for.
    #[arg(short = 'x', long = "export-name", default_value = "")]
    pub export_name: String,
    /// A description sent to clients that ask for it.
    #[arg(short = 'D', long = "description")]
    pub description: Option<String>,
    /// Export read-only (writes fail with EPERM).
    #[arg(short = 'r', long = "readonly", visible_alias = "read-only")]
    pub readonly: bool,
    /// Clients served at once (1 by default; 64 with --monitor).
    #[arg(short = 'e', long = "shared")]
    pub shared: Option<usize>,
    /// A control socket speaking QMP on the unix socket PATH (see `qimg_serve::monitor`).
    #[arg(long = "monitor", value_name = "PATH")]
    pub monitor: Option<PathBuf>,
    /// The disk's name in control-socket commands (QMP's device, node, node-name).
    #[arg(long = "node-name", value_name = "NAME", default_value = "disk")]
    pub node_name: String,
    /// Keep serving after the last client left.
    #[arg(long = "persistent")]
    pub persistent: bool,
    /// Cache mode (none, writeback, writethrough, directsync, unsafe).
    #[arg(short = 't', long = "cache")]
    pub cache: Option<String>,
    /// I/O backend (threads, io_uring; native means io_uring and needs O_DIRECT).
    #[arg(short = 'i', long = "aio")]
    pub aio: Option<String>,
    /// Offer the qemu:allocation-depth metadata context.
    #[arg(short = 'A', long = "allocation-depth")]
    pub allocation_depth: bool,
    /// Offer the persistent dirty bitmap NAME as the qemu:dirty-bitmap:NAME metadata context
    /// (repeatable, as qemu-nbd's -B).
    #[arg(short = 'B', long = "bitmap", value_name = "NAME", action = clap::ArgAction::Append)]
    pub bitmaps: Vec<String>,
    /// Write the process id to FILE once the socket accepts connections.
    #[arg(long = "pidfile", visible_alias = "pid-file", value_name = "FILE")]
    pub pidfile: Option<PathBuf>,
    /// qcow2 l2-cache-size (as qemu's option: bytes, with suffixes).
    #[arg(long = "l2-cache-size")]
    pub l2_cache_size: Option<String>,
    /// qcow2 l2-cache-entry-size (the slice size).
    #[arg(long = "l2-cache-entry-size")]
    pub l2_cache_entry_size: Option<String>,
    /// qcow2 refcount-cache-size.
    #[arg(long = "refcount-cache-size")]
    pub refcount_cache_size: Option<String>,
    /// Bytes per refcount cache slice (qimg's own option; 4 KiB by default).
    #[arg(long = "refcount-cache-entry-size")]
    pub refcount_cache_entry_size: Option<String>,
    /// qcow2 cache-size (L2 and refcount caches together).
    #[arg(long = "cache-size")]
    pub cache_size: Option<String>,
    /// qcow2 cache-clean-interval in seconds (0 disables).
    #[arg(long = "cache-clean-interval")]
    pub cache_clean_interval: Option<String>,
    /// Require TLS, with the credentials in DIR (ca-cert.pem, server-cert.pem,
    /// server-key.pem, as QEMU's tls-creds-x509); clients need a certificate of that CA.
    #[arg(long = "tls-creds", value_name = "DIR")]
    pub tls_creds: Option<PathBuf>,
}

/// Where to listen.
enum Listener {
    Unix(UnixListener, PathBuf),
    Tcp(TcpListener),
}

impl Listener {
    fn bind(addr: &str) -> Result<Self> {
        if let Some(path) = addr.strip_prefix("unix:") {
            if path.is_empty() {
                bail!("--nbd unix: needs a socket path");
            }
            let l = UnixListener::bind(path)
                .with_context(|| format!("cannot listen on unix socket '{path}'"))?;
            return Ok(Listener::Unix(l, PathBuf::from(path)));
        }
        let std = std::net::TcpListener::bind(addr).with_context(|| {
            format!("cannot listen on '{addr}' (expected unix:PATH or HOST:PORT)")
        })?;
        std.set_nonblocking(true)?;
        Ok(Listener::Tcp(TcpListener::from_std(std)?))
    }

    async fn accept(&self) -> std::io::Result<BoxStream> {
        Ok(match self {
            Listener::Unix(l, _) => Box::new(l.accept().await?.0),
            Listener::Tcp(l) => {
                let (s, _) = l.accept().await?;
                s.set_nodelay(true)?;
                Box::new(s)
            }
        })
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, path) = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The storage backend of `-i`, checked against the cache mode as qemu does.
fn backend(aio: Option<&str>, mode: &CacheMode) -> Result<Backend> {
    match aio {
        None | Some("threads") => Ok(Backend::Threads),
        Some("io_uring") => Ok(Backend::IoUring),
        Some("native") if mode.direct => Ok(Backend::IoUring),
        Some("native") => bail!("aio=native was specified, but it requires cache.direct=on"),
        Some(other) => bail!("Invalid aio option: {other}"),
    }
}

/// Writes the pid file whole (through a rename, so a reader never sees it half written).
fn write_pidfile(path: &Path) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, format!("{}\n", std::process::id()))
        .and_then(|()| std::fs::rename(&tmp, path))
        .with_context(|| format!("cannot write the pid file '{}'", path.display()))
}

/// Runs `qimg serve`.
pub fn run(a: ServeArgs) -> Result<()> {
    if a.shared == Some(0) {
        bail!("--shared 0: at least one client must be allowed");
    }
    let mode = CacheMode::parse_option(a.cache.as_deref(), "cache")?;
    let backend = backend(a.aio.as_deref(), &mode)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    rt.block_on(serve(a, mode, backend))
}

async fn serve(a: ServeArgs, mode: CacheMode, backend: Backend) -> Result<()> {
    // Credentials first: a mistake there must not leave an image opened for nothing.
    let tls = match &a.tls_creds {
        Some(dir) => Some(Arc::new(TlsCreds::from_dir(dir)?) as Arc<dyn StartTls>),
        None => None,
    };
    let mut cache = CacheOptions::default();
    for (key, v) in [
        ("l2-cache-size", &a.l2_cache_size),
        ("l2-cache-entry-size", &a.l2_cache_entry_size),
        ("refcount-cache-size", &a.refcount_cache_size),
        ("refcount-cache-entry-size", &a.refcount_cache_entry_size),
        ("cache-size", &a.cache_size),
        ("cache-clean-interval", &a.cache_clean_interval),
    ] {
        if let Some(v) = v {
            crate::cmd::bench::parse::cache_option(&mut cache, key, v).map_err(|e| anyhow!(e))?;
        }
    }
    let image = OpenOptions::new()
        .writable(!a.readonly)
        .cache(cache)
        .direct(mode.direct)
        .backend(backend)
        .open(&a.image)
        .await
        .map_err(|e| {
            // The library's error starts with the file name, which qemu's wording already has.
            let e = e.to_string();
            let prefix = format!("{}: ", a.image.display());
            let e = e.strip_prefix(&prefix).unwrap_or(&e);
            anyhow!("Could not open '{}': {e}", a.image.display())
        })?;
    let mut export = Export::new(image.clone());
    export.name = a.export_name.clone();
    export.description = a.description.clone();
    export.read_only = a.readonly;
    export.allocation_depth = a.allocation_depth;
    for name in &a.bitmaps {
        // As qemu-nbd: a bitmap that is not there (or cannot be used) ends the server.
        if !image.bitmaps().iter().any(|b| &b.name == name) {
            bail!("Bitmap '{name}' is not found");
        }
    }
    export.bitmaps = a.bitmaps.clone();
    export.writethrough = mode.writethrough;
    export.no_flush = mode.no_flush;
    export.per_connection_queue = true;
    let shared = a.shared.unwrap_or(if a.monitor.is_some() { 64 } else { 1 });
    let persistent = a.persistent || a.monitor.is_some();
    export.tls = tls.clone();
    export.multi_conn = shared > 1;
    let defaults = ExportDefaults {
        writethrough: export.writethrough,
        no_flush: export.no_flush,
        multi_conn: export.multi_conn,
        per_connection_queue: export.per_connection_queue,
    };
    let exports = Arc::new(Exports::new(tls));
    if exports.add(Arc::new(export)).is_err() {
        unreachable!("the first export's name is free");
    }
    let monitor = match &a.monitor {
        Some(path) => {
            let l = UnixListener::bind(path)
                .with_context(|| format!("cannot listen on '{}'", path.display()))?;
            let nbd = a.nbd.is_some().then(|| exports.clone());
            let m = Arc::new(Monitor::new(image.clone(), &a.node_name, nbd, defaults));
            Some((Listener::Unix(l, path.clone()), m))
        }
        None => None,
    };

    let listener = match &a.nbd {
        Some(addr) => Some(Listener::bind(addr)?),
        None => None,
    };
    let vhost = match &a.vhost_user_blk {
        Some(path) => Some(start_vhost(&a, &mode, path, &image)?),
        None => None,
    };
    if let Some(p) = &a.pidfile {
        write_pidfile(p)?;
    }
    let mut term = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    let (stop, shutdown) = Shutdown::new();
    let slots = Arc::new(Semaphore::new(shared));
    let mut monitor_clients = JoinSet::new();
    let mut conns = JoinSet::new();
    let (vhost_stop, mut vhost_done) = match vhost {
        Some((stop, done)) => (Some(stop), Some(done)),
        None => (None, None),
    };
    let mut vhost_failed = None;
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = async { monitor.as_ref().expect("guarded").1.quit_requested().await },
                if monitor.is_some() => break,
            client = async { monitor.as_ref().expect("guarded").0.accept().await },
                if monitor.is_some() => {
                match client {
                    Ok(stream) => {
                        let m = monitor.as_ref().expect("guarded").1.clone();
                        monitor_clients.spawn(async move { m.serve(stream).await });
                    }
                    Err(e) => eprintln!("qimg: monitor accept: {e}"),
                }
            }
            Some(_) = monitor_clients.join_next(), if !monitor_clients.is_empty() => {}
            r = async { vhost_done.as_mut().expect("guarded").await }, if vhost_done.is_some() => {
                vhost_done = None;
                if let Ok(Err(e)) = r {
                    vhost_failed = Some(e);
                }
                break;
            }
            Some(done) = conns.join_next(), if !conns.is_empty() => {
                match done {
                    Ok(Err(e)) => eprintln!("qimg: client: {e}"),
                    Err(e) => eprintln!("qimg: client task: {e}"),
                    Ok(Ok(())) => {}
                }
                if conns.is_empty() && !persistent && vhost_stop.is_none() {
                    break;
                }
            }
            accepted = async {
                let slot = slots.clone().acquire_owned().await;
                (slot, listener.as_ref().expect("guarded").accept().await)
            }, if listener.is_some() => {
                let (Ok(slot), stream) = accepted else { break };
                match stream {
                    Ok(stream) => {
                        let (exports, shutdown) = (exports.clone(), shutdown.clone());
                        conns.spawn(async move {
                            let r = serve_client(stream, &exports, shutdown).await;
                            drop(slot);
                            r
                        });
                    }
                    Err(e) => eprintln!("qimg: accept: {e}"),
                }
            }
        }
    }
    // The vhost-user frontend is disconnected; its requests in flight finish.
    if let Some(stop) = vhost_stop {
        stop.stop();
        if let Some(done) = vhost_done {
            if let Ok(Err(e)) = done.await {
                vhost_failed = Some(e);
            }
        }
    }
    drop(listener);
    // Connections finish their requests in flight, then close.
    let _ = stop.send(true);
    while let Some(done) = conns.join_next().await {
        if let Ok(Err(e)) = done {
            eprintln!("qimg: client: {e}");
        }
    }
    monitor_clients.abort_all();
    if let Some((l, m)) = monitor {
        drop(l);
        m.close().await;
    }
    drop(exports);
    image
        .close()
        .await
        .with_context(|| format!("closing '{}'", a.image.display()))?;
    if let Some(p) = &a.pidfile {
        let _ = std::fs::remove_file(p);
    }
    match vhost_failed {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

/// Binds the vhost-user socket and serves it on a thread of its own (the backend's queue
/// threads are its own too); the receiver says how it ended.
fn start_vhost(
    a: &ServeArgs,
    mode: &CacheMode,
    path: &Path,
    image: &qimg::Image<qimg::io::AnyStorage>,
) -> Result<(
    vhost_user_blk::Stop,
    tokio::sync::oneshot::Receiver<Result<(), vhost_user_blk::VhostError>>,
)> {
    let options = vhost_user_blk::BlkOptions {
        num_queues: a.num_queues,
        read_only: a.readonly,
        serial: a.serial.clone(),
        logical_block_size: a.logical_block_size,
        writethrough: mode.writethrough,
        no_flush: mode.no_flush,
        ..Default::default()
    };
    options.check()?;
    let bound = vhost_user_blk::bind(path)?;
    let stop = bound.stopper();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let (image, thread_stop) = (image.clone(), stop.clone());
    std::thread::Builder::new()
        .name("qimg-vhost-user".into())
        .spawn(move || {
            let _ = tx.send(vhost_user_blk::serve(&image, bound, options, thread_stop));
        })
        .context("cannot start the vhost-user thread")?;
    Ok((stop, rx))
}

//! [`NbdStorage`]: an export of an NBD server (qemu-nbd, qemu-storage-daemon, nbdkit,
//! `qimg serve --nbd`) as storage, so that an image name such as `nbd://host/export` or
//! `nbd+unix:///export?socket=/run/disk.sock` works wherever a file name does.
//!
//! The client speaks the fixed newstyle handshake (`NBD_OPT_GO`, falling back to
//! `NBD_OPT_EXPORT_NAME` for servers without it) and structured replies, one request at a
//! time on each connection, each request at most 32 MiB (the protocol's default maximum).
//! When the server offers multi-conn (`NBD_FLAG_CAN_MULTI_CONN`: qemu-nbd `-e 2` or more,
//! `qimg serve --nbd --shared N`, nbdkit), a request that finds every connection busy opens
//! another, up to [`MAX_CONNECTIONS`] (nbdcopy's default), so that callers on several threads
//! (convert's parallel chunks, a VMM's queues) have requests in flight together; the server's
//! promise makes a flush on one connection cover the writes completed on all of them. A server
//! without multi-conn gets one connection, whatever the callers. Names
//! are parsed as QEMU parses them: the URI forms `nbd://HOST[:PORT]/EXPORT` (also
//! `nbd+tcp://`), `nbd+unix:///EXPORT?socket=PATH`, and the legacy forms
//! `nbd:HOST:PORT[:exportname=NAME]` and `nbd:unix:PATH[:exportname=NAME]`. With the
//! `nbd-tls` feature, TLS (`NBD_OPT_STARTTLS`, rustls) is spoken for libnbd's URIs
//! `nbds://...?tls-certificates=DIR[&tls-hostname=NAME]` and `nbds+unix://...`, which the
//! CLI also makes of QEMU's `tls-creds=` option ([`NbdTls`]). Requests run inline on the
//! calling thread, as the file backend's default strategy does.

use std::io::{self, IoSlice};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, TryLockError, Weak};

use crate::error::{Op, Result, StorageError};
use crate::storage::{AllocateOutcome, DiscardOutcome, Storage, ZeroOutcome};

/// Block status: the range is a hole (not allocated).
pub const STATE_HOLE: u32 = 1;

/// Block status: the range reads as zeros.
pub const STATE_ZERO: u32 = 2;

/// Connections this process holds, by name: every open of one export shares its
/// connection (qemu-nbd serves one client at a time unless told otherwise).
static SHARED: Mutex<Vec<(String, bool, Weak<NbdStorage>)>> = Mutex::new(Vec::new());

/// The largest request sent (the protocol's default maximum payload).
const MAX_REQUEST: u64 = 32 << 20;

/// The most connections one [`NbdStorage`] opens to a server that offers multi-conn
/// (nbdcopy's default; [`NbdStorage::with_max_connections`] sets another); one to a server
/// that does not.
pub const MAX_CONNECTIONS: usize = 4;

mod address;
mod conn;
mod handshake;

mod stream;

#[cfg(feature = "nbd-tls")]
mod tls;
mod wire;

use conn::*;
use handshake::*;
use wire::*;

pub use address::{NbdAddress, NbdServer, NbdTls, is_nbd_name};
use stream::Stream;

/// What opening another connection needs, kept when the server offers multi-conn.
struct Growth {
    addr: NbdAddress,
    /// The extra metadata contexts the first connection asked for.
    contexts: Vec<String>,
    /// Opening one failed (or it disagreed with the first): no more are tried.
    failed: bool,
}

/// An NBD export as [`Storage`]; see the [module docs](self).
pub struct NbdStorage {
    /// The open connections: one, or up to [`MAX_CONNECTIONS`] with multi-conn.
    conns: RwLock<Vec<Arc<Mutex<Conn>>>>,
    /// `Some` when the server offers multi-conn: how to open another connection.
    growth: Option<Mutex<Growth>>,
    /// Where a request waits when every connection is busy and no more may be opened.
    next: AtomicUsize,
    /// The most connections opened ([`MAX_CONNECTIONS`] unless
    /// [`with_max_connections`](Self::with_max_connections) says otherwise).
    limit: usize,
    /// The metadata contexts the server agreed to, by name, sorted.
    contexts: Vec<String>,
    size: u64,
    flags: u16,
    writable: bool,
    name: String,
}

impl std::fmt::Debug for NbdStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdStorage")
            .field("name", &self.name)
            .field("size", &self.size)
            .field("flags", &self.flags)
            .finish()
    }
}

impl NbdStorage {
    /// Connects to the export `name` names (see [`NbdAddress::parse`]); read-only unless
    /// `writable` (a read-only export refuses a writable open).
    pub fn connect(name: &str, writable: bool) -> Result<Self> {
        Self::connect_with(name, writable, &[])
    }

    /// [`connect`](Self::connect), asking also for the metadata `contexts` (such as
    /// `qemu:dirty-bitmap:NAME`) beside `base:allocation`; one the server does not offer is
    /// refused when asked for ([`context_status`](Self::context_status)).
    pub fn connect_with(name: &str, writable: bool, contexts: &[&str]) -> Result<Self> {
        let addr = NbdAddress::parse(name)
            .map_err(|e| open_error(name, io::Error::new(io::ErrorKind::InvalidInput, e)))?
            .ok_or_else(|| {
                open_error(
                    name,
                    io::Error::new(io::ErrorKind::InvalidInput, "not an NBD name"),
                )
            })?;
        let first = open_conn(&addr, contexts).map_err(|e| open_error(name, e))?;
        if writable && first.flags & TFLAG_READ_ONLY != 0 {
            return Err(open_error(
                name,
                io::Error::new(io::ErrorKind::PermissionDenied, "the export is read-only"),
            ));
        }
        let growth = (first.flags & TFLAG_CAN_MULTI_CONN != 0).then(|| {
            Mutex::new(Growth {
                addr,
                contexts: contexts.iter().map(|c| c.to_string()).collect(),
                failed: false,
            })
        });
        Ok(NbdStorage {
            contexts: context_names(&first.conn),
            conns: RwLock::new(vec![Arc::new(Mutex::new(first.conn))]),
            growth,
            next: AtomicUsize::new(0),
            limit: MAX_CONNECTIONS,
            size: first.size,
            flags: first.flags,
            writable,
            name: name.to_string(),
        })
    }

    /// The client this process holds for export `name`, or a new one: one client (one
    /// connection, or a few with multi-conn) per export and process, as QEMU keeps one (a
    /// writable open upgrades nothing: it needs a writable client, and a read-only one is not
    /// reused for it).
    pub fn shared(name: &str, writable: bool) -> Result<Arc<Self>> {
        let mut all = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|(_, _, w)| w.strong_count() > 0);
        let found = all
            .iter()
            .filter(|(n, w, _)| n == name && (*w || !writable))
            .find_map(|(_, _, s)| s.upgrade());
        if let Some(s) = found {
            return Ok(s);
        }
        let s = Arc::new(Self::connect(name, writable)?);
        all.push((name.to_string(), writable, Arc::downgrade(&s)));
        Ok(s)
    }

    /// The export's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The allocation of `[offset, offset + len)` as `(length, flags)` runs from `offset`
    /// ([`STATE_HOLE`], [`STATE_ZERO`]), from the server's `base:allocation` context; `None`
    /// when the server offers none (then everything is data, as QEMU assumes).
    pub fn block_status(&self, offset: u64, len: u64) -> Result<Option<Vec<(u64, u32)>>> {
        if !self.has_context(BASE_ALLOCATION) {
            return Ok(None);
        }
        self.status_runs(BASE_ALLOCATION, offset, len).map(Some)
    }

    /// The runs `(length, flags)` from `offset` that metadata context `context` (asked for
    /// at [`connect_with`](Self::connect_with)) gives `[offset, offset + len)`: for
    /// `qemu:dirty-bitmap:NAME`, flag 1 is "dirty". Refused when the server did not agree to
    /// the context.
    pub fn context_status(&self, context: &str, offset: u64, len: u64) -> Result<Vec<(u64, u32)>> {
        if !self.has_context(context) {
            return Err(StorageError::Io {
                op: Op::Probe,
                offset,
                len,
                source: io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("the server offers no metadata context '{context}' for this export"),
                ),
            });
        }
        self.status_runs(context, offset, len)
    }

    /// Whether the server says several connections may serve this export at once
    /// (`NBD_FLAG_CAN_MULTI_CONN`): then a client may open more to have requests in flight
    /// together.
    pub fn can_multi_conn(&self) -> bool {
        self.flags & TFLAG_CAN_MULTI_CONN != 0
    }

    /// At most `n` connections (at least one) when the server offers multi-conn, instead of
    /// [`MAX_CONNECTIONS`] (`qimg backup --connections N`).
    pub fn with_max_connections(mut self, n: usize) -> Self {
        self.limit = n.max(1);
        self
    }

    /// How many connections are open to the server now: one, or more (up to
    /// [`MAX_CONNECTIONS`]) when it offers multi-conn and requests were in flight together.
    pub fn connections(&self) -> usize {
        self.conns.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether the server agreed to metadata context `name` (every connection agrees alike).
    fn has_context(&self, name: &str) -> bool {
        self.contexts.iter().any(|c| c == name)
    }

    /// Runs `f` on a connection: a free one, else a new one (multi-conn, below the limit),
    /// else the next in turn once it is free.
    fn with_conn<R>(&self, f: impl FnOnce(&mut Conn) -> R) -> R {
        let conns: Vec<Arc<Mutex<Conn>>> =
            self.conns.read().unwrap_or_else(|e| e.into_inner()).clone();
        for c in &conns {
            match c.try_lock() {
                Ok(mut g) => return f(&mut g),
                Err(TryLockError::Poisoned(e)) => return f(&mut e.into_inner()),
                Err(TryLockError::WouldBlock) => {}
            }
        }
        let c = match self.grow(conns.len()) {
            Some(c) => c,
            None => {
                let i = self.next.fetch_add(1, Ordering::Relaxed) % conns.len();
                conns[i].clone()
            }
        };
        let mut g = c.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut g)
    }

    /// Opens one more connection when the server offers multi-conn, fewer than the limit
    /// ([`MAX_CONNECTIONS`]) are open (`seen` were when the caller found them all busy) and no
    /// other caller is opening one; `None` otherwise. A connection that fails to open, or
    /// whose export differs from the first's (size, flags, contexts), ends the growing: the
    /// open ones carry on.
    fn grow(&self, seen: usize) -> Option<Arc<Mutex<Conn>>> {
        let mut g = match self.growth.as_ref()?.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        let open = self.connections();
        if g.failed || open >= self.limit || open > seen {
            // Another caller opened one meanwhile: take it if it is free.
            return (open > seen && !g.failed)
                .then(|| self.conns.read().unwrap_or_else(|e| e.into_inner())[open - 1].clone());
        }
        let contexts: Vec<&str> = g.contexts.iter().map(String::as_str).collect();
        match open_conn(&g.addr, &contexts) {
            Ok(o)
                if o.size == self.size
                    && o.flags == self.flags
                    && context_names(&o.conn) == self.contexts =>
            {
                let c = Arc::new(Mutex::new(o.conn));
                self.conns
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(c.clone());
                Some(c)
            }
            Ok(o) => {
                g.failed = true;
                // The odd connection is closed in order, and never used.
                let mut conn = o.conn;
                let _ = exchange_on(&mut conn, DISCONNECT, &[], None, &mut |_, _, _| {});
                None
            }
            Err(_) => {
                g.failed = true;
                None
            }
        }
    }

    /// The runs of context `context` over `[offset, offset + len)`, asked for in pieces the
    /// protocol can carry (each on whichever connection is free, under that connection's id
    /// for the context).
    fn status_runs(&self, context: &str, offset: u64, len: u64) -> Result<Vec<(u64, u32)>> {
        let end = offset.saturating_add(len).min(self.size);
        let mut runs: Vec<(u64, u32)> = Vec::new();
        let mut at = offset;
        while at < end {
            let n = (end - at).min(u64::from(u32::MAX) / 2 + 1);
            let mut got = 0u64;
            let req = Req {
                op: Op::Probe,
                cmd: CMD_BLOCK_STATUS,
                flags: 0,
                offset: at,
                len: n,
            };
            self.with_conn(|c| {
                let id = c.context_id(context);
                exchange_on(c, req, &[], None, &mut |ctx, l, f| {
                    let l = u64::from(l).min(n - got);
                    if Some(ctx) == id && l > 0 {
                        runs.push((l, f));
                        got += l;
                    }
                })
            })?;
            if got == 0 {
                return Err(StorageError::Io {
                    op: Op::Probe,
                    offset: at,
                    len: n,
                    source: proto("the server described no part of the range"),
                });
            }
            at += got;
        }
        Ok(runs)
    }

    /// Reads up to `buf.len()` bytes at `offset` on the calling thread (no runtime needed):
    /// fewer at the end of the export.
    pub fn read_blocking(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let end = offset.saturating_add(buf.len() as u64).min(self.size);
        let mut at = offset;
        let mut done = 0usize;
        while at < end {
            let n = (end - at).min(MAX_REQUEST) as usize;
            let out = &mut buf[done..done + n];
            self.request(
                Req {
                    op: Op::Read,
                    cmd: CMD_READ,
                    flags: 0,
                    offset: at,
                    len: n as u64,
                },
                &[],
                Some(out),
            )?;
            at += n as u64;
            done += n;
        }
        Ok(done)
    }

    /// Sends one request (with `data` for a write) on a connection and reads its reply
    /// (into `out` for a read).
    fn request(&self, req: Req, data: &[IoSlice<'_>], out: Option<&mut [u8]>) -> Result<()> {
        self.with_conn(|c| exchange_on(c, req, data, out, &mut |_, _, _| {}))
    }

    fn check_writable(&self, op: Op, offset: u64, len: u64) -> Result<()> {
        if self.writable {
            Ok(())
        } else {
            Err(StorageError::ReadOnly { op, offset, len })
        }
    }

    /// `cmd` over `[offset, offset + len)` in requests of at most [`MAX_REQUEST`] bytes.
    /// Refuses `op` on bytes past the end of the export (which cannot grow): writes and
    /// write-zeroes, whose bytes must be there to read back.
    fn check_inside(&self, op: Op, offset: u64, len: u64) -> Result<()> {
        if offset.saturating_add(len) <= self.size {
            return Ok(());
        }
        Err(StorageError::Io {
            op,
            offset,
            len,
            source: io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("an NBD export cannot grow past its {} bytes", self.size),
            ),
        })
    }

    /// Sends `cmd` over `[offset, offset + len)` in pieces of at most `MAX_REQUEST` bytes;
    /// bytes past the end of the export are left out (callers that need them refuse first,
    /// [`check_inside`](Self::check_inside)).
    fn each_piece(&self, op: Op, cmd: u16, flags: u16, offset: u64, len: u64) -> Result<()> {
        let mut at = offset;
        let end = offset.saturating_add(len).min(self.size);
        while at < end {
            let n = (end - at).min(MAX_REQUEST);
            self.request(
                Req {
                    op,
                    cmd,
                    flags,
                    offset: at,
                    len: n,
                },
                &[],
                None,
            )?;
            at += n;
        }
        Ok(())
    }
}

impl Drop for NbdStorage {
    fn drop(&mut self) {
        // NBD_CMD_DISC on each connection: the server closes them in order.
        let conns = std::mem::take(self.conns.get_mut().unwrap_or_else(|e| e.into_inner()));
        for c in conns {
            let mut c = c.lock().unwrap_or_else(|e| e.into_inner());
            let _ = exchange_on(&mut c, DISCONNECT, &[], None, &mut |_, _, _| {});
        }
    }
}

impl Storage for NbdStorage {
    async fn read_at_most(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        self.read_blocking(buf, offset)
    }

    async fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.write_vectored_at(&[IoSlice::new(buf)], offset).await
    }

    async fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> Result<()> {
        let len: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        self.check_writable(Op::Write, offset, len)?;
        self.check_inside(Op::Write, offset, len)?;
        // Pieces of at most MAX_REQUEST bytes, each sent from the caller's buffers.
        let mut at = offset;
        let mut pieces: Vec<IoSlice<'_>> = Vec::new();
        let mut piece_len = 0u64;
        for b in bufs {
            let mut rest: &[u8] = b;
            while !rest.is_empty() {
                let take = (MAX_REQUEST - piece_len).min(rest.len() as u64) as usize;
                pieces.push(IoSlice::new(&rest[..take]));
                piece_len += take as u64;
                rest = &rest[take..];
                if piece_len == MAX_REQUEST {
                    self.request(
                        Req {
                            op: Op::Write,
                            cmd: CMD_WRITE,
                            flags: 0,
                            offset: at,
                            len: piece_len,
                        },
                        &pieces,
                        None,
                    )?;
                    at += piece_len;
                    pieces.clear();
                    piece_len = 0;
                }
            }
        }
        if piece_len > 0 {
            self.request(
                Req {
                    op: Op::Write,
                    cmd: CMD_WRITE,
                    flags: 0,
                    offset: at,
                    len: piece_len,
                },
                &pieces,
                None,
            )?;
        }
        Ok(())
    }

    async fn write_zeroes(&self, offset: u64, len: u64) -> Result<ZeroOutcome> {
        self.check_writable(Op::WriteZeroes, offset, len)?;
        // Zeros past the end would not be there to read back: refused as a write is.
        self.check_inside(Op::WriteZeroes, offset, len)?;
        if self.flags & TFLAG_SEND_WRITE_ZEROES != 0 {
            self.each_piece(
                Op::WriteZeroes,
                CMD_WRITE_ZEROES,
                CMD_FLAG_NO_HOLE,
                offset,
                len,
            )?;
            return Ok(ZeroOutcome::Efficient);
        }
        let zeros = vec![0u8; len.min(MAX_REQUEST) as usize];
        let mut at = offset;
        let end = offset + len;
        while at < end {
            let n = (end - at).min(MAX_REQUEST);
            self.write_at(&zeros[..n as usize], at).await?;
            at += n;
        }
        Ok(ZeroOutcome::Written)
    }

    async fn discard(&self, offset: u64, len: u64) -> Result<DiscardOutcome> {
        self.check_writable(Op::Discard, offset, len)?;
        if self.flags & TFLAG_SEND_TRIM == 0 {
            return Ok(DiscardOutcome::Ignored);
        }
        self.each_piece(Op::Discard, CMD_TRIM, 0, offset, len)?;
        // A trimmed range need not read as zeros afterwards.
        Ok(DiscardOutcome::Ignored)
    }

    async fn allocate(&self, _offset: u64, _len: u64) -> Result<AllocateOutcome> {
        Ok(AllocateOutcome::NotReserved)
    }

    async fn flush(&self) -> Result<()> {
        if !self.writable || self.flags & TFLAG_SEND_FLUSH == 0 {
            return Ok(());
        }
        self.request(
            Req {
                op: Op::Flush,
                cmd: CMD_FLUSH,
                flags: 0,
                offset: 0,
                len: 0,
            },
            &[],
            None,
        )
    }

    async fn len(&self) -> Result<u64> {
        Ok(self.size)
    }

    async fn set_len(&self, len: u64) -> Result<()> {
        if len == self.size {
            return Ok(());
        }
        Err(StorageError::Io {
            op: Op::SetLen,
            offset: len,
            len: 0,
            source: io::Error::new(
                io::ErrorKind::Unsupported,
                "an NBD export cannot change its size",
            ),
        })
    }
}

/// An open failure of `name`.
fn open_error(name: &str, source: io::Error) -> StorageError {
    StorageError::Open {
        path: name.into(),
        source,
    }
}

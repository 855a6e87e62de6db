//! [`NbdStorage`]: an export of an NBD server (qemu-nbd, qemu-storage-daemon, nbdkit,
//! `qimg serve --nbd`) as storage, so that an image name such as `nbd://host/export` or
//! `nbd+unix:///export?socket=/run/disk.sock` works wherever a file name does.
//!
//! The client speaks the fixed newstyle handshake (`NBD_OPT_GO`, falling back to
//! `NBD_OPT_EXPORT_NAME` for servers without it) and simple replies, one request at a time
//! on one connection, each request at most 32 MiB (the protocol's default maximum). Names
//! are parsed as QEMU parses them: the URI forms `nbd://HOST[:PORT]/EXPORT` (also
//! `nbd+tcp://`), `nbd+unix:///EXPORT?socket=PATH`, and the legacy forms
//! `nbd:HOST:PORT[:exportname=NAME]` and `nbd:unix:PATH[:exportname=NAME]`. With the
//! `nbd-tls` feature, TLS (`NBD_OPT_STARTTLS`, rustls) is spoken for libnbd's URIs
//! `nbds://...?tls-certificates=DIR[&tls-hostname=NAME]` and `nbds+unix://...`, which the
//! CLI also makes of QEMU's `tls-creds=` option ([`NbdTls`]). Requests run inline on the
//! calling thread, as the file backend's default strategy does.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::error::{Op, Result, StorageError};
use crate::storage::{AllocateOutcome, DiscardOutcome, Storage, ZeroOutcome};

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

const OPT_STARTTLS: u32 = 5;
const OPT_STRUCTURED_REPLY: u32 = 8;
const OPT_SET_META_CONTEXT: u32 = 10;
const REP_META_CONTEXT: u32 = 4;
const BASE_ALLOCATION: &str = "base:allocation";

const REPLY_FLAG_DONE: u16 = 1;
const REPLY_TYPE_NONE: u16 = 0;
const REPLY_TYPE_OFFSET_DATA: u16 = 1;
const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
const REPLY_TYPE_ERROR_BIT: u16 = 1 << 15;

const CMD_BLOCK_STATUS: u16 = 7;
/// Block status: the range is a hole (not allocated).
pub const STATE_HOLE: u32 = 1;
/// Block status: the range reads as zeros.
pub const STATE_ZERO: u32 = 2;

const FLAG_FIXED_NEWSTYLE: u16 = 1;
const FLAG_NO_ZEROES: u16 = 2;

const OPT_EXPORT_NAME: u32 = 1;
const OPT_GO: u32 = 7;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
const INFO_EXPORT: u16 = 0;

const TFLAG_READ_ONLY: u16 = 1 << 1;
const TFLAG_SEND_FLUSH: u16 = 1 << 2;
const TFLAG_SEND_TRIM: u16 = 1 << 5;
const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;

const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;
const CMD_TRIM: u16 = 4;
const CMD_WRITE_ZEROES: u16 = 6;
const CMD_FLAG_NO_HOLE: u16 = 1 << 1;

/// How long the handshake may take before the connection is given up (a hang guard: a
/// server answers within milliseconds; one that serves a single client at a time and is
/// busy with another would otherwise keep the open waiting for ever).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(60);

/// Connections this process holds, by name: every open of one export shares its
/// connection (qemu-nbd serves one client at a time unless told otherwise).
static SHARED: Mutex<Vec<(String, bool, Weak<NbdStorage>)>> = Mutex::new(Vec::new());

/// The largest request sent (the protocol's default maximum payload).
const MAX_REQUEST: u64 = 32 << 20;

mod address;
mod stream;
#[cfg(feature = "nbd-tls")]
mod tls;

pub use address::{NbdAddress, NbdServer, NbdTls, is_nbd_name};
use stream::Stream;

/// The connection and the next request's cookie.
struct Conn {
    stream: Stream,
    cookie: u64,
    /// Structured replies were negotiated.
    structured: bool,
    /// The metadata contexts the server agreed to, `(name, id)`: `base:allocation` when it
    /// offers it, and those asked for by [`NbdStorage::connect_with`].
    contexts: Vec<(String, u32)>,
    /// A reply went wrong: the stream is out of step and takes no more requests.
    broken: bool,
}

/// One request's header fields.
#[derive(Clone, Copy)]
struct Req {
    op: Op,
    cmd: u16,
    flags: u16,
    offset: u64,
    len: u64,
}

/// An NBD export as [`Storage`]; see the [module docs](self).
pub struct NbdStorage {
    conn: Mutex<Conn>,
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

/// An OS error's text without Rust's "(os error N)" suffix, as C tools print it.
fn os_text(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(n) => nix::errno::Errno::from_raw(n).desc().to_string(),
        None => e.to_string(),
    }
}

fn proto(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

fn read_u16(s: &mut impl Read) -> io::Result<u16> {
    let mut b = [0u8; 2];
    s.read_exact(&mut b)?;
    Ok(u16::from_be_bytes(b))
}

fn read_u32(s: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

fn read_u64(s: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

/// Reads and drops `n` bytes.
fn skip(s: &mut impl Read, n: u64) -> io::Result<()> {
    io::copy(&mut s.take(n), &mut io::sink()).and_then(|got| {
        (got == n)
            .then_some(())
            .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))
    })
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
        let open_err = |source: io::Error| StorageError::Open {
            path: name.into(),
            source,
        };
        let addr = NbdAddress::parse(name)
            .map_err(|e| open_err(io::Error::new(io::ErrorKind::InvalidInput, e)))?
            .ok_or_else(|| {
                open_err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "not an NBD name",
                ))
            })?;
        let stream = match &addr.server {
            NbdServer::Tcp(host, port) => {
                let s = TcpStream::connect((host.as_str(), *port)).map_err(|e| {
                    open_err(io::Error::new(
                        e.kind(),
                        format!("Failed to connect to '{host}:{port}': {}", os_text(&e)),
                    ))
                })?;
                let _ = s.set_nodelay(true);
                Stream::Tcp(s)
            }
            NbdServer::Unix(path) => Stream::Unix(UnixStream::connect(path).map_err(|e| {
                open_err(io::Error::new(
                    e.kind(),
                    format!("Failed to connect to '{path}': {}", os_text(&e)),
                ))
            })?),
        };
        let mut stream = stream;
        stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
        let no_zeroes = greet(&mut stream).map_err(open_err)?;
        let mut stream = match &addr.tls {
            None => stream,
            Some(tls) => {
                let host = match &addr.server {
                    NbdServer::Tcp(host, _) => Some(host.as_str()),
                    NbdServer::Unix(_) => None,
                };
                start_tls(stream, tls, host).map_err(open_err)?
            }
        };
        let (size, flags, structured, agreed) =
            handshake(&mut stream, no_zeroes, &addr.export, contexts).map_err(open_err)?;
        stream.set_read_timeout(None);
        if writable && flags & TFLAG_READ_ONLY != 0 {
            return Err(open_err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "the export is read-only",
            )));
        }
        Ok(NbdStorage {
            conn: Mutex::new(Conn {
                stream,
                cookie: 1,
                structured,
                contexts: agreed,
                broken: false,
            }),
            size,
            flags,
            writable,
            name: name.to_string(),
        })
    }

    /// The connection this process holds to export `name`, or a new one: one connection
    /// per export and process, as QEMU keeps (a writable open upgrades nothing: it needs a
    /// writable connection, and a read-only one is not reused for it).
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
        match self.context_id(BASE_ALLOCATION) {
            None => Ok(None),
            Some(id) => self.status_runs(id, offset, len).map(Some),
        }
    }

    /// The runs `(length, flags)` from `offset` that metadata context `context` (asked for
    /// at [`connect_with`](Self::connect_with)) gives `[offset, offset + len)`: for
    /// `qemu:dirty-bitmap:NAME`, flag 1 is "dirty". Refused when the server did not agree to
    /// the context.
    pub fn context_status(&self, context: &str, offset: u64, len: u64) -> Result<Vec<(u64, u32)>> {
        let id = self.context_id(context).ok_or_else(|| StorageError::Io {
            op: Op::Probe,
            offset,
            len,
            source: io::Error::new(
                io::ErrorKind::Unsupported,
                format!("the server offers no metadata context '{context}' for this export"),
            ),
        })?;
        self.status_runs(id, offset, len)
    }

    /// Whether the server says several connections may serve this export at once
    /// (`NBD_FLAG_CAN_MULTI_CONN`): then a client may open more to have requests in flight
    /// together.
    pub fn can_multi_conn(&self) -> bool {
        self.flags & TFLAG_CAN_MULTI_CONN != 0
    }

    fn context_id(&self, name: &str) -> Option<u32> {
        let c = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        c.contexts
            .iter()
            .find(|(n, _)| n == name)
            .map(|&(_, id)| id)
    }

    /// The runs of context `id` over `[offset, offset + len)`, asked for in pieces the
    /// protocol can carry.
    fn status_runs(&self, id: u32, offset: u64, len: u64) -> Result<Vec<(u64, u32)>> {
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
            self.exchange(req, &[], None, &mut |ctx, l, f| {
                let l = u64::from(l).min(n - got);
                if ctx == id && l > 0 {
                    runs.push((l, f));
                    got += l;
                }
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

    /// Sends one request (with `data` for a write) and reads its reply (into `out` for a
    /// read).
    fn request(&self, req: Req, data: &[IoSlice<'_>], out: Option<&mut [u8]>) -> Result<()> {
        self.exchange(req, data, out, &mut |_, _, _| {})
    }

    /// [`request`](Self::request), block status descriptors handed to `status`.
    fn exchange(
        &self,
        req: Req,
        data: &[IoSlice<'_>],
        out: Option<&mut [u8]>,
        status: &mut dyn FnMut(u32, u32, u32),
    ) -> Result<()> {
        let Req {
            op,
            cmd,
            flags,
            offset,
            len,
        } = req;
        let err = |source: io::Error| StorageError::Io {
            op,
            offset,
            len,
            source,
        };
        let mut c = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        if c.broken {
            return Err(err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the NBD connection failed earlier",
            )));
        }
        let cookie = c.cookie;
        c.cookie += 1;
        let mut head = [0u8; 28];
        head[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        head[4..6].copy_from_slice(&flags.to_be_bytes());
        head[6..8].copy_from_slice(&cmd.to_be_bytes());
        head[8..16].copy_from_slice(&cookie.to_be_bytes());
        head[16..24].copy_from_slice(&offset.to_be_bytes());
        head[24..28].copy_from_slice(&(len as u32).to_be_bytes());
        let r = (|| -> io::Result<Option<i32>> {
            c.stream.write_all(&head)?;
            for d in data {
                c.stream.write_all(d)?;
            }
            c.stream.flush()?;
            if cmd == CMD_DISC {
                return Ok(None);
            }
            let c = &mut *c;
            read_reply(c, cookie, offset, out, status)
        })();
        match r {
            Ok(None) => Ok(()),
            Ok(Some(errno)) => Err(err(io::Error::from_raw_os_error(errno))),
            Err(e) => {
                c.broken = true;
                Err(err(e))
            }
        }
    }

    fn check_writable(&self, op: Op, offset: u64, len: u64) -> Result<()> {
        if self.writable {
            Ok(())
        } else {
            Err(StorageError::ReadOnly { op, offset, len })
        }
    }

    /// `cmd` over `[offset, offset + len)` in requests of at most [`MAX_REQUEST`] bytes.
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

/// Reads the reply to request `cookie` (which starts at `offset`): a simple reply, or the
/// chunks of a structured one (read data into `out`, holes zeroed there, block status
/// descriptors handed to `status` as `(context, length, flags)`). `Some(errno)` for an error
/// reply.
fn read_reply(
    c: &mut Conn,
    cookie: u64,
    offset: u64,
    mut out: Option<&mut [u8]>,
    status: &mut dyn FnMut(u32, u32, u32),
) -> io::Result<Option<i32>> {
    let s = &mut c.stream;
    let magic = read_u32(s)?;
    if magic == SIMPLE_REPLY_MAGIC {
        let error = read_u32(s)?;
        if read_u64(s)? != cookie {
            return Err(proto("the server answered another request"));
        }
        if error != 0 {
            return Ok(Some(error as i32));
        }
        if let Some(out) = out {
            s.read_exact(out)?;
        }
        return Ok(None);
    }
    if magic != STRUCTURED_REPLY_MAGIC || !c.structured {
        return Err(proto("the server sent no valid reply"));
    }
    let mut error = None;
    let mut first = true;
    loop {
        // Every chunk starts with the magic (the first one's was read above).
        if !std::mem::take(&mut first) && read_u32(s)? != STRUCTURED_REPLY_MAGIC {
            return Err(proto("a structured reply chunk without its magic"));
        }
        let flags = read_u16(s)?;
        let kind = read_u16(s)?;
        if read_u64(s)? != cookie {
            return Err(proto("the server answered another request"));
        }
        let len = u64::from(read_u32(s)?);
        match kind {
            REPLY_TYPE_NONE => skip(s, len)?,
            REPLY_TYPE_OFFSET_DATA | REPLY_TYPE_OFFSET_HOLE => {
                let at = read_u64(s)?;
                let n = if kind == REPLY_TYPE_OFFSET_DATA {
                    len.checked_sub(8)
                        .ok_or_else(|| proto("short data chunk"))?
                } else {
                    u64::from(read_u32(s)?)
                };
                let buf = out.as_deref_mut().unwrap_or(&mut []);
                let start = at
                    .checked_sub(offset)
                    .filter(|st| st.saturating_add(n) <= buf.len() as u64)
                    .ok_or_else(|| proto("a read chunk outside the request"))?
                    as usize;
                let dst = &mut buf[start..start + n as usize];
                if kind == REPLY_TYPE_OFFSET_DATA {
                    s.read_exact(dst)?;
                } else {
                    dst.fill(0);
                }
            }
            REPLY_TYPE_BLOCK_STATUS => {
                let context = read_u32(s)?;
                let mut left = len
                    .checked_sub(4)
                    .ok_or_else(|| proto("short status chunk"))?;
                while left >= 8 {
                    let n = read_u32(s)?;
                    let f = read_u32(s)?;
                    status(context, n, f);
                    left -= 8;
                }
                skip(s, left)?;
            }
            k if k & REPLY_TYPE_ERROR_BIT != 0 => {
                let e = read_u32(s)?;
                skip(s, len.saturating_sub(4))?;
                error.get_or_insert(if e == 0 { 5 } else { e as i32 });
            }
            _ => skip(s, len)?,
        }
        if flags & REPLY_FLAG_DONE != 0 {
            return Ok(error);
        }
    }
}

/// What the handshake found: the export's size and transmission flags, whether structured
/// replies are on, and the metadata contexts agreed to with their ids.
type Handshaken = (u64, u16, bool, Vec<(String, u32)>);

/// The server's greeting and the client's flags: whether the server leaves out the zero
/// padding of `NBD_OPT_EXPORT_NAME`'s reply.
fn greet(s: &mut Stream) -> io::Result<bool> {
    if read_u64(s)? != NBDMAGIC {
        return Err(proto("not an NBD server (no NBDMAGIC)"));
    }
    if read_u64(s)? != IHAVEOPT {
        return Err(proto(
            "the server speaks the oldstyle protocol, which qimg does not",
        ));
    }
    let server_flags = read_u16(s)?;
    if server_flags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(proto("the server does not speak fixed newstyle"));
    }
    let client_flags = u32::from(FLAG_FIXED_NEWSTYLE | (server_flags & FLAG_NO_ZEROES));
    s.write_all(&client_flags.to_be_bytes())?;
    Ok(server_flags & FLAG_NO_ZEROES != 0)
}

/// `NBD_OPT_STARTTLS`, then the TLS handshake: the stream becomes a TLS session.
fn start_tls(mut s: Stream, tls: &NbdTls, host: Option<&str>) -> io::Result<Stream> {
    send_option(&mut s, OPT_STARTTLS, &[])?;
    if !option_acked(&mut s, |s, _, len| skip(s, u64::from(len)))? {
        // QEMU's words.
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "Server don't support STARTTLS option",
        ));
    }
    #[cfg(feature = "nbd-tls")]
    return tls::start(s, tls, host);
    #[cfg(not(feature = "nbd-tls"))]
    {
        let _ = (tls, host);
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "NBD over TLS needs qimg-io's `nbd-tls` feature, which this build lacks",
        ))
    }
}

/// The fixed newstyle handshake for `export` after the greeting: its size and transmission
/// flags, whether structured replies are on, and the metadata contexts agreed to
/// (`base:allocation` and `extra`) with their ids.
fn handshake(
    s: &mut Stream,
    no_zeroes: bool,
    export: &str,
    extra: &[&str],
) -> io::Result<Handshaken> {
    // Structured replies, then the allocation context (block status) and those asked for,
    // when offered.
    send_option(s, OPT_STRUCTURED_REPLY, &[])?;
    let structured = option_acked(s, |_, _, _| Ok(()))?;
    let mut agreed = Vec::new();
    if structured {
        let wanted: Vec<&str> = std::iter::once(BASE_ALLOCATION)
            .chain(extra.iter().copied())
            .collect();
        let mut q = Vec::new();
        q.extend_from_slice(&(export.len() as u32).to_be_bytes());
        q.extend_from_slice(export.as_bytes());
        q.extend_from_slice(&(wanted.len() as u32).to_be_bytes());
        for w in &wanted {
            q.extend_from_slice(&(w.len() as u32).to_be_bytes());
            q.extend_from_slice(w.as_bytes());
        }
        send_option(s, OPT_SET_META_CONTEXT, &q)?;
        option_acked(s, |s, kind, len| {
            if kind == REP_META_CONTEXT && (4..4 + 4096).contains(&len) {
                let id = read_u32(s)?;
                let mut name = vec![0u8; (len - 4) as usize];
                s.read_exact(&mut name)?;
                let name = String::from_utf8_lossy(&name).into_owned();
                if wanted.contains(&name.as_str()) {
                    agreed.push((name, id));
                }
            } else {
                skip(s, u64::from(len))?;
            }
            Ok(())
        })?;
    }
    // NBD_OPT_GO: the export's name, and no information request beyond the default.
    let mut data = Vec::with_capacity(export.len() + 6);
    data.extend_from_slice(&(export.len() as u32).to_be_bytes());
    data.extend_from_slice(export.as_bytes());
    data.extend_from_slice(&0u16.to_be_bytes());
    send_option(s, OPT_GO, &data)?;
    let mut info = None;
    loop {
        if read_u64(s)? != REPLY_MAGIC {
            return Err(proto("bad option reply magic"));
        }
        let _option = read_u32(s)?;
        let kind = read_u32(s)?;
        let len = read_u32(s)?;
        match kind {
            REP_ACK => break,
            REP_INFO => {
                if len < 2 {
                    return Err(proto("short NBD_REP_INFO"));
                }
                let t = read_u16(s)?;
                if t == INFO_EXPORT && len == 12 {
                    info = Some((read_u64(s)?, read_u16(s)?));
                } else {
                    skip(s, u64::from(len) - 2)?;
                }
            }
            REP_ERR_UNSUP => {
                // An older server: NBD_OPT_EXPORT_NAME, which ends the handshake.
                skip(s, u64::from(len))?;
                send_option(s, OPT_EXPORT_NAME, export.as_bytes())?;
                let size = read_u64(s)?;
                let flags = read_u16(s)?;
                if !no_zeroes {
                    skip(s, 124)?;
                }
                return Ok((size, flags, structured, agreed));
            }
            k if k & (1 << 31) != 0 => {
                let mut msg = vec![0u8; len.min(4096) as usize];
                s.read_exact(&mut msg)?;
                skip(s, u64::from(len) - msg.len() as u64)?;
                let text = String::from_utf8_lossy(&msg);
                let what = match k & !(1 << 31) {
                    // QEMU's words.
                    6 => "Requested export not available".to_string(),
                    n => format!("Option request refused by the server (error {n})"),
                };
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    if text.is_empty() {
                        what
                    } else {
                        format!("{what}\nserver reported: {text}")
                    },
                ));
            }
            _ => skip(s, u64::from(len))?,
        }
    }
    let (size, flags) = info.ok_or_else(|| proto("the server sent no export information"))?;
    Ok((size, flags, structured, agreed))
}

/// Reads an option's replies up to its acknowledgement, handing the others to `each` as
/// `(stream, reply type, length)` (which must consume the payload): `true` when
/// acknowledged, `false` when the server does not support the option.
fn option_acked(
    s: &mut Stream,
    mut each: impl FnMut(&mut Stream, u32, u32) -> io::Result<()>,
) -> io::Result<bool> {
    loop {
        if read_u64(s)? != REPLY_MAGIC {
            return Err(proto("bad option reply magic"));
        }
        let _option = read_u32(s)?;
        let kind = read_u32(s)?;
        let len = read_u32(s)?;
        match kind {
            REP_ACK => {
                skip(s, u64::from(len))?;
                return Ok(true);
            }
            k if k & (1 << 31) != 0 => {
                skip(s, u64::from(len))?;
                return Ok(false);
            }
            k => each(s, k, len)?,
        }
    }
}

fn send_option(s: &mut Stream, option: u32, data: &[u8]) -> io::Result<()> {
    let mut head = [0u8; 16];
    head[0..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
    head[8..12].copy_from_slice(&option.to_be_bytes());
    head[12..16].copy_from_slice(&(data.len() as u32).to_be_bytes());
    s.write_all(&head)?;
    s.write_all(data)?;
    s.flush()
}

impl Drop for NbdStorage {
    fn drop(&mut self) {
        // NBD_CMD_DISC: the server closes the connection in order.
        let _ = self.request(
            Req {
                op: Op::Flush,
                cmd: CMD_DISC,
                flags: 0,
                offset: 0,
                len: 0,
            },
            &[],
            None,
        );
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
        if offset.saturating_add(len) > self.size {
            return Err(StorageError::Io {
                op: Op::Write,
                offset,
                len,
                source: io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("an NBD export cannot grow past its {} bytes", self.size),
                ),
            });
        }
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

//! One connection to an NBD server: opening it (connect, greeting, TLS, the handshake) and
//! one request with its reply on it (simple, or the chunks of a structured one). [`NbdStorage`](super::NbdStorage) holds one or, with
//! multi-conn, several.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;

use super::*;
use crate::error::{Op, Result, StorageError};

/// The connection and the next request's cookie.
pub(super) struct Conn {
    pub(super) stream: Stream,
    pub(super) cookie: u64,
    /// Structured replies were negotiated.
    pub(super) structured: bool,
    /// The metadata contexts the server agreed to, `(name, id)`: `base:allocation` when it
    /// offers it, and those asked for by [`NbdStorage::connect_with`].
    pub(super) contexts: Vec<(String, u32)>,
    /// A reply went wrong: the stream is out of step and takes no more requests.
    pub(super) broken: bool,
}

impl Conn {
    /// The id the server gave metadata context `name` on this connection.
    pub(super) fn context_id(&self, name: &str) -> Option<u32> {
        self.contexts
            .iter()
            .find(|(n, _)| n == name)
            .map(|&(_, id)| id)
    }
}

/// The first connection's answers, which every other connection must repeat.
pub(super) struct Opened {
    pub(super) conn: Conn,
    pub(super) size: u64,
    pub(super) flags: u16,
}

/// One request's header fields.
#[derive(Clone, Copy)]
pub(super) struct Req {
    pub(super) op: Op,
    pub(super) cmd: u16,
    pub(super) flags: u16,
    pub(super) offset: u64,
    pub(super) len: u64,
}

/// Sends request `req` (with `data` for a write) on connection `c` and reads its reply (into
/// `out` for a read; block status descriptors handed to `status`).
pub(super) fn exchange_on(
    c: &mut Conn,
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

/// The disconnect request (`NBD_CMD_DISC`): no reply comes.
pub(super) const DISCONNECT: Req = Req {
    op: Op::Flush,
    cmd: CMD_DISC,
    flags: 0,
    offset: 0,
    len: 0,
};

/// The names of the metadata contexts connection `c` agreed to, sorted.
pub(super) fn context_names(c: &Conn) -> Vec<String> {
    let mut names: Vec<String> = c.contexts.iter().map(|(n, _)| n.clone()).collect();
    names.sort();
    names
}

/// Opens one connection to `addr` (TLS when it says so) and negotiates the export, asking
/// for the metadata `contexts` beside `base:allocation`.
pub(super) fn open_conn(addr: &NbdAddress, contexts: &[&str]) -> io::Result<Opened> {
    let mut stream = match &addr.server {
        NbdServer::Tcp(host, port) => {
            let s = TcpStream::connect((host.as_str(), *port)).map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("Failed to connect to '{host}:{port}': {}", os_text(&e)),
                )
            })?;
            let _ = s.set_nodelay(true);
            Stream::Tcp(s)
        }
        NbdServer::Unix(path) => Stream::Unix(UnixStream::connect(path).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("Failed to connect to '{path}': {}", os_text(&e)),
            )
        })?),
    };
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
    let no_zeroes = greet(&mut stream)?;
    let mut stream = match &addr.tls {
        None => stream,
        Some(tls) => {
            let host = match &addr.server {
                NbdServer::Tcp(host, _) => Some(host.as_str()),
                NbdServer::Unix(_) => None,
            };
            start_tls(stream, tls, host)?
        }
    };
    let (size, flags, structured, agreed) =
        handshake(&mut stream, no_zeroes, &addr.export, contexts)?;
    stream.set_read_timeout(None);
    Ok(Opened {
        conn: Conn {
            stream,
            cookie: 1,
            structured,
            contexts: agreed,
            broken: false,
        },
        size,
        flags,
    })
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

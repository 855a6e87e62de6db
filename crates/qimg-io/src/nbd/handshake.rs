//! The client's side of the handshake: the greeting, STARTTLS, the options (structured
//! replies, meta contexts) and the export, with `NBD_OPT_GO` or the old `EXPORT_NAME`.

use super::stream::Stream;
use super::wire::*;
use super::*;

use std::io::{self, Read, Write};
use std::time::Duration;

/// How long the handshake may take before the connection is given up (a hang guard: a
/// server answers within milliseconds; one that serves a single client at a time and is
/// busy with another would otherwise keep the open waiting for ever).
pub(super) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(60);

/// What the handshake found: the export's size and transmission flags, whether structured
/// replies are on, and the metadata contexts agreed to with their ids.
pub(super) type Handshaken = (u64, u16, bool, Vec<(String, u32)>);

/// The server's greeting and the client's flags: whether the server leaves out the zero
/// padding of `NBD_OPT_EXPORT_NAME`'s reply.
pub(super) fn greet(s: &mut Stream) -> io::Result<bool> {
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
pub(super) fn start_tls(mut s: Stream, tls: &NbdTls, host: Option<&str>) -> io::Result<Stream> {
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
pub(super) fn handshake(
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
                // As QEMU's client: the handshake ends with NBD_OPT_ABORT (no reply awaited),
                // so that the server does not report a client that vanished mid-negotiation.
                let _ = send_option(s, OPT_ABORT, &[]);
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
pub(super) fn option_acked(
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

pub(super) fn send_option(s: &mut Stream, option: u32, data: &[u8]) -> io::Result<()> {
    let mut head = [0u8; 16];
    head[0..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
    head[8..12].copy_from_slice(&option.to_be_bytes());
    head[12..16].copy_from_slice(&(data.len() as u32).to_be_bytes());
    s.write_all(&head)?;
    s.write_all(data)?;
    s.flush()
}

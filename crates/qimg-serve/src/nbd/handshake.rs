//! The fixed newstyle handshake: greeting, client flags, then options until the client
//! picks an export (`NBD_OPT_GO`, `NBD_OPT_EXPORT_NAME`) or leaves (`NBD_OPT_ABORT`).
//!
//! Every option is read whole before it is acted on, up to [`MAX_OPTION`] bytes: a longer
//! one gets `NBD_REP_ERR_TOO_BIG` and the connection is closed, so a client cannot make the
//! server allocate or skip without bound. Strings are limited to [`MAX_STRING`] bytes.

use qimg::io::Storage;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use std::sync::Arc;

use super::proto::*;
use super::{BoxStream, Error, Export, Exports};

/// Options one handshake may have (a client looping on options cannot keep a connection
/// slot forever).
const MAX_OPTIONS: usize = 4096;

/// What the client negotiated for the transmission phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Negotiated {
    /// Structured replies (`NBD_OPT_STRUCTURED_REPLY`, or implied by extended headers).
    pub structured: bool,
    /// Extended headers (`NBD_OPT_EXTENDED_HEADERS`): 64-bit lengths, no simple replies.
    pub extended: bool,
    /// `base:allocation` was selected.
    pub base_allocation: bool,
    /// `qemu:allocation-depth` was selected.
    pub allocation_depth: bool,
    /// Bit `i` set: the `qemu:dirty-bitmap:` context of the export's bitmap `i` was
    /// selected (context id [`CTX_ID_BITMAP`]` + i`).
    pub bitmaps: u32,
}

/// The metadata contexts a client selected, and for which export name.
#[derive(Debug, Default)]
struct Selected {
    export: String,
    base: bool,
    depth: bool,
    bitmaps: u32,
}

/// A reader over option data that reports running out instead of panicking.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn u16(&mut self) -> Option<u16> {
        self.bytes(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Option<u32> {
        self.bytes(4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    /// A u32-length-prefixed string of at most [`MAX_STRING`] bytes.
    fn string(&mut self) -> Option<&'a [u8]> {
        let n = self.u32()? as usize;
        if n > MAX_STRING {
            return None;
        }
        self.bytes(n)
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Sends one option reply.
async fn reply(s: &mut BoxStream, option: u32, kind: u32, data: &[u8]) -> Result<(), Error> {
    let mut m = Vec::with_capacity(20 + data.len());
    m.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    m.extend_from_slice(&option.to_be_bytes());
    m.extend_from_slice(&kind.to_be_bytes());
    // Every reply the server builds is far below 4 GiB (strings are bounded).
    m.extend_from_slice(&u32::try_from(data.len()).unwrap_or(u32::MAX).to_be_bytes());
    m.extend_from_slice(data);
    s.write_all(&m).await?;
    s.flush().await?;
    Ok(())
}

/// Sends an error reply with a message.
async fn error(s: &mut BoxStream, option: u32, kind: u32, msg: &str) -> Result<(), Error> {
    reply(s, option, kind, msg.as_bytes()).await
}

/// What a finished handshake hands to the transmission phase: the stream (a TLS session
/// after `NBD_OPT_STARTTLS`), what was negotiated and the export chosen.
pub type Chosen<S> = (BoxStream, Negotiated, Arc<Export<S>>);

/// Runs the handshake. `None`: the client aborted; otherwise what it chose.
pub async fn negotiate<S: Storage + 'static>(
    mut s: BoxStream,
    exports: &Exports<S>,
) -> Result<Option<Chosen<S>>, Error> {
    let mut greeting = Vec::with_capacity(18);
    greeting.extend_from_slice(&NBDMAGIC.to_be_bytes());
    greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    s.write_all(&greeting).await?;
    s.flush().await?;
    let client = s.read_u32().await?;
    if client & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(Error::ClientFlags(client));
    }
    let no_zeroes = client & FLAG_C_NO_ZEROES != 0;
    let mut tls_active = false;
    let mut structured = false;
    let mut extended = false;
    let mut selected = Selected::default();
    for _ in 0..MAX_OPTIONS {
        let magic = s.read_u64().await?;
        if magic != IHAVEOPT {
            return Err(Error::BadMagic {
                found: magic,
                expected: IHAVEOPT,
            });
        }
        let option = s.read_u32().await?;
        let len = s.read_u32().await?;
        if len > MAX_OPTION {
            let msg = format!("option data of {len} bytes is over the limit of {MAX_OPTION}");
            error(&mut s, option, REP_ERR_TOO_BIG, &msg).await?;
            return Err(Error::OptionTooBig {
                option,
                len,
                limit: MAX_OPTION,
            });
        }
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data).await?;
        if exports.tls().is_some() && !tls_active && option != OPT_STARTTLS && option != OPT_ABORT {
            if option == OPT_EXPORT_NAME {
                return Err(Error::TlsRequired);
            }
            error(&mut s, option, REP_ERR_TLS_REQD, "TLS is required").await?;
            continue;
        }
        match option {
            OPT_ABORT => {
                // The spec asks for an ACK, which the client may not read: ignore a failure.
                let _ = reply(&mut s, option, REP_ACK, &[]).await;
                return Ok(None);
            }
            OPT_STARTTLS => {
                let Some(tls) = exports.tls().filter(|_| !tls_active) else {
                    let (kind, msg) = if tls_active {
                        (REP_ERR_INVALID, "TLS is already active")
                    } else {
                        (REP_ERR_POLICY, "this server does not offer TLS")
                    };
                    error(&mut s, option, kind, msg).await?;
                    continue;
                };
                if !data.is_empty() {
                    error(&mut s, option, REP_ERR_INVALID, "STARTTLS carries no data").await?;
                    continue;
                }
                reply(&mut s, option, REP_ACK, &[]).await?;
                s = tls.accept(s).await.map_err(Error::Tls)?;
                tls_active = true;
                // What was negotiated before TLS does not carry over.
                structured = false;
                extended = false;
                selected = Selected::default();
            }
            OPT_EXPORT_NAME => {
                // Clients that negotiated extended headers must use GO (the reply of
                // EXPORT_NAME cannot report errors).
                if extended {
                    return Err(Error::ExportNameWithExtendedHeaders);
                }
                let Some(export) = exports.get(&data) else {
                    return Err(Error::UnknownExport(
                        String::from_utf8_lossy(&data).into_owned(),
                    ));
                };
                let mut m = Vec::with_capacity(134);
                m.extend_from_slice(&export.image.size().to_be_bytes());
                m.extend_from_slice(&export.transmission_flags(structured).to_be_bytes());
                if !no_zeroes {
                    m.extend_from_slice(&[0u8; 124]);
                }
                s.write_all(&m).await?;
                s.flush().await?;
                let n = negotiated(structured, false, &selected, &export.name);
                return Ok(Some((s, n, export)));
            }
            OPT_LIST => {
                if !data.is_empty() {
                    error(&mut s, option, REP_ERR_INVALID, "LIST carries no data").await?;
                    continue;
                }
                for export in exports.all() {
                    let mut m = Vec::new();
                    m.extend_from_slice(&(export.name.len() as u32).to_be_bytes());
                    m.extend_from_slice(export.name.as_bytes());
                    if let Some(d) = &export.description {
                        m.extend_from_slice(d.as_bytes());
                    }
                    reply(&mut s, option, REP_SERVER, &m).await?;
                }
                reply(&mut s, option, REP_ACK, &[]).await?;
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    error(
                        &mut s,
                        option,
                        REP_ERR_INVALID,
                        "STRUCTURED_REPLY carries no data",
                    )
                    .await?;
                    continue;
                }
                structured = true;
                reply(&mut s, option, REP_ACK, &[]).await?;
            }
            OPT_EXTENDED_HEADERS => {
                if !data.is_empty() {
                    error(
                        &mut s,
                        option,
                        REP_ERR_INVALID,
                        "EXTENDED_HEADERS carries no data",
                    )
                    .await?;
                    continue;
                }
                // Extended headers include structured replies.
                structured = true;
                extended = true;
                reply(&mut s, option, REP_ACK, &[]).await?;
            }
            OPT_INFO | OPT_GO => {
                if let Some(export) = info(&mut s, option, &data, exports, structured).await? {
                    let n = negotiated(structured, extended, &selected, &export.name);
                    return Ok(Some((s, n, export)));
                }
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                meta_context(&mut s, option, &data, exports, structured, &mut selected).await?;
            }
            _ => {
                let msg = format!("option {option} is not supported");
                error(&mut s, option, REP_ERR_UNSUP, &msg).await?;
            }
        }
    }
    Err(Error::TooManyOptions(MAX_OPTIONS))
}

/// The contexts kept for the transmission: only those selected for the export chosen.
fn negotiated(structured: bool, extended: bool, selected: &Selected, name: &str) -> Negotiated {
    let same = selected.export == name;
    Negotiated {
        structured,
        extended,
        base_allocation: structured && same && selected.base,
        allocation_depth: structured && same && selected.depth,
        bitmaps: if structured && same {
            selected.bitmaps
        } else {
            0
        },
    }
}

/// `NBD_OPT_INFO` and `NBD_OPT_GO`. Returns the export when the transmission phase starts.
async fn info<S: Storage + 'static>(
    s: &mut BoxStream,
    option: u32,
    data: &[u8],
    exports: &Exports<S>,
    structured: bool,
) -> Result<Option<Arc<Export<S>>>, Error> {
    let mut c = Cursor(data);
    let parsed = (|| {
        let name = c.string()?;
        let n = c.u16()?;
        let mut wanted = Vec::with_capacity(usize::from(n));
        for _ in 0..n {
            wanted.push(c.u16()?);
        }
        c.is_empty().then_some((name, wanted))
    })();
    let Some((name, wanted)) = parsed else {
        error(s, option, REP_ERR_INVALID, "malformed INFO/GO request").await?;
        return Ok(None);
    };
    let Some(export) = exports.get(name) else {
        let msg = format!("export {:?} not found", String::from_utf8_lossy(name));
        error(s, option, REP_ERR_UNKNOWN, &msg).await?;
        return Ok(None);
    };
    let mut m = Vec::new();
    m.extend_from_slice(&INFO_EXPORT.to_be_bytes());
    m.extend_from_slice(&export.image.size().to_be_bytes());
    m.extend_from_slice(&export.transmission_flags(structured).to_be_bytes());
    reply(s, option, REP_INFO, &m).await?;
    if wanted.contains(&INFO_NAME) {
        let mut m = INFO_NAME.to_be_bytes().to_vec();
        m.extend_from_slice(export.name.as_bytes());
        reply(s, option, REP_INFO, &m).await?;
    }
    if let Some(d) = export
        .description
        .as_ref()
        .filter(|_| wanted.contains(&INFO_DESCRIPTION))
    {
        let mut m = INFO_DESCRIPTION.to_be_bytes().to_vec();
        m.extend_from_slice(d.as_bytes());
        reply(s, option, REP_INFO, &m).await?;
    }
    let preferred = u32::try_from(export.image.cluster_size())
        .unwrap_or(MAX_PAYLOAD)
        .clamp(512, MAX_PAYLOAD);
    let mut m = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
    m.extend_from_slice(&1u32.to_be_bytes());
    m.extend_from_slice(&preferred.to_be_bytes());
    m.extend_from_slice(&MAX_PAYLOAD.to_be_bytes());
    reply(s, option, REP_INFO, &m).await?;
    reply(s, option, REP_ACK, &[]).await?;
    Ok((option == OPT_GO).then_some(export))
}

/// `NBD_OPT_LIST_META_CONTEXT` and `NBD_OPT_SET_META_CONTEXT`.
async fn meta_context<S: Storage + 'static>(
    s: &mut BoxStream,
    option: u32,
    data: &[u8],
    exports: &Exports<S>,
    structured: bool,
    selected: &mut Selected,
) -> Result<(), Error> {
    let set = option == OPT_SET_META_CONTEXT;
    if set && !structured {
        let msg = "SET_META_CONTEXT needs structured replies first";
        return error(s, option, REP_ERR_INVALID, msg).await;
    }
    let mut c = Cursor(data);
    let parsed = (|| {
        let name = c.string()?;
        let n = c.u32()?;
        // Each query takes at least 4 bytes: a count the data cannot hold is malformed.
        if n as usize > c.0.len() / 4 {
            return None;
        }
        let mut queries = Vec::with_capacity(n as usize);
        for _ in 0..n {
            queries.push(c.string()?);
        }
        c.is_empty().then_some((name, queries))
    })();
    let Some((name, queries)) = parsed else {
        return error(s, option, REP_ERR_INVALID, "malformed meta context request").await;
    };
    let Some(export) = exports.get(name) else {
        let msg = format!("export {:?} not found", String::from_utf8_lossy(name));
        return error(s, option, REP_ERR_UNKNOWN, &msg).await;
    };
    let (mut base, mut depth, mut bitmaps) = (false, false, 0u32);
    let every_bitmap = (1u32 << export.bitmaps.len().min(32)).wrapping_sub(1);
    if queries.is_empty() && !set {
        base = true;
        depth = export.allocation_depth;
        bitmaps = every_bitmap;
    }
    for q in queries {
        match q {
            b"base:allocation" => base = true,
            b"base:" if !set => base = true,
            b"qemu:allocation-depth" => depth |= export.allocation_depth,
            b"qemu:" if !set => {
                depth |= export.allocation_depth;
                bitmaps = every_bitmap;
            }
            b"qemu:dirty-bitmap:" if !set => bitmaps = every_bitmap,
            q => {
                let named = q.strip_prefix(CTX_DIRTY_BITMAP_PREFIX.as_bytes());
                if let Some(i) = named
                    .and_then(|n| export.bitmaps.iter().position(|b| b.as_bytes() == n))
                    .filter(|&i| i < 32)
                {
                    bitmaps |= 1 << i;
                }
            }
        }
    }
    if set {
        *selected = Selected {
            export: export.name.clone(),
            base,
            depth,
            bitmaps,
        };
    }
    let mut offered = vec![
        (base, CTX_ID_BASE, CTX_BASE_ALLOCATION.to_string()),
        (depth, CTX_ID_DEPTH, CTX_ALLOCATION_DEPTH.to_string()),
    ];
    // Listed last given first, as qemu-nbd lists its -B bitmaps.
    for (i, name) in export.bitmaps.iter().enumerate().take(32).rev() {
        let ctx = format!("{CTX_DIRTY_BITMAP_PREFIX}{name}");
        offered.push((bitmaps & 1 << i != 0, CTX_ID_BITMAP + i as u32, ctx));
    }
    for (on, id, ctx) in offered {
        if on {
            let mut m = id.to_be_bytes().to_vec();
            m.extend_from_slice(ctx.as_bytes());
            reply(s, option, REP_META_CONTEXT, &m).await?;
        }
    }
    reply(s, option, REP_ACK, &[]).await
}

//! The transmission phase: requests are read one after another, checked, and each runs as
//! its own task on the shared image; each task writes its whole reply under the writer
//! lock when it completes, so replies go out in completion order.
//!
//! Memory stays bounded: before a request's payload is read (or its read buffer made) the
//! reader takes a slot of [`MAX_IN_FLIGHT`] and its bytes from [`IN_FLIGHT_BYTES`], which
//! the task gives back once its reply is written. When the client stops reading replies,
//! tasks wait on the socket, the budget runs out, and the reader stops reading requests.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use qimg::io::Storage;
use qimg::{ExtentKind, Image};
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::sync::{Mutex, Semaphore};
use tokio::task::JoinSet;

use qimg::io::AlignedBuf;

use super::proto::*;
#[cfg(target_os = "linux")]
use super::queued::Queued;
/// Without io_uring (not Linux) the engine serves every request.
#[cfg(not(target_os = "linux"))]
#[derive(Debug, Clone)]
enum Queued {}
use super::status::{self, Run};
use super::{BoxStream, Error, Export, IN_FLIGHT_BYTES, MAX_IN_FLIGHT, Negotiated, Shutdown};

/// Budget units are KiB so that a 32 MiB request fits the semaphore's permit type.
const UNIT: usize = 1024;
/// The longest block status answered at once; the client asks again for the rest.
const MAX_STATUS_SPAN: u64 = 1 << 30;
/// Zeros written per step of a `NO_HOLE` write-zeroes.
const ZERO_CHUNK: u64 = 1 << 20;
/// Alignment of payload and read buffers: what `O_DIRECT` asks of memory on every common
/// device, so that the queue's direct path can take them.
const PAYLOAD_ALIGN: usize = 4096;

/// A zeroed buffer of `len` bytes aligned to [`PAYLOAD_ALIGN`].
fn aligned(len: usize) -> io::Result<AlignedBuf> {
    AlignedBuf::zeroed(len, PAYLOAD_ALIGN)
        .ok_or_else(|| io::Error::other(format!("cannot make a buffer of {len} bytes")))
}

/// How long a shutdown waits for replies a client does not read.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// One request as read from the wire.
#[derive(Debug, Clone, Copy)]
struct Request {
    flags: u16,
    kind: u16,
    handle: u64,
    offset: u64,
    /// Payload length (WRITE) or effect length; 64 bits with extended headers.
    len: u64,
    /// The request carries `len` bytes of payload.
    carries: bool,
}

type Writer = Arc<Mutex<WriteHalf<BoxStream>>>;

/// Runs the transmission phase until the client disconnects, `shutdown` fires or the client
/// breaks the protocol; then waits for the requests in flight.
pub async fn run<S: Storage + 'static>(
    stream: BoxStream,
    export: Arc<Export<S>>,
    neg: Negotiated,
    mut shutdown: Shutdown,
) -> Result<(), Error> {
    let (mut rd, wr) = tokio::io::split(stream);
    #[cfg(target_os = "linux")]
    let (queued, driver) = match export
        .per_connection_queue
        .then(|| Queued::start(&export.image))
        .flatten()
    {
        Some((q, d)) => (Some(q), Some(d)),
        None => (None, None),
    };
    #[cfg(not(target_os = "linux"))]
    let (queued, driver): (Option<Queued>, Option<tokio::task::JoinHandle<()>>) = (None, None);
    let wr: Writer = Arc::new(Mutex::new(wr));
    let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let budget = Arc::new(Semaphore::new(IN_FLIGHT_BYTES / UNIT));
    let mut tasks = JoinSet::new();
    let result = loop {
        while tasks.try_join_next().is_some() {}
        let mut hdr = [0u8; 32];
        let size = if neg.extended { 32 } else { 28 };
        let got = tokio::select! {
            biased;
            _ = shutdown.wait() => break Ok(()),
            r = read_header(&mut rd, &mut hdr[..size]) => r,
        };
        match got {
            Ok(true) => {}
            Ok(false) => break Ok(()),
            Err(e) => break Err(e),
        }
        let magic = u32::from_be_bytes(hdr[0..4].try_into().unwrap_or_default());
        let expected = if neg.extended {
            EXTENDED_REQUEST_MAGIC
        } else {
            REQUEST_MAGIC
        };
        if magic != expected {
            break Err(Error::BadMagic {
                found: magic.into(),
                expected: expected.into(),
            });
        }
        let flags = u16::from_be_bytes([hdr[4], hdr[5]]);
        let kind = u16::from_be_bytes([hdr[6], hdr[7]]);
        let len = if neg.extended {
            u64::from_be_bytes(hdr[24..32].try_into().unwrap_or_default())
        } else {
            u32::from_be_bytes(hdr[24..28].try_into().unwrap_or_default()).into()
        };
        let req = Request {
            flags,
            kind,
            handle: u64::from_be_bytes(hdr[8..16].try_into().unwrap_or_default()),
            offset: u64::from_be_bytes(hdr[16..24].try_into().unwrap_or_default()),
            len,
            // WRITE always has its payload: the specification asks clients to flag it with
            // extended headers, but QEMU's client does not, and qemu-nbd accepts that too.
            carries: kind == CMD_WRITE || neg.extended && flags & CMD_FLAG_PAYLOAD_LEN != 0,
        };
        if req.kind == CMD_DISC {
            break Ok(());
        }
        if req.carries && req.len > u64::from(MAX_PAYLOAD) {
            // The payload cannot be skipped safely: answer, then close.
            let reply = error_reply(neg, req, EINVAL, "payload over the maximum");
            let _ = send(&wr, &reply).await;
            break Err(Error::PayloadTooBig {
                len: req.len,
                max: MAX_PAYLOAD,
            });
        }
        let buffered = if req.carries || req.kind == CMD_READ {
            req.len.min(MAX_PAYLOAD.into()) as usize
        } else {
            0
        };
        let units = (buffered / UNIT + 1) as u32;
        // Closed semaphores never happen (they live as long as this function).
        let (Ok(slot), Ok(bytes)) = (
            slots.clone().acquire_owned().await,
            budget.clone().acquire_many_owned(units).await,
        ) else {
            break Ok(());
        };
        // Aligned, so that the queue can hand it to the kernel as it is.
        let mut payload = match aligned(if req.carries { buffered } else { 0 }) {
            Ok(p) => p,
            Err(e) => break Err(e.into()),
        };
        if let Err(e) = rd.read_exact(&mut payload).await {
            break Err(e.into());
        }
        let (export, wr, queued) = (export.clone(), wr.clone(), queued.clone());
        tasks.spawn(async move {
            let reply = execute(&export, queued.as_ref(), neg, req, payload).await;
            // A client gone away is seen by the reader; nothing to do here.
            let _ = send(&wr, &reply).await;
            drop((slot, bytes));
        });
    };
    // Finish what is in flight (bounded: a client that does not read its replies must
    // not keep a shutdown waiting forever).
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
    }
    // The queue goes before the image can close: its driver ends once nothing is in flight.
    drop(queued);
    if let Some(driver) = driver {
        let _ = driver.await;
    }
    if !export.read_only && !export.no_flush {
        // Leave what this client wrote durable, as a flush would.
        let _ = export.image.flush().await;
    }
    let _ = wr.lock().await.shutdown().await;
    result
}

/// Reads a request header. `Ok(false)`: the client closed the connection between requests.
async fn read_header(rd: &mut ReadHalf<BoxStream>, hdr: &mut [u8]) -> Result<bool, Error> {
    let n = rd.read(&mut hdr[..]).await?;
    if n == 0 {
        return Ok(false);
    }
    rd.read_exact(&mut hdr[n..]).await?;
    Ok(true)
}

async fn send(wr: &Writer, bytes: &[u8]) -> io::Result<()> {
    let mut w = wr.lock().await;
    w.write_all(bytes).await?;
    w.flush().await
}

/// A successful reply without data: simple, or a `NONE` chunk with extended headers
/// (which forbid simple replies).
fn success(neg: Negotiated, req: Request) -> Vec<u8> {
    if neg.extended {
        let mut m = Vec::with_capacity(32);
        chunk(&mut m, neg, req, REPLY_FLAG_DONE, REPLY_TYPE_NONE, 0);
        return m;
    }
    simple(req.handle, 0, &[])
}

/// A simple reply.
fn simple(handle: u64, error: u32, data: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(16 + data.len());
    m.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    m.extend_from_slice(&error.to_be_bytes());
    m.extend_from_slice(&handle.to_be_bytes());
    m.extend_from_slice(data);
    m
}

/// Appends a structured (or, with extended headers, extended) reply chunk header for the
/// reply to `req`; the `len` bytes of payload follow. Payloads are at most
/// [`MAX_PAYLOAD`] plus a few headers, so they fit the 32-bit length of structured replies.
fn chunk(m: &mut Vec<u8>, neg: Negotiated, req: Request, flags: u16, kind: u16, len: usize) {
    let magic = if neg.extended {
        EXTENDED_REPLY_MAGIC
    } else {
        STRUCTURED_REPLY_MAGIC
    };
    m.extend_from_slice(&magic.to_be_bytes());
    m.extend_from_slice(&flags.to_be_bytes());
    m.extend_from_slice(&kind.to_be_bytes());
    m.extend_from_slice(&req.handle.to_be_bytes());
    if neg.extended {
        m.extend_from_slice(&req.offset.to_be_bytes());
        m.extend_from_slice(&(len as u64).to_be_bytes());
    } else {
        m.extend_from_slice(&(len as u32).to_be_bytes());
    }
}

/// The error reply: an error chunk for commands that answer in chunks, else simple.
fn error_reply(neg: Negotiated, req: Request, errno: u32, msg: &str) -> Vec<u8> {
    let chunked = neg.extended || neg.structured && matches!(req.kind, CMD_READ | CMD_BLOCK_STATUS);
    if !chunked {
        return simple(req.handle, errno, &[]);
    }
    let msg = &msg.as_bytes()[..msg.len().min(MAX_STRING)];
    let mut m = Vec::new();
    let len = 6 + msg.len();
    chunk(&mut m, neg, req, REPLY_FLAG_DONE, REPLY_TYPE_ERROR, len);
    m.extend_from_slice(&errno.to_be_bytes());
    m.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    m.extend_from_slice(msg);
    m
}

/// The NBD error of an engine error.
fn errno(e: &qimg::Error) -> u32 {
    match e {
        qimg::Error::ReadOnly { .. } => EPERM,
        qimg::Error::OutOfRange { .. } => EINVAL,
        _ => {
            let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
            while let Some(s) = src {
                if let Some(io) = s.downcast_ref::<io::Error>() {
                    match io.raw_os_error() {
                        Some(28) => return ENOSPC,
                        Some(12) => return ENOMEM,
                        _ => {}
                    }
                }
                src = s.source();
            }
            EIO
        }
    }
}

/// Checks a request against the export. `Err`: the errno and why.
fn check<S: Storage + 'static>(
    export: &Export<S>,
    neg: Negotiated,
    req: Request,
) -> Result<(), (u32, String)> {
    let allowed = match req.kind {
        CMD_READ if neg.structured => CMD_FLAG_DF,
        CMD_READ | CMD_FLUSH | CMD_CACHE => 0,
        CMD_WRITE | CMD_TRIM => CMD_FLAG_FUA,
        CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
        CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
        other => return Err((EINVAL, format!("unknown command {other}"))),
    };
    // With extended headers every command may announce a payload; only WRITE has one.
    let allowed = if neg.extended {
        allowed | CMD_FLAG_PAYLOAD_LEN
    } else {
        allowed
    };
    if req.flags & !allowed != 0 {
        let msg = format!(
            "flags {:#x} are not valid for command {}",
            req.flags, req.kind
        );
        return Err((EINVAL, msg));
    }
    if req.carries && req.kind != CMD_WRITE {
        let msg = format!("command {} does not take a payload", req.kind);
        return Err((EINVAL, msg));
    }
    let writes = matches!(req.kind, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    if writes && export.read_only {
        return Err((EPERM, "the export is read-only".into()));
    }
    if req.kind == CMD_READ && req.len > u64::from(MAX_PAYLOAD) {
        let msg = format!(
            "read of {} bytes is over the maximum of {MAX_PAYLOAD}",
            req.len
        );
        return Err((EINVAL, msg));
    }
    let size = export.image.size();
    let inside = req
        .offset
        .checked_add(req.len)
        .is_some_and(|end| end <= size);
    if req.kind != CMD_FLUSH && !inside {
        let msg = format!(
            "request of {} bytes at offset {} is past the end of the export ({size} bytes)",
            req.len, req.offset
        );
        return Err((EINVAL, msg));
    }
    if req.kind == CMD_FLUSH && (req.offset != 0 || req.len != 0) {
        return Err((EINVAL, "flush must have offset and length 0".into()));
    }
    if req.kind == CMD_BLOCK_STATUS {
        if !(neg.base_allocation || neg.allocation_depth) {
            return Err((EINVAL, "no metadata context was selected".into()));
        }
        if req.len == 0 {
            return Err((EINVAL, "block status of 0 bytes".into()));
        }
    }
    if req.kind == CMD_WRITE_ZEROES
        && req.flags & CMD_FLAG_FAST_ZERO != 0
        && req.flags & CMD_FLAG_NO_HOLE != 0
    {
        return Err((
            ENOTSUP,
            "zeroing without holes writes data: not fast".into(),
        ));
    }
    Ok(())
}

/// Runs one request and builds its reply.
async fn execute<S: Storage + 'static>(
    export: &Export<S>,
    queued: Option<&Queued>,
    neg: Negotiated,
    req: Request,
    payload: AlignedBuf,
) -> Vec<u8> {
    if let Err((e, msg)) = check(export, neg, req) {
        return error_reply(neg, req, e, &msg);
    }
    let img = &export.image;
    let fua = req.flags & CMD_FLAG_FUA != 0 || export.writethrough;
    let (offset, len) = (req.offset, req.len);
    let done = match req.kind {
        CMD_READ => return read(img, queued, neg, req).await,
        CMD_BLOCK_STATUS => return block_status(img, neg, req).await,
        CMD_WRITE => write(img, queued, payload, offset).await,
        CMD_FLUSH if export.no_flush => Ok(()),
        CMD_FLUSH => img.flush().await,
        CMD_TRIM => img.discard(offset, len).await,
        // Advisory: the first span only, so that the mapping stays bounded.
        CMD_CACHE => img.map(offset, len.min(MAX_STATUS_SPAN)).await.map(drop),
        CMD_WRITE_ZEROES if req.flags & CMD_FLAG_NO_HOLE != 0 => {
            write_zeros_as_data(img, offset, len).await
        }
        _ => img.write_zeroes(offset, len).await,
    };
    let done = match done {
        Ok(()) if fua && req.kind != CMD_FLUSH && req.kind != CMD_CACHE && !export.no_flush => {
            img.flush().await
        }
        other => other,
    };
    match done {
        Ok(()) => success(neg, req),
        Err(e) => error_reply(neg, req, errno(&e), &e.to_string()),
    }
}

/// Zeros that stay allocated (`NO_HOLE`): written as data.
async fn write_zeros_as_data<S: Storage + 'static>(
    img: &Image<S>,
    offset: u64,
    len: u64,
) -> qimg::Result<()> {
    let zeros = vec![0u8; len.min(ZERO_CHUNK) as usize];
    let mut at = 0;
    while at < len {
        let n = (len - at).min(ZERO_CHUNK);
        img.write(&zeros[..n as usize], offset + at).await?;
        at += n;
    }
    Ok(())
}

/// `NBD_CMD_WRITE`: through the connection's queue where there is one.
async fn write<S: Storage + 'static>(
    img: &Image<S>,
    queued: Option<&Queued>,
    payload: AlignedBuf,
    offset: u64,
) -> qimg::Result<()> {
    #[cfg(target_os = "linux")]
    if let Some(q) = queued {
        let request = qimg::Request::Write {
            offset,
            buffers: qimg::IoBuffers::from_aligned(payload),
        };
        let c = q.run(request).await.ok_or_else(queue_gone)?;
        return c.result.map(drop);
    }
    let _ = queued;
    img.write(&payload, offset).await
}

/// The error of a request a stopped queue did not take.
#[cfg(target_os = "linux")]
fn queue_gone() -> qimg::Error {
    qimg::Error::InvalidOption("the connection's request queue has stopped".into())
}

/// Reads `len` bytes at `offset` into an aligned buffer: through the connection's queue
/// where there is one. With them, the ranges that are holes when the queue knows them
/// (`qimg::Completion::holes`).
async fn read_data<S: Storage + 'static>(
    img: &Image<S>,
    queued: Option<&Queued>,
    offset: u64,
    len: usize,
) -> qimg::Result<(AlignedBuf, Option<Vec<(usize, usize)>>)> {
    let mut buf = aligned(len).map_err(|source| qimg::Error::Io {
        path: img.path().to_path_buf(),
        op: format!("reading {len} bytes at {offset}"),
        source,
    })?;
    #[cfg(target_os = "linux")]
    if let Some(q) = queued {
        let request = qimg::Request::Read {
            offset,
            buffers: qimg::IoBuffers::from_aligned(buf),
        };
        let c = q.run(request).await.ok_or_else(queue_gone)?;
        c.result?;
        // The buffer comes back whole: the ring is done with it.
        let owner = c.buffers.and_then(|b| b.into_owner().ok().flatten());
        return match owner.and_then(|o| o.downcast::<AlignedBuf>().ok()) {
            Some(buf) => Ok((*buf, c.holes)),
            None => Err(queue_gone()),
        };
    }
    let _ = queued;
    img.read(&mut buf, offset).await?;
    Ok((buf, None))
}

/// The `(start, length, hole)` pieces tiling `[offset, offset + len)`, given the hole ranges
/// `(position, length)` of a read in order.
fn tile_holes(offset: u64, len: u64, holes: &[(usize, usize)]) -> Vec<(u64, u64, bool)> {
    let mut pieces: Vec<(u64, u64, bool)> = Vec::new();
    let mut push = |start: u64, length: u64, hole: bool| {
        if length == 0 {
            return;
        }
        match pieces.last_mut() {
            Some(last) if last.2 == hole && last.0 + last.1 == start => last.1 += length,
            _ => pieces.push((start, length, hole)),
        }
    };
    let mut at = 0u64;
    for &(pos, n) in holes {
        let (pos, n) = (pos as u64, n as u64);
        if pos < at || pos + n > len {
            // Not in order or not inside: the caller falls back to all data.
            return vec![(offset, len, false)];
        }
        push(offset + at, pos - at, false);
        push(offset + pos, n, true);
        at = pos + n;
    }
    push(offset + at, len - at, false);
    pieces
}

/// `NBD_CMD_READ`: simple reply, or data and hole chunks.
async fn read<S: Storage + 'static>(
    img: &Image<S>,
    queued: Option<&Queued>,
    neg: Negotiated,
    req: Request,
) -> Vec<u8> {
    let (buf, holes) = match read_data(img, queued, req.offset, req.len as usize).await {
        Ok(read) => read,
        Err(e) => return error_reply(neg, req, errno(&e), &e.to_string()),
    };
    if !neg.structured {
        return simple(req.handle, 0, &buf);
    }
    if buf.is_empty() {
        let mut m = Vec::new();
        chunk(&mut m, neg, req, REPLY_FLAG_DONE, REPLY_TYPE_NONE, 0);
        return m;
    }
    // Which parts read as zeros without being data (holes); data everywhere with DF. The
    // queue's direct path knows them; otherwise the image's map says.
    let mut pieces: Vec<(u64, u64, bool)> = Vec::new();
    let df = req.flags & CMD_FLAG_DF != 0;
    let map = match holes {
        _ if df => None,
        Some(holes) => {
            pieces = tile_holes(req.offset, req.len, &holes);
            None
        }
        None => img.map(req.offset, req.len).await.ok(),
    };
    match map {
        None if pieces.is_empty() => pieces.push((req.offset, req.len, false)),
        None => {}
        Some(extents) => {
            for e in extents {
                let hole = match e.kind {
                    ExtentKind::Zero { .. } => true,
                    ExtentKind::Unallocated { .. } => img.backing().is_none(),
                    _ => false,
                };
                match pieces.last_mut() {
                    Some(last) if last.2 == hole => last.1 += e.length,
                    _ => pieces.push((e.start, e.length, hole)),
                }
            }
        }
    }
    // The chunks must tile the request exactly (and index `buf` safely): if the mapping did
    // not, send everything as one data chunk rather than a wrong reply.
    let mut at = req.offset;
    let tiles = pieces.iter().all(|&(start, length, _)| {
        let ok = start == at && length > 0;
        at = start.saturating_add(length);
        ok
    });
    if !tiles || at != req.offset + req.len {
        pieces = vec![(req.offset, req.len, false)];
    }
    let mut m = Vec::with_capacity(buf.len() + 32 * pieces.len() + 32);
    let last = pieces.len() - 1;
    for (i, (start, length, hole)) in pieces.into_iter().enumerate() {
        let flags = if i == last { REPLY_FLAG_DONE } else { 0 };
        if hole {
            chunk(&mut m, neg, req, flags, REPLY_TYPE_OFFSET_HOLE, 12);
            m.extend_from_slice(&start.to_be_bytes());
            m.extend_from_slice(&(length as u32).to_be_bytes());
        } else {
            let from = (start - req.offset) as usize;
            let data = &buf[from..from + length as usize];
            let len = 8 + length as usize;
            chunk(&mut m, neg, req, flags, REPLY_TYPE_OFFSET_DATA, len);
            m.extend_from_slice(&start.to_be_bytes());
            m.extend_from_slice(data);
        }
    }
    m
}

/// `NBD_CMD_BLOCK_STATUS`: one chunk per selected context.
async fn block_status<S: Storage + 'static>(
    img: &Image<S>,
    neg: Negotiated,
    req: Request,
) -> Vec<u8> {
    let len = req.len.min(MAX_STATUS_SPAN);
    let mut runs: Vec<Run> = Vec::new();
    if let Err(e) = status::layer(img, 1, req.offset, len, &mut runs).await {
        return error_reply(neg, req, errno(&e), &e.to_string());
    }
    let one = req.flags & CMD_FLAG_REQ_ONE != 0;
    let mut contexts: Vec<(u32, Vec<(u64, u32)>)> = Vec::new();
    if neg.base_allocation {
        contexts.push((CTX_ID_BASE, status::descriptors(&runs, |r| r.flags)));
    }
    if neg.allocation_depth {
        contexts.push((CTX_ID_DEPTH, status::descriptors(&runs, |r| r.depth)));
    }
    let mut m = Vec::new();
    let last = contexts.len() - 1;
    for (i, (id, mut descs)) in contexts.into_iter().enumerate() {
        if one {
            descs.truncate(1);
        }
        let flags = if i == last { REPLY_FLAG_DONE } else { 0 };
        if neg.extended {
            let len = 8 + 16 * descs.len();
            chunk(&mut m, neg, req, flags, REPLY_TYPE_BLOCK_STATUS_EXT, len);
            m.extend_from_slice(&id.to_be_bytes());
            m.extend_from_slice(&(descs.len() as u32).to_be_bytes());
            for (length, value) in descs {
                m.extend_from_slice(&length.to_be_bytes());
                m.extend_from_slice(&u64::from(value).to_be_bytes());
            }
        } else {
            let len = 4 + 8 * descs.len();
            chunk(&mut m, neg, req, flags, REPLY_TYPE_BLOCK_STATUS, len);
            m.extend_from_slice(&id.to_be_bytes());
            for (length, value) in descs {
                // Each run is within MAX_STATUS_SPAN (1 GiB), so it fits a u32.
                m.extend_from_slice(&(length as u32).to_be_bytes());
                m.extend_from_slice(&value.to_be_bytes());
            }
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::tile_holes;

    #[test]
    fn holes_tile_a_read_in_order_and_merge() {
        let o = 1 << 20;
        assert_eq!(tile_holes(o, 16384, &[]), [(o, 16384, false)]);
        assert_eq!(
            tile_holes(o, 16384, &[(4096, 2048), (6144, 2048)]),
            [
                (o, 4096, false),
                (o + 4096, 4096, true),
                (o + 8192, 8192, false)
            ]
        );
        assert_eq!(tile_holes(o, 8192, &[(0, 8192)]), [(o, 8192, true)]);
        // Out of order or past the end: all data, never a wrong reply.
        assert_eq!(
            tile_holes(o, 8192, &[(4096, 1024), (0, 1024)]),
            [(o, 8192, false)]
        );
        assert_eq!(tile_holes(o, 8192, &[(4096, 8192)]), [(o, 8192, false)]);
    }
}

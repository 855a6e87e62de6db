//! Running a request on the shared image (the commands that do not go to the connection's
//! queue): checks in the protocol's order, write-zeroes, block status, reads with holes.

use qimg::io::{AlignedBuf, Storage};
use qimg::{ExtentKind, Image};

use super::proto::*;
use super::reply::*;
use super::request::*;
use super::status::{self, Run};
use super::{Export, Negotiated};

/// The longest block status answered at once; the client asks again for the rest.
pub(super) const MAX_STATUS_SPAN: u64 = 1 << 30;

/// Zeros written per step of a `NO_HOLE` write-zeroes.
pub(super) const ZERO_CHUNK: u64 = 1 << 20;

/// The error of a request a stopped queue did not take.
pub(super) fn queue_gone() -> qimg::Error {
    qimg::Error::InvalidOption("the connection's request queue has stopped".into())
}

/// Checks a request against the export. `Err`: the errno and why.
pub(super) fn check<S: Storage + 'static>(
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
        if !(neg.base_allocation || neg.allocation_depth || neg.bitmaps != 0) {
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

/// Whether a command that changed the image is flushed before its reply (FUA, or a
/// write-through export; never with `no_flush`): the one rule of both routes (this one and
/// the connection's queue).
pub(super) fn flush_before_reply<S: Storage>(export: &Export<S>, req: Request) -> bool {
    let changes = !matches!(
        req.kind,
        CMD_READ | CMD_BLOCK_STATUS | CMD_FLUSH | CMD_CACHE
    );
    changes && (req.flags & CMD_FLAG_FUA != 0 || export.writethrough) && !export.no_flush
}

/// Runs one request on the image (not through a queue) and builds its reply.
pub(super) async fn execute<S: Storage + 'static>(
    export: &Export<S>,
    neg: Negotiated,
    req: Request,
    payload: AlignedBuf,
) -> Reply {
    let img = &export.image;
    let (offset, len) = (req.offset, req.len);
    let done = match req.kind {
        CMD_READ => return read(img, neg, req).await,
        CMD_BLOCK_STATUS => return Reply::bytes(block_status(export, img, neg, req).await),
        CMD_WRITE => img.write(&payload, offset).await,
        CMD_FLUSH if export.no_flush => Ok(()),
        CMD_FLUSH => img.flush().await,
        CMD_TRIM => img.discard(offset, len).await,
        // Advisory: the first span only, so that the mapping stays bounded.
        CMD_CACHE => img.map(offset, len.min(MAX_STATUS_SPAN)).await.map(drop),
        CMD_WRITE_ZEROES if req.flags & CMD_FLAG_NO_HOLE != 0 => {
            write_zeros_as_data(img, offset, len).await
        }
        // Without NO_HOLE the client allows holes (qemu-nbd: BDRV_REQ_MAY_UNMAP).
        _ => img.write_zeroes_unmap(offset, len).await,
    };
    let done = match done {
        Ok(()) if flush_before_reply(export, req) => img.flush().await,
        other => other,
    };
    Reply::bytes(outcome(neg, req, done))
}

/// `NBD_CMD_READ` on the image: simple reply, or data and hole chunks.
pub(super) async fn read<S: Storage + 'static>(
    img: &Image<S>,
    neg: Negotiated,
    req: Request,
) -> Reply {
    let len = req.len as usize;
    let mut buf = match aligned(len) {
        Ok(buf) => buf,
        Err(e) => return Reply::bytes(error_reply(neg, req, ENOMEM, &e.to_string())),
    };
    if let Err(e) = img.read(&mut buf, req.offset).await {
        return Reply::bytes(error_reply(neg, req, errno(&e), &e.to_string()));
    }
    let pieces = if neg.structured && req.flags & CMD_FLAG_DF == 0 {
        pieces(img, req).await
    } else {
        vec![(req.offset, req.len, false)]
    };
    read_reply(neg, req, buf, pieces)
}

/// The `(start, length, hole)` pieces of a read from the image's map: holes are zero
/// clusters, and unallocated ones without a backing file. All data if the map fails.
pub(super) async fn pieces<S: Storage + 'static>(
    img: &Image<S>,
    req: Request,
) -> Vec<(u64, u64, bool)> {
    let mut pieces: Vec<(u64, u64, bool)> = Vec::new();
    let Ok(extents) = img.map(req.offset, req.len).await else {
        return vec![(req.offset, req.len, false)];
    };
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
    pieces
}

/// Zeros that stay allocated (`NO_HOLE`): written as data.
pub(super) async fn write_zeros_as_data<S: Storage + 'static>(
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

/// `NBD_CMD_BLOCK_STATUS`: one chunk per selected context.
pub(super) async fn block_status<S: Storage + 'static>(
    export: &Export<S>,
    img: &Image<S>,
    neg: Negotiated,
    req: Request,
) -> Vec<u8> {
    let len = req.len.min(MAX_STATUS_SPAN);
    let mut runs: Vec<Run> = Vec::new();
    if neg.base_allocation || neg.allocation_depth {
        if let Err(e) = status::chain(img, req.offset, len, &mut runs).await {
            return error_reply(neg, req, errno(&e), &e.to_string());
        }
    }
    let one = req.flags & CMD_FLAG_REQ_ONE != 0;
    let mut contexts: Vec<(u32, Vec<(u64, u32)>)> = Vec::new();
    if neg.base_allocation {
        contexts.push((CTX_ID_BASE, status::descriptors(&runs, |r| r.flags)));
    }
    if neg.allocation_depth {
        contexts.push((CTX_ID_DEPTH, status::descriptors(&runs, |r| r.depth)));
    }
    let end = (req.offset + len).min(img.size());
    for (i, name) in export.bitmaps.iter().enumerate().take(32) {
        if neg.bitmaps & 1 << i == 0 {
            continue;
        }
        let source = export.bitmap_source.as_ref().unwrap_or(img);
        match source.bitmap_extents(name, req.offset, len).await {
            Ok(dirty) => contexts.push((
                CTX_ID_BITMAP + i as u32,
                status::dirty_descriptors(&dirty, req.offset, end),
            )),
            Err(e) => return error_reply(neg, req, errno(&e), &e.to_string()),
        }
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

//! Replies: simple and structured (chunks, errors with messages), a read's reply sent from
//! the buffer it was read into, and the holes it reports.

use std::collections::VecDeque;
use std::io::{self, IoSlice};

use qimg::io::AlignedBuf;

use super::Negotiated;
use super::proto::*;
use super::request::*;

/// Pieces of replies handed to one vectored write.
pub(super) const MAX_IOV: usize = 64;

/// A piece of a [`Reply`]: a range of its header bytes or of its data buffer.
#[derive(Debug, Clone, Copy)]
pub(super) enum Seg {
    Head(usize, usize),
    Data(usize, usize),
}

/// A reply on its way to the client: header bytes and, for reads, the buffer the data was
/// read into, sent from there.
#[derive(Debug)]
pub(super) struct Reply {
    pub(super) head: Vec<u8>,
    pub(super) data: Option<AlignedBuf>,
    /// The reply's bytes in order.
    pub(super) segs: Vec<Seg>,
    /// Bytes in all.
    pub(super) len: usize,
    /// Budget units of the request, given back once the reply is written.
    pub(super) units: usize,
}

impl Reply {
    /// A reply of header bytes only.
    pub(super) fn bytes(head: Vec<u8>) -> Self {
        let len = head.len();
        Self {
            head,
            data: None,
            segs: vec![Seg::Head(0, len)],
            len,
            units: 0,
        }
    }

    pub(super) fn seg(&self, s: Seg) -> &[u8] {
        match s {
            Seg::Head(a, b) => &self.head[a..b],
            Seg::Data(a, b) => self.data.as_deref().map_or(&[][..], |d| &d[a..b]),
        }
    }
}

/// The pieces of the first replies in `out` (the first `sent` bytes already written) for one
/// vectored write.
pub(super) fn gather<'a>(out: &'a VecDeque<Reply>, sent: usize, iov: &mut Vec<IoSlice<'a>>) {
    let mut skip = sent;
    for r in out {
        for &s in &r.segs {
            let bytes = r.seg(s);
            if skip >= bytes.len() {
                skip -= bytes.len();
                continue;
            }
            iov.push(IoSlice::new(&bytes[skip..]));
            skip = 0;
            if iov.len() == MAX_IOV {
                return;
            }
        }
    }
}

/// A successful reply without data: simple, or a `NONE` chunk with extended headers
/// (which forbid simple replies).
pub(super) fn success(neg: Negotiated, req: Request) -> Vec<u8> {
    if neg.extended {
        let mut m = Vec::with_capacity(32);
        chunk(&mut m, neg, req, REPLY_FLAG_DONE, REPLY_TYPE_NONE, 0);
        return m;
    }
    simple(req.handle, 0, &[])
}

/// A simple reply.
pub(super) fn simple(handle: u64, error: u32, data: &[u8]) -> Vec<u8> {
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
pub(super) fn chunk(
    m: &mut Vec<u8>,
    neg: Negotiated,
    req: Request,
    flags: u16,
    kind: u16,
    len: usize,
) {
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
pub(super) fn error_reply(neg: Negotiated, req: Request, errno: u32, msg: &str) -> Vec<u8> {
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
pub(super) fn errno(e: &qimg::Error) -> u32 {
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

/// The reply of a request without data, from its outcome.
pub(super) fn outcome(neg: Negotiated, req: Request, done: qimg::Result<()>) -> Vec<u8> {
    match done {
        Ok(()) => success(neg, req),
        Err(e) => error_reply(neg, req, errno(&e), &e.to_string()),
    }
}

/// The reply to a read of `buf` (the `req.len` bytes at `req.offset`): simple, or a data or
/// hole chunk for each of `pieces`, the data sent from `buf`.
pub(super) fn read_reply(
    neg: Negotiated,
    req: Request,
    buf: AlignedBuf,
    pieces: Vec<(u64, u64, bool)>,
) -> Reply {
    let mut head = Vec::with_capacity(32 + 32 * pieces.len());
    let mut segs = Vec::with_capacity(2 * pieces.len() + 1);
    if !neg.structured {
        head = simple(req.handle, 0, &[]);
        segs.push(Seg::Head(0, head.len()));
        segs.push(Seg::Data(0, buf.len()));
        return finish(head, buf, segs);
    }
    if buf.is_empty() {
        chunk(&mut head, neg, req, REPLY_FLAG_DONE, REPLY_TYPE_NONE, 0);
        return Reply::bytes(head);
    }
    // The chunks must tile the request exactly (and index `buf` safely): if the pieces do
    // not, everything goes as one data chunk rather than a wrong reply.
    let mut at = req.offset;
    let tiles = pieces.iter().all(|&(start, length, _)| {
        let ok = start == at && length > 0;
        at = start.saturating_add(length);
        ok
    });
    let pieces = if tiles && at == req.offset + req.len {
        pieces
    } else {
        vec![(req.offset, req.len, false)]
    };
    let last = pieces.len() - 1;
    let mut mark = 0;
    for (i, (start, length, hole)) in pieces.into_iter().enumerate() {
        let flags = if i == last { REPLY_FLAG_DONE } else { 0 };
        if hole {
            chunk(&mut head, neg, req, flags, REPLY_TYPE_OFFSET_HOLE, 12);
            head.extend_from_slice(&start.to_be_bytes());
            head.extend_from_slice(&(length as u32).to_be_bytes());
        } else {
            let from = (start - req.offset) as usize;
            let len = 8 + length as usize;
            chunk(&mut head, neg, req, flags, REPLY_TYPE_OFFSET_DATA, len);
            head.extend_from_slice(&start.to_be_bytes());
            segs.push(Seg::Head(mark, head.len()));
            segs.push(Seg::Data(from, from + length as usize));
            mark = head.len();
        }
    }
    if mark < head.len() {
        segs.push(Seg::Head(mark, head.len()));
    }
    finish(head, buf, segs)
}

/// A reply of `head` and `data` in the order of `segs`.
pub(super) fn finish(head: Vec<u8>, data: AlignedBuf, segs: Vec<Seg>) -> Reply {
    let len = segs
        .iter()
        .map(|&s| match s {
            Seg::Head(a, b) | Seg::Data(a, b) => b - a,
        })
        .sum();
    Reply {
        head,
        data: Some(data),
        segs,
        len,
        units: 0,
    }
}

/// The `(start, length, hole)` pieces tiling `[offset, offset + len)`, given the hole ranges
/// `(position, length)` of a read in order.
pub(super) fn tile_holes(offset: u64, len: u64, holes: &[(usize, usize)]) -> Vec<(u64, u64, bool)> {
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

#[cfg(test)]
mod tests {
    use super::tile_holes;

    #[test]
    pub(super) fn holes_tile_a_read_in_order_and_merge() {
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

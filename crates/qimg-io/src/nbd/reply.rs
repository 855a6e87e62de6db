//! Reading a reply: simple, or the chunks of a structured one.

use super::wire::*;
use super::*;

use std::io::{self, Read};

/// Reads the reply to request `cookie` (which starts at `offset`): a simple reply, or the
/// chunks of a structured one (read data into `out`, holes zeroed there, block status
/// descriptors handed to `status` as `(context, length, flags)`). `Some(errno)` for an error
/// reply.
pub(super) fn read_reply(
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

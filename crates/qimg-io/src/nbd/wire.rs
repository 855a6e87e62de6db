//! The NBD protocol's numbers as the client uses them, and reading big-endian fields.

use std::io::{self, Read};

pub(super) const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;

pub(super) const IHAVEOPT: u64 = 0x4948_4156_454f_5054;

pub(super) const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;

pub(super) const REQUEST_MAGIC: u32 = 0x2560_9513;

pub(super) const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

pub(super) const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

pub(super) const OPT_STARTTLS: u32 = 5;

pub(super) const OPT_STRUCTURED_REPLY: u32 = 8;

pub(super) const OPT_SET_META_CONTEXT: u32 = 10;

pub(super) const REP_META_CONTEXT: u32 = 4;

pub(super) const BASE_ALLOCATION: &str = "base:allocation";

pub(super) const REPLY_FLAG_DONE: u16 = 1;

pub(super) const REPLY_TYPE_NONE: u16 = 0;

pub(super) const REPLY_TYPE_OFFSET_DATA: u16 = 1;

pub(super) const REPLY_TYPE_OFFSET_HOLE: u16 = 2;

pub(super) const REPLY_TYPE_BLOCK_STATUS: u16 = 5;

pub(super) const REPLY_TYPE_ERROR_BIT: u16 = 1 << 15;

pub(super) const CMD_BLOCK_STATUS: u16 = 7;

pub(super) const FLAG_FIXED_NEWSTYLE: u16 = 1;

pub(super) const FLAG_NO_ZEROES: u16 = 2;

pub(super) const OPT_EXPORT_NAME: u32 = 1;

pub(super) const OPT_GO: u32 = 7;
/// `NBD_OPT_ABORT`: the client gives up the handshake (a server then closes quietly).
pub(super) const OPT_ABORT: u32 = 2;

pub(super) const REP_ACK: u32 = 1;

pub(super) const REP_INFO: u32 = 3;

pub(super) const REP_ERR_UNSUP: u32 = (1 << 31) + 1;

pub(super) const INFO_EXPORT: u16 = 0;

pub(super) const TFLAG_READ_ONLY: u16 = 1 << 1;

pub(super) const TFLAG_SEND_FLUSH: u16 = 1 << 2;

pub(super) const TFLAG_SEND_TRIM: u16 = 1 << 5;

pub(super) const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;

pub(super) const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;

pub(super) const CMD_READ: u16 = 0;

pub(super) const CMD_WRITE: u16 = 1;

pub(super) const CMD_DISC: u16 = 2;

pub(super) const CMD_FLUSH: u16 = 3;

pub(super) const CMD_TRIM: u16 = 4;

pub(super) const CMD_WRITE_ZEROES: u16 = 6;

pub(super) const CMD_FLAG_NO_HOLE: u16 = 1 << 1;

/// An OS error's text without Rust's "(os error N)" suffix, as C tools print it.
pub(super) fn os_text(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(n) => nix::errno::Errno::from_raw(n).desc().to_string(),
        None => e.to_string(),
    }
}

pub(super) fn proto(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

pub(super) fn read_u16(s: &mut impl Read) -> io::Result<u16> {
    let mut b = [0u8; 2];
    s.read_exact(&mut b)?;
    Ok(u16::from_be_bytes(b))
}

pub(super) fn read_u32(s: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

pub(super) fn read_u64(s: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

/// Reads and drops `n` bytes.
pub(super) fn skip(s: &mut impl Read, n: u64) -> io::Result<()> {
    io::copy(&mut s.take(n), &mut io::sink()).and_then(|got| {
        (got == n)
            .then_some(())
            .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))
    })
}

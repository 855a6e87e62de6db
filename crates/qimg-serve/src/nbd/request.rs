//! One NBD request as read from the wire, and the aligned buffers its payload and reply use.

use std::io;

use qimg::io::AlignedBuf;

/// Alignment of payload and read buffers: what `O_DIRECT` asks of memory on every common
/// device, so that the queue's direct path can take them.
pub(super) const PAYLOAD_ALIGN: usize = 4096;

/// A zeroed buffer of `len` bytes aligned to [`PAYLOAD_ALIGN`].
pub(super) fn aligned(len: usize) -> io::Result<AlignedBuf> {
    AlignedBuf::zeroed(len, PAYLOAD_ALIGN)
        .ok_or_else(|| io::Error::other(format!("cannot make a buffer of {len} bytes")))
}

/// One request as read from the wire.
#[derive(Debug, Clone, Copy)]
pub(super) struct Request {
    pub(super) flags: u16,
    pub(super) kind: u16,
    pub(super) handle: u64,
    pub(super) offset: u64,
    /// Payload length (WRITE) or effect length; 64 bits with extended headers.
    pub(super) len: u64,
    /// The request carries `len` bytes of payload.
    pub(super) carries: bool,
}

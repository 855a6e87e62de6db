//! Parsing a virtio-blk request from a descriptor chain, with every guest-supplied value
//! checked: the chain's shape, directions, lengths, sectors and segment lists. Nothing here
//! trusts the guest; a request that is wrong gets a status, never a panic.

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD,
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
    VIRTIO_BLK_T_WRITE_ZEROES, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use vm_memory::{Bytes, GuestAddress, GuestMemory};

/// The request header: type, reserved, sector.
const HEADER: usize = 16;
/// One discard / write-zeroes segment: sector, sector count, flags.
const SEGMENT: usize = 16;
/// virtio-blk addresses in 512-byte sectors whatever the logical block size.
pub const SECTOR: u64 = 512;

/// One descriptor of a chain, as the queue gave it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    /// Guest physical address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// Written by the device (the guest reads it afterwards).
    pub write_only: bool,
}

/// What the device accepts; set from the options and the image.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Disk size in bytes.
    pub capacity: u64,
    /// Logical block size: offsets and lengths of reads and writes are multiples of it.
    pub block_size: u32,
    /// Writes, discards and write-zeroes are refused.
    pub read_only: bool,
    /// Most data descriptors in a read or write (`seg_max`).
    pub max_segments: usize,
    /// Most bytes in one read or write.
    pub max_bytes: u64,
    /// Most sectors in one discard or write-zeroes segment.
    pub max_zero_sectors: u32,
    /// Most segments in one discard or write-zeroes request.
    pub max_zero_segments: usize,
}

/// A request the engine carries out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlkRequest {
    /// Read `len` bytes at `offset` into the guest ranges `data`.
    Read {
        /// Byte offset on the disk.
        offset: u64,
        /// `(guest address, length)` in order.
        data: Vec<(u64, usize)>,
    },
    /// Write the guest ranges `data` at `offset`.
    Write {
        /// Byte offset on the disk.
        offset: u64,
        /// `(guest address, length)` in order.
        data: Vec<(u64, usize)>,
    },
    /// Make completed writes durable.
    Flush,
    /// Write the device id into the guest ranges (at most 20 bytes).
    GetId {
        /// `(guest address, length)` in order.
        data: Vec<(u64, usize)>,
    },
    /// Discard `(offset, len)` ranges.
    Discard {
        /// `(byte offset, byte length)` per segment.
        ranges: Vec<(u64, u64)>,
    },
    /// Zero `(offset, len)` ranges; `unmap` allows releasing the space.
    WriteZeroes {
        /// `(byte offset, byte length)` per segment.
        ranges: Vec<(u64, u64)>,
        /// The guest allows deallocation.
        unmap: bool,
    },
}

impl BlkRequest {
    /// Bytes of data the device writes into guest memory (for the used length).
    pub fn device_writes(&self) -> u64 {
        match self {
            BlkRequest::Read { data, .. } => data.iter().map(|&(_, n)| n as u64).sum(),
            _ => 0,
        }
    }
}

/// The parse of one chain: the request (or the status to answer at once) and where the
/// status byte goes (`None` when the chain has nowhere to put it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed {
    /// The request, or the virtio status for a request refused without I/O.
    pub request: Result<BlkRequest, u8>,
    /// Guest address of the status byte.
    pub status: Option<u64>,
}

fn refuse(status: Option<u64>, code: u32) -> Parsed {
    Parsed {
        request: Err(code as u8),
        status,
    }
}

/// Byte ranges `[from, from + len)` of the concatenated descriptors, as guest ranges.
fn cut(descs: &[Desc], from: u64, len: u64) -> Vec<(u64, usize)> {
    let mut out = Vec::new();
    let mut at = 0u64;
    let end = from + len;
    for d in descs {
        let (a, b) = (at, at + u64::from(d.len));
        let lo = from.max(a);
        let hi = end.min(b);
        if lo < hi {
            out.push((d.addr.wrapping_add(lo - a), (hi - lo) as usize));
        }
        at = b;
    }
    out
}

/// Copies `buf.len()` bytes from byte `from` of the concatenated descriptors.
fn gather<M: GuestMemory>(mem: &M, descs: &[Desc], from: u64, buf: &mut [u8]) -> bool {
    let mut done = 0usize;
    for (addr, n) in cut(descs, from, buf.len() as u64) {
        if mem
            .read_slice(&mut buf[done..done + n], GuestAddress(addr))
            .is_err()
        {
            return false;
        }
        done += n;
    }
    done == buf.len()
}

/// Whether guest bytes `[offset, offset + len)` are on the disk and aligned to `align`.
fn in_disk(offset: u64, len: u64, capacity: u64, align: u64) -> bool {
    offset % align == 0
        && len % align == 0
        && offset.checked_add(len).is_some_and(|end| end <= capacity)
}

/// Parses the chain `descs` (in chain order) of one request.
pub fn parse<M: GuestMemory>(mem: &M, descs: &[Desc], limits: &Limits) -> Parsed {
    // The status byte: the last byte of the last descriptor, which the device writes.
    let status = match descs.last() {
        Some(d) if d.write_only && d.len >= 1 => Some(d.addr.wrapping_add(u64::from(d.len) - 1)),
        _ => None,
    };
    let ioerr = |why: u32| refuse(status, why);
    if status.is_none() {
        return ioerr(VIRTIO_BLK_S_IOERR);
    }
    // Device-readable descriptors first, then device-writable ones: anything else is malformed.
    let split = descs
        .iter()
        .position(|d| d.write_only)
        .unwrap_or(descs.len());
    if descs[split..].iter().any(|d| !d.write_only) {
        return ioerr(VIRTIO_BLK_S_IOERR);
    }
    let (readable, writable) = descs.split_at(split);
    let in_len: u64 = readable.iter().map(|d| u64::from(d.len)).sum();
    // The writable bytes except the status byte.
    let out_len: u64 = writable.iter().map(|d| u64::from(d.len)).sum::<u64>() - 1;
    if in_len < HEADER as u64 {
        return ioerr(VIRTIO_BLK_S_IOERR);
    }
    let mut header = [0u8; HEADER];
    if !gather(mem, readable, 0, &mut header) {
        return ioerr(VIRTIO_BLK_S_IOERR);
    }
    let kind = u32::from_le_bytes(header[0..4].try_into().unwrap_or_default());
    let sector = u64::from_le_bytes(header[8..16].try_into().unwrap_or_default());
    let payload = in_len - HEADER as u64;
    let block = u64::from(limits.block_size.max(512));
    let Some(offset) = sector.checked_mul(SECTOR) else {
        return ioerr(VIRTIO_BLK_S_IOERR);
    };
    let data_segments = |n: usize| n == 0 || n > limits.max_segments;
    let request = match kind {
        VIRTIO_BLK_T_IN => {
            let data = cut(writable, 0, out_len);
            if payload != 0
                || data_segments(data.len())
                || out_len > limits.max_bytes
                || !in_disk(offset, out_len, limits.capacity, block)
            {
                return ioerr(VIRTIO_BLK_S_IOERR);
            }
            BlkRequest::Read { offset, data }
        }
        VIRTIO_BLK_T_OUT => {
            let data = cut(readable, HEADER as u64, payload);
            if limits.read_only
                || out_len != 0
                || data_segments(data.len())
                || payload > limits.max_bytes
                || !in_disk(offset, payload, limits.capacity, block)
            {
                return ioerr(VIRTIO_BLK_S_IOERR);
            }
            BlkRequest::Write { offset, data }
        }
        VIRTIO_BLK_T_FLUSH => BlkRequest::Flush,
        VIRTIO_BLK_T_GET_ID => {
            let n = out_len.min(u64::from(VIRTIO_BLK_ID_BYTES));
            if n == 0 {
                return ioerr(VIRTIO_BLK_S_IOERR);
            }
            BlkRequest::GetId {
                data: cut(writable, 0, n),
            }
        }
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
            let discard = kind == VIRTIO_BLK_T_DISCARD;
            if limits.read_only {
                return ioerr(VIRTIO_BLK_S_IOERR);
            }
            let count = payload / SEGMENT as u64;
            if payload % SEGMENT as u64 != 0
                || count == 0
                || count > limits.max_zero_segments as u64
            {
                return ioerr(VIRTIO_BLK_S_UNSUPP);
            }
            let mut ranges = Vec::with_capacity(count as usize);
            let mut unmap = true;
            for i in 0..count {
                let mut seg = [0u8; SEGMENT];
                if !gather(mem, readable, HEADER as u64 + i * SEGMENT as u64, &mut seg) {
                    return ioerr(VIRTIO_BLK_S_IOERR);
                }
                let s = u64::from_le_bytes(seg[0..8].try_into().unwrap_or_default());
                let n = u32::from_le_bytes(seg[8..12].try_into().unwrap_or_default());
                let flags = u32::from_le_bytes(seg[12..16].try_into().unwrap_or_default());
                let allowed = if discard {
                    0
                } else {
                    VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP
                };
                if flags & !allowed != 0 {
                    return ioerr(VIRTIO_BLK_S_UNSUPP);
                }
                unmap &= flags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0;
                let Some(at) = s.checked_mul(SECTOR) else {
                    return ioerr(VIRTIO_BLK_S_IOERR);
                };
                let len = u64::from(n) * SECTOR;
                if n > limits.max_zero_sectors || !in_disk(at, len, limits.capacity, SECTOR) {
                    return ioerr(VIRTIO_BLK_S_IOERR);
                }
                ranges.push((at, len));
            }
            if discard {
                BlkRequest::Discard { ranges }
            } else {
                BlkRequest::WriteZeroes { ranges, unmap }
            }
        }
        _ => return refuse(status, VIRTIO_BLK_S_UNSUPP),
    };
    Parsed {
        request: Ok(request),
        status,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    const MIB: u64 = 1 << 20;

    fn mem() -> GuestMemoryMmap<()> {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MIB as usize)]).unwrap()
    }

    fn limits() -> Limits {
        Limits {
            capacity: 64 * MIB,
            block_size: 512,
            read_only: false,
            max_segments: 4,
            max_bytes: 32 * MIB,
            max_zero_sectors: 1 << 20,
            max_zero_segments: 1,
        }
    }

    fn header(m: &GuestMemoryMmap<()>, at: u64, kind: u32, sector: u64) -> Desc {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        m.write_slice(&h, GuestAddress(at)).unwrap();
        Desc {
            addr: at,
            len: 16,
            write_only: false,
        }
    }

    fn w(addr: u64, len: u32) -> Desc {
        Desc {
            addr,
            len,
            write_only: true,
        }
    }

    fn r(addr: u64, len: u32) -> Desc {
        Desc {
            addr,
            len,
            write_only: false,
        }
    }

    #[test]
    fn a_read_takes_the_writable_bytes_before_the_status() {
        let m = mem();
        let chain = [
            header(&m, 0, VIRTIO_BLK_T_IN, 8),
            w(0x1000, 4096),
            w(0x3000, 512),
            w(0x5000, 1),
        ];
        let p = parse(&m, &chain, &limits());
        assert_eq!(p.status, Some(0x5000));
        assert_eq!(
            p.request,
            Ok(BlkRequest::Read {
                offset: 4096,
                data: vec![(0x1000, 4096), (0x3000, 512)]
            })
        );
        // The status byte may share the last data descriptor.
        let chain = [header(&m, 0, VIRTIO_BLK_T_IN, 0), w(0x1000, 513)];
        let p = parse(&m, &chain, &limits());
        assert_eq!(p.status, Some(0x1200));
        assert_eq!(
            p.request,
            Ok(BlkRequest::Read {
                offset: 0,
                data: vec![(0x1000, 512)]
            })
        );
    }

    #[test]
    fn malformed_chains_get_an_error_status_or_none() {
        let m = mem();
        let l = limits();
        let io = Err(VIRTIO_BLK_S_IOERR as u8);
        // No writable status byte: nowhere to answer.
        let p = parse(&m, &[header(&m, 0, VIRTIO_BLK_T_IN, 0), r(0x1000, 512)], &l);
        assert_eq!((p.status, p.request), (None, io.clone()));
        assert_eq!(parse(&m, &[], &l).status, None);
        // A readable descriptor after a writable one.
        let chain = [
            header(&m, 0, VIRTIO_BLK_T_OUT, 0),
            w(0x1000, 512),
            r(0x2000, 512),
            w(0x3000, 1),
        ];
        assert_eq!(parse(&m, &chain, &l).request, io);
        // A header shorter than 16 bytes.
        assert_eq!(parse(&m, &[r(0, 8), w(0x3000, 1)], &l).request, io);
        // A header outside guest memory.
        assert_eq!(parse(&m, &[r(2 * MIB, 16), w(0x3000, 1)], &l).request, io);
        // Past the end of the disk, and straddling it.
        let chain = [
            header(&m, 0, VIRTIO_BLK_T_IN, 64 * MIB / 512),
            w(0x1000, 512),
            w(0x3000, 1),
        ];
        assert_eq!(parse(&m, &chain, &l).request, io);
        let chain = [
            header(&m, 0, VIRTIO_BLK_T_IN, 64 * MIB / 512 - 1),
            w(0x1000, 1024),
            w(0x3000, 1),
        ];
        assert_eq!(parse(&m, &chain, &l).request, io);
        // A sector whose byte offset overflows.
        let chain = [
            header(&m, 0, VIRTIO_BLK_T_IN, u64::MAX / 256),
            w(0x1000, 512),
            w(0x3000, 1),
        ];
        assert_eq!(parse(&m, &chain, &l).request, io);
        // Not a multiple of the sector; too many segments; a read with data to the device.
        let chain = [
            header(&m, 0, VIRTIO_BLK_T_IN, 0),
            w(0x1000, 100),
            w(0x3000, 1),
        ];
        assert_eq!(parse(&m, &chain, &l).request, io);
        let chain: Vec<Desc> = std::iter::once(header(&m, 0, VIRTIO_BLK_T_IN, 0))
            .chain((0..5).map(|i| w(0x1000 + i * 0x1000, 512)))
            .chain(std::iter::once(w(0x9000, 1)))
            .collect();
        assert_eq!(parse(&m, &chain, &l).request, io);
        let chain = [
            header(&m, 0, VIRTIO_BLK_T_IN, 0),
            r(0x4000, 512),
            w(0x1000, 512),
            w(0x3000, 1),
        ];
        assert_eq!(parse(&m, &chain, &l).request, io);
        // A write with a writable data descriptor, and a write of nothing.
        let chain = [
            header(&m, 0, VIRTIO_BLK_T_OUT, 0),
            w(0x1000, 512),
            w(0x3000, 1),
        ];
        assert_eq!(parse(&m, &chain, &l).request, io);
        let chain = [header(&m, 0, VIRTIO_BLK_T_OUT, 0), w(0x3000, 1)];
        assert_eq!(parse(&m, &chain, &l).request, io);
        // An unknown type.
        let chain = [header(&m, 0, 77, 0), w(0x3000, 1)];
        assert_eq!(
            parse(&m, &chain, &l).request,
            Err(VIRTIO_BLK_S_UNSUPP as u8)
        );
    }

    #[test]
    fn read_only_exports_refuse_every_change_but_flush() {
        let m = mem();
        let l = Limits {
            read_only: true,
            ..limits()
        };
        let chain = [
            header(&m, 0, VIRTIO_BLK_T_OUT, 0),
            r(0x1000, 512),
            w(0x3000, 1),
        ];
        assert_eq!(parse(&m, &chain, &l).request, Err(VIRTIO_BLK_S_IOERR as u8));
        let chain = [header(&m, 0, VIRTIO_BLK_T_FLUSH, 0), w(0x3000, 1)];
        assert_eq!(parse(&m, &chain, &l).request, Ok(BlkRequest::Flush));
    }

    #[test]
    fn segment_lists_are_checked() {
        let m = mem();
        let l = limits();
        let seg = |at: u64, sector: u64, n: u32, flags: u32| {
            let mut s = [0u8; 16];
            s[0..8].copy_from_slice(&sector.to_le_bytes());
            s[8..12].copy_from_slice(&n.to_le_bytes());
            s[12..16].copy_from_slice(&flags.to_le_bytes());
            m.write_slice(&s, GuestAddress(at)).unwrap();
            r(at, 16)
        };
        let chain = [
            header(&m, 0, VIRTIO_BLK_T_WRITE_ZEROES, 0),
            seg(0x100, 8, 16, 1),
            w(0x3000, 1),
        ];
        assert_eq!(
            parse(&m, &chain, &l).request,
            Ok(BlkRequest::WriteZeroes {
                ranges: vec![(4096, 8192)],
                unmap: true
            })
        );
        let chain = [
            header(&m, 0, VIRTIO_BLK_T_DISCARD, 0),
            seg(0x100, 8, 16, 0),
            w(0x3000, 1),
        ];
        assert_eq!(
            parse(&m, &chain, &l).request,
            Ok(BlkRequest::Discard {
                ranges: vec![(4096, 8192)]
            })
        );
        // Unmap on a discard, unknown flags, two segments (max 1), a partial segment.
        let unsupp = Err(VIRTIO_BLK_S_UNSUPP as u8);
        let chain = [
            header(&m, 0, VIRTIO_BLK_T_DISCARD, 0),
            seg(0x100, 8, 16, 1),
            w(0x3000, 1),
        ];
        assert_eq!(parse(&m, &chain, &l).request, unsupp);
        let chain = [
            header(&m, 0, VIRTIO_BLK_T_WRITE_ZEROES, 0),
            seg(0x100, 8, 16, 6),
            w(0x3000, 1),
        ];
        assert_eq!(parse(&m, &chain, &l).request, unsupp);
        let chain = [
            header(&m, 0, VIRTIO_BLK_T_DISCARD, 0),
            seg(0x100, 8, 16, 0),
            seg(0x200, 64, 8, 0),
            w(0x3000, 1),
        ];
        assert_eq!(parse(&m, &chain, &l).request, unsupp);
        let chain = [
            header(&m, 0, VIRTIO_BLK_T_DISCARD, 0),
            r(0x100, 10),
            w(0x3000, 1),
        ];
        assert_eq!(parse(&m, &chain, &l).request, unsupp);
        // A segment past the end of the disk.
        let chain = [
            header(&m, 0, VIRTIO_BLK_T_DISCARD, 0),
            seg(0x100, 64 * MIB / 512, 1, 0),
            w(0x3000, 1),
        ];
        assert_eq!(parse(&m, &chain, &l).request, Err(VIRTIO_BLK_S_IOERR as u8));
    }

    #[test]
    fn get_id_writes_at_most_twenty_bytes() {
        let m = mem();
        let chain = [
            header(&m, 0, VIRTIO_BLK_T_GET_ID, 0),
            w(0x1000, 512),
            w(0x3000, 1),
        ];
        assert_eq!(
            parse(&m, &chain, &limits()).request,
            Ok(BlkRequest::GetId {
                data: vec![(0x1000, 20)]
            })
        );
    }
}

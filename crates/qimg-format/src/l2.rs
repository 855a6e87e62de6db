//! L2 table entries: standard 64-bit entries (spec §3.2) and extended 128-bit entries with a
//! subcluster bitmap (spec §4).
//!
//! Raw words become types before anyone branches on them:
//!
//! * [`L2Entry`] is the cluster part (the first word) in one of four shapes.
//! * [`ExtendedL2Entry`] adds the [`SubclusterBitmap`]; invalid bit combinations are refused
//!   when decoding.
//! * [`AnyL2Entry`] holds either kind and is the one type the rest of the code asks "what is
//!   subcluster `x`" ([`AnyL2Entry::state`]) or "which runs of subclusters are alike"
//!   ([`AnyL2Entry::runs`]). A standard entry answers as a cluster with a single subcluster, so
//!   callers never branch on the entry kind.

mod subcluster;

pub use subcluster::{
    BitmapRuns, ExtendedL2Entry, StateRuns, SubclusterBitmap, SubclusterBits, SubclusterState,
};

use crate::be::u64_at;
use crate::compressed::CompressedDescriptor;
use crate::error::{FormatError, Result};
use crate::geometry::Geometry;
pub use crate::l1::QCOW_OFLAG_COPIED;
use crate::l1::entry_offset;
use crate::units::{HostOffset, SubclusterIndex, is_multiple_of};

/// Bits of a standard descriptor holding the host cluster offset.
pub const L2E_OFFSET_MASK: u64 = 0x00FF_FFFF_FFFF_FE00;
/// Bits of a standard descriptor that must be zero (bit 0 is deliberately not included).
pub const L2E_STD_RESERVED_MASK: u64 = 0x3F00_0000_0000_01FE;
/// Bit 62: the entry is a compressed cluster descriptor.
pub const QCOW_OFLAG_COMPRESSED: u64 = 1 << 62;
/// Bit 0 of a standard v3 entry: the cluster reads as zeros.
pub const QCOW_OFLAG_ZERO: u64 = 1;

/// What an L2 decoder needs to know about the image besides the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct L2Context {
    /// Cluster size and entry kind.
    pub geometry: Geometry,
    /// The image keeps guest data in an external data file (host offset 0 is valid there).
    pub external_data_file: bool,
    /// The image is version 2, where the zero flag does not exist (bit 0 set is corruption).
    pub v2: bool,
}

impl L2Context {
    /// A version 3 image without an external data file.
    pub fn new(geometry: Geometry) -> Self {
        Self {
            geometry,
            external_data_file: false,
            v2: false,
        }
    }
}

/// The cluster part of an L2 entry (the whole entry in standard images, the first word in
/// extended ones).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum L2Entry {
    /// No host cluster; reads go to the backing file (or zeros).
    Unallocated,
    /// Standard v3 zero cluster (bit 0). With `preallocated` the host cluster stays allocated
    /// (QEMU's ZERO_ALLOC), else none (ZERO_PLAIN). Never produced for extended entries.
    Zero {
        /// Host cluster kept for the guest cluster, if any.
        preallocated: Option<HostOffset>,
        /// The COPIED flag (meaningful when preallocated).
        copied: bool,
    },
    /// Data at a host cluster.
    Normal {
        /// Host cluster offset (cluster aligned; may be 0 with an external data file).
        host: HostOffset,
        /// The COPIED flag: the host cluster may be written in place (refcount exactly 1).
        copied: bool,
    },
    /// Compressed cluster.
    Compressed(CompressedDescriptor),
}

/// Decodes a first word, with `extended` deciding whether bit 0 is ignored.
pub(crate) fn decode_word(raw: u64, ctx: &L2Context, extended: bool, at: u64) -> Result<L2Entry> {
    let geometry = ctx.geometry;
    if raw & QCOW_OFLAG_COMPRESSED != 0 {
        let refuse = |what, bits| FormatError::ReservedBits {
            what,
            offset: at,
            bits,
            value: raw,
        };
        if raw & QCOW_OFLAG_COPIED != 0 {
            return Err(refuse(
                "compressed L2 entry (COPIED flag)",
                QCOW_OFLAG_COPIED,
            ));
        }
        if ctx.external_data_file {
            return Err(refuse(
                "L2 entry of an image with an external data file (compressed flag)",
                QCOW_OFLAG_COMPRESSED,
            ));
        }
        let d = CompressedDescriptor::decode(raw, geometry.cluster_bits(), at)?;
        return Ok(L2Entry::Compressed(d));
    }
    let word = if extended {
        raw & !QCOW_OFLAG_ZERO
    } else {
        raw
    };
    let reserved = word & L2E_STD_RESERVED_MASK;
    if reserved != 0 {
        return Err(FormatError::ReservedBits {
            what: "L2 entry",
            offset: at,
            bits: reserved,
            value: raw,
        });
    }
    let zero = word & QCOW_OFLAG_ZERO != 0;
    if zero && ctx.v2 {
        return Err(FormatError::ReservedBits {
            what: "L2 entry of a version 2 image (zero flag)",
            offset: at,
            bits: QCOW_OFLAG_ZERO,
            value: raw,
        });
    }
    let host = word & L2E_OFFSET_MASK;
    if !is_multiple_of(host, geometry.cluster_size()) {
        return Err(FormatError::Unaligned {
            what: "host cluster offset in L2 entry",
            offset: at,
            value: host,
            align: geometry.cluster_size(),
        });
    }
    let copied = word & QCOW_OFLAG_COPIED != 0;
    Ok(if zero {
        L2Entry::Zero {
            preallocated: (host != 0).then_some(HostOffset(host)),
            copied,
        }
    } else if host == 0 && !(ctx.external_data_file && copied) {
        L2Entry::Unallocated
    } else {
        L2Entry::Normal {
            host: HostOffset(host),
            copied,
        }
    })
}

impl L2Entry {
    /// Decodes the first (or only) word of an L2 entry read at file offset `at`.
    ///
    /// In extended images bit 0 is ignored (never [`L2Entry::Zero`]); in v2 images it is an
    /// error. The COPIED flag of an entry without host cluster is dropped (it means nothing).
    pub fn decode(raw: u64, ctx: &L2Context, at: u64) -> Result<Self> {
        decode_word(raw, ctx, ctx.geometry.extended_l2(), at)
    }

    /// The raw 64-bit word. Host offsets outside bits 9..=55 are dropped; values built by
    /// [`L2Entry::decode`] always fit.
    pub fn encode(&self) -> u64 {
        let flag = |set: bool| if set { QCOW_OFLAG_COPIED } else { 0 };
        match *self {
            Self::Unallocated => 0,
            Self::Zero {
                preallocated,
                copied,
            } => preallocated.map_or(0, |h| h.0 & L2E_OFFSET_MASK) | QCOW_OFLAG_ZERO | flag(copied),
            Self::Normal { host, copied } => (host.0 & L2E_OFFSET_MASK) | flag(copied),
            Self::Compressed(d) => QCOW_OFLAG_COMPRESSED | d.encode(),
        }
    }

    /// The host cluster this entry owns (normal or preallocated zero cluster), if any.
    pub fn host_cluster(&self) -> Option<HostOffset> {
        match *self {
            Self::Normal { host, .. } => Some(host),
            Self::Zero { preallocated, .. } => preallocated,
            _ => None,
        }
    }

    /// The COPIED flag (always false for unallocated and compressed entries).
    pub fn copied(&self) -> bool {
        matches!(
            self,
            Self::Normal { copied: true, .. } | Self::Zero { copied: true, .. }
        )
    }

    /// The state of the cluster read as a standard entry (QEMU's `qcow2_get_cluster_type`).
    pub fn cluster_state(&self) -> SubclusterState {
        match self {
            Self::Unallocated => SubclusterState::UnallocatedPlain,
            Self::Zero {
                preallocated: Some(_),
                ..
            } => SubclusterState::ZeroAlloc,
            Self::Zero {
                preallocated: None, ..
            } => SubclusterState::ZeroPlain,
            Self::Normal { .. } => SubclusterState::Normal,
            Self::Compressed(_) => SubclusterState::Compressed,
        }
    }
}

/// Either kind of L2 entry, with one way to ask about subclusters.
///
/// A standard entry is a cluster of exactly one subcluster: [`state`](Self::state) ignores the
/// index and [`runs`](Self::runs) yields one run of count 1. Multiply run counts by
/// [`Geometry::subcluster_size`] to get bytes in either case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AnyL2Entry {
    /// A 64-bit entry of a standard image.
    Standard(L2Entry),
    /// A 128-bit entry of an image with extended L2 entries.
    Extended(ExtendedL2Entry),
}

impl AnyL2Entry {
    /// An unallocated entry (reads from the backing file, or as zeros) of the image's kind.
    pub fn unallocated(extended: bool) -> Self {
        if extended {
            Self::Extended(ExtendedL2Entry {
                entry: L2Entry::Unallocated,
                bitmap: SubclusterBitmap::default(),
            })
        } else {
            Self::Standard(L2Entry::Unallocated)
        }
    }

    /// Decodes one entry (8 or 16 bytes, per `ctx.geometry`) from the start of `bytes`, which
    /// were read at file offset `at`.
    pub fn decode(bytes: &[u8], ctx: &L2Context, at: u64) -> Result<Self> {
        let size = ctx.geometry.l2_entry_size();
        let truncated = || FormatError::Truncated {
            what: "L2 entry",
            offset: at,
            need: size,
            have: bytes.len() as u64,
        };
        let word = |i: usize| -> Result<u64> {
            let b = bytes.get(i * 8..i * 8 + 8).ok_or_else(truncated)?;
            Ok(u64::from_be_bytes(b.try_into().map_err(|_| truncated())?))
        };
        if ctx.geometry.extended_l2() {
            Ok(Self::Extended(ExtendedL2Entry::decode(
                word(0)?,
                word(1)?,
                ctx,
                at,
            )?))
        } else {
            Ok(Self::Standard(L2Entry::decode(word(0)?, ctx, at)?))
        }
    }

    /// Size of the encoded entry in bytes (8 or 16).
    pub fn encoded_len(&self) -> usize {
        match self {
            Self::Standard(_) => 8,
            Self::Extended(_) => 16,
        }
    }

    /// Appends the big-endian encoding to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        match self {
            Self::Standard(e) => out.extend_from_slice(&e.encode().to_be_bytes()),
            Self::Extended(e) => {
                let [word, bitmap] = e.encode();
                out.extend_from_slice(&word.to_be_bytes());
                out.extend_from_slice(&bitmap.to_be_bytes());
            }
        }
    }

    /// The cluster part of the entry.
    pub fn entry(&self) -> &L2Entry {
        match self {
            Self::Standard(e) => e,
            Self::Extended(e) => &e.entry,
        }
    }

    /// The subcluster bitmap, for extended entries.
    pub fn bitmap(&self) -> Option<SubclusterBitmap> {
        match self {
            Self::Standard(_) => None,
            Self::Extended(e) => Some(e.bitmap),
        }
    }

    /// The state of subcluster `sc` (the cluster's state for a standard entry).
    pub fn state(&self, sc: SubclusterIndex) -> SubclusterState {
        match self {
            Self::Standard(e) => e.cluster_state(),
            Self::Extended(e) => e.state(sc),
        }
    }

    /// Maximal runs `(first, count, state)` over the entry's subclusters.
    pub fn runs(&self) -> StateRuns {
        match self {
            Self::Standard(e) => StateRuns::single(e.cluster_state()),
            Self::Extended(e) => e.runs(),
        }
    }
}

/// Decodes a slice of an L2 table: `bytes` holds whole entries and starts at file offset
/// `base`. An error names the file offset of the entry at fault.
pub fn decode_slice(bytes: &[u8], ctx: &L2Context, base: u64) -> Result<Vec<AnyL2Entry>> {
    // l2_entry_size is 8 or 16.
    let size = ctx.geometry.l2_entry_size() as usize;
    let chunks = bytes.chunks_exact(size);
    let rest = chunks.remainder().len();
    if rest != 0 {
        return Err(FormatError::Truncated {
            what: "L2 entry",
            offset: entry_offset(base, bytes.len() - rest, 1),
            need: size as u64,
            have: rest as u64,
        });
    }
    chunks
        .enumerate()
        .map(|(i, c)| AnyL2Entry::decode(c, ctx, entry_offset(base, i, size)))
        .collect()
}

/// Encodes entries (all of one kind) into big-endian bytes.
pub fn encode_slice(entries: &[AnyL2Entry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(entries.iter().map(AnyL2Entry::encoded_len).sum());
    for e in entries {
        e.encode_into(&mut out);
    }
    out
}

/// Overwrites entry `index` of an encoded slice with `entry`.
///
/// Fails (writing nothing) if the entry does not fit inside `slice`.
pub fn write_entry(slice: &mut [u8], index: usize, entry: &AnyL2Entry) -> Result<()> {
    let size = entry.encoded_len();
    let target = index
        .checked_mul(size)
        .and_then(|start| slice.get_mut(start..start.checked_add(size)?));
    let Some(target) = target else {
        return Err(FormatError::InvalidArgument {
            what: "L2 slice index",
            value: index as u64,
            reason: format!(
                "a slice of {:#x} bytes has no entry of {size} bytes there",
                slice.len()
            ),
        });
    };
    let mut bytes = Vec::with_capacity(size);
    entry.encode_into(&mut bytes);
    target.copy_from_slice(&bytes);
    Ok(())
}

/// Sets or clears `QCOW_OFLAG_COPIED` in entry `index` of an encoded slice whose entries are
/// `entry_size` bytes (8 or 16), leaving every other bit as it is.
///
/// Fails (writing nothing) if the entry does not fit inside `slice`.
pub fn set_copied(slice: &mut [u8], index: usize, entry_size: usize, copied: bool) -> Result<()> {
    let at = index.checked_mul(entry_size);
    let Some(word) = at.and_then(|at| slice.get_mut(at..at.checked_add(8)?)) else {
        return Err(FormatError::InvalidArgument {
            what: "L2 slice index",
            value: index as u64,
            reason: format!(
                "a slice of {:#x} bytes has no entry of {entry_size} bytes there",
                slice.len()
            ),
        });
    };
    let mut w = u64_at(word, 0);
    if copied {
        w |= crate::l1::QCOW_OFLAG_COPIED;
    } else {
        w &= !crate::l1::QCOW_OFLAG_COPIED;
    }
    word.copy_from_slice(&w.to_be_bytes());
    Ok(())
}

#[cfg(test)]
mod tests;

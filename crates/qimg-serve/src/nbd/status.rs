//! Block status of a range through the whole backing chain in NBD's terms: `base:allocation`
//! flags and `qemu:allocation-depth` values from the library's walk, and the descriptors of
//! each context.

use qimg::Image;
use qimg::block_status::{Chain, DataHoles, Status};
use qimg::io::Storage;

use super::proto::{STATE_HOLE, STATE_ZERO};

/// A run of bytes with one status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    /// Bytes.
    pub len: u64,
    /// `base:allocation` flags.
    pub flags: u32,
    /// `qemu:allocation-depth`: 0 unallocated in the whole chain, 1 the top image, ...
    pub depth: u32,
}

/// Appends the status of `len` bytes at `offset` of `img` and its backing chain to `out`
/// ([`qimg::block_status`]; holes of the host file inside data clusters read as zeros).
pub(crate) async fn chain<S: Storage + 'static>(
    img: &Image<S>,
    offset: u64,
    len: u64,
    out: &mut Vec<Run>,
) -> qimg::Result<()> {
    let chain = Chain::of_image(img, DataHoles::Always)?;
    let mut runs = Vec::new();
    chain.status(offset, len, &mut runs).await?;
    let layers = chain.layers().len();
    out.extend(runs.into_iter().map(|s| Run {
        len: s.length,
        flags: if s.data { 0 } else { STATE_HOLE } | if s.zero { STATE_ZERO } else { 0 },
        depth: allocation_depth(&s, layers),
    }));
    Ok(())
}

/// The `qemu:allocation-depth` value of `s` (1: the top layer) in a chain of `layers`, as
/// QEMU's `bdrv_co_common_block_status_above` counts it: a range no layer has is 0, unless it
/// lies past the end of a shorter layer below, whose zeros count as allocated there.
fn allocation_depth(s: &Status, layers: usize) -> u32 {
    let depth = u32::try_from(s.depth).unwrap_or(u32::MAX);
    match s.present {
        true => depth.saturating_add(1),
        // Not present at `depth`, yet a layer below exists: the range is past its end (the
        // walk descends into any layer that covers it).
        false if s.depth + 1 < layers => depth.saturating_add(2),
        false => 0,
    }
}

/// `(length, value)` descriptors from `runs`, adjacent runs of one value merged.
pub(crate) fn descriptors(runs: &[Run], value: impl Fn(&Run) -> u32) -> Vec<(u64, u32)> {
    let mut out: Vec<(u64, u32)> = Vec::new();
    for r in runs {
        let v = value(r);
        match out.last_mut() {
            Some((len, last)) if *last == v => *len += r.len,
            _ => out.push((r.len, v)),
        }
    }
    out
}

/// Block status descriptors `(length, flags)` of a `qemu:dirty-bitmap:` context over
/// `[start, end)`: flag 1 over the `dirty` ranges (in order, within the span), 0 between.
pub(super) fn dirty_descriptors(dirty: &[(u64, u64)], start: u64, end: u64) -> Vec<(u64, u32)> {
    let mut out = Vec::new();
    let mut at = start;
    for &(offset, len) in dirty {
        if offset > at {
            out.push((offset - at, 0));
        }
        out.push((len, 1));
        at = offset + len;
    }
    if at < end {
        out.push((end - at, 0));
    }
    out
}

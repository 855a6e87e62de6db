//! Block status of a range through the whole backing chain: `base:allocation` flags and
//! `qemu:allocation-depth` values, computed by mapping each layer and descending into the
//! backing image for the parts the layer above leaves unallocated.

use std::future::Future;
use std::pin::Pin;

use qimg::io::Storage;
use qimg::{Backing, ExtentKind, Image};

use super::host_holes::HostFile;
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

type BoxFut<'a> = Pin<Box<dyn Future<Output = qimg::Result<()>> + Send + 'a>>;

/// Appends the status of `len` bytes at `offset` of `img` (the layer at `depth`) to `out`.
pub(crate) fn layer<'a, S: Storage + 'static>(
    img: &'a Image<S>,
    depth: u32,
    offset: u64,
    len: u64,
    out: &'a mut Vec<Run>,
) -> BoxFut<'a> {
    Box::pin(async move {
        let zero = |len| Run {
            len,
            flags: STATE_HOLE | STATE_ZERO,
            depth: 0,
        };
        let extents = img.map(offset, len).await?;
        // Opened only when a data extent needs it.
        let mut host: Option<HostFile> = None;
        for e in extents {
            let run = |flags| Run {
                len: e.length,
                flags,
                depth,
            };
            match e.kind {
                ExtentKind::Data { host_offset } => {
                    let host = host.get_or_insert_with(|| HostFile::open(img.data_path()));
                    for (len, data) in host.runs(host_offset, e.length) {
                        let flags = if data { 0 } else { STATE_ZERO };
                        out.push(Run { len, flags, depth });
                    }
                }
                ExtentKind::Compressed { .. } => out.push(run(0)),
                ExtentKind::Zero { .. } => out.push(run(STATE_HOLE | STATE_ZERO)),
                ExtentKind::Unallocated { .. } => {
                    let end = e.start + e.length;
                    match img.backing() {
                        None => out.push(zero(e.length)),
                        Some(Backing::Qcow2(below)) => {
                            let inside = end.min(below.size()).saturating_sub(e.start);
                            if inside > 0 {
                                layer(below, depth + 1, e.start, inside, out).await?;
                            }
                            if inside < e.length {
                                out.push(zero(e.length - inside));
                            }
                        }
                        Some(Backing::Raw { storage, path }) => {
                            let size =
                                storage.len().await.map_err(|source| qimg::Error::Storage {
                                    path: path.clone(),
                                    source,
                                })?;
                            let inside = end.min(size).saturating_sub(e.start);
                            if inside > 0 {
                                out.push(Run {
                                    len: inside,
                                    flags: 0,
                                    depth: depth + 1,
                                });
                            }
                            if inside < e.length {
                                out.push(zero(e.length - inside));
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    })
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

//! Block status: what each guest range of a chain is (data, zero, compressed, unallocated),
//! at which depth and host offset, reproducing QEMU's `bdrv_co_do_block_status` over
//! `qcow2_co_block_status` and file-posix.

use std::rc::Rc;

use anyhow::Result;
use qimg::ExtentKind;

use super::Layer;

/// The block status of a layer could not be read (its metadata is damaged or unreadable):
/// `why` in qemu-img's words (`Input/output error` for damage). Each command words it as
/// qemu-img does: `map` as shown here, `convert` and `compare` their own way.
#[derive(Debug)]
pub(crate) struct StatusError {
    /// Why, as qemu-img says it.
    pub(crate) why: String,
}

impl std::fmt::Display for StatusError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Could not read file metadata: {}", self.why)
    }
}

impl std::error::Error for StatusError {}

/// One line of the map, with qemu-img's fields.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    /// First guest byte.
    pub(crate) start: u64,
    /// Length in bytes.
    pub(crate) length: u64,
    /// Index in the backing chain of the image the status comes from.
    pub(crate) depth: usize,
    /// Allocated at that depth (not a read-through to zeros).
    pub(crate) present: bool,
    /// Reads as zeros.
    pub(crate) zero: bool,
    /// Holds data (possibly also reading as zeros: a hole of a preallocated file).
    pub(crate) data: bool,
    /// A compressed cluster.
    pub(crate) compressed: bool,
    /// Host offset.
    pub(crate) offset: Option<u64>,
    /// The file `offset` points into (set only with an offset, as QEMU does).
    pub(crate) file: Option<Rc<str>>,
}

/// Appends the entries of `[start, start + len)` as seen from layer `depth` down.
pub(crate) async fn status(
    layers: &[Layer],
    depth: usize,
    start: u64,
    len: u64,
    out: &mut Vec<Entry>,
) -> Result<()> {
    // Boxed: the status of an unallocated range recurses into the layer below.
    Box::pin(layer_status(layers, depth, start, len, out)).await
}

/// [`status`] of one layer, asking the layers below for its unallocated ranges.
async fn layer_status(
    layers: &[Layer],
    depth: usize,
    start: u64,
    len: u64,
    out: &mut Vec<Entry>,
) -> Result<()> {
    let entry = |start: u64, length: u64| Entry {
        start,
        length,
        depth,
        present: true,
        zero: false,
        data: false,
        compressed: false,
        offset: None,
        file: None,
    };
    match &layers[depth] {
        Layer::Raw(f) => {
            for (s, l, data) in f.runs(start, start + len) {
                out.push(Entry {
                    zero: !data,
                    data,
                    offset: Some(s),
                    file: Some(f.name.clone()),
                    ..entry(s, l)
                });
            }
        }
        Layer::Qcow2 {
            img,
            name,
            prealloc,
            l2_presence,
            ..
        } => {
            let mut extents = Vec::new();
            let runs = match l2_presence {
                Some(l2_presence) => l2_presence.runs(start, start + len),
                None => vec![(start, start + len, true)],
            };
            for (s, e, has_table) in runs {
                if has_table {
                    extents.extend(img.map(s, e - s).await.map_err(|e| {
                        let why =
                            crate::status::damage_errno_text(&e).unwrap_or_else(|| e.to_string());
                        anyhow::Error::new(StatusError { why })
                    })?);
                } else {
                    extents.push(qimg::Extent {
                        start: s,
                        length: e - s,
                        kind: ExtentKind::Unallocated { host_offset: None },
                    });
                }
            }
            for x in extents {
                match x.kind {
                    ExtentKind::Data { host_offset } => match prealloc {
                        Some(f) => {
                            for (s, l, data) in f.runs(host_offset, host_offset + x.length) {
                                out.push(Entry {
                                    zero: !data,
                                    data: true,
                                    offset: Some(s),
                                    file: Some(name.clone()),
                                    ..entry(x.start + (s - host_offset), l)
                                });
                            }
                        }
                        None => out.push(Entry {
                            data: true,
                            offset: Some(host_offset),
                            file: Some(name.clone()),
                            ..entry(x.start, x.length)
                        }),
                    },
                    ExtentKind::Zero { host_offset } => out.push(Entry {
                        zero: true,
                        offset: host_offset,
                        file: host_offset.map(|_| name.clone()),
                        ..entry(x.start, x.length)
                    }),
                    ExtentKind::Compressed { .. } => out.push(Entry {
                        data: true,
                        compressed: true,
                        ..entry(x.start, x.length)
                    }),
                    ExtentKind::Unallocated { host_offset } => {
                        let end = x.start + x.length;
                        let below = match layers.get(depth + 1) {
                            Some(b) => b.size().clamp(x.start, end),
                            None => x.start,
                        };
                        if below > x.start {
                            status(layers, depth + 1, x.start, below - x.start, out).await?;
                        }
                        if end > below {
                            let offset = host_offset.map(|h| h + (below - x.start));
                            out.push(Entry {
                                present: false,
                                zero: true,
                                offset,
                                file: offset.map(|_| name.clone()),
                                ..entry(below, end - below)
                            });
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

//! Block status in qemu-img's terms: the library's walk ([`qimg::block_status`]) with each
//! entry naming its file, and its failure in qemu-img's words.

use std::rc::Rc;

use anyhow::Result;

use super::Layers;

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

impl Layers {
    /// Appends the entries of `[start, start + len)` of the top layer to `out`
    /// ([`qimg::block_status::Chain::status`]), each naming its layer's file.
    pub(crate) async fn status(&self, start: u64, len: u64, out: &mut Vec<Entry>) -> Result<()> {
        let mut runs = Vec::new();
        self.chain
            .status(start, len, &mut runs)
            .await
            .map_err(|e| {
                let why = crate::status::damage_errno_text(&e).unwrap_or_else(|| e.to_string());
                anyhow::Error::new(StatusError { why })
            })?;
        out.extend(runs.into_iter().map(|s| Entry {
            start: s.start,
            length: s.length,
            depth: s.depth,
            present: s.present,
            zero: s.zero,
            data: s.data,
            compressed: s.compressed,
            offset: s.offset,
            file: s.offset.map(|_| self.names[s.depth].clone()),
        }));
        Ok(())
    }
}

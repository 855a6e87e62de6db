//! Holes of the host file inside data clusters ([`qimg::io::holes`]): the parts of a data
//! cluster never written read as zeros, and qemu-nbd reports them as `NBD_STATE_ZERO`.
//!
//! Only a hint: when the file cannot be opened or the file system cannot tell, everything
//! is data.

use std::fs::File;
use std::path::Path;

/// The file holding the data extents of one layer.
#[derive(Debug)]
pub(crate) struct HostFile(Option<File>);

impl HostFile {
    /// Opens `path` read-only; a file that cannot be opened answers "all data".
    pub(crate) fn open(path: &Path) -> Self {
        Self(File::open(path).ok())
    }

    /// Splits `len` bytes at host `offset` into `(length, is_data)` runs.
    pub(crate) fn runs(&self, offset: u64, len: u64) -> Vec<(u64, bool)> {
        match &self.0 {
            None => vec![(len, true)],
            Some(file) => qimg::io::holes::runs(file, offset, offset.saturating_add(len), false)
                .into_iter()
                .map(|r| (r.len, r.data))
                .collect(),
        }
    }
}

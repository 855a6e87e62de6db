//! A file whose data extents and holes the file system reports (`SEEK_DATA`/`SEEK_HOLE`, as
//! QEMU's file-posix block status): a raw layer, or the host file of a metadata-preallocated
//! qcow2 image.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use anyhow::{Result, anyhow};

use crate::status::os_msg;

/// A file whose data extents and holes are asked from the file system.
pub(crate) struct HostFile {
    /// `None` for an NBD export.
    file: Option<File>,
    /// The NBD export, whose block status (when the server offers it) tells holes.
    nbd: Option<std::sync::Arc<qimg::io::NbdStorage>>,
    pub(super) path: PathBuf,
    /// Drop cached pages of a range before asking for its holes (metadata-preallocated qcow2
    /// files, whose metadata this process reads).
    pub(super) drop_cache: bool,
    /// The file's name as messages and the map show it.
    pub(super) name: Rc<str>,
    /// The file length in bytes.
    pub(super) len: u64,
}

impl HostFile {
    pub(super) fn open(path: &Path, name: Rc<str>) -> Result<Self> {
        if let Some(uri) = path.to_str().filter(|p| qimg::io::nbd::is_nbd_name(p)) {
            if let Ok(Some(addr)) = qimg::io::nbd::NbdAddress::parse(uri) {
                let nbd = qimg::io::NbdStorage::shared(uri, false)
                    .map_err(|e| anyhow!("Could not open '{name}': {e}"))?;
                // The map names the export as QEMU writes it back.
                let name = Rc::from(addr.to_string());
                return Ok(Self {
                    file: None,
                    path: path.to_path_buf(),
                    drop_cache: false,
                    name,
                    len: nbd.size(),
                    nbd: Some(nbd),
                });
            }
        }
        let file =
            File::open(path).map_err(|e| anyhow!("Could not open '{name}': {}", os_msg(&e)))?;
        let len = file
            .metadata()
            .map_err(|e| anyhow!("Could not stat '{name}': {}", os_msg(&e)))?
            .len();
        Ok(Self {
            file: Some(file),
            path: path.to_path_buf(),
            drop_cache: false,
            name,
            len,
            nbd: None,
        })
    }

    /// Splits `[start, end)` into (start, length, is_data) runs, as file-posix's block status
    /// does ([`qimg::io::holes::runs`] for a file; an export's block status for NBD).
    pub(super) fn runs(&self, start: u64, end: u64) -> Vec<(u64, u64, bool)> {
        let Some(file) = &self.file else {
            let data_end = end.min(self.len).max(start);
            // The server's block status; without it everything is data, as QEMU assumes.
            let status = self
                .nbd
                .as_ref()
                .and_then(|n| n.block_status(start, data_end - start).ok().flatten());
            if let Some(runs) = status {
                let mut out: Vec<(u64, u64, bool)> = Vec::new();
                let mut at = start;
                for (len, flags) in runs {
                    let data = flags & qimg::io::nbd::STATE_HOLE == 0;
                    match out.last_mut() {
                        Some(last) if last.2 == data => last.1 += len,
                        _ => out.push((at, len, data)),
                    }
                    at += len;
                }
                if end > at {
                    out.push((at, end - at, false));
                }
                return out;
            }
            let mut out = vec![(start, data_end - start, true)];
            if end > data_end {
                out.push((data_end, end - data_end, false));
            }
            out.retain(|r| r.1 > 0);
            return out;
        };
        qimg::io::holes::runs(file, start, end, self.drop_cache)
            .into_iter()
            .map(|r| (r.start, r.len, r.data))
            .collect()
    }
}

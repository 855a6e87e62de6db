//! Holes of the host file inside data clusters, from the file system (`SEEK_DATA`,
//! `SEEK_HOLE`), as QEMU's file-posix block status finds them: the parts of a data cluster
//! never written (copy-on-write regions QEMU zeroed with fallocate, the tail of a cluster
//! written partly) read as zeros, and qemu-nbd reports them as `NBD_STATE_ZERO`.
//!
//! Only a hint: when the file cannot be opened or the file system cannot tell, everything
//! is data.

use std::fs::File;
use std::path::Path;

use nix::errno::Errno;
use nix::unistd::{Whence, lseek};

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
        let Some(file) = &self.0 else {
            return vec![(len, true)];
        };
        let end = offset.saturating_add(len);
        let mut out: Vec<(u64, bool)> = Vec::new();
        let mut push = |n: u64, data: bool| match out.last_mut() {
            Some(last) if last.1 == data => last.0 += n,
            _ if n > 0 => out.push((n, data)),
            _ => {}
        };
        let mut pos = offset;
        while pos < end {
            let Ok(at) = i64::try_from(pos) else {
                push(end - pos, true);
                break;
            };
            match lseek(file, at, Whence::SeekData) {
                // No data after `pos`: the rest is a hole.
                Err(Errno::ENXIO) => {
                    push(end - pos, false);
                    break;
                }
                Err(_) => {
                    push(end - pos, true);
                    break;
                }
                Ok(d) if (d as u64) > pos => {
                    let d = (d as u64).min(end);
                    push(d - pos, false);
                    pos = d;
                }
                Ok(_) => {
                    let h = match lseek(file, at, Whence::SeekHole) {
                        Ok(h) if (h as u64) > pos => (h as u64).min(end),
                        _ => end,
                    };
                    push(h - pos, true);
                    pos = h;
                }
            }
        }
        out
    }
}

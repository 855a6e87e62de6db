//! The data extents and holes of a file as its storage reports them: `SEEK_DATA`/`SEEK_HOLE`
//! for a host file ([`qimg_io::holes::runs`], QEMU's file-posix block status), the server's
//! `base:allocation` for an NBD export.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use qimg_io::NbdStorage;
use qimg_io::nbd::STATE_HOLE;

use crate::error::{Error, Result};

/// A file (or NBD export) whose holes a walk asks its storage for.
#[derive(Debug)]
pub struct HostExtents {
    source: Source,
    path: PathBuf,
    len: u64,
    /// Where byte 0 lies in the file (raw's `offset`: a window, [`qimg_io::window`]).
    shift: u64,
    /// Drop cached pages of a range before asking for its holes.
    drop_cache: bool,
}

#[derive(Debug)]
enum Source {
    File(File),
    Nbd(Arc<NbdStorage>),
    /// QEMU's null device: no data anywhere.
    Null,
}

impl HostExtents {
    /// Opens `path` read-only: a file, or an NBD export named by its URI (`nbd://`,
    /// `nbd+unix://`, ...). Errors: [`Error::Io`] for a file that does not open (or whose
    /// length cannot be read), [`Error::Storage`] for an export that cannot be reached.
    pub fn open(path: &Path) -> Result<Self> {
        if let Some(null) = crate::chain::null_device(path) {
            return Ok(Self {
                len: null.size,
                source: Source::Null,
                path: path.to_path_buf(),
                shift: 0,
                drop_cache: false,
            });
        }
        if let Some(nbd) = crate::chain::nbd_export(path)? {
            return Ok(Self {
                len: nbd.size(),
                source: Source::Nbd(nbd),
                shift: 0,
                path: path.to_path_buf(),
                drop_cache: false,
            });
        }
        let io = |op: &str| {
            let path = path.to_path_buf();
            let op = op.to_string();
            move |source| Error::Io { path, op, source }
        };
        let file = File::open(path).map_err(io("open"))?;
        let mut len = file.metadata().map_err(io("stat"))?.len();
        let mut shift = 0;
        if let Some(w) = qimg_io::window::attached(path) {
            shift = w.offset;
            len = w.size.unwrap_or(len.saturating_sub(w.offset));
        }
        Ok(Self {
            source: Source::File(file),
            path: path.to_path_buf(),
            len,
            shift,
            drop_cache: false,
        })
    }

    /// Drop the clean cached pages of each range before asking for its holes (see
    /// [`qimg_io::holes::runs`]): for the host file of a metadata-preallocated image, whose
    /// metadata this process reads.
    pub fn drop_cache(mut self, drop: bool) -> Self {
        self.drop_cache = drop;
        self
    }

    /// The name it was opened with.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where its byte 0 lies in the file (raw's `offset`; 0 but for a window).
    pub fn shift(&self) -> u64 {
        self.shift
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether it is an NBD export.
    pub fn is_nbd(&self) -> bool {
        matches!(self.source, Source::Nbd(_))
    }

    /// Splits `[start, end)` into `(start, length, is_data)` runs, adjacent runs of one kind
    /// merged. Past the end: a hole. An export without block status is all data up to its
    /// end, as QEMU assumes.
    pub fn runs(&self, start: u64, end: u64) -> Vec<(u64, u64, bool)> {
        let nbd = match &self.source {
            Source::File(file) => {
                let shift = self.shift;
                return qimg_io::holes::runs(file, start + shift, end + shift, self.drop_cache)
                    .into_iter()
                    .map(|r| (r.start - shift, r.len, r.data))
                    .collect();
            }
            Source::Nbd(nbd) => nbd,
            Source::Null if end <= start => return Vec::new(),
            Source::Null => return vec![(start, end - start, false)],
        };
        let data_end = end.min(self.len).max(start);
        let runs: Vec<(u64, bool)> = match nbd.block_status(start, data_end - start) {
            Ok(Some(runs)) => runs
                .into_iter()
                .map(|(len, flags)| (len, flags & STATE_HOLE == 0))
                .collect(),
            _ => vec![(data_end - start, true)],
        };
        let mut out: Vec<(u64, u64, bool)> = Vec::new();
        let mut at = start;
        for (len, data) in runs {
            match out.last_mut() {
                Some(last) if last.2 == data => last.1 += len,
                _ if len > 0 => out.push((at, len, data)),
                _ => {}
            }
            at += len;
        }
        if end > at {
            match out.last_mut() {
                Some(last) if !last.2 => last.1 += end - at,
                _ => out.push((at, end - at, false)),
            }
        }
        out
    }
}

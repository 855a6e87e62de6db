//! Backing chains: format probing, resolution of the file names an image stores (backing
//! files, external data files), and the one limit on chain depth. The engine opens chains
//! with these; the tools (`info`, `create`, `convert`) inspect chains with them.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use qimg_format::extensions::Cluster0;
use qimg_format::header;
use qimg_format::validate::{OpenMode, validate_cluster0};

use crate::error::{Error, Result};

/// Image formats qimg can open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageFormat {
    /// qcow2.
    Qcow2,
    /// A raw disk image.
    Raw,
}

impl ImageFormat {
    /// The format named `name` (`qcow2` or `raw`), as a backing format or `-f` option gives it.
    pub fn from_name(name: &[u8]) -> Option<Self> {
        match name {
            b"qcow2" => Some(Self::Qcow2),
            b"raw" => Some(Self::Raw),
            _ => None,
        }
    }

    /// The qemu-img name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Qcow2 => "qcow2",
            Self::Raw => "raw",
        }
    }
}

/// Largest cluster 0 (2 MiB clusters).
pub(crate) const MAX_CLUSTER0: u64 = 2 << 20;

/// Bytes read first from the start of an image: every header and header extension QEMU or
/// qimg writes fits.
pub(crate) const HEADER_HEAD: u64 = 4096;

/// How many bytes from the start of the file are cluster 0, given its first bytes (at least
/// [`HEADER_HEAD`] of them, or the whole file): the header's cluster size; `None` when the
/// header does not decode to a usable one (the caller reads up to [`MAX_CLUSTER0`] bytes).
/// Reading only the cluster keeps a small image's data out of the page cache (where it
/// would turn unwritten extents into data for `SEEK_DATA`, and so `qemu-img map`'s answers).
pub(crate) fn cluster0_len(head: &[u8]) -> Option<u64> {
    qimg_format::header::Header::decode(head)
        .ok()
        .and_then(|h| h.cluster_size())
        .filter(|&c| (512..=MAX_CLUSTER0).contains(&c))
}

/// The bytes of cluster 0 of an image in `file` (`len` bytes long): its header first, then
/// the rest of the cluster that header names ([`cluster0_len`]), zeros past the end of the
/// file; without a usable cluster size, up to [`MAX_CLUSTER0`] bytes. The engine's open and
/// `check` read cluster 0 through this (the path-based reader is [`read_cluster0`]).
pub(crate) async fn cluster0_bytes<S: qimg_io::Storage>(
    file: &S,
    len: u64,
) -> std::result::Result<Vec<u8>, qimg_io::StorageError> {
    let head = len.clamp(512, HEADER_HEAD) as usize;
    let mut bytes = vec![0u8; head];
    file.read_at_zero_fill(&mut bytes, 0).await?;
    let want = match cluster0_len(&bytes) {
        Some(cs) => cs,
        None => len.min(MAX_CLUSTER0).max(head as u64),
    } as usize;
    if want > head {
        bytes.resize(want, 0);
        if len > head as u64 {
            file.read_at_zero_fill(&mut bytes[head..], head as u64)
                .await?;
        }
    } else {
        bytes.truncate(want);
    }
    Ok(bytes)
}

/// Most images in a backing chain below the opened one, for every walk down a chain (open,
/// `info --backing-chain`, create's size probe). QEMU has no fixed limit; a chain deeper than
/// this is almost certainly a loop through differently spelled names.
pub const MAX_CHAIN_DEPTH: usize = 64;

pub(crate) fn open(path: &Path) -> Result<File> {
    File::open(path).map_err(|e| Error::io(path, "open", e))
}

pub(crate) fn read_at_most(file: &File, path: &Path, offset: u64, len: u64) -> Result<Vec<u8>> {
    let flen = file
        .metadata()
        .map_err(|e| Error::io(path, "stat", e))?
        .len();
    let n = len.min(flen.saturating_sub(offset));
    let mut buf = vec![0u8; n as usize];
    file.read_exact_at(&mut buf, offset)
        .map_err(|e| Error::io(path, format!("read {n} bytes at {offset:#x}"), e))?;
    Ok(buf)
}

/// An NBD export, when `path` is an NBD name (`nbd://...`).
pub(crate) fn nbd_export(path: &Path) -> Result<Option<std::sync::Arc<qimg_io::NbdStorage>>> {
    let Some(name) = path.to_str().filter(|n| qimg_io::nbd::is_nbd_name(n)) else {
        return Ok(None);
    };
    qimg_io::NbdStorage::shared(name, false)
        .map(Some)
        .map_err(|e| Error::storage(path, e))
}

/// The null device `path` names (`null-co://`, QEMU's `null-co` driver), if it names one.
pub fn null_device(path: &Path) -> Option<qimg_io::NullOptions> {
    path.to_str().and_then(qimg_io::null::parse_name)
}

/// Up to `len` bytes from `offset` of the file or NBD export `path` names.
fn read_prefix(path: &Path, offset: u64, len: u64) -> Result<Vec<u8>> {
    if let Some(null) = null_device(path) {
        // What a probe of QEMU's null device sees: nothing but zeros (raw).
        return Ok(vec![0; len.min(null.size.saturating_sub(offset)) as usize]);
    }
    if let Some(nbd) = nbd_export(path)? {
        let mut buf = vec![0u8; len.min(nbd.size().saturating_sub(offset)) as usize];
        let n = nbd
            .read_blocking(&mut buf, offset)
            .map_err(|e| Error::storage(path, e))?;
        buf.truncate(n);
        return Ok(buf);
    }
    let f = open(path)?;
    read_at_most(&f, path, offset, len)
}

/// Guesses the format of an image from its first bytes: qcow2 when they have the magic and a
/// version other than 0 ([`header::probes_as_qcow2`]), else raw.
pub fn probe_format(path: &Path) -> Result<ImageFormat> {
    let b = read_prefix(path, 0, 8)?;
    Ok(if header::probes_as_qcow2(&b) {
        ImageFormat::Qcow2
    } else {
        ImageFormat::Raw
    })
}

/// The virtual size of an image of the given format.
pub fn virtual_size_of(path: &Path, fmt: ImageFormat) -> Result<u64> {
    if let (ImageFormat::Raw, Some(null)) = (fmt, null_device(path)) {
        return Ok(null.size);
    }
    if let (ImageFormat::Raw, Some(w)) = (fmt, qimg_io::window::attached(path)) {
        // A window onto the file (raw's `offset` and `size`).
        if let Some(size) = w.size {
            return Ok(size);
        }
        let len = open(path)?
            .metadata()
            .map_err(|e| Error::io(path, "stat", e))?
            .len();
        return Ok(len.saturating_sub(w.offset));
    }
    match fmt {
        ImageFormat::Raw => match nbd_export(path)? {
            Some(nbd) => Ok(nbd.size()),
            None => Ok(open(path)?
                .metadata()
                .map_err(|e| Error::io(path, "stat", e))?
                .len()),
        },
        ImageFormat::Qcow2 => Ok(read_cluster0(path, OpenMode::ReadOnly)?.header.size),
    }
}

/// Reads and validates cluster 0 of a qcow2 image.
pub fn read_cluster0(path: &Path, mode: OpenMode) -> Result<Cluster0> {
    let head = read_prefix(path, 0, HEADER_HEAD)?;
    let cs = cluster0_len(&head);
    let want = cs.unwrap_or(MAX_CLUSTER0);
    let mut bytes = if want as usize > head.len() && head.len() as u64 == HEADER_HEAD {
        read_prefix(path, 0, want)?
    } else {
        head
    };
    // QEMU reads past EOF as zeros; a short file still has a (zero) end marker.
    if let Some(cs) = cs {
        bytes.resize(cs as usize, 0);
    }
    validate_cluster0(&bytes, mode).map_err(|e| Error::format(path, e))
}

/// Resolves a backing file name relative to the directory of the image that names it, as
/// QEMU does (`path_combine`); an NBD name (`nbd://...`, `nbd+unix:///...`) is not a path
/// and stays as it is.
pub fn resolve_backing(image: &Path, backing: &str) -> PathBuf {
    let b = Path::new(backing);
    if b.is_absolute() || qimg_io::nbd::is_nbd_name(backing) {
        return b.to_path_buf();
    }
    match image.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.join(b),
        _ => b.to_path_buf(),
    }
}

/// Where the external data file named `name` in `image` is. QEMU resolves the name against
/// the current directory (unlike backing file names); qimg does too, and when nothing is
/// there, tries the image's directory, so an image and its data file can move together.
pub fn data_file_path(image: &Path, name: &str) -> PathBuf {
    let as_qemu = PathBuf::from(name);
    if as_qemu.exists() {
        return as_qemu;
    }
    let beside = resolve_backing(image, name);
    if beside.exists() { beside } else { as_qemu }
}

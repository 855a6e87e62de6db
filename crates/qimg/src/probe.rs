//! What an image is, read from a descriptor the caller holds (a VMM that opened the disk
//! itself and routes qcow2 images with extended L2 entries to qimg), without opening its
//! backing chain or taking a lock.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use qimg_format::cluster0::Cluster0;
use qimg_format::header::has_magic;

use crate::error::{Error, Result};

/// Cluster 0 is at most this long (2 MiB clusters).
const MAX_CLUSTER0: usize = 2 << 20;

/// Alignment of the probe's reads, in memory, offset and length: enough for `O_DIRECT` on
/// any device qimg supports (logical blocks up to 4 KiB).
const DIRECT_ALIGN: usize = 4096;

/// The header facts of a qcow2 image.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ImageProbe {
    /// qcow2 version (2 or 3).
    pub version: u32,
    /// Bytes per cluster.
    pub cluster_size: u64,
    /// Extended L2 entries (subcluster allocation).
    pub extended_l2: bool,
    /// Virtual disk size in bytes.
    pub size: u64,
    /// The backing file name stored in the image, as stored.
    pub backing_file: Option<String>,
    /// The backing file's format, when the image names it.
    pub backing_format: Option<String>,
    /// The external data file's name, when the image has one.
    pub data_file: Option<String>,
}

/// Reads the header of the image in `file`: `Ok(None)` when it is not a qcow2 image (no
/// qcow2 magic: a raw disk), an error when it is one qimg cannot read (the error names the
/// field and offset). Reads at most cluster 0 with `pread`; the file position is not moved.
pub fn probe(file: &File) -> Result<Option<ImageProbe>> {
    let name = Path::new("(probed descriptor)");
    let len = file
        .metadata()
        .map_err(|e| Error::io(name, "stat", e))?
        .len();
    // Whole aligned blocks into aligned memory: a VMM's descriptor may be `O_DIRECT`.
    let want = usize::try_from(len)
        .unwrap_or(MAX_CLUSTER0)
        .min(MAX_CLUSTER0)
        .next_multiple_of(DIRECT_ALIGN);
    if want == 0 {
        return Ok(None);
    }
    let mut bytes = qimg_io::AlignedBuf::zeroed(want, DIRECT_ALIGN).ok_or_else(|| {
        let e = std::io::Error::from(std::io::ErrorKind::OutOfMemory);
        Error::io(name, "allocate the header buffer", e)
    })?;
    let mut done = 0;
    while done < want {
        match file.read_at(&mut bytes[done..], done as u64) {
            Ok(0) => break,
            Ok(n) => {
                done += n;
                // The end of the file (a short block): nothing more to read, and an
                // `O_DIRECT` read from an unaligned position would fail.
                if n % DIRECT_ALIGN != 0 {
                    break;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io(name, "read the header", e)),
        }
    }
    let bytes = &bytes[..done];
    if !has_magic(bytes) {
        return Ok(None);
    }
    let c0 = Cluster0::decode(bytes).map_err(|e| Error::format(name, e))?;
    let h = &c0.header;
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    Ok(Some(ImageProbe {
        version: h.version,
        cluster_size: 1u64 << h.cluster_bits,
        extended_l2: h.extended_l2(),
        size: h.size,
        backing_file: c0.backing_file.as_deref().map(text),
        backing_format: c0.backing_format().map(text),
        data_file: c0.data_file().map(text),
    }))
}

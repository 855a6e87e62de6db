//! The images a command reads, opened as a chain of layers, and what a walk over them needs:
//! the format of a source (named or probed), each layer's files and virtual size, and its
//! block status ([`block_status`]). `map` prints that status; `convert` plans its copy from it.

mod block_status;
mod host_file;
mod l2_presence;
mod prealloc;

use std::path::{Path, PathBuf};
use std::rc::Rc;

use anyhow::{Result, anyhow, bail};
use qimg::chain::{ImageFormat, probe_format, read_cluster0};
use qimg::format::validate::OpenMode;
use qimg::io::AnyStorage;
use qimg::{Backing, Image};

pub(crate) use block_status::{Entry, StatusError, status};
use host_file::HostFile;
use l2_presence::L2Presence;
use prealloc::metadata_preallocated;

use crate::args::{image_format, split_opts};
use crate::status::lib_msg;

/// QEMU's sector: a raw image's virtual size is its file length rounded up to it.
const SECTOR_SIZE: u64 = 512;

/// The virtual size QEMU gives a raw file of `len` bytes.
pub(crate) fn raw_virtual_size(len: u64) -> u64 {
    len.next_multiple_of(SECTOR_SIZE)
}

/// Reads `buf.len()` bytes of a raw file at `at`, zeros past its end.
pub(crate) fn read_raw(f: &std::fs::File, buf: &mut [u8], at: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    buf.fill(0);
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], at + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The format of source `file`: the one `-f` names (`named`), or else the probed one; errors
/// are worded as qemu-img's "Could not open" for a source image.
pub(crate) fn source_format(path: &Path, file: &str, named: Option<&str>) -> Result<ImageFormat> {
    let given = crate::image_spec::format_for(file);
    match named.or(given.as_deref()) {
        Some(name) => image_format(name)
            .ok_or_else(|| anyhow!("Could not open '{file}': Unknown driver '{name}'")),
        // A file that is not there in qemu-img's words (`open_msg`).
        None => probe_format(path).map_err(|e| {
            crate::status::open_msg(
                anyhow!("Could not open '{file}': {}", lib_msg(&e, file)),
                file,
            )
        }),
    }
}

/// qemu-img's warning when the format of `file` was probed (neither `named` nor given by the
/// filename itself) and the probe guessed raw; `None` otherwise.
pub(crate) fn raw_probe_warning(
    file: &str,
    named: Option<&str>,
    fmt: ImageFormat,
) -> Option<String> {
    let probed = named.is_none() && crate::image_spec::format_for(file).is_none();
    (probed && fmt == ImageFormat::Raw).then(|| {
        format!(
            "WARNING: Image format was not specified for '{file}' and probing guessed raw.\n         \
             Automatically detecting the format is dangerous for raw images, write operations on block 0 will be restricted.\n         \
             Specify the 'raw' format explicitly to remove the restrictions."
        )
    })
}

/// One image of the chain, with what the walk needs from it.
pub(crate) enum Layer {
    /// A qcow2 image.
    Qcow2 {
        /// The open image.
        img: Image<AnyStorage>,
        /// Its external data file, if any.
        data_file: Option<PathBuf>,
        /// Name of the file host offsets point into (data file or image file).
        name: Rc<str>,
        /// The host file, when the image is metadata-preallocated (holes read as zeros).
        prealloc: Option<HostFile>,
        /// Which L1 entries have an L2 table, to skip the ranges of empty entries without a
        /// lookup per cluster (`None` if the L1 table could not be read: every range is then
        /// looked up).
        l2_presence: Option<L2Presence>,
    },
    /// A raw image.
    Raw(HostFile),
}

impl Layer {
    /// The files this layer reads (the image file and its data file, if any).
    pub(crate) fn files(&self) -> Vec<PathBuf> {
        match self {
            Layer::Qcow2 { img, data_file, .. } => {
                let mut v = vec![img.path().to_path_buf()];
                v.extend(data_file.clone());
                v
            }
            Layer::Raw(f) => vec![f.path.clone()],
        }
    }

    /// The virtual size as QEMU sees it (raw files round up to 512 bytes).
    pub(crate) fn size(&self) -> u64 {
        match self {
            Layer::Qcow2 { img, .. } => img.size(),
            Layer::Raw(f) => raw_virtual_size(f.len),
        }
    }
}

/// Opens the image and lists the layers of its chain, top first.
pub(crate) async fn open_chain(
    path: &Path,
    file: &str,
    fmt: ImageFormat,
    force_share: bool,
) -> Result<Vec<Layer>> {
    // A file that is not there (or cannot be reached) in qemu-img's words.
    if !path.to_str().is_some_and(qimg::io::nbd::is_nbd_name) {
        if let Err(e) = std::fs::metadata(path) {
            return Err(crate::status::open_msg(
                anyhow!("Could not open '{file}': {}", crate::status::os_msg(&e)),
                file,
            ));
        }
    }
    if fmt == ImageFormat::Raw {
        return Ok(vec![Layer::Raw(HostFile::open(path, Rc::from(file))?)]);
    }
    let opts = crate::image_spec::options_for(path)
        .clean_timer(false)
        .force_share(force_share);
    let img = opts
        .open(path)
        .await
        .map_err(|e| anyhow!("Could not open '{file}': {}", lib_msg(&e, file)))?;
    let mut layers = Vec::new();
    let mut next = Some(img);
    while let Some(img) = next.take() {
        let c0 = read_cluster0(img.path(), OpenMode::ReadOnly)?;
        let data_file = c0
            .data_file()
            .map(|n| String::from_utf8_lossy(n).into_owned());
        let (name, host_path): (Rc<str>, PathBuf) = match &data_file {
            Some(n) => (
                Rc::from(n.as_str()),
                qimg::chain::resolve_backing(img.path(), n),
            ),
            None => (
                Rc::from(img.path().display().to_string().as_str()),
                img.path().to_path_buf(),
            ),
        };
        let data_file = data_file.map(|_| host_path.clone());
        let prealloc = if metadata_preallocated(img.path()) {
            let mut host = HostFile::open(&host_path, name.clone())?;
            host.drop_cache = true;
            Some(host)
        } else {
            None
        };
        let below = match img.backing() {
            Some(Backing::Qcow2(b)) => {
                next = Some(b.clone());
                None
            }
            Some(Backing::Raw { path, .. }) => Some(HostFile::open(
                path,
                Rc::from(path.display().to_string().as_str()),
            )?),
            None => None,
        };
        let l2_presence = L2Presence::read(img.path());
        layers.push(Layer::Qcow2 {
            img,
            data_file,
            l2_presence,
            name,
            prealloc,
        });
        if let Some(raw) = below {
            layers.push(Layer::Raw(raw));
        }
    }
    Ok(layers)
}

/// `-l`'s value: `NAME_OR_ID`, or `snapshot.id=ID` and/or `snapshot.name=NAME`.
pub(crate) fn snapshot_param(v: &str) -> Result<(Option<String>, Option<String>)> {
    if !v.starts_with("snapshot.") {
        return Ok((Some(v.to_string()), Some(v.to_string())));
    }
    let (mut id, mut name) = (None, None);
    for pair in split_opts(v) {
        match pair.split_once('=') {
            Some(("snapshot.id", i)) => id = Some(i.to_string()),
            Some(("snapshot.name", n)) => name = Some(n.to_string()),
            _ => {
                let key = pair.split('=').next().unwrap_or_default();
                bail!(
                    "Invalid parameter '{key}'\n{}: Failed in parsing snapshot param '{v}'",
                    crate::status::program()
                );
            }
        }
    }
    Ok((id, name))
}

/// `-l`: the top image shows the snapshot, for its block status too (whose shortcut over
/// empty L1 entries, read from the file's active table, no longer applies).
pub(crate) async fn view_snapshot(
    layers: &mut [Layer],
    (id, name): &(Option<String>, Option<String>),
) -> Result<()> {
    match layers.first_mut() {
        Some(Layer::Qcow2 {
            img, l2_presence, ..
        }) => {
            load_snapshot(img, id, name).await?;
            *l2_presence = None;
            Ok(())
        }
        _ => bail!("Failed to load snapshot: raw images have no snapshots"),
    }
}

/// Shows snapshot `id`/`name` in place of `img`'s disk, in qemu-img's words when there is none.
pub(crate) async fn load_snapshot(
    img: &Image<AnyStorage>,
    id: &Option<String>,
    name: &Option<String>,
) -> Result<()> {
    match img.view_snapshot(id.as_deref(), name.as_deref()).await {
        Ok(()) => Ok(()),
        Err(qimg::Error::SnapshotNotFound { .. }) => {
            bail!("Failed to load snapshot: Can't find snapshot")
        }
        Err(e) => bail!("Failed to load snapshot: {e}"),
    }
}

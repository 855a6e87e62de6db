//! The images a command reads, opened as a chain of layers, and what a walk over them needs:
//! the format of a source (named or probed), each layer's files and virtual size, and its
//! block status ([`block_status`]). `map` prints that status; `convert` plans its copy from it.

mod block_status;

use std::path::{Path, PathBuf};
use std::rc::Rc;

use anyhow::{Result, anyhow, bail};
use qimg::Image;
use qimg::chain::{ImageFormat, probe_format, read_cluster0};
use qimg::format::validate::OpenMode;
use qimg::io::AnyStorage;

pub(crate) use block_status::{Entry, StatusError};
pub(crate) use qimg::block_status::Layer;
use qimg::block_status::{Chain, DataHoles, HostExtents};

use crate::args::{image_format, split_opts};
use crate::status::lib_msg;

use qimg::block_status::SECTOR_SIZE;

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

/// Why [`format_of`] found no format.
pub(crate) enum FormatError {
    /// The named driver is not one qimg has.
    UnknownDriver(String),
    /// The file could not be read to probe it.
    Probe(qimg::Error),
    /// The named driver does not take this name (the null driver, a file).
    Refused(String),
}

/// The format of image `file` (at `path`): the one `-f` names (`named`), else the one its
/// `json:` or `--image-opts` name gives, else the probed one. The one rule every command
/// uses; each words the failure its tool's way ([`source_format`] as qemu-img does). A qcow2
/// image's `encrypt.*` options are checked here too
/// ([`encryption_refusal`](crate::encryption::encryption_refusal)); `needs_key` is false
/// only for `info`, which QEMU lets show an encrypted image without its key.
pub(crate) fn format_of(
    path: &Path,
    file: &str,
    named: Option<&str>,
    needs_key: bool,
) -> std::result::Result<ImageFormat, FormatError> {
    let format = format_without_key(path, file, named)?;
    if format != ImageFormat::Qcow2 {
        return Ok(format);
    }
    // A header that cannot be read is left for the open to report.
    let Ok(c0) = qimg::chain::read_cluster0(path, qimg::format::validate::OpenMode::ReadOnly)
    else {
        return Ok(format);
    };
    stale_bitmaps_warning(&c0);
    match crate::encryption::encryption_refusal(&c0, file, needs_key) {
        Some(why) => Err(FormatError::Refused(why)),
        None => Ok(format),
    }
}

/// QEMU's warning when it opens a qcow2 image whose bitmaps extension autoclear bit 0 does not
/// vouch for (a v2 image, or one a writer without bitmap support changed): the bitmaps are
/// lost and their clusters leaked (a read-write open drops the extension, in the library).
/// QEMU's text, without a final newline, as QEMU prints it.
fn stale_bitmaps_warning(c0: &qimg::format::cluster0::Cluster0) {
    let h = &c0.header;
    let vouched =
        h.version >= 3 && h.autoclear_features & qimg::format::features::AUTOCLEAR_BITMAPS != 0;
    if c0.bitmaps().is_none() || vouched {
        return;
    }
    let program = crate::status::program();
    let what = if h.version < 3 {
        "This qcow2 v2 image contains bitmaps, but they may have been modified by a program \
         without persistent bitmap support; so now they must all be considered inconsistent"
    } else {
        "a program lacking bitmap support modified this file, so all bitmaps are now \
         considered inconsistent"
    };
    eprint!(
        "{program}: warning: {what}\nSome clusters may be leaked, run 'qemu-img check -r' on \
         the image file to fix."
    );
}

/// [`format_of`] before the encryption checks.
fn format_without_key(
    path: &Path,
    file: &str,
    named: Option<&str>,
) -> std::result::Result<ImageFormat, FormatError> {
    if let Some(why) = crate::option_string::plain_option_string(file) {
        return Err(FormatError::Refused(why));
    }
    let given = crate::image_spec::format_for(file);
    match named.or(given.as_deref()) {
        Some(name)
            if crate::args::is_null_driver(name) && qimg::chain::null_device(path).is_none() =>
        {
            Err(FormatError::Refused(
                "The only allowed filename for this driver is 'null-co://'".into(),
            ))
        }
        Some(name) => image_format(name).ok_or_else(|| FormatError::UnknownDriver(name.into())),
        None => probe_format(path).map_err(FormatError::Probe),
    }
}

/// The format of source `file` ([`format_of`]), errors worded as qemu-img's "Could not open"
/// for a source image.
pub(crate) fn source_format(path: &Path, file: &str, named: Option<&str>) -> Result<ImageFormat> {
    format_of(path, file, named, true).map_err(|e| match e {
        FormatError::UnknownDriver(name) => {
            anyhow!("Could not open '{file}': Unknown driver '{name}'")
        }
        // QEMU names the image as the user typed it (an option string, a `json:` name).
        FormatError::Refused(why) => {
            let typed = crate::status::typed_name(file).unwrap_or_else(|| file.to_string());
            anyhow!("Could not open '{typed}': {why}")
        }
        // A file that is not there in qemu-img's words (`open_msg`).
        FormatError::Probe(e) => crate::status::open_msg(
            anyhow!("Could not open '{file}': {}", lib_msg(&e, file)),
            file,
        ),
    })
}

/// qemu-img's warning when the format of `file` was probed (neither `named` nor given by the
/// filename itself) and the probe guessed raw; `None` otherwise.
pub(crate) fn raw_probe_warning(
    file: &str,
    named: Option<&str>,
    fmt: ImageFormat,
) -> Option<String> {
    let probed = named.is_none() && crate::image_spec::format_for(file).is_none();
    // QEMU names the node by its filename: an NBD export's in its canonical form.
    let canonical = qimg::io::nbd::NbdAddress::parse(file)
        .ok()
        .flatten()
        .filter(|_| qimg::io::nbd::is_nbd_name(file))
        .map(|a| a.to_string());
    let file = canonical.as_deref().unwrap_or(file);
    (probed && fmt == ImageFormat::Raw).then(|| {
        format!(
            "WARNING: Image format was not specified for '{file}' and probing guessed raw.\n         \
             Automatically detecting the format is dangerous for raw images, write operations on block 0 will be restricted.\n         \
             Specify the 'raw' format explicitly to remove the restrictions."
        )
    })
}

/// The layers of the image a command reads, top first ([`qimg::block_status::Chain`]), with
/// the name of each layer's file as qemu-img shows it.
pub(crate) struct Layers {
    chain: Chain<AnyStorage>,
    /// Per layer: the file host offsets point into, named as qemu-img names it.
    names: Vec<Rc<str>>,
    /// Per layer: the files it reads (the image file and its data file, if any).
    files: Vec<Vec<PathBuf>>,
}

impl std::ops::Deref for Layers {
    type Target = [Layer<AnyStorage>];

    fn deref(&self) -> &Self::Target {
        self.chain.layers()
    }
}

impl Layers {
    /// The files layer `i` reads (the image file and its data file, if any).
    pub(crate) fn files(&self, i: usize) -> &[PathBuf] {
        &self.files[i]
    }

    /// The top layer's virtual size.
    pub(crate) fn size(&self) -> u64 {
        self.chain.size()
    }
}

/// "Could not open" in qemu-img's words for a file of the chain the walk opens.
fn host_open_error(e: qimg::Error, name: &str) -> anyhow::Error {
    match e {
        qimg::Error::Io { source, .. } => {
            anyhow!(
                "Could not open '{name}': {}",
                crate::status::os_msg(&source)
            )
        }
        qimg::Error::Storage { source, .. } => anyhow!("Could not open '{name}': {source}"),
        other => anyhow!("Could not open '{name}': {other}"),
    }
}

/// Opens the image and lists the layers of its chain, top first.
pub(crate) async fn open_chain(
    path: &Path,
    file: &str,
    fmt: ImageFormat,
    force_share: bool,
) -> Result<Layers> {
    // A file that is not there (or cannot be reached) in qemu-img's words.
    let nbd = path.to_str().and_then(|p| {
        qimg::io::nbd::NbdAddress::parse(p)
            .ok()
            .flatten()
            .filter(|_| qimg::io::nbd::is_nbd_name(p))
    });
    if nbd.is_none() && qimg::chain::null_device(path).is_none() {
        if let Err(e) = std::fs::metadata(path) {
            return Err(crate::status::open_msg(
                anyhow!("Could not open '{file}': {}", crate::status::os_msg(&e)),
                file,
            ));
        }
    }
    if fmt == ImageFormat::Raw {
        let host = HostExtents::open(path).map_err(|e| host_open_error(e, file))?;
        // The map names an export as QEMU writes it back.
        let name = nbd.map_or_else(|| file.to_string(), |a| a.to_string());
        return Ok(Layers {
            chain: Chain::raw(host),
            names: vec![Rc::from(name)],
            files: vec![vec![path.to_path_buf()]],
        });
    }
    let opts = crate::image_spec::options_for(path)
        .clean_timer(false)
        .force_share(force_share);
    let img = opts
        .open(path)
        .await
        .map_err(|e| anyhow!("Could not open '{file}': {}", lib_msg(&e, file)))?;
    let chain = Chain::of_image(&img, DataHoles::WhenPreallocated).map_err(|e| {
        let name = match &e {
            qimg::Error::Io { path, .. } | qimg::Error::Storage { path, .. } => {
                path.display().to_string()
            }
            _ => file.to_string(),
        };
        host_open_error(e, &name)
    })?;
    // Each layer's file as qemu-img names it (a data file by the name its image stores) and
    // the files it reads.
    let mut names = Vec::new();
    let mut files = Vec::new();
    for layer in chain.layers() {
        match layer {
            Layer::Qcow2 { image, .. } => {
                let c0 = read_cluster0(image.path(), OpenMode::ReadOnly)?;
                let data_file = c0
                    .data_file()
                    .map(|n| String::from_utf8_lossy(n).into_owned());
                let mut mine = vec![image.path().to_path_buf()];
                mine.extend(data_file.is_some().then(|| image.data_path().to_path_buf()));
                files.push(mine);
                let name = data_file.unwrap_or_else(|| image.path().display().to_string());
                names.push(Rc::from(name));
            }
            Layer::Raw(host) => {
                names.push(Rc::from(host.path().display().to_string()));
                files.push(vec![host.path().to_path_buf()]);
            }
        }
    }
    Ok(Layers {
        chain,
        names,
        files,
    })
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

/// `-l`: the top image shows the snapshot, for its block status too.
pub(crate) async fn view_snapshot(
    layers: &Layers,
    (id, name): &(Option<String>, Option<String>),
) -> Result<()> {
    match layers.first() {
        Some(Layer::Qcow2 { image, .. }) => load_snapshot(image, id, name).await,
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

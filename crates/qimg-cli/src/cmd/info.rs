//! `qimg info [-f FMT] [--output human|json] [--backing-chain] [-U] FILE`: what qemu-img
//! info reports about an image (read-only), in its human text or JSON.

use std::path::Path;

use anyhow::{Result, anyhow};
use qimg::io::{FileStorage, ImageLock, Storage};
use qimg::tools::info::{backing_chain, image_info};

use crate::human;
use crate::status::{lib_msg, open_msg};

/// Arguments of `qimg info`.
#[derive(clap::Args)]
pub struct InfoArgs {
    /// Image format (probed when absent).
    #[arg(short = 'f')]
    fmt: Option<String>,
    /// Output format: human or json.
    #[arg(long, default_value = "human")]
    output: String,
    /// Show the whole backing chain.
    #[arg(long)]
    backing_chain: bool,
    /// Read even while another process writes the image (info takes QEMU's read lock,
    /// as qemu-img info does, unless this is given).
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// The image.
    filename: Option<String>,
}

/// Runs `qimg info`.
pub fn run(args: InfoArgs) -> Result<()> {
    let json = crate::args::json_output(&args.output, "info").map_err(anyhow::Error::msg)?;
    let Some(filename) = args.filename else {
        anyhow::bail!("Expecting one image file name\nTry 'qimg info --help' for more info");
    };
    let path = Path::new(&filename);
    // The one format rule; a file that cannot be probed is left for `image_info` to report
    // in its words.
    use crate::chain::FormatError;
    let fmt = match crate::chain::format_of(path, &filename, args.fmt.as_deref(), false) {
        Ok(f) => Some(f),
        Err(FormatError::UnknownDriver(name)) => {
            anyhow::bail!("Could not open '{filename}': Unknown driver '{name}'")
        }
        Err(FormatError::Refused(why)) => {
            let typed = crate::status::typed_name(&filename).unwrap_or_else(|| filename.clone());
            anyhow::bail!("Could not open '{typed}': {why}")
        }
        Err(FormatError::Probe(_)) => None,
    };
    // Held while the image is read: a writer (QEMU or qimg) keeps `info` out, and the other
    // way round, as with qemu-img; `-U` takes a lock that keeps nobody out.
    // QEMU's raw driver shares everything with other processes (it passes its user's
    // permissions through): a raw image takes no lock that refuses a writer.
    let share_all = args.force_share || fmt == Some(qimg::chain::ImageFormat::Raw);
    let _lock = match read_lock(path, share_all) {
        Ok(lock) => lock,
        Err(e) => return Err(crate::status::storage_open_error(e, &filename)),
    };
    // A file that cannot be opened is worded as qemu-img words it.
    let file = &filename;
    let opened = |e: qimg::Error| match e {
        qimg::Error::Io { .. } | qimg::Error::Storage { .. }
            if qimg::io::nbd::is_nbd_name(file) =>
        {
            anyhow!("Could not open '{file}': {}", lib_msg(&e, file))
        }
        ref e if crate::status::qemu_header_words(e).is_some() => {
            anyhow!("Could not open '{file}': {}", lib_msg(e, file))
        }
        // The file that could not be opened: the image, or a file of its backing chain.
        qimg::Error::Io { ref path, .. } => {
            let name = path.display().to_string();
            let name = if path == Path::new(file) || name.is_empty() {
                file.to_string()
            } else {
                name
            };
            open_msg(
                anyhow!("Could not open '{name}': {}", lib_msg(&e, &name)),
                &name,
            )
        }
        other => other.into(),
    };
    let mut list = if args.backing_chain {
        backing_chain(path, fmt).map_err(opened)?
    } else {
        vec![image_info(path, fmt).map_err(opened)?]
    };
    if qimg::chain::null_device(path).is_some() {
        show_null_device(&mut list[0], &filename, args.fmt.as_deref());
    }
    if crate::raw_window::window(&filename).is_some() {
        // Raw over a part of the file: QEMU names the node by its options.
        let typed = crate::status::typed_name(&filename);
        if let Some(shown) = typed.as_deref().and_then(crate::qjson::qemu_json_name) {
            list[0].filename = shown;
        }
    }
    if let Some(shown) = crate::status::typed_name(&filename)
        .as_deref()
        .and_then(crate::qjson::qemu_json_key_name)
    {
        // qcow2 with `encrypt.key-secret`: QEMU names the node by its options.
        list[0].filename = shown;
    }
    let given = crate::image_spec::format_for(&filename);
    if args.fmt.as_deref().or(given.as_deref()) == Some("file") && !list[0].children.is_empty() {
        // QEMU's file driver named as the image: its node is the file, shown as raw's
        // protocol child is.
        list[0] = *list[0].children.remove(0).info;
    }
    if json {
        let v = if args.backing_chain {
            serde_json::to_value(&list)?
        } else {
            serde_json::to_value(&list[0])?
        };
        outln!("{}", crate::qjson::pretty(&v));
    } else {
        let texts: Vec<String> = list.iter().map(human::info).collect();
        out!("{}", texts.join("\n"));
    }
    Ok(())
}

/// QEMU's view of its null device (`null-co://`, `json:{"driver":"null-co",...}`): a node of
/// its own (format `null-co`, no child) when the null driver is named, else raw over a
/// `null-co` protocol node; an option string or `json:` name shown as QEMU renders it.
fn show_null_device(info: &mut qimg::tools::info::ImageInfo, file: &str, named: Option<&str>) {
    let given = crate::image_spec::format_for(file);
    let node = named
        .or(given.as_deref())
        .is_some_and(crate::args::is_null_driver);
    let typed = crate::status::typed_name(file);
    let shown = typed
        .as_deref()
        .and_then(crate::qjson::qemu_json_name)
        .unwrap_or_else(|| file.to_string());
    if node {
        info.format = "null-co".into();
        info.children.clear();
        info.format_specific = None;
        info.filename = shown;
        return;
    }
    info.filename = shown;
    let child = typed
        .as_deref()
        .and_then(|t| crate::qjson::qemu_json_child(t, "file"));
    if let (Some(c), Some(name)) = (info.children.first_mut(), child) {
        c.info.filename = name;
    }
}

/// Opens `path` and takes QEMU's read lock on it (a shared read with `share_all`); a file
/// that cannot be opened is left for `image_info` to report as it does.
fn read_lock(
    path: &Path,
    share_all: bool,
) -> std::result::Result<Option<FileStorage>, qimg::io::StorageError> {
    let Ok(file) = FileStorage::open(path) else {
        return Ok(None);
    };
    let lock = if share_all {
        ImageLock::SharedRead
    } else {
        ImageLock::Read
    };
    file.lock_image(lock)?;
    Ok(Some(file))
}

//! `qimg resize [-f FMT] [--shrink] [--preallocation=MODE] [-q] FILE [+|-]SIZE`: changes the
//! virtual size of an image, with qemu-img resize's rules and messages.
//!
//! A qcow2 image grows through the engine ([`qimg::Image::resize`]: a larger L1 table, and
//! zeros where a longer backing file would show through) and shrinks, only with `--shrink`,
//! through [`qimg::Image::shrink`] (clusters past the new end freed, refcounts kept exact).
//! Growing may preallocate the new area: `metadata`, `falloc` and `full` allocate its
//! clusters (reading as zeros). A raw file is truncated or extended (`falloc` reserves the
//! new space, `full` writes zeros; `metadata` is refused, as qemu-img does).

use std::fs::OpenOptions as FsOpen;
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use qimg::Image;
use qimg::chain::ImageFormat;
use qimg::format::validate::{MAX_L1_BYTES, l1_entries_for};

use crate::args::parse_size;
use crate::chain::{raw_probe_warning, source_format};
use crate::status::{lib_msg, open_msg, os_msg};

/// Arguments of `qimg resize`.
#[derive(clap::Args)]
pub struct ResizeArgs {
    /// Image format: qcow2 or raw (probed when absent).
    #[arg(short = 'f', long = "format")]
    fmt: Option<String>,
    /// Allow the new size to be smaller (data past it is lost).
    #[arg(long)]
    shrink: bool,
    /// Preallocation of the new area when growing: off, metadata (qcow2), falloc or full.
    #[arg(long)]
    preallocation: Option<String>,
    /// Quiet: print nothing on success.
    #[arg(short = 'q', long = "quiet")]
    quiet: bool,
    /// The image, then the new size: absolute, or relative with a leading + or -.
    #[arg(allow_hyphen_values = true, num_args = 0..)]
    args: Vec<String>,
}

/// qemu's preallocation modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Prealloc {
    Off,
    Metadata,
    Falloc,
    Full,
}

impl Prealloc {
    /// The mode QEMU names `name` (`off`, `metadata`, `falloc`, `full`).
    pub(crate) fn parse(name: &str) -> Option<Self> {
        match name {
            "off" => Some(Self::Off),
            "metadata" => Some(Self::Metadata),
            "falloc" => Some(Self::Falloc),
            "full" => Some(Self::Full),
            _ => None,
        }
    }
}

/// Bytes of zeros written at a time to preallocate.
const ZERO_CHUNK: u64 = 1 << 20;

/// Runs `qimg resize`.
pub fn run(args: ResizeArgs) -> Result<()> {
    // `--` before a negative size ends the options, as with qemu-img.
    let mut rest: Vec<String> = args.args.clone();
    if let Some(i) = rest.iter().position(|a| a == "--") {
        rest.remove(i);
    }
    // qemu-img takes the last argument as the size (it may be negative) and hands the rest
    // to getopt: an option it does not know is refused in getopt's words.
    if let Some((_, before)) = rest.split_last() {
        if let Some(a) = before.iter().find(|a| a.starts_with('-') && a.len() > 1) {
            let p = crate::status::program();
            let why = match a.strip_prefix("--") {
                Some(_) => format!("unrecognized option '{a}'"),
                None => format!("invalid option -- '{}'", &a[1..2]),
            };
            eprintln!("{p} resize: {why}\nTry '{p} resize --help' for more info");
            crate::out::exit(1);
        }
    }
    if rest.len() > 2 {
        bail!("Extra argument(s) in command line\nTry 'qimg resize --help' for more info");
    }
    let [file, size_arg] = rest.as_slice() else {
        bail!("Expecting image file name and size\nTry 'qimg resize --help' for more info");
    };
    // The size: absolute, or relative to the current size.
    let (sign, digits) = match size_arg.as_bytes().first() {
        Some(b'+') => (1i8, &size_arg[1..]),
        Some(b'-') => (-1, &size_arg[1..]),
        _ => (0, size_arg.as_str()),
    };
    let Some(n) = parse_size(digits) else {
        bail!("{}", crate::args::size_error("size", digits));
    };
    let prealloc = match args.preallocation.as_deref() {
        None => Prealloc::Off,
        Some(name) => {
            Prealloc::parse(name).ok_or_else(|| anyhow!("Invalid preallocation mode '{name}'"))?
        }
    };
    let path = Path::new(file.as_str());
    let fmt = source_format(path, file, args.fmt.as_deref()).map_err(|e| open_msg(e, file))?;
    if let Some(warning) = raw_probe_warning(file, args.fmt.as_deref(), fmt) {
        eprintln!("{warning}");
    }
    let new_size = |current: u64| -> Result<u64> {
        let total = match sign {
            1 => i128::from(current) + i128::from(n),
            -1 => i128::from(current) - i128::from(n),
            _ => i128::from(n),
        };
        if total <= 0 || total > i128::from(i64::MAX) {
            bail!("New image size must be positive");
        }
        let total = total as u64;
        if total <= current && prealloc != Prealloc::Off {
            bail!("Preallocation can only be used for growing images");
        }
        if total < current && !args.shrink {
            bail!(
                "Use the --shrink option to perform a shrink operation.\n{}: warning: \
                 Shrinking an image will delete all data beyond the shrunken image's end. \
                 Before performing such an operation, make sure there is no important data \
                 there.",
                crate::status::program()
            );
        }
        Ok(total)
    };
    match fmt {
        ImageFormat::Raw => resize_raw(path, file, prealloc, new_size)?,
        ImageFormat::Qcow2 => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("cannot start the I/O runtime")?;
            rt.block_on(resize_qcow2(path, file, prealloc, new_size))?;
        }
    }
    if !args.quiet {
        outln!("Image resized.");
    }
    Ok(())
}

fn resize_raw(
    path: &Path,
    file: &str,
    prealloc: Prealloc,
    new_size: impl Fn(u64) -> Result<u64>,
) -> Result<()> {
    let f = FsOpen::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| {
            anyhow!(
                "Could not open '{file}': Could not open '{file}': {}",
                os_msg(&e)
            )
        })?;
    let len = f
        .metadata()
        .map_err(|e| anyhow!("Could not stat '{file}': {}", os_msg(&e)))?
        .len();
    let current = crate::chain::raw_virtual_size(len);
    // Any length: QEMU's file driver truncates to the byte (only qcow2 wants sectors).
    let total = new_size(current)?;
    match prealloc {
        Prealloc::Metadata => bail!("Unsupported preallocation mode: metadata"),
        Prealloc::Off => f.set_len(total),
        Prealloc::Falloc => nix::fcntl::fallocate(
            &f,
            nix::fcntl::FallocateFlags::empty(),
            len as i64,
            (total - len) as i64,
        )
        .map_err(std::io::Error::from)
        .and_then(|()| f.set_len(total)),
        Prealloc::Full => {
            let zeros = vec![0u8; ZERO_CHUNK as usize];
            let mut at = len;
            let mut r = Ok(());
            while at < total && r.is_ok() {
                let n = (total - at).min(ZERO_CHUNK);
                r = f.write_all_at(&zeros[..n as usize], at);
                at += n;
            }
            r
        }
    }
    .map_err(|e| anyhow!("Failed to resize '{file}': {}", os_msg(&e)))?;
    f.sync_all()
        .map_err(|e| anyhow!("Could not flush '{file}': {}", os_msg(&e)))?;
    Ok(())
}

async fn resize_qcow2(
    path: &Path,
    file: &str,
    prealloc: Prealloc,
    new_size: impl Fn(u64) -> Result<u64>,
) -> Result<()> {
    let c0 = qimg::chain::read_cluster0(path, qimg::format::validate::OpenMode::ReadOnly).map_err(
        |e| {
            open_msg(
                anyhow!("Could not open '{file}': {}", lib_msg(&e, file)),
                file,
            )
        },
    )?;
    let img = crate::image_spec::open_writable(path, file).await?;
    let r = change_size(&img, &c0.header, prealloc, new_size).await;
    let closed = img
        .close()
        .await
        .map_err(|e| anyhow!("{}", lib_msg(&e, file)));
    r.and(closed)
}

async fn change_size(
    img: &Image<qimg::io::AnyStorage>,
    h: &qimg::format::header::Header,
    prealloc: Prealloc,
    new_size: impl Fn(u64) -> Result<u64>,
) -> Result<()> {
    let file = img.path().display().to_string();
    let current = img.size();
    let total = new_size(current)?;
    if total == current {
        return Ok(());
    }
    if total % 512 != 0 {
        bail!("The new size must be a multiple of 512");
    }
    if total < current {
        return img.shrink(total).await.map_err(|e| {
            match crate::status::damage_errno_text(&e) {
                // Damage found while freeing the clusters past the end: QEMU's words.
                Some(why) => anyhow!("Failed to discard cropped clusters: {why}"),
                None => anyhow!("{}", lib_msg(&e, &file)),
            }
        });
    }
    // A v2 image cannot hold zero clusters: QEMU cannot hide a longer backing file behind
    // the new area unless preallocation writes it.
    let backing_len = match img.backing() {
        Some(qimg::Backing::Qcow2(b)) => b.size(),
        Some(qimg::Backing::Raw { storage, .. }) => {
            use qimg::io::Storage;
            storage.len().await.unwrap_or(0)
        }
        None => 0,
    };
    if h.version < 3
        && backing_len > current
        && matches!(prealloc, Prealloc::Off | Prealloc::Metadata)
    {
        bail!("Failed to zero out new clusters: Operation not supported");
    }
    let l1_entries = l1_entries_for(total, h.cluster_bits, img.extended_l2());
    if l1_entries.saturating_mul(8) > MAX_L1_BYTES {
        bail!("Failed to grow the L1 table: File too large");
    }
    grow(img, total, prealloc)
        .await
        .map_err(|e| anyhow!("{}", lib_msg(&e, &file)))
}

/// Grows `img` to `total` bytes, as `qemu-img resize --preallocation` and qemu-io's
/// `truncate -m` do: with `metadata` the new area gets host clusters and no data (holes, as
/// QEMU's); with `falloc` and `full` data clusters in QEMU's layout
/// ([`Image::resize_preallocated`]).
pub(crate) async fn grow(
    img: &Image<qimg::io::AnyStorage>,
    total: u64,
    prealloc: Prealloc,
) -> qimg::Result<()> {
    let current = img.size();
    if matches!(prealloc, Prealloc::Falloc | Prealloc::Full) {
        return img
            .resize_preallocated(total, prealloc == Prealloc::Full)
            .await;
    }
    img.resize(total).await?;
    if prealloc == Prealloc::Metadata {
        // Host clusters linked, no data written: the new area stays holes, as QEMU's.
        return img.preallocate(current, total - current).await;
    }
    Ok(())
}

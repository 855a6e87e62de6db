//! `qimg commit [-f FMT] [-t CACHE] [-b BASE] [-d] [-p] [-q] FILE`: writes the data of an
//! image down into its backing file, as qemu-img commit.
//!
//! Every range the image (or, with `-b`, any image above BASE in the chain) allocates is
//! copied into the backing file (BASE) as QEMU's mirror job in commit mode copies it: in
//! whole chunks of its granularity, zero runs of whole chunks as write-zeroes (see
//! [`plan`]). A base smaller than the image grows first. Then, unless `-d` or `-b` is given, the image is
//! emptied ([`qimg::Image::make_empty`]) so that its reads fall through to the backing file
//! again.

use std::fs::OpenOptions as FsOpen;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use qimg::Image;
use qimg::chain::ImageFormat;

use crate::cache_mode::CacheMode;
use crate::chain::source_format;
use crate::chain::{Layer, open_chain};
use crate::progress::{Pace, Progress};
use crate::status::{lib_msg, open_msg, os_msg};

/// Arguments of `qimg commit`.
#[derive(clap::Args)]
pub struct CommitArgs {
    /// Image format: qcow2 (probed when absent).
    #[arg(short = 'f', long = "format")]
    fmt: Option<String>,
    /// Cache mode (checked; qimg writes through the page cache and flushes at the end).
    #[arg(short = 't', long = "cache")]
    cache: Option<String>,
    /// Commit down to this image of the backing chain (implies -d).
    #[arg(short = 'b', long = "base")]
    base: Option<String>,
    /// Keep the image's data (do not empty it).
    #[arg(short = 'd', long = "drop")]
    keep: bool,
    /// Show progress.
    #[arg(short = 'p', long = "progress")]
    progress: bool,
    /// Quiet.
    #[arg(short = 'q', long = "quiet")]
    quiet: bool,
    /// qemu-img's rate limit (bytes per second): checked as qemu-img checks it; qimg commits
    /// at full speed.
    #[arg(short = 'r', long = "rate-limit", allow_hyphen_values = true)]
    rate_limit: Option<String>,
    /// The image.
    filename: Option<String>,
}

/// Bytes copied at a time.
const CHUNK: u64 = 2 << 20;

/// Runs `qimg commit`.
pub fn run(args: CommitArgs) -> Result<()> {
    CacheMode::parse_option(args.cache.as_deref(), "cache")?;
    let rate = match &args.rate_limit {
        Some(r) => crate::args::size_argument("rate limit", r).map_err(anyhow::Error::msg)?,
        None => 0,
    };
    let Some(file) = args.filename.clone() else {
        bail!("Expecting one image file name\nTry 'qimg commit --help' for more info");
    };
    // qemu-img starts its progress line before it opens anything, and ends it (a newline)
    // however the commit ends.
    let mut progress = Progress::start(args.progress && !args.quiet, 0);
    let r = run_with(&args, &file, rate, &mut progress);
    progress.end();
    r?;
    if !args.quiet {
        outln!("Image committed.");
    }
    Ok(())
}

/// [`run`] with its progress line started.
fn run_with(args: &CommitArgs, file: &str, rate: u64, progress: &mut Progress) -> Result<()> {
    let file = file.to_string();
    let path = Path::new(&file);
    let fmt = source_format(path, &file, args.fmt.as_deref()).map_err(|e| open_msg(e, &file))?;
    if fmt == ImageFormat::Raw {
        if !path.exists() {
            bail!("Could not open '{file}': Could not open '{file}': No such file or directory");
        }
        if let Some(warning) = crate::chain::raw_probe_warning(&file, args.fmt.as_deref(), fmt) {
            eprintln!("{warning}");
        }
        // A base named is looked for first, as QEMU's `bdrv_find_backing_image`.
        if let Some(b) = &args.base {
            bail!("Did not find '{b}' in the backing chain of '{file}'");
        }
        bail!("Image does not have a backing file");
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the I/O runtime")?;
    rt.block_on(commit(args, path, &file, rate, progress))
}

/// The base of the commit: its path, its format and its depth in the chain.
struct Base {
    path: PathBuf,
    raw: bool,
    depth: usize,
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// The commit itself; `rate`: `-r`, bytes of data copied per second (0: no limit).
async fn commit(
    args: &CommitArgs,
    path: &Path,
    file: &str,
    rate: u64,
    progress: &mut Progress,
) -> Result<()> {
    // QEMU opens the image for writing first: one another process holds is refused before
    // anything else is looked at.
    if let Ok(f) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
    {
        if let Err(e @ qimg::io::StorageError::Locked { .. }) =
            qimg::io::ImageLock::ReadWrite.lock(&f)
        {
            return Err(crate::status::storage_open_error(e, file));
        }
    }
    // The chain, read without taking locks (the base is opened for writing below).
    let layers = open_chain(path, file, ImageFormat::Qcow2, true)
        .await
        .map_err(|e| open_msg(e, file))?;
    // A base named is looked for first (below), as QEMU's `bdrv_find_backing_image`.
    if layers.len() < 2 && args.base.is_none() {
        bail!("Image does not have a backing file");
    }
    let base = match &args.base {
        None => 1,
        Some(b) => {
            // As QEMU's bdrv_find_backing_image: an absolute name is the file itself; a
            // relative one is taken from the directory of the image that names its backing
            // file (not the working directory).
            let wanted = Path::new(b);
            (1..layers.len())
                .find(|&i| {
                    let Some(p) = layers.files(i).first() else {
                        return false;
                    };
                    if wanted.is_absolute() {
                        return same_file(p, wanted);
                    }
                    let named_by = layers.files(i - 1);
                    let dir = named_by.first().and_then(|f| f.parent());
                    dir.is_some_and(|d| same_file(p, &d.join(wanted)))
                })
                .ok_or_else(|| anyhow!("Did not find '{b}' in the backing chain of '{file}'"))?
        }
    };
    let base = Base {
        path: layers.files(base)[0].clone(),
        raw: matches!(layers[base], Layer::Raw(_)),
        depth: base,
    };
    let Layer::Qcow2 { image: top, .. } = &layers[0] else {
        bail!("Image does not have a backing file");
    };
    let size = top.size();
    // The whole chain's block status, down to its bottom.
    let mut entries = Vec::new();
    let mut at = 0;
    while at < size {
        let n = (1u64 << 30).min(size - at);
        layers.status(at, n, &mut entries).await?;
        at += n;
    }
    // QEMU's mirror granularity (`bdrv_get_default_bitmap_granularity`): the base's cluster
    // size within 4 KiB..64 KiB (64 KiB for a raw base); zeroes go to the base only in
    // whole subclusters of it (`bdrv_round_to_subclusters`).
    let (granularity, zero_align) = match &layers[base.depth] {
        Layer::Qcow2 { image: img, .. } => {
            (img.cluster_size().clamp(4096, 65536), img.subcluster_size())
        }
        Layer::Raw(_) => (65536, 1),
    };
    let steps = plan(&entries, base.depth, size, granularity, zero_align);
    progress.set_total(steps.iter().map(|r| r.1).sum());
    let base_name = base.path.display().to_string();
    if base.raw {
        let mut pace = Pace::new(rate);
        copy_to_raw(
            top, &base.path, &base_name, size, &steps, progress, &mut pace,
        )
        .await?;
    } else {
        let b = crate::image_spec::options_for(&base.path)
            .writable(true)
            .clean_timer(false)
            .open(&base.path)
            .await
            .map_err(|e| anyhow!("Could not open '{base_name}': {}", lib_msg(&e, &base_name)))?;
        let mut pace = Pace::new(rate);
        let r = copy_to_qcow2(top, &b, size, &steps, progress, &mut pace).await;
        let closed = b
            .close()
            .await
            .map_err(|e| anyhow!("{}", lib_msg(&e, &base_name)));
        r.and(closed)?;
    }
    drop(layers);
    progress.complete();
    if args.keep || args.base.is_some() {
        return Ok(());
    }
    let top = crate::image_spec::open_writable(path, file).await?;
    let r = top.make_empty().await;
    let closed = top.close().await;
    r.and(closed)
        .map_err(|e| anyhow!("Could not empty {file}: {}", lib_msg(&e, file)))
}

/// The longest copy of one step (QEMU's `MAX_IO_BYTES`).
const MAX_IO: u64 = 1 << 20;

/// What the commit writes to the base, as `(start, length, zero)` steps: the decisions of
/// QEMU's mirror job in commit mode (`mirror_iteration`), so that the base ends up allocated
/// as QEMU leaves it. Every `granularity` chunk that a layer above the base (depth below
/// `base_depth`) allocates is copied; a run of the chain's status that reads as zeros and
/// spans whole chunks (and whole subclusters of the base, `zero_align`) is written as
/// zeroes instead; anything shorter than a chunk is copied as the chunk around it (zeros
/// included, as data).
fn plan(
    entries: &[crate::chain::Entry],
    base_depth: usize,
    size: u64,
    granularity: u64,
    zero_align: u64,
) -> Vec<(u64, u64, bool)> {
    let g = granularity;
    // The chain's extents, one per run of one layer's status (QEMU's block status answers
    // one layer's run at a time).
    let mut runs: Vec<(u64, u64, usize, bool)> = Vec::new();
    for e in entries {
        let reads_data = e.data;
        match runs.last_mut() {
            Some(last)
                if last.0 + last.1 == e.start && last.2 == e.depth && last.3 == reads_data =>
            {
                last.1 += e.length
            }
            _ => runs.push((e.start, e.length, e.depth, reads_data)),
        }
    }
    // The chunks written above the base, as runs of whole chunks.
    let mut dirty: Vec<(u64, u64)> = Vec::new();
    for e in entries.iter().filter(|e| e.depth < base_depth && e.present) {
        let (a, b) = (e.start / g * g, (e.start + e.length).div_ceil(g) * g);
        match dirty.last_mut() {
            Some(last) if last.1 >= a => last.1 = last.1.max(b),
            _ => dirty.push((a, b)),
        }
    }
    let mut steps: Vec<(u64, u64, bool)> = Vec::new();
    for (first, end) in dirty {
        let end = end.min(size);
        let mut off = first;
        while off < end {
            let i = runs.partition_point(|r| r.0 + r.1 <= off);
            let (len, data) = match runs.get(i) {
                Some(r) if r.0 <= off => ((r.0 + r.1 - off).min(end - off), r.3),
                _ => (end - off, false),
            };
            let len = if data { len.min(MAX_IO) } else { len };
            let mut io = len - len % g;
            let mut zero = false;
            if io < g {
                io = g;
            } else if !data && off % zero_align == 0 && io % zero_align == 0 {
                zero = true;
            }
            let io = io.min(size - off);
            match steps.last_mut() {
                Some(last) if last.0 + last.1 == off && last.2 == zero => last.1 += io,
                _ => steps.push((off, io, zero)),
            }
            off += io;
        }
    }
    steps
}

async fn copy_to_qcow2(
    top: &Image<qimg::io::AnyStorage>,
    base: &Image<qimg::io::AnyStorage>,
    size: u64,
    ranges: &[(u64, u64, bool)],
    progress: &mut Progress,
    pace: &mut Pace,
) -> Result<()> {
    if base.size() < size {
        base.resize(size).await.map_err(|e| anyhow!("{e}"))?;
    }
    let mut buf = vec![0u8; CHUNK as usize];
    for &(start, len, zero) in ranges {
        if zero {
            base.write_zeroes_unmap(start, len)
                .await
                .map_err(|e| anyhow!("{e}"))?;
            progress.add(len);
            continue;
        }
        let mut at = start;
        while at < start + len {
            let n = (start + len - at).min(CHUNK) as usize;
            pace.take(n as u64).await;
            top.read(&mut buf[..n], at)
                .await
                .map_err(|e| anyhow!("{e}"))?;
            base.write(&buf[..n], at)
                .await
                .map_err(|e| anyhow!("{e}"))?;
            at += n as u64;
            progress.add(n as u64);
        }
    }
    base.flush().await.map_err(|e| anyhow!("{e}"))
}

async fn copy_to_raw(
    top: &Image<qimg::io::AnyStorage>,
    path: &Path,
    name: &str,
    size: u64,
    ranges: &[(u64, u64, bool)],
    progress: &mut Progress,
    pace: &mut Pace,
) -> Result<()> {
    let f = FsOpen::new()
        .write(true)
        .open(path)
        .map_err(|e| anyhow!("Could not open '{name}': {}", os_msg(&e)))?;
    let io = |e: std::io::Error| anyhow!("Could not write '{name}': {}", os_msg(&e));
    if f.metadata().map_err(io)?.len() < size {
        f.set_len(size).map_err(io)?;
    }
    let mut buf = vec![0u8; CHUNK as usize];
    for &(start, len, zero) in ranges {
        let mut at = start;
        while at < start + len {
            let n = (start + len - at).min(CHUNK) as usize;
            if zero {
                buf[..n].fill(0);
            } else {
                pace.take(n as u64).await;
                top.read(&mut buf[..n], at)
                    .await
                    .map_err(|e| anyhow!("{e}"))?;
            }
            f.write_all_at(&buf[..n], at).map_err(io)?;
            at += n as u64;
            progress.add(n as u64);
        }
    }
    f.sync_all().map_err(io)
}

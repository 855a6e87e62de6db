//! `qimg convert [-f FMT] [-O qcow2|raw] [-o OPTS] [-B BACKING [-F FMT]] [-c] [-p] [-q] [-U]
//! [-n] [-S SIZE] [-m N] [-W] [-t CACHE] [-T SRC_CACHE] SRC... DST`: copies the guest view of
//! one or more images (their backing chains flattened; several sources are concatenated) into
//! a new raw or qcow2 image created with every `create` option.
//!
//! Zeros are never written: ranges the source maps as zero (zero clusters, unallocated
//! clusters over nothing, holes of raw or preallocated files) are skipped without reading,
//! and data that is read is checked for all-zero blocks at the target's allocation unit (its
//! subcluster, or `-S` bytes, 4 KiB by default, for raw) before it is written. The copy runs in
//! 2 MiB chunks with `-m` (default 8) chunks in flight. With `-c` every non-zero cluster is
//! written compressed (the engine stores a cluster that does not shrink uncompressed).
//! With `-n` the target must exist and zero ranges are zeroed explicitly.
//!
//! With `-B` the (qcow2) output gets that backing file, and only what the source's top image
//! holds itself is copied (zeros included, written as zeros): ranges the source reads from its
//! own backing chain stay unallocated, for the new backing file to provide, as qemu-img does.
//! `-t` and `-T` take qemu's cache modes: `none` and `directsync` open with `O_DIRECT`,
//! `writethrough` and `directsync` flush the output after every write, `unsafe` never flushes
//! it, `writeback` flushes it once at the end (qimg's default for the output, where qemu-img's
//! is `unsafe`).

mod copy;
mod offload;
mod options;
mod plan;
mod source;
mod target;

use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use qimg::chain::ImageFormat;
use qimg::tools::create::{create, create_raw};

use self::copy::{Progress, copy};
use self::options::Settings;
use self::plan::{Plan, data_bytes};
use self::source::{SourceImage, open_sources};
use self::target::{OutputImage, backing_len, open_target};
use crate::chain::Layers;

/// Arguments of `qimg convert`.
#[derive(clap::Args)]
pub struct ConvertArgs {
    /// Source format: qcow2 or raw (probed when absent); applies to every source.
    #[arg(short = 'f')]
    src_fmt: Option<String>,
    /// Output format: raw (the default, as qemu-img) or qcow2.
    #[arg(short = 'O')]
    out_fmt: Option<String>,
    /// The output is an option string (`driver=qcow2,file.filename=...`), opened as it is
    /// (with `-n` only, as qemu-img).
    #[arg(long = "target-image-opts")]
    target_image_opts: bool,
    /// Options of the new image, comma separated, as for `create`; `-o help` lists them.
    #[arg(short = 'o', action = clap::ArgAction::Append)]
    options: Vec<String>,
    /// Compress every data cluster of the (qcow2) output.
    #[arg(short = 'c')]
    compress: bool,
    /// Copy offloading: data goes from the source's file to a raw output with
    /// copy_file_range (no copy through user space); data ranges are copied whole (no zero
    /// detection, so not with -S), and not with -c.
    #[arg(short = 'C')]
    copy_range: bool,
    /// Show progress.
    #[arg(short = 'p')]
    progress: bool,
    /// Quiet: no progress.
    #[arg(short = 'q')]
    quiet: bool,
    /// Accepted for qemu-img compatibility: qimg opens the source read-only without locks.
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// Do not create the output: write into the existing image (zeros are written too).
    #[arg(short = 'n')]
    no_create: bool,
    /// Smallest run of zero bytes left unwritten (multiple of 512; 0 writes everything).
    #[arg(short = 'S')]
    sparse: Option<String>,
    /// Chunks copied in parallel (1 to 16, default 8).
    #[arg(short = 'm')]
    parallel: Option<String>,
    /// At most this many bytes copied per second (qemu-img's `-r RATE_LIMIT`; 0: no limit).
    #[arg(short = 'r', allow_hyphen_values = true)]
    rate_limit: Option<String>,
    /// Write chunks in any order (faster; the target's clusters may not follow guest order).
    #[arg(short = 'W')]
    out_of_order: bool,
    /// Backing file of the (qcow2) output, as -o backing_file. Only the ranges the source's
    /// top image holds are copied; those it reads from its own backing chain are left to the
    /// new backing file. With -n the target keeps its header and only this copy rule applies.
    #[arg(short = 'B', long = "backing")]
    backing: Option<String>,
    /// Format of the -B backing file (qcow2 or raw), as -o backing_fmt; needed to create an
    /// output with a backing file.
    #[arg(short = 'F', long = "backing-format")]
    backing_fmt: Option<String>,
    /// Output cache mode: writeback (the default: one flush at the end), none (O_DIRECT),
    /// writethrough (a flush after every write), directsync (both) or unsafe (no flush).
    #[arg(short = 't', long = "target-cache")]
    cache: Option<String>,
    /// Source cache mode: writeback (the default), none or directsync (O_DIRECT),
    /// writethrough or unsafe (the same as writeback for reading).
    #[arg(short = 'T', long = "source-cache")]
    src_cache: Option<String>,
    /// Copy the source's persistent dirty bitmaps into the (qcow2) output.
    #[arg(long = "bitmaps")]
    bitmaps: bool,
    /// With --bitmaps: leave inconsistent bitmaps out (with a warning) instead of failing.
    #[arg(long = "skip-broken-bitmaps")]
    skip_broken_bitmaps: bool,
    /// Copy what can be read: a sector whose read fails is copied as zeros, with a warning.
    #[arg(long = "salvage")]
    salvage: bool,
    /// With `-n`: the output already reads as zeros, so zeros are not written to it.
    #[arg(long = "target-is-zero")]
    target_is_zero: bool,
    /// Convert this internal snapshot of the source instead of its disk: `NAME_OR_ID`, or
    /// `snapshot.id=ID[,snapshot.name=NAME]`.
    #[arg(short = 'l')]
    snapshot: Option<String>,
    /// One or more sources (their guest contents are concatenated), then the destination.
    #[arg(allow_hyphen_values = false)]
    files: Vec<String>,
}

/// Runs `qimg convert`.
pub fn run(args: ConvertArgs) -> Result<()> {
    match options::settings(args)? {
        Some(settings) => execute(settings),
        None => Ok(()),
    }
}

/// Opens the sources, creates and opens the output, and copies.
fn execute(settings: Settings) -> Result<()> {
    let workers = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(1, 4);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .context("cannot start the I/O runtime")?;
    rt.block_on(async move {
        let dst_file = settings.dst_file.as_str();
        let (has_backing, no_create, sparse) =
            (settings.has_backing, settings.no_create, settings.sparse);
        let dst_path = Path::new(dst_file);
        let creating = (!no_create).then(|| settings.out_fmt.name());
        let (srcs, source, size) = open_sources(
            &settings.sources,
            (dst_path, dst_file, creating),
            settings.src_cache,
            settings.force_share,
            settings.snapshot.as_ref(),
        )
        .await?;
        if settings.target_is_zero && has_backing {
            // qemu-img's words, and its exit status 0.
            eprintln!(
                "{}: Cannot use --target-is-zero when the destination image has a backing file",
                crate::status::program()
            );
            return Ok(());
        }
        let bitmaps = match &source.0.first() {
            Some((_, _, SourceImage::Qcow2(img))) if settings.bitmaps => img.bitmaps(),
            _ => Vec::new(),
        };
        // QEMU walks its bitmaps last first: the last inconsistent one is named.
        if let Some(b) = bitmaps
            .iter()
            .rev()
            .find(|b| b.inconsistent && !settings.skip_broken_bitmaps)
        {
            bail!(
                "Cannot copy inconsistent bitmap '{}'\nTry --skip-broken-bitmaps, or use \
                 'qemu-img bitmap --remove' to delete it",
                b.name
            );
        }
        if !no_create {
            create_output(&settings, dst_path, size)?;
        }
        if settings.bitmaps && settings.out_fmt != ImageFormat::Qcow2 {
            bail!("Format driver 'raw' does not support bitmaps");
        }
        let target =
            open_target(dst_path, dst_file, settings.out_fmt, size, settings.cache).await?;

        let (zero_unit, compress_cluster) = match &target.out {
            OutputImage::Qcow2(img) if settings.compress => (sparse, img.cluster_size()),
            // Zero runs of `-S` bytes stay out, as qemu-img's: a new (sub)cluster gets what
            // was written and the engine zeroes the rest of it as QEMU's does.
            _ => (sparse, 0),
        };
        let plan = Plan {
            size,
            zero_unit,
            compress_cluster,
            // A backing file may hold data where the source reads zeros: write them.
            zero_target: (no_create || has_backing) && !settings.target_is_zero,
            // (-C sets no -S: zero ranges stay out, data ranges are copied whole.)
            all_data: sparse == 0 && !settings.copy_range,
            copy_range: settings.copy_range,
            parallel: settings.parallel,
            rate_limit: settings.rate_limit,
            // Compressed clusters are packed wherever they land; compress them in parallel.
            in_order: !settings.out_of_order && compress_cluster == 0,
            skip_backing: has_backing,
            salvage: settings.salvage,
            quiet: settings.quiet,
            zeros_from: match &target.out {
                OutputImage::Qcow2(img) if has_backing && !no_create => backing_len(img).await?,
                _ => u64::MAX,
            },
        };
        let mut progress = Progress {
            on: settings.progress,
            total: 0,
            done: 0,
            last: 0.0,
        };
        // With `--salvage` the counting pass also warns, as qemu-img's (which always counts).
        if progress.on || plan.salvage {
            progress.total = data_bytes(&srcs, plan).await?;
        }
        progress.start();
        copy(&srcs, source.clone(), target.clone(), plan, &mut progress).await?;
        if let (Some((_, _, SourceImage::Qcow2(src))), OutputImage::Qcow2(dst)) =
            (source.0.first(), &target.out)
        {
            copy_bitmaps(src, dst, &bitmaps).await?;
        }
        target
            .finish()
            .await
            .with_context(|| format!("error while closing '{dst_file}'"))?;
        progress.end();
        Ok(())
    })
}

/// `--bitmaps`: each bitmap of the source, with its granularity, enabled state and bits, into
/// the output (inconsistent ones, which `--skip-broken-bitmaps` lets through, are skipped
/// with qemu-img's warning). They reach the output's file when it is closed.
async fn copy_bitmaps(
    src: &qimg::Image<qimg::io::AnyStorage>,
    dst: &qimg::Image<target::OutStorage>,
    bitmaps: &[qimg::BitmapInfo],
) -> Result<()> {
    // Warned about last first, as QEMU walks its bitmaps; added in directory order (which
    // is where QEMU's output has them).
    for b in bitmaps.iter().rev().filter(|b| b.inconsistent) {
        eprintln!(
            "{}: warning: Skipping inconsistent bitmap '{}'",
            crate::status::program(),
            b.name
        );
    }
    for b in bitmaps.iter().filter(|b| !b.inconsistent) {
        let failed = |e: qimg::Error| anyhow!("Failed to populate bitmap {}: {e}", b.name);
        dst.add_bitmap(&b.name, Some(b.granularity), b.enabled)
            .map_err(failed)?;
        let bits = src.dirty_bitmap(&b.name).await.map_err(failed)?;
        dst.merge_bitmap(&b.name, &bits).map_err(failed)?;
    }
    Ok(())
}

/// Creates the output, as large as the sources together, with the `-o` options.
fn create_output(settings: &Settings, dst_path: &Path, size: u64) -> Result<()> {
    let dst_file = &settings.dst_file;
    let mut nop = |_: u64, _: u64| {};
    if settings.out_fmt == ImageFormat::Raw {
        if let Some(refused) = &settings.refused {
            bail!("{dst_file}: error while converting raw: {refused}");
        }
        create_raw(
            dst_path,
            size,
            settings.create_options.preallocation,
            &mut nop,
        )
        .map_err(|e| {
            anyhow!(
                "{dst_file}: error while converting raw: {}",
                crate::cmd::create::create_failure(&e, dst_file)
            )
        })?;
    } else {
        let mut create_options = settings.create_options.clone();
        create_options.size = Some(size);
        let made = match (&settings.refused, create_options.validate()) {
            (Some(refused), _) => Err(anyhow!(
                "{dst_file}: error while converting qcow2: {refused}"
            )),
            (None, Err(e)) => Err(anyhow!(
                "{dst_file}: error while converting qcow2: {}",
                crate::cmd::create::refusal_words(&e)
            )),
            (None, Ok(())) => create(dst_path, &create_options, &mut nop)
                .map(|_| {
                    // An encrypted output opens with the passphrase it was made with.
                    if let Some(e) = &create_options.encryption {
                        crate::encryption::add_key(dst_file, e.passphrase.clone());
                    }
                })
                .map_err(|e| {
                    anyhow!(
                        "{dst_file}: error while converting qcow2: {}",
                        crate::cmd::create::create_failure(&e, dst_file)
                    )
                }),
        };
        if made.is_err() {
            crate::cmd::create::delete_refused(dst_path, &create_options);
        }
        made?;
    }
    Ok(())
}

/// Refuses an output that is the source or a file of its chain (creating it would destroy the
/// data being read); as qemu-img, in its words: the source holds the file's lock, so creating
/// it (`creating`: the output format's name) or opening it for writing (`-n`) fails to get it.
pub(super) fn refuse_overwriting_source(
    layers: &Layers,
    dst: &Path,
    file: &str,
    creating: Option<&str>,
) -> Result<()> {
    let Ok(dst) = std::fs::canonicalize(dst) else {
        return Ok(());
    };
    for i in 0..layers.len() {
        for p in layers.files(i) {
            if std::fs::canonicalize(p).is_ok_and(|p| p == dst) {
                if crate::status::program() == "qimg" {
                    bail!(
                        "Could not open '{file}': the output is the source image or a file of \
                         its backing chain"
                    );
                }
                let locked = crate::status::lock_error("QEMU's shared \"write\" lock", file);
                match creating {
                    Some(fmt) => bail!("{file}: error while converting {fmt}: {locked}"),
                    None => bail!("Could not open '{file}': {locked}"),
                }
            }
        }
    }
    Ok(())
}

//! `qimg backup`: the client of an incremental backup over NBD.
//!
//! - `qimg backup full SOURCE OUTPUT` copies every allocated extent of the export SOURCE
//!   (`nbd://...`, `nbd+unix://...`; the `base:allocation` context says which) into a new
//!   qcow2 image OUTPUT.
//! - `qimg backup incremental --bitmap NAME SOURCE -B PREVIOUS OUTPUT` copies only the
//!   extents the export's `qemu:dirty-bitmap:NAME` context marks dirty into a new qcow2
//!   overlay OUTPUT whose backing file is PREVIOUS: the chain OUTPUT -> PREVIOUS -> ... then
//!   reads as SOURCE does. A dirty extent that reads as zeros becomes zero clusters (which
//!   hide the backing file's data).
//! - `qimg backup verify SOURCE CHAIN` compares the export with an image (and its backing
//!   chain), as `qemu-img compare` does, with its words and exit status (0 equal, 1 not).
//!
//! Several requests are in flight: with `--connections N` (4 by default) and a server that
//! offers multi-conn, N tasks copy the extents over the library's NBD client, which opens
//! up to N connections as they find the open ones busy; otherwise one. The
//! source is usually a checkpoint's frozen view (`qimg serve --monitor`, see
//! `qimg_serve::monitor`), so nothing changes under the copy.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, anyhow, bail};
use clap::{Args, Subcommand};
use qimg::io::nbd::{NbdStorage, STATE_ZERO};
use qimg::tools::create::{CreateOptions, create};
use qimg::{Image, OpenOptions};

use crate::create_opts;
use crate::progress::Progress;

/// Bytes one request copies at most.
const PIECE: u64 = 4 << 20;

/// `qimg backup` arguments.
#[derive(Args, Debug)]
pub struct BackupArgs {
    #[command(subcommand)]
    what: What,
}

#[derive(Subcommand, Debug)]
enum What {
    /// Copy every allocated extent of SOURCE into a new qcow2 image.
    Full {
        #[command(flatten)]
        copy: CopyArgs,
        /// The NBD export to back up (`nbd://HOST[:PORT]/NAME`, `nbd+unix:///NAME?socket=PATH`).
        source: String,
        /// The new qcow2 image.
        output: PathBuf,
    },
    /// Copy the extents bitmap NAME marks dirty onto a new overlay of PREVIOUS.
    Incremental {
        #[command(flatten)]
        copy: CopyArgs,
        /// The bitmap whose `qemu:dirty-bitmap:` context says what changed.
        #[arg(long = "bitmap", value_name = "NAME")]
        bitmap: String,
        /// The previous backup (the new image's backing file).
        #[arg(short = 'B', long = "backing", value_name = "PREVIOUS")]
        previous: PathBuf,
        /// The NBD export to back up.
        source: String,
        /// The new qcow2 overlay.
        output: PathBuf,
    },
    /// Compare SOURCE with an image and its backing chain (exit 0: equal; 1: not).
    Verify {
        /// Print nothing on success.
        #[arg(short = 'q')]
        quiet: bool,
        /// The NBD export.
        source: String,
        /// The last image of the backup chain.
        chain: PathBuf,
    },
}

#[derive(Args, Debug)]
struct CopyArgs {
    /// Show progress as qemu-img does.
    #[arg(short = 'p')]
    progress: bool,
    /// Print nothing but errors.
    #[arg(short = 'q')]
    quiet: bool,
    /// qcow2 creation options of the new image (as `qimg create -o`).
    #[arg(short = 'o', value_name = "OPTIONS", action = clap::ArgAction::Append)]
    options: Vec<String>,
    /// Connections to the server (used when it offers multi-conn).
    #[arg(long = "connections", default_value_t = 4)]
    connections: usize,
}

/// Runs `qimg backup`; the exit status.
pub fn main(a: BackupArgs) -> std::process::ExitCode {
    let r = match a.what {
        What::Verify {
            quiet,
            source,
            chain,
        } => verify(&source, &chain, quiet),
        What::Full {
            copy,
            source,
            output,
        } => backup(&copy, &source, None, &output).map(|()| 0),
        What::Incremental {
            copy,
            bitmap,
            previous,
            source,
            output,
        } => backup(&copy, &source, Some((&bitmap, &previous)), &output).map(|()| 0),
    };
    match r {
        Ok(code) => std::process::ExitCode::from(code),
        Err(e) => {
            eprintln!("qimg: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")
}

fn connect(source: &str, contexts: &[&str]) -> Result<NbdStorage> {
    NbdStorage::connect_with(source, false, contexts)
        .map_err(|e| anyhow!("Could not open '{source}': {e}"))
}

/// The extents to copy: `(offset, length)`, split into pieces of at most [`PIECE`] bytes.
fn plan(nbd: &NbdStorage, dirty: Option<&str>) -> Result<Vec<(u64, u64)>> {
    let size = nbd.size();
    let runs: Vec<(u64, bool)> = match dirty {
        Some(ctx) => nbd
            .context_status(ctx, 0, size)?
            .into_iter()
            .map(|(len, f)| (len, f & 1 != 0))
            .collect(),
        // Without the allocation context everything is data.
        None => match nbd.block_status(0, size)? {
            Some(runs) => runs
                .into_iter()
                .map(|(len, f)| (len, f & STATE_ZERO == 0))
                .collect(),
            None => vec![(size, true)],
        },
    };
    let mut out = Vec::new();
    let mut at = 0u64;
    for (len, copy) in runs {
        if copy {
            let mut o = at;
            while o < at + len {
                let n = PIECE.min(at + len - o);
                out.push((o, n));
                o += n;
            }
        }
        at += len;
    }
    Ok(out)
}

fn backup(
    a: &CopyArgs,
    source: &str,
    incremental: Option<(&String, &PathBuf)>,
    output: &Path,
) -> Result<()> {
    if a.connections == 0 {
        bail!("--connections 0: at least one connection is needed");
    }
    let ctx = incremental.map(|(b, _)| format!("qemu:dirty-bitmap:{b}"));
    let contexts: Vec<&str> = ctx.iter().map(String::as_str).collect();
    let nbd = connect(source, &contexts)?.with_max_connections(a.connections);
    let pieces = plan(&nbd, ctx.as_deref())?;
    let size = nbd.size();

    let mut o = CreateOptions::default();
    let pairs: Vec<String> = a
        .options
        .iter()
        .flat_map(|s| crate::args::split_opts(s))
        .collect();
    let mut given = create_opts::Given::default();
    create_opts::apply(&mut o, &mut given, &pairs, "qcow2")
        .with_context(|| output.display().to_string())?;
    o.size = Some(size);
    if let Some((_, prev)) = incremental {
        o.backing_file = Some(prev.display().to_string());
        o.backing_fmt = Some("qcow2".into());
    }
    create(output, &o, &mut |_, _| {})
        .with_context(|| format!("cannot create '{}'", output.display()))?;

    // One copy task per connection the client may open (it opens them as the tasks find
    // the open ones busy).
    let tasks_wanted = if nbd.can_multi_conn() {
        a.connections
    } else {
        1
    };
    let nbd = Arc::new(nbd);
    let total: u64 = pieces.iter().map(|p| p.1).sum();
    let count = pieces.len();
    let progress = Arc::new(Mutex::new(Progress::start(a.progress && !a.quiet, total)));
    let queue = Arc::new(Mutex::new(VecDeque::from(pieces)));
    let rt = runtime()?;
    rt.block_on(async {
        let image = OpenOptions::new()
            .writable(true)
            .open(output)
            .await
            .with_context(|| format!("cannot open '{}'", output.display()))?;
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..tasks_wanted {
            let (image, queue, progress) = (image.clone(), queue.clone(), progress.clone());
            tasks.spawn(copy_pieces(
                nbd.clone(),
                image,
                queue,
                progress,
                incremental.is_some(),
            ));
        }
        let mut failed = None;
        while let Some(r) = tasks.join_next().await {
            match r {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    failed.get_or_insert(e);
                }
                Err(e) => {
                    failed.get_or_insert(anyhow!("a copy task failed: {e}"));
                }
            }
        }
        let closed = image.close().await;
        if let Some(e) = failed {
            return Err(e);
        }
        closed.with_context(|| format!("closing '{}'", output.display()))
    })?;
    progress.lock().unwrap_or_else(|e| e.into_inner()).end();
    if !a.quiet {
        outln!(
            "Backed up '{source}' into '{}': {total} bytes copied in {count} requests, of {size}",
            output.display()
        );
    }
    Ok(())
}

/// One task's share: takes pieces until none is left; reads each from the export and
/// writes it (zeros as zero clusters in an overlay, not at all in a full backup).
async fn copy_pieces(
    nbd: Arc<NbdStorage>,
    image: Image<qimg::io::AnyStorage>,
    queue: Arc<Mutex<VecDeque<(u64, u64)>>>,
    progress: Arc<Mutex<Progress>>,
    overlay: bool,
) -> Result<()> {
    loop {
        let next = queue.lock().unwrap_or_else(|e| e.into_inner()).pop_front();
        let Some((offset, len)) = next else {
            return Ok(());
        };
        let reader = nbd.clone();
        let buf = tokio::task::spawn_blocking(move || {
            let mut buf = vec![0u8; len as usize];
            reader.read_blocking(&mut buf, offset).map(|_| buf)
        })
        .await
        .map_err(|e| anyhow!("a read task failed: {e}"))?
        .with_context(|| format!("reading {len} bytes at offset {offset}"))?;
        if buf.iter().all(|&b| b == 0) {
            if overlay {
                image.write_zeroes(offset, len).await?;
            }
        } else {
            image.write(&buf, offset).await?;
        }
        progress.lock().unwrap_or_else(|e| e.into_inner()).add(len);
    }
}

/// `qimg backup verify`: the export against the chain, in qemu-img compare's words.
fn verify(source: &str, chain: &Path, quiet: bool) -> Result<u8> {
    let nbd = Arc::new(connect(source, &[])?);
    let rt = runtime()?;
    rt.block_on(async {
        let image = OpenOptions::new()
            .writable(false)
            .open(chain)
            .await
            .with_context(|| format!("Could not open '{}'", chain.display()))?;
        let size = nbd.size();
        let common = size.min(image.size());
        let mut at = 0u64;
        let mut differ = None;
        while at < common && differ.is_none() {
            let n = PIECE.min(common - at);
            let reader = nbd.clone();
            let theirs = tokio::task::spawn_blocking(move || {
                let mut buf = vec![0u8; n as usize];
                reader.read_blocking(&mut buf, at).map(|_| buf)
            })
            .await
            .map_err(|e| anyhow!("a read task failed: {e}"))??;
            let mut ours = vec![0u8; n as usize];
            image.read(&mut ours, at).await?;
            if let Some(i) = ours.iter().zip(&theirs).position(|(a, b)| a != b) {
                differ = Some(at + i as u64 / 512 * 512);
            }
            at += n;
        }
        image.close().await?;
        if let Some(off) = differ {
            outln!("Content mismatch at offset {off}!");
            return Ok(1);
        }
        if size != image.size() {
            if !quiet {
                outln!(
                    "Image sizes differ: {size} (export) and {} (chain)",
                    image.size()
                );
            }
            return Ok(1);
        }
        if !quiet {
            outln!("Images are identical.");
        }
        Ok(0)
    })
}

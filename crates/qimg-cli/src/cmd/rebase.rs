//! `qimg rebase [-f FMT] [-F FMT] [-b BACKING] [-u] [-p] [-q] [-U] [-t CACHE] [-T CACHE] FILE`:
//! changes the backing file of a qcow2 image, as qemu-img rebase.
//!
//! Safe mode (the default) keeps the guest view: every range the image does not allocate
//! itself and where the old backing chain and the new backing file read differently gets the
//! old chain's data written into the image, in units of the image's subcluster (cluster
//! without extended L2), only the units that differ. `-b ""` makes the image standalone (the
//! new "backing file" reads as zeros, so everything the old chain supplies is copied). Then
//! the header gets the new name and format. `-u` only rewrites the name and format.

use std::fs::File;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use qimg::chain::{ImageFormat, resolve_backing};
use qimg::io::AnyStorage;
use qimg::{Backing, ExtentKind, Image, OpenOptions};

use crate::args::image_format;
use crate::cache_mode::CacheMode;
use crate::chain::source_format;
use crate::progress::Steps;
use crate::status::{lib_msg, open_msg, os_msg};

/// Arguments of `qimg rebase`.
#[derive(clap::Args)]
pub struct RebaseArgs {
    /// Image format: qcow2 (probed when absent).
    #[arg(short = 'f', long = "format")]
    fmt: Option<String>,
    /// Format of the new backing file (required with a new backing file).
    #[arg(short = 'F', long = "backing-format")]
    backing_fmt: Option<String>,
    /// The new backing file ("" for none), stored as given, relative to the image.
    #[arg(short = 'b', long = "backing")]
    backing: Option<String>,
    /// Unsafe: only rewrite the backing file name and format.
    #[arg(short = 'u', long = "unsafe")]
    unsafe_mode: bool,
    /// Show progress.
    #[arg(short = 'p', long = "progress")]
    progress: bool,
    /// Write the copied data compressed: clusters that hold nothing of the image's own are
    /// written whole and compressed, as by `qemu-img rebase -c`.
    #[arg(short = 'c', long = "compress")]
    compress: bool,
    /// Quiet.
    #[arg(short = 'q', long = "quiet")]
    quiet: bool,
    /// Accepted for qemu-img compatibility (the backing files are opened read-only).
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// Cache mode of the image (checked; qimg writes through the page cache).
    #[arg(short = 't', long = "cache")]
    cache: Option<String>,
    /// Cache mode of the backing files (checked).
    #[arg(short = 'T', long = "source-cache")]
    src_cache: Option<String>,
    /// The image.
    filename: Option<String>,
}

/// Guest bytes compared at a time.
const CHUNK: u64 = 2 << 20;

/// Runs `qimg rebase`.
pub fn run(args: RebaseArgs) -> Result<()> {
    CacheMode::parse_option(args.cache.as_deref(), "cache")?;
    CacheMode::parse_option(args.src_cache.as_deref(), "source cache")?;
    let Some(file) = args.filename.clone() else {
        bail!("Expecting one image file name\nTry 'qimg rebase --help' for more info");
    };
    let Some(new_name) = args.backing.clone() else {
        if args.unsafe_mode {
            return finish(&args, &file, None);
        }
        bail!(
            "Must specify backing file (-b) or use unsafe mode (-u)\nTry 'qimg rebase --help' for more info"
        );
    };
    let path = Path::new(&file);
    let fmt = source_format(path, &file, args.fmt.as_deref()).map_err(|e| open_msg(e, &file))?;
    let new = (!new_name.is_empty()).then_some(new_name.as_str());
    if fmt == ImageFormat::Raw {
        if !path.exists() {
            bail!("Could not open '{file}': Could not open '{file}': No such file or directory");
        }
        if let Some(warning) = crate::chain::raw_probe_warning(&file, args.fmt.as_deref(), fmt) {
            eprintln!("{warning}");
        }
        // A safe rebase opens the new backing file first (QEMU's order).
        if let (Some(n), false) = (new, args.unsafe_mode) {
            if !resolve_backing(path, n).exists() {
                bail!(
                    "Could not open new backing file '{n}': Could not open '{n}': No such file \
                     or directory"
                );
            }
        }
        // As QEMU's bdrv_change_backing_file: a missing format is refused before the driver
        // is asked.
        if let (Some(n), None) = (new, args.backing_fmt.as_deref()) {
            bail!("Could not change the backing file to '{n}': backing format must be specified")
        }
        bail!(
            "Could not change the backing file to '{}': Operation not supported",
            new.unwrap_or("")
        );
    }
    let new_fmt = match (new, args.backing_fmt.as_deref()) {
        (Some(n), None) => {
            if args.unsafe_mode {
                bail!(
                    "Could not change the backing file to '{n}': backing format must be specified"
                )
            }
            // As qemu-img: a safe rebase without -F opens the image and the new backing file
            // (probed), copies what differs, and only then is refused by `finish` (QEMU's
            // bdrv_change_backing_file), leaving the image backed as before with the copied
            // clusters allocated. A new backing file that does not open is reported by the
            // copy, after the image itself opened.
            Some(qimg::chain::probe_format(&resolve_backing(path, n)).unwrap_or(ImageFormat::Raw))
        }
        (Some(_), Some(f)) => Some(image_format(f).ok_or_else(|| anyhow!("Unknown driver '{f}'"))?),
        (None, _) => None,
    };
    // qemu-img's progress: 0, a step per unallocated run of at most 2 MiB, 100 at the end.
    let mut progress = Steps::start(args.progress && !args.quiet);
    if !args.unsafe_mode {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the I/O runtime")?;
        let copied = rt.block_on(copy_differences(
            path,
            &file,
            new,
            new_fmt,
            &mut progress,
            args.compress,
        ));
        if copied.is_err() {
            progress.end();
        }
        copied?;
    }
    let done = finish(&args, &file, new);
    if done.is_ok() {
        progress.set(100.0);
    }
    progress.end();
    done
}

/// Writes the new name and format into the header.
fn finish(args: &RebaseArgs, file: &str, new: Option<&str>) -> Result<()> {
    let path = Path::new(file);
    if new.is_some() && args.backing_fmt.is_none() {
        bail!(
            "Could not change the backing file to '{}': backing format must be specified",
            new.unwrap_or("")
        );
    }
    if let Some(f) = args.fmt.as_deref() {
        if image_format(f) == Some(ImageFormat::Raw) {
            bail!(
                "Could not change the backing file to '{}': Operation not supported",
                new.unwrap_or("")
            );
        }
    }
    qimg::tools::amend::set_backing_file(path, new, new.and(args.backing_fmt.as_deref())).map_err(
        |e| {
            if let Some(words) = crate::status::qemu_header_words(&e) {
                // A header QEMU refuses when it opens the image, before any change.
                return anyhow!("Could not open '{file}': {words}");
            }
            if let Some(refused) = crate::status::lock_refusal(&e, file) {
                // Another process's lock: QEMU fails the open, before any change.
                return refused;
            }
            anyhow!(
                "Could not change the backing file to '{}': {}",
                new.unwrap_or(""),
                lib_msg(&e, file)
            )
        },
    )
}

/// A backing file read for comparison (zeros past its end).
enum Reader {
    Qcow2(Image<AnyStorage>),
    Raw(File),
    None,
}

impl Reader {
    async fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        buf.fill(0);
        match self {
            Reader::Qcow2(img) => {
                let size = img.size();
                if offset < size {
                    let n = ((size - offset) as usize).min(buf.len());
                    img.read(&mut buf[..n], offset)
                        .await
                        .map_err(|e| anyhow!("{e}"))?;
                }
            }
            Reader::Raw(f) => {
                crate::chain::read_raw(f, buf, offset).map_err(|e| anyhow!("{}", os_msg(&e)))?
            }
            Reader::None => {}
        }
        Ok(())
    }

    /// Bytes of guest data (past them it reads zeros).
    fn size(&self) -> Result<u64> {
        Ok(match self {
            Reader::Qcow2(img) => img.size(),
            Reader::Raw(f) => f.metadata().map_err(|e| anyhow!("{}", os_msg(&e)))?.len(),
            Reader::None => 0,
        })
    }
}

/// The old backing chain of `img` as a reader.
async fn old_reader(img: &Image<AnyStorage>) -> Result<Reader> {
    Ok(match img.backing() {
        Some(Backing::Qcow2(b)) => Reader::Qcow2(b.clone()),
        Some(Backing::Raw { path, .. }) => Reader::Raw(
            File::open(path)
                .map_err(|e| anyhow!("Could not open old backing file: {}", os_msg(&e)))?,
        ),
        None => Reader::None,
    })
}

async fn copy_differences(
    path: &Path,
    file: &str,
    new: Option<&str>,
    new_fmt: Option<ImageFormat>,
    progress: &mut Steps,
    compress: bool,
) -> Result<()> {
    let img = crate::image_spec::open_writable(path, file).await?;
    let r = copy_into(&img, path, new, new_fmt, progress, compress).await;
    let closed = img
        .close()
        .await
        .map_err(|e| anyhow!("{}", lib_msg(&e, file)));
    r.and(closed)
}

async fn copy_into(
    img: &Image<AnyStorage>,
    path: &Path,
    new: Option<&str>,
    new_fmt: Option<ImageFormat>,
    progress: &mut Steps,
    compress: bool,
) -> Result<()> {
    let old = old_reader(img).await?;
    let cs = img.cluster_size();
    // With -c: clusters already written compressed (a later run in them has nothing to do).
    let mut compressed_upto = 0u64;
    let new_reader = match (new, new_fmt) {
        (Some(name), Some(fmt)) => {
            let p = resolve_backing(path, name);
            let fail = |msg: String| {
                anyhow!("Could not open new backing file '{name}': Could not open '{name}': {msg}")
            };
            if !p.exists() {
                return Err(fail("No such file or directory".into()));
            }
            match fmt {
                ImageFormat::Qcow2 => Reader::Qcow2(
                    OpenOptions::new()
                        .clean_timer(false)
                        .open(&p)
                        .await
                        .map_err(|e| match e {
                            qimg::Error::Io { source, .. } => fail(os_msg(&source)),
                            other => anyhow!(
                                "Could not open new backing file '{name}': {}",
                                lib_msg(&other, name)
                            ),
                        })?,
                ),
                ImageFormat::Raw => Reader::Raw(File::open(&p).map_err(|e| fail(os_msg(&e)))?),
            }
        }
        _ => Reader::None,
    };
    let size = img.size();
    let unit = img.subcluster_size();
    // qemu-img's step: 100 / (size / min(size, 2 MiB)) points per unallocated run of at
    // most 2 MiB.
    let per_step = 100.0 / (size / size.clamp(1, CHUNK)).max(1) as f64;
    let mut old_buf = vec![0u8; CHUNK as usize];
    let mut new_buf = vec![0u8; CHUNK as usize];
    let old_size = old.size()?;
    let extents = img.map(0, size).await.map_err(|e| anyhow!("{e}"))?;
    for e in extents {
        if !matches!(e.kind, ExtentKind::Unallocated { .. }) {
            continue;
        }
        for _ in 0..e.length.div_ceil(CHUNK) {
            progress.step(per_step);
        }
        let end = e.start + e.length;
        let mut at = e.start;
        while at < end {
            let n = (end - at).min(CHUNK - at % unit);
            // A chunk that starts past the end of the old backing file reads zeros that no
            // file holds: its differences are written as zeros (zero clusters), as qemu-img
            // does; other chunks write what the old chain reads as data.
            let old_is_zero = at >= old_size;
            let (ob, nb) = (&mut old_buf[..n as usize], &mut new_buf[..n as usize]);
            old.read(ob, at).await?;
            new_reader.read(nb, at).await?;
            // Write the runs of units that differ, each unit whole.
            let mut i = 0u64;
            while i < n {
                let unit_end = ((at + i) / unit * unit + unit - at).min(n);
                let same = ob[i as usize..unit_end as usize] == nb[i as usize..unit_end as usize];
                if !same {
                    let mut j = unit_end;
                    while j < n {
                        let next = (j + unit).min(n);
                        if ob[j as usize..next as usize] == nb[j as usize..next as usize] {
                            break;
                        }
                        j = next;
                    }
                    // -c: the clusters of the run that lie wholly in this unallocated extent
                    // are written whole and compressed (what the image reads there now, its
                    // old chain's data); the rest as usual.
                    let (lo, hi) = (at + i, at + j);
                    let first = lo / cs * cs;
                    let whole = compress && !old_is_zero && first >= e.start;
                    let done = if whole && first + cs.min(size - first) <= end {
                        let mut c = first.max(compressed_upto);
                        let mut r = Ok(());
                        while c < hi && r.is_ok() {
                            let n = cs.min(size - c);
                            if c + n > end {
                                break;
                            }
                            let mut buf = vec![0u8; n as usize];
                            r = match img.read(&mut buf, c).await {
                                Ok(()) => img.write_compressed(c, &buf).await,
                                Err(e) => Err(e),
                            };
                            c += n;
                            compressed_upto = c;
                        }
                        // A tail the loop left (its cluster runs past the extent).
                        if r.is_ok() && c < hi {
                            let from = (c - at) as usize;
                            r = img.write(&ob[from..j as usize], c).await;
                        }
                        r
                    } else if compress && hi <= compressed_upto {
                        Ok(())
                    } else {
                        match old_is_zero {
                            true => img.write_zeroes(lo, hi - lo).await,
                            false => img.write(&ob[i as usize..j as usize], lo).await,
                        }
                    };
                    done.map_err(|e| anyhow!("Error while writing to COW image: {e}"))?;
                    i = j;
                } else {
                    i = unit_end;
                }
            }
            at += n;
        }
    }
    img.flush().await.map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

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

use std::collections::VecDeque;
use std::io::IoSlice;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail};
use qimg::chain::{ImageFormat, probe_format};
use qimg::io::{
    AllocateOutcome, AnyStorage, Backend, DiscardOutcome, Storage, StorageError, ZeroOutcome,
};
use qimg::tools::create::{CreateOptions, create, create_raw};
use qimg::{Image, OpenOptions};
use tokio::sync::oneshot;
use tokio::task::JoinSet;

use crate::bench_parse::CacheMode;
use crate::map::{Layer, lib_msg, open_chain, os_msg, status};
use crate::opts;

/// Arguments of `qimg convert`.
#[derive(clap::Args)]
pub struct ConvertArgs {
    /// Source format: qcow2 or raw (probed when absent); applies to every source.
    #[arg(short = 'f')]
    src_fmt: Option<String>,
    /// Output format: raw (the default, as qemu-img) or qcow2.
    #[arg(short = 'O')]
    out_fmt: Option<String>,
    /// Options of the new image, comma separated, as for `create`; `-o help` lists them.
    #[arg(short = 'o', action = clap::ArgAction::Append)]
    options: Vec<String>,
    /// Compress every data cluster of the (qcow2) output.
    #[arg(short = 'c')]
    compress: bool,
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
    /// One or more sources (their guest contents are concatenated), then the destination.
    #[arg(allow_hyphen_values = false)]
    files: Vec<String>,
}

/// Guest bytes per copy chunk (a multiple of every cluster size).
const CHUNK: u64 = 2 << 20;
/// Guest bytes whose status is asked at once when planning.
const WINDOW: u64 = 1 << 30;

/// Runs `qimg convert`.
pub fn run_convert(a: ConvertArgs) -> ExitCode {
    match convert(a) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("qimg: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// One source image, read through its whole chain.
#[derive(Clone)]
enum Reader {
    Qcow2(Image<AnyStorage>),
    Raw(Arc<AnyStorage>),
}

impl Reader {
    async fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        match self {
            Reader::Qcow2(img) => img.read(buf, offset).await.map_err(|e| anyhow!("{e}")),
            Reader::Raw(f) => f
                .read_at_zero_fill(buf, offset)
                .await
                .map_err(|e| anyhow!("{e}")),
        }
    }
}

/// Where the guest data is read from: the sources end to end (`(start, size, reader)` each,
/// `start` being where the source begins in the output).
#[derive(Clone)]
struct Source(Arc<Vec<(u64, u64, Reader)>>);

impl Source {
    async fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let end = offset + buf.len() as u64;
        for (start, size, r) in self.0.iter() {
            let s = offset.max(*start);
            let e = end.min(start + size);
            if s < e {
                let part = &mut buf[(s - offset) as usize..(e - offset) as usize];
                r.read(part, s - start).await?;
            }
        }
        Ok(())
    }
}

/// The output's file: buffered or `O_DIRECT` (any alignment, bounced), and with `-t unsafe`
/// a flush that does nothing.
#[derive(Clone)]
struct OutStorage {
    inner: Arc<AnyStorage>,
    no_flush: bool,
}

impl OutStorage {
    fn open(path: &Path, writable: bool, mode: CacheMode) -> Result<Self, StorageError> {
        Ok(Self {
            inner: Arc::new(AnyStorage::open(
                path,
                writable,
                Backend::Threads,
                mode.direct,
            )?),
            no_flush: mode.no_flush,
        })
    }
}

impl Storage for OutStorage {
    fn read_at_most(
        &self,
        buf: &mut [u8],
        offset: u64,
    ) -> impl Future<Output = qimg::io::Result<usize>> + Send {
        self.inner.read_at_most(buf, offset)
    }
    fn read_at(
        &self,
        buf: &mut [u8],
        offset: u64,
    ) -> impl Future<Output = qimg::io::Result<()>> + Send {
        self.inner.read_at(buf, offset)
    }
    fn read_at_zero_fill(
        &self,
        buf: &mut [u8],
        offset: u64,
    ) -> impl Future<Output = qimg::io::Result<()>> + Send {
        self.inner.read_at_zero_fill(buf, offset)
    }
    fn write_at(
        &self,
        buf: &[u8],
        offset: u64,
    ) -> impl Future<Output = qimg::io::Result<()>> + Send {
        self.inner.write_at(buf, offset)
    }
    fn write_vectored_at(
        &self,
        bufs: &[IoSlice<'_>],
        offset: u64,
    ) -> impl Future<Output = qimg::io::Result<()>> + Send {
        self.inner.write_vectored_at(bufs, offset)
    }
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
    ) -> impl Future<Output = qimg::io::Result<ZeroOutcome>> + Send {
        self.inner.write_zeroes(offset, len)
    }
    fn discard(
        &self,
        offset: u64,
        len: u64,
    ) -> impl Future<Output = qimg::io::Result<DiscardOutcome>> + Send {
        self.inner.discard(offset, len)
    }
    fn allocate(
        &self,
        offset: u64,
        len: u64,
    ) -> impl Future<Output = qimg::io::Result<AllocateOutcome>> + Send {
        self.inner.allocate(offset, len)
    }
    fn flush(&self) -> impl Future<Output = qimg::io::Result<()>> + Send {
        let flush = (!self.no_flush).then(|| self.inner.flush());
        async move {
            match flush {
                Some(f) => f.await,
                None => Ok(()),
            }
        }
    }
    fn len(&self) -> impl Future<Output = qimg::io::Result<u64>> + Send {
        self.inner.len()
    }
    fn set_len(&self, len: u64) -> impl Future<Output = qimg::io::Result<()>> + Send {
        self.inner.set_len(len)
    }
    fn request_alignment(&self) -> usize {
        self.inner.request_alignment()
    }
    fn mem_alignment(&self) -> usize {
        self.inner.mem_alignment()
    }
}

/// The output image.
#[derive(Clone)]
enum Out {
    Qcow2(Image<OutStorage>),
    Raw(OutStorage),
}

/// Where it is written; with `writethrough` every write is followed by a flush.
#[derive(Clone)]
struct Target {
    out: Out,
    writethrough: bool,
}

impl Target {
    /// The flush of a writethrough cache mode.
    async fn written(&self) -> Result<()> {
        if self.writethrough {
            self.flush().await?;
        }
        Ok(())
    }

    async fn flush(&self) -> Result<()> {
        match &self.out {
            Out::Qcow2(img) => img.flush().await.map_err(|e| anyhow!("{e}")),
            Out::Raw(f) => f.flush().await.map_err(|e| anyhow!("{e}")),
        }
    }

    async fn write(&self, buf: &[u8], offset: u64) -> Result<()> {
        match &self.out {
            Out::Qcow2(img) => img.write(buf, offset).await.map_err(|e| anyhow!("{e}"))?,
            Out::Raw(f) => f.write_at(buf, offset).await.map_err(|e| anyhow!("{e}"))?,
        }
        self.written().await
    }

    async fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        match &self.out {
            Out::Qcow2(img) => img
                .write_zeroes(offset, len)
                .await
                .map_err(|e| anyhow!("{e}"))?,
            Out::Raw(f) => {
                f.write_zeroes(offset, len)
                    .await
                    .map_err(|e| anyhow!("{e}"))?;
            }
        }
        self.written().await
    }

    async fn write_compressed(&self, buf: &[u8], offset: u64) -> Result<()> {
        match &self.out {
            Out::Qcow2(img) => img
                .write_compressed(offset, buf)
                .await
                .map_err(|e| anyhow!("{e}"))?,
            Out::Raw(_) => bail!("Compression not supported for this file format"),
        }
        self.written().await
    }

    async fn finish(&self) -> Result<()> {
        match &self.out {
            Out::Qcow2(img) => img.close().await.map_err(|e| anyhow!("{e}")),
            Out::Raw(f) => f.flush().await.map_err(|e| anyhow!("{e}")),
        }
    }
}

/// How chunks are written.
#[derive(Clone, Copy)]
struct Plan {
    /// Virtual size of the copy.
    size: u64,
    /// Zero detection granularity (0: none, write everything).
    gran: u64,
    /// Write compressed clusters of this size (0: no compression).
    compress_cluster: u64,
    /// The target may hold old data: zero ranges are zeroed.
    zero_target: bool,
    /// Source zero ranges are copied as data (`-S 0`).
    all_data: bool,
    /// Chunks in flight.
    parallel: usize,
    /// Chunks write in guest order.
    in_order: bool,
    /// The output has a backing file: ranges the source reads from its backing chain are
    /// not copied, and read ranges are not widened (the widening could reach such ranges).
    skip_backing: bool,
    /// Where the backing file of a new output ends: past it the output reads zeros, so ranges
    /// the source maps as zero are not written there (`u64::MAX`: everywhere).
    zeros_from: u64,
}

/// One chunk of work: data ranges to copy and (with `-n`) zero ranges to clear.
struct Job {
    start: u64,
    end: u64,
    data: Vec<(u64, u64)>,
    zeros: Vec<(u64, u64)>,
}

fn push_range(v: &mut Vec<(u64, u64)>, start: u64, end: u64) {
    if let Some(last) = v.last_mut() {
        if last.1 >= start {
            last.1 = last.1.max(end);
            return;
        }
    }
    v.push((start, end));
}

/// Writes the maximal runs of non-zero `gran` blocks of `buf` (at guest `offset`); with
/// `zero_target`, zero blocks are zeroed in the target.
async fn write_nonzero(
    dst: &Target,
    buf: &[u8],
    offset: u64,
    gran: u64,
    zero_target: bool,
) -> Result<()> {
    let gran = gran as usize;
    let mut at = 0usize;
    while at < buf.len() {
        let block_is_zero = |i: usize| {
            let end = (i + gran).min(buf.len());
            buf[i..end].iter().all(|&b| b == 0)
        };
        let zero = block_is_zero(at);
        let mut end = (at + gran).min(buf.len());
        while end < buf.len() && block_is_zero(end) == zero {
            end = (end + gran).min(buf.len());
        }
        let off = offset + at as u64;
        if !zero {
            dst.write(&buf[at..end], off)
                .await
                .with_context(|| format!("error while writing at byte {off}"))?;
        } else if zero_target {
            dst.write_zeroes(off, (end - at) as u64)
                .await
                .with_context(|| format!("error while writing at byte {off}"))?;
        }
        at = end;
    }
    Ok(())
}

/// Copies one chunk; returns the data bytes it covered (for progress). The chunk is read at
/// once; with `turn`, writing waits until the previous chunk has written (in-order writes keep
/// the target's clusters in guest order, as qemu-img without `-W`), and `done` tells the next.
async fn run_job(
    src: Source,
    dst: Target,
    job: Job,
    plan: Plan,
    turn: Option<oneshot::Receiver<()>>,
    done: Option<oneshot::Sender<()>>,
) -> Result<u64> {
    let unit = if plan.compress_cluster > 0 {
        plan.compress_cluster
    } else if plan.skip_backing {
        1
    } else {
        plan.gran.max(1)
    };
    let limit = job.end.min(plan.size);
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    let mut covered = 0;
    for &(s, e) in &job.data {
        covered += e - s;
        let s = (s - s % unit).max(job.start);
        let e = e.next_multiple_of(unit).min(limit);
        push_range(&mut ranges, s, e);
    }
    let mut bufs = Vec::with_capacity(ranges.len());
    for (s, e) in ranges {
        let mut buf = vec![0u8; (e - s) as usize];
        src.read(&mut buf, s)
            .await
            .with_context(|| format!("error while reading at byte {s}"))?;
        bufs.push((s, buf));
    }
    if let Some(turn) = turn {
        // An error in the previous chunk drops its sender; that error is reported anyway.
        let _ = turn.await;
    }
    for &(s, e) in &job.zeros {
        dst.write_zeroes(s, e - s)
            .await
            .with_context(|| format!("error while writing at byte {s}"))?;
    }
    for (s, buf) in bufs {
        if plan.compress_cluster > 0 {
            let cs = plan.compress_cluster as usize;
            for (i, cluster) in buf.chunks(cs).enumerate() {
                let off = s + (i * cs) as u64;
                if cluster.iter().all(|&b| b == 0) {
                    if plan.zero_target {
                        dst.write_zeroes(off, cluster.len() as u64)
                            .await
                            .with_context(|| format!("error while writing at byte {off}"))?;
                    }
                    continue;
                }
                dst.write_compressed(cluster, off)
                    .await
                    .with_context(|| format!("error while writing at byte {off}"))?;
            }
        } else if plan.gran > 0 {
            write_nonzero(&dst, &buf, s, plan.gran, plan.zero_target).await?;
        } else {
            dst.write(&buf, s)
                .await
                .with_context(|| format!("error while writing at byte {s}"))?;
        }
    }
    if let Some(done) = done {
        let _ = done.send(());
    }
    Ok(covered)
}

/// Progress printed as qemu-img does: `    (12.34/100%)\r` on stdout, at every whole percent.
struct Progress {
    on: bool,
    total: u64,
    done: u64,
    last: f64,
}

impl Progress {
    fn print(&self, pct: f64) {
        use std::io::Write;
        print!("    ({pct:3.2}/100%)\r");
        let _ = std::io::stdout().flush();
    }

    fn start(&mut self) {
        if self.on {
            self.print(0.0);
        }
    }

    fn add(&mut self, n: u64) {
        self.done += n;
        if !self.on || self.total == 0 {
            return;
        }
        let pct = (self.done as f64 * 100.0 / self.total as f64).min(100.0);
        if pct - self.last >= 1.0 || (pct >= 100.0 && self.last < 100.0) {
            self.last = pct;
            self.print(pct);
        }
    }

    fn end(&mut self) {
        if self.on {
            self.print(100.0);
            println!();
        }
    }
}

fn parse_fmt(s: &str) -> Result<ImageFormat> {
    match s {
        "qcow2" => Ok(ImageFormat::Qcow2),
        "raw" => Ok(ImageFormat::Raw),
        _ => bail!("Unknown file format '{s}'"),
    }
}

/// Parses a `-t` / `-T` value (`what` names the option in the error, as qemu-img does).
fn parse_cache(v: Option<&str>, what: &str) -> Result<CacheMode> {
    match v {
        None => Ok(CacheMode::DEFAULT),
        Some(s) => CacheMode::parse(s).map_err(|_| anyhow!("Invalid {what} option: {s}")),
    }
}

/// One source: its chain (for the block status) and where it lands in the output.
struct Src {
    layers: Vec<Layer>,
    /// First output byte of this source.
    start: u64,
    /// Its virtual size.
    size: u64,
}

fn convert(a: ConvertArgs) -> Result<()> {
    let _ = a.force_share;
    let out_name = a.out_fmt.clone().unwrap_or_else(|| "raw".to_string());
    let out_fmt = parse_fmt(&out_name)?;
    let pairs: Vec<String> = a.options.iter().flat_map(|o| opts::split_opts(o)).collect();
    if pairs.iter().any(|p| p == "help" || p == "?") {
        print!("{}", opts::help_text(&out_name));
        return Ok(());
    }
    let cache = parse_cache(a.cache.as_deref(), "cache")?;
    let src_cache = parse_cache(a.src_cache.as_deref(), "source cache")?;
    if out_fmt == ImageFormat::Raw {
        if a.backing.is_some() {
            bail!("Backing file not supported for file format 'raw'");
        }
        if a.backing_fmt.is_some() {
            bail!("Backing file format not supported for file format 'raw'");
        }
    }
    if a.compress && out_fmt != ImageFormat::Qcow2 {
        bail!("Compression not supported for this file format");
    }
    let sparse = match &a.sparse {
        None => 4096,
        Some(s) => match opts::parse_size(s) {
            Some(v) if v % 512 == 0 && v <= 16 << 20 => v,
            _ => bail!(
                "Invalid buffer size for sparse output specified. Valid sizes are multiples of \
                 512 up to 16777216. Select 0 to disable sparse detection (fully allocates output)."
            ),
        },
    };
    let parallel = match &a.parallel {
        None => 8,
        Some(s) => match s.parse::<usize>() {
            Ok(n) if (1..=16).contains(&n) => n,
            _ => bail!("Invalid number of coroutines specified. Must be between 1 and 16."),
        },
    };
    let Some((dst_file, src_files)) = a.files.split_last().filter(|(_, s)| !s.is_empty()) else {
        bail!("Must specify image file name");
    };
    let dst_path = Path::new(dst_file);

    // The output's options, parsed and checked before anything is opened or created; -B and
    // -F override -o backing_file and backing_fmt, as in qemu-img.
    let mut co = CreateOptions::default();
    let mut given = opts::Given::default();
    opts::apply(&mut co, &mut given, &pairs, &out_name)?;
    if a.no_create && !pairs.is_empty() {
        bail!("-o has no effect with -n (the output is not created)");
    }
    if let Some(b) = &a.backing {
        co.backing_file = Some(b.clone());
    }
    if let Some(f) = &a.backing_fmt {
        co.backing_fmt = Some(f.clone());
    }
    let has_backing = co.backing_file.is_some();
    if has_backing && src_files.len() > 1 {
        bail!(
            "Having a backing file for the target makes no sense when concatenating multiple \
             input images"
        );
    }
    if !a.no_create {
        if has_backing && co.backing_fmt.is_none() {
            bail!("Use of backing file requires explicit backing format");
        }
        if !has_backing && co.backing_fmt.is_some() {
            bail!(
                "{dst_file}: error while converting {out_name}: Backing format cannot be used \
                 without backing file"
            );
        }
    }

    let src_fmts = src_files
        .iter()
        .map(|file| match a.src_fmt.as_deref() {
            Some(f) => {
                parse_fmt(f).map_err(|_| anyhow!("Could not open '{file}': Unknown driver '{f}'"))
            }
            None => probe_format(Path::new(file))
                .map_err(|e| anyhow!("Could not open '{file}': {}", lib_msg(&e, file))),
        })
        .collect::<Result<Vec<_>>>()?;

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
        let mut srcs = Vec::new();
        let mut readers = Vec::new();
        let mut size = 0u64;
        for (file, &fmt) in src_files.iter().zip(&src_fmts) {
            let path = Path::new(file);
            let layers = open_chain(path, file, fmt).await?;
            refuse_overwriting_source(&layers, dst_path, dst_file)?;
            let src_size = layers[0].size();
            let reader =
                match fmt {
                    ImageFormat::Qcow2 => {
                        let o = OpenOptions::new()
                            .direct(src_cache.direct)
                            .clean_timer(false);
                        Reader::Qcow2(o.open(path).await.map_err(|e| {
                            anyhow!("Could not open '{file}': {}", lib_msg(&e, file))
                        })?)
                    }
                    ImageFormat::Raw => Reader::Raw(Arc::new(
                        AnyStorage::open(path, false, Backend::Threads, src_cache.direct)
                            .map_err(|e| anyhow!("Could not open '{file}': {e}"))?,
                    )),
                };
            readers.push((size, src_size, reader));
            srcs.push(Src {
                layers,
                start: size,
                size: src_size,
            });
            size = size
                .checked_add(src_size)
                .ok_or_else(|| anyhow!("the sources add up to more than 16 EiB"))?;
        }
        let source = Source(Arc::new(readers));

        if !a.no_create {
            let mut nop = |_: u64, _: u64| {};
            if out_fmt == ImageFormat::Raw {
                create_raw(dst_path, size, co.preallocation, &mut nop).map_err(|e| {
                    anyhow!(
                        "{dst_file}: error while converting raw: {}",
                        lib_msg(&e, dst_file)
                    )
                })?;
            } else {
                co.size = Some(size);
                co.validate()
                    .and_then(|()| create(dst_path, &co, &mut nop).map(|_| ()))
                    .map_err(|e| {
                        anyhow!(
                            "{dst_file}: error while converting qcow2: {}",
                            lib_msg(&e, dst_file)
                        )
                    })?;
            }
        }
        let target = open_target(dst_path, dst_file, out_fmt, size, cache).await?;

        let (gran, compress_cluster) = match &target.out {
            Out::Qcow2(img) if a.compress => (sparse, img.cluster_size()),
            Out::Qcow2(img) if sparse > 0 => (img.subcluster_size(), 0),
            _ => (sparse, 0),
        };
        let plan = Plan {
            size,
            gran,
            compress_cluster,
            // A backing file may hold data where the source reads zeros: write them.
            zero_target: a.no_create || has_backing,
            all_data: sparse == 0,
            parallel,
            // Compressed clusters are packed wherever they land; compress them in parallel.
            in_order: !a.out_of_order && compress_cluster == 0,
            skip_backing: has_backing,
            zeros_from: match &target.out {
                Out::Qcow2(img) if has_backing && !a.no_create => backing_len(img).await?,
                _ => u64::MAX,
            },
        };
        let mut progress = Progress {
            on: a.progress && !a.quiet,
            total: 0,
            done: 0,
            last: 0.0,
        };
        if progress.on {
            progress.total = data_bytes(&srcs, plan).await?;
        }
        progress.start();
        copy(&srcs, source, target.clone(), plan, &mut progress).await?;
        target
            .finish()
            .await
            .with_context(|| format!("error while closing '{dst_file}'"))?;
        progress.end();
        Ok(())
    })
}

/// The virtual size of the output's backing file (raw files round up to 512 bytes, as in
/// QEMU).
async fn backing_len(img: &Image<OutStorage>) -> Result<u64> {
    Ok(match img.backing() {
        Some(qimg::Backing::Qcow2(b)) => b.size(),
        Some(qimg::Backing::Raw { storage, path }) => storage
            .len()
            .await
            .map_err(|e| anyhow!("{}: {e}", path.display()))?
            .next_multiple_of(512),
        None => u64::MAX,
    })
}

/// Refuses an output that is the source or a file of its chain (creating it would destroy the
/// data being read).
fn refuse_overwriting_source(layers: &[Layer], dst: &Path, file: &str) -> Result<()> {
    let Ok(dst) = std::fs::canonicalize(dst) else {
        return Ok(());
    };
    for l in layers {
        for p in l.files() {
            if std::fs::canonicalize(&p).is_ok_and(|p| p == dst) {
                bail!(
                    "Could not open '{file}': the output is the source image or a file of its \
                     backing chain"
                );
            }
        }
    }
    Ok(())
}

async fn open_target(
    path: &Path,
    file: &str,
    fmt: ImageFormat,
    size: u64,
    cache: CacheMode,
) -> Result<Target> {
    if let Err(e) = std::fs::metadata(path) {
        bail!("Could not open '{file}': {}", os_msg(&e));
    }
    let out = match fmt {
        ImageFormat::Qcow2 => {
            let o = OpenOptions::new()
                .writable(true)
                .direct(cache.direct)
                .clean_timer(false);
            let opener = move |p: &Path, writable: bool| OutStorage::open(p, writable, cache);
            let img = o
                .open_with(path, &opener)
                .await
                .map_err(|e| anyhow!("Could not open '{file}': {}", lib_msg(&e, file)))?;
            if img.size() < size {
                bail!("output file is smaller than input file");
            }
            Out::Qcow2(img)
        }
        ImageFormat::Raw => {
            let f = OutStorage::open(path, true, cache)
                .map_err(|e| anyhow!("Could not open '{file}': {e}"))?;
            let len = f.len().await.map_err(|e| anyhow!("{file}: {e}"))?;
            if len < size {
                bail!("output file is smaller than input file");
            }
            Out::Raw(f)
        }
    };
    Ok(Target {
        out,
        writethrough: cache.writethrough,
    })
}

/// Cuts the sources' status into chunk jobs, in output order: every chunk with data (or, with
/// `zeros`, zero ranges). `all_data` treats zero ranges as data (`-S 0`); `skip_backing`
/// leaves out what a source reads from its backing chain.
struct Jobs<'a> {
    srcs: &'a [Src],
    all_data: bool,
    zeros: bool,
    skip_backing: bool,
    zeros_from: u64,
    /// Zero ranges are read as data: compressed clusters are written whole, and with a
    /// backing file a cluster partly zero is copied whole from the source, as qemu-img does.
    zeros_as_data: bool,
    /// The source being walked, and the next byte of it to ask about.
    src: usize,
    at: u64,
    current: Option<Job>,
    ready: VecDeque<Job>,
}

impl<'a> Jobs<'a> {
    fn new(srcs: &'a [Src], plan: Plan, zeros: bool) -> Self {
        Self {
            srcs,
            all_data: plan.all_data,
            zeros,
            skip_backing: plan.skip_backing,
            zeros_from: plan.zeros_from,
            zeros_as_data: plan.skip_backing && plan.compress_cluster > 0,
            src: 0,
            at: 0,
            current: None,
            ready: VecDeque::new(),
        }
    }

    async fn next(&mut self) -> Result<Option<Job>> {
        loop {
            if let Some(j) = self.ready.pop_front() {
                return Ok(Some(j));
            }
            let Some(src) = self.srcs.get(self.src) else {
                return Ok(self.current.take());
            };
            if self.at >= src.size {
                self.src += 1;
                self.at = 0;
                continue;
            }
            let n = WINDOW.min(src.size - self.at);
            let mut entries = Vec::new();
            status(&src.layers, 0, self.at, n, &mut entries).await?;
            self.at += n;
            for e in &entries {
                if self.skip_backing && e.depth > 0 {
                    continue;
                }
                let is_data = self.all_data || self.zeros_as_data || !e.zero;
                if !is_data && !self.zeros {
                    continue;
                }
                let mut s = src.start + e.start;
                let mut end = s + e.length;
                if e.zero {
                    end = end.min(self.zeros_from.max(s));
                }
                while s < end {
                    let chunk = s - s % CHUNK;
                    let ce = (chunk + CHUNK).min(end);
                    if self.current.as_ref().is_some_and(|j| j.start != chunk) {
                        self.ready.extend(self.current.take());
                    }
                    let j = self.current.get_or_insert_with(|| Job {
                        start: chunk,
                        end: chunk + CHUNK,
                        data: Vec::new(),
                        zeros: Vec::new(),
                    });
                    if is_data {
                        push_range(&mut j.data, s, ce);
                    } else if self.skip_backing {
                        // One zero write per status entry, as qemu-img: a write of zeros
                        // over part of a cluster reads the rest from the backing file, so
                        // where requests split shows in how the output stores the zeros.
                        j.zeros.push((s, ce));
                    } else {
                        push_range(&mut j.zeros, s, ce);
                    }
                    s = ce;
                }
            }
        }
    }
}

/// The data bytes the copy will read (the progress total).
async fn data_bytes(srcs: &[Src], plan: Plan) -> Result<u64> {
    let mut jobs = Jobs::new(srcs, plan, false);
    let mut total = 0;
    while let Some(j) = jobs.next().await? {
        total += j.data.iter().map(|(s, e)| e - s).sum::<u64>();
    }
    Ok(total)
}

fn joined(r: Option<std::result::Result<Result<u64>, tokio::task::JoinError>>) -> Result<u64> {
    match r {
        None => Ok(0),
        Some(Ok(r)) => r,
        Some(Err(e)) => Err(anyhow!("copy task failed: {e}")),
    }
}

async fn copy(
    srcs: &[Src],
    source: Source,
    target: Target,
    plan: Plan,
    progress: &mut Progress,
) -> Result<()> {
    let mut set: JoinSet<Result<u64>> = JoinSet::new();
    let mut jobs = Jobs::new(srcs, plan, plan.zero_target);
    let r: Result<()> = async {
        let mut prev: Option<oneshot::Receiver<()>> = None;
        while let Some(job) = jobs.next().await? {
            while set.len() >= plan.parallel {
                progress.add(joined(set.join_next().await)?);
            }
            let (turn, done) = if plan.in_order {
                let (tx, rx) = oneshot::channel();
                (prev.replace(rx), Some(tx))
            } else {
                (None, None)
            };
            set.spawn(run_job(
                source.clone(),
                target.clone(),
                job,
                plan,
                turn,
                done,
            ));
        }
        while !set.is_empty() {
            progress.add(joined(set.join_next().await)?);
        }
        Ok(())
    }
    .await;
    if r.is_err() {
        set.abort_all();
        while set.join_next().await.is_some() {}
    }
    r
}

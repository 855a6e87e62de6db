//! `qimg bench`: qemu-img bench's options, defaults, request sequence and output, on qimg's
//! engine (qcow2) or directly on the storage (raw), plus a report qemu-img does not give:
//! IOPS, throughput, latency percentiles, L2 cache hit rate, copy-on-write bytes and clusters
//! allocated (`--output json` for scripts), random offsets, timed runs and cache options.
//!
//! ```text
//! qimg bench [-f FMT | --image-opts] [-t CACHE] [-c COUNT] [-d DEPTH] [-o OFFSET]
//!            [-s BUFFER_SIZE] [-S STEP_SIZE] [-i AIO] [-n] [-q] [-U]
//!            [-w [--pattern PATTERN] [--flush-interval INTERVAL [--no-drain]]]
//!            [--random [--seed N]] [--time SECONDS] [--l2-cache-size SIZE]
//!            [--l2-cache-entry-size SIZE] [--refcount-cache-size SIZE] [--cache-size SIZE]
//!            [--cache-clean-interval SECONDS] [--runtime current|multi]
//!            [--completions runtime|thread] [--output human|json] FILENAME
//! ```
//!
//! Backends: `-i threads` is `FileStorage` (system calls inline on the runtime thread for
//! buffered I/O, on tokio's blocking thread pool with O_DIRECT, like QEMU's thread pool);
//! `-i io_uring` (and `-i native`, which QEMU's rules otherwise follow) is `UringStorage`,
//! whose completions the runtime's I/O driver waits for (`--completions runtime`, with
//! batched submission) or its own completion thread. O_DIRECT (`-t none`, `-t directsync`)
//! goes through `BounceStorage`. The default runtime is one thread, QEMU's event-loop model;
//! docs/PERFORMANCE.md has the measurements behind these defaults.
//!
//! Request `i` (from 0) goes to `offset` for `i = 0` and to `(offset + i * step) % size`
//! after that, which is what qemu-img 10.0 bench issues (`b->offset += step; b->offset %=
//! image_size`); a request that then runs past the end of the image fails the run, as it does
//! in qemu-img. So the same options write the same bytes with both tools.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use qimg::chain::{ImageFormat, probe_format};
use qimg::io::{BlockingStrategy, BounceStorage, FileOptions, Storage, StorageError, UringOptions};
use qimg::{CacheOptions, CacheStats, Image, OpenOptions, Stats};

use crate::bench_hist::Histogram;
use crate::bench_parse::{self as parse, Aio, CacheMode, INT_MAX, INT64_MAX};
use crate::bench_run::{Offsets, Outcome, Plan, Raw, Target, drive};

/// Arguments of `qimg bench` (boxed: they are many, and the subcommand enum stays small).
#[derive(clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    opts: Box<BenchOpts>,
}

/// The options of `qimg bench`.
#[derive(clap::Args)]
struct BenchOpts {
    /// Number of I/O requests to perform (default 75000).
    #[arg(short = 'c', long = "count", allow_hyphen_values = true)]
    count: Option<String>,
    /// Number of requests to perform in parallel (default 64).
    #[arg(short = 'd', long = "depth", allow_hyphen_values = true)]
    depth: Option<String>,
    /// Image format: qcow2 or raw (probed when absent).
    #[arg(short = 'f', long = "format")]
    fmt: Option<String>,
    /// FILENAME is an option string: driver=qcow2,file.filename=X,l2-cache-size=...
    #[arg(long = "image-opts")]
    image_opts: bool,
    /// Cache mode: none (O_DIRECT), writeback (default), writethrough, directsync, unsafe.
    #[arg(short = 't', long = "cache")]
    cache: Option<String>,
    /// Issue a flush after this number of requests (write tests only).
    #[arg(long = "flush-interval", allow_hyphen_values = true)]
    flush_interval: Option<String>,
    /// Do not wait for the requests in flight before a flush.
    #[arg(long = "no-drain")]
    no_drain: bool,
    /// Backend: threads (positioned system calls), io_uring, native (io_uring, needs -t none).
    #[arg(short = 'i', long = "aio")]
    aio: Option<String>,
    /// Use the native AIO backend (requires -t none or -t directsync, as in qemu-img).
    #[arg(short = 'n', long = "native")]
    native: bool,
    /// Start the first request at this offset.
    #[arg(short = 'o', long = "offset", allow_hyphen_values = true)]
    offset: Option<String>,
    /// Byte written by write tests (default 0, as qemu-img).
    #[arg(long = "pattern", allow_hyphen_values = true)]
    pattern: Option<String>,
    /// Quiet: accepted like qemu-img (whose summary lines it does not silence); drops qimg's
    /// own report.
    #[arg(short = 'q', long = "quiet")]
    quiet: bool,
    /// Size of each request (default 4k).
    #[arg(short = 's', long = "buffer-size", allow_hyphen_values = true)]
    buffer_size: Option<String>,
    /// Offset increment between requests (default: the buffer size; 0 means the default).
    #[arg(short = 'S', long = "step-size", allow_hyphen_values = true)]
    step: Option<String>,
    /// Perform a write test (default: read).
    #[arg(short = 'w', long = "write")]
    write: bool,
    /// Open in shared mode (qimg takes no locks); read tests only.
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// qimg: uniformly random offsets, aligned to the buffer size, from OFFSET to the end.
    #[arg(long)]
    random: bool,
    /// qimg: seed of --random (default 0); the same seed gives the same offsets.
    #[arg(long, allow_hyphen_values = true)]
    seed: Option<String>,
    /// qimg: run for this many seconds instead of a request count (with -c, whichever ends
    /// first).
    #[arg(long = "time", allow_hyphen_values = true)]
    time: Option<String>,
    /// qimg: qcow2 l2-cache-size.
    #[arg(long = "l2-cache-size")]
    l2_cache_size: Option<String>,
    /// qimg: qcow2 l2-cache-entry-size.
    #[arg(long = "l2-cache-entry-size")]
    l2_cache_entry_size: Option<String>,
    /// qimg: qcow2 refcount-cache-size.
    #[arg(long = "refcount-cache-size")]
    refcount_cache_size: Option<String>,
    /// qimg: qcow2 cache-size (L2 and refcount caches together).
    #[arg(long = "cache-size")]
    cache_size: Option<String>,
    /// qimg: qcow2 cache-clean-interval in seconds (0 disables).
    #[arg(long = "cache-clean-interval")]
    cache_clean_interval: Option<String>,
    /// qimg: io_uring completions are awaited by the runtime's I/O driver, with batched
    /// submission (runtime, the default), or by the storage's completion thread (thread).
    #[arg(long, default_value = "runtime")]
    completions: String,
    /// qimg: tokio runtime: current (one thread, like QEMU's event loop; the default) or
    /// multi (a worker thread per core).
    #[arg(long, default_value = "current")]
    runtime: String,
    /// qimg: report format: human (qemu-img's lines, then qimg's report) or json.
    #[arg(long, default_value = "human")]
    output: String,
    /// The image (or, with --image-opts, its option string).
    filename: Option<String>,
}

/// The run, from the arguments.
#[derive(Debug)]
struct Config {
    path: PathBuf,
    /// As the user named it (for messages).
    name: String,
    fmt: Option<ImageFormat>,
    count: Option<u64>,
    depth: u64,
    offset: u64,
    bufsize: u64,
    step: u64,
    pattern: u8,
    write: bool,
    flush_interval: u64,
    drain: bool,
    aio: Aio,
    cache_mode: CacheMode,
    cache: CacheOptions,
    random: Option<u64>,
    duration: Option<Duration>,
    multi_thread: bool,
    on_runtime: bool,
    json: bool,
    quiet: bool,
}

fn config(a: BenchOpts) -> Result<Config, String> {
    let count = a
        .count
        .as_deref()
        .map(|s| parse::int("request count", s, 1, INT_MAX))
        .transpose()?;
    let depth = match &a.depth {
        Some(s) => parse::int("queue depth", s, 1, INT_MAX)?,
        None => 64,
    };
    let offset = match &a.offset {
        Some(s) => parse::size("offset", s, 0, INT64_MAX)?,
        None => 0,
    };
    let bufsize = match &a.buffer_size {
        Some(s) => parse::size("buffer size", s, 1, INT_MAX)?,
        None => 4096,
    };
    let step = match &a.step {
        Some(s) => parse::size("step size", s, 0, INT_MAX)?,
        None => 0,
    };
    let pattern = match &a.pattern {
        Some(s) => parse::int("pattern byte", s, 0, 255)? as u8,
        None => 0,
    };
    let flush_interval = match &a.flush_interval {
        Some(s) => parse::int("flush interval", s, 0, INT_MAX)?,
        None => 0,
    };
    let mut aio = match &a.aio {
        Some(s) => Aio::parse(s)?,
        None if a.native => Aio::Native,
        None => Aio::Threads,
    };
    let mut cache_mode = match &a.cache {
        Some(s) => CacheMode::parse(s)?,
        None => CacheMode::DEFAULT,
    };
    let mut cache = CacheOptions::default();
    for (key, v) in [
        ("l2-cache-size", &a.l2_cache_size),
        ("l2-cache-entry-size", &a.l2_cache_entry_size),
        ("refcount-cache-size", &a.refcount_cache_size),
        ("cache-size", &a.cache_size),
        ("cache-clean-interval", &a.cache_clean_interval),
    ] {
        if let Some(v) = v {
            parse::cache_option(&mut cache, key, v)?;
        }
    }
    let random = if a.random {
        Some(match &a.seed {
            Some(s) => parse::int("seed", s, 0, u64::MAX)?,
            None => 0,
        })
    } else {
        if a.seed.is_some() {
            return Err("--seed is only meaningful with --random".into());
        }
        None
    };
    let duration = match &a.time {
        None => None,
        Some(s) => {
            let secs: f64 = s
                .trim()
                .parse()
                .ok()
                .filter(|v: &f64| v.is_finite() && *v > 0.0 && *v <= 1e9)
                .ok_or_else(|| format!("Invalid time specified: '{s}' (seconds, above 0)."))?;
            Some(Duration::from_secs_f64(secs))
        }
    };
    let on_runtime = match a.completions.as_str() {
        "runtime" => true,
        "thread" => false,
        other => {
            return Err(format!(
                "--completions expects 'runtime' or 'thread' not '{other}'"
            ));
        }
    };
    let multi_thread = match a.runtime.as_str() {
        "multi" => true,
        "current" => false,
        other => {
            return Err(format!(
                "--runtime expects 'multi' or 'current' not '{other}'"
            ));
        }
    };
    let json = match a.output.as_str() {
        "human" => false,
        "json" => true,
        other => return Err(format!("--output expects 'human' or 'json' not '{other}'")),
    };
    let Some(filename) = a.filename else {
        return Err("Expecting one image file name".into());
    };
    if a.image_opts && a.fmt.is_some() {
        return Err("--image-opts and --format are mutually exclusive".into());
    }
    let (name, fmt) = if a.image_opts {
        let io = parse::image_opts(&filename, &mut cache)?;
        if let Some(d) = io.direct {
            cache_mode.direct = d;
        }
        if let Some(nf) = io.no_flush {
            cache_mode.no_flush = nf;
        }
        if let Some(x) = io.aio {
            aio = x;
        }
        let name = io
            .filename
            .ok_or("--image-opts: file.filename is missing")?;
        (name, io.driver)
    } else {
        (filename, a.fmt)
    };
    let fmt = match fmt.as_deref() {
        None => None,
        Some("qcow2") => Some(ImageFormat::Qcow2),
        Some("raw") => Some(ImageFormat::Raw),
        Some(other) => return Err(format!("Unknown file format '{other}'")),
    };
    if !a.write && flush_interval > 0 {
        return Err("--flush-interval is only available in write tests".into());
    }
    if flush_interval > 0 && flush_interval < depth {
        return Err("Flush interval can't be smaller than depth".into());
    }
    if a.write && a.force_share {
        return Err(format!(
            "Could not open '{name}': force-share=on can only be used with read-only images"
        ));
    }
    if aio == Aio::Native && !cache_mode.direct {
        return Err(format!(
            "Could not open '{name}': aio=native was specified, but it requires \
             cache.direct=on, which was not specified."
        ));
    }
    // Requests past the count are never issued, so more workers than requests would idle.
    let workers = count.map_or(depth, |c| depth.min(c));
    // Each worker owns a buffer and a latency histogram (30 KiB).
    let memory = workers.saturating_mul(bufsize + (30 << 10));
    if memory > 8 << 30 {
        return Err(format!(
            "Invalid queue depth specified: {depth} requests of {bufsize} bytes in flight need \
             {} MiB of buffers (at most 8 GiB)",
            memory >> 20
        ));
    }
    Ok(Config {
        path: PathBuf::from(&name),
        name,
        fmt,
        count: match (count, duration) {
            (Some(c), _) => Some(c),
            (None, Some(_)) => None,
            (None, None) => Some(75000),
        },
        depth,
        offset,
        bufsize,
        step: if step == 0 { bufsize } else { step },
        pattern,
        write: a.write,
        flush_interval,
        drain: !a.no_drain,
        aio,
        cache_mode,
        cache,
        random,
        duration,
        multi_thread,
        on_runtime,
        json,
        quiet: a.quiet,
    })
}

/// Runs `qimg bench`.
pub fn run_bench(a: BenchArgs) -> ExitCode {
    let cfg = match config(*a.opts) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("qimg: {e}");
            return ExitCode::from(1);
        }
    };
    match run(&cfg) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("qimg: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn run(cfg: &Config) -> Result<()> {
    let fmt = match cfg.fmt {
        Some(f) => f,
        None => probe_format(&cfg.path).map_err(|e| open_error(cfg, e))?,
    };
    let mut rt = if cfg.multi_thread {
        tokio::runtime::Builder::new_multi_thread()
    } else {
        tokio::runtime::Builder::new_current_thread()
    };
    let rt = rt
        .enable_time()
        .enable_io()
        .build()
        .context("cannot start the tokio runtime")?;
    let report = rt.block_on(async {
        match (cfg.aio, cfg.cache_mode.direct) {
            (Aio::Threads, false) => {
                let open = |p: &Path, w: bool| {
                    FileOptions::new()
                        .read_write(w)
                        .blocking(BlockingStrategy::Inline)
                        .open(p)
                };
                bench_on(cfg, fmt, &open).await
            }
            (Aio::Threads, true) => {
                let open = |p: &Path, w: bool| {
                    FileOptions::new()
                        .read_write(w)
                        .direct(true)
                        .blocking(BlockingStrategy::SpawnBlocking)
                        .open(p)
                        .map(BounceStorage::new)
                };
                bench_on(cfg, fmt, &open).await
            }
            (Aio::IoUring | Aio::Native, false) => {
                let entries = ring_entries(cfg.depth);
                let on_runtime = cfg.on_runtime;
                let open = move |p: &Path, w: bool| {
                    UringOptions::new()
                        .read_write(w)
                        .entries(entries)
                        .collect_inline_completions(true)
                        .complete_on_runtime(on_runtime)
                        .open(p)
                };
                bench_on(cfg, fmt, &open).await
            }
            (Aio::IoUring | Aio::Native, true) => {
                let entries = ring_entries(cfg.depth);
                let on_runtime = cfg.on_runtime;
                let open = move |p: &Path, w: bool| {
                    UringOptions::new()
                        .read_write(w)
                        .direct(true)
                        .entries(entries)
                        .collect_inline_completions(true)
                        .complete_on_runtime(on_runtime)
                        .open(p)
                        .map(BounceStorage::new)
                };
                bench_on(cfg, fmt, &open).await
            }
        }
    })?;
    print_report(cfg, fmt, &report)
}

/// Ring size for a queue depth: room for every request plus the engine's metadata I/O.
fn ring_entries(depth: u64) -> u32 {
    u32::try_from(depth.saturating_add(16).next_power_of_two())
        .unwrap_or(4096)
        .clamp(64, 4096)
}

fn open_error(cfg: &Config, e: impl std::fmt::Display) -> anyhow::Error {
    let e = e.to_string();
    let prefix = format!("{}: ", cfg.path.display());
    let e = e.strip_prefix(&prefix).unwrap_or(&e);
    anyhow!("Could not open '{}': {e}", cfg.name)
}

/// What the run measured, for the report.
struct Report {
    outcome: Outcome,
    size: u64,
    /// qcow2 only: the engine's counters over the run (summed over the chain for the caches).
    stats: Option<Stats>,
    backend: &'static str,
}

/// Opens the image (qcow2 through the engine, raw as the storage itself) with `open` and
/// runs the bench on it.
async fn bench_on<S, F>(cfg: &Config, fmt: ImageFormat, open: &F) -> Result<Report>
where
    S: Storage + 'static,
    F: Fn(&Path, bool) -> Result<S, StorageError> + Send + Sync,
{
    let backend = match cfg.aio {
        Aio::Native => "native (io_uring)",
        other => other.name(),
    };
    match fmt {
        ImageFormat::Raw => {
            let s = open(&cfg.path, cfg.write).map_err(|e| open_error(cfg, e))?;
            let size = s.len().await.map_err(|e| open_error(cfg, e))?;
            let align = s.mem_alignment().max(4096);
            let target = Arc::new(Raw(s));
            let outcome = announce_and_drive(cfg, size, align, target.clone()).await?;
            Ok(Report {
                outcome,
                size,
                stats: None,
                backend,
            })
        }
        ImageFormat::Qcow2 => {
            let opts = OpenOptions::new()
                .writable(cfg.write)
                .cache(cfg.cache)
                .direct(cfg.cache_mode.direct);
            let img = opts
                .open_with(&cfg.path, open)
                .await
                .map_err(|e| open_error(cfg, e))?;
            let size = img.size();
            let before = chain_stats(&img).await;
            let target = Arc::new(img.clone());
            let outcome = announce_and_drive(cfg, size, 4096, target).await;
            let after = chain_stats(&img).await;
            let closed = img.close().await;
            let outcome = outcome?;
            closed.context("closing the image")?;
            Ok(Report {
                outcome,
                size,
                stats: Some(delta(&before, &after)),
                backend,
            })
        }
    }
}

/// The engine counters of the image, with the L2 cache statistics summed over its chain.
async fn chain_stats<S: Storage + 'static>(img: &Image<S>) -> Stats {
    let mut s = img.stats().await;
    let mut below = img.backing();
    while let Some(qimg::Backing::Qcow2(b)) = below {
        let bs = b.stats().await;
        s.l2_cache.hits += bs.l2_cache.hits;
        s.l2_cache.misses += bs.l2_cache.misses;
        s.l2_cache.evictions += bs.l2_cache.evictions;
        below = b.backing();
    }
    s
}

fn delta(a: &Stats, b: &Stats) -> Stats {
    let mut d = *b;
    d.cow_bytes = b.cow_bytes.saturating_sub(a.cow_bytes);
    d.clusters_allocated = b.clusters_allocated.saturating_sub(a.clusters_allocated);
    d.clusters_freed = b.clusters_freed.saturating_sub(a.clusters_freed);
    let c = |x: &CacheStats, y: &CacheStats| {
        let mut z = *y;
        z.hits = y.hits.saturating_sub(x.hits);
        z.misses = y.misses.saturating_sub(x.misses);
        z.evictions = y.evictions.saturating_sub(x.evictions);
        z
    };
    d.l2_cache = c(&a.l2_cache, &b.l2_cache);
    d.refcount_cache = c(&a.refcount_cache, &b.refcount_cache);
    d
}

/// Prints qemu-img's first lines (human output), then runs.
async fn announce_and_drive<T: Target>(
    cfg: &Config,
    size: u64,
    mem_align: usize,
    target: Arc<T>,
) -> Result<Outcome> {
    let offsets = match cfg.random {
        None => Offsets::Sequential {
            start: cfg.offset,
            step: cfg.step,
            size,
        },
        Some(seed) => {
            let room = size.saturating_sub(cfg.offset);
            let slots = room / cfg.bufsize;
            if slots == 0 {
                return Err(anyhow!(
                    "--random: no {}-byte request fits between offset {} and the end of the \
                     image ({size} bytes)",
                    cfg.bufsize,
                    cfg.offset
                ));
            }
            Offsets::Random {
                base: cfg.offset,
                slots,
                bufsize: cfg.bufsize,
                seed,
            }
        }
    };
    if !cfg.json {
        println!("{}", sending_line(cfg));
        if cfg.flush_interval > 0 {
            println!("Sending flush every {} requests", cfg.flush_interval);
        }
    }
    let plan = Plan {
        write: cfg.write,
        bufsize: cfg.bufsize as usize,
        pattern: cfg.pattern,
        mem_align,
        count: cfg.count,
        duration: cfg.duration,
        offsets,
        size,
        workers: cfg.count.map_or(cfg.depth, |c| c.min(cfg.depth)) as usize,
        writethrough: cfg.cache_mode.writethrough,
        no_flush: cfg.cache_mode.no_flush,
        flush_interval: cfg.flush_interval,
        drain: cfg.drain,
    };
    drive(target, plan).await
}

/// qemu-img's "Sending ..." line (extended for qimg's timed and random runs).
fn sending_line(cfg: &Config) -> String {
    let op = if cfg.write { "write" } else { "read" };
    let what = match (cfg.count, cfg.duration) {
        (Some(c), None) => format!("Sending {c} {op} requests"),
        (Some(c), Some(d)) => format!(
            "Sending up to {c} {op} requests for {:.3} seconds",
            d.as_secs_f64()
        ),
        (None, Some(d)) => format!("Sending {op} requests for {:.3} seconds", d.as_secs_f64()),
        (None, None) => format!("Sending {op} requests"),
    };
    let place = match cfg.random {
        None => format!("starting at offset {}, step size {}", cfg.offset, cfg.step),
        Some(seed) => format!("random offsets from {}, seed {seed}", cfg.offset),
    };
    format!(
        "{what}, {} bytes each, {} in parallel ({place})",
        cfg.bufsize, cfg.depth
    )
}

fn print_report(cfg: &Config, fmt: ImageFormat, r: &Report) -> Result<()> {
    let o = &r.outcome;
    let secs = o.elapsed.as_secs_f64();
    let bytes = o.completed * cfg.bufsize;
    let iops = if secs > 0.0 {
        o.completed as f64 / secs
    } else {
        0.0
    };
    let mibs = if secs > 0.0 {
        bytes as f64 / secs / (1 << 20) as f64
    } else {
        0.0
    };
    let h: &Histogram = &o.latency;
    let us = |ns: u64| ns as f64 / 1000.0;
    let l2 = r.stats.as_ref().map(|s| {
        let lookups = s.l2_cache.hits + s.l2_cache.misses;
        let rate = if lookups > 0 {
            s.l2_cache.hits as f64 / lookups as f64
        } else {
            1.0
        };
        (s, rate)
    });
    if cfg.json {
        let v = serde_json::json!({
            "filename": cfg.name,
            "format": match fmt { ImageFormat::Qcow2 => "qcow2", ImageFormat::Raw => "raw" },
            "operation": if cfg.write { "write" } else { "read" },
            "aio": r.backend,
            "cache": cfg.cache_mode.name,
            "direct": cfg.cache_mode.direct,
            "runtime": if cfg.multi_thread { "multi" } else { "current" },
            "image-size": r.size,
            "buffer-size": cfg.bufsize,
            "depth": cfg.depth,
            "offset": cfg.offset,
            "step-size": cfg.step,
            "random": cfg.random.is_some(),
            "seed": cfg.random,
            "requested-count": cfg.count,
            "time-limit": cfg.duration.map(|d| d.as_secs_f64()),
            "flush-interval": cfg.flush_interval,
            "flushes": o.flushes,
            "requests": o.completed,
            "bytes": bytes,
            "seconds": secs,
            "iops": iops,
            "mib-per-second": mibs,
            "latency-us": {
                "min": us(h.min()),
                "mean": h.mean() / 1000.0,
                "p50": us(h.quantile(0.50)),
                "p99": us(h.quantile(0.99)),
                "p99.9": us(h.quantile(0.999)),
                "max": us(h.max()),
            },
            "l2-cache": l2.map(|(s, rate)| serde_json::json!({
                "hits": s.l2_cache.hits,
                "misses": s.l2_cache.misses,
                "hit-rate": rate,
                "evictions": s.l2_cache.evictions,
                "bytes-held": s.l2_cache.bytes_held,
            })),
            "cow-bytes": r.stats.map(|s| s.cow_bytes),
            "clusters-allocated": r.stats.map(|s| s.clusters_allocated),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("Run completed in {secs:3.3} seconds.");
    if cfg.quiet {
        return Ok(());
    }
    println!(
        "qimg: {} requests, {iops:.0} IOPS, {mibs:.1} MiB/s ({} on {}, cache={}, {} runtime)",
        o.completed,
        match fmt {
            ImageFormat::Qcow2 => "qcow2",
            ImageFormat::Raw => "raw",
        },
        r.backend,
        cfg.cache_mode.name,
        if cfg.multi_thread {
            "multi-thread"
        } else {
            "current-thread"
        }
    );
    println!(
        "qimg: latency us: p50 {:.1}, p99 {:.1}, p99.9 {:.1}, mean {:.1}, max {:.1}",
        us(h.quantile(0.50)),
        us(h.quantile(0.99)),
        us(h.quantile(0.999)),
        h.mean() / 1000.0,
        us(h.max())
    );
    if cfg.flush_interval > 0 {
        println!("qimg: {} flushes", o.flushes);
    }
    if let Some((s, rate)) = l2 {
        println!(
            "qimg: L2 cache {:.2}% hits ({} hits, {} misses), copy-on-write {} bytes, \
             {} clusters allocated",
            rate * 100.0,
            s.l2_cache.hits,
            s.l2_cache.misses,
            s.cow_bytes,
            s.clusters_allocated
        );
    }
    Ok(())
}

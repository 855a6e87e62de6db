//! The options of `qimg bench` and the run they describe ([`Config`]), checked with
//! qemu-img bench's rules, defaults and messages.

use std::path::PathBuf;
use std::time::Duration;

use qimg::CacheOptions;
use qimg::chain::ImageFormat;

use super::parse::{self, Aio, INT_MAX, INT64_MAX};
use crate::args::{image_format, json_output};
use crate::cache_mode::CacheMode;

/// The options of `qimg bench`.
#[derive(clap::Args)]
pub(super) struct BenchOpts {
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
    /// qimg: with the queue API, watch the ring for up to this many microseconds before
    /// sleeping in each wait (default 0: sleep at once; QEMU's iothreads poll up to 32).
    #[arg(long = "poll", allow_hyphen_values = true)]
    poll: Option<String>,
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
    /// qimg: bytes per refcount cache slice (qimg's own; 4 KiB by default).
    #[arg(long = "refcount-cache-entry-size")]
    refcount_cache_entry_size: Option<String>,
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
    /// qimg: how requests are issued: queue (one thread drives a `qimg::Queue`, the VMM data
    /// path: its own io_uring ring, buffers lent without a copy; the default with -i io_uring
    /// and -i native) or async (a task per request in flight awaiting `Image::read`/`write`;
    /// the default, and the only choice, with -i threads).
    #[arg(long)]
    api: Option<String>,
    /// qimg: how new clusters are reserved in the file: contiguous (the whole cluster, and
    /// 8 MiB at a time past the end of the file, with fallocate; the default) or sparse (only
    /// what is written, as qemu-img without its preallocate filter).
    #[arg(long)]
    allocation: Option<String>,
    /// qimg: how persistent dirty bitmaps are kept while writing: crash-consistent (on disk
    /// before the data they cover; the default) or qemu (marked in use until the close, as
    /// QEMU keeps them).
    #[arg(long)]
    bitmaps: Option<String>,
    /// qimg: report format: human (qemu-img's lines, then qimg's report) or json.
    #[arg(long, default_value = "human")]
    output: String,
    /// The image (or, with --image-opts, its option string).
    filename: Option<String>,
}

/// The run, from the arguments.
#[derive(Debug)]
pub(super) struct Config {
    pub(super) path: PathBuf,
    /// As the user named it (for messages).
    pub(super) name: String,
    pub(super) fmt: Option<ImageFormat>,
    pub(super) count: Option<u64>,
    pub(super) depth: u64,
    pub(super) offset: u64,
    pub(super) bufsize: u64,
    pub(super) step: u64,
    pub(super) pattern: u8,
    pub(super) write: bool,
    /// `-U`: read without keeping other processes from writing the image.
    pub(super) force_share: bool,
    pub(super) flush_interval: u64,
    pub(super) drain: bool,
    pub(super) aio: Aio,
    pub(super) cache_mode: CacheMode,
    pub(super) cache: CacheOptions,
    pub(super) random: Option<u64>,
    pub(super) duration: Option<Duration>,
    pub(super) multi_thread: bool,
    pub(super) on_runtime: bool,
    /// Requests go through a `qimg::Queue` (or a bare ring for raw files) from one thread.
    pub(super) queue_api: bool,
    /// `--poll`: how long a queue's wait watches its ring before it sleeps.
    pub(super) poll: Duration,
    pub(super) allocation: qimg::Allocation,
    /// Keep persistent bitmaps crash-consistent (`--bitmaps`).
    pub(super) crash_consistent_bitmaps: bool,
    pub(super) json: bool,
    pub(super) quiet: bool,
}

/// Checks the options as qemu-img bench does (its messages), and applies its defaults.
pub(super) fn config(args: BenchOpts) -> Result<Config, String> {
    let count = args
        .count
        .as_deref()
        .map(|s| parse::int("request count", s, 1, INT_MAX))
        .transpose()?;
    let depth = match &args.depth {
        Some(s) => parse::int("queue depth", s, 1, INT_MAX)?,
        None => 64,
    };
    let offset = match &args.offset {
        Some(s) => parse::size("offset", s, 0, INT64_MAX)?,
        None => 0,
    };
    let bufsize = match &args.buffer_size {
        Some(s) => parse::size("buffer size", s, 1, INT_MAX)?,
        None => 4096,
    };
    let step = match &args.step {
        Some(s) => parse::size("step size", s, 0, INT_MAX)?,
        None => 0,
    };
    let pattern = match &args.pattern {
        Some(s) => parse::int("pattern byte", s, 0, 255)? as u8,
        None => 0,
    };
    let flush_interval = match &args.flush_interval {
        Some(s) => parse::int("flush interval", s, 0, INT_MAX)?,
        None => 0,
    };
    let mut aio = match &args.aio {
        Some(s) => Aio::parse(s)?,
        None if args.native => Aio::Native,
        None => Aio::Threads,
    };
    let mut cache_mode = match &args.cache {
        Some(s) => CacheMode::parse(s)?,
        None => CacheMode::DEFAULT,
    };
    let mut cache = CacheOptions::default();
    for (key, v) in [
        ("l2-cache-size", &args.l2_cache_size),
        ("l2-cache-entry-size", &args.l2_cache_entry_size),
        ("refcount-cache-size", &args.refcount_cache_size),
        ("refcount-cache-entry-size", &args.refcount_cache_entry_size),
        ("cache-size", &args.cache_size),
        ("cache-clean-interval", &args.cache_clean_interval),
    ] {
        if let Some(v) = v {
            parse::cache_option(&mut cache, key, v)?;
        }
    }
    let random = if args.random {
        Some(match &args.seed {
            Some(s) => parse::int("seed", s, 0, u64::MAX)?,
            None => 0,
        })
    } else {
        if args.seed.is_some() {
            return Err("--seed is only meaningful with --random".into());
        }
        None
    };
    let poll = match &args.poll {
        Some(s) => Duration::from_micros(parse::int("poll", s, 0, 1_000_000)?),
        None => Duration::ZERO,
    };
    let duration = match &args.time {
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
    let on_runtime = match args.completions.as_str() {
        "runtime" => true,
        "thread" => false,
        other => {
            return Err(format!(
                "--completions expects 'runtime' or 'thread' not '{other}'"
            ));
        }
    };
    let multi_thread = match args.runtime.as_str() {
        "multi" => true,
        "current" => false,
        other => {
            return Err(format!(
                "--runtime expects 'multi' or 'current' not '{other}'"
            ));
        }
    };
    let json = json_output(&args.output, "bench")?;
    let Some(filename) = args.filename else {
        return Err("Expecting one image file name".into());
    };
    if args.image_opts && args.fmt.is_some() {
        return Err("--image-opts and --format are mutually exclusive".into());
    }
    let (name, fmt) = if args.image_opts {
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
        (filename, args.fmt)
    };
    let fmt = match fmt.as_deref() {
        None => None,
        // qemu-img names the file and the driver; qimg the format it does not know.
        Some(driver) => Some(image_format(driver).ok_or_else(|| {
            if crate::status::program() == "qimg" {
                format!("Unknown file format '{driver}'")
            } else {
                format!("Could not open '{name}': Unknown driver '{driver}'")
            }
        })?),
    };
    if !args.write && flush_interval > 0 {
        return Err("--flush-interval is only available in write tests".into());
    }
    if flush_interval > 0 && flush_interval < depth {
        return Err("Flush interval can't be smaller than depth".into());
    }
    if args.write && args.force_share {
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
    let queue_api = match args.api.as_deref() {
        None => aio != Aio::Threads,
        Some("queue") if aio == Aio::Threads => {
            return Err("--api queue runs on io_uring: add -i io_uring".into());
        }
        Some("queue") => true,
        Some("async") => false,
        Some(other) => return Err(format!("--api expects 'queue' or 'async' not '{other}'")),
    };
    if !poll.is_zero() && !queue_api {
        return Err("--poll needs the queue API (--api queue, -i io_uring)".into());
    }
    let crash_consistent_bitmaps = match args.bitmaps.as_deref() {
        None | Some("crash-consistent") => true,
        Some("qemu") => false,
        Some(other) => {
            return Err(format!(
                "--bitmaps expects 'crash-consistent' or 'qemu' not '{other}'"
            ));
        }
    };
    let allocation = match args.allocation.as_deref() {
        None | Some("contiguous") => qimg::Allocation::Contiguous,
        Some("sparse") => qimg::Allocation::Sparse,
        Some(other) => {
            return Err(format!(
                "--allocation expects 'contiguous' or 'sparse' not '{other}'"
            ));
        }
    };
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
        write: args.write,
        force_share: args.force_share,
        flush_interval,
        drain: !args.no_drain,
        aio,
        cache_mode,
        cache,
        random,
        duration,
        multi_thread,
        on_runtime,
        queue_api,
        poll,
        allocation,
        crash_consistent_bitmaps,
        json,
        quiet: args.quiet,
    })
}

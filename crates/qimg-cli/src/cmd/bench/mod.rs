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
//!            [--l2-cache-entry-size SIZE] [--refcount-cache-size SIZE]
//!            [--refcount-cache-entry-size SIZE] [--cache-size SIZE]
//!            [--cache-clean-interval SECONDS] [--runtime current|multi]
//!            [--completions runtime|thread] [--api queue|async]
//!            [--allocation contiguous|sparse] [--bitmaps crash-consistent|qemu]
//!            [--output human|json] FILENAME
//! ```
//!
//! Two request loops: with `-i io_uring` or `-i native` (`--api queue`, the default there) one
//! thread drives a [`qimg::Queue`] as a VMM's guest-queue loop does, lending each request's
//! buffer to the queue's ring (aligned, so O_DIRECT reads and writes reach the kernel with
//! it, no copy) and sleeping until a completion arrives; a raw file gets a bare ring on its
//! descriptor, so the baseline has the same loop (O_DIRECT requests not aligned for the file
//! fall back to the task loop, and the report says which loop ran). With `-i threads`, or
//! `--api async`, `depth` tasks await [`Image::read`] and [`Image::write`], the engine's
//! async API, on a tokio runtime.
//!
//! Backends of the engine: `-i threads` is `FileStorage` (system calls inline on the runtime thread for
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

mod config;
mod hist;
pub(crate) mod parse;
mod queue;
mod report;
mod run;

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, anyhow};
use qimg::chain::ImageFormat;
use qimg::io::{BlockingStrategy, BounceStorage, FileOptions, Storage, StorageError, UringOptions};
use qimg::{CacheStats, Image, OpenOptions, Stats};

use self::config::{BenchOpts, Config, config};
use self::parse::Aio;
use self::queue::{ImageQueue, QueueTarget, RawQueue, drive_queue};
use self::report::{Report, print_report, sending_line};
use self::run::{Offsets, Outcome, Plan, Raw, drive};

/// Arguments of `qimg bench` (boxed: they are many, and the subcommand enum stays small).
#[derive(clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    opts: Box<BenchOpts>,
}

/// Runs `qimg bench`.
pub fn run(args: BenchArgs) -> Result<()> {
    let cfg = config(*args.opts).map_err(anyhow::Error::msg)?;
    bench(&cfg)
}

/// Opens the image with the storage `-i` and `-t` ask for, runs, and prints the report.
fn bench(cfg: &Config) -> Result<()> {
    let fmt = match cfg.fmt {
        Some(f) => f,
        None => crate::chain::source_format(&cfg.path, &cfg.name, None)?,
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
        // O_DIRECT storage goes through a bounce layer (any buffer alignment); each choice is
        // its own storage type, so `bench_on` is instantiated per combination.
        let direct = cfg.cache_mode.direct;
        // An NBD export (`nbd://...`, `nbd+unix:///...`): the client is the storage, whatever
        // `-i` and `-t` say about files.
        if let Some(name) = cfg.path.to_str().filter(|n| qimg::io::nbd::is_nbd_name(n)) {
            let open = |_: &Path, w: bool| qimg::io::NbdStorage::connect(name, w);
            return bench_on(cfg, fmt, &open).await;
        }
        match cfg.aio {
            Aio::Threads => {
                let file = file_options(direct);
                if direct {
                    let open = |p: &Path, w: bool| {
                        file.clone().read_write(w).open(p).map(BounceStorage::new)
                    };
                    bench_on(cfg, fmt, &open).await
                } else {
                    let open = |p: &Path, w: bool| file.clone().read_write(w).open(p);
                    bench_on(cfg, fmt, &open).await
                }
            }
            Aio::IoUring | Aio::Native => {
                let ring = uring_options(cfg, direct);
                if direct {
                    let open = |p: &Path, w: bool| {
                        ring.clone().read_write(w).open(p).map(BounceStorage::new)
                    };
                    bench_on(cfg, fmt, &open).await
                } else {
                    let open = |p: &Path, w: bool| ring.clone().read_write(w).open(p);
                    bench_on(cfg, fmt, &open).await
                }
            }
        }
    })?;
    print_report(cfg, fmt, &report)
}

/// `-i threads`: system calls inline on the runtime thread for buffered I/O, on tokio's
/// blocking pool with O_DIRECT (like QEMU's thread pool).
fn file_options(direct: bool) -> FileOptions {
    let blocking = if direct {
        BlockingStrategy::SpawnBlocking
    } else {
        BlockingStrategy::Inline
    };
    FileOptions::new().direct(direct).blocking(blocking)
}

/// `-i io_uring` and `-i native`: a ring for the queue depth, completions collected inline
/// when the kernel finishes a request at once, and awaited where `--completions` says.
fn uring_options(cfg: &Config, direct: bool) -> UringOptions {
    UringOptions::new()
        .direct(direct)
        .entries(ring_entries(cfg.depth))
        .collect_inline_completions(true)
        .complete_on_runtime(cfg.on_runtime)
}

/// Ring size for a queue depth: room for every request plus the engine's metadata I/O.
fn ring_entries(depth: u64) -> u32 {
    u32::try_from(depth.saturating_add(16).next_power_of_two())
        .unwrap_or(4096)
        .clamp(64, 4096)
}

/// Request `i` (from 0) of `len` bytes at `off` runs past the end of an image of `size`
/// bytes: the run fails, in qemu-img's words (the block layer's EIO) or qimg's (naming it).
fn past_the_end(i: u64, len: u64, off: u64, size: u64) -> anyhow::Error {
    if crate::status::program() != "qimg" {
        return anyhow!("Failed request: Input/output error");
    }
    anyhow!(
        "Failed request: request {} ({len} bytes at offset {off}) runs past the end of the \
         image ({size} bytes)",
        i + 1
    )
}

/// An open failure as qemu-img words it ("Could not open 'NAME': ...", without the path
/// the library error starts with).
fn open_error(cfg: &Config, e: impl std::fmt::Display) -> anyhow::Error {
    let e = e.to_string();
    let prefix = format!("{}: ", cfg.path.display());
    let e = e.strip_prefix(&prefix).unwrap_or(&e);
    anyhow!("Could not open '{}': {e}", cfg.name)
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
            let plan = announce(cfg, size, align)?;
            // A bare ring takes requests as they are: with O_DIRECT only aligned ones.
            let aligned = s
                .direct_access()
                .is_some_and(|a| plan_is_aligned(cfg, a.request_alignment as u64));
            let queue_api = cfg.queue_api && (aligned || !cfg.cache_mode.direct);
            let outcome = if queue_api {
                // Room for every request and its writethrough flush, and flushes beside.
                let depth = plan.workers.saturating_mul(2).saturating_add(2);
                match RawQueue::new(s, depth, cfg.poll)? {
                    Some(q) => drive_blocking(q, plan).await?,
                    None => return Err(anyhow!("the raw file has no descriptor for a ring")),
                }
            } else {
                drive(Arc::new(Raw(s)), plan).await?
            };
            Ok(Report {
                outcome,
                size,
                stats: None,
                backend,
                queue_api,
            })
        }
        ImageFormat::Qcow2 => {
            let opts = OpenOptions::new()
                .writable(cfg.write)
                .force_share(cfg.force_share)
                .cache(cfg.cache)
                .allocation(cfg.allocation)
                .crash_consistent_bitmaps(cfg.crash_consistent_bitmaps)
                .direct(cfg.cache_mode.direct);
            let img = opts.open_with(&cfg.path, open).await.map_err(|e| {
                match crate::status::qemu_header_words(&e) {
                    Some(words) => anyhow!("Could not open '{}': {words}", cfg.name),
                    None => open_error(cfg, e),
                }
            })?;
            let size = img.size();
            let before = chain_stats(&img).await;
            let outcome = match announce(cfg, size, 4096) {
                Err(e) => Err(e),
                Ok(plan) if cfg.queue_api => match ImageQueue::new(&img, plan.workers, cfg.poll) {
                    Ok(q) => drive_blocking(q, plan).await,
                    Err(e) => Err(e),
                },
                Ok(plan) => drive(Arc::new(img.clone()), plan).await,
            };
            let after = chain_stats(&img).await;
            let closed = img.close().await;
            let outcome = outcome?;
            closed.context("closing the image")?;
            Ok(Report {
                outcome,
                size,
                stats: Some(delta(&before, &after)),
                backend,
                queue_api: cfg.queue_api,
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

/// The counters of the run: `after` less `before` (sizes and limits as `after`).
fn delta(before: &Stats, after: &Stats) -> Stats {
    let mut d = *after;
    d.cow_bytes = after.cow_bytes.saturating_sub(before.cow_bytes);
    d.clusters_allocated = after
        .clusters_allocated
        .saturating_sub(before.clusters_allocated);
    d.clusters_freed = after.clusters_freed.saturating_sub(before.clusters_freed);
    let c = |x: &CacheStats, y: &CacheStats| {
        let mut z = *y;
        z.hits = y.hits.saturating_sub(x.hits);
        z.misses = y.misses.saturating_sub(x.misses);
        z.evictions = y.evictions.saturating_sub(x.evictions);
        z
    };
    d.l2_cache = c(&before.l2_cache, &after.l2_cache);
    d.refcount_cache = c(&before.refcount_cache, &after.refcount_cache);
    d
}

/// Runs the queue loop on a blocking thread; the runtime stays free to drive the storage's
/// completions (the engine's requests of a queue wait for them).
async fn drive_blocking<Q: QueueTarget + 'static>(q: Q, plan: Plan) -> Result<Outcome> {
    tokio::task::spawn_blocking(move || drive_queue(q, &plan))
        .await
        .map_err(|e| anyhow!("the bench loop failed: {e}"))?
}

/// Whether every request of the run starts and ends on a multiple of `align`.
fn plan_is_aligned(cfg: &Config, align: u64) -> bool {
    let align = align.max(1);
    let steps = if cfg.random.is_some() {
        cfg.bufsize
    } else {
        cfg.step
    };
    cfg.offset % align == 0 && cfg.bufsize % align == 0 && steps % align == 0
}

/// Prints qemu-img's first lines (human output) and says what the run does.
fn announce(cfg: &Config, size: u64, mem_align: usize) -> Result<Plan> {
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
        outln!("{}", sending_line(cfg));
        if cfg.flush_interval > 0 {
            outln!("Sending flush every {} requests", cfg.flush_interval);
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
    Ok(plan)
}

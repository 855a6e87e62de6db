//! What `qimg bench` prints: qemu-img's "Sending ..." line, then qimg's report (human or
//! JSON): IOPS, throughput, latency percentiles, L2 cache hits, copy-on-write bytes.

use anyhow::Result;
use qimg::Stats;
use qimg::chain::ImageFormat;

use super::config::Config;
use super::hist::Histogram;
use super::run::Outcome;

/// What the run measured, for the report.
pub(super) struct Report {
    pub(super) outcome: Outcome,
    pub(super) size: u64,
    /// qcow2 only: the engine's counters over the run (summed over the chain for the caches).
    pub(super) stats: Option<Stats>,
    pub(super) backend: &'static str,
    /// Whether the run went through the queue loop (`--api queue`) or the task loop.
    pub(super) queue_api: bool,
}

/// qemu-img's "Sending ..." line (extended for qimg's timed and random runs).
pub(super) fn sending_line(cfg: &Config) -> String {
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

/// Prints qimg's report after qemu-img's lines (or the JSON report).
pub(super) fn print_report(cfg: &Config, fmt: ImageFormat, r: &Report) -> Result<()> {
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
            "format": fmt.name(),
            "operation": if cfg.write { "write" } else { "read" },
            "aio": r.backend,
            "cache": cfg.cache_mode.name,
            "direct": cfg.cache_mode.direct,
            "runtime": if cfg.multi_thread { "multi" } else { "current" },
            "api": if r.queue_api { "queue" } else { "async" },
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
            "queue": o.queue.map(|q| serde_json::json!({
                "direct": q.direct,
                "direct-bytes": q.direct_bytes,
                "engine": q.engine,
                "immediate": q.immediate,
                "allocating": q.allocating,
                "ring-enters": q.ring_enters,
            })),
            "cow-bytes": r.stats.map(|s| s.cow_bytes),
            "clusters-allocated": r.stats.map(|s| s.clusters_allocated),
        });
        outln!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    outln!("Run completed in {secs:3.3} seconds.");
    // Installed as qemu-img, bench prints what qemu-img prints and no more (a script may
    // read every line); `qimg bench` adds its own report.
    if cfg.quiet || crate::status::program() == "qemu-img" {
        return Ok(());
    }
    outln!(
        "qimg: {} requests, {iops:.0} IOPS, {mibs:.1} MiB/s ({} on {}, cache={}, {})",
        o.completed,
        fmt.name(),
        r.backend,
        cfg.cache_mode.name,
        match (r.queue_api, cfg.multi_thread) {
            (true, _) => "queue API, one thread",
            (false, true) => "async API, multi-thread runtime",
            (false, false) => "async API, current-thread runtime",
        }
    );
    outln!(
        "qimg: latency us: p50 {:.1}, p99 {:.1}, p99.9 {:.1}, mean {:.1}, max {:.1}",
        us(h.quantile(0.50)),
        us(h.quantile(0.99)),
        us(h.quantile(0.999)),
        h.mean() / 1000.0,
        us(h.max())
    );
    if cfg.flush_interval > 0 {
        outln!("qimg: {} flushes", o.flushes);
    }
    if let Some(q) = &o.queue {
        outln!(
            "qimg: queue: {} requests direct from the caller's buffers, {} on the engine, \
             {} without I/O, {} io_uring_enter calls",
            q.direct,
            q.engine,
            q.immediate,
            q.ring_enters
        );
    }
    if let Some((s, rate)) = l2 {
        outln!(
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

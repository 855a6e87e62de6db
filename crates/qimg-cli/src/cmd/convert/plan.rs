//! The copy plan of `qimg convert`: how chunks are written ([`Plan`]), and the chunk jobs cut
//! from the sources' block status ([`Jobs`]).

use std::collections::VecDeque;

use anyhow::{Result, bail};

use crate::chain::{Entry, Layers, StatusError};

/// Guest bytes per copy chunk (a multiple of every cluster size).
const CHUNK: u64 = 2 << 20;
/// Guest bytes whose status is asked at once when planning.
const WINDOW: u64 = 1 << 30;

/// How chunks are written.
#[derive(Clone, Copy)]
pub(super) struct Plan {
    /// Virtual size of the copy.
    pub(super) size: u64,
    /// Zero detection granularity (0: none, write everything).
    pub(super) zero_unit: u64,
    /// Write compressed clusters of this size (0: no compression).
    pub(super) compress_cluster: u64,
    /// The target may hold old data: zero ranges are zeroed.
    pub(super) zero_target: bool,
    /// Source zero ranges are copied as data (`-S 0`).
    pub(super) all_data: bool,
    /// `-C`: data ranges are copied whole with copy offloading where possible.
    pub(super) copy_range: bool,
    /// Chunks in flight.
    pub(super) parallel: usize,
    /// `-r`: bytes copied per second at most (0: no limit).
    pub(super) rate_limit: u64,
    /// Chunks write in guest order.
    pub(super) in_order: bool,
    /// The output has a backing file: ranges the source reads from its backing chain are
    /// not copied, and read ranges are not widened (the widening could reach such ranges).
    pub(super) skip_backing: bool,
    /// `--salvage`: sectors that cannot be read are copied as zeros, with a warning unless
    /// `quiet`.
    pub(super) salvage: bool,
    /// `-q`.
    pub(super) quiet: bool,
    /// Where the backing file of a new output ends: past it the output reads zeros, so ranges
    /// the source maps as zero are not written there (`u64::MAX`: everywhere).
    pub(super) zeros_from: u64,
}

/// One chunk of work: data ranges to copy and (with `-n`) zero ranges to clear.
pub(super) struct Job {
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) data: Vec<(u64, u64)>,
    pub(super) zeros: Vec<(u64, u64)>,
    /// With `--salvage`: the sectors of `data` whose block status could not be read; the
    /// copy warns of each again as it reads it, as qemu-img's copy pass does.
    pub(super) status_failed: Vec<StatusFailed>,
}

/// A sector whose block status could not be read (`--salvage`).
#[derive(Debug, Clone)]
pub(super) struct StatusFailed {
    /// Its offset in its source (qemu-img's warning names that).
    pub(super) source: u64,
    /// Its offset in the output.
    pub(super) output: u64,
    /// Why, in qemu-img's words.
    pub(super) why: String,
}

/// Appends `[start, end)` to sorted ranges `v`, merging it with the last one it touches.
pub(super) fn push_range(v: &mut Vec<(u64, u64)>, start: u64, end: u64) {
    if let Some(last) = v.last_mut() {
        if last.1 >= start {
            last.1 = last.1.max(end);
            return;
        }
    }
    v.push((start, end));
}

/// One source: its chain (for the block status) and where it lands in the output.
pub(super) struct SourceChain {
    pub(super) layers: Layers,
    /// First output byte of this source.
    pub(super) start: u64,
    /// Its virtual size.
    pub(super) size: u64,
}

/// Cuts the sources' status into chunk jobs, in output order: every chunk with data (or, with
/// `zeros`, zero ranges). `all_data` treats zero ranges as data (`-S 0`); `skip_backing`
/// leaves out what a source reads from its backing chain.
pub(super) struct Jobs<'a> {
    srcs: &'a [SourceChain],
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
    /// `--salvage`: a sector whose block status cannot be read is data (see
    /// [`status_salvaging`](Self::status_salvaging)).
    salvage: bool,
    /// Warn of each such sector here: the pass that counts (qemu-img always makes one
    /// before copying); the copy warns as it reads.
    warn: bool,
}

impl<'a> Jobs<'a> {
    pub(super) fn new(srcs: &'a [SourceChain], plan: Plan, zeros: bool) -> Self {
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
            salvage: plan.salvage,
            warn: false,
        }
    }

    /// The counting pass: as [`new`](Self::new), and with `--salvage` (unless `-q`) warning
    /// of every sector whose block status cannot be read, as qemu-img's first pass does.
    pub(super) fn counting(srcs: &'a [SourceChain], plan: Plan) -> Self {
        Self {
            warn: plan.salvage && !plan.quiet,
            ..Self::new(srcs, plan, false)
        }
    }

    /// The block status of `[at, at + n)` of source `src` appended to `out`. A range whose
    /// status cannot be read is halved until the first sector that fails is found: without
    /// `--salvage` the error names it, as qemu-img's (`convert_iteration_sectors`, which asks
    /// extent by extent); with it each such sector is data (its read may fail too) and is
    /// pushed to `failed`, as qemu-img retries one sector and
    /// counts it as data.
    async fn status_salvaging(
        &self,
        src: &SourceChain,
        at: u64,
        n: u64,
        out: &mut Vec<Entry>,
        failed: &mut Vec<StatusFailed>,
    ) -> Result<()> {
        let mut part = Vec::new();
        let Err(e) = src.layers.status(at, n, &mut part).await else {
            out.append(&mut part);
            return Ok(());
        };
        let Some(why) = e.downcast_ref::<StatusError>().map(|s| s.why.clone()) else {
            return Err(e);
        };
        if n > 512 {
            let half = (n / 2).next_multiple_of(512).min(n);
            Box::pin(self.status_salvaging(src, at, half, out, failed)).await?;
            return Box::pin(self.status_salvaging(src, at + half, n - half, out, failed)).await;
        }
        let message = format!("error while reading block status at offset {at}: {why}");
        if !self.salvage {
            bail!(message);
        }
        if self.warn {
            eprintln!("{}: warning: {message}", crate::status::program());
        }
        failed.push(StatusFailed {
            source: at,
            output: src.start + at,
            why,
        });
        out.push(Entry {
            start: at,
            length: n,
            depth: 0,
            present: true,
            zero: false,
            data: true,
            compressed: false,
            offset: None,
            file: None,
        });
        Ok(())
    }

    /// The next chunk job, in output order; `None` when every source has been walked.
    pub(super) async fn next(&mut self) -> Result<Option<Job>> {
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
            let (mut entries, mut failed) = (Vec::new(), Vec::new());
            self.status_salvaging(src, self.at, n, &mut entries, &mut failed)
                .await?;
            self.at += n;
            let mut failed = failed.into_iter().peekable();
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
                        status_failed: Vec::new(),
                    });
                    while let Some(f) = failed.next_if(|f| f.output < ce) {
                        j.status_failed.push(f);
                    }
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
pub(super) async fn data_bytes(srcs: &[SourceChain], plan: Plan) -> Result<u64> {
    let mut jobs = Jobs::counting(srcs, plan);
    let mut total = 0;
    while let Some(j) = jobs.next().await? {
        total += j.data.iter().map(|(s, e)| e - s).sum::<u64>();
    }
    Ok(total)
}

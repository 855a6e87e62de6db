//! The copy of `qimg convert`: chunk jobs run in parallel (in output order unless `-W`),
//! zero blocks skipped or zeroed, clusters compressed with `-c`, and qemu-img's progress.

use anyhow::{Context, Result, anyhow};
use tokio::sync::oneshot;
use tokio::task::JoinSet;

use super::offload::copy_range;
use super::plan::{Job, Jobs, Plan, SourceChain, push_range};
use super::source::Source;
use super::target::ConvertOutput;

/// Writes the maximal runs of non-zero `zero_unit` blocks of `buf` (at guest `offset`); with
/// `zero_target`, zero blocks are zeroed in the target. Blocks are aligned to `zero_unit` in
/// the guest and clipped to the buffer (one status extent's data): qemu-img's
/// `is_allocated_sectors`, which rounds data out and zeros in to its alignment but never past
/// the buffer, so that an extent's trailing zeros stay out of the target.
async fn write_nonzero(
    dst: &ConvertOutput,
    buf: &[u8],
    offset: u64,
    zero_unit: u64,
    zero_target: bool,
) -> Result<()> {
    let block_end = |i: usize| {
        let abs = offset + i as u64;
        ((abs / zero_unit + 1) * zero_unit - offset).min(buf.len() as u64) as usize
    };
    let block_is_zero = |i: usize| buf[i..block_end(i)].iter().all(|&b| b == 0);
    let mut at = 0usize;
    while at < buf.len() {
        let zero = block_is_zero(at);
        let mut end = block_end(at);
        while end < buf.len() && block_is_zero(end) == zero {
            end = block_end(end);
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
    dst: ConvertOutput,
    job: Job,
    plan: Plan,
    turn: Option<oneshot::Receiver<()>>,
    done: Option<oneshot::Sender<()>>,
) -> Result<u64> {
    // Compressed clusters are written whole; other data is read as the status gives it
    // (zero blocks are found within it, aligned in the guest).
    let unit = plan.compress_cluster.max(1);
    let limit = job.end.min(plan.size);
    if plan.copy_range {
        return offloaded_job(src, dst, job, limit, turn, done).await;
    }
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
        let failed: Vec<_> = job
            .status_failed
            .iter()
            .filter(|f| (s..e).contains(&f.output))
            .cloned()
            .collect();
        src.read_salvaging(&mut buf, s, plan.salvage, plan.quiet, &failed)
            .await?;
        bufs.push((s, buf));
    }
    if let Some(turn) = turn {
        // An error in the previous chunk drops its sender; that error is reported anyway.
        let _ = turn.await;
    }
    write_zero_ranges(&dst, &job.zeros).await?;
    for (s, buf) in bufs {
        if plan.compress_cluster > 0 {
            let cluster_size = plan.compress_cluster as usize;
            for (i, cluster) in buf.chunks(cluster_size).enumerate() {
                let off = s + (i * cluster_size) as u64;
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
        } else if plan.zero_unit > 0 {
            write_nonzero(&dst, &buf, s, plan.zero_unit, plan.zero_target).await?;
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

/// Zeroes the chunk's zero ranges in the target (`-n`, or over a backing file).
async fn write_zero_ranges(dst: &ConvertOutput, zeros: &[(u64, u64)]) -> Result<()> {
    for &(s, e) in zeros {
        dst.write_zeroes(s, e - s)
            .await
            .with_context(|| format!("error while writing at byte {s}"))?;
    }
    Ok(())
}

/// A chunk with `-C`: in turn, its zero ranges, then its data ranges whole, offloaded where
/// possible (see [`copy_range`]).
async fn offloaded_job(
    src: Source,
    dst: ConvertOutput,
    job: Job,
    limit: u64,
    turn: Option<oneshot::Receiver<()>>,
    done: Option<oneshot::Sender<()>>,
) -> Result<u64> {
    if let Some(turn) = turn {
        let _ = turn.await;
    }
    write_zero_ranges(&dst, &job.zeros).await?;
    let mut covered = 0;
    for &(s, e) in &job.data {
        covered += e - s;
        let (s, e) = (s.max(job.start), e.min(limit));
        if s < e {
            copy_range(&src, &dst, s, e).await?;
        }
    }
    if let Some(done) = done {
        let _ = done.send(());
    }
    Ok(covered)
}

/// Progress printed as qemu-img does: `    (12.34/100%)\r` on stdout, at every whole percent.
pub(super) struct Progress {
    pub(super) on: bool,
    pub(super) total: u64,
    pub(super) done: u64,
    pub(super) last: f64,
}

impl Progress {
    fn print(&self, pct: f64) {
        out!("    ({pct:3.2}/100%)\r");
        crate::out::flush();
    }

    pub(super) fn start(&mut self) {
        if self.on {
            self.print(0.0);
        }
    }

    pub(super) fn add(&mut self, n: u64) {
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

    pub(super) fn end(&mut self) {
        if self.on {
            self.print(100.0);
            outln!();
        }
    }
}

/// The covered bytes of a finished chunk task (0 when none was running).
fn joined(r: Option<std::result::Result<Result<u64>, tokio::task::JoinError>>) -> Result<u64> {
    match r {
        None => Ok(0),
        Some(Ok(r)) => r,
        Some(Err(e)) => Err(anyhow!("copy task failed: {e}")),
    }
}

/// Copies every job of the sources into the target, `plan.parallel` chunks at a time; on an
/// error the chunks still running are cancelled.
pub(super) async fn copy(
    srcs: &[SourceChain],
    source: Source,
    target: ConvertOutput,
    plan: Plan,
    progress: &mut Progress,
) -> Result<()> {
    let mut set: JoinSet<Result<u64>> = JoinSet::new();
    let mut jobs = Jobs::new(srcs, plan, plan.zero_target);
    let r: Result<()> = async {
        let mut prev: Option<oneshot::Receiver<()>> = None;
        // `-r`: a chunk starts no earlier than the bytes before it allow at the rate.
        let mut pace = crate::progress::Pace::new(plan.rate_limit);
        while let Some(job) = jobs.next().await? {
            pace.take(job.data.iter().map(|(s, e)| e - s).sum::<u64>())
                .await;
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

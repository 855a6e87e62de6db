//! The request loop of `qimg bench`: `depth` worker tasks issue requests against a [`BenchTarget`]
//! (a qcow2 [`Image`] or a raw [`Storage`]), taking request numbers from one shared counter, so
//! request `i` always goes to the same offset whatever the scheduling; with a flush interval a
//! small state machine shared by the workers reproduces qemu-img bench's `bench_cb` (drain,
//! flush, resume).

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow};
use qimg::Image;
use qimg::io::{AlignedBuf, Storage};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::hist::Histogram;

/// What the workers read from and write to.
pub trait BenchTarget: Send + Sync + 'static {
    /// Fills `buf` from `offset`.
    fn read(&self, buf: &mut [u8], offset: u64) -> impl Future<Output = Result<()>> + Send;
    /// Writes `buf` at `offset`.
    fn write(&self, buf: &[u8], offset: u64) -> impl Future<Output = Result<()>> + Send;
    /// Makes what was written durable.
    fn flush(&self) -> impl Future<Output = Result<()>> + Send;
}

impl<S: Storage + 'static> BenchTarget for Image<S> {
    async fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        Ok(Image::read(self, buf, offset).await?)
    }
    async fn write(&self, buf: &[u8], offset: u64) -> Result<()> {
        Ok(Image::write(self, buf, offset).await?)
    }
    async fn flush(&self) -> Result<()> {
        Ok(Image::flush(self).await?)
    }
}

/// A raw image: the storage itself, so the same tool measures the raw-file baseline.
pub struct Raw<S>(pub S);

impl<S: Storage + 'static> BenchTarget for Raw<S> {
    async fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        Ok(self.0.read_at(buf, offset).await?)
    }
    async fn write(&self, buf: &[u8], offset: u64) -> Result<()> {
        Ok(self.0.write_at(buf, offset).await?)
    }
    async fn flush(&self) -> Result<()> {
        Ok(self.0.flush().await?)
    }
}

/// Where request `i` goes.
#[derive(Debug, Clone, Copy)]
pub enum Offsets {
    /// qemu-img bench's sequence: the first request at `start`, each next one `step` further,
    /// wrapped modulo the image size (qemu 10.0: `offset = (offset + step) % size`, 0 for an
    /// empty image). A request that then runs past the end fails, as in qemu.
    Sequential { start: u64, step: u64, size: u64 },
    /// Uniform over the `slots` buffer-aligned positions from `base`, from a seeded generator
    /// indexed by the request number (so a seed always gives the same offsets).
    Random {
        base: u64,
        slots: u64,
        bufsize: u64,
        seed: u64,
    },
}

/// splitmix64's increment (the golden ratio in 64 bits).
const SPLITMIX_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// splitmix64's output function.
fn splitmix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Offsets {
    /// The offset of request `i` (0-based).
    pub fn at(&self, i: u64) -> u64 {
        match *self {
            Offsets::Sequential { start, step, size } => {
                if i == 0 {
                    start
                } else if size == 0 {
                    0
                } else {
                    let x = u128::from(start) + u128::from(i) * u128::from(step);
                    (x % u128::from(size)) as u64
                }
            }
            Offsets::Random {
                base,
                slots,
                bufsize,
                seed,
            } => {
                let r = splitmix(seed.wrapping_add(i.wrapping_add(1).wrapping_mul(SPLITMIX_GAMMA)));
                let slot = ((u128::from(r) * u128::from(slots)) >> 64) as u64;
                base + slot * bufsize
            }
        }
    }
}

/// Everything the workers need to know.
#[derive(Debug, Clone)]
pub struct Plan {
    pub write: bool,
    pub bufsize: usize,
    pub pattern: u8,
    /// Buffer address alignment (for O_DIRECT).
    pub mem_align: usize,
    /// Stop after this many requests (`None`: only the duration stops the run).
    pub count: Option<u64>,
    pub duration: Option<Duration>,
    pub offsets: Offsets,
    /// The virtual size: requests past it fail before being issued.
    pub size: u64,
    /// Worker tasks (requests in flight at most).
    pub workers: usize,
    /// Flush after every write, inside the request.
    pub writethrough: bool,
    /// Flushes do nothing (`-t unsafe`).
    pub no_flush: bool,
    /// 0, or flush whenever the number of requests not yet issued is a multiple of this.
    pub flush_interval: u64,
    /// Wait for the requests in flight before such a flush (qemu's default; `--no-drain`
    /// turns it off).
    pub drain: bool,
}

/// What a run did.
pub struct Outcome {
    /// Requests completed.
    pub completed: u64,
    /// Flushes issued by the flush interval (not the writethrough ones).
    pub flushes: u64,
    /// From the first request to the completion of the last.
    pub elapsed: Duration,
    /// Per-request latency, nanoseconds.
    pub latency: Histogram,
    /// What the image's queue did (`--api queue` on qcow2).
    pub queue: Option<qimg::QueueStats>,
}

/// qemu-img bench's `BenchData` fields that decide flushes, shared by the workers.
struct FlushSchedule {
    /// Requests not completed.
    not_completed: u64,
    in_flight: u64,
    /// Requests issued so far (the next request's number).
    issued: u64,
    /// A flush point was reached: issue nothing until the drain and flush are done.
    blocked: bool,
}

/// What the workers of a run share: the target, the plan, the request counter, the first
/// error, and the flush schedule.
struct RunState<T> {
    target: Arc<T>,
    plan: Plan,
    deadline: Option<Instant>,
    next: AtomicU64,
    stop: AtomicBool,
    error: Mutex<Option<anyhow::Error>>,
    sched: Option<Mutex<FlushSchedule>>,
    resume: Notify,
    flushes: AtomicU64,
    background: Mutex<Vec<JoinHandle<Result<()>>>>,
}

fn lock<X>(m: &Mutex<X>) -> MutexGuard<'_, X> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<T: BenchTarget> RunState<T> {
    fn fail(&self, e: anyhow::Error) {
        let mut slot = lock(&self.error);
        if slot.is_none() {
            *slot = Some(e);
        }
        drop(slot);
        self.stop.store(true, Ordering::Release);
        self.resume.notify_waiters();
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// The offset of request `i`, or the qemu-style failure if it runs past the end.
    fn offset(&self, i: u64) -> Result<u64> {
        let off = self.plan.offsets.at(i);
        let len = self.plan.bufsize as u64;
        if off.checked_add(len).is_none_or(|e| e > self.plan.size) {
            return Err(super::past_the_end(i, len, off, self.plan.size));
        }
        Ok(off)
    }

    async fn flush(&self) -> Result<()> {
        if self.plan.no_flush {
            Ok(())
        } else {
            self.target.flush().await
        }
    }

    /// One request: the I/O (and the writethrough flush).
    async fn request(&self, buf: &mut [u8], off: u64) -> Result<()> {
        if self.plan.write {
            self.target.write(buf, off).await?;
            if self.plan.writethrough {
                self.flush().await?;
            }
            Ok(())
        } else {
            self.target.read(buf, off).await
        }
    }

    /// Takes the next request number, or `None` when the run is over for this worker.
    async fn acquire(&self) -> Option<u64> {
        let Some(sched) = &self.sched else {
            if self.stopped() {
                return None;
            }
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            return self.plan.count.is_none_or(|c| i < c).then_some(i);
        };
        loop {
            let notified = self.resume.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            {
                let mut s = lock(sched);
                if self.stopped() || s.not_completed == s.in_flight {
                    return None;
                }
                if !s.blocked {
                    s.in_flight += 1;
                    let i = s.issued;
                    s.issued += 1;
                    return Some(i);
                }
            }
            notified.await;
        }
    }

    /// A request completed: qemu's flush-interval logic.
    async fn complete(self: &Arc<Self>) -> Result<()> {
        let Some(sched) = &self.sched else {
            return Ok(());
        };
        let interval = self.plan.flush_interval;
        enum Then {
            Nothing,
            Flush,
            Background,
        }
        let then = {
            let mut s = lock(sched);
            let remaining = s.not_completed - s.in_flight;
            s.not_completed -= 1;
            s.in_flight -= 1;
            if interval > 0 && remaining % interval == 0 {
                if self.plan.drain {
                    s.blocked = true;
                    if s.in_flight == 0 {
                        Then::Flush
                    } else {
                        Then::Nothing
                    }
                } else {
                    Then::Background
                }
            } else {
                Then::Nothing
            }
        };
        match then {
            Then::Nothing => {}
            Then::Flush => {
                self.flushes.fetch_add(1, Ordering::Relaxed);
                self.flush().await?;
                lock(sched).blocked = false;
                self.resume.notify_waiters();
            }
            Then::Background => {
                self.flushes.fetch_add(1, Ordering::Relaxed);
                let me = self.clone();
                let h = tokio::spawn(async move { me.flush().await });
                lock(&self.background).push(h);
            }
        }
        Ok(())
    }

    async fn worker(self: Arc<Self>) -> (Histogram, u64) {
        let mut hist = Histogram::new();
        let mut done = 0u64;
        let Some(mut buf) = AlignedBuf::zeroed(self.plan.bufsize, self.plan.mem_align) else {
            self.fail(anyhow!(
                "cannot allocate a {} byte buffer",
                self.plan.bufsize
            ));
            return (hist, done);
        };
        buf.fill(self.plan.pattern);
        while let Some(i) = self.acquire().await {
            let off = match self.offset(i) {
                Ok(o) => o,
                Err(e) => {
                    self.fail(e);
                    break;
                }
            };
            let t0 = Instant::now();
            if self.deadline.is_some_and(|d| t0 >= d) {
                self.stop.store(true, Ordering::Release);
                self.resume.notify_waiters();
                break;
            }
            let r = self.request(&mut buf, off).await;
            let t1 = Instant::now();
            if let Err(e) = r {
                self.fail(e.context(format!(
                    "Failed request: {} of {} bytes at offset {off}",
                    if self.plan.write { "write" } else { "read" },
                    self.plan.bufsize
                )));
                break;
            }
            hist.record(u64::try_from((t1 - t0).as_nanos()).unwrap_or(u64::MAX));
            done += 1;
            if let Err(e) = self.complete().await {
                self.fail(e.context("Failed flush request"));
                break;
            }
        }
        (hist, done)
    }
}

/// Runs the plan on the current tokio runtime.
pub async fn drive<T: BenchTarget>(target: Arc<T>, plan: Plan) -> Result<Outcome> {
    let sched = (plan.flush_interval > 0).then(|| {
        // Without a count (a timed run) qemu's "requests not yet issued" is counted down from
        // a multiple of the interval, so flushes still come every `interval` requests.
        let not_completed = plan
            .count
            .unwrap_or(u64::MAX / plan.flush_interval * plan.flush_interval);
        Mutex::new(FlushSchedule {
            not_completed,
            in_flight: 0,
            issued: 0,
            blocked: false,
        })
    });
    let start = Instant::now();
    let shared = Arc::new(RunState {
        target,
        deadline: plan.duration.map(|d| start + d),
        plan,
        next: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        error: Mutex::new(None),
        sched,
        resume: Notify::new(),
        flushes: AtomicU64::new(0),
        background: Mutex::new(Vec::new()),
    });
    let workers: Vec<_> = (0..shared.plan.workers)
        .map(|_| tokio::spawn(shared.clone().worker()))
        .collect();
    let mut latency = Histogram::new();
    let mut completed = 0;
    for w in workers {
        match w.await {
            Ok((h, n)) => {
                latency.merge(&h);
                completed += n;
            }
            Err(e) => shared.fail(anyhow!("a bench worker failed: {e}")),
        }
    }
    let elapsed = start.elapsed();
    let background = std::mem::take(&mut *lock(&shared.background));
    for h in background {
        match h.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => shared.fail(e.context("Failed flush request")),
            Err(e) => shared.fail(anyhow!("a flush task failed: {e}")),
        }
    }
    if let Some(e) = lock(&shared.error).take() {
        return Err(e);
    }
    Ok(Outcome {
        completed,
        flushes: shared.flushes.load(Ordering::Relaxed),
        elapsed,
        latency,
        queue: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_offsets_wrap_modulo_the_size_like_qemu_10_0() {
        let o = Offsets::Sequential {
            start: 102_400,
            step: 307_200,
            size: 1 << 20,
        };
        let got: Vec<u64> = (0..5).map(|i| o.at(i)).collect();
        assert_eq!(got, [102_400, 409_600, 716_800, 1_024_000, 282_624]);
        // The first request is where -o says even past the end; an empty image wraps to 0.
        let e = Offsets::Sequential {
            start: 7,
            step: 3,
            size: 0,
        };
        assert_eq!((e.at(0), e.at(1)), (7, 0));
        let big = Offsets::Sequential {
            start: i64::MAX as u64,
            step: i32::MAX as u64,
            size: 1 << 30,
        };
        assert!(big.at(u64::MAX) < 1 << 30);
    }

    #[test]
    fn random_offsets_are_aligned_in_range_and_seeded() {
        let r = |seed| Offsets::Random {
            base: 8192,
            slots: 100,
            bufsize: 4096,
            seed,
        };
        let a: Vec<u64> = (0..1000).map(|i| r(1).at(i)).collect();
        let b: Vec<u64> = (0..1000).map(|i| r(1).at(i)).collect();
        let c: Vec<u64> = (0..1000).map(|i| r(2).at(i)).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(
            a.iter()
                .all(|&o| (8192..8192 + 100 * 4096).contains(&o) && o % 4096 == 0)
        );
        let distinct: std::collections::BTreeSet<_> = a.iter().collect();
        assert!(distinct.len() > 95, "{} distinct slots", distinct.len());
    }
}

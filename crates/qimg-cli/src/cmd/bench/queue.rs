//! `qimg bench --api queue`: the request loop a VMM runs. One thread keeps `depth` requests
//! in flight on a per-queue io_uring ring, lending each request's buffer to the ring as it is
//! (no copy with O_DIRECT) and sleeping until a completion arrives, as a guest queue's event
//! loop does: a qcow2 image through [`qimg::Queue`], a raw file through a bare
//! [`QueueRing`] on its descriptor (the same ring, without the engine, for the baseline).
//!
//! The requests, their offsets and the flush schedule are those of the task loop in
//! [`super::run`] (qemu-img bench's), so both APIs write the same bytes.

use std::collections::VecDeque;
use std::time::Instant;

use anyhow::{Context, Result, anyhow};
use qimg::io::queue::QueueRing;
use qimg::io::{AlignedBuf, Storage};
use qimg::{IoBuffers, Queue, QueueOptions, Request};

use super::hist::Histogram;
use super::run::{Outcome, Plan};

/// What the loop asks of a target.
pub(super) enum Op {
    Read(u64),
    Write(u64),
    Flush,
}

/// A finished operation.
pub(super) struct Done {
    token: u64,
    result: Result<()>,
    buffers: Option<IoBuffers>,
}

/// A queue the loop drives: submissions, a blocking wait, completions.
pub(super) trait QueueTarget: Send {
    /// Starts `op` (reads and writes with `buffers`); its [`Done`] carries `token`.
    fn submit(&mut self, op: Op, buffers: Option<IoBuffers>, token: u64) -> Result<()>;
    /// Blocks until a completion is ready (returns at once when nothing is in flight).
    fn wait(&mut self) -> Result<()>;
    /// The next completion, if one is ready.
    fn next(&mut self) -> Option<Done>;
    /// The image queue's counters (none for a raw file).
    fn stats(&self) -> Option<qimg::QueueStats> {
        None
    }
}

/// A qcow2 image through [`qimg::Queue`], the data path a VMM embeds. Requests wait in a
/// batch until the loop looks for completions and finds none ready, then go to
/// [`Queue::submit_batch`] (one `io_uring_enter` for the batch), as the raw loop hands its
/// ring entries to the kernel and as QEMU defers its io_uring submissions.
pub(super) struct ImageQueue<S: Storage + 'static> {
    queue: Queue<S>,
    batch: Vec<(Request, u64)>,
    /// Why the queue stopped taking requests (reported by the next `wait`).
    failed: Option<qimg::Error>,
}

impl<S: Storage + 'static> ImageQueue<S> {
    /// A queue of the image's for `depth` requests in flight. Its ring has four places per
    /// request (at least 8): a request may take several (one per run of clusters, or two
    /// reads and a write when it copies on write), and one that finds no room goes to the
    /// engine. A VMM sizes its ring the same way, by its virtqueue (128 places), not by
    /// what the guest keeps in flight.
    pub(super) fn new(
        img: &qimg::Image<S>,
        depth: usize,
        poll: std::time::Duration,
    ) -> Result<Self> {
        let depth = u32::try_from(depth.saturating_mul(4).clamp(8, 4096)).unwrap_or(4096);
        let queue = img
            .queue(QueueOptions::new().depth(depth).poll(poll))
            .context("cannot set up the image's queue")?;
        Ok(ImageQueue {
            queue,
            batch: Vec::new(),
            failed: None,
        })
    }

    /// Hands the batched requests to the queue.
    fn flush_batch(&mut self) {
        if self.batch.is_empty() || self.failed.is_some() {
            return;
        }
        if let Err(refused) = self.queue.submit_batch(self.batch.drain(..)) {
            self.failed = Some(refused.error);
        }
    }
}

impl<S: Storage + 'static> QueueTarget for ImageQueue<S> {
    fn submit(&mut self, op: Op, buffers: Option<IoBuffers>, token: u64) -> Result<()> {
        let request = match (op, buffers) {
            (Op::Read(offset), Some(buffers)) => Request::Read { offset, buffers },
            (Op::Write(offset), Some(buffers)) => Request::Write { offset, buffers },
            (Op::Flush, _) => Request::Flush,
            (_, None) => return Err(anyhow!("a read or write without a buffer")),
        };
        self.batch.push((request, token));
        Ok(())
    }

    fn wait(&mut self) -> Result<()> {
        self.flush_batch();
        if let Some(e) = self.failed.take() {
            return Err(e.into());
        }
        Ok(self.queue.wait()?)
    }

    fn stats(&self) -> Option<qimg::QueueStats> {
        Some(self.queue.stats())
    }

    fn next(&mut self) -> Option<Done> {
        let c = match self.queue.next_completed() {
            Some(c) => c,
            None => {
                // Nothing ready: what the loop submitted meanwhile goes now (a failure is
                // reported by the next `wait`).
                self.flush_batch();
                self.queue.next_completed()?
            }
        };
        Some(Done {
            token: c.user_data,
            result: c.result.map(drop).map_err(anyhow::Error::from),
            buffers: c.buffers,
        })
    }
}

/// A raw file: reads, writes and flushes of its descriptor on a ring of the loop's own.
pub(super) struct RawQueue<S: Storage> {
    storage: S,
    ring: QueueRing,
    /// Operations waiting for room on the ring (flushes beyond its depth).
    backlog: VecDeque<(Op, Option<IoBuffers>, u64)>,
    /// The buffers of operations on the ring, by ring token, given back on completion.
    held: Vec<Option<IoBuffers>>,
    free: Vec<u64>,
    /// Ring token -> the loop's token.
    tokens: Vec<u64>,
    done: VecDeque<Done>,
}

impl<S: Storage> RawQueue<S> {
    /// `depth` operations on the ring at once; `None` when the storage has no descriptor.
    pub(super) fn new(storage: S, depth: usize, poll: std::time::Duration) -> Result<Option<Self>> {
        if storage.direct_access().is_none() {
            return Ok(None);
        }
        let depth = depth.clamp(1, 4096);
        let mut ring = QueueRing::new(u32::try_from(depth).unwrap_or(4096))
            .context("cannot set up an io_uring ring")?;
        ring.set_poll(poll);
        Ok(Some(RawQueue {
            storage,
            ring,
            backlog: VecDeque::new(),
            held: (0..depth).map(|_| None).collect(),
            free: (0..depth as u64).rev().collect(),
            tokens: vec![0; depth],
            done: VecDeque::new(),
        }))
    }

    /// Moves backlogged operations to the ring while it has room.
    fn push_backlog(&mut self) -> Result<()> {
        while !self.free.is_empty() {
            let Some((op, buffers, token)) = self.backlog.pop_front() else {
                break;
            };
            self.queue_on_ring(op, buffers, token)?;
        }
        self.ring.submit().context("io_uring submission")?;
        Ok(())
    }

    fn queue_on_ring(&mut self, op: Op, buffers: Option<IoBuffers>, token: u64) -> Result<()> {
        let Some(slot) = self.free.pop() else {
            self.backlog.push_back((op, buffers, token));
            return Ok(());
        };
        let fd = self
            .storage
            .direct_access()
            .ok_or_else(|| anyhow!("the raw file has no descriptor"))?
            .fd;
        let queued = match (&op, buffers) {
            (Op::Read(off), Some(mut b)) => {
                let len = b.len();
                let r = self.ring.read(fd, *off, &mut b, 0, len, slot);
                self.held[slot as usize] = Some(b);
                r
            }
            (Op::Write(off), Some(b)) => {
                let r = self.ring.write(fd, *off, &b, 0, b.len(), slot);
                self.held[slot as usize] = Some(b);
                r
            }
            (Op::Flush, _) => self.ring.fsync(fd, false, slot),
            (_, None) => Err(std::io::Error::other("a read or write without a buffer")),
        };
        if let Err(e) = queued {
            self.held[slot as usize] = None;
            self.free.push(slot);
            return Err(anyhow::Error::from(e).context("queuing on the io_uring ring"));
        }
        self.tokens[slot as usize] = token;
        Ok(())
    }

    fn reap(&mut self) {
        let mut finished = Vec::new();
        self.ring.reap(|c| finished.push(c));
        for c in finished {
            let slot = c.token as usize;
            self.free.push(c.token);
            let result = if c.result < 0 {
                Err(anyhow::Error::from(std::io::Error::from_raw_os_error(
                    -c.result,
                )))
            } else if c.result as usize != c.expected {
                Err(anyhow!(
                    "short transfer: {} of {} bytes",
                    c.result,
                    c.expected
                ))
            } else {
                Ok(())
            };
            self.done.push_back(Done {
                token: self.tokens[slot],
                result,
                buffers: self.held[slot].take(),
            });
        }
    }
}

impl<S: Storage> QueueTarget for RawQueue<S> {
    fn submit(&mut self, op: Op, buffers: Option<IoBuffers>, token: u64) -> Result<()> {
        // Queued only: `wait` hands everything queued to the kernel in one system call.
        self.queue_on_ring(op, buffers, token)
    }

    fn wait(&mut self) -> Result<()> {
        if !self.done.is_empty() {
            return Ok(());
        }
        self.ring
            .wait()
            .context("waiting for io_uring completions")?;
        self.reap();
        self.push_backlog()
    }

    fn next(&mut self) -> Option<Done> {
        if self.done.is_empty() {
            self.reap();
            if let Err(e) = self.push_backlog() {
                // Fails the first backlogged operation, so the loop sees the error.
                if let Some((_, buffers, token)) = self.backlog.pop_front() {
                    self.done.push_back(Done {
                        token,
                        result: Err(e),
                        buffers,
                    });
                }
            }
        }
        self.done.pop_front()
    }
}

/// Token kinds (high bits); the low bits are a request's slot.
const WRITETHROUGH_FLUSH: u64 = 1 << 62;
const INTERVAL_FLUSH: u64 = 1 << 61;
const BACKGROUND_FLUSH: u64 = 1 << 60;
const SLOT_MASK: u64 = BACKGROUND_FLUSH - 1;

/// The loop's state (qemu-img bench's `BenchData`, one thread).
struct Loop<'p> {
    plan: &'p Plan,
    deadline: Option<Instant>,
    /// Buffers of idle slots.
    idle: Vec<(usize, IoBuffers)>,
    /// Buffers of writethrough writes waiting for their flush, by slot.
    parked: Vec<Option<IoBuffers>>,
    started: Vec<Instant>,
    offsets: Vec<u64>,
    next: u64,
    /// Requests issued and not completed (a writethrough flush belongs to its request).
    in_flight: u64,
    /// Flushes issued without draining, not completed.
    background: u64,
    /// A drained flush is in flight.
    interval_flush: bool,
    /// Requests not completed, counted down from the count (flush schedule only).
    not_completed: u64,
    blocked: bool,
    stop: bool,
    error: Option<anyhow::Error>,
    latency: Histogram,
    completed: u64,
    flushes: u64,
}

impl Loop<'_> {
    fn fail(&mut self, e: anyhow::Error) {
        if self.error.is_none() {
            self.error = Some(e);
        }
        self.stop = true;
    }

    /// The number of the next request to issue, if one may go now.
    fn acquire(&mut self) -> Option<u64> {
        if self.stop {
            return None;
        }
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            self.stop = true;
            return None;
        }
        if self.plan.flush_interval > 0 {
            if self.blocked || self.not_completed == self.in_flight {
                return None;
            }
        } else if self.plan.count.is_some_and(|c| self.next >= c) {
            return None;
        }
        let i = self.next;
        self.next += 1;
        Some(i)
    }

    /// Issues requests while slots are idle.
    fn issue(&mut self, q: &mut impl QueueTarget) {
        while !self.idle.is_empty() {
            let Some(i) = self.acquire() else {
                return;
            };
            let off = self.plan.offsets.at(i);
            let len = self.plan.bufsize as u64;
            if off.checked_add(len).is_none_or(|e| e > self.plan.size) {
                self.fail(super::past_the_end(i, len, off, self.plan.size));
                return;
            }
            let Some((slot, buffers)) = self.idle.pop() else {
                return;
            };
            let op = if self.plan.write {
                Op::Write(off)
            } else {
                Op::Read(off)
            };
            self.started[slot] = Instant::now();
            self.offsets[slot] = off;
            if let Err(e) = q.submit(op, Some(buffers), slot as u64) {
                self.fail(e.context("cannot submit a request"));
                return;
            }
            self.in_flight += 1;
        }
    }

    fn flush(&mut self, q: &mut impl QueueTarget, token: u64) -> Result<()> {
        q.submit(Op::Flush, None, token)
            .context("cannot submit a flush")
    }

    fn on_done(&mut self, q: &mut impl QueueTarget, d: Done) {
        let slot = (d.token & SLOT_MASK) as usize;
        if d.token & BACKGROUND_FLUSH != 0 {
            self.background -= 1;
            if let Err(e) = d.result {
                self.fail(e.context("Failed flush request"));
            }
            return;
        }
        if d.token & INTERVAL_FLUSH != 0 {
            self.interval_flush = false;
            self.blocked = false;
            if let Err(e) = d.result {
                self.fail(e.context("Failed flush request"));
            }
            return;
        }
        let what = if self.plan.write { "write" } else { "read" };
        let failed = |e: anyhow::Error, off: u64| {
            e.context(format!(
                "Failed request: {what} of {} bytes at offset {off}",
                self.plan.bufsize
            ))
        };
        if d.token & WRITETHROUGH_FLUSH != 0 {
            let buffers = self.parked[slot].take();
            match (d.result, buffers) {
                (Ok(()), Some(b)) => self.complete(q, slot, b),
                (Err(e), _) => {
                    let e = failed(e.context("flush"), self.offsets[slot]);
                    self.in_flight -= 1;
                    self.fail(e);
                }
                (Ok(()), None) => {
                    self.in_flight -= 1;
                    self.fail(anyhow!("a writethrough flush completed twice"));
                }
            }
            return;
        }
        if let Err(e) = d.result {
            let e = failed(e, self.offsets[slot]);
            self.in_flight -= 1;
            self.fail(e);
            return;
        }
        let buffers = match d.buffers {
            Some(b) => b,
            // The queue gives buffers back with their completion; make one if it did not.
            None => match new_buffer(self.plan) {
                Ok(b) => b,
                Err(e) => {
                    self.in_flight -= 1;
                    self.fail(e);
                    return;
                }
            },
        };
        if self.plan.write && self.plan.writethrough && !self.plan.no_flush {
            // The request completes when its flush does; the buffer waits meanwhile.
            match self.flush(q, WRITETHROUGH_FLUSH | slot as u64) {
                Ok(()) => self.parked[slot] = Some(buffers),
                Err(e) => {
                    self.in_flight -= 1;
                    self.fail(e);
                }
            }
            return;
        }
        self.complete(q, slot, buffers);
    }

    fn complete(&mut self, q: &mut impl QueueTarget, slot: usize, buffers: IoBuffers) {
        let now = Instant::now();
        self.latency
            .record(u64::try_from((now - self.started[slot]).as_nanos()).unwrap_or(u64::MAX));
        self.completed += 1;
        self.idle.push((slot, buffers));
        let interval = self.plan.flush_interval;
        if interval == 0 {
            self.in_flight -= 1;
            return;
        }
        // qemu-img bench's bench_cb: requests not issued yet decide the flush points.
        let remaining = self.not_completed - self.in_flight;
        self.not_completed -= 1;
        self.in_flight -= 1;
        if remaining % interval != 0 {
            return;
        }
        if self.plan.drain {
            self.blocked = true;
            if self.in_flight == 0 {
                self.flushes += 1;
                if self.plan.no_flush {
                    self.blocked = false;
                } else if let Err(e) = self.flush(q, INTERVAL_FLUSH) {
                    self.fail(e);
                } else {
                    self.interval_flush = true;
                }
            }
        } else {
            self.flushes += 1;
            if !self.plan.no_flush {
                // Several may be in flight: each its own token (a queue refuses a
                // `user_data` already in flight).
                match self.flush(q, BACKGROUND_FLUSH | (self.flushes & SLOT_MASK)) {
                    Ok(()) => self.background += 1,
                    Err(e) => self.fail(e),
                }
            }
        }
    }
}

/// A request buffer: aligned for O_DIRECT, filled with the pattern (what writes write).
fn new_buffer(plan: &Plan) -> Result<IoBuffers> {
    let mut buf = AlignedBuf::zeroed(plan.bufsize, plan.mem_align.max(1))
        .ok_or_else(|| anyhow!("cannot allocate a {} byte buffer", plan.bufsize))?;
    buf.fill(plan.pattern);
    Ok(IoBuffers::from_aligned(buf))
}

/// Runs the plan on `q` from the calling thread (blocking), `plan.workers` requests in flight.
pub(super) fn drive_queue(mut q: impl QueueTarget, plan: &Plan) -> Result<Outcome> {
    let depth = plan.workers.max(1);
    let mut idle = Vec::with_capacity(depth);
    for slot in (0..depth).rev() {
        idle.push((slot, new_buffer(plan)?));
    }
    let start = Instant::now();
    // As in the task loop: a timed run counts down from a multiple of the interval.
    let not_completed = plan.count.unwrap_or_else(|| {
        u64::MAX
            .checked_div(plan.flush_interval)
            .map_or(u64::MAX, |n| n * plan.flush_interval)
    });
    let mut l = Loop {
        plan,
        deadline: plan.duration.map(|d| start + d),
        idle,
        parked: (0..depth).map(|_| None).collect(),
        started: vec![start; depth],
        offsets: vec![0; depth],
        next: 0,
        in_flight: 0,
        background: 0,
        interval_flush: false,
        not_completed,
        blocked: false,
        stop: false,
        error: None,
        latency: Histogram::new(),
        completed: 0,
        flushes: 0,
    };
    loop {
        l.issue(&mut q);
        if l.in_flight == 0 && l.background == 0 && !l.interval_flush {
            break;
        }
        if let Err(e) = q.wait() {
            // Nothing can be collected any more; dropping the queue waits for the kernel.
            l.fail(e);
            break;
        }
        while let Some(d) = q.next() {
            l.on_done(&mut q, d);
            // As qemu-img's completion callback: the next request goes at once, so the flush
            // schedule sees every count of requests not yet issued.
            l.issue(&mut q);
        }
    }
    let elapsed = start.elapsed();
    let queue = q.stats();
    drop(q);
    if let Some(e) = l.error {
        return Err(e);
    }
    Ok(Outcome {
        completed: l.completed,
        flushes: l.flushes,
        elapsed,
        latency: l.latency,
        queue,
    })
}

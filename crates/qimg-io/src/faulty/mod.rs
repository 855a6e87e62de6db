//! [`FaultyStorage`]: a wrapper that injects I/O errors, torn writes and power loss into any
//! [`Storage`], for crash and error tests of the engine.
//!
//! The wrapper passes every request to the storage it wraps (the *live* storage) and, beside
//! it, keeps a model of what is on stable storage: a *durable* in-memory image (the contents
//! as of the last successful flush) and a *journal* of the modifications that completed since
//! then. A flush that succeeds moves the journal entries it covers into the durable image. A
//! simulated power cut throws the live storage away and builds a post-crash image from the
//! durable image plus a subset of the journal chosen by a [`CrashPolicy`].
//!
//! Faults are armed at run time through a [`FaultController`], a cloneable handle shared with
//! the storage, so a test can hand the storage to the engine and keep the controller.

mod journal;
mod plan;

use journal::*;
pub use plan::{CrashPolicy, FaultAction, FaultPlan, OpCounts, OpFilter};

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::aligned::AlignedBuf;
use crate::error::{Op, Result, StorageError, range_end};
use crate::mem::MemStorage;
use crate::storage::{
    AllocateOutcome, DiscardOutcome, Storage, ZeroOutcome, check_aligned, total_len,
};

/// The granularity, in bytes, at which [`CrashPolicy::Random`] tears unflushed writes: the
/// sector size of the disks the engine is meant to survive.
pub const CRASH_SECTOR: u64 = 512;

/// Size of the buffer [`FaultyStorage::new`] reads the wrapped storage with.
const COPY_CHUNK: usize = 1 << 20;

/// The message of the error every operation fails with once the storage has crashed.
const POWER_LOSS: &str = "simulated power loss: the storage is gone";

/// Everything the storage and its controllers share.
#[derive(Debug)]
struct State {
    counts: OpCounts,
    plans: Vec<FaultPlan>,
    injected: u64,
    crashed: bool,
    /// The contents as of the last successful flush.
    durable: MemStorage,
    /// Modifications completed since, with their completion sequence numbers, oldest first.
    journal: VecDeque<(u64, Change)>,
    /// Sequence number of the next completed modification.
    next_seq: u64,
    /// Data bytes held by the journal.
    journal_bytes: u64,
}

/// What [`FaultyStorage`] does with an operation that was let through.
enum Admit {
    /// Pass it on whole.
    Proceed,
    /// Pass on this many leading bytes, then fail with EIO.
    Torn(u64),
}

/// The shared handle that arms faults on a [`FaultyStorage`], reads its counters, and cuts its
/// power. Clones control the same storage; get one from [`FaultyStorage::controller`].
#[derive(Debug, Clone)]
pub struct FaultController {
    state: Arc<Mutex<State>>,
}

impl FaultController {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while the lock is held, so a poisoned lock still guards consistent
        // state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Arms `plan`. Plans are checked in the order they were armed; when several fire on the
    /// same operation the first wins and the others fire on their next matching operation.
    /// A plan is dropped once it has fired as many times as it was told.
    pub fn arm(&self, plan: FaultPlan) {
        let mut g = self.lock();
        if !plan.exhausted() {
            g.plans.push(plan);
        }
    }

    /// Drops every armed plan.
    pub fn disarm_all(&self) {
        self.lock().plans.clear();
    }

    /// How many plans are armed and not yet used up.
    pub fn armed(&self) -> usize {
        self.lock().plans.len()
    }

    /// How many operations of each kind have reached the storage so far.
    pub fn counts(&self) -> OpCounts {
        self.lock().counts
    }

    /// How many faults (errors, torn writes, crashes) plans have injected so far.
    pub fn injected(&self) -> u64 {
        self.lock().injected
    }

    /// How many completed modifications are not yet covered by a successful flush.
    pub fn unflushed(&self) -> usize {
        self.lock().journal.len()
    }

    /// Data bytes held in memory for unflushed modifications.
    pub fn unflushed_bytes(&self) -> u64 {
        self.lock().journal_bytes
    }

    /// Whether the power has been cut: every operation now fails.
    pub fn is_crashed(&self) -> bool {
        self.lock().crashed
    }

    /// Cuts the power now: every later operation fails (operations in flight fail when they
    /// complete, though what they did may still be part of a post-crash image).
    pub fn crash(&self) {
        self.lock().crashed = true;
    }

    /// Cuts the power (if a crash has not already) and returns what the disk could hold
    /// afterwards under `policy`, as a fresh [`MemStorage`] the engine can reopen. Calling it
    /// again, say with other seeds, gives other possible outcomes of the same crash.
    pub fn power_cut(&self, policy: CrashPolicy) -> MemStorage {
        let mut g = self.lock();
        g.crashed = true;
        image(&g, policy)
    }

    /// The contents as of the last successful flush, without crashing: what
    /// [`power_cut`](FaultController::power_cut) with [`CrashPolicy::DropUnflushed`] would give.
    pub fn flushed_image(&self) -> MemStorage {
        image(&self.lock(), CrashPolicy::DropUnflushed)
    }
}

/// A [`Storage`] wrapper that injects faults and simulates power loss, for tests.
///
/// # Operations and counting
///
/// Every operation goes to the wrapped storage, whose data the reads see. The
/// [`FaultController`] counts operations by kind ([`OpCounts`]): reads, writes (plain and
/// vectored), `write_zeroes`, `discard`, `allocate`, `flush` and `set_len`, including those a
/// fault fails. [`Storage::len`] is not counted and cannot be faulted, so assertions on the
/// length do not shift fault plans. Requests that are out of range or misaligned fail before
/// they are counted, exactly as the wrapped storage would fail them.
///
/// # Faults
///
/// [`FaultPlan`]s armed through the controller fail chosen operations with `EIO` or `ENOSPC`
/// (the errors' [`raw_os_error`](StorageError::raw_os_error) is the errno), tear writes so
/// that only a prefix lands, or cut the power. A failed operation does not reach the wrapped
/// storage (except the prefix of a torn write).
///
/// # Power loss
///
/// Beside the wrapped storage, the wrapper models stable storage: a durable in-memory image
/// holding the contents as of the last successful flush, and a journal of every modification
/// that completed since (writes keep a copy of their data, so the journal's memory grows with
/// the data written between flushes and is released by each flush). A successful
/// [`flush`](Storage::flush) moves into the durable image the journal entries that completed
/// before it was called, as the [`Storage`] contract promises; a failed flush moves nothing.
///
/// [`FaultController::power_cut`] (or a [`FaultAction::Crash`] plan followed by it) stops the
/// storage, after which every operation, `len` included, fails with an I/O error whose message
/// says "simulated power loss", and returns a possible post-crash disk as a [`MemStorage`]
/// chosen by a [`CrashPolicy`]: the durable image plus none, all, a prefix, or a seeded random
/// subset (torn at [`CRASH_SECTOR`] granularity, in any order) of the unflushed modifications.
///
/// The durable image starts as a copy of the wrapped storage's contents: read from it by
/// [`FaultyStorage::new`], or given by the caller to [`FaultyStorage::with_baseline`]. Keeping it
/// costs memory for the data actually stored (it is sparse), so this is for test-sized images.
///
/// The wrapper has the wrapped storage's alignment requirements. Its futures are `Send` and
/// need the executor the wrapped storage needs (none for [`MemStorage`]).
///
/// ```
/// # async fn example() -> qimg_io::Result<()> {
/// use qimg_io::{CrashPolicy, FaultyStorage, Storage};
/// let s = FaultyStorage::in_memory(b"");
/// let ctl = s.controller();
/// s.write_at(b"durable", 0).await?;
/// s.flush().await?;
/// s.write_at(b"lost", 0).await?;
/// let disk = ctl.power_cut(CrashPolicy::DropUnflushed);
/// assert_eq!(disk.snapshot(), b"durable");
/// assert!(s.flush().await.is_err(), "the storage is gone");
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct FaultyStorage<S> {
    inner: S,
    ctl: FaultController,
}

impl FaultyStorage<MemStorage> {
    /// A fresh in-memory storage holding `image`, wrapped, with `image` as the durable state.
    pub fn in_memory(image: &[u8]) -> Self {
        let mem = MemStorage::from_bytes(image);
        FaultyStorage::with_baseline(mem.clone(), &mem)
    }
}

impl<S: Storage> FaultyStorage<S> {
    /// Wraps `inner`, copying its current contents as the durable state (every byte is read
    /// once; all-zero ranges take no memory, but a huge sparse file still takes long to
    /// read). Fails if reading it fails.
    pub async fn new(inner: S) -> Result<Self> {
        let durable = MemStorage::new();
        let len = inner.len().await?;
        let align = inner.request_alignment().max(1);
        let chunk = COPY_CHUNK.max(align);
        let mut buf = AlignedBuf::zeroed(chunk, inner.mem_alignment().max(1)).ok_or(
            StorageError::OutOfRange {
                op: Op::Read,
                offset: 0,
                len: chunk as u64,
            },
        )?;
        let mut pos = 0u64;
        while pos < len {
            let n = inner.read_at_most(&mut buf, pos).await?;
            if n == 0 {
                break;
            }
            for (i, piece) in buf[..n].chunks(SPARSE_PIECE).enumerate() {
                if piece.iter().any(|&b| b != 0) {
                    durable.apply_write(piece, pos + (i * SPARSE_PIECE) as u64);
                }
            }
            pos += n as u64;
        }
        durable.apply_set_len(len);
        Ok(Self::from_parts(inner, durable))
    }

    /// Wraps `inner`, taking a copy of `baseline` as the durable state. The caller promises
    /// that `baseline` holds what `inner` holds (for example two empty storages, or a
    /// [`MemStorage`] and a clone of it); otherwise post-crash images are meaningless.
    pub fn with_baseline(inner: S, baseline: &MemStorage) -> Self {
        Self::from_parts(inner, baseline.copy_contents())
    }

    fn from_parts(inner: S, durable: MemStorage) -> Self {
        FaultyStorage {
            inner,
            ctl: FaultController {
                state: Arc::new(Mutex::new(State {
                    counts: OpCounts::default(),
                    plans: Vec::new(),
                    injected: 0,
                    crashed: false,
                    durable,
                    journal: VecDeque::new(),
                    next_seq: 0,
                    journal_bytes: 0,
                })),
            },
        }
    }

    /// A handle to arm faults, read counters and cut the power; clones share the storage.
    pub fn controller(&self) -> FaultController {
        self.ctl.clone()
    }

    /// The wrapped storage. Modifying it directly bypasses the durability model.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Unwraps the wrapped storage.
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// Checks that a data request is aligned as the wrapped storage requires, so that
    /// refused requests are not counted.
    fn aligned<'b>(
        &self,
        op: Op,
        offset: u64,
        len: u64,
        bufs: impl IntoIterator<Item = &'b [u8]>,
    ) -> Result<()> {
        check_aligned(
            op,
            offset,
            len,
            bufs.into_iter().map(|b| (b.as_ptr() as usize, b.len())),
            self.inner.request_alignment(),
            self.inner.mem_alignment(),
        )
    }

    /// Counts an operation and runs the armed plans on it.
    fn begin(&self, op: Op, offset: u64, len: u64) -> Result<Admit> {
        let mut g = self.ctl.lock();
        if g.crashed {
            return Err(power_loss(op, offset, len));
        }
        g.counts.bump(op);
        let mut action = None;
        for p in g.plans.iter_mut().filter(|p| p.filter.matches(op)) {
            p.seen += 1;
            if action.is_none() && p.seen > p.skip && !p.exhausted() {
                action = Some(p.action);
                p.fired += 1;
            }
        }
        g.plans.retain(|p| !p.exhausted());
        let Some(action) = action else {
            return Ok(Admit::Proceed);
        };
        g.injected += 1;
        match action {
            FaultAction::Eio => Err(errno(op, offset, len, nix::errno::Errno::EIO)),
            FaultAction::NoSpace => Err(errno(op, offset, len, nix::errno::Errno::ENOSPC)),
            FaultAction::Crash => {
                g.crashed = true;
                Err(power_loss(op, offset, len))
            }
            FaultAction::TornWrite { keep } => match op {
                Op::Write | Op::WriteZeroes => {
                    let align = self.inner.request_alignment().max(1) as u64;
                    let keep = keep.min(len);
                    Ok(Admit::Torn(keep - keep % align))
                }
                _ => Err(errno(op, offset, len, nix::errno::Errno::EIO)),
            },
        }
    }

    /// Journals a completed modification; fails if the power was cut meanwhile.
    fn finish(&self, op: Op, offset: u64, len: u64, change: Option<Change>) -> Result<()> {
        let mut g = self.ctl.lock();
        if let Some(c) = change {
            let seq = g.next_seq;
            g.next_seq += 1;
            g.journal_bytes += c.bytes();
            g.journal.push_back((seq, c));
        }
        if g.crashed {
            return Err(power_loss(op, offset, len));
        }
        Ok(())
    }
}

fn errno(op: Op, offset: u64, len: u64, e: nix::errno::Errno) -> StorageError {
    StorageError::io(op, offset, len, io::Error::from_raw_os_error(e as i32))
}

fn power_loss(op: Op, offset: u64, len: u64) -> StorageError {
    StorageError::io(op, offset, len, io::Error::other(POWER_LOSS))
}

/// The first `keep` bytes of `bufs`, as segments borrowing from them.
fn prefix<'b>(bufs: &'b [IoSlice<'_>], keep: u64) -> Vec<IoSlice<'b>> {
    let mut left = usize::try_from(keep).unwrap_or(usize::MAX);
    let mut out = Vec::new();
    for b in bufs {
        if left == 0 {
            break;
        }
        let seg: &'b [u8] = b;
        let n = seg.len().min(left);
        out.push(IoSlice::new(&seg[..n]));
        left -= n;
    }
    out
}

fn concat(bufs: &[IoSlice<'_>], len: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    for b in bufs {
        v.extend_from_slice(b);
    }
    v
}

impl<S: Storage> Storage for FaultyStorage<S> {
    async fn read_at_most(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let len = buf.len() as u64;
        range_end(Op::Read, offset, len)?;
        self.aligned(Op::Read, offset, len, [&*buf])?;
        self.begin(Op::Read, offset, len)?;
        let n = self.inner.read_at_most(buf, offset).await?;
        self.finish(Op::Read, offset, len, None)?;
        Ok(n)
    }

    async fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        range_end(Op::Write, offset, len)?;
        self.aligned(Op::Write, offset, len, [buf])?;
        let (keep, torn) = match self.begin(Op::Write, offset, len)? {
            Admit::Proceed => (len, false),
            Admit::Torn(keep) => (keep, true),
        };
        let part = &buf[..keep as usize];
        if !part.is_empty() {
            self.inner.write_at(part, offset).await?;
        }
        let change = (!part.is_empty()).then(|| Change::Write {
            offset,
            data: part.to_vec(),
        });
        self.finish(Op::Write, offset, len, change)?;
        if torn {
            return Err(errno(Op::Write, offset, len, nix::errno::Errno::EIO));
        }
        Ok(())
    }

    async fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> Result<()> {
        let len = total_len(Op::Write, bufs, offset)?;
        range_end(Op::Write, offset, len)?;
        self.aligned(Op::Write, offset, len, bufs.iter().map(|b| &**b))?;
        let (keep, torn) = match self.begin(Op::Write, offset, len)? {
            Admit::Proceed => (len, false),
            Admit::Torn(keep) => (keep, true),
        };
        let cut;
        let part: &[IoSlice<'_>] = if keep == len {
            bufs
        } else {
            cut = prefix(bufs, keep);
            &cut
        };
        if keep > 0 {
            self.inner.write_vectored_at(part, offset).await?;
        }
        let change = (keep > 0).then(|| Change::Write {
            offset,
            data: concat(part, keep),
        });
        self.finish(Op::Write, offset, len, change)?;
        if torn {
            return Err(errno(Op::Write, offset, len, nix::errno::Errno::EIO));
        }
        Ok(())
    }

    async fn write_zeroes(&self, offset: u64, len: u64) -> Result<ZeroOutcome> {
        range_end(Op::WriteZeroes, offset, len)?;
        self.aligned(Op::WriteZeroes, offset, len, [])?;
        let (keep, torn) = match self.begin(Op::WriteZeroes, offset, len)? {
            Admit::Proceed => (len, false),
            Admit::Torn(keep) => (keep, true),
        };
        let outcome = self.inner.write_zeroes(offset, keep).await?;
        let change = (keep > 0).then_some(Change::Zero {
            offset,
            len: keep,
            grow: true,
        });
        self.finish(Op::WriteZeroes, offset, len, change)?;
        if torn {
            return Err(errno(Op::WriteZeroes, offset, len, nix::errno::Errno::EIO));
        }
        Ok(outcome)
    }

    async fn discard(&self, offset: u64, len: u64) -> Result<DiscardOutcome> {
        range_end(Op::Discard, offset, len)?;
        self.begin(Op::Discard, offset, len)?;
        let outcome = self.inner.discard(offset, len).await?;
        let change = (outcome == DiscardOutcome::Deallocated && len > 0).then_some(Change::Zero {
            offset,
            len,
            grow: false,
        });
        self.finish(Op::Discard, offset, len, change)?;
        Ok(outcome)
    }

    async fn allocate(&self, offset: u64, len: u64) -> Result<AllocateOutcome> {
        let end = range_end(Op::Allocate, offset, len)?;
        self.begin(Op::Allocate, offset, len)?;
        let outcome = self.inner.allocate(offset, len).await?;
        let change = (outcome == AllocateOutcome::Reserved).then_some(Change::Grow { end });
        self.finish(Op::Allocate, offset, len, change)?;
        Ok(outcome)
    }

    async fn flush(&self) -> Result<()> {
        self.begin(Op::Flush, 0, 0)?;
        // Every modification whose future completed before this call is journalled below
        // this mark.
        let mark = self.ctl.lock().next_seq;
        self.inner.flush().await?;
        let mut g = self.ctl.lock();
        if g.crashed {
            return Err(power_loss(Op::Flush, 0, 0));
        }
        while g.journal.front().is_some_and(|(seq, _)| *seq < mark) {
            if let Some((_, c)) = g.journal.pop_front() {
                c.apply(&g.durable);
                g.journal_bytes -= c.bytes();
            }
        }
        Ok(())
    }

    async fn len(&self) -> Result<u64> {
        if self.ctl.is_crashed() {
            return Err(power_loss(Op::Len, 0, 0));
        }
        self.inner.len().await
    }

    async fn set_len(&self, len: u64) -> Result<()> {
        range_end(Op::SetLen, len, 0)?;
        self.begin(Op::SetLen, len, 0)?;
        self.inner.set_len(len).await?;
        self.finish(Op::SetLen, len, 0, Some(Change::SetLen { len }))
    }

    fn unlock_image(&self) {
        self.inner.unlock_image()
    }

    fn debug_event(&self, event: crate::DebugEvent) {
        self.inner.debug_event(event)
    }

    fn lock_image(&self, lock: crate::ImageLock) -> Result<()> {
        self.inner.lock_image(lock)
    }

    fn request_alignment(&self) -> usize {
        self.inner.request_alignment()
    }

    fn mem_alignment(&self) -> usize {
        self.inner.mem_alignment()
    }
}

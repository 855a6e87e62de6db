//! What to inject: which operations a fault matches, what it does, when, and how often;
//! what a power cut keeps; the operation counts.

use crate::error::Op;

/// Which operations a [`FaultPlan`] watches (and counts towards its trigger).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpFilter {
    /// Every counted operation (see [`FaultyStorage`](super::FaultyStorage) for which are counted).
    All,
    /// Reads ([`Storage::read_at_most`](crate::Storage::read_at_most) and the reads built on it).
    Reads,
    /// Data writes: [`Storage::write_at`](crate::Storage::write_at) and [`Storage::write_vectored_at`](crate::Storage::write_vectored_at).
    Writes,
    /// Every modifying operation: writes, `write_zeroes`, `discard`, `allocate`, `set_len`.
    Modifications,
    /// [`Storage::flush`](crate::Storage::flush).
    Flushes,
    /// One kind of operation.
    Only(Op),
}

impl OpFilter {
    /// Whether `op` passes this filter.
    pub fn matches(self, op: Op) -> bool {
        match self {
            OpFilter::All => true,
            OpFilter::Reads => op == Op::Read,
            OpFilter::Writes => op == Op::Write,
            OpFilter::Modifications => matches!(
                op,
                Op::Write | Op::WriteZeroes | Op::Discard | Op::Allocate | Op::SetLen
            ),
            OpFilter::Flushes => op == Op::Flush,
            OpFilter::Only(o) => op == o,
        }
    }
}

/// What a [`FaultPlan`] does to an operation it fires on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultAction {
    /// Fail with `EIO`; the operation does not reach the wrapped storage.
    Eio,
    /// Fail with `ENOSPC`; the operation does not reach the wrapped storage.
    NoSpace,
    /// Tear a write: only the first `keep` bytes (capped at the request's length and rounded
    /// down to the request alignment) of a write, vectored write or `write_zeroes` reach the
    /// wrapped storage, then the operation fails with `EIO`. The prefix that landed is an
    /// unflushed modification like any other. On other operations this acts as
    /// [`FaultAction::Eio`].
    TornWrite {
        /// How many leading bytes of the request land.
        keep: u64,
    },
    /// Power loss just before the operation: it does not happen, it and every later operation
    /// fail, and [`FaultController::power_cut`](super::FaultController::power_cut) gives the possible contents of the disk.
    Crash,
}

/// A fault armed on a [`FaultyStorage`](super::FaultyStorage): which operations it watches, how many of them it lets
/// through, what it does to the next ones and how many times.
///
/// A plan counts only the operations its [`OpFilter`] matches, from the moment it is armed.
/// Built with [`FaultPlan::new`], it fires on the first matching operation, once; see
/// [`after`](FaultPlan::after), [`times`](FaultPlan::times) and
/// [`forever`](FaultPlan::forever).
///
/// ```
/// use qimg_io::{FaultAction, FaultPlan, OpFilter};
/// // Fail the third flush from now with EIO, and only that one.
/// let third_flush = FaultPlan::new(OpFilter::Flushes, FaultAction::Eio).after(2);
/// // Every write from the tenth on runs out of space.
/// let full_disk = FaultPlan::new(OpFilter::Writes, FaultAction::NoSpace).after(9).forever();
/// // Lose power after exactly 100 operations.
/// let power_cut = FaultPlan::crash_after(100);
/// # let _ = (third_flush, full_disk, power_cut);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultPlan {
    pub(super) filter: OpFilter,
    pub(super) action: FaultAction,
    pub(super) skip: u64,
    pub(super) times: Option<u64>,
    pub(super) seen: u64,
    pub(super) fired: u64,
}

impl FaultPlan {
    /// A plan that applies `action` to the first operation `filter` matches, once.
    pub fn new(filter: OpFilter, action: FaultAction) -> Self {
        FaultPlan {
            filter,
            action,
            skip: 0,
            times: Some(1),
            seen: 0,
            fired: 0,
        }
    }

    /// A power cut just before the operation with index `n` (counting every operation from 0
    /// when the plan is armed), so that exactly `n` operations happen.
    pub fn crash_after(n: u64) -> Self {
        FaultPlan::new(OpFilter::All, FaultAction::Crash).after(n)
    }

    /// Lets `n` matching operations through before the first fault.
    pub fn after(mut self, n: u64) -> Self {
        self.skip = n;
        self
    }

    /// Faults the `n` matching operations after the skipped ones (0 disarms the plan).
    pub fn times(mut self, n: u64) -> Self {
        self.times = Some(n);
        self
    }

    /// Faults every matching operation after the skipped ones.
    pub fn forever(mut self) -> Self {
        self.times = None;
        self
    }

    pub(super) fn exhausted(&self) -> bool {
        self.times.is_some_and(|t| self.fired >= t)
    }
}

/// How a simulated power cut treats modifications that completed but were not flushed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CrashPolicy {
    /// None of them survives: the disk holds exactly the contents as of the last flush.
    DropUnflushed,
    /// All of them survive, applied in the order they completed (as if the cache was written
    /// back in order before the power went).
    KeepAll,
    /// The first `n` of them in completion order survive, the rest are lost (an ordered
    /// write-back interrupted part way).
    KeepFirst(usize),
    /// A subset chosen deterministically from `seed` survives, applied in a shuffled order.
    /// Each unflushed modification is dropped, kept whole or (for data writes) torn: each
    /// [`CRASH_SECTOR`](super::CRASH_SECTOR)-byte sector of it independently kept or lost. `write_zeroes`,
    /// `discard`, `allocate` and `set_len` are kept whole or dropped. Because the order is
    /// shuffled, an older write to a sector may land over a newer one, as disks allow.
    Random {
        /// The seed; equal seeds give equal images for equal histories.
        seed: u64,
    },
}

/// How many operations of each kind reached a [`FaultyStorage`](super::FaultyStorage), including those that a fault
/// failed. [`Storage::len`](crate::Storage::len) and the alignment queries are not counted; requests refused as
/// out of range or misaligned before reaching the storage are not counted either.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct OpCounts {
    /// [`Storage::read_at_most`](crate::Storage::read_at_most) calls (each read, whatever the method, makes one).
    pub reads: u64,
    /// [`Storage::write_at`](crate::Storage::write_at) and [`Storage::write_vectored_at`](crate::Storage::write_vectored_at) calls.
    pub writes: u64,
    /// [`Storage::write_zeroes`](crate::Storage::write_zeroes) calls.
    pub write_zeroes: u64,
    /// [`Storage::discard`](crate::Storage::discard) calls.
    pub discards: u64,
    /// [`Storage::allocate`](crate::Storage::allocate) calls.
    pub allocates: u64,
    /// [`Storage::flush`](crate::Storage::flush) calls.
    pub flushes: u64,
    /// [`Storage::set_len`](crate::Storage::set_len) calls.
    pub set_lens: u64,
}

impl OpCounts {
    /// The number of counted operations of every kind.
    pub fn total(&self) -> u64 {
        self.reads
            + self.writes
            + self.write_zeroes
            + self.discards
            + self.allocates
            + self.flushes
            + self.set_lens
    }

    pub(super) fn bump(&mut self, op: Op) {
        let n = match op {
            Op::Read => &mut self.reads,
            Op::Write => &mut self.writes,
            Op::WriteZeroes => &mut self.write_zeroes,
            Op::Discard => &mut self.discards,
            Op::Allocate => &mut self.allocates,
            Op::Flush => &mut self.flushes,
            Op::SetLen => &mut self.set_lens,
            Op::Len | Op::Probe | Op::Lock => return,
        };
        *n += 1;
    }
}

//! The slot table ([`Driver`]) and what handles, futures and the completion side share
//! ([`Shared`]): collecting completions, handing requests over to the completion thread, and
//! the only accesses to the ring's submission and completion queues.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::task::{Context, Waker};
use std::time::Duration;

use io_uring::{IoUring, squeue};

use crate::aligned::AlignedBuf;
use crate::file::FileStorage;

use super::SHUTDOWN;
use super::submission::{RequestMemory, RingOps};

/// Where a slot's request stands.
pub(super) enum SlotState {
    /// Submitted; this task wants to hear of the completion.
    Waiting(Waker),
    /// Completed with this result (bytes transferred, or a negated errno); the owning future
    /// has not collected it yet.
    Done(i32),
    /// Submitted, and the future that submitted it was dropped: free the slot (and its
    /// memory) when the completion arrives.
    Abandoned,
}

/// A request's place in the ring, from submission until its completion is collected.
pub(super) struct Slot {
    pub(super) owned: RequestMemory,
    pub(super) state: SlotState,
    /// Left to the completion thread: its submitter found it unfinished after submitting
    /// (or dropped its future), so somebody must wait in the kernel for its completion.
    pub(super) handed: bool,
}

/// The ring's bookkeeping, behind the mutex that also gives exclusive access to the ring's
/// submission and completion queues.
pub(super) struct Driver {
    /// Indexed by `user_data`.
    pub(super) slots: Vec<Option<Slot>>,
    /// Indices of empty slots.
    pub(super) free: Vec<usize>,
    /// Tasks waiting for a free slot.
    pub(super) waiting: Vec<Waker>,
    /// Set when the last handle is dropped: the completion thread ends once the kernel holds
    /// no slot's memory any more.
    pub(super) shutdown: bool,
    /// Slots with `handed` set: while there are none, the completion thread sleeps on
    /// `Shared::armed` rather than in the kernel, where every completion would wake it (even
    /// those of requests the kernel finished inside the submitting call, which their tasks
    /// collect themselves).
    pub(super) handed: usize,
    /// The completion thread waits on `Shared::armed`.
    pub(super) parked: bool,
    /// With batched submission: a request is on the submission queue whose task yielded and
    /// will submit everything queued when polled again.
    pub(super) submitter: bool,
}

impl Driver {
    pub(super) fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Slots whose memory the kernel may still be using: submitted and not completed.
    pub(super) fn kernel_busy(&self) -> usize {
        self.slots
            .iter()
            .flatten()
            .filter(|s| !matches!(s.state, SlotState::Done(_)))
            .count()
    }

    /// Empties slot `idx` and lets waiting tasks compete for it.
    pub(super) fn release(&mut self, idx: usize, wake: &mut Vec<Waker>) -> Option<Slot> {
        let slot = self.slots.get_mut(idx)?.take()?;
        if slot.handed {
            self.handed -= 1;
        }
        self.free.push(idx);
        wake.append(&mut self.waiting);
        Some(slot)
    }
}

/// What the handles, the futures and the completion thread share.
pub(super) struct Shared {
    // Field order matters for drop: the ring (and with it any kernel reference to the
    // buffers) goes before the file and the slots. `Drop for Shared` has already waited for
    // every request by then.
    pub(super) ring: IoUring,
    pub(super) driver: Mutex<Driver>,
    /// Wakes the completion thread when a request is handed to it (or at shutdown).
    pub(super) armed: Condvar,
    /// The file, for its descriptor and as the fallback for everything not on the ring.
    pub(super) file: FileStorage,
    pub(super) fd: RawFd,
    pub(super) caps: RingOps,
    /// Whether FALLOC_FL_ZERO_RANGE, FALLOC_FL_PUNCH_HOLE and plain fallocate may work
    /// (cleared when the file system says they cannot).
    pub(super) zero_range: AtomicBool,
    pub(super) punch_hole: AtomicBool,
    pub(super) reserve: AtomicBool,
    /// [`UringOptions::collect_inline_completions`].
    ///
    /// [`UringOptions::collect_inline_completions`]: crate::UringOptions::collect_inline_completions
    pub(super) inline: bool,
    /// Batched submission ([`UringOptions::complete_on_runtime`]).
    ///
    /// [`UringOptions::complete_on_runtime`]: crate::UringOptions::complete_on_runtime
    pub(super) batch: bool,
    /// A task on a tokio runtime waits for completions (the completion thread stays parked).
    pub(super) reaper: AtomicBool,
    /// Bounce buffers of finished requests, reused instead of allocating and zeroing new ones
    /// ([`UringStorage::bounce`](super::UringStorage)).
    pub(super) spare: Mutex<Vec<AlignedBuf>>,
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, Driver> {
        // Nothing panics while the lock is held, so a poisoned lock still guards consistent
        // state.
        self.driver.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Collects every completion waiting in the queue. Tasks to wake go to `wake`, to be
    /// woken after the lock is released.
    pub(super) fn reap(&self, driver: &mut Driver, wake: &mut Vec<Waker>) {
        // SAFETY: `completion_shared` requires that no other `CompletionQueue` of this ring
        // exists. Every call in this module happens here, with the driver mutex held (`driver` is
        // borrowed from its guard), and the queue is dropped before this function returns.
        let cq = unsafe { self.ring.completion_shared() };
        for cqe in cq {
            let user_data = cqe.user_data();
            if user_data == SHUTDOWN {
                continue;
            }
            let Ok(idx) = usize::try_from(user_data) else {
                continue;
            };
            let Some(Some(slot)) = driver.slots.get_mut(idx) else {
                continue;
            };
            let handed = std::mem::take(&mut slot.handed);
            match std::mem::replace(&mut slot.state, SlotState::Done(cqe.result())) {
                SlotState::Waiting(w) => wake.push(w),
                SlotState::Abandoned => {
                    // The kernel is done with the memory and nobody wants the result.
                    driver.release(idx, wake);
                }
                // One completion per request: cannot happen, and keeping the first result
                // is harmless.
                SlotState::Done(r) => slot.state = SlotState::Done(r),
            }
            if handed {
                driver.handed -= 1;
            }
        }
    }

    /// Leaves slot `idx` to the completion thread, waking it if it sleeps.
    pub(super) fn hand_over(&self, driver: &mut Driver, idx: usize) {
        if let Some(Some(slot)) = driver.slots.get_mut(idx) {
            // A completed request needs nobody to wait for it.
            if !slot.handed && !matches!(slot.state, SlotState::Done(_)) {
                slot.handed = true;
                driver.handed += 1;
                if driver.parked && !self.reaper.load(Ordering::Acquire) {
                    driver.parked = false;
                    self.armed.notify_one();
                }
            }
        }
    }

    /// Submits whatever sits in the submission queue. If something stays unsubmitted (the
    /// kernel was short of memory, say), asks to be polled again to retry, so no entry is left
    /// behind while every task sleeps.
    pub(super) fn submit(&self, driver: &mut Driver, cx: &mut Context<'_>) {
        if self.ring.submit().is_err() || self.unsubmitted(driver) > 0 {
            cx.waker().wake_by_ref();
        }
    }

    /// Entries in the submission queue the kernel has not consumed yet.
    pub(super) fn unsubmitted(&self, _driver: &mut Driver) -> usize {
        // SAFETY: `submission_shared` requires that no other `SubmissionQueue` of this ring
        // exists. Every call in this module happens with the driver mutex held (`_driver` is
        // borrowed from its guard), and the queue is dropped at the end of this statement.
        unsafe { self.ring.submission_shared() }.len()
    }

    /// Puts `entry` on the submission queue; false when the queue is full.
    ///
    /// # Safety
    ///
    /// Every pointer in `entry` must stay valid (and its memory untouched by Rust code, for
    /// reads) until the completion with the entry's `user_data` has been reaped, and the
    /// entry's descriptor must stay open until then.
    pub(super) unsafe fn push(&self, _driver: &mut Driver, entry: &squeue::Entry) -> bool {
        // SAFETY: exclusivity of the submission queue as in `unsubmitted` (the driver mutex is
        // held: `_driver` comes from its guard; the queue is dropped, publishing the new tail, at
        // the end of the block). Validity of the entry's memory is this function's
        // precondition, passed on to `push`.
        unsafe {
            let mut sq = self.ring.submission_shared();
            sq.push(entry).is_ok()
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Normally the completion thread has already seen every request complete. Should it
        // not have (it could not be started, say), wait here: the slots' memory must outlive
        // the kernel's use of it.
        let mut wake = Vec::new();
        loop {
            {
                let mut driver = self.lock();
                self.reap(&mut driver, &mut wake);
                if driver.kernel_busy() == 0 {
                    return;
                }
            }
            if self.ring.submit_and_wait(1).is_err() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

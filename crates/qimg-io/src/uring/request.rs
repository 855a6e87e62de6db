//! The future of one ring request ([`Request`]): waiting for a slot, submitting (batched or
//! not), collecting the completion, and, when dropped early, leaving the slot to be freed on
//! completion so the kernel never touches freed memory.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use nix::libc;

use super::driver::{Driver, Shared, Slot, SlotState};
use super::submission::{RequestKind, RequestMemory};

/// A completed request: its result and its memory, back from the slot.
pub(super) struct Completion {
    pub(super) result: i32,
    pub(super) owned: RequestMemory,
}

/// Where a [`Request`] stands.
pub(super) enum Stage {
    /// Not submitted yet (no free slot so far).
    Queued(RequestKind, RequestMemory),
    /// On the submission queue in this slot, which this future submits (with whatever else
    /// is queued) when polled again: it yielded so that other tasks can queue theirs.
    Yielded(usize),
    /// On the submission queue in this slot; `poll` submits it after releasing the lock.
    Submit(usize),
    /// Submitted in this slot.
    InFlight(usize),
    /// Completed and collected.
    Finished,
}

/// The future of one ring request.
pub(super) struct Request<'a> {
    pub(super) shared: &'a Shared,
    pub(super) stage: Stage,
}

impl Request<'_> {
    /// One step of the request, with the driver locked.
    fn step(
        &mut self,
        driver: &mut Driver,
        cx: &mut Context<'_>,
        wake: &mut Vec<Waker>,
    ) -> Poll<Completion> {
        let shared = self.shared;
        match std::mem::replace(&mut self.stage, Stage::Finished) {
            Stage::Queued(kind, owned) => {
                let Some(idx) = driver.free.pop() else {
                    if !driver.waiting.iter().any(|w| w.will_wake(cx.waker())) {
                        driver.waiting.push(cx.waker().clone());
                    }
                    self.stage = Stage::Queued(kind, owned);
                    return Poll::Pending;
                };
                let slot = driver.slots[idx].insert(Slot {
                    owned,
                    state: SlotState::Waiting(cx.waker().clone()),
                    handed: false,
                });
                // The entry points into the slot's memory, which stays put from here on.
                let entry = kind.entry(shared.fd, &mut slot.owned).user_data(idx as u64);
                // SAFETY: the entry's pointers (the bounce buffer and the iovec, with lengths
                // capped at the buffer's) point into the heap blocks of `slots[idx].owned`.
                // That slot is emptied only (a) by this future after the completion for
                // `user_data == idx` was reaped (`Done`), (b) by `reap` on that completion if
                // this future was dropped (`Abandoned`); and (c) the ring and the slots are
                // dropped only after the completion thread and `Drop for Shared` saw no slot
                // left with the kernel (`kernel_busy() == 0`). Moving `RequestMemory`
                // into the slot moved no heap block, and nothing touches them until then. The
                // descriptor belongs to `shared.file`, which lives as long as the ring.
                if !unsafe { shared.push(driver, &entry) } {
                    // Queue full (entries that failed to submit earlier): the kernel never saw
                    // this entry, so the memory is ours again. Try again shortly.
                    let owned = driver
                        .release(idx, wake)
                        .map(|s| s.owned)
                        .unwrap_or_else(RequestMemory::empty);
                    self.stage = Stage::Queued(kind, owned);
                    let _ = shared.ring.submit();
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                if shared.batch {
                    if driver.submitter {
                        // Another task submits the queue soon.
                        self.stage = Stage::InFlight(idx);
                        shared.hand_over(driver, idx);
                    } else {
                        driver.submitter = true;
                        self.stage = Stage::Yielded(idx);
                        cx.waker().wake_by_ref();
                    }
                    return Poll::Pending;
                }
                // Submitted by `poll` once the driver lock is released: the system call
                // (which, for page-cache hits, does the whole transfer) must not hold up the
                // other tasks and the completion thread.
                self.stage = Stage::Submit(idx);
                Poll::Pending
            }
            Stage::Yielded(idx) => {
                // The batch is whatever is queued now; requests queued from here on start
                // the next one.
                driver.submitter = false;
                self.stage = Stage::Submit(idx);
                Poll::Pending
            }
            // Only `poll` sees this stage (it submits and moves on to `InFlight`).
            Stage::Submit(idx) => {
                self.stage = Stage::InFlight(idx);
                self.step(driver, cx, wake)
            }
            Stage::InFlight(idx) => {
                let state = driver
                    .slots
                    .get_mut(idx)
                    .and_then(|s| s.as_mut())
                    .map(|s| &mut s.state);
                match state {
                    Some(SlotState::Done(result)) => {
                        let result = *result;
                        let owned = driver
                            .release(idx, wake)
                            .map(|s| s.owned)
                            .unwrap_or_else(RequestMemory::empty);
                        Poll::Ready(Completion { result, owned })
                    }
                    Some(SlotState::Waiting(w)) => {
                        if !w.will_wake(cx.waker()) {
                            *w = cx.waker().clone();
                        }
                        self.stage = Stage::InFlight(idx);
                        if !driver.submitter && shared.unsubmitted(driver) > 0 {
                            shared.submit(driver, cx);
                        }
                        Poll::Pending
                    }
                    // Only this future empties or abandons its slot, so neither can happen;
                    // report an I/O error rather than panic.
                    Some(SlotState::Abandoned) | None => Poll::Ready(Completion {
                        result: -libc::EIO,
                        owned: RequestMemory::empty(),
                    }),
                }
            }
            // Polled after completion.
            Stage::Finished => Poll::Ready(Completion {
                result: -libc::EIO,
                owned: RequestMemory::empty(),
            }),
        }
    }
}

impl Future for Request<'_> {
    type Output = Completion;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Completion> {
        let this = self.get_mut();
        let mut wake = Vec::new();
        let mut out = {
            let mut driver = this.shared.lock();
            this.shared.reap(&mut driver, &mut wake);
            this.step(&mut driver, cx, &mut wake)
        };
        if let Stage::Submit(idx) = this.stage {
            this.stage = Stage::InFlight(idx);
            out = this.submitted(idx, cx, &mut wake);
        }
        // Woken outside the lock, so a waker that polls inline cannot deadlock.
        wake.into_iter().for_each(Waker::wake);
        out
    }
}

impl Request<'_> {
    /// Submits the queue (without the driver lock, which the system call does not need: the
    /// entry is already published) and hands the request to the completion thread. With
    /// [`UringOptions::collect_inline_completions`] it first collects the completion if the
    /// kernel finished the request inside the call, as it does for reads and writes served by
    /// the page cache; the task then goes on at once instead of sleeping until the
    /// completion thread wakes it.
    ///
    /// [`UringOptions::collect_inline_completions`]: crate::UringOptions::collect_inline_completions
    fn submitted(
        &mut self,
        idx: usize,
        cx: &mut Context<'_>,
        wake: &mut Vec<Waker>,
    ) -> Poll<Completion> {
        let shared = self.shared;
        let failed = shared.ring.submit().is_err();
        let mut driver = shared.lock();
        if !shared.inline {
            // Another task's submission may have taken this entry along, and a poll
            // elsewhere collected its completion already (waking this task, which is
            // running now): then it is finished.
            let done = matches!(
                driver.slots.get(idx),
                Some(Some(Slot {
                    state: SlotState::Done(_),
                    ..
                }))
            );
            if done {
                return self.step(&mut driver, cx, wake);
            }
            if failed || shared.unsubmitted(&mut driver) > 0 {
                cx.waker().wake_by_ref();
            }
            shared.hand_over(&mut driver, idx);
            return Poll::Pending;
        }
        // Reaping our own completion must not wake this task (it is running and collects
        // the result now); other tasks' completions are woken as usual.
        let mine = match driver.slots.get_mut(idx).and_then(|s| s.as_mut()) {
            Some(Slot {
                state: SlotState::Waiting(w),
                ..
            }) => Some(std::mem::replace(w, Waker::noop().clone())),
            _ => None,
        };
        shared.reap(&mut driver, wake);
        if let Some(Some(Slot {
            state: SlotState::Waiting(w),
            ..
        })) = driver.slots.get_mut(idx)
        {
            // Still with the kernel: wait for the completion with the real waker.
            if let Some(real) = mine {
                *w = real;
            } else if !w.will_wake(cx.waker()) {
                *w = cx.waker().clone();
            }
            if failed || shared.unsubmitted(&mut driver) > 0 {
                // Not (all) submitted: try again on the next poll.
                cx.waker().wake_by_ref();
            }
            shared.hand_over(&mut driver, idx);
            return Poll::Pending;
        }
        self.step(&mut driver, cx, wake)
    }
}

impl Drop for Request<'_> {
    fn drop(&mut self) {
        let (Stage::InFlight(idx) | Stage::Submit(idx) | Stage::Yielded(idx)) = self.stage else {
            return;
        };
        let mut wake = Vec::new();
        let unsubmitted = matches!(self.stage, Stage::Submit(_) | Stage::Yielded(_));
        if unsubmitted {
            // The batch (or this request) is on the queue: submit it before letting go.
            if matches!(self.stage, Stage::Yielded(_)) {
                self.shared.lock().submitter = false;
            }
            let _ = self.shared.ring.submit();
        }
        {
            let mut driver = self.shared.lock();
            let done = match driver.slots.get_mut(idx).and_then(|s| s.as_mut()) {
                Some(slot) => match slot.state {
                    SlotState::Done(_) => true,
                    // The kernel may still be using the memory: leave it to `reap`.
                    _ => {
                        slot.state = SlotState::Abandoned;
                        false
                    }
                },
                None => false,
            };
            if !done {
                self.shared.hand_over(&mut driver, idx);
            }
            if done {
                // Completed: the kernel is finished with the memory.
                drop(driver.release(idx, &mut wake));
            }
        }
        wake.into_iter().for_each(Waker::wake);
    }
}

//! Guest cluster range locks: the in-flight request tracking that keeps requests touching the
//! same guest clusters from interleaving.
//!
//! Reads take their clusters shared; writes, write-zeroes and discards take them exclusive, for
//! the whole request at once (so a multi-cluster request is atomic with respect to other
//! requests, and there is no lock ordering to get wrong). One exception: the queue's direct
//! path takes a write's clusters shared and keeps them so only when the write changes no
//! metadata (in place: in-place writes to one cluster then run together, as QEMU's do); a
//! write that needs more upgrades to exclusive when no one else holds them, or goes to the
//! engine. Requests on disjoint clusters never wait for each other. The lock is held across
//! data I/O; the metadata lock is not.

use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// A guest cluster range `[start, end)`, held or wanted.
#[derive(Debug, Clone, Copy)]
struct Range {
    start: u64,
    end: u64,
    exclusive: bool,
    id: u64,
}

impl Range {
    fn conflicts(&self, start: u64, end: u64, exclusive: bool) -> bool {
        self.start < end && start < self.end && (exclusive || self.exclusive)
    }
}

/// A request waiting for a range; woken only by releases that overlap it.
#[derive(Debug)]
struct Waiter {
    range: Range,
    wake: Arc<Notify>,
}

#[derive(Debug, Default)]
struct State {
    /// Held ranges, in slots reused from holder to holder: a holder's id names its slot (low
    /// 32 bits) and a serial number (high 32 bits, so that a stale id never releases the
    /// slot's next holder), and a release finds its range without a search.
    held: Vec<Option<Range>>,
    /// Free slots of `held`.
    free: Vec<u32>,
    /// Exclusive ranges among `held`: with none, a shared range conflicts with nothing.
    exclusive_held: usize,
    waiting: Vec<Waiter>,
    /// Serial numbers of holders and waiters.
    serial: u64,
}

impl State {
    fn conflicts(&self, start: u64, end: u64, exclusive: bool) -> bool {
        (exclusive || self.exclusive_held > 0)
            && self
                .held
                .iter()
                .flatten()
                .any(|h| h.conflicts(start, end, exclusive))
    }

    fn next_serial(&mut self) -> u64 {
        self.serial = self.serial.wrapping_add(1);
        self.serial
    }

    /// Holds `[start, end)` and returns the holder's id.
    fn hold(&mut self, start: u64, end: u64, exclusive: bool) -> u64 {
        let slot = match self.free.pop() {
            Some(s) => s as usize,
            None => {
                self.held.push(None);
                self.held.len() - 1
            }
        };
        let id = (self.next_serial() << 32) | slot as u64;
        self.exclusive_held += usize::from(exclusive);
        self.held[slot] = Some(Range {
            start,
            end,
            exclusive,
            id,
        });
        id
    }

    /// Gives up the range of holder `id`, if it is still held.
    fn unhold(&mut self, id: u64) -> Option<Range> {
        let slot = (id & 0xffff_ffff) as usize;
        let held = self.held.get_mut(slot)?;
        if held.is_none_or(|r| r.id != id) {
            return None;
        }
        let gone = held.take()?;
        self.free.push(slot as u32);
        self.exclusive_held -= usize::from(gone.exclusive);
        Some(gone)
    }
}

/// The set of guest cluster ranges held by requests in flight.
///
/// Uncontended, taking and releasing a range is one short critical section on a std mutex:
/// no waiter registration, no wake-up. A request that must wait registers its range with a
/// wake-up of its own, and a release wakes only the waiters whose range overlaps the released
/// one (each then checks again, so a wake-up that finds the range still taken costs one
/// check).
#[derive(Debug, Default)]
pub(crate) struct RangeLocks {
    state: Mutex<State>,
}

/// A held range; dropping it releases the range and wakes waiters.
#[derive(Debug)]
pub(crate) struct RangeGuard<'a> {
    locks: &'a RangeLocks,
    id: u64,
}

/// Removes a waiter's registration if its future is dropped before it got the range.
struct Registration<'a> {
    locks: &'a RangeLocks,
    id: u64,
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        let mut state = self.locks.state();
        let id = self.id;
        state.waiting.retain(|w| w.range.id != id);
    }
}

impl RangeLocks {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until `[start, end)` (guest cluster indices) conflicts with no held range, then
    /// holds it. Shared holders conflict only with exclusive ones.
    pub(crate) async fn lock(&self, start: u64, end: u64, exclusive: bool) -> RangeGuard<'_> {
        let id = self.acquire(start, end, exclusive).await;
        RangeGuard { locks: self, id }
    }

    /// Takes `[start, end)` and returns the holder id to pass to [`release`](Self::release)
    /// (for holders that outlive a borrow, such as write leases).
    pub(crate) async fn acquire(&self, start: u64, end: u64, exclusive: bool) -> u64 {
        let (range, wake) = {
            let mut state = self.state();
            if !state.conflicts(start, end, exclusive) {
                return state.hold(start, end, exclusive);
            }
            let range = Range {
                start,
                end,
                exclusive,
                id: state.next_serial(),
            };
            let wake = Arc::new(Notify::new());
            state.waiting.push(Waiter {
                range,
                wake: wake.clone(),
            });
            (range, wake)
        };
        let registration = Registration {
            locks: self,
            id: range.id,
        };
        loop {
            // `notify_one` leaves a permit when it comes before this await: no lost wake-up.
            wake.notified().await;
            let mut state = self.state();
            if !state.conflicts(start, end, exclusive) {
                state.waiting.retain(|w| w.range.id != range.id);
                let id = state.hold(start, end, exclusive);
                drop(state);
                std::mem::forget(registration);
                return id;
            }
        }
    }

    /// Takes `[start, end)` if nothing conflicts with it now, without waiting: the holder id
    /// for [`release`](Self::release), or `None`.
    pub(crate) fn try_acquire(&self, start: u64, end: u64, exclusive: bool) -> Option<u64> {
        let mut state = self.state();
        if state.conflicts(start, end, exclusive) {
            return None;
        }
        Some(state.hold(start, end, exclusive))
    }

    /// Takes `[start, end)` shared for a write that will change no metadata (an in-place
    /// write: several may share clusters, as reads do), unless something holds it exclusively
    /// or an exclusive request waits for part of it (which would otherwise wait for as long as
    /// such writes keep coming). `None` without waiting.
    pub(crate) fn try_acquire_in_place(&self, start: u64, end: u64) -> Option<u64> {
        let mut state = self.state();
        let waiter = state
            .waiting
            .iter()
            .any(|w| w.range.exclusive && w.range.start < end && start < w.range.end);
        if waiter || state.conflicts(start, end, false) {
            return None;
        }
        Some(state.hold(start, end, false))
    }

    /// Makes the shared range of holder `id` exclusive if no other holder overlaps it now;
    /// false (the range stays shared) otherwise.
    pub(crate) fn try_upgrade(&self, id: u64) -> bool {
        let mut state = self.state();
        let slot = (id & 0xffff_ffff) as usize;
        let Some(Some(mine)) = state.held.get(slot).copied() else {
            return false;
        };
        if mine.id != id {
            return false;
        }
        if mine.exclusive {
            return true;
        }
        let others = state
            .held
            .iter()
            .flatten()
            .any(|h| h.id != id && h.start < mine.end && mine.start < h.end);
        if others {
            return false;
        }
        if let Some(Some(r)) = state.held.get_mut(slot) {
            r.exclusive = true;
        }
        state.exclusive_held += 1;
        true
    }

    /// Number of ranges held now.
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.state().held.iter().flatten().count()
    }

    /// Number of requests waiting now.
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> usize {
        self.state().waiting.len()
    }

    /// Gives up the range held under `id`, waking the waiters it was keeping out.
    pub(crate) fn release(&self, id: u64) {
        let mut state = self.state();
        let Some(gone) = state.unhold(id) else {
            return;
        };
        for w in &state.waiting {
            if gone.conflicts(w.range.start, w.range.end, w.range.exclusive) {
                w.wake.notify_one();
            }
        }
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        self.locks.release(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    #[tokio::test]
    async fn shared_holders_coexist_and_an_exclusive_one_waits_for_them() {
        let locks = Arc::new(RangeLocks::default());
        let a = locks.lock(0, 4, false).await;
        let _b = locks.lock(2, 6, false).await;
        let l2 = locks.clone();
        let waiter = tokio::spawn(async move {
            let _g = l2.lock(3, 4, true).await;
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !waiter.is_finished(),
            "exclusive lock granted over shared holders"
        );
        drop(a);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !waiter.is_finished(),
            "exclusive lock granted while one holder remains"
        );
        drop(_b);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("waiter woke")
            .unwrap();
        assert_eq!(locks.held(), 0);
    }

    #[test]
    fn in_place_writes_share_and_upgrade_only_alone() {
        let locks = RangeLocks::default();
        let a = locks.try_acquire_in_place(0, 1).unwrap();
        let b = locks.try_acquire_in_place(0, 1).unwrap();
        assert!(!locks.try_upgrade(a), "upgraded over another holder");
        assert!(locks.try_acquire(0, 1, true).is_none());
        locks.release(b);
        assert!(locks.try_upgrade(a), "alone, the upgrade must work");
        assert!(
            locks.try_acquire_in_place(0, 1).is_none(),
            "shared over exclusive"
        );
        assert!(
            locks.try_acquire(0, 1, false).is_none(),
            "read over exclusive"
        );
        locks.release(a);
        assert!(!locks.try_upgrade(a), "a released holder upgraded");
        assert_eq!(locks.held(), 0);
    }

    #[tokio::test]
    async fn in_place_writes_let_a_waiting_exclusive_request_in() {
        let locks = Arc::new(RangeLocks::default());
        let a = locks.try_acquire_in_place(0, 2).unwrap();
        let l2 = locks.clone();
        let waiter = tokio::spawn(async move { l2.acquire(1, 2, true).await });
        while locks.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        assert!(
            locks.try_acquire_in_place(1, 3).is_none(),
            "an in-place write overtook a waiting exclusive request"
        );
        assert!(
            locks.try_acquire_in_place(5, 6).is_some(),
            "elsewhere: free"
        );
        locks.release(a);
        let id = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("the waiter got the range")
            .unwrap();
        locks.release(id);
    }

    #[test]
    fn try_acquire_refuses_shared_over_exclusive_until_released() {
        let locks = RangeLocks::default();
        let a = locks.try_acquire(0, 4, false).unwrap();
        let b = locks.try_acquire(2, 6, false).unwrap();
        assert!(
            locks.try_acquire(3, 4, true).is_none(),
            "exclusive over shared"
        );
        let w = locks.try_acquire(10, 12, true).unwrap();
        assert!(
            locks.try_acquire(11, 12, false).is_none(),
            "shared over exclusive"
        );
        assert!(
            locks.try_acquire(11, 12, true).is_none(),
            "exclusive over exclusive"
        );
        // Disjoint from the exclusive range: shared still goes.
        let c = locks.try_acquire(12, 13, false).unwrap();
        locks.release(w);
        let d = locks.try_acquire(11, 12, false).unwrap();
        for id in [a, b, c, d] {
            locks.release(id);
        }
        let e = locks.try_acquire(0, 20, true).unwrap();
        locks.release(e);
        assert_eq!(locks.held(), 0);
    }

    #[test]
    fn a_stale_id_never_releases_the_next_holder_of_its_slot() {
        let locks = RangeLocks::default();
        let first = locks.try_acquire(0, 4, true).unwrap();
        locks.release(first);
        // The same slot, another holder.
        let second = locks.try_acquire(2, 3, true).unwrap();
        assert_eq!(first & 0xffff_ffff, second & 0xffff_ffff);
        locks.release(first);
        assert_eq!(locks.held(), 1);
        assert!(locks.try_acquire(2, 3, false).is_none());
        locks.release(second);
        assert_eq!(locks.held(), 0);
        assert!(locks.try_acquire(2, 3, false).is_some());
    }

    #[tokio::test]
    async fn disjoint_exclusive_ranges_do_not_wait() {
        let locks = RangeLocks::default();
        let _a = locks.lock(0, 1, true).await;
        let _b = tokio::time::timeout(Duration::from_secs(1), locks.lock(1, 2, true))
            .await
            .expect("disjoint range granted at once");
        assert_eq!(locks.held(), 2);
    }

    #[tokio::test]
    async fn a_release_wakes_only_the_waiters_it_kept_out() {
        let locks = Arc::new(RangeLocks::default());
        let a = locks.lock(0, 2, true).await;
        let b = locks.lock(10, 12, true).await;
        let (l1, l2) = (locks.clone(), locks.clone());
        let behind_a = tokio::spawn(async move { drop(l1.lock(1, 2, true).await) });
        let behind_b = tokio::spawn(async move { drop(l2.lock(11, 12, false).await) });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(locks.waiting(), 2);
        drop(b);
        tokio::time::timeout(Duration::from_secs(5), behind_b)
            .await
            .expect("waiter behind b woke")
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!behind_a.is_finished(), "waiter behind a got a held range");
        assert_eq!(locks.waiting(), 1);
        drop(a);
        tokio::time::timeout(Duration::from_secs(5), behind_a)
            .await
            .expect("waiter behind a woke")
            .unwrap();
        assert_eq!((locks.held(), locks.waiting()), (0, 0));
    }

    #[tokio::test]
    async fn a_cancelled_waiter_leaves_no_registration() {
        let locks = RangeLocks::default();
        let held = locks.lock(0, 4, true).await;
        let gave_up =
            tokio::time::timeout(Duration::from_millis(20), locks.lock(1, 2, false)).await;
        assert!(gave_up.is_err());
        assert_eq!(locks.waiting(), 0);
        drop(held);
        assert_eq!(locks.held(), 0);
        let _again = locks.lock(1, 2, true).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_tasks_on_overlapping_ranges_all_finish_and_never_share_a_cluster() {
        let locks = Arc::new(RangeLocks::default());
        // Holders per cluster: an exclusive holder must find its clusters empty.
        let clusters: Arc<Vec<AtomicU64>> = Arc::new((0..20).map(|_| AtomicU64::new(0)).collect());
        let mut tasks = Vec::new();
        for t in 0..32u64 {
            let (locks, clusters) = (locks.clone(), clusters.clone());
            tasks.push(tokio::spawn(async move {
                for i in 0..50u64 {
                    let start = (t * 7 + i * 3) % 16;
                    let g = locks.lock(start, start + 4, true).await;
                    for c in start..start + 4 {
                        let before = clusters[c as usize].fetch_add(1, Ordering::SeqCst);
                        assert_eq!(before, 0, "cluster {c} held twice");
                    }
                    tokio::task::yield_now().await;
                    for c in start..start + 4 {
                        clusters[c as usize].fetch_sub(1, Ordering::SeqCst);
                    }
                    drop(g);
                }
            }));
        }
        for t in tasks {
            tokio::time::timeout(Duration::from_secs(20), t)
                .await
                .expect("no deadlock")
                .unwrap();
        }
        assert_eq!((locks.held(), locks.waiting()), (0, 0));
    }
}

//! Guest cluster range locks: the in-flight request tracking that keeps requests touching the
//! same guest clusters from interleaving.
//!
//! Reads take their clusters shared; writes, write-zeroes and discards take them exclusive, for
//! the whole request at once (so a multi-cluster request is atomic with respect to other
//! requests, and there is no lock ordering to get wrong). Requests on disjoint clusters never
//! wait for each other. The lock is held across data I/O; the metadata lock is not.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::Notify;

#[derive(Debug, Clone, Copy)]
struct Held {
    start: u64,
    end: u64,
    exclusive: bool,
    id: u64,
}

/// The set of guest cluster ranges held by requests in flight.
#[derive(Debug, Default)]
pub(crate) struct RangeLocks {
    held: Mutex<Vec<Held>>,
    released: Notify,
    next_id: AtomicU64,
}

/// A held range; dropping it releases the range and wakes waiters.
#[derive(Debug)]
pub(crate) struct RangeGuard<'a> {
    locks: &'a RangeLocks,
    id: u64,
}

impl RangeLocks {
    /// Waits until `[start, end)` (guest cluster indices) conflicts with no held range, then
    /// holds it. Shared holders conflict only with exclusive ones.
    pub(crate) async fn lock(&self, start: u64, end: u64, exclusive: bool) -> RangeGuard<'_> {
        let id = self.acquire(start, end, exclusive).await;
        RangeGuard { locks: self, id }
    }

    /// Takes `[start, end)` and returns the holder id to pass to [`release`](Self::release)
    /// (for holders that outlive a borrow, such as write leases).
    pub(crate) async fn acquire(&self, start: u64, end: u64, exclusive: bool) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        loop {
            let notified = self.released.notified();
            let mut notified = std::pin::pin!(notified);
            // Registered before the check, so a release between the check and the await is
            // not missed.
            notified.as_mut().enable();
            {
                let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
                let conflict = held
                    .iter()
                    .any(|h| h.start < end && start < h.end && (exclusive || h.exclusive));
                if !conflict {
                    held.push(Held {
                        start,
                        end,
                        exclusive,
                        id,
                    });
                    return id;
                }
            }
            notified.await;
        }
    }

    /// Number of ranges held now.
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl RangeLocks {
    /// Gives up the range held under `id`.
    pub(crate) fn release(&self, id: u64) {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.retain(|h| h.id != id);
        drop(held);
        self.released.notify_waiters();
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

    #[tokio::test]
    async fn disjoint_exclusive_ranges_do_not_wait() {
        let locks = RangeLocks::default();
        let _a = locks.lock(0, 1, true).await;
        let _b = tokio::time::timeout(Duration::from_secs(1), locks.lock(1, 2, true))
            .await
            .expect("disjoint range granted at once");
        assert_eq!(locks.held(), 2);
    }
}

//! Who waits in the kernel for completions: the completion thread, or (with
//! [`UringOptions::complete_on_runtime`]) a task of the tokio runtime; and the shutdown when
//! the last handle goes ([`Owner`]).
//!
//! [`UringOptions::complete_on_runtime`]: crate::UringOptions::complete_on_runtime

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::task::Waker;
use std::thread::JoinHandle;
use std::time::Duration;

use io_uring::{IoUring, opcode};
use nix::libc;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use super::SHUTDOWN;
use super::driver::Shared;

/// The completion thread: reaps completions as they come and wakes their tasks, until the
/// storage is dropped and the kernel holds no slot's memory any more.
pub(super) fn complete(shared: Arc<Shared>) {
    loop {
        let mut wake = Vec::new();
        let stop = {
            let mut driver = shared.lock();
            loop {
                shared.reap(&mut driver, &mut wake);
                let ours = driver.handed > 0 && !shared.reaper.load(Ordering::Acquire);
                if driver.shutdown || ours || !wake.is_empty() {
                    break;
                }
                // Nothing is left to us: sleep until a request is handed over or the storage
                // is dropped, instead of in the kernel.
                driver.parked = true;
                driver = shared.armed.wait(driver).unwrap_or_else(|e| e.into_inner());
                driver.parked = false;
            }
            driver.shutdown && driver.kernel_busy() == 0
        };
        let idle = wake.is_empty();
        wake.into_iter().for_each(Waker::wake);
        if stop {
            return;
        }
        if !idle {
            // Look again before sleeping in the kernel: the woken tasks may have handed
            // nothing more over.
            continue;
        }
        // Sleeps until at least one completion is in the queue (returns at once if one already
        // is), submitting anything left in the submission queue on the way.
        match shared.ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            // EBUSY/EAGAIN clear up as completions are reaped; anything else should not
            // happen on a valid ring. Either way, do not spin.
            Err(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

/// The ring's descriptor registered with the I/O driver of the tokio runtime current now, or
/// `None` without a runtime ([`UringOptions::complete_on_runtime`]).
///
/// [`UringOptions::complete_on_runtime`]: crate::UringOptions::complete_on_runtime
pub(super) fn runtime_watch(
    ring: &IoUring,
) -> std::io::Result<Option<(tokio::runtime::Handle, AsyncFd<OwnedFd>)>> {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return Ok(None);
    };
    // A descriptor of our own: the registration stays valid whatever happens to the ring's.
    let fd = ring.as_fd().try_clone_to_owned()?;
    let afd = {
        let _in = handle.enter();
        // SAFETY: `register_with_interest` requires the descriptor to stay open and refer to
        // the same file for the life of the `AsyncFd`; it is an `OwnedFd` that the `AsyncFd`
        // owns and closes only when dropped.
        unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
            .map_err(|e| e.into_parts().1)?
    };
    Ok(Some((handle, afd)))
}

/// The runtime task of [`UringOptions::complete_on_runtime`]: collects completions whenever
/// the ring's descriptor is readable and wakes their tasks, until the storage is dropped. If
/// the runtime drops it first, the completion thread takes over.
///
/// [`UringOptions::complete_on_runtime`]: crate::UringOptions::complete_on_runtime
pub(super) async fn reaper(weak: Weak<Shared>, afd: AsyncFd<OwnedFd>) {
    struct Handover(Weak<Shared>);
    impl Drop for Handover {
        fn drop(&mut self) {
            if let Some(shared) = self.0.upgrade() {
                shared.reaper.store(false, Ordering::Release);
                let mut driver = shared.lock();
                if driver.parked {
                    driver.parked = false;
                    shared.armed.notify_one();
                }
            }
        }
    }
    let _handover = Handover(weak.clone());
    loop {
        let Ok(mut ready) = afd.readable().await else {
            return;
        };
        let Some(shared) = weak.upgrade() else {
            return;
        };
        let mut wake = Vec::new();
        let stop = {
            let mut driver = shared.lock();
            shared.reap(&mut driver, &mut wake);
            driver.shutdown
        };
        wake.into_iter().for_each(Waker::wake);
        if stop {
            return;
        }
        // Keeps readiness that arrived since `readable` returned (tokio compares ticks).
        ready.clear_ready();
    }
}

/// The handle's owner: shuts the completion thread down when the last handle goes.
pub(super) struct Owner {
    pub(super) shared: Arc<Shared>,
    pub(super) thread: Option<JoinHandle<()>>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        {
            let mut driver = self.shared.lock();
            driver.shutdown = true;
            self.shared.armed.notify_all();
            // Wake the completion thread from its wait with a no-op. Every queued entry
            // belongs to a slot and there are as many queue entries as slots, so after
            // submitting there is room unless the kernel refuses entries; then the
            // outstanding requests' completions wake the thread instead.
            let nop = opcode::Nop::new().build().user_data(SHUTDOWN);
            for _ in 0..3 {
                // SAFETY: a no-op carries no pointers and no descriptor.
                if unsafe { self.shared.push(&mut driver, &nop) } {
                    break;
                }
                let _ = self.shared.ring.submit();
            }
            let _ = self.shared.ring.submit();
        }
        if let Some(t) = self.thread.take() {
            // A waker run on the completion thread could drop the last handle there; that
            // thread then ends by itself once nothing is in flight.
            if t.thread().id() != std::thread::current().id() {
                // Returns once every request still in flight (of cancelled futures) completed.
                let _ = t.join();
            }
        }
    }
}

//! Breakpoints of a `blkdebug` node, as qemu-io's `break`, `wait_break`, `resume` and
//! `remove_break` set and release them: a request that reaches a breakpoint's event stops
//! (it is *suspended* under the breakpoint's tag) until it is resumed, so that a test can
//! hold one request at a chosen point while others run.
//!
//! The engine announces an event just before the requests it is for
//! ([`Storage::debug_event`](crate::Storage::debug_event) is synchronous): the storage notes
//! the breakpoint the event hit, and its next request stops before it starts. Each
//! breakpoint fires once (QEMU removes it when it fires). What QEMU prints
//! (`blkdebug: Suspended request 'A'`, `blkdebug: Resuming request 'A'`) goes to the
//! [`set_reporter`] function, which a command-line tool points at its standard output; a
//! library prints nothing.

use std::sync::{Arc, Mutex, OnceLock};

use tokio::sync::Notify;

use super::DebugEvent;

/// Where QEMU's breakpoint messages go (nowhere until [`set_reporter`]).
static REPORTER: OnceLock<fn(&str)> = OnceLock::new();

/// Sends the messages QEMU's `blkdebug` prints when a request stops at a breakpoint or is
/// resumed to `report` (the first call wins).
pub fn set_reporter(report: fn(&str)) {
    let _ = REPORTER.set(report);
}

fn report(line: &str) {
    if let Some(r) = REPORTER.get() {
        r(line);
    }
}

/// The breakpoints of one `blkdebug` node and the requests stopped at them. Shared by every
/// open of the node's image (see [`crate::blkdebug::attach`]) and by whoever sets them.
#[derive(Debug, Default)]
pub struct Breakpoints {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// `(event, tag)`, newest first (QEMU's rule lists).
    rules: Vec<(DebugEvent, String)>,
    /// Requests stopped, oldest first, each with what wakes it.
    suspended: Vec<(String, Arc<Notify>)>,
}

/// Why a breakpoint operation did nothing: QEMU's `ENOENT` in every case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoSuchBreakpoint;

impl Breakpoints {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// qemu-io's `break EVENT TAG`: the next request after `event` stops, tagged `tag`.
    /// An event name QEMU does not know is refused.
    pub fn add(&self, event: &str, tag: &str) -> Result<(), NoSuchBreakpoint> {
        let event = DebugEvent::from_name(event).ok_or(NoSuchBreakpoint)?;
        self.lock().rules.insert(0, (event, tag.to_string()));
        Ok(())
    }

    /// qemu-io's `remove_break TAG`: removes the breakpoints tagged `tag` and resumes the
    /// requests stopped under it; refused when there was no breakpoint to remove.
    pub fn remove(&self, tag: &str) -> Result<(), NoSuchBreakpoint> {
        let (rules, woken) = {
            let mut s = self.lock();
            let before = s.rules.len();
            s.rules.retain(|(_, t)| t != tag);
            let rules = before - s.rules.len();
            let mut woken = Vec::new();
            s.suspended.retain(|(t, n)| {
                if t == tag {
                    woken.push(n.clone());
                }
                t != tag
            });
            (rules, woken)
        };
        for n in &woken {
            report(&format!("blkdebug: Resuming request '{tag}'"));
            n.notify_one();
        }
        // As QEMU's: refused when no breakpoint was left to remove, even if a request
        // stopped under the tag was resumed.
        if rules == 0 {
            return Err(NoSuchBreakpoint);
        }
        Ok(())
    }

    /// qemu-io's `resume TAG`: the oldest request stopped under `tag` goes on.
    pub fn resume(&self, tag: &str) -> Result<(), NoSuchBreakpoint> {
        let woken = {
            let mut s = self.lock();
            let at = s
                .suspended
                .iter()
                .position(|(t, _)| t == tag)
                .ok_or(NoSuchBreakpoint)?;
            s.suspended.remove(at).1
        };
        report(&format!("blkdebug: Resuming request '{tag}'"));
        woken.notify_one();
        Ok(())
    }

    /// How many requests are stopped.
    pub fn suspended(&self) -> usize {
        self.lock().suspended.len()
    }

    /// Drops every breakpoint and lets every stopped request go on, silently: what closing
    /// the image does (QEMU's node goes with its rules; its close would wait for ever on a
    /// stopped request).
    pub fn release_all(&self) {
        let woken = {
            let mut s = self.lock();
            s.rules.clear();
            std::mem::take(&mut s.suspended)
        };
        for (_, n) in woken {
            n.notify_one();
        }
    }

    /// Whether a request is stopped under `tag` (qemu-io's `wait_break` waits for this).
    pub fn is_suspended(&self, tag: &str) -> bool {
        self.lock().suspended.iter().any(|(t, _)| t == tag)
    }

    /// The tag of the breakpoint `event` hits, which fires (and goes) now.
    pub(super) fn hit(&self, event: DebugEvent) -> Option<String> {
        let mut s = self.lock();
        let at = s.rules.iter().position(|(e, _)| *e == event)?;
        Some(s.rules.remove(at).1)
    }

    /// Stops the calling request under `tag` until it is resumed.
    pub(super) async fn suspend(&self, tag: String) {
        let wake = Arc::new(Notify::new());
        self.lock().suspended.push((tag.clone(), wake.clone()));
        report(&format!("blkdebug: Suspended request '{tag}'"));
        // `notify_one` stores a permit when nobody waits yet: no wake-up is lost.
        wake.notified().await;
    }
}

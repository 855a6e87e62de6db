//! Hang guards: a test that waits for something (a socket, a process, a load) gives up with a
//! clear message after a limit of at least ten times what the wait takes on a quiet machine.
//! A guard is never a speed limit: a busy CI machine stays far inside it, and only a wait that
//! would never end reaches it.

use std::time::{Duration, Instant};

/// One wait under a hang guard; see the [module docs](self).
#[derive(Debug)]
pub struct HangGuard {
    what: String,
    quiet: Duration,
    limit: Duration,
    start: Instant,
}

impl HangGuard {
    /// Starts timing `what`, which takes about `quiet` on a quiet machine; [`check`]
    /// fails after `limit`, which must be at least ten times `quiet` (the project's rule,
    /// checked here once for every guard).
    ///
    /// [`check`]: Self::check
    pub fn start(what: impl Into<String>, quiet: Duration, limit: Duration) -> Self {
        let what = what.into();
        assert!(
            limit >= quiet * 10,
            "hang guard for {what}: a limit of {limit:?} is under ten times the quiet {quiet:?}"
        );
        Self {
            what,
            quiet,
            limit,
            start: Instant::now(),
        }
    }

    /// Whether the limit has passed (for a wait that must not panic, a `Drop` that falls
    /// back to a harder stop).
    pub fn expired(&self) -> bool {
        self.start.elapsed() > self.limit
    }

    /// Panics, naming the wait, once the limit has passed.
    pub fn check(&self) {
        if self.expired() {
            panic!(
                "hang guard: {} did not end within {:?} (it takes about {:?} on a quiet machine)",
                self.what, self.limit, self.quiet
            );
        }
    }
}

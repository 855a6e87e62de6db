//! qemu-img's progress line (`-p`): `    (12.34/100%)\r` on stdout, printed again whenever one
//! more whole percent is done, and a newline at the end.

/// A progress line over `total` units of work.
pub struct Progress {
    on: bool,
    total: u64,
    done: u64,
    last: f64,
}

impl Progress {
    /// A progress line that prints only when `on`; prints 0% at once.
    pub fn start(on: bool, total: u64) -> Self {
        let p = Self {
            on,
            total,
            done: 0,
            last: 0.0,
        };
        if on {
            p.print(0.0);
        }
        p
    }

    fn print(&self, pct: f64) {
        out!("    ({pct:3.2}/100%)\r");
        crate::out::flush();
    }

    /// Counts `n` more units done.
    pub fn add(&mut self, n: u64) {
        self.done = self.done.saturating_add(n);
        if !self.on || self.total == 0 {
            return;
        }
        let pct = (self.done as f64 * 100.0 / self.total as f64).min(100.0);
        if pct - self.last >= 1.0 || (pct >= 100.0 && self.last < 100.0) {
            self.last = pct;
            self.print(pct);
        }
    }

    /// Sets the amount of work, once it is known (a progress line started before it).
    pub fn set_total(&mut self, total: u64) {
        self.total = total;
    }

    /// The work is done: 100% printed once more if the last line said less (qemu-img's
    /// block jobs print it when the job completes, whatever was copied).
    pub fn complete(&mut self) {
        if self.on && self.last < 100.0 {
            self.last = 100.0;
            self.print(100.0);
        }
    }

    /// Ends the line (qemu-img prints a newline whether or not the work finished).
    pub fn end(&mut self) {
        if self.on {
            outln!();
            self.on = false;
        }
    }
}

/// qemu-img's progress state where a command drives it by steps (`qemu_progress_print`):
/// each step adds a percentage, capped at 100; a line is printed when the value moved more
/// than 2 points, or is 0 or 100 (so 100 may be printed several times, as qemu-img prints
/// it).
pub struct Steps {
    on: bool,
    current: f64,
    last: f64,
}

impl Steps {
    /// Prints 0% at once when `on`.
    pub fn start(on: bool) -> Self {
        let mut p = Self {
            on,
            current: 0.0,
            last: 0.0,
        };
        p.set(0.0);
        p
    }

    /// Adds `pct` points.
    pub fn step(&mut self, pct: f64) {
        self.set(self.current + pct);
    }

    /// Sets the value to `pct`.
    pub fn set(&mut self, pct: f64) {
        self.current = pct.min(100.0);
        if self.current > self.last + 2.0 || self.current == 100.0 || self.current == 0.0 {
            self.last = self.current;
            if self.on {
                out!("    ({:3.2}/100%)\r", self.current);
                crate::out::flush();
            }
        }
    }

    /// Ends the line.
    pub fn end(&mut self) {
        if self.on {
            outln!();
            self.on = false;
        }
    }
}

/// The `-r RATE` of `convert` and `commit` (bytes per second; 0: no limit): a piece of work
/// starts no earlier than the bytes taken before it allow at the rate.
pub struct Pace {
    rate: u64,
    started: tokio::time::Instant,
    taken: u64,
}

impl Pace {
    /// A pace of `rate` bytes per second (0: never waits).
    pub fn new(rate: u64) -> Self {
        Self {
            rate,
            started: tokio::time::Instant::now(),
            taken: 0,
        }
    }

    /// Waits until the bytes taken so far are due at the rate, then takes `n` more.
    pub async fn take(&mut self, n: u64) {
        if self.rate == 0 {
            return;
        }
        tokio::time::sleep_until(self.started + self.due()).await;
        self.taken += n;
    }

    /// How long after the start the next piece may begin: the bytes taken so far at the rate.
    fn due(&self) -> std::time::Duration {
        match self.rate {
            0 => std::time::Duration::ZERO,
            rate => std::time::Duration::from_secs_f64(self.taken as f64 / rate as f64),
        }
    }
}

#[cfg(test)]
mod pace_tests {
    use super::Pace;
    use std::time::Duration;

    #[test]
    fn a_piece_starts_when_the_bytes_before_it_are_due() {
        // Counted, not timed: only the first piece is due at once.
        let mut p = Pace::new(1 << 20);
        assert_eq!(p.due(), Duration::ZERO);
        p.taken += 2 << 20;
        assert_eq!(p.due(), Duration::from_secs(2));
        p.taken += 512 << 10;
        assert_eq!(p.due(), Duration::from_millis(2500));
        // No limit: never waits, whatever was taken.
        let mut free = Pace::new(0);
        free.taken = u64::MAX;
        assert_eq!(free.due(), Duration::ZERO);
    }
}

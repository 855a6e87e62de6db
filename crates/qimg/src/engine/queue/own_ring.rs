//! The queue's own io_uring ring, or none: a queue on storage without a descriptor the ring
//! could use (memory, an NBD export), or where io_uring cannot be set up (a kernel without
//! it, a seccomp filter or `kernel.io_uring_disabled` refusing it), has no ring and runs
//! every request on its engine thread, with the same completions on the same eventfd.
//!
//! Without a ring there are no free places ([`available`](OwnRing::available) is 0), so the
//! direct path, the ring's copy-on-write and the ring's slice loads, which all ask for a
//! place first, hand their requests to the engine thread.

use std::io;
use std::os::fd::BorrowedFd;

use nix::errno::Errno;
use qimg_io::queue::{IoBuffers, QueueRing, RingCompletion};

/// A queue's ring, if it has one.
#[derive(Debug)]
pub(super) struct OwnRing(Option<QueueRing>);

/// Why an operation found no ring (never seen: places are asked for first).
fn no_ring() -> io::Error {
    io::Error::new(io::ErrorKind::WouldBlock, "the queue has no io_uring ring")
}

impl OwnRing {
    /// A ring of `depth` places with `eventfd` signalled for its completions; `None` inside
    /// when `wanted` is false or io_uring is not available (`ENOSYS`, `EPERM`). Other
    /// errors (a depth out of range, no memory for the ring) are the caller's.
    pub(super) fn new(
        wanted: bool,
        depth: u32,
        poll: std::time::Duration,
        eventfd: BorrowedFd<'_>,
    ) -> io::Result<Self> {
        QueueRing::check_depth(depth)?;
        if !wanted {
            return Ok(Self(None));
        }
        let mut ring = match QueueRing::new(depth) {
            Ok(ring) => ring,
            Err(e)
                if matches!(
                    e.raw_os_error().map(Errno::from_raw),
                    Some(Errno::ENOSYS | Errno::EPERM)
                ) =>
            {
                return Ok(Self(None));
            }
            Err(e) => return Err(e),
        };
        ring.set_poll(poll);
        ring.register_eventfd(eventfd)?;
        Ok(Self(Some(ring)))
    }

    /// Whether there is a ring.
    pub(super) fn exists(&self) -> bool {
        self.0.is_some()
    }

    /// Free places for operations (0 without a ring).
    pub(super) fn available(&self) -> usize {
        self.0.as_ref().map_or(0, QueueRing::available)
    }

    /// Operations not reaped yet.
    pub(super) fn in_flight(&self) -> usize {
        self.0.as_ref().map_or(0, QueueRing::in_flight)
    }

    /// `io_uring_enter` calls so far.
    pub(super) fn submit_calls(&self) -> u64 {
        self.0.as_ref().map_or(0, QueueRing::submit_calls)
    }

    /// [`QueueRing::read`].
    pub(super) fn read(
        &mut self,
        fd: BorrowedFd<'_>,
        offset: u64,
        bufs: &mut IoBuffers,
        pos: usize,
        len: usize,
        token: u64,
    ) -> io::Result<()> {
        match &mut self.0 {
            Some(r) => r.read(fd, offset, bufs, pos, len, token),
            None => Err(no_ring()),
        }
    }

    /// [`QueueRing::write`].
    pub(super) fn write(
        &mut self,
        fd: BorrowedFd<'_>,
        offset: u64,
        bufs: &IoBuffers,
        pos: usize,
        len: usize,
        token: u64,
    ) -> io::Result<()> {
        match &mut self.0 {
            Some(r) => r.write(fd, offset, bufs, pos, len, token),
            None => Err(no_ring()),
        }
    }

    /// [`QueueRing::submit`].
    pub(super) fn submit(&mut self) -> io::Result<usize> {
        self.0.as_mut().map_or(Ok(0), QueueRing::submit)
    }

    /// [`QueueRing::wait`].
    pub(super) fn wait(&mut self) -> io::Result<()> {
        self.0.as_mut().map_or(Ok(()), QueueRing::wait)
    }

    /// [`QueueRing::reap`].
    pub(super) fn reap(&mut self, f: impl FnMut(RingCompletion)) -> usize {
        self.0.as_mut().map_or(0, |r| r.reap(f))
    }
}

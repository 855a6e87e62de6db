//! [`Notifier`]: the eventfd a queue's completions signal.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use nix::sys::eventfd::{EfdFlags, EventFd};

/// An eventfd shared by a queue's ring (the kernel signals it per completion) and the threads
/// that finish requests off the ring. Cloning shares the same descriptor.
#[derive(Debug, Clone)]
pub struct Notifier {
    fd: Arc<OwnedFd>,
}

impl Notifier {
    /// A new non-blocking, close-on-exec eventfd.
    pub fn new() -> io::Result<Self> {
        let fd = EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
            .map_err(io::Error::from)?;
        Ok(Notifier {
            fd: Arc::new(OwnedFd::from(fd)),
        })
    }

    /// Uses the caller's eventfd (for example one a VMM already polls). It should be
    /// non-blocking, or [`drain`](Self::drain) blocks while nothing was signalled.
    pub fn from_fd(fd: OwnedFd) -> Self {
        Notifier { fd: Arc::new(fd) }
    }

    /// Signals the eventfd once.
    pub fn notify(&self) -> io::Result<()> {
        match nix::unistd::write(&*self.fd, &1u64.to_ne_bytes()) {
            Ok(_) => Ok(()),
            // The counter is at its maximum: the reader has plenty to wake up for.
            Err(nix::errno::Errno::EAGAIN) => Ok(()),
            Err(e) => Err(io::Error::from(e)),
        }
    }

    /// Reads (and so resets) the counter: how many signals arrived since the last drain; 0
    /// when none did.
    pub fn drain(&self) -> io::Result<u64> {
        let mut count = [0u8; 8];
        match nix::unistd::read(&*self.fd, &mut count) {
            Ok(8) => Ok(u64::from_ne_bytes(count)),
            Ok(n) => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("an eventfd read returned {n} bytes, not 8: is the descriptor an eventfd?"),
            )),
            Err(nix::errno::Errno::EAGAIN) => Ok(0),
            Err(e) => Err(io::Error::from(e)),
        }
    }
}

impl AsFd for Notifier {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

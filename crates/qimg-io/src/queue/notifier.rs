//! [`Notifier`]: the eventfd a queue's completions signal.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
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

    /// Signals a duplicate of `fd`, a descriptor the caller keeps: any `AsRawFd` value, such
    /// as `vmm_sys_util::eventfd::EventFd` (which offers no `AsFd`). The duplicate is
    /// close-on-exec; the caller's descriptor stays as it is.
    pub fn duplicate(fd: &impl AsRawFd) -> io::Result<Self> {
        Ok(Self::from_fd(duplicate_raw(fd.as_raw_fd())?))
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

/// A close-on-exec duplicate of `fd`.
fn duplicate_raw(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: `fcntl(F_DUPFD_CLOEXEC)` reads no memory; on a descriptor that is not open it
    // fails with EBADF, handled below.
    let new = unsafe { nix::libc::fcntl(fd, nix::libc::F_DUPFD_CLOEXEC, 0) };
    if new < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `new` is a descriptor the call above just created for us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}

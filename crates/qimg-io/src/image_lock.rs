//! Image locks that QEMU honours, so that qimg and QEMU never write one image at once.
//!
//! QEMU's file driver (`file-posix`, `locking=auto`) expresses what a process does with an
//! image as *permissions* (consistent read, write, write-unchanged, resize) and takes one
//! shared open-file-description lock (`F_OFD_SETLK`, `F_RDLCK`) per byte:
//!
//! * byte `100 + bit` for every permission it uses;
//! * byte `200 + bit` for every permission it does *not* let others use.
//!
//! A newcomer conflicts when it wants a permission some holder does not share (a lock on
//! `200 + bit` exists) or does not share a permission some holder uses (a lock on `100 + bit`
//! exists). Locks are tested with `F_OFD_GETLK` for a write lock, which only other open file
//! descriptions can block. Locks are applied *before* the test, as QEMU does, so that of two
//! processes opening at the same moment at least one sees the other.
//!
//! The locks live as long as the file descriptor: closing the storage releases them.
//! [`ImageLock::lock`] takes them on a descriptor of the caller's ([`HeldImageLock`] says how
//! they compose with a whole-file lock of its own).

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, fcntl};
use nix::libc;

/// What a process does with an image, and what it lets other processes do meanwhile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ImageLock {
    /// Read, and refuse writers (`qemu-img info` without `-U`, a read-only disk, a backing
    /// file): a process writing the image makes this fail, and this makes writers fail.
    Read,
    /// Read and write, and refuse other writers (a VM's disk, `qemu-io` on an image).
    ReadWrite,
    /// Read and let everyone do anything (`qemu-img -U`, QEMU's `force-share=on`): nobody is
    /// refused, so what is read may be changing underneath.
    SharedRead,
    /// Read and write, and let everyone do anything: QEMU's raw format opened for writing by
    /// `qemu-io` (the raw driver passes its user's permissions through, and qemu-io shares
    /// them all), so that another raw writer or a `-U` reader is not refused.
    SharedReadWrite,
}

/// QEMU's permission bits (`BLK_PERM_*`), as bit numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Permission {
    ConsistentRead = 0,
    Write = 1,
    WriteUnchanged = 2,
    Resize = 3,
}

const PERMISSIONS: [Permission; 4] = [
    Permission::ConsistentRead,
    Permission::Write,
    Permission::WriteUnchanged,
    Permission::Resize,
];

/// First byte of the "uses permission" locks (QEMU's `RAW_LOCK_PERM_BASE`).
const USES_BASE: i64 = 100;
/// First byte of the "does not share permission" locks (QEMU's `RAW_LOCK_SHARED_BASE`).
const REFUSES_BASE: i64 = 200;

impl Permission {
    fn bit(self) -> u8 {
        1 << self as u8
    }

    /// QEMU's name for the permission, as in its "Failed to get ... lock" messages.
    fn name(self) -> &'static str {
        match self {
            Self::ConsistentRead => "consistent read",
            Self::Write => "write",
            Self::WriteUnchanged => "write unchanged",
            Self::Resize => "resize",
        }
    }
}

impl ImageLock {
    /// The permissions used, and the permissions shared with other processes, as QEMU's
    /// format drivers ask them of the image file.
    fn permissions(self) -> (u8, u8) {
        use Permission::*;
        let all = PERMISSIONS.iter().fold(0, |m, p| m | p.bit());
        match self {
            Self::Read => (ConsistentRead.bit(), all & !(Write.bit() | Resize.bit())),
            Self::ReadWrite => (
                ConsistentRead.bit() | Write.bit() | WriteUnchanged.bit() | Resize.bit(),
                all & !(Write.bit() | Resize.bit()),
            ),
            Self::SharedRead => (ConsistentRead.bit(), all),
            Self::SharedReadWrite => (ConsistentRead.bit() | Write.bit(), all),
        }
    }
}

/// A QEMU-compatible image lock held on a caller's descriptor ([`ImageLock::lock`]);
/// dropping it releases the lock (bytes 100-203 go back to a whole-file write lock the open
/// file description held before, if any).
///
/// # Beside a lock of the caller's own
///
/// [`ImageLock::lock`] takes the same locks on any descriptor (a VMM's, which it opened and
/// probed itself; qimg's `OpenOptions::open_file` does it on the descriptor it is given).
/// A VMM that also keeps a whole-file write lock of its own (cloud-hypervisor takes
/// `F_OFD_SETLK`/`F_WRLCK` over the whole file) may keep it **on the same open file
/// description** (the descriptor itself or a `dup` of it): taken first, the VMM's lock stays
/// everywhere but on bytes 100-203, which become QEMU's pattern, so that
///
/// * another VMM's whole-file lock and QEMU's writers (`qemu-io`, `qemu-img resize`...) are
///   refused as before, but QEMU's now say why in their own words (`Failed to get "write"
///   lock`, `Is another process using the image`) where the VMM's lock alone gives them
///   `Failed to lock byte 100`; `qemu-img info -U` reads as before (it takes no lock);
/// * releasing qimg's lock gives bytes 100-203 back to the VMM's write lock: its lock is whole
///   again, not holed.
///
/// On *another* open file description (a second `open` of the path) the two conflict: one
/// process, one open file description per image.
#[derive(Debug)]
pub struct HeldImageLock {
    kind: ImageLock,
    /// A duplicate of the caller's descriptor: the same open file description, which holds
    /// the locks.
    fd: OwnedFd,
    restore_write: bool,
}

impl HeldImageLock {
    /// What is held.
    pub fn kind(&self) -> ImageLock {
        self.kind
    }
}

impl Drop for HeldImageLock {
    fn drop(&mut self) {
        release(self.fd.as_fd(), self.restore_write);
    }
}

impl ImageLock {
    /// Takes this lock, as QEMU takes it, on the open file description of `fd` (any
    /// descriptor of the image file, for example one a VMM opened itself), replacing any
    /// image lock that description held. Held until the returned value is dropped. See
    /// [`HeldImageLock`] for a whole-file lock of the caller's on the same descriptor.
    pub fn lock(self, fd: &impl AsFd) -> crate::Result<HeldImageLock> {
        let fd = fd.as_fd();
        let dup = fd
            .try_clone_to_owned()
            .map_err(|e| crate::StorageError::io(crate::Op::Lock, 0, 0, e))?;
        let restore_write = apply(fd, self, false).map_err(LockFailure::into_storage)?;
        Ok(HeldImageLock {
            fd: dup,
            restore_write,
            kind: self,
        })
    }
}

/// Why an image lock could not be taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LockFailure {
    /// Another process holds the image in a way this access conflicts with.
    Conflict(String),
    /// The lock system call failed.
    Os(Errno),
}

fn flock(kind: libc::c_short, start: i64, len: i64) -> libc::flock {
    libc::flock {
        l_type: kind,
        l_whence: libc::SEEK_SET as libc::c_short,
        l_start: start,
        l_len: len,
        l_pid: 0,
    }
}

impl LockFailure {
    pub(crate) fn into_storage(self) -> crate::StorageError {
        match self {
            LockFailure::Conflict(holder) => crate::StorageError::Locked { holder },
            LockFailure::Os(e) => crate::StorageError::io(crate::Op::Lock, 0, 0, e),
        }
    }
}

/// The bytes of both lock ranges.
const SPAN: (i64, i64) = (USES_BASE, REFUSES_BASE + 4 - USES_BASE);

fn set(file: BorrowedFd<'_>, kind: libc::c_short, byte: i64) -> Result<(), Errno> {
    fcntl(file, FcntlArg::F_OFD_SETLK(&flock(kind, byte, 1))).map(drop)
}

/// Whether another open file description holds a lock on `byte`.
fn held_elsewhere(file: BorrowedFd<'_>, byte: i64) -> Result<bool, Errno> {
    let mut probe = flock(libc::F_WRLCK as libc::c_short, byte, 1);
    fcntl(file, FcntlArg::F_OFD_GETLK(&mut probe))?;
    Ok(probe.l_type != libc::F_UNLCK as libc::c_short)
}

/// Whether some open file description holds a write lock over all of both lock ranges,
/// seen from a new open file description of the same file (a description does not see its
/// own locks). `false` when that cannot be told.
fn write_locked_span(file: BorrowedFd<'_>) -> bool {
    use std::os::fd::AsRawFd;
    let Ok(other) = File::open(format!("/proc/self/fd/{}", file.as_raw_fd())) else {
        return false;
    };
    let mut probe = flock(libc::F_RDLCK as libc::c_short, SPAN.0, SPAN.1);
    fcntl(&other, FcntlArg::F_OFD_GETLK(&mut probe)).is_ok()
        && probe.l_type == libc::F_WRLCK as libc::c_short
        && probe.l_start <= SPAN.0
        && (probe.l_len == 0 || probe.l_start + probe.l_len >= SPAN.0 + SPAN.1)
}

/// Releases every image lock this descriptor holds; with `restore_write`, gives the bytes
/// back to the whole-file write lock the description held before ([`apply`]).
pub(crate) fn release(file: BorrowedFd<'_>, restore_write: bool) {
    if restore_write {
        let _ = fcntl(
            file,
            FcntlArg::F_OFD_SETLK(&flock(libc::F_WRLCK as libc::c_short, SPAN.0, SPAN.1)),
        );
    } else {
        release_all(file);
    }
}

fn release_all(file: BorrowedFd<'_>) {
    // Both lock ranges at once; bytes this descriptor never locked are left as they are.
    let _ = fcntl(
        file,
        FcntlArg::F_OFD_SETLK(&flock(libc::F_UNLCK as libc::c_short, SPAN.0, SPAN.1)),
    );
}

/// Takes the locks of `lock` on `file`, replacing any this descriptor held before. Returns
/// whether the description held a write lock over both ranges before (a VMM's whole-file
/// lock, or `restore_write` from an earlier call), which [`release`] gives back.
pub(crate) fn apply(
    file: BorrowedFd<'_>,
    lock: ImageLock,
    restore_write: bool,
) -> Result<bool, LockFailure> {
    let (uses, shares) = lock.permissions();
    // Seen before anything changes. A write lock of another description would make the
    // locks below fail, so if they succeed it was this description's.
    let restore_write = restore_write || write_locked_span(file);
    release_all(file);
    // Undoing a failed attempt gives the bytes back as they were.
    let release_all = |file| release(file, restore_write);
    let applied = (|| {
        for p in PERMISSIONS {
            if uses & p.bit() != 0 {
                set(file, libc::F_RDLCK as libc::c_short, USES_BASE + p as i64)?;
            }
            if shares & p.bit() == 0 {
                set(
                    file,
                    libc::F_RDLCK as libc::c_short,
                    REFUSES_BASE + p as i64,
                )?;
            }
        }
        Ok(())
    })();
    if let Err(e) = applied {
        release_all(file);
        return Err(LockFailure::Os(e));
    }
    match conflict(file, uses, shares) {
        Ok(None) => Ok(restore_write),
        Ok(Some(why)) => {
            release_all(file);
            Err(LockFailure::Conflict(why))
        }
        Err(e) => {
            release_all(file);
            Err(LockFailure::Os(e))
        }
    }
}

/// The first conflict with another holder, described by the holder's kind of access.
fn conflict(file: BorrowedFd<'_>, uses: u8, shares: u8) -> Result<Option<String>, Errno> {
    for p in PERMISSIONS {
        if uses & p.bit() != 0 && held_elsewhere(file, REFUSES_BASE + p as i64)? {
            let holder = if held_elsewhere(file, USES_BASE + Permission::Write as i64)? {
                "has it open for writing"
            } else {
                "has it open and does not let others write"
            };
            return Ok(Some(format!(
                "another process {holder} (QEMU's shared \"{}\" lock is taken)",
                p.name()
            )));
        }
        if shares & p.bit() == 0 && held_elsewhere(file, USES_BASE + p as i64)? {
            let holder = match p {
                Permission::Write => "has it open for writing".to_string(),
                other => format!(
                    "has it open with the \"{}\" permission, which this open does not share",
                    other.name()
                ),
            };
            return Ok(Some(format!(
                "another process {holder} (QEMU's \"{}\" lock is taken)",
                p.name()
            )));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_handles() -> (tempfile::TempDir, File, File) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        std::fs::write(&path, vec![0u8; 4096]).unwrap();
        let a = File::options().read(true).write(true).open(&path).unwrap();
        let b = File::options().read(true).write(true).open(&path).unwrap();
        (dir, a, b)
    }

    fn whole_file_write_lock(f: &File) -> Result<(), Errno> {
        fcntl(
            f,
            FcntlArg::F_OFD_SETLK(&flock(libc::F_WRLCK as libc::c_short, 0, 0)),
        )
        .map(drop)
    }

    #[test]
    fn a_whole_file_lock_on_the_same_description_composes_and_comes_back_whole() {
        let (_d, a, b) = two_handles();
        whole_file_write_lock(&a).unwrap();
        // qimg's lock on a duplicate of the VMM's descriptor: same description.
        let held = ImageLock::ReadWrite.lock(&a.try_clone().unwrap()).unwrap();
        assert!(held.restore_write, "the VMM's write lock was not seen");
        assert_eq!(held.kind(), ImageLock::ReadWrite);
        // Others: a writer and a whole-file lock are refused, `-U` readers are let in.
        assert!(matches!(
            apply(b.as_fd(), ImageLock::ReadWrite, false),
            Err(LockFailure::Conflict(_))
        ));
        assert!(whole_file_write_lock(&b).is_err());
        apply(b.as_fd(), ImageLock::SharedRead, false).unwrap();
        release(b.as_fd(), false);
        // Released: the VMM's lock is whole again, `-U` readers are refused as before.
        drop(held);
        assert!(apply(b.as_fd(), ImageLock::SharedRead, false).is_err());
        assert!(whole_file_write_lock(&b).is_err());
        drop(a);
        whole_file_write_lock(&b).unwrap();
    }

    #[test]
    fn without_a_lock_of_its_own_the_description_is_left_unlocked() {
        let (_d, a, b) = two_handles();
        let held = ImageLock::ReadWrite.lock(&a).unwrap();
        assert!(!held.restore_write);
        drop(held);
        whole_file_write_lock(&b).unwrap();
    }

    #[test]
    fn two_writers_refuse_each_other_and_a_closed_one_lets_go() {
        let (_d, a, b) = two_handles();
        apply(a.as_fd(), ImageLock::ReadWrite, false).unwrap();
        let Err(LockFailure::Conflict(why)) = apply(b.as_fd(), ImageLock::ReadWrite, false) else {
            panic!("second writer not refused");
        };
        assert!(why.contains("open for writing"), "{why}");
        drop(a);
        apply(b.as_fd(), ImageLock::ReadWrite, false).unwrap();
    }

    #[test]
    fn readers_share_with_readers_but_not_with_writers() {
        let (_d, a, b) = two_handles();
        apply(a.as_fd(), ImageLock::Read, false).unwrap();
        apply(b.as_fd(), ImageLock::Read, false).unwrap();
        let Err(LockFailure::Conflict(why)) = apply(b.as_fd(), ImageLock::ReadWrite, false) else {
            panic!("writer not refused by a reader");
        };
        assert!(why.contains("does not let others write"), "{why}");
    }

    #[test]
    fn a_shared_read_is_refused_by_nobody() {
        let (_d, a, b) = two_handles();
        apply(a.as_fd(), ImageLock::ReadWrite, false).unwrap();
        apply(b.as_fd(), ImageLock::SharedRead, false).unwrap();
        assert!(matches!(
            apply(b.as_fd(), ImageLock::Read, false),
            Err(LockFailure::Conflict(_))
        ));
    }

    #[test]
    fn a_failed_attempt_leaves_no_lock_behind() {
        let (dir, a, b) = two_handles();
        apply(a.as_fd(), ImageLock::ReadWrite, false).unwrap();
        assert!(apply(b.as_fd(), ImageLock::ReadWrite, false).is_err());
        drop(a);
        // b is still open but holds nothing: a third writer gets in.
        let c = File::options()
            .read(true)
            .write(true)
            .open(dir.path().join("img"))
            .unwrap();
        apply(c.as_fd(), ImageLock::ReadWrite, false).unwrap();
        drop(b);
    }
}

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

use std::fs::File;

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
        }
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

fn set(file: &File, kind: libc::c_short, byte: i64) -> Result<(), Errno> {
    fcntl(file, FcntlArg::F_OFD_SETLK(&flock(kind, byte, 1))).map(drop)
}

/// Whether another open file description holds a lock on `byte`.
fn held_elsewhere(file: &File, byte: i64) -> Result<bool, Errno> {
    let mut probe = flock(libc::F_WRLCK as libc::c_short, byte, 1);
    fcntl(file, FcntlArg::F_OFD_GETLK(&mut probe))?;
    Ok(probe.l_type != libc::F_UNLCK as libc::c_short)
}

/// Releases every image lock this descriptor holds.
pub(crate) fn release(file: &File) {
    release_all(file);
}

fn release_all(file: &File) {
    // Both lock ranges at once; bytes this descriptor never locked are left as they are.
    let _ = fcntl(
        file,
        FcntlArg::F_OFD_SETLK(&flock(libc::F_UNLCK as libc::c_short, USES_BASE, 104)),
    );
}

/// Takes the locks of `lock` on `file`, replacing any this descriptor held before.
pub(crate) fn apply(file: &File, lock: ImageLock) -> Result<(), LockFailure> {
    let (uses, shares) = lock.permissions();
    release_all(file);
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
        Ok(None) => Ok(()),
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
fn conflict(file: &File, uses: u8, shares: u8) -> Result<Option<String>, Errno> {
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

    #[test]
    fn two_writers_refuse_each_other_and_a_closed_one_lets_go() {
        let (_d, a, b) = two_handles();
        apply(&a, ImageLock::ReadWrite).unwrap();
        let Err(LockFailure::Conflict(why)) = apply(&b, ImageLock::ReadWrite) else {
            panic!("second writer not refused");
        };
        assert!(why.contains("open for writing"), "{why}");
        drop(a);
        apply(&b, ImageLock::ReadWrite).unwrap();
    }

    #[test]
    fn readers_share_with_readers_but_not_with_writers() {
        let (_d, a, b) = two_handles();
        apply(&a, ImageLock::Read).unwrap();
        apply(&b, ImageLock::Read).unwrap();
        let Err(LockFailure::Conflict(why)) = apply(&b, ImageLock::ReadWrite) else {
            panic!("writer not refused by a reader");
        };
        assert!(why.contains("does not let others write"), "{why}");
    }

    #[test]
    fn a_shared_read_is_refused_by_nobody() {
        let (_d, a, b) = two_handles();
        apply(&a, ImageLock::ReadWrite).unwrap();
        apply(&b, ImageLock::SharedRead).unwrap();
        assert!(matches!(
            apply(&b, ImageLock::Read),
            Err(LockFailure::Conflict(_))
        ));
    }

    #[test]
    fn a_failed_attempt_leaves_no_lock_behind() {
        let (dir, a, b) = two_handles();
        apply(&a, ImageLock::ReadWrite).unwrap();
        assert!(apply(&b, ImageLock::ReadWrite).is_err());
        drop(a);
        // b is still open but holds nothing: a third writer gets in.
        let c = File::options()
            .read(true)
            .write(true)
            .open(dir.path().join("img"))
            .unwrap();
        apply(&c, ImageLock::ReadWrite).unwrap();
        drop(b);
    }
}

//! Data extents and holes of a host file as the file system reports them (`SEEK_DATA`,
//! `SEEK_HOLE`), the way QEMU's file-posix block status finds them: the parts of a data
//! cluster never written (copy-on-write regions QEMU zeroed with fallocate, the tail of a
//! cluster written partly) read as zeros. The one walk both the NBD server's block status and
//! `qemu-img map` use.
//!
//! Only a hint: a file system that cannot tell answers "all data".

use std::fs::File;

use nix::errno::Errno;
use nix::fcntl::{PosixFadviseAdvice, posix_fadvise};
use nix::unistd::{Whence, lseek};

/// Cached pages are dropped in whole units of this size (a power of two above any page size).
const DROP_CACHE_ALIGN: u64 = 64 << 10;

/// One run of [`runs`]: `len` bytes from `start`, data or a hole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostRun {
    /// First byte, in the file.
    pub start: u64,
    /// Bytes.
    pub len: u64,
    /// Data (`false`: a hole, which reads as zeros).
    pub data: bool,
}

/// Splits `[start, end)` of `file` into data and hole runs, adjacent runs of one kind merged,
/// none empty. Everything past the end of the file is a hole; an error from the file system
/// makes the rest data.
///
/// `drop_cache`: first drop the clean cached pages of the range (rounded out to 64 KiB).
/// Unwritten extents (QEMU zeroes the copy-on-write parts of a cluster with
/// `FALLOC_FL_ZERO_RANGE`) are holes to `SEEK_DATA` only while none of their pages is cached,
/// and a process that reads the image's metadata may have pulled them in by readahead; a
/// reader that wants the answer a process that never read there gets (`qemu-img map`) asks
/// for the drop.
pub fn runs(file: &File, start: u64, end: u64, drop_cache: bool) -> Vec<HostRun> {
    if drop_cache {
        let mask = DROP_CACHE_ALIGN - 1;
        let (a, b) = (start & !mask, end.saturating_add(mask) & !mask);
        if let (Ok(o), Ok(l)) = (i64::try_from(a), i64::try_from(b - a)) {
            // Only a hint to the page cache: an error leaves the answer as it would be.
            let _ = posix_fadvise(file, o, l, PosixFadviseAdvice::POSIX_FADV_DONTNEED);
        }
    }
    let mut out: Vec<HostRun> = Vec::new();
    let mut push = |s: u64, e: u64, data: bool| {
        if e <= s {
            return;
        }
        match out.last_mut() {
            Some(last) if last.data == data && last.start + last.len == s => last.len += e - s,
            _ => out.push(HostRun {
                start: s,
                len: e - s,
                data,
            }),
        }
    };
    let mut pos = start;
    while pos < end {
        let Ok(at) = i64::try_from(pos) else {
            push(pos, end, true);
            break;
        };
        match lseek(file, at, Whence::SeekData) {
            // No data after `pos` (or `pos` at or past the end of the file): the rest is a
            // hole.
            Err(Errno::ENXIO) => {
                push(pos, end, false);
                break;
            }
            Err(_) => {
                push(pos, end, true);
                break;
            }
            Ok(d) if (d as u64) > pos => {
                let d = (d as u64).min(end);
                push(pos, d, false);
                pos = d;
            }
            Ok(_) => {
                // A file system that cannot tell: the rest is data.
                let h = match lseek(file, at, Whence::SeekHole) {
                    Ok(h) if (h as u64) > pos => (h as u64).min(end),
                    _ => end,
                };
                push(pos, h, true);
                pos = h;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom, Write};

    #[test]
    fn a_sparse_file_splits_into_data_and_holes_and_past_the_end_is_a_hole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let mut f = File::create(&path).unwrap();
        // Data at [1 MiB, 1 MiB + 64 KiB), a hole before, file ends at 2 MiB.
        f.seek(SeekFrom::Start(1 << 20)).unwrap();
        f.write_all(&[0xaa; 64 << 10]).unwrap();
        f.set_len(2 << 20).unwrap();
        f.sync_all().unwrap();
        let f = File::open(&path).unwrap();
        let got = runs(&f, 0, 3 << 20, true);
        // Every byte is covered once, in order.
        let mut at = 0;
        for r in &got {
            assert_eq!(r.start, at, "{got:?}");
            assert!(r.len > 0, "{got:?}");
            at += r.len;
        }
        assert_eq!(at, 3 << 20);
        // The written range is data; past the end of the file is a hole (on any file
        // system: SEEK_DATA can only be asked inside the file).
        let kind_at = |o: u64| {
            got.iter()
                .find(|r| r.start <= o && o < r.start + r.len)
                .unwrap()
        };
        assert!(kind_at((1 << 20) + 100).data, "{got:?}");
        assert!(!kind_at((2 << 20) + 100).data, "{got:?}");
    }
}

//! [`NullStorage`]: QEMU's `null-co` device, a disk of a given size that keeps nothing.
//!
//! Writes, write-zeroes, discards and flushes succeed and change nothing; reads return zeros
//! with `read-zeroes` on and leave the caller's buffer as it was without (QEMU's default,
//! which costs nothing: a benchmark's idea of an infinitely fast disk). It is named
//! `null-co://` (1 GiB, `read-zeroes` off) or, with options, `null-co://#size=N,read-zeroes=on`
//! (qimg's spelling of what QEMU takes as `json:{"driver":"null-co",...}`; QEMU refuses any
//! name but `null-co://`).

use std::io::IoSlice;

use crate::error::{Op, Result, StorageError};
use crate::storage::{AllocateOutcome, DiscardOutcome, Storage, ZeroOutcome};

/// The only name QEMU takes for the null device.
pub const NULL_CO: &str = "null-co://";

/// The size of a null device whose size is not given (QEMU's).
pub const DEFAULT_SIZE: u64 = 1 << 30;

/// What a null device is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NullOptions {
    /// Its size in bytes.
    pub size: u64,
    /// Reads return zeros (else the buffer is left alone).
    pub read_zeroes: bool,
}

impl Default for NullOptions {
    fn default() -> Self {
        NullOptions {
            size: DEFAULT_SIZE,
            read_zeroes: false,
        }
    }
}

impl NullOptions {
    /// The name [`parse_name`] reads back as these options.
    pub fn name(&self) -> String {
        if *self == NullOptions::default() {
            return NULL_CO.to_string();
        }
        let zeroes = if self.read_zeroes { "on" } else { "off" };
        format!("{NULL_CO}#size={},read-zeroes={zeroes}", self.size)
    }
}

/// The null device a name names (`null-co://`, or qimg's `null-co://#size=N,read-zeroes=on`);
/// `None` for any other name.
pub fn parse_name(name: &str) -> Option<NullOptions> {
    let rest = name.strip_prefix(NULL_CO)?;
    let mut opts = NullOptions::default();
    if rest.is_empty() {
        return Some(opts);
    }
    for pair in rest.strip_prefix('#')?.split(',') {
        match pair.split_once('=')? {
            ("size", v) => opts.size = v.parse().ok()?,
            ("read-zeroes", v) => opts.read_zeroes = v == "on",
            _ => return None,
        }
    }
    Some(opts)
}

/// A null device (see the module documentation).
#[derive(Debug, Clone)]
pub struct NullStorage {
    opts: NullOptions,
}

impl NullStorage {
    /// A null device with `opts`.
    pub fn new(opts: NullOptions) -> Self {
        NullStorage { opts }
    }

    /// What it is.
    pub fn options(&self) -> NullOptions {
        self.opts
    }
}

impl Storage for NullStorage {
    async fn read_at_most(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let n = (buf.len() as u64).min(self.opts.size.saturating_sub(offset)) as usize;
        if self.opts.read_zeroes {
            buf[..n].fill(0);
        }
        Ok(n)
    }

    async fn write_at(&self, _buf: &[u8], _offset: u64) -> Result<()> {
        Ok(())
    }

    async fn write_vectored_at(&self, _bufs: &[IoSlice<'_>], _offset: u64) -> Result<()> {
        Ok(())
    }

    async fn write_zeroes(&self, _offset: u64, _len: u64) -> Result<ZeroOutcome> {
        Ok(ZeroOutcome::Efficient)
    }

    async fn discard(&self, _offset: u64, _len: u64) -> Result<DiscardOutcome> {
        Ok(DiscardOutcome::Ignored)
    }

    async fn allocate(&self, _offset: u64, _len: u64) -> Result<AllocateOutcome> {
        Ok(AllocateOutcome::NotReserved)
    }

    async fn flush(&self) -> Result<()> {
        Ok(())
    }

    async fn len(&self) -> Result<u64> {
        Ok(self.opts.size)
    }

    async fn set_len(&self, len: u64) -> Result<()> {
        Err(StorageError::Io {
            op: Op::SetLen,
            offset: len,
            len: 0,
            source: std::io::Error::from_raw_os_error(libc_enotsup()),
        })
    }
}

/// `ENOTSUP`: a null device has a fixed size.
fn libc_enotsup() -> i32 {
    nix::errno::Errno::ENOTSUP as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_others_are_not_null_devices() {
        assert_eq!(parse_name("null-co://"), Some(NullOptions::default()));
        let o = NullOptions {
            size: 4096,
            read_zeroes: true,
        };
        assert_eq!(parse_name(&o.name()), Some(o));
        assert_eq!(NullOptions::default().name(), "null-co://");
        for other in ["null-co:", "null-co://x", "null-co://#bogus=1", "a.raw"] {
            assert_eq!(parse_name(other), None, "{other}");
        }
    }

    #[tokio::test]
    async fn reads_keep_the_buffer_or_zero_it_and_writes_keep_nothing() {
        let s = NullStorage::new(NullOptions::default());
        let mut buf = [0xabu8; 16];
        s.write_at(&[1; 16], 0).await.unwrap();
        assert_eq!(s.read_at_most(&mut buf, 0).await.unwrap(), 16);
        assert_eq!(buf, [0xab; 16]);
        let z = NullStorage::new(NullOptions {
            size: 8,
            read_zeroes: true,
        });
        assert_eq!(z.read_at_most(&mut buf, 0).await.unwrap(), 8);
        assert_eq!(&buf[..8], &[0; 8]);
        assert_eq!(&buf[8..], &[0xab; 8]);
        assert_eq!(z.len().await.unwrap(), 8);
        assert!(z.set_len(16).await.is_err());
    }
}

//! A heap buffer whose first byte sits on a chosen power-of-two address boundary, for O_DIRECT.

use std::fmt;
use std::ops::{Deref, DerefMut};

/// The alignment of the buffers this crate makes for O_DIRECT requests (bounce buffers), at
/// least: a page. A device may take buffers aligned to 512 bytes or less, but file systems
/// treat direct I/O whose memory is not aligned to their block size as unaligned: ext4 then
/// takes the inode lock exclusively and waits for every other direct request on the file
/// before a write that allocates blocks (one such write in flight at a time, where aligned
/// ones run in parallel: about 5x fewer 4 KiB writes per second into a sparse file at depth
/// 32 on io_uring).
pub(crate) const BUFFER_ALIGNMENT: usize = 4096;

/// A zero-initialised byte buffer whose start address is a multiple of a chosen alignment.
///
/// O_DIRECT requires buffers aligned to [`Storage::mem_alignment`](crate::Storage::mem_alignment).
/// This type gets there without `unsafe`: it over-allocates a `Vec<u8>` by `align - 1` bytes and
/// exposes the aligned window inside it. The vector is never resized, so its heap block (and
/// with it the alignment) stays put when the `AlignedBuf` is moved.
pub struct AlignedBuf {
    storage: Vec<u8>,
    start: usize,
    len: usize,
    align: usize,
}

impl AlignedBuf {
    /// A buffer of `len` zero bytes starting on a multiple of `align`.
    ///
    /// Returns `None` when `align` is not a power of two (0 included) or `len + align`
    /// overflows `usize`.
    pub fn zeroed(len: usize, align: usize) -> Option<Self> {
        if !align.is_power_of_two() {
            return None;
        }
        let total = len.checked_add(align - 1)?;
        let storage = vec![0u8; total];
        // Address arithmetic only: the pointer is never dereferenced through this integer.
        let addr = storage.as_ptr() as usize;
        let start = (align - addr % align) % align;
        Some(AlignedBuf {
            storage,
            start,
            len,
            align,
        })
    }

    /// An empty buffer (for requests that carry no data).
    pub(crate) fn empty() -> Self {
        AlignedBuf {
            storage: Vec::new(),
            start: 0,
            len: 0,
            align: 1,
        }
    }

    /// A buffer holding a copy of `data`, starting on a multiple of `align`.
    ///
    /// Returns `None` under the same conditions as [`AlignedBuf::zeroed`].
    pub fn copy_from(data: &[u8], align: usize) -> Option<Self> {
        let mut buf = Self::zeroed(data.len(), align)?;
        buf.copy_from_slice(data);
        Some(buf)
    }

    /// The alignment the buffer was created with.
    pub fn align(&self) -> usize {
        self.align
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("align", &self.align)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_start_on_the_requested_boundary() {
        for align in [1, 2, 512, 4096, 65536] {
            for len in [0, 1, 4095, 4096, 10000] {
                let b = AlignedBuf::zeroed(len, align).unwrap();
                assert_eq!(b.len(), len);
                assert_eq!(b.as_ptr() as usize % align, 0);
                assert!(b.iter().all(|&x| x == 0));
            }
        }
    }

    #[test]
    fn bad_alignments_and_overflowing_lengths_are_refused() {
        assert!(AlignedBuf::zeroed(10, 0).is_none());
        assert!(AlignedBuf::zeroed(10, 3).is_none());
        assert!(AlignedBuf::zeroed(usize::MAX, 2).is_none());
    }

    #[test]
    fn copies_keep_contents() {
        let b = AlignedBuf::copy_from(b"hello", 512).unwrap();
        assert_eq!(&*b, b"hello");
        assert_eq!(b.align(), 512);
    }
}

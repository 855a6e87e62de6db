//! [`IoBuffers`]: memory lent to a queued request, from the caller's raw iovecs (guest memory)
//! or owned buffers.

use std::any::Any;
use std::io::{IoSlice, IoSliceMut};
use std::sync::Arc;

use nix::libc;

use crate::AlignedBuf;

/// One segment: `len` bytes at `base`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Segment {
    pub(super) base: *mut u8,
    pub(super) len: usize,
}

/// The segments and whatever keeps them alive.
pub(super) struct Memory {
    pub(super) segments: Vec<Segment>,
    pub(super) len: usize,
    /// Owned buffers the segments point into (`None` for the caller's raw memory), or what
    /// keeps guest memory mapped.
    owner: Option<Box<dyn Any + Send>>,
    /// Memory another party (a guest) may access at any time: no Rust reference is ever made
    /// to it; bytes move by copies through raw pointers only.
    volatile: bool,
}

// SAFETY: `Memory` is `!Send`/`!Sync` only because of the raw segment pointers. They point into
// either `owner` (a heap block that moves with the value and is never reallocated while a
// segment points into it) or memory the caller of `IoBuffers::from_raw` promised is valid and
// not otherwise accessed until the request completes. Shared access happens only between an
// `IoBuffers` and the ring operations that hold a clone of its `Arc`: the kernel transfers into
// the segments while the operation is in flight, and `IoBuffers` creates Rust references to the
// memory only when no ring operation holds it (`Arc::get_mut`-style uniqueness checks below).
unsafe impl Send for Memory {}
// SAFETY: see `Send` above; `&Memory` gives no access to the bytes, only to the pointers.
unsafe impl Sync for Memory {}

/// Memory lent to a queued request: the segments of a vectored read or write.
///
/// A VMM hands its guest memory over with [`from_raw`](Self::from_raw) (an `unsafe` promise
/// that the iovecs stay valid until the request's completion is collected); safe code lends
/// owned buffers with [`from_vec`](Self::from_vec) or [`from_aligned`](Self::from_aligned) and
/// gets them back with [`into_owner`](Self::into_owner) once the request completed.
///
/// A request whose segments are aligned for `O_DIRECT` goes to the kernel as it is (no copy);
/// see `qimg::Queue`.
pub struct IoBuffers {
    pub(super) memory: Arc<Memory>,
}

impl std::fmt::Debug for IoBuffers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoBuffers")
            .field("segments", &self.memory.segments.len())
            .field("len", &self.memory.len)
            .field("owned", &self.memory.owner.is_some())
            .finish()
    }
}

impl IoBuffers {
    /// Lends the memory the iovecs describe (for example guest memory a VMM translated).
    ///
    /// # Safety
    ///
    /// For every iovec, `iov_base` must point to `iov_len` bytes that stay allocated, valid for
    /// reads and writes, and are not read or written by anything else (other than through this
    /// value) from this call until the request that takes these buffers has completed: its
    /// completion returned by `next_completed`, or the request refused at submission, or the
    /// queue dropped (dropping waits for every request). Segments must not overlap.
    pub unsafe fn from_raw(iovecs: &[libc::iovec]) -> Self {
        let segments: Vec<Segment> = iovecs
            .iter()
            .map(|v| Segment {
                base: v.iov_base.cast::<u8>(),
                len: v.iov_len,
            })
            .collect();
        Self::new(segments, None)
    }

    /// Lends the memory the iovecs describe together with `owner`, any value that stands for
    /// the request: a VMM's own operation object holding its guest memory mapping and the
    /// iovecs, say. The owner comes back with the buffers in the request's completion
    /// ([`take_owner`](Self::take_owner)), so a VMM keeps no table of requests beside the
    /// queue. The memory is treated as guest memory ([`is_guest_memory`](Self::is_guest_memory)):
    /// never referenced as Rust slices, bytes move by copies or by the kernel.
    ///
    /// Drop contract: the owner is dropped or handed back only after the kernel is done with
    /// the memory. A completion carries it once no ring operation holds the memory; a queue
    /// dropped with requests in flight waits for every one of them first, then drops their
    /// owners.
    ///
    /// # Safety
    ///
    /// For every iovec, `iov_base` must point to `iov_len` bytes that stay allocated and valid
    /// for reads and writes until the owner is given back or dropped (keeping them alive is
    /// what `owner` is for). A guest may touch them meanwhile; then what is read or written
    /// there is unspecified, as with a disk. Segments must not overlap.
    pub unsafe fn from_raw_owned<T: Send + 'static>(iovecs: &[libc::iovec], owner: T) -> Self {
        let segments: Vec<Segment> = iovecs
            .iter()
            .map(|v| Segment {
                base: v.iov_base.cast::<u8>(),
                len: v.iov_len,
            })
            .collect();
        let mut b = Self::new(segments, Some(Box::new(owner)));
        if let Some(m) = Arc::get_mut(&mut b.memory) {
            m.volatile = true;
        }
        b
    }

    /// Lends an owned buffer (one segment); [`into_owner`](Self::into_owner) gives it back.
    pub fn from_vec(mut buf: Vec<u8>) -> Self {
        let segments = vec![Segment {
            base: buf.as_mut_ptr(),
            len: buf.len(),
        }];
        Self::new(segments, Some(Box::new(buf)))
    }

    /// Lends several owned buffers as consecutive segments.
    pub fn from_vecs(mut bufs: Vec<Vec<u8>>) -> Self {
        let segments = bufs
            .iter_mut()
            .map(|b| Segment {
                base: b.as_mut_ptr(),
                len: b.len(),
            })
            .collect();
        Self::new(segments, Some(Box::new(bufs)))
    }

    /// Lends an aligned buffer (one segment), as `O_DIRECT` needs it.
    pub fn from_aligned(mut buf: AlignedBuf) -> Self {
        let segments = vec![Segment {
            base: buf.as_mut_ptr(),
            len: buf.len(),
        }];
        Self::new(segments, Some(Box::new(buf)))
    }

    /// Lends several aligned buffers as consecutive segments.
    pub fn from_aligned_vec(mut bufs: Vec<AlignedBuf>) -> Self {
        let segments = bufs
            .iter_mut()
            .map(|b| Segment {
                base: b.as_mut_ptr(),
                len: b.len(),
            })
            .collect();
        Self::new(segments, Some(Box::new(bufs)))
    }

    /// Lends guest memory: `ranges` of `(guest physical address, length)` in `mem`, which
    /// the buffers keep (and so keep mapped) until they are dropped. A range that crosses
    /// memory regions becomes several segments. The guest may touch the memory at any time,
    /// so the buffers never make Rust references to it: [`slices`](Self::slices) and
    /// [`slices_mut`](Self::slices_mut) return `None`, and bytes move with
    /// [`copy_out`](Self::copy_out), [`copy_in`](Self::copy_in) and
    /// [`fill_zero`](Self::fill_zero), or by the kernel.
    #[cfg(feature = "vm-memory")]
    pub fn from_guest<M>(mem: Arc<M>, ranges: &[(u64, usize)]) -> std::io::Result<Self>
    where
        M: vm_memory::GuestMemoryBackend + Send + Sync + 'static,
    {
        use vm_memory::GuestAddress;
        let mut segments = Vec::with_capacity(ranges.len());
        for &(addr, len) in ranges {
            for slice in mem.get_slices(GuestAddress(addr), len) {
                let slice = slice.map_err(|e| {
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        format!("guest memory {addr:#x}+{len:#x}: {e}"),
                    )
                })?;
                segments.push(Segment {
                    base: slice.ptr_guard_mut().as_ptr(),
                    len: slice.len(),
                });
            }
        }
        let mut b = Self::new(segments, Some(Box::new(mem)));
        if let Some(m) = Arc::get_mut(&mut b.memory) {
            m.volatile = true;
        }
        Ok(b)
    }

    fn new(segments: Vec<Segment>, owner: Option<Box<dyn Any + Send>>) -> Self {
        let len = segments.iter().map(|s| s.len).sum();
        IoBuffers {
            memory: Arc::new(Memory {
                segments,
                len,
                owner,
                volatile: false,
            }),
        }
    }

    /// Whether this is guest memory (`from_guest`, feature `vm-memory`): reachable only by
    /// copies, never as Rust slices.
    pub fn is_guest_memory(&self) -> bool {
        self.memory.volatile
    }

    /// Total bytes.
    pub fn len(&self) -> usize {
        self.memory.len
    }

    /// Whether there are no bytes at all.
    pub fn is_empty(&self) -> bool {
        self.memory.len == 0
    }

    /// Number of segments.
    pub fn segments(&self) -> usize {
        self.memory.segments.len()
    }

    /// Whether every segment starts on a multiple of `mem_align` and has a length that is a
    /// multiple of `len_align` (what `O_DIRECT` needs to take the memory as it is).
    pub fn is_aligned(&self, mem_align: usize, len_align: usize) -> bool {
        let mem_align = mem_align.max(1);
        let len_align = len_align.max(1);
        if mem_align == 1 && len_align == 1 {
            // Buffered I/O: everything is aligned (and this is on every request's path).
            return true;
        }
        self.memory
            .segments
            .iter()
            .all(|s| multiple_of(s.base as usize, mem_align) && multiple_of(s.len, len_align))
    }

    /// Whether no ring operation holds the memory now (then the methods that touch the bytes
    /// work).
    pub fn is_idle(&self) -> bool {
        Arc::strong_count(&self.memory) == 1
    }

    /// The segments as slices for reading, or `None` while a ring operation holds them (or
    /// for guest memory).
    pub fn slices(&self) -> Option<Vec<IoSlice<'_>>> {
        if !self.is_idle() || self.memory.volatile {
            return None;
        }
        Some(
            self.memory
                .segments
                .iter()
                .map(|s| {
                    // SAFETY: the segment is valid for `len` bytes (from_raw's contract, or it
                    // points into `owner`). No ring operation holds the memory (checked above),
                    // and while the returned slices borrow `self` shared, the only operation
                    // that can start is a ring write (the kernel reads the memory), because a
                    // ring read (the kernel writes) needs `&mut IoBuffers`: nothing writes the
                    // bytes while the slices exist.
                    let bytes = unsafe { std::slice::from_raw_parts(s.base.cast_const(), s.len) };
                    IoSlice::new(bytes)
                })
                .collect(),
        )
    }

    /// The segments as slices for filling, or `None` while a ring operation holds them (or
    /// for guest memory).
    pub fn slices_mut(&mut self) -> Option<Vec<IoSliceMut<'_>>> {
        if !self.is_idle() || self.memory.volatile {
            return None;
        }
        Some(
            self.memory
                .segments
                .iter()
                .map(|s| {
                    // SAFETY: valid for `len` bytes and unaliased (from_raw's contract, or it
                    // points into `owner`); no ring operation holds the memory (checked above)
                    // and none can start while `&mut self` is borrowed; segments do not overlap.
                    let bytes = unsafe { std::slice::from_raw_parts_mut(s.base, s.len) };
                    IoSliceMut::new(bytes)
                })
                .collect(),
        )
    }

    /// Copies `out.len()` bytes starting `pos` bytes into the buffers to `out`; `false` while
    /// a ring operation holds the memory or the range is out of bounds.
    pub fn copy_out(&self, pos: usize, out: &mut [u8]) -> bool {
        if !self.is_idle() {
            return false;
        }
        self.each_piece(pos, out.len(), |src, done, n| {
            // SAFETY: `src` points to `n` valid bytes of one segment (from_raw's contract, an
            // owned buffer, or mapped guest memory kept by `owner`); no ring operation holds
            // the memory (checked above) and `&self` keeps a ring read (the kernel writing)
            // from starting. `out[done..done + n]` is ours; the two do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(src.cast_const(), out[done..].as_mut_ptr(), n) }
        })
    }

    /// Copies `data` into the buffers starting `pos` bytes in; `false` while a ring operation
    /// holds the memory or the range is out of bounds.
    pub fn copy_in(&mut self, pos: usize, data: &[u8]) -> bool {
        if !self.is_idle() {
            return false;
        }
        self.each_piece(pos, data.len(), |dst, done, n| {
            // SAFETY: `dst` points to `n` valid, writable bytes of one segment (as in
            // `copy_out`); no ring operation holds the memory and none can start while
            // `&mut self` is borrowed; `data` is a separate Rust slice.
            unsafe { std::ptr::copy_nonoverlapping(data[done..].as_ptr(), dst, n) }
        })
    }

    /// Fills `len` bytes starting `pos` bytes into the buffers with zeros; `false` while a ring
    /// operation holds the memory or the range is out of bounds.
    pub fn fill_zero(&mut self, pos: usize, len: usize) -> bool {
        if !self.is_idle() {
            return false;
        }
        self.each_piece(pos, len, |dst, _, n| {
            // SAFETY: as in `copy_in`: `n` valid, writable bytes no one else writes now.
            unsafe { std::ptr::write_bytes(dst, 0, n) }
        })
    }

    /// Calls `f(address, bytes done before, length)` for the pieces of `[pos, pos + len)` in
    /// segment order; `false` (calling nothing) when the range is out of bounds.
    fn each_piece(&self, pos: usize, len: usize, mut f: impl FnMut(*mut u8, usize, usize)) -> bool {
        let Some(end) = pos.checked_add(len) else {
            return false;
        };
        if end > self.len() {
            return false;
        }
        let mut at = 0usize;
        let mut done = 0usize;
        for s in &self.memory.segments {
            let (a, b) = (at, at + s.len);
            let lo = pos.max(a);
            let hi = end.min(b);
            if lo < hi {
                f(s.base.wrapping_add(lo - a), done, hi - lo);
                done += hi - lo;
            }
            at = b;
        }
        true
    }

    /// The address of bytes `[pos, pos + len)` when they lie in one segment (`None` when they
    /// span several, are empty or out of bounds).
    pub(super) fn contiguous(&self, pos: usize, len: usize) -> Option<*mut u8> {
        let end = pos.checked_add(len)?;
        if len == 0 || end > self.len() {
            return None;
        }
        let mut at = 0usize;
        for s in &self.memory.segments {
            if pos < at + s.len {
                // Address arithmetic inside one segment, as in `iovecs`.
                return (end <= at + s.len).then(|| s.base.wrapping_add(pos - at));
            }
            at += s.len;
        }
        None
    }

    /// The iovecs for bytes `[pos, pos + len)` of the buffers (`None` when out of bounds).
    pub(super) fn iovecs(&self, pos: usize, len: usize) -> Option<Vec<libc::iovec>> {
        let end = pos.checked_add(len)?;
        if end > self.len() {
            return None;
        }
        let mut out = Vec::new();
        let mut at = 0usize;
        for s in &self.memory.segments {
            let (a, b) = (at, at + s.len);
            let lo = pos.max(a);
            let hi = end.min(b);
            if lo < hi {
                out.push(libc::iovec {
                    // Address arithmetic inside one segment; `wrapping_add` keeps it free of
                    // `unsafe` (the pointer is only handed to the kernel).
                    iov_base: s.base.wrapping_add(lo - a).cast::<libc::c_void>(),
                    iov_len: hi - lo,
                });
            }
            at = b;
        }
        Some(out)
    }

    /// The owned buffer this value was made from (`Vec<u8>`, `Vec<Vec<u8>>`, [`AlignedBuf`] or
    /// `Vec<AlignedBuf>`, or [`from_raw_owned`](Self::from_raw_owned)'s owner), once no ring
    /// operation holds it; `None` for raw memory. Downcast with `Box::downcast`, or use
    /// [`take_owner`](Self::take_owner).
    pub fn into_owner(self) -> Result<Option<Box<dyn Any + Send>>, Self> {
        match Arc::try_unwrap(self.memory) {
            Ok(m) => Ok(m.owner),
            Err(memory) => Err(IoBuffers { memory }),
        }
    }

    /// The owner as a `T` ([`from_raw_owned`](Self::from_raw_owned)'s, or the owned buffer of
    /// the other constructors), once no ring operation holds the memory. `Err(self)` while one
    /// does, when there is no owner (`from_raw`) or when it is not a `T`.
    pub fn take_owner<T: Send + 'static>(self) -> Result<T, Self> {
        let mut m = match Arc::try_unwrap(self.memory) {
            Ok(m) => m,
            Err(memory) => return Err(IoBuffers { memory }),
        };
        match m.owner.take().map(|o| o.downcast::<T>()) {
            Some(Ok(t)) => Ok(*t),
            Some(Err(o)) => {
                m.owner = Some(o);
                Err(IoBuffers {
                    memory: Arc::new(m),
                })
            }
            None => Err(IoBuffers {
                memory: Arc::new(m),
            }),
        }
    }

    /// The owner as a `T`, if it is one (whether or not a ring operation holds the memory).
    pub fn owner<T: 'static>(&self) -> Option<&T> {
        self.memory.owner.as_deref()?.downcast_ref::<T>()
    }

    /// A handle a ring operation keeps while the kernel uses the memory.
    pub(super) fn share(&self) -> Arc<Memory> {
        self.memory.clone()
    }
}

/// Whether `value` is a multiple of `align` (a mask for the usual powers of two: no division).
fn multiple_of(value: usize, align: usize) -> bool {
    if align.is_power_of_two() {
        value & (align - 1) == 0
    } else {
        value % align == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_ranges_stay_inside_one_segment() {
        let b = IoBuffers::from_vecs(vec![vec![0u8; 4], vec![0u8; 4], vec![0u8; 4]]);
        let base = |i: usize| b.memory.segments[i].base as usize;
        let at = |pos, len| b.contiguous(pos, len).map(|p| p as usize);
        assert_eq!(at(1, 2), Some(base(0) + 1));
        assert_eq!(at(0, 4), Some(base(0)));
        assert_eq!(at(4, 4), Some(base(1)));
        assert_eq!(at(9, 3), Some(base(2) + 1));
        // Across a segment boundary, empty, or out of bounds: none.
        assert_eq!(at(2, 4), None);
        assert_eq!(at(0, 12), None);
        assert_eq!(at(5, 0), None);
        assert_eq!(at(10, 4), None);
        assert_eq!(at(usize::MAX, 2), None);
    }

    #[test]
    fn a_raw_owner_comes_back_typed_and_only_when_no_operation_holds_it() {
        struct Op {
            id: u32,
            _memory: Vec<u8>,
        }
        let mut memory = vec![7u8; 8];
        let iov = [libc::iovec {
            iov_base: memory.as_mut_ptr().cast(),
            iov_len: memory.len(),
        }];
        // SAFETY: the iovec points into `memory`, which the owner keeps alive (moving a Vec
        // does not move its heap block).
        let b = unsafe {
            IoBuffers::from_raw_owned(
                &iov,
                Op {
                    id: 3,
                    _memory: memory,
                },
            )
        };
        assert!(
            b.is_guest_memory(),
            "raw owned memory is only copied, never sliced"
        );
        assert!(b.slices().is_none());
        assert_eq!(b.owner::<Op>().map(|o| o.id), Some(3));
        let mut out = [0u8; 8];
        assert!(b.copy_out(0, &mut out));
        assert_eq!(out, [7u8; 8]);
        // The wrong type leaves the owner in place; a held memory is refused.
        let Err(b) = b.take_owner::<String>() else {
            panic!("not a String")
        };
        let held = b.share();
        let Err(b) = b.take_owner::<Op>() else {
            panic!("held by an operation")
        };
        drop(held);
        assert_eq!(b.take_owner::<Op>().ok().map(|o| o.id), Some(3));
        // No owner at all: refused, not a panic.
        // SAFETY: an empty iovec list describes no memory.
        let raw = unsafe { IoBuffers::from_raw(&[]) };
        assert!(raw.take_owner::<Op>().is_err());
    }

    #[test]
    fn owned_buffers_come_back_and_iovecs_cut_across_segments() {
        let b = IoBuffers::from_vecs(vec![vec![1u8; 4], vec![2u8; 4], vec![3u8; 4]]);
        assert_eq!(b.len(), 12);
        let v = b.iovecs(2, 8).unwrap();
        assert_eq!(v.iter().map(|v| v.iov_len).collect::<Vec<_>>(), [2, 4, 2]);
        assert!(b.iovecs(10, 3).is_none());
        let mut out = [0u8; 6];
        assert!(b.copy_out(3, &mut out));
        assert_eq!(out, [1, 2, 2, 2, 2, 3]);
        let mut b = b;
        assert!(b.fill_zero(3, 2));
        let owner = b.into_owner().unwrap().unwrap();
        let bufs = owner.downcast::<Vec<Vec<u8>>>().unwrap();
        assert_eq!(bufs[0], [1, 1, 1, 0]);
        assert_eq!(bufs[1], [0, 2, 2, 2]);
    }

    #[test]
    fn shared_memory_refuses_access() {
        let mut b = IoBuffers::from_vec(vec![0u8; 8]);
        let held = b.share();
        assert!(b.slices().is_none());
        assert!(!b.fill_zero(0, 1));
        drop(held);
        assert!(b.fill_zero(0, 1));
    }
}

//! [`BounceStorage`]: any request on a backend that requires aligned requests (O_DIRECT).

use std::collections::VecDeque;
use std::future::{Future, poll_fn};
use std::io::IoSlice;
use std::sync::{Mutex, MutexGuard};
use std::task::{Poll, Waker};

use crate::error::{Op, Result, StorageError, range_end};
use crate::storage::{check_aligned, total_len};
use crate::{AlignedBuf, AllocateOutcome, DiscardOutcome, Storage, ZeroOutcome};

/// Makes a backend that requires aligned requests (such as [`FileStorage`](crate::FileStorage)
/// or [`UringStorage`](crate::UringStorage) with O_DIRECT) accept any request, by bouncing
/// unaligned ones through aligned buffers.
///
/// * Requests whose offset, length and buffers are already aligned go straight to the inner
///   storage.
/// * Other reads read the covering aligned blocks into an [`AlignedBuf`] and copy out.
/// * Other writes (and the unaligned edges of [`write_zeroes`](Storage::write_zeroes)) read the
///   partial blocks at their edges, merge, and write the covering blocks back
///   (read-modify-write). When that writes past the end of the storage, the length is then set
///   back to what the request alone gives.
///
/// Read-modify-write rewrites bytes the caller did not ask to write, so writers are ordered
/// by a table of locked block ranges: every modifying request locks the aligned blocks it
/// covers (and a request that must restore the length locks everything from its first block
/// to the end), so two unaligned writes into the same block, or an aligned write overlapping
/// an unaligned one, never lose each other's bytes. Waiters are served in arrival order among
/// overlapping ranges. Reads take no lock.
///
/// [`request_alignment`](Storage::request_alignment) and
/// [`mem_alignment`](Storage::mem_alignment) report 1. Over a backend that needs no alignment
/// every request passes straight through (still taking the lock for writes).
#[derive(Debug)]
pub struct BounceStorage<S> {
    inner: S,
    /// The inner request alignment (at least 1).
    req: u64,
    /// The inner buffer alignment (a power of two, at least 1).
    mem: usize,
    locks: RangeLocks,
}

impl<S: Storage> BounceStorage<S> {
    /// Wraps `inner`, reading its alignment requirements once.
    pub fn new(inner: S) -> Self {
        let req = inner.request_alignment().max(1) as u64;
        let mem = inner.mem_alignment().max(1).next_power_of_two();
        BounceStorage {
            inner,
            req,
            mem,
            locks: RangeLocks::default(),
        }
    }

    /// The wrapped storage.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Unwraps the inner storage.
    pub fn into_inner(self) -> S {
        self.inner
    }

    fn down(&self, x: u64) -> u64 {
        x - x % self.req
    }

    fn up(&self, x: u64) -> u64 {
        self.down(x + self.req - 1)
    }

    /// Whether the inner storage takes this request as it is.
    fn aligned<'a>(
        &self,
        op: Op,
        offset: u64,
        len: u64,
        bufs: impl IntoIterator<Item = &'a [u8]>,
    ) -> bool {
        check_aligned(
            op,
            offset,
            len,
            bufs.into_iter().map(|b| (b.as_ptr() as usize, b.len())),
            self.req as usize,
            self.mem,
        )
        .is_ok()
    }

    fn bounce_buf(&self, op: Op, offset: u64, len: u64) -> Result<AlignedBuf> {
        usize::try_from(len)
            .ok()
            .and_then(|n| AlignedBuf::zeroed(n, self.mem.max(crate::aligned::BUFFER_ALIGNMENT)))
            .ok_or(StorageError::OutOfRange { op, offset, len })
    }

    /// Locks the blocks `[a, e)` for a read-modify-write and returns the guard with the
    /// current length. If the storage ends before `e`, the lock covers everything from `a` on
    /// instead, so that no other request changes the length until the caller restored it.
    async fn lock_rmw(&self, a: u64, e: u64) -> Result<(RangeGuard<'_>, u64)> {
        let guard = self.locks.lock(a, e).await;
        let len = self.inner.len().await?;
        if len >= e {
            return Ok((guard, len));
        }
        drop(guard);
        let guard = self.locks.lock(a, u64::MAX).await;
        let len = self.inner.len().await?;
        Ok((guard, len))
    }

    /// Reads the block at `start` into `block` (`request_alignment` bytes), zeros past the end.
    async fn read_block(&self, block: &mut [u8], start: u64, len: u64) -> Result<()> {
        let n = if start < len {
            self.inner.read_at_most(block, start).await?
        } else {
            0
        };
        block[n..].fill(0);
        Ok(())
    }

    /// After a read-modify-write that wrote up to `e` while the storage was `old_len` long,
    /// sets the length to what the request alone gives (`max(old_len, end)`).
    async fn restore_len(&self, old_len: u64, end: u64, e: u64) -> Result<()> {
        let want = old_len.max(end);
        if old_len < e && want < e {
            self.inner.set_len(want).await?;
        }
        Ok(())
    }

    /// The read-modify-write path of a write of `bufs` (`len` bytes in total) at `offset`.
    async fn write_bounced(&self, bufs: &[IoSlice<'_>], offset: u64, len: u64) -> Result<()> {
        let end = offset + len;
        let (a, e) = (self.down(offset), self.up(end));
        let mut buf = self.bounce_buf(Op::Write, a, e - a)?;
        let (_guard, old_len) = self.lock_rmw(a, e).await?;
        let blk = self.req as usize;
        if offset != a {
            self.read_block(&mut buf[..blk], a, old_len).await?;
        }
        if end != e && (e - self.req != a || offset == a) {
            let t = buf.len() - blk;
            self.read_block(&mut buf[t..], e - self.req, old_len)
                .await?;
        }
        let mut at = (offset - a) as usize;
        for b in bufs {
            buf[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        }
        self.inner.write_at(&buf, a).await?;
        self.restore_len(old_len, end, e).await
    }

    /// Zeros `[from, to)` inside the block at `start` by read-modify-write.
    async fn zero_in_block(&self, start: u64, from: u64, to: u64, len: u64) -> Result<()> {
        let mut block = self.bounce_buf(Op::WriteZeroes, start, self.req)?;
        self.read_block(&mut block, start, len).await?;
        block[(from - start) as usize..(to - start) as usize].fill(0);
        self.inner.write_at(&block, start).await
    }
}

impl<S: Storage> Storage for BounceStorage<S> {
    async fn read_at_most(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let len = buf.len() as u64;
        let end = range_end(Op::Read, offset, len)?;
        if len == 0 {
            return Ok(0);
        }
        if self.aligned(Op::Read, offset, len, [&*buf]) {
            return self.inner.read_at_most(buf, offset).await;
        }
        let (a, e) = (self.down(offset), self.up(end));
        let mut bounce = self.bounce_buf(Op::Read, a, e - a)?;
        let n = self.inner.read_at_most(&mut bounce, a).await?;
        let skip = (offset - a) as usize;
        let got = n.saturating_sub(skip).min(buf.len());
        buf[..got].copy_from_slice(&bounce[skip..skip + got]);
        Ok(got)
    }

    async fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.write_vectored_at(&[IoSlice::new(buf)], offset).await
    }

    async fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> Result<()> {
        let len = total_len(Op::Write, bufs, offset)?;
        let end = range_end(Op::Write, offset, len)?;
        if len == 0 {
            return Ok(());
        }
        if self.aligned(Op::Write, offset, len, bufs.iter().map(|b| &**b)) {
            let _guard = self.locks.lock(offset, end).await;
            return self.inner.write_vectored_at(bufs, offset).await;
        }
        self.write_bounced(bufs, offset, len).await
    }

    async fn write_zeroes(&self, offset: u64, len: u64) -> Result<ZeroOutcome> {
        let end = range_end(Op::WriteZeroes, offset, len)?;
        if len == 0 {
            return Ok(ZeroOutcome::Efficient);
        }
        if offset % self.req == 0 && len % self.req == 0 {
            let _guard = self.locks.lock(offset, end).await;
            return self.inner.write_zeroes(offset, len).await;
        }
        let (a, e) = (self.down(offset), self.up(end));
        let (_guard, old_len) = self.lock_rmw(a, e).await?;
        // The aligned middle, if any, then the partial blocks at either edge.
        let (m0, m1) = (self.up(offset), self.down(end));
        if m0 < m1 {
            self.inner.write_zeroes(m0, m1 - m0).await?;
        }
        if offset != a {
            self.zero_in_block(a, offset, end.min(a + self.req), old_len)
                .await?;
        }
        let t = e - self.req;
        if end != e && (t != a || offset == a) {
            self.zero_in_block(t, offset.max(t), end, old_len).await?;
        }
        self.restore_len(old_len, end, e).await?;
        Ok(ZeroOutcome::Written)
    }

    async fn discard(&self, offset: u64, len: u64) -> Result<DiscardOutcome> {
        let end = range_end(Op::Discard, offset, len)?;
        let _guard = self.locks.lock(self.down(offset), self.up(end)).await;
        self.inner.discard(offset, len).await
    }

    async fn allocate(&self, offset: u64, len: u64) -> Result<AllocateOutcome> {
        let end = range_end(Op::Allocate, offset, len)?;
        let _guard = self.locks.lock(self.down(offset), self.up(end)).await;
        self.inner.allocate(offset, len).await
    }

    fn flush(&self) -> impl Future<Output = Result<()>> + Send {
        self.inner.flush()
    }

    fn len(&self) -> impl Future<Output = Result<u64>> + Send {
        self.inner.len()
    }

    async fn set_len(&self, len: u64) -> Result<()> {
        let _guard = self.locks.lock(0, u64::MAX).await;
        self.inner.set_len(len).await
    }

    fn unlock_image(&self) {
        self.inner.unlock_image()
    }

    fn debug_event(&self, event: crate::DebugEvent) {
        self.inner.debug_event(event)
    }

    fn lock_image(&self, lock: crate::ImageLock) -> Result<()> {
        self.inner.lock_image(lock)
    }

    fn request_alignment(&self) -> usize {
        1
    }

    fn mem_alignment(&self) -> usize {
        1
    }

    /// The inner storage's descriptor and its (`O_DIRECT`) alignment: direct requests are
    /// not bounced.
    fn direct_access(&self) -> Option<crate::storage::DirectAccess<'_>> {
        self.inner().direct_access()
    }
}

/// Locks on byte ranges `[start, end)`, granted in arrival order among overlapping ranges.
#[derive(Debug, Default)]
struct RangeLocks {
    state: Mutex<LockState>,
}

#[derive(Debug, Default)]
struct LockState {
    next_id: u64,
    /// Granted ranges: (id, start, end).
    held: Vec<(u64, u64, u64)>,
    /// Waiting requests in arrival order: (id, start, end, waker).
    waiting: VecDeque<(u64, u64, u64, Option<Waker>)>,
}

fn overlaps(s1: u64, e1: u64, s2: u64, e2: u64) -> bool {
    s1 < e2 && s2 < e1
}

impl LockState {
    /// Whether `[s, e)` overlaps a held range or a waiting one that arrived before `id`.
    fn blocked(&self, id: u64, s: u64, e: u64) -> bool {
        self.held.iter().any(|&(_, hs, he)| overlaps(s, e, hs, he))
            || self
                .waiting
                .iter()
                .take_while(|w| w.0 != id)
                .any(|&(_, ws, we, _)| overlaps(s, e, ws, we))
    }

    fn wake_all(&mut self) {
        for w in self.waiting.iter_mut() {
            if let Some(waker) = w.3.take() {
                waker.wake();
            }
        }
    }
}

impl RangeLocks {
    fn state(&self) -> MutexGuard<'_, LockState> {
        // A panic while holding this mutex leaves consistent state (every change is one
        // push or removal), so poisoning is ignored.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until `[start, end)` overlaps no granted range (nor an earlier waiter), then
    /// grants it until the guard is dropped.
    async fn lock(&self, start: u64, end: u64) -> RangeGuard<'_> {
        let mut ticket = Waiting {
            locks: self,
            id: None,
        };
        poll_fn(|cx| {
            let mut st = self.state();
            let id = match ticket.id {
                Some(id) => id,
                None => {
                    let id = st.next_id;
                    st.next_id += 1;
                    st.waiting.push_back((id, start, end, None));
                    ticket.id = Some(id);
                    id
                }
            };
            if st.blocked(id, start, end) {
                if let Some(w) = st.waiting.iter_mut().find(|w| w.0 == id) {
                    w.3 = Some(cx.waker().clone());
                }
                return Poll::Pending;
            }
            st.waiting.retain(|w| w.0 != id);
            st.held.push((id, start, end));
            ticket.id = None;
            // Later waiters that only waited behind this one's place in line may now proceed.
            st.wake_all();
            Poll::Ready(RangeGuard { locks: self, id })
        })
        .await
    }
}

/// Removes a waiter whose future was dropped before the lock was granted.
struct Waiting<'a> {
    locks: &'a RangeLocks,
    id: Option<u64>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            let mut st = self.locks.state();
            st.waiting.retain(|w| w.0 != id);
            st.wake_all();
        }
    }
}

/// A granted range; released on drop.
#[derive(Debug)]
struct RangeGuard<'a> {
    locks: &'a RangeLocks,
    id: u64,
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        let mut st = self.locks.state();
        st.held.retain(|h| h.0 != self.id);
        st.wake_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemStorage;

    fn block_on<F: Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
            .block_on(f)
    }

    #[test]
    fn bounce_buffers_start_on_a_page_even_when_the_device_takes_less() {
        let s = BounceStorage::new(MemStorage::new().with_alignment(512, 512));
        for len in [512u64, 4096, 65536] {
            let b = s.bounce_buf(Op::Write, 0, len).unwrap();
            assert_eq!(b.as_ptr() as usize % crate::aligned::BUFFER_ALIGNMENT, 0);
        }
    }

    #[test]
    fn overlapping_locks_wait_and_disjoint_ones_do_not() {
        block_on(async {
            let locks = RangeLocks::default();
            let g = locks.lock(0, 4096).await;
            let _other = locks.lock(4096, 8192).await;
            let mut waiting = Box::pin(locks.lock(100, 200));
            let waker = Waker::noop();
            let mut cx = std::task::Context::from_waker(waker);
            assert!(waiting.as_mut().poll(&mut cx).is_pending());
            // A later disjoint request is not held up by the waiter.
            let _third = locks.lock(9000, 9001).await;
            drop(g);
            assert!(waiting.as_mut().poll(&mut cx).is_ready());
        });
    }

    #[test]
    fn unaligned_requests_on_aligned_memory_storage() {
        block_on(async {
            let s = BounceStorage::new(MemStorage::new().with_alignment(512, 512));
            assert_eq!(s.request_alignment(), 1);
            s.write_at(b"hello", 1000).await.unwrap();
            assert_eq!(s.len().await.unwrap(), 1005);
            let mut b = [0u8; 7];
            s.read_at_zero_fill(&mut b, 999).await.unwrap();
            assert_eq!(&b[..6], b"\0hello");
            assert_eq!(b[6], 0);
        });
    }
}

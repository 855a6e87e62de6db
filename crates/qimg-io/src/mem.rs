//! [`MemStorage`]: a sparse in-memory file for tests.

use std::collections::BTreeMap;
use std::io::IoSlice;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{Op, Result, StorageError, range_end};
use crate::storage::{
    AllocateOutcome, DiscardOutcome, Storage, ZeroOutcome, check_aligned, total_len,
};

/// Size of one allocation unit of [`MemStorage`].
const CHUNK: u64 = 64 * 1024;

/// An in-memory, growable, sparse file with the semantics of [`Storage`], for tests.
///
/// Data lives in 64 KiB chunks allocated on first write, so a multi-terabyte
/// [`set_len`](Storage::set_len) costs nothing and zeroing or discarding whole chunks frees
/// them ([`allocated_bytes`](MemStorage::allocated_bytes) shows it).
///
/// Clones share the same contents, so a test can hand one clone to the code under test and keep
/// another to inspect ([`snapshot`](MemStorage::snapshot)). A clone made read-only with
/// [`read_only`](MemStorage::read_only) refuses modifications but still sees the others' writes.
///
/// By default any alignment is accepted; [`with_alignment`](MemStorage::with_alignment) makes it
/// enforce O_DIRECT-style alignment, to test callers that must respect it without needing a
/// file system that supports O_DIRECT.
///
/// Every operation completes in its first poll; the contents are behind a mutex that is never
/// held across an `.await`.
#[derive(Debug, Clone)]
pub struct MemStorage {
    inner: Arc<Mutex<Inner>>,
    read_only: bool,
    request_alignment: usize,
    mem_alignment: usize,
}

#[derive(Debug, Default)]
struct Inner {
    len: u64,
    /// Chunk index -> chunk contents (`CHUNK` bytes). Invariant: bytes at or past `len` are
    /// zero, so growing the storage exposes zeros.
    chunks: BTreeMap<u64, Box<[u8]>>,
}

/// Splits `[offset, offset + len)` into pieces that each stay inside one chunk: yields
/// (chunk index, offset within chunk, piece length, offset of the piece within the range).
fn pieces(offset: u64, len: u64) -> impl Iterator<Item = (u64, usize, usize, usize)> {
    let mut done = 0u64;
    std::iter::from_fn(move || {
        if done >= len {
            return None;
        }
        let pos = offset + done;
        let within = pos % CHUNK;
        let n = (CHUNK - within).min(len - done);
        let item = (pos / CHUNK, within as usize, n as usize, done as usize);
        done += n;
        Some(item)
    })
}

impl Inner {
    fn read(&self, buf: &mut [u8], offset: u64) -> usize {
        let avail = self.len.saturating_sub(offset).min(buf.len() as u64);
        for (idx, within, n, at) in pieces(offset, avail) {
            let dst = &mut buf[at..at + n];
            match self.chunks.get(&idx) {
                Some(chunk) => dst.copy_from_slice(&chunk[within..within + n]),
                None => dst.fill(0),
            }
        }
        avail as usize
    }

    fn write(&mut self, data: &[u8], offset: u64) {
        if data.is_empty() {
            return;
        }
        for (idx, within, n, at) in pieces(offset, data.len() as u64) {
            let chunk = self
                .chunks
                .entry(idx)
                .or_insert_with(|| vec![0u8; CHUNK as usize].into_boxed_slice());
            chunk[within..within + n].copy_from_slice(&data[at..at + n]);
        }
        self.len = self.len.max(offset + data.len() as u64);
    }

    /// Zeroes the part of the range below `len`, dropping chunks it covers whole. Visits only
    /// chunks that exist, so zeroing a huge sparse range is cheap.
    fn zero(&mut self, offset: u64, len: u64) {
        let len = self.len.saturating_sub(offset).min(len);
        if len == 0 {
            return;
        }
        let end = offset + len;
        let mut dead = Vec::new();
        for (&idx, chunk) in self.chunks.range_mut(offset / CHUNK..=(end - 1) / CHUNK) {
            let start = idx * CHUNK;
            let lo = (offset.max(start) - start) as usize;
            let hi = (end.min(start + CHUNK) - start) as usize;
            if lo == 0 && hi as u64 == CHUNK {
                dead.push(idx);
            } else {
                chunk[lo..hi].fill(0);
            }
        }
        for idx in dead {
            self.chunks.remove(&idx);
        }
    }

    fn set_len(&mut self, len: u64) {
        if len < self.len {
            let old = self.len;
            self.zero(len, old - len);
            // Chunks wholly past the new end are zero by now; drop the partial one's too.
            let first_dead = len.div_ceil(CHUNK);
            self.chunks.split_off(&first_dead);
        }
        self.len = len;
    }
}

impl Default for MemStorage {
    fn default() -> Self {
        Self::new()
    }
}

impl MemStorage {
    /// An empty, writable storage that accepts any alignment.
    pub fn new() -> Self {
        MemStorage {
            inner: Arc::new(Mutex::new(Inner::default())),
            read_only: false,
            request_alignment: 1,
            mem_alignment: 1,
        }
    }

    /// A writable storage holding a copy of `data`.
    pub fn from_bytes(data: &[u8]) -> Self {
        let s = Self::new();
        s.lock().write(data, 0);
        s
    }

    /// This storage, requiring data requests aligned as with O_DIRECT: offsets and lengths to
    /// multiples of `request_alignment`, buffers to multiples of `mem_alignment` (0 is taken
    /// as 1). Other clones keep their own setting.
    pub fn with_alignment(mut self, request_alignment: usize, mem_alignment: usize) -> Self {
        self.request_alignment = request_alignment.max(1);
        self.mem_alignment = mem_alignment.max(1);
        self
    }

    /// This storage, refusing every modification with [`StorageError::ReadOnly`]. Other
    /// clones stay writable.
    pub fn read_only(mut self) -> Self {
        self.read_only = true;
        self
    }

    /// Whether this handle refuses modifications.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// A copy of every byte, from 0 to the current length. Allocates the whole length: use
    /// [`snapshot_range`](MemStorage::snapshot_range) for large sparse storages.
    pub fn snapshot(&self) -> Vec<u8> {
        let g = self.lock();
        let mut out = vec![0u8; usize::try_from(g.len).unwrap_or(usize::MAX)];
        g.read(&mut out, 0);
        out
    }

    /// A copy of `len` bytes at `offset`, with bytes past the end reading as zeros.
    pub fn snapshot_range(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        self.lock().read(&mut out, offset);
        out
    }

    /// An independent copy: the same contents and settings, but later modifications of either
    /// are not seen by the other (unlike [`Clone`], which shares the contents). Copies only
    /// the allocated chunks, so sparse storages stay cheap.
    pub fn deep_copy(&self) -> MemStorage {
        MemStorage {
            read_only: self.read_only,
            request_alignment: self.request_alignment,
            mem_alignment: self.mem_alignment,
            ..self.copy_contents()
        }
    }

    /// An independent copy of the contents, writable and accepting any alignment.
    pub(crate) fn copy_contents(&self) -> MemStorage {
        let g = self.lock();
        MemStorage {
            inner: Arc::new(Mutex::new(Inner {
                len: g.len,
                chunks: g.chunks.clone(),
            })),
            ..MemStorage::new()
        }
    }

    /// Writes `data` at `offset`, growing as needed, ignoring read-only and alignment settings.
    /// The caller guarantees `offset + data.len()` is at most [`MAX_OFFSET`](crate::MAX_OFFSET).
    pub(crate) fn apply_write(&self, data: &[u8], offset: u64) {
        self.lock().write(data, offset);
    }

    /// Zeroes the part of the range below the current length, without growing.
    pub(crate) fn apply_zero(&self, offset: u64, len: u64) {
        self.lock().zero(offset, len);
    }

    /// Grows the length to `end` if it is shorter.
    pub(crate) fn apply_grow(&self, end: u64) {
        let mut g = self.lock();
        g.len = g.len.max(end);
    }

    /// Truncates or extends to `len`.
    pub(crate) fn apply_set_len(&self, len: u64) {
        self.lock().set_len(len);
    }

    /// Bytes of memory currently holding data (a multiple of the 64 KiB chunk size).
    pub fn allocated_bytes(&self) -> u64 {
        self.lock().chunks.len() as u64 * CHUNK
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // No code path panics while holding the lock, so a poisoned lock still guards
        // consistent data.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn writable(&self, op: Op, offset: u64, len: u64) -> Result<()> {
        if self.read_only {
            return Err(StorageError::ReadOnly { op, offset, len });
        }
        Ok(())
    }

    fn aligned<'b>(
        &self,
        op: Op,
        offset: u64,
        len: u64,
        bufs: impl IntoIterator<Item = &'b [u8]>,
    ) -> Result<()> {
        check_aligned(
            op,
            offset,
            len,
            bufs.into_iter().map(|b| (b.as_ptr() as usize, b.len())),
            self.request_alignment,
            self.mem_alignment,
        )
    }
}

impl Storage for MemStorage {
    async fn read_at_most(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let len = buf.len() as u64;
        range_end(Op::Read, offset, len)?;
        self.aligned(Op::Read, offset, len, [&*buf])?;
        Ok(self.lock().read(buf, offset))
    }

    async fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        range_end(Op::Write, offset, len)?;
        self.writable(Op::Write, offset, len)?;
        self.aligned(Op::Write, offset, len, [buf])?;
        self.lock().write(buf, offset);
        Ok(())
    }

    async fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> Result<()> {
        let len = total_len(Op::Write, bufs, offset)?;
        range_end(Op::Write, offset, len)?;
        self.writable(Op::Write, offset, len)?;
        self.aligned(Op::Write, offset, len, bufs.iter().map(|b| &**b))?;
        let mut g = self.lock();
        let mut pos = offset;
        for b in bufs {
            g.write(b, pos);
            pos += b.len() as u64;
        }
        Ok(())
    }

    async fn write_zeroes(&self, offset: u64, len: u64) -> Result<ZeroOutcome> {
        let end = range_end(Op::WriteZeroes, offset, len)?;
        self.writable(Op::WriteZeroes, offset, len)?;
        self.aligned(Op::WriteZeroes, offset, len, [])?;
        if len == 0 {
            return Ok(ZeroOutcome::Efficient);
        }
        let mut g = self.lock();
        g.zero(offset, len);
        g.len = g.len.max(end);
        Ok(ZeroOutcome::Efficient)
    }

    async fn discard(&self, offset: u64, len: u64) -> Result<DiscardOutcome> {
        range_end(Op::Discard, offset, len)?;
        self.writable(Op::Discard, offset, len)?;
        self.lock().zero(offset, len);
        Ok(DiscardOutcome::Deallocated)
    }

    async fn allocate(&self, offset: u64, len: u64) -> Result<AllocateOutcome> {
        let end = range_end(Op::Allocate, offset, len)?;
        self.writable(Op::Allocate, offset, len)?;
        if len == 0 {
            return Ok(AllocateOutcome::NotReserved);
        }
        let mut g = self.lock();
        g.len = g.len.max(end);
        Ok(AllocateOutcome::Reserved)
    }

    async fn flush(&self) -> Result<()> {
        Ok(())
    }

    async fn len(&self) -> Result<u64> {
        Ok(self.lock().len)
    }

    async fn set_len(&self, len: u64) -> Result<()> {
        range_end(Op::SetLen, len, 0)?;
        self.writable(Op::SetLen, len, 0)?;
        self.lock().set_len(len);
        Ok(())
    }

    fn request_alignment(&self) -> usize {
        self.request_alignment
    }

    fn mem_alignment(&self) -> usize {
        self.mem_alignment
    }
}

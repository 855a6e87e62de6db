//! [`Shared`]: the state of an open image that the metadata code needs (files, geometry,
//! options, counters, the corrupt and halted flags), and the checks every request makes.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use qimg_format::geometry::{Geometry, RefcountGeometry};
use qimg_format::header::CompressionType;
use qimg_format::l2::L2Context;
use qimg_io::{AlignedBuf, AllocateOutcome, Storage, StorageError};

use super::options::Allocation;
use crate::error::{Error, Result};

/// Event counters behind [`Stats`](super::Stats).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) cow_bytes: AtomicU64,
    pub(crate) clusters_allocated: AtomicU64,
    pub(crate) clusters_freed: AtomicU64,
}

/// What every part of the engine reads: the image's files, geometry, options and flags.
/// The metadata code ([`super::meta`]) works on this alone; [`Inner`](super::image::Inner)
/// adds the backing image, the metadata lock and the range locks.
#[derive(Debug)]
pub(crate) struct Shared<S: Storage> {
    pub(crate) path: PathBuf,
    pub(crate) file: S,
    pub(crate) data_file: Option<(PathBuf, S)>,
    pub(crate) geo: Geometry,
    pub(crate) rgeo: RefcountGeometry,
    pub(crate) ctx: L2Context,
    pub(crate) writable: bool,
    pub(crate) compression: CompressionType,
    pub(crate) data_file_raw: bool,
    pub(crate) lazy: bool,
    pub(crate) allocation: Allocation,
    pub(crate) version: u32,
    pub(crate) size: AtomicU64,
    pub(crate) counters: Counters,
    pub(crate) epoch: tokio::time::Instant,
    pub(crate) clean_interval: Option<Duration>,
    /// Corruption was found (reported once): a writable image refuses further writes.
    pub(crate) marked_corrupt: AtomicBool,
    /// Where messages go as they happen (else the metadata's list, for `take_messages`).
    pub(crate) on_message: Option<crate::engine::options::MessageSink>,
    /// A header switch failed (see [`Error::Halted`]): further writes are refused until the
    /// image is reopened. Holds what failed.
    pub(crate) halted: std::sync::OnceLock<String>,
    /// Host clusters reserved by write leases that were dropped without commit or abort:
    /// freed by the next flush (or close) under the metadata lock. A drop cannot wait for the
    /// lock, and a task spawned for it could run after `close`.
    pub(crate) abandoned: std::sync::Mutex<Vec<u64>>,
    /// [`OpenOptions::close_on_drop`](super::OpenOptions::close_on_drop).
    pub(crate) close_on_drop: bool,
    /// Space reserved ahead of allocation at the end of the image file.
    pub(crate) reservation: Reservation,
    /// L2 slices being read without the metadata lock (reads' cache misses).
    pub(crate) slice_loads: SliceLoads,
    /// Persistent dirty bitmaps loaded by a read-write open.
    pub(crate) bitmaps: super::bitmap_set::Bitmaps,
    /// A LUKS-encrypted image's sector cipher (unlocked at the open): guest data is
    /// encrypted by host offset in the data file ([`read_guest_data`](Self::read_guest_data),
    /// [`write_guest_data`](Self::write_guest_data)).
    pub(crate) crypt: Option<std::sync::Arc<dyn crate::crypto::SectorCipher>>,
}

/// The L2 slices reads are loading without the metadata lock, so that misses on different
/// slices load in parallel ([`Inner::lookup_for_read`](super::image::Inner)). A second miss on a
/// slice being loaded waits for that load ([`done`](Self::done)). A load's slice is inserted
/// only if its token is still here when it finishes: a locked load of the same slice
/// supersedes it (removes the token), and so does dropping the loading request (its guard).
#[derive(Debug, Default)]
pub(crate) struct SliceLoads {
    /// `(slice, token)` of each load under way.
    pub(crate) tokens: std::sync::Mutex<Vec<(qimg_cache::SliceKey, u64)>>,
    pub(crate) next: AtomicU64,
    /// Signalled whenever a load ends or is superseded: waiters look again.
    pub(crate) done: tokio::sync::Notify,
    /// Most loads seen under way at once (for tests and statistics).
    pub(crate) peak: AtomicU64,
}

/// Token bit of the loads a `Queue` runs on its own ring. Their end depends on the queue's
/// caller collecting completions, so engine reads never wait for them: they load the slice
/// under the lock, which supersedes the queue's load.
pub(crate) const QUEUE_LOAD: u64 = 1 << 63;

impl SliceLoads {
    /// Whether `key` is being loaded (by anyone).
    pub(crate) fn loading(&self, key: qimg_cache::SliceKey) -> bool {
        let t = self.tokens.lock().unwrap_or_else(|e| e.into_inner());
        t.iter().any(|&(k, _)| k == key)
    }

    /// Whether an engine read (not a queue) is loading `key`: one worth waiting for.
    pub(crate) fn engine_loading(&self, key: qimg_cache::SliceKey) -> bool {
        let t = self.tokens.lock().unwrap_or_else(|e| e.into_inner());
        t.iter().any(|&(k, id)| k == key && id & QUEUE_LOAD == 0)
    }

    /// Registers a load of `key` by a queue ([`QUEUE_LOAD`]); its token.
    pub(crate) fn begin_for_queue(&self, key: qimg_cache::SliceKey) -> u64 {
        self.register(key, QUEUE_LOAD)
    }

    /// Registers a load of `key`; its token.
    pub(crate) fn begin(&self, key: qimg_cache::SliceKey) -> u64 {
        self.register(key, 0)
    }

    fn register(&self, key: qimg_cache::SliceKey, bits: u64) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed) | bits;
        let mut t = self.tokens.lock().unwrap_or_else(|e| e.into_inner());
        t.push((key, id));
        self.peak.fetch_max(t.len() as u64, Ordering::Relaxed);
        id
    }

    /// Ends the load of token `id`: whether it was still current (not superseded).
    pub(crate) fn end(&self, id: u64) -> bool {
        let mut t = self.tokens.lock().unwrap_or_else(|e| e.into_inner());
        let found = t.iter().position(|&(_, i)| i == id);
        if let Some(at) = found {
            t.swap_remove(at);
        }
        drop(t);
        self.done.notify_waiters();
        found.is_some()
    }

    /// Supersedes every load of `key` (the slice is being inserted by someone else).
    pub(crate) fn supersede(&self, key: qimg_cache::SliceKey) {
        let mut t = self.tokens.lock().unwrap_or_else(|e| e.into_inner());
        let before = t.len();
        t.retain(|&(k, _)| k != key);
        let changed = t.len() != before;
        drop(t);
        if changed {
            self.done.notify_waiters();
        }
    }
}

/// How much to reserve past the end of the image file at once (rounded up to whole clusters,
/// at least [`RESERVE_CLUSTERS`]): one `fallocate` for many cluster allocations, like QEMU's
/// `preallocate` filter, so that allocating writes land in space the file system has already
/// reserved instead of extending the file one cluster at a time.
pub(crate) const RESERVE_AHEAD: u64 = 32 << 20;

/// The fewest clusters reserved at once: with large clusters (16 of 2 MiB in 32 MiB) a queue
/// depth of new clusters would outrun a step, and the queues' direct path, which takes only
/// reserved space, would hand the rest of a batch to the engine. The next step starts as soon
/// as less than a whole step is left (see [`Shared::claim_extension`]), so at least 64
/// clusters stay reserved ahead of the allocations in flight while it is made.
pub(crate) const RESERVE_CLUSTERS: u64 = 64;

/// [`Allocation::Contiguous`] past the end of the file: clusters allocated there are reserved
/// in steps of [`RESERVE_AHEAD`] bytes (at least [`RESERVE_CLUSTERS`] clusters); the unused tail is cut off at close. Below `from` (the
/// end of the file at open, in whole clusters) each new cluster is reserved on its own, as
/// before: it may be a hole a discard punched.
#[derive(Debug)]
pub(crate) struct Reservation {
    pub(crate) from: u64,
    /// End of what `fallocate` reserved past `from` (`from` while nothing is).
    pub(crate) end: AtomicU64,
    /// The file cannot reserve (no `fallocate`, or a backend without it): clusters stay
    /// sparse, as with [`Allocation::Sparse`].
    pub(crate) unsupported: AtomicBool,
    /// A [`Shared::extend_reservation`] is under way.
    pub(crate) extending: AtomicBool,
    /// Held across each `fallocate` of the reservation: requests that find their cluster not
    /// yet reserved wait for the one reserving and look again, instead of each reserving a
    /// step of its own (32 copy-on-write writes at once made 32 `fallocate`s of 128 MiB,
    /// which the storage's range locks ran one after another).
    pub(crate) lock: tokio::sync::Mutex<()>,
}

impl Reservation {
    pub(crate) fn new(file_end: u64) -> Self {
        Self {
            from: file_end,
            end: AtomicU64::new(file_end),
            unsupported: AtomicBool::new(false),
            extending: AtomicBool::new(false),
            lock: tokio::sync::Mutex::new(()),
        }
    }

    /// Whether a write may go to the new cluster at `host` (`cluster_size` bytes) without
    /// reserving anything first.
    pub(crate) fn covers(&self, allocation: Allocation, host: u64, cluster_size: u64) -> bool {
        allocation == Allocation::Sparse
            || self.unsupported.load(Ordering::Relaxed)
            || (host >= self.from && host + cluster_size <= self.end.load(Ordering::Acquire))
    }
}

impl<S: Storage> Shared<S> {
    pub(crate) fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    pub(crate) fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    /// Reserves the space of the new cluster at `host` before its first write
    /// ([`Allocation::Contiguous`]): on its own inside the file, in steps of [`RESERVE_AHEAD`]
    /// past its end. Advisory: a file that cannot reserve just stays sparse.
    pub(crate) async fn reserve_fresh(&self, host: u64) -> Result<()> {
        let cs = self.geo.cluster_size();
        let r = &self.reservation;
        if r.covers(self.allocation, host, cs) {
            return Ok(());
        }
        if host < r.from {
            // A hole inside the file (a discard punched it): this cluster alone.
            return self
                .reserve(host, cs)
                .await
                .map_err(|e| self.storage_error(e));
        }
        let _reserving = r.lock.lock().await;
        if r.covers(self.allocation, host, cs) {
            return Ok(());
        }
        let at = host.max(r.end.load(Ordering::Acquire));
        let len = host + self.reserve_step() - at;
        self.reserve(at, len)
            .await
            .map_err(|e| self.storage_error(e))
    }

    /// A zeroed buffer of `len` bytes in page-aligned memory, for data the engine writes
    /// itself (copy-on-write, new tables, write-back): O_DIRECT storage takes it as it is,
    /// where a `Vec` would be copied into a bounce buffer and written by read-modify-write.
    pub(crate) fn io_buf(&self, len: usize) -> Result<AlignedBuf> {
        let align = self.io_align();
        AlignedBuf::zeroed(len, align).ok_or_else(|| self.io_buf_error(len, align))
    }

    /// [`io_buf`](Self::io_buf) holding a copy of `data` (not zeroed first).
    pub(crate) fn io_copy(&self, data: &[u8]) -> Result<AlignedBuf> {
        let align = self.io_align();
        AlignedBuf::copy_from(data, align).ok_or_else(|| self.io_buf_error(data.len(), align))
    }

    fn io_align(&self) -> usize {
        self.file.mem_alignment().max(4096)
    }

    fn io_buf_error(&self, len: usize, align: usize) -> Error {
        Error::io(
            &self.path,
            "allocating an I/O buffer",
            std::io::Error::other(format!("{len} bytes aligned to {align} bytes")),
        )
    }

    /// Bytes reserved at once past the end of the file.
    pub(crate) fn reserve_step(&self) -> u64 {
        let cs = self.geo.cluster_size();
        RESERVE_AHEAD.div_ceil(cs).max(RESERVE_CLUSTERS) * cs
    }

    /// Whether the allocation of `host` leaves less than a whole step reserved after it, so
    /// that the next step should be reserved now; the one caller that gets `true` claims the
    /// job, which [`extend_reservation`](Self::extend_reservation) ends. (Half a step was too
    /// little: 32 copy-on-write writes of 2 MiB clusters in flight used it up before the
    /// `fallocate` of the next step ended, and a third of them went to the engine.)
    pub(crate) fn claim_extension(&self, host: u64) -> bool {
        let r = &self.reservation;
        self.allocation == Allocation::Contiguous
            && !r.unsupported.load(Ordering::Relaxed)
            && host >= r.from
            && host + self.reserve_step() > r.end.load(Ordering::Acquire)
            && !r.extending.swap(true, Ordering::AcqRel)
    }

    /// Reserves the next step past what is reserved, ahead of the allocations that will need
    /// it (after [`claim_extension`](Self::claim_extension); the queues' direct path cannot
    /// wait for a `fallocate`). Advisory: an error leaves the file sparse there.
    pub(crate) async fn extend_reservation(&self) {
        let r = &self.reservation;
        {
            let _reserving = r.lock.lock().await;
            let _ = self
                .reserve(r.end.load(Ordering::Acquire), self.reserve_step())
                .await;
        }
        r.extending.store(false, Ordering::Release);
    }

    /// `fallocate` of `[at, at + len)` in the image file, recorded in the reservation.
    async fn reserve(&self, at: u64, len: u64) -> std::result::Result<(), StorageError> {
        let r = &self.reservation;
        match self.file.allocate(at, len).await? {
            AllocateOutcome::Reserved if at >= r.from => {
                r.end.fetch_max(at + len, Ordering::AcqRel);
            }
            AllocateOutcome::Reserved => {}
            AllocateOutcome::NotReserved => r.unsupported.store(true, Ordering::Relaxed),
        }
        Ok(())
    }

    /// At close: cuts off what [`reserve_fresh`](Self::reserve_fresh) reserved past the last
    /// allocated cluster (`end_cluster`), so the file ends where QEMU's would.
    pub(crate) async fn trim_reservation(&self, end_cluster: u64) -> Result<()> {
        let r = &self.reservation;
        let keep = end_cluster * self.geo.cluster_size();
        if r.end.load(Ordering::Acquire) <= r.from.max(keep) {
            return Ok(());
        }
        let len = self.file_len().await?;
        if len > keep {
            self.file
                .set_len(keep)
                .await
                .map_err(|e| self.storage_error(e))?;
        }
        r.end.store(keep, Ordering::Release);
        Ok(())
    }

    pub(crate) fn storage_error(&self, e: StorageError) -> Error {
        Error::storage(&self.path, e)
    }

    /// Flushes the image file (its data file is [`data`](Self::data)'s), the error naming
    /// the image.
    pub(crate) async fn flush_file(&self) -> Result<()> {
        self.file.flush().await.map_err(|e| self.storage_error(e))
    }

    /// The length of the image file, the error naming the image.
    pub(crate) async fn file_len(&self) -> Result<u64> {
        self.file.len().await.map_err(|e| self.storage_error(e))
    }

    /// Reads guest data at host offset `host` of the data file into `dst` (zeros past its
    /// end), decrypted when the image is encrypted: the enclosing 512-byte sectors are read
    /// and decrypted (a sector's IV is its host offset / 512, as QEMU's LUKS qcow2). The one
    /// place guest data is read from the data file.
    pub(crate) async fn read_guest_data(&self, dst: &mut [u8], host: u64) -> Result<()> {
        let (data, path) = self.data();
        let Some(crypt) = &self.crypt else {
            return data
                .read_at_zero_fill(dst, host)
                .await
                .map_err(|e| Error::storage(path, e));
        };
        let sector = crate::crypto::SECTOR as u64;
        let start = host / sector * sector;
        let end = (host + dst.len() as u64).next_multiple_of(sector);
        let mut buf = self.io_buf((end - start) as usize)?;
        data.read_at_zero_fill(&mut buf, start)
            .await
            .map_err(|e| Error::storage(path, e))?;
        crypt.decrypt(start / sector, &mut buf);
        let at = (host - start) as usize;
        dst.copy_from_slice(&buf[at..at + dst.len()]);
        Ok(())
    }

    /// Writes guest data `src` at host offset `host` of the data file, encrypted when the
    /// image is encrypted (whole sectors only: the write planner widens an encrypted image's
    /// writes to them, `plan_write`). The one place guest data is written to the data file.
    pub(crate) async fn write_guest_data(&self, src: &[u8], host: u64) -> Result<()> {
        let (data, path) = self.data();
        let Some(crypt) = &self.crypt else {
            return data
                .write_at(src, host)
                .await
                .map_err(|e| Error::storage(path, e));
        };
        let sector = crate::crypto::SECTOR as u64;
        if host % sector != 0 || src.len() as u64 % sector != 0 {
            return Err(Error::InvalidOption(format!(
                "{}: an encrypted write of {} bytes at host offset {host:#x} is not in whole \
                 512-byte sectors",
                path.display(),
                src.len()
            )));
        }
        let mut buf = self.io_copy(src)?;
        crypt.encrypt(host / sector, &mut buf);
        data.write_at(&buf, host)
            .await
            .map_err(|e| Error::storage(path, e))
    }

    /// Refuses `what` (a lease handing out host offsets, a compressed write) on an encrypted
    /// image, whose host bytes are ciphertext.
    pub(crate) fn check_not_encrypted(&self, what: &str) -> Result<()> {
        match self.crypt {
            None => Ok(()),
            Some(_) => Err(Error::Unsupported {
                path: self.path.clone(),
                what: format!("{what} on an encrypted image (its host bytes are ciphertext)"),
            }),
        }
    }

    /// Where guest data lives: the external data file, or the image file.
    pub(crate) fn data(&self) -> (&S, &Path) {
        match &self.data_file {
            Some((p, s)) => (s, p),
            None => (&self.file, &self.path),
        }
    }

    /// Refuses changes after a failed header switch ([`Error::Halted`]).
    pub(crate) fn check_not_halted(&self) -> Result<()> {
        match self.halted.get() {
            Some(what) => Err(Error::Halted {
                path: self.path.clone(),
                what: what.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Refuses every request once corruption was found on a writable image
    /// ([`Error::Unusable`]): the one rule for "a corrupt image takes no more requests".
    pub(crate) fn check_usable(&self) -> Result<()> {
        if self.writable && self.marked_corrupt.load(Ordering::Acquire) {
            return Err(Error::Unusable {
                path: self.path.clone(),
            });
        }
        Ok(())
    }

    pub(crate) fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        self.check_usable()?;
        let size = self.size();
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::OutOfRange {
                path: self.path.clone(),
                offset,
                len,
                size,
            });
        }
        Ok(())
    }

    pub(crate) fn check_writable(&self) -> Result<()> {
        self.check_not_halted()?;
        // (On a read-only image the mark only says a corruption was reported.)
        self.check_usable()?;
        if self.writable {
            Ok(())
        } else {
            Err(Error::ReadOnly {
                path: self.path.clone(),
            })
        }
    }
}

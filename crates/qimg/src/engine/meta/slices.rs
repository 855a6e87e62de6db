//! L2 entries through the slice caches, and writing the caches back in the crash-safe order:
//! a slice is written only after what it depends on is durable (QEMU's cache dependencies).

use qimg_io::DebugEvent;
use std::time::Duration;

use qimg_cache::{Dependencies, DirtySlice, SliceCache, SliceKey};
use qimg_format::l2::{AnyL2Entry, write_entry};
use qimg_format::units::GuestOffset;
use qimg_io::Storage;

use super::{CacheKind, Meta};
use crate::engine::overlap::{Region, Writing};
use crate::engine::state::Shared;
use crate::error::{Error, Result, c_hex};

impl<S: Storage> Shared<S> {
    /// Slice key and index in the slice of the L2 entry for `guest` in table `table`.
    pub(crate) fn l2_position(&self, m: &Meta, table: u64, guest: u64) -> (SliceKey, usize) {
        let per_slice = m.l2_slice / self.geo.l2_entry_size();
        let index = self.geo.l2_index(GuestOffset(guest));
        let slice = index / per_slice;
        (
            SliceKey::new(table, slice as u32),
            (index % per_slice) as usize,
        )
    }

    pub(crate) fn slice_location(&self, m: &Meta, kind: CacheKind, key: SliceKey) -> u64 {
        match kind {
            CacheKind::L2 => key.table + u64::from(key.slice) * m.l2_slice,
            CacheKind::Refcount => key.table + u64::from(key.slice) * m.rc.slice_size() as u64,
        }
    }

    /// The L2 entry describing the guest cluster containing `guest`: its slice loaded (a
    /// counted lookup), then [`entry_now`](Self::entry_now).
    pub(crate) async fn lookup(&self, m: &mut Meta, guest: u64) -> Result<AnyL2Entry> {
        let Some((key, idx)) = self.entry_slot(m, guest) else {
            return Ok(self.unallocated_entry());
        };
        self.load(m, CacheKind::L2, key).await?;
        self.entry_in_slice(m, key, idx).await
    }

    /// Entry `idx` of the cached L2 slice `key` (an uncounted look: the caller counted the
    /// lookup). An entry that does not decode is corruption, reported in QEMU's words.
    pub(crate) async fn entry_in_slice(
        &self,
        m: &mut Meta,
        key: SliceKey,
        idx: usize,
    ) -> Result<AnyL2Entry> {
        match self.entry_now(m, key, idx, None) {
            Ok(Ok(entry)) => Ok(entry),
            Ok(Err(e)) => {
                // QEMU's words for the event (`qcow2_get_host_offset`), ours for the error.
                let es = self.geo.l2_entry_size();
                let at = self.slice_location(m, CacheKind::L2, key) + idx as u64 * es;
                let index = (at - key.table) / es;
                let event = match e {
                    qimg_format::FormatError::Unaligned { value, .. } => format!(
                        "Cluster allocation offset {value:#x} unaligned (L2 offset: {:#x}, L2 \
                         index: {})",
                        key.table,
                        c_hex(index)
                    ),
                    qimg_format::FormatError::InvalidSubclusterBitmap { .. } => format!(
                        "Invalid cluster entry found  (L2 offset: {:#x}, L2 index: {})",
                        key.table,
                        c_hex(index)
                    ),
                    _ => e.to_string(),
                };
                Err(self.signal_corruption_as(m, event, e.to_string()).await)
            }
            Err(_) => Err(Error::corrupt(
                &self.path,
                format!("L2 slice {key} vanished"),
            )),
        }
    }

    /// Where the L2 entry of the guest cluster containing `guest` is: its slice and index;
    /// `None` where no L2 table maps the cluster (the entry is unallocated).
    fn entry_slot(&self, m: &Meta, guest: u64) -> Option<(SliceKey, usize)> {
        let l1i = self.geo.l1_index(GuestOffset(guest)) as usize;
        let table = m.l1.get(l1i).and_then(|e| e.l2_offset)?;
        Some(self.l2_position(m, table.0, guest))
    }

    /// The one decode of an L2 entry from the cache: entry `idx` of slice `key`, or the
    /// slice as what it needs. `stamp`: a hit counts (and refreshes the slice with this
    /// time); `None`: an uncounted look, for a caller that counted the lookup already.
    fn entry_now(
        &self,
        m: &mut Meta,
        key: SliceKey,
        idx: usize,
        stamp: Option<Duration>,
    ) -> super::Needs<std::result::Result<AnyL2Entry, qimg_format::FormatError>> {
        let es = self.geo.l2_entry_size() as usize;
        let at = self.slice_location(m, CacheKind::L2, key) + (idx * es) as u64;
        // Not `get`: a miss here is not counted (the load that follows counts it).
        let slice = match stamp {
            Some(now) => m.l2.get_if_cached(key, now),
            None => m.l2.peek(key),
        }
        .ok_or(super::Need::L2Slice(key))?;
        let Some(bytes) = slice.get(idx * es..(idx + 1) * es) else {
            return Err(super::Need::L2Slice(key));
        };
        Ok(AnyL2Entry::decode(bytes, &self.ctx, at))
    }

    /// The L2 entry of the guest cluster containing `guest` if it is known without I/O (its
    /// slice cached, or no L2 table): the lookup of requests that must not wait. `None` on a
    /// cache miss or an entry that does not decode (the full [`lookup`](Self::lookup) reports
    /// that). `stamp`: as for [`entry_now`](Self::entry_now); `None` for a request whose
    /// miss was counted when its slice was loaded for it.
    pub(crate) fn lookup_cached(
        &self,
        m: &mut Meta,
        guest: u64,
        stamp: Option<Duration>,
    ) -> Option<AnyL2Entry> {
        let l1i = self.geo.l1_index(GuestOffset(guest)) as usize;
        if l1i >= m.l1.len() {
            return None;
        }
        let Some((key, idx)) = self.entry_slot(m, guest) else {
            return Some(self.unallocated_entry());
        };
        self.entry_now(m, key, idx, stamp).ok()?.ok()
    }

    /// Replaces the L2 entry of the guest cluster containing `guest`, creating (or
    /// un-sharing) its L2 table first.
    pub(crate) async fn set_entry(
        &self,
        m: &mut Meta,
        guest: u64,
        entry: &AnyL2Entry,
    ) -> Result<()> {
        // The slice made ready (a counted lookup, as every locked change of an entry makes),
        // then the change itself.
        self.writable_l2_slice(m, guest).await?;
        self.until_done(m, |m| self.set_entry_now(m, guest, entry))
            .await?
    }

    /// Runs `change` (a change made without I/O) until it is made, resolving what it needs
    /// in between; a change that still needs something after a few rounds is an error (the
    /// needs it names are resolved each time, so this means the metadata keeps changing under
    /// the lock, which it cannot).
    pub(crate) async fn until_done<T>(
        &self,
        m: &mut Meta,
        mut change: impl FnMut(&mut Meta) -> super::Needs<T>,
    ) -> Result<T> {
        for _ in 0..4 {
            match change(m) {
                Ok(done) => return Ok(done),
                Err(need) => self.resolve(m, need).await?,
            }
        }
        Err(Error::corrupt(
            &self.path,
            "a metadata change still needs I/O after that I/O was done",
        ))
    }

    /// Does the I/O `need` names (see [`Need`](super::Need)).
    pub(crate) async fn resolve(&self, m: &mut Meta, need: super::Need) -> Result<()> {
        // Boxed: resolving a need may change refcounts or tables, which may need resolving.
        Box::pin(self.resolve_inner(m, need)).await
    }

    async fn resolve_inner(&self, m: &mut Meta, need: super::Need) -> Result<()> {
        match need {
            super::Need::WriteBack { kind, on } => {
                self.write_back(m, kind).await?;
                self.flush_file().await?;
                let kept = m.cache(on).take_dependencies();
                if kept.flush {
                    m.cache(on).depend_on_flush();
                }
                Ok(())
            }
            super::Need::WritableSlice(guest) => self.writable_l2_slice(m, guest).await.map(|_| ()),
            super::Need::DirtyBit => self.mark_dirty_if_lazy(m).await,
            super::Need::Refblock { index, at } => self.ensure_refblock(m, index, at).await,
            super::Need::Reftable(entries) => self.grow_reftable(m, entries).await,
            super::Need::Flush => self.flush_meta(m).await,
            super::Need::Far => Err(Error::corrupt(
                &self.path,
                "a search bounded for a caller's thread reached the engine",
            )),
            super::Need::RefcountSlice(key) => self.load(m, CacheKind::Refcount, key).await,
            super::Need::L2Slice(key) => self.load(m, CacheKind::L2, key).await,
        }
    }

    /// The L2 slice holding the entry of the guest cluster containing `guest`, cached, with
    /// its table created (or un-shared) first; a table just created has its slice cached as
    /// the zeros just written, not read back. Returns the slice's key and the entry's index.
    pub(crate) async fn writable_l2_slice(
        &self,
        m: &mut Meta,
        guest: u64,
    ) -> Result<(SliceKey, usize)> {
        let l1i = self.geo.l1_index(GuestOffset(guest)) as usize;
        let (table, zeros) = self.ensure_l2(m, l1i).await?;
        let (key, idx) = self.l2_position(m, table, guest);
        if zeros && !m.l2.contains(key) {
            self.make_room(m, CacheKind::L2).await?;
            self.slice_loads.supersede(key);
            let size = m.l2.slice_size();
            self.insert_slice(m, CacheKind::L2, key, vec![0u8; size])
                .await?;
        } else {
            self.load(m, CacheKind::L2, key).await?;
        }
        Ok((key, idx))
    }

    /// The bytes of entry `idx` in an L2 slice: the only ones a change of the entry dirties.
    fn entry_bytes(&self, idx: usize) -> std::ops::Range<usize> {
        let es = self.geo.l2_entry_size() as usize;
        idx * es..(idx + 1) * es
    }

    /// The one body of [`set_entry`](Self::set_entry): replaces the entry of `guest` if its
    /// L2 table exists, is not shared with a snapshot (COPIED), and its slice is cached;
    /// otherwise (nothing changed) names the slice it needs. The inner result is the entry's
    /// encoding.
    pub(crate) fn set_entry_now(
        &self,
        m: &mut Meta,
        guest: u64,
        entry: &AnyL2Entry,
    ) -> super::Needs<Result<()>> {
        let need = super::Need::WritableSlice(guest);
        let (key, idx) = self.cached_position(m, guest).ok_or(need)?;
        let now = self.now();
        let slot = self.entry_bytes(idx);
        let bytes = m.l2.get_mut_range(key, slot, now).ok_or(need)?;
        Ok(write_entry(bytes, 0, entry).map_err(|e| self.fmt_err(e)))
    }

    /// Whether [`set_entry_now`](Self::set_entry_now) can change the entry of `guest` now.
    pub(crate) fn can_link_cached(&self, m: &Meta, guest: u64) -> bool {
        self.cached_position(m, guest).is_some()
    }

    /// The cached slice and index of the entry of `guest` in a table of its own (COPIED).
    fn cached_position(&self, m: &Meta, guest: u64) -> Option<(SliceKey, usize)> {
        let l1i = self.geo.l1_index(GuestOffset(guest)) as usize;
        let l1e = m.l1.get(l1i)?;
        let (Some(table), true) = (l1e.l2_offset, l1e.copied) else {
            return None;
        };
        let (key, idx) = self.l2_position(m, table.0, guest);
        m.l2.contains(key).then_some((key, idx))
    }

    /// The one body of [`set_dependency`](Self::set_dependency): records that `kind` waits for
    /// `on`, or (nothing changed) asks for `kind` to be written back when `on` already waits
    /// for it. Lazy refcounts record nothing (the dirty bit covers the order).
    pub(crate) fn set_dependency_now(
        &self,
        m: &mut Meta,
        kind: CacheKind,
        on: CacheKind,
    ) -> super::Needs<()> {
        if self.lazy {
            return Ok(());
        }
        if m.cache(on).dependencies().other_cache {
            return Err(super::Need::WriteBack { kind, on });
        }
        m.cache(kind).depend_on_other_cache();
        Ok(())
    }

    /// QEMU's words for the L2 table at `table` when it is not cluster aligned (`None` when
    /// it is). Such a table is never loaded, copied or freed: the request that needs it
    /// fails and the image is marked corrupt ([`load`](Self::load), [`ensure_l2`]
    /// (Self::ensure_l2), [`refuse_unaligned_l2`](Self::refuse_unaligned_l2)); the paths that
    /// load slices without the metadata lock leave it to the locked one.
    pub(crate) fn unaligned_l2(&self, m: &Meta, table: u64) -> Option<String> {
        (table % self.geo.cluster_size() != 0).then(|| {
            let l1i =
                m.l1.iter()
                    .position(|e| e.l2_offset.is_some_and(|o| o.0 == table))
                    .unwrap_or(0);
            format!(
                "L2 table offset {table:#x} unaligned (L1 index: {})",
                c_hex(l1i as u64)
            )
        })
    }

    /// Refuses (marking the image corrupt) when an L1 entry names an unaligned L2 table:
    /// for the operations that walk every table (refcount rebuild, snapshots, shrinking,
    /// emptying).
    pub(crate) async fn refuse_unaligned_l2(&self, m: &mut Meta) -> Result<()> {
        let bad =
            m.l1.iter()
                .filter_map(|e| e.l2_offset)
                .find_map(|t| self.unaligned_l2(m, t.0));
        match bad {
            Some(what) => Err(self.signal_corruption(m, what).await),
            None => Ok(()),
        }
    }

    /// Starts reading L2 slice `key` without the metadata lock (an engine read's parallel
    /// load, or a queue's load on its ring: `for_queue`): counts the miss as a locked load
    /// counts it and registers the load. Returns its token and the active L1 table's
    /// generation, which [`unlocked_load_usable`](Self::unlocked_load_usable) checks at the end.
    pub(crate) fn start_unlocked_load(
        &self,
        m: &mut Meta,
        key: SliceKey,
        for_queue: bool,
    ) -> (u64, u64) {
        let now = self.now();
        let _ = m.l2.get(key, now);
        let token = if for_queue {
            self.slice_loads.begin_for_queue(key)
        } else {
            self.slice_loads.begin(key)
        };
        (token, m.l1_epoch)
    }

    /// The staleness rule of a slice read without the metadata lock, for both executors:
    /// its bytes may go into the cache only if the read succeeded, the load was still
    /// `current` when it ended (no locked load of the slice superseded it), the image is
    /// open, and the active L1 table is the one the load started under (`epoch`). Otherwise
    /// the locked path decides.
    pub(crate) fn unlocked_load_usable(
        &self,
        m: &Meta,
        current: bool,
        epoch: u64,
        read_ok: bool,
    ) -> bool {
        read_ok && current && !m.closed && m.l1_epoch == epoch
    }

    /// Makes sure the slice `key` is cached, writing back a dirty victim first.
    pub(crate) async fn load(&self, m: &mut Meta, kind: CacheKind, key: SliceKey) -> Result<()> {
        // A counted lookup: hits and misses in the statistics come from here.
        let now = self.now();
        if m.cache(kind).get(key, now).is_some() {
            return Ok(());
        }
        let cs = self.geo.cluster_size();
        if kind == CacheKind::L2 {
            if let Some(what) = self.unaligned_l2(m, key.table) {
                return Err(self.signal_corruption(m, what).await);
            }
        }
        if kind == CacheKind::Refcount && key.table % cs != 0 {
            // QEMU's words; the image is marked corrupt (writable images), as QEMU does.
            let what = format!(
                "Refblock offset {:#x} unaligned (reftable index: {})",
                key.table,
                c_hex(m.reftable.iter().position(|&b| b == key.table).unwrap_or(0) as u64)
            );
            return Err(self.signal_corruption(m, what).await);
        }
        self.make_room(m, kind).await?;
        let size = m.cache(kind).slice_size();
        let mut buf = vec![0u8; size];
        let at = self.slice_location(m, kind, key);
        self.file.debug_event(match kind {
            CacheKind::L2 => DebugEvent::L2Load,
            CacheKind::Refcount => DebugEvent::RefblockLoad,
        });
        if let Err(e) = self.file.read_at(&mut buf, at).await {
            let what = format!(
                "{} at {at:#x} cannot be read: {e}",
                match kind {
                    CacheKind::L2 => "L2 table slice",
                    CacheKind::Refcount => "refcount block slice",
                }
            );
            let past_end = self
                .file
                .len()
                .await
                .is_ok_and(|len| at.saturating_add(size as u64) > len);
            if past_end && self.writable {
                return Err(self.signal_corruption(m, what).await);
            }
            if !past_end {
                // The file failed to read (an I/O error, not the image's fault): its errno
                // reaches the caller.
                return Err(self.storage_error(e));
            }
            // Read-only, an L2 table past the end of the file reads as zeros (unallocated), as
            // QEMU reads it (its check reports the table).
            let zeros = kind == CacheKind::L2;
            if !zeros || self.file.read_at_zero_fill(&mut buf, at).await.is_err() {
                return Err(Error::corrupt(&self.path, what));
            }
        }
        if kind == CacheKind::L2 {
            // A read loading the same slice without the lock must not insert its copy.
            self.slice_loads.supersede(key);
        }
        self.insert_slice(m, kind, key, buf).await
    }

    /// Writes the cache's victim back if it is dirty, before a slice is read to replace it:
    /// written back while still cached, so that nothing is lost if the write fails.
    pub(crate) async fn make_room(&self, m: &mut Meta, kind: CacheKind) -> Result<()> {
        if let Some(victim) = m.cache(kind).victim() {
            if m.cache(kind).is_dirty(victim) == Some(true) {
                self.write_back(m, kind).await?;
            }
        }
        Ok(())
    }

    /// Inserts a slice just read (after [`make_room`](Self::make_room)), writing back what
    /// its insertion evicts.
    pub(crate) async fn insert_slice(
        &self,
        m: &mut Meta,
        kind: CacheKind,
        key: SliceKey,
        buf: Vec<u8>,
    ) -> Result<()> {
        let now = self.now();
        let evicted = m
            .cache(kind)
            .insert(key, buf.into_boxed_slice(), now)
            .map_err(|e| self.cache_err(e))?;
        if let Some(d) = evicted {
            self.write_evicted(m, kind, d).await?;
        }
        Ok(())
    }

    pub(super) fn own(kind: CacheKind, key: SliceKey) -> Writing {
        match kind {
            CacheKind::L2 => Writing::Own(Region::ActiveL2, key.table),
            CacheKind::Refcount => Writing::Own(Region::RefcountBlock, key.table),
        }
    }

    /// The blkdebug event of a slice write-back (QEMU's cache announces it per table).
    fn update_event(kind: CacheKind) -> DebugEvent {
        match kind {
            CacheKind::L2 => DebugEvent::L2Update,
            CacheKind::Refcount => DebugEvent::RefblockUpdatePart,
        }
    }

    pub(crate) async fn write_evicted(
        &self,
        m: &mut Meta,
        kind: CacheKind,
        d: DirtySlice,
    ) -> Result<()> {
        self.honour_dependencies(m, kind).await?;
        let at = self.slice_location(m, kind, d.key);
        self.guard_write(m, at, d.data.len() as u64, Self::own(kind, d.key))
            .await?;
        self.file.debug_event(Self::update_event(kind));
        self.file
            .write_at(&d.data, at)
            .await
            .map_err(|e| self.storage_error(e))
    }

    /// Before writing any slice of `kind`: flush what it depends on.
    pub(super) async fn honour_dependencies(&self, m: &mut Meta, kind: CacheKind) -> Result<()> {
        let deps = m.cache(kind).take_dependencies();
        let other = kind.other();
        let mut theirs = Dependencies::default();
        let done = async {
            if deps.other_cache {
                theirs = m.cache(other).take_dependencies();
                if theirs.flush {
                    self.flush_data().await?;
                }
                self.write_slices(m, other).await?;
                self.flush_file().await?;
            }
            if deps.flush {
                self.flush_data().await?;
            }
            Ok(())
        }
        .await;
        if done.is_err() {
            // Nothing is known to be durable: the ordering still has to happen next time.
            restore(m.cache(kind), deps);
            restore(m.cache(other), theirs);
        }
        done
    }

    pub(super) async fn write_slices(&self, m: &mut Meta, kind: CacheKind) -> Result<()> {
        for entry in m.cache(kind).dirty_entries() {
            let at = self.slice_location(m, kind, entry.key);
            let cache = m.cache(kind);
            let (Some(span), Some(cached)) = (cache.dirty_span(entry.key), cache.peek(entry.key))
            else {
                continue;
            };
            // Only the blocks holding changed bytes: a 2 MiB table or refcount block with
            // one new entry costs a 4 KiB write, not 2 MiB.
            let span = write_back_span(span, cached.len());
            if !span.is_empty() {
                // Copied (the write may wait while the cache changes), into aligned memory.
                let data = self.io_copy(&cached[span.clone()])?;
                let at = at + span.start as u64;
                self.guard_write(m, at, data.len() as u64, Self::own(kind, entry.key))
                    .await?;
                self.file.debug_event(Self::update_event(kind));
                self.file
                    .write_at(&data, at)
                    .await
                    .map_err(|e| self.storage_error(e))?;
            }
            m.cache(kind)
                .mark_clean(entry)
                .map_err(|e| self.cache_err(e))?;
        }
        Ok(())
    }

    /// Writes back every dirty slice of `kind`, after what it depends on.
    pub(crate) async fn write_back(&self, m: &mut Meta, kind: CacheKind) -> Result<()> {
        self.honour_dependencies(m, kind).await?;
        self.write_slices(m, kind).await
    }

    /// Records that `kind` must not be written before `on` is flushed (QEMU's
    /// `qcow2_cache_set_dependency`): a dependency the other way is resolved first, by
    /// flushing, so the two never wait for each other.
    pub(crate) async fn set_dependency(
        &self,
        m: &mut Meta,
        kind: CacheKind,
        on: CacheKind,
    ) -> Result<()> {
        self.until_done(m, |m| self.set_dependency_now(m, kind, on))
            .await
    }

    pub(crate) async fn flush_data(&self) -> Result<()> {
        if let Some((p, s)) = &self.data_file {
            s.flush().await.map_err(|e| Error::storage(p, e))?;
        }
        self.flush_file().await
    }

    /// Guest flush: L2 slices, refcount blocks, then a storage flush; then queued punches.
    pub(crate) async fn flush_meta(&self, m: &mut Meta) -> Result<()> {
        self.flush_meta_with(m, true, false).await
    }

    /// The flush of [`Image::close`](crate::Image::close): [`flush_meta`](Self::flush_meta),
    /// announced as a guest flush is.
    pub(crate) async fn flush_closing(&self, m: &mut Meta) -> Result<()> {
        self.flush_meta_with(m, true, true).await
    }

    /// A guest's flush (`Image::flush`, and so every flush a queue, an export or `qimg io`
    /// asks for): [`flush_meta`](Self::flush_meta), except that on an image with lazy
    /// refcounts already marked dirty the refcount blocks stay in the cache, as QEMU's
    /// `qcow2_write_caches` leaves them (`qcow2_need_accurate_refcounts`): the dirty bit
    /// says they are rebuilt after a crash, and the close writes them before it clears it.
    /// So a writer killed after a flush leaves what QEMU's leaves (iotest 039's errors).
    pub(crate) async fn flush_guest(&self, m: &mut Meta) -> Result<()> {
        let accurate = !(self.lazy && m.dirty_on_disk);
        self.flush_meta_with(m, accurate, true).await
    }

    /// Writes back the caches (the refcount blocks if `refcounts`) and flushes the files.
    /// A `guest` flush (asked for by the guest or the close, not one the engine needs for its
    /// own ordering) announces QEMU's `flush_to_os` and `flush_to_disk` events.
    async fn flush_meta_with(&self, m: &mut Meta, refcounts: bool, guest: bool) -> Result<()> {
        if guest {
            self.file.debug_event(DebugEvent::FlushToOs);
        }
        self.write_back(m, CacheKind::L2).await?;
        if refcounts {
            self.write_back(m, CacheKind::Refcount).await?;
        }
        if guest {
            self.file.debug_event(DebugEvent::FlushToDisk);
        }
        self.flush_data().await?;
        let punches = std::mem::take(&mut m.pending_punch);
        let cs = self.geo.cluster_size();
        for c in punches {
            if m.overlap.find(c * cs, cs, Writing::Data).is_some() {
                // A freed cluster that is still metadata: the refcounts are wrong. Keep it.
                continue;
            }
            // Advisory: a failed punch only costs space.
            let _ = self.file.discard(c * cs, cs).await;
        }
        Ok(())
    }

    /// One pass of the cache-clean timer; returns the bytes freed.
    pub(crate) async fn clean_idle(&self, m: &mut Meta) -> Result<u64> {
        let Some(interval) = self.clean_interval else {
            return Ok(0);
        };
        self.clean_idle_with(m, interval).await
    }

    pub(crate) async fn clean_idle_with(&self, m: &mut Meta, interval: Duration) -> Result<u64> {
        let mut freed = 0;
        for kind in [CacheKind::L2, CacheKind::Refcount] {
            let now = self.now();
            let report = m.cache(kind).clean_idle(now, interval);
            freed += report.bytes_freed;
            if !report.dirty_idle.is_empty() {
                // Written back in dependency order, then dropped by a second pass (a
                // write-back is not a use).
                self.write_back(m, kind).await?;
                freed += m.cache(kind).clean_idle(now, interval).bytes_freed;
            }
        }
        Ok(freed)
    }
}

/// Blocks written back for the changed bytes `span` of a slice of `len` bytes.
const WRITE_BACK_BLOCK: usize = 4096;

/// `span` widened to whole [`WRITE_BACK_BLOCK`]s (whole slices when smaller), within the
/// slice: writes O_DIRECT storage takes without a read-modify-write.
fn write_back_span(span: std::ops::Range<usize>, len: usize) -> std::ops::Range<usize> {
    if span.is_empty() {
        return 0..0;
    }
    let block = WRITE_BACK_BLOCK.min(len).max(1);
    let start = span.start / block * block;
    let end = span.end.div_ceil(block).saturating_mul(block).min(len);
    start..end
}

fn restore(cache: &mut SliceCache, deps: Dependencies) {
    if deps.other_cache {
        cache.depend_on_other_cache();
    }
    if deps.flush {
        cache.depend_on_flush();
    }
}

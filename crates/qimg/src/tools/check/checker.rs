//! The state of a check ([`Checker`]): the image's geometry and tables as loaded, the computed
//! references, and the I/O every part of the check goes through (reads through the metadata
//! walker, writes that a silent walk only pretends, header updates, QEMU's corruption signal,
//! on-disk refcounts and the overlap check of repair writes).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::Path;

use qimg_format::bitmap::{BitmapEntry, BitmapsExtension, encode_directory};
use qimg_format::cluster0::Cluster0;
use qimg_format::extensions::Extension;
use qimg_format::features::{
    AUTOCLEAR_BITMAPS, INCOMPAT_CORRUPT, INCOMPAT_DATA_FILE, INCOMPAT_DIRTY, autoclear_for_writer,
};
use qimg_format::geometry::RefcountGeometry;
use qimg_format::header::{Header, encode_autoclear, encode_incompatible, field};
use qimg_format::lenient::{L2Layout, RawL1Entry, RawReftableEntry, TABLE_WORD};
use qimg_format::refcount;
use qimg_format::validate::{MAX_L1_BYTES, MAX_REFTABLE_BYTES};
use qimg_io::Storage;

use super::{CheckEvent, EIO, Failure, io_failure, storage_io_error, strerror};
use crate::engine::overlap::OverlapIndex;
use crate::engine::walk::{L2Table, ReferenceCounts, WalkError, Walker};
use crate::error::{Error, Result};

/// Clusters past the end of the file remembered as referenced by uncounted ranges.
pub(super) const BEYOND_EOF_WINDOW: u64 = 4096;

pub(super) use crate::error::c_hex;

/// A walk error as the `std::io::Error` QEMU would have seen.
pub(super) fn walk_io_error(e: WalkError) -> std::io::Error {
    match e {
        WalkError::Storage(e) => storage_io_error(e),
        // Tables are bounded before they are read; a strict decode is never asked for.
        WalkError::TooLarge { .. } => std::io::Error::from_raw_os_error(27),
        e @ WalkError::Format(_) => std::io::Error::other(e.to_string()),
    }
}

/// One entry of the snapshot table, as far as the check needs it.
#[derive(Debug, Clone)]
pub(super) struct SnapshotEntry {
    pub(super) l1_offset: u64,
    pub(super) l1_size: u32,
    pub(super) id: String,
    pub(super) name: String,
    pub(super) extra_data_size: u32,
}

/// What came of making an L2 entry read as zeros.
pub(super) enum ZeroingOutcome {
    /// The L2 table is also used as something else: not touched.
    Shared,
    Done,
    Overlap,
    Failed,
}

/// The bitmaps extension, when the bitmaps autoclear bit says it is valid.
#[derive(Debug, Clone, Copy)]
pub(super) struct BitmapDirectory {
    pub(super) offset: u64,
    pub(super) size: u64,
    pub(super) count: u32,
}

/// A check in progress.
pub(super) struct Checker<'a, S> {
    pub(super) file: &'a S,
    pub(super) writable: bool,
    pub(super) file_len: u64,
    pub(super) cluster_bits: u32,
    pub(super) cluster_size: u64,
    pub(super) layout: L2Layout,
    pub(super) version: u32,
    pub(super) data_file: bool,
    pub(super) total_sectors: u64,
    pub(super) order: u32,
    pub(super) refcount_max: u64,
    /// Refcount width and block size.
    pub(super) refcount_geometry: RefcountGeometry,
    /// Refcounts per refcount block.
    pub(super) entries: u64,
    pub(super) l1_offset: u64,
    pub(super) l1_size: u32,
    /// The active L1 table as loaded at open (QEMU's `s->l1_table`), with the entries'
    /// positions.
    pub(super) l1: Vec<(u64, RawL1Entry)>,
    pub(super) reftable_offset: u64,
    pub(super) reftable: Vec<RawReftableEntry>,
    /// The metadata places for the overlap check; `None` until first use and whenever a whole
    /// table was replaced.
    pub(super) index: Option<OverlapIndex>,
    pub(super) incompatible: u64,
    pub(super) nb_snapshots: u32,
    pub(super) snapshots_offset: u64,
    pub(super) snapshots_size: u64,
    pub(super) snapshots: Vec<SnapshotEntry>,
    /// v3 snapshot entries found incomplete, to be completed by a `-r all` repair.
    pub(super) incomplete_snapshots: u32,
    pub(super) bitmaps: Option<BitmapDirectory>,
    pub(super) crypto: Option<(u64, u64)>,
    pub(super) refs: ReferenceCounts,
    /// Clusters just past the end of the file that entries refer to although their ranges
    /// were not counted (past the end): a rebuild must not place its structure there.
    pub(super) beyond_eof: BTreeSet<u64>,
    /// The clusters inside the file (as `[start, end)` ranges, unmerged) of regions that were
    /// not counted because they run past its end. The walk still reads them (the part of an
    /// L1 or bitmap table inside the file gives its entries), so their bytes decide what a
    /// check finds although their refcount may be 0: a rebuild must not place its structure
    /// there, or the next check reads refcounts as table entries.
    pub(super) uncounted: Vec<(u64, u64)>,
    /// The longest the file may grow without bringing an uncounted region within one
    /// cluster of its end: the next check would count that region, and report its clusters
    /// instead of it. `u64::MAX` when no region was left uncounted.
    pub(super) grow_limit: u64,
    /// How often each cluster is used as (part of) an L1 or L2 table in the current walk.
    pub(super) table_uses: HashMap<u64, u64>,
    /// How often each cluster holds (part of) a compressed cluster's data in the current walk.
    pub(super) compressed_uses: HashMap<u64, u64>,
    /// With `-r all`: the clusters of tables referenced as nothing else (from a silent walk
    /// before the repairing one). Entries are only rewritten inside those, so that a table
    /// that is also guest data or other metadata is never changed.
    pub(super) exclusive: Option<HashSet<u64>>,
    /// The silent walk: messages and progress are not reported, and repairs are only
    /// pretended (nothing is written), so that the references corrupt entries would lose are
    /// not counted.
    pub(super) mute: bool,
    /// Refcount blocks read lately, by offset.
    pub(super) cache: HashMap<u64, Vec<u8>>,
    pub(super) signaled_corruption: bool,
    /// Entry repairs were written since the last sync (`sync_entries`).
    pub(super) unsynced: bool,
    /// Clusters whose refcount repairs must not change what COPIED says (named by entries
    /// of shared tables, see `mismatch`).
    pub(super) keep_copied: HashSet<u64>,
    pub(super) events: &'a mut dyn FnMut(CheckEvent<'_>),
}

impl<'a, S: Storage> Checker<'a, S> {
    pub(super) async fn open(
        file: &'a S,
        path: &Path,
        c0: &Cluster0,
        writable: bool,
        events: &'a mut dyn FnMut(CheckEvent<'_>),
    ) -> Result<Self> {
        let h = &c0.header;
        let file_len = file
            .len()
            .await
            .map_err(|e| Error::io(path, "stat", storage_io_error(e)))?;
        let cluster_bits = h.cluster_bits;
        let cluster_size = 1u64 << cluster_bits;
        let order = if h.version >= 3 { h.refcount_order } else { 4 };
        let geometry =
            RefcountGeometry::new(cluster_bits, order).map_err(|e| Error::format(path, e))?;
        let refcount_max = geometry.max_refcount();
        let entries = geometry.refblock_entries();
        let data_file = h.incompatible_features & INCOMPAT_DATA_FILE != 0;
        let mut ck = Self {
            file,
            writable,
            file_len,
            cluster_bits,
            cluster_size,
            layout: L2Layout {
                cluster_bits,
                extended: h.extended_l2(),
                external_data: data_file,
            },
            version: h.version,
            data_file,
            total_sectors: h.size / 512,
            order,
            refcount_max,
            refcount_geometry: geometry,
            entries,
            l1_offset: h.l1_table_offset,
            l1_size: h.l1_size,
            l1: Vec::new(),
            reftable_offset: h.refcount_table_offset,
            reftable: Vec::new(),
            index: None,
            incompatible: h.incompatible_features,
            nb_snapshots: h.nb_snapshots,
            snapshots_offset: h.snapshots_offset,
            snapshots_size: 0,
            snapshots: Vec::new(),
            incomplete_snapshots: 0,
            bitmaps: None,
            crypto: None,
            refs: ReferenceCounts::default(),
            beyond_eof: BTreeSet::new(),
            uncounted: Vec::new(),
            grow_limit: u64::MAX,
            table_uses: HashMap::new(),
            compressed_uses: HashMap::new(),
            exclusive: None,
            mute: false,
            cache: HashMap::new(),
            signaled_corruption: false,
            unsynced: false,
            keep_copied: HashSet::new(),
            events,
        };
        // Both sizes were bounded by the header validation (32 MiB and 8 MiB).
        let l1_bytes = u64::from(h.l1_size) * TABLE_WORD;
        let rt_bytes = u64::from(h.refcount_table_clusters) * cluster_size;
        if l1_bytes > MAX_L1_BYTES || rt_bytes > MAX_REFTABLE_BYTES {
            return Err(Error::corrupt(
                path,
                format!(
                    "L1 table of {} entries or refcount table of {} clusters is too large",
                    h.l1_size, h.refcount_table_clusters
                ),
            ));
        }
        ck.l1 = ck
            .read_l1(h.l1_table_offset, h.l1_size)
            .await
            .map_err(|e| {
                Error::io(
                    path,
                    format!("read the L1 table at {:#x}", h.l1_table_offset),
                    e,
                )
            })?;
        ck.reftable = ck
            .walker()
            .read_reftable(h.refcount_table_offset, h.refcount_table_clusters)
            .await
            .map_err(|e| {
                Error::io(
                    path,
                    format!("read the refcount table at {:#x}", h.refcount_table_offset),
                    walk_io_error(e),
                )
            })?;
        if h.autoclear_features & AUTOCLEAR_BITMAPS != 0 {
            if let Some(b) = c0.bitmaps() {
                ck.bitmaps = Some(BitmapDirectory {
                    offset: b.directory_offset,
                    size: b.directory_size,
                    count: b.nb_bitmaps,
                });
            }
        }
        if h.crypt_method == 2 {
            ck.crypto = c0.extensions.iter().find_map(|e| match e {
                Extension::Crypto { offset, length } => Some((*offset, *length)),
                _ => None,
            });
        }
        Ok(ck)
    }

    // ----- I/O -----

    /// The metadata walker over the image (bytes past the end of the file read as zeros,
    /// as QEMU's block layer returns them).
    pub(super) fn walker(&self) -> Walker<'a, S> {
        Walker::new(self.file, self.layout).zero_fill(true)
    }

    pub(super) fn msg(&mut self, s: String) {
        if self.mute {
            return;
        }
        (self.events)(CheckEvent::Message(&s));
    }

    /// Reads an L1 table of `entries` entries at `offset`, with the entries' positions.
    pub(super) async fn read_l1(
        &self,
        offset: u64,
        entries: u32,
    ) -> std::io::Result<Vec<(u64, RawL1Entry)>> {
        if entries == 0 {
            return Ok(Vec::new());
        }
        self.walker()
            .read_l1(offset, entries)
            .await
            .map_err(walk_io_error)
    }

    /// Reads the L2 table at `offset`, with the entries' positions.
    pub(super) async fn read_l2(&self, offset: u64) -> std::io::Result<L2Table> {
        self.walker().read_l2(offset).await.map_err(walk_io_error)
    }

    /// Reads the refcount block at `offset` as bytes.
    pub(super) async fn read_refblock(&self, offset: u64) -> std::io::Result<Vec<u8>> {
        self.walker()
            .read_refblock(offset)
            .await
            .map_err(storage_io_error)
    }

    /// Reads `len` bytes at `offset` (bounded by the caller: a snapshot ID or name, a
    /// validated bitmap directory).
    pub(super) async fn read_bytes(&self, offset: u64, len: u64) -> std::io::Result<Vec<u8>> {
        if len == 0 {
            return Ok(Vec::new());
        }
        self.walker()
            .read_bytes(offset, len)
            .await
            .map_err(walk_io_error)
    }

    pub(super) async fn write(&mut self, buf: &[u8], off: u64) -> std::io::Result<()> {
        if self.mute {
            return Ok(());
        }
        if !self.writable {
            return Err(std::io::Error::other("the image is open read-only"));
        }
        self.file
            .write_at(buf, off)
            .await
            .map_err(storage_io_error)?;
        self.file_len = self.file_len.max(off + buf.len() as u64);
        Ok(())
    }

    pub(super) async fn sync(&self) -> std::io::Result<()> {
        self.file.flush().await.map_err(storage_io_error)
    }

    pub(super) fn size_to_clusters(&self, bytes: u64) -> u64 {
        bytes.div_ceil(self.cluster_size)
    }

    async fn write_incompatible(&mut self, bits: u64) -> std::result::Result<(), Failure> {
        self.write(&encode_incompatible(bits), field::INCOMPATIBLE_FEATURES)
            .await
            .map_err(|e| io_failure(&e))?;
        self.sync().await.map_err(|e| io_failure(&e))?;
        self.incompatible = bits;
        Ok(())
    }

    async fn clear_incompatible(&mut self, bits: u64) -> std::result::Result<(), Failure> {
        if self.incompatible & bits != 0 {
            self.sync().await.map_err(|e| io_failure(&e))?;
            self.write_incompatible(self.incompatible & !bits).await?;
        }
        Ok(())
    }

    /// A repair writes to the image: first the autoclear bits it does not know are cleared,
    /// as every writer must (QEMU does when it opens the image for the repair).
    pub(super) async fn drop_unknown_autoclear(
        &mut self,
        h: &Header,
    ) -> std::result::Result<(), Failure> {
        let keep = autoclear_for_writer(h.autoclear_features, true);
        if !self.writable || h.version < 3 || keep == h.autoclear_features {
            return Ok(());
        }
        self.write(&encode_autoclear(keep), field::AUTOCLEAR_FEATURES)
            .await
            .map_err(|e| io_failure(&e))?;
        self.sync().await.map_err(|e| io_failure(&e))
    }

    /// Leaves only `keep` in the bitmap directory at `dir_offset` (written in place: it
    /// shrinks), or no bitmaps at all. Crash-safe: the autoclear bit goes first, so that
    /// until the header points at the new directory every reader ignores the bitmaps (QEMU
    /// calls them inconsistent); their clusters leak at worst. In the silent walk only the
    /// state changes.
    pub(super) async fn drop_bitmaps(
        &mut self,
        dir_offset: u64,
        keep: &[BitmapEntry],
    ) -> std::result::Result<(), Failure> {
        let ext = (!keep.is_empty()).then(|| BitmapsExtension {
            nb_bitmaps: keep.len() as u32,
            directory_size: encode_directory(keep).len() as u64,
            directory_offset: dir_offset,
        });
        if !self.mute {
            let fail = |e: std::io::Error| io_failure(&e);
            let mut c0 = self.read_bytes(0, self.cluster_size).await.map_err(fail)?;
            let mut cluster0 = Cluster0::decode(&c0).map_err(|e| Failure(e.to_string()))?;
            let ac = cluster0.header.autoclear_features & !AUTOCLEAR_BITMAPS;
            self.write(&encode_autoclear(ac), field::AUTOCLEAR_FEATURES)
                .await
                .map_err(fail)?;
            self.sync().await.map_err(fail)?;
            if ext.is_some() {
                self.write(&encode_directory(keep), dir_offset)
                    .await
                    .map_err(fail)?;
                self.sync().await.map_err(fail)?;
            }
            cluster0.set_bitmaps(ext);
            c0 = cluster0.encode().map_err(|e| Failure(e.to_string()))?;
            self.write(&c0, 0).await.map_err(fail)?;
            self.sync().await.map_err(fail)?;
        }
        if !self.mute {
            self.bitmaps = ext.map(|e| BitmapDirectory {
                offset: e.directory_offset,
                size: e.directory_size,
                count: e.nb_bitmaps,
            });
        }
        Ok(())
    }

    pub(super) async fn mark_clean_and_consistent(&mut self) -> std::result::Result<(), Failure> {
        self.clear_incompatible(INCOMPAT_DIRTY).await?;
        self.clear_incompatible(INCOMPAT_CORRUPT).await
    }

    /// QEMU's `qcow2_signal_corruption`: fatal events on a writable image set the corrupt bit.
    pub(super) async fn signal_corruption(&mut self, fatal: bool, what: String) {
        let fatal = fatal && self.writable;
        if self.signaled_corruption && (!fatal || self.incompatible & INCOMPAT_CORRUPT != 0) {
            return;
        }
        if fatal {
            self.msg(format!(
                "qcow2: Marking image as corrupt: {what}; further corruption events will be suppressed"
            ));
            let bits = self.incompatible | INCOMPAT_CORRUPT;
            let _ = self.write_incompatible(bits).await;
        } else {
            self.msg(format!(
                "qcow2: Image is corrupt: {what}; further non-fatal corruption events will be suppressed"
            ));
        }
        self.signaled_corruption = true;
    }

    // ----- on-disk refcounts -----

    /// QEMU's `qcow2_get_refcount`.
    pub(super) async fn get_refcount(&mut self, cluster: u64) -> std::result::Result<u64, String> {
        let j = cluster / self.entries;
        let Some(&entry) = self.reftable.get(j as usize) else {
            return Ok(0);
        };
        let block = entry.block_offset();
        if block == 0 {
            return Ok(0);
        }
        if block % self.cluster_size != 0 {
            self.signal_corruption(
                true,
                format!(
                    "Refblock offset {block:#x} unaligned (reftable index: {})",
                    c_hex(j)
                ),
            )
            .await;
            return Err(EIO.into());
        }
        if !self.cache.contains_key(&block) {
            let buf = self.read_refblock(block).await.map_err(|e| strerror(&e))?;
            // A small cache: the walks are mostly sequential.
            if self.cache.len() >= 64 {
                self.cache.clear();
            }
            self.cache.insert(block, buf);
        }
        let data = &self.cache[&block];
        refcount::get(data, self.order, cluster % self.entries).map_err(|e| e.to_string())
    }
}

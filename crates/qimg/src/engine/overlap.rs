//! Metadata overlap checks, as QEMU's default `overlap-check=cached` level does them: before
//! the engine writes anything to the image file (guest data or metadata), the target range is
//! compared with every metadata structure whose place is known without reading the disk: the
//! header, the active L1 table and the L2 tables it points at, the refcount table and its
//! blocks, the snapshot table and each snapshot's L1 table. A write that would land on one of
//! them (other than the structure being written) is refused and the image is marked corrupt,
//! so a corrupt refcount can cost an error but never silently destroys metadata.
//!
//! The index is kept up to date by the code that moves or creates those structures, so a check
//! costs a few `BTreeMap` range lookups. `check` uses the same index for its repairs, with
//! counted inserts (several L1 entries may name one L2 table: a repair that changes one entry
//! must not forget the table) and QEMU's lookup order and names ([`OverlapIndex::first_of`],
//! [`Region::qemu_name`]).
//!
//! Large structures (more than a cluster: L1 tables, the refcount and snapshot tables) are also
//! kept per kind as merged ranges, so a lookup finds whether one meets a range without walking
//! every large structure that starts within the largest one's length before it (thousands of
//! snapshot L1 tables packed into one table's length made every write walk all of them).

use std::collections::BTreeMap;
use std::fmt;

/// A kind of metadata structure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Region {
    Header,
    ActiveL1,
    ActiveL2,
    RefcountTable,
    RefcountBlock,
    SnapshotTable,
    SnapshotL1,
    /// A snapshot's L2 table: never indexed (QEMU's default checks leave them out); named
    /// only as what a `check` repair writes.
    SnapshotL2,
    BitmapDirectory,
}

impl Region {
    /// Every kind, in declaration order.
    const ALL: [Region; 9] = [
        Self::Header,
        Self::ActiveL1,
        Self::ActiveL2,
        Self::RefcountTable,
        Self::RefcountBlock,
        Self::SnapshotTable,
        Self::SnapshotL1,
        Self::SnapshotL2,
        Self::BitmapDirectory,
    ];

    /// The name QEMU's overlap check gives the structure (`check` prints it).
    pub(crate) fn qemu_name(self) -> &'static str {
        match self {
            Self::Header => "qcow2_header",
            Self::ActiveL1 => "active L1 table",
            Self::ActiveL2 => "active L2 table",
            Self::RefcountTable => "refcount table",
            Self::RefcountBlock => "refcount block",
            Self::SnapshotTable => "snapshot table",
            Self::SnapshotL1 => "inactive L1 table",
            Self::SnapshotL2 => "inactive L2 table",
            Self::BitmapDirectory => "bitmap directory",
        }
    }
}

impl fmt::Display for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Header => "the image header",
            Self::ActiveL1 => "the active L1 table",
            Self::ActiveL2 => "an active L2 table",
            Self::RefcountTable => "the refcount table",
            Self::RefcountBlock => "a refcount block",
            Self::SnapshotTable => "the snapshot table",
            Self::SnapshotL1 => "a snapshot's L1 table",
            Self::SnapshotL2 => "a snapshot's L2 table",
            Self::BitmapDirectory => "the bitmap directory",
        })
    }
}

/// What a write is allowed to touch: the structure it updates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Writing {
    /// Guest data, or a structure that is not in the index yet (a new table being written).
    Data,
    /// The structure of this kind starting at this offset.
    Own(Region, u64),
}

/// A found overlap: the metadata structure a write would hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hit {
    pub(crate) region: Region,
    pub(crate) start: u64,
    pub(crate) end: u64,
}

/// Known metadata places. Structures of at most one cluster (L2 tables, refcount blocks, the
/// header) sit in `small`; larger ones (L1 tables, the refcount table, the snapshot table) in
/// `large`, which stays short whatever the image size, and merged per kind in `cover`. Each
/// place maps to its end and the number of times it was inserted.
#[derive(Debug, Default)]
pub(crate) struct OverlapIndex {
    small: BTreeMap<(u64, Region), Place>,
    large: BTreeMap<(u64, Region), Place>,
    /// Per kind, the disjoint ranges `[start, end)` the large structures of that kind cover.
    cover: BTreeMap<(Region, u64), u64>,
    cluster_size: u64,
    largest: u64,
}

/// The end of an indexed structure and how many inserts name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Place {
    end: u64,
    count: u32,
}

impl OverlapIndex {
    pub(crate) fn new(cluster_size: u64) -> Self {
        Self {
            cluster_size,
            ..Self::default()
        }
    }

    /// Records `region` at `[start, start + len)`; empty or unset (offset 0) places are
    /// ignored, except for the header.
    pub(crate) fn insert(&mut self, region: Region, start: u64, len: u64) {
        if len == 0 || (start == 0 && region != Region::Header) {
            return;
        }
        // A second insert at the same place replaces the first (its length too).
        self.remove(region, start);
        self.place(region, start, len, |_| 1);
    }

    /// Records one more user of `region` at `[start, start + len)` (a later
    /// [`remove_one`](Self::remove_one) forgets it only when no user is left). Offset 0 is
    /// recorded too: the caller knows whether it means "unset".
    pub(crate) fn insert_counted(&mut self, region: Region, start: u64, len: u64) {
        if len == 0 {
            return;
        }
        self.place(region, start, len, |n| n.saturating_add(1));
    }

    fn place(&mut self, region: Region, start: u64, len: u64, count: impl Fn(u32) -> u32) {
        let end = start.saturating_add(len);
        let key = (start, region);
        if len <= self.cluster_size {
            let old = self.small.get(&key).map_or(0, |p| p.count);
            let end = self.small.get(&key).map_or(end, |p| p.end.max(end));
            self.small.insert(
                key,
                Place {
                    end,
                    count: count(old),
                },
            );
        } else {
            self.largest = self.largest.max(len);
            let old = self.large.get(&key).copied();
            let end = old.map_or(end, |p| p.end.max(end));
            let n = count(old.map_or(0, |p| p.count));
            self.large.insert(key, Place { end, count: n });
            self.cover_add(region, start, end);
        }
    }

    /// Forgets `region` at `start`.
    pub(crate) fn remove(&mut self, region: Region, start: u64) {
        self.small.remove(&(start, region));
        if self.large.remove(&(start, region)).is_some() {
            self.cover_rebuild_around(region, start);
        }
    }

    /// Forgets one user of `region` at `start` (see [`insert_counted`](Self::insert_counted)).
    pub(crate) fn remove_one(&mut self, region: Region, start: u64) {
        let key = (start, region);
        let place = match self.small.get_mut(&key) {
            Some(p) => Some(p),
            None => self.large.get_mut(&key),
        };
        if let Some(p) = place {
            p.count = p.count.saturating_sub(1);
            if p.count == 0 {
                self.remove(region, start);
            }
        }
    }

    /// Forgets every structure of `region`'s kind (used when a table is replaced wholesale).
    pub(crate) fn remove_all(&mut self, region: Region) {
        self.small.retain(|k, _| k.1 != region);
        self.large.retain(|k, _| k.1 != region);
        self.cover.retain(|k, _| k.0 != region);
    }

    /// Merges `[start, end)` into the ranges `region`'s large structures cover.
    fn cover_add(&mut self, region: Region, start: u64, end: u64) {
        let (mut a, mut b) = (start, end);
        let meeting: Vec<(u64, u64)> = self
            .cover
            .range((region, 0)..=(region, end))
            .rev()
            .take_while(|&(_, &e)| e >= start)
            .map(|(&(_, s), &e)| (s, e))
            .collect();
        for (s, e) in meeting {
            self.cover.remove(&(region, s));
            a = a.min(s);
            b = b.max(e);
        }
        self.cover.insert((region, a), b);
    }

    /// Recomputes the covered range of `region` that held the structure at `start`.
    fn cover_rebuild_around(&mut self, region: Region, start: u64) {
        let Some((&(_, a), &b)) = self.cover.range((region, 0)..=(region, start)).next_back()
        else {
            return;
        };
        self.cover.remove(&(region, a));
        let members: Vec<(u64, u64)> = self
            .large
            .range((a, Region::Header)..(b, Region::Header))
            .filter(|(k, _)| k.1 == region)
            .map(|(&(s, _), p)| (s, p.end))
            .collect();
        for (s, e) in members {
            self.cover_add(region, s, e);
        }
    }

    /// Where the first covered range of any kind meeting `[start, end)` begins: no large
    /// structure starting before it can meet the range.
    fn first_cover_meeting(&self, start: u64, end: u64) -> Option<u64> {
        Region::ALL
            .into_iter()
            .filter_map(|r| self.cover_meeting(r, start, end))
            .min()
    }

    /// The start of the first range `region` covers that meets `[start, end)`.
    fn cover_meeting(&self, region: Region, start: u64, end: u64) -> Option<u64> {
        // The ranges are disjoint and sorted: walking back from the last one starting before
        // `end`, they end earlier and earlier; stop at the first that ends before `start`.
        self.cover
            .range((region, 0)..(region, end))
            .rev()
            .take_while(|&(_, &e)| e > start)
            .last()
            .map(|(&(_, s), _)| s)
    }

    /// The first structure `[start, start + len)` would overlap, apart from `writing`'s own.
    pub(crate) fn find(&self, start: u64, len: u64, writing: Writing) -> Option<Hit> {
        if len == 0 {
            return None;
        }
        let end = start.saturating_add(len);
        let scan = |map: &BTreeMap<(u64, Region), Place>, from: u64| {
            map.range((from, Region::Header)..(end, Region::Header))
                .find(|&(&(s, r), p)| p.end > start && s < end && writing != Writing::Own(r, s))
                .map(|(&(s, r), p)| Hit {
                    region: r,
                    start: s,
                    end: p.end,
                })
        };
        scan(&self.small, start.saturating_sub(self.cluster_size)).or_else(|| {
            let first = self.first_cover_meeting(start, end)?;
            scan(&self.large, start.saturating_sub(self.largest).max(first))
        })
    }

    /// Whether a structure of `region`'s kind meets `[start, start + len)`.
    pub(crate) fn meets(&self, region: Region, start: u64, len: u64) -> bool {
        if len == 0 {
            return false;
        }
        let end = start.saturating_add(len);
        let from = start.saturating_sub(self.cluster_size);
        self.small
            .range((from, Region::Header)..(end, Region::Header))
            .any(|(&(s, r), p)| r == region && p.end > start && s < end)
            || self.cover_meeting(region, start, end).is_some()
    }

    /// The first kind in `order` with a structure meeting `[start, start + len)`, leaving out
    /// `ignore` (QEMU's `qcow2_check_metadata_overlap` checks the kinds in a fixed order and
    /// names the first one hit).
    pub(crate) fn first_of(
        &self,
        order: &[Region],
        ignore: Region,
        start: u64,
        len: u64,
    ) -> Option<Region> {
        order
            .iter()
            .copied()
            .find(|&r| r != ignore && self.meets(r, start, len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_what_a_range_touches_and_ignores_the_structure_being_written() {
        let mut ix = OverlapIndex::new(65536);
        ix.insert(Region::Header, 0, 65536);
        ix.insert(Region::ActiveL1, 0x30000, 3 * 65536);
        ix.insert(Region::ActiveL2, 0x70000, 65536);
        ix.insert(Region::RefcountBlock, 0x20000, 65536);
        assert_eq!(ix.find(0x80000, 4096, Writing::Data), None);
        let hit = ix.find(0x6ffff, 2, Writing::Data).unwrap();
        assert_eq!(hit.region, Region::ActiveL2);
        let hit = ix.find(0x50000, 1, Writing::Data).unwrap();
        assert_eq!(
            (hit.region, hit.start, hit.end),
            (Region::ActiveL1, 0x30000, 0x60000)
        );
        assert_eq!(
            ix.find(0x70000, 512, Writing::Own(Region::ActiveL2, 0x70000)),
            None
        );
        assert_eq!(
            ix.find(0x70000, 512, Writing::Own(Region::RefcountBlock, 0x70000))
                .map(|h| h.region),
            Some(Region::ActiveL2)
        );
        assert_eq!(
            ix.find(100, 8, Writing::Data).map(|h| h.region),
            Some(Region::Header)
        );
        ix.remove(Region::ActiveL2, 0x70000);
        assert_eq!(ix.find(0x70000, 512, Writing::Data), None);
        ix.remove_all(Region::ActiveL1);
        assert_eq!(ix.find(0x50000, 1, Writing::Data), None);
        // Unset places are not metadata.
        ix.insert(Region::ActiveL2, 0, 65536);
        assert_eq!(ix.find(70000, 8, Writing::Data), None);
    }

    #[test]
    fn two_structures_in_one_cluster_are_both_seen() {
        let mut ix = OverlapIndex::new(4096);
        ix.insert(Region::ActiveL2, 0x5000, 4096);
        ix.insert(Region::RefcountBlock, 0x5000, 4096);
        let hit = ix.find(0x5000, 4096, Writing::Own(Region::ActiveL2, 0x5000));
        assert_eq!(hit.map(|h| h.region), Some(Region::RefcountBlock));
    }

    #[test]
    fn counted_inserts_keep_a_table_until_its_last_user_goes() {
        let mut ix = OverlapIndex::new(4096);
        ix.insert_counted(Region::ActiveL2, 0x5000, 4096);
        ix.insert_counted(Region::ActiveL2, 0x5000, 4096);
        ix.remove_one(Region::ActiveL2, 0x5000);
        assert!(ix.meets(Region::ActiveL2, 0x5800, 8));
        ix.remove_one(Region::ActiveL2, 0x5000);
        assert!(!ix.meets(Region::ActiveL2, 0x5800, 8));
        assert_eq!(ix.find(0x5800, 8, Writing::Data), None);
    }

    #[test]
    fn lookups_follow_qemus_order_and_names() {
        let mut ix = OverlapIndex::new(4096);
        ix.insert_counted(Region::ActiveL2, 0x8000, 4096);
        ix.insert_counted(Region::SnapshotL1, 0x8000, 3 * 4096);
        let order = [Region::SnapshotL1, Region::ActiveL2];
        let hit = ix.first_of(&order, Region::SnapshotL2, 0x8000, 8);
        assert_eq!(hit.map(Region::qemu_name), Some("inactive L1 table"));
        let hit = ix.first_of(&order, Region::SnapshotL1, 0x8000, 8);
        assert_eq!(hit.map(Region::qemu_name), Some("active L2 table"));
        assert!(ix.meets(Region::SnapshotL1, 0xa000, 4096));
        assert!(!ix.meets(Region::SnapshotL1, 0xb000, 4096));
    }

    #[test]
    fn packed_large_tables_are_merged_and_removed_one_by_one() {
        let mut ix = OverlapIndex::new(512);
        // Many snapshot L1 tables of 1 KiB packed inside the length of one of 1 MiB.
        ix.insert_counted(Region::SnapshotL1, 0x10_0000, 1 << 20);
        for k in 0..1000u64 {
            ix.insert_counted(Region::SnapshotL1, 0x10_0200 + k * 512, 1024);
        }
        ix.insert_counted(Region::SnapshotL1, 0x40_0000, 1024);
        // A write past all of them meets nothing (and walks none of them).
        assert_eq!(ix.find(0x30_0000, 512, Writing::Data), None);
        assert!(!ix.meets(Region::SnapshotL1, 0x30_0000, 512));
        let hit = ix.find(0x40_0100, 8, Writing::Data).unwrap();
        assert_eq!((hit.region, hit.start), (Region::SnapshotL1, 0x40_0000));
        // Dropping the big table leaves the packed ones.
        ix.remove_one(Region::SnapshotL1, 0x10_0000);
        assert!(!ix.meets(Region::SnapshotL1, 0x10_0000, 8));
        assert!(ix.meets(Region::SnapshotL1, 0x10_0000 + 1001 * 512, 8));
        assert!(!ix.meets(Region::SnapshotL1, 0x10_0000 + 1002 * 512, 8));
        assert!(ix.meets(Region::SnapshotL1, 0x40_0000, 8));
        ix.remove(Region::SnapshotL1, 0x40_0000);
        assert!(!ix.meets(Region::SnapshotL1, 0x40_0000, 8));
    }

    #[test]
    fn a_second_insert_at_one_place_replaces_the_first() {
        let mut ix = OverlapIndex::new(4096);
        ix.insert(Region::ActiveL1, 0x10000, 4 * 4096);
        ix.insert(Region::ActiveL1, 0x10000, 2 * 4096);
        assert_eq!(ix.find(0x13000, 8, Writing::Data), None);
        let hit = ix.find(0x11000, 8, Writing::Data).unwrap();
        assert_eq!((hit.start, hit.end), (0x10000, 0x12000));
    }
}

//! Metadata overlap checks, as QEMU's default `overlap-check=cached` level does them: before
//! the engine writes anything to the image file (guest data or metadata), the target range is
//! compared with every metadata structure whose place is known without reading the disk: the
//! header, the active L1 table and the L2 tables it points at, the refcount table and its
//! blocks, the snapshot table and each snapshot's L1 table. A write that would land on one of
//! them (other than the structure being written) is refused and the image is marked corrupt,
//! so a corrupt refcount can cost an error but never silently destroys metadata.
//!
//! The index is kept up to date by the code that moves or creates those structures, so a check
//! costs two `BTreeMap` range lookups.

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
/// `large`, which stays short whatever the image size.
#[derive(Debug, Default)]
pub(crate) struct OverlapIndex {
    small: BTreeMap<(u64, Region), u64>,
    large: BTreeMap<(u64, Region), u64>,
    cluster_size: u64,
    largest: u64,
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
        let end = start.saturating_add(len);
        if len <= self.cluster_size {
            self.small.insert((start, region), end);
        } else {
            self.largest = self.largest.max(len);
            self.large.insert((start, region), end);
        }
    }

    /// Forgets `region` at `start`.
    pub(crate) fn remove(&mut self, region: Region, start: u64) {
        self.small.remove(&(start, region));
        self.large.remove(&(start, region));
    }

    /// Forgets every structure of `region`'s kind (used when a table is replaced wholesale).
    pub(crate) fn remove_all(&mut self, region: Region) {
        self.small.retain(|k, _| k.1 != region);
        self.large.retain(|k, _| k.1 != region);
    }

    /// The first structure `[start, start + len)` would overlap, apart from `writing`'s own.
    pub(crate) fn find(&self, start: u64, len: u64, writing: Writing) -> Option<Hit> {
        if len == 0 {
            return None;
        }
        let end = start.saturating_add(len);
        let scan = |map: &BTreeMap<(u64, Region), u64>, reach: u64| {
            let from = start.saturating_sub(reach);
            map.range((from, Region::Header)..(end, Region::Header))
                .find(|&(&(s, r), &e)| e > start && s < end && writing != Writing::Own(r, s))
                .map(|(&(s, r), &e)| Hit {
                    region: r,
                    start: s,
                    end: e,
                })
        };
        scan(&self.small, self.cluster_size).or_else(|| scan(&self.large, self.largest))
    }
}

impl OverlapIndex {
    /// The first two known structures that share bytes, if any: an image where that happens
    /// is corrupt (QEMU's check calls such clusters referenced twice).
    pub(crate) fn first_conflict(&self) -> Option<(Hit, Hit)> {
        let mut all: Vec<Hit> = self
            .small
            .iter()
            .chain(self.large.iter())
            .map(|(&(start, region), &end)| Hit { region, start, end })
            .collect();
        all.sort_by_key(|h| (h.start, h.region));
        let mut widest: Option<Hit> = None;
        for h in all {
            if let Some(w) = widest {
                if h.start < w.end {
                    return Some((w, h));
                }
            }
            if widest.is_none_or(|w| h.end > w.end) {
                widest = Some(h);
            }
        }
        None
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
    fn conflicts_between_known_structures_are_found() {
        let mut ix = OverlapIndex::new(4096);
        ix.insert(Region::Header, 0, 4096);
        ix.insert(Region::RefcountTable, 0x1000, 4096);
        ix.insert(Region::RefcountBlock, 0x2000, 4096);
        ix.insert(Region::ActiveL1, 0x3000, 8 * 1024);
        ix.insert(Region::ActiveL2, 0x6000, 4096);
        assert_eq!(ix.first_conflict(), None);
        ix.insert(Region::ActiveL2, 0x4000, 4096);
        let (a, b) = ix.first_conflict().unwrap();
        assert_eq!((a.region, b.region), (Region::ActiveL1, Region::ActiveL2));
    }

    #[test]
    fn two_structures_in_one_cluster_are_both_seen() {
        let mut ix = OverlapIndex::new(4096);
        ix.insert(Region::ActiveL2, 0x5000, 4096);
        ix.insert(Region::RefcountBlock, 0x5000, 4096);
        let hit = ix.find(0x5000, 4096, Writing::Own(Region::ActiveL2, 0x5000));
        assert_eq!(hit.map(|h| h.region), Some(Region::RefcountBlock));
    }
}

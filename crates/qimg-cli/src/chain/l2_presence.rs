//! Which guest ranges of a qcow2 image have no L2 table at all, read from its L1 table so
//! that `map` and `convert` skip them without a lookup per cluster.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use qimg::chain::read_cluster0;
use qimg::format::geometry::Geometry;
use qimg::format::l1::{self, L1_ENTRY_SIZE};
use qimg::format::validate::OpenMode;

/// An image's L1 table reduced to what a walk needs: whether each entry has an L2 table.
pub(crate) struct L2Presence {
    /// Guest bytes one L1 entry covers.
    span: u64,
    /// Per L1 entry: whether it points at an L2 table.
    has_table: Vec<bool>,
}

impl L2Presence {
    /// Reads and decodes the L1 table of the qcow2 image at `path`; `None` if it cannot be
    /// read or does not decode (every range is then looked up through the engine, which
    /// reports what is wrong).
    pub(super) fn read(path: &Path) -> Option<Self> {
        let c0 = read_cluster0(path, OpenMode::ReadOnly).ok()?;
        let header = &c0.header;
        let geometry = Geometry::new(header.cluster_bits, header.extended_l2()).ok()?;
        let file = File::open(path).ok()?;
        let mut raw = vec![
            0u8;
            usize::try_from(header.l1_size)
                .ok()?
                .checked_mul(L1_ENTRY_SIZE)?
        ];
        file.read_exact_at(&mut raw, header.l1_table_offset).ok()?;
        let entries =
            l1::decode_table(&raw, geometry.cluster_size(), header.l1_table_offset).ok()?;
        Some(Self {
            span: geometry.l2_coverage(),
            has_table: entries.iter().map(|e| e.l2_offset.is_some()).collect(),
        })
    }

    /// Splits `[start, end)` at entry boundaries into (start, end, has_table) runs, adjacent
    /// runs without a table merged. Ranges past the table count as having one (the engine
    /// decides what they are).
    pub(super) fn runs(&self, start: u64, end: u64) -> Vec<(u64, u64, bool)> {
        let mut out: Vec<(u64, u64, bool)> = Vec::new();
        let mut at = start;
        while at < end {
            let index = at / self.span;
            let entry_end = ((index + 1) * self.span).min(end);
            let has = self
                .has_table
                .get(usize::try_from(index).unwrap_or(usize::MAX))
                .is_none_or(|&t| t);
            match out.last_mut() {
                Some(last) if !has && !last.2 => last.1 = entry_end,
                _ => out.push((at, entry_end, has)),
            }
            at = entry_end;
        }
        out
    }
}

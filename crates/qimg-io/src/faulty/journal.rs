//! The journal of writes not yet flushed, and the image a power cut leaves of it.

use super::*;

use crate::mem::MemStorage;

/// Granularity at which [`FaultyStorage::new`] skips all-zero data (the chunk size of
/// [`MemStorage`]), so sparse images stay sparse in memory.
pub(super) const SPARSE_PIECE: usize = 64 * 1024;

/// A completed modification, as the journal and the durable image see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Change {
    /// Bytes written at an offset (growing the length if past the end).
    Write { offset: u64, data: Vec<u8> },
    /// A range zeroed; `grow` when it also extends the length to its end (`write_zeroes`,
    /// unlike `discard`).
    Zero { offset: u64, len: u64, grow: bool },
    /// The length grown to at least `end` (`allocate`).
    Grow { end: u64 },
    /// The length set.
    SetLen { len: u64 },
}

impl Change {
    /// Bytes of memory the journal holds for this change.
    pub(super) fn bytes(&self) -> u64 {
        match self {
            Change::Write { data, .. } => data.len() as u64,
            _ => 0,
        }
    }

    pub(super) fn apply(&self, image: &MemStorage) {
        match self {
            Change::Write { offset, data } => image.apply_write(data, *offset),
            Change::Zero { offset, len, grow } => {
                image.apply_zero(*offset, *len);
                if *grow {
                    image.apply_grow(offset + len);
                }
            }
            Change::Grow { end } => image.apply_grow(*end),
            Change::SetLen { len } => image.apply_set_len(*len),
        }
    }
}

/// splitmix64: small, fast, deterministic.
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform enough in `0..n` for `n` far below 2^64 (`n` > 0).
    pub(super) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A piece of the journal that survives a random crash: a whole change, or sectors of a write.
pub(super) enum Piece<'a> {
    Whole(&'a Change),
    Bytes(u64, &'a [u8]),
}

/// Builds a post-crash image from the durable image and the journal.
pub(super) fn image(state: &State, policy: CrashPolicy) -> MemStorage {
    let img = state.durable.copy_contents();
    let journal = state.journal.iter().map(|(_, c)| c);
    match policy {
        CrashPolicy::DropUnflushed => {}
        CrashPolicy::KeepAll => journal.for_each(|c| c.apply(&img)),
        CrashPolicy::KeepFirst(n) => journal.take(n).for_each(|c| c.apply(&img)),
        CrashPolicy::Random { seed } => {
            let mut rng = Rng(seed);
            let mut kept = Vec::new();
            for c in journal {
                match (rng.below(3), c) {
                    (0, _) => {}
                    (2, Change::Write { offset, data }) => {
                        let mut at = 0usize;
                        while at < data.len() {
                            let pos = offset + at as u64;
                            let to_boundary = CRASH_SECTOR - pos % CRASH_SECTOR;
                            let n = (data.len() - at).min(to_boundary as usize);
                            if rng.below(2) == 0 {
                                kept.push(Piece::Bytes(pos, &data[at..at + n]));
                            }
                            at += n;
                        }
                    }
                    _ => kept.push(Piece::Whole(c)),
                }
            }
            for i in (1..kept.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                kept.swap(i, j);
            }
            for p in kept {
                match p {
                    Piece::Whole(c) => c.apply(&img),
                    Piece::Bytes(offset, data) => img.apply_write(data, offset),
                }
            }
        }
    }
    img
}

//! Subcluster bitmaps, subcluster states and 128-bit extended L2 entries (spec §4).

use super::{L2Context, L2Entry, decode_word};
use crate::error::{FormatError, Result};
use crate::units::SubclusterIndex;

/// The 64-bit subcluster bitmap of an extended L2 entry: allocation bit `x` is bit `x` of
/// [`alloc`](Self::alloc) (word bits 0..=31), zero bit `x` is bit `x` of [`zero`](Self::zero)
/// (word bits 32..=63).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SubclusterBitmap {
    /// Allocation bits: subcluster `x` has data at the cluster's host offset.
    pub alloc: u32,
    /// Zero bits: subcluster `x` reads as zeros.
    pub zero: u32,
}

/// The two bitmap bits of one subcluster, before they are interpreted against the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SubclusterBits {
    /// Neither bit set.
    Neither,
    /// Only the allocation bit set.
    Alloc,
    /// Only the zero bit set.
    Zero,
    /// Both set (always invalid).
    Both,
}

impl SubclusterBitmap {
    /// No bit set.
    pub const EMPTY: Self = Self { alloc: 0, zero: 0 };

    /// Splits the bitmap word (alloc = low 32 bits, zero = high 32 bits).
    pub fn from_word(word: u64) -> Self {
        Self {
            alloc: word as u32,
            zero: (word >> 32) as u32,
        }
    }

    /// The bitmap word.
    pub fn to_word(self) -> u64 {
        (u64::from(self.zero) << 32) | u64::from(self.alloc)
    }

    /// Mask of subclusters `first .. first + count`, clipped at 32.
    pub fn range_mask(first: SubclusterIndex, count: u32) -> u32 {
        let start = first.bit();
        let end = (u64::from(start) + u64::from(count)).min(32);
        ((1u64 << end) - (1u64 << start)) as u32
    }

    /// Whether the allocation bit of `sc` is set.
    pub fn is_allocated(self, sc: SubclusterIndex) -> bool {
        self.alloc >> sc.bit() & 1 == 1
    }

    /// Whether the zero bit of `sc` is set.
    pub fn is_zero(self, sc: SubclusterIndex) -> bool {
        self.zero >> sc.bit() & 1 == 1
    }

    /// Both bits of `sc`.
    pub fn bits(self, sc: SubclusterIndex) -> SubclusterBits {
        match (self.is_allocated(sc), self.is_zero(sc)) {
            (false, false) => SubclusterBits::Neither,
            (true, false) => SubclusterBits::Alloc,
            (false, true) => SubclusterBits::Zero,
            (true, true) => SubclusterBits::Both,
        }
    }

    /// Marks `mask` allocated (data written): sets their allocation bits, clears zero bits.
    pub fn with_allocated(self, mask: u32) -> Self {
        Self {
            alloc: self.alloc | mask,
            zero: self.zero & !mask,
        }
    }

    /// Marks `mask` as reading zeros: sets their zero bits, clears allocation bits.
    pub fn with_zero(self, mask: u32) -> Self {
        Self {
            alloc: self.alloc & !mask,
            zero: self.zero | mask,
        }
    }

    /// Marks `mask` unallocated (reads from backing): clears both bits.
    pub fn with_unallocated(self, mask: u32) -> Self {
        Self {
            alloc: self.alloc & !mask,
            zero: self.zero & !mask,
        }
    }

    /// Maximal runs of subclusters with equal bits, as `(first, count, bits)`, covering all 32.
    pub fn runs(self) -> BitmapRuns {
        BitmapRuns {
            bitmap: self,
            next: 0,
            end: SubclusterIndex::COUNT,
        }
    }
}

/// Iterator over maximal runs of equal bits, from [`SubclusterBitmap::runs`].
#[derive(Debug, Clone)]
pub struct BitmapRuns {
    bitmap: SubclusterBitmap,
    next: u32,
    end: u32,
}

impl Iterator for BitmapRuns {
    type Item = (SubclusterIndex, u32, SubclusterBits);

    fn next(&mut self) -> Option<Self::Item> {
        if self.next >= self.end {
            return None;
        }
        let start = self.next;
        let SubclusterBitmap { alloc, zero } = self.bitmap;
        // Bits that differ from those of `start`; the run ends at the first one.
        let a = if alloc >> start & 1 == 1 {
            !alloc
        } else {
            alloc
        };
        let z = if zero >> start & 1 == 1 { !zero } else { zero };
        let len = ((a | z) >> start).trailing_zeros().min(self.end - start);
        self.next = start + len;
        let sc = SubclusterIndex(start);
        Some((sc, len, self.bitmap.bits(sc)))
    }
}

/// What a subcluster is, exactly QEMU's subcluster types minus "invalid" (invalid entries are
/// rejected when decoded). A standard cluster is a single subcluster with one of these states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SubclusterState {
    /// Data at the cluster's host offset plus the offset in the cluster.
    Normal,
    /// Reads as zeros; the cluster has host space.
    ZeroAlloc,
    /// Reads as zeros; the cluster has no host space.
    ZeroPlain,
    /// Reads from the backing file (or zeros); the cluster has host space reserved.
    UnallocatedAlloc,
    /// Reads from the backing file (or zeros); the cluster has no host space.
    UnallocatedPlain,
    /// Part of a compressed cluster: decompress the whole cluster and take the slice.
    Compressed,
}

impl SubclusterState {
    /// Reads as zeros without touching any file.
    pub fn reads_zeros(self) -> bool {
        matches!(self, Self::ZeroAlloc | Self::ZeroPlain)
    }

    /// Reads from the backing file, or zeros without one.
    pub fn reads_backing(self) -> bool {
        matches!(self, Self::UnallocatedAlloc | Self::UnallocatedPlain)
    }

    /// The cluster owns a host cluster at its L2 entry's offset (compressed data excluded).
    pub fn has_host_cluster(self) -> bool {
        matches!(
            self,
            Self::Normal | Self::ZeroAlloc | Self::UnallocatedAlloc
        )
    }
}

/// How a cluster turns bitmap bits into states.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mapping {
    /// Every subcluster has this state whatever its bits.
    Fixed(SubclusterState),
    /// Unallocated cluster: zero bits give `ZeroPlain`, the rest `UnallocatedPlain`.
    Unallocated,
    /// Allocated cluster: zero bits win, then allocation bits, else `UnallocatedAlloc`.
    Allocated,
}

impl Mapping {
    fn state(self, bits: SubclusterBits) -> SubclusterState {
        use SubclusterBits as B;
        match (self, bits) {
            (Self::Fixed(s), _) => s,
            (Self::Unallocated, B::Zero | B::Both) => SubclusterState::ZeroPlain,
            (Self::Unallocated, _) => SubclusterState::UnallocatedPlain,
            (Self::Allocated, B::Zero | B::Both) => SubclusterState::ZeroAlloc,
            (Self::Allocated, B::Alloc) => SubclusterState::Normal,
            (Self::Allocated, B::Neither) => SubclusterState::UnallocatedAlloc,
        }
    }
}

/// Iterator over maximal runs `(first, count, state)` of one entry's subclusters. For a standard
/// entry it yields one run of one subcluster; for an extended entry runs covering all 32.
#[derive(Debug, Clone)]
pub struct StateRuns {
    bits: BitmapRuns,
    mapping: Mapping,
    pending: Option<(SubclusterIndex, u32, SubclusterState)>,
}

impl StateRuns {
    pub(super) fn single(state: SubclusterState) -> Self {
        let bits = BitmapRuns {
            bitmap: SubclusterBitmap::EMPTY,
            next: 0,
            end: 1,
        };
        Self {
            bits,
            mapping: Mapping::Fixed(state),
            pending: None,
        }
    }

    fn pull(&mut self) -> Option<(SubclusterIndex, u32, SubclusterState)> {
        let mapping = self.mapping;
        self.bits
            .next()
            .map(|(sc, n, bits)| (sc, n, mapping.state(bits)))
    }
}

impl Iterator for StateRuns {
    type Item = (SubclusterIndex, u32, SubclusterState);

    fn next(&mut self) -> Option<Self::Item> {
        let (first, mut count, state) = self.pending.take().or_else(|| self.pull())?;
        while let Some(run) = self.pull() {
            if run.2 == state {
                count += run.1;
            } else {
                self.pending = Some(run);
                break;
            }
        }
        Some((first, count, state))
    }
}

/// A 128-bit L2 entry of an image with extended L2 entries: the cluster entry and its bitmap.
///
/// [`decode`](Self::decode) accepts only valid combinations; a value built by hand can be
/// checked with [`validate`](Self::validate). Even an invalid value never makes
/// [`state`](Self::state) panic: zero bits win over allocation bits, as in QEMU's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExtendedL2Entry {
    /// The cluster part (first word). Never [`L2Entry::Zero`] when valid.
    pub entry: L2Entry,
    /// The subcluster bitmap (second word).
    pub bitmap: SubclusterBitmap,
}

impl ExtendedL2Entry {
    /// Decodes the two words of an extended entry read at file offset `at`. Bit 0 of the first
    /// word is ignored, as QEMU does. Every combination §4.1 calls invalid is rejected with
    /// [`FormatError::InvalidSubclusterBitmap`], but for the reserved bitmap of a compressed
    /// cluster: QEMU reads such a cluster whatever its bitmap holds (`check` reports it), so
    /// it is read as zero here too.
    pub fn decode(word: u64, bitmap: u64, ctx: &L2Context, at: u64) -> Result<Self> {
        let entry = decode_word(word, ctx, true, at)?;
        if let L2Entry::Compressed(_) = entry {
            return Ok(Self {
                entry,
                bitmap: SubclusterBitmap::EMPTY,
            });
        }
        let decoded = Self {
            entry,
            bitmap: SubclusterBitmap::from_word(bitmap),
        };
        decoded.check(word, bitmap, at)?;
        Ok(decoded)
    }

    /// Checks a (possibly hand-built) entry against §4.1; `at` is used in the error.
    pub fn validate(&self, at: u64) -> Result<()> {
        let [word, bitmap] = self.encode();
        self.check(word, bitmap, at)
    }

    fn check(&self, word: u64, bitmap: u64, at: u64) -> Result<()> {
        let bm = self.bitmap;
        let reason = match self.entry {
            L2Entry::Compressed(_) if bitmap != 0 => "compressed cluster with a non-zero bitmap",
            L2Entry::Normal { .. } if bm.alloc & bm.zero != 0 => {
                "allocation and zero bit set for the same subcluster"
            }
            L2Entry::Unallocated if bm.alloc != 0 => {
                "allocation bits set on an unallocated cluster"
            }
            L2Entry::Zero { .. } => "zero flag in an extended L2 entry",
            _ => return Ok(()),
        };
        Err(FormatError::InvalidSubclusterBitmap {
            offset: at,
            entry: word,
            bitmap,
            reason,
        })
    }

    /// The two words, first the cluster entry, then the bitmap.
    pub fn encode(&self) -> [u64; 2] {
        [self.entry.encode(), self.bitmap.to_word()]
    }

    fn mapping(&self) -> Mapping {
        match self.entry {
            L2Entry::Unallocated => Mapping::Unallocated,
            L2Entry::Normal { .. } => Mapping::Allocated,
            other => Mapping::Fixed(other.cluster_state()),
        }
    }

    /// The state of subcluster `sc` (QEMU's `qcow2_get_subcluster_type`).
    pub fn state(&self, sc: SubclusterIndex) -> SubclusterState {
        self.mapping().state(self.bitmap.bits(sc))
    }

    /// Maximal runs `(first, count, state)` over the 32 subclusters.
    pub fn runs(&self) -> StateRuns {
        StateRuns {
            bits: self.bitmap.runs(),
            mapping: self.mapping(),
            pending: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn alloc_is_the_low_word_and_zero_the_high_word() {
        let b = SubclusterBitmap::from_word(0xFFFF_FFFF_0000_0000);
        assert_eq!(
            b,
            SubclusterBitmap {
                alloc: 0,
                zero: u32::MAX
            }
        );
        let b = SubclusterBitmap::from_word(0x0000_0000_FFFF_FFFF);
        assert_eq!(
            b,
            SubclusterBitmap {
                alloc: u32::MAX,
                zero: 0
            }
        );
        assert!(SubclusterBitmap::from_word(1 << 32).is_zero(SubclusterIndex(0)));
        assert!(SubclusterBitmap::from_word(1 << 31).is_allocated(SubclusterIndex(31)));
    }

    #[test]
    fn range_masks_match_the_spec_formula() {
        // ALLOC_RANGE [a, b) = (1 << b) - (1 << a)
        assert_eq!(SubclusterBitmap::range_mask(SubclusterIndex(4), 4), 0xF0);
        assert_eq!(
            SubclusterBitmap::range_mask(SubclusterIndex(0), 32),
            u32::MAX
        );
        assert_eq!(
            SubclusterBitmap::range_mask(SubclusterIndex(31), 1),
            1 << 31
        );
        assert_eq!(
            SubclusterBitmap::range_mask(SubclusterIndex(30), 10),
            0xC000_0000
        );
        assert_eq!(SubclusterBitmap::range_mask(SubclusterIndex(3), 0), 0);
    }

    #[test]
    fn writing_zeroing_and_discarding_flip_only_their_subclusters() {
        let m = SubclusterBitmap::range_mask(SubclusterIndex(2), 2);
        let b = SubclusterBitmap::EMPTY
            .with_zero(u32::MAX)
            .with_allocated(m);
        assert_eq!(
            b,
            SubclusterBitmap {
                alloc: 0b1100,
                zero: !0b1100
            }
        );
        let b = b.with_unallocated(SubclusterBitmap::range_mask(SubclusterIndex(3), 2));
        assert_eq!(
            b,
            SubclusterBitmap {
                alloc: 0b0100,
                zero: !0b11100
            }
        );
    }

    #[test]
    fn an_empty_bitmap_is_one_run_of_32() {
        let runs: Vec<_> = SubclusterBitmap::EMPTY.runs().collect();
        assert_eq!(
            runs,
            vec![(SubclusterIndex(0), 32, SubclusterBits::Neither)]
        );
    }

    #[test]
    fn bitmap_runs_split_where_either_bit_changes() {
        let b = SubclusterBitmap {
            alloc: 0b0011,
            zero: 0b0110 | (1 << 31),
        };
        let runs: Vec<_> = b.runs().collect();
        assert_eq!(
            runs,
            vec![
                (SubclusterIndex(0), 1, SubclusterBits::Alloc),
                (SubclusterIndex(1), 1, SubclusterBits::Both),
                (SubclusterIndex(2), 1, SubclusterBits::Zero),
                (SubclusterIndex(3), 28, SubclusterBits::Neither),
                (SubclusterIndex(31), 1, SubclusterBits::Zero),
            ]
        );
    }

    #[test]
    fn states_say_where_reads_go() {
        use SubclusterState as S;
        assert!(S::ZeroAlloc.reads_zeros() && S::ZeroPlain.reads_zeros());
        assert!(S::UnallocatedAlloc.reads_backing() && S::UnallocatedPlain.reads_backing());
        assert!(!S::Normal.reads_zeros() && !S::Compressed.reads_backing());
        assert!(S::UnallocatedAlloc.has_host_cluster() && !S::ZeroPlain.has_host_cluster());
        assert!(!S::Compressed.has_host_cluster());
    }

    proptest! {
        #[test]
        fn bitmap_words_round_trip(word in any::<u64>()) {
            prop_assert_eq!(SubclusterBitmap::from_word(word).to_word(), word);
        }

        #[test]
        fn bitmaps_round_trip(alloc in any::<u32>(), zero in any::<u32>()) {
            let b = SubclusterBitmap { alloc, zero };
            prop_assert_eq!(SubclusterBitmap::from_word(b.to_word()), b);
        }

        #[test]
        fn bitmap_runs_are_maximal_and_cover_all_32(word in any::<u64>()) {
            let b = SubclusterBitmap::from_word(word);
            let mut next = 0;
            let mut prev = None;
            for (first, count, bits) in b.runs() {
                prop_assert_eq!(first.0, next);
                for sc in first.0..first.0 + count {
                    prop_assert_eq!(b.bits(SubclusterIndex(sc)), bits);
                }
                prop_assert_ne!(prev, Some(bits));
                prev = Some(bits);
                next += count;
            }
            prop_assert_eq!(next, 32);
        }

        #[test]
        fn range_mask_has_exactly_the_requested_bits(first in 0u32..32, count in 0u32..40) {
            let m = SubclusterBitmap::range_mask(SubclusterIndex(first), count);
            for sc in 0..32 {
                prop_assert_eq!(m >> sc & 1 == 1, sc >= first && sc < first + count);
            }
        }
    }
}

//! Planning from cached metadata, shared by both executors (the engine's `rw`, a queue's
//! direct path) and by [`Image::map`](crate::Image::map): what the bytes of one guest cluster
//! read as, run by run, from `qimg-format`'s subcluster runs.
//!
//! Every reader of a cluster walks its bytes here: the engine's read
//! (`rw/read.rs::read_entry_range`, and whether a piece is plain data), a queue's direct read
//! plan (`queue/fast.rs::plan_direct_read`), and the map. The write side's table (what a
//! write copies, where it lands) is `rw/cow.rs::plan_write`, which both executors call too.

use qimg_format::l2::{AnyL2Entry, SubclusterState};

/// Bytes `[start, end)` of one guest cluster, all in one subcluster state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StateRun {
    /// First byte, from the start of the cluster.
    pub(crate) start: usize,
    /// One past the last byte.
    pub(crate) end: usize,
    /// What these bytes read as.
    pub(crate) state: SubclusterState,
}

/// The runs of bytes `[a, b)` of a cluster described by `entry` (subclusters of `scs` bytes:
/// the cluster size for standard entries), one per maximal run of one state, in order; they
/// cover `[a, b)` exactly.
pub(crate) fn state_runs(
    entry: &AnyL2Entry,
    scs: usize,
    a: usize,
    b: usize,
) -> impl Iterator<Item = StateRun> {
    entry.runs().filter_map(move |(first, count, state)| {
        let start = (first.0 as usize * scs).max(a);
        let end = ((first.0 + count) as usize * scs).min(b);
        (start < end).then_some(StateRun { start, end, state })
    })
}

/// Where bytes `[a, b)` of a cluster described by `entry` are in the file, when they are all
/// plain data (every subcluster they touch allocated with data).
pub(crate) fn plain_host(entry: &AnyL2Entry, scs: usize, a: usize, b: usize) -> Option<u64> {
    let host = entry.entry().host_cluster()?.0;
    state_runs(entry, scs, a, b)
        .all(|r| r.state == SubclusterState::Normal)
        .then_some(host + a as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use qimg_format::l2::{ExtendedL2Entry, L2Entry, SubclusterBitmap};
    use qimg_format::units::{HostOffset, SubclusterIndex};

    /// The runs agree with the entry's state of every byte, cover `[a, b)` once, and never
    /// split one state.
    fn check(entry: &AnyL2Entry, scs: usize, a: usize, b: usize) {
        let runs: Vec<_> = state_runs(entry, scs, a, b).collect();
        let mut at = a;
        for (i, r) in runs.iter().enumerate() {
            assert_eq!(r.start, at, "{runs:?}");
            assert!(r.start < r.end, "{runs:?}");
            for byte in r.start..r.end {
                assert_eq!(entry.state(SubclusterIndex((byte / scs) as u32)), r.state);
            }
            if i > 0 {
                assert_ne!(runs[i - 1].state, r.state, "{runs:?}");
            }
            at = r.end;
        }
        assert_eq!(at, b.max(a), "{runs:?}");
    }

    #[test]
    fn runs_cover_the_range_in_the_entrys_states() {
        let cs = 64 << 10;
        let scs = cs / 32;
        let normal = L2Entry::Normal {
            host: HostOffset(1 << 20),
            copied: true,
        };
        for (entry, alloc, zero) in [
            (normal, 0u32, 0u32),
            (normal, u32::MAX, 0),
            (normal, 0x0000_ffff, 0xff00_0000),
            (normal, 0x5555_5555, 0x0a0a_0a0a),
            (normal, 0x8000_0001, 0x0000_0006),
            (L2Entry::Unallocated, 0, 0x00ff_00f0),
        ] {
            let entry = AnyL2Entry::Extended(ExtendedL2Entry {
                entry,
                bitmap: SubclusterBitmap { alloc, zero },
            });
            for (a, b) in [
                (0, cs),
                (1, cs - 1),
                (scs - 1, scs + 1),
                (5 * scs, 5 * scs),
                (7, 3 * scs + 9),
            ] {
                check(&entry, scs, a, b);
            }
        }
        let standard = AnyL2Entry::Standard(normal);
        check(&standard, cs, 100, cs - 100);
        assert_eq!(plain_host(&standard, cs, 100, 200), Some((1 << 20) + 100));
        let partly = AnyL2Entry::Extended(ExtendedL2Entry {
            entry: normal,
            bitmap: SubclusterBitmap {
                alloc: 0b01,
                zero: 0,
            },
        });
        assert_eq!(plain_host(&partly, scs, 0, scs), Some(1 << 20));
        assert_eq!(plain_host(&partly, scs, 0, scs + 1), None);
    }
}

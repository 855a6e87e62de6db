//! The read planner, shared by both executors (the engine's `rw`, a queue's direct path) and
//! by [`Image::map`](crate::Image::map): what each byte of a request reads as (this image's
//! data at a host offset, zeros, the backing chain, a compressed cluster), decided from the
//! clusters' L2 entries by `qimg-format`'s subcluster runs, without I/O.
//!
//! [`plan_read`] plans a request from the entries its caller has at hand (the metadata cache,
//! under the metadata lock) and stops at the first cluster whose entry it lacks; the caller
//! gets that entry with I/O (the engine's `lookup_for_read`), plans the piece with
//! [`piece_parts`] and resumes. A queue's direct path, which does no metadata I/O, sends the
//! request to its engine instead, as it does when a part needs a backing read or inflating.
//! Copy-on-write reads its sources through the same parts (`rw/cow.rs::cow_sources`); the
//! write side's table (what a write copies, where it lands) is `rw/cow.rs::plan_write`, which
//! both executors call too.

use qimg_format::compressed::CompressedDescriptor;
use qimg_format::l2::{AnyL2Entry, L2Entry, SubclusterBitmap, SubclusterState};
use qimg_io::Storage;

use crate::engine::image::Inner;

/// Something a rewrite leaves without a reference.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Freed {
    Cluster(u64),
    Compressed(CompressedDescriptor),
}

/// Where the bytes of a write go: the cluster the entry names, or a new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Destination {
    /// The existing host cluster (COPIED), at this offset.
    InPlace(u64),
    /// A new host cluster.
    New,
}

/// A write to one guest cluster between allocation and linking.
#[derive(Debug, Clone)]
pub(crate) struct PreparedWrite {
    pub(super) gc: u64,
    pub(super) a: usize,
    pub(super) b: usize,
    pub(super) old: AnyL2Entry,
    pub(super) plan: WritePlan,
    /// Host offset of the cluster the data goes to (the guest offset with a data file).
    pub(crate) host: u64,
    pub(super) fresh: bool,
}

impl PreparedWrite {
    /// Where the guest bytes `[a, b)` go in the host file.
    pub(crate) fn guest_span(&self) -> (u64, u64, u64) {
        (
            self.gc + self.a as u64,
            self.host + self.a as u64,
            (self.b - self.a) as u64,
        )
    }
}

/// What one write does to one cluster.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WritePlan {
    pub(crate) target: Destination,
    /// Cluster-relative range written to the target (the guest range plus copy-on-write).
    pub(crate) start: usize,
    pub(crate) end: usize,
    /// The subcluster bitmap after the write (extended entries), or `None` for standard ones.
    pub(super) bitmap: Option<SubclusterBitmap>,
    /// Whether the L2 entry changes.
    pub(crate) relink: bool,
    pub(crate) freed: Option<Freed>,
}

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

/// A piece of a request inside one guest cluster: `(cluster start, offset in the cluster,
/// length, position in the request)`, as `Inner::pieces` splits a range.
pub(crate) type Piece = (u64, usize, usize, usize);

/// What bytes of a read plan read as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReadSource {
    /// This image's data at this host offset (in the external data file when there is one).
    Data(u64),
    /// Zeros. `reserved`: host space kept for them (a preallocated zero cluster or zero
    /// subcluster of an allocated cluster), if any.
    Zero {
        /// Host offset of the reserved space.
        reserved: Option<u64>,
    },
    /// Not allocated in this image: the backing chain from guest offset `guest` (zeros
    /// without one). `reserved` as for [`Zero`](Self::Zero).
    Backing {
        /// Guest offset of the first byte.
        guest: u64,
        /// Host offset of the reserved space.
        reserved: Option<u64>,
    },
    /// Bytes from `within` of the cluster at guest offset `gc`, stored compressed.
    Compressed {
        /// The cluster's descriptor.
        descriptor: CompressedDescriptor,
        /// Guest offset of the cluster.
        gc: u64,
        /// Offset of the first byte in the inflated cluster.
        within: usize,
    },
}

/// One part of a read plan: bytes `[pos, pos + len)` of the request read as `source`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReadPart {
    /// Position in the request.
    pub(crate) pos: usize,
    /// Length in bytes.
    pub(crate) len: usize,
    /// What they read as.
    pub(crate) source: ReadSource,
}

/// The read plan of one piece whose cluster `entry` describes: one part per run of one
/// subcluster state, in order, covering the piece exactly.
pub(crate) fn piece_parts(
    entry: &AnyL2Entry,
    scs: usize,
    (gc, a, n, pos): Piece,
) -> impl Iterator<Item = ReadPart> + '_ {
    let cluster = entry.entry().host_cluster().map(|h| h.0);
    state_runs(entry, scs, a, a + n).map(move |run| {
        let host = cluster.map(|h| h + run.start as u64);
        let backing = ReadSource::Backing {
            guest: gc + run.start as u64,
            reserved: None,
        };
        let source = match run.state {
            SubclusterState::Normal => host.map_or(backing, ReadSource::Data),
            SubclusterState::ZeroAlloc => ReadSource::Zero { reserved: host },
            SubclusterState::ZeroPlain => ReadSource::Zero { reserved: None },
            SubclusterState::UnallocatedAlloc => ReadSource::Backing {
                guest: gc + run.start as u64,
                reserved: host,
            },
            SubclusterState::UnallocatedPlain => backing,
            SubclusterState::Compressed => match *entry.entry() {
                L2Entry::Compressed(descriptor) => ReadSource::Compressed {
                    descriptor,
                    gc,
                    within: run.start,
                },
                // Only a compressed entry has compressed runs.
                _ => backing,
            },
        };
        ReadPart {
            pos: pos + (run.start - a),
            len: run.end - run.start,
            source,
        }
    })
}

/// How [`plan_read`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Planned {
    /// Every piece is planned.
    Done,
    /// The entry of this piece's cluster is not at hand: the pieces before it are planned,
    /// the ones after it are left in the iterator.
    Lacks(Piece),
    /// The caller's `emit` refused a part (it cannot execute it).
    Refused,
}

/// Plans a read of `pieces` in order: each piece's parts (see [`piece_parts`]) go to `emit`,
/// from the entry `entry_of` gives for its cluster. Stops at the first piece whose entry
/// `entry_of` does not have ([`Planned::Lacks`]), or when `emit` returns `false`
/// ([`Planned::Refused`]).
pub(crate) fn plan_read(
    pieces: &mut impl Iterator<Item = Piece>,
    scs: usize,
    mut entry_of: impl FnMut(u64) -> Option<AnyL2Entry>,
    mut emit: impl FnMut(ReadPart) -> bool,
) -> Planned {
    for piece in pieces {
        let Some(entry) = entry_of(piece.0) else {
            return Planned::Lacks(piece);
        };
        for part in piece_parts(&entry, scs, piece) {
            if !emit(part) {
                return Planned::Refused;
            }
        }
    }
    Planned::Done
}

impl<S: Storage> Inner<S> {
    /// The write planner: for each piece in order, the entry of its cluster (from `entry_of`)
    /// and the write's table ([`prepare_piece`](Self::prepare_piece)), appended to `out`.
    /// Stops at the first piece whose entry `entry_of` lacks ([`Planned::Lacks`]; the caller
    /// looks it up with I/O, prepares it and resumes). Nothing is allocated: the engine
    /// allocates the new clusters with I/O (`rw/write.rs::prepare_chunks`), a queue's direct
    /// path from cached refcounts (`queue/fast.rs::plan_direct_write`).
    pub(crate) fn plan_writes(
        &self,
        pieces: &mut impl Iterator<Item = Piece>,
        mut entry_of: impl FnMut(u64) -> Option<AnyL2Entry>,
        out: &mut Vec<PreparedWrite>,
    ) -> Planned {
        for piece in pieces {
            let Some(old) = entry_of(piece.0) else {
                return Planned::Lacks(piece);
            };
            out.push(self.prepare_piece(old, piece));
        }
        Planned::Done
    }

    /// A write of one piece into the cluster `old` describes: what it copies and where it
    /// lands ([`plan_write`](Self::plan_write)); a new cluster is still to allocate (`fresh`,
    /// host 0), except with an external data file, where the host offset is the guest one.
    pub(crate) fn prepare_piece(&self, old: AnyL2Entry, (gc, a, n, _): Piece) -> PreparedWrite {
        let plan = self.plan_write(&old, a, a + n);
        let (host, fresh) = match plan.target {
            Destination::InPlace(h) => (h, false),
            Destination::New if self.shared.data_file.is_some() => (gc, false),
            Destination::New => (0, true),
        };
        PreparedWrite {
            gc,
            a,
            b: a + n,
            old,
            plan,
            host,
            fresh,
        }
    }
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
        let parts: Vec<_> = piece_parts(&standard, cs, (1 << 30, 100, 100, 7)).collect();
        assert_eq!(
            parts,
            [ReadPart {
                pos: 7,
                len: 100,
                source: ReadSource::Data((1 << 20) + 100)
            }]
        );
        let partly = AnyL2Entry::Extended(ExtendedL2Entry {
            entry: normal,
            bitmap: SubclusterBitmap {
                alloc: 0b01,
                zero: 0b100,
            },
        });
        let parts: Vec<_> = piece_parts(&partly, scs, (cs as u64, 10, 3 * scs, 0)).collect();
        let gc = cs as u64;
        assert_eq!(
            parts,
            [
                ReadPart {
                    pos: 0,
                    len: scs - 10,
                    source: ReadSource::Data((1 << 20) + 10)
                },
                ReadPart {
                    pos: scs - 10,
                    len: scs,
                    source: ReadSource::Backing {
                        guest: gc + scs as u64,
                        reserved: Some((1 << 20) + scs as u64)
                    }
                },
                ReadPart {
                    pos: 2 * scs - 10,
                    len: scs,
                    source: ReadSource::Zero {
                        reserved: Some((1 << 20) + 2 * scs as u64)
                    }
                },
                ReadPart {
                    pos: 3 * scs - 10,
                    len: 10,
                    source: ReadSource::Backing {
                        guest: gc + 3 * scs as u64,
                        reserved: Some((1 << 20) + 3 * scs as u64)
                    }
                },
            ]
        );
    }
}

#[cfg(test)]
mod plan_tests {
    use super::*;
    use qimg_format::l2::L2Entry;
    use qimg_format::units::HostOffset;

    /// The plan stops at the first cluster whose entry is lacking, leaves the pieces after it
    /// to resume with, and stops when the caller refuses a part.
    #[test]
    fn a_plan_stops_at_the_first_lacking_entry_and_resumes() {
        let cs = 4096usize;
        let data = |h: u64| {
            AnyL2Entry::Standard(L2Entry::Normal {
                host: HostOffset(h),
                copied: true,
            })
        };
        // Clusters 0 and 1 are at hand, 2 is not, 3 is.
        let entry_of = |gc: u64| match gc / cs as u64 {
            0 => Some(data(1 << 20)),
            1 => Some(AnyL2Entry::Standard(L2Entry::Unallocated)),
            2 => None,
            _ => Some(data(2 << 20)),
        };
        let pieces = (0..4u64).map(|i| (i * cs as u64, 0, cs, i as usize * cs));
        let mut pieces = pieces;
        let mut parts = Vec::new();
        let planned = plan_read(&mut pieces, cs, entry_of, |p| {
            parts.push(p);
            true
        });
        assert_eq!(planned, Planned::Lacks((2 * cs as u64, 0, cs, 2 * cs)));
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].source, ReadSource::Data(1 << 20));
        assert_eq!(
            parts[1].source,
            ReadSource::Backing {
                guest: cs as u64,
                reserved: None
            }
        );
        // Resumed: the one piece left.
        let planned = plan_read(&mut pieces, cs, entry_of, |p| {
            parts.push(p);
            true
        });
        assert_eq!(planned, Planned::Done);
        assert_eq!(parts[2].source, ReadSource::Data(2 << 20));
        assert_eq!(parts[2].pos, 3 * cs);
        // A caller that executes no backing reads refuses the plan.
        let mut pieces = (0..2u64).map(|i| (i * cs as u64, 0, cs, i as usize * cs));
        let planned = plan_read(&mut pieces, cs, entry_of, |p| {
            !matches!(p.source, ReadSource::Backing { .. })
        });
        assert_eq!(planned, Planned::Refused);
    }
}

//! Copy-on-write planning: given a cluster's L2 entry and the guest bytes a write covers,
//! where the bytes go, which neighbouring bytes must be copied with them, and what the entry
//! becomes. Subcluster-granular on extended L2: only the partly written subclusters are copied.

use qimg_io::Storage;

use super::*;
use crate::engine::plan::{ReadSource, piece_parts};

/// What the bytes a write copies around the guest's (copy-on-write) read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CowSource {
    /// Zeros: zero subclusters, and unallocated ones with nothing behind them (no backing
    /// file, or past the end of a qcow2 backing image).
    Zero,
    /// The raw backing file from this guest offset (zeros past its end, whose size takes a
    /// system call to learn).
    RawBacking(u64),
    /// A qcow2 backing image, inside its size.
    Qcow2Backing,
    /// This image's own data (allocated or compressed).
    Data,
}

impl<S: Storage> Inner<S> {
    /// The sources of bytes `[from, to)` of the guest cluster at `gc`, described by `old`,
    /// run by run: `(start, end, source)`. The one rule both executors copy on write by (the
    /// engine's [`cow_reads_zero`](Self::cow_reads_zero), a queue's ring copy-on-write).
    pub(crate) fn cow_sources(
        &self,
        old: &AnyL2Entry,
        gc: u64,
        from: usize,
        to: usize,
    ) -> impl Iterator<Item = (usize, usize, CowSource)> {
        let scs = self.shared.geo.subcluster_size() as usize;
        let backing = &self.backing;
        // The read planner's parts of the range, by where the copy reads them.
        piece_parts(old, scs, (gc, from, to - from, from)).map(move |part| {
            let source = match part.source {
                ReadSource::Zero { .. } => CowSource::Zero,
                ReadSource::Backing { guest, .. } => match backing {
                    None => CowSource::Zero,
                    Some(Backing::Raw { .. }) => CowSource::RawBacking(guest),
                    Some(Backing::Qcow2(image)) if guest >= image.inner.shared.size() => {
                        CowSource::Zero
                    }
                    Some(Backing::Qcow2(_)) => CowSource::Qcow2Backing,
                },
                ReadSource::Data(_) | ReadSource::Compressed { .. } => CowSource::Data,
            };
            (part.pos, part.pos + part.len, source)
        })
    }

    /// Whether the copy-on-write parts of `plan` around the guest bytes `[a, b)` read as zeros
    /// from `old` (see [`CowSource::Zero`]). Written into a new cluster that already reads as
    /// zeros they would change nothing, so only the guest bytes need writing.
    pub(crate) fn cow_reads_zero(
        &self,
        old: &AnyL2Entry,
        gc: u64,
        plan: &WritePlan,
        a: usize,
        b: usize,
    ) -> bool {
        [(plan.start, a), (b, plan.end)]
            .into_iter()
            .all(|(from, to)| {
                self.cow_sources(old, gc, from, to)
                    .all(|(_, _, source)| source == CowSource::Zero)
            })
    }

    /// What a write of `[a, b)` into the guest cluster mapped by `old` writes, and where.
    /// An encrypted image's plan covers whole 512-byte sectors (the cipher's unit): the
    /// bytes around the write in its first and last sector are read and written back with it
    /// (under the write's exclusive cluster lock).
    pub(crate) fn plan_write(&self, old: &AnyL2Entry, a: usize, b: usize) -> WritePlan {
        let mut plan = self.plan_write_bytes(old, a, b);
        if self.shared.crypt.is_some() {
            let sector = crate::crypto::SECTOR;
            let cs = self.shared.geo.cluster_size() as usize;
            plan.start = plan.start / sector * sector;
            plan.end = plan.end.next_multiple_of(sector).min(cs);
        }
        plan
    }

    fn plan_write_bytes(&self, old: &AnyL2Entry, a: usize, b: usize) -> WritePlan {
        let cs = self.shared.geo.cluster_size() as usize;
        let external = self.shared.data_file.is_some();
        match old {
            AnyL2Entry::Standard(e) => match *e {
                L2Entry::Normal { host, copied: true } => WritePlan {
                    target: Destination::InPlace(host.0),
                    start: a,
                    end: b,
                    bitmap: None,
                    relink: false,
                    freed: None,
                },
                L2Entry::Zero {
                    preallocated: Some(h),
                    copied: true,
                } => WritePlan {
                    target: Destination::InPlace(h.0),
                    start: 0,
                    end: cs,
                    bitmap: None,
                    relink: true,
                    freed: None,
                },
                other => WritePlan {
                    target: Destination::New,
                    start: 0,
                    end: cs,
                    bitmap: None,
                    relink: true,
                    freed: if external {
                        None
                    } else {
                        old_reference(&other)
                    },
                },
            },
            AnyL2Entry::Extended(x) => {
                let scs = self.shared.geo.subcluster_size() as usize;
                let fsc = a / scs;
                let lsc = (b - 1) / scs;
                let touched = subcluster_mask(fsc, lsc + 1);
                let bm = x.bitmap;
                match x.entry {
                    L2Entry::Normal { host, copied: true } => {
                        let normal = |sc: usize| {
                            x.state(SubclusterIndex(sc as u32)) == SubclusterState::Normal
                        };
                        let start = if a % scs != 0 && !normal(fsc) {
                            fsc * scs
                        } else {
                            a
                        };
                        let end = if b % scs != 0 && !normal(lsc) {
                            (lsc + 1) * scs
                        } else {
                            b
                        };
                        let after = bm.with_allocated(touched);
                        WritePlan {
                            target: Destination::InPlace(host.0),
                            start,
                            end,
                            bitmap: Some(after),
                            relink: after != bm,
                            freed: None,
                        }
                    }
                    L2Entry::Compressed(d) => WritePlan {
                        target: Destination::New,
                        start: 0,
                        end: cs,
                        bitmap: Some(SubclusterBitmap {
                            alloc: ALL,
                            zero: 0,
                        }),
                        relink: true,
                        freed: Some(Freed::Compressed(d)),
                    },
                    L2Entry::Normal {
                        host,
                        copied: false,
                    } => {
                        // A shared cluster: carry every allocated subcluster over.
                        let (lo, hi) = if bm.alloc != 0 {
                            (fsc.min(lowest(bm.alloc)), lsc.max(highest(bm.alloc)))
                        } else {
                            (fsc, lsc)
                        };
                        let range = subcluster_mask(lo, hi + 1);
                        WritePlan {
                            target: Destination::New,
                            start: lo * scs,
                            end: (hi + 1) * scs,
                            bitmap: Some(SubclusterBitmap {
                                alloc: range,
                                zero: bm.zero & !range,
                            }),
                            relink: true,
                            freed: (!external).then_some(Freed::Cluster(host.0)),
                        }
                    }
                    L2Entry::Unallocated | L2Entry::Zero { .. } => WritePlan {
                        target: Destination::New,
                        start: fsc * scs,
                        end: (lsc + 1) * scs,
                        bitmap: Some(SubclusterBitmap {
                            alloc: touched,
                            zero: bm.zero & !touched,
                        }),
                        relink: true,
                        freed: None,
                    },
                }
            }
        }
    }
}

//! Copy-on-write planning: given a cluster's L2 entry and the guest bytes a write covers,
//! where the bytes go, which neighbouring bytes must be copied with them, and what the entry
//! becomes. Subcluster-granular on extended L2: only the partly written subclusters are copied.

use qimg_io::Storage;

use super::*;

impl<S: Storage> Inner<S> {
    /// Whether the copy-on-write parts of `plan` around the guest bytes `[a, b)` read as zeros
    /// from `old` (zero subclusters, or unallocated ones with nothing behind them). Written
    /// into a new cluster that already reads as zeros they would change nothing, so only the
    /// guest bytes need writing.
    pub(crate) fn cow_reads_zero(
        &self,
        old: &AnyL2Entry,
        gc: u64,
        plan: &WritePlan,
        a: usize,
        b: usize,
    ) -> bool {
        let scs = self.geo.subcluster_size() as usize;
        let zero_from = |from: usize| match old.state(SubclusterIndex((from / scs) as u32)) {
            SubclusterState::ZeroAlloc | SubclusterState::ZeroPlain => true,
            SubclusterState::UnallocatedAlloc | SubclusterState::UnallocatedPlain => {
                match &self.backing {
                    None => true,
                    Some(Backing::Qcow2(image)) => gc + from as u64 >= image.inner.size(),
                    // Its size would take a system call: copy.
                    Some(Backing::Raw { .. }) => false,
                }
            }
            SubclusterState::Normal | SubclusterState::Compressed => false,
        };
        [(plan.start, a), (b, plan.end)]
            .into_iter()
            .all(|(from, to)| {
                let mut at = from;
                while at < to {
                    if !zero_from(at) {
                        return false;
                    }
                    at = (at / scs + 1) * scs;
                }
                true
            })
    }

    pub(crate) fn plan_write(&self, old: &AnyL2Entry, a: usize, b: usize) -> WritePlan {
        let cs = self.geo.cluster_size() as usize;
        let external = self.data_file.is_some();
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
                let scs = self.geo.subcluster_size() as usize;
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

//! The direct path's planning: where each byte of a request is, when that is known without
//! metadata I/O and nothing in the image has to change.

use std::time::Duration;

use qimg_format::l2::{L2Entry, SubclusterState};
use qimg_format::units::SubclusterIndex;
use qimg_io::Storage;

use crate::engine::image::Inner;
use crate::engine::meta::Meta;
use crate::engine::overlap::Writing;
use crate::engine::rw::{Destination, PreparedWrite};

/// One piece of a request on the direct path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Part {
    /// Bytes `[pos, pos + len)` of the request move to or from host offset `host`.
    Io { host: u64, pos: usize, len: usize },
    /// Bytes `[pos, pos + len)` of a read are zeros.
    Zero { pos: usize, len: usize },
}

impl<S: Storage> Inner<S> {
    /// Appends to `parts` (empty, reused from request to request so that planning allocates
    /// nothing) the parts of a `len`-byte read at guest `offset`, or gives `None` when it
    /// needs the engine: an L2 slice not cached, a backing file to read, a compressed cluster.
    /// Adjacent parts merge. `stamp`: cache hits count, stamped with this time (see
    /// `lookup_cached`).
    pub(super) fn plan_direct_read(
        &self,
        m: &mut Meta,
        offset: u64,
        len: u64,
        stamp: Option<Duration>,
        parts: &mut Vec<Part>,
    ) -> Option<()> {
        let scs = self.geo.subcluster_size() as usize;
        for (gc, a, n, pos) in self.pieces(offset, len) {
            let entry = self.lookup_cached(m, gc, stamp)?;
            let host = match entry.entry() {
                L2Entry::Compressed(_) => return None,
                e => e.host_cluster().map(|h| h.0),
            };
            let state = |off: usize| entry.state(SubclusterIndex((off / scs) as u32));
            let end = a + n;
            let mut at = a;
            while at < end {
                let s = state(at);
                let mut run_end = ((at / scs + 1) * scs).min(end);
                while run_end < end && state(run_end) == s {
                    run_end = (run_end + scs).min(end);
                }
                let (p, l) = (pos + (at - a), run_end - at);
                match s {
                    SubclusterState::Normal => push(
                        parts,
                        Part::Io {
                            host: host? + at as u64,
                            pos: p,
                            len: l,
                        },
                    ),
                    SubclusterState::ZeroAlloc | SubclusterState::ZeroPlain => {
                        push(parts, Part::Zero { pos: p, len: l })
                    }
                    SubclusterState::UnallocatedAlloc | SubclusterState::UnallocatedPlain => {
                        if self.backing.is_some() {
                            return None;
                        }
                        push(parts, Part::Zero { pos: p, len: l })
                    }
                    SubclusterState::Compressed => return None,
                }
                at = run_end;
            }
        }
        Some(())
    }

    /// Appends to `parts` (empty, as for [`plan_direct_read`](Self::plan_direct_read)) the
    /// parts of a `len`-byte write at guest `offset` and gives the pieces to link once they
    /// are on disk, or `None` (nothing changed) when a piece needs the engine. A piece goes
    /// direct when it lands in place, or allocates without copying anything (whole
    /// subclusters, or copy-on-write of zeros into a cluster that never held data) with its
    /// new cluster taken from a cached refcount block in space already reserved; nothing it
    /// replaces may need freeing. `stamp` as for [`plan_direct_read`](Self::plan_direct_read).
    pub(super) fn plan_direct_write(
        &self,
        m: &mut Meta,
        offset: u64,
        len: u64,
        stamp: Option<Duration>,
        parts: &mut Vec<Part>,
    ) -> Option<Vec<PreparedWrite>> {
        let cs = self.geo.cluster_size();
        let mut planned = Vec::new();
        let mut fresh = 0;
        // Some piece skips copy-on-write of zeros: its new cluster must read as zeros.
        let mut unused_only = false;
        for (gc, a, n, pos) in self.pieces(offset, len) {
            let old = self.lookup_cached(m, gc, stamp)?;
            let mut plan = self.plan_write(&old, a, a + n);
            if plan.freed.is_some() {
                return None;
            }
            if plan.start != a || plan.end != a + n {
                if plan.target != Destination::New
                    || !self.cow_reads_zero(&old, gc, &plan, a, a + n)
                {
                    return None;
                }
                (plan.start, plan.end) = (a, a + n);
                unused_only = true;
            }
            if plan.relink && !self.can_link_cached(m, gc) {
                return None;
            }
            match plan.target {
                // With a data file the host offset is the guest offset: nothing to allocate,
                // but also nothing the direct path links there.
                Destination::New if self.data_file.is_some() => return None,
                Destination::New => fresh += 1,
                Destination::InPlace(h) => {
                    // The engine reports an overlap (and marks the image corrupt).
                    let overlaps = self.data_file.is_none()
                        && m.overlap
                            .find(h + a as u64, n as u64, Writing::Data)
                            .is_some();
                    if overlaps {
                        return None;
                    }
                }
            }
            planned.push((gc, a, n, pos, old, plan));
        }
        let allocation = self.allocation;
        let reservation = &self.reservation;
        // As in the engine's `prepare_chunk`: clusters from here on never held data.
        let unused_from = m.end_cluster * cs;
        let accept = |host: u64| {
            reservation.covers(allocation, host, cs) && (!unused_only || host >= unused_from)
        };
        let mut hosts = self.try_alloc_cached(m, fresh, accept)?.into_iter();
        let mut links = Vec::new();
        for (gc, a, n, pos, old, plan) in planned {
            let (host, fresh) = match plan.target {
                Destination::InPlace(h) => (h, false),
                // As many hosts as pieces that wanted one.
                Destination::New => (hosts.next().unwrap_or_default(), true),
            };
            push(
                parts,
                Part::Io {
                    host: host + a as u64,
                    pos,
                    len: n,
                },
            );
            if plan.relink {
                links.push(PreparedWrite {
                    gc,
                    a,
                    b: a + n,
                    old,
                    plan,
                    host,
                    fresh,
                });
            }
        }
        Some(links)
    }
}

/// Appends `part`, merging it into the last one when they continue each other (in the request
/// and, for I/O, on the host).
fn push(parts: &mut Vec<Part>, part: Part) {
    match (parts.last_mut(), part) {
        (
            Some(Part::Io { host, pos, len }),
            Part::Io {
                host: h,
                pos: p,
                len: l,
            },
        ) if *pos + *len == p && *host + *len as u64 == h => *len += l,
        (Some(Part::Zero { pos, len }), Part::Zero { pos: p, len: l }) if *pos + *len == p => {
            *len += l
        }
        _ => parts.push(part),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_merge_only_when_contiguous_in_request_and_host() {
        let mut v = Vec::new();
        push(
            &mut v,
            Part::Io {
                host: 100,
                pos: 0,
                len: 10,
            },
        );
        push(
            &mut v,
            Part::Io {
                host: 110,
                pos: 10,
                len: 5,
            },
        );
        push(
            &mut v,
            Part::Io {
                host: 200,
                pos: 15,
                len: 5,
            },
        );
        push(&mut v, Part::Zero { pos: 20, len: 4 });
        push(&mut v, Part::Zero { pos: 24, len: 4 });
        assert_eq!(
            v,
            [
                Part::Io {
                    host: 100,
                    pos: 0,
                    len: 15
                },
                Part::Io {
                    host: 200,
                    pos: 15,
                    len: 5
                },
                Part::Zero { pos: 20, len: 8 },
            ]
        );
    }
}

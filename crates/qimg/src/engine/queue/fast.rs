//! The direct path's planning: where each byte of a request is, when that is known without
//! metadata I/O and nothing in the image has to change.

use std::time::Duration;

use qimg_io::Storage;

use crate::engine::image::Inner;
use crate::engine::meta::Meta;
use crate::engine::plan::{Destination, PreparedWrite};
use crate::engine::plan::{Planned, ReadSource, plan_read};
use crate::engine::rw::CowSource;

/// One piece of a request on the direct path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Part {
    /// Bytes `[pos, pos + len)` of the request move to or from host offset `host`.
    Io { host: u64, pos: usize, len: usize },
    /// Bytes `[pos, pos + len)` of a read are zeros.
    Zero { pos: usize, len: usize },
}

/// Where the bytes a direct write copies around the guest's come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fill {
    /// Zeros (zero subclusters, unallocated ones with nothing behind them).
    Zero,
    /// The raw backing file, from this offset (bytes past its end read as zeros).
    Backing(u64),
}

/// A write into one guest cluster that copies on write on the queue's ring: the bytes
/// `[plan.start, plan.end)` of the cluster go to the host in one write, the guest's at
/// `[a, b)` and [`fills`](Self::fills) around them.
#[derive(Debug)]
pub(super) struct CowWrite {
    /// The write, linked once the merged bytes are on disk (`host` is chosen by
    /// [`Inner::alloc_direct_cow`] for a new cluster).
    pub(super) link: PreparedWrite,
    /// `(position in the merged range, length, source)` of the bytes around the guest's, in
    /// order.
    pub(super) fills: Vec<(usize, usize, Fill)>,
}

impl CowWrite {
    /// Bytes written: the guest's and the copied ones.
    pub(super) fn span(&self) -> usize {
        self.link.plan.end - self.link.plan.start
    }

    /// Where the guest's bytes start in the merged range.
    pub(super) fn guest_pos(&self) -> usize {
        self.link.a - self.link.plan.start
    }

    /// Host offset of the merged range.
    pub(super) fn host(&self) -> u64 {
        self.link.host + self.link.plan.start as u64
    }

    /// Whether the cluster is a new one to allocate.
    pub(super) fn fresh(&self) -> bool {
        self.link.fresh
    }
}

impl<S: Storage> Inner<S> {
    /// Plans a `len`-byte write at guest `offset` that stays in one cluster and copies on
    /// write (partly written subclusters on extended L2, the rest of the cluster otherwise)
    /// from sources the queue's ring reads itself: zeros, or a raw backing file. `None` for
    /// everything else (a slice not cached, a cluster to free, a qcow2 backing file to read,
    /// data to move out of a cluster the image shares): the engine's work. Nothing is
    /// allocated yet (see [`alloc_direct_cow`](Self::alloc_direct_cow)).
    pub(super) fn plan_direct_cow(
        &self,
        m: &mut Meta,
        offset: u64,
        len: u64,
        stamp: Option<Duration>,
    ) -> Option<CowWrite> {
        let mut pieces = self.pieces(offset, len);
        let (gc, a, n, _) = pieces.next()?;
        if pieces.next().is_some() || self.shared.data_file.is_some() {
            return None;
        }
        let b = a + n;
        let old = self.shared.lookup_cached(m, gc, stamp)?;
        let link = self.prepare_piece(old, (gc, a, n, 0));
        let plan = &link.plan;
        if plan.freed.is_some()
            || !plan.relink
            || (plan.start == a && plan.end == b)
            || !self.shared.can_link_cached(m, gc)
        {
            return None;
        }
        let mut fills: Vec<(usize, usize, Fill)> = Vec::with_capacity(2);
        for (from, to) in [(plan.start, a), (b, plan.end)] {
            for (at, end, source) in self.cow_sources(&link.old, gc, from, to) {
                let fill = match source {
                    CowSource::Zero => Fill::Zero,
                    CowSource::RawBacking(guest) => Fill::Backing(guest),
                    // The engine reads a qcow2 backing image and copies data.
                    CowSource::Qcow2Backing | CowSource::Data => return None,
                };
                let pos = at - plan.start;
                let n = end - at;
                match fills.last_mut() {
                    Some((p, l, Fill::Zero)) if fill == Fill::Zero && *p + *l == pos => *l += n,
                    Some((p, l, Fill::Backing(o)))
                        if *p + *l == pos && fill == Fill::Backing(*o + *l as u64) =>
                    {
                        *l += n
                    }
                    _ => fills.push((pos, n, fill)),
                }
            }
        }
        // The engine reports an overlap (and marks the image corrupt).
        let span = (plan.end - plan.start) as u64;
        if !link.fresh && m.data_overlaps_metadata(link.host + plan.start as u64, span) {
            return None;
        }
        Some(CowWrite { link, fills })
    }

    /// Allocates the new cluster of a planned copy-on-write write from a cached refcount
    /// block, in space already reserved (as [`plan_direct_write`](Self::plan_direct_write)
    /// does); `None` (nothing changed) when that needs the engine.
    pub(super) fn alloc_direct_cow(&self, m: &mut Meta, cow: &mut CowWrite) -> Option<()> {
        if !cow.link.fresh {
            return Some(());
        }
        let cs = self.shared.geo.cluster_size();
        let (allocation, reservation) = (self.shared.allocation, &self.shared.reservation);
        let hosts = self
            .shared
            .alloc_near_now(m, 1, |host| reservation.covers(allocation, host, cs))?;
        cow.link.host = *hosts.first()?;
        Some(())
    }

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
        let scs = self.shared.geo.subcluster_size() as usize;
        let backing = self.backing.is_some();
        // The engine's plan; what the ring cannot do itself (a backing read, inflating a
        // compressed cluster, a slice to load) goes to the engine.
        let planned = plan_read(
            &mut self.pieces(offset, len),
            scs,
            |gc| self.shared.lookup_cached(m, gc, stamp),
            |part| {
                let (pos, len) = (part.pos, part.len);
                match part.source {
                    ReadSource::Data(host) => push(parts, Part::Io { host, pos, len }),
                    ReadSource::Zero { .. } => push(parts, Part::Zero { pos, len }),
                    ReadSource::Backing { .. } if !backing => push(parts, Part::Zero { pos, len }),
                    ReadSource::Backing { .. } | ReadSource::Compressed { .. } => return false,
                }
                true
            },
        );
        (planned == Planned::Done).then_some(())
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
        let cs = self.shared.geo.cluster_size();
        let mut planned = Vec::new();
        let lookup = |gc| self.shared.lookup_cached(m, gc, stamp);
        if self.plan_writes(&mut self.pieces(offset, len), lookup, &mut planned) != Planned::Done {
            return None;
        }
        let mut fresh = 0;
        // Some piece skips copy-on-write of zeros: its new cluster must read as zeros.
        let mut unused_only = false;
        for p in &mut planned {
            if p.plan.freed.is_some() {
                return None;
            }
            if p.plan.start != p.a || p.plan.end != p.b {
                if p.plan.target != Destination::New
                    || !self.cow_reads_zero(&p.old, p.gc, &p.plan, p.a, p.b)
                {
                    return None;
                }
                (p.plan.start, p.plan.end) = (p.a, p.b);
                unused_only = true;
            }
            if p.plan.relink && !self.shared.can_link_cached(m, p.gc) {
                return None;
            }
            match p.plan.target {
                // With a data file the host offset is the guest offset: nothing to allocate,
                // but also nothing the direct path links there.
                Destination::New if self.shared.data_file.is_some() => return None,
                Destination::New => fresh += 1,
                Destination::InPlace(h) => {
                    // The engine reports an overlap (and marks the image corrupt).
                    let overlaps = self.shared.data_file.is_none()
                        && m.data_overlaps_metadata(h + p.a as u64, (p.b - p.a) as u64);
                    if overlaps {
                        return None;
                    }
                }
            }
        }
        let allocation = self.shared.allocation;
        let reservation = &self.shared.reservation;
        // As in the engine's `prepare_chunks`: clusters from here on never held data.
        let unused_from = m.never_used_from();
        let accept = |host: u64| {
            reservation.covers(allocation, host, cs) && (!unused_only || host >= unused_from)
        };
        let mut hosts = self.shared.alloc_near_now(m, fresh, accept)?.into_iter();
        let mut links = Vec::new();
        for mut p in planned {
            if p.fresh {
                // As many hosts as pieces that wanted one.
                p.host = hosts.next().unwrap_or_default();
            }
            push(
                parts,
                Part::Io {
                    host: p.host + p.a as u64,
                    pos: (p.gc + p.a as u64 - offset) as usize,
                    len: p.b - p.a,
                },
            );
            if p.plan.relink {
                links.push(p);
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

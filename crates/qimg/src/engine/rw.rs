//! The guest data paths: read, write with subcluster copy-on-write, write-zeroes, discard,
//! resize.
//!
//! Every request first takes its guest clusters in the range lock (shared for reads, exclusive
//! otherwise), then works cluster by cluster: look the L2 entry up under the metadata lock,
//! release it, do the data I/O, and take it again only to link what was written.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;

use qimg_format::compressed::CompressedDescriptor;
use qimg_format::l2::{AnyL2Entry, ExtendedL2Entry, L2Entry, SubclusterBitmap, SubclusterState};
use qimg_format::units::SubclusterIndex;
use qimg_io::{AllocateOutcome, Storage};

use super::compress;
use super::image::Inner;
use super::meta::{Meta, Which};
use super::open::{Allocation, Backing};
use super::overlap::Writing;
use crate::error::{Error, Result};

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

const ALL: u32 = u32::MAX;

/// Something a rewrite leaves without a reference.
#[derive(Debug, Clone, Copy)]
enum Freed {
    Cluster(u64),
    Compressed(CompressedDescriptor),
}

/// Where the bytes of a write go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    /// The existing host cluster (COPIED), at this offset.
    InPlace(u64),
    /// A new host cluster.
    New,
}

/// The two requests that drop data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unmap {
    Zero,
    Discard,
}

/// A write to one guest cluster between allocation and linking.
#[derive(Debug, Clone)]
pub(crate) struct Prepared {
    gc: u64,
    a: usize,
    b: usize,
    old: AnyL2Entry,
    plan: WritePlan,
    /// Host offset of the cluster the data goes to (the guest offset with a data file).
    pub(crate) host: u64,
    fresh: bool,
}

impl Prepared {
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
struct WritePlan {
    target: Target,
    /// Cluster-relative range written to the target (the guest range plus copy-on-write).
    start: usize,
    end: usize,
    /// The subcluster bitmap after the write (extended entries), or `None` for standard ones.
    bitmap: Option<SubclusterBitmap>,
    /// Whether the L2 entry changes.
    relink: bool,
    freed: Option<Freed>,
}

fn old_reference(e: &L2Entry) -> Option<Freed> {
    match *e {
        L2Entry::Compressed(d) => Some(Freed::Compressed(d)),
        other => other.host_cluster().map(|h| Freed::Cluster(h.0)),
    }
}

fn lowest(mask: u32) -> usize {
    mask.trailing_zeros() as usize
}

fn highest(mask: u32) -> usize {
    31 - mask.leading_zeros() as usize
}

fn sc_mask(first: usize, end: usize) -> u32 {
    SubclusterBitmap::range_mask(SubclusterIndex(first as u32), (end - first) as u32)
}

impl<S: Storage> Inner<S> {
    /// Splits `[offset, offset + len)` into per-cluster pieces `(cluster start, offset in
    /// cluster, length, position in the request)`.
    fn pieces(&self, offset: u64, len: u64) -> Vec<(u64, usize, usize, usize)> {
        let cs = self.geo.cluster_size();
        let mut out = Vec::new();
        let mut pos = 0u64;
        while pos < len {
            let at = offset + pos;
            let within = at % cs;
            let n = (cs - within).min(len - pos);
            out.push((at - within, within as usize, n as usize, pos as usize));
            pos += n;
        }
        out
    }

    fn cluster_span(&self, offset: u64, len: u64) -> (u64, u64) {
        let bits = self.geo.cluster_bits();
        (offset >> bits, ((offset + len.max(1) - 1) >> bits) + 1)
    }

    fn ensure_open(&self, m: &Meta) -> Result<()> {
        if m.closed {
            return Err(Error::InvalidOption(format!(
                "{}: the image is closed",
                self.path.display()
            )));
        }
        Ok(())
    }

    pub(crate) async fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let (first, end) = self.cluster_span(offset, len);
        let _guard = self.locks.lock(first, end, false).await;
        for (gc, a, n, pos) in self.pieces(offset, len) {
            let entry = {
                let mut m = self.meta.lock().await;
                self.ensure_open(&m)?;
                self.lookup(&mut m, gc).await?
            };
            self.read_entry_range(&entry, gc, a, &mut buf[pos..pos + n])
                .await?;
        }
        Ok(())
    }

    /// Reads `out.len()` bytes from offset `a` of the guest cluster at `gc` as `entry`
    /// describes it.
    async fn read_entry_range(
        &self,
        entry: &AnyL2Entry,
        gc: u64,
        a: usize,
        out: &mut [u8],
    ) -> Result<()> {
        let scs = self.geo.subcluster_size() as usize;
        let end = a + out.len();
        let state_at = |off: usize| entry.state(SubclusterIndex((off / scs) as u32));
        let mut pos = a;
        let mut inflated: Option<Vec<u8>> = None;
        while pos < end {
            let state = state_at(pos);
            let mut run_end = ((pos / scs + 1) * scs).min(end);
            while run_end < end && state_at(run_end) == state {
                run_end = (run_end + scs).min(end);
            }
            let dst = &mut out[pos - a..run_end - a];
            match state {
                SubclusterState::Normal => {
                    let host = entry.entry().host_cluster().map_or(0, |h| h.0);
                    let (data, path) = self.data();
                    data.read_at_zero_fill(dst, host + pos as u64)
                        .await
                        .map_err(|e| Error::storage(path, e))?;
                }
                SubclusterState::ZeroAlloc | SubclusterState::ZeroPlain => dst.fill(0),
                SubclusterState::UnallocatedAlloc | SubclusterState::UnallocatedPlain => {
                    self.read_backing(dst, gc + pos as u64).await?;
                }
                SubclusterState::Compressed => {
                    if inflated.is_none() {
                        let L2Entry::Compressed(d) = *entry.entry() else {
                            return Err(Error::corrupt(
                                &self.path,
                                "compressed state without descriptor",
                            ));
                        };
                        inflated = Some(self.read_compressed(&d, gc).await?);
                    }
                    if let Some(c) = &inflated {
                        dst.copy_from_slice(&c[pos..run_end]);
                    }
                }
            }
            pos = run_end;
        }
        Ok(())
    }

    async fn read_compressed(&self, d: &CompressedDescriptor, gc: u64) -> Result<Vec<u8>> {
        let mut input = vec![0u8; d.compressed_size_bytes() as usize];
        let at = d.host_offset().0;
        self.file
            .read_at_zero_fill(&mut input, at)
            .await
            .map_err(|e| self.st(e))?;
        let mut out = vec![0u8; self.geo.cluster_size() as usize];
        compress::decompress(self.compression, &input, &mut out).map_err(|e| {
            Error::corrupt(
                &self.path,
                format!(
                    "compressed cluster for guest offset {gc:#x} ({} bytes at host offset {at:#x}) \
                     cannot be decompressed: {e}",
                    input.len()
                ),
            )
        })?;
        Ok(out)
    }

    /// Reads guest bytes from the backing chain; zeros without one or past its end.
    fn read_backing<'a>(&'a self, buf: &'a mut [u8], offset: u64) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            match &self.backing {
                None => {
                    buf.fill(0);
                    Ok(())
                }
                Some(Backing::Raw { storage, path }) => storage
                    .read_at_zero_fill(buf, offset)
                    .await
                    .map_err(|e| Error::storage(path, e)),
                Some(Backing::Qcow2(img)) => {
                    let size = img.inner.size();
                    let n = size.saturating_sub(offset).min(buf.len() as u64) as usize;
                    buf[n..].fill(0);
                    if n > 0 {
                        img.inner.read(&mut buf[..n], offset).await?;
                    }
                    Ok(())
                }
            }
        })
    }

    pub(crate) async fn write(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.check_writable()?;
        let len = buf.len() as u64;
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let (first, end) = self.cluster_span(offset, len);
        let _guard = self.locks.lock(first, end, true).await;
        for (gc, a, n, pos) in self.pieces(offset, len) {
            self.write_chunk(gc, a, &buf[pos..pos + n]).await?;
        }
        Ok(())
    }

    fn plan_write(&self, old: &AnyL2Entry, a: usize, b: usize) -> WritePlan {
        let cs = self.geo.cluster_size() as usize;
        let external = self.data_file.is_some();
        match old {
            AnyL2Entry::Standard(e) => match *e {
                L2Entry::Normal { host, copied: true } => WritePlan {
                    target: Target::InPlace(host.0),
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
                    target: Target::InPlace(h.0),
                    start: 0,
                    end: cs,
                    bitmap: None,
                    relink: true,
                    freed: None,
                },
                other => WritePlan {
                    target: Target::New,
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
                let touched = sc_mask(fsc, lsc + 1);
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
                            target: Target::InPlace(host.0),
                            start,
                            end,
                            bitmap: Some(after),
                            relink: after != bm,
                            freed: None,
                        }
                    }
                    L2Entry::Compressed(d) => WritePlan {
                        target: Target::New,
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
                        let range = sc_mask(lo, hi + 1);
                        WritePlan {
                            target: Target::New,
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
                        target: Target::New,
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

    fn linked_entry(&self, host: u64, bitmap: Option<SubclusterBitmap>) -> AnyL2Entry {
        let entry = L2Entry::Normal {
            host: qimg_format::units::HostOffset(host),
            copied: true,
        };
        match bitmap {
            Some(bitmap) => AnyL2Entry::Extended(ExtendedL2Entry { entry, bitmap }),
            None => AnyL2Entry::Standard(entry),
        }
    }

    /// Writes `data` at offset `a` of the guest cluster at `gc` (the caller holds the cluster
    /// exclusively).
    async fn write_chunk(&self, gc: u64, a: usize, data: &[u8]) -> Result<()> {
        let p = self.prepare_chunk(gc, a, a + data.len()).await?;
        let written = self
            .write_data(&p.old, gc, a, data, &p.plan, p.host, p.fresh)
            .await;
        if let Err(e) = written {
            self.abandon_chunk(&p).await;
            return Err(e);
        }
        self.link_chunk(&p).await
    }

    /// First half of a write to `[a, b)` of guest cluster `gc`: look the entry up, plan the
    /// write, and allocate (under the metadata lock). Nothing is linked yet.
    pub(crate) async fn prepare_chunk(&self, gc: u64, a: usize, b: usize) -> Result<Prepared> {
        let mut m = self.meta.lock().await;
        self.ensure_open(&m)?;
        let old = self.lookup(&mut m, gc).await?;
        let plan = self.plan_write(&old, a, b);
        let (host, fresh) = match plan.target {
            Target::InPlace(h) => (h, false),
            Target::New if self.data_file.is_some() => (gc, false),
            Target::New => {
                let h = self.alloc_clusters(&mut m, 1).await?;
                self.counters
                    .clusters_allocated
                    .fetch_add(1, Ordering::Relaxed);
                (h, true)
            }
        };
        if self.data_file.is_none() {
            let span = (plan.end - plan.start) as u64;
            self.guard_write(&mut m, host + plan.start as u64, span, Writing::Data)
                .await?;
        }
        Ok(Prepared {
            gc,
            a,
            b,
            old,
            plan,
            host,
            fresh,
        })
    }

    /// Gives back what [`prepare_chunk`](Self::prepare_chunk) allocated when the data could
    /// not be written (never linked, so freeing it cannot lose anything).
    pub(crate) async fn abandon_chunk(&self, p: &Prepared) {
        if p.fresh {
            let mut m = self.meta.lock().await;
            let _ = self.free_clusters(&mut m, p.host, 1).await;
        }
    }

    /// Second half: links the written cluster into the L2 table, after the refcounts and the
    /// data (cache dependencies), and drops the old reference.
    pub(crate) async fn link_chunk(&self, p: &Prepared) -> Result<()> {
        let plan = &p.plan;
        let mut m = self.meta.lock().await;
        let cow = (p.a - plan.start) + (plan.end - p.b);
        self.counters
            .cow_bytes
            .fetch_add(cow as u64, Ordering::Relaxed);
        if !plan.relink {
            return Ok(());
        }
        if p.fresh {
            // Refcount increments reach the disk before the entry that uses them.
            self.set_dependency(&mut m, Which::L2, Which::Refcount)
                .await?;
        }
        self.set_entry(&mut m, p.gc, &self.linked_entry(p.host, plan.bitmap))
            .await?;
        // The data must be durable before the entry that points at it.
        m.l2.depend_on_flush();
        if let Some(freed) = plan.freed {
            self.release(&mut m, freed).await?;
        }
        Ok(())
    }

    /// The copy-on-write part of a prepared write: reserves a fresh cluster and writes the
    /// head `[plan.start, a)` and tail `[b, plan.end)` around the guest bytes, which the caller
    /// writes itself.
    pub(crate) async fn write_cow(&self, p: &Prepared) -> Result<()> {
        let (storage, path) = self.data();
        let cs = self.geo.cluster_size();
        if p.fresh && self.allocation == Allocation::Contiguous {
            let _: AllocateOutcome = storage
                .allocate(p.host, cs)
                .await
                .map_err(|e| Error::storage(path, e))?;
        }
        let plan = &p.plan;
        for (from, to) in [(plan.start, p.a), (p.b, plan.end)] {
            if from < to {
                let mut buf = vec![0u8; to - from];
                self.read_entry_range(&p.old, p.gc, from, &mut buf).await?;
                storage
                    .write_at(&buf, p.host + from as u64)
                    .await
                    .map_err(|e| Error::storage(path, e))?;
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    async fn write_data(
        &self,
        old: &AnyL2Entry,
        gc: u64,
        a: usize,
        data: &[u8],
        plan: &WritePlan,
        host: u64,
        fresh: bool,
    ) -> Result<()> {
        let (storage, path) = self.data();
        let cs = self.geo.cluster_size();
        if fresh && self.allocation == Allocation::Contiguous {
            // Advisory; a backend that cannot reserve just stays sparse.
            let _: AllocateOutcome = storage
                .allocate(host, cs)
                .await
                .map_err(|e| Error::storage(path, e))?;
        }
        let b = a + data.len();
        if plan.start == a && plan.end == b {
            return storage
                .write_at(data, host + a as u64)
                .await
                .map_err(|e| Error::storage(path, e));
        }
        let mut buf = vec![0u8; plan.end - plan.start];
        if plan.start < a {
            self.read_entry_range(old, gc, plan.start, &mut buf[..a - plan.start])
                .await?;
        }
        buf[a - plan.start..b - plan.start].copy_from_slice(data);
        if b < plan.end {
            self.read_entry_range(old, gc, b, &mut buf[b - plan.start..])
                .await?;
        }
        storage
            .write_at(&buf, host + plan.start as u64)
            .await
            .map_err(|e| Error::storage(path, e))
    }

    /// Stores one whole guest cluster compressed (the last cluster of a disk whose size is not
    /// a multiple of the cluster size may be shorter). Data that does not shrink is written
    /// the ordinary way, as QEMU does.
    pub(crate) async fn write_compressed(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check_writable()?;
        let cs = self.geo.cluster_size();
        let len = data.len() as u64;
        self.check_range(offset, len)?;
        if self.data_file.is_some() {
            return Err(Error::Unsupported {
                path: self.path.clone(),
                what: "compressed clusters in an image with an external data file".into(),
            });
        }
        let whole = len == cs || (len > 0 && len < cs && offset + len == self.size());
        if offset % cs != 0 || !whole {
            return Err(Error::InvalidOption(format!(
                "{}: a compressed write must cover one whole cluster ({cs} bytes at a cluster \
                 boundary, or the disk's last partial cluster), not {len} bytes at {offset:#x}",
                self.path.display()
            )));
        }
        let mut padded;
        let input = if len == cs {
            data
        } else {
            padded = vec![0u8; cs as usize];
            padded[..data.len()].copy_from_slice(data);
            &padded[..]
        };
        let cbits = self.geo.cluster_bits();
        let Some(packed) = compress::compress(self.compression, input, cs as usize - 1)
            .filter(|p| CompressedDescriptor::new(0, p.len() as u64, cbits).is_ok())
        else {
            return self.write(data, offset).await;
        };
        let plen = packed.len() as u64;
        let _guard = self.locks.lock(offset / cs, offset / cs + 1, true).await;
        let mut m = self.meta.lock().await;
        self.ensure_open(&m)?;
        let old = self.lookup(&mut m, offset).await?;
        // Pack into the tail of the last compressed cluster when the bytes fit there.
        let at = match m.compressed_tail {
            Some(t) if t % cs + plen <= cs => {
                self.update_refcount(&mut m, t / cs, 1).await?;
                t
            }
            _ => {
                let h = self.alloc_clusters(&mut m, 1).await?;
                self.counters
                    .clusters_allocated
                    .fetch_add(1, Ordering::Relaxed);
                h
            }
        };
        let end = at + plen;
        m.compressed_tail = (end % cs != 0).then_some(end);
        let desc = CompressedDescriptor::new(at, plen, cbits).map_err(|e| self.fmt_err(e))?;
        self.guard_write(&mut m, at, plen, Writing::Data).await?;
        drop(m);

        let written = self
            .file
            .write_at(&packed, at)
            .await
            .map_err(|e| self.st(e));
        let mut m = self.meta.lock().await;
        if let Err(e) = written {
            let _ = self.free_clusters(&mut m, at - at % cs, 1).await;
            return Err(e);
        }
        self.set_dependency(&mut m, Which::L2, Which::Refcount)
            .await?;
        let entry = L2Entry::Compressed(desc);
        let new = match old {
            AnyL2Entry::Standard(_) => AnyL2Entry::Standard(entry),
            AnyL2Entry::Extended(_) => AnyL2Entry::Extended(ExtendedL2Entry {
                entry,
                bitmap: SubclusterBitmap { alloc: 0, zero: 0 },
            }),
        };
        self.set_entry(&mut m, offset, &new).await?;
        m.l2.depend_on_flush();
        if let Some(freed) = old_reference(old.entry()) {
            self.release(&mut m, freed).await?;
        }
        Ok(())
    }

    /// Drops the reference a rewritten entry held (after the entry changed).
    async fn release(&self, m: &mut Meta, freed: Freed) -> Result<()> {
        if self.data_file.is_some() {
            return Ok(());
        }
        self.set_dependency(m, Which::Refcount, Which::L2).await?;
        match freed {
            Freed::Cluster(h) => self.free_clusters(m, h, 1).await,
            Freed::Compressed(d) => {
                let (first, n) = d.host_clusters();
                self.free_clusters(m, first.0 * self.geo.cluster_size(), n)
                    .await
            }
        }
    }

    pub(crate) async fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.unmap(offset, len, Unmap::Zero).await
    }

    pub(crate) async fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.unmap(offset, len, Unmap::Discard).await
    }

    /// Write-zeroes and discard: cluster by cluster, with the whole range held exclusively.
    async fn unmap(&self, offset: u64, len: u64, how: Unmap) -> Result<()> {
        self.check_writable()?;
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let (first, end) = self.cluster_span(offset, len);
        let _guard = self.locks.lock(first, end, true).await;
        for (gc, a, n, _) in self.pieces(offset, len) {
            match how {
                Unmap::Zero => self.zero_chunk(gc, a, a + n).await?,
                Unmap::Discard => self.discard_chunk(gc, a, a + n).await?,
            }
        }
        Ok(())
    }

    /// Subclusters `[first, end)` wholly inside `[a, b)`.
    fn whole_subclusters(&self, a: usize, b: usize) -> (usize, usize) {
        let scs = self.geo.subcluster_size() as usize;
        let first = a.div_ceil(scs);
        let end = b / scs;
        // The last cluster of an image whose size is not cluster aligned: its tail subcluster
        // counts as whole when the range reaches the end of the disk.
        (first, end.max(first))
    }

    async fn zero_chunk(&self, gc: u64, a: usize, b: usize) -> Result<()> {
        let scs = self.geo.subcluster_size() as usize;
        let b_eff = self.extend_to_cluster_end_at_eof(gc, b);
        let (first, end) = self.whole_subclusters(a, b_eff);
        if first >= end {
            return self.write_chunk(gc, a, &vec![0u8; b - a]).await;
        }
        if a < first * scs {
            self.write_chunk(gc, a, &vec![0u8; first * scs - a]).await?;
        }
        if end * scs < b {
            self.write_chunk(gc, end * scs, &vec![0u8; b - end * scs])
                .await?;
        }
        let mut m = self.meta.lock().await;
        self.ensure_open(&m)?;
        let old = self.lookup(&mut m, gc).await?;
        let (new, freed) = match old {
            AnyL2Entry::Standard(e) => {
                let new = if self.version == 2 {
                    if self.backing.is_some() {
                        drop(m);
                        return self
                            .write_chunk(gc, first * scs, &vec![0u8; (end - first) * scs])
                            .await;
                    }
                    L2Entry::Unallocated
                } else {
                    L2Entry::Zero {
                        preallocated: None,
                        copied: false,
                    }
                };
                (AnyL2Entry::Standard(new), old_reference(&e))
            }
            AnyL2Entry::Extended(x) => {
                let mask = sc_mask(first, end);
                match x.entry {
                    L2Entry::Compressed(_) if mask != ALL => {
                        drop(m);
                        return self
                            .write_chunk(gc, first * scs, &vec![0u8; (end - first) * scs])
                            .await;
                    }
                    L2Entry::Compressed(d) => (
                        AnyL2Entry::Extended(ExtendedL2Entry {
                            entry: L2Entry::Unallocated,
                            bitmap: SubclusterBitmap {
                                alloc: 0,
                                zero: ALL,
                            },
                        }),
                        Some(Freed::Compressed(d)),
                    ),
                    entry => self.unlink_if_empty(entry, x.bitmap.with_zero(mask)),
                }
            }
        };
        if new == old {
            return Ok(());
        }
        if self.data_file_raw {
            self.zero_raw_data(gc, first * scs, end * scs).await?;
        }
        self.set_entry(&mut m, gc, &new).await?;
        if let Some(freed) = freed.filter(|_| self.data_file.is_none()) {
            self.release(&mut m, freed).await?;
        }
        Ok(())
    }

    /// Extended entry with a new bitmap; a host cluster left without allocated subclusters is
    /// unlinked (and returned to be freed).
    fn unlink_if_empty(
        &self,
        entry: L2Entry,
        bitmap: SubclusterBitmap,
    ) -> (AnyL2Entry, Option<Freed>) {
        match entry {
            L2Entry::Normal { host, .. } if bitmap.alloc == 0 => (
                AnyL2Entry::Extended(ExtendedL2Entry {
                    entry: L2Entry::Unallocated,
                    bitmap,
                }),
                Some(Freed::Cluster(host.0)),
            ),
            other => (
                AnyL2Entry::Extended(ExtendedL2Entry {
                    entry: other,
                    bitmap,
                }),
                None,
            ),
        }
    }

    /// At the end of a disk whose size is not a multiple of the cluster size, a range reaching
    /// the end covers the rest of the last (sub)cluster too.
    fn extend_to_cluster_end_at_eof(&self, gc: u64, b: usize) -> usize {
        let size = self.size();
        if gc + b as u64 == size {
            self.geo.cluster_size() as usize
        } else {
            b
        }
    }

    async fn zero_raw_data(&self, gc: u64, from: usize, to: usize) -> Result<()> {
        let (storage, path) = self.data();
        let start = gc + from as u64;
        let len = (to - from) as u64;
        let len = len.min(self.size().saturating_sub(start));
        storage
            .write_zeroes(start, len)
            .await
            .map(|_| ())
            .map_err(|e| Error::storage(path, e))
    }

    async fn discard_chunk(&self, gc: u64, a: usize, b: usize) -> Result<()> {
        let scs = self.geo.subcluster_size() as usize;
        let b = self.extend_to_cluster_end_at_eof(gc, b);
        let (first, end) = self.whole_subclusters(a, b);
        if first >= end {
            return Ok(());
        }
        let mut m = self.meta.lock().await;
        self.ensure_open(&m)?;
        let old = self.lookup(&mut m, gc).await?;
        let (new, freed) = match old {
            AnyL2Entry::Standard(e) => (
                AnyL2Entry::Standard(L2Entry::Unallocated),
                old_reference(&e),
            ),
            AnyL2Entry::Extended(x) => {
                let mask = sc_mask(first, end);
                match x.entry {
                    L2Entry::Compressed(_) if mask != ALL => return Ok(()),
                    L2Entry::Compressed(d) => {
                        (self.unallocated_entry(), Some(Freed::Compressed(d)))
                    }
                    entry => self.unlink_if_empty(entry, x.bitmap.with_unallocated(mask)),
                }
            }
        };
        if new == old {
            return Ok(());
        }
        if self.data_file_raw {
            self.zero_raw_data(gc, first * scs, end * scs).await?;
        }
        self.set_entry(&mut m, gc, &new).await?;
        if let Some(freed) = freed {
            if self.data_file.is_none() {
                self.release(&mut m, freed).await?;
            } else if !self.data_file_raw {
                let (storage, _) = self.data();
                let _ = storage
                    .discard(gc + (first * scs) as u64, ((end - first) * scs) as u64)
                    .await;
            }
        }
        Ok(())
    }

    pub(crate) async fn resize(&self, new_size: u64) -> Result<()> {
        self.check_writable()?;
        let size = self.size();
        if new_size < size {
            return Err(Error::Unsupported {
                path: self.path.clone(),
                what: format!("shrinking from {size} to {new_size} bytes"),
            });
        }
        if new_size == size {
            return Ok(());
        }
        let entries = self
            .geo
            .l1_size_for(new_size)
            .map_err(|e| Error::InvalidOption(format!("size {new_size}: {e}")))?;
        let _guard = self.locks.lock(0, u64::MAX, true).await;
        let mut m = self.meta.lock().await;
        self.ensure_open(&m)?;
        self.grow_l1(&mut m, entries).await?;
        if self.data_file_raw {
            let (storage, path) = self.data();
            let len = storage.len().await.map_err(|e| Error::storage(path, e))?;
            if len < new_size {
                storage
                    .set_len(new_size)
                    .await
                    .map_err(|e| Error::storage(path, e))?;
            }
        }
        self.file
            .write_at(&new_size.to_be_bytes(), 24)
            .await
            .map_err(|e| self.st(e))?;
        self.file.flush().await.map_err(|e| self.st(e))?;
        self.size.store(new_size, Ordering::Release);
        Ok(())
    }
}

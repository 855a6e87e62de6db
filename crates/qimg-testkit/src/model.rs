//! The one flat model of guest data: the bytes every guest offset must read, over the backing
//! file's bytes, changed by guest requests as the engine's semantics say. The whole-system
//! tests and the fuzz harness compare the engine with it.
//!
//! The semantics it encodes:
//!
//! * a write leaves its bytes, a write-zeroes leaves zeros;
//! * a discard drops only whole subclusters of its range (a partial subcluster keeps its
//!   data); the last subcluster of the disk counts as whole when the range reaches the end of
//!   the disk. A dropped subcluster reads as zeros, over a backing file too;
//! * growing the disk ([`GuestModel::resize`]) shows the backing file in the new area, zeros
//!   past its end: the engine writes nothing there, so the area is unallocated.
//!
//! A model may cover the whole disk or only a window of it ([`GuestModel::window`]): the
//! multi-task stress tests keep one model per task for the task's private range, and requests
//! outside the window change nothing in it.

use std::sync::Arc;

use crate::pattern::{cached_pattern, pattern};

/// The sizes a model (and an [`OpCode`]) needs to know of an image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Virtual disk size in bytes.
    pub size: u64,
    /// Cluster size in bytes.
    pub cluster_size: u64,
    /// Subcluster size in bytes: the cluster size without extended L2 entries, a 32nd of it
    /// with them. The unit a discard drops.
    pub subcluster_size: u64,
}

impl Geometry {
    /// The geometry of an image of `size` bytes with clusters of `cluster_size` bytes and,
    /// when `extended`, extended L2 entries (32 subclusters per cluster).
    pub fn new(size: u64, cluster_size: u64, extended: bool) -> Self {
        Self {
            size,
            cluster_size,
            subcluster_size: if extended {
                cluster_size / 32
            } else {
                cluster_size
            },
        }
    }
}

/// One guest request of a test workload or a fuzz input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestOp {
    /// Write [`pattern`]`(seed, at, len)` (the fuzz harness writes its own pattern).
    Write {
        /// Guest offset.
        at: u64,
        /// Bytes.
        len: u64,
        /// Pattern seed.
        seed: u64,
    },
    /// Write zeroes.
    Zero {
        /// Guest offset.
        at: u64,
        /// Bytes.
        len: u64,
    },
    /// Discard.
    Discard {
        /// Guest offset.
        at: u64,
        /// Bytes.
        len: u64,
    },
    /// Read (and compare with the model).
    Read {
        /// Guest offset.
        at: u64,
        /// Bytes.
        len: u64,
    },
    /// Flush.
    Flush,
    /// Close the image and open it again.
    Reopen,
    /// Flush and close (the last request of a crash workload).
    Close,
}

impl GuestOp {
    /// The guest range `[start, end)` the request names, if any.
    pub fn range(&self) -> Option<(u64, u64)> {
        match *self {
            GuestOp::Write { at, len, .. }
            | GuestOp::Zero { at, len }
            | GuestOp::Discard { at, len }
            | GuestOp::Read { at, len } => Some((at, at + len)),
            _ => None,
        }
    }

    /// Whether the request makes everything before it durable (flush, close, reopen).
    pub fn is_barrier(&self) -> bool {
        matches!(self, GuestOp::Flush | GuestOp::Close | GuestOp::Reopen)
    }

    /// The request `code` stands for on a disk of geometry `g`.
    ///
    /// `kind % 16` chooses 0..=5 write, 6..=7 write-zeroes, 8..=10 discard, 11..=12 read,
    /// 13..=14 flush, 15 reopen. The start is subcluster `subcluster` (modulo the count) plus
    /// an offset inside it that `start_mode % 4` makes 0 (0), a multiple of 512 (1) or any
    /// (2, 3), from `within`. The length `len_mode % 5` is one subcluster (0),
    /// `1 + len % 40` subclusters (1), `1 + len % 4096` bytes (2), or up to three clusters
    /// (3, 4); clipped at the end of the disk. Biased toward (sub)cluster boundaries, where
    /// the engine's cases split.
    pub fn decode(code: &OpCode, g: &Geometry) -> Self {
        let size = g.size;
        let scs = g.subcluster_size;
        let sc = u64::from(code.subcluster) % size.div_ceil(scs);
        let w = u64::from(code.within);
        let within = match code.start_mode % 4 {
            0 => 0,
            1 => (w * 512) % scs,
            _ => w % scs,
        };
        let at = (sc * scs + within).min(size - 1);
        let n = u64::from(code.len);
        let len = match code.len_mode % 5 {
            0 => scs,
            1 => scs * (1 + n % 40),
            2 => 1 + n % 4096,
            _ => 1 + n * 97 % (3 * g.cluster_size),
        };
        let len = len.min(size - at).max(1);
        match code.kind % 16 {
            0..=5 => GuestOp::Write {
                at,
                len,
                seed: code.seed,
            },
            6..=7 => GuestOp::Zero { at, len },
            8..=10 => GuestOp::Discard { at, len },
            11..=12 => GuestOp::Read { at, len },
            13..=14 => GuestOp::Flush,
            _ => GuestOp::Reopen,
        }
    }
}

/// A guest request before it is scaled to an image's geometry: the raw numbers a proptest
/// strategy or a fuzz input provides ([`GuestOp::decode`] says what each means).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpCode {
    /// Which request.
    pub kind: u8,
    /// How the start is aligned inside its subcluster.
    pub start_mode: u8,
    /// The subcluster the request starts in.
    pub subcluster: u16,
    /// The offset inside the subcluster.
    pub within: u16,
    /// How the length is measured.
    pub len_mode: u8,
    /// The length in those units.
    pub len: u16,
    /// The pattern seed of a write.
    pub seed: u64,
}

/// What one request leaves in the guest range `[start, start + bytes.len())`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Effect {
    /// First guest byte.
    pub start: u64,
    /// The bytes the range reads afterwards.
    pub bytes: Vec<u8>,
}

impl Effect {
    /// One past the last guest byte.
    pub fn end(&self) -> u64 {
        self.start + self.bytes.len() as u64
    }
}

/// The flat model of a guest disk (or of a window of it).
#[derive(Debug, Clone)]
pub struct GuestModel {
    /// What the guest bytes `[base, base + data.len())` must read.
    pub data: Vec<u8>,
    /// The first guest byte `data` covers (0 for a whole-disk model).
    pub base: u64,
    /// The backing file's guest contents from offset 0 (may be shorter than the disk; reads
    /// as zeros past its end). Shared: crash tests clone models by the thousand.
    pub backing: Arc<Vec<u8>>,
    /// The virtual disk size.
    pub size: u64,
    /// The unit a discard drops.
    pub subcluster_size: u64,
}

impl GuestModel {
    /// A model of the whole disk of `size` bytes over `backing` (empty without a backing
    /// file): every byte reads the backing file's, zeros past its end.
    pub fn new(size: u64, backing: impl Into<Arc<Vec<u8>>>, subcluster_size: u64) -> Self {
        Self::window(size, 0, size, backing, subcluster_size)
    }

    /// A model of the guest bytes `[base, base + len)` only, of a disk of `size` bytes.
    pub fn window(
        size: u64,
        base: u64,
        len: u64,
        backing: impl Into<Arc<Vec<u8>>>,
        subcluster_size: u64,
    ) -> Self {
        let backing = backing.into();
        let mut m = Self {
            data: Vec::new(),
            base,
            backing,
            size,
            subcluster_size,
        };
        m.data = (base..base + len).map(|b| m.backing_byte(b)).collect();
        m
    }

    /// The virtual disk size.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// What the backing file shows at guest offset `at` (zero past its end).
    pub fn backing_byte(&self, at: u64) -> u8 {
        usize::try_from(at)
            .ok()
            .and_then(|i| self.backing.get(i))
            .copied()
            .unwrap_or(0)
    }

    /// What guest bytes `[at, at + len)` must read (inside the window).
    pub fn read(&self, at: u64, len: u64) -> &[u8] {
        let from = (at - self.base) as usize;
        &self.data[from..from + len as usize]
    }

    /// The range `[first, last)` a discard of `[at, at + len)` drops: its whole subclusters,
    /// the last one counting as whole when the range reaches the end of the disk. `None`
    /// when it drops nothing.
    pub fn discarded_range(&self, at: u64, len: u64) -> Option<(u64, u64)> {
        let scs = self.subcluster_size;
        let end = at + len;
        let first = at.div_ceil(scs) * scs;
        let mut last = first;
        while last < self.size {
            let e = (last + scs).min(self.size);
            if e > end {
                break;
            }
            last = e;
        }
        (last > first).then_some((first, last))
    }

    /// What `op` leaves on the disk where it changes anything (writes carry
    /// [`pattern`]`(seed, ..)`).
    pub fn effect(&self, op: &GuestOp) -> Option<Effect> {
        match *op {
            GuestOp::Write { at, len, seed } => Some(Effect {
                start: at,
                bytes: cached_pattern(seed, at, len).to_vec(),
            }),
            GuestOp::Zero { at, len } => Some(Effect {
                start: at,
                bytes: vec![0; len as usize],
            }),
            GuestOp::Discard { at, len } => self.discarded_range(at, len).map(|(s, e)| Effect {
                start: s,
                bytes: vec![0; (e - s) as usize],
            }),
            _ => None,
        }
    }

    /// Puts what `e` leaves into the model (the part inside the window).
    pub fn apply_effect(&mut self, e: &Effect) {
        self.put(e.start, &e.bytes);
    }

    /// Applies a request: see [`GuestModel::effect`].
    pub fn apply(&mut self, op: &GuestOp) {
        match *op {
            // Not through `effect`: no copy of the data, no cache entry.
            GuestOp::Write { at, len, seed } => self.put(at, &pattern(seed, at, len as usize)),
            GuestOp::Zero { at, len } => self.write_zeroes(at, len),
            GuestOp::Discard { at, len } => self.discard(at, len),
            _ => {}
        }
    }

    /// A write of `data` at `at`.
    pub fn write(&mut self, at: u64, data: &[u8]) {
        self.put(at, data);
    }

    /// A write-zeroes of `[at, at + len)`.
    pub fn write_zeroes(&mut self, at: u64, len: u64) {
        if let Some((s, e)) = self.clip(at, at + len) {
            self.data[s..e].fill(0);
        }
    }

    /// A discard of `[at, at + len)`: its whole subclusters ([`GuestModel::discarded_range`])
    /// read as zeros, over a backing file too (as QEMU's discard sets the zero flag there).
    pub fn discard(&mut self, at: u64, len: u64) {
        if let Some((first, last)) = self.discarded_range(at, len) {
            if let Some((s, e)) = self.clip(first, last) {
                self.data[s..e].fill(0);
            }
        }
    }

    /// Grows the disk to `new_size` bytes: the new area shows the backing file (zeros past
    /// its end), as nothing is allocated there. A whole-disk model grows with it; a window
    /// stays as it is.
    pub fn resize(&mut self, new_size: u64) {
        assert!(new_size >= self.size, "the engine refuses to shrink a disk");
        if self.base == 0 && self.data.len() as u64 == self.size {
            let old = self.size;
            let grown: Vec<u8> = (old..new_size).map(|b| self.backing_byte(b)).collect();
            self.data.extend(grown);
        }
        self.size = new_size;
    }

    /// Copies `bytes` to guest offset `at`, the part inside the window.
    fn put(&mut self, at: u64, bytes: &[u8]) {
        if let Some((s, e)) = self.clip(at, at + bytes.len() as u64) {
            let from = (self.base + s as u64 - at) as usize;
            self.data[s..e].copy_from_slice(&bytes[from..from + (e - s)]);
        }
    }

    /// The indexes into `data` of guest range `[start, end)` clipped to the window.
    fn clip(&self, start: u64, end: u64) -> Option<(usize, usize)> {
        let s = start.max(self.base);
        let e = end.min(self.base + self.data.len() as u64);
        (s < e).then(|| ((s - self.base) as usize, (e - self.base) as usize))
    }
}

/// Checks guest contents `read` read after a crash or a failed request: outside the ranges
/// the `window` requests touched, every byte must equal `flushed` (the model as of the last
/// completed flush); inside them, each byte must be its flushed value or a value one of those
/// requests left there. Compares 512-byte sectors whole where it can. On a mismatch returns
/// the guest offset and a message.
pub fn check_possible(
    read: &[u8],
    flushed: &[u8],
    window: &[&Effect],
) -> Result<(), (u64, String)> {
    assert_eq!(read.len(), flushed.len());
    let mut ranges: Vec<(u64, u64)> = window.iter().map(|e| (e.start, e.end())).collect();
    ranges.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for (s, e) in ranges {
        match merged.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    let mut pos = 0u64;
    let gap = |from: u64, to: u64| -> Result<(), (u64, String)> {
        let (a, b) = (from as usize, to as usize);
        if read[a..b] != flushed[a..b] {
            let i = a + (a..b).position(|i| read[i] != flushed[i]).unwrap_or(0);
            return Err((
                i as u64,
                format!(
                    "guest byte {i:#x} reads {:#04x}, but nothing touched it since the last \
                     flush, which left {:#04x}",
                    read[i], flushed[i]
                ),
            ));
        }
        Ok(())
    };
    for &(s, e) in &merged {
        gap(pos, s)?;
        let mut c = s;
        while c < e {
            let ce = ((c / 512 + 1) * 512).min(e);
            let (a, b) = (c as usize, ce as usize);
            let whole = read[a..b] == flushed[a..b]
                || window.iter().any(|w| {
                    w.start <= c
                        && ce <= w.end()
                        && read[a..b] == w.bytes[(c - w.start) as usize..(ce - w.start) as usize]
                });
            if !whole {
                for i in c..ce {
                    let v = read[i as usize];
                    let ok = v == flushed[i as usize]
                        || window.iter().any(|w| {
                            w.start <= i && i < w.end() && w.bytes[(i - w.start) as usize] == v
                        });
                    if !ok {
                        let mut cands: Vec<u8> = window
                            .iter()
                            .filter(|w| w.start <= i && i < w.end())
                            .map(|w| w.bytes[(i - w.start) as usize])
                            .collect();
                        cands.dedup();
                        return Err((
                            i,
                            format!(
                                "guest byte {i:#x} reads {v:#04x}: neither its flushed value \
                                 {:#04x} nor any value written to it since ({cands:02x?})",
                                flushed[i as usize]
                            ),
                        ));
                    }
                }
            }
            c = ce;
        }
        pos = e;
    }
    gap(pos, read.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discard_drops_whole_subclusters_only() {
        let backing = vec![7u8; 3000];
        let mut m = GuestModel::new(5000, backing, 1024);
        m.write(0, &[5; 5000]);
        // Bytes 1024..2048 and 2048..3072 are whole and read zeros (not the backing file's
        // 7s); 100..1024 and 3072..3100 are not and keep their data.
        m.discard(100, 3000);
        assert!(m.read(0, 1024).iter().all(|&b| b == 5));
        assert!(m.read(1024, 2048).iter().all(|&b| b == 0));
        assert!(m.read(3072, 28).iter().all(|&b| b == 5));
        // The last, partial subcluster is whole when the range reaches the end.
        m.write(4500, &[9; 500]);
        m.discard(4096, 904);
        assert!(m.read(4096, 904).iter().all(|&b| b == 0));
        assert_eq!(m.discarded_range(4096, 903), None);
    }

    #[test]
    fn a_window_sees_only_its_bytes() {
        let backing: Vec<u8> = (0..100u8).collect();
        let mut w = GuestModel::window(200, 50, 20, backing, 10);
        assert_eq!(w.read(50, 20), &(50..70u8).collect::<Vec<_>>()[..]);
        w.write(45, &[1; 10]);
        w.write_zeroes(65, 100);
        assert_eq!(&w.data[..5], &[1; 5]);
        assert!(w.data[15..].iter().all(|&b| b == 0));
        w.discard(0, 200);
        assert!(w.read(50, 20).iter().all(|&b| b == 0));
    }

    #[test]
    fn resize_shows_the_backing_file() {
        let mut m = GuestModel::new(10, vec![3u8; 12], 512);
        m.resize(14);
        assert_eq!(m.data, [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 0, 0]);
    }

    #[test]
    fn decode_scales_to_the_geometry() {
        let g = Geometry::new(1 << 20, 65536, true);
        let code = OpCode {
            kind: 0,
            start_mode: 0,
            subcluster: 3,
            within: 0,
            len_mode: 0,
            len: 0,
            seed: 9,
        };
        assert_eq!(
            GuestOp::decode(&code, &g),
            GuestOp::Write {
                at: 3 * 2048,
                len: 2048,
                seed: 9
            }
        );
    }
}

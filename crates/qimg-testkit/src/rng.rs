//! The one seeded generator of the tests: splitmix64, with the helpers the tests draw with.
//!
//! splitmix64 (not xorshift) because the crash and I/O-error tests replay their workloads by
//! seed and count their crash and error points from them: keeping their generator keeps
//! every workload, and so every count, as it was. It also has no bad seed (xorshift is stuck
//! at zero), so any `u64` is a valid seed.

/// A small, fast, deterministic generator (splitmix64): the same seed always gives the same
/// sequence, so a failing case reproduces from its seed alone.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    #[allow(clippy::should_implement_trait)] // not an iterator: it never ends
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform enough in `0..n` (`n` > 0; the modulo bias is irrelevant for tests).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// Uniform enough in `lo..hi` (`lo < hi`).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo)
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }

    /// One element of `items` (not empty).
    pub fn choose<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }

    /// A multiple of `align` in `0..limit` (`align` > 0, `limit` >= `align`).
    pub fn aligned(&mut self, limit: u64, align: u64) -> u64 {
        self.below(limit / align) * align
    }

    /// `len` random bytes (incompressible data).
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len + 8);
        while out.len() < len {
            out.extend_from_slice(&self.next().to_le_bytes());
        }
        out.truncate(len);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence() {
        let (mut a, mut b) = (Rng(42), Rng(42));
        for _ in 0..100 {
            assert_eq!(a.next(), b.next());
        }
        // The first splitmix64 output for seed 0 (the reference value of the algorithm).
        assert_eq!(Rng(0).next(), 0xe220_a839_7b1d_cdaf);
    }

    #[test]
    fn helpers_stay_in_range() {
        let mut r = Rng(7);
        for _ in 0..1000 {
            assert!((10..20).contains(&r.range(10, 20)));
            assert_eq!(r.aligned(4096, 512) % 512, 0);
            assert!(r.aligned(4096, 512) < 4096);
            assert!([1, 2, 3].contains(r.choose(&[1, 2, 3])));
        }
        assert_eq!(r.bytes(13).len(), 13);
    }
}

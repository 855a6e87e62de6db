//! Deterministic data patterns: the bytes the tests write, which they can compute again at
//! any offset instead of storing them.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

/// The pattern of the whole-system tests: byte `i` is a hash of `seed` and its guest offset
/// `at + i`, so the same guest byte gets the same value from any write of the same seed, and
/// a write landing at the wrong offset shows. Never a zero byte (`| 1`), so pattern data can
/// never be mistaken for zeros (a zero write, a discarded range, an unallocated cluster).
pub fn pattern(seed: u64, at: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            let x = (at + i).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ seed.wrapping_mul(0xD1B5_4A32_D192_ED03);
            (x >> 29) as u8 | 1
        })
        .collect()
}

/// The fuzz harness's pattern: byte `i` depends on `seed` and `at + i` too, but eight bytes
/// come from each 64-bit hash of an aligned word index, which makes it several times cheaper
/// than [`pattern`] (the harness makes megabytes per input). Unlike [`pattern`], it may hold
/// zero bytes. Kept apart from [`pattern`] because the harness's saved findings and corpus
/// were made with it.
pub fn word_pattern(seed: u64, at: u64, len: usize) -> Vec<u8> {
    let k = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let first = at / 8;
    let words = (at % 8 + len as u64).div_ceil(8);
    let mut out = Vec::with_capacity(words as usize * 8);
    for w in first..first + words {
        let mut x = w.wrapping_add(k).wrapping_mul(k);
        x ^= x >> 31;
        x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x ^= x >> 29;
        out.extend_from_slice(&x.to_le_bytes());
    }
    let skip = (at % 8) as usize;
    out.drain(..skip);
    out.truncate(len);
    out
}

/// [`pattern`]`(seed, at, len)`, remembered per thread: the crash and I/O-error workloads
/// replay the same requests many times, and in a debug build the pattern costs more than the
/// rest of a request.
pub fn cached_pattern(seed: u64, at: u64, len: u64) -> Arc<Vec<u8>> {
    type Cache = HashMap<(u64, u64, u64), Arc<Vec<u8>>>;
    thread_local! {
        static CACHE: RefCell<Cache> = RefCell::new(HashMap::new());
    }
    CACHE.with(|c| {
        let mut c = c.borrow_mut();
        // A bound, not an eviction policy: workloads reuse a few hundred requests at most.
        if c.len() > 512 {
            c.clear();
        }
        c.entry((seed, at, len))
            .or_insert_with(|| Arc::new(pattern(seed, at, len as usize)))
            .clone()
    })
}

/// The first index where `a` and `b` differ (`None` when they are equal); compares the slices
/// whole first, which is much faster than the byte loop when they are equal.
pub fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    if a == b {
        return None;
    }
    Some(
        a.iter()
            .zip(b)
            .position(|(x, y)| x != y)
            .unwrap_or(a.len().min(b.len())),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_depend_on_the_guest_offset_only() {
        let whole = pattern(5, 100, 64);
        assert_eq!(pattern(5, 120, 10), whole[20..30]);
        assert!(whole.iter().all(|&b| b != 0));
        let whole = word_pattern(5, 3, 64);
        assert_eq!(word_pattern(5, 20, 10), whole[17..27]);
        assert_eq!(*cached_pattern(5, 100, 64), pattern(5, 100, 64));
        assert_eq!(first_difference(b"abc", b"abd"), Some(2));
        assert_eq!(first_difference(b"abc", b"abc"), None);
    }
}

//! Big-endian field access on byte slices whose length the caller has already checked.

/// Reads a big-endian u16 at `off`. The caller guarantees `off + 2 <= b.len()`.
pub(crate) fn u16_at(b: &[u8], off: usize) -> u16 {
    let mut a = [0u8; 2];
    a.copy_from_slice(&b[off..off + 2]);
    u16::from_be_bytes(a)
}

/// Reads a big-endian u32 at `off`. The caller guarantees `off + 4 <= b.len()`.
pub(crate) fn u32_at(b: &[u8], off: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[off..off + 4]);
    u32::from_be_bytes(a)
}

/// Reads a big-endian u64 at `off`. The caller guarantees `off + 8 <= b.len()`.
pub(crate) fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_be_bytes(a)
}

/// Rounds `n` up to a multiple of 8, saturating.
pub(crate) fn pad8(n: usize) -> usize {
    n.saturating_add(7) & !7
}

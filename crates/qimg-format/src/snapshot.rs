//! The internal snapshot table: variable-length entries, each 8-byte aligned.

use crate::be::{pad8, u16_at, u32_at, u64_at};
use crate::error::{FormatError, Result};

/// QEMU's limit on the number of snapshots.
pub const MAX_SNAPSHOTS: u32 = 65536;
/// QEMU's limit on the extra data of one entry.
pub const MAX_EXTRA_DATA: u32 = 1024;
/// QEMU's limit on the size of the whole table.
pub const MAX_TABLE_SIZE: u64 = 1024 * 65536;
/// Extra data every v3 snapshot must carry (vm state size and disk size).
pub const V3_MIN_EXTRA_DATA: u32 = 16;

/// One snapshot table entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// Offset of the snapshot's L1 table.
    pub l1_table_offset: u64,
    /// Entries in that L1 table.
    pub l1_size: u32,
    /// Unique ID string.
    pub id: Vec<u8>,
    /// Name.
    pub name: Vec<u8>,
    /// Creation time, seconds since the epoch.
    pub date_sec: u32,
    /// Creation time, nanoseconds.
    pub date_nsec: u32,
    /// Guest run time in nanoseconds.
    pub vm_clock_nsec: u64,
    /// The 32-bit VM state size field (superseded by extra data bytes 0–7 when present).
    pub vm_state_size32: u32,
    /// Extra data, kept byte for byte.
    pub extra_data: Vec<u8>,
}

impl Snapshot {
    fn extra_u64(&self, at: usize) -> Option<u64> {
        (self.extra_data.len() >= at + 8).then(|| u64_at(&self.extra_data, at))
    }

    /// The VM state size: the 64-bit extra field when present, else the 32-bit one.
    pub fn vm_state_size(&self) -> u64 {
        self.extra_u64(0).unwrap_or(u64::from(self.vm_state_size32))
    }

    /// Virtual disk size when the snapshot was taken, if recorded.
    pub fn disk_size(&self) -> Option<u64> {
        self.extra_u64(8)
    }

    /// Record/replay instruction count, if recorded and enabled (not -1).
    pub fn icount(&self) -> Option<u64> {
        self.extra_u64(16).filter(|&v| v != u64::MAX)
    }

    /// Whether a v3 image must call this entry incomplete: less than
    /// [`V3_MIN_EXTRA_DATA`] bytes of extra data (QEMU reads such an entry, `check` reports
    /// it and `-r all` rewrites it; v2 images may carry none).
    pub fn is_incomplete(&self, version: u32) -> bool {
        version >= 3 && self.extra_data.len() < V3_MIN_EXTRA_DATA as usize
    }

    /// Gives the entry the extra data QEMU writes (VM state size, disk size, icount; 24
    /// bytes), keeping what it already records and any unknown bytes after them, as QEMU's
    /// `qcow2_write_snapshots` does: a missing disk size becomes `disk_size` (QEMU takes the
    /// image's current size), a missing icount -1.
    pub fn complete_extra(&mut self, disk_size: u64) {
        if self.extra_data.len() >= KNOWN_EXTRA_DATA as usize {
            return;
        }
        let icount = self.extra_u64(16).unwrap_or(u64::MAX);
        let disk_size = self.disk_size().unwrap_or(disk_size);
        self.extra_data = known_extra(self.vm_state_size(), disk_size, icount);
    }

    /// Encoded size including padding.
    pub fn encoded_len(&self) -> usize {
        pad8(40 + self.extra_data.len() + self.id.len() + self.name.len())
    }

    /// Encodes the entry and its padding.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.encoded_len());
        b.extend_from_slice(&self.l1_table_offset.to_be_bytes());
        b.extend_from_slice(&self.l1_size.to_be_bytes());
        b.extend_from_slice(&(self.id.len() as u16).to_be_bytes());
        b.extend_from_slice(&(self.name.len() as u16).to_be_bytes());
        b.extend_from_slice(&self.date_sec.to_be_bytes());
        b.extend_from_slice(&self.date_nsec.to_be_bytes());
        b.extend_from_slice(&self.vm_clock_nsec.to_be_bytes());
        b.extend_from_slice(&self.vm_state_size32.to_be_bytes());
        b.extend_from_slice(&(self.extra_data.len() as u32).to_be_bytes());
        b.extend_from_slice(&self.extra_data);
        b.extend_from_slice(&self.id);
        b.extend_from_slice(&self.name);
        b.resize(self.encoded_len(), 0);
        b
    }
}

/// The 24 bytes of extra data QEMU knows: 64-bit VM state size, virtual disk size at
/// snapshot time, and the record/replay instruction count (-1, `u64::MAX`, when disabled).
pub fn known_extra(vm_state_size: u64, disk_size: u64, icount: u64) -> Vec<u8> {
    [vm_state_size, disk_size, icount]
        .iter()
        .flat_map(|v| v.to_be_bytes())
        .collect()
}

/// Decodes `nb` entries of a snapshot table read from file offset `table_offset`.
///
/// Limits: at most 65536 entries, at most 1024 bytes of extra data per entry; an entry that
/// runs past `bytes` is reported as truncated with its own offset. A v3 entry with less
/// extra data than the specification asks for is read as QEMU reads it
/// ([`Snapshot::is_incomplete`] tells; writers complete it with
/// [`Snapshot::complete_extra`]).
pub fn decode_table(bytes: &[u8], table_offset: u64, nb: u32) -> Result<Vec<Snapshot>> {
    if nb > MAX_SNAPSHOTS {
        return Err(FormatError::InvalidField {
            what: "nb_snapshots",
            offset: 60,
            value: u64::from(nb),
            reason: format!("at most {MAX_SNAPSHOTS} snapshots are supported"),
        });
    }
    let mut out = Vec::with_capacity(nb.min(1024) as usize);
    let mut pos = 0usize;
    for i in 0..nb {
        let at = table_offset.saturating_add(pos as u64);
        let rest = &bytes[pos..];
        let truncated = |need: usize| FormatError::Truncated {
            what: "snapshot table entry",
            offset: at,
            need: need as u64,
            have: rest.len() as u64,
        };
        if rest.len() < 40 {
            return Err(truncated(40));
        }
        let id_len = usize::from(u16_at(rest, 12));
        let name_len = usize::from(u16_at(rest, 14));
        let extra_len = u32_at(rest, 36);
        if extra_len > MAX_EXTRA_DATA {
            return Err(FormatError::InvalidField {
                what: "snapshot extra_data_size",
                offset: at + 36,
                value: u64::from(extra_len),
                reason: format!("snapshot {i} has more than {MAX_EXTRA_DATA} bytes of extra data"),
            });
        }
        let extra_len = extra_len as usize;
        let body = 40 + extra_len + id_len + name_len;
        if rest.len() < body {
            return Err(truncated(body));
        }
        let x = 40 + extra_len;
        out.push(Snapshot {
            l1_table_offset: u64_at(rest, 0),
            l1_size: u32_at(rest, 8),
            date_sec: u32_at(rest, 16),
            date_nsec: u32_at(rest, 20),
            vm_clock_nsec: u64_at(rest, 24),
            vm_state_size32: u32_at(rest, 32),
            extra_data: rest[40..x].to_vec(),
            id: rest[x..x + id_len].to_vec(),
            name: rest[x + id_len..body].to_vec(),
        });
        pos = (pos + pad8(body)).min(bytes.len());
    }
    Ok(out)
}

/// Encodes a whole table.
pub fn encode_table(snapshots: &[Snapshot]) -> Vec<u8> {
    let mut table: Vec<u8> = snapshots.iter().flat_map(Snapshot::encode).collect();
    // Each entry starts 8-aligned; the last one's padding is not part of the table (QEMU's
    // table size, so the file ends where QEMU's does).
    if let Some(last) = snapshots.last() {
        let unpadded =
            ENTRY_HEADER_LEN as usize + last.extra_data.len() + last.id.len() + last.name.len();
        table.truncate(table.len() - last.encoded_len() + unpadded);
    }
    table
}

/// Bytes of the fixed part of a snapshot table entry.
pub const ENTRY_HEADER_LEN: u64 = 40;
/// Extra data QEMU knows the meaning of (VM state size, disk size, icount), in bytes.
pub const KNOWN_EXTRA_DATA: u64 = 24;

/// The fixed part of a snapshot table entry, decoded without judging it (for `check`, which
/// reports and repairs what [`decode_table`] refuses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EntryHeader {
    /// Offset of the snapshot's L1 table.
    pub l1_table_offset: u64,
    /// Entries in the snapshot's L1 table.
    pub l1_size: u32,
    /// Bytes of the ID string.
    pub id_size: u16,
    /// Bytes of the name.
    pub name_size: u16,
    /// Bytes of extra data following the fixed part.
    pub extra_data_size: u32,
}

impl EntryHeader {
    /// Decodes the [`ENTRY_HEADER_LEN`] bytes at the start of an entry.
    pub fn decode(bytes: &[u8; ENTRY_HEADER_LEN as usize]) -> Self {
        Self {
            l1_table_offset: u64_at(bytes, 0),
            l1_size: u32_at(bytes, 8),
            id_size: u16_at(bytes, 12),
            name_size: u16_at(bytes, 14),
            extra_data_size: u32_at(bytes, 36),
        }
    }

    /// Encodes the fields (date, VM clock and 32-bit VM state size as zeros).
    pub fn encode(&self) -> [u8; ENTRY_HEADER_LEN as usize] {
        let mut b = [0u8; ENTRY_HEADER_LEN as usize];
        b[..8].copy_from_slice(&self.l1_table_offset.to_be_bytes());
        b[8..12].copy_from_slice(&self.l1_size.to_be_bytes());
        b[12..14].copy_from_slice(&self.id_size.to_be_bytes());
        b[14..16].copy_from_slice(&self.name_size.to_be_bytes());
        b[36..40].copy_from_slice(&self.extra_data_size.to_be_bytes());
        b
    }
}

/// A snapshot ID or name as text: up to the first NUL, invalid UTF-8 replaced.
pub fn decode_text(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&c| c == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_snapshot() -> impl Strategy<Value = Snapshot> {
        (
            any::<(u64, u32, u32, u32, u64, u32)>(),
            proptest::collection::vec(any::<u8>(), 16..64),
            proptest::collection::vec(any::<u8>(), 0..20),
            proptest::collection::vec(any::<u8>(), 0..40),
        )
            .prop_map(
                |((l1, l1s, ds, dn, vm, vs), extra_data, id, name)| Snapshot {
                    l1_table_offset: l1,
                    l1_size: l1s,
                    id,
                    name,
                    date_sec: ds,
                    date_nsec: dn,
                    vm_clock_nsec: vm,
                    vm_state_size32: vs,
                    extra_data,
                },
            )
    }

    proptest! {
        #[test]
        fn snapshot_tables_round_trip(snaps in proptest::collection::vec(arb_snapshot(), 0..8)) {
            let bytes = encode_table(&snaps);
            // QEMU's table size: each entry starts 8-aligned, the last is not padded.
            let mut qemu_size = 0usize;
            for s in &snaps {
                qemu_size = qemu_size.next_multiple_of(8)
                    + ENTRY_HEADER_LEN as usize
                    + s.extra_data.len()
                    + s.id.len()
                    + s.name.len();
            }
            prop_assert_eq!(bytes.len(), qemu_size);
            prop_assert_eq!(decode_table(&bytes, 0x50000, snaps.len() as u32).unwrap(), snaps);
        }

        #[test]
        fn decoding_arbitrary_tables_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300), nb in 0u32..70000) {
            let _ = decode_table(&bytes, 0, nb);
        }
    }

    fn one(extra: usize) -> Snapshot {
        Snapshot {
            l1_table_offset: 0x30000,
            l1_size: 1,
            id: b"1".to_vec(),
            name: b"snap".to_vec(),
            date_sec: 0,
            date_nsec: 0,
            vm_clock_nsec: 0,
            vm_state_size32: 7,
            extra_data: vec![0; extra],
        }
    }

    #[test]
    fn extra_data_fields_are_read() {
        let mut s = one(24);
        s.extra_data[0..8].copy_from_slice(&(5u64 << 32).to_be_bytes());
        s.extra_data[8..16].copy_from_slice(&(1u64 << 30).to_be_bytes());
        s.extra_data[16..24].copy_from_slice(&u64::MAX.to_be_bytes());
        assert_eq!(s.vm_state_size(), 5 << 32);
        assert_eq!(s.disk_size(), Some(1 << 30));
        assert_eq!(s.icount(), None);
        assert_eq!(one(0).vm_state_size(), 7);
    }

    #[test]
    fn too_many_snapshots_are_refused_naming_the_count() {
        let err = decode_table(&[], 0, 65537).unwrap_err().to_string();
        assert!(err.contains("nb_snapshots 65537"), "{err}");
    }

    #[test]
    fn v3_snapshots_without_the_mandatory_extra_data_are_read_and_completed_as_qemu_does() {
        let mut s = one(8);
        s.vm_state_size32 = 5;
        s.extra_data = 9u64.to_be_bytes().to_vec();
        let b = s.encode();
        let got = decode_table(&b, 0x20000, 1).unwrap().remove(0);
        assert!(got.is_incomplete(3) && !got.is_incomplete(2));
        assert_eq!(got.vm_state_size(), 9);
        let mut done = got.clone();
        done.complete_extra(1 << 30);
        assert!(!done.is_incomplete(3));
        assert_eq!(done.extra_data.len(), 24);
        assert_eq!(
            (done.vm_state_size(), done.disk_size(), done.icount()),
            (9, Some(1 << 30), None)
        );
        // Nothing recorded: the 32-bit VM state size moves into the extra data.
        let mut bare = one(0);
        bare.vm_state_size32 = 5;
        bare.complete_extra(4096);
        assert_eq!(bare.extra_data, known_extra(5, 4096, u64::MAX));
        // Complete entries, and their unknown bytes, are left as they are.
        let mut long = one(40);
        let before = long.clone();
        long.complete_extra(1);
        assert_eq!(long, before);
    }

    #[test]
    fn oversized_extra_data_is_refused() {
        let b = one(1032).encode();
        let err = decode_table(&b, 0, 1).unwrap_err().to_string();
        assert!(err.contains("1032"), "{err}");
    }

    #[test]
    fn a_truncated_table_names_the_entry_offset() {
        let mut b = one(16).encode();
        b.extend_from_slice(&one(16).encode()[..30]);
        let len = one(16).encoded_len() as u64;
        let err = decode_table(&b, 0x10000, 2).unwrap_err().to_string();
        assert!(err.contains(&format!("{:#x}", 0x10000 + len)), "{err}");
    }

    #[test]
    fn entry_headers_decode_whatever_their_values() {
        let s = Snapshot {
            l1_table_offset: 0x5_0000,
            l1_size: 9,
            date_sec: 1,
            date_nsec: 2,
            vm_clock_nsec: 3,
            vm_state_size32: 4,
            extra_data: vec![0; 16],
            id: b"1".to_vec(),
            name: b"snap".to_vec(),
        };
        let b = s.encode();
        let h = EntryHeader::decode(b[..40].try_into().unwrap());
        assert_eq!(
            (
                h.l1_table_offset,
                h.l1_size,
                h.id_size,
                h.name_size,
                h.extra_data_size
            ),
            (0x5_0000, 9, 1, 4, 16)
        );
        assert_eq!(decode_text(b"ab\0c"), "ab");
        assert_eq!(decode_text(b"x"), "x");
    }

    proptest! {
        #[test]
        fn entry_headers_round_trip(off in any::<u64>(), l1 in any::<u32>(), id in any::<u16>(), name in any::<u16>(), extra in any::<u32>()) {
            let h = EntryHeader { l1_table_offset: off, l1_size: l1, id_size: id, name_size: name, extra_data_size: extra };
            prop_assert_eq!(EntryHeader::decode(&h.encode()), h);
        }
    }
}

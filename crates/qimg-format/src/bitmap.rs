//! Persistent dirty bitmaps: the bitmaps header extension (0x23852875) and the bitmap
//! directory, enough to list bitmaps and to preserve them and the clusters they own.

use crate::be::{pad8, u16_at, u32_at, u64_at};
use crate::error::{FormatError, Result};
use crate::magic::EXT_BITMAPS;

/// QEMU's limit on the number of bitmaps.
pub const MAX_BITMAPS: u32 = 65535;
/// QEMU's limit on the size of one directory entry.
pub const MAX_DIRECTORY_ENTRY: u64 = 1024;
/// QEMU's limit on the directory size.
pub const MAX_DIRECTORY_SIZE: u64 = MAX_DIRECTORY_ENTRY * MAX_BITMAPS as u64;
/// Bitmap flag: not saved consistently.
pub const FLAG_IN_USE: u32 = 1 << 0;
/// Bitmap flag: must track all writes.
pub const FLAG_AUTO: u32 = 1 << 1;
/// Bitmap flag: extra data may be ignored.
pub const FLAG_EXTRA_DATA_COMPATIBLE: u32 = 1 << 2;
/// Bitmap table entry bits that must be zero.
pub const TABLE_ENTRY_RESERVED: u64 = 0xff00_0000_0000_01fe;

/// The 24 bytes of the bitmaps extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BitmapsExtension {
    /// Number of bitmaps in the directory (1..=65535).
    pub nb_bitmaps: u32,
    /// Size of the directory in bytes.
    pub directory_size: u64,
    /// Cluster-aligned file offset of the directory.
    pub directory_offset: u64,
}

impl BitmapsExtension {
    /// Decodes the extension data found at file offset `at`, with QEMU's checks.
    pub fn decode(data: &[u8], at: u64, cluster_size: u64) -> Result<Self> {
        let bad = |reason: String| FormatError::BadExtension {
            kind: EXT_BITMAPS,
            offset: at,
            reason,
        };
        if data.len() != 24 {
            return Err(bad(format!(
                "bitmaps extension is {} bytes, expected 24",
                data.len()
            )));
        }
        let nb_bitmaps = u32_at(data, 0);
        let reserved = u32_at(data, 4);
        let directory_size = u64_at(data, 8);
        let directory_offset = u64_at(data, 16);
        if reserved != 0 {
            return Err(bad(format!("reserved field is {reserved:#x}, must be 0")));
        }
        if nb_bitmaps == 0 || nb_bitmaps > MAX_BITMAPS {
            return Err(bad(format!(
                "nb_bitmaps {nb_bitmaps} is outside 1..={MAX_BITMAPS}"
            )));
        }
        if directory_size > MAX_DIRECTORY_SIZE {
            return Err(bad(format!(
                "bitmap directory size {directory_size} exceeds {MAX_DIRECTORY_SIZE}"
            )));
        }
        if cluster_size == 0 || directory_offset % cluster_size != 0 {
            return Err(bad(format!(
                "bitmap directory offset {directory_offset:#x} is not cluster aligned"
            )));
        }
        Ok(Self {
            nb_bitmaps,
            directory_size,
            directory_offset,
        })
    }

    /// Encodes the 24 bytes.
    pub fn encode(&self) -> [u8; 24] {
        let mut b = [0u8; 24];
        b[0..4].copy_from_slice(&self.nb_bitmaps.to_be_bytes());
        b[8..16].copy_from_slice(&self.directory_size.to_be_bytes());
        b[16..24].copy_from_slice(&self.directory_offset.to_be_bytes());
        b
    }
}

/// One bitmap directory entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BitmapEntry {
    /// Cluster-aligned offset of the bitmap table.
    pub table_offset: u64,
    /// Number of bitmap table entries.
    pub table_size: u32,
    /// Flags (`FLAG_*`).
    pub flags: u32,
    /// Bitmap type; 1 = dirty tracking.
    pub kind: u8,
    /// log2 of the bytes of guest data one bit covers.
    pub granularity_bits: u8,
    /// Extra data, kept as read.
    pub extra_data: Vec<u8>,
    /// Name (not NUL-terminated).
    pub name: Vec<u8>,
}

impl BitmapEntry {
    /// Bytes of guest data per bit.
    pub fn granularity(&self) -> u64 {
        1u64.checked_shl(u32::from(self.granularity_bits))
            .unwrap_or(0)
    }

    /// The flag names qemu-img prints (`in-use`, `auto`).
    pub fn flag_names(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.flags & FLAG_IN_USE != 0 {
            v.push("in-use");
        }
        if self.flags & FLAG_AUTO != 0 {
            v.push("auto");
        }
        v
    }

    /// Encoded size including padding to 8 bytes.
    pub fn encoded_len(&self) -> usize {
        pad8(24 + self.extra_data.len() + self.name.len())
    }

    /// Encodes the entry with its padding.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.encoded_len());
        b.extend_from_slice(&self.table_offset.to_be_bytes());
        b.extend_from_slice(&self.table_size.to_be_bytes());
        b.extend_from_slice(&self.flags.to_be_bytes());
        b.push(self.kind);
        b.push(self.granularity_bits);
        b.extend_from_slice(&(self.name.len() as u16).to_be_bytes());
        b.extend_from_slice(&(self.extra_data.len() as u32).to_be_bytes());
        b.extend_from_slice(&self.extra_data);
        b.extend_from_slice(&self.name);
        b.resize(self.encoded_len(), 0);
        b
    }
}

impl BitmapEntry {
    /// Why QEMU would not load this entry of an image whose virtual disk has `disk_size`
    /// bytes (its `bitmap_list_load` and `check_dir_entry` rules), in QEMU's words followed
    /// by the value that breaks the rule; `None` when QEMU loads it. A consistent bitmap's
    /// table must also have exactly [`table_entries`] entries (see [`table_size_refusal`](Self::table_size_refusal)).
    pub fn refusal(&self, cluster_size: u64, disk_size: u64) -> Option<String> {
        let name = String::from_utf8_lossy(&self.name);
        if !self.extra_data.is_empty() {
            return Some(format!(
                "Bitmap extra data is not supported (bitmap '{name}' has {} bytes of it)",
                self.extra_data.len()
            ));
        }
        let cs = cluster_size.max(1);
        let size = u64::from(self.table_size);
        let g = self.granularity_bits;
        let why = if size == 0 {
            "its table size is 0".to_string()
        } else if self.table_offset == 0 || self.table_offset % cs != 0 {
            format!(
                "its table offset {:#x} is not a cluster of the file",
                self.table_offset
            )
        } else if size > MAX_TABLE_ENTRIES {
            format!("its table size {size} exceeds {MAX_TABLE_ENTRIES}")
        } else if !(MIN_GRANULARITY_BITS..=MAX_GRANULARITY_BITS).contains(&g) {
            format!(
                "its granularity_bits {g} is outside {MIN_GRANULARITY_BITS}..={MAX_GRANULARITY_BITS}"
            )
        } else if self.flags & !(FLAG_IN_USE | FLAG_AUTO) != 0 {
            format!(
                "its flags {:#x} have reserved bits {:#x} set",
                self.flags,
                self.flags & !(FLAG_IN_USE | FLAG_AUTO)
            )
        } else if self.name.len() > MAX_NAME_BYTES {
            format!("its name is {} bytes long", self.name.len())
        } else if self.kind != TYPE_DIRTY_TRACKING {
            format!("its type is {}, not 1 (dirty tracking)", self.kind)
        } else if size.saturating_mul(cs) > MAX_DATA_BYTES {
            format!("its table of {size} clusters exceeds QEMU's limit of {MAX_DATA_BYTES} bytes")
        } else if self.flags & FLAG_IN_USE == 0
            && disk_size > (size.saturating_mul(cs).saturating_mul(8)).saturating_mul(1 << g)
        {
            format!("its table of {size} clusters cannot cover a {disk_size}-byte disk")
        } else {
            return None;
        };
        Some(format!(
            "Bitmap '{name}' doesn't satisfy the constraints: {why}"
        ))
    }

    /// Why QEMU would not read a consistent bitmap's data (`load_bitmap_data`): its table
    /// must have exactly the entries its bits need on a `disk_size`-byte disk.
    pub fn table_size_refusal(&self, cluster_size: u64, disk_size: u64) -> Option<String> {
        let want = table_entries(bit_count(disk_size, self.granularity_bits), cluster_size);
        (u64::from(self.table_size) != want).then(|| {
            format!(
                "Could not read bitmap '{}' from image: its table has {} entries where a \
                 {disk_size}-byte disk needs {want}",
                String::from_utf8_lossy(&self.name),
                self.table_size
            )
        })
    }
}

/// QEMU's limit on a bitmap name's length.
pub const MAX_NAME_BYTES: usize = 1023;
/// Smallest granularity QEMU loads or creates (`granularity_bits` 9: 512 bytes).
pub const MIN_GRANULARITY_BITS: u8 = 9;
/// Largest granularity QEMU loads or creates (`granularity_bits` 31: 2 GiB).
pub const MAX_GRANULARITY_BITS: u8 = 31;
/// QEMU's limit on a bitmap table's entries.
pub const MAX_TABLE_ENTRIES: u64 = 0x800_0000;
/// QEMU's limit on a bitmap's data (512 MiB): what a loaded bitmap may take in memory.
pub const MAX_DATA_BYTES: u64 = 0x2000_0000;
/// Bitmap table entry: a cluster of bitmap data whose bits all read as set (offset 0).
pub const TABLE_ENTRY_ALL_ONES: u64 = 1;
/// Bitmap table entry: where the data cluster's offset lives.
pub const TABLE_ENTRY_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// The bitmap type QEMU knows: dirty tracking.
pub const TYPE_DIRTY_TRACKING: u8 = 1;

/// Bits of a bitmap over a disk of `size` bytes at `granularity_bits` (one bit a granule).
pub fn bit_count(size: u64, granularity_bits: u8) -> u64 {
    let g = 1u64 << granularity_bits.min(63);
    size.div_ceil(g)
}

/// Bytes of bitmap data on disk for `bits` bits (eight a byte).
pub fn data_bytes(bits: u64) -> u64 {
    bits.div_ceil(8)
}

/// Bitmap table entries (data clusters) for `bits` bits.
pub fn table_entries(bits: u64, cluster_size: u64) -> u64 {
    data_bytes(bits).div_ceil(cluster_size)
}

/// What one bitmap table entry says about its cluster of bitmap data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableEntry {
    /// No data cluster: every bit is clear.
    Zeros,
    /// No data cluster: every bit is set.
    Ones,
    /// The bits are in the data cluster at this offset.
    Data(u64),
}

impl TableEntry {
    /// Decodes the entry at index `index` of the table at file offset `table_at`, refusing
    /// what QEMU refuses: reserved bits, an unaligned data cluster, or one with the all-ones
    /// flag.
    pub fn decode(raw: u64, cluster_size: u64, table_at: u64, index: u64) -> Result<Self> {
        let offset = raw & TABLE_ENTRY_OFFSET_MASK;
        let bad = raw & TABLE_ENTRY_RESERVED != 0
            || (offset != 0
                && (raw & TABLE_ENTRY_ALL_ONES != 0 || offset % cluster_size.max(1) != 0));
        if bad {
            return Err(FormatError::InvalidField {
                what: "bitmap table entry",
                offset: table_at.saturating_add(index.saturating_mul(8)),
                value: raw,
                reason: format!("bitmap table entry {index} is invalid"),
            });
        }
        Ok(match (offset, raw & TABLE_ENTRY_ALL_ONES) {
            (0, 0) => TableEntry::Zeros,
            (0, _) => TableEntry::Ones,
            (o, _) => TableEntry::Data(o),
        })
    }

    /// The table word.
    pub fn encode(self) -> u64 {
        match self {
            TableEntry::Zeros => 0,
            TableEntry::Ones => TABLE_ENTRY_ALL_ONES,
            TableEntry::Data(o) => o & TABLE_ENTRY_OFFSET_MASK,
        }
    }
}

/// Bitmap data as 64-bit words: bit `n` of the bitmap is bit `n % 64` of word `n / 64`. On
/// disk the bits run LSB first within each byte, bytes in order: a word's little-endian
/// bytes. Copies `bytes` (starting at bit `8 * first_byte`, which is a multiple of 64) into
/// `words`; bytes past the words are ignored.
pub fn bytes_to_words(bytes: &[u8], first_byte: usize, words: &mut [u64]) {
    debug_assert_eq!(first_byte % 8, 0);
    for (i, chunk) in bytes.chunks(8).enumerate() {
        let Some(w) = words.get_mut(first_byte / 8 + i) else {
            break;
        };
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        *w = u64::from_le_bytes(b);
    }
}

/// The on-disk bytes of `words` (see [`bytes_to_words`]) from byte `first_byte` (a multiple
/// of 8), filling `out`; bytes past the words are zero.
pub fn words_to_bytes(words: &[u64], first_byte: usize, out: &mut [u8]) {
    debug_assert_eq!(first_byte % 8, 0);
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let w = words.get(first_byte / 8 + i).copied().unwrap_or(0);
        chunk.copy_from_slice(&w.to_le_bytes()[..chunk.len()]);
    }
}

/// Encodes a bitmap table.
pub fn encode_table(entries: &[TableEntry]) -> Vec<u8> {
    entries
        .iter()
        .flat_map(|e| e.encode().to_be_bytes())
        .collect()
}

/// Encodes a whole directory (entries with their padding, in order).
pub fn encode_directory(entries: &[BitmapEntry]) -> Vec<u8> {
    entries.iter().flat_map(BitmapEntry::encode).collect()
}

/// Decodes `ext.nb_bitmaps` directory entries from `dir` (the `directory_size` bytes read at
/// `ext.directory_offset`). Each entry's errors name its own file offset.
pub fn decode_directory(dir: &[u8], ext: &BitmapsExtension) -> Result<Vec<BitmapEntry>> {
    let mut out = Vec::new();
    let mut pos = 0usize;
    for i in 0..ext.nb_bitmaps {
        let at = ext.directory_offset.saturating_add(pos as u64);
        if dir.len() - pos < 24 {
            return Err(FormatError::Truncated {
                what: "bitmap directory entry",
                offset: at,
                need: 24,
                have: (dir.len() - pos) as u64,
            });
        }
        let e = &dir[pos..];
        let table_offset = u64_at(e, 0);
        let table_size = u32_at(e, 8);
        let flags = u32_at(e, 12);
        let kind = e[16];
        let granularity_bits = e[17];
        let name_size = usize::from(u16_at(e, 18));
        let extra_size = u32_at(e, 20) as usize;
        let bad = |what: &'static str, value: u64, reason: String| FormatError::InvalidField {
            what,
            offset: at,
            value,
            reason,
        };
        if name_size == 0 {
            return Err(bad(
                "bitmap name size",
                0,
                format!("bitmap {i} has an empty name"),
            ));
        }
        if flags & !0x7 != 0 {
            return Err(bad(
                "bitmap flags",
                u64::from(flags),
                format!("bitmap {i} has reserved flag bits {:#x} set", flags & !0x7),
            ));
        }
        let len = 24usize
            .checked_add(extra_size)
            .and_then(|l| l.checked_add(name_size))
            .map(pad8)
            .unwrap_or(usize::MAX);
        if len as u64 > MAX_DIRECTORY_ENTRY {
            return Err(bad(
                "bitmap directory entry size",
                len as u64,
                format!("bitmap {i}'s entry exceeds {MAX_DIRECTORY_ENTRY} bytes"),
            ));
        }
        let body_end = 24 + extra_size + name_size;
        if e.len() < body_end {
            return Err(FormatError::Truncated {
                what: "bitmap directory entry",
                offset: at,
                need: body_end as u64,
                have: e.len() as u64,
            });
        }
        out.push(BitmapEntry {
            table_offset,
            table_size,
            flags,
            kind,
            granularity_bits,
            extra_data: e[24..24 + extra_size].to_vec(),
            name: e[24 + extra_size..body_end].to_vec(),
        });
        pos = (pos + len).min(dir.len());
    }
    if pos != dir.len() {
        return Err(FormatError::InvalidField {
            what: "bitmap directory size",
            offset: ext.directory_offset,
            value: dir.len() as u64,
            reason: format!(
                "Broken bitmap directory: its {} entries end at byte {pos}",
                ext.nb_bitmaps
            ),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_entry() -> impl Strategy<Value = BitmapEntry> {
        (
            any::<u64>(),
            any::<u32>(),
            0u32..8,
            any::<u8>(),
            any::<u8>(),
            proptest::collection::vec(any::<u8>(), 0..40),
            proptest::collection::vec(any::<u8>(), 1..60),
        )
            .prop_map(|(t, s, flags, kind, g, extra_data, name)| BitmapEntry {
                table_offset: t,
                table_size: s,
                flags,
                kind,
                granularity_bits: g,
                extra_data,
                name,
            })
    }

    proptest! {
        #[test]
        fn bitmap_directories_round_trip(entries in proptest::collection::vec(arb_entry(), 1..10)) {
            let dir: Vec<u8> = entries.iter().flat_map(BitmapEntry::encode).collect();
            let ext = BitmapsExtension {
                nb_bitmaps: entries.len() as u32,
                directory_size: dir.len() as u64,
                directory_offset: 0x30000,
            };
            let back = BitmapsExtension::decode(&ext.encode(), 0x70, 0x10000).unwrap();
            prop_assert_eq!(back, ext);
            prop_assert_eq!(decode_directory(&dir, &ext).unwrap(), entries);
        }

        #[test]
        fn decoding_arbitrary_directories_never_panics(dir in proptest::collection::vec(any::<u8>(), 0..200), n in 1u32..10) {
            let ext = BitmapsExtension { nb_bitmaps: n, directory_size: dir.len() as u64, directory_offset: 0 };
            let _ = decode_directory(&dir, &ext);
        }
    }

    #[test]
    fn a_bitmaps_extension_with_zero_bitmaps_is_refused() {
        let ext = BitmapsExtension {
            nb_bitmaps: 0,
            directory_size: 8,
            directory_offset: 0x10000,
        };
        let err = BitmapsExtension::decode(&ext.encode(), 0x78, 0x10000)
            .unwrap_err()
            .to_string();
        assert!(err.contains("nb_bitmaps 0"), "{err}");
        assert!(err.contains("0x78"), "{err}");
    }

    #[test]
    fn a_misaligned_directory_or_reserved_field_is_refused() {
        let mut b = BitmapsExtension {
            nb_bitmaps: 1,
            directory_size: 32,
            directory_offset: 0x10200,
        }
        .encode();
        let err = BitmapsExtension::decode(&b, 0, 0x10000)
            .unwrap_err()
            .to_string();
        assert!(err.contains("0x10200"), "{err}");
        b[16..24].copy_from_slice(&0x20000u64.to_be_bytes());
        b[7] = 5;
        let err = BitmapsExtension::decode(&b, 0, 0x10000)
            .unwrap_err()
            .to_string();
        assert!(err.contains("reserved field is 0x5"), "{err}");
        let err = BitmapsExtension::decode(&b[..20], 0, 0x10000)
            .unwrap_err()
            .to_string();
        assert!(err.contains("20 bytes"), "{err}");
    }

    #[test]
    fn an_entry_with_reserved_flags_is_refused() {
        let e = BitmapEntry {
            table_offset: 0,
            table_size: 0,
            flags: 0x10,
            kind: 1,
            granularity_bits: 16,
            extra_data: vec![],
            name: b"b".to_vec(),
        };
        let ext = BitmapsExtension {
            nb_bitmaps: 1,
            directory_size: 32,
            directory_offset: 0x40000,
        };
        let err = decode_directory(&e.encode(), &ext).unwrap_err().to_string();
        assert!(err.contains("0x10"), "{err}");
        assert!(err.contains("0x40000"), "{err}");
    }

    #[test]
    fn bitmap_bits_are_lsb_first_bytes_in_order() {
        // Bit 0 and bit 9 set: byte 0 = 0x01, byte 1 = 0x02.
        let words = [1u64 | 1 << 9, 1 << 63];
        let mut out = [0u8; 16];
        words_to_bytes(&words, 0, &mut out);
        assert_eq!(out[..2], [0x01, 0x02]);
        assert_eq!(out[15], 0x80);
        let mut back = [0u64; 2];
        bytes_to_words(&out, 0, &mut back);
        assert_eq!(back, words);
        assert_eq!(bit_count(1 << 20, 16), 16);
        assert_eq!(bit_count((1 << 20) + 1, 16), 17);
        assert_eq!(table_entries(65536 * 8 + 1, 65536), 2);
    }

    #[test]
    fn table_entries_decode_as_qemu_reads_them() {
        let cs = 65536;
        assert_eq!(TableEntry::decode(0, cs, 0, 0).unwrap(), TableEntry::Zeros);
        assert_eq!(TableEntry::decode(1, cs, 0, 0).unwrap(), TableEntry::Ones);
        assert_eq!(
            TableEntry::decode(0x5_0000, cs, 0, 0).unwrap(),
            TableEntry::Data(0x5_0000)
        );
        let err = TableEntry::decode(0x5_0001, cs, 0x3_0000, 2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("0x30010"), "{err}");
        assert!(TableEntry::decode(0x5_0200, cs, 0, 0).is_err());
        assert!(TableEntry::decode(1 << 60, cs, 0, 0).is_err());
        for e in [
            TableEntry::Zeros,
            TableEntry::Ones,
            TableEntry::Data(0x7_0000),
        ] {
            assert_eq!(TableEntry::decode(e.encode(), cs, 0, 0).unwrap(), e);
        }
    }

    #[test]
    fn flag_names_match_qemu_img() {
        let e = BitmapEntry {
            table_offset: 0,
            table_size: 0,
            flags: FLAG_IN_USE | FLAG_AUTO,
            kind: 1,
            granularity_bits: 16,
            extra_data: vec![],
            name: b"b".to_vec(),
        };
        assert_eq!(e.flag_names(), vec!["in-use", "auto"]);
        assert_eq!(e.granularity(), 65536);
    }
}

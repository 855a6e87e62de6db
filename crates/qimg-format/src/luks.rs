//! The LUKS (version 1) header that a LUKS-encrypted qcow2 image (`crypt_method` 2) keeps in
//! the clusters its full disk encryption header extension (0x0537BE77) names: decoded for
//! `info`, which shows it as QEMU does (`encrypt:` with the cipher, hash, key slots and
//! payload offset), and encoded for a new image. Only bytes here: the key derivation and the
//! ciphers are `qimg::crypto`'s.
//!
//! Layout (all integers big-endian): magic `LUKS\xba\xbe` (6 bytes), version (u16, 1), cipher
//! name (32 bytes, NUL padded), cipher mode (32), hash spec (32), payload offset (u32,
//! sectors), key bytes (u32), master key digest (20), its salt (32), its iterations (u32),
//! UUID (40), then eight key slots of 48 bytes: active (u32, `0x00AC71F3` or `0x0000DEAD`),
//! iterations (u32), salt (32), key material offset (u32, sectors), stripes (u32).

use crate::error::FormatError;

/// The header's size in bytes.
pub const LUKS_HEADER_LEN: usize = 592;

/// The magic at offset 0.
pub const LUKS_MAGIC: [u8; 6] = *b"LUKS\xba\xbe";

/// A key slot's `active` value when it holds a key.
pub const SLOT_ACTIVE: u32 = 0x00AC_71F3;

/// A key slot's `active` value when it holds none.
pub const SLOT_INACTIVE: u32 = 0x0000_DEAD;

/// LUKS sectors are 512 bytes.
const SECTOR: u64 = 512;

/// One key slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LuksSlot {
    /// It holds a key.
    pub active: bool,
    /// PBKDF2 iterations of its passphrase.
    pub iterations: u32,
    /// The PBKDF2 salt of its passphrase.
    pub salt: [u8; 32],
    /// Where its key material starts, in bytes from the header's start.
    pub key_offset: u64,
    /// The anti-forensic stripes of its key material.
    pub stripes: u32,
}

/// A decoded LUKS header (what `info` shows).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LuksHeader {
    /// Cipher name (`aes`, `serpent`, `twofish`, `cast5`, `sm4`).
    pub cipher_name: String,
    /// Cipher mode and IV generator (`xts-plain64`, `cbc-essiv:sha256`).
    pub cipher_mode: String,
    /// Hash of the key derivation and the anti-forensic splitter (`sha256`).
    pub hash_spec: String,
    /// Where the payload starts, in bytes.
    pub payload_offset: u64,
    /// The master key's length in bytes.
    pub key_bytes: u32,
    /// The master key's PBKDF2 digest (what a candidate key must hash to).
    pub master_key_digest: [u8; 20],
    /// Its salt.
    pub master_key_salt: [u8; 32],
    /// PBKDF2 iterations of the master key digest.
    pub master_key_iterations: u32,
    /// The volume's UUID.
    pub uuid: String,
    /// The eight key slots.
    pub slots: Vec<LuksSlot>,
}

/// A NUL-padded text field.
fn text(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn array<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&b[at..at + N]);
    out
}

/// `text` into a NUL-padded field (cut to leave one NUL).
fn put_text(field: &mut [u8], text: &str) {
    let n = text.len().min(field.len() - 1);
    field[..n].copy_from_slice(&text.as_bytes()[..n]);
}

impl LuksHeader {
    /// Decodes the header from `bytes` found at file offset `offset` (for errors).
    pub fn decode(bytes: &[u8], offset: u64) -> Result<Self, FormatError> {
        if bytes.len() < LUKS_HEADER_LEN {
            return Err(FormatError::Truncated {
                what: "LUKS header",
                offset,
                need: LUKS_HEADER_LEN as u64,
                have: bytes.len() as u64,
            });
        }
        if bytes[..6] != LUKS_MAGIC {
            return Err(FormatError::InvalidField {
                what: "LUKS magic",
                offset,
                value: u64::from_be_bytes([
                    0, 0, bytes[0], bytes[1], bytes[2], bytes[3], bytes[4], bytes[5],
                ]),
                reason: "Volume is not in LUKS format".into(),
            });
        }
        let version = u16::from_be_bytes([bytes[6], bytes[7]]);
        if version != 1 {
            return Err(FormatError::InvalidField {
                what: "LUKS version",
                offset: offset + 6,
                value: u64::from(version),
                reason: format!("LUKS version {version} is not supported"),
            });
        }
        let slots = (0..8)
            .map(|i| {
                let at = 208 + i * 48;
                let active = u32_at(bytes, at);
                if active != SLOT_ACTIVE && active != SLOT_INACTIVE {
                    return Err(FormatError::InvalidField {
                        what: "LUKS key slot state",
                        offset: offset + at as u64,
                        value: u64::from(active),
                        reason: format!("Keyslot {i} state (active/disable) is corrupted"),
                    });
                }
                Ok(LuksSlot {
                    active: active == SLOT_ACTIVE,
                    iterations: u32_at(bytes, at + 4),
                    salt: array(bytes, at + 8),
                    key_offset: u64::from(u32_at(bytes, at + 40)) * SECTOR,
                    stripes: u32_at(bytes, at + 44),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(LuksHeader {
            cipher_name: text(&bytes[8..40]),
            cipher_mode: text(&bytes[40..72]),
            hash_spec: text(&bytes[72..104]),
            payload_offset: u64::from(u32_at(bytes, 104)) * SECTOR,
            key_bytes: u32_at(bytes, 108),
            master_key_digest: array(bytes, 112),
            master_key_salt: array(bytes, 132),
            master_key_iterations: u32_at(bytes, 164),
            uuid: text(&bytes[168..208]),
            slots,
        })
    }

    /// The header's bytes ([`decode`](Self::decode)'s inverse; offsets must be whole sectors).
    pub fn encode(&self) -> [u8; LUKS_HEADER_LEN] {
        let mut b = [0u8; LUKS_HEADER_LEN];
        b[..6].copy_from_slice(&LUKS_MAGIC);
        b[6..8].copy_from_slice(&1u16.to_be_bytes());
        put_text(&mut b[8..40], &self.cipher_name);
        put_text(&mut b[40..72], &self.cipher_mode);
        put_text(&mut b[72..104], &self.hash_spec);
        b[104..108].copy_from_slice(&((self.payload_offset / SECTOR) as u32).to_be_bytes());
        b[108..112].copy_from_slice(&self.key_bytes.to_be_bytes());
        b[112..132].copy_from_slice(&self.master_key_digest);
        b[132..164].copy_from_slice(&self.master_key_salt);
        b[164..168].copy_from_slice(&self.master_key_iterations.to_be_bytes());
        put_text(&mut b[168..208], &self.uuid);
        for (i, slot) in self.slots.iter().take(8).enumerate() {
            let at = 208 + i * 48;
            let state = if slot.active {
                SLOT_ACTIVE
            } else {
                SLOT_INACTIVE
            };
            b[at..at + 4].copy_from_slice(&state.to_be_bytes());
            b[at + 4..at + 8].copy_from_slice(&slot.iterations.to_be_bytes());
            b[at + 8..at + 40].copy_from_slice(&slot.salt);
            b[at + 40..at + 44].copy_from_slice(&((slot.key_offset / SECTOR) as u32).to_be_bytes());
            b[at + 44..at + 48].copy_from_slice(&slot.stripes.to_be_bytes());
        }
        b
    }

    /// The cipher as QEMU names it (`aes-256`): the name and the key size in bits, the key
    /// halved in XTS mode (which takes two keys).
    pub fn cipher_alg(&self) -> String {
        let bits = u64::from(self.key_bytes) * 8;
        let bits = if self.mode() == "xts" { bits / 2 } else { bits };
        format!("{}-{bits}", self.cipher_name)
    }

    /// The cipher mode (`xts`, `cbc`): the cipher mode field up to its `-`.
    pub fn mode(&self) -> &str {
        self.cipher_mode.split('-').next().unwrap_or("")
    }

    /// The IV generator (`plain64`, `essiv`) and, for ESSIV, its hash.
    pub fn ivgen(&self) -> (&str, Option<&str>) {
        let iv = self.cipher_mode.split_once('-').map_or("", |(_, iv)| iv);
        match iv.split_once(':') {
            Some((alg, hash)) => (alg, Some(hash)),
            None => (iv, None),
        }
    }
}

/// A hash of the concatenation of its parts (the header's `hash_spec`, which the caller
/// computes: this crate has no cryptography).
pub type HashFn<'a> = &'a dyn Fn(&[&[u8]]) -> Vec<u8>;

/// The anti-forensic splitter's diffusion: each digest-sized block of `buf` replaced by the
/// hash of its index (big-endian u32) and itself, a last partial block by a prefix of it.
fn diffuse(hash: HashFn<'_>, digest_len: usize, buf: &mut [u8]) {
    for (i, block) in buf.chunks_mut(digest_len.max(1)).enumerate() {
        let d = hash(&[&(i as u32).to_be_bytes(), block]);
        let len = block.len();
        block.copy_from_slice(&d[..len]);
    }
}

fn xor(dst: &mut [u8], src: &[u8]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d ^= s;
    }
}

/// AF merge: the key of `key_len` bytes that `stripes` stripes of `split` make (a key slot's
/// decrypted key material).
pub fn af_merge(
    split: &[u8],
    key_len: usize,
    stripes: usize,
    hash: HashFn<'_>,
    digest_len: usize,
) -> Vec<u8> {
    let mut buf = vec![0u8; key_len];
    for i in 0..stripes.saturating_sub(1) {
        xor(&mut buf, &split[i * key_len..(i + 1) * key_len]);
        diffuse(hash, digest_len, &mut buf);
    }
    let last = stripes.saturating_sub(1) * key_len;
    xor(&mut buf, &split[last..last + key_len]);
    buf
}

/// AF split: `key` into `stripes` stripes, the first `stripes - 1` being `random` (that many
/// key lengths of random bytes), the last made so that [`af_merge`] gives `key` back.
pub fn af_split(
    key: &[u8],
    random: &[u8],
    stripes: usize,
    hash: HashFn<'_>,
    digest_len: usize,
) -> Vec<u8> {
    let n = key.len();
    let mut out = random[..n * stripes.saturating_sub(1)].to_vec();
    let mut buf = vec![0u8; n];
    for i in 0..stripes.saturating_sub(1) {
        xor(&mut buf, &out[i * n..(i + 1) * n]);
        diffuse(hash, digest_len, &mut buf);
    }
    xor(&mut buf, key);
    out.extend_from_slice(&buf);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Vec<u8> {
        let mut b = vec![0u8; LUKS_HEADER_LEN];
        b[..6].copy_from_slice(&LUKS_MAGIC);
        b[6..8].copy_from_slice(&1u16.to_be_bytes());
        b[8..11].copy_from_slice(b"aes");
        b[40..56].copy_from_slice(b"cbc-essiv:sha256");
        b[72..78].copy_from_slice(b"sha256");
        b[104..108].copy_from_slice(&4040u32.to_be_bytes());
        b[108..112].copy_from_slice(&32u32.to_be_bytes());
        b[164..168].copy_from_slice(&1000u32.to_be_bytes());
        b[168..172].copy_from_slice(b"abcd");
        for i in 0..8 {
            let at = 208 + i * 48;
            let state = if i == 0 { SLOT_ACTIVE } else { SLOT_INACTIVE };
            b[at..at + 4].copy_from_slice(&state.to_be_bytes());
            b[at + 4..at + 8].copy_from_slice(&7u32.to_be_bytes());
            b[at + 40..at + 44].copy_from_slice(&(8 + i as u32 * 504).to_be_bytes());
            b[at + 44..at + 48].copy_from_slice(&4000u32.to_be_bytes());
        }
        b
    }

    #[test]
    fn a_header_decodes_with_qemus_names() {
        let h = LuksHeader::decode(&header(), 0x10000).unwrap();
        assert_eq!(h.cipher_alg(), "aes-256");
        assert_eq!(h.mode(), "cbc");
        assert_eq!(h.ivgen(), ("essiv", Some("sha256")));
        assert_eq!(h.hash_spec, "sha256");
        assert_eq!(h.payload_offset, 4040 * 512);
        assert_eq!(h.uuid, "abcd");
        assert!(h.slots[0].active && !h.slots[1].active);
        assert_eq!(h.slots[1].key_offset, 512 * 512);
        assert_eq!(h.encode().to_vec(), header());
    }

    #[test]
    fn af_merge_undoes_af_split() {
        // Any function works as the hash for the layout; a byte sum spread over 20 bytes.
        let hash = |parts: &[&[u8]]| {
            let sum: u32 = parts
                .iter()
                .flat_map(|p| p.iter())
                .map(|&b| u32::from(b))
                .sum();
            (0..20)
                .map(|i| (sum >> (i % 4)) as u8 ^ i)
                .collect::<Vec<u8>>()
        };
        let key: Vec<u8> = (0..64u8).collect();
        let random: Vec<u8> = (0..64 * 39).map(|i| (i * 7) as u8).collect();
        let split = af_split(&key, &random, 40, &hash, 20);
        assert_eq!(split.len(), 64 * 40);
        assert_eq!(af_merge(&split, 64, 40, &hash, 20), key);
    }

    #[test]
    fn damage_is_named_with_its_offset() {
        let mut b = header();
        b[0] = b'X';
        let e = LuksHeader::decode(&b, 0x10000).unwrap_err().to_string();
        assert!(
            e.contains("not in LUKS format") && e.contains("0x10000"),
            "{e}"
        );
        let mut b = header();
        b[208 + 48..208 + 52].copy_from_slice(&5u32.to_be_bytes());
        let e = LuksHeader::decode(&b, 0).unwrap_err().to_string();
        assert!(e.contains("Keyslot 1") && e.contains("0x100"), "{e}");
        let e = LuksHeader::decode(&b[..100], 0).unwrap_err().to_string();
        assert!(e.contains("truncated"), "{e}");
    }
}

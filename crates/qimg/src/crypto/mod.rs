//! LUKS encryption of qcow2 images (`crypt_method` 2): unlocking a key slot with a
//! passphrase (PBKDF2, the anti-forensic splitter, the master key digest), making a new LUKS
//! header with one key slot, and the sector ciphers data clusters are encrypted with
//! ([`cipher`]). The header's bytes are `qimg-format`'s ([`qimg_format::luks`]); the
//! primitives are RustCrypto's (`aes`, `cbc`, `sha1`, `sha2`, `hmac`, `pbkdf2`), XTS is
//! `xts-mode` over RustCrypto's traits, randomness `getrandom` (the kernel's).
//!
//! What QEMU does (`crypto/block-luks.c`), which this follows so that either opens the
//! other's images: 512-byte sectors; a key slot's key material is the master key split into
//! `stripes` pieces (AF split with the header's hash), encrypted with the key PBKDF2 derives
//! from the passphrase, IVs numbered from 0; the master key checks against the header's
//! digest (PBKDF2 of the key, 20 bytes).

pub mod cipher;

use std::time::{Duration, Instant};

use hmac::digest::Digest;
use qimg_format::luks::{LuksHeader, LuksSlot};

pub use cipher::{SECTOR, SectorCipher, sector_cipher};

/// What can go wrong unlocking or making a LUKS header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CryptoError {
    /// No active key slot opens with the passphrase (QEMU's words).
    #[error("Invalid password, cannot unlock any keyslot")]
    BadPassword,
    /// An algorithm or parameter qimg does not implement.
    #[error("unsupported LUKS parameter: {0}")]
    Unsupported(String),
    /// The header contradicts itself (a key slot past the header area, a key size of 0).
    #[error("invalid LUKS header: {0}")]
    Invalid(String),
    /// The kernel gave no random bytes.
    #[error("no random bytes: {0}")]
    Random(String),
}

/// The hashes LUKS names in `hash_spec` (and ESSIV in its IV generator).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hash {
    /// SHA-1.
    Sha1,
    /// SHA-224.
    Sha224,
    /// SHA-256.
    Sha256,
    /// SHA-384.
    Sha384,
    /// SHA-512.
    Sha512,
}

impl Hash {
    /// The hash LUKS (and QEMU's `hash-alg`) names `name`.
    pub fn from_name(name: &str) -> Result<Self, CryptoError> {
        Ok(match name {
            "sha1" => Hash::Sha1,
            "sha224" => Hash::Sha224,
            "sha256" => Hash::Sha256,
            "sha384" => Hash::Sha384,
            "sha512" => Hash::Sha512,
            other => return Err(CryptoError::Unsupported(format!("hash '{other}'"))),
        })
    }

    /// Its digest length in bytes.
    pub fn digest_len(self) -> usize {
        match self {
            Hash::Sha1 => 20,
            Hash::Sha224 => 28,
            Hash::Sha256 => 32,
            Hash::Sha384 => 48,
            Hash::Sha512 => 64,
        }
    }

    /// The digest of the concatenation of `parts`.
    pub fn digest(self, parts: &[&[u8]]) -> Vec<u8> {
        fn run<D: Digest>(parts: &[&[u8]]) -> Vec<u8> {
            let mut d = D::new();
            for p in parts {
                d.update(p);
            }
            d.finalize().to_vec()
        }
        match self {
            Hash::Sha1 => run::<sha1::Sha1>(parts),
            Hash::Sha224 => run::<sha2::Sha224>(parts),
            Hash::Sha256 => run::<sha2::Sha256>(parts),
            Hash::Sha384 => run::<sha2::Sha384>(parts),
            Hash::Sha512 => run::<sha2::Sha512>(parts),
        }
    }

    /// PBKDF2-HMAC of `password` with `salt` and `rounds`, `out.len()` bytes.
    pub fn pbkdf2(self, password: &[u8], salt: &[u8], rounds: u32, out: &mut [u8]) {
        use pbkdf2::pbkdf2_hmac;
        match self {
            Hash::Sha1 => pbkdf2_hmac::<sha1::Sha1>(password, salt, rounds, out),
            Hash::Sha224 => pbkdf2_hmac::<sha2::Sha224>(password, salt, rounds, out),
            Hash::Sha256 => pbkdf2_hmac::<sha2::Sha256>(password, salt, rounds, out),
            Hash::Sha384 => pbkdf2_hmac::<sha2::Sha384>(password, salt, rounds, out),
            Hash::Sha512 => pbkdf2_hmac::<sha2::Sha512>(password, salt, rounds, out),
        }
    }
}

/// AF merge with `hash` (`qimg-format` lays the stripes out).
fn af_merge(hash: Hash, split: &[u8], key_len: usize, stripes: usize) -> Vec<u8> {
    qimg_format::luks::af_merge(
        split,
        key_len,
        stripes,
        &|p| hash.digest(p),
        hash.digest_len(),
    )
}

/// AF split with `hash`, all stripes but the last random.
fn af_split(hash: Hash, key: &[u8], stripes: usize) -> Result<Vec<u8>, CryptoError> {
    let mut r = vec![0u8; key.len() * (stripes - 1)];
    random(&mut r)?;
    Ok(qimg_format::luks::af_split(
        key,
        &r,
        stripes,
        &|p| hash.digest(p),
        hash.digest_len(),
    ))
}

/// Fills `buf` with the kernel's random bytes.
fn random(buf: &mut [u8]) -> Result<(), CryptoError> {
    getrandom::fill(buf).map_err(|e| CryptoError::Random(e.to_string()))
}

/// The key material of a slot: `key_bytes * stripes` bytes, in whole sectors.
fn material_len(key_bytes: usize, stripes: usize) -> usize {
    (key_bytes * stripes).next_multiple_of(SECTOR)
}

/// The master key the passphrase `password` unlocks from `header`, whose key slots'
/// material `area` holds (the LUKS header area from its start: key offsets index it), and
/// the sector cipher it keys. Tries the active slots in order.
pub fn unlock(
    header: &LuksHeader,
    area: &[u8],
    password: &[u8],
) -> Result<Box<dyn SectorCipher>, CryptoError> {
    let hash = Hash::from_name(&header.hash_spec)?;
    let key_len = header.key_bytes as usize;
    if key_len == 0 || key_len > 256 {
        return Err(CryptoError::Invalid(format!("a key of {key_len} bytes")));
    }
    // The cipher and mode must be ones qimg has before any slot is tried.
    sector_cipher(
        &header.cipher_name,
        &header.cipher_mode,
        &vec![0u8; key_len],
    )?;
    for (i, slot) in header.slots.iter().enumerate().filter(|(_, s)| s.active) {
        let stripes = slot.stripes as usize;
        if stripes == 0 || stripes > 1 << 20 {
            return Err(CryptoError::Invalid(format!(
                "key slot {i} has {stripes} stripes"
            )));
        }
        let at = slot.key_offset as usize;
        let len = material_len(key_len, stripes);
        let Some(material) = area.get(at..at + len) else {
            return Err(CryptoError::Invalid(format!(
                "key slot {i}'s material at {at} ({len} bytes) is past the header area's {} bytes",
                area.len()
            )));
        };
        let mut slot_key = vec![0u8; key_len];
        hash.pbkdf2(password, &slot.salt, slot.iterations, &mut slot_key);
        let mut split = material.to_vec();
        sector_cipher(&header.cipher_name, &header.cipher_mode, &slot_key)?.decrypt(0, &mut split);
        let key = af_merge(hash, &split, key_len, stripes);
        let mut digest = [0u8; 20];
        hash.pbkdf2(
            &key,
            &header.master_key_salt,
            header.master_key_iterations,
            &mut digest,
        );
        if digest == header.master_key_digest {
            return sector_cipher(&header.cipher_name, &header.cipher_mode, &key);
        }
    }
    Err(CryptoError::BadPassword)
}

/// What a new LUKS header is made with (QEMU's `encrypt.*` create options).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LuksParams {
    /// `aes-128`, `aes-192` or `aes-256` (QEMU's `cipher-alg`; default `aes-256`).
    pub cipher_alg: String,
    /// `xts` or `cbc` (default `xts`).
    pub cipher_mode: String,
    /// `plain64`, `plain` or `essiv` (default `plain64`).
    pub ivgen_alg: String,
    /// ESSIV's hash (default `sha256`).
    pub ivgen_hash_alg: Option<String>,
    /// The hash of PBKDF2 and the splitter (default `sha256`).
    pub hash_alg: String,
    /// Milliseconds of PBKDF2 an unlock should take (default 2000).
    pub iter_time_ms: u64,
}

impl Default for LuksParams {
    fn default() -> Self {
        LuksParams {
            cipher_alg: "aes-256".into(),
            cipher_mode: "xts".into(),
            ivgen_alg: "plain64".into(),
            ivgen_hash_alg: None,
            hash_alg: "sha256".into(),
            iter_time_ms: 2000,
        }
    }
}

/// The stripes of a key slot (QEMU's and cryptsetup's).
const STRIPES: u32 = 4000;

/// Where the first key slot starts.
const FIRST_SLOT: u64 = 4096;

/// QEMU's floor of PBKDF2 iterations, for the master key digest and for a key slot.
const MIN_ITERATIONS: u64 = 1000;

/// PBKDF2 iterations of `hash` this machine runs in `ms` milliseconds (QEMU's
/// `qcrypto_pbkdf2_count_iters`: timed runs, doubled until one takes a tenth of a second).
fn iterations_for(hash: Hash, ms: u64) -> u64 {
    let mut rounds: u32 = 1 << 10;
    let mut out = [0u8; 32];
    loop {
        let start = Instant::now();
        hash.pbkdf2(b"calibration", &[0u8; 32], rounds, &mut out);
        let took = start.elapsed();
        if took >= Duration::from_millis(100) || rounds >= 1 << 30 {
            let per_ms = f64::from(rounds) / (took.as_secs_f64() * 1000.0).max(1e-3);
            return (per_ms * ms as f64) as u64;
        }
        rounds *= 2;
    }
}

/// The sizes of a LUKS header area made with `params`.
struct Shape {
    /// Cipher name (`aes`).
    name: String,
    /// Master key bytes.
    key_len: usize,
    /// Cipher mode as the header names it (`xts-plain64`).
    mode: String,
    /// Key material bytes of a slot (whole sectors).
    material: u64,
    /// Bytes from one slot to the next.
    slot_span: u64,
    /// The header area's length (where the payload would start).
    payload: u64,
}

fn shape(params: &LuksParams) -> Result<Shape, CryptoError> {
    let (name, bits) = params
        .cipher_alg
        .split_once('-')
        .ok_or_else(|| CryptoError::Unsupported(format!("cipher '{}'", params.cipher_alg)))?;
    let bits: usize = bits
        .parse()
        .map_err(|_| CryptoError::Unsupported(format!("cipher '{}'", params.cipher_alg)))?;
    let key_len = match params.cipher_mode.as_str() {
        "xts" => bits / 8 * 2,
        _ => bits / 8,
    };
    let mode = match params.ivgen_alg.as_str() {
        "essiv" => format!(
            "{}-essiv:{}",
            params.cipher_mode,
            params.ivgen_hash_alg.as_deref().unwrap_or("sha256")
        ),
        iv => format!("{}-{iv}", params.cipher_mode),
    };
    if key_len * STRIPES as usize % SECTOR != 0 {
        // QEMU asserts on key material that is not whole sectors (and so cannot open it).
        return Err(CryptoError::Unsupported(format!(
            "{}-{} with a {key_len}-byte key: its key material ({} bytes) is not whole \
             512-byte sectors, which QEMU cannot open",
            params.cipher_alg,
            params.cipher_mode,
            key_len * STRIPES as usize
        )));
    }
    let material = material_len(key_len, STRIPES as usize) as u64;
    let slot_span = material.next_multiple_of(FIRST_SLOT);
    Ok(Shape {
        name: name.to_string(),
        key_len,
        mode,
        material,
        slot_span,
        payload: FIRST_SLOT + 8 * slot_span,
    })
}

/// The length of the LUKS header area `params` make (what an image reserves for it: QEMU's
/// `measure` adds it, in whole clusters).
pub fn area_len(params: &LuksParams) -> Result<u64, CryptoError> {
    Ok(shape(params)?.payload)
}

/// A new LUKS header area for `password`: the header and slot 0's key material, in a buffer
/// as long as the header's payload offset (the area a qcow2 image keeps in its clusters;
/// unused slots zero), and the cipher of the new master key.
pub fn create(
    params: &LuksParams,
    password: &[u8],
) -> Result<(Vec<u8>, Box<dyn SectorCipher>), CryptoError> {
    let Shape {
        name,
        key_len,
        mode,
        material,
        slot_span,
        payload,
    } = shape(params)?;
    let name = name.as_str();
    let hash = Hash::from_name(&params.hash_alg)?;
    let mut key = vec![0u8; key_len];
    random(&mut key)?;
    let cipher = sector_cipher(name, &mode, &key)?;
    // As QEMU: the slot's PBKDF2 takes `iter-time`, the master key digest an eighth of it.
    let iters = iterations_for(hash, params.iter_time_ms);
    let master_iters = (iters / 8).clamp(MIN_ITERATIONS, u64::from(u32::MAX));
    let slot_iters = iters.clamp(MIN_ITERATIONS, u64::from(u32::MAX));
    let mut master_key_salt = [0u8; 32];
    random(&mut master_key_salt)?;
    let mut master_key_digest = [0u8; 20];
    hash.pbkdf2(
        &key,
        &master_key_salt,
        master_iters as u32,
        &mut master_key_digest,
    );
    let mut slot_salt = [0u8; 32];
    random(&mut slot_salt)?;
    let mut uuid = [0u8; 16];
    random(&mut uuid)?;
    uuid[6] = (uuid[6] & 0x0f) | 0x40;
    uuid[8] = (uuid[8] & 0x3f) | 0x80;
    let hex: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    let uuid = format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    );
    let slots = (0..8u64)
        .map(|i| LuksSlot {
            active: i == 0,
            iterations: if i == 0 { slot_iters as u32 } else { 0 },
            salt: if i == 0 { slot_salt } else { [0u8; 32] },
            key_offset: FIRST_SLOT + i * slot_span,
            stripes: STRIPES,
        })
        .collect();
    let header = LuksHeader {
        cipher_name: name.to_string(),
        cipher_mode: mode.clone(),
        hash_spec: params.hash_alg.clone(),
        payload_offset: payload,
        key_bytes: key_len as u32,
        master_key_digest,
        master_key_salt,
        master_key_iterations: master_iters as u32,
        uuid,
        slots,
    };
    let mut slot_key = vec![0u8; key_len];
    hash.pbkdf2(password, &slot_salt, slot_iters as u32, &mut slot_key);
    let mut split = af_split(hash, &key, STRIPES as usize)?;
    split.resize(material as usize, 0);
    sector_cipher(name, &mode, &slot_key)?.encrypt(0, &mut split);
    let mut area = vec![0u8; payload as usize];
    area[..qimg_format::luks::LUKS_HEADER_LEN].copy_from_slice(&header.encode());
    area[FIRST_SLOT as usize..(FIRST_SLOT + material) as usize].copy_from_slice(&split);
    Ok((area, cipher))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn af_merge_undoes_af_split() {
        let key: Vec<u8> = (0..64u8).collect();
        for hash in [Hash::Sha1, Hash::Sha256, Hash::Sha512] {
            let split = af_split(hash, &key, 40).unwrap();
            assert_eq!(af_merge(hash, &split, 64, 40), key);
        }
    }

    #[test]
    fn a_new_header_unlocks_with_its_password_only() {
        for (alg, mode, iv) in [
            ("aes-256", "xts", "plain64"),
            ("aes-128", "cbc", "essiv"),
            ("aes-192", "xts", "plain"),
        ] {
            let params = LuksParams {
                cipher_alg: alg.into(),
                cipher_mode: mode.into(),
                ivgen_alg: iv.into(),
                iter_time_ms: 1,
                ..LuksParams::default()
            };
            let (area, cipher) = create(&params, b"123456").unwrap();
            let header = LuksHeader::decode(&area, 0).unwrap();
            let mut data = vec![7u8; 2048];
            cipher.encrypt(100, &mut data);
            assert_ne!(data, vec![7u8; 2048]);
            let opened = unlock(&header, &area, b"123456").unwrap();
            opened.decrypt(100, &mut data);
            assert_eq!(data, vec![7u8; 2048], "{alg}-{mode}-{iv}");
            assert_eq!(
                unlock(&header, &area, b"12345").unwrap_err(),
                CryptoError::BadPassword
            );
        }
    }
}

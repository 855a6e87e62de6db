//! Sector ciphers of LUKS: AES (128, 192 or 256 bits) in XTS or CBC mode, with the IV
//! generators QEMU and cryptsetup use (`plain64`, `plain`, `essiv:HASH`), each 512-byte
//! sector encrypted on its own with its sector number as the IV. The block cipher and the
//! modes are RustCrypto's (`aes`, `cbc`) and `xts-mode` (XTS over RustCrypto's `cipher`
//! traits); this module only picks them and feeds them sector numbers.

use aes::cipher::{BlockCipher, BlockDecrypt, BlockEncrypt, KeyInit};
use aes::{Aes128, Aes192, Aes256};
use cbc::cipher::{BlockDecryptMut, BlockEncryptMut, InnerIvInit};
use xts_mode::Xts128;

use super::{CryptoError, Hash};

/// The sector size of LUKS encryption.
pub const SECTOR: usize = 512;

/// Encrypts and decrypts whole sectors, numbered from `first` (the byte offset / 512 that
/// the IV generator takes).
pub trait SectorCipher: Send + Sync + std::fmt::Debug {
    /// Encrypts `buf` (whole sectors) in place.
    fn encrypt(&self, first: u64, buf: &mut [u8]);
    /// Decrypts `buf` (whole sectors) in place.
    fn decrypt(&self, first: u64, buf: &mut [u8]);
}

/// How a sector's IV is made from its number.
#[derive(Clone)]
enum IvGen {
    /// The low 32 bits, little-endian.
    Plain,
    /// The 64 bits, little-endian.
    Plain64,
    /// `plain64` encrypted with AES keyed with the hash of the data key.
    Essiv(Box<Aes256Or128>),
}

/// ESSIV's cipher: AES with the key size the hash gives (SHA-256: AES-256).
#[derive(Clone)]
enum Aes256Or128 {
    A128(Aes128),
    A192(Aes192),
    A256(Aes256),
}

impl IvGen {
    fn new(name: &str, key: &[u8]) -> Result<Self, CryptoError> {
        match name.split_once(':') {
            None if name == "plain64" => Ok(IvGen::Plain64),
            None if name == "plain" => Ok(IvGen::Plain),
            Some(("essiv", hash)) => {
                let h = Hash::from_name(hash)?;
                let salt = h.digest(&[key]);
                let c = match salt.len() {
                    16 => Aes256Or128::A128(Aes128::new_from_slice(&salt).map_err(bad_key)?),
                    24 => Aes256Or128::A192(Aes192::new_from_slice(&salt).map_err(bad_key)?),
                    32 => Aes256Or128::A256(Aes256::new_from_slice(&salt).map_err(bad_key)?),
                    n => {
                        return Err(CryptoError::Unsupported(format!(
                            "ESSIV with hash '{hash}' ({n}-byte digest)"
                        )));
                    }
                };
                Ok(IvGen::Essiv(Box::new(c)))
            }
            _ => Err(CryptoError::Unsupported(format!("IV generator '{name}'"))),
        }
    }

    fn iv(&self, sector: u64) -> [u8; 16] {
        let mut iv = [0u8; 16];
        match self {
            IvGen::Plain => iv[..4].copy_from_slice(&(sector as u32).to_le_bytes()),
            IvGen::Plain64 => iv[..8].copy_from_slice(&sector.to_le_bytes()),
            IvGen::Essiv(c) => {
                iv[..8].copy_from_slice(&sector.to_le_bytes());
                let block = aes::Block::from_mut_slice(&mut iv);
                match c.as_ref() {
                    Aes256Or128::A128(c) => c.encrypt_block(block),
                    Aes256Or128::A192(c) => c.encrypt_block(block),
                    Aes256Or128::A256(c) => c.encrypt_block(block),
                }
            }
        }
        iv
    }
}

fn bad_key(_: aes::cipher::InvalidLength) -> CryptoError {
    CryptoError::Unsupported("a key of this length".into())
}

/// XTS: the key's two halves, data and tweak.
struct Xts<C: BlockEncrypt + BlockDecrypt + BlockCipher> {
    xts: Xts128<C>,
    ivgen: IvGen,
}

/// CBC: the block cipher, and the IV of each sector.
struct Cbc<C> {
    cipher: C,
    ivgen: IvGen,
}

impl<C: BlockEncrypt + BlockDecrypt + BlockCipher> std::fmt::Debug for Xts<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Xts")
    }
}

impl<C> std::fmt::Debug for Cbc<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Cbc")
    }
}

impl<C> SectorCipher for Xts<C>
where
    C: BlockEncrypt + BlockDecrypt + BlockCipher + Send + Sync,
{
    fn encrypt(&self, first: u64, buf: &mut [u8]) {
        for (i, s) in buf.chunks_exact_mut(SECTOR).enumerate() {
            self.xts.encrypt_sector(s, self.ivgen.iv(first + i as u64));
        }
    }

    fn decrypt(&self, first: u64, buf: &mut [u8]) {
        for (i, s) in buf.chunks_exact_mut(SECTOR).enumerate() {
            self.xts.decrypt_sector(s, self.ivgen.iv(first + i as u64));
        }
    }
}

impl<C> SectorCipher for Cbc<C>
where
    C: BlockEncrypt + BlockDecrypt + BlockCipher + Clone + Send + Sync,
    C: aes::cipher::BlockSizeUser<BlockSize = aes::cipher::consts::U16>,
{
    fn encrypt(&self, first: u64, buf: &mut [u8]) {
        for (i, s) in buf.chunks_exact_mut(SECTOR).enumerate() {
            let iv = self.ivgen.iv(first + i as u64);
            let mut enc = cbc::Encryptor::<C>::inner_iv_init(self.cipher.clone(), &iv.into());
            for block in s.chunks_exact_mut(16) {
                enc.encrypt_block_mut(aes::Block::from_mut_slice(block));
            }
        }
    }

    fn decrypt(&self, first: u64, buf: &mut [u8]) {
        for (i, s) in buf.chunks_exact_mut(SECTOR).enumerate() {
            let iv = self.ivgen.iv(first + i as u64);
            let mut dec = cbc::Decryptor::<C>::inner_iv_init(self.cipher.clone(), &iv.into());
            for block in s.chunks_exact_mut(16) {
                dec.decrypt_block_mut(aes::Block::from_mut_slice(block));
            }
        }
    }
}

/// The cipher LUKS names `cipher_name` (`aes`) in mode `cipher_mode` (`xts-plain64`,
/// `cbc-essiv:sha256`) with `key` (for XTS, both halves).
pub fn sector_cipher(
    cipher_name: &str,
    cipher_mode: &str,
    key: &[u8],
) -> Result<Box<dyn SectorCipher>, CryptoError> {
    if cipher_name != "aes" {
        return Err(CryptoError::Unsupported(format!("cipher '{cipher_name}'")));
    }
    let (mode, iv) = cipher_mode
        .split_once('-')
        .ok_or_else(|| CryptoError::Unsupported(format!("cipher mode '{cipher_mode}'")))?;
    let ivgen = IvGen::new(iv, key)?;
    let unsupported =
        || CryptoError::Unsupported(format!("aes-{mode} with a {}-byte key", key.len()));
    match (mode, key.len()) {
        ("xts", 32) => Ok(Box::new(xts::<Aes128>(key, ivgen)?)),
        ("xts", 48) => Ok(Box::new(xts::<Aes192>(key, ivgen)?)),
        ("xts", 64) => Ok(Box::new(xts::<Aes256>(key, ivgen)?)),
        ("cbc", 16) => Ok(Box::new(Cbc {
            cipher: Aes128::new_from_slice(key).map_err(bad_key)?,
            ivgen,
        })),
        ("cbc", 24) => Ok(Box::new(Cbc {
            cipher: Aes192::new_from_slice(key).map_err(bad_key)?,
            ivgen,
        })),
        ("cbc", 32) => Ok(Box::new(Cbc {
            cipher: Aes256::new_from_slice(key).map_err(bad_key)?,
            ivgen,
        })),
        _ => Err(unsupported()),
    }
}

fn xts<C>(key: &[u8], ivgen: IvGen) -> Result<Xts<C>, CryptoError>
where
    C: BlockEncrypt + BlockDecrypt + BlockCipher + KeyInit,
{
    let (a, b) = key.split_at(key.len() / 2);
    Ok(Xts {
        xts: Xts128::new(
            C::new_from_slice(a).map_err(bad_key)?,
            C::new_from_slice(b).map_err(bad_key)?,
        ),
        ivgen,
    })
}

//! [`CreateOptions`]: every `qemu-img create` option for qcow2 and raw, and their checks.

use std::path::Path;

use qimg_format::header::CompressionType;
use qimg_format::validate::{MAX_L1_BYTES, l1_entries_for};

use crate::chain::{ImageFormat, probe_format, resolve_backing, virtual_size_of};
use crate::error::{Error, Result};

/// Version of the image format (`compat` option).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compat {
    /// qcow2 version 2 (`0.10`, `v2`).
    V2,
    /// qcow2 version 3 (`1.1`, `v3`), the default.
    V3,
}

/// Preallocation mode (`preallocation` option).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preallocation {
    /// Allocate nothing beyond the L1 table.
    Off,
    /// Allocate L2 tables and map every data cluster, without writing data.
    Metadata,
    /// As `Metadata`, and reserve the data clusters with fallocate.
    Falloc,
    /// As `Metadata`, and write zeros to every data cluster.
    Full,
}

impl Preallocation {
    /// The option value (`off`, `metadata`, `falloc`, `full`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Metadata => "metadata",
            Self::Falloc => "falloc",
            Self::Full => "full",
        }
    }
}

/// Everything `qimg create` can set, with qemu-img's defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateOptions {
    /// Virtual size in bytes; `None` takes the backing file's size. Rounded up to 512.
    pub size: Option<u64>,
    /// Cluster size in bytes (default 65536).
    pub cluster_size: u64,
    /// Format version (default v3).
    pub compat: Compat,
    /// 128-bit L2 entries with 32 subclusters per cluster.
    pub extended_l2: bool,
    /// Refcount width (default 16).
    pub refcount_bits: u64,
    /// Set the lazy refcounts compatible feature.
    pub lazy_refcounts: bool,
    /// Backing file name as it is to be stored in the image.
    pub backing_file: Option<String>,
    /// Backing file format.
    pub backing_fmt: Option<String>,
    /// Compression type of compressed clusters.
    pub compression_type: CompressionType,
    /// Preallocation mode.
    pub preallocation: Preallocation,
    /// External data file name.
    pub data_file: Option<String>,
    /// The external data file is kept a valid raw image.
    pub data_file_raw: bool,
    /// Do not open the backing file (qemu-img `-u`); then `size` is required.
    pub unsafe_backing: bool,
    /// LUKS encryption (QEMU's `encrypt.format=luks`): the header's parameters and the
    /// passphrase of its key slot 0.
    pub encryption: Option<Encryption>,
}

/// How a new image is encrypted (QEMU's `encrypt.*` options, `encrypt.format=luks`).
#[derive(Clone, PartialEq, Eq)]
pub struct Encryption {
    /// Cipher, mode, IV generator, hash and PBKDF2 time.
    pub params: crate::crypto::LuksParams,
    /// The passphrase (QEMU's `encrypt.key-secret`'s data).
    pub passphrase: Vec<u8>,
}

impl std::fmt::Debug for Encryption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encryption")
            .field("params", &self.params)
            .finish_non_exhaustive()
    }
}

impl Default for CreateOptions {
    fn default() -> Self {
        Self {
            size: None,
            cluster_size: 65536,
            compat: Compat::V3,
            extended_l2: false,
            refcount_bits: 16,
            lazy_refcounts: false,
            backing_file: None,
            backing_fmt: None,
            compression_type: CompressionType::Zlib,
            preallocation: Preallocation::Off,
            data_file: None,
            data_file_raw: false,
            unsafe_backing: false,
            encryption: None,
        }
    }
}

/// Progress callback: bytes done and bytes in total of the long part of the work.
pub type Progress<'a> = &'a mut dyn FnMut(u64, u64);

const UPGRADE_HINT: &str = "(use version=v3 or greater)";

impl CreateOptions {
    /// Checks the option combination the way qemu-img does, with the same messages.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidOption(m));
        let cs = self.cluster_size;
        if !cs.is_power_of_two() || !(512..=2 << 20).contains(&cs) {
            return bad(format!(
                "cluster_size {cs}: Cluster size must be a power of two between 512 and 2048k"
            ));
        }
        let v2 = self.compat == Compat::V2;
        if v2 && self.extended_l2 {
            return bad(format!(
                "extended_l2: Extended L2 entries are only supported with compatibility level 1.1 and above {UPGRADE_HINT}"
            ));
        }
        if self.extended_l2 && cs < 16384 {
            return bad(format!(
                "extended_l2 with cluster_size {cs}: Extended L2 entries are only supported with cluster sizes of at least 16384 bytes"
            ));
        }
        let rb = self.refcount_bits;
        if !rb.is_power_of_two() || rb > 64 {
            return bad(format!(
                "refcount_bits {rb}: Refcount width must be a power of two and may not exceed 64 bits"
            ));
        }
        if v2 && rb != 16 {
            return bad(format!(
                "refcount_bits {rb}: Different refcount widths than 16 bits require compatibility level 1.1 or above {UPGRADE_HINT}"
            ));
        }
        if v2 && self.lazy_refcounts {
            return bad(format!(
                "lazy_refcounts: Lazy refcounts only supported with compatibility level 1.1 and above {UPGRADE_HINT}"
            ));
        }
        if v2 && self.compression_type != CompressionType::Zlib {
            return bad(format!(
                "compression_type {}: Non-zlib compression type is only supported with compatibility level 1.1 and above {UPGRADE_HINT}",
                self.compression_type.name()
            ));
        }
        if v2 && self.data_file.is_some() {
            return bad(format!(
                "data_file: External data files are only supported with compatibility level 1.1 and above {UPGRADE_HINT}"
            ));
        }
        if self.data_file_raw && self.data_file.is_none() {
            return bad("data_file_raw: data-file-raw requires data-file".into());
        }
        if self.data_file_raw && self.backing_file.is_some() {
            return bad(
                "backing_file with data_file_raw: Backing file and data-file-raw cannot be used at the same time"
                    .into(),
            );
        }
        if self.encryption.is_some() && self.data_file_raw {
            return bad(
                "data_file_raw: qimg does not encrypt a raw external data file (it would not \
                 stay a raw image)"
                    .into(),
            );
        }
        if self.encryption.is_some() && self.preallocation != Preallocation::Off {
            return bad(format!(
                "preallocation={}: qimg does not preallocate encrypted images (preallocated \
                 clusters would read as noise)",
                self.preallocation.name()
            ));
        }
        if self.backing_fmt.is_some() && self.backing_file.is_none() {
            return bad("backing_fmt: Backing format cannot be used without backing file".into());
        }
        if let Some(f) = &self.backing_fmt {
            if f.len() >= qimg_format::extensions::MAX_BACKING_FORMAT {
                return bad(format!("backing_fmt '{f}': the format name is too long"));
            }
        }
        if let Some(b) = &self.backing_file {
            if b.len() > qimg_format::extensions::MAX_BACKING_NAME {
                return bad(format!(
                    "backing_file: the name is {} bytes, at most 1023 are allowed",
                    b.len()
                ));
            }
        }
        if self.backing_file.is_some()
            && self.preallocation != Preallocation::Off
            && !self.extended_l2
        {
            return bad(format!(
                "preallocation={}: Backing file and preallocation can only be used at the same time if extended_l2 is on",
                self.preallocation.name()
            ));
        }
        if self.backing_file.is_some() && self.backing_fmt.is_none() {
            return bad("backing_fmt: Backing file specified without backing format".into());
        }
        if let Some(size) = self.size {
            if size > i64::MAX as u64 {
                return bad(format!("size {size}: Image size must be less than 8 EiB"));
            }
            let bits = cs.trailing_zeros();
            let l1 = l1_entries_for(size.next_multiple_of(512), bits, self.extended_l2);
            if l1.saturating_mul(8) > MAX_L1_BYTES {
                return bad(format!(
                    "size {size}: The image size is too large for file format 'qcow2' (try using a larger cluster size)"
                ));
            }
        }
        Ok(())
    }
}

/// The virtual size the image will get: the given size, or the backing file's, rounded up
/// to a multiple of 512 bytes. Opens the backing file unless `unsafe_backing` is set.
pub fn effective_size(path: &Path, opts: &CreateOptions) -> Result<u64> {
    let backing_size = match &opts.backing_file {
        Some(b) if !opts.unsafe_backing => {
            let full = resolve_backing(path, b);
            let fmt = match opts.backing_fmt.as_deref() {
                Some("qcow2") => ImageFormat::Qcow2,
                Some("raw") => ImageFormat::Raw,
                Some(other) => {
                    return Err(Error::InvalidOption(format!(
                        "backing_fmt '{other}': only qcow2 and raw backing files are supported"
                    )));
                }
                None => probe_format(&full)?,
            };
            Some(virtual_size_of(&full, fmt).map_err(|e| {
                Error::InvalidOption(format!("Could not open backing image '{b}': {e}"))
            })?)
        }
        _ => None,
    };
    let size = match (opts.size, backing_size) {
        (Some(s), _) => s,
        (None, Some(s)) => s,
        (None, None) => {
            return Err(Error::InvalidOption(
                "size: Image creation needs a size parameter".into(),
            ));
        }
    };
    Ok(size.next_multiple_of(512))
}

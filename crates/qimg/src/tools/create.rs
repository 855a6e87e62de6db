//! Creating a new qcow2 image (`qimg create`).
//!
//! The layout matches what `qemu-img create` writes whenever the refcount structures fit in
//! one refcount block (the common case): header and extensions in cluster 0, the refcount table
//! in cluster 1, the first refcount block in cluster 2, then the L1 table. Larger images get
//! as many refcount table clusters and blocks as they need, laid out contiguously, computed
//! up front so that every cluster is covered and refcounted exactly once.
//! With preallocation every L2 table is followed by the data clusters it maps.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use qimg_format::extensions::{Cluster0, Extension};
use qimg_format::features::{
    AUTOCLEAR_DATA_FILE_RAW, COMPAT_LAZY_REFCOUNTS, INCOMPAT_DATA_FILE, INCOMPAT_EXTENDED_L2,
    qemu_feature_table,
};
use qimg_format::geometry::RefcountGeometry;
use qimg_format::header::{CompressionType, Header};
use qimg_format::refcount;
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

/// Where everything goes in a fresh image, in clusters.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Layout {
    cluster_size: u64,
    reftable_clusters: u64,
    refblocks: u64,
    l1_entries: u64,
    l1_clusters: u64,
    /// Clusters of L2 tables plus mapped data, in the order they are laid out.
    prealloc_clusters: u64,
}

impl Layout {
    fn reftable_at(&self) -> u64 {
        1
    }
    fn refblocks_at(&self) -> u64 {
        1 + self.reftable_clusters
    }
    fn l1_at(&self) -> u64 {
        self.refblocks_at() + self.refblocks
    }
    fn prealloc_at(&self) -> u64 {
        self.l1_at() + self.l1_clusters
    }
    fn total(&self) -> u64 {
        self.prealloc_at() + self.prealloc_clusters
    }
}

fn plan(opts: &CreateOptions, size: u64) -> Result<Layout> {
    let cs = opts.cluster_size;
    let bits = cs.trailing_zeros();
    let l1_entries = l1_entries_for(size, bits, opts.extended_l2);
    let l1_clusters = (l1_entries * 8).div_ceil(cs);
    let prealloc_clusters = if opts.preallocation != Preallocation::Off || opts.data_file_raw {
        let data = if opts.data_file.is_some() {
            0
        } else {
            size.div_ceil(cs)
        };
        l1_entries + data
    } else {
        0
    };
    // Refcount table and blocks must cover everything, themselves included.
    let rg = RefcountGeometry::new(bits, rb_order(opts.refcount_bits))
        .map_err(|e| Error::InvalidOption(format!("refcount_bits {}: {e}", opts.refcount_bits)))?;
    let others = 1 + l1_clusters + prealloc_clusters;
    let meta = rg
        .refcount_metadata_for(others)
        .map_err(|e| Error::InvalidOption(format!("size {size}: {e}")))?;
    let layout = Layout {
        cluster_size: cs,
        reftable_clusters: meta.table_clusters.max(1),
        refblocks: meta.block_clusters.max(1),
        l1_entries,
        l1_clusters,
        prealloc_clusters,
    };
    if layout.reftable_clusters * cs > qimg_format::validate::MAX_REFTABLE_BYTES {
        return Err(Error::InvalidOption(format!(
            "size {size}: the refcount table would exceed 8 MiB (try a larger cluster size or refcount_bits)"
        )));
    }
    Ok(layout)
}

fn rb_order(bits: u64) -> u32 {
    bits.trailing_zeros()
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

/// Creates (or truncates) `path` as a new qcow2 image. Returns the virtual size.
///
/// `progress` is called during the long part of preallocation (writing or reserving data).
pub fn create(path: &Path, opts: &CreateOptions, progress: Progress<'_>) -> Result<u64> {
    opts.validate()?;
    let size = effective_size(path, opts)?;
    let mut checked = opts.clone();
    checked.size = Some(size);
    checked.validate()?;
    let layout = plan(opts, size)?;
    let cs = layout.cluster_size;

    let mut header = match opts.compat {
        Compat::V2 => Header::new_v2(cs.trailing_zeros(), size),
        Compat::V3 => Header::new_v3(cs.trailing_zeros(), size, rb_order(opts.refcount_bits)),
    };
    if opts.compat == Compat::V3 {
        header.set_compression_type(opts.compression_type);
        if opts.extended_l2 {
            header.incompatible_features |= INCOMPAT_EXTENDED_L2;
        }
        if opts.data_file.is_some() {
            header.incompatible_features |= INCOMPAT_DATA_FILE;
        }
        if opts.data_file_raw {
            header.autoclear_features |= AUTOCLEAR_DATA_FILE_RAW;
        }
        if opts.lazy_refcounts {
            header.compatible_features |= COMPAT_LAZY_REFCOUNTS;
        }
    }
    header.refcount_table_offset = layout.reftable_at() * cs;
    header.refcount_table_clusters = layout.reftable_clusters as u32;
    header.l1_size = layout.l1_entries as u32;
    header.l1_table_offset = if layout.l1_entries > 0 {
        layout.l1_at() * cs
    } else {
        0
    };
    let mut extensions = Vec::new();
    if let Some(f) = &opts.backing_fmt {
        extensions.push(Extension::BackingFormat(f.as_bytes().to_vec()));
    }
    if let Some(d) = &opts.data_file {
        extensions.push(Extension::DataFile(d.as_bytes().to_vec()));
    }
    if opts.compat == Compat::V3 && cs > 4096 {
        extensions.push(Extension::FeatureTable(qemu_feature_table()));
    }
    let mut c0 = Cluster0 {
        header,
        extensions,
        backing_file: opts.backing_file.as_ref().map(|b| b.as_bytes().to_vec()),
    };
    let cluster0 = c0.encode().map_err(|e| {
        Error::InvalidOption(format!("the header does not fit in one cluster: {e}"))
    })?;

    // Open the data file first so that a bad name fails before the image is touched.
    let data_file = match &opts.data_file {
        Some(d) => {
            // As QEMU: the data file name is relative to the current directory, not to the
            // image (unlike a backing file name).
            let full = PathBuf::from(d);
            Some((open_new(&full)?, full))
        }
        None => None,
    };
    let file = open_new(path)?;
    let w = |buf: &[u8], off: u64| {
        file.write_all_at(buf, off)
            .map_err(|e| Error::io(path, format!("write {} bytes at {off:#x}", buf.len()), e))
    };

    // Refcount table and blocks: every cluster of the layout has refcount 1.
    let order = rb_order(opts.refcount_bits);
    let mut table = vec![0u8; (layout.reftable_clusters * cs) as usize];
    for i in 0..layout.refblocks {
        let off = (layout.refblocks_at() + i) * cs;
        table[(i * 8) as usize..(i * 8 + 8) as usize].copy_from_slice(&off.to_be_bytes());
    }
    let per_block = (cs * 8) >> order;
    let mut block = vec![0u8; cs as usize];
    for i in 0..layout.refblocks {
        block.fill(0);
        let first = i * per_block;
        let last = (first + per_block).min(layout.total());
        for c in first..last {
            refcount::set(&mut block, order, c - first, 1).map_err(|e| Error::format(path, e))?;
        }
        w(&block, (layout.refblocks_at() + i) * cs)?;
    }
    w(&table, layout.reftable_at() * cs)?;

    // L1 (and, with preallocation, L2 tables and data).
    let mut l1 = vec![0u8; (layout.l1_entries * 8) as usize];
    let entry = if opts.extended_l2 { 16 } else { 8 };
    let l2_entries = cs / entry;
    let clusters = size.div_ceil(cs);
    let mut data_runs: Vec<(u64, u64)> = Vec::new();
    if layout.prealloc_clusters > 0 {
        let mut next = layout.prealloc_at();
        let mut l2 = vec![0u8; cs as usize];
        for i in 0..layout.l1_entries {
            let l2_off = next * cs;
            next += 1;
            l1[(i * 8) as usize..(i * 8 + 8) as usize]
                .copy_from_slice(&(l2_off | 1 << 63).to_be_bytes());
            l2.fill(0);
            let first = i * l2_entries;
            let n = clusters.saturating_sub(first).min(l2_entries);
            for j in 0..n {
                let host = if opts.data_file.is_some() {
                    (first + j) * cs
                } else {
                    let h = next * cs;
                    next += 1;
                    h
                };
                let at = (j * entry) as usize;
                l2[at..at + 8].copy_from_slice(&(host | 1 << 63).to_be_bytes());
            }
            if opts.data_file.is_none() && n > 0 {
                data_runs.push((l2_off + cs, n * cs));
            }
            w(&l2, l2_off)?;
        }
    }
    if !l1.is_empty() {
        w(&l1, layout.l1_at() * cs)?;
    }
    w(&cluster0, 0)?;

    // File length: the end of the L1 table as QEMU leaves it, or of the preallocated area.
    let end = if layout.prealloc_clusters > 0 {
        layout.total() * cs
    } else if layout.l1_entries > 0 {
        layout.l1_at() * cs + layout.l1_entries * 8
    } else {
        layout.l1_at() * cs
    };
    file.set_len(end)
        .map_err(|e| Error::io(path, format!("set length to {end}"), e))?;
    let total: u64 = data_runs.iter().map(|r| r.1).sum();
    match opts.preallocation {
        Preallocation::Falloc | Preallocation::Full if opts.data_file.is_none() => {
            fill(&file, path, &data_runs, opts.preallocation, total, progress)?;
        }
        _ => {}
    }
    if let Some((df, dpath)) = data_file {
        let len = if opts.preallocation != Preallocation::Off {
            size.next_multiple_of(cs)
        } else {
            size
        };
        df.set_len(len)
            .map_err(|e| Error::io(&dpath, format!("set length to {len}"), e))?;
        allocate_first_block(&df, &dpath, len)?;
        if matches!(
            opts.preallocation,
            Preallocation::Falloc | Preallocation::Full
        ) {
            fill(&df, &dpath, &[(0, len)], opts.preallocation, len, progress)?;
        }
        df.sync_all().map_err(|e| Error::io(&dpath, "fsync", e))?;
    }
    file.sync_all().map_err(|e| Error::io(path, "fsync", e))?;
    Ok(size)
}

/// Creates (or truncates) `path` as a raw image of `size` bytes. `Falloc` reserves the space,
/// `Full` writes zeros, anything else leaves the file sparse.
pub fn create_raw(
    path: &Path,
    size: u64,
    prealloc: Preallocation,
    progress: Progress<'_>,
) -> Result<()> {
    let file = open_new(path)?;
    file.set_len(size)
        .map_err(|e| Error::io(path, format!("set length to {size}"), e))?;
    allocate_first_block(&file, path, size)?;
    if matches!(prealloc, Preallocation::Falloc | Preallocation::Full) {
        fill(&file, path, &[(0, size)], prealloc, size, progress)?;
    }
    file.sync_all().map_err(|e| Error::io(path, "fsync", e))
}

/// Writes zeros over the first 4 KiB of a new raw file, as QEMU does so that the first block
/// is allocated and O_DIRECT alignment can be probed on it later.
fn allocate_first_block(file: &File, path: &Path, len: u64) -> Result<()> {
    let n = len.min(4096);
    if n > 0 {
        file.write_all_at(&vec![0u8; n as usize], 0)
            .map_err(|e| Error::io(path, format!("write {n} zero bytes at 0x0"), e))?;
    }
    Ok(())
}

fn open_new(path: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(|e| Error::io(path, "create", e))
}

/// Reserves (`Falloc`) or zero-fills (`Full`) the given byte runs, reporting progress.
fn fill(
    file: &File,
    path: &Path,
    runs: &[(u64, u64)],
    mode: Preallocation,
    total: u64,
    progress: Progress<'_>,
) -> Result<()> {
    const CHUNK: u64 = 8 << 20;
    let zeros = vec![0u8; CHUNK as usize];
    let mut done = 0;
    progress(0, total);
    for &(start, len) in runs {
        let mut off = start;
        while off < start + len {
            let n = CHUNK.min(start + len - off);
            match mode {
                Preallocation::Full => {
                    file.write_all_at(&zeros[..n as usize], off).map_err(|e| {
                        Error::io(path, format!("write {n} zero bytes at {off:#x}"), e)
                    })?;
                }
                _ => reserve(file, off, n)
                    .map_err(|e| Error::io(path, format!("fallocate {n} bytes at {off:#x}"), e))?,
            }
            off += n;
            done += n;
            progress(done, total);
        }
    }
    Ok(())
}

/// Reserves space without changing the contents: `posix_fallocate`-like, falling back to
/// writing zeros where the file system cannot allocate.
fn reserve(file: &File, off: u64, len: u64) -> std::io::Result<()> {
    use nix::fcntl::{FallocateFlags, fallocate};
    let (Ok(o), Ok(l)) = (i64::try_from(off), i64::try_from(len)) else {
        return Err(std::io::Error::other("range beyond i64"));
    };
    match fallocate(file, FallocateFlags::empty(), o, l) {
        Ok(()) => Ok(()),
        Err(_) => file.write_all_at(&vec![0u8; len as usize], off),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_images_get_qemus_layout() {
        let o = CreateOptions::default();
        let l = plan(&o, 1 << 30).unwrap();
        assert_eq!((l.reftable_at(), l.refblocks_at(), l.l1_at()), (1, 2, 3));
        assert_eq!(l.l1_entries, 2);
    }

    #[test]
    fn refcount_structures_cover_themselves() {
        for bits in [1u64, 2, 4, 8, 16, 32, 64] {
            for cs in [512u64, 4096, 65536] {
                let o = CreateOptions {
                    cluster_size: cs,
                    refcount_bits: bits,
                    preallocation: Preallocation::Metadata,
                    ..Default::default()
                };
                let size = if cs == 512 { 64 << 20 } else { 4 << 30 };
                let l = plan(&o, size).unwrap();
                let per_block = cs * 8 / bits;
                assert!(l.refblocks * per_block >= l.total(), "{l:?}");
                assert!(l.reftable_clusters * cs / 8 >= l.refblocks, "{l:?}");
                assert!(
                    (l.refblocks - 1) * per_block < l.total(),
                    "not minimal {l:?}"
                );
            }
        }
    }

    #[test]
    fn full_preallocation_reports_progress_up_to_the_whole_data_size() {
        let dir = std::env::temp_dir().join(format!("qimg-progress-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.qcow2");
        let opts = CreateOptions {
            size: Some(20 << 20),
            preallocation: Preallocation::Full,
            ..Default::default()
        };
        let mut calls = Vec::new();
        create(&path, &opts, &mut |d, t| calls.push((d, t))).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(calls.first(), Some(&(0, 20 << 20)));
        assert_eq!(calls.last(), Some(&(20 << 20, 20 << 20)));
        assert!(calls.len() >= 3, "{calls:?}");
        assert!(calls.windows(2).all(|w| w[0].0 <= w[1].0));
    }

    #[test]
    fn every_rule_names_its_option() {
        let cases: Vec<(CreateOptions, &str)> = vec![
            (
                CreateOptions {
                    cluster_size: 3000,
                    ..Default::default()
                },
                "cluster_size 3000",
            ),
            (
                CreateOptions {
                    extended_l2: true,
                    cluster_size: 8192,
                    ..Default::default()
                },
                "extended_l2",
            ),
            (
                CreateOptions {
                    refcount_bits: 3,
                    ..Default::default()
                },
                "refcount_bits 3",
            ),
            (
                CreateOptions {
                    compat: Compat::V2,
                    lazy_refcounts: true,
                    ..Default::default()
                },
                "lazy_refcounts",
            ),
            (
                CreateOptions {
                    size: Some(1 << 50),
                    cluster_size: 512,
                    ..Default::default()
                },
                "too large",
            ),
        ];
        for (o, want) in cases {
            let e = o.validate().unwrap_err().to_string();
            assert!(e.contains(want), "{e} lacks {want}");
        }
    }
}

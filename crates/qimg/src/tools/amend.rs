//! `qemu-img amend` for qcow2: changing the options of an existing image in place.
//!
//! | option | what changes |
//! |---|---|
//! | `compat` | upgrade v2 → v3 (112-byte header, feature name table); downgrade v3 → v2 (zero clusters expanded in place in every L2 table, the snapshots' too, as QEMU's `qcow2_expand_zero_clusters`: unallocated without a backing file, a cluster written with zeros otherwise; header back to 72 bytes; refused with a data file, extended L2, zstd-compressed clusters or refcount widths other than 16; persistent bitmaps stay, as QEMU leaves them) |
//! | `lazy_refcounts` | the compatible feature bit (v3 only) |
//! | `refcount_bits` | a new refcount table and blocks of the new width, computed from every reference in the image, placed past the end of the file; the header then switches to them and the old structure becomes free space |
//! | `data_file` | the name of the external data file (only for images that have one) |
//! | `data_file_raw` | `off` clears the raw-data-file bit; `on` only where it is set already (QEMU's rule) |
//! | `size` | the virtual size, growing or shrinking (as `qemu-img resize --shrink`) |
//!
//! The order is QEMU's: upgrade, refcount width, lazy refcounts, size, downgrade. Header
//! changes rewrite cluster 0 while the image is closed; data changes go through the engine.
//!
//! [`set_backing_file`] rewrites the backing file name and format (for `rebase`).

use std::fs::OpenOptions as FsOpen;
use std::os::unix::fs::FileExt;
use std::path::Path;

use qimg_format::cluster0::Cluster0;
use qimg_format::extension::Extension;
use qimg_format::features::{
    AUTOCLEAR_DATA_FILE_RAW, COMPAT_LAZY_REFCOUNTS, INCOMPAT_COMPRESSION, INCOMPAT_DATA_FILE,
    INCOMPAT_DIRTY, qemu_feature_table,
};
use qimg_format::geometry::RefcountGeometry;
use qimg_format::header::{self, CompressionType};
use qimg_format::refcount;
use qimg_format::units::HostOffset;
use qimg_format::validate::OpenMode;

use crate::chain::read_cluster0;
use crate::engine::walk::{Overflow, encode_refblock};
use crate::error::{Error, Result};
use crate::tools::create::Compat;
use crate::{ExtentKind, Image, OpenOptions};

/// What to change; `None` leaves an option as it is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AmendOptions {
    /// The format version.
    pub compat: Option<Compat>,
    /// The lazy refcounts feature.
    pub lazy_refcounts: Option<bool>,
    /// The refcount width in bits.
    pub refcount_bits: Option<u64>,
    /// The external data file name.
    pub data_file: Option<String>,
    /// Whether the external data file is raw: can only be turned off (or left on), as
    /// with qemu-img.
    pub data_file_raw: Option<bool>,
    /// The virtual size in bytes.
    pub size: Option<u64>,
}

fn refuse(msg: impl Into<String>) -> Error {
    Error::InvalidOption(msg.into())
}

/// Amends the qcow2 image at `path`; `progress(done, total)` is called as the work goes.
pub async fn amend(
    path: &Path,
    opts: &AmendOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    amend_with(path, opts, &OpenOptions::new(), progress).await
}

/// [`amend`], the image opened with `base` (the passphrase of an encrypted image, QEMU's
/// allocation behaviour) where it is opened through the engine.
pub async fn amend_with(
    path: &Path,
    opts: &AmendOptions,
    base: &OpenOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    let c0 = read_cluster0(path, OpenMode::ReadOnly)?;
    let h = &c0.header;
    let v3 = h.version >= 3;
    let new_v3 = match opts.compat {
        Some(Compat::V2) => false,
        Some(Compat::V3) => true,
        None => v3,
    };
    let has_data_file = h.incompatible_features & INCOMPAT_DATA_FILE != 0;
    if opts.data_file.is_some() && !has_data_file {
        return Err(refuse(
            "data-file can only be set for images that use an external data file",
        ));
    }
    let raw = h.autoclear_features & AUTOCLEAR_DATA_FILE_RAW != 0;
    if opts.data_file_raw == Some(true) && !raw {
        return Err(refuse("data-file-raw cannot be set on existing images"));
    }
    if let Some(bits) = opts.refcount_bits {
        if !bits.is_power_of_two() || bits > 64 {
            return Err(refuse(
                "Refcount width must be a power of two and may not exceed 64 bits",
            ));
        }
        if !new_v3 && bits != 16 {
            return Err(refuse(
                "Refcount widths other than 16 bits require compatibility level 1.1 or above \
                 (use compat=1.1 or greater)",
            ));
        }
    }
    if opts.lazy_refcounts == Some(true) && !new_v3 {
        return Err(refuse(
            "Lazy refcounts only supported with compatibility level 1.1 and above (use \
             compat=1.1 or greater)",
        ));
    }
    let downgrade = v3 && !new_v3;
    if downgrade {
        if has_data_file {
            return Err(refuse("Cannot downgrade an image with a data file"));
        }
        let other = h.incompatible_features & !(INCOMPAT_DIRTY | INCOMPAT_COMPRESSION);
        if other != 0 {
            return Err(refuse(format!(
                "Cannot downgrade an image with incompatible features {other:#x} set"
            )));
        }
        if h.refcount_order != 4 && opts.refcount_bits.is_none_or(|b| b != 16) {
            return Err(refuse("compat=0.10 requires refcount_bits=16"));
        }
    }
    // An upgrade in the same call comes first, as in QEMU.
    if opts.size.is_some() && !new_v3 && h.nb_snapshots > 0 {
        return Err(refuse("Can't resize a v2 image which has snapshots"));
    }
    let steps = 2;
    progress(0, steps);

    // Upgrade.
    if !v3 && new_v3 {
        rewrite_header(path, |c0| {
            let h = &mut c0.header;
            h.version = 3;
            h.header_length = header::QEMU_V3_HEADER_LEN;
            h.additional =
                vec![0; (header::QEMU_V3_HEADER_LEN - header::COMPRESSION_TYPE_OFFSET) as usize];
            h.refcount_order = 4;
            h.incompatible_features = 0;
            h.compatible_features = 0;
            h.autoclear_features = 0;
            c0.extensions
                .retain(|e| !matches!(e, Extension::FeatureTable(_)));
            c0.extensions
                .push(Extension::FeatureTable(qemu_feature_table()));
            c0.sort_like_qemu();
            Ok(())
        })?;
        // v3 snapshot entries carry at least 16 bytes of extra data: QEMU rewrites the
        // table of a v2 image whose entries have less.
        if h.nb_snapshots > 0 {
            let img = open(path, base).await?;
            let r = img.inner.complete_snapshot_table().await;
            img.close().await?;
            r?;
        }
    }
    // Refcount width.
    if let Some(bits) = opts.refcount_bits {
        let order = bits.trailing_zeros();
        if order
            != read_cluster0(path, OpenMode::ReadOnly)?
                .header
                .refcount_order
        {
            change_refcount_width(path, order, base).await?;
        }
    }
    // Lazy refcounts, data file name.
    let drop_raw = opts.data_file_raw == Some(false) && raw;
    if opts.lazy_refcounts.is_some() || opts.data_file.is_some() || drop_raw {
        // A dirty image gets its refcounts rebuilt by a writable open; close it clean.
        let img = open(path, base).await?;
        img.close().await?;
        rewrite_header(path, |c0| {
            if let Some(lazy) = opts.lazy_refcounts {
                if lazy {
                    c0.header.compatible_features |= COMPAT_LAZY_REFCOUNTS;
                } else {
                    c0.header.compatible_features &= !COMPAT_LAZY_REFCOUNTS;
                }
            }
            if drop_raw {
                c0.header.autoclear_features &= !AUTOCLEAR_DATA_FILE_RAW;
            }
            if let Some(name) = &opts.data_file {
                for e in &mut c0.extensions {
                    if let Extension::DataFile(n) = e {
                        *n = name.as_bytes().to_vec();
                    }
                }
            }
            Ok(())
        })?;
    }
    // Size.
    if let Some(size) = opts.size {
        let img = open(path, base).await?;
        let r = img.shrink(size).await;
        img.close().await?;
        r?;
    }
    progress(1, steps);
    // Downgrade.
    if downgrade {
        expand_zero_clusters(path, base).await?;
        rewrite_header(path, |c0| {
            let h = &mut c0.header;
            h.version = 2;
            h.header_length = header::V2_HEADER_LEN;
            h.additional = Vec::new();
            h.refcount_order = 4;
            h.incompatible_features = 0;
            h.compatible_features = 0;
            h.autoclear_features = 0;
            c0.extensions
                .retain(|e| !matches!(e, Extension::FeatureTable(_) | Extension::DataFile(_)));
            Ok(())
        })?;
    }
    progress(steps, steps);
    Ok(())
}

async fn open(path: &Path, base: &OpenOptions) -> Result<Image<crate::io::AnyStorage>> {
    base.clone()
        .writable(true)
        .clean_timer(false)
        .open(path)
        .await
}

/// Reads cluster 0, lets `change` edit it, and writes it back.
fn rewrite_header(path: &Path, change: impl FnOnce(&mut Cluster0) -> Result<()>) -> Result<()> {
    let f = FsOpen::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| Error::io(path, "open", e))?;
    // QEMU's write lock, as any writer of the image takes it: a header another process has
    // open (a VM's disk, a qemu-io session) is refused, never rewritten under it.
    let _lock = crate::io::ImageLock::ReadWrite
        .lock(&f)
        .map_err(|e| Error::storage(path, e))?;
    let mut c0 = read_cluster0(path, OpenMode::ReadOnly)?;
    change(&mut c0)?;
    let bytes = c0.encode().map_err(|e| Error::format(path, e))?;
    f.write_all_at(&bytes, 0)
        .and_then(|()| f.sync_all())
        .map_err(|e| Error::io(path, "write the header", e))
}

/// Before a downgrade: v2 has no zero clusters. Without a backing file they become
/// unallocated; with one they are written with zeros. zstd-compressed clusters cannot stay.
async fn expand_zero_clusters(path: &Path, base: &OpenOptions) -> Result<()> {
    let img = open(path, base).await?;
    let r = expand(&img).await;
    let closed = img.close().await;
    r.and(closed)
}

async fn expand(img: &Image<crate::io::AnyStorage>) -> Result<()> {
    let zstd = read_cluster0(img.path(), OpenMode::ReadOnly)?
        .header
        .compression_type()
        == Some(CompressionType::Zstd);
    let size = img.size();
    let extents = img.map(0, size).await?;
    if zstd
        && extents
            .iter()
            .any(|e| matches!(e.kind, ExtentKind::Compressed { .. }))
    {
        return Err(refuse(
            "Cannot downgrade an image with zstd compression type and existing compressed \
             clusters",
        ));
    }
    img.inner.expand_zero_clusters().await
}

/// Replaces the refcount structure with one of width `1 << order`, computed from every
/// reference in the image and placed past its end; then switches the header.
async fn change_refcount_width(path: &Path, order: u32, base: &OpenOptions) -> Result<()> {
    // A read-write open and close first (a dirty image repaired, the bitmaps stored: a
    // close moves them to new clusters, as QEMU's does); the plan is then made on a
    // read-only open, whose close writes nothing the plan did not count.
    open(path, base).await?.close().await?;
    let img = base.clone().clean_timer(false).open(path).await?;
    let planned = plan_refcounts(&img, order).await;
    img.close().await?;
    let (blocks, table, table_at, table_clusters) = planned?;
    let f = FsOpen::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| Error::io(path, "open", e))?;
    for (at, data) in &blocks {
        f.write_all_at(data, *at)
            .map_err(|e| Error::io(path, "write a refcount block", e))?;
    }
    f.write_all_at(&table, table_at)
        .and_then(|()| f.sync_all())
        .map_err(|e| Error::io(path, "write the refcount table", e))?;
    // One write switches table, size and width together (all within the first sector).
    let mut c0 = read_cluster0(path, OpenMode::ReadOnly)?;
    c0.header.refcount_table_offset = table_at;
    c0.header.refcount_table_clusters = table_clusters;
    c0.header.refcount_order = order;
    let hdr = c0.header.encode().map_err(|e| Error::format(path, e))?;
    f.write_all_at(&hdr[48..100], 48)
        .and_then(|()| f.sync_all())
        .map_err(|e| Error::io(path, "switch the refcount table", e))
}

/// Refcount blocks `(offset, bytes)`, the table, its offset and its size in clusters.
type Planned = (Vec<(u64, Vec<u8>)>, Vec<u8>, u64, u32);

async fn plan_refcounts(img: &Image<crate::io::AnyStorage>, order: u32) -> Result<Planned> {
    let inner = &img.inner;
    let path = img.path().to_path_buf();
    let cs = img.cluster_size();
    let rg = RefcountGeometry::new(cs.trailing_zeros(), order)
        .map_err(|e| refuse(format!("refcount_bits {}: {e}", 1u64 << order)))?;
    let m = inner.meta.lock().await;
    let refs = inner.count_references(&m).await?;
    let file_len = {
        use qimg_io::Storage;
        inner
            .shared
            .file
            .len()
            .await
            .map_err(|e| Error::storage(&path, e))?
    };
    let start = file_len
        .div_ceil(cs)
        .max(m.end_cluster())
        .max(refs.max_cluster().map_or(0, |c| c + 1));
    drop(m);
    // Blocks for every cluster up to the end of the new structure, which covers itself.
    let per_block = rg.refblock_entries();
    let per_table_cluster = cs / 8;
    let (mut nblocks, mut table_clusters) = (0u64, 1u64);
    loop {
        let end = start + nblocks + table_clusters;
        let nb = end.div_ceil(per_block);
        let tc = nb.div_ceil(per_table_cluster).max(1);
        if nb == nblocks && tc == table_clusters {
            break;
        }
        (nblocks, table_clusters) = (nb, tc);
    }
    let end = start + nblocks + table_clusters;
    let mut entries = Vec::new();
    let mut blocks = Vec::new();
    for j in 0..nblocks {
        let at = (start + j) * cs;
        entries.push(refcount::RefcountTableEntry {
            block_offset: Some(HostOffset(at)),
        });
        let own = (start.max(j * per_block)..end.min((j + 1) * per_block)).map(|c| (c, 1));
        let block =
            encode_refblock(&refs, &rg, j, own, false).map_err(|Overflow { cluster, value }| {
                refuse(format!(
                    "Cannot use refcount_bits={}: cluster {cluster} has {value} references",
                    1u64 << order
                ))
            })?;
        blocks.push((at, block));
    }
    let mut table = refcount::encode_table(&entries);
    table.resize((table_clusters * cs) as usize, 0);
    let table_at = (start + nblocks) * cs;
    let table_clusters = u32::try_from(table_clusters)
        .map_err(|_| refuse("the new refcount table would be too large"))?;
    Ok((blocks, table, table_at, table_clusters))
}

/// Rewrites the backing file name and format stored in the header of the qcow2 image at
/// `path` (what `qemu-img rebase` does last, and all that `rebase -u` does): `None` makes
/// the image standalone (no name, no format extension). Nothing else changes; the image must
/// not be open elsewhere.
pub fn set_backing_file(path: &Path, name: Option<&str>, format: Option<&str>) -> Result<()> {
    rewrite_header(path, |c0| {
        c0.backing_file = name.map(|n| n.as_bytes().to_vec());
        c0.extensions
            .retain(|e| !matches!(e, Extension::BackingFormat(_)));
        if let (Some(_), Some(f)) = (name, format) {
            c0.extensions
                .push(Extension::BackingFormat(f.as_bytes().to_vec()));
            c0.sort_like_qemu();
        }
        Ok(())
    })
}

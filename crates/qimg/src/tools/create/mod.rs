//! Creating a new qcow2 image (`qimg create`).
//!
//! The layout matches what `qemu-img create` writes whenever the refcount structures fit in
//! one refcount block (the common case): header and extensions in cluster 0, the refcount table
//! in cluster 1, the first refcount block in cluster 2, then the L1 table. Larger images get
//! as many refcount table clusters and blocks as they need, laid out contiguously, computed
//! up front so that every cluster is covered and refcounted exactly once.
//! With preallocation every L2 table is followed by the data clusters it maps.

mod file;
mod layout;
mod options;

pub use options::{Compat, CreateOptions, Encryption, Preallocation, Progress, effective_size};

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use qimg_format::extensions::{Cluster0, Extension};
use qimg_format::features::{
    AUTOCLEAR_DATA_FILE_RAW, COMPAT_LAZY_REFCOUNTS, INCOMPAT_DATA_FILE, INCOMPAT_EXTENDED_L2,
    qemu_feature_table,
};
use qimg_format::geometry::{Geometry, RefcountGeometry};
use qimg_format::header::Header;
use qimg_format::l1::{self, L1Entry};
use qimg_format::l2::{self, AnyL2Entry, ExtendedL2Entry, L2Entry, SubclusterBitmap};
use qimg_format::refcount::{self, RefcountTableEntry};
use qimg_format::units::HostOffset;

use crate::error::{Error, Result};
use file::{allocate_first_block, fill, open_new};
use layout::{plan, rb_order};

/// Creates (or truncates) `path` as a new qcow2 image. Returns the virtual size.
///
/// `progress` is called during the long part of preallocation (writing or reserving data).
pub fn create(path: &Path, opts: &CreateOptions, progress: Progress<'_>) -> Result<u64> {
    opts.validate()?;
    let size = effective_size(path, opts)?;
    let mut checked = opts.clone();
    checked.size = Some(size);
    checked.validate()?;
    // The LUKS header area first (PBKDF2 takes `iter-time`): its size sets the layout.
    let luks = match &opts.encryption {
        Some(e) => Some(
            crate::crypto::create(&e.params, &e.passphrase).map_err(|source| Error::Crypto {
                path: path.to_path_buf(),
                source,
            })?,
        ),
        None => None,
    };
    let luks_bytes = luks.as_ref().map_or(0, |(area, _)| area.len() as u64);
    let layout = plan(opts, size, luks_bytes)?;
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
    if luks.is_some() {
        header.crypt_method = 2;
        extensions.push(Extension::Crypto {
            offset: layout.luks_at() * cs,
            length: luks_bytes,
        });
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
            Some((open_new(&full, qimg_io::ImageLock::ReadWrite)?, full))
        }
        None => None,
    };
    let file = open_new(path, qimg_io::ImageLock::ReadWrite)?;
    let w = |buf: &[u8], off: u64| {
        file.write_all_at(buf, off)
            .map_err(|e| Error::io(path, format!("write {} bytes at {off:#x}", buf.len()), e))
    };

    // Refcount table and blocks: every cluster of the layout has refcount 1.
    let order = rb_order(opts.refcount_bits);
    let table_entries = layout.reftable_clusters * cs / refcount::REFTABLE_ENTRY_SIZE as u64;
    let mut table = vec![RefcountTableEntry::UNALLOCATED; table_entries as usize];
    for (i, entry) in table.iter_mut().take(layout.refblocks as usize).enumerate() {
        let off = (layout.refblocks_at() + i as u64) * cs;
        entry.block_offset = Some(HostOffset(off));
    }
    let table = refcount::encode_table(&table);
    let per_block = RefcountGeometry::new(cs.trailing_zeros(), order)
        .map_err(|e| Error::format(path, e))?
        .refblock_entries();
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
    let mut l1 = vec![L1Entry::UNALLOCATED; layout.l1_entries as usize];
    let geometry =
        Geometry::new(cs.trailing_zeros(), opts.extended_l2).map_err(|e| Error::format(path, e))?;
    let l2_entries = geometry.l2_entries();
    // A preallocated cluster: data at `host`, COPIED; with extended L2 entries no subcluster
    // is marked allocated, so it reads as zeros (or the backing file) until written, as QEMU
    // preallocates.
    let linked = |host: u64| {
        let entry = L2Entry::Normal {
            host: HostOffset(host),
            copied: true,
        };
        if opts.extended_l2 {
            AnyL2Entry::Extended(ExtendedL2Entry {
                entry,
                bitmap: SubclusterBitmap::default(),
            })
        } else {
            AnyL2Entry::Standard(entry)
        }
    };
    let clusters = size.div_ceil(cs);
    let mut data_runs: Vec<(u64, u64)> = Vec::new();
    if layout.prealloc_clusters > 0 {
        let mut next = layout.prealloc_at();
        for (i, l1_entry) in l1.iter_mut().enumerate() {
            let l2_off = next * cs;
            next += 1;
            *l1_entry = L1Entry {
                l2_offset: Some(HostOffset(l2_off)),
                copied: true,
            };
            let first = i as u64 * l2_entries;
            let n = clusters.saturating_sub(first).min(l2_entries);
            let mut l2 = vec![linked(0); l2_entries as usize];
            for (j, slot) in l2.iter_mut().enumerate() {
                let j = j as u64;
                *slot = if j >= n {
                    AnyL2Entry::unallocated(opts.extended_l2)
                } else if opts.data_file.is_some() {
                    linked((first + j) * cs)
                } else {
                    next += 1;
                    linked((next - 1) * cs)
                };
            }
            if opts.data_file.is_none() && n > 0 {
                data_runs.push((l2_off + cs, n * cs));
            }
            w(&l2::encode_slice(&l2), l2_off)?;
        }
    }
    if !l1.is_empty() {
        w(&l1::encode_table(&l1), layout.l1_at() * cs)?;
    }
    // The whole header cluster, as QEMU writes it: the file holds (and `st_blocks` counts)
    // the same clusters as QEMU's, which its metadata-preallocation heuristic and `disk size`
    // read.
    let mut header_cluster = cluster0;
    header_cluster.resize(header_cluster.len().max(cs as usize), 0);
    w(&header_cluster, 0)?;

    // The LUKS header area, zero to the end of its last cluster (as QEMU's
    // `qcow2_crypto_hdr_init_func` leaves it).
    if let Some((area, _)) = &luks {
        let mut whole = area.clone();
        whole.resize((layout.luks_clusters * cs) as usize, 0);
        w(&whole, layout.luks_at() * cs)?;
    }

    // File length: the end of the L1 table as QEMU leaves it, or of the preallocated area
    // (or LUKS header area).
    let end = if layout.prealloc_clusters > 0 || layout.luks_clusters > 0 {
        layout.total() * cs
    } else if layout.l1_entries > 0 {
        layout.l1_at() * cs + l1::table_bytes(layout.l1_entries)
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
    let file = open_new(path, qimg_io::ImageLock::SharedReadWrite)?;
    file.set_len(size)
        .map_err(|e| Error::io(path, format!("set length to {size}"), e))?;
    allocate_first_block(&file, path, size)?;
    if matches!(prealloc, Preallocation::Falloc | Preallocation::Full) {
        fill(&file, path, &[(0, size)], prealloc, size, progress)?;
    }
    file.sync_all().map_err(|e| Error::io(path, "fsync", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_images_get_qemus_layout() {
        let o = CreateOptions::default();
        let l = plan(&o, 1 << 30, 0).unwrap();
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
                let l = plan(&o, size, 0).unwrap();
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

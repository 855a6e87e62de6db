//! Reading what `qimg info` shows: header fields, snapshots, bitmaps, backing chain.
//!
//! Everything here opens files read-only and never writes.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use qimg_format::bitmap::decode_directory;
use qimg_format::cluster0::Cluster0;
use qimg_format::features::{
    AUTOCLEAR_BITMAPS, AUTOCLEAR_DATA_FILE_RAW, COMPAT_LAZY_REFCOUNTS, INCOMPAT_CORRUPT,
    INCOMPAT_DATA_FILE, INCOMPAT_DIRTY,
};
use qimg_format::snapshot::{MAX_TABLE_SIZE, decode_table};
use qimg_format::validate::OpenMode;

use crate::chain::{ImageFormat, MAX_CHAIN_DEPTH, open, probe_format, read_at_most, read_cluster0};
use crate::error::{Error, Result};

/// One snapshot as qemu-img info shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SnapshotInfo {
    /// Unique ID.
    pub id: String,
    /// Name.
    pub name: String,
    /// Size of the saved VM state.
    #[serde(rename = "vm-state-size")]
    pub vm_state_size: u64,
    /// Creation time, seconds.
    #[serde(rename = "date-sec")]
    pub date_sec: u64,
    /// Creation time, nanoseconds.
    #[serde(rename = "date-nsec")]
    pub date_nsec: u64,
    /// Guest clock, seconds.
    #[serde(rename = "vm-clock-sec")]
    pub vm_clock_sec: u64,
    /// Guest clock, nanoseconds.
    #[serde(rename = "vm-clock-nsec")]
    pub vm_clock_nsec: u64,
    /// Record/replay instruction count.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub icount: Option<u64>,
}

/// One persistent bitmap as qemu-img info shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BitmapInfo {
    /// Name.
    pub name: String,
    /// Bytes per bit.
    pub granularity: u64,
    /// `in-use`, `auto`.
    pub flags: Vec<String>,
}

/// qcow2-specific information (`format-specific.data`), with qemu-img's field names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Qcow2Specific {
    /// "0.10" or "1.1".
    pub compat: String,
    /// "zlib" or "zstd".
    #[serde(rename = "compression-type")]
    pub compression_type: String,
    /// Lazy refcounts (v3 only).
    #[serde(rename = "lazy-refcounts", skip_serializing_if = "Option::is_none")]
    pub lazy_refcounts: Option<bool>,
    /// Persistent bitmaps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bitmaps: Option<Vec<BitmapInfo>>,
    /// Refcount width.
    #[serde(rename = "refcount-bits")]
    pub refcount_bits: u64,
    /// External data file name.
    #[serde(rename = "data-file", skip_serializing_if = "Option::is_none")]
    pub data_file: Option<String>,
    /// Encrypted images: `{"format": "aes"}`, or the LUKS header's details as QEMU shows
    /// them (members in QEMU's order).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub encrypt: Option<serde_json::Value>,
    /// Raw external data.
    #[serde(rename = "data-file-raw", skip_serializing_if = "Option::is_none")]
    pub data_file_raw: Option<bool>,
    /// Corrupt bit (v3 only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub corrupt: Option<bool>,
    /// Extended L2 entries (v3 only).
    #[serde(rename = "extended-l2", skip_serializing_if = "Option::is_none")]
    pub extended_l2: Option<bool>,
}

/// `format-specific` of qemu-img info.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FormatSpecific {
    /// "qcow2" or "file".
    #[serde(rename = "type")]
    pub kind: String,
    /// The data.
    pub data: serde_json::Value,
}

/// A child node (the protocol layer under the format layer).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChildInfo {
    /// "file" or "data-file".
    pub name: String,
    /// What qemu-img shows for it.
    pub info: Box<ImageInfo>,
}

/// What `qimg info` reports, with qemu-img's JSON field names.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ImageInfo {
    /// File name as given.
    pub filename: String,
    /// "qcow2", "raw" or "file".
    pub format: String,
    /// Virtual disk size.
    #[serde(rename = "virtual-size")]
    pub virtual_size: u64,
    /// Bytes allocated on the host (`None` where that cannot be known: an NBD export).
    #[serde(rename = "actual-size", skip_serializing_if = "Option::is_none")]
    pub actual_size: Option<u64>,
    /// Cluster size (qcow2).
    #[serde(rename = "cluster-size", skip_serializing_if = "Option::is_none")]
    pub cluster_size: Option<u64>,
    /// Dirty bit (`None` for an NBD export, as QEMU leaves it out there).
    #[serde(rename = "dirty-flag", skip_serializing_if = "Option::is_none")]
    pub dirty_flag: Option<bool>,
    /// Backing file name as stored.
    #[serde(rename = "backing-filename", skip_serializing_if = "Option::is_none")]
    pub backing_filename: Option<String>,
    /// Backing file name resolved against the image's directory.
    #[serde(
        rename = "full-backing-filename",
        skip_serializing_if = "Option::is_none"
    )]
    pub full_backing_filename: Option<String>,
    /// Backing format from the header extension.
    #[serde(
        rename = "backing-filename-format",
        skip_serializing_if = "Option::is_none"
    )]
    pub backing_filename_format: Option<String>,
    /// Encrypted images only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub encrypted: Option<bool>,
    /// Internal snapshots.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshots: Option<Vec<SnapshotInfo>>,
    /// Format-specific details.
    #[serde(rename = "format-specific", skip_serializing_if = "Option::is_none")]
    pub format_specific: Option<FormatSpecific>,
    /// Child nodes.
    pub children: Vec<ChildInfo>,
}

fn lossy(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn file_info(path: &Path, name: &str) -> Result<ImageInfo> {
    // Protocol nodes that are not files: only their name, driver and size (QEMU's null
    // device also says it takes no disk space).
    let node = |format: &str, virtual_size: u64, actual_size: Option<u64>| ImageInfo {
        filename: name.to_string(),
        format: format.into(),
        virtual_size,
        actual_size,
        cluster_size: None,
        dirty_flag: None,
        backing_filename: None,
        full_backing_filename: None,
        backing_filename_format: None,
        encrypted: None,
        snapshots: None,
        format_specific: None,
        children: Vec::new(),
    };
    if let Some(null) = crate::chain::null_device(path) {
        return Ok(node("null-co", null.size, Some(0)));
    }
    if let Some(nbd) = crate::chain::nbd_export(path)? {
        return Ok(node("nbd", nbd.size(), None));
    }
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, "stat", e))?;
    Ok(ImageInfo {
        filename: name.to_string(),
        format: "file".into(),
        virtual_size: meta.len().next_multiple_of(512),
        actual_size: Some(meta.blocks() * 512),
        cluster_size: None,
        dirty_flag: Some(false),
        backing_filename: None,
        full_backing_filename: None,
        backing_filename_format: None,
        encrypted: None,
        snapshots: None,
        format_specific: Some(FormatSpecific {
            kind: "file".into(),
            data: serde_json::json!({}),
        }),
        children: Vec::new(),
    })
}

/// Gathers `qemu-img info` for one image. `name` is the file name as the user gave it
/// (reported verbatim); `fmt` forces a format, else it is probed.
pub fn image_info(path: &Path, fmt: Option<ImageFormat>) -> Result<ImageInfo> {
    let mut name = path.to_string_lossy().into_owned();
    // An NBD export is shown by the name QEMU writes back for it.
    if let Ok(Some(a)) = qimg_io::nbd::NbdAddress::parse(&name) {
        name = a.to_string();
    }
    let fmt = match fmt {
        Some(f) => f,
        None => probe_format(path)?,
    };
    let file = file_info(path, &name)?;
    if fmt == ImageFormat::Raw {
        // Raw over a part of the file (`offset`, `size`) is as long as that part.
        let virtual_size = match qimg_io::window::attached(path) {
            Some(_) => crate::chain::virtual_size_of(path, fmt)?,
            None => file.virtual_size,
        };
        return Ok(ImageInfo {
            format: "raw".into(),
            virtual_size,
            format_specific: None,
            children: vec![ChildInfo {
                name: "file".into(),
                info: Box::new(file.clone()),
            }],
            ..file
        });
    }
    let c0 = read_cluster0(path, OpenMode::ReadOnly)?;
    let h = &c0.header;
    let f = open(path)?;
    let cs = 1u64 << h.cluster_bits;

    let snapshots = if h.nb_snapshots > 0 {
        // Entries are variable-length: read a little, and more only while the table needs it
        // (never past QEMU's 64 MiB limit or the end of the file).
        let flen = f.metadata().map_err(|e| Error::io(path, "stat", e))?.len();
        let mut want = 64 << 10;
        let list = loop {
            let raw = read_at_most(&f, path, h.snapshots_offset, want)?;
            match decode_table(&raw, h.snapshots_offset, h.nb_snapshots) {
                Err(qimg_format::FormatError::Truncated { .. })
                    if want < MAX_TABLE_SIZE && h.snapshots_offset.saturating_add(want) < flen =>
                {
                    want = (want * 4).min(MAX_TABLE_SIZE);
                }
                r => break r.map_err(|e| Error::format(path, e))?,
            }
        };
        Some(
            list.iter()
                .map(|s| SnapshotInfo {
                    id: qimg_format::snapshot::decode_text(&s.id),
                    name: qimg_format::snapshot::decode_text(&s.name),
                    vm_state_size: s.vm_state_size(),
                    date_sec: u64::from(s.date_sec),
                    date_nsec: u64::from(s.date_nsec),
                    vm_clock_sec: s.vm_clock_nsec / 1_000_000_000,
                    vm_clock_nsec: s.vm_clock_nsec % 1_000_000_000,
                    icount: s.icount(),
                })
                .collect(),
        )
    } else {
        None
    };

    let v3 = h.version >= 3;
    let bitmaps = match c0.bitmaps() {
        Some(ext) if v3 && h.autoclear_features & AUTOCLEAR_BITMAPS != 0 => {
            let dir = read_at_most(&f, path, ext.directory_offset, ext.directory_size)?;
            let list = decode_directory(&dir, ext).map_err(|e| Error::format(path, e))?;
            Some(
                list.iter()
                    .map(|b| BitmapInfo {
                        name: lossy(&b.name),
                        granularity: b.granularity(),
                        flags: b.flag_names().into_iter().map(String::from).collect(),
                    })
                    .collect(),
            )
        }
        _ => None,
    };
    let has_data_file = h.incompatible_features & INCOMPAT_DATA_FILE != 0;
    let encrypt = encrypt_info(&f, path, &c0)?;
    let spec = Qcow2Specific {
        compat: if v3 { "1.1" } else { "0.10" }.into(),
        compression_type: h
            .compression_type()
            .map(|c| c.name())
            .unwrap_or("zlib")
            .into(),
        lazy_refcounts: v3.then_some(h.compatible_features & COMPAT_LAZY_REFCOUNTS != 0),
        refcount_bits: u64::from(h.refcount_bits().unwrap_or(16)),
        corrupt: v3.then_some(h.incompatible_features & INCOMPAT_CORRUPT != 0),
        extended_l2: v3.then_some(h.extended_l2()),
        data_file: c0.data_file().filter(|_| v3).map(lossy),
        encrypt,
        data_file_raw: (v3 && has_data_file)
            .then_some(h.autoclear_features & AUTOCLEAR_DATA_FILE_RAW != 0),
        bitmaps,
    };
    let backing_filename = c0.backing_file.as_deref().map(lossy);
    let full_backing_filename = backing_filename.as_deref().map(|b| {
        crate::chain::resolve_backing(Path::new(&name), b)
            .to_string_lossy()
            .into_owned()
    });
    let children = vec![ChildInfo {
        name: "file".into(),
        info: Box::new(file.clone()),
    }];
    Ok(ImageInfo {
        filename: name,
        format: "qcow2".into(),
        virtual_size: h.size,
        actual_size: file.actual_size,
        cluster_size: Some(cs),
        dirty_flag: Some(h.incompatible_features & INCOMPAT_DIRTY != 0),
        backing_filename,
        full_backing_filename,
        backing_filename_format: c0.backing_format().map(lossy),
        encrypted: (h.crypt_method != 0).then_some(true),
        snapshots,
        format_specific: Some(FormatSpecific {
            kind: "qcow2".into(),
            data: serde_json::to_value(&spec).unwrap_or_default(),
        }),
        children,
    })
}

/// `encrypt` of an encrypted image's format-specific information: `aes`, or the LUKS
/// header (read where the full disk encryption header extension says) as QEMU's
/// `QCryptoBlockInfoLUKS`, its members inserted in QAPI order.
fn encrypt_info(
    f: &std::fs::File,
    path: &Path,
    c0: &Cluster0,
) -> Result<Option<serde_json::Value>> {
    use qimg_format::extension::Extension;
    use qimg_format::luks::{LUKS_HEADER_LEN, LuksHeader};
    use serde_json::json;
    match c0.header.crypt_method {
        0 => return Ok(None),
        1 => return Ok(Some(json!({"format": "aes"}))),
        _ => {}
    }
    let Some(offset) = c0.extensions.iter().find_map(|e| match e {
        Extension::Crypto { offset, .. } => Some(*offset),
        _ => None,
    }) else {
        // Refused by the header's validation before this.
        return Ok(None);
    };
    let raw = read_at_most(f, path, offset, LUKS_HEADER_LEN as u64)?;
    let l = LuksHeader::decode(&raw, offset).map_err(|e| Error::format(path, e))?;
    let (ivgen, ivgen_hash) = l.ivgen();
    let mut m = serde_json::Map::new();
    m.insert("format".into(), json!("luks"));
    m.insert("cipher-alg".into(), json!(l.cipher_alg()));
    m.insert("cipher-mode".into(), json!(l.mode()));
    m.insert("ivgen-alg".into(), json!(ivgen));
    if let Some(hash) = ivgen_hash {
        m.insert("ivgen-hash-alg".into(), json!(hash));
    }
    m.insert("hash-alg".into(), json!(l.hash_spec));
    m.insert("detached-header".into(), json!(false));
    m.insert("payload-offset".into(), json!(l.payload_offset));
    m.insert("master-key-iters".into(), json!(l.master_key_iterations));
    m.insert("uuid".into(), json!(l.uuid));
    let slots: Vec<serde_json::Value> = l
        .slots
        .iter()
        .map(|s| {
            let mut o = serde_json::Map::new();
            o.insert("active".into(), json!(s.active));
            if s.active {
                o.insert("iters".into(), json!(s.iterations));
                o.insert("stripes".into(), json!(s.stripes));
            }
            o.insert("key-offset".into(), json!(s.key_offset));
            serde_json::Value::Object(o)
        })
        .collect();
    m.insert("slots".into(), json!(slots));
    Ok(Some(serde_json::Value::Object(m)))
}

/// `info --backing-chain`: the image and every backing file below it, top first.
///
/// A chain deeper than [`MAX_CHAIN_DEPTH`] or one that loops back on itself is an error.
pub fn backing_chain(path: &Path, fmt: Option<ImageFormat>) -> Result<Vec<ImageInfo>> {
    let mut out: Vec<ImageInfo> = Vec::new();
    let mut seen: Vec<PathBuf> = Vec::new();
    let mut cur = path.to_path_buf();
    let mut cur_fmt = fmt;
    loop {
        let canon = std::fs::canonicalize(&cur).map_err(|e| Error::io(&cur, "open", e))?;
        if seen.contains(&canon) {
            return Err(Error::InvalidOption(format!(
                "{}: backing chain loops back to {}",
                path.display(),
                cur.display()
            )));
        }
        if out.len() >= MAX_CHAIN_DEPTH {
            return Err(Error::InvalidOption(format!(
                "{}: backing chain is deeper than {MAX_CHAIN_DEPTH} images",
                path.display()
            )));
        }
        seen.push(canon);
        let info = image_info(&cur, cur_fmt)?;
        let next = info.full_backing_filename.clone();
        let next_fmt = match info.backing_filename_format.as_deref() {
            Some("raw") => Some(ImageFormat::Raw),
            Some("qcow2") => Some(ImageFormat::Qcow2),
            _ => None,
        };
        out.push(info);
        match next {
            Some(n) => {
                cur = PathBuf::from(n);
                cur_fmt = next_fmt;
            }
            None => return Ok(out),
        }
    }
}

//! `qimg map [-f FMT] [--output human|json] [--start-offset N] [--max-length N] [-U] FILE`:
//! where the guest data of an image lives, as `qemu-img map` prints it.
//!
//! The walk reproduces QEMU's block-status logic (`get_block_status` in qemu-img over
//! `bdrv_co_do_block_status` and `qcow2_co_block_status`):
//!
//! - A qcow2 layer reports data (with its host offset), zero (with an offset when host space
//!   stays reserved), compressed data (no offset) or unallocated. An unallocated range goes to
//!   the backing image, except past the backing image's end or below the bottom of the chain,
//!   where it reads as zeros and is reported at this depth as not present (keeping the offset
//!   of a preallocated-but-unallocated subcluster).
//! - A raw layer (the image itself or a backing file) asks the file system: data extents are
//!   data, holes are zeros, both present and mapped 1:1; its size is rounded up to 512 bytes.
//! - A qcow2 image whose file holds far fewer allocated clusters than it refcounts is
//!   "metadata preallocated" (QEMU's `qcow2_detect_metadata_preallocation`); its data extents
//!   are then refined by the holes of the host file, which read as zeros (`data` and `zero`).
//!
//! Adjacent entries merge when every field agrees and host offsets are contiguous.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::rc::Rc;

use anyhow::{Context, Result, anyhow, bail};
use nix::errno::Errno;
use nix::fcntl::{PosixFadviseAdvice, posix_fadvise};
use nix::unistd::{Whence, lseek};
use qimg::chain::{ImageFormat, probe_format, read_cluster0};
use qimg::io::AnyStorage;
use qimg::{Backing, ExtentKind, Image, OpenOptions};

/// Arguments of `qimg map`.
#[derive(clap::Args)]
pub struct MapArgs {
    /// Image format: qcow2 or raw (probed when absent).
    #[arg(short = 'f', long = "format")]
    fmt: Option<String>,
    /// Output format: human (the default) or json.
    #[arg(long, default_value = "human")]
    output: String,
    /// First guest byte to map.
    #[arg(long = "start-offset", allow_hyphen_values = true)]
    start_offset: Option<String>,
    /// Map at most this many bytes.
    #[arg(long = "max-length", allow_hyphen_values = true)]
    max_length: Option<String>,
    /// Accepted for qemu-img compatibility: qimg map takes no locks and never writes.
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// The image.
    filename: Option<String>,
}

/// Guest bytes processed per step (QEMU probes up to 1 GiB at a time).
const STEP: u64 = 1 << 30;

/// One line of the map, with qemu-img's fields.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    /// First guest byte.
    pub(crate) start: u64,
    /// Length in bytes.
    pub(crate) length: u64,
    /// Index in the backing chain of the image the status comes from.
    pub(crate) depth: usize,
    /// Allocated at that depth (not a read-through to zeros).
    pub(crate) present: bool,
    /// Reads as zeros.
    pub(crate) zero: bool,
    /// Holds data (possibly also reading as zeros: a hole of a preallocated file).
    pub(crate) data: bool,
    /// A compressed cluster.
    pub(crate) compressed: bool,
    /// Host offset.
    pub(crate) offset: Option<u64>,
    /// The file `offset` points into (set only with an offset, as QEMU does).
    pub(crate) file: Option<Rc<str>>,
}

impl Entry {
    /// qemu-img's `entry_mergeable`.
    fn mergeable(&self, next: &Entry) -> bool {
        if self.length == 0 {
            return false;
        }
        if self.zero != next.zero
            || self.data != next.data
            || self.compressed != next.compressed
            || self.depth != next.depth
            || self.present != next.present
            || self.file != next.file
            || self.offset.is_some() != next.offset.is_some()
        {
            return false;
        }
        match (self.offset, next.offset) {
            (Some(a), Some(b)) => a.checked_add(self.length) == Some(b),
            _ => true,
        }
    }

    fn json(&self) -> String {
        let mut s = format!(
            "{{ \"start\": {}, \"length\": {}, \"depth\": {}, \"present\": {}, \"zero\": {}, \
             \"data\": {}, \"compressed\": {}",
            self.start,
            self.length,
            self.depth,
            self.present,
            self.zero,
            self.data,
            self.compressed
        );
        if let Some(o) = self.offset {
            s.push_str(&format!(", \"offset\": {o}"));
        }
        s.push('}');
        s
    }
}

/// C's `%#-16x`: `0x` prefix except for zero, left-aligned in 16 columns.
fn hex16(v: u64) -> String {
    let s = if v == 0 {
        "0".to_string()
    } else {
        format!("{v:#x}")
    };
    format!("{s:<16}")
}

/// One image of the chain, with what the walk needs from it.
pub(crate) enum Layer {
    /// A qcow2 image.
    Qcow2 {
        /// The open image.
        img: Image<AnyStorage>,
        /// Its external data file, if any.
        data_file: Option<PathBuf>,
        /// Name of the file host offsets point into (data file or image file).
        name: Rc<str>,
        /// The host file, when the image is metadata-preallocated (holes read as zeros).
        prealloc: Option<HostFile>,
        /// The L1 table as stored, to skip the ranges of empty entries without a lookup per
        /// cluster (`None` if it could not be read: every range is then looked up).
        l1: Option<L1>,
    },
    /// A raw image.
    Raw(HostFile),
}

impl Layer {
    /// The files this layer reads (the image file and its data file, if any).
    pub(crate) fn files(&self) -> Vec<PathBuf> {
        match self {
            Layer::Qcow2 { img, data_file, .. } => {
                let mut v = vec![img.path().to_path_buf()];
                v.extend(data_file.clone());
                v
            }
            Layer::Raw(f) => vec![f.path.clone()],
        }
    }

    /// The virtual size as QEMU sees it (raw files round up to 512 bytes).
    pub(crate) fn size(&self) -> u64 {
        match self {
            Layer::Qcow2 { img, .. } => img.size(),
            Layer::Raw(f) => f.len.next_multiple_of(512),
        }
    }
}

/// A file whose data extents and holes are asked from the file system.
pub(crate) struct HostFile {
    file: File,
    path: PathBuf,
    /// Drop cached pages of a range before asking for its holes (metadata-preallocated qcow2
    /// files, whose metadata this process reads).
    drop_cache: bool,
    name: Rc<str>,
    /// The file length in bytes.
    len: u64,
}

impl HostFile {
    fn open(path: &Path, name: Rc<str>) -> Result<Self> {
        let file =
            File::open(path).map_err(|e| anyhow!("Could not open '{name}': {}", os_msg(&e)))?;
        let len = file
            .metadata()
            .map_err(|e| anyhow!("Could not stat '{name}': {}", os_msg(&e)))?
            .len();
        Ok(Self {
            file,
            path: path.to_path_buf(),
            drop_cache: false,
            name,
            len,
        })
    }

    /// Splits `[start, end)` into (start, length, is_data) runs, as file-posix's block status
    /// does: `SEEK_DATA`/`SEEK_HOLE`, everything past the end of the file is a hole, and a file
    /// system that cannot tell is all data.
    fn runs(&self, start: u64, end: u64) -> Vec<(u64, u64, bool)> {
        if self.drop_cache {
            // Unwritten extents (QEMU zeroes the copy-on-write parts of a cluster with
            // FALLOC_FL_ZERO_RANGE) are holes to SEEK_DATA only while none of their pages is
            // cached; our own metadata reads may have pulled them in by readahead. Drop clean
            // cached pages of the range first so the answer is the one qemu-img, which does
            // not read there, gets.
            // Whole pages only are dropped: round out (to 64 KiB, above any page size).
            let (a, b) = (start & !0xffff, end.saturating_add(0xffff) & !0xffff);
            if let (Ok(o), Ok(l)) = (i64::try_from(a), i64::try_from(b - a)) {
                let _ = posix_fadvise(&self.file, o, l, PosixFadviseAdvice::POSIX_FADV_DONTNEED);
            }
        }
        let mut out: Vec<(u64, u64, bool)> = Vec::new();
        let mut push = |s: u64, e: u64, data: bool| {
            if e <= s {
                return;
            }
            if let Some(last) = out.last_mut() {
                if last.2 == data && last.0 + last.1 == s {
                    last.1 += e - s;
                    return;
                }
            }
            out.push((s, e - s, data));
        };
        let mut pos = start;
        while pos < end {
            if pos >= self.len {
                push(pos, end, false);
                break;
            }
            let Ok(at) = i64::try_from(pos) else {
                push(pos, end, true);
                break;
            };
            match lseek(&self.file, at, Whence::SeekData) {
                Err(Errno::ENXIO) => {
                    push(pos, end, false);
                    break;
                }
                Err(_) => {
                    push(pos, end, true);
                    break;
                }
                Ok(d) if (d as u64) > pos => {
                    let d = (d as u64).min(end);
                    push(pos, d, false);
                    pos = d;
                }
                Ok(_) => {
                    let h = match lseek(&self.file, at, Whence::SeekHole) {
                        Ok(h) if (h as u64) > pos => h as u64,
                        _ => self.len.max(pos + 1),
                    };
                    let h = h.min(end);
                    push(pos, h, true);
                    pos = h;
                }
            }
        }
        out
    }
}

/// An image's L1 table: which guest ranges have no L2 table at all.
pub(crate) struct L1 {
    /// Guest bytes one entry covers.
    span: u64,
    /// L2 table offsets (0: none).
    tables: Vec<u64>,
}

impl L1 {
    /// Mask of the L2 table offset in an L1 entry.
    const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;

    fn read(path: &Path) -> Option<Self> {
        let c0 = read_cluster0(path, qimg::format::validate::OpenMode::ReadOnly).ok()?;
        let h = &c0.header;
        let geo = qimg::format::geometry::Geometry::new(h.cluster_bits, h.extended_l2()).ok()?;
        let file = File::open(path).ok()?;
        let mut raw = vec![0u8; usize::try_from(h.l1_size).ok()?.checked_mul(8)?];
        file.read_exact_at(&mut raw, h.l1_table_offset).ok()?;
        let tables = raw
            .chunks_exact(8)
            .map(|b| u64::from_be_bytes(b.try_into().unwrap_or([0; 8])) & Self::OFFSET_MASK)
            .collect();
        Some(Self {
            span: geo.l2_coverage(),
            tables,
        })
    }

    /// Splits `[start, end)` at entry boundaries into (start, end, has_table) runs, adjacent
    /// runs without a table merged.
    fn runs(&self, start: u64, end: u64) -> Vec<(u64, u64, bool)> {
        let mut out: Vec<(u64, u64, bool)> = Vec::new();
        let mut at = start;
        while at < end {
            let i = at / self.span;
            let e = ((i + 1) * self.span).min(end);
            let has = self
                .tables
                .get(usize::try_from(i).unwrap_or(usize::MAX))
                .is_none_or(|&t| t != 0);
            match out.last_mut() {
                Some(last) if !has && !last.2 => last.1 = e,
                _ => out.push((at, e, has)),
            }
            at = e;
        }
        out
    }
}

/// QEMU's `qcow2_detect_metadata_preallocation`: whether the image file refcounts at least
/// `max(allocated * 10 / 9, allocated + 2)` clusters, `allocated` being the clusters the file
/// system really holds. Errors count as "no", as in QEMU.
fn metadata_preallocated(path: &Path) -> bool {
    fn detect(path: &Path) -> Option<bool> {
        let c0 = read_cluster0(path, qimg::format::validate::OpenMode::ReadOnly).ok()?;
        let h = &c0.header;
        let cs = h.cluster_size()?;
        let file = File::open(path).ok()?;
        let meta = file.metadata().ok()?;
        let file_length = meta.len();
        let real_clusters = meta.blocks().saturating_mul(512) / cs;
        let threshold = (real_clusters * 10 / 9).max(real_clusters + 2);
        let end_cluster = file_length.div_ceil(cs);
        let order = h.refcount_order;
        let per_block = ((cs * 8) >> order).max(1);
        let table_len = u64::from(h.refcount_table_clusters) * cs;
        let mut count = 0u64;
        let mut block = vec![0u8; cs as usize];
        let mut i = 0u64;
        while i < end_cluster && count < threshold {
            let bi = i / per_block;
            if bi * 8 >= table_len {
                break;
            }
            let mut raw = [0u8; 8];
            file.read_exact_at(&mut raw, h.refcount_table_offset.checked_add(bi * 8)?)
                .ok()?;
            let offset = u64::from_be_bytes(raw) & qimg::format::refcount::REFT_OFFSET_MASK;
            let first = bi * per_block;
            let last = (first + per_block).min(end_cluster);
            if offset == 0 {
                i = last;
                continue;
            }
            file.read_exact_at(&mut block, offset).ok()?;
            while i < last && count < threshold {
                if qimg::format::refcount::get(&block, order, i - first).ok()? != 0 {
                    count += 1;
                }
                i += 1;
            }
        }
        Some(count >= threshold)
    }
    detect(path).unwrap_or(false)
}

/// Opens the image and lists the layers of its chain, top first.
pub(crate) async fn open_chain(path: &Path, file: &str, fmt: ImageFormat) -> Result<Vec<Layer>> {
    if fmt == ImageFormat::Raw {
        return Ok(vec![Layer::Raw(HostFile::open(path, Rc::from(file))?)]);
    }
    let opts = OpenOptions::new().clean_timer(false);
    let img = opts
        .open(path)
        .await
        .map_err(|e| anyhow!("Could not open '{file}': {}", lib_msg(&e, file)))?;
    let mut layers = Vec::new();
    let mut next = Some(img);
    while let Some(img) = next.take() {
        let c0 = read_cluster0(img.path(), qimg::format::validate::OpenMode::ReadOnly)?;
        let data_file = c0
            .data_file()
            .map(|n| String::from_utf8_lossy(n).into_owned());
        let (name, host_path): (Rc<str>, PathBuf) = match &data_file {
            Some(n) => (
                Rc::from(n.as_str()),
                qimg::chain::resolve_backing(img.path(), n),
            ),
            None => (
                Rc::from(img.path().display().to_string().as_str()),
                img.path().to_path_buf(),
            ),
        };
        let data_file = data_file.map(|_| host_path.clone());
        let prealloc = if metadata_preallocated(img.path()) {
            let mut f = HostFile::open(&host_path, name.clone())?;
            f.drop_cache = true;
            Some(f)
        } else {
            None
        };
        let below = match img.backing() {
            Some(Backing::Qcow2(b)) => {
                next = Some(b.clone());
                None
            }
            Some(Backing::Raw { path, .. }) => Some(HostFile::open(
                path,
                Rc::from(path.display().to_string().as_str()),
            )?),
            None => None,
        };
        let l1 = L1::read(img.path());
        layers.push(Layer::Qcow2 {
            img,
            data_file,
            l1,
            name,
            prealloc,
        });
        if let Some(raw) = below {
            layers.push(Layer::Raw(raw));
        }
    }
    Ok(layers)
}

/// Appends the entries of `[start, start + len)` as seen from layer `depth` down.
pub(crate) async fn status(
    layers: &[Layer],
    depth: usize,
    start: u64,
    len: u64,
    out: &mut Vec<Entry>,
) -> Result<()> {
    Box::pin(status_inner(layers, depth, start, len, out)).await
}

async fn status_inner(
    layers: &[Layer],
    depth: usize,
    start: u64,
    len: u64,
    out: &mut Vec<Entry>,
) -> Result<()> {
    let entry = |start: u64, length: u64| Entry {
        start,
        length,
        depth,
        present: true,
        zero: false,
        data: false,
        compressed: false,
        offset: None,
        file: None,
    };
    match &layers[depth] {
        Layer::Raw(f) => {
            for (s, l, data) in f.runs(start, start + len) {
                out.push(Entry {
                    zero: !data,
                    data,
                    offset: Some(s),
                    file: Some(f.name.clone()),
                    ..entry(s, l)
                });
            }
        }
        Layer::Qcow2 {
            img,
            name,
            prealloc,
            l1,
            ..
        } => {
            let mut extents = Vec::new();
            let runs = match l1 {
                Some(l1) => l1.runs(start, start + len),
                None => vec![(start, start + len, true)],
            };
            for (s, e, has_table) in runs {
                if has_table {
                    extents.extend(
                        img.map(s, e - s)
                            .await
                            .map_err(|e| anyhow!("Could not read file metadata: {e}"))?,
                    );
                } else {
                    extents.push(qimg::Extent {
                        start: s,
                        length: e - s,
                        kind: ExtentKind::Unallocated { host_offset: None },
                    });
                }
            }
            for x in extents {
                match x.kind {
                    ExtentKind::Data { host_offset } => match prealloc {
                        Some(f) => {
                            for (s, l, data) in f.runs(host_offset, host_offset + x.length) {
                                out.push(Entry {
                                    zero: !data,
                                    data: true,
                                    offset: Some(s),
                                    file: Some(name.clone()),
                                    ..entry(x.start + (s - host_offset), l)
                                });
                            }
                        }
                        None => out.push(Entry {
                            data: true,
                            offset: Some(host_offset),
                            file: Some(name.clone()),
                            ..entry(x.start, x.length)
                        }),
                    },
                    ExtentKind::Zero { host_offset } => out.push(Entry {
                        zero: true,
                        offset: host_offset,
                        file: host_offset.map(|_| name.clone()),
                        ..entry(x.start, x.length)
                    }),
                    ExtentKind::Compressed { .. } => out.push(Entry {
                        data: true,
                        compressed: true,
                        ..entry(x.start, x.length)
                    }),
                    ExtentKind::Unallocated { host_offset } => {
                        let end = x.start + x.length;
                        let below = match layers.get(depth + 1) {
                            Some(b) => b.size().clamp(x.start, end),
                            None => x.start,
                        };
                        if below > x.start {
                            status(layers, depth + 1, x.start, below - x.start, out).await?;
                        }
                        if end > below {
                            let offset = host_offset.map(|h| h + (below - x.start));
                            out.push(Entry {
                                present: false,
                                zero: true,
                                offset,
                                file: offset.map(|_| name.clone()),
                                ..entry(below, end - below)
                            });
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Parses `--start-offset` / `--max-length` as qemu-img does (sizes with suffixes).
fn parse_offset(s: &str, what: &str) -> Result<u64> {
    match crate::opts::parse_size(s) {
        Some(v) if v <= i64::MAX as u64 => Ok(v),
        _ => bail!("Invalid {what} specified. Must be between 0 and 9223372036854775807."),
    }
}

/// Runs `qimg map`.
pub fn run_map(a: MapArgs) -> ExitCode {
    match map(a) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("qimg: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn map(a: MapArgs) -> Result<()> {
    let _ = a.force_share;
    let json = match a.output.as_str() {
        "human" => false,
        "json" => true,
        other => bail!("--output expects 'human' or 'json' not '{other}'"),
    };
    let start = match &a.start_offset {
        Some(s) => parse_offset(s, "start offset")?,
        None => 0,
    };
    let max_length = match &a.max_length {
        Some(s) => Some(parse_offset(s, "max length")?),
        None => None,
    };
    let Some(file) = a.filename else {
        bail!("Expecting one image file name");
    };
    let path = Path::new(&file);
    let fmt = match a.fmt.as_deref() {
        Some("qcow2") => ImageFormat::Qcow2,
        Some("raw") => ImageFormat::Raw,
        Some(other) => bail!("Could not open '{file}': Unknown driver '{other}'"),
        None => probe_format(path)
            .map_err(|e| anyhow!("Could not open '{file}': {}", lib_msg(&e, &file)))?,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the I/O runtime")?;
    rt.block_on(async {
        let layers = open_chain(path, &file, fmt).await?;
        let mut length = layers[0].size();
        if let Some(m) = max_length {
            length = length.min(start.saturating_add(m));
        }
        let stdout = std::io::stdout();
        let mut w = BufWriter::new(stdout.lock());
        let r = walk(&layers, start, length, json, &mut w).await;
        w.flush().context("cannot write the map")?;
        r
    })
}

/// An OS error as C's `strerror` words it ("No such file or directory", without Rust's
/// " (os error 2)").
pub(crate) fn os_msg(e: &std::io::Error) -> String {
    let s = e.to_string();
    match s.find(" (os error") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

/// The error text of a library error without the leading file name `file`, followed by the
/// causes its text does not already include (such as the OS error of a failed open).
pub(crate) fn lib_msg(e: &qimg::Error, file: &str) -> String {
    use std::error::Error as _;
    let mut s = match e {
        qimg::Error::Io { source, .. } => return os_msg(source),
        other => {
            let s = other.to_string();
            s.strip_prefix(&format!("{file}: "))
                .map(str::to_string)
                .unwrap_or(s)
        }
    };
    let mut cause = e.source();
    while let Some(c) = cause {
        let t = c.to_string();
        let t = match t.find(" (os error") {
            Some(i) => t[..i].to_string(),
            None => t,
        };
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cause = c.source();
    }
    s
}

async fn walk(
    layers: &[Layer],
    start: u64,
    length: u64,
    json: bool,
    w: &mut impl Write,
) -> Result<()> {
    if json {
        write!(w, "[")?;
    } else {
        writeln!(w, "{:<16}{:<16}{:<16}File", "Offset", "Length", "Mapped to")?;
    }
    let mut curr = Entry {
        start,
        length: 0,
        depth: 0,
        present: false,
        zero: false,
        data: false,
        compressed: false,
        offset: None,
        file: None,
    };
    let mut at = start;
    let mut buf = Vec::new();
    while at < length {
        let n = STEP.min(length - at);
        buf.clear();
        status(layers, 0, at, n, &mut buf).await?;
        for mut next in buf.drain(..) {
            if curr.mergeable(&next) {
                curr.length += next.length;
                continue;
            }
            if curr.length > 0 {
                dump(&curr, Some(&mut next), json, w)?;
            }
            curr = next;
        }
        at += n;
    }
    dump(&curr, None, json, w)?;
    if json {
        writeln!(w, "]")?;
    }
    Ok(())
}

/// qemu-img's `dump_map_entry`.
fn dump(e: &Entry, next: Option<&mut Entry>, json: bool, w: &mut impl Write) -> Result<()> {
    if json {
        write!(w, "{}", e.json())?;
        if next.is_some() {
            writeln!(w, ",")?;
        }
        return Ok(());
    }
    if e.data && e.offset.is_none() {
        bail!("File contains external, encrypted or compressed clusters.");
    }
    if e.data && !e.zero {
        writeln!(
            w,
            "{}{}{}{}",
            hex16(e.start),
            hex16(e.length),
            hex16(e.offset.unwrap_or(0)),
            e.file.as_deref().unwrap_or("")
        )?;
    }
    // The human format ignores the difference between zero and zero data: merge them.
    if let Some(n) = next {
        if !n.data || n.zero {
            n.data = false;
            n.zero = true;
        }
    }
    Ok(())
}

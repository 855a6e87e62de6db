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

use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::{Context, Result, bail};

use crate::args::{json_output, parse_offset};
use crate::chain::{Entry, Layers, open_chain, source_format};

/// Arguments of `qimg map`.
#[derive(clap::Args)]
pub struct MapArgs {
    /// Image format: qcow2 or raw (probed when absent).
    #[arg(short = 'f', long = "format")]
    fmt: Option<String>,
    /// Output format: human (the default) or json.
    #[arg(long, default_value = "human")]
    output: String,
    /// First guest byte to map (`-s`, as qemu-img's getopt takes it too).
    #[arg(short = 's', long = "start-offset", allow_hyphen_values = true)]
    start_offset: Option<String>,
    /// Map at most this many bytes (`-l`).
    #[arg(short = 'l', long = "max-length", allow_hyphen_values = true)]
    max_length: Option<String>,
    /// Accepted for qemu-img compatibility: qimg map takes no locks and never writes.
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// The image.
    filename: Option<String>,
}

/// Guest bytes processed per step (QEMU probes up to 1 GiB at a time).
const STEP: u64 = 1 << 30;

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

/// Runs `qimg map`.
pub fn run(args: MapArgs) -> Result<()> {
    let json = json_output(&args.output, "map").map_err(anyhow::Error::msg)?;
    let start = match &args.start_offset {
        Some(s) => parse_offset(s, "start offset")?,
        None => 0,
    };
    let max_length = match &args.max_length {
        Some(s) => Some(parse_offset(s, "max length")?),
        None => None,
    };
    let Some(file) = args.filename else {
        bail!("Expecting one image file name\nTry 'qimg map --help' for more info");
    };
    let path = Path::new(&file);
    let fmt = source_format(path, &file, args.fmt.as_deref())?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the I/O runtime")?;
    rt.block_on(async {
        let layers = open_chain(path, &file, fmt, args.force_share).await?;
        let mut length = layers.size();
        if let Some(m) = max_length {
            length = length.min(start.saturating_add(m));
        }
        let mut w = BufWriter::new(crate::out::stdout());
        let r = walk(&layers, start, length, json, &mut w).await;
        w.flush().context("cannot write the map")?;
        r
    })
}

/// Writes the map of guest bytes `[start, length)` of the chain, merging adjacent entries.
async fn walk(
    layers: &Layers,
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
        layers.status(at, n, &mut buf).await?;
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

//! `qimg compare [-f FMT] [-F FMT] [-s] [-p] [-q] [-U] [-T CACHE] FILE1 FILE2`: whether two
//! images (each read through its backing chain) hold the same guest data, with qemu-img
//! compare's messages and exit statuses: 0 identical, 1 different, 2 an image cannot be
//! opened (or a bad option), 3 block status failed, 4 a read failed.
//!
//! The walk follows qemu-img's: both chains' block status is taken range by range (the same
//! status `map` prints); ranges both read as zeros are skipped without reading, ranges both
//! allocate are read and compared, and a range only one of them allocates must read as zeros
//! there. The first differing 512-byte sector is reported. Images of different sizes are
//! compared over the shorter size, then the longer one's tail must read as zeros ("Warning:
//! Image size mismatch!"); `-s` refuses different sizes and also requires equal block status.

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Result, anyhow};
use qimg::Image;
use qimg::io::AnyStorage;

use crate::cache_mode::CacheMode;
use crate::chain::{Entry, Layer, Layers, open_chain, source_format};
use crate::progress::Progress;
use crate::status::{fail, lib_msg, open_msg, os_msg};

/// Arguments of `qimg compare`.
#[derive(clap::Args)]
pub struct CompareArgs {
    /// Format of the first image: qcow2 or raw (probed when absent).
    #[arg(short = 'f', long = "a-format")]
    fmt1: Option<String>,
    /// Format of the second image: qcow2 or raw (probed when absent).
    #[arg(short = 'F', long = "b-format")]
    fmt2: Option<String>,
    /// Strict mode: the sizes and the block status must be equal too.
    #[arg(short = 's', long = "strict")]
    strict: bool,
    /// Show progress.
    #[arg(short = 'p', long = "progress")]
    progress: bool,
    /// Quiet: print nothing (the exit status tells the result).
    #[arg(short = 'q', long = "quiet")]
    quiet: bool,
    /// Accepted for qemu-img compatibility: compare opens the images read-only.
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// Cache mode of both images (checked; reads go through the page cache).
    #[arg(short = 'T', long = "cache")]
    cache: Option<String>,
    /// The two images.
    files: Vec<String>,
}

/// qemu-img's `IO_BUF_SIZE`: the most bytes read from each image at a time.
const IO_BUF_SIZE: u64 = 2 << 20;
/// The unit in which a mismatch is reported.
const SECTOR: u64 = 512;
/// Guest bytes whose block status is asked at a time.
const STEP: u64 = 1 << 30;

/// How compare ends: the message (if any), on stdout unless it is an error, and the status.
struct Outcome {
    code: u8,
    msg: Option<String>,
    error: bool,
}

impl Outcome {
    fn say(code: u8, msg: impl Into<String>) -> Self {
        Self {
            code,
            msg: Some(msg.into()),
            error: false,
        }
    }
    fn error(code: u8, msg: impl Into<String>) -> Self {
        Self {
            code,
            msg: Some(msg.into()),
            error: true,
        }
    }
}

/// Runs `qimg compare`; the exit status is qemu-img compare's.
pub fn run(args: CompareArgs) -> ExitCode {
    if args.files.len() != 2 {
        return crate::status::fail(
            "Expecting two image file names\nTry 'qimg compare --help' for more info",
            1,
        );
    }
    if let Err(e) = CacheMode::parse_option(args.cache.as_deref(), "source cache") {
        return fail(e, 2);
    }
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(format_args!("cannot start the I/O runtime: {e}"), 2),
    };
    let quiet = args.quiet;
    let mut progress = Progress::start(false, 0);
    let outcome = rt.block_on(compare(&args, &mut progress));
    let outcome = outcome.unwrap_or_else(|e| Outcome::error(2, format!("{e:#}")));
    if let Some(msg) = &outcome.msg {
        if outcome.error {
            progress.end();
            eprintln!("{}: {msg}", crate::status::program());
        } else if !quiet {
            outln!("{msg}");
        }
    }
    progress.end();
    ExitCode::from(outcome.code)
}

/// One image: its chain (for block status), a reader of its guest data and its name.
struct Side {
    layers: Layers,
    reader: Reader,
    name: String,
    size: u64,
}

enum Reader {
    Qcow2(Image<AnyStorage>),
    /// A raw file or NBD export.
    Raw(AnyStorage),
}

impl Side {
    async fn open(file: &str, fmt: Option<&str>, force_share: bool) -> Result<Self> {
        let path = Path::new(file);
        let fmt = source_format(path, file, fmt).map_err(|e| open_msg(e, file))?;
        let layers = open_chain(path, file, fmt, force_share)
            .await
            .map_err(|e| open_msg(e, file))?;
        let reader = match &layers[0] {
            Layer::Qcow2 { image, .. } => Reader::Qcow2(image.clone()),
            Layer::Raw(_) => Reader::Raw(
                AnyStorage::open(path, false, qimg::io::Backend::Threads, false).map_err(|e| {
                    let why = match &e {
                        qimg::io::StorageError::Open { source, .. } => os_msg(source),
                        other => other.to_string(),
                    };
                    anyhow!("Could not open '{file}': {why}")
                })?,
            ),
        };
        let size = layers.size();
        Ok(Self {
            layers,
            reader,
            name: file.to_string(),
            size,
        })
    }

    /// Reads guest bytes at `offset` (zeros past the end of a raw file).
    async fn read(&self, buf: &mut [u8], offset: u64) -> std::result::Result<(), String> {
        match &self.reader {
            Reader::Qcow2(img) => img
                .read(buf, offset)
                .await
                .map_err(|e| lib_msg(&e, &self.name)),
            Reader::Raw(f) => {
                use qimg::io::Storage as _;
                f.read_at_zero_fill(buf, offset).await.map_err(|e| match e {
                    qimg::io::StorageError::Io { source, .. } => os_msg(&source),
                    other => other.to_string(),
                })
            }
        }
    }

    /// The block status of `[start, end)`, as entries.
    async fn status(&self, start: u64, end: u64) -> Result<Vec<Entry>> {
        let mut out = Vec::new();
        let mut at = start;
        while at < end {
            let n = STEP.min(end - at);
            self.layers.status(at, n, &mut out).await?;
            at += n;
        }
        Ok(out)
    }

    /// Checks that `[offset, offset + len)` reads as zeros (qemu-img's `check_empty_sectors`).
    async fn check_empty(&self, offset: u64, len: u64, buf: &mut [u8]) -> Option<Outcome> {
        let buf = &mut buf[..len as usize];
        if let Err(e) = self.read(buf, offset).await {
            return Some(read_error(offset, &self.name, &e));
        }
        first_nonzero_sector(buf)
            .map(|i| Outcome::say(1, format!("Content mismatch at offset {}!", offset + i)))
    }
}

/// qemu-img's refusal when the block status of `side` cannot be read (it names the file and
/// not why).
fn allocation_test_failed(side: &Side) -> Outcome {
    Outcome::error(
        3,
        format!("Sector allocation test failed for {}", side.name),
    )
}

fn read_error(offset: u64, name: &str, e: &str) -> Outcome {
    Outcome::error(
        4,
        format!("Error while reading offset {offset} of {name}: {e}"),
    )
}

/// The offset of the first 512-byte sector of `buf` holding a non-zero byte.
fn first_nonzero_sector(buf: &[u8]) -> Option<u64> {
    buf.chunks(SECTOR as usize)
        .position(|s| s.iter().any(|&b| b != 0))
        .map(|i| i as u64 * SECTOR)
}

/// The offset of the first 512-byte sector where `a` and `b` differ.
fn first_different_sector(a: &[u8], b: &[u8]) -> Option<u64> {
    a.chunks(SECTOR as usize)
        .zip(b.chunks(SECTOR as usize))
        .position(|(x, y)| x != y)
        .map(|i| i as u64 * SECTOR)
}

/// The status flags QEMU's strict mode compares (block status bits, end of file included).
fn flags(e: &Entry, size: u64) -> (bool, bool, bool, bool, bool, bool) {
    (
        e.data,
        e.zero,
        e.offset.is_some(),
        e.present,
        e.compressed,
        e.start + e.length == size,
    )
}

/// A cursor over a list of entries.
struct Cursor {
    entries: Vec<Entry>,
    i: usize,
}

impl Cursor {
    /// The entry holding `at` and the bytes of it from `at` on.
    fn at(&mut self, at: u64) -> Option<(&Entry, u64)> {
        while let Some(e) = self.entries.get(self.i) {
            if at < e.start + e.length {
                return Some((e, e.start + e.length - at));
            }
            self.i += 1;
        }
        None
    }
}

async fn compare(args: &CompareArgs, progress: &mut Progress) -> Result<Outcome> {
    let a = match Side::open(&args.files[0], args.fmt1.as_deref(), args.force_share).await {
        Ok(s) => s,
        Err(e) => return Ok(Outcome::error(2, format!("{e:#}"))),
    };
    let b = match Side::open(&args.files[1], args.fmt2.as_deref(), args.force_share).await {
        Ok(s) => s,
        Err(e) => return Ok(Outcome::error(2, format!("{e:#}"))),
    };
    if args.strict && a.size != b.size {
        return Ok(Outcome::say(1, "Strict mode: Image size mismatch!"));
    }
    let min = a.size.min(b.size);
    let max = a.size.max(b.size);
    *progress = Progress::start(args.progress && !args.quiet, max);
    let mut buf1 = vec![0u8; IO_BUF_SIZE as usize];
    let mut buf2 = vec![0u8; IO_BUF_SIZE as usize];

    let mut at = 0;
    while at < min {
        let window = (at + STEP).min(min);
        // One after the other, as qemu-img asks: the second image is not asked (and says
        // nothing about its own damage) when the first fails.
        let Ok(sa) = a.status(at, window).await else {
            return Ok(allocation_test_failed(&a));
        };
        let Ok(sb) = b.status(at, window).await else {
            return Ok(allocation_test_failed(&b));
        };
        let (mut ca, mut cb) = (Cursor { entries: sa, i: 0 }, Cursor { entries: sb, i: 0 });
        while at < window {
            let (Some((ea, na)), Some((eb, nb))) = (ca.at(at), cb.at(at)) else {
                break;
            };
            let mut chunk = na.min(nb).min(window - at);
            if args.strict && flags(ea, a.size) != flags(eb, b.size) {
                return Ok(Outcome::say(
                    1,
                    format!("Strict mode: Offset {at} block status mismatch!"),
                ));
            }
            let (alloc1, alloc2) = (ea.present, eb.present);
            if ea.zero && eb.zero {
                // Both read as zeros.
            } else if alloc1 == alloc2 {
                if alloc1 {
                    chunk = chunk.min(IO_BUF_SIZE);
                    let n = chunk as usize;
                    if let Err(e) = a.read(&mut buf1[..n], at).await {
                        return Ok(read_error(at, &a.name, &e));
                    }
                    if let Err(e) = b.read(&mut buf2[..n], at).await {
                        return Ok(read_error(at, &b.name, &e));
                    }
                    if let Some(i) = first_different_sector(&buf1[..n], &buf2[..n]) {
                        return Ok(Outcome::say(
                            1,
                            format!("Content mismatch at offset {}!", at + i),
                        ));
                    }
                }
            } else {
                chunk = chunk.min(IO_BUF_SIZE);
                let side = if alloc1 { &a } else { &b };
                if let Some(o) = side.check_empty(at, chunk, &mut buf1).await {
                    return Ok(o);
                }
            }
            at += chunk;
            progress.add(chunk);
        }
    }

    if a.size != b.size {
        if !args.quiet {
            outln!("Warning: Image size mismatch!");
        }
        let over = if a.size > b.size { &a } else { &b };
        let mut at = min;
        while at < max {
            let window = (at + STEP).min(max);
            let entries = match over.status(at, window).await {
                Ok(x) => x,
                Err(_) => return Ok(allocation_test_failed(over)),
            };
            for e in entries {
                let mut pos = e.start.max(at);
                let end = (e.start + e.length).min(window);
                while pos < end {
                    let chunk = (end - pos).min(IO_BUF_SIZE);
                    if e.present && !e.zero {
                        if let Some(o) = over.check_empty(pos, chunk, &mut buf1).await {
                            return Ok(o);
                        }
                    }
                    progress.add(chunk);
                    pos += chunk;
                }
            }
            at = window;
        }
    }
    Ok(Outcome::say(0, "Images are identical."))
}

//! `qimg create [-f qcow2|raw] [-b BACKING [-F FMT]] [-o OPT=VAL,...] [-q] [-u] FILE [SIZE]`:
//! a new image, with qemu-img create's options, `Formatting ...` line and messages.

use std::io::IsTerminal;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use qimg::tools::create::{CreateOptions, create};

use crate::args::image_format;
use crate::create_opts;

/// Arguments of `qimg create`.
#[derive(clap::Args)]
pub struct CreateArgs {
    /// Image format: qcow2 or raw (the default: qcow2 as `qimg`, raw as `qemu-img`, as
    /// qemu-img's).
    #[arg(short = 'f')]
    fmt: Option<String>,
    /// Backing file (same as -o backing_file=).
    #[arg(short = 'b')]
    backing: Option<String>,
    /// Backing file format (same as -o backing_fmt=).
    #[arg(short = 'F')]
    backing_fmt: Option<String>,
    /// Format options, comma separated; `-o help` lists them.
    #[arg(short = 'o', action = clap::ArgAction::Append)]
    options: Vec<String>,
    /// Quiet: print nothing on success.
    #[arg(short = 'q')]
    quiet: bool,
    /// Do not open the backing file (the size must then be given).
    #[arg(short = 'u')]
    unsafe_backing: bool,
    /// The image to create.
    filename: Option<String>,
    /// Virtual size, with an optional k, M, G, T, P or E suffix (`-1` is an option, as
    /// getopt reads it; `-- -1` a size).
    size: Option<String>,
}

/// Runs `qimg create`.
pub fn run(mut args: CreateArgs) -> Result<()> {
    let default = if crate::status::program() == "qemu-img" {
        "raw"
    } else {
        "qcow2"
    };
    let fmt = args.fmt.take().unwrap_or_else(|| default.to_string());
    // qemu-img's words; qimg adds what it supports.
    let unknown = |prefix: String| {
        let hint = if crate::status::program() == "qimg" {
            " (qimg supports qcow2 and raw)"
        } else {
            ""
        };
        anyhow::anyhow!("{prefix}Unknown file format '{}'{hint}", fmt)
    };
    let known = image_format(&fmt).is_some();
    let pairs = crate::args::option_list(&args.options)?;
    if pairs.iter().any(|p| p == "help" || p == "?") {
        if !known {
            return Err(unknown(String::new()));
        }
        out!("{}", create_opts::help_text(&fmt, args.filename.is_some()));
        return Ok(());
    }
    let Some(file) = args.filename.clone() else {
        bail!("Expecting image file name\nTry 'qimg create --help' for more info");
    };
    if !known {
        return Err(unknown(format!("{file}: ")));
    }
    let mut o = CreateOptions::default();
    let mut given = create_opts::Given::default();
    create_opts::apply(&mut o, &mut given, &pairs, &fmt).with_context(|| file.clone())?;
    if let Some(b) = args.backing {
        o.backing_file = Some(b);
    }
    if let Some(f) = args.backing_fmt {
        o.backing_fmt = Some(f);
    }
    o.unsafe_backing = args.unsafe_backing;
    if let Some(s) = &args.size {
        let size = crate::args::size_argument("image size", s).map_err(anyhow::Error::msg)?;
        if o.size.is_some() {
            bail!("{file}: The image size must be specified only once");
        }
        o.size = Some(size);
    }
    let path = Path::new(&file);
    let show_progress = !args.quiet && std::io::stderr().is_terminal();
    let mut last = u64::MAX;
    let mut progress = |done: u64, total: u64| {
        if !show_progress || total == 0 {
            return;
        }
        let pct = done * 10000 / total;
        if pct != last {
            last = pct;
            eprint!("\r    ({:.2}/100%)", pct as f64 / 100.0);
            if done == total {
                eprintln!();
            }
        }
    };
    // Raw, or QEMU's file driver named as the format: the same bytes.
    if create_opts::raw_like(&fmt) {
        let fmt = &fmt;
        // qemu-img's words (the raw driver has neither option).
        if o.backing_file.is_some() {
            bail!("{file}: Backing file not supported for file format '{fmt}'");
        }
        if o.backing_fmt.is_some() {
            bail!("{file}: Backing file format not supported for file format '{fmt}'");
        }
        let size = qimg::tools::create::effective_size(path, &o).with_context(|| file.clone())?;
        if !args.quiet {
            let shown = o.size.unwrap_or(size);
            outln!(
                "{}",
                create_opts::formatting_line(&file, fmt, &o, &given, shown)
            );
            crate::out::flush();
        }
        if let Some(refused) = &given.refused {
            bail!("{file}: {refused}");
        }
        return qimg::tools::create::create_raw(path, size, o.preallocation, &mut progress)
            .map_err(|e| create_error(e, &file));
    }
    // An export named as the backing file is reached once and held until the image is made:
    // every later open of it here shares the connection, so a server that serves one client
    // and then exits (qemu-nbd's default) serves the whole create.
    let mut _held_export = None;
    // Before the `Formatting` line, as qemu-img: the backing file must be named with its
    // format, and must open.
    if let Some(b) = &o.backing_file {
        // qemu-img's first checks of the name (`bdrv_img_create`), as it spells them.
        if *b == file {
            bail!(
                "{file}: Error: Trying to create an image with the same filename as the backing file"
            );
        }
        if b.is_empty() {
            bail!("{file}: Expected backing file name, got empty string");
        }
        let full = qimg::chain::resolve_backing(path, b);
        let qemu = crate::status::program() == "qemu-img";
        // qemu-img opens the backing file first, then asks for its format.
        if qimg::io::nbd::is_nbd_name(b) {
            match qimg::io::NbdStorage::shared(b, false) {
                Ok(export) => _held_export = Some(export),
                Err(source) if !o.unsafe_backing => {
                    let e = qimg::Error::Storage {
                        path: full.clone(),
                        source,
                    };
                    let why = crate::status::lib_msg(&e, b);
                    bail!("{file}: {why}\nCould not open backing image.")
                }
                Err(_) => {}
            }
        } else if let (Err(e), false, true) = (std::fs::metadata(&full), o.unsafe_backing, qemu) {
            bail!(
                "{file}: Could not open '{b}': {}\nCould not open backing image.",
                crate::status::os_msg(&e)
            );
        }
        if o.backing_fmt.is_none() {
            match qimg::chain::probe_format(&full) {
                Ok(f) if qemu => bail!(
                    "{file}: Backing file specified without backing format\nDetected format of {}.",
                    f.name()
                ),
                _ => bail!("{file}: backing_fmt: Backing file specified without backing format"),
            }
        }
    }
    let size = match qimg::tools::create::effective_size(path, &o) {
        Ok(size) => size,
        Err(e) => bail!("{file}: {}", refusal_words(&e)),
    };
    // As qemu-img: the options parsed and the size known, the `Formatting` line comes first;
    // what the qcow2 driver refuses comes after it.
    if !args.quiet {
        outln!(
            "{}",
            create_opts::formatting_line(&file, "qcow2", &o, &given, o.size.unwrap_or(size))
        );
        // qemu-img flushes standard output after this line.
        crate::out::flush();
    }
    let made = match (&given.refused, o.validate()) {
        (Some(refused), _) => Err(anyhow!("{file}: {refused}")),
        (None, Err(e)) => Err(anyhow!("{file}: {}", refusal_words(&e))),
        (None, Ok(())) => create(path, &o, &mut progress)
            .map(drop)
            .map_err(|e| create_error(e, &file)),
    };
    if made.is_err() {
        delete_refused(path, &o);
    }
    made
}

/// `create`'s error for image file `file`: `FILE: ` and [`create_failure`]'s words as
/// qemu-img (and for another process's lock), the library's error with its causes as qimg.
fn create_error(e: qimg::Error, file: &str) -> anyhow::Error {
    if crate::status::program() != "qimg" || crate::status::is_locked(&e) {
        anyhow!("{file}: {}", create_failure(&e, file))
    } else {
        anyhow::Error::new(e).context(file.to_string())
    }
}

/// Why making image file `file` failed, in QEMU's words: the file that could not be created
/// (`Could not create 'F': ...`), another process's lock, or the library's words.
pub(crate) fn create_failure(e: &qimg::Error, file: &str) -> String {
    match e {
        qimg::Error::Io { op, source, .. } if op == "create" => {
            format!(
                "Could not create '{file}': {}",
                crate::status::os_msg(source)
            )
        }
        _ => crate::status::lib_msg(e, file),
    }
}

/// After a qcow2 create failed past its `Formatting` line (in `create` and `convert`): as
/// qemu-img, deletes the image file and the data file, as QEMU's qcow2 driver, which has
/// made them by the time it refuses, deletes them (`bdrv_co_delete_file_noerr`), so that a
/// file of that name that existed before is gone. As qimg nothing is touched: the options
/// are checked before any file is made.
pub(crate) fn delete_refused(path: &Path, o: &CreateOptions) {
    if crate::status::program() != "qemu-img" {
        return;
    }
    // A file another process holds was not touched (creation takes QEMU's write lock before
    // anything else): it stays theirs.
    if let Ok(f) = std::fs::File::open(path) {
        if let Err(qimg::io::StorageError::Locked { .. }) = qimg::io::ImageLock::ReadWrite.lock(&f)
        {
            return;
        }
    }
    let _ = std::fs::remove_file(path);
    if let Some(d) = &o.data_file {
        let _ = std::fs::remove_file(qimg::chain::resolve_backing(path, d));
    }
}

/// A refusal of the create options: qimg names the option and value first
/// ("cluster_size 3072: ..."); as qemu-img (multi-call) only QEMU's own words follow the
/// file name (here and in `convert`'s output).
pub(crate) fn refusal_words(e: &qimg::Error) -> String {
    let text = e.to_string();
    if crate::status::program() != "qemu-img" {
        return text;
    }
    match text.split_once(": ") {
        Some((_, qemu)) => qemu.to_string(),
        None => text,
    }
}

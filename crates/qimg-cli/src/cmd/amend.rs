//! `qimg amend [-f FMT] -o OPTS [-p] [-q] [--force] FILE`: changes the options of an existing
//! qcow2 image ([`qimg::tools::amend`]), with qemu-img amend's option checks and messages:
//! `compat`, `lazy_refcounts`, `refcount_bits`, `data_file` and `size` can change; creation-only
//! options and the backing file (use `rebase`) are refused, as is a raw image.

use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use qimg::chain::ImageFormat;
use qimg::tools::amend::{AmendOptions, amend_with};
use qimg::tools::create::Compat;

use crate::args::{on_off, parse_size};
use crate::chain::{raw_probe_warning, source_format};
use crate::progress::Progress;
use crate::status::{lib_msg, open_msg};

/// Arguments of `qimg amend`.
#[derive(clap::Args)]
pub struct AmendArgs {
    /// Image format: qcow2 (raw images have nothing to amend).
    #[arg(short = 'f', long = "format")]
    fmt: Option<String>,
    /// Options to change, comma separated; `-o help` lists them.
    #[arg(short = 'o', long = "options", action = clap::ArgAction::Append)]
    options: Vec<String>,
    /// Show progress.
    #[arg(short = 'p', long = "progress")]
    progress: bool,
    /// Quiet: no progress.
    #[arg(short = 'q', long = "quiet")]
    quiet: bool,
    /// Accepted for qemu-img compatibility (it only matters for encryption changes).
    #[arg(long)]
    force: bool,
    /// The image.
    filename: Option<String>,
}

/// The options amend can change, as `-o help` lists them.
const AMEND_OPTIONS: &[(&str, &str, &str)] = &[
    ("backing_file", "<str>", "File name of a base image"),
    ("backing_fmt", "<str>", "Image format of the base image"),
    (
        "compat",
        "<str>",
        "Compatibility level (v2 [0.10] or v3 [1.1])",
    ),
    ("data_file", "<str>", "File name of an external data file"),
    (
        "data_file_raw",
        "<bool (on/off)>",
        "The external data file must stay valid as a raw image",
    ),
    (
        "lazy_refcounts",
        "<bool (on/off)>",
        "Postpone refcount updates",
    ),
    (
        "refcount_bits",
        "<num>",
        "Width of a reference count entry in bits",
    ),
    ("size", "<size>", "Virtual disk size"),
];

/// The LUKS keyslot options QEMU lists among amend's (between `data_file_raw` and
/// `lazy_refcounts`); qimg does not change an image's encryption (key slots), and refuses
/// these.
const AMEND_ENCRYPT_HELP: &[(&str, &str, &str)] = &[
    (
        "encrypt.iter-time",
        "<num>",
        "Time to spend in PBKDF in milliseconds",
    ),
    (
        "encrypt.keyslot",
        "<num>",
        "Select a single keyslot to modify explicitly",
    ),
    (
        "encrypt.new-secret",
        "<str>",
        "New secret to set in the matching keyslots. Empty string to erase",
    ),
    (
        "encrypt.old-secret",
        "<str>",
        "Select all keyslots that match this password",
    ),
    (
        "encrypt.state",
        "<str>",
        "Select new state of affected keyslots (active/inactive)",
    ),
];

/// Options that only `create` takes.
const CREATE_ONLY: &[&str] = &[
    "cluster_size",
    "extended_l2",
    "preallocation",
    "encryption",
    "encrypt.format",
    "compression_type",
];

/// Runs `qimg amend`.
pub fn run(args: AmendArgs) -> Result<()> {
    let pairs = crate::args::option_list(&args.options)?;
    if pairs.iter().any(|p| p == "help" || p == "?") {
        outln!("Amend options for 'qcow2':");
        let mut list: Vec<_> = AMEND_OPTIONS.iter().chain(AMEND_ENCRYPT_HELP).collect();
        list.sort_by_key(|o| o.0);
        for (k, t, d) in list {
            let left = format!("{k}={t}");
            outln!("  {left:<22} - {d}");
        }
        return Ok(());
    }
    if args.options.is_empty() {
        bail!("Must specify options (-o)\nTry 'qimg amend --help' for more info");
    }
    let Some(file) = args.filename else {
        bail!("Expecting one image file name\nTry 'qimg amend --help' for more info");
    };
    let path = Path::new(&file);
    let fmt = source_format(path, &file, args.fmt.as_deref()).map_err(|e| open_msg(e, &file))?;
    if let Some(warning) = raw_probe_warning(&file, args.fmt.as_deref(), fmt) {
        eprintln!("{warning}");
    }
    if fmt == ImageFormat::Raw {
        if !path.exists() {
            bail!("Could not open '{file}': Could not open '{file}': No such file or directory");
        }
        bail!("Format driver 'raw' does not support option amendment");
    }
    let opts = parse(&pairs)?;
    if matches!(opts, Parsed::Backing) {
        bail!(
            "Cannot amend the backing file\nYou can use '{} rebase' instead.",
            crate::status::program()
        );
    }
    let Parsed::Options(opts) = opts else {
        unreachable!("handled above")
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the I/O runtime")?;
    let mut progress = Progress::start(args.progress && !args.quiet, 100);
    let mut done = 0u64;
    let mut report = |d: u64, total: u64| {
        if let Some(pct) = (d * 100).checked_div(total) {
            progress.add(pct.saturating_sub(done));
            done = done.max(pct);
        }
    };
    // An encrypted image opens with its passphrase (`encrypt.key-secret`).
    let mut base = qimg::OpenOptions::new();
    if let Some(key) = crate::encryption::key_for(&file) {
        base = base.encryption_key(key);
    }
    let r = rt.block_on(amend_with(path, &opts, &base, &mut report));
    progress.end();
    r.map_err(|e| match crate::status::qemu_header_words(&e) {
        // A header QEMU refuses at open, in its words.
        Some(words) => anyhow!("Could not open '{file}': {words}"),
        // Another process's lock: QEMU fails the open.
        None => crate::status::lock_refusal(&e, &file).unwrap_or_else(|| {
            let msg = lib_msg(&e, &file);
            // A file the image names (a new data file) that does not open: QEMU's reopen of
            // the image fails, and says so first.
            if msg.starts_with("Could not open '")
                && !msg.starts_with(&format!("Could not open '{file}'"))
            {
                anyhow!("Could not open '{file}': {msg}")
            } else {
                anyhow!("{msg}")
            }
        }),
    })
}

enum Parsed {
    Options(AmendOptions),
    Backing,
}

/// Parses `-o` pairs with qemu-img amend's checks, in its order.
fn parse(pairs: &[String]) -> Result<Parsed> {
    let mut o = AmendOptions::default();
    let mut backing = false;
    // Key slot changes: QEMU wants `encrypt.state` first; qimg does not change key slots.
    let keyslot = |p: &String| {
        AMEND_ENCRYPT_HELP
            .iter()
            .any(|a| p.starts_with(&format!("{}=", a.0)))
    };
    if pairs.iter().any(keyslot) {
        if !pairs.iter().any(|p| p.starts_with("encrypt.state=")) {
            bail!("Parameter 'state' is missing");
        }
        bail!("qimg does not change the key slots of an encrypted image (encrypt.state)");
    }
    for p in pairs {
        let (k, v) = p.split_once('=').unwrap_or((p.as_str(), ""));
        if CREATE_ONLY.contains(&k) {
            bail!("Invalid parameter '{k}'\nThis option is only supported for image creation");
        }
        if !AMEND_OPTIONS.iter().any(|a| a.0 == k) {
            bail!("Invalid parameter '{k}'");
        }
        match k {
            "compat" => {
                o.compat = Some(match v {
                    "0.10" | "v2" => Compat::V2,
                    "1.1" | "v3" => Compat::V3,
                    _ => bail!("Unknown compatibility level {v}"),
                })
            }
            "lazy_refcounts" => o.lazy_refcounts = Some(on_off(k, v).map_err(anyhow::Error::msg)?),
            "refcount_bits" => {
                o.refcount_bits = Some(
                    v.parse()
                        .map_err(|_| anyhow!("Parameter 'refcount_bits' expects a number"))?,
                )
            }
            "data_file" => o.data_file = Some(v.to_string()),
            "data_file_raw" => o.data_file_raw = Some(on_off(k, v).map_err(anyhow::Error::msg)?),
            "size" => {
                o.size =
                    Some(parse_size(v).ok_or_else(|| anyhow!(crate::args::size_error("size", v)))?)
            }
            "backing_file" | "backing_fmt" => backing = true,
            _ => {}
        }
    }
    if backing {
        return Ok(Parsed::Backing);
    }
    Ok(Parsed::Options(o))
}

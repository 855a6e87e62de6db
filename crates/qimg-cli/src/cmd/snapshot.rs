//! `qimg snapshot [-f FMT] [-U] [-q] (-l | -c NAME | -a NAME | -d NAME) FILE`: list, create,
//! apply or delete the internal snapshots of a qcow2 image, as `qemu-img snapshot` does
//! (same table, same messages, same exit codes).
//!
//! As in qemu-img: `-l` is the default; `-a` looks a snapshot up by ID, then by name; `-d`
//! by name only (the first one with that name); names need not be unique; a raw image has no
//! snapshots (the list is empty, the other actions fail); the backing file is not opened.

use std::path::Path;

use anyhow::{Result, anyhow, bail};

use qimg::InternalSnapshot;
use qimg::chain::ImageFormat;

use crate::chain::source_format;
use crate::human::{size_to_str, utc_date};
use crate::status::{lib_msg, os_msg};

/// Arguments of `qimg snapshot`.
#[derive(clap::Args)]
pub struct SnapshotArgs {
    /// Image format: qcow2 or raw (probed when absent).
    #[arg(short = 'f', long = "format")]
    fmt: Option<String>,
    /// Open the image read-only without taking the write lock's share (only with -l).
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// Quiet (qemu-img prints nothing more on success either).
    #[arg(short = 'q')]
    quiet: bool,
    /// List the snapshots (the default).
    #[arg(short = 'l', long = "list", action = clap::ArgAction::Count)]
    list: u8,
    /// Create a snapshot with this name.
    #[arg(short = 'c', long = "create", action = clap::ArgAction::Append)]
    create: Vec<String>,
    /// Apply (revert the disk to) the snapshot with this ID or name.
    #[arg(short = 'a', long = "apply", action = clap::ArgAction::Append)]
    apply: Vec<String>,
    /// Delete the snapshot with this name.
    #[arg(short = 'd', long = "delete", action = clap::ArgAction::Append)]
    delete: Vec<String>,
    /// The image.
    filenames: Vec<String>,
}

enum Action {
    List,
    Create(String),
    Apply(String),
    Delete(String),
}

const TRY_HELP: &str = "Try 'qimg snapshot --help' for more info";

/// The `-l` table, byte for byte as qemu-img prints it.
pub fn table(snaps: &[InternalSnapshot]) -> String {
    let mut s = String::from("Snapshot list:\n");
    s += &format!(
        "{:<7} {:<16} {:>8} {:>19} {:>15} {:>10}\n",
        "ID", "TAG", "VM_SIZE", "DATE", "VM_CLOCK", "ICOUNT"
    );
    for sn in snaps {
        let secs = sn.vm_clock_nsec / 1_000_000_000;
        let clock = format!(
            "{:04}:{:02}:{:02}.{:03}",
            secs / 3600,
            secs / 60 % 60,
            secs % 60,
            sn.vm_clock_nsec / 1_000_000 % 1000
        );
        s += &format!(
            "{:<7} {:<16} {:>8} {:>19} {:>15} {:>10}\n",
            sn.id,
            sn.name,
            size_to_str(sn.vm_state_size),
            utc_date(u64::from(sn.date_sec)),
            clock,
            sn.icount
                .map(|c| c.to_string())
                .unwrap_or_else(|| "--".into())
        );
    }
    s
}

/// Runs `qimg snapshot`.
pub fn run(args: SnapshotArgs) -> Result<()> {
    let _ = args.quiet;
    let n = usize::from(args.list) + args.create.len() + args.apply.len() + args.delete.len();
    if n > 1 {
        bail!("Cannot mix '-l', '-a', '-c', '-d'\n{TRY_HELP}");
    }
    let action = if let Some(c) = args.create.into_iter().next() {
        Action::Create(c)
    } else if let Some(a) = args.apply.into_iter().next() {
        Action::Apply(a)
    } else if let Some(d) = args.delete.into_iter().next() {
        Action::Delete(d)
    } else {
        Action::List
    };
    let [file] = <[String; 1]>::try_from(args.filenames)
        .map_err(|_| anyhow!("Expecting one image file name\n{TRY_HELP}"))?;
    let writable = !matches!(action, Action::List);
    if args.force_share && writable {
        bail!("Could not open '{file}': force-share=on can only be used with read-only images");
    }
    let path = Path::new(&file);
    if let Err(e) = std::fs::metadata(path) {
        bail!(
            "Could not open '{file}': Could not open '{file}': {}",
            os_msg(&e)
        );
    }
    let fmt = source_format(path, &file, args.fmt.as_deref())?;
    if fmt == ImageFormat::Raw {
        // QEMU warns only where a write could reach block 0: not for a list (read-only).
        if args.fmt.is_none() && !matches!(action, Action::List) {
            eprintln!(
                "WARNING: Image format was not specified for '{file}' and probing guessed raw.\n         \
                 Automatically detecting the format is dangerous for raw images, write operations on block 0 will be restricted.\n         \
                 Specify the 'raw' format explicitly to remove the restrictions."
            );
        }
        // A raw image has no snapshots; qemu-img's answers for each action.
        return match action {
            Action::List => Ok(()),
            Action::Create(name) => {
                bail!("Could not create snapshot '{name}': Operation not supported")
            }
            Action::Apply(name) => {
                bail!("Could not apply snapshot '{name}': Block driver does not support snapshots")
            }
            Action::Delete(name) => bail!("Could not delete snapshot '{name}': snapshot not found"),
        };
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let img = crate::image_spec::options_for(path)
            .writable(writable)
            .force_share(args.force_share)
            // Opening for writing needs the chain (qemu-img opens none).
            .follow_backing(writable)
            .clean_timer(false)
            .open(path)
            .await
            .map_err(|e| anyhow!("Could not open '{file}': {}", lib_msg(&e, &file)))?;
        let result = match action {
            Action::List => {
                let snaps = img
                    .snapshots()
                    .await
                    .map_err(|e| anyhow!(lib_msg(&e, &file)))?;
                if !snaps.is_empty() {
                    out!("{}", table(&snaps));
                }
                Ok(())
            }
            Action::Create(name) => img.create_snapshot(&name).await.map(drop).map_err(|e| {
                anyhow!(
                    "Could not create snapshot '{name}': {}",
                    reason(&e, &file, "Operation not supported")
                )
            }),
            Action::Apply(name) => img.apply_snapshot(&name).await.map_err(|e| {
                // Refused before the driver is asked (bitmaps): no "Failed to load".
                if let qimg::Error::InvalidOption(why) = &e {
                    return anyhow!("Could not apply snapshot '{name}': {why}");
                }
                let why = match &e {
                    qimg::Error::SnapshotNotFound { .. } => "No such file or directory".into(),
                    other => reason(other, &file, "Operation not supported"),
                };
                anyhow!("Could not apply snapshot '{name}': Failed to load snapshot: {why}")
            }),
            Action::Delete(name) => delete(&img, &name, &file).await,
        };
        let closed = img
            .close()
            .await
            .map_err(|e| anyhow!("{}", lib_msg(&e, &file)));
        result.and(closed)
    })
}

/// `-d`: by name only, as qemu-img (the first snapshot with that name).
async fn delete<S: qimg::io::Storage + 'static>(
    img: &qimg::Image<S>,
    name: &str,
    file: &str,
) -> Result<()> {
    let not_found = || anyhow!("Could not delete snapshot '{name}': snapshot not found");
    let snaps = img
        .snapshots()
        .await
        .map_err(|e| anyhow!("Could not delete snapshot '{name}': {}", lib_msg(&e, file)))?;
    let Some(sn) = snaps.iter().find(|s| s.name == name) else {
        return Err(not_found());
    };
    img.delete_snapshot(&sn.id)
        .await
        .map_err(|e| anyhow!("Could not delete snapshot '{name}': {}", lib_msg(&e, file)))
}

/// The reason of a failed snapshot change: qemu-img's `strerror` text for what QEMU does
/// not support, else the library's message.
fn reason(e: &qimg::Error, file: &str, unsupported: &str) -> String {
    if let Some(why) = crate::status::damage_errno_text(e) {
        return why;
    }
    match e {
        qimg::Error::Unsupported { .. } => unsupported.to_string(),
        // QEMU's errno for what the image cannot take (a refcount that would overflow).
        qimg::Error::InvalidOption(_) if crate::status::program() != "qimg" => {
            crate::status::os_msg(&std::io::Error::from_raw_os_error(22))
        }
        other => lib_msg(other, file),
    }
}

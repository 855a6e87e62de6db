//! `qimg`: create and inspect qcow2 images; option names, output and exit codes follow
//! `qemu-img` so that habits and scripts carry over.
//!
//! This file only parses the command line and dispatches: each command lives in
//! [`cmd`]; what several commands share is in one module each (option values in [`args`],
//! cache modes in [`cache_mode`], opening and walking a backing chain in [`chain`], the
//! options of a new image in [`create_opts`], qemu-img's human text in [`human`], exit
//! statuses and error wording in [`status`]).

#![forbid(unsafe_code)]

mod args;
mod cache_mode;
mod chain;
mod cmd;
mod create_opts;
mod human;
mod image_spec;
mod progress;
mod qjson;
mod status;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::status::exit_status;

#[derive(Parser)]
#[command(
    name = "qimg",
    version,
    about = "qcow2 images with subcluster allocation, qemu-img compatible"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create a new image: `qimg create [-f qcow2] [-b BACKING [-F FMT]] [-o OPT=VAL,...] [-q] FILE [SIZE]`
    Create(cmd::create::CreateArgs),
    /// Show information about an image (read-only).
    Info(cmd::info::InfoArgs),
    /// Check an image for consistency, optionally repairing it: `qimg check [-r leaks|all] [--output human|json] FILE`
    Check(cmd::check::CheckArgs),
    /// Show where the data of an image lives: `qimg map [--output human|json] FILE`
    Map(cmd::map::MapArgs),
    /// Convert images: `qimg convert [-f FMT] [-O qcow2|raw] [-o OPTS] [-B BACKING -F FMT] [-c] [-p] [-t CACHE] [-T CACHE] SRC... DST`
    Convert(cmd::convert::ConvertArgs),
    /// Measure I/O performance: `qimg bench [-c COUNT] [-d DEPTH] [-w] ... FILE`
    Bench(cmd::bench::BenchArgs),
    /// Compare the guest data of two images: `qimg compare [-f FMT] [-F FMT] [-s] [-p] [-q] [-U] FILE1 FILE2`
    Compare(cmd::compare::CompareArgs),
    /// Measure the size of a new image: `qimg measure [--output human|json] [-O FMT] [-o OPTS] [-f FMT] (--size SIZE | FILE)`
    Measure(cmd::measure::MeasureArgs),
    /// Change the virtual size of an image: `qimg resize [-f FMT] [--shrink] [--preallocation=MODE] [-q] FILE [+|-]SIZE`
    Resize(cmd::resize::ResizeArgs),
    /// Change the options of a qcow2 image: `qimg amend [-f FMT] -o OPTS [-p] [-q] [--force] FILE`
    Amend(cmd::amend::AmendArgs),
    /// Change the backing file of an image: `qimg rebase [-f FMT] [-F FMT] -b BACKING [-u] [-p] FILE`
    Rebase(cmd::rebase::RebaseArgs),
    /// Write an image's data into its backing file: `qimg commit [-f FMT] [-t CACHE] [-b BASE] [-d] [-p] [-q] FILE`
    Commit(cmd::commit::CommitArgs),
    /// Export an image over NBD and/or as a vhost-user-blk device: `qimg serve (--nbd unix:PATH|HOST:PORT [-x NAME] [-e N] [--persistent] | --vhost-user-blk SOCKET [--num-queues N]) [-r] [-t CACHE] FILE`
    Serve(cmd::serve::ServeArgs),
    /// List, create, apply or delete internal snapshots: `qimg snapshot [-f FMT] [-U] [-q] (-l | -c NAME | -a NAME | -d NAME) FILE`
    Snapshot(cmd::snapshot::SnapshotArgs),
    /// Copy blocks of an image into a new one: `qimg dd [-f FMT] [-O FMT] if=INPUT of=OUTPUT [bs=SIZE] [count=N] [skip=N]`
    Dd(cmd::dd::DdArgs),
    /// Change the persistent dirty bitmaps of a qcow2 image: `qimg bitmap (--merge SOURCE | --add | --remove | --clear | --enable | --disable)... [-b SOURCE_FILE [-F SOURCE_FMT]] [-g GRANULARITY] [-f FMT] FILE BITMAP`
    Bitmap(cmd::bitmap::BitmapArgs),
    /// Run qemu-io commands on an image: `qimg io [-f FMT] [-r] [-U] [-t CACHE] [-i AIO] [-n] [-c CMD]... FILE`
    Io(cmd::io::IoArgs),
}

/// A reader that goes away (`qimg map ... | head`) ends the command quietly with the status a
/// C tool killed by SIGPIPE has (128 + 13), as qemu-img does, instead of a panic from
/// `println!`. (Restoring SIGPIPE's default action would need `unsafe`.)
fn quiet_on_closed_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.starts_with("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(141);
        }
        default(info);
    }));
}

/// The command line as QEMU's tools take it. Installed (or linked) as `qemu-img`, the binary
/// is `qimg` speaking as qemu-img (messages start `qemu-img:`); as `qemu-io`, it is `qimg
/// io`. A single-value option given twice keeps the last value, as QEMU's `getopt` loops do.
fn parse() -> Cli {
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let invoked = args
        .first()
        .and_then(|a| std::path::Path::new(a).file_name())
        .and_then(|n| n.to_str())
        .unwrap_or("qimg");
    let name = match invoked {
        "qemu-img" => "qemu-img",
        "qemu-io" => "qemu-io",
        _ => "qimg",
    };
    status::set_program(name);
    if name == "qemu-io" {
        args.insert(1, "io".into());
    }
    if name == "qemu-img" {
        // qemu-img's words for a missing or unknown command (clap's are its own).
        let known = |c: &str| Cli::command().get_subcommands().any(|s| s.get_name() == c);
        let refusal = match args.get(1).and_then(|a| a.to_str()) {
            None => Some("Not enough arguments".to_string()),
            Some(c) if !c.starts_with('-') && !known(c) => Some(format!("Command not found: {c}")),
            _ => None,
        };
        if let Some(r) = refusal {
            eprintln!("qemu-img: {r}\nTry 'qemu-img --help' for more info");
            std::process::exit(1);
        }
    }
    if let Err(e) = image_spec::rewrite(&mut args) {
        eprintln!("{name}: {e}");
        std::process::exit(1);
    }
    let command = Cli::command()
        .name(name)
        .bin_name(name)
        .args_override_self(true)
        .mut_subcommands(|c| c.args_override_self(true));
    let matches = command.get_matches_from(args);
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

fn main() -> ExitCode {
    quiet_on_closed_stdout();
    match parse().cmd {
        Command::Create(a) => exit_status(cmd::create::run(a)),
        Command::Info(a) => exit_status(cmd::info::run(a)),
        // check has qemu-img check's exit codes (2 corruptions, 3 leaks, 63 no checks).
        Command::Check(a) => cmd::check::run(a),
        Command::Map(a) => exit_status(cmd::map::run(a)),
        Command::Convert(a) => exit_status(cmd::convert::run(a)),
        Command::Bench(a) => exit_status(cmd::bench::run(a)),
        // compare has qemu-img compare's exit codes (1 different, 2 open error, 4 read error).
        Command::Compare(a) => cmd::compare::run(a),
        Command::Measure(a) => exit_status(cmd::measure::run(a)),
        Command::Resize(a) => exit_status(cmd::resize::run(a)),
        Command::Amend(a) => exit_status(cmd::amend::run(a)),
        Command::Rebase(a) => exit_status(cmd::rebase::run(a)),
        Command::Commit(a) => exit_status(cmd::commit::run(a)),
        Command::Serve(a) => exit_status(cmd::serve::run(a)),
        Command::Snapshot(a) => exit_status(cmd::snapshot::run(a)),
        Command::Dd(a) => exit_status(cmd::dd::run(a)),
        Command::Bitmap(a) => cmd::bitmap::main(a),
        // io has qemu-io's exit status and prints its own errors.
        Command::Io(a) => cmd::io::run(a),
    }
}

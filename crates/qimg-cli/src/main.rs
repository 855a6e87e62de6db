//! `qimg`: create and inspect qcow2 images; option names, output and exit codes follow
//! `qemu-img` so that habits and scripts carry over.
//!
//! This file only parses the command line and dispatches: each command lives in
//! [`cmd`]; what several commands share is in one module each (option values in [`args`],
//! cache modes in [`cache_mode`], opening and walking a backing chain in [`chain`], the
//! options of a new image in [`create_opts`], qemu-img's human text in [`human`], exit
//! statuses and error wording in [`status`]).

#![forbid(unsafe_code)]

#[macro_use]
mod out;
mod args;
mod cache_mode;
mod chain;
mod cmd;
mod create_opts;
mod encryption;
mod human;
mod image_spec;
mod option_string;
mod progress;
mod qjson;
mod raw_window;
mod runtime_opts;
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
    Serve(Box<cmd::serve::ServeArgs>),
    /// List, create, apply or delete internal snapshots: `qimg snapshot [-f FMT] [-U] [-q] (-l | -c NAME | -a NAME | -d NAME) FILE`
    Snapshot(cmd::snapshot::SnapshotArgs),
    /// Copy blocks of an image into a new one: `qimg dd [-f FMT] [-O FMT] if=INPUT of=OUTPUT [bs=SIZE] [count=N] [skip=N]`
    Dd(cmd::dd::DdArgs),
    /// Change the persistent dirty bitmaps of a qcow2 image: `qimg bitmap (--merge SOURCE | --add | --remove | --clear | --enable | --disable)... [-b SOURCE_FILE [-F SOURCE_FMT]] [-g GRANULARITY] [-f FMT] FILE BITMAP`
    Bitmap(cmd::bitmap::BitmapArgs),
    /// Back up an NBD export (a checkpoint's view of `qimg serve --monitor`): `qimg backup full SOURCE OUTPUT`, `qimg backup incremental --bitmap NAME SOURCE -B PREVIOUS OUTPUT`, `qimg backup verify SOURCE CHAIN`
    Backup(cmd::backup::BackupArgs),
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
            crate::out::exit(141);
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
    if name != "qimg" {
        out::block_buffered();
    }
    if name == "qemu-io" {
        args.insert(1, "io".into());
    }
    if name == "qemu-img" {
        drop_trace_options(&mut args);
        // qemu-img's words for a missing or unknown command (clap's are its own).
        let known = |c: &str| Cli::command().get_subcommands().any(|s| s.get_name() == c);
        let refusal = match args.get(1).and_then(|a| a.to_str()) {
            None => Some("Not enough arguments".to_string()),
            Some(c) if !c.starts_with('-') && !known(c) => Some(format!("Command not found: {c}")),
            _ => None,
        };
        if let Some(r) = refusal {
            eprintln!("qemu-img: {r}\nTry 'qemu-img --help' for more info");
            crate::out::exit(1);
        }
        // qemu-img's own help before the command (clap's lists qimg's commands its way).
        if args.get(1).is_some_and(|a| a == "-h" || a == "--help") {
            out!("{}", qemu_img_help());
            crate::out::exit(0);
        }
    }
    if let Err(e) = take_objects(&mut args) {
        eprintln!("{name}: {e}");
        crate::out::exit(1);
    }
    if let Err(e) = image_spec::rewrite(&mut args, name) {
        eprintln!("{name}: {e}");
        // compare's exit code for an image that does not open is 2.
        let compare = args.get(1).is_some_and(|a| a == "compare");
        crate::out::exit(if compare { 2 } else { 1 });
    }
    if name != "qimg" && asks_version(&args, name) {
        outln!(
            "{name} version {QEMU_INTERFACE} (qimg {})",
            env!("CARGO_PKG_VERSION")
        );
        outln!("qimg implements the command line of QEMU's tools of that version");
        crate::out::exit(0);
    }
    let command = Cli::command()
        .name(name)
        .bin_name(name)
        .args_override_self(true)
        .mut_subcommands(|c| c.args_override_self(true));
    let matches = match command.try_get_matches_from(args) {
        Ok(m) => m,
        Err(e) if name == "qimg" => e.exit(),
        Err(e) => refuse_as_qemu(name, &e),
    };
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

/// `--object TYPE,id=ID,...` (QEMU's user-creatable objects, any number, anywhere on the
/// line): taken off the command line and checked as QEMU checks them. Secrets
/// (`secret,id=ID,data=VALUE|file=PATH[,format=base64]`: passphrases of encrypted images) and
/// TLS credentials are kept; other object types are refused. qemu-img's `bench` takes none,
/// as QEMU's.
fn take_objects(args: &mut Vec<std::ffi::OsString>) -> Result<(), String> {
    let bench = args.get(1).is_some_and(|a| a == "bench")
        && args.first().is_some_and(|p| {
            std::path::Path::new(p)
                .file_name()
                .is_some_and(|n| n == "qemu-img")
        });
    if bench {
        if args
            .iter()
            .any(|a| a.to_string_lossy().starts_with("--object"))
        {
            // getopt's words, with the command's name.
            eprintln!(
                "qemu-img bench: unrecognized option '--object'\nTry 'qemu-img bench --help' for \
                 more info"
            );
            crate::out::exit(1);
        }
        return Ok(());
    }
    let mut i = 1;
    while i < args.len() {
        let a = args[i].to_string_lossy().into_owned();
        let value = if a == "--object" {
            if i + 1 >= args.len() {
                return Err("option '--object' requires an argument".into());
            }
            let v = args.remove(i + 1).to_string_lossy().into_owned();
            args.remove(i);
            v
        } else if let Some(v) = a.strip_prefix("--object=") {
            let v = v.to_string();
            args.remove(i);
            v
        } else if a == "-c" || a == "--cmd" {
            // A qemu-io command, never an option.
            i += 2;
            continue;
        } else {
            i += 1;
            continue;
        };
        check_object(&value)?;
    }
    Ok(())
}

/// One `--object` value, checked as QEMU's object creation checks it.
fn check_object(value: &str) -> Result<(), String> {
    let pairs = args::split_opts(value);
    let get = |key: &str| {
        pairs
            .iter()
            .rev()
            .find_map(|p| p.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
    };
    let kind = pairs
        .first()
        .map(|p| p.strip_prefix("qom-type=").unwrap_or(p))
        .unwrap_or_default();
    match kind {
        "secret" => {}
        "tls-creds-x509" => {
            let id = get("id").ok_or("Parameter 'id' is missing")?;
            let endpoint = get("endpoint").unwrap_or("client");
            if !matches!(endpoint, "client" | "server") {
                return Err(format!(
                    "Parameter 'endpoint' does not accept value '{endpoint}'"
                ));
            }
            // QEMU's default directory, and its check when the object is made.
            let dir = get("dir").unwrap_or("/etc/pki/qemu");
            let ca = std::path::Path::new(dir).join("ca-cert.pem");
            if let Err(e) = std::fs::metadata(&ca) {
                return Err(format!(
                    "Unable to access credentials {}: {}",
                    ca.display(),
                    status::os_msg(&e)
                ));
            }
            image_spec::add_tls_creds(id, dir, endpoint == "client");
            return Ok(());
        }
        "tls-creds-psk" | "tls-creds-anon" | "throttle-group" | "iothread" => {
            return Err(format!(
                "qimg does not support objects of type '{kind}' yet"
            ));
        }
        other => {
            return Err(format!(
                "Parameter 'qom-type' does not accept value '{other}'"
            ));
        }
    }
    if get("id").is_none() {
        return Err("Parameter 'id' is missing".into());
    }
    let raw = match (get("data"), get("file")) {
        (None, None) => Err("Either 'file' or 'data' must be provided".to_string()),
        (Some(_), Some(_)) => Err("'data' and 'file' are mutually exclusive".into()),
        (None, Some(f)) => {
            std::fs::read(f).map_err(|e| format!("Unable to read {f}: {}", status::os_msg(&e)))
        }
        (Some(d), None) => Ok(d.as_bytes().to_vec()),
    }?;
    if get("keyid").is_some() || get("iv").is_some() {
        return Err(
            "qimg does not support secrets encrypted with another secret (keyid, iv)".into(),
        );
    }
    let data = match get("format").unwrap_or("raw") {
        "raw" => raw,
        "base64" => encryption::base64_decode(&raw).ok_or("Unable to decode base64 data")?,
        other => {
            return Err(format!(
                "Parameter 'format' does not accept value '{other}'"
            ));
        }
    };
    encryption::add_secret(get("id").unwrap_or_default(), data);
    Ok(())
}

/// Whether the short option `typed` (`-f`) is the one whose long form clap reported (`long`,
/// `--format`): same first letter after the dashes, as every such pair of qemu's is named.
fn short_of(_e: &clap::Error, long: &str, typed: &str) -> bool {
    let (Some(long), Some(short)) = (long.strip_prefix("--"), typed[1..].chars().next()) else {
        return false;
    };
    // A short name some command declares for that long one.
    let cli = Cli::command();
    let mut declared = std::iter::once(&cli)
        .chain(cli.get_subcommands())
        .flat_map(|c| c.get_arguments())
        .filter(|a| a.get_long() == Some(long))
        .filter_map(|a| a.get_short())
        .peekable();
    if declared.peek().is_none() {
        return long.starts_with(short);
    }
    declared.any(|d| d == short)
}

/// The QEMU release whose qemu-img and qemu-io command lines qimg implements (what
/// `--version` says when qimg runs as one of them).
const QEMU_INTERFACE: &str = "10.0.0";

/// qemu-img's standard option `-T`/`--trace` before the command, accepted and ignored as
/// qemu-io's is (qimg has no QEMU trace events).
fn drop_trace_options(args: &mut Vec<std::ffi::OsString>) {
    loop {
        let Some(a) = args.get(1).and_then(|a| a.to_str()) else {
            return;
        };
        let n = match a {
            "-T" | "--trace" if args.len() < 3 => {
                let which = if a == "-T" {
                    "option requires an argument -- 'T'"
                } else {
                    "option '--trace' requires an argument"
                };
                eprintln!("qemu-img: {which}\nTry 'qemu-img --help' for more info");
                crate::out::exit(1);
            }
            "-T" | "--trace" => 2,
            _ if a.starts_with("--trace=") || (a.starts_with("-T") && a.len() > 2) => 1,
            _ => return,
        };
        let end = (1 + n).min(args.len());
        args.drain(1..end);
    }
}

/// `qemu-img --help` in qemu-img's shape: version, usage, standard options, the commands
/// qimg has (with qemu-img's one-line descriptions) and the drivers it opens.
fn qemu_img_help() -> String {
    // qemu-img's commands, in its order, that qimg implements.
    const COMMANDS: [(&str, &str); 15] = [
        ("amend", "Update format-specific options of the image"),
        ("bench", "Run simple image benchmark"),
        (
            "bitmap",
            "Perform modifications of the persistent bitmap in the image",
        ),
        ("check", "Check basic image integrity"),
        ("commit", "Commit image to its backing file"),
        ("compare", "Check if two images have the same contents"),
        (
            "convert",
            "Copy one image to another with optional format conversion",
        ),
        ("create", "Create and format new image file"),
        ("dd", "Copy input to output with optional format conversion"),
        ("info", "Display information about image"),
        ("map", "Dump image metadata"),
        ("measure", "Calculate file size requred for a new image"),
        ("rebase", "Change backing file of the image"),
        ("resize", "Resize the image to the new size"),
        ("snapshot", "List or manipulate snapshots within image"),
    ];
    let mut h = format!(
        "qemu-img version {QEMU_INTERFACE} (qimg {})\n\
         qimg implements the command line of QEMU's tools of that version\n\
         QEMU disk image utility.  Usage:\n\n  \
         qemu-img [standard options] COMMAND [--help | command options]\n\n\
         Standard options:\n  -h, --help\n     display this help and exit\n  \
         -V, --version\n     display version info and exit\n\n\
         Recognized commands (run qemu-img COMMAND --help for command-specific help):\n\n",
        env!("CARGO_PKG_VERSION")
    );
    for (name, what) in COMMANDS {
        h.push_str(&format!("  {name} - {what}\n"));
    }
    h.push_str("\nSupported image formats:\n\n  blkdebug file nbd null-co qcow2 raw\n");
    h
}

/// Whether a qemu-img or qemu-io command line asks for the version (`-V`, `--version`)
/// rather than giving it as an option's value.
fn asks_version(args: &[std::ffi::OsString], name: &str) -> bool {
    // qemu-io's options that take a value (so that `-c -V` is a command, not a request).
    let takes_value = [
        "-c", "--cmd", "-f", "--format", "-t", "--cache", "-i", "--aio", "-d",
    ];
    let first = if name == "qemu-io" { 2 } else { 1 };
    let rest = args.get(first..).unwrap_or_default();
    if name == "qemu-img" {
        // Only before the command, as qemu-img takes it.
        return rest.first().is_some_and(|a| a == "-V" || a == "--version");
    }
    rest.iter().enumerate().any(|(i, a)| {
        (a == "-V" || a == "--version")
            && (i == 0 || !takes_value.iter().any(|t| rest[i - 1] == **t))
    })
}

/// A command line clap refused, told in the words of QEMU's tools (glibc's `getopt` and
/// QEMU's hint), with their exit status 1; help goes out as clap prints it.
fn refuse_as_qemu(name: &str, e: &clap::Error) -> ! {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if name == "qemu-io" && e.kind() == ErrorKind::DisplayHelp {
        out!("{}", cmd::io::USAGE);
        crate::out::exit(0);
    }
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        e.exit();
    }
    let arg = match e.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(s)) => s.clone(),
        _ => String::new(),
    };
    // `-O <FMT>` -> `-O`; `--output <FMT>` -> `--output`; as typed when the option has both
    // names (`-f` for `--format`): the last option word on the line naming it.
    let mut flag = arg.split([' ', '=']).next().unwrap_or_default().to_string();
    if let Some(typed) = std::env::args()
        .rev()
        .find(|a| a == &flag || (a.len() == 2 && a.starts_with('-') && short_of(e, &flag, a)))
    {
        flag = typed;
    }
    let letter = || flag.trim_start_matches('-').chars().next().unwrap_or('?');
    // An operand too many: each qemu-img command's own words (and whether it adds its hint).
    if name != "qemu-io" && e.kind() == ErrorKind::UnknownArgument && !arg.starts_with('-') {
        let sub = std::env::args().nth(1).unwrap_or_default();
        let (why, hint) = match sub.as_str() {
            "info" | "check" | "map" | "commit" | "rebase" | "bench" | "snapshot" => {
                ("Expecting one image file name".to_string(), true)
            }
            "amend" => ("Expecting one image file name".to_string(), false),
            "measure" => (
                "At most one filename argument is allowed.".to_string(),
                false,
            ),
            "create" => (format!("Unexpected argument: {arg}"), true),
            _ => (String::new(), false),
        };
        if !why.is_empty() {
            eprintln!("qemu-img: {why}");
            if hint {
                eprintln!("Try 'qemu-img {sub} --help' for more info");
            }
            crate::out::exit(1);
        }
    }
    let why = match e.kind() {
        ErrorKind::UnknownArgument if flag.starts_with("--") => {
            format!("unrecognized option '{flag}'")
        }
        ErrorKind::UnknownArgument if flag.starts_with('-') => {
            format!("invalid option -- '{}'", letter())
        }
        ErrorKind::InvalidValue | ErrorKind::NoEquals if flag.starts_with("--") => {
            format!("option '{flag}' requires an argument")
        }
        ErrorKind::InvalidValue | ErrorKind::NoEquals if flag.starts_with('-') => {
            format!("option requires an argument -- '{}'", letter())
        }
        _ => {
            let text = e
                .kind()
                .as_str()
                .unwrap_or("invalid command line")
                .to_string();
            if arg.is_empty() {
                text
            } else {
                format!("{text}: {arg}")
            }
        }
    };
    if name == "qemu-io" {
        // qemu-io: getopt's reason on stderr (none for an operand too many), its whole usage
        // on stdout.
        if e.kind() != ErrorKind::UnknownArgument || arg.starts_with('-') {
            eprintln!("qemu-io: {why}");
        }
        out!("{}", crate::cmd::io::USAGE);
    } else {
        let sub = std::env::args().nth(1).unwrap_or_default();
        eprintln!("qemu-img {sub}: {why}");
        eprintln!("Try 'qemu-img {sub} --help' for more info");
    }
    crate::out::exit(1);
}

fn main() -> ExitCode {
    quiet_on_closed_stdout();
    let code = run(parse().cmd);
    out::flush();
    code
}

fn run(cmd: Command) -> ExitCode {
    match cmd {
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
        Command::Serve(a) => exit_status(cmd::serve::run(*a)),
        Command::Snapshot(a) => exit_status(cmd::snapshot::run(a)),
        Command::Dd(a) => exit_status(cmd::dd::run(a)),
        Command::Bitmap(a) => cmd::bitmap::main(a),
        // backup verify has qemu-img compare's exit status (1: different).
        Command::Backup(a) => cmd::backup::main(a),
        // io has qemu-io's exit status and prints its own errors.
        Command::Io(a) => cmd::io::run(a),
    }
}

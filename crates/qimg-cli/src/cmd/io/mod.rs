//! `qimg io [-f FMT] [-r] [-U] [-t CACHE] [-i AIO] [-n] [-c CMD]... [FILE]`: qemu-io's command
//! language on qimg's engine, so that scripts and bug reports written for
//! `qemu-io -c 'write -P 0xab 0 64k' -c 'read -P 0xab 0 64k' img` run unchanged.
//!
//! The commands run in order, from the `-c` options or else from standard input, one per line
//! (each read preceded by the `qemu-io> ` prompt, as qemu-io prints it on any input). Output
//! lines, error messages and the exit status (1 when any command failed) are qemu-io's; the
//! program name in messages stays `qemu-io` so that the output of a script compares equal.
//!
//! Modules: [`parse`] (numbers, pattern bytes, getopt), [`out`] (sizes, times, reports,
//! dumps), [`session`] (the open image and how qemu-io's requests map onto the engine),
//! [`commands`] (the command table and each command).

/// `eprintln!` that ignores a standard error nobody reads any more, as
/// [`outln!`](crate::outln)'s standard output does.
macro_rules! complain {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

mod aio;
mod commands;
mod data;
mod errors;
mod help;
pub use help::USAGE;
mod out;
mod parse;
mod raw;
mod rw;
mod session;
mod table;

use std::io::BufRead;
use std::process::ExitCode;

use qimg::io::Backend;

use self::commands::line;
use self::session::{OpenSpec, Session, aio_mode, cache_mode, default_cache, discard_mode};

/// Arguments of `qimg io`.
#[derive(clap::Args)]
pub struct IoArgs {
    /// Image format: qcow2 or raw (probed when absent).
    #[arg(short = 'f', long = "format")]
    fmt: Option<String>,
    /// Open the image read-only.
    #[arg(short = 'r', long = "read-only")]
    read_only: bool,
    /// Share the image with writers (read-only opens only, as qemu-io).
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// Cache mode: none, writeback, writethrough (the default), directsync, unsafe.
    #[arg(short = 't', long = "cache")]
    cache: Option<String>,
    /// I/O backend: threads (the default), io_uring or native (io_uring).
    #[arg(short = 'i', long = "aio")]
    aio: Option<String>,
    /// No host cache: `-t none`.
    #[arg(short = 'n', long = "nocache")]
    nocache: bool,
    /// Writes go to a temporary overlay; the image itself is only read.
    #[arg(short = 's', long = "snapshot")]
    snapshot: bool,
    /// Copy-on-read: what reads find in the backing chain is written into the image.
    #[arg(short = 'C', long = "copy-on-read")]
    copy_on_read: bool,
    /// Linux native AIO: qimg's io_uring (`-i native`).
    #[arg(short = 'k', long = "native-aio")]
    native_aio: bool,
    /// Misalign allocations for O_DIRECT (accepted; qimg's buffers are its own).
    #[arg(short = 'm', long = "misalign")]
    misalign: bool,
    /// Discard mode: `unmap`/`on` (the default: discards free clusters) or `ignore`/`off`
    /// (discard requests succeed and do nothing).
    #[arg(short = 'd', long = "discard")]
    discard: Option<String>,
    /// Tracing options (accepted and ignored: qimg has no QEMU trace events).
    #[arg(short = 'T', long = "trace")]
    trace: Option<String>,
    /// A command to run (repeatable); without any, commands are read from standard input.
    #[arg(short = 'c', long = "cmd", allow_hyphen_values = true)]
    cmds: Vec<String>,
    /// The image.
    file: Option<String>,
}

/// Runs `qimg io`; the exit status is 1 when the image did not open or any command failed.
pub fn run(args: IoArgs) -> ExitCode {
    let spec = match open_spec(&args) {
        Ok(s) => s,
        Err(line) => {
            complain!("{line}");
            return ExitCode::FAILURE;
        }
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            complain!("qemu-io: cannot start the I/O runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // What QEMU's blkdebug prints when a request stops at a breakpoint, in the output.
    qimg::io::blkdebug::set_reporter(|line| outln!("{line}"));
    // The session's tasks (qemu-io's asynchronous requests) run on this thread.
    let local = tokio::task::LocalSet::new();
    let ok = local.block_on(&rt, async {
        let mut s = Session::new();
        if let Some(file) = &args.file {
            if s.open(file, &spec).await.is_err() {
                return false;
            }
        }
        if args.cmds.is_empty() {
            let stdin = std::io::stdin();
            let mut lines = stdin.lock();
            let mut input = String::new();
            loop {
                out!("qemu-io> ");
                crate::out::flush();
                input.clear();
                match lines.read_line(&mut input) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
                if line(&mut s, &input).await.is_break() {
                    break;
                }
            }
        } else {
            for c in &args.cmds {
                if line(&mut s, c).await.is_break() {
                    break;
                }
            }
        }
        s.finish().await
    });
    crate::out::flush();
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The open options of the command line, or the line qemu-io prints for a bad one.
fn open_spec(args: &IoArgs) -> Result<OpenSpec, String> {
    let mut cache = default_cache();
    if args.nocache {
        cache = cache_mode("none")?;
    }
    if let Some(t) = &args.cache {
        cache = cache_mode(t)?;
    }
    let backend = match &args.aio {
        Some(a) => aio_mode(a)?,
        None if args.native_aio => aio_mode("native")?,
        None => Backend::Threads,
    };
    let discard_ignored = match args.discard.as_deref() {
        Some(d) => discard_mode(d)?,
        None => false,
    };
    let _ = (args.misalign, &args.trace);
    Ok(OpenSpec {
        fmt: args.fmt.clone(),
        read_only: args.read_only,
        force_share: args.force_share,
        cache,
        backend,
        native_aio: args
            .aio
            .as_deref()
            .map_or(args.native_aio, |a| a == "native"),
        snapshot: args.snapshot,
        copy_on_read: args.copy_on_read,
        discard_ignored,
        named_by_options: false,
    })
}

//! The commands of `qimg io`: a line run (dispatch through the table of `table.rs`), and
//! the commands that are neither data requests (`rw.rs`) nor asynchronous (`aio.rs`), with
//! qemu-io's options, output and error lines.

use std::ops::ControlFlow;
use std::time::Instant;

use super::errors::{Failed, Outcome, strerror};
use super::out::size_str;
use super::rw::{read, readv, write, writev};
use super::session::{OpenSpec, Session, aio_mode, cache_mode, default_cache, discard_mode};
use super::table::{
    COMMANDS, Cmd, io_failed, num, offset_and_count, options, print_report, usage, usage_line,
};
use crate::cmd::resize::{Prealloc, grow};

/// Runs one command line; `Break` after `quit`.
pub async fn line(s: &mut Session, line: &str) -> ControlFlow<()> {
    let words: Vec<String> = line.split_whitespace().map(String::from).collect();
    if words.is_empty() {
        return ControlFlow::Continue(());
    }
    let (flow, outcome) = run(s, &words).await;
    s.print_messages().await;
    if outcome.is_err() {
        s.failed = true;
    }
    flow
}

/// Runs one command (`words[0]` its name).
async fn run(s: &mut Session, words: &[String]) -> (ControlFlow<()>, Outcome) {
    let typed = words[0].as_str();
    let Some(c) = COMMANDS
        .iter()
        .find(|c| c.name == typed || c.alt == Some(typed))
    else {
        complain!("command \"{typed}\" not found");
        return (ControlFlow::Continue(()), Err(Failed));
    };
    if c.needs_image && !s.is_open() {
        complain!("no file open, try 'help open'");
        return (ControlFlow::Continue(()), Err(Failed));
    }
    let args = &words[1..];
    let n = args.len();
    if n < c.min || c.max.is_some_and(|m| n > m) {
        let expected = match c.max {
            None => format!("at least {}", c.min),
            Some(m) if m == c.min => format!("{m}"),
            Some(m) => format!("between {} and {m}", c.min),
        };
        complain!("bad argument count {n} to {typed}, expected {expected} arguments");
        return (ControlFlow::Continue(()), Err(Failed));
    }
    if c.writes && s.read_only {
        complain!("qemu-io: Block node is read-only");
        return (ControlFlow::Continue(()), Err(Failed));
    }
    let outcome = match c.name {
        "quit" => return (ControlFlow::Break(()), Ok(())),
        "help" => help(args),
        "open" => open(s, args).await,
        "reopen" => reopen(s, args).await,
        "abort" => std::process::abort(),
        "sigraise" => sigraise(args),
        "break" | "remove_break" | "resume" | "wait_break" => {
            super::aio::breakpoint(s, c.name, args).await
        }
        "close" => s.close().await,
        "read" => read(s, args).await,
        "readv" => readv(s, "readv", args, false).await,
        "aio_read" => super::aio::submit(s, "aio_read", args).await,
        "write" => write(s, args).await,
        "writev" => writev(s, "writev", args, false).await,
        "aio_write" => super::aio::submit(s, "aio_write", args).await,
        "aio_flush" => {
            s.drain().await;
            Ok(())
        }
        "discard" => discard(s, args).await,
        "flush" => flush(s).await,
        "alloc" => alloc(s, args).await,
        "map" => map(s).await,
        "length" => match s.usable() {
            Ok(()) => {
                outln!("{}", size_str(s.size() as f64));
                Ok(())
            }
            Err(e) => {
                outln!("getlength: {}", strerror(e));
                Err(Failed)
            }
        },
        // QEMU's `info` on a node without a driver prints nothing.
        "info" if s.usable().is_err() => Ok(()),
        "info" => info(s),
        "truncate" => truncate(s, args).await,
        "sleep" => sleep(&args[0]).await,
        "zone_append" | "zone_close" | "zone_finish" | "zone_open" | "zone_report"
        | "zone_reset" => zone(c.name, args),
        _ => unreachable!("every command of the table is dispatched"),
    };
    (ControlFlow::Continue(()), outcome)
}

/// `help [command]`.
fn help(args: &[String]) -> Outcome {
    match args.first() {
        None => {
            // In the order of their names, as qemu-io lists them.
            let mut all: Vec<&Cmd> = COMMANDS.iter().collect();
            all.sort_by_key(|c| c.name);
            for c in all {
                outln!("{}", usage_line(c));
            }
            outln!();
            outln!("Use 'help commandname' for extended help.");
            Ok(())
        }
        Some(name) => match COMMANDS
            .iter()
            .find(|c| c.name == name.as_str() || c.alt == Some(name.as_str()))
        {
            Some(c) => {
                outln!("{}", usage_line(c));
                if let Some(text) = super::help::long_help(c.name) {
                    out!("{text}");
                }
                Ok(())
            }
            None => {
                outln!("command {name} not found");
                Err(Failed)
            }
        },
    }
}

/// `discard [-Cq] off len`.
async fn discard(s: &mut Session, args: &[String]) -> Outcome {
    let o = options("discard", args, "Cq")?;
    if o.operands.len() != 2 {
        return usage("discard");
    }
    let (offset, count) = offset_and_count(&o, "", false)?;
    let t0 = Instant::now();
    s.discard(offset, count)
        .await
        .map_err(|e| io_failed("discard", e))?;
    print_report(&o, "discard", t0, offset, count);
    Ok(())
}

/// The zone commands: a qcow2 image is no zoned device, so each fails as qemu-io's does
/// on one, after its arguments parsed.
fn zone(name: &str, args: &[String]) -> Outcome {
    let operands = if name == "zone_append" {
        options(name, args, "p:")?.operands
    } else {
        args.to_vec()
    };
    for a in &operands {
        num(a)?;
    }
    let what = name.strip_prefix("zone_").unwrap_or(name);
    outln!("zone {what} failed: Operation not supported");
    Err(Failed)
}

/// `flush`.
async fn flush(s: &mut Session) -> Outcome {
    s.flush().await.map_err(|e| io_failed("flush", e))
}

/// `alloc offset [count]`: bytes the image itself allocates (512 by default).
async fn alloc(s: &mut Session, args: &[String]) -> Outcome {
    let offset = num(&args[0])?;
    let mut count = match args.get(1) {
        Some(a) => num(a)?,
        None => 512,
    };
    let size = s.size();
    count = count.min(size.saturating_sub(offset));
    let mut sum = 0;
    let mut at = offset;
    let end = offset + count;
    while at < end {
        let (allocated, n) = s.allocation(at, end - at).await.map_err(|e| {
            outln!("is_allocated failed: {}", strerror(e));
            Failed
        })?;
        if n == 0 {
            break;
        }
        if allocated {
            sum += n;
        }
        at += n;
    }
    outln!(
        "{sum}/{count} bytes allocated at offset {}",
        size_str(offset as f64)
    );
    Ok(())
}

/// `map`: the runs of allocated and unallocated bytes of the image itself.
async fn map(s: &mut Session) -> Outcome {
    if let Err(e) = s.usable() {
        complain!("qemu-io: Failed to query image length: {}", strerror(e));
        return Err(Failed);
    }
    let size = s.size();
    let mut at = 0;
    while at < size {
        let (allocated, n) = s.allocation(at, size - at).await.map_err(|e| {
            complain!("qemu-io: Failed to get allocation status: {}", strerror(e));
            Failed
        })?;
        if n == 0 {
            break;
        }
        outln!(
            "{} (0x{n:x}) bytes {} at offset {} (0x{at:x})",
            size_str(n as f64),
            if allocated {
                "    allocated"
            } else {
                "not allocated"
            },
            size_str(at as f64)
        );
        at += n;
    }
    Ok(())
}

/// `info`: format, cluster size, VM state offset and the format-specific settings.
fn info(s: &mut Session) -> Outcome {
    if let Some(r) = &s.raw {
        if matches!(r.storage, qimg::io::AnyStorage::Null(_)) {
            // QEMU's null device has no block-driver info past its name.
            let node = s.opened.as_ref().is_some_and(|(file, spec)| {
                let given = crate::image_spec::format_for(file);
                spec.fmt
                    .as_deref()
                    .or(given.as_deref())
                    .is_some_and(crate::args::is_null_driver)
            });
            // QEMU's qemu-io prints the null node's name twice (its info has no block-driver
            // part, and the format name comes again in its place).
            outln!("format name: {}", if node { "null-co" } else { "raw" });
            if node {
                outln!("format name: null-co");
            }
            return Ok(());
        }
    }
    if s.raw.is_some() {
        // QEMU's file driver as the image prints its name twice (its specific info is
        // empty, and the name comes again in its place).
        let file_node = s.opened.as_ref().is_some_and(|(file, spec)| {
            let given = crate::image_spec::format_for(file);
            spec.fmt.as_deref().or(given.as_deref()) == Some("file")
        });
        if file_node {
            outln!("format name: file");
            outln!("format name: file");
        } else {
            outln!("format name: raw");
        }
        outln!("cluster size: 0 bytes");
        outln!("vm state offset: 0 bytes");
        return Ok(());
    }
    let img = s.image();
    let cs = img.cluster_size();
    let entry = if img.extended_l2() { 16 } else { 8 };
    // The VM state goes after the last guest byte, at the next L1 entry boundary.
    let per_l1 = cs * (cs / entry);
    let vm_state = img.size().div_ceil(per_l1) * per_l1;
    outln!("format name: qcow2");
    outln!("cluster size: {}", size_str(cs as f64));
    outln!("vm state offset: {}", size_str(vm_state as f64));
    match qimg::tools::info::image_info(img.path(), Some(qimg::chain::ImageFormat::Qcow2)) {
        Ok(i) => {
            // The format-specific block of qemu-img's human `info` text.
            let text = crate::human::info(&i);
            if let Some(at) = text.find("Format specific information:\n") {
                let mut lines = text[at..].lines();
                if let Some(first) = lines.next() {
                    outln!("{first}");
                }
                for l in lines.take_while(|l| l.starts_with("    ")) {
                    outln!("{l}");
                }
            }
            Ok(())
        }
        Err(e) => {
            outln!("qimg io: cannot read the image information: {e}");
            Err(Failed)
        }
    }
}

/// `sleep ms`: a number as C's `strtol` with base 0 reads it, not negative.
async fn sleep(arg: &str) -> Outcome {
    let (radix, digits) = match arg.strip_prefix("0x").or_else(|| arg.strip_prefix("0X")) {
        Some(h) => (16, h),
        None if arg.len() > 1 && arg.starts_with('0') => (8, &arg[1..]),
        None => (10, arg.strip_prefix('+').unwrap_or(arg)),
    };
    match u64::from_str_radix(digits, radix) {
        Ok(ms) if !digits.starts_with('+') => {
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
            Ok(())
        }
        _ => {
            outln!("{arg} is not a valid number");
            Err(Failed)
        }
    }
}

/// `truncate [-m off] size`: grows or shrinks the disk (as qemu-io, which shrinks without
/// asking).
async fn truncate(s: &mut Session, args: &[String]) -> Outcome {
    let o = options("truncate", args, "m:")?;
    if o.operands.len() != 1 {
        return usage("truncate");
    }
    let prealloc = match o.arg('m') {
        None => Prealloc::Off,
        Some(m) => match Prealloc::parse(m) {
            Some(p) => p,
            None => {
                complain!("qemu-io: Invalid preallocation mode '{m}'");
                return Err(Failed);
            }
        },
    };
    let size = num(&o.operands[0])?;
    if s.usable().is_err() {
        complain!("qemu-io: No medium inserted");
        return Err(Failed);
    }
    match s.truncate_raw(size, prealloc).await {
        Ok(true) => return Ok(()),
        Ok(false) => {}
        Err(e) => {
            complain!("qemu-io: {e}");
            return Err(Failed);
        }
    }
    let img = s.image();
    if size % 512 != 0 {
        complain!("qemu-io: The new size must be a multiple of 512");
        return Err(Failed);
    }
    let old = img.size();
    if size < old && prealloc != Prealloc::Off {
        // qcow2's words (`qcow2_co_truncate`): nothing changes.
        complain!("qemu-io: Preallocation can't be used for shrinking an image");
        return Err(Failed);
    }
    if size != old {
        let changed = if size < old {
            img.shrink(size).await
        } else {
            grow(img, size, prealloc).await
        };
        if let Err(e) = changed {
            let name = img.path().display().to_string();
            complain!("qemu-io: {}", crate::status::lib_msg(&e, &name));
            return Err(Failed);
        }
    }
    Ok(())
}

/// `open [-rnU] [-t cache] [-i aio] path`.
async fn open(s: &mut Session, args: &[String]) -> Outcome {
    let o = options("open", args, "rsCnkUt:d:o:i:")?;
    if o.operands.len() > 1 {
        return usage("open");
    }
    // `-o` runtime options: the driver and file name they may name, the rest as
    // `--image-opts` takes them.
    let pairs: Vec<(String, String)> = o
        .opts
        .iter()
        .filter(|(c, _)| *c == 'o')
        .filter_map(|(_, a)| a.as_deref())
        .flat_map(crate::args::split_opts)
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => (p, String::new()),
        })
        .collect();
    let operand = o.operands.first().map(std::path::Path::new);
    let (named, driver, read_only) = match crate::image_spec::open_options(&pairs, operand) {
        Ok(r) => r,
        Err(e) => {
            // qemu-io names the device only when the command gave a file name.
            match o.operands.first() {
                Some(device) => complain!("qemu-io: can't open device {device}: {e}"),
                None => complain!("qemu-io: can't open: {e}"),
            }
            return Err(Failed);
        }
    };
    let mut cache = default_cache();
    let mut backend = qimg::io::Backend::Threads;
    let mut native_aio = false;
    let mut discard_ignored = false;
    for (opt, arg) in &o.opts {
        let r = match (opt, arg.as_deref()) {
            ('d', Some(d)) => discard_mode(d).map(|i| discard_ignored = i),
            ('n', _) => cache_mode("none").map(|c| cache = c),
            ('t', Some(t)) => cache_mode(t).map(|c| cache = c),
            ('i', Some(a)) => aio_mode(a).map(|b| {
                backend = b;
                native_aio = a == "native";
            }),
            ('k', _) => aio_mode("native").map(|b| {
                backend = b;
                native_aio = true;
            }),
            _ => Ok(()),
        };
        if let Err(line) = r {
            complain!("{line}");
            return Err(Failed);
        }
    }
    if s.is_open() {
        complain!("qemu-io: file open already, try 'help close'");
        return Err(Failed);
    }
    if read_only == Some(true) && !o.has('r') {
        // qemu-io asks for a writable device; the node the options made cannot be one.
        let device = o
            .operands
            .first()
            .or(named.as_ref())
            .cloned()
            .unwrap_or_default();
        complain!("qemu-io: can't open device {device}: Block node is read-only");
        return Err(Failed);
    }
    let Some(file) = o.operands.first().or(named.as_ref()) else {
        complain!("qemu-io: qimg io: open needs a file name");
        return Err(Failed);
    };
    let spec = OpenSpec {
        fmt: driver,
        // `-o read-only=` overrides `-r`.
        read_only: read_only.unwrap_or(o.has('r')),
        force_share: o.has('U'),
        cache,
        backend,
        native_aio,
        snapshot: o.has('s'),
        copy_on_read: o.has('C'),
        discard_ignored,
        named_by_options: o.operands.is_empty(),
    };
    s.open(file, &spec).await
}

/// `reopen [-r|-w] [-c cache] [-o options]`: the open image again, read-only or writable, with
/// another cache mode (closed first: everything written stays).
async fn reopen(s: &mut Session, args: &[String]) -> Outcome {
    let o = options("reopen", args, "c:o:rw")?;
    if !o.operands.is_empty() {
        return usage("reopen");
    }
    if o.has('r') && o.has('w') {
        complain!("qemu-io: Only one -r/-w option may be given");
        return Err(Failed);
    }
    let Some((file, mut spec)) = s.opened.clone() else {
        complain!("no file open, try 'help open'");
        return Err(Failed);
    };
    if let Some(c) = o.arg('c') {
        match cache_mode(c) {
            Ok(c) => spec.cache = c,
            Err(line) => {
                complain!("{line}");
                return Err(Failed);
            }
        }
    }
    let pairs: Vec<String> = o
        .opts
        .iter()
        .filter(|(c, _)| *c == 'o')
        .filter_map(|(_, a)| a.clone())
        .flat_map(|a| crate::args::split_opts(&a))
        .collect();
    // The runtime options' values checked as at open (QEMU's `qcow2_update_options` runs
    // on reopen too), in its words.
    let kv: Vec<(String, String)> = pairs
        .iter()
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => (p.clone(), String::new()),
        })
        .collect();
    if let Err(e) = crate::runtime_opts::check(&kv, Some(std::path::Path::new(&file))) {
        complain!("qemu-io: {e}");
        return Err(Failed);
    }
    for p in &pairs {
        match p.split_once('=') {
            Some(("read-only", v)) => spec.read_only = v == "on",
            _ if crate::image_spec::ignored(p.split('=').next().unwrap_or_default()) => {}
            _ => {
                let key = p.split('=').next().unwrap_or_default();
                complain!("qemu-io: Cannot change the option '{key}'");
                return Err(Failed);
            }
        }
    }
    if o.has('r') {
        spec.read_only = true;
    }
    if o.has('w') {
        spec.read_only = false;
    }
    s.close_keeping_breakpoints().await?;
    s.open(&file, &spec).await
}

/// `sigraise SIGNAL`: the process raises the signal; one whose default action ends the
/// process ends it there, leaving the image as a crash would (what was written in
/// write-through mode is on disk, the image is not closed).
fn sigraise(args: &[String]) -> Outcome {
    let Ok(n) = args[0].parse::<i32>() else {
        complain!("Invalid signal '{}'", args[0]);
        return Err(Failed);
    };
    let Ok(signal) = nix::sys::signal::Signal::try_from(n) else {
        complain!("Invalid signal '{}'", args[0]);
        return Err(Failed);
    };
    crate::out::flush();
    if let Err(e) = nix::sys::signal::raise(signal) {
        complain!("sigraise: {e}");
        return Err(Failed);
    }
    Ok(())
}

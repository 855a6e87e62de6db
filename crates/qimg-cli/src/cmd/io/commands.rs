//! The commands of `qimg io`: the table (names, short names, argument counts, whether a
//! command needs an image or writes it) and each command, with qemu-io's options, output and
//! error lines.

use std::ops::ControlFlow;
use std::time::Instant;

use super::out::{hex_dump, report, size_str};
use super::parse::{MAX_REQUEST, NumError, Opts, getopt, num_error_line, parse_num, parse_pattern};
use super::session::{
    Failed, OpenSpec, Outcome, Session, aio_mode, cache_mode, default_cache, discard_mode, strerror,
};

/// What dispatch checks before running a command.
struct Cmd {
    /// Name.
    name: &'static str,
    /// Short name.
    alt: Option<&'static str>,
    /// Fewest arguments (options included).
    min: usize,
    /// Most arguments, if limited.
    max: Option<usize>,
    /// Needs an open image.
    needs_image: bool,
    /// Writes the image (refused when it is read-only).
    writes: bool,
    /// Synopsis of the arguments.
    args: &'static str,
    /// One line on what it does.
    about: &'static str,
}

const fn cmd(
    name: &'static str,
    alt: Option<&'static str>,
    (min, max): (usize, Option<usize>),
    (needs_image, writes): (bool, bool),
    args: &'static str,
    about: &'static str,
) -> Cmd {
    Cmd {
        name,
        alt,
        min,
        max,
        needs_image,
        writes,
        args,
        about,
    }
}

/// Argument counts.
const AT_LEAST_2: (usize, Option<usize>) = (2, None);
const NONE: (usize, Option<usize>) = (0, Some(0));
/// Needs an image / writes it.
const READS: (bool, bool) = (true, false);
const WRITES: (bool, bool) = (true, true);
const FREE: (bool, bool) = (false, false);

/// Every command, in the order `help` lists them.
const COMMANDS: &[Cmd] = &[
    cmd(
        "abort",
        None,
        NONE,
        FREE,
        "",
        "simulate a program crash using abort(3)",
    ),
    cmd(
        "aio_flush",
        None,
        NONE,
        READS,
        "",
        "completes all outstanding aio requests",
    ),
    cmd(
        "aio_read",
        None,
        AT_LEAST_2,
        READS,
        "[-Ciqrv] [-P pattern] off len [len..]",
        "asynchronously reads a number of bytes",
    ),
    cmd(
        "aio_write",
        None,
        AT_LEAST_2,
        WRITES,
        "[-Cfiqruz] [-P pattern] off len [len..]",
        "asynchronously writes a number of bytes",
    ),
    cmd(
        "alloc",
        None,
        (1, Some(2)),
        READS,
        "offset [count]",
        "checks if offset is allocated in the file",
    ),
    cmd(
        "close",
        Some("c"),
        NONE,
        READS,
        "",
        "close the current open file",
    ),
    cmd(
        "discard",
        None,
        AT_LEAST_2,
        WRITES,
        "[-Cq] off len",
        "discards a number of bytes at a specified offset",
    ),
    cmd(
        "flush",
        Some("f"),
        NONE,
        READS,
        "",
        "flush all in-core file state to disk",
    ),
    cmd(
        "help",
        Some("?"),
        (0, Some(1)),
        FREE,
        "[command]",
        "help for one or all commands",
    ),
    cmd(
        "info",
        Some("i"),
        NONE,
        READS,
        "",
        "prints information about the current file",
    ),
    cmd(
        "length",
        None,
        NONE,
        READS,
        "",
        "gets the length of the current file",
    ),
    cmd(
        "map",
        None,
        NONE,
        READS,
        " ",
        "prints the allocated areas of a file",
    ),
    cmd(
        "open",
        Some("o"),
        (1, None),
        FREE,
        "[-rsCnkU] [-t cache] [-d discard] [-o options] [path]",
        "open the file specified by path",
    ),
    cmd("quit", Some("q"), (0, None), FREE, "", "exit the program"),
    cmd(
        "read",
        Some("r"),
        AT_LEAST_2,
        READS,
        "[-abCqrv] [-P pattern [-s off] [-l len]] off len",
        "reads a number of bytes at a specified offset",
    ),
    cmd(
        "readv",
        None,
        AT_LEAST_2,
        READS,
        "[-Cqrv] [-P pattern] off len [len..]",
        "reads a number of bytes at a specified offset",
    ),
    cmd(
        "break",
        None,
        (2, Some(2)),
        READS,
        "event tag",
        "sets a breakpoint on event and tags the stopped request as tag",
    ),
    cmd(
        "remove_break",
        None,
        (1, Some(1)),
        READS,
        "tag",
        "remove a breakpoint by tag",
    ),
    cmd(
        "resume",
        None,
        (1, Some(1)),
        READS,
        "tag",
        "resumes the request tagged as tag",
    ),
    cmd(
        "wait_break",
        None,
        (1, Some(1)),
        READS,
        "tag",
        "waits for the suspension of a request",
    ),
    cmd(
        "reopen",
        None,
        (0, None),
        READS,
        "[(-r|-w)] [-c cache] [-o options]",
        "reopens an image with new options",
    ),
    cmd(
        "sigraise",
        None,
        (1, Some(1)),
        FREE,
        "signal",
        "raises a signal",
    ),
    cmd(
        "sleep",
        None,
        (1, Some(1)),
        FREE,
        "",
        "waits for the given value in milliseconds",
    ),
    cmd(
        "truncate",
        Some("t"),
        (1, Some(3)),
        WRITES,
        "[-m prealloc_mode] off",
        "truncates the current file at the given offset",
    ),
    cmd(
        "write",
        Some("w"),
        AT_LEAST_2,
        WRITES,
        "[-bcCfnqruz] [-P pattern | -s source_file] off len",
        "writes a number of bytes at a specified offset",
    ),
    cmd(
        "writev",
        None,
        AT_LEAST_2,
        WRITES,
        "[-Cfqr] [-P pattern] off len [len..]",
        "writes a number of bytes at a specified offset",
    ),
    cmd(
        "zone_append",
        Some("zap"),
        (3, Some(4)),
        READS,
        "offset len [len..]",
        "append write a number of bytes at a specified offset",
    ),
    cmd(
        "zone_close",
        Some("zc"),
        (2, Some(2)),
        READS,
        "offset len",
        "close a range of zones in zone block device",
    ),
    cmd(
        "zone_finish",
        Some("zf"),
        (2, Some(2)),
        READS,
        "offset len",
        "finish a range of zones in zone block device",
    ),
    cmd(
        "zone_open",
        Some("zo"),
        (2, Some(2)),
        READS,
        "offset len",
        "explicit open a range of zones in zone block device",
    ),
    cmd(
        "zone_report",
        Some("zrp"),
        (2, Some(2)),
        READS,
        "offset number",
        "report zone information",
    ),
    cmd(
        "zone_reset",
        Some("zrs"),
        (2, Some(2)),
        READS,
        "offset len",
        "reset a zone write pointer in zone block device",
    ),
];

/// The usage line of a command.
fn usage_line(c: &Cmd) -> String {
    // QEMU prints "NAME -- ABOUT" for a command without an argument string and
    // "NAME ARGS -- ABOUT" otherwise; `map`'s is empty (`" "` here), hence its two spaces.
    if c.args.is_empty() {
        format!("{} -- {}", c.name, c.about)
    } else {
        format!("{} {} -- {}", c.name, c.args.trim(), c.about)
    }
}

/// Prints the usage line of `name` and fails.
fn usage(name: &str) -> Outcome {
    if let Some(c) = COMMANDS.iter().find(|c| c.name == name) {
        outln!("{}", usage_line(c));
    }
    Err(Failed)
}

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
        "length" => {
            outln!("{}", size_str(s.size() as f64));
            Ok(())
        }
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

/// Parses the options of `name`; a bad option prints getopt's line and the usage.
fn options(name: &str, args: &[String], spec: &str) -> Result<Opts, Failed> {
    getopt(name, args, spec).map_err(|e| {
        complain!("{}", e.0);
        let _ = usage(name);
        Failed
    })
}

/// A number operand; a bad one prints qemu-io's parsing error.
fn num(arg: &str) -> Result<u64, Failed> {
    parse_num(arg).map_err(|e: NumError| {
        outln!("{}", num_error_line(e, arg));
        Failed
    })
}

/// The `-P` byte of the options, if given; a bad one prints qemu-io's line.
fn pattern(o: &Opts) -> Result<Option<u8>, Failed> {
    match o.arg('P') {
        None => Ok(None),
        Some(p) => match parse_pattern(p) {
            Some(b) => Ok(Some(b)),
            None => {
                outln!("{p} is not a valid pattern byte");
                Err(Failed)
            }
        },
    }
}

/// Prints the report of a request unless `-q`.
fn print_report(o: &Opts, op: &str, t0: Instant, offset: u64, count: u64) {
    let t = t0.elapsed();
    if !o.has('q') {
        out!("{}", report(op, t, offset, count, count, o.has('C')));
    }
}

/// The request's error line, `OP failed: strerror`.
fn io_failed(op: &str, errno: i32) -> Failed {
    outln!("{op} failed: {}", strerror(errno));
    Failed
}

/// `read [-Cqv] [-P pattern [-s off] [-l len]] off len`.
async fn read(s: &mut Session, args: &[String]) -> Outcome {
    let o = options("read", args, "bCl:pP:qrs:v")?;
    let pat = pattern(&o)?;
    let s_off = o.arg('s').map(num).transpose()?;
    let l_len = o.arg('l').map(num).transpose()?;
    if o.operands.len() != 2 {
        return usage("read");
    }
    if pat.is_none() && (s_off.is_some() || l_len.is_some()) {
        return usage("read");
    }
    let offset = num(&o.operands[0])?;
    let count = num(&o.operands[1])?;
    if count > MAX_REQUEST {
        outln!(
            "length cannot exceed {MAX_REQUEST}, given {}",
            o.operands[1]
        );
        return Err(Failed);
    }
    let p_off = s_off.unwrap_or(0);
    let p_len = l_len.unwrap_or(count.saturating_sub(p_off));
    if p_off.saturating_add(p_len) > count {
        outln!("pattern verification range exceeds end of read data");
        return Err(Failed);
    }
    let vm_state = o.has('b');
    if vm_state {
        sector_aligned(offset, count)?;
    } else {
        s.check_request(offset, count)
            .map_err(|e| io_failed("read", e))?;
    }
    let mut buf = vec![0u8; count as usize];
    let t0 = Instant::now();
    if vm_state {
        s.read_vmstate(&mut buf, offset).await
    } else {
        s.read(&mut buf, offset).await
    }
    .map_err(|e| io_failed("read", e))?;
    let mut outcome = Ok(());
    if let Some(p) = pat {
        let range = &buf[p_off as usize..(p_off + p_len) as usize];
        if range.iter().any(|&b| b != p) {
            outln!(
                "Pattern verification failed at offset {}, {p_len} bytes",
                offset + p_off
            );
            outcome = Err(Failed);
        }
    }
    if o.has('q') {
        return outcome;
    }
    if o.has('v') {
        out!("{}", hex_dump(&buf, offset));
    }
    print_report(&o, "read", t0, offset, count);
    outcome
}

/// The offset and lengths of `readv`/`writev`/`aio_*` operands.
fn vector_operands(o: &Opts) -> Result<(u64, Vec<u64>), Failed> {
    let offset = num(&o.operands[0])?;
    let mut lens = Vec::new();
    for a in &o.operands[1..] {
        let n = num(a)?;
        if n > MAX_REQUEST {
            outln!("Argument '{a}' exceeds maximum size {MAX_REQUEST}");
            return Err(Failed);
        }
        lens.push(n);
    }
    let total: u64 = lens.iter().sum();
    if total > MAX_REQUEST {
        outln!("The total number of bytes exceeds the maximum size {MAX_REQUEST}");
        return Err(Failed);
    }
    Ok((offset, lens))
}

/// `-i` of `aio_read`/`aio_write`: qemu-io counts an invalid request and stops there.
fn invalid_request(o: &Opts, what: &str) -> bool {
    if o.has('i') {
        outln!("injecting invalid {what} request");
    }
    o.has('i')
}

/// `readv` and `aio_read` (`aio`: failures are reported but do not fail the command).
pub(super) async fn readv(s: &mut Session, name: &str, args: &[String], aio: bool) -> Outcome {
    let spec = if aio { "CiP:qrv" } else { "CP:qrv" };
    let o = options(name, args, spec)?;
    if invalid_request(&o, "read") {
        return Ok(());
    }
    let pat = pattern(&o)?;
    if o.operands.len() < 2 {
        return usage(name);
    }
    let (offset, lens) = vector_operands(&o)?;
    let total: u64 = lens.iter().sum();
    // The aio path answers with the message of qemu-io's vectored read.
    let failed = |e| {
        let f = io_failed("readv", e);
        if aio { Ok(()) } else { Err(f) }
    };
    if let Err(e) = s.check_request(offset, total) {
        return failed(e);
    }
    let mut bufs: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0u8; n as usize]).collect();
    let t0 = Instant::now();
    if let Err(e) = s.read_vectored(&mut bufs, offset).await {
        return failed(e);
    }
    let data = bufs.concat();
    let mut outcome = Ok(());
    if let Some(p) = pat {
        if data.iter().any(|&b| b != p) {
            outln!("Pattern verification failed at offset {offset}, {total} bytes");
            if !aio {
                outcome = Err(Failed);
            }
        }
    }
    if o.has('q') {
        return outcome;
    }
    if o.has('v') {
        out!("{}", hex_dump(&data, offset));
    }
    print_report(&o, "read", t0, offset, total);
    outcome
}

/// `write [-cCfnquz] [-P pattern] off len`.
async fn write(s: &mut Session, args: &[String]) -> Outcome {
    let o = options("write", args, "bcCfnpP:qrs:uz")?;
    let pat = pattern(&o)?;
    if o.operands.len() != 2 {
        return usage("write");
    }
    let z = o.has('z');
    if o.has('b') && z {
        outln!("-b and -z cannot be specified at the same time");
        return Err(Failed);
    }
    if o.has('f') && o.has('b') {
        outln!("-f and -b cannot be specified at the same time");
        return Err(Failed);
    }
    if o.has('u') && !z {
        outln!("-u requires -z to be specified");
        return Err(Failed);
    }
    if o.has('n') && !z {
        outln!("-n requires -z to be specified");
        return Err(Failed);
    }
    if usize::from(z) + usize::from(pat.is_some()) + usize::from(o.has('s')) > 1 {
        outln!("Only one of -z, -P, and -s can be specified at the same time");
        return Err(Failed);
    }
    let offset = num(&o.operands[0])?;
    let count = num(&o.operands[1])?;
    if count > MAX_REQUEST && !(z && o.has('n')) {
        outln!(
            "length cannot exceed {MAX_REQUEST} without -n, given {}",
            o.operands[1]
        );
        return Err(Failed);
    }
    let fua = o.has('f');
    let vm_state = o.has('b');
    if vm_state {
        sector_aligned(offset, count)?;
    } else {
        s.check_request(offset, count)
            .map_err(|e| io_failed("write", e))?;
    }
    let t0 = Instant::now();
    // -b and -z never come together (refused above).
    let r = if z {
        s.write_zeroes(offset, count, o.has('u'), fua).await
    } else {
        let buf = match o.arg('s') {
            Some(file) => pattern_file(file, count)?,
            None => vec![pat.unwrap_or(0xcd); count as usize],
        };
        if vm_state {
            s.write_vmstate(&buf, offset).await
        } else if o.has('c') {
            s.write_compressed(&buf, offset, fua).await
        } else {
            s.write(&buf, offset, fua).await
        }
    };
    r.map_err(|e| io_failed("write", e))?;
    print_report(&o, "wrote", t0, offset, count);
    Ok(())
}

/// The VM-state area is read and written in 512-byte sectors, as qemu-io's `-b` requires.
fn sector_aligned(offset: u64, count: u64) -> Result<(), Failed> {
    for (value, name) in [(offset, "offset"), (count, "count")] {
        if value % 512 != 0 {
            outln!("{value} is not a sector-aligned value for '{name}'");
            return Err(Failed);
        }
    }
    Ok(())
}

/// `write -s FILE`: `count` bytes of the file's first `count` bytes, repeated.
fn pattern_file(file: &str, count: u64) -> Result<Vec<u8>, Failed> {
    use std::io::Read;
    let mut head = Vec::new();
    let read = std::fs::File::open(file).and_then(|f| f.take(count).read_to_end(&mut head));
    if let Err(e) = read {
        complain!("{file}: {}", crate::status::os_msg(&e));
        return Err(Failed);
    }
    if head.is_empty() {
        complain!("{file}: file is empty");
        return Err(Failed);
    }
    Ok(head.iter().copied().cycle().take(count as usize).collect())
}

/// `writev` and `aio_write` (`aio`: failures are reported but do not fail the command).
pub(super) async fn writev(s: &mut Session, name: &str, args: &[String], aio: bool) -> Outcome {
    let spec = if aio { "CfiP:qruz" } else { "CfP:qr" };
    let o = options(name, args, spec)?;
    if invalid_request(&o, "write") {
        return Ok(());
    }
    let pat = pattern(&o)?;
    if o.operands.len() < 2 {
        return usage(name);
    }
    let z = o.has('z');
    if o.has('u') && !z {
        outln!("-u requires -z to be specified");
        return Err(Failed);
    }
    if z && o.operands.len() != 2 {
        outln!("-z supports only a single length parameter");
        return Err(Failed);
    }
    let (offset, lens) = vector_operands(&o)?;
    let total: u64 = lens.iter().sum();
    let fua = o.has('f');
    if let Err(e) = s.check_request(offset, total) {
        let f = io_failed(name, e);
        return if aio { Ok(()) } else { Err(f) };
    }
    let t0 = Instant::now();
    let r = if z {
        s.write_zeroes(offset, total, o.has('u'), fua).await
    } else {
        let bufs: Vec<Vec<u8>> = lens
            .iter()
            .map(|&n| vec![pat.unwrap_or(0xcd); n as usize])
            .collect();
        s.write_vectored(&bufs, offset, fua).await
    };
    if let Err(e) = r {
        let f = io_failed(name, e);
        return if aio { Ok(()) } else { Err(f) };
    }
    print_report(&o, "wrote", t0, offset, total);
    Ok(())
}

/// `discard [-Cq] off len`.
async fn discard(s: &mut Session, args: &[String]) -> Outcome {
    let o = options("discard", args, "Cq")?;
    if o.operands.len() != 2 {
        return usage("discard");
    }
    let offset = num(&o.operands[0])?;
    let count = num(&o.operands[1])?;
    if count > MAX_REQUEST {
        outln!(
            "length cannot exceed {MAX_REQUEST}, given {}",
            o.operands[1]
        );
        return Err(Failed);
    }
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
    let size = s.size();
    let mut at = 0;
    while at < size {
        let (allocated, n) = s.allocation(at, size - at).await.map_err(|e| {
            outln!("map_is_allocated failed: {}", strerror(e));
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
    if s.raw.is_some() {
        outln!("format name: raw");
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
    if let Some(m) = o.arg('m') {
        if m != "off" {
            complain!("qemu-io: qimg io: preallocation mode '{m}' is not supported");
            return Err(Failed);
        }
    }
    let size = num(&o.operands[0])?;
    match s.truncate_raw(size).await {
        Ok(true) => return Ok(()),
        Ok(false) => {}
        Err(e) => {
            complain!("qemu-io: {}", strerror(e));
            return Err(Failed);
        }
    }
    let img = s.image();
    if size % 512 != 0 {
        complain!("qemu-io: The new size must be a multiple of 512");
        return Err(Failed);
    }
    let old = img.size();
    if size != old {
        let changed = if size < old {
            img.shrink(size).await
        } else {
            img.resize(size).await
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
    let (named, driver, read_only) = match crate::image_spec::open_options(&pairs) {
        Ok(r) => r,
        Err(e) => {
            let device = o.operands.first().map(String::as_str).unwrap_or("");
            complain!("qemu-io: can't open device {device}: {e}");
            return Err(Failed);
        }
    };
    let mut cache = default_cache();
    let mut backend = qimg::io::Backend::Threads;
    let mut discard_ignored = false;
    for (opt, arg) in &o.opts {
        let r = match (opt, arg.as_deref()) {
            ('d', Some(d)) => discard_mode(d).map(|i| discard_ignored = i),
            ('n', _) => cache_mode("none").map(|c| cache = c),
            ('t', Some(t)) => cache_mode(t).map(|c| cache = c),
            ('i', Some(a)) => aio_mode(a).map(|b| backend = b),
            ('k', _) => aio_mode("native").map(|b| backend = b),
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
    let Some(file) = o.operands.first().or(named.as_ref()) else {
        complain!("qemu-io: qimg io: open needs a file name");
        return Err(Failed);
    };
    let spec = OpenSpec {
        fmt: driver,
        read_only: o.has('r') || read_only,
        force_share: o.has('U'),
        cache,
        backend,
        snapshot: o.has('s'),
        copy_on_read: o.has('C'),
        discard_ignored,
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

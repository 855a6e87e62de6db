//! The table of qemu-io's commands (names, short names, argument counts, whether a command
//! needs an image or writes it) and what every command shares: option parsing, the usage
//! line, the report of a request.

use std::time::Instant;

use super::errors::{Failed, Outcome, strerror};
use super::out::report;
use super::parse::{MAX_REQUEST, NumError, Opts, getopt, num_error_line, parse_num, parse_pattern};

/// What dispatch checks before running a command.
pub(super) struct Cmd {
    /// Name.
    pub(super) name: &'static str,
    /// Short name.
    pub(super) alt: Option<&'static str>,
    /// Fewest arguments (options included).
    pub(super) min: usize,
    /// Most arguments, if limited.
    pub(super) max: Option<usize>,
    /// Needs an open image.
    pub(super) needs_image: bool,
    /// Writes the image (refused when it is read-only).
    pub(super) writes: bool,
    /// Synopsis of the arguments.
    pub(super) args: &'static str,
    /// One line on what it does.
    pub(super) about: &'static str,
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
pub(super) const COMMANDS: &[Cmd] = &[
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
pub(super) fn usage_line(c: &Cmd) -> String {
    // QEMU prints "NAME -- ABOUT" for a command without an argument string and
    // "NAME ARGS -- ABOUT" otherwise; `map`'s is empty (`" "` here), hence its two spaces.
    if c.args.is_empty() {
        format!("{} -- {}", c.name, c.about)
    } else {
        format!("{} {} -- {}", c.name, c.args.trim(), c.about)
    }
}

/// Prints the usage line of `name` and fails.
pub(super) fn usage(name: &str) -> Outcome {
    if let Some(c) = COMMANDS.iter().find(|c| c.name == name) {
        outln!("{}", usage_line(c));
    }
    Err(Failed)
}

/// Parses the options of `name`; a bad option prints getopt's line and the usage.
pub(super) fn options(name: &str, args: &[String], spec: &str) -> Result<Opts, Failed> {
    getopt(name, args, spec).map_err(|e| {
        complain!("{}", e.0);
        let _ = usage(name);
        Failed
    })
}

/// A number operand; a bad one prints qemu-io's parsing error.
pub(super) fn num(arg: &str) -> Result<u64, Failed> {
    parse_num(arg).map_err(|e: NumError| {
        outln!("{}", num_error_line(e, arg));
        Failed
    })
}

/// The `OFFSET LENGTH` operands of a request command; a length over [`MAX_REQUEST`] is
/// refused with qemu-io's line (`write`'s says `without -n`) unless `unbounded` (`write -z
/// -n`, which moves no data).
pub(super) fn offset_and_count(
    o: &Opts,
    without: &str,
    unbounded: bool,
) -> Result<(u64, u64), Failed> {
    let offset = num(&o.operands[0])?;
    let count = num(&o.operands[1])?;
    if count > MAX_REQUEST && !unbounded {
        outln!(
            "length cannot exceed {MAX_REQUEST}{without}, given {}",
            o.operands[1]
        );
        return Err(Failed);
    }
    Ok((offset, count))
}

/// The `-P` byte of the options, if given; a bad one prints qemu-io's line.
pub(super) fn pattern(o: &Opts) -> Result<Option<u8>, Failed> {
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
pub(super) fn print_report(o: &Opts, op: &str, t0: Instant, offset: u64, count: u64) {
    let t = t0.elapsed();
    if !o.has('q') {
        out!("{}", report(op, t, offset, count, count, o.has('C')));
    }
}

/// The request's error line, `OP failed: strerror`.
pub(super) fn io_failed(op: &str, errno: i32) -> Failed {
    outln!("{op} failed: {}", strerror(errno));
    Failed
}

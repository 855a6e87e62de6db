//! Exit statuses and error messages, worded as qemu-img words them.
//!
//! Every command prints its failure as `qimg: MESSAGE` on stderr; most exit with 1, `check`
//! with the codes of qemu-img check. OS and library errors are reworded to read like QEMU's
//! (C's `strerror` text, no repeated file name).

use std::fmt::Display;
use std::process::ExitCode;

use anyhow::{Result, anyhow};

static PROGRAM: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();

/// Sets the name messages start with: `qimg`, or `qemu-img` when the binary runs as
/// qemu-img (see `main`). Only the first call counts.
pub fn set_program(name: &'static str) {
    let _ = PROGRAM.set(name);
}

/// The name messages start with (`qimg` unless [`set_program`] said otherwise).
pub fn program() -> &'static str {
    PROGRAM.get().copied().unwrap_or("qimg")
}

/// The option strings and `json:` names the user typed, by the file name they stand for.
static TYPED: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());

/// Records that the user named file `name` as `typed` (an option string or a `json:` name),
/// which QEMU's messages repeat.
pub fn remember_typed(name: &str, typed: &str) {
    let mut all = TYPED.lock().unwrap_or_else(|e| e.into_inner());
    all.push((name.to_string(), typed.to_string()));
}

/// What the user typed for file `name`, if it was an option string or a `json:` name.
pub fn typed_name(name: &str) -> Option<String> {
    let all = TYPED.lock().unwrap_or_else(|e| e.into_inner());
    all.iter()
        .rev()
        .find(|(n, _)| n == name)
        .map(|(_, t)| t.clone())
}

/// Prints `PROGRAM: MESSAGE` on stderr and returns exit status `code`.
pub fn fail(msg: impl Display, code: u8) -> ExitCode {
    let mut msg = msg.to_string();
    if program() != "qimg" {
        // The hint names the command as the user typed it.
        msg = msg.replace("Try 'qimg ", &format!("Try '{} ", program()));
    }
    eprintln!("{}: {msg}", program());
    ExitCode::from(code)
}

/// The exit status of a command that succeeds (0) or fails (1, with its error and causes
/// printed on one line).
pub fn exit_status(result: Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(one_line(&e), 1),
    }
}

/// An error and its causes on one line, each cause once: a library error's text often
/// already ends with its source's (a failed open names the OS error itself).
fn one_line(e: &anyhow::Error) -> String {
    let mut s = e.to_string();
    for cause in e.chain().skip(1) {
        let text = cause.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
    }
    s
}

/// Removes Rust's " (os error N)" suffix from an error text, leaving C's `strerror` words.
fn strip_os_error(text: &str) -> &str {
    match text.find(" (os error") {
        Some(i) => &text[..i],
        None => text,
    }
}

/// An OS error as C's `strerror` words it ("No such file or directory", without Rust's
/// " (os error 2)").
pub fn os_msg(e: &std::io::Error) -> String {
    strip_os_error(&e.to_string()).to_string()
}

/// What qemu-img says of a request the driver failed for damage (the errno's text: its own
/// `qcow2: ...` line is already on standard error); `None` for other errors, or run as qimg.
pub fn damage_errno_text(e: &qimg::Error) -> Option<String> {
    (matches!(e, qimg::Error::Corrupt { .. }) && program() == "qemu-img")
        .then(|| os_msg(&std::io::Error::from_raw_os_error(e.errno())))
}

/// QEMU's words for a qcow2 header it refuses at open (as qemu-img or qemu-io;
/// `qcow2_do_open`), where qimg names the field, the offset and the value: incompatible
/// features it does not know (`report_unsupported_feature`: the names the image's feature
/// table gives them, then the rest as one hexadecimal mask), the version, the cluster size,
/// the header length, the refcount width, the compression type, the backing file offset, the
/// number of snapshots, and the L1 and refcount tables' offsets and sizes.
/// `None`: not such an error, or speaking as qimg.
pub fn qemu_header_words(e: &qimg::Error) -> Option<String> {
    use qimg::format::FormatError as F;
    let qimg::Error::Format { source, .. } = e else {
        return None;
    };
    if program() == "qimg" {
        return None;
    }
    Some(match source {
        F::UnknownIncompatibleFeatures { bits, named, .. } => {
            let mut parts: Vec<String> = named.iter().map(|(_, n)| n.clone()).collect();
            let unknown = named.iter().fold(*bits, |m, (b, _)| m & !(1u64 << b));
            if unknown != 0 {
                parts.push(format!("Unknown incompatible feature: {unknown:x}"));
            }
            format!("Unsupported qcow2 feature(s): {}", parts.join(", "))
        }
        F::UnsupportedVersion { version } => format!("Unsupported qcow2 version {version}"),
        // A file opened as qcow2 (`-f qcow2`) that is not one.
        F::BadMagic { .. } => "Image is not in qcow2 format".into(),
        F::InvalidField {
            what,
            offset,
            value,
            reason,
        } => match (*what, *offset) {
            ("cluster_bits", 0x14) => format!("Unsupported cluster size: 2^{value}"),
            ("l1_size", 0x24) if reason.contains("exceeds") => "Active L1 table too large".into(),
            ("l1_size", 0x24) => "L1 table is too small".into(),
            ("nb_snapshots", 0x3c) => "Snapshot table too large".into(),
            ("backing_file_offset", 0x8) => "Invalid backing file offset".into(),
            ("compression_type", 0x68) => format!("qcow2: unknown compression type: {value}"),
            ("l1_table_offset", 0x28) => "Active L1 table offset invalid".into(),
            ("refcount_table_offset", 0x30) => "Reference count table offset invalid".into(),
            ("refcount_table_clusters", 0x38) => "Reference count table too large".into(),
            ("refcount_order", 0x60) => {
                "Reference count entry width too large; may not exceed 64 bits".into()
            }
            ("header_length", 0x64) if *value < 104 => "qcow2 header too short".into(),
            _ => return None,
        },
        F::Unaligned { what, offset, .. } => match (*what, *offset) {
            ("l1_table_offset", 0x28) => "Active L1 table offset invalid".into(),
            ("refcount_table_offset", 0x30) => "Reference count table offset invalid".into(),
            _ => return None,
        },
        _ => return None,
    })
}

/// The error text of a library error without the leading file name `file`, followed by the
/// causes its text does not already include (such as the OS error of a failed open).
pub fn lib_msg(e: &qimg::Error, file: &str) -> String {
    use std::error::Error as _;
    if let Some(words) = qemu_header_words(e) {
        return words;
    }
    let mut s = match e {
        // A backing file that does not open: QEMU's words, one level per image of the chain.
        qimg::Error::Backing { source, .. } if program() != "qimg" => {
            return format!("Could not open backing file: {}", lib_msg(source, ""));
        }
        // Another process's lock, in QEMU's words when qimg speaks as QEMU's tools.
        qimg::Error::Storage {
            path,
            source: qimg::io::StorageError::Locked { holder },
        } if program() != "qimg" => return lock_error(holder, &path.display().to_string()),
        qimg::Error::Io { source, .. } => return os_msg(source),
        // An encrypted image (a backing file: the named image is refused before its open by
        // `encryption_refusal`, in QEMU's words): what QEMU says when no key is given.
        qimg::Error::Encrypted { .. } if program() != "qimg" => {
            return "Parameter 'encrypt.key-secret' is required for cipher".into();
        }
        // Another file of the image (its data file, a backing file) that does not open, as
        // QEMU names it.
        qimg::Error::Storage {
            path,
            source: qimg::io::StorageError::Open { source, .. },
        } if program() != "qimg"
            && !qimg::io::nbd::is_nbd_name(file)
            && path.as_path() != std::path::Path::new(file) =>
        {
            return format!("Could not open '{}': {}", path.display(), os_msg(source));
        }
        // An NBD export that could not be reached or refused: what the client said, as QEMU
        // says it.
        qimg::Error::Storage {
            source: qimg::io::StorageError::Open { source, .. },
            ..
        } if qimg::io::nbd::is_nbd_name(file) => return source.to_string(),
        other => {
            let s = other.to_string();
            s.strip_prefix(&format!("{file}: "))
                .map(str::to_string)
                .unwrap_or(s)
        }
    };
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        let text = strip_os_error(&text);
        if !s.contains(text) {
            s.push_str(": ");
            s.push_str(text);
        }
        cause = c.source();
    }
    s
}

/// A failed open, worded as qemu-img's (a missing file names the file twice, as QEMU's
/// protocol layer does).
pub fn open_msg(e: anyhow::Error, file: &str) -> anyhow::Error {
    let text = format!("{e:#}");
    let prefix = format!("Could not open '{file}': ");
    match text.strip_prefix(&prefix) {
        Some(rest)
            if rest.starts_with("No such file")
                || rest.starts_with("Permission denied")
                || rest.starts_with("Is a directory") =>
        {
            // The outer name is what the user typed (an option string, a `json:` name).
            let typed = typed_name(file).unwrap_or_else(|| file.to_string());
            anyhow!("Could not open '{typed}': {prefix}{rest}")
        }
        Some(rest) if rest.starts_with("not a qcow2 image") => {
            anyhow!("{prefix}Image is not in qcow2 format")
        }
        _ => e,
    }
}

/// Whether `e` is another process's lock on a file (nothing was changed; the file is theirs).
pub fn is_locked(e: &qimg::Error) -> bool {
    matches!(
        e,
        qimg::Error::Storage {
            source: qimg::io::StorageError::Locked { .. },
            ..
        }
    )
}

/// Another process's lock on `file` as the failed open qemu-img reports (`Could not open
/// 'F': ...`; nothing was changed); `None` for any other error. Every command that writes
/// words a lock refusal through this.
pub fn lock_refusal(e: &qimg::Error, file: &str) -> Option<anyhow::Error> {
    is_locked(e).then(|| anyhow::anyhow!("Could not open '{file}': {}", lib_msg(e, file)))
}

/// A storage of file `file` that did not open (or lock): `Could not open 'F': ...`, a lock
/// in the words of [`lock_refusal`].
pub fn storage_open_error(e: qimg::io::StorageError, file: &str) -> anyhow::Error {
    let e = qimg::Error::Storage {
        path: file.into(),
        source: e,
    };
    anyhow::anyhow!("Could not open '{file}': {}", lib_msg(&e, file))
}

/// QEMU's message for a lock another process holds on `file`. The engine names the lock
/// byte the other process holds: its "shared" byte (it does not share a permission this
/// open uses) is QEMU's failure to get the lock, its use byte (it uses a permission this
/// open does not share) QEMU's failure to get the shared lock.
pub fn lock_error(holder: &str, file: &str) -> String {
    let shared = if holder.contains("QEMU's shared") {
        ""
    } else {
        "shared "
    };
    let perm = holder.split('"').nth(1).unwrap_or("write");
    format!("Failed to get {shared}\"{perm}\" lock\nIs another process using the image [{file}]?")
}

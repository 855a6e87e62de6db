//! Standard output as QEMU's tools write it.
//!
//! qemu-img and qemu-io print with C's stdio: when standard output is not a terminal (a pipe,
//! a file) it is block-buffered, so a script that merges the streams (`2>&1`) sees every
//! message written to standard error *before* the standard output written around it, which
//! comes out in blocks of the file's `st_blksize` (4 KiB for a pipe) and at exit. Scripts and
//! their reference outputs depend on that order. Invoked as `qemu-img` or `qemu-io`, qimg
//! therefore buffers its standard output the same way ([`block_buffered`]), flushing where
//! QEMU's tools call `fflush(stdout)` (the `Formatting ...` line of create, progress lines,
//! qemu-io's prompt, before `sigraise`) and at exit. Invoked as `qimg`, output is
//! line-buffered as Rust's standard output always is.
//!
//! Every line the CLI prints to standard output goes through [`stdout`] (the [`outln!`] and
//! [`out!`] macros).

use std::io::{self, Write};
use std::sync::Mutex;

/// The block buffer: `Some((buffered bytes, block size))` when standard output is
/// block-buffered.
static BLOCK: Mutex<Option<(Vec<u8>, usize)>> = Mutex::new(None);

/// glibc's buffer size when `st_blksize` is not positive (`BUFSIZ`).
const BUFSIZ: usize = 8192;

/// Buffers standard output in blocks as C's stdio does for a file or pipe, when it is not a
/// terminal. Call once, before anything is printed.
pub fn block_buffered() {
    use std::io::IsTerminal;
    if io::stdout().is_terminal() {
        return;
    }
    let block = nix::sys::stat::fstat(io::stdout())
        .ok()
        .and_then(|st| usize::try_from(st.st_blksize).ok())
        .filter(|&b| b > 0)
        .unwrap_or(BUFSIZ);
    *lock() = Some((Vec::with_capacity(block), block));
}

fn lock() -> std::sync::MutexGuard<'static, Option<(Vec<u8>, usize)>> {
    BLOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// Writes `bytes` to the real standard output. A reader that went away ends the process with
/// the status a C tool killed by SIGPIPE has (128 + 13), as QEMU's tools end.
fn emit(bytes: &[u8]) {
    let mut o = io::stdout().lock();
    if let Err(e) = o.write_all(bytes).and_then(|()| o.flush()) {
        if e.kind() == io::ErrorKind::BrokenPipe {
            std::process::exit(141);
        }
    }
}

/// The CLI's standard output (see the module documentation). Errors other than a closed pipe
/// are ignored, as `printf`'s are.
pub fn stdout() -> Stdout {
    Stdout
}

/// Handle returned by [`stdout`].
pub struct Stdout;

impl Write for Stdout {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let mut guard = lock();
        match guard.as_mut() {
            None => {
                drop(guard);
                let mut o = io::stdout().lock();
                if let Err(e) = o.write_all(bytes) {
                    if e.kind() == io::ErrorKind::BrokenPipe {
                        std::process::exit(141);
                    }
                }
            }
            Some((buf, block)) => {
                // As glibc's `fwrite`: fill the buffer, write it out whole when it is full.
                buf.extend_from_slice(bytes);
                let whole = buf.len() / *block * *block;
                if whole > 0 {
                    let rest = buf.split_off(whole);
                    let full = std::mem::replace(buf, rest);
                    drop(guard);
                    emit(&full);
                }
            }
        }
        Ok(bytes.len())
    }

    /// Writes out what a writer layered over this one holds (a `BufWriter`), not the block
    /// buffer: C code writing through stdio does not flush it either. [`flush`] is
    /// `fflush(stdout)`.
    fn flush(&mut self) -> io::Result<()> {
        if lock().is_none() {
            let _ = io::stdout().flush();
        }
        Ok(())
    }
}

/// Writes out what is buffered (`fflush(stdout)`).
pub fn flush() {
    let pending = lock().as_mut().map(|(buf, _)| std::mem::take(buf));
    match pending {
        Some(bytes) if !bytes.is_empty() => emit(&bytes),
        Some(_) => {}
        None => {
            let _ = io::stdout().flush();
        }
    }
}

/// Flushes standard output and ends the process with `code` (what `exit()` does in C).
pub fn exit(code: i32) -> ! {
    flush();
    std::process::exit(code)
}

/// `println!` through [`stdout`].
macro_rules! outln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!($crate::out::stdout(), $($t)*);
    }};
}

/// `print!` through [`stdout`].
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = write!($crate::out::stdout(), $($t)*);
    }};
}

//! qemu-io's asynchronous requests (`aio_read`, `aio_write`, `aio_flush`) and the
//! breakpoints of a `blkdebug` image that hold them (`break`, `wait_break`, `resume`,
//! `remove_break`).
//!
//! An asynchronous request runs as a task of the session's thread on its own view of the
//! open image ([`Session::for_request`]): like QEMU's coroutine it runs as soon as it is
//! submitted until it waits for I/O (or stops at a breakpoint), and prints its result when it
//! completes, which the commands that follow give it the time to do. `aio_flush`, `close`
//! and the end of the run wait for every one.

use std::time::Duration;

use qimg::io::blkdebug::{self, Breakpoints};

use super::errors::{Failed, Outcome};
use super::rw::{readv, writev};
use super::session::Session;

/// `aio_read` and `aio_write`: the request starts, the command returns.
pub async fn submit(s: &mut Session, name: &'static str, args: &[String]) -> Outcome {
    let mut on = s.for_request();
    let args = args.to_vec();
    let request = tokio::task::spawn_local(async move {
        let done = if name == "aio_read" {
            readv(&mut on, name, &args, true).await
        } else {
            writev(&mut on, name, &args, true).await
        };
        done.is_ok()
    });
    s.aio.push(request);
    // As QEMU enters the request's coroutine at once: it runs until it waits.
    tokio::task::yield_now().await;
    Ok(())
}

/// `break`, `remove_break`, `resume`, `wait_break` on the image's `blkdebug` node (without
/// one, QEMU's answer: the operation is not supported).
pub async fn breakpoint(s: &mut Session, name: &str, args: &[String]) -> Outcome {
    let Some(bp) = blkdebug::attached_breakpoints() else {
        let why = super::errors::strerror(nix::errno::Errno::EOPNOTSUPP as i32);
        fail(name, args, &why);
        return Err(Failed);
    };
    let done = match name {
        "break" => bp.add(&args[0], &args[1]),
        "remove_break" => bp.remove(&args[0]),
        "resume" => bp.resume(&args[0]),
        _ => return wait_break(s, &bp, &args[0]).await,
    };
    if done.is_err() {
        let why = super::errors::strerror(nix::errno::Errno::ENOENT as i32);
        fail(name, args, &why);
        return Err(Failed);
    }
    // A resumed request goes on at once, as QEMU re-enters its coroutine.
    tokio::task::yield_now().await;
    Ok(())
}

/// QEMU's message for a failed breakpoint command.
fn fail(name: &str, args: &[String], why: &str) {
    match name {
        "break" => outln!("Could not set breakpoint: {why}"),
        "remove_break" => outln!("Could not remove breakpoint {}: {why}", args[0]),
        "resume" => outln!("Could not resume request: {why}"),
        _ => outln!(
            "Could not wait for a request suspended at {}: {why}",
            args[0]
        ),
    }
}

/// `wait_break TAG`: until a request stops at a breakpoint tagged `tag`. QEMU's waits for
/// ever when none can; this one says so once no request is left in flight.
async fn wait_break(s: &mut Session, bp: &Breakpoints, tag: &str) -> Outcome {
    loop {
        if bp.is_suspended(tag) {
            return Ok(());
        }
        // Every request in flight stopped under other tags (or none left): nothing can
        // reach this one any more.
        let running = s.aio.iter().filter(|r| !r.is_finished()).count();
        if running <= bp.suspended() {
            outln!("Could not wait for a request suspended at {tag}: no request can reach it");
            return Err(Failed);
        }
        // The requests run meanwhile (they are tasks of this thread).
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

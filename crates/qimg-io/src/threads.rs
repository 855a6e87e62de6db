//! The threads qimg starts, and the embedder's hook into each of them.
//!
//! qimg starts these threads (named, so that `/proc/PID/task/*/comm` and debuggers show them):
//!
//! | name | how many | what it does |
//! |---|---|---|
//! | `qimg-uring` | one per file opened on io_uring (`UringStorage`) | reaps the ring's completions |
//! | `qimg-queue` | one per `qimg::Queue` | runs the queue's engine requests |
//! | `qimg-clean` | one per image opened without a running tokio runtime and with a cache-clean interval | the clean timer |
//! | `qimg-close` | one, for the moment of the close, per image dropped with `close_on_drop` | closes the image |
//! | `qimg-blocking` | as needed, in the runtimes qimg builds (the blocking facade's, `qimg-queue`'s, `qimg-clean`'s), when the file backend offloads a system call (`BlockingStrategy::SpawnBlocking`) | one blocking file operation |
//!
//! An embedder that polices its threads (a VMM applying a seccomp filter to each) registers a
//! [start hook](set_start_hook): every one of these threads calls it first, with its name,
//! before qimg runs anything on it. Threads of the embedder's own tokio runtime (an async
//! [`Storage`](crate::Storage) used there, its `spawn_blocking` pool) are the embedder's.

use std::io;
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;

/// What [`set_start_hook`] registers.
type Hook = Arc<dyn Fn(&str) + Send + Sync>;

static HOOK: RwLock<Option<Hook>> = RwLock::new(None);

/// Registers `hook`, called first on every thread qimg starts from now on, with the thread's
/// name (see the [module docs](self)). It runs on the new thread, so it may apply a seccomp
/// filter, set a signal mask or CPU affinity, or register the thread with the embedder; a
/// panic in it ends that thread (the operation that needed it fails). Threads started earlier
/// are not called back. One hook per process; a later call replaces it.
pub fn set_start_hook(hook: impl Fn(&str) + Send + Sync + 'static) {
    *HOOK.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(hook));
}

/// Removes the hook [`set_start_hook`] registered.
pub fn clear_start_hook() {
    *HOOK.write().unwrap_or_else(|e| e.into_inner()) = None;
}

/// Calls the start hook for a thread named `name`: the first thing each of qimg's threads
/// does ([`spawn`] and [`runtime`] do it; a thread started otherwise calls this itself).
pub fn started(name: &str) {
    let hook = HOOK.read().unwrap_or_else(|e| e.into_inner()).clone();
    if let Some(hook) = hook {
        hook(name);
    }
}

/// Starts a thread named `name` that calls the start hook, then `f`.
pub fn spawn<T, F>(name: &'static str, f: F) -> io::Result<JoinHandle<T>>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            started(name);
            f()
        })
}

/// A current-thread tokio runtime builder (timers enabled) whose blocking pool threads are
/// named `qimg-blocking` and call the start hook: every runtime qimg builds for itself.
pub fn runtime() -> tokio::runtime::Builder {
    let mut b = tokio::runtime::Builder::new_current_thread();
    b.enable_time()
        .thread_name("qimg-blocking")
        .on_thread_start(|| started("qimg-blocking"));
    b
}

//! The socket and the daemon: binding, serving one front-end after another, stopping.

use super::*;
use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use qimg::io::AnyStorage;
use qimg::{Image, QueueOptions};
use vhost::vhost_user::Listener;
use vhost_user_backend::VhostUserDaemon;

use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;

use self::request::{Limits, SECTOR};

/// Stops a running [`serve`] from another thread.
#[derive(Clone)]
pub struct Stop {
    flag: Arc<AtomicBool>,
    current: Arc<Mutex<Option<vhost_user_backend::ShutdownHandle>>>,
    socket: PathBuf,
}

impl std::fmt::Debug for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stop")
            .field("socket", &self.socket)
            .finish()
    }
}

impl Stop {
    /// Asks the server to stop: the frontend is disconnected (or, with none, the wait for one
    /// ends), requests in flight finish, and [`serve`] returns.
    pub fn stop(&self) {
        self.flag.store(true, Ordering::Release);
        let current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        match &*current {
            Some(h) => h.shutdown(),
            // Waiting in accept: a connection of our own wakes it.
            None => {
                let _ = std::os::unix::net::UnixStream::connect(&self.socket);
            }
        }
    }
}

/// A bound vhost-user socket: connections are accepted from the moment this returns.
pub struct Bound {
    listener: Listener,
    path: PathBuf,
}

impl std::fmt::Debug for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bound").field("path", &self.path).finish()
    }
}

/// Binds the vhost-user socket at `path` (replacing a stale socket file).
pub fn bind(path: &Path) -> Result<Bound, VhostError> {
    let listener = Listener::new(path, true).map_err(|e| VhostError::Listen {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    Ok(Bound {
        listener,
        path: path.to_path_buf(),
    })
}

impl Bound {
    /// The handle that stops [`serve`] on this socket.
    pub fn stopper(&self) -> Stop {
        Stop {
            flag: Arc::new(AtomicBool::new(false)),
            current: Arc::new(Mutex::new(None)),
            socket: self.path.clone(),
        }
    }
}

impl Drop for Bound {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Serves `image` on the bound socket, one frontend at a time, until `stop` is used. Each
/// virtqueue gets a [`Queue`] of its own on the image. Returns after the last frontend's
/// requests finished; the caller closes the image.
pub fn serve(
    image: &Image<AnyStorage>,
    mut bound: Bound,
    options: BlkOptions,
    stop: Stop,
) -> Result<(), VhostError> {
    options.check()?;
    if !options.read_only && !image.is_writable() {
        return Err(VhostError::Option(
            "the image is open read-only: serve it with --readonly".into(),
        ));
    }
    let queues = (0..options.num_queues)
        .map(|_| {
            let queue = image.queue(QueueOptions::new().depth(options.ring_depth))?;
            Ok(Mutex::new(QueueState {
                queue,
                pending: HashMap::new(),
                next: 0,
                logged: 0,
            }))
        })
        .collect::<Result<Vec<_>, qimg::Error>>()?;
    let device = Arc::new(Device {
        limits: Limits {
            capacity: image.size() / SECTOR * SECTOR,
            block_size: options.logical_block_size,
            read_only: options.read_only,
            max_segments: SEG_MAX as usize,
            max_bytes: MAX_REQUEST,
            max_zero_sectors: MAX_ZERO_SECTORS,
            max_zero_segments: 1,
        },
        cluster_size: image.cluster_size(),
        subcluster_size: image.subcluster_size(),
        write_cache: AtomicBool::new(!options.writethrough),
        options,
        queues,
        generation: AtomicU64::new(0),
    });
    while !stop.flag.load(Ordering::Acquire) {
        serve_one(&device, &mut bound, &stop)?;
    }
    // Whatever the last frontend left in flight finishes before the image is closed.
    for q in &device.queues {
        let mut s = q.lock().unwrap_or_else(|e| e.into_inner());
        while s.queue.in_flight() > 0 {
            s.queue.wait()?;
            while s.queue.next_completed().is_some() {}
        }
        s.pending.clear();
    }
    Ok(())
}

/// One frontend, from connection to disconnect.
pub(super) fn serve_one(
    device: &Arc<Device>,
    bound: &mut Bound,
    stop: &Stop,
) -> Result<(), VhostError> {
    let generation = device.generation.fetch_add(1, Ordering::AcqRel) + 1;
    // A new frontend starts with the configured cache mode, whatever the last one set.
    device
        .write_cache
        .store(!device.options.writethrough, Ordering::Release);
    let mem: Mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
    let backend = Arc::new(Backend {
        device: device.clone(),
        mem: mem.clone(),
        event_idx: AtomicBool::new(false),
        generation,
    });
    let daemon_err = |e: vhost_user_backend::Error| VhostError::Daemon(e.to_string());
    let mut daemon =
        VhostUserDaemon::new("qimg-vhost-user-blk".into(), backend, mem).map_err(daemon_err)?;
    let n = device.queues.len();
    for (q, handler) in daemon.get_epoll_handlers().iter().enumerate() {
        let Some(state) = device.queues.get(q) else {
            break;
        };
        let fd = state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .queue
            .notifier()
            .as_fd()
            .as_raw_fd();
        handler
            .register_listener(fd, EventSet::IN, (n + 1 + q) as u64)
            .map_err(|e| VhostError::Daemon(format!("registering queue {q}'s eventfd: {e}")))?;
    }
    daemon.start(&mut bound.listener).map_err(daemon_err)?;
    *stop.current.lock().unwrap_or_else(|e| e.into_inner()) = daemon.shutdown_handle();
    if stop.flag.load(Ordering::Acquire) {
        daemon.request_shutdown();
    }
    let waited = daemon.wait();
    *stop.current.lock().unwrap_or_else(|e| e.into_inner()) = None;
    // Dropping the daemon stops its queue threads.
    drop(daemon);
    match waited {
        // A frontend that goes away (a VM that stops, a VMM that restarts) is the normal end.
        Ok(())
        | Err(vhost_user_backend::Error::HandleRequest(
            vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage,
        )) => {}
        Err(e) if !stop.flag.load(Ordering::Acquire) => {
            eprintln!("qimg: vhost-user frontend: {e}");
        }
        Err(_) => {}
    }
    Ok(())
}

//! Reads and writes of one NBD connection through a [`qimg::Queue`]: the path the
//! vhost-user-blk daemon uses. Requests whose place in the image is known from cached
//! metadata (reads, in-place writes, allocating writes without copy-on-write) go straight to
//! the queue's own io_uring ring with the connection's aligned buffers (no bounce copy, no
//! thread hop); the rest run on the queue's engine thread. The connection's task owns the
//! queue: it submits as it reads requests and collects completions when the queue's eventfd,
//! polled by the runtime ([`AsyncFd`]), says there are some.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};

use qimg::io::Storage;
use qimg::{Completion, Image, Queue, QueueOptions, Request};
use tokio::io::unix::AsyncFd;

/// Ring entries per connection: the requests one connection may have in flight
/// ([`MAX_IN_FLIGHT`](super::MAX_IN_FLIGHT)) with room for multi-cluster ones.
const DEPTH: u32 = 256;

/// A connection's queue and what the connection keeps (`P`) for each request in it.
#[derive(Debug)]
pub(super) struct ConnQueue<S: Storage + 'static, P> {
    queue: Queue<S>,
    ready: AsyncFd<OwnedFd>,
    pending: HashMap<u64, P>,
    next: u64,
}

impl<S: Storage + 'static, P> ConnQueue<S, P> {
    /// A queue on `image` (without a ring of its own where the storage has no descriptor or
    /// io_uring is refused: every request then runs on its engine thread); `None` where it
    /// cannot be made at all (no eventfd or thread, a runtime without I/O): the engine
    /// serves the connection. Must run inside a runtime with I/O enabled.
    pub(super) fn start(image: &Image<S>) -> Option<Self> {
        let queue = image.queue(QueueOptions::new().depth(DEPTH)).ok()?;
        let fd = queue.notifier().as_fd().try_clone_to_owned().ok()?;
        // Deprecated because a type that merely borrows a descriptor could close it while it
        // is registered; an `OwnedFd` moved into the `AsyncFd` cannot be.
        #[allow(deprecated)]
        let ready = AsyncFd::new(fd).ok()?;
        Some(Self {
            queue,
            ready,
            pending: HashMap::new(),
            next: 0,
        })
    }

    /// Submits `request`, keeping `p` until it completes. `Err(p)`: the queue stopped
    /// taking requests.
    pub(super) fn submit(&mut self, request: Request, p: P) -> Result<(), P> {
        let id = self.next;
        self.next += 1;
        match self.queue.submit(request, id) {
            Ok(()) => {
                self.pending.insert(id, p);
                Ok(())
            }
            Err(_) => Err(p),
        }
    }

    /// The next completed request with what was kept for it, if any (never blocks).
    pub(super) fn next_completed(&mut self) -> Option<(Completion, P)> {
        while let Some(c) = self.queue.next_completed() {
            if let Some(p) = self.pending.remove(&c.user_data) {
                return Some((c, p));
            }
        }
        None
    }

    /// Requests submitted and not yet collected.
    pub(super) fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// Resolves when completions may be ready. Borrows only the eventfd, so that the
    /// future stays `Send` (the queue itself is not `Sync`).
    pub(super) fn ready(&self) -> impl std::future::Future<Output = ()> + Send + '_ {
        ready(&self.ready)
    }
}

async fn ready(fd: &AsyncFd<OwnedFd>) {
    match fd.readable().await {
        Ok(mut guard) => {
            // Reset the eventfd before collecting: a completion posted after this signals
            // it again. (Non-blocking: EAGAIN when nothing was signalled.)
            let mut count = [0u8; 8];
            let _ = nix::unistd::read(fd.get_ref(), &mut count);
            guard.clear_ready();
        }
        // The eventfd cannot be polled: collect after a short sleep instead.
        Err(_) => tokio::time::sleep(std::time::Duration::from_millis(1)).await,
    }
}

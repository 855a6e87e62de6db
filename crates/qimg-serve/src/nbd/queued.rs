//! Reads and writes of one NBD connection through a [`qimg::Queue`]: the path the
//! vhost-user-blk daemon uses. Requests whose place in the image is known from cached
//! metadata (reads, in-place writes, allocating writes without copy-on-write) go straight to
//! the queue's own io_uring ring with the connection's aligned buffers (no bounce copy, no
//! thread hop); the rest run on the queue's engine thread. One driver task per connection
//! owns the queue, submits what the request tasks send it and hands each completion back; the
//! queue's eventfd wakes it through the runtime ([`AsyncFd`]).

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};

use qimg::io::Storage;
use qimg::{Completion, Image, Queue, QueueOptions, Request};
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// Ring entries per connection: the requests one connection may have in flight
/// ([`MAX_IN_FLIGHT`](super::MAX_IN_FLIGHT)) with room for multi-cluster ones.
const DEPTH: u32 = 256;

type Job = (Request, oneshot::Sender<Completion>);

/// A handle on a connection's queue, cloned into every request task.
#[derive(Debug, Clone)]
pub(super) struct Queued {
    tx: mpsc::UnboundedSender<Job>,
}

impl Queued {
    /// Starts the driver task of a queue on `image`; `None` where the queue cannot be made
    /// (no io_uring, storage without a file descriptor): the engine serves the connection.
    /// Must run inside a runtime with I/O enabled.
    pub(super) fn start<S: Storage + 'static>(image: &Image<S>) -> Option<(Self, JoinHandle<()>)> {
        // Without a descriptor the queue's ring can use, every request would take the engine
        // with an extra hop.
        image.storage().direct_access()?;
        let queue = image.queue(QueueOptions::new().depth(DEPTH)).ok()?;
        let fd = queue.notifier().as_fd().try_clone_to_owned().ok()?;
        // Deprecated because a type that merely borrows a descriptor could close it while it
        // is registered; an `OwnedFd` moved into the `AsyncFd` cannot be.
        #[allow(deprecated)]
        let ready = AsyncFd::new(fd).ok()?;
        let (tx, rx) = mpsc::unbounded_channel();
        let driver = tokio::spawn(drive(queue, ready, rx));
        Some((Self { tx }, driver))
    }

    /// Runs `request` on the queue; `None` if the queue stopped taking requests.
    pub(super) async fn run(&self, request: Request) -> Option<Completion> {
        let (tx, rx) = oneshot::channel();
        self.tx.send((request, tx)).ok()?;
        rx.await.ok()
    }
}

/// Submits what arrives on `rx` and answers each completion, until every handle is dropped
/// and nothing is in flight; then drops the queue (which must go before the image closes).
async fn drive<S: Storage + 'static>(
    mut queue: Queue<S>,
    ready: AsyncFd<OwnedFd>,
    mut rx: mpsc::UnboundedReceiver<Job>,
) {
    let mut waiting: HashMap<u64, oneshot::Sender<Completion>> = HashMap::new();
    let mut next = 0u64;
    let mut open = true;
    loop {
        while let Some(c) = queue.next_completed() {
            if let Some(tx) = waiting.remove(&c.user_data) {
                // A request task that went away (its connection closed) drops the answer.
                let _ = tx.send(c);
            }
        }
        if !open && waiting.is_empty() {
            break;
        }
        tokio::select! {
            job = rx.recv(), if open => match job {
                Some((request, tx)) => {
                    let id = next;
                    next += 1;
                    // A queue that cannot take requests any more: the task gets `None`.
                    if queue.submit(request, id).is_ok() {
                        waiting.insert(id, tx);
                    }
                }
                None => open = false,
            },
            guard = ready.readable() => match guard {
                Ok(mut guard) => {
                    // Reset the eventfd before collecting: a completion posted after this
                    // signals it again.
                    let _ = queue.notifier().drain();
                    guard.clear_ready();
                }
                Err(_) => {
                    // The eventfd cannot be polled: collect by waiting in place.
                    let _ = queue.wait();
                }
            },
        }
    }
}

//! The engine's side of a queue: requests that need metadata I/O (allocation, copy-on-write,
//! slice loads, backing reads) or the engine's own care (flush, write-zeroes, discard) run on
//! one thread per queue, off the caller's event loop.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::thread::JoinHandle;

use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};

pub(super) type Job = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// A thread running a single-threaded tokio runtime that runs queued jobs concurrently.
#[derive(Debug)]
pub(super) struct Worker {
    tx: Option<UnboundedSender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    pub(super) fn start() -> io::Result<Self> {
        let rt = qimg_io::threads::runtime().build()?;
        let (tx, mut rx) = unbounded_channel::<Job>();
        let thread = qimg_io::threads::spawn("qimg-queue", move || {
            rt.block_on(async move {
                let mut jobs = tokio::task::JoinSet::new();
                while let Some(job) = rx.recv().await {
                    jobs.spawn(job);
                    while jobs.try_join_next().is_some() {}
                }
                // The queue is being dropped: finish what was submitted.
                while jobs.join_next().await.is_some() {}
            });
        })?;
        Ok(Worker {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Whether the thread still takes jobs.
    pub(super) fn is_running(&self) -> bool {
        self.tx.as_ref().is_some_and(|tx| !tx.is_closed())
    }

    /// Queues `job`; `false` if the thread is gone.
    pub(super) fn run(&self, job: Job) -> bool {
        self.tx.as_ref().is_some_and(|tx| tx.send(job).is_ok())
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing the channel ends the loop once every job finished.
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

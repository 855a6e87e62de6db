//! The engine's side of a queue: requests that need metadata I/O (allocation, copy-on-write,
//! slice loads, backing reads) or the engine's own care (flush, write-zeroes, discard) run on
//! one thread per queue, off the caller's event loop.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::thread::JoinHandle;

use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};

use std::sync::atomic::Ordering;

use qimg_io::Storage;
use qimg_io::queue::IoBuffers;

use super::{Completion, Queue, Request};
use crate::engine::image::Image;
use crate::error::{Error, Result};

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

impl<S: Storage + 'static> Queue<S> {
    /// Runs `request` on the engine thread. Should the thread have died since the request was
    /// admitted (only a panic of its runtime could do that), the request completes with that
    /// error, its buffers dropped (the kernel never saw them).
    pub(super) fn run_on_engine_thread(&mut self, request: Request, user_data: u64) {
        self.stats.engine += 1;
        let queued = self.post_from_engine(move |image| async move {
            let (result, buffers) = run_on_engine(&image, request).await;
            Completion {
                user_data,
                result,
                buffers,
                holes: None,
            }
        });
        if !queued {
            self.done.push_back(Completion {
                user_data,
                result: Err(self.gone("queueing a request")),
                buffers: None,
                holes: None,
            });
            if !self.collecting {
                let _ = self.notifier.notify();
            }
        }
    }

    /// Runs `work` on the engine thread and posts the completion it returns (counted in
    /// flight until then); `false` if the thread is gone.
    pub(super) fn post_from_engine<F, Fut>(&mut self, work: F) -> bool
    where
        F: FnOnce(Image<S>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Completion> + Send + 'static,
    {
        let image = self.image.clone();
        let done = self.engine_done.clone();
        let in_flight = self.engine_in_flight.clone();
        let notifier = self.notifier.clone();
        in_flight.fetch_add(1, Ordering::AcqRel);
        let job = Box::pin(async move {
            let completion = work(image).await;
            done.lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(completion);
            in_flight.fetch_sub(1, Ordering::AcqRel);
            let _ = notifier.notify();
        });
        let queued = self.worker.run(job);
        if !queued {
            self.engine_in_flight.fetch_sub(1, Ordering::AcqRel);
        }
        queued
    }
}

async fn run_on_engine<S: Storage + 'static>(
    image: &Image<S>,
    request: Request,
) -> (Result<u64>, Option<IoBuffers>) {
    let path = &image.inner.shared.path;
    let busy = || {
        Error::io(
            path,
            "lending buffers",
            io::Error::other("the buffers are still in use by the ring"),
        )
    };
    match request {
        Request::Read {
            offset,
            mut buffers,
        } => {
            let len = buffers.len() as u64;
            let r = if buffers.is_guest_memory() {
                // Guest memory is never borrowed as a slice: read into a buffer, copy in.
                let mut tmp = vec![0u8; buffers.len()];
                match image.read(&mut tmp, offset).await {
                    Ok(()) if buffers.copy_in(0, &tmp) => Ok(()),
                    Ok(()) => Err(busy()),
                    Err(e) => Err(e),
                }
            } else {
                match buffers.slices_mut() {
                    Some(mut slices) => image.read_vectored(&mut slices, offset).await,
                    None => Err(busy()),
                }
            };
            (r.map(|()| len), Some(buffers))
        }
        Request::Write { offset, buffers } => {
            let len = buffers.len() as u64;
            let r = if buffers.is_guest_memory() {
                let mut tmp = vec![0u8; buffers.len()];
                if buffers.copy_out(0, &mut tmp) {
                    image.write(&tmp, offset).await
                } else {
                    Err(busy())
                }
            } else {
                match buffers.slices() {
                    Some(slices) => image.write_vectored(&slices, offset).await,
                    None => Err(busy()),
                }
            };
            (r.map(|()| len), Some(buffers))
        }
        Request::Flush => (image.flush().await.map(|()| 0), None),
        Request::WriteZeroes { offset, len, unmap } => {
            let done = match unmap {
                true => image.write_zeroes_unmap(offset, len).await,
                false => image.write_zeroes(offset, len).await,
            };
            (done.map(|()| 0), None)
        }
        Request::Discard { offset, len } => (image.discard(offset, len).await.map(|()| 0), None),
    }
}

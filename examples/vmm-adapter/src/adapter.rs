//! [`QcowDisk`] and [`QcowAsyncIo`]: the [`vmm`](crate::vmm) traits on `qimg::Queue`.

use std::{fs::File, path::Path};

use qimg::{BlockingImage, IoBuffers, OpenOptions, Queue, QueueOptions, Request, io::AnyStorage};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use crate::vmm::{AsyncIo, AsyncIoCompletion, AsyncIoOp, BatchRequest, DiskError, DiskFile};
use crate::vmm::{IoTarget, Refused};

/// A qcow2 disk served by qimg: the VMM routes images with extended L2 entries here.
pub struct QcowDisk {
    image: BlockingImage,
}

impl QcowDisk {
    /// Opens the image on the VMM's descriptor (locks beside the VMM's own; the chain resolves
    /// next to `path`) if it has extended L2 entries, else `None` (the VMM's other backends
    /// take it). Dropping the disk (after its queues) flushes and closes the image.
    pub fn open(file: File, path: &Path, opts: OpenOptions) -> Result<Option<Self>, DiskError> {
        match qimg::probe(&file)? {
            Some(p) if p.extended_l2 => {}
            _ => return Ok(None),
        }
        let image = opts.close_on_drop(true).open_file_blocking(file, path)?;
        Ok(Some(QcowDisk { image }))
    }
}

impl DiskFile for QcowDisk {
    fn size(&mut self) -> Result<u64, DiskError> {
        Ok(self.image.size())
    }

    fn new_async_io(&self, ring_depth: u32) -> Result<Box<dyn AsyncIo>, DiskError> {
        let notifier = EventFd::new(EFD_NONBLOCK)?;
        let options = QueueOptions::new()
            .depth(ring_depth)
            .eventfd_of(&notifier)?;
        let queue = self.image.as_async().queue(options)?;
        Ok(Box::new(QcowAsyncIo { queue, notifier }))
    }
}

/// One virtqueue's queue.
pub struct QcowAsyncIo {
    queue: Queue<AnyStorage>,
    notifier: EventFd,
}

/// A read or write of `op`'s memory; `op` rides along as the owner handed back at the end.
fn request(mut op: AsyncIoOp, write: bool) -> Request {
    let iovecs = match &mut op.target {
        IoTarget::Guest(g) => g.iovecs.clone(),
        IoTarget::Bounce(b) => {
            let (iov_base, iov_len) = (b.as_mut_ptr().cast(), b.len());
            vec![libc::iovec { iov_base, iov_len }]
        }
    };
    // SAFETY: the iovecs point into memory `op` keeps alive (the guest mapping it holds, or
    // its bounce buffer, whose heap block does not move with `op`), and `op` is the owner: it
    // is dropped or handed back only after the kernel is done with that memory.
    let (offset, buffers) = (op.offset, unsafe { IoBuffers::from_raw_owned(&iovecs, op) });
    match write {
        true => Request::Write { offset, buffers },
        false => Request::Read { offset, buffers },
    }
}

/// The operation a read or write request carries, handed back by the queue.
fn owner(request: Request) -> AsyncIoOp {
    let (Request::Read { buffers, .. } | Request::Write { buffers, .. }) = request else {
        unreachable!("only reads and writes carry an operation")
    };
    buffers
        .take_owner()
        .expect("the queue hands requests back whole")
}

impl QcowAsyncIo {
    fn rw(&mut self, op: AsyncIoOp, user_data: u64, write: bool) -> Result<(), Refused<AsyncIoOp>> {
        let submitted = self.queue.submit(request(op, write), user_data);
        submitted.map_err(|e| (owner(e.request), e.error.into()))
    }

    fn submit(&mut self, request: Request, user_data: u64) -> Result<(), DiskError> {
        let submitted = self.queue.submit(request, user_data);
        submitted.map_err(|e| qimg::Error::from(e).into())
    }
}

impl AsyncIo for QcowAsyncIo {
    fn notifier(&self) -> &EventFd {
        &self.notifier
    }

    fn read_vectored(&mut self, op: AsyncIoOp, user_data: u64) -> Result<(), Refused<AsyncIoOp>> {
        self.rw(op, user_data, false)
    }

    fn write_vectored(&mut self, op: AsyncIoOp, user_data: u64) -> Result<(), Refused<AsyncIoOp>> {
        self.rw(op, user_data, true)
    }

    fn fsync(&mut self, user_data: Option<u64>) -> Result<(), DiskError> {
        match user_data {
            Some(u) => self.submit(Request::Flush, u),
            None => Ok(self.queue.flush_blocking()?),
        }
    }

    fn write_zeroes(&mut self, offset: u64, len: u64, user_data: u64) -> Result<(), DiskError> {
        let unmap = false;
        self.submit(Request::WriteZeroes { offset, len, unmap }, user_data)
    }

    fn punch_hole(&mut self, offset: u64, len: u64, user_data: u64) -> Result<(), DiskError> {
        // Must read zeros afterwards: `Request::Discard` may leave partial subclusters.
        let unmap = true;
        self.submit(Request::WriteZeroes { offset, len, unmap }, user_data)
    }

    fn submit_batch_requests(
        &mut self,
        batch: Vec<(BatchRequest, u64)>,
    ) -> Result<(), Refused<Vec<(BatchRequest, u64)>>> {
        let requests = batch.into_iter().map(|(r, u)| match r {
            BatchRequest::Read(op) => (request(op, false), u),
            BatchRequest::Write(op) => (request(op, true), u),
        });
        self.queue.submit_batch(requests).map_err(|e| {
            let batch = e.requests.into_iter().map(|(r, u)| match r {
                r @ Request::Write { .. } => (BatchRequest::Write(owner(r)), u),
                r => (BatchRequest::Read(owner(r)), u),
            });
            (batch.collect(), e.error.into())
        })
    }

    fn next_completed_request(&mut self) -> Option<AsyncIoCompletion> {
        let c = self.queue.next_completed()?;
        let (user_data, result) = (c.user_data, c.raw_result());
        let op = c.buffers.and_then(|b| b.take_owner::<AsyncIoOp>().ok());
        Some(AsyncIoCompletion {
            user_data,
            result,
            op,
        })
    }
}

//! The transmission phase. One task per connection reads requests from a buffer (many per
//! `read` when the client sends them back to back), checks them and starts them: reads and
//! writes, flushes, trims and write-zeroes (but with `NO_HOLE`, which writes zeros as data)
//! go to the connection's [`qimg::Queue`] when it has one (the task collects their
//! completions itself); block status, cache and what has no queue run as tasks of their own
//! on the shared image and hand their reply back. Replies go out in completion order, gathered into one vectored
//! write when several are ready, and a read's data is sent from the buffer it was read into.
//!
//! Memory stays bounded: a request is taken only when it fits [`MAX_IN_FLIGHT`] requests and
//! [`IN_FLIGHT_BYTES`] of payload (write data received, read data to send), and its share is
//! given back once its reply is written. When the client stops reading replies, they wait,
//! the budget runs out, and the task stops reading requests.
//!
//! This module is the connection (reading, budgeting, collecting and sending); the request
//! as read (`request.rs`), its checks and the commands run on the image (`execute.rs`) and
//! the replies (`reply.rs`) are its siblings.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::sync::Arc;
use std::time::Duration;

use qimg::io::{AlignedBuf, Storage};
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::execute::*;
use super::proto::*;
use super::reply::*;
use super::request::*;
use super::{BoxStream, Error, Export, IN_FLIGHT_BYTES, MAX_IN_FLIGHT, Negotiated, Shutdown};

/// Budget units are KiB.
const UNIT: usize = 1024;

/// Bytes of requests read from the socket at once (headers, and small payloads with them).
const INPUT_BUFFER: usize = 64 << 10;

/// Bytes of spare buffers a connection keeps for its next reads and writes.
const POOL_BYTES: usize = 4 << 20;

/// How long a shutdown waits for replies a client does not read.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// A request in the connection's queue.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
#[derive(Debug)]
enum Queued {
    Read {
        req: Request,
        units: usize,
    },
    /// A write, flush, trim or write-zeroes: its reply is its outcome.
    Write {
        req: Request,
        units: usize,
    },
}

#[cfg(target_os = "linux")]
type ConnQueue<S> = super::queued::ConnQueue<S, Queued>;

/// Without io_uring (not Linux) the engine serves every request: a queue that never exists.
#[cfg(not(target_os = "linux"))]
#[derive(Debug)]
enum ConnQueue<S> {
    #[allow(dead_code)]
    Never(std::convert::Infallible, std::marker::PhantomData<S>),
}

#[cfg(not(target_os = "linux"))]
impl<S: Storage + 'static> ConnQueue<S> {
    fn start(_: &Image<S>) -> Option<Self> {
        None
    }
    fn submit(&mut self, _: qimg::Request, _: Queued) -> Result<(), Queued> {
        match *self {}
    }
    fn next_completed(&mut self) -> Option<(qimg::Completion, Queued)> {
        match *self {}
    }
    fn in_flight(&self) -> usize {
        match *self {}
    }
    async fn ready(&self) {
        match *self {}
    }
}

/// Requests read from the socket and not yet taken.
#[derive(Debug)]
struct Input {
    buf: Box<[u8]>,
    head: usize,
    tail: usize,
    /// A write whose payload is still arriving: the request, its buffer, bytes in it, units.
    partial: Option<(Request, AlignedBuf, usize, usize)>,
}

impl Input {
    /// Where the next socket read goes.
    fn target(&mut self) -> &mut [u8] {
        if let Some((_, payload, filled, _)) = &mut self.partial {
            return &mut payload[*filled..];
        }
        if self.head == self.tail {
            (self.head, self.tail) = (0, 0);
        } else if self.buf.len() - self.tail < 64 {
            self.buf.copy_within(self.head..self.tail, 0);
            (self.head, self.tail) = (0, self.tail - self.head);
        }
        &mut self.buf[self.tail..]
    }

    /// Records `n` bytes read into [`target`](Self::target).
    fn filled(&mut self, n: usize) {
        match &mut self.partial {
            Some((_, _, filled, _)) => *filled += n,
            None => self.tail += n,
        }
    }

    /// Whether the client stopped in the middle of a message.
    fn mid_message(&self) -> bool {
        self.partial.is_some() || self.head != self.tail
    }
}

/// What woke the connection's task.
enum Event {
    Shutdown,
    DrainTimeout,
    Queue,
    Reply(Option<Reply>),
    Wrote(io::Result<usize>),
    Flushed(io::Result<()>),
    Read(io::Result<usize>),
}

/// One connection in the transmission phase.
struct Conn<S: Storage + 'static> {
    export: Arc<Export<S>>,
    neg: Negotiated,
    queue: Option<ConnQueue<S>>,
    /// Replies of the requests running as tasks.
    tx: mpsc::UnboundedSender<Reply>,
    tasks: JoinSet<()>,
    input: Input,
    /// Replies to write, and bytes of the first one already written.
    out: VecDeque<Reply>,
    sent: usize,
    /// Requests taken whose reply is not written yet, and their budget units.
    in_flight: usize,
    units: usize,
    /// Still reading requests; the outcome once not.
    reading: bool,
    result: Result<(), Error>,
    /// The budget is full: no request is taken until a reply is written.
    blocked: bool,
    /// Writing to the client failed: replies are dropped.
    write_failed: bool,
    /// Bytes were written since the last flush of the stream. A TLS session can keep part of
    /// what a write accepted (the socket was full) until it is flushed: once no reply is
    /// left to write, the stream is flushed, or the client waits for the end of a reply
    /// for ever (found with qimg's own client under load).
    unflushed: bool,
    /// Buffers of finished requests, for the next ones (no allocation and zeroing per
    /// request), and their bytes.
    pool: Vec<AlignedBuf>,
    pool_bytes: usize,
}

/// Runs the transmission phase until the client disconnects, `shutdown` fires or the client
/// breaks the protocol; then finishes the requests in flight (waiting at most 10 seconds for
/// replies the client does not read).
pub async fn run<S: Storage + 'static>(
    stream: BoxStream,
    export: Arc<Export<S>>,
    neg: Negotiated,
    mut shutdown: Shutdown,
) -> Result<(), Error> {
    let (mut rd, mut wr) = tokio::io::split(stream);
    let queue = if export.per_connection_queue {
        ConnQueue::start(&export.image)
    } else {
        None
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut c = Conn {
        export,
        neg,
        queue,
        tx,
        tasks: JoinSet::new(),
        input: Input {
            buf: vec![0u8; INPUT_BUFFER].into_boxed_slice(),
            head: 0,
            tail: 0,
            partial: None,
        },
        out: VecDeque::new(),
        sent: 0,
        in_flight: 0,
        units: 0,
        reading: true,
        result: Ok(()),
        blocked: false,
        write_failed: false,
        unflushed: false,
        pool: Vec::new(),
        pool_bytes: 0,
    };
    c.serve(&mut rd, &mut wr, &mut rx, &mut shutdown).await;
    // The queue goes before the image can close; nothing is in flight in it any more.
    drop(c.queue.take());
    let export = c.export.clone();
    if !export.read_only && !export.no_flush {
        // Leave what this client wrote durable, as a flush would.
        let _ = export.image.flush().await;
    }
    let _ = wr.shutdown().await;
    c.result
}

impl<S: Storage + 'static> Conn<S> {
    /// The event loop: until reading stopped and every request taken has its reply written
    /// (or the drain timed out).
    async fn serve(
        &mut self,
        rd: &mut ReadHalf<BoxStream>,
        wr: &mut WriteHalf<BoxStream>,
        rx: &mut mpsc::UnboundedReceiver<Reply>,
        shutdown: &mut Shutdown,
    ) {
        let drain = tokio::time::sleep(Duration::MAX);
        tokio::pin!(drain);
        let mut draining = false;
        loop {
            self.collect(rx);
            if self.reading {
                self.parse();
            }
            if !self.reading {
                if self.in_flight == 0 {
                    return;
                }
                if !draining {
                    draining = true;
                    drain
                        .as_mut()
                        .reset(tokio::time::Instant::now() + DRAIN_TIMEOUT);
                }
            }
            let want_read = self.reading && !self.blocked;
            let want_write = !self.out.is_empty();
            let want_flush = self.unflushed && !want_write && !self.write_failed;
            let queued = self.queue.as_ref().is_some_and(|q| q.in_flight() > 0);
            let event = {
                let mut iov: Vec<IoSlice<'_>> = Vec::new();
                if want_write {
                    gather(&self.out, self.sent, &mut iov);
                }
                // Only the eventfd is borrowed across the wait (the queue is not `Sync`).
                let queue = self.queue.as_ref().map(|q| q.ready());
                let target = if want_read {
                    self.input.target()
                } else {
                    &mut []
                };
                tokio::select! {
                    biased;
                    _ = shutdown.wait(), if self.reading => Event::Shutdown,
                    _ = &mut drain, if draining => Event::DrainTimeout,
                    _ = async { if let Some(ready) = queue { ready.await } }, if queued => Event::Queue,
                    r = rx.recv() => Event::Reply(r),
                    // One branch: a write, or, with nothing left to write, a flush.
                    r = async {
                        if want_write {
                            Event::Wrote(wr.write_vectored(&iov).await)
                        } else {
                            Event::Flushed(wr.flush().await)
                        }
                    }, if want_write || want_flush => r,
                    r = rd.read(target), if want_read => Event::Read(r),
                }
            };
            match event {
                Event::Shutdown => self.stop(Ok(())),
                Event::DrainTimeout => {
                    self.abandon().await;
                    return;
                }
                Event::Queue => {}
                Event::Reply(Some(r)) => self.push(r),
                Event::Reply(None) => {}
                Event::Wrote(Ok(n)) if n > 0 => {
                    self.unflushed = true;
                    self.advance(n);
                }
                Event::Flushed(Ok(())) => self.unflushed = false,
                Event::Wrote(_) | Event::Flushed(Err(_)) => {
                    // The client is gone (the reader will see it): drop what it would get.
                    self.write_failed = true;
                    while let Some(r) = self.out.pop_front() {
                        self.release(r.units);
                    }
                    self.sent = 0;
                }
                Event::Read(Ok(0)) => {
                    let r = if self.input.mid_message() {
                        Err(io::Error::from(io::ErrorKind::UnexpectedEof).into())
                    } else {
                        Ok(())
                    };
                    self.stop(r);
                }
                Event::Read(Ok(n)) => self.input.filled(n),
                Event::Read(Err(e)) => self.stop(Err(e.into())),
            }
        }
    }

    /// Stops reading requests, ending the connection with `result` once the requests in
    /// flight are answered.
    fn stop(&mut self, result: Result<(), Error>) {
        if self.reading {
            self.reading = false;
            self.result = result;
            // A request whose payload did not come in full never runs: nothing to wait for
            // (counted in flight, it kept the connection draining until the timeout).
            if let Some((_, payload, _, units)) = self.input.partial.take() {
                self.release(units);
                self.recycle(payload);
            }
        }
    }

    /// After the drain timed out: the tasks are cancelled, the queue's requests (which end
    /// on their own) are waited for, and their replies dropped.
    async fn abandon(&mut self) {
        self.tasks.abort_all();
        while self.tasks.join_next().await.is_some() {}
        if let Some(q) = &mut self.queue {
            while q.in_flight() > 0 {
                while q.next_completed().is_some() {}
                if q.in_flight() > 0 {
                    q.ready().await;
                }
            }
        }
    }

    /// Gives back a request's share of the budget.
    fn release(&mut self, units: usize) {
        self.in_flight -= 1;
        self.units -= units;
    }

    /// Queues a reply for writing.
    fn push(&mut self, reply: Reply) {
        if self.write_failed {
            self.release(reply.units);
        } else {
            self.out.push_back(reply);
        }
    }

    /// Accounts for `n` bytes written from the front of the replies.
    fn advance(&mut self, mut n: usize) {
        while n > 0 {
            let Some(front) = self.out.front() else {
                return;
            };
            let rest = front.len - self.sent;
            if n < rest {
                self.sent += n;
                return;
            }
            n -= rest;
            self.sent = 0;
            if let Some(mut r) = self.out.pop_front() {
                self.release(r.units);
                if let Some(buf) = r.data.take() {
                    self.recycle(buf);
                }
            }
        }
    }

    /// A buffer of `len` bytes for a read or a write payload: a spare one of that size, or a
    /// new (zeroed) one. Its old contents do not matter: a read fills all of it (holes with
    /// zeros), a payload is read whole from the client before it is used.
    fn buffer(&mut self, len: usize) -> io::Result<AlignedBuf> {
        match self.pool.iter().rposition(|b| b.len() == len) {
            Some(i) => {
                self.pool_bytes -= len;
                Ok(self.pool.swap_remove(i))
            }
            None => aligned(len),
        }
    }

    /// Keeps a finished request's buffer for the next ones, within [`POOL_BYTES`].
    fn recycle(&mut self, buf: AlignedBuf) {
        if !buf.is_empty() && self.pool_bytes + buf.len() <= POOL_BYTES {
            self.pool_bytes += buf.len();
            self.pool.push(buf);
        }
    }

    /// Collects what finished: the queue's completions and the tasks' replies.
    fn collect(&mut self, rx: &mut mpsc::UnboundedReceiver<Reply>) {
        while let Some((c, q)) = self.queue.as_mut().and_then(|q| q.next_completed()) {
            self.completed(c, q);
        }
        while let Ok(r) = rx.try_recv() {
            self.push(r);
        }
        while self.tasks.try_join_next().is_some() {}
    }

    /// Answers a request the queue completed.
    fn completed(&mut self, c: qimg::Completion, q: Queued) {
        let neg = self.neg;
        match q {
            Queued::Read { req, units } => {
                if let Err(e) = &c.result {
                    return self.reply(error_reply(neg, req, errno(e), &e.to_string()), units);
                }
                // The buffer comes back whole: the ring is done with it.
                let owner = c.buffers.and_then(|b| b.into_owner().ok().flatten());
                let Some(buf) = owner.and_then(|o| o.downcast::<AlignedBuf>().ok()) else {
                    let e = queue_gone();
                    return self.reply(error_reply(neg, req, errno(&e), &e.to_string()), units);
                };
                let df = req.flags & CMD_FLAG_DF != 0;
                match c.holes {
                    Some(holes) => {
                        let pieces = if df {
                            vec![(req.offset, req.len, false)]
                        } else {
                            tile_holes(req.offset, req.len, &holes)
                        };
                        let mut r = read_reply(neg, req, *buf, pieces);
                        r.units = units;
                        self.push(r);
                    }
                    // The engine ran it: its holes are the image's map.
                    None => {
                        let (export, tx) = (self.export.clone(), self.tx.clone());
                        self.tasks.spawn(async move {
                            let pieces = pieces(&export.image, req).await;
                            let mut r = read_reply(neg, req, *buf, pieces);
                            r.units = units;
                            let _ = tx.send(r);
                        });
                    }
                }
            }
            Queued::Write { req, units } => {
                let owner = c.buffers.and_then(|b| b.into_owner().ok().flatten());
                if let Some(buf) = owner.and_then(|o| o.downcast::<AlignedBuf>().ok()) {
                    self.recycle(*buf);
                }
                match c.result {
                    Err(e) => self.reply(error_reply(neg, req, errno(&e), &e.to_string()), units),
                    Ok(_) if super::execute::flush_before_reply(&self.export, req) => {
                        let (export, tx) = (self.export.clone(), self.tx.clone());
                        self.tasks.spawn(async move {
                            let done = export.image.flush().await;
                            let mut r = Reply::bytes(outcome(neg, req, done));
                            r.units = units;
                            let _ = tx.send(r);
                        });
                    }
                    Ok(_) => self.reply(success(neg, req), units),
                }
            }
        }
    }

    /// Queues a reply of header bytes for a request holding `units`.
    fn reply(&mut self, bytes: Vec<u8>, units: usize) {
        let mut r = Reply::bytes(bytes);
        r.units = units;
        self.push(r);
    }

    /// Takes the whole requests in the input, as far as the budget allows.
    fn parse(&mut self) {
        self.blocked = false;
        let neg = self.neg;
        loop {
            if let Some((_, payload, filled, _)) = &self.input.partial {
                if *filled < payload.len() {
                    return;
                }
                if let Some((req, payload, _, units)) = self.input.partial.take() {
                    self.start(req, payload, units);
                }
                continue;
            }
            let size = if neg.extended { 32 } else { 28 };
            let avail = &self.input.buf[self.input.head..self.input.tail];
            if avail.len() < size {
                return;
            }
            let hdr = &avail[..size];
            let magic = u32::from_be_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
            let expected = if neg.extended {
                EXTENDED_REQUEST_MAGIC
            } else {
                REQUEST_MAGIC
            };
            if magic != expected {
                let found = magic.into();
                let expected = expected.into();
                return self.stop(Err(Error::BadMagic { found, expected }));
            }
            let be64 =
                |at: usize| u64::from_be_bytes(hdr[at..at + 8].try_into().unwrap_or_default());
            let flags = u16::from_be_bytes([hdr[4], hdr[5]]);
            let kind = u16::from_be_bytes([hdr[6], hdr[7]]);
            let len = if neg.extended {
                be64(24)
            } else {
                u32::from_be_bytes([hdr[24], hdr[25], hdr[26], hdr[27]]).into()
            };
            let req = Request {
                flags,
                kind,
                handle: be64(8),
                offset: be64(16),
                len,
                // WRITE always has its payload: the specification asks clients to flag it
                // with extended headers, but QEMU's client does not, and qemu-nbd accepts
                // that too.
                carries: kind == CMD_WRITE || neg.extended && flags & CMD_FLAG_PAYLOAD_LEN != 0,
            };
            if req.kind == CMD_DISC {
                self.input.head += size;
                return self.stop(Ok(()));
            }
            if req.carries && req.len > u64::from(MAX_PAYLOAD) {
                // The payload cannot be skipped safely: answer, then close.
                self.input.head += size;
                self.in_flight += 1;
                self.reply(error_reply(neg, req, EINVAL, "payload over the maximum"), 0);
                let max = MAX_PAYLOAD;
                return self.stop(Err(Error::PayloadTooBig { len: req.len, max }));
            }
            let buffered = if req.carries || req.kind == CMD_READ {
                req.len.min(MAX_PAYLOAD.into()) as usize
            } else {
                0
            };
            let units = buffered / UNIT + 1;
            if self.in_flight >= MAX_IN_FLIGHT || self.units + units > IN_FLIGHT_BYTES / UNIT {
                // Taken once replies are written and give their share back.
                self.blocked = true;
                return;
            }
            self.input.head += size;
            self.in_flight += 1;
            self.units += units;
            // Aligned, so that the queue can hand it to the kernel as it is.
            let mut payload = match self.buffer(if req.carries { buffered } else { 0 }) {
                Ok(p) => p,
                Err(e) => {
                    self.release(units);
                    return self.stop(Err(e.into()));
                }
            };
            let have = (self.input.tail - self.input.head).min(payload.len());
            let from = self.input.head;
            payload[..have].copy_from_slice(&self.input.buf[from..from + have]);
            self.input.head += have;
            self.input.partial = Some((req, payload, have, units));
        }
    }

    /// Starts a request whose payload is all there.
    fn start(&mut self, req: Request, payload: AlignedBuf, units: usize) {
        let neg = self.neg;
        if let Err((e, msg)) = check(&self.export, neg, req) {
            return self.reply(error_reply(neg, req, e, &msg), units);
        }
        let payload = match self.enqueue(req, payload, units) {
            Took::Queued => return,
            Took::Failed(e, msg) => return self.reply(error_reply(neg, req, e, &msg), units),
            Took::Engine(payload) => payload,
        };
        let (export, tx) = (self.export.clone(), self.tx.clone());
        self.tasks.spawn(async move {
            let mut r = execute(&export, neg, req, payload).await;
            r.units = units;
            // The connection gone: nobody to answer.
            let _ = tx.send(r);
        });
    }

    /// Hands a command to the connection's queue, if it has one and the command is a
    /// queue's request (see the module's front).
    fn enqueue(&mut self, req: Request, payload: AlignedBuf, units: usize) -> Took {
        let (offset, len) = (req.offset, req.len);
        let request = match req.kind {
            _ if self.queue.is_none() => return Took::Engine(payload),
            CMD_READ => match self.buffer(len as usize) {
                Ok(buf) => {
                    let buffers = qimg::IoBuffers::from_aligned(buf);
                    qimg::Request::Read { offset, buffers }
                }
                Err(e) => return Took::Failed(ENOMEM, e.to_string()),
            },
            CMD_WRITE => {
                let buffers = qimg::IoBuffers::from_aligned(payload);
                qimg::Request::Write { offset, buffers }
            }
            CMD_FLUSH if !self.export.no_flush => qimg::Request::Flush,
            CMD_TRIM => qimg::Request::Discard { offset, len },
            // Without NO_HOLE the client allows holes (qemu-nbd: BDRV_REQ_MAY_UNMAP).
            CMD_WRITE_ZEROES if req.flags & CMD_FLAG_NO_HOLE == 0 => qimg::Request::WriteZeroes {
                offset,
                len,
                unmap: true,
            },
            _ => return Took::Engine(payload),
        };
        let kept = match req.kind {
            CMD_READ => Queued::Read { req, units },
            _ => Queued::Write { req, units },
        };
        let submitted = self.queue.as_mut().map(|q| q.submit(request, kept));
        match submitted {
            Some(Ok(())) => Took::Queued,
            _ => {
                let e = queue_gone();
                Took::Failed(errno(&e), e.to_string())
            }
        }
    }
}

/// Where [`Conn::enqueue`] put a request.
enum Took {
    Queued,
    /// Not taken: the errno and why.
    Failed(u32, String),
    /// Not a queue's request (or no queue): the engine runs it, with its payload.
    Engine(AlignedBuf),
}

//! The transmission phase. One task per connection reads requests from a buffer (many per
//! `read` when the client sends them back to back), checks them and starts them: reads and
//! writes go to the connection's [`qimg::Queue`] when it has one (the task collects their
//! completions itself), the other commands run as tasks of their own on the shared image and
//! hand their reply back. Replies go out in completion order, gathered into one vectored
//! write when several are ready, and a read's data is sent from the buffer it was read into.
//!
//! Memory stays bounded: a request is taken only when it fits [`MAX_IN_FLIGHT`] requests and
//! [`IN_FLIGHT_BYTES`] of payload (write data received, read data to send), and its share is
//! given back once its reply is written. When the client stops reading replies, they wait,
//! the budget runs out, and the task stops reading requests.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::sync::Arc;
use std::time::Duration;

use qimg::io::{AlignedBuf, Storage};
use qimg::{ExtentKind, Image};
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::proto::*;
use super::status::{self, Run};
use super::{BoxStream, Error, Export, IN_FLIGHT_BYTES, MAX_IN_FLIGHT, Negotiated, Shutdown};

/// Budget units are KiB.
const UNIT: usize = 1024;
/// The longest block status answered at once; the client asks again for the rest.
const MAX_STATUS_SPAN: u64 = 1 << 30;
/// Zeros written per step of a `NO_HOLE` write-zeroes.
const ZERO_CHUNK: u64 = 1 << 20;
/// Alignment of payload and read buffers: what `O_DIRECT` asks of memory on every common
/// device, so that the queue's direct path can take them.
const PAYLOAD_ALIGN: usize = 4096;
/// Bytes of requests read from the socket at once (headers, and small payloads with them).
const INPUT_BUFFER: usize = 64 << 10;
/// Pieces of replies handed to one vectored write.
const MAX_IOV: usize = 64;
/// Bytes of spare buffers a connection keeps for its next reads and writes.
const POOL_BYTES: usize = 4 << 20;
/// How long a shutdown waits for replies a client does not read.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// A zeroed buffer of `len` bytes aligned to [`PAYLOAD_ALIGN`].
fn aligned(len: usize) -> io::Result<AlignedBuf> {
    AlignedBuf::zeroed(len, PAYLOAD_ALIGN)
        .ok_or_else(|| io::Error::other(format!("cannot make a buffer of {len} bytes")))
}

/// One request as read from the wire.
#[derive(Debug, Clone, Copy)]
struct Request {
    flags: u16,
    kind: u16,
    handle: u64,
    offset: u64,
    /// Payload length (WRITE) or effect length; 64 bits with extended headers.
    len: u64,
    /// The request carries `len` bytes of payload.
    carries: bool,
}

/// A piece of a [`Reply`]: a range of its header bytes or of its data buffer.
#[derive(Debug, Clone, Copy)]
enum Seg {
    Head(usize, usize),
    Data(usize, usize),
}

/// A reply on its way to the client: header bytes and, for reads, the buffer the data was
/// read into, sent from there.
#[derive(Debug)]
struct Reply {
    head: Vec<u8>,
    data: Option<AlignedBuf>,
    /// The reply's bytes in order.
    segs: Vec<Seg>,
    /// Bytes in all.
    len: usize,
    /// Budget units of the request, given back once the reply is written.
    units: usize,
}

impl Reply {
    /// A reply of header bytes only.
    fn bytes(head: Vec<u8>) -> Self {
        let len = head.len();
        Self {
            head,
            data: None,
            segs: vec![Seg::Head(0, len)],
            len,
            units: 0,
        }
    }

    fn seg(&self, s: Seg) -> &[u8] {
        match s {
            Seg::Head(a, b) => &self.head[a..b],
            Seg::Data(a, b) => self.data.as_deref().map_or(&[][..], |d| &d[a..b]),
        }
    }
}

/// A request in the connection's queue.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
#[derive(Debug)]
enum Queued {
    Read { req: Request, units: usize },
    Write { req: Request, units: usize },
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
                    Ok(_) if self.fua(req) => {
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

    /// Whether a write must be flushed before its reply.
    fn fua(&self, req: Request) -> bool {
        let e = &self.export;
        (req.flags & CMD_FLAG_FUA != 0 || e.writethrough) && !e.no_flush
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

    /// Hands a read or write to the connection's queue, if it has one.
    fn enqueue(&mut self, req: Request, payload: AlignedBuf, units: usize) -> Took {
        if self.queue.is_none() || !matches!(req.kind, CMD_READ | CMD_WRITE) {
            return Took::Engine(payload);
        }
        let offset = req.offset;
        let (request, kept) = if req.kind == CMD_READ {
            match self.buffer(req.len as usize) {
                Ok(buf) => {
                    let buffers = qimg::IoBuffers::from_aligned(buf);
                    let request = qimg::Request::Read { offset, buffers };
                    (request, Queued::Read { req, units })
                }
                Err(e) => return Took::Failed(ENOMEM, e.to_string()),
            }
        } else {
            let buffers = qimg::IoBuffers::from_aligned(payload);
            let request = qimg::Request::Write { offset, buffers };
            (request, Queued::Write { req, units })
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

/// The pieces of the first replies in `out` (the first `sent` bytes already written) for one
/// vectored write.
fn gather<'a>(out: &'a VecDeque<Reply>, sent: usize, iov: &mut Vec<IoSlice<'a>>) {
    let mut skip = sent;
    for r in out {
        for &s in &r.segs {
            let bytes = r.seg(s);
            if skip >= bytes.len() {
                skip -= bytes.len();
                continue;
            }
            iov.push(IoSlice::new(&bytes[skip..]));
            skip = 0;
            if iov.len() == MAX_IOV {
                return;
            }
        }
    }
}

/// The error of a request a stopped queue did not take.
fn queue_gone() -> qimg::Error {
    qimg::Error::InvalidOption("the connection's request queue has stopped".into())
}

/// A successful reply without data: simple, or a `NONE` chunk with extended headers
/// (which forbid simple replies).
fn success(neg: Negotiated, req: Request) -> Vec<u8> {
    if neg.extended {
        let mut m = Vec::with_capacity(32);
        chunk(&mut m, neg, req, REPLY_FLAG_DONE, REPLY_TYPE_NONE, 0);
        return m;
    }
    simple(req.handle, 0, &[])
}

/// A simple reply.
fn simple(handle: u64, error: u32, data: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(16 + data.len());
    m.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    m.extend_from_slice(&error.to_be_bytes());
    m.extend_from_slice(&handle.to_be_bytes());
    m.extend_from_slice(data);
    m
}

/// Appends a structured (or, with extended headers, extended) reply chunk header for the
/// reply to `req`; the `len` bytes of payload follow. Payloads are at most
/// [`MAX_PAYLOAD`] plus a few headers, so they fit the 32-bit length of structured replies.
fn chunk(m: &mut Vec<u8>, neg: Negotiated, req: Request, flags: u16, kind: u16, len: usize) {
    let magic = if neg.extended {
        EXTENDED_REPLY_MAGIC
    } else {
        STRUCTURED_REPLY_MAGIC
    };
    m.extend_from_slice(&magic.to_be_bytes());
    m.extend_from_slice(&flags.to_be_bytes());
    m.extend_from_slice(&kind.to_be_bytes());
    m.extend_from_slice(&req.handle.to_be_bytes());
    if neg.extended {
        m.extend_from_slice(&req.offset.to_be_bytes());
        m.extend_from_slice(&(len as u64).to_be_bytes());
    } else {
        m.extend_from_slice(&(len as u32).to_be_bytes());
    }
}

/// The error reply: an error chunk for commands that answer in chunks, else simple.
fn error_reply(neg: Negotiated, req: Request, errno: u32, msg: &str) -> Vec<u8> {
    let chunked = neg.extended || neg.structured && matches!(req.kind, CMD_READ | CMD_BLOCK_STATUS);
    if !chunked {
        return simple(req.handle, errno, &[]);
    }
    let msg = &msg.as_bytes()[..msg.len().min(MAX_STRING)];
    let mut m = Vec::new();
    let len = 6 + msg.len();
    chunk(&mut m, neg, req, REPLY_FLAG_DONE, REPLY_TYPE_ERROR, len);
    m.extend_from_slice(&errno.to_be_bytes());
    m.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    m.extend_from_slice(msg);
    m
}

/// The NBD error of an engine error.
fn errno(e: &qimg::Error) -> u32 {
    match e {
        qimg::Error::ReadOnly { .. } => EPERM,
        qimg::Error::OutOfRange { .. } => EINVAL,
        _ => {
            let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
            while let Some(s) = src {
                if let Some(io) = s.downcast_ref::<io::Error>() {
                    match io.raw_os_error() {
                        Some(28) => return ENOSPC,
                        Some(12) => return ENOMEM,
                        _ => {}
                    }
                }
                src = s.source();
            }
            EIO
        }
    }
}

/// Checks a request against the export. `Err`: the errno and why.
fn check<S: Storage + 'static>(
    export: &Export<S>,
    neg: Negotiated,
    req: Request,
) -> Result<(), (u32, String)> {
    let allowed = match req.kind {
        CMD_READ if neg.structured => CMD_FLAG_DF,
        CMD_READ | CMD_FLUSH | CMD_CACHE => 0,
        CMD_WRITE | CMD_TRIM => CMD_FLAG_FUA,
        CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
        CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
        other => return Err((EINVAL, format!("unknown command {other}"))),
    };
    // With extended headers every command may announce a payload; only WRITE has one.
    let allowed = if neg.extended {
        allowed | CMD_FLAG_PAYLOAD_LEN
    } else {
        allowed
    };
    if req.flags & !allowed != 0 {
        let msg = format!(
            "flags {:#x} are not valid for command {}",
            req.flags, req.kind
        );
        return Err((EINVAL, msg));
    }
    if req.carries && req.kind != CMD_WRITE {
        let msg = format!("command {} does not take a payload", req.kind);
        return Err((EINVAL, msg));
    }
    let writes = matches!(req.kind, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    if writes && export.read_only {
        return Err((EPERM, "the export is read-only".into()));
    }
    if req.kind == CMD_READ && req.len > u64::from(MAX_PAYLOAD) {
        let msg = format!(
            "read of {} bytes is over the maximum of {MAX_PAYLOAD}",
            req.len
        );
        return Err((EINVAL, msg));
    }
    let size = export.image.size();
    let inside = req
        .offset
        .checked_add(req.len)
        .is_some_and(|end| end <= size);
    if req.kind != CMD_FLUSH && !inside {
        let msg = format!(
            "request of {} bytes at offset {} is past the end of the export ({size} bytes)",
            req.len, req.offset
        );
        return Err((EINVAL, msg));
    }
    if req.kind == CMD_FLUSH && (req.offset != 0 || req.len != 0) {
        return Err((EINVAL, "flush must have offset and length 0".into()));
    }
    if req.kind == CMD_BLOCK_STATUS {
        if !(neg.base_allocation || neg.allocation_depth || neg.bitmaps != 0) {
            return Err((EINVAL, "no metadata context was selected".into()));
        }
        if req.len == 0 {
            return Err((EINVAL, "block status of 0 bytes".into()));
        }
    }
    if req.kind == CMD_WRITE_ZEROES
        && req.flags & CMD_FLAG_FAST_ZERO != 0
        && req.flags & CMD_FLAG_NO_HOLE != 0
    {
        return Err((
            ENOTSUP,
            "zeroing without holes writes data: not fast".into(),
        ));
    }
    Ok(())
}

/// Runs one request on the image (not through a queue) and builds its reply.
async fn execute<S: Storage + 'static>(
    export: &Export<S>,
    neg: Negotiated,
    req: Request,
    payload: AlignedBuf,
) -> Reply {
    let img = &export.image;
    let fua = req.flags & CMD_FLAG_FUA != 0 || export.writethrough;
    let (offset, len) = (req.offset, req.len);
    let done = match req.kind {
        CMD_READ => return read(img, neg, req).await,
        CMD_BLOCK_STATUS => return Reply::bytes(block_status(export, img, neg, req).await),
        CMD_WRITE => img.write(&payload, offset).await,
        CMD_FLUSH if export.no_flush => Ok(()),
        CMD_FLUSH => img.flush().await,
        CMD_TRIM => img.discard(offset, len).await,
        // Advisory: the first span only, so that the mapping stays bounded.
        CMD_CACHE => img.map(offset, len.min(MAX_STATUS_SPAN)).await.map(drop),
        CMD_WRITE_ZEROES if req.flags & CMD_FLAG_NO_HOLE != 0 => {
            write_zeros_as_data(img, offset, len).await
        }
        // Without NO_HOLE the client allows holes (qemu-nbd: BDRV_REQ_MAY_UNMAP).
        _ => img.write_zeroes_unmap(offset, len).await,
    };
    let done = match done {
        Ok(()) if fua && req.kind != CMD_FLUSH && req.kind != CMD_CACHE && !export.no_flush => {
            img.flush().await
        }
        other => other,
    };
    Reply::bytes(outcome(neg, req, done))
}

/// The reply of a request without data, from its outcome.
fn outcome(neg: Negotiated, req: Request, done: qimg::Result<()>) -> Vec<u8> {
    match done {
        Ok(()) => success(neg, req),
        Err(e) => error_reply(neg, req, errno(&e), &e.to_string()),
    }
}

/// `NBD_CMD_READ` on the image: simple reply, or data and hole chunks.
async fn read<S: Storage + 'static>(img: &Image<S>, neg: Negotiated, req: Request) -> Reply {
    let len = req.len as usize;
    let mut buf = match aligned(len) {
        Ok(buf) => buf,
        Err(e) => return Reply::bytes(error_reply(neg, req, ENOMEM, &e.to_string())),
    };
    if let Err(e) = img.read(&mut buf, req.offset).await {
        return Reply::bytes(error_reply(neg, req, errno(&e), &e.to_string()));
    }
    let pieces = if neg.structured && req.flags & CMD_FLAG_DF == 0 {
        pieces(img, req).await
    } else {
        vec![(req.offset, req.len, false)]
    };
    read_reply(neg, req, buf, pieces)
}

/// The `(start, length, hole)` pieces of a read from the image's map: holes are zero
/// clusters, and unallocated ones without a backing file. All data if the map fails.
async fn pieces<S: Storage + 'static>(img: &Image<S>, req: Request) -> Vec<(u64, u64, bool)> {
    let mut pieces: Vec<(u64, u64, bool)> = Vec::new();
    let Ok(extents) = img.map(req.offset, req.len).await else {
        return vec![(req.offset, req.len, false)];
    };
    for e in extents {
        let hole = match e.kind {
            ExtentKind::Zero { .. } => true,
            ExtentKind::Unallocated { .. } => img.backing().is_none(),
            _ => false,
        };
        match pieces.last_mut() {
            Some(last) if last.2 == hole => last.1 += e.length,
            _ => pieces.push((e.start, e.length, hole)),
        }
    }
    pieces
}

/// The reply to a read of `buf` (the `req.len` bytes at `req.offset`): simple, or a data or
/// hole chunk for each of `pieces`, the data sent from `buf`.
fn read_reply(
    neg: Negotiated,
    req: Request,
    buf: AlignedBuf,
    pieces: Vec<(u64, u64, bool)>,
) -> Reply {
    let mut head = Vec::with_capacity(32 + 32 * pieces.len());
    let mut segs = Vec::with_capacity(2 * pieces.len() + 1);
    if !neg.structured {
        head = simple(req.handle, 0, &[]);
        segs.push(Seg::Head(0, head.len()));
        segs.push(Seg::Data(0, buf.len()));
        return finish(head, buf, segs);
    }
    if buf.is_empty() {
        chunk(&mut head, neg, req, REPLY_FLAG_DONE, REPLY_TYPE_NONE, 0);
        return Reply::bytes(head);
    }
    // The chunks must tile the request exactly (and index `buf` safely): if the pieces do
    // not, everything goes as one data chunk rather than a wrong reply.
    let mut at = req.offset;
    let tiles = pieces.iter().all(|&(start, length, _)| {
        let ok = start == at && length > 0;
        at = start.saturating_add(length);
        ok
    });
    let pieces = if tiles && at == req.offset + req.len {
        pieces
    } else {
        vec![(req.offset, req.len, false)]
    };
    let last = pieces.len() - 1;
    let mut mark = 0;
    for (i, (start, length, hole)) in pieces.into_iter().enumerate() {
        let flags = if i == last { REPLY_FLAG_DONE } else { 0 };
        if hole {
            chunk(&mut head, neg, req, flags, REPLY_TYPE_OFFSET_HOLE, 12);
            head.extend_from_slice(&start.to_be_bytes());
            head.extend_from_slice(&(length as u32).to_be_bytes());
        } else {
            let from = (start - req.offset) as usize;
            let len = 8 + length as usize;
            chunk(&mut head, neg, req, flags, REPLY_TYPE_OFFSET_DATA, len);
            head.extend_from_slice(&start.to_be_bytes());
            segs.push(Seg::Head(mark, head.len()));
            segs.push(Seg::Data(from, from + length as usize));
            mark = head.len();
        }
    }
    if mark < head.len() {
        segs.push(Seg::Head(mark, head.len()));
    }
    finish(head, buf, segs)
}

/// A reply of `head` and `data` in the order of `segs`.
fn finish(head: Vec<u8>, data: AlignedBuf, segs: Vec<Seg>) -> Reply {
    let len = segs
        .iter()
        .map(|&s| match s {
            Seg::Head(a, b) | Seg::Data(a, b) => b - a,
        })
        .sum();
    Reply {
        head,
        data: Some(data),
        segs,
        len,
        units: 0,
    }
}

/// Zeros that stay allocated (`NO_HOLE`): written as data.
async fn write_zeros_as_data<S: Storage + 'static>(
    img: &Image<S>,
    offset: u64,
    len: u64,
) -> qimg::Result<()> {
    let zeros = vec![0u8; len.min(ZERO_CHUNK) as usize];
    let mut at = 0;
    while at < len {
        let n = (len - at).min(ZERO_CHUNK);
        img.write(&zeros[..n as usize], offset + at).await?;
        at += n;
    }
    Ok(())
}

/// The `(start, length, hole)` pieces tiling `[offset, offset + len)`, given the hole ranges
/// `(position, length)` of a read in order.
fn tile_holes(offset: u64, len: u64, holes: &[(usize, usize)]) -> Vec<(u64, u64, bool)> {
    let mut pieces: Vec<(u64, u64, bool)> = Vec::new();
    let mut push = |start: u64, length: u64, hole: bool| {
        if length == 0 {
            return;
        }
        match pieces.last_mut() {
            Some(last) if last.2 == hole && last.0 + last.1 == start => last.1 += length,
            _ => pieces.push((start, length, hole)),
        }
    };
    let mut at = 0u64;
    for &(pos, n) in holes {
        let (pos, n) = (pos as u64, n as u64);
        if pos < at || pos + n > len {
            // Not in order or not inside: the caller falls back to all data.
            return vec![(offset, len, false)];
        }
        push(offset + at, pos - at, false);
        push(offset + pos, n, true);
        at = pos + n;
    }
    push(offset + at, len - at, false);
    pieces
}

/// `NBD_CMD_BLOCK_STATUS`: one chunk per selected context.
async fn block_status<S: Storage + 'static>(
    export: &Export<S>,
    img: &Image<S>,
    neg: Negotiated,
    req: Request,
) -> Vec<u8> {
    let len = req.len.min(MAX_STATUS_SPAN);
    let mut runs: Vec<Run> = Vec::new();
    if neg.base_allocation || neg.allocation_depth {
        if let Err(e) = status::layer(img, 1, req.offset, len, &mut runs).await {
            return error_reply(neg, req, errno(&e), &e.to_string());
        }
    }
    let one = req.flags & CMD_FLAG_REQ_ONE != 0;
    let mut contexts: Vec<(u32, Vec<(u64, u32)>)> = Vec::new();
    if neg.base_allocation {
        contexts.push((CTX_ID_BASE, status::descriptors(&runs, |r| r.flags)));
    }
    if neg.allocation_depth {
        contexts.push((CTX_ID_DEPTH, status::descriptors(&runs, |r| r.depth)));
    }
    let end = (req.offset + len).min(img.size());
    for (i, name) in export.bitmaps.iter().enumerate().take(32) {
        if neg.bitmaps & 1 << i == 0 {
            continue;
        }
        let source = export.bitmap_source.as_ref().unwrap_or(img);
        match source.bitmap_extents(name, req.offset, len).await {
            Ok(dirty) => contexts.push((
                CTX_ID_BITMAP + i as u32,
                status::dirty_descriptors(&dirty, req.offset, end),
            )),
            Err(e) => return error_reply(neg, req, errno(&e), &e.to_string()),
        }
    }
    let mut m = Vec::new();
    let last = contexts.len() - 1;
    for (i, (id, mut descs)) in contexts.into_iter().enumerate() {
        if one {
            descs.truncate(1);
        }
        let flags = if i == last { REPLY_FLAG_DONE } else { 0 };
        if neg.extended {
            let len = 8 + 16 * descs.len();
            chunk(&mut m, neg, req, flags, REPLY_TYPE_BLOCK_STATUS_EXT, len);
            m.extend_from_slice(&id.to_be_bytes());
            m.extend_from_slice(&(descs.len() as u32).to_be_bytes());
            for (length, value) in descs {
                m.extend_from_slice(&length.to_be_bytes());
                m.extend_from_slice(&u64::from(value).to_be_bytes());
            }
        } else {
            let len = 4 + 8 * descs.len();
            chunk(&mut m, neg, req, flags, REPLY_TYPE_BLOCK_STATUS, len);
            m.extend_from_slice(&id.to_be_bytes());
            for (length, value) in descs {
                // Each run is within MAX_STATUS_SPAN (1 GiB), so it fits a u32.
                m.extend_from_slice(&(length as u32).to_be_bytes());
                m.extend_from_slice(&value.to_be_bytes());
            }
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::tile_holes;

    #[test]
    fn holes_tile_a_read_in_order_and_merge() {
        let o = 1 << 20;
        assert_eq!(tile_holes(o, 16384, &[]), [(o, 16384, false)]);
        assert_eq!(
            tile_holes(o, 16384, &[(4096, 2048), (6144, 2048)]),
            [
                (o, 4096, false),
                (o + 4096, 4096, true),
                (o + 8192, 8192, false)
            ]
        );
        assert_eq!(tile_holes(o, 8192, &[(0, 8192)]), [(o, 8192, true)]);
        // Out of order or past the end: all data, never a wrong reply.
        assert_eq!(
            tile_holes(o, 8192, &[(4096, 1024), (0, 1024)]),
            [(o, 8192, false)]
        );
        assert_eq!(tile_holes(o, 8192, &[(4096, 8192)]), [(o, 8192, false)]);
    }
}

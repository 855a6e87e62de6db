//! A vhost-user-blk device backend on the qimg engine: `qimg serve --vhost-user-blk`.
//!
//! A VMM (cloud-hypervisor, QEMU, Firecracker) connects to a unix socket, hands over its guest
//! memory and virtqueues, and the backend serves them: one thread per virtqueue (rust-vmm's
//! `vhost-user-backend` epoll loops), each driving one [`qimg::Queue`] (its own io_uring ring
//! and eventfd). A request's guest memory goes to the engine in place
//! ([`qimg::IoBuffers::from_guest`]): reads and in-place writes whose metadata is cached go from
//! the queue's thread straight to the kernel; the rest runs on the queue's engine thread, and
//! its completion comes back through the same epoll loop.
//!
//! Guest input is untrusted: [`request::parse`] checks every chain, and a bad one gets a
//! virtio error status. One frontend is served at a time; after it disconnects the backend
//! waits for the next one (a restarted VMM reconnects), with the same open image.

pub mod request;

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use qimg::io::AnyStorage;
use qimg::{Image, IoBuffers, Queue, QueueOptions, Request};
use vhost::vhost_user::Listener;
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VhostUserDaemon, VringRwLock, VringT};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_CONFIG_WCE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH,
    VIRTIO_BLK_F_MQ, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_TOPOLOGY,
    VIRTIO_BLK_F_WRITE_ZEROES, VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use virtio_queue::QueueOwnedT;
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;

use self::request::{BlkRequest, Desc, Limits, SECTOR, parse};

type Mem = GuestMemoryAtomic<GuestMemoryMmap<()>>;

/// Offset of `writeback` in `struct virtio_blk_config`.
const WRITEBACK_AT: usize = 32;

/// Virtqueue size the backend offers.
pub const QUEUE_SIZE: u16 = 1024;
/// Most data segments in one request (`seg_max`).
pub const SEG_MAX: u32 = 126;
/// Most bytes in one read or write.
pub const MAX_REQUEST: u64 = 32 << 20;
/// Most sectors in one discard or write-zeroes segment.
pub const MAX_ZERO_SECTORS: u32 = (1 << 30) / 512;

/// Errors of the vhost-user-blk backend.
#[derive(Debug, thiserror::Error)]
pub enum VhostError {
    /// An option is impossible.
    #[error("{0}")]
    Option(String),
    /// The socket could not be set up.
    #[error("cannot listen on vhost-user socket '{path}': {reason}")]
    Listen {
        /// The socket path.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The daemon failed.
    #[error("vhost-user daemon: {0}")]
    Daemon(String),
    /// The engine refused something.
    #[error(transparent)]
    Engine(#[from] qimg::Error),
}

/// What the device looks like to the guest.
#[derive(Debug, Clone)]
pub struct BlkOptions {
    /// Virtqueues (1..=64).
    pub num_queues: u16,
    /// Refuse writes (and advertise `VIRTIO_BLK_F_RO`).
    pub read_only: bool,
    /// The id `VIRTIO_BLK_T_GET_ID` returns (at most 20 bytes).
    pub serial: String,
    /// Logical block size: 512 or 4096.
    pub logical_block_size: u32,
    /// Depth of each queue's io_uring ring.
    pub ring_depth: u32,
    /// Start without a volatile write cache (cache modes `writethrough`, `directsync`): a
    /// write or write-zeroes completes only once it is durable, as if the guest had flushed
    /// after it. The guest may change it through the `writeback` config field
    /// (`VIRTIO_BLK_F_CONFIG_WCE`), as with QEMU; a guest that does not negotiate
    /// `VIRTIO_BLK_F_FLUSH` always gets write-through.
    pub writethrough: bool,
    /// Ignore flushes (cache mode `unsafe`): nothing is made durable before the image closes.
    pub no_flush: bool,
}

impl Default for BlkOptions {
    fn default() -> Self {
        BlkOptions {
            num_queues: 1,
            read_only: false,
            serial: String::new(),
            logical_block_size: 512,
            ring_depth: 128,
            writethrough: false,
            no_flush: false,
        }
    }
}

impl BlkOptions {
    /// Refuses impossible options, naming the value.
    pub fn check(&self) -> Result<(), VhostError> {
        if !(1..=64).contains(&self.num_queues) {
            return Err(VhostError::Option(format!(
                "--num-queues {}: must be 1 to 64",
                self.num_queues
            )));
        }
        if !matches!(self.logical_block_size, 512 | 4096) {
            return Err(VhostError::Option(format!(
                "--logical-block-size {}: must be 512 or 4096",
                self.logical_block_size
            )));
        }
        if self.serial.len() > VIRTIO_BLK_ID_BYTES as usize {
            return Err(VhostError::Option(format!(
                "--serial {:?}: at most {VIRTIO_BLK_ID_BYTES} bytes",
                self.serial
            )));
        }
        Ok(())
    }
}

/// A request between submission and completion.
struct InFlight {
    head: u16,
    status: u64,
    used: u32,
    /// The connection it came from: completions of an earlier one are dropped.
    generation: u64,
    /// A write submitted while the device was write-through: its answer waits for a flush.
    durable: bool,
    /// For a flush the device added after write-through writes: the answers that wait for
    /// it, `(head, status address, used length)`.
    then: Vec<(u16, u64, u32)>,
}

/// One virtqueue's engine queue and requests in flight.
struct QueueState {
    queue: Queue<AnyStorage>,
    pending: HashMap<u64, InFlight>,
    next: u64,
}

/// What every connection's backend shares: the image, one engine queue per virtqueue.
struct Device {
    options: BlkOptions,
    limits: Limits,
    cluster_size: u64,
    subcluster_size: u64,
    queues: Vec<Mutex<QueueState>>,
    generation: AtomicU64,
    /// The guest-visible `writeback` config field: false when writes must be durable before
    /// they complete.
    write_cache: AtomicBool,
}

/// The `VhostUserBackend` of one connection.
struct Backend {
    device: Arc<Device>,
    mem: Mem,
    event_idx: AtomicBool,
    generation: u64,
}

impl Device {
    fn features(&self) -> u64 {
        let mut f = 1 << VIRTIO_F_VERSION_1
            | 1 << VIRTIO_RING_F_INDIRECT_DESC
            | 1 << VIRTIO_RING_F_EVENT_IDX
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
            | 1 << VIRTIO_BLK_F_SEG_MAX
            | 1 << VIRTIO_BLK_F_BLK_SIZE
            | 1 << VIRTIO_BLK_F_FLUSH
            | 1 << VIRTIO_BLK_F_TOPOLOGY
            | 1 << VIRTIO_BLK_F_MQ;
        if !self.options.no_flush {
            f |= 1 << VIRTIO_BLK_F_CONFIG_WCE;
        }
        if self.options.read_only {
            f |= 1 << VIRTIO_BLK_F_RO;
        } else {
            f |= 1 << VIRTIO_BLK_F_DISCARD | 1 << VIRTIO_BLK_F_WRITE_ZEROES;
        }
        f
    }

    /// `struct virtio_blk_config`, little-endian, 60 bytes.
    fn config(&self) -> Vec<u8> {
        let mut c = vec![0u8; 60];
        let bs = self.options.logical_block_size;
        let put32 =
            |c: &mut [u8], at: usize, v: u32| c[at..at + 4].copy_from_slice(&v.to_le_bytes());
        c[0..8].copy_from_slice(&(self.limits.capacity / SECTOR).to_le_bytes());
        put32(&mut c, 12, SEG_MAX);
        put32(&mut c, 20, bs);
        // Topology: one logical block per physical block; the cluster is the optimal I/O size.
        c[26..28].copy_from_slice(&1u16.to_le_bytes());
        put32(
            &mut c,
            28,
            (self.cluster_size / u64::from(bs)).max(1) as u32,
        );
        c[WRITEBACK_AT] = u8::from(self.write_cache.load(Ordering::Acquire));
        c[34..36].copy_from_slice(&self.options.num_queues.to_le_bytes());
        put32(&mut c, 36, MAX_ZERO_SECTORS);
        put32(&mut c, 40, 1);
        // Discard works on whole subclusters.
        put32(&mut c, 44, (self.subcluster_size / SECTOR).max(1) as u32);
        put32(&mut c, 48, MAX_ZERO_SECTORS);
        put32(&mut c, 52, 1);
        c[56] = 1;
        c
    }
}

impl Backend {
    /// Takes every available chain of virtqueue `q` and submits it.
    fn process_queue(&self, q: usize, vring: &VringRwLock<Mem>) -> io::Result<()> {
        let mem = self.mem.memory();
        let event_idx = self.event_idx.load(Ordering::Acquire);
        let mut state = self.device.queues[q]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut answered = false;
        loop {
            if event_idx {
                vring.disable_notification().map_err(io::Error::other)?;
            }
            let chains: Vec<_> = {
                let mut v = vring.get_mut();
                match v.get_queue_mut().iter(mem.clone()) {
                    Ok(iter) => iter.collect(),
                    Err(e) => return Err(io::Error::other(e)),
                }
            };
            // The chains' engine requests, handed to the queue at once below (one
            // `io_uring_enter` for all of them).
            let mut batch = Vec::new();
            for chain in chains {
                let head = chain.head_index();
                let descs: Vec<Desc> = chain
                    .clone()
                    .take(SEG_MAX as usize + 3)
                    .map(|d| Desc {
                        addr: d.addr().0,
                        len: d.len(),
                        write_only: d.is_write_only(),
                    })
                    .collect();
                let too_long = chain.count() > descs.len();
                let parsed = if too_long {
                    request::Parsed {
                        request: Err(VIRTIO_BLK_S_IOERR as u8),
                        status: None,
                    }
                } else {
                    parse(&*mem, &descs, &self.device.limits)
                };
                if let Some(done) = self.start(&mut state, &mem, head, parsed, &mut batch) {
                    let (status, used) = done;
                    if let Some(at) = status {
                        let _ = mem.write_obj(used.1, GuestAddress(at));
                    }
                    vring.add_used(head, used.0).map_err(io::Error::other)?;
                    answered = true;
                }
            }
            if !batch.is_empty() {
                // A batch the queue refused (its engine thread is gone; the tokens are
                // counters, never in flight twice) never completes: answer it now.
                if let Err(refused) = state.queue.submit_batch(batch) {
                    for (_, token) in refused.requests {
                        if let Some(p) = state.pending.remove(&token) {
                            let _ = mem.write_obj(VIRTIO_BLK_S_IOERR as u8, GuestAddress(p.status));
                            vring.add_used(p.head, 1).map_err(io::Error::other)?;
                            answered = true;
                        }
                    }
                }
            }
            if !event_idx || !vring.enable_notification().map_err(io::Error::other)? {
                break;
            }
        }
        if answered && vring.needs_notification().map_err(io::Error::other)? {
            vring.signal_used_queue()?;
        }
        Ok(())
    }

    /// Starts one parsed request: adds it to `batch` for the engine queue, or answers it at
    /// once, returning `(status address, (used length, status))`.
    #[allow(clippy::type_complexity)]
    fn start(
        &self,
        state: &mut QueueState,
        mem: &GuestMemoryLoadGuardOf,
        head: u16,
        parsed: request::Parsed,
        batch: &mut Vec<(Request, u64)>,
    ) -> Option<(Option<u64>, (u32, u8))> {
        let status = parsed.status;
        let req = match parsed.request {
            Err(code) => return Some((status, (u32::from(status.is_some()), code))),
            Ok(r) => r,
        };
        let status_at = status?;
        let used = req.device_writes() as u32 + 1;
        let durable = matches!(
            req,
            BlkRequest::Write { .. } | BlkRequest::WriteZeroes { .. }
        ) && !self.device.write_cache.load(Ordering::Acquire)
            && !self.device.options.no_flush;
        let engine_req = match req {
            BlkRequest::GetId { data } => {
                let mut id = [0u8; VIRTIO_BLK_ID_BYTES as usize];
                let serial = self.device.options.serial.as_bytes();
                id[..serial.len()].copy_from_slice(serial);
                let mut done = 0usize;
                for (addr, n) in &data {
                    if mem
                        .write_slice(&id[done..done + n], GuestAddress(*addr))
                        .is_err()
                    {
                        return Some((status, (1, VIRTIO_BLK_S_IOERR as u8)));
                    }
                    done += n;
                }
                return Some((status, (done as u32 + 1, VIRTIO_BLK_S_OK as u8)));
            }
            BlkRequest::Read { offset, data } => {
                match IoBuffers::from_guest(mem.clone().into_inner(), &data) {
                    Ok(buffers) => Request::Read { offset, buffers },
                    Err(_) => return Some((status, (1, VIRTIO_BLK_S_IOERR as u8))),
                }
            }
            BlkRequest::Write { offset, data } => {
                match IoBuffers::from_guest(mem.clone().into_inner(), &data) {
                    Ok(buffers) => Request::Write { offset, buffers },
                    Err(_) => return Some((status, (1, VIRTIO_BLK_S_IOERR as u8))),
                }
            }
            BlkRequest::Flush if self.device.options.no_flush => {
                return Some((status, (1, VIRTIO_BLK_S_OK as u8)));
            }
            BlkRequest::Flush => Request::Flush,
            BlkRequest::Discard { ranges } => {
                let (offset, len) = ranges[0];
                Request::Discard { offset, len }
            }
            BlkRequest::WriteZeroes { ranges, unmap } => {
                let (offset, len) = ranges[0];
                Request::WriteZeroes { offset, len, unmap }
            }
        };
        state.next += 1;
        let token = state.next;
        state.pending.insert(
            token,
            InFlight {
                head,
                status: status_at,
                used,
                generation: self.generation,
                durable,
                then: Vec::new(),
            },
        );
        batch.push((engine_req, token));
        None
    }

    /// Collects virtqueue `q`'s completions and answers them. Write-through writes are
    /// answered after a flush the device submits for all of them at once.
    fn complete(&self, q: usize, vring: &VringRwLock<Mem>) -> io::Result<()> {
        let mem = self.mem.memory();
        let mut state = self.device.queues[q]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let _ = state.queue.notifier().drain();
        let mut answered = false;
        let mut waiting = Vec::new();
        while let Some(c) = state.queue.next_completed() {
            let Some(p) = state.pending.remove(&c.user_data) else {
                continue;
            };
            if p.generation != self.generation {
                continue;
            }
            let ok = c.result.is_ok();
            if ok && p.durable {
                waiting.push((p.head, p.status, p.used));
                continue;
            }
            let answers = std::iter::once((p.head, p.status, p.used)).chain(p.then);
            for (head, status, used) in answers {
                let (code, used) = match ok {
                    true => (VIRTIO_BLK_S_OK, used),
                    false => (VIRTIO_BLK_S_IOERR, 1),
                };
                let _ = mem.write_obj(code as u8, GuestAddress(status));
                vring.add_used(head, used).map_err(io::Error::other)?;
                answered = true;
            }
        }
        if !waiting.is_empty() {
            // One flush makes every write completed before it durable (group commit): it
            // answers for the first write, the others ride along.
            state.next += 1;
            let token = state.next;
            let rest = waiting.split_off(1);
            let first = waiting[0];
            state.pending.insert(
                token,
                InFlight {
                    head: first.0,
                    status: first.1,
                    used: first.2,
                    generation: self.generation,
                    durable: false,
                    then: rest,
                },
            );
            if state.queue.submit(Request::Flush, token).is_err() {
                let p = state.pending.remove(&token).expect("just inserted");
                for (head, status, _) in std::iter::once(first).chain(p.then) {
                    let _ = mem.write_obj(VIRTIO_BLK_S_IOERR as u8, GuestAddress(status));
                    vring.add_used(head, 1).map_err(io::Error::other)?;
                }
                answered = true;
            }
        }
        if answered && vring.needs_notification().map_err(io::Error::other)? {
            vring.signal_used_queue()?;
        }
        Ok(())
    }
}

type GuestMemoryLoadGuardOf = vm_memory::GuestMemoryLoadGuard<GuestMemoryMmap<()>>;

impl VhostUserBackend for Backend {
    type Bitmap = ();
    type Vring = VringRwLock<Mem>;

    fn num_queues(&self) -> usize {
        usize::from(self.device.options.num_queues)
    }

    fn max_queue_size(&self) -> usize {
        usize::from(QUEUE_SIZE)
    }

    fn features(&self) -> u64 {
        self.device.features()
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, Ordering::Release);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let c = self.device.config();
        let start = (offset as usize).min(c.len());
        let end = start.saturating_add(size as usize).min(c.len());
        let mut out = c[start..end].to_vec();
        out.resize(size as usize, 0);
        out
    }

    fn set_config(&self, offset: u32, buf: &[u8]) -> io::Result<()> {
        // Only `writeback` is writable (with VIRTIO_BLK_F_CONFIG_WCE); the rest is ignored,
        // as QEMU does.
        let at = (WRITEBACK_AT as u64).checked_sub(u64::from(offset));
        if let Some(&v) = at.and_then(|at| buf.get(at as usize)) {
            if !self.device.options.no_flush {
                self.device.write_cache.store(v != 0, Ordering::Release);
            }
        }
        Ok(())
    }

    fn acked_features(&self, features: u64) {
        // A driver without flush has no way to make writes durable: the device is then
        // write-through (virtio 1.2, 5.2.5.1), as QEMU's.
        if features & 1 << VIRTIO_BLK_F_FLUSH == 0 {
            self.device.write_cache.store(false, Ordering::Release);
        }
    }

    fn update_memory(&self, _mem: Mem) -> io::Result<()> {
        // The daemon updates the atomic we share with it; nothing else to do.
        Ok(())
    }

    fn exit_event(
        &self,
        _thread_index: usize,
    ) -> Option<(
        vmm_sys_util::event::EventConsumer,
        vmm_sys_util::event::EventNotifier,
    )> {
        // Without one, a queue thread never ends and dropping the daemon waits forever.
        use vmm_sys_util::event::{EventFlag, new_event_consumer_and_notifier};
        new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC).ok()
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.device.options.num_queues)
            .map(|q| 1u64 << q)
            .collect()
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[Self::Vring],
        thread_id: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            return Err(io::Error::other(format!("unexpected event set {evset:?}")));
        }
        let n = usize::from(self.device.options.num_queues);
        // Each thread serves one virtqueue: `vrings` holds just that one.
        let Some(vring) = vrings.first() else {
            return Ok(());
        };
        let q = thread_id;
        let r = if usize::from(device_event) < n {
            self.process_queue(q, vring)
        } else if usize::from(device_event) == n + 1 + q {
            self.complete(q, vring)
        } else {
            Ok(())
        };
        // An error here comes from the guest's rings (a queue not ready, a used ring the
        // guest broke): the queue thread must keep serving, so it is reported, not returned
        // (an error would end the thread and with it the virtqueue).
        if let Err(e) = r {
            eprintln!("qimg: vhost-user-blk queue {q}: {e}");
        }
        Ok(())
    }
}

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
fn serve_one(device: &Arc<Device>, bound: &mut Bound, stop: &Stop) -> Result<(), VhostError> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn backend(options: BlkOptions) -> Backend {
        let device = Device {
            limits: Limits {
                capacity: 1 << 20,
                block_size: 512,
                read_only: false,
                max_segments: 1,
                max_bytes: 1 << 20,
                max_zero_sectors: 1,
                max_zero_segments: 1,
            },
            cluster_size: 65536,
            subcluster_size: 2048,
            write_cache: AtomicBool::new(!options.writethrough),
            options,
            queues: Vec::new(),
            generation: AtomicU64::new(0),
        };
        Backend {
            device: Arc::new(device),
            mem: GuestMemoryAtomic::new(GuestMemoryMmap::new()),
            event_idx: AtomicBool::new(false),
            generation: 1,
        }
    }

    fn writeback(b: &Backend) -> u8 {
        b.get_config(WRITEBACK_AT as u32, 1)[0]
    }

    #[test]
    fn the_guest_sees_and_switches_the_write_cache() {
        let b = backend(BlkOptions::default());
        assert_ne!(b.features() & 1 << VIRTIO_BLK_F_CONFIG_WCE, 0);
        assert_eq!(writeback(&b), 1);
        b.set_config(WRITEBACK_AT as u32, &[0]).unwrap();
        assert_eq!(writeback(&b), 0);
        // A write of the whole config space changes only `writeback`.
        let mut c = b.get_config(0, 60);
        c[WRITEBACK_AT] = 1;
        c[0] = 0xff;
        b.set_config(0, &c).unwrap();
        assert_eq!(writeback(&b), 1);
        assert_eq!(b.get_config(0, 8), (1u64 << 20 >> 9).to_le_bytes());
        // Writes past it leave it alone.
        b.set_config(WRITEBACK_AT as u32 + 1, &[0, 0]).unwrap();
        assert_eq!(writeback(&b), 1);
    }

    #[test]
    fn writethrough_starts_without_a_write_cache_and_a_driver_without_flush_gets_none() {
        let b = backend(BlkOptions {
            writethrough: true,
            ..Default::default()
        });
        assert_eq!(writeback(&b), 0);
        let b = backend(BlkOptions::default());
        b.acked_features(b.features() & !(1 << VIRTIO_BLK_F_FLUSH));
        assert_eq!(writeback(&b), 0);
        // `unsafe` has no cache to switch: the feature is not offered.
        let b = backend(BlkOptions {
            no_flush: true,
            ..Default::default()
        });
        assert_eq!(b.features() & 1 << VIRTIO_BLK_F_CONFIG_WCE, 0);
    }
}

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

mod daemon;
pub mod request;
mod virtqueue;

pub use daemon::{Bound, Stop, bind, serve};

use std::collections::HashMap;
use std::io;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use qimg::Queue;
use qimg::io::AnyStorage;
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VringRwLock};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_CONFIG_WCE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH,
    VIRTIO_BLK_F_MQ, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_TOPOLOGY,
    VIRTIO_BLK_F_WRITE_ZEROES, VIRTIO_BLK_ID_BYTES,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;

use self::request::{Limits, SECTOR};

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
    /// Errors reported on stderr so far (at most [`LOGGED_ERRORS`]: a guest cannot flood it).
    logged: u32,
}

/// Most errors one virtqueue reports on stderr.
const LOGGED_ERRORS: u32 = 16;

impl QueueState {
    /// Reports why a request of virtqueue `q` failed, up to [`LOGGED_ERRORS`] times.
    fn report(&mut self, q: usize, what: &dyn std::fmt::Display) {
        self.logged = self.logged.saturating_add(1);
        if self.logged <= LOGGED_ERRORS {
            eprintln!("qimg: vhost-user-blk queue {q}: request failed: {what}");
        }
        if self.logged == LOGGED_ERRORS {
            eprintln!("qimg: vhost-user-blk queue {q}: further errors are not reported");
        }
    }
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

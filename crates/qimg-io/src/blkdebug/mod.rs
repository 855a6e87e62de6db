//! [`BlkdebugStorage`]: I/O errors injected at named points of the image format's work, as
//! QEMU's `blkdebug` driver injects them, for users who test how their stack handles a failed
//! write of an L2 table, a full disk during a refcount block allocation, a failed flush.
//!
//! The format engine announces what its next requests are for ([`Storage::debug_event`]:
//! [`DebugEvent::L2Update`] before it writes back an L2 table, [`DebugEvent::WriteAio`] before
//! guest data, ...). A [`BlkdebugConfig`] holds QEMU's rules:
//!
//! * `inject-error`: when `event` happens (in `state`, if given), the rule becomes *active*:
//!   every later request of its I/O types (reads, writes, write-zeroes, discards and flushes
//!   unless `iotype` names one) that covers `sector` (any request if not given) fails with
//!   `errno` (`EIO` by default). With `once` the first such failure removes the rule for good;
//!   without it the rule stays active until an event activates other `inject-error` rules.
//! * `set-state`: when `event` happens (in `state`, if given), the state becomes `new_state`.
//!   The state starts at 1.
//!
//! Rules for one event apply in the reverse order of their definition, and the first active
//! rule that matches a request decides, as in QEMU. A config comes from QEMU's config file
//! format ([`BlkdebugConfig::parse_file`], for `blkdebug:CONFIG:IMAGE` names) or from the
//! dotted options of a `json:` name or `--image-opts`
//! ([`BlkdebugConfig::from_options`]: `inject-error.0.event=l2_update,...`).
//!
//! [`FaultyStorage`](crate::FaultyStorage) serves the engine's own crash tests: it counts
//! operations and keeps a model of the durable image in memory (a copy of the whole file).
//! This wrapper keeps only its rules and works on a file of any size, which is what a
//! command-line user of `blkdebug` needs.

use std::io::{self, IoSlice};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

mod breakpoints;
pub use breakpoints::{Breakpoints, NoSuchBreakpoint, set_reporter};

use crate::error::{Op, Result, StorageError};
use crate::storage::{AllocateOutcome, DiscardOutcome, Storage, ZeroOutcome};

macro_rules! events {
    ($($variant:ident = $name:literal,)*) => {
        /// A point of the format engine's work that [`BlkdebugStorage`] rules can name, with
        /// QEMU's names (`l2_update`, `write_aio`, ...). qimg's engine announces the events
        /// listed on [`Storage::debug_event`]; the others are accepted in rules and never
        /// happen.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum DebugEvent {
            $(
                #[doc = concat!("`", $name, "`")]
                $variant,
            )*
        }

        impl DebugEvent {
            /// Every event, in QEMU's order.
            pub const ALL: &'static [DebugEvent] = &[$(DebugEvent::$variant,)*];

            /// QEMU's name of the event.
            pub fn name(self) -> &'static str {
                match self {
                    $(DebugEvent::$variant => $name,)*
                }
            }
        }
    };
}

events! {
    L1Update = "l1_update",
    L1GrowAllocTable = "l1_grow_alloc_table",
    L1GrowWriteTable = "l1_grow_write_table",
    L1GrowActivateTable = "l1_grow_activate_table",
    L2Load = "l2_load",
    L2Update = "l2_update",
    L2UpdateCompressed = "l2_update_compressed",
    L2AllocCowRead = "l2_alloc_cow_read",
    L2AllocWrite = "l2_alloc_write",
    ReadAio = "read_aio",
    ReadBackingAio = "read_backing_aio",
    ReadCompressed = "read_compressed",
    WriteAio = "write_aio",
    WriteCompressed = "write_compressed",
    VmstateLoad = "vmstate_load",
    VmstateSave = "vmstate_save",
    CowRead = "cow_read",
    CowWrite = "cow_write",
    ReftableLoad = "reftable_load",
    ReftableGrow = "reftable_grow",
    ReftableUpdate = "reftable_update",
    RefblockLoad = "refblock_load",
    RefblockUpdate = "refblock_update",
    RefblockUpdatePart = "refblock_update_part",
    RefblockAlloc = "refblock_alloc",
    RefblockAllocHookup = "refblock_alloc_hookup",
    RefblockAllocWrite = "refblock_alloc_write",
    RefblockAllocWriteBlocks = "refblock_alloc_write_blocks",
    RefblockAllocWriteTable = "refblock_alloc_write_table",
    RefblockAllocSwitchTable = "refblock_alloc_switch_table",
    ClusterAlloc = "cluster_alloc",
    ClusterAllocBytes = "cluster_alloc_bytes",
    ClusterFree = "cluster_free",
    FlushToOs = "flush_to_os",
    FlushToDisk = "flush_to_disk",
    PwritevRmwHead = "pwritev_rmw_head",
    PwritevRmwAfterHead = "pwritev_rmw_after_head",
    PwritevRmwTail = "pwritev_rmw_tail",
    PwritevRmwAfterTail = "pwritev_rmw_after_tail",
    Pwritev = "pwritev",
    PwritevZero = "pwritev_zero",
    PwritevDone = "pwritev_done",
    EmptyImagePrepare = "empty_image_prepare",
    L1ShrinkWriteTable = "l1_shrink_write_table",
    L1ShrinkFreeL2Clusters = "l1_shrink_free_l2_clusters",
    CorWrite = "cor_write",
    ClusterAllocSpace = "cluster_alloc_space",
    None = "none",
}

impl DebugEvent {
    /// The event QEMU names `name`.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|e| e.name() == name)
    }
}

/// The kinds of request an `inject-error` rule can fail (QEMU's `iotype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IoType {
    /// Reads.
    Read,
    /// Writes.
    Write,
    /// Write-zeroes requests.
    WriteZeroes,
    /// Discards.
    Discard,
    /// Flushes.
    Flush,
    /// Block-status queries (qimg's storages have none; accepted for QEMU's configs).
    BlockStatus,
}

impl IoType {
    const NAMES: [(IoType, &'static str); 6] = [
        (IoType::Read, "read"),
        (IoType::Write, "write"),
        (IoType::WriteZeroes, "write-zeroes"),
        (IoType::Discard, "discard"),
        (IoType::Flush, "flush"),
        (IoType::BlockStatus, "block-status"),
    ];

    fn bit(self) -> u8 {
        1 << (self as u8)
    }

    fn from_name(name: &str) -> Option<Self> {
        Self::NAMES
            .iter()
            .find(|(_, n)| *n == name)
            .map(|(t, _)| *t)
    }
}

/// The types an `inject-error` rule fails when it names none: every one but block status.
const DEFAULT_IOTYPES: u8 = 0b1_1111;

/// One `inject-error` rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InjectError {
    /// The event that activates the rule.
    pub event: DebugEvent,
    /// The state the rule applies in (any if `None`).
    pub state: Option<u64>,
    /// The error requests fail with (0: none).
    pub errno: i32,
    /// The byte offset a failing request must cover (any request if `None`); QEMU's
    /// `sector` times 512.
    pub offset: Option<u64>,
    /// Whether the rule is removed after its first failure.
    pub once: bool,
    /// QEMU's `immediately` (fail without yielding first): accepted, no effect here.
    pub immediately: bool,
    /// Bit mask of the [`IoType`]s the rule fails.
    iotypes: u8,
}

/// One `set-state` rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetState {
    /// The event that applies the rule.
    pub event: DebugEvent,
    /// The state the rule applies in (any if `None`).
    pub state: Option<u64>,
    /// The state after the event.
    pub new_state: u64,
}

/// The rules of one `blkdebug` node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlkdebugConfig {
    /// `inject-error` rules, in the order they were defined.
    pub inject: Vec<InjectError>,
    /// `set-state` rules, in the order they were defined.
    pub set_state: Vec<SetState>,
}

/// Reads QEMU's boolean words.
fn boolean(key: &str, v: &str) -> std::result::Result<bool, String> {
    match v {
        "on" | "true" | "yes" => Ok(true),
        "off" | "false" | "no" => Ok(false),
        _ => Err(format!("Parameter '{key}' expects 'on' or 'off'")),
    }
}

fn number(key: &str, v: &str) -> std::result::Result<u64, String> {
    let parsed = match v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => v.parse().ok(),
    };
    parsed.ok_or_else(|| format!("Parameter '{key}' expects a number"))
}

impl BlkdebugConfig {
    /// Adds the rule of one section (`inject-error` or `set-state`) given as key/value pairs.
    fn add_rule(
        &mut self,
        kind: &str,
        keys: &[(String, String)],
    ) -> std::result::Result<(), String> {
        let get = |k: &str| {
            keys.iter()
                .rev()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
        };
        let event_name = get("event").ok_or("Missing event name for rule")?;
        let event = DebugEvent::from_name(event_name)
            .ok_or_else(|| format!("invalid parameter value: {event_name}"))?;
        let state = get("state").map(|v| number("state", v)).transpose()?;
        match kind {
            "inject-error" => {
                for (k, _) in keys {
                    if !matches!(
                        k.as_str(),
                        "event" | "state" | "errno" | "sector" | "once" | "immediately" | "iotype"
                    ) {
                        return Err(format!("Invalid parameter '{k}'"));
                    }
                }
                let errno = get("errno").map(|v| number("errno", v)).transpose()?;
                let iotypes = match get("iotype") {
                    None => DEFAULT_IOTYPES,
                    Some(t) => IoType::from_name(t)
                        .ok_or_else(|| format!("Invalid parameter 'iotype': {t}"))?
                        .bit(),
                };
                let offset = match get("sector").map(|v| number("sector", v)).transpose()? {
                    Some(s) => Some(
                        s.checked_mul(512)
                            .ok_or_else(|| format!("sector {s} is past the largest offset"))?,
                    ),
                    None => None,
                };
                self.inject.push(InjectError {
                    event,
                    state,
                    errno: errno
                        .map(|e| i32::try_from(e).map_err(|_| format!("errno {e} is out of range")))
                        .transpose()?
                        .unwrap_or(libc_eio()),
                    offset,
                    once: get("once")
                        .map(|v| boolean("once", v))
                        .transpose()?
                        .unwrap_or(false),
                    immediately: get("immediately")
                        .map(|v| boolean("immediately", v))
                        .transpose()?
                        .unwrap_or(false),
                    iotypes,
                });
            }
            "set-state" => {
                for (k, _) in keys {
                    if !matches!(k.as_str(), "event" | "state" | "new_state") {
                        return Err(format!("Invalid parameter '{k}'"));
                    }
                }
                let new_state = get("new_state").ok_or("Parameter 'new_state' is missing")?;
                self.set_state.push(SetState {
                    event,
                    state,
                    new_state: number("new_state", new_state)?,
                });
            }
            other => return Err(format!("Invalid group name '{other}'")),
        }
        Ok(())
    }

    /// Parses QEMU's blkdebug config file format: `[inject-error]` and `[set-state]`
    /// sections of `key = "value"` lines, `#` comments.
    pub fn parse_file(text: &str) -> std::result::Result<Self, String> {
        let mut config = BlkdebugConfig::default();
        let mut section: Option<(String, Vec<(String, String)>)> = None;
        for (n, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                if let Some((kind, keys)) = section.take() {
                    config.add_rule(&kind, &keys)?;
                }
                section = Some((name.trim().to_string(), Vec::new()));
                continue;
            }
            let (key, value) = line
                .split_once('=')
                .ok_or_else(|| format!("line {}: parse error", n + 1))?;
            let value = value.trim();
            let value = value
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .unwrap_or(value);
            let Some((_, keys)) = section.as_mut() else {
                return Err(format!("line {}: no group defined", n + 1));
            };
            keys.push((key.trim().to_string(), value.to_string()));
        }
        if let Some((kind, keys)) = section.take() {
            config.add_rule(&kind, &keys)?;
        }
        Ok(config)
    }

    /// Adds the rules of QEMU's dotted options (`inject-error.0.event=l2_update`,
    /// `set-state.1.new_state=2`), the keys of a blkdebug node without its prefix. Keys of
    /// other options are left to the caller: the return value lists them.
    pub fn from_options(
        &mut self,
        pairs: &[(String, String)],
    ) -> std::result::Result<Vec<String>, String> {
        let mut rest = Vec::new();
        // (section kind, index, its keys)
        type Section = (String, u64, Vec<(String, String)>);
        let mut rules: Vec<Section> = Vec::new();
        for (k, v) in pairs {
            let mut parts = k.splitn(3, '.');
            let (Some(kind @ ("inject-error" | "set-state")), Some(index), Some(key)) =
                (parts.next(), parts.next(), parts.next())
            else {
                rest.push(k.clone());
                continue;
            };
            let index = number(k, index)?;
            match rules
                .iter_mut()
                .find(|(kd, i, _)| kd == kind && *i == index)
            {
                Some((_, _, keys)) => keys.push((key.to_string(), v.clone())),
                None => rules.push((kind.to_string(), index, vec![(key.to_string(), v.clone())])),
            }
        }
        rules.sort_by_key(|(kind, index, _)| (kind != "inject-error", *index));
        for (kind, _, keys) in rules {
            self.add_rule(&kind, &keys)?;
        }
        Ok(rest)
    }
}

fn libc_eio() -> i32 {
    // EIO is 5 on every Unix qimg builds for.
    5
}

/// Files opened through [`AnyStorage::open`](crate::AnyStorage::open) with blkdebug rules.
static ATTACHED: Mutex<Vec<(PathBuf, BlkdebugConfig, Arc<Breakpoints>)>> = Mutex::new(Vec::new());

/// Makes every later [`AnyStorage::open`](crate::AnyStorage::open) of `path` in this process
/// wrap the file in a [`BlkdebugStorage`] with `config`'s rules (each open starting from the
/// rules as given, in state 1), the way QEMU's tools open a `blkdebug:` image name. For
/// command-line tools; a program that builds its own storage wraps it with
/// [`BlkdebugStorage::new`].
pub fn attach(path: impl Into<PathBuf>, config: BlkdebugConfig) {
    let mut all = ATTACHED.lock().unwrap_or_else(|p| p.into_inner());
    let path = path.into();
    all.retain(|(p, ..)| *p != path);
    all.push((path, config, Arc::default()));
}

/// The rules [`attach`] gave `path`, and its node's breakpoints.
pub(crate) fn attached(path: &Path) -> Option<(BlkdebugConfig, Arc<Breakpoints>)> {
    let all = ATTACHED.lock().unwrap_or_else(|p| p.into_inner());
    all.iter()
        .find(|(p, ..)| p == path)
        .map(|(_, c, b)| (c.clone(), b.clone()))
}

/// The breakpoints of the first node [`attach`] made (what qemu-io's `break` finds first),
/// or `None` when there is no `blkdebug` node.
pub fn attached_breakpoints() -> Option<Arc<Breakpoints>> {
    let all = ATTACHED.lock().unwrap_or_else(|p| p.into_inner());
    all.first().map(|(.., b)| b.clone())
}

/// The live state of a node: the rules left, the active ones, the state number.
#[derive(Debug)]
struct Rules {
    /// `inject-error` rules still in force (a `once` rule goes after its failure).
    inject: Vec<InjectError>,
    set_state: Vec<SetState>,
    /// Indices into `inject` of the active rules, the one consulted first first.
    active: Vec<usize>,
    state: u64,
}

/// A storage whose requests fail as its [`BlkdebugConfig`] says (see the module
/// documentation). Every request is passed to the wrapped storage unless a rule fails it.
#[derive(Debug)]
pub struct BlkdebugStorage<S> {
    inner: S,
    rules: Mutex<Rules>,
    /// Modifications done, and the count the last successful flush covered: as QEMU's
    /// block layer (`write_gen`, `flushed_gen`), a flush with nothing to make durable does
    /// not reach the storage (nor the rules).
    written: AtomicU64,
    flushed: AtomicU64,
    breaks: Arc<Breakpoints>,
    /// The tag of the breakpoint the last event hit: the next request stops under it.
    stop_next: Mutex<Option<String>>,
}

impl<S: Storage> BlkdebugStorage<S> {
    /// Wraps `inner` with `config`'s rules, in state 1.
    pub fn new(inner: S, config: BlkdebugConfig) -> Self {
        BlkdebugStorage {
            inner,
            rules: Mutex::new(Rules {
                inject: config.inject,
                set_state: config.set_state,
                active: Vec::new(),
                state: 1,
            }),
            written: AtomicU64::new(0),
            flushed: AtomicU64::new(0),
            breaks: Arc::default(),
            stop_next: Mutex::new(None),
        }
    }

    /// Shares `breaks` (the breakpoints of the node this storage is an open of).
    pub fn with_breakpoints(mut self, breaks: Arc<Breakpoints>) -> Self {
        self.breaks = breaks;
        self
    }

    /// The breakpoints requests stop at.
    pub fn breakpoints(&self) -> &Arc<Breakpoints> {
        &self.breaks
    }

    /// Stops this request if the event before it hit a breakpoint, until it is resumed.
    async fn stop_if_hit(&self) {
        let tag = self
            .stop_next
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(tag) = tag {
            self.breaks.suspend(tag).await;
        }
    }

    /// The wrapped storage.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The current state number.
    pub fn state(&self) -> u64 {
        self.lock().state
    }

    fn modifies(&self) {
        self.written.fetch_add(1, Ordering::AcqRel);
    }

    /// The end of a write or write-zeroes, failed or not: as QEMU's block layer, the done
    /// event and the count of modifications (a failed write may have landed in part, so the
    /// next flush is not skipped, and meets the rules).
    fn finished_write<T>(&self, done: Result<T>) -> Result<T> {
        self.event(DebugEvent::PwritevDone);
        self.modifies();
        done
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Rules> {
        self.rules.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The error a request of `kind` over `[offset, offset + len)` fails with, if an active
    /// rule fails it (QEMU's `rule_check`).
    fn check(&self, op: Op, kind: IoType, offset: u64, len: u64) -> Result<()> {
        let mut r = self.lock();
        let hit = r.active.iter().position(|&i| {
            let rule = &r.inject[i];
            let covers = match rule.offset {
                None => true,
                Some(at) => len > 0 && at >= offset && at - offset < len,
            };
            covers && rule.iotypes & kind.bit() != 0
        });
        let Some(pos) = hit else { return Ok(()) };
        let index = r.active[pos];
        let rule = r.inject[index].clone();
        if rule.errno == 0 {
            return Ok(());
        }
        if rule.once {
            r.active.remove(pos);
            r.inject.remove(index);
            for i in r.active.iter_mut() {
                if *i > index {
                    *i -= 1;
                }
            }
        }
        Err(StorageError::Io {
            op,
            offset,
            len,
            source: io::Error::from_raw_os_error(rule.errno),
        })
    }

    fn event(&self, event: DebugEvent) {
        let mut r = self.lock();
        let state = r.state;
        let mut new_state = state;
        let mut injected = false;
        // QEMU keeps each event's rules newest first.
        for i in (0..r.inject.len()).rev() {
            let rule = &r.inject[i];
            if rule.event != event || rule.state.is_some_and(|s| s != state) {
                continue;
            }
            if !injected {
                r.active.clear();
                injected = true;
            }
            r.active.insert(0, i);
        }
        for rule in r.set_state.iter().rev() {
            if rule.event == event && rule.state.is_none_or(|s| s == state) {
                new_state = rule.new_state;
            }
        }
        r.state = new_state;
        drop(r);
        if let Some(tag) = self.breaks.hit(event) {
            *self.stop_next.lock().unwrap_or_else(|p| p.into_inner()) = Some(tag);
        }
    }
}

impl<S: Storage> Storage for BlkdebugStorage<S> {
    async fn read_at_most(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        self.stop_if_hit().await;
        self.check(Op::Read, IoType::Read, offset, buf.len() as u64)?;
        self.inner.read_at_most(buf, offset).await
    }

    async fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.event(DebugEvent::Pwritev);
        self.stop_if_hit().await;
        let done = match self.check(Op::Write, IoType::Write, offset, buf.len() as u64) {
            Ok(()) => self.inner.write_at(buf, offset).await,
            Err(e) => Err(e),
        };
        self.finished_write(done)
    }

    async fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> Result<()> {
        let len = bufs.iter().map(|b| b.len() as u64).sum();
        self.event(DebugEvent::Pwritev);
        self.stop_if_hit().await;
        let done = match self.check(Op::Write, IoType::Write, offset, len) {
            Ok(()) => self.inner.write_vectored_at(bufs, offset).await,
            Err(e) => Err(e),
        };
        self.finished_write(done)
    }

    async fn write_zeroes(&self, offset: u64, len: u64) -> Result<ZeroOutcome> {
        self.event(DebugEvent::PwritevZero);
        self.stop_if_hit().await;
        let done = match self.check(Op::WriteZeroes, IoType::WriteZeroes, offset, len) {
            Ok(()) => self.inner.write_zeroes(offset, len).await,
            Err(e) => Err(e),
        };
        self.finished_write(done)
    }

    async fn discard(&self, offset: u64, len: u64) -> Result<DiscardOutcome> {
        self.stop_if_hit().await;
        self.check(Op::Discard, IoType::Discard, offset, len)?;
        let done = self.inner.discard(offset, len).await?;
        self.modifies();
        Ok(done)
    }

    async fn allocate(&self, offset: u64, len: u64) -> Result<AllocateOutcome> {
        let done = self.inner.allocate(offset, len).await?;
        self.modifies();
        Ok(done)
    }

    async fn flush(&self) -> Result<()> {
        self.stop_if_hit().await;
        let covers = self.written.load(Ordering::Acquire);
        if covers == self.flushed.load(Ordering::Acquire) {
            return Ok(());
        }
        self.check(Op::Flush, IoType::Flush, 0, 0)?;
        self.inner.flush().await?;
        self.flushed.fetch_max(covers, Ordering::AcqRel);
        Ok(())
    }

    async fn len(&self) -> Result<u64> {
        self.inner.len().await
    }

    async fn set_len(&self, len: u64) -> Result<()> {
        self.inner.set_len(len).await?;
        self.modifies();
        Ok(())
    }

    fn request_alignment(&self) -> usize {
        self.inner.request_alignment()
    }

    fn mem_alignment(&self) -> usize {
        self.inner.mem_alignment()
    }

    fn lock_image(&self, lock: crate::ImageLock) -> Result<()> {
        self.inner.lock_image(lock)
    }

    fn unlock_image(&self) {
        self.inner.unlock_image()
    }

    fn debug_event(&self, event: DebugEvent) {
        self.event(event);
    }
}

#[cfg(test)]
mod tests;

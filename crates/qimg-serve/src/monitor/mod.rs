//! A control socket speaking QMP (QEMU's machine protocol): what a backup tool drives on a
//! live disk, with QEMU's command and argument names where QEMU has the command.
//!
//! The framing is QMP's: a greeting, `qmp_capabilities` first, then one JSON object per
//! command (`{"execute": NAME, "arguments": {...}, "id": ANY}`), each answered by
//! `{"return": ...}` or `{"error": {"class": ..., "desc": ...}}` (with the command's `id`
//! echoed), and events (`BLOCK_EXPORT_DELETED`) sent to every client. Commands run one at a
//! time, whichever client sends them.
//!
//! | command | what it does |
//! |---|---|
//! | `qmp_capabilities`, `query-version`, `query-commands`, `quit` | as QEMU |
//! | `query-block` | the disk: node name, file, snapshots, dirty bitmaps (with dirty byte counts) |
//! | `block-dirty-bitmap-add` / `-remove` / `-clear` / `-enable` / `-disable` / `-merge` | as QEMU (bitmaps are always persistent: `persistent: false` is refused) |
//! | `blockdev-snapshot-internal-sync`, `blockdev-snapshot-delete-internal-sync` | an internal snapshot of the live disk; a snapshot an export shows cannot be deleted |
//! | `transaction` | any of the above bitmap actions and snapshots at one instant between two guest requests ([`qimg::Image::transaction`]): a checkpoint |
//! | `block-export-add` / `-del`, `query-block-exports` | NBD exports on the same server; `"x-snapshot": NAME` exports a snapshot of the disk read-only (a checkpoint's frozen view), offering the live disk's `bitmaps` |
//!
//! A checkpoint, as a backup tool sends it:
//!
//! ```text
//! {"execute": "transaction", "arguments": {"actions": [
//!   {"type": "blockdev-snapshot-internal-sync", "data": {"device": "disk", "name": "ck2"}},
//!   {"type": "block-dirty-bitmap-disable", "data": {"node": "disk", "name": "b1"}},
//!   {"type": "block-dirty-bitmap-add", "data": {"node": "disk", "name": "b2"}}]}}
//! {"execute": "block-export-add", "arguments": {"type": "nbd", "id": "v2", "node-name": "disk",
//!   "name": "ck2", "x-snapshot": "ck2", "bitmaps": ["b1"]}}
//! ```
//!
//! Bitmap `b1` then holds every change between checkpoints 1 and 2, the export `ck2` shows
//! the disk at checkpoint 2, and the guest goes on writing the disk (snapshot clusters are
//! copied on write). Afterwards `block-export-del` the view, then
//! `blockdev-snapshot-delete-internal-sync` frees the checkpoint's clusters and
//! `block-dirty-bitmap-remove` drops `b1`.

mod exports;

use std::sync::Arc;

use qimg::io::AnyStorage;
use qimg::{Action, Image, InternalSnapshot, SnapshotOptions};
use serde_json::{Map, Value, json};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::{Mutex, Notify, broadcast};

use crate::nbd::{Export, Exports};

/// The most bytes one command may take before the client is disconnected.
const MAX_COMMAND: usize = 1 << 20;

/// The commands this monitor knows, for `query-commands`.
const COMMANDS: &[&str] = &[
    "qmp_capabilities",
    "query-version",
    "query-commands",
    "query-block",
    "query-block-exports",
    "block-dirty-bitmap-add",
    "block-dirty-bitmap-remove",
    "block-dirty-bitmap-clear",
    "block-dirty-bitmap-enable",
    "block-dirty-bitmap-disable",
    "block-dirty-bitmap-merge",
    "blockdev-snapshot-internal-sync",
    "blockdev-snapshot-delete-internal-sync",
    "transaction",
    "block-export-add",
    "block-export-del",
    "quit",
];

/// A QMP error: its class and text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QmpError {
    /// `GenericError`, `CommandNotFound` or `DeviceNotFound`, as QEMU classes them.
    pub class: &'static str,
    /// The message.
    pub desc: String,
}

impl QmpError {
    fn generic(desc: impl Into<String>) -> Self {
        Self {
            class: "GenericError",
            desc: desc.into(),
        }
    }
}

impl From<qimg::Error> for QmpError {
    fn from(e: qimg::Error) -> Self {
        Self::generic(e.to_string())
    }
}

type Reply = Result<Value, QmpError>;

/// An NBD export the monitor added.
#[derive(Debug)]
struct Added {
    id: String,
    snapshot: Option<String>,
    export: Arc<Export>,
}

/// Settings of exports added through the monitor, taken from the server's own export.
#[derive(Debug, Clone, Copy, Default)]
pub struct ExportDefaults {
    /// [`Export::writethrough`].
    pub writethrough: bool,
    /// [`Export::no_flush`].
    pub no_flush: bool,
    /// [`Export::multi_conn`].
    pub multi_conn: bool,
    /// [`Export::per_connection_queue`].
    pub per_connection_queue: bool,
}

/// The control socket's state: the live disk, the NBD server's exports, what was added.
#[derive(Debug)]
pub struct Monitor {
    image: Image<AnyStorage>,
    node: String,
    exports: Option<Arc<Exports>>,
    defaults: ExportDefaults,
    added: Mutex<Vec<Added>>,
    /// One command at a time.
    running: Mutex<()>,
    quit: Notify,
    events: broadcast::Sender<String>,
}

impl Monitor {
    /// A monitor of the live disk `image`, named `node` in commands (QMP's `device`,
    /// `node`, `node-name`), adding exports to `exports` (`None`: no NBD server, and
    /// `block-export-add` is refused as QEMU refuses it).
    pub fn new(
        image: Image<AnyStorage>,
        node: impl Into<String>,
        exports: Option<Arc<Exports>>,
        defaults: ExportDefaults,
    ) -> Self {
        Self {
            image,
            node: node.into(),
            exports,
            defaults,
            added: Mutex::new(Vec::new()),
            running: Mutex::new(()),
            quit: Notify::new(),
            events: broadcast::channel(64).0,
        }
    }

    /// Resolves once a client sent `quit`.
    pub async fn quit_requested(&self) {
        self.quit.notified().await;
    }

    /// Removes every export the monitor added and closes the snapshot views (at shutdown,
    /// after the connections ended).
    pub async fn close(&self) {
        let added = std::mem::take(&mut *self.added.lock().await);
        for a in added {
            if let Some(exports) = &self.exports {
                exports.remove(&a.export.name);
            }
            if a.snapshot.is_some() {
                let _ = a.export.image.close().await;
            }
        }
    }

    /// Serves one client until it leaves; I/O errors end it.
    pub async fn serve<T: AsyncRead + AsyncWrite + Unpin>(&self, stream: T) -> std::io::Result<()> {
        let (rd, mut wr) = tokio::io::split(stream);
        let mut rd = BufReader::new(rd);
        let greeting = json!({"QMP": {
            "version": {"qemu": {"micro": 0, "minor": 0, "major": 10},
                        "package": concat!("qimg ", env!("CARGO_PKG_VERSION"))},
            "capabilities": []}});
        send(&mut wr, &greeting).await?;
        let mut events = self.events.subscribe();
        let mut negotiated = false;
        let mut buf: Vec<u8> = Vec::new();
        loop {
            tokio::select! {
                ev = events.recv() => {
                    if let (Ok(ev), true) = (ev, negotiated) {
                        wr.write_all(ev.as_bytes()).await?;
                        wr.write_all(b"\r\n").await?;
                        wr.flush().await?;
                    }
                }
                n = rd.read_until(b'\n', &mut buf) => {
                    if n? == 0 {
                        return Ok(());
                    }
                    if buf.len() > MAX_COMMAND {
                        let e = QmpError::generic(format!(
                            "a command of over {MAX_COMMAND} bytes: the connection is closed"
                        ));
                        send(&mut wr, &error_reply(&e, None)).await?;
                        return Ok(());
                    }
                    for reply in self.input(&mut buf, &mut negotiated).await {
                        send(&mut wr, &reply).await?;
                    }
                }
            }
        }
    }

    /// Runs every whole JSON object in `buf` (what is left is an unfinished one).
    async fn input(&self, buf: &mut Vec<u8>, negotiated: &mut bool) -> Vec<Value> {
        let mut parsed: Vec<Result<Value, QmpError>> = Vec::new();
        let mut used = 0;
        {
            let mut it = serde_json::Deserializer::from_slice(buf).into_iter::<Value>();
            loop {
                match it.next() {
                    None => {
                        used = it.byte_offset();
                        break;
                    }
                    Some(Ok(v)) => {
                        used = it.byte_offset();
                        parsed.push(Ok(v));
                    }
                    Some(Err(e)) if e.is_eof() => break,
                    Some(Err(e)) => {
                        used = buf.len();
                        parsed.push(Err(QmpError::generic(format!("JSON parse error, {e}"))));
                        break;
                    }
                }
            }
        }
        buf.drain(..used);
        let mut out = Vec::new();
        for v in parsed {
            let v = match v {
                Ok(v) => v,
                Err(e) => {
                    out.push(error_reply(&e, None));
                    continue;
                }
            };
            let id = v.get("id").cloned();
            out.push(match self.command(&v, negotiated).await {
                Ok(ret) => {
                    let mut m = Map::new();
                    m.insert("return".into(), ret);
                    if let Some(id) = id {
                        m.insert("id".into(), id);
                    }
                    Value::Object(m)
                }
                Err(e) => error_reply(&e, id),
            });
        }
        out
    }

    /// One command object, checked as QEMU checks it.
    async fn command(&self, v: &Value, negotiated: &mut bool) -> Reply {
        let Some(obj) = v.as_object() else {
            return Err(QmpError::generic("QMP input must be a JSON object"));
        };
        let Some(name) = obj.get("execute").and_then(Value::as_str) else {
            return Err(QmpError::generic("QMP input lacks member 'execute'"));
        };
        let empty = Map::new();
        let args = match obj.get("arguments") {
            None => &empty,
            Some(Value::Object(a)) => a,
            Some(_) => {
                return Err(QmpError::generic(
                    "QMP input member 'arguments' must be an object",
                ));
            }
        };
        if name == "qmp_capabilities" {
            if *negotiated {
                return Err(QmpError {
                    class: "CommandNotFound",
                    desc: "Capabilities negotiation is already complete, command ignored".into(),
                });
            }
            *negotiated = true;
            return Ok(json!({}));
        }
        if !*negotiated {
            return Err(QmpError {
                class: "CommandNotFound",
                desc: "Expecting capabilities negotiation with 'qmp_capabilities'".into(),
            });
        }
        self.execute(name, args).await
    }

    /// Runs command `name` with `args` (after capabilities negotiation): the API behind the
    /// socket, for embedders that hold the monitor in process.
    pub async fn execute(&self, name: &str, args: &Map<String, Value>) -> Reply {
        let _one = self.running.lock().await;
        match name {
            "query-version" => Ok(json!({
                "qemu": {"micro": 0, "minor": 0, "major": 10},
                "package": concat!("qimg ", env!("CARGO_PKG_VERSION")),
            })),
            "query-commands" => Ok(Value::Array(
                COMMANDS.iter().map(|c| json!({"name": c})).collect(),
            )),
            "quit" => {
                self.quit.notify_one();
                Ok(json!({}))
            }
            "query-block" => self.query_block().await,
            "query-block-exports" => {
                let added = self.added.lock().await;
                Ok(Value::Array(
                    added
                        .iter()
                        .map(|a| {
                            json!({"type": "nbd", "id": a.id, "node-name": self.node,
                                   "shutting-down": false})
                        })
                        .collect(),
                ))
            }
            "transaction" => {
                let actions = args
                    .get("actions")
                    .ok_or_else(|| missing("actions"))?
                    .as_array()
                    .ok_or_else(|| wrong_type("actions", "array"))?;
                let mut list = Vec::new();
                for a in actions {
                    let kind = a
                        .get("type")
                        .and_then(Value::as_str)
                        .ok_or_else(|| missing("type"))?;
                    let empty = Map::new();
                    let data = match a.get("data") {
                        None => &empty,
                        Some(d) => d.as_object().ok_or_else(|| wrong_type("data", "object"))?,
                    };
                    list.push(self.action(kind, data).map_err(|e| match e.class {
                        "CommandNotFound" => QmpError::generic(format!(
                            "Invalid parameter 'type' value '{kind}' in a transaction"
                        )),
                        _ => e,
                    })?);
                }
                self.run(&list).await
            }
            "blockdev-snapshot-delete-internal-sync" => self.delete_snapshot(args).await,
            "block-export-add" => self.export_add(args).await,
            "block-export-del" => self.export_del(args).await,
            _ => {
                let action = self.action(name, args)?;
                self.run(&[action]).await
            }
        }
    }

    /// Runs `actions` as one transaction; a bitmap an export offers cannot be removed (QEMU
    /// refuses to remove a bitmap in use, in these words).
    async fn run(&self, actions: &[Action]) -> Reply {
        let added = self.added.lock().await;
        for a in actions {
            if let Action::RemoveBitmap { name } = a {
                if added.iter().any(|e| e.export.bitmaps.contains(name)) {
                    return Err(QmpError::generic(format!(
                        "Bitmap '{name}' is currently in use by another operation and cannot be used"
                    )));
                }
            }
        }
        drop(added);
        self.image.transaction(actions).await?;
        Ok(json!({}))
    }

    /// A command that is also a transaction action, as an engine [`Action`].
    fn action(&self, name: &str, args: &Map<String, Value>) -> Result<Action, QmpError> {
        let bitmap = |key: &str| -> Result<String, QmpError> {
            self.node_arg(args, "node")?;
            Ok(str_arg(args, key)?.to_string())
        };
        Ok(match name {
            "block-dirty-bitmap-add" => {
                if args.get("persistent") == Some(&Value::Bool(false)) {
                    return Err(QmpError::generic(
                        "qimg keeps persistent bitmaps only: leave out 'persistent' or set it true",
                    ));
                }
                let granularity = match args.get("granularity") {
                    None => None,
                    Some(g) => Some(
                        g.as_u64()
                            .ok_or_else(|| wrong_type("granularity", "uint32"))?,
                    ),
                };
                let disabled = match args.get("disabled") {
                    None => false,
                    Some(d) => d.as_bool().ok_or_else(|| wrong_type("disabled", "bool"))?,
                };
                Action::AddBitmap {
                    name: bitmap("name")?,
                    granularity,
                    enabled: !disabled,
                }
            }
            "block-dirty-bitmap-remove" => Action::RemoveBitmap {
                name: bitmap("name")?,
            },
            "block-dirty-bitmap-clear" => Action::ClearBitmap {
                name: bitmap("name")?,
            },
            "block-dirty-bitmap-enable" | "block-dirty-bitmap-disable" => Action::EnableBitmap {
                name: bitmap("name")?,
                enabled: name == "block-dirty-bitmap-enable",
            },
            "block-dirty-bitmap-merge" => {
                let target = bitmap("target")?;
                let sources = args
                    .get("bitmaps")
                    .ok_or_else(|| missing("bitmaps"))?
                    .as_array()
                    .ok_or_else(|| wrong_type("bitmaps", "array"))?;
                let mut names = Vec::new();
                for s in sources {
                    names.push(match s {
                        Value::String(n) => n.clone(),
                        Value::Object(o) => {
                            self.node_arg(o, "node")?;
                            str_arg(o, "name")?.to_string()
                        }
                        _ => return Err(wrong_type("bitmaps", "array of str or object")),
                    });
                }
                Action::MergeBitmaps {
                    target,
                    sources: names,
                }
            }
            "blockdev-snapshot-internal-sync" => {
                self.node_arg(args, "device")?;
                Action::Snapshot {
                    name: str_arg(args, "name")?.to_string(),
                    options: SnapshotOptions::new(),
                }
            }
            _ => {
                return Err(QmpError {
                    class: "CommandNotFound",
                    desc: format!("The command {name} has not been found"),
                });
            }
        })
    }

    /// Checks that `args[key]` names the disk, in QEMU's words when it does not.
    fn node_arg(&self, args: &Map<String, Value>, key: &str) -> Result<(), QmpError> {
        let v = str_arg(args, key)?;
        if v != self.node {
            return Err(QmpError::generic(format!(
                "Cannot find device='{v}' nor node-name='{v}'"
            )));
        }
        Ok(())
    }
}

/// A snapshot as QMP's `SnapshotInfo`.
fn snapshot_json(s: &InternalSnapshot) -> Value {
    json!({
        "id": s.id, "name": s.name, "vm-state-size": s.vm_state_size,
        "date-sec": s.date_sec, "date-nsec": s.date_nsec,
        "vm-clock-sec": s.vm_clock_nsec / 1_000_000_000,
        "vm-clock-nsec": s.vm_clock_nsec % 1_000_000_000,
    })
}

fn error_reply(e: &QmpError, id: Option<Value>) -> Value {
    let mut m = Map::new();
    m.insert("error".into(), json!({"class": e.class, "desc": e.desc}));
    if let Some(id) = id {
        m.insert("id".into(), id);
    }
    Value::Object(m)
}

async fn send<W: AsyncWrite + Unpin>(w: &mut W, v: &Value) -> std::io::Result<()> {
    w.write_all(v.to_string().as_bytes()).await?;
    w.write_all(b"\r\n").await?;
    w.flush().await
}

fn missing(key: &str) -> QmpError {
    QmpError::generic(format!("Parameter '{key}' is missing"))
}

fn wrong_type(key: &str, want: &str) -> QmpError {
    QmpError::generic(format!(
        "Invalid parameter type for '{key}', expected: {want}"
    ))
}

fn str_arg<'a>(args: &'a Map<String, Value>, key: &str) -> Result<&'a str, QmpError> {
    opt_str(args, key)?.ok_or_else(|| missing(key))
}

fn opt_str<'a>(args: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>, QmpError> {
    match args.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(wrong_type(key, "string")),
    }
}

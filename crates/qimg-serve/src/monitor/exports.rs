//! The monitor's commands on exports and views: adding and removing an NBD export of the
//! live disk or of a snapshot's view, listing the block nodes, deleting a snapshot.

use super::*;
use crate::nbd::Export;
use qimg::io::AnyStorage;
use qimg::{Image, OpenOptions};
use serde_json::{Map, Value, json};
use std::sync::Arc;

impl Monitor {
    pub(super) async fn query_block(&self) -> Reply {
        let img = &self.image;
        let snapshots: Vec<Value> = img.snapshots().await?.iter().map(snapshot_json).collect();
        let mut bitmaps = Vec::new();
        for b in img.bitmaps() {
            let mut v = json!({
                "name": b.name, "recording": b.enabled, "persistent": true, "busy": false,
                "granularity": b.granularity,
            });
            if b.inconsistent {
                v["inconsistent"] = json!(true);
                v["count"] = json!(0);
            } else {
                let bits = img.dirty_bitmap(&b.name).await?;
                let count: u64 = bits.extents(0, img.size()).iter().map(|e| e.1).sum();
                v["count"] = json!(count);
            }
            bitmaps.push(v);
        }
        let file = img.path().display().to_string();
        Ok(json!([{
            "device": self.node, "qdev": "", "locked": false, "removable": false,
            "inserted": {
                "node-name": self.node, "file": file, "ro": !img.is_writable(), "drv": "qcow2",
                "encrypted": false,
                "image": {"filename": file, "format": "qcow2", "virtual-size": img.size(),
                          "cluster-size": img.cluster_size(), "snapshots": snapshots},
                "dirty-bitmaps": bitmaps,
            },
        }]))
    }

    pub(super) async fn delete_snapshot(&self, args: &Map<String, Value>) -> Reply {
        self.node_arg(args, "device")?;
        let id = opt_str(args, "id")?;
        let name = opt_str(args, "name")?;
        if id.is_none() && name.is_none() {
            return Err(QmpError::generic("One of id and name must be specified"));
        }
        let all = self.image.snapshots().await?;
        let found = all
            .iter()
            .find(|s| id.is_none_or(|i| s.id == i) && name.is_none_or(|n| s.name == n))
            .cloned()
            .ok_or_else(|| {
                QmpError::generic(format!(
                    "Snapshot with id '{}' and name '{}' does not exist on device '{}'",
                    id.unwrap_or("(null)"),
                    name.unwrap_or("(null)"),
                    self.node
                ))
            })?;
        if let Some(a) = self
            .added
            .lock()
            .await
            .iter()
            .find(|a| a.snapshot.as_deref() == Some(found.id.as_str()))
        {
            return Err(QmpError::generic(format!(
                "Snapshot '{}' is exported as '{}': remove the export first (block-export-del)",
                found.name, a.id
            )));
        }
        self.image.delete_snapshot(&found.id).await?;
        Ok(snapshot_json(&found))
    }

    pub(super) async fn export_add(&self, args: &Map<String, Value>) -> Reply {
        let kind = str_arg(args, "type")?;
        if kind != "nbd" {
            return Err(QmpError::generic(format!(
                "Invalid parameter 'type' value '{kind}': this monitor adds NBD exports \
                 (vhost-user-blk is served with --vhost-user-blk)"
            )));
        }
        let id = str_arg(args, "id")?.to_string();
        self.node_arg(args, "node-name")?;
        let Some(exports) = &self.exports else {
            return Err(QmpError::generic("NBD server not running"));
        };
        let name = opt_str(args, "name")?.unwrap_or(&self.node).to_string();
        let writable = match args.get("writable") {
            None => false,
            Some(w) => w.as_bool().ok_or_else(|| wrong_type("writable", "bool"))?,
        };
        let snapshot = opt_str(args, "x-snapshot")?;
        let mut bitmaps = Vec::new();
        if let Some(b) = args.get("bitmaps") {
            for n in b.as_array().ok_or_else(|| wrong_type("bitmaps", "array"))? {
                let n = match n {
                    Value::String(n) => n.as_str(),
                    Value::Object(o) => {
                        self.node_arg(o, "node")?;
                        str_arg(o, "name")?
                    }
                    _ => return Err(wrong_type("bitmaps", "array of str or object")),
                };
                match self.image.bitmaps().iter().find(|b| b.name == n) {
                    None => return Err(QmpError::generic(format!("Bitmap '{n}' is not found"))),
                    Some(b) if b.inconsistent => {
                        return Err(QmpError::generic(format!(
                            "Bitmap '{n}' is inconsistent and cannot be used"
                        )));
                    }
                    Some(_) => bitmaps.push(n.to_string()),
                }
            }
        }
        let mut added = self.added.lock().await;
        if added.iter().any(|a| a.id == id) {
            return Err(QmpError::generic(format!(
                "Block export id '{id}' is already in use"
            )));
        }
        if exports.get(name.as_bytes()).is_some() {
            return Err(QmpError::generic(format!(
                "NBD server already has export named '{name}'"
            )));
        }
        let (image, snapshot_id) = match snapshot {
            None => (self.image.clone(), None),
            Some(s) => {
                if writable {
                    return Err(QmpError::generic(
                        "a snapshot is exported read-only: leave out 'writable' or set it false",
                    ));
                }
                let all = self.image.snapshots().await?;
                let sn = all
                    .iter()
                    .find(|x| x.id == s)
                    .or_else(|| all.iter().find(|x| x.name == s))
                    .ok_or_else(|| {
                        QmpError::generic(format!(
                            "Snapshot '{s}' does not exist on device '{}'",
                            self.node
                        ))
                    })?;
                (self.open_view(&sn.id).await?, Some(sn.id.clone()))
            }
        };
        let mut export = Export::new(image);
        export.name = name;
        export.description = opt_str(args, "description")?.map(str::to_string);
        export.read_only = !writable;
        export.bitmaps = bitmaps;
        if snapshot_id.is_some() {
            export.bitmap_source = Some(self.image.clone());
        }
        export.writethrough = self.defaults.writethrough;
        export.no_flush = self.defaults.no_flush;
        export.multi_conn = self.defaults.multi_conn;
        export.per_connection_queue = self.defaults.per_connection_queue && snapshot_id.is_none();
        let export = Arc::new(export);
        if exports.add(export.clone()).is_err() {
            return Err(QmpError::generic("NBD server already has that export name"));
        }
        added.push(Added {
            id,
            snapshot: snapshot_id,
            export,
        });
        Ok(json!({}))
    }

    /// A read-only image of the disk's file showing snapshot `id`: the snapshot's tables and
    /// clusters do not change while it exists (the live disk copies them on write), and it
    /// cannot be deleted while exported.
    pub(super) async fn open_view(&self, id: &str) -> Result<Image<AnyStorage>, QmpError> {
        let view: Image<AnyStorage> = OpenOptions::new()
            .writable(false)
            .force_share(true)
            .open(self.image.path())
            .await?;
        if let Err(e) = view.view_snapshot(Some(id), None).await {
            let _ = view.close().await;
            return Err(e.into());
        }
        Ok(view)
    }

    pub(super) async fn export_del(&self, args: &Map<String, Value>) -> Reply {
        let id = str_arg(args, "id")?;
        let mode = opt_str(args, "mode")?.unwrap_or("safe");
        if mode != "safe" && mode != "hard" {
            return Err(QmpError::generic(format!(
                "Parameter 'mode' does not accept value '{mode}'"
            )));
        }
        let mut added = self.added.lock().await;
        let Some(at) = added.iter().position(|a| a.id == id) else {
            return Err(QmpError::generic(format!("Export '{id}' is not found")));
        };
        // Held by the list, the server's exports and each connection.
        if Arc::strong_count(&added[at].export) > 2 {
            return Err(QmpError::generic(format!(
                "export '{id}' still in use (its clients must disconnect first)"
            )));
        }
        let a = added.remove(at);
        if let Some(exports) = &self.exports {
            exports.remove(&a.export.name);
        }
        if a.snapshot.is_some() {
            a.export.image.close().await?;
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let ev = json!({"timestamp": {"seconds": now.as_secs(), "microseconds": now.subsec_micros()},
                        "event": "BLOCK_EXPORT_DELETED", "data": {"id": id}});
        let _ = self.events.send(ev.to_string());
        Ok(json!({}))
    }
}

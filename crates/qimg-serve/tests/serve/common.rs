//! A minimal NBD client for the in-memory tests: it builds the protocol's bytes by hand, so
//! that tests can also send what a real client never would.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use qimg::io::AnyStorage;
use qimg::tools::create::{CreateOptions, create};
use qimg_serve::nbd::proto::*;
use qimg_serve::nbd::{Export, Shutdown, serve_connection};
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::task::JoinHandle;

/// Creates a qcow2 image of `size` bytes in `dir`.
pub fn make_image(dir: &Path, name: &str, size: u64, extended_l2: bool) -> PathBuf {
    let path = dir.join(name);
    let opts = CreateOptions {
        size: Some(size),
        extended_l2,
        ..CreateOptions::default()
    };
    create(&path, &opts, &mut |_, _| {}).expect("create the image");
    path
}

/// Opens `path` writable and exports it.
pub async fn export(path: &Path) -> Arc<Export<AnyStorage>> {
    let img = qimg::OpenOptions::new()
        .writable(true)
        .open(path)
        .await
        .expect("open the image");
    Arc::new(Export::new(img))
}

/// Opens `path` writable and exports it with a `qimg::Queue` per connection (reads and
/// writes on the queue's direct path where their metadata is cached).
pub async fn export_queued(path: &Path) -> Arc<Export<AnyStorage>> {
    let img = qimg::OpenOptions::new()
        .writable(true)
        .open(path)
        .await
        .expect("open the image");
    let mut export = Export::new(img);
    export.per_connection_queue = true;
    Arc::new(export)
}

/// [`export_queued`] when `queued`, else [`export`].
pub async fn export_with(path: &Path, queued: bool) -> Arc<Export<AnyStorage>> {
    if queued {
        export_queued(path).await
    } else {
        export(path).await
    }
}

/// `qimg check` of the image finds nothing.
pub fn assert_clean(path: &Path) {
    let opts = qimg::tools::check::CheckOptions::default();
    let report = qimg::tools::check::check(path, &opts, &mut |_| {}).expect("check");
    assert_eq!(report.exit_code(), 0, "{}: {report:?}", path.display());
}

/// One reply as the client sees it.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Reply {
    /// The error (0 on success).
    pub error: u32,
    /// Data of a read (holes filled with zeros).
    pub data: Vec<u8>,
    /// Structured chunk types received, in order.
    pub chunks: Vec<u16>,
    /// Block status descriptors per context id.
    pub status: Vec<(u32, Vec<(u32, u32)>)>,
}

/// A client connected to a server task through an in-memory pipe.
pub struct Client {
    pub s: DuplexStream,
    pub server: JoinHandle<Result<(), qimg_serve::nbd::Error>>,
    pub structured: bool,
}

/// Starts serving `export` on an in-memory pipe of `buffer` bytes each way.
pub fn connect_raw(export: Arc<Export<AnyStorage>>, buffer: usize) -> Client {
    let (c, s) = tokio::io::duplex(buffer);
    let server = tokio::spawn(serve_connection(Box::new(s), export, Shutdown::never()));
    Client {
        s: c,
        server,
        structured: false,
    }
}

impl Client {
    /// Reads the greeting and sends the client flags.
    pub async fn greet(&mut self) {
        let mut g = [0u8; 18];
        self.s.read_exact(&mut g).await.unwrap();
        assert_eq!(u64::from_be_bytes(g[0..8].try_into().unwrap()), NBDMAGIC);
        self.s
            .write_u32(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES)
            .await
            .unwrap();
    }

    /// Sends an option.
    pub async fn option(&mut self, opt: u32, data: &[u8]) {
        let mut m = IHAVEOPT.to_be_bytes().to_vec();
        m.extend_from_slice(&opt.to_be_bytes());
        m.extend_from_slice(&(data.len() as u32).to_be_bytes());
        m.extend_from_slice(data);
        self.s.write_all(&m).await.unwrap();
    }

    /// Reads one option reply: (type, data).
    pub async fn option_reply(&mut self) -> (u32, Vec<u8>) {
        let mut h = [0u8; 20];
        self.s.read_exact(&mut h).await.unwrap();
        assert_eq!(
            u64::from_be_bytes(h[0..8].try_into().unwrap()),
            OPT_REPLY_MAGIC
        );
        let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
        let mut d = vec![0u8; len as usize];
        self.s.read_exact(&mut d).await.unwrap();
        (kind, d)
    }

    /// Replies up to and including the ACK (or the first error).
    pub async fn option_replies(&mut self) -> Vec<(u32, Vec<u8>)> {
        let mut out = Vec::new();
        loop {
            let r = self.option_reply().await;
            let end = r.0 == REP_ACK || r.0 & (1 << 31) != 0;
            out.push(r);
            if end {
                return out;
            }
        }
    }

    /// Structured replies, `contexts` selected, `NBD_OPT_GO` of the export `name`; returns
    /// the transmission flags.
    pub async fn go(&mut self, name: &str, structured: bool, contexts: &[&str]) -> u16 {
        self.greet().await;
        if structured {
            self.option(OPT_STRUCTURED_REPLY, &[]).await;
            assert_eq!(self.option_replies().await[0].0, REP_ACK);
            self.structured = true;
            let mut q = (name.len() as u32).to_be_bytes().to_vec();
            q.extend_from_slice(name.as_bytes());
            q.extend_from_slice(&(contexts.len() as u32).to_be_bytes());
            for c in contexts {
                q.extend_from_slice(&(c.len() as u32).to_be_bytes());
                q.extend_from_slice(c.as_bytes());
            }
            self.option(OPT_SET_META_CONTEXT, &q).await;
            let r = self.option_replies().await;
            assert_eq!(r.len(), contexts.len() + 1, "{r:?}");
        }
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&0u16.to_be_bytes());
        self.option(OPT_GO, &d).await;
        let r = self.option_replies().await;
        assert_eq!(r.last().unwrap().0, REP_ACK, "{r:?}");
        let info = r
            .iter()
            .find(|(_, d)| d[0..2] == INFO_EXPORT.to_be_bytes())
            .unwrap();
        u16::from_be_bytes(info.1[10..12].try_into().unwrap())
    }

    /// Sends a request (with `data` as its payload).
    pub async fn send(
        &mut self,
        kind: u16,
        flags: u16,
        handle: u64,
        offset: u64,
        len: u32,
        data: &[u8],
    ) {
        let mut m = REQUEST_MAGIC.to_be_bytes().to_vec();
        m.extend_from_slice(&flags.to_be_bytes());
        m.extend_from_slice(&kind.to_be_bytes());
        m.extend_from_slice(&handle.to_be_bytes());
        m.extend_from_slice(&offset.to_be_bytes());
        m.extend_from_slice(&len.to_be_bytes());
        m.extend_from_slice(data);
        self.s.write_all(&m).await.unwrap();
    }

    /// Reads one whole reply (all chunks up to DONE); `read_len` is the data length of a
    /// simple read reply, `read_offset` where a structured read started.
    pub async fn reply(&mut self, read_len: usize, read_offset: u64) -> (u64, Reply) {
        let mut out = Reply::default();
        let magic = self.s.read_u32().await.unwrap();
        if magic == SIMPLE_REPLY_MAGIC {
            out.error = self.s.read_u32().await.unwrap();
            let handle = self.s.read_u64().await.unwrap();
            if out.error == 0 {
                out.data = vec![0u8; read_len];
                self.s.read_exact(&mut out.data).await.unwrap();
            }
            return (handle, out);
        }
        let mut magic = magic;
        out.data = vec![0u8; read_len];
        loop {
            assert_eq!(magic, STRUCTURED_REPLY_MAGIC);
            let flags = self.s.read_u16().await.unwrap();
            let kind = self.s.read_u16().await.unwrap();
            let handle = self.s.read_u64().await.unwrap();
            let len = self.s.read_u32().await.unwrap();
            let mut p = vec![0u8; len as usize];
            self.s.read_exact(&mut p).await.unwrap();
            out.chunks.push(kind);
            match kind {
                REPLY_TYPE_OFFSET_DATA => {
                    let at = u64::from_be_bytes(p[0..8].try_into().unwrap()) - read_offset;
                    out.data[at as usize..at as usize + p.len() - 8].copy_from_slice(&p[8..]);
                }
                REPLY_TYPE_OFFSET_HOLE => {}
                REPLY_TYPE_BLOCK_STATUS => {
                    let id = u32::from_be_bytes(p[0..4].try_into().unwrap());
                    let d = p[4..]
                        .chunks(8)
                        .map(|c| {
                            (
                                u32::from_be_bytes(c[0..4].try_into().unwrap()),
                                u32::from_be_bytes(c[4..8].try_into().unwrap()),
                            )
                        })
                        .collect();
                    out.status.push((id, d));
                }
                REPLY_TYPE_ERROR => out.error = u32::from_be_bytes(p[0..4].try_into().unwrap()),
                _ => {}
            }
            if flags & REPLY_FLAG_DONE != 0 {
                return (handle, out);
            }
            magic = self.s.read_u32().await.unwrap();
        }
    }

    /// Reads one whole structured read reply among several in flight: `reads` gives each
    /// handle's `(offset, length)`. (This server sends each reply's chunks together.)
    pub async fn read_reply_any(
        &mut self,
        reads: &std::collections::HashMap<u64, (u64, u64)>,
    ) -> (u64, Reply) {
        let mut out = Reply::default();
        let mut current: Option<u64> = None;
        loop {
            assert_eq!(self.s.read_u32().await.unwrap(), STRUCTURED_REPLY_MAGIC);
            let flags = self.s.read_u16().await.unwrap();
            let kind = self.s.read_u16().await.unwrap();
            let handle = self.s.read_u64().await.unwrap();
            let len = self.s.read_u32().await.unwrap();
            let (offset, length) = reads[&handle];
            match current {
                None => {
                    current = Some(handle);
                    out.data = vec![0u8; length as usize];
                }
                Some(h) => assert_eq!(h, handle, "chunks of two replies interleaved"),
            }
            let mut p = vec![0u8; len as usize];
            self.s.read_exact(&mut p).await.unwrap();
            out.chunks.push(kind);
            match kind {
                REPLY_TYPE_OFFSET_DATA => {
                    let at = u64::from_be_bytes(p[0..8].try_into().unwrap()) - offset;
                    out.data[at as usize..at as usize + p.len() - 8].copy_from_slice(&p[8..]);
                }
                REPLY_TYPE_ERROR => out.error = u32::from_be_bytes(p[0..4].try_into().unwrap()),
                _ => {}
            }
            if flags & REPLY_FLAG_DONE != 0 {
                return (handle, out);
            }
        }
    }

    /// Sends a request and reads its reply (nothing else in flight).
    pub async fn call(
        &mut self,
        kind: u16,
        flags: u16,
        offset: u64,
        len: u32,
        data: &[u8],
    ) -> Reply {
        self.send(kind, flags, 7, offset, len, data).await;
        let read_len = if kind == CMD_READ { len as usize } else { 0 };
        let (handle, r) = self.reply(read_len, offset).await;
        assert_eq!(handle, 7);
        r
    }

    /// Sends `NBD_CMD_DISC` and waits for the server to end the connection.
    pub async fn disconnect(mut self) {
        self.send(CMD_DISC, 0, 0, 0, 0, &[]).await;
        self.server.await.unwrap().unwrap();
    }
}

//! Exports of qcow2 images built on the [`qimg`] engine.
//!
//! [`nbd`] is a Network Block Device server: the fixed newstyle handshake, structured
//! replies, extended headers, TLS, `base:allocation` and `qemu:allocation-depth` block status, requests of one
//! connection running concurrently on the shared [`qimg::Image`]. It runs over any tokio
//! stream, so that tests and fuzzers drive it in memory and the `qimg serve --nbd` command
//! over unix or TCP sockets.
//!
//! [`vhost_user_blk`] is a vhost-user-blk device backend: a VMM (cloud-hypervisor, QEMU,
//! Firecracker) connects to its socket and its guest sees a virtio-blk disk, served from one
//! thread per virtqueue through the engine's per-queue completion handles.
//!
//! [`monitor`] is a control socket speaking QMP: bitmaps, snapshots, checkpoints (both at one
//! instant between two guest requests) and NBD exports of a checkpoint's frozen view, as a
//! backup tool drives a live disk.
//!
//! ```no_run
//! # async fn doc() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use qimg_serve::nbd::{Export, serve_connection};
//!
//! let image = qimg::OpenOptions::new().writable(true).open("disk.qcow2").await?;
//! let export = Arc::new(Export::new(image));
//! let listener = tokio::net::UnixListener::bind("/tmp/nbd.sock")?;
//! let (stream, _) = listener.accept().await?;
//! serve_connection(Box::new(stream), export, qimg_serve::nbd::Shutdown::never()).await?;
//! # Ok(()) }
//! ```

#![forbid(unsafe_code)]

/// The fuzz harnesses (feature `fuzzing`, off by default: not part of the published API; the
/// fuzz crate and `scripts/test.sh` turn it on).
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod monitor;
pub mod nbd;
#[cfg(target_os = "linux")]
pub mod vhost_user_blk;

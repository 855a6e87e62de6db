//! Exports of qcow2 images built on the [`qimg`] engine.
//!
//! [`nbd`] is a Network Block Device server: the fixed newstyle handshake, structured
//! replies, extended headers, TLS, `base:allocation` and `qemu:allocation-depth` block status, requests of one
//! connection running concurrently on the shared [`qimg::Image`]. It runs over any tokio
//! stream, so that tests and fuzzers drive it in memory and the `qimg serve --nbd` command
//! over unix or TCP sockets.
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

#[doc(hidden)]
pub mod fuzzing;
pub mod nbd;

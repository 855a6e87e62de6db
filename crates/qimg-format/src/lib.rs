//! # qimg-format: the qcow2 on-disk format, bytes to types and back
//!
//! Every structure of qcow2 version 2 and 3, including extended L2 entries (subcluster
//! allocation), as pure functions: no I/O, no async, no `unsafe`. Each module owns one on-disk
//! structure with an encode/decode pair; decoding validates and returns a [`FormatError`] that
//! names the offending value and the file offset it was read from.
//!
//! All multi-byte integers in qcow2 are big-endian.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod be;
pub mod bitmap;
pub mod cluster0;
pub mod compressed;
pub mod error;
pub mod extension;
pub mod extensions;
pub mod features;
pub mod geometry;
pub mod header;
pub mod l1;
pub mod l2;
pub mod lenient;
pub mod luks;
pub mod magic;
pub mod refcount;
pub mod snapshot;
pub mod units;
pub mod validate;

pub use error::{FormatError, Result};

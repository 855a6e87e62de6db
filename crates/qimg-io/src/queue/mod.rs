//! Per-queue rings for embedders that run their own event loops (a VMM's virtqueue threads).
//!
//! [`QueueRing`] is one io_uring ring owned by one thread, with an eventfd the kernel signals
//! on completion; [`IoBuffers`] is the memory a request lends it (raw guest iovecs, or owned
//! buffers). `qimg::Queue` builds a per-queue disk interface on these: requests whose location
//! is known without metadata I/O go straight from the caller's thread to the kernel.

mod buffers;
mod notifier;
mod ring;

pub use buffers::IoBuffers;
pub use notifier::Notifier;
pub use ring::{QueueRing, RingCompletion};

#[cfg(test)]
mod tests;

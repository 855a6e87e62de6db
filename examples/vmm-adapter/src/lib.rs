//! An example of embedding qimg in a VMM: [`vmm`] restates the disk traits of a
//! ring-per-queue VMM (cloud-hypervisor's shapes), and [`adapter`] implements them on
//! [`qimg::Queue`] in under 150 lines: no table of requests beside the queue (each request
//! owns its operation and gets it back), no second handle for the synchronous flush, and one
//! `unsafe` block, where guest memory is handed over as iovecs.
//!
//! The table in `qimg::queue`'s docs, which maps each `AsyncIo` call to the queue, is checked
//! against this adapter by `tests/model.rs`.

pub mod adapter;
pub mod vmm;

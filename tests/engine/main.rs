//! The engine's integration tests (package `qimg`), one test binary: each module was a test
//! binary of its own. Run one module with `cargo test -p qimg --test engine MODULE::`.
//!
//! Two stay binaries of their own because they own process-wide state: `hostile_named`
//! (a counting global allocator with a limit) and `engine_lifecycle` (thread start hooks and
//! the process's thread list).

#[path = "../common/mod.rs"]
mod common;

mod basic;
mod crash;
mod fuzz_corpus;
mod hostile_headers;
mod hostile_images;
mod interop;
mod io_errors;
mod metadata_io;
mod model;
mod queue;
mod slice_loads;
mod structure;
mod uring;
mod vectored;
mod vmm_lease;

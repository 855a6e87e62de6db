//! The test kit of the qimg workspace: what the whole-system tests (`tests/` at the workspace
//! root) and the cargo-fuzz harness (`fuzz/`) share, written once.
//!
//! | module | what |
//! |---|---|
//! | [`model`] | the flat model of guest data ([`GuestModel`]), the guest requests ([`GuestOp`]) and what a crash may leave ([`model::check_possible`]) |
//! | [`rng`] | the seeded generator ([`Rng`], splitmix64) |
//! | [`pattern`](mod@pattern) | deterministic data patterns ([`pattern()`], [`pattern::word_pattern`]) |
//! | [`qemu`] | qemu-img / qemu-io: [`have_qemu`] and its `QIMG_REQUIRE_QEMU` rule, create / check / compare / convert / info wrappers, JSON comparison, scratch directories |
//! | [`hang`] | hang guards: a wait that gives up after ten times its quiet time ([`HangGuard`]) |
//! | [`fuzzing`] | the entry points of the engine-level fuzz targets, also replayed by `tests/engine/fuzz_corpus.rs` |
//!
//! Not published and not part of qimg's API: it may change with the tests. It depends on
//! `qimg`, so qimg's own unit tests cannot use it (only its integration tests, as a
//! dev-dependency).
#![forbid(unsafe_code)]

pub mod fuzzing;
pub mod hang;
pub mod model;
pub mod pattern;
pub mod qemu;
pub mod rng;

pub use hang::HangGuard;
pub use model::{Effect, Geometry, GuestModel, GuestOp, OpCode};
pub use pattern::pattern;
pub use qemu::{Scratch, have_qemu};
pub use rng::Rng;

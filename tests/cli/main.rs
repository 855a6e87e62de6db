//! The command-line tests (package `qimg-cli`: the `qimg` binary, and qimg run as `qemu-img`
//! and `qemu-io`, side by side with QEMU's tools), one test binary: each module was a test
//! binary of its own. Run one module with `cargo test -p qimg-cli --test cli MODULE::`.

#[path = "../common/mod.rs"]
mod common;

mod backup;
mod bench_cli;
mod bitmaps_interop;
mod check_interop;
mod compare_measure;
mod convert_interop;
mod corruption_parity;
mod create_refusals;
mod encryption;
mod image_locks;
mod interop_create;
mod interop_info;
mod io_interop;
mod map_interop;
mod nbd_interop;
mod nbd_multi_conn;
mod qemu_dropin;
mod rebase_commit;
mod resize_amend;
mod snapshot_interop;
mod subcluster_parity;
mod vhost_user_blk;

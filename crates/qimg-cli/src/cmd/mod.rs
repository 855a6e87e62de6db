//! One module per `qimg` command: its arguments (clap) and its `run`.

pub mod amend;
pub mod backup;
pub mod bench;
pub mod bitmap;
pub mod check;
pub mod commit;
pub mod compare;
pub mod convert;
pub mod create;
pub mod dd;
pub mod info;
pub mod io;
pub mod map;
pub mod measure;
pub mod rebase;
pub mod resize;
pub mod serve;
pub mod snapshot;

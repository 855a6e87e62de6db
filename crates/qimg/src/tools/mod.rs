//! The tools built on the engine and the format crate: what `qemu-img` does to whole images.
//! The engine never imports these.
//!
//! | module | what it does |
//! |---|---|
//! | [`create`] | `qemu-img create`: new qcow2 and raw images, every create option |
//! | `info` | `qemu-img info`: header fields, snapshots, bitmaps, the backing chain, as qemu-img's JSON (feature `json`) |
//! | [`measure`] | `qemu-img measure`: the size of a qcow2 file with given options, fully allocated or holding a source's data, and of its bitmaps |
//! | [`amend`] | `qemu-img amend`: compat up/downgrade, lazy refcounts, refcount width, data file name, size |
//! | [`check`] | `qemu-img check [-r leaks\|all]`: the consistency walk and its repairs |

pub mod amend;
pub mod check;
pub mod create;
#[cfg(feature = "json")]
pub mod info;
pub mod measure;

//! The NBD server's integration tests, one binary (`cargo test -p qimg-serve --test serve`;
//! one module: `cargo test -p qimg-serve --test serve hostile::`): a well-behaved client built
//! by hand (`protocol`) and hostile ones (`hostile`), over the helpers of `common`.

mod common;
mod hostile;
mod protocol;

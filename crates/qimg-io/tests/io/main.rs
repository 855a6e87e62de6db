//! The storage backends' integration tests, one binary (`cargo test -p qimg-io --test io`;
//! one module: `cargo test -p qimg-io --test io uring::`): the conformance suite on every
//! backend, each backend's own behaviour, and the differential test between them.

mod bounce;
mod conformance;
mod differential;
mod faulty;
mod file;
mod mem;
mod uring;

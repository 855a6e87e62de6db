//! `qimg map` (placeholder: being written).

use std::process::ExitCode;

/// Arguments of `qimg map`.
#[derive(clap::Args)]
pub struct MapArgs {
    /// The image.
    filename: String,
}

/// Runs `qimg map`.
pub fn run_map(a: MapArgs) -> ExitCode {
    eprintln!("qimg map: not yet implemented ({})", a.filename);
    ExitCode::from(1)
}

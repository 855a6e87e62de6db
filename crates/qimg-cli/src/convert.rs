//! `qimg convert` (placeholder: being written).

use std::process::ExitCode;

/// Arguments of `qimg convert`.
#[derive(clap::Args)]
pub struct ConvertArgs {
    /// The image.
    filename: String,
}

/// Runs `qimg convert`.
pub fn run_convert(a: ConvertArgs) -> ExitCode {
    eprintln!("qimg convert: not yet implemented ({})", a.filename);
    ExitCode::from(1)
}

//! `qimg bench` (placeholder: being written).

use std::process::ExitCode;

/// Arguments of `qimg bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// The image.
    filename: String,
}

/// Runs `qimg bench`.
pub fn run_bench(a: BenchArgs) -> ExitCode {
    eprintln!("qimg bench: not yet implemented ({})", a.filename);
    ExitCode::from(1)
}

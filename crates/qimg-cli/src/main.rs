//! `qimg`: create and inspect qcow2 images; option names, output and exit codes follow
//! `qemu-img` so that habits and scripts carry over.

mod bench;
mod bench_hist;
mod bench_parse;
mod bench_run;
mod check;
mod convert;
mod human;
mod map;
mod opts;

use std::io::IsTerminal;
use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use qimg::chain::ImageFormat;
use qimg::tools::create::{CreateOptions, create};
use qimg::tools::info::{backing_chain, image_info};

#[derive(Parser)]
#[command(
    name = "qimg",
    version,
    about = "qcow2 images with subcluster allocation, qemu-img compatible"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Create a new image: `qimg create [-f qcow2] [-b BACKING [-F FMT]] [-o OPT=VAL,...] [-q] FILE [SIZE]`
    Create(CreateArgs),
    /// Show information about an image (read-only).
    Info(InfoArgs),
    /// Check an image for consistency, optionally repairing it: `qimg check [-r leaks|all] [--output human|json] FILE`
    Check(check::CheckArgs),
    /// Show where the data of an image lives: `qimg map [--output human|json] FILE`
    Map(map::MapArgs),
    /// Convert images: `qimg convert [-f FMT] [-O qcow2|raw] [-o OPTS] [-B BACKING -F FMT] [-c] [-p] [-t CACHE] [-T CACHE] SRC... DST`
    Convert(convert::ConvertArgs),
    /// Measure I/O performance: `qimg bench [-c COUNT] [-d DEPTH] [-w] ... FILE`
    Bench(bench::BenchArgs),
}

#[derive(clap::Args)]
struct CreateArgs {
    /// Image format: qcow2 (default) or raw.
    #[arg(short = 'f', default_value = "qcow2")]
    fmt: String,
    /// Backing file (same as -o backing_file=).
    #[arg(short = 'b')]
    backing: Option<String>,
    /// Backing file format (same as -o backing_fmt=).
    #[arg(short = 'F')]
    backing_fmt: Option<String>,
    /// Format options, comma separated; `-o help` lists them.
    #[arg(short = 'o', action = clap::ArgAction::Append)]
    options: Vec<String>,
    /// Quiet: print nothing on success.
    #[arg(short = 'q')]
    quiet: bool,
    /// Do not open the backing file (the size must then be given).
    #[arg(short = 'u')]
    unsafe_backing: bool,
    /// The image to create.
    filename: Option<String>,
    /// Virtual size, with an optional k, M, G, T, P or E suffix.
    #[arg(allow_hyphen_values = true)]
    size: Option<String>,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Output {
    Human,
    Json,
}

#[derive(clap::Args)]
struct InfoArgs {
    /// Image format (probed when absent).
    #[arg(short = 'f')]
    fmt: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value = "human")]
    output: Output,
    /// Show the whole backing chain.
    #[arg(long)]
    backing_chain: bool,
    /// Accepted for qemu-img compatibility: qimg info never locks or writes.
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// The image.
    filename: String,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Create(a) => run_create(a),
        Cmd::Info(a) => run_info(a),
        Cmd::Check(a) => return check::run_check(a),
        Cmd::Map(a) => return map::run_map(a),
        Cmd::Convert(a) => return convert::run_convert(a),
        Cmd::Bench(a) => return bench::run_bench(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("qimg: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn parse_fmt(s: &str) -> Result<ImageFormat> {
    match s {
        "qcow2" => Ok(ImageFormat::Qcow2),
        "raw" => Ok(ImageFormat::Raw),
        _ => bail!("Unknown file format '{s}' (qimg supports qcow2 and raw)"),
    }
}

fn run_create(a: CreateArgs) -> Result<()> {
    parse_fmt(&a.fmt)?;
    let pairs: Vec<String> = a.options.iter().flat_map(|o| opts::split_opts(o)).collect();
    if pairs.iter().any(|p| p == "help" || p == "?") {
        print!("{}", opts::help_text(&a.fmt));
        return Ok(());
    }
    let Some(file) = a.filename else {
        bail!("Expecting image file name");
    };
    let mut o = CreateOptions::default();
    let mut given = opts::Given::default();
    opts::apply(&mut o, &mut given, &pairs, &a.fmt).with_context(|| file.clone())?;
    if let Some(b) = a.backing {
        o.backing_file = Some(b);
    }
    if let Some(f) = a.backing_fmt {
        o.backing_fmt = Some(f);
    }
    o.unsafe_backing = a.unsafe_backing;
    if let Some(s) = &a.size {
        match opts::parse_size(s) {
            Some(v) if v <= i64::MAX as u64 => o.size = Some(v),
            _ if s.starts_with('-') => {
                bail!("Invalid image size specified. Must be between 0 and 9223372036854775807.")
            }
            _ => bail!("Invalid image size specified: '{s}'."),
        }
    }
    let path = Path::new(&file);
    let show_progress = !a.quiet && std::io::stderr().is_terminal();
    let mut last = u64::MAX;
    let mut progress = |done: u64, total: u64| {
        if !show_progress || total == 0 {
            return;
        }
        let pct = done * 10000 / total;
        if pct != last {
            last = pct;
            eprint!("\r    ({:.2}/100%)", pct as f64 / 100.0);
            if done == total {
                eprintln!();
            }
        }
    };
    if a.fmt == "raw" {
        if o.backing_file.is_some() || o.backing_fmt.is_some() {
            bail!("{file}: raw images cannot have a backing file");
        }
        let size = qimg::tools::create::effective_size(path, &o).with_context(|| file.clone())?;
        if !a.quiet {
            let shown = o.size.unwrap_or(size);
            println!("{}", opts::formatting_line(&file, "raw", &o, &given, shown));
        }
        qimg::tools::create::create_raw(path, size, o.preallocation, &mut progress)
            .with_context(|| file.clone())?;
        return Ok(());
    }
    o.validate().with_context(|| file.clone())?;
    let size = qimg::tools::create::effective_size(path, &o).with_context(|| file.clone())?;
    if !a.quiet {
        println!(
            "{}",
            opts::formatting_line(&file, "qcow2", &o, &given, o.size.unwrap_or(size))
        );
    }
    create(path, &o, &mut progress).with_context(|| file.clone())?;
    Ok(())
}

fn run_info(a: InfoArgs) -> Result<()> {
    let _ = a.force_share;
    let fmt = a.fmt.as_deref().map(parse_fmt).transpose()?;
    let path = Path::new(&a.filename);
    let list = if a.backing_chain {
        backing_chain(path, fmt)?
    } else {
        vec![image_info(path, fmt)?]
    };
    match a.output {
        Output::Json => {
            let v = if a.backing_chain {
                serde_json::to_value(&list)?
            } else {
                serde_json::to_value(&list[0])?
            };
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
        Output::Human => {
            let texts: Vec<String> = list.iter().map(human::info).collect();
            print!("{}", texts.join("\n"));
        }
    }
    Ok(())
}

//! `qimg check [-f qcow2] [-r leaks|all] [--output human|json] [-q] [-U] FILE`: qemu-img
//! check's options, messages, JSON and exit codes (0 clean, 1 check not completed,
//! 2 corruptions, 3 leaks only, 63 format without checks).

use std::io::IsTerminal;
use std::path::Path;
use std::process::ExitCode;

use qimg::chain::ImageFormat;
use qimg::tools::check::{CheckEvent, CheckOptions, CheckReport, Repair, check};

use crate::args::json_output;
use crate::status::{fail, lib_msg, open_msg};

/// Arguments of `qimg check`.
#[derive(clap::Args)]
pub struct CheckArgs {
    /// Image format: qcow2 (probed when absent; other formats have no checks).
    #[arg(short = 'f')]
    fmt: Option<String>,
    /// Repair: `leaks` frees leaked clusters, `all` also repairs corruptions.
    #[arg(short = 'r', long = "repair")]
    repair: Option<String>,
    /// Output format: human or json.
    #[arg(long, default_value = "human")]
    output: String,
    /// Quiet: print no report (diagnostics still go to stderr).
    #[arg(short = 'q')]
    quiet: bool,
    /// Accepted for qemu-img compatibility (qimg takes no locks); not allowed with -r.
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// The image.
    filename: Option<String>,
}

/// Runs `qimg check`, returning qemu-img check's exit code.
pub fn run(args: CheckArgs) -> ExitCode {
    let repair = match args.repair.as_deref() {
        None => None,
        Some("leaks") => Some(Repair::Leaks),
        Some("all") => Some(Repair::All),
        Some(other) => {
            return fail(
                format!(
                    "--repair (-r) expects 'leaks' or 'all' not '{other}'\n\
                     Try 'qimg check --help' for more info"
                ),
                1,
            );
        }
    };
    let json = match json_output(&args.output, "check") {
        Ok(json) => json,
        Err(msg) => return fail(msg, 1),
    };
    let Some(file) = args.filename else {
        return fail(
            "Expecting one image file name\nTry 'qimg check --help' for more info",
            1,
        );
    };
    let path = Path::new(&file);
    let fmt = match crate::chain::source_format(path, &file, args.fmt.as_deref()) {
        Ok(f) => f,
        Err(e) => return fail(format!("{e:#}"), 1),
    };
    if args.force_share && repair.is_some() {
        return fail(
            format!(
                "Could not open '{file}': force-share=on can only be used with read-only images"
            ),
            1,
        );
    }
    if fmt == ImageFormat::Raw {
        return fail("This image format does not support checks", 63);
    }
    // An encrypted image opens with its passphrase first, as QEMU's check does: a wrong one
    // stops the check (the engine's open tries the key slots; its other complaints are the
    // check's to report).
    if let Some(e) = wrong_passphrase(path) {
        return fail(
            format!(
                "Could not open '{}': {}",
                crate::status::typed_name(&file).unwrap_or_else(|| file.clone()),
                crate::status::lib_msg(&e, &file)
            ),
            1,
        );
    }
    // QEMU opens the whole chain to check the top: a backing file that does not open stops
    // the check (other open errors are the check's to report).
    if let Err(e) = backing_chain_opens(path) {
        return fail(
            format!(
                "Could not open '{file}': {}",
                crate::status::lib_msg(&e, &file)
            ),
            1,
        );
    }

    let human = !json && !args.quiet;
    let tty = !args.quiet && std::io::stderr().is_terminal();
    let mut progress_shown = false;
    let mut last_progress: Option<std::time::Instant> = None;
    let mut on_event = |e: CheckEvent<'_>| match e {
        CheckEvent::Message(m) => {
            if progress_shown {
                eprint!("\r\x1b[K");
                progress_shown = false;
            }
            eprintln!("{m}");
        }
        CheckEvent::Repaired {
            leaks_fixed,
            corruptions_fixed,
        } => {
            if human {
                out!(
                    "The following inconsistencies were found and repaired:\n\n    \
                     {leaks_fixed} leaked clusters\n    {corruptions_fixed} corruptions\n\n\
                     Double checking the fixed image now...\n"
                );
            }
        }
        CheckEvent::Progress { done, total } => {
            if tty && total > 0 {
                if done >= total {
                    if progress_shown {
                        eprint!("\r\x1b[K");
                        progress_shown = false;
                    }
                } else if last_progress.is_none_or(|t| t.elapsed().as_millis() >= 100) {
                    last_progress = Some(std::time::Instant::now());
                    eprint!("\r    ({:.2}/100%)", done as f64 * 100.0 / total as f64);
                    progress_shown = true;
                }
            }
        }
    };
    let opts = CheckOptions {
        repair,
        force_share: args.force_share,
    };
    let report = match check(path, &opts, &mut on_event) {
        Ok(r) => r,
        Err(e) => {
            let msg = anyhow::anyhow!("Could not open '{file}': {}", lib_msg(&e, &file));
            return fail(open_msg(msg, &file), 1);
        }
    };
    if progress_shown {
        eprint!("\r\x1b[K");
    }
    if let Some(why) = &report.failure {
        return fail(format!("Check failed: {why}"), 1);
    }
    if !args.quiet {
        if json {
            out!("{}", json_text(&report));
        } else {
            out!("{}", human_text(&report));
        }
    }
    if report.check_errors > 0 {
        return fail("Check failed", 1);
    }
    ExitCode::from(report.exit_code())
}

/// The report as qemu-img prints it: a flat object indented by four spaces, then a newline.
fn json_text(r: &CheckReport) -> String {
    let text =
        serde_json::to_string_pretty(r).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    let mut out = String::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("  ") {
            out.push_str("    ");
            out.push_str(rest);
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

/// qemu-img's `dump_human_image_check`.
fn human_text(r: &CheckReport) -> String {
    let mut s = String::new();
    if r.corruptions == 0 && r.leaks == 0 && r.check_errors == 0 {
        s.push_str("No errors were found on the image.\n");
    } else {
        if r.corruptions > 0 {
            s.push_str(&format!(
                "\n{} errors were found on the image.\nData may be corrupted, or further \
                 writes to the image may corrupt it.\n",
                r.corruptions
            ));
        }
        if r.leaks > 0 {
            s.push_str(&format!(
                "\n{} leaked clusters were found on the image.\nThis means waste of disk \
                 space, but no harm to data.\n",
                r.leaks
            ));
        }
        if r.check_errors > 0 {
            s.push_str(&format!(
                "\n{} internal errors have occurred during the check.\n",
                r.check_errors
            ));
        }
    }
    if r.total_clusters != 0 && r.allocated_clusters != 0 {
        s.push_str(&format!(
            "{}/{} = {:.2}% allocated, {:.2}% fragmented, {:.2}% compressed clusters\n",
            r.allocated_clusters,
            r.total_clusters,
            r.allocated_clusters as f64 * 100.0 / r.total_clusters as f64,
            r.fragmented_clusters as f64 * 100.0 / r.allocated_clusters as f64,
            r.compressed_clusters as f64 * 100.0 / r.allocated_clusters as f64,
        ));
    }
    if r.image_end_offset != 0 {
        s.push_str(&format!("Image end offset: {}\n", r.image_end_offset));
    }
    s
}

/// Whether the backing chain of the qcow2 image at `path` opens: the error of the first
/// backing file that does not; `Ok` also when the image itself does not open (its check
/// says why).
fn backing_chain_opens(path: &Path) -> Result<(), qimg::Error> {
    let Ok(c0) = qimg::chain::read_cluster0(path, qimg::format::validate::OpenMode::ReadOnly)
    else {
        return Ok(());
    };
    if c0.backing_file.is_none() {
        return Ok(());
    }
    let rt = match tokio::runtime::Builder::new_current_thread().build() {
        Ok(rt) => rt,
        Err(_) => return Ok(()),
    };
    rt.block_on(async {
        let opened = qimg::OpenOptions::new()
            .writable(false)
            .force_share(true)
            .clean_timer(false)
            .open(path)
            .await;
        match opened {
            Ok(img) => {
                let _ = img.close().await;
                Ok(())
            }
            Err(e @ qimg::Error::Backing { .. }) => Err(e),
            Err(_) => Ok(()),
        }
    })
}

/// The error of an encrypted image whose passphrase (`encrypt.key-secret`) opens no key
/// slot; `None` otherwise (no key given, not encrypted, or it opens).
fn wrong_passphrase(path: &Path) -> Option<qimg::Error> {
    path.to_str().and_then(crate::encryption::key_for)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .ok()?;
    let opened = rt.block_on(
        crate::image_spec::options_for(path)
            .clean_timer(false)
            .force_share(true)
            .open(path),
    );
    match opened {
        Err(e @ qimg::Error::Crypto { .. }) => Some(e),
        _ => None,
    }
}

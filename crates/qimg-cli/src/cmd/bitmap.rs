//! `qimg bitmap (--merge SOURCE | --add | --remove | --clear | --enable | --disable)...
//! [-b SOURCE_FILE [-F SOURCE_FMT]] [-g GRANULARITY] [-f FMT] FILE BITMAP`: changes the
//! persistent dirty bitmaps of a qcow2 image as `qemu-img bitmap` does: the actions run in
//! the order given (options may come after the operands, as GNU getopt takes them), the
//! first that fails ends the command with "Operation ACTION on bitmap NAME failed: ..." and
//! status 1 (what the actions before it did is kept), and the messages are qemu-img's.

use anyhow::{Result, anyhow, bail};

use qimg::chain::ImageFormat;
use qimg::{DirtyBitmap, OpenOptions};

use crate::args::parse_size;
use crate::chain::source_format;
use crate::status::{lib_msg, open_msg, program};

/// Arguments of `qimg bitmap`, parsed as qemu-img parses them (order matters).
#[derive(clap::Args)]
pub struct BitmapArgs {
    /// (--merge SOURCE | --add | --remove | --clear | --enable | --disable)... [-b
    /// SOURCE_FILE [-F SOURCE_FMT]] [-g GRANULARITY] [-f FMT] FILE BITMAP
    #[arg(allow_hyphen_values = true, trailing_var_arg = true, num_args = 0..)]
    args: Vec<String>,
}

#[derive(Debug)]
enum Action {
    Add,
    Remove,
    Clear,
    Enable,
    Disable,
    Merge(String),
}

impl Action {
    fn word(&self) -> &'static str {
        match self {
            Action::Add => "add",
            Action::Remove => "remove",
            Action::Clear => "clear",
            Action::Enable => "enable",
            Action::Disable => "disable",
            Action::Merge(_) => "merge",
        }
    }
}

#[derive(Debug, Default)]
struct Parsed {
    actions: Vec<Action>,
    granularity: Option<u64>,
    fmt: Option<String>,
    source_file: Option<String>,
    source_fmt: Option<String>,
    operands: Vec<String>,
}

/// A getopt refusal: printed as it is (it names the program itself), status 1.
#[derive(Debug)]
struct Usage(String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

fn invalid(what: String) -> anyhow::Error {
    anyhow::Error::new(Usage(format!(
        "{what}\nTry '{} bitmap --help' for more info",
        program()
    )))
}

fn parse(args: &[String]) -> Result<Parsed> {
    let mut p = Parsed::default();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--" {
            p.operands.extend(it.by_ref().cloned());
            break;
        }
        let (name, inline) = match a.split_once('=') {
            Some((n, v)) if a.starts_with("--") => (n.to_string(), Some(v.to_string())),
            _ => (a.clone(), None),
        };
        let needs_value = matches!(
            name.as_str(),
            "--merge"
                | "-b"
                | "--source-file"
                | "-F"
                | "--source-format"
                | "-g"
                | "--granularity"
                | "-f"
                | "--format"
        );
        let short_value = |flag: &str| a.len() > 2 && a.starts_with(flag) && !a.starts_with("--");
        let (name, value) = if needs_value {
            let v = match inline {
                Some(v) => v,
                None => it.next().cloned().ok_or_else(|| {
                    let shown = name.trim_start_matches('-');
                    if name.starts_with("--") {
                        invalid(format!(
                            "{} bitmap: option '{name}' requires an argument",
                            program()
                        ))
                    } else {
                        invalid(format!(
                            "{} bitmap: option requires an argument -- '{shown}'",
                            program()
                        ))
                    }
                })?,
            };
            (name, Some(v))
        } else if ["-b", "-F", "-g", "-f"].iter().any(|f| short_value(f)) {
            (a[..2].to_string(), Some(a[2..].to_string()))
        } else {
            if let (Some(_), true) = (&inline, name.starts_with("--")) {
                return Err(invalid(format!(
                    "{} bitmap: option '{name}' doesn't allow an argument",
                    program()
                )));
            }
            (name, None)
        };
        match (name.as_str(), value) {
            ("--add", _) => p.actions.push(Action::Add),
            ("--remove", _) => p.actions.push(Action::Remove),
            ("--clear", _) => p.actions.push(Action::Clear),
            ("--enable", _) => p.actions.push(Action::Enable),
            // `--add --disable` adds, then disables, as qemu-img.
            ("--disable", _) => p.actions.push(Action::Disable),
            ("--merge", Some(v)) => p.actions.push(Action::Merge(v)),
            ("-b" | "--source-file", Some(v)) => p.source_file = Some(v),
            ("-F" | "--source-format", Some(v)) => p.source_fmt = Some(v),
            ("-f" | "--format", Some(v)) => p.fmt = Some(v),
            ("-g" | "--granularity", Some(v)) => {
                let g = parse_size(&v)
                    .ok_or_else(|| anyhow!("Invalid granularity specified: '{v}'."))?;
                p.granularity = (g != 0).then_some(g);
            }
            (o, _) if o.starts_with("--") => {
                return Err(invalid(format!(
                    "{} bitmap: unrecognized option '{o}'",
                    program()
                )));
            }
            (o, _) if o.starts_with('-') && o.len() > 1 => {
                return Err(invalid(format!(
                    "{} bitmap: invalid option -- '{}'",
                    program(),
                    &o[1..2]
                )));
            }
            _ => p.operands.push(a.clone()),
        }
    }
    if p.actions.is_empty() {
        bail!("Need at least one of --add, --remove, --clear, --enable, --disable, or --merge");
    }
    let adding = p.actions.iter().any(|a| matches!(a, Action::Add));
    if p.granularity.is_some() && !adding {
        bail!("granularity only supported with --add");
    }
    if p.source_fmt.is_some() && p.source_file.is_none() {
        bail!("-F only supported with -b");
    }
    let merging = p.actions.iter().any(|a| matches!(a, Action::Merge(_)));
    if p.source_file.is_some() && !merging {
        bail!("Merge bitmap source file only supported with --merge");
    }
    if p.operands.len() != 2 {
        bail!("Expecting filename and bitmap name");
    }
    Ok(p)
}

/// Runs `qimg bitmap`: its exit status (getopt's refusals printed as getopt words them).
pub fn main(args: BitmapArgs) -> std::process::ExitCode {
    match run(args) {
        Err(e) if e.is::<Usage>() => {
            eprintln!("{e}");
            std::process::ExitCode::from(1)
        }
        other => crate::status::exit_status(other),
    }
}

fn run(args: BitmapArgs) -> Result<()> {
    let p = parse(&args.args)?;
    let (file, name) = (&p.operands[0], &p.operands[1]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let format = source_format(std::path::Path::new(file), file, p.fmt.as_deref())
            .map_err(|e| open_msg(e, file))?;
        let failed = |action: &Action, msg: String| {
            anyhow!("Operation {} on bitmap {name} failed: {msg}", action.word())
        };
        if format != ImageFormat::Qcow2 {
            if let Some(warning) = crate::chain::raw_probe_warning(file, p.fmt.as_deref(), format) {
                eprintln!("{warning}");
            }
            let action = &p.actions[0];
            return Err(failed(
                action,
                format!("Can't store persistent bitmaps to '{file}': Operation not supported"),
            ));
        }
        let img = crate::image_spec::options_for(std::path::Path::new(file))
            .writable(true)
            .clean_timer(false)
            .open(file)
            .await
            .map_err(|e| {
                // Another process's lock fails the open, as QEMU's.
                crate::status::lock_refusal(&e, file)
                    .unwrap_or_else(|| open_msg(anyhow!(lib_msg(&e, file)), file))
            })?;
        let mut result = Ok(());
        for action in &p.actions {
            let done = match action {
                Action::Add => img.add_bitmap(name, p.granularity, true),
                Action::Remove => img.remove_bitmap(name),
                Action::Clear => img.clear_bitmap(name),
                Action::Enable => img.enable_bitmap(name, true),
                Action::Disable => img.enable_bitmap(name, false),
                // As QEMU: the source file opens, then the target is looked up, then the
                // source bitmap.
                Action::Merge(source) => match merge_source(&p, &img, source).await {
                    Ok(bits) => img
                        .bitmap(name)
                        .and(bits)
                        .and_then(|bits| img.merge_bitmap(name, &bits)),
                    // The source file did not open: qemu-img's open error, as is.
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                },
            };
            if let Err(e) = done {
                result = Err(failed(action, bitmap_msg(&e)));
                break;
            }
        }
        // What the actions before a failure did is kept, as qemu-img keeps it.
        let closed = img.close().await;
        result?;
        closed.map_err(|e| anyhow!(lib_msg(&e, file)))
    })
}

/// The message of a bitmap refusal (the library words it as qemu-img does).
fn bitmap_msg(e: &qimg::Error) -> String {
    match e {
        qimg::Error::InvalidOption(m) => m.clone(),
        other => other.to_string(),
    }
}

/// The bits to merge: bitmap `source` of `-b FILE` (opened read-only), or of the image.
/// The outer error is the source file's failure to open, the inner one the bitmap's.
async fn merge_source(
    p: &Parsed,
    img: &qimg::Image<qimg::io::AnyStorage>,
    source: &str,
) -> Result<qimg::Result<DirtyBitmap>> {
    let Some(other) = &p.source_file else {
        return Ok(img.dirty_bitmap(source).await);
    };
    let src = match OpenOptions::new().clean_timer(false).open(other).await {
        Ok(src) => src,
        Err(e) => return Err(anyhow!("Could not open '{other}': {}", lib_msg(&e, other))),
    };
    let bits = src.dirty_bitmap(source).await;
    Ok(match src.close().await {
        Ok(()) => bits,
        Err(e) => Err(e),
    })
}

//! `qimg dd [-f FMT] [-O OUTPUT_FMT] [-U] if=INPUT of=OUTPUT [bs=SIZE] [count=N] [skip=N]`:
//! copies blocks of an image's guest data into a new image, as `qemu-img dd` does, quirks
//! included: `count` counts blocks from the start of the input (not after `skip`), the
//! output is as long as what is copied, and a `skip` past the end of the input warns and
//! leaves an empty output image (exit status 0).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::{Result, anyhow, bail};
use qimg::OpenOptions;
use qimg::chain::ImageFormat;
use qimg::tools::create::{CreateOptions, create};

use crate::args::parse_size;
use crate::chain::{raw_virtual_size, source_format};
use crate::status::{lib_msg, open_msg, os_msg};

/// Arguments of `qimg dd`.
#[derive(clap::Args)]
pub struct DdArgs {
    /// Input image format: qcow2 or raw (probed when absent).
    #[arg(short = 'f', long = "format")]
    fmt: Option<String>,
    /// Output image format: raw (default) or qcow2.
    #[arg(short = 'O')]
    out_fmt: Option<String>,
    /// Read the input even while another program writes it.
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// Operands: if=FILE, of=FILE, bs=SIZE (512), count=BLOCKS, skip=BLOCKS. Options may
    /// follow them, as qemu-img's `getopt` takes them.
    operands: Vec<String>,
}

/// The parsed operands.
struct Operands {
    input: Option<String>,
    output: Option<String>,
    bs: u64,
    count: Option<u64>,
    skip: Option<u64>,
}

/// A block count as qemu-img takes `count` and `skip`: a decimal integer, no suffix.
fn blocks(what: &str, v: &str) -> Result<u64> {
    match v.parse::<i64>() {
        Ok(n) if n >= 0 => Ok(n as u64),
        Ok(_) => bail!("Invalid {what} specified. Must be between 0 and 9223372036854775807."),
        Err(_) => bail!("Invalid {what} specified: '{v}'."),
    }
}

fn parse_operands(list: &[String]) -> Result<Operands> {
    let mut o = Operands {
        input: None,
        output: None,
        bs: 512,
        count: None,
        skip: None,
    };
    for arg in list {
        let Some((key, v)) = arg.split_once('=') else {
            bail!("unrecognized operand {arg}");
        };
        match key {
            "bs" => {
                o.bs = match parse_size(v) {
                    Some(n) if (1..=i32::MAX as u64).contains(&n) => n,
                    Some(_) => bail!("Invalid bs specified. Must be between 1 and 2147483647."),
                    None if v.starts_with('-') => {
                        bail!("Invalid bs specified. Must be between 1 and 2147483647.")
                    }
                    None => bail!("Invalid bs specified: '{v}'."),
                }
            }
            "count" => o.count = Some(blocks("count", v)?),
            "if" => o.input = Some(v.to_string()),
            "of" => o.output = Some(v.to_string()),
            "skip" => o.skip = Some(blocks("skip", v)?),
            _ => bail!("unrecognized operand {key}"),
        }
    }
    Ok(o)
}

/// The guest data of the input image.
enum Input {
    Qcow2(qimg::BlockingImage),
    Raw(File, u64),
}

impl Input {
    fn size(&self) -> u64 {
        match self {
            Input::Qcow2(img) => img.size(),
            Input::Raw(_, size) => *size,
        }
    }

    fn read(&self, buf: &mut [u8], at: u64) -> Result<()> {
        match self {
            Input::Qcow2(img) => img.read(buf, at).map_err(|e| anyhow!("{}", errno_text(&e))),
            Input::Raw(f, _) => {
                crate::chain::read_raw(f, buf, at).map_err(|e| anyhow!("{}", os_msg(&e)))
            }
        }
    }
}

/// Runs `qimg dd`.
pub fn run(a: DdArgs) -> Result<()> {
    let o = parse_operands(&a.operands)?;
    let (Some(input), Some(output)) = (o.input, o.output) else {
        bail!("Must specify both input and output files");
    };
    let in_path = Path::new(&input);
    let fmt = source_format(in_path, &input, a.fmt.as_deref()).map_err(|e| open_msg(e, &input))?;
    let src = match fmt {
        ImageFormat::Qcow2 => Input::Qcow2(
            OpenOptions::new()
                .force_share(a.force_share)
                .clean_timer(false)
                .open_blocking(in_path)
                .map_err(|e| {
                    open_msg(
                        anyhow!("Could not open '{input}': {}", lib_msg(&e, &input)),
                        &input,
                    )
                })?,
        ),
        ImageFormat::Raw => {
            let f = File::open(in_path).map_err(|e| {
                open_msg(anyhow!("Could not open '{input}': {}", os_msg(&e)), &input)
            })?;
            let len = f.metadata().map_err(|e| anyhow!("{}", os_msg(&e)))?.len();
            Input::Raw(f, raw_virtual_size(len))
        }
    };
    let out_fmt = match a.out_fmt.as_deref() {
        None | Some("raw") => ImageFormat::Raw,
        Some("qcow2") => ImageFormat::Qcow2,
        Some(other) => bail!("Unknown file format '{other}'"),
    };
    let bs = o.bs;
    let mut size = src.size();
    if let Some(count) = o.count {
        if count.checked_mul(bs).is_some_and(|n| n < size) {
            size = count * bs;
        }
    }
    let skip_past = o
        .skip
        .is_some_and(|s| s.checked_mul(bs).is_none_or(|at| at > size));
    let start = o.skip.map_or(0, |s| s * bs);
    let out_size = if skip_past { 0 } else { size - start };
    let out_path = Path::new(&output);
    let out_msg = |e: &dyn std::fmt::Display| anyhow!("{output}: {e}");
    // As qemu-img's dd: the output is made as `create` makes it (QEMU's write lock first:
    // a file another process holds is refused, not truncated).
    let made = |e: qimg::Error| {
        out_msg(&format!(
            "error while creating output image: {}",
            crate::cmd::create::create_failure(&e, &output)
        ))
    };
    let mut raw_out = None;
    match out_fmt {
        ImageFormat::Raw => {
            qimg::tools::create::create_raw(
                out_path,
                out_size,
                qimg::tools::create::Preallocation::Off,
                &mut |_, _| {},
            )
            .map_err(made)?;
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(out_path)
                .map_err(|e| out_msg(&os_msg(&e)))?;
            raw_out = Some(f);
        }
        ImageFormat::Qcow2 => {
            let opts = CreateOptions {
                size: Some(out_size),
                ..Default::default()
            };
            create(out_path, &opts, &mut |_, _| {}).map_err(made)?;
        }
    }
    let mut at = start;
    if skip_past {
        eprintln!(
            "{}: {input}: cannot skip to specified offset",
            crate::status::program()
        );
        at = size;
    }
    let mut buf = vec![0u8; bs as usize];
    let mut out_pos = 0u64;
    let out_img = match out_fmt {
        ImageFormat::Qcow2 => Some(
            crate::image_spec::options_for(out_path)
                .writable(true)
                .clean_timer(false)
                .open_blocking(out_path)
                .map_err(|e| out_msg(&lib_msg(&e, &output)))?,
        ),
        ImageFormat::Raw => None,
    };
    while at < size {
        let n = bs.min(size - at) as usize;
        src.read(&mut buf[..n], at)
            .map_err(|e| anyhow!("error while reading from input image file: {e}"))?;
        let written = match &out_img {
            Some(img) => img
                .write(&buf[..n], out_pos)
                .map_err(|e| anyhow!("{}", errno_text(&e))),
            None => raw_out
                .as_ref()
                .expect("a raw output file")
                .write_all_at(&buf[..n], out_pos)
                .map_err(|e| anyhow!("{}", os_msg(&e))),
        };
        written.map_err(|e| anyhow!("error while writing to output image file: {e}"))?;
        at += n as u64;
        out_pos += n as u64;
    }
    if let Some(img) = out_img {
        img.close().map_err(|e| out_msg(&lib_msg(&e, &output)))?;
    }
    if let Input::Qcow2(img) = src {
        let _ = img.close();
    }
    Ok(())
}

/// The C `strerror` words of a library error's errno.
fn errno_text(e: &qimg::Error) -> String {
    os_msg(&std::io::Error::from_raw_os_error(e.errno()))
}

//! `qimg measure [--output human|json] [-O FMT] [-o OPTS] [-f FMT] [-U] (--size SIZE | FILE)`:
//! how large a new image would be, as `qemu-img measure` prints it: the `required size` (the
//! metadata of a fully allocated image plus the data clusters a copy of FILE holds), the
//! `fully allocated size`, and for a qcow2 v3 source the `bitmaps size` its persistent
//! bitmaps take. A raw output is as large as the disk.

use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use qimg::chain::ImageFormat;
use qimg::tools::measure::{MeasureOptions, data_bytes};

use crate::args::{image_format, json_output, parse_size};
use crate::chain::{Layer, open_chain, source_format};
use crate::create_opts::takes;
use crate::status::open_msg;

/// Arguments of `qimg measure`.
#[derive(clap::Args)]
pub struct MeasureArgs {
    /// Output format: human (the default) or json.
    #[arg(long, default_value = "human")]
    output: String,
    /// Format of the image to measure for: raw (the default, as qemu-img) or qcow2.
    #[arg(short = 'O', long = "target-format")]
    out_fmt: Option<String>,
    /// Options of the image to measure for, comma separated, as for `create`.
    #[arg(short = 'o', long = "options", action = clap::ArgAction::Append)]
    options: Vec<String>,
    /// Format of FILE: qcow2 or raw (probed when absent).
    #[arg(short = 'f', long = "format")]
    fmt: Option<String>,
    /// Accepted for qemu-img compatibility: measure opens FILE read-only.
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// Measure internal snapshot `NAME_OR_ID` (or `snapshot.id=ID,snapshot.name=NAME`)
    /// instead of the disk, as `convert -l` copies it.
    #[arg(short = 'l', long = "snapshot")]
    snapshot: Option<String>,
    /// Measure for an empty image of this virtual size.
    #[arg(long = "size", allow_hyphen_values = true)]
    size: Option<String>,
    /// The image whose data the new image would hold.
    filename: Option<String>,
}

/// The `-o` options measure looks at.
struct Target {
    opts: MeasureOptions,
    v3: bool,
    prealloc_data: bool,
    has_backing: bool,
}

/// Parses the `-o` pairs for format `fmt` with qemu-img's checks and messages.
fn target_options(pairs: &[String], fmt: &str) -> Result<Target> {
    // qemu-img prints this as a second error line.
    let invalid = format!(
        "{}: Invalid options for file format '{fmt}'",
        crate::status::program()
    );
    let mut get = std::collections::HashMap::new();
    for p in pairs {
        let (k, v) = p.split_once('=').unwrap_or((p.as_str(), ""));
        if !takes(fmt, k) {
            bail!("Invalid parameter '{k}'\n{invalid}");
        }
        match k {
            "size" | "cluster_size" if parse_size(v).is_none() => {
                bail!("{}\n{invalid}", crate::args::size_error(k, v))
            }
            "extended_l2" | "lazy_refcounts" | "data_file_raw"
                if !matches!(v, "on" | "off" | "yes" | "no" | "true" | "false") =>
            {
                bail!("Parameter '{k}' expects 'on' or 'off'\n{invalid}")
            }
            "refcount_bits" if v.parse::<u64>().is_err() => {
                bail!("Parameter 'refcount_bits' expects a number\n{invalid}")
            }
            _ => {}
        }
        get.insert(k.to_string(), v.to_string());
    }
    let flag = |k: &str| {
        get.get(k)
            .is_some_and(|v| matches!(v.as_str(), "on" | "yes" | "true"))
    };
    let mut t = Target {
        opts: MeasureOptions {
            cluster_size: 65536,
            refcount_bits: 16,
            extended_l2: false,
            luks_bytes: 0,
        },
        v3: true,
        prealloc_data: false,
        has_backing: get.contains_key("backing_file"),
    };
    if fmt == "raw" {
        return Ok(t);
    }
    t.opts.extended_l2 = flag("extended_l2");
    if let Some(v) = get.get("cluster_size") {
        let cs = parse_size(v).unwrap_or(0);
        if !cs.is_power_of_two() || !(512..=2 << 20).contains(&cs) {
            bail!("Cluster size must be a power of two between 512 and 2048k");
        }
        t.opts.cluster_size = cs;
    }
    if t.opts.extended_l2 && t.opts.cluster_size < 16384 {
        bail!("Extended L2 entries are only supported with cluster sizes of at least 16384 bytes");
    }
    if let Some(v) = get.get("compat") {
        t.v3 = match v.as_str() {
            "0.10" | "v2" => false,
            "1.1" | "v3" => true,
            _ => bail!("Invalid compatibility level: '{v}'"),
        };
    }
    if let Some(v) = get.get("refcount_bits") {
        let bits: u64 = v.parse().unwrap_or(0);
        if !bits.is_power_of_two() || bits > 64 {
            bail!("Refcount width must be a power of two and may not exceed 64 bits");
        }
        if !t.v3 && bits != 16 {
            bail!(
                "Different refcount widths than 16 bits require compatibility level 1.1 or \
                 above (use compat=1.1 or greater)"
            );
        }
        t.opts.refcount_bits = bits;
    }
    // LUKS encryption: the header area the image will hold (QEMU's `qcow2_measure`).
    let legacy = get
        .get("encryption")
        .is_some_and(|v| matches!(v.as_str(), "on" | "yes" | "true"));
    match get.get("encrypt.format").map(String::as_str) {
        Some("luks") => {
            let params = crate::create_opts::luks_params(&|k| get.get(k).cloned())
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            t.opts.luks_bytes =
                qimg::crypto::area_len(&params).map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        Some("aes") => {}
        None if legacy => {}
        None => {}
        Some(other) => bail!("Parameter 'format' does not accept value '{other}'"),
    }
    if let Some(v) = get.get("preallocation") {
        t.prealloc_data = match v.as_str() {
            "off" | "metadata" => false,
            "falloc" | "full" => true,
            _ => bail!("invalid parameter value: {v}"),
        };
    }
    Ok(t)
}

/// The figures measure prints.
struct Measured {
    required: u64,
    fully_allocated: u64,
    bitmaps: Option<u64>,
}

/// Runs `qimg measure`.
pub fn run(args: MeasureArgs) -> Result<()> {
    let json = json_output(&args.output, "measure").map_err(anyhow::Error::msg)?;
    let size = match &args.size {
        None => None,
        Some(s) => Some(crate::args::size_argument("image size", s).map_err(anyhow::Error::msg)?),
    };
    match (&args.filename, size) {
        (None, None) => bail!("Either --size N or one filename must be specified."),
        (Some(_), Some(_)) => bail!("--size N cannot be used together with a filename."),
        _ => {}
    }
    let out_fmt = args.out_fmt.as_deref().unwrap_or("raw");
    if image_format(out_fmt).is_none() {
        bail!("Block driver '{out_fmt}' does not support size measurement");
    }
    let pairs = crate::args::option_list(&args.options)?;
    let target = target_options(&pairs, out_fmt)?;
    let m = match &args.filename {
        None => measure_empty(out_fmt, &target, size.unwrap_or(0))?,
        Some(file) => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("cannot start the I/O runtime")?;
            rt.block_on(measure_file(&args, file, out_fmt, &target))?
        }
    };
    if json {
        outln!("{{");
        if let Some(b) = m.bitmaps {
            outln!("    \"bitmaps\": {b},");
        }
        outln!("    \"required\": {},", m.required);
        outln!("    \"fully-allocated\": {}", m.fully_allocated);
        outln!("}}");
    } else {
        outln!("required size: {}", m.required);
        outln!("fully allocated size: {}", m.fully_allocated);
        if let Some(b) = m.bitmaps {
            outln!("bitmaps size: {b}");
        }
    }
    Ok(())
}

/// A raw image is as large as its disk (rounded up to 512 bytes).
fn raw_size(size: u64) -> Measured {
    let s = size.next_multiple_of(512);
    Measured {
        required: s,
        fully_allocated: s,
        bitmaps: None,
    }
}

fn measure_empty(out_fmt: &str, t: &Target, size: u64) -> Result<Measured> {
    if out_fmt == "raw" {
        return Ok(raw_size(size));
    }
    t.opts.check_size(size).map_err(|e| anyhow!("{e}"))?;
    let data = if t.prealloc_data {
        size.next_multiple_of(t.opts.cluster_size)
    } else {
        0
    };
    Ok(Measured {
        required: t.opts.required(size, data).map_err(|e| anyhow!("{e}"))?,
        fully_allocated: t.opts.fully_allocated(size).map_err(|e| anyhow!("{e}"))?,
        bitmaps: None,
    })
}

async fn measure_file(
    args: &MeasureArgs,
    file: &str,
    out_fmt: &str,
    t: &Target,
) -> Result<Measured> {
    let path = Path::new(file);
    let fmt = source_format(path, file, args.fmt.as_deref()).map_err(|e| open_msg(e, file))?;
    let layers = open_chain(path, file, fmt, args.force_share)
        .await
        .map_err(|e| open_msg(e, file))?;
    if let Some(sn) = &args.snapshot {
        let sn = crate::chain::snapshot_param(sn)?;
        crate::chain::view_snapshot(&layers, &sn).await?;
    }
    let size = layers.size();
    if out_fmt == "raw" {
        return Ok(raw_size(size));
    }
    let cs = t.opts.cluster_size;
    let aligned = size.next_multiple_of(cs);
    let data = if t.prealloc_data || t.has_backing {
        aligned
    } else {
        let mut entries = Vec::new();
        let mut at = 0;
        while at < size {
            let n = (1u64 << 30).min(size - at);
            layers
                .status(at, n, &mut entries)
                .await
                .with_context(|| format!("Error getting block status of '{file}'"))?;
            at += n;
        }
        data_bytes(
            entries
                .iter()
                .filter(|e| !e.zero && e.data && e.present)
                .map(|e| (e.start, e.length)),
            cs,
        )
    };
    let bitmaps = match (&layers[0], fmt) {
        (Layer::Qcow2 { .. }, ImageFormat::Qcow2) if t.v3 => {
            source_bitmaps(path)?.map(|list| t.opts.bitmaps_size(size, &list))
        }
        _ => None,
    };
    Ok(Measured {
        required: t.opts.required(size, data).map_err(|e| anyhow!("{e}"))?,
        fully_allocated: t.opts.fully_allocated(size).map_err(|e| anyhow!("{e}"))?,
        bitmaps,
    })
}

/// The persistent bitmaps of a qcow2 v3 image as (name length, granularity); `None` for a
/// v2 image (which cannot hold any).
fn source_bitmaps(path: &Path) -> Result<Option<Vec<(usize, u64)>>> {
    let info = qimg::tools::info::image_info(path, Some(ImageFormat::Qcow2))
        .map_err(|e| anyhow!("{e}"))?;
    let Some(spec) = info.format_specific else {
        return Ok(None);
    };
    let data = spec.data;
    if data.get("compat").and_then(|v| v.as_str()) != Some("1.1") {
        return Ok(None);
    }
    let list = data
        .get("bitmaps")
        .and_then(|b| b.as_array())
        .map(|a| {
            a.iter()
                .map(|b| {
                    let name = b.get("name").and_then(|n| n.as_str()).unwrap_or("");
                    let g = b
                        .get("granularity")
                        .and_then(|g| g.as_u64())
                        .unwrap_or(65536);
                    (name.len(), g)
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(Some(list))
}

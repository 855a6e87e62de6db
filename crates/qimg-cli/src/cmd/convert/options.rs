//! `qimg convert`'s arguments, parsed and checked (qemu-img's messages) into [`Settings`]
//! before anything is opened or created.

use std::path::Path;

use anyhow::{Result, anyhow, bail};
use qimg::chain::ImageFormat;
use qimg::tools::create::CreateOptions;

use super::ConvertArgs;
use crate::args::image_format;
use crate::cache_mode::CacheMode;
use crate::chain::source_format;
use crate::create_opts;

/// What the arguments ask for.
pub(super) struct Settings {
    /// The sources (as named, and their format), concatenated in this order.
    pub(super) sources: Vec<(String, ImageFormat)>,
    /// The output, as named.
    pub(super) dst_file: String,
    /// The output's format (`-O`, raw by default).
    pub(super) out_fmt: ImageFormat,
    /// The options of the new output (`-o`, `-B`, `-F`); its size is set once the sources
    /// are open.
    pub(super) create_options: CreateOptions,
    /// A value of `-o` the format driver refuses once it creates the output (qemu's words).
    pub(super) refused: Option<String>,
    /// The output gets (or, with `-n`, is said to have) a backing file.
    pub(super) has_backing: bool,
    /// `-n`: the output exists and is not created.
    pub(super) no_create: bool,
    /// `-c`.
    pub(super) compress: bool,
    /// `-C`.
    pub(super) copy_range: bool,
    /// `--salvage`.
    pub(super) salvage: bool,
    /// `-q`.
    pub(super) quiet: bool,
    /// `-S`: smallest run of zeros left unwritten (0: write everything).
    pub(super) sparse: u64,
    /// `-m`: chunks in flight.
    pub(super) parallel: usize,
    /// `-r`: bytes per second (0: no limit).
    pub(super) rate_limit: u64,
    /// `-W`.
    pub(super) out_of_order: bool,
    /// `-p` without `-q`.
    pub(super) progress: bool,
    /// `-t` and `-T`.
    pub(super) cache: CacheMode,
    pub(super) src_cache: CacheMode,
    /// `-U`: read the sources without keeping others from writing them.
    pub(super) force_share: bool,
    /// `--bitmaps`, `--skip-broken-bitmaps`.
    pub(super) bitmaps: bool,
    pub(super) skip_broken_bitmaps: bool,
    /// `--target-is-zero` (with `-n`).
    pub(super) target_is_zero: bool,
    /// `-l`: the snapshot to convert, as `(id, name)` (the same string when either may
    /// match).
    pub(super) snapshot: Option<(Option<String>, Option<String>)>,
}

/// Parses and checks the arguments before anything is opened or created; `None` when `-o help`
/// was asked for (and printed).
pub(super) fn settings(args: ConvertArgs) -> Result<Option<Settings>> {
    if args.target_image_opts {
        if !args.no_create {
            bail!("--target-image-opts requires use of -n flag");
        }
        if args.out_fmt.is_some() {
            bail!("--image-opts and --format are mutually exclusive");
        }
    }
    // With --target-image-opts the option string names the format.
    let named = args
        .target_image_opts
        .then(|| {
            args.files
                .last()
                .and_then(|f| crate::image_spec::format_for(f))
        })
        .flatten();
    let out_name = args
        .out_fmt
        .clone()
        .or(named)
        .unwrap_or_else(|| "raw".to_string());
    let out_fmt =
        image_format(&out_name).ok_or_else(|| anyhow!("Unknown file format '{out_name}'"))?;
    let pairs = crate::args::option_list(&args.options)?;
    if pairs.iter().any(|p| p == "help" || p == "?") {
        // (QEMU names the protocol options once it knows the target: given a source and
        // the destination.)
        out!(
            "{}",
            create_opts::help_text(&out_name, args.files.len() >= 2)
        );
        return Ok(None);
    }
    if args.target_is_zero && !args.no_create {
        bail!("--target-is-zero requires use of -n flag");
    }
    let snapshot = args
        .snapshot
        .as_deref()
        .map(crate::chain::snapshot_param)
        .transpose()?;
    if args.skip_broken_bitmaps && !args.bitmaps {
        bail!("Use of --skip-broken-bitmaps requires --bitmaps");
    }
    let cache = CacheMode::parse_option(args.cache.as_deref(), "cache")?;
    let src_cache = CacheMode::parse_option(args.src_cache.as_deref(), "source cache")?;
    if out_fmt == ImageFormat::Raw {
        if args.backing.is_some() {
            bail!("Backing file not supported for file format 'raw'");
        }
        if args.backing_fmt.is_some() {
            bail!("Backing file format not supported for file format 'raw'");
        }
    }
    if args.compress && out_fmt != ImageFormat::Qcow2 {
        bail!("Compression not supported for this file format");
    }
    if args.copy_range && args.salvage {
        bail!("Cannot use copy offloading in salvaging mode");
    }
    if args.copy_range && (args.compress || args.sparse.is_some()) {
        bail!(
            "Cannot enable copy offloading when -{} is used",
            if args.compress { 'c' } else { 'S' }
        );
    }
    let sparse = match &args.sparse {
        // -C copies data ranges whole, as -S 0 but leaving the source's zero ranges out.
        None if args.copy_range => 0,
        None => 4096,
        Some(s) => match crate::args::size_argument("buffer size for sparse output", s)
            .map_err(anyhow::Error::msg)?
        {
            v if v % 512 == 0 && v <= 16 << 20 => v,
            _ => bail!(
                "Invalid buffer size for sparse output specified. Valid sizes are multiples of \
                 512 up to 16777216. Select 0 to disable sparse detection (fully allocates output)."
            ),
        },
    };
    let parallel = match &args.parallel {
        None => 8,
        Some(s) => match s.parse::<usize>() {
            Ok(n) if (1..=16).contains(&n) => n,
            _ => bail!("Invalid number of coroutines specified. Must be between 1 and 16."),
        },
    };
    let rate_limit = match &args.rate_limit {
        None => 0,
        Some(r) => crate::args::size_argument("rate limit", r).map_err(anyhow::Error::msg)?,
    };
    let Some((dst_file, src_files)) = args.files.split_last().filter(|(_, s)| !s.is_empty()) else {
        bail!("Must specify image file name");
    };

    // The output's options, parsed and checked before anything is opened or created; -B and
    // -F override -o backing_file and backing_fmt, as in qemu-img.
    let mut create_options = CreateOptions::default();
    let mut given = create_opts::Given::default();
    create_opts::apply(&mut create_options, &mut given, &pairs, &out_name)?;
    if args.no_create && !pairs.is_empty() {
        bail!("-o has no effect with -n (the output is not created)");
    }
    if let Some(b) = &args.backing {
        create_options.backing_file = Some(b.clone());
    }
    if let Some(f) = &args.backing_fmt {
        create_options.backing_fmt = Some(f.clone());
    }
    if snapshot.is_some() && src_files.len() > 1 {
        bail!("No support for concatenating multiple snapshot");
    }
    if args.bitmaps && src_files.len() > 1 {
        bail!("Copying bitmaps only possible with single source");
    }
    let has_backing = create_options.backing_file.is_some();
    if has_backing && src_files.len() > 1 {
        bail!(
            "Having a backing file for the target makes no sense when concatenating multiple \
             input images"
        );
    }
    if !args.no_create {
        if has_backing && create_options.backing_fmt.is_none() {
            bail!("Use of backing file requires explicit backing format");
        }
        if !has_backing && create_options.backing_fmt.is_some() {
            bail!(
                "{dst_file}: error while converting {out_name}: Backing format cannot be used \
                 without backing file"
            );
        }
    }

    let sources = src_files
        .iter()
        .map(|file| {
            let fmt = source_format(Path::new(file), file, args.src_fmt.as_deref())?;
            Ok((file.clone(), fmt))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Some(Settings {
        sources,
        dst_file: dst_file.clone(),
        out_fmt,
        create_options,
        refused: given.refused,
        has_backing,
        no_create: args.no_create,
        compress: args.compress,
        copy_range: args.copy_range,
        salvage: args.salvage,
        quiet: args.quiet,
        sparse,
        parallel,
        rate_limit,
        out_of_order: args.out_of_order,
        progress: args.progress && !args.quiet,
        cache,
        src_cache,
        force_share: args.force_share,
        bitmaps: args.bitmaps,
        skip_broken_bitmaps: args.skip_broken_bitmaps,
        target_is_zero: args.target_is_zero,
        snapshot,
    }))
}

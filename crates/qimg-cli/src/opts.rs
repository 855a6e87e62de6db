//! qemu-img style option strings: `-o key=value,key=value` and sizes with suffixes.

use anyhow::{Result, bail};
use qimg::format::header::CompressionType;
use qimg::tools::create::{Compat, CreateOptions, Preallocation};

/// Parses a size the way qemu-img does: a decimal number, optionally fractional, with an
/// optional suffix B, K, M, G, T, P or E (case-insensitive, powers of 1024).
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mult) = match s.chars().last()? {
        c if c.is_ascii_digit() || c == '.' => (s, 1u64),
        c => {
            let m = match c.to_ascii_lowercase() {
                'b' => 1u64,
                'k' => 1 << 10,
                'm' => 1 << 20,
                'g' => 1 << 30,
                't' => 1 << 40,
                'p' => 1 << 50,
                'e' => 1 << 60,
                _ => return None,
            };
            (&s[..s.len() - 1], m)
        }
    };
    if num.is_empty() || !num.chars().all(|c| c.is_ascii_digit() || c == '.') {
        return None;
    }
    if let Some((int, frac)) = num.split_once('.') {
        if frac.contains('.') || mult == 1 {
            return None;
        }
        let int: u64 = if int.is_empty() { 0 } else { int.parse().ok()? };
        let whole = int.checked_mul(mult)?;
        // Fraction: exact decimal arithmetic on up to 18 digits.
        let digits = &frac[..frac.len().min(18)];
        let f: u128 = if digits.is_empty() {
            0
        } else {
            digits.parse().ok()?
        };
        let part = f * u128::from(mult) / 10u128.pow(digits.len() as u32);
        return whole.checked_add(u64::try_from(part).ok()?);
    }
    num.parse::<u64>().ok()?.checked_mul(mult)
}

fn parse_bool(key: &str, v: &str) -> Result<bool> {
    match v {
        "on" | "yes" | "true" | "y" => Ok(true),
        "off" | "no" | "false" | "n" => Ok(false),
        _ => bail!("Parameter '{key}' expects 'on' or 'off'"),
    }
}

/// Splits `a=b,c=d` honouring qemu's `,,` escape for a literal comma.
pub fn split_opts(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == ',' {
            if chars.peek() == Some(&',') {
                chars.next();
                cur.push(',');
            } else {
                out.push(std::mem::take(&mut cur));
            }
        } else {
            cur.push(c);
        }
    }
    out.push(cur);
    out.into_iter().filter(|s| !s.is_empty()).collect()
}

/// The options given by the user, kept as typed for the `Formatting ...` line.
#[derive(Debug, Default)]
pub struct Given {
    /// (key, value as typed) in the order given; later ones win.
    pub pairs: Vec<(String, String)>,
}

impl Given {
    fn get(&self, key: &str) -> Option<&str> {
        self.pairs
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// Every option qimg create knows, with its help text (as `-o help` prints them).
pub const QCOW2_OPTIONS: &[(&str, &str, &str)] = &[
    ("backing_file", "<str>", "File name of a base image"),
    ("backing_fmt", "<str>", "Image format of the base image"),
    ("cluster_size", "<size>", "qcow2 cluster size"),
    (
        "compat",
        "<str>",
        "Compatibility level (v2 [0.10] or v3 [1.1])",
    ),
    (
        "compression_type",
        "<str>",
        "Compression method used for image cluster compression (zlib, zstd)",
    ),
    ("data_file", "<str>", "File name of an external data file"),
    (
        "data_file_raw",
        "<bool (on/off)>",
        "The external data file must stay valid as a raw image",
    ),
    ("extended_l2", "<bool (on/off)>", "Extended L2 tables"),
    (
        "lazy_refcounts",
        "<bool (on/off)>",
        "Postpone refcount updates",
    ),
    (
        "preallocation",
        "<str>",
        "Preallocation mode (allowed values: off, metadata, falloc, full)",
    ),
    (
        "refcount_bits",
        "<num>",
        "Width of a reference count entry in bits",
    ),
    ("size", "<size>", "Virtual disk size"),
];

/// Options of the raw format.
pub const RAW_OPTIONS: &[(&str, &str, &str)] = &[
    (
        "preallocation",
        "<str>",
        "Preallocation mode (allowed values: off, falloc, full)",
    ),
    ("size", "<size>", "Virtual disk size"),
];

/// The `-o help` text.
pub fn help_text(fmt: &str) -> String {
    let list = if fmt == "raw" {
        RAW_OPTIONS
    } else {
        QCOW2_OPTIONS
    };
    let mut s = format!("Supported {fmt} options:\n");
    for (k, t, d) in list {
        let left = format!("{k}={t}");
        s.push_str(&format!("  {left:<22} - {d}\n"));
    }
    s
}

/// Applies `-o` pairs to `opts`, recording them in `given`.
pub fn apply(
    opts: &mut CreateOptions,
    given: &mut Given,
    pairs: &[String],
    fmt: &str,
) -> Result<()> {
    let known: Vec<&str> = if fmt == "raw" {
        RAW_OPTIONS
    } else {
        QCOW2_OPTIONS
    }
    .iter()
    .map(|o| o.0)
    .collect();
    for p in pairs {
        let (k, v) = p.split_once('=').unwrap_or((p.as_str(), ""));
        if !known.contains(&k) {
            bail!("Invalid parameter '{k}'");
        }
        match k {
            "size" => {
                opts.size = Some(
                    parse_size(v)
                        .ok_or_else(|| anyhow::anyhow!("Parameter 'size' expects a size: '{v}'"))?,
                )
            }
            "cluster_size" => {
                opts.cluster_size = parse_size(v).ok_or_else(|| {
                    anyhow::anyhow!("Parameter 'cluster_size' expects a size: '{v}'")
                })?
            }
            "compat" => {
                opts.compat = match v {
                    "0.10" | "v2" => Compat::V2,
                    "1.1" | "v3" => Compat::V3,
                    _ => bail!(
                        "Parameter 'compat' does not accept value '{v}' (use v2, 0.10, v3 or 1.1)"
                    ),
                }
            }
            "extended_l2" => opts.extended_l2 = parse_bool(k, v)?,
            "lazy_refcounts" => opts.lazy_refcounts = parse_bool(k, v)?,
            "data_file_raw" => opts.data_file_raw = parse_bool(k, v)?,
            "refcount_bits" => {
                opts.refcount_bits = v.parse().map_err(|_| {
                    anyhow::anyhow!("Parameter 'refcount_bits' expects a number: '{v}'")
                })?
            }
            "backing_file" => opts.backing_file = Some(v.to_string()),
            "backing_fmt" => opts.backing_fmt = Some(v.to_string()),
            "data_file" => opts.data_file = Some(v.to_string()),
            "compression_type" => {
                opts.compression_type = match v {
                    "zlib" => CompressionType::Zlib,
                    "zstd" => CompressionType::Zstd,
                    _ => bail!(
                        "Parameter 'compression_type' does not accept value '{v}' (use zlib or zstd)"
                    ),
                }
            }
            "preallocation" => {
                opts.preallocation = match v {
                    "off" => Preallocation::Off,
                    "metadata" if fmt != "raw" => Preallocation::Metadata,
                    "falloc" => Preallocation::Falloc,
                    "full" => Preallocation::Full,
                    _ => bail!("Parameter 'preallocation' does not accept value '{v}'"),
                }
            }
            _ => unreachable!("checked against the known list"),
        }
        given.pairs.push((k.to_string(), v.to_string()));
    }
    Ok(())
}

/// The `Formatting '...', fmt=...` line qemu-img prints, in its field order.
pub fn formatting_line(
    file: &str,
    fmt: &str,
    opts: &CreateOptions,
    given: &Given,
    size: u64,
) -> String {
    let mut parts = vec![format!("fmt={fmt}")];
    // Boolean options print as typed when given, else as on/off.
    let flag = |key: &str, value: bool| {
        given
            .get(key)
            .map(String::from)
            .unwrap_or_else(|| if value { "on" } else { "off" }.to_string())
    };
    if fmt == "raw" {
        if let Some(p) = given.get("preallocation") {
            parts.push(format!("preallocation={p}"));
        }
        parts.push(format!("size={size}"));
        return format!("Formatting '{file}', {}", parts.join(" "));
    }
    parts.push(format!("cluster_size={}", opts.cluster_size));
    parts.push(format!(
        "extended_l2={}",
        flag("extended_l2", opts.extended_l2)
    ));
    if let Some(p) = given.get("preallocation") {
        parts.push(format!("preallocation={p}"));
    }
    parts.push(format!("compression_type={}", opts.compression_type.name()));
    parts.push(format!("size={size}"));
    if let Some(v) = given.get("compat") {
        parts.push(format!("compat={v}"));
    }
    if let Some(b) = &opts.backing_file {
        parts.push(format!("backing_file={b}"));
    }
    if let Some(b) = &opts.backing_fmt {
        parts.push(format!("backing_fmt={b}"));
    }
    if let Some(d) = &opts.data_file {
        parts.push(format!("data_file={d}"));
    }
    if let Some(v) = given.get("data_file_raw") {
        parts.push(format!("data_file_raw={v}"));
    }
    parts.push(format!(
        "lazy_refcounts={}",
        flag("lazy_refcounts", opts.lazy_refcounts)
    ));
    parts.push(format!("refcount_bits={}", opts.refcount_bits));
    format!("Formatting '{file}', {}", parts.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_like_qemu_img() {
        assert_eq!(parse_size("1000"), Some(1000));
        assert_eq!(parse_size("64k"), Some(65536));
        assert_eq!(parse_size("1.5M"), Some(1_572_864));
        assert_eq!(parse_size("2G"), Some(2 << 30));
        assert_eq!(parse_size("1E"), Some(1 << 60));
        assert_eq!(parse_size("16E"), None);
        assert_eq!(parse_size("10X"), None);
        assert_eq!(parse_size("-5"), None);
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("1.5"), None);
    }

    #[test]
    fn double_commas_escape_a_comma() {
        assert_eq!(
            split_opts("backing_file=a,,b,size=1M"),
            vec!["backing_file=a,b", "size=1M"]
        );
    }
}

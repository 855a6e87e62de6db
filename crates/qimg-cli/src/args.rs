//! Option values every command parses the same way, with qemu-img's rules: sizes with
//! suffixes, `-o` option strings, on/off switches, format names and `--output`.

use anyhow::Result;
use qimg::chain::ImageFormat;

/// Parses a size the way qemu-img does: a decimal number, optionally fractional, with an
/// optional suffix B, K, M, G, T, P or E (case-insensitive, powers of 1024), or a
/// hexadecimal integer (`0x10000`; no fraction or suffix, as qemu's `qemu_strtosz`).
pub fn parse_size(s: &str) -> Option<u64> {
    parse_size_wide(s).and_then(|v| u64::try_from(v).ok())
}

/// qemu-img's `cvtnum_full(name, value, 0, INT64_MAX)` for a size argument (`name`: "image
/// size"): a value that does not parse is `Invalid NAME specified: 'VALUE'.`; a negative one,
/// one past 64 bits or past `i64::MAX`, `Invalid NAME specified. Must be between 0 and
/// 9223372036854775807.`
pub fn size_argument(name: &str, s: &str) -> std::result::Result<u64, String> {
    let range = || {
        format!(
            "Invalid {name} specified. Must be between 0 and {}.",
            i64::MAX
        )
    };
    if s.trim_start().starts_with('-') {
        return Err(range());
    }
    match parse_size_wide(s) {
        Some(v) if v <= i64::MAX as u128 => Ok(v as u64),
        Some(_) => Err(range()),
        None => Err(format!("Invalid {name} specified: '{s}'.")),
    }
}

/// [`parse_size`] without its 64-bit limit (so that a value too large is told apart from
/// one that does not parse).
fn parse_size_wide(s: &str) -> Option<u128> {
    let s = s.trim();
    if let Some(hex) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        if hex.is_empty() || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        return u128::from_str_radix(hex, 16).ok();
    }
    let (num, mult) = match s.chars().last()? {
        c if c.is_ascii_digit() || c == '.' => (s, 1u128),
        c => {
            let m = match c.to_ascii_lowercase() {
                'b' => 1u128,
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
        let int: u128 = if int.is_empty() { 0 } else { int.parse().ok()? };
        let whole = int.checked_mul(mult)?;
        // Fraction: exact decimal arithmetic on up to 18 digits.
        let digits = &frac[..frac.len().min(18)];
        let f: u128 = if digits.is_empty() {
            0
        } else {
            digits.parse().ok()?
        };
        let part = f * mult / 10u128.pow(digits.len() as u32);
        return whole.checked_add(part);
    }
    num.parse::<u128>().ok()?.checked_mul(mult)
}

/// The `-o` strings of `create`, `convert`, `amend` and `measure` split into `key=value`
/// items, each string first checked as qemu-img's `accumulate_options` does: an empty one,
/// one starting with a comma or ending with an odd number of commas is `Invalid option list:
/// S`.
pub fn option_list(options: &[String]) -> Result<Vec<String>> {
    for o in options {
        let trailing = o.len() - o.trim_end_matches(',').len();
        if o.is_empty() || o.starts_with(',') || trailing % 2 == 1 {
            anyhow::bail!("Invalid option list: {o}");
        }
    }
    Ok(options.iter().flat_map(|o| split_opts(o)).collect())
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

/// An on/off switch as qemu's `-o` and `--image-opts` take it.
pub fn on_off(key: &str, v: &str) -> Result<bool, String> {
    match v {
        "on" | "yes" | "true" | "y" => Ok(true),
        "off" | "no" | "false" | "n" => Ok(false),
        _ => Err(format!("Parameter '{key}' expects 'on' or 'off'")),
    }
}

/// The image format named by `-f`/`-O`/`driver=` (`qcow2` or `raw`).
pub fn image_format(name: &str) -> Option<ImageFormat> {
    match name {
        // QEMU's null device reads and writes as a raw image would (see `is_null_driver`).
        "null-co" | "null-aio" => Some(ImageFormat::Raw),
        // QEMU's file driver as the image: the file's bytes, as a raw image reads them.
        "file" => Some(ImageFormat::Raw),
        _ => ImageFormat::from_name(name.as_bytes()),
    }
}

/// Whether `name` is QEMU's null driver (a node of its own, not raw over a file).
pub fn is_null_driver(name: &str) -> bool {
    matches!(name, "null-co" | "null-aio")
}

/// `--output human|json` of command `sub`: whether the output is JSON (refused in
/// qemu-img's words, with its hint).
pub fn json_output(value: &str, sub: &str) -> Result<bool, String> {
    match value {
        "human" => Ok(false),
        "json" => Ok(true),
        other => Err(format!(
            "--output expects 'human' or 'json' not '{other}'\nTry 'qimg {sub} --help' for more info"
        )),
    }
}

/// `map`'s `--start-offset` and `--max-length`: [`size_argument`] as an error (`what` names
/// it).
pub fn parse_offset(value: &str, what: &str) -> Result<u64> {
    size_argument(what, value).map_err(anyhow::Error::msg)
}

/// qemu's message for a size option `key` whose `value` does not parse (`parse_option_size`'s):
/// a negative number or one past 64 bits is out of range, anything else not a number.
pub fn size_error(key: &str, value: &str) -> String {
    let t = value.trim_start();
    let negative = t
        .strip_prefix('-')
        .is_some_and(|r| r.trim_start().starts_with(|c: char| c.is_ascii_digit()));
    let too_large = parse_size_wide(value).is_some_and(|v| v > u64::MAX as u128);
    if negative || too_large {
        return format!("Value '{value}' is out of range for parameter '{key}'");
    }
    format!(
        "Parameter '{key}' expects a non-negative number below 2^64\nOptional suffix k, M, G, \
         T, P or E means kilo-, mega-, giga-, tera-, peta-\nand exabytes, respectively."
    )
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
        // Hexadecimal as qemu takes it: integers only, 'b' and 'e' are digits.
        assert_eq!(parse_size("0x10000"), Some(65536));
        assert_eq!(parse_size("0X1e"), Some(30));
        assert_eq!(parse_size("0x1B"), Some(27));
        assert_eq!(parse_size("0x1k"), None);
        assert_eq!(parse_size("0x"), None);
        assert_eq!(parse_size("0x1.5"), None);
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

//! The words of a qemu-io command line: numbers with qemu's size rules, pattern bytes, and
//! GNU `getopt` (options may follow operands, `--` ends them, `-vP1` clusters them).

/// The longest request qemu's block layer accepts: `INT_MAX` rounded down to 512 bytes.
pub const MAX_REQUEST: u64 = 2_147_483_136;

/// Why a number did not parse (qemu-io prints each differently).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NumError {
    /// Not a number, or an unknown suffix.
    Invalid,
    /// Negative or above `i64::MAX`.
    TooLarge,
}

/// The line qemu-io prints when argument `arg` is not a number.
pub fn num_error_line(e: NumError, arg: &str) -> String {
    match e {
        NumError::Invalid => format!(
            "Parsing error: non-numeric argument, or extraneous/unrecognized suffix -- {arg}"
        ),
        NumError::TooLarge => format!("Parsing error: argument too large -- {arg}"),
    }
}

/// A byte count or offset as qemu-io reads it: decimal with an optional fraction and a
/// binary suffix (`B`, `K`, `M`, `G`, `T`, `P`, `E`, either case; a fraction needs a suffix
/// other than `B` and is rounded to the nearest byte), or `0x` hex without suffix; a leading
/// `+` is allowed, a `-` makes the value out of range; at most `i64::MAX`.
pub fn parse_num(s: &str) -> Result<u64, NumError> {
    let body = s.strip_prefix('+').unwrap_or(s);
    if body.starts_with('-') {
        return Err(NumError::TooLarge);
    }
    let value = if let Some(hex) = body.strip_prefix("0x").or_else(|| body.strip_prefix("0X")) {
        if hex.is_empty() || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(NumError::Invalid);
        }
        let digits = hex.trim_start_matches('0');
        if digits.len() > 16 {
            return Err(NumError::TooLarge);
        }
        u64::from_str_radix(if digits.is_empty() { "0" } else { digits }, 16)
            .map_err(|_| NumError::Invalid)?
    } else {
        decimal(body)?
    };
    if value > i64::MAX as u64 {
        return Err(NumError::TooLarge);
    }
    Ok(value)
}

/// The decimal form of [`parse_num`].
fn decimal(s: &str) -> Result<u64, NumError> {
    let end = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, suffix) = s.split_at(end);
    let mult: u64 = match suffix {
        "" => 1,
        "b" | "B" => 1,
        "k" | "K" => 1 << 10,
        "m" | "M" => 1 << 20,
        "g" | "G" => 1 << 30,
        "t" | "T" => 1 << 40,
        "p" | "P" => 1 << 50,
        "e" | "E" => 1 << 60,
        _ => return Err(NumError::Invalid),
    };
    let (int, frac) = match num.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (num, None),
    };
    if frac.is_some_and(|f| f.contains('.')) {
        return Err(NumError::Invalid);
    }
    if int.is_empty() && frac.is_none_or(str::is_empty) {
        return Err(NumError::Invalid);
    }
    let int_value: u64 = if int.is_empty() {
        0
    } else {
        let digits = int.trim_start_matches('0');
        if digits.len() > 20 {
            return Err(NumError::TooLarge);
        }
        if digits.is_empty() {
            0
        } else {
            digits.parse().map_err(|_| NumError::TooLarge)?
        }
    };
    let whole = int_value.checked_mul(mult).ok_or(NumError::TooLarge)?;
    let Some(frac) = frac else {
        return Ok(whole);
    };
    // A fraction needs a real unit: `1.5` and `1.5b` are refused.
    if suffix.is_empty() || mult == 1 {
        return Err(NumError::Invalid);
    }
    let f: f64 = format!("0.{frac}0")
        .parse()
        .map_err(|_| NumError::Invalid)?;
    let part = (f * mult as f64 + 0.5).floor();
    if part >= 18_446_744_073_709_551_616.0 {
        return Err(NumError::TooLarge);
    }
    whole.checked_add(part as u64).ok_or(NumError::TooLarge)
}

/// A pattern byte (`-P`): C's `strtol` with base 0 (decimal, `0x` hex, leading-zero octal),
/// the whole word, within 0..=255.
pub fn parse_pattern(s: &str) -> Option<u8> {
    let (neg, body) = match s.strip_prefix('-') {
        Some(b) => (true, b),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    let (radix, digits) =
        if let Some(h) = body.strip_prefix("0x").or_else(|| body.strip_prefix("0X")) {
            (16, h)
        } else if body.len() > 1 && body.starts_with('0') {
            (8, &body[1..])
        } else {
            (10, body)
        };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    let v = u64::from_str_radix(digits, radix).ok()?;
    if neg && v != 0 {
        return None;
    }
    u8::try_from(v).ok()
}

/// What `getopt` found in a command's words.
#[derive(Debug, Default)]
pub struct Opts {
    /// Options in order, with their arguments.
    pub opts: Vec<(char, Option<String>)>,
    /// The operands, in order.
    pub operands: Vec<String>,
}

impl Opts {
    /// Whether option `c` was given.
    pub fn has(&self, c: char) -> bool {
        self.opts.iter().any(|(o, _)| *o == c)
    }

    /// The argument of the last `c` given.
    pub fn arg(&self, c: char) -> Option<&str> {
        self.opts
            .iter()
            .rev()
            .find(|(o, _)| *o == c)
            .and_then(|(_, a)| a.as_deref())
    }
}

/// A `getopt` failure, with the line GNU getopt prints on stderr.
#[derive(Debug)]
pub struct OptError(pub String);

/// GNU `getopt` over `args` (without the command name `cmd`): `spec` lists the option letters,
/// a `:` after one that takes an argument. Options and operands may mix; `--` ends options.
pub fn getopt(cmd: &str, args: &[String], spec: &str) -> Result<Opts, OptError> {
    let takes = |c: char| -> Option<bool> {
        let i = spec.find(c)?;
        Some(spec[i + c.len_utf8()..].starts_with(':'))
    };
    let mut out = Opts::default();
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        i += 1;
        if a == "--" {
            out.operands.extend(args[i..].iter().cloned());
            break;
        }
        if !a.starts_with('-') || a == "-" {
            out.operands.push(a.clone());
            continue;
        }
        for (j, c) in a[1..].char_indices() {
            if c == ':' {
                return Err(OptError(format!("{cmd}: invalid option -- '{c}'")));
            }
            match takes(c) {
                None => return Err(OptError(format!("{cmd}: invalid option -- '{c}'"))),
                Some(false) => out.opts.push((c, None)),
                Some(true) => {
                    let rest = &a[1 + j + c.len_utf8()..];
                    let value = if !rest.is_empty() {
                        rest.to_string()
                    } else if i < args.len() {
                        i += 1;
                        args[i - 1].clone()
                    } else {
                        return Err(OptError(format!(
                            "{cmd}: option requires an argument -- '{c}'"
                        )));
                    };
                    out.opts.push((c, Some(value)));
                    break;
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_follow_qemu_io() {
        assert_eq!(parse_num("4096"), Ok(4096));
        assert_eq!(parse_num("64k"), Ok(65536));
        assert_eq!(parse_num("0X10"), Ok(16));
        assert_eq!(parse_num("+5"), Ok(5));
        assert_eq!(parse_num("08"), Ok(8));
        assert_eq!(parse_num("1.k"), Ok(1024));
        assert_eq!(parse_num(".5k"), Ok(512));
        assert_eq!(parse_num("1.0009k"), Ok(1025));
        assert_eq!(parse_num("0.1k"), Ok(102));
        assert_eq!(parse_num("1.7k"), Ok(1741));
        assert_eq!(parse_num("0.00048828125k"), Ok(1));
        assert_eq!(parse_num("7E"), Ok(7 << 60));
        assert_eq!(parse_num("0x10k"), Err(NumError::Invalid));
        assert_eq!(parse_num("1.5"), Err(NumError::Invalid));
        assert_eq!(parse_num("1.5b"), Err(NumError::Invalid));
        assert_eq!(parse_num("1e3"), Err(NumError::Invalid));
        assert_eq!(parse_num("0x"), Err(NumError::Invalid));
        assert_eq!(parse_num("1kB"), Err(NumError::Invalid));
        assert_eq!(parse_num("1M-1"), Err(NumError::Invalid));
        assert_eq!(parse_num("8E"), Err(NumError::TooLarge));
        assert_eq!(parse_num("-0"), Err(NumError::TooLarge));
        assert_eq!(parse_num("99999999999999999999"), Err(NumError::TooLarge));
        assert_eq!(parse_num("0x10000000000000000"), Err(NumError::TooLarge));
        assert_eq!(parse_num("7.9999999999999999999E"), Err(NumError::TooLarge));
    }

    #[test]
    fn pattern_bytes_are_strtol_base_0() {
        assert_eq!(parse_pattern("0xab"), Some(0xab));
        assert_eq!(parse_pattern("010"), Some(8));
        assert_eq!(parse_pattern("255"), Some(255));
        assert_eq!(parse_pattern("256"), None);
        assert_eq!(parse_pattern("-1"), None);
        assert_eq!(parse_pattern("0x"), None);
        assert_eq!(parse_pattern("1k"), None);
    }

    #[test]
    fn getopt_permutes_and_clusters() {
        let w = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
        let o = getopt("read", &w("0 16 -vP1 -q"), "CP:qv").unwrap();
        assert_eq!(o.operands, ["0", "16"]);
        assert!(o.has('v') && o.has('q'));
        assert_eq!(o.arg('P'), Some("1"));
        let o = getopt("read", &w("-P 1 -- -5"), "P:").unwrap();
        assert_eq!(o.operands, ["-5"]);
        let e = getopt("read", &w("-Z 0 1"), "P:").unwrap_err();
        assert_eq!(e.0, "read: invalid option -- 'Z'");
        let e = getopt("read", &w("0 1 -P"), "P:").unwrap_err();
        assert_eq!(e.0, "read: option requires an argument -- 'P'");
    }
}

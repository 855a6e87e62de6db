//! Number and option parsing for `qimg bench`, with qemu-img bench's rules and messages.
//!
//! qemu-img (10.0) parses the request count, queue depth, pattern byte and flush interval as
//! C integers (`qemu_strtol`, base 0: `0x` hex, a leading `0` octal, leading white space and a
//! sign allowed, nothing after the digits) and the offset, buffer size and step size as sizes
//! (`cvtnum`: decimal or `0x` hex, optional fraction and a B/K/M/G/T/P/E suffix in powers of
//! 1024). A value that does not parse is "Invalid NAME specified: 'VALUE'."; one out of range
//! is "Invalid NAME specified. Must be between MIN and MAX.".

use qimg::CacheOptions;

use crate::args::{on_off, parse_size, split_opts};

/// The two qemu messages.
fn invalid(name: &str, s: &str) -> String {
    format!("Invalid {name} specified: '{s}'.")
}

fn range(name: &str, min: u64, max: u64) -> String {
    format!("Invalid {name} specified. Must be between {min} and {max}.")
}

/// Splits optional leading white space and a sign off `s`; returns (negative, rest).
fn sign(s: &str) -> (bool, &str) {
    let s = s.trim_start_matches([' ', '\t', '\n', '\r', '\x0b', '\x0c']);
    if let Some(r) = s.strip_prefix('-') {
        (true, r)
    } else {
        (false, s.strip_prefix('+').unwrap_or(s))
    }
}

/// Digits of `s` in base 0 (C `strtol` rules); `None` unless all of `s` is one number.
fn c_digits(s: &str) -> Option<u128> {
    let (digits, radix) = if let Some(h) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        (h, 16)
    } else if s.len() > 1 && s.starts_with('0') {
        (&s[1..], 8)
    } else {
        (s, 10)
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    // Anything too long for u128 is out of every range anyway.
    Some(u128::from_str_radix(digits, radix).unwrap_or(u128::MAX))
}

/// A qemu integer option (`qemu_strtol` base 0) within `[min, max]`.
pub fn int(name: &str, s: &str, min: u64, max: u64) -> Result<u64, String> {
    let (neg, rest) = sign(s);
    let v = c_digits(rest).ok_or_else(|| invalid(name, s))?;
    if neg {
        // qemu reports any negative value (even -0) as out of range.
        return Err(range(name, min, max));
    }
    match u64::try_from(v) {
        Ok(v) if (min..=max).contains(&v) => Ok(v),
        _ => Err(range(name, min, max)),
    }
}

/// A qemu size option (`cvtnum`) within `[min, max]`.
pub fn size(name: &str, s: &str, min: u64, max: u64) -> Result<u64, String> {
    let (neg, rest) = sign(s);
    if neg {
        return Err(range(name, min, max));
    }
    let v = if let Some(h) = rest.strip_prefix("0x").or_else(|| rest.strip_prefix("0X")) {
        // Hexadecimal takes no fraction and no suffix.
        if h.is_empty() || !h.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(invalid(name, s));
        }
        u64::from_str_radix(h, 16).map_err(|_| range(name, min, max))?
    } else {
        if rest.ends_with(char::is_whitespace) {
            return Err(invalid(name, s));
        }
        parse_size(rest).ok_or_else(|| invalid(name, s))?
    };
    if (min..=max).contains(&v) {
        Ok(v)
    } else {
        Err(range(name, min, max))
    }
}

/// `INT_MAX`, qemu's limit for counts and sizes of bench.
pub const INT_MAX: u64 = i32::MAX as u64;
/// `INT64_MAX`, qemu's limit for offsets.
pub const INT64_MAX: u64 = i64::MAX as u64;

/// How I/O is submitted (`-i`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Aio {
    /// Positioned system calls (qimg's `FileStorage`); qemu's thread pool.
    Threads,
    /// qemu's Linux AIO. qimg has no libaio backend and uses io_uring for it; like qemu it
    /// requires O_DIRECT (`-t none` or `-t directsync`).
    Native,
    /// io_uring (qimg's `UringStorage`).
    IoUring,
}

impl Aio {
    /// `-i` values, as `bdrv_parse_aio` takes them.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "threads" => Ok(Aio::Threads),
            "native" => Ok(Aio::Native),
            "io_uring" => Ok(Aio::IoUring),
            _ => Err(format!("Invalid aio option: {s}")),
        }
    }

    /// The name qemu uses.
    pub fn name(self) -> &'static str {
        match self {
            Aio::Threads => "threads",
            Aio::Native => "native",
            Aio::IoUring => "io_uring",
        }
    }
}

/// Sets one of the qcow2 cache options (names as in qemu's `-o`/`--image-opts`).
pub fn cache_option(cache: &mut CacheOptions, key: &str, v: &str) -> Result<bool, String> {
    let sz = |name: &str| size(name, v, 0, u64::MAX);
    match key {
        "l2-cache-size" => cache.l2_cache_size = Some(sz("l2-cache-size")?),
        "l2-cache-entry-size" => cache.l2_cache_entry_size = Some(sz("l2-cache-entry-size")?),
        "refcount-cache-size" => cache.refcount_cache_size = Some(sz("refcount-cache-size")?),
        // qimg's own: QEMU caches whole refcount blocks.
        "refcount-cache-entry-size" => {
            cache.refcount_cache_entry_size = Some(sz("refcount-cache-entry-size")?)
        }
        "cache-size" => cache.cache_size = Some(sz("cache-size")?),
        "cache-clean-interval" => {
            cache.cache_clean_interval = Some(int("cache-clean-interval", v, 0, u64::MAX)?)
        }
        _ => return Ok(false),
    }
    Ok(true)
}

/// What `--image-opts` gives: the file, the format, cache options and O_DIRECT.
#[derive(Debug, Default)]
pub struct ImageOpts {
    /// `file.filename` (or `file`).
    pub filename: Option<String>,
    /// `driver`.
    pub driver: Option<String>,
    /// `cache.direct`.
    pub direct: Option<bool>,
    /// `cache.no-flush`.
    pub no_flush: Option<bool>,
    /// `file.aio` / `aio`.
    pub aio: Option<Aio>,
}

/// Parses an `--image-opts` string (`driver=qcow2,file.filename=X,l2-cache-size=1M,...`),
/// putting cache options into `cache`. Only the keys qimg can honour are accepted.
pub fn image_opts(s: &str, cache: &mut CacheOptions) -> Result<ImageOpts, String> {
    let mut o = ImageOpts::default();
    for pair in split_opts(s) {
        let Some((k, v)) = pair.split_once('=') else {
            return Err(format!("Invalid parameter '{pair}'"));
        };
        match k {
            "driver" => match v {
                "qcow2" | "raw" => o.driver = Some(v.to_string()),
                _ => {
                    return Err(format!(
                        "Unknown driver '{v}' (qimg supports qcow2 and raw)"
                    ));
                }
            },
            "file.filename" | "file" | "filename" => o.filename = Some(v.to_string()),
            "file.driver" => {
                if v != "file" {
                    return Err(format!("Unknown protocol driver '{v}' (qimg reads files)"));
                }
            }
            "cache.direct" | "file.cache.direct" => o.direct = Some(on_off(k, v)?),
            "cache.no-flush" | "file.cache.no-flush" => o.no_flush = Some(on_off(k, v)?),
            "aio" | "file.aio" => o.aio = Some(Aio::parse(v)?),
            _ => {
                if !cache_option(cache, k, v)? {
                    return Err(format!("Invalid parameter '{k}'"));
                }
            }
        }
    }
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_parse_like_qemu_strtol() {
        let c = |s| int("request count", s, 1, INT_MAX);
        assert_eq!(c("75000"), Ok(75000));
        assert_eq!(c("0x10"), Ok(16));
        assert_eq!(c("010"), Ok(8));
        assert_eq!(c(" 5"), Ok(5));
        assert_eq!(c("+5"), Ok(5));
        assert_eq!(
            c("abc"),
            Err("Invalid request count specified: 'abc'.".into())
        );
        for bad in ["5 ", "09", "1k", "2.5", "", "0x", "5B"] {
            assert!(c(bad).unwrap_err().contains(": '"), "{bad}");
        }
        for out in [
            "0",
            "-1",
            "-0",
            "2147483648",
            "99999999999999999999999999999999999999999",
        ] {
            assert_eq!(
                c(out),
                Err("Invalid request count specified. Must be between 1 and 2147483647.".into()),
                "{out}"
            );
        }
        assert_eq!(int("pattern byte", "0377", 0, 255), Ok(255));
    }

    #[test]
    fn sizes_parse_like_qemu_cvtnum() {
        let s = |v| size("offset", v, 0, INT64_MAX);
        assert_eq!(s("4k"), Ok(4096));
        assert_eq!(s("4K"), Ok(4096));
        assert_eq!(s("1.5k"), Ok(1536));
        assert_eq!(s("010"), Ok(10));
        assert_eq!(s("0x1000"), Ok(4096));
        assert_eq!(s(" 4k"), Ok(4096));
        assert_eq!(s("4b"), Ok(4));
        for bad in ["abc", "0x10k", "1e3", "4kB", "1.5", "4k ", ""] {
            assert_eq!(s(bad), Err(format!("Invalid offset specified: '{bad}'.")));
        }
        assert_eq!(
            s("-0"),
            Err("Invalid offset specified. Must be between 0 and 9223372036854775807.".into())
        );
        assert_eq!(
            size("buffer size", "0", 1, INT_MAX),
            Err("Invalid buffer size specified. Must be between 1 and 2147483647.".into())
        );
    }

    #[test]
    fn image_opts_take_qemu_keys() {
        let mut c = CacheOptions::default();
        let o = image_opts(
            "driver=qcow2,file.filename=a,,b.qcow2,l2-cache-size=1M,l2-cache-entry-size=4k,refcount-cache-entry-size=512,cache.direct=on",
            &mut c,
        )
        .unwrap();
        assert_eq!(o.filename.as_deref(), Some("a,b.qcow2"));
        assert_eq!(o.driver.as_deref(), Some("qcow2"));
        assert_eq!(o.direct, Some(true));
        assert_eq!(c.l2_cache_size, Some(1 << 20));
        assert_eq!(c.l2_cache_entry_size, Some(4096));
        assert_eq!(c.refcount_cache_entry_size, Some(512));
        assert!(image_opts("bogus=1", &mut c).is_err());
        assert!(image_opts("driver=vmdk", &mut c).is_err());
    }
}

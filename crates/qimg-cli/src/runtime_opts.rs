//! The values of qcow2's runtime options (`l2-cache-size`, `overlap-check`, ...) checked as
//! QEMU checks them when it opens an image (`read_cache_sizes`, `qcow2_update_options`),
//! whether they come from `--image-opts`, a `json:` name or qemu-io's `open -o`. qimg takes
//! them and leaves its engine to its own cache sizing; what QEMU refuses, qimg refuses in
//! the same words.

use std::path::Path;

use crate::args::{on_off, parse_size, size_error};

/// A size option's value.
fn size(key: &str, v: &str) -> Result<u64, String> {
    parse_size(v).ok_or_else(|| size_error(key, v))
}

/// Checks the runtime options among `pairs` (later values win, as in QEMU); `file`, when
/// given and readable, supplies the cluster size the L2 cache entry size is held to.
pub fn check(pairs: &[(String, String)], file: Option<&Path>) -> Result<(), String> {
    let get = |key: &str| pairs.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v);
    for (k, v) in pairs {
        match k.as_str() {
            "l2-cache-size" | "l2-cache-entry-size" | "refcount-cache-size" | "cache-size" => {
                size(k, v)?;
            }
            "cache-clean-interval" => {
                let n: i128 =
                    parse_number(v).ok_or_else(|| format!("Parameter '{k}' expects a number"))?;
                if !(0..=i128::from(u32::MAX)).contains(&n) {
                    return Err("Cache clean interval too big".into());
                }
            }
            "lazy-refcounts"
            | "pass-discard-request"
            | "pass-discard-snapshot"
            | "pass-discard-other" => {
                on_off(k, v)?;
            }
            "overlap-check" | "overlap-check.template"
                if !matches!(v.as_str(), "none" | "constant" | "cached" | "all") =>
            {
                return Err(format!(
                    "Unsupported value '{v}' for qcow2 option 'overlap-check'. Allowed are any \
                     of the following: none, constant, cached, all"
                ));
            }
            "overlap-check" | "overlap-check.template" => {}
            k if k.starts_with("overlap-check.") => {
                on_off(k, v)?;
            }
            _ => {}
        }
    }
    let l2 = get("l2-cache-size")
        .map(|v| size("l2-cache-size", v))
        .transpose()?;
    let rc = get("refcount-cache-size")
        .map(|v| size("refcount-cache-size", v))
        .transpose()?;
    if let Some(total) = get("cache-size")
        .map(|v| size("cache-size", v))
        .transpose()?
    {
        match (l2, rc) {
            (Some(_), Some(_)) => {
                return Err(
                    "cache-size, l2-cache-size and refcount-cache-size may not be set \
                            at the same time"
                        .into(),
                );
            }
            (Some(l2), None) if l2 > total => {
                return Err("l2-cache-size may not exceed cache-size".into());
            }
            (None, Some(rc)) if rc > total => {
                return Err("refcount-cache-size may not exceed cache-size".into());
            }
            _ => {}
        }
    }
    if let Some(entry) = get("l2-cache-entry-size") {
        let entry = size("l2-cache-entry-size", entry)?;
        let cluster = file
            .and_then(|f| {
                qimg::chain::read_cluster0(f, qimg::format::validate::OpenMode::ReadOnly).ok()
            })
            .map(|c0| 1u64 << c0.header.cluster_bits);
        if let Some(cs) = cluster {
            if entry < 512 || entry > cs || !entry.is_power_of_two() {
                return Err(format!(
                    "L2 cache entry size must be a power of two between 512 and the cluster \
                     size ({cs})"
                ));
            }
        }
    }
    Ok(())
}

/// QEMU's checks of a `blkdebug` node's request limits (`own`: its options without their
/// prefix): `align` a power of two, the others multiples of it (`max-write-zero` and
/// `max-discard` of their `opt-` value too), all below 2^31. qimg accepts them and leaves its
/// requests as they are.
pub fn check_blkdebug(own: &[(String, String)]) -> Result<(), String> {
    const LIMIT: u64 = i32::MAX as u64;
    let get = |key: &str| -> Result<u64, String> {
        own.iter()
            .rev()
            .find(|(k, _)| k == key)
            .map_or(Ok(0), |(k, v)| size(k, v))
    };
    let refuse = |key: &str, v: u64| Err(format!("Cannot meet constraints with {key} {v}"));
    let align = get("align")?;
    if align != 0 && (align >= LIMIT || !align.is_power_of_two()) {
        return refuse("align", align);
    }
    let unit = align.max(1);
    let multiple = |key: &str, v: u64, of: u64| {
        if v != 0 && (v >= LIMIT || v % of != 0) {
            return refuse(key, v);
        }
        Ok(())
    };
    multiple("max-transfer", get("max-transfer")?, unit)?;
    let opt_wz = get("opt-write-zero")?;
    multiple("opt-write-zero", opt_wz, unit)?;
    multiple("max-write-zero", get("max-write-zero")?, opt_wz.max(unit))?;
    let opt_discard = get("opt-discard")?;
    multiple("opt-discard", opt_discard, unit)?;
    multiple("max-discard", get("max-discard")?, opt_discard.max(unit))
}

/// A QemuOpts number: decimal, or hexadecimal with `0x` (no suffix).
fn parse_number(v: &str) -> Option<i128> {
    let v = v.trim();
    let (neg, digits) = match v.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, v),
    };
    let n = match digits
        .strip_prefix("0x")
        .or_else(|| digits.strip_prefix("0X"))
    {
        Some(hex) => i128::from_str_radix(hex, 16).ok()?,
        None if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) => {
            digits.parse().ok()?
        }
        None => return None,
    };
    Some(if neg { -n } else { n })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(s: &[(&str, &str)]) -> Vec<(String, String)> {
        s.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn values_are_refused_in_qemus_words() {
        let e = |p: &[(&str, &str)]| check(&pairs(p), None).unwrap_err();
        assert!(e(&[("l2-cache-size", "abc")]).starts_with("Parameter 'l2-cache-size' expects"));
        assert_eq!(
            e(&[("l2-cache-size", "-1")]),
            "Value '-1' is out of range for parameter 'l2-cache-size'"
        );
        assert_eq!(
            e(&[("cache-clean-interval", "abc")]),
            "Parameter 'cache-clean-interval' expects a number"
        );
        assert_eq!(
            e(&[("cache-clean-interval", "-1")]),
            "Cache clean interval too big"
        );
        assert!(e(&[("overlap-check", "x")]).contains("none, constant, cached, all"));
        assert_eq!(
            e(&[("cache-size", "1M"), ("l2-cache-size", "2M")]),
            "l2-cache-size may not exceed cache-size"
        );
        assert_eq!(
            e(&[("cache-size", "64k"), ("refcount-cache-size", "128k")]),
            "refcount-cache-size may not exceed cache-size"
        );
        assert!(
            e(&[
                ("cache-size", "1M"),
                ("l2-cache-size", "1k"),
                ("refcount-cache-size", "1k")
            ])
            .contains("may not be set at the same time")
        );
        assert_eq!(
            e(&[("lazy-refcounts", "maybe")]),
            "Parameter 'lazy-refcounts' expects 'on' or 'off'"
        );
        let b = |p: &[(&str, &str)]| check_blkdebug(&pairs(p));
        assert_eq!(
            b(&[("align", "4095")]),
            Err("Cannot meet constraints with align 4095".into())
        );
        assert_eq!(
            b(&[("align", "8192"), ("max-transfer", "4096")]),
            Err("Cannot meet constraints with max-transfer 4096".into())
        );
        assert_eq!(
            b(&[("opt-discard", "4096"), ("max-discard", "6144")]),
            Err("Cannot meet constraints with max-discard 6144".into())
        );
        b(&[
            ("align", "0"),
            ("max-transfer", "1000"),
            ("opt-write-zero", "1024"),
        ])
        .unwrap();
        check(
            &pairs(&[
                ("cache-clean-interval", "0x10"),
                ("overlap-check", "all"),
                ("l2-cache-size", "1T"),
            ]),
            None,
        )
        .unwrap();
    }
}

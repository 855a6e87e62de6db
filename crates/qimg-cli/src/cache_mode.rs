//! qemu's cache modes (`-t` of `bench` and `convert`, `-T` of `convert`): what each means for
//! opening and flushing (`bdrv_parse_cache_mode`).

use anyhow::{Result, anyhow};

/// What a cache mode means for the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheMode {
    /// The name as given (canonical: `none` for `off`).
    pub name: &'static str,
    /// Open with O_DIRECT.
    pub direct: bool,
    /// Every write is followed by a flush (no volatile write cache).
    pub writethrough: bool,
    /// Flushes are ignored.
    pub no_flush: bool,
}

impl CacheMode {
    /// The default of qemu-img bench and of qimg convert, `writeback`.
    pub const DEFAULT: CacheMode = CacheMode {
        name: "writeback",
        direct: false,
        writethrough: false,
        no_flush: false,
    };

    /// A `-t` value.
    pub fn parse(s: &str) -> Result<Self, String> {
        let (name, direct, writethrough, no_flush) = match s {
            "none" | "off" => ("none", true, false, false),
            "directsync" => ("directsync", true, true, false),
            "writeback" => ("writeback", false, false, false),
            "unsafe" => ("unsafe", false, false, true),
            "writethrough" => ("writethrough", false, true, false),
            _ => return Err("Invalid cache mode".into()),
        };
        Ok(CacheMode {
            name,
            direct,
            writethrough,
            no_flush,
        })
    }

    /// An optional `-t` / `-T` value of `convert` (`what` names the option in the error, as
    /// qemu-img does); absent, the default.
    pub fn parse_option(value: Option<&str>, what: &str) -> Result<Self> {
        match value {
            None => Ok(CacheMode::DEFAULT),
            Some(s) => CacheMode::parse(s).map_err(|_| anyhow!("Invalid {what} option: {s}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_modes() {
        assert!(CacheMode::parse("none").unwrap().direct);
        assert!(CacheMode::parse("off").unwrap().direct);
        let d = CacheMode::parse("directsync").unwrap();
        assert!(d.direct && d.writethrough);
        assert!(CacheMode::parse("unsafe").unwrap().no_flush);
        assert_eq!(CacheMode::parse("writeback"), Ok(CacheMode::DEFAULT));
        assert!(CacheMode::parse("bogus").is_err());
    }
}

//! The options of a new image (`create -o`, `convert -o`): which keys a format takes, their
//! `-o help` text, how they apply to [`CreateOptions`], and the `Formatting ...` line.

use anyhow::{Result, bail};
use qimg::format::header::CompressionType;
use qimg::tools::create::{Compat, CreateOptions, Preallocation};

use crate::args::{on_off, parse_size};

/// The options given by the user, kept as typed for the `Formatting ...` line.
#[derive(Debug, Default)]
pub struct Given {
    /// (key, value as typed) in the order given; later ones win.
    pub pairs: Vec<(String, String)>,
    /// A value the format driver refuses (compat, preallocation, compression_type): as
    /// qemu-img, it is reported after the `Formatting` line, which shows the value as typed.
    pub refused: Option<String>,
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

/// Whether `fmt` creates a plain file: raw, or QEMU's file driver named as the format.
pub fn raw_like(fmt: &str) -> bool {
    matches!(fmt, "raw" | "file")
}

/// Whether qimg takes option `key` when creating a `fmt` image: the format's and the file
/// protocol's options as QEMU lists them (the `-o help` tables below), less those qimg does
/// not implement (encryption, btrfs's `nocow`).
pub fn takes(fmt: &str, key: &str) -> bool {
    let own = if raw_like(fmt) { RAW_HELP } else { QCOW2_HELP };
    let implemented = key != "nocow";
    implemented && own.iter().chain(FILE_HELP).any(|o| o.0 == key)
}

/// qcow2's creation options as QEMU 10 lists them for `-o help`.
const QCOW2_HELP: &[(&str, &str, &str)] = &[
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
        "Compression method used for image cluster compression",
    ),
    ("data_file", "<str>", "File name of an external data file"),
    (
        "data_file_raw",
        "<bool (on/off)>",
        "The external data file must stay valid as a raw image",
    ),
    (
        "encrypt.cipher-alg",
        "<str>",
        "Name of encryption cipher algorithm",
    ),
    (
        "encrypt.cipher-mode",
        "<str>",
        "Name of encryption cipher mode",
    ),
    (
        "encrypt.format",
        "<str>",
        "Encrypt the image, format choices: 'aes', 'luks'",
    ),
    (
        "encrypt.hash-alg",
        "<str>",
        "Name of encryption hash algorithm",
    ),
    (
        "encrypt.iter-time",
        "<num>",
        "Time to spend in PBKDF in milliseconds",
    ),
    (
        "encrypt.ivgen-alg",
        "<str>",
        "Name of IV generator algorithm",
    ),
    (
        "encrypt.ivgen-hash-alg",
        "<str>",
        "Name of IV generator hash algorithm",
    ),
    (
        "encrypt.key-secret",
        "<str>",
        "ID of secret providing qcow AES key or LUKS passphrase",
    ),
    (
        "encryption",
        "<bool (on/off)>",
        "Encrypt the image with format 'aes'. (Deprecated in favor of encrypt.format=aes)",
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

/// The raw format's own creation options (QEMU's list).
const RAW_HELP: &[(&str, &str, &str)] = &[("size", "<size>", "Virtual disk size")];

/// The file protocol's creation options (QEMU's list), shown with a format's when the
/// target file is named.
const FILE_HELP: &[(&str, &str, &str)] = &[
    (
        "extent_size_hint",
        "<size>",
        "Extent size hint for the image file, 0 to disable",
    ),
    (
        "nocow",
        "<bool (on/off)>",
        "Turn off copy-on-write (valid only on btrfs)",
    ),
    (
        "preallocation",
        "<str>",
        "Preallocation mode (allowed values: off, falloc, full)",
    ),
    ("size", "<size>", "Virtual disk size"),
];

/// The `-o help` text, as qemu-img prints it: the format's options alone with a pointer to
/// the protocol's when no target file is named (`with_file` false), else both, merged by name
/// (the format's entry first when both have one).
pub fn help_text(fmt: &str, with_file: bool) -> String {
    // The file driver as the format lists its own options (the protocol's).
    let own = match fmt {
        "file" => FILE_HELP,
        _ if raw_like(fmt) => RAW_HELP,
        _ => QCOW2_HELP,
    };
    let mut list: Vec<&(&str, &str, &str)> = own.iter().collect();
    if with_file {
        for o in FILE_HELP {
            if !list.iter().any(|l| l.0 == o.0) {
                list.push(o);
            }
        }
        list.sort_by_key(|o| o.0);
    }
    let mut s = if with_file {
        "Supported options:\n".to_string()
    } else {
        format!("Supported {fmt} options:\n")
    };
    for (k, t, d) in list {
        let left = format!("{k}={t}");
        s.push_str(&format!("  {left:<22} - {d}\n"));
    }
    if !with_file {
        s.push_str(
            "\nThe protocol level may support further options.\n\
             Specify the target filename to include those options.\n",
        );
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
    for p in pairs {
        let (k, v) = p.split_once('=').unwrap_or((p.as_str(), ""));
        if !raw_like(fmt) && ENCRYPTION.contains(&k) {
            // Shown on the `Formatting` line; refused after it (below).
            given.pairs.push((k.to_string(), v.to_string()));
            continue;
        }
        if !takes(fmt, k) {
            bail!("Invalid parameter '{k}'");
        }
        match k {
            "size" => opts.size = Some(parse_size(v).ok_or_else(|| not_a_size(k, v))?),
            "cluster_size" => opts.cluster_size = parse_size(v).ok_or_else(|| not_a_size(k, v))?,
            "compat" => match v {
                "0.10" | "v2" => opts.compat = Compat::V2,
                "1.1" | "v3" => opts.compat = Compat::V3,
                // qemu's qcow2 driver calls the option 'version' in this message.
                _ => refuse(
                    given,
                    format!("Parameter 'version' does not accept value '{v}'"),
                    "(compat: use v2, 0.10, v3 or 1.1)",
                ),
            },
            "extended_l2" => opts.extended_l2 = on_off(k, v).map_err(anyhow::Error::msg)?,
            "lazy_refcounts" => opts.lazy_refcounts = on_off(k, v).map_err(anyhow::Error::msg)?,
            "data_file_raw" => opts.data_file_raw = on_off(k, v).map_err(anyhow::Error::msg)?,
            "refcount_bits" => {
                opts.refcount_bits = v.parse().map_err(|_| {
                    anyhow::anyhow!("Parameter 'refcount_bits' expects a number: '{v}'")
                })?
            }
            // A hint QEMU's file driver passes to XFS (`FS_IOC_FSSETXATTR`); qimg takes and
            // prints it as qemu-img does and leaves the file's extent size to the
            // filesystem (see docs/ARCHITECTURE.md, "Not done yet").
            "extent_size_hint" => {
                let n = parse_size(v).ok_or_else(|| not_a_size(k, v))?;
                if n > u64::from(u32::MAX) {
                    let hint = "(extent_size_hint: at most 4 GiB - 1)";
                    refuse(given, "Extent size hint is too large".into(), hint);
                }
                given.pairs.push((k.to_string(), n.to_string()));
                continue;
            }
            "backing_file" => opts.backing_file = Some(v.to_string()),
            "backing_fmt" => opts.backing_fmt = Some(v.to_string()),
            "data_file" => opts.data_file = Some(v.to_string()),
            "compression_type" => match v {
                "zlib" => opts.compression_type = CompressionType::Zlib,
                "zstd" => opts.compression_type = CompressionType::Zstd,
                _ => refuse(
                    given,
                    format!("Parameter 'compression-type' does not accept value '{v}'"),
                    "(compression_type: use zlib or zstd)",
                ),
            },
            "preallocation" => match v {
                "off" => opts.preallocation = Preallocation::Off,
                "metadata" if !raw_like(fmt) => opts.preallocation = Preallocation::Metadata,
                "falloc" => opts.preallocation = Preallocation::Falloc,
                "full" => opts.preallocation = Preallocation::Full,
                // qemu's file driver words these two its own way.
                "metadata" => refuse(
                    given,
                    format!("Unsupported preallocation mode: {v}"),
                    "(preallocation: raw files take off, falloc or full)",
                ),
                _ if raw_like(fmt) => refuse(
                    given,
                    format!("invalid parameter value: {v}"),
                    "(preallocation: use off, falloc or full)",
                ),
                _ => refuse(
                    given,
                    format!("Parameter 'preallocation' does not accept value '{v}'"),
                    "",
                ),
            },
            _ => unreachable!("checked against the known list"),
        }
        given.pairs.push((k.to_string(), v.to_string()));
    }
    match encryption(given) {
        Ok(e) => opts.encryption = e,
        Err(why) => refuse(given, why, ""),
    }
    Ok(())
}

/// qcow2's encryption options, in the order qemu-img prints them on the `Formatting` line.
const ENCRYPTION: [&str; 9] = [
    "encryption",
    "encrypt.format",
    "encrypt.key-secret",
    "encrypt.cipher-alg",
    "encrypt.cipher-mode",
    "encrypt.ivgen-alg",
    "encrypt.ivgen-hash-alg",
    "encrypt.hash-alg",
    "encrypt.iter-time",
];

/// The encryption the options of `given` ask for (LUKS, keyed with the `--object secret`
/// `encrypt.key-secret` names), or QEMU's refusal (no format, no secret, an unknown secret, a
/// value the option does not take), or qimg's (the legacy AES format, a cipher or mode qimg
/// does not implement).
fn encryption(
    given: &Given,
) -> std::result::Result<Option<qimg::tools::create::Encryption>, String> {
    let any = given
        .pairs
        .iter()
        .any(|(k, _)| ENCRYPTION.contains(&k.as_str()));
    if !any {
        return Ok(None);
    }
    let legacy = given
        .get("encryption")
        .is_some_and(|v| matches!(v, "on" | "yes" | "true"));
    let format = given.get("encrypt.format").or(legacy.then_some("aes"));
    let Some(format) = format else {
        let others = given.pairs.iter().any(|(k, _)| k.starts_with("encrypt."));
        if !others {
            // `encryption=off` and no `encrypt.` option: no encryption.
            return Ok(None);
        }
        return Err("Parameter 'encrypt.format' is missing".into());
    };
    if !matches!(format, "luks" | "aes") {
        return Err(format!(
            "Parameter 'format' does not accept value '{format}'"
        ));
    }
    let passphrase = match given.get("encrypt.key-secret") {
        None => return Err("Parameter 'encrypt.key-secret' is required for cipher".into()),
        Some(id) => {
            crate::encryption::secret(id).ok_or_else(|| format!("No secret with id '{id}'"))?
        }
    };
    if format == "aes" {
        return Err("qimg does not create AES-CBC encrypted images (encrypt.format=aes); use encrypt.format=luks".into());
    }
    let params = luks_params(&|k| given.get(k).map(str::to_string))?;
    Ok(Some(qimg::tools::create::Encryption { params, passphrase }))
}

/// The LUKS parameters the `encrypt.*` options (`get`, by full key) ask for, checked as QEMU
/// checks them (its words), then against what qimg implements (its own words).
pub fn luks_params(
    get: &dyn Fn(&str) -> Option<String>,
) -> std::result::Result<qimg::crypto::LuksParams, String> {
    // QEMU's value checks, then what qimg implements.
    let choice = |key: &str, default: &str, qemu: &[&str], ours: &[&str]| {
        let v = get(&format!("encrypt.{key}")).unwrap_or_else(|| default.to_string());
        if !qemu.contains(&v.as_str()) {
            return Err(format!("Parameter '{key}' does not accept value '{v}'"));
        }
        if !ours.contains(&v.as_str()) {
            return Err(format!("qimg does not encrypt with {key} '{v}'"));
        }
        Ok(v)
    };
    const CIPHERS: &[&str] = &[
        "aes-128",
        "aes-192",
        "aes-256",
        "des",
        "3des",
        "cast5-128",
        "serpent-128",
        "serpent-192",
        "serpent-256",
        "twofish-128",
        "twofish-192",
        "twofish-256",
        "sm4",
    ];
    const HASHES: &[&str] = &[
        "md5",
        "sha1",
        "sha224",
        "sha256",
        "sha384",
        "sha512",
        "ripemd160",
        "sm3",
    ];
    let cipher_alg = choice(
        "cipher-alg",
        "aes-256",
        CIPHERS,
        &["aes-128", "aes-192", "aes-256"],
    )?;
    let cipher_mode = choice(
        "cipher-mode",
        "xts",
        &["ecb", "cbc", "xts", "ctr"],
        &["cbc", "xts"],
    )?;
    let ivgen_alg = choice(
        "ivgen-alg",
        "plain64",
        &["plain", "plain64", "essiv"],
        &["plain", "plain64", "essiv"],
    )?;
    let ivgen_hash = match ivgen_alg.as_str() {
        "essiv" => {
            let h = get("encrypt.ivgen-hash-alg").unwrap_or_else(|| "sha256".into());
            let h = h.as_str();
            if !HASHES.contains(&h) {
                return Err(format!(
                    "Parameter 'ivgen-hash-alg' does not accept value '{h}'"
                ));
            }
            // ESSIV keys AES with the digest: its length must be an AES key's.
            let len = match h {
                "md5" => 16,
                "sha1" | "ripemd160" => 20,
                "sha224" => 28,
                "sha384" => 48,
                "sha512" => 64,
                _ => 32,
            };
            if !matches!(len, 16 | 24 | 32) {
                return Err(format!("No AES cipher with key size {len} available"));
            }
            if h != "sha256" {
                return Err(format!("qimg does not encrypt with ivgen-hash-alg '{h}'"));
            }
            Some(h.to_string())
        }
        _ => None,
    };
    let hash_alg = choice(
        "hash-alg",
        "sha256",
        HASHES,
        &["sha1", "sha224", "sha256", "sha384", "sha512"],
    )?;
    let iter_time = match get("encrypt.iter-time") {
        None => 2000,
        Some(v) => v
            .parse::<u64>()
            .map_err(|_| "Parameter 'encrypt.iter-time' expects a number".to_string())?,
    };
    Ok(qimg::crypto::LuksParams {
        cipher_alg,
        cipher_mode,
        ivgen_alg,
        ivgen_hash_alg: ivgen_hash,
        hash_alg,
        iter_time_ms: iter_time,
    })
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
    if raw_like(fmt) {
        parts.push(format!("size={size}"));
        if let Some(p) = given.get("preallocation") {
            parts.push(format!("preallocation={p}"));
        }
        if let Some(h) = given.get("extent_size_hint") {
            parts.push(format!("extent_size_hint={h}"));
        }
        return format!("Formatting '{file}', {}", parts.join(" "));
    }
    for key in ENCRYPTION {
        if let Some(v) = given.get(key) {
            parts.push(format!("{key}={v}"));
        }
    }
    parts.push(format!("cluster_size={}", opts.cluster_size));
    parts.push(format!(
        "extended_l2={}",
        flag("extended_l2", opts.extended_l2)
    ));
    if let Some(p) = given.get("preallocation") {
        parts.push(format!("preallocation={p}"));
    }
    let compression = given.get("compression_type");
    parts.push(format!(
        "compression_type={}",
        compression.unwrap_or(opts.compression_type.name())
    ));
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
    if let Some(h) = given.get("extent_size_hint") {
        parts.push(format!("extent_size_hint={h}"));
    }
    format!("Formatting '{file}', {}", parts.join(" "))
}

/// Records the first value the format driver refuses: qemu's words, and as qimg (not
/// multi-call) a hint after them.
fn refuse(given: &mut Given, qemu: String, hint: &str) {
    if given.refused.is_some() {
        return;
    }
    let hint = match crate::status::program() {
        "qemu-img" => "",
        _ => hint,
    };
    given.refused = Some(if hint.is_empty() {
        qemu
    } else {
        format!("{qemu} {hint}")
    });
}

/// A `-o` size that does not parse: qimg names the value; as qemu-img (multi-call), qemu's
/// own words.
fn not_a_size(key: &str, value: &str) -> anyhow::Error {
    if crate::status::program() == "qemu-img" {
        return anyhow::anyhow!(crate::args::size_error(key, value));
    }
    anyhow::anyhow!("Parameter '{key}' expects a size: '{value}'")
}

//! Image names as QEMU's tools take them besides plain file names: `--image-opts` option
//! strings (`driver=qcow2,file.filename=disk.qcow2,l2-cache-size=1M`) and `json:{...}` names
//! (`json:{"driver":"qcow2","file":{"driver":"file","filename":"disk.qcow2"}}`). Both are
//! turned into the file name before the command line is parsed, for images on files with
//! the qcow2 or raw driver; runtime options that change how, not what, qemu reads (caches,
//! overlap checks, locking) are accepted and left to qimg's own defaults. Anything else
//! (backing or data-file nodes, other protocols) is refused, naming the key.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use qimg::OpenOptions;
use serde_json::Value;

use crate::option_string::{is_option_string, node_reference, option_pairs};

/// What an option string or `json:` name says beyond its file name, recorded by [`rewrite`]
/// for the name it became and applied where the command opens that image
/// ([`options_for`], [`format_for`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Overrides {
    /// `driver`: the image's format (else probed).
    format: Option<String>,
    /// `backing: null`: the image is opened without its backing file.
    no_backing: bool,
    /// `data-file`: the external data file, instead of the one the image names.
    data_file: Option<String>,
}

static OVERRIDES: Mutex<Vec<(String, Overrides)>> = Mutex::new(Vec::new());

/// `--object tls-creds-x509` objects: `(id, directory, client endpoint)`.
static TLS_CREDS: Mutex<Vec<(String, String, bool)>> = Mutex::new(Vec::new());

/// Records a `tls-creds-x509` object (its credentials directory) for `tls-creds=ID`.
pub fn add_tls_creds(id: &str, dir: &str, client: bool) {
    let mut all = TLS_CREDS.lock().unwrap_or_else(|e| e.into_inner());
    all.push((id.to_string(), dir.to_string(), client));
}

/// The credentials directory of object `id`, refused as QEMU refuses a missing or server
/// object.
fn tls_dir(id: &str) -> Result<String, String> {
    let all = TLS_CREDS.lock().unwrap_or_else(|e| e.into_inner());
    match all.iter().rev().find(|(i, _, _)| i == id) {
        None => Err(format!("No TLS credentials with id '{id}'")),
        Some((_, _, false)) => Err("Expected TLS credentials for a client endpoint".into()),
        Some((_, dir, true)) => Ok(dir.clone()),
    }
}

/// Escapes what would end a URI part early.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '%' | '&' | '?' | '#' | ' ' => out.push_str(&format!("%{:02X}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// The NBD name (`nbd://`, `nbd+unix://`, with TLS `nbds...`) of the nbd driver's options
/// under `prefix` (`""` or `"file."`), and the keys it used.
fn nbd_name(
    get: &dyn Fn(&str) -> Option<String>,
    prefix: &str,
) -> Result<(String, Vec<String>), String> {
    let key = |k: &str| format!("{prefix}{k}");
    let mut used = Vec::new();
    let mut take = |k: &str| {
        used.push(key(k));
        get(&key(k))
    };
    let export = take("export").unwrap_or_default();
    let kind = take("server.type");
    let (path, host, port) = (
        take("server.path").or_else(|| take("path")),
        take("server.host").or_else(|| take("host")),
        take("server.port").or_else(|| take("port")),
    );
    let tls = take("tls-creds");
    let hostname = take("tls-hostname");
    for k in ["reconnect-delay", "open-timeout"] {
        take(k);
    }
    let s = if tls.is_some() { "s" } else { "" };
    let mut query = Vec::new();
    let mut name = match (kind.as_deref(), path, host) {
        (Some("unix") | None, Some(path), None) => {
            query.push(format!("socket={}", escape(&path)));
            format!("nbd{s}+unix:///{}", escape(&export))
        }
        (Some("inet") | None, None, Some(host)) => {
            let host = if host.contains(':') {
                format!("[{host}]")
            } else {
                host
            };
            let port = port.unwrap_or_else(|| "10809".into());
            format!("nbd{s}://{host}:{port}/{}", escape(&export))
        }
        (Some(t), _, _) if t != "unix" && t != "inet" => {
            return Err(format!(
                "Parameter 'server.type' does not accept value '{t}'"
            ));
        }
        _ => return Err("one of path and host must be specified".into()),
    };
    if let Some(id) = tls {
        let dir = tls_dir(&id)?;
        // QEMU's refusal, before it connects: nothing to check the certificate against.
        if hostname.is_none() && name.starts_with("nbds+unix") {
            return Err("No hostname for certificate validation".into());
        }
        query.push(format!("tls-certificates={}", escape(&dir)));
        if let Some(h) = hostname {
            query.push(format!("tls-hostname={}", escape(&h)));
        }
    }
    if !query.is_empty() {
        name = format!("{name}?{}", query.join("&"));
    }
    Ok((name, used))
}

/// A JSON `null` among the flattened options (no option string can hold a NUL).
const NULL: &str = "\0null";

fn overrides(name: &str) -> Option<Overrides> {
    let all = OVERRIDES.lock().unwrap_or_else(|e| e.into_inner());
    all.iter()
        .rev()
        .find(|(n, _)| n == name)
        .map(|(_, o)| o.clone())
}

/// The open options for the image the user named `path`: qimg's defaults, with what an
/// option string or `json:` name said about it (no backing file, another data file).
pub fn options_for(path: &Path) -> OpenOptions {
    let mut o = OpenOptions::new();
    if crate::status::program() != "qimg" {
        // As QEMU's tools: a new cluster holds only what was written (the rest stays a hole
        // of the file), so the file has QEMU's length and allocation, which `qemu-img info`
        // and QEMU's metadata-preallocation heuristic (`map`) read. qimg's own default
        // reserves whole clusters ahead, for speed. Bitmaps are QEMU's too: `in_use` on disk
        // from the open to the close (a killed writer leaves them inconsistent, as QEMU's
        // does) instead of qimg's crash-consistent bitmaps, which write bits as they go.
        o = o
            .allocation(qimg::Allocation::Sparse)
            .crash_consistent_bitmaps(false);
    }
    if crate::status::program() == "qemu-img" {
        // QEMU's driver prints its messages (the image marked corrupt) on standard error as
        // they happen; qemu-io prints them between commands (`Session::print_messages`).
        // QEMU opens a file once per command where qimg may open it twice (`convert` reads
        // through one instance and asks block status through another): a line is printed
        // once per file.
        let file = path.to_path_buf();
        o = o.on_message(move |line| {
            static PRINTED: std::sync::Mutex<Vec<(PathBuf, String)>> =
                std::sync::Mutex::new(Vec::new());
            let mut printed = PRINTED.lock().unwrap_or_else(|e| e.into_inner());
            let key = (file.clone(), line.to_string());
            if !printed.contains(&key) {
                eprintln!("{line}");
                printed.push(key);
            }
        });
    }
    if let Some(ov) = path.to_str().and_then(overrides) {
        if ov.no_backing {
            o = o.without_backing();
        }
        if let Some(d) = ov.data_file {
            o = o.data_file(d);
        }
    }
    if let Some(key) = path.to_str().and_then(crate::encryption::key_for) {
        o = o.encryption_key(key);
    }
    o
}

/// Opens `path` (named `file` in messages) read-write through the engine, without the clean
/// timer (a command's short life needs none), with qemu-img's wording when that fails.
pub async fn open_writable(
    path: &std::path::Path,
    file: &str,
) -> anyhow::Result<qimg::Image<qimg::io::AnyStorage>> {
    options_for(path)
        .writable(true)
        .clean_timer(false)
        .open(path)
        .await
        .map_err(|e| {
            crate::status::open_msg(
                anyhow::anyhow!(
                    "Could not open '{file}': {}",
                    crate::status::lib_msg(&e, file)
                ),
                file,
            )
        })
}

/// The format an option string or `json:` name gave the image the user named `name`.
pub fn format_for(name: &str) -> Option<String> {
    overrides(name).and_then(|o| o.format)
}

/// Runtime options that do not change what a command prints or writes.
const IGNORED: &[&str] = &[
    "l2-cache-size",
    "l2-cache-entry-size",
    "refcount-cache-size",
    "cache-size",
    "cache-clean-interval",
    "overlap-check",
    "lazy-refcounts",
    "pass-discard-request",
    "pass-discard-snapshot",
    "pass-discard-other",
    "cache.direct",
    "cache.no-flush",
    "read-only",
    "auto-read-only",
    "force-share",
    "discard",
    "detect-zeroes",
    "node-name",
    "file.aio",
    "file.locking",
    "file.cache.direct",
    "file.cache.no-flush",
    "file.node-name",
];

/// Rewrites `args` (the program name first): with `--image-opts`, every option-string image
/// name becomes its file name and the flag goes; `json:` names become their file names
/// everywhere. An unusable name is an error worded as qemu-img's.
pub fn rewrite(args: &mut Vec<std::ffi::OsString>, program: &str) -> Result<(), String> {
    // `bench` takes `--image-opts` itself and honours the cache options in it.
    if args.get(1).is_some_and(|a| a == "bench") {
        return Ok(());
    }
    let image_opts = args.iter().any(|a| a == "--image-opts");
    args.retain(|a| a != "--image-opts");
    // convert's `--target-image-opts`: its last name (the output) is an option string.
    let target_opts = args.iter().any(|a| a == "--target-image-opts");
    let last = args.len().saturating_sub(1);
    // How the tool names the image it could not open (qemu-io's words differ).
    let io = program == "qemu-io" || args.get(1).is_some_and(|a| a == "io");
    // qemu-io names a `json:` or `blkdebug:` name it could not open ("can't open device").
    let named = |s: &str| {
        ["json:", "blkdebug:", "null-co:"]
            .iter()
            .any(|p| s.starts_with(p))
    };
    let failed = |s: &str, e: String| match (io, named(s)) {
        (true, true) => format!("can't open device {s}: {e}"),
        (true, false) => format!("can't open: {e}"),
        (false, _) => format!("Could not open '{s}': {e}"),
    };
    let args_are_convert = args.get(1).is_some_and(|a| a == "convert");
    for (i, a) in args.iter_mut().enumerate().skip(1) {
        let Some(s) = a.to_str() else { continue };
        if let Some(name) = s.strip_prefix("file:").filter(|n| !n.is_empty()) {
            // The file protocol named explicitly: the rest is the file name.
            *a = name.to_string().into();
            continue;
        }
        if s.starts_with(qimg::io::null::NULL_CO) && s != qimg::io::null::NULL_CO {
            return Err(failed(
                s,
                "The only allowed filename for this driver is 'null-co://'".into(),
            ));
        }
        if let Some(rest) = s.strip_prefix("blkdebug:") {
            // `blkdebug:CONFIG:IMAGE`: error injection over the file IMAGE.
            let (config, image) = rest.split_once(':').ok_or_else(|| {
                failed(
                    s,
                    "blkdebug requires both config file and image path".into(),
                )
            })?;
            let mut rules = qimg::io::BlkdebugConfig::default();
            if !config.is_empty() {
                rules = blkdebug_file(config).map_err(|e| failed(s, e))?;
            }
            qimg::io::blkdebug::attach(image, rules);
            *a = image.to_string().into();
            continue;
        }
        // With `--image-opts` every image name is an option string, a `json:` one too
        // (convert's output excepted).
        let convert_output = i == last && args_are_convert;
        let opts = (image_opts && !convert_output) || (target_opts && i == last);
        let pairs = if let Some(json) = s.strip_prefix("json:").filter(|_| !opts) {
            let v: Value = serde_json::from_str(json).map_err(|e| {
                failed(
                    s,
                    format!("Could not parse the JSON options: {}", json_error(json, &e)),
                )
            })?;
            let mut pairs = Vec::new();
            flatten(&v, "", &mut pairs).map_err(|e| failed(s, e))?;
            pairs
        } else if opts && (is_option_string(s) || s.starts_with("json:")) {
            option_pairs(s, io)
        } else {
            if image_opts && !s.starts_with('-') && !s.contains(['=', ',', ' ']) {
                crate::option_string::remember_plain(s, io);
                crate::status::remember_typed(s, s);
            }
            continue;
        };
        let (name, ov) = file_name(&pairs, program).map_err(|e| failed(s, e))?;
        crate::status::remember_typed(&name, s);
        OVERRIDES
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((name.clone(), ov));
        *a = name.into();
    }
    Ok(())
}

/// Whether `key` is a runtime option qimg takes and leaves to its own defaults.
pub fn ignored(key: &str) -> bool {
    IGNORED.contains(&key) || key.starts_with("overlap-check.")
}

/// What qemu-io's `open -o` options say: `(file name, driver, read-only when given)`.
pub type OpenNames = (Option<String>, Option<String>, Option<bool>);

/// qemu-io's `open -o` options: `(file name they name, driver, read-only when given)`. The
/// file name may come from the command's operand instead; the driver, when named, must be
/// qcow2 or raw.
pub fn open_options(
    pairs: &[(String, String)],
    operand: Option<&Path>,
) -> Result<OpenNames, String> {
    let get = |key: &str| pairs.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v);
    let driver = get("driver").cloned();
    if let Some(d) = driver.as_deref().filter(|d| !matches!(*d, "qcow2" | "raw")) {
        return Err(format!("Unknown driver '{d}'"));
    }
    match get("file.driver").map(String::as_str) {
        None | Some("file") => {}
        Some(other) => return Err(format!("the protocol '{other}' is not supported")),
    }
    node_reference(get("file"))?;
    let file = get("file.filename");
    if file.is_none() && operand.is_none() && get("file.driver").is_some_and(|d| d == "file") {
        return Err("The 'file' block driver requires a file name".into());
    }
    if file.or(get("filename")).is_none() && operand.is_none() {
        // Before the options are checked, as QEMU opens the file node first.
        if driver.is_none() && get("file.driver").is_none() {
            return Err("Must specify either driver or file".into());
        }
        return Err("A block device must be specified for \"file\"".into());
    }
    crate::runtime_opts::check(pairs, file.map(Path::new).or(operand))?;
    for (k, _) in pairs {
        let known = matches!(
            k.as_str(),
            "driver" | "file" | "file.driver" | "file.filename" | "filename"
        ) || (k.starts_with("encrypt.") && driver.as_deref() != Some("raw"));
        if !known && !ignored(k) {
            let d = driver.as_deref().unwrap_or("qcow2");
            return Err(format!(
                "Block format '{d}' does not support the option '{k}'"
            ));
        }
    }
    let name = get("file.filename").or_else(|| get("filename"));
    let encrypt: Vec<(String, String)> = pairs
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix("encrypt.")?.to_string(), v.clone())))
        .collect();
    let image = name
        .cloned()
        .or_else(|| operand.map(|p| p.display().to_string()));
    if let (false, Some(image)) = (encrypt.is_empty(), image) {
        crate::encryption::remember_options(&image, encrypt);
    }
    let read_only = get("read-only").map(|v| v == "on" || v == "true");
    Ok((name.cloned(), driver, read_only))
}

/// The rules of a blkdebug config file, refused in QEMU's words.
fn blkdebug_file(path: &str) -> Result<qimg::io::BlkdebugConfig, String> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        format!(
            "Could not read blkdebug config file: {}",
            crate::status::os_msg(&e)
        )
    })?;
    qimg::io::BlkdebugConfig::parse_file(&text)
}

/// The image file a `blkdebug` node under `prefix` (`"file."`) names, with its rules
/// attached to it ([`qimg::io::blkdebug::attach`]), and the keys it used.
fn blkdebug_node(
    pairs: &[(String, String)],
    prefix: &str,
) -> Result<(Option<String>, Vec<String>), String> {
    let mut own = Vec::new();
    let mut used = Vec::new();
    for (k, v) in pairs {
        if let Some(rest) = k.strip_prefix(prefix) {
            own.push((rest.to_string(), v.clone()));
            used.push(k.clone());
        }
    }
    let get = |key: &str| {
        own.iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    };
    let mut rules = match get("config") {
        Some(path) => blkdebug_file(&path)?,
        None => qimg::io::BlkdebugConfig::default(),
    };
    let rest = rules.from_options(&own)?;
    crate::runtime_opts::check_blkdebug(&own)?;
    for k in rest {
        let ok = matches!(
            k.as_str(),
            "driver"
                | "config"
                | "image"
                | "image.filename"
                | "align"
                | "max-transfer"
                | "opt-write-zero"
                | "max-write-zero"
                | "opt-discard"
                | "max-discard"
                | "take-child-perms"
                | "unshare-child-perms"
                | "node-name"
        ) || (k == "image.driver" && get("image.driver").as_deref() == Some("file"));
        if !ok {
            return Err(format!(
                "Block protocol 'blkdebug' does not support the option '{k}'"
            ));
        }
    }
    let image = get("image.filename").or_else(|| get("image"));
    if let Some(image) = &image {
        qimg::io::blkdebug::attach(image.as_str(), rules);
    }
    Ok((image, used))
}

/// Flattens JSON objects into qemu's dotted keys.
fn flatten(v: &Value, prefix: &str, out: &mut Vec<(String, String)>) -> Result<(), String> {
    let Value::Object(map) = v else {
        return Err("Invalid JSON object given".into());
    };
    for (k, v) in map {
        let key = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match v {
            Value::Object(_) => flatten(v, &key, out)?,
            Value::String(s) => out.push((key, s.clone())),
            Value::Bool(b) => out.push((key, if *b { "on" } else { "off" }.into())),
            Value::Number(n) => out.push((key, n.to_string())),
            // `"backing": null`: no backing file.
            Value::Null => out.push((key, NULL.to_string())),
            // Lists (blkdebug's rules) as QEMU flattens them: `key.0.field`.
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    let key = format!("{key}.{i}");
                    match item {
                        Value::Object(_) => flatten(item, &key, out)?,
                        Value::String(s) => out.push((key, s.clone())),
                        Value::Number(n) => out.push((key, n.to_string())),
                        Value::Bool(b) => out.push((key, if *b { "on" } else { "off" }.into())),
                        _ => return Err(format!("option '{key}': nested lists are not taken")),
                    }
                }
            }
        }
    }
    Ok(())
}

/// The file name an option set names, for the qcow2 or raw driver on a file (or the file
/// driver alone, or no driver: the format is probed), and what else it says about the image.
fn file_name(pairs: &[(String, String)], program: &str) -> Result<(String, Overrides), String> {
    let get = |key: &str| pairs.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v);
    let owned = |key: &str| get(key).cloned();
    let driver = get("driver").map(String::as_str).unwrap_or("");
    let mut ov = Overrides::default();
    let mut encrypt = Vec::new();
    let mut nbd_keys = Vec::new();
    let mut nbd = |prefix: &str| -> Result<Option<String>, String> {
        let (name, used) = nbd_name(&owned, prefix)?;
        nbd_keys = used;
        Ok(Some(name))
    };
    let mut blkdebug_keys = Vec::new();
    let mut null_keys: Vec<String> = Vec::new();
    let mut null = |prefix: &str| -> Result<Option<String>, String> {
        let key = |k: &str| format!("{prefix}{k}");
        let mut opts = qimg::io::NullOptions::default();
        if let Some(v) = get(&key("size")) {
            opts.size = crate::args::parse_size(v)
                .ok_or("Parameter 'size' expects a non-negative number below 2^64")?;
        }
        if let Some(v) = get(&key("read-zeroes")) {
            opts.read_zeroes = crate::args::on_off("read-zeroes", v)?;
        }
        null_keys = ["size", "read-zeroes", "latency-ns"]
            .iter()
            .map(|k| key(k))
            .collect();
        Ok(Some(opts.name()))
    };
    let name = match driver {
        "qcow2" | "raw" | "" => {
            if !driver.is_empty() {
                ov.format = Some(driver.to_string());
            }
            match get("file.driver").map(String::as_str) {
                None | Some("file") => {
                    node_reference(get("file"))?;
                    get("file.filename").cloned()
                }
                Some("nbd") => nbd("file.")?,
                Some("null-co" | "null-aio") => null("file.")?,
                Some("blkdebug") => {
                    let (image, used) = blkdebug_node(pairs, "file.")?;
                    blkdebug_keys = used;
                    image
                }
                Some(other) => return Err(format!("the protocol '{other}' is not supported")),
            }
        }
        // The file itself as the image (QEMU's protocol node, format `file`): read as raw.
        "file" => {
            ov.format = Some("file".into());
            get("filename").cloned()
        }
        // QEMU's null device as the image, with no format layer.
        "null-co" | "null-aio" => {
            ov.format = Some(driver.to_string());
            null("")?
        }
        // The export itself as the image, read as raw (what QEMU's protocol node reads).
        "nbd" => {
            ov.format = Some("raw".into());
            nbd("")?
        }
        other => return Err(format!("Unknown driver '{other}'")),
    };
    // QEMU opens the file node before the format checks its options.
    if name.is_none() && !driver.is_empty() {
        return Err("A block device must be specified for \"file\"".into());
    }
    let window = driver == "raw";
    if let (true, Some(n)) = (window, &name) {
        crate::raw_window::apply(n, get("offset"), get("size"))?;
    }
    crate::runtime_opts::check(pairs, name.as_deref().map(Path::new))?;
    for (k, v) in pairs {
        let generic = if crate::args::is_null_driver(driver) {
            k == "driver"
        } else {
            matches!(
                k.as_str(),
                "driver" | "file" | "file.driver" | "file.filename" | "filename"
            )
        };
        let known = generic
            || nbd_keys.contains(k)
            || blkdebug_keys.contains(k)
            || null_keys.contains(k)
            || (window && matches!(k.as_str(), "offset" | "size"));
        match k.as_str() {
            _ if known || ignored(k) => {}
            "backing" if v == NULL && driver == "qcow2" => ov.no_backing = true,
            "backing" if v.is_empty() && driver == "qcow2" => {
                eprintln!(
                    "{}: warning: Use of \"backing\": \"\" is deprecated; use \"backing\": null \
                     instead",
                    program
                );
                ov.no_backing = true;
            }
            "data-file" if driver == "qcow2" => ov.data_file = Some(v.clone()),
            k if k.starts_with("encrypt.") && matches!(driver, "qcow2" | "") => {
                encrypt.push((k["encrypt.".len()..].to_string(), v.clone()));
            }
            // An encrypted backing file's key (the engine tries the one key on each file).
            "backing.encrypt.key-secret" if matches!(driver, "qcow2" | "") => {
                encrypt.push(("backing.key-secret".to_string(), v.clone()));
            }
            "data-file.filename" if driver == "qcow2" => ov.data_file = Some(v.clone()),
            "data-file.driver" if driver == "qcow2" && v == "file" => {}
            _ if crate::args::is_null_driver(driver) => {
                return Err(format!(
                    "Block protocol '{driver}' doesn't support the option '{k}'"
                ));
            }
            _ => {
                let d = if driver.is_empty() { "qcow2" } else { driver };
                return Err(format!(
                    "Block format '{d}' does not support the option '{k}'"
                ));
            }
        }
    }
    if driver.is_empty() && name.is_none() {
        return Err("Parameter 'driver' is required".into());
    }
    let name = name.ok_or_else(|| "A block device must be specified for \"file\"".to_string())?;
    if !encrypt.is_empty() {
        crate::encryption::remember_options(&name, encrypt);
    }
    Ok((name, ov))
}

/// Why a `json:` name did not parse, in the words of QEMU's JSON parser where they are
/// known (serde_json's otherwise).
fn json_error(json: &str, e: &serde_json::Error) -> String {
    let text = e.to_string();
    if json.trim().is_empty() {
        "Expecting a JSON value".into()
    } else if e.is_eof() {
        "JSON parse error, premature EOI".into()
    } else if text.starts_with("trailing characters") {
        "Expecting at most one JSON value".into()
    } else if text.starts_with("expected value") || text.starts_with("trailing comma") {
        "JSON parse error, expecting value".into()
    } else if text.starts_with("expected `:`") {
        "JSON parse error, missing : in object pair".into()
    } else {
        text
    }
}

#[cfg(test)]
#[path = "image_spec_tests.rs"]
mod tests;

//! Encryption on the command line: `--object secret` objects, the `encrypt.*` options an
//! image was named with (`--image-opts`, `json:`, qemu-io's `open -o`), and QEMU's checks of
//! those options against an image's header.

use std::sync::Mutex;

/// `--object secret` ids (their data is checked when the object is made; qimg does not
/// decrypt images yet, so only their presence is used, by [`encryption_refusal`]).
static SECRETS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// `encrypt.*` options: `(key without the prefix, value)`.
type Pairs = Vec<(String, String)>;

/// The `encrypt.*` options of each image name.
static OPTIONS: Mutex<Vec<(String, Pairs)>> = Mutex::new(Vec::new());

/// Records a `secret` object's id.
pub fn add_secret(id: &str) {
    let mut all = SECRETS.lock().unwrap_or_else(|e| e.into_inner());
    all.push(id.to_string());
}

/// Whether a `secret` object with id `id` was given.
pub fn has_secret(id: &str) -> bool {
    let all = SECRETS.lock().unwrap_or_else(|e| e.into_inner());
    all.iter().any(|s| s == id)
}

/// Records the `encrypt.*` options (`pairs`, keys without the prefix) image `name` was
/// given, checked against the image by [`encryption_refusal`].
pub fn remember_options(name: &str, pairs: Pairs) {
    let mut all = OPTIONS.lock().unwrap_or_else(|e| e.into_inner());
    all.push((name.to_string(), pairs));
}

/// The `encrypt.*` options image `name` was given (the last naming wins).
fn options(name: &str) -> Pairs {
    let all = OPTIONS.lock().unwrap_or_else(|e| e.into_inner());
    all.iter()
        .rev()
        .find(|(n, _)| n == name)
        .map(|(_, o)| o.clone())
        .unwrap_or_default()
}

/// QEMU's checks of image `name`'s `encrypt.*` options against the encryption its header
/// (`c0`) reports, in QEMU's words: a format that differs, an option the format does not
/// take, and, when the command reads or writes the image (`needs_key`; not `info`), the key
/// (`encrypt.key-secret` naming a `--object secret`). An image that passes them all is still
/// refused, in qimg's words: qimg does not decrypt yet. `None` for an unencrypted image without
/// `encrypt.format`.
pub fn encryption_refusal(
    c0: &qimg::format::cluster0::Cluster0,
    name: &str,
    needs_key: bool,
) -> Option<String> {
    let method = c0.header.crypt_method;
    let opts = options(name);
    let get = |key: &str| opts.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v);
    let header = match method {
        0 => None,
        1 => Some("aes"),
        _ => Some("luks"),
    };
    match (header, get("format")) {
        (None, Some(f)) => {
            return Some(format!(
                "No encryption in image header, but options specified format '{f}'"
            ));
        }
        (Some(h), Some(f)) if h != f => {
            return Some(format!(
                "Header reported '{h}' encryption format but options specify '{f}'"
            ));
        }
        (None, None) => return None,
        _ => {}
    }
    if let Some((k, _)) = opts
        .iter()
        .find(|(k, _)| k != "format" && k != "key-secret")
    {
        return Some(format!("Parameter '{k}' is unexpected"));
    }
    if !needs_key {
        return None;
    }
    match get("key-secret") {
        None => Some("Parameter 'encrypt.key-secret' is required for cipher".into()),
        Some(id) if !has_secret(id) => Some(format!("No secret with id '{id}'")),
        Some(_) => Some(format!(
            "qimg cannot decrypt {} images yet (crypt_method {method} at offset 32)",
            header.unwrap_or("encrypted").to_uppercase()
        )),
    }
}

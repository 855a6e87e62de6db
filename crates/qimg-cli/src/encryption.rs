//! Encryption on the command line: `--object secret` objects, the `encrypt.*` options an
//! image was named with (`--image-opts`, `json:`, qemu-io's `open -o`), QEMU's checks of
//! those options against an image's header, and the passphrase an image opens with.

use std::sync::Mutex;

/// `encrypt.*` options: `(key without the prefix, value)`.
type Pairs = Vec<(String, String)>;

/// The `encrypt.*` options of each image name.
static OPTIONS: Mutex<Vec<(String, Pairs)>> = Mutex::new(Vec::new());

/// `--object secret` objects: `(id, data)` (the passphrases of encrypted images).
static SECRETS: Mutex<Vec<(String, Vec<u8>)>> = Mutex::new(Vec::new());

/// Records a `secret` object.
pub fn add_secret(id: &str, data: Vec<u8>) {
    let mut all = SECRETS.lock().unwrap_or_else(|e| e.into_inner());
    all.push((id.to_string(), data));
}

/// Whether a `secret` object with id `id` was given.
pub fn has_secret(id: &str) -> bool {
    secret(id).is_some()
}

/// The data of `secret` object `id`.
pub fn secret(id: &str) -> Option<Vec<u8>> {
    let all = SECRETS.lock().unwrap_or_else(|e| e.into_inner());
    all.iter()
        .rev()
        .find(|(s, _)| s == id)
        .map(|(_, d)| d.clone())
}

/// Passphrases of images this command made encrypted (`convert -O qcow2 -o encrypt.*`),
/// by image name.
static KEYS: Mutex<Vec<(String, Vec<u8>)>> = Mutex::new(Vec::new());

/// Records that image `name` opens with `passphrase` (an output this command encrypted).
pub fn add_key(name: &str, passphrase: Vec<u8>) {
    let mut all = KEYS.lock().unwrap_or_else(|e| e.into_inner());
    all.push((name.to_string(), passphrase));
}

/// The passphrase of image `name`: the secret its `encrypt.key-secret` names, or the one
/// this command made it with ([`add_key`]).
pub fn key_for(name: &str) -> Option<Vec<u8>> {
    let opts = options(name);
    let named = |key: &str| {
        opts.iter()
            .rev()
            .find(|(k, _)| k == key)
            .and_then(|(_, id)| secret(id))
    };
    let given = named("key-secret").or_else(|| named("backing.key-secret"));
    given.or_else(|| {
        let all = KEYS.lock().unwrap_or_else(|e| e.into_inner());
        all.iter()
            .rev()
            .find(|(n, _)| n == name)
            .map(|(_, k)| k.clone())
    })
}

/// Standard base64 (`format=base64` secrets), padding optional; `None` for anything else.
pub fn base64_decode(text: &[u8]) -> Option<Vec<u8>> {
    let value = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let text: Vec<u8> = text
        .iter()
        .copied()
        .filter(|c| !c.is_ascii_whitespace())
        .collect();
    let body = text
        .strip_suffix(b"==")
        .or(text.strip_suffix(b"="))
        .unwrap_or(&text);
    if body.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(body.len() * 3 / 4);
    for chunk in body.chunks(4) {
        let mut acc = 0u32;
        for &c in chunk {
            acc = acc << 6 | value(c)?;
        }
        acc <<= 6 * (4 - chunk.len() as u32);
        let bytes = acc.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    Some(out)
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
/// (`encrypt.key-secret` naming a `--object secret`, which the open then tries). The legacy
/// AES method is refused in qimg's words (qimg does not decrypt it). `None` when the image
/// may be opened.
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
        .find(|(k, _)| k != "format" && k != "key-secret" && !k.starts_with("backing."))
    {
        return Some(format!("Parameter '{k}' is unexpected"));
    }
    if !needs_key {
        return None;
    }
    match get("key-secret") {
        None => Some("Parameter 'encrypt.key-secret' is required for cipher".into()),
        Some(id) if !has_secret(id) => Some(format!("No secret with id '{id}'")),
        // LUKS: the open unlocks it with the secret (`image_spec::options_for`).
        Some(_) if method == 2 => None,
        Some(_) => Some(format!(
            "qimg does not decrypt AES-CBC encrypted images (crypt_method {method} at offset 32)"
        )),
    }
}

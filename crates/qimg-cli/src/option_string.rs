//! `--image-opts` option strings as QEMU's option parser reads them: `key=value` pairs,
//! short-form booleans, a plain name where a string was wanted, and `file=NAME` as a node
//! reference.

use std::sync::Mutex;

use crate::args::split_opts;

/// Plain names given where `--image-opts` wants an option string: QEMU parses each as one,
/// and no such string names an image (see [`plain_option_string`]).
static PLAIN: Mutex<Vec<(String, bool)>> = Mutex::new(Vec::new());

/// Notes that `name` was given plainly where `--image-opts` wants an option string (`io`:
/// by qemu-io).
pub fn remember_plain(name: &str, io: bool) {
    PLAIN
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((name.to_string(), io));
}

/// The `key=value` pairs of an `--image-opts` string, as QEMU's option parser reads them: an
/// element without `=` is a short-form boolean (`NAME=on`, with QEMU's deprecation warning),
/// except that qemu-img takes a first one as `file=NAME`.
pub fn option_pairs(s: &str, io: bool) -> Vec<(String, String)> {
    split_opts(s)
        .into_iter()
        .enumerate()
        .map(|(i, p)| match p.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None if i == 0 && !io => ("file".to_string(), p),
            None => {
                short_form_warning(&p);
                (p, "on".to_string())
            }
        })
        .collect()
}

/// QEMU's warning for a short-form boolean option (`NAME` for `NAME=on`).
fn short_form_warning(name: &str) {
    eprintln!(
        "{}: warning: short-form boolean option '{name}' deprecated\nPlease use {name}=on instead",
        crate::status::program()
    );
}

/// Why `file`, given plainly where `--image-opts` wants an option string, opens nothing, in
/// QEMU's words: qemu-img reads it as `file=NAME` (a node reference), qemu-io as the
/// short-form boolean `NAME=on` (after its warning), which names no driver and no file.
pub fn plain_option_string(file: &str) -> Option<String> {
    let plain = PLAIN.lock().unwrap_or_else(|e| e.into_inner());
    let (_, io) = plain.iter().find(|(p, _)| p == file)?;
    if *io {
        short_form_warning(file);
        return Some("Must specify either driver or file".into());
    }
    node_reference(Some(&file.to_string())).err()
}

/// `file=NAME` (a string, not an object): QEMU takes it as the name of a block node defined
/// elsewhere (`--blockdev`), which qemu-img and qemu-io never have, and refuses it so.
pub fn node_reference(file: Option<&String>) -> Result<(), String> {
    match file {
        Some(v) => Err(format!("Cannot find device='{v}' nor node-name='{v}'")),
        None => Ok(()),
    }
}

/// Whether `s` is an `--image-opts` option string rather than another argument.
pub fn is_option_string(s: &str) -> bool {
    split_opts(s).iter().any(|p| {
        let key = p.split_once('=').map_or(p.as_str(), |(k, _)| k);
        matches!(key, "driver" | "file" | "file.filename" | "filename")
    })
}

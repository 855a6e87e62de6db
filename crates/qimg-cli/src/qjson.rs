//! JSON printed as QEMU's tools print it (`qobject_to_json_pretty`), so that output can be
//! compared byte for byte: four-space indentation; an object's members in the order QEMU's
//! `QDict` iterates them (by hash bucket of the key, the later-inserted first within a
//! bucket); empty lists and objects on two lines; non-ASCII and control characters as
//! `\uXXXX` escapes with upper-case hex.

use serde_json::Value;

/// `QDICT_BUCKET_MAX`.
const BUCKETS: u32 = 512;

/// QEMU's `tdb_hash` of a dictionary key.
fn tdb_hash(name: &str) -> u32 {
    let bytes = name.as_bytes();
    let mut value = 0x238F_13AFu32.wrapping_mul(bytes.len() as u32);
    for (i, &b) in bytes.iter().enumerate() {
        value = value.wrapping_add(u32::from(b) << ((i * 5) % 24));
    }
    1_103_515_243u32.wrapping_mul(value).wrapping_add(12345)
}

/// `v` as qemu-img prints it with `--output=json` (no final newline).
pub fn pretty(v: &Value) -> String {
    let mut out = String::new();
    write(v, 0, &mut out);
    out
}

/// `v` as QEMU's `qobject_to_json` writes it on one line (`json:` names): members in the
/// same order as [`pretty`], `": "` and `", "` between.
pub fn compact(v: &Value) -> String {
    let mut out = String::new();
    write_compact(v, &mut out);
    out
}

fn write_compact(v: &Value, out: &mut String) {
    match v {
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_compact(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (j, (k, v)) in members(map).into_iter().enumerate() {
                if j > 0 {
                    out.push_str(", ");
                }
                quoted(k, out);
                out.push_str(": ");
                write_compact(v, out);
            }
            out.push('}');
        }
        scalar => write(scalar, 0, out),
    }
}

/// An object's members in the order QEMU's `QDict` visits them: buckets in order; within
/// one, the member inserted last first.
pub(crate) fn members(map: &serde_json::Map<String, Value>) -> Vec<(&String, &Value)> {
    let mut members: Vec<(u32, usize, &String, &Value)> = map
        .iter()
        .enumerate()
        .map(|(i, (k, v))| (tdb_hash(k) % BUCKETS, i, k, v))
        .collect();
    members.sort_by_key(|&(bucket, i, _, _)| (bucket, std::cmp::Reverse(i)));
    members.into_iter().map(|(_, _, k, v)| (k, v)).collect()
}

/// The `json:{...}` name QEMU shows for an image given as the option string or `json:` name
/// `typed` (as `typed_name` keeps it): the options as a JSON object, each object's keys in
/// the order of QEMU's `QDict` buckets (its `tdb_hash` modulo 512), `": "` and `", "`
/// between. Option-string values stay strings, as QEMU keeps them. `None` for other names.
pub fn qemu_json_name(typed: &str) -> Option<String> {
    let v = options_value(typed)?;
    Some(format!("json:{}", compact(&v)))
}

/// The object under key `key` of the options `typed` names, as [`qemu_json_name`] renders it
/// (a child node's name: `file`).
pub fn qemu_json_child(typed: &str, key: &str) -> Option<String> {
    let v = options_value(typed)?;
    let child = v.get(key)?;
    child
        .is_object()
        .then(|| format!("json:{}", compact(child)))
}

/// The `json:{...}` name QEMU shows for a qcow2 image opened with `encrypt.key-secret` (one
/// of qcow2's "strong" options, which make QEMU name the node by its options): `driver`,
/// `file` and the key secret, which QEMU keeps as the flat key `encrypt.key-secret`. `None`
/// when `typed` gives no key secret.
pub fn qemu_json_key_name(typed: &str) -> Option<String> {
    let v = options_value(typed)?;
    let Value::Object(mut all) = v else {
        return None;
    };
    let secret = all
        .remove("encrypt")
        .and_then(|e| e.get("key-secret").cloned())?;
    let mut shown = serde_json::Map::new();
    shown.insert("encrypt.key-secret".into(), secret);
    for key in ["driver", "file"] {
        if let Some(v) = all.remove(key) {
            shown.insert(key.into(), v);
        }
    }
    Some(format!("json:{}", compact(&Value::Object(shown))))
}

fn options_value(typed: &str) -> Option<Value> {
    let mut v = options_as_given(typed)?;
    // The file child's protocol, when not given, is QEMU's default, which it names.
    if let Some(Value::Object(file)) = v.get_mut("file") {
        file.entry("driver")
            .or_insert_with(|| Value::String("file".into()));
    }
    Some(v)
}

fn options_as_given(typed: &str) -> Option<Value> {
    if let Some(json) = typed.strip_prefix("json:") {
        return serde_json::from_str::<Value>(json)
            .ok()
            .filter(Value::is_object);
    }
    let mut root = serde_json::Map::new();
    for p in crate::args::split_opts(typed) {
        let (k, v) = p.split_once('=')?;
        let mut parts: Vec<&str> = k.split('.').collect();
        let last = parts.pop()?;
        let mut at = &mut root;
        for part in parts {
            let next = at
                .entry(part.to_string())
                .or_insert_with(|| Value::Object(serde_json::Map::new()));
            at = next.as_object_mut()?;
        }
        at.insert(last.to_string(), Value::String(v.to_string()));
    }
    Some(Value::Object(root))
}

fn indent(level: usize, out: &mut String) {
    out.push_str(&"    ".repeat(level));
}

fn write(v: &Value, level: usize, out: &mut String) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => quoted(s, out),
        Value::Array(items) => {
            out.push_str("[\n");
            for (i, item) in items.iter().enumerate() {
                indent(level + 1, out);
                write(item, level + 1, out);
                out.push_str(if i + 1 < items.len() { ",\n" } else { "\n" });
            }
            indent(level, out);
            out.push(']');
        }
        Value::Object(map) => {
            out.push_str("{\n");
            let members = members(map);
            let n = members.len();
            for (j, (k, v)) in members.into_iter().enumerate() {
                indent(level + 1, out);
                quoted(k, out);
                out.push_str(": ");
                write(v, level + 1, out);
                out.push_str(if j + 1 < n { ",\n" } else { "\n" });
            }
            indent(level, out);
            out.push('}');
        }
    }
}

/// A JSON string as QEMU's `quoted_str` writes it.
fn quoted(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || (c as u32) >= 0x7f => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04X}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_option_sets_are_rendered_as_qemu_shows_them() {
        // What qemu-img 10 prints for these names (`image:` of `info`).
        assert_eq!(
            qemu_json_name(r#"json:{"size":4096,"read-zeroes":true,"driver":"null-co"}"#).unwrap(),
            r#"json:{"read-zeroes": true, "driver": "null-co", "size": 4096}"#
        );
        assert_eq!(
            qemu_json_name("driver=null-co,read-zeroes=on").unwrap(),
            r#"json:{"read-zeroes": "on", "driver": "null-co"}"#
        );
        let nested = r#"json:{"driver":"raw","file":{"driver":"null-co","size":4096}}"#;
        assert_eq!(
            qemu_json_name(nested).unwrap(),
            r#"json:{"driver": "raw", "file": {"driver": "null-co", "size": 4096}}"#
        );
        assert_eq!(
            qemu_json_child(nested, "file").unwrap(),
            r#"json:{"driver": "null-co", "size": 4096}"#
        );
        assert_eq!(qemu_json_name("json:[1]"), None);
    }

    #[test]
    fn members_come_in_qdict_order_with_qemus_layout() {
        let v = serde_json::json!({
            "filename": "a/\u{fc}.qcow2",
            "format": "qcow2",
            "virtual-size": 1,
            "children": [],
            "format-specific": {"type": "file", "data": {}},
        });
        let want = "{\n    \"children\": [\n    ],\n    \"virtual-size\": 1,\n    \
                    \"filename\": \"a/\\u00FC.qcow2\",\n    \"format\": \"qcow2\",\n    \
                    \"format-specific\": {\n        \"type\": \"file\",\n        \"data\": {\n        \
                    }\n    }\n}";
        assert_eq!(pretty(&v), want);
    }
}

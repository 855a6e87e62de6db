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
            // Buckets in order; within one, the member inserted last comes first.
            let mut members: Vec<(u32, usize, &String, &Value)> = map
                .iter()
                .enumerate()
                .map(|(i, (k, v))| (tdb_hash(k) % BUCKETS, i, k, v))
                .collect();
            members.sort_by_key(|&(bucket, i, _, _)| (bucket, std::cmp::Reverse(i)));
            let n = members.len();
            for (j, (_, _, k, v)) in members.into_iter().enumerate() {
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

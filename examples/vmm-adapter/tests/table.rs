//! The table in `qimg::queue`'s docs says how each `AsyncIo` call maps onto a `Queue`. This
//! test holds it to the adapter's code: the table names exactly the stand-in trait's methods,
//! the adapter implements exactly those, every qimg item a row names is used by the adapter,
//! and the `unmap` a row promises is the one that method passes.

use std::collections::BTreeSet;

const QUEUE_DOCS: &str = include_str!("../../../crates/qimg/src/engine/queue/mod.rs");
const TRAIT: &str = include_str!("../src/vmm.rs");
const ADAPTER: &str = include_str!("../src/adapter.rs");

/// The rows of the mapping table: `(AsyncIo column, Queue column)`.
fn rows() -> Vec<(String, String)> {
    let start = QUEUE_DOCS
        .find("//! | `AsyncIo` | `Queue` |")
        .expect("the table's header");
    QUEUE_DOCS[start..]
        .lines()
        .skip(2)
        .map_while(|l| l.strip_prefix("//! | "))
        .map(|l| {
            let (left, right) = l.split_once(" | ").expect("two columns");
            (left.to_string(), right.trim_end_matches(" |").to_string())
        })
        .collect()
}

/// The method a table cell starts with: `` `read_vectored(op, user_data)` `` gives
/// `read_vectored`.
fn method(cell: &str) -> String {
    let code = cell.trim_start_matches('`');
    code.split(['(', '`'])
        .next()
        .unwrap_or_default()
        .to_string()
}

/// The names of the `fn`s in the block of `text` that starts with `header`.
fn fns_in(text: &str, header: &str) -> BTreeSet<String> {
    let start = text.find(header).unwrap_or_else(|| panic!("no `{header}`"));
    let block = &text[start..];
    let end = block.find("\n}\n").map_or(block.len(), |e| e + 2);
    block[..end]
        .split("fn ")
        .skip(1)
        .map(|s| s.split(['(', '<']).next().unwrap_or_default().to_string())
        .collect()
}

/// The body of the adapter's `fn name(`, up to the next `fn`.
fn body(name: &str) -> &'static str {
    let impl_at = ADAPTER
        .find("impl AsyncIo for QcowAsyncIo")
        .expect("the impl");
    let text = &ADAPTER[impl_at..];
    let start = text
        .find(&format!("fn {name}("))
        .unwrap_or_else(|| panic!("no fn {name}"));
    let rest = &text[start + 3..];
    &rest[..rest.find("\n    fn ").unwrap_or(rest.len())]
}

/// The `Type::item` paths a cell names, for the qimg types of the queue API.
fn api_paths(cell: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut rest = cell;
    while let Some(at) = rest.find("::") {
        let ty: String = rest[..at].chars().rev().take_while(|&c| ident(c)).collect();
        let ty: String = ty.chars().rev().collect();
        let item: String = rest[at + 2..].chars().take_while(|&c| ident(c)).collect();
        if ["Queue", "QueueOptions", "IoBuffers", "Request"].contains(&ty.as_str()) {
            out.push((ty, item));
        }
        rest = &rest[at + 2..];
    }
    out
}

#[test]
fn the_queue_docs_table_matches_the_adapter() {
    let rows = rows();
    assert!(rows.len() >= 9, "the table has {} rows", rows.len());
    let in_table: BTreeSet<String> = rows.iter().map(|(l, _)| method(l)).collect();
    let in_trait = fns_in(TRAIT, "pub trait AsyncIo");
    let in_adapter = fns_in(ADAPTER, "impl AsyncIo for QcowAsyncIo");
    assert_eq!(
        in_table, in_trait,
        "the table's methods are not the trait's"
    );
    assert_eq!(
        in_adapter, in_trait,
        "the adapter implements other methods than the trait's"
    );
    for (left, right) in &rows {
        let name = method(left);
        let paths = api_paths(right);
        let plain = [
            "flush_blocking",
            "submit_batch",
            "next_completed",
            "eventfd_of",
        ];
        assert!(
            !paths.is_empty() || plain.iter().any(|p| right.contains(p)),
            "row {name}: names no queue API"
        );
        for (ty, item) in paths {
            let used = match ty.as_str() {
                "Request" => ADAPTER.contains(&format!("Request::{item}")),
                _ => {
                    ADAPTER.contains(&format!("{item}(")) || ADAPTER.contains(&format!("{item}::<"))
                }
            };
            assert!(used, "row {name}: the adapter does not use {ty}::{item}");
        }
        for p in plain {
            if right.contains(p) {
                assert!(
                    ADAPTER.contains(&format!(".{p}(")),
                    "row {name}: the adapter never calls {p}"
                );
            }
        }
        for unmap in ["true", "false"] {
            if right.contains(&format!("`unmap: {unmap}`")) {
                let b = body(&name);
                assert!(
                    b.contains(&format!("unmap = {unmap}")),
                    "row {name}: promises unmap: {unmap}; the adapter: {b}"
                );
            }
        }
        if left.contains("Some(") {
            assert!(body(&name).contains("Some(u) => self.submit(Request::Flush, u)"));
        }
        if left.contains("None)") {
            assert!(body(&name).contains("None => Ok(self.queue.flush_blocking()?)"));
        }
    }
}

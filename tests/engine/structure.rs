//! The shape issue 30 asked the code to keep, checked on every run rather than by hand: no
//! non-test source file over 700 lines, and no `try_*_cached` twin of an async metadata
//! operation (each operation has one body; `Meta`'s fields are private to `engine/meta/`,
//! which the compiler enforces).

use std::path::{Path, PathBuf};

/// Most lines in one non-test source file.
const MAX_LINES: usize = 700;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every `.rs` file under `dir` that is not a test (no `tests` directory, no `test` in its
/// name).
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if p.is_dir() {
            if name != "tests" && name != "target" {
                sources(&p, out);
            }
        } else if name.ends_with(".rs") && !name.contains("test") {
            out.push(p);
        }
    }
}

#[test]
fn source_files_stay_small_and_metadata_operations_have_one_body() {
    let root = workspace();
    let mut files = Vec::new();
    for top in ["crates", "examples"] {
        sources(&root.join(top), &mut files);
    }
    assert!(files.len() > 100, "found only {} source files", files.len());
    let mut long = Vec::new();
    let mut twins = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let lines = text.lines().count();
        if lines > MAX_LINES {
            long.push(format!("{} ({lines} lines)", f.display()));
        }
        for line in text.lines() {
            let l = line.trim_start();
            let is_fn = l.contains("fn try_") && l.contains("_cached");
            if is_fn && !l.starts_with("//") {
                twins.push(format!("{}: {}", f.display(), l));
            }
        }
    }
    assert!(long.is_empty(), "files over {MAX_LINES} lines: {long:#?}");
    assert!(twins.is_empty(), "try_*_cached twins: {twins:#?}");
}

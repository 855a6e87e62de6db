//! The shape issue 30 asked the code to keep, checked on every run rather than by hand: no
//! non-test source file over 700 lines, no `try_*_cached` twin of an async metadata
//! operation (each operation has one body; `Meta`'s fields are private to `engine/meta/`,
//! which the compiler enforces), and no module cycle: in every crate, the modules of each
//! directory depend on each other one way only.

use std::collections::{BTreeMap, BTreeSet};
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

/// A module's path inside its crate (`["engine", "rw", "read"]`).
type ModPath = Vec<String>;

/// What the module scan reads of one crate: each module's code (comments and its trailing
/// `#[cfg(test)] mod` left out) by module path.
fn crate_modules(src: &Path) -> BTreeMap<ModPath, String> {
    let mut files = Vec::new();
    sources(src, &mut files);
    let mut out: BTreeMap<ModPath, String> = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(src).unwrap().with_extension("");
        let mut m: ModPath = rel
            .iter()
            .map(|c| c.to_string_lossy().into_owned())
            .collect();
        if matches!(m.last().map(String::as_str), Some("lib" | "main" | "mod")) {
            m.pop();
        }
        let text = std::fs::read_to_string(&f).unwrap();
        out.entry(m).or_default().push_str(&code_of(&text));
    }
    out
}

/// `text` without line comments (doc links are not dependencies) and without the unit tests
/// at its end.
fn code_of(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod ") {
        Some(k) => &text[..k],
        None => text,
    };
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        out.push_str(line.split("//").next().unwrap());
        out.push('\n');
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Whether a word starts at byte `i` of `s` (not in the middle of an identifier or a path,
/// and not `$crate`).
fn word_start(s: &str, i: usize) -> bool {
    s[..i]
        .chars()
        .next_back()
        .is_none_or(|c| !is_ident(c) && c != ':' && c != '$')
}

/// The paths a use tree names (`a::{b, c::{d as e}}` -> `a::b`, `a::c::d`), each with the
/// name it is imported as.
fn expand_use(tree: &str) -> Vec<(String, String)> {
    let mut norm = String::new();
    let words: Vec<&str> = tree.split_whitespace().collect();
    let mut k = 0;
    while k < words.len() {
        if words[k] == "as" && k + 1 < words.len() {
            norm.push('@');
            norm.push_str(words[k + 1]);
            k += 2;
        } else {
            norm.push_str(words[k]);
            k += 1;
        }
    }
    let mut out = Vec::new();
    fn leaf(prefix: &str, cur: &str, out: &mut Vec<(String, String)>) {
        if cur.is_empty() {
            return;
        }
        let (path, alias) = match cur.split_once('@') {
            Some((p, a)) => (format!("{prefix}{p}"), a.to_string()),
            None => {
                let p = format!("{prefix}{cur}");
                let last = p.rsplit("::").next().unwrap_or("").to_string();
                (p, last)
            }
        };
        out.push((path, alias));
    }
    fn parse(s: &[u8], mut i: usize, prefix: &str, out: &mut Vec<(String, String)>) -> usize {
        let mut cur = String::new();
        while i < s.len() {
            match s[i] {
                b'{' => {
                    i = parse(s, i + 1, &format!("{prefix}{cur}"), out);
                    cur.clear();
                }
                b'}' => {
                    leaf(prefix, &cur, out);
                    return i + 1;
                }
                b',' => {
                    leaf(prefix, &cur, out);
                    cur.clear();
                    i += 1;
                }
                c => {
                    cur.push(c as char);
                    i += 1;
                }
            }
        }
        leaf(prefix, &cur, out);
        i
    }
    parse(norm.as_bytes(), 0, "", &mut out);
    out
}

/// `path` (`crate::a::b`, `super::c`, `self::d`) as a path from the crate root, seen from
/// module `me`; `None` for another crate's or std's paths.
fn absolute(me: &[String], path: &str) -> Option<ModPath> {
    let parts: Vec<&str> = path.split("::").filter(|p| !p.is_empty()).collect();
    let first = *parts.first()?;
    let (mut base, mut i) = match first {
        "crate" => (Vec::new(), 1),
        "super" | "self" => (me.to_vec(), 0),
        _ => return None,
    };
    while i < parts.len() && (parts[i] == "super" || parts[i] == "self") {
        if parts[i] == "super" {
            base.pop();
        }
        i += 1;
    }
    base.extend(
        parts[i..]
            .iter()
            .filter(|p| **p != "*" && **p != "self")
            .map(|p| p.to_string()),
    );
    Some(base)
}

/// Each module's dependencies on the other modules of one crate, as sibling edges: a
/// reference from `a::x` to `b::y` is the edge `a -> b` among the children of their common
/// parent (a module's references to its own ancestors or descendants are not edges). Paths
/// through a `pub use` are followed to where the item is defined.
fn sibling_edges(modules: &BTreeMap<ModPath, String>) -> BTreeSet<(ModPath, ModPath)> {
    let mut uses: Vec<(ModPath, ModPath)> = Vec::new();
    let mut reexports: BTreeMap<ModPath, BTreeMap<String, ModPath>> = BTreeMap::new();
    for (me, code) in modules {
        let mut at = 0;
        while let Some(k) = code[at..].find("use ") {
            let i = at + k;
            at = i + 4;
            if !word_start(code, i) {
                continue;
            }
            let Some(end) = code[i..].find(';') else {
                break;
            };
            let before = code[..i].trim_end();
            let public = before.ends_with("pub")
                || before.ends_with(')') && {
                    let open = before.rfind('(').unwrap_or(0);
                    before[..open].trim_end().ends_with("pub")
                };
            for (path, alias) in expand_use(&code[i + 4..i + end]) {
                if let Some(t) = absolute(me, &path) {
                    if public && alias != "*" && alias != "self" {
                        reexports
                            .entry(me.clone())
                            .or_default()
                            .insert(alias, t.clone());
                    }
                    uses.push((me.clone(), t));
                }
            }
        }
        for root in ["crate::", "super::", "self::"] {
            let mut at = 0;
            while let Some(k) = code[at..].find(root) {
                let i = at + k;
                at = i + root.len();
                if !word_start(code, i) {
                    continue;
                }
                let end = code[i..]
                    .find(|c: char| !is_ident(c) && c != ':')
                    .map_or(code.len(), |e| i + e);
                if let Some(t) = absolute(me, code[i..end].trim_end_matches(':')) {
                    uses.push((me.clone(), t));
                }
            }
        }
    }
    let resolve = |mut t: ModPath| -> ModPath {
        for _ in 0..16 {
            let Some(n) = (0..=t.len()).rev().find(|&n| modules.contains_key(&t[..n])) else {
                return Vec::new();
            };
            match t.get(n).and_then(|name| reexports.get(&t[..n])?.get(name)) {
                Some(to) => t = to.iter().chain(&t[n + 1..]).cloned().collect(),
                None => {
                    t.truncate(n);
                    return t;
                }
            }
        }
        t
    };
    let mut edges = BTreeSet::new();
    for (me, t) in uses {
        let to = resolve(t);
        let j = me.iter().zip(&to).take_while(|(a, b)| a == b).count();
        if j < me.len() && j < to.len() {
            edges.insert((me[..=j].to_vec(), to[..=j].to_vec()));
        }
    }
    edges
}

/// The edges left once every module that nothing depends on, or that depends on nothing, is
/// taken away again and again: those among and between cycles (empty: no cycle).
fn cyclic(edges: &BTreeSet<(ModPath, ModPath)>) -> Vec<String> {
    let mut left: BTreeSet<(ModPath, ModPath)> = edges.clone();
    loop {
        let froms: BTreeSet<ModPath> = left.iter().map(|(a, _)| a.clone()).collect();
        let tos: BTreeSet<ModPath> = left.iter().map(|(_, b)| b.clone()).collect();
        let before = left.len();
        left.retain(|(a, b)| froms.contains(b) && tos.contains(a));
        if left.len() == before {
            break;
        }
    }
    left.iter()
        .map(|(a, b)| format!("{} -> {}", a.join("::"), b.join("::")))
        .collect()
}

#[test]
fn the_module_scan_finds_a_cycle_between_directories() {
    let mut m = BTreeMap::new();
    let p = |s: &str| s.split('/').map(str::to_string).collect::<ModPath>();
    m.insert(
        Vec::new(),
        "mod a; mod b; pub use a::inner::Thing;".to_string(),
    );
    m.insert(p("a"), "pub mod inner;".to_string());
    m.insert(
        p("a/inner"),
        "use crate::b::{x::{self, Y as Z}};".to_string(),
    );
    m.insert(p("b"), "pub mod x;".to_string());
    m.insert(
        p("b/x"),
        "fn f() -> crate::Thing { super::super::a::g() }".to_string(),
    );
    let edges = sibling_edges(&m);
    assert!(edges.contains(&(p("a"), p("b"))), "{edges:?}");
    assert!(edges.contains(&(p("b"), p("a"))), "{edges:?}");
    assert_eq!(cyclic(&edges), ["a -> b", "b -> a"]);
    m.insert(p("b/x"), "fn f() -> u32 { self::g() }".to_string());
    assert!(cyclic(&sibling_edges(&m)).is_empty());
}

#[test]
fn no_module_cycle_in_any_crate() {
    let root = workspace();
    let mut crates: Vec<PathBuf> = std::fs::read_dir(root.join("crates"))
        .unwrap()
        .flatten()
        .map(|e| e.path().join("src"))
        .collect();
    crates.push(root.join("examples/vmm-adapter/src"));
    let mut total = 0;
    let mut cycles = Vec::new();
    for src in crates.iter().filter(|s| s.is_dir()) {
        let edges = sibling_edges(&crate_modules(src));
        total += edges.len();
        let name = src
            .parent()
            .and_then(Path::file_name)
            .unwrap()
            .to_string_lossy();
        for e in cyclic(&edges) {
            cycles.push(format!("{name}: {e}"));
        }
    }
    // The scan sees the engine's layering (hundreds of edges), so an empty answer means
    // something.
    assert!(
        total > 150,
        "the scan found only {total} dependencies between modules"
    );
    assert!(
        cycles.is_empty(),
        "modules that depend on each other: {cycles:#?}"
    );
}

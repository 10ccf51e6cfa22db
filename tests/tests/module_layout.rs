//! The source files of every crate (and of the `kvgate` binary) depend on each other one way:
//! no file reaches — through a `crate::`, `super::`, `self::` or child-module path, in a `use`
//! or inline — a file that reaches it back. A circle means a boundary drawn in the wrong place
//! (STYLE.md). The gateway's request path adds an order: its stages (`gateway/src/request/`)
//! are declared in the order a request meets them, and a stage never reaches back to one the
//! request has already passed; the files between them that are not stages (the data a stage
//! hands on, the SSE reader) reach no stage at all. Unit tests (`tests.rs` files and
//! `#[cfg(test)] mod … { }` blocks) are left out: a test may reach anything.
//!
//! The checks are shown to fail on planted trees (a circle through `super::`, a stage that
//! calls back up the path) before they are trusted on the real one.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The request path's stages in the order a request meets them (`gateway/src/request/`).
const REQUEST_STAGES: &[&str] = &["prepare", "classify", "admit", "place", "forward", "relay"];
/// Files of `request/` that may reach any stage: the pipeline itself and the dry run.
const REQUEST_ENTRIES: &[&str] = &["mod", "explain"];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Code with comments, string and char literals blanked out (so paths in docs and messages
/// are not read as imports).
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c == b'r' && matches!(b.get(i + 1), Some(b'"') | Some(b'#')) && {
            let mut j = i + 1;
            while b.get(j) == Some(&b'#') {
                j += 1;
            }
            b.get(j) == Some(&b'"') && (i == 0 || !is_ident(b[i - 1]))
        } {
            let mut j = i + 1;
            let mut hashes = 0;
            while b[j] == b'#' {
                hashes += 1;
                j += 1;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == b'"' && (0..hashes).all(|k| b.get(j + 1 + k) == Some(&b'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            i = j;
            out.push_str("\"\"");
        } else if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == b'\'' {
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a).
            if b.get(i + 1) == Some(&b'\\') {
                i += 2;
                while i < b.len() && b[i] != b'\'' {
                    i += 1;
                }
                i += 1;
                out.push_str("' '");
            } else if b.get(i + 2) == Some(&b'\'') {
                i += 3;
                out.push_str("' '");
            } else {
                let ch = text[i..].chars().nth(1);
                match ch {
                    Some(ch)
                        if !ch.is_ascii() && text[i + 1 + ch.len_utf8()..].starts_with('\'') =>
                    {
                        i += 2 + ch.len_utf8();
                        out.push_str("' '");
                    }
                    _ => {
                        out.push('\'');
                        i += 1;
                    }
                }
            }
        } else {
            let ch = text[i..].chars().next().unwrap();
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// `code` without its `#[cfg(test)] mod name { … }` blocks.
fn without_test_modules(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at + "#[cfg(test)]".len()..];
        let trimmed = after.trim_start();
        let item = trimmed
            .strip_prefix("pub(crate) ")
            .or_else(|| trimmed.strip_prefix("pub "))
            .unwrap_or(trimmed);
        match (item.strip_prefix("mod "), item.find('{'), item.find(';')) {
            (Some(_), Some(open), semi) if semi.is_none_or(|s| s > open) => {
                let start = after.len() - item.len() + open;
                let mut depth = 0;
                let mut end = after.len();
                for (k, ch) in after[start..].char_indices() {
                    match ch {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = start + k + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                rest = &after[end..];
            }
            _ => rest = after,
        }
    }
    out.push_str(rest);
    out
}

/// A source folder: its files by module path (`[]` is lib.rs or main.rs).
struct Tree {
    src: PathBuf,
    modules: BTreeMap<Vec<String>, PathBuf>,
}

impl Tree {
    fn read(src: &Path) -> Tree {
        let mut files = Vec::new();
        rust_files(src, &mut files);
        let mut modules = BTreeMap::new();
        for f in files {
            let rel = f.strip_prefix(src).unwrap();
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            let last = parts.pop().unwrap();
            match last.as_str() {
                "mod.rs" => {}
                "lib.rs" | "main.rs" if parts.is_empty() => {}
                name => parts.push(name.trim_end_matches(".rs").to_string()),
            }
            // Sibling unit-test files are tests, not part of the graph.
            if parts.last().is_some_and(|p| p == "tests") && !parts.is_empty() && parts.len() > 1 {
                continue;
            }
            modules.insert(parts, f);
        }
        Tree {
            src: src.to_path_buf(),
            modules,
        }
    }

    fn rel(&self, f: &Path) -> String {
        f.strip_prefix(&self.src).unwrap().display().to_string()
    }

    fn is_module(&self, path: &[String]) -> bool {
        self.modules.contains_key(path)
    }

    /// File → the files it reaches. A path through a re-export (`pub use`) reaches the file
    /// the item comes from; the re-export itself is a facade, not a dependency.
    fn graph(&self) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
        let mut code = BTreeMap::new();
        let mut exports: BTreeMap<Vec<String>, Exports> = BTreeMap::new();
        for (module, file) in &self.modules {
            let text = without_test_modules(&code_only(&std::fs::read_to_string(file).unwrap()));
            let (reexports, rest) = split_reexports(&text);
            let mut e = Exports::default();
            for (name, path) in reexports {
                if let Some(abs) = self.absolute(module, &path) {
                    match name {
                        Some(n) => {
                            e.named.insert(n, abs);
                        }
                        None => e.globs.push(abs),
                    }
                }
            }
            e.defined = defined_items(&rest);
            exports.insert(module.clone(), e);
            code.insert(module.clone(), rest);
        }
        let mut g = BTreeMap::new();
        for (module, file) in &self.modules {
            let mut deps = BTreeSet::new();
            for path in paths(&code[module]) {
                let Some(abs) = self.absolute(module, &path) else {
                    continue;
                };
                if let Some(target) = self.resolve_through(&abs, &exports, 0) {
                    if target != file {
                        deps.insert(target.clone());
                    }
                }
            }
            g.insert(file.clone(), deps);
        }
        g
    }

    /// The file `path` (from the crate root) lands in, following re-exports.
    fn resolve_through(
        &self,
        path: &[String],
        exports: &BTreeMap<Vec<String>, Exports>,
        depth: usize,
    ) -> Option<&PathBuf> {
        let n = (0..=path.len())
            .rev()
            .find(|&n| self.modules.contains_key(&path[..n]))?;
        let file = &self.modules[&path[..n]];
        let (Some(item), Some(e)) = (path.get(n), exports.get(&path[..n])) else {
            return Some(file);
        };
        if depth > 8 || e.defined.contains(item) {
            return Some(file);
        }
        let via = match e.named.get(item) {
            Some(target) => Some(target.clone()),
            None => e.globs.first().map(|g| {
                let mut t = g.clone();
                t.push(item.clone());
                t
            }),
        };
        match via {
            Some(mut target) => {
                target.extend(path[n + 1..].iter().cloned());
                self.resolve_through(&target, exports, depth + 1)
            }
            None => Some(file),
        }
    }

    /// `path` as written in `module`, from the crate root; `None` for other crates' paths.
    fn absolute(&self, module: &[String], path: &[String]) -> Option<Vec<String>> {
        let first = path.first()?;
        let mut base: Vec<String> = match first.as_str() {
            "crate" => return Some(path[1..].to_vec()),
            "self" => module.to_vec(),
            "super" => {
                let mut m = module.to_vec();
                let mut rest = path;
                while rest.first().is_some_and(|s| s == "super") {
                    m.pop()?;
                    rest = &rest[1..];
                }
                m.extend(rest.iter().cloned());
                return Some(m);
            }
            _ => {
                // A child module of this one, named without a prefix.
                let mut child = module.to_vec();
                child.push(first.clone());
                if !self.is_module(&child) {
                    return None;
                }
                let mut m = module.to_vec();
                m.extend(path.iter().cloned());
                return Some(m);
            }
        };
        base.extend(path[1..].iter().cloned());
        Some(base)
    }
}

/// What a file re-exports (`pub use`): by name, and whole modules (`pub use x::*`); and the
/// names it defines itself (which a glob re-export does not shadow).
#[derive(Default)]
struct Exports {
    named: BTreeMap<String, Vec<String>>,
    globs: Vec<Vec<String>>,
    defined: BTreeSet<String>,
}

/// A re-exported name (`None` for a glob) and the path it stands for.
type Reexport = (Option<String>, Vec<String>);

/// `code`'s re-exports (`pub use` / `pub(…) use`), and the code without them.
fn split_reexports(code: &str) -> (Vec<Reexport>, String) {
    let mut found = Vec::new();
    let mut rest = String::with_capacity(code.len());
    let mut at = 0;
    while let Some(i) = code[at..].find("pub").map(|i| at + i) {
        let boundary = i == 0 || !is_ident(code.as_bytes()[i - 1]);
        let after = &code[i + 3..];
        let vis_end = if after.starts_with('(') {
            after.find(')').map(|e| e + 1)
        } else {
            Some(0)
        };
        let stmt = vis_end.and_then(|v| after[v..].trim_start().strip_prefix("use "));
        match (boundary, stmt) {
            (true, Some(tree)) => {
                let end = tree.find(';').unwrap_or(tree.len());
                let mut leaves = Vec::new();
                expand_use_named(&tree[..end], &mut Vec::new(), &mut leaves);
                found.extend(leaves);
                rest.push_str(&code[at..i]);
                at = code.len() - tree.len() + end + 1;
                at = at.min(code.len());
            }
            _ => {
                rest.push_str(&code[at..i + 3]);
                at = i + 3;
            }
        }
    }
    rest.push_str(&code[at..]);
    (found, rest)
}

/// The leaves of a `use` tree with the name each brings in scope (`None` for a glob).
fn expand_use_named(tree: &str, prefix: &mut Vec<String>, out: &mut Vec<Reexport>) {
    let mut plain = Vec::new();
    expand_use(tree, prefix, &mut plain);
    // Re-read the leaves for their names: `a as b` exports b, `a::*` is a glob.
    let mut names = Vec::new();
    collect_names(tree, &mut names);
    for (path, name) in plain.into_iter().zip(names) {
        out.push((name, path));
    }
}

/// The name each leaf of a `use` tree brings in scope, in `expand_use`'s order.
fn collect_names(tree: &str, out: &mut Vec<Option<String>>) {
    let tree = tree.trim().trim_start_matches("::");
    if let Some(open) = tree.find('{') {
        let head_is_empty = tree[..open].split("::").all(|s| s.trim().is_empty());
        let close = tree.rfind('}').unwrap_or(tree.len());
        let inner = &tree[open + 1..close];
        let mut depth = 0;
        let mut from = 0;
        let mut parts = Vec::new();
        for (k, ch) in inner.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(&inner[from..k]);
                    from = k + 1;
                }
                _ => {}
            }
        }
        parts.push(&inner[from..]);
        for part in parts {
            let p = part.trim();
            if p == "self" {
                // `a::{self}` names the module `a`.
                let head = tree[..open].trim().trim_end_matches("::");
                let name = head.rsplit("::").next().unwrap_or("").trim();
                if !(head_is_empty || name.is_empty()) {
                    out.push(Some(name.to_string()));
                }
                continue;
            }
            collect_names(p, out);
        }
        return;
    }
    let mut it = tree.split(" as ");
    let leaf = it.next().unwrap_or("").trim();
    if leaf.is_empty() {
        return;
    }
    let alias = it.next().map(|a| a.trim().to_string());
    let last = leaf.rsplit("::").next().unwrap_or("").trim();
    match (alias, last) {
        (Some(a), _) => out.push(Some(a)),
        (None, "*") => out.push(None),
        (None, "self") => {
            let name = leaf
                .trim_end_matches("self")
                .trim_end_matches("::")
                .rsplit("::")
                .next()
                .unwrap_or("")
                .trim()
                .to_string();
            out.push(Some(name));
        }
        (None, l) => out.push(Some(l.to_string())),
    }
}

/// The item names `code` defines at any depth (functions, types, traits, consts, modules).
fn defined_items(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let words: Vec<&str> = code
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '!'))
        .filter(|w| !w.is_empty())
        .collect();
    for w in words.windows(2) {
        if matches!(
            w[0],
            "fn" | "struct"
                | "enum"
                | "trait"
                | "type"
                | "const"
                | "static"
                | "mod"
                | "union"
                | "macro_rules!"
        ) {
            out.insert(w[1].to_string());
        }
    }
    out
}

/// Every path in `code`: each leaf of each `use` tree, and each inline `a::b::c` path.
fn paths(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let b = code.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if !is_ident(b[i]) || (i > 0 && (is_ident(b[i - 1]) || b[i - 1] == b'$')) {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && is_ident(b[i]) {
            i += 1;
        }
        let word = &code[start..i];
        if word == "use" {
            let end = code[i..].find(';').map_or(b.len(), |e| i + e);
            expand_use(code[i..end].trim(), &mut Vec::new(), &mut out);
            i = end;
            continue;
        }
        // An inline path: the word followed by `::`, not itself after `::`.
        let before = code[..start].trim_end();
        if before.ends_with("::") || !code[i..].starts_with("::") {
            continue;
        }
        let mut path = vec![word.to_string()];
        let mut j = i;
        while code[j..].starts_with("::") {
            let s = j + 2;
            let mut e = s;
            while e < b.len() && is_ident(b[e]) {
                e += 1;
            }
            if e == s {
                break;
            }
            path.push(code[s..e].to_string());
            j = e;
        }
        i = j;
        out.push(path);
    }
    out
}

/// Appends the leaves of a `use` tree (`a::{b, c::{d, self}}`) under `prefix`.
fn expand_use(tree: &str, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    let tree = tree.trim().trim_start_matches("::");
    if let Some(open) = tree.find('{') {
        let head: Vec<String> = tree[..open]
            .split("::")
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        let close = tree.rfind('}').unwrap_or(tree.len());
        let inner = &tree[open + 1..close];
        let n = prefix.len();
        prefix.extend(head);
        let mut depth = 0;
        let mut from = 0;
        for (k, ch) in inner.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand_use(&inner[from..k], prefix, out);
                    from = k + 1;
                }
                _ => {}
            }
        }
        expand_use(&inner[from..], prefix, out);
        prefix.truncate(n);
        return;
    }
    let leaf = tree.split(" as ").next().unwrap_or("").trim();
    if leaf.is_empty() {
        return;
    }
    let mut path = prefix.clone();
    for seg in leaf.split("::").map(str::trim) {
        match seg {
            "self" | "*" | "" => {}
            s => path.push(s.to_string()),
        }
    }
    if !path.is_empty() {
        out.push(path);
    }
}

/// Every circle in `g`, each once (as its files, starting from the smallest).
fn circles(g: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<Vec<PathBuf>> {
    let mut found: BTreeSet<Vec<PathBuf>> = BTreeSet::new();
    for start in g.keys() {
        let mut stack = vec![(start.clone(), vec![start.clone()])];
        let mut seen = BTreeSet::new();
        while let Some((node, path)) = stack.pop() {
            for next in g.get(&node).into_iter().flatten() {
                if next == start {
                    let mut c = path.clone();
                    let min = c.iter().enumerate().min_by_key(|(_, p)| *p).unwrap().0;
                    c.rotate_left(min);
                    found.insert(c);
                } else if next > start && seen.insert(next.clone()) {
                    let mut p = path.clone();
                    p.push(next.clone());
                    stack.push((next.clone(), p));
                }
            }
        }
    }
    found.into_iter().collect()
}

/// Circles in the tree at `src`, written as `a.rs → b.rs → a.rs`.
fn circles_in(src: &Path) -> Vec<String> {
    let tree = Tree::read(src);
    circles(&tree.graph())
        .into_iter()
        .map(|c| {
            let mut names: Vec<String> = c.iter().map(|f| tree.rel(f)).collect();
            names.push(names[0].clone());
            names.join(" → ")
        })
        .collect()
}

/// References in `src/request/` that go back up the path: a stage reaching a stage declared
/// before it, or a file that is not a stage (nor an entry) reaching a stage.
fn calls_back_up(src: &Path, stages: &[&str], entries: &[&str]) -> Vec<String> {
    let tree = Tree::read(src);
    let dir = src.join("request");
    let name = |f: &Path| -> Option<String> {
        let rel = f.strip_prefix(&dir).ok()?;
        let s = rel.to_string_lossy();
        Some(s.trim_end_matches(".rs").to_string())
    };
    let mut bad = Vec::new();
    for (from, deps) in tree.graph() {
        let Some(from_name) = name(&from) else {
            continue;
        };
        if entries.contains(&from_name.as_str()) {
            continue;
        }
        let from_rank = stages.iter().position(|s| *s == from_name);
        for to in deps {
            let Some(to_name) = name(&to) else { continue };
            let Some(to_rank) = stages.iter().position(|s| *s == to_name) else {
                if entries.contains(&to_name.as_str()) {
                    bad.push(format!(
                        "request/{from_name} reaches the entry request/{to_name}"
                    ));
                }
                continue;
            };
            match from_rank {
                Some(f) if to_rank > f => {}
                Some(_) => bad.push(format!(
                    "stage {from_name} reaches back up to stage {to_name}"
                )),
                None => bad.push(format!(
                    "request/{from_name} is not a stage but reaches stage {to_name}"
                )),
            }
        }
    }
    bad
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn no_source_file_reaches_a_file_that_reaches_it_back() {
    let root = root();
    let mut found = Vec::new();
    for dir in [
        "gateway/src",
        "replica/src",
        "kernels/src",
        "protocol/src",
        "config/src",
        "policies/src",
        "loadtest/src",
        "src",
    ] {
        let src = root.join(dir);
        assert!(Tree::read(&src).modules.len() > 2, "{dir}: files were read");
        for c in circles_in(&src) {
            found.push(format!("{dir}: {c}"));
        }
    }
    assert!(found.is_empty(), "circles between files: {found:#?}");
}

#[test]
fn the_request_path_never_calls_back_up() {
    let src = root().join("gateway/src");
    for s in REQUEST_STAGES.iter().chain(REQUEST_ENTRIES) {
        assert!(
            src.join("request").join(format!("{s}.rs")).exists(),
            "request/{s}.rs is declared but missing"
        );
    }
    let bad = calls_back_up(&src, REQUEST_STAGES, REQUEST_ENTRIES);
    assert!(bad.is_empty(), "calls back up the request path: {bad:#?}");
}

#[test]
fn the_gateway_state_is_implemented_only_in_the_composition_root() {
    let src = root().join("gateway/src");
    let tree = Tree::read(&src);
    let mut outside = Vec::new();
    let mut long = Vec::new();
    for f in tree.modules.values() {
        let code = without_test_modules(&code_only(&std::fs::read_to_string(f).unwrap()));
        if code.contains("impl GatewayState") && !f.ends_with("state.rs") {
            outside.push(tree.rel(f));
        }
        let lines = code.lines().count();
        if lines > 500 {
            long.push(format!("{} ({lines} lines)", tree.rel(f)));
        }
    }
    assert!(
        outside.is_empty(),
        "impl GatewayState outside state.rs: {outside:?}"
    );
    assert!(
        long.is_empty(),
        "gateway files over 500 lines (tests aside): {long:?}"
    );
}

/// A scratch source tree, removed when dropped.
struct Planted(PathBuf);

impl Planted {
    fn new(name: &str, files: &[(&str, &str)]) -> Planted {
        let dir = std::env::temp_dir().join(format!("kvgate-layout-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (path, text) in files {
            let p = dir.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        Planted(dir)
    }
}

impl Drop for Planted {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn a_planted_circle_is_found_through_super_nested_folders_and_use_trees() {
    let t = Planted::new(
        "circle",
        &[
            ("lib.rs", "pub mod fleet;\npub mod prefix;\n"),
            ("fleet/mod.rs", "//! uses crate::prefix in a comment only\npub mod replica;\n"),
            (
                "fleet/replica.rs",
                "use crate::{prefix::{view::View, self}};\npub struct Replica;\n",
            ),
            ("prefix/mod.rs", "pub mod view;\n"),
            (
                "prefix/view.rs",
                "pub struct View;\nfn f() { let s = \"crate::fleet\"; super::super::fleet::replica::Replica; }\n",
            ),
        ],
    );
    let found = circles_in(&t.0);
    assert_eq!(
        found,
        vec!["fleet/replica.rs → prefix/view.rs → fleet/replica.rs".to_string()],
        "the planted circle is found, and nothing in comments or strings counts"
    );
    // A path through the crate root's re-export reaches the file the item comes from.
    let t = Planted::new(
        "facade",
        &[
            (
                "lib.rs",
                "mod a;\nmod b;\npub use a::A;\npub use b::{B as Bee, self};\n",
            ),
            ("a.rs", "pub struct A;\nfn f() -> crate::Bee { todo!() }\n"),
            ("b.rs", "use crate::A;\npub struct B;\n"),
        ],
    );
    assert_eq!(circles_in(&t.0), vec!["a.rs → b.rs → a.rs".to_string()]);
    // Without the back edge there is none; a test block may reach anything.
    let t = Planted::new(
        "nocircle",
        &[
            ("lib.rs", "pub mod a;\npub mod b;\n"),
            ("a.rs", "use crate::b::B;\npub struct A;\n"),
            (
                "b.rs",
                "pub struct B;\n#[cfg(test)]\nmod tests {\n    use crate::a::A;\n}\n",
            ),
            ("c/mod.rs", "mod tests;\n"),
            ("c/tests.rs", "use crate::a::A;\n"),
        ],
    );
    assert!(circles_in(&t.0).is_empty());
}

#[test]
fn a_planted_call_back_up_the_request_path_is_found() {
    let t = Planted::new(
        "backup",
        &[
            ("lib.rs", "pub mod request;\n"),
            (
                "request/mod.rs",
                "mod prepare; mod place; mod forward; mod sse;\nuse forward::go;\n",
            ),
            ("request/prepare.rs", "pub struct Prepared;\n"),
            ("request/place.rs", "use super::prepare::Prepared;\n"),
            (
                "request/forward.rs",
                "pub fn go() { super::place::again(); crate::request::sse::read(); }\n",
            ),
            (
                "request/sse.rs",
                "pub fn read() { super::forward::go(); }\n",
            ),
        ],
    );
    let bad = calls_back_up(&t.0, &["prepare", "place", "forward"], &["mod"]);
    assert_eq!(
        bad,
        vec![
            "stage forward reaches back up to stage place".to_string(),
            "stage place reaches back up to stage prepare".to_string(),
            "request/sse is not a stage but reaches stage forward".to_string(),
        ]
    );
}

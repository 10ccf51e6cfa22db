//! The crates' modules depend on each other one way: no module of gateway, replica, kernels,
//! protocol, config, policies or loadtest reaches (through `crate::…` paths) a module that
//! reaches it back. A circle means a boundary drawn in the wrong place (STYLE.md).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

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

/// Top-level module → the top-level modules it names as `crate::name`.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(src).unwrap();
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let module = first.trim_end_matches(".rs").to_string();
        if module == "lib" || module == "main" {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap();
        let deps = g.entry(module.clone()).or_default();
        for (i, _) in text.match_indices("crate::") {
            let name: String = text[i + 7..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            if !name.is_empty() && name != module {
                deps.insert(name);
            }
        }
    }
    g
}

/// A cycle through `start`, if any (depth-first).
fn cycle_from(g: &BTreeMap<String, BTreeSet<String>>, start: &str) -> Option<Vec<String>> {
    fn walk(
        g: &BTreeMap<String, BTreeSet<String>>,
        node: &str,
        path: &mut Vec<String>,
        seen: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        for next in g.get(node).into_iter().flatten() {
            if next == &path[0] {
                let mut c = path.clone();
                c.push(next.clone());
                return Some(c);
            }
            if seen.insert(next.clone()) {
                path.push(next.clone());
                if let Some(c) = walk(g, next, path, seen) {
                    return Some(c);
                }
                path.pop();
            }
        }
        None
    }
    walk(g, start, &mut vec![start.to_string()], &mut BTreeSet::new())
}

#[test]
fn no_module_imports_a_module_that_imports_it_back() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut found = Vec::new();
    for krate in [
        "gateway", "replica", "kernels", "protocol", "config", "policies", "loadtest",
    ] {
        let g = graph(&root.join(krate).join("src"));
        assert!(g.len() > 2, "{krate}: modules were read");
        for m in g.keys() {
            if let Some(c) = cycle_from(&g, m) {
                found.push(format!("{krate}: {}", c.join(" → ")));
                break;
            }
        }
    }
    assert!(found.is_empty(), "import circles: {found:#?}");
}

//! The layers point one way: no file of `src/` depends, through any chain of others, on
//! itself. This test reads `src/**/*.rs`, collects the paths each file names (`use crate::…`,
//! `crate::…`, `super::…`, `self::…`, braces expanded), resolves each to the file of the
//! deepest module it names, and fails naming every cycle of that graph.
//!
//! A child naming an item of its own ancestor module (`super::Partition` in `backend/host.rs`)
//! is not counted: the parent declares its children and is their namespace, and re-exports
//! from them. The exception are the [`FACADES`]: modules whose `mod.rs` is a facade over
//! components that never name it (the store's components are built in one order, and the
//! facade on top). Code under `#[cfg(test)]` is left out: unit tests may reach anywhere in
//! their module.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Files that their modules' children must not name (see the module doc).
const FACADES: &[&str] = &["store/mod.rs"];

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, found: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("read src/")
        .map(|e| e.expect("entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, found);
        } else if path.extension().is_some_and(|e| e == "rs") {
            found.push(path);
        }
    }
}

/// The module path of a file under `src/` (`store/put.rs` → `["store", "put"]`); `None` for
/// the binary's root, which is a crate of its own.
fn module_of(relative: &Path) -> Option<Vec<String>> {
    let mut parts: Vec<String> = relative
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop()?;
    match last.as_str() {
        "lib.rs" if parts.is_empty() => Some(parts),
        "main.rs" if parts.is_empty() => None,
        "mod.rs" => Some(parts),
        file => {
            parts.push(file.strip_suffix(".rs")?.to_owned());
            Some(parts)
        }
    }
}

/// `text` without comments, string and char literals (replaced by spaces), so that only code
/// is searched for paths.
fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
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
        } else if c == 'r'
            && (next == Some('"') || next == Some('#'))
            && !chars
                .get(i.wrapping_sub(1))
                .is_some_and(|p| p.is_alphanumeric() || *p == '_')
        {
            // A raw string: r"…", r#"…"#.
            let mut j = i + 1;
            let mut hashes = 0;
            while chars.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if chars.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= chars.len() {
                    break;
                }
                if chars[j] == '"' && (0..hashes).all(|h| chars.get(j + 1 + h) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            i = j;
            out.push(' ');
        } else if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push(' ');
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{..}'), or a lifetime ('a), which is kept.
            if next == Some('\\') {
                i += 2;
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
                out.push(' ');
            } else if chars.get(i + 2) == Some(&'\'') {
                i += 3;
                out.push(' ');
            } else {
                out.push(c);
                i += 1;
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// `code` without the items marked `#[cfg(test)]`.
fn without_tests(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let item = &rest[at..];
        // The item ends at its first `;` outside braces, or at the brace closing its body.
        let mut depth = 0usize;
        let mut end = item.len();
        for (index, c) in item.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = index + 1;
                        break;
                    }
                }
                ';' if depth == 0 => {
                    end = index + 1;
                    break;
                }
                _ => {}
            }
        }
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

/// Tokens of `code` that paths are made of: identifiers, `::`, braces and commas.
fn tokens(code: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    let chars: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            tokens.push(chars[start..i].iter().collect());
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            tokens.push("::".to_owned());
            i += 2;
        } else if c.is_whitespace() {
            i += 1;
        } else {
            tokens.push(c.to_string());
            i += 1;
        }
    }
    tokens
}

/// Parses a path starting at `tokens[*at]` (after a leading `crate`, `super` or `self`),
/// pushing every full path it names (a group `a::{b, c::d}` names two) onto `paths`.
fn parse_path(
    tokens: &[String],
    at: &mut usize,
    prefix: Vec<String>,
    paths: &mut Vec<Vec<String>>,
) {
    let mut path = prefix;
    loop {
        if tokens.get(*at).map(String::as_str) != Some("::") {
            paths.push(path);
            return;
        }
        *at += 1;
        match tokens.get(*at).map(String::as_str) {
            Some("{") => {
                *at += 1;
                loop {
                    match tokens.get(*at).map(String::as_str) {
                        Some("}") | None => {
                            *at += 1;
                            return;
                        }
                        Some(",") => *at += 1,
                        Some("self") => {
                            paths.push(path.clone());
                            *at += 1;
                        }
                        Some(word) if is_ident(word) => {
                            let mut inner = path.clone();
                            inner.push(word.to_owned());
                            *at += 1;
                            parse_path(tokens, at, inner, paths);
                        }
                        // `*`, `as` renames and the like: nothing more to resolve.
                        Some(_) => *at += 1,
                    }
                }
            }
            Some(word) if is_ident(word) => {
                path.push(word.to_owned());
                *at += 1;
            }
            _ => {
                paths.push(path);
                return;
            }
        }
    }
}

fn is_ident(word: &str) -> bool {
    word.chars().all(|c| c.is_alphanumeric() || c == '_')
        && !word.starts_with(|c: char| c.is_ascii_digit())
}

/// Absolute module paths of the items `code` (in module `module`, whose child modules are
/// `children`) names: paths from `crate`, `super` or `self`, and paths relative to the module
/// that start with a child's name (`use put::PendingPut;`).
fn named_paths(code: &str, module: &[String], children: &BTreeSet<String>) -> Vec<Vec<String>> {
    let tokens = tokens(code);
    let mut found = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let word = tokens[i].as_str();
        let starts = (matches!(word, "crate" | "super" | "self") || children.contains(word))
            && tokens.get(i + 1).map(String::as_str) == Some("::")
            // Not the tail of a longer path (`a::self`), nor a field or method.
            && (i == 0 || !matches!(tokens[i - 1].as_str(), "::" | "."));
        if !starts {
            i += 1;
            continue;
        }
        let mut base: Vec<String> = match word {
            "crate" => Vec::new(),
            "self" => module.to_vec(),
            "super" => module[..module.len().saturating_sub(1)].to_vec(),
            child => [module, &[child.to_owned()]].concat(),
        };
        i += 1;
        // `super::super::…`
        while tokens.get(i).map(String::as_str) == Some("::")
            && tokens.get(i + 1).map(String::as_str) == Some("super")
        {
            base.pop();
            i += 2;
        }
        let mut paths = Vec::new();
        parse_path(&tokens, &mut i, base, &mut paths);
        found.extend(paths);
    }
    found
}

/// Strongly connected components of more than one file (Tarjan).
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct State<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        next: usize,
        found: Vec<Vec<String>>,
    }
    fn visit<'a>(state: &mut State<'a>, node: &'a str) {
        state.index.insert(node, state.next);
        state.low.insert(node, state.next);
        state.next += 1;
        state.stack.push(node);
        state.on_stack.insert(node);
        for next in state.graph.get(node).into_iter().flatten() {
            let next = next.as_str();
            if !state.index.contains_key(next) {
                visit(state, next);
                let low = state.low[node].min(state.low[next]);
                state.low.insert(node, low);
            } else if state.on_stack.contains(next) {
                let low = state.low[node].min(state.index[next]);
                state.low.insert(node, low);
            }
        }
        if state.low[node] == state.index[node] {
            let mut component = Vec::new();
            while let Some(top) = state.stack.pop() {
                state.on_stack.remove(top);
                component.push(top.to_owned());
                if top == node {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                state.found.push(component);
            }
        }
    }
    let mut state = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        found: Vec::new(),
    };
    for node in graph.keys() {
        if !state.index.contains_key(node.as_str()) {
            visit(&mut state, node);
        }
    }
    state.found
}

/// One cycle through `component`, as the files it passes, for the message.
fn one_cycle(graph: &BTreeMap<String, BTreeSet<String>>, component: &[String]) -> Vec<String> {
    let within: BTreeSet<&str> = component.iter().map(String::as_str).collect();
    let start = component[0].as_str();
    // Breadth first from `start` back to it, within the component: the shortest cycle.
    let mut previous: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    while let Some(node) = queue.pop_front() {
        for next in graph.get(node).into_iter().flatten() {
            let next = next.as_str();
            if !within.contains(next) {
                continue;
            }
            if next == start {
                let mut path = vec![start.to_owned()];
                let mut at = node;
                while at != start {
                    path.push(at.to_owned());
                    at = previous[at];
                }
                path.push(start.to_owned());
                path.reverse();
                return path;
            }
            if !previous.contains_key(next) {
                previous.insert(next, node);
                queue.push_back(next);
            }
        }
    }
    component.to_vec()
}

/// The files of `src/` (as `store/put.rs`), each with the files it names.
fn file_graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    // Module path to file, for every file of the library.
    let mut modules: BTreeMap<Vec<String>, String> = BTreeMap::new();
    for file in &files {
        let relative = file.strip_prefix(&src).expect("under src/");
        if let Some(module) = module_of(relative) {
            modules.insert(module, relative.display().to_string());
        }
    }
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, file) in &modules {
        let text = std::fs::read_to_string(src.join(file)).expect("read a source file");
        let code = without_tests(&code_only(&text));
        let children: BTreeSet<String> = modules
            .keys()
            .filter(|m| m.len() == module.len() + 1 && m.starts_with(module))
            .filter_map(|m| m.last().cloned())
            .collect();
        let edges = graph.entry(file.clone()).or_default();
        for path in named_paths(&code, module, &children) {
            // The deepest module the path names.
            let (len, target) = (0..=path.len())
                .rev()
                .find_map(|len| modules.get(&path[..len]).map(|target| (len, target)))
                .expect("lib.rs is the module of every path");
            let ancestor = len < module.len() && module.starts_with(&path[..len]);
            if target != file && (!ancestor || FACADES.contains(&target.as_str())) {
                edges.insert(target.clone());
            }
        }
    }
    assert!(
        graph.get("store/put.rs").is_some_and(|e| !e.is_empty()),
        "the graph was read: store/put.rs names other files"
    );
    graph
}

/// Every import cycle among the files of `src/`, each as one cycle through it and the files
/// it joins.
fn import_cycles() -> Vec<(Vec<String>, Vec<String>)> {
    let graph = file_graph();
    cycles(&graph)
        .into_iter()
        .map(|component| (one_cycle(&graph, &component), component))
        .collect()
}

/// `cycles` as lines of a message, each also printed.
fn describe(cycles: &[(Vec<String>, Vec<String>)]) -> String {
    let lines: Vec<String> = cycles
        .iter()
        .map(|(cycle, files)| format!("{} (files {})", cycle.join(" → "), files.join(", ")))
        .collect();
    for line in &lines {
        eprintln!("import cycle: {line}");
    }
    lines.join("\n")
}

#[test]
fn no_file_of_src_depends_on_itself() {
    let cycles = import_cycles();
    let described = describe(&cycles);
    assert!(
        cycles.is_empty(),
        "files of src/ that depend on themselves through others:\n{described}"
    );
}

/// The layers, top first: a file may name files of its own layer and of layers below it,
/// never above. `launch` starts a server from its configuration; `server` is the connection
/// code and the layers every call passes; `flight` the protocol; `metrics` reads the store;
/// `error` maps every layer's error to a gRPC status; `auth` says who a caller is; `store`
/// holds the datasets; `backend` their memory; `arrays` and `task` serve everyone.
const LAYERS: &[&[&str]] = &[
    &["launch"],
    &["config"],
    &["server"],
    &["flight", "consumer"],
    &["metrics"],
    &["error"],
    &["auth"],
    &["store"],
    &["backend"],
    &["arrays", "task"],
];

/// The layer of a file: its place in [`LAYERS`], `None` for `lib.rs`.
fn layer_of(file: &str) -> Option<usize> {
    let top = file.split('/').next()?.trim_end_matches(".rs");
    LAYERS.iter().position(|layer| layer.contains(&top))
}

#[test]
fn every_file_names_only_its_own_layer_and_those_below() {
    let graph = file_graph();
    let mut upward = Vec::new();
    for (file, names) in &graph {
        let Some(from) = layer_of(file) else { continue };
        for named in names {
            match layer_of(named) {
                Some(to) if to < from => upward.push(format!("{file} → {named}")),
                Some(_) => {}
                None if named == "lib.rs" => {}
                None => panic!("{named} is in no layer: add its module to LAYERS"),
            }
        }
    }
    assert!(
        upward.is_empty(),
        "files that name a layer above their own:\n{}",
        upward.join("\n")
    );
}

/// Files of the backend that the layers above the store reach only through it: `ipc-import`'s
/// document checks run in the store (`store/import.rs`), so that they fail with the store's
/// error and the backend's plan of the columns is made once, where the put is.
const THROUGH_THE_STORE: &[&str] = &["backend/ingest.rs"];

#[test]
fn the_layers_above_the_store_reach_the_ingest_checks_only_through_it() {
    let graph = file_graph();
    let store = layer_of("store/mod.rs").expect("the store is a layer");
    let mut skipping = Vec::new();
    for (file, names) in &graph {
        if layer_of(file).is_none_or(|layer| layer >= store) {
            continue;
        }
        for named in names {
            if THROUGH_THE_STORE.contains(&named.as_str()) {
                skipping.push(format!("{file} → {named}"));
            }
        }
    }
    assert!(
        skipping.is_empty(),
        "files above the store that name what they must reach through it:\n{}",
        skipping.join("\n")
    );
}

//! Every repository path the documentation cites exists, and docs/README.md links every page.
//!
//! Scans README.md and docs/*.md for paths that start with one of the repository's top-level
//! folders (`src/`, `crates/`, `tests/`, ...) and end either in a file extension
//! (`crates/format/src/check.rs`) or in `/` (a folder: `src/capture/`), and checks each
//! against the checkout (from `CARGO_MANIFEST_DIR`). A file moved without its documentation
//! fails this test with the stale paths named.
//!
//! A path counts only where it starts a word: `/tmp/x.rs`, `../lib/` and `target/tmp/` are
//! not repository paths. Text after the path that cannot be part of one (`:174`, `,`, a
//! closing backquote) ends it; a trailing `.` ends a sentence, not the path.

use std::path::{Path, PathBuf};

/// The top-level folders a cited path may start with.
const ROOTS: &[&str] = &[
    "src", "crates", "tests", "scripts", "benches", "python", "fuzz", "include", "docs",
];

/// File endings that make a cited path a file path.
const EXTENSIONS: &[&str] = &[
    "rs", "py", "sh", "c", "h", "cu", "toml", "md", "json", "txt", "html", "pickle",
];

fn is_path_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '/' | '-')
}

/// The repository paths cited in `text`: (path, line number).
fn cited_paths(text: &str) -> Vec<(String, usize)> {
    let mut found = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let chars: Vec<(usize, char)> = line.char_indices().collect();
        let mut i = 0;
        while i < chars.len() {
            let (start, c) = chars[i];
            let starts_word = i == 0 || !is_path_char(chars[i - 1].1);
            if !is_path_char(c) || !starts_word {
                i += 1;
                continue;
            }
            let mut j = i;
            while j < chars.len() && is_path_char(chars[j].1) {
                j += 1;
            }
            let end = chars.get(j).map_or(line.len(), |&(e, _)| e);
            i = j;
            let token = line[start..end].trim_end_matches('.');
            let Some((root, rest)) = token.split_once('/') else {
                continue;
            };
            if !ROOTS.contains(&root) || rest.is_empty() || token.contains("//") {
                continue;
            }
            let is_folder = token.ends_with('/');
            let is_file = Path::new(rest)
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| EXTENSIONS.contains(&e));
            if is_folder || is_file {
                found.push((token.to_string(), n + 1));
            }
        }
    }
    found
}

fn documentation(root: &Path) -> Vec<PathBuf> {
    let mut files = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("read docs/")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

#[test]
fn every_path_cited_in_the_documentation_exists() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut stale = Vec::new();
    let mut checked = 0;
    for file in documentation(&root) {
        let text = std::fs::read_to_string(&file).expect("read documentation");
        let name = file
            .strip_prefix(&root)
            .unwrap_or(&file)
            .display()
            .to_string();
        for (path, line) in cited_paths(&text) {
            checked += 1;
            let target = root.join(&path);
            let exists = if path.ends_with('/') {
                target.is_dir()
            } else {
                target.is_file()
            };
            if !exists {
                stale.push(format!("{name}:{line}: {path}"));
            }
        }
    }
    assert!(
        checked > 100,
        "only {checked} cited paths found: is the scan broken?"
    );
    assert!(
        stale.is_empty(),
        "{} cited path(s) do not exist in the repository:\n  {}",
        stale.len(),
        stale.join("\n  ")
    );
}

#[test]
fn the_scan_finds_files_and_folders_and_skips_other_paths() {
    let text = "see `src/capture/cpython.rs` and src/writer/, scripts/gpu/workloads.py:174 \
                (in crates/format/src/pickle_read/). Not /tmp/memsnap/x.rs, ../lib/, \
                target/tmp/, https://example.com/src/a.rs or src/capture/cpython.\n\
                tests/fixtures/torch/*.pickle ends in docs/FORMAT.md.";
    let paths: Vec<String> = cited_paths(text).into_iter().map(|(p, _)| p).collect();
    assert_eq!(
        paths,
        [
            "src/capture/cpython.rs",
            "src/writer/",
            "scripts/gpu/workloads.py",
            "crates/format/src/pickle_read/",
            "tests/fixtures/torch/",
            "docs/FORMAT.md",
        ]
    );
}

#[test]
fn the_docs_index_links_every_page() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let index = std::fs::read_to_string(root.join("docs/README.md")).expect("docs/README.md");
    let missing: Vec<String> = documentation(&root)
        .iter()
        .filter(|p| p.parent() == Some(root.join("docs").as_path()))
        .filter_map(|p| p.file_name()?.to_str().map(str::to_string))
        .filter(|name| name != "README.md" && !index.contains(&format!("]({name})")))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/README.md does not link: {}",
        missing.join(", ")
    );
}

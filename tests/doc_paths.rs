//! Every repository path the documentation cites exists, every section that code or a page
//! cites is a heading of its page, and docs/README.md links every page.
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

/// Where code cites documentation: the folders scanned and the file endings read. README.md
/// and docs/*.md are read as well: a section cited by its page and quoted title, or by the
/// page's anchor, must be a heading of that page, so that code and pages cite only what a page
/// still has.
const CODE_ROOTS: &[&str] = &["src", "crates", "scripts", "tests", "benches"];
const CODE_EXTENSIONS: &[&str] = &["rs", "py", "sh", "c", "h", "cu", "html", "js", "toml"];

/// The text of a source file with comment markers (`//!`, `///`, `//`, `#`, `*`, `/*`) taken
/// off each line's start and the lines joined by spaces, so that a citation broken over two
/// comment lines reads as one.
fn comment_text(source: &str) -> String {
    let mut text = String::new();
    for line in source.lines() {
        let mut rest = line.trim_start();
        for marker in ["//!", "///", "//", "/*", "*", "#"] {
            if let Some(r) = rest.strip_prefix(marker) {
                rest = r.trim_start();
                break;
            }
        }
        text.push_str(rest);
        text.push(' ');
    }
    text
}

/// The sections of documentation cited in `text`: (page, section), where a section is a
/// quoted title (`docs/HOT-PATH.md, "Paths of frames"`, several in a row allowed) or an
/// anchor (`docs/FORMAT.md#integers`, given with its leading `#`).
fn cited_sections(text: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(at) = text[from..].find("docs/") {
        let start = from + at;
        from = start + "docs/".len();
        if start > 0 && text[..start].ends_with(|c: char| is_path_char(c)) {
            continue;
        }
        let name_len = text[from..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
            .unwrap_or(text.len() - from);
        let after_name = &text[from + name_len..];
        let Some(after) = after_name.strip_prefix(".md") else {
            continue;
        };
        let page = format!("docs/{}.md", &text[from..from + name_len]);
        if let Some(anchor) = after.strip_prefix('#') {
            let len = anchor
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
                .unwrap_or(anchor.len());
            found.push((page, format!("#{}", &anchor[..len])));
            continue;
        }
        let mut rest = after;
        while let Some(quoted) = rest
            .strip_prefix(',')
            .map(str::trim_start)
            .and_then(|r| r.strip_prefix('"'))
        {
            let Some(end) = quoted.find('"') else { break };
            found.push((page.clone(), quoted[..end].to_string()));
            rest = &quoted[end + 1..];
        }
    }
    found
}

/// A heading or cited title compared without case, backquotes or runs of spaces.
fn normalized_title(title: &str) -> String {
    title
        .replace('`', "")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .to_lowercase()
}

/// Whether a cited title names a heading: the whole heading, or its part before a colon or a
/// parenthesis (`"Floods"` for `### Floods: at most one request snapshot a second`).
fn names_heading(cited: &str, heading: &str) -> bool {
    let (cited, heading) = (normalized_title(cited), normalized_title(heading));
    heading == cited
        || heading
            .strip_prefix(&cited)
            .is_some_and(|rest| rest.starts_with(':') || rest.starts_with(" ("))
}

/// GitHub's anchor for a heading: lower case, punctuation other than `-` and `_` dropped,
/// spaces made hyphens.
fn anchor_of(title: &str) -> String {
    title
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The headings of a Markdown page, outside fenced code.
fn headings(page: &str) -> Vec<String> {
    let mut fenced = false;
    let mut found = Vec::new();
    for line in page.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            let title = line.trim_start_matches('#');
            if title.starts_with(' ') {
                found.push(title.trim().to_string());
            }
        }
    }
    found
}

fn code_files(dir: &Path, files: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if path
                .file_name()
                .is_some_and(|n| n != "target" && n != "fixtures")
            {
                code_files(&path, files);
            }
        } else if path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| CODE_EXTENSIONS.contains(&e))
        {
            files.push(path);
        }
    }
}

#[test]
fn every_section_of_the_documentation_cited_in_code_or_docs_exists() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in CODE_ROOTS {
        code_files(&root.join(dir), &mut files);
    }
    files.sort();
    files.extend(documentation(&root));
    let mut stale = Vec::new();
    let mut checked = 0;
    for file in files {
        let Ok(source) = std::fs::read_to_string(&file) else {
            continue;
        };
        let name = file
            .strip_prefix(&root)
            .unwrap_or(&file)
            .display()
            .to_string();
        for (page, section) in cited_sections(&comment_text(&source)) {
            checked += 1;
            let Ok(text) = std::fs::read_to_string(root.join(&page)) else {
                stale.push(format!("{name}: {page} (no such page)"));
                continue;
            };
            let titles = headings(&text);
            let exists = match section.strip_prefix('#') {
                Some(anchor) => titles.iter().any(|t| anchor_of(t) == anchor),
                None => titles.iter().any(|t| names_heading(&section, t)),
            };
            if !exists {
                stale.push(format!("{name}: {page}, {section:?}"));
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} cited sections found: is the scan broken?"
    );
    assert!(
        stale.is_empty(),
        "{} cited section(s) are not headings of their page:\n  {}",
        stale.len(),
        stale.join("\n  ")
    );
}

#[test]
fn the_section_scan_reads_titles_across_comment_lines_and_anchors() {
    let source = "//! as measured (docs/HOT-PATH.md, \"The\n\
                  //! recording floor\", \"One line an event\"); see\n\
                  /// docs/FORMAT.md#integers and docs/FORMAT.md, \"Producer's rules\", rule 2;\n\
                  # not a citation: mydocs/X.md, \"Y\" or docs/X.md alone\n";
    assert_eq!(
        cited_sections(&comment_text(source)),
        [
            (
                "docs/HOT-PATH.md".to_string(),
                "The recording floor".to_string()
            ),
            (
                "docs/HOT-PATH.md".to_string(),
                "One line an event".to_string()
            ),
            ("docs/FORMAT.md".to_string(), "#integers".to_string()),
            ("docs/FORMAT.md".to_string(), "Producer's rules".to_string()),
        ]
    );
    assert_eq!(
        anchor_of("`memsnap top` requests (no GPU)"),
        "memsnap-top-requests-no-gpu"
    );
    assert!(names_heading("Floods", "Floods: at most one a second"));
    assert!(names_heading("the `view`", "The view (CLI)"));
    assert!(!names_heading("Flood", "Floods: at most one a second"));
    assert!(!names_heading("The view", "The viewer"));
    assert_eq!(
        headings("# A\n```\n# not\n```\n## B `c`\n#nope\n"),
        ["A", "B `c`"]
    );
}

#[test]
fn every_setting_has_a_row_in_the_settings_page() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let config =
        std::fs::read_to_string(root.join("crates/format/src/config.rs")).expect("config.rs");
    let page = std::fs::read_to_string(root.join("docs/SETTINGS.md")).expect("docs/SETTINGS.md");
    let names: Vec<&str> = config
        .split('"')
        .skip(1)
        .step_by(2)
        .filter(|s| {
            s.strip_prefix("MEMSNAP_").is_some_and(|r| {
                !r.is_empty() && r.chars().all(|c| c.is_ascii_uppercase() || c == '_')
            })
        })
        .collect();
    assert!(
        names.len() >= 20,
        "only {} settings found in config.rs",
        names.len()
    );
    let missing: Vec<&str> = names
        .iter()
        .copied()
        .filter(|name| !page.contains(&format!("| `{name}` |")))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/SETTINGS.md has no row for: {}",
        missing.join(", ")
    );
}

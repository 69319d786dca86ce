//! The repository's proportions and its build's shape, kept: a README read to the end,
//! reference pages that hold current facts (history lives in git), no source file too long to
//! read as one room, no benchmark code in the library's folder (benchmarks live in
//! benches/), and one set of features for the dependencies the library and the CLI share.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn files_under(dir: &Path, ext: &str, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files_under(&path, ext, found);
        } else if path.extension().is_some_and(|e| e == ext) {
            found.push(path);
        }
    }
}

#[test]
fn the_readme_and_the_reference_pages_keep_their_length() {
    let lines = |page: &str| read(&root().join(page)).lines().count();
    for (page, most) in [
        ("README.md", 350),
        ("docs/BENCHMARKS.md", 400),
        ("docs/HOT-PATH.md", 400),
    ] {
        assert!(
            lines(page) <= most,
            "{page}: {} lines, at most {most}",
            lines(page)
        );
    }
    let mut pages = Vec::new();
    files_under(&root().join("docs"), "md", &mut pages);
    let words: usize = pages
        .iter()
        .map(|p| read(p).split_whitespace().count())
        .sum();
    assert!(
        words <= 45_000,
        "docs/*.md: {words} words, at most 45,000: take out what a reference page need not hold"
    );
}

#[test]
fn no_source_file_is_over_1200_lines_and_no_benchmark_lives_in_src() {
    let mut sources = Vec::new();
    files_under(&root().join("src"), "rs", &mut sources);
    for krate in std::fs::read_dir(root().join("crates")).unwrap().flatten() {
        if krate.path().join("src").is_dir() {
            files_under(&krate.path().join("src"), "rs", &mut sources);
        }
    }
    assert!(sources.len() > 50, "found only {} sources", sources.len());
    let long: Vec<String> = sources
        .iter()
        .map(|p| (p, read(p).lines().count()))
        .filter(|(_, n)| *n > 1200)
        .map(|(p, n)| format!("{} ({n} lines)", p.display()))
        .collect();
    assert!(long.is_empty(), "over 1,200 lines: {long:?}");
    let benches: Vec<&PathBuf> = sources
        .iter()
        .filter(|p| p.file_name().unwrap().to_string_lossy().contains("bench"))
        .collect();
    assert!(
        benches.is_empty(),
        "benchmarks live in benches/: {benches:?}"
    );
}

/// `{package}|{features}` lines of the dependencies that `cargo tree` resolves for one
/// selection of packages (`-p memsnap`, `--workspace`, ...), the workspace's own left out.
fn resolved(selection: &[&str]) -> Option<Vec<String>> {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args([
            "tree",
            "--locked",
            "--offline",
            "-e",
            "normal,build",
            "--prefix",
            "none",
        ])
        .args(["-f", "{p}|{f}"])
        .args(selection)
        .current_dir(root())
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!(
            "cargo tree {selection:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    let mut lines: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim_end_matches(" (*)").to_string())
        .filter(|l| !l.starts_with("memsnap"))
        .collect();
    lines.sort();
    lines.dedup();
    Some(lines)
}

/// The wheel's build (setuptools-rust) compiles the library and the CLI one package at a
/// time, scripts/try-simulated.sh and the tests the whole workspace: a dependency whose
/// features differ between those selections is compiled once per selection. The
/// dependencies `crates/workspace-hack` names make them equal.
#[test]
fn the_library_and_the_cli_resolve_their_dependencies_as_the_workspace_does() {
    let Some(workspace) = resolved(&["--workspace"]) else {
        common::skip("cargo tree could not read the dependency graph offline");
        return;
    };
    for package in ["memsnap", "memsnap-cli"] {
        let alone = resolved(&["-p", package]).expect("cargo tree -p");
        let differ: Vec<&String> = alone.iter().filter(|l| !workspace.contains(l)).collect();
        assert!(
            differ.is_empty(),
            "under -p {package} these resolve other features than under --workspace \
             (give crates/workspace-hack/Cargo.toml the workspace's): {differ:?}"
        );
    }
}

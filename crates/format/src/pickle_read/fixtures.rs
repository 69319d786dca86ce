//! The PyTorch snapshots (tests/fixtures/torch) that the reader's unit tests read.

pub(super) const FIXTURES: &[&str] = &[
    "torch-python-stacks.pickle",
    "torch-expandable-segments.pickle",
    "torch-oom.pickle",
    "torch-leak-step3.pickle",
    "torch-leak-step11.pickle",
    "torch-transformer-all-stacks.pickle",
];

pub(super) fn fixture(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/../../tests/fixtures/torch/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// What Python's pickle.load found in a fixture: tests/fixtures/torch/fixtures.json,
/// written with the files by scripts/gpu/make_fixtures.py.
pub(super) fn counts(name: &str) -> serde_json::Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/torch/fixtures.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let c = v["files"][name].clone();
    assert!(c.is_object(), "fixtures.json: no entry for {name}");
    c
}

/// The line number of scripts/gpu/make_fixtures.py that ends in
/// `# FIXTURE-ANCHOR: {name}` (the fixtures' frames name the script by that path).
pub(super) fn anchor_line(name: &str) -> i64 {
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gpu/make_fixtures.py");
    let text = std::fs::read_to_string(&script).unwrap();
    let marker = format!("# FIXTURE-ANCHOR: {name}");
    let lines: Vec<usize> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| l.ends_with(&marker))
        .map(|(i, _)| i + 1)
        .collect();
    assert_eq!(lines.len(), 1, "`{marker}` on {} lines", lines.len());
    lines[0] as i64
}

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

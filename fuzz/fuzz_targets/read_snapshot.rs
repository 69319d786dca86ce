//! Fuzzes the pickle reader: any input must end in `Ok` or a typed error, never a panic,
//! a hang, or unbounded memory. Seed the corpus with tests/fixtures/torch/*.pickle.
#![no_main]

#[allow(dead_code)]
#[path = "../../src/snapshot/mod.rs"]
mod snapshot;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = snapshot::pickle_read::read_snapshot(data);
    let _ = snapshot::pickle_read::parse(data);
});

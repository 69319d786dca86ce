//! `include/memsnap.h` against the library: every `memsnap_*` function the header declares
//! is exported by `target/<profile>/libmemsnap.so`, and every `memsnap_*` symbol the library
//! exports is declared (the `memsnap_debug_*` entry points of a `bench-hooks` build are not
//! part of the C API and are left out of the comparison). Needs `nm` (binutils); without it
//! the test says it was ignored.

mod common;

use std::collections::BTreeSet;
use std::process::Command;

/// The names of the functions the header declares: `int name(` at the start of a line.
fn declared() -> BTreeSet<String> {
    let header = concat!(env!("CARGO_MANIFEST_DIR"), "/include/memsnap.h");
    let text = std::fs::read_to_string(header).expect("include/memsnap.h");
    text.lines()
        .filter(|l| !l.starts_with(' ') && !l.starts_with('/') && !l.starts_with('#'))
        .filter_map(|l| {
            let name = l.split('(').next()?.split_whitespace().last()?;
            let name = name.trim_start_matches('*');
            name.starts_with("memsnap_").then(|| name.to_string())
        })
        .collect()
}

#[test]
fn the_header_declares_exactly_the_exported_c_api() {
    let lib = common::preload_lib();
    let out = match Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&lib)
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            common::skip(&format!("nm could not run ({e})"));
            return;
        }
    };
    assert!(out.status.success(), "nm -D failed on {}", lib.display());
    let exported: BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .filter(|s| s.starts_with("memsnap_") && !s.starts_with("memsnap_debug_"))
        .map(str::to_string)
        .collect();
    let declared = declared();
    assert_eq!(
        declared.len(),
        4,
        "the header's functions as parsed: {declared:?}"
    );
    assert_eq!(
        declared,
        exported,
        "include/memsnap.h (left) and the memsnap_* exports of {} (right)",
        lib.display()
    );
}

//! What the Cargo benches share: the `--bench` check, their `BENCH_*` settings, the release
//! build of `libmemsnap.so` with the `bench-hooks` feature (its `memsnap_debug_*` entry
//! points), and opening one of them. Cold (bench tooling, not the library). The shell,
//! Python and GPU benchmarks' helpers are beside this file (benches/README.md).
#![allow(dead_code)] // each bench uses a subset

use std::path::PathBuf;
use std::process::Command;

/// `cargo test --all-targets` runs bench binaries without `--bench`: they measure nothing
/// then, and say how to run them.
pub fn benchmarking(name: &str) -> bool {
    let on = std::env::args().any(|a| a == "--bench");
    if !on {
        println!("{name} bench: run with `cargo bench --bench {name}`");
    }
    on
}

/// The bench's own setting `name` (`BENCH_*`), or `default` when it is unset or unreadable.
pub fn setting<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Builds the release library with `--features bench-hooks` and returns its path. It goes
/// to a target folder of its own (`target/with-bench-hooks`), so that
/// `target/release/libmemsnap.so` stays the library that ships, without those entry points.
pub fn release_library() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or(root.join("target"))
        .join("with-bench-hooks");
    let st = Command::new("cargo")
        .args([
            "build",
            "--release",
            "--lib",
            "--quiet",
            "--features",
            "bench-hooks",
        ])
        .arg("--target-dir")
        .arg(&target)
        .current_dir(&root)
        .status()
        .expect("cargo build");
    assert!(st.success());
    target.join("release/libmemsnap.so")
}

/// The address of `symbol` in the release library (built first).
pub fn entry_point(symbol: &std::ffi::CStr) -> *mut libc::c_void {
    symbol_in(&release_library(), symbol)
}

/// The address of `symbol` in the shared library `so`, opened with `dlopen`.
pub fn symbol_in(so: &std::path::Path, symbol: &std::ffi::CStr) -> *mut libc::c_void {
    let c = std::ffi::CString::new(so.to_str().expect("utf-8 path")).expect("path");
    // SAFETY: loading a library the bench built; a NUL-terminated name for dlsym.
    let b = unsafe {
        let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOW);
        assert!(!h.is_null(), "dlopen {}", so.display());
        libc::dlsym(h, symbol.as_ptr())
    };
    assert!(!b.is_null(), "{symbol:?} is not exported");
    b
}

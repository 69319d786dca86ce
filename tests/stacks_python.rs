//! Python frames captured without the GIL, checked under every installed CPython 3.10–3.14.
//!
//! Interpreters: pyenv's newest 3.10, 3.11, 3.12, 3.13 and 3.14, plus every path in
//! `MEMSNAP_TEST_PYTHONS` (separated by `:`; an interpreter pyenv does not manage, such as a
//! distribution's binary: docs/CPYTHON.md says how 3.14 was tested that way).
//!
//! Runs `tests/stacks/capture_check.py` (nested functions, exact file:line, placement among
//! native frames, deep recursion past the frame limit, non-ASCII names, threads) with the
//! `libmemsnap.so` loaded through ctypes, which calls `memsnap_debug_capture_json`: a build
//! with the `bench-hooks` feature, in a target folder of its own (`target/with-bench-hooks`)
//! so that `target/<profile>/libmemsnap.so` stays the library that ships.

mod common;

use std::path::PathBuf;
use std::process::Command;

fn libmemsnap() -> PathBuf {
    // target/<profile>/deps/stacks_python-<hash> -> target/with-bench-hooks/<profile>/
    let exe = std::env::current_exe().expect("current_exe");
    let release = exe.components().any(|c| c.as_os_str() == "release");
    let profile_dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let target = profile_dir
        .parent()
        .expect("target dir")
        .join("with-bench-hooks");
    // Built here, once per run: `cargo test --test` does not rebuild a cdylib, and this one
    // needs the feature.
    static BUILT: std::sync::Once = std::sync::Once::new();
    BUILT.call_once(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
        let st = Command::new(cargo)
            .args(["build", "--lib", "--quiet", "--features", "bench-hooks"])
            .args(release.then_some("--release"))
            .arg("--target-dir")
            .arg(&target)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("cargo build --lib --features bench-hooks");
        assert!(
            st.success(),
            "cargo build --lib --features bench-hooks failed"
        );
    });
    let profile = if release { "release" } else { "debug" };
    let so = target.join(profile).join("libmemsnap.so");
    assert!(so.is_file(), "{} not built", so.display());
    so
}

#[test]
fn python_frames_exact_under_each_cpython() {
    let so = libmemsnap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/stacks/capture_check.py");
    let pythons = common::interpreters();
    for (name, py) in &pythons {
        let out = Command::new(py)
            .arg(&script)
            .arg(&so)
            .output()
            .expect("run python");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "Python {name}: {stdout}\n{stderr}");
        assert!(stdout.starts_with("OK "), "Python {name}: {stdout}");
        eprintln!("Python {name}: {}", stdout.trim());
    }
}

/// The steady-state hot path (Python and native frames) calls no malloc-family function,
/// counted by an `LD_PRELOAD`ed counter in a real interpreter with the GIL released.
#[test]
fn capture_in_python_allocates_nothing_after_setup() {
    let so = libmemsnap();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().expect("tempdir");
    let counter = dir.path().join("libcountmalloc.so");
    let st = Command::new("cc")
        .args(["-O2", "-fPIC", "-shared", "-o"])
        .arg(&counter)
        .arg(root.join("tests/stacks/count_malloc.c"))
        .status()
        .expect("cc");
    assert!(st.success());
    let script = root.join("tests/stacks/no_alloc_check.py");
    for (name, py) in &common::interpreters() {
        let out = Command::new(py)
            .env("LD_PRELOAD", &counter)
            .arg(&script)
            .arg(&so)
            .output()
            .expect("run python");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "Python {name}: {stdout}\n{stderr}");
        assert!(stdout.trim_end().ends_with("OK"), "Python {name}: {stdout}");
    }
}

/// A CPython without a known layout (3.9 here, when installed): one warning, no Python
/// frames, native frames unaffected.
#[test]
fn unsupported_python_turns_python_frames_off_with_one_warning() {
    let root = common::pyenv_root();
    let Ok(entries) = std::fs::read_dir(root.join("versions")) else {
        common::skip("no pyenv with CPython 3.9");
        return;
    };
    let Some(py) = entries
        .flatten()
        .map(|e| e.path().join("bin/python3"))
        .find(|p| p.to_string_lossy().contains("/3.9.") && p.is_file())
    else {
        common::skip("no pyenv with CPython 3.9");
        return;
    };
    let so = libmemsnap();
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/stacks/unsupported_check.py");
    let out = Command::new(&py)
        .arg(&script)
        .arg(&so)
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.trim_end().ends_with("OK"), "{stdout}");
}

//! Every frame is kept, whatever happens to its code after the allocation: Python code freed
//! right after it allocated (generated code, its memory taken by the next compiles; module
//! code and a function of every length, freed as the module ends), a script
//! that exits 0, 1 or 5 ms after its last allocation (the exit snapshot, and a signal
//! snapshot taken just before the exit), the first allocation of the process, and a library
//! unloaded (`dlclose`) right after it allocated (docs/CPYTHON.md, "Code freed after an
//! event").
//!
//! `tests/programs/py_frames_kept.py` prints, before each allocation, Python's own view of
//! the stack at the call; the snapshot must hold that stack, frame by frame, for every
//! allocation of every run, with no frame unresolved. Each test runs its program many times
//! (a race shows in some runs only), under one CPython 3.10–3.14 (pyenv's, or
//! `MEMSNAP_TEST_PYTHONS`), and is skipped where that version is missing.

mod common;

use common::{Run, label_of, python_load_json, run_program_under, snapshot_files};
use serde_json::Value;
use std::path::{Path, PathBuf};

const PROGRAM: &str = "py_frames_kept.py";
/// Runs of each program and timing.
const RUNS: usize = 6;

/// One frame as the snapshot and Python's truth give it: (file, function, line).
type Frame = (String, String, i64);

/// Each allocation's size and Python's stack at the call, innermost first.
fn truth(run: &Run) -> Vec<(u64, Vec<Frame>)> {
    let all: Vec<(u64, Vec<Frame>)> = run
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("truth size="))
        .map(|rest| {
            let (size, stack) = rest.split_once(" stack=").expect("size and stack");
            let stack: Vec<(String, String, i64)> =
                serde_json::from_str(stack).expect("the stack as JSON");
            (size.parse().expect("a size"), stack)
        })
        .collect();
    assert!(!all.is_empty(), "no truth lines:\n{}", run.stdout);
    all
}

/// The snapshot labelled `label` the run wrote.
fn snapshot(run: &Run, label: &str) -> Value {
    let files: Vec<PathBuf> = snapshot_files(run.dir.path())
        .into_iter()
        .filter(|p| label_of(p).as_deref() == Some(label))
        .collect();
    assert_eq!(files.len(), 1, "{label}: {files:?}\n{}", run.stderr);
    python_load_json(&files[0])
}

fn frame(f: &Value) -> Frame {
    (
        f["filename"].as_str().expect("a file").to_string(),
        f["name"].as_str().expect("a name").to_string(),
        f["line"].as_i64().expect("a line"),
    )
}

/// The frames of the live block of `size` bytes, innermost first.
fn block_frames(snap: &Value, size: u64) -> Vec<Frame> {
    let blocks = snap["segments"]
        .as_array()
        .expect("segments")
        .iter()
        .flat_map(|s| s["blocks"].as_array().expect("blocks"))
        .filter(|b| b["size"].as_u64() == Some(size))
        .collect::<Vec<_>>();
    assert_eq!(blocks.len(), 1, "one live block of {size} bytes");
    blocks[0]["frames"]
        .as_array()
        .expect("frames")
        .iter()
        .map(frame)
        .collect()
}

/// The snapshot's memsnap counter `key`.
fn counter(snap: &Value, key: &str) -> i64 {
    snap["memsnap"][key]
        .as_i64()
        .unwrap_or_else(|| panic!("no {key} in {}", snap["memsnap"]))
}

/// No frame left unresolved and no event without its stack.
fn assert_all_resolved(snap: &Value, what: &str) {
    assert_eq!(counter(snap, "frames_unresolved"), 0, "{what}");
    assert_eq!(counter(snap, "events_without_stack"), 0, "{what}");
}

/// Runs the program under `python` with Python stacks only: a block's frames are then
/// exactly Python's stack at the call.
fn run_python_stacks(python: &Path, args: &[&str]) -> Run {
    let run = run_program_under(
        Some(python),
        PROGRAM,
        args,
        &[("MEMSNAP_STACKS", "python")],
        true,
    );
    run.assert_success();
    run
}

/// Every allocation the run made holds Python's stack at its call in the snapshot
/// `label`, frame by frame.
fn assert_stacks_kept(run: &Run, label: &str, what: &str) {
    let snap = snapshot(run, label);
    assert_all_resolved(&snap, what);
    for (size, expected) in truth(run) {
        assert_eq!(
            block_frames(&snap, size),
            expected,
            "{what}: the {size}-byte allocation in the {label} snapshot"
        );
    }
}

/// Generated code (a module compiled and run for one function, which allocates once and is
/// dropped), its code object freed right after the allocation and its memory taken by the
/// next compiles: every one of 41 keeps its frame `generated_<i>.py:3 (gen_alloc)`.
fn generated_code(python: &Path) {
    for round in 0..3 {
        let run = run_python_stacks(python, &["generated", "40"]);
        let truth = truth(&run);
        assert_eq!(truth.len(), 41, "the probe and 40 more");
        assert!(
            truth.iter().zip(-1..).all(|((_, stack), i)| stack[1]
                == (format!("generated_{i}.py"), "gen_alloc".to_string(), 3)),
            "the generated function allocates at line 3 of its file"
        );
        assert_stacks_kept(&run, "exit", &format!("round {round}"));
    }
}

/// The first allocation of the process, made by generated code dropped at once, just
/// before the program exits (with one more after it).
fn first_allocation(python: &Path) {
    for round in 0..RUNS * 2 {
        let run = run_python_stacks(python, &["generated", "1"]);
        assert_stacks_kept(&run, "exit", &format!("round {round}"));
    }
}

/// A script that exits 0, 1 and 5 ms after its last allocation: the script's code and its
/// functions' are freed as it ends, before the exit snapshot is written.
fn exit_soon_after(python: &Path) {
    for ms in ["0", "1", "5"] {
        for round in 0..RUNS {
            let run = run_python_stacks(python, &["exit", ms]);
            assert_eq!(truth(&run).len(), 3);
            assert_stacks_kept(&run, "exit", &format!("exit {ms} ms after, round {round}"));
        }
    }
}

/// The same, with the dump signal sent just before the exit: the signal snapshot holds
/// every frame too.
fn signal_before_exit(python: &Path) {
    for ms in ["0", "1", "5"] {
        for round in 0..RUNS {
            let run = run_python_stacks(python, &["signal", ms]);
            let what = format!("signal {ms} ms after, round {round}");
            assert_stacks_kept(&run, "signal", &what);
            assert_stacks_kept(&run, "exit", &what);
        }
    }
}

/// Module code of 10 to 1000 statements that allocates from its last line, freed as the
/// module ends: code objects of CPython's small-object allocator and, from 40 statements on
/// 3.11+, over its 512 bytes (malloc's, whose free overwrites the type pointer), lines past
/// 255, over 256 names and constants (EXTENDED_ARG) and line tables' long entries. Its frame
/// is `long_<S>.py:<S + 2>`.
fn long_module(python: &Path) {
    for statements in [10, 40, 200, 1000] {
        for round in 0..RUNS {
            let run = run_python_stacks(python, &["long", &statements.to_string()]);
            let truth = truth(&run);
            assert_eq!(truth.len(), 1);
            let file = format!("long_{statements}.py");
            assert_eq!(
                truth[0].1[1],
                (file, "<module>".to_string(), statements + 2),
                "the module allocates from its last line"
            );
            let what = format!("{statements} statements, round {round}");
            assert_stacks_kept(&run, "exit", &what);
        }
    }
}

/// A function of 300 statements, a line of 150 names and 300 blank lines before the call
/// that allocates (over two lines, past column 127: the line table's long entries with
/// varints of two bytes), called from module code; both freed as the module ends.
fn long_function(python: &Path) {
    for round in 0..RUNS {
        let run = run_python_stacks(python, &["long", "10", "function"]);
        let truth = truth(&run);
        assert_eq!(truth.len(), 1);
        let at = |name: &str, line| ("long_10.py".to_string(), name.to_string(), line);
        assert_eq!(
            truth[0].1[1..3],
            [at("long_body", 603), at("<module>", 616)],
            "the function allocates from line 603, called from the module's last line"
        );
        assert_stacks_kept(&run, "exit", &format!("round {round}"));
    }
}

/// `tests/programs/kept_lib.c`'s line that allocates.
fn kept_lib_line() -> i64 {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/kept_lib.c");
    let text = std::fs::read_to_string(&src).expect("kept_lib.c");
    let at = text
        .lines()
        .position(|l| l.contains("/* ALLOC_LINE */"))
        .expect("the marked line");
    at as i64 + 1
}

/// kept_lib.c built as a library in `dir`, as `name`.
fn build_kept_lib(dir: &Path, name: &str) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/kept_lib.c");
    let lib = dir.join(name);
    common::build_cuda_library(&src, &lib, &["-g", "-O1"]);
    lib
}

/// A library that allocated and was unloaded right away (then the process exits), with
/// native and Python stacks: its frame is named as when it stays loaded, and so is every
/// other frame; with its file deleted too, it is named by its library and offset.
fn library_unloaded(python: &Path) {
    let dir = tempfile::tempdir().expect("tempdir");
    let line = kept_lib_line();
    let run_how = |how: &str, round: usize| {
        let lib = build_kept_lib(dir.path(), &format!("libkept_{how}_{round}.so"));
        let run = run_program_under(
            Some(python),
            PROGRAM,
            &["unload", lib.to_str().expect("a UTF-8 path"), how],
            &[("MEMSNAP_STACKS", "all")],
            true,
        );
        run.assert_success();
        let snap = snapshot(&run, "exit");
        assert_all_resolved(&snap, how);
        let (size, python_frames) = truth(&run).remove(0);
        (lib, block_frames(&snap, size), python_frames)
    };
    // The library kept loaded: the stack every other run must have.
    let (_, kept, python_frames) = run_how("keep", 0);
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/kept_lib.c");
    let own = (
        src.to_str().expect("a UTF-8 path").to_string(),
        "kept_alloc".to_string(),
        line,
    );
    assert_eq!(kept[0], own, "the library's frame comes first: {kept:?}");
    let in_python: Vec<Frame> = kept
        .iter()
        .filter(|f| f.0.ends_with(".py"))
        .cloned()
        .collect();
    assert_eq!(
        in_python, python_frames,
        "the Python frames among the native ones"
    );
    assert!(kept.iter().all(|f| f.1 != "??"), "{kept:?}");
    for round in 0..RUNS {
        let (_, closed, _) = run_how("close", round);
        assert_eq!(closed, kept, "unloaded, round {round}");
        let (lib, deleted, _) = run_how("delete", round);
        // Its file gone too: named by what was known while it was loaded, its path and the
        // offset, unless the writer read its names before the file went.
        let name = lib.file_name().and_then(|n| n.to_str()).expect("a name");
        let first = &deleted[0];
        assert!(
            *first == own
                || (first.0 == lib.to_str().expect("a UTF-8 path")
                    && first.1.strip_prefix(name).is_some_and(|rest| rest
                        .strip_prefix("+0x")
                        .is_some_and(|hex| u64::from_str_radix(hex, 16).is_ok()))
                    && first.2 == 0),
            "unloaded and deleted, round {round}: {first:?}"
        );
        assert_eq!(
            deleted[1..],
            kept[1..],
            "unloaded and deleted, round {round}"
        );
    }
}

/// One test per scenario and CPython version, skipped where that version is missing.
macro_rules! under_each_python {
    ($($scenario:ident),* $(,)?) => {
        $(
            mod $scenario {
                fn under(minor: &str) {
                    match crate::common::python(minor) {
                        Some(python) => super::$scenario(&python),
                        None => crate::common::skip(&format!(
                            "no CPython {minor} (pyenv, MEMSNAP_TEST_PYTHONS or python{minor} on PATH)"
                        )),
                    }
                }
                #[test]
                fn python_3_10() {
                    under("3.10");
                }
                #[test]
                fn python_3_11() {
                    under("3.11");
                }
                #[test]
                fn python_3_12() {
                    under("3.12");
                }
                #[test]
                fn python_3_13() {
                    under("3.13");
                }
                #[test]
                fn python_3_14() {
                    under("3.14");
                }
            }
        )*
    };
}

under_each_python!(
    generated_code,
    first_allocation,
    exit_soon_after,
    signal_before_exit,
    library_unloaded,
    long_module,
    long_function,
);

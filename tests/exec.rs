//! The record before an `exec` (`lifecycle::exec`), on the fake CUDA driver: a program that
//! records and then replaces its image gets an `exec` snapshot holding everything it
//! recorded; an exec that fails returns its error to a program that is still recorded; a
//! forked or vforked child execs at once, with no snapshot and no wait.

mod common;

use common::{
    Run, csv, label_of, num, python_load_json, python_script, run_program, snapshot_files,
};
use serde_json::Value;
use std::path::PathBuf;

/// The snapshots of `run` whose label is `label`.
fn files_labelled(run: &Run, label: &str) -> Vec<PathBuf> {
    snapshot_files(run.dir.path())
        .into_iter()
        .filter(|p| label_of(p).as_deref() == Some(label))
        .collect()
}

/// The one snapshot labelled `label`, loaded.
fn only(run: &Run, label: &str) -> (PathBuf, Value) {
    let files = files_labelled(run, label);
    assert_eq!(
        files.len(),
        1,
        "expected one {label} snapshot, found {:?}\nstderr: {}",
        snapshot_files(run.dir.path()),
        run.stderr
    );
    let snap = python_load_json(&files[0]);
    (files[0].clone(), snap)
}

/// (bytes, count) of the active blocks on device 0.
fn live(snap: &Value) -> (u64, u64) {
    let mut out = (0, 0);
    for seg in snap["segments"].as_array().unwrap() {
        if seg["device"] != 0 {
            continue;
        }
        for b in seg["blocks"].as_array().unwrap() {
            if b["state"] == "active_allocated" {
                out.0 += b["size"].as_u64().unwrap();
                out.1 += 1;
            }
        }
    }
    out
}

const MIB: u64 = 1 << 20;

/// The variadic members, hooked on x86-64 only (`exports.rs`).
const VARIADIC: &[&str] = if cfg!(target_arch = "x86_64") {
    &["execl", "execlp", "execle"]
} else {
    &[]
};

#[test]
fn the_exec_snapshot_holds_everything_recorded_before_the_image_is_replaced() {
    let functions = [
        "execv", "execve", "execvp", "execvpe", "fexecve", "execveat",
    ]
    .into_iter()
    .chain(VARIADIC.iter().copied());
    let plain = run_program("exec", &["execv"], &[], false).results();
    for (i, function) in functions.enumerate() {
        let run = run_program("exec", &[function], &[], true);
        run.assert_success();
        let r = run.results();
        if r.contains_key("unsupported") {
            // execveat before glibc 2.34: memsnap's hook fails as glibc's absence would.
            assert_eq!(function, "execveat");
            continue;
        }
        if function.starts_with("execl") {
            // Every argument arrived, those passed on the stack included, and execle's
            // environment.
            assert_eq!(r["after_argc"], "8", "{function}");
            assert_eq!(r["after_last"], "a7", "{function}");
            let mark = if function == "execle" { "le" } else { "none" };
            assert_eq!(r["after_mark"], mark, "{function}");
        }
        // None of memsnap's descriptors (folders, socket, wake-ups) outlives the image: the
        // new image holds what it holds without memsnap (what the test runner passed on).
        assert_eq!(r["after_open_fds"], plain["after_open_fds"], "{function}");
        // The new image ran, in the same process.
        assert_eq!(
            r["after_pid"], r["before_pid"],
            "{function}\n{}",
            run.stdout
        );
        let (path, snap) = only(&run, "exec");
        if i == 0 {
            python_script("tests/python/check_snapshot.py", &path);
        }
        assert_eq!(live(&snap), (2 * MIB, 2), "{function}");
        assert_eq!(
            snap["memsnap"]["pid"].as_u64().unwrap().to_string(),
            r["before_pid"],
            "{function}"
        );
        // The exit line, which the replaced image never prints, came before the exec.
        let exec_name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            run.stderr.contains("memsnap: wrote 1 snapshot") && run.stderr.contains(&exec_name),
            "{function}: {}",
            run.stderr
        );
        // The image that replaced it never allocated: nothing else was written.
        assert_eq!(snapshot_files(run.dir.path()), vec![path], "{function}");
    }
}

#[test]
fn pythons_os_exec_functions_keep_the_record() {
    for function in ["execv", "execve", "execvp", "execvpe"] {
        let run = run_program("py_exec.py", &[function], &[], true);
        run.assert_success();
        let r = run.results();
        assert_eq!(
            r["after_pid"], r["before_pid"],
            "{function}\n{}",
            run.stderr
        );
        assert_eq!(live(&only(&run, "exec").1), (3 * MIB, 2), "{function}");
    }
}

#[test]
fn an_image_that_records_after_the_exec_keeps_its_own_record() {
    // A job wrapper that re-execs itself: both images record, in the same process.
    let run = run_program("exec", &["reexec"], &[], true);
    run.assert_success();
    let r = run.results();
    assert_eq!(r["after_pid"], r["before_pid"]);
    assert_eq!(live(&only(&run, "exec").1), (2 * MIB, 2));
    // The new image's exit snapshot holds its own allocation only (the fake driver starts
    // afresh with the image too).
    let (_, exit) = only(&run, "exit");
    assert_eq!(num(&run.truth_device(0), "live_bytes"), MIB);
    assert_eq!(live(&exit), (MIB, 1));
    assert_eq!(snapshot_files(run.dir.path()).len(), 2);
}

#[test]
fn an_exec_that_fails_returns_its_error_and_recording_goes_on() {
    let execle = VARIADIC.iter().filter(|f| **f == "execle");
    for function in ["execv"].iter().chain(execle) {
        let run = run_program("exec", &["missing", function], &[], true);
        run.assert_success();
        let r = run.results();
        assert_eq!(r["exec_rc"], "-1", "{function}");
        assert_eq!(
            r["exec_enoent"], "1",
            "{function}: errno is what the real call set"
        );
        // Written before the call failed: what was recorded then.
        let (_, before) = only(&run, "exec");
        assert_eq!(live(&before), (MIB, 1), "{function}");
        // The program went on and was still recorded: its exit snapshot has everything.
        let (_, exit) = only(&run, "exit");
        let truth = run.truth_device(0);
        assert_eq!(num(&truth, "live_bytes"), 3 * MIB, "{function}");
        assert_eq!(live(&exit), (3 * MIB, 2), "{function}");
    }
}

#[test]
fn an_exec_snapshot_is_an_exit_snapshot_for_memsnap_at_exit_and_memsnap_stats() {
    let stats_dir = tempfile::tempdir().unwrap();
    let stats = stats_dir.path().join("mem.csv");
    let env = [
        ("MEMSNAP_AT_EXIT", "0"),
        ("MEMSNAP_STATS", stats.to_str().unwrap()),
    ];
    let run = run_program("exec", &["execv"], &env, true);
    run.assert_success();
    let r = run.results();
    assert_eq!(r["after_pid"], r["before_pid"]);
    assert!(snapshot_files(run.dir.path()).is_empty());
    // The stats row an exit would have written, with what was live before the exec.
    let rows = csv(&stats);
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["reason"], "exec");
    assert_eq!(num(&rows[0], "allocated_bytes"), 2 * MIB);
}

#[test]
fn a_signal_the_program_ignores_is_inherited_ignored_by_the_new_image() {
    // Without memsnap, SIGUSR1 ignored before an exec stays ignored in the new image; the
    // dump signal's handler in the kernel would have become the default (death) there.
    let plain = run_program("exec", &["ignored"], &[], false);
    plain.assert_success();
    assert_eq!(plain.results()["after_usr1_ignored"], "1");
    let run = run_program("exec", &["ignored"], &[], true);
    run.assert_success();
    assert_eq!(run.results()["after_usr1_ignored"], "1");
    assert_eq!(live(&only(&run, "exec").1), (MIB, 1));
    // An exec that fails puts memsnap's handler back: the dump signal still works.
    let run = run_program("exec", &["ignored", "missing"], &[], true);
    run.assert_success();
    assert_eq!(run.results()["exec_rc"], "-1");
    assert_eq!(run.results()["signal_snapshot"], "1", "{}", run.stderr);
    assert_eq!(live(&only(&run, "signal").1), (MIB, 1));
}

#[test]
fn a_forked_or_vforked_child_that_never_recorded_execs_at_once() {
    for mode in ["fork", "vfork"] {
        let run = run_program("exec", &[mode], &[], true);
        run.assert_success();
        let r = run.results();
        assert_eq!(r["child_exit_ok"], "1", "{mode}\n{}", run.stdout);
        assert_ne!(r["after_pid"], r["before_pid"], "{mode}: the child execed");
        // No wait for a writer (the parent's exit wait is 60 s; a child that waited for one
        // would take that long).
        let child_ms: f64 = r["child_ms"].parse().unwrap();
        assert!(child_ms < 5_000.0, "{mode}: the child took {child_ms} ms");
        // Only the parent's exit snapshot: the child asked for none.
        assert!(files_labelled(&run, "exec").is_empty(), "{mode}");
        let (_, exit) = only(&run, "exit");
        assert_eq!(live(&exit), (MIB, 1), "{mode}");
    }
}

//! Steps, windows, periods, explicit dumps, per-step stats, the Python module, and the
//! `memsnap run` / `memsnap dump` commands, end to end on the fake CUDA driver (no GPU).
//! Needs `cargo build --workspace` first (the tests preload target/<profile>/libmemsnap.so).

mod common;

use common::{
    assert_callback_results, csv, env_lines, num, python_load_json, run_program, snapshot_files,
};
use serde_json::Value;
use std::collections::{BTreeSet, HashMap};
use std::io::{BufRead, BufReader};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

fn names(dir: &Path) -> Vec<String> {
    snapshot_files(dir)
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect()
}

/// Sizes of the `alloc` entries in device 0's history.
fn alloc_sizes(snap: &Value) -> BTreeSet<u64> {
    snap["device_traces"][0]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["action"] == "alloc")
        .map(|e| e["size"].as_u64().unwrap())
        .collect()
}

fn live_bytes(snap: &Value) -> u64 {
    snap["segments"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["blocks"].as_array().unwrap().iter())
        .filter(|b| b["state"] == "active_allocated")
        .map(|b| b["size"].as_u64().unwrap())
        .sum()
}

/// (keep, temp) sizes of step `k` as the steps program printed them.
fn step_sizes(r: &HashMap<String, String>, k: u32) -> (u64, u64) {
    (
        num(r, &format!("step{k}_keep")),
        num(r, &format!("step{k}_temp")),
    )
}

#[test]
fn window_writes_one_snapshot_holding_only_the_window() {
    let run = run_program(
        "steps",
        &["5"],
        &[
            ("MEMSNAP_SKIP", "1"),
            ("MEMSNAP_INTERVAL", "2"),
            ("MEMSNAP_FILENAME", "{reason}-at{step}-{seq}.pickle"),
        ],
        true,
    );
    run.assert_success();
    let r = run.results();
    let all = names(run.dir.path());
    let step_files: Vec<&String> = all.iter().filter(|n| n.starts_with("step-")).collect();
    // The window is steps 2 and 3 (after skipping 1): one snapshot when step 3 ends.
    assert_eq!(step_files, vec!["step-at3-1.pickle"], "{all:?}");
    assert!(all.contains(&"exit-at5-2.pickle".to_string()), "{all:?}");

    let snap = python_load_json(&run.dir.path().join("step-at3-1.pickle"));
    let (k1, t1) = step_sizes(&r, 1);
    let (k2, t2) = step_sizes(&r, 2);
    let (k3, t3) = step_sizes(&r, 3);
    assert_eq!(alloc_sizes(&snap), BTreeSet::from([k2, t2, k3, t3]));
    // Step 1's allocations happened before the window: absent from its history, though
    // the block itself (freed in step 3) is gone and step 2's and 3's are live.
    let trace = snap["device_traces"][0].as_array().unwrap();
    assert!(
        !trace
            .iter()
            .any(|e| e["action"] == "alloc" && [k1, t1].contains(&e["size"].as_u64().unwrap())),
        "events from before the window leaked in"
    );
    assert_eq!(live_bytes(&snap), num(&r, "step3_live_bytes"));
    // The exit snapshot keeps the full history.
    let exit = python_load_json(&run.dir.path().join("exit-at5-2.pickle"));
    assert!(alloc_sizes(&exit).contains(&k1));
}

#[test]
fn skip_zero_opens_the_window_at_the_start() {
    let run = run_program(
        "steps",
        &["3"],
        &[
            ("MEMSNAP_SKIP", "0"),
            ("MEMSNAP_INTERVAL", "2"),
            ("MEMSNAP_AT_EXIT", "0"),
            ("MEMSNAP_FILENAME", "{reason}-at{step}.pickle"),
        ],
        true,
    );
    run.assert_success();
    assert_eq!(names(run.dir.path()), vec!["step-at2.pickle"]);
    let snap = python_load_json(&run.dir.path().join("step-at2.pickle"));
    let r = run.results();
    let (k1, t1) = step_sizes(&r, 1);
    let (k2, t2) = step_sizes(&r, 2);
    assert_eq!(alloc_sizes(&snap), BTreeSet::from([k1, t1, k2, t2]));
}

#[test]
fn every_writes_exactly_the_expected_steps() {
    let run = run_program(
        "steps",
        &["7"],
        &[
            ("MEMSNAP_EVERY", "3"),
            ("MEMSNAP_AT_EXIT", "0"),
            ("MEMSNAP_FILENAME", "s{step}-{reason}.pickle"),
        ],
        true,
    );
    run.assert_success();
    assert_eq!(
        names(run.dir.path()),
        vec!["s3-step.pickle", "s6-step.pickle"]
    );
    let r = run.results();
    for k in [3, 6] {
        let snap = python_load_json(&run.dir.path().join(format!("s{k}-step.pickle")));
        assert_eq!(live_bytes(&snap), num(&r, &format!("step{k}_live_bytes")));
        assert_eq!(snap["memsnap"]["step"].as_u64(), Some(k as u64));
    }
}

#[test]
fn every_inside_a_window_keeps_the_full_history_and_is_not_written_twice() {
    let run = run_program(
        "steps",
        &["5"],
        &[
            ("MEMSNAP_SKIP", "1"),
            ("MEMSNAP_INTERVAL", "3"),
            ("MEMSNAP_EVERY", "2"),
            ("MEMSNAP_AT_EXIT", "0"),
            ("MEMSNAP_FILENAME", "at{step}-{seq}.pickle"),
        ],
        true,
    );
    run.assert_success();
    // EVERY at 2 and 4; the window (steps 2..4) closes at 4: one file there, not two.
    assert_eq!(names(run.dir.path()), vec!["at2-1.pickle", "at4-2.pickle"]);
    let r = run.results();
    let (k1, _) = step_sizes(&r, 1);
    let every = python_load_json(&run.dir.path().join("at2-1.pickle"));
    assert!(
        alloc_sizes(&every).contains(&k1),
        "an EVERY snapshot inside the window lost the history before it"
    );
    let window = python_load_json(&run.dir.path().join("at4-2.pickle"));
    assert!(!alloc_sizes(&window).contains(&k1));
    assert!(alloc_sizes(&window).contains(&step_sizes(&r, 2).0));
}

#[test]
fn step_boundaries_are_in_the_history_and_the_device_memory_in_the_metadata() {
    let run = run_program(
        "steps",
        &["5"],
        &[
            ("MEMSNAP_FILENAME", "s{step}-{reason}.pickle"),
            ("FAKE_CUDA_CAPACITY", "8G"),
        ],
        true,
    );
    run.assert_success();
    let snap = python_load_json(&run.dir.path().join("s5-exit.pickle"));
    let marks = snap["external_annotations"].as_array().expect("a list");
    let steps: Vec<u64> = marks.iter().map(|m| m["step"].as_u64().unwrap()).collect();
    assert_eq!(
        steps,
        vec![1, 2, 3, 4, 5],
        "one boundary per step: {marks:?}"
    );
    let trace = snap["device_traces"][0].as_array().unwrap();
    let mut previous = 0;
    for (k, m) in marks.iter().enumerate() {
        assert_eq!(m["name"], "memsnap.step");
        assert_eq!(m["stage"], "START");
        assert_eq!(m["device"], 0);
        let t = m["time_us"].as_u64().unwrap();
        assert!(t >= previous, "in order");
        previous = t;
        // Step k+1 (1-based) allocates keep = (k+1) MiB + 4 KiB: after the boundary of k
        // completed steps, never before it.
        let keep = (k as u64 + 1) * (1 << 20) + 4096;
        let at = trace
            .iter()
            .position(|e| e["action"] == "alloc" && e["size"] == keep)
            .unwrap();
        if k > 0 {
            assert!(
                trace[at]["time_us"].as_u64().unwrap() <= t,
                "step {k}'s alloc before its end"
            );
        }
    }
    let devices = snap["memsnap"]["devices"].as_array().unwrap();
    assert_eq!(devices[0]["total_bytes"], 8u64 << 30);
    // The driver's free memory when the file was written: the capacity less what the
    // program holds at exit (the fake driver's own count after the last step).
    let held = num(&run.results(), "step5_driver_live_bytes");
    assert_eq!(devices[0]["free_bytes"].as_u64(), Some((8u64 << 30) - held));
}

#[test]
fn explicit_dumps_make_a_tagged_before_after_pair() {
    let run = run_program(
        "steps",
        &["4", "dumps"],
        &[
            ("MEMSNAP_AT_EXIT", "0"),
            ("MEMSNAP_FILENAME", "leak-{tag}-{reason}-{step}.pickle"),
        ],
        true,
    );
    run.assert_success();
    let r = run.results();
    assert_eq!(r["before_rc"], "0");
    assert_eq!(r["after_rc"], "0");
    assert_eq!(
        names(run.dir.path()),
        vec!["leak-after-api-4.pickle", "leak-before-api-1.pickle"]
    );
    let before = python_load_json(&run.dir.path().join("leak-before-api-1.pickle"));
    let after = python_load_json(&run.dir.path().join("leak-after-api-4.pickle"));
    assert_eq!(live_bytes(&before), num(&r, "step1_live_bytes"));
    assert_eq!(live_bytes(&after), num(&r, "step4_live_bytes"));
    assert_eq!(before["memsnap"]["tag"], "before");
    assert_eq!(after["memsnap"]["reason"], "api");

    // Without the preload the program finds no memsnap_dump and writes nothing.
    let plain = run_program("steps", &["2", "dumps"], &[], false);
    plain.assert_success();
    assert_eq!(plain.results()["before_rc"], "-2");
    assert!(names(plain.dir.path()).is_empty());
}

#[test]
fn stats_rows_match_the_drivers_truth_at_every_step() {
    let stats_dir = tempfile::tempdir().unwrap();
    let stats = stats_dir.path().join("mem-r{rank}.csv");
    let run = run_program(
        "steps",
        &["6"],
        &[
            ("MEMSNAP_STATS", stats.to_str().unwrap()),
            ("MEMSNAP_AT_EXIT", "0"),
            ("RANK", "3"),
        ],
        true,
    );
    run.assert_success();
    let r = run.results();
    let rows = csv(&stats_dir.path().join("mem-r3.csv"));
    // One row per step on device 0 (the only device used), then one at exit.
    let steps: Vec<u64> = rows.iter().map(|row| num(row, "step")).collect();
    assert_eq!(steps, vec![1, 2, 3, 4, 5, 6, 6], "{rows:?}");
    let reasons: Vec<&str> = rows.iter().map(|row| row["reason"].as_str()).collect();
    assert_eq!(
        reasons,
        ["step", "step", "step", "step", "step", "step", "exit"]
    );
    for row in &rows[..6] {
        let k = num(row, "step");
        assert_eq!(row["device"], "0");
        assert_eq!(row["rank"], "3");
        let live = num(&r, &format!("step{k}_live_bytes"));
        assert_eq!(live, num(&r, &format!("step{k}_driver_live_bytes")));
        assert_eq!(num(row, "allocated_bytes"), live, "step {k}");
        assert_eq!(num(row, "reserved_bytes"), live, "step {k}");
        // The peak is the step's own (reset every step), not the run's.
        assert_eq!(
            num(row, "peak_bytes"),
            num(&r, &format!("step{k}_peak_bytes")),
            "step {k}"
        );
        assert_eq!(num(row, "total_bytes"), 80 << 30);
        assert_eq!(row["ooms"], "0");
    }
    let last = &rows[6];
    assert_eq!(num(last, "allocated_bytes"), num(&r, "expected_live_bytes"));
    assert_eq!(
        num(last, "allocated_bytes"),
        num(&run.truth_device(0), "live_bytes")
    );
}

/// Spawns a fake-CUDA program with `LD_PRELOAD` (when `preload`) and piped stdin/stdout;
/// returns once it printed `result ready=1`.
fn spawn_waiting(args: &[&str], env: &[(&str, &str)], folder: &Path, preload: bool) -> Child {
    spawn_waiting_via(None, args, env, folder, preload)
}

/// [`spawn_waiting`], started through `launcher --fork` when given (`setsid`: in a session
/// of its own, and a child of init rather than of this process).
fn spawn_waiting_via(
    launcher: Option<&str>,
    args: &[&str],
    env: &[(&str, &str)],
    folder: &Path,
    preload: bool,
) -> Child {
    let mut cmd = match launcher {
        Some(l) => {
            let mut c = Command::new(l);
            // `setsid --fork`: the program is not this process's child.
            c.arg("--fork").arg(common::program_path("wait"));
            c
        }
        None => Command::new(common::program_path("wait")),
    };
    cmd.args(args);
    clean_env(&mut cmd);
    cmd.env("LD_LIBRARY_PATH", common::fake_lib_dir())
        .env("MEMSNAP_FOLDER", folder);
    if preload {
        cmd.env("LD_PRELOAD", common::preload_lib());
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the wait program");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "result ready=1");
    // Keep draining so the program never blocks on a full pipe.
    std::thread::spawn(move || for _ in out.lines() {});
    child
}

/// Closes the program's stdin (it then exits) and returns its status.
fn finish(mut child: Child) -> std::process::ExitStatus {
    drop(child.stdin.take());
    child.wait().unwrap()
}

fn clean_env(cmd: &mut Command) {
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        if key.starts_with("MEMSNAP_") || key.starts_with("FAKE_CUDA") || key == "LD_PRELOAD" {
            cmd.env_remove(key.as_ref());
        }
    }
}

fn wait_for(mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(30) {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    done()
}

#[test]
fn period_snapshots_and_stats_rows_without_steps() {
    let dir = tempfile::tempdir().unwrap();
    let stats = dir.path().join("stats.csv");
    let child = spawn_waiting(
        &[],
        &[
            // The shortest period allowed.
            ("MEMSNAP_PERIOD", "1s"),
            ("MEMSNAP_STATS", stats.to_str().unwrap()),
            ("MEMSNAP_AT_EXIT", "0"),
        ],
        dir.path(),
        true,
    );
    let found = wait_for(|| {
        names(dir.path())
            .iter()
            .filter(|n| n.contains("-period-"))
            .count()
            >= 2
    });
    assert!(finish(child).success());
    assert!(found, "no two period snapshots: {:?}", names(dir.path()));
    let periods: Vec<String> = names(dir.path())
        .into_iter()
        .filter(|n| n.contains("-period-"))
        .collect();
    assert!(
        names(dir.path())
            .iter()
            .all(|n| n.contains("-period-") || n == "stats.csv")
    );
    let snap = python_load_json(&dir.path().join(&periods[0]));
    assert_eq!(live_bytes(&snap), 8 << 20);
    assert_eq!(snap["memsnap"]["reason"], "period");
    let rows = csv(&stats);
    assert!(rows.len() >= periods.len(), "{rows:?}");
    for row in &rows {
        assert_eq!(num(row, "step"), 0);
        assert_eq!(num(row, "allocated_bytes"), 8 << 20);
        assert!(
            row["reason"] == "period" || row["reason"] == "exit",
            "{row:?}"
        );
    }
}

/// The folder holding the `memsnap` Python package.
fn python_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("python")
}

#[test]
fn python_module_is_silent_without_the_preload() {
    let run = run_program(
        "py_steps.py",
        &[],
        &[("PYTHONPATH", python_dir().to_str().unwrap())],
        false,
    );
    run.assert_success();
    let r = run.results();
    assert_eq!(
        Path::new(&r["module"]),
        python_dir()
            .join("memsnap/__init__.py")
            .canonicalize()
            .unwrap()
    );
    assert_eq!(r["frameworks"], "");
    assert_eq!(r["active_before"], "False");
    assert_eq!(r["step_returns"], "False,False,False");
    assert_eq!(r["active"], "False");
    assert_eq!(r["loaded"], "False");
    assert_eq!(r["dump_return"], "None");
    assert!(!r.contains_key("cut_length"));
    assert_eq!(r["thread_steps"], "0");
    assert!(names(run.dir.path()).is_empty());
    assert!(run.stderr.is_empty(), "{}", run.stderr);
}

#[test]
fn python_module_steps_and_dumps_with_the_preload() {
    let stats_dir = tempfile::tempdir().unwrap();
    let stats = stats_dir.path().join("stats.csv");
    let run = run_program(
        "py_steps.py",
        &[],
        &[
            ("PYTHONPATH", python_dir().to_str().unwrap()),
            ("MEMSNAP_STATS", stats.to_str().unwrap()),
            ("MEMSNAP_AT_EXIT", "0"),
            ("MEMSNAP_FILENAME", "{tag}-{seq}.pickle"),
        ],
        true,
    );
    run.assert_success();
    let r = run.results();
    assert_eq!(r["frameworks"], "");
    // Nothing records before the first CUDA allocation.
    assert_eq!(r["active_before"], "False");
    assert_eq!(r["step_returns"], "True,True,True");
    assert_eq!(r["active"], "True");
    assert_eq!(r["loaded"], "True");
    assert_eq!(names(run.dir.path()), ["cut-2.pickle", "mid-1.pickle"]);
    // dump() returns the absolute path of the file it wrote.
    let mid = run.dir.path().join("mid-1.pickle");
    assert_eq!(Path::new(&r["dump_return"]), mid);
    let snap = python_load_json(&mid);
    assert_eq!(live_bytes(&snap), 3 << 20);
    assert_eq!(snap["memsnap"]["tag"], "mid");
    // memsnap_dump_path with 8 bytes: 7 bytes of the path and a NUL, nothing past the
    // buffer, and the full length returned.
    let cut = run.dir.path().join("cut-2.pickle");
    let cut = cut.to_str().unwrap();
    assert_eq!(num(&r, "cut_length"), cut.len() as u64);
    let expected: String = cut.as_bytes()[..7]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(r["cut_bytes"], format!("{expected}00ff"));
    // 3 steps, then 4 threads x 8 steps, all counted once, in order.
    assert_eq!(r["thread_steps"], "32");
    let steps: Vec<u64> = csv(&stats).iter().map(|row| num(row, "step")).collect();
    let expected: Vec<u64> = (1..=35).chain([35]).collect();
    assert_eq!(steps, expected);
}

#[test]
fn framework_callbacks_mark_one_step_per_batch() {
    let stats_dir = tempfile::tempdir().unwrap();
    let stats = stats_dir.path().join("stats.csv");
    // The program's own temporary folder, to see that it leaves nothing there.
    let tmp = tempfile::tempdir().unwrap();
    let run = run_program(
        "py_callbacks.py",
        &[],
        &[
            ("PYTHONPATH", python_dir().to_str().unwrap()),
            ("MEMSNAP_STATS", stats.to_str().unwrap()),
            ("TMPDIR", tmp.path().to_str().unwrap()),
        ],
        true,
    );
    run.assert_success();
    assert_callback_results(&run.results());
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().flatten().collect();
    assert!(left.is_empty(), "left in TMPDIR: {left:?}");
    let steps: Vec<u64> = csv(&stats).iter().map(|row| num(row, "step")).collect();
    assert_eq!(steps, [1, 2, 3, 4, 5, 6, 6]);
}

#[test]
fn python_package_version_is_the_crates() {
    let init = std::fs::read_to_string(python_dir().join("memsnap/__init__.py")).unwrap();
    let line = format!("__version__ = \"{}\"", env!("CARGO_PKG_VERSION"));
    assert!(
        init.lines().any(|l| l == line),
        "no `{line}` in memsnap/__init__.py"
    );
}

// ------------------------------------------------------------------------------------
// memsnap run

fn memsnap(args: &[&str], env: &[(&str, &str)], cwd: &Path) -> Output {
    memsnap_at(&common::memsnap_bin(), args, env, cwd)
}

fn memsnap_at(exe: &Path, args: &[&str], env: &[(&str, &str)], cwd: &Path) -> Output {
    let mut cmd = Command::new(exe);
    cmd.args(args).current_dir(cwd);
    clean_env(&mut cmd);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.stdin(Stdio::null()).output().expect("run memsnap")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn run_passes_the_exit_code_through() {
    let dir = tempfile::tempdir().unwrap();
    for code in [0, 3, 255] {
        let o = memsnap(
            &["run", "--", "sh", "-c", &format!("exit {code}")],
            &[],
            dir.path(),
        );
        assert_eq!(o.status.code(), Some(code), "{}", stderr(&o));
    }
}

#[test]
fn run_reports_a_deadly_signal_like_a_shell() {
    let dir = tempfile::tempdir().unwrap();
    let o = memsnap(&["run", "--", "sh", "-c", "kill -TERM $$"], &[], dir.path());
    assert_eq!(o.status.code(), Some(143));
    assert!(
        stderr(&o).contains("killed by signal 15 (SIGTERM)"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn run_sets_the_preload_the_variables_and_the_python_path() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let o = memsnap(
        &[
            "run",
            "--folder",
            "snaps",
            "--skip",
            "2",
            "--interval",
            "3",
            "--every",
            "10",
            "--period",
            "30s",
            "--stacks",
            "python",
            "--signal",
            "USR2",
            "--no-at-exit",
            "--quiet",
            "--overwrite",
            "--max-entries",
            "500",
            "--context",
            "all",
            "--stats",
            "s.csv",
            "--filename",
            "r{rank}.{step}.pickle",
            "--",
            "env",
        ],
        &[
            ("LD_PRELOAD", "/other/libfoo.so"),
            ("PYTHONPATH", "/mine"),
            ("XDG_CACHE_HOME", cache.path().to_str().unwrap()),
        ],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let env = env_lines(&o.stdout);
    let lib = common::preload_lib().canonicalize().unwrap();
    assert_eq!(
        env["LD_PRELOAD"],
        format!("{}:/other/libfoo.so", lib.display())
    );
    let (entry, rest) = env["PYTHONPATH"].split_once(':').unwrap();
    assert_eq!(rest, "/mine");
    assert!(entry.starts_with(cache.path().to_str().unwrap()), "{entry}");
    assert_package_entry(entry, &python_dir().canonicalize().unwrap().join("memsnap"));
    for (k, v) in [
        ("MEMSNAP_FOLDER", "snaps"),
        ("MEMSNAP_SKIP", "2"),
        ("MEMSNAP_INTERVAL", "3"),
        ("MEMSNAP_EVERY", "10"),
        ("MEMSNAP_PERIOD", "30s"),
        ("MEMSNAP_STACKS", "python"),
        ("MEMSNAP_SIGNAL", "USR2"),
        ("MEMSNAP_AT_EXIT", "0"),
        ("MEMSNAP_QUIET", "1"),
        ("MEMSNAP_OVERWRITE", "1"),
        ("MEMSNAP_MAX_ENTRIES", "500"),
        ("MEMSNAP_CONTEXT", "all"),
        ("MEMSNAP_STATS", "s.csv"),
        ("MEMSNAP_FILENAME", "r{rank}.{step}.pickle"),
    ] {
        assert_eq!(env.get(k).map(String::as_str), Some(v), "{k}");
    }
    // Without --tensors, no framework setting is touched.
    assert!(!env.contains_key("TF_GPU_ALLOCATOR"));
}

#[test]
fn python_m_memsnap_run_passes_its_library_without_a_visible_option() {
    // No command: the usage shows what was typed, no `--lib` the user never wrote.
    let o = Command::new("python3")
        .args(["-m", "memsnap", "run"])
        .env("PYTHONPATH", python_dir())
        .stdin(Stdio::null())
        .output()
        .expect("python3 -m memsnap");
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("Usage: memsnap run"), "{err}");
    assert!(!err.contains("--lib"), "{err}");

    // The library travels in MEMSNAP_RUN_LIB, which the command does not inherit.
    let dir = tempfile::tempdir().unwrap();
    let lib = dir.path().canonicalize().unwrap().join("libmemsnap.so");
    std::fs::copy(common::preload_lib(), &lib).unwrap();
    let o = memsnap(
        &["run", "--", "env"],
        &[("MEMSNAP_RUN_LIB", lib.to_str().unwrap())],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let env = env_lines(&o.stdout);
    assert_eq!(Path::new(&env["LD_PRELOAD"]), lib);
    assert!(!env.contains_key("MEMSNAP_RUN_LIB"), "{env:?}");
    // --lib, typed, wins over it.
    let o = memsnap(
        &[
            "run",
            "--lib",
            common::preload_lib().to_str().unwrap(),
            "--",
            "env",
        ],
        &[("MEMSNAP_RUN_LIB", "/nonexistent/libmemsnap.so")],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let o = memsnap(
        &["run", "--", "env"],
        &[("MEMSNAP_RUN_LIB", "/nonexistent/libmemsnap.so")],
        dir.path(),
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("MEMSNAP_RUN_LIB=/nonexistent/libmemsnap.so: no such file"),
        "{}",
        stderr(&o)
    );
}

/// `entry`, the `PYTHONPATH` entry `memsnap run` adds, holds one thing: `memsnap`, a link
/// to `package` (never the folder above it: for a pip installation, a whole site-packages).
fn assert_package_entry(entry: &str, package: &Path) {
    let names: Vec<_> = std::fs::read_dir(entry)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["memsnap"], "{entry}");
    assert_eq!(
        std::fs::read_link(Path::new(entry).join("memsnap")).unwrap(),
        package
    );
}

/// A copy of this build's `memsnap` binary at `prefix/bin/memsnap`, where pip puts it.
fn installed_copy(prefix: &Path) -> PathBuf {
    let bin = prefix.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let exe = bin.join("memsnap");
    std::fs::copy(common::memsnap_bin(), &exe).unwrap();
    exe
}

/// An executable shell script at `path`.
fn write_script(path: &Path, body: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn run_finds_the_library_pip_installed_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().canonicalize().unwrap();
    let exe = installed_copy(&prefix);
    let package = prefix.join("lib/python3.12/site-packages/memsnap");
    std::fs::create_dir_all(&package).unwrap();
    std::fs::copy(common::preload_lib(), package.join("libmemsnap.so")).unwrap();
    std::fs::write(package.join("__init__.py"), "").unwrap();
    std::fs::write(package.join("../numpy.py"), "").unwrap();
    let cache = tempfile::tempdir().unwrap();
    let o = memsnap_at(
        &exe,
        &["run", "--", "env"],
        &[
            ("PYTHONPATH", "/mine"),
            ("XDG_CACHE_HOME", cache.path().to_str().unwrap()),
        ],
        &prefix,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let env = env_lines(&o.stdout);
    assert_eq!(Path::new(&env["LD_PRELOAD"]), package.join("libmemsnap.so"));
    // As for a cargo build: the package (and only it: not the rest of site-packages) goes
    // on PYTHONPATH, so another Python than the environment's imports it too.
    let (entry, rest) = env["PYTHONPATH"].split_once(':').unwrap();
    assert_eq!(rest, "/mine");
    assert_package_entry(entry, &package);
    // A second run reuses the entry.
    let again = memsnap_at(
        &exe,
        &["run", "--", "env"],
        &[("XDG_CACHE_HOME", cache.path().to_str().unwrap())],
        &prefix,
    );
    assert_eq!(env_lines(&again.stdout)["PYTHONPATH"], entry);
}

#[test]
fn run_asks_the_python_beside_it_where_an_editable_install_keeps_the_library() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().canonicalize().unwrap();
    let exe = installed_copy(&prefix);
    let lib = common::preload_lib().canonicalize().unwrap();
    let asked = prefix.join("asked");
    write_script(
        &prefix.join("bin/python3"),
        &format!("echo \"$@\" > {}\necho {}", asked.display(), lib.display()),
    );
    let o = memsnap_at(&exe, &["run", "--", "env"], &[], &prefix);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(Path::new(&env_lines(&o.stdout)["LD_PRELOAD"]), lib);
    assert_eq!(
        std::fs::read_to_string(&asked).unwrap(),
        "-I -c import memsnap; print(memsnap.library_path())\n"
    );
}

#[test]
fn run_says_where_it_looked_for_the_library() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().canonicalize().unwrap();
    let exe = installed_copy(&prefix);
    write_script(
        &prefix.join("bin/python3"),
        "echo \"ModuleNotFoundError: No module named 'memsnap'\" >&2; exit 1",
    );
    let o = memsnap_at(&exe, &["run", "--", "true"], &[], &prefix);
    assert!(!o.status.success());
    let err = stderr(&o);
    let p = prefix.display();
    for expected in [
        "cannot find libmemsnap.so; looked in:".to_string(),
        format!("  {p}/bin/libmemsnap.so\n"),
        format!("  {p}/lib/libmemsnap.so\n"),
        format!("  {p}/lib*/python*/{{site,dist}}-packages/memsnap/libmemsnap.so\n"),
        format!(
            "  `import memsnap` in {p}/bin/python3 (ModuleNotFoundError: No module named 'memsnap')\n"
        ),
        "Pass --lib PATH".to_string(),
    ] {
        assert!(err.contains(&expected), "no `{expected}` in:\n{err}");
    }
}

#[test]
fn run_tensors_sets_only_what_the_user_left_unset() {
    let dir = tempfile::tempdir().unwrap();
    let o = memsnap(&["run", "--tensors", "--", "env"], &[], dir.path());
    assert!(o.status.success());
    let env = env_lines(&o.stdout);
    assert_eq!(env["PYTORCH_CUDA_ALLOC_CONF"], "backend:cudaMallocAsync");
    assert_eq!(env["XLA_PYTHON_CLIENT_PREALLOCATE"], "false");
    assert_eq!(env["XLA_PYTHON_CLIENT_ALLOCATOR"], "platform");
    assert_eq!(env["TF_GPU_ALLOCATOR"], "cuda_malloc_async");
    assert!(stderr(&o).contains("set TF_GPU_ALLOCATOR=cuda_malloc_async"));

    let o = memsnap(
        &["run", "--tensors", "--", "env"],
        &[
            ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
            ("TF_GPU_ALLOCATOR", "cuda_malloc"),
        ],
        dir.path(),
    );
    let env = env_lines(&o.stdout);
    assert_eq!(env["PYTORCH_CUDA_ALLOC_CONF"], "expandable_segments:True");
    assert_eq!(env["TF_GPU_ALLOCATOR"], "cuda_malloc");
    assert_eq!(env["XLA_PYTHON_CLIENT_ALLOCATOR"], "platform");
    assert!(
        stderr(&o).contains("keeping PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn run_refuses_an_unknown_option_before_the_command_and_lists_its_options() {
    let dir = tempfile::tempdir().unwrap();
    // `--bogus` is not the command: nothing runs, and the message names it and the options.
    let o = memsnap(&["run", "--bogus", "touch", "ran"], &[], dir.path());
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(err.contains("unexpected argument '--bogus'"), "{err}");
    assert!(
        err.contains("the options of `memsnap run`: --folder, --filename,"),
        "{err}"
    );
    assert!(!dir.path().join("ran").exists(), "the command ran anyway");
    // After the command's first word, and after `--`, options are the command's own.
    let o = memsnap(
        &["run", "--", "sh", "-c", "touch -- \"$1\"", "sh", "--bogus"],
        &[],
        dir.path(),
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(dir.path().join("--bogus").exists(), "{}", stderr(&o));
    // The command's own `--` is passed on.
    let o = memsnap(&["run", "touch", "--", "-x"], &[], dir.path());
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(dir.path().join("-x").exists(), "{}", stderr(&o));
}

#[test]
fn run_refuses_bad_values_and_names_the_variable() {
    let dir = tempfile::tempdir().unwrap();
    let o = memsnap(
        &["run", "--skip", "abc", "--", "touch", "ran"],
        &[("MEMSNAP_PERIOD", "soon")],
        dir.path(),
    );
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(err.contains("MEMSNAP_SKIP=\"abc\""), "{err}");
    assert!(err.contains("(set by --skip)"), "{err}");
    assert!(err.contains("MEMSNAP_PERIOD=\"soon\""), "{err}");
    assert!(err.contains("(from the environment)"), "{err}");
    // One message, not the library's "ignoring ...; using the default" plus a verdict.
    assert!(
        err.starts_with("memsnap: not running touch: 2 invalid values:"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 3, "{err}");
    assert!(
        !err.contains("ignoring") && !err.contains("using the default"),
        "{err}"
    );
    assert!(!dir.path().join("ran").exists(), "the command ran anyway");

    let o = memsnap(
        &["run", "--filename", "x-{batch}.pickle", "--", "true"],
        &[],
        dir.path(),
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("MEMSNAP_FILENAME"), "{}", stderr(&o));
}

#[test]
fn run_lists_the_new_snapshots_and_the_next_command() {
    let dir = tempfile::tempdir().unwrap();
    let snaps = dir.path().join("snaps");
    std::fs::create_dir(&snaps).unwrap();
    std::fs::write(snaps.join("demo-old-0.pickle"), b"older").unwrap();
    let o = memsnap(
        &[
            "run",
            "--folder",
            "snaps",
            "--every",
            "2",
            "--filename",
            "demo-{reason}-{step}.pickle",
            "--quiet",
            "--",
            common::program_path("demo").to_str().unwrap(),
        ],
        &[("LD_LIBRARY_PATH", common::fake_lib_dir().to_str().unwrap())],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("the run wrote 3 snapshots:"), "{err}");
    let listed: Vec<&str> = err.lines().filter_map(|l| l.strip_prefix("  ")).collect();
    assert_eq!(
        listed,
        vec![
            "snaps/demo-step-2.pickle",
            "snaps/demo-step-4.pickle",
            "snaps/demo-exit-5.pickle"
        ]
    );
    assert!(
        err.contains("next: memsnap summary snaps/demo-exit-5.pickle"),
        "{err}"
    );
    assert!(!err.contains("demo-old-0"), "{err}");
}

/// `memsnap run DEMO` in `dir` with `options` before `--`.
fn run_demo(dir: &Path, options: &[&str]) -> Output {
    let demo = common::program_path("demo");
    let mut args = vec!["run"];
    args.extend_from_slice(options);
    args.extend(["--", demo.to_str().unwrap()]);
    memsnap(
        &args,
        &[("LD_LIBRARY_PATH", common::fake_lib_dir().to_str().unwrap())],
        dir,
    )
}

/// The stats file goes where it was asked, its folder created as a snapshot folder is,
/// and `memsnap run` names only a stats file that is there.
#[test]
fn run_writes_the_stats_file_in_a_folder_that_did_not_exist() {
    let dir = tempfile::tempdir().unwrap();
    let o = run_demo(
        dir.path(),
        &["--folder", "snaps", "--stats", "snaps/mem-r{rank}.csv"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    // Without a launcher's rank variable the rank is the pid.
    let stats: Vec<String> = names(&dir.path().join("snaps"))
        .into_iter()
        .filter(|n| n.starts_with("mem-r") && n.ends_with(".csv"))
        .collect();
    assert_eq!(stats.len(), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!("per-step figures: snaps/{}", stats[0])),
        "{}",
        stderr(&o)
    );

    // A stats path that cannot be a file: not announced as written.
    std::fs::write(dir.path().join("blocked"), "a file").unwrap();
    let o = run_demo(dir.path(), &["--stats", "blocked/mem.csv"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(!err.contains("per-step figures: blocked"), "{err}");
    assert!(
        err.contains("no per-step figures were written to blocked/mem.csv"),
        "{err}"
    );
}

/// A run without a snapshot says why: snapshots turned off, recording disabled, a folder
/// that cannot be one; not always "the first CUDA allocation".
#[test]
fn run_says_the_real_reason_a_run_wrote_no_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let off = run_demo(dir.path(), &["--folder", "a", "--no-at-exit"]);
    assert!(off.status.success());
    assert!(
        stderr(&off).contains("snapshots at exit were turned off (MEMSNAP_AT_EXIT=0"),
        "{}",
        stderr(&off)
    );

    let demo = common::program_path("demo");
    let lib_dir = common::fake_lib_dir();
    let disabled = memsnap(
        &["run", "--folder", "b", "--", demo.to_str().unwrap()],
        &[
            ("LD_LIBRARY_PATH", lib_dir.to_str().unwrap()),
            ("MEMSNAP_DISABLE", "1"),
        ],
        dir.path(),
    );
    assert!(
        stderr(&disabled).contains("no snapshot in b: recording was disabled (MEMSNAP_DISABLE=1)"),
        "{}",
        stderr(&disabled)
    );

    std::fs::write(dir.path().join("c"), "a file").unwrap();
    let blocked = run_demo(dir.path(), &["--folder", "c"]);
    let err = stderr(&blocked);
    assert!(err.contains("c is not a folder"), "{err}");
    for o in [&off, &disabled, &blocked] {
        assert!(
            !stderr(o).contains("memsnap records from the first CUDA allocation)"),
            "{}",
            stderr(o)
        );
    }
}

// ------------------------------------------------------------------------------------
// memsnap dump

#[test]
fn dump_asks_a_live_process_for_a_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let child = spawn_waiting(&[], &[], dir.path(), true);
    let pid = child.id();
    let o = memsnap(&["dump", &pid.to_string()], &[], dir.path());
    let printed = stdout(&o);
    let status = finish(child);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(status.success());
    let path = PathBuf::from(printed.trim());
    assert_eq!(path.parent(), Some(dir.path()));
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.contains(&format!("-p{pid}-signal-")), "{name}");
    let snap = python_load_json(&path);
    assert_eq!(live_bytes(&snap), 8 << 20);
    assert_eq!(snap["memsnap"]["reason"], "signal");
}

#[test]
fn dump_finds_custom_names_relative_folders_and_other_signals() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("out")).unwrap();
    let mut cmd_env = vec![
        ("MEMSNAP_FILENAME", "snap-{tag}-{seq}.pickle"),
        ("MEMSNAP_SIGNAL", "USR2"),
    ];
    // A relative folder is relative to the process's working directory.
    let child = {
        let mut cmd = Command::new(common::program_path("wait"));
        clean_env(&mut cmd);
        cmd.current_dir(dir.path())
            .env("LD_LIBRARY_PATH", common::fake_lib_dir())
            .env("LD_PRELOAD", common::preload_lib())
            .env("MEMSNAP_FOLDER", "out");
        for (k, v) in cmd_env.drain(..) {
            cmd.env(k, v);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "result ready=1");
        std::thread::spawn(move || for _ in out.lines() {});
        child
    };
    let elsewhere = tempfile::tempdir().unwrap();
    let o = memsnap(&["dump", &child.id().to_string()], &[], elsewhere.path());
    let status = finish(child);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(status.success(), "USR2 must not have killed it");
    assert_eq!(
        PathBuf::from(stdout(&o).trim()),
        dir.path().join("out").join("snap-signal-1.pickle")
    );
}

#[test]
fn dump_follows_the_processes_own_acknowledgement() {
    // A fixed name rewritten in place: each dump still reports its file.
    let dir = tempfile::tempdir().unwrap();
    let env = [
        ("MEMSNAP_FILENAME", "latest.pickle"),
        ("MEMSNAP_OVERWRITE", "1"),
    ];
    let child = spawn_waiting(&[], &env, dir.path(), true);
    let pid = child.id().to_string();
    // Without its live socket the process is asked with the signal.
    without_socket(child.id());
    for round in 1..=2 {
        let o = memsnap(&["dump", &pid], &[], dir.path());
        assert!(o.status.success(), "round {round}: {}", stderr(&o));
        assert_eq!(
            PathBuf::from(stdout(&o).trim()),
            dir.path().join("latest.pickle")
        );
        assert!(
            stderr(&o).contains("received the signal; writing"),
            "{}",
            stderr(&o)
        );
    }
    assert!(finish(child).success());

    // A folder it cannot write to: the process says so at once, with the reason.
    let dir = tempfile::tempdir().unwrap();
    let blocked = dir.path().join("not-a-folder");
    std::fs::write(&blocked, "a file").unwrap();
    let child = spawn_waiting(&[], &[], &blocked, true);
    let pid = child.id().to_string();
    without_socket(child.id());
    let o = memsnap(&["dump", &pid, "--timeout", "60"], &[], dir.path());
    assert!(finish(child).success());
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.contains(&format!(
            "pid {pid} received the signal but could not write its snapshot"
        )),
        "{err}"
    );
}

#[test]
fn dump_refuses_processes_it_cannot_or_must_not_signal() {
    let dir = tempfile::tempdir().unwrap();

    // memsnap loaded, but no CUDA call yet: SIGUSR1 would kill it, so it is not sent.
    let idle = spawn_waiting(&["noalloc"], &[], dir.path(), true);
    let o = memsnap(&["dump", &idle.id().to_string()], &[], dir.path());
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("is not recording"), "{}", stderr(&o));
    let status = finish(idle);
    assert!(status.success(), "the idle process was hurt: {status}");

    // Signals off and no socket.
    let quiet = spawn_waiting(&[], &[("MEMSNAP_SIGNAL", "none")], dir.path(), true);
    without_socket(quiet.id());
    let o = memsnap(&["dump", &quiet.id().to_string()], &[], dir.path());
    assert!(finish(quiet).success());
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("signals are off for pid") && stderr(&o).contains("no live socket"),
        "{}",
        stderr(&o)
    );

    // No memsnap at all.
    let plain = spawn_waiting(&[], &[], dir.path(), false);
    let pid = plain.id();
    let o = memsnap(&["dump", &pid.to_string()], &[], dir.path());
    assert!(finish(plain).success());
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains(&format!("pid {pid} does not have memsnap loaded")),
        "{}",
        stderr(&o)
    );

    // No such process (above any pid_max).
    let o = memsnap(&["dump", "2147483647"], &[], dir.path());
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("no process 2147483647"),
        "{}",
        stderr(&o)
    );
    // Exit snapshots only: nothing was signalled.
    let written = names(dir.path());
    assert!(written.iter().all(|n| n.contains("-exit-")), "{written:?}");
}

#[test]
fn dump_all_in_a_folder_reaches_that_jobs_recording_processes_only() {
    // One "job" (ranks 0 and 1 and an idle launcher-like process) writing to `job`, and a
    // recording process of another job that `--folder` must leave alone.
    let job = tempfile::tempdir().unwrap();
    let other = tempfile::tempdir().unwrap();
    let a = spawn_waiting(&[], &[("RANK", "0")], job.path(), true);
    let b = spawn_waiting(&[], &[("RANK", "1")], job.path(), true);
    let idle = spawn_waiting(&["noalloc"], &[], job.path(), true);
    let stranger = spawn_waiting(&[], &[("MEMSNAP_AT_EXIT", "0")], other.path(), true);
    let (a_pid, b_pid, idle_pid) = (a.id(), b.id(), idle.id());
    let o = memsnap(
        &[
            "dump",
            "--all",
            "--folder",
            job.path().to_str().unwrap(),
            "--timeout",
            "30",
        ],
        &[],
        other.path(),
    );
    for child in [a, b, idle, stranger] {
        assert!(finish(child).success());
    }
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(names(other.path()).is_empty(), "{:?}", names(other.path()));
    let out = stdout(&o);
    let err = stderr(&o);
    let mine: Vec<&str> = out.lines().collect();
    assert_eq!(mine.len(), 2, "{out}\n{err}");
    assert!(
        mine.iter()
            .any(|l| l.contains(&format!("-r0-p{a_pid}-signal-")))
    );
    assert!(
        mine.iter()
            .any(|l| l.contains(&format!("-r1-p{b_pid}-signal-")))
    );
    assert!(err.contains(&format!("skipping: pid {idle_pid} ")), "{err}");
    for line in mine {
        assert!(Path::new(line).is_file());
    }
}

#[test]
fn dump_all_stays_in_the_callers_session_unless_user_widens_it() {
    if Command::new("setsid").arg("--version").output().is_err() {
        common::skip("setsid missing");
        return;
    }
    // Both write to `job`, so that no process of a test running beside this one is ever
    // signalled. `stranger` runs in a session of its own and, forked away by `setsid
    // --fork`, descends from no process of this one: like another person's job under a
    // shared account.
    // No stacks: nothing to symbolize, so the processes answer at once even on a busy
    // machine.
    let job = tempfile::tempdir().unwrap();
    let mine = spawn_waiting(
        &[],
        &[("RANK", "0"), ("MEMSNAP_STACKS", "none")],
        job.path(),
        true,
    );
    let stranger = spawn_waiting_via(
        Some("setsid"),
        &[],
        &[
            ("RANK", "1"),
            ("MEMSNAP_AT_EXIT", "0"),
            ("MEMSNAP_STACKS", "none"),
        ],
        job.path(),
        true,
    );
    let mine_pid = mine.id();
    let folder = job.path().to_str().unwrap();
    let o = memsnap(
        &["dump", "--all", "--folder", folder, "--timeout", "30"],
        &[],
        job.path(),
    );
    let session_only = stderr(&o);
    assert!(o.status.success(), "{session_only}");
    let out = stdout(&o);
    assert_eq!(out.lines().count(), 1, "{out}\n{session_only}");
    assert!(out.contains(&format!("-r0-p{mine_pid}-signal-")), "{out}");
    assert!(
        session_only.contains(&format!(
            "dumping 1 process in this session ({}): pid {mine_pid} (wait)\n",
            session_of_this_process()
        )),
        "{session_only}"
    );
    // --user reaches both.
    let o = memsnap(
        &[
            "dump",
            "--all",
            "--user",
            "--folder",
            folder,
            "--timeout",
            "30",
        ],
        &[],
        job.path(),
    );
    let all = stdout(&o);
    for child in [mine, stranger] {
        assert!(finish(child).success());
    }
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(all.lines().count(), 2, "{all}\n{}", stderr(&o));
    assert!(
        stderr(&o).contains("dumping 2 processes of yours on this host: "),
        "{}",
        stderr(&o)
    );
    let stranger_pid = all
        .lines()
        .find_map(|l| l.split("-r1-p").nth(1)?.split('-').next())
        .unwrap_or_else(|| panic!("no rank 1 file in {all}"));
    // The first dump said it left the stranger alone, and how to include it.
    assert!(
        session_only.contains("left alone: ")
            && session_only.contains(&format!("pid {stranger_pid} (wait)"))
            && session_only.contains("--user includes them"),
        "{session_only}"
    );
}

/// This process's session id (field 6 of /proc/self/stat).
fn session_of_this_process() -> String {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 1..];
    rest.split_whitespace().nth(3).unwrap().to_string()
}

/// Removes the live socket of `pid` (it keeps running): `memsnap dump` then has only the
/// signal to ask with, as for a process whose socket could not be made.
fn without_socket(pid: u32) {
    let uid = std::fs::metadata("/proc/self").unwrap().uid();
    let socket = memsnap_format::live::socket_path(uid, pid);
    assert!(
        wait_for(|| socket.exists()),
        "no socket at {}",
        socket.display()
    );
    std::fs::remove_file(&socket).unwrap();
}

/// `wait sleep N` with the preload: its stdout, line by line, once it said it is ready.
fn spawn_sleeping(seconds: &str, env: &[(&str, &str)], folder: &Path) -> (Child, Receiver<String>) {
    let mut cmd = Command::new(common::program_path("wait"));
    clean_env(&mut cmd);
    let mut child = cmd
        .args(["sleep", seconds])
        .env("LD_LIBRARY_PATH", common::fake_lib_dir())
        .env("MEMSNAP_FOLDER", folder)
        .env("LD_PRELOAD", common::preload_lib())
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in out.lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let ready = lines.recv_timeout(Duration::from_secs(60)).unwrap();
    assert_eq!(ready, "result ready=1");
    (child, lines)
}

/// `memsnap dump` asks through the live socket when there is one: no signal, so a program
/// in `sleep()` sleeps on, and the file is reported.
#[test]
fn dump_asks_through_the_socket_and_interrupts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, lines) = spawn_sleeping("3", &[], dir.path());
    let o = memsnap(&["dump", &child.id().to_string()], &[], dir.path());
    assert!(o.status.success(), "{}", stderr(&o));
    let path = PathBuf::from(stdout(&o).trim());
    assert!(path.is_file(), "{}", stdout(&o));
    assert!(path.to_string_lossy().contains("-signal-"), "{path:?}");
    assert!(child.wait().unwrap().success());
    let rest: Vec<String> = lines.iter().collect();
    assert!(
        rest.contains(&"result slept_full=1".to_string()),
        "the sleep was cut short: {rest:?}"
    );
}

/// A process asked with the signal that exits before it could acknowledge (its `sleep()`
/// was cut short), with the file written: reported as dumped, never as a failure.
#[test]
fn dump_reports_the_file_of_a_process_that_exited_before_acknowledging() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, _lines) = spawn_sleeping("3", &[("MEMSNAP_AT_EXIT", "0")], dir.path());
    without_socket(child.id());
    let o = memsnap(&["dump", &child.id().to_string()], &[], dir.path());
    assert!(child.wait().unwrap().success());
    let written: Vec<String> = names(dir.path())
        .into_iter()
        .filter(|n| n.contains("-signal-"))
        .collect();
    assert_eq!(written.len(), 1, "{:?}", names(dir.path()));
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        PathBuf::from(stdout(&o).trim()),
        dir.path().join(&written[0])
    );
}

/// `memsnap dump` given the pid of `memsnap run` itself (what `pgrep -f train.py` finds
/// first) dumps the recording process it started, and says so.
#[test]
fn dump_of_the_launchers_pid_dumps_its_recording_children() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(common::memsnap_bin());
    clean_env(&mut cmd);
    let mut launcher = cmd
        .args(["run", "--folder"])
        .arg(dir.path())
        .arg("--")
        .arg(common::program_path("wait"))
        .env("LD_LIBRARY_PATH", common::fake_lib_dir())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(launcher.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "result ready=1");
    std::thread::spawn(move || for _ in out.lines() {});
    let o = memsnap(&["dump", &launcher.id().to_string()], &[], dir.path());
    drop(launcher.stdin.take());
    assert!(launcher.wait().unwrap().success());
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains(&format!(
            "pid {} has no memsnap loaded (a launcher); dumping 1 process it started: pid ",
            launcher.id()
        )) && err.contains("(wait)"),
        "{err}"
    );
    assert!(Path::new(stdout(&o).trim()).is_file(), "{}", stdout(&o));
}

#[test]
fn dump_needs_a_pid_or_all() {
    let dir = tempfile::tempdir().unwrap();
    let o = memsnap(&["dump"], &[], dir.path());
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("<PID>"), "{}", stderr(&o));
}

// ------------------------------------------------------------------------------------
// Values that used to panic or be taken silently (tests/settings.rs: the library's side)

#[test]
fn run_refuses_what_the_library_refuses_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    for (option, value, var) in [
        ("--period", "99999999999999999999", "MEMSNAP_PERIOD"),
        ("--period", "5124095576030431h", "MEMSNAP_PERIOD"),
        ("--period", "1ms", "MEMSNAP_PERIOD"),
        ("--period", "31d", "MEMSNAP_PERIOD"),
        ("--signal", "SEGV", "MEMSNAP_SIGNAL"),
        ("--signal", "9", "MEMSNAP_SIGNAL"),
        ("--signal", "RTMIN+-23", "MEMSNAP_SIGNAL"),
        ("--signal", "RTMIN+2147483647", "MEMSNAP_SIGNAL"),
        (
            "--max-entries",
            "99999999999999999999999",
            "MEMSNAP_MAX_ENTRIES",
        ),
        ("--every", "18446744073709551615", "MEMSNAP_EVERY"),
        ("--steps", "optimizer", "MEMSNAP_STEPS"),
        ("--folder", "snaps/{rnak}", "MEMSNAP_FOLDER"),
        ("--stats", "mem-{rnak}.csv", "MEMSNAP_STATS"),
        ("--stats", "mem-{step}.csv", "MEMSNAP_STATS"),
        ("--stats", ".mem.csv", "MEMSNAP_STATS"),
        ("--filename", "..", "MEMSNAP_FILENAME"),
        ("--filename", ".hidden-{pid}", "MEMSNAP_FILENAME"),
    ] {
        let o = memsnap(
            &["run", option, value, "--", "touch", "ran"],
            &[],
            dir.path(),
        );
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{option} {value}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.starts_with(&format!(
                "memsnap: not running touch: {var}={value:?} (set by {option}): expected "
            )),
            "{err}"
        );
        assert!(
            !dir.path().join("ran").exists(),
            "{option} {value}: ran anyway"
        );
    }
}

#[test]
fn dump_reads_a_process_whose_period_is_too_large_for_a_duration() {
    let dir = tempfile::tempdir().unwrap();
    let env = [("MEMSNAP_PERIOD", "99999999999999999999")];
    let child = spawn_waiting(&[], &env, dir.path(), true);
    let o = memsnap(&["dump", &child.id().to_string()], &[], dir.path());
    assert!(finish(child).success());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    assert!(Path::new(stdout(&o).trim()).is_file(), "{}", stdout(&o));
}

/// The signals a process catches, as the `SigCgt` mask of /proc/PID/status (bit N-1 for
/// signal N).
fn caught_signals(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .expect("a SigCgt line");
    u64::from_str_radix(hex.trim(), 16).unwrap()
}

#[test]
fn a_refused_signal_gets_no_handler_and_the_default_one_stays() {
    const SIGUSR1: u32 = 10;
    let dir = tempfile::tempdir().unwrap();
    // MEMSNAP_AT_CRASH=0: SIGSEGV is then memsnap's only if it became the dump signal.
    let baseline = spawn_waiting(
        &[],
        &[("MEMSNAP_SIGNAL", "none"), ("MEMSNAP_AT_CRASH", "0")],
        dir.path(),
        true,
    );
    let theirs = caught_signals(baseline.id());
    assert!(finish(baseline).success());
    for (signal, number) in [
        ("SEGV", 11),
        ("11", 11),
        ("HUP", 1),
        ("RTMIN+2147483647", 0),
    ] {
        let env = [("MEMSNAP_SIGNAL", signal), ("MEMSNAP_AT_CRASH", "0")];
        let child = spawn_waiting(&[], &env, dir.path(), true);
        let caught = caught_signals(child.id());
        assert!(finish(child).success());
        // Only memsnap's default (USR1) was added to what the program catches itself.
        assert_eq!(
            caught & !theirs,
            1 << (SIGUSR1 - 1),
            "{signal}: {caught:#x}"
        );
        if number > 0 {
            assert_eq!(caught & (1 << (number - 1)), 0, "{signal} is caught");
        }
    }
}

#[test]
fn run_takes_an_environment_that_is_not_utf8() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let dir = tempfile::tempdir().unwrap();
    let run_with = |name: &str, value: &[u8]| {
        let mut cmd = Command::new(common::memsnap_bin());
        clean_env(&mut cmd);
        cmd.args(["run", "--", "true"])
            .current_dir(dir.path())
            .env(name, OsStr::from_bytes(value))
            .output()
            .unwrap()
    };
    // Another program's variable is none of memsnap's business.
    let o = run_with("SOME_PATH", b"caf\xe9");
    assert!(o.status.success(), "{}", stderr(&o));
    // A MEMSNAP_ value is refused like any bad value, in one line.
    let o = run_with("MEMSNAP_FOLDER", b"snaps-\xff");
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert_eq!(
        stderr(&o),
        "memsnap: not running true: MEMSNAP_FOLDER=\"snaps-\u{fffd}\" (from the environment): expected UTF-8 text\n"
    );
}

#[test]
fn dump_takes_any_timeout_without_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    for timeout in ["inf", "1e300"] {
        let o = memsnap(
            &["dump", "--timeout", timeout, "2147483647"],
            &[],
            dir.path(),
        );
        assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
        assert!(
            stderr(&o).contains("no process 2147483647"),
            "{}",
            stderr(&o)
        );
    }
}

//! `memsnap explain` end to end: programs on the simulated CUDA driver (tests/programs/
//! explain_steps.c, explain_oom.c, multi_device.c, iter_leak.c) write real snapshot files,
//! and explain must give the expected answer for each. Needs `cargo build --workspace` first (the
//! tests preload target/<profile>/libmemsnap.so and run target/<profile>/memsnap).

mod common;

use common::{num, run_program};
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};

const MIB: f64 = (1u64 << 20) as f64;

fn memsnap(args: &[&str]) -> Output {
    Command::new(common::memsnap_bin())
        .args(args)
        .output()
        .expect("run memsnap")
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `memsnap explain --json` on `paths`: the object, after checking the exit status.
fn explain_json(paths: &[&Path], code: i32) -> Value {
    explain_with(&[], paths, code)
}

/// [`explain_json`] with `extra` arguments first.
fn explain_with(extra: &[&str], paths: &[&Path], code: i32) -> Value {
    let mut args = vec!["explain".to_string(), "--json".to_string()];
    args.extend(extra.iter().map(|a| a.to_string()));
    args.extend(paths.iter().map(|p| p.display().to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = memsnap(&args);
    assert_eq!(
        out.status.code(),
        Some(code),
        "{args:?}\n{}\n{}",
        text(&out),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("explain --json prints one JSON object")
}

/// explain_steps in `mode` for 25 steps, a step snapshot after every step.
fn steps_run(mode: &str) -> common::Run {
    let run = run_program(
        "explain_steps",
        &[mode, "25"],
        &[("MEMSNAP_EVERY", "1"), ("MEMSNAP_QUIET", "1")],
        true,
    );
    run.assert_success();
    run
}

fn notes(x: &Value) -> Vec<String> {
    x["notes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn a_leak_among_steady_temporaries_is_found_on_its_line() {
    let run = steps_run("leak");
    let line = num(&run.results(), "leak_line");
    let x = explain_json(&[run.dir.path()], 0);
    let leaks = x["leaks"].as_array().unwrap();
    assert_eq!(leaks.len(), 1, "{x:#}");
    let l = &leaks[0];
    assert_eq!(
        l["site"].as_str().unwrap(),
        format!("leak_keep (explain_steps.c:{line})"),
        "{x:#}"
    );
    let per_step = l["bytes_per_step"].as_f64().unwrap();
    assert!(
        (per_step - MIB).abs() <= 0.1 * MIB,
        "1 MiB per step within 10%: {per_step}"
    );
    assert!(l["steps"].as_i64().unwrap() >= 20, "{l}");
    // --fail-on-leak: exit 1, the site named on stderr; the text names it too.
    let dir = run.dir.path().display().to_string();
    let out = memsnap(&["explain", "--fail-on-leak", &dir]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("leak_keep (explain_steps.c:"), "{err}");
    assert!(text(&out).contains("+1.0 MiB per step"), "{}", text(&out));
}

#[test]
fn the_same_program_without_the_leak_reports_none() {
    let run = steps_run("noleak");
    let dir = run.dir.path().display().to_string();
    let x = explain_json(&[run.dir.path()], 0);
    assert_eq!(x["leaks"], serde_json::json!([]), "{x:#}");
    assert!(
        notes(&x)
            .iter()
            .any(|n| n.contains("no leak across 25 step boundaries")),
        "{x:#}"
    );
    let out = memsnap(&["explain", "--fail-on-leak", &dir]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}

#[test]
fn a_warm_up_that_grows_three_steps_then_stays_is_no_leak() {
    let run = steps_run("warmup");
    let line = num(&run.results(), "warm_line");
    let x = explain_json(&[run.dir.path()], 0);
    assert_eq!(x["leaks"], serde_json::json!([]), "{x:#}");
    let warm = format!("warm_cache (explain_steps.c:{line})");
    assert!(
        notes(&x)
            .iter()
            .any(|n| n.contains("warm-up") && n.contains(&warm) && n.contains("by step 3")),
        "{x:#}"
    );
}

#[test]
fn an_oom_held_by_one_site_is_live_and_names_that_site_first() {
    let run = run_program(
        "explain_oom",
        &["oom"],
        &[("FAKE_CUDA_CAPACITY", "64M"), ("MEMSNAP_QUIET", "1")],
        true,
    );
    run.assert_success();
    let r = run.results();
    assert_eq!(num(&r, "ask_rc"), 2, "the 32 MiB request must fail");
    let x = explain_json(&[run.dir.path()], 0);
    let o = &x["oom"];
    assert_eq!(o["verdict"], "live", "{x:#}");
    assert_eq!(o["request_bytes"], 32 << 20);
    // 64 MiB - 3 x 12 MiB - 2 x 1 MiB.
    assert_eq!(o["device_free_bytes"], 26 << 20);
    let line = num(&r, "big_line");
    assert_eq!(
        o["sites"][0]["site"].as_str().unwrap(),
        format!("hold_big (explain_oom.c:{line})")
    );
    assert_eq!(o["sites"][0]["bytes"], 36 << 20);
    assert_eq!(o["sites"][0]["allocations"], 3);
    assert_eq!(o["sites"][0]["library"], "app");
    // summary of the OOM file ends with the verdict.
    let oom_file = common::snapshot_files(run.dir.path())
        .into_iter()
        .find(|p| p.to_string_lossy().contains("-oom-"))
        .expect("an oom file");
    let out = memsnap(&["summary", &oom_file.display().to_string()]);
    let last = text(&out).lines().last().unwrap_or_default().to_string();
    assert!(
        last.starts_with("verdict: live") && last.contains("memsnap explain"),
        "{last}"
    );
}

/// Runs explain_oom as `rank` (LOCAL_RANK 0: one rank per node) into `dir`.
fn rank_run(dir: &Path, rank: &str, mode: &str) {
    run_program(
        "explain_oom",
        &[mode],
        &[
            ("FAKE_CUDA_CAPACITY", "64M"),
            ("MEMSNAP_QUIET", "1"),
            ("MEMSNAP_FOLDER", dir.to_str().unwrap()),
            ("RANK", rank),
            ("LOCAL_RANK", "0"),
        ],
        true,
    )
    .assert_success();
}

#[test]
fn the_rank_that_ran_out_first_is_named() {
    let dir = tempfile::tempdir().unwrap();
    // Rank 2 runs out first, rank 1 later; ranks 0 and 3 fit.
    rank_run(dir.path(), "0", "fit");
    rank_run(dir.path(), "2", "oom");
    rank_run(dir.path(), "1", "oom");
    rank_run(dir.path(), "3", "fit");
    let x = explain_json(&[dir.path()], 0);
    let o = &x["oom"];
    assert_eq!(o["first_rank"], 2, "{x:#}");
    assert_eq!(o["rank"], 2);
    let others: Vec<i64> = o["others"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["rank"].as_i64().unwrap())
        .collect();
    assert_eq!(others, [0, 1, 3]);
    assert!(
        notes(&x)
            .iter()
            .any(|n| n == "rank 1 ran out of memory too, later")
    );
    // Ranks side by side: 0 and 3 peak at 46 MiB (they asked for 8 MiB more).
    assert_eq!(x["ranks"]["worst_peak_bytes"], 46 << 20, "{x:#}");
    let out = memsnap(&["explain", &dir.path().display().to_string()]);
    assert!(
        text(&out).starts_with("rank 2 ran out of memory first"),
        "{}",
        text(&out)
    );
    // No rank is on another's device here.
    assert!(
        !notes(&x)
            .iter()
            .any(|n| n.contains("belongs to another rank"))
    );
}

#[test]
fn an_allocation_on_another_ranks_device_is_noted() {
    let run = run_program(
        "multi_device",
        &[],
        &[("RANK", "1"), ("LOCAL_RANK", "1"), ("MEMSNAP_QUIET", "1")],
        true,
    );
    run.assert_success();
    let x = explain_json(&[run.dir.path()], 0);
    assert_eq!(
        x["ranks"]["foreign_devices"],
        serde_json::json!([{"rank": 1, "local_rank": 1, "devices": [0, 1]}]),
        "{x:#}"
    );
    assert!(
        notes(&x)
            .iter()
            .any(|n| n.contains("rank 1 (LOCAL_RANK 1) allocates on device 0")),
        "{x:#}"
    );
}

#[test]
fn bad_input_is_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.pickle");
    std::fs::write(&bad, b"not a pickle").unwrap();
    for args in [
        vec!["explain".to_string(), bad.display().to_string()],
        vec![
            "explain".to_string(),
            dir.path().join("missing.pickle").display().to_string(),
        ],
        vec![
            "explain".to_string(),
            "--json".to_string(),
            bad.display().to_string(),
        ],
    ] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = memsnap(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}: {}", text(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.starts_with("memsnap: "), "{err}");
    }
}

/// iter_leak (a loop with no step marks) in `mode` for 30 iterations, asking for a snapshot
/// by SIGUSR1 after each iteration in `dumps`; `env` added.
fn loop_run(mode: &str, dumps: &[&str], env: &[(&str, &str)]) -> common::Run {
    let mut args = vec![mode, "30"];
    args.extend(dumps);
    let mut all = vec![("MEMSNAP_QUIET", "1")];
    all.extend(env);
    let run = run_program("iter_leak", &args, &all, true);
    run.assert_success();
    assert_eq!(num(&run.results(), "signal_files"), dumps.len() as u64);
    run
}

/// The run's files whose names contain `needle`, in name order.
fn files_named(dir: &Path, needle: &str) -> Vec<std::path::PathBuf> {
    common::snapshot_files(dir)
        .into_iter()
        .filter(|p| p.to_string_lossy().contains(needle))
        .collect()
}

#[test]
fn a_loop_without_step_marks_leaks_per_iteration_in_its_exit_file() {
    let run = loop_run("leak", &[], &[]);
    let r = run.results();
    let exit = files_named(run.dir.path(), "-exit-");
    assert_eq!(exit.len(), 1);
    let exit = exit[0].as_path();
    // Every allocation goes through device_alloc, from seven lines: a helper, so each
    // allocation is shown at its calling line, the helper named beside it.
    let helper = format!("device_alloc (iter_leak.c:{})", num(&r, "helper_line"));
    let keep = format!("keep_batch (iter_leak.c:{})", num(&r, "keep_line"));
    let keep_via = format!("{keep} via {helper}");
    let x = explain_json(&[exit], 0);
    let it = &x["iterations"][0];
    assert_eq!(it["found"], true, "{x:#}");
    assert_eq!(it["iterations"], 30, "{x:#}");
    assert_eq!(it["allocations_per_iteration"], 6);
    assert_eq!(it["confidence"], "high");
    let leaks = x["leaks"].as_array().unwrap();
    assert_eq!(leaks.len(), 1, "{x:#}");
    let l = &leaks[0];
    assert_eq!(l["site"], keep_via.as_str(), "{x:#}");
    assert_eq!(l["via"], helper.as_str(), "{x:#}");
    assert_eq!(l["unit"], "iteration");
    assert_eq!(l["bytes_per_step"], 1 << 20);
    assert_eq!(l["bytes_per_iteration"], 1 << 20);
    assert_eq!(
        (l["first_step"].clone(), l["steps"].clone()),
        (1.into(), 30.into())
    );
    assert_eq!(l["live_bytes_at_end"], 30 << 20);
    // `--ignore device_alloc` makes the callers the sites themselves (keep_batch has one
    // caller, main: no helper).
    let x = explain_with(&["--ignore", "device_alloc"], &[exit], 0);
    assert_eq!(x["leaks"][0]["site"], keep.as_str(), "{x:#}");
    assert_eq!(x["leaks"][0]["via"], Value::Null, "{x:#}");
    // `--at-helpers`: the helper's own line, and a note naming its calling lines.
    let x = explain_with(&["--at-helpers"], &[exit], 0);
    assert_eq!(x["leaks"][0]["site"], helper.as_str(), "{x:#}");
    assert_eq!(x["leaks"][0]["bytes_per_iteration"], 1 << 20, "{x:#}");
    assert!(
        notes(&x).iter().any(|n| n.starts_with(&format!(
            "{helper} holds 100% of the live bytes and is a helper: it allocates for 7 \
             calling lines, the largest {keep} (30.0 MiB)"
        ))),
        "{x:#}"
    );
    let out = memsnap(&["explain", "--fail-on-leak", &exit.display().to_string()]);
    assert_eq!(out.status.code(), Some(1));
    let t = text(&out);
    assert!(
        t.contains("Leaks across iterations found in the record")
            && t.contains("30 iterations of 6 allocations")
            && t.contains(&format!(
                "+1.0 MiB per iteration since iteration 1 (30 iterations, 30.0 MiB live at the \
                 end): {keep_via}"
            )),
        "{t}"
    );
    // `summary` shows every calling line, each with its bytes at the end.
    assert_eq!(
        end_sites(exit, &[]),
        [
            (keep_via.clone(), Value::from(helper.as_str()), 30 << 20, 30),
            (
                format!(
                    "model_weights (iter_leak.c:{}) via {helper}",
                    num(&r, "weights_line")
                ),
                Value::from(helper.as_str()),
                16 << 20,
                1
            ),
        ]
    );
}

#[test]
fn a_loop_without_the_leak_has_none_and_a_short_history_says_why_in_one_line() {
    let run = loop_run("noleak", &[], &[]);
    let x = explain_json(&[run.dir.path()], 0);
    assert_eq!(x["leaks"], serde_json::json!([]), "{x:#}");
    assert_eq!(x["iterations"][0]["iterations"], 30, "{x:#}");
    assert!(
        notes(&x)
            .iter()
            .any(|n| n == "no leak across 31 iteration boundaries (iterations 1 to 31)"),
        "{x:#}"
    );
    // 40 entries: less than two iterations of the leaking loop.
    let run = loop_run("leak", &[], &[("MEMSNAP_MAX_ENTRIES", "40")]);
    let dir = run.dir.path().display().to_string();
    let x = explain_json(&[run.dir.path()], 0);
    assert_eq!(x["leaks"], serde_json::json!([]), "{x:#}");
    assert_eq!(x["iterations"][0]["found"], false);
    let why: Vec<String> = notes(&x)
        .into_iter()
        .filter(|n| n.contains("no iterations found in"))
        .collect();
    assert_eq!(why.len(), 1, "{x:#}");
    assert!(
        why[0].contains("its history is too short")
            && why[0].contains("MEMSNAP_MAX_ENTRIES")
            && why[0].contains("MEMSNAP_EVERY")
            && why[0].contains("two dumps"),
        "{}",
        why[0]
    );
    let t = text(&memsnap(&["explain", &dir]));
    assert_eq!(t.matches("no iterations found in").count(), 1, "{t}");
}

#[test]
fn two_signal_dumps_of_one_leaking_process_name_the_leak() {
    // Histories of 40 entries: neither dump alone holds enough iterations; the growth
    // between them (iterations 10 and 25) does.
    let run = loop_run("leak", &["10", "25"], &[("MEMSNAP_MAX_ENTRIES", "40")]);
    let keep = format!(
        "keep_batch (iter_leak.c:{})",
        num(&run.results(), "keep_line")
    );
    let keep = format!(
        "{keep} via device_alloc (iter_leak.c:{})",
        num(&run.results(), "helper_line")
    );
    let dumps = files_named(run.dir.path(), "-signal-");
    let paths: Vec<&Path> = dumps.iter().map(|p| p.as_path()).collect();
    let x = explain_json(&paths, 0);
    let s = &x["snapshots"][0];
    let names: Vec<String> = dumps.iter().map(|p| p.display().to_string()).collect();
    assert_eq!(s["files"], serde_json::json!(names), "{x:#}");
    assert!(s["pid"].as_i64().is_some(), "{s:#}");
    assert_eq!(s["sites"][0]["site"], keep.as_str(), "{x:#}");
    assert_eq!(s["sites"][0]["growth_bytes"], 15 << 20);
    assert_eq!(s["sites"][0]["verdict"], "leak");
    assert_eq!(s["sites"].as_array().unwrap().len(), 1, "{x:#}");
    let leaks = x["leaks"].as_array().unwrap();
    assert_eq!(leaks.len(), 1, "{x:#}");
    assert_eq!(leaks[0]["site"], keep.as_str());
    assert_eq!(leaks[0]["unit"], "snapshot");
    // Whole histories: the dumps' own iterations count 15 between them, 1 MiB each.
    let run = loop_run("leak", &["10", "25"], &[]);
    let dumps = files_named(run.dir.path(), "-signal-");
    let paths: Vec<&Path> = dumps.iter().map(|p| p.as_path()).collect();
    let names: Vec<String> = dumps.iter().map(|p| p.display().to_string()).collect();
    let x = explain_json(&paths, 0);
    assert_eq!(x["snapshots"][0]["iterations"], 15, "{x:#}");
    assert_eq!(x["snapshots"][0]["sites"][0]["verdict"], "leak");
    assert_eq!(x["leaks"][0]["site"], keep.as_str());
    assert_eq!(x["leaks"][0]["bytes_per_iteration"], 1 << 20, "{x:#}");
    // `diff` of the two dumps: the growth at the calling line, the helper beside it.
    let d: Value =
        serde_json::from_slice(&memsnap(&["diff", "--json", &names[0], &names[1]]).stdout)
            .expect("diff --json");
    assert_eq!(d["grew"][0]["site"], keep.as_str(), "{d:#}");
    assert_eq!(d["grew"][0]["growth_bytes"], 15 << 20, "{d:#}");
    assert!(
        d["grew"][0]["via"]
            .as_str()
            .is_some_and(|v| v.starts_with("device_alloc (iter_leak.c:")),
        "{d:#}"
    );
    assert_eq!(d["grew"].as_array().unwrap().len(), 1, "{d:#}");
    let t = text(&memsnap(&["explain", &names[0], &names[1]]));
    assert!(
        t.contains("Growth between 2 snapshots of one process (pid ")
            && t.contains("about 15 iterations apart")
            && t.contains(&format!(
                "+15.0 MiB  leak (about +1.0 MiB per iteration), 25.0 MiB live at the end: {keep}"
            )),
        "{t}"
    );
    // `ranks` shows the two dumps and the exit file as one process, oldest first.
    let v: Value = serde_json::from_slice(
        &memsnap(&["ranks", "--json", &run.dir.path().display().to_string()]).stdout,
    )
    .expect("ranks --json");
    let rows = v["ranks"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{v:#}");
    let files: Vec<&str> = rows[0]["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap())
        .collect();
    assert_eq!(files.len(), 3, "{v:#}");
    assert!(
        files[0].contains("-signal-") && files[1].contains("-signal-"),
        "{files:?}"
    );
    assert!(files[2].contains("-exit-"), "{files:?}");
}

/// The line of tests/programs/py_helper.py that ends in `# LINE: name`, as a site names it:
/// `FILE:N (function)`.
fn py_helper_line(name: &str, function: &str) -> String {
    let path = common::program_path("py_helper.py");
    let source = std::fs::read_to_string(&path).expect("read py_helper.py");
    let marker = format!("# LINE: {name}");
    let n = source
        .lines()
        .position(|l| l.trim_end().ends_with(&marker))
        .unwrap_or_else(|| panic!("no line marked {marker}"));
    format!("{}:{} ({function})", path.display(), n + 1)
}

/// (site, via, bytes, count) of each row of `summary --json`'s end, largest first.
fn end_sites(file: &Path, extra: &[&str]) -> Vec<(String, Value, i64, i64)> {
    let path = file.display().to_string();
    let mut args = vec!["summary", "--json", &path];
    args.extend(extra);
    let s: Value = serde_json::from_slice(&memsnap(&args).stdout).expect("summary --json");
    s["devices"][0]["top_sites"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["site"].as_str().unwrap().to_string(),
                r["via"].clone(),
                r["bytes"].as_i64().unwrap(),
                r["count"].as_i64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn a_python_programs_helpers_are_shown_at_their_calling_lines() {
    let run = run_program("py_helper.py", &[], &[("MEMSNAP_QUIET", "1")], true);
    run.assert_success();
    let exit = files_named(run.dir.path(), "-exit-");
    assert_eq!(exit.len(), 1);
    let exit = exit[0].as_path();
    let mib = 1i64 << 20;
    let get = py_helper_line("get", "get");
    let alloc = py_helper_line("alloc", "alloc");
    let via = |line: &str, helper: &str| format!("{line} via {helper}");
    let module = py_helper_line("module", "<module>");
    let keep = via(&py_helper_line("keep", "step"), &get);
    // The cache's get (through its one-caller _new_block) and alloc are helpers; the
    // module-level line is the site of the library's two allocations, alone; load_weights
    // has one caller.
    assert_eq!(
        end_sites(exit, &[]),
        [
            (module.clone(), Value::Null, 256 * mib, 2),
            (keep.clone(), Value::from(get.as_str()), 60 * mib, 20),
            (
                py_helper_line("weights", "load_weights"),
                Value::Null,
                16 * mib,
                1
            ),
            (
                via(&py_helper_line("eval", "evaluate"), &get),
                Value::from(get.as_str()),
                16 * mib,
                1
            ),
            (
                via(&py_helper_line("temp1", "step"), &alloc),
                Value::from(alloc.as_str()),
                2 * mib,
                1
            ),
            (
                via(&py_helper_line("temp2", "step"), &alloc),
                Value::from(alloc.as_str()),
                mib,
                1
            ),
        ]
    );
    // Turned off: every allocation at the helper's own line.
    let off = end_sites(exit, &["--at-helpers"]);
    let lines: Vec<(&str, i64)> = off.iter().map(|r| (r.0.as_str(), r.2)).collect();
    let new_block = py_helper_line("new_block", "_new_block");
    let weights = py_helper_line("weights", "load_weights");
    assert_eq!(
        lines,
        [
            (module.as_str(), 256 * mib),
            (new_block.as_str(), 76 * mib),
            (weights.as_str(), 16 * mib),
            (alloc.as_str(), 3 * mib),
        ]
    );
    // explain names the leak at the calling line of the cache's get, and never calls the
    // module-level line a helper (the library's lines below it are its callees).
    let x = explain_json(&[exit], 0);
    assert_eq!(x["leaks"][0]["site"], keep.as_str(), "{x:#}");
    assert_eq!(x["leaks"][0]["via"], get.as_str(), "{x:#}");
    assert_eq!(x["leaks"][0]["bytes_per_iteration"], 3 * mib, "{x:#}");
    for extra in [&[][..], &["--at-helpers"][..]] {
        let x = explain_with(extra, &[exit], 0);
        assert!(
            !notes(&x).iter().any(|n| n.contains("helper")),
            "{extra:?}: {x:#}"
        );
    }
}

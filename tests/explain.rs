//! `memsnap explain` end to end: programs on the simulated CUDA driver (tests/programs/
//! explain_steps.c, explain_oom.c, multi_device.c) write real snapshot files, and explain
//! must give the expected answer for each. Needs `cargo build --workspace` first (the
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
    let mut args = vec!["explain".to_string(), "--json".to_string()];
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

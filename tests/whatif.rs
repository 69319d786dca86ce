//! `memsnap whatif` end to end: memsnap's files of the PyTorch stand-in (tests/fake_torch:
//! the caching allocator's rules, CUDA graphs' private pools, an out-of-memory error) recorded
//! on the simulated driver, PyTorch's own snapshots (tests/fixtures/torch), and a generated
//! file of `backend:cudaMallocAsync` tensors; the text, the JSON and the refusals. Needs
//! `cargo build --workspace` first. The real PyTorch: tests/real_torch.rs.

mod common;

use common::{memsnap_json, run_program, snapshot_files};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn memsnap(args: &[&str]) -> Output {
    Command::new(common::memsnap_bin())
        .args(args)
        .output()
        .expect("run memsnap")
}

fn fixture(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/torch")
        .join(name)
        .display()
        .to_string()
}

/// The stand-in's `scenario` under memsnap: its exit snapshot (and the run, which owns it).
fn standin(scenario: &str, env: &[(&str, &str)]) -> (common::Run, PathBuf) {
    let truth = tempfile::tempdir().unwrap();
    let path = truth.path().join("truth.json");
    let run = run_program(
        "torch_standin",
        &[scenario, path.to_str().unwrap()],
        env,
        true,
    );
    run.assert_success();
    let exit = snapshot_files(run.dir.path())
        .into_iter()
        .find(|p| p.to_string_lossy().contains("-exit-"))
        .expect("an exit snapshot");
    (run, exit)
}

/// The scenarios' names, in order.
fn labels<'a>(rows: impl IntoIterator<Item = &'a Value>) -> Vec<&'a str> {
    rows.into_iter()
        .map(|r| r["setting"].as_str().expect("a setting"))
        .collect()
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

#[test]
fn the_stand_ins_runs_replay_as_recorded_private_pools_too() {
    for scenario in ["mixed", "graphs"] {
        let (_run, exit) = standin(scenario, &[]);
        let exit = exit.to_str().unwrap();
        let w = memsnap_json(&["whatif", "--json", exit]);
        for check in w["checks"].as_array().unwrap() {
            assert_eq!(check["reproduced"], true, "{scenario}: {w:#}");
            assert!(u(&check["segment_operations"]) > 0, "{scenario}");
            assert_eq!(
                check["model_peak_reserved_bytes"], check["recorded_peak_reserved_bytes"],
                "{scenario}"
            );
        }
        assert_eq!(w["release"], "2.11", "{scenario}");
        assert_eq!(w["release_assumed"], false, "{scenario}");
        // One row per scenario and device; device 0's here.
        let rows: Vec<&Value> = w["scenarios"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["device"] == 0)
            .collect();
        assert_eq!(rows[0]["setting"], "as recorded");
        // The defaults: expandable segments, max_split_size_mb:128, the other backend; the
        // simulated device's 80 GiB holds every one.
        assert_eq!(
            labels(rows.iter().copied()),
            [
                "as recorded",
                "expandable_segments:True",
                "max_split_size_mb:128",
                "backend:cudaMallocAsync"
            ],
            "{scenario}"
        );
        for r in &rows {
            assert_eq!(r["fits"], true, "{scenario}: {r:#}");
            assert_eq!(u(&r["capacity_bytes"]), 80 << 30, "{scenario}");
            assert!(
                u(&r["peak_reserved_bytes"]) >= u(&r["peak_allocated_bytes"]),
                "{scenario}: {r:#}"
            );
        }
        // No cache: what the tensors asked for, no more than the caching allocator holds.
        assert!(u(&rows[3]["peak_reserved_bytes"]) <= u(&rows[0]["peak_allocated_bytes"]));
    }
}

#[test]
fn an_out_of_memory_file_says_first_which_settings_avoid_it() {
    // 3 MiB requests, six to a 20 MiB segment, on a 64 MiB device: the 19th needs a fourth
    // segment. Packed in an expandable segment's pages, 19 x 3 MiB take three pages.
    let (_run, exit) = standin("oom", &[("FAKE_CUDA_CAPACITY", "64M")]);
    let exit = exit.to_str().unwrap();
    let w = memsnap_json(&["whatif", "--json", exit]);
    assert_eq!(w["checks"][0]["reproduced"], true, "{w:#}");
    let oom = &w["recorded_oom"];
    assert_eq!(u(&oom["request_bytes"]), 3 << 20, "{w:#}");
    assert_eq!(
        oom["avoided_by"],
        serde_json::json!(["expandable_segments:True", "backend:cudaMallocAsync"]),
        "{w:#}"
    );
    assert_eq!(
        oom["not_avoided_by"],
        serde_json::json!(["max_split_size_mb:128"])
    );
    let rows = w["scenarios"].as_array().unwrap();
    assert_eq!(rows[0]["fits"], false, "{w:#}");
    assert_eq!(rows[0]["oom"]["event"], oom["event"], "{w:#}");
    assert_eq!(u(&rows[0]["capacity_bytes"]), 64 << 20);
    assert_eq!(u(&rows[0]["peak_reserved_bytes"]), 60 << 20);
    // The peak is first reached when the third segment holds one request: 60 - 13 x 3 MiB.
    assert_eq!(u(&rows[0]["reserved_unallocated_bytes_at_peak"]), 21 << 20);
    assert_eq!(rows[1]["fits"], true, "{w:#}");
    assert_eq!(u(&rows[1]["peak_reserved_bytes"]), 60 << 20, "{w:#}");
    // The text: the OOM line first, then the check.
    let out = memsnap(&["whatif", exit]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[1].starts_with("The recorded out-of-memory error (device 0, event ")
            && lines[1].contains("would have been avoided by: expandable_segments:True"),
        "{text}"
    );
    assert!(
        lines[3].starts_with("As recorded, the model gives back"),
        "{text}"
    );
}

#[test]
fn pytorchs_own_snapshots_scales_and_refusals() {
    let leak = fixture("torch-leak-step11.pickle");
    let w = memsnap_json(&[
        "whatif",
        "--json",
        &leak,
        "--set",
        "expandable_segments:True,max_split_size_mb:128",
        "--set",
        "frobnicate:1",
        "--scale",
        "activations=2,temporaries=2",
        "--device-memory",
        "1GiB",
    ]);
    assert_eq!(w["checks"][0]["reproduced"], true, "{w:#}");
    assert_eq!(w["release_assumed"], true);
    assert_eq!(
        labels(w["scenarios"].as_array().unwrap()),
        [
            "as recorded",
            "frobnicate:1",
            "expandable_segments:True,max_split_size_mb:128",
            "scale activations=2,temporaries=2",
            "expandable_segments:True,max_split_size_mb:128 + scale activations=2,temporaries=2"
        ]
    );
    let rows = w["scenarios"].as_array().unwrap();
    assert!(rows[1]["refused"].as_str().unwrap().contains("frobnicate"));
    assert_eq!(rows[1]["peak_reserved_bytes"], Value::Null);
    assert_eq!(u(&rows[0]["capacity_bytes"]), 1 << 30);
    // Twice the activations and temporaries need more than the recorded peak.
    assert!(u(&rows[3]["peak_allocated_bytes"]) > u(&rows[0]["peak_allocated_bytes"]));
    // The recorded peak (108 MiB) is the fixture's.
    assert_eq!(u(&rows[0]["peak_reserved_bytes"]), 108 << 20);

    // Errors: a file without PyTorch's allocator, a role that does not exist.
    let none = memsnap(&["whatif", &fixture("README.md")]);
    assert_eq!(none.status.code(), Some(2));
    let bad = memsnap(&["whatif", &leak, "--scale", "activation=2"]);
    assert_eq!(bad.status.code(), Some(2));
    let said = String::from_utf8_lossy(&bad.stderr);
    assert!(said.contains("`activation` is not a role"), "{said}");
}

#[test]
fn a_file_of_stream_ordered_tensors_replays_through_the_caching_allocator() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tensors.pickle");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/chromium/gen_snapshot.py");
    let Ok(o) = Command::new("python3")
        .arg(script)
        .arg(&file)
        .args(["--events", "20000", "--torch-tensors", "--live", "300"])
        .output()
    else {
        common::skip("python3 is not installed");
        return;
    };
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let path = file.to_str().unwrap();
    let w = memsnap_json(&["whatif", "--json", path, "--device-memory", "80GiB"]);
    assert_eq!(w["recorded_settings"], "backend:cudaMallocAsync", "{w:#}");
    let rows = w["scenarios"].as_array().unwrap();
    // As recorded (no cache) reproduces the tensors' peak; the caching allocator holds at
    // least what they asked for, in segments.
    assert_eq!(w["checks"][0]["reproduced"], true, "{w:#}");
    assert_eq!(rows[1]["setting"], "backend:native");
    assert!(u(&rows[1]["peak_reserved_bytes"]) >= u(&rows[0]["peak_reserved_bytes"]));
    assert!(u(&rows[1]["segments_at_peak"]) > 0);
    assert_eq!(
        rows[2]["setting"],
        "backend:native,expandable_segments:True"
    );
    assert_eq!(rows[2]["fits"], true);
}

//! `memsnap check`: every PyTorch fixture follows the viewer's rules; a snapshot that breaks
//! one (a block outside any segment's tiling) is reported with exit status 1.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

fn memsnap(args: &[&str]) -> std::process::Output {
    Command::new(common::memsnap_bin())
        .args(args)
        .output()
        .expect("run memsnap")
}

fn fixtures() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torch");
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pickle"))
        .collect();
    v.sort();
    v
}

#[test]
fn every_pytorch_fixture_passes() {
    let files = fixtures();
    assert_eq!(files.len(), 6);
    let args: Vec<&str> = std::iter::once("check")
        .chain(files.iter().map(|p| p.to_str().unwrap()))
        .collect();
    let out = memsnap(&args);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        text.lines().filter(|l| l.contains(": ok (")).count(),
        6,
        "{text}"
    );
}

#[test]
fn a_broken_snapshot_is_reported_with_exit_1() {
    // One segment whose single block is smaller than the segment: blocks must tile it.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.pickle");
    let script = r#"
import pickle, sys
seg = {"device": 0, "address": 4096, "total_size": 8192, "allocated_size": 4096,
       "active_size": 4096, "requested_size": 4096, "stream": 0, "segment_type": "large",
       "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
       "blocks": [{"address": 4096, "size": 4096, "requested_size": 4096,
                   "state": "active_allocated", "frames": []}]}
pickle.dump({"segments": [seg], "device_traces": [[]]}, open(sys.argv[1], "wb"), protocol=4)
"#;
    let ok = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&path)
        .status()
        .unwrap();
    assert!(ok.success());
    let out = memsnap(&["check", path.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("broken.pickle: ") && text.contains("violation"),
        "{text}"
    );
}

#[test]
fn an_unreadable_file_is_exit_2_with_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notes.txt");
    std::fs::write(&path, "not a pickle").unwrap();
    let out = memsnap(&["check", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("notes.txt"));
}

/// Inputs that once cost gigabytes (kept as fuzzing seeds in fuzz/seeds/read_snapshot/):
/// every command that reads a file refuses them with the budget in the message, exit 2.
#[test]
fn inputs_that_would_explode_in_memory_are_refused_by_every_command() {
    let seeds = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/read_snapshot");
    let dir = tempfile::tempdir().unwrap();
    // 8 MB of empty-list opcodes: past the value budget after about 0.6 MB.
    let flood = dir.path().join("flood.pickle");
    let mut bytes = vec![0x80, 4];
    bytes.resize(2 + (8 << 20), b']');
    bytes.push(b'.');
    std::fs::write(&flood, bytes).unwrap();
    let cases = [
        (seeds.join("billion-laughs-memsnap.pickle"), "16 MiB"),
        (
            seeds.join("billion-laughs-allocator-settings.pickle"),
            "16 MiB",
        ),
        (flood, "values plus one per 4 bytes"),
    ];
    for (file, budget) in &cases {
        let f = file.to_str().unwrap();
        let out_html = dir.path().join("v.html");
        let out_svg = dir.path().join("f.svg");
        for args in [
            vec!["summary", f],
            vec!["check", f],
            vec!["diff", f, f],
            vec!["view", f, "-o", out_html.to_str().unwrap()],
            vec!["flamegraph", f, "-o", out_svg.to_str().unwrap()],
        ] {
            let out = memsnap(&args);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
            assert!(err.contains("not a memory snapshot"), "{args:?}: {err}");
            assert!(err.contains(budget), "{args:?}: {err}");
        }
    }
}

/// Writes `value` (a Python expression) with `pickle.dump(..., protocol=protocol)`.
fn python_pickle(path: &Path, value: &str, protocol: u8) {
    let script = format!(
        "import pickle, sys\npickle.dump({value}, open(sys.argv[1], 'wb'), protocol={protocol})"
    );
    let ok = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(path)
        .status()
        .unwrap();
    assert!(ok.success());
}

/// A valid one-allocation history whose `alloc` has the frames `frames` (Python).
fn with_frames(frames: &str) -> String {
    format!(
        r#"{{"segments": [{{"device": 0, "address": 4096, "total_size": 512, "stream": 0,
             "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
             "frames": [], "blocks": [{{"address": 4096, "size": 512, "requested_size": 512,
             "state": "inactive", "frames": []}}]}}],
           "device_traces": [[
             {{"action": "segment_alloc", "addr": 4096, "size": 512, "stream": 0, "time_us": 0, "frames": []}},
             {{"action": "alloc", "addr": 4096, "size": 512, "stream": 0, "time_us": 1, "frames": {frames}}},
             {{"action": "free_requested", "addr": 4096, "size": 512, "stream": 0, "time_us": 2, "frames": []}},
             {{"action": "free_completed", "addr": 4096, "size": 512, "stream": 0, "time_us": 3, "frames": []}}]]}}"#
    )
}

/// The viewer rejects protocol 5 and reads frames as `{name, filename, line}`: `check`
/// reports both (it passed them before), and passes the same file written right.
#[test]
fn protocol_5_and_malformed_frames_are_violations() {
    let dir = tempfile::tempdir().unwrap();
    let good_frames = r#"[{"name": "f", "filename": "a.py", "line": 3}]"#;
    let cases = [
        ("good.pickle", with_frames(good_frames), 4, None),
        (
            "protocol5.pickle",
            with_frames(good_frames),
            5,
            Some("pickle protocol 5"),
        ),
        (
            "int-frame.pickle",
            with_frames("[7]"),
            4,
            Some("a frame that is an integer (7)"),
        ),
        (
            "list-frame.pickle",
            with_frames(r#"[["a.py", 3]]"#),
            4,
            Some("a frame that is a list"),
        ),
        (
            "no-filename.pickle",
            with_frames(r#"[{"name": "f", "line": 3}]"#),
            4,
            Some("without a str `filename`"),
        ),
        (
            "no-line.pickle",
            with_frames(r#"[{"name": "f", "filename": "a.py"}]"#),
            4,
            Some("without an int `line`"),
        ),
    ];
    for (name, value, protocol, problem) in cases {
        let path = dir.path().join(name);
        python_pickle(&path, &value, protocol);
        let out = memsnap(&["check", path.to_str().unwrap()]);
        let text = String::from_utf8_lossy(&out.stdout);
        match problem {
            None => assert_eq!(out.status.code(), Some(0), "{name}: {text}"),
            Some(p) => {
                assert_eq!(out.status.code(), Some(1), "{name}: {text}");
                assert!(
                    text.contains("1 violation(s)") && text.contains(p),
                    "{name}: {text}"
                );
            }
        }
    }
}

/// `check A B C` checks every file, one report each, even past one it cannot read: exit
/// 2 when any is unreadable, else 1 when any breaks a rule.
#[test]
fn check_reports_every_file_and_fails_if_any_failed() {
    let dir = tempfile::tempdir().unwrap();
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, "not a pickle").unwrap();
    let p5 = dir.path().join("protocol5.pickle");
    python_pickle(&p5, r#"{"segments": [], "device_traces": [[]]}"#, 5);
    let oom = fixtures()
        .into_iter()
        .find(|p| p.ends_with("torch-oom.pickle"))
        .unwrap();
    let run = |files: &[&Path]| {
        let mut args = vec!["check"];
        args.extend(files.iter().map(|p| p.to_str().unwrap()));
        let out = memsnap(&args);
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, text, err) = run(&[&oom, &notes, &p5, &oom]);
    assert_eq!(code, Some(2), "{text}{err}");
    assert_eq!(text.matches("torch-oom.pickle: ok").count(), 2, "{text}");
    assert!(text.contains("protocol5.pickle: 1 violation(s)"), "{text}");
    assert!(
        err.contains("notes.txt") && err.lines().count() == 1,
        "{err}"
    );
    let (code, text, _) = run(&[&p5, &oom]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("torch-oom.pickle: ok"), "{text}");
}

/// One `device_traces` list per device (docs/FORMAT.md, "Producer's rules", rule 2): an
/// empty snapshot with one or two empty lists has that many devices in `check`,
/// `summary` and `summary --json` alike (summary said 0).
#[test]
fn summary_and_check_count_the_devices_of_an_empty_snapshot_alike() {
    let dir = tempfile::tempdir().unwrap();
    for (n, lists) in [(0, "[]"), (1, "[[]]"), (2, "[[], []]")] {
        let path = dir.path().join(format!("empty{n}.pickle"));
        python_pickle(
            &path,
            &format!(r#"{{"segments": [], "device_traces": {lists}}}"#),
            4,
        );
        let f = path.to_str().unwrap();
        let check = String::from_utf8_lossy(&memsnap(&["check", f]).stdout).into_owned();
        assert!(check.contains(&format!("on {n} device(s)")), "{check}");
        let summary = String::from_utf8_lossy(&memsnap(&["summary", f]).stdout).into_owned();
        let word = if n == 1 { "device" } else { "devices" };
        assert!(summary.contains(&format!("{n} {word},")), "{summary}");
        let json: serde_json::Value =
            serde_json::from_slice(&memsnap(&["summary", "--json", f]).stdout).unwrap();
        assert_eq!(json["devices"].as_array().unwrap().len(), n, "{json}");
    }
}

/// What a memsnap file says it misses comes first, a line each where not 0, and is no
/// violation: the file still passes.
#[test]
fn check_names_what_a_file_misses_first() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("missing.pickle");
    let meta = |without: u32, unresolved: u32| {
        format!(
            r#"{{"segments": [], "device_traces": [[]], "memsnap": {{"dropped_events": 0,
                 "events_without_stack": {without}, "frames_unresolved": {unresolved}}}}}"#
        )
    };
    python_pickle(&path, &meta(1, 3), 4);
    let f = path.to_str().unwrap();
    let out = memsnap(&["check", f]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(
        lines[0].ends_with("INCOMPLETE: 1 event recorded without a stack"),
        "{text}"
    );
    assert!(
        lines[1].ends_with(
            "INCOMPLETE: 3 stack frames unresolved (code gone before memsnap read it): kept \
             as ?? or with line 0"
        ),
        "{text}"
    );
    assert!(lines[2].contains(": ok ("), "{text}");
    // Nothing missed: the one line.
    python_pickle(&path, &meta(0, 0), 4);
    let text = String::from_utf8_lossy(&memsnap(&["check", f]).stdout).into_owned();
    assert_eq!(text.lines().count(), 1, "{text}");
}

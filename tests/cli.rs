//! The `memsnap` binary on PyTorch's reference snapshots: exact summary/diff text (golden
//! files in tests/golden/, rewritten with `BLESS=1`), JSON shapes, bad input,
//! ranks, flamegraph, and the HTML page (self-contained); and on snapshots built in the
//! tests: the live set at a moment (`--at`), `--ignore`/`--callers`, and the labels.
//!
//! The tests named `chromium_*` load pages in headless Chromium. They are `#[ignore]`d, so a
//! plain `cargo test` reports them as ignored; scripts/test.sh runs them
//! (`cargo test --test cli -- --ignored chromium_`) when Chromium is installed.
//!
//! Expected numbers that depend on the fixture files come from
//! tests/fixtures/torch/fixtures.json (written with the files by
//! scripts/gpu/make_fixtures.py), and expected Python frames from the script's
//! `# FIXTURE-ANCHOR:` comments: new fixtures need new goldens, not new test code.

mod common;

use memsnap_format::model::{Action, Frame, Meta, Segment, Snapshot, StackId, TraceEntry};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;

const FIXTURES: &[&str] = &[
    "torch-python-stacks",
    "torch-expandable-segments",
    "torch-oom",
    "torch-leak-step3",
    "torch-leak-step11",
    "torch-transformer-all-stacks",
];

/// The script that makes the fixtures, as their frames name it (relative to the repository).
const SCRIPT: &str = "scripts/gpu/make_fixtures.py";

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn fixture(name: &str) -> PathBuf {
    repo().join(format!("tests/fixtures/torch/{name}.pickle"))
}

/// The line of the fixture script that ends in `# FIXTURE-ANCHOR: {name}`, with the function
/// it is in: (`scripts/gpu/make_fixtures.py:N`, `function`).
fn anchor(name: &str) -> (String, String) {
    let text = std::fs::read_to_string(repo().join(SCRIPT)).expect("read the fixture script");
    let marker = format!("# FIXTURE-ANCHOR: {name}");
    let mut func = "<module>";
    let mut found = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if let Some(rest) = line.strip_prefix("def ") {
            func = rest.split('(').next().unwrap();
        }
        if line.ends_with(&marker) {
            found.push((format!("{SCRIPT}:{}", i + 1), func.to_string()));
        }
    }
    assert_eq!(
        found.len(),
        1,
        "{SCRIPT}: `{marker}` on {} lines",
        found.len()
    );
    found.pop().unwrap()
}

/// The anchor as `memsnap` names a Python site: `scripts/gpu/make_fixtures.py:N (function)`.
fn anchor_site(name: &str) -> String {
    let (at, func) = anchor(name);
    format!("{at} ({func})")
}

/// The line the leak fixture leaks from (`loss = model(...)`).
fn leak_site() -> String {
    anchor_site("leak loss")
}

/// What Python's pickle.load found in a fixture (tests/fixtures/torch/fixtures.json).
fn counts(name: &str) -> serde_json::Value {
    let path = repo().join("tests/fixtures/torch/fixtures.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let c = v["files"][format!("{name}.pickle")].clone();
    assert!(
        c.is_object(),
        "{}: no entry for {name}.pickle",
        path.display()
    );
    c
}

fn memsnap(args: &[&str]) -> Output {
    Command::new(common::memsnap_bin())
        .args(args)
        .output()
        .expect("run memsnap")
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).expect("utf-8 stdout")
}
fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Compares with tests/golden/NAME, or rewrites it when BLESS=1.
fn golden(name: &str, actual: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    if std::env::var("BLESS").as_deref() == Ok("1") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run with BLESS=1 to create it)", path.display()));
    assert!(
        expected == actual,
        "{name} differs from the golden file (BLESS=1 rewrites it)\n--- expected\n{expected}\n--- actual\n{actual}"
    );
}

#[test]
fn summary_text_of_every_fixture_matches_golden() {
    for f in FIXTURES {
        let o = memsnap(&["summary", fixture(f).to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(0), "{f}: {}", stderr(&o));
        golden(&format!("summary-{f}.txt"), &stdout(&o));
    }
}

#[test]
fn summary_json_shape_and_values() {
    let o = memsnap(&[
        "summary",
        "--json",
        "--top",
        "3",
        fixture("torch-oom").to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["producer"], "pytorch");
    assert!(v["dropped_events"].is_null());
    // 16 GiB tensors until the OOM: how many fit depends on the GPU (fixtures.json).
    let c = counts("torch-oom");
    let n = c["live_blocks"].as_i64().unwrap();
    assert!(n > 0);
    let d = &v["devices"][0];
    assert_eq!(d["device"], 0);
    assert_eq!(d["live_bytes"], n * (16 << 30));
    assert_eq!(d["live_bytes"], c["live_bytes"]);
    assert_eq!(d["live_blocks"], n);
    assert_eq!(d["reserved_bytes"], c["reserved_bytes"]);
    assert_eq!(d["segments"], c["segments"]);
    assert_eq!(d["history"]["events"], c["events"][0]);
    assert_eq!(d["history"]["start_live_requested_bytes"], 0);
    assert_eq!(d["libraries"][0]["library"], "torch");
    let top = d["top_sites"].as_array().unwrap();
    assert_eq!(top.len(), 1);
    assert_eq!(top[0]["site"], anchor_site("oom alloc"));
    assert_eq!(top[0]["kind"], "python");
    let oom = &d["ooms"][0];
    assert_eq!(oom["event"], c["ooms"][0]["event"]);
    assert_eq!(oom["requested_bytes"], 16i64 << 30);
    assert_eq!(oom["device_free_bytes"], c["ooms"][0]["device_free"]);
    assert_eq!(oom["site"], anchor_site("oom alloc"));
    assert_eq!(oom["live_allocations"], n);
    assert_eq!(oom["top_sites"][0]["count"], n);

    // Recording started after the transformer's parameters existed: the history starts from
    // a non-zero live state.
    let o = memsnap(&[
        "summary",
        "--json",
        fixture("torch-transformer-all-stacks").to_str().unwrap(),
    ]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let c = counts("torch-transformer-all-stacks");
    let h = &v["devices"][0]["history"];
    assert_eq!(h["events"], c["events"][0]);
    assert!(h["start_live_requested_bytes"].as_i64().unwrap() > 0);
    assert!(
        h["peak_live_requested_bytes"].as_i64().unwrap()
            > v["devices"][0]["live_requested_bytes"].as_i64().unwrap()
    );
    assert_eq!(v["devices"][0]["live_bytes"], c["live_bytes"]);
}

/// A pickle whose one trace entry is appended twice (once more through the memo): no known
/// writer does this, the reader cannot stream it, and `summary` reads it whole instead.
#[test]
fn summary_reads_a_file_that_cannot_be_streamed_whole() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hand/shared-entry.pickle");
    let o = memsnap(&["summary", "--json", path.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let h = &v["devices"][0]["history"];
    assert_eq!(h["events"], 2);
    // Two allocations of 9 bytes from nothing live at the end: the history started at -18.
    assert_eq!(h["start_live_requested_bytes"], -18);
}

#[test]
fn diff_of_the_leak_pair_points_at_the_leaking_line() {
    let (a, b) = (fixture("torch-leak-step3"), fixture("torch-leak-step11"));
    let o = memsnap(&["diff", a.to_str().unwrap(), b.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    golden("diff-leak.txt", &stdout(&o));
    let leak = leak_site();
    let text = stdout(&o);
    let first_row = text
        .lines()
        .skip_while(|l| !l.starts_with("grew"))
        .nth(2)
        .unwrap();
    assert!(first_row.ends_with(&leak), "{first_row}");

    let o = memsnap(&["diff", "--json", a.to_str().unwrap(), b.to_str().unwrap()]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["grew"][0]["site"], leak);
    // Eight more steps kept eight more scalar losses alive.
    assert_eq!(v["grew"][0]["count_growth"], 8);
    assert_eq!(v["total_growth_bytes"], v["grew"][0]["growth_bytes"]);
    assert_eq!(v["total_growth_bytes"], 4096);

    let o = memsnap(&[
        "diff",
        "--fail-above",
        "1000",
        a.to_str().unwrap(),
        b.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(stdout(&o).contains("FAIL: growth +4.0 KiB exceeds the limit 1000 B"));
    let o = memsnap(&[
        "diff",
        "--fail-above",
        "1MiB",
        a.to_str().unwrap(),
        b.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0));
    // Reversed, the leak shows up as shrinking.
    let o = memsnap(&["diff", "--json", b.to_str().unwrap(), a.to_str().unwrap()]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["shrank"][0]["site"], leak);
    assert_eq!(v["total_growth_bytes"], -4096);
}

#[test]
fn bad_inputs_exit_2_with_one_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let real = std::fs::read(fixture("torch-leak-step3")).unwrap();
    let mut rng: u64 = 42;
    let random: Vec<u8> = (0..4096)
        .map(|_| {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (rng >> 33) as u8
        })
        .collect();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "truncated.pickle",
            real[..real.len() / 2].to_vec(),
            "truncated",
        ),
        ("random.pickle", random, "not a pickle snapshot"),
        (
            "text.pickle",
            b"segments: []\n".to_vec(),
            "not a pickle snapshot",
        ),
        ("empty.pickle", Vec::new(), "empty file"),
        (
            "random-after-header.pickle",
            [&[0x80u8, 4][..], b"\xff\xfe\xfd"].concat(),
            "unknown pickle opcode 0xff at byte 2",
        ),
    ];
    for (name, bytes, why) in cases {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        for cmd in ["summary", "flamegraph", "view"] {
            let mut args = vec![cmd, p.to_str().unwrap()];
            if cmd != "summary" {
                args.extend(["-o", "/dev/null"]);
            }
            let o = memsnap(&args);
            let err = stderr(&o);
            assert_eq!(o.status.code(), Some(2), "{cmd} {name}: {err}");
            assert!(
                err.contains(name) && err.contains(why),
                "{cmd} {name}: {err}"
            );
            assert!(!err.contains("panicked"), "{err}");
            assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        }
    }
    let missing = dir.path().join("missing.pickle");
    let o = memsnap(&["summary", missing.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("missing.pickle") && stderr(&o).contains("No such file"),
        "{}",
        stderr(&o)
    );
    // Diff names the bad one of the two.
    let o = memsnap(&[
        "diff",
        fixture("torch-oom").to_str().unwrap(),
        missing.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("missing.pickle"));
    // Bad arguments are errors too.
    assert_eq!(memsnap(&["summary"]).status.code(), Some(2));
    assert_eq!(
        memsnap(&["diff", "a", "b", "--fail-above", "lots"])
            .status
            .code(),
        Some(2)
    );
}

#[test]
fn closed_stdout_is_not_an_error() {
    let mut child = Command::new(common::memsnap_bin())
        .args([
            "summary",
            "--json",
            fixture("torch-transformer-all-stacks").to_str().unwrap(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(!stderr(&o).contains("panicked"));
}

#[test]
fn ranks_marks_the_rank_that_stands_out() {
    let dir = tempfile::tempdir().unwrap();
    for (name, src) in [
        ("job-r0-p1.pickle", "torch-leak-step3"),
        ("job-r1-p2.pickle", "torch-leak-step11"),
        ("job-r2-p3.pickle", "torch-leak-step3"),
        ("job-r3-p4.pickle", "torch-oom"),
    ] {
        std::fs::copy(fixture(src), dir.path().join(name)).unwrap();
    }
    std::fs::write(dir.path().join("notes.txt"), "not a snapshot").unwrap();
    let o = memsnap(&["ranks", "--json", dir.path().to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 4);
    let ids: Vec<i64> = ranks.iter().map(|r| r["rank"].as_i64().unwrap()).collect();
    assert_eq!(ids, [0, 1, 2, 3]);
    let marked: Vec<bool> = ranks
        .iter()
        .map(|r| r["outlier"].as_bool().unwrap())
        .collect();
    assert_eq!(marked, [false, false, false, true]);
    assert_eq!(ranks[3]["ooms"], 1);
    assert_eq!(ranks[3]["live_bytes"], counts("torch-oom")["live_bytes"]);
    assert_eq!(ranks[0]["top_site"], leak_site());
    let reasons = ranks[3]["reasons"].as_array().unwrap();
    assert!(
        reasons
            .iter()
            .any(|r| r.as_str().unwrap().starts_with("OOM")),
        "{reasons:?}"
    );

    let o = memsnap(&["ranks", dir.path().to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0));
    let t = stdout(&o);
    let line3 = t
        .lines()
        .find(|l| l.trim_start().starts_with("3 "))
        .unwrap();
    assert!(
        line3.contains("!!") && line3.contains("job-r3-p4.pickle"),
        "{t}"
    );

    let empty = tempfile::tempdir().unwrap();
    let o = memsnap(&["ranks", empty.path().to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("no *.pickle"));
}

#[test]
fn flamegraph_svg_names_the_frames() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("f.svg");
    let o = memsnap(&[
        "flamegraph",
        fixture("torch-leak-step11").to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let svg = std::fs::read_to_string(&out).unwrap();
    assert!(svg.starts_with("<?xml") && svg.contains("<svg"));
    let (leak_line, _) = anchor("leak loss");
    assert!(
        svg.contains(&leak_line),
        "leaking line {leak_line} missing from the SVG"
    );
    assert!(svg.contains("torch/nn/modules/module.py"));

    let out = dir.path().join("t.svg");
    let o = memsnap(&[
        "flamegraph",
        fixture("torch-transformer-all-stacks").to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let svg = std::fs::read_to_string(&out).unwrap();
    // The last step's output is still referenced when the snapshot is taken.
    let (forward, _) = anchor("transformer forward");
    assert!(svg.contains(&forward), "{forward} missing from the SVG");
    // PyTorch's filtered frames stay out.
    assert!(!svg.contains("CapturedTraceback::gather"));
}

/// The JSON island of a page written by `memsnap view`.
fn page_data_of(html: &str) -> Value {
    let start = html.find("id=\"data\">").unwrap() + "id=\"data\">".len();
    let end = start + html[start..].find("</script>").unwrap();
    serde_json::from_str(&html[start..end]).unwrap()
}

fn page_data(page: &Path) -> Value {
    page_data_of(&std::fs::read_to_string(page).unwrap())
}

fn write_view(name: &str, dir: &Path) -> (PathBuf, String) {
    let out = dir.join(format!("{name}.html"));
    let o = memsnap(&[
        "view",
        fixture(name).to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{name}: {}", stderr(&o));
    let html = std::fs::read_to_string(&out).unwrap();
    (out, html)
}

#[test]
fn view_is_one_self_contained_file() {
    let dir = tempfile::tempdir().unwrap();
    for f in FIXTURES {
        let (_, html) = write_view(f, dir.path());
        assert!(
            !html.contains("http://") && !html.contains("https://"),
            "{f}: network reference"
        );
        assert!(
            !html.contains("<script src") && !html.contains("<link"),
            "{f}: external resource"
        );
        assert!(!html.contains("__MEMSNAP_"), "{f}: placeholder left");
        // The data island parses and holds what the summary reports.
        let v = page_data_of(&html);
        let d = &v["devices"][0];
        assert_eq!(
            d["ev_site"].as_array().unwrap().len(),
            d["ev_delta"].as_array().unwrap().len()
        );
        let c = counts(f);
        if *f == "torch-oom" {
            assert_eq!(d["ooms"][0], c["ooms"][0]["event"]);
            assert_eq!(
                d["segments"].as_array().unwrap().len() as u64,
                c["segments"]
            );
        }
        if *f == "torch-leak-step11" {
            assert_eq!(
                d["ev_site"].as_array().unwrap().len() as u64,
                c["events"][0]
            );
        }
    }
}

/// Headless Chromium on PATH; the `chromium_*` tests fail without it (they run only when
/// asked for by name, after scripts/test.sh found it).
fn chromium() -> PathBuf {
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        for dir in std::env::var("PATH").unwrap_or_default().split(':') {
            let p = Path::new(dir).join(name);
            if p.is_file() {
                return p;
            }
        }
    }
    panic!(
        "chromium, chromium-browser or google-chrome not found on PATH (apt-get install -y chromium)"
    );
}

/// Loads `page` (with the URL fragment `fragment`) in headless Chromium and checks that it
/// finished drawing: the page marks <body> with data-ok="1" after drawing, or
/// data-error="..." on any JS error (window.onerror). Returns the dumped DOM.
fn load_in_chromium(name: &str, page: &Path, fragment: &str) -> String {
    let profile = tempfile::tempdir().unwrap();
    let o = Command::new("timeout")
        .arg("120")
        .arg(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg("--dump-dom")
        .arg(format!("file://{}{fragment}", page.display()))
        .output()
        .expect("run chromium");
    let dom = stdout(&o);
    let body = dom
        .find("<body")
        .map(|i| &dom[i..i + dom[i..].find('>').unwrap_or(0)])
        .unwrap_or_else(|| {
            panic!(
                "{name}: no <body> in the dumped DOM ({:?})\n{}",
                o.status,
                stderr(&o)
            )
        });
    assert!(
        !body.contains("data-error"),
        "{name}: the page reported an error: {body}"
    );
    assert!(
        body.contains("data-ok=\"1\""),
        "{name}: the page did not finish drawing: {body}"
    );
    dom
}

#[test]
#[ignore = "needs headless Chromium; scripts/test.sh runs it when chromium is installed"]
fn chromium_view_of_the_fixtures_loads_without_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (search, _) = anchor("transformer forward");
    for f in [
        "torch-oom",
        "torch-transformer-all-stacks",
        "torch-expandable-segments",
    ] {
        let (page, _) = write_view(f, dir.path());
        // One page opens with a search applied (`#q=`), which redraws everything.
        let fragment = if f == "torch-transformer-all-stacks" {
            format!("#q={search}")
        } else {
            String::new()
        };
        let dom = load_in_chromium(f, &page, &fragment);
        assert!(dom.contains("peak "), "{f}: status line missing");
    }
}

/// Runs tests/chromium/gen_snapshot.py (memsnap-style files); `None` without python3.
fn generate(out: &Path, args: &[&str]) -> Option<()> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/chromium/gen_snapshot.py");
    let o = Command::new("python3")
        .arg(script)
        .arg(out)
        .args(args)
        .output()
        .ok()?;
    assert!(o.status.success(), "gen_snapshot.py: {}", stderr(&o));
    Some(())
}

#[test]
fn memsnap_files_metadata_libraries_and_apis() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.pickle");
    if generate(
        &a,
        &[
            "--events",
            "30000",
            "--rank",
            "5",
            "--dropped",
            "7",
            "--stacks",
            "400",
        ],
    )
    .is_none()
    {
        common::skip("python3 missing");
        return;
    }
    let o = memsnap(&["summary", "--json", a.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["producer"], "memsnap");
    assert_eq!(v["dropped_events"], 7);
    assert_eq!(v["metadata"]["rank"], 5);
    assert_eq!(v["metadata"]["host"], "gen-host");
    let d = &v["devices"][0];
    // The generator writes whole operations (2 or 3 events), so it may pass the target by 2.
    let events = d["history"]["events"].as_i64().unwrap();
    assert!((30000..30003).contains(&events), "{events}");
    let libs: Vec<&str> = d["libraries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["library"].as_str().unwrap())
        .collect();
    for l in ["torch", "nccl", "cublas", "app"] {
        assert!(libs.contains(&l), "{l} missing from {libs:?}");
    }
    let apis: Vec<&str> = d["events_by_api"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["api"].as_str().unwrap())
        .collect();
    assert!(
        apis.contains(&"cudaFree") && apis.contains(&"cuMemAlloc_v2"),
        "{apis:?}"
    );
    // Native-only stacks (the generator's "app" frames) get a native site.
    let o = memsnap(&["summary", "--top", "200", a.to_str().unwrap()]);
    assert!(
        stdout(&o).contains("launch_kernels (kernels.cu:88)"),
        "{}",
        stdout(&o)
    );
    assert_eq!(
        stdout(&o).lines().nth(1),
        Some(
            "INCOMPLETE: 7 events not recorded (memsnap's writer stopped early); live memory \
             below may be off by what they did"
        ),
        "the loss is on the second line"
    );

    // ranks: the rank comes from the metadata when the name has none.
    let b = dir.path().join("b.pickle");
    generate(
        &b,
        &[
            "--events", "30000", "--rank", "9", "--stacks", "400", "--seed", "2",
        ],
    )
    .unwrap();
    let o = memsnap(&["ranks", "--json", dir.path().to_str().unwrap()]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let ids: Vec<i64> = v["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["rank"].as_i64().unwrap())
        .collect();
    assert_eq!(ids, [5, 9]);
}

/// A page of 200 000 generated events; `None` without python3.
fn large_generated_view(dir: &Path) -> Option<PathBuf> {
    let snap = dir.join("big.pickle");
    generate(&snap, &["--events", "200000", "--stacks", "2000"])?;
    let page = dir.join("big.html");
    let o = memsnap(&["view", snap.to_str().unwrap(), "-o", page.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(html.contains("id=\"data\">") && !html.contains("__MEMSNAP_"));
    Some(page)
}

#[test]
fn view_of_a_large_generated_snapshot_is_written() {
    let dir = tempfile::tempdir().unwrap();
    if large_generated_view(dir.path()).is_none() {
        common::skip("python3 missing");
    }
}

#[test]
#[ignore = "needs headless Chromium; scripts/test.sh runs it when chromium is installed"]
fn chromium_view_of_a_large_generated_snapshot_loads() {
    let dir = tempfile::tempdir().unwrap();
    let page =
        large_generated_view(dir.path()).expect("python3 is needed to generate the snapshot");
    load_in_chromium("big.html", &page, "");
}

// ------------------------------------------------------------------------------------
// The moment that matters (`--at`), attribution (`--ignore`, `--callers`) and honest
// labels, on snapshots built here with the format crate's own writer: the exact live set
// at the peak, at the OOM, at an event and at a time; the site chosen with `--ignore` and
// shown with `--callers`; call counts beside event counts, the history cap, dropped events
// only when there are some, sizes in MB (10^6) and MiB (2^20), what `view` and
// `flamegraph` wrote, and `ranks` going on past an unreadable rank.

fn json(o: &Output) -> Value {
    assert_eq!(o.status.code(), Some(0), "{}", stderr(o));
    serde_json::from_slice(&o.stdout).expect("JSON on stdout")
}

fn frame(name: &str, filename: &str, line: i64) -> Frame {
    Frame {
        name: name.into(),
        filename: filename.into(),
        line,
    }
}

/// The program of the report: every allocation goes through `cuda_alloc` in pyalloc.py;
/// `remember_me` keeps its memory, `forget_me` frees it again.
const KEPT: StackId = 0;
const TEMP: StackId = 1;
const SITE_HELPER: &str = "/srv/app/pyalloc.py:12 (cuda_alloc)";
const SITE_KEPT: &str = "/srv/app/main.py:30 (remember_me)";
const SITE_TEMP: &str = "/srv/app/main.py:35 (forget_me)";
const SITE_MODULE: &str = "/srv/app/main.py:41 (<module>)";

/// A calling line of `cuda_alloc` as a site: called from two lines, it is a helper.
fn via_helper(site: &str) -> String {
    format!("{site} via {SITE_HELPER}")
}

/// A memsnap-style snapshot built call by call: `cudaMalloc` is `segment_alloc` + `alloc`,
/// `cudaFree` is `free_requested` + `free_completed` + `segment_free`, as the recorder
/// writes them.
struct Recording {
    trace: Vec<TraceEntry>,
    live: Vec<(i64, i64, StackId)>,
    time_us: i64,
    calls: (i64, i64),
}

impl Recording {
    fn new() -> Self {
        Recording {
            trace: Vec::new(),
            live: Vec::new(),
            time_us: 1_700_000_000_000_000,
            calls: (0, 0),
        }
    }

    fn event(&mut self, action: Action, addr: i64, size: i64, stack: StackId, api: &str) {
        self.trace.push(TraceEntry {
            action,
            addr,
            size,
            stream: 0,
            time_us: self.time_us,
            stack: Some(stack),
            device_free: None,
            user_metadata: Some(Arc::from(api)),
        });
    }

    /// One call, 1 ms after the previous one.
    fn malloc(&mut self, addr: i64, size: i64, stack: StackId) -> &mut Self {
        self.time_us += 1000;
        self.calls.0 += 1;
        self.event(Action::SegmentAlloc, addr, size, stack, "cudaMalloc");
        self.event(Action::Alloc, addr, size, stack, "cudaMalloc");
        self.live.push((addr, size, stack));
        self
    }

    fn free(&mut self, addr: i64) -> &mut Self {
        self.time_us += 1000;
        self.calls.1 += 1;
        let i = self.live.iter().position(|b| b.0 == addr).expect("live");
        let (_, size, stack) = self.live.remove(i);
        for action in [
            Action::FreeRequested,
            Action::FreeCompleted,
            Action::SegmentFree,
        ] {
            self.event(action, addr, size, stack, "cudaFree");
        }
        self
    }

    fn oom(&mut self, size: i64) -> &mut Self {
        self.time_us += 1000;
        self.event(Action::Oom, 0, size, TEMP, "cudaMalloc");
        self.trace.last_mut().unwrap().device_free = Some(1 << 20);
        self
    }

    /// The snapshot; the history keeps only the newest `kept` events (all when `None`),
    /// and the metadata says how many the cap dropped.
    fn snapshot(&self, kept: Option<usize>) -> Snapshot {
        let helper = frame("cuda_alloc", "/srv/app/pyalloc.py", 12);
        let frames = vec![
            frame("cudaMalloc", "/usr/lib/libcudart.so.13", 0),
            helper,
            frame("remember_me", "/srv/app/main.py", 30),
            frame("forget_me", "/srv/app/main.py", 35),
            frame("<module>", "/srv/app/main.py", 41),
        ];
        let keep = kept.unwrap_or(self.trace.len()).min(self.trace.len());
        let dropped = self.trace.len() - keep;
        let int = |k: &str, v: i64| (k.to_string(), Meta::Int(v));
        Snapshot {
            frames,
            stacks: vec![vec![0, 1, 2, 4], vec![0, 1, 3, 4]],
            segments: self
                .live
                .iter()
                .map(|&(addr, size, stack)| Segment::one_allocation(0, addr, size, Some(stack)))
                .collect(),
            device_traces: vec![self.trace[dropped..].to_vec()],
            allocator_settings: vec![],
            memsnap: vec![
                ("version".into(), Meta::Str("test".into())),
                int("dropped_events", 0),
                int("events_without_stack", 0),
                int("frames_unresolved", 0),
                (
                    "api_calls".into(),
                    Meta::Dict(vec![
                        int("cudaMalloc", self.calls.0),
                        int("cudaFree", self.calls.1),
                    ]),
                ),
                (
                    "devices".into(),
                    Meta::List(vec![Meta::Dict(vec![
                        int("device", 0),
                        int("history_dropped", dropped as i64),
                    ])]),
                ),
            ],
            step_marks: vec![],
        }
    }
}

fn write(dir: &Path, name: &str, snap: &Snapshot) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, memsnap_format::pickle_write::to_bytes(snap)).unwrap();
    path
}

/// Remembers 1000 B, then 5000 B twice held and freed (the peak), then 1000 B more.
fn helper_program() -> Recording {
    let mut r = Recording::new();
    r.malloc(0x1000, 1000, KEPT)
        .malloc(0x2000, 5000, TEMP)
        .malloc(0x3000, 5000, TEMP) // events 4, 5: the peak from event 5
        // The peak lasts until the first free completes: ties go to the latest event, the
        // free_requested (event 6).
        .free(0x2000)
        .free(0x3000)
        .malloc(0x4000, 1000, KEPT);
    r
}

/// [`helper_program`]'s snapshot, whole, as `DIR/helper.pickle`.
fn helper_file(dir: &Path) -> PathBuf {
    write(dir, "helper.pickle", &helper_program().snapshot(None))
}

/// (site, bytes, count) of a JSON site list.
fn rows(v: &Value, bytes: &str, count: &str) -> Vec<(String, i64, i64)> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["site"].as_str().unwrap().to_string(),
                r[bytes].as_i64().unwrap(),
                r[count].as_i64().unwrap(),
            )
        })
        .collect()
}

fn owned(v: &[(&str, i64, i64)]) -> Vec<(String, i64, i64)> {
    v.iter().map(|(s, b, c)| (s.to_string(), *b, *c)).collect()
}

#[test]
fn summary_answers_at_the_peak_by_default_with_the_end_beside_it() {
    let dir = tempfile::tempdir().unwrap();
    let snap = helper_file(dir.path());
    let p = snap.to_str().unwrap();
    let v = json(&memsnap(&["summary", "--json", p]));
    let at = &v["devices"][0]["at"];
    assert_eq!(at["moment"], "peak");
    assert_eq!(at["after_event"], 6);
    assert_eq!(at["since_first_event_us"], 3000);
    assert_eq!(at["live_requested_bytes"], 11000);
    assert_eq!(at["live_allocations"], 3);
    assert_eq!(at["reserved_bytes"], 11000);
    // Everything goes through the helper, from two lines: each is a site, the helper
    // named beside it.
    let (kept, temp) = (via_helper(SITE_KEPT), via_helper(SITE_TEMP));
    assert_eq!(
        rows(&at["sites"], "bytes", "count"),
        owned(&[(&temp, 10000, 2), (&kept, 1000, 1)])
    );
    assert_eq!(
        rows(&at["sites"], "end_bytes", "end_count"),
        owned(&[(&temp, 0, 0), (&kept, 2000, 2)])
    );
    assert_eq!(at["sites"][0]["via"], SITE_HELPER);
    // --at-helpers: the helper's own line is the one site.
    let off = json(&memsnap(&["summary", "--json", "--at-helpers", p]));
    assert_eq!(
        rows(&off["devices"][0]["at"]["sites"], "bytes", "count"),
        owned(&[(SITE_HELPER, 11000, 3)])
    );
    assert_eq!(off["devices"][0]["at"]["sites"][0]["via"], Value::Null);
    // The end's own figures are unchanged (block bytes).
    assert_eq!(v["devices"][0]["live_bytes"], 2000);

    let o = memsnap(&["summary", p]);
    let text = stdout(&o);
    assert!(
        text.contains(
            "  at        the peak (after event 6, +0.003 s): 10.7 KiB requested in 3 allocations, reserved 10.7 KiB\n"
        ),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "       at peak  allocs      at end  allocs  allocation site\n       9.8 KiB       2         0 B       0  {temp}\n        1000 B       1     2.0 KiB       2  {kept}\n"
        )),
        "{text}"
    );

    // --at end: the snapshot's own blocks, one column.
    let v = json(&memsnap(&["summary", "--json", "--at", "end", p]));
    let at = &v["devices"][0]["at"];
    assert_eq!(at["moment"], "end");
    assert_eq!(at["after_event"], Value::Null);
    assert_eq!(
        rows(&at["sites"], "bytes", "count"),
        owned(&[(&kept, 2000, 2)])
    );
}

#[test]
fn ignore_blames_the_caller_of_a_helper_everywhere() {
    let dir = tempfile::tempdir().unwrap();
    let snap = helper_file(dir.path());
    let p = snap.to_str().unwrap();
    let v = json(&memsnap(&[
        "summary",
        "--json",
        "--ignore",
        "pyalloc.py",
        p,
    ]));
    let at = &v["devices"][0]["at"];
    assert_eq!(
        rows(&at["sites"], "bytes", "count"),
        owned(&[(SITE_TEMP, 10000, 2), (SITE_KEPT, 1000, 1)])
    );
    assert_eq!(
        rows(&v["devices"][0]["top_sites"], "bytes", "count"),
        owned(&[(SITE_KEPT, 2000, 2)])
    );
    // --callers names the frames above the site.
    let v = json(&memsnap(&["summary", "--json", "--callers", "1", p]));
    let kept_chain = format!("{SITE_HELPER} <- {SITE_KEPT}");
    let temp_chain = format!("{SITE_HELPER} <- {SITE_TEMP}");
    assert_eq!(
        rows(&v["devices"][0]["at"]["sites"], "bytes", "count"),
        owned(&[(&temp_chain, 10000, 2), (&kept_chain, 1000, 1)])
    );
    let v = json(&memsnap(&[
        "summary",
        "--json",
        "--ignore",
        "pyalloc.py",
        "--callers",
        "3",
        p,
    ]));
    assert_eq!(
        v["devices"][0]["top_sites"][0]["site"],
        format!("{SITE_KEPT} <- {SITE_MODULE}")
    );

    // diff, ranks, flamegraph and view choose the same site.
    let empty = write(dir.path(), "empty.pickle", &Recording::new().snapshot(None));
    let v = json(&memsnap(&[
        "diff",
        "--json",
        "--ignore",
        "pyalloc.py",
        empty.to_str().unwrap(),
        p,
    ]));
    assert_eq!(v["grew"][0]["site"], SITE_KEPT);
    assert_eq!(v["grew"][0]["growth_bytes"], 2000);
    let ranks_dir = dir.path().join("ranks");
    std::fs::create_dir(&ranks_dir).unwrap();
    write(&ranks_dir, "r0.pickle", &helper_program().snapshot(None));
    let v = json(&memsnap(&[
        "ranks",
        "--json",
        "--ignore",
        "pyalloc.py",
        ranks_dir.to_str().unwrap(),
    ]));
    assert_eq!(v["ranks"][0]["top_site"], SITE_KEPT);
    let svg = dir.path().join("f.svg");
    let o = memsnap(&[
        "flamegraph",
        p,
        "-o",
        svg.to_str().unwrap(),
        "--ignore",
        "pyalloc.py",
        "--callers",
        "0",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let svg_text = std::fs::read_to_string(&svg).unwrap();
    assert!(svg_text.contains(SITE_TEMP) && svg_text.contains(SITE_KEPT));
    assert!(
        !svg_text.contains("cuda_alloc"),
        "the ignored frame is drawn"
    );
    let page = dir.path().join("p.html");
    let o = memsnap(&[
        "view",
        p,
        "-o",
        page.to_str().unwrap(),
        "--ignore",
        "pyalloc.py",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let data = page_data(&page);
    let sites: Vec<&str> = data["devices"][0]["sites"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["text"].as_str().unwrap())
        .collect();
    assert!(
        sites.contains(&SITE_TEMP) && sites.contains(&SITE_KEPT),
        "{sites:?}"
    );
}

#[test]
fn the_oom_is_the_default_moment_when_the_file_holds_one() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = Recording::new();
    r.malloc(0x1000, 1000, KEPT)
        .malloc(0x2000, 3000, TEMP)
        .oom(1 << 30) // event 4
        .free(0x2000)
        .malloc(0x3000, 8000, TEMP) // the peak, after the OOM
        .free(0x3000);
    let snap = write(dir.path(), "oom.pickle", &r.snapshot(None));
    let p = snap.to_str().unwrap();
    let v = json(&memsnap(&["summary", "--json", "--ignore", "pyalloc", p]));
    let at = &v["devices"][0]["at"];
    assert_eq!(at["moment"], "oom");
    assert_eq!(at["after_event"], 4);
    assert_eq!(
        rows(&at["sites"], "bytes", "count"),
        owned(&[(SITE_TEMP, 3000, 1), (SITE_KEPT, 1000, 1)])
    );
    let text = stdout(&memsnap(&["summary", "--ignore", "pyalloc", p]));
    assert!(
        text.contains("  at        the OOM (event 4, +0.002 s):"),
        "{text}"
    );
    assert!(
        text.contains("held by:  the sites listed above (at OOM)"),
        "{text}"
    );
    // The peak is still one --at away.
    let v = json(&memsnap(&["summary", "--json", "--at", "peak", p]));
    let at = &v["devices"][0]["at"];
    assert_eq!(at["moment"], "peak");
    assert_eq!(at["live_requested_bytes"], 9000);
    // An event number and a time: the state after that event.
    let v = json(&memsnap(&["summary", "--json", "--at", "1", p]));
    assert_eq!(v["devices"][0]["at"]["live_requested_bytes"], 1000);
    let v = json(&memsnap(&["summary", "--json", "--at", "1.5ms", p]));
    let at = &v["devices"][0]["at"];
    assert_eq!(
        (at["moment"].as_str(), at["after_event"].as_i64()),
        (Some("time"), Some(3))
    );
    assert_eq!(at["live_requested_bytes"], 4000);

    // A moment the file does not hold is an error naming why.
    let none = write(dir.path(), "none.pickle", &helper_program().snapshot(None));
    let o = memsnap(&["summary", "--at", "oom", none.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("no OOM in this device's history"),
        "{}",
        stderr(&o)
    );
    // explain refuses it alike, instead of showing the end in its place.
    let refused = memsnap(&["explain", "--at", "oom", none.to_str().unwrap()]);
    assert_eq!(refused.status.code(), Some(2), "{}", stdout(&refused));
    assert_eq!(stderr(&refused), stderr(&o));
    assert!(refused.stdout.is_empty(), "{}", stdout(&refused));
    // Over several files, one that reached the moment is enough.
    let o = memsnap(&["explain", "--at", "oom", none.to_str().unwrap(), p]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("ran out of memory first"),
        "{}",
        stdout(&o)
    );
    let o = memsnap(&["summary", "--at", "999", none.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("event 999 is past"), "{}", stderr(&o));
    let refused = memsnap(&["explain", "--at", "999", none.to_str().unwrap()]);
    assert_eq!(refused.status.code(), Some(2));
    assert_eq!(stderr(&refused), stderr(&o));
    let o = memsnap(&["summary", "--at", "soon", none.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("peak, oom, end"), "{}", stderr(&o));
}

/// `snap` with memsnap's identity of a process started without a rank: memsnap writes the
/// pid in `rank` then.
fn with_pid(mut snap: Snapshot, pid: i64) -> Snapshot {
    snap.memsnap.push(("pid".into(), Meta::Int(pid)));
    snap.memsnap
        .push(("rank".into(), Meta::Str(pid.to_string())));
    snap.memsnap
        .push(("host".into(), Meta::Str("node1".into())));
    snap
}

#[test]
fn a_file_without_a_rank_is_named_by_its_pid() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = Recording::new();
    r.malloc(0x1000, 1000, KEPT).oom(1 << 30);
    let oom = write(dir.path(), "a.pickle", &with_pid(r.snapshot(None), 4242));
    let other = write(
        dir.path(),
        "b.pickle",
        &with_pid(helper_program().snapshot(None), 4343),
    );
    let text = stdout(&memsnap(&[
        "explain",
        oom.to_str().unwrap(),
        other.to_str().unwrap(),
    ]));
    assert!(
        text.starts_with(
            "The process (rank not known: pid 4242) ran out of memory first: asked for 1.0 GiB"
        ),
        "{text}"
    );
    assert!(
        text.contains("a.pickle (rank not known: pid 4242): "),
        "{text}"
    );
    assert!(!text.contains('?'), "{text}");
    // The site's library and role say which is which.
    assert!(
        text.contains(&format!(
            "\n  held by (requested bytes, allocations, site):\n        1000 B       1  {} [library: app, role: other]\n",
            via_helper(SITE_KEPT)
        )),
        "{text}"
    );
    let v = json(&memsnap(&[
        "explain",
        "--json",
        oom.to_str().unwrap(),
        other.to_str().unwrap(),
    ]));
    assert_eq!(
        (v["oom"]["rank"].clone(), v["oom"]["pid"].clone()),
        (Value::Null, 4242.into())
    );
    assert_eq!(v["at"]["pid"], 4242);
    let text = stdout(&memsnap(&["explain", other.to_str().unwrap()]));
    assert!(
        text.contains(&format!(
            "\n     9.8 KiB  at {} [library: app, role: other]\n",
            via_helper(SITE_TEMP)
        )),
        "{text}"
    );
    // A file that names no process either (PyTorch's own): the rank is not known, plainly.
    let plain = write(dir.path(), "c.pickle", &r.snapshot(None));
    let text = stdout(&memsnap(&[
        "explain",
        plain.to_str().unwrap(),
        other.to_str().unwrap(),
    ]));
    assert!(
        text.starts_with("The process (rank not known) ran out of memory first: asked for"),
        "{text}"
    );
    assert!(text.contains("c.pickle (rank not known): "), "{text}");
}

/// `snap` as step file `step` of its process (written at `step` seconds, `seq` alike).
fn as_step(mut snap: Snapshot, step: i64) -> Snapshot {
    snap.memsnap.extend([
        ("reason".into(), Meta::Str("step".into())),
        ("step".into(), Meta::Int(step)),
        ("seq".into(), Meta::Int(step)),
        (
            "time_us".into(),
            Meta::Int(1_700_000_000_000_000 + step * 1_000_000),
        ),
    ]);
    snap
}

#[test]
fn ranks_shows_one_process_step_files_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    // memsnap's default names: the pid stands in the rank's place without RANK.
    let mut r = Recording::new();
    for step in [5, 10, 15] {
        r.malloc(0x1000 * step, 1000 * step, KEPT);
        let name = format!("memsnap-python-node1-r4242-p4242-step-{step}-{step}.pickle");
        write(
            dir.path(),
            &name,
            &as_step(with_pid(r.snapshot(None), 4242), step),
        );
    }
    let d = dir.path().to_str().unwrap();
    let v = json(&memsnap(&["ranks", "--json", d]));
    let rows = v["ranks"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{v:#}");
    let row = &rows[0];
    assert_eq!(
        (row["rank"].clone(), row["pid"].clone(), row["host"].clone()),
        (Value::Null, 4242.into(), "node1".into())
    );
    // Oldest first by when each was written (step 5's name sorts after step 15's).
    let files: Vec<&str> = row["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap())
        .collect();
    assert_eq!(
        files,
        [
            "memsnap-python-node1-r4242-p4242-step-5-5.pickle",
            "memsnap-python-node1-r4242-p4242-step-10-10.pickle",
            "memsnap-python-node1-r4242-p4242-step-15-15.pickle",
        ]
    );
    assert_eq!(row["file"], files[2]);
    assert_eq!(row["live_bytes"], 30000, "the latest file's figures");
    let text = stdout(&memsnap(&["ranks", d]));
    assert!(
        text.contains("rank not known: pid 4242 on node1\n"),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "one process's 3 files, oldest first (the figures are the latest's, the peak the \
             highest): {}\n",
            files.join(", ")
        )),
        "{text}"
    );
    assert!(text.contains("`memsnap diff "), "{text}");
    assert!(
        !text.contains("4242  "),
        "no rank column of the pid: {text}"
    );
    // Two ranks of a run, two files each: two rows, one per rank.
    let dir = tempfile::tempdir().unwrap();
    for rank in [0, 1] {
        for step in [1, 2] {
            let mut snap = as_step(with_pid(helper_program().snapshot(None), 100 + rank), step);
            for (k, v) in &mut snap.memsnap {
                if k == "rank" {
                    *v = Meta::Str(rank.to_string());
                }
            }
            write(dir.path(), &format!("job-r{rank}-step{step}.pickle"), &snap);
        }
    }
    let v = json(&memsnap(&["ranks", "--json", dir.path().to_str().unwrap()]));
    let rows: Vec<(i64, usize)> = v["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["rank"].as_i64().unwrap(),
                r["files"].as_array().unwrap().len(),
            )
        })
        .collect();
    assert_eq!(rows, [(0, 2), (1, 2)]);
}

#[test]
fn a_time_past_the_history_is_refused_by_every_command_that_takes_at() {
    let dir = tempfile::tempdir().unwrap();
    let p = helper_file(dir.path());
    let p = p.to_str().unwrap();
    let out = dir.path().join("out");
    let out = out.to_str().unwrap();
    // The calls are 1 ms apart: the history spans 5 ms, events 0 to 13.
    let why = "--at: +3600.000 s is past this device's history, which spans +0.000 s to \
               +0.005 s (events 0 to 13)";
    for args in [
        vec!["summary", "--at", "1h", p],
        vec!["explain", "--at", "1h", p],
        vec!["diff", "--at", "1h", p, p],
        vec!["diff", "--at-after", "1h", p, p],
        vec!["flamegraph", "--at", "1h", p, "-o", out],
        vec!["view", "--at", "1h", p, "-o", out],
    ] {
        let o = memsnap(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stdout(&o));
        assert!(stderr(&o).contains(why), "{args:?}: {}", stderr(&o));
        assert!(o.stdout.is_empty(), "{args:?}: {}", stdout(&o));
    }
    assert!(!Path::new(out).exists(), "nothing written");
    // view refuses a named moment the file does not hold, as the others do.
    let o = memsnap(&["view", "--at", "oom", p, "-o", out]);
    assert_eq!(o.status.code(), Some(2), "{}", stdout(&o));
    assert!(stderr(&o).contains("no OOM in this device's history"));
    // The last event's own time is within the history: the state after it.
    let v = json(&memsnap(&["summary", "--json", "--at", "5ms", p]));
    let at = &v["devices"][0]["at"];
    assert_eq!(
        (at["moment"].as_str(), at["after_event"].as_i64()),
        (Some("time"), Some(13))
    );
    assert!(at["unreached"].is_null());
}

#[test]
fn labels_say_calls_events_and_the_cap_honestly() {
    let dir = tempfile::tempdir().unwrap();
    let full = helper_program();
    // Keep the newest 10 of the 14 events.
    let snap = write(dir.path(), "capped.pickle", &full.snapshot(Some(10)));
    let text = stdout(&memsnap(&["summary", snap.to_str().unwrap()]));
    assert!(
        text.contains("\nAPI calls: cudaMalloc 4, cudaFree 2\n"),
        "{text}"
    );
    assert!(
        text.contains(
            "events by API (trace events; a call makes 2 or 3): cudaFree 6, cudaMalloc 4\n"
        ),
        "{text}"
    );
    assert!(
        text.contains("  history capped: kept 10 of 14 events"),
        "{text}"
    );
    assert!(!text.contains("dropped events"), "{text}");
    // memsnap's own markers (its step marks) are no CUDA calls: named apart, as what they are.
    let mut marked = full.snapshot(None);
    for (key, value) in &mut marked.memsnap {
        if let ("api_calls", Meta::Dict(calls)) = (key.as_str(), value) {
            calls.push(("memsnap".into(), Meta::Int(5)));
        }
    }
    let mut mark = marked.device_traces[0][0].clone();
    mark.user_metadata = Some(Arc::from("memsnap"));
    marked.device_traces[0].push(TraceEntry {
        action: Action::Snapshot,
        ..mark
    });
    let marked = write(dir.path(), "marked.pickle", &marked);
    let text = stdout(&memsnap(&["summary", marked.to_str().unwrap()]));
    assert!(
        text.contains(
            "\nAPI calls: cudaMalloc 4, cudaFree 2; memsnap's own markers (not CUDA calls) 5\n"
        ),
        "{text}"
    );
    assert!(
        text.contains(
            "events by API (trace events; a call makes 2 or 3): cudaMalloc 8, cudaFree 6; \
             memsnap's own markers (not CUDA calls) 1\n"
        ),
        "{text}"
    );
    let v = json(&memsnap(&["summary", "--json", snap.to_str().unwrap()]));
    assert_eq!(v["devices"][0]["history"]["dropped_by_cap"], 4);
    assert_eq!(
        v["devices"][0]["history"]["capped"],
        "history capped: kept 10 of 14 events"
    );
    assert_eq!(v["api_calls"][0]["api"], "cudaMalloc");
    assert_eq!(v["api_calls"][0]["calls"], 4);
    // The reconstruction is exact within the kept events: the peak is still 11000 B.
    assert_eq!(v["devices"][0]["at"]["live_requested_bytes"], 11000);
    // A file that keeps everything says nothing about a cap.
    let snap = write(dir.path(), "full.pickle", &full.snapshot(None));
    let text = stdout(&memsnap(&["summary", snap.to_str().unwrap()]));
    assert!(!text.contains("capped"), "{text}");
    // Dropped events are reported when there are some.
    let mut s = full.snapshot(None);
    for (key, value) in &mut s.memsnap {
        if key == "dropped_events" {
            *value = Meta::Int(7);
        }
        if key == "events_without_stack" {
            *value = Meta::Int(1);
        }
        if key == "frames_unresolved" {
            *value = Meta::Int(2);
        }
    }
    let snap = write(dir.path(), "dropped.pickle", &s);
    let text = stdout(&memsnap(&["summary", snap.to_str().unwrap()]));
    let first: Vec<&str> = text.lines().take(4).collect();
    assert!(
        first[1].starts_with("INCOMPLETE: 7 events not recorded"),
        "{text}"
    );
    assert_eq!(
        first[2], "INCOMPLETE: 1 event recorded without a stack",
        "{text}"
    );
    assert_eq!(
        first[3],
        "INCOMPLETE: 2 stack frames unresolved (code gone before memsnap read it): kept as \
         ?? or with line 0",
        "{text}"
    );
    let v = json(&memsnap(&["summary", "--json", snap.to_str().unwrap()]));
    assert_eq!(v["frames_unresolved"], 2);
}

#[test]
fn diff_sizes_mean_what_their_units_say_and_each_side_has_a_moment() {
    let dir = tempfile::tempdir().unwrap();
    let before = write(
        dir.path(),
        "before.pickle",
        &Recording::new().snapshot(None),
    );
    let mut r = Recording::new();
    r.malloc(0x1000, 64_000_001, KEPT);
    let after = write(dir.path(), "after.pickle", &r.snapshot(None));
    let (b, a) = (before.to_str().unwrap(), after.to_str().unwrap());
    // 64MB is 64 * 10^6 bytes: 64,000,001 passes it.
    let o = memsnap(&["diff", b, a, "--fail-above", "64MB"]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(
        stdout(&o).contains("FAIL: growth +61.0 MiB exceeds the limit 61.0 MiB (64000000 bytes)"),
        "{}",
        stdout(&o)
    );
    // 64MiB is 64 * 2^20 = 67,108,864 bytes: within.
    let o = memsnap(&["diff", b, a, "--fail-above", "64MiB"]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    // A bare M is refused rather than guessed.
    let o = memsnap(&["diff", b, a, "--fail-above", "64M"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("ambiguous: write 64MB (10^6 bytes) or 64MiB (2^20 bytes)"),
        "{}",
        stderr(&o)
    );

    // Each side at its own moment: the helper program at its peak against its end.
    let p = helper_file(dir.path());
    let p = p.to_str().unwrap();
    let v = json(&memsnap(&[
        "diff",
        "--json",
        "--ignore",
        "pyalloc",
        "--at-before",
        "peak",
        "--at-after",
        "end",
        p,
        p,
    ]));
    assert_eq!(v["before"]["units"], "requested bytes");
    assert_eq!(v["before"]["at"][0]["moment"], "peak");
    assert_eq!(v["after"]["at"][0]["moment"], "end");
    assert_eq!(v["total_growth_bytes"], 2000 - 11000);
    assert_eq!(v["shrank"][0]["site"], SITE_TEMP);
    assert_eq!(v["shrank"][0]["growth_bytes"], -10000);
    assert_eq!(v["grew"][0]["site"], SITE_KEPT);
    assert_eq!(v["grew"][0]["growth_bytes"], 1000);
    let text = stdout(&memsnap(&["diff", "--at", "peak", p, p]));
    assert!(
        text.contains("before: at the peak (after event 6, +0.003 s)\n"),
        "{text}"
    );
}

#[test]
fn ranks_reports_an_unreadable_rank_and_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let good = memsnap_format::pickle_write::to_bytes(&helper_program().snapshot(None));
    std::fs::write(dir.path().join("job-r0.pickle"), &good).unwrap();
    std::fs::write(dir.path().join("job-r2.pickle"), &good).unwrap();
    std::fs::write(dir.path().join("job-r1.pickle"), &good[..good.len() / 2]).unwrap();
    let o = memsnap(&["ranks", dir.path().to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(
        text.contains("job-r0.pickle") && text.contains("job-r2.pickle"),
        "{text}"
    );
    let bad = text
        .lines()
        .position(|l| l.contains("job-r1.pickle"))
        .unwrap_or_else(|| panic!("{text}"));
    let why = text.lines().nth(bad + 1).unwrap();
    assert!(
        why.contains("unreadable: ") && why.contains("truncated"),
        "{text}"
    );
    assert!(text.contains("1 of 3 files could not be read"), "{text}");
    let v = json(&memsnap(&["ranks", "--json", dir.path().to_str().unwrap()]));
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 3);
    assert_eq!(ranks[1]["rank"], 1);
    assert!(ranks[1]["error"].as_str().unwrap().contains("truncated"));
    assert!(ranks[0]["error"].is_null() && ranks[2]["error"].is_null());
    assert_eq!(v["median_live_bytes"], 2000);
    // No readable file at all is an error.
    std::fs::remove_file(dir.path().join("job-r0.pickle")).unwrap();
    std::fs::remove_file(dir.path().join("job-r2.pickle")).unwrap();
    let o = memsnap(&["ranks", dir.path().to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn view_and_flamegraph_say_what_they_wrote_and_open_at_the_moment() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = helper_program();
    r.oom(1 << 30); // event 14
    let snap = write(dir.path(), "oom.pickle", &r.snapshot(Some(12)));
    let p = snap.to_str().unwrap();
    let page = dir.path().join("page.html");
    let o = memsnap(&["view", p, "-o", page.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.starts_with(&format!("wrote {} (", page.display())),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "open it in a web browser: file://{}",
            page.display()
        )),
        "{out}"
    );
    let d = &page_data(&page)["devices"][0];
    // The OOM (event 14 of 15, the 12th of the 12 kept) is where the page opens, with its
    // size for the legend.
    assert_eq!(d["at"]["event"], 11);
    assert_eq!(d["at"]["short"], "OOM");
    assert_eq!(d["oom_requested"][0], 1i64 << 30);
    assert_eq!(d["capped"], "history capped: kept 12 of 15 events");
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(html.contains("red line: out of memory at event "));
    assert!(html.contains("sizes written where they fit"));
    let o = memsnap(&["view", p, "-o", page.to_str().unwrap(), "--at", "peak"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // The peak after event 6 of the full history is event 3 of the 12 kept.
    assert_eq!(page_data(&page)["devices"][0]["at"]["event"], 3);

    let svg = dir.path().join("f.svg");
    let o = memsnap(&["flamegraph", p, "-o", svg.to_str().unwrap(), "--at", "peak"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.starts_with(&format!(
            "wrote {}: live memory by stack at the peak (after event 3, +0.002 s), 10.7 KiB (requested bytes) in 3 allocations\n",
            svg.display()
        )),
        "{out}"
    );
    assert!(
        out.contains("history capped: kept 12 of 15 events"),
        "{out}"
    );
    assert!(out.contains(&format!(
        "open it in a web browser: file://{}",
        svg.display()
    )));
    assert!(std::fs::read_to_string(&svg).unwrap().contains("forget_me"));
    // At the end only the kept blocks are drawn.
    let o = memsnap(&["flamegraph", p, "-o", svg.to_str().unwrap(), "--at", "end"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let svg_text = std::fs::read_to_string(&svg).unwrap();
    assert!(svg_text.contains("remember_me") && !svg_text.contains("forget_me"));
}

/// What a crafted file can put in its strings for a terminal to act on: clear the screen,
/// write the clipboard (OSC 52), a forged report line, an 8-bit CSI, DEL.
const TERMINAL_ATTACK: &str = "\x1b[2J\x1b]52;c;cHduZWQ=\x07\r\nFORGED line\u{9b}31m\x7f";
/// [`TERMINAL_ATTACK`] as the reports show it.
const TERMINAL_ATTACK_SHOWN: &str =
    "\\x1b[2J\\x1b]52;c;cHduZWQ=\\x07\\r\\nFORGED line\\u{9b}31m\\x7f";

/// Fails unless `bytes` hold no control character but the line ends, and no line of them
/// was forged by a string of the file.
fn assert_no_terminal_controls(what: &str, bytes: &[u8]) {
    let text = String::from_utf8_lossy(bytes);
    let raw = text
        .char_indices()
        .find(|&(_, c)| c != '\n' && c.is_control());
    assert!(raw.is_none(), "{what}: a raw control {raw:?} in:\n{text}");
    assert!(
        !text.lines().any(|l| l.starts_with("FORGED")),
        "{what}: a forged line in:\n{text}"
    );
}

#[test]
fn control_characters_from_a_file_are_shown_escaped_never_sent_to_the_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let ranks = dir.path().join(format!("run{TERMINAL_ATTACK}"));
    std::fs::create_dir(&ranks).unwrap();
    let mut r = helper_program();
    r.malloc(0x5000, 3000, TEMP).oom(1 << 30);
    let mut snap = r.snapshot(None);
    for f in &mut snap.frames[1..] {
        f.name = format!("{}{TERMINAL_ATTACK}", f.name);
        f.filename = format!("/srv/{TERMINAL_ATTACK}/main.py");
    }
    snap.memsnap.push((
        "torch_allocator".into(),
        Meta::Str(format!("blocks{TERMINAL_ATTACK}")),
    ));
    let hostile = write(&ranks, &format!("job{TERMINAL_ATTACK}-r0.pickle"), &snap);
    let plain = write(&ranks, "job-r1.pickle", &helper_program().snapshot(None));
    let (hostile, plain) = (hostile.to_str().unwrap(), plain.to_str().unwrap());
    let dir_arg = ranks.to_str().unwrap();
    let page = ranks.join("page.html");
    let svg = ranks.join("flame.svg");
    let (page, svg) = (page.to_str().unwrap(), svg.to_str().unwrap());
    for args in [
        &["view", hostile, "-o", page][..],
        &["flamegraph", hostile, "-o", svg],
        &["summary", hostile],
        &["summary", "--at", "end", hostile],
        &["diff", plain, hostile],
        &["diff", hostile, plain],
        &["ranks", dir_arg],
        &["explain", hostile],
        &["explain", dir_arg],
        &["check", hostile],
    ] {
        let o = memsnap(args);
        let what = args[0];
        assert!(
            o.status.code().is_some_and(|c| c < 2),
            "{what}: {}",
            stderr(&o)
        );
        assert_no_terminal_controls(what, &o.stdout);
        assert_no_terminal_controls(what, &o.stderr);
        assert!(
            stdout(&o).contains(TERMINAL_ATTACK_SHOWN),
            "{what}: the escaped form missing in:\n{}",
            stdout(&o)
        );
    }
    // The metadata line and the frames' names in summary; a file that is not there is an
    // error whose message shows its name escaped too.
    let text = stdout(&memsnap(&["summary", hostile]));
    assert!(
        text.contains(&format!(
            "PyTorch's allocator: blocks{TERMINAL_ATTACK_SHOWN}"
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!("(cuda_alloc{TERMINAL_ATTACK_SHOWN})")),
        "{text}"
    );
    let missing = format!("{hostile}.gone");
    let o = memsnap(&["summary", &missing]);
    assert_eq!(o.status.code(), Some(2));
    assert_no_terminal_controls("a missing file", &o.stderr);
    assert!(stderr(&o).contains(TERMINAL_ATTACK_SHOWN), "{}", stderr(&o));
    // JSON keeps the strings as they are: serde escapes what JSON must.
    let v = json(&memsnap(&["summary", "--json", hostile]));
    assert!(
        v["metadata"]["torch_allocator"]
            .as_str()
            .is_some_and(|s| s.ends_with(TERMINAL_ATTACK))
    );
}

#[test]
fn explain_finds_iterations_in_pytorchs_own_snapshots() {
    // The leak fixture keeps every step's loss: its requested bytes grew by 8 losses between
    // the dumps after steps 3 and 11. Its file has no step marks: explain cuts the history
    // where the loop's allocations recur, and the loss line leaks one loss an iteration.
    let step3 = counts("torch-leak-step3")["live_requested_bytes"]
        .as_i64()
        .unwrap();
    let step11 = counts("torch-leak-step11")["live_requested_bytes"]
        .as_i64()
        .unwrap();
    let per_step = (step11 - step3) / 8;
    assert!(per_step > 0);
    let f = fixture("torch-leak-step11");
    let x = json(&memsnap(&["explain", "--json", f.to_str().unwrap()]));
    let it = &x["iterations"][0];
    assert_eq!(it["found"], true, "{x:#}");
    // 12 steps: 11 iterations between the first one's start and the last one's.
    assert_eq!(it["iterations"], 11, "{x:#}");
    let leaks = x["leaks"].as_array().unwrap();
    assert_eq!(leaks.len(), 1, "{x:#}");
    assert_eq!(leaks[0]["site"], leak_site().as_str(), "{x:#}");
    assert_eq!(leaks[0]["unit"], "iteration");
    assert_eq!(leaks[0]["bytes_per_iteration"], per_step);
    // The transformer trains 8 steps and keeps nothing from them.
    let f = fixture("torch-transformer-all-stacks");
    let x = json(&memsnap(&["explain", "--json", f.to_str().unwrap()]));
    assert_eq!(x["iterations"][0]["iterations"], 8, "{x:#}");
    assert_eq!(x["leaks"], serde_json::json!([]), "{x:#}");
    // The two leak files name no process: given together, they are one unnamed process's
    // snapshots, and the loss line grew between them.
    let (a, b) = (fixture("torch-leak-step3"), fixture("torch-leak-step11"));
    let x = json(&memsnap(&[
        "explain",
        "--json",
        b.to_str().unwrap(),
        a.to_str().unwrap(),
    ]));
    let s = &x["snapshots"][0];
    assert_eq!(
        s["files"],
        serde_json::json!([a.to_str().unwrap(), b.to_str().unwrap()]),
        "{x:#}"
    );
    assert_eq!(s["sites"][0]["site"], leak_site().as_str(), "{x:#}");
    assert_eq!(s["sites"][0]["growth_bytes"], step11 - step3);
    assert_eq!(s["sites"][0]["verdict"], "leak");
    // The later file's history reaches back past the earlier one's end: it counts the
    // iterations that started since.
    assert_eq!(s["iterations"], 8, "{x:#}");
}

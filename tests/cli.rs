//! The `memsnap` binary on PyTorch's reference snapshots: exact summary/diff text (golden
//! files in tests/golden/, rewritten with `MEMSNAP_BLESS=1`), JSON shapes, bad input,
//! ranks, flamegraph, and the HTML page (self-contained).
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

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

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

/// Compares with tests/golden/NAME, or rewrites it when MEMSNAP_BLESS=1.
fn golden(name: &str, actual: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    if std::env::var("MEMSNAP_BLESS").as_deref() == Ok("1") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run with MEMSNAP_BLESS=1 to create it)",
            path.display()
        )
    });
    assert!(
        expected == actual,
        "{name} differs from the golden file (MEMSNAP_BLESS=1 rewrites it)\n--- expected\n{expected}\n--- actual\n{actual}"
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
        let start = html.find("id=\"data\">").unwrap() + "id=\"data\">".len();
        let end = start + html[start..].find("</script>").unwrap();
        let v: serde_json::Value = serde_json::from_str(&html[start..end]).unwrap();
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
        eprintln!("NOTICE: python3 not found; skipping the generated memsnap-file test");
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
    assert!(stdout(&o).contains("dropped events: 7 (memsnap counter)"));

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
        eprintln!("NOTICE: python3 not found; skipping the large-page test");
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

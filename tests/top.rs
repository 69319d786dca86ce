//! `memsnap top` end to end on the fake CUDA driver (no GPU): a running program's live bytes
//! by site over the socket, the same-user socket surviving garbage, stalled and flooding
//! clients, a dump asked through it, and no socket for a process that never touches CUDA.
//! Needs `cargo build --workspace` first (the tests preload target/<profile>/libmemsnap.so).

mod common;

use memsnap_format::live::{self, Answer, Request};
use serde_json::Value;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

/// A running `top` program: its stdin, and its stdout lines as they come.
struct Program {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    folder: tempfile::TempDir,
}

impl Program {
    fn start(name: &str, args: &[&str]) -> Program {
        let folder = tempfile::tempdir().unwrap();
        let path = common::program_path(name);
        let mut cmd = if name.ends_with(".py") {
            let mut c = Command::new("python3");
            c.arg(path);
            c
        } else {
            Command::new(path)
        };
        cmd.args(args);
        for (key, _) in std::env::vars_os() {
            let key = key.to_string_lossy();
            if key.starts_with("MEMSNAP_") || key.starts_with("FAKE_CUDA") || key == "LD_PRELOAD" {
                cmd.env_remove(key.as_ref());
            }
        }
        let mut child = cmd
            .env("LD_LIBRARY_PATH", common::fake_lib_dir())
            .env(
                "FAKE_CUDART",
                common::fake_lib_dir().join("libcudart.so.13"),
            )
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env("LD_PRELOAD", common::preload_lib())
            .env("MEMSNAP_FOLDER", folder.path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the program");
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Program {
            stdin: child.stdin.take(),
            child,
            lines,
            folder,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The socket, once the writer (started by the first CUDA call) has opened it.
    fn socket(&self) -> PathBuf {
        let path = socket(self.pid());
        let start = Instant::now();
        while !path.exists() && start.elapsed() < common::PROGRAM_TIMEOUT {
            std::thread::sleep(Duration::from_millis(10));
        }
        path
    }

    /// The `result k=v` pairs printed up to and including `result ready=N`.
    fn results_until_ready(&self) -> HashMap<String, String> {
        let mut out = HashMap::new();
        loop {
            let line = self
                .lines
                .recv_timeout(common::PROGRAM_TIMEOUT)
                .expect("the program says it is ready");
            out.extend(common::results(&line));
            if line.starts_with("result ready=") {
                return out;
            }
        }
    }

    fn send(&mut self, line: &str) {
        writeln!(self.stdin.as_mut().unwrap(), "{line}").unwrap();
    }

    /// Closes stdin (the program then exits) and returns its exit status.
    fn finish(mut self) -> (std::process::ExitStatus, tempfile::TempDir) {
        drop(self.stdin.take());
        (self.child.wait().unwrap(), self.folder)
    }
}

fn uid() -> u32 {
    std::fs::metadata("/proc/self").unwrap().uid()
}

fn socket(pid: u32) -> PathBuf {
    live::socket_path(uid(), pid)
}

fn memsnap(args: &[&str]) -> Output {
    Command::new(common::memsnap_bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run memsnap")
}

/// `memsnap top PID --once --json`: the one process's object.
fn top_json(pid: u32) -> Value {
    let o = memsnap(&["top", &pid.to_string(), "--once", "--json"]);
    assert!(
        o.status.success(),
        "top failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let text = String::from_utf8(o.stdout).unwrap();
    assert_eq!(text.lines().count(), 1, "{text}");
    serde_json::from_str(&text).unwrap()
}

/// (bytes, count) of the one native site whose text contains `function`.
fn site(top: &Value, function: &str) -> (u64, u64) {
    site_of_kind(top, function, "native")
}

fn site_of_kind(top: &Value, function: &str, kind: &str) -> (u64, u64) {
    let rows: Vec<&Value> = top["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["site"].as_str().unwrap().contains(function))
        .collect();
    assert_eq!(rows.len(), 1, "one site for {function}: {top}");
    assert_eq!(rows[0]["kind"], kind);
    (
        rows[0]["bytes"].as_u64().unwrap(),
        rows[0]["count"].as_u64().unwrap(),
    )
}

/// (site, via, bytes, count) of the native rows whose site contains `function`.
fn rows_through(top: &Value, function: &str) -> Vec<(String, Value, u64, u64)> {
    top["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["site"].as_str().unwrap().contains(function))
        .map(|s| {
            assert_eq!(s["kind"], "native", "{s}");
            (
                s["site"].as_str().unwrap().to_string(),
                s["via"].clone(),
                s["bytes"].as_u64().unwrap(),
                s["count"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Checks that each of `rows` is a line of main through `helper` (the function's name);
/// returns how many distinct lines they are and their bytes.
fn through_helper(rows: &[(String, Value, u64, u64)], helper: &str) -> (usize, u64) {
    let mut callers: Vec<&str> = rows.iter().map(|r| r.0.as_str()).collect();
    callers.dedup();
    for (site, via, _, _) in rows {
        let via = via.as_str().unwrap_or_default();
        assert!(via.starts_with(&format!("{helper} (top.c:")), "{rows:?}");
        assert!(
            site.starts_with("main (top.c:") && site.ends_with(&format!(" via {via}")),
            "{rows:?}"
        );
    }
    (callers.len(), rows.iter().map(|r| r.2).sum())
}

fn num(results: &HashMap<String, String>, key: &str) -> u64 {
    common::num(results, key)
}

/// The exit snapshot's live bytes, by `memsnap summary --json`; `memsnap check` passes.
fn exit_snapshot_live_bytes(folder: &Path) -> u64 {
    let files = common::snapshot_files(folder);
    let exit: Vec<&PathBuf> = files
        .iter()
        .filter(|p| common::label_of(p).as_deref() == Some("exit"))
        .collect();
    assert_eq!(exit.len(), 1, "{files:?}");
    let exit = exit[0].to_str().unwrap();
    let check = memsnap(&["check", exit]);
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stdout)
    );
    let summary = memsnap(&["summary", exit, "--json"]);
    assert!(summary.status.success());
    let s: Value = serde_json::from_slice(&summary.stdout).unwrap();
    s["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["live_bytes"].as_u64().unwrap())
        .sum()
}

#[test]
fn once_json_reports_exactly_what_the_program_holds_by_site() {
    let mut p = Program::start("top", &[]);
    let truth = p.results_until_ready();
    let pid = p.pid();
    assert!(p.socket().exists());
    assert_eq!(num(&truth, "live_bytes"), 11 * MIB);

    let top = top_json(pid);
    assert_eq!(top["pid"], pid);
    assert_eq!(top["live_bytes"].as_u64(), Some(num(&truth, "live_bytes")));
    assert_eq!(top["devices"][0]["live_bytes"].as_u64(), Some(11 * MIB));
    assert_eq!(top["devices"][0]["live_allocations"].as_u64(), Some(3));
    // The freed 1 MiB scratch buffer counts toward the peak only.
    assert_eq!(top["devices"][0]["peak_bytes"].as_u64(), Some(12 * MIB));
    // top_weights is called from two lines of main: a helper, shown at each of them.
    let weights = rows_through(&top, "top_weights");
    assert_eq!(
        through_helper(&weights, "top_weights"),
        (2, num(&truth, "weights_bytes"))
    );
    assert!(weights.iter().all(|r| r.3 == 1), "{weights:?}");
    // top_cache, from one line so far: its own line is the site.
    assert_eq!(site(&top, "top_cache"), (num(&truth, "cache_bytes"), 1));
    assert_eq!(rows_through(&top, "top_cache")[0].1, Value::Null);
    assert_eq!(top["sites"].as_array().unwrap().len(), 3, "{top}");
    assert_eq!(top["step"], 0);

    p.send("grow");
    let truth = p.results_until_ready();
    let top = top_json(pid);
    assert_eq!(top["live_bytes"].as_u64(), Some(num(&truth, "live_bytes")));
    // A second line of main called top_cache: now a helper too.
    assert_eq!(
        through_helper(&rows_through(&top, "top_cache"), "top_cache"),
        (2, num(&truth, "cache_bytes"))
    );
    assert_eq!(top["step"], 1);

    // Plain lines, as a script would see them.
    let o = memsnap(&["top", &pid.to_string(), "--once"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains(&format!("pid {pid} step 1 device 0: live 13.0 MiB")),
        "{text}"
    );
    // The site rows come under a column header (one sample: no growth column).
    let header = text
        .lines()
        .position(|l| {
            l.split_whitespace().collect::<Vec<_>>() == ["live", "allocs", "allocation", "site"]
        })
        .unwrap_or_else(|| panic!("no column header: {text}"));
    assert!(
        text.lines()
            .nth(header + 1)
            .is_some_and(|l| l.contains("x  ")),
        "a site row follows the header: {text}"
    );

    let (status, folder) = p.finish();
    assert!(status.success(), "{status}");
    assert!(!socket(pid).exists(), "the socket is removed at exit");
    assert_eq!(exit_snapshot_live_bytes(folder.path()), 13 * MIB);
}

#[test]
fn a_python_program_is_shown_by_python_line() {
    let p = Program::start("py_alloc.py", &["wait"]);
    let truth = p.results_until_ready();
    p.socket();
    let top = top_json(p.pid());
    let line = format!("py_alloc.py:{} (make_tensor)", truth["line"]);
    assert_eq!(
        site_of_kind(&top, &line, "python"),
        (
            num(&truth, "expected_live_bytes"),
            num(&truth, "expected_live_count")
        )
    );
    assert_eq!(
        top["live_bytes"].as_u64(),
        Some(num(&truth, "expected_live_bytes"))
    );
    assert!(p.finish().0.success());
}

#[test]
fn garbage_stalled_and_flooding_clients_leave_the_program_intact() {
    let p = Program::start("top", &[]);
    let truth = p.results_until_ready();
    let pid = p.pid();
    let path = p.socket();

    // Garbage: a length prefix over the cap, then a body that is not a request.
    let mut huge = UnixStream::connect(&path).unwrap();
    huge.write_all(&[0xff, 0xff, 0xff, 0x7f, b'x']).unwrap();
    let mut junk = UnixStream::connect(&path).unwrap();
    junk.write_all(&[5, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef, 0])
        .unwrap();
    // A stall: connects and says nothing, and keeps the connection open.
    let mut stalled = UnixStream::connect(&path).unwrap();
    // A flood: connections opened and dropped at once.
    for _ in 0..200 {
        drop(UnixStream::connect(&path));
    }
    for (name, conn) in [("oversized", &mut huge), ("garbage", &mut junk)] {
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(
            conn.read(&mut buf).unwrap(),
            0,
            "the {name} client is cut off"
        );
    }

    // Meanwhile the program is served as before.
    let top = top_json(pid);
    assert_eq!(top["live_bytes"].as_u64(), Some(num(&truth, "live_bytes")));

    // The stalled client is cut off at its deadline.
    let start = Instant::now();
    stalled
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 16];
    assert_eq!(stalled.read(&mut buf).unwrap(), 0);
    assert!(start.elapsed() < Duration::from_secs(5));

    // A dump asked through the socket is a complete snapshot.
    let mut asker = UnixStream::connect(&path).unwrap();
    asker.write_all(&live::encode(&Request::Dump)).unwrap();
    let answer: Answer = live::read_message(&mut asker, live::MAX_ANSWER).unwrap();
    let Answer::Dumped { path: dumped, .. } = answer else {
        panic!("no dump: {answer:?}")
    };
    assert!(Path::new(&dumped).is_file(), "{dumped}");
    assert!(memsnap(&["check", &dumped]).status.success());

    let (status, folder) = p.finish();
    assert!(status.success(), "the program was hurt: {status}");
    assert_eq!(
        exit_snapshot_live_bytes(folder.path()),
        num(&truth, "live_bytes")
    );
}

/// Dump requests that arrive together (or while a snapshot is being written) share one
/// snapshot, as dump signals do: 48 requests at once never make 48 files.
#[test]
fn dump_requests_that_arrive_together_share_one_snapshot() {
    const ASKERS: usize = 48;
    let p = Program::start("top", &[]);
    p.results_until_ready();
    let path = p.socket();
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(ASKERS));
    let askers: Vec<_> = (0..ASKERS)
        .map(|_| {
            let (path, barrier) = (path.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let mut conn = UnixStream::connect(&path).unwrap();
                conn.write_all(&live::encode(&Request::Dump)).unwrap();
                live::read_message::<Answer>(&mut conn, live::MAX_ANSWER).unwrap()
            })
        })
        .collect();
    // Each file with the number of requests it served, as every one of them was told.
    let mut paths = std::collections::BTreeMap::new();
    for asker in askers {
        match asker.join().unwrap() {
            Answer::Dumped { path, requests } => {
                assert!(Path::new(&path).is_file(), "{path}");
                let told = paths.entry(path).or_insert(requests);
                assert_eq!(*told, requests, "one file, one count");
            }
            other => panic!("not dumped: {other:?}"),
        }
    }
    assert_eq!(
        paths.values().sum::<u64>(),
        ASKERS as u64,
        "the counts add up to the requests: {paths:?}"
    );
    let (status, folder) = p.finish();
    assert!(status.success());
    let signal_files = std::fs::read_dir(folder.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains("-signal-"))
        .count();
    assert_eq!(signal_files, paths.len(), "each file answers some requests");
    assert!(
        paths.len() <= ASKERS / 4,
        "{} snapshots for {ASKERS} requests",
        paths.len()
    );
}

/// A flood of dump requests from clients that ask and leave at once, for about 2 s:
/// `memsnap top` is answered throughout, the snapshots are held to one a second (the
/// floor, docs/SIGNALS.md), and the program ends as it would have.
#[test]
fn a_flood_of_dump_requests_leaves_top_served_and_few_snapshots() {
    const FLOODERS: usize = 4;
    let p = Program::start("top", &[]);
    let truth = p.results_until_ready();
    let path = p.socket();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let started = Instant::now();
    let flooders: Vec<_> = (0..FLOODERS)
        .map(|_| {
            let (path, stop) = (path.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut asked = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Ok(mut conn) = UnixStream::connect(&path)
                        && conn.write_all(&live::encode(&Request::Dump)).is_ok()
                    {
                        asked += 1;
                    }
                }
                asked
            })
        })
        .collect();
    let mut samples = 0;
    while started.elapsed() < Duration::from_secs(2) {
        let top = top_json(p.pid());
        assert_eq!(top["live_bytes"].as_u64(), Some(num(&truth, "live_bytes")));
        samples += 1;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let asked: u64 = flooders.into_iter().map(|f| f.join().unwrap()).sum();
    let flood = started.elapsed();
    // A client that waits is still told which file served it.
    let mut waiter = UnixStream::connect(&path).unwrap();
    waiter.write_all(&live::encode(&Request::Dump)).unwrap();
    let answer: Answer = live::read_message(&mut waiter, live::MAX_ANSWER).unwrap();
    let Answer::Dumped { path: dumped, .. } = answer else {
        panic!("no dump: {answer:?}")
    };
    assert!(Path::new(&dumped).is_file(), "{dumped}");

    let (status, folder) = p.finish();
    assert!(status.success(), "the program was hurt: {status}");
    assert!(
        samples >= 2 && asked > 100,
        "{samples} samples, {asked} requests"
    );
    let signal_files = std::fs::read_dir(folder.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains("-signal-"))
        .count() as u64;
    let bound = flood.as_secs() + 2 + 1;
    assert!(
        (1..=bound).contains(&signal_files),
        "{signal_files} snapshots for {asked} requests in {flood:?} (at most {bound}: the flood, then the waiting client's)"
    );
}

/// Dump clients that wait hold one of the program's descriptors each: past 64 waiting, a
/// client's connection is closed without an answer, and its request is served by the next
/// snapshot all the same (the counts the others are told include it).
#[test]
fn dump_clients_past_the_waiting_limit_are_closed_and_still_counted() {
    const WAITERS: usize = 80;
    let p = Program::start("top", &[]);
    p.results_until_ready();
    let path = p.socket();
    let ask = |path: &Path| {
        let mut conn = UnixStream::connect(path).unwrap();
        conn.write_all(&live::encode(&Request::Dump)).unwrap();
        conn
    };
    // Served at once: the next request snapshot is a second away.
    let mut first = ask(&path);
    let first: Answer = live::read_message(&mut first, live::MAX_ANSWER).unwrap();
    assert!(
        matches!(first, Answer::Dumped { requests: 1, .. }),
        "{first:?}"
    );
    let waiting: Vec<UnixStream> = (0..WAITERS).map(|_| ask(&path)).collect();
    let mut told = std::collections::BTreeMap::<String, (u64, usize)>::new();
    let mut closed = 0;
    for mut conn in waiting {
        match live::read_message::<Answer>(&mut conn, live::MAX_ANSWER) {
            Ok(Answer::Dumped { path, requests }) => {
                let entry = told.entry(path).or_insert((requests, 0));
                assert_eq!(entry.0, requests, "one file, one count");
                entry.1 += 1;
            }
            Ok(other) => panic!("not dumped: {other:?}"),
            Err(_) => closed += 1,
        }
    }
    let (status, _folder) = p.finish();
    assert!(status.success(), "the program was hurt: {status}");
    let answered: usize = told.values().map(|(_, n)| n).sum();
    assert_eq!(answered + closed, WAITERS);
    assert!(
        told.values().all(|&(_, n)| n <= 64),
        "more than 64 waited: {told:?}"
    );
    assert_eq!(
        told.values().map(|(r, _)| r).sum::<u64>(),
        WAITERS as u64,
        "closed clients are counted too: {told:?}"
    );
}

#[test]
fn all_finds_the_program_and_a_process_without_cuda_has_no_socket() {
    let p = Program::start("top", &[]);
    let truth = p.results_until_ready();
    p.socket();
    let idle = Program::start("wait", &["noalloc"]);
    assert_eq!(idle.results_until_ready()["ready"], "1");

    let o = memsnap(&["top", "--all", "--once", "--json"]);
    let ours: Vec<Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["pid"] == p.pid())
        .collect();
    assert_eq!(ours.len(), 1, "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        ours[0]["live_bytes"].as_u64(),
        Some(num(&truth, "live_bytes"))
    );

    // memsnap is loaded but never started: no socket, and top says why.
    assert!(!socket(idle.pid()).exists());
    let o = memsnap(&["top", &idle.pid().to_string(), "--once"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("is not recording yet"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(idle.finish().0.success());
    assert!(p.finish().0.success());
}

#[test]
fn without_a_terminal_top_prints_one_sample_per_refresh() {
    let p = Program::start("top", &[]);
    p.results_until_ready();
    p.socket();
    let mut top = Command::new(common::memsnap_bin())
        .args(["top", &p.pid().to_string(), "--interval", "0.2"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = BufReader::new(top.stdout.take().unwrap());
    let samples = out
        .lines()
        .map_while(Result::ok)
        .filter(|l| l.starts_with(&format!("pid {} step 0 device 0: live 11.0 MiB", p.pid())))
        .take(3)
        .count();
    let _ = top.kill();
    let _ = top.wait();
    assert_eq!(samples, 3);
    assert!(p.finish().0.success());
}

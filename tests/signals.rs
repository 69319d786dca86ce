//! The signals memsnap borrows, on the fake CUDA driver: the dump signal stays memsnap's
//! while the program installs, replaces, ignores, defaults, masks and blocks its own
//! handling of it (C and Python programs), and a job that ends by SIGTERM, SIGABRT,
//! SIGSEGV or SIGBUS leaves a last snapshot and ends exactly as it would have without
//! memsnap. Each test asserts what the program saw and what memsnap wrote.

mod common;

use common::{label_of, python_load_json, run_program, snapshot_files};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;

fn files_with_reason(dir: &std::path::Path, reason: &str) -> Vec<PathBuf> {
    snapshot_files(dir)
        .into_iter()
        .filter(|p| label_of(p).as_deref() == Some(reason))
        .collect()
}

#[test]
fn a_handler_installed_after_memsnap_is_chained_with_its_own_arguments() {
    let run = run_program("sigchain", &["siginfo"], &[], true);
    run.assert_success();
    let r = run.results();
    assert_eq!(
        r["old_was_default"], "1",
        "the old action is the program's own"
    );
    assert_eq!(
        r["current"], "own-siginfo",
        "sigaction reports the program's handler"
    );
    assert_eq!(r["signal_file"], "1");
    assert_eq!(r["calls"], "1");
    assert_eq!(r["last_sig"], "10");
    assert_eq!(r["last_code"], "0", "SI_USER: sent with kill()");
    assert_eq!(r["last_pid_is_self"], "1");
    assert_eq!(r["had_ctx"], "1");
    assert_eq!(
        r["usr1_blocked"], "1",
        "the signal is blocked while its handler runs"
    );
    let signal = &files_with_reason(run.dir.path(), "signal");
    assert_eq!(signal.len(), 1);
    let snap = python_load_json(&signal[0]);
    assert_eq!(snap["memsnap"]["dump_signals_received"], 1);
}

#[test]
fn signal_bsd_signal_and_sysv_signal_keep_their_semantics() {
    for mode in ["signal", "bsd"] {
        let run = run_program("sigchain", &[mode], &[], true);
        run.assert_success();
        let r = run.results();
        assert_eq!(r["old_was_default"], "1", "{mode}");
        assert_eq!(r["current"], "own-plain", "{mode}");
        assert_eq!(
            (r["calls"].as_str(), r["last_sig"].as_str()),
            ("1", "10"),
            "{mode}"
        );
        assert_eq!(r["signal_file"], "1", "{mode}");
    }
    // One-shot handlers: the first signal calls them, the second finds the default action,
    // which for the dump signal means memsnap's alone: a snapshot, and the program lives on.
    for mode in ["sysv", "resethand"] {
        let run = run_program("sigchain", &[mode], &[], true);
        run.assert_success();
        let r = run.results();
        assert_eq!(r["calls_before_second"], "1", "{mode}");
        assert_eq!(r["current"], "default", "{mode}: reset before the call");
        assert_eq!(r["second_signal_file"], "1", "{mode}");
        assert_eq!(r["calls"], "1", "{mode}: the one-shot handler ran once");
        assert_eq!(
            files_with_reason(run.dir.path(), "signal").len(),
            2,
            "{mode}"
        );
    }
}

/// The dump signal never ends the program, however its action came back to SIG_DFL: a
/// library that installed a handler and later put back the action it was told was there
/// (LLVM's signal handlers, installed by Triton's compiler during torch.compile), or whose
/// handler puts it back and raises the signal again.
#[test]
fn the_dump_signal_never_ends_the_program() {
    for mode in ["default", "restored", "reraise"] {
        let run = run_program("sigchain", &[mode], &[], true);
        run.assert_success();
        let r = run.results();
        assert_eq!(r["old_was_default"], "1", "{mode}");
        assert_eq!(r["survived"], "1", "{mode}");
        assert_eq!(r["signal_file"], "1", "{mode}");
        let expected_calls = if mode == "reraise" { "1" } else { "0" };
        assert_eq!(r["calls"], expected_calls, "{mode}: the program's handler");
        let files = files_with_reason(run.dir.path(), "signal");
        assert!(
            (1..=2).contains(&files.len()),
            "{mode}: {:?}",
            snapshot_files(run.dir.path())
        );
        // The program's second allocation, after the signal, is in the exit snapshot.
        let exit = files_with_reason(run.dir.path(), "exit");
        assert_eq!(exit.len(), 1, "{mode}");
        let snap = python_load_json(&exit[0]);
        assert_eq!(snap["segments"].as_array().unwrap().len(), 1, "{mode}");
    }
}

#[test]
fn ignored_defaulted_masked_and_blocked_signals_behave_as_the_program_asked() {
    let ignore = run_program("sigchain", &["ignore"], &[], true);
    ignore.assert_success();
    assert_eq!(ignore.results()["current"], "ignore");
    assert_eq!(
        ignore.results()["signal_file"],
        "1",
        "ignored by the program, not by memsnap"
    );

    let mask = run_program("sigchain", &["mask"], &[], true);
    mask.assert_success();
    assert_eq!(
        mask.results()["usr2_blocked"],
        "1",
        "sa_mask applied during the handler"
    );
    assert_eq!(mask.results()["usr1_blocked"], "1");
    let nodefer = run_program("sigchain", &["nodefer"], &[], true);
    nodefer.assert_success();
    assert_eq!(
        nodefer.results()["usr1_blocked"],
        "0",
        "SA_NODEFER honoured"
    );

    let blocked = run_program("sigchain", &["blocked"], &[], true);
    blocked.assert_success();
    assert_eq!(blocked.results()["files_while_blocked"], "0");
    assert_eq!(
        blocked.results()["signal_file"],
        "1",
        "delivered once unblocked"
    );
}

#[test]
fn a_signal_storm_becomes_a_few_snapshots_and_every_signal_is_counted() {
    let run = run_program("sigchain", &["storm"], &[], true);
    run.assert_success();
    let r = run.results();
    assert_eq!(r["calls"], "5000", "the program's handler saw every signal");
    let signal = files_with_reason(run.dir.path(), "signal");
    assert!(
        !signal.is_empty() && signal.len() < 100,
        "{} snapshots for 5000 signals",
        signal.len()
    );
    let exit = &files_with_reason(run.dir.path(), "exit")[0];
    let snap = python_load_json(exit);
    assert_eq!(snap["memsnap"]["dump_signals_received"], 5000);
    // Every allocation and free made during the storm is in the ledger: only the 2 MiB
    // block allocated after it is live at exit.
    let live: u64 = snap["segments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["allocated_size"].as_u64().unwrap())
        .sum();
    assert_eq!(live, 2 << 20);
}

/// A flood of dump signals (2,000 in about 2 s, from a thread of the program) costs at
/// most one snapshot a second (the floor, docs/SIGNALS.md): the program ends with its own
/// status and output, and every signal it took is counted.
#[test]
fn a_flood_of_dump_signals_is_held_to_one_snapshot_a_second() {
    let run = run_program("sigchain", &["flood"], &[], true);
    assert_eq!(run.status.code(), Some(3), "{}", run.stderr);
    let r = run.results();
    assert_eq!(r["survived"], "1");
    let flood_ms: u64 = r["flood_ms"].parse().unwrap();
    let calls: u64 = r["calls"].parse().unwrap();
    assert!(calls > 0 && r["allocs"].parse::<u64>().unwrap() > 0);
    let signal = files_with_reason(run.dir.path(), "signal");
    let bound = flood_ms / 1000 + 2;
    assert!(
        !signal.is_empty() && signal.len() as u64 <= bound,
        "{} snapshots for {calls} signals in {flood_ms} ms (at most {bound})",
        signal.len()
    );
    let exit = &files_with_reason(run.dir.path(), "exit")[0];
    let snap = python_load_json(exit);
    assert_eq!(snap["memsnap"]["dump_signals_received"], calls);
}

#[test]
fn python_signal_handlers_and_faulthandler_are_chained() {
    let run = run_program("py_signals.py", &["signal"], &[], true);
    run.assert_success();
    let r = run.results();
    assert_eq!(r["previous_is_default"], "1");
    assert_eq!(r["signal_file"], "1");
    assert_eq!(r["handler_args_ok"], "1", "{r:?}");
    assert_eq!(r["current_is_ours"], "1");

    let run = run_program("py_signals.py", &["faulthandler"], &[], true);
    run.assert_success();
    assert_eq!(run.results()["signal_file"], "1");
    assert_eq!(run.results()["traceback_names_this_file"], "1");
}

/// How a crash-mode run ended, with and without memsnap, and the snapshot it left.
fn crash(mode: &str, env: &[(&str, &str)]) -> (common::Run, common::Run) {
    let plain = run_program("crash", &[mode], env, false);
    let with = run_program("crash", &[mode], env, true);
    assert_eq!(
        (with.status.code(), with.status.signal()),
        (plain.status.code(), plain.status.signal()),
        "{mode}: memsnap changed how the program ended\n{}",
        with.stderr
    );
    assert_eq!(
        with.results().get("handler"),
        plain.results().get("handler"),
        "{mode}: the program's handler"
    );
    (plain, with)
}

#[test]
fn a_job_ending_by_a_signal_leaves_a_snapshot_and_ends_as_it_would_have() {
    // (mode, killed by, exit code, reason, signal name, has the crashing thread's stack)
    type Case = (
        &'static str,
        Option<i32>,
        Option<i32>,
        &'static str,
        &'static str,
        bool,
    );
    let cases: [Case; 7] = [
        ("term", Some(libc::SIGTERM), None, "term", "SIGTERM", false),
        ("term-handler", None, Some(7), "term", "SIGTERM", false),
        ("abort", Some(libc::SIGABRT), None, "crash", "SIGABRT", true),
        (
            "abort-handler",
            Some(libc::SIGABRT),
            None,
            "crash",
            "SIGABRT",
            true,
        ),
        ("segv", Some(libc::SIGSEGV), None, "crash", "SIGSEGV", true),
        (
            "segv-handler",
            Some(libc::SIGSEGV),
            None,
            "crash",
            "SIGSEGV",
            true,
        ),
        ("bus", Some(libc::SIGBUS), None, "crash", "SIGBUS", true),
    ];
    for (mode, signal, code, reason, name, with_stack) in cases {
        let (_, run) = crash(mode, &[]);
        assert_eq!(run.status.signal(), signal, "{mode}");
        assert_eq!(run.status.code(), code, "{mode}");
        if mode.ends_with("-handler") {
            assert!(
                run.results().contains_key("handler"),
                "{mode}: handler not called"
            );
        }
        let files = files_with_reason(run.dir.path(), reason);
        assert_eq!(
            files.len(),
            1,
            "{mode}: {:?}",
            snapshot_files(run.dir.path())
        );
        let snap = python_load_json(&files[0]);
        assert_eq!(snap["memsnap"]["signal"]["name"], name, "{mode}");
        // 5 MiB live: the state at the signal.
        assert_eq!(snap["segments"].as_array().unwrap().len(), 1, "{mode}");
        let last = snap["device_traces"][0]
            .as_array()
            .unwrap()
            .last()
            .unwrap()
            .clone();
        assert_eq!(
            last["action"], "snapshot",
            "{mode}: the signal is the last event"
        );
        let frames: Vec<String> = last["frames"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["name"].as_str().unwrap_or("").to_string())
            .collect();
        if with_stack {
            assert!(
                frames.iter().any(|f| f == "crash_here"),
                "{mode}: the signalled thread's stack: {frames:?}"
            );
        } else {
            assert!(frames.is_empty(), "{mode}: SIGTERM has no meaningful stack");
        }
    }
}

/// Ctrl-C, a closed terminal and Ctrl-\ end a job as SIGTERM does: a `term` snapshot, then
/// the end the program would have had. A program that handles or ignores them lives on,
/// with no snapshot and no delay.
#[test]
fn signals_from_a_terminal_leave_a_snapshot_when_they_end_the_job() {
    for (mode, signal, name) in [
        ("int", libc::SIGINT, "SIGINT"),
        ("hup", libc::SIGHUP, "SIGHUP"),
        ("quit", libc::SIGQUIT, "SIGQUIT"),
    ] {
        let (_, run) = crash(mode, &[]);
        assert_eq!(run.status.signal(), Some(signal), "{mode}");
        let files = files_with_reason(run.dir.path(), "term");
        assert_eq!(
            files.len(),
            1,
            "{mode}: {:?}",
            snapshot_files(run.dir.path())
        );
        let snap = python_load_json(&files[0]);
        assert_eq!(snap["memsnap"]["signal"]["name"], name, "{mode}");
        assert_eq!(snap["segments"].as_array().unwrap().len(), 1, "{mode}");
    }
    for mode in ["int-handler", "hup-ignored"] {
        let (_, run) = crash(mode, &[]);
        run.assert_success();
        assert_eq!(run.results()["survived"], "1", "{mode}");
        assert!(
            files_with_reason(run.dir.path(), "term").is_empty(),
            "{mode}: {:?}",
            snapshot_files(run.dir.path())
        );
        assert_eq!(files_with_reason(run.dir.path(), "exit").len(), 1, "{mode}");
    }
}

/// Ctrl-C on a Python job: the `KeyboardInterrupt` ends it, and Python ends itself with
/// SIGINT (its exit status, 130 in a shell, tells the caller so); the `term` snapshot holds
/// what was live then.
#[test]
fn ctrl_c_on_a_python_job_leaves_a_snapshot() {
    let run = run_program("py_signals.py", &["ctrl-c"], &[], true);
    assert_eq!(run.status.signal(), Some(libc::SIGINT), "{}", run.stderr);
    assert!(run.stderr.contains("KeyboardInterrupt"), "{}", run.stderr);
    assert!(!run.results().contains_key("survived"));
    let files = files_with_reason(run.dir.path(), "term");
    assert_eq!(files.len(), 1, "{:?}", snapshot_files(run.dir.path()));
    let snap = python_load_json(&files[0]);
    assert_eq!(snap["memsnap"]["signal"]["name"], "SIGINT");
    let live: u64 = snap["segments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["allocated_size"].as_u64().unwrap())
        .sum();
    assert_eq!(live, 3 << 20, "the 1 MiB and 2 MiB blocks held at Ctrl-C");
}

#[test]
fn at_crash_off_leaves_the_crash_signals_alone() {
    let (_, run) = crash("segv", &[("MEMSNAP_AT_CRASH", "0")]);
    assert_eq!(run.status.signal(), Some(libc::SIGSEGV));
    assert!(files_with_reason(run.dir.path(), "crash").is_empty());
}

/// A second signal that ends the job while the first one's snapshot is being written (two
/// threads faulting together, SIGTERM twice) is held until the snapshot is on disk; the
/// process then ends with the first signal, as it would have without memsnap.
#[test]
fn a_second_ending_signal_waits_for_the_first_ones_snapshot() {
    let cases = [
        ("double-term", libc::SIGTERM, "term", "SIGTERM"),
        ("two-faults", libc::SIGSEGV, "crash", "SIGSEGV"),
    ];
    for (mode, signal, reason, name) in cases {
        // Several tries: without the hold, most of them lose the snapshot.
        for attempt in 0..3 {
            let (_, run) = crash(mode, &[]);
            assert_eq!(run.status.signal(), Some(signal), "{mode} #{attempt}");
            let files = files_with_reason(run.dir.path(), reason);
            assert_eq!(
                files.len(),
                1,
                "{mode} #{attempt}: {:?}\n{}",
                snapshot_files(run.dir.path()),
                run.stderr
            );
            let snap = python_load_json(&files[0]);
            assert_eq!(snap["memsnap"]["signal"]["name"], name, "{mode} #{attempt}");
        }
    }
}

/// The pids `fork_signal` forked.
fn child_pids(run: &common::Run) -> Vec<String> {
    run.results()["child_pids"]
        .split(',')
        .map(str::to_string)
        .collect()
}

/// The files in the run's folder written by process `pid`.
fn files_of(run: &common::Run, pid: &str) -> Vec<PathBuf> {
    snapshot_files(run.dir.path())
        .into_iter()
        .filter(|p| p.to_string_lossy().contains(&format!("-p{pid}-")))
        .collect()
}

/// A child forked from a recording process (a DataLoader worker, a multiprocessing.Pool
/// worker) that never allocated has no writer: a signal that ends it must not wait for one
/// (`MEMSNAP_CRASH_WAIT`, 5 s), and it ends exactly as it would without memsnap.
#[test]
fn a_forked_child_that_never_recorded_dies_at_once_as_without_memsnap() {
    for mode in ["term", "segv", "abort"] {
        // Four children at once, as Pool(4).terminate() stops them.
        let plain = run_program("fork_signal", &[mode, "4"], &[], false);
        let with = run_program("fork_signal", &[mode, "4"], &[], true);
        with.assert_success();
        assert_eq!(
            with.results()["child_signal"],
            plain.results()["child_signal"],
            "{mode}"
        );
        let died_ms: f64 = with.results()["died_ms"].parse().unwrap();
        assert!(
            died_ms < 1000.0,
            "{mode}: the children took {died_ms} ms to die\n{}",
            with.stderr
        );
        for pid in child_pids(&with) {
            assert!(
                files_of(&with, &pid).is_empty(),
                "{mode}: child {pid} wrote"
            );
        }
    }
}

/// A forked child that allocates records on its own (its own writer), and a signal that
/// ends it leaves its own snapshot with what the child holds.
#[test]
fn a_forked_child_that_records_gets_its_own_crash_snapshot() {
    let cases = [
        ("record-term", libc::SIGTERM, "term", "SIGTERM"),
        ("record-segv", libc::SIGSEGV, "crash", "SIGSEGV"),
    ];
    for (mode, signal, reason, name) in cases {
        let run = run_program("fork_signal", &[mode], &[], true);
        run.assert_success();
        assert_eq!(run.results()["child_signal"], signal.to_string(), "{mode}");
        let child = &child_pids(&run)[0];
        let files: Vec<PathBuf> = files_of(&run, child)
            .into_iter()
            .filter(|p| label_of(p).as_deref() == Some(reason))
            .collect();
        assert_eq!(
            files.len(),
            1,
            "{mode}: {:?}\n{}",
            snapshot_files(run.dir.path()),
            run.stderr
        );
        let snap = python_load_json(&files[0]);
        assert_eq!(snap["memsnap"]["signal"]["name"], name, "{mode}");
        assert_eq!(snap["memsnap"]["pid"].as_u64().unwrap().to_string(), *child);
        let live: u64 = snap["segments"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["allocated_size"].as_u64().unwrap())
            .sum();
        assert_eq!(live, 2 << 20, "{mode}: the child's own 2 MiB");
    }
}

/// The per-user folder of the live sockets and acknowledgement files.
fn private_folder() -> PathBuf {
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    PathBuf::from(format!("/tmp/memsnap-{uid}"))
}

/// `wait` with the preload, once it said it is ready (its stdin piped: closing it ends it).
fn spawn_wait(folder: &std::path::Path, env: &[(&str, &str)]) -> std::process::Child {
    use std::io::{BufRead, BufReader};
    let mut cmd = std::process::Command::new(common::program_path("wait"));
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        if key.starts_with("MEMSNAP_") || key.starts_with("FAKE_CUDA") || key == "LD_PRELOAD" {
            cmd.env_remove(key.as_ref());
        }
    }
    let mut child = cmd
        .env("LD_LIBRARY_PATH", common::fake_lib_dir())
        .env("LD_PRELOAD", common::preload_lib())
        .env("MEMSNAP_FOLDER", folder)
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "result ready=1");
    std::thread::spawn(move || for _ in out.lines() {});
    child
}

fn send(pid: u32, signal: &str) {
    let ok = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{signal} {pid}");
}

fn eventually(done: impl Fn() -> bool) -> bool {
    let start = std::time::Instant::now();
    while !done() && start.elapsed() < std::time::Duration::from_secs(30) {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    done()
}

/// A process ended by SIGTERM (or any ending signal's default action) takes its live socket
/// and acknowledgement file with it.
#[test]
fn a_job_ended_by_a_signal_leaves_no_socket_or_acknowledgement() {
    let dir = tempfile::tempdir().unwrap();
    for signal in ["TERM", "SEGV", "ABRT"] {
        let mut child = spawn_wait(dir.path(), &[]);
        let pid = child.id();
        let socket = private_folder().join(format!("{pid}.sock"));
        let ack = private_folder().join(format!("{pid}.ack"));
        assert!(eventually(|| socket.exists()), "{signal}: no socket");
        send(pid, "USR1");
        assert!(eventually(|| ack.exists()), "{signal}: no acknowledgement");
        send(pid, signal);
        let status = child.wait().unwrap();
        assert!(status.signal().is_some(), "{signal}: {status}");
        assert!(!socket.exists(), "{signal}: {} left", socket.display());
        assert!(!ack.exists(), "{signal}: {} left", ack.display());
    }
}

/// A pid that no process has now (one that just ran and was reaped).
fn dead_pid() -> u32 {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

/// What processes killed outright left (sockets and acknowledgements in the private
/// folder, hidden temporaries in the snapshot folder) is removed by the next process that
/// records: the private folder's entries when it starts, a folder's temporaries when it
/// first writes there. Those of live processes stay, and so does every hidden file memsnap
/// cannot prove it made: the user's own `.NAME.tmp.N` files, and a temporary of another
/// host or boot.
#[test]
fn what_dead_processes_left_is_removed_by_the_next_one() {
    use std::os::unix::fs::DirBuilderExt;
    let dead = dead_pid();
    let _ = std::fs::DirBuilder::new()
        .mode(0o700)
        .create(private_folder());
    let left: Vec<PathBuf> = ["sock", "ack", "ack.tmp"]
        .iter()
        .map(|kind| private_folder().join(format!("{dead}.{kind}")))
        .collect();
    for path in &left {
        std::fs::write(path, "left behind").unwrap();
    }
    // `.memsnap-tmp.HOST.BOOT.PIDNS.PID.RANDOM`, as this host and boot name it.
    let proc = |file: &str| std::fs::read_to_string(file).unwrap().trim().to_string();
    let host = memsnap_format::config::sanitize(&proc("/proc/sys/kernel/hostname"));
    let boot = proc("/proc/sys/kernel/random/boot_id").replace('-', "");
    let namespace = std::fs::read_link("/proc/self/ns/pid").unwrap();
    let namespace = namespace.to_str().unwrap();
    let namespace = &namespace["pid:[".len()..namespace.len() - 1];
    let temporary = |host: &str, boot: &str, pid: u32| {
        format!(".memsnap-tmp.{host}.{boot}.{namespace}.{pid}.0123456789abcdef")
    };
    let folder = tempfile::tempdir().unwrap();
    let stale = folder.path().join(temporary(&host, &boot, dead));
    let kept: Vec<PathBuf> = [
        temporary(&host, &boot, std::process::id()),
        temporary("otherhost", &boot, dead),
        temporary(&host, &"0".repeat(32), dead),
        format!(".a.pickle.tmp.{dead}"),
        format!(".b.pickle.tmp.{dead}.0123456789abcdef"),
        ".notes.tmp.99999999".to_string(),
        ".config.json.tmp.3141592653".to_string(),
        ".report.md.tmp.424242.bak".to_string(),
    ]
    .iter()
    .map(|name| folder.path().join(name))
    .collect();
    for path in kept.iter().chain([&stale]) {
        std::fs::write(path, "partial").unwrap();
    }
    let folder_value = folder.path().to_str().unwrap();
    let run = run_program("demo", &[], &[("MEMSNAP_FOLDER", folder_value)], true);
    run.assert_success();
    for path in left.iter().chain([&stale]) {
        assert!(!path.exists(), "{} is still there", path.display());
    }
    for path in &kept {
        assert_eq!(
            std::fs::read(path).unwrap(),
            b"partial",
            "{} was touched",
            path.display()
        );
    }
}

/// The temporary a snapshot is written through has no name anyone can predict: a file or
/// folder someone put at the old name (`.NAME.tmp.PID`) blocks nothing.
#[test]
fn a_predictable_temporary_cannot_block_a_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = spawn_wait(dir.path(), &[("MEMSNAP_FILENAME", "snap.pickle")]);
    let blocker = dir.path().join(format!(".snap.pickle.tmp.{}", child.id()));
    std::fs::create_dir(&blocker).unwrap();
    std::fs::write(blocker.join("x"), "in the way").unwrap();
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    assert!(
        dir.path().join("snap.pickle").is_file(),
        "{:?}",
        snapshot_files(dir.path())
    );
    assert!(
        blocker.join("x").exists(),
        "someone else's entry is left alone"
    );
}

/// The snapshot folder is held once memsnap opened it: moved away mid-run and replaced by a
/// link to another folder, the next snapshots still go into the folder memsnap opened, and
/// nothing is written where the link points.
#[test]
fn a_folder_swapped_for_a_link_mid_run_does_not_redirect_snapshots() {
    let top = tempfile::tempdir().unwrap();
    let snaps = top.path().join("snaps");
    let moved = top.path().join("moved");
    let elsewhere = top.path().join("elsewhere");
    std::fs::create_dir(&snaps).unwrap();
    std::fs::create_dir(&elsewhere).unwrap();
    let mut child = spawn_wait(&snaps, &[]);
    send(child.id(), "USR1");
    assert!(eventually(|| snapshot_files(&snaps).len() == 1));
    std::fs::rename(&snaps, &moved).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &snaps).unwrap();
    send(child.id(), "USR1");
    assert!(eventually(|| snapshot_files(&moved).len() == 2));
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    let written = snapshot_files(&moved);
    let mut labels: Vec<_> = written.iter().filter_map(|p| label_of(p)).collect();
    labels.sort();
    assert_eq!(labels, ["exit", "signal", "signal"], "{written:?}");
    assert!(snapshot_files(&elsewhere).is_empty());
}

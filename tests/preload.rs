//! libmemsnap.so end to end, on the fake CUDA driver: every route recorded exactly once,
//! live bytes equal to the driver's own count, the exit/OOM/signal files, fork, threads,
//! back-pressure, file naming, and every snapshot valid for PyTorch's viewer (checked by
//! tests/python/check_snapshot.py, which replays the viewer's backward walk).

mod common;

use common::{Run, label_of, num, python_load_json, python_script, run_program, snapshot_files};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Runs the independent Python checker; panics with its report unless the file is valid.
fn assert_valid(path: &Path) {
    python_script("tests/python/check_snapshot.py", path);
}

/// The only snapshot written for `reason`.
fn file_for(run: &Run, reason: &str) -> PathBuf {
    let files: Vec<PathBuf> = snapshot_files(run.dir.path())
        .into_iter()
        .filter(|p| label_of(p).as_deref() == Some(reason))
        .collect();
    assert_eq!(
        files.len(),
        1,
        "expected one {reason} snapshot, found {files:?}\nstderr: {}",
        run.stderr
    );
    files.into_iter().next().unwrap()
}

/// (bytes, count) of active blocks per device.
fn live_by_device(snap: &Value) -> BTreeMap<i64, (u64, u64)> {
    let mut out = BTreeMap::new();
    for seg in snap["segments"].as_array().unwrap() {
        let dev = seg["device"].as_i64().unwrap();
        for b in seg["blocks"].as_array().unwrap() {
            if b["state"] == "active_allocated" {
                let e = out.entry(dev).or_insert((0, 0));
                e.0 += b["size"].as_u64().unwrap();
                e.1 += 1;
            }
        }
    }
    out
}

fn actions(snap: &Value, device: usize, action: &str) -> Vec<Value> {
    snap["device_traces"][device]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["action"] == action)
        .cloned()
        .collect()
}

fn meta(snap: &Value, key: &str) -> u64 {
    snap["memsnap"][key]
        .as_u64()
        .unwrap_or_else(|| panic!("no memsnap.{key}"))
}

/// Runs `program`, checks its one exit snapshot against the fake driver's truth, and
/// returns the run and the snapshot.
fn run_and_match_truth(program: &str, args: &[&str]) -> (Run, Value) {
    let run = run_program(program, args, &[], true);
    run.assert_success();
    let path = file_for(&run, "exit");
    assert_valid(&path);
    let snap = python_load_json(&path);
    let live = live_by_device(&snap);
    for t in run.truth().iter().filter(|t| t.contains_key("device")) {
        let dev: i64 = t["device"].parse().unwrap();
        let bytes = num(t, "live_bytes") + num(t, "mapped_bytes");
        let (got_bytes, _) = live.get(&dev).copied().unwrap_or((0, 0));
        assert_eq!(got_bytes, bytes, "{program}: live bytes on device {dev}");
        if num(t, "mapped_bytes") == 0 {
            let (_, got_count) = live.get(&dev).copied().unwrap_or((0, 0));
            assert_eq!(
                got_count,
                num(t, "live_count"),
                "{program}: live allocations on device {dev}"
            );
        }
    }
    assert_eq!(meta(&snap, "dropped_events"), 0);
    (run, snap)
}

#[test]
fn static_runtime_is_seen_through_dlsym_and_nested_cu_get_proc_address() {
    let (run, snap) = run_and_match_truth("static_rt", &[]);
    let r = run.results();
    // The only way in: dlsym(libcuda, "cuGetProcAddress_v2"), then the nested lookup.
    assert!(snap["memsnap"]["routes"]["dlsym"].as_u64().unwrap() >= 1);
    assert!(
        snap["memsnap"]["routes"]["cuGetProcAddress"]
            .as_u64()
            .unwrap()
            >= 1
    );
    // Exactly once: one alloc event per successful driver allocation call (managed memory
    // stays out of device traces, as the format asks).
    let driver_allocs: u64 = [
        "cuMemAlloc_v2_calls",
        "cuMemAllocAsync_calls",
        "cuMemAllocAsync_ptsz_calls",
        "cuMemAllocFromPoolAsync_calls",
        "cuMemAllocPitch_v2_calls",
    ]
    .iter()
    .map(|k| num(&r, k))
    .sum();
    let allocs = actions(&snap, 0, "alloc");
    assert_eq!(allocs.len() as u64, driver_allocs);
    assert!(
        allocs
            .iter()
            .all(|a| a["user_metadata"].as_str().unwrap().starts_with("cuMem"))
    );
    assert_eq!(
        meta(&snap, "managed_live_bytes"),
        num(&r, "expected_managed_bytes")
    );
    // Frees: cuMemFree + cuMemFreeAsync(+_ptsz), each once.
    let frees = actions(&snap, 0, "free_completed").len() as u64;
    assert_eq!(
        frees,
        1 + num(&r, "cuMemFreeAsync_calls") + num(&r, "cuMemFreeAsync_ptsz_calls")
    );
}

#[test]
fn shared_runtime_is_recorded_once_at_the_runtime_level() {
    let (_, snap) = run_and_match_truth("shared_rt", &[]);
    let allocs = actions(&snap, 0, "alloc");
    // cudaMalloc x3, cudaMallocAsync x5 (incl. _ptsz), FromPool, Pitch, 3D: the driver calls
    // underneath are suppressed by the nesting guard.
    let apis: Vec<&str> = allocs
        .iter()
        .map(|a| a["user_metadata"].as_str().unwrap())
        .collect();
    assert_eq!(apis.len(), 11, "{apis:?}");
    assert!(apis.iter().all(|a| a.starts_with("cuda")), "{apis:?}");
    assert_eq!(apis.iter().filter(|a| **a == "cudaMalloc").count(), 3);
    assert_eq!(apis.iter().filter(|a| **a == "cudaMalloc3D").count(), 1);
}

#[test]
fn direct_driver_calls_through_the_plt() {
    let (_, snap) = run_and_match_truth("driver_direct", &[]);
    assert!(
        actions(&snap, 0, "alloc")
            .iter()
            .all(|a| a["user_metadata"].as_str().unwrap().starts_with("cuMem"))
    );
}

/// A process that sees one device has every allocation on device 0: the driver is asked
/// for the device once (the first allocation, before memsnap has counted the devices),
/// where with two it is asked at every allocation (driver_direct makes seven).
#[test]
fn a_process_that_sees_one_device_is_not_asked_for_the_device_at_every_allocation() {
    for (devices, queries) in [("1", 1), ("2", 7)] {
        let run = run_program(
            "driver_direct",
            &[],
            &[("FAKE_CUDA_DEVICES", devices)],
            true,
        );
        run.assert_success();
        let r = run.results();
        assert_eq!(
            num(&r, "cuCtxGetDevice_calls"),
            queries,
            "{devices} device(s)"
        );
        let snap = python_load_json(&file_for(&run, "exit"));
        let live = live_by_device(&snap);
        assert_eq!(
            live.get(&0).copied(),
            Some((num(&r, "expected_live_bytes"), 3)),
            "{devices} device(s): every allocation on device 0"
        );
        assert_eq!(live.len(), 1, "{devices} device(s): {live:?}");
        assert_eq!(meta(&snap, "dropped_events"), 0);
    }
}

#[test]
fn expandable_segments_route_records_mappings_as_segment_map() {
    for args in [&[][..], &["legacy"][..]] {
        let (run, snap) = run_and_match_truth("expandable", args);
        let r = run.results();
        let maps = actions(&snap, 0, "segment_map");
        let unmaps = actions(&snap, 0, "segment_unmap");
        assert_eq!(maps.len(), 4, "{args:?}: four cuMemMap calls");
        assert_eq!(unmaps.len(), 1, "{args:?}: one cuMemUnmap");
        // Three contiguous mappings remain: one expandable segment with three blocks.
        let segs = snap["segments"].as_array().unwrap();
        assert_eq!(segs.len(), 1);
        assert_eq!(segs[0]["is_expandable"], true);
        assert_eq!(segs[0]["blocks"].as_array().unwrap().len(), 3);
        assert_eq!(
            segs[0]["total_size"].as_u64().unwrap(),
            num(&r, "expected_mapped_bytes")
        );
    }
}

#[test]
fn jax_style_dlsym_route() {
    let (_, snap) = run_and_match_truth("jax_dlsym", &[]);
    assert!(snap["memsnap"]["routes"]["dlsym"].as_u64().unwrap() >= 5);
    assert!(!actions(&snap, 0, "segment_map").is_empty());
    assert!(!actions(&snap, 0, "segment_alloc").is_empty());
}

#[test]
fn multiple_devices_get_one_trace_each() {
    let (_, snap) = run_and_match_truth("multi_device", &[]);
    let traces = snap["device_traces"].as_array().unwrap();
    assert_eq!(traces.len(), 2);
    assert!(traces.iter().all(|t| !t.as_array().unwrap().is_empty()));
}

#[test]
fn eight_threads_allocating_concurrently_match_the_driver() {
    let (run, snap) = run_and_match_truth("threads", &[]);
    assert_eq!(num(&run.results(), "threads"), 8);
    assert!(snap["device_traces"][0].as_array().unwrap().len() > 1000);
}

#[test]
fn oom_snapshot_is_written_before_the_failing_call_returns() {
    let run = run_program("oom", &[], &[("FAKE_CUDA_CAPACITY", "64M")], true);
    run.assert_success();
    let r = run.results();
    assert_eq!(r["oom_file_before_return"], "1", "{}", run.stderr);
    assert_eq!(r["oom_untouched_out_param"], "1");
    assert_eq!(r["retry_ok"], "1");
    let path = file_for(&run, "oom"); // one file: the retry's episode is debounced
    assert_valid(&path);
    let snap = python_load_json(&path);
    let ooms = actions(&snap, 0, "oom");
    assert_eq!(ooms.len(), 1);
    assert_eq!(ooms[0]["size"].as_u64().unwrap(), num(&r, "oom_size"));
    // device_free comes from the driver: capacity minus what is allocated.
    let held = num(&r, "oom_at") * num(&r, "oom_size");
    assert_eq!(ooms[0]["device_free"].as_u64().unwrap(), (64 << 20) - held);
    assert_eq!(live_by_device(&snap)[&0], (held, num(&r, "oom_at")));
    // The exit snapshot also holds the OOM event, and the final state.
    let exit = python_load_json(&file_for(&run, "exit"));
    assert_eq!(live_by_device(&exit)[&0].0, num(&r, "expected_live_bytes"));
}

#[test]
fn signal_dumps_and_chains_to_the_programs_own_handler() {
    let run = run_program("signal", &[], &[], true);
    run.assert_success();
    assert_eq!(run.results()["signal_file"], "1");
    let signal = python_load_json(&file_for(&run, "signal"));
    let exit = python_load_json(&file_for(&run, "exit"));
    assert!(
        live_by_device(&signal)[&0].0 < live_by_device(&exit)[&0].0,
        "the signal file is the earlier state"
    );

    let own = run_program("signal", &["own-handler"], &[], true);
    own.assert_success();
    assert_eq!(own.results()["signal_file"], "1");
    assert_eq!(
        own.results()["own_handler_calls"],
        "1",
        "memsnap chains to the handler installed before it"
    );

    // A handler installed after memsnap's: both still work (tests/signals.rs has the rest).
    let late = run_program("signal", &["late-handler"], &[], true);
    late.assert_success();
    assert_eq!(late.results()["signal_file"], "1");
    assert_eq!(late.results()["own_handler_calls"], "1");

    let off = run_program(
        "signal",
        &["own-handler"],
        &[("MEMSNAP_SIGNAL", "none")],
        true,
    );
    off.assert_success();
    assert_eq!(off.results()["own_handler_calls"], "1");
    let reasons: Vec<Option<String>> = snapshot_files(off.dir.path())
        .iter()
        .map(|p| label_of(p))
        .collect();
    assert!(
        reasons.iter().all(|r| r.as_deref() == Some("exit")),
        "{reasons:?}"
    );
}

#[test]
fn exit_file_and_the_line_that_names_it() {
    let run = run_program("demo", &[], &[], true);
    run.assert_success();
    let path = file_for(&run, "exit");
    assert!(
        run.stderr.contains(&path.display().to_string()),
        "{}",
        run.stderr
    );
    assert!(run.stderr.contains("memsnap summary"), "{}", run.stderr);
    let quiet = run_program("demo", &[], &[("MEMSNAP_AT_EXIT", "0")], true);
    quiet.assert_success();
    assert!(snapshot_files(quiet.dir.path()).is_empty());
}

#[test]
fn a_process_without_cuda_gets_no_thread_no_file_no_output() {
    let run = run_program("nocuda", &[], &[], true);
    run.assert_success();
    assert!(snapshot_files(run.dir.path()).is_empty());
    assert_eq!(run.stderr, "");
    assert_eq!(run.stdout.trim(), "hello");
}

#[test]
fn fork_child_neither_hangs_nor_corrupts_the_parent() {
    for mode in [&[][..], &["early"][..]] {
        let (run, snap) = run_and_match_truth("fork", mode);
        assert_eq!(run.results()["child_exit_ok"], "1", "{mode:?}");
        // Only the parent's process wrote files.
        let pid = run.results()["parent_pid"].clone();
        for f in snapshot_files(run.dir.path()) {
            assert!(f.to_string_lossy().contains(&format!("-p{pid}-")), "{f:?}");
        }
        assert_eq!(snap["memsnap"]["pid"].as_u64().unwrap().to_string(), pid);
    }
}

#[test]
fn capped_history_keeps_the_newest_entries_and_stays_valid() {
    let run = run_program("threads", &[], &[("MEMSNAP_MAX_ENTRIES", "500")], true);
    run.assert_success();
    let path = file_for(&run, "exit");
    assert_valid(&path);
    let snap = python_load_json(&path);
    for t in snap["device_traces"].as_array().unwrap() {
        assert_eq!(t.as_array().unwrap().len(), 500);
    }
    assert_eq!(snap["allocator_settings"]["trace_alloc_overflowed"], true);
    // Segments stay complete even though the history is capped.
    let truth0 = run.truth_device(0);
    assert_eq!(live_by_device(&snap)[&0].0, num(&truth0, "live_bytes"));
}

#[test]
fn back_pressure_is_counted_reported_once_and_the_snapshot_stays_valid() {
    let run = run_program("threads", &[], &[("MEMSNAP_QUEUE_CAPACITY", "16")], true);
    run.assert_success();
    let path = file_for(&run, "exit");
    assert_valid(&path);
    let snap = python_load_json(&path);
    let dropped = meta(&snap, "dropped_events");
    if dropped > 0 {
        assert_eq!(
            run.stderr.matches("events were dropped").count(),
            1,
            "{}",
            run.stderr
        );
        assert_eq!(
            dropped,
            meta(&snap, "dropped_allocs") + meta(&snap, "dropped_frees")
        );
    }
    // Whatever was dropped, nothing is lost silently: events recorded + dropped = calls made.
    let r = run.results();
    let calls = num(&r, "threads") * num(&r, "ops_per_thread");
    assert!(
        meta(&snap, "events_recorded") + dropped >= calls,
        "{} + {dropped} < {calls}",
        meta(&snap, "events_recorded")
    );
}

#[test]
fn file_names_follow_the_template_and_never_collide() {
    let folder = tempfile::tempdir().unwrap();
    let f = folder.path().to_str().unwrap();
    let env = [
        ("MEMSNAP_FOLDER", f),
        ("MEMSNAP_FILENAME", "r{rank}-{reason}.pickle"),
        ("RANK", "3"),
    ];
    run_program("demo", &[], &env, true).assert_success();
    run_program("demo", &[], &env, true).assert_success();
    let names: Vec<String> = snapshot_files(folder.path())
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["r3-exit-1.pickle", "r3-exit.pickle"]);
    let env = [
        ("MEMSNAP_FOLDER", f),
        ("MEMSNAP_FILENAME", "r{rank}-{reason}.pickle"),
        ("RANK", "3"),
        ("MEMSNAP_OVERWRITE", "1"),
    ];
    run_program("demo", &[], &env, true).assert_success();
    assert_eq!(
        snapshot_files(folder.path()).len(),
        2,
        "overwritten in place"
    );
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(folder.path().join("r3-exit.pickle"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}

#[test]
fn a_bad_variable_gets_one_message_and_the_default() {
    let run = run_program(
        "demo",
        &[],
        &[("MEMSNAP_MAX_ENTRIES", "lots"), ("MEMSNAP_STACKS", "some")],
        true,
    );
    run.assert_success();
    let messages: Vec<&str> = run
        .stderr
        .lines()
        .filter(|l| l.contains("ignoring"))
        .collect();
    assert_eq!(messages.len(), 2, "{}", run.stderr);
    assert!(messages[0].contains("MEMSNAP_MAX_ENTRIES") && messages[0].contains("whole number"));
    assert!(
        messages[1].contains("MEMSNAP_STACKS") && messages[1].contains("none, python, native, all")
    );
    file_for(&run, "exit");
}

#[test]
fn an_unwritable_folder_is_one_warning_and_the_program_runs_on() {
    let run = run_program(
        "demo",
        &[],
        &[("MEMSNAP_FOLDER", "/proc/memsnap-cannot-write-here")],
        true,
    );
    run.assert_success();
    assert_eq!(
        run.stderr.matches("could not write").count(),
        1,
        "{}",
        run.stderr
    );
}

#[test]
fn disabled_means_pass_through() {
    let (_, with) = run_and_match_truth("static_rt", &[]);
    let run = run_program("static_rt", &[], &[("MEMSNAP_DISABLE", "1")], true);
    run.assert_success();
    assert!(snapshot_files(run.dir.path()).is_empty());
    assert!(!with["segments"].as_array().unwrap().is_empty());
}

#[test]
fn the_exit_line_names_the_absolute_folder_and_says_when_memsnap_created_it() {
    let base = tempfile::tempdir().unwrap();
    let deep = base.path().join("typo").join("deep");
    let run = run_program(
        "static_rt",
        &[],
        &[("MEMSNAP_FOLDER", deep.to_str().unwrap())],
        true,
    );
    run.assert_success();
    assert!(deep.is_dir());
    assert!(
        run.stderr
            .contains(&format!("in {}, a folder memsnap created:", deep.display())),
        "{}",
        run.stderr
    );

    // A folder that was there already: named, not called new.
    let run = run_program(
        "static_rt",
        &[],
        &[("MEMSNAP_FOLDER", deep.to_str().unwrap())],
        true,
    );
    run.assert_success();
    assert!(
        run.stderr.contains(&format!("in {}: ", deep.display())),
        "{}",
        run.stderr
    );
    assert!(
        !run.stderr.contains("a folder memsnap created"),
        "{}",
        run.stderr
    );
}

/// A program that closes every descriptor it did not open (daemonizing code, `close_range`)
/// and opens its own files, which get the numbers memsnap's had: memsnap writes nothing into
/// them and reads nothing out of them, its wake-ups and dumps still work, its live socket
/// is opened again, and the record is whole.
#[test]
fn a_program_that_closes_every_descriptor_keeps_its_files_to_itself() {
    let run = run_program("closefds", &[], &[("MEMSNAP_STATS", "stats.csv")], true);
    run.assert_success();
    let r = run.results();
    assert_eq!(
        r["data_bytes"], "64",
        "memsnap wrote into the program's file"
    );
    assert_eq!(
        r["stream_intact"], "1",
        "memsnap read or wrote the program's stream"
    );
    assert_eq!(
        r["live_socket"], "1",
        "the live socket was not opened again"
    );
    assert!(r["signal_files"].parse::<u32>().unwrap() >= 1);
    let data = std::fs::read(run.dir.path().join("program-data.bin")).unwrap();
    assert_eq!(data, vec![b'p'; 64]);
    let exit = snapshot_files(run.dir.path())
        .into_iter()
        .find(|p| label_of(p).as_deref() == Some("exit"))
        .expect("the exit snapshot");
    let snap = python_load_json(&exit);
    // 1 + 200 allocations, 1 + 200 frees.
    assert_eq!(
        snap["memsnap"]["api_calls"]["cuMemAlloc"], 201,
        "{}",
        snap["memsnap"]
    );
    // The stats file, opened again by its path once the program closed it, has its rows.
    let stats = std::fs::read_to_string(run.dir.path().join("stats.csv")).unwrap();
    assert!(stats.lines().any(|l| l.contains(",exit,")), "{stats}");
}

/// A program that exits while other threads still allocate: its exit snapshot holds what
/// came before `exit()`, and what the threads do after it is not reported as a loss (the
/// writer ended because the program did, not early).
#[test]
fn exiting_while_threads_allocate_reports_no_loss() {
    for _ in 0..2 {
        let run = run_program(
            "load",
            &["4", "exit"],
            &[("FAKE_CUDA_CAPACITY", "80G")],
            true,
        );
        run.assert_success();
        assert!(!run.stderr.contains("stopped early"), "{}", run.stderr);
        let exit = snapshot_files(run.dir.path())
            .into_iter()
            .find(|p| label_of(p).as_deref() == Some("exit"))
            .expect("the exit snapshot");
        let snap = python_load_json(&exit);
        assert_eq!(snap["memsnap"]["dropped_events"], 0, "{}", snap["memsnap"]);
    }
}

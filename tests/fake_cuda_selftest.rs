//! Tests of the fake CUDA driver and runtime themselves, without the preload: every test
//! program runs, and what the fake driver says it holds (`truth` lines) matches what the
//! program expects from its own bookkeeping and from the constants written here.
//! Run with `cargo test --test fake_cuda_selftest`.

mod common;

use common::{num, results, run_program, truth_device};
use std::collections::HashMap;

const MIB: u64 = 1 << 20;

fn run_ok(program: &str, args: &[&str], env: &[(&str, &str)]) -> common::Run {
    let run = run_program(program, args, env, false);
    run.assert_success();
    run
}

/// The truth of `device` matches the program's `expected_*` results with `suffix`
/// ("" or "_dev1").
fn assert_live_matches(run: &common::Run, device: u32, suffix: &str) {
    let r = run.results();
    let t = run.truth_device(device);
    assert_eq!(
        num(&t, "live_bytes"),
        num(&r, &format!("expected_live_bytes{suffix}")),
        "live bytes on device {device}:\n{}",
        run.stdout
    );
    assert_eq!(
        num(&t, "live_count"),
        num(&r, &format!("expected_live_count{suffix}")),
        "live count on device {device}:\n{}",
        run.stdout
    );
}

fn managed_bytes(run: &common::Run) -> u64 {
    let line = run
        .truth()
        .into_iter()
        .find(|t| t.contains_key("managed_bytes"))
        .expect("a truth managed_bytes line");
    num(&line, "managed_bytes")
}

#[test]
fn runtime_scenario_static_and_shared() {
    // 1 MiB + 3 MiB + 512 KiB + 1024*100 (pitch) + 3072*20*10 (3D).
    let expected_live = MIB + 3 * MIB + 512 * 1024 + 1024 * 100 + 3072 * 200;
    for program in ["static_rt", "shared_rt", "static_rt_stripped"] {
        let run = run_ok(program, &[], &[]);
        let r = run.results();
        let t = run.truth_device(0);
        assert_eq!(num(&t, "live_bytes"), expected_live, "{program}");
        assert_eq!(num(&r, "expected_live_bytes"), expected_live, "{program}");
        assert_eq!(num(&t, "live_count"), 5, "{program}");
        assert_eq!(num(&run.truth_device(1), "live_bytes"), 0, "{program}");
        assert_eq!(managed_bytes(&run), 2 * MIB, "{program}");
        assert_eq!(num(&r, "pitch"), 1024);
        assert_eq!(num(&r, "volume_pitch"), 3072);
        assert_eq!(num(&r, "mem_total"), 80 << 30);
        assert_eq!(num(&r, "mem_total") - num(&r, "mem_free"), expected_live);
        // The runtime found the driver through dlsym("cuGetProcAddress_v2") and then asked it
        // for "cuGetProcAddress" exactly once (the nested lookup); all else went through that.
        assert!(num(&r, "getproc_v2_calls") >= 1, "{program}: {r:?}");
        assert_eq!(num(&r, "nested_getproc_lookups"), 1, "{program}");
        assert_eq!(num(&r, "cuMemAlloc_v2_calls"), 3, "{program}");
        assert_eq!(num(&r, "cuMemAllocAsync_calls"), 4, "{program}");
        assert_eq!(num(&r, "cuMemAllocAsync_ptsz_calls"), 1, "{program}");
        assert_eq!(num(&r, "cuMemFreeAsync_ptsz_calls"), 1, "{program}");
        assert_eq!(num(&r, "cuMemAllocFromPoolAsync_calls"), 1, "{program}");
        assert_eq!(num(&r, "cuMemFreeAsync_calls"), 4, "{program}");
        assert_eq!(num(&r, "cuMemAllocPitch_v2_calls"), 2, "{program}");
        assert_eq!(num(&r, "cuMemAllocManaged_calls"), 1, "{program}");
        // First fit: the freed 12345-byte block's address is handed out again.
        assert_eq!(r["address_reused"], "1", "{program}");
        assert_eq!(r["activations_ptr"], r["async_first_ptr"], "{program}");
        for key in [
            "alloc_weights_line",
            "alloc_activations_line",
            "alloc_volume_line",
        ] {
            assert!(num(&r, key) > 0, "{program}: {key}");
        }
    }
}

#[test]
fn static_runtime_is_internal_and_stripped_copy_has_no_symbols() {
    use object::{Object, ObjectSymbol};
    let symbols = |program: &str| -> Vec<String> {
        let data = std::fs::read(common::program_path(program)).expect("read the program");
        let file = object::File::parse(&*data).expect("an ELF file");
        file.symbols()
            .filter_map(|s| s.name().ok().map(str::to_string))
            .collect()
    };
    let full = symbols("static_rt");
    assert!(full.iter().any(|s| s == "alloc_weights"));
    assert!(full.iter().any(|s| s == "cudaMalloc"));
    assert!(symbols("static_rt_stripped").is_empty());

    let dynamic = |program: &str| -> Vec<String> {
        let data = std::fs::read(common::program_path(program)).expect("read the program");
        let file = object::File::parse(&*data).expect("an ELF file");
        file.dynamic_symbols()
            .filter_map(|s| s.name().ok().map(str::to_string))
            .collect()
    };
    // The static runtime's cudaMalloc never goes through the dynamic linker...
    assert!(!dynamic("static_rt").iter().any(|s| s.starts_with("cuda")));
    // ...the shared one does.
    assert!(dynamic("shared_rt").iter().any(|s| s == "cudaMalloc"));
    assert!(
        dynamic("driver_direct")
            .iter()
            .any(|s| s == "cuMemAlloc_v2")
    );
}

#[test]
fn driver_contract_checks() {
    let run = run_ok("driver_checks", &[], &[("FAKE_CUDA_CAPACITY", "64M")]);
    let r = run.results();
    let failed: Vec<&String> = r
        .iter()
        .filter(|(k, v)| k.starts_with("check_") && v.as_str() != "1")
        .map(|(k, _)| k)
        .collect();
    assert!(
        failed.is_empty(),
        "failed checks {failed:?}:\n{}",
        run.stdout
    );
    assert!(r.keys().filter(|k| k.starts_with("check_")).count() >= 50);
    assert_eq!(r["all_ok"], "1");
    let t = run.truth_device(0);
    assert_eq!(num(&t, "live_bytes"), 0);
    assert_eq!(num(&t, "physical_bytes"), 0);
    assert_eq!(num(&t, "capacity"), 64 * MIB);
}

#[test]
fn driver_direct_plt_calls() {
    let run = run_ok("driver_direct", &[], &[]);
    let r = run.results();
    assert_live_matches(&run, 0, "");
    assert_eq!(
        num(&run.truth_device(0), "live_bytes"),
        2 * MIB + MIB + 2048 * 64
    );
    assert_eq!(managed_bytes(&run), MIB);
    assert_eq!(r["address_reused"], "1");
    assert_eq!(r["bad_free_error"], "1");
    assert_eq!(r["zero_alloc_error"], "1");
    assert_eq!(r["untouched_out_param"], "1");
    assert_eq!(num(&r, "cuMemAlloc_v2_calls"), 4);
}

#[test]
fn expandable_segments_through_driver_entry_points() {
    for args in [&[][..], &["legacy"][..]] {
        let run = run_ok("expandable", args, &[]);
        let r = run.results();
        let t = run.truth_device(0);
        assert_eq!(num(&t, "mapped_bytes"), 42 * MIB, "{args:?}");
        assert_eq!(num(&t, "physical_bytes"), 42 * MIB, "{args:?}");
        assert_eq!(num(&r, "expected_mapped_bytes"), 42 * MIB);
        assert_eq!(num(&t, "live_bytes"), 0);
        assert_eq!(num(&r, "granularity"), 2 * MIB);
        assert_eq!(r["missing_status"], "1");
        assert_eq!(r["missing_is_null"], "1");
        assert_eq!(r["early_address_free_error"], "1");
        assert_eq!(num(&r, "getproc_cuMemCreate"), 1);
        assert_eq!(num(&r, "cuMemCreate_calls"), 4);
        assert_eq!(num(&r, "cuMemUnmap_calls"), 1);
        // Chunks are contiguous from the reservation's start.
        assert_eq!(r["reserve_ptr"], r["chunk0_ptr"]);
        let chunk = |i: usize| {
            u64::from_str_radix(r[&format!("chunk{i}_ptr")].trim_start_matches("0x"), 16).unwrap()
        };
        assert_eq!(chunk(1) - chunk(0), 2 * MIB);
        assert_eq!(chunk(3) - chunk(2), 20 * MIB);
    }
}

#[test]
fn jax_dlsym_vmm_and_plain_allocations() {
    let run = run_ok("jax_dlsym", &[], &[]);
    let r = run.results();
    let t = run.truth_device(0);
    assert_eq!(num(&t, "mapped_bytes"), 22 * MIB);
    assert_eq!(num(&t, "physical_bytes"), 22 * MIB);
    assert_live_matches(&run, 0, "");
    assert_eq!(num(&t, "live_bytes"), 3 * MIB);
    // A released handle keeps its memory while mapped; host memory takes no device memory.
    assert_eq!(num(&r, "physical_while_released_but_mapped"), 28 * MIB);
    assert_eq!(num(&r, "physical_with_host_handle"), 22 * MIB);
    assert_eq!(r["address_reused"], "1");
}

#[test]
fn multi_device_accounting() {
    let run = run_ok("multi_device", &[], &[]);
    assert_live_matches(&run, 0, "_dev0");
    assert_live_matches(&run, 1, "_dev1");
    let r = run.results();
    assert_eq!(num(&run.truth_device(0), "live_bytes"), 5 * MIB);
    assert_eq!(num(&run.truth_device(1), "live_bytes"), 8 * MIB + MIB / 2);
    assert_eq!(num(&r, "dev1_mem_used"), 8 * MIB + MIB / 2);
    assert_eq!(r["current_device"], "1");
}

#[test]
fn device_count_and_capacity_from_env() {
    let run = run_ok(
        "static_rt",
        &[],
        &[("FAKE_CUDA_DEVICES", "3"), ("FAKE_CUDA_CAPACITY", "8G")],
    );
    assert_eq!(
        run.truth()
            .iter()
            .filter(|t| t.contains_key("device"))
            .count(),
        3
    );
    assert_eq!(num(&run.results(), "mem_total"), 8 << 30);
    assert_eq!(num(&run.truth_device(2), "capacity"), 8 << 30);
}

#[test]
fn oom_reported_at_capacity() {
    let run = run_ok("oom", &[], &[("FAKE_CUDA_CAPACITY", "64M")]);
    let r = run.results();
    assert_eq!(
        num(&r, "oom_at"),
        4,
        "4 x 16 MiB fit in 64 MiB:\n{}",
        run.stdout
    );
    assert_eq!(num(&r, "oom_size"), 16 * MIB);
    assert_eq!(num(&r, "oom_error"), 2); // cudaErrorMemoryAllocation
    assert_eq!(num(&r, "last_error"), 2);
    assert_eq!(r["oom_untouched_out_param"], "1");
    assert_eq!(r["retry_ok"], "1");
    // No interposer: nobody writes an OOM file.
    assert_eq!(r["oom_file_before_return"], "0");
    assert_live_matches(&run, 0, "");
    assert_eq!(num(&run.truth_device(0), "live_bytes"), 64 * MIB);
}

#[test]
fn threads_truth_is_consistent() {
    let run = run_ok("threads", &[], &[]);
    let r = run.results();
    assert_eq!(r["failed"], "0");
    assert_eq!(r["live_ptrs_distinct"], "1");
    assert_live_matches(&run, 0, "_dev0");
    assert_live_matches(&run, 1, "_dev1");
    assert!(num(&run.truth_device(0), "live_count") > 0);
    assert!(num(&r, "reused_addresses") > 0, "freed addresses come back");
    let allocs = num(&r, "cuMemAlloc_v2_calls") + num(&r, "cuMemAllocAsync_calls");
    let frees = num(&r, "cuMemFree_v2_calls") + num(&r, "cuMemFreeAsync_calls");
    let live = num(&run.truth_device(0), "live_count") + num(&run.truth_device(1), "live_count");
    assert_eq!(allocs - frees, live);
    assert_eq!(allocs + frees, 8 * 2000);
}

#[test]
fn fork_child_and_parent() {
    for (args, child_expected) in [(&[][..], 5 * MIB), (&["early"][..], MIB)] {
        let run = run_ok("fork", args, &[]);
        let r = run.results();
        assert_eq!(r["child_exit_ok"], "1", "{args:?}");
        assert_eq!(num(&r, "child_live_bytes"), child_expected, "{args:?}");
        assert_eq!(num(&r, "child_expected_live_bytes"), child_expected);
        assert_ne!(r["child_pid"], r["parent_pid"]);
        assert_live_matches(&run, 0, "");
        assert_eq!(num(&run.truth_device(0), "live_bytes"), 6 * MIB);
        assert_eq!(
            run.stdout.matches("truth device=0").count(),
            1,
            "{}",
            run.stdout
        );
    }
}

#[test]
fn signal_modes_without_interposer() {
    let fast = [("FAKE_SIGNAL_WAIT_MS", "50")];
    let plain = run_ok("signal", &[], &fast);
    // No handler installed: the program must not signal itself to death.
    assert_eq!(plain.results()["sigusr1_handled"], "0");
    assert_eq!(plain.results()["signal_file"], "0");
    for mode in ["own-handler", "late-handler"] {
        let run = run_ok("signal", &[mode], &fast);
        let r = run.results();
        assert_eq!(r["sigusr1_handled"], "1", "{mode}");
        assert_eq!(r["own_handler_calls"], "1", "{mode}");
        assert_eq!(r["signal_file"], "0", "{mode}");
        assert_live_matches(&run, 0, "");
    }
}

#[test]
fn nocuda_prints_hello_only() {
    let run = run_ok("nocuda", &[], &[]);
    assert_eq!(run.stdout, "hello\n");
    assert_eq!(run.stderr, "");
    assert!(common::snapshot_files(run.dir.path()).is_empty());
    let threads = run_ok("nocuda", &["threads"], &[]);
    assert_eq!(threads.stdout, "hello\nthreads=1\n");
}

#[test]
fn demo_training_loop() {
    let run = run_ok("demo", &[], &[]);
    assert_live_matches(&run, 0, "");
    assert_eq!(
        num(&run.truth_device(0), "live_bytes"),
        16 * MIB + 5 * 256 * 1024
    );
    assert!(run.stdout.contains("demo: step 4 done"));
}

#[test]
fn python_ctypes_allocations() {
    let source =
        std::fs::read_to_string(common::program_path("py_alloc.py")).expect("read py_alloc.py");
    let malloc_line = source
        .lines()
        .position(|l| l.contains("CUDART.cudaMalloc(ctypes.byref"))
        .expect("the cudaMalloc call")
        + 1;
    for mode in ["main", "thread"] {
        let run = run_ok("py_alloc.py", &[mode], &[]);
        let r = run.results();
        assert_eq!(num(&r, "line"), malloc_line as u64, "{mode}");
        assert_eq!(r["function"], "make_tensor");
        assert_live_matches(&run, 0, "");
        assert_eq!(num(&run.truth_device(0), "live_bytes"), 6 * 1024);
    }
}

#[test]
fn result_and_truth_parsers() {
    let out = "noise\nresult a=1\nresult path=/x=y\ntruth device=0 live_bytes=7 live_count=1\n\
               truth managed_bytes=3\n";
    let r = results(out);
    assert_eq!(r["a"], "1");
    assert_eq!(r["path"], "/x=y");
    let t = common::truth(out);
    assert_eq!(t.len(), 2);
    assert_eq!(num(&truth_device(out, 0), "live_bytes"), 7);
    assert_eq!(t[1], HashMap::from([("managed_bytes".into(), "3".into())]));
}

#[test]
fn python_loads_reference_pickle_as_json() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/torch/torch-oom.pickle");
    let json = common::python_load_json(&path);
    let segments = json["segments"].as_array().expect("segments is a list");
    assert!(!segments.is_empty());
    assert!(segments[0]["total_size"].is_u64(), "ints stay ints");
    assert!(
        json["device_traces"].is_array(),
        "tuples and lists become arrays"
    );
}

#[test]
fn build_script_is_idempotent_and_concurrency_safe() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/build-fake-cuda.sh");
    let spawn = || {
        std::process::Command::new("bash")
            .arg(&script)
            .arg(dir.path())
            .output()
            .expect("run the build script")
    };
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(spawn);
        let b = s.spawn(spawn);
        (a.join().unwrap(), b.join().unwrap())
    });
    for out in [&a, &b] {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let lib = dir.path().join("lib");
    assert!(lib.join("libcuda.so.1").is_file());
    assert_eq!(
        std::fs::read_link(lib.join("libcudart.so")).unwrap(),
        std::path::Path::new("libcudart.so.13")
    );
    let stamp = dir.path().join(".stamp");
    let before = std::fs::metadata(&stamp).unwrap().modified().unwrap();
    assert!(spawn().status.success());
    assert_eq!(
        std::fs::metadata(&stamp).unwrap().modified().unwrap(),
        before,
        "no rebuild"
    );
}

/// `probe key=N` lines that `libroute_probe.so` prints to stderr at exit.
fn probe_counts(stderr: &str) -> HashMap<String, u64> {
    stderr
        .lines()
        .filter_map(|l| l.strip_prefix("probe "))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.parse().expect("a count")))
        .collect()
}

/// A minimal reference interposer (tests/programs/route_probe.c) sees each program's
/// allocations on the route docs/CUDA.md#what-real-programs-do describes, and passes them
/// through unchanged.
#[test]
fn routes_seen_by_a_reference_interposer() {
    let probe = common::fake_lib_dir().join("libroute_probe.so");
    let probe = probe.to_str().expect("utf-8 path");
    let run_probed = |program: &str, args: &[&str]| {
        let run = run_program(program, args, &[("LD_PRELOAD", probe)], false);
        run.assert_success();
        (probe_counts(&run.stderr), run)
    };

    // Static runtime: no cudaMalloc symbol call at all; the driver is reached through
    // dlsym("cuGetProcAddress_v2") and the nested lookup, whose answer must be substituted.
    let (p, run) = run_probed("static_rt", &[]);
    assert_eq!(p["plt_cudaMalloc"], 0);
    assert_eq!(p["dlsym_cuGetProcAddress_v2"], 1);
    assert_eq!(p["getproc_cuGetProcAddress_v2"], 1, "the nested lookup");
    assert_eq!(p["getproc_cuMemAlloc_v2"], 1);
    assert_eq!(p["calls_cuMemAlloc_v2"], 3);
    assert_eq!(p["calls_cuMemAllocAsync"], 4);
    assert_eq!(
        p["calls_cuMemAllocAsync_ptsz"], 1,
        "flag 2 gives the _ptsz variant"
    );
    assert_eq!(
        num(&run.truth_device(0), "live_bytes"),
        5435392,
        "unchanged by the hooks"
    );

    // Shared runtime: the exported cudaMalloc fires, and the driver hooks again underneath.
    let (p, _) = run_probed("shared_rt", &[]);
    assert_eq!(p["plt_cudaMalloc"], 3);
    assert_eq!(p["calls_cuMemAlloc_v2"], 3);

    // Driver API through the PLT: no dlsym or cuGetProcAddress involved.
    let (p, _) = run_probed("driver_direct", &[]);
    assert_eq!(p["calls_cuMemAlloc_v2"], 4);
    assert_eq!(p["calls_cuMemAllocAsync"], 2);
    assert_eq!(p["dlsym_cuMemAlloc_v2"] + p["getproc_cuMemAlloc_v2"], 0);

    // PyTorch's expandable segments: VMM functions handed out by cuGetProcAddress.
    for args in [&[][..], &["legacy"][..]] {
        let (p, _) = run_probed("expandable", args);
        assert_eq!(p["getproc_cuMemCreate"], 1, "{args:?}");
        assert_eq!(p["calls_cuMemCreate"], 4, "{args:?}");
        assert_eq!(p["calls_cuMemMap"], 4, "{args:?}");
    }

    // JAX: plain dlsym on the libcuda handle.
    let (p, run) = run_probed("jax_dlsym", &[]);
    assert_eq!(p["dlsym_cuMemCreate"], 1);
    assert_eq!(p["calls_cuMemCreate"], 7);
    assert_eq!(p["calls_cuMemMap"], 6);
    assert_eq!(p["calls_cuMemAlloc_v2"], 2);
    assert_eq!(num(&run.truth_device(0), "mapped_bytes"), 22 * MIB);

    // ctypes looks cudaMalloc up with dlsym(handle): the exported runtime symbol is bypassed,
    // only the driver level sees these allocations.
    let (p, _) = run_probed("py_alloc.py", &[]);
    assert_eq!(p["plt_cudaMalloc"], 0);
    assert_eq!(p["calls_cuMemAlloc_v2"], 6);

    // Pointer-identity rules still hold when every answer is the interposer's.
    let run = run_program(
        "driver_checks",
        &[],
        &[("LD_PRELOAD", probe), ("FAKE_CUDA_CAPACITY", "64M")],
        false,
    );
    run.assert_success();
    assert_eq!(run.results()["all_ok"], "1", "{}", run.stdout);
}

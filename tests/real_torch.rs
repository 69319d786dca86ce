//! The real PyTorch on the simulated driver: PyTorch's CUDA wheel (2.11 by default, whose
//! `libc10_cuda.so` is the GPU machines' own; another release set up in `REAL_TORCH_DIR`)
//! with the simulated driver and runtime and stand-ins for the other NVIDIA libraries it
//! links (scripts/real-torch/setup.sh). memsnap's record of PyTorch's caching allocator is
//! set against PyTorch's own snapshot, its out-of-memory snapshot against PyTorch's, and
//! tensor mode's route is checked, with the checks of scripts/gpu/torch_blocks.py (its
//! `compare` and `oom` cases) run here on the real library: the stand-in of tests/fake_torch
//! follows PyTorch's rules, this is PyTorch.
//!
//! #[ignore]d for plain `cargo test`: the wheel is a download of about 530 MB.
//! scripts/test.sh sets it up in target/real-torch (or `REAL_TORCH_DIR`) and runs them.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

/// The folder scripts/real-torch/setup.sh filled.
fn real_torch_dir() -> PathBuf {
    let dir = std::env::var_os("REAL_TORCH_DIR").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("target/real-torch"),
        PathBuf::from,
    );
    assert!(
        dir.join("env.sh").is_file(),
        "{} has no env.sh: run `bash scripts/real-torch/setup.sh {}` first (scripts/test.sh does)",
        dir.display(),
        dir.display()
    );
    dir
}

/// The release the folder holds, as PyTorch reports it (`torch/version.py`: `2.11.0+cu130`).
fn torch_version() -> String {
    let path = real_torch_dir().join("site-packages/torch/version.py");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    text.lines()
        .find_map(|line| line.strip_prefix("__version__ = "))
        .map(|v| v.trim().trim_matches(|c| c == '\'' || c == '"').to_owned())
        .unwrap_or_else(|| panic!("no __version__ in {}", path.display()))
}

/// `python3 ARGS` with the real PyTorch on the simulated driver, `libmemsnap.so` preloaded,
/// snapshots into `folder`, memsnap's settings only those of `env`; panics unless it
/// succeeds; stdout.
fn python(args: &[&str], env: &[(&str, &str)], folder: &Path) -> String {
    let dir = real_torch_dir();
    let mut command = Command::new("python3");
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("MEMSNAP_") {
            command.env_remove(name);
        }
    }
    let out = command
        .args(["-W", "ignore"]) // (PyTorch's warnings, NumPy's absence among them)
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env(
            "PYTHONPATH",
            format!(
                "{}:{}",
                dir.join("site-packages").display(),
                dir.join("deps").display()
            ),
        )
        .env("LD_LIBRARY_PATH", dir.join("lib"))
        .env("FAKE_CUDA_DEVICES", "1")
        .env("LD_PRELOAD", common::preload_lib())
        .env("MEMSNAP_FOLDER", folder)
        .envs(env.iter().copied())
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "python3 {args:?}: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The JSON of the last `RESULT ` line of scripts/gpu/torch_blocks.py's case `case`.
fn torch_blocks_case(case: &str, env: &[(&str, &str)]) -> serde_json::Value {
    let folder = tempfile::tempdir().expect("temporary folder");
    let cli = common::memsnap_bin();
    let stdout = python(
        &[
            "scripts/gpu/torch_blocks.py",
            "--case",
            case,
            "--cli",
            cli.to_str().expect("a UTF-8 path"),
        ],
        env,
        folder.path(),
    );
    let line = stdout
        .lines()
        .rfind(|line| line.starts_with("RESULT "))
        .unwrap_or_else(|| panic!("no RESULT line in:\n{stdout}"));
    serde_json::from_str(&line["RESULT ".len()..]).expect("RESULT is JSON")
}

/// Runs scripts/gpu/NAME.py with this build's library and CLI and `args`: the JSON it writes
/// (NAME.json in its --out folder).
fn check_script(name: &str, args: &[&str]) -> serde_json::Value {
    let out = tempfile::tempdir().expect("temporary folder");
    let lib = common::preload_lib();
    let cli = common::memsnap_bin();
    let script = format!("scripts/gpu/{name}.py");
    let mut argv = vec![
        script.as_str(),
        "--lib",
        lib.to_str().expect("a UTF-8 path"),
        "--cli",
        cli.to_str().expect("a UTF-8 path"),
        "--out",
        out.path().to_str().expect("a UTF-8 path"),
    ];
    argv.extend_from_slice(args);
    python(&argv, &[], out.path());
    let path = out.path().join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn number(value: &serde_json::Value, key: &str) -> u64 {
    value[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} is not a count in {value:#}"))
}

/// One comparison of torch_blocks.py (`compared()`: PyTorch's snapshot and memsnap's, taken at
/// the same moment): the same segments and, in each, the same blocks; PyTorch's own counters
/// byte for byte; every live block with the stack that made it; nothing lost; the tracker's
/// route on the snapshot's line. `at` names the comparison in messages.
fn assert_blocks_agree(figures: &serde_json::Value, at: &str) {
    assert_eq!(
        figures["problems"],
        serde_json::json!([]),
        "{at}: {figures:#}"
    );
    assert_eq!(number(figures, "problem_count"), 0, "{at}");
    let segments = number(figures, "segments_torch");
    assert_eq!(number(figures, "segments_memsnap"), segments, "{at}");
    assert_eq!(number(figures, "memsnap_only_segments"), 0, "{at}");
    assert!(
        number(figures, "blocks_torch") > segments,
        "{at}: {figures:#}"
    );
    let allocated = number(figures, "memory_allocated");
    assert!(allocated > 100 << 20, "{at}: {figures:#}");
    assert_eq!(
        number(figures, "memsnap_live_block_bytes"),
        allocated,
        "{at}"
    );
    assert_eq!(
        number(figures, "memsnap_cache_allocated_bytes"),
        allocated,
        "{at}"
    );
    assert_eq!(
        number(figures, "memsnap_cache_reserved_bytes"),
        number(figures, "memory_reserved"),
        "{at}"
    );
    assert_eq!(
        number(figures, "live_blocks_with_frames"),
        number(figures, "live_blocks"),
        "{at}"
    );
    assert_eq!(number(figures, "dropped"), 0, "{at}");
    assert_eq!(number(figures, "without_stack"), 0, "{at}");
    let line = figures["torch_allocator"].as_str().unwrap_or_default();
    let release = format!("blocks: PyTorch {} caching allocator", torch_version());
    assert!(
        line.starts_with(&release) && line.contains("through its trace tracker"),
        "{at}: {line}"
    );
    assert_eq!(figures["ok"], true, "{at}: {figures:#}");
}

/// The `compare` case (or `expandable`, its run with expandable segments): a workload over both
/// pools (splits, merges, an unsplit tail, a block freed while in use on a side stream), then
/// PyTorch's snapshot and memsnap's, taken at the same moment, must agree block for block, and
/// every entry's time lie within the run. Returns the case's result.
fn blocks_match_pytorchs_own_snapshot(case: &str, env: &[(&str, &str)]) -> serde_json::Value {
    let result = torch_blocks_case(case, env);
    assert_blocks_agree(&result, case);
    assert_eq!(number(&result, "times_outside_run"), 0);
    assert!(number(&result, "trace_entries") > 100, "{result:#}");
    result
}

#[test]
#[ignore = "needs the real PyTorch: scripts/test.sh sets it up and runs this"]
fn real_torch_blocks_match_pytorchs_own_snapshot() {
    let result = blocks_match_pytorchs_own_snapshot("compare", &[]);
    // One segment per cudaMalloc: both pools' and the large tensors' own.
    assert!(number(&result, "segments_torch") >= 5, "{result:#}");
    assert_eq!(number(&result, "expandable_segments_torch"), 0);
}

#[test]
#[ignore = "needs the real PyTorch: scripts/test.sh sets it up and runs this"]
fn real_torch_expandable_segments_blocks_match_pytorchs_own_snapshot() {
    // The same workload with one growing segment per pool and stream: PyTorch maps memory into
    // a reserved range (cuMemCreate, cuMemMap) instead of calling cudaMalloc.
    let result = blocks_match_pytorchs_own_snapshot(
        "expandable",
        &[("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")],
    );
    let segments = number(&result, "segments_torch");
    assert!((1..=3).contains(&segments), "{result:#}");
    assert_eq!(number(&result, "expandable_segments_torch"), segments);
}

#[test]
#[ignore = "needs the real PyTorch: scripts/test.sh sets it up and runs this"]
fn real_torch_training_step_blocks_match_pytorchs_own_snapshot() {
    // A transformer's training step (benches/gpu/step_time.py's: 4 encoder layers, bf16
    // autocast, AdamW; autograd frees on its own thread), with and without expandable
    // segments: after a forward pass, with the activations autograd keeps, and after the
    // optimizer step, PyTorch's snapshot and memsnap's agree block for block.
    for env in [
        &[][..],
        &[("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")][..],
    ] {
        let result = torch_blocks_case("step", env);
        for moment in ["forward", "after"] {
            let figures = &result[moment];
            assert_blocks_agree(figures, &format!("{env:?} {moment}"));
            let segments = number(figures, "segments_torch");
            let expandable = if env.is_empty() { 0 } else { segments };
            assert_eq!(number(figures, "expandable_segments_torch"), expandable);
            assert!(
                number(figures, "blocks_torch") > 100,
                "{env:?} {moment}: {figures:#}"
            );
        }
        // The forward pass's activations are freed by the backward pass and the step.
        assert!(
            number(&result["forward"], "memory_allocated")
                > number(&result["after"], "memory_allocated"),
            "{result:#}"
        );
    }
}

#[test]
#[ignore = "needs the real PyTorch: scripts/test.sh sets it up and runs this"]
fn real_torch_out_of_memory_snapshot_matches_pytorchs_free_space() {
    // A fragmented cache on a 6 GiB device (its fill fits: 921 tensors of 6 MiB, three to a
    // 20 MiB segment), then a request larger than any hole: memsnap's
    // out-of-memory snapshot, written before PyTorch raises, against PyTorch's own snapshot
    // taken in the handler.
    let result = torch_blocks_case("oom", &[("FAKE_CUDA_CAPACITY", "6G")]);
    let inactive = number(&result, "torch_inactive_bytes");
    assert!(inactive > 100 << 20, "{result:#}");
    assert_eq!(number(&result, "memsnap_inactive_bytes"), inactive);
    let largest = number(&result, "torch_largest_free_block");
    assert!(largest > 0, "{result:#}");
    assert_eq!(number(&result, "memsnap_largest_free_block"), largest);
    assert_eq!(number(&result, "oom_events"), 1);
    assert_eq!(result["ok"], true, "{result:#}");
}

#[test]
#[ignore = "needs the real PyTorch: scripts/test.sh sets it up and runs this"]
fn real_torch_leak_diff_names_the_leaking_line_first() {
    // A training loop (two `nn.Linear`, ReLU, SGD) whose evaluation pass runs without no_grad
    // and keeps every output, and with it the activations its graph saved. The cache grows
    // wherever PyTorch runs short (the training step's lines as often as the leak's); memsnap
    // records PyTorch's blocks, so the diff of steps 3 and 11 puts the growth where the
    // tensors were made: 8 steps x (the 8 MiB output + the 32 MiB ReLU output the second layer
    // saved) on the evaluation's line, 8 x the 8 MiB input on the loop's line. (Kernels and
    // cuBLAS compute nothing here; every allocation and free happens as on a GPU, where the
    // same case gave the same two lines and sizes: docs/VALIDATION.md.)
    let result = torch_blocks_case("leak", &[]);
    let leak_line = number(&result, "leak_line");
    let top: Vec<&str> = result["diff_top_lines"]
        .as_array()
        .expect("diff_top_lines")
        .iter()
        .map(|line| line.as_str().expect("a line"))
        .collect();
    let growth = |line: &str| -> Vec<String> {
        line.split_whitespace().take(3).map(str::to_owned).collect()
    };
    assert_eq!(top.len(), 2, "{result:#}");
    assert!(
        top[0].ends_with(&format!("torch_blocks.py:{leak_line} (evaluate)")),
        "{result:#}"
    );
    assert_eq!(growth(top[0]), ["+320.0", "MiB", "+16"], "{result:#}");
    assert!(top[1].ends_with("(case_leak)"), "{result:#}");
    assert_eq!(growth(top[1]), ["+64.0", "MiB", "+8"], "{result:#}");
    assert_eq!(number(&result, "diff_exit"), 0);
    assert_eq!(number(&result, "dropped"), 0);
    assert_eq!(number(&result, "without_stack"), 0);
    let line = result["torch_allocator"].as_str().unwrap_or_default();
    assert!(line.starts_with("blocks: PyTorch "), "{line}");
    assert_eq!(result["ok"], true, "{result:#}");
}

#[test]
#[ignore = "needs the real PyTorch: scripts/test.sh sets it up and runs this"]
fn real_torch_explain_says_why_a_model_ran_out_of_memory_and_what_leaks() {
    // scripts/gpu/explain_check.py's `oom` and `leak` cases, as on the GPU: an MLP whose batch
    // doubles until PyTorch raises OutOfMemoryError on the 80 GiB simulated device, and a
    // training loop whose evaluation pass keeps its outputs, one snapshot a step (and the same
    // loop without the leak). `memsnap explain --json` on what memsnap wrote.
    let result = check_script("explain_check", &["--cases", "oom,leak"]);
    let oom = &result["oom"];
    // The request was larger than what the driver had left, while the cache held more than it
    // in free blocks, none of them large enough: fragmentation, and the forward pass's line
    // among the sites that hold the memory.
    assert_eq!(oom["verdict"], "fragmentation", "{oom:#}");
    let request = number(oom, "request_bytes");
    assert!(request > number(oom, "device_free_bytes"), "{oom:#}");
    let cached_free = number(oom, "reserved_unallocated_bytes");
    assert!(cached_free >= request, "{oom:#}");
    assert_eq!(number(&oom["owners"], "torch cache (free)"), cached_free);
    assert!(number(&oom["owners"], "torch tensors") > 1 << 30, "{oom:#}");
    let forward = format!(
        "explain_check.py:{} (child_oom)",
        number(oom, "forward_line")
    );
    let sites: Vec<&str> = oom["sites"]
        .as_array()
        .expect("sites")
        .iter()
        .take(3)
        .map(|site| site.as_str().expect("a site"))
        .collect();
    assert!(sites.iter().any(|site| site.ends_with(&forward)), "{oom:#}");
    assert_eq!(oom["ok"], true, "{oom:#}");
    // One leak, on the evaluation line: its 1024 x 1024 input and output and the 1024 x 4096
    // ReLU output the graph keeps, 24 MiB a step over the 15 steps after the first; none
    // without the leak.
    let leak = &result["leak"];
    let leaks = leak["leak"]["leaks"].as_array().expect("leaks");
    assert_eq!(leaks.len(), 1, "{leak:#}");
    let eval = format!(
        "explain_check.py:{} (child_leak)",
        number(leak, "eval_line")
    );
    assert!(
        leaks[0]["site"]
            .as_str()
            .unwrap_or_default()
            .ends_with(&eval),
        "{leak:#}"
    );
    assert_eq!(number(&leaks[0], "bytes_per_step"), 24 << 20);
    assert_eq!(number(&leaks[0], "steps"), 15);
    assert_eq!(number(&leaks[0], "live_bytes_at_end"), 16 * (24 << 20));
    assert_eq!(leak["steady"]["leaks"], serde_json::json!([]), "{leak:#}");
    assert_eq!(leak["ok"], true, "{leak:#}");
}

#[test]
#[ignore = "needs the real PyTorch: scripts/test.sh sets it up and runs this"]
fn real_torch_tensor_mode_records_each_tensor_through_its_cuda_call() {
    let folder = tempfile::tempdir().expect("temporary folder");
    let stdout = python(
        &[
            "-c",
            "import ctypes, json, torch\n\
             sizes = [(i + 1) * 4096 + 512 for i in range(100)]\n\
             kept = [torch.empty(s, dtype=torch.uint8, device='cuda') for s in sizes]\n\
             addresses = [t.data_ptr() for t in kept]\n\
             del kept[50:]\n\
             fn = ctypes.CDLL(None).memsnap_dump_path\n\
             fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]\n\
             buf = ctypes.create_string_buffer(4096)\n\
             n = fn(b'tensors', buf, 4096)\n\
             print(json.dumps({'backend': torch.cuda.get_allocator_backend(), 'path': buf.raw[:n].decode(),\n\
                               'sizes': sizes, 'addresses': addresses}))",
        ],
        &[("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")],
        folder.path(),
    );
    let run: serde_json::Value =
        serde_json::from_str(stdout.lines().last().unwrap_or_default()).expect("JSON");
    assert_eq!(run["backend"], "cudaMallocAsync");
    let snapshot = common::python_load_json(Path::new(run["path"].as_str().expect("a path")));
    let meta = &snapshot["memsnap"];
    let line = meta["torch_allocator"].as_str().unwrap_or_default();
    let release = format!("tensors: PyTorch {} ", torch_version());
    assert!(line.starts_with(&release), "{line}");
    assert_eq!(meta["dropped_events"], 0);
    assert_eq!(meta["events_without_stack"], 0);
    // Each tensor is its own CUDA allocation: the first 50 live at their addresses and sizes,
    // the other 50 allocated and freed.
    let live: Vec<(u64, u64)> = snapshot["segments"]
        .as_array()
        .expect("segments")
        .iter()
        .map(|s| (number(s, "address"), number(s, "total_size")))
        .collect();
    let counts = |key: &str| -> Vec<u64> {
        run[key]
            .as_array()
            .expect("a list")
            .iter()
            .map(|v| v.as_u64().expect("a count"))
            .collect()
    };
    let (sizes, addresses) = (counts("sizes"), counts("addresses"));
    assert_eq!((sizes.len(), addresses.len()), (100, 100));
    for (i, (&address, &size)) in addresses.iter().zip(&sizes).enumerate() {
        let is_live = live.contains(&(address, size));
        assert_eq!(
            is_live,
            i < 50,
            "tensor {i} ({address:#x}, {size} bytes): live {is_live}; live segments {live:x?}"
        );
    }
    let trace = snapshot["device_traces"][0]
        .as_array()
        .expect("device 0's trace");
    let count = |action: &str| {
        trace
            .iter()
            .filter(|e| e["action"] == action && sizes.contains(&e["size"].as_u64().unwrap_or(0)))
            .count()
    };
    let actions = [
        "segment_alloc",
        "alloc",
        "free_requested",
        "free_completed",
        "segment_free",
    ];
    assert_eq!(actions.map(count), [100, 100, 50, 50, 50]);
}

/// `tests/python/torch_train.py MODE` with `MEMSNAP_EVERY=5` and `env`, and `paths` ahead
/// of the real PyTorch's on PYTHONPATH after it: the labels of the files written, the exit
/// file's metadata and the program's results.
fn train(
    mode: &str,
    env: &[(&str, &str)],
    paths: &[PathBuf],
) -> (
    Vec<String>,
    serde_json::Value,
    std::collections::HashMap<String, String>,
) {
    let dir = real_torch_dir();
    let folder = tempfile::tempdir().expect("temporary folder");
    let mut path = vec![dir.join("site-packages"), dir.join("deps")];
    path.extend(paths.iter().cloned());
    let path = std::env::join_paths(path).expect("a PYTHONPATH");
    let path = path.to_str().expect("a UTF-8 PYTHONPATH");
    let mut all = vec![("MEMSNAP_EVERY", "5"), ("PYTHONPATH", path)];
    all.extend_from_slice(env);
    let stdout = python(&["tests/python/torch_train.py", mode], &all, folder.path());
    let (labels, meta) = common::written(folder.path());
    (labels, meta, common::results(&stdout))
}

#[test]
#[ignore = "needs the real PyTorch: scripts/test.sh sets it up and runs this"]
fn real_torch_optimizer_steps_are_steps_with_no_memsnap_code() {
    // 20 optimizer steps, one batch each or four (gradient accumulation): step files at 5, 10,
    // 15 and 20, with nothing but the preload.
    for mode in ["plain", "accumulate"] {
        let (labels, meta, r) = train(mode, &[], &[]);
        assert_eq!(r["optimizer_steps"], "20", "{mode}");
        common::assert_optimizer_steps(&labels, &meta, mode);
    }
    // The program marks its steps too (memsnap.step() after each optimizer step): each step
    // once.
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let (labels, meta, r) = train("program", &[], &[python]);
    assert_eq!(r["marks"], "20");
    assert_eq!(labels, common::steps_every_5());
    assert_eq!(meta["step"], 20);
    assert_eq!(meta["step_source"], "optimizer, then program from step 1");
    // MEMSNAP_STEPS=off: no step at all.
    let (labels, meta, _) = train("plain", &[("MEMSNAP_STEPS", "off")], &[]);
    assert_eq!(labels, ["exit"]);
    assert_eq!(meta["step"], 0);
    assert_eq!(meta["step_source"], "none");
}

#[test]
#[ignore = "needs the real PyTorch: scripts/test.sh sets it up and runs this"]
fn real_torch_lightning_and_trainer_steps_are_the_same_with_and_without_the_callback() {
    let frameworks = real_torch_dir().join("frameworks");
    if !frameworks.join(".installed").is_file() {
        common::skip(&format!(
            "no Lightning or transformers in {} (scripts/real-torch/setup.sh installs them \
             unless REAL_TORCH_FRAMEWORKS=0)",
            frameworks.display()
        ));
        return;
    }
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    for framework in ["lightning", "trainer"] {
        for callback in [false, true] {
            let mode = match callback {
                true => format!("{framework}_callback"),
                false => framework.to_string(),
            };
            let paths = [frameworks.clone(), python.clone()];
            let (labels, meta, r) = train(&mode, &[], &paths);
            assert_eq!(r["optimizer_steps"], "20", "{mode}");
            assert_eq!(labels, common::steps_every_5(), "{mode}");
            assert_eq!(meta["step"], 20, "{mode}");
            let source = match callback {
                true => "optimizer, then program from step 1",
                false => "optimizer",
            };
            assert_eq!(meta["step_source"], source, "{mode}");
        }
    }
}

#[test]
#[ignore = "needs the real PyTorch: scripts/test.sh sets it up and runs this"]
fn real_torch_whatif_replays_and_predicts_the_caching_allocator_to_the_byte() {
    // scripts/gpu/whatif_check.py: four workloads (random sizes and lifetimes with an
    // empty_cache(), two streams with record_stream, oversize tensors, an MLP's training
    // steps), each recorded under six allocator settings. The replay as recorded gives back
    // each run's segments and PyTorch's max_memory_reserved() (memsnap's file and PyTorch's
    // own snapshot); each file's prediction for each other setting equals that setting's own
    // run. Then an OOM through fragmentation on a 210 MiB device that expandable segments
    // avoid: explain points to whatif, whatif says so, and the run with it fits.
    let capacity = (210u64 << 20).to_string();
    let result = check_script("whatif_check", &["--capacity", &capacity]);
    let replay = &result["replay"];
    let runs = replay["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 4 * 6, "{replay:#}");
    for run in runs {
        assert_eq!(run["reproduced"], true, "{run:#}");
        assert_eq!(run["model_peak"], run["pytorch_peak"], "{run:#}");
        assert!(number(run, "segment_operations") > 0, "{run:#}");
    }
    let predictions = replay["predictions"].as_array().expect("predictions");
    assert_eq!(predictions.len(), 4 * 6 * 5);
    for p in predictions {
        assert_eq!(p["refused"], serde_json::Value::Null, "{p:#}");
        assert!(number(p, "actual") > 0, "{p:#}");
        assert_eq!(p["predicted"], p["actual"], "{p:#}");
    }
    for own in replay["own"].as_array().expect("own") {
        assert_eq!(own["reproduced"], true, "{own:#}");
        assert_eq!(own["model_peak"], own["pytorch_peak"], "{own:#}");
    }
    // The settings do change the peak (the predictions are not all one figure).
    let peaks: std::collections::BTreeSet<u64> =
        predictions.iter().map(|p| number(p, "actual")).collect();
    assert!(peaks.len() >= 10, "{peaks:?}");

    let oom = &result["oom"];
    assert_eq!(oom["default"]["error"], "OutOfMemoryError", "{oom:#}");
    assert_eq!(oom["check"]["reproduced"], true, "{oom:#}");
    assert_eq!(
        oom["recorded_oom"]["request_bytes"],
        serde_json::json!(24 << 20),
        "{oom:#}"
    );
    assert_eq!(
        oom["recorded_oom"]["avoided_by"],
        serde_json::json!(["expandable_segments:True"]),
        "{oom:#}"
    );
    assert_eq!(oom["scenarios"][1]["fits"], true, "{oom:#}");
    assert_eq!(
        oom["scenarios"][1]["peak_reserved_bytes"], oom["expandable_run"]["max_reserved"],
        "{oom:#}"
    );
    assert_eq!(oom["ok"], true, "{oom:#}");
    // explain calls it fragmentation and names the command.
    let file = oom["file"].as_str().expect("the OOM file");
    let explained = Command::new(common::memsnap_bin())
        .args(["explain", file])
        .output()
        .expect("run memsnap explain");
    let text = String::from_utf8_lossy(&explained.stdout);
    assert!(text.contains("verdict: fragmentation"), "{text}");
    assert!(
        text.contains(&format!(
            "`memsnap whatif {file} --set expandable_segments:True --set max_split_size_mb:128`"
        )),
        "{text}"
    );
}

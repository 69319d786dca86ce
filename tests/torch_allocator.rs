//! memsnap inside PyTorch's caching allocator, on the PyTorch 2.11 stand-in
//! (tests/fake_torch, built into `OUTDIR/torch/lib/libc10_cuda.so` by
//! scripts/build-fake-cuda.sh). The stand-in writes its own state as JSON (the truth); with
//! the preload, memsnap's snapshot must hold the same segments and blocks, block by block.
//!
//! Every snapshot is read back through Python's own `pickle` (`common::python_load_json`).
//! The meta key `memsnap.torch_allocator` says which route was taken: a string starting with
//! "blocks" when memsnap attached a trace tracker to the allocator, with "segments" when it
//! fell back to one block per cudaMalloc'd segment.

mod common;

use common::{
    Run, fake_cuda, label_of, memsnap_bin, memsnap_json, num, python_load_json, run_program,
    snapshot_files,
};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const MIB: u64 = 1 << 20;

/// Runs `torch_standin <scenario> <truth>`; returns the run and the truth JSON.
fn run_standin(scenario: &str, env: &[(&str, &str)], preload: bool) -> (Run, Value) {
    let truth_dir = tempfile::tempdir().unwrap();
    let truth_path = truth_dir.path().join("truth.json");
    let run = run_program(
        "torch_standin",
        &[scenario, truth_path.to_str().unwrap()],
        env,
        preload,
    );
    run.assert_success();
    let text = std::fs::read_to_string(&truth_path)
        .unwrap_or_else(|e| panic!("no truth JSON from {scenario}: {e}\n{}", run.stderr));
    let truth: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("the truth JSON of {scenario} does not parse: {e}\n{text}"));
    assert_well_formed(&truth);
    (run, truth)
}

fn u(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no integer `{key}` in {v}"))
}

fn segments(v: &Value) -> &Vec<Value> {
    v["segments"].as_array().expect("a segments list")
}

fn blocks(segment: &Value) -> &Vec<Value> {
    segment["blocks"].as_array().expect("a blocks list")
}

/// The truth's own invariants: segments in address order per device, blocks tiling each
/// segment in address order, `requested_size <= size`, and 0 for inactive blocks.
fn assert_well_formed(truth: &Value) {
    let mut last: BTreeMap<u64, u64> = BTreeMap::new();
    for seg in segments(truth) {
        let (dev, addr, total) = (u(seg, "device"), u(seg, "address"), u(seg, "total_size"));
        assert!(total > 0, "{seg}");
        if let Some(end) = last.get(&dev) {
            assert!(addr >= *end, "segments overlap or are out of order: {seg}");
        }
        last.insert(dev, addr + total);
        let mut at = addr;
        for b in blocks(seg) {
            assert_eq!(u(b, "address"), at, "blocks must tile the segment: {seg}");
            let (size, requested) = (u(b, "size"), u(b, "requested_size"));
            assert!(size > 0, "{b}");
            // The caching allocator rounds every block to 512 bytes; the cudaMallocAsync
            // stand-in's blocks are the requests themselves.
            if truth["allocator"] == "native" {
                assert_eq!(size % 512, 0, "{b}");
            }
            assert!(requested <= size, "{b}");
            match b["state"].as_str() {
                Some("active_allocated") | Some("active_pending_free") => {
                    assert!(requested > 0, "{b}")
                }
                Some("inactive") => assert_eq!(requested, 0, "{b}"),
                other => panic!("unknown state {other:?} in {b}"),
            }
            at += size;
        }
        assert_eq!(
            at,
            addr + total,
            "blocks must end at the segment's end: {seg}"
        );
    }
}

/// Σ size of the blocks in `state` on `device`.
fn bytes_in_state(v: &Value, device: u64, state: &str) -> u64 {
    segments(v)
        .iter()
        .filter(|s| u(s, "device") == device)
        .flat_map(blocks)
        .filter(|b| b["state"] == state)
        .map(|b| u(b, "size"))
        .sum()
}

fn reserved(v: &Value, device: u64) -> u64 {
    segments(v)
        .iter()
        .filter(|s| u(s, "device") == device)
        .map(|s| u(s, "total_size"))
        .sum()
}

/// The only snapshot file labelled `label` (a dump's tag, or the reason: exit, oom).
fn snapshot_file(run: &Run, label: &str) -> PathBuf {
    let mut files: Vec<PathBuf> = snapshot_files(run.dir.path())
        .into_iter()
        .filter(|p| label_of(p).as_deref() == Some(label))
        .collect();
    assert_eq!(
        files.len(),
        1,
        "expected one {label} snapshot, found {files:?}\nstderr: {}",
        run.stderr
    );
    files.remove(0)
}

/// That snapshot, read by Python's pickle.
fn snapshot(run: &Run, label: &str) -> Value {
    python_load_json(&snapshot_file(run, label))
}

fn torch_allocator_meta(snap: &Value) -> String {
    snap["memsnap"]["torch_allocator"]
        .as_str()
        .unwrap_or_else(|| {
            panic!(
                "no string memsnap.torch_allocator in the snapshot's meta: {}",
                snap["memsnap"]
            )
        })
        .to_string()
}

type BlockKey = (u64, u64, u64, String);

fn block_list(seg: &Value) -> Vec<BlockKey> {
    blocks(seg)
        .iter()
        .map(|b| {
            (
                u(b, "address"),
                u(b, "size"),
                u(b, "requested_size"),
                b["state"].as_str().unwrap_or("?").to_string(),
            )
        })
        .collect()
}

fn by_address(v: &Value) -> BTreeMap<(u64, u64), &Value> {
    segments(v)
        .iter()
        .map(|s| ((u(s, "device"), u(s, "address")), s))
        .collect()
}

/// memsnap's segments are the stand-in's, with identical block lists.
fn assert_blocks_equal(snap: &Value, truth: &Value, what: &str) {
    let got = by_address(snap);
    let want = by_address(truth);
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{what}: segments (device, address)"
    );
    for (key, want_seg) in &want {
        let got_seg = got[key];
        assert_eq!(
            u(got_seg, "total_size"),
            u(want_seg, "total_size"),
            "{what}: total_size of segment {key:?}"
        );
        assert_eq!(
            block_list(got_seg),
            block_list(want_seg),
            "{what}: blocks of segment {key:?} (address, size, requested_size, state)"
        );
    }
}

/// Every allocated block of the truth has an `alloc` trace entry at its address, of its
/// requested size, with frames.
fn assert_allocs_have_frames(snap: &Value, truth: &Value) {
    let traces = snap["device_traces"].as_array().expect("device_traces");
    for seg in segments(truth) {
        let dev = u(seg, "device") as usize;
        let entries = traces
            .get(dev)
            .and_then(Value::as_array)
            .unwrap_or_else(|| panic!("no device_traces[{dev}]"));
        for b in blocks(seg)
            .iter()
            .filter(|b| b["state"] == "active_allocated")
        {
            let alloc = entries
                .iter()
                .rev()
                .find(|e| e["action"] == "alloc" && e["addr"].as_u64() == Some(u(b, "address")))
                .unwrap_or_else(|| panic!("no alloc entry for block {b} on device {dev}"));
            assert_eq!(u(alloc, "size"), u(b, "requested_size"), "{alloc}");
            assert!(
                !alloc["frames"].as_array().is_none_or(Vec::is_empty),
                "alloc entry without frames: {alloc}"
            );
        }
    }
}

/// The fallback: one segment per cudaMalloc'd segment of the stand-in, each one allocated
/// block of the whole segment; `memsnap.torch_allocator` starts with `line`.
fn assert_segments_fallback(snap: &Value, truth: &Value, what: &str, line: &str) {
    assert!(
        torch_allocator_meta(snap).starts_with(line),
        "{what}: memsnap.torch_allocator = {:?}",
        torch_allocator_meta(snap)
    );
    let got: BTreeSet<(u64, u64, u64)> = segments(snap)
        .iter()
        .map(|s| (u(s, "device"), u(s, "address"), u(s, "total_size")))
        .collect();
    let want: BTreeSet<(u64, u64, u64)> = segments(truth)
        .iter()
        .map(|s| (u(s, "device"), u(s, "address"), u(s, "total_size")))
        .collect();
    assert_eq!(got, want, "{what}: the cudaMalloc'd segments");
    for seg in segments(snap) {
        let b = blocks(seg);
        assert_eq!(b.len(), 1, "{what}: one block per segment: {seg}");
        assert_eq!(u(&b[0], "address"), u(seg, "address"));
        assert_eq!(u(&b[0], "size"), u(seg, "total_size"));
        assert_eq!(b[0]["state"], "active_allocated");
    }
}

/// The allocator's own counters printed by the program agree with its truth JSON, and the
/// fake driver's live bytes are the reserved bytes.
fn assert_counters_match_truth(run: &Run, truth: &Value) {
    let r = run.results();
    for dev in 0..2u64 {
        assert_eq!(
            num(&r, &format!("allocated_bytes_{dev}")),
            bytes_in_state(truth, dev, "active_allocated"),
            "allocated bytes on device {dev}"
        );
        assert_eq!(
            num(&r, &format!("reserved_bytes_{dev}")),
            reserved(truth, dev),
            "reserved bytes on device {dev}"
        );
        assert_eq!(
            num(&run.truth_device(dev as u32), "live_bytes"),
            reserved(truth, dev),
            "the fake driver's live bytes on device {dev}"
        );
    }
}

fn standin_dir() -> &'static Path {
    fake_cuda()
}

/// The stand-in's folder copied into a temporary one with `version` in torch/version.py.
fn standin_copy_with_version(version: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let lib = dir.path().join("torch/lib");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::copy(
        standin_dir().join("torch/lib/libc10_cuda.so"),
        lib.join("libc10_cuda.so"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("torch/version.py"),
        format!("__version__ = '{version}'\n"),
    )
    .unwrap();
    dir
}

// ---------------------------------------------------------------- the stand-in alone

#[test]
fn standin_runs_without_memsnap() {
    let version = std::fs::read_to_string(standin_dir().join("torch/version.py")).unwrap();
    assert_eq!(version.trim(), "__version__ = '2.11.0+standin'");

    let (run, truth) = run_standin("mixed", &[], false);
    assert_counters_match_truth(&run, &truth);
    let r = run.results();
    assert_eq!(r["dump_rc"], "-2");
    assert_eq!(r["attach_calls"], "0");
    assert_eq!(r["tracker_calls"], "0");
    assert!(snapshot_files(run.dir.path()).is_empty());
    // The scenario holds what it claims: both devices, a pending free, an unsplit tail
    // (requested well below size), a fully free cached segment, inactive holes.
    let all: Vec<&Value> = segments(&truth).iter().flat_map(blocks).collect();
    assert!(all.iter().any(|b| b["state"] == "active_pending_free"));
    assert!(
        all.iter().any(|b| b["state"] == "active_allocated"
            && u(b, "size") - u(b, "requested_size") > 512 * 1024)
    );
    assert!(segments(&truth).iter().any(|s| {
        let b = blocks(s);
        b.len() == 1 && b[0]["state"] == "inactive"
    }));
    assert!(bytes_in_state(&truth, 0, "inactive") > 0 && bytes_in_state(&truth, 1, "inactive") > 0);
    assert!(segments(&truth).iter().any(|s| blocks(s).len() >= 4));

    let (run, truth) = run_standin("threads", &[], false);
    assert_counters_match_truth(&run, &truth);
    assert!(segments(&truth).len() >= 4, "{truth}");

    let (run, truth) = run_standin("oom", &[("FAKE_CUDA_CAPACITY", "64M")], false);
    assert_counters_match_truth(&run, &truth);
    let r = run.results();
    assert_eq!(
        num(&r, "oom_at"),
        18,
        "3 segments of 20 MiB hold 6 x 3 MiB each"
    );
    assert_eq!(bytes_in_state(&truth, 0, "inactive"), 6 * MIB);
    assert_eq!(reserved(&truth, 0), 60 * MIB);

    let (run, truth) = run_standin("mixed", &[("STANDIN_ALLOCATOR", "async")], false);
    assert_eq!(run.results()["allocator"], "async");
    assert_counters_match_truth(&run, &truth);
    assert!(segments(&truth).iter().all(|s| blocks(s).len() == 1));

    let leak = run_program("torch_leak.py", &[], &[], false);
    leak.assert_success();
    let r = leak.results();
    assert_eq!(num(&r, "allocated_bytes"), 25 * MIB);
    assert_eq!(num(&r, "expected_leak_bytes"), 25 * MIB);
    assert_eq!(r["steps_marked"], "0");
    assert_eq!(r["attach_calls"], "0");
    assert_eq!(
        num(&leak.truth_device(0), "live_bytes"),
        num(&r, "reserved_bytes")
    );
}

// ---------------------------------------------------------------- with memsnap

/// Microseconds since the Unix epoch, now.
fn wall_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// Every trace entry's time lies within `[from, to]` (wall clock, microseconds): block events
/// carry the allocator's own time-stamp counter reading, CUDA calls memsnap's, and the writer
/// turns both into the wall clock.
fn assert_times_within(snap: &Value, from: u64, to: u64, what: &str) {
    let mut n = 0;
    for trace in snap["device_traces"].as_array().expect("device_traces") {
        for e in trace.as_array().expect("a device's trace") {
            let t = u(e, "time_us");
            assert!(
                from <= t && t <= to,
                "{what}: {} at {t} outside the run [{from}, {to}]",
                e["action"]
            );
            n += 1;
        }
    }
    assert!(n > 0, "{what}: no trace entries");
}

#[test]
fn blocks_equal_the_allocators_own_state() {
    let started = wall_us();
    let (run, truth) = run_standin("mixed", &[], true);
    let ended = wall_us();
    let r = run.results();
    assert_eq!(r["dump_rc"], "0", "{}", run.stderr);
    assert_eq!(r["attach_calls"], "1", "memsnap attaches one tracker");
    for label in ["standin", "exit"] {
        let snap = snapshot(&run, label);
        let meta = torch_allocator_meta(&snap);
        assert!(
            meta.starts_with("blocks"),
            "{label}: torch_allocator = {meta:?}"
        );
        assert_blocks_equal(&snap, &truth, label);
        assert_allocs_have_frames(&snap, &truth);
        assert_times_within(&snap, started, ended, label);
    }
}

#[test]
fn threads_blocks_equal_the_allocators_own_state() {
    let (run, truth) = run_standin("threads", &[], true);
    assert_eq!(run.results()["dump_rc"], "0", "{}", run.stderr);
    let snap = snapshot(&run, "standin");
    let meta = torch_allocator_meta(&snap);
    assert!(meta.starts_with("blocks"), "torch_allocator = {meta:?}");
    assert_blocks_equal(&snap, &truth, "threads");
    assert_allocs_have_frames(&snap, &truth);
}

/// `(device, address) -> segment_pool_id` of every segment of a snapshot or a truth.
fn pool_ids(v: &Value) -> BTreeMap<(u64, u64), (u64, u64)> {
    segments(v)
        .iter()
        .map(|seg| {
            let pool = seg["segment_pool_id"]
                .as_array()
                .unwrap_or_else(|| panic!("no segment_pool_id pair in {seg}"));
            let id = |i: usize| pool[i].as_u64().expect("a pool id is an integer");
            ((u(seg, "device"), u(seg, "address")), (id(0), id(1)))
        })
        .collect()
}

/// CUDA graphs' private pools (torch.compile's `reduce-overhead`): each segment carries its
/// pool's id as the allocator records it, the default pool's (0, 0), a graph's its own.
#[test]
fn private_pools_segments_carry_their_pool_ids() {
    let (run, truth) = run_standin("graphs", &[], true);
    assert_eq!(run.results()["dump_rc"], "0", "{}", run.stderr);
    let want = pool_ids(&truth);
    let private: Vec<(u64, u64)> = want.values().copied().filter(|p| *p != (0, 0)).collect();
    assert_eq!(
        private,
        vec![(0, 1), (0, 1), (0, 1), (2, 0)],
        "the stand-in's own record: three segments of pool (0, 1), one of (2, 0)"
    );
    assert!(want.values().any(|p| *p == (0, 0)), "{truth}");
    for label in ["standin", "exit"] {
        let snap = snapshot(&run, label);
        assert!(torch_allocator_meta(&snap).starts_with("blocks"));
        assert_blocks_equal(&snap, &truth, label);
        assert_eq!(pool_ids(&snap), want, "{label}: segment_pool_id");
    }
    // The reports say which memory is in a private pool: (0, 1) holds a 2 MiB small
    // segment with one 2048-byte block, a 20 MiB one with a 3 MiB block and an 18 MiB one,
    // free; (2, 0) a 2 MiB segment with one 1024-byte block (700 bytes asked for).
    let file = snapshot_file(&run, "standin");
    let report = |command: &str| {
        let out = std::process::Command::new(common::memsnap_bin())
            .arg(command)
            .arg(&file)
            .output()
            .expect("memsnap runs");
        assert!(out.status.success(), "memsnap {command}: {out:?}");
        String::from_utf8(out.stdout).expect("UTF-8")
    };
    let summary = report("summary");
    for line in [
        "private   pool (0, 1): 40.0 MiB reserved in 3 segments, 3.0 MiB live",
        "private   pool (2, 0): 2.0 MiB reserved in 1 segment, 1.0 KiB live",
    ] {
        assert!(summary.contains(line), "no {line:?} in\n{summary}");
    }
    let explain = report("explain");
    assert!(
        explain.contains("device 0: private pool (0, 1): 40.0 MiB reserved in 3 segments"),
        "{explain}"
    );
}

#[test]
fn oom_file_shows_reserved_but_unallocated_bytes() {
    let (run, truth) = run_standin("oom", &[("FAKE_CUDA_CAPACITY", "64M")], true);
    let snap = snapshot(&run, "oom");
    let ooms: Vec<&Value> = snap["device_traces"][0]
        .as_array()
        .expect("device_traces[0]")
        .iter()
        .filter(|e| e["action"] == "oom")
        .collect();
    assert!(!ooms.is_empty(), "no oom entry in the OOM file");
    assert!(torch_allocator_meta(&snap).starts_with("blocks"));
    // The 2 MiB tails of the three full segments: reserved, not allocated.
    assert_eq!(bytes_in_state(&truth, 0, "inactive"), 6 * MIB);
    assert_eq!(
        bytes_in_state(&snap, 0, "inactive"),
        bytes_in_state(&truth, 0, "inactive")
    );
    assert_blocks_equal(&snap, &truth, "oom");
}

#[test]
fn async_allocator_is_left_alone() {
    let (run, truth) = run_standin("mixed", &[("STANDIN_ALLOCATOR", "async")], true);
    let r = run.results();
    assert_eq!(r["allocator"], "async");
    // Its attachAllocatorTraceTracker throws: memsnap must see the vtable mismatch first.
    assert_eq!(r["attach_calls"], "0");
    // PyTorch's cudaMallocAsync backend makes a CUDA call per tensor (cudaMallocAsync, as
    // the stand-in's async class): memsnap records those, and with no segment-level
    // allocation in the whole run its stream-ordered allocations found the allocator.
    let snap = snapshot(&run, "standin");
    assert_segments_fallback(&snap, &truth, "async", "tensors");
}

/// A program whose first CUDA allocation was stream-ordered, before PyTorch was loaded:
/// that one look found nothing, and the stream allocations look again once the library is
/// loaded (memsnap's writer sees the loader's count move), so the async allocator is still
/// found and described.
#[test]
fn async_allocator_is_found_after_earlier_stream_allocations() {
    let (run, truth) = run_standin(
        "mixed",
        &[("STANDIN_ALLOCATOR", "async"), ("STANDIN_FIRST", "async")],
        true,
    );
    assert_eq!(run.results()["attach_calls"], "0");
    let snap = snapshot(&run, "standin");
    assert_segments_fallback(&snap, &truth, "async after a stream allocation", "tensors");
}

/// `memsnap summary` says what memsnap saw of PyTorch's allocator, so that its reader knows
/// whether the live bytes are tensors inside the cache or the cache's segments.
#[test]
fn summary_names_what_was_seen_of_the_allocator() {
    for (allocator, line) in [
        ("native", "blocks: PyTorch 2.11.0+standin caching allocator"),
        ("async", "tensors: PyTorch 2.11.0+standin does not use"),
    ] {
        let (run, _) = run_standin("mixed", &[("STANDIN_ALLOCATOR", allocator)], true);
        let file = snapshot_file(&run, "standin");
        let out = std::process::Command::new(memsnap_bin())
            .arg("summary")
            .arg(&file)
            .output()
            .expect("run memsnap summary");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{allocator}: {text}");
        let want = format!("PyTorch's allocator: {line}");
        assert!(
            text.lines().any(|l| l.starts_with(&want)),
            "{allocator}: no line starting {want:?} in\n{text}"
        );
    }
}

#[test]
fn unknown_version_falls_back_to_segments() {
    let dir = standin_copy_with_version("1.0.0");
    let (run, truth) = run_standin(
        "mixed",
        &[("STANDIN_DIR", dir.path().to_str().unwrap())],
        true,
    );
    let r = run.results();
    assert_eq!(
        r["attach_calls"], "0",
        "no tracker for a layout memsnap does not know"
    );
    let snap = snapshot(&run, "standin");
    assert_segments_fallback(&snap, &truth, "version 1.0.0", "segments only");
    assert!(
        torch_allocator_meta(&snap).contains("1.0.0"),
        "the line names the version: {}",
        torch_allocator_meta(&snap)
    );
}

/// `memsnap ranks` marks the rank where memsnap could record PyTorch's allocator only as
/// segments (an unknown release there) while the other ranks have its blocks: that rank's
/// bytes are another kind of figure, whatever their size.
#[test]
fn ranks_marks_the_rank_whose_allocator_was_recorded_otherwise() {
    let ranks = tempfile::tempdir().unwrap();
    let unknown = standin_copy_with_version("1.0.0");
    for rank in 0..3 {
        let rank_var = rank.to_string();
        // Each process a rank of its own: without one, a file is named by its pid alone and
        // `ranks` counts no rank for it.
        let mut env: Vec<(&str, &str)> = vec![("RANK", &rank_var)];
        if rank == 2 {
            env.push(("STANDIN_DIR", unknown.path().to_str().unwrap()));
        }
        let (run, _) = run_standin("mixed", &env, true);
        let file = snapshot_file(&run, "standin");
        std::fs::copy(&file, ranks.path().join(format!("job-r{rank}.pickle"))).unwrap();
    }
    let v = memsnap_json(&["ranks", "--json", ranks.path().to_str().unwrap()]);
    let marked: Vec<(i64, String)> = v["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["outlier"] == true)
        .map(|r| (r["rank"].as_i64().unwrap(), r["reasons"].to_string()))
        .collect();
    assert_eq!(marked.len(), 1, "{marked:?}");
    assert_eq!(marked[0].0, 2);
    assert!(
        marked[0]
            .1
            .contains("recorded as segments only, not blocks as on 2 ranks"),
        "{marked:?}"
    );
}

/// A CUDA runtime opened with RTLD_LOCAL is not in the global scope, so `RTLD_NEXT` from
/// memsnap's `cudaMalloc` export cannot find it; the call must still reach it (by soname),
/// and the program must run exactly as without memsnap.
#[test]
fn a_runtime_opened_rtld_local_is_still_reached() {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let run = run_program(
        "torch_leak.py",
        &["local"],
        &[("PYTHONPATH", python.to_str().unwrap())],
        true,
    );
    run.assert_success();
    assert_eq!(run.results()["steps_marked"], "25", "{}", run.stderr);
    let snap = snapshot(&run, "exit");
    assert!(torch_allocator_meta(&snap).starts_with("blocks"));
}

#[test]
fn leaking_line_is_named() {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let run = run_program(
        "torch_leak.py",
        &[],
        &[("PYTHONPATH", python.to_str().unwrap())],
        true,
    );
    run.assert_success();
    let r = run.results();
    assert_eq!(r["steps_marked"], "25", "{}", run.stderr);
    let snap = snapshot(&run, "exit");
    assert!(torch_allocator_meta(&snap).starts_with("blocks"));
    let mut leaked = 0u64;
    for seg in segments(&snap) {
        for b in blocks(seg) {
            if b["state"] != "active_allocated" {
                continue;
            }
            let named = b["frames"].as_array().is_some_and(|frames| {
                frames.iter().any(|f| {
                    f["name"]
                        .as_str()
                        .is_some_and(|n| n.contains("keep_outputs"))
                })
            });
            if named {
                leaked += u(b, "size");
            }
        }
    }
    let expected = num(&r, "expected_leak_bytes");
    assert_eq!(expected, 25 * MIB);
    let off = leaked.abs_diff(expected);
    assert!(
        off * 100 <= expected,
        "bytes attributed to keep_outputs: {leaked}, expected {expected} (within 1%)"
    );
}

//! Tests of `explain`'s model, and the snapshots they build (`pub(crate)`: other modules'
//! tests reuse them). Cold: test code.

use super::leaks::Unit;
use super::*;
use memsnap_format::model::{Action, BlockState, Frame, Segment, StepMark, TraceEntry};

const MIB: i64 = 1 << 20;

fn fr(name: &str, line: i64) -> Frame {
    Frame {
        name: name.into(),
        filename: "/job/train.py".into(),
        line,
    }
}

/// A trace entry of `stack` at time `t` (the log's tests use it too).
pub(crate) fn ev(action: Action, addr: i64, size: i64, stack: u32, t: i64) -> TraceEntry {
    TraceEntry {
        action,
        addr,
        size,
        stream: 0,
        time_us: t,
        stack: Some(stack),
        device_free: None,
        user_metadata: None,
    }
}

/// A memsnap-style file of `rank` (stacks: 0 `keep` train.py:10, 1 `temp` train.py:20,
/// 2 `big` train.py:30) with `trace` on device `device` and `live` at the end.
fn file(rank: i64, device: i64, trace: Vec<TraceEntry>, live: &[(i64, i64, u32)]) -> Snapshot {
    let s = |k: &str, v: &str| (k.to_string(), Meta::Str(v.into()));
    let mut traces = vec![Vec::new(); device as usize + 1];
    traces[device as usize] = trace;
    Snapshot {
        frames: vec![fr("keep", 10), fr("temp", 20), fr("big", 30)],
        stacks: vec![vec![0], vec![1], vec![2]],
        segments: live
            .iter()
            .map(|&(a, b, st)| Segment::one_allocation(device, a, b, Some(st)))
            .collect(),
        device_traces: traces,
        memsnap: vec![
            s("rank", &rank.to_string()),
            s("local_rank", &rank.to_string()),
            ("pid".into(), Meta::Int(1000 + rank)),
            s("reason", "exit"),
            (
                "devices".into(),
                Meta::List(vec![Meta::Dict(vec![
                    ("device".into(), Meta::Int(device)),
                    ("total_bytes".into(), Meta::Int(512 * MIB)),
                ])]),
            ),
        ],
        ..Snapshot::default()
    }
}

fn digest_of(name: &str, snap: Snapshot) -> Digest {
    let read = Read::of_whole(snap, At::Auto);
    digest(name.into(), &read.loaded, &read.logs, &Options::default())
}

/// Rank `rank` holds 3 x 100 MiB of `big` and 1 MiB of `keep`, then asks for 512 MiB
/// at `t_oom` with 200 MiB free.
fn oom_file(rank: i64, t_oom: i64) -> Snapshot {
    let mut trace = Vec::new();
    for i in 0..3 {
        trace.push(ev(Action::SegmentAlloc, 0x1000 * (i + 1), 100 * MIB, 2, i));
        trace.push(ev(Action::Alloc, 0x1000 * (i + 1), 100 * MIB, 2, i));
    }
    trace.push(ev(Action::SegmentAlloc, 0x9000, MIB, 0, 5));
    trace.push(ev(Action::Alloc, 0x9000, MIB, 0, 5));
    let mut oom = ev(Action::Oom, 0, 512 * MIB, 1, t_oom);
    oom.device_free = Some(200 * MIB);
    trace.push(oom);
    let live = [
        (0x1000, 100 * MIB, 2),
        (0x2000, 100 * MIB, 2),
        (0x3000, 100 * MIB, 2),
        (0x9000, MIB, 0),
    ];
    file(rank, 0, trace, &live)
}

#[test]
fn an_oom_held_by_one_site_is_live_with_that_site_first() {
    let d = digest_of("r0.pickle", oom_file(0, 100));
    let o = d.oom.as_ref().unwrap();
    assert_eq!(o.verdict, Verdict::Live);
    assert_eq!(
        (o.request_bytes, o.device_free_bytes),
        (512 * MIB, Some(200 * MIB))
    );
    assert_eq!(o.sites[0].site, "/job/train.py:30 (big)");
    assert_eq!((o.sites[0].bytes, o.sites[0].allocations), (300 * MIB, 3));
    // No caching allocator: nothing reserved-but-free; 512 - 301 - 200 outside.
    assert_eq!(o.reserved_unallocated_bytes, Some(0));
    assert_eq!(o.outside_bytes, Some(11 * MIB));
    assert_eq!(o.owners.get("app"), Some(&(301 * MIB)));
    let x = build(vec![d]);
    assert_eq!(x.oom.unwrap().first_rank, Some(0));
    assert!(x.leaks.is_empty());
}

#[test]
fn the_rank_that_ran_out_first_is_named_with_what_the_others_held() {
    let late = oom_file(1, 900);
    let x = build(vec![
        digest_of("r0.pickle", oom_file(0, 500)),
        digest_of("r1.pickle", late),
        digest_of("r2.pickle", oom_file(2, 300)),
    ]);
    let o = x.oom.unwrap();
    assert_eq!((o.rank, o.first_rank), (Some(2), Some(2)));
    let others: Vec<(Option<i64>, Option<i64>)> =
        o.others.iter().map(|r| (r.rank, r.live_bytes)).collect();
    // At t=300 ranks 0 and 1 had allocated everything (their allocations end at t=5).
    assert_eq!(
        others,
        [(Some(0), Some(301 * MIB)), (Some(1), Some(301 * MIB))]
    );
    assert!(
        x.notes
            .iter()
            .any(|n| n == "ranks 0, 1 ran out of memory too, later")
    );
}

/// 10 steps of 100 us, marked in one file, on a device of `capacity` bytes: `temp` 4 MiB
/// freed within the step, `keep` 1 MiB kept.
fn marked_leak(capacity: i64) -> Snapshot {
    let mut trace = Vec::new();
    let mut marks = Vec::new();
    for step in 0..10i64 {
        let t = step * 100;
        marks.push(StepMark {
            step,
            device: 0,
            time_us: t,
        });
        trace.push(ev(Action::Alloc, 0x5000, 4 * MIB, 1, t + 1));
        trace.push(ev(Action::Alloc, 0x100 + step, MIB, 0, t + 2));
        trace.push(ev(Action::FreeCompleted, 0x5000, 4 * MIB, 1, t + 3));
    }
    let live: Vec<(i64, i64, u32)> = (0..10).map(|s| (0x100 + s, MIB, 0)).collect();
    let mut snap = file(0, 0, trace, &live);
    snap.step_marks = marks;
    for (k, v) in &mut snap.memsnap {
        if k == "devices" {
            *v = Meta::List(vec![Meta::Dict(vec![
                ("device".into(), Meta::Int(0)),
                ("total_bytes".into(), Meta::Int(capacity)),
            ])]);
        }
    }
    snap
}

#[test]
fn step_marks_in_one_file_find_the_leak() {
    let x = build(vec![digest_of("r0.pickle", marked_leak(512 * MIB))]);
    assert_eq!(x.leaks.len(), 1, "{:?}", x.notes);
    let l = &x.leaks[0];
    assert_eq!(l.site, "/job/train.py:10 (keep)");
    assert_eq!(l.bytes_per_step, MIB);
    // Boundaries are step starts: 0 MiB at step 0's start ... 9 MiB at step 9's.
    assert_eq!((l.first_step, l.last_step), (0, 9));
    // 512 MiB capacity, 9 MiB in use at the last boundary.
    assert_eq!(x.steps_to_oom, Some(503));
    assert!(
        x.notes.iter().any(|n| n
            == "rank 0: at +1.0 MiB per step, out of memory in about 503 steps \
                (9.0 MiB of 512.0 MiB in use at step 9)"),
        "{:?}",
        x.notes
    );
}

#[test]
fn steps_to_oom_past_the_horizon_are_not_counted_in_the_text() {
    // 64 GiB at +1 MiB a step: 65527 steps, far past what 10 boundaries measured.
    let x = build(vec![digest_of("r0.pickle", marked_leak(64 << 30))]);
    assert_eq!(x.steps_to_oom, Some(65527), "the JSON keeps the figure");
    let note = x
        .notes
        .iter()
        .find(|n| n.contains("per step"))
        .expect("a note on when the creep fills the device");
    assert_eq!(
        note,
        "rank 0: at +1.0 MiB per step, not out of memory within the next 10000 steps \
         (9.0 MiB of 64.0 GiB in use at step 9)"
    );
    // At the horizon itself the count is still given.
    let x = build(vec![digest_of(
        "r0.pickle",
        marked_leak((STEPS_HORIZON + 9) * MIB),
    )]);
    assert_eq!(x.steps_to_oom, Some(STEPS_HORIZON));
    assert!(
        x.notes
            .iter()
            .any(|n| n.contains("out of memory in about 10000 steps")),
        "{:?}",
        x.notes
    );
}

#[test]
fn step_files_without_marks_find_the_leak_and_steady_ones_do_not() {
    let step_file = |step: i64, leak: bool| {
        let mut live = vec![(0x10, 8 * MIB, 1u32)];
        if leak {
            live.extend((0..step).map(|i| (0x1000 + i, MIB, 0u32)));
        }
        let mut snap = file(0, 0, Vec::new(), &live);
        snap.memsnap.retain(|(k, _)| k != "reason");
        snap.memsnap
            .push(("reason".into(), Meta::Str("step".into())));
        snap.memsnap.push(("step".into(), Meta::Int(step)));
        digest_of(&format!("r0-step{step}.pickle"), snap)
    };
    let x = build((1..=8).map(|s| step_file(s, true)).collect());
    assert_eq!(x.leaking_sites(), ["/job/train.py:10 (keep)"]);
    assert_eq!(x.leaks[0].bytes_per_step, MIB);
    let x = build((1..=8).map(|s| step_file(s, false)).collect());
    assert!(x.leaks.is_empty());
    assert!(
        x.notes
            .iter()
            .any(|n| n.contains("no leak across 8 step boundaries"))
    );
}

#[test]
fn a_rank_on_another_ranks_device_is_noted() {
    // Rank 1 (LOCAL_RANK 1) with memory on device 0.
    let snap = file(1, 0, Vec::new(), &[(0x10, MIB, 0)]);
    let x = build(vec![digest_of("r1.pickle", snap)]);
    let r = x.ranks.unwrap();
    assert_eq!(
        r.foreign_devices,
        [ForeignDevice {
            rank: 1,
            local_rank: 1,
            devices: vec![0]
        }]
    );
    assert!(
        x.notes
            .iter()
            .any(|n| n.contains("rank 1 (LOCAL_RANK 1) allocates on device 0"))
    );
}

#[test]
fn free_space_stranded_between_live_blocks_is_fragmentation() {
    use memsnap_format::model::Block;
    // PyTorch's own file: one 100 MiB segment, live 40 + 20 MiB, free 20 + 20 MiB; then
    // a 30 MiB request fails with 5 MiB free on the device.
    let block = |address: i64, mib: i64, state: BlockState| Block {
        address,
        size: mib * MIB,
        requested_size: mib * MIB,
        state,
        stack: Some(2),
    };
    let mut seg = Segment::one_allocation(0, 0, 100 * MIB, Some(2));
    seg.blocks = vec![
        block(0, 40, BlockState::ActiveAllocated),
        block(40 * MIB, 20, BlockState::Inactive),
        block(60 * MIB, 20, BlockState::ActiveAllocated),
        block(80 * MIB, 20, BlockState::Inactive),
    ];
    let mut oom = ev(Action::Oom, 0, 30 * MIB, 1, 10);
    oom.device_free = Some(5 * MIB);
    let snap = Snapshot {
        frames: vec![fr("big", 30), fr("ask", 40)],
        stacks: vec![vec![0], vec![1], vec![0]],
        segments: vec![seg],
        device_traces: vec![vec![oom]],
        ..Snapshot::default()
    };
    let d = digest_of("torch-oom.pickle", snap);
    let o = d.oom.unwrap();
    assert_eq!(o.verdict, Verdict::Fragmentation);
    assert_eq!(o.reserved_unallocated_bytes, Some(40 * MIB));
    assert_eq!(o.largest_free_block_bytes, Some(20 * MIB));
    assert!(o.advice.unwrap().contains("expandable_segments:True"));
    assert_eq!(o.owners.get(owners::TORCH_TENSORS), Some(&(60 * MIB)));
    assert_eq!(o.owners.get(owners::TORCH_CACHE_FREE), Some(&(40 * MIB)));
}

#[test]
fn a_private_pools_segments_are_named_with_their_pool() {
    let mut snap = file(
        0,
        0,
        Vec::new(),
        &[(0x1000, 4 * MIB, 0), (0x80_0000, MIB, 1)],
    );
    snap.segments[1].segment_pool_id = (0, 1);
    let d = digest_of("graphs.pickle", snap);
    let pools: Vec<&String> = d.notes.iter().filter(|n| n.contains("pool")).collect();
    assert_eq!(
        pools,
        vec![
            "graphs.pickle: device 0: private pool (0, 1): 1.0 MiB reserved in 1 segment, \
             1.0 MiB live at the end: a CUDA graph's (torch.compile \
             mode=\"reduce-overhead\") or a torch.cuda.MemPool's, kept for that pool's own \
             allocations"
        ]
    );
}

#[test]
fn segments_without_blocks_say_they_cannot_tell() {
    let mut snap = oom_file(0, 100);
    snap.memsnap.push((
        "torch_allocator".into(),
        Meta::Str("segments only: PyTorch 9.9: unknown release".into()),
    ));
    let o = digest_of("r0.pickle", snap).oom.unwrap();
    assert_eq!(o.verdict, Verdict::Live);
    assert_eq!(
        (o.reserved_unallocated_bytes, o.largest_free_block_bytes),
        (None, None)
    );
    assert!(
        o.cannot_tell
            .unwrap()
            .contains("segments only: PyTorch 9.9")
    );
}

#[test]
fn files_with_different_allocator_kinds_get_a_note() {
    let with = |rank: i64, line: &str| {
        let mut snap = file(rank, 0, Vec::new(), &[(0x10, MIB, 0)]);
        snap.memsnap
            .push(("torch_allocator".into(), Meta::Str(line.into())));
        digest_of(&format!("r{rank}.pickle"), snap)
    };
    let blocks = "blocks: PyTorch 2.11.0 caching allocator, through its trace tracker";
    let segments = "segments only: PyTorch 2.11.0: block events set aside";
    let x = build(vec![with(0, blocks), with(1, blocks), with(2, segments)]);
    let note = x
        .notes
        .iter()
        .find(|n| n.starts_with("PyTorch's allocator was recorded as different kinds"))
        .unwrap_or_else(|| panic!("no note: {:?}", x.notes));
    assert!(
        note.contains("blocks in rank 0, rank 1; segments only in rank 2."),
        "{note}"
    );
    let x = build(vec![with(0, blocks), with(1, blocks)]);
    assert!(
        !x.notes.iter().any(|n| n.contains("different kinds")),
        "{:?}",
        x.notes
    );
}

#[test]
fn an_empty_allocator_line_is_no_line() {
    let mut snap = oom_file(0, 100);
    snap.memsnap
        .push(("torch_allocator".into(), Meta::Str(String::new())));
    // memsnap writes the line empty when it found no PyTorch allocator: no line, so no
    // "the file says ``" in a verdict and no kind of its own in ranks.
    assert_eq!(owners::torch_allocator_line(&snap), None);
    assert_eq!(digest_of("r0.pickle", snap).torch_allocator, None);
}

#[test]
fn a_pid_is_no_rank() {
    let mut snap = file(7, 0, Vec::new(), &[(0x10, MIB, 0)]);
    snap.memsnap.retain(|(k, _)| k != "pid");
    snap.memsnap.push(("pid".into(), Meta::Int(7)));
    let d = digest_of("x.pickle", snap);
    assert_eq!((d.rank, d.local_rank), (None, None));
}

/// A loop of `iterations` without step marks on rank 0: each iteration `temp` (4 MiB) and
/// `big` (2 MiB), both freed within it, and `keep` (1 MiB, kept) when `leak`.
fn loop_file(iterations: i64, leak: bool) -> Snapshot {
    use Action::{Alloc, FreeCompleted};
    let (mut trace, mut live) = (Vec::new(), Vec::new());
    for k in 0..iterations {
        let base = 0x100_0000 * (k + 1);
        let mut push = |action, addr, size, stack| {
            let t = trace.len() as i64;
            trace.push(ev(action, addr, size, stack, t));
        };
        push(Alloc, base, 4 * MIB, 1);
        push(Alloc, base + 0x1000, 2 * MIB, 2);
        if leak {
            push(Alloc, base + 0x2000, MIB, 0);
            live.push((base + 0x2000, MIB, 0));
        }
        push(FreeCompleted, base + 0x1000, 2 * MIB, 2);
        push(FreeCompleted, base, 4 * MIB, 1);
    }
    file(0, 0, trace, &live)
}

/// `snap` as file number `seq` of process 4242 on host `node1`, written at `seq` seconds,
/// its history cut to its newest `keep` entries (the dropped ones counted).
fn of_process(mut snap: Snapshot, seq: i64, keep: usize) -> Snapshot {
    let trace = &mut snap.device_traces[0];
    let dropped = trace.len().saturating_sub(keep);
    trace.drain(..dropped);
    snap.memsnap
        .retain(|(k, _)| !matches!(k.as_str(), "rank" | "local_rank" | "pid" | "devices"));
    snap.memsnap.extend([
        ("pid".to_string(), Meta::Int(4242)),
        ("host".into(), Meta::Str("node1".into())),
        ("seq".into(), Meta::Int(seq)),
        (
            "time_us".into(),
            Meta::Int(1_700_000_000_000_000 + seq * 1_000_000),
        ),
        (
            "devices".into(),
            Meta::List(vec![Meta::Dict(vec![
                ("device".into(), Meta::Int(0)),
                ("total_bytes".into(), Meta::Int(512 * MIB)),
                ("history_dropped".into(), Meta::Int(dropped as i64)),
            ])]),
        ),
    ]);
    snap
}

#[test]
fn iterations_found_in_a_loop_without_marks_find_its_leak() {
    let x = build(vec![digest_of("r0.pickle", loop_file(20, true))]);
    let it = &x.iterations[0];
    assert!(it.found, "{it:?}");
    assert_eq!(
        (
            it.iterations,
            it.allocations_per_iteration,
            it.entries_per_iteration
        ),
        (Some(20), Some(3), Some(5))
    );
    assert_eq!(it.anchor_site.as_deref(), Some("/job/train.py:20 (temp)"));
    assert_eq!(it.confidence, Some(iterations::Confidence::High));
    assert_eq!(x.leaking_sites(), ["/job/train.py:10 (keep)"]);
    let l = &x.leaks[0];
    assert_eq!((l.unit, l.bytes_per_step), (Unit::Iteration, MIB));
    assert_eq!(l.bytes_per_iteration, Some(MIB));
    assert_eq!((l.first_step, l.last_step, l.steps), (1, 21, 20));
    assert_eq!(l.live_bytes_at_end, 20 * MIB);
    // 512 MiB of capacity, 20 MiB in use at the end: 492 iterations to go.
    assert_eq!(x.steps_to_oom, Some(492));
    assert!(
        x.notes
            .iter()
            .any(|n| n.contains("at +1.0 MiB per iteration, out of memory in about 492 iterations")),
        "{:?}",
        x.notes
    );
}

#[test]
fn a_leak_freed_at_exit_is_measured_over_the_iterations_not_the_exit() {
    // The leaking loop, then the process's exit frees everything it kept: the last
    // iteration ends before those frees, so the last boundary still holds the leak.
    let mut snap = loop_file(20, true);
    let kept: Vec<(i64, i64)> = snap
        .segments
        .iter()
        .map(|s| (s.address, s.total_size))
        .collect();
    let trace = &mut snap.device_traces[0];
    for (addr, size) in kept {
        let t = trace.len() as i64;
        trace.push(ev(Action::FreeCompleted, addr, size, 0, t));
    }
    snap.segments.clear();
    let x = build(vec![digest_of("r0.pickle", snap)]);
    assert_eq!(x.iterations[0].iterations, Some(20), "{:?}", x.iterations);
    assert_eq!(
        x.leaking_sites(),
        ["/job/train.py:10 (keep)"],
        "{:?}",
        x.notes
    );
    let l = &x.leaks[0];
    assert_eq!(l.bytes_per_iteration, Some(MIB));
    assert_eq!((l.first_step, l.last_step), (1, 21));
    assert_eq!(l.live_bytes_at_end, 20 * MIB);
}

#[test]
fn a_steady_loop_has_no_leak_and_a_short_history_says_what_would_help() {
    let x = build(vec![digest_of("r0.pickle", loop_file(20, false))]);
    assert!(x.leaks.is_empty());
    assert!(
        x.notes
            .iter()
            .any(|n| n == "no leak across 21 iteration boundaries (iterations 1 to 21)"),
        "{:?}",
        x.notes
    );
    let x = build(vec![digest_of("r0.pickle", loop_file(2, true))]);
    assert!(x.leaks.is_empty());
    assert!(!x.iterations[0].found);
    let note = x
        .notes
        .iter()
        .find(|n| n.starts_with("rank 0: no iterations found in r0.pickle: "))
        .unwrap_or_else(|| panic!("{:?}", x.notes));
    assert!(
        note.contains("its history is too short: no allocation comes back 4 times in its 6")
            && note.contains("MEMSNAP_MAX_ENTRIES")
            && note.contains("MEMSNAP_EVERY")
            && note.contains("two dumps"),
        "{note}"
    );
}

#[test]
fn two_snapshots_of_one_process_tell_a_leak_from_a_warm_up() {
    // Histories of 6 entries: too short for iterations. Between the files, `keep` gained
    // 15 MiB and still gains at the end of the second; `big` gained 8 MiB kept from before
    // the second file's history, which holds `big` flat.
    let a = of_process(loop_file(10, true), 1, 6);
    let mut b = of_process(loop_file(25, true), 2, 6);
    b.segments
        .push(Segment::one_allocation(0, 0x7000_0000, 8 * MIB, Some(2)));
    let x = build(vec![digest_of("b.pickle", b), digest_of("a.pickle", a)]);
    let s = &x.snapshots[0];
    assert_eq!(s.files, ["a.pickle", "b.pickle"]);
    assert_eq!((s.pid, s.host.as_deref()), (Some(4242), Some("node1")));
    assert_eq!(s.seconds, Some(1.0));
    assert_eq!(s.iterations, None, "no iterations to count by");
    let verdicts: Vec<(&str, i64, snapshots::Verdict)> = s
        .sites
        .iter()
        .map(|g| (g.site.as_str(), g.growth_bytes, g.verdict))
        .collect();
    assert_eq!(
        verdicts,
        [
            (
                "/job/train.py:10 (keep)",
                15 * MIB,
                snapshots::Verdict::Leak
            ),
            (
                "/job/train.py:30 (big)",
                8 * MIB,
                snapshots::Verdict::WarmUp
            ),
        ]
    );
    assert_eq!(x.leaking_sites(), ["/job/train.py:10 (keep)"]);
    let l = &x.leaks[0];
    assert_eq!(
        (l.unit, l.bytes_per_step, l.steps, l.live_bytes_at_end),
        (Unit::Snapshot, 15 * MIB, 1, 25 * MIB)
    );
    // Whole histories: the second file's iterations count those between the files.
    let a = of_process(loop_file(10, true), 1, usize::MAX);
    let b = of_process(loop_file(25, true), 2, usize::MAX);
    let x = build(vec![digest_of("a.pickle", a), digest_of("b.pickle", b)]);
    assert_eq!(x.snapshots[0].iterations, Some(15));
    assert_eq!(x.snapshots[0].sites[0].verdict, snapshots::Verdict::Leak);
    // The leak is told once, per iteration, from the latest file's history.
    assert_eq!(x.leaks.len(), 1, "{:?}", x.leaks);
    assert_eq!(x.leaks[0].unit, Unit::Iteration);
}

#[test]
fn files_of_other_processes_are_no_snapshots_of_one() {
    // Another pid; the same pid again from file number 1 (a new process).
    let a = of_process(loop_file(10, true), 3, 6);
    let mut other = of_process(loop_file(25, true), 2, 6);
    for (k, v) in &mut other.memsnap {
        if k == "pid" {
            *v = Meta::Int(5151);
        }
    }
    let again = of_process(loop_file(25, true), 1, 6);
    let mut later = again.clone();
    for (k, v) in &mut later.memsnap {
        if k == "time_us" {
            *v = Meta::Int(1_700_000_000_000_000 + 9_000_000);
        }
    }
    let digests = vec![
        digest_of("a.pickle", a),
        digest_of("other.pickle", other),
        digest_of("later.pickle", later),
    ];
    assert!(snapshots::groups(&digests).is_empty());
    let x = build(digests);
    assert!(x.snapshots.is_empty());
}

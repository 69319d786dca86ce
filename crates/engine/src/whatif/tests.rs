//! Tests of the allocator model on hand-built request sequences (each layout worked out by
//! hand from the rules in docs/WHATIF.md), of reading histories, and of the replay as
//! recorded on PyTorch's own snapshots (tests/fixtures/torch). Cold: test code.

use super::model::{Allocator, Driver, Fail, NONE};
use super::settings::{MIB, Release, Settings};
use super::*;
use memsnap_format::model::{Action, Block, BlockState, Frame, Segment, TraceEntry};

const R: Release = Release {
    major: 2,
    minor: 11,
};
const BASE: u64 = 0x1000_0000;
const VMM: u64 = 0x8000_0000_0000;

/// CUDA for the tests: addresses handed out upward with no reuse, a limit on what may be
/// held, and a log of every call.
#[derive(Default)]
struct TestDriver {
    next: u64,
    next_va: u64,
    limit: Option<u64>,
    log: Vec<String>,
}

impl Driver for TestDriver {
    fn malloc(&mut self, size: u64, held: u64) -> Option<u64> {
        if !self.has_room(size, held) {
            self.log.push(format!("malloc {} refused", size / MIB));
            return None;
        }
        let a = BASE + self.next;
        self.next += size;
        self.log
            .push(format!("malloc {} at +{}", size / MIB, (a - BASE) / MIB));
        Some(a)
    }
    fn free(&mut self, addr: u64, size: u64) {
        self.log
            .push(format!("free {} at +{}", size / MIB, (addr - BASE) / MIB));
    }
    fn reserve(&mut self, size: u64) -> u64 {
        let a = VMM + self.next_va;
        self.next_va += size;
        a
    }
    fn release(&mut self, addr: u64, _size: u64) {
        self.log.push(format!("release +{}", (addr - VMM) / MIB));
    }
    fn map(&mut self, addr: u64, size: u64, held: u64) -> bool {
        if !self.has_room(size, held) {
            self.log.push(format!("map {} refused", size / MIB));
            return false;
        }
        self.log
            .push(format!("map {} at +{}", size / MIB, (addr - VMM) / MIB));
        true
    }
    fn unmap(&mut self, addr: u64, size: u64) {
        self.log
            .push(format!("unmap {} at +{}", size / MIB, (addr - VMM) / MIB));
    }
    fn has_room(&self, size: u64, held: u64) -> bool {
        self.limit.is_none_or(|l| held + size <= l)
    }
}

fn settings(conf: &str) -> Settings {
    Settings::default().with(conf, R, &mut Vec::new()).unwrap()
}

fn alloc(conf: &str) -> Allocator {
    Allocator::new(settings(conf), 80 << 30)
}

fn m(a: &mut Allocator, d: &mut TestDriver, bytes: u64) -> u32 {
    a.malloc(d, bytes, 0, None, 0).expect("served")
}

/// Each segment's blocks as `size[*]` in MiB (`*`: in use), relative to the segment.
fn layout(a: &Allocator) -> Vec<String> {
    a.segments_with_blocks()
        .into_iter()
        .map(|(_, _, blocks)| {
            let blocks: Vec<String> = blocks
                .iter()
                .map(|b| {
                    let mib = b.1 as f64 / MIB as f64;
                    format!("{mib}{}", if b.2 { "*" } else { "" })
                })
                .collect();
            blocks.join(" ")
        })
        .collect()
}

#[test]
fn small_requests_share_a_two_mib_segment_and_merge_back() {
    let mut d = TestDriver::default();
    let mut a = alloc("");
    // 1000 B → 1024; 3000 B → 3072, right after it; the rest stays one free block.
    let x = m(&mut a, &mut d, 1000);
    let y = m(&mut a, &mut d, 3000);
    assert_eq!(a.block(x).size, 1024);
    assert_eq!(a.block(y).addr, a.block(x).addr + 1024);
    assert_eq!(a.block(y).size, 3072);
    assert_eq!(d.log, ["malloc 2 at +0"]);
    assert_eq!((a.reserved, a.allocated), (2 * MIB, 4096));
    a.free(x, false);
    // x's space is free on its own (y is in use after it); then everything merges.
    assert_eq!(a.largest_free_block(), 2 * MIB - 4096);
    a.free(y, false);
    assert_eq!(layout(&a), ["2"]);
    assert_eq!(a.largest_free_block(), 2 * MIB);
}

#[test]
fn large_requests_split_only_above_one_mib_and_round_to_two_mib() {
    let mut d = TestDriver::default();
    let mut a = alloc("");
    // 1.5 MiB takes a 20 MiB segment, 18.5 MiB stay free.
    let x = m(&mut a, &mut d, 3 * MIB / 2);
    assert_eq!(a.block(x).size, 3 * MIB / 2);
    // 19 MiB: no free block that large, a new 20 MiB segment; the 1 MiB left is not more
    // than 1 MiB, so the block keeps it.
    let y = m(&mut a, &mut d, 19 * MIB);
    assert_eq!(a.block(y).size, 20 * MIB);
    // 18 MiB fits the 18.5 MiB left of the first segment: 0.5 MiB is not split off.
    let w = m(&mut a, &mut d, 18 * MIB);
    assert_eq!(a.block(w).size, 37 * MIB / 2);
    // 11 MiB + 1: rounded up to 512, a 12 MiB segment, the rest (under 1 MiB) kept.
    let z = m(&mut a, &mut d, 11 * MIB + 1);
    assert_eq!(a.block(z).size, 12 * MIB);
    assert_eq!(
        d.log,
        ["malloc 20 at +0", "malloc 20 at +20", "malloc 12 at +40"]
    );
    assert_eq!(layout(&a), ["1.5* 18.5*", "20*", "12*"]);
    assert_eq!(a.reserved, 52 * MIB);
}

#[test]
fn best_fit_takes_the_smallest_block_then_the_lowest_address() {
    let mut d = TestDriver::default();
    let mut a = alloc("");
    // Three 12 MiB segments of 11 MiB blocks; the second and third freed: two free blocks
    // of the same size, the lower address wins; a 5 MiB free block would win over both.
    let b: Vec<u32> = (0..3).map(|_| m(&mut a, &mut d, 11 * MIB)).collect();
    a.free(b[2], false);
    a.free(b[1], false);
    let again = m(&mut a, &mut d, 10 * MIB + 1);
    assert_eq!(a.block(again).addr, BASE + 12 * MIB);
    assert_eq!(d.log.len(), 3);
}

#[test]
fn max_split_size_keeps_oversize_blocks_whole_and_within_the_rounding_limit() {
    let mut d = TestDriver::default();
    let mut a = alloc("max_split_size_mb:40");
    let big = m(&mut a, &mut d, 50 * MIB);
    let huge = m(&mut a, &mut d, 100 * MIB);
    a.free(big, false);
    a.free(huge, false);
    // 30 MiB is below the limit: an oversize cached block is not split for it.
    let x = m(&mut a, &mut d, 30 * MIB);
    assert_eq!(a.block(x).size, 30 * MIB);
    assert_eq!(d.log.last().unwrap(), "malloc 30 at +150");
    // 45 MiB takes the 50 MiB block whole (50 < 45 + 20); 70 MiB may not take the 100 MiB
    // one (100 >= 70 + 20).
    let y = m(&mut a, &mut d, 45 * MIB);
    assert_eq!((a.block(y).addr, a.block(y).size), (BASE, 50 * MIB));
    let z = m(&mut a, &mut d, 70 * MIB);
    assert_eq!(a.block(z).addr, BASE + 180 * MIB);
    assert_eq!(d.log.len(), 4);
}

#[test]
fn a_full_device_frees_cached_segments_then_retries() {
    let mut d = TestDriver {
        limit: Some(64 * MIB),
        ..TestDriver::default()
    };
    let mut a = alloc("");
    let x = m(&mut a, &mut d, 30 * MIB);
    let y = m(&mut a, &mut d, 20 * MIB);
    a.free(x, false);
    // 40 MiB: no free block, 50 + 40 > 64: the cached 30 MiB segment goes back, then it fits.
    let z = m(&mut a, &mut d, 40 * MIB);
    assert_eq!(
        d.log,
        [
            "malloc 30 at +0",
            "malloc 20 at +30",
            "malloc 40 refused",
            "free 30 at +0",
            "malloc 40 at +50"
        ]
    );
    // Now nothing cached can go back: out of memory.
    assert_eq!(
        a.malloc(&mut d, 10 * MIB, 0, None, 0),
        Err(Fail::Oom(super::model::OutOfMemory))
    );
    let _ = (y, z);
}

#[test]
fn under_max_split_size_the_smallest_oversize_block_goes_back_first() {
    let mut d = TestDriver {
        limit: Some(260 * MIB),
        ..TestDriver::default()
    };
    let mut a = alloc("max_split_size_mb:40");
    let blocks: Vec<u32> = [60, 80, 100]
        .iter()
        .map(|&s| m(&mut a, &mut d, s * MIB))
        .collect();
    for b in blocks {
        a.free(b, false);
    }
    // 50 MiB: no cached block may serve it (60 >= 50 + 20 is not true: 60 < 70, so the 60
    // MiB one does): it is taken whole.
    let x = m(&mut a, &mut d, 50 * MIB);
    assert_eq!(a.block(x).size, 60 * MIB);
    // 30 MiB: the cached 80 and 100 MiB blocks are oversize; 240 + 30 > 260: the smallest
    // oversize block that covers max(30, 40) MiB, the 80 MiB one, goes back alone.
    m(&mut a, &mut d, 30 * MIB);
    assert_eq!(
        &d.log[3..],
        ["malloc 30 refused", "free 80 at +60", "malloc 30 at +240"]
    );
}

#[test]
fn expandable_segments_grow_in_pages_and_unmap_free_pages() {
    // The fixture torch-expandable-segments.pickle's sequence: 30, 70, 150, 20 MiB, the 70
    // MiB tensor freed, empty_cache().
    let mut d = TestDriver::default();
    let mut a = alloc("expandable_segments:True");
    let t: Vec<u32> = [30, 70, 150, 20]
        .iter()
        .map(|&s| m(&mut a, &mut d, s * MIB))
        .collect();
    assert_eq!(
        d.log,
        [
            "map 40 at +0",
            "map 60 at +40",
            "map 160 at +100",
            "map 20 at +260"
        ]
    );
    // The 70 MiB block starts in the first mapping's 10 free MiB.
    assert_eq!(a.block(t[1]).addr, VMM + 30 * MIB);
    a.free(t[1], false);
    a.release_cached_blocks(&mut d);
    // Only whole pages inside the free 70 MiB go: 60 MiB at +40.
    assert_eq!(d.log.last().unwrap(), "unmap 60 at +40");
    assert_eq!(a.reserved, 220 * MIB);
    assert_eq!(a.segment_count(), 2);
    assert_eq!(layout(&a), ["30* 10", "150* 20* 10"]);
}

#[test]
fn a_free_that_waits_for_another_stream_keeps_its_block_until_it_completes() {
    let mut d = TestDriver::default();
    let mut a = alloc("");
    let x = m(&mut a, &mut d, 10 * MIB);
    a.free(x, true);
    assert!(a.is_active(x));
    // Its space cannot be handed out yet: a new segment.
    m(&mut a, &mut d, 10 * MIB);
    assert_eq!(d.log.len(), 2);
    a.complete(x);
    let again = m(&mut a, &mut d, 10 * MIB);
    assert_eq!(a.block(again).addr, BASE);
    // empty_cache() frees a waiting block first, then its segment.
    a.free(again, true);
    a.release_cached_blocks(&mut d);
    assert_eq!(d.log.last().unwrap(), "free 10 at +0");
}

#[test]
fn garbage_collection_frees_the_oldest_cached_segments_under_a_memory_fraction() {
    // 1 GiB device, fraction 0.5: 512 MiB allowed; collection above 0.5 of it (256 MiB).
    let mut d = TestDriver::default();
    let mut a = Allocator::new(
        settings("per_process_memory_fraction:0.5,garbage_collection_threshold:0.5"),
        1 << 30,
    );
    // Each request looks in the large pool once; 120 MiB is freed after the first look,
    // 130 MiB after the second; 150 MiB fits neither.
    let older = m(&mut a, &mut d, 120 * MIB);
    a.free(older, false);
    let newer = m(&mut a, &mut d, 130 * MIB);
    a.free(newer, false);
    m(&mut a, &mut d, 150 * MIB);
    // 200 MiB: no cached block fits; 400 MiB held is above 256: the cached blocks' ages
    // (looks since they were freed) are 3 and 2; the older one, at least the average, goes
    // (144 MiB to reclaim; 120 is less, the next round frees the 130 MiB one too).
    m(&mut a, &mut d, 200 * MIB);
    assert_eq!(
        &d.log[3..],
        ["free 120 at +0", "free 130 at +120", "malloc 200 at +400"],
        "{:?}",
        d.log
    );
    // 350 MiB held: another 200 MiB goes past the 512 MiB the fraction allows, whatever the
    // device has: out of memory.
    assert!(a.malloc(&mut d, 200 * MIB, 0, None, 0).is_err());
}

// ------------------------------------------------------------------ histories and replays

fn entry(action: Action, addr: u64, size: u64, api: &str) -> TraceEntry {
    TraceEntry {
        action,
        addr: addr as i64,
        size: size as i64,
        stream: 0,
        time_us: 0,
        stack: Some(0),
        device_free: None,
        user_metadata: Some(api.into()),
    }
}

/// A memsnap file with blocks: a cuBLAS-like allocation beside PyTorch's, on a device of
/// `capacity` bytes.
fn memsnap_file(trace: Vec<TraceEntry>, segments: Vec<Segment>, capacity: u64) -> Snapshot {
    Snapshot {
        frames: vec![Frame {
            name: "forward".into(),
            filename: "/job/train.py".into(),
            line: 3,
        }],
        stacks: vec![vec![0]],
        segments,
        device_traces: vec![trace],
        memsnap: vec![
            (
                "torch_allocator".into(),
                Meta::Str("blocks: PyTorch 2.11.0+cu130 caching allocator".into()),
            ),
            (
                "devices".into(),
                Meta::List(vec![Meta::Dict(vec![
                    ("device".into(), Meta::Int(0)),
                    ("total_bytes".into(), Meta::Int(capacity as i64)),
                ])]),
            ),
        ],
        ..Snapshot::default()
    }
}

const CA: &str = trace::CACHING_ALLOCATOR;

#[test]
fn memsnap_files_tell_pytorchs_segments_from_other_libraries_allocations() {
    let seg = 0x7000_0000u64;
    let lib = 0x7100_0000u64;
    let trace = vec![
        // Another library's cudaMalloc: segment_alloc + alloc of its own.
        entry(Action::SegmentAlloc, lib, 30 * MIB, "cudaMalloc"),
        entry(Action::Alloc, lib, 30 * MIB, "cudaMalloc"),
        // PyTorch's segment (the CUDA call's record) and a block in it.
        entry(Action::SegmentAlloc, seg, 20 * MIB, "cudaMalloc"),
        entry(Action::Alloc, seg, 5 * MIB, CA),
        entry(Action::FreeRequested, seg, 5 * MIB, CA),
        entry(Action::FreeCompleted, seg, 5 * MIB, CA),
        entry(Action::FreeRequested, lib, 30 * MIB, "cudaFree"),
        entry(Action::FreeCompleted, lib, 30 * MIB, "cudaFree"),
        entry(Action::SegmentFree, lib, 30 * MIB, "cudaFree"),
    ];
    let segments = vec![Segment {
        blocks: vec![Block {
            address: seg as i64,
            size: 20 * MIB as i64,
            requested_size: 0,
            state: BlockState::Inactive,
            stack: None,
        }],
        ..Segment::one_allocation(0, seg as i64, 20 * MIB as i64, None)
    }];
    let snap = memsnap_file(trace, segments, 1 << 30);
    let t = &trace::devices(&snap, trace::Source::MemsnapBlocks, &|_| true)[0];
    assert_eq!(t.requests.len(), 1);
    assert_eq!(t.outside.len(), 1);
    assert_eq!(t.segments.len(), 1);
    assert_eq!(t.recorded_peak_reserved, 20 * MIB);
    let r = whatif(&snap, &Options::default()).unwrap();
    assert!(r.checks[0].reproduced, "{:?}", r.checks);
    assert_eq!(r.scenarios[0].setting, AS_RECORDED);
    assert_eq!(r.scenarios[0].peak_reserved_bytes, Some(20 * MIB as i64));
    assert_eq!(r.scenarios[0].capacity_bytes, Some(1 << 30));
    assert_eq!(r.scenarios[0].fits, Some(true));
    assert_eq!(r.release, "2.11");
    // The other library's 30 MiB and PyTorch's 20 MiB segment do not fit in 40 MiB.
    let small = whatif(
        &snap,
        &Options {
            device_memory: Some(40 * MIB as i64),
            ..Options::default()
        },
    )
    .unwrap();
    let oom = small.scenarios[0].oom.clone().expect("runs out");
    assert_eq!((oom.request_bytes, oom.event), (5 * MIB as i64, 3));
    assert!(!oom.outside);
    assert_eq!(oom.site, "/job/train.py:3 (forward)");
}

#[test]
fn a_model_that_parts_from_the_recording_says_where() {
    // The recording took a 40 MiB segment for a 5 MiB request: not what PyTorch does.
    let seg = 0x7000_0000u64;
    let trace = vec![
        entry(Action::SegmentAlloc, seg, 40 * MIB, "cudaMalloc"),
        entry(Action::Alloc, seg, 5 * MIB, CA),
    ];
    let snap = memsnap_file(trace, Vec::new(), 1 << 30);
    let r = whatif(&snap, &Options::default()).unwrap();
    let c = &r.checks[0];
    assert!(!c.reproduced);
    let why = c.divergence.clone().unwrap();
    assert!(
        why.contains("41943040 bytes") && why.contains("20971520"),
        "{why}"
    );
}

#[test]
fn files_without_pytorchs_requests_are_refused_with_the_reason() {
    let mut snap = memsnap_file(Vec::new(), Vec::new(), 1 << 30);
    snap.memsnap[0].1 = Meta::Str("segments only: PyTorch 2.3: not known".into());
    let e = whatif(&snap, &Options::default()).unwrap_err();
    assert!(e.contains("segments without its blocks"), "{e}");
    snap.memsnap[0].1 = Meta::Str("blocks: PyTorch 2.2.0 caching allocator".into());
    let e = whatif(&snap, &Options::default()).unwrap_err();
    assert!(e.contains("2.4 to 2.15"), "{e}");
    let bad = Options {
        scales: vec!["activation=2".into()],
        ..Options::default()
    };
    snap.memsnap[0].1 = Meta::Str("blocks: PyTorch 2.11.0 caching allocator".into());
    assert!(whatif(&snap, &bad).unwrap_err().contains("not a role"));
}

#[test]
fn scaling_a_role_scales_its_requests_only() {
    let seg = 0x7000_0000u64;
    let trace = vec![
        entry(Action::SegmentAlloc, seg, 20 * MIB, "cudaMalloc"),
        entry(Action::Alloc, seg, 4 * MIB, CA),
    ];
    let snap = memsnap_file(trace, Vec::new(), 1 << 30);
    let r = whatif(
        &snap,
        &Options {
            scales: vec!["activations=3".into(), "gradients=3".into()],
            ..Options::default()
        },
    )
    .unwrap();
    let labels: Vec<&str> = r.scenarios.iter().map(|s| s.setting.as_str()).collect();
    assert_eq!(
        labels,
        [AS_RECORDED, "scale activations=3", "scale gradients=3"]
    );
    // `forward`: an activation: 12 MiB of it in the same 20 MiB segment; gradients: none.
    assert_eq!(r.scenarios[1].peak_allocated_bytes, Some(12 * MIB as i64));
    assert_eq!(r.scenarios[2].peak_allocated_bytes, Some(4 * MIB as i64));
}

#[test]
fn unknown_and_newer_settings_are_refused_per_scenario() {
    let seg = 0x7000_0000u64;
    let trace = vec![
        entry(Action::SegmentAlloc, seg, 20 * MIB, "cudaMalloc"),
        entry(Action::Alloc, seg, 4 * MIB, CA),
    ];
    let mut snap = memsnap_file(trace, Vec::new(), 1 << 30);
    snap.memsnap[0].1 = Meta::Str("blocks: PyTorch 2.6.1 caching allocator".into());
    let r = whatif(
        &snap,
        &Options {
            sets: vec![
                "large_segment_size_mb:40".into(),
                "frobnicate:1".into(),
                "expandable_segments:True".into(),
            ],
            ..Options::default()
        },
    )
    .unwrap();
    assert!(r.scenarios[1].refused.as_deref().unwrap().contains("2.6"));
    assert!(
        r.scenarios[2]
            .refused
            .as_deref()
            .unwrap()
            .contains("frobnicate")
    );
    assert_eq!(r.scenarios[1].peak_reserved_bytes, None);
    assert_eq!(r.scenarios[3].refused, None);
    assert_eq!(r.scenarios[3].peak_reserved_bytes, Some(20 * MIB as i64));
}

fn fixture(name: &str) -> Snapshot {
    let path = format!(
        "{}/../../tests/fixtures/torch/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let mut f = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    memsnap_format::pickle_read::read_snapshot_from(&mut f, &mut |_| {}).expect("a snapshot")
}

#[test]
fn pytorchs_own_snapshots_replay_as_recorded_to_the_byte() {
    for (name, peak, ops) in [
        ("torch-python-stacks.pickle", 232 * MIB, 14),
        ("torch-leak-step11.pickle", 108 * MIB, 6),
        ("torch-expandable-segments.pickle", 280 * MIB, 5),
        ("torch-oom.pickle", 64 << 30, 4),
        // Its history begins after the parameters exist: from that state.
        ("torch-transformer-all-stacks.pickle", 1_457_520_640, 60),
    ] {
        let snap = fixture(name);
        let r = whatif(&snap, &Options::default()).unwrap();
        let c = &r.checks[0];
        assert!(c.reproduced, "{name}: {c:?}");
        assert_eq!(c.recorded_peak_reserved_bytes as u64, peak, "{name}");
        assert_eq!(c.model_peak_reserved_bytes as u64, peak, "{name}");
        assert_eq!(c.segment_operations, ops, "{name}");
        assert!(r.release_assumed, "{name}");
    }
    // The OOM: 4 x 16 GiB, then 16 GiB more where 14.7 GiB were free: no setting helps.
    let r = whatif(&fixture("torch-oom.pickle"), &Options::default()).unwrap();
    let o = r.recorded_oom.expect("the recorded OOM");
    assert_eq!((o.event, o.request_bytes), (8, 16 << 30));
    assert!(o.avoided_by.is_empty(), "{o:?}");
    assert_eq!(
        r.scenarios[0].capacity_bytes,
        Some((64 << 30) + 15_745_613_824)
    );
}

#[test]
fn a_changed_history_no_longer_replays_as_recorded() {
    // The leak fixture with one request made larger than its segment allows: the model takes
    // a segment the recording did not.
    let mut snap = fixture("torch-leak-step3.pickle");
    let t = &mut snap.device_traces[0];
    let i = t
        .iter()
        .position(|e| e.action == Action::Alloc && e.size > 4 * MIB as i64)
        .unwrap();
    t[i].size += 40 * MIB as i64;
    let r = whatif(&snap, &Options::default()).unwrap();
    assert!(!r.checks[0].reproduced, "{:?}", r.checks[0]);
    assert!(r.checks[0].divergence.is_some());
    let _ = NONE;
}

//! Tests of the snapshot checker: each rule of docs/FORMAT.md broken on purpose, and
//! files that keep them. Cold: test code.

use super::*;
use crate::model::{Block, Segment};
use crate::pickle_write::tests::minimal_example;
use ViolationKind as K;

const A: i64 = 0x7F00_0000_0000;
const MIB: i64 = 1 << 20;

fn ev(action: Action, addr: i64, size: i64) -> TraceEntry {
    TraceEntry {
        action,
        addr,
        size,
        stream: 0,
        time_us: 1_795_314_852_136_082,
        stack: None,
        device_free: None,
        user_metadata: None,
    }
}

/// A segment tiled by `blocks` = (size, requested_size, state).
fn seg(address: i64, blocks: &[(i64, i64, BlockState)], expandable: bool) -> Segment {
    let mut addr = address;
    let blocks = blocks
        .iter()
        .map(|&(size, requested_size, state)| {
            let b = Block {
                address: addr,
                size,
                requested_size,
                state,
                stack: None,
            };
            addr += size;
            b
        })
        .collect();
    Segment {
        device: 0,
        address,
        total_size: addr - address,
        stream: 0,
        segment_type: "large".into(),
        segment_pool_id: (0, 0),
        is_expandable: expandable,
        stack: None,
        blocks,
    }
}

fn snapshot(segments: Vec<Segment>, trace: Vec<TraceEntry>) -> Snapshot {
    Snapshot {
        segments,
        device_traces: vec![trace],
        ..Default::default()
    }
}

fn kinds(snap: &Snapshot) -> Vec<ViolationKind> {
    check(snap).into_iter().map(|v| v.kind).collect()
}

/// Every suffix of `snap`'s device-0 trace (the ring-buffer cut) must stay valid.
fn assert_valid_with_every_suffix(snap: &Snapshot) {
    let full = check(snap);
    assert!(
        full.is_empty(),
        "{}",
        full.iter().map(|v| format!("{v}\n")).collect::<String>()
    );
    for cut in 1..=snap.device_traces[0].len() {
        let mut capped = snap.clone();
        capped.device_traces[0].drain(..cut);
        let v = check(&capped);
        assert!(
            v.is_empty(),
            "suffix from {cut}: {}",
            v.iter().map(|v| format!("{v}\n")).collect::<String>()
        );
    }
}

#[test]
fn minimal_example_and_its_suffixes_are_valid() {
    assert_valid_with_every_suffix(&minimal_example());
}

use BlockState::{ActiveAllocated as Live, ActivePendingFree as Pending, Inactive};

/// Deterministic pseudo-random cudaMalloc-level history
/// (docs/FORMAT.md#one-segment-per-allocation) plus a caching-allocator style part
/// (several blocks per segment, segments kept, a deferred free).
fn generated() -> Snapshot {
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let mut rnd = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    let mut trace = Vec::new();
    let mut live: Vec<(i64, i64)> = Vec::new();
    let mut next = A;
    for _ in 0..300 {
        if live.len() < 20 && (live.is_empty() || rnd(2) == 0) {
            let n = 512 * (1 + rnd(4096) as i64);
            trace.push(ev(Action::SegmentAlloc, next, n));
            trace.push(ev(Action::Alloc, next, n));
            live.push((next, n));
            next += 2 * MIB * (1 + n / (2 * MIB));
        } else {
            let (a, n) = live.swap_remove(rnd(live.len() as u64) as usize);
            trace.push(ev(Action::FreeRequested, a, n));
            trace.push(ev(Action::FreeCompleted, a, n));
            trace.push(ev(Action::SegmentFree, a, n));
        }
    }
    // Caching-allocator part: one 20 MiB segment, blocks split out of it.
    let c = 0x7E00_0000_0000;
    trace.push(ev(Action::SegmentAlloc, c, 20 * MIB));
    trace.push(ev(Action::Alloc, c, 4 * MIB));
    trace.push(ev(Action::Alloc, c + 4 * MIB, 6 * MIB - 100));
    trace.push(ev(Action::Alloc, c + 10 * MIB, MIB));
    trace.push(ev(Action::FreeRequested, c, 4 * MIB));
    trace.push(ev(Action::FreeCompleted, c, 4 * MIB));
    trace.push(ev(Action::FreeRequested, c + 10 * MIB, MIB)); // deferred (record_stream)
    trace.push(TraceEntry {
        device_free: Some(MIB),
        ..ev(Action::Oom, 0, 80 << 30)
    });
    let mut segments: Vec<Segment> = {
        live.sort();
        live.iter()
            .map(|&(a, n)| seg(a, &[(n, n, Live)], false))
            .collect()
    };
    segments.insert(
        0,
        seg(
            c,
            &[
                (4 * MIB, 0, Inactive),
                (6 * MIB, 6 * MIB - 100, Live),
                (MIB, MIB, Pending),
                (9 * MIB, 0, Inactive),
            ],
            false,
        ),
    );
    snapshot(segments, trace)
}

#[test]
fn generated_history_and_its_suffixes_are_valid() {
    let snap = generated();
    assert!(snap.segments.len() > 2);
    assert_valid_with_every_suffix(&snap);
}

/// The history of the first torch-expandable-segments.pickle fixture (addresses as
/// recorded; kept here as written, whatever the fixture file holds now).
fn expandable() -> Snapshot {
    let m = |a: i64, n| ev(Action::SegmentMap, a, n);
    let trace = vec![
        m(12918456320, 41943040),
        ev(Action::Alloc, 12918456320, 31457280),
        m(12960399360, 62914560),
        // Spans the first two mapped ranges: legal only because they merged.
        ev(Action::Alloc, 12949913600, 73400320),
        m(13023313920, 167772160),
        ev(Action::Alloc, 13023313920, 157286400),
        m(13191086080, 20971520),
        ev(Action::Alloc, 13180600320, 20971520),
        ev(Action::FreeRequested, 12949913600, 73400320),
        ev(Action::FreeCompleted, 12949913600, 73400320),
        ev(Action::SegmentUnmap, 12960399360, 62914560),
    ];
    let segments = vec![
        seg(
            12918456320,
            &[(31457280, 31457280, Live), (10485760, 0, Inactive)],
            true,
        ),
        seg(
            13023313920,
            &[
                (157286400, 157286400, Live),
                (20971520, 20971520, Live),
                (10485760, 0, Inactive),
            ],
            true,
        ),
    ];
    snapshot(segments, trace)
}

#[test]
fn expandable_segments_map_merge_and_unmap() {
    assert_valid_with_every_suffix(&expandable());
}

#[test]
fn alloc_before_segment_alloc() {
    let mut snap = minimal_example();
    snap.device_traces[0].swap(5, 6);
    assert!(
        kinds(&snap).contains(&K::AllocOutsideSegment),
        "{:?}",
        kinds(&snap)
    );
}

#[test]
fn keeping_a_few_counts_the_rest() {
    let mut snap = minimal_example();
    // A time past what JavaScript holds exactly: a violation at every event.
    for e in &mut snap.device_traces[0] {
        e.time_us = i64::MAX;
    }
    let all = check(&snap);
    assert!(all.len() >= 2, "{all:?}");
    let few = check_keeping(&snap, 1);
    assert_eq!(few.total, all.len());
    assert_eq!(few.kept, all[..1]);
    assert_eq!(check_keeping(&snap, 0).kept, []);
}

#[test]
fn segment_free_before_the_blocks_free() {
    let mut snap = minimal_example();
    let t = &mut snap.device_traces[0];
    let seg_free = t.remove(4);
    t.insert(2, seg_free);
    let v = check(&snap);
    let hit = v
        .iter()
        .find(|v| v.kind == K::SegmentNotEmpty)
        .expect("SegmentNotEmpty");
    assert_eq!((hit.device, hit.event), (Some(0), Some(2)));
}

#[test]
fn missing_free_completed() {
    let mut snap = minimal_example();
    snap.device_traces[0].remove(3);
    let k = kinds(&snap);
    // The block stays pending: the segment cannot be freed and the address is reused.
    assert!(k.contains(&K::SegmentNotEmpty), "{k:?}");
    assert!(k.contains(&K::AllocOverlap), "{k:?}");
}

#[test]
fn free_completed_without_free_requested() {
    let mut snap = minimal_example();
    snap.device_traces[0].remove(2);
    assert_eq!(kinds(&snap), vec![K::FreeNotRequested]);
}

#[test]
fn free_requested_twice_and_free_size_mismatch() {
    let mut snap = minimal_example();
    let dup = snap.device_traces[0][2].clone();
    snap.device_traces[0].insert(2, dup);
    assert_eq!(kinds(&snap), vec![K::FreeRequestedTwice]);
    let mut snap = minimal_example();
    snap.device_traces[0][2].size = 100;
    assert_eq!(kinds(&snap), vec![K::FreeSizeMismatch]);
}

#[test]
fn double_free() {
    // A free of a block that the kept history already freed. (A free of a block the
    // history never allocated is accepted: the allocation may be in a dropped prefix.)
    let mut snap = minimal_example();
    snap.device_traces[0].insert(4, ev(Action::Free, A, MIB));
    let v = check(&snap);
    assert_eq!(
        v.iter().map(|v| v.kind).collect::<Vec<_>>(),
        vec![K::FreeUnknownBlock]
    );
    assert_eq!(v[0].event, Some(4));
}

#[test]
fn blocks_not_tiling() {
    let mut snap = minimal_example();
    snap.segments[0].blocks[0].size -= 512;
    snap.segments[0].blocks[0].requested_size -= 512;
    assert!(kinds(&snap).contains(&K::BlockTiling));
    let mut snap = minimal_example();
    snap.segments[0].blocks[0].address += 512;
    assert!(kinds(&snap).contains(&K::BlockTiling));
}

#[test]
fn requested_size_above_size() {
    let mut snap = minimal_example();
    snap.segments[0].blocks[0].requested_size += 1;
    assert!(kinds(&snap).contains(&K::RequestedSize));
}

#[test]
fn final_state_mismatch() {
    // The live allocation is missing from `segments`.
    let mut snap = minimal_example();
    snap.segments[0].blocks[0].state = Inactive;
    assert_eq!(kinds(&snap), vec![K::FinalStateMismatch]);
    // The snapshot says pending free, the history says allocated.
    let mut snap = minimal_example();
    snap.segments[0].blocks[0].state = Pending;
    assert_eq!(kinds(&snap), vec![K::FinalStateMismatch]);
    // The last segment_alloc has a different size from the snapshot's segment.
    let mut snap = minimal_example();
    snap.device_traces[0][5].size = 4 * MIB;
    assert!(kinds(&snap).contains(&K::FinalStateMismatch));
}

#[test]
fn segments_overlap() {
    let mut snap = minimal_example();
    let mut other = seg(A + MIB, &[(MIB, MIB, Live)], false);
    other.blocks[0].state = Inactive;
    snap.segments.push(other);
    assert!(kinds(&snap).contains(&K::SegmentOverlap));
}

#[test]
fn segment_device_without_trace_list() {
    let mut snap = minimal_example();
    snap.segments[0].device = 1;
    let k = kinds(&snap);
    assert!(k.contains(&K::MissingDeviceTrace), "{k:?}");
}

#[test]
fn segment_alloc_over_a_live_segment() {
    let mut snap = minimal_example();
    snap.device_traces[0].remove(4);
    assert!(kinds(&snap).contains(&K::SegmentAllocOverlap));
}

#[test]
fn segment_free_of_unknown_segment() {
    let mut snap = minimal_example();
    snap.device_traces[0][4].size = 2 * MIB;
    assert!(kinds(&snap).contains(&K::SegmentFreeUnknown));
}

#[test]
fn segment_map_overlap_and_unmap_of_unmapped_range() {
    let mut snap = expandable();
    snap.device_traces[0].insert(1, ev(Action::SegmentMap, 12918456320 + MIB, MIB));
    assert!(kinds(&snap).contains(&K::SegmentMapOverlap));
    let mut snap = expandable();
    // Unmapping a range that holds the live block.
    snap.device_traces[0].push(ev(Action::SegmentUnmap, 12918456320, 41943040));
    assert!(kinds(&snap).contains(&K::SegmentNotEmpty));
    // Unmapping the same range twice: the rule explains the second unmap by a range that
    // existed before the history (a dropped prefix could have mapped it), and then the
    // map at event 2 overlaps it.
    let mut snap = expandable();
    snap.device_traces[0].push(ev(Action::SegmentUnmap, 12960399360, 62914560));
    assert_eq!(kinds(&snap), vec![K::SegmentMapOverlap]);
    // Unmapping a range that straddles the end of a mapped range: rejected, reported
    // where the reconstructed start state makes the earlier events fail.
    let mut snap = expandable();
    snap.device_traces[0].push(ev(Action::SegmentUnmap, 12960399360 - MIB, 2 * MIB));
    let k = kinds(&snap);
    assert!(k.contains(&K::SegmentMapOverlap), "{k:?}");
    // Unmapping part of a whole (segment_alloc) segment.
    let mut snap = minimal_example();
    snap.device_traces[0].insert(5, ev(Action::SegmentUnmap, A, MIB));
    let k = kinds(&snap);
    assert!(k.contains(&K::SegmentUnmapUnmapped), "{k:?}");
}

#[test]
fn capped_history_must_start_from_a_valid_state() {
    // A suffix that frees a block no segment ever held.
    let mut snap = minimal_example();
    snap.device_traces[0] = vec![
        ev(Action::FreeRequested, A + 64 * MIB, MIB),
        ev(Action::FreeCompleted, A + 64 * MIB, MIB),
    ];
    let v = check(&snap);
    assert_eq!(
        v.iter().map(|v| v.kind).collect::<Vec<_>>(),
        vec![K::InitialState]
    );
    assert_eq!(v[0].event, Some(0));
}

#[test]
fn bad_ids_and_ranges() {
    let mut snap = minimal_example();
    snap.stacks.push(vec![7]);
    snap.device_traces[0][0].stack = Some(9);
    assert_eq!(kinds(&snap), vec![K::BadStack, K::BadStack]);
    let mut snap = minimal_example();
    snap.device_traces[0][6].time_us = 1 << 53;
    assert_eq!(kinds(&snap), vec![K::ValueRange]);
    let mut snap = minimal_example();
    snap.device_traces[0].push(ev(Action::Other("mystery".into()), A, 0));
    assert_eq!(kinds(&snap), vec![K::UnknownAction]);
    let mut snap = minimal_example();
    snap.device_traces[0].push(ev(Action::Oom, 0, 80 << 30));
    assert_eq!(kinds(&snap), vec![K::OomWithoutDeviceFree]);
}

/// The Python checker (tests/python/check_snapshot.py) must agree on valid and on
/// broken histories, through the real encoder.
#[test]
fn python_checker_agrees() {
    let Ok(st) = std::process::Command::new("python3")
        .arg("-c")
        .arg("pass")
        .status()
    else {
        return;
    };
    assert!(st.success());
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/python/check_snapshot.py");
    let mut broken_dup = minimal_example();
    let dup = broken_dup.device_traces[0][2].clone();
    broken_dup.device_traces[0].insert(2, dup);
    let mut broken_order = minimal_example();
    broken_order.device_traces[0].swap(5, 6);
    let mut capped = generated();
    capped.device_traces[0].drain(..333);
    let cases = [
        (minimal_example(), true),
        (generated(), true),
        (capped, true),
        (expandable(), true),
        (broken_dup, false),
        (broken_order, false),
    ];
    for (i, (snap, valid)) in cases.iter().enumerate() {
        assert_eq!(check(snap).is_empty(), *valid, "case {i}: Rust checker");
        let file = tempfile::NamedTempFile::new().unwrap();
        crate::pickle_write::write_to(snap, file.as_file()).unwrap();
        let out = std::process::Command::new("python3")
            .arg(&script)
            .arg(file.path())
            .output()
            .unwrap();
        assert_eq!(
            out.status.success(),
            *valid,
            "case {i}: Python checker said\n{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

/// The Python checker passes its own self-test (valid and broken histories, the crash
/// table of docs/FORMAT.md#backward-walk) and accepts the six real PyTorch snapshots in
/// tests/fixtures/torch.
#[test]
fn python_checker_self_test_and_torch_fixtures() {
    let Ok(st) = std::process::Command::new("python3")
        .arg("-c")
        .arg("pass")
        .status()
    else {
        return;
    };
    assert!(st.success());
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let root = root.as_path();
    let script = root.join("tests/python/check_snapshot.py");
    let out = std::process::Command::new("python3")
        .arg(&script)
        .arg("--self-test")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let mut fixtures: Vec<_> = std::fs::read_dir(root.join("tests/fixtures/torch"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "pickle"))
        .collect();
    fixtures.sort();
    assert_eq!(fixtures.len(), 6, "{fixtures:?}");
    let out = std::process::Command::new("python3")
        .arg(&script)
        .arg("--json")
        .args(&fixtures)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let events: u64 = summary
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["events_per_device"][0].as_u64().unwrap())
        .sum();
    // Every event of the six files (tests/fixtures/torch/fixtures.json, from pickle.load).
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("tests/fixtures/torch/fixtures.json")).unwrap(),
    )
    .unwrap();
    let expected: u64 = manifest["files"]
        .as_object()
        .unwrap()
        .values()
        .map(|f| f["events"][0].as_u64().unwrap())
        .sum();
    assert_eq!(events, expected);
}

#[test]
fn display_names_device_and_event() {
    let mut snap = minimal_example();
    snap.device_traces[0].swap(5, 6);
    let v = check(&snap);
    let text = v
        .iter()
        .find(|v| v.kind == K::AllocOutsideSegment)
        .unwrap()
        .to_string();
    assert!(
        text.starts_with("device 0, event 5: alloc [0x7f0000000000, +3145728)"),
        "{text}"
    );
}

/// What the reader saw of the file: protocol 5, opcodes and batches the viewer does
/// not take, a 9-byte LONG1, and frames that are an integer, a list, dicts without
/// `filename` or an int `line`, a `frames` that is not a list. memsnap's own file and
/// the model's minimal example pass.
#[test]
fn encoding_rules_protocol_opcodes_batches_and_frames() {
    use crate::pickle_read::read_snapshot_encoding_from;
    let kinds = |b: &[u8]| {
        let (_, e) = read_snapshot_encoding_from(&mut &b[..], &mut |_| {}).unwrap();
        check_encoding(&e)
            .into_iter()
            .map(|v| (v.kind, v.message))
            .collect::<Vec<_>>()
    };
    let good = crate::pickle_write::to_bytes(&generated());
    assert_eq!(kinds(&good), []);
    assert_eq!(
        kinds(&crate::pickle_write::to_bytes(&minimal_example())),
        []
    );
    let mut p5 = good.clone();
    assert_eq!(p5[..2], [0x80, 4]);
    p5[1] = 5;
    let k = kinds(&p5);
    assert_eq!(k.len(), 1);
    assert_eq!(k[0].0, K::Protocol);
    assert!(k[0].1.contains("protocol 5"), "{}", k[0].1);

    let s = |b: &mut Vec<u8>, t: &str| {
        b.push(0x8c);
        b.push(t.len() as u8);
        b.extend_from_slice(t.as_bytes());
    };
    let mut b = vec![0x80, 4, b'}', b'('];
    s(&mut b, "device_traces");
    b.extend_from_slice(b"](](");
    // Frames lists: [5], [[]], [{name}], [{name, filename, line: None}], and 7.
    let frames: [&[u8]; 5] = [
        b"](K\x05e",
        b"](]e",
        b"](}(\x8c\x04name\x8c\x01fue",
        b"](}(\x8c\x04name\x8c\x01f\x8c\x08filename\x8c\x01a\x8c\x04lineNue",
        b"K\x07",
    ];
    for i in 0..1001 {
        b.extend_from_slice(b"}(");
        s(&mut b, "action");
        s(&mut b, "alloc");
        s(&mut b, "size");
        b.extend_from_slice(b"I4096\n");
        if i == 0 {
            s(&mut b, "addr");
            b.extend_from_slice(&[0x8a, 9, 0, 0, 0, 0, 0, 0, 0, 0x80, 0]);
        }
        if let Some(f) = frames.get(i) {
            s(&mut b, "frames");
            b.extend_from_slice(f);
        }
        b.push(b'u');
    }
    b.extend_from_slice(b"eeu.");
    let k = kinds(&b);
    let got: Vec<K> = k.iter().map(|(k, _)| *k).collect();
    assert_eq!(
        got,
        [K::Opcode, K::BatchSize, K::LongInt, K::BadFrame],
        "{k:?}"
    );
    assert!(k[0].1.contains("INT (0x49)"), "{}", k[0].1);
    assert!(k[1].1.contains("the largest 1001"), "{}", k[1].1);
    assert!(
        k[3].1.starts_with("5 frame(s)") && k[3].1.contains("an integer (5)"),
        "{}",
        k[3].1
    );
}

//! Tests of the pickle encoder, and the example snapshots they build (`pub(crate)`: the
//! checker's and readers' tests reuse them). Cold: test code.

use super::*;
use crate::model::{Action, Block, BlockState, Frame, Segment, TraceEntry};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::Command;

fn python3() -> Option<&'static str> {
    let ok = Command::new("python3")
        .arg("-c")
        .arg("pass")
        .status()
        .is_ok_and(|s| s.success());
    if ok { Some("python3") } else { None }
}

fn checker() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/python/check_snapshot.py")
}

/// Loads the pickle with Python and returns it as JSON: tuples become
/// `{"tuple": [...]}`, and `__ids__` lists `id()` of every event's and block's
/// frame list and of every frame dict inside them, so tests can check sharing.
const LOADER: &str = r#"
import json, pickle, sys
d = pickle.load(open(sys.argv[1], 'rb'))
def conv(o):
    if isinstance(o, tuple): return {"tuple": [conv(x) for x in o]}
    if isinstance(o, list): return [conv(x) for x in o]
    if isinstance(o, dict): return {k: conv(v) for k, v in o.items()}
    return o
ids = {"events": [[id(e["frames"]) for e in t] for t in d["device_traces"]],
       "frames": [[[id(f) for f in e["frames"]] for e in t] for t in d["device_traces"]],
       "segments": [id(s["frames"]) for s in d["segments"]],
       "blocks": [[id(b["frames"]) for b in s["blocks"]] for s in d["segments"]],
       "is_tuple": [isinstance(s["segment_pool_id"], tuple) for s in d["segments"]]}
out = conv(d); out["__ids__"] = ids
print(json.dumps(out))
"#;

struct Loaded {
    value: Value,
    ids: Value,
}

fn write_tmp(bytes: &[u8]) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(bytes).unwrap();
    f.flush().unwrap();
    f
}

/// Encodes, loads with Python, and runs the checker (`full` = every rule, else only
/// the opcode rules). `None` when python3 is missing.
fn roundtrip(snap: &Snapshot, full: bool) -> Option<Loaded> {
    let py = python3()?;
    let bytes = to_bytes(snap);
    let mut streamed = Vec::new();
    write_to(snap, &mut streamed).unwrap();
    assert_eq!(bytes, streamed, "write_to and to_bytes must agree");
    assert_eq!(&bytes[..2], &[0x80, 4], "PROTO 4 header");
    assert_eq!(bytes.last(), Some(&b'.'), "ends with STOP");
    let file = write_tmp(&bytes);
    let out = Command::new(py)
        .arg("-c")
        .arg(LOADER)
        .arg(file.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut value: Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids = value.as_object_mut().unwrap().remove("__ids__").unwrap();
    let mut cmd = Command::new(py);
    cmd.arg(checker()).arg(file.path());
    if !full {
        cmd.arg("--opcodes-only");
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "checker rejected the encoding:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Some(Loaded { value, ids })
}

/// The expected Python value, built independently of the encoder through serde_json.
fn expected(snap: &Snapshot) -> Value {
    let frames = |stack: Option<StackId>| -> Value {
        Value::Array(
            snap.stack_frames(stack)
                .map(|f| json!({"name": f.name, "filename": f.filename, "line": f.line}))
                .collect(),
        )
    };
    fn meta(m: &Meta) -> Value {
        match m {
            Meta::Bool(b) => json!(b),
            Meta::Int(i) => json!(i),
            Meta::Float(f) => json!(f),
            Meta::Str(s) => json!(s),
            Meta::List(l) => Value::Array(l.iter().map(meta).collect()),
            Meta::Dict(d) => dict(d),
        }
    }
    fn dict(d: &[(String, Meta)]) -> Value {
        Value::Object(d.iter().map(|(k, v)| (k.clone(), meta(v))).collect())
    }
    let segments: Vec<Value> = snap
        .segments
        .iter()
        .map(|s| {
            json!({
                "device": s.device, "address": s.address, "total_size": s.total_size,
                "allocated_size": s.allocated_size(), "active_size": s.active_size(),
                "requested_size": s.requested_size(), "stream": s.stream,
                "segment_type": s.segment_type,
                "segment_pool_id": {"tuple": [s.segment_pool_id.0, s.segment_pool_id.1]},
                "is_expandable": s.is_expandable, "frames": frames(s.stack),
                "blocks": s.blocks.iter().map(|b| json!({
                    "address": b.address, "size": b.size, "requested_size": b.requested_size,
                    "state": b.state.as_str(), "frames": frames(b.stack)})).collect::<Vec<_>>(),
            })
        })
        .collect();
    let traces: Vec<Value> = snap
        .device_traces
        .iter()
        .map(|t| {
            Value::Array(
                t.iter()
                    .map(|e| {
                        let mut v = json!({
                            "action": e.action.as_str(), "addr": e.addr, "size": e.size,
                            "stream": e.stream, "time_us": e.time_us, "frames": frames(e.stack),
                            "compile_context": "N/A",
                        });
                        if let Some(f) = e.device_free {
                            v["device_free"] = json!(f);
                        }
                        if let Some(m) = &e.user_metadata {
                            v["user_metadata"] = json!(&**m);
                        }
                        v
                    })
                    .collect(),
            )
        })
        .collect();
    let mut top = json!({
        "segments": segments, "device_traces": traces,
        "allocator_settings": dict(&snap.allocator_settings),
        "external_annotations": snap.step_marks.iter().map(|m| json!({
            "name": "memsnap.step", "stage": "START", "step": m.step,
            "device": m.device, "time_us": m.time_us})).collect::<Vec<_>>(),
    });
    if !snap.memsnap.is_empty() {
        top["memsnap"] = dict(&snap.memsnap);
    }
    top
}

fn frame(name: &str, line: i64) -> Frame {
    Frame {
        name: name.into(),
        filename: "/src/app.cpp".into(),
        line,
    }
}

fn ev(action: Action, addr: i64, size: i64, time_us: i64, stack: Option<StackId>) -> TraceEntry {
    TraceEntry {
        action,
        addr,
        size,
        stream: 0,
        time_us,
        stack,
        device_free: None,
        user_metadata: None,
    }
}

/// The example of docs/FORMAT.md#minimal-example.
pub(crate) fn minimal_example() -> Snapshot {
    const A: i64 = 0x7F00_0000_0000;
    let f = Some(0);
    let mut snap = Snapshot {
        frames: vec![frame("my_alloc", 42), frame("main", 7)],
        stacks: vec![vec![0, 1]],
        ..Default::default()
    };
    snap.segments.push(Segment {
        device: 0,
        address: A,
        total_size: 3 << 20,
        stream: 0,
        segment_type: "large".into(),
        segment_pool_id: (0, 0),
        is_expandable: false,
        stack: f,
        blocks: vec![Block {
            address: A,
            size: 3 << 20,
            requested_size: 3 << 20,
            state: BlockState::ActiveAllocated,
            stack: f,
        }],
    });
    snap.device_traces.push(vec![
        ev(Action::SegmentAlloc, A, 1 << 20, 1, f),
        ev(Action::Alloc, A, 1 << 20, 1, f),
        ev(Action::FreeRequested, A, 1 << 20, 2, f),
        ev(Action::FreeCompleted, A, 1 << 20, 2, f),
        ev(Action::SegmentFree, A, 1 << 20, 2, f),
        ev(Action::SegmentAlloc, A, 3 << 20, 3, f),
        ev(Action::Alloc, A, 3 << 20, 3, f),
    ]);
    snap
}

#[test]
fn minimal_example_loads_and_round_trips() {
    let snap = minimal_example();
    let Some(got) = roundtrip(&snap, true) else {
        return;
    };
    assert_eq!(got.value, expected(&snap));
    assert_eq!(got.ids["is_tuple"], json!([true]));
    // One stack everywhere: every frames value is the same Python list.
    let ev_ids = got.ids["events"][0].as_array().unwrap();
    assert!(ev_ids.iter().all(|i| *i == ev_ids[0]));
    assert_eq!(got.ids["segments"][0], ev_ids[0]);
    assert_eq!(got.ids["blocks"][0][0], ev_ids[0]);
}

#[test]
fn step_marks_are_external_annotations_and_read_back() {
    use crate::model::StepMark;
    let mut snap = minimal_example();
    snap.step_marks = (1..=3)
        .map(|step| StepMark {
            step,
            device: 0,
            time_us: 10 * step,
        })
        .collect();
    let bytes = to_bytes(&snap);
    let back = crate::pickle_read::read_snapshot(&bytes).unwrap();
    assert_eq!(back.step_marks, snap.step_marks);
    // Streamed the same.
    let streamed =
        crate::pickle_read::stream_snapshot_from(&mut &bytes[..], &mut |_| {}, &mut |_, _| {})
            .unwrap();
    assert_eq!(streamed.snapshot.step_marks, snap.step_marks);
    if let Some(got) = roundtrip(&snap, false) {
        assert_eq!(got.value, expected(&snap));
    }
}

const INTS: [i64; 15] = [
    0,
    255,
    256,
    65535,
    65536,
    (1 << 31) - 1,
    1 << 31,
    -1,
    -(1 << 31),
    -(1 << 31) - 1,
    1 << 47,
    (1 << 53) - 1,
    1 << 62,
    i64::MAX,
    i64::MIN,
];

#[test]
fn integers_round_trip_with_short_encodings() {
    let mut snap = Snapshot::default();
    snap.device_traces.push(
        INTS.iter()
            .enumerate()
            .map(|(i, &v)| ev(Action::Alloc, v, INTS[INTS.len() - 1 - i], v, None))
            .collect(),
    );
    snap.allocator_settings = INTS
        .iter()
        .enumerate()
        .map(|(i, &v)| (format!("i{i}"), Meta::Int(v)))
        .collect();
    snap.allocator_settings.push((
        "list".into(),
        Meta::List(INTS.iter().map(|&v| Meta::Int(v)).collect()),
    ));
    snap.allocator_settings
        .push(("gc".into(), Meta::Float(0.8)));
    snap.allocator_settings
        .push(("negative".into(), Meta::Float(-2.5e10)));
    snap.allocator_settings
        .push(("flag".into(), Meta::Bool(true)));
    snap.allocator_settings
        .push(("off".into(), Meta::Bool(false)));
    snap.memsnap = vec![("dropped".into(), Meta::Int(3))];
    let Some(got) = roundtrip(&snap, false) else {
        return;
    };
    assert_eq!(got.value, expected(&snap));

    // The exact encodings (docs/FORMAT.md#integers).
    let opcodes = |v: i64| {
        let mut e = Encoder::new(&snap, None);
        e.int(v);
        e.buf
    };
    assert_eq!(opcodes(0), [op::BININT1, 0]);
    assert_eq!(opcodes(255), [op::BININT1, 255]);
    assert_eq!(opcodes(256), [op::BININT2, 0, 1]);
    assert_eq!(opcodes(65535), [op::BININT2, 255, 255]);
    assert_eq!(opcodes(65536), [op::BININT, 0, 0, 1, 0]);
    assert_eq!(opcodes(-1), [op::BININT, 255, 255, 255, 255]);
    assert_eq!(opcodes((1 << 31) - 1), [op::BININT, 255, 255, 255, 127]);
    for v in [
        1i64 << 31,
        -(1 << 31) - 1,
        1 << 47,
        (1 << 53) - 1,
        i64::MAX,
        i64::MIN,
    ] {
        let mut want = vec![op::LONG1, 8];
        want.extend_from_slice(&v.to_le_bytes());
        assert_eq!(opcodes(v), want, "{v}");
    }
}

#[test]
fn strings_short_long_and_non_ascii() {
    let names = [
        String::new(),
        "a".repeat(255),
        "b".repeat(256),
        "c".repeat(70000),
        "αβγ — 日本語 🚀".to_string(),
        // 254 ASCII bytes + a 2-byte char = 256 bytes: must switch to BINUNICODE.
        format!("{}é", "d".repeat(254)),
    ];
    let mut snap = Snapshot::default();
    snap.frames = names
        .iter()
        .enumerate()
        .map(|(i, n)| Frame {
            name: n.clone(),
            filename: format!("/src/ü{i}.py"),
            line: i as i64,
        })
        .collect();
    snap.stacks = vec![(0..names.len() as u32).collect()];
    snap.device_traces.push(vec![TraceEntry {
        user_metadata: Some("cudaMallocAsync ✓".into()),
        ..ev(Action::Other("custom".into()), 0, 0, 0, Some(0))
    }]);
    let bytes = to_bytes(&snap);
    let has = |op: u8, len: usize, s: &str| {
        let mut pat = vec![op];
        if op == op::SHORT_BINUNICODE {
            pat.push(len as u8);
        } else {
            pat.extend_from_slice(&(len as u32).to_le_bytes());
        }
        pat.extend_from_slice(s.as_bytes());
        bytes.windows(pat.len()).any(|w| w == pat.as_slice())
    };
    assert!(has(op::SHORT_BINUNICODE, 0, ""));
    assert!(has(op::SHORT_BINUNICODE, 255, &names[1]));
    assert!(has(op::BINUNICODE, 256, &names[2]));
    assert!(has(op::BINUNICODE, 70000, &names[3]));
    assert!(has(op::BINUNICODE, 256, &names[5]));
    let Some(got) = roundtrip(&snap, false) else {
        return;
    };
    assert_eq!(got.value, expected(&snap));
}

#[test]
fn lists_are_batched_at_1000() {
    for n in [0usize, 1, 1000, 1001, 2500] {
        let mut snap = Snapshot::default();
        snap.frames = (0..n).map(|i| frame(&format!("f{i}"), i as i64)).collect();
        // Stack 0 holds all n frames (used once); the n events use a small stack 1.
        snap.stacks = vec![(0..n as u32).collect(), vec![0; n.min(1)]];
        snap.device_traces.push(
            (0..n)
                .map(|i| {
                    ev(
                        Action::Snapshot,
                        0,
                        i as i64,
                        i as i64,
                        Some(u32::from(i > 0)),
                    )
                })
                .collect(),
        );
        snap.device_traces.push(Vec::new());
        snap.allocator_settings = vec![
            (
                "list".into(),
                Meta::List((0..n as i64).map(Meta::Int).collect()),
            ),
            (
                "dict".into(),
                Meta::Dict(
                    (0..n)
                        .map(|i| (format!("k{i}"), Meta::Int(i as i64)))
                        .collect(),
                ),
            ),
        ];
        snap.segments.push(Segment {
            device: 0,
            address: 1 << 40,
            total_size: n as i64 * 512 + 512,
            stream: 0,
            segment_type: "large".into(),
            segment_pool_id: (0, 0),
            is_expandable: false,
            stack: None,
            blocks: (0..=n)
                .map(|i| Block {
                    address: (1 << 40) + i as i64 * 512,
                    size: 512,
                    requested_size: 0,
                    state: BlockState::Inactive,
                    stack: None,
                })
                .collect(),
        });
        // Many segments too (the top-level list is batched as well).
        let appends = to_bytes(&snap)
            .iter()
            .filter(|&&b| b == op::APPENDS)
            .count();
        assert!(
            n < 1000 || appends >= 3 * n.div_ceil(1000),
            "n={n}: {appends} APPENDS"
        );
        let Some(got) = roundtrip(&snap, false) else {
            return;
        };
        assert_eq!(got.value, expected(&snap), "n={n}");
    }
}

#[test]
fn shared_stacks_are_the_same_python_objects() {
    let mut snap = Snapshot::default();
    snap.frames = (0..5).map(|i| frame(&format!("f{i}"), i)).collect();
    // Stacks 0 and 1 share frames 1 and 2; stack 2 is empty; stack 3 is unused.
    snap.stacks = vec![vec![0, 1, 2], vec![3, 1, 2], vec![], vec![4]];
    let stacks = [
        Some(0),
        Some(1),
        Some(0),
        None,
        Some(2),
        Some(1),
        Some(2),
        None,
    ];
    snap.device_traces.push(
        stacks
            .iter()
            .enumerate()
            .map(|(i, &s)| ev(Action::Oom, 0, i as i64, i as i64, s))
            .collect(),
    );
    let Some(got) = roundtrip(&snap, false) else {
        return;
    };
    assert_eq!(got.value, expected(&snap));
    let ids: Vec<u64> = got.ids["events"][0]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    for i in 0..stacks.len() {
        for j in 0..stacks.len() {
            if i == j || stacks[i].is_none() || stacks[j].is_none() {
                continue;
            }
            assert_eq!(
                ids[i] == ids[j],
                stacks[i] == stacks[j],
                "events {i} and {j}"
            );
        }
    }
    // `None` is a fresh list every time.
    assert_ne!(ids[3], ids[7]);
    // Frame dicts 1 and 2 are shared between stacks 0 and 1.
    let f = &got.ids["frames"][0];
    assert_eq!(f[0][1], f[1][1]);
    assert_eq!(f[0][2], f[1][2]);
    assert_ne!(f[0][0], f[1][0]);
    // Each stack list and each frame dict is written once: the frame names occur once.
    let bytes = to_bytes(&snap);
    for name in ["f0", "f1", "f2", "f3"] {
        let pat = [&[op::SHORT_BINUNICODE, 2][..], name.as_bytes()].concat();
        assert_eq!(
            bytes.windows(4).filter(|w| *w == pat.as_slice()).count(),
            1,
            "{name}"
        );
    }
    // Frame 4 is only in the unused stack: not written at all.
    assert!(!bytes.windows(2).any(|w| w == b"f4"));
}

/// A sink that records how the bytes arrive.
struct Chunks(Vec<Vec<u8>>);
impl Write for Chunks {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.push(buf.to_vec());
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[test]
fn write_to_streams_large_snapshots_in_chunks() {
    let mut snap = Snapshot::default();
    snap.frames = (0..100).map(|i| frame(&format!("fn{i}"), i)).collect();
    snap.stacks = (0..50u32)
        .map(|i| (i..i + 30).map(|f| f % 100).collect())
        .collect();
    snap.device_traces.push(
        (0..60_000)
            .map(|i| {
                ev(
                    Action::Alloc,
                    0x7f00_0000_0000 + i * 512,
                    512,
                    1_795_314_852_136_082 + i,
                    Some((i % 50) as u32),
                )
            })
            .collect(),
    );
    let whole = to_bytes(&snap);
    assert!(whole.len() > 2 * FLUSH_AT, "{} bytes", whole.len());
    let mut sink = Chunks(Vec::new());
    write_to(&snap, &mut sink).unwrap();
    assert!(sink.0.len() >= 3, "{} chunks", sink.0.len());
    assert!(sink.0.iter().all(|c| c.len() < FLUSH_AT + (1 << 16)));
    assert_eq!(sink.0.concat(), whole);
    // An I/O error reaches the caller.
    struct Broken;
    impl Write for Broken {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Err(io::Error::other("disk full"))
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    assert_eq!(
        write_to(&snap, Broken).unwrap_err().to_string(),
        "disk full"
    );
}

#[test]
fn memo_switches_to_long_binput_past_255() {
    let mut snap = Snapshot::default();
    snap.frames = (0..600).map(|i| frame(&format!("fn{i}"), i)).collect();
    snap.stacks = (0..600u32).map(|i| vec![i]).collect();
    snap.device_traces.push(
        (0..1200)
            .map(|i| ev(Action::Snapshot, 0, 0, i, Some((i % 600) as u32)))
            .collect(),
    );
    let bytes = to_bytes(&snap);
    assert!(bytes.contains(&op::LONG_BINPUT));
    assert!(bytes.contains(&op::LONG_BINGET));
    let Some(got) = roundtrip(&snap, false) else {
        return;
    };
    assert_eq!(got.value, expected(&snap));
    let ids = got.ids["events"][0].as_array().unwrap();
    for i in 0..600 {
        assert_eq!(ids[i], ids[i + 600]);
    }
}

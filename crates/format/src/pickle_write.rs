//! Hand-written pickle encoder for [`Snapshot`]: the bytes that PyTorch's viewers load.
//!
//! Cold (writer thread / CLI), no unsafe. It follows the producer's checklist of
//! docs/FORMAT.md ("Producer's rules" and "Pickle subset"; summary in "How memsnap encodes"):
//! - a `PROTO 4` header and only opcodes from the viewer's whitelist
//!   (docs/FORMAT.md#opcodes-the-viewer-accepts);
//! - the memo is filled with explicit BINPUT/LONG_BINPUT and read with BINGET/LONG_BINGET,
//!   never MEMOIZE (the viewer numbers MEMOIZE separately, docs/FORMAT.md#memo-and-sharing);
//! - integers as BININT1/BININT2/BININT or an 8-byte LONG1, never 9 bytes
//!   (docs/FORMAT.md#integers);
//! - strings as SHORT_BINUNICODE (< 256 bytes) or BINUNICODE;
//! - lists batched ≤ 1000 items per MARK…APPENDS, dicts ≤ 1000 per MARK…SETITEMS
//!   (Producer's rules, rule 3);
//! - only strings, frame dicts and frame lists are memoized and shared. Event, segment and
//!   block dicts are written fresh every time because the viewer mutates them
//!   (docs/FORMAT.md#memo-and-sharing).
//!
//! Sharing is what keeps big histories small and fast: each unique frame dict and each
//! unique stack list is written once, and every later use is one BINGET.
//!
//! Note on the header: SHORT_BINUNICODE is a protocol-4 opcode, so the header says 4
//! (what CPython 3.8–3.13 writes for PyTorch's own files; the viewer accepts 2, 3 and 4,
//! never 5). No FRAME opcodes: they are optional and the viewer only skips them.

use std::io::{self, Write};

use rustc_hash::FxHashMap;

use super::model::{Meta, Snapshot, StackId};

/// Declared protocol; the viewer accepts 2, 3 and 4 (docs/FORMAT.md#opcodes-the-viewer-accepts).
const PROTOCOL: u8 = 4;
/// Largest MARK…APPENDS / MARK…SETITEMS batch (docs/FORMAT.md, "Producer's rules", rule 3).
const BATCH: usize = 1000;
/// `write_to` hands the buffer to the sink once it grows past this.
const FLUSH_AT: usize = 1 << 20;

mod op {
    pub const PROTO: u8 = 0x80;
    pub const STOP: u8 = b'.';
    pub const MARK: u8 = b'(';
    pub const EMPTY_DICT: u8 = b'}';
    pub const EMPTY_LIST: u8 = b']';
    pub const SETITEMS: u8 = b'u';
    pub const APPENDS: u8 = b'e';
    pub const TUPLE2: u8 = 0x86;
    pub const NEWTRUE: u8 = 0x88;
    pub const NEWFALSE: u8 = 0x89;
    pub const BININT1: u8 = b'K';
    pub const BININT2: u8 = b'M';
    pub const BININT: u8 = b'J';
    pub const LONG1: u8 = 0x8a;
    pub const BINFLOAT: u8 = b'G';
    pub const SHORT_BINUNICODE: u8 = 0x8c;
    pub const BINUNICODE: u8 = b'X';
    pub const BINPUT: u8 = b'q';
    pub const LONG_BINPUT: u8 = b'r';
    pub const BINGET: u8 = b'h';
    pub const LONG_BINGET: u8 = b'j';
}

/// Marks a frame or stack that has not been written yet.
const NOT_WRITTEN: u32 = u32::MAX;

/// Strings every snapshot repeats (keys, actions, states). Each gets the memo slot equal to
/// its index, reserved up front, so every later use is a 2-byte BINGET even when
/// thousands of frames were memoized before its first use. Dynamic memo slots start after
/// them. Explicit BINPUT indices may be chosen freely: Python's memo is a dict, the
/// viewer's an array indexed by the argument.
#[derive(Clone, Copy)]
#[repr(u8)]
enum Fixed {
    Segments,
    DeviceTraces,
    AllocatorSettings,
    ExternalAnnotations,
    Memsnap,
    Device,
    Address,
    TotalSize,
    AllocatedSize,
    ActiveSize,
    RequestedSize,
    Stream,
    SegmentType,
    SegmentPoolId,
    IsExpandable,
    Frames,
    Blocks,
    Size,
    State,
    Action,
    Addr,
    TimeUs,
    DeviceFree,
    UserMetadata,
    CompileContext,
    NotAvailable,
    Name,
    Filename,
    Line,
    ActiveAllocated,
    ActivePendingFree,
    Inactive,
    Alloc,
    FreeRequested,
    FreeCompleted,
    Free,
    SegmentAlloc,
    SegmentFree,
    SegmentMap,
    SegmentUnmap,
    SnapshotAction,
    Oom,
}

/// Indexed by `Fixed as usize`.
const FIXED: [&str; 42] = [
    "segments",
    "device_traces",
    "allocator_settings",
    "external_annotations",
    "memsnap",
    "device",
    "address",
    "total_size",
    "allocated_size",
    "active_size",
    "requested_size",
    "stream",
    "segment_type",
    "segment_pool_id",
    "is_expandable",
    "frames",
    "blocks",
    "size",
    "state",
    "action",
    "addr",
    "time_us",
    "device_free",
    "user_metadata",
    "compile_context",
    "N/A",
    "name",
    "filename",
    "line",
    "active_allocated",
    "active_pending_free",
    "inactive",
    "alloc",
    "free_requested",
    "free_completed",
    "free",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
    "oom",
];

fn fixed_action(action: &super::model::Action) -> Option<Fixed> {
    use super::model::Action as A;
    Some(match action {
        A::Alloc => Fixed::Alloc,
        A::FreeRequested => Fixed::FreeRequested,
        A::FreeCompleted => Fixed::FreeCompleted,
        A::Free => Fixed::Free,
        A::SegmentAlloc => Fixed::SegmentAlloc,
        A::SegmentFree => Fixed::SegmentFree,
        A::SegmentMap => Fixed::SegmentMap,
        A::SegmentUnmap => Fixed::SegmentUnmap,
        A::Snapshot => Fixed::SnapshotAction,
        A::Oom => Fixed::Oom,
        A::Other(_) => return None,
    })
}

fn fixed_state(state: super::model::BlockState) -> Fixed {
    use super::model::BlockState as S;
    match state {
        S::ActiveAllocated => Fixed::ActiveAllocated,
        S::ActivePendingFree => Fixed::ActivePendingFree,
        S::Inactive => Fixed::Inactive,
    }
}

/// Encodes `snap` as a pickle that PyTorch's viewers and `pickle.load` read.
pub fn to_bytes(snap: &Snapshot) -> Vec<u8> {
    let mut enc = Encoder::new(snap, None);
    // Without a sink the encoder never does I/O, so this cannot fail.
    enc.snapshot().expect("encoding into memory does no I/O");
    enc.buf
}

/// Encodes `snap` into `out`, in chunks of about 1 MiB (the whole file is never held in
/// memory twice).
pub fn write_to<W: Write>(snap: &Snapshot, mut out: W) -> io::Result<()> {
    let mut enc = Encoder::new(snap, Some(&mut out));
    enc.snapshot()?;
    let Encoder { buf, sink, .. } = enc;
    if let Some(sink) = sink {
        sink.write_all(&buf)?;
        sink.flush()?;
    }
    Ok(())
}

struct Encoder<'a, 's> {
    snap: &'a Snapshot,
    buf: Vec<u8>,
    sink: Option<&'s mut dyn Write>,
    /// Next free memo slot.
    memo_len: u32,
    /// Which [`FIXED`] strings have been written (their slot is their index).
    fixed_written: [bool; FIXED.len()],
    /// Memo slot of each string already written.
    strings: FxHashMap<&'a str, u32>,
    /// Memo slot of each frame dict, by frame index (`NOT_WRITTEN` if not yet written).
    frame_slots: Vec<u32>,
    /// Memo slot of each stack list, by stack id.
    stack_slots: Vec<u32>,
}

impl<'a, 's> Encoder<'a, 's> {
    fn new(snap: &'a Snapshot, sink: Option<&'s mut dyn Write>) -> Self {
        let events: usize = snap.device_traces.iter().map(Vec::len).sum();
        Encoder {
            snap,
            // About 60 bytes per event; the stacks come on top once.
            buf: Vec::with_capacity(if sink.is_some() {
                FLUSH_AT + (FLUSH_AT >> 2)
            } else {
                64 + events * 64
            }),
            sink,
            memo_len: FIXED.len() as u32,
            fixed_written: [false; FIXED.len()],
            strings: FxHashMap::default(),
            frame_slots: vec![NOT_WRITTEN; snap.frames.len()],
            stack_slots: vec![NOT_WRITTEN; snap.stacks.len()],
        }
    }

    fn maybe_flush(&mut self) -> io::Result<()> {
        if self.buf.len() >= FLUSH_AT
            && let Some(sink) = self.sink.as_mut()
        {
            sink.write_all(&self.buf)?;
            self.buf.clear();
        }
        Ok(())
    }

    fn snapshot(&mut self) -> io::Result<()> {
        let snap = self.snap;
        self.buf.extend_from_slice(&[op::PROTO, PROTOCOL]);
        self.buf.push(op::EMPTY_DICT);
        self.buf.push(op::MARK);

        self.key(Fixed::Segments);
        self.buf.push(op::EMPTY_LIST);
        for chunk in snap.segments.chunks(BATCH) {
            self.buf.push(op::MARK);
            for seg in chunk {
                self.segment(seg);
                self.maybe_flush()?;
            }
            self.buf.push(op::APPENDS);
        }

        self.key(Fixed::DeviceTraces);
        self.buf.push(op::EMPTY_LIST);
        for chunk in snap.device_traces.chunks(BATCH) {
            self.buf.push(op::MARK);
            for trace in chunk {
                self.buf.push(op::EMPTY_LIST);
                for events in trace.chunks(BATCH) {
                    self.buf.push(op::MARK);
                    for ev in events {
                        self.trace_entry(ev);
                    }
                    self.buf.push(op::APPENDS);
                    self.maybe_flush()?;
                }
            }
            self.buf.push(op::APPENDS);
        }

        self.key(Fixed::AllocatorSettings);
        self.meta_dict(&snap.allocator_settings);
        self.key(Fixed::ExternalAnnotations);
        self.buf.push(op::EMPTY_LIST);
        for chunk in snap.step_marks.chunks(BATCH) {
            self.buf.push(op::MARK);
            for m in chunk {
                self.step_mark(m);
            }
            self.buf.push(op::APPENDS);
            self.maybe_flush()?;
        }
        let mut items = 4;
        if !snap.memsnap.is_empty() {
            self.key(Fixed::Memsnap);
            self.meta_dict(&snap.memsnap);
            items += 1;
        }
        debug_assert!(items <= BATCH);
        self.buf.push(op::SETITEMS);
        self.buf.push(op::STOP);
        Ok(())
    }

    fn segment(&mut self, seg: &'a super::model::Segment) {
        self.buf.push(op::EMPTY_DICT);
        self.buf.push(op::MARK);
        self.key(Fixed::Device);
        self.int(seg.device);
        self.key(Fixed::Address);
        self.int(seg.address);
        self.key(Fixed::TotalSize);
        self.int(seg.total_size);
        self.key(Fixed::AllocatedSize);
        self.int(seg.allocated_size());
        self.key(Fixed::ActiveSize);
        self.int(seg.active_size());
        self.key(Fixed::RequestedSize);
        self.int(seg.requested_size());
        self.key(Fixed::Stream);
        self.int(seg.stream);
        self.key(Fixed::SegmentType);
        self.string(&seg.segment_type);
        self.key(Fixed::SegmentPoolId);
        self.int(seg.segment_pool_id.0);
        self.int(seg.segment_pool_id.1);
        self.buf.push(op::TUPLE2);
        self.key(Fixed::IsExpandable);
        self.bool(seg.is_expandable);
        self.key(Fixed::Frames);
        self.stack(seg.stack);
        self.key(Fixed::Blocks);
        self.buf.push(op::EMPTY_LIST);
        for chunk in seg.blocks.chunks(BATCH) {
            self.buf.push(op::MARK);
            for b in chunk {
                self.buf.push(op::EMPTY_DICT);
                self.buf.push(op::MARK);
                self.key(Fixed::Address);
                self.int(b.address);
                self.key(Fixed::Size);
                self.int(b.size);
                self.key(Fixed::RequestedSize);
                self.int(b.requested_size);
                self.key(Fixed::State);
                self.key(fixed_state(b.state));
                self.key(Fixed::Frames);
                self.stack(b.stack);
                self.buf.push(op::SETITEMS);
            }
            self.buf.push(op::APPENDS);
        }
        self.buf.push(op::SETITEMS);
    }

    fn trace_entry(&mut self, ev: &'a super::model::TraceEntry) {
        self.buf.push(op::EMPTY_DICT);
        self.buf.push(op::MARK);
        self.key(Fixed::Action);
        match fixed_action(&ev.action) {
            Some(k) => self.key(k),
            None => self.string(ev.action.as_str()),
        }
        self.key(Fixed::Addr);
        self.int(ev.addr);
        self.key(Fixed::Size);
        self.int(ev.size);
        self.key(Fixed::Stream);
        self.int(ev.stream);
        self.key(Fixed::TimeUs);
        self.int(ev.time_us);
        self.key(Fixed::Frames);
        self.stack(ev.stack);
        if let Some(free) = ev.device_free {
            self.key(Fixed::DeviceFree);
            self.int(free);
        }
        if let Some(meta) = &ev.user_metadata {
            self.key(Fixed::UserMetadata);
            self.string(meta);
        }
        self.key(Fixed::CompileContext);
        self.key(Fixed::NotAvailable);
        self.buf.push(op::SETITEMS);
    }

    /// A stack as a frame list: written once, then shared through the memo. `None` and
    /// unknown ids are a fresh `[]`.
    fn stack(&mut self, stack: Option<StackId>) {
        let Some(id) = stack else {
            self.buf.push(op::EMPTY_LIST);
            return;
        };
        let snap = self.snap;
        let Some(frames) = snap.stacks.get(id as usize) else {
            self.buf.push(op::EMPTY_LIST);
            return;
        };
        let slot = self.stack_slots[id as usize];
        if slot != NOT_WRITTEN {
            self.get(slot);
            return;
        }
        self.buf.push(op::EMPTY_LIST);
        self.stack_slots[id as usize] = self.put();
        // Frame ids outside `frames` are skipped, as `Snapshot::stack_frames` does.
        let valid: Vec<u32> = frames
            .iter()
            .copied()
            .filter(|&f| (f as usize) < snap.frames.len())
            .collect();
        for chunk in valid.chunks(BATCH) {
            self.buf.push(op::MARK);
            for &f in chunk {
                self.frame(f);
            }
            self.buf.push(op::APPENDS);
        }
    }

    fn frame(&mut self, id: u32) {
        let slot = self.frame_slots[id as usize];
        if slot != NOT_WRITTEN {
            self.get(slot);
            return;
        }
        let frame = &self.snap.frames[id as usize];
        self.buf.push(op::EMPTY_DICT);
        self.frame_slots[id as usize] = self.put();
        self.buf.push(op::MARK);
        self.key(Fixed::Name);
        self.string(&frame.name);
        self.key(Fixed::Filename);
        self.string(&frame.filename);
        self.key(Fixed::Line);
        self.int(frame.line);
        self.buf.push(op::SETITEMS);
    }

    /// `{"name": "memsnap.step", "stage": "START", "step": N, "device": d, "time_us": t}`.
    fn step_mark(&mut self, m: &super::model::StepMark) {
        self.buf.push(op::EMPTY_DICT);
        self.buf.push(op::MARK);
        self.key(Fixed::Name);
        self.string(super::model::STEP_MARK_NAME);
        self.string("stage");
        self.string("START");
        self.string("step");
        self.int(m.step);
        self.key(Fixed::Device);
        self.int(m.device);
        self.key(Fixed::TimeUs);
        self.int(m.time_us);
        self.buf.push(op::SETITEMS);
    }

    fn meta_dict(&mut self, items: &'a [(String, Meta)]) {
        self.buf.push(op::EMPTY_DICT);
        for chunk in items.chunks(BATCH) {
            self.buf.push(op::MARK);
            for (k, v) in chunk {
                self.string(k);
                self.meta(v);
            }
            self.buf.push(op::SETITEMS);
        }
    }

    fn meta(&mut self, value: &'a Meta) {
        match value {
            Meta::Bool(b) => self.bool(*b),
            Meta::Int(i) => self.int(*i),
            Meta::Float(f) => {
                self.buf.push(op::BINFLOAT);
                self.buf.extend_from_slice(&f.to_be_bytes());
            }
            Meta::Str(s) => self.string(s),
            Meta::List(items) => {
                self.buf.push(op::EMPTY_LIST);
                for chunk in items.chunks(BATCH) {
                    self.buf.push(op::MARK);
                    for item in chunk {
                        self.meta(item);
                    }
                    self.buf.push(op::APPENDS);
                }
            }
            Meta::Dict(items) => self.meta_dict(items),
        }
    }

    /// A [`FIXED`] string (dict key or well-known value), memoized in its reserved slot.
    #[inline]
    fn key(&mut self, k: Fixed) {
        let slot = k as usize;
        if self.fixed_written[slot] {
            self.get(slot as u32);
            return;
        }
        self.fixed_written[slot] = true;
        self.raw_string(FIXED[slot]);
        self.put_at(slot as u32);
    }

    /// Every string is memoized: keys, actions and states are written once each, frame
    /// file names once per file.
    fn string(&mut self, s: &'a str) {
        if let Some(&slot) = self.strings.get(s) {
            self.get(slot);
            return;
        }
        self.raw_string(s);
        let slot = self.memo_len;
        self.memo_len += 1;
        self.put_at(slot);
        self.strings.insert(s, slot);
    }

    /// The string opcode alone, without memo.
    fn raw_string(&mut self, s: &str) {
        let bytes = s.as_bytes();
        if bytes.len() < 256 {
            self.buf.push(op::SHORT_BINUNICODE);
            self.buf.push(bytes.len() as u8);
        } else {
            // A str over 4 GiB would need BINUNICODE8, which the viewer lacks; model
            // strings are names and paths, far below that.
            self.buf.push(op::BINUNICODE);
            self.buf
                .extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        }
        self.buf.extend_from_slice(bytes);
    }

    #[inline]
    fn int(&mut self, v: i64) {
        if (0..256).contains(&v) {
            self.buf.extend_from_slice(&[op::BININT1, v as u8]);
        } else if (0..65536).contains(&v) {
            self.buf.push(op::BININT2);
            self.buf.extend_from_slice(&(v as u16).to_le_bytes());
        } else if (i32::MIN as i64..=i32::MAX as i64).contains(&v) {
            self.buf.push(op::BININT);
            self.buf.extend_from_slice(&(v as i32).to_le_bytes());
        } else {
            // Exactly 8 bytes of little-endian two's complement: a JS Number, never a
            // BigInt (docs/FORMAT.md#integers).
            self.buf.extend_from_slice(&[op::LONG1, 8]);
            self.buf.extend_from_slice(&v.to_le_bytes());
        }
    }

    #[inline]
    fn bool(&mut self, b: bool) {
        self.buf.push(if b { op::NEWTRUE } else { op::NEWFALSE });
    }

    /// Stores the top of the stack in the next memo slot and returns the slot.
    #[inline]
    fn put(&mut self) -> u32 {
        let slot = self.memo_len;
        self.memo_len += 1;
        self.put_at(slot);
        slot
    }

    #[inline]
    fn put_at(&mut self, slot: u32) {
        if slot < 256 {
            self.buf.extend_from_slice(&[op::BINPUT, slot as u8]);
        } else {
            self.buf.push(op::LONG_BINPUT);
            self.buf.extend_from_slice(&slot.to_le_bytes());
        }
    }

    #[inline]
    fn get(&mut self, slot: u32) {
        if slot < 256 {
            self.buf.extend_from_slice(&[op::BINGET, slot as u8]);
        } else {
            self.buf.push(op::LONG_BINGET);
            self.buf.extend_from_slice(&slot.to_le_bytes());
        }
    }
}

#[cfg(test)]
// Tests fill a default snapshot field by field, which reads better than one big literal.
#[allow(clippy::field_reassign_with_default)]
pub(crate) mod tests {
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

    fn ev(
        action: Action,
        addr: i64,
        size: i64,
        time_us: i64,
        stack: Option<StackId>,
    ) -> TraceEntry {
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
}

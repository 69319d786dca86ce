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

use super::model::{KNOWN_ACTIONS, Meta, Snapshot, StackId};

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

/// Strings every snapshot repeats (keys, states; the actions' names follow them, see
/// [`FIXED_SLOTS`]). Each gets the memo slot equal to its index, reserved up front, so every later use is a 2-byte BINGET even when
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
}

/// Indexed by `Fixed as usize`.
const FIXED: [&str; 32] = [
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
];

/// Memo slots reserved up front: the [`FIXED`] strings, then the known actions' names
/// (`model::KNOWN_ACTIONS`, in its order).
const FIXED_SLOTS: usize = FIXED.len() + KNOWN_ACTIONS.len();

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
    fixed_written: [bool; FIXED_SLOTS],
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
            memo_len: FIXED_SLOTS as u32,
            fixed_written: [false; FIXED_SLOTS],
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
        match ev.action.known_index() {
            Some(i) => self.fixed_slot(FIXED.len() + i, KNOWN_ACTIONS[i].1),
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
        self.fixed_slot(k as usize, FIXED[k as usize]);
    }

    /// A string with a reserved memo slot ([`FIXED_SLOTS`]), written at its first use.
    #[inline]
    fn fixed_slot(&mut self, slot: usize, text: &'static str) {
        if self.fixed_written[slot] {
            self.get(slot as u32);
            return;
        }
        self.fixed_written[slot] = true;
        self.raw_string(text);
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
pub(crate) mod tests;

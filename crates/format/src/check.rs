//! Snapshot validity checker: the consistency rules of docs/FORMAT.md (sections "Segments",
//! "Blocks" and "Forward history rule") applied to a [`Snapshot`].
//!
//! Cold, no unsafe. [`check`] returns every rule broken, as [`Violation`]s; an empty list
//! means the viewer's "Allocator State History" can step through every event and the
//! timelines match the snapshot.
//!
//! What it checks, on what the reader recorded of the file ([`check_encoding`]):
//! - the pickle protocol is 2, 3 or 4, only the viewer's opcodes are used, MARK…APPENDS
//!   and MARK…SETITEMS batches hold at most 1000 items (docs/FORMAT.md, "Producer's
//!   rules", rule 3), no LONG1 is longer than 8 bytes (rule 4);
//! - every frame is `{"name": str, "filename": str, "line": int}` and every `frames` value
//!   a list (rule 11);
//!
//! and on the model ([`check`]):
//! - every segment's device has a `device_traces` list (docs/FORMAT.md, "Producer's rules",
//!   rule 2), stack and frame ids exist;
//! - sizes are non-negative, addresses, sizes and times below 2^53 (Producer's rules, rule 4);
//! - blocks tile their segment: in address order from the segment address, sizes summing
//!   to `total_size` (docs/FORMAT.md#segments); `requested_size ≤ size`; a device's segments
//!   do not overlap;
//! - per device, the trace is a valid forward history under the state machine of
//!   docs/FORMAT.md#forward-history-rule whose end state equals `segments`.
//!
//! # Capped histories: the rule
//!
//! A ring buffer drops the oldest events, so a history may start mid-way. The forward
//! replay therefore does not start from the empty state but from the state **S0 obtained by
//! undoing every event, last to first, starting from the snapshot** (what the viewer's
//! backward walk does, docs/FORMAT.md#backward-walk). A device's history is accepted iff
//! 1. S0 is a valid state: disjoint segments, disjoint live blocks, every live block inside
//!    one segment (else [`ViolationKind::InitialState`], reported at event 0);
//! 2. replaying the events forward from S0 obeys the forward history rule at every step;
//! 3. the state after the last event equals `segments`: the same segments (address, size,
//!    expandable or not) and the same live blocks (address, requested size, pending free
//!    or not) ([`ViolationKind::FinalStateMismatch`]).
//!
//! A complete history gives S0 = empty; any suffix of a valid history gives the state at
//! the cut and is accepted too, as the viewer accepts it (docs/FORMAT.md#capped-history).
//! Segments or blocks that exist from the start are accepted as pre-existing: a history
//! cannot tell a dropped prefix from a recorder that started late.
//!
//! The undo step of each event is the exact inverse of its forward step, so S0 is unique:
//! if any valid start state leads through a legal forward replay to the snapshot, S0 is
//! that state and [`check`] reports nothing; otherwise it reports at least one violation.
//! Where an undo is impossible (an `alloc` whose block is not live afterwards, ...) it is
//! skipped and the forward replay reports the discrepancy.
//!
//! Consequences worth knowing: a free, `segment_free` or `segment_unmap` of something the
//! kept history never created is accepted (a dropped prefix may have created it), so
//! [`ViolationKind::FreeUnknownBlock`] means a block freed twice within the history. The
//! kind and event of a violation are diagnostics: a broken history is always rejected,
//! but the rule may blame a neighbouring event (e.g. a double `segment_unmap` shows up as
//! the earlier `segment_map` overlapping a range that S0 had to contain).
//! `tests/python/check_snapshot.py` implements the same rule independently.

use std::collections::BTreeMap;
use std::fmt;

use super::model::{Action, BlockState, Snapshot, StackId, TraceEntry};
use super::pickle_read::Encoding;

/// Integers above this lose precision in the viewer's JS numbers (docs/FORMAT.md#integers).
const JS_SAFE: i64 = 1 << 53;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ViolationKind {
    /// A segment's device has no list in `device_traces`.
    MissingDeviceTrace,
    /// A stack id or a frame id that does not exist.
    BadStack,
    /// A negative size, or an address, size or time at or above 2^53.
    ValueRange,
    /// Blocks do not tile their segment (address order from the segment start, sizes
    /// summing to `total_size`).
    BlockTiling,
    /// A block's `requested_size` is negative or above its `size`.
    RequestedSize,
    /// Two segments of one device overlap in `segments`.
    SegmentOverlap,
    /// The state reconstructed before the first event is not valid.
    InitialState,
    /// `segment_alloc` over a live segment.
    SegmentAllocOverlap,
    /// `segment_free` of a range that is not a live (non-expandable) segment.
    SegmentFreeUnknown,
    /// `segment_free` or `segment_unmap` of a range that still holds live blocks.
    SegmentNotEmpty,
    /// `segment_map` over a live segment.
    SegmentMapOverlap,
    /// `segment_unmap` of a range that is not inside one mapped range.
    SegmentUnmapUnmapped,
    /// `alloc` outside every live segment.
    AllocOutsideSegment,
    /// `alloc` over a live block.
    AllocOverlap,
    /// A free at an address where no live block starts.
    FreeUnknownBlock,
    /// A free whose size differs from the allocation's.
    FreeSizeMismatch,
    /// `free_completed` of a block that was not `free_requested`.
    FreeNotRequested,
    /// `free_requested` of a block already pending free.
    FreeRequestedTwice,
    /// An action the forward history state machine does not know.
    UnknownAction,
    /// An `oom` event without `device_free` (the viewer and `_memory_viz trace` need it).
    OomWithoutDeviceFree,
    /// The state after the last event differs from `segments`.
    FinalStateMismatch,
    /// The PROTO header is not 2, 3 or 4 (Producer's rules, rule 3).
    Protocol,
    /// An opcode the viewer's unpickler does not handle (rule 3).
    Opcode,
    /// A MARK…APPENDS or MARK…SETITEMS batch of more than 1000 items (rule 3).
    BatchSize,
    /// A LONG1 integer of more than 8 bytes (rule 4).
    LongInt,
    /// A frame that is not `{"name": str, "filename": str, "line": int}`, or a `frames`
    /// value that is not a list (rule 11).
    BadFrame,
}

/// The opcodes the viewer's unpickler handles (docs/FORMAT.md, "Opcodes the viewer
/// accepts"), with their names.
const VIEWER_OPCODES: &[(u8, &str)] = &[
    (0x80, "PROTO"),
    (b'.', "STOP"),
    (b'(', "MARK"),
    (b'}', "EMPTY_DICT"),
    (b']', "EMPTY_LIST"),
    (b')', "EMPTY_TUPLE"),
    (b's', "SETITEM"),
    (b'u', "SETITEMS"),
    (b'd', "DICT"),
    (b'a', "APPEND"),
    (b'e', "APPENDS"),
    (b'l', "LIST"),
    (b't', "TUPLE"),
    (0x85, "TUPLE1"),
    (0x86, "TUPLE2"),
    (0x87, "TUPLE3"),
    (b'N', "NONE"),
    (0x88, "NEWTRUE"),
    (0x89, "NEWFALSE"),
    (b'K', "BININT1"),
    (b'M', "BININT2"),
    (b'J', "BININT"),
    (0x8a, "LONG1"),
    (b'G', "BINFLOAT"),
    (0x8c, "SHORT_BINUNICODE"),
    (b'X', "BINUNICODE"),
    (b'q', "BINPUT"),
    (b'r', "LONG_BINPUT"),
    (0x94, "MEMOIZE"),
    (b'h', "BINGET"),
    (b'j', "LONG_BINGET"),
    (0x95, "FRAME"),
];

/// Names of the plain-data opcodes the reader takes but the viewer does not.
fn opcode_name(op: u8) -> &'static str {
    match op {
        b'0' => "POP",
        b'1' => "POP_MARK",
        b'2' => "DUP",
        b'I' => "INT",
        b'L' => "LONG",
        b'F' => "FLOAT",
        0x8b => "LONG4",
        0x8d => "BINUNICODE8",
        b'C' | b'U' => "SHORT_BINBYTES/SHORT_BINSTRING",
        b'B' | b'T' => "BINBYTES/BINSTRING",
        0x8e => "BINBYTES8",
        0x96 => "BYTEARRAY8",
        b'p' => "PUT",
        b'g' => "GET",
        _ => "unknown",
    }
}

/// Checks what the reader saw of the file itself that the model does not keep
/// ([`Encoding`]): protocol 2–4, only the viewer's opcodes, batches of at most 1000
/// (Producer's rules, rule 3), no LONG1 over 8 bytes (rule 4), well-formed frames (rule 11).
pub fn check_encoding(enc: &Encoding) -> Vec<Violation> {
    let mut out = Sink {
        found: Checked::default(),
        keep: usize::MAX,
    };
    if !(2..=4).contains(&enc.protocol) {
        let msg = format!(
            "pickle protocol {}: the viewer reads protocols 2 to 4 only (write with protocol=4)",
            enc.protocol
        );
        push(&mut out, None, None, ViolationKind::Protocol, msg);
    }
    let foreign: Vec<String> = (0..=255u8)
        .filter(|&op| enc.uses(op) && !VIEWER_OPCODES.iter().any(|&(v, _)| v == op))
        .map(|op| format!("{} (0x{op:02x})", opcode_name(op)))
        .collect();
    if !foreign.is_empty() {
        let msg = format!("opcodes the viewer does not handle: {}", foreign.join(", "));
        push(&mut out, None, None, ViolationKind::Opcode, msg);
    }
    if enc.uses(0x94) && (enc.uses(b'q') || enc.uses(b'r')) {
        let msg = "MEMOIZE mixed with BINPUT/LONG_BINPUT: the viewer numbers MEMOIZE slots                    by its own counter, so its memo indices disagree"
            .to_string();
        push(&mut out, None, None, ViolationKind::Opcode, msg);
    }
    if enc.large_batches > 0 {
        let msg = format!(
            "{} APPENDS/SETITEMS batch(es) of more than 1000 items (the largest {}): the \
             viewer's stack overflows from about 125,000",
            enc.large_batches, enc.largest_batch
        );
        push(&mut out, None, None, ViolationKind::BatchSize, msg);
    }
    if enc.long_ints > 0 {
        let msg = format!(
            "{} LONG1 integer(s) of more than 8 bytes: the viewer decodes them as BigInt",
            enc.long_ints
        );
        push(&mut out, None, None, ViolationKind::LongInt, msg);
    }
    if enc.bad_frames > 0 {
        let msg = format!(
            "{} frame(s) not {{\"name\": str, \"filename\": str, \"line\": int}} in a list, the first {}",
            enc.bad_frames,
            enc.first_bad_frame.as_deref().unwrap_or("?")
        );
        push(&mut out, None, None, ViolationKind::BadFrame, msg);
    }
    out.found.kept
}

/// One broken rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// Device ordinal, when the rule is about one device.
    pub device: Option<i64>,
    /// Index into that device's trace, when the rule is about one event.
    pub event: Option<usize>,
    pub kind: ViolationKind,
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.device, self.event) {
            (Some(d), Some(e)) => write!(f, "device {d}, event {e}: ")?,
            (Some(d), None) => write!(f, "device {d}: ")?,
            _ => {}
        }
        write!(f, "{}", self.message)
    }
}

/// Checks `snap` against every rule above; an empty result means valid.
pub fn check(snap: &Snapshot) -> Vec<Violation> {
    check_keeping(snap, usize::MAX).kept
}

/// What [`check_keeping`] found: the first violations, and how many there are in all.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Checked {
    pub kept: Vec<Violation>,
    pub total: usize,
}

/// [`check`], keeping only the first `keep` violations and counting the rest. A file can
/// break a rule at every event (one history shared by several devices through the memo):
/// a message for each would take gigabytes for a file of 80 MB, and a report shows the
/// first few.
pub fn check_keeping(snap: &Snapshot, keep: usize) -> Checked {
    let mut out = Sink {
        found: Checked::default(),
        keep,
    };
    check_stacks(snap, &mut out);
    check_segments(snap, &mut out);
    for (device, trace) in snap.device_traces.iter().enumerate() {
        check_history(snap, device as i64, trace, &mut out);
    }
    out.found
}

/// Where the checks put what they find: the first `keep` violations, a count of all.
struct Sink {
    found: Checked,
    keep: usize,
}

fn push(
    out: &mut Sink,
    device: Option<i64>,
    event: Option<usize>,
    kind: ViolationKind,
    message: String,
) {
    out.found.total += 1;
    if out.found.kept.len() < out.keep {
        out.found.kept.push(Violation {
            device,
            event,
            kind,
            message,
        });
    }
}

fn check_stacks(snap: &Snapshot, out: &mut Sink) {
    for (i, stack) in snap.stacks.iter().enumerate() {
        if let Some(&bad) = stack.iter().find(|&&f| f as usize >= snap.frames.len()) {
            let msg = format!(
                "stack {i} refers to frame {bad}, but there are {} frames",
                snap.frames.len()
            );
            push(out, None, None, ViolationKind::BadStack, msg);
        }
    }
    let mut check_id = |what: &dyn Fn() -> String, id: Option<StackId>, device, event| {
        if let Some(id) = id
            && id as usize >= snap.stacks.len()
        {
            let msg = format!(
                "{} uses stack {id}, but there are {} stacks",
                what(),
                snap.stacks.len()
            );
            push(out, device, event, ViolationKind::BadStack, msg);
        }
    };
    for s in &snap.segments {
        check_id(
            &|| format!("segment {:#x}", s.address),
            s.stack,
            Some(s.device),
            None,
        );
        for b in &s.blocks {
            check_id(
                &|| format!("block {:#x}", b.address),
                b.stack,
                Some(s.device),
                None,
            );
        }
    }
    for (d, trace) in snap.device_traces.iter().enumerate() {
        for (i, e) in trace.iter().enumerate() {
            check_id(
                &|| e.action.as_str().to_string(),
                e.stack,
                Some(d as i64),
                Some(i),
            );
        }
    }
}

fn js_safe(v: i64) -> bool {
    v > -JS_SAFE && v < JS_SAFE
}

fn check_segments(snap: &Snapshot, out: &mut Sink) {
    let mut by_device: BTreeMap<i64, Vec<(i64, i64)>> = BTreeMap::new();
    for s in &snap.segments {
        let dev = Some(s.device);
        let here = format!("segment {:#x}", s.address);
        if s.device < 0 || s.device as usize >= snap.device_traces.len() {
            let msg = format!(
                "{here}: device {} has no list in device_traces ({} lists)",
                s.device,
                snap.device_traces.len()
            );
            push(out, dev, None, ViolationKind::MissingDeviceTrace, msg);
        }
        if s.total_size <= 0 || !js_safe(s.total_size) || !js_safe(s.address) || s.address < 0 {
            let msg = format!(
                "{here}: address or total_size {} out of range",
                s.total_size
            );
            push(out, dev, None, ViolationKind::ValueRange, msg);
        }
        let mut running = s.address;
        for b in &s.blocks {
            if b.address != running {
                let msg = format!(
                    "{here}: block at {:#x} where the tiling puts {running:#x}",
                    b.address
                );
                push(out, dev, None, ViolationKind::BlockTiling, msg);
            }
            if b.size < 0 || !js_safe(b.size) {
                let msg = format!("{here}: block {:#x} has size {}", b.address, b.size);
                push(out, dev, None, ViolationKind::ValueRange, msg);
            }
            if b.requested_size < 0 || b.requested_size > b.size {
                let msg = format!(
                    "{here}: block {:#x} has requested_size {} for size {}",
                    b.address, b.requested_size, b.size
                );
                push(out, dev, None, ViolationKind::RequestedSize, msg);
            }
            running = running.saturating_add(b.size);
        }
        let sum = running.saturating_sub(s.address);
        if sum != s.total_size {
            let msg = format!(
                "{here}: block sizes sum to {sum}, total_size is {}",
                s.total_size
            );
            push(out, dev, None, ViolationKind::BlockTiling, msg);
        }
        by_device
            .entry(s.device)
            .or_default()
            .push((s.address, s.total_size));
    }
    for (dev, mut segs) in by_device {
        segs.sort_unstable();
        for w in segs.windows(2) {
            if w[0].0.saturating_add(w[0].1) > w[1].0 {
                let msg = format!("segments {:#x} and {:#x} overlap", w[0].0, w[1].0);
                push(out, Some(dev), None, ViolationKind::SegmentOverlap, msg);
            }
        }
    }
}

/// A live segment, or one mapped range of an expandable segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Seg {
    size: i64,
    /// Created by `segment_map` (expandable); merges with adjacent mapped ranges.
    mapped: bool,
    stream: i64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Blk {
    /// The allocation's requested size (what `alloc` and the frees carry).
    size: i64,
    pending_free: bool,
}

fn end(a: i64, n: i64) -> i64 {
    a.saturating_add(n.max(1))
}

#[derive(Clone, Debug, Default, PartialEq)]
struct State {
    segs: BTreeMap<i64, Seg>,
    blocks: BTreeMap<i64, Blk>,
}

impl State {
    /// The snapshot's segments and live blocks of `device`.
    fn from_snapshot(snap: &Snapshot, device: i64) -> Self {
        let mut st = State::default();
        for s in snap.segments.iter().filter(|s| s.device == device) {
            let seg = Seg {
                size: s.total_size,
                mapped: s.is_expandable,
                stream: s.stream,
            };
            st.segs.insert(s.address, seg);
            // Block addresses as the viewer computes them: by tiling.
            let mut addr = s.address;
            for b in &s.blocks {
                if b.state.is_active() {
                    let pending_free = b.state == BlockState::ActivePendingFree;
                    st.blocks.insert(
                        addr,
                        Blk {
                            size: b.requested_size,
                            pending_free,
                        },
                    );
                }
                addr = addr.saturating_add(b.size);
            }
        }
        st
    }

    /// Start of the segment that holds `[a, a+n)` entirely.
    fn seg_containing(&self, a: i64, n: i64) -> Option<i64> {
        let (&sa, seg) = self.segs.range(..=a).next_back()?;
        (end(a, n) <= end(sa, seg.size)).then_some(sa)
    }

    fn seg_overlaps(&self, a: i64, n: i64) -> bool {
        let below = self
            .segs
            .range(..=a)
            .next_back()
            .is_some_and(|(&sa, s)| end(sa, s.size) > a);
        below || self.segs.range(a..end(a, n)).next().is_some()
    }

    fn block_overlaps(&self, a: i64, n: i64) -> bool {
        let below = self
            .blocks
            .range(..=a)
            .next_back()
            .is_some_and(|(&ba, b)| end(ba, b.size) > a);
        below || self.blocks.range(a..end(a, n)).next().is_some()
    }

    /// Adds a mapped range, merging it with adjacent mapped ranges on the same stream.
    fn map_range(&mut self, a: i64, n: i64, stream: i64) {
        let (mut start, mut stop) = (a, a.saturating_add(n));
        if let Some((&sa, s)) = self.segs.range(..start).next_back()
            && s.mapped
            && s.stream == stream
            && sa.saturating_add(s.size) == start
        {
            self.segs.remove(&sa);
            start = sa;
        }
        if let Some(s) = self.segs.get(&stop).copied()
            && s.mapped
            && s.stream == stream
        {
            self.segs.remove(&stop);
            stop = stop.saturating_add(s.size);
        }
        self.segs.insert(
            start,
            Seg {
                size: stop - start,
                mapped: true,
                stream,
            },
        );
    }

    /// Removes `[a, a+n)` from the segment that contains it, splitting it if needed.
    fn carve(&mut self, a: i64, n: i64) -> bool {
        let Some(sa) = self.seg_containing(a, n) else {
            return false;
        };
        let seg = self.segs.remove(&sa).expect("found above");
        if a > sa {
            self.segs.insert(
                sa,
                Seg {
                    size: a - sa,
                    ..seg
                },
            );
        }
        let (cut_end, seg_end) = (a.saturating_add(n), sa.saturating_add(seg.size));
        if cut_end < seg_end {
            self.segs.insert(
                cut_end,
                Seg {
                    size: seg_end - cut_end,
                    ..seg
                },
            );
        }
        true
    }

    /// The inverse of `e`'s forward step, best effort (see the module docs).
    fn undo(&mut self, e: &TraceEntry) {
        let (a, n) = (e.addr, e.size);
        match e.action {
            Action::SegmentAlloc => {
                self.segs.remove(&a);
            }
            Action::SegmentFree => {
                self.segs.insert(
                    a,
                    Seg {
                        size: n,
                        mapped: false,
                        stream: e.stream,
                    },
                );
            }
            Action::SegmentMap => {
                self.carve(a, n);
            }
            Action::SegmentUnmap => self.map_range(a, n, e.stream),
            Action::Alloc => {
                self.blocks.remove(&a);
            }
            Action::FreeRequested => {
                if let Some(b) = self.blocks.get_mut(&a) {
                    b.pending_free = false;
                }
            }
            Action::FreeCompleted => {
                self.blocks.insert(
                    a,
                    Blk {
                        size: n,
                        pending_free: true,
                    },
                );
            }
            Action::Free => {
                self.blocks.insert(
                    a,
                    Blk {
                        size: n,
                        pending_free: false,
                    },
                );
            }
            Action::Snapshot | Action::Oom | Action::Other(_) => {}
        }
    }

    /// Problems of a state that must be valid by itself (S0).
    fn problems(&self) -> Vec<String> {
        let mut found = Vec::new();
        let segs: Vec<_> = self.segs.iter().collect();
        for w in segs.windows(2) {
            if end(*w[0].0, w[0].1.size) > *w[1].0 {
                found.push(format!("segments {:#x} and {:#x} overlap", w[0].0, w[1].0));
            }
        }
        let blocks: Vec<_> = self.blocks.iter().collect();
        for w in blocks.windows(2) {
            if end(*w[0].0, w[0].1.size) > *w[1].0 {
                found.push(format!(
                    "live blocks {:#x} and {:#x} overlap",
                    w[0].0, w[1].0
                ));
            }
        }
        for (&a, b) in &self.blocks {
            if self.seg_containing(a, b.size).is_none() {
                found.push(format!(
                    "live block [{a:#x}, +{}) lies in no segment",
                    b.size
                ));
            }
        }
        found
    }

    /// Applies `e` forward; returns the rules it breaks (docs/FORMAT.md#forward-history-rule).
    fn apply(&mut self, e: &TraceEntry) -> Vec<(ViolationKind, String)> {
        use ViolationKind as K;
        let (a, n) = (e.addr, e.size);
        let mut found = Vec::new();
        match &e.action {
            Action::SegmentAlloc => {
                if self.seg_overlaps(a, n) {
                    found.push((
                        K::SegmentAllocOverlap,
                        format!("segment_alloc [{a:#x}, +{n}) overlaps a live segment"),
                    ));
                }
                self.segs.insert(
                    a,
                    Seg {
                        size: n,
                        mapped: false,
                        stream: e.stream,
                    },
                );
            }
            Action::SegmentFree => {
                match self.segs.get(&a) {
                    Some(s) if s.size == n && !s.mapped => {}
                    Some(s) if s.mapped => found.push((
                        K::SegmentFreeUnknown,
                        format!("segment_free of mapped (expandable) range {a:#x}"),
                    )),
                    _ => found.push((
                        K::SegmentFreeUnknown,
                        format!("segment_free [{a:#x}, +{n}): no such live segment"),
                    )),
                }
                if self.block_overlaps(a, n) {
                    found.push((
                        K::SegmentNotEmpty,
                        format!("segment_free [{a:#x}, +{n}) while it holds live blocks"),
                    ));
                }
                self.segs.remove(&a);
            }
            Action::SegmentMap => {
                if self.seg_overlaps(a, n) {
                    found.push((
                        K::SegmentMapOverlap,
                        format!("segment_map [{a:#x}, +{n}) overlaps a live segment"),
                    ));
                }
                self.map_range(a, n, e.stream);
            }
            Action::SegmentUnmap => {
                let inside = self.seg_containing(a, n).filter(|sa| self.segs[sa].mapped);
                if inside.is_none() {
                    found.push((
                        K::SegmentUnmapUnmapped,
                        format!("segment_unmap [{a:#x}, +{n}) is not inside one mapped range"),
                    ));
                }
                if self.block_overlaps(a, n) {
                    found.push((
                        K::SegmentNotEmpty,
                        format!("segment_unmap [{a:#x}, +{n}) while it holds live blocks"),
                    ));
                }
                if inside.is_some() {
                    self.carve(a, n);
                }
            }
            Action::Alloc => {
                if self.seg_containing(a, n).is_none() {
                    found.push((
                        K::AllocOutsideSegment,
                        format!("alloc [{a:#x}, +{n}) lies in no live segment"),
                    ));
                }
                if self.block_overlaps(a, n) {
                    found.push((
                        K::AllocOverlap,
                        format!("alloc [{a:#x}, +{n}) overlaps a live block"),
                    ));
                }
                self.blocks.insert(
                    a,
                    Blk {
                        size: n,
                        pending_free: false,
                    },
                );
            }
            Action::FreeRequested | Action::FreeCompleted | Action::Free => {
                let what = e.action.as_str();
                let Some(b) = self.blocks.get_mut(&a) else {
                    found.push((
                        K::FreeUnknownBlock,
                        format!("{what} at {a:#x}: no live block starts there"),
                    ));
                    return found;
                };
                if b.size != n {
                    found.push((
                        K::FreeSizeMismatch,
                        format!("{what} of {n} bytes at {a:#x}, allocated {}", b.size),
                    ));
                }
                match e.action {
                    Action::FreeRequested => {
                        if b.pending_free {
                            found.push((
                                K::FreeRequestedTwice,
                                format!("free_requested twice at {a:#x}"),
                            ));
                        }
                        b.pending_free = true;
                    }
                    Action::FreeCompleted => {
                        if !b.pending_free {
                            found.push((
                                K::FreeNotRequested,
                                format!("free_completed at {a:#x} without free_requested"),
                            ));
                        }
                        self.blocks.remove(&a);
                    }
                    _ => {
                        self.blocks.remove(&a);
                    }
                }
            }
            Action::Snapshot | Action::Oom => {}
            // Newest PyTorch's note on an allocation; no state change (docs/FORMAT.md#actions).
            Action::Other(s) if s == "annotate" => {}
            Action::Other(s) => found.push((
                K::UnknownAction,
                format!("unknown action \"{}\"", crate::text::escape_controls(s)),
            )),
        }
        found
    }
}

fn check_history(snap: &Snapshot, device: i64, trace: &[TraceEntry], out: &mut Sink) {
    use ViolationKind as K;
    let dev = Some(device);
    for (i, e) in trace.iter().enumerate() {
        if e.size < 0 || !js_safe(e.size) || !js_safe(e.addr) || !js_safe(e.time_us) {
            let msg = format!(
                "{}: addr {:#x}, size {} or time_us {} out of range",
                e.action.as_str(),
                e.addr,
                e.size,
                e.time_us
            );
            push(out, dev, Some(i), K::ValueRange, msg);
        }
        if e.action == Action::Oom && e.device_free.is_none() {
            push(
                out,
                dev,
                Some(i),
                K::OomWithoutDeviceFree,
                "oom without device_free".into(),
            );
        }
    }
    let last = State::from_snapshot(snap, device);
    let mut st = last.clone();
    for e in trace.iter().rev() {
        st.undo(e);
    }
    for p in st.problems() {
        push(
            out,
            dev,
            Some(0),
            K::InitialState,
            format!("state before the first kept event: {p}"),
        );
    }
    for (i, e) in trace.iter().enumerate() {
        for (kind, msg) in st.apply(e) {
            push(out, dev, Some(i), kind, msg);
        }
    }
    use Mismatch::{Differs, OnlyReplayed, OnlyStated};
    let segments = mismatches(&st.segs, &last.segs, |s, t| {
        s.size == t.size && s.mapped == t.mapped
    })
    .map(|(a, m)| match m {
        OnlyReplayed(s) => format!(
            "segment [{a:#x}, +{}) is live after the history but not in `segments`",
            s.size
        ),
        Differs(s, t) => format!(
            "segment {a:#x}: the history ends with size {} (mapped: {}), `segments` has {} (expandable: {})",
            s.size, s.mapped, t.size, t.mapped
        ),
        OnlyStated(t) => format!(
            "segment [{a:#x}, +{}) is in `segments` but not live after the history",
            t.size
        ),
    });
    let blocks = mismatches(&st.blocks, &last.blocks, Blk::eq).map(|(a, m)| match m {
        OnlyReplayed(b) => format!(
            "block [{a:#x}, +{}) is live after the history but not active in `segments`",
            b.size
        ),
        Differs(b, t) => format!(
            "block {a:#x}: the history ends with {} bytes (pending free: {}), `segments` has requested_size {} (pending free: {})",
            b.size, b.pending_free, t.size, t.pending_free
        ),
        OnlyStated(t) => format!(
            "active block [{a:#x}, +{}) in `segments` is not live after the history",
            t.size
        ),
    });
    for msg in segments.chain(blocks) {
        push(out, dev, None, K::FinalStateMismatch, msg);
    }
}

/// One address where the state the history ends in and the one `segments` states disagree.
enum Mismatch<'a, V> {
    /// Live after the history, absent from `segments`.
    OnlyReplayed(&'a V),
    /// At the same address on both sides (replayed, stated), but different.
    Differs(&'a V, &'a V),
    /// In `segments`, not live after the history.
    OnlyStated(&'a V),
}

/// The addresses where `replayed` (what is live after the history) and `stated` (what
/// `segments` says) disagree, `same` telling whether two entries at one address agree:
/// those of `replayed` first, then those only in `stated`, each in address order.
fn mismatches<'a, V>(
    replayed: &'a BTreeMap<i64, V>,
    stated: &'a BTreeMap<i64, V>,
    same: impl Fn(&V, &V) -> bool,
) -> impl Iterator<Item = (i64, Mismatch<'a, V>)> {
    let in_replayed = replayed
        .iter()
        .filter_map(move |(&a, r)| match stated.get(&a) {
            None => Some((a, Mismatch::OnlyReplayed(r))),
            Some(s) if !same(r, s) => Some((a, Mismatch::Differs(r, s))),
            Some(_) => None,
        });
    let only_stated = stated
        .iter()
        .filter(move |(a, _)| !replayed.contains_key(a))
        .map(|(&a, s)| (a, Mismatch::OnlyStated(s)));
    in_replayed.chain(only_stated)
}

#[cfg(test)]
mod tests;

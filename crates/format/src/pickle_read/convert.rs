//! Conversion of the parsed value to a [`Snapshot`]: segments and blocks, each device's
//! trace (entries the machine already converted are moved, not copied), the metadata
//! dicts, and the stacks as the model stores them.

use super::Budget;
use super::arena::{Node, Pickle, Val};
use super::entry::{event_from_dict, int_of};
use super::error::{ReadError, Result};
use super::intern::Interner;
use super::machine::Mode;
use crate::model::{Action, Block, BlockState, Meta, Segment, Snapshot, TraceEntry};

struct Converter<'p> {
    p: &'p Pickle,
    mode: Mode,
    /// Stream mode: each device's trace list (the number its entries were handed out with).
    trace_lists: Vec<u32>,
    interner: Interner,
    events: Vec<TraceEntry>,
    /// Where each converted entry went: (device, index), `u32::MAX` while not yet placed.
    event_home: Vec<(u32, u32)>,
    /// Entries moved whole by the in-order fast path: (first entry, count, device). They
    /// need no `event_home` (8 bytes an entry, at the time memory peaks).
    moved_runs: Vec<(usize, usize, u32)>,
    total_events: usize,
    cur_device: u32,
    cur_index: u32,
    /// Entries moved out by the in-order fast path (they left the front of `events`).
    consumed: usize,
    /// Bytes of metadata expanded so far (against [`Budget::METADATA_BYTES`]).
    metadata_spent: std::cell::Cell<usize>,
    /// The interner's count of model bytes, once it is handed over to the snapshot.
    model_bytes: usize,
    /// The interner's bad frames, likewise.
    bad_frames: (u64, Option<String>),
}

/// Stream mode: the number a device's entries were handed out with, once it is sure that
/// they are all of the list's items (each converted where it was appended to this list).
fn streamed_list(p: &Pickle, l: Val, d: usize) -> Result<u32> {
    let Val::Ref(id) = l else {
        return Err(shape(format!("device_traces[{d}]"), "not a list"));
    };
    match p.node(l) {
        Some(Node::EventRun { .. }) => Ok(id),
        Some(Node::List(items)) if items.iter().all(|v| matches!(v, Val::Event(_))) => Ok(id),
        Some(Node::List(_)) => Err(ReadError::NeedsFullRead {
            why: "a trace list holds items that were not trace entries when appended",
        }),
        _ => Err(shape(format!("device_traces[{d}]"), "not a list")),
    }
}

fn shape(path: impl Into<String>, msg: impl Into<String>) -> ReadError {
    ReadError::Shape {
        path: path.into(),
        msg: msg.into(),
    }
}

const META_DEPTH: usize = 32;

/// Converts the value `root` of a file the machine read in `mode` (with the `interner` and
/// the `events` it converted on the way) to a snapshot.
pub(super) fn to_snapshot(
    pickle: &Pickle,
    root: Val,
    mode: Mode,
    interner: Interner,
    events: Vec<TraceEntry>,
) -> Result<Converted> {
    let total_events = events.len();
    // Nothing is dropped from here on, so lists may be remembered by identity.
    let mut interner = interner;
    interner.collapse = None;
    let mut conv = Converter {
        p: pickle,
        mode,
        interner,
        events,
        total_events,
        event_home: Vec::new(),
        moved_runs: Vec::new(),
        cur_device: 0,
        cur_index: 0,
        consumed: 0,
        trace_lists: Vec::new(),
        metadata_spent: std::cell::Cell::new(0),
        model_bytes: 0,
        bad_frames: (0, None),
    };
    let snapshot = conv.snapshot(root)?;
    Ok(Converted {
        snapshot,
        trace_lists: conv.trace_lists,
        model_bytes: conv.model_bytes,
        bad_frames: conv.bad_frames,
    })
}

/// What [`to_snapshot`] makes.
pub(super) struct Converted {
    pub(super) snapshot: Snapshot,
    /// Stream mode: each device's trace list number (empty otherwise).
    pub(super) trace_lists: Vec<u32>,
    /// Bytes of model counted against [`Budget::model_limit`] (what the tests measure).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(super) model_bytes: usize,
    /// Frames that break rule 11: how many, and the first described.
    pub(super) bad_frames: (u64, Option<String>),
}

/// The `memsnap.step` entries of `external_annotations` (anything else there, and an
/// entry without an integer `step`, `device` and `time_us`, is skipped: no viewer relies on
/// the list, so it is never a reason to refuse a file).
fn step_marks(p: &Pickle, list: Val) -> Vec<crate::model::StepMark> {
    let Some(items) = p.items(list) else {
        return Vec::new();
    };
    let int = |d: Val, k: &str| int_of(p.get(d, k));
    items
        .iter()
        .filter(|&&d| p.get(d, "name").and_then(|n| p.str(n)) == Some(crate::model::STEP_MARK_NAME))
        .filter_map(|&d| {
            Some(crate::model::StepMark {
                step: int(d, "step")?,
                device: int(d, "device")?,
                time_us: int(d, "time_us")?,
            })
        })
        .collect()
}

impl Converter<'_> {
    /// Counts `bytes` of model against its budget ([`Budget::model_limit`]).
    fn spend_model(&mut self, bytes: usize, what: &'static str) -> Result<()> {
        self.interner.spend(bytes, what);
        self.over_budget()
    }

    /// The budget error once anything (frames interned on the way included) went over.
    fn over_budget(&self) -> Result<()> {
        match self.interner.exceeded() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn snapshot(&mut self, root: Val) -> Result<Snapshot> {
        let p = self.p;
        let mut snap = Snapshot::default();
        let segments_val;
        match p.node(root) {
            Some(Node::Dict(_)) => {
                segments_val = p.get(root, "segments");
                if p.get(root, "device_traces").is_none() {
                    return Err(shape(
                        "top level",
                        if segments_val.is_none() {
                            "a dict without `segments` or `device_traces`"
                        } else {
                            "a dict without `device_traces` (every PyTorch snapshot has it, \
                             an empty list when nothing was recorded)"
                        },
                    ));
                }
            }
            // Legacy form: the top level is the segment list (`torch.cuda.memory_snapshot()`).
            // An empty list says nothing about any memory: not a snapshot.
            Some(Node::List(items)) if !items.is_empty() => segments_val = Some(root),
            Some(Node::List(_)) => {
                return Err(shape(
                    "top level",
                    "an empty list (neither segments nor device traces)",
                ));
            }
            _ => {
                return Err(shape(
                    "top level",
                    "expected a dict with `segments` and `device_traces`",
                ));
            }
        }
        if let Some(sv) = segments_val {
            let list = p.items(sv).ok_or_else(|| shape("segments", "not a list"))?;
            for (i, &s) in list.iter().enumerate() {
                snap.segments.push(self.segment(s, i)?);
            }
            snap.segments.sort_by_key(|s| (s.device, s.address));
        }
        if matches!(p.node(root), Some(Node::Dict(_))) {
            if let Some(dt) = p.get(root, "device_traces") {
                let lists = p
                    .items(dt)
                    .ok_or_else(|| shape("device_traces", "not a list"))?;
                for (d, &l) in lists.iter().enumerate() {
                    // Every reference to a list is one more device holding all its entries
                    // (a history each when streaming), however the list is shared.
                    let len = match p.node(l) {
                        Some(Node::EventRun { len, .. }) => *len as usize,
                        Some(Node::List(x)) => x.len(),
                        _ => 0,
                    };
                    self.spend_model(
                        len.saturating_mul(std::mem::size_of::<TraceEntry>())
                            .saturating_add(std::mem::size_of::<Vec<TraceEntry>>()),
                        "trace entries",
                    )?;
                    if self.mode == Mode::Stream {
                        self.trace_lists.push(streamed_list(p, l, d)?);
                        snap.device_traces.push(Vec::new());
                        continue;
                    }
                    // Fast path: the entries were converted in exactly this order (every
                    // writer appends device by device), so move them without a second copy.
                    if let Some(Node::EventRun { first, len }) = p.node(l)
                        && *first as usize == self.consumed
                        && *len as usize <= self.events.len()
                        && *len > 0
                    {
                        let n = *len as usize;
                        let out: Vec<TraceEntry> = if n == self.events.len() {
                            std::mem::take(&mut self.events)
                        } else {
                            self.events.drain(..n).collect()
                        };
                        self.moved_runs.push((self.consumed, out.len(), d as u32));
                        self.consumed += out.len();
                        snap.device_traces.push(out);
                        continue;
                    }
                    let items = p
                        .items(l)
                        .ok_or_else(|| shape(format!("device_traces[{d}]"), "not a list"))?;
                    let mut out = Vec::with_capacity(items.len());
                    for (i, &e) in items.iter().enumerate() {
                        (self.cur_device, self.cur_index) = (d as u32, i as u32);
                        let entry = match self.taken_event(e, &snap.device_traces, &out, d) {
                            Some(x) => x,
                            None => {
                                let entry = self.event(e);
                                self.over_budget()?;
                                entry.map_err(|m| shape(format!("device_traces[{d}][{i}]"), m))?
                            }
                        };
                        out.push(entry);
                    }
                    snap.device_traces.push(out);
                }
            }
            if let Some(s) = p.get(root, "allocator_settings") {
                snap.allocator_settings = self.meta_dict(s, "allocator_settings")?;
            }
            if let Some(s) = p.get(root, "memsnap") {
                snap.memsnap = self.meta_dict(s, "memsnap")?;
            }
            if let Some(a) = p.get(root, "external_annotations") {
                snap.step_marks = step_marks(p, a);
            }
        }
        self.events = Vec::new();
        self.model_bytes = self.interner.model_bytes();
        self.bad_frames = (
            self.interner.bad_frames,
            self.interner.first_bad_frame.take(),
        );
        (snap.frames, snap.stacks) = std::mem::take(&mut self.interner).into_stacks();
        Ok(snap)
    }

    /// The number of an already converted entry: a list item, or a dict shared through
    /// the memo that was converted where it was first appended.
    fn event_no(&self, v: Val) -> Option<u32> {
        match v {
            Val::Event(n) => Some(n),
            _ => match self.p.node(v) {
                Some(Node::Event(n)) => Some(*n),
                _ => None,
            },
        }
    }

    /// A converted entry that an earlier list position already took (an entry shared
    /// through the memo, which no known writer produces): a clone of that one.
    fn taken_event(
        &self,
        v: Val,
        done: &[Vec<TraceEntry>],
        current: &[TraceEntry],
        device: usize,
    ) -> Option<TraceEntry> {
        let n = self.event_no(v)?;
        let n = n as usize;
        let (d, i) = match self
            .moved_runs
            .iter()
            .find(|(first, len, _)| (*first..first + len).contains(&n))
        {
            Some(&(first, _, moved_to)) => (moved_to, (n - first) as u32),
            None => *self.event_home.get(n)?,
        };
        if d == u32::MAX {
            return None;
        }
        let list = if d as usize == device {
            current
        } else {
            done.get(d as usize)?
        };
        list.get(i as usize).cloned()
    }

    fn event(&mut self, v: Val) -> std::result::Result<TraceEntry, String> {
        if let Some(n) = self.event_no(v) {
            // Move the entry out (no clone); remember where it went for a shared reference.
            let n = n as usize;
            let placeholder = TraceEntry::new(Action::Oom);
            let idx = n.checked_sub(self.consumed).ok_or("bad event index")?;
            let e = self.events.get_mut(idx).ok_or("bad event index")?;
            let entry = std::mem::replace(e, placeholder);
            if self.event_home.is_empty() {
                self.event_home = vec![(u32::MAX, u32::MAX); self.total_events];
            }
            if let Some(home) = self.event_home.get_mut(n) {
                *home = (self.cur_device, self.cur_index);
            }
            return Ok(entry);
        }
        event_from_dict(self.p, &mut self.interner, v)
    }

    fn segment(&mut self, s: Val, i: usize) -> Result<Segment> {
        let p = self.p;
        let path = format!("segments[{i}]");
        if p.dict(s).is_none() {
            return Err(shape(path, "not a dict"));
        }
        let req = |key: &str| {
            int_of(p.get(s, key))
                .ok_or_else(|| shape(format!("{path}.{key}"), "missing or not an integer"))
        };
        let address = req("address")?;
        let total_size = req("total_size")?;
        let pool = p
            .get(s, "segment_pool_id")
            .and_then(|v| p.seq(v))
            .unwrap_or_default();
        let segment_pool_id = (
            int_of(pool.first().copied()).unwrap_or(0),
            int_of(pool.get(1).copied()).unwrap_or(0),
        );
        let segment_type = p
            .get(s, "segment_type")
            .and_then(|v| p.str(v))
            .unwrap_or("large");
        self.spend_model(
            std::mem::size_of::<Segment>() + segment_type.len(),
            "segments and blocks",
        )?;
        let stack = self.interner.stack(p, p.get(s, "frames"));
        self.over_budget()?;
        let mut blocks = Vec::new();
        if let Some(bv) = p.get(s, "blocks") {
            let list = p
                .items(bv)
                .ok_or_else(|| shape(format!("{path}.blocks"), "not a list"))?;
            // A block list shared by many segments is a copy for each.
            self.spend_model(
                list.len().saturating_mul(std::mem::size_of::<Block>()),
                "segments and blocks",
            )?;
            let mut next = address;
            for (j, &b) in list.iter().enumerate() {
                let bpath = format!("{path}.blocks[{j}]");
                if p.dict(b).is_none() {
                    return Err(shape(bpath, "not a dict"));
                }
                let size = int_of(p.get(b, "size"))
                    .ok_or_else(|| shape(format!("{bpath}.size"), "missing or not an integer"))?;
                let state_s = p
                    .get(b, "state")
                    .and_then(|v| p.str(v))
                    .unwrap_or("inactive");
                let state = BlockState::parse(state_s).ok_or_else(|| {
                    shape(
                        format!("{bpath}.state"),
                        format!("unknown state {state_s:?}"),
                    )
                })?;
                let mut frames = p.get(b, "frames");
                let mut requested_size = int_of(p.get(b, "requested_size"));
                // Legacy block: `history` list of {addr, real_size, frames}; newest last.
                if frames.is_none()
                    && let Some(h) = p
                        .get(b, "history")
                        .and_then(|h| p.seq(h))
                        .and_then(|h| h.last().copied())
                {
                    frames = p.get(h, "frames");
                    requested_size = requested_size.or(int_of(p.get(h, "real_size")));
                }
                let block_address = int_of(p.get(b, "address")).unwrap_or(next);
                next = block_address.wrapping_add(size);
                blocks.push(Block {
                    address: block_address,
                    size,
                    requested_size: requested_size.unwrap_or(size),
                    state,
                    stack: self.interner.stack(p, frames),
                });
                self.over_budget()?;
            }
        }
        Ok(Segment {
            device: int_of(p.get(s, "device")).unwrap_or(0),
            address,
            total_size,
            stream: int_of(p.get(s, "stream")).unwrap_or(0),
            segment_type: segment_type.to_string(),
            segment_pool_id,
            is_expandable: matches!(p.get(s, "is_expandable"), Some(Val::Bool(true))),
            stack,
            blocks,
        })
    }

    fn meta_dict(&self, v: Val, path: &str) -> Result<Vec<(String, Meta)>> {
        match self.meta(v, 0, path)? {
            Some(Meta::Dict(d)) => Ok(d),
            _ => Err(shape(path, "not a dict")),
        }
    }

    /// Counts `bytes` of expanded metadata against [`Budget::METADATA_BYTES`].
    fn spend(&self, bytes: usize, path: &str) -> Result<()> {
        let spent = self.metadata_spent.get() + bytes;
        self.metadata_spent.set(spent);
        if spent > Budget::METADATA_BYTES {
            return Err(ReadError::Budget {
                offset: None,
                what: format!("expanding the `{path}` metadata"),
                limit: format!("{} MiB", Budget::METADATA_BYTES >> 20),
                why: "lists or dicts shared many times over",
            });
        }
        Ok(())
    }

    /// `None` for values with no JSON-like form (None, bytes, huge ints): they are skipped.
    fn meta(&self, v: Val, depth: usize, path: &str) -> Result<Option<Meta>> {
        if depth > META_DEPTH {
            return Err(shape(path, "nested too deeply"));
        }
        self.spend(std::mem::size_of::<(String, Meta)>(), path)?;
        let p = self.p;
        Ok(match v {
            Val::None => None,
            Val::Bool(b) => Some(Meta::Bool(b)),
            Val::Int(i) => Some(Meta::Int(i)),
            Val::Float(f) => Some(Meta::Float(f)),
            Val::Event(_) | Val::Stack(_) => None,
            Val::Ref(_) => match p.node(v) {
                Some(Node::Str(s)) => {
                    self.spend(s.len(), path)?;
                    Some(Meta::Str(s.to_string()))
                }
                Some(Node::List(x)) | Some(Node::Tuple(x)) => {
                    let mut out = Vec::with_capacity(x.len());
                    for &i in x {
                        if let Some(m) = self.meta(i, depth + 1, path)? {
                            out.push(m);
                        }
                    }
                    Some(Meta::List(out))
                }
                Some(Node::Dict(d)) => {
                    let mut out = Vec::with_capacity(d.len());
                    for &(k, val) in d {
                        let key = match (p.str(k), k) {
                            (Some(s), _) => {
                                self.spend(s.len(), path)?;
                                s.to_string()
                            }
                            (None, Val::Int(i)) => i.to_string(),
                            _ => continue,
                        };
                        if let Some(m) = self.meta(val, depth + 1, path)? {
                            out.push((key, m));
                        }
                    }
                    Some(Meta::Dict(out))
                }
                _ => None,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{FIXTURES, anchor_line, counts, fixture};
    use super::super::hostile::{
        shared_block_list, shared_frame_string, shared_metadata_string, shared_trace_list,
    };
    use super::super::machine::Machine;
    use super::*;

    /// The whole of `bytes` through the machine (keep mode) and the conversion.
    /// A `str` key (BINUNICODE) for hand-made pickles.
    fn key(b: &mut Vec<u8>, s: &str) {
        b.push(b'X');
        b.extend_from_slice(&(s.len() as u32).to_le_bytes());
        b.extend_from_slice(s.as_bytes());
    }

    fn read_whole(bytes: &[u8]) -> Result<Snapshot> {
        let mut m = Machine::new(bytes, Mode::Keep);
        m.run(&mut |_| {})?;
        let (pickle, interner, events, _) = m.st.finish();
        let root = pickle.root.expect("the machine stops with a root");
        to_snapshot(&pickle, root, Mode::Keep, interner, events).map(|c| c.snapshot)
    }

    fn count(s: &Snapshot, a: &str) -> usize {
        s.device_traces
            .iter()
            .flatten()
            .filter(|e| e.action.as_str() == a)
            .count()
    }

    #[test]
    fn reads_every_fixture_with_the_counts_python_reports() {
        // Counts from `pickle.load` on the same files (tests/fixtures/torch/fixtures.json).
        for name in FIXTURES {
            let s = read_whole(&fixture(name)).unwrap();
            let c = counts(name);
            assert_eq!(s.segments.len() as u64, c["segments"], "{name}");
            assert_eq!(s.device_traces.len() as u64, c["devices"], "{name}");
            for (d, trace) in s.device_traces.iter().enumerate() {
                assert_eq!(trace.len() as u64, c["events"][d], "{name}, device {d}");
            }
            let actions = c["actions"].as_object().unwrap();
            for (action, n) in actions {
                assert_eq!(count(&s, action) as u64, *n, "{name}: {action}");
            }
            let events: usize = s.device_traces.iter().map(Vec::len).sum();
            assert_eq!(
                actions.values().map(|n| n.as_u64().unwrap()).sum::<u64>() as usize,
                events
            );
            let live: Vec<_> = s
                .segments
                .iter()
                .flat_map(|g| &g.blocks)
                .filter(|b| b.state == BlockState::ActiveAllocated)
                .collect();
            assert_eq!(live.len() as u64, c["live_blocks"], "{name}");
            assert_eq!(
                live.iter().map(|b| b.size).sum::<i64>(),
                c["live_bytes"],
                "{name}"
            );
            let reserved: i64 = s.segments.iter().map(|g| g.total_size).sum();
            assert_eq!(reserved, c["reserved_bytes"], "{name}");
        }

        let s = read_whole(&fixture("torch-python-stacks.pickle")).unwrap();
        assert_eq!(s.device_traces.len(), 1);
        assert_eq!(
            s.allocator_settings
                .iter()
                .find(|(k, _)| k == "max_split_size")
                .map(|(_, v)| v),
            Some(&Meta::Int(-1))
        );

        let s = read_whole(&fixture("torch-transformer-all-stacks.pickle")).unwrap();
        // Shared frame lists stay shared: far fewer stacks than events.
        assert!(
            s.stacks.len() < s.device_traces[0].len() / 4,
            "{} stacks for {} events",
            s.stacks.len(),
            s.device_traces[0].len()
        );

        let s = read_whole(&fixture("torch-oom.pickle")).unwrap();
        let c = &counts("torch-oom.pickle")["ooms"][0];
        let (i, oom) = s.device_traces[0]
            .iter()
            .enumerate()
            .find(|(_, e)| e.action == Action::Oom)
            .unwrap();
        assert_eq!(i as u64, c["event"]);
        assert_eq!(oom.device_free, c["device_free"].as_i64());
        assert_eq!(oom.size, 16 << 30);
        let f: Vec<_> = s.stack_frames(oom.stack).collect();
        assert_eq!(f[0].filename, "scripts/gpu/make_fixtures.py");
        assert_eq!(f[0].line, anchor_line("oom alloc"));

        let s = read_whole(&fixture("torch-expandable-segments.pickle")).unwrap();
        assert!(s.segments.iter().all(|g| g.is_expandable));
        assert!(count(&s, "segment_map") >= 4);
        assert!(count(&s, "segment_unmap") >= 1);
    }

    #[test]
    fn blocks_tile_their_segments_in_fixtures() {
        for f in FIXTURES {
            let s = read_whole(&fixture(f)).unwrap();
            for g in &s.segments {
                assert_eq!(
                    g.blocks.iter().map(|b| b.size).sum::<i64>(),
                    g.total_size,
                    "{f}"
                );
                assert_eq!(g.blocks[0].address, g.address, "{f}");
            }
        }
    }

    /// A hand-made protocol-2 pickle in the C++ pickler's style: BINPUT memo, an unbatched
    /// APPENDS, 8-byte LONG1, a 9-byte LONG1 address ≥ 2^63, text INT, a shared frame list.
    #[test]
    fn reads_cpp_pickler_style_and_legacy_shapes() {
        let mut b = vec![0x80, 2, b'}', b'q', 0, b'('];
        key(&mut b, "segments");
        b.extend_from_slice(&[b']', b'q', 1]);
        key(&mut b, "device_traces");
        b.extend_from_slice(&[b']', b'q', 2, b'(', b']', b'q', 3, b'(']);
        // frames list: [{"name": "f", "filename": "a.py", "line": 7}], memo 4
        let event = |b: &mut Vec<u8>, first: bool| {
            b.extend_from_slice(b"}(");
            key(b, "action");
            key(b, "alloc");
            key(b, "addr");
            b.extend_from_slice(&[0x8a, 9, 0, 0, 0, 0, 0, 0, 0, 0x80, 0]);
            key(b, "size");
            b.extend_from_slice(b"I4096\n");
            key(b, "frames");
            if first {
                b.extend_from_slice(&[b']', b'q', 4, b'}', b'(']);
                key(b, "name");
                key(b, "f");
                key(b, "filename");
                key(b, "a.py");
                key(b, "line");
                b.extend_from_slice(&[b'K', 7, b'u', b'a']);
            } else {
                b.extend_from_slice(&[b'h', 4]);
            }
            b.push(b'u');
        };
        event(&mut b, true);
        event(&mut b, false);
        b.extend_from_slice(b"eeu.");
        let s = read_whole(&b).unwrap();
        assert_eq!(s.device_traces[0].len(), 2);
        assert_eq!(s.device_traces[0][0].addr, i64::MIN);
        assert_eq!(s.device_traces[0][1].size, 4096);
        assert_eq!(s.stacks.len(), 1);
        assert_eq!(s.device_traces[0][0].stack, s.device_traces[0][1].stack);
        assert_eq!(s.frames[0].line, 7);

        // An event dict shared through the memo (appended twice) is read twice.
        let mut b = vec![0x80, 4, b'}', b'('];
        key(&mut b, "device_traces");
        b.extend_from_slice(&[b']', b'(', b']', b'(', b'}', b'q', 1, b'(']);
        key(&mut b, "action");
        key(&mut b, "alloc");
        key(&mut b, "size");
        b.extend_from_slice(&[b'K', 9, b'u', b'h', 1, b'e', b'e', b'u', b'.']);
        let s = read_whole(&b).unwrap();
        assert_eq!(s.device_traces[0].len(), 2);
        assert_eq!(s.device_traces[0][0], s.device_traces[0][1]);
        assert_eq!(s.device_traces[0][1].size, 9);

        // A run of converted entries that then gets something else appended (the same
        // entry again, through the memo) turns back into a plain list, read in order.
        let mut b = vec![0x80, 4, b'}', b'('];
        key(&mut b, "device_traces");
        b.extend_from_slice(b"](]");
        for (memo, size) in [(1u8, 5u8), (2, 6)] {
            b.extend_from_slice(&[b'}', b'q', memo, b'(']);
            key(&mut b, "action");
            key(&mut b, "alloc");
            key(&mut b, "size");
            b.extend_from_slice(&[b'K', size, b'u', b'a']);
        }
        b.extend_from_slice(&[b'h', 1, b'a', b'e', b'u', b'.']);
        let s = read_whole(&b).unwrap();
        let sizes: Vec<i64> = s.device_traces[0].iter().map(|e| e.size).collect();
        assert_eq!(sizes, [5, 6, 5]);

        // Two devices, each a run: entries go to their own device, in order.
        let mut b = vec![0x80, 4, b'}', b'('];
        key(&mut b, "device_traces");
        b.extend_from_slice(b"](");
        for sizes in [[1u8, 2, 3], [4, 5, 6]] {
            b.extend_from_slice(b"](");
            for size in sizes {
                b.extend_from_slice(b"}(");
                key(&mut b, "action");
                key(&mut b, "free_completed");
                key(&mut b, "size");
                b.extend_from_slice(&[b'K', size, b'u']);
            }
            b.push(b'e');
        }
        b.extend_from_slice(b"eu.");
        let s = read_whole(&b).unwrap();
        let sizes: Vec<Vec<i64>> = s
            .device_traces
            .iter()
            .map(|t| t.iter().map(|e| e.size).collect())
            .collect();
        assert_eq!(sizes, [vec![1, 2, 3], vec![4, 5, 6]]);
        assert!(
            s.device_traces[1]
                .iter()
                .all(|e| e.action == Action::FreeCompleted)
        );

        // Legacy top-level list (`torch.cuda.memory_snapshot()`): segments only.
        let mut b = vec![0x80, 2, b']', b'(', b'}', b'('];
        key(&mut b, "address");
        b.extend_from_slice(&[b'M', 0, 0x10]);
        key(&mut b, "total_size");
        b.extend_from_slice(&[b'J', 0, 0, 0x20, 0]);
        key(&mut b, "blocks");
        b.extend_from_slice(b"]ue.");
        let s = read_whole(&b).unwrap();
        assert_eq!(s.segments.len(), 1);
        assert_eq!(
            (s.segments[0].address, s.segments[0].total_size),
            (4096, 2 << 20)
        );
        assert!(s.device_traces.is_empty());
    }

    #[test]
    fn inputs_without_device_traces_or_segments_are_not_snapshots() {
        let empty_list = [0x80, 2, b']', b'.'];
        let mut segments_only = vec![0x80, 4, b'}', b'('];
        key(&mut segments_only, "segments");
        segments_only.extend_from_slice(b"]u.");
        for (what, bytes) in [
            ("empty list", &empty_list[..]),
            ("segments only", &segments_only),
        ] {
            match read_whole(bytes) {
                Err(ReadError::Shape { path, msg }) => {
                    assert_eq!(path, "top level", "{what}");
                    assert!(
                        msg.contains("device_traces") || msg.contains("empty list"),
                        "{what}: {msg}"
                    );
                }
                other => panic!("{what}: {other:?}"),
            }
        }
    }

    /// 100 MB of empty-list opcodes once took 5 GB; any input now stops at its budget.
    #[test]
    fn a_flood_of_tiny_values_stops_at_the_budget() {
        let n = Budget::FLOOR_VALUES * 2;
        let mut b = vec![0x80, 4];
        b.resize(2 + n, b']');
        b.push(b'.');
        match read_whole(&b) {
            Err(ReadError::Budget {
                what,
                offset: Some(offset),
                ..
            }) => {
                assert_eq!(what, "the pickle's values");
                // It stopped as soon as the values outgrew the bytes read.
                let limit = Budget::FLOOR_VALUES + offset / Budget::BYTES_PER_VALUE;
                assert!(
                    offset < n && limit <= Budget::FLOOR_VALUES * 2,
                    "stopped at {offset}"
                );
            }
            other => panic!("{other:?}"),
        }
        let err = read_whole(&b).unwrap_err().to_string();
        assert!(err.contains("budget"), "{err}");
    }

    /// A few hundred bytes whose metadata list holds the one below twice at every level: expanded,
    /// 2^30 values (60 GB). The expansion stops at the metadata budget.
    #[test]
    fn shared_metadata_is_never_expanded_past_the_budget() {
        let mut b = vec![0x80, 4, b'}', b'('];
        key(&mut b, "device_traces");
        b.push(b']');
        key(&mut b, "memsnap");
        b.push(b'}');
        b.push(b'(');
        key(&mut b, "laughs");
        // A list memoized at 0, then 30 times (within the nesting limit): a new list holding the previous one twice,
        // memoized at the next index.
        b.extend_from_slice(&[b']', b'K', 1, b'a', 0x94]);
        for level in 0u8..30 {
            // POP the previous list off the stack: only the memo keeps it.
            b.extend_from_slice(&[b'0', b']', b'(', b'h', level, b'h', level, b'e', 0x94]);
        }
        b.extend_from_slice(b"uu.");
        match read_whole(&b) {
            Err(ReadError::Budget { what, limit, .. }) => {
                assert_eq!(what, "expanding the `memsnap` metadata");
                assert_eq!(limit, format!("{} MiB", Budget::METADATA_BYTES >> 20));
            }
            other => panic!("{other:?}"),
        }
    }

    /// The bytes of model `bytes` makes when read whole (keep mode).
    fn model_bytes(bytes: &[u8]) -> usize {
        let mut m = Machine::new(bytes, Mode::Keep);
        m.run(&mut |_| {}).unwrap();
        let (pickle, interner, events, _) = m.st.finish();
        let root = pickle.root.unwrap();
        to_snapshot(&pickle, root, Mode::Keep, interner, events)
            .unwrap()
            .model_bytes
    }

    /// PyTorch's files and memsnap's own stay far inside the model budget: a fifth of
    /// [`Budget::MODEL_PER_BYTE`] or less, floor not counted.
    #[test]
    fn real_files_need_a_fraction_of_the_model_budget() {
        let mut files: Vec<(String, Vec<u8>)> = FIXTURES
            .iter()
            .map(|n| (n.to_string(), fixture(n)))
            .collect();
        let mut own = crate::model::Snapshot {
            frames: vec![crate::model::Frame {
                name: "f".into(),
                filename: "/app/train.py".into(),
                line: 1,
            }],
            stacks: vec![vec![0]],
            ..Snapshot::default()
        };
        own.device_traces = vec![
            (0..20_000)
                .map(|i| TraceEntry {
                    action: if i % 2 == 0 {
                        Action::Alloc
                    } else {
                        Action::FreeCompleted
                    },
                    addr: 0x1000 * (i / 2),
                    size: 512,
                    stream: 0,
                    time_us: i,
                    stack: Some(0),
                    device_free: None,
                    user_metadata: None,
                })
                .collect(),
        ];
        files.push(("memsnap's own".into(), crate::pickle_write::to_bytes(&own)));
        for (name, bytes) in files {
            let per_byte = model_bytes(&bytes) as f64 / bytes.len() as f64;
            assert!(
                per_byte * 5.0 <= Budget::MODEL_PER_BYTE as f64,
                "{name}: {per_byte:.2} bytes of model per byte"
            );
        }
    }

    /// A list of trace entries or of blocks stored once and referenced many times through
    /// the memo was expanded once per reference: 780 KB of file took 4 GB. The model is
    /// now counted per reference and the read refused at its budget, whole or streamed;
    /// a little sharing (a few devices with the same list) still reads.
    #[test]
    fn lists_shared_through_the_memo_stop_at_the_model_budget() {
        let hostile = [
            (
                "trace list",
                shared_trace_list(20_000, 180_000),
                "trace entries",
            ),
            (
                "block list",
                shared_block_list(20_000, 25_000),
                "segments and blocks",
            ),
        ];
        for (what, bytes, expanding) in &hostile {
            assert!(bytes.len() < 1 << 20, "{what}: {} bytes", bytes.len());
            let expected = ReadError::Expands {
                what: expanding,
                per_byte: Budget::MODEL_PER_BYTE,
                floor_mib: Budget::MODEL_FLOOR >> 20,
            };
            assert_eq!(read_whole(bytes).unwrap_err(), expected, "{what}");
            let streamed =
                super::super::stream_snapshot_from(&mut &bytes[..], &mut |_| {}, &mut |_, _| {});
            assert_eq!(streamed.unwrap_err(), expected, "{what}, streamed");
            let msg = expected.to_string();
            assert!(
                msg.contains("times its size") && !msg.contains('\n'),
                "{msg}"
            );
        }
        let s = read_whole(&shared_trace_list(1000, 3)).unwrap();
        assert_eq!(s.device_traces.len(), 4);
        assert!(s.device_traces.iter().all(|t| t.len() == 1000));
        assert_eq!(s.device_traces[3][999].addr, 999 << 9);
        let s = read_whole(&shared_block_list(1000, 3)).unwrap();
        assert_eq!(s.segments.len(), 4);
        assert!(s.segments.iter().all(|g| g.blocks.len() == 1000));
    }

    /// A long string shared through the memo by many distinct frames, or by every pair of
    /// a `user_metadata` dict, is copied each time: 300 KB of file would be gigabytes of
    /// frames or of one metadata text. Both stop at the model budget; short ones read.
    #[test]
    fn strings_shared_through_the_memo_stop_at_the_model_budget() {
        for (what, bytes, expanding) in [
            ("frames", shared_frame_string(64 << 10, 20_000), "frames"),
            (
                "user_metadata",
                shared_metadata_string(64 << 10, 50_000),
                "user_metadata",
            ),
        ] {
            assert!(bytes.len() < 400 << 10, "{what}: {} bytes", bytes.len());
            match read_whole(&bytes) {
                Err(ReadError::Expands { what: w, .. }) => assert_eq!(w, expanding),
                other => panic!("{what}: {other:?}"),
            }
        }
        let s = read_whole(&shared_frame_string(10, 5)).unwrap();
        assert_eq!(s.frames.len(), 5);
        assert_eq!(s.frames[4].name, "x".repeat(10));
        assert_eq!(s.stacks[0].len(), 5);
        let s = read_whole(&shared_metadata_string(3, 2)).unwrap();
        assert_eq!(
            s.device_traces[0][0].user_metadata.as_deref(),
            Some("xxx: xxx, xxx: xxx")
        );
    }
}

//! Pickle reader for snapshots: memsnap's own files and PyTorch's (`_dump_snapshot`).
//!
//! Cold code, no unsafe, executes nothing. Layers:
//! - [`parse`] runs the pickle machine (protocols 0–5, plain data only) over untrusted bytes
//!   into an arena of [`Node`]s. Values refer to nodes by index, so an object shared through
//!   the memo (PyTorch shares frame dicts and frame lists) stays one node: that is what lets
//!   the model intern frames and stacks by identity, and what serde-pickle cannot do.
//! - [`read_snapshot`] turns the value into a [`Snapshot`]. Trace entries (the bulk of any
//!   large file) are converted as soon as they are appended to their list, and their dict
//!   is dropped, so memory stays close to the size of the model rather than of a generic tree.
//!   A device's list of converted entries is kept as a number range, not one value each.
//! - [`read_snapshot_from`] does the same from a stream, a chunk at a time (an opcode cut by
//!   a chunk's end is run again once the next chunk is in), so the file itself is never held
//!   whole: the CLI's peak memory is the model plus the memo, not the model plus the file.
//! - [`stream_snapshot_from`] also hands each entry out as it is converted instead of
//!   keeping it. The dicts and frame lists it came from go back to the arena for reuse
//!   (a node nothing else can refer to: not memoized, or memoized once and never fetched
//!   or duplicated; its memo slot then names the interned stack, or "gone"), so memory no
//!   longer grows with the history: `summary` of a 1 GB file needs about a tenth of it.
//!
//! Untrusted input: every length is checked against the remaining input before anything is
//! allocated (when streaming, a length past the chunk reads on, at most to the end of the
//! file, before it is checked), every opcode creates at most one node, and nothing recurses over input depth
//! except the conversion of metadata dicts, which is capped. Any problem is a [`ReadError`]
//! with the byte offset (or the key path for shape errors); nothing panics.

use super::model::{
    Action, Block, BlockState, Frame, Meta, Segment, Snapshot, StackId, TraceEntry,
};
use rustc_hash::{FxHashMap, FxHashSet};
use std::sync::Arc;
use thiserror::Error;

/// Why a file could not be read.
#[derive(Debug, Error, PartialEq)]
#[non_exhaustive]
pub enum ReadError {
    #[error("empty file: not a pickle")]
    Empty,
    #[error(
        "not a pickle snapshot: it starts with {start:?}, not a pickle protocol header (0x80){hint}"
    )]
    NotPickle { start: String, hint: &'static str },
    #[error("truncated at byte {offset}: {what} needs {need} bytes, {left} left")]
    Truncated {
        offset: usize,
        what: &'static str,
        need: u64,
        left: usize,
    },
    #[error("unknown pickle opcode 0x{opcode:02x} at byte {offset} (not a pickle, or corrupt)")]
    UnknownOpcode { offset: usize, opcode: u8 },
    #[error(
        "pickle opcode {name} at byte {offset} builds a Python object: memsnap reads plain data only and executes nothing"
    )]
    Forbidden { offset: usize, name: &'static str },
    #[error("unsupported pickle protocol {version} at byte {offset}")]
    Protocol { offset: usize, version: u8 },
    #[error("corrupt pickle at byte {offset}: {msg}")]
    Corrupt { offset: usize, msg: String },
    #[error("memo index {index} used at byte {offset} was never stored")]
    BadMemo { offset: usize, index: u64 },
    #[error("pickle ends at byte {offset} without STOP (truncated file?)")]
    NoStop { offset: usize },
    #[error("cannot read the file at byte {offset}: {msg}")]
    Io { offset: usize, msg: String },
    #[error("not a memory snapshot: {path}: {msg}")]
    Shape { path: String, msg: String },
    /// Only from [`stream_snapshot_from`]: the file needs an entry it already handed out.
    #[error("cannot stream this snapshot: {why}; read it whole instead")]
    NeedsFullRead { why: &'static str },
}

type Result<T> = std::result::Result<T, ReadError>;

/// A value on the pickle stack or inside a container: scalars inline, the rest in the arena.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Val {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    /// Index into [`Pickle::nodes`].
    Ref(u32),
    /// A trace entry converted when it was appended to a list (snapshot modes only): the
    /// entry's number. Found only inside lists, never on the machine's stack.
    Event(u32),
    /// A frame list already interned, fetched from the memo (snapshot modes only): the
    /// list itself was dropped once interned.
    Stack(Option<StackId>),
}

/// An arena entry. Containers hold [`Val`]s, so sharing is preserved.
#[derive(Clone, Debug, PartialEq)]
pub enum Node {
    /// An integer that does not fit in 64 bits (kept opaque: the little-endian bytes).
    BigInt(Box<[u8]>),
    Str(Box<str>),
    /// `bytes`/`bytearray`/py2 `str`: kept opaque, only the length.
    Bytes(usize),
    List(Vec<Val>),
    Tuple(Vec<Val>),
    Dict(Vec<(Val, Val)>),
    /// A trace entry already converted (snapshot mode only); its dict was dropped.
    Event(u32),
    /// A frame list already interned as a stack (snapshot mode only); its items were
    /// dropped, which is most of the memory a large file would otherwise hold.
    Stack(Option<StackId>),
    /// A list of `len` converted trace entries numbered `first..first + len` (snapshot
    /// mode only): the device's trace list, stored without one value per entry.
    EventRun {
        first: u32,
        len: u32,
    },
    /// A slot given back after its contents were converted; the next node reuses it.
    Free,
}

/// The result of [`parse`]: the arena and the top-level value.
#[derive(Debug, Default)]
pub struct Pickle {
    pub nodes: Vec<Node>,
    pub root: Option<Val>,
    /// Protocol from the PROTO header (0 when there is none).
    pub protocol: u8,
    /// Snapshot modes: how each node can be reached again besides its one container
    /// ([`NOT_MEMOIZED`], [`SHARED`], or its memo index). Empty in plain mode.
    reach: Vec<u32>,
}

/// [`Pickle::reach`]: the node was neither memoized nor duplicated, so its one container is
/// the only thing that refers to it.
const NOT_MEMOIZED: u32 = u32::MAX;
/// [`Pickle::reach`]: fetched from the memo (a copy exists besides its container), memoized
/// more than once, duplicated, or under an index the dense memo cannot hold: never freed.
const SHARED: u32 = u32::MAX - 1;

impl Pickle {
    /// Whether the node can be referred to again later in the file (through the memo or a
    /// DUP): only then is it worth remembering by identity.
    fn may_recur(&self, id: u32) -> bool {
        self.reach
            .get(id as usize)
            .is_none_or(|&r| r != NOT_MEMOIZED)
    }

    pub fn node(&self, v: Val) -> Option<&Node> {
        match v {
            Val::Ref(i) => self.nodes.get(i as usize),
            _ => None,
        }
    }
    pub fn str(&self, v: Val) -> Option<&str> {
        match self.node(v) {
            Some(Node::Str(s)) => Some(s),
            _ => None,
        }
    }
    /// Items of a list or tuple.
    pub fn items(&self, v: Val) -> Option<std::borrow::Cow<'_, [Val]>> {
        match self.node(v) {
            Some(Node::List(x)) | Some(Node::Tuple(x)) => Some(std::borrow::Cow::Borrowed(x)),
            Some(Node::EventRun { first, len }) => Some(std::borrow::Cow::Owned(
                (*first..first.saturating_add(*len))
                    .map(Val::Event)
                    .collect(),
            )),
            _ => None,
        }
    }
    pub fn dict(&self, v: Val) -> Option<&[(Val, Val)]> {
        match self.node(v) {
            Some(Node::Dict(x)) => Some(x),
            _ => None,
        }
    }
    /// Value of a string key in a dict (the last one wins, as in Python).
    pub fn get(&self, dict: Val, key: &str) -> Option<Val> {
        self.dict(dict)?
            .iter()
            .rev()
            .find(|(k, _)| self.str(*k) == Some(key))
            .map(|(_, v)| *v)
    }
}

/// Parses any plain-data pickle into an arena of values.
pub fn parse(bytes: &[u8]) -> Result<Pickle> {
    let mut m = Machine::new(bytes, Mode::Plain);
    m.run(&mut |_| {})?;
    Ok(m.st.pickle)
}

/// Reads a memory snapshot (memsnap's or PyTorch's).
pub fn read_snapshot(bytes: &[u8]) -> Result<Snapshot> {
    read_snapshot_with_progress(bytes, &mut |_| {})
}

/// Like [`read_snapshot`], calling `progress(bytes_done)` every few MiB.
pub fn read_snapshot_with_progress(
    bytes: &[u8],
    progress: &mut dyn FnMut(usize),
) -> Result<Snapshot> {
    read_snapshot_from(&mut &bytes[..], progress)
}

/// Reads a snapshot from a stream (a file) a chunk at a time, so the file is never
/// held in memory whole: only the decoded model, the memo and the current chunk are.
/// Errors and their offsets are the same as for [`read_snapshot`] on the whole file.
pub fn read_snapshot_from(
    input: &mut dyn std::io::Read,
    progress: &mut dyn FnMut(usize),
) -> Result<Snapshot> {
    read_chunked(input, READ_CHUNK, progress, None).map(|s| s.snapshot)
}

/// A snapshot read by [`stream_snapshot_from`]: everything but the trace entries.
#[derive(Debug, PartialEq)]
pub struct Streamed {
    /// `device_traces` holds one empty list per device: the entries went to the sink.
    pub snapshot: Snapshot,
    /// For each device, the list number its entries were handed out with.
    pub trace_lists: Vec<u32>,
}

/// Receives each trace entry once, in file order, with the number of the list it was
/// appended to (a device's entries all share one number, see [`Streamed::trace_lists`]).
pub type TraceSink<'a> = &'a mut dyn FnMut(u32, TraceEntry);

/// Reads a snapshot without keeping its history: each trace entry goes to `sink` as soon
/// as it is decoded and is then dropped, and so are the dicts and frame lists it came
/// from. Memory is the segments, the distinct frames and stacks, and 4 bytes of memo per
/// memoized object, whatever the length of the history.
///
/// A file that refers back to a trace entry already handed out (no known writer does)
/// fails with [`ReadError::NeedsFullRead`]: read it with [`read_snapshot_from`] instead.
pub fn stream_snapshot_from(
    input: &mut dyn std::io::Read,
    progress: &mut dyn FnMut(usize),
    sink: TraceSink<'_>,
) -> Result<Streamed> {
    read_chunked(input, READ_CHUNK, progress, Some(sink))
}

/// Bytes read from the stream at a time (more when one opcode needs more).
const READ_CHUNK: usize = 8 << 20;

/// Appends up to `want` bytes of `input` to `buf`; true when the input is exhausted.
fn fill(input: &mut dyn std::io::Read, buf: &mut Vec<u8>, want: usize, at: usize) -> Result<bool> {
    buf.reserve(want.min(READ_CHUNK));
    let mut limited = std::io::Read::take(&mut *input, want as u64);
    let got = std::io::Read::read_to_end(&mut limited, buf).map_err(|e| ReadError::Io {
        offset: at,
        msg: e.to_string(),
    })?;
    Ok(got < want)
}

fn read_chunked(
    input: &mut dyn std::io::Read,
    chunk: usize,
    progress: &mut dyn FnMut(usize),
    mut sink: Option<TraceSink<'_>>,
) -> Result<Streamed> {
    let chunk = chunk.max(1);
    let mut buf = Vec::new();
    let mut eof = fill(input, &mut buf, chunk.max(16), 0)?;
    // Every snapshot writer (Python protocol 2+, the C++ pickler, memsnap) starts with
    // PROTO; checking it first turns "memo index never stored" on a text file into a
    // message that says what the file is not.
    match buf.first() {
        None => return Err(ReadError::Empty),
        Some(0x80) => {}
        Some(_) => {
            let start: String = String::from_utf8_lossy(&buf[..buf.len().min(12)])
                .chars()
                .map(|c| if c.is_control() { '.' } else { c })
                .collect();
            let hint = if buf.starts_with(&[0x1f, 0x8b]) {
                " (gzip-compressed: gunzip it first)"
            } else {
                ""
            };
            return Err(ReadError::NotPickle { start, hint });
        }
    }
    let mut base = 0usize;
    let mode = if sink.is_some() {
        Mode::Stream
    } else {
        Mode::Keep
    };
    let mut state = MachineState::new(mode);
    loop {
        let mut m = Machine::resume(&buf, base, eof, state);
        let ran = m.run(progress);
        if let Some(sink) = sink.as_deref_mut() {
            for (list, entry) in m.st.streamed.drain(..) {
                sink(list, entry);
            }
        }
        match ran {
            Ok(()) => {
                state = m.st;
                break;
            }
            Err(ReadError::Truncated { need, .. }) if !eof => {
                // The opcode at `op_start` runs past this chunk: keep its bytes, read on.
                let (keep_from, pos) = (m.op_start, m.pos);
                state = m.st;
                let more = (need as usize).saturating_add(pos - keep_from).max(chunk);
                buf.drain(..keep_from);
                base += keep_from;
                let at = base + buf.len();
                eof = fill(input, &mut buf, more, at)?;
            }
            Err(ReadError::NoStop { .. }) if !eof => {
                let keep_from = m.op_start;
                state = m.st;
                buf.drain(..keep_from);
                base += keep_from;
                let at = base + buf.len();
                eof = fill(input, &mut buf, chunk, at)?;
            }
            Err(e) => return Err(e.shifted(base)),
        }
    }
    drop(buf);
    let MachineState {
        pickle,
        interner,
        events,
        memo,
        memo_side,
        memo_sparse,
        stack,
        marks,
        free,
        ..
    } = state;
    // The machine's working state is not needed to convert: free it now, not at the end.
    drop((memo, memo_side, memo_sparse, stack, marks, free));
    let root = pickle.root.ok_or(ReadError::NoStop { offset: base })?;
    let total_events = events.len();
    // Nothing is dropped from here on, so lists may be remembered by identity.
    let mut interner = interner;
    interner.collapse = None;
    let mut conv = Converter {
        p: &pickle,
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
    };
    let snapshot = conv.snapshot(root)?;
    Ok(Streamed {
        snapshot,
        trace_lists: conv.trace_lists,
    })
}

impl ReadError {
    /// The same error with byte offsets moved by `base` (errors of a chunk that starts
    /// at byte `base` of the file).
    fn shifted(mut self, base: usize) -> Self {
        match &mut self {
            ReadError::Truncated { offset, .. }
            | ReadError::UnknownOpcode { offset, .. }
            | ReadError::Forbidden { offset, .. }
            | ReadError::Protocol { offset, .. }
            | ReadError::Corrupt { offset, .. }
            | ReadError::BadMemo { offset, .. }
            | ReadError::NoStop { offset }
            | ReadError::Io { offset, .. } => *offset += base,
            ReadError::Empty
            | ReadError::NotPickle { .. }
            | ReadError::Shape { .. }
            | ReadError::NeedsFullRead { .. } => {}
        }
        self
    }
}

// ---------------------------------------------------------------------------------------
// The pickle machine.

const PROGRESS_STEP: usize = 8 << 20;
/// Memo slot tag: the rest is an index into `Machine::memo_side`.
const MEMO_SIDE: u32 = 1 << 31;
/// Memo slot tag: the rest is an interned stack ([`MEMO_NO_STACK`] for an empty one); the
/// frame list it came from was dropped. Below this tag, a slot is a node index.
const MEMO_STACK: u32 = 1 << 30;
const MEMO_NO_STACK: u32 = MEMO_SIDE - 1;
/// Memo slot of a trace entry already handed to the sink and dropped (stream mode).
const MEMO_GONE: u32 = u32::MAX - 1;
/// Memo slot that holds nothing in the dense vector (the value is in `memo_sparse`).
const MEMO_UNSET: u32 = u32::MAX;

/// Dropped dicts (and lists) whose storage is kept for reuse.
const SPARES: usize = 64;

/// What the machine builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// A generic value tree ([`parse`]).
    Plain,
    /// A snapshot: trace entries converted as they are appended, and kept.
    Keep,
    /// A snapshot whose entries are handed out as they are converted and not kept.
    Stream,
}

/// Everything the pickle machine keeps between input chunks.
struct MachineState {
    pickle: Pickle,
    stack: Vec<Val>,
    marks: Vec<usize>,
    /// Dense memo, 4 bytes a slot (files memoize every dict and list, so this is one slot
    /// per container of the file): a node index, or [`MEMO_SIDE`] plus an index into
    /// `memo_side` for anything else (scalars, node indices too large for the encoding).
    memo: Vec<u32>,
    memo_side: Vec<Val>,
    /// Memo indices far beyond the dense vector (BINPUT with arbitrary numbers).
    memo_sparse: FxHashMap<u64, Val>,
    mode: Mode,
    interner: Interner,
    /// Keep mode: the converted entries, by number.
    events: Vec<TraceEntry>,
    /// Stream mode: converted entries not yet handed to the sink, with their list.
    streamed: Vec<(u32, TraceEntry)>,
    /// Entries converted so far (their numbers).
    converted: u32,
    /// Arena slots given back ([`Node::Free`]), reused before the arena grows.
    free: Vec<u32>,
    /// Scratch for [`Machine::release`].
    release_work: Vec<u32>,
    /// Storage of dropped dicts and lists, for the next ones (at most [`SPARES`] each).
    spare_dicts: Vec<Vec<(Val, Val)>>,
    spare_lists: Vec<Vec<Val>>,
    next_report: usize,
}

impl MachineState {
    fn new(mode: Mode) -> Self {
        MachineState {
            pickle: Pickle::default(),
            stack: Vec::new(),
            marks: Vec::new(),
            memo: Vec::new(),
            memo_side: Vec::new(),
            memo_sparse: FxHashMap::default(),
            mode,
            interner: Interner {
                collapse: (mode != Mode::Plain).then(Vec::new),
                ..Interner::default()
            },
            events: Vec::new(),
            streamed: Vec::new(),
            converted: 0,
            free: Vec::new(),
            release_work: Vec::new(),
            spare_dicts: Vec::new(),
            spare_lists: Vec::new(),
            next_report: PROGRESS_STEP,
        }
    }
}

/// The machine over one chunk of input: `input` starts at byte `base` of the file, and
/// `last` says whether it runs to the end of the file. Every opcode reads all its bytes
/// before it changes any state, so an opcode cut by the end of a chunk (a `Truncated` or
/// `NoStop` error when `last` is false) is simply run again from `op_start` once the next
/// chunk is there.
struct Machine<'a> {
    input: &'a [u8],
    pos: usize,
    base: usize,
    last: bool,
    op_start: usize,
    st: MachineState,
}

impl<'a> Machine<'a> {
    fn new(input: &'a [u8], mode: Mode) -> Self {
        Machine::resume(input, 0, true, MachineState::new(mode))
    }
    fn resume(input: &'a [u8], base: usize, last: bool, st: MachineState) -> Self {
        Machine {
            input,
            pos: 0,
            base,
            last,
            op_start: 0,
            st,
        }
    }

    fn take(&mut self, n: u64, what: &'static str) -> Result<&'a [u8]> {
        let left = self.input.len() - self.pos;
        if n > left as u64 {
            return Err(ReadError::Truncated {
                offset: self.pos,
                what,
                need: n,
                left,
            });
        }
        let s = &self.input[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }
    fn u8(&mut self, what: &'static str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    fn le(&mut self, n: usize, what: &'static str) -> Result<u64> {
        let b = self.take(n as u64, what)?;
        let mut v = 0u64;
        for (i, x) in b.iter().enumerate() {
            v |= (*x as u64) << (8 * i);
        }
        Ok(v)
    }
    fn line(&mut self, what: &'static str) -> Result<&'a [u8]> {
        let rest = &self.input[self.pos..];
        match rest.iter().position(|&c| c == b'\n') {
            Some(n) => {
                let s = &rest[..n];
                self.pos += n + 1;
                Ok(s)
            }
            None => Err(ReadError::Truncated {
                offset: self.pos,
                what,
                need: rest.len() as u64 + 1,
                left: rest.len(),
            }),
        }
    }

    fn corrupt(&self, at: usize, msg: impl Into<String>) -> ReadError {
        ReadError::Corrupt {
            offset: at,
            msg: msg.into(),
        }
    }
    fn push_node(&mut self, n: Node) -> Val {
        let p = &mut self.st.pickle;
        if let Some(id) = self.st.free.pop() {
            p.nodes[id as usize] = n;
            p.reach[id as usize] = NOT_MEMOIZED;
            return Val::Ref(id);
        }
        let id = p.nodes.len() as u32;
        p.nodes.push(n);
        if self.st.mode != Mode::Plain {
            p.reach.push(NOT_MEMOIZED);
        }
        Val::Ref(id)
    }

    /// Gives back a node that nothing can refer to any more, and with it every child that
    /// only it referred to (a child never memoized nor duplicated has exactly one
    /// container). Iterative: input depth never becomes recursion.
    fn release(&mut self, root: u32) {
        let mut work = std::mem::take(&mut self.st.release_work);
        work.push(root);
        while let Some(id) = work.pop() {
            let p = &mut self.st.pickle;
            let node = std::mem::replace(&mut p.nodes[id as usize], Node::Free);
            let keep = match &node {
                // Its numbers name entries already converted: never reuse it.
                Node::EventRun { .. } | Node::Free => true,
                Node::List(v) | Node::Tuple(v) => v.iter().any(|v| matches!(v, Val::Event(_))),
                _ => false,
            };
            if keep {
                p.nodes[id as usize] = node;
                continue;
            }
            let sole = |v: &Val| match *v {
                Val::Ref(c) => (p.reach.get(c as usize) == Some(&NOT_MEMOIZED)).then_some(c),
                _ => None,
            };
            // The storage of dicts and lists serves the next ones: one event dict or frame
            // list is much like the next.
            match node {
                Node::Dict(mut d) => {
                    work.extend(d.iter().flat_map(|(k, v)| [sole(k), sole(v)]).flatten());
                    if self.st.spare_dicts.len() < SPARES {
                        d.clear();
                        self.st.spare_dicts.push(d);
                    }
                }
                Node::List(mut v) => {
                    work.extend(v.iter().filter_map(sole));
                    if self.st.spare_lists.len() < SPARES {
                        v.clear();
                        self.st.spare_lists.push(v);
                    }
                }
                Node::Tuple(v) => work.extend(v.iter().filter_map(sole)),
                _ => {}
            }
            self.st.interner.forget(id);
            self.st.free.push(id);
        }
        self.st.release_work = work;
    }

    /// A second reference to a node now exists (DUP, or a copy fetched from the memo): it
    /// can no longer be dropped when its first container is done with it.
    fn share(&mut self, v: Val) {
        if let Val::Ref(id) = v
            && let Some(reach) = self.st.pickle.reach.get_mut(id as usize)
        {
            *reach = SHARED;
        }
    }

    /// Leaves node `id` referred to by its container alone, so that it can be dropped:
    /// its memo slot, if it still names it, now holds `to`. False when other references
    /// may exist (a DUP, a copy already fetched, a second memo slot): keep the node then.
    fn detach(&mut self, id: u32, to: u32) -> bool {
        match self.st.pickle.reach.get(id as usize) {
            Some(&i) if i != NOT_MEMOIZED && i != SHARED => {
                match self.st.memo.get_mut(i as usize) {
                    Some(slot) if *slot == id => {
                        *slot = to;
                        true
                    }
                    // The index was reused for something else: nothing refers to `id`.
                    _ => true,
                }
            }
            Some(&NOT_MEMOIZED) => true,
            _ => false,
        }
    }
    fn pop(&mut self, at: usize) -> Result<Val> {
        let floor = self.st.marks.last().copied().unwrap_or(0);
        if self.st.stack.len() <= floor {
            return Err(self.corrupt(at, "stack underflow"));
        }
        Ok(self.st.stack.pop().expect("checked above"))
    }
    fn top(&self, at: usize) -> Result<Val> {
        let floor = self.st.marks.last().copied().unwrap_or(0);
        if self.st.stack.len() <= floor {
            return Err(self.corrupt(at, "stack underflow"));
        }
        Ok(*self.st.stack.last().expect("checked above"))
    }
    /// APPEND/SETITEM: where the top `n` items start, with the container below them.
    fn top_items(&self, n: usize, at: usize) -> Result<usize> {
        let floor = self.st.marks.last().copied().unwrap_or(0);
        let len = self.st.stack.len();
        if len < floor + n + 1 {
            return Err(self.corrupt(at, "stack underflow"));
        }
        Ok(len - n)
    }
    /// APPENDS/SETITEMS: pops the mark; where its items start, with the container below.
    fn marked_items(&mut self, at: usize) -> Result<usize> {
        let m = self
            .st
            .marks
            .pop()
            .ok_or_else(|| self.corrupt(at, "no MARK before this opcode"))?;
        let floor = self.st.marks.last().copied().unwrap_or(0);
        if m <= floor {
            return Err(self.corrupt(at, "stack underflow"));
        }
        Ok(m)
    }
    fn pop_mark(&mut self, at: usize) -> Result<Vec<Val>> {
        let m = self
            .st
            .marks
            .pop()
            .ok_or_else(|| self.corrupt(at, "no MARK before this opcode"))?;
        Ok(self.st.stack.split_off(m))
    }
    fn memo_put(&mut self, index: u64, v: Val) {
        let len = self.st.memo.len() as u64;
        if let Val::Ref(id) = v
            && let Some(reach) = self.st.pickle.reach.get_mut(id as usize)
        {
            // Only a node remembered under one dense index can later be dropped and its
            // memo slot pointed at what it became.
            *reach = if *reach == NOT_MEMOIZED
                && index <= len
                && index < SHARED as u64
                && id < MEMO_STACK
            {
                index as u32
            } else {
                SHARED
            };
        }
        if index > len {
            self.st.memo_sparse.insert(index, v);
            return;
        }
        let slot = match v {
            Val::Ref(id) if id < MEMO_STACK => id,
            _ => {
                self.st.memo_side.push(v);
                // Each PUT is at least one input byte, so this index fits below 2^31 for
                // any file under 2 GiB; beyond that the dense encoding gives way to the map.
                let side = self.st.memo_side.len() - 1;
                match u32::try_from(side) {
                    Ok(i) if i < MEMO_GONE - MEMO_SIDE => MEMO_SIDE | i,
                    _ => {
                        self.st.memo_side.pop();
                        if index < len {
                            // Keep the index valid for the dense vector: nothing there.
                            self.st.memo[index as usize] = MEMO_UNSET;
                        }
                        self.st.memo_sparse.insert(index, v);
                        return;
                    }
                }
            }
        };
        if index < len {
            self.st.memo[index as usize] = slot;
        } else {
            self.st.memo.push(slot);
        }
    }
    fn memo_get(&self, index: u64, at: usize) -> Result<Val> {
        let v = match self.st.memo.get(index as usize).copied() {
            Some(MEMO_UNSET) | None => self.st.memo_sparse.get(&index).copied(),
            Some(MEMO_GONE) => {
                return Err(ReadError::NeedsFullRead {
                    why: "a trace entry is referred to a second time",
                });
            }
            Some(slot) if slot < MEMO_STACK => Some(Val::Ref(slot)),
            Some(MEMO_NO_STACK) => Some(Val::Stack(None)),
            Some(slot) if slot < MEMO_SIDE => Some(Val::Stack(Some(slot - MEMO_STACK))),
            Some(slot) => self.st.memo_side.get((slot & !MEMO_SIDE) as usize).copied(),
        };
        v.ok_or(ReadError::BadMemo { offset: at, index })
    }
    fn memo_len(&self) -> u64 {
        self.st.memo.len() as u64 + self.st.memo_sparse.len() as u64
    }

    fn string(&mut self, len: u64, what: &'static str, at: usize) -> Result<Val> {
        let b = self.take(len, what)?;
        let s = std::str::from_utf8(b).map_err(|e| self.corrupt(at, format!("{what}: {e}")))?;
        Ok(self.push_node(Node::Str(s.into())))
    }
    fn bytes(&mut self, len: u64, what: &'static str) -> Result<Val> {
        self.take(len, what)?;
        Ok(self.push_node(Node::Bytes(len as usize)))
    }
    fn long(&mut self, b: &[u8]) -> Val {
        // Little-endian two's complement. Up to 8 bytes: sign-extend. 9 bytes holding a
        // value below 2^64 (a u64 address ≥ 2^63 written by Python): keep the bit pattern.
        if b.is_empty() {
            return Val::Int(0);
        }
        if b.len() <= 8 {
            let mut v: u64 = 0;
            for (i, x) in b.iter().enumerate() {
                v |= (*x as u64) << (8 * i);
            }
            let shift = 64 - 8 * b.len() as u32;
            return Val::Int(((v << shift) as i64) >> shift);
        }
        let negative = b[b.len() - 1] & 0x80 != 0;
        if !negative && b[8..].iter().all(|&x| x == 0) {
            let mut v: u64 = 0;
            for (i, x) in b[..8].iter().enumerate() {
                v |= (*x as u64) << (8 * i);
            }
            return Val::Int(v as i64);
        }
        if negative && b[8..].iter().all(|&x| x == 0xff) && b[7] & 0x80 != 0 {
            let mut v: u64 = 0;
            for (i, x) in b[..8].iter().enumerate() {
                v |= (*x as u64) << (8 * i);
            }
            return Val::Int(v as i64);
        }
        self.push_node(Node::BigInt(b.into()))
    }
    fn text_int(&self, line: &[u8], at: usize) -> Result<Val> {
        let s = std::str::from_utf8(line).map_err(|_| self.corrupt(at, "INT: not ASCII"))?;
        let s = s.trim().trim_end_matches('L');
        match s {
            "00" => return Ok(Val::Bool(false)),
            "01" => return Ok(Val::Bool(true)),
            _ => {}
        }
        s.parse::<i64>()
            .map(Val::Int)
            .map_err(|_| self.corrupt(at, format!("INT/LONG: {s:?} is not a 64-bit integer")))
    }

    fn run(&mut self, progress: &mut dyn FnMut(usize)) -> Result<()> {
        if self.input.is_empty() && self.base == 0 && self.last {
            return Err(ReadError::Empty);
        }
        loop {
            if self.base + self.pos >= self.st.next_report {
                progress(self.base + self.pos);
                self.st.next_report = self.base + self.pos + PROGRESS_STEP;
            }
            let at = self.pos;
            self.op_start = at;
            let Some(&op) = self.input.get(self.pos) else {
                return Err(ReadError::NoStop { offset: at });
            };
            self.pos += 1;
            match op {
                0x80 => {
                    let v = self.u8("PROTO")?;
                    if v > 5 {
                        return Err(ReadError::Protocol {
                            offset: at,
                            version: v,
                        });
                    }
                    self.st.pickle.protocol = v;
                }
                0x95 => {
                    self.take(8, "FRAME")?;
                }
                b'.' => {
                    let v = self.pop(at)?;
                    self.st.pickle.root = Some(v);
                    progress(self.base + self.input.len());
                    return Ok(());
                }
                b'(' => self.st.marks.push(self.st.stack.len()),
                b'0' => {
                    // POP: pops the top item, or a bare MARK.
                    if self.st.marks.last() == Some(&self.st.stack.len()) {
                        self.st.marks.pop();
                    } else {
                        self.pop(at)?;
                    }
                }
                b'1' => {
                    self.pop_mark(at)?;
                }
                b'2' => {
                    let v = self.top(at)?;
                    self.share(v);
                    self.st.stack.push(v);
                }
                b'N' => self.st.stack.push(Val::None),
                0x88 => self.st.stack.push(Val::Bool(true)),
                0x89 => self.st.stack.push(Val::Bool(false)),
                b'J' => {
                    let v = self.le(4, "BININT")? as u32 as i32;
                    self.st.stack.push(Val::Int(v as i64));
                }
                b'K' => {
                    let v = self.u8("BININT1")?;
                    self.st.stack.push(Val::Int(v as i64));
                }
                b'M' => {
                    let v = self.le(2, "BININT2")?;
                    self.st.stack.push(Val::Int(v as i64));
                }
                0x8a => {
                    let n = self.u8("LONG1")? as u64;
                    let b = self.take(n, "LONG1")?;
                    let v = self.long(b);
                    self.st.stack.push(v);
                }
                0x8b => {
                    let n = self.le(4, "LONG4")? as u32 as i32;
                    if n < 0 {
                        return Err(self.corrupt(at, "LONG4 with a negative length"));
                    }
                    let b = self.take(n as u64, "LONG4")?;
                    let v = self.long(b);
                    self.st.stack.push(v);
                }
                b'I' | b'L' => {
                    let l = self.line("INT/LONG")?;
                    let v = self.text_int(l, at)?;
                    self.st.stack.push(v);
                }
                b'F' => {
                    let l = self.line("FLOAT")?;
                    let v = std::str::from_utf8(l)
                        .ok()
                        .and_then(|s| s.trim().parse::<f64>().ok())
                        .ok_or_else(|| self.corrupt(at, "FLOAT: not a number"))?;
                    self.st.stack.push(Val::Float(v));
                }
                b'G' => {
                    let b = self.take(8, "BINFLOAT")?;
                    let mut a = [0u8; 8];
                    a.copy_from_slice(b);
                    self.st.stack.push(Val::Float(f64::from_be_bytes(a)));
                }
                0x8c => {
                    let n = self.u8("SHORT_BINUNICODE")? as u64;
                    let v = self.string(n, "SHORT_BINUNICODE", at)?;
                    self.st.stack.push(v);
                }
                b'X' => {
                    let n = self.le(4, "BINUNICODE")?;
                    let v = self.string(n, "BINUNICODE", at)?;
                    self.st.stack.push(v);
                }
                0x8d => {
                    let n = self.le(8, "BINUNICODE8")?;
                    let v = self.string(n, "BINUNICODE8", at)?;
                    self.st.stack.push(v);
                }
                b'C' | b'U' => {
                    let n = self.u8("SHORT_BINBYTES")? as u64;
                    let v = self.bytes(n, "SHORT_BINBYTES")?;
                    self.st.stack.push(v);
                }
                b'B' | b'T' => {
                    let n = self.le(4, "BINBYTES")?;
                    let v = self.bytes(n, "BINBYTES")?;
                    self.st.stack.push(v);
                }
                0x8e | 0x96 => {
                    let n = self.le(8, "BINBYTES8")?;
                    let v = self.bytes(n, "BINBYTES8")?;
                    self.st.stack.push(v);
                }
                b'}' => {
                    let v = self.push_node(Node::Dict(Vec::new()));
                    self.st.stack.push(v);
                }
                b']' => {
                    let v = self.push_node(Node::List(Vec::new()));
                    self.st.stack.push(v);
                }
                b')' => {
                    let v = self.push_node(Node::Tuple(Vec::new()));
                    self.st.stack.push(v);
                }
                b'd' => {
                    let items = self.pop_mark(at)?;
                    if items.len() % 2 != 0 {
                        return Err(self.corrupt(at, "DICT with an odd number of items"));
                    }
                    let pairs = items.chunks_exact(2).map(|c| (c[0], c[1])).collect();
                    let v = self.push_node(Node::Dict(pairs));
                    self.st.stack.push(v);
                }
                b'l' => {
                    let items = self.pop_mark(at)?;
                    let v = self.push_node(Node::List(items));
                    self.st.stack.push(v);
                }
                b't' => {
                    let items = self.pop_mark(at)?;
                    let v = self.push_node(Node::Tuple(items));
                    self.st.stack.push(v);
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    let floor = self.st.marks.last().copied().unwrap_or(0);
                    if self.st.stack.len() < floor + n {
                        return Err(self.corrupt(at, "stack underflow in TUPLE1/2/3"));
                    }
                    let items = self.st.stack.split_off(self.st.stack.len() - n);
                    let v = self.push_node(Node::Tuple(items));
                    self.st.stack.push(v);
                }
                b'a' => {
                    let from = self.top_items(1, at)?;
                    self.append(self.st.stack[from - 1], from, at)?;
                }
                b'e' => {
                    let from = self.marked_items(at)?;
                    self.append(self.st.stack[from - 1], from, at)?;
                }
                b's' => {
                    let from = self.top_items(2, at)?;
                    self.set_items(self.st.stack[from - 1], from, at)?;
                }
                b'u' => {
                    let from = self.marked_items(at)?;
                    if !(self.st.stack.len() - from).is_multiple_of(2) {
                        return Err(self.corrupt(at, "SETITEMS with an odd number of items"));
                    }
                    self.set_items(self.st.stack[from - 1], from, at)?;
                }
                b'q' => {
                    let i = self.u8("BINPUT")? as u64;
                    let v = self.top(at)?;
                    self.memo_put(i, v);
                }
                b'r' => {
                    let i = self.le(4, "LONG_BINPUT")?;
                    let v = self.top(at)?;
                    self.memo_put(i, v);
                }
                0x94 => {
                    let v = self.top(at)?;
                    let i = self.memo_len();
                    self.memo_put(i, v);
                }
                b'p' => {
                    let l = self.line("PUT")?;
                    let i = parse_index(l).ok_or_else(|| self.corrupt(at, "PUT: bad index"))?;
                    let v = self.top(at)?;
                    self.memo_put(i, v);
                }
                b'h' => {
                    let i = self.u8("BINGET")? as u64;
                    let v = self.memo_get(i, at)?;
                    self.share(v);
                    self.st.stack.push(v);
                }
                b'j' => {
                    let i = self.le(4, "LONG_BINGET")?;
                    let v = self.memo_get(i, at)?;
                    self.share(v);
                    self.st.stack.push(v);
                }
                b'g' => {
                    let l = self.line("GET")?;
                    let i = parse_index(l).ok_or_else(|| self.corrupt(at, "GET: bad index"))?;
                    let v = self.memo_get(i, at)?;
                    self.share(v);
                    self.st.stack.push(v);
                }
                _ => {
                    let name = match op {
                        b'c' => "GLOBAL",
                        0x93 => "STACK_GLOBAL",
                        b'R' => "REDUCE",
                        b'b' => "BUILD",
                        b'i' => "INST",
                        b'o' => "OBJ",
                        0x81 => "NEWOBJ",
                        0x92 => "NEWOBJ_EX",
                        b'P' => "PERSID",
                        b'Q' => "BINPERSID",
                        0x82..=0x84 => "EXT1/EXT2/EXT4",
                        0x97 => "NEXT_BUFFER",
                        0x98 => "READONLY_BUFFER",
                        0x8f..=0x91 => "EMPTY_SET/ADDITEMS/FROZENSET",
                        b'S' | b'V' => "STRING/UNICODE (text)",
                        _ => {
                            return Err(ReadError::UnknownOpcode {
                                offset: at,
                                opcode: op,
                            });
                        }
                    };
                    return Err(ReadError::Forbidden { offset: at, name });
                }
            }
        }
    }

    /// Moves the items `stack[from..]` into `list`.
    fn append(&mut self, list: Val, from: usize, at: usize) -> Result<()> {
        let idx = match list {
            Val::Ref(i) => i,
            _ => return Err(self.corrupt(at, "APPEND(S) to something that is not a list")),
        };
        if self.st.mode != Mode::Plain {
            for i in from..self.st.stack.len() {
                if let Some(n) = self.maybe_convert_event(self.st.stack[i], idx, at)? {
                    self.st.stack[i] = Val::Event(n);
                }
            }
        }
        let items = &self.st.stack[from..];
        // Entries numbered `start..start + items.len()`, when the items are exactly that.
        let run_from = |start: u32| {
            items
                .iter()
                .enumerate()
                .all(|(i, v)| matches!(v, Val::Event(n) if Some(*n) == start.checked_add(i as u32)))
        };
        let node = self.st.pickle.nodes.get_mut(idx as usize);
        match node {
            Some(Node::List(v)) if v.is_empty() => match items.first() {
                Some(&Val::Event(first)) if run_from(first) => {
                    let len = items.len() as u32;
                    *node.expect("matched") = Node::EventRun { first, len };
                }
                _ => {
                    if v.capacity() == 0
                        && let Some(spare) = self.st.spare_lists.pop()
                    {
                        *v = spare;
                    }
                    v.extend_from_slice(items);
                }
            },
            Some(Node::List(v)) => v.extend_from_slice(items),
            Some(Node::EventRun { first, len }) => {
                let next = first.checked_add(*len);
                match next {
                    Some(next)
                        if run_from(next) && len.checked_add(items.len() as u32).is_some() =>
                    {
                        *len += items.len() as u32;
                    }
                    _ => {
                        // Anything else appended: back to a plain list of values.
                        let mut v: Vec<Val> = (*first..first.saturating_add(*len))
                            .map(Val::Event)
                            .collect();
                        v.extend_from_slice(items);
                        *node.expect("matched") = Node::List(v);
                    }
                }
            }
            _ => return Err(self.corrupt(at, "APPEND(S) to something that is not a list")),
        }
        self.st.stack.truncate(from);
        Ok(())
    }

    /// Moves the key/value pairs `stack[from..]` into `dict`.
    fn set_items(&mut self, dict: Val, from: usize, at: usize) -> Result<()> {
        let idx = match dict {
            Val::Ref(i) => i as usize,
            _ => return Err(self.corrupt(at, "SETITEM(S) on something that is not a dict")),
        };
        match self.st.pickle.nodes.get_mut(idx) {
            Some(Node::Dict(d)) => {
                if d.capacity() == 0
                    && let Some(spare) = self.st.spare_dicts.pop()
                {
                    *d = spare;
                }
                d.extend(self.st.stack[from..].chunks_exact(2).map(|c| (c[0], c[1])));
                self.st.stack.truncate(from);
                Ok(())
            }
            _ => Err(self.corrupt(at, "SETITEM(S) on something that is not a dict")),
        }
    }

    /// A dict with an `action` string that is appended to a list is a trace entry: convert
    /// it now and drop the dict and the frame lists it used (snapshot modes only).
    fn maybe_convert_event(&mut self, item: Val, list: u32, at: usize) -> Result<Option<u32>> {
        let Val::Ref(id) = item else { return Ok(None) };
        let is_event = match self.st.pickle.nodes.get(id as usize) {
            // A frame dict already interned (the items of a fresh frame list): not an entry.
            Some(Node::Dict(_))
                if self
                    .st
                    .interner
                    .frame_of_node
                    .get(id as usize)
                    .is_some_and(|&f| f != NO_FRAME) =>
            {
                false
            }
            Some(Node::Dict(d)) => d.iter().any(|&(k, v)| {
                self.st.interner.key(&self.st.pickle, k) == EntryKey::Action
                    && self.st.pickle.str(v).is_some()
            }),
            Some(Node::Event(_)) if self.st.mode == Mode::Stream => {
                return Err(ReadError::NeedsFullRead {
                    why: "a trace entry is appended a second time",
                });
            }
            _ => false,
        };
        if !is_event {
            return Ok(None);
        }
        let entry = event_from_dict(&self.st.pickle, &mut self.st.interner, item)
            .map_err(|msg| self.corrupt(at, format!("trace entry: {msg}")))?;
        let n = self.st.converted;
        self.st.converted = n
            .checked_add(1)
            .ok_or_else(|| self.corrupt(at, "more than 2^32 trace entries"))?;
        match self.st.mode {
            Mode::Stream => self.st.streamed.push((list, entry)),
            _ => self.st.events.push(entry),
        }
        // Frame lists first: the dict below may be their only container.
        let mut pending = self.st.interner.collapse.take().unwrap_or_default();
        for &(list, stack) in &pending {
            self.collapse_stack(list, stack);
        }
        pending.clear();
        self.st.interner.collapse = Some(pending);
        if self.st.mode == Mode::Stream && self.detach(id, MEMO_GONE) {
            self.release(id);
        } else {
            // Keep mode: the memo may name this entry again (a shared entry is copied).
            self.st.pickle.nodes[id as usize] = Node::Event(n);
        }
        Ok(Some(n))
    }

    /// A frame list just interned as `stack`: the memo remembers the stack instead and the
    /// list is dropped, unless it is shared in a way the memo slot cannot express.
    fn collapse_stack(&mut self, list: u32, stack: Option<StackId>) {
        let code = match stack {
            None => Some(MEMO_NO_STACK),
            Some(s) => s.checked_add(MEMO_STACK).filter(|&c| c < MEMO_NO_STACK),
        };
        match code {
            Some(code) if self.detach(list, code) => self.release(list),
            _ => self.st.pickle.nodes[list as usize] = Node::Stack(stack),
        }
    }
}

fn parse_index(l: &[u8]) -> Option<u64> {
    std::str::from_utf8(l).ok()?.trim().parse().ok()
}

// ---------------------------------------------------------------------------------------
// Conversion to the model.

/// The keys of a trace-entry dict the reader looks at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum EntryKey {
    /// Not yet looked at (cache slot only).
    Unknown,
    Other,
    Action,
    Addr,
    Size,
    Stream,
    TimeUs,
    DeviceFree,
    Frames,
    UserMetadata,
}

/// The actions remembered by node in [`Interner::action_of_node`].
const ACTIONS: [Action; 10] = [
    Action::Alloc,
    Action::FreeRequested,
    Action::FreeCompleted,
    Action::Free,
    Action::SegmentAlloc,
    Action::SegmentFree,
    Action::SegmentMap,
    Action::SegmentUnmap,
    Action::Snapshot,
    Action::Oom,
];

/// Slot of [`Interner::frame_of_node`] with no frame.
const NO_FRAME: u32 = u32::MAX;

/// Frames and stacks, interned by node identity first (PyTorch shares them through the
/// memo) and by value second (files that repeat them).
///
/// The by-node caches are vectors indexed by node, not hash maps: they are consulted for
/// every key of every entry and every frame of every fresh frame list, and the arena stays
/// small because converted nodes are reused. A reused slot is forgotten ([`Self::forget`]).
#[derive(Default)]
struct Interner {
    frames: Vec<Frame>,
    frame_by_value: FxHashMap<Frame, u32>,
    /// Frame of a frame dict, by node ([`NO_FRAME`]: unknown); only nodes that may recur.
    frame_of_node: Vec<u32>,
    /// What a string node says as a dict key, by node; only nodes that may recur.
    key_of_node: Vec<EntryKey>,
    /// A string node as an `action` value: 1 + its index in [`ACTIONS`] (0: not known).
    action_of_node: Vec<u8>,
    /// A string node as a `user_metadata` value: its index in `meta_list` + 1 (0: not known).
    meta_of_node: Vec<u32>,
    meta_list: Vec<Arc<str>>,
    /// Every stack's frame ids back to back: stack `s` is
    /// `stack_frames[stack_start[s]..stack_start[s + 1]]`. One block instead of a vector
    /// per stack keeps the comparisons of by-value lookups in few cache lines.
    stack_frames: Vec<u32>,
    stack_start: Vec<usize>,
    /// Stacks by the hash of their frame ids. Exact: a hit is compared in full, and the
    /// rare stack whose hash is taken by another goes to `stack_collided`.
    stack_by_hash: FxHashMap<u64, StackId>,
    stack_collided: FxHashMap<Vec<u32>, StackId>,
    /// After parsing only (nothing is dropped then): lists already interned.
    stack_by_node: FxHashMap<u32, Option<StackId>>,
    /// Frame ids of the list being interned.
    scratch: Vec<u32>,
    /// Distinct `user_metadata` values, shared by every entry that has them.
    metas: FxHashSet<Arc<str>>,
    /// While parsing: lists just interned, for the machine to collapse into `Node::Stack`.
    collapse: Option<Vec<(u32, Option<StackId>)>>,
}

impl Interner {
    fn meta(&mut self, s: &str) -> Arc<str> {
        if let Some(m) = self.metas.get(s) {
            return m.clone();
        }
        let m: Arc<str> = s.into();
        self.metas.insert(m.clone());
        m
    }

    /// A node slot was given back: whatever was known about it no longer holds.
    fn forget(&mut self, id: u32) {
        if let Some(f) = self.frame_of_node.get_mut(id as usize) {
            *f = NO_FRAME;
        }
        if let Some(k) = self.key_of_node.get_mut(id as usize) {
            *k = EntryKey::Unknown;
        }
        if let Some(a) = self.action_of_node.get_mut(id as usize) {
            *a = 0;
        }
        if let Some(m) = self.meta_of_node.get_mut(id as usize) {
            *m = 0;
        }
    }

    /// The `action` a string value names (remembered by node: a file has a handful).
    fn action(&mut self, p: &Pickle, v: Val) -> Option<Action> {
        let Val::Ref(id) = v else { return None };
        let i = id as usize;
        if let Some(&a) = self.action_of_node.get(i)
            && a != 0
        {
            return Some(ACTIONS[a as usize - 1].clone());
        }
        let action = Action::parse(p.str(v)?);
        if p.may_recur(id)
            && let Some(known) = ACTIONS.iter().position(|a| *a == action)
        {
            if self.action_of_node.len() <= i {
                self.action_of_node.resize(i + 1, 0);
            }
            self.action_of_node[i] = known as u8 + 1;
        }
        Some(action)
    }

    /// A `user_metadata` string, shared (`None` when empty).
    fn meta_str(&mut self, p: &Pickle, v: Val) -> Option<Arc<str>> {
        let Val::Ref(id) = v else { return None };
        let i = id as usize;
        if let Some(&m) = self.meta_of_node.get(i)
            && m != 0
        {
            return Some(self.meta_list[m as usize - 1].clone());
        }
        let s = p.str(v).filter(|s| !s.is_empty())?;
        let m = self.meta(s);
        if p.may_recur(id) {
            if self.meta_of_node.len() <= i {
                self.meta_of_node.resize(i + 1, 0);
            }
            self.meta_list.push(m.clone());
            self.meta_of_node[i] = self.meta_list.len() as u32;
        }
        Some(m)
    }

    fn key(&mut self, p: &Pickle, k: Val) -> EntryKey {
        let Val::Ref(id) = k else {
            return EntryKey::Other;
        };
        if let Some(&key) = self.key_of_node.get(id as usize)
            && key != EntryKey::Unknown
        {
            return key;
        }
        let key = match p.str(k) {
            Some("action") => EntryKey::Action,
            Some("addr") => EntryKey::Addr,
            Some("size") => EntryKey::Size,
            Some("stream") => EntryKey::Stream,
            Some("time_us") => EntryKey::TimeUs,
            Some("device_free") => EntryKey::DeviceFree,
            Some("frames") => EntryKey::Frames,
            Some("user_metadata") => EntryKey::UserMetadata,
            _ => EntryKey::Other,
        };
        if p.may_recur(id) {
            let i = id as usize;
            if self.key_of_node.len() <= i {
                self.key_of_node.resize(i + 1, EntryKey::Unknown);
            }
            self.key_of_node[i] = key;
        }
        key
    }

    fn frame(&mut self, p: &Pickle, v: Val) -> u32 {
        if let Val::Ref(id) = v
            && let Some(&f) = self.frame_of_node.get(id as usize)
            && f != NO_FRAME
        {
            return f;
        }
        let frame = match p.node(v) {
            Some(Node::Dict(_)) => Frame {
                name: p
                    .get(v, "name")
                    .and_then(|x| p.str(x))
                    .unwrap_or("??")
                    .to_string(),
                filename: p
                    .get(v, "filename")
                    .and_then(|x| p.str(x))
                    .unwrap_or("??")
                    .to_string(),
                line: match p.get(v, "line") {
                    Some(Val::Int(l)) => l,
                    _ => 0,
                },
            },
            // `forward_frames`-style plain strings, or anything else: keep it readable.
            Some(Node::Str(s)) => Frame {
                name: s.to_string(),
                filename: String::new(),
                line: 0,
            },
            _ => Frame {
                name: "??".into(),
                filename: "??".into(),
                line: 0,
            },
        };
        let next = self.frames.len() as u32;
        let f = *self.frame_by_value.entry(frame.clone()).or_insert(next);
        if f == next {
            self.frames.push(frame);
        }
        // A frame dict never memoized cannot be seen again, and its slot may be reused.
        if let Val::Ref(id) = v
            && p.may_recur(id)
        {
            let i = id as usize;
            if self.frame_of_node.len() <= i {
                self.frame_of_node.resize(i + 1, NO_FRAME);
            }
            self.frame_of_node[i] = f;
        }
        f
    }

    fn stack_ids(&self, s: StackId) -> &[u32] {
        let s = s as usize;
        &self.stack_frames[self.stack_start[s]..self.stack_start[s + 1]]
    }

    /// The stack made of `self.scratch`, added if new.
    fn intern_scratch(&mut self) -> StackId {
        if self.stack_start.is_empty() {
            self.stack_start.push(0);
        }
        let hash = std::hash::BuildHasher::hash_one(&rustc_hash::FxBuildHasher, &self.scratch);
        let taken = match self.stack_by_hash.get(&hash) {
            Some(&s) if self.stack_ids(s) == self.scratch.as_slice() => return s,
            Some(_) => {
                if let Some(&s) = self.stack_collided.get(&self.scratch) {
                    return s;
                }
                true
            }
            None => false,
        };
        let next = (self.stack_start.len() - 1) as StackId;
        self.stack_frames.extend_from_slice(&self.scratch);
        self.stack_start.push(self.stack_frames.len());
        if taken {
            self.stack_collided.insert(self.scratch.clone(), next);
        } else {
            self.stack_by_hash.insert(hash, next);
        }
        next
    }

    /// `None` for a missing or empty frame list.
    fn stack(&mut self, p: &Pickle, v: Option<Val>) -> Option<StackId> {
        let v = v?;
        if let Val::Stack(s) = v {
            return s;
        }
        let Val::Ref(id) = v else { return None };
        if let Some(Node::Stack(s)) = p.node(v) {
            return *s;
        }
        if let Some(&s) = self.stack_by_node.get(&id) {
            return s;
        }
        let items = p.items(v).unwrap_or_default();
        let mut ids = std::mem::take(&mut self.scratch);
        ids.clear();
        ids.extend(items.iter().map(|&f| self.frame(p, f)));
        self.scratch = ids;
        let s = (!self.scratch.is_empty()).then(|| self.intern_scratch());
        match &mut self.collapse {
            Some(pending) if matches!(p.node(v), Some(Node::List(_))) => pending.push((id, s)),
            _ => {
                self.stack_by_node.insert(id, s);
            }
        }
        s
    }

    /// The stacks as the model stores them.
    fn into_stacks(self) -> (Vec<Frame>, Vec<Vec<u32>>) {
        let stacks = self
            .stack_start
            .windows(2)
            .map(|w| self.stack_frames[w[0]..w[1]].to_vec())
            .collect();
        (self.frames, stacks)
    }
}

fn int_of(v: Option<Val>) -> Option<i64> {
    match v? {
        Val::Int(i) => Some(i),
        Val::Bool(b) => Some(b as i64),
        _ => None,
    }
}

/// Converts one trace-entry dict. Tolerates missing keys (PyTorch omits `addr` on `oom`).
fn event_from_dict(
    p: &Pickle,
    interner: &mut Interner,
    v: Val,
) -> std::result::Result<TraceEntry, String> {
    let d = p.dict(v).ok_or("not a dict")?;
    let mut e = TraceEntry {
        action: Action::Other(String::new()),
        addr: 0,
        size: 0,
        stream: 0,
        time_us: 0,
        stack: None,
        device_free: None,
        user_metadata: None,
    };
    let mut frames = None;
    let mut has_action = false;
    for &(k, val) in d {
        match interner.key(p, k) {
            EntryKey::Action => {
                e.action = interner.action(p, val).ok_or("`action` is not a string")?;
                has_action = true;
            }
            EntryKey::Addr => e.addr = int_of(Some(val)).ok_or("`addr` is not an integer")?,
            EntryKey::Size => e.size = int_of(Some(val)).ok_or("`size` is not an integer")?,
            EntryKey::Stream => e.stream = int_of(Some(val)).unwrap_or(0),
            EntryKey::TimeUs => e.time_us = int_of(Some(val)).unwrap_or(0),
            EntryKey::DeviceFree => e.device_free = int_of(Some(val)),
            EntryKey::Frames => frames = Some(val),
            EntryKey::UserMetadata => {
                e.user_metadata = match p.node(val) {
                    Some(Node::Str(_)) => interner.meta_str(p, val),
                    Some(Node::Dict(kv)) if !kv.is_empty() => Some(
                        interner.meta(
                            &kv.iter()
                                .map(|(k, v)| {
                                    format!(
                                        "{}: {}",
                                        p.str(*k).unwrap_or("?"),
                                        p.str(*v)
                                            .map(str::to_string)
                                            .or_else(|| int_of(Some(*v)).map(|i| i.to_string()))
                                            .unwrap_or_else(|| "?".into())
                                    )
                                })
                                .collect::<Vec<_>>()
                                .join(", "),
                        ),
                    ),
                    _ => None,
                }
            }
            _ => {}
        }
    }
    if !has_action {
        return Err("no `action`".into());
    }
    e.stack = interner.stack(p, frames);
    Ok(e)
}

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

impl Converter<'_> {
    fn snapshot(&mut self, root: Val) -> Result<Snapshot> {
        let p = self.p;
        let mut snap = Snapshot::default();
        let segments_val;
        match p.node(root) {
            Some(Node::Dict(_)) => {
                segments_val = p.get(root, "segments");
                if segments_val.is_none() && p.get(root, "device_traces").is_none() {
                    return Err(shape(
                        "top level",
                        "a dict without `segments` or `device_traces`",
                    ));
                }
            }
            // Legacy form: the top level is the segment list.
            Some(Node::List(_)) => segments_val = Some(root),
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
                            None => self
                                .event(e)
                                .map_err(|m| shape(format!("device_traces[{d}][{i}]"), m))?,
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
        }
        self.events = Vec::new();
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
            let placeholder = TraceEntry {
                action: Action::Oom,
                addr: 0,
                size: 0,
                stream: 0,
                time_us: 0,
                stack: None,
                device_free: None,
                user_metadata: None,
            };
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
            .and_then(|v| p.items(v))
            .unwrap_or_default();
        let segment_pool_id = (
            int_of(pool.first().copied()).unwrap_or(0),
            int_of(pool.get(1).copied()).unwrap_or(0),
        );
        let stack = self.interner.stack(p, p.get(s, "frames"));
        let mut blocks = Vec::new();
        if let Some(bv) = p.get(s, "blocks") {
            let list = p
                .items(bv)
                .ok_or_else(|| shape(format!("{path}.blocks"), "not a list"))?;
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
                        .and_then(|h| p.items(h))
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
            }
        }
        Ok(Segment {
            device: int_of(p.get(s, "device")).unwrap_or(0),
            address,
            total_size,
            stream: int_of(p.get(s, "stream")).unwrap_or(0),
            segment_type: p
                .get(s, "segment_type")
                .and_then(|v| p.str(v))
                .unwrap_or("large")
                .to_string(),
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

    /// `None` for values with no JSON-like form (None, bytes, huge ints): they are skipped.
    fn meta(&self, v: Val, depth: usize, path: &str) -> Result<Option<Meta>> {
        if depth > META_DEPTH {
            return Err(shape(path, "nested too deeply"));
        }
        let p = self.p;
        Ok(match v {
            Val::None => None,
            Val::Bool(b) => Some(Meta::Bool(b)),
            Val::Int(i) => Some(Meta::Int(i)),
            Val::Float(f) => Some(Meta::Float(f)),
            Val::Event(_) | Val::Stack(_) => None,
            Val::Ref(_) => match p.node(v) {
                Some(Node::Str(s)) => Some(Meta::Str(s.to_string())),
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
                            (Some(s), _) => s.to_string(),
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
    use super::*;

    const FIXTURES: &[&str] = &[
        "torch-python-stacks.pickle",
        "torch-expandable-segments.pickle",
        "torch-oom.pickle",
        "torch-leak-step3.pickle",
        "torch-leak-step11.pickle",
        "torch-transformer-all-stacks.pickle",
    ];

    /// The repository's tests/fixtures/torch (this crate lives in crates/format).
    fn fixture_dir() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/torch")
    }

    fn fixture(name: &str) -> Vec<u8> {
        let path = fixture_dir().join(name);
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// What Python's pickle.load found in a fixture: tests/fixtures/torch/fixtures.json,
    /// written with the files by scripts/gpu/make_fixtures.py.
    fn counts(name: &str) -> serde_json::Value {
        let path = fixture_dir().join("fixtures.json");
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let c = v["files"][name].clone();
        assert!(c.is_object(), "fixtures.json: no entry for {name}");
        c
    }

    /// The line number of scripts/gpu/make_fixtures.py that ends in
    /// `# FIXTURE-ANCHOR: {name}` (the fixtures' frames name the script by that path).
    fn anchor_line(name: &str) -> i64 {
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../scripts/gpu/make_fixtures.py");
        let text = std::fs::read_to_string(&script).unwrap();
        let marker = format!("# FIXTURE-ANCHOR: {name}");
        let lines: Vec<usize> = text
            .lines()
            .enumerate()
            .filter(|(_, l)| l.ends_with(&marker))
            .map(|(i, _)| i + 1)
            .collect();
        assert_eq!(lines.len(), 1, "`{marker}` on {} lines", lines.len());
        lines[0] as i64
    }

    fn count(s: &Snapshot, a: &str) -> usize {
        s.device_traces
            .iter()
            .flatten()
            .filter(|e| e.action.as_str() == a)
            .count()
    }

    #[test]
    fn chunked_reading_gives_the_same_snapshot_and_errors_as_whole_file_reading() {
        // Chunk sizes that cut opcodes, strings and lines at every kind of place.
        for name in FIXTURES {
            let bytes = fixture(name);
            let whole = read_snapshot(&bytes).unwrap();
            for chunk in [1, 7, 4096] {
                let mut done = 0;
                let s = read_chunked(&mut &bytes[..], chunk, &mut |d| done = d, None)
                    .unwrap()
                    .snapshot;
                assert_eq!(s, whole, "{name} in chunks of {chunk}");
                assert_eq!(done, bytes.len(), "{name}: progress reaches the end");
            }
            // A file cut short fails at the same byte with the same error either way.
            let cut = &bytes[..bytes.len() * 2 / 3];
            let expected = read_snapshot_from(&mut &cut[..], &mut |_| {}).unwrap_err();
            let whole_err = Machine::new(cut, Mode::Keep).run(&mut |_| {}).unwrap_err();
            assert_eq!(expected, whole_err, "{name} cut");
            for chunk in [1, 13] {
                let e = read_chunked(&mut &cut[..], chunk, &mut |_| {}, None).unwrap_err();
                assert_eq!(e, whole_err, "{name} cut, chunks of {chunk}");
            }
        }
    }

    #[test]
    fn reads_every_fixture_with_the_counts_python_reports() {
        // Counts from `pickle.load` on the same files (tests/fixtures/torch/fixtures.json).
        for name in FIXTURES {
            let s = read_snapshot(&fixture(name)).unwrap();
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

        let s = read_snapshot(&fixture("torch-python-stacks.pickle")).unwrap();
        assert_eq!(s.device_traces.len(), 1);
        assert_eq!(
            s.allocator_settings
                .iter()
                .find(|(k, _)| k == "max_split_size")
                .map(|(_, v)| v),
            Some(&Meta::Int(-1))
        );

        let s = read_snapshot(&fixture("torch-transformer-all-stacks.pickle")).unwrap();
        // Shared frame lists stay shared: far fewer stacks than events.
        assert!(
            s.stacks.len() < s.device_traces[0].len() / 4,
            "{} stacks for {} events",
            s.stacks.len(),
            s.device_traces[0].len()
        );

        let s = read_snapshot(&fixture("torch-oom.pickle")).unwrap();
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

        let s = read_snapshot(&fixture("torch-expandable-segments.pickle")).unwrap();
        assert!(s.segments.iter().all(|g| g.is_expandable));
        assert!(count(&s, "segment_map") >= 4);
        assert!(count(&s, "segment_unmap") >= 1);
    }

    #[test]
    fn blocks_tile_their_segments_in_fixtures() {
        for f in FIXTURES {
            let s = read_snapshot(&fixture(f)).unwrap();
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
        let key = |b: &mut Vec<u8>, s: &str| {
            b.push(b'X');
            b.extend_from_slice(&(s.len() as u32).to_le_bytes());
            b.extend_from_slice(s.as_bytes());
        };
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
        let s = read_snapshot(&b).unwrap();
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
        let s = read_snapshot(&b).unwrap();
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
        let s = read_snapshot(&b).unwrap();
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
        let s = read_snapshot(&b).unwrap();
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

        // Legacy top-level list: segments only.
        let b = [0x80, 2, b']', b'.'];
        let s = read_snapshot(&b).unwrap();
        assert!(s.segments.is_empty() && s.device_traces.is_empty());
    }

    #[test]
    fn hostile_inputs_end_in_typed_errors() {
        assert_eq!(read_snapshot(b""), Err(ReadError::Empty));
        assert!(matches!(
            read_snapshot(b"hello world\n"),
            Err(ReadError::NotPickle { .. })
        ));
        assert!(matches!(
            parse(b"xyz"),
            Err(ReadError::UnknownOpcode {
                offset: 0,
                opcode: b'x'
            })
        ));
        // Huge declared length: no allocation, a truncation error.
        assert!(matches!(
            read_snapshot(&[
                0x80, 4, 0x8d, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f
            ]),
            Err(ReadError::Truncated { offset: 11, .. })
        ));
        assert!(matches!(
            read_snapshot(&[0x80, 4, b'h', 9, b'.']),
            Err(ReadError::BadMemo {
                offset: 2,
                index: 9
            })
        ));
        assert!(matches!(
            read_snapshot(b"\x80\x04cos\nsystem\n."),
            Err(ReadError::Forbidden {
                offset: 2,
                name: "GLOBAL"
            })
        ));
        assert!(matches!(
            read_snapshot(&[0x80, 9]),
            Err(ReadError::Protocol { version: 9, .. })
        ));
        assert!(matches!(
            read_snapshot(&[0x80, 4, b'a']),
            Err(ReadError::Corrupt { offset: 2, .. })
        ));
        assert!(matches!(
            read_snapshot(&[0x80, 4, b']']),
            Err(ReadError::NoStop { offset: 3 })
        ));
        // Deep nesting: 100k nested lists are built without recursion; the snapshot
        // conversion then rejects the shape.
        let mut deep = vec![0x80, 4];
        deep.extend(std::iter::repeat_n(b']', 100_000));
        deep.extend(std::iter::repeat_n(b'a', 99_999));
        deep.push(b'.');
        assert!(matches!(read_snapshot(&deep), Err(ReadError::Shape { .. })));
        assert!(parse(&deep).is_ok());
        // A list that contains itself, inside metadata: the depth cap ends it.
        let mut cyc = vec![0x80, 4, b'}', b'('];
        for k in ["segments", "device_traces", "memsnap"] {
            cyc.push(0x8c);
            cyc.push(k.len() as u8);
            cyc.extend_from_slice(k.as_bytes());
            if k == "memsnap" {
                cyc.extend_from_slice(&[b']', b'q', 7, b'h', 7, b'a']);
            } else {
                cyc.push(b']');
            }
        }
        cyc.extend_from_slice(b"u.");
        let r = read_snapshot(&cyc);
        assert!(matches!(r, Err(ReadError::Shape { .. })), "{r:?}");
        // Truncation at every prefix of a real file ends in an error, never a panic.
        let f = fixture("torch-oom.pickle");
        for n in 0..f.len() - 1 {
            assert!(read_snapshot(&f[..n]).is_err(), "prefix {n}");
        }
    }

    /// Reads `bytes` with [`stream_snapshot_from`] in chunks of `chunk` and puts the
    /// handed-out entries back into their devices' lists, to compare with a full read.
    fn streamed(bytes: &[u8], chunk: usize) -> Result<Snapshot> {
        let mut got: Vec<(u32, TraceEntry)> = Vec::new();
        let mut done = 0;
        let s = read_chunked(
            &mut &bytes[..],
            chunk,
            &mut |d| done = d,
            Some(&mut |list, e| got.push((list, e))),
        )?;
        assert_eq!(done, bytes.len(), "progress reaches the end");
        let mut snap = s.snapshot;
        assert_eq!(snap.device_traces.len(), s.trace_lists.len());
        assert!(snap.device_traces.iter().all(Vec::is_empty));
        for (d, list) in s.trace_lists.iter().enumerate() {
            snap.device_traces[d] = got
                .iter()
                .filter(|(l, _)| l == list)
                .map(|(_, e)| e.clone())
                .collect();
        }
        Ok(snap)
    }

    #[test]
    fn streaming_hands_out_every_entry_of_every_fixture_in_order() {
        for name in FIXTURES {
            let bytes = fixture(name);
            let whole = read_snapshot(&bytes).unwrap();
            for chunk in [1, 7, 4096, READ_CHUNK] {
                assert_eq!(
                    streamed(&bytes, chunk).unwrap(),
                    whole,
                    "{name}, chunks of {chunk}"
                );
            }
            let cut = &bytes[..bytes.len() / 2];
            assert_eq!(
                streamed(cut, 13).unwrap_err(),
                read_snapshot(cut).unwrap_err(),
                "{name} cut"
            );
        }
    }

    /// memsnap's own file with a long history: streaming keeps the arena at one batch of
    /// entries' worth of nodes (converted dicts and frame lists are reused) however long
    /// the history, where keeping the entries needs a node per entry.
    #[test]
    fn streaming_memory_does_not_grow_with_the_history() {
        use crate::model::{Block, Segment};
        let file = |events: i64| {
            let frame = |i: i64| Frame {
                name: format!("f{i}"),
                filename: "/app/train.py".into(),
                line: i,
            };
            let mut snap = Snapshot {
                frames: (0..40).map(frame).collect(),
                stacks: (0..30u32).map(|s| (s..s + 10).collect()).collect(),
                ..Snapshot::default()
            };
            let trace = (0..events)
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
                    stack: Some((i % 30) as u32),
                    device_free: None,
                    user_metadata: Some("cudaMalloc".into()),
                })
                .collect();
            snap.device_traces = vec![trace];
            snap.segments = vec![Segment {
                device: 0,
                address: 0x1000,
                total_size: 512,
                stream: 0,
                segment_type: "large".into(),
                segment_pool_id: (0, 0),
                is_expandable: false,
                stack: Some(3),
                blocks: vec![Block {
                    address: 0x1000,
                    size: 512,
                    requested_size: 512,
                    state: BlockState::ActiveAllocated,
                    stack: Some(3),
                }],
            }];
            let bytes = crate::pickle_write::to_bytes(&snap);
            let whole = read_snapshot(&bytes).unwrap();
            assert_eq!(whole.device_traces, snap.device_traces);
            assert_eq!(streamed(&bytes, 4096).unwrap(), whole);
            bytes
        };
        let nodes_after = |bytes: &[u8], mode| {
            let mut m = Machine::new(bytes, mode);
            m.run(&mut |_| {}).unwrap();
            m.st.pickle.nodes.len()
        };
        let (short, long) = (file(10_000), file(40_000));
        let kept = [
            nodes_after(&short, Mode::Keep),
            nodes_after(&long, Mode::Keep),
        ];
        let streaming = [
            nodes_after(&short, Mode::Stream),
            nodes_after(&long, Mode::Stream),
        ];
        assert!(kept[1] - kept[0] >= 30_000, "keep mode: {kept:?} nodes");
        assert_eq!(
            streaming[0], streaming[1],
            "stream mode: nodes for 10k and 40k entries"
        );
        // What stays: strings, frames, and one batch of (at most 1000) entry dicts.
        assert!(streaming[1] < 1500, "stream mode: {streaming:?} nodes");
    }

    #[test]
    fn streaming_refuses_entries_referred_to_twice_and_full_reading_takes_them() {
        // An event dict appended, then fetched from the memo and appended again.
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/hand/shared-entry.pickle"
        );
        let b = std::fs::read(path).unwrap();
        let full = read_snapshot(&b).unwrap();
        assert_eq!(full.device_traces[0].len(), 2);
        assert!(matches!(
            streamed(&b, READ_CHUNK),
            Err(ReadError::NeedsFullRead { .. })
        ));
    }

    /// Random byte mutations of every fixture: Ok or Err, never a panic. Deterministic.
    #[test]
    fn mutated_fixtures_never_panic() {
        let mut rng: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let small: Vec<Vec<u8>> = FIXTURES[..5].iter().map(|f| fixture(f)).collect();
        let mut errors = 0;
        for i in 0..3000 {
            let mut b = small[i % small.len()].clone();
            let n = 1 + next() % 8;
            for _ in 0..n {
                let at = (next() as usize) % b.len();
                match next() % 4 {
                    0 => b[at] = next() as u8,
                    1 => b[at] ^= 1 << (next() % 8),
                    2 => b.truncate(at.max(1)),
                    _ => {
                        let len = b.len();
                        b[at..].rotate_left((next() as usize) % (len - at));
                    }
                }
            }
            let whole = read_snapshot(&b);
            if whole.is_err() {
                errors += 1;
            }
            // Streaming the entries out gives the same, or says the file needs a full read.
            match (streamed(&b, READ_CHUNK), &whole) {
                (Ok(s), Ok(w)) => assert_eq!(&s, w, "mutation {i}: streamed"),
                (Ok(_), Err(e)) => panic!("mutation {i}: streamed fine, full read failed: {e}"),
                (Err(ReadError::NeedsFullRead { .. }), _) => {}
                (Err(e), Err(w)) => assert_eq!(&e, w, "mutation {i}: streamed"),
                (Err(e), Ok(_)) => panic!("mutation {i}: full read fine, streamed failed: {e}"),
            }
            // Streaming in small chunks reaches the same result or the same error.
            if i % 10 == 0 {
                let chunked = read_chunked(&mut &b[..], 997, &mut |_| {}, None).map(|s| s.snapshot);
                assert_eq!(chunked, whole, "mutation {i}, chunks of 997");
            }
        }
        // Some mutations hit values only (still valid), most break the structure.
        assert!(errors > 100 && errors < 3000, "{errors} errors");
    }
}

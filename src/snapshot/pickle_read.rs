//! Pickle reader for snapshots: memsnap's own files and PyTorch's (`_dump_snapshot`).
//!
//! Cold code, no unsafe, executes nothing. Two layers:
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
    /// A trace entry converted when it was appended to a list (snapshot mode only): the
    /// entry's number. Found only inside lists, never on the machine's stack.
    Event(u32),
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
}

/// The result of [`parse`]: the arena and the top-level value.
#[derive(Debug, Default)]
pub struct Pickle {
    pub nodes: Vec<Node>,
    pub root: Option<Val>,
    /// Protocol from the PROTO header (0 when there is none).
    pub protocol: u8,
}

impl Pickle {
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
    let mut m = Machine::new(bytes, false);
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
    read_chunked(input, READ_CHUNK, progress)
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
) -> Result<Snapshot> {
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
    let mut state = MachineState::new(true);
    loop {
        let mut m = Machine::resume(&buf, base, eof, state);
        match m.run(progress) {
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
        ..
    } = state;
    // The machine's working state is not needed to convert: free it now, not at the end.
    drop((memo, memo_side, memo_sparse, stack, marks));
    let root = pickle.root.ok_or(ReadError::NoStop { offset: base })?;
    let total_events = events.len();
    let mut conv = Converter {
        p: &pickle,
        interner,
        events,
        total_events,
        event_home: Vec::new(),
        moved_runs: Vec::new(),
        cur_device: 0,
        cur_index: 0,
        consumed: 0,
    };
    conv.snapshot(root)
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
            ReadError::Empty | ReadError::NotPickle { .. } | ReadError::Shape { .. } => {}
        }
        self
    }
}

// ---------------------------------------------------------------------------------------
// The pickle machine.

const PROGRESS_STEP: usize = 8 << 20;
/// Memo slot tag: the rest is an index into `Machine::memo_side`.
const MEMO_SIDE: u32 = 1 << 31;
/// Memo slot that holds nothing in the dense vector (the value is in `memo_sparse`).
const MEMO_UNSET: u32 = u32::MAX;

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
    /// Snapshot mode: convert trace entries when they are appended.
    snapshot_mode: bool,
    interner: Interner,
    events: Vec<TraceEntry>,
    next_report: usize,
}

impl MachineState {
    fn new(snapshot_mode: bool) -> Self {
        MachineState {
            pickle: Pickle::default(),
            stack: Vec::new(),
            marks: Vec::new(),
            memo: Vec::new(),
            memo_side: Vec::new(),
            memo_sparse: FxHashMap::default(),
            snapshot_mode,
            interner: Interner {
                collapse: snapshot_mode.then(Vec::new),
                ..Interner::default()
            },
            events: Vec::new(),
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
    fn new(input: &'a [u8], snapshot_mode: bool) -> Self {
        Machine::resume(input, 0, true, MachineState::new(snapshot_mode))
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
        let id = self.st.pickle.nodes.len() as u32;
        self.st.pickle.nodes.push(n);
        Val::Ref(id)
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
        if index > len {
            self.st.memo_sparse.insert(index, v);
            return;
        }
        let slot = match v {
            Val::Ref(id) if id < MEMO_SIDE => id,
            _ => {
                self.st.memo_side.push(v);
                // Each PUT is at least one input byte, so this index fits below 2^31 for
                // any file under 2 GiB; beyond that the dense encoding gives way to the map.
                let side = self.st.memo_side.len() - 1;
                match u32::try_from(side) {
                    Ok(i) if i < MEMO_SIDE - 1 => MEMO_SIDE | i,
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
            Some(slot) if slot & MEMO_SIDE == 0 => Some(Val::Ref(slot)),
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
                    let item = self.pop(at)?;
                    let list = self.top(at)?;
                    self.append(list, vec![item], at)?;
                }
                b'e' => {
                    let items = self.pop_mark(at)?;
                    let list = self.top(at)?;
                    self.append(list, items, at)?;
                }
                b's' => {
                    let v = self.pop(at)?;
                    let k = self.pop(at)?;
                    let d = self.top(at)?;
                    self.set_items(d, vec![k, v], at)?;
                }
                b'u' => {
                    let items = self.pop_mark(at)?;
                    if items.len() % 2 != 0 {
                        return Err(self.corrupt(at, "SETITEMS with an odd number of items"));
                    }
                    let d = self.top(at)?;
                    self.set_items(d, items, at)?;
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
                    self.st.stack.push(v);
                }
                b'j' => {
                    let i = self.le(4, "LONG_BINGET")?;
                    let v = self.memo_get(i, at)?;
                    self.st.stack.push(v);
                }
                b'g' => {
                    let l = self.line("GET")?;
                    let i = parse_index(l).ok_or_else(|| self.corrupt(at, "GET: bad index"))?;
                    let v = self.memo_get(i, at)?;
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

    fn append(&mut self, list: Val, mut items: Vec<Val>, at: usize) -> Result<()> {
        if self.st.snapshot_mode {
            for item in items.iter_mut() {
                if let Some(n) = self.maybe_convert_event(*item, at)? {
                    *item = Val::Event(n);
                }
            }
        }
        let idx = match list {
            Val::Ref(i) => i as usize,
            _ => return Err(self.corrupt(at, "APPEND(S) to something that is not a list")),
        };
        // Entries numbered `start..start + items.len()`, when the items are exactly that.
        let run_from = |start: u32| {
            items
                .iter()
                .enumerate()
                .all(|(i, v)| matches!(v, Val::Event(n) if Some(*n) == start.checked_add(i as u32)))
        };
        let node = self.st.pickle.nodes.get_mut(idx);
        match node {
            Some(Node::List(v)) if v.is_empty() => {
                let n = items.len() as u32;
                match items.first() {
                    Some(&Val::Event(first)) if self.st.snapshot_mode && run_from(first) => {
                        *node.expect("matched") = Node::EventRun { first, len: n };
                    }
                    _ => *v = items,
                }
                Ok(())
            }
            Some(Node::List(v)) => {
                v.extend_from_slice(&items);
                Ok(())
            }
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
                        v.extend_from_slice(&items);
                        *node.expect("matched") = Node::List(v);
                    }
                }
                Ok(())
            }
            _ => Err(self.corrupt(at, "APPEND(S) to something that is not a list")),
        }
    }

    fn set_items(&mut self, dict: Val, items: Vec<Val>, at: usize) -> Result<()> {
        let idx = match dict {
            Val::Ref(i) => i as usize,
            _ => return Err(self.corrupt(at, "SETITEM(S) on something that is not a dict")),
        };
        match self.st.pickle.nodes.get_mut(idx) {
            Some(Node::Dict(d)) => {
                d.extend(items.chunks_exact(2).map(|c| (c[0], c[1])));
                Ok(())
            }
            _ => Err(self.corrupt(at, "SETITEM(S) on something that is not a dict")),
        }
    }

    /// A dict with an `action` string that is appended to a list is a trace entry: convert
    /// it now and drop the dict (snapshot mode only).
    fn maybe_convert_event(&mut self, item: Val, at: usize) -> Result<Option<u32>> {
        let Val::Ref(id) = item else { return Ok(None) };
        let is_event = match self.st.pickle.nodes.get(id as usize) {
            Some(Node::Dict(d)) => d.iter().any(|(k, v)| {
                self.st.pickle.str(*k) == Some("action") && self.st.pickle.str(*v).is_some()
            }),
            _ => false,
        };
        if !is_event {
            return Ok(None);
        }
        let entry = event_from_dict(&self.st.pickle, &mut self.st.interner, item)
            .map_err(|msg| self.corrupt(at, format!("trace entry: {msg}")))?;
        let n = self.st.events.len() as u32;
        self.st.events.push(entry);
        self.st.pickle.nodes[id as usize] = Node::Event(n);
        if let Some(pending) = &mut self.st.interner.collapse {
            for (list, stack) in pending.drain(..) {
                self.st.pickle.nodes[list as usize] = Node::Stack(stack);
            }
        }
        Ok(Some(n))
    }
}

fn parse_index(l: &[u8]) -> Option<u64> {
    std::str::from_utf8(l).ok()?.trim().parse().ok()
}

// ---------------------------------------------------------------------------------------
// Conversion to the model.

/// Frames and stacks, interned by node identity first (PyTorch shares them through the
/// memo) and by value second (files that repeat them).
#[derive(Default)]
struct Interner {
    frames: Vec<Frame>,
    stacks: Vec<Vec<u32>>,
    frame_by_node: FxHashMap<u32, u32>,
    frame_by_value: FxHashMap<Frame, u32>,
    stack_by_node: FxHashMap<u32, Option<StackId>>,
    stack_by_value: FxHashMap<Vec<u32>, StackId>,
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

    fn frame(&mut self, p: &Pickle, v: Val) -> u32 {
        if let Val::Ref(id) = v
            && let Some(&f) = self.frame_by_node.get(&id)
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
        if let Val::Ref(id) = v {
            self.frame_by_node.insert(id, f);
        }
        f
    }

    /// `None` for a missing or empty frame list.
    fn stack(&mut self, p: &Pickle, v: Option<Val>) -> Option<StackId> {
        let v = v?;
        let Val::Ref(id) = v else { return None };
        if let Some(Node::Stack(s)) = p.node(v) {
            return *s;
        }
        if let Some(&s) = self.stack_by_node.get(&id) {
            return s;
        }
        let items = p.items(v).unwrap_or_default();
        let ids: Vec<u32> = items.iter().map(|&f| self.frame(p, f)).collect();
        let s = if ids.is_empty() {
            None
        } else {
            // Look up before inserting: most lists repeat a known stack, and `entry` would
            // need an owned copy of the ids for every lookup.
            match self.stack_by_value.get(&ids) {
                Some(&s) => Some(s),
                None => {
                    let next = self.stacks.len() as StackId;
                    self.stack_by_value.insert(ids.clone(), next);
                    self.stacks.push(ids);
                    Some(next)
                }
            }
        };
        match &mut self.collapse {
            Some(pending) if matches!(p.node(v), Some(Node::List(_))) => pending.push((id, s)),
            _ => {
                self.stack_by_node.insert(id, s);
            }
        }
        s
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
        let Some(key) = p.str(k) else { continue };
        match key {
            "action" => {
                let s = p.str(val).ok_or("`action` is not a string")?;
                e.action = Action::parse(s);
                has_action = true;
            }
            "addr" => e.addr = int_of(Some(val)).ok_or("`addr` is not an integer")?,
            "size" => e.size = int_of(Some(val)).ok_or("`size` is not an integer")?,
            "stream" => e.stream = int_of(Some(val)).unwrap_or(0),
            "time_us" => e.time_us = int_of(Some(val)).unwrap_or(0),
            "device_free" => e.device_free = int_of(Some(val)),
            "frames" => frames = Some(val),
            "user_metadata" => {
                e.user_metadata = match p.node(val) {
                    Some(Node::Str(s)) if !s.is_empty() => Some(interner.meta(s)),
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
        let interner = std::mem::take(&mut self.interner);
        snap.frames = interner.frames;
        snap.stacks = interner.stacks;
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
            Val::Event(_) => None,
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

    fn fixture(name: &str) -> Vec<u8> {
        let path = format!("{}/tests/fixtures/torch/{name}", env!("CARGO_MANIFEST_DIR"));
        std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
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
                let s = read_chunked(&mut &bytes[..], chunk, &mut |d| done = d).unwrap();
                assert_eq!(s, whole, "{name} in chunks of {chunk}");
                assert_eq!(done, bytes.len(), "{name}: progress reaches the end");
            }
            // A file cut short fails at the same byte with the same error either way.
            let cut = &bytes[..bytes.len() * 2 / 3];
            let expected = read_snapshot_from(&mut &cut[..], &mut |_| {}).unwrap_err();
            let whole_err = Machine::new(cut, true).run(&mut |_| {}).unwrap_err();
            assert_eq!(expected, whole_err, "{name} cut");
            for chunk in [1, 13] {
                let e = read_chunked(&mut &cut[..], chunk, &mut |_| {}).unwrap_err();
                assert_eq!(e, whole_err, "{name} cut, chunks of {chunk}");
            }
        }
    }

    #[test]
    fn reads_every_fixture_with_the_counts_python_reports() {
        // Counts from `pickle.load` on the same files (see tests/fixtures/torch/README.md).
        let s = read_snapshot(&fixture("torch-python-stacks.pickle")).unwrap();
        assert_eq!(s.segments.len(), 14);
        assert_eq!(s.device_traces.len(), 1);
        assert_eq!(s.device_traces[0].len(), 269);
        assert_eq!(count(&s, "alloc"), 95);
        assert_eq!(count(&s, "free_completed"), 80);
        assert_eq!(count(&s, "segment_alloc"), 14);
        assert_eq!(
            s.allocator_settings
                .iter()
                .find(|(k, _)| k == "max_split_size")
                .map(|(_, v)| v),
            Some(&Meta::Int(-1))
        );

        let s = read_snapshot(&fixture("torch-transformer-all-stacks.pickle")).unwrap();
        assert_eq!(s.device_traces[0].len(), 12561);
        assert_eq!(s.segments.len(), 66);
        assert_eq!(count(&s, "alloc"), 4267);
        let live: i64 = s
            .segments
            .iter()
            .flat_map(|g| &g.blocks)
            .filter(|b| b.state == BlockState::ActiveAllocated)
            .map(|b| b.size)
            .sum();
        assert_eq!(live, 304566784);
        // Shared frame lists stay shared: far fewer stacks than events.
        assert!(s.stacks.len() < 3000, "{} stacks", s.stacks.len());

        let s = read_snapshot(&fixture("torch-oom.pickle")).unwrap();
        let oom = s.device_traces[0]
            .iter()
            .find(|e| e.action == Action::Oom)
            .unwrap();
        assert_eq!(oom.device_free, Some(12118523904));
        assert_eq!(oom.size, 17179869184);
        let f: Vec<_> = s.stack_frames(oom.stack).collect();
        assert_eq!(f[0].line, 22);
        assert!(f[0].filename.ends_with("make_fixtures.py"));

        let s = read_snapshot(&fixture("torch-expandable-segments.pickle")).unwrap();
        assert!(s.segments.iter().all(|g| g.is_expandable));
        assert_eq!(count(&s, "segment_map"), 4);
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
            b.extend_from_slice(&[b'}', b'(']);
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
        b.extend_from_slice(&[b'e', b'e', b'u', b'.']);
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
        b.extend_from_slice(&[b']', b'(', b']']);
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
        b.extend_from_slice(&[b']', b'(']);
        for sizes in [[1u8, 2, 3], [4, 5, 6]] {
            b.extend_from_slice(&[b']', b'(']);
            for size in sizes {
                b.extend_from_slice(&[b'}', b'(']);
                key(&mut b, "action");
                key(&mut b, "free_completed");
                key(&mut b, "size");
                b.extend_from_slice(&[b'K', size, b'u']);
            }
            b.push(b'e');
        }
        b.extend_from_slice(&[b'e', b'u', b'.']);
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
        cyc.extend_from_slice(&[b'u', b'.']);
        let r = read_snapshot(&cyc);
        assert!(matches!(r, Err(ReadError::Shape { .. })), "{r:?}");
        // Truncation at every prefix of a real file ends in an error, never a panic.
        let f = fixture("torch-oom.pickle");
        for n in 0..f.len() - 1 {
            assert!(read_snapshot(&f[..n]).is_err(), "prefix {n}");
        }
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
                        b[at..].rotate_left(((next() as usize) % (len - at)).max(0));
                    }
                }
            }
            let whole = read_snapshot(&b);
            if whole.is_err() {
                errors += 1;
            }
            // Streaming in small chunks reaches the same result or the same error.
            if i % 10 == 0 {
                let chunked = read_chunked(&mut &b[..], 997, &mut |_| {});
                assert_eq!(chunked, whole, "mutation {i}, chunks of 997");
            }
        }
        // Some mutations hit values only (still valid), most break the structure.
        assert!(errors > 100 && errors < 3000, "{errors} errors");
    }
}

//! The pickle machine: opcodes (protocols 0–5, plain data only), the stack and marks, the
//! memo, and the arena's node slots (given back and reused in stream mode). In snapshot
//! modes it converts each trace entry as it is appended ([`super::entry`]) and collapses
//! the frame lists it used into interned stacks.

use super::Budget;
use super::arena::{Encoding, NOT_MEMOIZED, Node, Pickle, SHARED, Val};
use super::entry::event_from_dict;
use super::error::{ReadError, Result};
use super::intern::{EntryKey, Interner};
use crate::model::{StackId, TraceEntry};
use rustc_hash::FxHashMap;

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
pub(super) enum Mode {
    /// A generic value tree ([`parse`]).
    Plain,
    /// A snapshot: trace entries converted as they are appended, and kept.
    Keep,
    /// A snapshot whose entries are handed out as they are converted and not kept.
    Stream,
}

/// Everything the pickle machine keeps between input chunks.
pub(super) struct MachineState {
    pub(super) pickle: Pickle,
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
    pub(super) streamed: Vec<(u32, TraceEntry)>,
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
    /// Bytes of input up to and including STOP, once it is read.
    read: usize,
    /// The file's encoding as far as read (frames are the interner's part).
    pub(super) encoding: Encoding,
}

impl MachineState {
    pub(super) fn new(mode: Mode) -> Self {
        MachineState {
            pickle: Pickle::default(),
            stack: Vec::new(),
            marks: Vec::new(),
            memo: Vec::new(),
            memo_side: Vec::new(),
            memo_sparse: FxHashMap::default(),
            mode,
            interner: Interner::new(mode != Mode::Plain),
            events: Vec::new(),
            streamed: Vec::new(),
            converted: 0,
            free: Vec::new(),
            release_work: Vec::new(),
            spare_dicts: Vec::new(),
            spare_lists: Vec::new(),
            next_report: PROGRESS_STEP,
            read: 0,
            encoding: Encoding::default(),
        }
    }

    /// What conversion needs once the input is read: the arena, the interner and the
    /// converted entries. The machine's working state (memo, stack, spares) is freed here.
    pub(super) fn finish(self) -> (Pickle, Interner, Vec<TraceEntry>, Encoding) {
        let MachineState {
            pickle,
            mut interner,
            events,
            read,
            mut encoding,
            ..
        } = self;
        // Conversion may spend what the whole input allows.
        interner.model_limit = Budget::model_limit(read);
        encoding.protocol = pickle.protocol;
        (pickle, interner, events, encoding)
    }
}

/// The machine over one chunk of input: `input` starts at byte `base` of the file, and
/// `last` says whether it runs to the end of the file. Every opcode reads all its bytes
/// before it changes any state, so an opcode cut by the end of a chunk (a `Truncated` or
/// `NoStop` error when `last` is false) is simply run again from `op_start` once the next
/// chunk is there.
pub(super) struct Machine<'a> {
    input: &'a [u8],
    pub(super) pos: usize,
    base: usize,
    last: bool,
    pub(super) op_start: usize,
    pub(super) st: MachineState,
}

impl<'a> Machine<'a> {
    pub(super) fn new(input: &'a [u8], mode: Mode) -> Self {
        Machine::resume(input, 0, true, MachineState::new(mode))
    }
    pub(super) fn resume(input: &'a [u8], base: usize, last: bool, st: MachineState) -> Self {
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

    pub(super) fn run(&mut self, progress: &mut dyn FnMut(usize)) -> Result<()> {
        if self.input.is_empty() && self.base == 0 && self.last {
            return Err(ReadError::Empty);
        }
        loop {
            if self.base + self.pos >= self.st.next_report {
                progress(self.base + self.pos);
                self.st.next_report = self.base + self.pos + PROGRESS_STEP;
            }
            // Every opcode makes at most one node or stack entry: checked once per opcode.
            let values = self.st.pickle.nodes.len() + self.st.stack.len();
            if values > Budget::FLOOR_VALUES + (self.base + self.pos) / Budget::BYTES_PER_VALUE {
                return Err(ReadError::Budget {
                    offset: Some(self.pos),
                    what: "the pickle's values".to_string(),
                    limit: format!(
                        "{} values plus one per {} bytes",
                        Budget::FLOOR_VALUES,
                        Budget::BYTES_PER_VALUE
                    ),
                    why: "real snapshots need one per 11 bytes or more",
                });
            }
            let at = self.pos;
            self.op_start = at;
            let Some(&op) = self.input.get(self.pos) else {
                return Err(ReadError::NoStop { offset: at });
            };
            self.pos += 1;
            self.st.encoding.opcodes[(op >> 6) as usize] |= 1 << (op & 63);
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
                    self.st.read = self.base + self.pos;
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
                    if n > 8 {
                        self.st.encoding.long_ints += 1;
                    }
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
                    self.batch(self.st.stack.len() - from);
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
                    self.batch((self.st.stack.len() - from) / 2);
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

    /// Records a MARK…APPENDS or MARK…SETITEMS batch of `n` items (the viewer's limit is
    /// 1000: docs/FORMAT.md, "Producer's rules", rule 3).
    fn batch(&mut self, n: usize) {
        let e = &mut self.st.encoding;
        if n > 1000 {
            e.large_batches += 1;
        }
        e.largest_batch = e.largest_batch.max(n);
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
            Some(Node::Dict(_)) if self.st.interner.is_frame(id) => false,
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
        self.st.interner.model_limit = Budget::model_limit(self.base + self.pos);
        let entry = event_from_dict(&self.st.pickle, &mut self.st.interner, item);
        if let Some(e) = self.st.interner.exceeded() {
            return Err(e);
        }
        let entry = entry.map_err(|msg| self.corrupt(at, format!("trace entry: {msg}")))?;
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

/// Parses any plain-data pickle into an arena of values.
pub fn parse(bytes: &[u8]) -> Result<Pickle> {
    let mut m = Machine::new(bytes, Mode::Plain);
    m.run(&mut |_| {})?;
    Ok(m.st.pickle)
}

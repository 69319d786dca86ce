//! The arena the pickle machine builds: [`Val`]s (scalars inline, containers by index),
//! [`Node`]s, and [`Pickle`] with its record of which nodes can be reached again.

use crate::model::StackId;

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

/// The result of [`parse`](super::parse): the arena and the top-level value.
#[derive(Debug, Default)]
pub struct Pickle {
    pub nodes: Vec<Node>,
    pub root: Option<Val>,
    /// Protocol from the PROTO header (0 when there is none).
    pub protocol: u8,
    /// Snapshot modes: how each node can be reached again besides its one container
    /// ([`NOT_MEMOIZED`], [`SHARED`], or its memo index). Empty in plain mode.
    pub(super) reach: Vec<u32>,
}

/// [`Pickle::reach`]: the node was neither memoized nor duplicated, so its one container is
/// the only thing that refers to it.
pub(super) const NOT_MEMOIZED: u32 = u32::MAX;
/// [`Pickle::reach`]: fetched from the memo (a copy exists besides its container), memoized
/// more than once, duplicated, or under an index the dense memo cannot hold: never freed.
pub(super) const SHARED: u32 = u32::MAX - 1;

impl Pickle {
    /// Whether the node can be referred to again later in the file (through the memo or a
    /// DUP): only then is it worth remembering by identity.
    pub(super) fn may_recur(&self, id: u32) -> bool {
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
    /// Items of a list or tuple stored as values (not a run of converted trace entries):
    /// borrowed, never expanded.
    pub fn seq(&self, v: Val) -> Option<&[Val]> {
        match self.node(v) {
            Some(Node::List(x)) | Some(Node::Tuple(x)) => Some(x),
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

/// What the reader saw of a file that its [`Snapshot`](crate::model::Snapshot) does not
/// keep: the encoding (docs/FORMAT.md, "Producer's rules", rule 3) and frames that are not
/// `{"name": str, "filename": str, "line": int}` (rule 11), which the model turns into
/// `??`. What `memsnap check` needs beyond the model ([`crate::check::check_encoding`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Encoding {
    /// From the PROTO header (0 when there is none).
    pub protocol: u8,
    /// Every opcode the file uses: bit `op % 64` of word `op / 64`.
    pub opcodes: [u64; 4],
    /// MARK…APPENDS and MARK…SETITEMS batches of more than 1000 items, and the largest.
    pub large_batches: u64,
    pub largest_batch: usize,
    /// LONG1 integers of more than 8 bytes (the viewer decodes them as BigInt).
    pub long_ints: u64,
    /// Frame objects (each memoized one once) that are not a dict with a str `name`, a str
    /// `filename` and an int `line`, and `frames` values that are not lists; the first
    /// one described.
    pub bad_frames: u64,
    pub first_bad_frame: Option<String>,
}

impl Encoding {
    /// Whether the file uses opcode `op`.
    pub fn uses(&self, op: u8) -> bool {
        self.opcodes[(op >> 6) as usize] & (1 << (op & 63)) != 0
    }
}

//! Interning while reading: frames and stacks (by node identity, then by value), the keys
//! and `action` strings of trace-entry dicts, and `user_metadata` strings.

use super::Budget;
use super::arena::{Node, Pickle, Val};
use super::error::ReadError;
use crate::model::{Action, Frame, StackId};
use rustc_hash::{FxHashMap, FxHashSet};
use std::sync::Arc;

/// The keys of a trace-entry dict the reader looks at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum EntryKey {
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
pub(super) struct Interner {
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
    pub(super) collapse: Option<Vec<(u32, Option<StackId>)>>,
    /// Bytes of model made so far, against `model_limit` ([`Budget::model_limit`] of the
    /// bytes read, kept current by the reader).
    model_bytes: usize,
    pub(super) model_limit: usize,
    /// What went over `model_limit` first; nothing more is expanded from then on.
    over: Option<&'static str>,
    /// Frames and `frames` values that break "Producer's rules", rule 11, and the first
    /// one described ([`Encoding::bad_frames`](super::arena::Encoding::bad_frames)).
    pub(super) bad_frames: u64,
    pub(super) first_bad_frame: Option<String>,
}

impl Interner {
    /// `collapse`: while parsing a snapshot, hand the lists just interned to the machine.
    pub(super) fn new(collapse: bool) -> Self {
        Interner {
            collapse: collapse.then(Vec::new),
            model_limit: Budget::model_limit(0),
            ..Interner::default()
        }
    }

    /// Counts `bytes` of model for `what`; false once the model is over its limit (the
    /// caller then expands nothing more, and the reader fails with [`Self::exceeded`]).
    pub(super) fn spend(&mut self, bytes: usize, what: &'static str) -> bool {
        if self.over.is_some() {
            return false;
        }
        self.model_bytes = self.model_bytes.saturating_add(bytes);
        if self.model_bytes > self.model_limit {
            self.over = Some(what);
            return false;
        }
        true
    }

    fn bad_frame(&mut self, what: impl FnOnce() -> String) {
        self.bad_frames += 1;
        if self.first_bad_frame.is_none() {
            self.first_bad_frame = Some(what());
        }
    }

    /// Bytes of model counted so far.
    pub(super) fn model_bytes(&self) -> usize {
        self.model_bytes
    }

    /// The error once the model went over its limit.
    pub(super) fn exceeded(&self) -> Option<ReadError> {
        self.over.map(|what| ReadError::Expands {
            what,
            per_byte: Budget::MODEL_PER_BYTE,
            floor_mib: Budget::MODEL_FLOOR >> 20,
        })
    }

    pub(super) fn meta(&mut self, s: &str) -> Arc<str> {
        if let Some(m) = self.metas.get(s) {
            return m.clone();
        }
        let m: Arc<str> = s.into();
        self.metas.insert(m.clone());
        m
    }

    /// Whether node `id` is a frame dict already interned (remembered only for nodes that
    /// may recur).
    pub(super) fn is_frame(&self, id: u32) -> bool {
        self.frame_of_node
            .get(id as usize)
            .is_some_and(|&f| f != NO_FRAME)
    }

    /// A node slot was given back: whatever was known about it no longer holds.
    pub(super) fn forget(&mut self, id: u32) {
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
    pub(super) fn action(&mut self, p: &Pickle, v: Val) -> Option<Action> {
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
    pub(super) fn meta_str(&mut self, p: &Pickle, v: Val) -> Option<Arc<str>> {
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

    pub(super) fn key(&mut self, p: &Pickle, k: Val) -> EntryKey {
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
        // The frame's strings are copied (twice: the frame and its by-value key), however
        // many frame dicts share them through the memo.
        let strings = match p.node(v) {
            Some(Node::Dict(_)) => ["name", "filename"]
                .iter()
                .map(|k| p.get(v, k).and_then(|x| p.str(x)).map_or(2, str::len))
                .sum(),
            Some(Node::Str(s)) => s.len(),
            _ => 4,
        };
        if !self.spend(2 * (std::mem::size_of::<Frame>() + strings), "frames") {
            return 0;
        }
        let str_of = |k| p.get(v, k).and_then(|x| p.str(x));
        let problem = match (p.node(v), v) {
            (Some(Node::Dict(_)), _) => {
                if str_of("name").is_none() {
                    Some("a frame dict without a str `name`".to_string())
                } else if str_of("filename").is_none() {
                    Some("a frame dict without a str `filename`".to_string())
                } else if !matches!(p.get(v, "line"), Some(Val::Int(_))) {
                    Some("a frame dict without an int `line`".to_string())
                } else {
                    None
                }
            }
            (Some(Node::Str(s)), _) => Some(format!(
                "a frame that is a string (\"{}\")",
                crate::text::escape_controls(&s.chars().take(40).collect::<String>())
            )),
            (Some(Node::List(_) | Node::Tuple(_)), _) => Some("a frame that is a list".into()),
            (_, Val::Int(i)) => Some(format!("a frame that is an integer ({i})")),
            (_, Val::None) => Some("a frame that is None".into()),
            _ => Some("a frame that is not a dict".into()),
        };
        if let Some(problem) = problem {
            self.bad_frame(|| problem);
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
        // Kept here and again as the model's own vector.
        self.spend(8 * self.scratch.len() + 32, "stacks");
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
    pub(super) fn stack(&mut self, p: &Pickle, v: Option<Val>) -> Option<StackId> {
        let v = v?;
        if let Val::Stack(s) = v {
            return s;
        }
        let not_a_list = || "a `frames` value that is not a list".to_string();
        let Val::Ref(id) = v else {
            self.bad_frame(not_a_list);
            return None;
        };
        if let Some(Node::Stack(s)) = p.node(v) {
            return *s;
        }
        if let Some(&s) = self.stack_by_node.get(&id) {
            return s;
        }
        let items = match p.seq(v) {
            Some(items) => items,
            None => {
                self.bad_frame(not_a_list);
                &[]
            }
        };
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
    pub(super) fn into_stacks(self) -> (Vec<Frame>, Vec<Vec<u32>>) {
        let stacks = self
            .stack_start
            .windows(2)
            .map(|w| self.stack_frames[w[0]..w[1]].to_vec())
            .collect();
        (self.frames, stacks)
    }
}

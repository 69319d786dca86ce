//! Raw stacks to frames: interning, Python frame decoding, native symbolization, merging.
//!
//! Cold (writer thread). [`StackTable::intern`] runs as soon as the writer drains an event:
//! it reads the Python code objects right away (they may be freed later) and keeps the
//! resolved Python frames; native addresses are symbolized lazily by [`StackTable::frames`],
//! once per unique address, and each unique stack's merged frame list is cached.
//!
//! Merging follows PyTorch (`combined_traceback.cpp`, docs/FORMAT.md#frames): native frames
//! in order; at each native frame whose name contains `PyEval_EvalFrame` (the interpreter
//! loop), the Python frames that eval call ran are inserted just before it; Python frames
//! left over go at the end.

mod pyframes;
mod symbolize;
mod symtab;

pub use pyframes::{line_310, line_311, read_mem};
pub use symbolize::demangle;

use crate::channel::event::{PyFrameRaw, StackSlot};
use crate::config::Config;
use crate::process::{modules, python};
use crate::snapshot::model::Frame;
use rustc_hash::FxHashMap;

/// Index of an interned raw stack.
pub type RawStackId = u32;

/// One interned stack: raw native addresses, the raw Python records (what identifies it),
/// Python frames already resolved (grouped by the eval call that ran them), and the merged
/// frames once computed.
struct RawStack {
    native: Vec<u64>,
    raw_python: Vec<PyFrameRaw>,
    python: Vec<Vec<Frame>>,
    merged: Option<Vec<Frame>>,
}

pub struct StackTable {
    /// Stacks by their [`StackSlot::identity_hash`]: the first stack with each hash. A stack
    /// a hook sent by reference costs one lookup here; one sent in full, a lookup and a
    /// compare; no copy, no allocation.
    by_hash: FxHashMap<u64, RawStackId>,
    /// Later stacks whose hash an earlier one already had (compared in full, like the rest).
    same_hash: FxHashMap<u64, Vec<RawStackId>>,
    /// References to a hash two different stacks have: attributed to the first of them.
    /// With 64-bit hashes, about 2^-64 per pair of stacks (reported if it ever happens).
    pub ambiguous_references: u64,
    /// References to a hash no stack had: the event is recorded without its stack. Never
    /// expected (a thread's full send is drained before its references); counted.
    pub unknown_references: u64,
    /// Stacks received in a slot, and by reference to one received before.
    pub received_in_full: u64,
    pub received_by_reference: u64,
    /// Interned stacks not symbolized yet, oldest first (see [`Self::symbolize_some`]).
    unsymbolized: std::collections::VecDeque<RawStackId>,
    stacks: Vec<RawStack>,
    python: pyframes::PyResolver,
    native: symbolize::Symbolizer,
    warned_python: bool,
    /// Messages for the user (the writer prints them): e.g. an unsupported Python.
    warnings: Vec<String>,
}

impl StackTable {
    pub fn new(_cfg: &Config) -> Self {
        StackTable {
            by_hash: FxHashMap::default(),
            same_hash: FxHashMap::default(),
            ambiguous_references: 0,
            unknown_references: 0,
            received_in_full: 0,
            received_by_reference: 0,
            unsymbolized: std::collections::VecDeque::new(),
            stacks: Vec::new(),
            python: pyframes::PyResolver::new(),
            native: symbolize::Symbolizer::new(),
            warned_python: false,
            warnings: Vec::new(),
        }
    }

    /// Interns the stack in `slot`. Called as soon as the writer drains the event, while
    /// the Python code objects it names are still alive. `None` for an empty stack.
    pub fn intern(&mut self, slot: &StackSlot) -> Option<RawStackId> {
        self.intern_hashed(slot, slot.identity_hash())
    }

    /// A stack a hook sent in full, with the hash it computed: interned (and counted).
    pub fn sent_in_full(&mut self, slot: &StackSlot, hash: u64) -> Option<RawStackId> {
        self.received_in_full += 1;
        self.intern_hashed(slot, hash)
    }

    /// The stack a hook sent by reference: the one interned with `hash`.
    #[inline]
    pub fn sent_before(&mut self, hash: u64) -> Option<RawStackId> {
        self.received_by_reference += 1;
        let Some(&id) = self.by_hash.get(&hash) else {
            self.unknown_references += 1;
            return None;
        };
        // Almost always empty (64-bit hashes): no second lookup then.
        if !self.same_hash.is_empty() && self.same_hash.contains_key(&hash) {
            self.ambiguous_references += 1;
        }
        Some(id)
    }

    /// [`Self::intern`] with the slot's [`StackSlot::identity_hash`] given, as the hook
    /// computed it (tests give two stacks one hash).
    fn intern_hashed(&mut self, slot: &StackSlot, hash: u64) -> Option<RawStackId> {
        self.check_python_support();
        if slot.is_empty() {
            return None;
        }
        let same = |s: &RawStack| s.native == slot.native() && s.raw_python == slot.python();
        if let Some(&id) = self.by_hash.get(&hash) {
            if self.stacks.get(id as usize).is_some_and(same) {
                return Some(id);
            }
            let others = self.same_hash.get(&hash).map_or(&[][..], Vec::as_slice);
            if let Some(&id) = others
                .iter()
                .find(|&&i| self.stacks.get(i as usize).is_some_and(same))
            {
                return Some(id);
            }
        }
        let python = self.python.resolve(slot.python());
        let id = self.stacks.len() as RawStackId;
        self.stacks.push(RawStack {
            native: slot.native().to_vec(),
            raw_python: slot.python().to_vec(),
            python,
            merged: None,
        });
        match self.by_hash.entry(hash) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(id);
            }
            std::collections::hash_map::Entry::Occupied(_) => {
                self.same_hash.entry(hash).or_default().push(id);
            }
        }
        self.unsymbolized.push_back(id);
        Some(id)
    }

    /// Symbolizes interned stacks that are not yet, oldest first, until `budget` has
    /// passed; returns whether any are left. The writer calls this when the queue is empty,
    /// so that names are taken while the libraries are still loaded (a later `dlclose`
    /// would lose them) without ever holding up the drain; a dump symbolizes the rest.
    pub fn symbolize_some(&mut self, budget: std::time::Duration) -> bool {
        let start = std::time::Instant::now();
        while let Some(id) = self.unsymbolized.pop_front() {
            let _ = self.frames(id);
            if start.elapsed() >= budget {
                break;
            }
        }
        !self.unsymbolized.is_empty()
    }

    /// The frames of an interned stack, innermost first, symbolized and merged (cached).
    pub fn frames(&mut self, id: RawStackId) -> &[Frame] {
        let Some(stack) = self.stacks.get_mut(id as usize) else {
            return &[];
        };
        if stack.merged.is_none() {
            let mut native: Vec<Frame> = Vec::with_capacity(stack.native.len());
            // PyTorch's caching allocator's own frames (from its tracker or its cudaMalloc
            // call) come first: the allocation site is whoever called the allocator.
            let allocator = stack
                .native
                .iter()
                .take_while(|&&pc| self.native.in_allocator_library(pc))
                .count();
            let skip = if allocator < stack.native.len() {
                allocator
            } else {
                0
            };
            for &pc in &stack.native[skip..] {
                native.extend(self.native.symbolize(pc).iter().cloned());
            }
            stack.merged = Some(merge(native, &stack.python));
        }
        stack.merged.as_deref().unwrap_or(&[])
    }

    /// Number of distinct raw stacks interned.
    pub fn len(&self) -> usize {
        self.stacks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.stacks.is_empty()
    }

    /// Writer thread, every ~100 ms or when a hook asked: rebuild the module table if a
    /// hook met an unknown address and libraries were loaded or unloaded since.
    pub fn refresh_modules(&mut self) {
        if modules::refresh_if_stale() {
            python::retry_if_absent();
        }
    }

    /// Warnings produced so far (taken: each is returned once).
    pub fn take_warnings(&mut self) -> Vec<String> {
        std::mem::take(&mut self.warnings)
    }

    fn check_python_support(&mut self) {
        if self.warned_python {
            return;
        }
        if let python::Interpreter::Unsupported(major, minor, free_threaded) = python::interpreter()
        {
            self.warned_python = true;
            let build = if free_threaded {
                " (free-threaded build)"
            } else {
                ""
            };
            // Printed with the `memsnap: ` prefix by whoever takes the warnings.
            self.warnings.push(format!(
                "Python {major}.{minor}{build} is not supported for Python frames \
                 (supported: 3.10 to 3.14 with the GIL); Python frames are off"
            ));
        }
    }
}

/// Whether a native frame is the interpreter's eval loop (one per eval call).
fn is_eval_frame(f: &Frame) -> bool {
    f.name.contains("PyEval_EvalFrame")
}

/// PyTorch's placement: each eval-call group of Python frames goes just before the native
/// frame that ran it; leftovers at the end.
fn merge(native: Vec<Frame>, python: &[Vec<Frame>]) -> Vec<Frame> {
    let total = native.len() + python.iter().map(Vec::len).sum::<usize>();
    let mut out = Vec::with_capacity(total);
    let mut groups = python.iter();
    let mut inner_was_eval = false;
    for f in native {
        let eval = is_eval_frame(&f);
        // `_PyEval_EvalFrame` inlined just outside `_PyEval_EvalFrameDefault` (DWARF builds)
        // is the same eval call: only the innermost of adjacent eval frames takes a group.
        if eval
            && !inner_was_eval
            && let Some(g) = groups.next()
        {
            out.extend(g.iter().cloned());
        }
        inner_was_eval = eval;
        out.push(f);
    }
    for g in groups {
        out.extend(g.iter().cloned());
    }
    out
}

#[cfg(test)]
mod tests;

//! Raw stacks to frames: interning, Python frame decoding, native symbolization, merging.
//!
//! Cold (writer thread). [`StackTable::intern`] runs as soon as the writer drains an event:
//! it reads the Python code objects right away and keeps the resolved Python frames, and
//! notes the module each native address is in (a code object is freed, a library unloaded,
//! only after the writer has read the events published before: `channel::keep`); native
//! addresses are symbolized lazily by [`StackTable::frames`], once per unique address and
//! module, and each unique stack's merged frame list is cached. A frame that cannot be
//! resolved (a Python code object gone, an address in no module) is kept as far as known and
//! counted in [`StackTable::frames_unresolved`].
//!
//! Merging follows PyTorch (`combined_traceback.cpp`, docs/FORMAT.md#frames): native frames
//! in order; at each native frame whose name contains `PyEval_EvalFrame` (the interpreter
//! loop), the Python frames that eval call ran are inserted just before it; Python frames
//! left over go at the end.

mod pyframes;
mod symbolize;
mod symtab;

pub use pyframes::{UNRESOLVED_FILE, line_310, line_311, read_mem};
pub use symbolize::demangle;

use crate::channel::event::{PyFrameRaw, StackSlot};
use crate::config::Config;
use crate::process::modules::{self, ModuleInfo, ModuleTable};
use crate::process::python;
use crate::snapshot::model::Frame;
use rustc_hash::FxHashMap;

/// Index of an interned raw stack.
pub type RawStackId = u32;

/// A module a native address was in when its stack was interned: an index in
/// [`ModuleIds::infos`], or [`NO_MODULE`].
type ModuleId = u32;
const NO_MODULE: ModuleId = u32::MAX;

/// One interned stack: raw native addresses and the module each was in, the raw Python
/// records (what identifies it), Python frames already resolved (grouped by the eval call
/// that ran them), and the merged frames once computed.
struct RawStack {
    native: Vec<u64>,
    modules: Vec<ModuleId>,
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
    /// Frames of the interned stacks (each distinct stack once) that could not be resolved:
    /// a Python code object gone or a line not decoded, an address in no module.
    pub frames_unresolved: u64,
    modules: ModuleIds,
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
            frames_unresolved: 0,
            modules: ModuleIds::default(),
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
        let (python, python_unresolved) = self.python.resolve(slot.python());
        let (modules, native_unresolved) = self.modules.of(slot.native());
        self.frames_unresolved += python_unresolved + native_unresolved;
        let id = self.stacks.len() as RawStackId;
        self.stacks.push(RawStack {
            native: slot.native().to_vec(),
            modules,
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
    /// so that a dump has little left to do, without ever holding up the drain; a dump
    /// symbolizes the rest.
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
                .modules
                .iter()
                .take_while(|&&m| {
                    self.modules
                        .info(m)
                        .is_some_and(symbolize::Symbolizer::is_allocator_library)
                })
                .count();
            let skip = if allocator < stack.native.len() {
                allocator
            } else {
                0
            };
            for (&pc, &m) in stack.native.iter().zip(&stack.modules).skip(skip) {
                let module = self.modules.info(m).map(|info| (m, info));
                native.extend(self.native.symbolize(pc, module).iter().cloned());
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

    /// Writer thread, every ~100 ms: rebuild the module table if a hook met an unknown
    /// address (or a library was unloaded) and libraries were loaded or unloaded since.
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

/// The modules native addresses were in, each given an id the first time it is met (the
/// same module in a rebuilt table keeps its id).
#[derive(Default)]
struct ModuleIds {
    /// What each id names.
    infos: Vec<ModuleInfo>,
    by_key: FxHashMap<(String, u64, u64), ModuleId>,
    /// The table the ids below are for (its address), and the id of each of its modules.
    table: usize,
    by_index: Vec<Option<ModuleId>>,
}

impl ModuleIds {
    /// The module of each address, as the table has them now; an address in none makes the
    /// table be rebuilt once, if libraries were loaded or unloaded since. Returns the ids
    /// and how many addresses are in no module.
    fn of(&mut self, native: &[u64]) -> (Vec<ModuleId>, u64) {
        if modules::refresh_if_stale() {
            python::retry_if_absent();
        }
        let mut table = modules::ensure();
        let mut rebuilt = false;
        let mut unresolved = 0;
        let mut ids = Vec::with_capacity(native.len());
        for &pc in native {
            let mut found = table.find(pc);
            if found.is_none() && !rebuilt {
                rebuilt = true;
                if modules::refresh() {
                    python::retry_if_absent();
                    table = modules::ensure();
                    found = table.find(pc);
                }
            }
            ids.push(match found {
                Some(index) => self.id(table, index),
                None => {
                    unresolved += 1;
                    NO_MODULE
                }
            });
        }
        (ids, unresolved)
    }

    fn id(&mut self, table: &ModuleTable, index: usize) -> ModuleId {
        let at = table as *const ModuleTable as usize;
        if self.table != at {
            self.table = at;
            self.by_index.clear();
            self.by_index.resize(table.modules.len(), None);
        }
        if let Some(Some(id)) = self.by_index.get(index) {
            return *id;
        }
        let Some(m) = table.modules.get(index) else {
            return NO_MODULE;
        };
        let key = (m.path.clone(), m.base, m.start);
        let id = *self.by_key.entry(key).or_insert_with(|| {
            self.infos.push(m.clone());
            (self.infos.len() - 1) as ModuleId
        });
        if let Some(slot) = self.by_index.get_mut(index) {
            *slot = Some(id);
        }
        id
    }

    fn info(&self, id: ModuleId) -> Option<&ModuleInfo> {
        self.infos.get(id as usize)
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

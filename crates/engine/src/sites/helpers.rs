//! Allocation helpers (docs/EXPLAIN.md#sites): a function that allocates for several
//! calling lines (`def alloc(n)`, a cache's `get`, a C wrapper around `cudaMalloc`). Its
//! allocations are shown at those lines, the helper named beside them
//! (`train.py:88 (step) via cache.py:12 (get)`), unless `--at-helpers` or `--callers`.
//!
//! Cold code. The rule, per site frame (the frame [`super::choose_site`] picks):
//! - only a frame of the program's own code can be a helper: a Python file outside the
//!   libraries (never a module-level line, `<module>`), or a native frame of the
//!   application; framework internals are never helpers;
//! - its *calling lines* are the program's own frames above it, outward (library frames
//!   between them, such as `torch.nn.Module.__call__`, are skipped); the frames below a site
//!   are its callees, never its callers;
//! - where every allocating stack goes through one same line, that line is part of the
//!   helper and the next one out is looked at (a `get` that calls an `alloc`), up to
//!   [`MAX_DEPTH`] lines, but never past a module-level line;
//! - it is a helper when, at the first depth where the stacks part, at least two calling
//!   lines allocated through it and no one of them holds more than [`LARGEST_SHARE`] of its
//!   bytes ([`StackBytes`]: what the file records each stack allocating). A line with one
//!   caller, or one caller that all but owns it, stays the site.

use super::{
    Attribution, SiteKind, frame_library, frame_text, is_hidden, is_library_python_file,
    is_python_frame, is_runtime,
};
use crate::sites::Library;
use memsnap_format::model::{Frame, Snapshot, StackId, TraceEntry};
use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;

/// How many lines above a site the calling lines are looked for.
pub const MAX_DEPTH: usize = 6;
/// The most of a helper's bytes one calling line may hold: above it, the line is that
/// caller's own more than a helper shared by several.
pub const LARGEST_SHARE: f64 = 0.9;

/// Bytes each stack allocated as far as a file records: its `alloc` entries in the history
/// plus its blocks live at the end (a block allocated within the history counts in both:
/// the bytes it still holds weigh more). For `memsnap top`, the live bytes of its samples.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StackBytes(Vec<i64>);

impl StackBytes {
    pub fn add(&mut self, stack: Option<StackId>, bytes: i64) {
        let Some(s) = stack.map(|s| s as usize) else {
            return;
        };
        if self.0.len() <= s {
            self.0.resize(s + 1, 0);
        }
        self.0[s] += bytes;
    }

    /// Counts an `alloc` entry (other entries allocate nothing for a stack).
    pub fn add_entry(&mut self, e: &TraceEntry) {
        if e.action == memsnap_format::model::Action::Alloc {
            self.add(e.stack, e.size);
        }
    }

    /// Counts the blocks live at the end of `snap` (requested bytes).
    pub fn add_end_blocks(&mut self, snap: &Snapshot) {
        for b in snap.segments.iter().flat_map(|s| &s.blocks) {
            if b.state.is_active() {
                self.add(b.stack, b.requested_size);
            }
        }
    }

    pub fn merge(&mut self, other: &StackBytes) {
        if self.0.len() < other.0.len() {
            self.0.resize(other.0.len(), 0);
        }
        for (a, b) in self.0.iter_mut().zip(&other.0) {
            *a += b;
        }
    }

    pub fn get(&self, stack: usize) -> i64 {
        self.0.get(stack).copied().unwrap_or(0)
    }

    /// A whole file's: every device's history (`histories`' tallies) and the end's blocks.
    pub fn of_file<'h>(
        snap: &Snapshot,
        histories: impl IntoIterator<Item = &'h StackBytes>,
    ) -> StackBytes {
        let mut all = StackBytes::default();
        for h in histories {
            all.merge(h);
        }
        all.add_end_blocks(snap);
        all
    }

    /// A file read whole: its trace entries and the end's blocks.
    pub fn of_whole(snap: &Snapshot) -> StackBytes {
        let mut all = StackBytes::default();
        for e in snap.device_traces.iter().flatten() {
            all.add_entry(e);
        }
        all.add_end_blocks(snap);
        all
    }
}

/// The helpers of one file, or of several files that must name their sites alike: each
/// helper's site frame (its text) and how far out its calling lines are (0: the frames
/// just above it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Helpers {
    found: BTreeMap<String, usize>,
    /// Site frames that could be helpers here (the program's own, with a calling line):
    /// where another file's helper would change this file's sites.
    seen: BTreeSet<String>,
}

impl Helpers {
    /// The helpers of one file's stacks, by the rule above: `chosen`, each stack's site
    /// frame (its position among the stack's frames); `bytes`, by stack.
    pub(super) fn find(
        stacks: &[Vec<u32>],
        chosen: &[Option<(usize, SiteKind)>],
        facts: &mut Facts,
        bytes: &StackBytes,
    ) -> Helpers {
        // Per candidate site frame (by text: a frame's text is what names it in every
        // file): each allocating stack's calling lines and bytes.
        let mut through: BTreeMap<Rc<str>, Vec<(Vec<Line>, i64)>> = BTreeMap::new();
        let mut seen: BTreeSet<Rc<str>> = BTreeSet::new();
        for (i, (st, &chosen)) in stacks.iter().zip(chosen).enumerate() {
            let Some((at, kind)) = chosen else {
                continue;
            };
            let ids = super::frame_ids(facts.frames, st);
            if !facts.may_be_helper(ids[at], kind) {
                continue;
            }
            let b = bytes.get(i);
            let chain = facts.calling_lines(&ids, at, kind, if b > 0 { MAX_DEPTH } else { 1 });
            if chain.is_empty() {
                continue;
            }
            let site = facts.text(ids[at]);
            if b > 0 {
                let chain = chain.into_iter().map(|id| facts.line(id)).collect();
                through.entry(site.clone()).or_default().push((chain, b));
            }
            seen.insert(site);
        }
        let found = through
            .into_iter()
            .filter_map(|(site, stacks)| Some((site.to_string(), calling_depth(&stacks)?)))
            .collect();
        let seen = seen.into_iter().map(|s| s.to_string()).collect();
        Helpers { found, seen }
    }

    /// Adds `other`'s helpers (a helper found at two depths keeps the nearer).
    pub fn union(&mut self, other: &Helpers) {
        for (k, &d) in &other.found {
            let e = self.found.entry(k.clone()).or_insert(d);
            *e = (*e).min(d);
        }
        self.seen.extend(other.seen.iter().cloned());
    }

    /// Whether this file's sites are the same under `shared` (the helpers of every file
    /// read together) as under its own helpers.
    pub fn agrees_with(&self, shared: &Helpers) -> bool {
        shared
            .found
            .iter()
            .all(|(k, d)| !self.seen.contains(k) || self.found.get(k) == Some(d))
    }

    pub fn is_empty(&self) -> bool {
        self.found.is_empty()
    }

    /// The depth of the calling lines of the helper whose site frame reads `site`.
    pub fn depth(&self, site: &str) -> Option<usize> {
        self.found.get(site).copied()
    }

    /// The helpers' site frames.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.found.keys().map(String::as_str)
    }
}

fn is_module_level(f: &Frame) -> bool {
    is_python_frame(f) && f.name == "<module>"
}

/// Whether a frame is the program's own: a Python file outside the libraries, or a native
/// frame of the application.
fn is_own(f: &Frame, kind: SiteKind) -> bool {
    match kind {
        SiteKind::Python => is_python_frame(f) && !is_library_python_file(&f.filename),
        _ => !is_python_frame(f) && !is_runtime(f) && frame_library(f) == Some(Library::App),
    }
}

/// One calling line: its text, and whether it is a module-level line.
struct Line {
    text: Rc<str>,
    module: bool,
}

/// What the helper rule asks of each frame of one file, each answer found once (the stacks
/// share their frames): whether it can be a calling line or a helper, for a Python site and
/// for a native one, and its text.
pub(super) struct Facts<'a> {
    frames: &'a [Frame],
    attr: &'a Attribution,
    /// Per frame and site kind: 0 not known yet, 1 no, 2 yes.
    calling: Vec<[u8; 2]>,
    helper: Vec<[u8; 2]>,
    texts: Vec<Option<Rc<str>>>,
}

impl<'a> Facts<'a> {
    pub(super) fn new(frames: &'a [Frame], attr: &'a Attribution) -> Self {
        Facts {
            frames,
            attr,
            calling: vec![[0; 2]; frames.len()],
            helper: vec![[0; 2]; frames.len()],
            texts: vec![None; frames.len()],
        }
    }

    fn known(memo: &mut [[u8; 2]], id: u32, kind: SiteKind, find: impl FnOnce() -> bool) -> bool {
        let slot = &mut memo[id as usize][(kind != SiteKind::Python) as usize];
        if *slot == 0 {
            *slot = if find() { 2 } else { 1 };
        }
        *slot == 2
    }

    /// Whether frame `id` can be a calling line above a site of `kind`: the program's own,
    /// neither hidden nor ignored.
    fn is_calling_line(&mut self, id: u32, kind: SiteKind) -> bool {
        let (f, attr) = (&self.frames[id as usize], self.attr);
        Self::known(&mut self.calling, id, kind, || {
            is_own(f, kind) && !is_hidden(f) && !attr.ignores(f)
        })
    }

    /// Whether the site frame `id` can be a helper: the program's own, not a module-level
    /// line.
    pub(super) fn may_be_helper(&mut self, id: u32, kind: SiteKind) -> bool {
        let f = &self.frames[id as usize];
        Self::known(&mut self.helper, id, kind, || {
            is_own(f, kind) && !is_module_level(f)
        })
    }

    pub(super) fn text(&mut self, id: u32) -> Rc<str> {
        let f = &self.frames[id as usize];
        self.texts[id as usize]
            .get_or_insert_with(|| frame_text(f).into())
            .clone()
    }

    fn line(&mut self, id: u32) -> Line {
        Line {
            text: self.text(id),
            module: is_module_level(&self.frames[id as usize]),
        }
    }

    /// The calling lines above the site at `at` of the stack whose frames are `ids`,
    /// outward, at most `n`.
    pub(super) fn calling_lines(
        &mut self,
        ids: &[u32],
        at: usize,
        kind: SiteKind,
        n: usize,
    ) -> Vec<u32> {
        let mut lines = Vec::new();
        for &id in &ids[at + 1..] {
            if lines.len() == n {
                break;
            }
            if self.is_calling_line(id, kind) {
                lines.push(id);
            }
        }
        lines
    }
}

/// Where the stacks through one site frame part (each: its calling lines, outward, and
/// its bytes): the depth of their calling lines when they make it a helper, else `None`.
fn calling_depth(stacks: &[(Vec<Line>, i64)]) -> Option<usize> {
    let total: i64 = stacks.iter().map(|(_, b)| b).sum();
    if total <= 0 {
        return None;
    }
    for depth in 0..MAX_DEPTH {
        let mut by_line: BTreeMap<&str, (i64, bool)> = BTreeMap::new();
        let mut ended = 0;
        for (chain, b) in stacks {
            match chain.get(depth) {
                Some(l) => by_line.entry(&l.text).or_insert((0, l.module)).0 += b,
                None => ended += b,
            }
        }
        match by_line.len() {
            0 => return None,
            // One line on every path: part of the helper, unless module-level.
            1 if ended == 0 => {
                if by_line.values().any(|(_, module)| *module) {
                    return None;
                }
            }
            1 => return None,
            _ => {
                let largest = by_line.values().map(|(b, _)| *b).max().unwrap_or(0);
                return (largest as f64 <= LARGEST_SHARE * total as f64).then_some(depth);
            }
        }
    }
    None
}

//! Every byte has an owner: live bytes at one moment split by who holds them, and what a
//! file can say about PyTorch's caching allocator (blocks, segments only, or tensors).
//!
//! Owner names (the keys of `owners` in `memsnap explain --json`):
//! - `torch tensors`: PyTorch's live blocks (files with blocks: PyTorch's own, memsnap's
//!   under the caching allocator's trace tracker) or tensors that are CUDA allocations
//!   (`backend:cudaMallocAsync`).
//! - `torch cache segments`: PyTorch's caching-allocator segments where the file has no
//!   blocks (the tensors inside cannot be told apart from the cache's free space).
//! - `torch cache (free)`: reserved but unallocated inside the caching allocator's segments
//!   (files with blocks only).
//! - `nccl`, `cublas`, `cudnn`, `xla`, `cupy`, `cudart`, `python`, `app`, `unknown`: other
//!   allocations by the owning library of their stack (the engine's library rules,
//!   [`crate::sites`]).
//! - `outside memsnap`: device memory in use that memsnap did not record (CUDA contexts,
//!   other processes): capacity − recorded reserved − free, where the file has the
//!   capacity and the driver's free bytes (at an OOM; at the end, from `devices[i].free_bytes`,
//!   the driver's answer when the file was written).
//!
//! Cold code.

use crate::sites::{Library, Sites};
use crate::tally::Tally;
use memsnap_format::model::{Meta, Snapshot, StackId};
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;

pub const TORCH_TENSORS: &str = "torch tensors";
pub const TORCH_SEGMENTS: &str = "torch cache segments";
pub const TORCH_CACHE_FREE: &str = "torch cache (free)";
pub const OUTSIDE: &str = "outside memsnap";

/// What the file knows of PyTorch's caching allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Knowledge {
    /// Segments with their blocks (PyTorch's own files; memsnap's `blocks: ...`).
    Blocks,
    /// The caching allocator's segments without blocks (memsnap's `segments only: ...`, or
    /// an older memsnap file whose torch allocations come from the allocator).
    Segments,
    /// Every tensor is a CUDA allocation (`tensors: ...`, `backend:cudaMallocAsync`).
    Tensors,
    /// No PyTorch allocation in the file.
    NoTorch,
}

/// memsnap's `torch_allocator` line, if any (memsnap writes it empty when no PyTorch
/// allocator was found: none then).
pub fn torch_allocator_line(snap: &Snapshot) -> Option<&str> {
    match snap.meta("torch_allocator")? {
        Meta::Str(s) if !s.is_empty() => Some(s),
        _ => None,
    }
}

/// What a `torch_allocator` line says was recorded: the words before its first colon
/// (`blocks`, `segments only`, `tensors`).
fn allocator_kind(line: &str) -> &str {
    line.split(':').next().unwrap_or(line).trim()
}

/// Files grouped by what their `torch_allocator` line says was recorded: for each kind, in
/// the order first seen, the positions of the items whose line names it (items without a
/// line are in no group). `ranks` and `explain` compare the files of a run with it.
pub fn by_allocator_kind<'a>(
    lines: impl IntoIterator<Item = Option<&'a str>>,
) -> Vec<(String, Vec<usize>)> {
    let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
    for (i, line) in lines.into_iter().enumerate() {
        let Some(kind) = line.map(allocator_kind) else {
            continue;
        };
        match groups.iter_mut().find(|(k, _)| k == kind) {
            Some((_, at)) => at.push(i),
            None => groups.push((kind.to_string(), vec![i])),
        }
    }
    groups
}

/// `PYTORCH_CUDA_ALLOC_CONF` as the file recorded it (`allocator_settings`), else "".
pub fn alloc_conf(snap: &Snapshot) -> String {
    snap.allocator_settings
        .iter()
        .find_map(|(k, v)| match v {
            Meta::Str(s) if k == "PYTORCH_CUDA_ALLOC_CONF" => Some(s.clone()),
            _ => None,
        })
        .unwrap_or_default()
}

/// Whether expandable segments are on: PyTorch's own `expandable_segments` setting, or
/// `expandable_segments:True` in `PYTORCH_CUDA_ALLOC_CONF`.
pub fn expandable_on(snap: &Snapshot) -> bool {
    let own = snap
        .allocator_settings
        .iter()
        .any(|(k, v)| k == "expandable_segments" && matches!(v, Meta::Bool(true) | Meta::Int(1)));
    let conf = alloc_conf(snap).to_ascii_lowercase().replace(' ', "");
    own || conf.contains("expandable_segments:true")
        || snap.segments.iter().any(|s| s.is_expandable)
}

pub fn knowledge(snap: &Snapshot, sites: &Sites) -> Knowledge {
    if snap.memsnap.is_empty() {
        return Knowledge::Blocks;
    }
    if let Some(line) = torch_allocator_line(snap) {
        if line.starts_with("blocks") {
            return Knowledge::Blocks;
        }
        if line.starts_with("tensors") {
            return Knowledge::Tensors;
        }
        if line.starts_with("segments") {
            return Knowledge::Segments;
        }
    }
    // Files before the `torch_allocator` line: blocks when segments have more than one
    // block or free space; else PyTorch's allocations are segments, unless the allocator
    // was switched to cudaMallocAsync.
    if snap
        .segments
        .iter()
        .any(|s| s.blocks.len() > 1 || s.blocks.iter().any(|b| !b.state.is_active()))
    {
        return Knowledge::Blocks;
    }
    let torch = snap
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .any(|b| sites.library(b.stack) == Library::Torch)
        || (0..snap.stacks.len()).any(|s| sites.library(Some(s as StackId)) == Library::Torch);
    if !torch {
        return Knowledge::NoTorch;
    }
    if alloc_conf(snap).contains("cudaMallocAsync") {
        Knowledge::Tensors
    } else {
        Knowledge::Segments
    }
}

/// The owner name of a live allocation of `library`.
pub fn owner_of(library: Library, k: Knowledge) -> &'static str {
    match library {
        Library::Torch if k == Knowledge::Segments => TORCH_SEGMENTS,
        Library::Torch => TORCH_TENSORS,
        other => other.as_str(),
    }
}

/// Live bytes by owner at one moment: `holders` (requested bytes by stack), the reserved
/// bytes then, and the bytes outside memsnap's record where known.
pub fn owners(
    sites: &Sites,
    k: Knowledge,
    holders: &FxHashMap<Option<StackId>, Tally>,
    reserved: i64,
    outside: Option<i64>,
) -> BTreeMap<String, i64> {
    let mut out: BTreeMap<String, i64> = BTreeMap::new();
    let mut live = 0;
    for (stack, t) in holders {
        *out.entry(owner_of(sites.library(*stack), k).to_string())
            .or_default() += t.bytes;
        live += t.bytes;
    }
    if k == Knowledge::Blocks && reserved > live {
        out.insert(TORCH_CACHE_FREE.to_string(), reserved - live);
    }
    if let Some(o) = outside.filter(|&o| o > 0) {
        out.insert(OUTSIDE.to_string(), o);
    }
    out.retain(|_, b| *b != 0);
    out
}

/// Owners largest first.
pub fn sorted(owners: &BTreeMap<String, i64>) -> Vec<(&str, i64)> {
    let mut v: Vec<(&str, i64)> = owners.iter().map(|(k, b)| (k.as_str(), *b)).collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    v
}

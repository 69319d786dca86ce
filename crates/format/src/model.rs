//! The snapshot as data: PyTorch's memory-snapshot shape with frames and stacks interned.
//!
//! Cold code, no unsafe. The preload's writer builds a [`Snapshot`] and encodes it with
//! `pickle_write`; the CLI gets one from `pickle_read` (memsnap's files and PyTorch's).
//! Field names follow PyTorch's keys (docs/FORMAT.md, "Top-level keys" through "Trace
//! entries") so the codec reads as a one-to-one mapping. Frames and stacks are stored once
//! and referred to by index, which is also how the pickle shares them (memo), and what keeps
//! 100k events with deep stacks small.

use std::sync::Arc;

/// One frame, PyTorch's `{"name", "filename", "line"}`.
#[derive(
    Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct Frame {
    pub name: String,
    pub filename: String,
    pub line: i64,
}

/// Index into [`Snapshot::stacks`]; a stack is a list of frame indices, innermost first.
pub type StackId = u32;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockState {
    ActiveAllocated,
    ActivePendingFree,
    Inactive,
}

impl BlockState {
    pub fn as_str(self) -> &'static str {
        match self {
            BlockState::ActiveAllocated => "active_allocated",
            BlockState::ActivePendingFree => "active_pending_free",
            BlockState::Inactive => "inactive",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "active_allocated" => Some(BlockState::ActiveAllocated),
            // The docstring's name for the same state (docs/FORMAT.md#blocks).
            "active_pending_free" | "active_awaiting_free" => Some(BlockState::ActivePendingFree),
            "inactive" => Some(BlockState::Inactive),
            _ => None,
        }
    }
    pub fn is_active(self) -> bool {
        !matches!(self, BlockState::Inactive)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    pub address: i64,
    pub size: i64,
    pub requested_size: i64,
    pub state: BlockState,
    /// `None` is written as `frames: []`.
    pub stack: Option<StackId>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Segment {
    pub device: i64,
    pub address: i64,
    pub total_size: i64,
    pub stream: i64,
    /// "large" or "small" in PyTorch; memsnap writes "large".
    pub segment_type: String,
    pub segment_pool_id: (i64, i64),
    pub is_expandable: bool,
    pub stack: Option<StackId>,
    /// Must tile `[address, address + total_size)` in address order.
    pub blocks: Vec<Block>,
}

impl Segment {
    /// A segment holding one allocated block of its whole size: the shape memsnap writes
    /// for one `cudaMalloc` (docs/FORMAT.md#one-segment-per-allocation).
    pub fn one_allocation(device: i64, address: i64, size: i64, stack: Option<StackId>) -> Self {
        Segment {
            device,
            address,
            total_size: size,
            stream: 0,
            segment_type: "large".into(),
            segment_pool_id: (0, 0),
            is_expandable: false,
            stack,
            blocks: vec![Block {
                address,
                size,
                requested_size: size,
                state: BlockState::ActiveAllocated,
                stack,
            }],
        }
    }

    /// Σ size of `active_allocated` blocks (PyTorch's `allocated_size`).
    pub fn allocated_size(&self) -> i64 {
        self.blocks
            .iter()
            .filter(|b| b.state == BlockState::ActiveAllocated)
            .map(|b| b.size)
            .sum()
    }
    /// Σ size of active blocks, allocated or pending free (`active_size`).
    pub fn active_size(&self) -> i64 {
        self.blocks
            .iter()
            .filter(|b| b.state.is_active())
            .map(|b| b.size)
            .sum()
    }
    /// Σ requested size of active blocks (`requested_size`).
    pub fn requested_size(&self) -> i64 {
        self.blocks
            .iter()
            .filter(|b| b.state.is_active())
            .map(|b| b.requested_size)
            .sum()
    }
}

/// The trace actions the viewer knows (docs/FORMAT.md#actions). Anything else read from
/// a file is kept as `Other` so the CLI can still show it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Alloc,
    FreeRequested,
    FreeCompleted,
    /// Merged free; PyTorch never writes it, but viewers accept it.
    Free,
    SegmentAlloc,
    SegmentFree,
    SegmentMap,
    SegmentUnmap,
    Snapshot,
    Oom,
    Other(String),
}

/// The actions the viewer knows and their names in files: one table, read both ways
/// ([`Action::as_str`], [`Action::parse`]) and by the pickle writer, which memoizes each name
/// in a slot of its own.
pub const KNOWN_ACTIONS: [(Action, &str); 10] = [
    (Action::Alloc, "alloc"),
    (Action::FreeRequested, "free_requested"),
    (Action::FreeCompleted, "free_completed"),
    (Action::Free, "free"),
    (Action::SegmentAlloc, "segment_alloc"),
    (Action::SegmentFree, "segment_free"),
    (Action::SegmentMap, "segment_map"),
    (Action::SegmentUnmap, "segment_unmap"),
    (Action::Snapshot, "snapshot"),
    (Action::Oom, "oom"),
];

impl Action {
    /// Its row in [`KNOWN_ACTIONS`]; `None` for [`Action::Other`].
    pub fn known_index(&self) -> Option<usize> {
        Some(match self {
            Action::Alloc => 0,
            Action::FreeRequested => 1,
            Action::FreeCompleted => 2,
            Action::Free => 3,
            Action::SegmentAlloc => 4,
            Action::SegmentFree => 5,
            Action::SegmentMap => 6,
            Action::SegmentUnmap => 7,
            Action::Snapshot => 8,
            Action::Oom => 9,
            Action::Other(_) => return None,
        })
    }

    pub fn as_str(&self) -> &str {
        match (self, self.known_index()) {
            (Action::Other(s), _) => s,
            (_, Some(i)) => KNOWN_ACTIONS[i].1,
            (_, None) => "",
        }
    }

    pub fn parse(s: &str) -> Self {
        KNOWN_ACTIONS
            .iter()
            .find(|(_, name)| *name == s)
            .map_or_else(|| Action::Other(s.to_string()), |(a, _)| a.clone())
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct TraceEntry {
    pub action: Action,
    /// Absent only for `oom` (and `snapshot`) in PyTorch's files; memsnap always writes it.
    pub addr: i64,
    pub size: i64,
    pub stream: i64,
    pub time_us: i64,
    pub stack: Option<StackId>,
    /// Only on `oom`: free bytes reported by cuMemGetInfo.
    pub device_free: Option<i64>,
    /// memsnap writes the API that made the event (`cudaMallocAsync`, `cuMemMap`, ...).
    /// Shared: a file has a handful of distinct values over millions of events, so the
    /// reader interns them instead of allocating one string per event.
    pub user_metadata: Option<Arc<str>>,
}

impl TraceEntry {
    /// An entry of `action` with every other field empty (0 or `None`), to be filled in.
    pub fn new(action: Action) -> Self {
        TraceEntry {
            action,
            addr: 0,
            size: 0,
            stream: 0,
            time_us: 0,
            stack: None,
            device_free: None,
            user_metadata: None,
        }
    }
}

/// A value in `allocator_settings` or memsnap's own metadata: JSON-like, no BigInt.
#[derive(Clone, Debug, PartialEq)]
pub enum Meta {
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    List(Vec<Meta>),
    Dict(Vec<(String, Meta)>),
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    /// Unique frames.
    pub frames: Vec<Frame>,
    /// Unique stacks: frame indices, innermost first.
    pub stacks: Vec<Vec<u32>>,
    /// Every segment of every device, sorted by (device, address).
    pub segments: Vec<Segment>,
    /// One list per device ordinal (index = device), oldest event first.
    pub device_traces: Vec<Vec<TraceEntry>>,
    /// PyTorch's `allocator_settings` dict (memsnap records its own settings here too).
    pub allocator_settings: Vec<(String, Meta)>,
    /// memsnap's top-level `memsnap` key: counters, dropped events, routes, trigger.
    /// Viewers ignore unknown top-level keys. Empty for PyTorch's files.
    pub memsnap: Vec<(String, Meta)>,
    /// Step boundaries: the `external_annotations` entries named `memsnap.step`, in file
    /// order (other annotations, such as PyTorch's `record_function` marks, are not kept).
    pub step_marks: Vec<StepMark>,
}

/// One `{"name": "memsnap.step", "stage": "START", "step": N, "device": d, "time_us": t}`
/// entry of `external_annotations`: step `step` starts on `device` at `time_us`; the entries
/// of `device_traces[device]` with `time_us >= t` belong to that step or a later one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepMark {
    pub step: i64,
    pub device: i64,
    pub time_us: i64,
}

/// The `name` of a step mark in `external_annotations`.
pub const STEP_MARK_NAME: &str = "memsnap.step";

impl Snapshot {
    /// The frames of a stack, innermost first (empty for `None`).
    pub fn stack_frames(&self, stack: Option<StackId>) -> impl Iterator<Item = &Frame> + '_ {
        let ids: &[u32] = match stack {
            Some(id) => self
                .stacks
                .get(id as usize)
                .map(Vec::as_slice)
                .unwrap_or(&[]),
            None => &[],
        };
        ids.iter().filter_map(|&f| self.frames.get(f as usize))
    }

    /// Looks up a key of memsnap's metadata.
    pub fn meta(&self, key: &str) -> Option<&Meta> {
        self.memsnap.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_known_action_is_its_row_and_reads_back_by_name() {
        for (i, (action, name)) in KNOWN_ACTIONS.iter().enumerate() {
            assert_eq!(action.known_index(), Some(i));
            assert_eq!(action.as_str(), *name);
            assert_eq!(&Action::parse(name), action);
        }
        let other = Action::parse("segment_move");
        assert_eq!(other, Action::Other("segment_move".into()));
        assert_eq!(
            (other.as_str(), other.known_index()),
            ("segment_move", None)
        );
    }
}

//! What memsnap knows of PyTorch's caching allocator in this process: whether its blocks
//! are recorded, or why not.
//!
//! Process-wide state both sides read: written once by the hook side (`pytorch/`, at
//! attach time), read by the writer for each snapshot's `torch_allocator` line. The writer
//! may switch block events off ([`BLOCK_EVENTS`]) when the first ones fail its check; the
//! tracker then returns at once. Under PyTorch's `backend:cudaMallocAsync` no segment
//! allocation ever comes, so stream-ordered allocations look for the allocator too; they
//! stop after one look ([`STREAM_ALLOCATIONS_DONE_LOOKING`]: each look takes the loader's
//! lock), and the writer sends them looking again when libraries were loaded since and
//! nothing was decided. Not hot except [`block_events_on`] and
//! [`stream_allocations_look`] (one relaxed load each).

use super::hook_line::HOOK_LINE;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

/// How PyTorch's allocator is seen, once decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllocatorRoute {
    /// A trace tracker is attached: every block is recorded. `version` is PyTorch's.
    Blocks { version: String },
    /// PyTorch's allocator is not the caching allocator (`backend:cudaMallocAsync`, or a
    /// pluggable allocator): its tensors are recorded through their own CUDA calls.
    NotCaching { version: String },
    /// The caching allocator is there but cannot be reached; segments only, for `reason`.
    SegmentsOnly { reason: String },
}

static ROUTE: OnceLock<AllocatorRoute> = OnceLock::new();

/// Off once the writer found the allocator's events inconsistent with the CUDA calls it
/// saw (a layout memsnap misread): the tracker then ignores every entry. On the line every
/// hooked call reads (`process::hook_line`).
pub const BLOCK_EVENTS: &AtomicBool = &HOOK_LINE.block_events;

/// On once stream-ordered allocations (`cudaMallocAsync`, `cuMemAllocAsync` and their pool
/// forms) stopped looking for PyTorch's allocator. Off again only by the writer
/// ([`look_again_at_stream_allocations`]). On the line every hooked call reads.
pub const STREAM_ALLOCATIONS_DONE_LOOKING: &AtomicBool = &HOOK_LINE.stream_allocations_done_looking;

/// Records the decision (the first one wins; the hook side decides once per process).
pub fn decide(route: AllocatorRoute) {
    let _ = ROUTE.set(route);
}

/// The decision, if PyTorch's allocator was found in this process.
pub fn route() -> Option<&'static AllocatorRoute> {
    ROUTE.get()
}

#[inline(always)]
pub fn block_events_on() -> bool {
    BLOCK_EVENTS.load(Relaxed)
}

/// Hook side: whether a stream-ordered allocation should look for PyTorch's allocator.
#[inline(always)]
pub fn stream_allocations_look() -> bool {
    !STREAM_ALLOCATIONS_DONE_LOOKING.load(Relaxed)
}

/// Hook side, after a stream-ordered allocation looked (whatever it found).
pub fn stream_allocations_stop_looking() {
    STREAM_ALLOCATIONS_DONE_LOOKING.store(true, Relaxed);
}

/// Writer: whether stream-ordered allocations stopped looking with nothing decided (then
/// libraries loaded since may have brought PyTorch).
pub fn stream_allocations_stopped_undecided() -> bool {
    STREAM_ALLOCATIONS_DONE_LOOKING.load(Relaxed) && route().is_none()
}

/// Writer: libraries were loaded since stream-ordered allocations last looked, and nothing
/// is decided: the next one looks again. A write to the hooks' shared line, made only when
/// the loader's count of loads moved.
pub fn look_again_at_stream_allocations() {
    if route().is_none() {
        STREAM_ALLOCATIONS_DONE_LOOKING.store(false, Relaxed);
    }
}

/// The snapshot's one-line description: starts with `blocks` when blocks are recorded,
/// `segments` when only the allocator's segments are, `tensors` when PyTorch allocates
/// each tensor through CUDA (then every tensor is a CUDA call memsnap records).
pub fn describe(rejected: Option<&str>) -> Option<String> {
    Some(match (route()?, rejected) {
        (AllocatorRoute::Blocks { version }, None) => {
            format!("blocks: PyTorch {version} caching allocator, through its trace tracker")
        }
        (AllocatorRoute::Blocks { version }, Some(why)) => {
            format!("segments only: PyTorch {version}: block events set aside ({why})")
        }
        (AllocatorRoute::NotCaching { version }, _) => format!(
            "tensors: PyTorch {version} does not use its caching allocator here; \
             each tensor is recorded through its own CUDA call"
        ),
        (AllocatorRoute::SegmentsOnly { reason }, _) => format!("segments only: {reason}"),
    })
}

//! Builds a [`Snapshot`] from the writer's state.
//!
//! Cold (writer thread). Frames and stacks are interned across dumps, so each unique
//! stack is symbolized once per process and written once per file (the encoder shares it
//! through the pickle memo). [`live_sample`] answers `memsnap top` from the same caches.

use crate::channel::event::{Api, PoolId};
use crate::snapshot::live::{DeviceSample, LiveGroup, Sample};
use crate::snapshot::model::{
    Action as ModelAction, Block, BlockState, Frame, Meta, Segment, Snapshot, StackId, StepMark,
    TraceEntry,
};
use crate::writer::stacks::{RawStackId, StackTable};
use crate::writer::state::{Action, Device, Live, State};
use rustc_hash::FxHashMap;

#[derive(Default)]
pub struct FrameInterner {
    frames: Vec<Frame>,
    frame_ids: FxHashMap<Frame, u32>,
    stacks: Vec<Vec<u32>>,
    stack_ids: FxHashMap<Vec<u32>, StackId>,
    by_raw: FxHashMap<RawStackId, Option<StackId>>,
}

impl FrameInterner {
    pub fn stack(&mut self, raw: Option<RawStackId>, table: &mut StackTable) -> Option<StackId> {
        let raw = raw?;
        if let Some(&known) = self.by_raw.get(&raw) {
            return known;
        }
        let frames = table.frames(raw);
        let id = if frames.is_empty() {
            None
        } else {
            let ids: Vec<u32> = frames
                .iter()
                .map(|f| match self.frame_ids.get(f) {
                    Some(&i) => i,
                    None => {
                        let i = self.frames.len() as u32;
                        self.frames.push(f.clone());
                        self.frame_ids.insert(f.clone(), i);
                        i
                    }
                })
                .collect();
            let next = self.stacks.len() as StackId;
            let id = *self.stack_ids.entry(ids.clone()).or_insert(next);
            if id == next {
                self.stacks.push(ids);
            }
            Some(id)
        };
        self.by_raw.insert(raw, id);
        id
    }
}

fn action(a: Action) -> ModelAction {
    match a {
        Action::SegmentAlloc => ModelAction::SegmentAlloc,
        Action::Alloc => ModelAction::Alloc,
        Action::FreeRequested => ModelAction::FreeRequested,
        Action::FreeCompleted => ModelAction::FreeCompleted,
        Action::SegmentFree => ModelAction::SegmentFree,
        Action::SegmentMap => ModelAction::SegmentMap,
        Action::SegmentUnmap => ModelAction::SegmentUnmap,
        Action::Oom => ModelAction::Oom,
        Action::Snapshot => ModelAction::Snapshot,
    }
}

/// Addresses, sizes and times are below 2^63 (CUDA addresses are below 2^48); the format
/// wants signed integers (docs/FORMAT.md#integers).
fn int(v: u64) -> i64 {
    v.min(i64::MAX as u64) as i64
}

/// The snapshot of the current state. `history_from[d]`, when given, drops device `d`'s
/// events older than that global event index (a recording window); dropping a prefix
/// keeps the history valid.
pub fn build(
    state: &State,
    table: &mut StackTable,
    interner: &mut FrameInterner,
    history_from: Option<&[u64]>,
) -> Snapshot {
    let mut snap = Snapshot::default();
    // One shared string per CUDA entry point, not one per event.
    let api_names: Vec<std::sync::Arc<str>> = Api::ALL.iter().map(|a| a.name().into()).collect();
    for (d, dev) in state.devices.iter().enumerate() {
        let from = history_from.and_then(|h| h.get(d)).copied().unwrap_or(0);
        let first_index = dev.trace_total - dev.trace.len() as u64;
        let skip = from.saturating_sub(first_index) as usize;
        let trace = dev
            .trace
            .iter()
            .skip(skip)
            .map(|r| TraceEntry {
                action: action(r.action),
                addr: int(r.address()),
                size: int(r.size),
                stream: int(r.stream),
                time_us: int(r.time_us),
                stack: interner.stack(r.stack.get(), table),
                device_free: r.device_free(),
                user_metadata: api_names.get(r.api as usize).cloned(),
            })
            .collect();
        snap.device_traces.push(trace);
        segments(d as i64, dev, table, interner, &mut snap.segments);
    }
    snap.step_marks = step_marks(state, &snap.device_traces);
    snap.frames = interner.frames.clone();
    snap.stacks = interner.stacks.clone();
    snap
}

/// Step boundaries inside each device's written history (written as PyTorch's
/// `external_annotations` entries `{"name": "memsnap.step", "stage": "START", "step": N,
/// "device": d, "time_us": t}`: the history's entries from `t` on come after N completed
/// steps, docs/FORMAT.md#step-boundaries).
fn step_marks(state: &State, traces: &[Vec<TraceEntry>]) -> Vec<StepMark> {
    let mut out = Vec::new();
    for (d, trace) in traces.iter().enumerate() {
        let Some(first) = trace.first() else {
            continue;
        };
        for &(steps, time_us) in state
            .step_marks
            .iter()
            .filter(|m| int(m.1) >= first.time_us)
        {
            out.push(StepMark {
                step: int(steps),
                device: d as i64,
                time_us: int(time_us),
            });
        }
    }
    out
}

fn segments(
    device: i64,
    dev: &Device,
    table: &mut StackTable,
    interner: &mut FrameInterner,
    out: &mut Vec<Segment>,
) {
    let mut segs: Vec<Segment> = Vec::with_capacity(dev.allocs.len() + 4);
    let mut block = |addr: u64, live: &Live| Block {
        address: int(addr),
        size: int(live.size),
        requested_size: int(live.size),
        state: BlockState::ActiveAllocated,
        stack: interner.stack(live.stack, table),
    };
    for (&addr, live) in dev.allocs.iter() {
        let b = block(addr, live);
        segs.push(Segment {
            device,
            address: int(addr),
            total_size: int(live.size),
            stream: int(live.stream),
            segment_type: "large".to_string(),
            segment_pool_id: (0, 0),
            is_expandable: false,
            stack: b.stack,
            blocks: vec![b],
        });
    }
    // Contiguous mappings form one mapped range (as the viewer merges `segment_map`s),
    // one block per mapping.
    let mut current: Option<(Segment, u64)> = None;
    for (&addr, live) in dev.mappings.iter() {
        let b = block(addr, live);
        match &mut current {
            Some((seg, end)) if *end == addr => {
                seg.total_size += int(live.size);
                seg.blocks.push(b);
                *end = addr + live.size;
            }
            _ => {
                if let Some((seg, _)) = current.take() {
                    segs.push(seg);
                }
                current = Some((
                    Segment {
                        device,
                        address: int(addr),
                        total_size: int(live.size),
                        stream: 0,
                        segment_type: "large".to_string(),
                        segment_pool_id: (0, 0),
                        is_expandable: true,
                        stack: b.stack,
                        blocks: vec![b],
                    },
                    addr + live.size,
                ));
            }
        }
    }
    if let Some((seg, _)) = current {
        segs.push(seg);
    }
    cache_segments(device, dev, table, interner, &mut segs);
    segs.sort_by_key(|s| s.address);
    out.extend(segs);
}

/// PyTorch's caching-allocator segments with their blocks, as PyTorch's own snapshot has
/// them: live blocks in address order, the free space between them as inactive blocks
/// (free space is always merged, so one block per gap), a contiguous run of expandable
/// mappings as one segment.
fn cache_segments(
    device: i64,
    dev: &Device,
    table: &mut StackTable,
    interner: &mut FrameInterner,
    out: &mut Vec<Segment>,
) {
    let cache = &dev.cache;
    let mut starts = cache.segments.keys().copied().peekable();
    while let Some(start) = starts.next() {
        let Some((first, end, seg)) = cache.region_of(start) else {
            continue;
        };
        if first != start {
            continue; // inside a region already written
        }
        while starts.next_if(|&s| s < end).is_some() {}
        let stack = interner.stack(seg.live.stack, table);
        let mut blocks = Vec::new();
        let mut at = start;
        for (&addr, block) in cache.blocks.range(start..end) {
            if addr > at {
                blocks.push(inactive(at, addr - at));
            }
            blocks.push(Block {
                address: int(addr),
                size: int(block.size),
                requested_size: int(block.requested),
                state: if block.pending_free {
                    BlockState::ActivePendingFree
                } else {
                    BlockState::ActiveAllocated
                },
                stack: interner.stack(block.stack, table),
            });
            at = addr + block.size;
        }
        if at < end {
            blocks.push(inactive(at, end - at));
        }
        let small = !seg.expandable && seg.live.size == 2 << 20;
        out.push(Segment {
            device,
            address: int(start),
            total_size: int(end - start),
            stream: int(seg.live.stream),
            segment_type: if small { "small" } else { "large" }.to_string(),
            segment_pool_id: pool_id(seg.pool),
            is_expandable: seg.expandable,
            stack,
            blocks,
        });
    }
}

/// A pool's id as PyTorch writes it: its two 64-bit ids as `int64_t` (bit for bit).
fn pool_id(pool: PoolId) -> (i64, i64) {
    (pool.first as i64, pool.second as i64)
}

fn inactive(address: u64, size: u64) -> Block {
    Block {
        address: int(address),
        size: int(size),
        requested_size: 0,
        state: BlockState::Inactive,
        stack: None,
    }
}

/// Helpers for metadata dictionaries.
pub fn meta_int(key: &str, v: u64) -> (String, Meta) {
    (key.to_string(), Meta::Int(int(v)))
}
pub fn meta_str(key: &str, v: &str) -> (String, Meta) {
    (key.to_string(), Meta::Str(v.to_string()))
}

/// What is live now, grouped by device and stack, with the frames and stacks of the
/// snapshot interner from `known_frames` and `known_stacks` on (what the asking client does
/// not hold yet). Stacks not interned before go through the same symbolization caches as a
/// dump. The caller fills in the counters. Costs one pass over the live set with a hash
/// lookup per block, then one lookup per distinct stack.
pub fn live_sample(
    state: &State,
    table: &mut StackTable,
    interner: &mut FrameInterner,
    known_frames: u32,
    known_stacks: u32,
) -> Sample {
    let mut sample = Sample::default();
    let mut groups: FxHashMap<(u32, Option<RawStackId>), (u64, u64)> = FxHashMap::default();
    for (d, dev) in state.devices.iter().enumerate() {
        let mut reserved = 0u64;
        for live in dev.allocs.values().chain(dev.mappings.values()) {
            reserved += live.size;
            let g = groups.entry((d as u32, live.stack)).or_default();
            g.0 += live.size;
            g.1 += 1;
        }
        // PyTorch's blocks are the live allocations; its segments are reserved.
        reserved += dev.cache.reserved_bytes;
        for block in dev.cache.blocks.values() {
            let g = groups.entry((d as u32, block.stack)).or_default();
            g.0 += block.size;
            g.1 += 1;
        }
        sample.devices.push(DeviceSample {
            device: d as u32,
            live_bytes: dev.live_bytes,
            reserved_bytes: reserved,
            peak_bytes: dev.peak_ever,
            live_allocations: (dev.allocs.len() + dev.mappings.len() + dev.cache.blocks.len())
                as u64,
            ooms: dev.ooms,
        });
    }
    // Raw stacks with the same frames are one interned stack: merge their groups.
    let mut merged: FxHashMap<(u32, Option<StackId>), (u64, u64)> = FxHashMap::default();
    for ((device, raw), (bytes, count)) in groups {
        let g = merged
            .entry((device, interner.stack(raw, table)))
            .or_default();
        g.0 += bytes;
        g.1 += count;
    }
    sample.groups = merged
        .into_iter()
        .map(|((device, stack), (bytes, count))| LiveGroup {
            device,
            stack,
            bytes,
            count,
        })
        .collect();
    sample
        .groups
        .sort_unstable_by_key(|g| (g.device, std::cmp::Reverse(g.bytes), g.stack));
    let frames_from = (known_frames as usize).min(interner.frames.len());
    let stacks_from = (known_stacks as usize).min(interner.stacks.len());
    sample.frames_from = frames_from as u32;
    sample.frames = interner.frames[frames_from..].to_vec();
    sample.stacks_from = stacks_from as u32;
    sample.stacks = interner.stacks[stacks_from..].to_vec();
    sample
}

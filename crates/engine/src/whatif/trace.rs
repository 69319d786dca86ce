//! What a replay needs from one device's recorded history: PyTorch's requests and frees in
//! order (with their sizes, streams, stacks and roles), the allocations of other libraries,
//! the segments PyTorch's allocator took and gave back (to check the model against), and
//! the allocator's state when the history begins. Which entries are whose depends on who
//! wrote the file (docs/WHATIF.md, "What is replayed"). Cold code, one pass per device.

use crate::explain::roles::{self, Role, StackRole};
use memsnap_format::model::{Action, BlockState, Meta, Segment, Snapshot, StackId, TraceEntry};
use rustc_hash::FxHashMap;

/// The API memsnap names the caching allocator's own entries with.
pub const CACHING_ALLOCATOR: &str = "CUDACachingAllocator";
/// The stream-ordered allocations PyTorch makes under `backend:cudaMallocAsync`.
const ASYNC_APIS: &[&str] = &[
    "cudaMallocAsync",
    "cudaMallocFromPoolAsync",
    "cuMemAllocAsync",
    "cuMemAllocFromPoolAsync",
];

/// One allocation PyTorch asked for.
#[derive(Clone, Debug)]
pub struct Request {
    /// Requested bytes.
    pub size: u64,
    /// Where the recording placed it.
    pub addr: u64,
    pub stream: u64,
    /// Its entry in the device's history.
    pub event: u32,
    pub stack: Option<StackId>,
    pub role: Role,
    /// The private pool it was served from (a CUDA graph's or a `MemPool`'s).
    pub pool: Option<(i64, i64)>,
    /// Its free waits for other streams (`record_stream`): other allocator entries come
    /// between its `free_requested` and its `free_completed`.
    pub waits: bool,
    /// Freed within the history.
    pub freed: bool,
}

/// A segment operation of PyTorch's allocator as recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SegKind {
    Alloc,
    Free,
    Map,
    Unmap,
}

#[derive(Clone, Copy, Debug)]
pub struct SegRec {
    pub kind: SegKind,
    pub addr: u64,
    pub size: u64,
    pub event: u32,
}

/// An allocation of another library (replayed as recorded).
#[derive(Clone, Copy, Debug)]
pub struct Outside {
    pub addr: u64,
    pub size: u64,
    pub stack: Option<StackId>,
    pub event: u32,
}

/// One step of the replay, in recorded order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Request `id` is made.
    Alloc(u32),
    /// The program frees request `id` (`free_requested`).
    Free(u32),
    /// The free of `id` completes (`free_completed`).
    Complete(u32),
    /// Request `id` ran out of memory in the recording (PyTorch's `oom`): replayed as a
    /// request that is never freed.
    Failed(u32),
    /// Another library's allocation `i` / its free.
    OutsideAlloc(u32),
    OutsideFree(u32),
    /// Recorded segment operation `i` of PyTorch's allocator.
    Segment(u32),
}

/// A segment that existed when the history began.
#[derive(Clone, Debug)]
pub struct StartSegment {
    pub addr: u64,
    pub size: u64,
    pub stream: u64,
    pub small: bool,
    pub pool: Option<(i64, i64)>,
    /// Live blocks: (address, size, requested, the request whose free is in the history).
    pub live: Vec<(u64, u64, u64, Option<u32>)>,
}

/// Who wrote the file and what it holds of PyTorch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// PyTorch's own `_dump_snapshot`.
    Pytorch,
    /// memsnap, with the caching allocator's blocks.
    MemsnapBlocks,
    /// memsnap, PyTorch under `backend:cudaMallocAsync`: each tensor a CUDA allocation.
    MemsnapTensors,
}

/// One device's history, ready to replay.
#[derive(Clone, Debug)]
pub struct DeviceTrace {
    pub device: i64,
    pub source: Source,
    pub requests: Vec<Request>,
    pub ops: Vec<Op>,
    pub segments: Vec<SegRec>,
    pub outside: Vec<Outside>,
    /// The allocator's segments when the history began (empty when it begins at the start).
    pub start: Vec<StartSegment>,
    /// Why the history cannot be replayed, if it cannot.
    pub refused: Option<String>,
    /// The most PyTorch's reserved bytes reached in the recording.
    pub recorded_peak_reserved: u64,
    /// What PyTorch, the other libraries and the device's free memory added up to at the
    /// first out-of-memory entry: what the process could hold then.
    pub limit_at_oom: Option<u64>,
    /// PyTorch's and the other libraries' bytes at the end (beside the driver's free bytes
    /// then, what the process could hold).
    pub held_at_end: u64,
    /// The first address CUDA handed out, and whether later segments came at lower
    /// addresses (the order the model hands addresses out in, where it must choose).
    pub first_addr: Option<u64>,
    pub descending: bool,
    /// The first recorded expandable mapping.
    pub first_map: Option<u64>,
}

fn api(e: &TraceEntry) -> &str {
    e.user_metadata.as_deref().unwrap_or("")
}

/// Whose entry this is in a memsnap file with blocks.
fn is_cache(e: &TraceEntry) -> bool {
    api(e) == CACHING_ALLOCATOR
}

/// Reads each device's history of `snap` for replay. `torch_stack`: whether a stack is
/// PyTorch's (a CUDA call that ran out of memory inside its allocator).
pub fn devices(
    snap: &Snapshot,
    source: Source,
    torch_stack: &dyn Fn(Option<StackId>) -> bool,
) -> Vec<DeviceTrace> {
    let roles = roles::of_stacks(snap);
    snap.device_traces
        .iter()
        .enumerate()
        .filter(|(_, t)| !t.is_empty())
        .map(|(d, t)| device(snap, d as i64, t, source, &roles, torch_stack))
        .collect()
}

/// PyTorch's segments of `device` in the snapshot itself.
fn end_segments(snap: &Snapshot, device: i64) -> Vec<&Segment> {
    snap.segments
        .iter()
        .filter(|s| s.device == device)
        .collect()
}

/// memsnap's per-device `history_dropped`.
fn dropped(snap: &Snapshot, device: i64) -> i64 {
    crate::device::history_dropped(snap, device).unwrap_or(0)
}

struct Builder<'a> {
    t: DeviceTrace,
    /// Live requests by recorded address.
    live: FxHashMap<u64, u32>,
    /// Live outside allocations by address.
    outside_live: FxHashMap<u64, u32>,
    /// Recorded PyTorch segments by address (size), expandable mappings by start.
    segs: FxHashMap<u64, u64>,
    maps: std::collections::BTreeMap<u64, u64>,
    /// Requests allocated before the history began (their free is in it).
    pre: Vec<u32>,
    /// Requests of that kind whose free completed within the history.
    pre_gone: usize,
    /// Segments freed that the history never allocated: (address, size, entry).
    pre_segments: Vec<(u64, u64)>,
    unmapped_before: bool,
    /// The request whose `free_requested` was the latest allocator entry.
    freeing: Option<u32>,
    /// An address another library (or a tensor) just freed: its `segment_free` follows.
    just_freed: Option<u64>,
    /// PyTorch's reserved bytes since the history began (below zero when it frees segments
    /// older than the history), and their most.
    reserved: i64,
    peak_reserved: i64,
    outside_bytes: u64,
    /// (reserved, other libraries, the driver's free bytes) at the first out-of-memory entry.
    oom_sample: Option<(i64, u64, u64)>,
    /// Tensors of the stream-ordered backend: their live bytes and the most of them.
    tensors: u64,
    peak_tensors: u64,
    last_seg_addr: Option<u64>,
    ups: u32,
    downs: u32,
    roles: &'a [StackRole],
    torch_stack: &'a dyn Fn(Option<StackId>) -> bool,
    /// A CUDA call of PyTorch's that ran out of memory, with no allocator entry after it
    /// yet: memsnap wrote its out-of-memory snapshot there, before PyTorch's own entry.
    cuda_oom: Option<(TraceEntry, u32)>,
}

fn device(
    snap: &Snapshot,
    dev: i64,
    entries: &[TraceEntry],
    source: Source,
    roles: &[StackRole],
    torch_stack: &dyn Fn(Option<StackId>) -> bool,
) -> DeviceTrace {
    let mut b = Builder {
        t: DeviceTrace {
            device: dev,
            source,
            requests: Vec::new(),
            ops: Vec::with_capacity(entries.len()),
            segments: Vec::new(),
            outside: Vec::new(),
            start: Vec::new(),
            refused: None,
            recorded_peak_reserved: 0,
            limit_at_oom: None,
            held_at_end: 0,
            first_addr: None,
            descending: false,
            first_map: None,
        },
        live: FxHashMap::default(),
        outside_live: FxHashMap::default(),
        segs: FxHashMap::default(),
        maps: Default::default(),
        pre: Vec::new(),
        pre_gone: 0,
        pre_segments: Vec::new(),
        unmapped_before: false,
        freeing: None,
        just_freed: None,
        reserved: 0,
        peak_reserved: 0,
        outside_bytes: 0,
        oom_sample: None,
        tensors: 0,
        peak_tensors: 0,
        last_seg_addr: None,
        ups: 0,
        downs: 0,
        roles,
        torch_stack,
        cuda_oom: None,
    };
    let mut i = 0;
    while i < entries.len() {
        i += b.entry(entries, i);
    }
    b.finish(snap)
}

impl Builder<'_> {
    /// One entry (or a pair that belongs together); returns how many were used.
    fn entry(&mut self, entries: &[TraceEntry], i: usize) -> usize {
        let e = &entries[i];
        let ev = i as u32;
        let source = self.t.source;
        // The allocator's own entries (all of them in PyTorch's files).
        let ours = match source {
            Source::Pytorch => true,
            Source::MemsnapBlocks => is_cache(e),
            Source::MemsnapTensors => false,
        };
        if ours {
            self.cuda_oom = None;
        }
        match e.action {
            Action::Alloc if ours => self.alloc(e, ev),
            Action::FreeRequested if ours => self.free_requested(e.addr as u64),
            Action::FreeCompleted | Action::Free if ours => self.free_completed(e.addr as u64),
            Action::Oom if ours => {
                self.note_freeing();
                self.oom_limit(e);
                let id = self.request(e, ev);
                self.t.ops.push(Op::Failed(id));
            }
            Action::Oom => {
                self.oom_limit(e);
                if source == Source::MemsnapBlocks && (self.torch_stack)(e.stack) {
                    self.cuda_oom = Some((e.clone(), ev));
                }
            }
            Action::SegmentAlloc | Action::SegmentMap if source != Source::Pytorch => {
                // memsnap writes `segment_alloc` (or `segment_map`) + `alloc` for another
                // library's allocation; a lone one is PyTorch's segment.
                if let Some(next) = entries.get(i + 1)
                    && next.action == Action::Alloc
                    && next.addr == e.addr
                    && !is_cache(next)
                {
                    self.outside_alloc(next, ev + 1, source);
                    return 2;
                }
                self.segment(e, ev);
            }
            Action::SegmentAlloc | Action::SegmentMap => self.segment(e, ev),
            Action::Alloc => self.outside_alloc(e, ev, source),
            Action::FreeCompleted | Action::Free | Action::FreeRequested => {
                self.outside_free(e, source)
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                // Another library's free (and a tensor's) ends with its own `segment_free`.
                let addr = e.addr as u64;
                if source == Source::Pytorch {
                    self.segment(e, ev);
                } else if self.just_freed.take() == Some(addr) {
                } else if self.outside_live.contains_key(&addr) {
                    self.end_outside(addr);
                } else if source == Source::MemsnapBlocks {
                    self.segment(e, ev);
                }
            }
            _ => {}
        }
        1
    }

    /// The entry after a `free_requested` settles whether that free waited.
    fn note_freeing(&mut self) {
        if let Some(id) = self.freeing.take() {
            self.t.requests[id as usize].waits = true;
        }
    }

    fn request(&mut self, e: &TraceEntry, ev: u32) -> u32 {
        self.t.requests.push(Request {
            size: e.size.max(0) as u64,
            addr: e.addr as u64,
            stream: e.stream as u64,
            event: ev,
            stack: e.stack,
            role: Role::Other,
            pool: None,
            waits: false,
            freed: false,
        });
        (self.t.requests.len() - 1) as u32
    }

    fn alloc(&mut self, e: &TraceEntry, ev: u32) {
        self.note_freeing();
        let id = self.request(e, ev);
        self.live.insert(e.addr as u64, id);
        self.t.ops.push(Op::Alloc(id));
    }

    fn free_requested(&mut self, addr: u64) {
        self.note_freeing();
        let id = match self.live.get(&addr) {
            Some(&id) => id,
            None => {
                // Allocated before the history began.
                let id = self.t.requests.len() as u32;
                self.t.requests.push(Request {
                    size: 0,
                    addr,
                    stream: 0,
                    event: 0,
                    stack: None,
                    role: Role::Other,
                    pool: None,
                    waits: false,
                    freed: true,
                });
                self.pre.push(id);
                self.live.insert(addr, id);
                id
            }
        };
        self.t.requests[id as usize].freed = true;
        self.freeing = Some(id);
        self.t.ops.push(Op::Free(id));
    }

    fn free_completed(&mut self, addr: u64) {
        let id = self.live.remove(&addr);
        match self.freeing.take() {
            // Right after its own `free_requested`: it did not wait.
            Some(f) if Some(f) == id => {}
            Some(f) => self.t.requests[f as usize].waits = true,
            None => {}
        }
        let Some(id) = id else {
            // Its `free_requested` came before the history: a block that waited then.
            self.pre_gone += 1;
            return;
        };
        if self.pre.contains(&id) {
            self.pre_gone += 1;
        }
        self.t.ops.push(Op::Complete(id));
    }

    fn segment(&mut self, e: &TraceEntry, ev: u32) {
        self.note_freeing();
        let (addr, size) = (e.addr as u64, e.size.max(0) as u64);
        let kind = match e.action {
            Action::SegmentAlloc => SegKind::Alloc,
            Action::SegmentFree => SegKind::Free,
            Action::SegmentMap => SegKind::Map,
            _ => SegKind::Unmap,
        };
        match kind {
            SegKind::Alloc => {
                self.segs.insert(addr, size);
                self.reserved += size as i64;
                self.t.first_addr.get_or_insert(addr);
                if let Some(last) = self.last_seg_addr {
                    if addr > last {
                        self.ups += 1;
                    } else {
                        self.downs += 1;
                    }
                }
                self.last_seg_addr = Some(addr);
            }
            SegKind::Free => {
                if self.segs.remove(&addr).is_none() {
                    self.pre_segments.push((addr, size));
                }
                self.reserved -= size as i64;
            }
            SegKind::Map => {
                self.maps.insert(addr, size);
                self.reserved += size as i64;
                self.t.first_map.get_or_insert(addr);
            }
            SegKind::Unmap => {
                // The mappings inside the range (memsnap records PyTorch's page by page).
                let inside: Vec<(u64, u64)> = self
                    .maps
                    .range(addr..addr + size)
                    .map(|(&a, &s)| (a, s))
                    .collect();
                let covered: u64 = inside.iter().map(|m| m.1).sum();
                if covered < size {
                    self.unmapped_before = true;
                }
                for (a, s) in inside {
                    self.maps.remove(&a);
                    // A range mapped in one call may come back in parts.
                    let end = a + s;
                    let cut_end = (addr + size).min(end);
                    if cut_end < end {
                        self.maps.insert(cut_end, end - cut_end);
                    }
                }
                self.reserved -= size as i64;
            }
        }
        self.peak_reserved = self.peak_reserved.max(self.reserved);
        self.t.segments.push(SegRec {
            kind,
            addr,
            size,
            event: ev,
        });
        self.t
            .ops
            .push(Op::Segment((self.t.segments.len() - 1) as u32));
    }

    fn outside_alloc(&mut self, e: &TraceEntry, ev: u32, source: Source) {
        let addr = e.addr as u64;
        if source == Source::MemsnapTensors && ASYNC_APIS.contains(&api(e)) {
            // A tensor of PyTorch's stream-ordered backend.
            self.note_freeing();
            let id = self.request(e, ev);
            self.live.insert(addr, id);
            self.t.ops.push(Op::Alloc(id));
            self.tensors += e.size.max(0) as u64;
            self.peak_tensors = self.peak_tensors.max(self.tensors);
            return;
        }
        let size = e.size.max(0) as u64;
        self.t.first_addr.get_or_insert(addr);
        self.t.outside.push(Outside {
            addr,
            size,
            stack: e.stack,
            event: ev,
        });
        let i = (self.t.outside.len() - 1) as u32;
        self.outside_live.insert(addr, i);
        self.outside_bytes += size;
        self.t.ops.push(Op::OutsideAlloc(i));
    }

    fn outside_free(&mut self, e: &TraceEntry, source: Source) {
        let addr = e.addr as u64;
        if source == Source::MemsnapTensors && self.live.contains_key(&addr) {
            // A tensor's free: `free_requested`, `free_completed` (the stream-ordered
            // allocator orders it after the streams' work itself), `segment_free`.
            if e.action == Action::FreeRequested {
                if let Some(&id) = self.live.get(&addr) {
                    self.t.requests[id as usize].freed = true;
                    self.t.ops.push(Op::Free(id));
                }
            } else if let Some(id) = self.live.remove(&addr) {
                self.t.ops.push(Op::Complete(id));
                self.tensors -= self.t.requests[id as usize].size;
                self.just_freed = Some(addr);
            }
            return;
        }
        if e.action != Action::FreeRequested && self.outside_live.contains_key(&addr) {
            self.end_outside(addr);
            self.just_freed = Some(addr);
        }
    }

    fn end_outside(&mut self, addr: u64) {
        if let Some(i) = self.outside_live.remove(&addr) {
            self.outside_bytes -= self.t.outside[i as usize].size;
            self.t.ops.push(Op::OutsideFree(i));
        }
    }

    /// An out-of-memory entry: what the process could hold then.
    fn oom_limit(&mut self, e: &TraceEntry) {
        let free = e.device_free.unwrap_or(e.addr);
        if free >= 0 && self.oom_sample.is_none() {
            self.oom_sample = Some((self.reserved, self.outside_bytes, free as u64));
        }
    }

    fn finish(mut self, snap: &Snapshot) -> DeviceTrace {
        // A trailing `free_requested` whose completion is not in the history waited.
        self.note_freeing();
        // The file ends inside a request whose segment CUDA refused: that request ran out
        // of memory (its size is the segment PyTorch asked for; the request itself comes
        // in PyTorch's own entry, after the snapshot).
        if let Some((e, ev)) = self.cuda_oom.take() {
            let id = self.request(&e, ev);
            self.t.ops.push(Op::Failed(id));
        }
        let dev = self.t.device;
        for r in &mut self.t.requests {
            r.role = roles::of_stack(self.roles, r.stack).role(r.freed);
        }
        self.t.descending = self.downs > self.ups;
        // Private pools: the requests placed inside a private pool's segments.
        let private: Vec<(u64, u64, (i64, i64))> = end_segments(snap, dev)
            .into_iter()
            .filter(|s| s.segment_pool_id != (0, 0))
            .map(|s| (s.address as u64, s.total_size as u64, s.segment_pool_id))
            .collect();
        if !private.is_empty() {
            for r in &mut self.t.requests {
                r.pool = private
                    .iter()
                    .find(|(a, size, _)| r.addr >= *a && r.addr < a + size)
                    .map(|p| p.2);
            }
        }
        if let Some(why) = self.truncation(snap) {
            self.t.refused = Some(why);
        }
        let start: i64 = self.t.start.iter().map(|s| s.size as i64).sum();
        self.t.recorded_peak_reserved = if self.t.source == Source::MemsnapTensors {
            // No cache: what the tensors themselves held.
            self.peak_tensors
        } else {
            (start + self.peak_reserved).max(0) as u64
        };
        self.t.held_at_end =
            (start + self.reserved).max(0) as u64 + self.outside_bytes + self.tensors;
        self.t.limit_at_oom = self
            .oom_sample
            .map(|(r, o, free)| (start + r).max(0) as u64 + o + free);
        self.t
    }

    /// When the history does not begin with the allocator empty: the state it begins from
    /// (into `start`), or why that state cannot be told.
    fn truncation(&mut self, snap: &Snapshot) -> Option<String> {
        let dev = self.t.device;
        let source = self.t.source;
        let ends = end_segments(snap, dev);
        let cache_ends: Vec<&Segment> = match source {
            Source::Pytorch => ends,
            // memsnap's other allocations are one-block segments too: PyTorch's are the
            // ones its history allocated.
            _ => ends
                .into_iter()
                .filter(|s| {
                    let a = s.address as u64;
                    self.segs.contains_key(&a)
                        || self
                            .maps
                            .range(..=a)
                            .next_back()
                            .is_some_and(|(&m, &sz)| a < m + sz)
                })
                .collect(),
        };
        let end_unknown: Vec<&&Segment> = cache_ends
            .iter()
            .filter(|s| {
                let a = s.address as u64;
                !(self.segs.contains_key(&a)
                    || self.maps.contains_key(&a)
                    || (s.is_expandable && self.maps.range(a..a + s.total_size as u64).count() > 0))
            })
            .collect();
        let truncated = !self.pre.is_empty()
            || self.pre_gone > 0
            || !self.pre_segments.is_empty()
            || self.unmapped_before
            || !end_unknown.is_empty();
        if !truncated {
            return None;
        }
        let dropped = dropped(snap, dev);
        if source != Source::Pytorch {
            return Some(if dropped > 0 {
                format!(
                    "memsnap's history cap dropped {dropped} entries of device {dev} \
                     (MEMSNAP_MAX_ENTRIES): the allocator's state where the history begins \
                     cannot be told apart from the other libraries' allocations"
                )
            } else {
                format!(
                    "device {dev}'s history does not begin with PyTorch's allocator empty: \
                     its state then cannot be told apart from the other libraries' allocations"
                )
            });
        }
        if self.pre_gone > 0 {
            return Some(format!(
                "{} blocks allocated before the history began are freed within it: their \
                 sizes in the allocator are not recorded, so its state where the history \
                 begins cannot be told",
                self.pre_gone
            ));
        }
        if self.unmapped_before || end_unknown.iter().any(|s| s.is_expandable) {
            return Some(
                "expandable segments mapped before the history began: their state then \
                 cannot be told"
                    .into(),
            );
        }
        // Blocks that the history allocated and that are still live at the end.
        let mut start = Vec::new();
        for s in end_unknown {
            let mut live = Vec::new();
            for blk in &s.blocks {
                if !blk.state.is_active() {
                    continue;
                }
                let a = blk.address as u64;
                let id = self.live.get(&a).copied();
                let pre_block = id.is_none_or(|id| self.pre.contains(&id));
                if pre_block {
                    live.push((a, blk.size as u64, blk.requested_size as u64, id));
                    if let Some(id) = id {
                        let r = &mut self.t.requests[id as usize];
                        r.size = blk.requested_size as u64;
                        r.stream = s.stream as u64;
                        r.stack = blk.stack;
                        r.waits = r.waits || blk.state == BlockState::ActivePendingFree;
                    }
                }
            }
            start.push(StartSegment {
                addr: s.address as u64,
                size: s.total_size as u64,
                stream: s.stream as u64,
                small: s.segment_type == "small",
                pool: (s.segment_pool_id != (0, 0)).then_some(s.segment_pool_id),
                live,
            });
        }
        for &(a, size) in &self.pre_segments {
            start.push(StartSegment {
                addr: a,
                size,
                stream: 0,
                small: size == super::settings::SMALL_BUFFER,
                pool: None,
                live: Vec::new(),
            });
        }
        if self
            .pre
            .iter()
            .any(|id| !start.iter().flat_map(|s| &s.live).any(|l| l.3 == Some(*id)))
        {
            return Some(
                "blocks allocated before the history began and freed within it are not in \
                 the snapshot's segments: the allocator's state then cannot be told"
                    .into(),
            );
        }
        start.sort_by_key(|s| s.addr);
        self.t.start = start;
        None
    }
}

/// `memsnap.torch_allocator`, where the file has one.
pub fn torch_line(snap: &Snapshot) -> Option<&str> {
    match snap.meta("torch_allocator")? {
        Meta::Str(s) if !s.is_empty() => Some(s),
        _ => None,
    }
}

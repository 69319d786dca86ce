//! One scenario's replay of one device's history through the allocator model: CUDA as a
//! [`Driver`] (the device's capacity, the other libraries' allocations, addresses), the
//! requests and frees in recorded order, and the figures at the peak. "As recorded" hands
//! the model the recorded segments' addresses and checks each segment it takes or gives
//! back against the recording (docs/WHATIF.md, "How the model is checked"). Cold code; the
//! loop over the operations is the command's inner loop.

use super::model::{Allocator, BlockView, Driver, Fail, NONE};
use super::settings::{Backend, Settings};
use super::trace::{DeviceTrace, Op, Outside, Request, SegKind, SegRec};
use crate::explain::roles::Role;
use memsnap_format::model::StackId;
use std::collections::BTreeMap;

/// What one scenario changes: the settings, and the sizes of some roles' requests.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub label: String,
    pub settings: Settings,
    pub scale: Vec<(Role, f64)>,
}

/// The device as the replay sees it.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// The bytes the process may hold (capacity less what was in use outside the
    /// recording); `None`: not known, nothing runs out.
    pub limit: Option<u64>,
    /// The device's memory (`totalGlobalMem`: an expandable segment's address space, the
    /// memory fraction).
    pub device_total: u64,
}

/// Where a scenario ran out of memory.
#[derive(Clone, Debug, PartialEq)]
pub struct OomPoint {
    pub request_bytes: u64,
    pub stack: Option<StackId>,
    pub event: u32,
    /// Another library's allocation, not PyTorch's.
    pub outside: bool,
    /// The request that ran out in the recording too.
    pub recorded: bool,
}

impl OomPoint {
    /// Request `r`, of `size` bytes in the scenario, ran out (`recorded`: so did it in the
    /// recording).
    fn of(r: &Request, size: u64, recorded: bool) -> Self {
        OomPoint {
            request_bytes: size,
            stack: r.stack,
            event: r.event,
            outside: false,
            recorded,
        }
    }

    /// Another library's allocation `o` no longer fits.
    fn outside(o: &Outside) -> Self {
        OomPoint {
            request_bytes: o.size,
            stack: o.stack,
            event: o.event,
            outside: true,
            recorded: false,
        }
    }
}

/// A request's bytes in `scenario`: its role's factor applied, at least 1.
fn scaled(scenario: &Scenario, r: &Request) -> u64 {
    match scenario.scale.iter().find(|(role, _)| *role == r.role) {
        Some((_, f)) => ((r.size as f64 * f).round() as u64).max(1),
        None => r.size,
    }
}

/// The figures of one scenario on one device.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub peak_reserved: u64,
    pub peak_allocated: u64,
    pub segments_at_peak: u64,
    pub unallocated_at_peak: u64,
    pub largest_free_at_peak: u64,
    /// The first time it ran out; the replay stops there unless the recording ran out at
    /// the same request.
    pub oom: Option<OomPoint>,
    pub refused: Option<String>,
    /// As recorded: where the model first parted from the recording.
    pub divergence: Option<String>,
    /// As recorded: the recorded segment operations the model matched.
    pub matched: usize,
    /// As recorded: the operations where the recording called `empty_cache()` (its cache
    /// shrank outside any request); the other scenarios do the same there.
    pub empty_cache_at: Vec<usize>,
    /// As recorded: the model's segments at the end with their blocks.
    pub end: Vec<EndSegment>,
}

/// A segment (or a run of mapped pages) at the end of the replay.
#[derive(Clone, Debug)]
pub struct EndSegment {
    pub addr: u64,
    pub size: u64,
    pub blocks: Vec<BlockView>,
}

/// First fit over an address range, 512-byte granules: how the simulated driver hands out
/// addresses; downward from the top where the recording's segments came downward.
#[derive(Clone, Debug)]
struct Space {
    used: BTreeMap<u64, u64>,
    base: u64,
    descending: bool,
}

const GRANULE: u64 = 512;

impl Space {
    fn take(&mut self, size: u64) -> u64 {
        let size = size.div_ceil(GRANULE).max(1) * GRANULE;
        let addr = if self.descending {
            let mut top = self.base;
            for (&s, &e) in self.used.range(..self.base).rev() {
                if e.div_ceil(GRANULE) * GRANULE + size <= top {
                    break;
                }
                top = top.min(s);
            }
            (top - size) / GRANULE * GRANULE
        } else {
            let mut at = self.base;
            // The range that may hold `at` starts below it.
            let from = self
                .used
                .range(..=self.base)
                .next_back()
                .map_or(self.base, |(&s, _)| s);
            for (&s, &e) in self.used.range(from..) {
                if s >= at + size {
                    break;
                }
                at = at.max(e.div_ceil(GRANULE) * GRANULE);
            }
            at
        };
        self.used.insert(addr, addr + size);
        addr
    }

    fn give(&mut self, addr: u64) {
        self.used.remove(&addr);
    }
}

/// Where segment addresses come from.
enum Addresses<'t> {
    /// The recorded ones, checked in order.
    Recorded {
        segs: &'t [SegRec],
        cursor: usize,
        /// Bytes of `segs[cursor]` already matched (a mapping recorded page by page, or
        /// several mappings recorded as one).
        partial: u64,
        diverged: Option<String>,
        /// Addresses once the model has parted from the recording.
        fallback: Space,
    },
    Synthetic {
        malloc: Space,
        reserve: Space,
    },
}

struct Device<'t> {
    limits: Limits,
    /// Live bytes of the other libraries.
    outside: u64,
    addrs: Addresses<'t>,
    outside_addr: Vec<u64>,
}

fn kind_name(k: SegKind) -> &'static str {
    match k {
        SegKind::Alloc => "took a segment",
        SegKind::Free => "gave back a segment",
        SegKind::Map => "mapped",
        SegKind::Unmap => "unmapped",
    }
}

impl Device<'_> {
    fn room(&self, size: u64, held: u64) -> bool {
        self.limits
            .limit
            .is_none_or(|l| held.saturating_add(self.outside).saturating_add(size) <= l)
    }

    /// As recorded: the next recorded segment operation must be `kind` at `addr` (any
    /// address for a new segment) of `size` bytes; returns its address.
    fn expect(&mut self, kind: SegKind, addr: Option<u64>, size: u64) -> Option<u64> {
        let Addresses::Recorded {
            segs,
            cursor,
            partial,
            diverged,
            fallback,
        } = &mut self.addrs
        else {
            return None;
        };
        if diverged.is_some() {
            return match kind {
                SegKind::Alloc | SegKind::Map if addr.is_none() => Some(fallback.take(size)),
                _ => None,
            };
        }
        let what = |a: Option<u64>| a.map_or(String::new(), |a| format!(" at {a:#x}"));
        let mut left = size;
        let mut at = addr;
        let mut first = None;
        while left > 0 {
            let Some(r) = segs.get(*cursor) else {
                *diverged = Some(format!(
                    "the model {} of {size} bytes{} after the recording's last one",
                    kind_name(kind),
                    what(addr)
                ));
                break;
            };
            let r_at = r.addr + *partial;
            let r_left = r.size - *partial;
            let same_kind = r.kind == kind;
            let same_addr = at.is_none_or(|a| a == r_at);
            let whole = matches!(kind, SegKind::Alloc | SegKind::Free);
            if !same_kind || !same_addr || (whole && r.size != size) {
                *diverged = Some(format!(
                    "at event {}, the recording {} of {} bytes at {:#x} where the model {} of \
                     {size} bytes{}",
                    r.event,
                    kind_name(r.kind),
                    r.size,
                    r.addr,
                    kind_name(kind),
                    what(addr)
                ));
                break;
            }
            first.get_or_insert(r_at);
            let take = left.min(r_left);
            left -= take;
            at = Some(r_at + take);
            if take == r_left {
                *cursor += 1;
                *partial = 0;
            } else {
                *partial += take;
            }
        }
        if diverged.is_some() {
            return match kind {
                SegKind::Alloc | SegKind::Map if addr.is_none() => Some(fallback.take(size)),
                _ => None,
            };
        }
        first
    }

    fn diverged(&self) -> Option<&String> {
        match &self.addrs {
            Addresses::Recorded { diverged, .. } => diverged.as_ref(),
            Addresses::Synthetic { .. } => None,
        }
    }

    /// As recorded: the recorded segment operation not matched yet, if any.
    fn pending(&self) -> Option<usize> {
        match &self.addrs {
            Addresses::Recorded {
                segs,
                cursor,
                diverged: None,
                ..
            } if *cursor < segs.len() => Some(*cursor),
            _ => None,
        }
    }

    fn diverge(&mut self, why: String) {
        if let Addresses::Recorded { diverged, .. } = &mut self.addrs
            && diverged.is_none()
        {
            *diverged = Some(why);
        }
    }
}

impl Driver for Device<'_> {
    fn malloc(&mut self, size: u64, held: u64) -> Option<u64> {
        if !self.room(size, held) {
            return None;
        }
        match &mut self.addrs {
            Addresses::Synthetic { malloc, .. } => Some(malloc.take(size)),
            Addresses::Recorded { .. } => self.expect(SegKind::Alloc, None, size),
        }
    }
    fn free(&mut self, addr: u64, size: u64) {
        match &mut self.addrs {
            Addresses::Synthetic { malloc, .. } => malloc.give(addr),
            Addresses::Recorded { .. } => {
                self.expect(SegKind::Free, Some(addr), size);
            }
        }
    }
    fn reserve(&mut self, size: u64) -> u64 {
        match &mut self.addrs {
            Addresses::Synthetic { reserve, .. } => reserve.take(size),
            Addresses::Recorded {
                segs,
                cursor,
                partial: 0,
                diverged: None,
                ..
            } if segs.get(*cursor).is_some_and(|r| r.kind == SegKind::Map) => segs[*cursor].addr,
            Addresses::Recorded {
                fallback, diverged, ..
            } => {
                if diverged.is_none() {
                    *diverged = Some(
                        "the model reserved a new expandable segment where the recording did \
                         not map one"
                            .into(),
                    );
                }
                fallback.take(size)
            }
        }
    }
    fn release(&mut self, addr: u64, _size: u64) {
        if let Addresses::Synthetic { reserve, .. } = &mut self.addrs {
            reserve.give(addr);
        }
    }
    fn map(&mut self, addr: u64, size: u64, held: u64) -> bool {
        if !self.room(size, held) {
            return false;
        }
        if matches!(self.addrs, Addresses::Recorded { .. }) {
            self.expect(SegKind::Map, Some(addr), size);
        }
        true
    }
    fn unmap(&mut self, addr: u64, size: u64) {
        if matches!(self.addrs, Addresses::Recorded { .. }) {
            self.expect(SegKind::Unmap, Some(addr), size);
        }
    }
    fn has_room(&self, size: u64, held: u64) -> bool {
        self.room(size, held)
    }
}

/// Where a request stands in the replay.
#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    NotYet,
    Live,
    Waiting,
    Done,
}

/// Replays `t` under `scenario`. `as_recorded`: hand the model the recorded addresses and
/// check it against the recording; otherwise `empty_cache_at` says where the recording
/// emptied its cache.
pub fn run(
    t: &DeviceTrace,
    scenario: &Scenario,
    limits: Limits,
    as_recorded: bool,
    empty_cache_at: &[usize],
) -> Outcome {
    if scenario.settings.backend == Backend::CudaMallocAsync {
        return run_async(t, scenario, limits);
    }
    let addrs = if as_recorded {
        Addresses::Recorded {
            segs: &t.segments,
            cursor: 0,
            partial: 0,
            diverged: None,
            fallback: Space {
                used: BTreeMap::new(),
                base: 1 << 62,
                descending: false,
            },
        }
    } else {
        let first = t.first_addr.unwrap_or(0x1000_0000_0000);
        let top = t
            .segments
            .iter()
            .map(|s| s.addr + s.size)
            .chain(t.outside.iter().map(|o| o.addr + o.size))
            .max()
            .unwrap_or(first);
        Addresses::Synthetic {
            malloc: Space {
                used: BTreeMap::new(),
                base: if t.descending { top } else { first },
                descending: t.descending,
            },
            reserve: Space {
                used: BTreeMap::new(),
                base: t.first_map.unwrap_or(0x4000_0000_0000),
                descending: false,
            },
        }
    };
    let mut dev = Device {
        limits,
        outside: 0,
        addrs,
        outside_addr: vec![0; t.outside.len()],
    };
    let mut a = Allocator::new(scenario.settings.clone(), limits.device_total);
    let mut out = Outcome::default();
    let mut block = vec![NONE; t.requests.len()];
    let mut state = vec![State::NotYet; t.requests.len()];
    // The state where a history that starts mid-run begins.
    for s in &t.start {
        let private = s.pool.map(|id| a.private_pool(id));
        let live: Vec<(u64, u64, u64, u32)> = s
            .live
            .iter()
            .map(|l| (l.0, l.1, l.2, l.3.unwrap_or(NONE)))
            .collect();
        let handles = a.add_segment(s.addr, s.size, s.stream, s.small, private, &live);
        for (h, l) in handles.iter().zip(&s.live) {
            if let Some(id) = l.3 {
                block[id as usize] = *h;
                state[id as usize] = State::Live;
            }
        }
        if let Addresses::Synthetic { malloc, .. } = &mut dev.addrs {
            malloc.used.insert(s.addr, s.addr + s.size);
        }
    }
    let scale = |id: u32| scaled(scenario, &t.requests[id as usize]);
    let mut empty_next = empty_cache_at.iter().peekable();
    let peak = |a: &Allocator, out: &mut Outcome| {
        if a.reserved > out.peak_reserved || (out.peak_reserved == 0 && a.reserved == 0) {
            out.peak_reserved = a.reserved;
            out.segments_at_peak = a.segment_count();
            out.unallocated_at_peak = a.reserved - a.allocated;
            out.largest_free_at_peak = a.largest_free_block();
        }
        out.peak_allocated = out.peak_allocated.max(a.allocated);
    };
    peak(&a, &mut out);
    for (k, op) in t.ops.iter().enumerate() {
        if !as_recorded && empty_next.peek().is_some_and(|&&at| at == k) {
            empty_next.next();
            a.release_cached_blocks(&mut dev);
        }
        match *op {
            Op::Alloc(id) | Op::Failed(id) => {
                let r = &t.requests[id as usize];
                let private = r.pool.map(|p| a.private_pool(p));
                let size = scale(id);
                match a.malloc(&mut dev, size, r.stream, private, id) {
                    Ok(b) => {
                        block[id as usize] = b;
                        state[id as usize] = State::Live;
                        if as_recorded
                            && matches!(op, Op::Alloc(_))
                            && a.block(b).addr != r.addr
                            && dev.diverged().is_none()
                        {
                            dev.diverge(format!(
                                "at event {}, the recording placed a request of {} bytes at \
                                 {:#x}, the model at {:#x}",
                                r.event,
                                r.size,
                                r.addr,
                                a.block(b).addr
                            ));
                        }
                        if as_recorded && matches!(op, Op::Failed(_)) {
                            dev.diverge(format!(
                                "at event {}, the recording ran out of memory for a request of {size} bytes; the \
                                 model served it",
                                r.event
                            ));
                        }
                    }
                    Err(Fail::Oom(_)) => {
                        let recorded = matches!(op, Op::Failed(_));
                        out.oom.get_or_insert(OomPoint::of(r, size, recorded));
                        if !recorded {
                            if as_recorded {
                                dev.diverge(format!(
                                    "at event {}, the model runs out of memory for a request \
                                     the recording served",
                                    r.event
                                ));
                            }
                            peak(&a, &mut out);
                            break;
                        }
                    }
                    Err(Fail::Unmodelled(why)) => {
                        out.refused = Some(why.0);
                        return out;
                    }
                }
                if as_recorded && let Some(c) = dev.pending() {
                    let rec = t.segments[c];
                    if rec.event < r.event && dev.diverged().is_none() {
                        dev.diverge(format!(
                            "at event {}, the recording {} of {} bytes at {:#x}; the model did \
                             not",
                            rec.event,
                            kind_name(rec.kind),
                            rec.size,
                            rec.addr
                        ));
                    }
                }
                peak(&a, &mut out);
            }
            Op::Free(id) => {
                if state[id as usize] == State::Live {
                    let waits = t.requests[id as usize].waits;
                    a.free(block[id as usize], waits);
                    state[id as usize] = if waits { State::Waiting } else { State::Done };
                }
            }
            Op::Complete(id) => {
                if state[id as usize] == State::Waiting {
                    let b = block[id as usize];
                    // The cache may have been emptied since (waiting blocks go first), and
                    // the block merged into another.
                    if a.block(b).waiting && a.block(b).tag == id {
                        a.complete(b);
                    }
                    state[id as usize] = State::Done;
                } else if state[id as usize] == State::Live {
                    a.free(block[id as usize], false);
                    state[id as usize] = State::Done;
                }
            }
            Op::OutsideAlloc(i) => {
                let o = &t.outside[i as usize];
                if !dev.room(o.size, a.reserved) {
                    out.oom.get_or_insert(OomPoint::outside(o));
                    if as_recorded {
                        dev.diverge(format!(
                            "at event {}, another library's allocation of {} bytes does not fit \
                             beside the model's cache",
                            o.event, o.size
                        ));
                    }
                    break;
                }
                dev.outside += o.size;
                if let Addresses::Synthetic { malloc, .. } = &mut dev.addrs {
                    dev.outside_addr[i as usize] = malloc.take(o.size);
                }
            }
            Op::OutsideFree(i) => {
                let o = &t.outside[i as usize];
                dev.outside = dev.outside.saturating_sub(o.size);
                if let Addresses::Synthetic { malloc, .. } = &mut dev.addrs {
                    malloc.give(dev.outside_addr[i as usize]);
                }
            }
            Op::Segment(i) => {
                if as_recorded
                    && dev.pending() == Some(i as usize)
                    && matches!(t.segments[i as usize].kind, SegKind::Free | SegKind::Unmap)
                    && !release_comes_with_request(t, &a, &dev, k, &scale)
                {
                    // The cache shrank outside any request: `empty_cache()`.
                    a.release_cached_blocks(&mut dev);
                    out.empty_cache_at.push(k);
                    peak(&a, &mut out);
                }
            }
        }
    }
    if as_recorded {
        if let Some(c) = dev.pending()
            && out.oom.as_ref().is_none_or(|o| o.recorded)
        {
            let rec = t.segments[c];
            dev.diverge(format!(
                "at event {}, the recording {} of {} bytes at {:#x}; the model did not",
                rec.event,
                kind_name(rec.kind),
                rec.size,
                rec.addr
            ));
        }
        if let Addresses::Recorded { cursor, .. } = &dev.addrs {
            out.matched = *cursor;
        }
        out.divergence = dev.diverged().cloned();
        out.end = a
            .segments_with_blocks()
            .into_iter()
            .map(|(addr, size, blocks)| EndSegment { addr, size, blocks })
            .collect();
    }
    out
}

/// Whether the recorded segment frees at operation `k` belong to the request that comes
/// next (it finds no free block and CUDA is full, or garbage collection runs), rather than
/// to an `empty_cache()` call.
fn release_comes_with_request(
    t: &DeviceTrace,
    a: &Allocator,
    dev: &Device,
    k: usize,
    scale: &dyn Fn(u32) -> u64,
) -> bool {
    for op in &t.ops[k..] {
        match *op {
            // The request's own segments come before its entry too.
            Op::Segment(_) | Op::OutsideAlloc(_) | Op::OutsideFree(_) => {}
            Op::Alloc(id) | Op::Failed(id) => {
                let r = &t.requests[id as usize];
                let private = r.pool.and_then(|p| a.find_private_pool(p));
                return a.would_release(dev, scale(id), r.stream, private);
            }
            _ => return false,
        }
    }
    false
}

/// `backend:cudaMallocAsync`: no cache; each tensor holds its requested bytes from its
/// allocation until its free completes.
fn run_async(t: &DeviceTrace, scenario: &Scenario, limits: Limits) -> Outcome {
    let mut out = Outcome::default();
    let mut live = 0u64;
    let mut count = 0u64;
    let mut outside = 0u64;
    let mut size_of = vec![0u64; t.requests.len()];
    let mut state = vec![State::NotYet; t.requests.len()];
    for s in &t.start {
        for l in &s.live {
            live += l.2;
            count += 1;
            if let Some(id) = l.3 {
                size_of[id as usize] = l.2;
                state[id as usize] = State::Live;
            }
        }
    }
    let fits = |live: u64, outside: u64, more: u64| {
        limits.limit.is_none_or(|l| live + outside + more <= l)
    };
    for op in &t.ops {
        match *op {
            Op::Alloc(id) | Op::Failed(id) => {
                let r = &t.requests[id as usize];
                let size = scaled(scenario, r);
                if !fits(live, outside, size) {
                    let recorded = matches!(op, Op::Failed(_));
                    out.oom.get_or_insert(OomPoint::of(r, size, recorded));
                    if recorded {
                        continue;
                    }
                    break;
                }
                live += size;
                count += 1;
                size_of[id as usize] = size;
                state[id as usize] = State::Live;
                if live > out.peak_reserved {
                    out.peak_reserved = live;
                    out.segments_at_peak = count;
                }
            }
            Op::Free(_) => {}
            Op::Complete(id) => {
                if state[id as usize] == State::Live {
                    live -= size_of[id as usize];
                    count -= 1;
                    state[id as usize] = State::Done;
                }
            }
            Op::OutsideAlloc(i) => {
                let o = &t.outside[i as usize];
                if !fits(live, outside, o.size) {
                    out.oom.get_or_insert(OomPoint::outside(o));
                    break;
                }
                outside += o.size;
            }
            Op::OutsideFree(i) => outside = outside.saturating_sub(t.outside[i as usize].size),
            Op::Segment(_) => {}
        }
    }
    out.peak_allocated = out.peak_reserved;
    out
}

//! PyTorch's caching allocator as the writer rebuilds it: which CUDA allocations are its
//! segments, and the blocks it carved in them, from the trace entries its tracker sends.
//!
//! Cold (writer thread only). A block's size is not in the trace entry (only the size the
//! program asked for), so it follows the allocator's own rules (docs/PYTORCH.md, "Block
//! sizes"): the request rounded up to 512 bytes; a block starts where a free block starts
//! (free space is always merged, so the free block reaches the next live block or the end
//! of the segment); and it keeps that whole free block when the rest is too small to be
//! split off. Everything else (segments, addresses, states) is what the allocator said.

use super::{Action, Live, State, TraceRec, TraceStack, keys_in};
use crate::channel::event::{Api, PoolId};
use crate::process::allocator_route;
use crate::writer::stacks::RawStackId;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;

/// Whether the allocator's entries were checked against the CUDA calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CacheCheck {
    /// No segment reported yet.
    #[default]
    Pending,
    Passed,
    /// The first segment did not match: block events are off.
    Failed,
}

/// Smallest block, and the unit sizes are rounded up to (`kMinBlockSize`).
const MIN_BLOCK: u64 = 512;
/// Largest request served from the small pool (`kSmallSize`).
const SMALL_SIZE: u64 = 1 << 20;
/// The size of a small-pool segment (`kSmallBuffer`).
const SMALL_SEGMENT: u64 = 2 << 20;

/// One segment of the caching allocator: a CUDA allocation it took as its own, or one
/// mapping of an expandable segment.
#[derive(Clone, Copy, Debug)]
pub struct CacheSegment {
    /// The CUDA allocation or mapping, as recorded from its call.
    pub live: Live,
    /// A mapping inside an expandable segment (`expandable_segments:True`).
    pub expandable: bool,
    /// The pool that owns it: the default one, or a CUDA graph's private pool (a
    /// `Kind::CachePool` right behind the segment's own event says which).
    pub pool: PoolId,
}

/// A live block: handed out, or freed and waiting for the streams that used it.
#[derive(Clone, Copy, Debug)]
pub struct CachedBlock {
    /// The block's size in the allocator (what it occupies in its segment).
    pub size: u64,
    /// What the program asked for.
    pub requested: u64,
    pub stream: u64,
    pub stack: Option<RawStackId>,
    pub time_us: u64,
    /// `free_requested` seen, `free_completed` not yet.
    pub pending_free: bool,
}

/// The caching allocator's state on one device.
#[derive(Default)]
pub struct Cache {
    /// Segment start → segment.
    pub segments: BTreeMap<u64, CacheSegment>,
    /// Block start → live block.
    pub blocks: BTreeMap<u64, CachedBlock>,
    /// Bytes in `segments` (PyTorch's "reserved").
    pub reserved_bytes: u64,
    /// Bytes of live blocks not freed yet (PyTorch's `memory_allocated()`: a block leaves
    /// it when the program frees it, before the streams that used it are done).
    pub allocated_bytes: u64,
}

impl Cache {
    /// The region of contiguous segments that holds `addr`: `(start, end, segment)` where
    /// contiguous expandable mappings count as one region (the allocator's blocks span
    /// them), and the first segment of the region is returned.
    pub fn region_of(&self, addr: u64) -> Option<(u64, u64, CacheSegment)> {
        let (&start, seg) = self.segments.range(..=addr).next_back()?;
        let mut end = start + seg.live.size;
        if addr >= end {
            return None;
        }
        let mut first = (start, *seg);
        if seg.expandable {
            // Walk back and forth over touching mappings of the same pool (each pool's
            // expandable segments are its own reservations).
            while let Some((&s, prev)) = self.segments.range(..first.0).next_back() {
                if !prev.expandable || s + prev.live.size != first.0 || prev.pool != seg.pool {
                    break;
                }
                first = (s, *prev);
            }
            while let Some(next) = self.segments.get(&end) {
                if !next.expandable || next.pool != seg.pool {
                    break;
                }
                end += next.live.size;
            }
        }
        Some((first.0, end, first.1))
    }

    /// The end of the free space starting at `addr` inside the region ending at
    /// `region_end`: the next live block, or the region's end.
    fn free_end(&self, addr: u64, region_end: u64) -> u64 {
        self.blocks
            .range(addr + 1..region_end)
            .next()
            .map_or(region_end, |(&start, _)| start)
    }
}

/// PyTorch's `round_size` without `roundup_power2_divisions`.
pub fn round_size(requested: u64) -> u64 {
    requested.max(1).div_ceil(MIN_BLOCK) * MIN_BLOCK
}

/// PyTorch's `should_split`: whether the free space left after a block of `size` becomes
/// a free block of its own (else the block keeps it).
pub fn should_split(size: u64, remaining: u64, small_pool: bool, expandable: bool) -> bool {
    if small_pool || expandable {
        remaining >= MIN_BLOCK
    } else {
        let _ = size; // `max_split_size` is unlimited unless configured
        remaining > SMALL_SIZE
    }
}

impl State {
    /// The writer's check of the route: the allocator's first segment must be a CUDA
    /// allocation (or mapping) just recorded with the same address and size. When it is
    /// not, memsnap misread the allocator's entries: block events are switched off for
    /// the rest of the run and every snapshot says why.
    pub fn check_first_cache_segment(&mut self, matched: bool) {
        if self.cache_check != CacheCheck::Pending {
            return;
        }
        if matched {
            self.cache_check = CacheCheck::Passed;
        } else {
            self.cache_check = CacheCheck::Failed;
            allocator_route::BLOCK_EVENTS.store(false, Relaxed);
        }
    }

    /// Why block events were set aside, if they were.
    pub fn cache_rejection(&self) -> Option<&'static str> {
        (self.cache_check == CacheCheck::Failed)
            .then_some("its first segment matched no CUDA allocation memsnap recorded")
    }

    /// `segment_alloc` from the allocator: the CUDA allocation just recorded at `addr` is
    /// its segment. Its `alloc` record goes (PyTorch's history has none for a segment), its
    /// bytes move from live to reserved. False when no CUDA allocation matches.
    pub fn cache_segment(&mut self, device: i32, addr: u64, size: u64) -> bool {
        let dev = self.device(device.max(0));
        match dev.allocs.get(&addr) {
            Some(live) if live.size == size => {}
            _ => {
                self.anomalies.cache_mismatches += 1;
                return false;
            }
        }
        let Some(live) = dev.allocs.remove(&addr) else {
            return false;
        };
        self.claim(device.max(0), addr, live, false);
        true
    }

    /// `segment_map` from the allocator: the mappings just recorded in `[addr, addr+size)`
    /// extend one of its expandable segments. False when none is there.
    pub fn cache_segment_map(&mut self, device: i32, addr: u64, size: u64) -> bool {
        let mappings = self.take_mappings(addr, addr.saturating_add(size));
        let claimed = !mappings.is_empty();
        for (d, start, live) in mappings {
            self.claim(d, start, live, true);
        }
        if !claimed {
            let _ = device;
            self.anomalies.cache_mismatches += 1;
        }
        claimed
    }

    fn claim(&mut self, device: i32, addr: u64, live: Live, expandable: bool) {
        self.sub_live(device, live.size);
        self.drop_recent_alloc_record(device, addr);
        let dev = self.device(device);
        dev.cache.reserved_bytes += live.size;
        let pool = PoolId::DEFAULT; // until a `Kind::CachePool` says otherwise
        dev.cache.segments.insert(
            addr,
            CacheSegment {
                live,
                expandable,
                pool,
            },
        );
    }

    /// `Kind::CachePool`: the segments that start in `[addr, addr+size)` (the one segment,
    /// or the mappings, that the same thread's segment event just claimed) belong to the
    /// private pool `pool`. False when there is none (a mismatch, counted).
    pub fn cache_pool(&mut self, addr: u64, size: u64, pool: PoolId) -> bool {
        let end = addr.saturating_add(size.max(1));
        let mut found = false;
        for dev in &mut self.devices {
            for (_, seg) in dev.cache.segments.range_mut(addr..end) {
                seg.pool = pool;
                found = true;
            }
        }
        if !found {
            self.anomalies.cache_mismatches += 1;
        }
        found
    }

    /// Removes the `alloc` record written for a CUDA allocation that turned out to be a
    /// segment (it is among the newest: the allocator reports the segment right after the
    /// call returns). Older records keep their places, so a window cut by index stays
    /// right.
    fn drop_recent_alloc_record(&mut self, device: i32, addr: u64) {
        let dev = self.device(device);
        let newest = dev.trace.len().saturating_sub(256);
        if let Some(i) = (newest..dev.trace.len())
            .rev()
            .find(|&i| dev.trace[i].action == Action::Alloc && dev.trace[i].addr == addr)
        {
            dev.trace.remove(i);
            dev.trace_total -= 1;
        }
    }

    /// `alloc` from the allocator: a block of `requested` bytes at `addr`.
    #[allow(clippy::too_many_arguments)] // one per field of the trace entry
    pub fn cache_block_alloc(
        &mut self,
        device: i32,
        addr: u64,
        requested: u64,
        stream: u64,
        time_us: u64,
        stack: Option<RawStackId>,
    ) {
        let device = device.max(0);
        let Some((start, region_end, segment)) = self.device(device).cache.region_of(addr) else {
            self.anomalies.cache_mismatches += 1;
            return;
        };
        // A live block here means its free was never reported: close it first.
        let stale = {
            let cache = &self.device(device).cache;
            cache
                .blocks
                .range(..=addr)
                .next_back()
                .filter(|(s, b)| **s + b.size > addr && **s >= start)
                .map(|(&s, _)| s)
        };
        if let Some(s) = stale {
            self.anomalies.cache_mismatches += 1;
            self.cache_block_free_completed(device, s, time_us, None);
        }
        let cache = &self.device(device).cache;
        let free_end = cache.free_end(addr, region_end);
        let rounded = round_size(requested);
        let small_pool = if segment.expandable {
            rounded <= SMALL_SIZE
        } else {
            segment.live.size == SMALL_SEGMENT
        };
        let room = free_end - addr;
        let size = if rounded >= room
            || !should_split(rounded, room - rounded, small_pool, segment.expandable)
        {
            room
        } else {
            rounded
        };
        let block = CachedBlock {
            size,
            requested,
            stream,
            stack,
            time_us,
            pending_free: false,
        };
        let dev = self.device(device);
        dev.cache.blocks.insert(addr, block);
        dev.cache.allocated_bytes += size;
        dev.events += 1;
        self.add_live(device, size);
        self.push(
            device,
            TraceRec {
                action: Action::Alloc,
                addr,
                size: requested,
                stream,
                time_us,
                stack: TraceStack::new(stack),
                api: Api::CachingAllocator,
            },
        );
    }

    /// `free_requested` from the allocator: the program let go of the block at `addr`.
    pub fn cache_block_free_requested(
        &mut self,
        device: i32,
        addr: u64,
        stream: u64,
        time_us: u64,
        stack: Option<RawStackId>,
    ) {
        let device = device.max(0);
        let Some(block) = self.device(device).cache.blocks.get_mut(&addr) else {
            self.anomalies.cache_mismatches += 1;
            return;
        };
        if block.pending_free {
            return; // reported twice: once is enough
        }
        block.pending_free = true;
        let block = *block;
        self.device(device).cache.allocated_bytes -= block.size;
        self.push(
            device,
            TraceRec {
                action: Action::FreeRequested,
                addr,
                size: block.requested,
                stream: if stream == 0 { block.stream } else { stream },
                time_us,
                stack: TraceStack::new(stack.or(block.stack)),
                api: Api::CachingAllocator,
            },
        );
    }

    /// `free_completed` from the allocator: the block at `addr` is free space again.
    pub fn cache_block_free_completed(
        &mut self,
        device: i32,
        addr: u64,
        time_us: u64,
        stack: Option<RawStackId>,
    ) {
        let device = device.max(0);
        let dev = self.device(device);
        let Some(block) = dev.cache.blocks.remove(&addr) else {
            self.anomalies.cache_mismatches += 1;
            return;
        };
        if !block.pending_free {
            dev.cache.allocated_bytes -= block.size;
        }
        dev.events += 1;
        self.sub_live(device, block.size);
        let rec = |action| TraceRec {
            action,
            addr,
            size: block.requested,
            stream: block.stream,
            time_us,
            stack: TraceStack::new(stack.or(block.stack)),
            api: Api::CachingAllocator,
        };
        if !block.pending_free {
            // Closing a block whose free was never reported: both records, as PyTorch
            // writes them.
            self.push(device, rec(Action::FreeRequested));
        }
        self.push(device, rec(Action::FreeCompleted));
    }

    /// The CUDA free of a segment of the caching allocator (`cudaFree` after
    /// `segment_free`): `segment_free`. False when `addr` is no such segment.
    pub(super) fn free_cache_segment(
        &mut self,
        addr: u64,
        api: Api,
        stream: u64,
        time_us: u64,
        stack: Option<RawStackId>,
    ) -> bool {
        let Some(d) = self
            .devices
            .iter()
            .position(|d| d.cache.segments.contains_key(&addr))
        else {
            return false;
        };
        let Some(seg) = self.devices[d].cache.segments.remove(&addr) else {
            return false;
        };
        let stream = if stream == 0 { seg.live.stream } else { stream };
        let action = Action::SegmentFree;
        self.release_cache_segment(d as i32, addr, seg, action, api, stream, time_us, stack);
        true
    }

    /// `cuMemUnmap` of `[addr, end)`: the expandable mappings there leave their segments
    /// (`segment_unmap`). True when there was one.
    pub(super) fn unmap_cache_segments(
        &mut self,
        addr: u64,
        end: u64,
        time_us: u64,
        stack: Option<RawStackId>,
    ) -> bool {
        let mut found = false;
        for d in 0..self.devices.len() {
            let starts = keys_in(&self.devices[d].cache.segments, addr..end);
            for start in starts {
                let Some(seg) = self.devices[d].cache.segments.remove(&start) else {
                    continue;
                };
                found = true;
                let (action, api) = (Action::SegmentUnmap, Api::CuMemUnmap);
                self.release_cache_segment(d as i32, start, seg, action, api, 0, time_us, stack);
                self.handle_unmapped(seg.live.handle);
            }
        }
        found
    }

    /// A segment of the caching allocator, taken out of its table, goes back to CUDA: the
    /// blocks still live in it are closed, its bytes leave `reserved`, and `action`
    /// (`segment_free` or `segment_unmap`) is written for it.
    #[allow(clippy::too_many_arguments)] // one per field of the trace entry
    fn release_cache_segment(
        &mut self,
        device: i32,
        addr: u64,
        seg: CacheSegment,
        action: Action,
        api: Api,
        stream: u64,
        time_us: u64,
        stack: Option<RawStackId>,
    ) {
        self.close_blocks_in(device, addr, addr + seg.live.size, time_us);
        let dev = self.device(device);
        dev.cache.reserved_bytes -= seg.live.size;
        dev.events += 1;
        self.push(
            device,
            TraceRec {
                action,
                addr,
                size: seg.live.size,
                stream,
                time_us,
                stack: TraceStack::new(stack.or(seg.live.stack)),
                api,
            },
        );
    }

    /// Blocks still live in a range that is going back to CUDA: their frees were never
    /// reported. Closed, and counted.
    fn close_blocks_in(&mut self, device: i32, start: u64, end: u64, time_us: u64) {
        let stale = keys_in(&self.device(device).cache.blocks, start..end);
        for addr in stale {
            self.anomalies.cache_mismatches += 1;
            self.cache_block_free_completed(device, addr, time_us, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn live(size: u64) -> Live {
        Live {
            size,
            stream: 0,
            api: Api::CudaMalloc,
            stack: None,
            time_us: 1,
            handle: 0,
        }
    }

    /// A state with one caching-allocator segment of `size` at `base` on device 0.
    fn with_segment(base: u64, size: u64) -> State {
        let mut s = State::new(1000);
        s.alloc(0, base, size, live(size));
        assert!(s.cache_segment(0, base, size));
        s
    }

    fn blocks(s: &State) -> Vec<(u64, u64, u64, bool)> {
        s.devices[0]
            .cache
            .blocks
            .iter()
            .map(|(&a, b)| (a, b.size, b.requested, b.pending_free))
            .collect()
    }

    #[test]
    fn rounding_follows_pytorch() {
        assert_eq!(round_size(1), 512);
        assert_eq!(round_size(512), 512);
        assert_eq!(round_size(513), 1024);
        assert_eq!(round_size(4), 512);
    }

    #[test]
    fn a_segment_replaces_its_cuda_allocation_and_the_history_has_no_alloc_for_it() {
        let s = with_segment(0x1000_0000, 20 * MIB);
        let dev = &s.devices[0];
        assert!(dev.allocs.is_empty());
        assert_eq!(dev.cache.reserved_bytes, 20 * MIB);
        assert_eq!(dev.live_bytes, 0, "a segment is reserved, not live");
        let actions: Vec<Action> = dev.trace.iter().map(|r| r.action).collect();
        assert_eq!(actions, vec![Action::SegmentAlloc]);
        assert_eq!(dev.trace_total, 1);
    }

    #[test]
    fn a_segment_without_its_cuda_allocation_is_a_mismatch() {
        let mut s = State::new(10);
        assert!(!s.cache_segment(0, 0x1000, 2 * MIB));
        s.alloc(0, 0x1000, 4 * MIB, live(4 * MIB));
        assert!(!s.cache_segment(0, 0x1000, 2 * MIB), "sizes differ");
        assert_eq!(s.anomalies.cache_mismatches, 2);
    }

    #[test]
    fn large_blocks_split_only_above_one_mib_and_small_ones_always() {
        let base = 0x1000_0000;
        let mut s = with_segment(base, 20 * MIB);
        // 4 MiB, then 16 MiB - 512 KiB: what is left (512 KiB) is too small to split off.
        s.cache_block_alloc(0, base, 4 * MIB, 0, 2, None);
        s.cache_block_alloc(0, base + 4 * MIB, 15 * MIB + MIB / 2, 0, 3, None);
        assert_eq!(
            blocks(&s),
            vec![
                (base, 4 * MIB, 4 * MIB, false),
                (base + 4 * MIB, 16 * MIB, 15 * MIB + MIB / 2, false)
            ]
        );
        assert_eq!(s.devices[0].live_bytes, 20 * MIB);
        let small = 0x2000_0000;
        s.alloc(0, small, 2 * MIB, live(2 * MIB));
        assert!(s.cache_segment(0, small, 2 * MIB));
        s.cache_block_alloc(0, small, 4, 0, 4, None);
        s.cache_block_alloc(0, small + 512, 2 * MIB - 1024, 0, 5, None);
        let b = blocks(&s);
        assert_eq!(b[2], (small, 512, 4, false));
        assert_eq!(b[3], (small + 512, 2 * MIB - 1024, 2 * MIB - 1024, false));
    }

    #[test]
    fn frees_wait_for_completion_and_free_space_merges() {
        let base = 0x1000_0000;
        let mut s = with_segment(base, 20 * MIB);
        s.cache_block_alloc(0, base, 4 * MIB, 7, 2, None);
        s.cache_block_alloc(0, base + 4 * MIB, 4 * MIB, 7, 2, None);
        s.cache_block_free_requested(0, base, 0, 3, None);
        assert!(blocks(&s)[0].3, "pending until completed");
        assert_eq!(
            s.devices[0].cache.allocated_bytes,
            4 * MIB,
            "freed, no longer allocated"
        );
        assert_eq!(s.devices[0].live_bytes, 8 * MIB, "but still held");
        s.cache_block_free_completed(0, base, 4, None);
        s.cache_block_free_requested(0, base + 4 * MIB, 0, 5, None);
        s.cache_block_free_completed(0, base + 4 * MIB, 5, None);
        assert!(blocks(&s).is_empty());
        assert_eq!(s.devices[0].cache.allocated_bytes, 0);
        // The whole segment is free again: a 19 MiB request takes it all (1 MiB left).
        s.cache_block_alloc(0, base, 19 * MIB, 7, 6, None);
        assert_eq!(blocks(&s)[0].1, 20 * MIB);
        let actions: Vec<Action> = s.devices[0].trace.iter().map(|r| r.action).collect();
        assert_eq!(
            actions,
            vec![
                Action::SegmentAlloc,
                Action::Alloc,
                Action::Alloc,
                Action::FreeRequested,
                Action::FreeCompleted,
                Action::FreeRequested,
                Action::FreeCompleted,
                Action::Alloc
            ]
        );
        let sizes: Vec<u64> = s.devices[0].trace.iter().map(|r| r.size).collect();
        assert_eq!(
            sizes[1],
            4 * MIB,
            "history entries carry the requested size"
        );
    }

    #[test]
    fn the_cuda_free_of_a_segment_is_one_segment_free() {
        let base = 0x1000_0000;
        let mut s = with_segment(base, 2 * MIB);
        s.free(base, Api::CudaFree, 0, 9, None);
        let dev = &s.devices[0];
        assert!(dev.cache.segments.is_empty());
        assert_eq!(dev.cache.reserved_bytes, 0);
        assert_eq!(
            dev.trace.back().map(|r| r.action),
            Some(Action::SegmentFree)
        );
        assert_eq!(s.anomalies.unknown_frees, 0);
        assert_eq!(s.anomalies.cache_mismatches, 0);
    }

    #[test]
    fn blocks_outside_segments_and_unknown_frees_are_counted_not_recorded() {
        let mut s = with_segment(0x1000_0000, 2 * MIB);
        s.cache_block_alloc(0, 0x5000_0000, 512, 0, 1, None);
        s.cache_block_free_requested(0, 0x1000_0000, 0, 1, None);
        s.cache_block_free_completed(0, 0x1000_0000, 1, None);
        assert!(blocks(&s).is_empty());
        assert_eq!(s.anomalies.cache_mismatches, 3);
    }

    /// Two touching mappings of 20 MiB at `base` on device 0, not claimed yet.
    fn two_touching_mappings(base: u64) -> State {
        let mut s = State::new(100);
        for (i, h) in [(0, 11u64), (1, 12)] {
            s.mem_create(h, 20 * MIB, 0);
            let m = Live {
                handle: h,
                api: Api::CuMemMap,
                ..live(20 * MIB)
            };
            s.map(base + i * 20 * MIB, 20 * MIB, m);
        }
        s
    }

    #[test]
    fn expandable_mappings_form_one_region() {
        let base = 0x4000_0000_0000;
        let mut s = two_touching_mappings(base);
        assert!(s.cache_segment_map(0, base, 40 * MIB));
        assert_eq!(s.devices[0].live_bytes, 0);
        // A block across both mappings.
        s.cache_block_alloc(0, base, 30 * MIB, 0, 2, None);
        assert_eq!(blocks(&s), vec![(base, 30 * MIB, 30 * MIB, false)]);
        s.cache_block_free_requested(0, base, 0, 3, None);
        s.cache_block_free_completed(0, base, 3, None);
        s.unmap(base + 20 * MIB, 20 * MIB, 4, None);
        assert_eq!(s.devices[0].cache.reserved_bytes, 20 * MIB);
        assert_eq!(s.anomalies.unknown_unmaps, 0);
    }

    const GRAPH_POOL: PoolId = PoolId {
        first: 0,
        second: 1,
    };

    #[test]
    fn a_segment_named_by_a_pool_event_belongs_to_that_pool_and_the_snapshot_says_so() {
        let (default_base, graph_base) = (0x1000_0000, 0x2000_0000);
        let mut s = with_segment(default_base, 20 * MIB);
        s.alloc(0, graph_base, 2 * MIB, live(2 * MIB));
        assert!(s.cache_segment(0, graph_base, 2 * MIB));
        assert!(s.cache_pool(graph_base, 2 * MIB, GRAPH_POOL));
        let segments = &s.devices[0].cache.segments;
        assert_eq!(segments[&default_base].pool, PoolId::DEFAULT);
        assert_eq!(segments[&graph_base].pool, GRAPH_POOL);
        // A pool event for no segment is a mismatch, and changes nothing.
        assert!(!s.cache_pool(0x3000_0000, MIB, GRAPH_POOL));
        assert_eq!(s.anomalies.cache_mismatches, 1);

        let cfg = crate::config::Config::default();
        let mut table = crate::writer::stacks::StackTable::new(&cfg);
        let mut interner = crate::writer::dump::FrameInterner::default();
        let snap = crate::writer::dump::build(&s, &mut table, &mut interner, None);
        let pools: Vec<(i64, (i64, i64))> = snap
            .segments
            .iter()
            .map(|seg| (seg.address, seg.segment_pool_id))
            .collect();
        assert_eq!(
            pools,
            vec![(default_base as i64, (0, 0)), (graph_base as i64, (0, 1))]
        );
    }

    #[test]
    fn expandable_mappings_of_different_pools_are_different_segments() {
        let base = 0x4000_0000_0000;
        let mut s = two_touching_mappings(base);
        assert!(s.cache_segment_map(0, base, 20 * MIB));
        assert!(s.cache_segment_map(0, base + 20 * MIB, 20 * MIB));
        // The second mapping touches the first but is a private pool's.
        assert!(s.cache_pool(base + 20 * MIB, 20 * MIB, GRAPH_POOL));
        let cache = &s.devices[0].cache;
        let (start, end, seg) = cache.region_of(base).unwrap();
        assert_eq!(
            (start, end, seg.pool),
            (base, base + 20 * MIB, PoolId::DEFAULT)
        );
        let (start, end, seg) = cache.region_of(base + 30 * MIB).unwrap();
        assert_eq!(
            (start, end, seg.pool),
            (base + 20 * MIB, base + 40 * MIB, GRAPH_POOL)
        );
    }
}

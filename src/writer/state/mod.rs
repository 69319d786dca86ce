//! What is live on each device, and the capped event history, as the writer sees it.
//!
//! Cold (writer thread only). Applies events in queue order, which is a real
//! linearization: frees are queued before the real free, allocations after the real
//! allocation (docs/FORMAT.md#event-order). Each allocation is one segment holding one block;
//! each `cuMemMap` is one block inside a mapped range. The history is kept as a valid
//! forward history (docs/FORMAT.md#forward-history-rule), so any suffix of it (the newest
//! `max_entries`) is valid too.
//!
//! Robust to lost events: an allocation that overlaps a live one means a free was missed
//! (dropped under back-pressure); the stale one is closed with synthesized free events
//! and counted, so the history stays valid and the live set stays right.
//!
//! `cache`: PyTorch's caching allocator inside a device's state (its segments and blocks).

pub mod cache;

use crate::channel::event::Api;
use crate::writer::blocks::BlockMap;
use crate::writer::stacks::RawStackId;
use cache::{Cache, CacheCheck};
use rustc_hash::FxHashMap;
use std::collections::{BTreeMap, VecDeque};

/// Most device ordinals tracked; events for larger ordinals are filed under 0.
const MAX_DEVICES: usize = 256;
/// Step boundaries kept (older ones are older than any history a file can hold at the
/// default history size).
pub const MAX_STEP_MARKS: usize = 1 << 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    SegmentAlloc,
    Alloc,
    FreeRequested,
    FreeCompleted,
    SegmentFree,
    SegmentMap,
    SegmentUnmap,
    Oom,
    /// A marker: the signal that ends the job.
    Snapshot,
}

/// One history record: 40 bytes (a full history keeps two or three per event).
#[derive(Clone, Copy, Debug)]
pub struct TraceRec {
    pub action: Action,
    /// The block's address; for `Oom` (which has none), the free device bytes or -1 as
    /// `i64` bits, read through [`TraceRec::address`] and [`TraceRec::device_free`].
    pub addr: u64,
    pub size: u64,
    pub stream: u64,
    pub time_us: u64,
    pub stack: TraceStack,
    pub api: Api,
}

impl TraceRec {
    /// The address the record is about (0 for `Oom`).
    pub fn address(&self) -> u64 {
        if self.action == Action::Oom {
            0
        } else {
            self.addr
        }
    }

    /// Only for `Oom`: free device bytes, or -1.
    pub fn device_free(&self) -> Option<i64> {
        (self.action == Action::Oom).then_some(self.addr as i64)
    }
}

/// A history record's stack in 4 bytes (`Option<RawStackId>` takes 8; a full history keeps
/// two or three records per event): the id plus one, `None` for no stack. Id `u32::MAX`
/// (never reached: four billion distinct stacks) would read as no stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceStack(Option<std::num::NonZeroU32>);

impl TraceStack {
    pub fn new(stack: Option<RawStackId>) -> TraceStack {
        TraceStack(stack.and_then(|id| std::num::NonZeroU32::new(id.wrapping_add(1))))
    }

    pub fn get(self) -> Option<RawStackId> {
        self.0.map(|n| n.get() - 1)
    }
}

/// A live allocation or mapping.
#[derive(Clone, Copy, Debug)]
pub struct Live {
    pub size: u64,
    pub stream: u64,
    pub api: Api,
    pub stack: Option<RawStackId>,
    pub time_us: u64,
    /// VMM handle for mappings, 0 otherwise.
    pub handle: u64,
}

#[derive(Default)]
pub struct Device {
    pub allocs: BlockMap<Live>,
    pub mappings: BlockMap<Live>,
    pub trace: VecDeque<TraceRec>,
    /// Oldest events dropped from `trace` to respect `max_entries`.
    pub trace_overflow: u64,
    /// Trace events ever appended (the index of the next one).
    pub trace_total: u64,
    pub live_bytes: u64,
    /// Highest `live_bytes` since the last [`State::reset_peaks`].
    pub peak_bytes: u64,
    /// Highest `live_bytes` ever.
    pub peak_ever: u64,
    pub events: u64,
    pub ooms: u64,
    /// Physical bytes of VMM handles created on this device and not yet freed.
    pub physical_bytes: u64,
    /// PyTorch's caching allocator on this device: its segments and live blocks
    /// (`state/cache.rs`).
    pub cache: Cache,
}

#[derive(Clone, Copy, Debug)]
struct Handle {
    device: i32,
    size: u64,
    mapped: u32,
    released: bool,
}

/// Corrections and oddities, reported in every snapshot.
#[derive(Default, Debug, Clone, Copy)]
pub struct Anomalies {
    /// Frees of addresses memsnap never saw allocated (allocated before it started, or an
    /// allocation event was dropped). Passed through, not recorded.
    pub unknown_frees: u64,
    /// Live allocations closed because a new one overlapped them (a lost free).
    pub repaired_overlaps: u64,
    pub unknown_unmaps: u64,
    /// Caching-allocator events that did not fit what the CUDA calls showed (a block
    /// outside every segment, a free of an unknown block, a segment no CUDA call made).
    pub cache_mismatches: u64,
}

pub struct State {
    pub devices: Vec<Device>,
    handles: FxHashMap<u64, Handle>,
    pub managed: FxHashMap<u64, Live>,
    pub host_mappings: BTreeMap<u64, u64>,
    /// Mappings of handles created elsewhere (imported from another process): start → size.
    pub imported_mappings: BTreeMap<u64, u64>,
    pub reservations: BTreeMap<u64, u64>,
    pub anomalies: Anomalies,
    /// The check of PyTorch's allocator route (`state/cache.rs`).
    pub cache_check: CacheCheck,
    /// Step boundaries, oldest first: `(steps completed, time_us)`, the newest
    /// [`MAX_STEP_MARKS`] (written as `external_annotations`, docs/FORMAT.md).
    pub step_marks: VecDeque<(u64, u64)>,
    /// Newest history entries kept per device (`MEMSNAP_MAX_ENTRIES`, at least 1).
    max_entries: usize,
}

impl State {
    /// An empty state keeping each device's newest `max_entries` history entries
    /// (`MEMSNAP_MAX_ENTRIES`, at least 1 as the configuration reads it).
    pub fn new(max_entries: usize) -> State {
        State {
            devices: vec![Device::default()],
            handles: FxHashMap::default(),
            managed: FxHashMap::default(),
            host_mappings: BTreeMap::new(),
            imported_mappings: BTreeMap::new(),
            reservations: BTreeMap::new(),
            anomalies: Anomalies::default(),
            cache_check: CacheCheck::Pending,
            step_marks: VecDeque::new(),
            max_entries,
        }
    }

    /// Newest history entries kept per device.
    pub fn max_entries(&self) -> usize {
        self.max_entries
    }

    /// Device `device`'s state (device 0's for an id out of range), made on first use.
    /// Inlined: every event looks its device up several times, and a call each time was
    /// about a tenth of the writer's instructions on the caching allocator's entries.
    #[inline]
    pub(super) fn device(&mut self, device: i32) -> &mut Device {
        let d = if device < 0 || device as usize >= MAX_DEVICES {
            0
        } else {
            device as usize
        };
        if self.devices.len() <= d {
            self.add_devices(d + 1);
        }
        &mut self.devices[d]
    }

    #[cold]
    fn add_devices(&mut self, count: usize) {
        self.devices.resize_with(count, Device::default);
    }

    pub(super) fn push(&mut self, device: i32, rec: TraceRec) {
        self.push_all(device, [rec]);
    }

    /// [`Self::push`] of several records (the device found once).
    pub(super) fn push_all<const N: usize>(&mut self, device: i32, recs: [TraceRec; N]) {
        let max = self.max_entries;
        let dev = self.device(device);
        for rec in recs {
            // Full: the oldest goes first, so the history never holds more than `max`.
            if dev.trace.len() >= max {
                dev.trace.pop_front();
                dev.trace_overflow += 1;
            }
            dev.trace.push_back(rec);
        }
        dev.trace_total += N as u64;
    }

    pub(super) fn add_live(&mut self, device: i32, size: u64) {
        let dev = self.device(device);
        dev.live_bytes += size;
        dev.peak_bytes = dev.peak_bytes.max(dev.live_bytes);
        dev.peak_ever = dev.peak_ever.max(dev.live_bytes);
    }

    pub(super) fn sub_live(&mut self, device: i32, size: u64) {
        let dev = self.device(device);
        dev.live_bytes = dev.live_bytes.saturating_sub(size);
    }

    pub fn reset_peaks(&mut self) {
        for dev in &mut self.devices {
            dev.peak_bytes = dev.live_bytes;
        }
    }

    /// A device allocation: `segment_alloc` + `alloc`.
    pub fn alloc(&mut self, device: i32, addr: u64, size: u64, live: Live) {
        if addr == 0 || size == 0 {
            return;
        }
        let device = device.max(0);
        let end = addr.saturating_add(size);
        let ends = |start: u64, l: &Live| start.saturating_add(l.size);
        // The usual case, no live allocation in the way: checked and placed in one search.
        let live = match self
            .device(device)
            .allocs
            .insert_if_clear(addr, end, live, ends)
        {
            Ok(()) => {
                self.opened(device, addr, size, live, Action::SegmentAlloc);
                return;
            }
            Err(live) => live,
        };
        self.close_overlaps(device, addr, size, false);
        self.open_block(device, addr, size, live, Action::SegmentAlloc);
    }

    /// A free of `addr`: `free_requested` + `free_completed` + `segment_free` on whichever
    /// device holds it. `stack` is the free's own stack (context=all), else the
    /// allocation's is used, as PyTorch does.
    pub fn free(
        &mut self,
        addr: u64,
        api: Api,
        stream: u64,
        time_us: u64,
        stack: Option<RawStackId>,
    ) {
        // The first device that holds it (one search each, the removal itself).
        let found = self
            .devices
            .iter_mut()
            .enumerate()
            .find_map(|(d, dev)| Some((d, dev.allocs.remove(&addr)?)));
        let Some((d, live)) = found else {
            if self.free_cache_segment(addr, api, stream, time_us, stack) {
                return;
            }
            if self.managed.remove(&addr).is_none() {
                self.anomalies.unknown_frees += 1;
            }
            return;
        };
        self.emit_free(
            d as i32,
            addr,
            &live,
            api,
            stream,
            time_us,
            stack.or(live.stack),
            Action::SegmentFree,
        );
        self.devices[d].events += 1;
        self.sub_live(d as i32, live.size);
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn emit_free(
        &mut self,
        device: i32,
        addr: u64,
        live: &Live,
        api: Api,
        stream: u64,
        time_us: u64,
        stack: Option<RawStackId>,
        segment_action: Action,
    ) {
        let stream = if stream == 0 { live.stream } else { stream };
        let rec = |action| TraceRec {
            action,
            addr,
            size: live.size,
            stream,
            time_us,
            stack: TraceStack::new(stack),
            api,
        };
        self.push_all(
            device,
            [
                rec(Action::FreeRequested),
                rec(Action::FreeCompleted),
                rec(segment_action),
            ],
        );
    }

    /// Closes live allocations (or mappings) overlapping `[addr, addr+size)`: their free
    /// was lost. Keeps the history valid and the live set true.
    fn close_overlaps(&mut self, device: i32, addr: u64, size: u64, mappings: bool) {
        let end = addr.saturating_add(size);
        loop {
            let dev = self.device(device);
            let map = if mappings { &dev.mappings } else { &dev.allocs };
            let Some((start, &live)) = map.last_below(end) else {
                break;
            };
            if start.saturating_add(live.size) <= addr {
                break;
            }
            let (action, api) = if mappings {
                (Action::SegmentUnmap, Api::CuMemUnmap)
            } else {
                (Action::SegmentFree, live.api)
            };
            let dev = self.device(device);
            if mappings {
                dev.mappings.remove(&start);
            } else {
                dev.allocs.remove(&start);
            }
            self.emit_free(
                device,
                start,
                &live,
                api,
                0,
                live.time_us,
                live.stack,
                action,
            );
            self.sub_live(device, live.size);
            self.anomalies.repaired_overlaps += 1;
        }
    }

    pub fn managed_alloc(&mut self, addr: u64, live: Live) {
        if addr != 0 {
            self.managed.insert(addr, live);
        }
    }

    pub fn mem_create(&mut self, handle: u64, size: u64, device: i32) {
        self.handles.insert(
            handle,
            Handle {
                device,
                size,
                mapped: 0,
                released: false,
            },
        );
        if device >= 0 {
            self.device(device).physical_bytes += size;
        }
    }

    pub fn mem_release(&mut self, handle: u64) {
        if let Some(h) = self.handles.get_mut(&handle) {
            h.released = true;
            if h.mapped == 0 {
                self.drop_handle(handle);
            }
        }
    }

    /// One mapping of `handle` is gone: the handle's memory is freed with its last mapping
    /// once it was released.
    pub(super) fn handle_unmapped(&mut self, handle: u64) {
        let mut drop_it = false;
        if let Some(h) = self.handles.get_mut(&handle) {
            h.mapped = h.mapped.saturating_sub(1);
            drop_it = h.released && h.mapped == 0;
        }
        if drop_it {
            self.drop_handle(handle);
        }
    }

    fn drop_handle(&mut self, handle: u64) {
        if let Some(h) = self.handles.remove(&handle)
            && h.device >= 0
        {
            let dev = self.device(h.device);
            dev.physical_bytes = dev.physical_bytes.saturating_sub(h.size);
        }
    }

    /// `cuMemMap`: a block inside a mapped range: `segment_map` + `alloc`.
    pub fn map(&mut self, addr: u64, size: u64, live: Live) {
        if size == 0 {
            return;
        }
        let device = match self.handles.get_mut(&live.handle) {
            Some(h) => {
                h.mapped += 1;
                h.device
            }
            // A handle memsnap never saw created: imported from another process
            // (cuMemImportFromShareableHandle: NCCL maps its peers' buffers so), memory that
            // process owns and records. Kept apart, never counted as this process's device
            // memory.
            None => {
                self.imported_mappings.insert(addr, size);
                return;
            }
        };
        if device < 0 {
            self.host_mappings.insert(addr, size);
            return;
        }
        self.close_overlaps(device, addr, size, true);
        self.open_block(device, addr, size, live, Action::SegmentMap);
    }

    /// A new live block: `segment_alloc` (its own segment) or `segment_map` (a mapping in a
    /// mapped range), then `alloc`.
    fn open_block(&mut self, device: i32, addr: u64, size: u64, live: Live, segment: Action) {
        let dev = self.device(device);
        if segment == Action::SegmentMap {
            dev.mappings.insert(addr, live);
        } else {
            dev.allocs.insert(addr, live);
        }
        self.opened(device, addr, size, live, segment);
    }

    /// The records and counts of a block just placed in its map (see [`Self::open_block`]).
    fn opened(&mut self, device: i32, addr: u64, size: u64, live: Live, segment: Action) {
        let rec = |action| TraceRec {
            action,
            addr,
            size,
            stream: live.stream,
            time_us: live.time_us,
            stack: TraceStack::new(live.stack),
            api: live.api,
        };
        self.push_all(device, [rec(segment), rec(Action::Alloc)]);
        self.device(device).events += 1;
        self.add_live(device, size);
    }

    /// `cuMemUnmap` of a range covering one or more whole mappings.
    pub fn unmap(&mut self, addr: u64, size: u64, time_us: u64, stack: Option<RawStackId>) {
        let end = addr.saturating_add(size.max(1));
        let mappings = self.take_mappings(addr, end);
        let found = !mappings.is_empty();
        for (d, start, live) in mappings {
            self.emit_free(
                d,
                start,
                &live,
                Api::CuMemUnmap,
                0,
                time_us,
                stack.or(live.stack),
                Action::SegmentUnmap,
            );
            self.device(d).events += 1;
            self.sub_live(d, live.size);
            self.handle_unmapped(live.handle);
        }
        let host = remove_range(&mut self.host_mappings, addr..end);
        let imported = remove_range(&mut self.imported_mappings, addr..end);
        let found = found | self.unmap_cache_segments(addr, end, time_us, stack);
        if !found && !host && !imported {
            self.anomalies.unknown_unmaps += 1;
        }
    }

    /// Takes out every device's mappings that start in `[addr, end)`: (device, start,
    /// mapping), device by device, each in address order.
    fn take_mappings(&mut self, addr: u64, end: u64) -> Vec<(i32, u64, Live)> {
        let mut taken = Vec::new();
        for (d, dev) in self.devices.iter_mut().enumerate() {
            let starts: Vec<u64> = dev.mappings.range(addr..end).map(|(&a, _)| a).collect();
            for start in starts {
                if let Some(live) = dev.mappings.remove(&start) {
                    taken.push((d as i32, start, live));
                }
            }
        }
        taken
    }

    #[allow(clippy::too_many_arguments)] // one field per column of the `oom` event
    pub fn oom(
        &mut self,
        device: i32,
        size: u64,
        device_free: i64,
        stream: u64,
        time_us: u64,
        api: Api,
        stack: Option<RawStackId>,
    ) {
        let device = device.max(0);
        self.push(
            device,
            TraceRec {
                action: Action::Oom,
                // No address: the free device bytes go in its place (TraceRec::device_free).
                addr: device_free as u64,
                size,
                stream,
                time_us,
                stack: TraceStack::new(stack),
                api,
            },
        );
        let dev = self.device(device);
        dev.ooms += 1;
        dev.events += 1;
    }

    /// A `snapshot` marker in every device's history (device 0 when none has one yet):
    /// the signal that ends the job, with the signalled thread's stack.
    pub fn marker(&mut self, time_us: u64, stack: Option<RawStackId>, api: Api) {
        let devices = self.devices.len().max(1) as i32;
        for device in 0..devices {
            self.push(
                device,
                TraceRec {
                    action: Action::Snapshot,
                    addr: 0,
                    size: 0,
                    stream: 0,
                    time_us,
                    stack: TraceStack::new(stack),
                    api,
                },
            );
        }
    }

    /// `memsnap_step()`: `steps` steps are complete from `time_us` on.
    pub fn mark_step(&mut self, steps: u64, time_us: u64) {
        if self.step_marks.len() == MAX_STEP_MARKS {
            self.step_marks.pop_front();
        }
        self.step_marks.push_back((steps, time_us));
    }

    /// The last step boundary is at `time_us` instead (where the program marked the step
    /// the optimizer's mark had closed: `writer::steps`).
    pub fn move_last_step_mark(&mut self, time_us: u64) {
        if let Some((_, time)) = self.step_marks.back_mut() {
            *time = time_us;
        }
    }

    pub fn reserve(&mut self, addr: u64, size: u64) {
        self.reservations.insert(addr, size);
    }

    pub fn reserve_free(&mut self, addr: u64) {
        self.reservations.remove(&addr);
    }

    /// Bytes in live managed allocations.
    pub fn managed_bytes(&self) -> u64 {
        self.managed.values().map(|l| l.size).sum()
    }
}

/// The keys of `map` that lie in `range`, collected, so that the map can change while
/// they are visited.
fn keys_in<V>(map: &BTreeMap<u64, V>, range: std::ops::Range<u64>) -> Vec<u64> {
    map.range(range).map(|(&k, _)| k).collect()
}

/// Removes the entries of `map` whose keys lie in `range`; whether there were any.
fn remove_range(map: &mut BTreeMap<u64, u64>, range: std::ops::Range<u64>) -> bool {
    let keys = keys_in(map, range);
    for k in &keys {
        map.remove(k);
    }
    !keys.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

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

    fn actions(s: &State, d: usize) -> Vec<(Action, u64, u64)> {
        s.devices[d]
            .trace
            .iter()
            .map(|r| (r.action, r.addr, r.size))
            .collect()
    }

    #[test]
    fn a_history_record_is_40_bytes_and_keeps_its_stack_and_free_bytes() {
        assert_eq!(std::mem::size_of::<TraceRec>(), 40);
        let mut s = State::new(10);
        s.oom(0, 1 << 30, -1, 0, 5, Api::CudaMalloc, Some(3));
        s.oom(0, 1 << 30, 123_456, 0, 6, Api::CudaMalloc, None);
        s.alloc(0, 0x1000, 512, live(512));
        let t = &s.devices[0].trace;
        assert_eq!((t[0].address(), t[0].device_free()), (0, Some(-1)));
        assert_eq!(t[0].stack.get(), Some(3));
        assert_eq!((t[1].address(), t[1].device_free()), (0, Some(123_456)));
        assert_eq!((t[2].address(), t[2].device_free()), (0x1000, None));
        for stack in [None, Some(0), Some(7), Some(u32::MAX - 1)] {
            assert_eq!(TraceStack::new(stack).get(), stack);
        }
    }

    #[test]
    fn alloc_then_free_is_the_five_event_model() {
        let mut s = State::new(100);
        s.alloc(0, 0x1000, 512, live(512));
        s.free(0x1000, Api::CudaFree, 0, 2, None);
        assert_eq!(
            actions(&s, 0),
            vec![
                (Action::SegmentAlloc, 0x1000, 512),
                (Action::Alloc, 0x1000, 512),
                (Action::FreeRequested, 0x1000, 512),
                (Action::FreeCompleted, 0x1000, 512),
                (Action::SegmentFree, 0x1000, 512),
            ]
        );
        assert_eq!(s.devices[0].live_bytes, 0);
        assert_eq!(s.devices[0].peak_ever, 512);
    }

    #[test]
    fn frees_find_the_right_device_and_unknown_frees_are_counted() {
        let mut s = State::new(100);
        s.alloc(1, 0x2000, 100, live(100));
        s.free(0x2000, Api::CudaFree, 0, 2, None);
        s.free(0x9999, Api::CudaFree, 0, 2, None);
        assert_eq!(s.devices.len(), 2);
        assert_eq!(s.devices[1].trace.len(), 5);
        assert!(s.devices[0].trace.is_empty());
        assert_eq!(s.anomalies.unknown_frees, 1);
    }

    #[test]
    fn a_lost_free_is_repaired_when_the_address_comes_back() {
        let mut s = State::new(100);
        s.alloc(0, 0x1000, 4096, live(4096));
        s.alloc(0, 0x1800, 100, live(100)); // overlaps: the free of 0x1000 was lost
        assert_eq!(s.anomalies.repaired_overlaps, 1);
        assert_eq!(s.devices[0].allocs.len(), 1);
        assert_eq!(s.devices[0].live_bytes, 100);
        let a = actions(&s, 0);
        assert_eq!(
            a[2..5].iter().map(|x| x.0).collect::<Vec<_>>(),
            [
                Action::FreeRequested,
                Action::FreeCompleted,
                Action::SegmentFree
            ]
        );
    }

    #[test]
    fn history_keeps_the_newest_entries() {
        let mut s = State::new(4);
        for i in 0..3 {
            s.alloc(0, 0x1000 * (i + 1), 10, live(10));
        }
        assert_eq!(s.devices[0].trace.len(), 4);
        assert_eq!(s.devices[0].trace_overflow, 2);
        assert_eq!(s.devices[0].trace.front().map(|r| r.addr), Some(0x2000));
    }

    #[test]
    fn a_mapped_handle_from_another_process_is_not_this_process_memory() {
        let mut s = State::new(100);
        let imported = Live {
            handle: 42, // never created here: imported from a peer
            api: Api::CuMemMap,
            ..live(2 << 20)
        };
        s.map(0x10_0000_0000, 2 << 20, imported);
        assert!(
            s.devices
                .iter()
                .all(|d| d.mappings.is_empty() && d.live_bytes == 0)
        );
        assert_eq!(s.imported_mappings.values().sum::<u64>(), 2 << 20);
        s.unmap(0x10_0000_0000, 2 << 20, 5, None);
        assert!(s.imported_mappings.is_empty());
        assert_eq!(s.anomalies.unknown_unmaps, 0);
    }

    #[test]
    fn mappings_follow_their_handle_device_and_unmap_covers_several() {
        let mut s = State::new(100);
        s.mem_create(7, 2 << 20, 1);
        s.mem_create(8, 2 << 20, 1);
        s.mem_create(9, 2 << 20, -1); // host NUMA memory
        let m = |h| Live {
            handle: h,
            api: Api::CuMemMap,
            ..live(2 << 20)
        };
        s.map(0x10_0000_0000, 2 << 20, m(7));
        s.map(0x10_0020_0000, 2 << 20, m(8));
        s.map(0x20_0000_0000, 2 << 20, m(9));
        assert_eq!(s.devices[1].mappings.len(), 2);
        assert_eq!(s.host_mappings.len(), 1);
        assert_eq!(s.devices[1].physical_bytes, 4 << 20);
        s.mem_release(7);
        assert_eq!(s.devices[1].physical_bytes, 4 << 20, "still mapped");
        s.unmap(0x10_0000_0000, 4 << 20, 5, None);
        assert!(s.devices[1].mappings.is_empty());
        assert_eq!(
            s.devices[1].physical_bytes,
            2 << 20,
            "7 freed on unmap, 8 not released"
        );
        let kinds: Vec<Action> = s.devices[1].trace.iter().map(|r| r.action).collect();
        assert_eq!(
            kinds.iter().filter(|a| **a == Action::SegmentUnmap).count(),
            2
        );
        assert_eq!(s.devices[1].live_bytes, 0);
    }
}

//! Per-device figures of one snapshot: live, pending-free and reserved bytes at the end,
//! the peaks and start of the history, the live set at each OOM and at the `--at` moment,
//! by site and by library; the devices a file has, the history cap's labels, and the live
//! set of every device at one moment ([`moments`], for `diff` and `flamegraph`).
//!
//! Cold code. Definitions (also printed by `memsnap summary --help`):
//! - *live*: blocks in state `active_allocated` (block sizes); *reserved*: Σ segment sizes.
//! - *peak*: the history is followed forward and anchored to the final state, in the units
//!   the trace uses (requested bytes: `alloc` carries the requested size), so a history
//!   capped by a ring buffer starts from the live state it implies instead of from zero
//!   (see [`crate::history`]).
//! - *at a moment* (`--at`): the live set then, from the history, in requested bytes,
//!   beside the same figures at the end.
//! - *private pools*: segments whose `segment_pool_id` is not `(0, 0)` belong to a private
//!   pool of PyTorch's caching allocator (a CUDA graph's, as torch.compile's
//!   `reduce-overhead` mode makes, or a `torch.cuda.MemPool`): only that pool's allocations
//!   use them ([`private_pools`]).

use crate::at::Resolved;
use crate::history::{EndBlock, History};
use crate::sites::{Library, Sites};
use crate::tally::{Tally, sorted};
use memsnap_format::model::{BlockState, Snapshot, StackId};
use rustc_hash::FxHashMap;

/// The memory of one private pool of PyTorch's caching allocator on one device, at the end.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PrivatePool {
    /// The pool's id, `segment_pool_id`.
    pub pool: (i64, i64),
    pub segments: i64,
    /// Σ of its segments' sizes.
    pub reserved_bytes: i64,
    /// Its `active_allocated` blocks (block bytes).
    pub live_bytes: i64,
}

/// The private pools with segments on `device`, in the order of their ids.
pub fn private_pools(snap: &Snapshot, device: i64) -> Vec<PrivatePool> {
    let mut pools: std::collections::BTreeMap<(i64, i64), PrivatePool> = Default::default();
    for seg in snap.segments.iter().filter(|s| s.device == device) {
        if seg.segment_pool_id == (0, 0) {
            continue;
        }
        let p = pools
            .entry(seg.segment_pool_id)
            .or_insert_with(|| PrivatePool {
                pool: seg.segment_pool_id,
                segments: 0,
                reserved_bytes: 0,
                live_bytes: 0,
            });
        p.segments += 1;
        p.reserved_bytes += seg.total_size;
        p.live_bytes += seg
            .blocks
            .iter()
            .filter(|b| b.state == BlockState::ActiveAllocated)
            .map(|b| b.size)
            .sum::<i64>();
    }
    pools.into_values().collect()
}

/// How a private pool reads in a report: `pool (0, 1): 22.0 MiB reserved in 3 segments,
/// 3.0 MiB live`.
pub fn describe_private_pool(p: &PrivatePool) -> String {
    format!(
        "pool ({}, {}): {} reserved in {} segment{}, {} live",
        p.pool.0,
        p.pool.1,
        crate::bytes::fmt_bytes(p.reserved_bytes),
        p.segments,
        if p.segments == 1 { "" } else { "s" },
        crate::bytes::fmt_bytes(p.live_bytes),
    )
}

pub struct OomInfo {
    pub event: usize,
    pub requested: i64,
    pub device_free: Option<i64>,
    pub time_us: i64,
    pub site: u32,
    pub library: Library,
    /// Live (requested bytes, allocations) at that moment, and reserved bytes.
    pub live: Tally,
    pub reserved: i64,
    pub holders: Vec<(u32, Tally)>,
}

pub struct DeviceStats {
    pub device: i64,
    pub live: Tally,
    pub live_requested: i64,
    pub pending_free: Tally,
    /// Inactive blocks: free space a caching allocator keeps in its segments.
    pub cached_free: Tally,
    /// The largest of them.
    pub largest_free_block: i64,
    pub reserved: Tally,
    pub events: usize,
    pub start_live_requested: i64,
    pub peak_live_requested: i64,
    /// Index of the event after which the peak was reached; `None` = before the first.
    pub peak_after_event: Option<usize>,
    pub start_reserved: i64,
    pub peak_reserved: i64,
    pub by_site: FxHashMap<u32, Tally>,
    pub by_library: FxHashMap<Library, Tally>,
    pub ooms: Vec<OomInfo>,
    /// The live set at the moment `--at` asked for, with the end beside it.
    pub at: AtInfo,
}

/// The live set at one moment, by site and library, in requested bytes; the end's in the
/// same units beside it.
pub struct AtInfo {
    pub moment: Resolved,
    pub live: Tally,
    pub reserved: i64,
    pub by_site: FxHashMap<u32, Tally>,
    pub by_library: FxHashMap<Library, Tally>,
    pub end_by_site: FxHashMap<u32, Tally>,
    pub end_by_library: FxHashMap<Library, Tally>,
}

impl AtInfo {
    fn new(sites: &Sites, at: crate::history::AtState, end: &[EndBlock]) -> Self {
        let mut info = AtInfo {
            moment: at.moment,
            live: Tally::default(),
            reserved: at.reserved,
            by_site: FxHashMap::default(),
            by_library: FxHashMap::default(),
            end_by_site: FxHashMap::default(),
            end_by_library: FxHashMap::default(),
        };
        for (stack, t) in &at.holders {
            info.live.merge(*t);
            info.by_site
                .entry(sites.site(*stack))
                .or_default()
                .merge(*t);
            info.by_library
                .entry(sites.library(*stack))
                .or_default()
                .merge(*t);
        }
        for b in end {
            info.end_by_site
                .entry(sites.site(b.stack))
                .or_default()
                .add(b.requested);
            info.end_by_library
                .entry(sites.library(b.stack))
                .or_default()
                .add(b.requested);
        }
        info
    }
}

/// Every active block of `device` in the snapshot (what is live after the last event).
pub fn end_blocks(snap: &Snapshot, device: i64) -> Vec<EndBlock> {
    snap.segments
        .iter()
        .filter(|s| s.device == device)
        .flat_map(|seg| seg.blocks.iter())
        .filter(|b| b.state.is_active())
        .map(|b| EndBlock {
            address: b.address,
            requested: b.requested_size,
            stack: b.stack,
        })
        .collect()
}

/// Reserved bytes of `device` in the snapshot.
pub fn end_reserved(snap: &Snapshot, device: i64) -> i64 {
    snap.segments
        .iter()
        .filter(|s| s.device == device)
        .map(|s| s.total_size)
        .sum()
}

/// Every device of the file, in order: one per `device_traces` list, empty or not (the
/// lists are the devices: docs/FORMAT.md, "Producer's rules", rule 2, one list per device
/// index that occurs), and any segment's device that has no list. `summary`, `ranks`,
/// `view` and `check` count devices this way.
pub fn devices(snap: &Snapshot) -> Vec<i64> {
    let mut d: Vec<i64> = snap.segments.iter().map(|s| s.device).collect();
    d.extend((0i64..).take(snap.device_traces.len()));
    d.sort_unstable();
    d.dedup();
    d
}

/// The history of `device` (an empty one for a device without entries).
pub fn history_of(histories: &[History], device: i64) -> std::borrow::Cow<'_, History> {
    usize::try_from(device)
        .ok()
        .and_then(|d| histories.get(d))
        .map_or_else(Default::default, std::borrow::Cow::Borrowed)
}

pub fn device_stats(snap: &Snapshot, sites: &Sites, device: i64, hist: &History) -> DeviceStats {
    let mut st = DeviceStats {
        device,
        live: Tally::default(),
        live_requested: 0,
        pending_free: Tally::default(),
        cached_free: Tally::default(),
        largest_free_block: 0,
        reserved: Tally::default(),
        events: hist.events,
        start_live_requested: 0,
        peak_live_requested: 0,
        peak_after_event: None,
        start_reserved: 0,
        peak_reserved: 0,
        by_site: FxHashMap::default(),
        by_library: FxHashMap::default(),
        ooms: Vec::new(),
        at: AtInfo::new(sites, crate::history::AtState::empty(), &[]),
    };
    let mut active_requested = 0i64;
    for seg in snap.segments.iter().filter(|s| s.device == device) {
        st.reserved.add(seg.total_size);
        for b in &seg.blocks {
            match b.state {
                BlockState::ActiveAllocated => {
                    st.live.add(b.size);
                    st.live_requested += b.requested_size;
                    active_requested += b.requested_size;
                    st.by_site
                        .entry(sites.site(b.stack))
                        .or_default()
                        .add(b.size);
                    st.by_library
                        .entry(sites.library(b.stack))
                        .or_default()
                        .add(b.size);
                }
                BlockState::ActivePendingFree => {
                    st.pending_free.add(b.size);
                    active_requested += b.requested_size;
                }
                BlockState::Inactive => {
                    st.cached_free.add(b.size);
                    st.largest_free_block = st.largest_free_block.max(b.size);
                }
            }
        }
    }
    let end_blocks = end_blocks(snap, device);
    st.at = AtInfo::new(
        sites,
        hist.at_with_end(&end_blocks, st.reserved.bytes),
        &end_blocks,
    );
    // The state after the last entry is the snapshot itself.
    st.start_live_requested = hist.start_live(active_requested);
    (st.peak_live_requested, st.peak_after_event) = hist.peak_live(active_requested);
    st.start_reserved = hist.start_reserved(st.reserved.bytes);
    st.peak_reserved = hist.peak_reserved(st.reserved.bytes);
    st.ooms = hist
        .ooms_with_end(&end_blocks, st.reserved.bytes)
        .into_iter()
        .map(|o| {
            let mut by_site: FxHashMap<u32, Tally> = FxHashMap::default();
            let mut total = Tally::default();
            for (stack, t) in &o.holders {
                by_site.entry(sites.site(*stack)).or_default().merge(*t);
                total.merge(*t);
            }
            OomInfo {
                event: o.oom.event,
                requested: o.oom.requested,
                device_free: o.oom.device_free,
                time_us: o.oom.time_us,
                site: sites.site(o.oom.stack),
                library: sites.library(o.oom.stack),
                live: total,
                reserved: o.reserved,
                holders: sorted(&by_site),
            }
        })
        .collect();
    st
}

/// Trace events of `device` the file's history cap dropped (memsnap's per-device
/// `history_dropped`); `None` when the file does not say (PyTorch's files).
pub fn history_dropped(snap: &Snapshot, device: i64) -> Option<i64> {
    use memsnap_format::model::Meta;
    let Some(Meta::List(devices)) = snap.meta("devices") else {
        return None;
    };
    devices.iter().find_map(|d| {
        let Meta::Dict(kv) = d else { return None };
        let get = |key: &str| {
            kv.iter().find_map(|(k, v)| match v {
                Meta::Int(i) if k == key => Some(*i),
                _ => None,
            })
        };
        (get("device") == Some(device)).then(|| get("history_dropped"))?
    })
}

/// `history capped: kept N of M events` when the cap dropped any, else `None`.
pub fn capped_label(kept: usize, dropped: Option<i64>) -> Option<String> {
    let dropped = dropped.filter(|&d| d > 0)?;
    Some(format!(
        "history capped: kept {kept} of {} events",
        kept as i64 + dropped
    ))
}

/// Live bytes by site over all devices (for diff and ranks).
pub fn live_by_site(snap: &Snapshot, sites: &Sites) -> FxHashMap<u32, Tally> {
    let mut m: FxHashMap<u32, Tally> = FxHashMap::default();
    for seg in &snap.segments {
        for b in seg
            .blocks
            .iter()
            .filter(|b| b.state == BlockState::ActiveAllocated)
        {
            m.entry(sites.site(b.stack)).or_default().add(b.size);
        }
    }
    m
}

/// One device's live set at the moment its history followed (`--at`), by allocating stack.
pub struct DeviceMoment {
    pub device: i64,
    /// Requested bytes and allocations by stack.
    pub holders: FxHashMap<Option<StackId>, Tally>,
    pub moment: Resolved,
    /// `device D: history capped: kept N of M events`, where the cap dropped events.
    pub capped: Option<String>,
}

/// The live set of every device at the moment each history followed.
pub fn moments(snap: &Snapshot, histories: &[History]) -> Vec<DeviceMoment> {
    devices(snap)
        .into_iter()
        .map(|d| {
            let hist = history_of(histories, d);
            let end = end_blocks(snap, d);
            let state = hist.at_with_end(&end, end_reserved(snap, d));
            DeviceMoment {
                device: d,
                holders: state.holders,
                moment: state.moment,
                capped: capped_label(hist.events, history_dropped(snap, d))
                    .map(|c| format!("device {d}: {c}")),
            }
        })
        .collect()
}

/// Why a moment asked for by name is nowhere: `Some(reason)` when there are devices and
/// none of them reached it (the first device's reason), else `None`.
pub fn unreached<'m>(moments: impl IntoIterator<Item = &'m Resolved>) -> Option<String> {
    let mut first = None;
    for m in moments {
        let why = m.unreached.as_ref()?;
        first.get_or_insert_with(|| why.clone());
    }
    first
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sites::{Attribution, StackBytes};
    use memsnap_format::model::{Action, Frame};

    fn fr(name: &str, file: &str, line: i64) -> Frame {
        Frame {
            name: name.into(),
            filename: file.into(),
            line,
        }
    }

    /// A memsnap-style snapshot: one segment per live block, stacks `x.py:1`, `y.py:2`...
    fn snap_with(
        events: &[(Action, i64, i64, Option<StackId>)],
        live: &[(i64, i64, StackId)],
    ) -> Snapshot {
        use memsnap_format::model::{Meta, Segment, TraceEntry};
        let frames: Vec<Frame> = (0..4)
            .map(|i| fr("f", &format!("/app/s{i}.py"), i + 1))
            .collect();
        let entry =
            |(action, addr, size, stack): &(Action, i64, i64, Option<StackId>)| TraceEntry {
                action: action.clone(),
                addr: *addr,
                size: *size,
                stream: 0,
                time_us: 0,
                stack: *stack,
                device_free: (*action == Action::Oom).then_some(7),
                user_metadata: None,
            };
        Snapshot {
            frames,
            stacks: (0..4).map(|i| vec![i]).collect(),
            segments: live
                .iter()
                .map(|&(addr, size, st)| Segment::one_allocation(0, addr, size, Some(st)))
                .collect(),
            device_traces: vec![events.iter().map(entry).collect()],
            allocator_settings: vec![],
            memsnap: vec![("dropped_events".into(), Meta::Int(0))],
            step_marks: vec![],
        }
    }

    #[test]
    fn oom_holders_are_the_live_set_at_the_oom_not_at_the_end() {
        use Action::*;
        // A (s0) and B (s1) live; OOM asked by s2; then A freed and C (s3) allocated.
        let s = snap_with(
            &[
                (Alloc, 0x1000, 100, Some(0)),
                (Alloc, 0x2000, 200, Some(1)),
                (Oom, 0, 5000, Some(2)),
                (FreeCompleted, 0x1000, 100, None),
                (Alloc, 0x3000, 300, Some(3)),
            ],
            &[(0x2000, 200, 1), (0x3000, 300, 3)],
        );
        let sites = Sites::new(&s, &Attribution::default(), &StackBytes::of_whole(&s));
        let st = device_stats(
            &s,
            &sites,
            0,
            &History::of(&s.device_traces[0], crate::at::At::Auto),
        );
        assert_eq!(st.ooms.len(), 1);
        let o = &st.ooms[0];
        assert_eq!((o.event, o.requested, o.device_free), (2, 5000, Some(7)));
        assert_eq!(sites.text(o.site), "/app/s2.py:3 (f)");
        assert_eq!(
            o.live,
            Tally {
                bytes: 300,
                count: 2
            }
        );
        let held: Vec<(&str, i64)> = o
            .holders
            .iter()
            .map(|(s, t)| (sites.text(*s), t.bytes))
            .collect();
        // The free carried no stack: the holder is found through its alloc.
        assert_eq!(held, [("/app/s1.py:2 (f)", 200), ("/app/s0.py:1 (f)", 100)]);
        assert_eq!(
            st.live,
            Tally {
                bytes: 500,
                count: 2
            }
        );
        assert_eq!(st.peak_live_requested, 500);
        assert_eq!(st.start_live_requested, 0);
    }

    #[test]
    fn capped_history_starts_from_the_implied_live_state() {
        use Action::*;
        // 1000 bytes were live before the first kept event; then one freed, one allocated.
        let s = snap_with(
            &[
                (FreeCompleted, 0x9000, 400, Some(0)),
                (Alloc, 0x1000, 100, Some(1)),
            ],
            &[(0x1000, 100, 1), (0x5000, 600, 2)],
        );
        let sites = Sites::new(&s, &Attribution::default(), &StackBytes::of_whole(&s));
        let st = device_stats(
            &s,
            &sites,
            0,
            &History::of(&s.device_traces[0], crate::at::At::Auto),
        );
        assert_eq!(st.start_live_requested, 1000);
        assert_eq!(st.peak_live_requested, 1000);
        assert_eq!(st.peak_after_event, None);
        assert_eq!(st.live.bytes, 700);
    }
}

//! `view`'s model: the data the HTML page draws, per device: per-event (timeline site,
//! delta) arrays, the live bytes by site before the first event, the sites drawn
//! separately (the `top` with the highest peak of their own; the rest are "other"), the
//! segment map, the OOMs, the moment the page opens at (`--at`; default the first OOM,
//! else the peak) and the history cap; and the stacks and frame texts, deduplicated. The
//! CLI serializes it into the page's JSON island. Cold code.

use crate::at::{At, Pos};
use crate::bytes::fmt_bytes;
use crate::device;
use crate::history::History;
use crate::sites::{Attribution, Sites, StackBytes, is_hidden, stack_frame_text};
use memsnap_format::model::{Action, BlockState, Snapshot, StackId, TraceEntry};
use rustc_hash::FxHashMap;
use serde::Serialize;

/// Frames kept per stack in the page.
const MAX_FRAMES: usize = 48;
/// Stacks kept per site for search.
const STACKS_PER_SITE: usize = 6;
/// The timeline site of an event that changes no live bytes.
const NO_SITE: u32 = u32::MAX;

#[derive(Serialize)]
pub struct PageSite {
    pub text: String,
    pub lib: &'static str,
    /// Stack indices (first = representative) for hover and search.
    pub stacks: Vec<u32>,
}

#[derive(Serialize)]
pub struct PageSegment {
    /// Hex: addresses can exceed 2^53.
    pub addr: String,
    pub size: i64,
    /// [offset in segment, size, state (0 allocated, 1 pending free, 2 inactive),
    ///  timeline site (-1 none), stack (-1 none)]
    pub blocks: Vec<[i64; 5]>,
}

#[derive(Serialize)]
pub struct PageDevice {
    pub device: i64,
    pub sites: Vec<PageSite>,
    pub init: Vec<i64>,
    pub ev_site: Vec<i32>,
    pub ev_delta: Vec<i64>,
    /// Event indices of OOMs (drawn as red marks), and the bytes each asked for.
    pub ooms: Vec<usize>,
    pub oom_requested: Vec<i64>,
    pub segments: Vec<PageSegment>,
    /// The moment the page opens at.
    pub at: PageAt,
    /// `history capped: kept N of M events`, when the cap dropped events.
    pub capped: Option<String>,
}

#[derive(Serialize)]
pub struct PageAt {
    /// The state after this event is shown (-1: before the first event).
    pub event: i64,
    /// `the peak (after event 8, +1.234 s)`.
    pub label: String,
    /// Short: `peak`, `OOM`, `event 12`, `end`.
    pub short: String,
}

#[derive(Serialize)]
pub struct Page {
    pub title: String,
    pub devices: Vec<PageDevice>,
    pub stacks: Vec<Vec<u32>>,
    pub frames: Vec<String>,
}

/// Stacks and frame texts shipped to the page, deduplicated.
#[derive(Default)]
struct Table {
    stacks: Vec<Vec<u32>>,
    frames: Vec<String>,
    stack_of: FxHashMap<StackId, u32>,
    frame_of: FxHashMap<u32, u32>,
}

impl Table {
    fn stack(&mut self, snap: &Snapshot, s: Option<StackId>) -> i64 {
        let Some(s) = s else { return -1 };
        if let Some(&i) = self.stack_of.get(&s) {
            return i as i64;
        }
        let ids = snap
            .stacks
            .get(s as usize)
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        let mut out = Vec::new();
        for &f in ids {
            let Some(fr) = snap.frames.get(f as usize) else {
                continue;
            };
            if is_hidden(fr) {
                continue;
            }
            if out.len() == MAX_FRAMES {
                break;
            }
            let next = self.frames.len() as u32;
            let id = *self.frame_of.entry(f).or_insert(next);
            if id == next {
                self.frames.push(stack_frame_text(fr));
            }
            out.push(id);
        }
        let i = self.stacks.len() as u32;
        self.stacks.push(out);
        self.stack_of.insert(s, i);
        i as i64
    }
}

/// A few stacks of each site (for hover and search), the first one representative.
#[derive(Default)]
struct StacksOfSite(FxHashMap<u32, Vec<Option<StackId>>>);

impl StacksOfSite {
    fn note(&mut self, site: u32, stack: Option<StackId>) {
        let v = self.0.entry(site).or_default();
        if v.len() < STACKS_PER_SITE && stack.is_some() && !v.contains(&stack) {
            v.push(stack);
        }
    }
    fn of(&self, site: u32) -> &[Option<StackId>] {
        self.0.get(&site).map(Vec::as_slice).unwrap_or(&[])
    }
}

/// Every entry's (site, live delta): allocations to their site, frees to the site of
/// their allocation (else their own stack's), other entries to [`NO_SITE`].
fn attribute_events(
    trace: &[TraceEntry],
    sites: &Sites,
    stacks: &mut StacksOfSite,
) -> Vec<(u32, i64)> {
    let mut last_alloc: FxHashMap<i64, u32> = FxHashMap::default();
    trace
        .iter()
        .map(|e| match e.action {
            Action::Alloc => {
                let s = sites.site(e.stack);
                last_alloc.insert(e.addr, s);
                stacks.note(s, e.stack);
                (s, e.size)
            }
            Action::FreeCompleted | Action::Free => {
                let s = last_alloc
                    .remove(&e.addr)
                    .unwrap_or_else(|| sites.site(e.stack));
                (s, -e.size)
            }
            _ => (NO_SITE, 0),
        })
        .collect()
}

/// Requested bytes live at the end by site (the snapshot's active blocks of `device`).
fn end_live_by_site(
    snap: &Snapshot,
    sites: &Sites,
    device: i64,
    stacks: &mut StacksOfSite,
) -> FxHashMap<u32, i64> {
    let mut end: FxHashMap<u32, i64> = FxHashMap::default();
    for seg in snap.segments.iter().filter(|s| s.device == device) {
        for b in seg.blocks.iter().filter(|b| b.state.is_active()) {
            let s = sites.site(b.stack);
            *end.entry(s).or_default() += b.requested_size;
            stacks.note(s, b.stack);
        }
    }
    end
}

/// Live bytes by site before the first event: the end's minus the history's net change.
/// Every site of the end or the history is present.
fn start_live_by_site(end: &FxHashMap<u32, i64>, ev: &[(u32, i64)]) -> FxHashMap<u32, i64> {
    let mut start = end.clone();
    for &(s, d) in ev.iter().filter(|(s, _)| *s != NO_SITE) {
        *start.entry(s).or_default() -= d;
    }
    start
}

/// The `top` sites with the highest peak of their own over the history (ties by text).
fn rank_by_peak(
    sites: &Sites,
    start: &FxHashMap<u32, i64>,
    ev: &[(u32, i64)],
    top: usize,
) -> Vec<u32> {
    let mut cur = start.clone();
    let mut peak = start.clone();
    for &(s, d) in ev.iter().filter(|(s, _)| *s != NO_SITE) {
        let c = cur.entry(s).or_default();
        *c += d;
        let p = peak.entry(s).or_default();
        *p = (*p).max(*c);
    }
    let mut ranked: Vec<u32> = start.keys().copied().collect();
    ranked.sort_by(|a, b| {
        peak[b]
            .cmp(&peak[a])
            .then(sites.text(*a).cmp(sites.text(*b)))
            .then(a.cmp(b))
    });
    ranked.truncate(top);
    ranked
}

/// The drawn sites, then "other sites".
fn page_sites(
    snap: &Snapshot,
    sites: &Sites,
    table: &mut Table,
    ranked: &[u32],
    stacks: &StacksOfSite,
) -> Vec<PageSite> {
    let mut out: Vec<PageSite> = ranked
        .iter()
        .map(|&s| PageSite {
            text: sites.text(s).to_string(),
            lib: sites
                .library(stacks.of(s).first().copied().flatten())
                .as_str(),
            stacks: stacks
                .of(s)
                .iter()
                .map(|st| table.stack(snap, *st) as u32)
                .collect(),
        })
        .collect();
    out.push(PageSite {
        text: "other sites".into(),
        lib: "",
        stacks: Vec::new(),
    });
    out
}

/// The segment map of `device`: each block's offset, size, state, timeline slot, stack.
fn page_segments(
    snap: &Snapshot,
    sites: &Sites,
    table: &mut Table,
    device: i64,
    slot_of: &dyn Fn(u32) -> i64,
) -> Vec<PageSegment> {
    snap.segments
        .iter()
        .filter(|s| s.device == device)
        .map(|seg| PageSegment {
            addr: format!("{:#x}", seg.address),
            size: seg.total_size,
            blocks: seg
                .blocks
                .iter()
                .map(|b| {
                    let state = match b.state {
                        BlockState::ActiveAllocated => 0,
                        BlockState::ActivePendingFree => 1,
                        BlockState::Inactive => 2,
                    };
                    let (site, stack) = if b.state.is_active() {
                        (slot_of(sites.site(b.stack)), table.stack(snap, b.stack))
                    } else {
                        (-1, -1)
                    };
                    [
                        b.address.wrapping_sub(seg.address),
                        b.size,
                        state,
                        site,
                        stack,
                    ]
                })
                .collect(),
        })
        .collect()
}

/// The page data of one device.
fn device_page(
    snap: &Snapshot,
    sites: &Sites,
    table: &mut Table,
    device: i64,
    top: usize,
    want: At,
) -> PageDevice {
    let trace: &[_] = snap
        .device_traces
        .get(device as usize)
        .filter(|_| device >= 0)
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    let mut stacks = StacksOfSite::default();
    let ev = attribute_events(trace, sites, &mut stacks);
    let end = end_live_by_site(snap, sites, device, &mut stacks);
    let start = start_live_by_site(&end, &ev);
    let ranked = rank_by_peak(sites, &start, &ev, top);
    let slot: FxHashMap<u32, usize> = ranked.iter().enumerate().map(|(i, &s)| (s, i)).collect();
    let other = ranked.len();
    let slot_of = |s: u32| slot.get(&s).copied().unwrap_or(other) as i64;
    let mut init = vec![0i64; other + 1];
    for (&s, &bytes) in &start {
        init[slot_of(s) as usize] += bytes;
    }
    let ooms: Vec<&TraceEntry> = trace.iter().filter(|e| e.action == Action::Oom).collect();
    PageDevice {
        device,
        sites: page_sites(snap, sites, table, &ranked, &stacks),
        init,
        ev_site: ev
            .iter()
            .map(|&(s, _)| if s == NO_SITE { -1 } else { slot_of(s) as i32 })
            .collect(),
        ev_delta: ev.iter().map(|&(_, d)| d).collect(),
        ooms: trace
            .iter()
            .enumerate()
            .filter(|(_, e)| e.action == Action::Oom)
            .map(|(i, _)| i)
            .collect(),
        oom_requested: ooms.iter().map(|e| e.size).collect(),
        segments: page_segments(snap, sites, table, device, &slot_of),
        at: page_at(snap, device, trace, want),
        capped: device::capped_label(trace.len(), device::history_dropped(snap, device)),
    }
}

/// Where the page opens: the event after which the moment stands.
fn page_at(snap: &Snapshot, device: i64, trace: &[TraceEntry], want: At) -> PageAt {
    let hist = History::of(trace, want);
    let end = device::end_blocks(snap, device);
    let state = hist.at_with_end(&end, device::end_reserved(snap, device));
    let m = state.moment;
    let event = match m.pos {
        Pos::BeforeFirst => -1,
        Pos::After(i) => i as i64,
        Pos::End => trace.len() as i64 - 1,
    };
    let mut label = m.describe();
    if let Some(why) = &m.unreached {
        label = format!("{label} ({why})");
    }
    let live: i64 = state.holders.values().map(|t| t.bytes).sum();
    PageAt {
        event,
        label: format!("{label}: {} requested", fmt_bytes(live)),
        short: m.column().trim_start_matches("at ").to_string(),
    }
}

/// About how many bytes of JSON the page of `snap` holds: a site and a delta per event,
/// five numbers per block of the segment map (what pages of real and generated files
/// show). Known before the page is built, so that `view` can refuse a file whose page
/// would be many times its size (a history or a block list shared through the memo).
pub fn page_bytes_estimate(snap: &Snapshot) -> u64 {
    const PER_EVENT: u64 = 12;
    const PER_BLOCK: u64 = 24;
    let events: u64 = snap.device_traces.iter().map(|t| t.len() as u64).sum();
    let blocks: u64 = snap.segments.iter().map(|s| s.blocks.len() as u64).sum();
    events * PER_EVENT + blocks * PER_BLOCK
}

/// Why `at` is in no device's history of `snap` (as [`device::unreached`] says): `view`
/// refuses such a moment, as the other commands do, rather than open the page at the end.
pub fn unreached(snap: &Snapshot, at: At) -> Option<String> {
    let histories: Vec<History> = snap
        .device_traces
        .iter()
        .map(|t| History::of(t, at))
        .collect();
    let moments = device::moments(snap, &histories);
    device::unreached(moments.iter().map(|m| &m.moment))
}

/// The page data of a snapshot read whole; `title` heads the page, `top` sites are drawn
/// separately, `at` is the moment it opens at.
pub fn page(snap: &Snapshot, title: &str, top: usize, at: At, attr: &Attribution) -> Page {
    let sites = Sites::new(snap, attr, &StackBytes::of_whole(snap));
    let mut table = Table::default();
    let devices = device::devices(snap)
        .into_iter()
        .map(|d| device_page(snap, &sites, &mut table, d, top, at))
        .collect();
    Page {
        title: title.to_string(),
        devices,
        stacks: table.stacks,
        frames: table.frames,
    }
}

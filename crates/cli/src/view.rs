//! `memsnap view SNAP -o page.html`: one self-contained HTML page (no network: inline
//! JS/CSS, data as an inline JSON island) with a live-memory timeline stacked by allocation
//! site, a segment map, the stack under the pointer, search by frame text, and zoom.
//!
//! The page gets per-event (site, delta) arrays and builds a max-envelope pyramid of
//! 256-event buckets on load; views finer than a bucket per pixel replay from checkpoints.
//! That keeps drawing proportional to the canvas width, not to the number of events.
//!
//! The page opens at a moment (`--at`; default the first OOM, else the peak): a marker on
//! the timeline and the live set by site then in the side panel.

use crate::analysis::{
    self, Attribution, Sites, fmt_bytes, is_hidden, is_python_frame, native_text, short_path,
};
use crate::at::{self, At, Pos};
use crate::history::History;
use anyhow::{Context, Result};
use memsnap_format::model::{Action, BlockState, Snapshot, StackId};
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;

const TEMPLATE: &str = include_str!("view.html");
/// Frames kept per stack in the page.
const MAX_FRAMES: usize = 48;
/// Stacks kept per site for search.
const STACKS_PER_SITE: usize = 6;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Snapshot file.
    pub snap: PathBuf,
    /// Output HTML file.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Sites drawn separately in the timeline (the rest are "other").
    #[arg(long, default_value_t = 12)]
    pub top: usize,
    /// The moment the page opens at (a marker, and the live set then in the side panel):
    /// peak, oom, end, an event number or a time since the first recorded event (12.5s).
    /// Default: the first OOM when the device has one, else the peak.
    #[arg(long, value_name = "MOMENT", value_parser = at::parse)]
    pub at: Option<At>,
    #[command(flatten)]
    pub attr: Attribution,
}

#[derive(Serialize)]
struct PageSite {
    text: String,
    lib: &'static str,
    /// Stack indices (first = representative) for hover and search.
    stacks: Vec<u32>,
}

#[derive(Serialize)]
struct PageSegment {
    /// Hex: addresses can exceed 2^53.
    addr: String,
    size: i64,
    /// [offset in segment, size, state (0 allocated, 1 pending free, 2 inactive),
    ///  timeline site (-1 none), stack (-1 none)]
    blocks: Vec<[i64; 5]>,
}

#[derive(Serialize)]
struct PageDevice {
    device: i64,
    sites: Vec<PageSite>,
    init: Vec<i64>,
    ev_site: Vec<i32>,
    ev_delta: Vec<i64>,
    /// Event indices of OOMs (drawn as red marks), and the bytes each asked for.
    ooms: Vec<usize>,
    oom_requested: Vec<i64>,
    segments: Vec<PageSegment>,
    /// The moment the page opens at.
    at: PageAt,
    /// `history capped: kept N of M events`, when the cap dropped events.
    capped: Option<String>,
}

#[derive(Serialize)]
struct PageAt {
    /// The state after this event is shown (-1: before the first event).
    event: i64,
    /// `the peak (after event 8, +1.234 s)`.
    label: String,
    /// Short: `peak`, `OOM`, `event 12`, `end`.
    short: String,
}

#[derive(Serialize)]
struct Page {
    title: String,
    devices: Vec<PageDevice>,
    stacks: Vec<Vec<u32>>,
    frames: Vec<String>,
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
                self.frames.push(if is_python_frame(fr) {
                    format!("{} ({}:{})", fr.name, short_path(&fr.filename), fr.line)
                } else {
                    native_text(fr)
                });
            }
            out.push(id);
        }
        let i = self.stacks.len() as u32;
        self.stacks.push(out);
        self.stack_of.insert(s, i);
        i as i64
    }
}

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
    // Attribute every live change to a site; frees go to the site of their alloc.
    let mut last_alloc: FxHashMap<i64, u32> = FxHashMap::default();
    let mut ev: Vec<(u32, i64)> = Vec::with_capacity(trace.len());
    let mut stacks_of_site: FxHashMap<u32, Vec<Option<StackId>>> = FxHashMap::default();
    let note = |site: u32, st: Option<StackId>, m: &mut FxHashMap<u32, Vec<Option<StackId>>>| {
        let v = m.entry(site).or_default();
        if v.len() < STACKS_PER_SITE && st.is_some() && !v.contains(&st) {
            v.push(st);
        }
    };
    for e in trace {
        match e.action {
            Action::Alloc => {
                let s = sites.site(e.stack);
                last_alloc.insert(e.addr, s);
                note(s, e.stack, &mut stacks_of_site);
                ev.push((s, e.size));
            }
            Action::FreeCompleted | Action::Free => {
                let s = last_alloc
                    .remove(&e.addr)
                    .unwrap_or_else(|| sites.site(e.stack));
                ev.push((s, -e.size));
            }
            _ => ev.push((u32::MAX, 0)),
        }
    }
    let mut final_live: FxHashMap<u32, i64> = FxHashMap::default();
    for seg in snap.segments.iter().filter(|s| s.device == device) {
        for b in seg.blocks.iter().filter(|b| b.state.is_active()) {
            let s = sites.site(b.stack);
            *final_live.entry(s).or_default() += b.requested_size;
            note(s, b.stack, &mut stacks_of_site);
        }
    }
    let mut net: FxHashMap<u32, i64> = FxHashMap::default();
    for &(s, d) in &ev {
        if s != u32::MAX {
            *net.entry(s).or_default() += d;
        }
    }
    let mut all: Vec<u32> = final_live.keys().chain(net.keys()).copied().collect();
    all.sort_unstable();
    all.dedup();
    let init_of =
        |s: u32| final_live.get(&s).copied().unwrap_or(0) - net.get(&s).copied().unwrap_or(0);
    // Rank sites by their own peak over the history.
    let mut cur: FxHashMap<u32, i64> = all.iter().map(|&s| (s, init_of(s))).collect();
    let mut peak: FxHashMap<u32, i64> = cur.clone();
    for &(s, d) in &ev {
        if s != u32::MAX {
            let c = cur.entry(s).or_default();
            *c += d;
            let p = peak.entry(s).or_default();
            *p = (*p).max(*c);
        }
    }
    let mut ranked: Vec<u32> = all.clone();
    ranked.sort_by(|a, b| {
        peak[b]
            .cmp(&peak[a])
            .then(sites.text(*a).cmp(sites.text(*b)))
    });
    ranked.truncate(top);
    let slot: FxHashMap<u32, usize> = ranked.iter().enumerate().map(|(i, &s)| (s, i)).collect();
    let other = ranked.len();
    let mut page_sites: Vec<PageSite> = ranked
        .iter()
        .map(|&s| PageSite {
            text: sites.text(s).to_string(),
            lib: sites
                .library(
                    stacks_of_site
                        .get(&s)
                        .and_then(|v| v.first().copied())
                        .flatten(),
                )
                .as_str(),
            stacks: stacks_of_site
                .get(&s)
                .map(|v| v.iter().map(|st| table.stack(snap, *st) as u32).collect())
                .unwrap_or_default(),
        })
        .collect();
    page_sites.push(PageSite {
        text: "other sites".into(),
        lib: "",
        stacks: Vec::new(),
    });
    let mut init = vec![0i64; other + 1];
    for &s in &all {
        init[slot.get(&s).copied().unwrap_or(other)] += init_of(s);
    }
    let site_slot = |s: u32| slot.get(&s).copied().unwrap_or(other) as i64;
    let segments = snap
        .segments
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
                        (site_slot(sites.site(b.stack)), table.stack(snap, b.stack))
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
        .collect();
    PageDevice {
        device,
        sites: page_sites,
        init,
        ev_site: ev
            .iter()
            .map(|&(s, _)| {
                if s == u32::MAX {
                    -1
                } else {
                    site_slot(s) as i32
                }
            })
            .collect(),
        ev_delta: ev.iter().map(|&(_, d)| d).collect(),
        ooms: trace
            .iter()
            .enumerate()
            .filter(|(_, e)| e.action == Action::Oom)
            .map(|(i, _)| i)
            .collect(),
        oom_requested: trace
            .iter()
            .filter(|e| e.action == Action::Oom)
            .map(|e| e.size)
            .collect(),
        segments,
        at: page_at(snap, device, trace, want),
        capped: analysis::capped_label(trace.len(), analysis::history_dropped(snap, device)),
    }
}

/// Where the page opens: the event after which the moment stands.
fn page_at(
    snap: &Snapshot,
    device: i64,
    trace: &[memsnap_format::model::TraceEntry],
    want: At,
) -> PageAt {
    let hist = History::of(trace, want);
    let end = analysis::end_blocks(snap, device);
    let state = hist.at_with_end(&end, analysis::end_reserved(snap, device));
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

/// The whole page as a string.
pub fn render(
    snap: &Snapshot,
    title: &str,
    top: usize,
    at: At,
    attr: &Attribution,
) -> Result<String> {
    let sites = Sites::new(snap, attr);
    let mut table = Table::default();
    let devices = analysis::devices(snap, snap.device_traces.iter().map(Vec::len))
        .into_iter()
        .map(|d| device_page(snap, &sites, &mut table, d, top, at))
        .collect();
    let page = Page {
        title: title.to_string(),
        devices,
        stacks: table.stacks,
        frames: table.frames,
    };
    // `<` only occurs inside JSON strings, where \u003c is the same character: this keeps
    // `</script>` and `<!--` in frame names from ending the island.
    let json = serde_json::to_string(&page)?.replace('<', "\\u003c");
    let title_html = title
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;");
    // Split first, so neither value can be mistaken for the other placeholder.
    let (head, tail) = TEMPLATE
        .split_once("@@VIEW_DATA@@")
        .context("view template lost its data placeholder")?;
    Ok(format!(
        "{}{json}{}",
        head.replace("@@VIEW_TITLE@@", &title_html),
        tail.replace("@@VIEW_TITLE@@", &title_html)
    ))
}

pub fn run(a: &Args, out: &mut dyn Write) -> Result<i32> {
    let snap = crate::input::load(&a.snap)?;
    let html = render(
        &snap,
        &crate::input::display_name(&a.snap),
        a.top,
        a.at.unwrap_or(At::Auto),
        &a.attr,
    )?;
    std::fs::write(&a.output, &html)
        .with_context(|| format!("cannot write {}", a.output.display()))?;
    writeln!(
        out,
        "wrote {} ({}, one self-contained page, no network needed)",
        a.output.display(),
        fmt_bytes(html.len() as i64)
    )?;
    writeln!(
        out,
        "open it in a web browser: {}",
        crate::flamegraph::file_url(&a.output)
    )?;
    Ok(0)
}

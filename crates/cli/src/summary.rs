//! `memsnap summary SNAP`: what held the memory at the moment that matters (the first OOM,
//! else the peak, or the moment `--at` names), beside the end, per device; and each OOM.

use crate::analysis::{
    self, AtInfo, Attribution, DeviceStats, Library, SiteKind, Sites, fmt_bytes,
};
use crate::at::{self, At, AtJson, Kind, Resolved};
use crate::history;
use crate::tally::{Tally, sorted};
use anyhow::Result;
use memsnap_format::model::{Meta, Snapshot};
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;

/// The `--json` shape (stable: fields are only ever added).
pub const JSON_SHAPE: &str = "\
JSON (--json):
  { file, producer: \"memsnap\"|\"pytorch\", dropped_events: int|null,
    events_without_stack: int|null, metadata: {memsnap's metadata},
    api_calls: [ {api, calls} ] (memsnap's files: calls per CUDA entry point, whole process),
    devices: [ { device, live_bytes, live_blocks, live_requested_bytes, pending_free_bytes,
                 reserved_bytes, segments,
                 history: { events, start_live_requested_bytes, peak_live_requested_bytes,
                            peak_after_event: int|null, start_reserved_bytes, peak_reserved_bytes,
                            dropped_by_cap: int|null, capped: str|null },
                 events_by_api: [ {api, events} ],
                 top_sites: [ {site, kind: \"python\"|\"native\"|\"none\", bytes, count} ],
                 libraries: [ {library, bytes, count} ],
                 at: { moment: \"peak\"|\"oom\"|\"event\"|\"time\"|\"end\", after_event: int|null,
                       before_first_event, time_us: int|null, since_first_event_us: int|null,
                       unreached: str|null, live_requested_bytes, live_allocations, reserved_bytes,
                       sites: [ {site, kind, bytes, count, end_bytes, end_count} ],
                       libraries: [ {library, bytes, count, end_bytes, end_count} ] },
                 ooms: [ { event, requested_bytes, device_free_bytes, time_us, site, library,
                           live_requested_bytes, live_allocations, reserved_bytes, top_sites } ] } ] }
Live = active_allocated blocks (block bytes); top_sites and libraries are the end's, in block
bytes. Peak = the most live bytes after any recorded event, each state derived from the final
one, in requested bytes (what `alloc` events carry); a capped history starts from the live
state it implies. `at` = the live set at the moment --at names (default: the first OOM, else
the peak), in requested bytes, with the end's figures in the same units (end_bytes).
Site = innermost user Python file:line, else the first native frame outside the CUDA
runtime, the allocator and PyTorch's filtered frames; --ignore and --callers change it.
events_by_api counts trace events (a cudaMalloc is 2, a cudaFree 3); api_calls counts calls.";

#[derive(clap::Args, Debug)]
#[command(after_long_help = JSON_SHAPE)]
pub struct Args {
    /// Snapshot file (memsnap's or PyTorch's `_dump_snapshot` pickle).
    pub snap: PathBuf,
    /// The moment to show what was live at: peak, oom, end, an event number (1234) or a
    /// time since the first recorded event (250ms, 12.5s, 3m). Default: the first OOM when
    /// the device has one, else the peak; the end is shown beside it.
    #[arg(long, value_name = "MOMENT", value_parser = at::parse)]
    pub at: Option<At>,
    /// How many allocation sites to list.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    #[command(flatten)]
    pub attr: Attribution,
    /// Print JSON instead of text (shape: see --help).
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
pub struct SiteRow {
    pub site: String,
    pub kind: SiteKind,
    pub bytes: i64,
    pub count: i64,
}

#[derive(Serialize)]
pub struct ApiRow {
    pub api: String,
    pub events: usize,
}

#[derive(Serialize)]
pub struct CallRow {
    pub api: String,
    pub calls: i64,
}

#[derive(Serialize)]
pub struct LibRow {
    pub library: Library,
    pub bytes: i64,
    pub count: i64,
}

#[derive(Serialize)]
pub struct History {
    pub events: usize,
    pub start_live_requested_bytes: i64,
    pub peak_live_requested_bytes: i64,
    pub peak_after_event: Option<usize>,
    pub start_reserved_bytes: i64,
    pub peak_reserved_bytes: i64,
    /// Events the file's history cap dropped (memsnap's files), and the label saying so.
    pub dropped_by_cap: Option<i64>,
    pub capped: Option<String>,
}

/// Requested bytes and allocations of one group at the moment and at the end.
#[derive(Serialize, Clone, Copy)]
pub struct AtFigures {
    pub bytes: i64,
    pub count: i64,
    pub end_bytes: i64,
    pub end_count: i64,
}

impl AtFigures {
    fn new(at: Tally, end: Option<&Tally>) -> Self {
        let end = end.copied().unwrap_or_default();
        AtFigures {
            bytes: at.bytes,
            count: at.count,
            end_bytes: end.bytes,
            end_count: end.count,
        }
    }
}

#[derive(Serialize)]
pub struct AtSiteRow {
    pub site: String,
    pub kind: SiteKind,
    #[serde(flatten)]
    pub figures: AtFigures,
}

#[derive(Serialize)]
pub struct AtLibRow {
    pub library: Library,
    #[serde(flatten)]
    pub figures: AtFigures,
}

#[derive(Serialize)]
pub struct AtDevice {
    #[serde(flatten)]
    pub moment: AtJson,
    pub live_requested_bytes: i64,
    pub live_allocations: i64,
    pub reserved_bytes: i64,
    pub sites: Vec<AtSiteRow>,
    pub libraries: Vec<AtLibRow>,
    #[serde(skip)]
    pub resolved: Resolved,
}

#[derive(Serialize)]
pub struct Oom {
    pub event: usize,
    pub requested_bytes: i64,
    pub device_free_bytes: Option<i64>,
    pub time_us: i64,
    pub site: String,
    pub library: Library,
    pub live_requested_bytes: i64,
    pub live_allocations: i64,
    pub reserved_bytes: i64,
    pub top_sites: Vec<SiteRow>,
}

#[derive(Serialize)]
pub struct Device {
    pub device: i64,
    pub live_bytes: i64,
    pub live_blocks: i64,
    pub live_requested_bytes: i64,
    pub pending_free_bytes: i64,
    pub reserved_bytes: i64,
    pub segments: i64,
    pub history: History,
    /// Events per `user_metadata` (memsnap writes the CUDA API there), most first.
    pub events_by_api: Vec<ApiRow>,
    pub top_sites: Vec<SiteRow>,
    pub libraries: Vec<LibRow>,
    pub at: AtDevice,
    pub ooms: Vec<Oom>,
}

#[derive(Serialize)]
pub struct Summary {
    pub file: String,
    /// "memsnap" (has memsnap's metadata) or "pytorch".
    pub producer: &'static str,
    pub dropped_events: Option<i64>,
    /// Events recorded without their stack (memsnap's counter).
    pub events_without_stack: Option<i64>,
    pub metadata: serde_json::Value,
    /// Calls per CUDA entry point (memsnap's `api_calls`), most first.
    pub api_calls: Vec<CallRow>,
    pub devices: Vec<Device>,
}

pub fn meta_json(m: &Meta) -> serde_json::Value {
    use serde_json::Value as J;
    match m {
        Meta::Bool(b) => J::Bool(*b),
        Meta::Int(i) => J::from(*i),
        Meta::Float(f) => serde_json::Number::from_f64(*f)
            .map(J::Number)
            .unwrap_or(J::Null),
        Meta::Str(s) => J::String(s.clone()),
        Meta::List(l) => J::Array(l.iter().map(meta_json).collect()),
        Meta::Dict(d) => J::Object(d.iter().map(|(k, v)| (k.clone(), meta_json(v))).collect()),
    }
}

pub fn meta_int(snap: &Snapshot, key: &str) -> Option<i64> {
    match snap.meta(key)? {
        Meta::Int(i) => Some(*i),
        _ => None,
    }
}

fn site_rows(sites: &Sites, v: &[(u32, Tally)], top: usize) -> Vec<SiteRow> {
    v.iter()
        .take(top)
        .map(|(s, t)| SiteRow {
            site: sites.text(*s).to_string(),
            kind: sites.sites[*s as usize].kind,
            bytes: t.bytes,
            count: t.count,
        })
        .collect()
}

/// memsnap's `api_calls` metadata, most calls first (ties by name).
fn api_calls(snap: &Snapshot) -> Vec<CallRow> {
    let Some(Meta::Dict(calls)) = snap.meta("api_calls") else {
        return Vec::new();
    };
    let mut rows: Vec<CallRow> = calls
        .iter()
        .filter_map(|(api, n)| match n {
            Meta::Int(n) => Some(CallRow {
                api: api.clone(),
                calls: *n,
            }),
            _ => None,
        })
        .collect();
    rows.sort_by(|a, b| b.calls.cmp(&a.calls).then(a.api.cmp(&b.api)));
    rows
}

pub fn build(
    snap: &Snapshot,
    histories: &[history::History],
    file: String,
    top: usize,
    attr: &Attribution,
) -> Summary {
    let sites = Sites::new(snap, attr);
    let devices = analysis::devices(snap, histories.iter().map(|h| h.events))
        .into_iter()
        .map(|d| {
            let hist = analysis::history_of(histories, d);
            let st = analysis::device_stats(snap, &sites, d, &hist);
            device(snap, &sites, st, &hist, top)
        })
        .collect();
    Summary {
        file,
        producer: if snap.memsnap.is_empty() {
            "pytorch"
        } else {
            "memsnap"
        },
        dropped_events: meta_int(snap, "dropped_events"),
        events_without_stack: meta_int(snap, "events_without_stack"),
        metadata: meta_json(&Meta::Dict(snap.memsnap.clone())),
        api_calls: api_calls(snap),
        devices,
    }
}

fn at_device(sites: &Sites, at: &AtInfo, top: usize) -> AtDevice {
    let site_rows: Vec<AtSiteRow> = sorted(&at.by_site)
        .into_iter()
        .filter(|(_, t)| t.count > 0)
        .take(top)
        .map(|(s, t)| AtSiteRow {
            site: sites.text(s).to_string(),
            kind: sites.sites[s as usize].kind,
            figures: AtFigures::new(t, at.end_by_site.get(&s)),
        })
        .collect();
    AtDevice {
        moment: AtJson::from(&at.moment),
        live_requested_bytes: at.live.bytes,
        live_allocations: at.live.count,
        reserved_bytes: at.reserved,
        sites: site_rows,
        libraries: sorted(&at.by_library)
            .into_iter()
            .map(|(l, t)| AtLibRow {
                library: l,
                figures: AtFigures::new(t, at.end_by_library.get(&l)),
            })
            .collect(),
        resolved: at.moment.clone(),
    }
}

fn device(
    snap: &Snapshot,
    sites: &Sites,
    st: DeviceStats,
    hist: &history::History,
    top: usize,
) -> Device {
    let events_by_api = hist
        .apis()
        .into_iter()
        .map(|(a, n)| ApiRow {
            api: a.to_string(),
            events: n,
        })
        .collect();
    let dropped_by_cap = analysis::history_dropped(snap, st.device);
    Device {
        events_by_api,
        device: st.device,
        live_bytes: st.live.bytes,
        live_blocks: st.live.count,
        live_requested_bytes: st.live_requested,
        pending_free_bytes: st.pending_free.bytes,
        reserved_bytes: st.reserved.bytes,
        segments: st.reserved.count,
        history: History {
            events: st.events,
            start_live_requested_bytes: st.start_live_requested,
            peak_live_requested_bytes: st.peak_live_requested,
            peak_after_event: st.peak_after_event,
            start_reserved_bytes: st.start_reserved,
            peak_reserved_bytes: st.peak_reserved,
            dropped_by_cap,
            capped: analysis::capped_label(st.events, dropped_by_cap),
        },
        top_sites: site_rows(sites, &sorted(&st.by_site), top),
        libraries: sorted(&st.by_library)
            .into_iter()
            .map(|(l, t)| LibRow {
                library: l,
                bytes: t.bytes,
                count: t.count,
            })
            .collect(),
        at: at_device(sites, &st.at, top),
        ooms: st
            .ooms
            .iter()
            .map(|o| Oom {
                event: o.event,
                requested_bytes: o.requested,
                device_free_bytes: o.device_free,
                time_us: o.time_us,
                site: sites.text(o.site).to_string(),
                library: o.library,
                live_requested_bytes: o.live.bytes,
                live_allocations: o.live.count,
                reserved_bytes: o.reserved,
                top_sites: site_rows(sites, &o.holders, top),
            })
            .collect(),
    }
}

pub fn run(a: &Args, out: &mut dyn Write) -> Result<i32> {
    let at = a.at.unwrap_or(At::Auto);
    let loaded = crate::input::load_summarized(&a.snap, at)?;
    let s = build(
        &loaded.snap,
        &loaded.histories,
        a.snap.display().to_string(),
        a.top,
        &a.attr,
    );
    // A moment asked for by name that no device reached is an error, not an answer.
    if a.at.is_some_and(|at| at != At::End)
        && !s.devices.is_empty()
        && s.devices.iter().all(|d| d.at.resolved.unreached.is_some())
    {
        let why = s.devices[0]
            .at
            .resolved
            .unreached
            .clone()
            .unwrap_or_default();
        anyhow::bail!("{}: --at: {why}", a.snap.display());
    }
    if a.json {
        serde_json::to_writer_pretty(&mut *out, &s)?;
        writeln!(out)?;
    } else {
        write_text(&s, &crate::input::display_name(&a.snap), out)?;
    }
    Ok(0)
}

fn plural(n: impl Into<i64>, one: &str, many: &str) -> String {
    let n = n.into();
    format!("{n} {}", if n == 1 { one } else { many })
}

fn write_sites(out: &mut dyn Write, rows: &[SiteRow], indent: &str) -> std::io::Result<()> {
    for r in rows {
        writeln!(
            out,
            "{indent}{:>10}  {:>6}  {}",
            fmt_bytes(r.bytes),
            r.count,
            r.site
        )?;
    }
    Ok(())
}

pub fn write_text(s: &Summary, name: &str, out: &mut dyn Write) -> std::io::Result<()> {
    let events: usize = s.devices.iter().map(|d| d.history.events).sum();
    writeln!(
        out,
        "{name}: {} snapshot, {}, {}",
        if s.producer == "memsnap" {
            "memsnap"
        } else {
            "PyTorch"
        },
        plural(s.devices.len() as i64, "device", "devices"),
        plural(events as i64, "event", "events"),
    )?;
    // What the record misses comes first: everything below is short by it.
    if let Some(n) = s.dropped_events.filter(|&n| n > 0) {
        writeln!(
            out,
            "INCOMPLETE: {} not recorded (memsnap's writer stopped early); live memory \
             below may be off by what they did",
            plural(n, "event", "events")
        )?;
    }
    if let Some(n) = s.events_without_stack.filter(|&n| n > 0) {
        writeln!(
            out,
            "INCOMPLETE: {} recorded without a stack",
            plural(n, "event", "events")
        )?;
    }
    if !s.api_calls.is_empty() {
        let list: Vec<String> = s
            .api_calls
            .iter()
            .map(|c| format!("{} {}", c.api, c.calls))
            .collect();
        writeln!(out, "API calls: {}", list.join(", "))?;
    }
    if s.devices.is_empty() {
        writeln!(out, "no segments and no events: nothing was recorded")?;
    }
    for d in &s.devices {
        writeln!(out)?;
        writeln!(out, "device {}", d.device)?;
        writeln!(
            out,
            "  live      {} in {} (requested {}) at the end",
            fmt_bytes(d.live_bytes),
            plural(d.live_blocks, "block", "blocks"),
            fmt_bytes(d.live_requested_bytes)
        )?;
        if d.pending_free_bytes > 0 {
            writeln!(
                out,
                "  pending   {} freed, waiting on streams",
                fmt_bytes(d.pending_free_bytes)
            )?;
        }
        writeln!(
            out,
            "  reserved  {} in {}",
            fmt_bytes(d.reserved_bytes),
            plural(d.segments, "segment", "segments")
        )?;
        let h = &d.history;
        if h.events == 0 {
            writeln!(out, "  history   no events recorded")?;
        } else {
            let at = match h.peak_after_event {
                Some(i) => format!("after event {i}"),
                None => "before the first event".into(),
            };
            writeln!(
                out,
                "  peak      {} requested {at}, reserved peak {} (within the {} recorded)",
                fmt_bytes(h.peak_live_requested_bytes),
                fmt_bytes(h.peak_reserved_bytes),
                plural(h.events as i64, "event", "events"),
            )?;
            writeln!(
                out,
                "  history   starts with {} live, {} reserved (implied by the final state minus the events)",
                fmt_bytes(h.start_live_requested_bytes),
                fmt_bytes(h.start_reserved_bytes)
            )?;
        }
        if let Some(capped) = &h.capped {
            writeln!(
                out,
                "  {capped}: the oldest were dropped (MEMSNAP_MAX_ENTRIES), so the peak and the moments below are within the kept events"
            )?;
        }
        if !d.events_by_api.is_empty() {
            let list: Vec<String> = d
                .events_by_api
                .iter()
                .map(|a| format!("{} {}", a.api, a.events))
                .collect();
            writeln!(
                out,
                "  events by API (trace events; a call makes 2 or 3): {}",
                list.join(", ")
            )?;
        }
        write_at(out, &d.at)?;
        for o in &d.ooms {
            writeln!(
                out,
                "  OOM at event {}: asked for {}, device free {}",
                o.event,
                fmt_bytes(o.requested_bytes),
                o.device_free_bytes
                    .map(fmt_bytes)
                    .unwrap_or_else(|| "unknown".into())
            )?;
            writeln!(out, "    asked by  {} [{}]", o.site, o.library.as_str())?;
            writeln!(
                out,
                "    live then {} requested in {}, reserved {}",
                fmt_bytes(o.live_requested_bytes),
                plural(o.live_allocations, "allocation", "allocations"),
                fmt_bytes(o.reserved_bytes)
            )?;
            let shown_above = d.at.resolved.kind == Kind::Oom
                && d.at.resolved.pos == crate::at::Pos::After(o.event);
            if shown_above {
                writeln!(out, "    held by:  the sites listed above (at OOM)")?;
            } else if !o.top_sites.is_empty() {
                writeln!(out, "    held by:")?;
                write_sites(out, &o.top_sites, "    ")?;
            }
        }
    }
    Ok(())
}

/// The live set at the chosen moment, by site and library, with the end beside it.
fn write_at(out: &mut dyn Write, at: &AtDevice) -> std::io::Result<()> {
    let r = &at.resolved;
    if let Some(why) = &r.unreached {
        writeln!(out, "  --at: {why}; showing the end")?;
    }
    let at_end = r.kind == Kind::End;
    writeln!(
        out,
        "  at        {}: {} requested in {}, reserved {}",
        r.describe(),
        fmt_bytes(at.live_requested_bytes),
        plural(at.live_allocations, "allocation", "allocations"),
        fmt_bytes(at.reserved_bytes)
    )?;
    if at.sites.is_empty() {
        return Ok(());
    }
    let col = r.column();
    let heading = |out: &mut dyn Write, what: &str| {
        if at_end {
            writeln!(out, "  live by {what} at the end (requested bytes):")?;
            writeln!(out, "    {:>10}  {:>6}  {what}", "bytes", "allocs")
        } else {
            writeln!(out, "  live by {what} (requested bytes), {col} and at end:")?;
            writeln!(
                out,
                "    {col:>10}  {:>6}  {:>10}  {:>6}  {what}",
                "allocs", "at end", "allocs"
            )
        }
    };
    let sites: Vec<(&str, AtFigures)> = at
        .sites
        .iter()
        .map(|r| (r.site.as_str(), r.figures))
        .collect();
    let libraries: Vec<(&str, AtFigures)> = at
        .libraries
        .iter()
        .map(|l| (l.library.as_str(), l.figures))
        .collect();
    for (what, rows) in [("allocation site", sites), ("library", libraries)] {
        heading(out, what)?;
        for (name, f) in rows {
            if at_end {
                writeln!(
                    out,
                    "    {:>10}  {:>6}  {name}",
                    fmt_bytes(f.bytes),
                    f.count
                )?;
            } else {
                writeln!(
                    out,
                    "    {:>10}  {:>6}  {:>10}  {:>6}  {name}",
                    fmt_bytes(f.bytes),
                    f.count,
                    fmt_bytes(f.end_bytes),
                    f.end_count
                )?;
            }
        }
    }
    Ok(())
}

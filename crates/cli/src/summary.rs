//! `memsnap summary SNAP`: what holds the memory, per device, and what happened at an OOM.

use crate::analysis::{self, DeviceStats, Library, SiteKind, Sites, fmt_bytes};
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
  { file, producer: \"memsnap\"|\"pytorch\", dropped_events: int|null, metadata: {memsnap's metadata},
    devices: [ { device, live_bytes, live_blocks, live_requested_bytes, pending_free_bytes,
                 reserved_bytes, segments,
                 history: { events, start_live_requested_bytes, peak_live_requested_bytes,
                            peak_after_event: int|null, start_reserved_bytes, peak_reserved_bytes },
                 events_by_api: [ {api, events} ],
                 top_sites: [ {site, kind: \"python\"|\"native\"|\"none\", bytes, count} ],
                 libraries: [ {library, bytes, count} ],
                 ooms: [ { event, requested_bytes, device_free_bytes, time_us, site, library,
                           live_requested_bytes, live_allocations, reserved_bytes, top_sites } ] } ] }
Live = active_allocated blocks (block bytes). Peak = the most live bytes after any recorded
event, each state derived from the final one, in requested bytes (what `alloc` events carry);
a capped history starts from the live state it implies. Site = innermost user Python file:line, else the first native
frame outside the CUDA runtime, the allocator and PyTorch's filtered frames.";

#[derive(clap::Args, Debug)]
#[command(after_long_help = JSON_SHAPE)]
pub struct Args {
    /// Snapshot file (memsnap's or PyTorch's `_dump_snapshot` pickle).
    pub snap: PathBuf,
    /// How many allocation sites to list.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
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
    pub ooms: Vec<Oom>,
}

#[derive(Serialize)]
pub struct Summary {
    pub file: String,
    /// "memsnap" (has memsnap's metadata) or "pytorch".
    pub producer: &'static str,
    pub dropped_events: Option<i64>,
    pub metadata: serde_json::Value,
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

pub fn build(snap: &Snapshot, histories: &[history::History], file: String, top: usize) -> Summary {
    let sites = Sites::new(snap);
    let devices = analysis::devices(snap, histories.iter().map(|h| h.events))
        .into_iter()
        .map(|d| {
            let hist = analysis::history_of(histories, d);
            let st = analysis::device_stats(snap, &sites, d, &hist);
            device(&sites, st, &hist, top)
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
        metadata: meta_json(&Meta::Dict(snap.memsnap.clone())),
        devices,
    }
}

fn device(sites: &Sites, st: DeviceStats, hist: &history::History, top: usize) -> Device {
    let events_by_api = hist
        .apis()
        .into_iter()
        .map(|(a, n)| ApiRow {
            api: a.to_string(),
            events: n,
        })
        .collect();
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
    let loaded = crate::input::load_summarized(&a.snap)?;
    let s = build(
        &loaded.snap,
        &loaded.histories,
        a.snap.display().to_string(),
        a.top,
    );
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
    match s.dropped_events {
        Some(n) => writeln!(out, "dropped events: {n} (memsnap counter)")?,
        None if s.producer == "pytorch" => writeln!(
            out,
            "dropped events: not recorded (PyTorch keeps the newest max_entries events per device)"
        )?,
        None => writeln!(out, "dropped events: not recorded")?,
    }
    if s.devices.is_empty() {
        writeln!(out, "no segments and no events: nothing was recorded")?;
    }
    for d in &s.devices {
        writeln!(out)?;
        writeln!(out, "device {}", d.device)?;
        writeln!(
            out,
            "  live      {} in {} (requested {})",
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
        if !d.events_by_api.is_empty() {
            let list: Vec<String> = d
                .events_by_api
                .iter()
                .map(|a| format!("{} {}", a.api, a.events))
                .collect();
            writeln!(out, "  APIs      {}", list.join(", "))?;
        }
        if !d.top_sites.is_empty() {
            writeln!(out, "  live by allocation site:")?;
            writeln!(out, "    {:>10}  {:>6}  site", "bytes", "blocks")?;
            write_sites(out, &d.top_sites, "    ")?;
        }
        if !d.libraries.is_empty() {
            writeln!(out, "  live by library:")?;
            for l in &d.libraries {
                writeln!(
                    out,
                    "    {:>10}  {:>6}  {}",
                    fmt_bytes(l.bytes),
                    l.count,
                    l.library_str()
                )?;
            }
        }
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
            if !o.top_sites.is_empty() {
                writeln!(out, "    held by:")?;
                write_sites(out, &o.top_sites, "    ")?;
            }
        }
    }
    Ok(())
}

impl LibRow {
    fn library_str(&self) -> &'static str {
        self.library.as_str()
    }
}

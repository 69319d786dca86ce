//! `memsnap summary SNAP`: the arguments, and the text renderer of the engine's
//! [`Summary`] (JSON is its serde form). What held the memory at the moment that matters
//! (the first OOM, else the peak, or the moment `--at` names), beside the end, per device;
//! and each OOM. Cold code.

use crate::args::Report;
use crate::shown::{shown, write_escaped};
use anyhow::Result;
use memsnap_engine::at::{self, At, Kind};
use memsnap_engine::bytes::fmt_bytes;
use memsnap_engine::summary::{AtDevice, AtFigures, SiteRow, Summary, build};
use std::io::Write;
use std::path::PathBuf;

/// The `--json` shape (stable: fields are only ever added).
pub const JSON_SHAPE: &str = "\
JSON (--json):
  { file, producer: \"memsnap\"|\"pytorch\", dropped_events: int|null,
    events_without_stack: int|null, frames_unresolved: int|null, metadata: {memsnap's metadata},
    api_calls: [ {api, calls} ] (memsnap's files: calls per CUDA entry point, whole process),
    devices: [ { device, live_bytes, live_blocks, live_requested_bytes, pending_free_bytes,
                 cached_free_bytes, largest_free_block_bytes, reserved_bytes, segments,
                 private_pools: [ {pool: [int, int], segments, reserved_bytes, live_bytes} ],
                 history: { events, start_live_requested_bytes, peak_live_requested_bytes,
                            peak_after_event: int|null, start_reserved_bytes, peak_reserved_bytes,
                            dropped_by_cap: int|null, capped: str|null },
                 events_by_api: [ {api, events} ],
                 top_sites: [ {site, kind: \"python\"|\"native\"|\"none\", via: str|null, bytes, count} ],
                 libraries: [ {library, bytes, count} ],
                 at: { moment: \"peak\"|\"oom\"|\"event\"|\"time\"|\"end\", after_event: int|null,
                       before_first_event, time_us: int|null, since_first_event_us: int|null,
                       unreached: str|null, live_requested_bytes, live_allocations, reserved_bytes,
                       sites: [ {site, kind, via, bytes, count, end_bytes, end_count} ],
                       libraries: [ {library, bytes, count, end_bytes, end_count} ] },
                 ooms: [ { event, requested_bytes, device_free_bytes, time_us, site, via, library,
                           live_requested_bytes, live_allocations, reserved_bytes, top_sites } ] } ] }
Live = active_allocated blocks (block bytes); top_sites and libraries are the end's, in block
bytes. Peak = the most live bytes after any recorded event, each state derived from the final
one, in requested bytes (what `alloc` events carry); a capped history starts from the live
state it implies. `at` = the live set at the moment --at names (default: the first OOM, else
the peak), in requested bytes, with the end's figures in the same units (end_bytes).
Site = innermost user Python file:line, else the first native frame outside the CUDA
runtime, the allocator and PyTorch's filtered frames; --ignore and --callers change it. A
helper (a function of the program that allocates for several calling lines) is shown at each
calling line, `caller via helper` (via: the helper, else null); --at-helpers turns it off.
events_by_api counts trace events (a cudaMalloc is 2, a cudaFree 3); api_calls counts calls.
private_pools = segments whose segment_pool_id is not (0, 0): PyTorch's private pools (CUDA
graphs', as torch.compile mode=\"reduce-overhead\" makes, or torch.cuda.MemPool's), part of
reserved_bytes and segments; only the pool's own allocations use them.";

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
    pub report: Report,
}

pub fn run(a: &Args, out: &mut dyn Write) -> Result<i32> {
    let at = a.at.unwrap_or(At::Auto);
    let loaded = crate::input::load_summarized(&a.snap, at)?;
    let s = build(
        &loaded.snap,
        &loaded.histories,
        a.snap.display().to_string(),
        a.top,
        &a.report.attr.rules(),
    );
    // A moment asked for by name that no device reached is an error, not an answer.
    if a.at.is_some_and(|at| at != At::End)
        && let Some(why) = s.unreached()
    {
        anyhow::bail!("{}: --at: {why}", a.snap.display());
    }
    if a.report.json {
        serde_json::to_writer_pretty(&mut *out, &s)?;
        writeln!(out)?;
    } else {
        write_escaped(out, |out| {
            write_text(&s, &crate::input::display_name(&a.snap), out)?;
            // An OOM file ends with explain's verdict.
            if s.devices.iter().any(|d| !d.ooms.is_empty())
                && let Some(line) = memsnap_engine::explain::verdict_line(
                    &loaded,
                    &crate::input::display_name(&a.snap),
                    &a.report.attr.rules(),
                )
            {
                writeln!(out)?;
                writeln!(out, "{line}")?;
            }
            Ok(())
        })?;
    }
    Ok(0)
}

/// The name memsnap records its own markers under (step and crash marks), beside the CUDA
/// entry points in `api_calls` and the events' `user_metadata`.
const OWN_MARKERS: &str = "memsnap";

/// `cudaMalloc 4, cudaFree 2`, with memsnap's own markers apart and named as what they are
/// (no CUDA call): `cudaMalloc 4; memsnap's own markers (not CUDA calls) 5`.
fn api_list<'a>(rows: impl Iterator<Item = (&'a str, i64)>) -> String {
    let (own, calls): (Vec<_>, Vec<_>) = rows.partition(|(api, _)| *api == OWN_MARKERS);
    let mut text: Vec<String> = calls
        .iter()
        .map(|(api, n)| format!("{} {n}", shown(api)))
        .collect();
    if text.is_empty() {
        text.push("none".into());
    }
    let mut text = text.join(", ");
    for (_, n) in own {
        text.push_str(&format!("; memsnap's own markers (not CUDA calls) {n}"));
    }
    text
}

/// What a memsnap file says it misses (its counters of dropped events, events without a
/// stack and frames not resolved), a line each where not 0: `summary` and `check` print
/// these first.
pub fn incomplete(
    dropped_events: Option<i64>,
    events_without_stack: Option<i64>,
    frames_unresolved: Option<i64>,
) -> Vec<String> {
    let mut lines = Vec::new();
    if let Some(n) = dropped_events.filter(|&n| n > 0) {
        lines.push(format!(
            "INCOMPLETE: {} not recorded (memsnap's writer stopped early); live memory \
             below may be off by what they did",
            plural(n, "event", "events")
        ));
    }
    if let Some(n) = events_without_stack.filter(|&n| n > 0) {
        lines.push(format!(
            "INCOMPLETE: {} recorded without a stack",
            plural(n, "event", "events")
        ));
    }
    if let Some(n) = frames_unresolved.filter(|&n| n > 0) {
        lines.push(format!(
            "INCOMPLETE: {} unresolved (code gone before memsnap read it): kept as ?? or \
             with line 0",
            plural(n, "stack frame", "stack frames")
        ));
    }
    lines
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
            shown(&r.site)
        )?;
    }
    Ok(())
}

/// The summary as text (`name`: the file name heading it).
pub fn write_text(s: &Summary, name: &str, out: &mut dyn Write) -> std::io::Result<()> {
    let events: usize = s.devices.iter().map(|d| d.history.events).sum();
    writeln!(
        out,
        "{}: {} snapshot, {}, {}",
        shown(name),
        if s.producer == "memsnap" {
            "memsnap"
        } else {
            "PyTorch"
        },
        plural(s.devices.len() as i64, "device", "devices"),
        plural(events as i64, "event", "events"),
    )?;
    // What the record misses comes first: everything below is short by it.
    for line in incomplete(
        s.dropped_events,
        s.events_without_stack,
        s.frames_unresolved,
    ) {
        writeln!(out, "{line}")?;
    }
    // What memsnap saw of PyTorch's allocator says what the live bytes below are: its
    // blocks (tensors inside the cache), its segments only, or tensors that are CUDA calls.
    if let Some(line) = s
        .metadata
        .get("torch_allocator")
        .and_then(|v| v.as_str())
        .filter(|l| !l.is_empty())
    {
        writeln!(out, "PyTorch's allocator: {}", shown(line))?;
    }
    // Where memsnap's step marks came from: what MEMSNAP_EVERY and the window counted.
    if let Some(source) = s.metadata.get("step_source").and_then(|v| v.as_str()) {
        let text = |key: &str| s.metadata.get(key).and_then(|v| v.as_str()).unwrap_or("");
        let steps = s.metadata.get("step").and_then(|v| v.as_i64()).unwrap_or(0);
        writeln!(
            out,
            "Steps: {steps} (from: {}; optimizer step hook: {})",
            shown(source),
            shown(text("optimizer_step_hook"))
        )?;
    }
    if !s.api_calls.is_empty() {
        let list = api_list(s.api_calls.iter().map(|c| (c.api.as_str(), c.calls)));
        writeln!(out, "API calls: {list}")?;
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
        for pool in &d.private_pools {
            writeln!(
                out,
                "  private   {} (a CUDA graph's or a MemPool's: only its own allocations use it)",
                memsnap_engine::device::describe_private_pool(pool)
            )?;
        }
        if d.cached_free_bytes > 0 {
            writeln!(
                out,
                "  cached    {} free inside the segments (largest free block {}): the allocator's cache",
                fmt_bytes(d.cached_free_bytes),
                fmt_bytes(d.largest_free_block_bytes)
            )?;
        }
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
            let list = api_list(
                d.events_by_api
                    .iter()
                    .map(|a| (a.api.as_str(), a.events as i64)),
            );
            writeln!(
                out,
                "  events by API (trace events; a call makes 2 or 3): {list}"
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
            writeln!(
                out,
                "    asked by  {} [library: {}]",
                shown(&o.site),
                o.library.as_str()
            )?;
            writeln!(
                out,
                "    live then {} requested in {}, reserved {}",
                fmt_bytes(o.live_requested_bytes),
                plural(o.live_allocations, "allocation", "allocations"),
                fmt_bytes(o.reserved_bytes)
            )?;
            let shown_above =
                d.at.resolved.kind == Kind::Oom && d.at.resolved.pos == at::Pos::After(o.event);
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
            let name = shown(name);
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

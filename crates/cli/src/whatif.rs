//! `memsnap whatif PATH`: the arguments, reading the file whole, and the text renderer of
//! the engine's [`Report`] (JSON is its serde form; docs/WHATIF.md has the shape): which
//! scenarios avoid a recorded out-of-memory error first, then how the replay as recorded
//! compares with the recording, then one row per scenario. Cold code.

use crate::args::Attribution;
use crate::shown::write_escaped;
use anyhow::Result;
use memsnap_engine::bytes::{fmt_bytes, parse_bytes};
use memsnap_engine::whatif::{self as engine, AS_RECORDED, Report, Row};
use std::io::Write;
use std::path::PathBuf;

/// The `--json` shape, in short (docs/WHATIF.md has every key).
pub const JSON_SHAPE: &str = "\
JSON (--json); docs/WHATIF.md has every key and its meaning:
  { scenarios: [ {setting, device, peak_reserved_bytes, peak_allocated_bytes,
                  segments_at_peak, reserved_unallocated_bytes_at_peak,
                  largest_free_block_bytes_at_peak, capacity_bytes, fits,
                  oom: null | {request_bytes, site, event, outside}, refused} ],
    release, release_assumed, recorded_settings,
    checks: [ {device, reproduced, divergence, segment_operations, matched,
               recorded_peak_reserved_bytes, model_peak_reserved_bytes, starts_mid_run} ],
    recorded_oom: null | {device, request_bytes, site, event, avoided_by, not_avoided_by},
    notes: [str] }
The first scenario is always \"as recorded\"; a refused one has null figures and its reason.";

#[derive(clap::Args, Debug)]
#[command(after_long_help = JSON_SHAPE)]
pub struct Args {
    /// A snapshot file (memsnap's, or PyTorch's own with its trace), or an s3://, gs://,
    /// az:// object.
    #[arg(value_name = "PATH")]
    pub path: PathBuf,
    /// A scenario: the run as if PYTORCH_CUDA_ALLOC_CONF had been this (repeatable;
    /// `expandable_segments:True,max_split_size_mb:128` is one scenario of two keys, `""`
    /// PyTorch's defaults, `backend:cudaMallocAsync` the other backend). Default, with no
    /// --set and no --scale: expandable_segments:True, max_split_size_mb:128,
    /// backend:cudaMallocAsync.
    #[arg(long = "set", value_name = "KEY:VALUE")]
    pub sets: Vec<String>,
    /// A scenario where the requests of some roles (as `explain` assigns them: parameters,
    /// gradients, optimizer_state, activations, temporaries, communication, other) are
    /// larger: `activations=2,temporaries=2` (repeatable; also tried with each --set).
    #[arg(long = "scale", value_name = "ROLE=FACTOR")]
    pub scales: Vec<String>,
    /// The device's memory in place of the recorded capacity (64GiB, 80GB, bytes).
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    pub device_memory: Option<i64>,
    #[command(flatten)]
    pub attr: Attribution,
    /// Print JSON instead of text (shape: see --help).
    #[arg(long)]
    pub json: bool,
}

pub fn build(a: &Args) -> Result<Report> {
    let snap = crate::input::load(&a.path)?;
    let opts = engine::Options {
        sets: a.sets.clone(),
        scales: a.scales.clone(),
        device_memory: a.device_memory,
        attr: a.attr.rules(),
    };
    engine::whatif(&snap, &opts).map_err(|e| anyhow::anyhow!("{}: {e}", a.path.display()))
}

pub fn run(a: &Args, out: &mut dyn Write) -> Result<i32> {
    let report = build(a)?;
    if a.json {
        serde_json::to_writer_pretty(&mut *out, &report)?;
        writeln!(out)?;
    } else {
        let name = a.path.display().to_string();
        write_escaped(out, |out| write_text(&report, &name, out))?;
    }
    Ok(0)
}

fn opt_bytes(b: Option<i64>) -> String {
    b.map_or_else(|| "-".to_string(), fmt_bytes)
}

/// A scenario's answer to "would it fit".
fn fits(r: &Row) -> String {
    if let Some(why) = &r.refused {
        return format!("refused: {why}");
    }
    match (&r.oom, r.fits) {
        (Some(o), _) => format!(
            "no: runs out at event {}, {} {} at {}",
            o.event,
            fmt_bytes(o.request_bytes),
            if o.outside {
                "for another library"
            } else {
                "asked"
            },
            o.site
        ),
        (None, Some(true)) => format!("yes ({})", opt_bytes(r.capacity_bytes)),
        _ => "capacity not known".into(),
    }
}

pub fn write_text(r: &Report, file: &str, out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(out, "{file}")?;
    if let Some(o) = &r.recorded_oom {
        let none = o.avoided_by.is_empty();
        writeln!(
            out,
            "The recorded out-of-memory error (device {}, event {}: {} at {}) {}{}",
            o.device,
            o.event,
            fmt_bytes(o.request_bytes),
            o.site,
            if none {
                "is avoided by none of the scenarios".to_string()
            } else {
                format!("would have been avoided by: {}", o.avoided_by.join("; "))
            },
            if !none && !o.not_avoided_by.is_empty() {
                format!(" (not by: {})", o.not_avoided_by.join("; "))
            } else {
                String::new()
            }
        )?;
    }
    let settings = if r.recorded_settings.is_empty() {
        "PyTorch's defaults".to_string()
    } else {
        r.recorded_settings.clone()
    };
    writeln!(
        out,
        "PyTorch {}'s caching allocator{}; recorded settings: {settings}",
        r.release,
        if r.release_assumed { " (assumed)" } else { "" }
    )?;
    for c in &r.checks {
        let start = if c.starts_mid_run {
            " (from the state where its history begins)"
        } else {
            ""
        };
        match &c.divergence {
            // No segments: the stream-ordered backend, its tensors' bytes.
            None if c.segment_operations == 0 => writeln!(
                out,
                "As recorded, the model gives back device {}'s peak of {} in tensors, to the \
                 byte{start}",
                c.device,
                fmt_bytes(c.recorded_peak_reserved_bytes)
            )?,
            None => writeln!(
                out,
                "As recorded, the model gives back device {}'s {} segment operations and its \
                 peak of {} reserved, to the byte{start}",
                c.device,
                c.segment_operations,
                fmt_bytes(c.recorded_peak_reserved_bytes)
            )?,
            Some(d) => writeln!(
                out,
                "As recorded, the model parts from device {}'s recording ({} of {} segment \
                 operations matched{start}): {d}. The other scenarios are estimates",
                c.device, c.matched, c.segment_operations
            )?,
        }
    }
    writeln!(out)?;
    let several = r
        .scenarios
        .iter()
        .any(|s| s.device != r.scenarios[0].device);
    let head = [
        "scenario",
        "peak reserved",
        "peak allocated",
        "segments",
        "unallocated",
        "largest free",
        "fits",
    ];
    let rows: Vec<[String; 7]> = r
        .scenarios
        .iter()
        .map(|s| {
            let label = if several {
                format!("{} (device {})", s.setting, s.device)
            } else {
                s.setting.clone()
            };
            [
                label,
                opt_bytes(s.peak_reserved_bytes),
                opt_bytes(s.peak_allocated_bytes),
                s.segments_at_peak.map_or("-".into(), |n| n.to_string()),
                opt_bytes(s.reserved_unallocated_bytes_at_peak),
                opt_bytes(s.largest_free_block_bytes_at_peak),
                fits(s),
            ]
        })
        .collect();
    let mut width = head.map(str::len);
    for row in &rows {
        for (w, cell) in width.iter_mut().zip(row).take(6) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: [&str; 7], out: &mut dyn Write| -> std::io::Result<()> {
        let mut text = format!("{:<w$}", cells[0], w = width[0]);
        for (i, c) in cells.iter().enumerate().skip(1).take(5) {
            text.push_str(&format!("  {c:>w$}", w = width[i]));
        }
        text.push_str(&format!("  {}", cells[6]));
        writeln!(out, "{}", text.trim_end())
    };
    line(head, out)?;
    for row in &rows {
        line(row.each_ref().map(String::as_str), out)?;
    }
    writeln!(
        out,
        "(at the peak of reserved bytes: its segments, reserved but unallocated bytes and \
         largest free block; `{AS_RECORDED}` is the model under the file's own settings)"
    )?;
    for n in &r.notes {
        writeln!(out, "note: {n}")?;
    }
    Ok(())
}

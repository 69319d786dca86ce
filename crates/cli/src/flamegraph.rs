//! `memsnap flamegraph SNAP -o out.svg`: live bytes by stack, root first (inferno), at the
//! moment `--at` names (default: the first OOM, else the peak), or at the end.

use crate::analysis::{
    self, Attribution, fmt_bytes, is_hidden, is_python_frame, native_text, short_path,
};
use crate::at::{self, At, Resolved};
use crate::tally::Tally;
use anyhow::{Context, Result};
use memsnap_format::model::{BlockState, Frame, Snapshot, StackId};
use rustc_hash::FxHashMap;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
#[command(
    after_help = "In a flame graph --ignore drops the frames it matches from every stack, and --callers N draws\neach stack as its allocation site and N callers (a graph by site; 0: the sites alone)."
)]
pub struct Args {
    /// Snapshot file.
    pub snap: PathBuf,
    /// Output SVG file.
    #[arg(short, long)]
    pub output: PathBuf,
    /// The moment to draw: peak, oom, end, an event number or a time since the first
    /// recorded event (12.5s). Default: the first OOM when the device has one, else the
    /// peak. At the end the graph is in block bytes, elsewhere in requested bytes.
    #[arg(long, value_name = "MOMENT", value_parser = at::parse)]
    pub at: Option<At>,
    #[command(flatten)]
    pub attr: Attribution,
}

/// Live bytes by stack on each device, and the moment each device was taken at.
pub struct Live {
    pub by_stack: Vec<(i64, Option<StackId>, Tally)>,
    pub moments: Vec<(i64, Resolved)>,
    pub capped: Vec<String>,
    /// "block bytes" at the end, else "requested bytes".
    pub units: &'static str,
}

/// The snapshot's active_allocated blocks by stack (block bytes).
fn live_at_end(snap: &Snapshot) -> Live {
    let mut by: FxHashMap<(i64, Option<StackId>), Tally> = FxHashMap::default();
    for seg in &snap.segments {
        for b in seg
            .blocks
            .iter()
            .filter(|b| b.state == BlockState::ActiveAllocated)
        {
            by.entry((seg.device, b.stack)).or_default().add(b.size);
        }
    }
    Live {
        by_stack: by.into_iter().map(|((d, s), t)| (d, s, t)).collect(),
        moments: Vec::new(),
        capped: Vec::new(),
        units: "block bytes",
    }
}

/// Folded stacks (`root;...;leaf bytes`), one line per distinct path, sorted. The root is
/// `device memory`, or `device N` when more than one device holds memory.
pub fn folded(snap: &Snapshot, live: &Live, attr: &Attribution) -> Vec<String> {
    let mut devices: Vec<i64> = live.by_stack.iter().map(|(d, _, _)| *d).collect();
    devices.sort_unstable();
    devices.dedup();
    let mut by_path: FxHashMap<String, i64> = FxHashMap::default();
    for (device, stack, t) in &live.by_stack {
        if t.bytes <= 0 {
            continue;
        }
        let frames: Vec<&Frame> = snap.stack_frames(*stack).collect();
        let mut names: Vec<String> = if attr.callers.is_some() {
            analysis::site_chain(&frames, attr)
                .map(|(chain, _)| chain)
                .unwrap_or_default()
        } else {
            frames
                .iter()
                .filter(|f| !is_hidden(f) && !attr.ignores(f))
                .map(|f| {
                    if is_python_frame(f) {
                        format!("{} ({}:{})", f.name, short_path(&f.filename), f.line)
                    } else {
                        native_text(f)
                    }
                })
                .collect()
        };
        if names.is_empty() {
            names.push("<no frames recorded>".into());
        }
        names.reverse();
        let root = if devices.len() > 1 {
            format!("device {device}")
        } else {
            "device memory".to_string()
        };
        let path = std::iter::once(root)
            .chain(names.into_iter().map(|n| n.replace(';', ":")))
            .collect::<Vec<_>>()
            .join(";");
        *by_path.entry(path).or_default() += t.bytes;
    }
    let mut lines: Vec<String> = by_path
        .into_iter()
        .map(|(path, bytes)| format!("{path} {bytes}"))
        .collect();
    lines.sort();
    lines
}

/// The live set of every device at `at`, by stack (the end's blocks for `At::End`).
pub fn live_at(path: &std::path::Path, at: At) -> Result<(Snapshot, Live)> {
    if at == At::End {
        let snap = crate::input::load_final_state(path)?;
        let live = live_at_end(&snap);
        return Ok((snap, live));
    }
    let loaded = crate::input::load_summarized(path, at)?;
    let snap = loaded.snap;
    let mut live = Live {
        by_stack: Vec::new(),
        moments: Vec::new(),
        capped: Vec::new(),
        units: "requested bytes",
    };
    for d in analysis::devices(&snap, loaded.histories.iter().map(|h| h.events)) {
        let hist = analysis::history_of(&loaded.histories, d);
        let end = analysis::end_blocks(&snap, d);
        let state = hist.at_with_end(&end, analysis::end_reserved(&snap, d));
        live.by_stack
            .extend(state.holders.into_iter().map(|(s, t)| (d, s, t)));
        if let Some(c) = analysis::capped_label(hist.events, analysis::history_dropped(&snap, d)) {
            live.capped.push(format!("device {d}: {c}"));
        }
        live.moments.push((d, state.moment));
    }
    if at != At::Auto
        && !live.moments.is_empty()
        && live.moments.iter().all(|(_, m)| m.unreached.is_some())
    {
        let why = live.moments[0].1.unreached.clone().unwrap_or_default();
        anyhow::bail!("{}: --at: {why}", path.display());
    }
    Ok((snap, live))
}

pub fn run(a: &Args, out: &mut dyn Write) -> Result<i32> {
    let (snap, live) = live_at(&a.snap, a.at.unwrap_or(At::Auto))?;
    let lines = folded(&snap, &live, &a.attr);
    let when = at::describe_devices(&live.moments);
    if lines.is_empty() {
        anyhow::bail!(
            "{}: no live allocations {when}, nothing to draw",
            a.snap.display()
        );
    }
    let mut opts = inferno::flamegraph::Options::default();
    opts.title = format!(
        "live GPU memory {when}: {}",
        crate::input::display_name(&a.snap)
    );
    opts.count_name = live.units.into();
    let file = std::fs::File::create(&a.output)
        .with_context(|| format!("cannot create {}", a.output.display()))?;
    let mut w = std::io::BufWriter::new(file);
    inferno::flamegraph::from_lines(&mut opts, lines.iter().map(String::as_str), &mut w)
        .with_context(|| format!("writing {}", a.output.display()))?;
    w.flush()
        .with_context(|| format!("writing {}", a.output.display()))?;
    let total: Tally = live.by_stack.iter().fold(Tally::default(), |mut t, x| {
        t.merge(x.2);
        t
    });
    writeln!(
        out,
        "wrote {}: live memory by stack {when}, {} ({}) in {} allocations",
        a.output.display(),
        fmt_bytes(total.bytes),
        live.units,
        total.count
    )?;
    for c in &live.capped {
        writeln!(out, "{c}")?;
    }
    writeln!(out, "open it in a web browser: {}", file_url(&a.output))?;
    Ok(0)
}

/// `file:///abs/path` for a written file (relative paths resolved against the working
/// directory).
pub fn file_url(path: &std::path::Path) -> String {
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    format!("file://{}", abs.display())
}

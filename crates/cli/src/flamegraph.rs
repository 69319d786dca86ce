//! `memsnap flamegraph SNAP -o out.svg`: the arguments, reading the file, and drawing the
//! engine's folded stacks ([`memsnap_engine::flamegraph`]) with inferno: live bytes by
//! stack, root first, at the moment `--at` names (default: the first OOM, else the peak),
//! or at the end. Cold code.

use crate::args::Attribution;
use crate::shown::shown;
use anyhow::{Context, Result};
use memsnap_engine::at::{self, At};
use memsnap_engine::bytes::fmt_bytes;
use memsnap_engine::flamegraph::{self as engine, Live};
use memsnap_engine::tally::Tally;
use memsnap_format::model::Snapshot;
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

/// The live set of every device at `at`, by stack (the end's blocks for `At::End`).
pub fn live_at(path: &std::path::Path, at: At) -> Result<(Snapshot, Live)> {
    if at == At::End {
        let snap = crate::input::load_final_state(path)?.snap;
        let live = engine::live_at_end(&snap);
        return Ok((snap, live));
    }
    let loaded = crate::input::load_summarized(path, at)?;
    let live = engine::live_at(&loaded);
    if at != At::Auto
        && let Some(why) = live.unreached()
    {
        anyhow::bail!("{}: --at: {why}", path.display());
    }
    Ok((loaded.snap, live))
}

pub fn run(a: &Args, out: &mut dyn Write) -> Result<i32> {
    let (snap, live) = live_at(&a.snap, a.at.unwrap_or(At::Auto))?;
    let lines = engine::folded(&snap, &live, &a.attr.rules());
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
    // The output path is the command line's, shown as the reports show strings.
    writeln!(
        out,
        "wrote {}: live memory by stack {when}, {} ({}) in {} allocations",
        shown(&a.output.display().to_string()),
        fmt_bytes(total.bytes),
        live.units,
        total.count
    )?;
    for c in &live.capped {
        writeln!(out, "{c}")?;
    }
    writeln!(
        out,
        "open it in a web browser: {}",
        shown(&file_url(&a.output))
    )?;
    Ok(0)
}

/// `file:///abs/path` for a written file (relative paths resolved against the working
/// directory).
pub fn file_url(path: &std::path::Path) -> String {
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    format!("file://{}", abs.display())
}

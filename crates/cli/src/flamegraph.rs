//! `memsnap flamegraph SNAP -o out.svg`: live bytes by stack, root first (inferno).

use crate::analysis::{is_hidden, is_python_frame, native_text, short_path};
use anyhow::{Context, Result};
use memsnap_format::model::{BlockState, Snapshot};
use rustc_hash::FxHashMap;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Snapshot file.
    pub snap: PathBuf,
    /// Output SVG file.
    #[arg(short, long)]
    pub output: PathBuf,
}

/// Folded stacks (`root;...;leaf bytes`), one line per distinct stack, sorted.
pub fn folded(snap: &Snapshot) -> Vec<String> {
    let mut by_stack: FxHashMap<Option<u32>, i64> = FxHashMap::default();
    for seg in &snap.segments {
        for b in seg
            .blocks
            .iter()
            .filter(|b| b.state == BlockState::ActiveAllocated)
        {
            *by_stack.entry(b.stack).or_default() += b.size;
        }
    }
    let mut lines: Vec<String> = by_stack
        .into_iter()
        .filter(|(_, bytes)| *bytes > 0)
        .map(|(stack, bytes)| {
            let mut names: Vec<String> = snap
                .stack_frames(stack)
                .filter(|f| !is_hidden(f))
                .map(|f| {
                    let t = if is_python_frame(f) {
                        format!("{} ({}:{})", f.name, short_path(&f.filename), f.line)
                    } else {
                        native_text(f)
                    };
                    t.replace(';', ":")
                })
                .collect();
            if names.is_empty() {
                names.push("<no frames recorded>".into());
            }
            names.reverse();
            format!("device memory;{} {bytes}", names.join(";"))
        })
        .collect();
    lines.sort();
    lines
}

pub fn run(a: &Args, _out: &mut dyn Write) -> Result<i32> {
    let snap = crate::input::load_final_state(&a.snap)?;
    let lines = folded(&snap);
    if lines.is_empty() {
        anyhow::bail!("{}: no live allocations, nothing to draw", a.snap.display());
    }
    let mut opts = inferno::flamegraph::Options::default();
    opts.title = format!("live GPU memory: {}", crate::input::display_name(&a.snap));
    opts.count_name = "bytes".into();
    let file = std::fs::File::create(&a.output)
        .with_context(|| format!("cannot create {}", a.output.display()))?;
    let mut w = std::io::BufWriter::new(file);
    inferno::flamegraph::from_lines(&mut opts, lines.iter().map(String::as_str), &mut w)
        .with_context(|| format!("writing {}", a.output.display()))?;
    w.flush()
        .with_context(|| format!("writing {}", a.output.display()))?;
    Ok(0)
}

//! `memsnap check SNAP...`: does each snapshot follow the rules PyTorch's viewer relies on?
//!
//! Cold, no unsafe. Runs the format checker (`memsnap_format::check`: the forward history
//! ending in the segments (docs/FORMAT.md#forward-history-rule), tiling, sizes, stacks) on
//! each file; one line per file, then the violations. Exit 1 when any file breaks a rule (2
//! when one cannot be read at all).

use crate::input::{display_name, load};
use anyhow::Result;
use memsnap_format::check;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Snapshot files (memsnap's or PyTorch's).
    #[arg(required = true)]
    pub snaps: Vec<PathBuf>,
    /// Violations listed per file before "... and N more".
    #[arg(long, default_value_t = 20)]
    pub max: usize,
}

pub fn run(a: &Args, out: &mut dyn Write) -> Result<i32> {
    let mut failed = false;
    for path in &a.snaps {
        let snap = load(path)?;
        let violations = check::check(&snap);
        let events: usize = snap.device_traces.iter().map(Vec::len).sum();
        if violations.is_empty() {
            writeln!(
                out,
                "{}: ok ({} segments, {events} events on {} device(s))",
                display_name(path),
                snap.segments.len(),
                snap.device_traces.len()
            )?;
            continue;
        }
        failed = true;
        writeln!(
            out,
            "{}: {} violation(s)",
            display_name(path),
            violations.len()
        )?;
        for v in violations.iter().take(a.max) {
            writeln!(out, "  {v}")?;
        }
        if violations.len() > a.max {
            writeln!(out, "  ... and {} more", violations.len() - a.max)?;
        }
    }
    Ok(if failed { 1 } else { 0 })
}

//! `memsnap check SNAP...`: does each snapshot follow the rules PyTorch's viewer relies on?
//!
//! Cold, no unsafe. Checks every file, one line per file then its violations: the file's
//! encoding as the reader saw it (`memsnap_format::check::check_encoding`: protocol 2–4,
//! the viewer's opcodes, batches of at most 1000, LONG1 of at most 8 bytes, frames
//! `{name, filename, line}`) and the model (`memsnap_format::check::check`: the forward
//! history ending in the segments (docs/FORMAT.md#forward-history-rule), tiling, sizes,
//! stacks). What a memsnap file says it misses (dropped events, events without a stack, stack
//! frames unresolved) comes first, a line each, and is no violation. A file that cannot be
//! read is one error line on stderr, and the next file is checked. Exit 0 when every file passes, 1 when any breaks a rule, 2 when any cannot be
//! read at all. docs/FORMAT.md, "Which checker enforces which rule", lists what is not
//! checked.

use crate::input::{display_name, load_for_check};
use crate::shown::shown;
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
    let (mut failed, mut unreadable) = (false, false);
    for path in &a.snaps {
        let (snap, encoding) = match load_for_check(path) {
            Ok(x) => x,
            Err(e) => {
                // Reported in order with the others' lines.
                out.flush()?;
                eprintln!("memsnap: {}", shown(&format!("{e:#}")));
                unreadable = true;
                continue;
            }
        };
        // The encoding's violations are a few lines at most; the model's can be one per
        // event, so only those shown are kept.
        let mut violations = check::check_encoding(&encoding);
        let checked = check::check_keeping(&snap, a.max);
        let total = violations.len() + checked.total;
        violations.extend(checked.kept);
        let events: usize = snap.device_traces.iter().map(Vec::len).sum();
        // What the file says it misses, first (not a violation of the format).
        let meta = |key| memsnap_engine::summary::meta_int(&snap, key);
        for line in crate::summary::incomplete(
            meta("dropped_events"),
            meta("events_without_stack"),
            meta("frames_unresolved"),
        ) {
            writeln!(out, "{}: {line}", shown(&display_name(path)))?;
        }
        if total == 0 {
            writeln!(
                out,
                "{}: ok ({} segments, {events} events on {} device(s))",
                shown(&display_name(path)),
                snap.segments.len(),
                memsnap_engine::device::devices(&snap).len()
            )?;
            continue;
        }
        failed = true;
        writeln!(out, "{}: {total} violation(s)", shown(&display_name(path)))?;
        for v in violations.iter().take(a.max) {
            writeln!(out, "  {}", shown(&v.to_string()))?;
        }
        if total > a.max {
            writeln!(out, "  ... and {} more", total - a.max)?;
        }
    }
    Ok(match (unreadable, failed) {
        (true, _) => 2,
        (false, true) => 1,
        (false, false) => 0,
    })
}

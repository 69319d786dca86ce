//! `memsnap diff BEFORE AFTER`: the arguments, reading both files, and the text renderer
//! of the engine's [`Diff`] (JSON is its serde form): what grew between two snapshots, by
//! allocation site.
//!
//! Compares live blocks (`active_allocated`, all devices) grouped by site, at the end of
//! each file, or at the moment `--at` names on each side (then in requested bytes, on both
//! sides). Exit status 1 when the total growth passes `--fail-above`, for CI. Cold code.

use crate::args::Report;
use crate::input::{FinalState, Summarized};
use crate::shown::{shown, write_escaped};
use anyhow::Result;
use memsnap_engine::at::{self, At};
use memsnap_engine::bytes::{fmt_bytes, parse_bytes};
use memsnap_engine::diff::{self as engine, Diff, Input, Row, SideLive};
use memsnap_engine::sites::{self, StackBytes};
use memsnap_format::model::Snapshot;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The `--json` shape (stable: fields are only ever added).
pub const JSON_SHAPE: &str = "\
JSON (--json):
  { before: {file, live_bytes, live_blocks, units, at: [ {device, moment, after_event, ...} ], capped: [str]},
    after:  {same fields},
    total_growth_bytes, fail_above_bytes: int|null, failed: bool,
    grew:   [ {site, kind, via: str|null, before_bytes, after_bytes, growth_bytes, before_count,
               after_count, count_growth} ],
    shrank: [ same fields, most negative growth first ] }
units: \"block bytes\" (both sides at the end: active_allocated blocks) or \"requested bytes\"
(a side at another moment: what was live then, as the history records it; live_blocks then
counts allocations). via: the helper, where the site is its calling line (a helper of either
file is one of both). Exit status: 0, or 1 when total_growth_bytes > --fail-above; 2 on errors.";

#[derive(clap::Args, Debug)]
#[command(after_long_help = JSON_SHAPE)]
pub struct Args {
    /// The earlier snapshot.
    pub before: PathBuf,
    /// The later snapshot.
    pub after: PathBuf,
    /// Compare both files at this moment: peak, oom, end (the default), an event number or a
    /// time since the first recorded event (12.5s).
    #[arg(long, value_name = "MOMENT", value_parser = at::parse)]
    pub at: Option<At>,
    /// The moment of BEFORE only (overrides --at for it).
    #[arg(long, value_name = "MOMENT", value_parser = at::parse)]
    pub at_before: Option<At>,
    /// The moment of AFTER only (overrides --at for it).
    #[arg(long, value_name = "MOMENT", value_parser = at::parse)]
    pub at_after: Option<At>,
    /// Exit with status 1 when the total live growth exceeds this (1000, 64MB = 64*10^6,
    /// 64MiB = 64*2^20, 2GiB).
    #[arg(long, value_parser = parse_bytes)]
    pub fail_above: Option<i64>,
    /// How many growing sites to list (shrinking: a quarter of it).
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    #[command(flatten)]
    pub report: Report,
}

/// One file read for `diff`: its final state (block bytes at the end), or its histories
/// followed to a moment (requested bytes).
enum Loaded {
    End(FinalState),
    At(Summarized, At),
}

impl Loaded {
    fn read(path: &Path, at: At, requested: bool) -> Result<Loaded> {
        Ok(if requested {
            Loaded::At(crate::input::load_summarized(path, at)?, at)
        } else {
            Loaded::End(crate::input::load_final_state(path)?)
        })
    }

    /// The snapshot, and what its stacks allocated (helpers are found from it).
    fn stacks(&self) -> (&Snapshot, StackBytes) {
        match self {
            Loaded::End(f) => (&f.snap, f.bytes.clone()),
            Loaded::At(s, _) => (&s.snap, s.stack_bytes()),
        }
    }

    /// The live set of the file `path`, by site.
    fn side(&self, path: &Path, attr: &sites::Attribution) -> Result<SideLive> {
        let (loaded, at) = match self {
            Loaded::End(f) => return Ok(engine::side_at_end(&f.snap, &f.bytes, attr)),
            Loaded::At(s, at) => (s, *at),
        };
        let side = engine::side_at(loaded, attr);
        if at != At::End
            && let Some(why) = side.unreached()
        {
            anyhow::bail!("{}: --at: {why}", path.display());
        }
        Ok(side)
    }
}

pub fn run(a: &Args, out: &mut dyn Write) -> Result<i32> {
    let at_before = a.at_before.or(a.at).unwrap_or(At::End);
    let at_after = a.at_after.or(a.at).unwrap_or(At::End);
    // Block bytes exist only at the end; any other moment puts both sides in the
    // history's units, so the two columns compare like with like.
    let requested = at_before != At::End || at_after != At::End;
    // Both files at once: reading is one core per file.
    let mut loaded = crate::input::map_files(
        &[(&a.before, at_before), (&a.after, at_after)],
        |(p, at)| Loaded::read(p, *at, requested),
    )
    .into_iter();
    let (Some(b), Some(c)) = (loaded.next(), loaded.next()) else {
        anyhow::bail!("internal error: two files read, fewer results");
    };
    let (b, c) = (b?, c?);
    // A helper of either file is one of both, so that the two name their sites alike.
    let (sb, sc) = (b.stacks(), c.stacks());
    let attr = a.report.attr.rules().shared([(sb.0, &sb.1), (sc.0, &sc.1)]);
    let (b, c) = (b.side(&a.before, &attr)?, c.side(&a.after, &attr)?);
    let d = engine::compare(
        Input {
            file: a.before.display().to_string(),
            live: &b,
        },
        Input {
            file: a.after.display().to_string(),
            live: &c,
        },
        requested,
        a.top,
        a.fail_above,
    );
    if a.report.json {
        serde_json::to_writer_pretty(&mut *out, &d)?;
        writeln!(out)?;
    } else {
        write_escaped(out, |out| {
            write_text(
                &d,
                (&crate::input::display_name(&a.before), &b),
                (&crate::input::display_name(&a.after), &c),
                out,
            )
        })?;
    }
    Ok(if d.failed { 1 } else { 0 })
}

fn signed(b: i64) -> String {
    if b > 0 {
        format!("+{}", fmt_bytes(b))
    } else {
        fmt_bytes(b)
    }
}

/// `count` names what the counts count: `blocks` or `allocs`.
fn write_rows(out: &mut dyn Write, rows: &[Row], count: &str) -> std::io::Result<()> {
    writeln!(
        out,
        "  {:>11}  {:>6}  {:>10}  {:>10}  site",
        "growth", count, "before", "after"
    )?;
    for r in rows {
        writeln!(
            out,
            "  {:>11}  {:>+6}  {:>10}  {:>10}  {}",
            signed(r.growth_bytes),
            r.count_growth,
            fmt_bytes(r.before_bytes),
            fmt_bytes(r.after_bytes),
            shown(&r.site)
        )?;
    }
    Ok(())
}

fn write_text(
    d: &Diff,
    (before, b): (&str, &SideLive),
    (after, c): (&str, &SideLive),
    out: &mut dyn Write,
) -> std::io::Result<()> {
    writeln!(out, "{} -> {}", shown(before), shown(after))?;
    let requested = d.before.units == "requested bytes";
    if requested {
        writeln!(out, "before: {}", at::describe_devices(&b.moments))?;
        writeln!(out, "after:  {}", at::describe_devices(&c.moments))?;
        for capped in b
            .capped
            .iter()
            .map(|l| format!("before, {l}"))
            .chain(c.capped.iter().map(|l| format!("after, {l}")))
        {
            writeln!(out, "{capped}")?;
        }
    }
    writeln!(
        out,
        "live{} {} -> {} ({}), {} {} -> {} ({:+})",
        if requested { " (requested)" } else { "" },
        fmt_bytes(d.before.live_bytes),
        fmt_bytes(d.after.live_bytes),
        signed(d.total_growth_bytes),
        if requested { "allocations" } else { "blocks" },
        d.before.live_blocks,
        d.after.live_blocks,
        d.after.live_blocks - d.before.live_blocks
    )?;
    if d.grew.is_empty() {
        writeln!(out, "nothing grew")?;
    } else {
        writeln!(out, "grew (largest first):")?;
        write_rows(out, &d.grew, if requested { "allocs" } else { "blocks" })?;
    }
    if !d.shrank.is_empty() {
        writeln!(out, "shrank:")?;
        write_rows(out, &d.shrank, if requested { "allocs" } else { "blocks" })?;
    }
    if let Some(f) = d.fail_above_bytes {
        writeln!(
            out,
            "{}: growth {} {} the limit {} ({f} bytes)",
            if d.failed { "FAIL" } else { "ok" },
            signed(d.total_growth_bytes),
            if d.failed { "exceeds" } else { "is within" },
            fmt_bytes(f)
        )?;
    }
    Ok(())
}

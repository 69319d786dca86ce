//! `memsnap diff BEFORE AFTER`: what grew between two snapshots, by allocation site.
//!
//! Compares live blocks (`active_allocated`, all devices) grouped by site, at the end of
//! each file, or at the moment `--at` names on each side (then in requested bytes, on both
//! sides). Exit status 1 when the total growth passes `--fail-above`, for CI.

use crate::analysis::{self, Attribution, SiteKind, Sites, fmt_bytes, parse_bytes};
use crate::at::{self, At, AtJson, Resolved};
use crate::tally::Tally;
use anyhow::Result;
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The `--json` shape (stable: fields are only ever added).
pub const JSON_SHAPE: &str = "\
JSON (--json):
  { before: {file, live_bytes, live_blocks, units, at: [ {device, moment, after_event, ...} ], capped: [str]},
    after:  {same fields},
    total_growth_bytes, fail_above_bytes: int|null, failed: bool,
    grew:   [ {site, kind, before_bytes, after_bytes, growth_bytes, before_count, after_count, count_growth} ],
    shrank: [ same fields, most negative growth first ] }
units: \"block bytes\" (both sides at the end: active_allocated blocks) or \"requested bytes\"
(a side at another moment: what was live then, as the history records it; live_blocks then
counts allocations). Exit status: 0, or 1 when total_growth_bytes > --fail-above; 2 on errors.";

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
    pub attr: Attribution,
    /// Print JSON instead of text (shape: see --help).
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
pub struct DeviceAt {
    pub device: i64,
    #[serde(flatten)]
    pub moment: AtJson,
}

#[derive(Serialize)]
pub struct Side {
    pub file: String,
    pub live_bytes: i64,
    pub live_blocks: i64,
    pub units: &'static str,
    /// The moment of each device (empty when the side is at its end).
    pub at: Vec<DeviceAt>,
    /// `history capped: kept N of M events`, per device where the cap dropped events.
    pub capped: Vec<String>,
}

#[derive(Serialize, Clone)]
pub struct Row {
    pub site: String,
    pub kind: SiteKind,
    pub before_bytes: i64,
    pub after_bytes: i64,
    pub growth_bytes: i64,
    pub before_count: i64,
    pub after_count: i64,
    pub count_growth: i64,
}

#[derive(Serialize)]
pub struct Diff {
    pub before: Side,
    pub after: Side,
    pub total_growth_bytes: i64,
    pub fail_above_bytes: Option<i64>,
    pub failed: bool,
    pub grew: Vec<Row>,
    pub shrank: Vec<Row>,
}

/// One side: live bytes by site text (sites are compared by their text, which is stable
/// across files), the moment of each device, and the cap labels.
struct SideLive {
    by_site: BTreeMap<String, (SiteKind, Tally)>,
    total: Tally,
    moments: Vec<(i64, Resolved)>,
    capped: Vec<String>,
}

/// The live set of `path` at `at`, by site: block bytes at the end when `requested` is
/// false, else requested bytes (the history's units) at the moment.
fn side(path: &Path, at: At, requested: bool, attr: &Attribution) -> Result<SideLive> {
    let mut side = SideLive {
        by_site: BTreeMap::new(),
        total: Tally::default(),
        moments: Vec::new(),
        capped: Vec::new(),
    };
    let mut add = |sites: &Sites, site: u32, t: Tally| {
        side.by_site
            .entry(sites.text(site).to_string())
            .or_insert((sites.sites[site as usize].kind, Tally::default()))
            .1
            .merge(t);
        side.total.merge(t);
    };
    if !requested {
        let snap = crate::input::load_final_state(path)?;
        let sites = Sites::new(&snap, attr);
        for (s, t) in analysis::live_by_site(&snap, &sites) {
            add(&sites, s, t);
        }
        return Ok(side);
    }
    let loaded = crate::input::load_summarized(path, at)?;
    let snap = &loaded.snap;
    let sites = Sites::new(snap, attr);
    let mut moments = Vec::new();
    let mut capped = Vec::new();
    for d in analysis::devices(snap, loaded.histories.iter().map(|h| h.events)) {
        let hist = analysis::history_of(&loaded.histories, d);
        let end = analysis::end_blocks(snap, d);
        let state = hist.at_with_end(&end, analysis::end_reserved(snap, d));
        for (stack, t) in &state.holders {
            add(&sites, sites.site(*stack), *t);
        }
        if let Some(c) = analysis::capped_label(hist.events, analysis::history_dropped(snap, d)) {
            capped.push(format!("device {d}: {c}"));
        }
        moments.push((d, state.moment));
    }
    if at != At::End && !moments.is_empty() && moments.iter().all(|(_, m)| m.unreached.is_some()) {
        let why = moments[0].1.unreached.clone().unwrap_or_default();
        anyhow::bail!("{}: --at: {why}", path.display());
    }
    side.moments = moments;
    side.capped = capped;
    Ok(side)
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
        |(p, at)| side(p, *at, requested, &a.attr),
    )
    .into_iter();
    let (Some(b), Some(c)) = (loaded.next(), loaded.next()) else {
        anyhow::bail!("internal error: two files read, fewer results");
    };
    let (b, c) = (b?, c?);
    let mut rows: BTreeMap<&str, (SiteKind, Tally, Tally)> = BTreeMap::new();
    for (site, (kind, t)) in &b.by_site {
        rows.entry(site)
            .or_insert((*kind, Tally::default(), Tally::default()))
            .1 = *t;
    }
    for (site, (kind, t)) in &c.by_site {
        rows.entry(site)
            .or_insert((*kind, Tally::default(), Tally::default()))
            .2 = *t;
    }
    let all: Vec<Row> = rows
        .into_iter()
        .map(|(site, (kind, x, y))| Row {
            site: site.to_string(),
            kind,
            before_bytes: x.bytes,
            after_bytes: y.bytes,
            growth_bytes: y.bytes - x.bytes,
            before_count: x.count,
            after_count: y.count,
            count_growth: y.count - x.count,
        })
        .collect();
    let mut grew: Vec<Row> = all.iter().filter(|r| r.growth_bytes > 0).cloned().collect();
    grew.sort_by(|x, y| {
        y.growth_bytes
            .cmp(&x.growth_bytes)
            .then(x.site.cmp(&y.site))
    });
    grew.truncate(a.top);
    let mut shrank: Vec<Row> = all.iter().filter(|r| r.growth_bytes < 0).cloned().collect();
    shrank.sort_by(|x, y| {
        x.growth_bytes
            .cmp(&y.growth_bytes)
            .then(x.site.cmp(&y.site))
    });
    shrank.truncate(a.top.div_ceil(4));
    let total = c.total.bytes - b.total.bytes;
    let failed = a.fail_above.is_some_and(|f| total > f);
    let units = if requested {
        "requested bytes"
    } else {
        "block bytes"
    };
    let json_side = |path: &Path, s: &SideLive| Side {
        file: path.display().to_string(),
        live_bytes: s.total.bytes,
        live_blocks: s.total.count,
        units,
        at: s
            .moments
            .iter()
            .map(|(d, m)| DeviceAt {
                device: *d,
                moment: AtJson::from(m),
            })
            .collect(),
        capped: s.capped.clone(),
    };
    let d = Diff {
        before: json_side(&a.before, &b),
        after: json_side(&a.after, &c),
        total_growth_bytes: total,
        fail_above_bytes: a.fail_above,
        failed,
        grew,
        shrank,
    };
    if a.json {
        serde_json::to_writer_pretty(&mut *out, &d)?;
        writeln!(out)?;
    } else {
        write_text(
            &d,
            (&crate::input::display_name(&a.before), &b),
            (&crate::input::display_name(&a.after), &c),
            out,
        )?;
    }
    Ok(if failed { 1 } else { 0 })
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
            r.site
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
    writeln!(out, "{before} -> {after}")?;
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

//! `memsnap diff BEFORE AFTER`: what grew between two snapshots, by allocation site.
//!
//! Compares live blocks (`active_allocated`, all devices) grouped by site. Exit status 1
//! when the total growth passes `--fail-above`, for CI.

use crate::analysis::{self, SiteKind, Sites, fmt_bytes, parse_bytes};
use crate::tally::Tally;
use anyhow::Result;
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

/// The `--json` shape (stable: fields are only ever added).
pub const JSON_SHAPE: &str = "\
JSON (--json):
  { before: {file, live_bytes, live_blocks}, after: {file, live_bytes, live_blocks},
    total_growth_bytes, fail_above_bytes: int|null, failed: bool,
    grew:   [ {site, kind, before_bytes, after_bytes, growth_bytes, before_count, after_count, count_growth} ],
    shrank: [ same fields, most negative growth first ] }
Exit status: 0, or 1 when total_growth_bytes > --fail-above; 2 on errors.";

#[derive(clap::Args, Debug)]
#[command(after_long_help = JSON_SHAPE)]
pub struct Args {
    /// The earlier snapshot.
    pub before: PathBuf,
    /// The later snapshot.
    pub after: PathBuf,
    /// Exit with status 1 when the total live growth exceeds this (e.g. 1000, 64MiB, 2GiB).
    #[arg(long, value_parser = parse_bytes)]
    pub fail_above: Option<i64>,
    /// How many growing sites to list (shrinking: a quarter of it).
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Print JSON instead of text (shape: see --help).
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
pub struct Side {
    pub file: String,
    pub live_bytes: i64,
    pub live_blocks: i64,
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

pub fn run(a: &Args, out: &mut dyn Write) -> Result<i32> {
    // Both files at once: reading is one core per file.
    let mut loaded = crate::input::map_files(&[&a.before, &a.after], |p| {
        crate::input::load_final_state(p)
    })
    .into_iter();
    let (Some(b), Some(c)) = (loaded.next(), loaded.next()) else {
        anyhow::bail!("internal error: two files read, fewer results");
    };
    let (b, c) = (b?, c?);
    let (sb, sc) = (Sites::new(&b), Sites::new(&c));
    // Sites are compared by their text, which is stable across files.
    let mut rows: BTreeMap<String, (SiteKind, Tally, Tally)> = BTreeMap::new();
    let mut tb = Tally::default();
    for (s, t) in analysis::live_by_site(&b, &sb) {
        let r = rows.entry(sb.text(s).to_string()).or_insert((
            sb.sites[s as usize].kind,
            Tally::default(),
            Tally::default(),
        ));
        r.1 = t;
        tb.bytes += t.bytes;
        tb.count += t.count;
    }
    let mut tc = Tally::default();
    for (s, t) in analysis::live_by_site(&c, &sc) {
        let r = rows.entry(sc.text(s).to_string()).or_insert((
            sc.sites[s as usize].kind,
            Tally::default(),
            Tally::default(),
        ));
        r.2 = t;
        tc.bytes += t.bytes;
        tc.count += t.count;
    }
    let all: Vec<Row> = rows
        .into_iter()
        .map(|(site, (kind, x, y))| Row {
            site,
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
    let total = tc.bytes - tb.bytes;
    let failed = a.fail_above.is_some_and(|f| total > f);
    let d = Diff {
        before: Side {
            file: a.before.display().to_string(),
            live_bytes: tb.bytes,
            live_blocks: tb.count,
        },
        after: Side {
            file: a.after.display().to_string(),
            live_bytes: tc.bytes,
            live_blocks: tc.count,
        },
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
            &crate::input::display_name(&a.before),
            &crate::input::display_name(&a.after),
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

fn write_rows(out: &mut dyn Write, rows: &[Row]) -> std::io::Result<()> {
    writeln!(
        out,
        "  {:>11}  {:>6}  {:>10}  {:>10}  site",
        "growth", "blocks", "before", "after"
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

pub fn write_text(d: &Diff, before: &str, after: &str, out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(out, "{before} -> {after}")?;
    writeln!(
        out,
        "live {} -> {} ({}), blocks {} -> {} ({:+})",
        fmt_bytes(d.before.live_bytes),
        fmt_bytes(d.after.live_bytes),
        signed(d.total_growth_bytes),
        d.before.live_blocks,
        d.after.live_blocks,
        d.after.live_blocks - d.before.live_blocks
    )?;
    if d.grew.is_empty() {
        writeln!(out, "nothing grew")?;
    } else {
        writeln!(out, "grew (largest first):")?;
        write_rows(out, &d.grew)?;
    }
    if !d.shrank.is_empty() {
        writeln!(out, "shrank:")?;
        write_rows(out, &d.shrank)?;
    }
    if let Some(f) = d.fail_above_bytes {
        writeln!(
            out,
            "{}: growth {} {} the limit {}",
            if d.failed { "FAIL" } else { "ok" },
            signed(d.total_growth_bytes),
            if d.failed { "exceeds" } else { "is within" },
            fmt_bytes(f)
        )?;
    }
    Ok(())
}

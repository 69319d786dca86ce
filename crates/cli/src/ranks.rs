//! `memsnap ranks DIR`: the arguments, reading every rank file (several at once), and the
//! text renderer of the engine's [`Ranks`] (JSON is its serde form): one row per rank file
//! and the ranks that stand out ([`memsnap_engine::ranks`] says which). A file that cannot
//! be read gets a row saying why; the other ranks are still reported (they are the ones a
//! person needs then). Cold code.

use crate::args::{Attribution, Report};
use crate::shown::{shown, write_escaped};
use anyhow::Result;
use memsnap_engine::at::At;
use memsnap_engine::bytes::fmt_bytes;
use memsnap_engine::ranks::{self as engine, OUTLIER_FACTOR, Rank, Ranks};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The `--json` shape (stable: fields are only ever added).
pub const JSON_SHAPE: &str = "\
JSON (--json):
  { dir, median_live_bytes, median_peak_bytes,
    ranks: [ {file, files: [str], rank: int|null, pid: int|null, host: str|null, live_bytes, reserved_bytes, peak_bytes, ooms,
              top_site: str|null, top_site_bytes, outlier: bool, reasons: [str],
              capped: [str], torch_allocator: str|null, error: str|null} ] }
A rank whose file cannot be read has `error` set and zeros elsewhere; it is left out of the
medians. A process's several files (same host and pid: its step files, its exit file) are one
row: `files` lists them oldest first, `file` is the latest, whose figures the row gives (peak
and ooms: the most of any of them). capped: `history capped: kept N of M events` per device where the cap dropped events.
torch_allocator: memsnap's line on what it saw of PyTorch's allocator (blocks, segments only,
tensors); a rank whose kind differs from most ranks' is marked.";

#[derive(clap::Args, Debug)]
#[command(after_long_help = JSON_SHAPE)]
pub struct Args {
    /// Folder holding one snapshot per rank (*.pickle, *.pkl).
    pub dir: PathBuf,
    #[command(flatten)]
    pub report: Report,
}

/// Reads every snapshot of `dir` and builds the table.
pub fn build(dir: &Path, attr: &Attribution) -> Result<Ranks> {
    let files = crate::input::rank_files(dir)?;
    if files.is_empty() {
        anyhow::bail!("{}: no *.pickle or *.pkl files", dir.display());
    }
    let attr = attr.rules();
    let ranks = crate::input::map_files(&files, |p| {
        let name = crate::input::display_name(p);
        match crate::input::load_summarized(p, At::End) {
            Ok(loaded) => engine::row(name, &loaded, &attr),
            Err(e) => engine::unreadable(name, format!("{e:#}")),
        }
    });
    if let Some(e) = ranks.iter().find_map(|r| r.error.as_ref())
        && ranks.iter().all(|r| r.error.is_some())
    {
        anyhow::bail!("{}: no readable snapshot; the first: {e}", dir.display());
    }
    Ok(engine::finish(dir.display().to_string(), ranks))
}

pub fn run(a: &Args, out: &mut dyn Write) -> Result<i32> {
    let r = build(&a.dir, &a.report.attr)?;
    if a.report.json {
        serde_json::to_writer_pretty(&mut *out, &r)?;
        writeln!(out)?;
        return Ok(0);
    }
    write_escaped(out, |out| write_text(&r, &a.dir, out))?;
    Ok(0)
}

/// `rank not known: pid 4242 on node1`, for a row whose files name no rank.
fn process(x: &Rank) -> String {
    match (x.pid, &x.host) {
        (Some(pid), Some(host)) => format!("rank not known: pid {pid} on {host}"),
        (Some(pid), None) => format!("rank not known: pid {pid}"),
        _ => "rank not known (the file names none)".to_string(),
    }
}

/// The table as text (`dir`: the folder as given, for the `explain` hint).
fn write_text(r: &Ranks, dir: &Path, out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(
        out,
        "{:>5}  {:>10}  {:>10}  {:>10}  {:>4}  {:<2} file / top site",
        "rank", "live", "reserved", "peak", "ooms", ""
    )?;
    for x in &r.ranks {
        if let Some(e) = &x.error {
            writeln!(
                out,
                "{:>5}  {:>10}  {:>10}  {:>10}  {:>4}  {:<2} {}",
                x.rank.map(|r| r.to_string()).unwrap_or_else(|| "?".into()),
                "-",
                "-",
                "-",
                "-",
                "??",
                shown(&x.file)
            )?;
            writeln!(out, "{:>51}unreadable: {}", "", shown(e))?;
            continue;
        }
        writeln!(
            out,
            "{:>5}  {:>10}  {:>10}  {:>10}  {:>4}  {:<2} {}",
            x.rank.map(|r| r.to_string()).unwrap_or_else(|| "?".into()),
            fmt_bytes(x.live_bytes),
            fmt_bytes(x.reserved_bytes),
            fmt_bytes(x.peak_bytes),
            x.ooms,
            if x.outlier { "!!" } else { "" },
            shown(&x.file)
        )?;
        if x.rank.is_none() {
            writeln!(out, "{:>51}{}", "", shown(&process(x)))?;
        }
        if x.files.len() > 1 {
            writeln!(
                out,
                "{:>51}one process's {} files, oldest first (the figures are the latest's, the \
                 peak the highest): {}",
                "",
                x.files.len(),
                shown(&x.files.join(", "))
            )?;
        }
        if let Some(s) = &x.top_site {
            let bytes = fmt_bytes(x.top_site_bytes);
            writeln!(out, "{:>51}{bytes} {}", "", shown(s))?;
        }
        if x.outlier {
            let reasons = x.reasons.join(", ");
            writeln!(out, "{:>51}stands out: {}", "", shown(&reasons))?;
        }
        for c in &x.capped {
            writeln!(out, "{:>51}{}", "", shown(c))?;
        }
    }
    writeln!(
        out,
        "median live {}, median peak {}; marked (!!): > {OUTLIER_FACTOR}x median, an OOM where others had none, or PyTorch's allocator recorded otherwise",
        fmt_bytes(r.median_live_bytes),
        fmt_bytes(r.median_peak_bytes)
    )?;
    if r.ranks.iter().any(|x| x.ooms > 0 || x.outlier) {
        writeln!(
            out,
            "`memsnap explain {}`: which rank ran out of memory first and why, and the sites that \
             differ from the median rank",
            shown(&dir.display().to_string())
        )?;
    }
    if let Some(x) = r.ranks.iter().find(|x| x.files.len() > 1) {
        let (first, last) = (&x.files[0], &x.files[x.files.len() - 1]);
        let path = |f: &str| shown(&dir.join(f).display().to_string()).into_owned();
        writeln!(
            out,
            "several files of one process (same host and pid) are one row, not ranks: \
             `memsnap explain` on them finds leaks across their steps, `memsnap diff {} {}` \
             shows what grew between the first and the last",
            path(first),
            path(last)
        )?;
    }
    let unreadable = r.ranks.iter().filter(|x| x.error.is_some()).count();
    if unreadable > 0 {
        writeln!(
            out,
            "{unreadable} of {} files could not be read (marked ??); the medians are of the others",
            r.ranks.len()
        )?;
    }
    Ok(())
}

//! `memsnap ranks DIR`: one row per rank file and the ranks that stand out.
//!
//! The rank comes from memsnap's metadata (`rank`) or the file name (`r3`, `rank3`,
//! `rank_3`, as in memsnap's `-r{rank}-` and torchtitan's `rank{rank}_`). A rank stands
//! out when its live or peak bytes exceed 1.25× the median of all files, or when it hit an
//! OOM while some other rank did not. A file that cannot be read gets a row saying why;
//! the other ranks are still reported (they are the ones a person needs then).

use crate::analysis::{self, Attribution, Sites, fmt_bytes};
use crate::at::At;
use crate::summary::meta_int;
use crate::tally::sorted;
use anyhow::Result;
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Factor over the median that marks a rank.
pub const OUTLIER_FACTOR: f64 = 1.25;

/// The `--json` shape (stable: fields are only ever added).
pub const JSON_SHAPE: &str = "\
JSON (--json):
  { dir, median_live_bytes, median_peak_bytes,
    ranks: [ {file, rank: int|null, live_bytes, reserved_bytes, peak_bytes, ooms,
              top_site: str|null, top_site_bytes, outlier: bool, reasons: [str],
              capped: [str], error: str|null} ] }
A rank whose file cannot be read has `error` set and zeros elsewhere; it is left out of the
medians. capped: `history capped: kept N of M events` per device where the cap dropped events.";

#[derive(clap::Args, Debug)]
#[command(after_long_help = JSON_SHAPE)]
pub struct Args {
    /// Folder holding one snapshot per rank (*.pickle, *.pkl).
    pub dir: PathBuf,
    #[command(flatten)]
    pub attr: Attribution,
    /// Print JSON instead of text (shape: see --help).
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize, Clone)]
pub struct Rank {
    pub file: String,
    pub rank: Option<i64>,
    pub live_bytes: i64,
    pub reserved_bytes: i64,
    /// Σ over devices of the peak live (requested) bytes within the recorded history.
    pub peak_bytes: i64,
    pub ooms: usize,
    pub top_site: Option<String>,
    pub top_site_bytes: i64,
    pub outlier: bool,
    pub reasons: Vec<String>,
    /// `device D: history capped: kept N of M events`, where the cap dropped events.
    pub capped: Vec<String>,
    /// Why the file could not be read (the row's figures are then zero).
    pub error: Option<String>,
}

#[derive(Serialize)]
pub struct Ranks {
    pub dir: String,
    pub median_live_bytes: i64,
    pub median_peak_bytes: i64,
    pub ranks: Vec<Rank>,
}

/// `…-r12-…`, `rank12`, `rank_12`, `_r3.`: the first such number in the file name.
pub fn rank_from_name(name: &str) -> Option<i64> {
    let b = name.as_bytes();
    for (i, _) in name.match_indices('r') {
        let boundary = i == 0 || !b[i - 1].is_ascii_alphanumeric();
        if !boundary {
            continue;
        }
        let mut j = i + 1;
        if name[j..].starts_with("ank") {
            j += 3;
            if name[j..].starts_with('_') || name[j..].starts_with('-') {
                j += 1;
            }
        }
        let digits: String = name[j..]
            .chars()
            .take_while(|c| c.is_ascii_digit())
            .collect();
        let after = name[j + digits.len()..].chars().next();
        if !digits.is_empty() && after.is_none_or(|c| !c.is_ascii_alphanumeric()) {
            return digits.parse().ok();
        }
    }
    None
}

fn median(mut v: Vec<i64>) -> i64 {
    if v.is_empty() {
        return 0;
    }
    v.sort_unstable();
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2
    }
}

/// A row of `path` with no figures yet.
fn empty_row(path: &Path, rank: Option<i64>) -> Rank {
    let name = crate::input::display_name(path);
    Rank {
        rank: rank.or_else(|| rank_from_name(&name)),
        file: name,
        live_bytes: 0,
        reserved_bytes: 0,
        peak_bytes: 0,
        ooms: 0,
        top_site: None,
        top_site_bytes: 0,
        outlier: false,
        reasons: Vec::new(),
        capped: Vec::new(),
        error: None,
    }
}

/// A row saying why the file could not be read.
fn unreadable(path: &Path, e: &anyhow::Error) -> Rank {
    Rank {
        error: Some(format!("{e:#}")),
        ..empty_row(path, None)
    }
}

fn row(path: &Path, attr: &Attribution) -> Result<Rank> {
    let crate::input::Summarized { snap, histories } =
        crate::input::load_summarized(path, At::End)?;
    let sites = Sites::new(&snap, attr);
    let mut r = empty_row(path, meta_int(&snap, "rank"));
    for d in analysis::devices(&snap, histories.iter().map(|h| h.events)) {
        let hist = analysis::history_of(&histories, d);
        let st = analysis::device_stats(&snap, &sites, d, &hist);
        r.live_bytes += st.live.bytes;
        r.reserved_bytes += st.reserved.bytes;
        r.peak_bytes += st.peak_live_requested;
        r.ooms += st.ooms.len();
        if let Some(c) = analysis::capped_label(hist.events, analysis::history_dropped(&snap, d)) {
            r.capped.push(format!("device {d}: {c}"));
        }
    }
    if let Some((s, t)) = sorted(&analysis::live_by_site(&snap, &sites)).first() {
        r.top_site = Some(sites.text(*s).to_string());
        r.top_site_bytes = t.bytes;
    }
    Ok(r)
}

pub fn build(dir: &Path, attr: &Attribution) -> Result<Ranks> {
    let files = crate::input::rank_files(dir)?;
    if files.is_empty() {
        anyhow::bail!("{}: no *.pickle or *.pkl files", dir.display());
    }
    let mut ranks: Vec<Rank> = crate::input::map_files(&files, |p| {
        row(p, attr).unwrap_or_else(|e| unreadable(p, &e))
    });
    if let Some(e) = ranks.iter().find_map(|r| r.error.as_ref())
        && ranks.iter().all(|r| r.error.is_some())
    {
        anyhow::bail!("{}: no readable snapshot; the first: {e}", dir.display());
    }
    ranks.sort_by(|a, b| {
        a.rank
            .is_none()
            .cmp(&b.rank.is_none())
            .then(a.rank.cmp(&b.rank))
            .then(a.file.cmp(&b.file))
    });
    let read = || ranks.iter().filter(|r| r.error.is_none());
    let ml = median(read().map(|r| r.live_bytes).collect());
    let mp = median(read().map(|r| r.peak_bytes).collect());
    let any_clean = read().any(|r| r.ooms == 0);
    for r in ranks.iter_mut().filter(|r| r.error.is_none()) {
        if ml > 0 && r.live_bytes as f64 > OUTLIER_FACTOR * ml as f64 {
            r.reasons.push(format!(
                "live {:.2}x median",
                r.live_bytes as f64 / ml as f64
            ));
        }
        if mp > 0 && r.peak_bytes as f64 > OUTLIER_FACTOR * mp as f64 {
            r.reasons.push(format!(
                "peak {:.2}x median",
                r.peak_bytes as f64 / mp as f64
            ));
        }
        if r.ooms > 0 && any_clean {
            r.reasons.push("OOM (other ranks had none)".into());
        }
        r.outlier = !r.reasons.is_empty();
    }
    Ok(Ranks {
        dir: dir.display().to_string(),
        median_live_bytes: ml,
        median_peak_bytes: mp,
        ranks,
    })
}

pub fn run(a: &Args, out: &mut dyn Write) -> Result<i32> {
    let r = build(&a.dir, &a.attr)?;
    if a.json {
        serde_json::to_writer_pretty(&mut *out, &r)?;
        writeln!(out)?;
        return Ok(0);
    }
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
                x.file
            )?;
            writeln!(out, "{:>51}unreadable: {e}", "")?;
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
            x.file
        )?;
        if let Some(s) = &x.top_site {
            writeln!(out, "{:>51}{} {s}", "", fmt_bytes(x.top_site_bytes))?;
        }
        if x.outlier {
            writeln!(out, "{:>51}stands out: {}", "", x.reasons.join(", "))?;
        }
        for c in &x.capped {
            writeln!(out, "{:>51}{c}", "")?;
        }
    }
    writeln!(
        out,
        "median live {}, median peak {}; marked (!!): > {OUTLIER_FACTOR}x median, or an OOM where others had none",
        fmt_bytes(r.median_live_bytes),
        fmt_bytes(r.median_peak_bytes)
    )?;
    let unreadable = r.ranks.iter().filter(|x| x.error.is_some()).count();
    if unreadable > 0 {
        writeln!(
            out,
            "{unreadable} of {} files could not be read (marked ??); the medians are of the others",
            r.ranks.len()
        )?;
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::rank_from_name;

    #[test]
    fn rank_from_file_names() {
        assert_eq!(
            rank_from_name("memsnap-python-node1-r12-p4242-exit-0.pickle"),
            Some(12)
        );
        assert_eq!(rank_from_name("rank3_memory_snapshot.pickle"), Some(3));
        assert_eq!(rank_from_name("snap_rank_7.pickle"), Some(7));
        assert_eq!(rank_from_name("train-r0.pickle"), Some(0));
        assert_eq!(rank_from_name("torch-transformer.pickle"), None);
        assert_eq!(rank_from_name("run-r2d2.pickle"), None);
    }
}

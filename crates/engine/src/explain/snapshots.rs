//! Several snapshots of one process given together (signal dumps, `memsnap dump`, periodic
//! files, its exit file): which files are one process's ([`groups`]), and the growth
//! between them by site ([`compare`]), judged as a leak, a warm-up, or growth that cannot
//! be told, with the rules of [`super::leaks`] (docs/EXPLAIN.md, "Snapshots of one
//! process"). Cold code.

use super::Digest;
use super::leaks::{self, Leak, MIN_POINTS, StepPoint, Unit};
use serde::Serialize;
use std::collections::BTreeMap;

/// Sites listed per process, most growth first.
pub const GROWTH_SITES: usize = 10;

/// What the growth of one site between the snapshots is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Verdict {
    #[serde(rename = "leak")]
    Leak,
    #[serde(rename = "warm-up")]
    WarmUp,
    /// Grew, but the files cannot tell a leak from a warm-up.
    #[serde(rename = "grew")]
    Grew,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Leak => "leak",
            Verdict::WarmUp => "warm-up",
            Verdict::Grew => "grew",
        }
    }
}

/// One site that grew between the first snapshot and the last.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Growth {
    pub site: String,
    pub growth_bytes: i64,
    pub live_bytes_at_end: i64,
    pub verdict: Verdict,
    /// The helper the bytes went through, where the site is its calling line.
    pub via: Option<String>,
}

/// One process's snapshots side by side (`snapshots` in `--json`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Snapshots {
    pub rank: Option<i64>,
    pub pid: Option<i64>,
    pub host: Option<String>,
    /// Oldest first.
    pub files: Vec<String>,
    /// Between the first file and the last, where both say when they were written.
    pub seconds: Option<f64>,
    /// Iterations of the program between the first file and the last, where counted.
    pub iterations: Option<i64>,
    pub sites: Vec<Growth>,
}

/// What [`compare`] says.
pub struct Compared {
    pub snapshots: Snapshots,
    pub leaks: Vec<Leak>,
    pub notes: Vec<String>,
    /// How notes about this process start (`pid 4242: `).
    pub who: String,
}

/// The files of each process with two or more among `digests` (their indices), oldest
/// first. One process: the same rank, host, pid and program (files that name none, as
/// PyTorch's own, are one unnamed process per rank), in the order they were written
/// (`memsnap.time_us`, else their last entry), split where the file number (`seq`) or
/// the events recorded go back: a new process that got the same pid.
pub fn groups(digests: &[Digest]) -> Vec<Vec<usize>> {
    type Key = (Option<i64>, Option<String>, Option<i64>, Option<String>);
    let mut by_key: BTreeMap<Key, Vec<usize>> = BTreeMap::new();
    for (i, d) in digests.iter().enumerate() {
        by_key
            .entry((d.rank, d.host.clone(), d.pid, d.exe.clone()))
            .or_default()
            .push(i);
    }
    let restarted = |a: &Digest, b: &Digest| {
        matches!((a.seq, b.seq), (Some(x), Some(y)) if y < x)
            || matches!((a.events_recorded, b.events_recorded), (Some(x), Some(y)) if y < x)
    };
    let mut out = Vec::new();
    for (_, mut files) in by_key {
        files.sort_by(|&a, &b| {
            let (x, y) = (&digests[a], &digests[b]);
            (x.written_us, x.seq, &x.file).cmp(&(y.written_us, y.seq, &y.file))
        });
        let mut process: Vec<usize> = Vec::new();
        for i in files {
            if let Some(&p) = process.last()
                && restarted(&digests[p], &digests[i])
            {
                out.push(std::mem::take(&mut process));
            }
            process.push(i);
        }
        out.push(process);
    }
    out.retain(|g| g.len() >= 2);
    out
}

/// Iterations between the files `a` and `b`: the iterations `b`'s history saw start after
/// `a` was written, where it reaches back that far; else the history entries recorded
/// between them (memsnap's files count the ones they dropped) over an iteration's entries.
fn iterations_between(a: &Digest, b: &Digest, cut: Option<&Digest>) -> Option<i64> {
    let a_end = a.written_us?;
    if let (Some((b_start, _)), false) = (b.time_range, b.iteration_starts.is_empty())
        && b_start <= a_end
    {
        let k = b.iteration_starts.iter().filter(|&&t| t > a_end).count();
        if k > 0 {
            return Some(k as i64);
        }
    }
    let info = cut?.iterations.as_ref()?;
    let dev = info.device?;
    let per = info.entries_per_iteration.filter(|&e| e > 0)?;
    let gained = b.entries_total.get(&dev)? - a.entries_total.get(&dev)?;
    Some((gained + per / 2) / per).filter(|&k| k > 0)
}

/// The growth between `files` (one process's, oldest first) by site. `name_rank`: notes
/// start with the rank.
pub fn compare(files: &[&Digest], name_rank: bool) -> Compared {
    let n = files.len();
    let (first, last) = (files[0], files[n - 1]);
    let rank = first.rank;
    let who = match (rank, first.pid) {
        (Some(r), _) if name_rank => format!("rank {r}: "),
        (None, Some(pid)) => format!("pid {pid}: "),
        _ => String::new(),
    };
    let points: Vec<StepPoint> = files
        .iter()
        .enumerate()
        .map(|(i, d)| StepPoint {
            step: i as i64 + 1,
            ..d.end_point.clone()
        })
        .collect();
    // The files' iterations, from the latest file that found them.
    let cut = files
        .iter()
        .rev()
        .find(|d| d.iterations.as_ref().is_some_and(|i| i.found))
        .copied();
    let iterations = iterations_between(first, last, cut);
    let steps: Vec<i64> = (1..=n as i64).collect();
    let mut sites: Vec<&String> = points.iter().flat_map(|p| p.by_site.keys()).collect();
    sites.sort();
    sites.dedup();
    let mut growth: Vec<Growth> = Vec::new();
    let mut leaks: Vec<Leak> = Vec::new();
    for site in sites {
        let v: Vec<i64> = points
            .iter()
            .map(|p| p.by_site.get(site).copied().unwrap_or(0))
            .collect();
        let grew = v[n - 1] - v[0];
        if grew <= 0 {
            continue;
        }
        // Where the leak starts (a file's index), if it is one.
        let (verdict, start) = if n >= MIN_POINTS {
            match leaks::window(&steps, &v) {
                Some((k, _)) => (Verdict::Leak, k),
                None if v[n - 1] == v[n - 2] => (Verdict::WarmUp, 0),
                None => (Verdict::Grew, 0),
            }
        } else {
            // Too few files for the series rule: the latest file's history says whether
            // the site still grows, and how much it holds and frees within an iteration.
            match last
                .motion
                .as_ref()
                .map(|m| m.get(site).copied().unwrap_or((0, 0)))
            {
                None if n == 3 && v[2] == v[1] => (Verdict::WarmUp, 0),
                None => (Verdict::Grew, 0),
                Some((late, fall)) => {
                    if v.windows(2).all(|w| w[1] - w[0] > fall) && late > 0 {
                        (Verdict::Leak, 0)
                    } else if late <= 0 || v[n - 1] == v[n - 2] {
                        (Verdict::WarmUp, 0)
                    } else {
                        (Verdict::Grew, 0)
                    }
                }
            }
        };
        if verdict == Verdict::Leak {
            let span = (n - 1 - start) as i64;
            let bytes = v[n - 1] - v[start];
            leaks.push(Leak {
                site: site.clone(),
                bytes_per_step: bytes / span,
                steps: span,
                first_step: start as i64 + 1,
                last_step: n as i64,
                live_bytes_at_end: v[n - 1],
                ranks: rank.into_iter().collect(),
                unit: Unit::Snapshot,
                bytes_per_iteration: iterations_between(files[start], last, cut).map(|k| bytes / k),
                via: None,
            });
        }
        growth.push(Growth {
            site: site.clone(),
            growth_bytes: grew,
            live_bytes_at_end: v[n - 1],
            verdict,
            via: None,
        });
    }
    growth.sort_by(|a, b| {
        b.growth_bytes
            .cmp(&a.growth_bytes)
            .then(a.site.cmp(&b.site))
    });
    growth.truncate(GROWTH_SITES);
    leaks.sort_by(|a, b| {
        b.bytes_per_step
            .cmp(&a.bytes_per_step)
            .then(a.site.cmp(&b.site))
    });
    let mut notes = Vec::new();
    if leaks.is_empty() {
        notes.extend(leaks::cache_growth(&points, &who, Unit::Snapshot));
    }
    if last.motion.is_none() && n < MIN_POINTS && growth.iter().any(|g| g.verdict == Verdict::Grew)
    {
        notes.push(format!(
            "{who}{} has no history: growth between {n} snapshots cannot be told a leak or a \
             warm-up (a history, `MEMSNAP_MAX_ENTRIES`, or at least {MIN_POINTS} snapshots can)",
            last.file
        ));
    }
    let seconds = match (first.written_us, last.written_us) {
        (Some(a), Some(b)) if b >= a => Some((b - a) as f64 / 1e6),
        _ => None,
    };
    Compared {
        snapshots: Snapshots {
            rank,
            pid: first.pid,
            host: first.host.clone(),
            files: files.iter().map(|d| d.file.clone()).collect(),
            seconds,
            iterations,
            sites: growth,
        },
        leaks,
        notes,
        who,
    }
}

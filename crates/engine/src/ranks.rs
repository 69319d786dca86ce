//! `ranks`' model: one row per rank file (live, reserved and peak bytes, OOMs, the top
//! site, the history cap) and the ranks that stand out. A process's several files (same
//! host and pid: its step files) are one row ([`by_process`]).
//!
//! The rank comes from memsnap's metadata (`rank`) or the file name (`r3`, `rank3`,
//! `rank_3`, as in memsnap's `-r{rank}-` and torchtitan's `rank{rank}_`); the pid, which
//! memsnap writes there when the environment names no rank, is no rank. A rank stands
//! out when its live or peak bytes exceed [`OUTLIER_FACTOR`] × the median of all files, or
//! when it hit an OOM while some other rank did not, or when memsnap saw PyTorch's allocator
//! differently there than on the other ranks (its blocks on most, its segments only on one:
//! that rank's bytes are not the same kind of figure). A file that cannot be read gets a row
//! saying why ([`unreadable`]), left out of the medians. The CLI lists and reads the
//! files, prints text or serializes this as JSON. Cold code.

use crate::device;
use crate::explain::owners::{by_allocator_kind, torch_allocator_line};
use crate::input::Summarized;
use crate::origin::{meta_number, rank_from_name};
use crate::sites::{Attribution, Sites};
use crate::tally::sorted;
use memsnap_format::model::Meta;
use serde::Serialize;

/// Factor over the median that marks a rank.
pub const OUTLIER_FACTOR: f64 = 1.25;

#[derive(Serialize, Clone)]
pub struct Rank {
    /// The file the figures are of: a process's latest where it wrote several.
    pub file: String,
    /// Every file of the row's process, oldest first (the one `file` alone where it wrote
    /// one, or where the files name no process).
    pub files: Vec<String>,
    pub rank: Option<i64>,
    /// The process that wrote the file and its host (`memsnap.pid`, `memsnap.host`), where
    /// the file names them.
    pub pid: Option<i64>,
    pub host: Option<String>,
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
    /// memsnap's line on PyTorch's allocator (`blocks: ...`, `segments only: ...`,
    /// `tensors: ...`), where the file has one.
    pub torch_allocator: Option<String>,
    /// Why the file could not be read (the row's figures are then zero).
    pub error: Option<String>,
    /// When the file was written (`memsnap.time_us`, `seq`, `step`): orders a process's files.
    #[serde(skip)]
    written: (Option<i64>, Option<i64>, Option<i64>),
}

#[derive(Serialize)]
pub struct Ranks {
    pub dir: String,
    pub median_live_bytes: i64,
    pub median_peak_bytes: i64,
    pub ranks: Vec<Rank>,
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

/// A row of the file `name` with no figures yet.
fn empty_row(name: String, rank: Option<i64>) -> Rank {
    Rank {
        rank: rank.or_else(|| rank_from_name(&name)),
        files: vec![name.clone()],
        pid: None,
        host: None,
        written: (None, None, None),
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
        torch_allocator: None,
        error: None,
    }
}

/// A row saying why the file `name` could not be read.
pub fn unreadable(name: String, error: String) -> Rank {
    Rank {
        error: Some(error),
        ..empty_row(name, None)
    }
}

/// The row of the file `name` (figures summed over its devices).
pub fn row(name: String, loaded: &Summarized, attr: &Attribution) -> Rank {
    let Summarized { snap, histories } = loaded;
    let sites = Sites::new(snap, attr, &loaded.stack_bytes());
    // memsnap writes the pid as the rank where the environment names none (and so in its
    // default file name, `-r{rank}-`): no rank then, as `explain` reads it.
    let pid = meta_number(snap, "pid");
    let mut r = empty_row(name, meta_number(snap, "rank"));
    r.rank = r.rank.filter(|&n| Some(n) != pid);
    r.pid = pid;
    r.host = match snap.meta("host") {
        Some(Meta::Str(h)) if !h.is_empty() => Some(h.clone()),
        _ => None,
    };
    r.written = (
        meta_number(snap, "time_us"),
        meta_number(snap, "seq"),
        meta_number(snap, "step"),
    );
    for d in device::devices(snap) {
        let hist = device::history_of(histories, d);
        let st = device::device_stats(snap, &sites, d, &hist);
        r.live_bytes += st.live.bytes;
        r.reserved_bytes += st.reserved.bytes;
        r.peak_bytes += st.peak_live_requested;
        r.ooms += st.ooms.len();
        if let Some(c) = device::capped_label(hist.events, device::history_dropped(snap, d)) {
            r.capped.push(format!("device {d}: {c}"));
        }
    }
    r.torch_allocator = torch_allocator_line(snap).map(str::to_string);
    if let Some((s, t)) = sorted(&device::live_by_site(snap, &sites)).first() {
        r.top_site = Some(sites.text(*s).to_string());
        r.top_site_bytes = t.bytes;
    }
    r
}

/// The table of the folder `dir`: rows by rank (then file name), medians of the readable
/// ones, outliers marked.
pub fn finish(dir: String, ranks: Vec<Rank>) -> Ranks {
    let mut ranks = by_process(ranks);
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
    }
    mark_allocator_differences(&mut ranks);
    for r in ranks.iter_mut() {
        r.outlier = !r.reasons.is_empty();
    }
    Ranks {
        dir,
        median_live_bytes: ml,
        median_peak_bytes: mp,
        ranks,
    }
}

/// One row per process: the readable files of one host and pid (a process's step files,
/// its exit file beside them) are one row, not one rank each with the same number. The
/// row's figures are its latest file's (the process's state last written), its peak and
/// OOMs the most any of its files recorded (a later file's history may have lost an
/// earlier peak to the cap; an `oom` file and the `exit` file after it hold the same OOM).
fn by_process(ranks: Vec<Rank>) -> Vec<Rank> {
    let mut groups: Vec<Vec<Rank>> = Vec::new();
    for r in ranks {
        let same = |g: &Vec<Rank>| {
            let x = &g[0];
            r.error.is_none()
                && x.error.is_none()
                && r.pid.is_some()
                && (x.pid, &x.host, x.rank) == (r.pid, &r.host, r.rank)
        };
        match groups.iter_mut().find(|g| same(g)) {
            Some(g) => g.push(r),
            None => groups.push(vec![r]),
        }
    }
    groups
        .into_iter()
        .map(|mut g| {
            g.sort_by(|a, b| a.written.cmp(&b.written).then(a.file.cmp(&b.file)));
            let files: Vec<String> = g.iter().map(|r| r.file.clone()).collect();
            let peak = g.iter().map(|r| r.peak_bytes).max().unwrap_or(0);
            let ooms = g.iter().map(|r| r.ooms).max().unwrap_or(0);
            let mut last = g.pop().expect("a group has a file");
            last.files = files;
            last.peak_bytes = peak;
            last.ooms = ooms;
            last
        })
        .collect()
}

/// Marks the ranks whose allocator line names another kind of record than most ranks'
/// (every rank that has one, when no kind has the most): their live and peak bytes are
/// blocks where the others' are segments, or the other way round.
fn mark_allocator_differences(ranks: &mut [Rank]) {
    let groups = by_allocator_kind(
        ranks
            .iter()
            .map(|r| r.torch_allocator.as_deref().filter(|_| r.error.is_none())),
    );
    if groups.len() < 2 {
        return;
    }
    let most = groups.iter().map(|(_, at)| at.len()).max().unwrap_or(0);
    let mut leaders = groups.iter().filter(|(_, at)| at.len() == most);
    let majority = match (leaders.next(), leaders.next()) {
        (Some((kind, _)), None) => Some(kind.as_str()),
        _ => None,
    };
    let all: Vec<String> = groups
        .iter()
        .map(|(kind, at)| format!("{kind} on {}", at.len()))
        .collect();
    for (kind, at) in &groups {
        let reason = match majority {
            Some(m) if m == kind => continue,
            Some(m) => {
                format!("PyTorch's allocator recorded as {kind}, not {m} as on {most} ranks")
            }
            None => format!(
                "PyTorch's allocator recorded as {kind} (ranks differ: {})",
                all.join(", ")
            ),
        };
        for &i in at {
            ranks[i].reasons.push(reason.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Rank, empty_row, finish};

    fn rank_with(name: &str, live: i64, allocator: Option<&str>) -> Rank {
        Rank {
            live_bytes: live,
            peak_bytes: live,
            torch_allocator: allocator.map(str::to_string),
            ..empty_row(name.to_string(), None)
        }
    }

    #[test]
    fn a_rank_whose_allocator_was_seen_otherwise_stands_out() {
        let blocks = "blocks: PyTorch 2.11.0 caching allocator, through its trace tracker";
        let segments = "segments only: PyTorch 2.11.0: block events set aside (a check failed)";
        let r = finish(
            "run".into(),
            vec![
                rank_with("r0.pickle", 100, Some(blocks)),
                rank_with("r1.pickle", 100, Some(blocks)),
                rank_with("r2.pickle", 100, Some(segments)),
                rank_with("r3.pickle", 100, None),
            ],
        );
        let marked: Vec<(&str, &Vec<String>)> = r
            .ranks
            .iter()
            .filter(|x| x.outlier)
            .map(|x| (x.file.as_str(), &x.reasons))
            .collect();
        assert_eq!(
            marked,
            vec![(
                "r2.pickle",
                &vec![
                    "PyTorch's allocator recorded as segments only, not blocks as on 2 ranks"
                        .to_string()
                ]
            )]
        );
        // No majority: every rank with a line is marked, each with the whole count.
        let r = finish(
            "run".into(),
            vec![
                rank_with("r0.pickle", 100, Some(blocks)),
                rank_with("r1.pickle", 100, Some(segments)),
            ],
        );
        for x in &r.ranks {
            assert!(x.outlier, "{}", x.file);
            assert!(x.reasons[0].ends_with("(ranks differ: blocks on 1, segments only on 1)"));
        }
        // The same kind everywhere: nothing marked.
        let r = finish(
            "run".into(),
            vec![
                rank_with("r0.pickle", 100, Some(blocks)),
                rank_with("r1.pickle", 100, Some(blocks)),
            ],
        );
        assert!(r.ranks.iter().all(|x| !x.outlier));
    }
}

//! The digests of every file put together ([`build`]): the OOM that came first, leaks per
//! rank (step boundaries, else iterations, else the growth between one process's snapshots),
//! owners and roles at the moment, the ranks side by side. Cold code.

use super::leaks::{self, Leak, StepPoint, Unit};
use super::{
    AtFile, Digest, Explanation, OtherRank, iterations, log, owners, side_by_side, snapshots,
};
use crate::sites::{Attribution, HelperRule, Helpers};
use std::collections::BTreeMap;

/// Live bytes of a file at `time_us` (Σ over devices), from its timelines; `None` when its
/// history does not cover that moment.
fn live_at(d: &Digest, time_us: i64) -> Option<i64> {
    let (first, last) = d.time_range?;
    if time_us < first || time_us > last {
        return None;
    }
    let tls = d.timelines.as_ref()?;
    tls.iter().map(|t| log::at_time(t, time_us)).sum()
}

/// How far ahead the text counts steps until a leak fills the device: a creep measured over
/// tens of step boundaries, carried ten thousand steps on, is a guess about a program that
/// will change before then (docs/EXPLAIN.md, "Leaks"). Beyond it the note says "not within
/// the next 10000 steps"; `steps_to_oom` keeps the figure.
pub const STEPS_HORIZON: i64 = 10_000;

/// One series of boundaries the leak rule runs over: a rank's, what its boundaries are,
/// and the file whose iterations they are.
struct Series<'a> {
    rank: Option<i64>,
    unit: Unit,
    points: Vec<StepPoint>,
    file: Option<&'a Digest>,
}

/// Adds `found` to `leaks`: a site already there with the same unit (another rank's)
/// takes the ranks and the larger figures.
fn add_leaks(leaks: &mut Vec<Leak>, found: Vec<Leak>) {
    for l in found {
        match leaks
            .iter_mut()
            .find(|x| x.site == l.site && x.unit == l.unit)
        {
            Some(x) => {
                x.ranks.extend(l.ranks);
                x.bytes_per_step = x.bytes_per_step.max(l.bytes_per_step);
                x.bytes_per_iteration = x.bytes_per_iteration.max(l.bytes_per_iteration);
                x.live_bytes_at_end = x.live_bytes_at_end.max(l.live_bytes_at_end);
                x.steps = x.steps.max(l.steps);
                x.first_step = x.first_step.min(l.first_step);
                x.last_step = x.last_step.max(l.last_step);
            }
            None => leaks.push(l),
        }
    }
}

/// Puts the digests of every file together.
pub fn build(mut digests: Vec<Digest>) -> Explanation {
    let files = digests.len();
    let mut notes: Vec<String> = Vec::new();
    for d in digests.iter().filter(|d| d.error.is_some()) {
        notes.push(format!(
            "{}: unreadable: {}",
            d.file,
            d.error.as_deref().unwrap_or_default()
        ));
    }
    digests.retain(|d| d.error.is_none());
    let several = digests.len() > 1;
    for d in &digests {
        notes.extend(d.notes.iter().cloned());
    }
    notes.extend(allocator_kinds_differ(&digests));
    // Peak per rank (over its files).
    let mut peak_of_rank: BTreeMap<i64, i64> = BTreeMap::new();
    for d in &digests {
        if let Some(r) = d.rank {
            let p = peak_of_rank.entry(r).or_default();
            *p = (*p).max(d.peak_bytes);
        }
    }
    // 1. The OOM that came first.
    // Ties (a rank's `oom` and `exit` files hold the same OOM): the `oom` file.
    let first = digests
        .iter()
        .filter_map(|d| d.oom.as_ref().map(|o| (o.time_us, d.rank, d)))
        .min_by_key(|(t, r, d)| (*t, *r, d.reason.as_deref() != Some("oom"), d.file.clone()))
        .map(|(_, _, d)| d);
    let mut oom = first.and_then(|d| d.oom.clone());
    if let Some(o) = oom.as_mut() {
        o.first_rank = o.rank;
        let ranks_oomed: Vec<i64> = digests
            .iter()
            .filter(|d| d.oom.is_some())
            .filter_map(|d| d.rank)
            .collect();
        for (&rank, &peak) in &peak_of_rank {
            if Some(rank) == o.rank {
                continue;
            }
            // The rank's file whose history covers the moment, else its latest.
            let files: Vec<&Digest> = digests.iter().filter(|d| d.rank == Some(rank)).collect();
            let covering = files
                .iter()
                .find(|d| {
                    d.time_range
                        .is_some_and(|(a, b)| a <= o.time_us && o.time_us <= b)
                })
                .or_else(|| files.iter().max_by_key(|d| d.time_range.map(|r| r.1)));
            o.others.push(OtherRank {
                rank: Some(rank),
                live_bytes: covering.and_then(|d| live_at(d, o.time_us)),
                peak_bytes: peak,
            });
        }
        if ranks_oomed.iter().any(|r| Some(*r) != o.rank) {
            let mut later: Vec<i64> = ranks_oomed
                .iter()
                .copied()
                .filter(|r| Some(*r) != o.rank)
                .collect();
            later.sort_unstable();
            later.dedup();
            notes.push(format!(
                "rank{} {} ran out of memory too, later",
                if later.len() > 1 { "s" } else { "" },
                later
                    .iter()
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
    }
    // 2. Leaks: per rank, the longest series of step boundaries; a rank without one, the
    // iterations found in its files' histories, and the growth between the snapshots of
    // each of its processes.
    let mut series: BTreeMap<Option<i64>, Vec<StepPoint>> = BTreeMap::new();
    let mut groups: BTreeMap<(Option<i64>, Option<i64>), Vec<StepPoint>> = BTreeMap::new();
    for d in &digests {
        if d.reason.as_deref() == Some("step") && d.step.is_some() {
            groups
                .entry((d.rank, d.pid))
                .or_default()
                .push(d.end_point.clone());
        }
        if d.marks.len() > series.get(&d.rank).map_or(0, Vec::len) {
            series.insert(d.rank, d.marks.clone());
        }
    }
    for ((rank, _), mut pts) in groups {
        pts.sort_by_key(|p| p.step);
        pts.dedup_by_key(|p| p.step);
        if pts.len() > series.get(&rank).map_or(0, Vec::len) {
            series.insert(rank, pts);
        }
    }
    // Ranks with two or more step boundaries are judged by them alone.
    series.retain(|_, pts| pts.len() >= 2);
    let mut all: Vec<Series> = series
        .into_iter()
        .map(|(rank, points)| Series {
            rank,
            unit: Unit::Step,
            points,
            file: None,
        })
        .collect();
    let stepped: Vec<Option<i64>> = all.iter().map(|s| s.rank).collect();
    // The rest: per rank, the file whose history cut the most iterations (or, where none
    // did, the latest file with a history, to say why).
    let mut cut: BTreeMap<Option<i64>, &Digest> = BTreeMap::new();
    let key = |d: &Digest| {
        let i = d.iterations.as_ref();
        (
            i.is_some_and(|i| i.found),
            i.and_then(|i| i.iterations),
            d.written_us,
        )
    };
    for d in digests.iter().filter(|d| !stepped.contains(&d.rank)) {
        if d.iterations.is_some() && cut.get(&d.rank).is_none_or(|c| key(d) > key(c)) {
            cut.insert(d.rank, d);
        }
    }
    let processes = snapshots::groups(&digests);
    let mut iteration_infos: Vec<iterations::Info> = Vec::new();
    // Ranks whose files gave no iterations: (rank, file, why), said in one line.
    let mut none_found: Vec<(Option<i64>, &str, String)> = Vec::new();
    for (rank, d) in cut {
        let Some(info) = d.iterations.clone() else {
            continue;
        };
        if info.found {
            all.push(Series {
                rank,
                unit: Unit::Iteration,
                points: d.iteration_points.clone(),
                file: Some(d),
            });
        } else {
            let why = info.why_not.clone().unwrap_or_default();
            none_found.push((rank, &d.file, why));
        }
        iteration_infos.push(info);
    }
    if let Some((rank, file, why)) = none_found.first() {
        // What would help, unless the process's snapshots are given already.
        let compared = processes
            .iter()
            .any(|g| g.iter().any(|&i| digests[i].rank == *rank));
        let help = if compared {
            String::new()
        } else {
            format!(
                "; what would let explain find leaks: {}",
                iterations::WHAT_WOULD_HELP
            )
        };
        let rank_of =
            |r: &Option<i64>| r.map_or_else(|| "rank not known".into(), |r| format!("rank {r}"));
        let line = match none_found.len() {
            1 => format!(
                "{}no iterations found in {file}: {why}{help}",
                rank.map(|r| format!("rank {r}: ")).unwrap_or_default()
            ),
            n => format!(
                "no iterations found in the records of {n} ranks ({}); {}, {file}: {why}{help}",
                none_found
                    .iter()
                    .map(|(r, _, _)| rank_of(r))
                    .collect::<Vec<_>>()
                    .join(", "),
                rank_of(rank)
            ),
        };
        notes.push(line);
    }
    let ranks_with_series = all
        .iter()
        .map(|s| s.rank)
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    let mut leaks: Vec<Leak> = Vec::new();
    let mut steps_to_oom: Option<i64> = None;
    // Per series with leaks: (rank, what a step is, bytes a step, bytes in use, when).
    let mut creeps: Vec<(Option<i64>, &str, i64, i64, String)> = Vec::new();
    for Series {
        rank,
        unit,
        points: pts,
        file,
    } in &all
    {
        let mut found = leaks::find(pts, *rank, ranks_with_series > 1, *unit);
        // Iterations: live bytes at the end of the file, not at its last boundary.
        for l in &mut found.leaks {
            if let Some(b) = file.and_then(|d| d.end_point.by_site.get(&l.site)) {
                l.live_bytes_at_end = *b;
            }
        }
        if !found.leaks.is_empty() {
            let per_step: i64 = found.leaks.iter().map(|l| l.bytes_per_step).sum();
            let last = pts.last().expect("a series with leaks has points");
            let used = last.reserved.max(last.live);
            let at = format!("at {} {}", unit.as_str(), last.step);
            creeps.push((*rank, unit.as_str(), per_step, used, at));
        }
        notes.extend(found.notes);
        add_leaks(&mut leaks, found.leaks);
    }
    // Snapshots of one process, where its rank has no step boundaries.
    let mut snapshots: Vec<snapshots::Snapshots> = Vec::new();
    for g in processes {
        let files: Vec<&Digest> = g.iter().map(|&i| &digests[i]).collect();
        if stepped.contains(&files[0].rank) {
            continue;
        }
        let mut c = snapshots::compare(&files, ranks_with_series > 1);
        notes.extend(c.notes);
        // A site found leaking per iteration is that leak; the others are added.
        let known: Vec<String> = leaks
            .iter()
            .filter(|l| l.ranks == files[0].rank.into_iter().collect::<Vec<_>>())
            .map(|l| l.site.clone())
            .collect();
        for g in &mut c.snapshots.sites {
            if known.contains(&g.site) {
                g.verdict = snapshots::Verdict::Leak;
            }
        }
        if !c
            .snapshots
            .sites
            .iter()
            .any(|g| g.verdict == snapshots::Verdict::Leak)
        {
            notes.push(format!(
                "{}no leak between {} snapshots of one process",
                c.who,
                files.len()
            ));
        }
        let new: Vec<Leak> = c
            .leaks
            .into_iter()
            .filter(|l| !known.contains(&l.site))
            .collect();
        let per_iteration: Option<i64> = new
            .iter()
            .map(|l| l.bytes_per_iteration)
            .sum::<Option<i64>>()
            .filter(|_| !new.is_empty());
        if let (Some(per), Some(last)) = (per_iteration, files.last()) {
            let used = last.end_point.reserved.max(last.end_point.live);
            let at = "at the last snapshot".to_string();
            creeps.push((files[0].rank, Unit::Iteration.as_str(), per, used, at));
        }
        add_leaks(&mut leaks, new);
        snapshots.push(c.snapshots);
    }
    for (rank, word, per_step, used, at) in creeps {
        let cap = digests
            .iter()
            .filter(|d| d.rank == rank)
            .flat_map(|d| d.capacity.values().copied())
            .max();
        let who = rank.map(|r| format!("rank {r}: ")).unwrap_or_default();
        match cap {
            Some(cap) if per_step > 0 => {
                let n = ((cap - used).max(0) + per_step - 1) / per_step;
                steps_to_oom = Some(steps_to_oom.map_or(n, |s: i64| s.min(n)));
                // Past the horizon the figure says more than the series measured.
                let when = if n > STEPS_HORIZON {
                    format!("not out of memory within the next {STEPS_HORIZON} {word}s")
                } else {
                    format!("out of memory in about {n} {word}s")
                };
                notes.push(format!(
                    "{who}at +{} per {word}, {when} ({} of {} in use {at})",
                    crate::bytes::fmt_bytes(per_step),
                    crate::bytes::fmt_bytes(used),
                    crate::bytes::fmt_bytes(cap),
                ));
            }
            _ => notes.push(format!(
                "{who}the files do not carry the device's capacity \
                 (memsnap.devices[].total_bytes): when the creep runs out of memory cannot be told"
            )),
        }
    }
    leaks.sort_by(|a, b| {
        (a.unit as u8)
            .cmp(&(b.unit as u8))
            .then(b.bytes_per_step.cmp(&a.bytes_per_step))
            .then(a.site.cmp(&b.site))
    });
    // 3, 4. Owners and roles at the moment: the first OOM's file, else the highest peak.
    let focus = first.or_else(|| {
        digests
            .iter()
            .max_by_key(|d| (d.peak_bytes, std::cmp::Reverse(d.file.clone())))
    });
    let (owners, roles, at, sites) = match focus {
        Some(d) => {
            if let Some(h) = &d.instant.helper {
                notes.push(h.clone());
            }
            (
                d.instant.owners.clone(),
                d.instant.roles,
                Some(AtFile {
                    file: d.file.clone(),
                    rank: d.rank,
                    pid: d.pid,
                    moment: d.instant.moment.clone(),
                }),
                d.instant.sites.clone(),
            )
        }
        None => (BTreeMap::new(), None, None, Vec::new()),
    };
    // 5. Ranks side by side.
    let ranks = side_by_side::side_by_side(&digests, &peak_of_rank, &mut notes);
    if several && files > 0 && digests.is_empty() {
        notes.push("no file could be read".into());
    }
    let mut x = Explanation {
        oom,
        leaks,
        iterations: iteration_infos,
        snapshots,
        owners,
        roles,
        ranks,
        notes,
        at,
        files,
        steps_to_oom,
        sites,
    };
    name_helpers(&mut x, &digests);
    x
}

/// The helper of each site that is a helper's calling line, in every list of sites.
fn name_helpers(x: &mut Explanation, digests: &[Digest]) {
    let via: BTreeMap<&str, &str> = digests
        .iter()
        .flat_map(|d| d.via.iter().map(|(s, v)| (s.as_str(), v.as_str())))
        .collect();
    if via.is_empty() {
        return;
    }
    let of = |site: &str| via.get(site).map(|v| v.to_string());
    for l in &mut x.leaks {
        l.via = of(&l.site);
    }
    for g in x.snapshots.iter_mut().flat_map(|s| &mut s.sites) {
        g.via = of(&g.site);
    }
    for d in x.ranks.iter_mut().flat_map(|r| &mut r.differing_sites) {
        d.via = of(&d.site);
    }
}

/// Where several files are explained together, the helpers found in any of them, and the
/// files (their indices) whose sites would differ under them: read those again with the
/// rules returned, so that every file names its sites alike (leaks and ranks compare sites
/// by name). `None` when the files agree already.
pub fn shared_helpers(digests: &[Digest], attr: &Attribution) -> Option<(Attribution, Vec<usize>)> {
    if attr.helpers != HelperRule::Find {
        return None;
    }
    let mut all = Helpers::default();
    for d in digests.iter().filter(|d| d.error.is_none()) {
        all.union(&d.helpers);
    }
    let redo: Vec<usize> = (0..digests.len())
        .filter(|&i| digests[i].error.is_none() && !digests[i].helpers.agrees_with(&all))
        .collect();
    (!redo.is_empty()).then(|| (attr.with_helpers(all), redo))
}

/// A note when the files recorded PyTorch's allocator as different kinds (its blocks in
/// some, its segments only in others): their bytes by site are not the same kind of figure,
/// so the ranks compared below differ by more than their memory.
fn allocator_kinds_differ(digests: &[Digest]) -> Option<String> {
    let groups = owners::by_allocator_kind(digests.iter().map(|d| d.torch_allocator.as_deref()));
    if groups.len() < 2 {
        return None;
    }
    let list: Vec<String> = groups
        .iter()
        .map(|(kind, at)| {
            let who: Vec<String> = at
                .iter()
                .map(|&i| {
                    let d = &digests[i];
                    d.rank
                        .map_or_else(|| d.file.clone(), |r| format!("rank {r}"))
                })
                .collect();
            format!("{kind} in {}", who.join(", "))
        })
        .collect();
    Some(format!(
        "PyTorch's allocator was recorded as different kinds: {}. Where only its segments are \
         recorded, a site is the line that grew the cache, not the tensor's: sites compared \
         across these files are not the same kind of figure",
        list.join("; ")
    ))
}

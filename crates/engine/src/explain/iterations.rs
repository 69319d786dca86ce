//! Iterations found in the record itself, for a history without step boundaries: a
//! program's loop shows as the same allocations (same site, about the same size) coming
//! back at a regular interval. Finds the boundaries between iterations in one device's log
//! of changes ([`EventLog`]), says how it found them and how sure it is, or why it could not.
//!
//! The rule (docs/EXPLAIN.md, "Iterations"): each allocation is a token, its site and its
//! size class (two per power of two). A token that comes back at least
//! [`MIN_OCCURRENCES`] times, spread over at least half of the allocations, with most
//! gaps between its occurrences within a quarter of their median, is a candidate anchor.
//! Each candidate cuts the sequence at its occurrences, 1 to [`MAX_LAG`] occurrences an
//! iteration (an allocation made once per micro-batch comes back twice an iteration); the
//! cut is accepted when consecutive iterations are alike, in their contents (the multiset
//! of tokens) and in their order (tokens at the same place from the start or from the end).
//! The finest accepted cut wins. Sites alone (sizes that vary), then each allocation with
//! the two before it (loops whose every allocation recurs many times an iteration), are
//! tried only when the kind before cut nothing ([`Tokens`]). Cold code.

use super::log::{EventLog, Step};
use memsnap_format::model::StackId;
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::borrow::Cow;

/// Occurrences a recurring allocation needs to be a candidate anchor (and the iterations
/// a history needs, so that the leak rule has its boundaries).
pub const MIN_OCCURRENCES: usize = 4;
/// A gap between two occurrences is regular within this share of the median gap...
const GAP_TOLERANCE: f64 = 0.25;
/// ... and a candidate has at least this share of its gaps regular.
const REGULAR_SHARE: f64 = 2.0 / 3.0;
/// Candidate cuts tried, most promising first.
const MAX_CANDIDATES: usize = 12;
/// Anchors per iteration tried.
pub const MAX_LAG: usize = 8;
/// Pairs of consecutive iterations compared for each lag.
const SAMPLE_PAIRS: usize = 32;
/// The size-weighted mean similarity of compared iterations that an accepted cut reaches.
pub const ACCEPT: f64 = 0.6;
/// Two iterations are alike at this similarity (the lower of contents and order).
pub const ALIKE: f64 = 0.9;
/// Lags whose similarity is within this of the best are as good (the smallest wins).
const LAG_SLACK: f64 = 0.02;
/// Boundaries handed to the leak rule, evenly spread over the iterations (the first and
/// the last kept): its series cost sites times boundaries.
pub const MAX_POINTS: usize = 512;

/// How sure the finding is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Confidence {
    /// At least 8 iterations; 9 in 10 of the compared allocations in pairs alike.
    High,
    /// At least [`MIN_OCCURRENCES`] − 1 iterations; 6 in 10.
    Medium,
    Low,
}

impl Confidence {
    pub fn as_str(self) -> &'static str {
        match self {
            Confidence::High => "high",
            Confidence::Medium => "medium",
            Confidence::Low => "low",
        }
    }
}

/// The iterations of one device's history.
#[derive(Clone, Debug, PartialEq)]
pub struct Found {
    /// Where each boundary is: the state before this change (the number of changes
    /// applied). When the history ends on a whole iteration ([`Found::end_is_boundary`]),
    /// the last one is its end: one iteration's changes (the median) after its start, or
    /// the log's length if sooner.
    pub boundaries: Vec<usize>,
    /// When each iteration starts (its first allocation's time; the end of the history,
    /// a boundary too where it ends on a whole iteration, is not a start).
    pub start_times: Vec<i64>,
    /// Iterations between the first boundary and the last.
    pub iterations: usize,
    /// Medians over the iterations: allocations, history entries and microseconds.
    pub allocations_per_iteration: usize,
    pub entries_per_iteration: i64,
    pub us_per_iteration: i64,
    /// The allocation whose recurrence cut the iterations: its stack and (median) size.
    pub anchor_stack: Option<StackId>,
    pub anchor_bytes: i64,
    /// Times the anchor is allocated in an iteration.
    pub anchors_per_iteration: usize,
    /// What a token was.
    pub tokens: Tokens,
    /// The size-weighted mean similarity of compared consecutive iterations (the lower of
    /// contents and order for each pair).
    pub similarity: f64,
    /// Compared pairs of iterations, and those alike.
    pub compared: usize,
    pub alike: usize,
    pub confidence: Confidence,
    pub end_is_boundary: bool,
}

/// What an allocation is taken as when looking for its recurrence, tried in this order
/// (the next only when the one before cut nothing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tokens {
    /// Its site and size class.
    SiteAndSize,
    /// Its site alone (sizes that vary).
    Site,
    /// It and the two allocations before it, by site and size: for loops in which no single
    /// allocation comes back once an iteration (every one made many times, unevenly).
    Three,
}

impl Tokens {
    pub fn as_str(self) -> &'static str {
        match self {
            Tokens::SiteAndSize => "site and size",
            Tokens::Site => "site",
            Tokens::Three => "three in a row",
        }
    }
}

/// What the search says.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Found(Found),
    /// No allocation came back [`MIN_OCCURRENCES`] times over the history.
    TooShort {
        allocations: usize,
    },
    /// Allocations come back, but not as iterations.
    NoRecurrence {
        allocations: usize,
    },
    /// The log was too long to keep ([`super::log::LOG_MAX`]).
    Truncated,
}

/// One allocation of the log.
#[derive(Clone, Copy)]
struct Alloc {
    /// Its change's position in the log.
    pos: usize,
    stack: Option<StackId>,
    bytes: i64,
    live_before: i64,
    entry: u32,
    time_us: i64,
}

/// Two size classes per power of two: sizes a few percent apart share one.
pub fn size_class(bytes: i64) -> u32 {
    if bytes <= 0 {
        return 0;
    }
    let b = bytes as u64;
    let log2 = 63 - b.leading_zeros();
    let upper_half = if log2 >= 1 { (b >> (log2 - 1)) & 1 } else { 0 };
    log2 * 2 + upper_half as u32 + 1
}

/// Finds the iterations of `log`. `site_of`: a stack's site; `start_live`: live bytes
/// before the first change.
pub fn find(log: &EventLog, site_of: &dyn Fn(Option<StackId>) -> u32, start_live: i64) -> Outcome {
    if log.truncated {
        return Outcome::Truncated;
    }
    let mut allocs: Vec<Alloc> = Vec::new();
    let mut live = start_live;
    for (
        pos,
        Step {
            time_us,
            delta,
            stack,
            entry,
        },
    ) in log.changes().enumerate()
    {
        if delta > 0 {
            allocs.push(Alloc {
                pos,
                stack,
                bytes: delta,
                live_before: live,
                entry,
                time_us,
            });
        }
        live += delta;
    }
    let n = allocs.len();
    if n < 2 * MIN_OCCURRENCES {
        return Outcome::TooShort { allocations: n };
    }
    // Tokens: site and size class; sites alone.
    let sites: Vec<u32> = allocs.iter().map(|a| site_of(a.stack)).collect();
    let mut ids: FxHashMap<(u32, u32), u32> = FxHashMap::default();
    let sized: Vec<u32> = allocs
        .iter()
        .zip(&sites)
        .map(|(a, &s)| {
            let next = ids.len() as u32;
            *ids.entry((s, size_class(a.bytes))).or_insert(next)
        })
        .collect();
    let site_tokens = sites.iter().copied().max().map_or(0, |m| m as usize + 1);
    let mut recurs = false;
    let mut best: Option<Found> = None;
    for kind in [Tokens::SiteAndSize, Tokens::Site, Tokens::Three] {
        // Anchors are looked for among `anchors`; iterations are compared by `compared`.
        let (anchors, count, compared): (Cow<[u32]>, usize, &[u32]) = match kind {
            Tokens::SiteAndSize => (Cow::Borrowed(&sized), ids.len(), &sized),
            Tokens::Site => (Cow::Borrowed(&sites), site_tokens, &sites),
            Tokens::Three => {
                let mut triples: FxHashMap<(u32, u32, u32), u32> = FxHashMap::default();
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    let key = (
                        sized[i],
                        sized[i.saturating_sub(1)],
                        sized[i.saturating_sub(2)],
                    );
                    let next = triples.len() as u32;
                    v.push(*triples.entry(key).or_insert(next));
                }
                (Cow::Owned(v), triples.len(), &sized)
            }
        };
        let (groups, any) = candidates(&anchors, count);
        recurs |= any;
        for group in groups.iter().take(MAX_CANDIDATES) {
            if let Some(f) = judge(&allocs, compared, group, kind, log.changes().len())
                && best.as_ref().is_none_or(|b| better(&f, b))
            {
                best = Some(f);
            }
        }
        if best.is_some() {
            break;
        }
    }
    match best {
        Some(f) => Outcome::Found(f),
        None if recurs => Outcome::NoRecurrence { allocations: n },
        None => Outcome::TooShort { allocations: n },
    }
}

/// The finer cut (more iterations), then the more alike, then the fewer anchors each.
fn better(a: &Found, b: &Found) -> bool {
    let key = |f: &Found| {
        (
            f.iterations,
            (f.similarity * 1000.0) as i64,
            std::cmp::Reverse(f.anchors_per_iteration),
        )
    };
    key(a) > key(b)
}

/// Tokens that recur alike: each with its occurrences (indices into the allocations).
type Group = Vec<(u32, Vec<u32>)>;

/// Tokens that recur regularly, grouped by (occurrences, median gap): the groups most
/// likely to cut iterations first (most tokens agreeing, times their occurrences); and
/// whether any token came back [`MIN_OCCURRENCES`] times at all.
fn candidates(tokens: &[u32], count: usize) -> (Vec<Group>, bool) {
    let n = tokens.len();
    let mut counts = vec![0u32; count];
    for &t in tokens {
        counts[t as usize] += 1;
    }
    // Occurrences of each token, in order (a counting sort).
    let mut start = vec![0usize; count + 1];
    for t in 0..count {
        start[t + 1] = start[t] + counts[t] as usize;
    }
    let mut fill = start.clone();
    let mut at = vec![0u32; n];
    for (i, &t) in tokens.iter().enumerate() {
        at[fill[t as usize]] = i as u32;
        fill[t as usize] += 1;
    }
    let mut groups: FxHashMap<(usize, u32), Group> = FxHashMap::default();
    let mut gaps: Vec<u32> = Vec::new();
    let mut recurs = false;
    for t in 0..count {
        let occ = &at[start[t]..start[t + 1]];
        if occ.len() < MIN_OCCURRENCES {
            continue;
        }
        recurs = true;
        if ((occ[occ.len() - 1] - occ[0]) as usize) * 2 < n {
            continue;
        }
        gaps.clear();
        gaps.extend(occ.windows(2).map(|w| w[1] - w[0]));
        let mid = gaps.len() / 2;
        let median = *gaps.clone().select_nth_unstable(mid).1;
        let tolerance = (median as f64 * GAP_TOLERANCE).max(1.0);
        let regular = gaps
            .iter()
            .filter(|&&g| (g as f64 - median as f64).abs() <= tolerance)
            .count();
        if (regular as f64) < REGULAR_SHARE * gaps.len() as f64 {
            continue;
        }
        groups
            .entry((occ.len(), median))
            .or_default()
            .push((t as u32, occ.to_vec()));
    }
    let mut out: Vec<((usize, u32), Group)> = groups.into_iter().collect();
    out.sort_by(|((ca, ga), a), ((cb, gb), b)| {
        (cb * b.len())
            .cmp(&(ca * a.len()))
            .then(cb.cmp(ca))
            .then(ga.cmp(gb))
            .then(a[0].0.cmp(&b[0].0))
    });
    (out.into_iter().map(|(_, g)| g).collect(), recurs)
}

/// Similarity of two pieces: contents (multiset intersection over the larger) and order
/// (tokens at the same place from the start, or from the end, over the larger).
fn similarity(a: &[u32], b: &[u32], sorted_a: &[u32], sorted_b: &[u32]) -> (f64, f64) {
    let larger = a.len().max(b.len()).max(1) as f64;
    let (mut i, mut j, mut common) = (0, 0, 0usize);
    while i < sorted_a.len() && j < sorted_b.len() {
        match sorted_a[i].cmp(&sorted_b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                common += 1;
                i += 1;
                j += 1;
            }
        }
    }
    let front = a.iter().zip(b).filter(|(x, y)| x == y).count();
    let back = a
        .iter()
        .rev()
        .zip(b.iter().rev())
        .filter(|(x, y)| x == y)
        .count();
    (common as f64 / larger, front.max(back) as f64 / larger)
}

fn median_i(mut v: Vec<i64>) -> i64 {
    if v.is_empty() {
        return 0;
    }
    v.sort_unstable();
    v[(v.len() - 1) / 2]
}

/// `k` indices evenly spread over `0..n` (all of them when `n <= k`).
fn spread(n: usize, k: usize) -> Vec<usize> {
    if n <= k {
        return (0..n).collect();
    }
    (0..k).map(|j| j * (n - 1) / (k - 1)).collect()
}

/// Up to `k` indices of `0..n`, spread without a period of their own (the golden ratio's
/// sequence), so that they cannot fall in step with the program's own.
fn sample(n: usize, k: usize) -> Vec<usize> {
    if n <= k {
        return (0..n).collect();
    }
    let mut v: Vec<usize> = (0..k)
        .map(|j| ((j as f64 * 0.618_033_988_75).fract() * n as f64) as usize)
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// How alike consecutive iterations are when each is `lag` pieces from `starts`: the
/// compared pairs' similarities (the lower of contents and order) and sizes.
fn compare_iterations(tokens: &[u32], starts: &[usize]) -> Vec<(f64, usize)> {
    let unit = |j: usize| &tokens[starts[j]..starts[j + 1]];
    let sorted = |j: usize| {
        let mut v = unit(j).to_vec();
        v.sort_unstable();
        v
    };
    let units = starts.len() - 1;
    let mut cache: FxHashMap<usize, Vec<u32>> = FxHashMap::default();
    sample(units - 1, SAMPLE_PAIRS)
        .into_iter()
        .map(|j| {
            let a = cache.remove(&j).unwrap_or_else(|| sorted(j));
            let b = sorted(j + 1);
            let (c, o) = similarity(unit(j), unit(j + 1), &a, &b);
            cache.insert(j + 1, b);
            (c.min(o), unit(j).len().max(unit(j + 1).len()))
        })
        .collect()
}

/// `starts` without those less than half the median iteration after the one before: an
/// anchor allocated again within one iteration (a warm-up iteration's extra allocations).
fn merge_short(starts: Vec<usize>) -> Vec<usize> {
    let lengths: Vec<i64> = starts.windows(2).map(|w| (w[1] - w[0]) as i64).collect();
    let half = median_i(lengths) as usize / 2;
    let mut out: Vec<usize> = Vec::with_capacity(starts.len());
    for s in starts {
        match out.last() {
            Some(&prev) if s - prev < half => {}
            _ => out.push(s),
        }
    }
    out
}

/// The size-weighted mean of compared similarities, and the size-weighted share alike.
fn weighted(pairs: &[(f64, usize)]) -> (f64, f64) {
    let total: f64 = pairs.iter().map(|p| p.1 as f64).sum::<f64>().max(1.0);
    let mean = pairs.iter().map(|p| p.0 * p.1 as f64).sum::<f64>() / total;
    let alike = pairs
        .iter()
        .filter(|p| p.0 >= ALIKE)
        .map(|p| p.1 as f64)
        .sum::<f64>()
        / total;
    (mean, alike)
}

/// One way to cut: `lag` anchors an iteration, the iterations' starts (indices into the
/// allocations), the compared pairs (similarity, size) and their weighted similarity.
struct Cut {
    lag: usize,
    starts: Vec<usize>,
    pairs: Vec<(f64, usize)>,
    score: f64,
}

/// The iterations one group of candidate tokens cuts, if they are alike.
fn judge(
    allocs: &[Alloc],
    tokens: &[u32],
    group: &Group,
    kind: Tokens,
    changes: usize,
) -> Option<Found> {
    // The anchor: the group's token allocated when the fewest bytes are live (between
    // iterations rather than inside one), the earliest on a tie.
    let mean_live = |occ: &mut dyn Iterator<Item = &u32>| {
        let (mut sum, mut k) = (0.0, 0usize);
        for &i in occ {
            sum += allocs[i as usize].live_before as f64;
            k += 1;
        }
        sum / k.max(1) as f64
    };
    let (_, occ) = group.iter().min_by(|(_, a), (_, b)| {
        mean_live(&mut a.iter())
            .total_cmp(&mean_live(&mut b.iter()))
            .then(a[0].cmp(&b[0]))
    })?;
    // Per number of anchors an iteration (`lag`): the iterations' starts (the phase whose
    // starts hold the fewest bytes) and how alike consecutive iterations are.
    let mut by_lag: Vec<Cut> = Vec::new();
    for lag in 1..=MAX_LAG {
        if occ.len() / lag < MIN_OCCURRENCES {
            break;
        }
        let phase = (0..lag)
            .min_by(|&a, &b| {
                mean_live(&mut occ.iter().skip(a).step_by(lag))
                    .total_cmp(&mean_live(&mut occ.iter().skip(b).step_by(lag)))
            })
            .unwrap_or(0);
        let starts = merge_short(
            occ.iter()
                .skip(phase)
                .step_by(lag)
                .map(|&i| i as usize)
                .collect(),
        );
        if starts.len() < MIN_OCCURRENCES {
            continue;
        }
        let pairs = compare_iterations(tokens, &starts);
        let score = weighted(&pairs).0;
        by_lag.push(Cut {
            lag,
            starts,
            pairs,
            score,
        });
    }
    let top = by_lag.iter().map(|c| c.score).fold(0.0, f64::max);
    let Cut {
        lag,
        starts,
        pairs,
        score,
    } = by_lag.into_iter().find(|c| c.score >= top - LAG_SLACK)?;
    if score < ACCEPT {
        return None;
    }
    let lengths: Vec<i64> = starts.windows(2).map(|w| (w[1] - w[0]) as i64).collect();
    let per_iteration = median_i(lengths) as usize;
    let last = *starts.last()?;
    // The history ends on a whole iteration when the allocations after the last start are
    // one iteration's, alike to the one before.
    let tail = &tokens[last..];
    let before = &tokens[starts[starts.len() - 2]..last];
    let end_is_boundary = {
        let (mut a, mut b) = (tail.to_vec(), before.to_vec());
        a.sort_unstable();
        b.sort_unstable();
        let (c, o) = similarity(tail, before, &a, &b);
        tail.len().abs_diff(per_iteration) * 10 <= per_iteration && c.min(o) >= ALIKE
    };
    let mut boundaries: Vec<usize> = starts.iter().map(|&i| allocs[i].pos).collect();
    if end_is_boundary {
        // The last iteration ends one iteration's changes after its start: what follows in
        // the log (the frees of a process's exit) is no part of it.
        let changes_per_iteration = median_i(
            boundaries
                .windows(2)
                .map(|w| (w[1] - w[0]) as i64)
                .collect(),
        ) as usize;
        boundaries.push(changes.min(boundaries[boundaries.len() - 1] + changes_per_iteration));
    }
    let (_, alike_share) = weighted(&pairs);
    let alike = pairs.iter().filter(|p| p.0 >= ALIKE).count();
    let iterations = boundaries.len() - 1;
    let confidence = if iterations >= 8 && alike_share >= 0.9 {
        Confidence::High
    } else if iterations + 1 >= MIN_OCCURRENCES && alike_share >= 0.6 {
        Confidence::Medium
    } else {
        Confidence::Low
    };
    let anchor = allocs[starts[0]];
    Some(Found {
        boundaries,
        start_times: starts.iter().map(|&i| allocs[i].time_us).collect(),
        iterations,
        allocations_per_iteration: per_iteration,
        entries_per_iteration: median_i(
            starts
                .windows(2)
                .map(|w| allocs[w[1]].entry as i64 - allocs[w[0]].entry as i64)
                .collect(),
        ),
        us_per_iteration: median_i(
            starts
                .windows(2)
                .map(|w| allocs[w[1]].time_us - allocs[w[0]].time_us)
                .collect(),
        ),
        anchor_stack: anchor.stack,
        anchor_bytes: median_i(starts.iter().map(|&i| allocs[i].bytes).collect()),
        anchors_per_iteration: lag,
        tokens: kind,
        similarity: score,
        compared: pairs.len(),
        alike,
        confidence,
        end_is_boundary,
    })
}

/// At most `max` of `boundaries` (their indices), evenly spread, the first and the last
/// kept: the moments the leak rule looks at.
pub fn thin(count: usize, max: usize) -> Vec<usize> {
    spread(count, max.max(2))
}

/// What `explain` says of one file's iterations (`iterations` in `--json`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Info {
    pub file: String,
    pub rank: Option<i64>,
    pub pid: Option<i64>,
    /// The device whose history was cut (the one with the most iterations).
    pub device: Option<i64>,
    pub found: bool,
    pub iterations: Option<usize>,
    pub allocations_per_iteration: Option<usize>,
    pub entries_per_iteration: Option<i64>,
    pub us_per_iteration: Option<i64>,
    /// The allocation whose recurrence cut them: its site and (median) bytes, and how
    /// many times an iteration it is made.
    pub anchor_site: Option<String>,
    pub anchor_bytes: Option<i64>,
    pub anchors_per_iteration: Option<usize>,
    /// What an allocation was taken as: `"site and size"`, `"site"` (sizes varied), or
    /// `"three in a row"` ([`Tokens`]).
    pub tokens: Option<&'static str>,
    /// The size-weighted mean similarity of compared consecutive iterations (the lower of
    /// contents and order for each pair).
    pub similarity: Option<f64>,
    pub compared: Option<usize>,
    pub alike: Option<usize>,
    pub confidence: Option<Confidence>,
    /// Why none were found, and what would let them be.
    pub why_not: Option<String>,
}

/// What would let `explain` tell iterations where the record does not.
pub const WHAT_WOULD_HELP: &str = "step marks (`memsnap.step()`, `MEMSNAP_EVERY`), a longer \
     history (`MEMSNAP_MAX_ENTRIES`), or two dumps of the process given together (`memsnap \
     dump`, SIGUSR1)";

impl Info {
    /// The finding `f` on `device`, its anchor named by `anchor_site`.
    pub fn found(file: &str, device: i64, f: &Found, anchor_site: String) -> Info {
        Info {
            file: file.to_string(),
            device: Some(device),
            found: true,
            iterations: Some(f.iterations),
            allocations_per_iteration: Some(f.allocations_per_iteration),
            entries_per_iteration: Some(f.entries_per_iteration),
            us_per_iteration: Some(f.us_per_iteration),
            anchor_site: Some(anchor_site),
            anchor_bytes: Some(f.anchor_bytes),
            anchors_per_iteration: Some(f.anchors_per_iteration),
            tokens: Some(f.tokens.as_str()),
            similarity: Some((f.similarity * 1000.0).round() / 1000.0),
            compared: Some(f.compared),
            alike: Some(f.alike),
            confidence: Some(f.confidence),
            ..Info::default()
        }
    }

    /// Why the history of `file` (device `device`) gave no iterations.
    pub fn not_found(file: &str, device: Option<i64>, outcome: &Outcome) -> Info {
        let why = match outcome {
            Outcome::TooShort { allocations: 0 } => "its history holds no allocation".to_string(),
            Outcome::TooShort { allocations } => format!(
                "its history is too short: no allocation comes back {MIN_OCCURRENCES} times \
                 in its {allocations} allocations"
            ),
            Outcome::NoRecurrence { allocations } => format!(
                "no allocation of its {allocations} comes back at a regular interval with the \
                 same allocations between"
            ),
            Outcome::Truncated => format!(
                "its history is too long to keep (more than {} allocations and frees)",
                super::log::LOG_MAX
            ),
            Outcome::Found(_) => String::new(),
        };
        Info {
            file: file.to_string(),
            device,
            why_not: Some(why),
            ..Info::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::explain::tests::ev;
    use memsnap_format::model::Action::{Alloc as A, FreeCompleted as F};
    use memsnap_format::model::TraceEntry;

    const MIB: i64 = 1 << 20;

    /// A loop of `iterations`: per iteration the allocations `body` (stack, bytes), each
    /// freed at the end of the iteration unless its stack is in `kept`.
    fn run(
        warm_up: &[(u32, i64)],
        body: &dyn Fn(usize) -> Vec<(u32, i64)>,
        iterations: usize,
        kept: &[u32],
    ) -> Vec<TraceEntry> {
        let mut out: Vec<TraceEntry> = Vec::new();
        let mut addr = 0x1000;
        let alloc = |out: &mut Vec<TraceEntry>, s: u32, b: i64, keep: bool| {
            addr += 0x1000;
            let t = out.len() as i64;
            out.push(ev(A, addr, b, s, t));
            (!keep).then_some((addr, b, s))
        };
        let mut alloc = alloc;
        for &(s, b) in warm_up {
            alloc(&mut out, s, b, true);
        }
        for k in 0..iterations {
            let mut temps = Vec::new();
            for (s, b) in body(k) {
                temps.extend(alloc(&mut out, s, b, kept.contains(&s)));
            }
            for (a, b, s) in temps {
                let t = out.len() as i64;
                out.push(ev(F, a, b, s, t));
            }
        }
        out
    }

    fn found(trace: &[TraceEntry]) -> Outcome {
        let log = EventLog::of(trace);
        find(&log, &|s| s.unwrap_or(999), 0)
    }

    #[test]
    fn a_loop_of_many_allocations_is_cut_where_each_iteration_starts() {
        // 20 iterations of 40 allocations: the input batch, then 10 sites whose sizes
        // repeat within an iteration.
        let body = |_: usize| {
            let mut v = vec![(0, 3 * MIB)];
            v.extend((1..40u32).map(|i| (1 + i % 10, MIB * (1 + (i % 3) as i64))));
            v
        };
        let trace = run(&[(50, 64 * MIB)], &body, 20, &[]);
        let Outcome::Found(f) = found(&trace) else {
            panic!("{:?}", found(&trace))
        };
        assert_eq!(f.allocations_per_iteration, 40);
        assert_eq!(f.anchors_per_iteration, 1);
        assert!(f.end_is_boundary, "{f:?}");
        assert_eq!(f.iterations, 20);
        assert_eq!(f.confidence, Confidence::High);
        // The first boundary is before the first allocation of the loop (the warm-up
        // allocation is change 0).
        assert_eq!(f.boundaries[0], 1);
        assert_eq!(f.anchor_stack, Some(0));
    }

    #[test]
    fn warm_up_sizes_that_vary_and_a_truncated_start_still_cut() {
        // The first iteration allocates more (an optimizer's state); sizes wander by a
        // few percent; the history starts in the middle of an iteration.
        let body = |k: usize| {
            let mut v: Vec<(u32, i64)> = (0..12u32)
                .map(|i| (i, MIB + ((k * 7 + i as usize) % 5) as i64 * 4096))
                .collect();
            if k == 0 {
                v.extend((0..6).map(|i| (20 + i, 8 * MIB)));
            }
            v
        };
        let mut trace = run(&[], &body, 30, &[20, 21, 22, 23, 24, 25]);
        trace.drain(..5);
        let Outcome::Found(f) = found(&trace) else {
            panic!("{:?}", found(&trace))
        };
        assert_eq!(f.allocations_per_iteration, 12);
        assert!(f.iterations >= 28, "{f:?}");
        assert_eq!(f.confidence, Confidence::High);
    }

    #[test]
    fn an_allocation_made_twice_an_iteration_cuts_whole_iterations() {
        // Two micro-batches (the same 5 allocations), then an optimizer step of 1: each
        // micro-batch allocation comes back twice an iteration, almost evenly.
        let body = |_: usize| {
            let mut v: Vec<(u32, i64)> = Vec::new();
            for _ in 0..2 {
                v.extend((0..5u32).map(|i| (i, MIB << i)));
            }
            v.push((7, 3 * MIB));
            v
        };
        let trace = run(&[], &body, 16, &[]);
        let Outcome::Found(f) = found(&trace) else {
            panic!("{:?}", found(&trace))
        };
        assert_eq!(
            (
                f.allocations_per_iteration,
                f.anchors_per_iteration,
                f.iterations
            ),
            (11, 2, 16),
            "{f:?}"
        );
        // 11 allocations and their 11 frees an iteration.
        assert_eq!(f.boundaries[..2], [0, 22], "{f:?}");
    }

    #[test]
    fn too_short_or_random_histories_find_none() {
        let body = |_: usize| (0..6u32).map(|i| (i, MIB)).collect();
        assert_eq!(
            found(&run(&[], &body, 3, &[])),
            Outcome::TooShort { allocations: 18 }
        );
        // Random sites and sizes: nothing recurs as iterations.
        let mut x: u64 = 12345;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let random: Vec<(u32, i64)> = (0..2000)
            .map(|_| ((rnd() % 40) as u32, MIB << (rnd() % 6)))
            .collect();
        let trace = run(&[], &|_| random.clone(), 1, &[]);
        assert!(
            matches!(found(&trace), Outcome::NoRecurrence { allocations: 2000 }),
            "{:?}",
            found(&trace)
        );
    }

    #[test]
    fn a_loop_whose_every_allocation_recurs_unevenly_is_cut_by_three_in_a_row() {
        // 300 allocations an iteration from 12 sites and sizes, in a fixed random order:
        // each comes back about 25 times an iteration at uneven gaps.
        let mut x: u64 = 99;
        let order: Vec<(u32, i64)> = (0..300)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x % 12) as u32, MIB)
            })
            .collect();
        let trace = run(&[], &|_| order.clone(), 10, &[]);
        let Outcome::Found(f) = found(&trace) else {
            panic!("{:?}", found(&trace))
        };
        assert_eq!(f.tokens, Tokens::Three);
        assert_eq!(
            (f.allocations_per_iteration, f.iterations),
            (300, 10),
            "{f:?}"
        );
    }

    #[test]
    fn size_classes_are_two_per_power_of_two() {
        assert_eq!(size_class(MIB), size_class(MIB + MIB / 4));
        assert_ne!(size_class(MIB), size_class(MIB + MIB / 2));
        assert_ne!(size_class(MIB), size_class(2 * MIB));
        assert_eq!(size_class(0), 0);
    }
}

//! Leaks and creep across steps: live bytes by site at step boundaries (one step snapshot
//! per step, or a file's `memsnap.step` marks; else iterations found in the record, or
//! snapshots of one process: [`Unit`]), and the sites that grow step after step.
//!
//! The rule (docs/EXPLAIN.md, "Leaks"): with `n` boundaries (at least [`MIN_POINTS`]), a
//! site leaks when there is a window from boundary `k` to the last one that spans at least
//! half of the intervals (and at least 3), in which at least 3 of 4 intervals grow, the
//! last third of the window still grows, and the site ends higher than it started the
//! window. The earliest such `k` is where the leak starts; bytes per step are the growth
//! over the window divided by its steps. A site that grew for a few steps and then stayed
//! is warm-up (noted, not a leak); reserved bytes that grow while live bytes do not are the
//! caching allocator's own growth (noted). Cold code.

use serde::Serialize;
use std::collections::BTreeMap;

/// Boundaries needed before anything is called a leak.
pub const MIN_POINTS: usize = 4;

/// What the boundaries of a series are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Unit {
    /// Step boundaries: step files, or a file's step marks.
    #[default]
    Step,
    /// Iterations found in a history ([`super::iterations`]).
    Iteration,
    /// The ends of several snapshots of one process, oldest first.
    Snapshot,
}

impl Unit {
    pub fn as_str(self) -> &'static str {
        match self {
            Unit::Step => "step",
            Unit::Iteration => "iteration",
            Unit::Snapshot => "snapshot",
        }
    }

    /// `25 step boundaries`, `25 iteration boundaries`, `5 snapshots`.
    pub fn boundaries(self, n: usize) -> String {
        match self {
            Unit::Snapshot => format!("{n} snapshots"),
            u => format!("{n} {} boundaries", u.as_str()),
        }
    }
}

/// The state at one step boundary.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepPoint {
    pub step: i64,
    /// Live requested bytes by site.
    pub by_site: BTreeMap<String, i64>,
    pub live: i64,
    pub reserved: i64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Leak {
    pub site: String,
    pub bytes_per_step: i64,
    /// Steps the growth spans (last_step − first_step).
    pub steps: i64,
    pub first_step: i64,
    pub last_step: i64,
    pub live_bytes_at_end: i64,
    /// The ranks it was seen on (empty: unknown rank).
    pub ranks: Vec<i64>,
    /// What `bytes_per_step`, `steps`, `first_step` and `last_step` count.
    pub unit: Unit,
    /// Bytes an iteration of the program, where its iterations are known (found in the
    /// record, or counted between snapshots).
    pub bytes_per_iteration: Option<i64>,
    /// The helper the bytes went through, where the site is its calling line.
    pub via: Option<String>,
}

/// What one series of boundaries says.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Found {
    pub leaks: Vec<Leak>,
    /// Warm-up and cache-growth observations, and "no leak across N steps".
    pub notes: Vec<String>,
    pub steps: usize,
}

/// The leak window of one series of values, if any: (start index, bytes per step).
pub fn window(steps: &[i64], v: &[i64]) -> Option<(usize, i64)> {
    let n = v.len();
    if n < MIN_POINTS {
        return None;
    }
    let intervals = n - 1;
    let min_len = (intervals.div_ceil(2)).max(3);
    let k = (0..=intervals - min_len).find(|&k| {
        let w = &v[k..];
        let len = w.len() - 1;
        let grows = w.windows(2).filter(|p| p[1] > p[0]).count();
        let third = (len / 3).max(1);
        grows * 4 >= len * 3 && v[n - 1] > v[n - 1 - third] && v[n - 1] > v[k]
    })?;
    // The leak starts where the growth does: past the flat or falling start of the window.
    let mut k = k;
    while k + 1 < n && v[k + 1] <= v[k] {
        k += 1;
    }
    let span = steps[n - 1] - steps[k];
    (span > 0).then(|| (k, (v[n - 1] - v[k]) / span))
}

/// Leaks, warm-ups and cache growth in a series of boundaries (sorted by step) of `rank`;
/// `name_rank`: notes start with the rank (several ranks have series); `unit`: what the
/// boundaries are.
pub fn find(points: &[StepPoint], rank: Option<i64>, name_rank: bool, unit: Unit) -> Found {
    let mut found = Found {
        steps: points.len(),
        ..Found::default()
    };
    let n = points.len();
    let who = match rank {
        Some(r) if name_rank => format!("rank {r}: "),
        _ => String::new(),
    };
    let word = unit.as_str();
    if n < MIN_POINTS {
        if n > 1 {
            found.notes.push(format!(
                "{who}{}: too few to tell a leak (at least {MIN_POINTS})",
                unit.boundaries(n)
            ));
        }
        return found;
    }
    let steps: Vec<i64> = points.iter().map(|p| p.step).collect();
    let mut sites: Vec<&String> = points.iter().flat_map(|p| p.by_site.keys()).collect();
    sites.sort();
    sites.dedup();
    let mut warm = Vec::new();
    for site in sites {
        let v: Vec<i64> = points
            .iter()
            .map(|p| p.by_site.get(site).copied().unwrap_or(0))
            .collect();
        if let Some((k, per_step)) = window(&steps, &v) {
            found.leaks.push(Leak {
                site: site.clone(),
                bytes_per_step: per_step,
                steps: steps[n - 1] - steps[k],
                first_step: steps[k],
                last_step: steps[n - 1],
                live_bytes_at_end: v[n - 1],
                ranks: rank.into_iter().collect(),
                unit,
                bytes_per_iteration: (unit == Unit::Iteration).then_some(per_step),
                via: None,
            });
        } else if v[n - 1] > v[0] {
            // Grew, then stopped: the last step it grew at.
            let last_growth = (1..n).rev().find(|&i| v[i] > v[i - 1]).unwrap_or(0);
            if last_growth < n - 1 {
                warm.push((v[n - 1], site.clone(), steps[last_growth]));
            }
        }
    }
    found.leaks.sort_by(|a, b| {
        b.bytes_per_step
            .cmp(&a.bytes_per_step)
            .then(a.site.cmp(&b.site))
    });
    let (first, last) = (steps[0], steps[n - 1]);
    if found.leaks.is_empty() {
        found.notes.push(format!(
            "{who}no leak across {} ({word}s {first} to {last})",
            unit.boundaries(n)
        ));
    }
    warm.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    for (reached, site, until) in warm.iter().take(3) {
        found.notes.push(format!(
            "{who}warm-up, not a leak: {site} grew to {} by {word} {until}, then stayed",
            crate::bytes::fmt_bytes(*reached)
        ));
    }
    if found.leaks.is_empty() {
        found.notes.extend(cache_growth(points, &who, unit));
    }
    found
}

/// The note on reserved bytes that grew more than twice as much as live bytes over the
/// series (the caching allocator's own growth), when they did; `who` starts the note.
pub fn cache_growth(points: &[StepPoint], who: &str, unit: Unit) -> Option<String> {
    let (a, b) = (points.first()?, points.last()?);
    let live_growth = b.live - a.live;
    let reserved_growth = b.reserved - a.reserved;
    (reserved_growth > 0 && reserved_growth > 2 * live_growth.max(0)).then(|| {
        format!(
            "{who}reserved bytes grew by {} over {}s {} to {} while live bytes grew by {}: \
             the caching allocator's own growth, not a leak",
            crate::bytes::fmt_bytes(reserved_growth),
            unit.as_str(),
            a.step,
            b.step,
            crate::bytes::fmt_bytes(live_growth)
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: i64 = 1 << 20;

    /// Boundaries 1..=n: `steady` site at 8 MiB, and `f(step)` bytes at `site`.
    fn series(n: i64, site: &str, f: impl Fn(i64) -> i64) -> Vec<StepPoint> {
        (1..=n)
            .map(|step| {
                let mut by_site = BTreeMap::new();
                by_site.insert("steady.py:1 (f)".to_string(), 8 * MIB);
                by_site.insert(site.to_string(), f(step));
                StepPoint {
                    step,
                    live: 8 * MIB + f(step),
                    reserved: 8 * MIB + f(step),
                    by_site,
                }
            })
            .collect()
    }

    #[test]
    fn a_steady_leak_is_found_with_its_rate_and_start() {
        let found = find(
            &series(25, "leak.py:9 (keep)", |s| s * MIB),
            Some(3),
            false,
            Unit::Step,
        );
        assert_eq!(found.leaks.len(), 1, "{found:?}");
        let l = &found.leaks[0];
        assert_eq!(l.site, "leak.py:9 (keep)");
        assert_eq!(l.bytes_per_step, MIB);
        assert_eq!((l.first_step, l.last_step, l.steps), (1, 25, 24));
        assert_eq!(l.live_bytes_at_end, 25 * MIB);
        assert_eq!(l.ranks, [3]);
    }

    #[test]
    fn a_leak_after_warm_up_starts_where_it_starts() {
        // Flat for 10 steps, then 2 MiB a step for 15.
        let found = find(
            &series(25, "late.py:1 (f)", |s| 2 * MIB * (s - 10).max(0)),
            None,
            false,
            Unit::Step,
        );
        let l = &found.leaks[0];
        assert_eq!(l.first_step, 10);
        assert_eq!(l.bytes_per_step, 2 * MIB);
    }

    #[test]
    fn warm_up_and_steady_runs_are_not_leaks() {
        // Grows for 3 steps, then stays.
        let found = find(
            &series(25, "cache.py:4 (warm)", |s| s.min(3) * 4 * MIB),
            None,
            false,
            Unit::Step,
        );
        assert!(found.leaks.is_empty(), "{found:?}");
        assert!(
            found.notes.iter().any(|n| n.contains("warm-up")
                && n.contains("cache.py:4 (warm)")
                && n.contains("grew to 12.0 MiB by step 3")),
            "{:?}",
            found.notes
        );
        let found = find(
            &series(25, "temp.py:1 (f)", |_| MIB),
            None,
            false,
            Unit::Step,
        );
        assert!(found.leaks.is_empty());
        assert!(found.notes[0].contains("no leak across 25 step boundaries (steps 1 to 25)"));
        // Noise that goes up and down is no leak.
        let found = find(
            &series(25, "noise.py:1 (f)", |s| (s % 2) * MIB),
            None,
            false,
            Unit::Step,
        );
        assert!(found.leaks.is_empty(), "{found:?}");
    }

    #[test]
    fn reserved_growth_without_live_growth_is_the_cache() {
        let mut pts = series(10, "temp.py:1 (f)", |_| MIB);
        for (i, p) in pts.iter_mut().enumerate() {
            p.reserved += 20 * MIB * i as i64;
        }
        let found = find(&pts, None, false, Unit::Step);
        assert!(found.leaks.is_empty());
        assert!(
            found
                .notes
                .iter()
                .any(|n| n.contains("caching allocator's own growth"))
        );
    }

    #[test]
    fn too_few_boundaries_say_so() {
        let found = find(
            &series(3, "leak.py:9 (keep)", |s| s * MIB),
            None,
            false,
            Unit::Step,
        );
        assert!(found.leaks.is_empty());
        assert!(found.notes[0].contains("too few"));
    }
}

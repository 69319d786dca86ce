//! The changes of live bytes of one device, in the order the history made them, kept
//! compactly beside its [`History`] during the one pass over a file: what `explain` needs
//! after the pass, once the file's step marks (`external_annotations`, which come after the
//! traces) and the other ranks' OOM times are known: live bytes by stack at each step
//! boundary, live bytes at a given time, and the allocation sequence in which
//! [`super::iterations`] looks for the program's iterations.
//!
//! 24 bytes per `alloc`/`free` entry, at most [`LOG_MAX`] of them (about 100 MB); a longer
//! history is marked truncated and the questions that need it answer `None`. Cold code.

use crate::history::{EndBlock, History};
use memsnap_format::model::{Action, StackId, TraceEntry};
use rustc_hash::FxHashMap;

/// Changes kept per device.
pub const LOG_MAX: usize = 1 << 22;

/// Points kept of a device's live-bytes timeline.
pub const TIMELINE_POINTS: usize = 4096;

/// A stack id no stack has: `None` in [`Change::stack`] (4 bytes instead of an
/// `Option`'s 8, so that the entry's number fits in the same 24 bytes).
const NO_STACK: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Change {
    time_us: i64,
    delta: i64,
    stack: u32,
    /// The entry's number in its device's history (saturated at `u32::MAX`).
    entry: u32,
}

impl Change {
    fn stack(&self) -> Option<StackId> {
        (self.stack != NO_STACK).then_some(self.stack)
    }
}

/// One change as [`EventLog::changes`] hands it out.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Step {
    pub time_us: i64,
    /// Requested bytes: positive for an allocation, negative for a free.
    pub delta: i64,
    /// The allocating stack (for a free, the freed block's).
    pub stack: Option<StackId>,
    pub entry: u32,
}

#[derive(Clone, Debug, Default)]
pub struct EventLog {
    changes: Vec<Change>,
    pub truncated: bool,
}

impl EventLog {
    /// Takes the entry `e` that was just pushed into `h`.
    pub fn push(&mut self, e: &TraceEntry, h: &History) {
        let (delta, stack) = match e.action {
            Action::Alloc => (e.size, e.stack),
            Action::FreeCompleted | Action::Free => (-e.size, h.last_freed_stack()),
            _ => return,
        };
        if self.changes.len() >= LOG_MAX {
            self.truncated = true;
            return;
        }
        self.changes.push(Change {
            time_us: e.time_us,
            delta,
            stack: stack.filter(|&s| s != NO_STACK).unwrap_or(NO_STACK),
            entry: u32::try_from(h.events.saturating_sub(1)).unwrap_or(u32::MAX),
        });
    }

    /// The changes kept, in order.
    pub fn changes(&self) -> impl ExactSizeIterator<Item = Step> + '_ {
        self.changes.iter().map(|c| Step {
            time_us: c.time_us,
            delta: c.delta,
            stack: c.stack(),
            entry: c.entry,
        })
    }

    /// The site of each change, and live bytes by site before the first change (`end`
    /// less every change); `None` when the log was truncated.
    fn start_by_site(
        &self,
        site_of: &dyn Fn(Option<StackId>) -> u32,
        sites: usize,
        end: &[(u32, i64)],
    ) -> Option<(Vec<u32>, Vec<i64>)> {
        if self.truncated {
            return None;
        }
        let site_of_change: Vec<u32> = self.changes.iter().map(|c| site_of(c.stack())).collect();
        let mut start = vec![0i64; sites];
        for &(site, bytes) in end {
            start[site as usize] += bytes;
        }
        for (c, &s) in self.changes.iter().zip(&site_of_change) {
            start[s as usize] -= c.delta;
        }
        Some((site_of_change, start))
    }

    /// How each site's live bytes moved over the log: what it gained over the last half of
    /// the changes, and its largest fall (the most bytes it held at once and freed again:
    /// the temporaries it may hold at any moment). Sites that never moved are left out.
    /// `site_of`, `sites`, `end` as for [`EventLog::varying_by_site`].
    pub fn motion_by_site(
        &self,
        site_of: &dyn Fn(Option<StackId>) -> u32,
        sites: usize,
        end: &[(u32, i64)],
    ) -> Option<Vec<Motion>> {
        let (site_of_change, mut cur) = self.start_by_site(site_of, sites, end)?;
        let mut high = cur.clone();
        let mut fall = vec![0i64; sites];
        let mut moved = vec![false; sites];
        let half = self.changes.len() / 2;
        let mut mid = Vec::new();
        for (i, (c, &s)) in self.changes.iter().zip(&site_of_change).enumerate() {
            if i == half {
                mid = cur.clone();
            }
            let s = s as usize;
            cur[s] += c.delta;
            moved[s] = true;
            high[s] = high[s].max(cur[s]);
            fall[s] = fall[s].max(high[s] - cur[s]);
        }
        if mid.is_empty() {
            mid = cur.clone();
        }
        Some(
            (0..sites)
                .filter(|&s| moved[s])
                .map(|s| Motion {
                    site: s as u32,
                    late_gain: cur[s] - mid[s],
                    largest_fall: fall[s],
                })
                .collect(),
        )
    }

    /// Live bytes by site after the first `positions[k]` changes, for each `k`
    /// (`positions` ascending, at most the number of changes): the total, and the series
    /// of every site whose bytes are not the same at all of those moments (a site that
    /// stays put can neither leak nor warm up). `site_of` names a stack's site (a number
    /// below `sites`); `end`: bytes by site after the last change. `None` when the log was
    /// truncated.
    pub fn varying_by_site(
        &self,
        site_of: &dyn Fn(Option<StackId>) -> u32,
        sites: usize,
        end: &[(u32, i64)],
        positions: &[usize],
    ) -> Option<BySite> {
        let (site_of_change, mut cur) = self.start_by_site(site_of, sites, end)?;
        let mut total: i64 = cur.iter().sum();
        // Per site, (moment, bytes) wherever its bytes at a moment differ from the moment
        // before; `recorded`: its bytes at the latest moment.
        let mut recorded = cur.clone();
        let start = cur.clone();
        let mut touched = vec![false; sites];
        let mut dirty: Vec<u32> = Vec::new();
        let mut moves: FxHashMap<u32, Vec<(usize, i64)>> = FxHashMap::default();
        let mut totals = Vec::with_capacity(positions.len());
        let mut i = 0;
        for (k, &pos) in positions.iter().enumerate() {
            let pos = pos.min(self.changes.len());
            while i < pos {
                let s = site_of_change[i] as usize;
                cur[s] += self.changes[i].delta;
                total += self.changes[i].delta;
                if !touched[s] {
                    touched[s] = true;
                    dirty.push(s as u32);
                }
                i += 1;
            }
            for s in dirty.drain(..) {
                let u = s as usize;
                touched[u] = false;
                if cur[u] != recorded[u] {
                    recorded[u] = cur[u];
                    moves.entry(s).or_default().push((k, cur[u]));
                }
            }
            totals.push(total);
        }
        let n = positions.len();
        let series = moves
            .into_iter()
            .filter_map(|(s, m)| {
                let mut v = Vec::with_capacity(n);
                let mut bytes = start[s as usize];
                let mut next = m.iter().peekable();
                for k in 0..n {
                    if let Some(&(_, b)) = next.next_if(|(at, _)| *at == k) {
                        bytes = b;
                    }
                    v.push(bytes);
                }
                v.iter().any(|b| *b != v[0]).then_some((s, v))
            })
            .collect();
        Some(BySite { totals, series })
    }

    /// The same from a history read whole.
    pub fn of(entries: &[TraceEntry]) -> Self {
        let mut h = History::new(crate::at::At::End);
        let mut log = EventLog::default();
        for e in entries {
            h.push(e);
            log.push(e, &h);
        }
        log
    }

    /// Requested bytes by allocating stack before each of `times` (ascending): after every
    /// change with a time below it. `end`: the snapshot's active blocks (after the last
    /// change). `None` when the log was truncated.
    pub fn by_stack_before(
        &self,
        end: &[EndBlock],
        times: &[i64],
    ) -> Option<Vec<FxHashMap<Option<StackId>, i64>>> {
        if self.truncated {
            return None;
        }
        let mut cur: FxHashMap<Option<StackId>, i64> = FxHashMap::default();
        for b in end {
            *cur.entry(b.stack).or_default() += b.requested;
        }
        for c in &self.changes {
            *cur.entry(c.stack()).or_default() -= c.delta;
        }
        let mut out = Vec::with_capacity(times.len());
        let mut i = 0;
        for &t in times {
            while let Some(c) = self.changes.get(i).filter(|c| c.time_us < t) {
                *cur.entry(c.stack()).or_default() += c.delta;
                i += 1;
            }
            let mut snap = cur.clone();
            snap.retain(|_, b| *b != 0);
            out.push(snap);
        }
        Some(out)
    }

    /// Live (requested) bytes over time: at most [`TIMELINE_POINTS`] (time, bytes after the
    /// change) points, evenly spread over the changes, with the start (time of the first
    /// change, bytes before it). `end_live`: bytes after the last change.
    pub fn timeline(&self, end_live: i64) -> Option<Vec<(i64, i64)>> {
        if self.truncated {
            return None;
        }
        let total: i64 = self.changes.iter().map(|c| c.delta).sum();
        let mut live = end_live - total;
        let Some(first) = self.changes.first() else {
            return Some(Vec::new());
        };
        let every = self.changes.len().div_ceil(TIMELINE_POINTS).max(1);
        let mut out = vec![(first.time_us.saturating_sub(1), live)];
        for (i, c) in self.changes.iter().enumerate() {
            live += c.delta;
            if (i + 1) % every == 0 || i + 1 == self.changes.len() {
                out.push((c.time_us, live));
            }
        }
        Some(out)
    }
}

/// How one site's live bytes moved over a log ([`EventLog::motion_by_site`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Motion {
    pub site: u32,
    pub late_gain: i64,
    pub largest_fall: i64,
}

/// Live bytes by site at several moments ([`EventLog::varying_by_site`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BySite {
    /// Live bytes at each moment.
    pub totals: Vec<i64>,
    /// Per site whose bytes differ between the moments, its bytes at each.
    pub series: FxHashMap<u32, Vec<i64>>,
}

/// Bytes at `time_us` on a timeline: the last point at or before it (the first point's
/// bytes before the timeline starts).
pub fn at_time(timeline: &[(i64, i64)], time_us: i64) -> Option<i64> {
    let first = timeline.first()?;
    let i = timeline.partition_point(|(t, _)| *t <= time_us);
    Some(if i == 0 { first.1 } else { timeline[i - 1].1 })
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::explain::tests::ev as e;

    #[test]
    fn by_stack_before_each_boundary_and_the_timeline() {
        use Action::*;
        // 100 B of stack 9 live before the history; stack 1 allocates 10 per step and
        // keeps it; stack 2 is a temporary within each step.
        let mut entries = Vec::new();
        for step in 0..3i64 {
            let t = 100 * step;
            entries.push(e(Alloc, 10 + step, 10, 1, t + 1));
            entries.push(e(Alloc, 50, 7, 2, t + 2));
            // The free carries no stack of its own here: the history finds it.
            let mut free = e(FreeCompleted, 50, 7, 0, t + 3);
            free.stack = None;
            entries.push(free);
        }
        let log = EventLog::of(&entries);
        let end = [
            EndBlock {
                address: 10,
                requested: 10,
                stack: Some(1),
            },
            EndBlock {
                address: 11,
                requested: 10,
                stack: Some(1),
            },
            EndBlock {
                address: 12,
                requested: 10,
                stack: Some(1),
            },
            EndBlock {
                address: 99,
                requested: 100,
                stack: Some(9),
            },
        ];
        let at = log.by_stack_before(&end, &[0, 100, 200, 300]).unwrap();
        let get = |i: usize, s: u32| at[i].get(&Some(s)).copied().unwrap_or(0);
        assert_eq!(
            (0..4).map(|i| get(i, 1)).collect::<Vec<_>>(),
            [0, 10, 20, 30]
        );
        assert_eq!((0..4).map(|i| get(i, 2)).collect::<Vec<_>>(), [0; 4]);
        assert_eq!((0..4).map(|i| get(i, 9)).collect::<Vec<_>>(), [100; 4]);
        let tl = log.timeline(130).unwrap();
        assert_eq!(at_time(&tl, -5), Some(100));
        assert_eq!(at_time(&tl, 2), Some(117));
        assert_eq!(at_time(&tl, 150), Some(120));
        assert_eq!(at_time(&tl, 1000), Some(130));
    }

    #[test]
    fn bytes_by_site_at_moments_and_how_each_site_moved() {
        use Action::*;
        // Site 1 keeps 10 B an iteration; site 2 holds 50 B within each and frees them;
        // site 3 holds 7 B from before the history to the end.
        let mut entries = Vec::new();
        for k in 0..4i64 {
            entries.push(e(Alloc, 100 + k, 10, 1, 3 * k));
            entries.push(e(Alloc, 50, 50, 2, 3 * k + 1));
            entries.push(e(FreeCompleted, 50, 50, 2, 3 * k + 2));
        }
        let log = EventLog::of(&entries);
        assert_eq!(log.changes().len(), 12);
        assert_eq!(
            log.changes().nth(3).map(|c| (c.delta, c.entry)),
            Some((10, 3))
        );
        let site = |s: Option<StackId>| s.unwrap_or(0);
        let end = [(1, 40), (3, 7)];
        // Before each iteration, and in the middle of the second one.
        let by = log
            .varying_by_site(&site, 4, &end, &[0, 3, 5, 6, 12])
            .unwrap();
        assert_eq!(by.totals, [7, 17, 77, 27, 47]);
        assert_eq!(by.series.get(&1), Some(&vec![0, 10, 20, 20, 40]));
        assert_eq!(by.series.get(&2), Some(&vec![0, 0, 50, 0, 0]));
        assert_eq!(by.series.get(&3), None, "site 3 never moves");
        let mut moved = log.motion_by_site(&site, 4, &end).unwrap();
        moved.sort_by_key(|m| m.site);
        assert_eq!(
            moved,
            [
                Motion {
                    site: 1,
                    late_gain: 20,
                    largest_fall: 0
                },
                Motion {
                    site: 2,
                    late_gain: 0,
                    largest_fall: 50
                },
            ]
        );
    }
}

//! The changes of live bytes of one device, in the order the history made them, kept
//! compactly beside its [`History`] during the one pass over a file: what `explain` needs
//! after the pass, once the file's step marks (`external_annotations`, which come after the
//! traces) and the other ranks' OOM times are known: live bytes by stack at each step
//! boundary, and live bytes at a given time.
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

#[derive(Clone, Copy, Debug)]
struct Change {
    time_us: i64,
    delta: i64,
    stack: Option<StackId>,
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
            stack,
        });
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
            *cur.entry(c.stack).or_default() -= c.delta;
        }
        let mut out = Vec::with_capacity(times.len());
        let mut i = 0;
        for &t in times {
            while let Some(c) = self.changes.get(i).filter(|c| c.time_us < t) {
                *cur.entry(c.stack).or_default() += c.delta;
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
}

//! One forward pass over a device's trace, entry by entry, keeping only what the figures
//! need: running sums for the peaks, counts per API, the allocations made within the
//! history that are still live, and the live set at each OOM. The entries themselves are
//! never kept, so `summary` and `ranks` read a file of any length in the memory of its
//! live set (the reader streams entries straight into [`History::push`]).
//!
//! Cold code; `push` is the CLI's inner loop (one call per entry of the file).
//!
//! Why forward: the state before the first entry is unknown (a capped history starts
//! mid-run), the state after the last one is the snapshot's blocks, and those come from
//! the same file. So the pass keeps *differences* from the start: live bytes after entry
//! `k` are `start + net(k)`, and `start = end - net(n)` once the end is known; the peak
//! is `start + max net(k)`. At an OOM the live set is what the history allocated and did
//! not free yet, plus blocks older than the history: those are either freed later in the
//! history (a free with no matching allocation) or still live at the end.

use crate::tally::Tally;
use memsnap_format::model::{Action, StackId, TraceEntry};
use rustc_hash::FxHashMap;
use std::sync::Arc;

/// What one device's history contributes to the figures.
#[derive(Clone, Debug, Default)]
pub struct History {
    pub events: usize,
    /// Σ `alloc` − Σ `free_completed`/`free` sizes so far, and its maximum (ties: latest).
    net_live: i64,
    best_net_live: i64,
    /// Entry after which the maximum was reached; `None`: before the first.
    best_after: Option<usize>,
    /// The same for segment sizes (reserved bytes).
    net_reserved: i64,
    best_net_reserved: i64,
    /// Entries per `user_metadata` value, keyed by the interned string's address (the
    /// reader shares one `Arc` per distinct value; merged by text in [`History::apis`]).
    apis: FxHashMap<usize, (Arc<str>, usize)>,
    /// Allocations made within the history and not freed yet: address → (bytes, stack).
    live: FxHashMap<i64, (i64, Option<StackId>)>,
    ooms: Vec<OomAt>,
}

/// An `oom` entry and what was live when it happened, as far as known so far.
#[derive(Clone, Debug)]
pub struct OomAt {
    pub event: usize,
    pub requested: i64,
    pub device_free: Option<i64>,
    pub time_us: i64,
    pub stack: Option<StackId>,
    /// `net_reserved` at that moment.
    net_reserved: i64,
    /// Live allocations by allocating stack: those of the history at once, older ones as
    /// they are freed later; [`History::ooms_with_end`] adds the ones still live at the end.
    holders: FxHashMap<Option<StackId>, Tally>,
}

/// A block live in the snapshot itself (after the last entry).
pub struct EndBlock {
    pub address: i64,
    pub requested: i64,
    pub stack: Option<StackId>,
}

/// An OOM with its full live set.
pub struct OomState<'h> {
    pub oom: &'h OomAt,
    pub reserved: i64,
    pub holders: FxHashMap<Option<StackId>, Tally>,
}

impl History {
    /// A history read whole (a file that could not be streamed, or tests).
    pub fn of(entries: &[TraceEntry]) -> Self {
        let mut h = History::default();
        for e in entries {
            h.push(e);
        }
        h
    }

    pub fn push(&mut self, e: &TraceEntry) {
        let i = self.events;
        self.events += 1;
        match e.action {
            Action::Alloc => {
                self.net_live += e.size;
                self.live.insert(e.addr, (e.size, e.stack));
            }
            Action::FreeCompleted | Action::Free => {
                self.net_live -= e.size;
                if self.live.remove(&e.addr).is_none() {
                    // Allocated before the history began: it was live at every OOM so
                    // far. Its own allocation is not recorded; the free's stack stands in.
                    for oom in &mut self.ooms {
                        oom.holders.entry(e.stack).or_default().add(e.size);
                    }
                }
            }
            Action::SegmentAlloc | Action::SegmentMap => self.net_reserved += e.size,
            Action::SegmentFree | Action::SegmentUnmap => self.net_reserved -= e.size,
            Action::Oom => {
                let mut holders: FxHashMap<Option<StackId>, Tally> = FxHashMap::default();
                for &(size, stack) in self.live.values() {
                    holders.entry(stack).or_default().add(size);
                }
                self.ooms.push(OomAt {
                    event: i,
                    requested: e.size,
                    device_free: e.device_free,
                    time_us: e.time_us,
                    stack: e.stack,
                    net_reserved: self.net_reserved,
                    holders,
                });
            }
            _ => {}
        }
        if self.net_live >= self.best_net_live {
            self.best_net_live = self.net_live;
            self.best_after = Some(i);
        }
        self.best_net_reserved = self.best_net_reserved.max(self.net_reserved);
        if let Some(api) = &e.user_metadata {
            let key = Arc::as_ptr(api) as *const u8 as usize;
            self.apis.entry(key).or_insert_with(|| (api.clone(), 0)).1 += 1;
        }
    }

    /// Live bytes before the first entry, given those after the last one.
    pub fn start_live(&self, end_live: i64) -> i64 {
        end_live - self.net_live
    }
    /// The most live bytes at any point (ties: the latest), and the entry after which
    /// that was (`None`: before the first).
    pub fn peak_live(&self, end_live: i64) -> (i64, Option<usize>) {
        (
            self.start_live(end_live) + self.best_net_live,
            self.best_after,
        )
    }
    pub fn start_reserved(&self, end_reserved: i64) -> i64 {
        end_reserved - self.net_reserved
    }
    pub fn peak_reserved(&self, end_reserved: i64) -> i64 {
        self.start_reserved(end_reserved) + self.best_net_reserved
    }

    /// Entries per API (`user_metadata`), most first (ties by name).
    pub fn apis(&self) -> Vec<(&str, usize)> {
        let mut by_text: FxHashMap<&str, usize> = FxHashMap::default();
        for (api, n) in self.apis.values() {
            *by_text.entry(&**api).or_default() += n;
        }
        let mut v: Vec<(&str, usize)> = by_text.into_iter().collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        v
    }

    pub fn has_oom(&self) -> bool {
        !self.ooms.is_empty()
    }

    /// Each OOM with everything live then: the snapshot's own blocks that the history did
    /// not allocate were live all along.
    pub fn ooms_with_end(&self, end: &[EndBlock], end_reserved: i64) -> Vec<OomState<'_>> {
        let older: Vec<&EndBlock> = end
            .iter()
            .filter(|b| !self.live.contains_key(&b.address))
            .collect();
        self.ooms
            .iter()
            .map(|oom| {
                let mut holders = oom.holders.clone();
                for b in &older {
                    holders.entry(b.stack).or_default().add(b.requested);
                }
                OomState {
                    oom,
                    reserved: self.start_reserved(end_reserved) + oom.net_reserved,
                    holders,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(action: Action, addr: i64, size: i64, stack: Option<StackId>) -> TraceEntry {
        TraceEntry {
            action,
            addr,
            size,
            stream: 0,
            time_us: 0,
            stack,
            device_free: None,
            user_metadata: None,
        }
    }

    #[test]
    fn peak_is_found_forward_from_the_end_state() {
        // Before the history 100 B are live (unknown to the pass); it allocates 50 and
        // 30, frees the 50, allocates 10: live 100 → 150 → 180 → 130 → 140 = the end.
        let h = History::of(&[
            e(Action::Alloc, 1, 50, None),
            e(Action::Alloc, 2, 30, None),
            e(Action::FreeCompleted, 1, 50, None),
            e(Action::Alloc, 3, 10, None),
        ]);
        assert_eq!(h.start_live(140), 100);
        assert_eq!(h.peak_live(140), (180, Some(1)));
        // A history that only frees peaks before its first entry.
        let h = History::of(&[e(Action::FreeCompleted, 9, 64, None)]);
        assert_eq!(h.peak_live(0), (64, None));
        // Ties go to the latest moment.
        let h = History::of(&[
            e(Action::Alloc, 1, 8, None),
            e(Action::FreeCompleted, 1, 8, None),
            e(Action::Alloc, 2, 8, None),
        ]);
        assert_eq!(h.peak_live(8), (8, Some(2)));
        assert_eq!(History::default().peak_live(7), (7, None));
    }

    #[test]
    fn oom_live_set_counts_history_and_older_blocks() {
        let h = History::of(&[
            e(Action::SegmentAlloc, 10, 1000, None),
            e(Action::Alloc, 10, 100, Some(1)),
            e(Action::Alloc, 20, 200, Some(2)),
            e(Action::FreeCompleted, 20, 200, Some(9)),
            e(Action::Oom, 0, 5000, Some(3)),
            // Older than the history, freed after the OOM: it was live at the OOM.
            e(Action::FreeCompleted, 30, 300, Some(4)),
            // Allocated after the OOM: not live then.
            e(Action::Alloc, 40, 400, Some(5)),
        ]);
        // The end: block 10 (from the history), 40 (after the OOM), 50 (older, never freed).
        let end = [
            EndBlock {
                address: 10,
                requested: 100,
                stack: Some(1),
            },
            EndBlock {
                address: 40,
                requested: 400,
                stack: Some(5),
            },
            EndBlock {
                address: 50,
                requested: 500,
                stack: Some(6),
            },
        ];
        let ooms = h.ooms_with_end(&end, 3000);
        assert_eq!(ooms.len(), 1);
        let mut held: Vec<(Option<StackId>, i64)> =
            ooms[0].holders.iter().map(|(s, t)| (*s, t.bytes)).collect();
        held.sort();
        assert_eq!(held, [(Some(1), 100), (Some(4), 300), (Some(6), 500)]);
        assert_eq!(ooms[0].oom.requested, 5000);
        // Reserved: 3000 at the end, 1000 of it allocated by the history before the OOM.
        assert_eq!(ooms[0].reserved, 3000);
        assert_eq!(h.start_reserved(3000), 2000);
    }
}

//! One forward pass over a device's trace, entry by entry, keeping only what the figures
//! need: running sums for the peaks, counts per API, the allocations made within the
//! history that are still live, the live set at each OOM, and the live set at the one
//! moment `--at` asks for. The entries themselves are never kept, so `summary` and `ranks`
//! read a file of any length in the memory of its live set (the reader streams entries
//! straight into [`History::push`]).
//!
//! Cold code; `push` is the CLI's inner loop (one call per entry of the file).
//!
//! Why forward: the state before the first entry is unknown (a capped history starts
//! mid-run), the state after the last one is the snapshot's blocks, and those come from
//! the same file. So the pass keeps *differences* from the start: live bytes after entry
//! `k` are `start + net(k)`, and `start = end - net(n)` once the end is known; the peak
//! is `start + max net(k)`. At a moment `k` the live set is what the history allocated up
//! to `k` and did not free by then, plus blocks older than the history: those are either
//! freed later in the history (a free with no matching allocation) or still live at the
//! end.
//!
//! The moment (a [`Mark`]) is followed without a second pass: once it is set, every free
//! of a block that was live then is noted, so at the end the live set then is the history's
//! blocks allocated by the moment and still live, plus the noted frees, plus the older
//! blocks still live. The peak is a moving mark: each new maximum moves it to the current
//! event, where the live set *is* the current one, and forgets the notes.

use crate::at::{At, Kind, Pos, Resolved, fmt_since};
use crate::sites::StackBytes;
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
    /// Allocations made within the history and not freed yet, by address.
    live: FxHashMap<i64, LiveAlloc>,
    ooms: Vec<OomAt>,
    /// Time of the first and of the latest entry.
    first_time_us: Option<i64>,
    last_time_us: i64,
    /// The moment `--at` asks for, followed through the pass.
    mark: Mark,
    /// The last entry that changed live or reserved bytes (alloc, free, segment).
    last_change: Option<usize>,
    /// The allocating stack of the block the latest free released (its own stack when the
    /// allocation is older than the history).
    last_freed_stack: Option<StackId>,
    /// Bytes of the `alloc` entries, by stack (what helpers are found from).
    allocated: StackBytes,
}

/// An allocation of the history: requested bytes, stack, and the entry that made it.
#[derive(Clone, Copy, Debug)]
struct LiveAlloc {
    size: i64,
    stack: Option<StackId>,
    at: usize,
}

/// Frees noted for a mark are kept in a plain list (cleared in O(1) when the peak moves)
/// and folded by stack once the list reaches this length, so memory stays bounded by the
/// distinct stacks however many frees follow the moment.
const FREED_LIST_MAX: usize = 1 << 16;

/// One moment followed through the pass.
#[derive(Clone, Debug, Default)]
struct Mark {
    want: Option<At>,
    /// What the mark is now: the peak until the first OOM for [`At::Auto`].
    kind: Option<Kind>,
    /// `None` until the moment is reached.
    pos: Option<Pos>,
    net_live: i64,
    net_reserved: i64,
    time_us: Option<i64>,
    /// Blocks live at the mark and freed since: (stack, bytes), then folded by stack.
    freed: Vec<(Option<StackId>, i64)>,
    freed_by_stack: FxHashMap<Option<StackId>, Tally>,
}

impl Mark {
    fn new(want: At) -> Self {
        let mut m = Mark {
            want: Some(want),
            ..Mark::default()
        };
        // The peak (and Auto, a peak until an OOM) starts as the state before the first
        // event; a history whose every entry only frees peaks there.
        if matches!(want, At::Peak | At::Auto) {
            m.kind = Some(Kind::Peak);
            m.pos = Some(Pos::BeforeFirst);
        }
        m
    }

    /// Sets the mark at `pos`, with the running sums then; earlier notes no longer apply.
    fn set(&mut self, kind: Kind, pos: Pos, net_live: i64, net_reserved: i64, time: Option<i64>) {
        self.kind = Some(kind);
        self.pos = Some(pos);
        self.net_live = net_live;
        self.net_reserved = net_reserved;
        self.time_us = time;
        self.freed.clear();
        if !self.freed_by_stack.is_empty() {
            self.freed_by_stack.clear();
        }
    }

    /// Whether an allocation made by entry `at` was live at the mark.
    fn holds(&self, at: usize) -> bool {
        matches!(self.pos, Some(Pos::After(m)) if at <= m)
    }

    /// A block live at the mark was freed.
    fn note_free(&mut self, stack: Option<StackId>, size: i64) {
        self.freed.push((stack, size));
        if self.freed.len() >= FREED_LIST_MAX {
            for (stack, size) in self.freed.drain(..) {
                self.freed_by_stack.entry(stack).or_default().add(size);
            }
        }
    }

    fn follows_peak(&self) -> bool {
        self.kind == Some(Kind::Peak)
    }
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

/// The live set at the moment `--at` asked for.
pub struct AtState {
    pub moment: Resolved,
    /// Requested bytes and allocations by allocating stack.
    pub holders: FxHashMap<Option<StackId>, Tally>,
    pub reserved: i64,
}

impl AtState {
    /// Nothing live, at the end (a placeholder until the figures are known).
    pub fn empty() -> Self {
        AtState {
            moment: Resolved::end(),
            holders: FxHashMap::default(),
            reserved: 0,
        }
    }
}

impl History {
    /// A history that follows the moment `at` (`At::End` follows none).
    pub fn new(at: At) -> Self {
        History {
            mark: if at == At::End {
                Mark::default()
            } else {
                Mark::new(at)
            },
            ..History::default()
        }
    }

    /// A history read whole (a file that could not be streamed, or tests).
    pub fn of(entries: &[TraceEntry], at: At) -> Self {
        let mut h = History::new(at);
        for e in entries {
            h.push(e);
        }
        h
    }

    pub fn push(&mut self, e: &TraceEntry) {
        let i = self.events;
        self.events += 1;
        if self.mark.pos.is_none()
            && let Some(At::Time(t)) = self.mark.want
        {
            // The last event at most `t` after the first: the state before this one.
            let first = *self.first_time_us.get_or_insert(e.time_us);
            if e.time_us.saturating_sub(first) > t {
                let pos = i.checked_sub(1).map_or(Pos::BeforeFirst, Pos::After);
                let time = (i > 0).then_some(self.last_time_us);
                self.mark
                    .set(Kind::Time, pos, self.net_live, self.net_reserved, time);
            }
        }
        self.first_time_us.get_or_insert(e.time_us);
        self.last_time_us = e.time_us;
        match e.action {
            Action::Alloc => {
                self.last_change = Some(i);
                self.net_live += e.size;
                self.allocated.add(e.stack, e.size);
                let new = LiveAlloc {
                    size: e.size,
                    stack: e.stack,
                    at: i,
                };
                if let Some(old) = self.live.insert(e.addr, new) {
                    // Allocated twice without a free between: the older one is gone.
                    if self.mark.holds(old.at) {
                        self.mark.note_free(old.stack, old.size);
                    }
                }
            }
            Action::FreeCompleted | Action::Free => {
                self.last_change = Some(i);
                self.net_live -= e.size;
                self.last_freed_stack = e.stack;
                match self.live.remove(&e.addr) {
                    Some(old) => {
                        self.last_freed_stack = old.stack;
                        if self.mark.holds(old.at) {
                            self.mark.note_free(old.stack, old.size);
                        }
                    }
                    None => {
                        // Allocated before the history began: it was live at every OOM so
                        // far and at the mark. Its own allocation is not recorded; the
                        // free's stack stands in.
                        for oom in &mut self.ooms {
                            oom.holders.entry(e.stack).or_default().add(e.size);
                        }
                        if self.mark.pos.is_some() {
                            self.mark.note_free(e.stack, e.size);
                        }
                    }
                }
            }
            Action::SegmentAlloc | Action::SegmentMap => {
                self.last_change = Some(i);
                self.net_reserved += e.size;
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                self.last_change = Some(i);
                self.net_reserved -= e.size;
            }
            Action::Oom => {
                let mut holders: FxHashMap<Option<StackId>, Tally> = FxHashMap::default();
                for a in self.live.values() {
                    holders.entry(a.stack).or_default().add(a.size);
                }
                if self.ooms.is_empty() && matches!(self.mark.want, Some(At::Oom | At::Auto)) {
                    self.mark.set(
                        Kind::Oom,
                        Pos::After(i),
                        self.net_live,
                        self.net_reserved,
                        Some(e.time_us),
                    );
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
            if self.mark.follows_peak() {
                self.mark.set(
                    Kind::Peak,
                    Pos::After(i),
                    self.net_live,
                    self.net_reserved,
                    Some(e.time_us),
                );
            }
        }
        if self.mark.pos.is_none() && self.mark.want == Some(At::Event(i)) {
            self.mark.set(
                Kind::Event,
                Pos::After(i),
                self.net_live,
                self.net_reserved,
                Some(e.time_us),
            );
        }
        self.best_net_reserved = self.best_net_reserved.max(self.net_reserved);
        if let Some(api) = &e.user_metadata {
            let key = Arc::as_ptr(api) as *const u8 as usize;
            self.apis.entry(key).or_insert_with(|| (api.clone(), 0)).1 += 1;
        }
    }

    /// Bytes of the history's `alloc` entries, by stack.
    pub fn allocated(&self) -> &StackBytes {
        &self.allocated
    }

    /// The allocating stack of the block the latest `free`/`free_completed` entry released
    /// (for a caller that follows entries beside this history).
    pub fn last_freed_stack(&self) -> Option<StackId> {
        self.last_freed_stack
    }

    /// The times of the first and the last entry.
    pub fn time_range(&self) -> Option<(i64, i64)> {
        Some((self.first_time_us?, self.last_time_us))
    }

    /// Whether any entry after `event` changed live or reserved bytes: when none did, the
    /// snapshot's own segments and blocks are the state at that event.
    pub fn changed_after(&self, event: usize) -> bool {
        self.last_change.is_some_and(|c| c > event)
    }

    /// [`History::at_with_end`], and the part of its live set that was freed later within
    /// the history (by allocating stack); the rest was still live at the end.
    pub fn at_with_end_split(
        &self,
        end: &[EndBlock],
        end_reserved: i64,
    ) -> (AtState, FxHashMap<Option<StackId>, Tally>) {
        let at = self.at_with_end(end, end_reserved);
        let mut freed = FxHashMap::default();
        if at.moment.pos != Pos::End && self.mark.pos.is_some() {
            freed = self.mark.freed_by_stack.clone();
            for &(stack, size) in &self.mark.freed {
                freed.entry(stack).or_default().add(size);
            }
        }
        (at, freed)
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

    /// Microseconds between the first entry and `time_us`.
    fn since_first(&self, time_us: Option<i64>) -> Option<i64> {
        Some(time_us?.saturating_sub(self.first_time_us?))
    }

    /// The live set at the moment this history followed, given the snapshot's own blocks
    /// (`end`, every active block) and reserved bytes. A moment the history never reached
    /// (an event number past its end, no OOM) gives the end, with the reason.
    pub fn at_with_end(&self, end: &[EndBlock], end_reserved: i64) -> AtState {
        let end_state = |unreached: Option<String>| {
            let mut holders: FxHashMap<Option<StackId>, Tally> = FxHashMap::default();
            for b in end {
                holders.entry(b.stack).or_default().add(b.requested);
            }
            let mut moment = Resolved::end();
            moment.unreached = unreached;
            AtState {
                moment,
                holders,
                reserved: end_reserved,
            }
        };
        let m = &self.mark;
        let span = self.since_first(Some(self.last_time_us));
        if let (None, Some(At::Time(t)), Some(span)) = (m.pos, m.want, span)
            && self.events > 0
            && t == span
        {
            // Exactly the last event's time: the state after it, which is the end's.
            let mut at = end_state(None);
            at.moment = Resolved {
                kind: Kind::Time,
                pos: Pos::After(self.events - 1),
                time_us: Some(self.last_time_us),
                since_first_us: Some(span),
                unreached: None,
            };
            return at;
        }
        let (Some(kind), Some(pos)) = (m.kind, m.pos) else {
            let why = match m.want {
                None | Some(At::End) => None,
                Some(At::Oom) => Some("no OOM in this device's history".to_string()),
                Some(At::Event(n)) => Some(format!(
                    "event {n} is past this device's history ({} events, 0 to {})",
                    self.events,
                    self.events.saturating_sub(1)
                )),
                // Every event is within the time: past the history, whose end is not the
                // moment asked for (the program may have run on for long after it).
                Some(At::Time(t)) => Some(match span {
                    Some(span) if self.events > 0 => format!(
                        "{} is past this device's history, which spans +0.000 s to {} \
                         (events 0 to {})",
                        fmt_since(t),
                        fmt_since(span),
                        self.events - 1
                    ),
                    _ => "this device recorded no events, so no time in its history".to_string(),
                }),
                Some(At::Peak | At::Auto) => None,
            };
            return end_state(why);
        };
        let mut holders = m.freed_by_stack.clone();
        for &(stack, size) in &m.freed {
            holders.entry(stack).or_default().add(size);
        }
        for a in self.live.values() {
            if m.holds(a.at) {
                holders.entry(a.stack).or_default().add(a.size);
            }
        }
        for b in end.iter().filter(|b| !self.live.contains_key(&b.address)) {
            holders.entry(b.stack).or_default().add(b.requested);
        }
        AtState {
            moment: Resolved {
                kind,
                pos,
                time_us: m.time_us,
                since_first_us: self.since_first(m.time_us),
                unreached: None,
            },
            holders,
            reserved: self.start_reserved(end_reserved) + m.net_reserved,
        }
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

    impl History {
        /// A history followed for no moment.
        fn of_all(entries: &[TraceEntry]) -> Self {
            History::of(entries, At::End)
        }
    }

    pub(super) fn e(action: Action, addr: i64, size: i64, stack: Option<StackId>) -> TraceEntry {
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
        let h = History::of_all(&[
            e(Action::Alloc, 1, 50, None),
            e(Action::Alloc, 2, 30, None),
            e(Action::FreeCompleted, 1, 50, None),
            e(Action::Alloc, 3, 10, None),
        ]);
        assert_eq!(h.start_live(140), 100);
        assert_eq!(h.peak_live(140), (180, Some(1)));
        // A history that only frees peaks before its first entry.
        let h = History::of_all(&[e(Action::FreeCompleted, 9, 64, None)]);
        assert_eq!(h.peak_live(0), (64, None));
        // Ties go to the latest moment.
        let h = History::of_all(&[
            e(Action::Alloc, 1, 8, None),
            e(Action::FreeCompleted, 1, 8, None),
            e(Action::Alloc, 2, 8, None),
        ]);
        assert_eq!(h.peak_live(8), (8, Some(2)));
        assert_eq!(History::new(At::End).peak_live(7), (7, None));
    }

    #[test]
    fn oom_live_set_counts_history_and_older_blocks() {
        let h = History::of_all(&[
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

/// The live set at a moment, on histories built by hand.
#[cfg(test)]
mod at_tests {
    use super::*;
    use Action::*;

    fn e(action: Action, addr: i64, size: i64, stack: u32) -> TraceEntry {
        tests::e(action, addr, size, Some(stack))
    }

    fn timed(mut entry: TraceEntry, time_us: i64) -> TraceEntry {
        entry.time_us = time_us;
        entry
    }

    fn end(blocks: &[(i64, i64, u32)]) -> Vec<EndBlock> {
        blocks
            .iter()
            .map(|&(address, requested, stack)| EndBlock {
                address,
                requested,
                stack: Some(stack),
            })
            .collect()
    }

    /// Holders as sorted (stack, bytes, count).
    fn held(state: &AtState) -> Vec<(u32, i64, i64)> {
        let mut v: Vec<(u32, i64, i64)> = state
            .holders
            .iter()
            .map(|(s, t)| (s.unwrap(), t.bytes, t.count))
            .collect();
        v.sort();
        v
    }

    /// A capped history: blocks 0x90 (s5), 0x91 (s6) and 0x99 (s7) are older than it.
    fn capped_history() -> Vec<TraceEntry> {
        vec![
            e(Alloc, 0x10, 100, 1),         // 0: A
            e(Alloc, 0x20, 200, 2),         // 1: B
            e(FreeCompleted, 0x90, 50, 5),  // 2: older, freed before the peak
            e(Alloc, 0x30, 300, 3),         // 3: C -> the peak
            e(FreeCompleted, 0x10, 100, 1), // 4: A freed after the peak
            e(FreeCompleted, 0x91, 70, 6),  // 5: older, freed after the peak
            e(Alloc, 0x40, 50, 4),          // 6: D, after the peak
            e(FreeCompleted, 0x30, 300, 3), // 7: C freed
        ]
    }

    #[test]
    fn the_live_set_at_the_peak_is_exact_on_a_capped_history() {
        let h = History::of(&capped_history(), At::Peak);
        // The end: B, D and the older 0x99 (never freed).
        let blocks = end(&[(0x20, 200, 2), (0x40, 50, 4), (0x99, 400, 7)]);
        let end_live: i64 = 200 + 50 + 400;
        // Older blocks: 50 + 70 + 400 live before the first event.
        assert_eq!(h.start_live(end_live), 520);
        assert_eq!(h.peak_live(end_live), (1070, Some(3)));
        let at = h.at_with_end(&blocks, 0);
        assert_eq!(at.moment.kind, Kind::Peak);
        assert_eq!(at.moment.pos, Pos::After(3));
        // A, B, C of the history; 0x91 (freed later) and 0x99 (still live) from before it;
        // not 0x90 (freed before the peak) nor D (allocated after).
        assert_eq!(
            held(&at),
            [
                (1, 100, 1),
                (2, 200, 1),
                (3, 300, 1),
                (6, 70, 1),
                (7, 400, 1)
            ]
        );
        let total: i64 = at.holders.values().map(|t| t.bytes).sum();
        assert_eq!(total, 1070);
    }

    #[test]
    fn a_later_peak_forgets_what_was_freed_after_the_earlier_one() {
        let h = History::of(
            &[
                e(Alloc, 1, 100, 1),         // peak 100
                e(FreeCompleted, 1, 100, 1), // noted for that peak
                e(Alloc, 2, 150, 2),         // the new peak: only B
                e(FreeCompleted, 2, 150, 2),
            ],
            At::Peak,
        );
        let at = h.at_with_end(&[], 0);
        assert_eq!(at.moment.pos, Pos::After(2));
        assert_eq!(held(&at), [(2, 150, 1)]);
        // A history that only frees peaks before its first event.
        let h = History::of(&[e(FreeCompleted, 9, 64, 3)], At::Peak);
        let at = h.at_with_end(&[], 0);
        assert_eq!(at.moment.pos, Pos::BeforeFirst);
        assert_eq!(held(&at), [(3, 64, 1)]);
    }

    #[test]
    fn the_live_set_at_the_oom_and_the_default_moment() {
        let trace = [
            e(Alloc, 0x1000, 100, 0),
            e(Alloc, 0x2000, 200, 1),
            e(Oom, 0, 5000, 2),
            e(FreeCompleted, 0x1000, 100, 0),
            e(FreeCompleted, 0x5000, 600, 4), // older than the history, live at the OOM
            e(Alloc, 0x3000, 300, 3),
            e(Alloc, 0x4000, 900, 5), // the peak, after the OOM
        ];
        let blocks = end(&[(0x2000, 200, 1), (0x3000, 300, 3), (0x4000, 900, 5)]);
        for want in [At::Oom, At::Auto] {
            let h = History::of(&trace, want);
            let at = h.at_with_end(&blocks, 0);
            assert_eq!((at.moment.kind, at.moment.pos), (Kind::Oom, Pos::After(2)));
            assert_eq!(held(&at), [(0, 100, 1), (1, 200, 1), (4, 600, 1)]);
            // The same set as the OOM's own report.
            let oom = &h.ooms_with_end(&blocks, 0)[0];
            let mut by_oom: Vec<(u32, i64, i64)> = oom
                .holders
                .iter()
                .map(|(s, t)| (s.unwrap(), t.bytes, t.count))
                .collect();
            by_oom.sort();
            assert_eq!(by_oom, held(&at));
        }
        // Without an OOM, Auto is the peak and Oom is not reached: the end, with the reason.
        let no_oom: Vec<TraceEntry> = trace.iter().filter(|x| x.action != Oom).cloned().collect();
        let at = History::of(&no_oom, At::Auto).at_with_end(&blocks, 0);
        assert_eq!((at.moment.kind, at.moment.pos), (Kind::Peak, Pos::After(5)));
        assert_eq!(held(&at), [(1, 200, 1), (3, 300, 1), (5, 900, 1)]);
        let at = History::of(&no_oom, At::Oom).at_with_end(&blocks, 0);
        assert_eq!(at.moment.kind, Kind::End);
        assert_eq!(
            at.moment.unreached.as_deref(),
            Some("no OOM in this device's history")
        );
        assert_eq!(held(&at), [(1, 200, 1), (3, 300, 1), (5, 900, 1)]);
    }

    #[test]
    fn an_event_number_and_a_time_pick_the_state_after_that_event() {
        let trace = [
            timed(e(Alloc, 1, 10, 1), 1_000),
            timed(e(Alloc, 2, 20, 2), 2_000),
            timed(e(FreeCompleted, 1, 10, 1), 5_000),
            timed(e(Alloc, 3, 30, 3), 9_000),
        ];
        let blocks = end(&[(2, 20, 2), (3, 30, 3)]);
        let at = History::of(&trace, At::Event(2)).at_with_end(&blocks, 0);
        assert_eq!(
            (at.moment.kind, at.moment.pos),
            (Kind::Event, Pos::After(2))
        );
        assert_eq!(at.moment.since_first_us, Some(4_000));
        assert_eq!(held(&at), [(2, 20, 1)]);
        // 3.5 ms after the first event: events 0 and 1 (at +0 and +1 ms) happened.
        let at = History::of(&trace, At::Time(3_500)).at_with_end(&blocks, 0);
        assert_eq!((at.moment.kind, at.moment.pos), (Kind::Time, Pos::After(1)));
        assert_eq!(at.moment.since_first_us, Some(1_000));
        assert_eq!(held(&at), [(1, 10, 1), (2, 20, 1)]);
        // Exactly the last event's time: the state after it.
        let at = History::of(&trace, At::Time(8_000)).at_with_end(&blocks, 0);
        assert_eq!((at.moment.kind, at.moment.pos), (Kind::Time, Pos::After(3)));
        assert_eq!(at.moment.unreached, None);
        assert_eq!(held(&at), [(2, 20, 1), (3, 30, 1)]);
        // Past the last event: not reached, the span named (the end is shown only with it).
        let at = History::of(&trace, At::Time(60_000_000)).at_with_end(&blocks, 0);
        assert_eq!(at.moment.kind, Kind::End);
        assert_eq!(
            at.moment.unreached.as_deref(),
            Some(
                "+60.000 s is past this device's history, which spans +0.000 s to +0.008 s \
                 (events 0 to 3)"
            )
        );
        assert_eq!(held(&at), [(2, 20, 1), (3, 30, 1)]);
        // No history at all: no time in it.
        let at = History::of(&[], At::Time(1)).at_with_end(&blocks, 0);
        assert!(
            at.moment
                .unreached
                .as_deref()
                .unwrap()
                .contains("no events"),
            "{:?}",
            at.moment.unreached
        );
        let at = History::of(&trace, At::Event(4)).at_with_end(&blocks, 0);
        assert_eq!(at.moment.kind, Kind::End);
        assert!(
            at.moment
                .unreached
                .as_deref()
                .unwrap()
                .contains("4 events, 0 to 3"),
            "{:?}",
            at.moment.unreached
        );
    }

    #[test]
    fn many_frees_after_the_moment_are_folded_by_stack() {
        let n = FREED_LIST_MAX as i64 + 1000;
        let mut trace: Vec<TraceEntry> = (0..n)
            .map(|i| e(Alloc, i, 1 + i % 2, (i % 3) as u32))
            .collect();
        trace.extend((0..n).map(|i| e(FreeCompleted, i, 1 + i % 2, (i % 3) as u32)));
        let at = History::of(&trace, At::Peak).at_with_end(&[], 0);
        assert_eq!(at.moment.pos, Pos::After(n as usize - 1));
        let mut expected = [(0u32, 0i64, 0i64), (1, 0, 0), (2, 0, 0)];
        for i in 0..n {
            let row = &mut expected[(i % 3) as usize];
            row.1 += 1 + i % 2;
            row.2 += 1;
        }
        assert_eq!(held(&at), expected);
    }

    #[test]
    fn a_block_allocated_twice_without_a_free_is_gone_from_the_later_state_only() {
        let h = History::of(
            &[
                e(Alloc, 7, 100, 1),
                e(Alloc, 8, 10, 2), // the moment
                e(FreeCompleted, 8, 10, 2),
                e(Alloc, 7, 40, 3), // a lost free of the first block at 7
            ],
            At::Event(1),
        );
        let at = h.at_with_end(&end(&[(7, 40, 3)]), 0);
        assert_eq!(at.moment.pos, Pos::After(1));
        assert_eq!(held(&at), [(1, 100, 1), (2, 10, 1)]);
    }
}

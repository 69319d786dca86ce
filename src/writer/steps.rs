//! Step boundaries as the writer sees them: which marks count (the optimizer's until the
//! program marks its own), the recording window (`MEMSNAP_SKIP`, `MEMSNAP_INTERVAL`),
//! `MEMSNAP_EVERY` snapshots, and the `MEMSNAP_STATS` rows written at each step, period and
//! exit. [`StepWindow`] holds the count, the window and those settings.
//!
//! Cold (writer thread).

use super::Writer;
use super::files::Reason;
use crate::channel::event::StepOrigin;

/// The step marks applied, by origin.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MarkOrigins {
    /// Marks of the optimizer step hook counted as steps.
    pub optimizer: u64,
    /// Marks of the program (`memsnap_step()`).
    pub program: u64,
    /// The step the program's marks took over from, when the optimizer's came first.
    pub program_from: Option<u64>,
}

/// What a step mark is to the count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mark {
    /// The end of a step.
    Step,
    /// The program's first mark after the optimizer's: the end of the step the optimizer's
    /// last mark closed, which moves here.
    MovesLast,
}

impl MarkOrigins {
    /// Notes a mark of `origin` after `step` steps. The program's first mark after the
    /// optimizer's is the boundary the optimizer's last one already marked (the program
    /// marks after its optimizer step, or before the next), placed where the program wants
    /// it: from then on the program's marks are its boundaries as if it had marked every
    /// one. (The hook side stops the optimizer's marks at the program's first, so none
    /// comes after it.)
    pub fn note(&mut self, origin: StepOrigin, step: u64) -> Mark {
        match origin {
            StepOrigin::Optimizer => {
                self.optimizer += 1;
                Mark::Step
            }
            StepOrigin::Program => {
                self.program += 1;
                if self.program == 1 && self.optimizer > 0 {
                    self.program_from = Some(step);
                    return Mark::MovesLast;
                }
                Mark::Step
            }
        }
    }

    /// Where the steps came from, as the metadata says it.
    pub fn describe(&self) -> String {
        match (self.optimizer, self.program, self.program_from) {
            (0, 0, _) => "none".to_string(),
            (_, 0, _) => "optimizer".to_string(),
            (0, _, _) => "program".to_string(),
            (_, _, Some(from)) => format!("optimizer, then program from step {from}"),
            (_, _, None) => "optimizer, program".to_string(),
        }
    }
}

/// The step count and what it triggers: the recording window (`MEMSNAP_SKIP`,
/// `MEMSNAP_INTERVAL`) and `MEMSNAP_EVERY` snapshots.
pub(super) struct StepWindow {
    /// Steps completed.
    step: u64,
    /// Where the steps came from (the optimizer, the program).
    marks: MarkOrigins,
    /// Per-device event index where the open recording window began.
    from: Option<Vec<u64>>,
    skip: u64,
    interval: u64,
    every: u64,
}

/// What the end of a step asks of the writer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct StepEnd {
    /// The recording window opens here (`MEMSNAP_SKIP` steps done).
    pub opens_window: bool,
    /// The window's snapshot is due (`MEMSNAP_INTERVAL` steps after it opened).
    pub closes_window: bool,
    /// An `MEMSNAP_EVERY` snapshot is due (none where the window's own is written).
    pub every: bool,
}

impl StepWindow {
    pub fn new(skip: u64, interval: u64, every: u64) -> StepWindow {
        StepWindow {
            step: 0,
            marks: MarkOrigins::default(),
            from: None,
            skip,
            interval,
            every,
        }
    }

    /// Steps completed.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Where the steps came from, as the metadata says it.
    pub fn step_source(&self) -> String {
        self.marks.describe()
    }

    /// Whether the window is open before the first step (`MEMSNAP_SKIP=0`).
    pub fn opens_at_start(&self) -> bool {
        self.skip == 0 && self.interval > 0
    }

    /// Opens the window at `from` (each device's event index), or moves its start there.
    pub fn open(&mut self, from: Vec<u64>) {
        self.from = Some(from);
    }

    /// Closes the window: where it began, for its snapshot.
    pub fn close(&mut self) -> Option<Vec<u64>> {
        self.from.take()
    }

    /// Notes a step mark of `origin` (see [`MarkOrigins::note`]).
    pub fn note_mark(&mut self, origin: StepOrigin) -> Mark {
        self.marks.note(origin, self.step)
    }

    /// Whether the window opened at the boundary that a [`Mark::MovesLast`] moves: it then
    /// opens at the moved one.
    pub fn opened_at_last_boundary(&self) -> bool {
        self.interval > 0 && self.step == self.skip && self.from.is_some()
    }

    /// A step's end: counted, and what it asks for.
    pub fn end_step(&mut self) -> StepEnd {
        self.step += 1;
        let windowed = self.interval > 0;
        let closes_window = windowed && self.step == self.skip + self.interval;
        StepEnd {
            opens_window: windowed && self.step == self.skip,
            closes_window,
            every: self.every > 0 && self.step.is_multiple_of(self.every) && !closes_window,
        }
    }
}

impl Writer {
    /// A step mark of `origin` at `time_us`.
    pub(super) fn on_step_mark(&mut self, origin: StepOrigin, time_us: u64) {
        match self.window.note_mark(origin) {
            Mark::Step => {
                // Marked before the step's own snapshot (MEMSNAP_EVERY) is written, so that
                // file has its closing boundary too.
                self.state.mark_step(self.window.step() + 1, time_us);
                self.on_step()
            }
            Mark::MovesLast => {
                self.state.move_last_step_mark(time_us);
                // A window that opened at that boundary opens here.
                if self.window.opened_at_last_boundary() {
                    self.window.open(self.history_marks());
                }
            }
        }
    }

    /// A step's end: the recording window (SKIP/INTERVAL), EVERY, and stats rows.
    pub(super) fn on_step(&mut self) {
        let end = self.window.end_step();
        if end.opens_window {
            self.window.open(self.history_marks());
        }
        if end.closes_window {
            let from = self.window.close();
            let _ = self.dump_from(Reason::Step, "", from.as_deref());
        }
        if end.every {
            // An EVERY snapshot keeps the full history even while a window is open: only
            // the window's own snapshot is cut to the window.
            let _ = self.dump(Reason::Step, "");
        }
        self.write_stats(Reason::Step);
    }

    pub(super) fn write_stats(&mut self, reason: Reason) {
        if let Some(stats) = &mut self.stats {
            stats.row(self.window.step(), reason, &self.state);
            self.state.reset_peaks();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_programs_first_mark_takes_over_the_optimizers_count() {
        let mut marks = MarkOrigins::default();
        assert_eq!(marks.describe(), "none");
        let mut step = 0;
        for origin in [StepOrigin::Optimizer; 3] {
            assert_eq!(marks.note(origin, step), Mark::Step);
            step += 1;
        }
        assert_eq!(marks.describe(), "optimizer");
        // The third step's program mark is the same boundary; the next ones count.
        assert_eq!(marks.note(StepOrigin::Program, step), Mark::MovesLast);
        assert_eq!(marks.note(StepOrigin::Program, step), Mark::Step);
        assert_eq!(
            (marks.optimizer, marks.program, marks.program_from),
            (3, 2, Some(3))
        );
        assert_eq!(marks.describe(), "optimizer, then program from step 3");
        let mut program_only = MarkOrigins::default();
        assert_eq!(program_only.note(StepOrigin::Program, 0), Mark::Step);
        assert_eq!(program_only.note(StepOrigin::Program, 1), Mark::Step);
        assert_eq!(program_only.describe(), "program");
    }

    #[test]
    fn the_window_opens_after_skip_and_its_snapshot_replaces_that_steps_every() {
        let mut window = StepWindow::new(2, 2, 2);
        assert!(!window.opens_at_start());
        let ends: Vec<(bool, bool, bool)> = (0..6)
            .map(|_| window.end_step())
            .map(|e| (e.opens_window, e.closes_window, e.every))
            .collect();
        let (none, open_every, close) = (
            (false, false, false),
            (true, false, true),
            (false, true, false),
        );
        assert_eq!(
            ends,
            [none, open_every, none, close, none, (false, false, true)]
        );
        assert_eq!(window.step(), 6);
        assert!(StepWindow::new(0, 3, 0).opens_at_start());
    }
}

//! Step boundaries as the writer sees them: which marks count (the optimizer's until the
//! program marks its own), the recording window (`MEMSNAP_SKIP`, `MEMSNAP_INTERVAL`),
//! `MEMSNAP_EVERY` snapshots, and the `MEMSNAP_STATS` rows written at each step, period and
//! exit.
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

impl Writer {
    /// A step mark of `origin` at `time_us`.
    pub(super) fn on_step_mark(&mut self, origin: StepOrigin, time_us: u64) {
        match self.marks.note(origin, self.step) {
            Mark::Step => {
                // Marked before the step's own snapshot (MEMSNAP_EVERY) is written, so that
                // file has its closing boundary too.
                self.state.mark_step(self.step + 1, time_us);
                self.on_step()
            }
            Mark::MovesLast => {
                self.state.move_last_step_mark(time_us);
                // A window that opened at that boundary opens here.
                if self.cfg.interval > 0 && self.step == self.cfg.skip && self.window_from.is_some()
                {
                    self.window_from = Some(self.history_marks());
                }
            }
        }
    }

    /// A step's end: the recording window (SKIP/INTERVAL), EVERY, and stats rows.
    pub(super) fn on_step(&mut self) {
        self.step += 1;
        let (skip, interval) = (self.cfg.skip, self.cfg.interval);
        if interval > 0 {
            if self.step == skip {
                self.window_from = Some(self.history_marks());
            }
            if self.step == skip + interval {
                let _ = self.dump(Reason::Step, "");
                self.window_from = None;
            }
        }
        if self.cfg.every > 0
            && self.step.is_multiple_of(self.cfg.every)
            && !(interval > 0 && self.step == skip + interval)
        {
            // An EVERY snapshot keeps the full history even while a window is open: only
            // the window's own snapshot is cut to the window.
            let window = self.window_from.take();
            let _ = self.dump(Reason::Step, "");
            self.window_from = window;
        }
        self.write_stats(Reason::Step);
    }

    pub(super) fn write_stats(&mut self, reason: Reason) {
        if let Some(stats) = &mut self.stats {
            stats.row(self.step, reason, &self.state);
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
}

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

impl MarkOrigins {
    /// Notes a mark of `origin` after `step` steps: whether it is a step of its own. The
    /// program's first mark after the optimizer's is the boundary the optimizer's last one
    /// already marked (the program marks after its optimizer step, or before the next): it
    /// takes the count over without counting again. (The hook side stops the optimizer's
    /// marks at the program's first, so none comes after it.)
    pub fn counts(&mut self, origin: StepOrigin, step: u64) -> bool {
        match origin {
            StepOrigin::Optimizer => {
                self.optimizer += 1;
                true
            }
            StepOrigin::Program => {
                self.program += 1;
                if self.program == 1 && self.optimizer > 0 {
                    self.program_from = Some(step);
                    return false;
                }
                true
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
    /// `memsnap_step()`: the recording window (SKIP/INTERVAL), EVERY, and stats rows.
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
            assert!(marks.counts(origin, step));
            step += 1;
        }
        assert_eq!(marks.describe(), "optimizer");
        // The third step's program mark is the same boundary; the next ones count.
        assert!(!marks.counts(StepOrigin::Program, step));
        assert!(marks.counts(StepOrigin::Program, step));
        assert_eq!(
            (marks.optimizer, marks.program, marks.program_from),
            (3, 2, Some(3))
        );
        assert_eq!(marks.describe(), "optimizer, then program from step 3");
        let mut program_only = MarkOrigins::default();
        assert!(program_only.counts(StepOrigin::Program, 0));
        assert!(program_only.counts(StepOrigin::Program, 1));
        assert_eq!(program_only.describe(), "program");
    }
}

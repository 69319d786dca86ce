//! `memsnap_step()` as the writer sees it: the recording window (`MEMSNAP_SKIP`,
//! `MEMSNAP_INTERVAL`), `MEMSNAP_EVERY` snapshots, and the `MEMSNAP_STATS` rows written at
//! each step, period and exit.
//!
//! Cold (writer thread).

use super::Writer;
use super::files::Reason;

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

//! The writer's timed work: `MEMSNAP_PERIOD` snapshots.
//!
//! Cold (writer thread).

use std::time::{Duration, Instant};

/// `MEMSNAP_PERIOD`: a snapshot (and a stats row) each period.
pub(super) struct Period {
    /// `None`: off.
    every: Option<Duration>,
    /// When the current period began.
    began: Instant,
}

impl Period {
    pub fn new(every: Option<Duration>) -> Period {
        Period {
            every,
            began: Instant::now(),
        }
    }

    /// Whether the current period is over; the next one begins now if so.
    pub fn due(&mut self) -> bool {
        let Some(every) = self.every else {
            return false;
        };
        if self.began.elapsed() < every {
            return false;
        }
        self.began = Instant::now();
        true
    }
}

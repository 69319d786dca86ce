//! The writer's timed work: `MEMSNAP_PERIOD` snapshots, and the refresh every 100 ms of what
//! the process loaded since (the module table, PyTorch's allocator, the optimizer step hook).
//!
//! Cold (writer thread).

use super::stacks::StackTable;
use crate::process::{allocator_route, modules, step_marks};
use std::time::{Duration, Instant};

/// How often the writer looks for newly loaded libraries for the native unwinder, for
/// PyTorch's allocator to be looked for again, and arms the optimizer step hook's next
/// attempt when one is due.
const MODULE_REFRESH: Duration = Duration::from_millis(100);

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

/// The refresh every [`MODULE_REFRESH`] of what the process may have loaded since.
pub(super) struct Refresh {
    last: Instant,
    /// The loader's count of loads when stream-ordered allocations were last sent looking
    /// for PyTorch's allocator.
    libraries_at_allocator_look: u64,
}

impl Refresh {
    pub fn new() -> Refresh {
        Refresh {
            last: Instant::now(),
            libraries_at_allocator_look: 0,
        }
    }

    /// Every [`MODULE_REFRESH`]: the module table refreshed (libraries loaded since),
    /// PyTorch's allocator looked for again and the optimizer step hook's next attempt
    /// armed where those are due.
    pub fn maintain(&mut self, stacks: &mut StackTable) {
        if self.last.elapsed() < MODULE_REFRESH {
            return;
        }
        self.last = Instant::now();
        stacks.refresh_modules();
        self.allocator_route();
        step_marks::maintain(crate::channel::keep::keep_code_objects);
    }

    /// PyTorch may have been loaded since stream-ordered allocations last looked for its
    /// allocator with nothing found: they look again (`process::allocator_route`).
    fn allocator_route(&mut self) {
        if !allocator_route::stream_allocations_stopped_undecided() {
            return;
        }
        let loaded = modules::libraries_loaded();
        if loaded != self.libraries_at_allocator_look {
            self.libraries_at_allocator_look = loaded;
            allocator_route::look_again_at_stream_allocations();
        }
    }
}

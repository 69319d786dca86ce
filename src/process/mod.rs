//! Process-wide state that the hook side and the writer both read: glibc's real `dlsym`,
//! the loaded-module table, the CPython layouts and the interpreter found at run time, the
//! event clock, and what was decided about PyTorch's caching allocator.
//!
//! The bottom of the library: it imports nothing of it. Hot only in what the hooks load on
//! every call (one module-table pointer, the interpreter's resolved functions: atomic
//! loads); building and refreshing the tables is cold.
//! - [`dlsym`]: glibc's own `dlsym`, found once.
//! - [`modules`]: the table of loaded modules (ranges and unwind sections), rebuilt by the
//!   writer when a hook met an unknown address.
//! - [`cpython`]: CPython's structure layouts and the code-object check value.
//! - [`python`]: the running interpreter: found once, then read by the walker and the writer.
//! - [`clock`]: the event clock (the time-stamp counter or the wall clock, chosen once) and
//!   the writer's conversion of its readings.
//! - [`allocator_route`]: how PyTorch's caching allocator is seen (decided once by the hook
//!   side, read by the writer for each snapshot), and the switch that sets its events aside.
//! - [`step_marks`]: where step boundaries come from (`MEMSNAP_STEPS`, the program's marks,
//!   the optimizer step hook's state).
//! - [`hook_line`]: where the values above that every hooked call reads live: one cache
//!   line.

pub mod allocator_route;
pub mod clock;
pub mod cpython;
pub mod dlsym;
pub mod hook_line;
pub mod modules;
pub mod python;
pub mod step_marks;

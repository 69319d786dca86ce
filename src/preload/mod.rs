//! Everything that runs inside the host process's CUDA calls.
//!
//! Hot. No allocation, lock, panic or extra syscall on the path of a recorded call; the
//! one-time start on the first CUDA event is the only exception.
//! - [`hooks`]: the table of hooked symbols, exported wrappers, routing by pointer.
//! - [`guard`]: the per-thread nesting guard (one allocation, one record).
//! - [`record`]: a call's outcome as an [`event::Event`]; the out-of-memory path.
//! - [`queue`]: the lock-free queue and stack slots to the writer.
//! - [`stack`]: native and Python stack capture.
//! - [`control`]: start, signal, exit, fork, and the `memsnap_*` C API.

pub mod control;
pub mod event;
pub mod ffi;
pub mod guard;
pub mod hooks;
pub mod queue;
pub mod record;
pub mod stack;

#[cfg(test)]
mod no_alloc_tests;

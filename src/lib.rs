//! `libmemsnap.so`: preloaded into a CUDA process, it records every device-memory
//! allocation and free and writes PyTorch memory-snapshot files.
//!
//! The rooms (hot = runs inside the host's CUDA calls; docs/ARCHITECTURE.md has the whole
//! picture and the import arrows):
//! - [`exports`] (front door): every exported symbol, bound to the room that does the work.
//! - [`lifecycle`] (cold): the composition root: starts recording on the first CUDA event,
//!   exit, fork, and the bodies of the `memsnap_*` C API.
//! - [`interpose`] (hot): the hook table and its wrappers, routing, device queries.
//! - [`pytorch`] (cold attach, hot tracker): PyTorch's caching allocator, whose blocks
//!   are reported by a trace tracker memsnap attaches at run time.
//! - [`signals`] (cold): the borrowed signals: libc hooks, the table, the handler.
//! - [`guard`] (hot): the per-thread nesting guard.
//! - [`initial_exec`] (hot): thread-locals reached from the thread pointer, without a call.
//! - [`record`] (hot): a call's outcome as an event, with its stack, on the channel.
//! - [`capture`] (hot): the native and Python stack walkers.
//! - [`prefetch`] (hot): cache hints, for the walks and the channel.
//! - [`writer`] (cold): the one writer thread that owns all recorded state and writes
//!   snapshots.
//! - [`channel`] (hot): what travels from the hook side to the writer: events, the queue,
//!   the stacks each thread has sent, requests and counters.
//! - [`process`] (hot reads, cold builds): process-wide state both sides read: the recording
//!   switch, glibc's `dlsym`, the loaded-module table, the CPython layouts and interpreter.
//! - [`thread_state`] (cold): per-thread state of the hook side, freed at thread exit.
//!
//! The hook side and the writer meet only in `channel/` (events) and `process/`
//! (process-wide state). Nothing imports `lifecycle/` or `interpose/` but this file and the
//! front door, `exports.rs`. The snapshot format and the `MEMSNAP_*` settings live in the
//! `memsnap-format` crate.

pub mod capture;
pub mod channel;
pub mod exports;
pub mod guard;
pub mod initial_exec;
pub mod interpose;
pub mod lifecycle;
pub mod prefetch;
pub mod process;
pub mod pytorch;
pub mod record;
pub mod signals;
pub mod thread_state;
pub mod writer;

pub use memsnap_format as snapshot;
pub use memsnap_format::config;

#[cfg(test)]
mod counting_alloc;
#[cfg(test)]
mod no_alloc_tests;
#[cfg(test)]
mod stack_tests;

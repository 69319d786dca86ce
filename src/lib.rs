//! `libmemsnap.so`: preloaded into a CUDA process, it records every device-memory
//! allocation and free and writes PyTorch memory-snapshot files.
//!
//! The rooms, in the order an event flows through them (hot = runs inside the host's CUDA
//! calls; docs/ARCHITECTURE.md has the whole picture):
//! - [`lifecycle`] (cold): the composition root: starts recording on the first CUDA event,
//!   the dump signal, exit, fork, and the `memsnap_*` C API.
//! - [`interpose`] (hot): symbol lookup, the routing table, the exported wrappers, device
//!   queries, the per-thread nesting guard.
//! - [`pytorch`] (cold attach, hot tracker): PyTorch's caching allocator, whose blocks
//!   are reported by a trace tracker memsnap attaches at run time.
//! - [`record`] (hot): a call's outcome as an event, with its stack, on the channel.
//! - [`capture`] (hot): native and Python stack capture, the loaded-module table, the
//!   CPython layout table.
//! - [`channel`] (hot): the event type, the queue to the writer, the stacks each thread
//!   has sent, and the handshake flags the writer and the hook side share.
//! - [`thread_state`] (cold): per-thread state of the hook side, freed at thread exit.
//! - [`writer`] (cold): the one writer thread that owns all recorded state and writes
//!   snapshots. It never imports interposition, recording or lifecycle.
//!
//! The snapshot format and the `MEMSNAP_*` settings live in the `memsnap-format` crate.

pub mod capture;
pub mod channel;
pub mod guard;
pub mod interpose;
pub mod lifecycle;
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

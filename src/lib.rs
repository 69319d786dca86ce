//! `libmemsnap.so`: preloaded into a CUDA process, it records every device-memory
//! allocation and free and writes PyTorch memory-snapshot files.
//!
//! Map of the crate (hot = runs inside the host's CUDA calls):
//! - [`preload`] (hot): exported hooks, route table, nesting guard, event queue, triggers.
//! - [`writer`] (cold): the one writer thread that owns all state and writes snapshots.
//! - [`snapshot`] (cold, no unsafe): the snapshot model and its pickle encoding.
//! - [`config`] (cold): every `MEMSNAP_*` variable, parsed once.

pub mod config;
pub mod preload;
#[allow(dead_code)] // the reader half is used by the CLI, which shares this module by path
pub mod snapshot;
pub mod writer;

#[cfg(test)]
mod counting_alloc;

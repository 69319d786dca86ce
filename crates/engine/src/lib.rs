//! memsnap's engine: what the commands compute from snapshot files, as plain data, with no
//! printing. The `memsnap` CLI (crates/cli) parses arguments, opens files, calls in here
//! and renders the results (text, JSON through serde, the HTML page, the flame graph).
//!
//! Inputs: [`input`] decodes a snapshot from any `std::io::Read` the caller opened, whole,
//! folded into per-device [`history::History`]s as it streams, or final state only. The
//! engine does not open files or URLs: object stores (S3, GCS, Azure) need an async
//! runtime and an HTTP stack, which stay in the CLI (`crates/cli/src/remote.rs`) with the
//! progress bars, so this crate depends on memsnap-format, serde and rustc-hash only and a
//! new command or tool can take it without them.
//!
//! Modules:
//! - [`bytes`]: the one byte formatter of every report, and size parsing.
//! - [`tally`]: bytes and count of a group; the largest-first order.
//! - [`at`]: `--at` moments, parsed and resolved, and how they are described.
//! - [`history`]: one forward pass over a device's trace (peaks, OOMs, the live set at a
//!   moment).
//! - [`sites`]: allocation sites and owning libraries (`--ignore`, `--callers`).
//! - [`device`]: per-device figures; the live set of every device at a moment.
//! - [`origin`]: which process a file came from (metadata numbers, the rank in its name).
//! - [`summary`], [`diff`], [`ranks`], [`flamegraph`], [`view`], [`explain`], [`whatif`]: each
//!   command's model.
//!
//! Cold code: nothing here runs inside the recorded process.
#![forbid(unsafe_code)]

pub mod at;
pub mod bytes;
pub mod device;
pub mod diff;
pub mod explain;
pub mod flamegraph;
pub mod history;
pub mod input;
pub mod origin;
pub mod ranks;
pub mod sites;
pub mod summary;
pub mod tally;
pub mod view;
pub mod whatif;

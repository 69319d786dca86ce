//! Pickle reader for snapshots: memsnap's own files and PyTorch's (`_dump_snapshot`).
//!
//! Cold code, no unsafe, executes nothing. Layers:
//! - [`parse`] runs the pickle machine (protocols 0–5, plain data only) over untrusted bytes
//!   into an arena of [`Node`]s. Values refer to nodes by index, so an object shared through
//!   the memo (PyTorch shares frame dicts and frame lists) stays one node: that is what lets
//!   the model intern frames and stacks by identity, and what serde-pickle cannot do.
//! - [`read_snapshot`] turns the value into a [`Snapshot`](crate::model::Snapshot). Trace
//!   entries (the bulk of any large file) are converted as soon as they are appended to
//!   their list, and their dict is dropped, so memory stays close to the size of the model
//!   rather than of a generic tree.
//!   A device's list of converted entries is kept as a number range, not one value each.
//! - [`read_snapshot_from`] does the same from a stream, a chunk at a time (an opcode cut by
//!   a chunk's end is run again once the next chunk is in), so the file itself is never held
//!   whole: the CLI's peak memory is the model plus the memo, not the model plus the file.
//! - [`stream_snapshot_from`] also hands each entry out as it is converted instead of
//!   keeping it. The dicts and frame lists it came from go back to the arena for reuse
//!   (a node nothing else can refer to: not memoized, or memoized once and never fetched
//!   or duplicated; its memo slot then names the interned stack, or "gone"), so memory no
//!   longer grows with the history: `summary` of a 1 GB file needs about a tenth of it.
//!
//! Untrusted input: memory stays within a small multiple of the input's size ([`Budget`]);
//! every length is checked against the remaining input before anything is
//! allocated (when streaming, a length past the chunk reads on, at most to the end of the
//! file, before it is checked), every opcode creates at most one node, and nothing recurses over input depth
//! except the conversion of metadata dicts, which is capped. Any problem is a [`ReadError`]
//! with the byte offset (or the key path for shape errors); nothing panics.
//!
//! Files, lowest layer first (each uses only files listed before it): `error`,
//! `arena` (values and nodes), `intern` (frames, stacks, strings), `entry` (one trace
//! entry), `machine` (the pickle machine), `convert` (value to model), `stream` (chunked
//! reading and the public entry points).

mod arena;
mod convert;
mod entry;
mod error;
#[cfg(test)]
mod fixtures;
#[cfg(test)]
pub(crate) mod hostile;
mod intern;
mod machine;
mod stream;

pub use arena::{Encoding, Node, Pickle, Val};

/// The memory budgets that keep a hostile input from costing more than a real snapshot of
/// its size (docs/FORMAT.md, "Reading untrusted files"):
/// - the pickle machine holds at most [`Budget::FLOOR_VALUES`] values plus one per
///   [`Budget::BYTES_PER_VALUE`] bytes read (arena nodes and stack entries: about 50 bytes
///   each). Real snapshots, PyTorch's and memsnap's, need one per 11 to 35 bytes; 100 MB of
///   empty-list opcodes needed one per byte.
/// - metadata (`memsnap`, `allocator_settings`, unknown keys) is expanded into at most
///   [`Budget::METADATA_BYTES`]: a list shared by reference can stand for a billion copies
///   of itself in a few hundred bytes of pickle, and expanding it is where the memory went.
/// - the model (every device list's trace entries, segments, blocks, frames with their
///   strings, `user_metadata` strings) is at most [`Budget::MODEL_FLOOR`] bytes plus
///   [`Budget::MODEL_PER_BYTE`] per byte read. A trace list, block list or string stored
///   once and referenced many times through the memo is counted once per reference, since
///   that is what the model holds. PyTorch's fixtures need 0.7 to 1.6 bytes of model per
///   byte of file, memsnap's own about 2.7.
pub struct Budget;

impl Budget {
    pub const FLOOR_VALUES: usize = 1 << 20;
    pub const BYTES_PER_VALUE: usize = 4;
    pub const METADATA_BYTES: usize = 16 << 20;
    pub const MODEL_FLOOR: usize = 16 << 20;
    pub const MODEL_PER_BYTE: usize = 16;

    /// The model bytes allowed once `read` bytes of input are read.
    pub fn model_limit(read: usize) -> usize {
        Self::MODEL_FLOOR.saturating_add(read.saturating_mul(Self::MODEL_PER_BYTE))
    }
}
pub use error::ReadError;
pub use machine::parse;
pub use stream::{
    Streamed, TraceSink, read_snapshot, read_snapshot_encoding_from, read_snapshot_from,
    read_snapshot_with_progress, stream_snapshot_from,
};

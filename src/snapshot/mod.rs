//! PyTorch's memory-snapshot format: the model, a pickle encoder that follows the
//! producer's checklist (reference/snapshot-format.md §0), a reader for memsnap's and
//! PyTorch's files, and a validity checker. No unsafe, no CUDA, no threads.
#![forbid(unsafe_code)]

pub mod check;
pub mod model;
pub mod pickle_read;
pub mod pickle_write;

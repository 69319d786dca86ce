//! PyTorch's memory-snapshot format as memsnap writes and reads it (docs/FORMAT.md): the
//! model, a pickle encoder that follows the producer's rules, a reader for memsnap's and
//! PyTorch's files, a validity checker, and the `MEMSNAP_*` settings with the file-naming
//! rules that the recorder and the CLI share. Cold code: no unsafe, no CUDA, no threads.
#![forbid(unsafe_code)]

pub mod ack;
pub mod check;
pub mod config;
pub mod live;
pub mod model;
pub mod pickle_read;
pub mod pickle_write;
pub mod text;

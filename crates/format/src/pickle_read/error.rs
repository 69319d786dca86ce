//! [`ReadError`], what every layer of the reader fails with, and the byte-offset shift that
//! makes a chunk's errors read as the whole file's.

use thiserror::Error;

/// Why a file could not be read.
#[derive(Debug, Error, PartialEq)]
#[non_exhaustive]
pub enum ReadError {
    #[error("empty file: not a pickle")]
    Empty,
    #[error(
        "not a pickle snapshot: it starts with \"{start}\", not a pickle protocol header (0x80){hint}"
    )]
    NotPickle { start: String, hint: &'static str },
    #[error("truncated at byte {offset}: {what} needs {need} bytes, {left} left")]
    Truncated {
        offset: usize,
        what: &'static str,
        need: u64,
        left: usize,
    },
    #[error("unknown pickle opcode 0x{opcode:02x} at byte {offset} (not a pickle, or corrupt)")]
    UnknownOpcode { offset: usize, opcode: u8 },
    #[error(
        "pickle opcode {name} at byte {offset} builds a Python object: memsnap reads plain data only and executes nothing"
    )]
    Forbidden { offset: usize, name: &'static str },
    #[error("unsupported pickle protocol {version} at byte {offset}")]
    Protocol { offset: usize, version: u8 },
    #[error("corrupt pickle at byte {offset}: {msg}")]
    Corrupt { offset: usize, msg: String },
    #[error("memo index {index} used at byte {offset} was never stored")]
    BadMemo { offset: usize, index: u64 },
    #[error("pickle ends at byte {offset} without STOP (truncated file?)")]
    NoStop { offset: usize },
    #[error("cannot read the file at byte {offset}: {msg}")]
    Io { offset: usize, msg: String },
    #[error("not a memory snapshot: {path}: {msg}")]
    Shape { path: String, msg: String },
    /// The input would take more memory than any real snapshot of its size: a memory
    /// budget (see [`Budget`](super::Budget)) was reached.
    #[error(
        "not a memory snapshot: {what}{} exceeds memsnap's budget of {limit} for this input ({why})",
        at_byte(.offset)
    )]
    Budget {
        /// Where the pickle machine stopped; `None` for a limit met after parsing.
        offset: Option<usize>,
        what: String,
        limit: String,
        why: &'static str,
    },
    /// The model would outgrow [`Budget::model_limit`](super::Budget::model_limit): the
    /// file refers to the same lists or strings so many times that expanding them takes
    /// far more memory than any real snapshot of its size.
    #[error(
        "refusing the file: it expands to more than {per_byte} times its size (plus {floor_mib} MiB) through shared references ({what})"
    )]
    Expands {
        /// What was being expanded: "trace entries", "segments and blocks", "frames", ...
        what: &'static str,
        per_byte: usize,
        floor_mib: usize,
    },
    /// Only from [`stream_snapshot_from`](super::stream_snapshot_from): the file needs an
    /// entry it already handed out.
    #[error("cannot stream this snapshot: {why}; read it whole instead")]
    NeedsFullRead { why: &'static str },
}

pub(super) type Result<T> = std::result::Result<T, ReadError>;

fn at_byte(offset: &Option<usize>) -> String {
    offset.map_or_else(String::new, |o| format!(" at byte {o}"))
}

impl ReadError {
    /// The same error with byte offsets moved by `base` (errors of a chunk that starts
    /// at byte `base` of the file).
    pub(super) fn shifted(mut self, base: usize) -> Self {
        match &mut self {
            ReadError::Truncated { offset, .. }
            | ReadError::UnknownOpcode { offset, .. }
            | ReadError::Forbidden { offset, .. }
            | ReadError::Protocol { offset, .. }
            | ReadError::Corrupt { offset, .. }
            | ReadError::BadMemo { offset, .. }
            | ReadError::NoStop { offset }
            | ReadError::Io { offset, .. }
            | ReadError::Budget {
                offset: Some(offset),
                ..
            } => *offset += base,
            ReadError::Empty
            | ReadError::NotPickle { .. }
            | ReadError::Shape { .. }
            | ReadError::Budget { offset: None, .. }
            | ReadError::Expands { .. }
            | ReadError::NeedsFullRead { .. } => {}
        }
        self
    }
}

//! Decoding a snapshot from bytes already opened by the caller: whole, folded into
//! per-device [`History`]s as it streams, or final state only. Where the bytes come from
//! (a local file, a `file://` URL, an object store) and how progress is shown is the
//! caller's business: the engine takes any [`Read`], so it links no network, async or
//! terminal code. Cold code.
//!
//! Each reader takes `progress`, called with the bytes consumed so far.

use crate::at::At;
use crate::history::History;
use crate::sites::StackBytes;
use memsnap_format::model::{Snapshot, TraceEntry};
use memsnap_format::pickle_read::{self, ReadError};
use std::io::Read;

/// Reads and decodes one snapshot, history included (for `view`, `check`).
///
/// The bytes are streamed through the decoder a chunk at a time rather than held whole:
/// the pickle is decoded front to back once, so holding the whole file would only add its
/// size to the peak memory.
pub fn read_whole(
    file: &mut dyn Read,
    progress: &mut dyn FnMut(usize),
) -> Result<Snapshot, ReadError> {
    pickle_read::read_snapshot_from(file, progress)
}

/// A snapshot whose histories were folded as they were read, never held.
pub struct Summarized {
    /// Everything but the entries (`device_traces` lists are empty).
    pub snap: Snapshot,
    /// One per device ordinal.
    pub histories: Vec<History>,
}

impl Summarized {
    /// The same from a snapshot read whole (its entries are folded here, and kept).
    pub fn of_whole(snap: Snapshot, at: At) -> Self {
        let histories = snap
            .device_traces
            .iter()
            .map(|t| History::of(t, at))
            .collect();
        Summarized { snap, histories }
    }

    /// What each stack allocated, as far as the file records ([`StackBytes`]).
    pub fn stack_bytes(&self) -> StackBytes {
        StackBytes::of_file(&self.snap, self.histories.iter().map(History::allocated))
    }
}

/// A snapshot's final state (its history decoded, not kept), and what its stacks allocated.
pub struct FinalState {
    pub snap: Snapshot,
    pub bytes: StackBytes,
}

/// Reads a snapshot for `summary`, `ranks`, and the commands asked for a moment (`--at`):
/// each trace entry goes into its device's [`History`], which follows the moment `at`, as
/// it is decoded and is dropped, so memory follows the live set and the distinct stacks,
/// not the length of the history.
///
/// `Ok(None)`: the file refers back to an entry (no known writer does), so it cannot be
/// streamed; read it again with [`read_whole`] and [`Summarized::of_whole`].
pub fn read_summarized(
    file: &mut dyn Read,
    progress: &mut dyn FnMut(usize),
    at: At,
) -> Result<Option<Summarized>, ReadError> {
    Ok(read_summarized_with(file, progress, at, &mut |_, _, _| {})?.map(|(s, _)| s))
}

/// [`read_summarized`], and each entry also handed to `beside` with its list's number
/// (in the order the lists were first seen) and its device's [`History`] just after the
/// entry went in (for [`History::last_freed_stack`]). Returns, with the snapshot, the
/// device ordinal of each list number (`None`: a list that is no device's).
#[allow(clippy::type_complexity)]
pub fn read_summarized_with(
    file: &mut dyn Read,
    progress: &mut dyn FnMut(usize),
    at: At,
    beside: &mut dyn FnMut(usize, &TraceEntry, &History),
) -> Result<Option<(Summarized, Vec<Option<usize>>)>, ReadError> {
    let mut by_list: Vec<(u32, History)> = Vec::new();
    let streamed = pickle_read::stream_snapshot_from(file, progress, &mut |list, entry| {
        // A file has one list per device: a short scan beats hashing per entry.
        let i = match by_list.iter().position(|(l, _)| *l == list) {
            Some(i) => i,
            None => {
                by_list.push((list, History::new(at)));
                by_list.len() - 1
            }
        };
        let h = &mut by_list[i].1;
        h.push(&entry);
        beside(i, &entry, h);
    });
    let streamed = match streamed {
        Ok(s) => s,
        Err(ReadError::NeedsFullRead { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    let device_of_list = by_list
        .iter()
        .map(|(l, _)| streamed.trace_lists.iter().position(|x| x == l))
        .collect();
    let histories = streamed
        .trace_lists
        .iter()
        .map(|l| {
            by_list
                .iter()
                .find(|(list, _)| list == l)
                .map(|(_, h)| h.clone())
                .unwrap_or_else(|| History::new(at))
        })
        .collect();
    Ok(Some((
        Summarized {
            snap: streamed.snapshot,
            histories,
        },
        device_of_list,
    )))
}

/// Reads a snapshot for commands that only need its final state (`diff`, `flamegraph`):
/// the history is decoded (that is how a pickle is read) and only the bytes each stack
/// allocated are kept of it. `Ok(None)` as for [`read_summarized`].
pub fn read_final_state(
    file: &mut dyn Read,
    progress: &mut dyn FnMut(usize),
) -> Result<Option<FinalState>, ReadError> {
    let mut bytes = StackBytes::default();
    match pickle_read::stream_snapshot_from(file, progress, &mut |_, e| bytes.add_entry(&e)) {
        Ok(s) => {
            bytes.add_end_blocks(&s.snapshot);
            Ok(Some(FinalState {
                snap: s.snapshot,
                bytes,
            }))
        }
        Err(ReadError::NeedsFullRead { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

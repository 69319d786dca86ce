//! Reading from a stream a chunk at a time, and the public ways in: [`read_snapshot`] and
//! [`read_snapshot_from`] keep every trace entry; [`stream_snapshot_from`] hands each to a
//! [`TraceSink`] instead and fails with [`ReadError::NeedsFullRead`] on a file that refers
//! back to one it already handed out.

use super::arena::Encoding;
use super::convert::to_snapshot;
use super::error::{ReadError, Result};
use super::machine::{Machine, MachineState, Mode};
use crate::model::{Snapshot, TraceEntry};

/// Reads a memory snapshot (memsnap's or PyTorch's).
pub fn read_snapshot(bytes: &[u8]) -> Result<Snapshot> {
    read_snapshot_with_progress(bytes, &mut |_| {})
}

/// Like [`read_snapshot`], calling `progress(bytes_done)` every few MiB.
pub fn read_snapshot_with_progress(
    bytes: &[u8],
    progress: &mut dyn FnMut(usize),
) -> Result<Snapshot> {
    read_snapshot_from(&mut &bytes[..], progress)
}

/// Reads a snapshot from a stream (a file) a chunk at a time, so the file is never
/// held in memory whole: only the decoded model, the memo and the current chunk are.
/// Errors and their offsets are the same as for [`read_snapshot`] on the whole file.
pub fn read_snapshot_from(
    input: &mut dyn std::io::Read,
    progress: &mut dyn FnMut(usize),
) -> Result<Snapshot> {
    read_chunked(input, READ_CHUNK, progress, None).map(|(s, _)| s.snapshot)
}

/// Like [`read_snapshot_from`], with what the model does not keep of the file: its
/// encoding and its malformed frames (for `memsnap check`).
pub fn read_snapshot_encoding_from(
    input: &mut dyn std::io::Read,
    progress: &mut dyn FnMut(usize),
) -> Result<(Snapshot, Encoding)> {
    read_chunked(input, READ_CHUNK, progress, None).map(|(s, e)| (s.snapshot, e))
}

/// A snapshot read by [`stream_snapshot_from`]: everything but the trace entries.
#[derive(Debug, PartialEq)]
pub struct Streamed {
    /// `device_traces` holds one empty list per device: the entries went to the sink.
    pub snapshot: Snapshot,
    /// For each device, the list number its entries were handed out with.
    pub trace_lists: Vec<u32>,
}

/// Receives each trace entry once, in file order, with the number of the list it was
/// appended to (a device's entries all share one number, see [`Streamed::trace_lists`]).
pub type TraceSink<'a> = &'a mut dyn FnMut(u32, TraceEntry);

/// Reads a snapshot without keeping its history: each trace entry goes to `sink` as soon
/// as it is decoded and is then dropped, and so are the dicts and frame lists it came
/// from. Memory is the segments, the distinct frames and stacks, and 4 bytes of memo per
/// memoized object, whatever the length of the history.
///
/// A file that refers back to a trace entry already handed out (no known writer does)
/// fails with [`ReadError::NeedsFullRead`]: read it with [`read_snapshot_from`] instead.
pub fn stream_snapshot_from(
    input: &mut dyn std::io::Read,
    progress: &mut dyn FnMut(usize),
    sink: TraceSink<'_>,
) -> Result<Streamed> {
    read_chunked(input, READ_CHUNK, progress, Some(sink)).map(|(s, _)| s)
}

/// Bytes read from the stream at a time (more when one opcode needs more).
const READ_CHUNK: usize = 8 << 20;

/// Appends up to `want` bytes of `input` to `buf`; true when the input is exhausted.
fn fill(input: &mut dyn std::io::Read, buf: &mut Vec<u8>, want: usize, at: usize) -> Result<bool> {
    buf.reserve(want.min(READ_CHUNK));
    let mut limited = std::io::Read::take(&mut *input, want as u64);
    let got = std::io::Read::read_to_end(&mut limited, buf).map_err(|e| ReadError::Io {
        offset: at,
        msg: e.to_string(),
    })?;
    Ok(got < want)
}

fn read_chunked(
    input: &mut dyn std::io::Read,
    chunk: usize,
    progress: &mut dyn FnMut(usize),
    mut sink: Option<TraceSink<'_>>,
) -> Result<(Streamed, Encoding)> {
    let chunk = chunk.max(1);
    let mut buf = Vec::new();
    let mut eof = fill(input, &mut buf, chunk.max(16), 0)?;
    // Every snapshot writer (Python protocol 2+, the C++ pickler, memsnap) starts with
    // PROTO; checking it first turns "memo index never stored" on a text file into a
    // message that says what the file is not.
    match buf.first() {
        None => return Err(ReadError::Empty),
        Some(0x80) => {}
        Some(_) => {
            let start =
                crate::text::escape_controls(&String::from_utf8_lossy(&buf[..buf.len().min(12)]))
                    .into_owned();
            let hint = if buf.starts_with(&[0x1f, 0x8b]) {
                " (gzip-compressed: gunzip it first)"
            } else {
                ""
            };
            return Err(ReadError::NotPickle { start, hint });
        }
    }
    let mut base = 0usize;
    let mode = if sink.is_some() {
        Mode::Stream
    } else {
        Mode::Keep
    };
    let mut state = MachineState::new(mode);
    loop {
        let mut m = Machine::resume(&buf, base, eof, state);
        let ran = m.run(progress);
        if let Some(sink) = sink.as_deref_mut() {
            for (list, entry) in m.st.streamed.drain(..) {
                sink(list, entry);
            }
        }
        match ran {
            Ok(()) => {
                state = m.st;
                break;
            }
            Err(ReadError::Truncated { need, .. }) if !eof => {
                // The opcode at `op_start` runs past this chunk: keep its bytes, read on.
                let (keep_from, pos) = (m.op_start, m.pos);
                state = m.st;
                let more = (need as usize).saturating_add(pos - keep_from).max(chunk);
                buf.drain(..keep_from);
                base += keep_from;
                let at = base + buf.len();
                eof = fill(input, &mut buf, more, at)?;
            }
            Err(ReadError::NoStop { .. }) if !eof => {
                let keep_from = m.op_start;
                state = m.st;
                buf.drain(..keep_from);
                base += keep_from;
                let at = base + buf.len();
                eof = fill(input, &mut buf, chunk, at)?;
            }
            Err(e) => return Err(e.shifted(base)),
        }
    }
    drop(buf);
    // The machine's working state is not needed to convert: free it now, not at the end.
    let (pickle, interner, events, mut encoding) = state.finish();
    let root = pickle.root.ok_or(ReadError::NoStop { offset: base })?;
    let c = to_snapshot(&pickle, root, mode, interner, events)?;
    (encoding.bad_frames, encoding.first_bad_frame) = c.bad_frames;
    Ok((
        Streamed {
            snapshot: c.snapshot,
            trace_lists: c.trace_lists,
        },
        encoding,
    ))
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{FIXTURES, fixture};
    use super::super::machine::parse;
    use super::*;
    use crate::model::{Action, BlockState, Frame};

    #[test]
    fn chunked_reading_gives_the_same_snapshot_and_errors_as_whole_file_reading() {
        // Chunk sizes that cut opcodes, strings and lines at every kind of place.
        for name in FIXTURES {
            let bytes = fixture(name);
            let whole = read_snapshot(&bytes).unwrap();
            for chunk in [1, 7, 4096] {
                let mut done = 0;
                let s = read_chunked(&mut &bytes[..], chunk, &mut |d| done = d, None)
                    .unwrap()
                    .0
                    .snapshot;
                assert_eq!(s, whole, "{name} in chunks of {chunk}");
                assert_eq!(done, bytes.len(), "{name}: progress reaches the end");
            }
            // A file cut short fails at the same byte with the same error either way.
            let cut = &bytes[..bytes.len() * 2 / 3];
            let expected = read_snapshot_from(&mut &cut[..], &mut |_| {}).unwrap_err();
            let whole_err = Machine::new(cut, Mode::Keep).run(&mut |_| {}).unwrap_err();
            assert_eq!(expected, whole_err, "{name} cut");
            for chunk in [1, 13] {
                let e = read_chunked(&mut &cut[..], chunk, &mut |_| {}, None).unwrap_err();
                assert_eq!(e, whole_err, "{name} cut, chunks of {chunk}");
            }
        }
    }

    #[test]
    fn hostile_inputs_end_in_typed_errors() {
        assert_eq!(read_snapshot(b""), Err(ReadError::Empty));
        assert!(matches!(
            read_snapshot(b"hello world\n"),
            Err(ReadError::NotPickle { .. })
        ));
        assert!(matches!(
            parse(b"xyz"),
            Err(ReadError::UnknownOpcode {
                offset: 0,
                opcode: b'x'
            })
        ));
        // Huge declared length: no allocation, a truncation error.
        assert!(matches!(
            read_snapshot(&[
                0x80, 4, 0x8d, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f
            ]),
            Err(ReadError::Truncated { offset: 11, .. })
        ));
        assert!(matches!(
            read_snapshot(&[0x80, 4, b'h', 9, b'.']),
            Err(ReadError::BadMemo {
                offset: 2,
                index: 9
            })
        ));
        assert!(matches!(
            read_snapshot(b"\x80\x04cos\nsystem\n."),
            Err(ReadError::Forbidden {
                offset: 2,
                name: "GLOBAL"
            })
        ));
        assert!(matches!(
            read_snapshot(&[0x80, 9]),
            Err(ReadError::Protocol { version: 9, .. })
        ));
        assert!(matches!(
            read_snapshot(&[0x80, 4, b'a']),
            Err(ReadError::Corrupt { offset: 2, .. })
        ));
        assert!(matches!(
            read_snapshot(&[0x80, 4, b']']),
            Err(ReadError::NoStop { offset: 3 })
        ));
        // Deep nesting: 100k nested lists are built without recursion; the snapshot
        // conversion then rejects the shape.
        let mut deep = vec![0x80, 4];
        deep.extend(std::iter::repeat_n(b']', 100_000));
        deep.extend(std::iter::repeat_n(b'a', 99_999));
        deep.push(b'.');
        assert!(matches!(read_snapshot(&deep), Err(ReadError::Shape { .. })));
        assert!(parse(&deep).is_ok());
        // A list that contains itself, inside metadata: the depth cap ends it.
        let mut cyc = vec![0x80, 4, b'}', b'('];
        for k in ["segments", "device_traces", "memsnap"] {
            cyc.push(0x8c);
            cyc.push(k.len() as u8);
            cyc.extend_from_slice(k.as_bytes());
            if k == "memsnap" {
                cyc.extend_from_slice(&[b']', b'q', 7, b'h', 7, b'a']);
            } else {
                cyc.push(b']');
            }
        }
        cyc.extend_from_slice(b"u.");
        let r = read_snapshot(&cyc);
        assert!(matches!(r, Err(ReadError::Shape { .. })), "{r:?}");
        // Truncation at every prefix of a real file ends in an error, never a panic.
        let f = fixture("torch-oom.pickle");
        for n in 0..f.len() - 1 {
            assert!(read_snapshot(&f[..n]).is_err(), "prefix {n}");
        }
    }

    /// Reads `bytes` with [`stream_snapshot_from`] in chunks of `chunk` and puts the
    /// handed-out entries back into their devices' lists, to compare with a full read.
    fn streamed(bytes: &[u8], chunk: usize) -> Result<Snapshot> {
        let mut got: Vec<(u32, TraceEntry)> = Vec::new();
        let mut done = 0;
        let (s, _) = read_chunked(
            &mut &bytes[..],
            chunk,
            &mut |d| done = d,
            Some(&mut |list, e| got.push((list, e))),
        )?;
        assert_eq!(done, bytes.len(), "progress reaches the end");
        let mut snap = s.snapshot;
        assert_eq!(snap.device_traces.len(), s.trace_lists.len());
        assert!(snap.device_traces.iter().all(Vec::is_empty));
        for (d, list) in s.trace_lists.iter().enumerate() {
            snap.device_traces[d] = got
                .iter()
                .filter(|(l, _)| l == list)
                .map(|(_, e)| e.clone())
                .collect();
        }
        Ok(snap)
    }

    #[test]
    fn streaming_hands_out_every_entry_of_every_fixture_in_order() {
        for name in FIXTURES {
            let bytes = fixture(name);
            let whole = read_snapshot(&bytes).unwrap();
            for chunk in [1, 7, 4096, READ_CHUNK] {
                assert_eq!(
                    streamed(&bytes, chunk).unwrap(),
                    whole,
                    "{name}, chunks of {chunk}"
                );
            }
            let cut = &bytes[..bytes.len() / 2];
            assert_eq!(
                streamed(cut, 13).unwrap_err(),
                read_snapshot(cut).unwrap_err(),
                "{name} cut"
            );
        }
    }

    /// memsnap's own file with a long history: streaming keeps the arena at one batch of
    /// entries' worth of nodes (converted dicts and frame lists are reused) however long
    /// the history, where keeping the entries needs a node per entry.
    #[test]
    fn streaming_memory_does_not_grow_with_the_history() {
        use crate::model::{Block, Segment};
        let file = |events: i64| {
            let frame = |i: i64| Frame {
                name: format!("f{i}"),
                filename: "/app/train.py".into(),
                line: i,
            };
            let mut snap = Snapshot {
                frames: (0..40).map(frame).collect(),
                stacks: (0..30u32).map(|s| (s..s + 10).collect()).collect(),
                ..Snapshot::default()
            };
            let trace = (0..events)
                .map(|i| TraceEntry {
                    action: if i % 2 == 0 {
                        Action::Alloc
                    } else {
                        Action::FreeCompleted
                    },
                    addr: 0x1000 * (i / 2),
                    size: 512,
                    stream: 0,
                    time_us: i,
                    stack: Some((i % 30) as u32),
                    device_free: None,
                    user_metadata: Some("cudaMalloc".into()),
                })
                .collect();
            snap.device_traces = vec![trace];
            snap.segments = vec![Segment {
                device: 0,
                address: 0x1000,
                total_size: 512,
                stream: 0,
                segment_type: "large".into(),
                segment_pool_id: (0, 0),
                is_expandable: false,
                stack: Some(3),
                blocks: vec![Block {
                    address: 0x1000,
                    size: 512,
                    requested_size: 512,
                    state: BlockState::ActiveAllocated,
                    stack: Some(3),
                }],
            }];
            let bytes = crate::pickle_write::to_bytes(&snap);
            let whole = read_snapshot(&bytes).unwrap();
            assert_eq!(whole.device_traces, snap.device_traces);
            assert_eq!(streamed(&bytes, 4096).unwrap(), whole);
            bytes
        };
        let nodes_after = |bytes: &[u8], mode| {
            let mut m = Machine::new(bytes, mode);
            m.run(&mut |_| {}).unwrap();
            m.st.pickle.nodes.len()
        };
        let (short, long) = (file(10_000), file(40_000));
        let kept = [
            nodes_after(&short, Mode::Keep),
            nodes_after(&long, Mode::Keep),
        ];
        let streaming = [
            nodes_after(&short, Mode::Stream),
            nodes_after(&long, Mode::Stream),
        ];
        assert!(kept[1] - kept[0] >= 30_000, "keep mode: {kept:?} nodes");
        assert_eq!(
            streaming[0], streaming[1],
            "stream mode: nodes for 10k and 40k entries"
        );
        // What stays: strings, frames, and one batch of (at most 1000) entry dicts.
        assert!(streaming[1] < 1500, "stream mode: {streaming:?} nodes");
    }

    #[test]
    fn streaming_refuses_entries_referred_to_twice_and_full_reading_takes_them() {
        // An event dict appended, then fetched from the memo and appended again.
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/hand/shared-entry.pickle"
        );
        let b = std::fs::read(path).unwrap();
        let full = read_snapshot(&b).unwrap();
        assert_eq!(full.device_traces[0].len(), 2);
        assert!(matches!(
            streamed(&b, READ_CHUNK),
            Err(ReadError::NeedsFullRead { .. })
        ));
    }

    /// The fuzz target's seeds of both hostile shapes (a trace list, a block list, each
    /// stored once and referenced thousands of times) are refused at the model budget,
    /// read whole or streamed, in any chunk size.
    #[test]
    fn fuzz_seeds_of_shared_lists_are_refused_at_the_model_budget() {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../fuzz/seeds/read_snapshot"
        );
        for name in ["shared-trace-list.pickle", "shared-block-list.pickle"] {
            let b = std::fs::read(format!("{dir}/{name}")).unwrap();
            for r in [
                read_snapshot(&b).map(|_| ()),
                read_chunked(&mut &b[..], 4096, &mut |_| {}, None).map(|_| ()),
                streamed(&b, 4096).map(|_| ()),
            ] {
                assert!(matches!(r, Err(ReadError::Expands { .. })), "{name}: {r:?}");
            }
        }
    }

    /// Random byte mutations of every fixture: Ok or Err, never a panic. Deterministic.
    #[test]
    fn mutated_fixtures_never_panic() {
        let mut rng: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let small: Vec<Vec<u8>> = FIXTURES[..5].iter().map(|f| fixture(f)).collect();
        let mut errors = 0;
        for i in 0..3000 {
            let mut b = small[i % small.len()].clone();
            let n = 1 + next() % 8;
            for _ in 0..n {
                let at = (next() as usize) % b.len();
                match next() % 4 {
                    0 => b[at] = next() as u8,
                    1 => b[at] ^= 1 << (next() % 8),
                    2 => b.truncate(at.max(1)),
                    _ => {
                        let len = b.len();
                        b[at..].rotate_left((next() as usize) % (len - at));
                    }
                }
            }
            let whole = read_snapshot(&b);
            if whole.is_err() {
                errors += 1;
            }
            // Streaming the entries out gives the same, or says the file needs a full read.
            match (streamed(&b, READ_CHUNK), &whole) {
                (Ok(s), Ok(w)) => assert_eq!(&s, w, "mutation {i}: streamed"),
                (Ok(_), Err(e)) => panic!("mutation {i}: streamed fine, full read failed: {e}"),
                (Err(ReadError::NeedsFullRead { .. }), _) => {}
                (Err(e), Err(w)) => assert_eq!(&e, w, "mutation {i}: streamed"),
                (Err(e), Ok(_)) => panic!("mutation {i}: full read fine, streamed failed: {e}"),
            }
            // Streaming in small chunks reaches the same result or the same error.
            if i % 10 == 0 {
                let chunked =
                    read_chunked(&mut &b[..], 997, &mut |_| {}, None).map(|(s, _)| s.snapshot);
                assert_eq!(chunked, whole, "mutation {i}, chunks of 997");
            }
        }
        // Some mutations hit values only (still valid), most break the structure.
        assert!(errors > 100 && errors < 3000, "{errors} errors");
    }
}

//! The live-view protocol: how `memsnap top` asks a recording process what it holds now,
//! without a file. The library's writer thread serves it on a Unix socket; the CLI asks.
//! One definition for both sides.
//!
//! Cold. One request per connection: the client sends a request, the process sends one
//! answer and closes. Each message is a 4-byte little-endian length, then that many bytes
//! of JSON. A request is at most [`MAX_REQUEST`] bytes (the process cuts off a client that
//! announces more); an answer at most [`MAX_ANSWER`] (the CLI refuses more). The socket is
//! `{pid}.sock` in the per-user folder of [`crate::ack::folder`] (0700); the process also
//! checks the peer's credentials. docs/LIVE.md has the design and the limits.

use crate::model::Frame;
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use std::io::Read;
use std::path::PathBuf;

/// Bumped when a field changes meaning; the CLI refuses other versions.
pub const PROTOCOL_VERSION: u32 = 1;
/// Largest request the process reads.
pub const MAX_REQUEST: usize = 1024;
/// Largest answer the CLI reads (100k live allocations with distinct deep stacks stay
/// far below it).
pub const MAX_ANSWER: usize = 256 << 20;

/// The socket of process `pid` of user `uid`.
pub fn socket_path(uid: u32, pid: u32) -> PathBuf {
    crate::ack::folder(uid).join(format!("{pid}.sock"))
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "ask", rename_all = "snake_case")]
pub enum Request {
    /// What is live now. Frames and stacks are numbered the same in every answer of a
    /// process (they only grow), so a client that already holds the first `known_frames`
    /// frames and `known_stacks` stacks is sent only the ones after them.
    Sample {
        #[serde(default)]
        known_frames: u32,
        #[serde(default)]
        known_stacks: u32,
    },
    /// Write a snapshot now; answered with its path once it is on disk.
    Dump,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "answer", rename_all = "snake_case")]
pub enum Answer {
    Sample(Sample),
    /// The snapshot's path, and how many dump requests it served (signals and socket
    /// requests that arrived within the floor between request snapshots share the next
    /// one; 0 when not said).
    Dumped {
        path: String,
        #[serde(default)]
        requests: u64,
    },
    Failed {
        reason: String,
    },
}

/// One device's totals, as a snapshot's `memsnap.devices` would give them now.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceSample {
    pub device: u32,
    pub live_bytes: u64,
    /// Σ of segment sizes, as `memsnap summary` counts reserved bytes.
    pub reserved_bytes: u64,
    pub peak_bytes: u64,
    pub live_allocations: u64,
    pub ooms: u64,
}

/// Live blocks of one device that share one stack.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveGroup {
    pub device: u32,
    /// Index into [`Sample::stacks`]; `None` for blocks recorded without a stack.
    pub stack: Option<u32>,
    pub bytes: u64,
    pub count: u64,
}

/// The most recent out-of-memory error.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OomSample {
    pub device: u32,
    pub time_us: u64,
    pub requested_bytes: u64,
    /// Free device bytes the driver reported, or -1.
    pub device_free: i64,
}

/// What a process holds at one moment. Frames and stacks are those a snapshot written now
/// would carry (innermost first), so the CLI applies the same site rules as to a file; the
/// answer carries those from `frames_from` and `stacks_from` on (what the client did not
/// have), and group stacks index the whole list.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub version: u32,
    pub pid: u32,
    /// Microseconds on the clock of the snapshot's trace entries.
    pub time_us: u64,
    /// `memsnap_step()` calls so far.
    pub step: u64,
    pub events_recorded: u64,
    pub dropped_events: u64,
    pub events_without_stack: u64,
    pub devices: Vec<DeviceSample>,
    /// Index of `frames[0]` in the process's list of frames.
    pub frames_from: u32,
    pub frames: Vec<Frame>,
    /// Index of `stacks[0]` in the process's list of stacks.
    pub stacks_from: u32,
    /// Frame indices, innermost first.
    pub stacks: Vec<Vec<u32>>,
    pub groups: Vec<LiveGroup>,
    pub last_oom: Option<OomSample>,
}

#[derive(Debug, thiserror::Error)]
pub enum LiveError {
    #[error("message of {len} bytes is over the limit of {max}")]
    TooLarge { len: usize, max: usize },
    #[error("malformed message")]
    Malformed(#[from] serde_json::Error),
    #[error("connection failed")]
    Io(#[from] std::io::Error),
}

/// A message as it travels: length prefix, then JSON.
pub fn encode<T: Serialize>(message: &T) -> Vec<u8> {
    let mut out = vec![0u8; 4];
    // Serializing these plain structs into memory cannot fail.
    let _ = serde_json::to_writer(&mut out, message);
    let len = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&len.to_le_bytes());
    out
}

/// Decodes a message from what has arrived so far: `Ok(None)` while it is incomplete; an
/// error as soon as the announced length passes `max` or the body is not a `T`.
pub fn decode<T: DeserializeOwned>(buf: &[u8], max: usize) -> Result<Option<T>, LiveError> {
    let Some(prefix) = buf.get(..4) else {
        return Ok(None);
    };
    let len = u32::from_le_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]) as usize;
    if len > max {
        return Err(LiveError::TooLarge { len, max });
    }
    match buf.get(4..4 + len) {
        Some(body) => Ok(Some(serde_json::from_slice(body)?)),
        None => Ok(None),
    }
}

/// Reads one whole message from a blocking reader (the caller sets its timeouts).
pub fn read_message<T: DeserializeOwned>(r: &mut impl Read, max: usize) -> Result<T, LiveError> {
    let mut prefix = [0u8; 4];
    r.read_exact(&mut prefix)?;
    let len = u32::from_le_bytes(prefix) as usize;
    if len > max {
        return Err(LiveError::TooLarge { len, max });
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(serde_json::from_slice(&body)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_wait_for_their_whole_body() {
        let ask = Request::Sample {
            known_frames: 0,
            known_stacks: 2,
        };
        let bytes = encode(&ask);
        assert_eq!(
            &bytes[4..],
            br#"{"ask":"sample","known_frames":0,"known_stacks":2}"#
        );
        assert_eq!(decode::<Request>(&bytes, MAX_REQUEST).unwrap(), Some(ask));
        let short = encode(&serde_json::json!({"ask": "sample"}));
        assert!(matches!(
            decode::<Request>(&short, MAX_REQUEST).unwrap(),
            Some(Request::Sample {
                known_frames: 0,
                known_stacks: 0
            })
        ));
        assert_eq!(decode::<Request>(&bytes[..6], MAX_REQUEST).unwrap(), None);
        assert_eq!(decode::<Request>(&bytes[..2], MAX_REQUEST).unwrap(), None);

        let sample = Answer::Sample(Sample {
            version: PROTOCOL_VERSION,
            pid: 7,
            frames: vec![Frame {
                name: "f".into(),
                filename: "a.py".into(),
                line: 3,
            }],
            stacks: vec![vec![0]],
            groups: vec![LiveGroup {
                device: 1,
                stack: Some(0),
                bytes: 4096,
                count: 2,
            }],
            ..Sample::default()
        });
        let bytes = encode(&sample);
        let back: Answer = read_message(&mut &bytes[..], MAX_ANSWER).unwrap();
        assert_eq!(back, sample);
    }

    #[test]
    fn refuses_oversized_and_malformed_messages() {
        let mut huge = (MAX_REQUEST as u32 + 1).to_le_bytes().to_vec();
        huge.extend_from_slice(b"{}");
        assert!(matches!(
            decode::<Request>(&huge, MAX_REQUEST),
            Err(LiveError::TooLarge { len, .. }) if len == MAX_REQUEST + 1
        ));
        let mut garbage = 5u32.to_le_bytes().to_vec();
        garbage.extend_from_slice(b"\xff\x00abc");
        assert!(matches!(
            decode::<Request>(&garbage, MAX_REQUEST),
            Err(LiveError::Malformed(_))
        ));
        let unknown = encode(&serde_json::json!({"ask": "rm -rf"}));
        assert!(decode::<Request>(&unknown, MAX_REQUEST).is_err());
    }
}

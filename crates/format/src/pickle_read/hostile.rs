//! Generators of hostile snapshots: a few hundred KB of pickle that an expanding reader
//! turns into gigabytes. Used by the reader's unit tests and, through `#[path]`, by the
//! CLI's tests (tests/hostile.rs), so both build the same bytes. Plain std code.

/// A `str` (BINUNICODE).
fn key(b: &mut Vec<u8>, s: &str) {
    b.push(b'X');
    b.extend_from_slice(&(s.len() as u32).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

/// Hostile shape 1: one list of `n` trace entries, memoized once (memo 0) and
/// referenced `m` more times with BINGET, as `m + 1` devices' traces.
pub fn shared_trace_list(n: usize, m: usize) -> Vec<u8> {
    let mut b = vec![0x80, 4, b'}', b'('];
    key(&mut b, "segments");
    b.push(b']');
    key(&mut b, "device_traces");
    b.extend_from_slice(&[b']', b']', b'q', 0, b'(']);
    for i in 0..n {
        b.extend_from_slice(b"}(");
        if i == 0 {
            for (k, memo) in [("action", 1u8), ("alloc", 2), ("addr", 3), ("size", 4)] {
                key(&mut b, k);
                b.extend_from_slice(&[b'q', memo]);
                if k == "action" {
                    continue;
                }
                if k != "alloc" {
                    b.extend_from_slice(&[b'J', 0, 2, 0, 0]);
                }
            }
        } else {
            b.extend_from_slice(&[b'h', 1, b'h', 2, b'h', 3, b'J']);
            b.extend_from_slice(&((i as u32) << 9).to_le_bytes());
            b.extend_from_slice(&[b'h', 4, b'J', 0, 2, 0, 0]);
        }
        b.push(b'u');
        if i % 1000 == 999 {
            b.extend_from_slice(b"e(");
        }
    }
    b.extend_from_slice(b"ea");
    for i in 0..m {
        if i % 1000 == 0 {
            b.push(b'(');
        }
        b.extend_from_slice(&[b'h', 0]);
        if i % 1000 == 999 || i == m - 1 {
            b.push(b'e');
        }
    }
    b.extend_from_slice(b"u.");
    b
}

/// Hostile shape 2: one list of `n` blocks, memoized once and the `blocks` of `m`
/// segments.
pub fn shared_block_list(n: usize, m: usize) -> Vec<u8> {
    let mut b = vec![0x80, 4, b'}', b'('];
    key(&mut b, "device_traces");
    b.extend_from_slice(b"]]a");
    key(&mut b, "segments");
    b.extend_from_slice(b"](}(");
    key(&mut b, "address");
    b.extend_from_slice(&[b'q', 1, b'J', 0, 0, 0, 0]);
    key(&mut b, "total_size");
    b.extend_from_slice(&[b'q', 2, b'J']);
    b.extend_from_slice(&((n as u32) << 9).to_le_bytes());
    key(&mut b, "blocks");
    b.extend_from_slice(&[b'q', 3, b']', b'q', 0, b'(']);
    for i in 0..n {
        b.extend_from_slice(b"}(");
        if i == 0 {
            key(&mut b, "size");
            b.extend_from_slice(&[b'q', 4]);
            b.extend_from_slice(&[b'J', 0, 2, 0, 0]);
            key(&mut b, "state");
            b.extend_from_slice(&[b'q', 5]);
            key(&mut b, "active_allocated");
            b.extend_from_slice(&[b'q', 6]);
        } else {
            b.extend_from_slice(&[b'h', 4, b'J', 0, 2, 0, 0, b'h', 5, b'h', 6]);
        }
        b.push(b'u');
        if i % 1000 == 999 {
            b.extend_from_slice(b"e(");
        }
    }
    b.extend_from_slice(b"eue");
    for i in 0..m {
        if i % 1000 == 0 {
            b.push(b'(');
        }
        b.extend_from_slice(&[b'}', b'(', b'h', 1, b'J']);
        b.extend_from_slice(&((i as u32 + 1) << 24).to_le_bytes());
        b.extend_from_slice(&[b'h', 2, b'J']);
        b.extend_from_slice(&((n as u32) << 9).to_le_bytes());
        b.extend_from_slice(&[b'h', 3, b'h', 0, b'u']);
        if i % 1000 == 999 || i == m - 1 {
            b.push(b'e');
        }
    }
    b.extend_from_slice(b"u.");
    b
}

/// Hostile shape 3: one trace entry whose stack is `n` distinct frames (each its own line)
/// sharing one name string of `len` bytes through the memo: each frame copies it.
pub fn shared_frame_string(len: usize, n: usize) -> Vec<u8> {
    let mut b = vec![0x80, 4, b'}', b'('];
    key(&mut b, "device_traces");
    b.extend_from_slice(b"](]}(");
    key(&mut b, "action");
    key(&mut b, "alloc");
    key(&mut b, "frames");
    b.push(b']');
    // Memoized and popped: only the memo keeps them.
    key(&mut b, &"x".repeat(len));
    b.extend_from_slice(&[b'q', 0, b'0']);
    key(&mut b, "name");
    b.extend_from_slice(&[b'q', 1, b'0']);
    key(&mut b, "line");
    b.extend_from_slice(&[b'q', 2, b'0']);
    for i in 0..n {
        if i % 1000 == 0 {
            b.push(b'(');
        }
        b.extend_from_slice(&[b'}', b'(', b'h', 1, b'h', 0, b'h', 2, b'J']);
        b.extend_from_slice(&(i as u32).to_le_bytes());
        b.push(b'u');
        if i % 1000 == 999 || i == n - 1 {
            b.push(b'e');
        }
    }
    b.extend_from_slice(b"uaeu.");
    b
}

/// Hostile shape 4: one trace entry whose `user_metadata` dict holds `n` pairs, each a
/// string of `len` bytes shared through the memo: its "k: v, ..." text copies it `2n` times.
pub fn shared_metadata_string(len: usize, n: usize) -> Vec<u8> {
    let mut b = vec![0x80, 4, b'}', b'('];
    key(&mut b, "device_traces");
    b.extend_from_slice(b"](]}(");
    key(&mut b, "action");
    key(&mut b, "alloc");
    key(&mut b, "user_metadata");
    b.push(b'}');
    key(&mut b, &"x".repeat(len));
    b.extend_from_slice(&[b'q', 0, b'0']);
    for i in 0..n {
        if i % 1000 == 0 {
            b.push(b'(');
        }
        b.extend_from_slice(&[b'h', 0, b'h', 0]);
        if i % 1000 == 999 || i == n - 1 {
            b.push(b'u');
        }
    }
    b.extend_from_slice(b"uaeu.");
    b
}

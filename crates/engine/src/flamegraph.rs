//! `flamegraph`'s model: live bytes by stack on each device, at the end (block bytes) or
//! at the moment each history followed (requested bytes), and the folded-stack lines a
//! flame graph is drawn from. The CLI reads the file and draws the SVG. Cold code.

use crate::at::Resolved;
use crate::device;
use crate::input::Summarized;
use crate::sites::{self, Attribution, is_hidden, stack_frame_text};
use crate::tally::Tally;
use memsnap_format::model::{BlockState, Frame, Snapshot, StackId};
use rustc_hash::FxHashMap;

/// Live bytes by stack on each device, and the moment each device was taken at.
pub struct Live {
    pub by_stack: Vec<(i64, Option<StackId>, Tally)>,
    pub moments: Vec<(i64, Resolved)>,
    pub capped: Vec<String>,
    /// "block bytes" at the end, else "requested bytes".
    pub units: &'static str,
}

/// The snapshot's active_allocated blocks by stack (block bytes).
pub fn live_at_end(snap: &Snapshot) -> Live {
    let mut by: FxHashMap<(i64, Option<StackId>), Tally> = FxHashMap::default();
    for seg in &snap.segments {
        for b in seg
            .blocks
            .iter()
            .filter(|b| b.state == BlockState::ActiveAllocated)
        {
            by.entry((seg.device, b.stack)).or_default().add(b.size);
        }
    }
    Live {
        by_stack: by.into_iter().map(|((d, s), t)| (d, s, t)).collect(),
        moments: Vec::new(),
        capped: Vec::new(),
        units: "block bytes",
    }
}

/// Folded stacks (`root;...;leaf bytes`), one line per distinct path, sorted. The root is
/// `device memory`, or `device N` when more than one device holds memory.
pub fn folded(snap: &Snapshot, live: &Live, attr: &Attribution) -> Vec<String> {
    let mut devices: Vec<i64> = live.by_stack.iter().map(|(d, _, _)| *d).collect();
    devices.sort_unstable();
    devices.dedup();
    let mut by_path: FxHashMap<String, i64> = FxHashMap::default();
    for (device, stack, t) in &live.by_stack {
        if t.bytes <= 0 {
            continue;
        }
        let frames: Vec<&Frame> = snap.stack_frames(*stack).collect();
        let mut names: Vec<String> = if attr.callers.is_some() {
            sites::site_chain(&frames, attr)
                .map(|(chain, _)| chain)
                .unwrap_or_default()
        } else {
            frames
                .iter()
                .filter(|f| !is_hidden(f) && !attr.ignores(f))
                .map(|f| stack_frame_text(f))
                .collect()
        };
        if names.is_empty() {
            names.push("<no frames recorded>".into());
        }
        names.reverse();
        let root = if devices.len() > 1 {
            format!("device {device}")
        } else {
            "device memory".to_string()
        };
        let path = std::iter::once(root)
            .chain(names.into_iter().map(|n| n.replace(';', ":")))
            .collect::<Vec<_>>()
            .join(";");
        *by_path.entry(path).or_default() += t.bytes;
    }
    let mut lines: Vec<String> = by_path
        .into_iter()
        .map(|(path, bytes)| format!("{path} {bytes}"))
        .collect();
    lines.sort();
    lines
}

/// The live set of every device at the moment its history followed, by stack, in
/// requested bytes.
pub fn live_at(loaded: &Summarized) -> Live {
    let mut live = Live {
        by_stack: Vec::new(),
        moments: Vec::new(),
        capped: Vec::new(),
        units: "requested bytes",
    };
    for m in device::moments(&loaded.snap, &loaded.histories) {
        let d = m.device;
        live.by_stack
            .extend(m.holders.into_iter().map(|(s, t)| (d, s, t)));
        live.capped.extend(m.capped);
        live.moments.push((d, m.moment));
    }
    live
}

impl Live {
    /// Why the moment asked for is in no device's history, as for [`device::unreached`].
    pub fn unreached(&self) -> Option<String> {
        device::unreached(self.moments.iter().map(|(_, m)| m))
    }
}

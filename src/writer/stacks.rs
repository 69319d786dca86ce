//! Raw stacks to frames: interning, Python frame decoding, native symbolization.
//!
//! Cold (writer thread). (Stub: native addresses become hex frames; being written.)

use crate::config::Config;
use crate::preload::event::StackSlot;
use crate::snapshot::model::Frame;
use rustc_hash::FxHashMap;

/// Index of an interned raw stack.
pub type RawStackId = u32;

#[derive(Default)]
pub struct StackTable {
    ids: FxHashMap<Vec<u64>, RawStackId>,
    raw: Vec<Vec<u64>>,
    resolved: FxHashMap<RawStackId, Vec<Frame>>,
}

impl StackTable {
    pub fn new(_cfg: &Config) -> Self {
        Self::default()
    }

    /// Interns the stack in `slot`. Called as soon as the writer drains the event, while
    /// the Python code objects it names are still alive. `None` for an empty stack.
    pub fn intern(&mut self, slot: &StackSlot) -> Option<RawStackId> {
        if slot.native().is_empty() && slot.python().is_empty() {
            return None;
        }
        let key: Vec<u64> = slot.native().to_vec();
        let next = self.raw.len() as RawStackId;
        let id = *self.ids.entry(key.clone()).or_insert(next);
        if id == next {
            self.raw.push(key);
        }
        Some(id)
    }

    /// The frames of an interned stack, innermost first, symbolized (cached).
    pub fn frames(&mut self, id: RawStackId) -> &[Frame] {
        let raw = &self.raw;
        self.resolved.entry(id).or_insert_with(|| {
            raw.get(id as usize)
                .map(|r| {
                    r.iter()
                        .map(|pc| Frame {
                            name: format!("{pc:#x}"),
                            filename: "??".to_string(),
                            line: 0,
                        })
                        .collect()
                })
                .unwrap_or_default()
        })
    }
}

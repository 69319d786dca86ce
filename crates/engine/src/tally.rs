//! [`Tally`]: the bytes and count of one group (a site, a library, a device's live set),
//! and the largest-first order the reports list groups in. Cold code.

use rustc_hash::FxHashMap;
use serde::Serialize;

/// Bytes and count of one group.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Tally {
    pub bytes: i64,
    pub count: i64,
}

impl Tally {
    pub fn add(&mut self, bytes: i64) {
        self.bytes += bytes;
        self.count += 1;
    }
    /// Adds another group's bytes and count.
    pub fn merge(&mut self, other: Tally) {
        self.bytes += other.bytes;
        self.count += other.count;
    }
}

/// Groups, largest first (ties by name for stable output).
pub fn sorted<K: Ord + Copy>(m: &FxHashMap<K, Tally>) -> Vec<(K, Tally)> {
    let mut v: Vec<(K, Tally)> = m.iter().map(|(k, t)| (*k, *t)).collect();
    v.sort_by(|a, b| {
        b.1.bytes
            .cmp(&a.1.bytes)
            .then(b.1.count.cmp(&a.1.count))
            .then(a.0.cmp(&b.0))
    });
    v
}

//! [`BlockMap`]: the live blocks of one device (allocations or mappings) by start address,
//! in address order.
//!
//! Cold (writer thread), but on the writer's per-event path: every allocation looks for a
//! live block it overlaps and inserts one, every free removes one. `std`'s `BTreeMap` spent
//! about 60% of the writer's instructions per event on that (its removal rebalances nodes
//! and its range search walks both edges); here the blocks are short sorted runs, each at
//! most [`RUN`] entries, in order: a lookup is two binary searches, an insert or removal
//! one move of at most a run's tail, and a run is split only when full (removed when
//! empty, merged into a neighbour when small). Same answers as a `BTreeMap<u64, V>` for
//! the operations the writer uses (the tests below check them against one).

/// Most entries in one run. A run's tail moves on every insert and removal in it; more
/// runs make the outer binary search longer and splits move more run headers.
const RUN: usize = 32;

/// Values by `u64` key, in key order (the subset of `BTreeMap`'s interface the writer's
/// live blocks need, plus [`BlockMap::last_below`] for the overlap check).
#[derive(Clone, Debug)]
pub struct BlockMap<V> {
    /// Sorted runs of `(key, value)`: every run non-empty and sorted, every key of a run
    /// below every key of the next.
    runs: Vec<Vec<(u64, V)>>,
    len: usize,
}

impl<V> Default for BlockMap<V> {
    fn default() -> Self {
        BlockMap {
            runs: Vec::new(),
            len: 0,
        }
    }
}

impl<V> BlockMap<V> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The run `key` belongs in: the last whose first key is at most `key`, else the first.
    /// `None` when there is no run.
    fn run_of(&self, key: u64) -> Option<usize> {
        if self.runs.is_empty() {
            return None;
        }
        Some(
            self.runs
                .partition_point(|r| r[0].0 <= key)
                .saturating_sub(1),
        )
    }

    /// Where `key` is (`Ok`) or would go (`Err`) in run `run`.
    fn search(&self, run: usize, key: u64) -> Result<usize, usize> {
        self.runs[run].binary_search_by_key(&key, |e| e.0)
    }

    pub fn get(&self, key: &u64) -> Option<&V> {
        let run = self.run_of(*key)?;
        let at = self.search(run, *key).ok()?;
        Some(&self.runs[run][at].1)
    }

    pub fn contains_key(&self, key: &u64) -> bool {
        self.get(key).is_some()
    }

    /// Inserts `value` at `key`; the value it replaces, if any.
    pub fn insert(&mut self, key: u64, value: V) -> Option<V> {
        let Some(mut run) = self.run_of(key) else {
            let mut first = Vec::with_capacity(RUN);
            first.push((key, value));
            self.runs.push(first);
            self.len = 1;
            return None;
        };
        let mut at = match self.search(run, key) {
            Ok(at) => return Some(std::mem::replace(&mut self.runs[run][at].1, value)),
            Err(at) => at,
        };
        if self.runs[run].len() == RUN {
            // Full: its upper half becomes a run of its own.
            let mut upper = Vec::with_capacity(RUN);
            upper.extend(self.runs[run].drain(RUN / 2..));
            self.runs.insert(run + 1, upper);
            if at > RUN / 2 {
                run += 1;
                at -= RUN / 2;
            }
        }
        self.runs[run].insert(at, (key, value));
        self.len += 1;
        None
    }

    pub fn remove(&mut self, key: &u64) -> Option<V> {
        let run = self.run_of(*key)?;
        let at = self.search(run, *key).ok()?;
        let (_, value) = self.runs[run].remove(at);
        self.len -= 1;
        if self.runs[run].is_empty() {
            self.runs.remove(run);
        } else if self.runs[run].len() < RUN / 4 {
            // A small run joins a neighbour with room, so that removals in one place do
            // not leave many tiny runs behind.
            let neighbour = if run + 1 < self.runs.len() {
                Some((run, run + 1))
            } else if run > 0 {
                Some((run - 1, run))
            } else {
                None
            };
            if let Some((lower, upper)) = neighbour
                && self.runs[lower].len() + self.runs[upper].len() <= RUN / 2
            {
                let moved = self.runs.remove(upper);
                self.runs[lower].extend(moved);
            }
        }
        Some(value)
    }

    /// The entry with the greatest key below `end`: the only live block that can reach into
    /// `[addr, end)` from below, live blocks never overlapping one another.
    pub fn last_below(&self, end: u64) -> Option<(u64, &V)> {
        let run = self.runs.partition_point(|r| r[0].0 < end).checked_sub(1)?;
        let entries = &self.runs[run];
        // At least one: the run's first key is below `end`.
        let at = entries.partition_point(|e| e.0 < end) - 1;
        Some((entries[at].0, &entries[at].1))
    }

    /// Entries with keys in `range`, in key order.
    pub fn range(&self, range: std::ops::Range<u64>) -> impl Iterator<Item = (&u64, &V)> {
        let first_run = self
            .runs
            .partition_point(|r| r[0].0 < range.start)
            .saturating_sub(1);
        let skip = self
            .runs
            .get(first_run)
            .map_or(0, |r| r.partition_point(|e| e.0 < range.start));
        self.runs
            .get(first_run..)
            .unwrap_or(&[])
            .iter()
            .flatten()
            .skip(skip)
            .take_while(move |e| e.0 < range.end)
            .map(|(k, v)| (k, v))
    }

    /// Every entry, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&u64, &V)> {
        self.runs.iter().flatten().map(|(k, v)| (k, v))
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.runs.iter().flatten().map(|(_, v)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// xorshift64*: deterministic.
    fn next(state: &mut u64) -> u64 {
        *state ^= *state >> 12;
        *state ^= *state << 25;
        *state ^= *state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn same(map: &BlockMap<u64>, model: &BTreeMap<u64, u64>) {
        assert_eq!(map.len(), model.len());
        assert!(map.iter().eq(model.iter()));
        assert!(map.runs.iter().all(|r| !r.is_empty() && r.len() <= RUN));
    }

    #[test]
    fn answers_as_a_btreemap_under_random_inserts_and_removals() {
        let mut rng = 7u64;
        for keys in [8u64, 100, 3_000] {
            let mut map = BlockMap::default();
            let mut model = BTreeMap::new();
            for i in 0..40_000u64 {
                let key = next(&mut rng) % keys * 16;
                match next(&mut rng) % 4 {
                    0 | 1 => assert_eq!(map.insert(key, i), model.insert(key, i)),
                    2 => assert_eq!(map.remove(&key), model.remove(&key)),
                    _ => {
                        let end = key + next(&mut rng) % 200;
                        assert_eq!(
                            map.last_below(end),
                            model.range(..end).next_back().map(|(&k, v)| (k, v))
                        );
                        assert!(map.range(key..end).eq(model.range(key..end)));
                        assert_eq!(map.get(&key), model.get(&key));
                    }
                }
                if i % 997 == 0 {
                    same(&map, &model);
                }
            }
            same(&map, &model);
            // Emptied in order: runs go as they empty.
            let keys: Vec<u64> = model.keys().copied().collect();
            for k in keys {
                assert_eq!(map.remove(&k), model.remove(&k));
            }
            same(&map, &model);
            assert!(map.runs.is_empty());
        }
    }

    #[test]
    fn first_in_first_out_like_a_training_loop() {
        let mut map = BlockMap::default();
        let mut model = BTreeMap::new();
        for i in 0..10_000u64 {
            map.insert(i * 4096, i);
            model.insert(i * 4096, i);
            if i >= 64 {
                let old = (i - 64) * 4096;
                assert_eq!(map.remove(&old), model.remove(&old));
            }
        }
        same(&map, &model);
        assert!(
            map.runs.len() <= 64 / (RUN / 4) + 1,
            "{} runs",
            map.runs.len()
        );
        assert_eq!(map.last_below(0), None);
        assert_eq!(map.last_below(u64::MAX).map(|e| e.0), Some(9_999 * 4096));
        assert!(map.range(5..5).next().is_none());
    }
}

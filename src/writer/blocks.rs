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
    /// The last run that emptied, kept for the next split: blocks freed in allocation
    /// order empty runs at one end as splits make them at the other.
    spare: Option<Vec<(u64, V)>>,
}

impl<V> Default for BlockMap<V> {
    fn default() -> Self {
        BlockMap {
            runs: Vec::new(),
            len: 0,
            spare: None,
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

    /// An empty run with room for [`RUN`] entries.
    fn new_run(&mut self) -> Vec<(u64, V)> {
        self.spare.take().unwrap_or_else(|| Vec::with_capacity(RUN))
    }

    /// Inserts `value` at `key`; the value it replaces, if any.
    pub fn insert(&mut self, key: u64, value: V) -> Option<V> {
        let Some(run) = self.run_of(key) else {
            self.insert_at(0, 0, key, value);
            return None;
        };
        match self.search(run, key) {
            Ok(at) => Some(std::mem::replace(&mut self.runs[run][at].1, value)),
            Err(at) => {
                self.insert_at(run, at, key, value);
                None
            }
        }
    }

    /// Inserts `value` at `key` when no entry overlaps `[key, end)`, an entry's extent
    /// being `[its key, end_of(its value))`: one search for the check and the place.
    /// Otherwise gives `value` back and changes nothing. Only the entries next to `key`
    /// are looked at: the map's entries must not overlap one another (live blocks don't).
    pub fn insert_if_clear(
        &mut self,
        key: u64,
        end: u64,
        value: V,
        end_of: impl Fn(u64, &V) -> u64,
    ) -> Result<(), V> {
        let Some(run) = self.run_of(key) else {
            self.insert_at(0, 0, key, value);
            return Ok(());
        };
        let Err(at) = self.search(run, key) else {
            return Err(value);
        };
        let entries = &self.runs[run];
        // The entry just below `key` (in this run, or the last of the run before) must end
        // by `key`; the one just above must start at or after `end`.
        let below = match at.checked_sub(1) {
            Some(i) => Some(&entries[i]),
            None => run.checked_sub(1).and_then(|r| self.runs[r].last()),
        };
        let above = match entries.get(at) {
            Some(e) => Some(e),
            None => self.runs.get(run + 1).and_then(|r| r.first()),
        };
        if below.is_some_and(|(k, v)| end_of(*k, v) > key) || above.is_some_and(|e| e.0 < end) {
            return Err(value);
        }
        self.insert_at(run, at, key, value);
        Ok(())
    }

    /// Inserts at index `at` of run `run` (where `key` belongs), splitting a full run.
    fn insert_at(&mut self, mut run: usize, mut at: usize, key: u64, value: V) {
        if self.runs.is_empty() {
            let first = self.new_run();
            self.runs.push(first);
        } else if self.runs[run].len() == RUN {
            // Full: its upper half becomes a run of its own.
            let mut upper = self.new_run();
            upper.extend(self.runs[run].drain(RUN / 2..));
            self.runs.insert(run + 1, upper);
            if at > RUN / 2 {
                run += 1;
                at -= RUN / 2;
            }
        }
        self.runs[run].insert(at, (key, value));
        self.len += 1;
    }

    pub fn remove(&mut self, key: &u64) -> Option<V> {
        let run = self.run_of(*key)?;
        let at = self.search(run, *key).ok()?;
        let (_, value) = self.runs[run].remove(at);
        self.len -= 1;
        if self.runs[run].is_empty() {
            self.spare = Some(self.runs.remove(run));
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
    fn insert_if_clear_refuses_exactly_the_overlapping_blocks() {
        let mut rng = 11u64;
        for keys in [8u64, 100, 3_000] {
            // Entries are blocks of `value` bytes from their key, never overlapping.
            let mut map = BlockMap::default();
            let mut model = BTreeMap::new();
            for _ in 0..40_000u64 {
                let key = next(&mut rng) % keys * 16;
                if next(&mut rng).is_multiple_of(3) {
                    assert_eq!(map.remove(&key), model.remove(&key));
                    continue;
                }
                let size = 1 + next(&mut rng) % 40;
                let end = key + size;
                let clear = !model.range(..end).any(|(&k, &v)| k + v > key);
                let got = map.insert_if_clear(key, end, size, |k, v| k + v);
                assert_eq!(got, if clear { Ok(()) } else { Err(size) });
                if clear {
                    model.insert(key, size);
                }
            }
            same(&map, &model);
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

//! What stack captures did, counted for diagnosis: walks, frames unwound and reused, stack
//! reads checked, rule-cache misses, Python frames. Compiled only with the `capture-stats`
//! feature (a diagnostic build; the shipped library, the wheel and the builds that
//! benchmarks time leave it off), so the counting costs the hot path nothing elsewhere.
//!
//! Hot when compiled in: one relaxed atomic add per counted quantity per capture, the
//! reason it is not in the builds whose cost is measured. Read by
//! `memsnap_debug_capture_stats` (`benches/gpu/step_stacks.py` reports them per event).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// The counters, in the order `memsnap_debug_capture_stats` writes them.
#[derive(Clone, Copy)]
#[repr(usize)]
pub enum Stat {
    /// Native walks made.
    Walks,
    /// Walks that took an earlier walk's path of frames to its end.
    WalksReused,
    /// Unwinder steps a walk made itself (frames unwound, memsnap's own included).
    StepsUnwound,
    /// Steps taken from earlier walks' paths (each made again from one or two stack reads).
    StepsReused,
    /// Stack words read to check whole paths taken at once.
    ReadsChecked,
    /// Walks that met a path and took it whole at once (one pass over its checks).
    WholePaths,
    /// Paths a walk met and left midway (a frame changed there), then went on elsewhere.
    PathsLeft,
    /// Steps whose rule was not in the per-thread rule cache (derived with framehop).
    RuleMisses,
    /// Rule misses at an empty slot (the address's first time).
    RuleMissesCold,
    /// Rule misses at a slot another address's rule held (evicted it).
    RuleMissesConflict,
    /// Rule misses at the walk's first frame (the hook's own address).
    RuleMissesFirstFrame,
    /// Steps framehop unwound itself (a rule of another shape, or the unclean case).
    FramehopSteps,
    /// Walks that stopped at the step limit (the stack is deeper than a walk goes).
    WalksAtStepLimit,
    /// Native frames written to stacks.
    NativeFrames,
    /// Stacks whose native frames were cut at the frame limit.
    NativeTruncated,
    /// Python walks made.
    PythonWalks,
    /// Python frames written to stacks.
    PythonFrames,
    /// Time-stamp-counter ticks spent in native walks.
    NativeTicks,
    /// Ticks spent in Python walks.
    PythonTicks,
    /// Ticks spent sending an event with its stack (the sent-stack table, a slot and the
    /// copy for a new stack, the queue).
    SendTicks,
    /// Ticks spent in the whole stack path of an event (its walks and its send).
    StackEventTicks,
    /// Events that went through the stack path.
    StackEvents,
    /// Nodes made for paths of frames not seen before.
    NodesMade,
    /// Times a thread's nodes were all forgotten (full, or a new module table).
    PathResets,
    /// Paths a walk tried to take whole whose piece no longer held (it tried the state's
    /// next path, or followed the newest).
    PathsNotHolding,
    /// Ticks spent recording an allocation, a free or a caching-allocator block, from the
    /// hook's first step after the real call (or before it, for a free) to the event on the
    /// channel: the device query and the clock where the hook makes them, the stack path
    /// where there is one, the push. The hook's nesting guard and the real call are outside.
    EventTicks,
    /// Events those ticks are for (stackless ones included).
    Events,
    /// Ticks of an empty timed region, once per event, next to the recording's: what the
    /// counter reads themselves add to each timed part.
    TimerTicks,
    /// Ticks spent in the device query of recorded allocations (`cuCtxGetDevice` through
    /// the real driver, in the caller's context).
    DeviceTicks,
    /// Device queries those ticks are for.
    DeviceQueries,
    /// Ticks spent putting a stackless event on the channel (its lane, or the shared queue).
    PushTicks,
    /// Stackless events those ticks are for.
    Pushes,
    /// Time-stamp-counter ticks per millisecond, measured when the counters are read.
    TicksPerMillisecond,
}

/// How many counters there are.
pub const STATS: usize = Stat::TicksPerMillisecond as usize + 1;
/// Rule-cache keys of the latest misses kept (a ring), written after the counters.
pub const MISSED_KEPT: usize = 32;

static COUNTERS: [AtomicU64; STATS] = [const { AtomicU64::new(0) }; STATS];
static MISSED: [AtomicU64; MISSED_KEPT] = [const { AtomicU64::new(0) }; MISSED_KEPT];

/// Adds `n` to `stat`.
#[inline(always)]
pub fn add(stat: Stat, n: u64) {
    COUNTERS[stat as usize].fetch_add(n, Relaxed);
}

/// Keeps `key` (a frame address, top bit set for a walk's first frame) among the latest
/// rule misses.
#[inline(always)]
pub fn note_miss(key: u64) {
    let at = COUNTERS[Stat::RuleMisses as usize].load(Relaxed) as usize % MISSED_KEPT;
    MISSED[at].store(key, Relaxed);
}

/// The time-stamp counter (0 off x86-64).
#[inline(always)]
pub fn ticks() -> u64 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `rdtsc` reads a counter; it touches no memory.
    unsafe {
        std::arch::x86_64::_rdtsc()
    }
    #[cfg(not(target_arch = "x86_64"))]
    0
}

/// The counters so far, in [`Stat`] order, then the latest missed keys. Measures the
/// counter's rate over 20 ms first (cold: a diagnostic read).
pub fn read() -> [u64; STATS + MISSED_KEPT] {
    let (t0, i0) = (ticks(), std::time::Instant::now());
    while i0.elapsed() < std::time::Duration::from_millis(20) {}
    let rate = (ticks() - t0) as f64 / (i0.elapsed().as_secs_f64() * 1e3);
    COUNTERS[Stat::TicksPerMillisecond as usize].store(rate as u64, Relaxed);
    std::array::from_fn(|i| match i.checked_sub(STATS) {
        None => COUNTERS[i].load(Relaxed),
        Some(k) => MISSED[k].load(Relaxed),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text of `text` between the first `start` and the next `end`.
    fn between<'a>(text: &'a str, start: &str, end: &str) -> &'a str {
        let (_, rest) = text.split_once(start).expect(start);
        rest.split_once(end).map_or(rest, |(inside, _)| inside)
    }

    /// The variants of [`Stat`], in order, as this file declares them.
    fn declared() -> Vec<String> {
        between(include_str!("stats.rs"), "pub enum Stat {", "\n}")
            .lines()
            .map(str::trim)
            .filter(|l| !l.starts_with("//") && l.ends_with(','))
            .map(|l| l.trim_end_matches(',').to_string())
            .collect()
    }

    #[test]
    fn capture_stats_the_gpu_script_names_every_counter_in_order() {
        let script = include_str!("../../benches/gpu/step_stacks.py");
        let named: Vec<String> = between(script, "STAT_NAMES = [", "]")
            .split(',')
            .map(|n| n.trim().trim_matches('"').to_string())
            .filter(|n| !n.is_empty())
            .collect();
        // The script's names are the variants' in snake case, the rate shortened.
        let expected: Vec<String> = declared()
            .iter()
            .map(|v| match v.as_str() {
                "TicksPerMillisecond" => "ticks_per_ms".to_string(),
                v => v.chars().fold(String::new(), |mut s, c| {
                    if c.is_ascii_uppercase() && !s.is_empty() {
                        s.push('_');
                    }
                    s.push(c.to_ascii_lowercase());
                    s
                }),
            })
            .collect();
        assert_eq!(expected.len(), STATS);
        assert_eq!(named, expected);
    }
}

//! The event clock: when an event happened, read by the hooks as cheaply as the machine
//! allows and turned into microseconds since the Unix epoch by the writer.
//!
//! Process-wide: the source is chosen once, when recording starts, before the first event
//! is stamped ([`choose_source`]); the hooks read it on every event ([`now`], hot: one
//! relaxed load and one counter read), the writer converts ([`StampConverter`], cold).
//!
//! Where the kernel itself keeps time with the processor's time-stamp counter (its clock
//! source is `tsc`: the counter is invariant and agrees across cores), a stamp is the raw
//! counter (`rdtsc`, 16 ns on the H200 machine against 37 ns for the vDSO's
//! `clock_gettime`: docs/HOT-PATH.md, "Where the nanoseconds go"). Elsewhere (other clock
//! sources, other architectures) a stamp is the wall clock in microseconds, as before.

use super::hook_line::HOOK_LINE;
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

/// A reading of the event clock: raw counter ticks or microseconds, by [`source`]. Only a
/// [`StampConverter`] gives it a meaning.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Stamp(pub u64);

/// What a [`Stamp`] counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// Microseconds since the Unix epoch (`clock_gettime(CLOCK_REALTIME)`).
    WallMicros,
    /// The x86-64 time-stamp counter.
    TimeStampCounter,
}

const WALL: u8 = 0;
const TSC: u8 = 1;

/// The source, on the line every hooked call reads (`process::hook_line`).
const SOURCE: &AtomicU8 = &HOOK_LINE.clock_source;
const _: () = assert!(WALL == 0); // the line's initial value

/// The event clock's source, as [`choose_source`] set it.
pub fn source() -> Source {
    match SOURCE.load(Relaxed) {
        TSC => Source::TimeStampCounter,
        _ => Source::WallMicros,
    }
}

/// Chooses the source once, before the first event: the time-stamp counter where the
/// kernel's clock source is `tsc`. Cold (reads one sysfs file).
pub fn choose_source() {
    let tsc = cfg!(target_arch = "x86_64")
        && std::fs::read_to_string(
            "/sys/devices/system/clocksource/clocksource0/current_clocksource",
        )
        .is_ok_and(|s| s.trim() == "tsc");
    SOURCE.store(if tsc { TSC } else { WALL }, Relaxed);
}

/// Now, on the event clock. Hot.
#[inline(always)]
pub fn now() -> Stamp {
    #[cfg(target_arch = "x86_64")]
    if SOURCE.load(Relaxed) == TSC {
        return Stamp(time_stamp_counter());
    }
    Stamp(wall_micros())
}

/// Now, on the event clock, read before any load that follows it: the writer's watermark
/// (`channel::lanes`). `rdtsc` alone may execute after later loads; `lfence` after it
/// waits for it (Intel's and AMD's manuals). Writer side, once per pass.
pub fn now_before_loads() -> Stamp {
    let now = now();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `lfence` exists on every x86-64 processor and only orders instructions.
    unsafe {
        std::arch::x86_64::_mm_lfence()
    };
    now
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn time_stamp_counter() -> u64 {
    // SAFETY: `rdtsc` exists on every x86-64 processor and only reads the counter.
    unsafe { std::arch::x86_64::_rdtsc() }
}

/// Microseconds since the Unix epoch (the vDSO's `clock_gettime`: no syscall).
#[inline]
pub fn wall_micros() -> u64 {
    wall_nanos() / 1000
}

#[inline]
fn wall_nanos() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer; CLOCK_REALTIME always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    (ts.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.tv_nsec as u64)
}

/// A counter reading and the wall clock taken together (the counter read on both sides of
/// the wall clock, its midpoint kept).
#[derive(Clone, Copy, Debug)]
struct Pair {
    ticks: u64,
    nanos: u64,
}

impl Pair {
    fn take() -> Pair {
        #[cfg(target_arch = "x86_64")]
        {
            let before = time_stamp_counter();
            let nanos = wall_nanos();
            let after = time_stamp_counter();
            Pair {
                ticks: before + (after.wrapping_sub(before)) / 2,
                nanos,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let nanos = wall_nanos();
            Pair {
                ticks: nanos,
                nanos,
            }
        }
    }
}

/// How long the first rate measurement takes (the writer thread spins that long once).
const FIRST_RATE_SPAN_NS: u64 = 2_000_000;
/// The rate is measured again over spans of at least this long ...
const RATE_SPAN_NS: u64 = 200_000_000;
/// ... and the span's start moves on after this long, so that a step of the wall clock
/// (a time adjustment) leaves the rate within seconds.
const RATE_WINDOW_NS: u64 = 10_000_000_000;

/// Writer side: turns [`Stamp`]s into microseconds since the Unix epoch. Cold: the writer
/// calls [`Self::refresh`] once per pass over the queue, and [`Self::micros`] per event.
///
/// A stamp is placed relative to the newest pair of readings (taken at the last refresh,
/// milliseconds at most from the events drained after it), so the rate's error moves a
/// time by that distance times the error: nanoseconds.
pub struct StampConverter {
    source: Source,
    /// Where the current rate measurement started.
    span_start: Pair,
    /// The newest pair, the reference for conversions.
    latest: Pair,
    nanos_per_tick: f64,
}

impl StampConverter {
    /// For the source [`choose_source`] chose. With the time-stamp counter, measures its
    /// rate over 2 ms first (the calling thread spins).
    pub fn new() -> StampConverter {
        StampConverter::for_source(source())
    }

    pub fn for_source(source: Source) -> StampConverter {
        let start = Pair::take();
        let mut c = StampConverter {
            source,
            span_start: start,
            latest: start,
            nanos_per_tick: 1.0,
        };
        if source == Source::TimeStampCounter {
            let mut end = Pair::take();
            while end.nanos.saturating_sub(start.nanos) < FIRST_RATE_SPAN_NS {
                std::hint::spin_loop();
                end = Pair::take();
            }
            c.nanos_per_tick = rate(start, end).unwrap_or(1.0);
            c.latest = end;
        }
        c
    }

    /// Takes a new pair of readings, and measures the rate again once enough time passed.
    pub fn refresh(&mut self) {
        if self.source != Source::TimeStampCounter {
            return;
        }
        let now = Pair::take();
        let span = now.nanos.saturating_sub(self.span_start.nanos);
        if span >= RATE_SPAN_NS
            && let Some(r) = rate(self.span_start, now)
        {
            // A wall-clock step inside the span gives a wrong rate: keep the old one and
            // start a new span (a real counter's rate does not move by a percent).
            let steady = (r / self.nanos_per_tick - 1.0).abs() < 0.01;
            if steady {
                self.nanos_per_tick = r;
            }
            if span >= RATE_WINDOW_NS || !steady {
                self.span_start = now;
            }
        }
        self.latest = now;
    }

    /// Microseconds since the Unix epoch of `stamp`.
    #[inline]
    pub fn micros(&self, stamp: Stamp) -> u64 {
        match self.source {
            Source::WallMicros => stamp.0,
            Source::TimeStampCounter => {
                // Stamps lie within milliseconds of the latest pair: the difference fits an
                // i64 and its product a double's 53 bits many times over.
                let ticks = stamp.0.wrapping_sub(self.latest.ticks) as i64;
                let nanos = self.latest.nanos as i64 + (ticks as f64 * self.nanos_per_tick) as i64;
                nanos.max(0) as u64 / 1000
            }
        }
    }
}

impl Default for StampConverter {
    fn default() -> Self {
        StampConverter::new()
    }
}

/// Nanoseconds per tick between two pairs (`None` when the counter did not move).
fn rate(from: Pair, to: Pair) -> Option<f64> {
    let ticks = to.ticks.checked_sub(from.ticks).filter(|&t| t > 0)?;
    let nanos = to.nanos.checked_sub(from.nanos)?;
    Some(nanos as f64 / ticks as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wall_clock_stamp_is_its_own_microseconds() {
        let c = StampConverter::for_source(Source::WallMicros);
        assert_eq!(
            c.micros(Stamp(1_700_000_000_123_456)),
            1_700_000_000_123_456
        );
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn counter_stamps_convert_to_the_wall_clock_within_a_few_microseconds() {
        let mut c = StampConverter::for_source(Source::TimeStampCounter);
        for _ in 0..5 {
            let (before, stamp, after) =
                (wall_micros(), Stamp(time_stamp_counter()), wall_micros());
            c.refresh();
            let t = c.micros(stamp);
            // The stamp lies between the two wall readings (a little slack for the rate
            // measured over 2 ms and the readings' own width).
            assert!(
                t + 50 >= before && t <= after + 50,
                "{before} <= {t} <= {after}"
            );
            std::thread::sleep(std::time::Duration::from_millis(3));
        }
        // Later stamps are later.
        let (a, b) = (
            Stamp(time_stamp_counter()),
            Stamp(time_stamp_counter() + 3_000_000),
        );
        assert!(c.micros(b) > c.micros(a));
    }
}

//! The writer's drain rate, measured: one producer thread sends synthetic events through
//! a real [`Recorder`] while this thread applies them exactly as the writer thread does
//! (intern the stack, update the per-device state). Called through the library's
//! `memsnap_debug_bench_writer` entry point by `cargo bench --bench writer`. Cold.
//!
//! The events: alloc/free pairs over a window of 64 live blocks, 256 sizes, every alloc and
//! free with a stack of `depth` native return addresses drawn from `distinct_stacks`
//! stacks (the outer frames shared by all, the innermost eight varying), hot stacks far
//! more often than cold ones, as in a training loop. Python frames cannot be made up (the
//! writer reads their code objects), so the stacks are native only; a repeated Python
//! stack costs the same hash lookup as a native one.

use super::Writer;
use crate::channel::event::{Api, Event, Kind, Payload};
use crate::channel::queue::{HookSettings, Recorder};
use crate::config::{Config, Context, FRAME_CAPACITY, Stacks};
use std::time::Instant;

/// What one run measured.
pub struct DrainFigures {
    pub nanoseconds: u64,
    /// Distinct stacks the writer interned.
    pub interned: u64,
    /// Growth of the process's resident memory while the events were applied.
    pub rss_growth_bytes: u64,
}

/// Resident set size of this process, from /proc/self/statm (pages).
fn rss_bytes() -> u64 {
    let page = 4096;
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * page)
}

/// xorshift64*: deterministic and dependency-free.
fn next(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

/// Sends `events` events (half allocs, half frees) through the channel and applies them.
pub fn run(events: u64, distinct_stacks: u32, depth: usize) -> DrainFigures {
    let depth = depth.clamp(1, FRAME_CAPACITY);
    let distinct = u64::from(distinct_stacks.max(1));
    let settings = HookSettings {
        stacks: Stacks::Native,
        context: Context::All,
        max_frames: depth,
        dump_on_oom: false,
    };
    let rec: &'static Recorder = Box::leak(Box::new(Recorder::new(1 << 16, settings, -1)));
    let cfg = Config {
        stacks: Stacks::Native,
        at_exit: false,
        ..Config::default()
    };
    let mut writer = Writer::new(rec, cfg);
    let producer = std::thread::spawn(move || {
        const WINDOW: u64 = 64;
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..events {
            let pair = i / 2;
            let (kind, addr) = if i % 2 == 0 {
                (Kind::Alloc, 0x7f00_0000_0000 + pair * 0x1000)
            } else if pair >= WINDOW {
                (Kind::Free, 0x7f00_0000_0000 + (pair - WINDOW) * 0x1000)
            } else {
                (Kind::Alloc, 0x7e00_0000_0000 + pair * 0x1000)
            };
            let mut ev = Event::new(kind, Api::CudaMallocAsync);
            ev.addr = addr;
            ev.size = 512 << (next(&mut rng) % 256 / 16);
            ev.payload = Payload::Stream(0);
            ev.time_us = i;
            // Hot stacks: a quarter of the stacks take three quarters of the events.
            let r = next(&mut rng);
            let id = if !r.is_multiple_of(4) {
                r / 4 % (distinct / 4).max(1)
            } else {
                r / 4 % distinct
            };
            if let Some((idx, slot)) = rec.take_slot() {
                for (k, pc) in slot.native[..depth].iter_mut().enumerate() {
                    let k = k as u64;
                    *pc = if k < 8 {
                        0x5500_0000 + id * 0x100 + k * 8
                    } else {
                        0x6600_0000 + k * 0x40
                    };
                }
                slot.n_native = depth as u16;
                slot.n_python = 0;
                ev.stack = idx;
            }
            rec.push(ev);
        }
    });
    let rss_before = rss_bytes();
    let start = Instant::now();
    let mut applied = 0;
    while applied < events {
        match rec.pop() {
            Some(ev) => {
                writer.apply(ev);
                applied += 1;
            }
            None => std::hint::spin_loop(),
        }
    }
    let nanoseconds = start.elapsed().as_nanos() as u64;
    let _ = producer.join();
    DrainFigures {
        nanoseconds,
        interned: writer.stacks.len() as u64,
        rss_growth_bytes: rss_bytes().saturating_sub(rss_before),
    }
}

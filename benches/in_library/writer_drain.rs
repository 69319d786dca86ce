//! The writer's drain rate, measured: one producer thread sends synthetic events through
//! a real [`Recorder`] while this thread applies them exactly as the writer thread does
//! (intern the stack, update the per-device state); then the same events again in bursts,
//! the writer draining a filled queue alone (one producer thread is slower than the
//! writer, so the first figure is the producer's as much as the writer's). Called through
//! the library's `memsnap_debug_bench_writer` and `memsnap_debug_bench_writer_blocks` entry
//! points by `cargo bench --bench writer`. Cold.
//!
//! The events, on either of memsnap's routes ([`Route`]): blocks allocated and freed over a
//! window of 64 live ones that never overlap (every free finds its allocation), 16 sizes
//! from 512 bytes to 16 MiB, every allocation and free with a stack of `depth` native
//! return addresses drawn from `distinct_stacks` stacks (the outer frames shared by all,
//! the innermost eight varying), hot stacks far more often than cold ones, as in a
//! training loop. Python frames cannot be made up (the writer reads their code objects),
//! so the stacks are native only; a repeated Python stack costs the same hash lookup as a
//! native one.

use super::Writer;
use crate::channel::event::{Api, Event, Kind, Payload};
use crate::channel::queue::{HookSettings, Recorder};
use crate::channel::sent;
use crate::channel::thread;
use crate::config::{Config, Context, FRAME_CAPACITY, Stacks};
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Acquire, Release};
use std::time::Instant;

/// Which events the writer is sent: what it receives on each of memsnap's two routes
/// (docs/PYTORCH.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// CUDA calls (a program's own, or PyTorch's in tensor mode): each allocation and each
    /// free one event with its stack.
    CudaCalls,
    /// PyTorch's caching allocator through its trace tracker: each block handed out (with
    /// its stack), its free requested (with the freeing stack, as under
    /// `MEMSNAP_CONTEXT=all`) and its free completed (no stack), three entries an
    /// allocation, inside 64 segments the allocator took from CUDA calls before the count
    /// starts.
    CachingAllocator,
}

/// What one run measured.
pub struct DrainFigures {
    pub nanoseconds: u64,
    /// Distinct stacks the writer interned.
    pub interned: u64,
    /// Stacks that came in full (a thread's first send of each, or after its table
    /// entry was taken by another stack).
    pub sent_in_full: u64,
    /// Growth of the process's resident memory while the events were applied.
    pub rss_growth_bytes: u64,
    /// The writer's time for the same events drained in bursts from a filled queue (see
    /// [`bursts`]): its rate alone, when one producer thread cannot keep up with it.
    pub burst_ns: u64,
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

/// A channel and a writer for native stacks of `depth` frames (the channel is leaked: the
/// writer holds it for `'static`, as in the library).
fn native_writer(depth: usize) -> (&'static Recorder, Writer) {
    let settings = HookSettings {
        stacks: Stacks::Native,
        context: Context::All,
        max_frames: depth,
        dump_on_oom: false,
    };
    let rec: &'static Recorder = Box::leak(Box::new(Recorder::new(1 << 16, settings, true)));
    // The history kept per device is the library's own setting, `MEMSNAP_MAX_ENTRIES`
    // (default 100,000; a large value keeps the whole history, to measure its memory per
    // event), read by the one configuration parser.
    let cfg = Config {
        stacks: Stacks::Native,
        at_exit: false,
        max_entries: Config::from_env().0.max_entries,
        ..Config::default()
    };
    (rec, Writer::new(rec, cfg))
}

/// A writer ready for `route`'s events: on the caching allocator's, its segments made and
/// its first [`WINDOW`] blocks handed out, applied before anything is counted.
fn prepared_writer(depth: usize, route: Route) -> (&'static Recorder, Writer) {
    let (rec, mut writer) = native_writer(depth);
    if route == Route::CachingAllocator {
        let mut rng = SEED;
        for segment in 0..SEGMENTS {
            // A CUDA allocation, then the allocator's entry taking it as a segment.
            let addr = segment_start(segment);
            for ev in [
                event(Kind::Alloc, Api::CudaMalloc, addr, SEGMENT),
                event(Kind::CacheSegment, API_BLOCKS, addr, SEGMENT),
            ] {
                send(rec, ev, None, depth);
            }
        }
        for pair in 0..WINDOW {
            let (addr, size) = (block_start(pair), block_size(&mut rng));
            send(
                rec,
                event(Kind::BlockAlloc, API_BLOCKS, addr, size),
                None,
                depth,
            );
        }
        while let Some(ev) = writer.reader.next(rec) {
            writer.apply(ev);
        }
    }
    (rec, writer)
}

/// The writer's state after a run: every event must have found what it refers to (a
/// free its allocation, a block its segment), or the bench measured the writer's repair
/// paths instead of the ordinary ones, and its figures are void.
fn check_applied(writer: &Writer) {
    let a = &writer.state.anomalies;
    let misapplied = a.unknown_frees + a.repaired_overlaps + a.unknown_unmaps + a.cache_mismatches;
    assert_eq!(
        misapplied, 0,
        "the writer misapplied the bench's events: void"
    );
    assert_ne!(
        writer.state.cache_check,
        super::state::cache::CacheCheck::Failed,
        "the writer refused the bench's segments: void"
    );
}

/// Sends `events` events through the channel and applies them, twice: once with the
/// producer and the writer running side by side (`nanoseconds`), and once in bursts, the
/// writer draining a filled queue (`burst_ns`). On the CUDA calls' route half are
/// allocations and half frees; on the caching allocator's, a third each are blocks handed
/// out, frees requested and frees completed.
pub fn run(events: u64, distinct_stacks: u32, depth: usize, route: Route) -> DrainFigures {
    let depth = depth.clamp(1, FRAME_CAPACITY);
    let (rec, mut writer) = prepared_writer(depth, route);
    // Unlimited: the producer runs as fast as the writer takes its events.
    let allowed: &'static AtomicU64 = Box::leak(Box::new(AtomicU64::new(u64::MAX)));
    let producer =
        std::thread::spawn(move || produce(rec, allowed, events, distinct_stacks, depth, route));
    let rss_before = rss_bytes();
    let start = Instant::now();
    let mut applied = 0;
    while applied < events {
        match writer.reader.next(rec) {
            Some(ev) => {
                writer.apply(ev);
                applied += 1;
            }
            None => std::hint::spin_loop(),
        }
    }
    let nanoseconds = start.elapsed().as_nanos() as u64;
    let _ = producer.join();
    let rss_growth_bytes = rss_bytes().saturating_sub(rss_before);
    check_applied(&writer);
    let (interned, sent_in_full) = (writer.stacks.len() as u64, writer.stacks.received_in_full);
    // Gone before the second run, so that the process's peak memory is one writer's.
    drop(writer);
    DrainFigures {
        nanoseconds,
        interned,
        sent_in_full,
        rss_growth_bytes,
        burst_ns: bursts(events, distinct_stacks, depth, route),
    }
}

/// The same events, in bursts: the producer fills the queue with [`BURST`] events while the
/// writer waits, then the writer drains them, timed, the producer waiting. The sum of the
/// drain times: what the writer alone takes for `events` (the queue's lines already
/// written, none crossing between the cores while it drains).
fn bursts(events: u64, distinct_stacks: u32, depth: usize, route: Route) -> u64 {
    /// Half the queue (1 << 16): the producer never waits for room.
    const BURST: u64 = 1 << 15;
    let (rec, mut writer) = prepared_writer(depth, route);
    let allowed: &'static AtomicU64 = Box::leak(Box::new(AtomicU64::new(0)));
    let producer =
        std::thread::spawn(move || produce(rec, allowed, events, distinct_stacks, depth, route));
    let mut applied = 0u64;
    let mut drain_ns = 0u64;
    while applied < events {
        let burst = BURST.min(events - applied);
        allowed.store(applied + burst, Release);
        // Filled, or no longer filling: a thread's stacks sent in full wait for stack slots
        // (4,096) that only the writer frees (then the producer goes on while this drain
        // runs; it happens in the first bursts, while every stack's first send comes).
        let mut seen = (0, Instant::now());
        loop {
            let queued = rec.queued();
            if queued >= burst {
                break;
            }
            if queued != seen.0 {
                seen = (queued, Instant::now());
            } else if seen.1.elapsed() >= std::time::Duration::from_millis(1) {
                break;
            }
            std::hint::spin_loop();
        }
        let queued = rec.queued().min(burst);
        let start = Instant::now();
        for _ in 0..queued {
            let Some(ev) = writer.reader.next(rec) else {
                break;
            };
            writer.apply(ev);
            applied += 1;
        }
        drain_ns += start.elapsed().as_nanos() as u64;
    }
    allowed.store(u64::MAX, Release);
    let _ = producer.join();
    check_applied(&writer);
    drain_ns
}

/// Live blocks at any time: each event's free is of the block allocated this many before.
const WINDOW: u64 = 64;
/// The generator's start, the same in every run.
const SEED: u64 = 0x9e37_79b9_7f4a_7c15;
/// Blocks one largest size (16 MiB) apart never overlap, so every free finds its
/// allocation, as in a program: with 4 KiB apart, three allocations in four closed an
/// overlapping one as a lost free and three frees in four were unknown, and the bench
/// measured that repair path instead of the ordinary one (before 2026-11-26).
const SPACING: u64 = 16 << 20;
/// The caching allocator's segments: 64 of 64 MiB, four block places each, so that the
/// blocks of neighbouring allocations often share a segment (the writer then finds the
/// next live block to size the new one), 128 MiB apart (never touching).
const SEGMENTS: u64 = 64;
const SEGMENT: u64 = 4 * SPACING;
/// What the caching allocator's entries are recorded as.
const API_BLOCKS: Api = Api::CachingAllocator;

fn segment_start(segment: u64) -> u64 {
    0x7f00_0000_0000 + segment * 2 * SEGMENT
}

/// Where the caching allocator's `pair`th block goes: the places of all segments in
/// turn, 256 of them, so a place is free again long before it comes round (64 live).
fn block_start(pair: u64) -> u64 {
    let place = pair % (SEGMENTS * 4);
    segment_start(place / 4) + place % 4 * SPACING
}

/// One of 16 sizes from 512 bytes to 16 MiB.
fn block_size(rng: &mut u64) -> u64 {
    512 << (next(rng) % 256 / 16)
}

/// An event of `kind` from `api` at `addr` of `size` bytes, stamped now, without a stack.
fn event(kind: Kind, api: Api, addr: u64, size: u64) -> Event {
    let now = crate::process::clock::now();
    Event::stackless(kind, api, 0, 0, addr, size, Payload::Stream(0), now)
}

/// Sends `ev` as a hook does: with `stack`, the thread's scratch stack filled with stack
/// number `stack`'s `depth` frames and sent (in full the first time, by hash after).
fn send(rec: &'static Recorder, ev: Event, stack: Option<u64>, depth: usize) {
    let Some(id) = stack else {
        thread::with_thread(|hook| rec.push(hook, ev));
        return;
    };
    let thread = sent::this_thread().expect("per-thread state");
    let slot = &mut thread.scratch;
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
    let hash = slot.identity_hash();
    thread::with_thread(|hook| rec.push_with_stack(hook, ev, thread, hash, |_| {}));
}

/// The producer thread: `events` events of `route`, each sent once `allowed` passes its
/// index.
fn produce(
    rec: &'static Recorder,
    allowed: &AtomicU64,
    events: u64,
    distinct_stacks: u32,
    depth: usize,
    route: Route,
) {
    let distinct = u64::from(distinct_stacks.max(1));
    // Hot stacks: a quarter of the stacks take three quarters of the events.
    let pick_stack = |rng: &mut u64| {
        let r = next(rng);
        if !r.is_multiple_of(4) {
            r / 4 % (distinct / 4).max(1)
        } else {
            r / 4 % distinct
        }
    };
    let mut rng = SEED;
    for i in 0..events {
        while i >= allowed.load(Acquire) {
            std::hint::spin_loop();
        }
        match route {
            Route::CudaCalls => {
                let pair = i / 2;
                let (kind, addr) = if i % 2 == 0 {
                    (Kind::Alloc, 0x7f00_0000_0000 + pair * SPACING)
                } else if pair >= WINDOW {
                    (Kind::Free, 0x7f00_0000_0000 + (pair - WINDOW) * SPACING)
                } else {
                    (Kind::Alloc, 0x7e00_0000_0000 + pair * SPACING)
                };
                let size = block_size(&mut rng);
                let stack = pick_stack(&mut rng);
                let ev = event(kind, Api::CudaMallocAsync, addr, size);
                send(rec, ev, Some(stack), depth);
            }
            Route::CachingAllocator => {
                // The first `WINDOW` blocks were handed out before the count.
                let pair = i / 3 + WINDOW;
                let freed = block_start(pair - WINDOW);
                let stack = pick_stack(&mut rng);
                let (kind, addr, size, stack) = match i % 3 {
                    0 => (
                        Kind::BlockAlloc,
                        block_start(pair),
                        block_size(&mut rng),
                        Some(stack),
                    ),
                    1 => (Kind::BlockFreeRequested, freed, 0, Some(stack)),
                    _ => (Kind::BlockFreeCompleted, freed, 0, None),
                };
                send(rec, event(kind, API_BLOCKS, addr, size), stack, depth);
            }
        }
    }
}

/// What answering `memsnap top` costs the writer, measured.
pub struct LiveFigures {
    /// Writer time per request after the first (every `serve_live` pass that worked on
    /// it), sorted.
    pub per_request_ns: Vec<u64>,
    /// The first request: symbolizes every stack and sends every frame.
    pub first_request_ns: u64,
    /// Bytes of the first answer (every frame) and of the last (no new frame).
    pub first_answer_bytes: u64,
    pub answer_bytes: u64,
}

/// Fills a writer with `live` live allocations whose stacks (of `depth` native frames) are
/// drawn from `distinct_stacks`, then has a client ask for `requests` samples over the real
/// socket; each request's writer time is the sum of the drain-loop passes that served it
/// (accepting, reading, building the sample, encoding, sending). The client asks as
/// `memsnap top` does, for the frames it does not hold yet; the first request, which
/// symbolizes every stack and carries every frame, is reported apart.
pub fn live_requests(live: u64, distinct_stacks: u32, depth: usize, requests: u32) -> LiveFigures {
    use crate::snapshot::live::{self as protocol, Answer, MAX_ANSWER, Request};
    let depth = depth.clamp(1, FRAME_CAPACITY);
    let (rec, mut writer) = native_writer(depth);
    // Return addresses inside this library's own code, so that stacks symbolize to
    // distinct frames (made-up addresses all become the same `??` frame and one group).
    let (text, text_len) = own_code().unwrap_or((0x5500_0000, 1 << 20));
    let mut rng = SEED;
    for i in 0..live {
        let (addr, size) = (0x7f00_0000_0000 + i * 0x1000, 512 << (next(&mut rng) % 8));
        let (api, now) = (Api::CudaMallocAsync, crate::process::clock::now());
        let ev = Event::stackless(Kind::Alloc, api, 0, 0, addr, size, Payload::Stream(0), now);
        let id = next(&mut rng) % u64::from(distinct_stacks.max(1));
        let thread = sent::this_thread().expect("per-thread state");
        let slot = &mut thread.scratch;
        for (k, pc) in slot.native[..depth].iter_mut().enumerate() {
            // The innermost frames vary with the stack, the outer ones are shared.
            let spread = if k < 4 {
                id * 7919 + k as u64 * 104_729
            } else {
                k as u64 * 104_729
            };
            *pc = text + (spread * 16) % text_len;
        }
        slot.n_native = depth as u16;
        slot.n_python = 0;
        let hash = slot.identity_hash();
        thread::with_thread(|hook| rec.push_with_stack(hook, ev, thread, hash, |_| {}));
        let ev = writer.reader.next(rec).expect("just sent");
        writer.apply(ev);
    }
    let uid = writer.live.uid;
    let path = protocol::socket_path(uid, writer.id.pid);
    let client = std::thread::spawn(move || {
        // As `memsnap top` does: the frames and stacks it holds are not sent again.
        let (mut known_frames, mut known_stacks) = (0u32, 0u32);
        let mut sizes = Vec::new();
        for _ in 0..=requests {
            let mut s = std::os::unix::net::UnixStream::connect(&path).expect("connect");
            let ask = Request::Sample {
                known_frames,
                known_stacks,
            };
            std::io::Write::write_all(&mut s, &protocol::encode(&ask)).unwrap();
            let answer: Answer = protocol::read_message(&mut s, MAX_ANSWER).expect("answer");
            let Answer::Sample(sample) = answer else {
                panic!("not a sample")
            };
            known_frames = sample.frames_from + sample.frames.len() as u32;
            known_stacks = sample.stacks_from + sample.stacks.len() as u32;
            sizes.push(protocol::encode(&Answer::Sample(sample)).len() as u64);
        }
        sizes
    });
    let mut per_request_ns = Vec::new();
    let mut first_request_ns = 0;
    let mut current = 0u64;
    while writer.live.answered <= u64::from(requests) {
        let (busy_before, answered_before) = (writer.live.busy(), writer.live.answered);
        let start = Instant::now();
        writer.serve_live();
        let ns = start.elapsed().as_nanos() as u64;
        assert_eq!(writer.live.refused, 0, "a benchmark request was refused");
        // Passes with nobody connected are the idle polls the drain loop makes anyway.
        if busy_before || writer.live.busy() {
            current += ns;
        }
        if writer.live.answered > answered_before {
            // Sending what did not fit in the socket at once is charged to the next one.
            if answered_before > 0 {
                per_request_ns.push(current);
            } else {
                first_request_ns = current;
            }
            current = 0;
        }
    }
    // The last answer may still be leaving.
    while writer.live.busy() {
        writer.serve_live();
    }
    let sizes = client.join().expect("client");
    writer.live.close();
    per_request_ns.sort_unstable();
    LiveFigures {
        per_request_ns,
        first_request_ns,
        first_answer_bytes: sizes.first().copied().unwrap_or(0),
        answer_bytes: sizes.last().copied().unwrap_or(0),
    }
}

/// Start and length of this library's executable mapping, from /proc/self/maps.
fn own_code() -> Option<(u64, u64)> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        let range = f.next()?;
        let perms = f.next()?;
        let path = f.nth(3)?;
        if !perms.starts_with("r-x") || !path.ends_with("libmemsnap.so") {
            return None;
        }
        let (a, b) = range.split_once('-')?;
        let (a, b) = (
            u64::from_str_radix(a, 16).ok()?,
            u64::from_str_radix(b, 16).ok()?,
        );
        Some((a, b - a))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::writer::state::Action;

    /// Sends `events` of `route` from this thread and applies them; the writer after.
    fn applied(route: Route, events: u64, distinct_stacks: u32) -> Writer {
        let (rec, mut writer) = prepared_writer(8, route);
        let allowed = AtomicU64::new(u64::MAX);
        produce(rec, &allowed, events, distinct_stacks, 8, route);
        let mut count = 0;
        while let Some(ev) = writer.reader.next(rec) {
            writer.apply(ev);
            count += 1;
        }
        assert_eq!(count, events);
        check_applied(&writer);
        writer
    }

    fn actions(writer: &Writer, action: Action) -> usize {
        let trace = &writer.state.devices[0].trace;
        trace.iter().filter(|r| r.action == action).count()
    }

    #[test]
    fn the_caching_allocators_entries_are_what_the_writer_rebuilds_it_from() {
        let writer = applied(Route::CachingAllocator, 3 * 500, 100);
        let dev = &writer.state.devices[0];
        assert_eq!(dev.cache.segments.len(), SEGMENTS as usize);
        assert_eq!(dev.cache.reserved_bytes, SEGMENTS * SEGMENT);
        // The window: the last 64 of the 500 counted blocks, each with its stack.
        let live: Vec<u64> = dev.cache.blocks.keys().copied().collect();
        let mut window: Vec<u64> = (500..500 + WINDOW).map(block_start).collect();
        window.sort_unstable();
        assert_eq!(live, window);
        assert!(dev.cache.blocks.values().all(|b| b.stack.is_some()));
        let allocated: u64 = dev.cache.blocks.values().map(|b| b.size).sum();
        assert_eq!(dev.cache.allocated_bytes, allocated);
        // PyTorch's history: the segments, then an entry for each of the allocator's.
        assert_eq!(actions(&writer, Action::SegmentAlloc), SEGMENTS as usize);
        assert_eq!(actions(&writer, Action::Alloc), (WINDOW + 500) as usize);
        assert_eq!(actions(&writer, Action::FreeRequested), 500);
        assert_eq!(actions(&writer, Action::FreeCompleted), 500);
        assert!((1..=100).contains(&writer.stacks.len()));
    }

    #[test]
    #[should_panic(expected = "misapplied the bench's events: void")]
    fn a_run_with_an_event_the_writer_could_not_place_is_void() {
        let (rec, mut writer) = prepared_writer(8, Route::CachingAllocator);
        // A free of a block never handed out.
        let stray = event(Kind::BlockFreeCompleted, API_BLOCKS, block_start(WINDOW), 0);
        send(rec, stray, None, 8);
        while let Some(ev) = writer.reader.next(rec) {
            writer.apply(ev);
        }
        check_applied(&writer);
    }

    #[test]
    fn the_cuda_calls_events_free_what_they_allocated() {
        let writer = applied(Route::CudaCalls, 2 * 500, 100);
        let dev = &writer.state.devices[0];
        // The first 64 pairs allocate twice (nothing to free yet), the other 436 free.
        assert_eq!(dev.allocs.len(), (2 * WINDOW) as usize);
        assert_eq!(actions(&writer, Action::Alloc), 500 + WINDOW as usize);
        assert_eq!(
            actions(&writer, Action::FreeRequested),
            500 - WINDOW as usize
        );
        assert!((1..=100).contains(&writer.stacks.len()));
    }
}

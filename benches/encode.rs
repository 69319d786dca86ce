//! Snapshot encoding speed and size: 100k trace entries with 30-frame stacks
//! (1000 unique stacks over 3000 unique frames), encoded by `pickle_write`.
//!
//! Run: `cargo bench -p memsnap-format --bench encode` (release profile). Prints the time per encode
//! (min and median of several runs) and the file size, and leaves the file in
//! `target/encode-bench.pickle` so it can be checked and compared with Python's pickle
//! (docs/BENCHMARKS.md, "Snapshot encoding").
use memsnap_format::model::{
    Action, Block, BlockState, Frame, Meta, Segment, Snapshot, StackId, TraceEntry,
};
use memsnap_format::pickle_write;
use std::time::Instant;

const EVENTS: usize = 100_000;
const STACKS: usize = 1000;
const FRAMES: usize = 3000;
const DEPTH: usize = 30;
const RUNS: usize = 15;

/// xorshift64*: deterministic and dependency-free.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// A cudaMalloc-level history (docs/FORMAT.md#one-segment-per-allocation): segment_alloc, alloc / free_requested,
/// free_completed, segment_free, with up to 400 live allocations. Ends with the live set
/// as `segments`, so the file is a valid snapshot.
fn build() -> Snapshot {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let frames = (0..FRAMES)
        .map(|i| Frame {
            name: format!("torch::autograd::some_namespace::function_number_{i}"),
            filename: format!(
                "/usr/lib/python3.11/site-packages/torch/module_{}.py",
                i % 200
            ),
            line: (i * 7 % 2000) as i64,
        })
        .collect();
    let stacks = (0..STACKS)
        .map(|_| (0..DEPTH).map(|_| rng.below(FRAMES) as u32).collect())
        .collect();
    let mut events = Vec::with_capacity(EVENTS + 8);
    // (addr, size, stack)
    let mut live: Vec<(i64, i64, StackId)> = Vec::new();
    let mut next_addr: i64 = 0x7f00_0000_0000;
    let mut time_us: i64 = 1_795_314_852_136_082;
    let entry = |action, addr, size, time_us, stack| TraceEntry {
        action,
        addr,
        size,
        stream: 0,
        time_us,
        stack: Some(stack),
        device_free: None,
        user_metadata: Some("cudaMalloc".into()),
    };
    while events.len() + 5 <= EVENTS {
        time_us += 1 + rng.below(50) as i64;
        if live.len() < 400 && (live.is_empty() || rng.below(2) == 0) {
            let size = 512 * (1 + rng.below(1 << 14) as i64);
            let stack = rng.below(STACKS) as StackId;
            let addr = next_addr;
            next_addr += (size + 0x1f_ffff) & !0x1f_ffff;
            events.push(entry(Action::SegmentAlloc, addr, size, time_us, stack));
            events.push(entry(Action::Alloc, addr, size, time_us, stack));
            live.push((addr, size, stack));
        } else {
            let (addr, size, stack) = live.swap_remove(rng.below(live.len()));
            events.push(entry(Action::FreeRequested, addr, size, time_us, stack));
            events.push(entry(Action::FreeCompleted, addr, size, time_us, stack));
            events.push(entry(Action::SegmentFree, addr, size, time_us, stack));
        }
    }
    live.sort();
    let segments = live
        .iter()
        .map(|&(addr, size, stack)| Segment {
            device: 0,
            address: addr,
            total_size: size,
            stream: 0,
            segment_type: "large".into(),
            segment_pool_id: (0, 0),
            is_expandable: false,
            stack: Some(stack),
            blocks: vec![Block {
                address: addr,
                size,
                requested_size: size,
                state: BlockState::ActiveAllocated,
                stack: Some(stack),
            }],
        })
        .collect();
    Snapshot {
        frames,
        stacks,
        segments,
        device_traces: vec![events],
        allocator_settings: vec![("PYTORCH_CUDA_ALLOC_CONF".into(), Meta::Str(String::new()))],
        memsnap: Vec::new(),
        step_marks: Vec::new(),
    }
}

fn main() {
    let snap = build();
    let n_events = snap.device_traces[0].len();
    let mut times = Vec::with_capacity(RUNS);
    let mut bytes = Vec::new();
    for _ in 0..RUNS {
        let t = Instant::now();
        bytes = pickle_write::to_bytes(&snap);
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    let out =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/encode-bench.pickle");
    let t = Instant::now();
    let file = std::fs::File::create(&out).expect("create target/encode-bench.pickle");
    pickle_write::write_to(&snap, file).expect("write target/encode-bench.pickle");
    let write_ms = t.elapsed().as_secs_f64() * 1e3;
    println!(
        "encode: {n_events} events, {STACKS} stacks x {DEPTH} frames, {FRAMES} frames, {} segments",
        snap.segments.len()
    );
    println!(
        "to_bytes: min {:.2} ms, median {:.2} ms over {RUNS} runs; {} bytes ({:.1} bytes/event)",
        times[0],
        times[RUNS / 2],
        bytes.len(),
        bytes.len() as f64 / n_events as f64
    );
    println!("write_to(File): {write_ms:.2} ms -> {}", out.display());
}

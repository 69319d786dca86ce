//! Turns a hooked call's outcome into an [`Event`] on the channel.
//!
//! Hot. Called only from the outermost hooked call of a thread, after the real call (for
//! allocations) or before it (for frees). No allocation, no lock, no panic; the only extra
//! driver call is an allocation's device query (`cuCtxGetDevice`, a thread-local read in
//! the driver; not made in a process that sees one device), which the interposition layer
//! supplies through [`Devices`]. The out-of-memory path is
//! cold: it asks the driver for free memory and waits, bounded, for the writer to persist
//! the snapshot before the failing call returns.

use crate::capture;
use crate::channel::event::{Api, Event, Kind, MAX_OOM_DUMPS, Payload, PoolId, StepOrigin};
use crate::channel::handshake::{self, OOM_DUMPS};
use crate::channel::queue::Recorder;
use crate::channel::recording;
use crate::channel::sent;
use crate::channel::thread::HookThread;
use crate::config::{Context, Stacks};
use crate::guard::Scope;
use crate::prefetch::{prefetch_for_write, prefetch_line};
use crate::process::clock::{self, Stamp, now};
use crate::process::hook_line::HOOK_LINE;
use std::sync::atomic::{AtomicU64, Ordering::*};
use std::time::Duration;

/// What recording needs to know about devices, answered by the real driver.
pub trait Devices {
    /// The device of the calling thread's current context (0 when unknown).
    fn current(&self) -> i32;
    /// `(free, total)` bytes of the current device, if the driver answers.
    fn memory(&self) -> Option<(u64, u64)>;
    /// Asks how many devices the process sees, so that [`Devices::current`] can answer
    /// without the driver when there is one. Cold: called at a device's first recorded
    /// allocation, when the driver is known to be initialized (the count is fixed then).
    fn count_devices(&self);
}

/// The outcome of a call, as the wrapper saw it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Success,
    OutOfMemory,
    /// Any other error: nothing happened, nothing is recorded.
    Failed,
}

/// Who sends: the recorder and the calling thread's hook state (from its nesting guard,
/// so that the hook looks its thread-local up once). The recorder's settings are read
/// where they are needed, from the hook line (`recording::stacks` and the others).
#[derive(Clone, Copy)]
pub struct Sender<'a> {
    pub rec: &'static Recorder,
    pub thread: &'a HookThread,
}

impl Sender<'_> {
    /// An event of the calling thread at `time`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn event(
        &self,
        time: Stamp,
        kind: Kind,
        api: Api,
        device: i32,
        addr: u64,
        size: u64,
        payload: Payload,
    ) -> Event {
        let tid = self.thread.tid();
        Event::stackless(kind, api, device, tid, addr, size, payload, time)
    }
}

/// Captures the caller's stack if configured, then sends the event with it (by hash when
/// this thread sent the same stack before: see [`sent`]).
///
/// Always inlined, as are the functions that call it from a hook: the native walk starts
/// where [`capture::capture`] is inlined, and each out-of-line function between the hook
/// and that point would be one more unwinder step on every event.
#[inline(always)]
fn send(by: Sender, ev: Event, with_stack: bool) {
    let rec = by.rec;
    // The recorder's settings from the hook line (its own copy is on a line an event
    // would wait for).
    let stacks = recording::stacks();
    if with_stack && stacks != Stacks::None {
        let Some(thread) = sent::of(by.thread) else {
            // A thread past its exit destructors, or no memory for its state: the event
            // goes without its stack, counted.
            rec.counters.lost_stacks.fetch_add(1, Relaxed);
            rec.push(by.thread, ev);
            return;
        };
        // The send's first lines (the thread's lane slot, its stack state's shared line)
        // are asked for now, so that they arrive while the walks run: in a real step the
        // work between two events has pushed them out of the nearer caches. (The previous
        // push asked for the slot too, but the writer, once caught up, reads its mark and
        // takes the line back; a walk is time enough to bring it again.)
        if let Some(line) = rec.next_push_line(by.thread) {
            prefetch_for_write(line);
        }
        prefetch_line(thread.send_line() as u64);
        capture::timed!(StackEventTicks, {
            let hash = capture::capture_unfinished(
                &mut thread.scratch,
                &mut thread.trail,
                stacks,
                recording::max_frames(),
            );
            capture::timed!(
                SendTicks,
                rec.push_with_stack(by.thread, ev, thread, hash, capture::finish)
            );
        });
        capture::count!(StackEvents, 1);
    } else {
        capture::timed!(PushTicks, rec.push(by.thread, ev));
        capture::count!(Pushes, 1);
    }
}

/// Devices whose total memory is remembered, one bit each, on the line every hooked call
/// reads (`process::hook_line`): the handshake's slots are on lines of their own, which
/// each allocation would otherwise wait for.
const DEVICES_WITH_TOTAL: &AtomicU64 = &HOOK_LINE.devices_with_total;
// One bit for each of the handshake's slots, and a slot for each bit: a device with a bit
// and no slot would take the slow path on every allocation.
const _: () = assert!(handshake::MAX_DEVICES == 64);

/// Remembers device `device`'s total memory the first time it allocates (one extra
/// memory query per device per process), for the stats' utilization column, and lets the
/// driver count the devices then (a device query saved on every later allocation of a
/// process that sees one).
#[inline]
fn note_device_total(devices: &impl Devices, device: i32) {
    let known = u32::try_from(device)
        .ok()
        .and_then(|d| 1u64.checked_shl(d))
        .is_none_or(|bit| DEVICES_WITH_TOTAL.load(Relaxed) & bit != 0);
    if !known {
        note_device_total_slow(devices, device);
    }
}

#[cold]
#[inline(never)]
fn note_device_total_slow(devices: &impl Devices, device: i32) {
    let Some(slot) = handshake::device_total_slot(device) else {
        return;
    };
    devices.count_devices();
    if let Some((_, total)) = devices.memory() {
        slot.store(total, Relaxed);
        // Only after the total: a bit set means the slot holds it.
        DEVICES_WITH_TOTAL.fetch_or(1 << device, Relaxed);
    }
}

/// The outcome of an allocating call: an event on success, the OOM path on
/// out-of-memory, nothing on any other error.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn allocation(
    by: Sender,
    devices: &impl Devices,
    outcome: Outcome,
    kind: Kind,
    api: Api,
    addr: u64,
    size: u64,
    stream: u64,
) {
    match outcome {
        Outcome::Success => {
            if addr == 0 {
                return; // zero-byte requests succeed without memory
            }
            capture::timed_event!({
                let device = capture::timed!(DeviceTicks, devices.current());
                capture::count!(DeviceQueries, 1);
                note_device_total(devices, device);
                let payload = Payload::Stream(stream);
                let ev = by.event(now(), kind, api, device, addr, size, payload);
                send(by, ev, true);
            });
        }
        Outcome::OutOfMemory => out_of_memory(by, devices, api, size, stream),
        Outcome::Failed => {}
    }
}

/// A free, recorded before the real call releases the address.
#[inline(always)]
pub fn release(by: Sender, kind: Kind, api: Api, addr: u64, size: u64, stream: u64) {
    capture::timed_event!({
        let with_stack = recording::context() == Context::All;
        let payload = Payload::Stream(stream);
        let ev = by.event(now(), kind, api, -1, addr, size, payload);
        send(by, ev, with_stack);
    });
}

/// Virtual-memory bookkeeping (create/release/reserve/free): no stack needed.
#[inline]
pub fn vmm(by: Sender, kind: Kind, api: Api, device: i32, addr: u64, size: u64, handle: u64) {
    let payload = Payload::Handle(handle);
    let ev = by.event(now(), kind, api, device, addr, size, payload);
    send(by, ev, false);
}

/// `cuMemMap` (after success) and `cuMemUnmap` (before the call).
#[inline]
pub fn mapping(by: Sender, kind: Kind, addr: u64, size: u64, handle: u64) {
    let (api, with_stack) = match kind {
        Kind::Map => (Api::CuMemMap, true),
        _ => (Api::CuMemUnmap, recording::context() == Context::All),
    };
    let payload = Payload::Handle(handle);
    let ev = by.event(now(), kind, api, -1, addr, size, payload);
    send(by, ev, with_stack);
}

/// A step boundary marked by `origin` (`memsnap_step()`, or PyTorch's optimizer step through
/// memsnap's hook): one event on the queue, no stack. Cold. False when this process is not
/// recording (a step before its first CUDA allocation starts nothing).
pub fn step(origin: StepOrigin) -> bool {
    let scope = Scope::enter();
    if !recording::is_active() {
        return false;
    }
    let Some(rec) = recording::recorder_if_started() else {
        return false;
    };
    let payload = Payload::Step(origin);
    let ev = Event::stackless(Kind::Step, Api::Memsnap, 0, 0, 0, 0, payload, now());
    rec.push(scope.thread(), ev);
    true
}

/// PyTorch frees its cache and retries after an OOM: the retry's failure within this
/// window belongs to the same episode and does not dump again.
const OOM_DEBOUNCE_US: u64 = 2_000_000;
/// Longest an OOM-ing call waits for its snapshot.
const OOM_WAIT: Duration = Duration::from_secs(30);
/// When the current OOM episode was last extended (0: none yet).
static OOM_LAST_US: AtomicU64 = AtomicU64::new(0);

/// A non-zero ticket when this OOM should be dumped (first of an episode, while fewer than
/// [`MAX_OOM_DUMPS`] were), else 0.
fn oom_dump_ticket(rec: &Recorder) -> u8 {
    if !rec.settings.dump_on_oom {
        return 0;
    }
    let now = clock::wall_micros();
    let last = OOM_LAST_US.load(Acquire);
    if last != 0 && now.saturating_sub(last) < OOM_DEBOUNCE_US {
        return 0;
    }
    if OOM_LAST_US
        .compare_exchange(last, now, AcqRel, Acquire)
        .is_err()
    {
        return 0; // another thread's OOM opened this episode
    }
    u8::try_from(OOM_DUMPS.ask())
        .ok()
        .filter(|&ticket| ticket <= MAX_OOM_DUMPS)
        .unwrap_or(0)
}

/// Out of memory: record the request with free memory and the stack, and if this OOM
/// starts a new episode, wait until the writer has written the snapshot.
#[cold]
#[inline(never)]
fn out_of_memory(by: Sender, devices: &impl Devices, api: Api, size: u64, stream: u64) {
    let device = devices.current();
    let free_bytes = devices.memory().map(|(free, _)| free);
    oom_episode(by, api, device, free_bytes, size, stream);
}

/// The OOM event, and the wait for its snapshot when it opens an episode.
#[inline(always)]
fn oom_episode(by: Sender, api: Api, device: i32, free_bytes: Option<u64>, size: u64, stream: u64) {
    let rec = by.rec;
    let dump_ticket = oom_dump_ticket(rec);
    let payload = Payload::Oom {
        free_bytes,
        stream,
        dump_ticket,
    };
    let ev = by.event(now(), Kind::Oom, api, device, 0, size, payload);
    send(by, ev, true);
    if dump_ticket != 0 {
        rec.wake_writer();
        rec.wait_for(|| OOM_DUMPS.is_done(u64::from(dump_ticket)), OOM_WAIT);
        // The episode ends when the caller gets its error back, not when it asked.
        OOM_LAST_US.store(clock::wall_micros(), Release);
    }
}

/// A trace entry of PyTorch's caching allocator (`pytorch::on_trace_entry`): a block
/// handed out (with the stack that asked for it), a free requested (with its stack under
/// `MEMSNAP_CONTEXT=all`) or a free completed (segments: [`cache_segment`]).
/// `device` and `time` come with the entry: no driver query, no clock read.
#[inline(always)]
pub fn block(by: Sender, kind: Kind, device: i32, addr: u64, size: u64, stream: u64, time: Stamp) {
    capture::timed_event!({
        let with_stack = match kind {
            Kind::BlockAlloc => true,
            Kind::BlockFreeRequested => recording::context() == Context::All,
            _ => false,
        };
        let payload = Payload::Stream(stream);
        let ev = by.event(
            time,
            kind,
            Api::CachingAllocator,
            device,
            addr,
            size,
            payload,
        );
        send(by, ev, with_stack);
    });
}

/// A segment PyTorch's caching allocator took (`Kind::CacheSegment`) or mapped
/// (`Kind::CacheSegmentMap`), from its trace entry, then, when `pool` is a private one (a
/// CUDA graph's), a `Kind::CachePool` naming it, on the same lane right behind: the writer
/// applies them in that order. No stack: the CUDA call before it has one.
#[cold]
#[inline(never)]
#[allow(clippy::too_many_arguments)] // one per field of the trace entry
pub fn cache_segment(
    by: Sender,
    kind: Kind,
    device: i32,
    addr: u64,
    size: u64,
    stream: u64,
    time: Stamp,
    pool: PoolId,
) {
    let allocator_event = |kind, payload| {
        let api = Api::CachingAllocator;
        by.event(time, kind, api, device, addr, size, payload)
    };
    capture::timed_event!(send(
        by,
        allocator_event(kind, Payload::Stream(stream)),
        false
    ));
    if pool.is_private() {
        send(
            by,
            allocator_event(Kind::CachePool, Payload::Pool(pool)),
            false,
        );
    }
}

/// PyTorch's caching allocator gave up on a request of `size` bytes (after freeing its
/// cache and retrying, or at its own memory limit); `free_bytes` is what CUDA reported.
#[cold]
#[inline(never)]
pub fn allocator_oom(by: Sender, device: i32, size: u64, free_bytes: u64, stream: u64) {
    oom_episode(
        by,
        Api::CachingAllocator,
        device,
        Some(free_bytes),
        size,
        stream,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A driver that answers the memory query `answers` (or not), counting the memory
    /// queries and the device counts.
    struct Counted {
        answers: bool,
        queries: Cell<u32>,
        counts: Cell<u32>,
    }

    impl Counted {
        fn new(answers: bool) -> Counted {
            Counted {
                answers,
                queries: Cell::new(0),
                counts: Cell::new(0),
            }
        }
    }

    impl Devices for Counted {
        fn current(&self) -> i32 {
            0
        }
        fn memory(&self) -> Option<(u64, u64)> {
            self.queries.set(self.queries.get() + 1);
            self.answers.then_some((1, 7 << 30))
        }
        fn count_devices(&self) {
            self.counts.set(self.counts.get() + 1);
        }
    }

    // The devices here are numbers no other test of this process allocates on: the bits
    // and the slots are the process's.
    #[test]
    fn a_devices_total_is_asked_for_until_the_driver_answers_then_never_again() {
        let silent = Counted::new(false);
        note_device_total(&silent, 62);
        note_device_total(&silent, 62);
        assert_eq!(silent.queries.get(), 2, "no answer yet: asked again");
        assert_eq!(handshake::device_total(62), 0);
        let driver = Counted::new(true);
        for _ in 0..3 {
            note_device_total(&driver, 62);
            note_device_total(&driver, 63);
        }
        assert_eq!(driver.queries.get(), 2, "once per device");
        assert_eq!(
            driver.counts.get(),
            2,
            "devices counted at each one's first allocation"
        );
        assert_eq!(handshake::device_total(62), 7 << 30);
        assert_eq!(handshake::device_total(63), 7 << 30);
        assert_eq!(DEVICES_WITH_TOTAL.load(Relaxed) & (3 << 62), 3 << 62);
    }

    #[test]
    fn a_device_without_a_slot_is_never_asked_about() {
        let driver = Counted::new(true);
        for device in [-1, 64, 65, i32::MAX, i32::MIN] {
            note_device_total(&driver, device);
        }
        assert_eq!(driver.queries.get(), 0);
        assert_eq!(driver.counts.get(), 0);
    }
}

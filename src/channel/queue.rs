//! The bounded, lock-free, lossless path from hooks to the writer thread.
//!
//! Hot. Pre-allocated structures, created once on the first CUDA event:
//! - each recording thread's own ring ([`lanes`](super::lanes)), where the event clock
//!   orders events across cores;
//! - `events`: the shared queue, a crossbeam `ArrayQueue<Event>` (no allocation, no lock,
//!   no thread-local on push; docs/DEPENDENCIES.md#crossbeam-queue), for threads without a
//!   lane (another event clock, more threads than lanes, a thread past its exit);
//! - a slab of [`StackSlot`]s with a free list (`ArrayQueue<u32>` of slot indices). A hook
//!   sending a stack for the first time pops a slot, fills it and sends its index with the
//!   event; the writer interns the stack and pushes the index back. (A repeated stack needs
//!   no slot: see [`sent`](super::sent).)
//!
//! Lossless (docs/DESIGN.md, decision 5): when a lane, the queue or the slab is full, the hook
//! waits for the writer (a short spin, then it wakes the writer and yields, then sleeps
//! in 50 µs steps) instead of dropping an event or its stack: the program slows down, the
//! record stays exact. Waits are counted. Only when the writer is gone (a panic it caught,
//! process teardown) does an event go unrecorded; those are counted by kind and reported
//! at exit. No allocation, no lock; syscalls only while waiting for the writer.

use crate::channel::event::{Event, Kind, StackRef, StackSlot, StackSlotIndex};
use crate::channel::futex;
use crate::channel::handshake::READ_REQUESTS;
use crate::channel::lanes::{self, Lanes};
use crate::channel::thread::HookThread;
use crate::config::{Context, Stacks};
use crossbeam_queue::ArrayQueue;
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::*};
use std::time::Duration;

/// Upper bound on stack slots: the writer drains within milliseconds, so a few thousand
/// in flight is plenty, and each slot is ~2 KiB (8 MiB for the whole slab).
pub const MAX_STACK_SLOTS: usize = 4096;
// An event names its slot in a `StackSlotIndex`.
const _: () = assert!(MAX_STACK_SLOTS <= StackSlotIndex::MAX as usize + 1);

/// Spins on a full queue or slab before the first syscall (a few µs): absorbs short
/// bursts while the writer is busy.
const SPINS_BEFORE_YIELD: u32 = 2_000;
/// Yields before sleeping: the writer usually needs only a time slice.
const YIELDS_BEFORE_SLEEP: u32 = 64;
/// Sleep between checks once the writer has been behind for a while.
const WAIT_SLEEP: Duration = Duration::from_micros(50);
/// How often a thread that asked for a snapshot looks whether it is written
/// ([`Recorder::wait_for`]).
const WAIT_STEP: Duration = Duration::from_millis(1);
/// The longest [`Recorder::wait_until_read`] waits: the writer drains within milliseconds,
/// unless it is writing a large snapshot or loading a library's symbols.
pub const READ_WAIT: Duration = Duration::from_secs(2);

/// The settings a hook needs, copied out of the configuration once.
#[derive(Clone, Copy, Debug)]
pub struct HookSettings {
    pub stacks: Stacks,
    pub context: Context,
    pub max_frames: usize,
    /// Out-of-memory errors ask for a snapshot and wait for it.
    pub dump_on_oom: bool,
}

pub struct Recorder {
    pub settings: HookSettings,
    /// Wakes the writer from its idle wait (signal handler, OOM, control calls, exit, a
    /// hook waiting for room).
    pub wake: WakeWord,
    pub(super) lanes: Lanes,
    pub(super) events: ArrayQueue<Event>,
    slots: Box<[UnsafeCell<StackSlot>]>,
    free_slots: ArrayQueue<StackSlotIndex>,
    /// The stack of the thread that got the first crash signal (see `signals`).
    crash_slot: UnsafeCell<StackSlot>,
    /// Cleared when the writer thread is gone (exit, panic): hooks then stop spinning.
    pub writer_alive: AtomicBool,
    /// Set by the writer while its busy passes get less than half their time on a
    /// processor (more threads record than there are processors): a thread that waits for
    /// a snapshot then holds the lanes ([`Recorder::wait_for`]).
    writer_starved: AtomicBool,
    pub counters: Counters,
}

// SAFETY: a slot is accessed by exactly one party at a time: the hook that popped its index
// from `free_slots` until it pushes the event, then the writer until it pushes the index
// back. The queues' push/pop are the synchronization points (release/acquire).
unsafe impl Sync for Recorder {}

/// Counters bumped by hooks (relaxed atomics; the writer reads them at dump time), except
/// [`Counters::applied`]. A sent event bumps none of them: a locked add per event, after
/// the event's own stores, cost the hook 6 ns and more (docs/HOT-PATH.md, "Where the
/// nanoseconds go"); only waits and losses are counted on the hook side.
#[derive(Default)]
pub struct Counters {
    /// Events the writer took off a lane or the shared queue (to apply them: an event
    /// taken off the shared queue waits in the reader for its turn). Written by the writer
    /// thread alone (a plain store, no locked add), read by tests and the writer's own reports.
    pub applied: AtomicU64,
    /// Of those, the events whose stack the writer has interned, its Python code objects
    /// read (written by the writer thread alone, after `applied`; [`Recorder::all_read`]).
    pub interned: AtomicU64,
    /// Threads that waited for the writer to read what events name before they freed a
    /// code object or unloaded a library (`channel::keep`).
    pub free_waits: AtomicU64,
    /// Events that found their lane or the shared queue full and waited for the writer.
    pub queue_waits: AtomicU64,
    /// Stacks that found every slot taken and waited for the writer.
    pub slot_waits: AtomicU64,
    /// Events not recorded because the writer was gone, by kind.
    pub lost_allocs: AtomicU64,
    pub lost_frees: AtomicU64,
    pub lost_other: AtomicU64,
    /// Stacks not recorded: the writer was gone (their events were lost too), or the
    /// calling thread was past its exit destructors (its per-thread state freed).
    pub lost_stacks: AtomicU64,
}

impl Counters {
    pub fn lost_total(&self) -> u64 {
        self.lost_allocs.load(Relaxed)
            + self.lost_frees.load(Relaxed)
            + self.lost_other.load(Relaxed)
    }
}

/// How the writer is woken: a futex word, not a descriptor. The program owns every
/// descriptor number: one that closes them all (daemonizing code, `close_range`) and opens
/// files of its own would get, under a descriptor's number, memsnap's wake-ups written into
/// its files and its data read away by the writer. A word in memsnap's own memory cannot
/// be taken: each wake-up counts it up and wakes a waiting writer; the writer waits only
/// while the count is the one it saw last, so a wake-up that comes before it waits is
/// never lost. `FUTEX_WAKE` is async-signal-safe (a system call on memory).
#[derive(Default)]
pub struct WakeWord {
    count: AtomicU32,
}

impl WakeWord {
    /// Counts a wake-up and wakes the writer if it waits.
    pub fn wake(&self) {
        self.count.fetch_add(1, Release);
        futex::wake(&self.count, 1);
    }

    /// The wake-ups counted so far.
    pub fn seen(&self) -> u32 {
        self.count.load(Acquire)
    }

    /// Waits until a wake-up after `seen`, or `timeout`. Returns at once if one came
    /// already; a spurious return is harmless (the writer looks at the queue again).
    pub fn wait(&self, seen: u32, timeout: Duration) {
        futex::wait(&self.count, seen, timeout);
    }
}

/// Waits for the writer: spin, then yield (waking the writer once), then sleep; while the
/// writer holds the lanes (`Lanes::hold`), off the processors until it lets go,
/// [`lanes::MAX_HELD_WAIT`] at most. Returns `false` once the writer is gone.
struct Backoff<'a> {
    rec: &'a Recorder,
    round: u32,
    /// When this wait first found the lanes held.
    held_since: Option<std::time::Instant>,
}

impl<'a> Backoff<'a> {
    fn new(rec: &'a Recorder) -> Backoff<'a> {
        Backoff {
            rec,
            round: 0,
            held_since: None,
        }
    }

    /// Whether this wait has waited out a hold: its thread leaves it.
    fn waited_out_hold(&self) -> bool {
        self.held_since
            .is_some_and(|since| since.elapsed() >= lanes::MAX_HELD_WAIT)
    }

    #[cold]
    #[inline(never)]
    fn wait(&mut self) -> bool {
        if !self.rec.writer_alive.load(Acquire) {
            return false;
        }
        if self.rec.lanes.held() {
            let since = *self.held_since.get_or_insert_with(std::time::Instant::now);
            if let Some(left) = lanes::MAX_HELD_WAIT.checked_sub(since.elapsed())
                && !left.is_zero()
            {
                self.rec.lanes.wait_while_held(left);
                return true;
            }
        }
        self.round = self.round.saturating_add(1);
        if self.round < SPINS_BEFORE_YIELD {
            std::hint::spin_loop();
        } else if self.round == SPINS_BEFORE_YIELD {
            // The writer may be in its idle sleep: hooks never wake it otherwise.
            self.rec.wake_writer();
            std::thread::yield_now();
        } else if self.round < SPINS_BEFORE_YIELD + YIELDS_BEFORE_SLEEP {
            std::thread::yield_now();
        } else {
            std::thread::sleep(WAIT_SLEEP);
        }
        true
    }
}

impl Recorder {
    /// Allocates everything up front but the lanes (mapped as threads claim them).
    /// `capacity` events per lane and in the shared queue; `lanes`: whether threads get
    /// lanes (the event clock orders events across cores). Cold: called once, on the
    /// first CUDA event.
    pub fn new(capacity: usize, settings: HookSettings, lanes: bool) -> Recorder {
        let n_slots = capacity.clamp(1, MAX_STACK_SLOTS);
        let slots: Box<[UnsafeCell<StackSlot>]> = (0..n_slots)
            .map(|_| UnsafeCell::new(StackSlot::EMPTY))
            .collect();
        let free_slots = ArrayQueue::new(n_slots);
        for i in (0..).take(n_slots) {
            let _ = free_slots.push(i);
        }
        Recorder {
            settings,
            wake: WakeWord::default(),
            lanes: Lanes::new(lanes, capacity),
            events: ArrayQueue::new(capacity.max(1)),
            slots,
            free_slots,
            crash_slot: UnsafeCell::new(StackSlot::EMPTY),
            writer_alive: AtomicBool::new(true),
            writer_starved: AtomicBool::new(false),
            counters: Counters::default(),
        }
    }

    /// Borrows a free stack slot, waiting for the writer to give one back when all are in
    /// flight. `None` only when the writer is gone (counted).
    // `&self` → `&mut`: exclusive by the free-list protocol (see the `Sync` impl), which is
    // what lets hooks on many threads fill slots without a lock.
    #[allow(clippy::mut_from_ref)]
    #[inline]
    pub fn take_slot(&self) -> Option<(StackSlotIndex, &mut StackSlot)> {
        let idx = match self.free_slots.pop() {
            Some(idx) => idx,
            None => self.take_slot_slow()?,
        };
        let cell = self.slots.get(idx as usize)?;
        // SAFETY: `idx` came off the free list, so no one else holds this slot until we push
        // an event naming it (see the `Sync` impl).
        Some((idx, unsafe { &mut *cell.get() }))
    }

    #[cold]
    #[inline(never)]
    fn take_slot_slow(&self) -> Option<StackSlotIndex> {
        self.counters.slot_waits.fetch_add(1, Relaxed);
        let mut backoff = Backoff::new(self);
        loop {
            if let Some(idx) = self.free_slots.pop() {
                return Some(idx);
            }
            if !backoff.wait() {
                self.counters.lost_stacks.fetch_add(1, Relaxed);
                return None;
            }
        }
    }

    /// Sends an event from the thread whose hook state is `thread`, waiting for room while
    /// the writer is behind. Never allocates; an event is lost (and counted) only when the
    /// writer is gone.
    #[inline]
    pub fn push(&self, thread: &HookThread, event: Event) {
        if let Some(cursor) = thread.lane(self.address()) {
            // SAFETY: the thread's own hold on its lane of this channel.
            if unsafe { Lanes::try_push(cursor, &event) } {
                return;
            }
            return self.push_waiting(event, Some(cursor), |e| {
                // SAFETY: as above.
                unsafe { Lanes::try_push(cursor, &e) }
            });
        }
        self.push_without_lane(thread, event)
    }

    /// The line the calling thread's next [`Recorder::push`] writes (its lane's next
    /// slot), if it sends through a lane of this channel.
    #[inline(always)]
    pub fn next_push_line(&self, thread: &HookThread) -> Option<usize> {
        let cursor = thread.lane(self.address())?.get();
        // SAFETY: the thread's own hold on its lane of this channel.
        Some(unsafe { Lanes::next_slot(&cursor) })
    }

    /// This channel's identity for a thread's lane.
    #[inline(always)]
    fn address(&self) -> usize {
        self as *const Recorder as usize
    }

    /// The thread's first event on this channel: claim a lane (given back at its exit);
    /// with none to claim, the shared queue from now on.
    #[cold]
    #[inline(never)]
    fn push_without_lane(&self, thread: &HookThread, event: Event) {
        if !thread.without_lane() {
            match self.lanes.claim() {
                Some(cursor) => {
                    lanes::release_at_exit(&cursor);
                    thread.set_lane(cursor, self.address());
                    return self.push(thread, event);
                }
                None => {
                    thread.go_without_lane();
                }
            }
        }
        if let Err(back) = self.events.push(event) {
            self.push_waiting(back, None, |e| self.events.push(e).is_ok());
        }
    }

    /// Waits until `try_push` takes `event` (the writer is behind, or holds the lanes while
    /// it serves a request), or counts it lost once the writer is gone. One wait for a full
    /// or held lane (`lane`: the thread's) and for the full shared queue.
    #[cold]
    #[inline(never)]
    fn push_waiting(
        &self,
        event: Event,
        lane: Option<&std::cell::Cell<lanes::Cursor>>,
        mut try_push: impl FnMut(Event) -> bool,
    ) {
        self.counters.queue_waits.fetch_add(1, Relaxed);
        let mut backoff = Backoff::new(self);
        loop {
            if try_push(event) {
                return;
            }
            if !backoff.wait() {
                break;
            }
            if let Some(cursor) = lane
                && backoff.waited_out_hold()
            {
                // SAFETY: the thread's own hold on its lane of this channel.
                unsafe { Lanes::leave_hold(&cursor.get()) };
            }
        }
        self.count_lost(&event);
    }

    /// An event the writer will never see (it is gone): counted by kind, its stack slot
    /// given back.
    fn count_lost(&self, event: &Event) {
        let counter = match event.kind {
            Kind::Alloc | Kind::AllocManaged | Kind::Map => &self.counters.lost_allocs,
            Kind::Free | Kind::Unmap => &self.counters.lost_frees,
            _ => &self.counters.lost_other,
        };
        counter.fetch_add(1, Relaxed);
        if let StackRef::Slot { index, .. } = event.stack() {
            let _ = self.free_slots.push(index);
        }
    }

    /// The crash signal's stack slot, to fill.
    ///
    /// # Safety
    /// Only the first crash signal's handler may call it, once (`CRASH.dumps` then hands
    /// the slot to the writer).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn crash_slot_to_fill(&self) -> &mut StackSlot {
        // SAFETY: exclusive by the caller's contract.
        unsafe { &mut *self.crash_slot.get() }
    }

    /// Writer side: the crash signal's stack, once its ticket was seen.
    pub fn crash_slot(&self) -> &StackSlot {
        // SAFETY: written once, before the ticket the writer has seen (release/acquire
        // through `CRASH.dumps`), and never again.
        unsafe { &*self.crash_slot.get() }
    }

    /// Whether the writer has read every event published before this call: none waits in a
    /// lane or the shared queue, and each one taken had its stack interned (its code objects
    /// read). Conservative: a moment's lag reads as not read. Cold: no hook calls it.
    pub fn all_read(&self) -> bool {
        // The queues first, then the counts: the writer counts an event taken before the
        // queue lets it go, so an event no longer queued is in `applied`.
        if self.lanes.any_queued() || !self.events.is_empty() {
            return false;
        }
        let taken = self.counters.applied.load(Acquire);
        self.counters.interned.load(Acquire) >= taken
    }

    /// Waits until the writer has read every event published before this call (at most
    /// [`READ_WAIT`]), for a thread about to free what they name (`channel::keep`). Returns
    /// at once when it has, or when the writer is gone. Cold; never called by a hook.
    pub fn wait_until_read(&self) {
        if !self.writer_alive.load(Acquire) || self.all_read() {
            return;
        }
        self.counters.free_waits.fetch_add(1, Relaxed);
        let ticket = READ_REQUESTS.ask();
        self.wake_writer();
        let start = std::time::Instant::now();
        let mut round = 0u32;
        while !READ_REQUESTS.is_done(ticket)
            && self.writer_alive.load(Acquire)
            && start.elapsed() < READ_WAIT
        {
            round = round.saturating_add(1);
            if round < YIELDS_BEFORE_SLEEP {
                std::thread::yield_now();
            } else {
                std::thread::sleep(WAIT_SLEEP);
            }
        }
    }

    /// Events published and not yet taken by the writer, in lanes and the shared queue.
    pub fn queued(&self) -> u64 {
        self.lanes.queued() + self.events.len() as u64
    }

    /// Writer side: the stack of a taken event. The caller must hand the index back with
    /// [`Recorder::release_slot`] once done with the reference.
    pub fn slot(&self, idx: StackSlotIndex) -> Option<&StackSlot> {
        let cell = self.slots.get(idx as usize)?;
        // SAFETY: the event naming `idx` was popped by the (single) writer, so the hook that
        // filled the slot is done with it and nobody else can take it until it is released.
        Some(unsafe { &*cell.get() })
    }

    pub fn release_slot(&self, idx: StackSlotIndex) {
        let _ = self.free_slots.push(idx);
    }

    /// Holds the threads that record through lanes (see [`Lanes::hold`]); each call is
    /// ended by one [`Recorder::let_lanes_go`].
    pub fn hold_lanes(&self) {
        self.lanes.hold();
    }

    /// Whether anyone holds the lanes.
    pub fn lanes_held(&self) -> bool {
        self.lanes.held()
    }

    /// Ends one [`Recorder::hold_lanes`].
    pub fn let_lanes_go(&self) {
        self.lanes.let_go();
    }

    /// Writer side: wakes the threads a waiting thread's hold left waiting (see
    /// [`Recorder::wait_for`]). Cold: once a pass.
    pub fn wake_held_if_due(&self) {
        self.lanes.wake_if_due();
    }

    /// Writer side, as it ends: waits until no thread holds the lanes, `limit` at most.
    /// Cold.
    pub fn wait_until_let_go(&self, limit: Duration) {
        let start = std::time::Instant::now();
        while self.lanes.held() && start.elapsed() < limit {
            std::thread::sleep(WAIT_STEP);
        }
    }

    /// Writer side: whether its busy passes are starved of processor time.
    pub fn note_writer_starved(&self, starved: bool) {
        self.writer_starved.store(starved, Relaxed);
    }

    /// Wakes the writer now instead of at the end of its idle wait. Async-signal-safe.
    pub fn wake_writer(&self) {
        self.wake.wake();
    }

    /// Polls `done` every [`WAIT_STEP`] until it holds, the writer is gone, or `limit`
    /// passes; returns whether it held. Cold: for threads that asked for a snapshot (after
    /// their last event). Async-signal-safe.
    ///
    /// Once the writer is starved, or the waiting thread itself (a step of its wait took
    /// four times as long: threads outnumber the processors), the waiting thread holds
    /// the lanes until it has its answer: the writer gets the processors to take the queue
    /// and write the file, and the waiting thread gets one to go on at once (were the
    /// threads let go when the file is written, it would wait its turn behind them: 50 to
    /// 130 ms at 64 threads on two cores).
    pub fn wait_for(&self, done: impl Fn() -> bool, limit: Duration) -> bool {
        let mut holding = false;
        let mut overslept = false;
        let start = std::time::Instant::now();
        let answered = loop {
            if done() {
                break true;
            }
            if !self.writer_alive.load(Acquire) || start.elapsed() > limit {
                break done();
            }
            if !holding && (self.writer_starved.load(Relaxed) || overslept) {
                holding = true;
                self.lanes.hold();
            }
            let asleep = std::time::Instant::now();
            std::thread::sleep(WAIT_STEP);
            overslept = asleep.elapsed() >= WAIT_STEP * 4;
        };
        if holding {
            // The writer wakes the held threads at its next pass: this thread goes on first.
            self.lanes.let_go_quietly();
            // A writer that ended meanwhile wakes no one: then this thread does. (Each side
            // stores, fences, then loads what the other stored: one of them sees the other.)
            std::sync::atomic::fence(SeqCst);
            if !self.writer_alive.load(Relaxed) {
                self.lanes.wake_if_due();
            }
        }
        answered
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::event::Api;
    use crate::channel::lanes::Reader;
    use crate::channel::thread;

    const TEST_SETTINGS: HookSettings = HookSettings {
        stacks: Stacks::All,
        context: Context::Alloc,
        max_frames: 64,
        dump_on_oom: true,
    };

    /// Runs `f` on a thread of its own (a thread keeps its lane, or its lack of one, for
    /// its life), once with lanes and once with the shared queue alone.
    fn with_and_without_lanes(f: fn(bool)) {
        for lanes in [true, false] {
            std::thread::spawn(move || f(lanes)).join().unwrap();
        }
    }

    /// A thread that waits for a snapshot holds the lanes while the writer is starved,
    /// and only then (or once a step of its own wait overslept: a loaded machine); it lets
    /// go quietly once answered (the writer's pass wakes the held), or at once when the
    /// writer is gone.
    #[test]
    fn a_thread_waiting_for_a_snapshot_holds_the_lanes_while_the_writer_is_starved() {
        let rec = Recorder::new(16, TEST_SETTINGS, true);
        for starved in [false, true] {
            rec.note_writer_starved(starved);
            let looks = AtomicU32::new(0);
            let saw_held = AtomicBool::new(false);
            let last_look = std::cell::Cell::new(std::time::Instant::now());
            let overslept = AtomicBool::new(false);
            let answered = rec.wait_for(
                || {
                    saw_held.fetch_or(rec.lanes_held(), Relaxed);
                    let now = std::time::Instant::now();
                    overslept.fetch_or(now - last_look.replace(now) >= WAIT_STEP * 4, Relaxed);
                    looks.fetch_add(1, Relaxed) == 3
                },
                Duration::from_secs(5),
            );
            assert!(answered);
            let held = saw_held.load(Relaxed);
            // Without starvation a hold is right only after a step that took four.
            assert!(
                held == starved || (held && overslept.load(Relaxed)),
                "writer starved: {starved}, held: {held}"
            );
            assert!(!rec.lanes_held(), "let go once answered");
            assert_eq!(
                rec.lanes.wake_due.load(Relaxed),
                held,
                "the wake left to the writer"
            );
            rec.wake_held_if_due();
            assert!(!rec.lanes.wake_due.load(Relaxed));
        }
        // The writer gone while the thread waits: it wakes the held itself.
        let looks = AtomicU32::new(0);
        let answered = rec.wait_for(
            || match looks.fetch_add(1, Relaxed) {
                0 => false,
                1 => {
                    assert!(rec.lanes_held());
                    rec.writer_alive.store(false, Release);
                    false
                }
                _ => true,
            },
            Duration::from_secs(5),
        );
        assert!(answered);
        assert!(!rec.lanes_held() && !rec.lanes.wake_due.load(Relaxed));
    }

    #[test]
    fn all_is_read_once_every_event_published_was_taken_and_its_stack_interned() {
        with_and_without_lanes(|lanes| {
            let rec = Recorder::new(16, TEST_SETTINGS, lanes);
            assert!(rec.all_read(), "nothing published");
            thread::with_thread(|t| rec.push(t, Event::new(Kind::Alloc, Api::CudaMalloc)));
            assert!(!rec.all_read(), "queued, lanes {lanes}");
            let mut reader = Reader::new();
            assert!(reader.next(&rec).is_some());
            assert!(!rec.all_read(), "taken, its stack not interned yet");
            // What the writer stores once it has interned the event's stack.
            rec.counters.interned.store(1, Release);
            assert!(rec.all_read());
            // Nothing to read: no wait, whether or not the writer is there.
            rec.wait_until_read();
            assert_eq!(rec.counters.free_waits.load(Relaxed), 0);
        });
    }

    #[test]
    fn with_the_writer_gone_a_full_queue_loses_events_by_kind_and_gives_slots_back() {
        with_and_without_lanes(|lanes| {
            let rec = Recorder::new(16, TEST_SETTINGS, lanes);
            rec.writer_alive.store(false, Relaxed);
            thread::with_thread(|t| {
                for i in 0..20u64 {
                    let kind = if i % 2 == 0 { Kind::Alloc } else { Kind::Free };
                    let mut ev = Event::new(kind, Api::CudaMalloc);
                    if let Some((index, slot)) = rec.take_slot() {
                        slot.n_native = 1;
                        ev.set_stack(StackRef::Slot { index, hash: 1 });
                    }
                    ev.set_addr(i);
                    rec.push(t, ev);
                }
            });
            assert_eq!(rec.queued(), 16, "lanes {lanes}");
            assert_eq!(
                rec.events.len(),
                if lanes { 0 } else { 16 },
                "lanes {lanes}"
            );
            assert_eq!(rec.counters.lost_allocs.load(Relaxed), 2);
            assert_eq!(rec.counters.lost_frees.load(Relaxed), 2);
            // The 16 queued events hold all 16 slots: the four later events found none, and
            // with no writer to give one back their stacks are lost too, and counted.
            assert_eq!(rec.counters.lost_stacks.load(Relaxed), 4);
            let mut reader = Reader::new();
            let mut addrs = Vec::new();
            while let Some(ev) = reader.next(&rec) {
                let StackRef::Slot { index, .. } = ev.stack() else {
                    panic!("every queued event has its slot")
                };
                assert_eq!(rec.slot(index).map(|s| s.n_native), Some(1));
                rec.release_slot(index);
                addrs.push(ev.addr());
            }
            assert_eq!(addrs, (0..16).collect::<Vec<u64>>(), "FIFO, oldest kept");
        });
    }

    #[test]
    fn a_full_queue_waits_for_the_writer_and_loses_nothing() {
        with_and_without_lanes(|lanes| {
            const EVENTS: u64 = 200_000;
            let rec: &'static Recorder =
                Box::leak(Box::new(Recorder::new(16, TEST_SETTINGS, lanes)));
            let producers: Vec<_> = (0..4u64)
                .map(|t| {
                    std::thread::spawn(move || {
                        thread::with_thread(|thread| {
                            for i in 0..EVENTS / 4 {
                                let mut ev = Event::new(Kind::Alloc, Api::CudaMalloc);
                                let (index, slot) = rec.take_slot().expect("the writer is alive");
                                slot.n_native = 1;
                                slot.native[0] = t << 32 | i;
                                ev.set_stack(StackRef::Slot { index, hash: 1 });
                                ev.set_addr(t << 32 | i);
                                ev.time = crate::process::clock::now();
                                rec.push(thread, ev);
                            }
                        })
                    })
                })
                .collect();
            // A slow writer: it pauses now and then, so the queue and the slab fill up.
            let mut reader = Reader::new();
            let mut seen = [0u64; 4];
            let mut received = 0;
            while received < EVENTS {
                match reader.next(rec) {
                    Some(ev) => {
                        let StackRef::Slot { index, .. } = ev.stack() else {
                            panic!("every event has its stack")
                        };
                        let slot = rec.slot(index).expect("a valid slot");
                        assert_eq!(
                            slot.native[0],
                            ev.addr(),
                            "the stack travels with its event"
                        );
                        rec.release_slot(index);
                        let (t, i) = ((ev.addr() >> 32) as usize, ev.addr() & 0xffff_ffff);
                        assert_eq!(i, seen[t], "per-thread order kept");
                        seen[t] += 1;
                        received += 1;
                        if received % 10_000 == 0 {
                            std::thread::sleep(Duration::from_millis(2));
                        }
                    }
                    None => std::thread::yield_now(),
                }
            }
            for p in producers {
                p.join().unwrap();
            }
            assert_eq!(rec.counters.applied.load(Relaxed), EVENTS);
            assert_eq!(rec.counters.lost_total(), 0);
            assert_eq!(rec.counters.lost_stacks.load(Relaxed), 0);
            assert!(
                rec.counters.queue_waits.load(Relaxed) + rec.counters.slot_waits.load(Relaxed) > 0
            );
            assert_eq!(rec.queued(), 0);
        });
    }
}

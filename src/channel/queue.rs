//! The bounded, lock-free path from hooks to the writer thread.
//!
//! Hot. Two pre-allocated structures, created once on the first CUDA event:
//! - `events`: a crossbeam `ArrayQueue<Event>` (no allocation, no lock, no thread-local on
//!   push; docs/DEPENDENCIES.md#crossbeam-queue);
//! - a slab of [`StackSlot`]s with a free list (`ArrayQueue<u32>` of slot indices). A hook
//!   pops a slot, fills it in place and sends its index with the event; the writer copies
//!   what it needs and pushes the index back.
//!
//! Back-pressure degrades stacks first: no free slot means the event goes without a stack
//! (counted). A full event queue is retried for a bounded spin while the writer is alive,
//! then the event is dropped and counted per kind; the writer records the counts in every
//! snapshot and warns once. Nothing here blocks, allocates or makes a syscall.

use crate::channel::event::{Event, Kind, NO_STACK, StackSlot};
use crate::config::{Context, Stacks};
use crossbeam_queue::ArrayQueue;
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::time::Duration;

/// Upper bound on stack slots: the writer drains within milliseconds, so a few thousand
/// in flight is plenty, and each slot is ~2 KiB.
const MAX_STACK_SLOTS: usize = 4096;

/// Spins on a full queue before dropping (a few tens of µs): absorbs bursts without a
/// syscall, and stays bounded if the writer is stuck.
const FULL_QUEUE_SPINS: u32 = 20_000;

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
    /// eventfd that wakes the writer (signal handler, OOM, control calls, exit); -1: none,
    /// the writer then polls.
    wake_fd: i32,
    events: ArrayQueue<Event>,
    slots: Box<[UnsafeCell<StackSlot>]>,
    free_slots: ArrayQueue<u32>,
    /// Cleared when the writer thread is gone (exit, panic): hooks then stop spinning.
    pub writer_alive: AtomicBool,
    pub counters: Counters,
}

// SAFETY: a slot is accessed by exactly one party at a time: the hook that popped its index
// from `free_slots` until it pushes the event, then the writer until it pushes the index
// back. The queues' push/pop are the synchronization points (release/acquire).
unsafe impl Sync for Recorder {}

/// Counters bumped by hooks (relaxed atomics; the writer reads them at dump time).
#[derive(Default)]
pub struct Counters {
    pub pushed: AtomicU64,
    pub dropped_allocs: AtomicU64,
    pub dropped_frees: AtomicU64,
    pub dropped_other: AtomicU64,
    pub stackless: AtomicU64,
    pub full_queue_waits: AtomicU64,
}

impl Counters {
    pub fn dropped_total(&self) -> u64 {
        self.dropped_allocs.load(Relaxed)
            + self.dropped_frees.load(Relaxed)
            + self.dropped_other.load(Relaxed)
    }
}

impl Recorder {
    /// Allocates everything up front. Cold: called once, on the first CUDA event.
    pub fn new(capacity: usize, settings: HookSettings, wake_fd: i32) -> Recorder {
        let n_slots = capacity.clamp(1, MAX_STACK_SLOTS);
        let slots: Box<[UnsafeCell<StackSlot>]> = (0..n_slots)
            .map(|_| UnsafeCell::new(StackSlot::EMPTY))
            .collect();
        let free_slots = ArrayQueue::new(n_slots);
        for i in 0..n_slots {
            let _ = free_slots.push(i as u32);
        }
        Recorder {
            settings,
            wake_fd,
            events: ArrayQueue::new(capacity.max(1)),
            slots,
            free_slots,
            writer_alive: AtomicBool::new(true),
            counters: Counters::default(),
        }
    }

    /// Borrows a free stack slot, or `None` under back-pressure (counted).
    // `&self` → `&mut`: exclusive by the free-list protocol (see the `Sync` impl), which is
    // what lets hooks on many threads fill slots without a lock.
    #[allow(clippy::mut_from_ref)]
    #[inline]
    pub fn take_slot(&self) -> Option<(u32, &mut StackSlot)> {
        let Some(idx) = self.free_slots.pop() else {
            self.counters.stackless.fetch_add(1, Relaxed);
            return None;
        };
        let cell = self.slots.get(idx as usize)?;
        // SAFETY: `idx` came off the free list, so no one else holds this slot until we push
        // an event naming it (see the `Sync` impl).
        Some((idx, unsafe { &mut *cell.get() }))
    }

    /// Sends an event. Never blocks for long, never allocates; counts what it drops.
    #[inline]
    pub fn push(&self, event: Event) {
        let mut event = event;
        let mut spins = 0u32;
        loop {
            match self.events.push(event) {
                Ok(()) => {
                    self.counters.pushed.fetch_add(1, Relaxed);
                    return;
                }
                Err(back) => event = back,
            }
            if spins == 0 {
                self.counters.full_queue_waits.fetch_add(1, Relaxed);
            }
            if spins >= FULL_QUEUE_SPINS || !self.writer_alive.load(Relaxed) {
                break;
            }
            spins += 1;
            std::hint::spin_loop();
        }
        let counter = match event.kind {
            Kind::Alloc | Kind::AllocManaged | Kind::Map => &self.counters.dropped_allocs,
            Kind::Free | Kind::Unmap => &self.counters.dropped_frees,
            _ => &self.counters.dropped_other,
        };
        counter.fetch_add(1, Relaxed);
        if event.stack != NO_STACK {
            let _ = self.free_slots.push(event.stack);
        }
    }

    /// Writer side: the next event, if any.
    pub fn pop(&self) -> Option<Event> {
        self.events.pop()
    }

    /// Writer side: the stack of a popped event. The caller must hand the index back with
    /// [`Recorder::release_slot`] once done with the reference.
    pub fn slot(&self, idx: u32) -> Option<&StackSlot> {
        let cell = self.slots.get(idx as usize)?;
        // SAFETY: the event naming `idx` was popped by the (single) writer, so the hook that
        // filled the slot is done with it and nobody else can take it until it is released.
        Some(unsafe { &*cell.get() })
    }

    pub fn release_slot(&self, idx: u32) {
        let _ = self.free_slots.push(idx);
    }

    pub fn queued(&self) -> usize {
        self.events.len()
    }

    pub fn wake_fd(&self) -> i32 {
        self.wake_fd
    }

    /// Wakes the writer now instead of at its next poll. Async-signal-safe.
    pub fn wake_writer(&self) {
        if self.wake_fd >= 0 {
            let one: u64 = 1;
            // SAFETY: writing 8 bytes from a valid buffer to our eventfd; errors are ignored
            // (EAGAIN means a wake-up is already pending).
            unsafe { libc::write(self.wake_fd, (&one as *const u64).cast(), 8) };
        }
    }

    /// Polls `done` every millisecond until it holds, the writer is gone, or `limit`
    /// passes; returns whether it held. Cold: for threads that asked for a snapshot.
    pub fn wait_for(&self, done: impl Fn() -> bool, limit: Duration) -> bool {
        let start = std::time::Instant::now();
        loop {
            if done() {
                return true;
            }
            if !self.writer_alive.load(Acquire) || start.elapsed() > limit {
                return done();
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::event::Api;

    const TEST_SETTINGS: HookSettings = HookSettings {
        stacks: Stacks::All,
        context: Context::Alloc,
        max_frames: 64,
        dump_on_oom: true,
    };

    #[test]
    fn full_queue_counts_drops_by_kind() {
        let rec = Recorder::new(16, TEST_SETTINGS, -1);
        rec.writer_alive.store(false, Relaxed); // no spinning in the test
        for i in 0..20u64 {
            let kind = if i % 2 == 0 { Kind::Alloc } else { Kind::Free };
            let mut ev = Event::new(kind, Api::CudaMalloc);
            if let Some((idx, slot)) = rec.take_slot() {
                slot.n_native = 1;
                ev.stack = idx;
            }
            ev.addr = i;
            rec.push(ev);
        }
        assert_eq!(rec.queued(), 16);
        assert_eq!(rec.counters.pushed.load(Relaxed), 16);
        assert_eq!(rec.counters.dropped_allocs.load(Relaxed), 2);
        assert_eq!(rec.counters.dropped_frees.load(Relaxed), 2);
        // The 16 queued events hold all 16 slots; the last four went without a stack.
        assert_eq!(rec.counters.stackless.load(Relaxed), 4);
        let mut addrs = Vec::new();
        while let Some(ev) = rec.pop() {
            assert_eq!(rec.slot(ev.stack).map(|s| s.n_native), Some(1));
            rec.release_slot(ev.stack);
            addrs.push(ev.addr);
        }
        assert_eq!(addrs, (0..16).collect::<Vec<u64>>(), "FIFO, oldest kept");
    }

    #[test]
    fn a_dropped_event_gives_its_stack_slot_back() {
        let rec = Recorder::new(16, TEST_SETTINGS, -1);
        rec.writer_alive.store(false, Relaxed);
        for _ in 0..16 {
            rec.push(Event::new(Kind::Alloc, Api::CuMemAlloc));
        }
        let (idx, _) = rec.take_slot().expect("all slots free");
        let mut ev = Event::new(Kind::Free, Api::CuMemFree);
        ev.stack = idx;
        rec.push(ev);
        assert_eq!(rec.counters.dropped_frees.load(Relaxed), 1);
        let taken: Vec<u32> = std::iter::from_fn(|| rec.take_slot().map(|(i, _)| i)).collect();
        assert_eq!(
            taken.len(),
            16,
            "the dropped event's slot is back in the pool"
        );
    }
}

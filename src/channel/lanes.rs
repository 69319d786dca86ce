//! Each recording thread's own event ring (its lane), and the writer's merge of all lanes
//! and the shared queue into one order.
//!
//! Hot, producer side ([`Lanes::try_push`]): the event is stored in the thread's ring and
//! published by one release store of its slot's mark: no locked instruction, no cache line
//! that another producer writes, and no load of a line the writer wrote except when the
//! ring looked full; then the next slot's line is asked for. (The shared queue's push is
//! a compare-and-swap on a line every producer and the writer touch, and 60 instructions:
//! docs/HOT-PATH.md, "Per-thread lanes".) The writer reads the mark in the line it reads
//! the event from, so while it keeps up with a thread no other line travels between the
//! two. Cold: a thread claims a lane on its first event ([`Lanes::claim`]: one mapping,
//! made once per lane) and gives it back at exit ([`release_at_exit`]); a later thread
//! reuses it. Writer side: [`Reader`].
//!
//! The order across lanes. One queue orders events by itself: an event a thread sends
//! after another thread's is behind it. Lanes do not, so the writer merges them by stamp,
//! and stamps order events only where the event clock is the time-stamp counter, which the
//! kernel keeps in step across cores (`process::clock`); elsewhere every thread uses the
//! shared queue, as before lanes. What must not be reordered is an event and one that
//! depended on it (a free recorded before the real free, then another thread's allocation
//! that got the same address): the first was published before the second was even
//! stamped. So each pass of the writer first reads the clock (its watermark) and only then
//! looks at the lanes, and takes in stamp order the events stamped at or before the
//! watermark: any event that one of them depended on was published before that stamp,
//! hence before the writer looked, and is among the events it sees, with an earlier stamp.
//! Events stamped later wait for the next pass, and an event already seen at an earlier
//! pass is taken whatever its stamp (a stamp from another clock cannot hold the writer
//! back).

use crate::channel::event::Event;
use crate::channel::futex;
use crate::channel::queue::Recorder;
use crate::prefetch::prefetch_for_write;
use crate::thread_state::ExitKey;
use std::cell::{Cell, UnsafeCell};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, Ordering::*};

/// Lanes at most: threads recording at the same time beyond this many use the shared
/// queue (their events are merged just the same).
pub const MAX_LANES: usize = 256;
/// The fewest events a lane may hold however many lanes share the channel's budget.
const MIN_LANE_SHARE: u64 = 256;
/// The most events a producer publishes between two looks at its lane (its `head`, share
/// and hold). A look reads a line the writer writes, so not every event; but a hold must
/// reach every thread soon, and at 64 threads on two cores each gets a 32nd of a processor:
/// 256 events a thread (the look's former interval) kept threads running for tens of
/// milliseconds into a hold. Every 64 events costs under one instruction an event more.
const LOOK_EVERY: u64 = 64;
/// The longest a producer waits for a hold to end ([`Lanes::hold`]); past it, it leaves
/// the hold ([`Lanes::leave_hold`]) and publishes into its lane again, up to its share.
pub const MAX_HELD_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// One cache line.
#[repr(C, align(64))]
struct Line<T>(T);

const FREE: u32 = 0;
const TAKEN: u32 = 1;

/// One thread's ring: a header of two cache lines (what the writer writes; whether a
/// thread owns the lane, and where its last owner stopped), then the slots.
#[repr(C)]
pub struct Lane {
    /// Events ever taken (the writer's; the producer reads it when the ring looks full).
    head: Line<AtomicU64>,
    /// Whether a thread owns the lane, and the events its owners published before the
    /// present one claimed it (the owner keeps its own count in its [`Cursor`] meanwhile).
    claim: Line<Claim>,
}

#[repr(C)]
struct Claim {
    /// Written by an owner as it gives the lane back, read by the next as it claims it
    /// (the two synchronize through `owner`).
    tail: UnsafeCell<u64>,
    owner: AtomicU32,
    /// The lane's share of the channel's budget, minus one: it holds at most this many
    /// events plus one. Lowered (never raised) as lanes are mapped; read by the owner at
    /// its next look (see [`Lanes::try_push`]).
    limit: AtomicU32,
    /// Non-zero while the writer holds producers back to serve a snapshot request
    /// ([`Lanes::hold`]); read by the owner at its next look.
    held: AtomicU32,
}

/// A thread's hold on the lane it claimed: where the slots are, and its positions. Kept
/// in the thread's hook state (`channel::thread::HookThread`), on the cache line the hook reads
/// anyway, so that a push reads no other line before its stores: in a real program the
/// work between two events pushes the lane's header out of the nearer caches, and reading
/// the position from there made every event wait for it (docs/HOT-PATH.md, "The
/// recording floor").
#[derive(Clone, Copy)]
pub struct Cursor {
    /// The lane's first slot (the lane's header is right before it).
    slots: *const Slot,
    /// Events per lane minus one.
    mask: u64,
    /// Events ever published into the lane.
    tail: u64,
    /// The position at which the producer looks at its lane's `head` and share again:
    /// where the share it last read would be full, and at most [`LOOK_EVERY`] events
    /// after that look.
    next_look: u64,
}

impl Cursor {
    /// No lane.
    pub const NONE: Cursor = Cursor::marked(std::ptr::null());
    /// A thread that sends through the shared queue for the rest of its life: it gave its
    /// lane back at exit (other destructors may still free memory on it), or found none
    /// (lanes off, or all taken).
    pub const NO_LANE: Cursor = Cursor::marked(std::ptr::without_provenance(1));

    const fn marked(slots: *const Slot) -> Cursor {
        Cursor {
            slots,
            mask: 0,
            tail: 0,
            next_look: 0,
        }
    }

    /// Whether every field is zero ([`Cursor::NONE`] must be: a thread's hook state starts
    /// as zero bytes).
    pub const fn is_all_zero(&self) -> bool {
        self.slots.is_null() && self.mask == 0 && self.tail == 0 && self.next_look == 0
    }

    /// Whether this is [`Cursor::NO_LANE`].
    pub fn is_no_lane(&self) -> bool {
        self.slots == Cursor::NO_LANE.slots
    }

    /// The lane (meaningful only for a cursor [`Lanes::claim`] returned).
    fn lane(&self) -> *const Lane {
        (self.slots as *const u8).wrapping_sub(size_of::<Lane>()) as *const Lane
    }

    /// The slot of position `at`.
    ///
    /// # Safety
    /// `self` is a cursor [`Lanes::claim`] returned.
    unsafe fn slot(&self, at: u64) -> &Slot {
        // SAFETY: the lane's mapping holds `mask + 1` slots from `slots` on (caller's
        // contract), never unmapped.
        unsafe { &*self.slots.wrapping_add((at & self.mask) as usize) }
    }
}

/// One event's place in a ring, and the mark that publishes it: position + 1 once the
/// event at `position` is written. The writer reads the mark in the line it reads the
/// event from: no count of the producer's to read (a line that would travel between the
/// two cores on every event while the writer keeps up). One cache line: a push writes
/// one line and shares it with no other event (the lane's header is two lines, so the
/// slots start on a line).
#[repr(C, align(64))]
struct Slot {
    event: UnsafeCell<std::mem::MaybeUninit<Event>>,
    published: AtomicU64,
}

const _: () = assert!(size_of::<Slot>() == 64 && size_of::<Lane>().is_multiple_of(64));

// SAFETY: `claim.0.tail` is touched only by a thread that owns the lane, as it claims it
// and as it gives it back (the two synchronize through `owner`); everything else is atomic; a
// slot's event is written by the owner before its release store of the slot's mark and read
// by the writer after its acquire load of it, and overwritten only after the writer's
// release store of `head` says it was read.
unsafe impl Sync for Lane {}

impl Lane {
    /// The lane's first slot.
    fn slots(&self) -> *const Slot {
        (self as *const Lane as *const u8).wrapping_add(size_of::<Lane>()) as *const Slot
    }

    /// The slot of position `at`.
    fn slot(&self, at: u64, mask: u64) -> &Slot {
        // SAFETY: the lane's mapping holds `mask + 1` slots after the header (`Lanes::bytes`),
        // zeroed when mapped (a valid `Slot`: no mark, an event not yet written).
        unsafe { &*self.slots().wrapping_add((at & mask) as usize) }
    }

    /// The event at position `at` if it is published (its mark read with acquire).
    fn published(&self, at: u64, mask: u64) -> Option<&Slot> {
        let slot = self.slot(at, mask);
        (slot.published.load(Acquire) == at.wrapping_add(1)).then_some(slot)
    }
}

/// Every lane of a channel, and how big each is.
///
/// The lanes share one budget: a snapshot asked for now (exit, a signal, `memsnap dump`, a
/// crash) waits until the writer has applied every event published before it, so what is
/// queued over all lanes is the work between a request and its file. Each lane may hold
/// the budget divided by the lanes mapped (at least [`MIN_LANE_SHARE`]): one thread gets the
/// whole ring, 64 threads a 64th each. A producer looks at its share again at least every
/// [`LOOK_EVERY`] events, so a lane runs at most that many past a lowered share: the
/// total stays under the budget plus [`LOOK_EVERY`] per lane (69,632 events for 64
/// threads at the default budget of 65,536), however many threads record.
///
/// A bounded queue is not enough when threads outnumber the processors: 64 threads
/// allocating on two cores leave the writer a 65th of the time, and a snapshot request
/// then waits hundreds of milliseconds for the writer to take what was queued before it.
/// So while a request is served and the writer is starved, the lanes are *held*
/// ([`Lanes::hold`]: by the writer, and by a thread that waits for the snapshot it asked
/// for): at its next look a producer finds its lane refused, and waits on a futex word (no
/// processor taken) until every holder lets go, [`MAX_HELD_WAIT`] at most (then it leaves
/// the hold: a hold can slow a thread by that much, not stop it). The writer lets go once
/// the snapshot is written, a waiting thread once it has its answer.
pub struct Lanes {
    /// Whether threads get lanes (the event clock orders events across cores).
    on: bool,
    /// Events per lane minus one (a power of two minus one).
    mask: u64,
    /// Events all lanes together may hold: `MEMSNAP_QUEUE_CAPACITY`.
    budget: u64,
    /// The lanes mapped so far. A thread claims the first free one and maps a new one only
    /// in the first empty entry, which it tries before any later one: the mapped lanes are
    /// always the entries before the first empty one, with no gap (the writer reads up to
    /// there: a count kept beside them would lag the entries for a moment, and a lane left
    /// out of a pass could put an event after one that depended on it).
    table: Box<[AtomicPtr<Lane>]>,
    /// How many hold the lanes (the writer serving a request, threads waiting for a
    /// snapshot they asked for: [`Lanes::hold`]), 0 when none: the futex word held
    /// producers wait on. (Only holders set and clear the lanes' own flags, so none is
    /// left set once all let go; a lane mapped during a hold is not held by it.)
    hold_word: AtomicU32,
    /// Set by a quiet let-go ([`Lanes::let_go_quietly`]): the held producers are still to be
    /// woken.
    pub(super) wake_due: AtomicBool,
}

impl Lanes {
    /// `capacity` events per lane (rounded up to a power of two). Cold.
    pub fn new(on: bool, capacity: usize) -> Lanes {
        Lanes {
            on,
            mask: capacity.max(2).next_power_of_two() as u64 - 1,
            budget: capacity.max(2) as u64,
            table: (0..MAX_LANES)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
            hold_word: AtomicU32::new(0),
            wake_due: AtomicBool::new(false),
        }
    }

    /// Producers wait at their next look until every holder has let go ([`Lanes::let_go`],
    /// once for each `hold`), [`MAX_HELD_WAIT`] at most. Cold; async-signal-safe.
    pub fn hold(&self) {
        if self.hold_word.fetch_add(1, Relaxed) == 0 {
            for lane in self.mapped() {
                lane.claim.0.held.store(1, Relaxed);
            }
        }
    }

    /// Ends one [`Lanes::hold`]; the last to let go wakes the producers waiting on it.
    /// (A hold and the last let-go racing can leave some lanes of the new hold unheld for
    /// it: a hold is a help to the writer, never what correctness rests on.) Cold;
    /// async-signal-safe.
    pub fn let_go(&self) {
        if self.end_hold() {
            futex::wake(&self.hold_word, i32::MAX);
        }
    }

    /// Ends one [`Lanes::hold`] without waking anyone: the last to let go leaves the wake
    /// to [`Lanes::wake_if_due`] (the writer's next pass). For a thread that must go on at
    /// once: woken together, the held threads take the processors from the one that woke
    /// them (at 64 threads on two cores, for 100 ms and more). Cold; async-signal-safe.
    pub fn let_go_quietly(&self) {
        if self.end_hold() {
            self.wake_due.store(true, Release);
        }
    }

    /// Wakes the producers a quiet let-go left waiting, if any. Cold.
    pub fn wake_if_due(&self) {
        if self.wake_due.load(Relaxed) && self.wake_due.swap(false, Acquire) {
            futex::wake(&self.hold_word, i32::MAX);
        }
    }

    /// One holder fewer; true for the last, who cleared the lanes' flags.
    fn end_hold(&self) -> bool {
        let before = self
            .hold_word
            .fetch_update(Release, Relaxed, |holders| holders.checked_sub(1));
        if before != Ok(1) {
            return false;
        }
        for lane in self.mapped() {
            lane.claim.0.held.store(0, Relaxed);
        }
        true
    }

    /// Producer side, cold: the lane of `cursor` is no longer held by the present hold (its
    /// owner waited [`MAX_HELD_WAIT`]); the next hold holds it again.
    ///
    /// # Safety
    /// As for [`Lanes::try_push`].
    pub unsafe fn leave_hold(cursor: &Cursor) {
        // SAFETY: the cursor's lane, mapped for the life of the process.
        unsafe { (*cursor.lane()).claim.0.held.store(0, Relaxed) };
    }

    /// Whether anyone holds the lanes.
    pub fn held(&self) -> bool {
        self.hold_word.load(Relaxed) != 0
    }

    /// Producer side, cold: waits until the hold ends or `timeout` passes (a spurious
    /// return is harmless: the caller looks again).
    pub fn wait_while_held(&self, timeout: std::time::Duration) {
        let holders = self.hold_word.load(Relaxed);
        if holders != 0 {
            futex::wait(&self.hold_word, holders, timeout);
        }
    }

    /// Events one lane holds.
    pub fn capacity(&self) -> u64 {
        self.mask + 1
    }

    /// Each lane's share of the budget, minus one, once `lanes` are mapped (never more than
    /// its ring holds).
    fn limit_for(&self, lanes: usize) -> u32 {
        let share = (self.budget / lanes.max(1) as u64).max(MIN_LANE_SHARE);
        (share.min(self.capacity()) - 1) as u32
    }

    fn bytes(&self) -> usize {
        size_of::<Lane>() + self.capacity() as usize * size_of::<Slot>()
    }

    /// Publishes `ev` in the lane of `cursor`; `false` when the lane holds its share (the
    /// writer is behind) or is held ([`Lanes::hold`]). Reads nothing but the cursor before its stores, except at a look
    /// (the lane's `head` and share: when the share last read would be full, and at least
    /// every [`LOOK_EVERY`] events).
    ///
    /// # Safety
    /// `cursor` holds a cursor [`Lanes::claim`] returned, of a lane the calling thread owns.
    #[inline(always)]
    pub unsafe fn try_push(cursor: &Cell<Cursor>, ev: &Event) -> bool {
        let mut c = cursor.get();
        let at = c.tail;
        if at >= c.next_look {
            // SAFETY: the cursor's lane, mapped for the life of the process.
            let lane = unsafe { &*c.lane() };
            let head = lane.head.0.load(Acquire);
            // Lanes mapped since the last look may have lowered this lane's share.
            let limit = u64::from(lane.claim.0.limit.load(Relaxed));
            if at.wrapping_sub(head) > limit {
                return false;
            }
            // Held: the writer serves a request and wants the processors (see `hold`).
            // On the line of `limit`, read with it: no other line at a look.
            if lane.claim.0.held.load(Relaxed) != 0 {
                return false;
            }
            c.next_look = (head + limit + 1).min(at + LOOK_EVERY);
            cursor.set(c);
        }
        // SAFETY: the caller's contract.
        let slot = unsafe { c.slot(at) };
        // SAFETY: the slot of position `at` is free: at the last look the writer had taken
        // every event up to a `head` at most `limit + 1 <= mask + 1` behind `next_look`, and
        // only the owner writes the lane.
        unsafe { (*slot.event.get()).write(*ev) };
        slot.published.store(at.wrapping_add(1), Release);
        // Only the count changed: one store, not the whole cursor's four.
        // SAFETY: the calling thread's own cell (not `Sync`), no reference into it held.
        unsafe { (*cursor.as_ptr()).tail = at.wrapping_add(1) };
        // The next event's line, asked for now: it was last written one turn of the ring
        // ago and the program's work until the next event gives it time to arrive; its
        // store then waits for nothing (docs/HOT-PATH.md, "The next slot asked for").
        // SAFETY: the caller's contract (any position has a slot).
        let next = unsafe { c.slot(at.wrapping_add(1)) };
        prefetch_for_write(next as *const Slot as usize);
        true
    }

    /// The line the next [`Lanes::try_push`] with `cursor` writes (its slot: the event
    /// and its mark), for a caller that asks for it while it does other work first.
    ///
    /// # Safety
    /// As for [`Lanes::try_push`].
    #[inline(always)]
    pub unsafe fn next_slot(cursor: &Cursor) -> usize {
        // SAFETY: the caller's contract.
        unsafe { cursor.slot(cursor.tail) as *const Slot as usize }
    }

    /// A lane for the calling thread: a free one, or a new mapping. `None` when lanes are
    /// off, all [`MAX_LANES`] are owned, or the mapping failed. Cold: a thread's first
    /// event.
    #[cold]
    pub fn claim(&self) -> Option<Cursor> {
        let lane = self.claim_lane()?;
        // SAFETY: this thread owns the lane now; the previous owner's `tail` came with the
        // claim.
        let tail = unsafe { *lane.claim.0.tail.get() };
        Some(Cursor {
            slots: lane.slots(),
            mask: self.mask,
            tail,
            // The first push looks at the lane.
            next_look: tail,
        })
    }

    fn claim_lane(&self) -> Option<&Lane> {
        if !self.on {
            return None;
        }
        for (index, entry) in self.table.iter().enumerate() {
            let mut lane = entry.load(Acquire);
            if lane.is_null() {
                let fresh = self.map_lane()?;
                let limit = self.limit_for(index + 1);
                // SAFETY: our mapping, not yet published.
                unsafe { (*fresh).claim.0.limit.store(limit, Relaxed) };
                match entry.compare_exchange(std::ptr::null_mut(), fresh, AcqRel, Acquire) {
                    Ok(_) => {
                        // One more lane: every lane's share is lowered to its new size.
                        for other in self.mapped() {
                            other.claim.0.limit.fetch_min(limit, Relaxed);
                        }
                        // SAFETY: just mapped and published, owned by this thread.
                        return Some(unsafe { &*fresh });
                    }
                    Err(other) => {
                        // SAFETY: our mapping, never published.
                        unsafe { libc::munmap(fresh.cast(), self.bytes()) };
                        lane = other;
                    }
                }
            }
            // SAFETY: a published lane, never unmapped.
            let lane = unsafe { &*lane };
            if lane
                .claim
                .0
                .owner
                .compare_exchange(FREE, TAKEN, Acquire, Relaxed)
                .is_ok()
            {
                return Some(lane);
            }
        }
        None
    }

    /// A zeroed lane, owned by the calling thread. Cold.
    fn map_lane(&self) -> Option<*mut Lane> {
        // SAFETY: a fresh private anonymous mapping; nothing else is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                self.bytes(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        let lane = p as *mut Lane;
        // SAFETY: zero bytes are a valid header (counts 0, free) and valid slots (no mark);
        // the mapping is ours.
        unsafe { (*lane).claim.0.owner.store(TAKEN, Relaxed) };
        Some(lane)
    }

    /// Lane `index`, if mapped. Writer side.
    fn get(&self, index: usize) -> Option<&Lane> {
        let p = self.table.get(index)?.load(Acquire);
        // SAFETY: a published lane, never unmapped.
        unsafe { p.as_ref() }
    }

    /// The mapped lanes, in order (see `table`).
    fn mapped(&self) -> impl Iterator<Item = &Lane> {
        (0..MAX_LANES).map_while(|i| self.get(i))
    }

    /// Whether any lane holds an event not yet taken (one mark read per lane).
    pub fn any_queued(&self) -> bool {
        self.mapped().any(|lane| {
            lane.published(lane.head.0.load(Acquire), self.mask)
                .is_some()
        })
    }

    /// Per lane, the position after its last event published now: the writer has taken
    /// every one of them once its `head` reaches it. Writer side.
    fn published_ends(&self) -> Vec<u64> {
        self.mapped()
            .map(|lane| {
                let mut at = lane.head.0.load(Relaxed);
                while lane.published(at, self.mask).is_some() {
                    at += 1;
                }
                at
            })
            .collect()
    }

    /// Events published and not yet taken, over all lanes (their marks counted).
    pub fn queued(&self) -> u64 {
        self.mapped()
            .map(|lane| {
                let head = lane.head.0.load(Acquire);
                (head..head.wrapping_add(self.capacity()))
                    .take_while(|&at| lane.published(at, self.mask).is_some())
                    .count() as u64
            })
            .sum()
    }
}

static LANE_KEY: ExitKey = ExitKey::new();

unsafe extern "C" fn release(p: *mut libc::c_void) {
    let cursor = crate::channel::thread::with_thread(|t| t.go_without_lane());
    if !p.is_null() {
        let lane = p as *const Lane;
        // SAFETY: the lane this thread claimed (`release_at_exit`); it publishes nothing
        // more into it (its hook state says "gone"). Its count goes to the lane for the
        // next owner, before the release store that hands the lane over.
        unsafe {
            if cursor.lane() == lane {
                *(*lane).claim.0.tail.get() = cursor.tail;
            }
            (*lane).claim.0.owner.store(FREE, Release);
        }
    }
}

/// Gives `lane` back when the calling thread exits. Cold.
pub fn release_at_exit(cursor: &Cursor) {
    // SAFETY: `release` takes a lane, and lanes are never unmapped.
    unsafe { LANE_KEY.call_at_exit(cursor.lane() as *mut libc::c_void, release) };
}

/// What the writer knows of one lane.
#[derive(Clone, Copy, Default)]
struct LaneReading {
    /// The next position to take (the writer's copy of the lane's `head`).
    next: u64,
    /// Positions before this were seen published at an earlier pass: taken whatever their
    /// stamp.
    seen_before: u64,
    /// Positions before this were seen published (this pass included).
    seen: u64,
}

/// The writer's side: takes the events of every lane and of the shared queue in one
/// order (see the module's text). Owned by the writer; cold relative to the hooks.
#[derive(Default)]
pub struct Reader {
    /// Per lane, by its index in the table.
    lanes: Vec<LaneReading>,
    /// The lanes that had an event published at the start of this pass.
    active: Vec<usize>,
    /// The shared queue's oldest event, taken off it to read its stamp, and whether it
    /// was taken at an earlier pass.
    shared_front: Option<(Event, bool)>,
    /// This pass's watermark: events stamped after it wait for the next pass.
    watermark: u64,
    /// Events of the shared queue returned so far.
    shared_returned: u64,
}

/// Where the lanes and the shared queue stood when [`Reader::mark`] was called: the reader
/// has taken every event published before then once it has [`Reader::passed`] it.
pub struct ReadMark {
    /// Per lane mapped then: the position after its last published event.
    lanes: Vec<u64>,
    /// Shared-queue events the reader will have returned by then.
    shared: u64,
}

impl Reader {
    pub fn new() -> Reader {
        Reader::default()
    }

    /// The next event in order, if any is ready.
    pub fn next(&mut self, rec: &Recorder) -> Option<Event> {
        if let Some(ev) = self.take_earliest(rec) {
            return Some(ev);
        }
        self.start_pass(rec);
        self.take_earliest(rec)
    }

    /// Where every lane and the shared queue stand now (see [`ReadMark`]).
    pub fn mark(&self, rec: &Recorder) -> ReadMark {
        ReadMark {
            lanes: rec.lanes.published_ends(),
            // One queue, one consumer: the events in it now are the next ones it returns.
            shared: self.shared_returned
                + u64::from(self.shared_front.is_some())
                + rec.events.len() as u64,
        }
    }

    /// Whether every event published before `mark` was taken.
    pub fn passed(&self, rec: &Recorder, mark: &ReadMark) -> bool {
        self.shared_returned >= mark.shared
            && rec
                .lanes
                .mapped()
                .zip(&mark.lanes)
                .all(|(lane, &end)| lane.head.0.load(Relaxed) >= end)
    }

    fn start_pass(&mut self, rec: &Recorder) {
        // First the clock, then the marks (see the module's text).
        self.watermark = crate::process::clock::now_before_loads().0;
        let lanes = &rec.lanes;
        self.active.clear();
        for (index, lane) in lanes.mapped().enumerate() {
            if self.lanes.len() <= index {
                let next = lane.head.0.load(Relaxed);
                self.lanes.push(LaneReading {
                    next,
                    seen_before: next,
                    seen: next,
                });
            }
            let reading = &mut self.lanes[index];
            reading.seen_before = reading.seen;
            if lane.published(reading.next, lanes.mask).is_some() {
                reading.seen = reading.seen.max(reading.next + 1);
                self.active.push(index);
            }
        }
        match &mut self.shared_front {
            Some((_, seen_before)) => *seen_before = true,
            None => self.shared_front = Self::pop_shared(rec).map(|ev| (ev, false)),
        }
    }

    /// The shared queue's oldest event, counted in
    /// [`Counters::applied`](crate::channel::queue::Counters::applied) before it leaves the
    /// queue: whoever sees the queue without it sees it counted ([`Recorder::all_read`]).
    fn pop_shared(rec: &Recorder) -> Option<Event> {
        count_taken(rec, 1);
        let ev = rec.events.pop();
        if ev.is_none() {
            count_taken(rec, u64::MAX); // none was there: the count back (wrapping -1)
        }
        ev
    }

    /// The earliest event of this pass that may be taken now.
    fn take_earliest(&mut self, rec: &Recorder) -> Option<Event> {
        let lanes = &rec.lanes;
        let watermark = self.watermark;
        let ready = |time: u64, seen_before: bool| seen_before || time <= watermark;
        let mut best: Option<(usize, u64)> = None;
        for &index in &self.active {
            let (Some(lane), Some(reading)) = (lanes.get(index), self.lanes.get_mut(index)) else {
                continue;
            };
            let Some(slot) = lane.published(reading.next, lanes.mask) else {
                continue;
            };
            reading.seen = reading.seen.max(reading.next + 1);
            // SAFETY: published (its mark read with acquire) and not yet taken: only this
            // reader takes, and the producer writes the slot again only after `head` passed it.
            let time = unsafe { (*slot.event.get()).assume_init_ref().time.0 };
            if ready(time, reading.next < reading.seen_before) && best.is_none_or(|(_, t)| time < t)
            {
                best = Some((index, time));
            }
        }
        if let Some((ev, seen_before)) = self.shared_front
            && ready(ev.time.0, seen_before)
            && best.is_none_or(|(_, t)| ev.time.0 < t)
        {
            // The next one is new to this pass: taken by its stamp alone.
            self.shared_front = Self::pop_shared(rec).map(|ev| (ev, false));
            self.shared_returned += 1;
            return Some(ev);
        }
        let (index, _) = best?;
        let (lane, reading) = (lanes.get(index)?, self.lanes.get_mut(index)?);
        let slot = lane.slot(reading.next, lanes.mask);
        // SAFETY: as above; read before `head` says the position may be written again.
        let ev = unsafe { (*slot.event.get()).assume_init_read() };
        reading.next += 1;
        // Counted before `head` moves past it: whoever sees the lane without it sees it
        // counted ([`Recorder::all_read`]).
        count_taken(rec, 1);
        lane.head.0.store(reading.next, Release);
        Some(ev)
    }
}

/// Counts an event taken off a lane or the shared queue in
/// [`Counters::applied`](crate::channel::queue::Counters::applied). The reader's thread is
/// the only one that writes it: no locked add.
fn count_taken(rec: &Recorder, n: u64) {
    let applied = &rec.counters.applied;
    applied.store(applied.load(Relaxed).wrapping_add(n), Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::event::{Api, Kind};
    use crate::channel::queue::HookSettings;
    use crate::channel::thread;
    use crate::config::{Context, Stacks};
    use crate::process::clock::{self, Stamp};
    use std::sync::atomic::AtomicUsize;
    use std::sync::{Arc, Barrier};

    fn channel(capacity: usize) -> &'static Recorder {
        let settings = HookSettings {
            stacks: Stacks::None,
            context: Context::Alloc,
            max_frames: 64,
            dump_on_oom: false,
        };
        Box::leak(Box::new(Recorder::new(capacity, settings, true)))
    }

    /// Sends one event stamped `time` (its address is the stamp too) from the calling
    /// thread.
    fn send(rec: &Recorder, time: u64) {
        let mut ev = Event::new(Kind::Alloc, Api::CudaMalloc);
        ev.time = Stamp(time);
        ev.set_addr(time);
        thread::with_thread(|t| rec.push(t, ev));
    }

    /// Pushes into a lane of its own until it is full; returns how many it took.
    fn fill_a_lane(lanes: &Lanes, all_claimed: &Barrier) -> u64 {
        let cursor = Cell::new(lanes.claim().expect("a lane"));
        all_claimed.wait();
        let ev = Event::new(Kind::Alloc, Api::CudaMalloc);
        let mut pushed = 0;
        // SAFETY: the cursor of the lane this thread claimed and owns.
        while unsafe { Lanes::try_push(&cursor, &ev) } {
            pushed += 1;
        }
        pushed
    }

    /// What is queued over all lanes is the work between a snapshot request and its file:
    /// one thread may fill the whole budget, eight threads share it, and nothing is
    /// refused that fits the share (the writer takes nothing here).
    #[test]
    fn the_lanes_share_one_budget_however_many_threads_record() {
        const BUDGET: usize = 4096;
        let alone = Lanes::new(true, BUDGET);
        assert_eq!(fill_a_lane(&alone, &Barrier::new(1)), BUDGET as u64);

        const THREADS: usize = 8;
        let lanes = Arc::new(Lanes::new(true, BUDGET));
        let all_claimed = Arc::new(Barrier::new(THREADS));
        let filled: Vec<u64> = (0..THREADS)
            .map(|_| {
                let (lanes, all_claimed) = (lanes.clone(), all_claimed.clone());
                std::thread::spawn(move || fill_a_lane(&lanes, &all_claimed))
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        // Each lane looked at its share as it began: every lane was mapped by then.
        assert_eq!(filled, vec![(BUDGET / THREADS) as u64; THREADS]);
        assert_eq!(lanes.queued(), BUDGET as u64);
    }

    /// A lane whose share was lowered while it was sending (threads that start later) takes
    /// the lower share at its next look, at most [`LOOK_EVERY`] events later.
    #[test]
    fn a_lowered_share_is_taken_within_a_look() {
        const BUDGET: usize = 8192;
        let lanes = Lanes::new(true, BUDGET);
        let first = Cell::new(lanes.claim().unwrap());
        let ev = Event::new(Kind::Alloc, Api::CudaMalloc);
        for _ in 0..1000 {
            // SAFETY: the cursor of a lane this thread claimed and owns.
            assert!(unsafe { Lanes::try_push(&first, &ev) });
        }
        // Seven more lanes: a share of 1024 each.
        let _others: Vec<Cursor> = (0..7).map(|_| lanes.claim().unwrap()).collect();
        let mut more = 0;
        // SAFETY: as above.
        while unsafe { Lanes::try_push(&first, &ev) } {
            more += 1;
        }
        assert!(1000 + more <= 1024 + LOOK_EVERY as usize, "{more} more");
        assert!(1000 + more >= 1024, "{more} more");
    }

    /// While the writer holds the lanes a producer is refused at its next look, however
    /// much room its lane has (at most [`LOOK_EVERY`] events later), and takes events
    /// again once let go.
    #[test]
    fn a_held_lane_refuses_within_a_look_and_takes_again_once_let_go() {
        let lanes = Lanes::new(true, 8192);
        let cursor = Cell::new(lanes.claim().unwrap());
        let ev = Event::new(Kind::Alloc, Api::CudaMalloc);
        for _ in 0..10 {
            // SAFETY: the cursor of a lane this thread claimed and owns.
            assert!(unsafe { Lanes::try_push(&cursor, &ev) });
        }
        lanes.hold();
        let mut more = 0;
        // SAFETY: as above.
        while unsafe { Lanes::try_push(&cursor, &ev) } {
            more += 1;
            assert!(
                more <= LOOK_EVERY,
                "still taking events {more} after the hold"
            );
        }
        assert!(lanes.held());
        lanes.let_go();
        assert!(!lanes.held());
        // SAFETY: as above.
        assert!(unsafe { Lanes::try_push(&cursor, &ev) });
    }

    /// A thread that sends events 1 to `events`, the lanes held (`Recorder::hold_lanes`)
    /// once its first event claimed its lane; and its thread id.
    fn producer_held_after_its_first_event(
        rec: &'static Recorder,
        events: u64,
    ) -> (std::thread::JoinHandle<()>, i32) {
        let lane_claimed = Arc::new(Barrier::new(2));
        let held = lane_claimed.clone();
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let producer = std::thread::spawn(move || {
            // SAFETY: no arguments, no memory touched.
            tid_tx.send(unsafe { libc::gettid() }).unwrap();
            send(rec, 1); // claims the thread's lane
            held.wait();
            held.wait();
            for time in 2..=events {
                send(rec, time);
            }
        });
        lane_claimed.wait();
        rec.hold_lanes();
        lane_claimed.wait();
        (producer, tid_rx.recv().unwrap())
    }

    /// A thread held while it records waits until the writer lets go, and a hold that
    /// never ends holds it [`MAX_HELD_WAIT`] at most: it records on, nothing lost.
    #[test]
    fn a_held_thread_waits_until_let_go_and_no_longer_than_the_longest_wait() {
        const EVENTS: u64 = 3 * MIN_LANE_SHARE;
        for let_go in [true, false] {
            let rec = channel(8192);
            let waits_before = rec.counters.queue_waits.load(Relaxed);
            let began = std::time::Instant::now();
            let (producer, _) = producer_held_after_its_first_event(rec, EVENTS);
            if let_go {
                while rec.counters.queue_waits.load(Relaxed) == waits_before {
                    std::thread::yield_now();
                }
                rec.let_lanes_go();
            }
            producer.join().unwrap();
            if !let_go {
                assert!(began.elapsed() >= MAX_HELD_WAIT, "left the hold early");
            }
            let mut reader = Reader::new();
            let taken: Vec<u64> = std::iter::from_fn(|| reader.next(rec))
                .map(|e| e.addr())
                .collect();
            assert_eq!(taken, (1..=EVENTS).collect::<Vec<_>>(), "let go: {let_go}");
            assert!(rec.counters.queue_waits.load(Relaxed) > waits_before);
        }
    }

    /// Two holders (the writer and a thread waiting for its snapshot): the lanes stay held
    /// until both let go, in either order; a let-go without a hold changes nothing.
    #[test]
    fn the_lanes_stay_held_until_every_holder_lets_go() {
        let lanes = Lanes::new(true, 8192);
        let cursor = Cell::new(lanes.claim().unwrap());
        let ev = Event::new(Kind::Alloc, Api::CudaMalloc);
        let refused_within_a_look = |cursor: &Cell<Cursor>| {
            // SAFETY: the cursor of a lane this thread claimed and owns.
            (0..=LOOK_EVERY).any(|_| !unsafe { Lanes::try_push(cursor, &ev) })
        };
        lanes.let_go();
        assert!(!lanes.held(), "a let-go without a hold");
        lanes.hold();
        lanes.hold();
        lanes.let_go();
        assert!(lanes.held());
        assert!(refused_within_a_look(&cursor), "one holder of two let go");
        lanes.let_go_quietly();
        assert!(!lanes.held());
        assert!(!refused_within_a_look(&cursor), "both let go");
    }

    /// A quiet let-go leaves the held thread waiting until the wake it leaves due (the
    /// writer's next pass), so that the thread that let go runs first.
    #[test]
    fn a_quiet_let_go_wakes_the_held_threads_at_the_writers_next_pass() {
        const EVENTS: u64 = 4 * LOOK_EVERY;
        let rec = channel(8192);
        let (producer, tid) = producer_held_after_its_first_event(rec, EVENTS);
        // Until the producer sleeps in its wait for the hold to end.
        let stat = format!("/proc/self/task/{tid}/stat");
        let asleep = || {
            let text = std::fs::read_to_string(&stat).unwrap_or_default();
            text.rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with('S'))
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while rec.counters.queue_waits.load(Relaxed) == 0 || !asleep() {
            assert!(std::time::Instant::now() < deadline, "never held");
            std::thread::yield_now();
        }
        rec.lanes.let_go_quietly();
        let published = |rec: &Recorder| rec.lanes.queued();
        let before = published(rec);
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(published(rec), before, "woken before the writer's pass");
        assert!(!producer.is_finished());
        rec.wake_held_if_due();
        producer.join().unwrap();
        let mut reader = Reader::new();
        let taken: Vec<u64> = std::iter::from_fn(|| reader.next(rec))
            .map(|e| e.addr())
            .collect();
        assert_eq!(taken, (1..=EVENTS).collect::<Vec<_>>());
    }

    /// The line a hook asks for before its walks is where its next push writes: the event
    /// at its start, its mark (position + 1) in its last 8 bytes, lap after lap.
    #[test]
    fn the_next_push_line_is_where_the_next_push_writes() {
        let rec = channel(4);
        std::thread::spawn(move || {
            send(rec, 1); // claims the thread's lane
            assert_eq!(Reader::new().next(rec).map(|e| e.addr()), Some(1));
            for time in 2..12u64 {
                let line = thread::with_thread(|t| rec.next_push_line(t)).expect("a lane");
                assert_eq!(line % 64, 0, "a slot is a line of its own");
                let (event_at, mark_at) = (line, line + 56);
                send(rec, time);
                // SAFETY: the slot of this thread's lane the push just wrote; the writer
                // is not running and takes nothing from the lane while we read.
                let (event, mark) = unsafe {
                    (
                        std::ptr::read(event_at as *const Event),
                        (*(mark_at as *const AtomicU64)).load(Acquire),
                    )
                };
                assert_eq!((event.addr(), event.time), (time, Stamp(time)));
                assert_eq!(mark, time, "position {} published", time - 1);
                // Take it, so that the ring has room for the next lap.
                assert_eq!(Reader::new().next(rec).map(|e| e.addr()), Some(time));
            }
        })
        .join()
        .unwrap();
    }

    /// A thread that sends events stamped `times`, then waits on `hold` (keeping its lane)
    /// before it exits.
    fn sender(
        rec: &'static Recorder,
        times: Vec<u64>,
        hold: Arc<Barrier>,
    ) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            for t in times {
                send(rec, t);
            }
            hold.wait();
        })
    }

    fn wait_until_queued(rec: &Recorder, n: u64) {
        while rec.queued() < n {
            std::thread::yield_now();
        }
    }

    #[test]
    fn lanes_are_merged_by_stamp_and_an_event_stamped_after_the_watermark_waits_a_pass() {
        let rec = channel(16);
        let now = clock::now().0;
        let later = now + (1 << 50);
        let hold = Arc::new(Barrier::new(4));
        let a = sender(rec, vec![now - 30, now - 10], hold.clone());
        wait_until_queued(rec, 2);
        let b = sender(rec, vec![now - 20, later], hold.clone());
        wait_until_queued(rec, 4);
        let mut reader = Reader::new();
        let mut taken: Vec<u64> = (0..3)
            .filter_map(|_| reader.next(rec))
            .map(|e| e.addr())
            .collect();
        assert_eq!(
            taken,
            [now - 30, now - 20, now - 10],
            "one order across two lanes"
        );
        // Published after the first pass read the counts, stamped before `later`, which
        // that pass saw already but held back: the next pass takes both, by stamp.
        let c = sender(rec, vec![now - 5], hold.clone());
        wait_until_queued(rec, 2);
        taken.extend(std::iter::from_fn(|| reader.next(rec)).map(|e| e.addr()));
        assert_eq!(taken, [now - 30, now - 20, now - 10, now - 5, later]);
        assert_eq!(
            rec.lanes.mapped().count(),
            3,
            "three threads alive, three lanes"
        );
        assert_eq!(rec.counters.applied.load(Relaxed), 5);
        hold.wait();
        for t in [a, b, c] {
            t.join().unwrap();
        }
    }

    #[test]
    fn a_read_mark_is_passed_once_every_event_published_before_it_was_taken() {
        let rec = channel(16);
        let now = clock::now().0;
        let hold = Arc::new(Barrier::new(3));
        let lane = sender(rec, vec![now - 30, now - 10], hold.clone());
        let shared = std::thread::spawn({
            let hold = hold.clone();
            move || {
                thread::with_thread(|t| t.go_without_lane());
                send(rec, now - 20);
                hold.wait();
            }
        });
        wait_until_queued(rec, 3);
        let mut reader = Reader::new();
        let mark = reader.mark(rec);
        assert!(!reader.passed(rec, &mark));
        let mut taken = Vec::new();
        for _ in 0..2 {
            taken.push(reader.next(rec).expect("queued").addr());
            assert!(!reader.passed(rec, &mark), "after {taken:?}");
        }
        // Published after the mark (by a thread that does not wait to exit): not waited for.
        let later = sender(rec, vec![now - 5], Arc::new(Barrier::new(1)));
        wait_until_queued(rec, 2);
        taken.push(reader.next(rec).expect("queued").addr());
        assert_eq!(taken, [now - 30, now - 20, now - 10]);
        assert!(reader.passed(rec, &mark));
        hold.wait();
        for t in [lane, shared, later] {
            t.join().unwrap();
        }
    }

    #[test]
    fn a_lane_given_back_at_exit_is_claimed_again_and_a_thread_without_one_uses_the_queue() {
        let rec = channel(16);
        let now = clock::now().0;
        std::thread::spawn(move || send(rec, now - 3))
            .join()
            .unwrap();
        std::thread::spawn(move || send(rec, now - 2))
            .join()
            .unwrap();
        assert_eq!(
            rec.lanes.mapped().count(),
            1,
            "the second thread took the first's lane"
        );
        std::thread::spawn(move || {
            // As after its exit destructor gave the lane back.
            thread::with_thread(|t| t.go_without_lane());
            send(rec, now - 1);
        })
        .join()
        .unwrap();
        assert_eq!(rec.events.len(), 1, "the shared queue");
        assert_eq!(rec.lanes.queued(), 2);
        let mut reader = Reader::new();
        let taken: Vec<u64> = std::iter::from_fn(|| reader.next(rec))
            .map(|e| e.addr())
            .collect();
        assert_eq!(taken, [now - 3, now - 2, now - 1]);
        assert_eq!(rec.queued(), 0);
    }

    #[test]
    fn threads_beyond_the_lanes_use_the_shared_queue_in_the_same_order() {
        const THREADS: usize = MAX_LANES + 4;
        let rec = channel(16);
        let base = clock::now().0 - 10_000;
        let turn: &'static AtomicUsize = Box::leak(Box::new(AtomicUsize::new(0)));
        let hold = Arc::new(Barrier::new(THREADS + 1));
        let threads: Vec<_> = (0..THREADS)
            .map(|i| {
                let hold = hold.clone();
                std::thread::spawn(move || {
                    // One after the other, so that the shared queue's order is the stamps'.
                    while turn.load(Acquire) != i {
                        std::thread::yield_now();
                    }
                    send(rec, base + i as u64);
                    turn.store(i + 1, Release);
                    hold.wait();
                })
            })
            .collect();
        wait_until_queued(rec, THREADS as u64);
        assert_eq!(rec.lanes.mapped().count(), MAX_LANES);
        assert_eq!(rec.events.len(), THREADS - MAX_LANES);
        let mut reader = Reader::new();
        let taken: Vec<u64> = std::iter::from_fn(|| reader.next(rec))
            .map(|e| e.addr())
            .collect();
        let expected: Vec<u64> = (0..THREADS as u64).map(|i| base + i).collect();
        assert_eq!(taken, expected);
        hold.wait();
        for t in threads {
            t.join().unwrap();
        }
    }
}

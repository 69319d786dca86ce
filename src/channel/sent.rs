//! The stacks a thread has sent in full, so that a repeated stack travels as its hash.
//!
//! Hot. Most stacks of a training loop repeat. The first time a thread sends a stack, it
//! goes in full in a stack slot, with its [`StackSlot::identity_hash`]; afterwards the
//! thread sends only the hash ([`StackRef::Sent`]), which the writer looks up among the
//! stacks it interned. A repeated stack then costs the hook no slot (two contended atomic
//! operations on the shared free list) and no copy, and the writer one table lookup instead
//! of reading a whole stack written on another core.
//!
//! Why the writer always has the stack a hash names: a thread's events reach the writer in
//! the thread's order (its lane, or the shared queue: `queue`), so a thread's full send is
//! taken before its later references. (A thread that moves from its lane to the shared
//! queue at its exit keeps its order through the writer's merge by stamp: `lanes`.) Only
//! the hashes this thread itself sent are in its table.
//!
//! Per thread: a table of [`SENT_TABLE_SLOTS`] hashes in sets of eight (a stack the table
//! forgot is simply sent in full again), a scratch stack the hook captures into before it
//! knows whether the stack is new, and the trail of its last Python walk: 258 KiB of
//! address space, mapped on the thread's first stack (resident as the table fills) and
//! unmapped when the thread exits. No lock; no allocation or syscall afterwards.

use crate::channel::event::{Event, StackRef, StackSlot};
use crate::channel::queue::Recorder;
use crate::channel::thread::{self, HookThread};
use crate::thread_state::ExitKey;

/// Hashes a thread's table holds (256 KiB).
pub const SENT_TABLE_SLOTS: usize = 32768;
/// Entries per set: one cache line of hashes. A direct-mapped table of 4,096 entries sent
/// 11% of the events of a loop over 2,000 distinct stacks in full again, because stacks
/// evicted each other from shared entries; with sets of eight, none but the first sends.
/// Over 20,000 distinct stacks, 8,192 entries sent 29% in full and 16,384 sent 9%
/// (`cargo bench --bench writer`, docs/BENCHMARKS.md); each of those costs the hook a slot
/// and a copy, and the writer a read of the whole stack from another core and a compare.
/// 32,768 entries hold them all.
const WAYS: usize = 8;
const SETS: usize = SENT_TABLE_SLOTS / WAYS;

/// Marks a thread whose state was freed by the thread-exit destructor.
const STATE_GONE: *mut ThreadStacks = std::ptr::without_provenance_mut(1);

/// Frames of a walk remembered for the next one's prefetch (the records' capacity).
pub const TRAIL_FRAMES: usize = crate::config::FRAME_CAPACITY;

/// Where a thread's previous Python walk read: the words the chain starts from and the
/// frames it visited. The next capture asks for all those cache lines at once before either
/// walk starts (`capture::python::prefetch`, which with the walk owns what a trail holds).
/// The walk is a chain of dependent loads (the thread state, then each frame's
/// `previous`); in a real program, whose work between two events pushes these lines out of
/// the nearer caches, each step would otherwise wait for its miss after the one before, and
/// fetched together the waits overlap (docs/HOT-PATH.md, "The Python walk's cache
/// misses"). The code objects are not asked for: their loads hang off the chain, not
/// on it, and the processor already overlaps them. The addresses are only ever prefetched,
/// never read through: a frame gone since costs one useless fetch, nothing else (a prefetch
/// does not fault).
///
/// All zero is an empty trail (a thread's fresh state is zero pages).
///
/// `repr(C)`: the frames first, then the head and the count, which a capture reads first
/// and writes last, so that the thread's stack state can put those two on the line of its
/// own first fields ([`ThreadStacks`]) and the frames on lines of their own. Laid out by
/// the compiler, the count came after the frames, on a line of its own.
#[repr(C)]
pub struct Trail {
    /// Frames visited: the i-th at `i % TRAIL_FRAMES` (a deeper walk's outer frames take
    /// the places of its inner ones; any frame of the chain is worth fetching).
    pub(crate) frames: [u64; TRAIL_FRAMES],
    /// The addresses the chain's first pointer was read from (3.11/3.12: the thread state's
    /// `cframe` word, then the `_PyCFrame`'s frame pointer; elsewhere the first only).
    pub(crate) head: [u64; 2],
    /// How many places of `frames` hold a frame of the last walk.
    pub(crate) n_frames: u32,
}

/// Where a trail's head begins; its count follows it.
pub const TRAIL_HEAD_AT: usize = std::mem::offset_of!(Trail, head);
const _: () = assert!(
    std::mem::offset_of!(Trail, frames) == 0
        && std::mem::offset_of!(Trail, n_frames) == TRAIL_HEAD_AT + 16
);

impl Trail {
    pub const EMPTY: Trail = Trail {
        frames: [0; TRAIL_FRAMES],
        head: [0; 2],
        n_frames: 0,
    };
}

/// One thread's sent stacks and capture scratch.
///
/// Laid out by hand (`repr(C)`): what every event with a stack touches outside its set
/// and its frames shares one cache line, which the send asks for before the walks
/// ([`ThreadStacks::send_line`]): the Python trail's head and count (read first, written
/// last), the channel (read), the count of stacks sent by reference and the scratch
/// stack's counts (written). The trail's frames come before that line, the scratch stack's
/// frames after it. Left to the compiler these were on four lines, the by-reference count
/// written last, right before PyTorch releases its allocator's mutex (a locked
/// instruction, which waits for the store's line); and each set of the table straddled two
/// lines. Counted in docs/HOT-PATH.md, "The send's lines".
#[repr(C)]
pub struct ThreadStacks {
    /// Where the thread's previous Python walk read, for the next one's prefetch: its
    /// frames, then its head and count (on the shared line).
    pub trail: Trail,
    /// The channel the table's hashes were sent on: a new one (a process forked before its
    /// first CUDA call that starts recording) empties the table. 0: none yet.
    channel: usize,
    /// Stacks this thread sent by reference (tests read it).
    pub by_reference: u64,
    /// Where the hook captures the stack; its counts come first.
    pub scratch: StackSlot,
    /// Hashes sent in full, each in set `hash % SETS`, newest first (a full set forgets
    /// its oldest); 0: empty (a stack hashing to 0 is always sent in full).
    sent: [Set; SETS],
}

/// One set of the table: a cache line of hashes.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Set([u64; WAYS]);

/// The line of the trail's head and count, the channel, the by-reference count and the
/// scratch stack's counts (the state is page-aligned: offsets are positions in lines).
const SHARED_LINE: usize = (std::mem::offset_of!(ThreadStacks, trail) + TRAIL_HEAD_AT) / 64;
const _: () = assert!(
    (std::mem::offset_of!(ThreadStacks, scratch) + std::mem::offset_of!(StackSlot, native) - 1)
        / 64
        == SHARED_LINE
);
// The trail's frames start a line; a set is one line.
const _: () = assert!(std::mem::offset_of!(ThreadStacks, trail) % 64 == 0);
const _: () = assert!(std::mem::size_of::<Set>() == 64);
const _: () = assert!(std::mem::align_of::<ThreadStacks>() == 64);

static STATE_KEY: ExitKey = ExitKey::new();

unsafe extern "C" fn free_state(p: *mut libc::c_void) {
    thread::with_thread(|t| t.stacks.set(STATE_GONE));
    if !p.is_null() {
        // SAFETY: `p` is the state mapped for this thread; the thread is exiting and
        // its TLS says "gone", so no later hook on it uses the pointer.
        unsafe { crate::thread_state::free(p as *mut ThreadStacks) };
    }
}

/// The state of the thread whose hook state is `thread`, created on its first stack;
/// `None` once the thread is exiting or if the allocation failed (then the event goes
/// without a stack, counted).
///
/// The caller must not hold an earlier reference: hooks do not nest on one thread (the
/// nesting guard), and nothing else calls this.
#[inline]
pub fn of(thread: &HookThread) -> Option<&'static mut ThreadStacks> {
    let p = thread.stacks.get();
    if p == STATE_GONE {
        return None;
    }
    if !p.is_null() {
        // SAFETY: this thread's leaked state, used only by this thread and not re-entered
        // (see above).
        return Some(unsafe { &mut *p });
    }
    first_use(thread)
}

/// [`of`] the calling thread, looking its hook state up (benchmarks and tests).
pub fn this_thread() -> Option<&'static mut ThreadStacks> {
    thread::with_thread(of)
}

#[cold]
#[inline(never)]
fn first_use(thread: &HookThread) -> Option<&'static mut ThreadStacks> {
    // SAFETY: all-zero bytes are a valid `ThreadStacks` (no channel, an empty table, an
    // empty scratch stack); `free_state` frees a `ThreadStacks`.
    let fresh: *mut ThreadStacks = unsafe { STATE_KEY.alloc_zeroed(free_state) };
    if fresh.is_null() {
        return None;
    }
    thread.stacks.set(fresh);
    // SAFETY: just allocated, owned by this thread.
    Some(unsafe { &mut *fresh })
}

impl ThreadStacks {
    /// The line every event with a stack touches outside its set and its frames (the
    /// trail's head and count, the channel, the by-reference count, the scratch stack's
    /// counts): the one the hook asks for before its walks.
    #[inline(always)]
    pub fn send_line(&self) -> usize {
        &self.channel as *const usize as usize
    }
}

impl Recorder {
    /// Sends `ev` from the thread whose hook state is `hook` with the stack captured in
    /// `thread.scratch` (its stack state), whose
    /// [`StackSlot::identity_hash`] is `hash`: by the hash when this thread sent the same
    /// stack before on this channel, else in full in a stack slot (waiting for one while
    /// the writer is behind, like [`Recorder::push`]). `complete` fills in what the capture
    /// left out of the scratch stack (its hash and counts are whole already); it runs only
    /// where the stack's contents are read, before a full send.
    #[inline]
    pub fn push_with_stack(
        &self,
        hook: &HookThread,
        mut ev: Event,
        thread: &mut ThreadStacks,
        hash: u64,
        complete: impl FnOnce(&mut StackSlot),
    ) {
        if !thread.scratch.is_empty() {
            let channel = self as *const Recorder as usize;
            if thread.channel != channel {
                // (0: the table is the thread's fresh zero pages: none to write.)
                if thread.channel != 0 {
                    thread.sent.fill(Set([0; WAYS]));
                }
                thread.channel = channel;
            }
            let set = &mut thread.sent[hash as usize % SETS].0;
            // The newest first, on its own: a set seldom holds more than the stack a thread
            // sends again and again (callgrind: 4 to 42 instructions fewer an allocation with
            // a stack in the benchmarks' loops, docs/BENCHMARKS.md).
            if (set[0] == hash || set[1..].contains(&hash)) && hash != 0 {
                ev.set_stack(StackRef::Sent { hash });
                thread.by_reference += 1;
            } else if let Some((index, slot)) = self.take_slot() {
                complete(&mut thread.scratch);
                // Debug builds (the tests' preloaded library) check the completed stack
                // against the hash the capture gave.
                debug_assert_eq!(hash, thread.scratch.identity_hash());
                slot.copy_from(&thread.scratch);
                set.copy_within(..WAYS - 1, 1);
                set[0] = hash;
                ev.set_stack(StackRef::Slot { index, hash });
            }
        }
        self.push(hook, ev);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::event::{Api, Kind};
    use crate::channel::lanes::Reader;
    use crate::channel::queue::HookSettings;
    use crate::config::{Context, Stacks};

    fn recorder() -> Recorder {
        let settings = HookSettings {
            stacks: Stacks::Native,
            context: Context::All,
            max_frames: 64,
            dump_on_oom: false,
        };
        Recorder::new(64, settings, true)
    }

    /// The hash of the native stack `frames`.
    fn hash_of(frames: &[u64]) -> u64 {
        let mut slot = StackSlot::EMPTY;
        slot.native[..frames.len()].copy_from_slice(frames);
        slot.n_native = frames.len() as u16;
        slot.identity_hash()
    }

    /// Sends `frames` as a capture that left them out of the scratch stack for `complete`
    /// to fill in (its count and hash already whole).
    fn send(rec: &Recorder, thread: &mut ThreadStacks, frames: &[u64]) -> StackRef {
        let hash = hash_of(frames);
        thread.scratch = StackSlot::EMPTY;
        thread.scratch.n_native = frames.len() as u16;
        let complete = |slot: &mut StackSlot| slot.native[..frames.len()].copy_from_slice(frames);
        thread::with_thread(|hook| {
            rec.push_with_stack(
                hook,
                Event::new(Kind::Alloc, Api::CudaMalloc),
                thread,
                hash,
                complete,
            )
        });
        let ev = Reader::new().next(rec).expect("sent");
        if let StackRef::Slot { index, .. } = ev.stack() {
            let slot = rec.slot(index).expect("slot");
            assert_eq!(slot.native(), frames, "the slot holds the captured stack");
            rec.release_slot(index);
        }
        ev.stack()
    }

    #[test]
    fn a_repeated_stack_goes_by_hash_a_new_one_in_full_and_a_new_channel_starts_afresh() {
        let rec = recorder();
        let thread = this_thread().expect("state");
        let a = send(&rec, thread, &[1, 2, 3]);
        let StackRef::Slot { hash, .. } = a else {
            panic!("first send of a stack is in full: {a:?}")
        };
        assert_eq!(send(&rec, thread, &[1, 2, 3]), StackRef::Sent { hash });
        assert!(matches!(
            send(&rec, thread, &[1, 2, 4]),
            StackRef::Slot { .. }
        ));
        assert_eq!(send(&rec, thread, &[1, 2, 3]), StackRef::Sent { hash });
        assert_eq!(send(&rec, thread, &[]), StackRef::None, "empty: no stack");
        // A new channel (a writer that never saw these stacks): in full again.
        let other = recorder();
        assert!(matches!(
            send(&other, thread, &[1, 2, 3]),
            StackRef::Slot { .. }
        ));
        assert_eq!(send(&other, thread, &[1, 2, 3]), StackRef::Sent { hash });
        assert!(matches!(
            send(&rec, thread, &[1, 2, 3]),
            StackRef::Slot { .. }
        ));
    }

    #[test]
    fn a_stack_found_behind_newer_ones_of_its_set_goes_by_hash() {
        let rec = recorder();
        let thread = this_thread().expect("state");
        // Stacks whose hashes share one set: the first, then the next two found.
        let first = [0x1000u64, 0x2000];
        let set = hash_of(&first) as usize % SETS;
        let mut same_set = (1..)
            .map(|k: u64| [0x1000, 0x2000, k])
            .filter(|s| hash_of(s) as usize % SETS == set);
        let (second, third) = (same_set.next().unwrap(), same_set.next().unwrap());
        let sent_in_full = |r: StackRef| matches!(r, StackRef::Slot { .. });
        assert!(sent_in_full(send(&rec, thread, &first)));
        assert!(sent_in_full(send(&rec, thread, &second)));
        assert!(sent_in_full(send(&rec, thread, &third)));
        // Newest first: `third`, `second`, `first`; each is found wherever it stands.
        for stack in [&first[..], &second[..], &third[..]] {
            assert_eq!(
                send(&rec, thread, stack),
                StackRef::Sent {
                    hash: hash_of(stack)
                },
                "{stack:x?}"
            );
        }
    }

    #[test]
    fn another_thread_sends_its_first_copy_in_full() {
        let rec: &'static Recorder = Box::leak(Box::new(recorder()));
        let here = send(rec, this_thread().expect("state"), &[9, 8, 7]);
        assert!(matches!(here, StackRef::Slot { .. }));
        let there =
            std::thread::spawn(move || send(rec, this_thread().expect("state"), &[9, 8, 7]))
                .join()
                .unwrap();
        assert!(matches!(there, StackRef::Slot { .. }), "{there:?}");
    }
}

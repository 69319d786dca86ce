//! The calling thread's Python frames, read without the GIL (docs/DESIGN.md, decision 2).
//!
//! Hot. The thread sits in our hook, so its own frame chain cannot change under us; we read
//! it with the frame layout of the running CPython (3.10–3.14; the offsets are in
//! [`crate::process::cpython`]), which `process::python` chose once from the interpreter's
//! version. Each frame becomes a [`PyFrameRaw`]: the code object's address, the raw
//! instruction position (3.10: `f_lasti`; 3.11+: the instruction pointer) and a check value
//! ([`check_value`]); the writer turns them into file, function and line.
//!
//! Steady state: two calls into CPython that only read globals / a TSS key, then plain
//! loads along the chain. Before any of that, the capture asks for the cache lines of the
//! frames the thread's previous walk visited ([`Trail`], [`prefetch`]): in a real program
//! those lines are rarely in the nearer caches, and the chain's loads depend on each other.
//! No Python API that needs the GIL is ever called. The one-time lookup of the interpreter
//! is `process::python`'s.

use crate::channel::event::{PyFrameRaw, StackSlot, python_sum};
use crate::channel::keep;
use crate::channel::sent::{TRAIL_FRAMES, Trail};
use crate::prefetch::prefetch_line;
use crate::process::cpython::{
    FLAG_ENTRY, FRAME_OWNED_BY_CSTACK, FRAME_OWNED_BY_INTERPRETER_314, Layout,
    STACKREF_TAG_BITS_314, check_value, fold,
};
use crate::process::python;

/// Reads a `T` at `addr`. Returns `None` for null.
///
/// # Safety
/// `addr` must be null or point to readable memory holding a `T`.
#[inline(always)]
unsafe fn rd<T: Copy>(addr: u64) -> Option<T> {
    if addr == 0 {
        return None;
    }
    // SAFETY: caller's contract.
    Some(unsafe { std::ptr::read_unaligned(addr as *const T) })
}

/// Reads the `T` at `base + offset`, for a field of a structure known to be there (`base`
/// is not null): no null test, unlike [`rd`] (callgrind: ten instructions a frame less).
///
/// # Safety
/// `base + offset` must point to readable memory holding a `T`.
#[inline(always)]
unsafe fn field<T: Copy>(base: u64, offset: u64) -> T {
    // SAFETY: caller's contract.
    unsafe { std::ptr::read_unaligned(base.wrapping_add(offset) as *const T) }
}

/// Asks for the cache lines the thread's previous walk read first in each structure
/// ([`Trail`]).
#[inline]
pub fn prefetch(trail: &Trail) {
    // (Before the first capture has resolved the interpreter the trail is empty anyway.)
    let Some(back) = python::frame_back() else {
        return;
    };
    // The line of each frame that holds the pointer to the next one: the chain's dependent
    // load. The frame's other fields are on it or on the next line; asking for both lines,
    // and the code objects' too, did no better in the cold benchmark (155 ns a walk against
    // 137 with 4 MiB written between captures) and cost 8-12 ns with warm caches
    // (docs/HOT-PATH.md, "The Python walk's cache misses").
    prefetch_chain(trail, back);
}

/// [`prefetch`] with the offset of a frame's pointer to the next one.
#[inline(always)]
fn prefetch_chain(trail: &Trail, back: u64) {
    for &at in &trail.head {
        prefetch_line(at);
    }
    for &frame in trail.frames.iter().take(trail.n_frames as usize) {
        prefetch_line(frame.wrapping_add(back));
    }
}

/// Upper bound on frames skipped (those that are no Python function): with the records'
/// bound, bounded work on any chain.
const MAX_VISITS: usize = 1024;

/// Fills `slot.python`, innermost first. Sets `slot.truncated` when frames were left out.
/// Returns the records' [`python_sum`].
#[inline]
pub fn capture(slot: &mut StackSlot, trail: &mut Trail, max_frames: usize) -> u64 {
    slot.n_python = 0;
    trail.n_frames = 0;
    let Some(python::Runtime {
        layout,
        is_initialized: init,
        get_tstate: get,
    }) = python::runtime(keep::keep_code_objects)
    else {
        return 0;
    };
    // SAFETY: both were resolved from the interpreter with these C signatures. Neither
    // needs the GIL: one reads a runtime flag, the other this thread's TSS slot.
    let tstate = unsafe {
        let is_init: extern "C" fn() -> libc::c_int = std::mem::transmute(init);
        if is_init() == 0 {
            return 0;
        }
        let get_ts: extern "C" fn() -> usize = std::mem::transmute(get);
        get_ts() as u64
    };
    if tstate == 0 {
        return 0; // a thread CPython never saw (CUDA's, NCCL's, autograd's): no Python frames
    }
    let max = max_frames.min(slot.python.len());
    // One copy of the walk per layout, each with its offsets and version tests folded into
    // constants: a quarter fewer instructions than one walk reading them (callgrind, 12
    // Python frames: 1,112 per walk before, 850 with the walk's prologue included).
    let out = &mut slot.python[..max];
    // SAFETY: `tstate` is this thread's live PyThreadState and the frames along its chain
    // belong to this thread, which is inside our hook: nothing frees or moves them while
    // we read. Offsets are those of the interpreter's version (checked against its headers).
    let (n, more) = unsafe {
        match layout {
            Layout::Py310 => marked(walk(Layout::Py310, tstate, out, trail), out),
            Layout::Py311 => marked(walk(Layout::Py311, tstate, out, trail), out),
            Layout::Py312 => walk(Layout::Py312, tstate, out, trail),
            Layout::Py313 => walk(Layout::Py313, tstate, out, trail),
            Layout::Py314 => walk(Layout::Py314, tstate, out, trail),
        }
    };
    slot.n_python = n as u16;
    super::count!(PythonWalks, 1);
    super::count!(PythonFrames, n);
    if more {
        slot.truncated = true;
    }
    // Hashed in a pass of its own over the records, not term by term in the walk: the
    // walk's loop then keeps its state in registers (callgrind, 12 frames on 3.12: about
    // 300 instructions a walk less), and an entry mark set after its frame was written
    // needs no correction of the sum.
    python_sum(slot.python.get(..n).unwrap_or_default())
}

/// 3.10/3.11, after a walk that wrote `walked.0` records into `out`: code objects have no
/// serial there, so the count of those freed, in the innermost record's flags, tells this
/// stack from an earlier one alike whose code objects were freed and replaced at the same
/// addresses since (docs/CPYTHON.md, "Code freed after an event"). Outside the walk, whose
/// loop it cost registers in (callgrind: 54 instructions an event against 3 here).
#[inline(always)]
fn marked(walked: (usize, bool), out: &mut [PyFrameRaw]) -> (usize, bool) {
    if walked.0 > 0
        && let Some(first) = out.first_mut()
    {
        first.flags |= keep::code_frees_mark();
    }
    walked
}

/// Walks the chain from `tstate` into `out`, noting where it read in `trail`. Returns
/// (frames written, more frames left out).
///
/// # Safety
/// `tstate` must be the calling thread's live `PyThreadState` of an interpreter with `layout`.
#[inline(always)]
unsafe fn walk(
    layout: Layout,
    tstate: u64,
    out: &mut [PyFrameRaw],
    trail: &mut Trail,
) -> (usize, bool) {
    let o = layout.table();
    // SAFETY: for the whole body: every address read is a field of a live structure of this thread
    // at an offset of this version's layout (caller's contract).
    unsafe {
        trail.head[0] = tstate.wrapping_add(o.thread.frame);
        let mut frame: u64 = match layout {
            Layout::Py310 | Layout::Py313 | Layout::Py314 => field(tstate, o.thread.frame),
            Layout::Py311 | Layout::Py312 => {
                let cframe: u64 = field(tstate, o.thread.frame);
                trail.head[1] = cframe.wrapping_add(o.thread.cframe_current);
                rd(cframe.wrapping_add(o.thread.cframe_current))
                    .filter(|_| cframe != 0)
                    .unwrap_or(0)
            }
        };
        let mut n = 0usize;
        // Frames that are no Python function, skipped: only they are counted against
        // MAX_VISITS (a chain of them could loop; the records written are bounded by `out`).
        let mut skipped = 0usize;
        // Bit i: record i was the first frame its eval call ran (a shim follows it). Set
        // on the records after the walk, so that the loop keeps no pointer to the record
        // before (callgrind: 8 instructions a frame less).
        let mut entries: u64 = 0;
        let mut more = false;
        while frame != 0 {
            trail.frames[(n + skipped) % TRAIL_FRAMES] = frame;
            let back: u64 = field(frame, o.frame.back);
            let owner: u8 = match layout {
                Layout::Py310 => 0,
                _ => field(frame, o.frame.owner),
            };
            // 3.14 renumbered the shim (`FRAME_OWNED_BY_INTERPRETER`) and added another
            // frame that is no Python function (`FRAME_OWNED_BY_CSTACK`, one above).
            let shim = match layout {
                Layout::Py312 | Layout::Py313 => owner == FRAME_OWNED_BY_CSTACK,
                Layout::Py314 => owner >= FRAME_OWNED_BY_INTERPRETER_314,
                _ => false,
            };
            let mut code: u64 = field(frame, o.frame.code);
            if layout == Layout::Py314 {
                code &= !STACKREF_TAG_BITS_314; // a `_PyStackRef`: a tagged pointer
            }
            if shim || code == 0 {
                if shim && n > 0 {
                    // The frame written just before is the first one that eval call ran
                    // (`out` holds at most 64 records: FRAME_CAPACITY).
                    entries |= 1u64.wrapping_shl((n - 1) as u32);
                }
                skipped += 1;
                if skipped >= MAX_VISITS {
                    break;
                }
                frame = back;
                continue;
            }
            let Some(record) = out.get_mut(n) else {
                more = true;
                break;
            };
            let instr: u64 = match layout {
                Layout::Py310 => field::<i32>(frame, o.frame.instr) as i64 as u64,
                _ => field(frame, o.frame.instr),
            };
            let entry = match layout {
                Layout::Py310 => true,
                Layout::Py311 => field::<u8>(frame, o.frame.is_entry) != 0,
                _ => false,
            };
            let firstlineno: i32 = field(code, o.code.firstlineno);
            let serial: u32 = match o.code.version {
                0 => 0, // 3.10/3.11: none
                off => field(code, off),
            };
            let check = check_value(firstlineno, serial, || {
                let filename: u64 = field(code, o.code.filename);
                let name: u64 = field(code, o.code.name);
                let name_serial = match o.code.version {
                    0 => fold(rd::<u64>(name.wrapping_add(o.str_.hash)).unwrap_or(0)),
                    _ => 0,
                };
                Some((filename, name, name_serial))
            })
            .unwrap_or(0);
            *record = PyFrameRaw {
                code,
                instr,
                check,
                flags: if entry { FLAG_ENTRY } else { 0 },
            };
            n += 1;
            frame = back;
        }
        // The outermost frame was entered from C whatever the version says.
        if n > 0 && !more {
            entries |= 1u64.wrapping_shl((n - 1) as u32);
        }
        trail.n_frames = (n + skipped).min(TRAIL_FRAMES) as u32;
        while entries != 0 {
            if let Some(record) = out.get_mut(entries.trailing_zeros() as usize) {
                record.flags |= FLAG_ENTRY;
            }
            entries &= entries - 1;
        }
        (n, more || frame != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::cpython::FRAME_OWNED_BY_CSTACK;

    /// Plain memory laid out as a 3.12 structure: `u64` words, written field by field.
    struct Block(Box<[u64; 32]>);

    impl Block {
        fn new() -> Block {
            Block(Box::new([0; 32]))
        }
        fn addr(&self) -> u64 {
            self.0.as_ptr() as u64
        }
        fn put<T: Copy>(&mut self, offset: u64, value: T) {
            assert!(offset as usize + size_of::<T>() <= 256);
            // SAFETY: in bounds of the 256-byte block (checked above).
            unsafe { std::ptr::write_unaligned(self.addr().wrapping_add(offset) as *mut T, value) };
        }
    }

    /// A 3.12 thread state whose chain is `frames` (innermost first; each `(code, shim)`).
    fn chain_312(frames: &[(Option<&Block>, bool)]) -> (Block, Block, Vec<Block>) {
        let o = Layout::Py312.table();
        let mut blocks: Vec<Block> = frames.iter().map(|_| Block::new()).collect();
        for i in 0..blocks.len() {
            let back = blocks.get(i + 1).map_or(0, Block::addr);
            let (code, shim) = frames[i];
            let code = code.map_or(0, Block::addr);
            let b = &mut blocks[i];
            b.put(o.frame.back, back);
            b.put(o.frame.code, code);
            b.put(o.frame.instr, code + o.code.code_adaptive + 2 * i as u64);
            b.put(
                o.frame.owner,
                if shim { FRAME_OWNED_BY_CSTACK } else { 0u8 },
            );
        }
        let mut cframe = Block::new();
        cframe.put(
            o.thread.cframe_current,
            blocks.first().map_or(0, Block::addr),
        );
        let mut tstate = Block::new();
        tstate.put(o.thread.frame, cframe.addr());
        (tstate, cframe, blocks)
    }

    fn code_312(firstlineno: i32, serial: u32) -> Block {
        let o = Layout::Py312.table();
        let mut code = Block::new();
        code.put(o.code.firstlineno, firstlineno);
        code.put(o.code.version, serial);
        code
    }

    #[test]
    fn the_walk_notes_every_frame_it_visits_where_the_next_capture_prefetches() {
        let o = Layout::Py312.table();
        let codes = [code_312(10, 101), code_312(20, 102), code_312(30, 103)];
        // Innermost first: two frames of one eval call, a shim, the outer call's frame.
        let (tstate, cframe, frames) = chain_312(&[
            (Some(&codes[0]), false),
            (Some(&codes[1]), false),
            (Some(&codes[2]), true),
            (Some(&codes[2]), false),
        ]);
        let mut out = [PyFrameRaw::default(); 8];
        let mut trail = Trail::EMPTY;
        // SAFETY: every address on the chain is one of the blocks above, alive here.
        let (n, more) = unsafe { walk(Layout::Py312, tstate.addr(), &mut out, &mut trail) };
        assert_eq!((n, more), (3, false));
        let written: Vec<(u64, u64, u32, u32)> = out[..n]
            .iter()
            .map(|r| (r.code, r.instr, r.check, r.flags))
            .collect();
        let check = |line, serial| check_value(line, serial, || None).expect("a serial");
        let instr = |code: &Block, i: u64| code.addr() + o.code.code_adaptive + 2 * i;
        assert_eq!(
            written,
            vec![
                (codes[0].addr(), instr(&codes[0], 0), check(10, 101), 0),
                // The frame below the shim began its eval call; so did the outermost.
                (
                    codes[1].addr(),
                    instr(&codes[1], 1),
                    check(20, 102),
                    FLAG_ENTRY
                ),
                (
                    codes[2].addr(),
                    instr(&codes[2], 3),
                    check(30, 103),
                    FLAG_ENTRY
                ),
            ]
        );
        // Every frame visited, the shim included, and where the chain's first two
        // pointers were read.
        let visited: Vec<u64> = frames.iter().map(Block::addr).collect();
        assert_eq!(&trail.frames[..trail.n_frames as usize], &visited[..]);
        assert_eq!(
            trail.head,
            [
                tstate.addr() + o.thread.frame,
                cframe.addr() + o.thread.cframe_current
            ]
        );
    }

    #[test]
    fn a_deeper_chain_than_the_trail_holds_leaves_frames_of_that_chain_in_every_place() {
        let code = code_312(1, 7);
        let shape: Vec<(Option<&Block>, bool)> = vec![(Some(&code), false); TRAIL_FRAMES + 9];
        let (tstate, _cframe, frames) = chain_312(&shape);
        let mut out = vec![PyFrameRaw::default(); TRAIL_FRAMES];
        let mut trail = Trail::EMPTY;
        // SAFETY: as above.
        let (n, more) = unsafe { walk(Layout::Py312, tstate.addr(), &mut out, &mut trail) };
        assert_eq!((n, more), (TRAIL_FRAMES, true));
        assert_eq!(trail.n_frames as usize, TRAIL_FRAMES);
        // The walk visited one frame more than it wrote (no room for its record): that
        // frame took the first place; every other place holds the frame visited there.
        let mut expected: Vec<u64> = frames.iter().take(TRAIL_FRAMES).map(Block::addr).collect();
        expected[0] = frames[TRAIL_FRAMES].addr();
        assert_eq!(&trail.frames[..], &expected[..]);
    }

    #[test]
    fn a_prefetch_of_memory_gone_or_never_mapped_does_nothing() {
        // A page mapped, then unmapped: its addresses are what a freed frame leaves behind.
        // SAFETY: a fresh anonymous mapping, unmapped at once; its address is only prefetched.
        let gone = unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            assert_eq!(libc::munmap(p, 4096), 0);
            p as u64
        };
        let mut trail = Trail::EMPTY;
        trail.head = [0, u64::MAX];
        trail.frames[..4].copy_from_slice(&[gone, gone + 4000, 0xffff_8000_0000_0000, 8]);
        trail.n_frames = 4;
        for layout in Layout::ALL {
            prefetch_chain(&trail, layout.table().frame.back);
        }
        // The hook's prefetch for writing (its lane slot) too.
        for &addr in trail.frames[..4].iter().chain(&trail.head) {
            crate::prefetch::prefetch_for_write(addr as usize);
        }
        // Still here: no fault. And nothing was written.
        assert_eq!(trail.n_frames, 4);
        assert_eq!(trail.frames[0], gone);
    }
}

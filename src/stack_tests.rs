//! Stack capture and resolution together (capture in the hook, [`StackTable`] in the
//! writer), against a small C library built with `cc` at test time.

use crate::capture::{Trail, capture};
use crate::channel::event::StackSlot;
use crate::config::{FRAME_CAPACITY, Stacks};
use crate::process::modules;
use crate::writer::stacks::StackTable;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::counting_alloc::thread_allocations as thread_allocs;

/// C source; the `LINE_*` markers name the call lines the test expects.
const C_SOURCE: &str = r#"
typedef void (*cb_t)(void *);
#define KEEP() __asm__ volatile("" ::: "memory")
__attribute__((noinline)) void stk_c(cb_t cb, void *arg) {
    cb(arg); /* LINE_C */
    KEEP();
}
__attribute__((noinline)) void stk_b(cb_t cb, void *arg) {
    stk_c(cb, arg); /* LINE_B */
    KEEP();
}
__attribute__((noinline)) void stk_a(cb_t cb, void *arg) {
    stk_b(cb, arg); /* LINE_A */
    KEEP();
}
__attribute__((noinline)) void stk_x(cb_t cb, void *arg) {
    stk_b(cb, arg); /* LINE_X */
    KEEP();
}
__attribute__((noinline)) void stk_y(cb_t cb, void *arg) {
    stk_b(cb, arg); /* LINE_Y */
    KEEP();
}
__attribute__((noinline)) int stk_recurse(int n, cb_t cb, void *arg) {
    if (n == 0) { cb(arg); KEEP(); return 0; }
    int r = stk_recurse(n - 1, cb, arg); /* LINE_R */
    KEEP();
    return r + 1;
}
/* The same recursion under two callers of the same code: only a return address beneath the
 * recursion differs between the two. */
__attribute__((noinline)) int stk_deep_x(int n, cb_t cb, void *arg) {
    int r = stk_recurse(n, cb, arg); /* LINE_DX */
    KEEP();
    return r;
}
__attribute__((noinline)) int stk_deep_y(int n, cb_t cb, void *arg) {
    int r = stk_recurse(n, cb, arg); /* LINE_DY */
    KEEP();
    return r;
}
/* The same with a frame pointer: every frame's unwinder state (rbp included) is then the same
 * at the same depth, so a walk can meet an earlier walk's path inside the recursion. */
__attribute__((noinline, optimize("no-omit-frame-pointer")))
int stk_recurse_fp(int n, cb_t cb, void *arg) {
    if (n == 0) { cb(arg); KEEP(); return 0; }
    int r = stk_recurse_fp(n - 1, cb, arg); /* LINE_FP */
    KEEP();
    return r + 1;
}
/* Captures at each of `count` depths from one frame, as a training step allocates from one
 * loop through operators of different depths. */
__attribute__((noinline, optimize("no-omit-frame-pointer")))
void stk_depths(const int *depths, int count, cb_t cb, void *arg) {
    for (int i = 0; i < count; i++) {
        stk_recurse_fp(depths[i], cb, arg);
        KEEP();
    }
}
"#;

fn line_of(marker: &str) -> i64 {
    C_SOURCE
        .lines()
        .position(|l| l.contains(marker))
        .expect("marker") as i64
        + 1
}

type Callback = extern "C" fn(*mut libc::c_void);
type CallA = extern "C" fn(Callback, *mut libc::c_void);
type CallRecurse = extern "C" fn(libc::c_int, Callback, *mut libc::c_void) -> libc::c_int;
type CallDepths = extern "C" fn(*const libc::c_int, libc::c_int, Callback, *mut libc::c_void);

struct CLib {
    a: CallA,
    /// `stk_x` and `stk_y`: the same code (so the same frame size) under two names.
    x: CallA,
    y: CallA,
    recurse: CallRecurse,
    /// `stk_depths`: `stk_recurse_fp` at each of several depths.
    depths: CallDepths,
    /// `stk_deep_x` and `stk_deep_y`: `stk_recurse` under two callers.
    deep_x: CallRecurse,
    deep_y: CallRecurse,
}

/// Builds (once) and loads the C library; `stripped` loads a `strip --strip-all` copy.
#[derive(PartialEq)]
enum Which {
    Full,
    Stripped,
    /// Loaded without refreshing the module table (a library `dlopen`ed mid-run).
    Late,
    /// Built without unwind tables or frame pointers.
    NoUnwind,
}

fn load_raw(path: &Path) -> CLib {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: loading our own test library; symbols have the declared C signatures.
    unsafe {
        let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOW);
        assert!(!h.is_null(), "dlopen {}", path.display());
        let a = libc::dlsym(h, c"stk_a".as_ptr());
        let r = libc::dlsym(h, c"stk_recurse".as_ptr());
        let x = libc::dlsym(h, c"stk_x".as_ptr());
        let y = libc::dlsym(h, c"stk_y".as_ptr());
        let fp = libc::dlsym(h, c"stk_depths".as_ptr());
        let dx = libc::dlsym(h, c"stk_deep_x".as_ptr());
        let dy = libc::dlsym(h, c"stk_deep_y".as_ptr());
        assert!(!a.is_null() && !r.is_null() && !x.is_null() && !y.is_null() && !fp.is_null());
        assert!(!dx.is_null() && !dy.is_null());
        CLib {
            a: std::mem::transmute::<*mut libc::c_void, CallA>(a),
            x: std::mem::transmute::<*mut libc::c_void, CallA>(x),
            y: std::mem::transmute::<*mut libc::c_void, CallA>(y),
            recurse: std::mem::transmute::<*mut libc::c_void, CallRecurse>(r),
            depths: std::mem::transmute::<*mut libc::c_void, CallDepths>(fp),
            deep_x: std::mem::transmute::<*mut libc::c_void, CallRecurse>(dx),
            deep_y: std::mem::transmute::<*mut libc::c_void, CallRecurse>(dy),
        }
    }
}

/// Builds the C file `src` into the shared library `out` with `cc` and `flags` (`-fPIC
/// -shared` added); the test fails if it does not build.
pub(crate) fn build_c_library(src: &Path, out: &Path, flags: &[&str]) {
    let st = std::process::Command::new("cc")
        .args(flags)
        .args(["-fPIC", "-shared", "-o"])
        .arg(out)
        .arg(src)
        .status()
        .expect("run cc");
    assert!(st.success(), "cc failed on {}", src.display());
}

fn clib(which: Which) -> &'static CLib {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    static FULL: OnceLock<CLib> = OnceLock::new();
    static STRIPPED: OnceLock<CLib> = OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir").keep();
        let src = dir.join("stacktest.c");
        std::fs::write(&src, C_SOURCE).expect("write C");
        let so = dir.join("libstacktest.so");
        build_c_library(&src, &so, &["-g", "-O2"]);
        std::fs::copy(&so, dir.join("libstacktest-late.so")).expect("copy");
        let no_unwind = [
            "-O2",
            "-fno-asynchronous-unwind-tables",
            "-fno-unwind-tables",
            "-fomit-frame-pointer",
        ];
        build_c_library(&src, &dir.join("libstacktest-nounwind.so"), &no_unwind);
        let st = std::process::Command::new("strip")
            .args(["--strip-all", "-o"])
            .arg(dir.join("libstacktest-stripped.so"))
            .arg(&so)
            .status()
            .expect("run strip");
        assert!(st.success(), "strip failed");
        dir
    });
    let load = |path: &Path| -> CLib {
        let lib = load_raw(path);
        // What the writer does after a hook met the new library's addresses.
        modules::refresh();
        lib
    };
    static LATE: OnceLock<CLib> = OnceLock::new();
    static NO_UNWIND: OnceLock<CLib> = OnceLock::new();
    if which == Which::NoUnwind {
        return NO_UNWIND.get_or_init(|| load(&dir.join("libstacktest-nounwind.so")));
    }
    if which == Which::Late {
        return LATE.get_or_init(|| load_raw(&dir.join("libstacktest-late.so")));
    }
    if which == Which::Stripped {
        STRIPPED.get_or_init(|| load(&dir.join("libstacktest-stripped.so")))
    } else {
        FULL.get_or_init(|| load(&dir.join("libstacktest.so")))
    }
}

struct Request {
    stacks: Stacks,
    max: usize,
    repeat: usize,
    slot: StackSlot,
    trail: Trail,
    allocs_first: u64,
    allocs_after_first: u64,
    /// Captures whose returned hash (native part carried over by the walk) differed from
    /// the hash of the stack computed in full.
    hash_mismatches: u64,
}

extern "C" fn capture_cb(arg: *mut libc::c_void) {
    // SAFETY: the tests pass a `&mut Request` through the C library.
    let req = unsafe { &mut *(arg as *mut Request) };
    let start = thread_allocs();
    let hash = capture(&mut req.slot, &mut req.trail, req.stacks, req.max);
    req.allocs_first = thread_allocs() - start;
    req.hash_mismatches += u64::from(hash != req.slot.identity_hash());
    let before = thread_allocs();
    for _ in 1..req.repeat {
        let hash = capture(&mut req.slot, &mut req.trail, req.stacks, req.max);
        req.hash_mismatches += u64::from(hash != req.slot.identity_hash());
    }
    req.allocs_after_first = thread_allocs() - before;
}

fn request(stacks: Stacks, max: usize) -> Request {
    Request {
        stacks,
        max,
        repeat: 1,
        slot: StackSlot::EMPTY,
        trail: Trail::EMPTY,
        allocs_first: 0,
        allocs_after_first: 0,
        hash_mismatches: 0,
    }
}

fn resolve(slot: &StackSlot) -> Vec<crate::snapshot::model::Frame> {
    let mut table = StackTable::new(&crate::config::Config::default());
    table.refresh_modules();
    let id = table.intern(slot).expect("non-empty stack");
    table.frames(id).to_vec()
}

/// Calls through `stk_x` or `stk_y` from this one call site: the capture then runs at the
/// same stack pointer either way, and only a return address deep in the stack differs.
#[inline(never)]
fn through(lib: &CLib, via_y: bool) -> Vec<(String, i64)> {
    let mut req = request(Stacks::Native, FRAME_CAPACITY);
    let f = if via_y { lib.y } else { lib.x };
    f(capture_cb, &mut req as *mut Request as *mut libc::c_void);
    // The stack's hash, whose native part came with the reused frames, is the same as
    // computed over the new stack in full: the writer tells the two apart by it.
    assert_eq!(req.hash_mismatches, 0, "{:?}", req.slot.native());
    resolve(&req.slot)
        .iter()
        .take(4)
        .map(|f| (f.name.clone(), f.line))
        .collect()
}

#[test]
fn outer_frames_that_changed_at_the_same_depth_are_unwound_again() {
    let lib = clib(Which::Full);
    let via_x = [
        ("stk_c".to_string(), line_of("LINE_C")),
        ("stk_b".to_string(), line_of("LINE_B")),
        ("stk_x".to_string(), line_of("LINE_X")),
    ];
    let via_y = [
        ("stk_c".to_string(), line_of("LINE_C")),
        ("stk_b".to_string(), line_of("LINE_B")),
        ("stk_y".to_string(), line_of("LINE_Y")),
    ];
    let reused_before =
        crate::capture::native::WALKS_REUSED.load(std::sync::atomic::Ordering::Relaxed);
    for round in 0..4 {
        assert_eq!(
            through(lib, false)[..3],
            via_x[..],
            "round {round}, via stk_x"
        );
        assert_eq!(
            through(lib, true)[..3],
            via_y[..],
            "round {round}, via stk_y"
        );
        assert_eq!(
            through(lib, true)[..3],
            via_y[..],
            "round {round}, via stk_y again"
        );
    }
    // The repeated calls through the same function did reuse the previous walk.
    let reused = crate::capture::native::WALKS_REUSED.load(std::sync::atomic::Ordering::Relaxed);
    assert!(reused > reused_before, "no walk was reused");
}

/// A walk that takes a whole earlier path checks the stack words that path's steps read
/// beyond its first few: under recursions of 4 to 11 frames, the words that tell
/// `stk_deep_x` from `stk_deep_y` (its return address among them) fall at places 0 to 10 of
/// those later checks, and captures alternating between the two callers must each name
/// their own. (Fails when the later checks are left out.)
#[test]
fn a_return_address_that_changed_deep_under_a_path_is_seen() {
    let lib = clib(Which::Full);
    let deep = |depth: libc::c_int, via_y: bool| -> Vec<(String, i64)> {
        resolve(&deep_capture(lib, depth, via_y, FRAME_CAPACITY))
            .iter()
            .map(|f| (f.name.clone(), f.line))
            .filter(|(name, _)| name.starts_with("stk_deep_"))
            .collect()
    };
    for depth in 4..12 {
        for round in 0..3 {
            assert_eq!(
                deep(depth, false),
                [("stk_deep_x".to_string(), line_of("LINE_DX"))],
                "depth {depth}, round {round}"
            );
            assert_eq!(
                deep(depth, true),
                [("stk_deep_y".to_string(), line_of("LINE_DY"))],
                "depth {depth}, round {round}"
            );
        }
    }
}

/// The stacks of a run of captures, one after another on one thread.
struct Captures {
    slots: Vec<StackSlot>,
    /// Captures whose returned hash differed from the hash of the stack computed in full.
    hash_mismatches: u64,
}

/// One capture ([`capture_each_cb`]) at each of `depths`, from one loop of the C library.
fn capture_at_depths(lib: &CLib, depths: &[libc::c_int]) -> Captures {
    let mut captures = Captures {
        slots: Vec::with_capacity(depths.len()),
        hash_mismatches: 0,
    };
    (lib.depths)(
        depths.as_ptr(),
        depths.len() as libc::c_int,
        capture_each_cb,
        &mut captures as *mut Captures as *mut libc::c_void,
    );
    captures
}

/// Captures as a hook does: the frames of a path taken whole may stay where the walk found
/// them until `finish` (which the hook calls only before a stack is sent in full).
extern "C" fn capture_each_cb(arg: *mut libc::c_void) {
    // SAFETY: the test passes a `&mut Captures` through the C library.
    let captures = unsafe { &mut *(arg as *mut Captures) };
    let (mut slot, mut trail) = (StackSlot::EMPTY, Trail::EMPTY);
    let hash =
        crate::capture::capture_unfinished(&mut slot, &mut trail, Stacks::Native, FRAME_CAPACITY);
    crate::capture::finish(&mut slot);
    captures.hash_mismatches += u64::from(hash != slot.identity_hash());
    captures.slots.push(slot);
}

/// Consecutive walks of different depths from one loop, as a training step's allocations
/// from different operators: each takes an earlier walk's path of frames from where it
/// meets one (inside the recursion, or above it), and each gives exactly its own stack,
/// with the hash of it.
#[test]
fn walks_of_changing_depth_reuse_the_outer_frames_and_give_each_stack_exactly() {
    let lib = clib(Which::Full);
    std::thread::spawn(move || {
        let reused_before =
            crate::capture::native::WALKS_REUSED.load(std::sync::atomic::Ordering::Relaxed);
        let depths = [
            0, 5, 20, 3, 40, 40, 7, 2, 55, 1, 200, 30, 0, 61, 9, 130, 4, 4, 12,
        ];
        let captures = capture_at_depths(lib, &depths);
        assert_eq!(captures.slots.len(), depths.len());
        assert_eq!(captures.hash_mismatches, 0);
        // The first capture (depth 0): the base case's call of the callback, then the frames
        // that called the recursion (stk_depths and the thread's start), the same every time.
        assert_eq!(depths[0], 0);
        let first = captures.slots[0].native();
        let (base, outer) = (first[0], &first[1..]);
        assert!(
            outer.len() >= 2,
            "stk_depths and its callers are under the recursion"
        );
        let recursive_call = captures.slots[1].native()[1];
        for (i, (&n, slot)) in depths.iter().zip(&captures.slots).enumerate() {
            // Each stack in full: the base case, `n` recursive calls at one address, the
            // outer frames; the slot holds its first FRAME_CAPACITY frames.
            let mut expected = vec![base];
            expected.extend(std::iter::repeat_n(recursive_call, n as usize));
            expected.extend_from_slice(outer);
            let kept = expected.len().min(FRAME_CAPACITY);
            assert_eq!(slot.native(), &expected[..kept], "capture {i} (depth {n})");
            assert_eq!(
                slot.truncated,
                expected.len() > FRAME_CAPACITY,
                "capture {i} (depth {n})"
            );
        }
        let reused =
            crate::capture::native::WALKS_REUSED.load(std::sync::atomic::Ordering::Relaxed);
        // All but two: the thread's first walk, and the one 200 deep, which reaches the step
        // limit before any state an earlier walk reached (the one 130 deep meets the path
        // of the one 61 deep inside the recursion).
        assert!(
            reused - reused_before >= depths.len() as u64 - 2,
            "walks reused: {}",
            reused - reused_before
        );
    })
    .join()
    .unwrap();
}

/// A stack deeper than the frame limit, captured again and again as the hook does: each
/// walk after the first takes the path whole and cuts it at the limit, and its hash is of
/// the frames the slot keeps (no node's chain is: a node's covers its whole path). Slot and
/// hash must be those of the stack every time.
#[test]
fn a_cut_stack_taken_again_keeps_its_frames_and_the_hash_of_them() {
    let lib = clib(Which::Full);
    std::thread::spawn(move || {
        let depths = [90, 90, 90, 5, 90];
        let captures = capture_at_depths(lib, &depths);
        assert_eq!(captures.hash_mismatches, 0);
        let first = &captures.slots[0];
        assert!(first.truncated && first.n_native as usize == FRAME_CAPACITY);
        for (i, slot) in captures
            .slots
            .iter()
            .enumerate()
            .filter(|&(i, _)| depths[i] == 90)
        {
            assert_eq!(slot.native(), first.native(), "capture {i}");
            assert!(slot.truncated, "capture {i}");
        }
        assert!(!captures.slots[3].truncated);
        // One path cut at other limits in turn.
        let mut frames_at = Vec::new();
        for max in [10, 24, 10, 24] {
            let mut req = request(Stacks::Native, max);
            req.repeat = 3;
            (lib.recurse)(
                40,
                capture_cb,
                &mut req as *mut Request as *mut libc::c_void,
            );
            assert_eq!(req.hash_mismatches, 0, "cut at {max}");
            assert!(req.slot.truncated && req.slot.n_native as usize == max);
            frames_at.push(req.slot.native().to_vec());
        }
        assert_eq!(frames_at[0], frames_at[2]);
        assert_eq!(frames_at[1], frames_at[3]);
        assert_eq!(frames_at[0][..], frames_at[1][..10]);
    })
    .join()
    .unwrap();
}

/// A capture through `stk_deep_x` or `stk_deep_y` (a recursion `depth` deep under either)
/// with at most `max` frames, from this one call site: both reach the hook in the same
/// state, and their stacks differ only in the callers' frame beneath the recursion.
#[inline(never)]
fn deep_capture(lib: &CLib, depth: libc::c_int, via_y: bool, max: usize) -> StackSlot {
    let mut req = request(Stacks::Native, max);
    let f = if via_y { lib.deep_y } else { lib.deep_x };
    f(
        depth,
        capture_cb,
        &mut req as *mut Request as *mut libc::c_void,
    );
    assert_eq!(req.hash_mismatches, 0, "{:?}", req.slot.native());
    req.slot
}

/// The two stacks of [`deep_capture`] whole, and the place of the first frame in which
/// they differ.
fn deep_stacks(lib: &CLib, depth: libc::c_int) -> (Vec<u64>, Vec<u64>, usize) {
    let x = deep_capture(lib, depth, false, FRAME_CAPACITY);
    let y = deep_capture(lib, depth, true, FRAME_CAPACITY);
    assert!(!x.truncated && !y.truncated && x.n_native == y.n_native);
    let differs = x
        .native()
        .iter()
        .zip(y.native())
        .position(|(a, b)| a != b)
        .expect("the callers' frames differ");
    (x.native().to_vec(), y.native().to_vec(), differs)
}

/// A stack cut at the frame limit is checked only up to the cut: the steps to its last
/// frame kept and to the next one (which says that the stack goes on). Captures alternating
/// between two callers whose stacks differ at place `k`, cut at `k - 2` to `k + 2` frames:
/// each must be its own stack's first frames, cut (a check that leaves out the step to the
/// last frame kept takes the other caller's frame at `k` when the stack keeps it).
#[test]
fn a_cut_stack_is_checked_to_the_cut_and_is_exactly_its_first_frames() {
    let lib = clib(Which::Full);
    std::thread::spawn(move || {
        let (x, y, k) = deep_stacks(lib, 20);
        assert!(
            k > 20 && k + 2 < x.len(),
            "the callers' frame is beneath the recursion"
        );
        for max in k - 2..=k + 2 {
            for round in 0..3 {
                for (via_y, whole) in [(false, &x), (true, &y)] {
                    let slot = deep_capture(lib, 20, via_y, max);
                    assert_eq!(
                        slot.native(),
                        &whole[..max],
                        "cut at {max}, round {round}, via_y {via_y}"
                    );
                    assert!(slot.truncated, "cut at {max}, round {round}");
                }
            }
        }
    })
    .join()
    .unwrap();
}

/// One capture ([`deep_capture`]) per `(depth, via_y, max)`, in order, on a thread of its own
/// (the same code for every thread, so that each capture's frames outside the recursion are
/// the same whichever thread makes it).
fn deep_captures_on_a_new_thread(
    lib: &'static CLib,
    captures: Vec<(libc::c_int, bool, usize)>,
) -> Vec<StackSlot> {
    std::thread::spawn(move || {
        captures
            .iter()
            .map(|&(depth, via_y, max)| deep_capture(lib, depth, via_y, max))
            .collect()
    })
    .join()
    .unwrap()
}

/// Walks that reuse every earlier walk's paths, cut or not, give exactly what a thread's
/// first walk gives: 300 captures of random depth, caller and frame limit on one thread,
/// each against the same capture made alone on a fresh thread (no path to take).
#[test]
fn reused_and_cut_walks_give_what_a_fresh_walk_gives() {
    let lib = clib(Which::Full);
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = |below: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % below
    };
    let captures: Vec<(libc::c_int, bool, usize)> = (0..300)
        .map(|_| {
            let depth = next(48) as libc::c_int;
            let via_y = next(2) == 1;
            // Half of them cut close to the callers' frame, the rest anywhere.
            let max = if next(2) == 0 {
                (depth as usize + next(6) as usize).clamp(1, FRAME_CAPACITY)
            } else {
                1 + next(FRAME_CAPACITY as u64) as usize
            };
            (depth, via_y, max)
        })
        .collect();
    let reused = deep_captures_on_a_new_thread(lib, captures.clone());
    let mut cut = 0;
    for (i, (capture, slot)) in captures.iter().zip(&reused).enumerate() {
        let fresh = &deep_captures_on_a_new_thread(lib, vec![*capture])[0];
        assert_eq!(slot.native(), fresh.native(), "capture {i}: {capture:?}");
        assert_eq!(slot.truncated, fresh.truncated, "capture {i}: {capture:?}");
        cut += usize::from(fresh.truncated);
    }
    assert!(cut > 50 && cut < 280, "{cut} of 300 cut");
}

/// The diagnostic counters of a `capture-stats` build count what the walks did. They are
/// process-wide, so scripts/test.sh runs the `capture_stats_` tests alone, one at a time.
#[cfg(feature = "capture-stats")]
#[test]
fn capture_stats_count_the_walks_their_frames_and_their_reuse() {
    use crate::capture::stats::{self, Stat};
    use std::sync::atomic::Ordering::Relaxed;
    let lib = clib(Which::Full);
    std::thread::spawn(move || {
        let depths = [0, 5, 20, 3, 40, 40, 7, 2, 80, 1];
        let before = stats::read();
        let reused_before = crate::capture::native::WALKS_REUSED.load(Relaxed);
        let captures = capture_at_depths(lib, &depths);
        let after = stats::read();
        let counted = |stat: Stat| after[stat as usize] - before[stat as usize];
        let slots = &captures.slots;
        assert_eq!(counted(Stat::Walks), depths.len() as u64);
        assert_eq!(
            counted(Stat::WalksReused),
            crate::capture::native::WALKS_REUSED.load(Relaxed) - reused_before
        );
        assert!(counted(Stat::WalksReused) >= depths.len() as u64 - 3);
        let frames: u64 = slots.iter().map(|s| u64::from(s.n_native)).sum();
        assert_eq!(counted(Stat::NativeFrames), frames);
        let cut = slots.iter().filter(|s| s.truncated).count() as u64;
        assert_eq!(counted(Stat::NativeTruncated), cut);
        assert!(cut >= 1, "the depth-80 stack is cut at the frame limit");
        // The first walk unwinds every frame and makes a node of each; the later ones take
        // frames from the paths made, most of them whole, checking at least a word each.
        assert!(counted(Stat::StepsUnwound) > 0 && counted(Stat::NodesMade) > 0);
        assert!(
            counted(Stat::NodesMade) <= counted(Stat::StepsUnwound) + counted(Stat::StepsReused)
        );
        assert!(counted(Stat::StepsReused) > 0);
        assert!(
            counted(Stat::WholePaths) > 0
                && counted(Stat::ReadsChecked) >= counted(Stat::WholePaths)
        );
        assert_eq!(
            counted(Stat::PathResets),
            1,
            "the thread's first walk set its paths up, and nothing emptied them after"
        );
        // Native stacks only, captured outside a hook: no Python walk, no send.
        assert_eq!(counted(Stat::PythonWalks), 0);
        assert_eq!(counted(Stat::StackEvents), 0);
        // Each state a walk starts from, or goes on from, has one path here (other depths
        // start at other stack pointers; depth 40 twice is one path), and it holds.
        assert_eq!(counted(Stat::PathsNotHolding), 0);
        assert!(counted(Stat::NativeTicks) > 0);
        assert!(after[Stat::TicksPerMillisecond as usize] > 0);
    })
    .join()
    .unwrap();
}

/// Captures whose stacks differ only beyond the frame limit take one path whole, each
/// checking it only to the cut: no path fails its check, and fewer words are read than the
/// whole path has. (Checked over the whole path, each capture would find the other
/// caller's path failing beneath the cut.) Process-wide counters: scripts/test.sh runs the
/// `capture_stats_` tests one at a time.
#[cfg(feature = "capture-stats")]
#[test]
fn capture_stats_a_change_beyond_the_cut_fails_no_path() {
    use crate::capture::stats::{self, Stat};
    let lib = clib(Which::Full);
    std::thread::spawn(move || {
        let (_, _, k) = deep_stacks(lib, 20);
        let rounds = 8u64;
        let counted_over = |captures: &dyn Fn()| {
            let before = stats::read();
            captures();
            let after = stats::read();
            move |stat: Stat| after[stat as usize] - before[stat as usize]
        };
        // The whole path, uncut, taken again and again: the words its check reads.
        let whole = counted_over(&|| {
            for _ in 0..rounds {
                assert!(!deep_capture(lib, 20, false, FRAME_CAPACITY).truncated);
            }
        });
        assert_eq!(whole(Stat::WholePaths), rounds);
        // Cut two frames before the callers differ, alternating between them.
        let max = k - 2;
        let cut = counted_over(&|| {
            for _ in 0..rounds {
                for via_y in [false, true] {
                    let slot = deep_capture(lib, 20, via_y, max);
                    assert!(slot.truncated && slot.n_native as usize == max);
                }
            }
        });
        assert_eq!(cut(Stat::Walks), 2 * rounds);
        assert_eq!(cut(Stat::WholePaths), 2 * rounds);
        assert_eq!(cut(Stat::PathsNotHolding), 0);
        let (words_whole, words_cut) = (whole(Stat::ReadsChecked), cut(Stat::ReadsChecked) / 2);
        assert!(
            words_cut < words_whole,
            "{rounds} walks read {words_cut} words cut, {words_whole} whole"
        );
    })
    .join()
    .unwrap();
}

#[test]
fn c_frames_have_names_files_and_lines() {
    let lib = clib(Which::Full);
    let mut req = request(Stacks::All, FRAME_CAPACITY);
    (lib.a)(capture_cb, &mut req as *mut Request as *mut libc::c_void);
    assert!(req.slot.n_native >= 3, "{:?}", req.slot.native());
    let frames = resolve(&req.slot);
    let top: Vec<(&str, i64)> = frames
        .iter()
        .take(3)
        .map(|f| (f.name.as_str(), f.line))
        .collect();
    assert_eq!(
        top,
        [
            ("stk_c", line_of("LINE_C")),
            ("stk_b", line_of("LINE_B")),
            ("stk_a", line_of("LINE_A"))
        ]
    );
    for f in &frames[..3] {
        assert!(f.filename.ends_with("stacktest.c"), "{f:?}");
    }
    // memsnap's own code (here: the test binary, which holds the callback) never appears.
    let own = modules::ensure();
    for &pc in req.slot.native() {
        let m = own.find(pc).expect("every captured pc is in a module");
        assert!(!own.is_own(m));
    }
    assert!(!req.slot.truncated);
}

#[test]
fn stripped_library_gives_dynsym_names() {
    let lib = clib(Which::Stripped);
    let mut req = request(Stacks::Native, FRAME_CAPACITY);
    (lib.a)(capture_cb, &mut req as *mut Request as *mut libc::c_void);
    let frames = resolve(&req.slot);
    let top: Vec<(&str, &str, i64)> = frames
        .iter()
        .take(3)
        .map(|f| (f.name.as_str(), f.filename.as_str(), f.line))
        .collect();
    // No debug info: the exported symbol that holds the return address, plus its offset
    // into it, and the library as the file; never "??".
    for ((name, file, line), want) in top.iter().zip(["stk_c+0x", "stk_b+0x", "stk_a+0x"]) {
        assert!(name.starts_with(want), "{top:?}");
        assert!(file.ends_with("libstacktest-stripped.so"), "{top:?}");
        assert_eq!(*line, 0);
    }
    assert_eq!(top.len(), 3);
}

#[test]
fn deep_recursion_is_truncated_at_max_frames() {
    let lib = clib(Which::Full);
    for max in [10usize, FRAME_CAPACITY] {
        let mut req = request(Stacks::Native, max);
        (lib.recurse)(
            200,
            capture_cb,
            &mut req as *mut Request as *mut libc::c_void,
        );
        assert_eq!(req.slot.n_native as usize, max);
        assert!(req.slot.truncated);
        let frames = resolve(&req.slot);
        assert_eq!(frames.len(), max);
        // Innermost: the call of `cb` in the base case; then the recursive call line.
        assert!(frames.iter().all(|f| f.name == "stk_recurse"), "{frames:?}");
        assert!(
            frames[1..].iter().all(|f| f.line == line_of("LINE_R")),
            "{frames:?}"
        );
    }
}

#[test]
fn stacks_none_and_python_capture_no_native_frames() {
    let lib = clib(Which::Full);
    for stacks in [Stacks::None, Stacks::Python] {
        let mut req = request(stacks, FRAME_CAPACITY);
        (lib.a)(capture_cb, &mut req as *mut Request as *mut libc::c_void);
        assert_eq!(req.slot.n_native, 0);
        // No CPython in this test binary: no Python frames either.
        assert_eq!(req.slot.n_python, 0);
    }
}

#[test]
fn steady_state_capture_allocates_nothing() {
    let lib = clib(Which::Full);
    std::thread::spawn(move || {
        let mut req = request(Stacks::All, FRAME_CAPACITY);
        req.repeat = 200;
        (lib.a)(capture_cb, &mut req as *mut Request as *mut libc::c_void);
        assert!(req.slot.n_native >= 3);
        // The counter works: the thread's first capture allocates its unwinder cache.
        assert!(req.allocs_first > 0);
        assert_eq!(
            req.allocs_after_first, 0,
            "capture allocated in steady state"
        );
        assert_eq!(req.hash_mismatches, 0, "hash carried over by reused walks");
    })
    .join()
    .expect("thread");
}

#[test]
fn many_threads_capture_the_same_frames() {
    let lib = clib(Which::Full);
    let mut reference = request(Stacks::Native, FRAME_CAPACITY);
    (lib.a)(
        capture_cb,
        &mut reference as *mut Request as *mut libc::c_void,
    );
    let expected: Vec<u64> = reference.slot.native()[..3].to_vec();
    let threads: Vec<_> = (0..8)
        .map(|_| {
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                for _ in 0..500 {
                    let mut req = request(Stacks::All, FRAME_CAPACITY);
                    (lib.a)(capture_cb, &mut req as *mut Request as *mut libc::c_void);
                    seen.push(req.slot.native().get(..3).map(<[u64]>::to_vec));
                }
                seen
            })
        })
        .collect();
    for t in threads {
        for s in t.join().expect("thread") {
            assert_eq!(s.as_deref(), Some(&expected[..]));
        }
    }
}

#[test]
fn library_loaded_later_ends_the_walk_until_the_writer_refreshes() {
    modules::ensure();
    let lib = clib(Which::Late);
    let mut req = request(Stacks::Native, FRAME_CAPACITY);
    (lib.a)(capture_cb, &mut req as *mut Request as *mut libc::c_void);
    // Other tests may refresh concurrently; if the table already knows the library, the
    // stack is complete, otherwise the walk stopped cleanly at its first address.
    let table = modules::ensure();
    if req.slot.n_native == 0 {
        assert!(modules::is_stale() || table.find(lib.a as *const () as u64).is_some());
        modules::refresh();
    }
    let mut req = request(Stacks::Native, FRAME_CAPACITY);
    (lib.a)(capture_cb, &mut req as *mut Request as *mut libc::c_void);
    let frames = resolve(&req.slot);
    let names: Vec<&str> = frames.iter().take(3).map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["stk_c", "stk_b", "stk_a"]);
    assert!(frames[0].filename.ends_with("stacktest.c"));
}

#[test]
fn code_without_unwind_tables_ends_the_walk_cleanly() {
    let lib = clib(Which::NoUnwind);
    let full = clib(Which::Full);
    // Tests run in parallel and each may refresh the module table; a refresh that read the
    // maps before this library was loaded can be published after the one that saw it. Only
    // the writer refreshes in a real process, so make sure the table knows the library.
    for _ in 0..100 {
        if modules::ensure().find(lib.a as usize as u64).is_some() {
            break;
        }
        modules::refresh();
    }
    let mut first = None;
    for i in 0..200 {
        let mut req = request(Stacks::Native, FRAME_CAPACITY);
        (lib.a)(capture_cb, &mut req as *mut Request as *mut libc::c_void);
        // The callback has unwind info, so its caller (stk_c) is found; past that the
        // walk may stop anywhere, but every address it kept is inside a known module.
        assert!(
            req.slot.n_native >= 1,
            "capture {i}: {:?}",
            req.slot.native()
        );
        let table = modules::ensure();
        assert!(req.slot.native().iter().all(|&pc| table.find(pc).is_some()));
        let innermost = req.slot.native()[0];
        assert_eq!(*first.get_or_insert(innermost), innermost);
    }
    let mut req = request(Stacks::Native, FRAME_CAPACITY);
    (lib.a)(capture_cb, &mut req as *mut Request as *mut libc::c_void);
    // Built without debug info: named by its symbol plus the offset into it.
    assert!(resolve(&req.slot)[0].name.starts_with("stk_c+0x"));
    // The library with unwind tables still unwinds fully afterwards.
    let mut req = request(Stacks::Native, FRAME_CAPACITY);
    (full.a)(capture_cb, &mut req as *mut Request as *mut libc::c_void);
    let names: Vec<String> = resolve(&req.slot)
        .into_iter()
        .take(3)
        .map(|f| f.name)
        .collect();
    assert_eq!(names, ["stk_c", "stk_b", "stk_a"]);
}

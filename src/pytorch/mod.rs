//! PyTorch's CUDA caching allocator, seen from inside.
//!
//! Under PyTorch's default allocator the CUDA calls memsnap hooks are segments: one
//! `cudaMalloc` each time the cache grows. The tensors are blocks carved inside them with
//! no CUDA call at all. PyTorch calls every registered trace tracker for each block it
//! hands out or takes back, on the allocating thread, even with its own history recording
//! off; this room registers one and turns each entry into an event (docs/PYTORCH.md).
//!
//! Cold: [`before_segment_allocation`]'s probe, at a segment-level allocation, until PyTorch's
//! allocator is found and decided on (once per process), and [`after_stream_allocation`]'s,
//! at a stream-ordered allocation, once until libraries are loaded again. Hot:
//! [`on_trace_entry`], the tracker, for every block event; no allocation, no lock, no
//! syscall (PyTorch holds its allocator's mutex while it runs; the only wait is the
//! channel's bounded one, and the writer never calls into PyTorch, so that wait cannot
//! deadlock).

pub mod layout;
pub mod library;
pub mod optimizer;
pub mod std_function;

use crate::channel::event::{Kind, PoolId};
use crate::channel::recording;
use crate::guard::{self, Scope};
use crate::process::allocator_route::{self, AllocatorRoute};
use crate::process::clock;
use crate::process::dlsym::real_dlsym;
use crate::process::modules;
use crate::record;
use layout::Action;
use library::{Allocator, Missing};
use std::ffi::c_void;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicPtr, AtomicU8, AtomicU64, Ordering::*};
use std_function::{AnyData, StdFunction};

/// Not found yet: probe at the next segment-level allocation.
const LOOKING: u8 = 0;
/// One thread is probing; the others go on without waiting (they may hold another
/// device's allocator mutex, which the attach takes).
const PROBING: u8 = 1;
/// Attached, or decided against: never probe again.
const DECIDED: u8 = 2;

static STATE: AtomicU8 = AtomicU8::new(LOOKING);
/// `modules::libraries_loaded()` at the last probe that found no PyTorch.
static LIBRARIES_AT_LAST_PROBE: AtomicU64 = AtomicU64::new(0);
static FOUND: OnceLock<Allocator> = OnceLock::new();
/// The number of the trace entries' layout (`layout::number_for_version`): set once, before
/// the tracker is attached; read by every call of the tracker, on the line it reads anyway
/// (`process::hook_line`; in a static of its own it was one more cache line an event).
const LAYOUT: &AtomicU8 = &crate::process::hook_line::HOOK_LINE.trace_entry_layout;

/// Called by the segment-level allocation hooks (`cudaMalloc`, `cuMemAlloc`, and for
/// expandable segments `cuMemAddressReserve` and `cuMemCreate`) before the real call:
/// attaches the tracker the first time PyTorch's caching allocator is loaded and
/// initialized, so that the segment being allocated and the block that asked for it are
/// both recorded. One relaxed load once decided.
#[inline(always)]
pub fn before_segment_allocation() {
    if STATE.load(Relaxed) != DECIDED
        && !guard::inside_hook_or_internal()
        && recording::recorder().is_some()
    {
        probe();
    }
}

/// Called by the stream-ordered allocation hooks (`cudaMallocAsync`, `cuMemAllocAsync`
/// and their pool forms) after the real call, in the outermost hooked call of a recording
/// thread. Under PyTorch's `backend:cudaMallocAsync` these are its tensors and no
/// segment-level allocation ever comes: without this look the snapshot could not say that
/// each tensor is its own CUDA call. One look, whatever it finds (a program without PyTorch
/// makes many such calls, and a look takes the loader's lock), until the writer sees
/// libraries loaded since (`allocator_route`). One relaxed load of the hooks' shared line
/// otherwise.
#[inline(always)]
pub fn after_stream_allocation() {
    if allocator_route::stream_allocations_look() {
        look_at_stream_allocation();
    }
}

#[cold]
#[inline(never)]
fn look_at_stream_allocation() {
    if STATE.load(Relaxed) != DECIDED {
        probe();
    }
    allocator_route::stream_allocations_stop_looking();
}

#[cold]
#[inline(never)]
fn probe() {
    if STATE
        .compare_exchange(LOOKING, PROBING, Acquire, Relaxed)
        .is_err()
    {
        return;
    }
    let next = match try_attach() {
        Some(route) => {
            allocator_route::decide(route);
            DECIDED
        }
        None => LOOKING,
    };
    STATE.store(next, Release);
}

/// `None`: not there yet (no `libc10_cuda.so`, or its allocator not initialized): look
/// again at the next segment allocation.
fn try_attach() -> Option<AllocatorRoute> {
    let allocator = match FOUND.get() {
        Some(a) => a,
        None => {
            let loaded = modules::libraries_loaded();
            if LIBRARIES_AT_LAST_PROBE.swap(loaded, Relaxed) == loaded {
                return None; // nothing was loaded since the last look
            }
            match library::find() {
                Ok(a) => FOUND.get_or_init(|| a),
                Err(Missing::NotLoaded) => return None,
                Err(Missing::Unusable(reason)) => {
                    return Some(AllocatorRoute::SegmentsOnly { reason });
                }
            }
        }
    };
    // SAFETY: `pointer` is the exported std::atomic<CUDAAllocator*>, which has the layout
    // of one pointer.
    let object = unsafe { (*(allocator.pointer as *const AtomicPtr<c_void>)).load(Acquire) };
    if object.is_null() {
        return None;
    }
    // SAFETY: a live C++ object with virtual methods starts with its virtual-table pointer.
    let vptr = unsafe { *(object as *const usize) };
    let version = allocator.version.clone();
    if vptr != allocator.native_vptr {
        return Some(AllocatorRoute::NotCaching { version });
    }
    let len = allocator.vtable_len;
    // SAFETY: `vptr` is NativeCachingAllocator's table of `len` entries (checked above).
    let slots = unsafe {
        (
            library::slot_of(vptr, len, allocator.initialized),
            library::slot_of(vptr, len, allocator.attach),
        )
    };
    let (Some(initialized), Some(attach)) = slots else {
        return Some(AllocatorRoute::SegmentsOnly {
            reason: format!(
                "PyTorch {version}: the caching allocator's methods are not in its virtual table"
            ),
        });
    };
    type Initialized = unsafe extern "C" fn(*mut c_void) -> bool;
    type Attach = unsafe extern "C" fn(*mut c_void, *mut StdFunction);
    // SAFETY: the entry is `bool NativeCachingAllocator::initialized()` (matched by
    // address); a member function takes `this` as its first argument.
    let is_initialized = unsafe {
        let f: Initialized = std::mem::transmute(*(vptr as *const usize).add(initialized));
        f(object)
    };
    if !is_initialized {
        // A tracker attached now would be lost: PyTorch hands it to each device's
        // allocator, and there are none before `init`.
        return None;
    }
    let Some(layout) = layout::number_for_version(&version) else {
        return Some(AllocatorRoute::SegmentsOnly {
            reason: format!(
                "PyTorch {version}: this memsnap knows the allocator's trace entries of \
                 releases 2.4 to 2.15 only"
            ),
        });
    };
    LAYOUT.store(layout, Release);
    // PyTorch's libraries may have been loaded since the unwinder's module table was
    // built: without them the first blocks' native stacks would stop at the tracker.
    crate::process::modules::refresh();
    // SAFETY: RTLD_DEFAULT and a C string; `typeid(void)` is libstdc++'s.
    let type_info = unsafe { real_dlsym(libc::RTLD_DEFAULT, c"_ZTIv") };
    let mut tracker = StdFunction::new(on_trace_entry, type_info);
    // SAFETY: the entry is `void NativeCachingAllocator::attachAllocatorTraceTracker(
    // std::function<void(const TraceEntry&)>)` (matched by address). A by-value argument
    // of a class with a non-trivial copy is passed as the address of a temporary that the
    // caller owns (the Itanium C++ ABI); PyTorch copies it for each device.
    unsafe {
        let f: Attach = std::mem::transmute(*(vptr as *const usize).add(attach));
        f(object, &mut tracker);
    }
    Some(AllocatorRoute::Blocks { version })
}

/// Tests: the layout the tracker reads with, as an attach would set it (its number:
/// `layout::number_for_version`).
#[cfg(test)]
pub fn set_layout_for_test(number: u8) {
    LAYOUT.store(number, Release);
}

/// The tracker: PyTorch calls it for every trace entry, on the thread that allocates or
/// frees, with its allocator's mutex held.
///
/// # Safety
/// Called by libstdc++'s `std::function` with `entry` pointing at a live `TraceEntry`.
pub(crate) unsafe extern "C" fn on_trace_entry(_functor: *const AnyData, entry: *const u8) {
    if !allocator_route::block_events_on() {
        return;
    }
    let Some(layout) = layout::by_number(LAYOUT.load(Acquire)) else {
        return;
    };
    // One allocation is one record, and memsnap's own threads and benchmarks' passing-
    // through threads record nothing, exactly as in the CUDA hooks.
    let scope = Scope::enter();
    if !scope.outermost() {
        return;
    }
    let Some(rec) = recording::recorder() else {
        return;
    };
    let by = record::Sender {
        rec,
        thread: scope.thread(),
    };
    // SAFETY: the offset is this PyTorch release's (`layout`), inside the live entry.
    let code = unsafe { (entry.add(layout.action) as *const u32).read_unaligned() };
    let kind = match layout.action(code) {
        Action::Alloc => Kind::BlockAlloc,
        Action::FreeRequested => Kind::BlockFreeRequested,
        Action::FreeCompleted => Kind::BlockFreeCompleted,
        // Out of line, where each reads what it needs (a segment its pool): the block events
        // gain nothing.
        // SAFETY: `entry` is the live entry, of `layout`'s release.
        rare => return unsafe { rare_entry(by, rare, layout, entry) },
    };
    // SAFETY: as above.
    let f = unsafe { EntryFields::read(layout, entry) };
    // One call site: the stack capture it inlines is in the binary once.
    record::block(by, kind, f.device, f.addr, f.size, f.stream, f.time);
    optimizer::attach_if_due(by.thread);
}

/// What every event takes from its entry.
struct EntryFields {
    device: i32,
    /// The address (for `OOM`: the device's free memory as CUDA reported it).
    addr: u64,
    stream: u64,
    size: u64,
    time: clock::Stamp,
}

impl EntryFields {
    /// # Safety
    /// `entry` points at a live `TraceEntry` of `layout`'s release.
    #[inline(always)]
    unsafe fn read(layout: layout::TraceEntryLayout, entry: *const u8) -> EntryFields {
        // SAFETY: the offsets are this PyTorch release's (`layout`), inside the live entry.
        let (device, addr, stream, size, counter) = unsafe {
            (
                *(entry.add(layout.device) as *const i8),
                (entry.add(layout.addr) as *const u64).read_unaligned(),
                (entry.add(layout.stream) as *const u64).read_unaligned(),
                (entry.add(layout.size) as *const u64).read_unaligned(),
                (entry.add(layout.time) as *const u64).read_unaligned(),
            )
        };
        // PyTorch read the time-stamp counter for this entry: the event clock's own reading
        // when the event clock is that counter.
        let time = match clock::source() {
            clock::Source::TimeStampCounter => clock::Stamp(counter),
            clock::Source::WallMicros => clock::now(),
        };
        EntryFields {
            device: i32::from(device),
            addr,
            stream,
            size,
            time,
        }
    }
}

/// Every entry but a block's: a segment (`SEGMENT_ALLOC`, `SEGMENT_MAP`) is sent with its
/// pool when that is a private one (read here, once per segment, never per block); `OOM`
/// takes the out-of-memory path; the rest is not sent (segment frees and unmaps are recorded
/// from the CUDA calls that follow them).
///
/// # Safety
/// `entry` points at a live `TraceEntry` of `layout`'s release.
#[cold]
#[inline(never)]
unsafe fn rare_entry(
    by: record::Sender,
    action: Action,
    layout: layout::TraceEntryLayout,
    entry: *const u8,
) {
    let kind = match action {
        Action::SegmentAlloc => Kind::CacheSegment,
        Action::SegmentMap => Kind::CacheSegmentMap,
        Action::Oom => {
            // SAFETY: the caller's.
            let f = unsafe { EntryFields::read(layout, entry) };
            return record::allocator_oom(by, f.device, f.size, f.addr, f.stream);
        }
        _ => return,
    };
    // SAFETY: the caller's; the pool's offsets are this release's, inside the live entry.
    let (f, pool) = unsafe {
        let pool = match layout.mempool {
            Some(at) => PoolId {
                first: (entry.add(at) as *const u64).read_unaligned(),
                second: (entry.add(at + 8) as *const u64).read_unaligned(),
            },
            // Releases whose entries have no pool (2.4 to 2.7): the default pool's.
            None => PoolId::DEFAULT,
        };
        (EntryFields::read(layout, entry), pool)
    };
    record::cache_segment(by, kind, f.device, f.addr, f.size, f.stream, f.time, pool);
}

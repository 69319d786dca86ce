//! Native return addresses of the calling thread, unwound in-process with framehop.
//!
//! Hot. Steady state: one atomic load (module table), two const-TLS reads (unwinder cache,
//! stack bounds), then framehop's cached per-address rules; every stack read is checked
//! against `[sp at capture, top of the thread's stack)`. First capture on a thread: one
//! allocation (the framehop cache, leaked) and `pthread_getattr_np` (may read /proc on the
//! main thread). The walk ends cleanly at an address in no known module (JIT code, a module
//! loaded since the table was built: the table is marked stale for the writer), at a failed
//! stack read, or at the frame limit. x86_64 only; elsewhere nothing is captured.

#[cfg(target_arch = "x86_64")]
pub use imp::capture;

#[cfg(not(target_arch = "x86_64"))]
#[inline]
pub fn capture(slot: &mut crate::channel::event::StackSlot, max_frames: usize) {
    let _ = max_frames;
    slot.n_native = 0;
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use crate::capture::modules;
    use crate::channel::event::StackSlot;
    use crate::config::FRAME_CAPACITY;
    use framehop::x86_64::{CacheX86_64, UnwindRegsX86_64};
    use framehop::{FrameAddress, MustNotAllocateDuringUnwind, Unwinder as _};
    use std::cell::Cell;

    type Cache = CacheX86_64<MustNotAllocateDuringUnwind>;

    /// Marks a thread whose cache was given back by the thread-exit destructor.
    const CACHE_GONE: *mut Cache = std::ptr::without_provenance_mut(1);

    /// Upper bound on unwinder steps, own frames included: bounded work whatever the stack.
    const MAX_STEPS: usize = FRAME_CAPACITY + 64;

    thread_local! {
        static CACHE: Cell<*mut Cache> = const { Cell::new(std::ptr::null_mut()) };
        /// This thread's stack `[bottom, top)`; top 0 = not looked up yet, MAX = unknown.
        static STACK: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
    }

    static CACHE_KEY: std::sync::OnceLock<libc::pthread_key_t> = std::sync::OnceLock::new();

    unsafe extern "C" fn free_cache(p: *mut libc::c_void) {
        CACHE.with(|c| c.set(CACHE_GONE));
        if !p.is_null() {
            // SAFETY: `p` is the Box we leaked for this thread; the thread is exiting and
            // its TLS now says "gone", so no later capture on it can use the pointer.
            unsafe { drop(Box::from_raw(p as *mut Cache)) };
        }
    }

    /// The thread's unwinder cache, created on its first capture.
    #[inline]
    fn thread_cache() -> Option<&'static mut Cache> {
        let p = CACHE.with(|c| c.get());
        if p == CACHE_GONE {
            return None;
        }
        if !p.is_null() {
            // SAFETY: `p` is this thread's leaked cache; only this thread uses it, and
            // `capture` is not re-entered on one thread (the hooks' nesting guard).
            return Some(unsafe { &mut *p });
        }
        let fresh = Box::into_raw(Box::new(Cache::new_in()));
        CACHE.with(|c| c.set(fresh));
        let key = CACHE_KEY.get_or_init(|| {
            let mut key: libc::pthread_key_t = 0;
            // SAFETY: plain key creation with a destructor of the right type.
            let rc = unsafe { libc::pthread_key_create(&mut key, Some(free_cache)) };
            if rc == 0 {
                key
            } else {
                libc::pthread_key_t::MAX
            }
        });
        if *key != libc::pthread_key_t::MAX {
            // SAFETY: a valid key; the value is only read back by `free_cache`.
            unsafe { libc::pthread_setspecific(*key, fresh as *const libc::c_void) };
        }
        // SAFETY: just allocated, owned by this thread.
        Some(unsafe { &mut *fresh })
    }

    /// The calling thread's stack `[bottom, top)`, looked up once per thread; `None` when
    /// unknown (then no native frames: reads could not be bounded).
    #[inline]
    fn stack_bounds() -> Option<(u64, u64)> {
        let (bottom, top) = STACK.with(|c| c.get());
        if top != 0 {
            return (top != u64::MAX).then_some((bottom, top));
        }
        let mut bounds = (0u64, u64::MAX);
        // SAFETY: attr is initialised by pthread_getattr_np before use and destroyed after.
        unsafe {
            let mut attr: libc::pthread_attr_t = std::mem::zeroed();
            if libc::pthread_getattr_np(libc::pthread_self(), &mut attr) == 0 {
                let mut addr: *mut libc::c_void = std::ptr::null_mut();
                let mut size: libc::size_t = 0;
                if libc::pthread_attr_getstack(&attr, &mut addr, &mut size) == 0 && size > 0 {
                    bounds = (addr as u64, (addr as u64).saturating_add(size as u64));
                }
                libc::pthread_attr_destroy(&mut attr);
            }
        }
        STACK.with(|c| c.set(bounds));
        (bounds.1 != u64::MAX).then_some(bounds)
    }

    /// Fills `slot.native` with return addresses, innermost first, memsnap's own frames
    /// removed. Sets `slot.truncated` if the stack had more than `max_frames` frames.
    #[inline(never)]
    pub fn capture(slot: &mut StackSlot, max_frames: usize) {
        slot.n_native = 0;
        let max = max_frames.min(FRAME_CAPACITY);
        if max == 0 {
            return;
        }
        let table = modules::ensure();
        let Some(cache) = thread_cache() else { return };
        let Some((bottom, top)) = stack_bounds() else {
            return;
        };

        let (ip, sp, bp): (u64, u64, u64);
        // SAFETY: reads three registers, touches no memory.
        unsafe {
            std::arch::asm!(
                "lea {ip}, [rip]",
                "mov {sp}, rsp",
                "mov {bp}, rbp",
                ip = out(reg) ip,
                sp = out(reg) sp,
                bp = out(reg) bp,
                options(nomem, nostack, preserves_flags),
            );
        }
        if sp < bottom || sp >= top {
            // Running on another stack (a signal's alternate stack, a coroutine's): the
            // reads could not be bounded, so no native frames.
            return;
        }
        let lo = sp;
        let mut read_stack = |addr: u64| -> Result<u64, ()> {
            if addr < lo || addr > top.saturating_sub(8) {
                return Err(());
            }
            // SAFETY: `[lo, top)` is this thread's live stack: everything above our own
            // stack pointer up to the top of the mapping is mapped and readable.
            Ok(unsafe { std::ptr::read_unaligned(addr as *const u64) })
        };
        let regs = UnwindRegsX86_64::new(ip, sp, bp);
        let mut iter = table.unwinder.iter_frames(ip, regs, cache, &mut read_stack);
        let mut n = 0usize;
        let mut steps = 0usize;
        let mut hint = usize::MAX;
        while steps < MAX_STEPS {
            steps += 1;
            let frame = match iter.next() {
                Ok(Some(f)) => f,
                Ok(None) | Err(_) => break,
            };
            let pc = match frame {
                // Our own capture function: never part of the stack.
                FrameAddress::InstructionPointer(_) => continue,
                FrameAddress::ReturnAddress(ra) => ra.get(),
            };
            let Some(module) = table.find_near(pc, hint) else {
                // JIT code, or a module loaded after the table was built.
                modules::mark_stale();
                break;
            };
            hint = module;
            if table.is_own(module) {
                continue;
            }
            if n >= max {
                slot.truncated = true;
                break;
            }
            if let Some(dst) = slot.native.get_mut(n) {
                *dst = pc;
                n += 1;
            }
        }
        slot.n_native = n as u16;
    }
}

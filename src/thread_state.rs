//! Per-thread state that the hook side allocates on a thread's first use and that is freed
//! when the thread exits (the native unwinder's caches and walks, the stacks a thread has
//! sent), and the thread-exit calls that free it (or give a thread's lane back:
//! `channel::lanes`).
//!
//! Cold: runs once per thread. The state is mapped zeroed in place, never built on the
//! hook's stack (which may be a small thread stack of the program's), and handed to a
//! pthread key whose destructor frees it at thread exit; the owning module keeps the
//! pointer in a `const` thread-local and marks it gone in that destructor.
//!
//! Why a mapping of its own and not the allocator: the unwinder's state is 8.3 MiB aligned
//! to cache lines, and Rust's system allocator zeroes any allocation aligned above 16 bytes
//! with a `memset` of its whole size: 9 million instructions on a thread's first capture and
//! every page resident at once. Anonymous pages are zero already and become resident only
//! when written (small pages, asked for whatever the huge-page policy), so a thread pays
//! for the part of its tables its walks fill.

use std::sync::OnceLock;

/// The pthread key that frees one kind of per-thread state at thread exit.
pub struct ExitKey {
    key: OnceLock<libc::pthread_key_t>,
}

impl ExitKey {
    pub const fn new() -> ExitKey {
        ExitKey {
            key: OnceLock::new(),
        }
    }

    /// Maps a zeroed `T` for the calling thread and has `destructor` called with it when
    /// the thread exits. Null when the mapping failed. Without a key (the process ran out
    /// of them) the state lives until the process ends.
    ///
    /// # Safety
    /// All-zero bytes must be a valid `T` (or the caller writes every field that is not
    /// before any use), and `destructor` must end a `*mut T` mapped here with [`free`].
    pub unsafe fn alloc_zeroed<T>(
        &self,
        destructor: unsafe extern "C" fn(*mut libc::c_void),
    ) -> *mut T {
        const { assert!(std::mem::align_of::<T>() <= PAGE && std::mem::size_of::<T>() > 0) };
        // SAFETY: a fresh private anonymous mapping; nothing else is touched.
        let fresh = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                std::mem::size_of::<T>(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if fresh == libc::MAP_FAILED {
            return std::ptr::null_mut();
        }
        // Small pages whatever the system's transparent-huge-page policy: with "always", a
        // walk's first write into each 2 MiB of the tables would make all of it resident.
        // (A hint: if the kernel refuses it, the state works the same.)
        // SAFETY: advice on the mapping just made, nothing else.
        unsafe { libc::madvise(fresh, std::mem::size_of::<T>(), libc::MADV_NOHUGEPAGE) };
        let fresh = fresh as *mut T;
        // SAFETY: the caller's contract: `destructor` ends a `*mut T` mapped here.
        unsafe { self.call_at_exit(fresh.cast(), destructor) };
        fresh
    }

    /// Has `destructor` called with `value` when the calling thread exits (without a key,
    /// never: the process ran out of them).
    ///
    /// # Safety
    /// `destructor` must accept `value` at the thread's exit (one value per key and
    /// thread: a second call replaces the first).
    pub unsafe fn call_at_exit(
        &self,
        value: *mut libc::c_void,
        destructor: unsafe extern "C" fn(*mut libc::c_void),
    ) {
        let key = self.key.get_or_init(|| {
            let mut key: libc::pthread_key_t = 0;
            // SAFETY: plain key creation with a destructor of the right type.
            let rc = unsafe { libc::pthread_key_create(&mut key, Some(destructor)) };
            if rc == 0 {
                key
            } else {
                libc::pthread_key_t::MAX
            }
        });
        if *key != libc::pthread_key_t::MAX {
            // SAFETY: a valid key; the value is only read back by `destructor`.
            unsafe { libc::pthread_setspecific(*key, value) };
        }
    }
}

/// The smallest page of the supported systems: every mapping is aligned to it at least.
const PAGE: usize = 4096;

/// Drops the `T` at `p` in place and unmaps it.
///
/// # Safety
/// `p` must come from [`ExitKey::alloc_zeroed`] of a `T`, hold a valid `T`, and not be used
/// afterwards.
pub unsafe fn free<T>(p: *mut T) {
    // SAFETY: caller's contract: a valid `T` mapped by `alloc_zeroed` with this size.
    unsafe {
        std::ptr::drop_in_place(p);
        libc::munmap(p as *mut libc::c_void, std::mem::size_of::<T>());
    }
}

impl Default for ExitKey {
    fn default() -> Self {
        ExitKey::new()
    }
}

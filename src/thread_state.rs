//! Per-thread state that the hook side allocates on a thread's first use and that is freed
//! when the thread exits (the native unwinder's caches and walks, the stacks a thread has
//! sent).
//!
//! Cold: runs once per thread. The state is allocated zeroed in place, never built on the
//! hook's stack (which may be a small thread stack of the program's), and handed to a
//! pthread key whose destructor frees it at thread exit; the owning module keeps the
//! pointer in a `const` thread-local and marks it gone in that destructor.

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

    /// Allocates a zeroed `T` for the calling thread and has `destructor` called with it
    /// when the thread exits. Null when the allocation failed. Without a key (the process
    /// ran out of them) the state lives until the process ends.
    ///
    /// # Safety
    /// All-zero bytes must be a valid `T` (or the caller writes every field that is not
    /// before any use), and `destructor` must free a `*mut T` allocated here.
    pub unsafe fn alloc_zeroed<T>(
        &self,
        destructor: unsafe extern "C" fn(*mut libc::c_void),
    ) -> *mut T {
        let layout = std::alloc::Layout::new::<T>();
        // SAFETY: the types used here are not zero-sized.
        let fresh = unsafe { std::alloc::alloc_zeroed(layout) } as *mut T;
        if fresh.is_null() {
            return fresh;
        }
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
            unsafe { libc::pthread_setspecific(*key, fresh as *const libc::c_void) };
        }
        fresh
    }
}

impl Default for ExitKey {
    fn default() -> Self {
        ExitKey::new()
    }
}

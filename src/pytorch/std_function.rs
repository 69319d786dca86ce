//! A libstdc++ `std::function<void(const TraceEntry&)>` built by hand, whose call lands in
//! a Rust function: what PyTorch's `attachAllocatorTraceTracker` takes.
//!
//! Cold to build (once); the invoker it carries is the hot tracker. The layout is
//! libstdc++'s on x86-64 (docs/PYTORCH.md, "The tracker as a std::function"): 16 bytes of
//! functor storage (`_Any_data`), then the manager and the invoker pointers. memsnap's
//! functor holds nothing, so copying it is copying 16 bytes and destroying it is nothing.

use std::ffi::{c_int, c_void};

/// `std::_Any_data`: where a small functor lives inside the `std::function`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct AnyData([usize; 2]);

/// `_M_manager(_Any_data& dest, const _Any_data& source, _Manager_operation op) -> bool`.
type Manager = unsafe extern "C" fn(*mut AnyData, *const AnyData, c_int) -> bool;
/// `_M_invoker(const _Any_data& functor, const TraceEntry& entry)`.
pub type Invoker = unsafe extern "C" fn(*const AnyData, *const u8);

/// `std::function`'s layout: `_Function_base { _Any_data _M_functor; _Manager_type
/// _M_manager; }` followed by `_Invoker_type _M_invoker`.
#[repr(C)]
pub struct StdFunction {
    functor: AnyData,
    manager: Option<Manager>,
    invoker: Option<Invoker>,
}

// `_Manager_operation`'s values.
const GET_TYPE_INFO: c_int = 0;
const GET_FUNCTOR_PTR: c_int = 1;
const CLONE_FUNCTOR: c_int = 2;

/// The `type_info` answered to `target_type()` (`typeid(void)` from libstdc++, looked up
/// once at attach; null when absent: nothing in PyTorch asks).
static TYPE_INFO: std::sync::atomic::AtomicPtr<c_void> =
    std::sync::atomic::AtomicPtr::new(std::ptr::null_mut());

/// The manager of a functor that is two plain words: copies them, frees nothing.
unsafe extern "C" fn manage(dest: *mut AnyData, source: *const AnyData, op: c_int) -> bool {
    // SAFETY: libstdc++ passes valid `_Any_data` references for both operands.
    unsafe {
        match op {
            GET_TYPE_INFO => {
                (*dest).0[0] = TYPE_INFO.load(std::sync::atomic::Ordering::Relaxed) as usize
            }
            GET_FUNCTOR_PTR => (*dest).0[0] = source as usize,
            CLONE_FUNCTOR => *dest = *source,
            _ => {} // destroy: nothing was allocated
        }
    }
    false
}

impl StdFunction {
    /// A `std::function` that calls `invoker`; `type_info` is what `target_type()` answers.
    pub fn new(invoker: Invoker, type_info: *mut c_void) -> StdFunction {
        TYPE_INFO.store(type_info, std::sync::atomic::Ordering::Relaxed);
        StdFunction {
            functor: AnyData([0; 2]),
            manager: Some(manage),
            invoker: Some(invoker),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

    static CALLS: AtomicUsize = AtomicUsize::new(0);

    unsafe extern "C" fn count(_f: *const AnyData, entry: *const u8) {
        // SAFETY: the test passes a pointer to a live u8.
        CALLS.fetch_add(unsafe { *entry } as usize, SeqCst);
    }

    #[test]
    fn layout_is_libstdcxx() {
        assert_eq!(std::mem::size_of::<StdFunction>(), 32);
        assert_eq!(std::mem::offset_of!(StdFunction, manager), 16);
        assert_eq!(std::mem::offset_of!(StdFunction, invoker), 24);
    }

    #[test]
    fn clone_and_call_as_libstdcxx_would() {
        let f = StdFunction::new(count, std::ptr::null_mut());
        // What `std::function`'s copy constructor does: manager(clone), then copy the
        // invoker; what `operator()` does: invoker(&functor, &arg).
        let mut copy = AnyData([7; 2]);
        // SAFETY: valid operands, as libstdc++ passes them.
        unsafe { (f.manager.unwrap())(&mut copy, &f.functor, CLONE_FUNCTOR) };
        assert_eq!(copy.0, [0, 0]);
        let arg = 5u8;
        // SAFETY: the invoker reads one byte from a live u8.
        unsafe { (f.invoker.unwrap())(&copy, &arg) };
        assert_eq!(CALLS.load(SeqCst), 5);
        let mut out = AnyData([0; 2]);
        // SAFETY: as above.
        unsafe { (f.manager.unwrap())(&mut out, &f.functor, GET_FUNCTOR_PTR) };
        assert_eq!(out.0[0], &f.functor as *const AnyData as usize);
    }
}

//! PyTorch's optimizer steps as step boundaries, in a program that has no memsnap code
//! (docs/PYTORCH.md, "Steps without code"): memsnap adds a built-in function of its own to
//! PyTorch's global optimizer step post hooks, and each step it is called for marks a
//! boundary (`process::step_marks` says which).
//!
//! Cold, on the program's threads, in three places:
//! - [`attach_if_due`], in a recorded hooked call: one load of the hook line; while an
//!   attempt is due (a few times in a process), [`schedule`], on the interpreter's main
//!   thread only, queues [`attach`] with `Py_AddPendingCall`, which takes CPython's
//!   pending-call lock for a few instructions (no other lock, no allocation, no Python
//!   code). The first attempt also looks up the C API functions (`dlsym`, once).
//! - [`attach`], run by the interpreter on its main thread with the GIL held, between two
//!   bytecodes: finds `torch.optim.optimizer` in `sys.modules` (never imports it) and adds
//!   the hook to its table, running no Python code.
//! - [`on_optimizer_step`], the hook: called with the GIL held after each optimizer step.
//!
//! No Python error memsnap causes reaches the program: each is cleared and counted.

use crate::channel::event::StepOrigin;
use crate::channel::thread::HookThread;
use crate::process::python::lookup;
use crate::process::step_marks::{self, Hook, NotAttached};
use crate::record;
use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::OnceLock;

/// A `PyObject *`.
type Object = *mut c_void;

/// CPython's `PyMethodDef` (the same in every version memsnap supports).
#[repr(C)]
struct MethodDef {
    name: *const c_char,
    function: unsafe extern "C" fn(Object, *const Object, isize) -> Object,
    flags: c_int,
    doc: *const c_char,
}

// SAFETY: the definition is immutable and its pointers are to static strings; CPython only
// reads it.
unsafe impl Sync for MethodDef {}

/// `METH_FASTCALL`: the function gets its positional arguments as an array.
const METH_FASTCALL: c_int = 0x0080;

/// The hook's definition: CPython keeps a pointer to it for the function's whole life.
static HOOK_DEF: MethodDef = MethodDef {
    name: c"memsnap_step".as_ptr(),
    function: on_optimizer_step,
    flags: METH_FASTCALL,
    doc: c"memsnap: a step boundary after each optimizer step".as_ptr(),
};

type PendingCall = extern "C" fn(*mut c_void) -> c_int;

/// The C API functions used here, present in every CPython from 3.10 to 3.14.
struct Api {
    is_initialized: unsafe extern "C" fn() -> c_int,
    /// `PyGILState_GetThisThreadState`: the calling thread's own thread state.
    this_thread_state: unsafe extern "C" fn() -> *mut c_void,
    add_pending_call: unsafe extern "C" fn(PendingCall, *mut c_void) -> c_int,
    err_occurred: unsafe extern "C" fn() -> Object,
    err_clear: unsafe extern "C" fn(),
    module_dict: unsafe extern "C" fn() -> Object,
    dict_get_item_string: unsafe extern "C" fn(Object, *const c_char) -> Object,
    module_get_dict: unsafe extern "C" fn(Object) -> Object,
    dict_size: unsafe extern "C" fn(Object) -> isize,
    cfunction_new: unsafe extern "C" fn(*const MethodDef, Object, Object) -> Object,
    set_item: unsafe extern "C" fn(Object, Object, Object) -> c_int,
    inc_ref: unsafe extern "C" fn(Object),
    dec_ref: unsafe extern "C" fn(Object),
    /// `Py_None`.
    none: Object,
}

// SAFETY: function addresses and the address of `Py_None`, which lives as long as the
// interpreter; only used under the interpreter's rules (the GIL) by the functions below.
unsafe impl Send for Api {}
// SAFETY: as above.
unsafe impl Sync for Api {}

static API: OnceLock<Option<Api>> = OnceLock::new();

impl Api {
    /// Looks the functions up in the global scope; `None` when one is missing.
    fn resolve() -> Option<Api> {
        let find = |name: &CStr| -> Option<usize> { Some(lookup(name)).filter(|&a| a != 0) };
        // SAFETY: each address is the interpreter's function of that name, whose C signature
        // (CPython's documented one) is the type it is given here.
        unsafe {
            Some(Api {
                is_initialized: Api::function(find(c"Py_IsInitialized")?),
                this_thread_state: Api::function(find(c"PyGILState_GetThisThreadState")?),
                add_pending_call: Api::function(find(c"Py_AddPendingCall")?),
                err_occurred: Api::function(find(c"PyErr_Occurred")?),
                err_clear: Api::function(find(c"PyErr_Clear")?),
                module_dict: Api::function(find(c"PyImport_GetModuleDict")?),
                dict_get_item_string: Api::function(find(c"PyDict_GetItemString")?),
                module_get_dict: Api::function(find(c"PyModule_GetDict")?),
                dict_size: Api::function(find(c"PyDict_Size")?),
                cfunction_new: Api::function(find(c"PyCFunction_NewEx")?),
                set_item: Api::function(find(c"PyObject_SetItem")?),
                inc_ref: Api::function(find(c"Py_IncRef")?),
                dec_ref: Api::function(find(c"Py_DecRef")?),
                none: find(c"_Py_NoneStruct")? as Object,
            })
        }
    }

    /// The function at `address`, as a pointer of type `F`.
    ///
    /// # Safety
    /// `F` is a function pointer type, and the function at `address` has its signature.
    unsafe fn function<F: Copy>(address: usize) -> F {
        const { assert!(size_of::<F>() == size_of::<usize>()) };
        // SAFETY: the caller's; a function pointer is an address (sizes checked above).
        unsafe { std::mem::transmute_copy(&address) }
    }

    /// Clears the error the last call raised, if any, and counts it.
    ///
    /// # Safety
    /// The calling thread holds the GIL.
    unsafe fn clear_error(&self) {
        // SAFETY: the caller holds the GIL.
        unsafe {
            if !(self.err_occurred)().is_null() {
                (self.err_clear)();
                step_marks::count_python_error();
            }
        }
    }
}

/// Called by a hooked call after it recorded its event (`thread`: the caller's hook state):
/// one load, and the attach path while an attempt is due.
#[inline(always)]
pub fn attach_if_due(thread: &HookThread) {
    if step_marks::attach_due() {
        schedule(thread);
    }
}

/// Queues [`attach`] for the interpreter's main thread, when the calling thread is that
/// thread: the process's first thread, with a Python thread state. It is the one that
/// finalizes the interpreter, and it is here, so the interpreter's pending-call queue
/// cannot be freed while `Py_AddPendingCall` runs (which, as CPython documents, needs
/// neither the GIL nor a thread state: PyTorch releases the GIL around its operations, so
/// a CUDA call rarely holds it). Another thread leaves the attempt to a later event.
#[cold]
#[inline(never)]
fn schedule(thread: &HookThread) {
    if !step_marks::take_due() {
        return; // another thread took this attempt
    }
    if thread.tid() != step_marks::main_thread() {
        return step_marks::not_attached(NotAttached::NotMainThread, 0);
    }
    let Some(api) = API.get_or_init(Api::resolve) else {
        return step_marks::try_later(NotAttached::NoPython);
    };
    // SAFETY: neither needs the GIL: a runtime flag, and this thread's thread-state slot.
    let python_thread =
        unsafe { (api.is_initialized)() != 0 && !(api.this_thread_state)().is_null() };
    if !python_thread {
        return step_marks::try_later(NotAttached::NoPython);
    }
    // SAFETY: `attach` has the pending-call signature; the interpreter is initialized and
    // cannot finalize meanwhile (see above).
    if unsafe { (api.add_pending_call)(attach, std::ptr::null_mut()) } != 0 {
        step_marks::try_later(NotAttached::Busy);
    }
}

/// The pending call: registers the hook if `torch.optim` is imported. Always returns 0 (a
/// pending call that fails raises its error in the program).
extern "C" fn attach(_: *mut c_void) -> c_int {
    let Some(Some(api)) = API.get() else {
        return 0;
    };
    if !step_marks::attach_wanted() {
        return 0; // the program marked a step since this was queued
    }
    // SAFETY: a pending call runs on the interpreter's main thread with the GIL held.
    let outcome = unsafe { register(api) };
    match outcome {
        Ok(()) => step_marks::set_hook(Hook::Attached),
        Err(Some(why)) => step_marks::try_later(why),
        Err(None) => step_marks::set_hook(Hook::Failed),
    }
    0
}

/// Adds a function made from [`HOOK_DEF`] to PyTorch's global optimizer step post hooks
/// (`_global_optimizer_post_hooks`, the table `register_optimizer_step_post_hook` fills and
/// each step runs), keyed by itself. Only into an empty table: a step running the program's
/// own hooks, on this thread or another that the interpreter paused between two bytecodes,
/// iterates it, and a table changed under an iteration raises in the program; an empty one
/// is iterated within one bytecode. Directly, not through `register_...`: no Python code
/// runs (nothing a tracer or profiler of the program would see) and the numbers PyTorch gives
/// its hook handles stay the program's. `Err(Some(why))`: not now; `Err(None)`: a Python
/// error (cleared).
///
/// # Safety
/// The calling thread holds the GIL.
unsafe fn register(api: &Api) -> Result<(), Option<NotAttached>> {
    // SAFETY: the caller holds the GIL. The module and the table are borrowed from
    // `sys.modules` and the module's namespace, and used before any code of the program can
    // run (str keys only: no `__eq__` of the program's; the table's own `__setitem__` and
    // `__len__` are C).
    unsafe {
        if !(api.err_occurred)().is_null() {
            // Between two bytecodes no exception is being raised; should one be, its
            // handling is not interrupted.
            return Err(Some(NotAttached::Busy));
        }
        let modules = (api.module_dict)();
        let module = match modules.is_null() {
            true => std::ptr::null_mut(),
            false => (api.dict_get_item_string)(modules, c"torch.optim.optimizer".as_ptr()),
        };
        if module.is_null() {
            api.clear_error();
            return Err(Some(NotAttached::NoTorchOptim));
        }
        let namespace = (api.module_get_dict)(module);
        let item = |name: &CStr| match namespace.is_null() {
            true => std::ptr::null_mut(),
            false => (api.dict_get_item_string)(namespace, name.as_ptr()),
        };
        // The public function vouches for the table's meaning (PyTorch 2.0 and later).
        let register = item(c"register_optimizer_step_post_hook");
        let table = item(c"_global_optimizer_post_hooks");
        if register.is_null() || table.is_null() {
            api.clear_error();
            return Err(Some(NotAttached::NoHookFunction));
        }
        match (api.dict_size)(table) {
            0 => {}
            n => {
                api.clear_error(); // (-1: not a dict)
                return Err(Some(match n {
                    -1 => NotAttached::NoHookFunction,
                    _ => NotAttached::ProgramHooks,
                }));
            }
        }
        let hook = (api.cfunction_new)(&HOOK_DEF, std::ptr::null_mut(), std::ptr::null_mut());
        if hook.is_null() {
            api.clear_error();
            return Err(None);
        }
        let stored = (api.set_item)(table, hook, hook);
        (api.dec_ref)(hook); // the table holds it now (or not at all)
        if stored != 0 {
            api.clear_error();
            return Err(None);
        }
        Ok(())
    }
}

/// The hook: `hook(optimizer, args, kwargs)` after each step of a `torch.optim.Optimizer`,
/// with the GIL held. Returns `None`; never raises.
unsafe extern "C" fn on_optimizer_step(_: Object, args: *const Object, nargs: isize) -> Object {
    let optimizer = match nargs > 0 && !args.is_null() {
        // SAFETY: CPython passes `nargs` arguments at `args`.
        true => (unsafe { *args }) as usize,
        false => 0,
    };
    if step_marks::optimizer_step_is_boundary(optimizer) {
        record::step(StepOrigin::Optimizer);
    }
    match API.get() {
        Some(Some(api)) => {
            // SAFETY: the caller holds the GIL; `Py_None` lives as long as the interpreter.
            unsafe { (api.inc_ref)(api.none) };
            api.none
        }
        // Not reached: the hook exists only once attached with these functions.
        _ => std::ptr::null_mut(),
    }
}

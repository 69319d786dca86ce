//! The bodies of the public C API (`memsnap_step`, `memsnap_dump`, `memsnap_dump_path`,
//! `memsnap_active`): the symbols themselves are declared in `exports.rs` and documented in
//! `include/memsnap.h`.
//!
//! Cold, but called from the program's threads: a step is one event on the queue; a dump
//! waits (in 1 ms steps) until the writer says the file is on disk.

use super::EXIT_WAIT;
use crate::channel::event::StepOrigin;
use crate::channel::handshake::{API_DUMP_LOG, API_DUMPS, ApiDump};
use crate::channel::recording;
use crate::guard::Scope;
use crate::process::step_marks;
use crate::record;
use std::ffi::{CStr, c_char, c_int};

/// `memsnap_step()`: marks the end of a training step. Cheap: one event on the queue.
/// -1 under `MEMSNAP_STEPS=off`; from the first call on, PyTorch's optimizer steps are no
/// boundaries (`process::step_marks`).
#[inline]
pub fn step() -> c_int {
    if !step_marks::program_mark() {
        return -1;
    }
    match record::step(StepOrigin::Program) {
        true => 0,
        false => -1,
    }
}

/// `memsnap_dump(tag)`: 0 once the snapshot is on disk, -1 if memsnap is off or it timed
/// out.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
pub unsafe fn dump(tag: *const c_char) -> c_int {
    // SAFETY: the caller's contract on `tag` is this function's.
    match unsafe { request_api_dump(tag) } {
        Some(_) => 0,
        None => -1,
    }
}

/// `memsnap_dump_path(tag, path, size)`: as [`dump`], and copies the file's absolute path
/// into `path` (cut to fit as `snprintf` does); returns the path's full length in bytes
/// without the NUL, or -1.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string; `path` is NULL or points to `size` writable
/// bytes.
pub unsafe fn dump_path(tag: *const c_char, path: *mut c_char, size: usize) -> c_int {
    // SAFETY: the caller's contract on `tag` is this function's.
    let Some(ticket) = (unsafe { request_api_dump(tag) }) else {
        return -1;
    };
    let written = match API_DUMP_LOG.lock() {
        Ok(log) => log
            .get(ticket as usize - 1)
            .and_then(|d| d.path.as_ref())
            .map(|p| p.as_os_str().as_encoded_bytes().to_vec()),
        Err(_) => None,
    };
    let Some(bytes) = written else { return -1 };
    if !path.is_null() && size > 0 {
        let n = bytes.len().min(size - 1);
        // SAFETY: the caller gives `size` writable bytes at `path`; n + 1 <= size.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), path.cast::<u8>(), n);
            *path.add(n) = 0;
        }
    }
    c_int::try_from(bytes.len()).unwrap_or(c_int::MAX)
}

/// Asks the writer for an `api` snapshot tagged `tag` and waits until it is on disk:
/// the request's ticket, or `None` when memsnap is off or the wait timed out.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
unsafe fn request_api_dump(tag: *const c_char) -> Option<u64> {
    let _scope = Scope::enter();
    let rec = recording::recorder()?;
    let tag = if tag.is_null() {
        String::new()
    } else {
        // SAFETY: the caller passes a NUL-terminated string (documented contract).
        unsafe { CStr::from_ptr(tag) }
            .to_string_lossy()
            .into_owned()
    };
    let ticket = {
        let mut log = API_DUMP_LOG.lock().ok()?;
        log.push(ApiDump { tag, path: None });
        API_DUMPS.ask()
    };
    rec.wake_writer();
    rec.wait_for(|| API_DUMPS.is_done(ticket), EXIT_WAIT)
        .then_some(ticket)
}

/// `memsnap_active()`: whether memsnap is recording in this process (1) or not (0).
#[inline]
pub fn active() -> c_int {
    recording::is_active() as c_int
}

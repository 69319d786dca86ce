//! Turns a hooked call's outcome into an [`Event`] on the queue.
//!
//! Hot. Called only from the outermost hooked call of a thread, after the real call (for
//! allocations) or before it (for frees). No allocation, no lock, no panic; the only
//! extra driver call is `cuCtxGetDevice` (a thread-local read in the driver). The
//! out-of-memory path is cold: it asks the driver for free memory and waits, bounded, for
//! the writer to persist the snapshot before the failing call returns.

use crate::config::{Context, Stacks};
use crate::preload::control;
use crate::preload::event::{Api, Event, Kind};
use crate::preload::ffi::{CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, CuResult};
use crate::preload::hooks;
use crate::preload::queue::Recorder;
use crate::preload::stack;
use std::cell::Cell;

thread_local! {
    static TID: Cell<u32> = const { Cell::new(0) };
}

/// Kernel thread id, asked once per thread.
#[inline]
fn tid() -> u32 {
    TID.with(|t| {
        let v = t.get();
        if v != 0 {
            return v;
        }
        // SAFETY: gettid has no preconditions.
        let v = unsafe { libc::gettid() } as u32;
        t.set(v);
        v
    })
}

/// Microseconds since the Unix epoch (clock_gettime through the vDSO: no syscall).
#[inline]
pub fn now_us() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer; CLOCK_REALTIME always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    (ts.tv_sec as u64)
        .wrapping_mul(1_000_000)
        .wrapping_add(ts.tv_nsec as u64 / 1000)
}

#[inline]
fn event(kind: Kind, api: Api, device: i32, addr: u64, size: u64, aux: u64, aux2: u64) -> Event {
    let mut ev = Event::new(kind, api);
    ev.device = device;
    ev.tid = tid();
    ev.addr = addr;
    ev.size = size;
    ev.aux = aux;
    ev.aux2 = aux2;
    ev.time_us = now_us();
    ev
}

/// Attaches the caller's stack if configured and a slot is free, then sends the event.
#[inline]
fn send(rec: &Recorder, mut ev: Event, with_stack: bool) {
    let settings = control::settings();
    if with_stack
        && settings.stacks != Stacks::None
        && let Some((idx, slot)) = rec.take_slot()
    {
        stack::capture(slot, settings.stacks, settings.max_frames);
        ev.stack = idx;
    }
    rec.push(ev);
}

/// The outcome of an allocating call: an event on success, the OOM path on
/// out-of-memory, nothing on any other error.
#[inline]
pub fn allocation(result: CuResult, kind: Kind, api: Api, addr: u64, size: u64, stream: u64) {
    if result == CUDA_SUCCESS {
        if addr == 0 {
            return; // zero-byte requests succeed without memory
        }
        let Some(rec) = control::recorder() else {
            return;
        };
        let device = hooks::current_device();
        hooks::note_device_total(device);
        send(rec, event(kind, api, device, addr, size, stream, 0), true);
    } else if result == CUDA_ERROR_OUT_OF_MEMORY {
        out_of_memory(api, size, stream);
    }
}

/// A free, recorded before the real call releases the address.
#[inline]
pub fn release(kind: Kind, api: Api, addr: u64, size: u64, stream: u64) {
    let Some(rec) = control::recorder() else {
        return;
    };
    let with_stack = control::settings().context == Context::All;
    send(rec, event(kind, api, -1, addr, size, stream, 0), with_stack);
}

/// Virtual-memory bookkeeping (create/release/reserve/free): no stack needed.
#[inline]
pub fn vmm(kind: Kind, api: Api, device: i32, addr: u64, size: u64, handle: u64) {
    let Some(rec) = control::recorder() else {
        return;
    };
    send(rec, event(kind, api, device, addr, size, handle, 0), false);
}

/// `cuMemMap` (after success) and `cuMemUnmap` (before the call).
#[inline]
pub fn mapping(kind: Kind, addr: u64, size: u64, handle: u64) {
    let Some(rec) = control::recorder() else {
        return;
    };
    let (api, with_stack) = match kind {
        Kind::Map => (Api::CuMemMap, true),
        _ => (Api::CuMemUnmap, control::settings().context == Context::All),
    };
    send(rec, event(kind, api, -1, addr, size, handle, 0), with_stack);
}

/// Out of memory: record the request with free memory and the stack, and if this OOM
/// starts a new episode, wait until the writer has written the snapshot.
#[cold]
#[inline(never)]
fn out_of_memory(api: Api, size: u64, stream: u64) {
    let Some(rec) = control::recorder() else {
        return;
    };
    let device = hooks::current_device();
    let free = hooks::device_free_bytes();
    let ticket = control::oom_dump_ticket();
    // addr carries the dump ticket (0: recorded, no dump), aux the free bytes (-1: unknown).
    send(
        rec,
        event(Kind::Oom, api, device, ticket, size, free as u64, stream),
        true,
    );
    if ticket != 0 {
        control::wait_for_oom_dump(ticket);
    }
}

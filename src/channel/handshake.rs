//! The state the hook side and the writer thread share besides the queue: requests for
//! snapshots (exit, exec, `memsnap_dump`, the dump signal, a crash signal, out-of-memory), route counters and
//! device totals, and the clock both sides stamp with. One place, so that the writer never
//! has to reach into the hook side (the rest it reads, the module table and the interpreter,
//! is process-wide state in `process/`).
//!
//! Requests never wait in the event queue, however full it is: the asking thread raises a
//! flag or takes a ticket here and wakes the writer, which first applies every event that
//! was queued when it saw the request (so the snapshot holds everything the asking thread
//! did before asking), then writes the snapshot and completes the request.
//!
//! Hot only in the route counters (relaxed atomics; events are stamped by
//! `process::clock`). Waiting for a dump is cold (a thread that asked for a snapshot sleeps
//! in 1 ms steps until the writer says it is on disk).

use crate::process::clock::wall_micros;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering::*};

/// A request that a writer completes: the asking side takes a ticket, the writer raises
/// `done` to the ticket once the snapshot is written (or given up on).
pub struct DumpRequests {
    asked: AtomicU64,
    done: AtomicU64,
}

impl DumpRequests {
    pub const fn new() -> DumpRequests {
        DumpRequests {
            asked: AtomicU64::new(0),
            done: AtomicU64::new(0),
        }
    }
    /// A new ticket (1, 2, ...).
    pub fn ask(&self) -> u64 {
        self.asked.fetch_add(1, AcqRel) + 1
    }
    /// The newest ticket handed out (0: none yet).
    pub fn asked(&self) -> u64 {
        self.asked.load(Acquire)
    }
    /// Writer side: every ticket up to `ticket` is done.
    pub fn complete(&self, ticket: u64) {
        self.done.fetch_max(ticket, AcqRel);
    }
    pub fn is_done(&self, ticket: u64) -> bool {
        self.done.load(Acquire) >= ticket
    }
    /// In a forked child: the parent's tickets are not the child's to serve.
    pub fn forget_pending(&self) {
        self.done.store(self.asked.load(Relaxed), Relaxed);
    }
    /// Writer side: the tickets asked for and not done yet, oldest first.
    pub fn pending(&self) -> std::ops::RangeInclusive<u64> {
        self.done.load(Acquire) + 1..=self.asked.load(Acquire)
    }
}

impl Default for DumpRequests {
    fn default() -> Self {
        Self::new()
    }
}

/// Out-of-memory snapshots asked for by failing calls (the ticket travels in the event).
pub static OOM_DUMPS: DumpRequests = DumpRequests::new();
/// One `memsnap_dump(tag)` call: the tag it asked with, and the file the writer wrote for
/// it (absolute; `None` until written, or when the write failed).
pub struct ApiDump {
    pub tag: String,
    pub path: Option<PathBuf>,
}

/// The `memsnap_dump` calls so far: ticket N's is at index N - 1. A ticket is taken under
/// this lock, so tickets and entries stay in step. Cold: taken by the C API and by the
/// writer, never by a hook.
pub static API_DUMP_LOG: Mutex<Vec<ApiDump>> = Mutex::new(Vec::new());
/// `memsnap_dump(tag)` calls.
pub static API_DUMPS: DumpRequests = DumpRequests::new();
/// The dump signal: each signal takes a ticket (async-signal-safe); one snapshot completes
/// every ticket taken before the writer looked, and the writer writes at most one such
/// snapshot a second (`writer::requests`), so a storm of signals becomes a few snapshots
/// and the count of signals stays exact.
pub static SIGNAL_DUMPS: DumpRequests = DumpRequests::new();

/// A signal that ends the job (SIGTERM, SIGABRT, SIGSEGV, SIGBUS): the first one asks for
/// a `term` or `crash` snapshot. Its fields are written before the ticket is taken and read
/// by the writer after it sees the ticket.
pub struct CrashRequest {
    pub dumps: DumpRequests,
    pub signal: AtomicI32,
    /// `si_code`: > 0 raised by the kernel for a fault, <= 0 sent by a process.
    pub code: AtomicI32,
    /// The sending process for a sent signal, else 0.
    pub sender: AtomicI32,
    pub tid: AtomicU32,
    pub time_us: AtomicU64,
    /// Whether the recorder's crash slot holds the signalled thread's stack.
    pub with_stack: AtomicBool,
}

impl CrashRequest {
    /// Async-signal-safe. Returns the ticket to wait for.
    pub fn ask(&self, signal: i32, code: i32, sender: i32, tid: u32, with_stack: bool) -> u64 {
        self.signal.store(signal, Relaxed);
        self.code.store(code, Relaxed);
        self.sender.store(sender, Relaxed);
        self.tid.store(tid, Relaxed);
        self.time_us.store(wall_micros(), Relaxed);
        self.with_stack.store(with_stack, Relaxed);
        self.dumps.ask()
    }
}

pub static CRASH: CrashRequest = CrashRequest {
    dumps: DumpRequests::new(),
    signal: AtomicI32::new(0),
    code: AtomicI32::new(0),
    sender: AtomicI32::new(0),
    tid: AtomicU32::new(0),
    time_us: AtomicU64::new(0),
    with_stack: AtomicBool::new(false),
};
/// The exec hooks (`lifecycle::exec`): the program is about to replace its image; an `exec`
/// snapshot holds everything recorded so far. Recording goes on (an exec that fails returns
/// to a program still recorded).
pub static EXEC_DUMPS: DumpRequests = DumpRequests::new();
/// A thread about to free what recorded events may name (a Python code object, a library it
/// unloads) asks the writer to read every event published so far first
/// (`Recorder::wait_until_read`); the writer completes the ticket once it has taken and
/// interned them all.
pub static READ_REQUESTS: DumpRequests = DumpRequests::new();
/// Set by the exit handler: write the exit snapshot and stop.
pub static EXIT_REQUESTED: AtomicBool = AtomicBool::new(false);
/// Set by the writer once the exit snapshot is written (or the writer is gone).
pub static EXIT_DONE: AtomicBool = AtomicBool::new(false);

/// How often each lookup route handed out a wrapper (reported in every snapshot).
pub struct RouteCounters {
    pub dlsym: AtomicU64,
    pub get_proc_address: AtomicU64,
    pub driver_entry_point: AtomicU64,
}
pub static ROUTED: RouteCounters = RouteCounters {
    dlsym: AtomicU64::new(0),
    get_proc_address: AtomicU64::new(0),
    driver_entry_point: AtomicU64::new(0),
};

/// Device ordinals with a remembered total.
pub const MAX_DEVICES: usize = 64;
static DEVICE_TOTAL: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];

/// The slot for device `d`'s total bytes (0 = not known yet), if `d` is in range.
#[inline]
pub fn device_total_slot(device: i32) -> Option<&'static AtomicU64> {
    usize::try_from(device)
        .ok()
        .and_then(|d| DEVICE_TOTAL.get(d))
}

/// Total bytes of device `d` as seen by its first allocation, 0 if unknown.
pub fn device_total(d: usize) -> u64 {
    DEVICE_TOTAL.get(d).map_or(0, |t| t.load(Relaxed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ticket_is_done_once_the_writer_reaches_it() {
        let r = DumpRequests::new();
        let (a, b) = (r.ask(), r.ask());
        assert_eq!((a, b), (1, 2));
        assert!(!r.is_done(a));
        r.complete(a);
        assert!(r.is_done(a) && !r.is_done(b));
        r.complete(b);
        r.complete(a); // never goes back
        assert!(r.is_done(b));
    }
}

//! Serving what the program asks for outside the event queue: exit, exec, `memsnap_dump`,
//! the dump signal, a signal that ends the job (the `term`/`crash` snapshot), and `memsnap top`'s
//! requests over the live socket.
//!
//! Cold (writer thread). Each request first applies every event queued when it was seen,
//! so the snapshot holds all that the asking thread did before it asked. The requests
//! themselves travel through `channel::handshake`.
//!
//! Dump requests from outside the program (the dump signal, the socket's dump requests)
//! are held to a floor: after a snapshot served from them, the next one is written
//! [`REQUEST_FLOOR`] later at the earliest, and every request that arrives meanwhile waits
//! for it and shares it (docs/SIGNALS.md, "Floods"). Exit, exec, out-of-memory, crash,
//! step, period and `memsnap_dump` snapshots are not held.

use super::files::Reason;
use super::meta::CrashInfo;
use super::{Flow, Writer, absolute, dump};
use crate::channel::event::Api;
use crate::channel::handshake::{
    API_DUMP_LOG, API_DUMPS, CRASH, EXEC_DUMPS, EXIT_DONE, EXIT_REQUESTED, SIGNAL_DUMPS,
};
use crate::snapshot::live::{self as live_protocol, Answer, Request, Sample};
use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::sync::atomic::Ordering::*;
use std::time::{Duration, Instant};

/// The least time between the end of a snapshot served from dump requests and the start of
/// the next. A second: a person or a script asking again sees a new file within about a
/// second, and a flood (a loop of `kill -USR1`, clients that ask and leave) costs the job
/// at most one snapshot a second, however fast it comes (docs/SIGNALS.md, "Floods").
pub(super) const REQUEST_FLOOR: Duration = Duration::from_secs(1);
/// Socket clients that asked for a dump and wait for it, at most (each holds one of the
/// program's descriptors until answered). The request of one more is merged into the next
/// snapshot all the same, but its connection is closed at once, without an answer.
const MAX_WAITING_DUMPS: usize = 64;

/// How long a request is served before the writer looks at whether it is starved.
const STARVED_AFTER: Duration = Duration::from_millis(5);

/// A request being served (from when the writer saw it to when its snapshot is written),
/// and whether the lanes are held for it. The writer holds the lanes (`Lanes::hold`: the
/// allocating threads wait, off the processors) only when it is starved, as when 64
/// threads allocate on two cores: at once when its last busy pass ran for less than half
/// its time, else once serving has lasted [`STARVED_AFTER`] and the writer ran for less
/// than half of it. Where the writer has a processor of its own, nobody waits
/// (docs/SIGNALS.md, "Many threads").
#[derive(Default)]
pub(super) struct Serving {
    /// When serving began, and the writer thread's processor time then.
    since: Option<CpuWatch>,
    /// Whether the writer holds the lanes (one hold of its own, ended by `end_serving`).
    holding: bool,
    /// Whether the last pass was busy: the next one is measured.
    last_pass_busy: bool,
    /// Whether the writer's last measured busy pass (one that applied at least a
    /// [`super::REQUEST_LOOK`] of events, right after another) ran for less than half
    /// its time; false again after a pass that found little to do.
    starved: bool,
}

/// A pass of the writer's loop being measured (see [`Serving::pass_begins`]).
pub(super) struct PassStart(Option<CpuWatch>);

impl Serving {
    /// A pass of the writer's loop begins: measured only after a busy pass (an idle
    /// writer does not pay for the clock's system call).
    pub(super) fn pass_begins(&self) -> PassStart {
        PassStart(self.last_pass_busy.then(CpuWatch::start))
    }

    /// The pass begun at `start` ended, busy or not; returns whether the writer is starved.
    pub(super) fn pass_ends(&mut self, start: PassStart, busy: bool) -> bool {
        if !busy {
            self.starved = false;
        } else if let PassStart(Some(watch)) = start {
            self.starved = watch.ran_under_half();
        }
        self.last_pass_busy = busy;
        self.starved
    }
}

/// Wall-clock time and the calling thread's processor time since a start.
#[derive(Clone, Copy)]
struct CpuWatch {
    began: Instant,
    cpu_then: Duration,
}

impl CpuWatch {
    fn start() -> CpuWatch {
        CpuWatch {
            began: Instant::now(),
            cpu_then: thread_cpu_time(),
        }
    }

    /// Whether the thread ran for less than half the time since the start (a system call).
    fn ran_under_half(&self) -> bool {
        thread_cpu_time().saturating_sub(self.cpu_then) * 2 < self.began.elapsed()
    }
}

/// The calling thread's processor time.
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid clock id and a timespec of our own to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

impl Writer {
    /// A request is being served (see [`Serving`]); false when one was already.
    pub(super) fn begin_serving(&mut self) -> bool {
        if self.serving.since.is_some() {
            return false;
        }
        self.serving.since = Some(CpuWatch::start());
        if self.serving.starved {
            self.hold_lanes();
        }
        true
    }

    /// Holds the lanes if a request is being served and the writer is starved. Cheap
    /// enough to call every few dozen events: a clock read while serving, and the thread's
    /// processor time (a system call) only past [`STARVED_AFTER`] and until it holds.
    pub(super) fn hold_if_starved(&mut self) {
        let Some(watch) = self.serving.since else {
            return;
        };
        if watch.began.elapsed() >= STARVED_AFTER && !self.serving.holding && watch.ran_under_half()
        {
            self.hold_lanes();
        }
    }

    /// Whether a request waits that would be served now (the dump signal only once the
    /// floor allows). Looked at between events: a request waits for the events queued
    /// before it, not for a whole batch of the writer's.
    pub(super) fn request_waiting(&self) -> bool {
        EXIT_REQUESTED.load(Relaxed)
            || !CRASH.dumps.pending().is_empty()
            || !API_DUMPS.pending().is_empty()
            || !EXEC_DUMPS.pending().is_empty()
            || (!SIGNAL_DUMPS.pending().is_empty()
                && self
                    .held
                    .floor_until
                    .is_none_or(|until| Instant::now() >= until))
    }

    /// The request's snapshot is written (or it needed none): the threads go on.
    pub(super) fn end_serving(&mut self) {
        self.serving.since = None;
        if std::mem::take(&mut self.serving.holding) {
            self.rec.let_lanes_go();
        }
    }

    fn hold_lanes(&mut self) {
        if !self.serving.holding {
            self.serving.holding = true;
            self.rec.hold_lanes();
            // Threads that wait for this snapshot hold too, until they have it: let go
            // when it is written, they would wait their turn behind every other thread.
            self.rec.note_writer_starved(true);
        }
    }
}

/// The dump requests from outside the program that wait for the next request snapshot.
#[derive(Default)]
pub(super) struct HeldRequests {
    /// Socket clients waiting for the path.
    waiting: Vec<u64>,
    /// Socket requests waiting, those whose client left included.
    socket: u64,
    /// When the next request snapshot may be written; `None` before the first.
    floor_until: Option<Instant>,
}

impl Writer {
    /// Requests that do not travel in the queue (docs: `channel::handshake`): exit, exec,
    /// `memsnap_dump`, the dump signal. Each first applies every event queued when the
    /// request was seen, so the snapshot holds all that the asking thread did before.
    pub(super) fn serve_requests(&mut self) -> Flow {
        let exit = EXIT_REQUESTED.load(Acquire);
        let crash = CRASH.dumps.pending();
        let signals = SIGNAL_DUMPS.pending();
        let dumps = API_DUMPS.pending();
        let exec = EXEC_DUMPS.pending();
        if !signals.is_empty() {
            // Acknowledged before anything else, so `memsnap dump` knows at once (written
            // once per new signal, not once per pass while it waits for the floor).
            self.ack.received(*signals.end());
        }
        if !exit && crash.is_empty() && dumps.is_empty() && exec.is_empty() {
            // Dump signals are served with the socket's dump requests (`serve_live`).
            return Flow::Continue;
        }
        let _ = self.begin_serving();
        if let Flow::Exit = self.apply_queued() {
            self.end_serving();
            return Flow::Exit;
        }
        if !crash.is_empty() {
            // The job is ending: its snapshot comes first.
            self.crash_snapshot();
            CRASH.dumps.complete(*crash.end());
        }
        for ticket in dumps {
            let index = ticket as usize - 1;
            let tag = API_DUMP_LOG
                .lock()
                .ok()
                .and_then(|log| log.get(index).map(|d| d.tag.clone()))
                .unwrap_or_default();
            // Absolute, so the caller gets a path that holds whatever its working directory.
            let path = self
                .dump(Reason::Api, &tag)
                .ok()
                .map(|p| std::path::absolute(&p).unwrap_or(p));
            if let Some(entry) = API_DUMP_LOG
                .lock()
                .ok()
                .as_mut()
                .and_then(|l| l.get_mut(index))
            {
                entry.path = path;
            }
            API_DUMPS.complete(ticket);
        }
        if !exec.is_empty() {
            // The image is about to be replaced, with no exit of its own: this snapshot stands
            // in for its exit snapshot (and, like it, is off with MEMSNAP_AT_EXIT=0), and the
            // exit's stats row and line are written now, which the image's exit never will.
            // One file serves every thread that asked meanwhile.
            if self.at_exit.snapshot {
                let _ = self.dump(Reason::Exec, "");
            }
            self.write_stats(Reason::Exec);
            self.report_at_exit();
            EXEC_DUMPS.complete(*exec.end());
        }
        if exit {
            // Dump requests still held by the floor get their snapshot now, floor or not:
            // there is no later one (and `memsnap dump` looks for a `signal` file of a
            // process that ended before it could read the answer).
            let signals = SIGNAL_DUMPS.pending();
            if !signals.is_empty() || self.held.socket > 0 {
                let written = self.dump(Reason::Signal, "");
                self.answer_held(signals, written);
            }
            if self.at_exit.snapshot {
                let _ = self.dump(Reason::Exit, "");
            }
            self.write_stats(Reason::Exit);
            if let Some(uploader) = &mut self.uploader {
                uploader.finish();
            }
            self.end_serving();
            self.report_at_exit();
            self.ack.remove();
            self.live.close();
            EXIT_DONE.store(true, Release);
            return Flow::Exit;
        }
        self.end_serving();
        Flow::Continue
    }

    /// The `term` or `crash` snapshot: the signal, with the signalled thread's stack, is
    /// its last trace entry (a `snapshot` action, which PyTorch's viewer shows as a marker).
    pub(super) fn crash_snapshot(&mut self) {
        let info = CrashInfo::asked();
        let stack = if CRASH.with_stack.load(Relaxed) {
            self.stacks.intern(self.rec.crash_slot())
        } else {
            None
        };
        self.state
            .marker(CRASH.time_us.load(Relaxed), stack, Api::Memsnap);
        self.crash = Some(info);
        let _ = self.dump(info.reason(), "");
    }

    /// `memsnap top` and `memsnap dump`: answers the requests that arrived in full, from
    /// the state after every event queued so far. Never waits on a client (docs/LIVE.md).
    /// Samples are answered in this pass, before any snapshot is written, so `memsnap top`
    /// is served whatever else asks. Dump requests join the dump signals that wait for the
    /// next request snapshot, which is written once the floor allows
    /// ([`Writer::serve_held_requests`]).
    pub(super) fn serve_live(&mut self) {
        let mut applied = false;
        for a in self.live.poll() {
            match a.request {
                Request::Sample {
                    known_frames,
                    known_stacks,
                } => {
                    if !applied {
                        // Everything the program did before it was asked is in the answer;
                        // `apply` never ends the loop, so the flow is always `Continue`.
                        let _ = self.apply_queued();
                        applied = true;
                    }
                    let answer = Answer::Sample(self.sample(known_frames, known_stacks));
                    self.live.answer(a.client, live_protocol::encode(&answer));
                }
                Request::Dump => {
                    self.held.socket += 1;
                    if a.gone {
                        // Counted: it is served by the next snapshot, with nobody to tell.
                    } else if self.held.waiting.len() < MAX_WAITING_DUMPS {
                        self.held.waiting.push(a.client);
                    } else {
                        // Served by the next snapshot all the same, but not worth one more
                        // of the program's descriptors: closed without an answer.
                        self.live.close_client(a.client);
                    }
                }
            }
        }
        self.serve_held_requests();
    }

    /// The next request snapshot, once the floor allows it: one `signal` snapshot serves
    /// every dump signal and socket dump request that waits.
    fn serve_held_requests(&mut self) {
        let signals = SIGNAL_DUMPS.pending();
        if signals.is_empty() && self.held.socket == 0 {
            return;
        }
        if self
            .held
            .floor_until
            .is_some_and(|until| Instant::now() < until)
        {
            return;
        }
        // What the program did before it asked is in the snapshot (see `serve_live`).
        let _ = self.begin_serving();
        let _ = self.apply_queued();
        let written = self.dump(Reason::Signal, "");
        self.end_serving();
        self.held.floor_until = Some(Instant::now() + REQUEST_FLOOR);
        self.answer_held(signals, written);
    }

    /// Tells the held requests which file served them: the acknowledgement file for the
    /// signals `signals`, an answer for each waiting socket client.
    fn answer_held(&mut self, signals: RangeInclusive<u64>, written: Result<PathBuf, String>) {
        let served_signals = if signals.is_empty() {
            0
        } else {
            signals.end() - signals.start() + 1
        };
        let requests = served_signals + self.held.socket;
        if !signals.is_empty() {
            self.ack.served(*signals.end(), &written, requests);
            SIGNAL_DUMPS.complete(*signals.end());
        }
        let answer = live_protocol::encode(&match written {
            Ok(path) => Answer::Dumped {
                path: absolute(&path).display().to_string(),
                requests,
            },
            Err(reason) => Answer::Failed { reason },
        });
        for client in std::mem::take(&mut self.held.waiting) {
            self.live.answer(client, answer.clone());
        }
        self.held.socket = 0;
    }

    /// What is live now, with the counters `memsnap top` shows.
    pub(super) fn sample(&mut self, known_frames: u32, known_stacks: u32) -> Sample {
        let c = &self.rec.counters;
        let mut sample = dump::live_sample(
            &self.state,
            &mut self.stacks,
            &mut self.interner,
            known_frames,
            known_stacks,
        );
        sample.version = live_protocol::PROTOCOL_VERSION;
        sample.pid = self.id.pid;
        sample.time_us = crate::process::clock::wall_micros();
        sample.step = self.window.step();
        sample.events_recorded = c.applied.load(Relaxed);
        sample.dropped_events = c.lost_total();
        sample.events_without_stack = self.events_without_stack();
        sample.last_oom = self.last_oom.clone();
        sample
    }
}

//! Serving what the program asks for outside the event queue: exit, `memsnap_dump`, the
//! dump signal, a signal that ends the job (the `term`/`crash` snapshot), and `memsnap top`'s
//! requests over the live socket.
//!
//! Cold (writer thread). Each request first applies every event queued when it was seen,
//! so the snapshot holds all that the asking thread did before it asked. The requests
//! themselves travel through `channel::handshake`.

use super::files::Reason;
use super::{CrashInfo, Flow, Writer, absolute, dump};
use crate::channel::event::Api;
use crate::channel::handshake::{
    API_DUMP_LOG, API_DUMPS, CRASH, EXIT_DONE, EXIT_REQUESTED, SIGNAL_DUMPS,
};
use crate::snapshot::live::{self as live_protocol, Answer, Request, Sample};
use std::sync::atomic::Ordering::*;

impl Writer {
    /// Requests that do not travel in the queue (docs: `channel::handshake`): exit,
    /// `memsnap_dump`, the dump signal. Each first applies every event queued when the
    /// request was seen, so the snapshot holds all that the asking thread did before.
    pub(super) fn serve_requests(&mut self) -> Flow {
        let exit = EXIT_REQUESTED.load(Acquire);
        let crash = CRASH.dumps.pending();
        let signals = SIGNAL_DUMPS.pending();
        let dumps = API_DUMPS.pending();
        if !exit && crash.is_empty() && signals.is_empty() && dumps.is_empty() {
            return Flow::Continue;
        }
        if !signals.is_empty() {
            // Acknowledged before anything else, so `memsnap dump` knows at once.
            self.ack.received(*signals.end());
        }
        if let Flow::Exit = self.apply_queued() {
            return Flow::Exit;
        }
        if !crash.is_empty() {
            // The job is ending: its snapshot comes first.
            self.crash_snapshot();
            CRASH.dumps.complete(*crash.end());
        }
        if !signals.is_empty() {
            let written = self.dump(Reason::Signal, "");
            self.ack.served(*signals.end(), &written);
            SIGNAL_DUMPS.complete(*signals.end());
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
        if exit {
            if self.cfg.at_exit {
                let _ = self.dump(Reason::Exit, "");
            }
            self.write_stats(Reason::Exit);
            if let Some(uploader) = &mut self.uploader {
                uploader.finish(self.cfg.remote_wait);
            }
            self.report_at_exit();
            self.ack.remove();
            self.live.close();
            EXIT_DONE.store(true, Release);
            return Flow::Exit;
        }
        Flow::Continue
    }

    /// The `term` or `crash` snapshot: the signal, with the signalled thread's stack, is
    /// its last trace entry (a `snapshot` action, which PyTorch's viewer shows as a marker).
    pub(super) fn crash_snapshot(&mut self) {
        let info = CrashInfo {
            signal: CRASH.signal.load(Acquire),
            code: CRASH.code.load(Relaxed),
            sender: CRASH.sender.load(Relaxed),
            tid: CRASH.tid.load(Relaxed),
        };
        let stack = if CRASH.with_stack.load(Relaxed) {
            self.stacks.intern(self.rec.crash_slot())
        } else {
            None
        };
        self.state
            .marker(CRASH.time_us.load(Relaxed), stack, Api::Memsnap);
        self.crash = Some(info);
        // Sent to stop the job (a scheduler, a person at the terminal) or raised by a crash.
        let reason = match info.signal {
            libc::SIGTERM | libc::SIGINT | libc::SIGHUP | libc::SIGQUIT => Reason::Term,
            _ => Reason::Crash,
        };
        let _ = self.dump(reason, "");
    }

    /// `memsnap top` and `memsnap dump`: answers the requests that arrived in full, from
    /// the state after every event queued so far. Never waits on a client (docs/LIVE.md).
    /// Every dump request read in this pass (those that arrived while the last snapshot
    /// was being written, say) and every dump signal not yet served share one snapshot, as
    /// signals always have: a flood of requests costs a few snapshots, not one each.
    pub(super) fn serve_live(&mut self) {
        let asked = self.live.poll();
        if asked.is_empty() {
            return;
        }
        // Everything the program did before it was asked is in the answer; `apply` never
        // ends the loop, so the flow is always `Continue` here.
        let _ = self.apply_queued();
        let mut dumped: Option<Answer> = None;
        for a in asked {
            let answer = match a.request {
                Request::Sample {
                    known_frames,
                    known_stacks,
                } => Answer::Sample(self.sample(known_frames, known_stacks)),
                Request::Dump => dumped.get_or_insert_with(|| self.merged_dump()).clone(),
            };
            self.live.answer(a.client, live_protocol::encode(&answer));
        }
    }

    /// One `signal` snapshot for the socket's dump requests of this pass, serving the dump
    /// signals that are waiting too.
    fn merged_dump(&mut self) -> Answer {
        let signals = SIGNAL_DUMPS.pending();
        if !signals.is_empty() {
            self.ack.received(*signals.end());
        }
        let written = self.dump(Reason::Signal, "");
        if !signals.is_empty() {
            self.ack.served(*signals.end(), &written);
            SIGNAL_DUMPS.complete(*signals.end());
        }
        match written {
            Ok(path) => Answer::Dumped {
                path: absolute(&path).display().to_string(),
            },
            Err(reason) => Answer::Failed { reason },
        }
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
        sample.step = self.step;
        sample.events_recorded = c.applied.load(Relaxed);
        sample.dropped_events = c.lost_total();
        sample.events_without_stack = self.events_without_stack();
        sample.last_oom = self.last_oom.clone();
        sample
    }
}

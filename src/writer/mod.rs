//! The writer thread: owns all recorded state, builds and writes snapshots.
//!
//! Cold. One thread, started on the first CUDA event. It drains the queue (polling with
//! a short adaptive sleep; hooks never wake it, so they make no syscall), applies events
//! to [`state::State`], interns stacks while their Python code objects are still alive,
//! and writes snapshots on exit, out-of-memory, the dump signal, steps, periods and
//! explicit `memsnap_dump` calls. It may allocate, lock and do I/O; a failure is a warning
//! on stderr, never the host's problem. A panic in here turns recording off.

pub mod ack;
#[cfg(feature = "bench-hooks")]
pub mod drain_bench;
pub mod dump;
pub mod files;
pub mod live;
pub mod stacks;
pub mod state;
pub mod stats;
pub mod upload;

use crate::channel::event::{Api, Event, Kind, Payload, StackRef};
use crate::channel::handshake::{
    self, API_DUMP_LOG, API_DUMPS, CRASH, EXIT_DONE, EXIT_REQUESTED, OOM_DUMPS, ROUTED,
    SIGNAL_DUMPS,
};
use crate::channel::queue::Recorder;
use crate::config::Config;
use crate::snapshot::live::{self as live_protocol, Answer, OomSample, Request, Sample};
use crate::snapshot::model::Meta;
use crate::snapshot::pickle_write;
use dump::{FrameInterner, meta_int, meta_str};
use files::{Identity, NameFields, Reason};
use stacks::StackTable;
use state::{Live, State};
use std::io::{self, Write};
use std::path::PathBuf;
use std::sync::atomic::Ordering::*;
use std::time::{Duration, Instant};

/// The writer thread's body: drains the channel and writes snapshots until exit. Catches
/// its own panics (a bug in here must never take the program down); when it returns, the
/// writer is gone and the channel says so.
pub fn run(rec: &'static Recorder, cfg: Config) {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Writer::new(rec, cfg).run();
    }));
    if outcome.is_err() {
        eprintln!("memsnap: internal error in the writer thread; recording is off");
    }
    rec.writer_alive.store(false, Release);
    EXIT_DONE.store(true, Release);
}

/// Longest idle sleep between queue polls.
const MAX_IDLE: Duration = Duration::from_millis(5);
/// Longest stretch spent symbolizing new stacks before the queue is looked at again.
const SYMBOLIZE_BUDGET: Duration = Duration::from_micros(500);
/// Events applied between checks of the signal flag and timers.
const BATCH: usize = 8192;
/// How often the writer looks for newly loaded libraries for the native unwinder.
const MODULE_REFRESH: Duration = Duration::from_millis(100);
/// Write-failure warnings printed before going quiet.
const MAX_WRITE_WARNINGS: u32 = 3;

struct Writer {
    rec: &'static Recorder,
    cfg: Config,
    state: State,
    stacks: StackTable,
    interner: FrameInterner,
    id: Identity,
    seq: u64,
    step: u64,
    written: Vec<PathBuf>,
    /// Folders memsnap created (absolute), named in the exit line.
    created_folders: Vec<PathBuf>,
    /// Per-device event index where the current recording window began.
    window_from: Option<Vec<u64>>,
    last_period: Instant,
    last_refresh: Instant,
    api_counts: [u64; Api::ALL.len()],
    write_warnings: u32,
    stats: Option<stats::Stats>,
    /// What `memsnap dump` reads to learn that its signal arrived and how it ended.
    ack: ack::AckFile,
    /// The signal that ends the job, once its snapshot was asked for.
    crash: Option<CrashInfo>,
    /// Copies to `MEMSNAP_REMOTE`; `None` when it is unset.
    uploader: Option<upload::Uploader>,
    /// The socket `memsnap top` asks through.
    live: live::LiveServer,
    /// The most recent out-of-memory error, for `memsnap top`.
    last_oom: Option<OomSample>,
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGTERM => "SIGTERM",
        libc::SIGABRT => "SIGABRT",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        _ => "other",
    }
}

/// `path` made absolute against the working directory (left as is if that fails).
fn absolute(path: &std::path::Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// The signal behind a `term` or `crash` snapshot, for its metadata.
#[derive(Clone, Copy)]
struct CrashInfo {
    signal: i32,
    code: i32,
    sender: i32,
    tid: u32,
}

enum Flow {
    Continue,
    Exit,
}

impl Writer {
    fn new(rec: &'static Recorder, cfg: Config) -> Writer {
        let id = Identity::current();
        let id_pid = id.pid;
        let stats = cfg.stats.as_ref().map(|t| stats::Stats::new(t, &id));
        Writer {
            rec,
            state: State::new(cfg.max_entries),
            stacks: StackTable::new(&cfg),
            interner: FrameInterner::default(),
            id,
            seq: 0,
            step: 0,
            written: Vec::new(),
            created_folders: Vec::new(),
            window_from: None,
            last_period: Instant::now(),
            last_refresh: Instant::now(),
            api_counts: [0; Api::ALL.len()],
            write_warnings: 0,
            ack: ack::AckFile::new(id_pid),
            crash: None,
            uploader: cfg
                .remote
                .as_ref()
                .map(|_| upload::Uploader::new(cfg.remote_only)),
            live: live::LiveServer::open(id_pid),
            last_oom: None,
            stats,
            cfg,
        }
    }

    fn run(&mut self) {
        let mut idle = Duration::from_micros(100);
        if self.cfg.skip == 0 && self.cfg.interval > 0 {
            self.window_from = Some(self.history_marks());
        }
        loop {
            let mut applied = 0;
            while applied < BATCH {
                let Some(ev) = self.rec.pop() else { break };
                applied += 1;
                if let Flow::Exit = self.apply(ev) {
                    return;
                }
            }
            self.maintain_stacks();
            if let Flow::Exit = self.serve_requests() {
                return;
            }
            self.serve_live();
            if let Some(period) = self.cfg.period
                && self.last_period.elapsed() >= period
            {
                self.last_period = Instant::now();
                let _ = self.dump(Reason::Period, "");
                self.write_stats(Reason::Period);
            }
            if applied < BATCH && self.stacks.symbolize_some(SYMBOLIZE_BUDGET) {
                // Names still to take: no sleep, the queue is checked again right away.
                idle = Duration::from_micros(100);
                continue;
            }
            if applied == 0 {
                self.sleep(idle);
                idle = (idle * 2).min(MAX_IDLE);
            } else {
                idle = Duration::from_micros(100);
            }
        }
    }

    /// Waits for the wake-up eventfd, a `memsnap top` client, or the timeout.
    fn sleep(&mut self, timeout: Duration) {
        let wake_fd = self.rec.wake_fd();
        let mut fds = Vec::with_capacity(4);
        if wake_fd >= 0 {
            fds.push(libc::pollfd {
                fd: wake_fd,
                events: libc::POLLIN,
                revents: 0,
            });
        }
        self.live.poll_fds(&mut fds);
        if fds.is_empty() {
            std::thread::sleep(timeout);
            return;
        }
        let ms = timeout.as_millis().max(1) as i32;
        // SAFETY: `fds` holds fds.len() valid pollfds.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if ready > 0 && wake_fd >= 0 && fds[0].revents != 0 {
            let mut buf = 0u64;
            // SAFETY: draining our nonblocking eventfd into a local.
            unsafe { libc::read(wake_fd, (&mut buf as *mut u64).cast(), 8) };
        }
        if ready > 0 {
            self.live.after_poll(&fds);
        }
    }

    /// `memsnap top`: answers the requests that arrived in full, from the state after every
    /// event queued so far. Never waits on a client (docs/LIVE.md).
    fn serve_live(&mut self) {
        let asked = self.live.poll();
        if asked.is_empty() {
            return;
        }
        // Everything the program did before it was asked is in the answer; `apply` never
        // ends the loop, so the flow is always `Continue` here.
        let _ = self.apply_queued();
        for a in asked {
            let answer = match a.request {
                Request::Sample {
                    known_frames,
                    known_stacks,
                } => Answer::Sample(self.sample(known_frames, known_stacks)),
                Request::Dump => match self.dump(Reason::Signal, "") {
                    Ok(path) => Answer::Dumped {
                        path: absolute(&path).display().to_string(),
                    },
                    Err(reason) => Answer::Failed { reason },
                },
            };
            self.live.answer(a.client, live_protocol::encode(&answer));
        }
    }

    /// What is live now, with the counters `memsnap top` shows.
    fn sample(&mut self, known_frames: u32, known_stacks: u32) -> Sample {
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
        sample.time_us = handshake::now_us();
        sample.step = self.step;
        sample.events_recorded = c.pushed.load(Relaxed);
        sample.dropped_events = c.lost_total();
        sample.events_without_stack = self.events_without_stack();
        sample.last_oom = self.last_oom.clone();
        sample
    }

    /// Events recorded without the stack they should have had.
    fn events_without_stack(&self) -> u64 {
        self.rec.counters.lost_stacks.load(Relaxed) + self.stacks.unknown_references
    }

    fn take_stack(&mut self, ev: &Event) -> Option<stacks::RawStackId> {
        match ev.stack {
            StackRef::None => None,
            StackRef::Slot { index, hash } => {
                let id = self
                    .rec
                    .slot(index)
                    .and_then(|slot| self.stacks.sent_in_full(slot, hash));
                self.rec.release_slot(index);
                id
            }
            StackRef::Sent { hash } => self.stacks.sent_before(hash),
        }
    }

    /// Module table refresh (libraries loaded since) and one-time stack warnings.
    fn maintain_stacks(&mut self) {
        if self.last_refresh.elapsed() >= MODULE_REFRESH {
            self.last_refresh = Instant::now();
            self.stacks.refresh_modules();
        }
        for w in self.stacks.take_warnings() {
            eprintln!("memsnap: {w}");
        }
    }

    fn apply(&mut self, ev: Event) -> Flow {
        let stack = self.take_stack(&ev);
        if let Some(c) = self.api_counts.get_mut(ev.api as usize) {
            *c += 1;
        }
        let live = Live {
            size: ev.size,
            stream: ev.payload.stream(),
            api: ev.api,
            stack,
            time_us: ev.time_us,
            handle: 0,
        };
        match ev.kind {
            Kind::Alloc => self.state.alloc(ev.device, ev.addr, ev.size, live),
            Kind::AllocManaged => self.state.managed_alloc(ev.addr, live),
            Kind::Free => {
                let stream = ev.payload.stream();
                self.state.free(ev.addr, ev.api, stream, ev.time_us, stack)
            }
            Kind::MemCreate => self
                .state
                .mem_create(ev.payload.handle(), ev.size, ev.device),
            Kind::MemRelease => self.state.mem_release(ev.payload.handle()),
            Kind::Map => self.state.map(
                ev.addr,
                ev.size,
                Live {
                    handle: ev.payload.handle(),
                    stream: 0,
                    ..live
                },
            ),
            Kind::Unmap => self.state.unmap(ev.addr, ev.size, ev.time_us, stack),
            Kind::Reserve => self.state.reserve(ev.addr, ev.size),
            Kind::ReserveFree => self.state.reserve_free(ev.addr),
            Kind::Oom => {
                if let Payload::Oom {
                    free_bytes,
                    stream,
                    dump_ticket,
                } = ev.payload
                {
                    let free = free_bytes.map_or(-1, |b| b as i64);
                    let (device, size, time) = (ev.device, ev.size, ev.time_us);
                    self.state
                        .oom(device, size, free, stream, time, ev.api, stack);
                    self.last_oom = Some(OomSample {
                        device: device.max(0) as u32,
                        time_us: time,
                        requested_bytes: size,
                        device_free: free,
                    });
                    if dump_ticket != 0 {
                        let _ = self.dump(Reason::Oom, "");
                        OOM_DUMPS.complete(dump_ticket);
                    }
                }
            }
            Kind::Step => self.on_step(),
        }
        Flow::Continue
    }

    /// Requests that do not travel in the queue (docs: `channel::handshake`): exit,
    /// `memsnap_dump`, the dump signal. Each first applies every event queued when the
    /// request was seen, so the snapshot holds all that the asking thread did before.
    fn serve_requests(&mut self) -> Flow {
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
    fn crash_snapshot(&mut self) {
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
        let reason = if info.signal == libc::SIGTERM {
            Reason::Term
        } else {
            Reason::Crash
        };
        let _ = self.dump(reason, "");
    }

    /// Applies the events in the queue now (not those pushed while this runs).
    fn apply_queued(&mut self) -> Flow {
        for _ in 0..self.rec.queued() {
            let Some(ev) = self.rec.pop() else { break };
            if let Flow::Exit = self.apply(ev) {
                return Flow::Exit;
            }
        }
        Flow::Continue
    }

    fn history_marks(&self) -> Vec<u64> {
        self.state.devices.iter().map(|d| d.trace_total).collect()
    }

    /// `memsnap_step()`: the recording window (SKIP/INTERVAL), EVERY, and stats rows.
    fn on_step(&mut self) {
        self.step += 1;
        let (skip, interval) = (self.cfg.skip, self.cfg.interval);
        if interval > 0 {
            if self.step == skip {
                self.window_from = Some(self.history_marks());
            }
            if self.step == skip + interval {
                let _ = self.dump(Reason::Step, "");
                self.window_from = None;
            }
        }
        if self.cfg.every > 0
            && self.step.is_multiple_of(self.cfg.every)
            && !(interval > 0 && self.step == skip + interval)
        {
            // An EVERY snapshot keeps the full history even while a window is open: only
            // the window's own snapshot is cut to the window.
            let window = self.window_from.take();
            let _ = self.dump(Reason::Step, "");
            self.window_from = window;
        }
        self.write_stats(Reason::Step);
    }

    fn write_stats(&mut self, reason: Reason) {
        if let Some(stats) = &mut self.stats {
            stats.row(self.step, reason, &self.state);
            self.state.reset_peaks();
        }
    }

    /// Writes one snapshot; returns its path, or why it could not be written.
    fn dump(&mut self, reason: Reason, tag: &str) -> Result<PathBuf, String> {
        let window = if reason == Reason::Step {
            self.window_from.clone()
        } else {
            None
        };
        let mut snap = dump::build(
            &self.state,
            &mut self.stacks,
            &mut self.interner,
            window.as_deref(),
        );
        self.seq += 1;
        let now_s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let fields = NameFields {
            reason,
            seq: self.seq,
            step: self.step,
            tag,
            time_s: now_s,
        };
        snap.allocator_settings = self.allocator_settings();
        snap.memsnap = self.metadata(reason, tag);
        let bytes = pickle_write::to_bytes(&snap);
        let name = files::expand(&self.cfg.filename, &self.id, &fields);
        let result = files::folder(&self.cfg, &self.id, &fields).and_then(|dir| {
            if dir.created {
                self.created_folders.push(absolute(&dir.path));
            }
            files::write_atomic(&dir.path, &name, &bytes, self.cfg.overwrite)
        });
        match result {
            Ok(path) => {
                if let (Some(uploader), Some(remote)) = (&mut self.uploader, &self.cfg.remote) {
                    uploader.send(&path, &files::expand(remote, &self.id, &fields));
                }
                self.written.push(path.clone());
                Ok(path)
            }
            Err(e) => {
                self.write_warnings += 1;
                if self.write_warnings <= MAX_WRITE_WARNINGS {
                    eprintln!(
                        "memsnap: could not write the {} snapshot {name} in {}: {e}{}",
                        reason.as_str(),
                        self.cfg.folder,
                        if self.write_warnings == MAX_WRITE_WARNINGS {
                            " (further failures are silent)"
                        } else {
                            ""
                        }
                    );
                }
                Err(format!(
                    "could not write {name} in {}: {e}",
                    self.cfg.folder
                ))
            }
        }
    }

    fn allocator_settings(&self) -> Vec<(String, Meta)> {
        let overflowed = self.state.devices.iter().any(|d| d.trace_overflow > 0);
        vec![
            meta_str(
                "PYTORCH_CUDA_ALLOC_CONF",
                &std::env::var("PYTORCH_CUDA_ALLOC_CONF").unwrap_or_default(),
            ),
            (
                "trace_alloc_max_entries".to_string(),
                Meta::Int(self.cfg.max_entries as i64),
            ),
            ("trace_alloc_overflowed".to_string(), Meta::Bool(overflowed)),
            meta_str("recorder", "memsnap (CUDA driver/runtime interposer)"),
        ]
    }

    fn metadata(&self, reason: Reason, tag: &str) -> Vec<(String, Meta)> {
        let c = &self.rec.counters;
        let api_counts: Vec<(String, Meta)> = self
            .api_counts
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .filter_map(|(i, n)| api_name(i).map(|name| meta_int(name, *n)))
            .collect();
        let per_device: Vec<Meta> = self
            .state
            .devices
            .iter()
            .enumerate()
            .map(|(d, dev)| {
                Meta::Dict(vec![
                    meta_int("device", d as u64),
                    meta_int("live_bytes", dev.live_bytes),
                    meta_int(
                        "live_allocations",
                        (dev.allocs.len() + dev.mappings.len()) as u64,
                    ),
                    meta_int("peak_bytes", dev.peak_ever),
                    meta_int("vmm_physical_bytes", dev.physical_bytes),
                    meta_int("events", dev.events),
                    meta_int("ooms", dev.ooms),
                    meta_int("history_dropped", dev.trace_overflow),
                ])
            })
            .collect();
        let mut meta = vec![
            meta_str("version", env!("CARGO_PKG_VERSION")),
            meta_int("pid", self.id.pid as u64),
            meta_str("rank", &self.id.rank),
            meta_str("local_rank", &self.id.local_rank),
            meta_str("host", &self.id.host),
            meta_str("exe", &self.id.exe),
            meta_str("reason", reason.as_str()),
            meta_str("tag", tag),
            meta_int("seq", self.seq),
            meta_int("step", self.step),
            meta_int("time_us", handshake::now_us()),
            meta_int("events_recorded", c.pushed.load(Relaxed)),
            // Lost only while the writer is gone; a snapshot written then has none to report,
            // so these are 0 in every file and exist for readers that check.
            meta_int("dropped_events", c.lost_total()),
            meta_int("dropped_allocs", c.lost_allocs.load(Relaxed)),
            meta_int("dropped_frees", c.lost_frees.load(Relaxed)),
            meta_int("events_without_stack", self.events_without_stack()),
            meta_int("stacks_sent_in_full", self.stacks.received_in_full),
            meta_int(
                "stacks_sent_by_reference",
                self.stacks.received_by_reference,
            ),
            meta_int(
                "ambiguous_stack_references",
                self.stacks.ambiguous_references,
            ),
            meta_int("hook_queue_waits", c.queue_waits.load(Relaxed)),
            meta_int("hook_slot_waits", c.slot_waits.load(Relaxed)),
            meta_int("unknown_frees", self.state.anomalies.unknown_frees),
            meta_int("unknown_unmaps", self.state.anomalies.unknown_unmaps),
            meta_int("repaired_overlaps", self.state.anomalies.repaired_overlaps),
            meta_int("managed_live_bytes", self.state.managed_bytes()),
            meta_int("managed_live_allocations", self.state.managed.len() as u64),
            meta_int("host_mapped_bytes", self.state.host_mappings.values().sum()),
            meta_int("reserved_va_bytes", self.state.reservations.values().sum()),
            meta_str("stacks", &format!("{:?}", self.cfg.stacks).to_lowercase()),
            (
                "routes".to_string(),
                Meta::Dict(vec![
                    meta_int("dlsym", ROUTED.dlsym.load(Relaxed)),
                    meta_int("cuGetProcAddress", ROUTED.get_proc_address.load(Relaxed)),
                    meta_int(
                        "cudaGetDriverEntryPoint",
                        ROUTED.driver_entry_point.load(Relaxed),
                    ),
                ]),
            ),
            meta_int("dump_signals_received", SIGNAL_DUMPS.asked()),
            ("api_calls".to_string(), Meta::Dict(api_counts)),
            ("devices".to_string(), Meta::List(per_device)),
        ];
        if let Some(c) = self.crash
            && matches!(reason, Reason::Term | Reason::Crash)
        {
            meta.push((
                "signal".to_string(),
                Meta::Dict(vec![
                    meta_int("number", c.signal as u64),
                    meta_str("name", signal_name(c.signal)),
                    meta_str("origin", if c.code > 0 { "fault" } else { "sent" }),
                    meta_int("sender_pid", c.sender.max(0) as u64),
                    meta_int("thread", c.tid as u64),
                ]),
            ));
        }
        meta
    }

    /// The one line a user sees at exit: which files, and what to run next.
    fn report_at_exit(&self) {
        if self.cfg.quiet {
            return;
        }
        let mut err = io::stderr().lock();
        match self.written.as_slice() {
            [] => {
                let _ = writeln!(
                    err,
                    "memsnap: recorded {} events; no snapshot was written",
                    self.rec.counters.pushed.load(Relaxed)
                );
            }
            files => {
                let files: Vec<PathBuf> = files.iter().map(|p| absolute(p)).collect();
                let folders: std::collections::BTreeSet<&std::path::Path> =
                    files.iter().filter_map(|p| p.parent()).collect();
                // One folder: named once, files by name; several: whole paths.
                let (place, shown): (String, Vec<String>) = match folders.iter().next() {
                    Some(dir) if folders.len() == 1 => {
                        let created = if self.created_folders.iter().any(|c| c == dir) {
                            ", a folder memsnap created"
                        } else {
                            ""
                        };
                        (
                            format!(" in {}{created}", dir.display()),
                            files
                                .iter()
                                .filter_map(|p| p.file_name())
                                .map(|n| n.to_string_lossy().into_owned())
                                .collect(),
                        )
                    }
                    _ => {
                        let created: Vec<String> = self
                            .created_folders
                            .iter()
                            .map(|c| c.display().to_string())
                            .collect();
                        let note = if created.is_empty() {
                            String::new()
                        } else {
                            format!(" (memsnap created {})", created.join(", "))
                        };
                        (
                            note,
                            files.iter().map(|p| p.display().to_string()).collect(),
                        )
                    }
                };
                let last = files
                    .last()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default();
                let listed = &shown[shown.len().saturating_sub(5)..];
                let more = if files.len() > 5 {
                    format!(" (and {} more)", files.len() - 5)
                } else {
                    String::new()
                };
                let _ = writeln!(
                    err,
                    "memsnap: wrote {} snapshot{}{place}: {}{more}. Look at it with: memsnap summary {last} (or open it at https://pytorch.org/memory_viz)",
                    files.len(),
                    if files.len() == 1 { "" } else { "s" },
                    listed.join(", "),
                );
            }
        }
    }
}

fn api_name(i: usize) -> Option<&'static str> {
    crate::channel::event::Api::ALL.get(i).map(|a| a.name())
}

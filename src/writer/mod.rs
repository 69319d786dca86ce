//! The writer thread: owns all recorded state, builds and writes snapshots.
//!
//! Cold. One thread, started on the first CUDA event. It drains the queue (polling with
//! a short adaptive sleep; hooks wake it only when they wait for room), applies events
//! to [`state::State`], interns stacks while their Python code objects are still alive,
//! and writes snapshots on exit, out-of-memory, the dump signal, steps, periods and
//! explicit `memsnap_dump` calls. It may allocate, lock and do I/O; a failure is a warning
//! on stderr, never the host's problem. A panic in here turns recording off.
//!
//! This file holds the thread's state ([`Writer`]) and its drain loop (apply events, refresh
//! the module table, symbolize when idle, sleep); each policy has its own file and its own
//! state, holding the settings it reads: `requests` (exit, `memsnap_dump`, signals,
//! `memsnap top`), `steps` (the step window, `MEMSNAP_EVERY`, stats rows), `timers`
//! (`MEMSNAP_PERIOD`, the module refresh), `publish` (writing one snapshot; the files
//! written), `meta` (what a snapshot says about itself), `exit_report` (the exit line). What
//! the hook side shares with it comes only through `channel/` (events, requests, counters)
//! and `process/` (the module table and the interpreter, which `stacks` reads).

pub mod ack;
pub mod blocks;
pub mod device_memory;
/// The writer's drain benchmark (`cargo bench --bench writer`). Its code lives with the
/// other benchmarks, in benches/in_library/; it is compiled here, as a part of the writer it
/// measures, only in `bench-hooks` builds.
#[cfg(feature = "bench-hooks")]
#[path = "../../benches/in_library/writer_drain.rs"]
pub mod drain_bench;
pub mod dump;
mod exit_report;
pub mod files;
mod folder;
pub mod live;
mod meta;
pub mod own_fd;
mod publish;
mod requests;
pub mod stacks;
pub mod state;
pub mod stats;
mod steps;
mod temporaries;
mod timers;
pub mod upload;

use crate::channel::event::{Api, Event, Kind, Payload, StackRef};
use crate::channel::handshake::{EXIT_DONE, OOM_DUMPS, READ_REQUESTS};
use crate::channel::lanes::{ReadMark, Reader};
use crate::channel::queue::Recorder;
use crate::config::Config;
use crate::process::clock::StampConverter;
use crate::snapshot::live::OomSample;
use dump::FrameInterner;
use files::{Identity, Reason};
use stacks::StackTable;
use state::{Live, State};
use std::path::PathBuf;
use std::sync::atomic::Ordering::*;
use std::time::Duration;

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
    // The thread that waited for the exit snapshot goes on to end the process; if it held
    // the lanes, it lets go quietly and the wake is done here, so that it does not wait
    // behind the threads it woke. One that lets go only after this wake wakes them itself
    // (`Recorder::wait_for`: each side stores, fences, then loads what the other stored).
    rec.wait_until_let_go(LAST_LET_GO);
    rec.writer_alive.store(false, Release);
    EXIT_DONE.store(true, Release);
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    rec.wake_held_if_due();
}

/// How long the ending writer waits for a thread that holds the lanes to let go.
const LAST_LET_GO: Duration = Duration::from_millis(100);
/// Longest idle sleep between queue polls.
const MAX_IDLE: Duration = Duration::from_millis(5);
/// Longest stretch spent symbolizing new stacks before the queue is looked at again.
const SYMBOLIZE_BUDGET: Duration = Duration::from_micros(500);
/// Events applied between checks of the signal flag and timers.
const BATCH: usize = 8192;
/// Events applied between looks for a waiting request within a batch: a starved writer
/// (many threads on few processors) takes a batch in hundreds of milliseconds.
const REQUEST_LOOK: usize = 512;

/// The writer thread's state: what was recorded (the reader, the state, the stacks), and
/// one state per policy, each holding the settings it reads (a policy's functions are an
/// `impl` on its state, or an `impl Writer` in its file where it needs the recorded state).
struct Writer {
    rec: &'static Recorder,
    /// Takes the events of every thread's lane and of the shared queue in one order.
    reader: Reader,
    state: State,
    stacks: StackTable,
    interner: FrameInterner,
    id: Identity,
    /// Calls applied, by CUDA entry point.
    api_counts: [u64; Api::ALL.len()],
    /// The most recent out-of-memory error, for `memsnap top`.
    last_oom: Option<OomSample>,
    /// The events' times in microseconds since the epoch.
    times: EventTimes,
    /// The wake-ups counted when the writer last woke: it waits only while none came since.
    wake_seen: u32,
    /// The newest read request seen (`READ_REQUESTS`) and where the lanes stood then: done
    /// once the reader has passed it.
    reads: Option<(u64, ReadMark)>,
    /// The step count, the recording window and `MEMSNAP_EVERY`.
    window: steps::StepWindow,
    /// `MEMSNAP_PERIOD`'s snapshots.
    period: timers::Period,
    /// The module table, PyTorch's allocator and the step hook looked at again.
    refresh: timers::Refresh,
    /// Where snapshot files go, and those written.
    files: publish::SnapshotFiles,
    /// What exit and exec write.
    at_exit: exit_report::AtExit,
    /// `MEMSNAP_STATS`'s rows; `None` when it is unset.
    stats: Option<stats::Stats>,
    /// Copies to `MEMSNAP_REMOTE`; `None` when it is unset.
    uploader: Option<upload::Uploader>,
    /// The signal that ends the job, once its snapshot was asked for.
    crash: Option<meta::CrashInfo>,
    /// What `memsnap dump` reads to learn that its signal arrived and how it ended.
    ack: ack::AckFile,
    /// The socket `memsnap top` asks through.
    live: live::LiveServer,
    /// Dump requests (signals, socket) waiting for the next request snapshot.
    held: requests::HeldRequests,
    /// The request being served, if any, and whether the lanes are held for it.
    serving: requests::Serving,
}

/// `path` made absolute against the working directory (left as is if that fails).
fn absolute(path: &std::path::Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// The events' times: their clock readings in microseconds since the epoch, in order.
#[derive(Default)]
struct EventTimes {
    /// Turns the events' clock readings into microseconds since the epoch.
    clock: StampConverter,
    /// The time given to the last event applied.
    last_us: u64,
}

impl EventTimes {
    /// Reads the clock's conversion again (see [`StampConverter::refresh`]).
    fn refresh(&mut self) {
        self.clock.refresh();
    }

    /// `ev`'s time in microseconds since the epoch, such that times never decrease in the
    /// order events are recorded, and a step mark is later than every event before it: the
    /// file's step boundaries are times ("the history's entries from `t` on come after N
    /// steps", docs/FORMAT.md#step-boundaries), and a fast program makes several events in
    /// one microsecond, so an event just before a mark must not share its time. (Threads
    /// stamp an event before they queue it, so the queue's order and the clock's can differ
    /// by the time between the two: an event then takes the time of the one before it.)
    fn of(&mut self, ev: &Event) -> u64 {
        let t = self.clock.micros(ev.time);
        let floor = match ev.kind {
            Kind::Step => self.last_us + 1,
            _ => self.last_us,
        };
        self.last_us = t.max(floor);
        self.last_us
    }
}

enum Flow {
    Continue,
    Exit,
}

impl Writer {
    /// The writer for `cfg`: each setting it uses goes to the one policy that reads it
    /// (the hooks' own went to the recorder, the signal handlers and the step hook).
    fn new(rec: &'static Recorder, cfg: Config) -> Writer {
        let stacks = StackTable::new(&cfg);
        let Config {
            folder,
            filename,
            overwrite,
            max_entries,
            at_exit,
            quiet,
            skip,
            interval,
            every,
            period,
            stats,
            remote,
            remote_only,
            remote_wait,
            ..
        } = cfg;
        let id = Identity::current();
        let id_pid = id.pid;
        let uploader = remote.map(|remote| {
            upload::Uploader::new(remote, remote_only, remote_wait, &id.host, id_pid)
        });
        let stats = stats.map(|t| stats::Stats::new(&t, &id));
        ack::forget_dead_processes(live::LiveServer::own_uid());
        Writer {
            rec,
            reader: Reader::new(),
            state: State::new(max_entries),
            stacks,
            interner: FrameInterner::default(),
            id,
            files: publish::SnapshotFiles::new(folder, filename, overwrite),
            at_exit: exit_report::AtExit {
                snapshot: at_exit,
                line: !quiet,
            },
            window: steps::StepWindow::new(skip, interval, every),
            period: timers::Period::new(period),
            refresh: timers::Refresh::new(),
            api_counts: [0; Api::ALL.len()],
            ack: ack::AckFile::new(id_pid),
            crash: None,
            uploader,
            live: live::LiveServer::open(id_pid),
            held: requests::HeldRequests::default(),
            serving: requests::Serving::default(),
            last_oom: None,
            times: EventTimes::default(),
            wake_seen: 0,
            reads: None,
            stats,
        }
    }

    fn run(&mut self) {
        let mut idle = Duration::from_micros(100);
        if self.window.opens_at_start() {
            self.window.open(self.history_marks());
        }
        loop {
            self.rec.wake_held_if_due();
            self.times.refresh();
            self.serve_reads();
            let mut applied = 0;
            let pass = self.serving.pass_begins();
            while applied < BATCH {
                if applied % REQUEST_LOOK == REQUEST_LOOK - 1 && self.request_waiting() {
                    break;
                }
                let Some(ev) = self.reader.next(self.rec) else {
                    break;
                };
                applied += 1;
                if let Flow::Exit = self.apply(ev) {
                    return;
                }
                if self.reads.is_some() {
                    self.serve_reads();
                }
            }
            let starved = self.serving.pass_ends(pass, applied >= REQUEST_LOOK);
            self.rec.note_writer_starved(starved);
            self.serve_reads();
            self.maintain_stacks();
            if let Flow::Exit = self.serve_requests() {
                return;
            }
            self.serve_live();
            if self.period.due() {
                let _ = self.dump(Reason::Period, "");
                self.write_stats(Reason::Period);
            }
            if self.reads.is_some() {
                // A thread waits to free what events name: events held back for the next
                // pass are taken now, symbols later.
                idle = Duration::from_micros(100);
                continue;
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

    /// Waits for a wake-up (a hook, a signal, a request, exit) or the timeout, unless a
    /// `memsnap top` client is ready now. The wait is on memory, not on descriptors (see
    /// `channel::queue::WakeWord`), so the live socket is looked at before it, without
    /// waiting: a client is served within one idle sleep (at most 5 ms).
    fn sleep(&mut self, timeout: Duration) {
        let mut fds = Vec::with_capacity(4);
        self.live.keep_descriptors();
        self.live.poll_fds(&mut fds);
        if !fds.is_empty() {
            // SAFETY: `fds` holds fds.len() valid pollfds; a zero timeout never blocks.
            let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) };
            if ready > 0 {
                self.live.after_poll(&fds);
                return;
            }
        }
        if self.rec.wake.seen() == self.wake_seen {
            self.rec.wake.wait(self.wake_seen, timeout);
        }
        self.wake_seen = self.rec.wake.seen();
    }

    /// Completes the read request noted once the reader has passed where the lanes stood
    /// when it was seen, then notes the next one (`Recorder::wait_until_read`).
    fn serve_reads(&mut self) {
        if let Some((ticket, mark)) = &self.reads {
            if !self.reader.passed(self.rec, mark) {
                return;
            }
            READ_REQUESTS.complete(*ticket);
            self.reads = None;
        }
        if READ_REQUESTS.pending().is_empty() {
            return;
        }
        let ticket = READ_REQUESTS.asked();
        let mark = self.reader.mark(self.rec);
        if self.reader.passed(self.rec, &mark) {
            READ_REQUESTS.complete(ticket);
        } else {
            self.reads = Some((ticket, mark));
        }
    }

    /// Events recorded without the stack they should have had.
    fn events_without_stack(&self) -> u64 {
        self.rec.counters.lost_stacks.load(Relaxed) + self.stacks.unknown_references
    }

    fn take_stack(&mut self, ev: &Event) -> Option<stacks::RawStackId> {
        match ev.stack() {
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

    /// The refresh of what the process loaded since, when due, then the one-time stack
    /// warnings.
    fn maintain_stacks(&mut self) {
        self.refresh.maintain(&mut self.stacks);
        for w in self.stacks.take_warnings() {
            eprintln!("memsnap: {w}");
        }
    }

    fn apply(&mut self, ev: Event) -> Flow {
        let stack = self.take_stack(&ev);
        // Its code objects are read: a thread may free them (`Recorder::all_read`).
        let interned = &self.rec.counters.interned;
        interned.store(interned.load(Relaxed) + 1, Release);
        let time_us = self.times.of(&ev);
        // (A pool event is part of its segment's trace entry, counted with it.)
        if ev.kind != Kind::CachePool
            && let Some(c) = self.api_counts.get_mut(ev.api as usize)
        {
            *c += 1;
        }
        let live = Live {
            size: ev.size,
            stream: ev.payload().stream(),
            api: ev.api,
            stack,
            time_us,
            handle: 0,
        };
        match ev.kind {
            Kind::Alloc => self.state.alloc(ev.device, ev.addr(), ev.size, live),
            Kind::AllocManaged => self.state.managed_alloc(ev.addr(), live),
            Kind::Free => {
                let stream = ev.payload().stream();
                self.state.free(ev.addr(), ev.api, stream, time_us, stack)
            }
            Kind::MemCreate => self
                .state
                .mem_create(ev.payload().handle(), ev.size, ev.device),
            Kind::MemRelease => self.state.mem_release(ev.payload().handle()),
            Kind::Map => self.state.map(
                ev.addr(),
                ev.size,
                Live {
                    handle: ev.payload().handle(),
                    stream: 0,
                    ..live
                },
            ),
            Kind::Unmap => self.state.unmap(ev.addr(), ev.size, time_us, stack),
            Kind::Reserve => self.state.reserve(ev.addr(), ev.size),
            Kind::ReserveFree => self.state.reserve_free(ev.addr()),
            Kind::Oom => {
                if let Payload::Oom {
                    free_bytes,
                    stream,
                    dump_ticket,
                } = ev.payload()
                {
                    let free = free_bytes.map_or(-1, |b| b as i64);
                    let (device, size, time) = (ev.device, ev.size, time_us);
                    self.state
                        .oom(device, size, free, stream, time, ev.api, stack);
                    self.last_oom = Some(OomSample {
                        device: device.max(0) as u32,
                        time_us: time,
                        requested_bytes: size,
                        device_free: free,
                    });
                    if dump_ticket != 0 {
                        let began = self.begin_serving();
                        let _ = self.dump(Reason::Oom, "");
                        OOM_DUMPS.complete(u64::from(dump_ticket));
                        if began {
                            self.end_serving();
                        }
                    }
                }
            }
            Kind::BlockAlloc => {
                let (stream, time) = (ev.payload().stream(), time_us);
                self.state
                    .cache_block_alloc(ev.device, ev.addr(), ev.size, stream, time, stack)
            }
            Kind::BlockFreeRequested => {
                let (stream, time) = (ev.payload().stream(), time_us);
                self.state
                    .cache_block_free_requested(ev.device, ev.addr(), stream, time, stack)
            }
            Kind::BlockFreeCompleted => {
                self.state
                    .cache_block_free_completed(ev.device, ev.addr(), time_us, stack)
            }
            Kind::CacheSegment => {
                let matched = self.state.cache_segment(ev.device, ev.addr(), ev.size);
                self.state.check_first_cache_segment(matched);
            }
            Kind::CacheSegmentMap => {
                let matched = self.state.cache_segment_map(ev.device, ev.addr(), ev.size);
                self.state.check_first_cache_segment(matched);
            }
            Kind::CachePool => {
                if let Payload::Pool(pool) = ev.payload() {
                    self.state.cache_pool(ev.addr(), ev.size, pool);
                }
            }
            Kind::Step => {
                if let Payload::Step(origin) = ev.payload() {
                    self.on_step_mark(origin, time_us)
                }
            }
        }
        Flow::Continue
    }

    /// Applies the events in the queue now (not those pushed while this runs).
    fn apply_queued(&mut self) -> Flow {
        self.times.refresh();
        for taken in 0..=self.rec.queued() {
            if taken % 64 == 0 {
                self.hold_if_starved();
            }
            let Some(ev) = self.reader.next(self.rec) else {
                break;
            };
            if let Flow::Exit = self.apply(ev) {
                return Flow::Exit;
            }
        }
        Flow::Continue
    }

    fn history_marks(&self) -> Vec<u64> {
        self.state.devices.iter().map(|d| d.trace_total).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::event::{PoolId, StepOrigin};
    use crate::channel::queue::HookSettings;
    use crate::config::{Context, Stacks};

    fn writer() -> Writer {
        let settings = HookSettings {
            stacks: Stacks::None,
            context: Context::All,
            max_frames: 8,
            dump_on_oom: false,
        };
        let rec: &'static Recorder = Box::leak(Box::new(Recorder::new(1 << 10, settings, true)));
        Writer::new(rec, Config::default())
    }

    #[test]
    fn the_programs_first_step_mark_moves_the_optimizers_last_boundary_to_it() {
        let mut w = writer();
        let now = crate::process::clock::now();
        let step = |origin| {
            let payload = Payload::Step(origin);
            Event::stackless(Kind::Step, Api::Memsnap, 0, 0, 0, 0, payload, now)
        };
        w.apply(step(StepOrigin::Optimizer));
        w.apply(step(StepOrigin::Optimizer));
        let optimizers = w.state.step_marks.back().copied().expect("a boundary");
        // The program marks the second step after more work: one boundary, at its mark.
        w.apply(step(StepOrigin::Program));
        assert_eq!(w.window.step(), 2);
        assert_eq!(w.state.step_marks.len(), 2);
        let (steps, time) = w.state.step_marks.back().copied().expect("a boundary");
        assert_eq!(steps, 2);
        assert!(time > optimizers.1, "{time} after {}", optimizers.1);
        w.apply(step(StepOrigin::Program));
        assert_eq!((w.window.step(), w.state.step_marks.len()), (3, 3));
        assert_eq!(
            w.window.step_source(),
            "optimizer, then program from step 2"
        );
    }

    #[test]
    fn a_read_request_is_done_once_the_events_published_before_it_are_applied() {
        let mut w = writer();
        let rec = w.rec;
        std::thread::spawn(move || {
            crate::channel::thread::with_thread(|t| {
                rec.push(t, Event::new(Kind::Alloc, Api::CudaMalloc))
            })
        })
        .join()
        .unwrap();
        let ticket = READ_REQUESTS.ask();
        w.serve_reads();
        assert!(!READ_REQUESTS.is_done(ticket), "its event not applied yet");
        let ev = w.reader.next(rec).expect("queued");
        w.apply(ev);
        assert_eq!(rec.counters.interned.load(Relaxed), 1);
        w.serve_reads();
        assert!(READ_REQUESTS.is_done(ticket));
        // Asked with nothing left to read: done at once.
        let ticket = READ_REQUESTS.ask();
        w.serve_reads();
        assert!(READ_REQUESTS.is_done(ticket));
    }

    #[test]
    fn a_pool_event_marks_its_segment_and_is_no_call_of_its_own() {
        let mut w = writer();
        let (addr, size, now) = (0x7f00_0000_0000, 2 << 20, crate::process::clock::now());
        let event =
            |kind, api, payload| Event::stackless(kind, api, 0, 0, addr, size, payload, now);
        let pool = PoolId {
            first: 0,
            second: 1,
        };
        w.apply(event(Kind::Alloc, Api::CudaMalloc, Payload::Stream(0)));
        w.apply(event(
            Kind::CacheSegment,
            Api::CachingAllocator,
            Payload::Stream(0),
        ));
        w.apply(event(
            Kind::CachePool,
            Api::CachingAllocator,
            Payload::Pool(pool),
        ));
        assert_eq!(w.state.devices[0].cache.segments[&addr].pool, pool);
        assert_eq!(
            w.api_counts[Api::CachingAllocator as usize],
            1,
            "the segment's entry, counted once"
        );
    }
}

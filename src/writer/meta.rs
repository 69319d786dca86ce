//! What each snapshot says about itself: `allocator_settings` (as PyTorch writes them) and
//! memsnap's own metadata (identity, reason, counters, route counts, per-device totals, the
//! signal behind a `term`/`crash` snapshot).
//!
//! Cold (writer thread).

use super::Writer;
use super::device_memory;
use super::dump::{meta_int, meta_str};
use super::files::Reason;
use crate::channel::handshake::{self, CRASH, ROUTED, SIGNAL_DUMPS};
use crate::config::StepMarks;
use crate::process::allocator_route;
use crate::process::step_marks::{self, Hook, NotAttached};
use crate::snapshot::model::Meta;
use std::sync::atomic::Ordering::*;

/// The signal behind a `term` or `crash` snapshot, for its metadata.
#[derive(Clone, Copy)]
pub(super) struct CrashInfo {
    signal: i32,
    code: i32,
    sender: i32,
    tid: u32,
}

impl CrashInfo {
    /// The signal that asked for the snapshot, as its handler noted it (`CRASH`).
    pub fn asked() -> CrashInfo {
        CrashInfo {
            signal: CRASH.signal.load(Acquire),
            code: CRASH.code.load(Relaxed),
            sender: CRASH.sender.load(Relaxed),
            tid: CRASH.tid.load(Relaxed),
        }
    }

    /// `term` for a signal sent to stop the job (a scheduler, a person at the terminal),
    /// `crash` for one raised by a crash.
    pub fn reason(&self) -> Reason {
        match self.signal {
            libc::SIGTERM | libc::SIGINT | libc::SIGHUP | libc::SIGQUIT => Reason::Term,
            _ => Reason::Crash,
        }
    }

    /// The `signal` dictionary of the snapshot's metadata.
    fn metadata(&self) -> (String, Meta) {
        (
            "signal".to_string(),
            Meta::Dict(vec![
                meta_int("number", self.signal as u64),
                meta_str("name", signal_name(self.signal)),
                meta_str("origin", if self.code > 0 { "fault" } else { "sent" }),
                meta_int("sender_pid", self.sender.max(0) as u64),
                meta_int("thread", self.tid as u64),
            ]),
        )
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGTERM => "SIGTERM",
        libc::SIGABRT => "SIGABRT",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        libc::SIGINT => "SIGINT",
        libc::SIGHUP => "SIGHUP",
        libc::SIGQUIT => "SIGQUIT",
        _ => "other",
    }
}

/// What became of the optimizer step hook (`process::step_marks`), in words.
fn optimizer_step_hook() -> &'static str {
    match (step_marks::setting(), step_marks::hook()) {
        (StepMarks::Off, _) => "off (MEMSNAP_STEPS=off)",
        (StepMarks::Program, _) => "off (MEMSNAP_STEPS=program)",
        (StepMarks::Auto, Hook::Attached) if step_marks::program_marks() => {
            "attached; unused since the program marks its own steps"
        }
        (StepMarks::Auto, Hook::Attached) => "attached",
        (StepMarks::Auto, _) if step_marks::program_marks() => {
            "not attached: the program marks its own steps"
        }
        (StepMarks::Auto, Hook::Failed) => {
            "not attached: registering it raised a Python error (cleared)"
        }
        (StepMarks::Auto, Hook::Scheduled) => {
            "not attached yet: queued for the interpreter's main thread"
        }
        (StepMarks::Auto, Hook::NotTried | Hook::Waiting) => match step_marks::why_not() {
            NotAttached::NoPython => "not attached: no supported CPython in the process",
            NotAttached::NotMainThread => {
                "not attached yet: no CUDA call from the interpreter's main thread"
            }
            NotAttached::NoTorchOptim => "not attached: torch.optim not imported",
            NotAttached::NoHookFunction => {
                "not attached: torch.optim has no global step hooks (PyTorch before 2.0)"
            }
            NotAttached::ProgramHooks => {
                "not attached: the program has global optimizer step hooks of its own"
            }
            NotAttached::Busy => "not attached yet: the interpreter was busy",
        },
    }
}

fn api_name(i: usize) -> Option<&'static str> {
    crate::channel::event::Api::ALL.get(i).map(|a| a.name())
}

impl Writer {
    pub(super) fn allocator_settings(&self) -> Vec<(String, Meta)> {
        let overflowed = self.state.devices.iter().any(|d| d.trace_overflow > 0);
        let mut settings = vec![meta_str(
            "PYTORCH_CUDA_ALLOC_CONF",
            &std::env::var("PYTORCH_CUDA_ALLOC_CONF").unwrap_or_default(),
        )];
        // PyTorch reads this one first where it is set (from 2.9); `memsnap whatif` replays
        // the settings it names.
        if let Ok(conf) = std::env::var("PYTORCH_ALLOC_CONF") {
            settings.push(meta_str("PYTORCH_ALLOC_CONF", &conf));
        }
        settings.extend([
            (
                "trace_alloc_max_entries".to_string(),
                Meta::Int(self.state.max_entries() as i64),
            ),
            ("trace_alloc_overflowed".to_string(), Meta::Bool(overflowed)),
            meta_str("recorder", "memsnap (CUDA driver/runtime interposer)"),
        ]);
        settings
    }

    pub(super) fn metadata(&self, reason: Reason, tag: &str) -> Vec<(String, Meta)> {
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
                let mut fields = vec![
                    meta_int("device", d as u64),
                    meta_int("live_bytes", dev.live_bytes),
                    meta_int(
                        "live_allocations",
                        (dev.allocs.len() + dev.mappings.len() + dev.cache.blocks.len()) as u64,
                    ),
                    // PyTorch's caching allocator: its segments, and its blocks not freed
                    // yet (PyTorch's memory_reserved() and memory_allocated()).
                    meta_int("cache_reserved_bytes", dev.cache.reserved_bytes),
                    meta_int("cache_allocated_bytes", dev.cache.allocated_bytes),
                    // The device's capacity as the driver reported it (0: not asked yet).
                    meta_int("total_bytes", handshake::device_total(d)),
                    meta_int("peak_bytes", dev.peak_ever),
                    meta_int("vmm_physical_bytes", dev.physical_bytes),
                    meta_int("events", dev.events),
                    meta_int("ooms", dev.ooms),
                    meta_int("history_dropped", dev.trace_overflow),
                ];
                // The driver's free memory now, on devices the program allocated on (with
                // the capacity: what memsnap did not record). Absent when it cannot say.
                if dev.events > 0
                    && let Some(free) = device_memory::free_bytes(d as i32)
                {
                    fields.push(meta_int("free_bytes", free));
                }
                Meta::Dict(fields)
            })
            .collect();
        let torch_allocator =
            allocator_route::describe(self.state.cache_rejection()).unwrap_or_default();
        let mut meta = vec![
            meta_str("version", env!("CARGO_PKG_VERSION")),
            // How PyTorch's allocator was seen: "blocks: ...", "segments only: ...",
            // "tensors: ...", or empty when no PyTorch was loaded.
            meta_str("torch_allocator", &torch_allocator),
            meta_int("pid", self.id.pid as u64),
            meta_str("rank", &self.id.rank),
            meta_str("local_rank", &self.id.local_rank),
            meta_str("host", &self.id.host),
            meta_str("exe", &self.id.exe),
            meta_str("reason", reason.as_str()),
            meta_str("tag", tag),
            meta_int("seq", self.files.seq()),
            meta_int("step", self.window.step()),
            // Where the steps came from, and why the optimizer's did or did not.
            meta_str("step_source", &self.window.step_source()),
            meta_str("optimizer_step_hook", optimizer_step_hook()),
            meta_int("optimizer_hook_python_errors", step_marks::python_errors()),
            meta_int("time_us", crate::process::clock::wall_micros()),
            meta_int("events_recorded", c.applied.load(Relaxed)),
            // Lost only while the writer is gone; a snapshot written then has none to report,
            // so these are 0 in every file and exist for readers that check.
            meta_int("dropped_events", c.lost_total()),
            meta_int("dropped_allocs", c.lost_allocs.load(Relaxed)),
            meta_int("dropped_frees", c.lost_frees.load(Relaxed)),
            meta_int("events_without_stack", self.events_without_stack()),
            meta_int("frames_unresolved", self.stacks.frames_unresolved),
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
            meta_int("free_waits", c.free_waits.load(Relaxed)),
            meta_int("unknown_frees", self.state.anomalies.unknown_frees),
            meta_int("unknown_unmaps", self.state.anomalies.unknown_unmaps),
            meta_int("repaired_overlaps", self.state.anomalies.repaired_overlaps),
            meta_int("cache_mismatches", self.state.anomalies.cache_mismatches),
            meta_int("managed_live_bytes", self.state.managed_bytes()),
            meta_int("managed_live_allocations", self.state.managed.len() as u64),
            meta_int("host_mapped_bytes", self.state.host_mappings.values().sum()),
            // Other processes' memory mapped here (NCCL's peer buffers): theirs to record.
            meta_int(
                "imported_mapped_bytes",
                self.state.imported_mappings.values().sum(),
            ),
            meta_int("reserved_va_bytes", self.state.reservations.values().sum()),
            // The hooks' setting, as the recorder holds it.
            meta_str(
                "stacks",
                &format!("{:?}", self.rec.settings.stacks).to_lowercase(),
            ),
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
            meta.push(c.metadata());
        }
        meta
    }
}

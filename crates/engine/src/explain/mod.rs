//! `explain`'s model: a few short answers about a run's files, most important first. Why it
//! ran out of memory ([`oom`]), leaks and creep across steps ([`leaks`]), who owns every
//! byte ([`owners`]), what the memory is for ([`roles`]), and the ranks side by side.
//!
//! Each file is read once ([`read`]: its histories, and beside them a compact log of the
//! live-byte changes, [`log`]) and reduced on its own thread to a [`Digest`] (a few
//! kilobytes); [`build`] then puts the digests of every file together. The CLI renders the
//! [`Explanation`] as text, or serializes it (the JSON shape is docs/EXPLAIN.md's, stable:
//! keys are only ever added). Cold code.

pub mod iterations;
pub mod leaks;
pub mod log;
pub mod oom;
pub mod owners;
pub mod roles;
pub mod snapshots;

mod build;
mod digest;
mod side_by_side;

pub use build::{STEPS_HORIZON, build, shared_helpers};
pub use digest::digest;
pub use side_by_side::{DifferingSite, ForeignDevice, Ranks};

use crate::at::At;
use crate::input::{self, Summarized};
use crate::origin::rank_from_name;
use crate::sites::{Attribution, Helpers, Library};
use leaks::{Leak, StepPoint};
use log::EventLog;
use memsnap_format::model::{Meta, Snapshot};
use memsnap_format::pickle_read::ReadError;
use memsnap_format::text::escape_controls;
use oom::Verdict;
use roles::{Role, Roles};
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::Read as IoRead;

/// Sites listed for an OOM.
pub const OOM_SITES: usize = 5;
/// Sites listed as differing between ranks.
pub const DIFFERING_SITES: usize = 5;
/// Under `--at-helpers`, the share of the live bytes above which a site that is a helper
/// gets a note naming its calling lines.
pub const HELPER_SHARE: f64 = 0.5;

/// A file read for `explain`: its summarized snapshot and, per device ordinal, the log of
/// its live-byte changes.
pub struct Read {
    pub loaded: Summarized,
    pub logs: Vec<EventLog>,
}

/// Reads one file in one pass: histories following `at`, and the change logs.
/// `Ok(None)`: the file cannot be streamed (see [`input::read_summarized`]); read it whole
/// and use [`Read::of_whole`].
pub fn read(
    file: &mut dyn IoRead,
    progress: &mut dyn FnMut(usize),
    at: At,
) -> Result<Option<Read>, ReadError> {
    let mut by_list: Vec<EventLog> = Vec::new();
    let r = input::read_summarized_with(file, progress, at, &mut |i, e, h| {
        if by_list.len() <= i {
            by_list.resize_with(i + 1, EventLog::default);
        }
        by_list[i].push(e, h);
    })?;
    let Some((loaded, device_of_list)) = r else {
        return Ok(None);
    };
    let mut logs = vec![EventLog::default(); loaded.histories.len()];
    for (i, log) in by_list.into_iter().enumerate() {
        if let Some(&Some(d)) = device_of_list.get(i)
            && d < logs.len()
        {
            logs[d] = log;
        }
    }
    Ok(Some(Read { loaded, logs }))
}

impl Read {
    /// The same from a snapshot read whole.
    pub fn of_whole(snap: Snapshot, at: At) -> Self {
        let logs = snap.device_traces.iter().map(|t| EventLog::of(t)).collect();
        Read {
            loaded: Summarized::of_whole(snap, at),
            logs,
        }
    }
}

/// How sites are named (`--ignore`, `--callers`).
#[derive(Clone, Debug, Default)]
pub struct Options {
    pub attr: Attribution,
}

/// One allocation site with its owner and role.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SiteRow {
    pub site: String,
    /// The helper the bytes went through, where the site is its calling line.
    pub via: Option<String>,
    pub bytes: i64,
    pub allocations: i64,
    pub library: Library,
    pub role: Role,
}

/// The OOM of one file (its earliest), judged.
#[derive(Clone, Debug, Serialize)]
pub struct Oom {
    pub rank: Option<i64>,
    /// The process (`memsnap.pid`), where the file names one: what says whose file it is
    /// when the rank is not known.
    pub pid: Option<i64>,
    pub file: String,
    pub device: i64,
    pub time_us: i64,
    pub request_bytes: i64,
    pub device_free_bytes: Option<i64>,
    pub verdict: Verdict,
    pub reserved_unallocated_bytes: Option<i64>,
    pub largest_free_block_bytes: Option<i64>,
    /// Recorded reserved and live (requested) bytes on the device then.
    pub reserved_bytes: i64,
    pub live_bytes: i64,
    pub capacity_bytes: Option<i64>,
    pub outside_bytes: Option<i64>,
    /// The setting or change that would help (fragmentation).
    pub advice: Option<String>,
    /// Why the file cannot tell the caching allocator's free space (segments only).
    pub cannot_tell: Option<String>,
    pub sites: Vec<SiteRow>,
    pub owners: BTreeMap<String, i64>,
    pub first_rank: Option<i64>,
    pub others: Vec<OtherRank>,
}

/// Another rank at the moment the first one ran out of memory.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OtherRank {
    pub rank: Option<i64>,
    /// Live bytes at that moment; `null` when its history cannot tell.
    pub live_bytes: Option<i64>,
    pub peak_bytes: i64,
}

/// The live set at the moment asked for (`--at`), in one file.
#[derive(Clone, Debug, Default)]
pub struct Instant {
    /// `the peak (after event 8, +1.234 s)`, per device where several.
    pub moment: String,
    pub oom: bool,
    pub live: i64,
    pub owners: BTreeMap<String, i64>,
    pub roles: Option<Roles>,
    pub sites: Vec<SiteRow>,
    /// Under `--at-helpers`, the note on a helper that holds most of the bytes.
    pub helper: Option<String>,
}

/// What `explain` keeps of one file once it is read.
#[derive(Clone, Debug, Default)]
pub struct Digest {
    pub file: String,
    pub rank: Option<i64>,
    pub local_rank: Option<i64>,
    pub pid: Option<i64>,
    pub reason: Option<String>,
    pub step: Option<i64>,
    /// Devices with segments or trace entries.
    pub devices: Vec<i64>,
    /// Σ over devices of the peak live (requested) bytes.
    pub peak_bytes: i64,
    pub live_bytes: i64,
    /// Device → capacity (`memsnap.devices[i].total_bytes`).
    pub capacity: BTreeMap<i64, i64>,
    /// Per device, live bytes over time (`None`: history too long to keep).
    pub timelines: Option<Vec<Vec<(i64, i64)>>>,
    pub time_range: Option<(i64, i64)>,
    pub oom: Option<Oom>,
    pub instant: Instant,
    /// Why no device reached the moment asked for (`--at oom` on a file without one), as
    /// [`device::unreached`] says; the instant is then the end.
    pub unreached: Option<String>,
    /// The state at the end (a step snapshot's step boundary).
    pub end_point: StepPoint,
    /// The states at the file's own step marks.
    pub marks: Vec<StepPoint>,
    /// Iterations found in the history of a file without step marks (or why none were),
    /// and the states at their boundaries (`step`: the iteration's number).
    pub iterations: Option<iterations::Info>,
    pub iteration_points: Vec<StepPoint>,
    /// When each of those iterations starts.
    pub iteration_starts: Vec<i64>,
    /// Per site whose bytes moved in the history: the bytes it gained over the last half,
    /// and its largest fall ([`log::Motion`]); `None` without a history to tell.
    pub motion: Option<BTreeMap<String, (i64, i64)>>,
    /// Who wrote the file (memsnap's metadata): host, program, its file number, its events.
    pub host: Option<String>,
    pub exe: Option<String>,
    pub seq: Option<i64>,
    pub events_recorded: Option<i64>,
    /// When the file was written (`memsnap.time_us`), else its last entry's time.
    pub written_us: Option<i64>,
    /// Per device, history entries since recording began (dropped and kept).
    pub entries_total: BTreeMap<i64, i64>,
    pub notes: Vec<String>,
    /// memsnap's line on PyTorch's allocator (`blocks: ...`, `segments only: ...`,
    /// `tensors: ...`), where the file has one.
    pub torch_allocator: Option<String>,
    /// Why the file could not be read.
    pub error: Option<String>,
    /// The helpers whose allocations the sites above show at their calling lines, and the
    /// helper of each such site (`A via H` → `H`).
    pub helpers: Helpers,
    pub via: BTreeMap<String, String>,
}

/// A digest saying why the file `name` could not be read.
pub fn unreadable(file: String, error: String) -> Digest {
    Digest {
        rank: rank_from_name(&file),
        file,
        error: Some(error),
        ..Digest::default()
    }
}

fn meta_str(snap: &Snapshot, key: &str) -> Option<String> {
    match snap.meta(key)? {
        Meta::Str(s) => Some(s.clone()),
        _ => None,
    }
}

/// `memsnap.devices[i].<key>` by device, where present.
pub fn device_meta(snap: &Snapshot, key: &str) -> BTreeMap<i64, i64> {
    let Some(Meta::List(devices)) = snap.meta("devices") else {
        return BTreeMap::new();
    };
    devices
        .iter()
        .filter_map(|d| {
            let Meta::Dict(kv) = d else { return None };
            let get = |k: &str| {
                kv.iter().find_map(|(name, v)| match v {
                    Meta::Int(i) if name == k => Some(*i),
                    _ => None,
                })
            };
            Some((get("device")?, get(key)?))
        })
        .collect()
}

/// Where the owners and roles were taken.
#[derive(Clone, Debug, Serialize)]
pub struct AtFile {
    pub file: String,
    pub rank: Option<i64>,
    /// The process (`memsnap.pid`), where the file names one.
    pub pid: Option<i64>,
    pub moment: String,
}

/// Everything `explain` says.
#[derive(Clone, Debug, Serialize)]
pub struct Explanation {
    pub oom: Option<Oom>,
    pub leaks: Vec<Leak>,
    /// Live bytes by owner at the moment asked for (default: the OOM, else the peak).
    pub owners: BTreeMap<String, i64>,
    pub roles: Option<Roles>,
    pub ranks: Option<Ranks>,
    pub notes: Vec<String>,
    /// The file and moment `owners` and `roles` describe.
    pub at: Option<AtFile>,
    pub files: usize,
    /// Steps (or iterations) until the leaks fill the device, where its capacity is known.
    pub steps_to_oom: Option<i64>,
    /// Iterations found in the record, or why none were, per rank without step boundaries.
    pub iterations: Vec<iterations::Info>,
    /// Each process given as several snapshots: the growth between them.
    pub snapshots: Vec<snapshots::Snapshots>,
    /// The sites at that moment (text only).
    #[serde(skip)]
    pub sites: Vec<SiteRow>,
}

impl Explanation {
    /// The leaking sites, for `--fail-on-leak`.
    pub fn leaking_sites(&self) -> Vec<&str> {
        self.leaks.iter().map(|l| l.site.as_str()).collect()
    }
}

/// The verdict line `summary` ends an OOM file with, and whether there is one; a text
/// line, so the site and the file name in it are shown with their controls escaped.
pub fn verdict_line(loaded: &Summarized, name: &str, attr: &Attribution) -> Option<String> {
    let d = digest(
        name.to_string(),
        loaded,
        &[],
        &Options { attr: attr.clone() },
    );
    let o = d.oom?;
    let why = match o.verdict {
        Verdict::Live => format!(
            "live: the live allocations hold the memory{}",
            o.sites
                .first()
                .map(|s| format!(
                    ", {} the most ({})",
                    escape_controls(&s.site),
                    crate::bytes::fmt_bytes(s.bytes)
                ))
                .unwrap_or_default()
        ),
        Verdict::Fragmentation => format!(
            "fragmentation: {} reserved but free inside the caching allocator, no free block of {}",
            crate::bytes::fmt_bytes(o.reserved_unallocated_bytes.unwrap_or(0)),
            crate::bytes::fmt_bytes(o.request_bytes)
        ),
        Verdict::Outside => format!(
            "outside: {} in use that memsnap did not record (CUDA contexts, other processes)",
            crate::bytes::fmt_bytes(o.outside_bytes.unwrap_or(0))
        ),
    };
    Some(format!(
        "verdict: {why}; `memsnap explain {}` says more",
        escape_controls(name)
    ))
}

#[cfg(test)]
pub(crate) mod tests;

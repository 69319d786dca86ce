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

use crate::at::{At, Kind, Resolved};
use crate::device;
use crate::history::History;
use crate::input::{self, Summarized};
use crate::origin::{meta_number, rank_from_name};
use crate::sites::{self, Attribution, Library, Sites};
use crate::tally::Tally;
use leaks::{Leak, StepPoint, Unit};
use log::EventLog;
use memsnap_format::model::{BlockState, Meta, Snapshot, StackId};
use memsnap_format::pickle_read::ReadError;
use memsnap_format::text::escape_controls;
use oom::Verdict;
use owners::Knowledge;
use roles::{Role, Roles, StackRole};
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::Read as IoRead;

/// Sites listed for an OOM.
pub const OOM_SITES: usize = 5;
/// Sites listed as differing between ranks.
pub const DIFFERING_SITES: usize = 5;
/// Share of the live bytes above which one site is looked at as a possible helper.
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
    /// The helper note, when one site holds most of the bytes through several callers.
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

/// Σ of `b` into `a`.
fn merge(a: &mut FxHashMap<Option<StackId>, Tally>, b: &FxHashMap<Option<StackId>, Tally>) {
    for (s, t) in b {
        a.entry(*s).or_default().merge(*t);
    }
}

/// Per-file context for turning stacks into sites, owners and roles.
struct Ctx<'a> {
    snap: &'a Snapshot,
    sites: Sites,
    roles: Vec<StackRole>,
}

impl Ctx<'_> {
    /// Site rows of a live set (requested bytes by stack), largest first; `freed`: the
    /// part freed later (for the backward role).
    fn site_rows(
        &self,
        holders: &FxHashMap<Option<StackId>, Tally>,
        freed: &FxHashMap<Option<StackId>, Tally>,
    ) -> Vec<SiteRow> {
        // Per site: bytes, allocations, and per library and role the bytes.
        type Acc = (Tally, FxHashMap<Library, i64>, FxHashMap<Role, i64>);
        let mut by_site: FxHashMap<u32, Acc> = FxHashMap::default();
        for (stack, t) in holders {
            let acc = by_site.entry(self.sites.site(*stack)).or_default();
            acc.0.merge(*t);
            *acc.1.entry(self.sites.library(*stack)).or_default() += t.bytes;
            for (role, bytes) in self.roles_of(*stack, t.bytes, freed) {
                *acc.2.entry(role).or_default() += bytes;
            }
        }
        fn top<K: Ord + Copy>(m: &FxHashMap<K, i64>) -> Option<K> {
            m.iter()
                .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))
                .map(|(k, _)| *k)
        }
        let mut rows: Vec<SiteRow> = by_site
            .into_iter()
            .map(|(site, (t, libs, roles))| SiteRow {
                site: self.sites.text(site).to_string(),
                bytes: t.bytes,
                allocations: t.count,
                library: top(&libs).unwrap_or(Library::Unknown),
                role: top(&roles).unwrap_or(Role::Other),
            })
            .filter(|r| r.allocations > 0)
            .collect();
        rows.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.site.cmp(&b.site)));
        rows
    }

    /// The roles of `bytes` of `stack`: backward blocks split by what was freed later.
    fn roles_of(
        &self,
        stack: Option<StackId>,
        bytes: i64,
        freed: &FxHashMap<Option<StackId>, Tally>,
    ) -> Vec<(Role, i64)> {
        match roles::of_stack(&self.roles, stack) {
            StackRole::Known(r) => vec![(r, bytes)],
            StackRole::Backward => {
                let f = freed.get(&stack).map_or(0, |t| t.bytes).clamp(0, bytes);
                vec![(Role::Temporaries, f), (Role::Gradients, bytes - f)]
            }
        }
    }

    fn roles(
        &self,
        holders: &FxHashMap<Option<StackId>, Tally>,
        freed: &FxHashMap<Option<StackId>, Tally>,
    ) -> Option<Roles> {
        let framed = holders
            .keys()
            .any(|s| self.snap.stack_frames(*s).next().is_some());
        if !framed {
            return None;
        }
        let mut r = Roles::default();
        for (stack, t) in holders {
            for (role, bytes) in self.roles_of(*stack, t.bytes, freed) {
                r.add(role, bytes);
            }
        }
        Some(r)
    }

    /// When one site holds most of `holders` through several callers: which caller to look
    /// at, and the `--ignore` pattern that names the callers.
    fn helper(
        &self,
        holders: &FxHashMap<Option<StackId>, Tally>,
        attr: &Attribution,
    ) -> Option<String> {
        let total: i64 = holders.values().map(|t| t.bytes).sum();
        let mut by_site: FxHashMap<u32, i64> = FxHashMap::default();
        for (s, t) in holders {
            *by_site.entry(self.sites.site(*s)).or_default() += t.bytes;
        }
        let (&site, &bytes) = by_site
            .iter()
            .max_by_key(|(s, b)| (**b, std::cmp::Reverse(**s)))?;
        if total <= 0 || (bytes as f64) < HELPER_SHARE * total as f64 {
            return None;
        }
        // The site's frame, from its largest stack.
        let (stack, _) = holders
            .iter()
            .filter(|(s, _)| self.sites.site(**s) == site)
            .max_by_key(|(s, t)| (t.bytes, std::cmp::Reverse(**s)))?;
        let frames: Vec<_> = self.snap.stack_frames(*stack).collect();
        let frame = sites::site_frame(&frames, attr)?;
        let pattern = if sites::is_python_frame(frame) {
            frame
                .filename
                .rsplit('/')
                .next()
                .unwrap_or(&frame.filename)
                .to_string()
        } else {
            sites::simplify_cpp(&frame.name)
        };
        if pattern.is_empty() {
            return None;
        }
        let mut ignoring = attr.clone();
        ignoring.ignore.push(pattern.clone());
        let callers = Sites::new(self.snap, &ignoring);
        let mut by_caller: FxHashMap<u32, i64> = FxHashMap::default();
        for (s, t) in holders.iter().filter(|(s, _)| self.sites.site(**s) == site) {
            *by_caller.entry(callers.site(*s)).or_default() += t.bytes;
        }
        if by_caller.len() < 2 {
            return None;
        }
        let (&caller, &caller_bytes) = by_caller
            .iter()
            .max_by_key(|(s, b)| (**b, std::cmp::Reverse(**s)))?;
        Some(format!(
            "{} holds {:.0}% of the live bytes, reached from {} callers: an allocation helper? \
             The largest caller is {} ({}); `--ignore {pattern}` makes the callers the sites, \
             `--callers 2` shows them beside it",
            self.sites.text(site),
            100.0 * bytes as f64 / total as f64,
            by_caller.len(),
            callers.text(caller),
            crate::bytes::fmt_bytes(caller_bytes),
        ))
    }

    /// Free space inside the caching allocator's segments of `device` in the snapshot
    /// itself: Σ and largest inactive block.
    fn end_cache_free(&self, device: i64) -> (i64, i64) {
        let free = self
            .snap
            .segments
            .iter()
            .filter(|s| s.device == device)
            .flat_map(|s| &s.blocks)
            .filter(|b| b.state == BlockState::Inactive)
            .map(|b| b.size);
        let sizes: Vec<i64> = free.collect();
        (sizes.iter().sum(), sizes.iter().copied().max().unwrap_or(0))
    }
}

/// Reduces one file to what `explain` needs. `logs` may be empty (no step marks, no
/// timelines: what `summary` has).
pub fn digest(file: String, loaded: &Summarized, logs: &[EventLog], opts: &Options) -> Digest {
    let Summarized { snap, histories } = loaded;
    let sites = Sites::new(snap, &opts.attr);
    let knowledge = owners::knowledge(snap, &sites);
    let ctx = Ctx {
        snap,
        roles: roles::of_stacks(snap),
        sites,
    };
    let devs = device::devices(snap);
    let capacity = device_meta(snap, "total_bytes");
    // The driver's free bytes when the file was written (memsnap's files, devices whose
    // context was active): with the capacity, what memsnap did not record at the end.
    let free_at_end = device_meta(snap, "free_bytes");
    let mut outside_at_end: Option<i64> = None;
    // memsnap writes the pid where the environment names no rank: no rank then.
    let pid = meta_number(snap, "pid");
    let not_pid = |r: Option<i64>| r.filter(|r| Some(*r) != pid);
    let mut d = Digest {
        rank: match meta_number(snap, "rank") {
            Some(r) => not_pid(Some(r)),
            None => rank_from_name(&file),
        },
        local_rank: not_pid(meta_number(snap, "local_rank")),
        pid,
        reason: meta_str(snap, "reason"),
        step: meta_number(snap, "step"),
        devices: devs.clone(),
        capacity: capacity.clone(),
        torch_allocator: owners::torch_allocator_line(snap).map(str::to_string),
        host: meta_str(snap, "host"),
        exe: meta_str(snap, "exe"),
        seq: meta_number(snap, "seq"),
        events_recorded: meta_number(snap, "events_recorded"),
        file,
        ..Digest::default()
    };
    let dropped = device_meta(snap, "history_dropped");
    // Per device with a history: what its iterations say.
    let mut cuts: Vec<(i64, iterations::Outcome, Vec<StepPoint>)> = Vec::new();
    let mut holders: FxHashMap<Option<StackId>, Tally> = FxHashMap::default();
    let mut freed: FxHashMap<Option<StackId>, Tally> = FxHashMap::default();
    let mut reserved_at = 0;
    let mut moments: Vec<(i64, Resolved)> = Vec::new();
    let mut end_by_site: BTreeMap<String, i64> = BTreeMap::new();
    let mut end_reserved_all = 0;
    let mut timelines = Some(Vec::new());
    let mut first_oom = None;
    for &dev in &devs {
        for pool in device::private_pools(snap, dev) {
            d.notes.push(format!(
                "{}: device {dev}: private {} at the end: a CUDA graph's (torch.compile \
                 mode=\"reduce-overhead\") or a torch.cuda.MemPool's, kept for that pool's own \
                 allocations",
                d.file,
                device::describe_private_pool(&pool)
            ));
        }
        let hist = device::history_of(histories, dev);
        let end = device::end_blocks(snap, dev);
        let end_reserved = device::end_reserved(snap, dev);
        end_reserved_all += end_reserved;
        let end_live: i64 = end.iter().map(|b| b.requested).sum();
        d.live_bytes += end_live;
        d.peak_bytes += hist.peak_live(end_live).0;
        for b in &end {
            *end_by_site
                .entry(ctx.sites.text(ctx.sites.site(b.stack)).to_string())
                .or_default() += b.requested;
        }
        let (at, later) = hist.at_with_end_split(&end, end_reserved);
        merge(&mut holders, &at.holders);
        merge(&mut freed, &later);
        reserved_at += at.reserved;
        if at.moment.kind == Kind::End
            && let (Some(total), Some(free)) = (capacity.get(&dev), free_at_end.get(&dev))
            && *total > 0
        {
            let outside = (total - free - end_reserved).max(0);
            *outside_at_end.get_or_insert(0) += outside;
        }
        moments.push((dev, at.moment));
        for o in hist.ooms_with_end(&end, end_reserved) {
            if first_oom
                .as_ref()
                .is_none_or(|(_, t, _): &(i64, i64, _)| o.oom.time_us < *t)
            {
                let info = (
                    o.oom.requested,
                    o.oom.device_free,
                    o.reserved,
                    o.holders.clone(),
                    hist.changed_after(o.oom.event),
                );
                first_oom = Some((dev, o.oom.time_us, info));
            }
        }
        let log = usize::try_from(dev).ok().and_then(|i| logs.get(i));
        match (log.and_then(|l| l.timeline(end_live)), timelines.as_mut()) {
            (Some(tl), Some(all)) => all.push(tl),
            _ if log.is_none() => {}
            _ => timelines = None,
        }
        // The file's own step marks on this device.
        let marks: Vec<i64> = snap
            .step_marks
            .iter()
            .filter(|m| m.device == dev)
            .map(|m| m.time_us)
            .collect();
        if !marks.is_empty() {
            add_marks(&mut d, &ctx, snap, dev, log, &end, &hist);
        }
        if hist.events > 0
            && let Some(&gone) = dropped.get(&dev)
        {
            d.entries_total.insert(dev, gone + hist.events as i64);
        }
        if let Some(log) = log.filter(|l| l.changes().len() > 0) {
            let end_sites: Vec<(u32, i64)> = end
                .iter()
                .map(|b| (ctx.sites.site(b.stack), b.requested))
                .collect();
            add_motion(&mut d, &ctx, log, &end_sites);
            if snap.step_marks.is_empty() {
                let outcome =
                    iterations::find(log, &|s| ctx.sites.site(s), hist.start_live(end_live));
                let points = match &outcome {
                    iterations::Outcome::Found(f) => iteration_points(&ctx, log, f, &end_sites),
                    _ => Vec::new(),
                };
                cuts.push((dev, outcome, points));
            }
        }
    }
    choose_iterations(&mut d, &ctx, cuts);
    d.timelines = timelines.filter(|t| !t.is_empty());
    // From the first entry to the last, or to the moment the file was written (memsnap's
    // `time_us`): the state then is the snapshot's own.
    let ranges = devs
        .iter()
        .filter_map(|&dev| device::history_of(histories, dev).time_range());
    d.time_range = ranges
        .reduce(|a, b| (a.0.min(b.0), a.1.max(b.1)))
        .map(|(a, b)| {
            let written = meta_number(snap, "time_us").filter(|&w| w >= b);
            (a, written.unwrap_or(b))
        });
    d.written_us = meta_number(snap, "time_us").or(d.time_range.map(|r| r.1));
    d.end_point = StepPoint {
        step: d.step.unwrap_or(0),
        live: d.live_bytes,
        reserved: end_reserved_all,
        by_site: end_by_site,
    };
    // The moment asked for.
    let live: i64 = holders.values().map(|t| t.bytes).sum();
    let is_oom = !moments.is_empty()
        && moments.iter().all(|(_, m)| m.kind != Kind::Peak)
        && moments.iter().any(|(_, m)| m.kind == Kind::Oom);
    d.unreached = device::unreached(moments.iter().map(|(_, m)| m));
    d.instant = Instant {
        moment: describe_moments(&moments),
        oom: is_oom,
        live,
        owners: owners::owners(&ctx.sites, knowledge, &holders, reserved_at, outside_at_end),
        roles: ctx.roles(&holders, &freed),
        sites: ctx.site_rows(&holders, &freed),
        helper: ctx.helper(&holders, &opts.attr),
    };
    if let Some((dev, time_us, (request, free, reserved, oom_holders, changed))) = first_oom {
        let oom_live: i64 = oom_holders.values().map(|t| t.bytes).sum();
        let mut cannot_tell = None;
        let (cache_free, largest) = match knowledge {
            Knowledge::Blocks if !changed => {
                let (sum, largest) = ctx.end_cache_free(dev);
                (Some(sum), Some(largest))
            }
            // Later events changed the segments: free space from the history's sums.
            Knowledge::Blocks => (Some((reserved - oom_live).max(0)), None),
            Knowledge::NoTorch => (Some(0), None),
            Knowledge::Segments => {
                let why = owners::torch_allocator_line(snap)
                    .map(|l| format!("the file says `{l}`"))
                    .unwrap_or_else(|| {
                        "the file was recorded without the caching allocator's blocks".into()
                    });
                cannot_tell = Some(format!(
                    "PyTorch's caching-allocator segments are recorded without their blocks \
                     ({why}): how much of the reserved memory was free inside them, and \
                     whether fragmentation played a part, cannot be told"
                ));
                (None, None)
            }
            Knowledge::Tensors => {
                cannot_tell = Some(
                    "PyTorch allocates each tensor from CUDA (cudaMallocAsync): the free space \
                     of CUDA's own memory pool is not recorded"
                        .into(),
                );
                (None, None)
            }
        };
        let cap = capacity.get(&dev).copied();
        let judged = oom::judge(&oom::Inputs {
            request,
            device_free: free,
            reserved,
            live: oom_live,
            capacity: cap,
            knowledge,
            cache_free,
            largest_free_block: largest,
            expandable: owners::expandable_on(snap),
        });
        let no_freed = if is_oom {
            &freed
        } else {
            &FxHashMap::default()
        };
        d.oom = Some(Oom {
            rank: d.rank,
            pid: d.pid,
            file: d.file.clone(),
            device: dev,
            time_us,
            request_bytes: request,
            device_free_bytes: free,
            verdict: judged.verdict,
            reserved_unallocated_bytes: cache_free,
            largest_free_block_bytes: largest,
            reserved_bytes: reserved,
            live_bytes: oom_live,
            capacity_bytes: cap,
            outside_bytes: judged.outside,
            advice: judged.advice,
            cannot_tell,
            sites: ctx
                .site_rows(&oom_holders, no_freed)
                .into_iter()
                .take(OOM_SITES)
                .collect(),
            owners: owners::owners(
                &ctx.sites,
                knowledge,
                &oom_holders,
                reserved,
                judged.outside,
            ),
            first_rank: None,
            others: Vec::new(),
        });
    }
    d
}

/// Adds how each site moved over `log` to the file's [`Digest::motion`] (summed over
/// devices: the gains add up, the largest fall is the largest).
fn add_motion(d: &mut Digest, ctx: &Ctx, log: &EventLog, end_sites: &[(u32, i64)]) {
    let Some(moved) = log.motion_by_site(&|s| ctx.sites.site(s), ctx.sites.sites.len(), end_sites)
    else {
        return;
    };
    let motion = d.motion.get_or_insert_with(BTreeMap::new);
    for m in moved {
        let e = motion
            .entry(ctx.sites.text(m.site).to_string())
            .or_default();
        e.0 += m.late_gain;
        e.1 = e.1.max(m.largest_fall);
    }
}

/// Live bytes by site at the boundaries of the iterations `f` found in `log` (at most
/// [`iterations::MAX_POINTS`] of them), numbered from 1.
fn iteration_points(
    ctx: &Ctx,
    log: &EventLog,
    f: &iterations::Found,
    end_sites: &[(u32, i64)],
) -> Vec<StepPoint> {
    let picked = iterations::thin(f.boundaries.len(), iterations::MAX_POINTS);
    let positions: Vec<usize> = picked.iter().map(|&i| f.boundaries[i]).collect();
    let Some(by) = log.varying_by_site(
        &|s| ctx.sites.site(s),
        ctx.sites.sites.len(),
        end_sites,
        &positions,
    ) else {
        return Vec::new();
    };
    picked
        .iter()
        .enumerate()
        .map(|(k, &i)| StepPoint {
            step: i as i64 + 1,
            by_site: by
                .series
                .iter()
                .map(|(s, v)| (ctx.sites.text(*s).to_string(), v[k]))
                .collect(),
            live: by.totals[k],
            // Reserved bytes are not followed between boundaries: no cache growth is
            // claimed from iterations.
            reserved: by.totals[k],
        })
        .collect()
}

/// Keeps the device whose history cut the most iterations, else says why none did (for
/// the device with the longest history).
fn choose_iterations(
    d: &mut Digest,
    ctx: &Ctx,
    cuts: Vec<(i64, iterations::Outcome, Vec<StepPoint>)>,
) {
    use iterations::Outcome;
    let best = cuts
        .iter()
        .filter_map(|(dev, o, _)| match o {
            Outcome::Found(f) => Some((f.iterations, std::cmp::Reverse(*dev))),
            _ => None,
        })
        .max();
    let chosen = match best {
        Some((_, std::cmp::Reverse(dev))) => cuts.into_iter().find(|c| c.0 == dev),
        None => cuts.into_iter().max_by_key(|(dev, o, _)| {
            let n = match o {
                Outcome::TooShort { allocations } | Outcome::NoRecurrence { allocations } => {
                    *allocations
                }
                Outcome::Truncated => usize::MAX,
                Outcome::Found(_) => 0,
            };
            (n, std::cmp::Reverse(*dev))
        }),
    };
    let Some((dev, outcome, points)) = chosen else {
        return;
    };
    let mut info = match &outcome {
        Outcome::Found(f) => {
            let site = ctx.sites.text(ctx.sites.site(f.anchor_stack)).to_string();
            d.iteration_starts = f.start_times.clone();
            iterations::Info::found(&d.file, dev, f, site)
        }
        o => iterations::Info::not_found(&d.file, Some(dev), o),
    };
    info.rank = d.rank;
    info.pid = d.pid;
    d.iterations = Some(info);
    d.iteration_points = points;
}

/// The live set by site at each of the file's step marks on `dev` (the state before the
/// first entry at or after the mark's time).
fn add_marks(
    d: &mut Digest,
    ctx: &Ctx,
    snap: &Snapshot,
    dev: i64,
    log: Option<&EventLog>,
    end: &[crate::history::EndBlock],
    hist: &History,
) {
    let mut marks: Vec<(i64, i64)> = snap
        .step_marks
        .iter()
        .filter(|m| m.device == dev)
        .map(|m| (m.time_us, m.step))
        .collect();
    marks.sort_unstable();
    let times: Vec<i64> = marks.iter().map(|m| m.0).collect();
    let Some(states) = log.and_then(|l| l.by_stack_before(end, &times)) else {
        if hist.events > 0 {
            d.notes.push(format!(
                "{}: device {dev}'s history is too long ({} events) to place its step marks",
                d.file, hist.events
            ));
        }
        return;
    };
    for ((_, step), by_stack) in marks.iter().zip(states) {
        let i = match d.marks.iter().position(|p| p.step == *step) {
            Some(i) => i,
            None => {
                d.marks.push(StepPoint {
                    step: *step,
                    ..StepPoint::default()
                });
                d.marks.len() - 1
            }
        };
        let p = &mut d.marks[i];
        for (stack, bytes) in by_stack {
            *p.by_site
                .entry(ctx.sites.text(ctx.sites.site(stack)).to_string())
                .or_default() += bytes;
            p.live += bytes;
        }
        // Reserved bytes are not followed between marks: live stands in, so no cache
        // growth is claimed from marks.
        p.reserved = p.live;
    }
    d.marks.sort_by_key(|p| p.step);
}

fn describe_moments(moments: &[(i64, Resolved)]) -> String {
    crate::at::describe_devices(moments)
}

/// The ranks side by side.
#[derive(Clone, Debug, Serialize)]
pub struct Ranks {
    pub worst_rank: Option<i64>,
    pub median_rank: Option<i64>,
    pub median_peak_bytes: i64,
    pub worst_peak_bytes: i64,
    pub differing_sites: Vec<DifferingSite>,
    /// Ranks whose files allocate on a device that belongs to another rank.
    pub foreign_devices: Vec<ForeignDevice>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DifferingSite {
    pub site: String,
    pub bytes_worst: i64,
    pub bytes_median: i64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ForeignDevice {
    pub rank: i64,
    pub local_rank: i64,
    pub devices: Vec<i64>,
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

fn median_of(mut v: Vec<i64>) -> i64 {
    if v.is_empty() {
        return 0;
    }
    v.sort_unstable();
    v[(v.len() - 1) / 2]
}

/// Live bytes of a file at `time_us` (Σ over devices), from its timelines; `None` when its
/// history does not cover that moment.
fn live_at(d: &Digest, time_us: i64) -> Option<i64> {
    let (first, last) = d.time_range?;
    if time_us < first || time_us > last {
        return None;
    }
    let tls = d.timelines.as_ref()?;
    tls.iter().map(|t| log::at_time(t, time_us)).sum()
}

/// How far ahead the text counts steps until a leak fills the device: a creep measured over
/// tens of step boundaries, carried ten thousand steps on, is a guess about a program that
/// will change before then (docs/EXPLAIN.md, "Leaks"). Beyond it the note says "not within
/// the next 10000 steps"; `steps_to_oom` keeps the figure.
pub const STEPS_HORIZON: i64 = 10_000;

/// One series of boundaries the leak rule runs over: a rank's, what its boundaries are,
/// and the file whose iterations they are.
struct Series<'a> {
    rank: Option<i64>,
    unit: Unit,
    points: Vec<StepPoint>,
    file: Option<&'a Digest>,
}

/// Adds `found` to `leaks`: a site already there with the same unit (another rank's)
/// takes the ranks and the larger figures.
fn add_leaks(leaks: &mut Vec<Leak>, found: Vec<Leak>) {
    for l in found {
        match leaks
            .iter_mut()
            .find(|x| x.site == l.site && x.unit == l.unit)
        {
            Some(x) => {
                x.ranks.extend(l.ranks);
                x.bytes_per_step = x.bytes_per_step.max(l.bytes_per_step);
                x.bytes_per_iteration = x.bytes_per_iteration.max(l.bytes_per_iteration);
                x.live_bytes_at_end = x.live_bytes_at_end.max(l.live_bytes_at_end);
                x.steps = x.steps.max(l.steps);
                x.first_step = x.first_step.min(l.first_step);
                x.last_step = x.last_step.max(l.last_step);
            }
            None => leaks.push(l),
        }
    }
}

/// Puts the digests of every file together.
pub fn build(mut digests: Vec<Digest>) -> Explanation {
    let files = digests.len();
    let mut notes: Vec<String> = Vec::new();
    for d in digests.iter().filter(|d| d.error.is_some()) {
        notes.push(format!(
            "{}: unreadable: {}",
            d.file,
            d.error.as_deref().unwrap_or_default()
        ));
    }
    digests.retain(|d| d.error.is_none());
    let several = digests.len() > 1;
    for d in &digests {
        notes.extend(d.notes.iter().cloned());
    }
    notes.extend(allocator_kinds_differ(&digests));
    // Peak per rank (over its files).
    let mut peak_of_rank: BTreeMap<i64, i64> = BTreeMap::new();
    for d in &digests {
        if let Some(r) = d.rank {
            let p = peak_of_rank.entry(r).or_default();
            *p = (*p).max(d.peak_bytes);
        }
    }
    // 1. The OOM that came first.
    // Ties (a rank's `oom` and `exit` files hold the same OOM): the `oom` file.
    let first = digests
        .iter()
        .filter_map(|d| d.oom.as_ref().map(|o| (o.time_us, d.rank, d)))
        .min_by_key(|(t, r, d)| (*t, *r, d.reason.as_deref() != Some("oom"), d.file.clone()))
        .map(|(_, _, d)| d);
    let mut oom = first.and_then(|d| d.oom.clone());
    if let Some(o) = oom.as_mut() {
        o.first_rank = o.rank;
        let ranks_oomed: Vec<i64> = digests
            .iter()
            .filter(|d| d.oom.is_some())
            .filter_map(|d| d.rank)
            .collect();
        for (&rank, &peak) in &peak_of_rank {
            if Some(rank) == o.rank {
                continue;
            }
            // The rank's file whose history covers the moment, else its latest.
            let files: Vec<&Digest> = digests.iter().filter(|d| d.rank == Some(rank)).collect();
            let covering = files
                .iter()
                .find(|d| {
                    d.time_range
                        .is_some_and(|(a, b)| a <= o.time_us && o.time_us <= b)
                })
                .or_else(|| files.iter().max_by_key(|d| d.time_range.map(|r| r.1)));
            o.others.push(OtherRank {
                rank: Some(rank),
                live_bytes: covering.and_then(|d| live_at(d, o.time_us)),
                peak_bytes: peak,
            });
        }
        if ranks_oomed.iter().any(|r| Some(*r) != o.rank) {
            let mut later: Vec<i64> = ranks_oomed
                .iter()
                .copied()
                .filter(|r| Some(*r) != o.rank)
                .collect();
            later.sort_unstable();
            later.dedup();
            notes.push(format!(
                "rank{} {} ran out of memory too, later",
                if later.len() > 1 { "s" } else { "" },
                later
                    .iter()
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
    }
    // 2. Leaks: per rank, the longest series of step boundaries; a rank without one, the
    // iterations found in its files' histories, and the growth between the snapshots of
    // each of its processes.
    let mut series: BTreeMap<Option<i64>, Vec<StepPoint>> = BTreeMap::new();
    let mut groups: BTreeMap<(Option<i64>, Option<i64>), Vec<StepPoint>> = BTreeMap::new();
    for d in &digests {
        if d.reason.as_deref() == Some("step") && d.step.is_some() {
            groups
                .entry((d.rank, d.pid))
                .or_default()
                .push(d.end_point.clone());
        }
        if d.marks.len() > series.get(&d.rank).map_or(0, Vec::len) {
            series.insert(d.rank, d.marks.clone());
        }
    }
    for ((rank, _), mut pts) in groups {
        pts.sort_by_key(|p| p.step);
        pts.dedup_by_key(|p| p.step);
        if pts.len() > series.get(&rank).map_or(0, Vec::len) {
            series.insert(rank, pts);
        }
    }
    // Ranks with two or more step boundaries are judged by them alone.
    series.retain(|_, pts| pts.len() >= 2);
    let mut all: Vec<Series> = series
        .into_iter()
        .map(|(rank, points)| Series {
            rank,
            unit: Unit::Step,
            points,
            file: None,
        })
        .collect();
    let stepped: Vec<Option<i64>> = all.iter().map(|s| s.rank).collect();
    // The rest: per rank, the file whose history cut the most iterations (or, where none
    // did, the latest file with a history, to say why).
    let mut cut: BTreeMap<Option<i64>, &Digest> = BTreeMap::new();
    let key = |d: &Digest| {
        let i = d.iterations.as_ref();
        (
            i.is_some_and(|i| i.found),
            i.and_then(|i| i.iterations),
            d.written_us,
        )
    };
    for d in digests.iter().filter(|d| !stepped.contains(&d.rank)) {
        if d.iterations.is_some() && cut.get(&d.rank).is_none_or(|c| key(d) > key(c)) {
            cut.insert(d.rank, d);
        }
    }
    let processes = snapshots::groups(&digests);
    let mut iteration_infos: Vec<iterations::Info> = Vec::new();
    // Ranks whose files gave no iterations: (rank, file, why), said in one line.
    let mut none_found: Vec<(Option<i64>, &str, String)> = Vec::new();
    for (rank, d) in cut {
        let Some(info) = d.iterations.clone() else {
            continue;
        };
        if info.found {
            all.push(Series {
                rank,
                unit: Unit::Iteration,
                points: d.iteration_points.clone(),
                file: Some(d),
            });
        } else {
            let why = info.why_not.clone().unwrap_or_default();
            none_found.push((rank, &d.file, why));
        }
        iteration_infos.push(info);
    }
    if let Some((rank, file, why)) = none_found.first() {
        // What would help, unless the process's snapshots are given already.
        let compared = processes
            .iter()
            .any(|g| g.iter().any(|&i| digests[i].rank == *rank));
        let help = if compared {
            String::new()
        } else {
            format!(
                "; what would let explain find leaks: {}",
                iterations::WHAT_WOULD_HELP
            )
        };
        let rank_of =
            |r: &Option<i64>| r.map_or_else(|| "rank not known".into(), |r| format!("rank {r}"));
        let line = match none_found.len() {
            1 => format!(
                "{}no iterations found in {file}: {why}{help}",
                rank.map(|r| format!("rank {r}: ")).unwrap_or_default()
            ),
            n => format!(
                "no iterations found in the records of {n} ranks ({}); {}, {file}: {why}{help}",
                none_found
                    .iter()
                    .map(|(r, _, _)| rank_of(r))
                    .collect::<Vec<_>>()
                    .join(", "),
                rank_of(rank)
            ),
        };
        notes.push(line);
    }
    let ranks_with_series = all
        .iter()
        .map(|s| s.rank)
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    let mut leaks: Vec<Leak> = Vec::new();
    let mut steps_to_oom: Option<i64> = None;
    // Per series with leaks: (rank, what a step is, bytes a step, bytes in use, when).
    let mut creeps: Vec<(Option<i64>, &str, i64, i64, String)> = Vec::new();
    for Series {
        rank,
        unit,
        points: pts,
        file,
    } in &all
    {
        let mut found = leaks::find(pts, *rank, ranks_with_series > 1, *unit);
        // Iterations: live bytes at the end of the file, not at its last boundary.
        for l in &mut found.leaks {
            if let Some(b) = file.and_then(|d| d.end_point.by_site.get(&l.site)) {
                l.live_bytes_at_end = *b;
            }
        }
        if !found.leaks.is_empty() {
            let per_step: i64 = found.leaks.iter().map(|l| l.bytes_per_step).sum();
            let last = pts.last().expect("a series with leaks has points");
            let used = last.reserved.max(last.live);
            let at = format!("at {} {}", unit.as_str(), last.step);
            creeps.push((*rank, unit.as_str(), per_step, used, at));
        }
        notes.extend(found.notes);
        add_leaks(&mut leaks, found.leaks);
    }
    // Snapshots of one process, where its rank has no step boundaries.
    let mut snapshots: Vec<snapshots::Snapshots> = Vec::new();
    for g in processes {
        let files: Vec<&Digest> = g.iter().map(|&i| &digests[i]).collect();
        if stepped.contains(&files[0].rank) {
            continue;
        }
        let mut c = snapshots::compare(&files, ranks_with_series > 1);
        notes.extend(c.notes);
        // A site found leaking per iteration is that leak; the others are added.
        let known: Vec<String> = leaks
            .iter()
            .filter(|l| l.ranks == files[0].rank.into_iter().collect::<Vec<_>>())
            .map(|l| l.site.clone())
            .collect();
        for g in &mut c.snapshots.sites {
            if known.contains(&g.site) {
                g.verdict = snapshots::Verdict::Leak;
            }
        }
        if !c
            .snapshots
            .sites
            .iter()
            .any(|g| g.verdict == snapshots::Verdict::Leak)
        {
            notes.push(format!(
                "{}no leak between {} snapshots of one process",
                c.who,
                files.len()
            ));
        }
        let new: Vec<Leak> = c
            .leaks
            .into_iter()
            .filter(|l| !known.contains(&l.site))
            .collect();
        let per_iteration: Option<i64> = new
            .iter()
            .map(|l| l.bytes_per_iteration)
            .sum::<Option<i64>>()
            .filter(|_| !new.is_empty());
        if let (Some(per), Some(last)) = (per_iteration, files.last()) {
            let used = last.end_point.reserved.max(last.end_point.live);
            let at = "at the last snapshot".to_string();
            creeps.push((files[0].rank, Unit::Iteration.as_str(), per, used, at));
        }
        add_leaks(&mut leaks, new);
        snapshots.push(c.snapshots);
    }
    for (rank, word, per_step, used, at) in creeps {
        let cap = digests
            .iter()
            .filter(|d| d.rank == rank)
            .flat_map(|d| d.capacity.values().copied())
            .max();
        let who = rank.map(|r| format!("rank {r}: ")).unwrap_or_default();
        match cap {
            Some(cap) if per_step > 0 => {
                let n = ((cap - used).max(0) + per_step - 1) / per_step;
                steps_to_oom = Some(steps_to_oom.map_or(n, |s: i64| s.min(n)));
                // Past the horizon the figure says more than the series measured.
                let when = if n > STEPS_HORIZON {
                    format!("not out of memory within the next {STEPS_HORIZON} {word}s")
                } else {
                    format!("out of memory in about {n} {word}s")
                };
                notes.push(format!(
                    "{who}at +{} per {word}, {when} ({} of {} in use {at})",
                    crate::bytes::fmt_bytes(per_step),
                    crate::bytes::fmt_bytes(used),
                    crate::bytes::fmt_bytes(cap),
                ));
            }
            _ => notes.push(format!(
                "{who}the files do not carry the device's capacity \
                 (memsnap.devices[].total_bytes): when the creep runs out of memory cannot be told"
            )),
        }
    }
    leaks.sort_by(|a, b| {
        (a.unit as u8)
            .cmp(&(b.unit as u8))
            .then(b.bytes_per_step.cmp(&a.bytes_per_step))
            .then(a.site.cmp(&b.site))
    });
    // 3, 4. Owners and roles at the moment: the first OOM's file, else the highest peak.
    let focus = first.or_else(|| {
        digests
            .iter()
            .max_by_key(|d| (d.peak_bytes, std::cmp::Reverse(d.file.clone())))
    });
    let (owners, roles, at, sites) = match focus {
        Some(d) => {
            if let Some(h) = &d.instant.helper {
                notes.push(h.clone());
            }
            (
                d.instant.owners.clone(),
                d.instant.roles,
                Some(AtFile {
                    file: d.file.clone(),
                    rank: d.rank,
                    pid: d.pid,
                    moment: d.instant.moment.clone(),
                }),
                d.instant.sites.clone(),
            )
        }
        None => (BTreeMap::new(), None, None, Vec::new()),
    };
    // 5. Ranks side by side.
    let ranks = side_by_side(&digests, &peak_of_rank, &mut notes);
    if several && files > 0 && digests.is_empty() {
        notes.push("no file could be read".into());
    }
    Explanation {
        oom,
        leaks,
        iterations: iteration_infos,
        snapshots,
        owners,
        roles,
        ranks,
        notes,
        at,
        files,
        steps_to_oom,
        sites,
    }
}

/// A note when the files recorded PyTorch's allocator as different kinds (its blocks in
/// some, its segments only in others): their bytes by site are not the same kind of figure,
/// so the ranks compared below differ by more than their memory.
fn allocator_kinds_differ(digests: &[Digest]) -> Option<String> {
    let groups = owners::by_allocator_kind(digests.iter().map(|d| d.torch_allocator.as_deref()));
    if groups.len() < 2 {
        return None;
    }
    let list: Vec<String> = groups
        .iter()
        .map(|(kind, at)| {
            let who: Vec<String> = at
                .iter()
                .map(|&i| {
                    let d = &digests[i];
                    d.rank
                        .map_or_else(|| d.file.clone(), |r| format!("rank {r}"))
                })
                .collect();
            format!("{kind} in {}", who.join(", "))
        })
        .collect();
    Some(format!(
        "PyTorch's allocator was recorded as different kinds: {}. Where only its segments are \
         recorded, a site is the line that grew the cache, not the tensor's: sites compared \
         across these files are not the same kind of figure",
        list.join("; ")
    ))
}

fn side_by_side(
    digests: &[Digest],
    peak_of_rank: &BTreeMap<i64, i64>,
    notes: &mut Vec<String>,
) -> Option<Ranks> {
    // Devices that belong to another rank.
    let mut foreign: Vec<ForeignDevice> = Vec::new();
    for d in digests {
        let (Some(rank), Some(local)) = (d.rank, d.local_rank) else {
            continue;
        };
        let used: Vec<i64> = d.devices.clone();
        if used.is_empty() || used == [local] {
            continue;
        }
        match foreign.iter_mut().find(|f| f.rank == rank) {
            Some(f) => {
                f.devices.extend(used);
                f.devices.sort_unstable();
                f.devices.dedup();
            }
            None => foreign.push(ForeignDevice {
                rank,
                local_rank: local,
                devices: used,
            }),
        }
    }
    for f in &foreign {
        let others: Vec<String> = f
            .devices
            .iter()
            .filter(|&&dv| dv != f.local_rank)
            .map(|dv| format!("device {dv} (local rank {dv}'s)"))
            .collect();
        notes.push(format!(
            "rank {} (LOCAL_RANK {}) allocates on {}: memory on a device that belongs to another \
             rank (unless CUDA_VISIBLE_DEVICES gives each rank its own device 0)",
            f.rank,
            f.local_rank,
            others.join(", ")
        ));
    }
    if peak_of_rank.len() < 2 {
        return (!foreign.is_empty()).then(|| Ranks {
            worst_rank: None,
            median_rank: None,
            median_peak_bytes: 0,
            worst_peak_bytes: 0,
            differing_sites: Vec::new(),
            foreign_devices: foreign,
        });
    }
    let (&worst, &worst_peak) = peak_of_rank
        .iter()
        .max_by_key(|(r, p)| (**p, std::cmp::Reverse(**r)))?;
    let median = median_of(peak_of_rank.values().copied().collect());
    let (&median_rank, _) = peak_of_rank
        .iter()
        .filter(|(r, _)| **r != worst)
        .min_by_key(|(r, p)| ((**p - median).abs(), **r))?;
    // Sites at each rank's moment (its file with the highest peak).
    let sites_of = |rank: i64| -> BTreeMap<String, i64> {
        digests
            .iter()
            .filter(|d| d.rank == Some(rank))
            .max_by_key(|d| d.peak_bytes)
            .map(|d| {
                d.instant
                    .sites
                    .iter()
                    .map(|s| (s.site.clone(), s.bytes))
                    .collect()
            })
            .unwrap_or_default()
    };
    let (w, m) = (sites_of(worst), sites_of(median_rank));
    let mut differing: Vec<DifferingSite> = w
        .keys()
        .chain(m.keys())
        .map(|s| DifferingSite {
            site: s.clone(),
            bytes_worst: w.get(s).copied().unwrap_or(0),
            bytes_median: m.get(s).copied().unwrap_or(0),
        })
        .filter(|d| d.bytes_worst != d.bytes_median)
        .collect();
    differing.sort_by(|a, b| {
        (b.bytes_worst - b.bytes_median)
            .abs()
            .cmp(&(a.bytes_worst - a.bytes_median).abs())
            .then(a.site.cmp(&b.site))
    });
    differing.dedup_by(|a, b| a.site == b.site);
    differing.truncate(DIFFERING_SITES);
    Some(Ranks {
        worst_rank: Some(worst),
        median_rank: Some(median_rank),
        median_peak_bytes: median,
        worst_peak_bytes: worst_peak,
        differing_sites: differing,
        foreign_devices: foreign,
    })
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

//! One file reduced to what `explain` needs ([`Digest`]): its sites, owners and roles at the
//! moment asked for, its OOM, its step marks and iterations, and how each site moved. Runs on
//! the file's own reading thread. Cold code.

use super::leaks::StepPoint;
use super::log::EventLog;
use super::owners::{self, Knowledge};
use super::roles::{self, Role, Roles, StackRole};
use super::{
    Digest, HELPER_SHARE, Instant, OOM_SITES, Oom, Options, SiteRow, device_meta, iterations,
    meta_str, oom,
};
use crate::at::{Kind, Resolved};
use crate::device;
use crate::history::History;
use crate::input::Summarized;
use crate::origin::{meta_number, rank_from_name};
use crate::sites::{self, Attribution, HelperRule, Library, Sites, StackBytes};
use crate::tally::Tally;
use memsnap_format::model::{BlockState, Snapshot, StackId};
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;

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
    /// What each stack allocated (helpers are found from it).
    bytes: StackBytes,
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
                via: self.sites.via(site).map(str::to_string),
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

    /// Under `--at-helpers`, when one site holds most of `holders` and is a helper: the
    /// note naming its calling lines (the sites it would have been shown at).
    fn helper_note(
        &self,
        holders: &FxHashMap<Option<StackId>, Tally>,
        attr: &Attribution,
    ) -> Option<String> {
        if attr.helpers != HelperRule::Off || attr.callers.is_some() {
            return None;
        }
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
        let found = Attribution {
            helpers: HelperRule::Find,
            ..attr.clone()
        };
        let at_callers = Sites::new(self.snap, &found, &self.bytes);
        let mut by_caller: FxHashMap<u32, i64> = FxHashMap::default();
        for (s, t) in holders.iter().filter(|(s, _)| self.sites.site(**s) == site) {
            let c = at_callers.site(*s);
            if at_callers.via(c).is_some() {
                *by_caller.entry(c).or_default() += t.bytes;
            }
        }
        if by_caller.len() < 2 {
            return None;
        }
        let (&caller, &caller_bytes) = by_caller
            .iter()
            .max_by_key(|(s, b)| (**b, std::cmp::Reverse(**s)))?;
        let text = at_callers.text(caller);
        let line = at_callers
            .via(caller)
            .and_then(|via| text.strip_suffix(&format!("{}{via}", sites::VIA)))
            .unwrap_or(text);
        Some(format!(
            "{} holds {:.0}% of the live bytes and is a helper: it allocates for {} calling \
             lines, the largest {line} ({}); without --at-helpers they are the sites",
            self.sites.text(site),
            100.0 * bytes as f64 / total as f64,
            by_caller.len(),
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
    let bytes = loaded.stack_bytes();
    let sites = Sites::new(snap, &opts.attr, &bytes);
    let knowledge = owners::knowledge(snap, &sites);
    let ctx = Ctx {
        snap,
        roles: roles::of_stacks(snap),
        sites,
        bytes,
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
    d.helpers = ctx.sites.helpers().clone();
    d.via = ctx
        .sites
        .sites
        .iter()
        .filter_map(|s| Some((s.text.clone(), s.via.clone()?)))
        .collect();
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
        helper: ctx.helper_note(&holders, &opts.attr),
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

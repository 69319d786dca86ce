//! What `memsnap top` shows, computed from the samples the processes answer: per device
//! live/reserved/peak with a short history for the sparkline, live bytes by site (the
//! same site rules as `memsnap summary`, from `memsnap_engine::sites`), growth against a
//! baseline, steps per second, and the OOM events seen while watching.
//!
//! Helpers are found from the live bytes of every sample so far, and stay helpers once
//! found; live bytes are kept by stack and named by the current rules when shown, so a
//! baseline taken before a helper was found compares like with like.
//!
//! Cold, no I/O: the terminal view (`ui`), the plain lines and `--json` all read this.

use memsnap_engine::bytes::fmt_bytes;
use memsnap_engine::sites::{Attribution, HelperRule, Helpers, SiteKind, Sites, StackBytes};
use memsnap_format::live::{DeviceSample, Sample};
use memsnap_format::model::Frame;
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::collections::VecDeque;

/// Samples kept per device for the sparkline: five minutes at one per second.
pub const HISTORY: usize = 300;
/// The site of blocks recorded without frames (the text `summary` uses).
const NO_FRAMES: &str = "<no frames recorded>";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SortBy {
    Live,
    Count,
    Growth,
}

impl SortBy {
    pub fn next(self) -> SortBy {
        match self {
            SortBy::Live => SortBy::Count,
            SortBy::Count => SortBy::Growth,
            SortBy::Growth => SortBy::Live,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            SortBy::Live => "live bytes",
            SortBy::Count => "count",
            SortBy::Growth => "growth",
        }
    }
}

/// What growth is measured against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Baseline {
    /// The first sample taken.
    Start,
    /// The first sample after the most recent step boundary.
    LastStep,
}

/// One allocation site: live bytes and blocks now, and growth against the baseline.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SiteRow {
    pub site: String,
    pub kind: SiteKind,
    /// The helper the bytes went through, where the site is its calling line.
    pub via: Option<String>,
    pub bytes: u64,
    pub count: u64,
    pub growth: i64,
}

impl SiteRow {
    fn empty(site: &SiteName) -> SiteRow {
        SiteRow {
            site: site.text.clone(),
            kind: site.kind,
            via: site.via.clone(),
            bytes: 0,
            count: 0,
            growth: 0,
        }
    }
}

/// One device of one process now.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DeviceRow {
    pub pid: u32,
    #[serde(flatten)]
    pub now: DeviceSample,
    /// Live bytes over the last samples, oldest first.
    #[serde(skip)]
    pub history: Vec<u64>,
}

/// How a stack's site is shown.
#[derive(Clone, Debug)]
struct SiteName {
    text: String,
    kind: SiteKind,
    via: Option<String>,
}

/// Live bytes and blocks of one sample by stack (`None`: recorded without frames).
type StackTotals = FxHashMap<Option<u32>, (u64, u64)>;

/// One watched process: its latest sample and what is remembered across samples.
pub struct Watched {
    pub pid: u32,
    pub last: Sample,
    /// The process's frames and stacks so far (answers carry only the new ones), and the
    /// site of each stack, by `summary`'s rules.
    frames: Vec<Frame>,
    stacks: Vec<Vec<u32>>,
    stack_sites: Vec<SiteName>,
    /// The site of blocks recorded without frames.
    no_frames: SiteName,
    /// Live bytes by stack summed over the samples so far (what helpers are found from),
    /// and the helpers found.
    held: StackBytes,
    helpers: Helpers,
    now: StackTotals,
    start: StackTotals,
    step: StackTotals,
    history: FxHashMap<u32, VecDeque<u64>>,
    /// (time, step) of the first sample, for steps per second.
    first: (u64, u64),
    /// (time, step) when the step last changed, and the one before, for the current rate.
    step_marks: VecDeque<(u64, u64)>,
    ooms_seen: u64,
    pub gone: Option<String>,
    /// `--ignore` and `--callers`, as in `summary`.
    attr: Attribution,
}

impl Watched {
    pub fn new(mut sample: Sample, attr: Attribution) -> Watched {
        let mut w = Watched {
            pid: sample.pid,
            first: (sample.time_us, sample.step),
            step_marks: VecDeque::from([(sample.time_us, sample.step)]),
            ooms_seen: sample.devices.iter().map(|d| d.ooms).sum(),
            frames: Vec::new(),
            stacks: Vec::new(),
            stack_sites: Vec::new(),
            no_frames: SiteName {
                text: NO_FRAMES.to_string(),
                kind: SiteKind::None,
                via: None,
            },
            held: StackBytes::default(),
            helpers: Helpers::default(),
            now: StackTotals::default(),
            start: StackTotals::default(),
            step: StackTotals::default(),
            history: FxHashMap::default(),
            last: Sample::default(),
            gone: None,
            attr,
        };
        w.absorb(&mut sample);
        w.now = by_stack(&sample);
        w.start = w.now.clone();
        w.step = w.now.clone();
        w.last = sample;
        w.remember_live();
        w
    }

    /// How many frames and stacks of the process this view holds (the next request asks
    /// only for the ones after them).
    pub fn known(&self) -> (u32, u32) {
        (self.frames.len() as u32, self.stacks.len() as u32)
    }

    /// Takes the frames, stacks and live bytes a sample carries, and names the sites of the
    /// new stacks (of every stack when a helper was found).
    fn absorb(&mut self, sample: &mut Sample) {
        self.frames.truncate(sample.frames_from as usize);
        self.frames.append(&mut sample.frames);
        self.stacks.truncate(sample.stacks_from as usize);
        self.stacks.append(&mut sample.stacks);
        self.stack_sites
            .truncate(self.stacks.len().min(sample.stacks_from as usize));
        for g in &sample.groups {
            self.held.add(g.stack, g.bytes as i64);
        }
        let mut helpers = self.helpers.clone();
        if self.attr.helpers == HelperRule::Find {
            helpers.union(&self.attr.helpers_of(&self.frames, &self.stacks, &self.held));
        }
        if helpers != self.helpers {
            self.helpers = helpers;
            self.stack_sites.clear();
        }
        let new = &self.stacks[self.stack_sites.len()..];
        let rules = self.attr.with_helpers(self.helpers.clone());
        let sites = Sites::of_stacks(&self.frames, new, false, &rules, &StackBytes::default());
        for i in 0..new.len() {
            let site = sites.site(Some(i as u32));
            let s = &sites.sites[site as usize];
            self.stack_sites.push(SiteName {
                text: s.text.clone(),
                kind: s.kind,
                via: s.via.clone(),
            });
        }
    }

    /// Live bytes by site of `totals` (by stack), by the current rules.
    fn site_totals(&self, totals: &StackTotals) -> FxHashMap<&str, (&SiteName, u64, u64)> {
        let mut out: FxHashMap<&str, (&SiteName, u64, u64)> = FxHashMap::default();
        for (stack, &(bytes, count)) in totals {
            let name = stack
                .and_then(|s| self.stack_sites.get(s as usize))
                .unwrap_or(&self.no_frames);
            let e = out.entry(name.text.as_str()).or_insert((name, 0, 0));
            e.1 += bytes;
            e.2 += count;
        }
        out
    }

    /// Takes a new sample; returns the lines of OOMs that happened since the last one.
    pub fn update(&mut self, mut sample: Sample) -> Vec<String> {
        self.absorb(&mut sample);
        let now = by_stack(&sample);
        if sample.step != self.last.step {
            self.step = now.clone();
            self.step_marks.push_back((sample.time_us, sample.step));
            if self.step_marks.len() > 10 {
                self.step_marks.pop_front();
            }
        }
        let ooms: u64 = sample.devices.iter().map(|d| d.ooms).sum();
        let mut events = Vec::new();
        if ooms > self.ooms_seen {
            let what = match &sample.last_oom {
                Some(o) => format!(
                    "device {} could not allocate {}{}",
                    o.device,
                    fmt_bytes(o.requested_bytes as i64),
                    if o.device_free >= 0 {
                        format!(" ({} free)", fmt_bytes(o.device_free))
                    } else {
                        String::new()
                    }
                ),
                None => "out of memory".to_string(),
            };
            let more = ooms - self.ooms_seen;
            events.push(format!(
                "pid {}: OOM: {what}{}; `memsnap explain` on its oom snapshot says why",
                self.pid,
                if more > 1 {
                    format!(" ({more} OOM errors since the last sample)")
                } else {
                    String::new()
                }
            ));
            self.ooms_seen = ooms;
        }
        self.now = now;
        self.last = sample;
        self.remember_live();
        events
    }

    fn remember_live(&mut self) {
        for d in &self.last.devices {
            let h = self.history.entry(d.device).or_default();
            h.push_back(d.live_bytes);
            if h.len() > HISTORY {
                h.pop_front();
            }
        }
    }

    /// Steps per second over the recent step changes (`None` before two steps were seen).
    pub fn steps_per_s(&self) -> Option<f64> {
        let (&(t0, s0), &(t1, s1)) = (self.step_marks.front()?, self.step_marks.back()?);
        let (t0, s0) = if self.step_marks.len() == 1 {
            self.first
        } else {
            (t0, s0)
        };
        (t1 > t0 && s1 > s0).then(|| (s1 - s0) as f64 / ((t1 - t0) as f64 / 1e6))
    }

    pub fn devices(&self) -> Vec<DeviceRow> {
        self.last
            .devices
            .iter()
            .map(|d| DeviceRow {
                pid: self.pid,
                now: d.clone(),
                history: self
                    .history
                    .get(&d.device)
                    .map(|h| h.iter().copied().collect())
                    .unwrap_or_default(),
            })
            .collect()
    }

    fn baseline(&self, baseline: Baseline) -> &StackTotals {
        match baseline {
            Baseline::Start => &self.start,
            Baseline::LastStep => &self.step,
        }
    }
}

/// Live bytes and blocks of a sample by stack, over all its devices.
fn by_stack(sample: &Sample) -> StackTotals {
    let mut out = StackTotals::default();
    for g in &sample.groups {
        let e = out.entry(g.stack).or_default();
        e.0 += g.bytes;
        e.1 += g.count;
    }
    out
}

/// Site rows over all watched processes, sorted.
pub fn site_rows(watched: &[Watched], sort: SortBy, baseline: Baseline) -> Vec<SiteRow> {
    let mut rows: FxHashMap<String, SiteRow> = FxHashMap::default();
    for w in watched.iter().filter(|w| w.gone.is_none()) {
        let base = w.site_totals(w.baseline(baseline));
        let now = w.site_totals(&w.now);
        for (site, &(name, bytes, count)) in &now {
            let r = rows
                .entry(site.to_string())
                .or_insert_with(|| SiteRow::empty(name));
            r.bytes += bytes;
            r.count += count;
            r.growth += bytes as i64 - base.get(site).map_or(0, |b| b.1 as i64);
        }
        // Sites that held memory at the baseline and hold none now shrank to zero.
        for (site, &(name, bytes, _)) in &base {
            if !now.contains_key(site) {
                let r = rows
                    .entry(site.to_string())
                    .or_insert_with(|| SiteRow::empty(name));
                r.growth -= bytes as i64;
            }
        }
    }
    let mut rows: Vec<SiteRow> = rows
        .into_values()
        .filter(|r| r.bytes > 0 || r.growth != 0)
        .collect();
    rows.sort_by(|a, b| {
        let key = |r: &SiteRow| match sort {
            SortBy::Live => (r.bytes as i128, r.count as i128),
            SortBy::Count => (r.count as i128, r.bytes as i128),
            SortBy::Growth => (r.growth as i128, r.bytes as i128),
        };
        key(b).cmp(&key(a)).then_with(|| a.site.cmp(&b.site))
    });
    rows
}

/// The `--json` object of one process.
#[derive(Serialize)]
pub struct ProcessJson {
    pub pid: u32,
    pub step: u64,
    pub steps_per_s: Option<f64>,
    pub devices: Vec<DeviceRow>,
    pub live_bytes: u64,
    pub sites: Vec<SiteRow>,
    pub last_oom: Option<memsnap_format::live::OomSample>,
    pub events_recorded: u64,
    pub dropped_events: u64,
    pub events_without_stack: u64,
}

pub fn process_json(w: &Watched) -> ProcessJson {
    let devices = w.devices();
    ProcessJson {
        pid: w.pid,
        step: w.last.step,
        steps_per_s: w.steps_per_s(),
        live_bytes: devices.iter().map(|d| d.now.live_bytes).sum(),
        devices,
        sites: site_rows(std::slice::from_ref(w), SortBy::Live, Baseline::Start),
        last_oom: w.last.last_oom.clone(),
        events_recorded: w.last.events_recorded,
        dropped_events: w.last.dropped_events,
        events_without_stack: w.last.events_without_stack,
    }
}

/// The plain-text lines of one refresh (stdout is not a terminal, or `--once`): one per
/// device, then the largest sites under a column header. `growth`: with the growth since
/// `top` started (a refresh); `--once` has a single sample, where growth is always 0, and
/// leaves the column out.
pub fn plain_lines(watched: &[Watched], top: usize, growth: bool) -> Vec<String> {
    let mut lines = Vec::new();
    for w in watched.iter().filter(|w| w.gone.is_none()) {
        let rate = w
            .steps_per_s()
            .map(|r| format!(" ({r:.2}/s)"))
            .unwrap_or_default();
        for d in w.devices() {
            lines.push(format!(
                "pid {} step {}{rate} device {}: live {} reserved {} peak {} in {} allocations{}",
                w.pid,
                w.last.step,
                d.now.device,
                fmt_bytes(d.now.live_bytes as i64),
                fmt_bytes(d.now.reserved_bytes as i64),
                fmt_bytes(d.now.peak_bytes as i64),
                d.now.live_allocations,
                if d.now.ooms > 0 {
                    format!(", {} OOM", d.now.ooms)
                } else {
                    String::new()
                }
            ));
        }
    }
    let rows = site_rows(watched, SortBy::Live, Baseline::Start);
    let rows = &rows[..rows.len().min(top)];
    if !rows.is_empty() {
        lines.push(if growth {
            format!(
                "  {:>10} {:>7} {:>11}  {}",
                "live", "allocs", "growth", "allocation site (growth: since top started)"
            )
        } else {
            format!("  {:>10} {:>7}  {}", "live", "allocs", "allocation site")
        });
    }
    for r in rows {
        let count = format!("{}x", r.count);
        lines.push(if growth {
            format!(
                "  {:>10} {count:>7} {:>11}  {}",
                fmt_bytes(r.bytes as i64),
                signed_bytes(r.growth),
                r.site
            )
        } else {
            format!("  {:>10} {count:>7}  {}", fmt_bytes(r.bytes as i64), r.site)
        });
    }
    lines
}

/// `+1.0 MiB`, `-512 B`, `0`.
pub fn signed_bytes(b: i64) -> String {
    match b.signum() {
        0 => "0".to_string(),
        1 => format!("+{}", fmt_bytes(b)),
        _ => fmt_bytes(b),
    }
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use memsnap_format::live::LiveGroup;

    /// A process holding `weights` bytes from train.py:12 and `cache` bytes from a native
    /// frame, at step `step`.
    pub fn sample(pid: u32, step: u64, time_s: u64, weights: u64, cache: u64) -> Sample {
        let frame = |name: &str, filename: &str, line| Frame {
            name: name.into(),
            filename: filename.into(),
            line,
        };
        Sample {
            version: 1,
            pid,
            time_us: time_s * 1_000_000,
            step,
            devices: vec![DeviceSample {
                device: 0,
                live_bytes: weights + cache,
                reserved_bytes: weights + cache,
                peak_bytes: weights + cache,
                live_allocations: 3,
                ooms: 0,
            }],
            frames: vec![
                frame("cudaMalloc", "libcudart.so", 0),
                frame("build", "proj/train.py", 12),
                frame("kv_cache_alloc", "src/cache.cc", 40),
            ],
            stacks: vec![vec![0, 1], vec![0, 2]],
            groups: vec![
                LiveGroup {
                    device: 0,
                    stack: Some(0),
                    bytes: weights,
                    count: 2,
                },
                LiveGroup {
                    device: 0,
                    stack: Some(1),
                    bytes: cache,
                    count: 1,
                },
            ],
            ..Sample::default()
        }
    }

    #[test]
    fn sites_follow_summary_rules_and_grow_against_the_baseline() {
        let mut w = Watched::new(sample(1, 0, 0, 1000, 500), Attribution::default());
        w.update(sample(1, 4, 2, 1000, 4500));
        let rows = site_rows(std::slice::from_ref(&w), SortBy::Live, Baseline::Start);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].site, "kv_cache_alloc (cache.cc:40)");
        assert_eq!(
            (rows[0].bytes, rows[0].count, rows[0].growth),
            (4500, 1, 4000)
        );
        assert_eq!(rows[1].site, "proj/train.py:12 (build)");
        assert_eq!((rows[1].bytes, rows[1].growth), (1000, 0));
        let by_count = site_rows(std::slice::from_ref(&w), SortBy::Count, Baseline::Start);
        assert_eq!(by_count[0].site, "proj/train.py:12 (build)");
        // Since the last step: the step changed with this very sample.
        let since_step = site_rows(std::slice::from_ref(&w), SortBy::Growth, Baseline::LastStep);
        assert!(since_step.iter().all(|r| r.growth == 0));
        assert_eq!(w.steps_per_s(), Some(2.0));
        assert_eq!(w.devices()[0].history, vec![1500, 5500]);
    }

    #[test]
    fn plain_lines_have_a_column_header() {
        let mut w = Watched::new(sample(7, 0, 0, 1000, 500), Attribution::default());
        let once = plain_lines(std::slice::from_ref(&w), 10, false);
        assert_eq!(
            once[0],
            "pid 7 step 0 device 0: live 1.5 KiB reserved 1.5 KiB peak 1.5 KiB in 3 allocations"
        );
        assert_eq!(once[1], "        live  allocs  allocation site");
        assert_eq!(once[2], "      1000 B      2x  proj/train.py:12 (build)");
        assert_eq!(once.len(), 4);
        w.update(sample(7, 1, 1, 1000, 2548));
        let refresh = plain_lines(std::slice::from_ref(&w), 1, true);
        assert_eq!(
            refresh[1],
            "        live  allocs      growth  allocation site (growth: since top started)"
        );
        assert_eq!(
            refresh[2],
            "     2.5 KiB      1x    +2.0 KiB  kv_cache_alloc (cache.cc:40)"
        );
        assert_eq!(refresh.len(), 3, "--top 1: one row");
    }

    #[test]
    fn an_oom_is_reported_once() {
        let mut w = Watched::new(sample(1, 0, 0, 1, 1), Attribution::default());
        let mut s = sample(1, 0, 1, 1, 1);
        s.devices[0].ooms = 1;
        s.last_oom = Some(memsnap_format::live::OomSample {
            device: 0,
            time_us: 1,
            requested_bytes: 2 << 30,
            device_free: 1 << 20,
        });
        let events = w.update(s.clone());
        assert_eq!(
            events,
            vec![
                "pid 1: OOM: device 0 could not allocate 2.0 GiB (1.0 MiB free); \
                 `memsnap explain` on its oom snapshot says why"
                    .to_string()
            ]
        );
        assert!(w.update(s).is_empty());
    }

    #[test]
    fn a_helper_found_later_names_the_baseline_alike() {
        // `wrap` (app.cc:5) is called from main:10 and main:20; the first sample holds
        // memory from main:10 only.
        let frame = |name: &str, line| Frame {
            name: name.into(),
            filename: "src/app.cc".into(),
            line,
        };
        let group = |stack, bytes| LiveGroup {
            device: 0,
            stack: Some(stack),
            bytes,
            count: 1,
        };
        let mut first = sample(3, 0, 0, 0, 0);
        first.frames = vec![frame("wrap", 5), frame("main", 10), frame("main", 20)];
        first.stacks = vec![vec![0, 1], vec![0, 2]];
        first.groups = vec![group(0, 600)];
        let mut w = Watched::new(first, Attribution::default());
        let rows = site_rows(std::slice::from_ref(&w), SortBy::Live, Baseline::Start);
        assert_eq!(rows[0].site, "wrap (app.cc:5)");
        assert_eq!(rows[0].via, None);
        let mut next = sample(3, 0, 1, 0, 0);
        (next.frames_from, next.stacks_from) = (3, 2);
        (next.frames, next.stacks) = (Vec::new(), Vec::new());
        next.groups = vec![group(0, 700), group(1, 400)];
        w.update(next);
        let rows = site_rows(std::slice::from_ref(&w), SortBy::Live, Baseline::Start);
        let got: Vec<(&str, Option<&str>, u64, i64)> = rows
            .iter()
            .map(|r| (r.site.as_str(), r.via.as_deref(), r.bytes, r.growth))
            .collect();
        assert_eq!(
            got,
            [
                (
                    "main (app.cc:10) via wrap (app.cc:5)",
                    Some("wrap (app.cc:5)"),
                    700,
                    100
                ),
                (
                    "main (app.cc:20) via wrap (app.cc:5)",
                    Some("wrap (app.cc:5)"),
                    400,
                    400
                ),
            ]
        );
    }

    #[test]
    fn later_answers_carry_only_new_frames() {
        let mut w = Watched::new(sample(1, 0, 0, 1000, 500), Attribution::default());
        assert_eq!(w.known(), (3, 2));
        // The next answer: no new frame, a new stack over known frames, and a block
        // without frames.
        let mut next = sample(1, 0, 1, 1000, 500);
        next.frames_from = 3;
        next.frames.clear();
        next.stacks_from = 2;
        next.stacks = vec![vec![2]];
        next.groups.push(LiveGroup {
            device: 0,
            stack: Some(2),
            bytes: 64,
            count: 1,
        });
        next.groups.push(LiveGroup {
            device: 0,
            stack: None,
            bytes: 32,
            count: 4,
        });
        w.update(next);
        assert_eq!(w.known(), (3, 3));
        let rows = site_rows(std::slice::from_ref(&w), SortBy::Live, Baseline::Start);
        let cache = rows
            .iter()
            .find(|r| r.site.starts_with("kv_cache_alloc"))
            .unwrap();
        assert_eq!((cache.bytes, cache.count), (564, 2));
        let none = rows.iter().find(|r| r.site == NO_FRAMES).unwrap();
        assert_eq!((none.bytes, none.count, none.kind), (32, 4, SiteKind::None));
    }
}

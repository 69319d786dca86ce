//! `memsnap whatif`'s model: a recorded run replayed through a model of PyTorch's CUDA
//! caching allocator under other settings (`--set`), another backend, or larger requests of
//! some roles (`--scale`), and whether it would have fitted. The file's own settings come
//! first ("as recorded"): that replay must give back the recorded segments, which is how
//! the model is trusted. docs/WHATIF.md has the rules, what is replayed and what is refused.
//!
//! [`settings`] parses `PYTORCH_CUDA_ALLOC_CONF`, [`trace`] reads a device's history into
//! requests, [`model`] is the allocator, [`replay`] runs one scenario; [`whatif`] puts them
//! together (scenarios on threads of their own). Cold code.

pub mod model;
pub mod replay;
pub mod settings;
#[cfg(test)]
mod tests;
pub mod trace;

use crate::bytes::fmt_bytes;
use crate::explain::device_meta;
use crate::explain::roles::Role;
use crate::sites::{Attribution, Library, Sites, StackBytes};
use memsnap_format::model::{Meta, Snapshot, StackId};
use replay::{Limits, Outcome, Scenario};
use serde::Serialize;
use settings::{Backend, NEWEST, Release, Settings};
use trace::{DeviceTrace, Op, Source};

/// What to replay.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// `--set`: one scenario each, the run as if `PYTORCH_CUDA_ALLOC_CONF` had been this text
    /// (empty: PyTorch's defaults). None given: [`DEFAULT_SETS`].
    pub sets: Vec<String>,
    /// `--scale`: one scenario each, `ROLE=FACTOR[,ROLE=FACTOR...]`, under the recorded
    /// settings and under each `--set`.
    pub scales: Vec<String>,
    /// `--device-memory`: the device's capacity in place of the recorded one.
    pub device_memory: Option<i64>,
    pub attr: Attribution,
}

/// The scenarios tried when none is asked for (those the recording did not already use).
pub const DEFAULT_SETS: &[&str] = &[
    "expandable_segments:True",
    "max_split_size_mb:128",
    "backend:cudaMallocAsync",
];
/// For a file recorded under `backend:cudaMallocAsync`.
pub const DEFAULT_SETS_FROM_ASYNC: &[&str] =
    &["backend:native", "backend:native,expandable_segments:True"];

/// The label of the first scenario.
pub const AS_RECORDED: &str = "as recorded";
/// The label of `--set ""`: PyTorch's default settings.
pub const DEFAULTS: &str = "defaults";

/// What `whatif` answers (the `--json` shape: docs/WHATIF.md, "JSON").
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The first scenario is always the recording's own settings.
    pub scenarios: Vec<Row>,
    /// The PyTorch release whose rules were followed, and whether the file said so.
    pub release: String,
    pub release_assumed: bool,
    /// The recorded settings, as `PYTORCH_CUDA_ALLOC_CONF` writes them.
    pub recorded_settings: String,
    /// Per device: how the replay as recorded compares with the recording.
    pub checks: Vec<Check>,
    /// The recording's out-of-memory error and the scenarios that avoid it.
    pub recorded_oom: Option<RecordedOom>,
    pub notes: Vec<String>,
}

/// One scenario on one device.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Row {
    pub setting: String,
    pub device: i64,
    pub peak_reserved_bytes: Option<i64>,
    pub peak_allocated_bytes: Option<i64>,
    pub segments_at_peak: Option<i64>,
    pub reserved_unallocated_bytes_at_peak: Option<i64>,
    pub largest_free_block_bytes_at_peak: Option<i64>,
    pub capacity_bytes: Option<i64>,
    /// `null`: the capacity is not known, or the scenario was refused.
    pub fits: Option<bool>,
    pub oom: Option<OomRow>,
    /// Why the scenario could not be modelled.
    pub refused: Option<String>,
}

/// Where a scenario runs out of memory.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct OomRow {
    pub request_bytes: i64,
    pub site: String,
    /// The entry of the device's history (`--at` numbers them the same way).
    pub event: i64,
    /// Another library's allocation, not PyTorch's.
    pub outside: bool,
}

/// The replay as recorded set against the recording.
#[derive(Clone, Debug, Serialize)]
pub struct Check {
    pub device: i64,
    /// Same segments (each taken or given back, at the same request, of the same size),
    /// the same peak of reserved bytes, the same segments and blocks at the end.
    pub reproduced: bool,
    pub divergence: Option<String>,
    pub segment_operations: i64,
    pub matched: i64,
    pub recorded_peak_reserved_bytes: i64,
    pub model_peak_reserved_bytes: i64,
    /// Where the history begins mid-run: the state it begins from.
    pub starts_mid_run: bool,
}

/// The recording's out-of-memory error.
#[derive(Clone, Debug, Serialize)]
pub struct RecordedOom {
    pub device: i64,
    pub request_bytes: i64,
    pub site: String,
    pub event: i64,
    /// Scenarios that get past it (some may still run out later: see their rows).
    pub avoided_by: Vec<String>,
    pub not_avoided_by: Vec<String>,
}

/// Replays `snap` under the scenarios `opts` asks for. `Err`: the file cannot be replayed
/// at all (no PyTorch requests in it, a release or settings the model does not follow, a
/// malformed `--scale`).
pub fn whatif(snap: &Snapshot, opts: &Options) -> Result<Report, String> {
    let mut notes = Vec::new();
    let source = source(snap)?;
    let (release, assumed) = release(snap);
    if !release.modelled() {
        return Err(format!(
            "PyTorch {release}: the model follows the caching allocator of releases {} to \
             {} only",
            settings::OLDEST,
            NEWEST
        ));
    }
    if assumed {
        notes.push(format!(
            "the file does not say which PyTorch release wrote it: the rules of {NEWEST}, the \
             newest modelled, are assumed"
        ));
    }
    let recorded = recorded_settings(snap, release, source, &mut notes)?;
    let scales = opts
        .scales
        .iter()
        .map(|s| parse_scale(s).map(|v| (s.clone(), v)))
        .collect::<Result<Vec<_>, _>>()?;
    let scenarios = scenarios(&recorded, release, opts, &scales, &mut notes);
    let sites = Sites::new(snap, &opts.attr, &StackBytes::of_whole(snap));
    let site_of = |stack| sites.text(sites.site(stack)).to_string();
    let torch = |stack| sites.library(stack) == Library::Torch;
    let devices: Vec<DeviceTrace> = trace::devices(snap, source, &torch)
        .into_iter()
        .filter(|t| !t.requests.is_empty() || !t.segments.is_empty())
        .collect();
    if devices.is_empty() {
        return Err("the file records no request to PyTorch's allocator: nothing to replay".into());
    }
    let total = device_meta(snap, "total_bytes");
    let free_end = device_meta(snap, "free_bytes");
    let mut rows = Vec::new();
    let mut checks = Vec::new();
    let mut recorded_oom = None;
    for t in &devices {
        let dev = t.device;
        let total = total
            .get(&dev)
            .copied()
            .filter(|&b| b > 0)
            .map(|b| b as u64);
        let derived = t
            .limit_at_oom
            .or_else(|| free_end.get(&dev).map(|&f| t.held_at_end + f.max(0) as u64));
        let capacity = opts
            .device_memory
            .map(|b| b.max(0) as u64)
            .or(total)
            .or(derived);
        let outside_unrecorded = match (total, derived) {
            (Some(tot), Some(l)) => tot.saturating_sub(l),
            _ => 0,
        };
        if outside_unrecorded > 0 {
            notes.push(format!(
                "device {dev}: {} of its {} was in use outside the recording (the CUDA \
                 context, other processes): every scenario has that much less",
                fmt_bytes(outside_unrecorded as i64),
                fmt_bytes(total.unwrap_or(0) as i64)
            ));
        }
        if capacity.is_none() {
            notes.push(format!(
                "device {dev}: the file does not say how much memory the device has: give \
                 --device-memory to know what fits"
            ));
        }
        let limits = Limits {
            limit: capacity.map(|c| c.saturating_sub(outside_unrecorded)),
            device_total: total.or(capacity).unwrap_or(80 << 30),
        };
        let outcomes = run_all(t, &scenarios, limits);
        if let Some(first) = outcomes.first().and_then(|o| o.as_ref().ok()) {
            checks.push(check(snap, t, first));
        }
        for (s, o) in scenarios.iter().zip(&outcomes) {
            rows.push(row(t.device, s, o, capacity, &site_of));
        }
        let failed = t.ops.iter().find_map(|op| match op {
            Op::Failed(id) => Some(&t.requests[*id as usize]),
            _ => None,
        });
        if let Some(r) = failed
            && recorded_oom.is_none()
        {
            let mut avoided = Vec::new();
            let mut not = Vec::new();
            for (s, o) in scenarios.iter().zip(&outcomes).skip(1) {
                let (Ok(s), Ok(o)) = (s, o) else { continue };
                if o.refused.is_some() {
                    continue;
                }
                if o.oom.as_ref().is_none_or(|p| p.event > r.event) {
                    avoided.push(s.label.clone());
                } else {
                    not.push(s.label.clone());
                }
            }
            recorded_oom = Some(RecordedOom {
                device: dev,
                request_bytes: r.size as i64,
                site: site_of(r.stack),
                event: i64::from(r.event),
                avoided_by: avoided,
                not_avoided_by: not,
            });
        }
    }
    Ok(Report {
        scenarios: rows,
        release: release.to_string(),
        release_assumed: assumed,
        recorded_settings: recorded.to_string(),
        checks,
        recorded_oom,
        notes,
    })
}

/// A scenario, or its label and why it cannot be modelled.
type Planned = Result<Scenario, (String, String)>;

/// As recorded, each `--set` (the defaults when neither `--set` nor `--scale` is given),
/// each `--scale`, each `--set` with each `--scale`.
fn scenarios(
    recorded: &Settings,
    release: Release,
    opts: &Options,
    scales: &[(String, Vec<(Role, f64)>)],
    notes: &mut Vec<String>,
) -> Vec<Planned> {
    let mut out: Vec<Planned> = vec![Ok(Scenario {
        label: AS_RECORDED.into(),
        settings: recorded.clone(),
        scale: Vec::new(),
    })];
    let sets: Vec<String> = if opts.sets.is_empty() && opts.scales.is_empty() {
        let defaults = if recorded.backend == Backend::CudaMallocAsync {
            DEFAULT_SETS_FROM_ASYNC
        } else {
            DEFAULT_SETS
        };
        defaults
            .iter()
            .filter(|s| {
                Settings::default()
                    .with(s, release, &mut Vec::new())
                    .is_ok_and(|x| x != *recorded)
            })
            .map(|s| s.to_string())
            .collect()
    } else {
        opts.sets.clone()
    };
    let mut with_sets = Vec::new();
    for set in &sets {
        let label = if set.trim().is_empty() {
            DEFAULTS.to_string()
        } else {
            set.clone()
        };
        let mut set_notes = Vec::new();
        match Settings::default().with(set, release, &mut set_notes) {
            Ok(s) => {
                notes.extend(set_notes.into_iter().map(|n| format!("{label}: {n}")));
                with_sets.push((label, s));
            }
            Err(e) => out.push(Err((label, e))),
        }
    }
    for (label, s) in &with_sets {
        out.push(Ok(Scenario {
            label: label.clone(),
            settings: s.clone(),
            scale: Vec::new(),
        }));
    }
    for (text, scale) in scales {
        out.push(Ok(Scenario {
            label: format!("scale {text}"),
            settings: recorded.clone(),
            scale: scale.clone(),
        }));
        for (label, s) in &with_sets {
            out.push(Ok(Scenario {
                label: format!("{label} + scale {text}"),
                settings: s.clone(),
                scale: scale.clone(),
            }));
        }
    }
    out
}

/// Every scenario of one device: as recorded first (the others empty the cache where it
/// did), then the rest on threads of their own.
fn run_all(t: &DeviceTrace, scenarios: &[Planned], limits: Limits) -> Vec<Result<Outcome, String>> {
    if let Some(why) = &t.refused {
        return scenarios
            .iter()
            .map(|s| {
                Err(s
                    .as_ref()
                    .err()
                    .map_or_else(|| why.clone(), |e| e.1.clone()))
            })
            .collect();
    }
    let first = match &scenarios[0] {
        Ok(s) => replay::run(t, s, limits, true, &[]),
        Err((_, why)) => return scenarios.iter().map(|_| Err(why.clone())).collect(),
    };
    let empty_at = first.empty_cache_at.clone();
    let rest = &scenarios[1..];
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, rest.len().max(1));
    let chunk = rest.len().div_ceil(threads).max(1);
    let mut out = vec![Ok(first)];
    std::thread::scope(|scope| {
        let handles: Vec<_> = rest
            .chunks(chunk)
            .map(|part| {
                let empty_at = &empty_at;
                scope.spawn(move || {
                    part.iter()
                        .map(|s| match s {
                            Ok(s) => Ok(replay::run(t, s, limits, false, empty_at)),
                            Err((_, why)) => Err(why.clone()),
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for (h, part) in handles.into_iter().zip(rest.chunks(chunk)) {
            match h.join() {
                Ok(done) => out.extend(done),
                Err(_) => out.extend(part.iter().map(|_| Err("the replay failed".to_string()))),
            }
        }
    });
    out
}

fn row(
    dev: i64,
    s: &Planned,
    o: &Result<Outcome, String>,
    capacity: Option<u64>,
    site_of: &dyn Fn(Option<StackId>) -> String,
) -> Row {
    let setting = match s {
        Ok(s) => s.label.clone(),
        Err((label, _)) => label.clone(),
    };
    let capacity_bytes = capacity.map(|c| c as i64);
    let refused = |why: &str| Row {
        setting: setting.clone(),
        device: dev,
        peak_reserved_bytes: None,
        peak_allocated_bytes: None,
        segments_at_peak: None,
        reserved_unallocated_bytes_at_peak: None,
        largest_free_block_bytes_at_peak: None,
        capacity_bytes,
        fits: None,
        oom: None,
        refused: Some(why.to_string()),
    };
    let o = match o {
        Ok(o) => o,
        Err(why) => return refused(why),
    };
    if let Some(why) = &o.refused {
        return refused(why);
    }
    Row {
        setting,
        device: dev,
        peak_reserved_bytes: Some(o.peak_reserved as i64),
        peak_allocated_bytes: Some(o.peak_allocated as i64),
        segments_at_peak: Some(o.segments_at_peak as i64),
        reserved_unallocated_bytes_at_peak: Some(o.unallocated_at_peak as i64),
        largest_free_block_bytes_at_peak: Some(o.largest_free_at_peak as i64),
        capacity_bytes,
        fits: capacity.map(|_| o.oom.is_none()),
        oom: o.oom.as_ref().map(|p| OomRow {
            request_bytes: p.request_bytes as i64,
            site: site_of(p.stack),
            event: i64::from(p.event),
            outside: p.outside,
        }),
        refused: None,
    }
}

/// The replay as recorded against the recording: its segments one by one (in
/// [`replay::run`]), its peak, and its segments and blocks at the end.
fn check(snap: &Snapshot, t: &DeviceTrace, o: &Outcome) -> Check {
    let mut divergence = o.divergence.clone().or_else(|| o.refused.clone());
    if divergence.is_none() && o.peak_reserved != t.recorded_peak_reserved {
        divergence = Some(format!(
            "the model's peak of reserved bytes is {} where the recording's is {}",
            o.peak_reserved, t.recorded_peak_reserved
        ));
    }
    if divergence.is_none() && o.oom.as_ref().is_none_or(|p| p.recorded) {
        divergence = end_mismatch(snap, t, o);
    }
    Check {
        device: t.device,
        reproduced: divergence.is_none(),
        divergence,
        segment_operations: t.segments.len() as i64,
        matched: o.matched as i64,
        recorded_peak_reserved_bytes: t.recorded_peak_reserved as i64,
        model_peak_reserved_bytes: o.peak_reserved as i64,
        starts_mid_run: !t.start.is_empty(),
    }
}

/// The model's segments and blocks at the end against the snapshot's: each segment at
/// the same address with the same size, the same blocks handed out (with their sizes in
/// PyTorch's own files; memsnap derives a block's size, docs/PYTORCH.md, "Block sizes").
fn end_mismatch(snap: &Snapshot, t: &DeviceTrace, o: &Outcome) -> Option<String> {
    let ours: Vec<&memsnap_format::model::Segment> = snap
        .segments
        .iter()
        .filter(|s| s.device == t.device)
        .collect();
    for replay::EndSegment { addr, size, blocks } in &o.end {
        let Some(seg) = ours.iter().find(|s| s.address as u64 == *addr) else {
            return Some(format!(
                "at the end, the model holds a segment of {size} bytes at {addr:#x} that the \
                 snapshot does not have"
            ));
        };
        if seg.total_size as u64 != *size {
            return Some(format!(
                "at the end, the segment at {addr:#x} is {size} bytes in the model, {} in the \
                 snapshot",
                seg.total_size
            ));
        }
        let sizes = t.source == Source::Pytorch;
        let model: Vec<(u64, u64)> = blocks
            .iter()
            .filter(|b| b.2)
            .map(|b| (b.0, if sizes { b.1 } else { 0 }))
            .collect();
        let file: Vec<(u64, u64)> = seg
            .blocks
            .iter()
            .filter(|b| b.state.is_active())
            .map(|b| (b.address as u64, if sizes { b.size as u64 } else { 0 }))
            .collect();
        if model != file {
            return Some(format!(
                "at the end, the blocks in use in the segment at {addr:#x} differ: the model \
                 has {model:x?}, the snapshot {file:x?} (address, size)"
            ));
        }
    }
    if t.source == Source::Pytorch && ours.len() != o.end.len() {
        return Some(format!(
            "at the end, the model holds {} segments, the snapshot {}",
            o.end.len(),
            ours.len()
        ));
    }
    None
}

/// Who wrote the file, and whether it holds PyTorch's requests.
fn source(snap: &Snapshot) -> Result<Source, String> {
    if snap.memsnap.is_empty() {
        return Ok(Source::Pytorch);
    }
    match trace::torch_line(snap) {
        Some(l) if l.starts_with("blocks") => Ok(Source::MemsnapBlocks),
        Some(l) if l.starts_with("tensors") => Ok(Source::MemsnapTensors),
        Some(l) => Err(format!(
            "the file has PyTorch's caching-allocator segments without its blocks (`{l}`): \
             the requests it served are not recorded, so they cannot be replayed"
        )),
        None => {
            let blocks = snap
                .device_traces
                .iter()
                .flatten()
                .any(|e| e.user_metadata.as_deref() == Some(trace::CACHING_ALLOCATOR));
            if blocks {
                Ok(Source::MemsnapBlocks)
            } else {
                Err(
                    "the file records no request to PyTorch's caching allocator: nothing to \
                     replay"
                        .into(),
                )
            }
        }
    }
}

/// The release named by memsnap's `torch_allocator` line (`... PyTorch 2.11.0+cu130 ...`);
/// otherwise the newest modelled one, assumed.
fn release(snap: &Snapshot) -> (Release, bool) {
    let named = trace::torch_line(snap).and_then(|l| {
        let at = l.find("PyTorch ")? + "PyTorch ".len();
        Release::parse(l[at..].split_whitespace().next()?)
    });
    match named {
        Some(r) => (r, false),
        None => (NEWEST, true),
    }
}

/// The settings the file was recorded with: the `PYTORCH_ALLOC_CONF` or
/// `PYTORCH_CUDA_ALLOC_CONF` text, then PyTorch's own keys (its snapshot writes what the
/// allocator ran with, settings changed at run time included).
fn recorded_settings(
    snap: &Snapshot,
    release: Release,
    source: Source,
    notes: &mut Vec<String>,
) -> Result<Settings, String> {
    let conf = ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"]
        .iter()
        .find_map(|k| {
            snap.allocator_settings.iter().find_map(|(key, v)| match v {
                Meta::Str(s) if key == k && !s.trim().is_empty() => Some(s.clone()),
                _ => None,
            })
        })
        .unwrap_or_default();
    let mut s = Settings::recorded(&conf, release, notes)
        .map_err(|e| format!("the recorded settings `{conf}`: {e}"))?;
    for (key, v) in &snap.allocator_settings {
        match (key.as_str(), v) {
            ("max_split_size", Meta::Int(b)) => {
                s.max_split_size = if *b <= 0 { u64::MAX } else { *b as u64 };
            }
            ("garbage_collection_threshold", Meta::Float(f)) => {
                s.garbage_collection_threshold = *f;
            }
            ("garbage_collection_threshold", Meta::Int(i)) => {
                s.garbage_collection_threshold = *i as f64;
            }
            ("expandable_segments", Meta::Bool(b)) => s.expandable_segments = *b,
            ("roundup_power2_divisions", Meta::Dict(kv)) => {
                for (mb, d) in kv {
                    if let (Ok(mb), Meta::Int(d)) = (mb.parse::<u64>(), d)
                        && mb.is_power_of_two()
                    {
                        let i =
                            (63 - mb.leading_zeros() as usize).min(settings::ROUNDUP_INTERVALS - 1);
                        s.roundup_divisions[i] = (*d).max(0) as u64;
                    }
                }
            }
            _ => {}
        }
    }
    if source == Source::MemsnapTensors {
        s.backend = Backend::CudaMallocAsync;
    }
    Ok(s)
}

/// `activations=2,temporaries=1.5`.
pub fn parse_scale(text: &str) -> Result<Vec<(Role, f64)>, String> {
    const ROLES: &[Role] = &[
        Role::Parameters,
        Role::Gradients,
        Role::OptimizerState,
        Role::Activations,
        Role::Temporaries,
        Role::Communication,
        Role::Other,
    ];
    text.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|part| {
            let (name, factor) = part.split_once('=').ok_or_else(|| {
                format!("--scale {text}: `{part}` is not ROLE=FACTOR (activations=2)")
            })?;
            let role = ROLES
                .iter()
                .copied()
                .find(|r| r.as_str() == name.trim())
                .ok_or_else(|| {
                    let names: Vec<&str> = ROLES.iter().map(|r| r.as_str()).collect();
                    format!(
                        "--scale {text}: `{}` is not a role; the roles: {}",
                        name.trim(),
                        names.join(", ")
                    )
                })?;
            let f: f64 = factor
                .trim()
                .parse()
                .ok()
                .filter(|f: &f64| f.is_finite() && *f > 0.0)
                .ok_or_else(|| {
                    format!(
                        "--scale {text}: `{}` is not a factor above 0",
                        factor.trim()
                    )
                })?;
            Ok((role, f))
        })
        .collect()
}

//! `summary`'s model: what held the memory at the moment that matters (the first OOM, else
//! the peak, or the moment `--at` names), beside the end, per device; and each OOM. The
//! CLI prints it as text or serializes it as JSON (the shape is stable: fields are only
//! ever added). Cold code.

use crate::at::{AtJson, Resolved};
use crate::device::{self, AtInfo, DeviceStats};
use crate::history;
use crate::sites::{Attribution, Library, SiteKind, Sites, StackBytes};
use crate::tally::{Tally, sorted};
use memsnap_format::model::{Meta, Snapshot};
use serde::Serialize;

#[derive(Serialize)]
pub struct SiteRow {
    pub site: String,
    pub kind: SiteKind,
    /// The helper the bytes went through, where the site is its calling line.
    pub via: Option<String>,
    pub bytes: i64,
    pub count: i64,
}

#[derive(Serialize)]
pub struct ApiRow {
    pub api: String,
    pub events: usize,
}

#[derive(Serialize)]
pub struct CallRow {
    pub api: String,
    pub calls: i64,
}

#[derive(Serialize)]
pub struct LibRow {
    pub library: Library,
    pub bytes: i64,
    pub count: i64,
}

#[derive(Serialize)]
pub struct History {
    pub events: usize,
    pub start_live_requested_bytes: i64,
    pub peak_live_requested_bytes: i64,
    pub peak_after_event: Option<usize>,
    pub start_reserved_bytes: i64,
    pub peak_reserved_bytes: i64,
    /// Events the file's history cap dropped (memsnap's files), and the label saying so.
    pub dropped_by_cap: Option<i64>,
    pub capped: Option<String>,
}

/// Requested bytes and allocations of one group at the moment and at the end.
#[derive(Serialize, Clone, Copy)]
pub struct AtFigures {
    pub bytes: i64,
    pub count: i64,
    pub end_bytes: i64,
    pub end_count: i64,
}

impl AtFigures {
    fn new(at: Tally, end: Option<&Tally>) -> Self {
        let end = end.copied().unwrap_or_default();
        AtFigures {
            bytes: at.bytes,
            count: at.count,
            end_bytes: end.bytes,
            end_count: end.count,
        }
    }
}

#[derive(Serialize)]
pub struct AtSiteRow {
    pub site: String,
    pub kind: SiteKind,
    pub via: Option<String>,
    #[serde(flatten)]
    pub figures: AtFigures,
}

#[derive(Serialize)]
pub struct AtLibRow {
    pub library: Library,
    #[serde(flatten)]
    pub figures: AtFigures,
}

#[derive(Serialize)]
pub struct AtDevice {
    #[serde(flatten)]
    pub moment: AtJson,
    pub live_requested_bytes: i64,
    pub live_allocations: i64,
    pub reserved_bytes: i64,
    pub sites: Vec<AtSiteRow>,
    pub libraries: Vec<AtLibRow>,
    #[serde(skip)]
    pub resolved: Resolved,
}

#[derive(Serialize)]
pub struct Oom {
    pub event: usize,
    pub requested_bytes: i64,
    pub device_free_bytes: Option<i64>,
    pub time_us: i64,
    pub site: String,
    pub via: Option<String>,
    pub library: Library,
    pub live_requested_bytes: i64,
    pub live_allocations: i64,
    pub reserved_bytes: i64,
    pub top_sites: Vec<SiteRow>,
}

#[derive(Serialize)]
pub struct Device {
    pub device: i64,
    pub live_bytes: i64,
    pub live_blocks: i64,
    pub live_requested_bytes: i64,
    pub pending_free_bytes: i64,
    /// Reserved but unallocated: the inactive blocks of caching-allocator segments.
    pub cached_free_bytes: i64,
    pub largest_free_block_bytes: i64,
    pub reserved_bytes: i64,
    pub segments: i64,
    /// The private pools' share of the segments (CUDA graphs', `torch.cuda.MemPool`s').
    pub private_pools: Vec<crate::device::PrivatePool>,
    pub history: History,
    /// Events per `user_metadata` (memsnap writes the CUDA API there), most first.
    pub events_by_api: Vec<ApiRow>,
    pub top_sites: Vec<SiteRow>,
    pub libraries: Vec<LibRow>,
    pub at: AtDevice,
    pub ooms: Vec<Oom>,
}

#[derive(Serialize)]
pub struct Summary {
    pub file: String,
    /// "memsnap" (has memsnap's metadata) or "pytorch".
    pub producer: &'static str,
    pub dropped_events: Option<i64>,
    /// Events recorded without their stack (memsnap's counter).
    pub events_without_stack: Option<i64>,
    /// Stack frames memsnap could not resolve (memsnap's counter).
    pub frames_unresolved: Option<i64>,
    pub metadata: serde_json::Value,
    /// Calls per CUDA entry point (memsnap's `api_calls`), most first.
    pub api_calls: Vec<CallRow>,
    pub devices: Vec<Device>,
}

impl Summary {
    /// Why the moment asked for is in no device's history (`None` when some device reached
    /// it, or when there are no devices).
    pub fn unreached(&self) -> Option<String> {
        device::unreached(self.devices.iter().map(|d| &d.at.resolved))
    }
}

/// memsnap's metadata as JSON.
pub fn meta_json(m: &Meta) -> serde_json::Value {
    use serde_json::Value as J;
    match m {
        Meta::Bool(b) => J::Bool(*b),
        Meta::Int(i) => J::from(*i),
        Meta::Float(f) => serde_json::Number::from_f64(*f)
            .map(J::Number)
            .unwrap_or(J::Null),
        Meta::Str(s) => J::String(s.clone()),
        Meta::List(l) => J::Array(l.iter().map(meta_json).collect()),
        Meta::Dict(d) => J::Object(d.iter().map(|(k, v)| (k.clone(), meta_json(v))).collect()),
    }
}

/// An integer of memsnap's metadata.
pub fn meta_int(snap: &Snapshot, key: &str) -> Option<i64> {
    match snap.meta(key)? {
        Meta::Int(i) => Some(*i),
        _ => None,
    }
}

fn site_rows(sites: &Sites, v: &[(u32, Tally)], top: usize) -> Vec<SiteRow> {
    v.iter()
        .take(top)
        .map(|(s, t)| SiteRow {
            site: sites.text(*s).to_string(),
            kind: sites.sites[*s as usize].kind,
            via: sites.via(*s).map(str::to_string),
            bytes: t.bytes,
            count: t.count,
        })
        .collect()
}

/// memsnap's `api_calls` metadata, most calls first (ties by name).
fn api_calls(snap: &Snapshot) -> Vec<CallRow> {
    let Some(Meta::Dict(calls)) = snap.meta("api_calls") else {
        return Vec::new();
    };
    let mut rows: Vec<CallRow> = calls
        .iter()
        .filter_map(|(api, n)| match n {
            Meta::Int(n) => Some(CallRow {
                api: api.clone(),
                calls: *n,
            }),
            _ => None,
        })
        .collect();
    rows.sort_by(|a, b| b.calls.cmp(&a.calls).then(a.api.cmp(&b.api)));
    rows
}

/// The summary of one snapshot; `file` is its name in the JSON, `top` the sites listed.
pub fn build(
    snap: &Snapshot,
    histories: &[history::History],
    file: String,
    top: usize,
    attr: &Attribution,
) -> Summary {
    let bytes = StackBytes::of_file(snap, histories.iter().map(history::History::allocated));
    let sites = Sites::new(snap, attr, &bytes);
    let devices = device::devices(snap)
        .into_iter()
        .map(|d| {
            let hist = device::history_of(histories, d);
            let st = device::device_stats(snap, &sites, d, &hist);
            device_summary(snap, &sites, st, &hist, top)
        })
        .collect();
    Summary {
        file,
        producer: if snap.memsnap.is_empty() {
            "pytorch"
        } else {
            "memsnap"
        },
        dropped_events: meta_int(snap, "dropped_events"),
        events_without_stack: meta_int(snap, "events_without_stack"),
        frames_unresolved: meta_int(snap, "frames_unresolved"),
        metadata: meta_json(&Meta::Dict(snap.memsnap.clone())),
        api_calls: api_calls(snap),
        devices,
    }
}

fn at_device(sites: &Sites, at: &AtInfo, top: usize) -> AtDevice {
    let site_rows: Vec<AtSiteRow> = sorted(&at.by_site)
        .into_iter()
        .filter(|(_, t)| t.count > 0)
        .take(top)
        .map(|(s, t)| AtSiteRow {
            site: sites.text(s).to_string(),
            kind: sites.sites[s as usize].kind,
            via: sites.via(s).map(str::to_string),
            figures: AtFigures::new(t, at.end_by_site.get(&s)),
        })
        .collect();
    AtDevice {
        moment: AtJson::from(&at.moment),
        live_requested_bytes: at.live.bytes,
        live_allocations: at.live.count,
        reserved_bytes: at.reserved,
        sites: site_rows,
        libraries: sorted(&at.by_library)
            .into_iter()
            .map(|(l, t)| AtLibRow {
                library: l,
                figures: AtFigures::new(t, at.end_by_library.get(&l)),
            })
            .collect(),
        resolved: at.moment.clone(),
    }
}

fn device_summary(
    snap: &Snapshot,
    sites: &Sites,
    st: DeviceStats,
    hist: &history::History,
    top: usize,
) -> Device {
    let events_by_api = hist
        .apis()
        .into_iter()
        .map(|(a, n)| ApiRow {
            api: a.to_string(),
            events: n,
        })
        .collect();
    let dropped_by_cap = device::history_dropped(snap, st.device);
    Device {
        events_by_api,
        device: st.device,
        live_bytes: st.live.bytes,
        live_blocks: st.live.count,
        live_requested_bytes: st.live_requested,
        pending_free_bytes: st.pending_free.bytes,
        cached_free_bytes: st.cached_free.bytes,
        largest_free_block_bytes: st.largest_free_block,
        reserved_bytes: st.reserved.bytes,
        segments: st.reserved.count,
        private_pools: device::private_pools(snap, st.device),
        history: History {
            events: st.events,
            start_live_requested_bytes: st.start_live_requested,
            peak_live_requested_bytes: st.peak_live_requested,
            peak_after_event: st.peak_after_event,
            start_reserved_bytes: st.start_reserved,
            peak_reserved_bytes: st.peak_reserved,
            dropped_by_cap,
            capped: device::capped_label(st.events, dropped_by_cap),
        },
        top_sites: site_rows(sites, &sorted(&st.by_site), top),
        libraries: sorted(&st.by_library)
            .into_iter()
            .map(|(l, t)| LibRow {
                library: l,
                bytes: t.bytes,
                count: t.count,
            })
            .collect(),
        at: at_device(sites, &st.at, top),
        ooms: st
            .ooms
            .iter()
            .map(|o| Oom {
                event: o.event,
                requested_bytes: o.requested,
                device_free_bytes: o.device_free,
                time_us: o.time_us,
                site: sites.text(o.site).to_string(),
                via: sites.via(o.site).map(str::to_string),
                library: o.library,
                live_requested_bytes: o.live.bytes,
                live_allocations: o.live.count,
                reserved_bytes: o.reserved,
                top_sites: site_rows(sites, &o.holders, top),
            })
            .collect(),
    }
}

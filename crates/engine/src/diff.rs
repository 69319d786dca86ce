//! `diff`'s model: the live set of two snapshots by allocation site (sites are compared by
//! their text, which is stable across files), at their ends (block bytes) or at a moment
//! each (requested bytes), what grew and what shrank, and whether the growth passes a
//! limit. The CLI reads the files, prints text or serializes this as JSON. Cold code.

use crate::at::{AtJson, Resolved};
use crate::device;
use crate::input::Summarized;
use crate::sites::{Attribution, SiteKind, Sites, StackBytes};
use crate::tally::Tally;
use memsnap_format::model::Snapshot;
use serde::Serialize;
use std::collections::BTreeMap;

#[derive(Serialize)]
pub struct DeviceAt {
    pub device: i64,
    #[serde(flatten)]
    pub moment: AtJson,
}

#[derive(Serialize)]
pub struct Side {
    pub file: String,
    pub live_bytes: i64,
    pub live_blocks: i64,
    pub units: &'static str,
    /// The moment of each device (empty when the side is at its end).
    pub at: Vec<DeviceAt>,
    /// `history capped: kept N of M events`, per device where the cap dropped events.
    pub capped: Vec<String>,
}

#[derive(Serialize, Clone)]
pub struct Row {
    pub site: String,
    pub kind: SiteKind,
    /// The helper the bytes went through, where the site is its calling line.
    pub via: Option<String>,
    pub before_bytes: i64,
    pub after_bytes: i64,
    pub growth_bytes: i64,
    pub before_count: i64,
    pub after_count: i64,
    pub count_growth: i64,
}

#[derive(Serialize)]
pub struct Diff {
    pub before: Side,
    pub after: Side,
    pub total_growth_bytes: i64,
    pub fail_above_bytes: Option<i64>,
    pub failed: bool,
    pub grew: Vec<Row>,
    pub shrank: Vec<Row>,
}

/// The live bytes of one site on one side.
#[derive(Clone)]
pub struct SiteLive {
    pub kind: SiteKind,
    pub via: Option<String>,
    pub live: Tally,
}

/// One side: live bytes by site text, the moment of each device, and the cap labels.
pub struct SideLive {
    pub by_site: BTreeMap<String, SiteLive>,
    pub total: Tally,
    /// The moment of each device (empty at the end).
    pub moments: Vec<(i64, Resolved)>,
    /// `device D: history capped: kept N of M events`, where the cap dropped events.
    pub capped: Vec<String>,
}

impl SideLive {
    fn new() -> Self {
        SideLive {
            by_site: BTreeMap::new(),
            total: Tally::default(),
            moments: Vec::new(),
            capped: Vec::new(),
        }
    }

    fn add(&mut self, sites: &Sites, site: u32, t: Tally) {
        self.by_site
            .entry(sites.text(site).to_string())
            .or_insert_with(|| SiteLive {
                kind: sites.sites[site as usize].kind,
                via: sites.via(site).map(str::to_string),
                live: Tally::default(),
            })
            .live
            .merge(t);
        self.total.merge(t);
    }

    /// Why the moment asked for is in no device's history, as for
    /// [`device::unreached`].
    pub fn unreached(&self) -> Option<String> {
        device::unreached(self.moments.iter().map(|(_, m)| m))
    }
}

/// The snapshot's live blocks (`active_allocated`, all devices) by site, in block bytes;
/// `bytes`: what its stacks allocated. Both sides are to name their sites alike: `attr`
/// gives the helpers of both files ([`Attribution::shared`]).
pub fn side_at_end(snap: &Snapshot, bytes: &StackBytes, attr: &Attribution) -> SideLive {
    let mut side = SideLive::new();
    let sites = Sites::new(snap, attr, bytes);
    for (s, t) in device::live_by_site(snap, &sites) {
        side.add(&sites, s, t);
    }
    side
}

/// The live set at the moment each device's history followed, by site, in requested
/// bytes (the history's units); `attr` as for [`side_at_end`].
pub fn side_at(loaded: &Summarized, attr: &Attribution) -> SideLive {
    let mut side = SideLive::new();
    let sites = Sites::new(&loaded.snap, attr, &loaded.stack_bytes());
    for m in device::moments(&loaded.snap, &loaded.histories) {
        for (stack, t) in &m.holders {
            side.add(&sites, sites.site(*stack), *t);
        }
        side.capped.extend(m.capped);
        side.moments.push((m.device, m.moment));
    }
    side
}

/// One side of a comparison: its file (shown in the JSON) and its live set.
pub struct Input<'s> {
    pub file: String,
    pub live: &'s SideLive,
}

/// Compares two sides: `requested` when they are in requested bytes (a moment other than
/// the end on either side); `top` growing sites kept (a quarter as many shrinking).
pub fn compare(
    before: Input<'_>,
    after: Input<'_>,
    requested: bool,
    top: usize,
    fail_above: Option<i64>,
) -> Diff {
    let (b, c) = (before.live, after.live);
    let mut rows: BTreeMap<&str, (&SiteLive, Tally, Tally)> = BTreeMap::new();
    for (site, s) in &b.by_site {
        rows.entry(site)
            .or_insert((s, Tally::default(), Tally::default()))
            .1 = s.live;
    }
    for (site, s) in &c.by_site {
        rows.entry(site)
            .or_insert((s, Tally::default(), Tally::default()))
            .2 = s.live;
    }
    let all: Vec<Row> = rows
        .into_iter()
        .map(|(site, (s, x, y))| Row {
            site: site.to_string(),
            kind: s.kind,
            via: s.via.clone(),
            before_bytes: x.bytes,
            after_bytes: y.bytes,
            growth_bytes: y.bytes - x.bytes,
            before_count: x.count,
            after_count: y.count,
            count_growth: y.count - x.count,
        })
        .collect();
    let mut grew: Vec<Row> = all.iter().filter(|r| r.growth_bytes > 0).cloned().collect();
    grew.sort_by(|x, y| {
        y.growth_bytes
            .cmp(&x.growth_bytes)
            .then(x.site.cmp(&y.site))
    });
    grew.truncate(top);
    let mut shrank: Vec<Row> = all.iter().filter(|r| r.growth_bytes < 0).cloned().collect();
    shrank.sort_by(|x, y| {
        x.growth_bytes
            .cmp(&y.growth_bytes)
            .then(x.site.cmp(&y.site))
    });
    shrank.truncate(top.div_ceil(4));
    let total = c.total.bytes - b.total.bytes;
    let failed = fail_above.is_some_and(|f| total > f);
    let units = if requested {
        "requested bytes"
    } else {
        "block bytes"
    };
    let json_side = |file: String, s: &SideLive| Side {
        file,
        live_bytes: s.total.bytes,
        live_blocks: s.total.count,
        units,
        at: s
            .moments
            .iter()
            .map(|(d, m)| DeviceAt {
                device: *d,
                moment: AtJson::from(m),
            })
            .collect(),
        capped: s.capped.clone(),
    };
    Diff {
        before: json_side(before.file, b),
        after: json_side(after.file, c),
        total_growth_bytes: total,
        fail_above_bytes: fail_above,
        failed,
        grew,
        shrank,
    }
}

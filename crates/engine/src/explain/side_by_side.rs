//! The ranks side by side: the worst and the median rank's peaks, the sites that differ
//! between them, and ranks that allocate on another rank's device. Cold code.

use super::{DIFFERING_SITES, Digest};
use serde::Serialize;
use std::collections::BTreeMap;

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
    /// The helper the bytes went through, where the site is its calling line.
    pub via: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ForeignDevice {
    pub rank: i64,
    pub local_rank: i64,
    pub devices: Vec<i64>,
}

pub(super) fn side_by_side(
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
            via: None,
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

fn median_of(mut v: Vec<i64>) -> i64 {
    if v.is_empty() {
        return 0;
    }
    v.sort_unstable();
    v[(v.len() - 1) / 2]
}

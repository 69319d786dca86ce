//! `memsnap explain PATH...`: the arguments, reading every file (several at once, each in
//! one pass, reduced to the engine's per-file digest on its thread), and the text renderer
//! of the engine's [`Explanation`] (JSON is its serde form; docs/EXPLAIN.md has the shape):
//! a few short paragraphs, most important first. Cold code.

use crate::args::Report;
use crate::shown::{shown, write_escaped};
use anyhow::Result;
use memsnap_engine::at::{self, At};
use memsnap_engine::bytes::fmt_bytes;
use memsnap_engine::explain::leaks::{Leak, Unit};
use memsnap_engine::explain::{
    self as engine, Explanation, Oom, SiteRow, iterations, oom::Verdict, owners, snapshots,
};
use std::io::Write;
use std::path::PathBuf;

/// The `--json` shape, in short (docs/EXPLAIN.md has every key).
pub const JSON_SHAPE: &str = "\
JSON (--json); docs/EXPLAIN.md has every key and its meaning:
  { oom: null | { rank, pid, file, device, time_us, request_bytes, device_free_bytes,
                  verdict: \"live\"|\"fragmentation\"|\"outside\", reserved_unallocated_bytes,
                  largest_free_block_bytes, reserved_bytes, live_bytes, capacity_bytes,
                  outside_bytes, advice, cannot_tell,
                  sites: [ {site, via, bytes, allocations, library, role} ], owners: {owner: bytes},
                  first_rank, others: [ {rank, live_bytes, peak_bytes} ] },
    leaks: [ {site, bytes_per_step, steps, first_step, last_step, live_bytes_at_end, ranks,
              unit: \"step\"|\"iteration\"|\"snapshot\", bytes_per_iteration, via} ],
    iterations: [ {file, rank, pid, device, found, iterations, allocations_per_iteration,
                   entries_per_iteration, us_per_iteration, anchor_site, anchor_bytes,
                   anchors_per_iteration, tokens, similarity, compared, alike,
                   confidence: \"high\"|\"medium\"|\"low\", why_not} ],
    snapshots: [ {rank, pid, host, files, seconds, iterations,
                  sites: [ {site, growth_bytes, live_bytes_at_end,
                            verdict: \"leak\"|\"warm-up\"|\"grew\", via} ]} ],
    owners: {owner: bytes}, roles: null | {parameters, gradients, optimizer_state,
    activations, temporaries, communication, other},
    ranks: null | {worst_rank, median_rank, median_peak_bytes, worst_peak_bytes,
                   differing_sites: [ {site, bytes_worst, bytes_median, via} ],
                   foreign_devices: [ {rank, local_rank, devices} ]},
    notes: [str], at: null | {file, rank, pid, moment}, files, steps_to_oom: int|null }
Bytes at a moment are requested bytes, as in `summary`'s `at`. via: the helper, where the site
is its calling line (`caller via helper`), else null.";

#[derive(clap::Args, Debug)]
#[command(after_long_help = JSON_SHAPE)]
pub struct Args {
    /// Snapshot files, folders of a run (every rank's and every step's files, subfolders
    /// too), or s3://, gs://, az:// prefixes.
    #[arg(required = true, value_name = "PATH")]
    pub paths: Vec<PathBuf>,
    /// The moment owners and roles are told at: peak, oom, end, an event number or a time
    /// since the first recorded event (250ms, 12.5s). Default: the OOM if any, else the peak.
    /// A moment no file reached is an error, as in `summary`.
    #[arg(long, value_name = "MOMENT", value_parser = at::parse)]
    pub at: Option<At>,
    /// Exit with status 1 when a leak is found (the sites are named on stderr).
    #[arg(long)]
    pub fail_on_leak: bool,
    #[command(flatten)]
    pub report: Report,
}

/// Reads every file and puts the answers together.
pub fn build(a: &Args) -> Result<Explanation> {
    let files = crate::input::run_files(&a.paths)?;
    let at = a.at.unwrap_or(At::Auto);
    let opts = engine::Options {
        attr: a.report.attr.rules(),
    };
    let digest = |p: &PathBuf, opts: &engine::Options| {
        let name = p.display().to_string();
        match crate::input::load_explained(p, at) {
            Ok(read) => engine::digest(name, &read.loaded, &read.logs, opts),
            Err(e) => engine::unreadable(name, format!("{e:#}")),
        }
    };
    let mut digests = crate::input::map_files(&files, |p| digest(p, &opts));
    // Files that found different helpers name some sites differently: those whose sites
    // change under the helpers of all are read again with them (rarely needed: a helper
    // is one in every file of a run that calls it alike).
    if let Some((attr, again)) = engine::shared_helpers(&digests, &opts.attr) {
        let opts = engine::Options { attr };
        let redone = crate::input::map_files(&again, |&i| digest(&files[i], &opts));
        for (i, d) in again.into_iter().zip(redone) {
            digests[i] = d;
        }
    }
    if let Some(e) = digests.iter().find_map(|d| d.error.as_ref())
        && digests.iter().all(|d| d.error.is_some())
    {
        if digests.len() == 1 {
            anyhow::bail!("{e}");
        }
        anyhow::bail!(
            "no readable snapshot among {} files; the first: {e}",
            digests.len()
        );
    }
    // A moment asked for by name that no file reached is an error, as in `summary`, not
    // the end shown in its place. Over a run it is enough that one rank reached it.
    let mut readable = digests.iter().filter(|d| d.error.is_none());
    if a.at.is_some_and(|at| at != At::End)
        && let Some(first) = readable.clone().next()
        && let Some(why) = &first.unreached
        && readable.all(|d| d.unreached.is_some())
    {
        anyhow::bail!("{}: --at: {why}", first.file);
    }
    Ok(engine::build(digests))
}

pub fn run(a: &Args, out: &mut dyn Write) -> Result<i32> {
    let x = build(a)?;
    if a.report.json {
        serde_json::to_writer_pretty(&mut *out, &x)?;
        writeln!(out)?;
    } else {
        write_escaped(out, |out| write_text(&x, out))?;
    }
    if a.fail_on_leak && !x.leaks.is_empty() {
        out.flush()?;
        eprintln!("memsnap: leak: {}", shown(&x.leaking_sites().join("; ")));
        return Ok(1);
    }
    Ok(0)
}

/// `rank 3`; where the file names no rank, `rank not known: pid 4242` (the process that
/// wrote it, from its metadata), or `rank not known`.
pub fn rank(r: Option<i64>, pid: Option<i64>) -> String {
    match (r, pid) {
        (Some(r), _) => format!("rank {r}"),
        (None, Some(pid)) => format!("rank not known: pid {pid}"),
        (None, None) => "rank not known".to_string(),
    }
}

/// `[library: torch, role: activations]`: each word says what it is, so that a line read
/// alone needs no key (docs/EXPLAIN.md lists the libraries and the roles).
fn library_and_role(s: &SiteRow) -> String {
    format!(
        "[library: {}, role: {}]",
        s.library.as_str(),
        s.role.as_str()
    )
}

fn opt_bytes(b: Option<i64>) -> String {
    b.map_or_else(|| "unknown".to_string(), fmt_bytes)
}

/// The explanation as text.
pub fn write_text(x: &Explanation, out: &mut dyn Write) -> std::io::Result<()> {
    let mut first = true;
    let mut paragraph = |out: &mut dyn Write| -> std::io::Result<()> {
        if !std::mem::take(&mut first) {
            writeln!(out)?;
        }
        Ok(())
    };
    if let Some(o) = &x.oom {
        paragraph(out)?;
        write_oom(o, x.files > 1, out)?;
    }
    let of_unit = |u: Unit| x.leaks.iter().filter(move |l| l.unit == u);
    if of_unit(Unit::Step).next().is_some() {
        paragraph(out)?;
        writeln!(out, "Leaks across steps (live bytes at step boundaries):")?;
        for l in of_unit(Unit::Step) {
            write_leak(l, out)?;
        }
    }
    let found: Vec<&iterations::Info> = x.iterations.iter().filter(|i| i.found).collect();
    if of_unit(Unit::Iteration).next().is_some() {
        paragraph(out)?;
        writeln!(
            out,
            "Leaks across iterations found in the record (live bytes where each iteration starts):"
        )?;
        for i in &found {
            writeln!(out, "  {}", shown(&describe_iterations(i)))?;
        }
        for l in of_unit(Unit::Iteration) {
            write_leak(l, out)?;
        }
    }
    for s in &x.snapshots {
        paragraph(out)?;
        write_snapshots(s, out)?;
    }
    if let Some(at) = &x.at {
        paragraph(out)?;
        let whose = if x.files > 1 {
            format!(" of {} ({})", shown(&at.file), rank(at.rank, at.pid))
        } else {
            String::new()
        };
        let total: i64 = x
            .owners
            .iter()
            .filter(|(k, _)| k.as_str() != owners::OUTSIDE)
            .map(|(_, b)| b)
            .sum();
        writeln!(
            out,
            "Who holds the memory {}{whose}: {} recorded",
            at.moment,
            fmt_bytes(total)
        )?;
        for (owner, bytes) in owners::sorted(&x.owners) {
            writeln!(out, "  {:>10}  {}", fmt_bytes(bytes), shown(owner))?;
        }
        // The OOM paragraph listed the sites already when it is the same moment.
        let listed = x.oom.as_ref().is_some_and(|o| o.file == at.file);
        for s in x.sites.iter().take(if listed { 0 } else { 3 }) {
            writeln!(
                out,
                "  {:>10}  at {} {}",
                fmt_bytes(s.bytes),
                shown(&s.site),
                library_and_role(s)
            )?;
        }
        match &x.roles {
            Some(r) => {
                let rows: Vec<String> = r
                    .rows()
                    .iter()
                    .map(|(role, b)| format!("{} {}", role.as_str(), fmt_bytes(*b)))
                    .collect();
                if !rows.is_empty() {
                    writeln!(
                        out,
                        "  what for (from the frames; `other` where they do not say): {}",
                        rows.join(", ")
                    )?;
                }
            }
            None => writeln!(
                out,
                "  what for: cannot be told (no frames were recorded for the live memory)"
            )?,
        }
    }
    if let Some(r) = &x.ranks
        && let (Some(worst), Some(median)) = (r.worst_rank, r.median_rank)
    {
        paragraph(out)?;
        writeln!(
            out,
            "Ranks: rank {worst} peaks highest at {}; the median peak is {} (rank {median} is closest)",
            fmt_bytes(r.worst_peak_bytes),
            fmt_bytes(r.median_peak_bytes)
        )?;
        if !r.differing_sites.is_empty() {
            writeln!(
                out,
                "  {:>10}  {:>10}  sites that differ most (rank {worst}, rank {median})",
                format!("rank {worst}"),
                format!("rank {median}")
            )?;
            for s in &r.differing_sites {
                writeln!(
                    out,
                    "  {:>10}  {:>10}  {}",
                    fmt_bytes(s.bytes_worst),
                    fmt_bytes(s.bytes_median),
                    shown(&s.site)
                )?;
            }
        }
    }
    // Iterations found without a leak among them: how, first among the notes.
    let quiet: Vec<String> = if of_unit(Unit::Iteration).next().is_none() {
        found.iter().map(|i| describe_iterations(i)).collect()
    } else {
        Vec::new()
    };
    if !x.notes.is_empty() || !quiet.is_empty() {
        paragraph(out)?;
        writeln!(out, "Notes:")?;
        for n in quiet.iter().chain(&x.notes) {
            writeln!(out, "  - {}", shown(n))?;
        }
    }
    if first {
        writeln!(
            out,
            "nothing to explain: no OOM, no steps, no live memory recorded"
        )?;
    }
    Ok(())
}

/// One leak line: `+1.0 MiB per step since step 3 (22 steps, 25.0 MiB live at step 25): site`.
fn write_leak(l: &Leak, out: &mut dyn Write) -> std::io::Result<()> {
    let on = match l.ranks.as_slice() {
        [] => String::new(),
        r => format!(
            " on rank{} {}",
            if r.len() > 1 { "s" } else { "" },
            r.iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let word = l.unit.as_str();
    let at = match l.unit {
        Unit::Step => format!("at step {}", l.last_step),
        _ => "at the end".to_string(),
    };
    writeln!(
        out,
        "  +{} per {word} since {word} {} ({} {word}s, {} live {at}){on}: {}",
        fmt_bytes(l.bytes_per_step),
        l.first_step,
        l.steps,
        fmt_bytes(l.live_bytes_at_end),
        shown(&l.site)
    )
}

/// How iterations were found: `25 iterations of 3 allocations (1.2 ms each) in FILE,
/// device 0, cut where the 4.0 MiB allocation at SITE comes back once an iteration; 24 of
/// 24 compared iterations alike: high confidence`.
fn describe_iterations(i: &iterations::Info) -> String {
    let times = match i.anchors_per_iteration.unwrap_or(1) {
        1 => "once".to_string(),
        2 => "twice".to_string(),
        k => format!("{k} times"),
    };
    let each = i
        .us_per_iteration
        .filter(|&us| us > 0)
        .map(|us| format!(" ({} each)", fmt_duration(us)))
        .unwrap_or_default();
    let by = match i.tokens {
        Some("site") => " (sites alone: the sizes vary)",
        Some("three in a row") => " (with the two allocations before it)",
        _ => "",
    };
    format!(
        "{} iterations of {} allocations{each} in {}, device {}, cut where the {} allocation at \
         {} comes back {times} an iteration{by}; {} of {} compared iterations alike: {} confidence",
        i.iterations.unwrap_or(0),
        i.allocations_per_iteration.unwrap_or(0),
        i.file,
        i.device.unwrap_or(0),
        fmt_bytes(i.anchor_bytes.unwrap_or(0)),
        i.anchor_site.as_deref().unwrap_or_default(),
        i.alike.unwrap_or(0),
        i.compared.unwrap_or(0),
        i.confidence.map_or("low", |c| c.as_str())
    )
}

/// `850 us`, `1.2 ms`, `3.40 s`.
fn fmt_duration(us: i64) -> String {
    match us {
        ..1_000 => format!("{us} us"),
        1_000..1_000_000 => format!("{:.1} ms", us as f64 / 1e3),
        _ => format!("{:.2} s", us as f64 / 1e6),
    }
}

/// The growth between one process's snapshots.
fn write_snapshots(s: &snapshots::Snapshots, out: &mut dyn Write) -> std::io::Result<()> {
    let who = match (s.rank, s.pid, &s.host) {
        (Some(r), _, _) => format!("rank {r}"),
        (None, Some(pid), Some(host)) => format!("pid {pid} on {host}"),
        (None, Some(pid), None) => format!("pid {pid}"),
        (None, None, _) => "the files name no process".to_string(),
    };
    let mut apart: Vec<String> = Vec::new();
    if let Some(sec) = s.seconds {
        apart.push(format!("{sec:.2} s"));
    }
    if let Some(k) = s.iterations {
        apart.push(format!("about {k} iterations"));
    }
    let apart = if apart.is_empty() {
        String::new()
    } else {
        format!(", {} apart", apart.join(", "))
    };
    writeln!(
        out,
        "Growth between {} snapshots of one process ({who}{apart}; oldest first: {}):",
        s.files.len(),
        shown(&s.files.join(", "))
    )?;
    if s.sites.is_empty() {
        writeln!(out, "  no site grew")?;
    }
    for g in &s.sites {
        let per = match (g.verdict, s.iterations) {
            (snapshots::Verdict::Leak, Some(k)) => {
                format!(" (about +{} per iteration)", fmt_bytes(g.growth_bytes / k))
            }
            _ => String::new(),
        };
        writeln!(
            out,
            "  {:>10}  {}{per}, {} live at the end: {}",
            format!("+{}", fmt_bytes(g.growth_bytes)),
            g.verdict.as_str(),
            fmt_bytes(g.live_bytes_at_end),
            shown(&g.site)
        )?;
    }
    Ok(())
}

fn write_oom(o: &Oom, several: bool, out: &mut dyn Write) -> std::io::Result<()> {
    let who = if several {
        match o.rank {
            Some(_) => format!("{} ran out of memory first", rank(o.rank, o.pid)),
            None => format!(
                "The process ({}) ran out of memory first",
                rank(o.rank, o.pid)
            ),
        }
    } else {
        "Out of memory".to_string()
    };
    writeln!(
        out,
        "{who}: asked for {} on device {}, the driver had {} free ({})",
        fmt_bytes(o.request_bytes),
        o.device,
        opt_bytes(o.device_free_bytes),
        shown(&o.file)
    )?;
    match o.verdict {
        Verdict::Live => writeln!(
            out,
            "  verdict: live: the live allocations hold the memory ({} requested, {} reserved)",
            fmt_bytes(o.live_bytes),
            fmt_bytes(o.reserved_bytes)
        )?,
        Verdict::Fragmentation => writeln!(
            out,
            "  verdict: fragmentation: {} reserved but unallocated inside the caching allocator's \
             segments, largest free block {}; {}",
            opt_bytes(o.reserved_unallocated_bytes),
            opt_bytes(o.largest_free_block_bytes),
            shown(o.advice.as_deref().unwrap_or_default())
        )
        .and_then(|_| {
            writeln!(
                out,
                "  `memsnap whatif {} --set expandable_segments:True --set max_split_size_mb:128` \
                 replays it under those settings and says which would have avoided it",
                shown(&o.file)
            )
        })?,
        Verdict::Outside => writeln!(
            out,
            "  verdict: outside: {} of the device's {} is in use but not recorded by memsnap \
             (CUDA contexts, other processes), more than the {} it recorded",
            opt_bytes(o.outside_bytes),
            opt_bytes(o.capacity_bytes),
            fmt_bytes(o.reserved_bytes)
        )?,
    }
    if o.verdict != Verdict::Outside
        && let Some(b) = o.outside_bytes.filter(|&b| b > 0)
    {
        writeln!(
            out,
            "  {} of the device's {} is in use outside memsnap's record",
            fmt_bytes(b),
            opt_bytes(o.capacity_bytes)
        )?;
    }
    if let Some(why) = &o.cannot_tell {
        writeln!(out, "  {}", shown(why))?;
    }
    if !o.sites.is_empty() {
        writeln!(out, "  held by (requested bytes, allocations, site):")?;
        for s in &o.sites {
            writeln!(
                out,
                "    {:>10}  {:>6}  {} {}",
                fmt_bytes(s.bytes),
                s.allocations,
                shown(&s.site),
                library_and_role(s)
            )?;
        }
    }
    if !o.others.is_empty() {
        let others: Vec<String> = o
            .others
            .iter()
            .map(|r| {
                format!(
                    "{} {} live (peak {})",
                    rank(r.rank, None),
                    opt_bytes(r.live_bytes),
                    fmt_bytes(r.peak_bytes)
                )
            })
            .collect();
        writeln!(out, "  the other ranks then: {}", others.join(", "))?;
    }
    Ok(())
}

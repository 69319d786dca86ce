//! `memsnap top [PID ...|--all]`: watches running processes' GPU memory by allocation
//! site, live, through the socket each recording process serves (`memsnap_format::live`).
//!
//! Cold, no unsafe. The client is `reach::ask`; `model` turns samples into rows (with the
//! site rules of `memsnap_engine::sites`); `ui` is the full-screen view (ratatui). When
//! stdout is not a terminal, or with `--once`, samples are printed as plain lines or JSON.

pub mod model;
pub mod ui;

use crate::reach;
use anyhow::{Result, bail};
use memsnap_format::live::{self, Answer, Request, Sample};
use model::Watched;
use std::io::{IsTerminal, Write};
use std::os::unix::fs::MetadataExt;
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Keys: s sort (live bytes, count, growth), g growth since start / since \
the last step, f or space freeze, d dump a snapshot now, q quit.\n\nExamples:\n  memsnap top 12345\n  \
memsnap top --all                 # the recording processes of this session or job (all ranks)\n  \
memsnap top --all --user          # every process of yours on this host recording with memsnap\n  \
memsnap top 12345 --once --json   # one sample as JSON, for scripts"
)]
pub struct TopArgs {
    /// Processes to watch
    #[arg(value_name = "PID", required_unless_present = "all")]
    pub pids: Vec<u32>,
    #[command(flatten)]
    pub scope: reach::ScopeArgs,
    /// Print one sample and exit
    #[arg(long)]
    pub once: bool,
    /// With --once: one JSON object per process, one per line
    #[arg(long, requires = "once")]
    pub json: bool,
    /// Seconds between refreshes
    #[arg(long, value_name = "SECS", default_value_t = 1.0)]
    pub interval: f64,
    /// Site rows shown in plain-line mode
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    #[command(flatten)]
    pub attr: crate::args::Attribution,
}

/// How long one sample may take to come back (the process answers within milliseconds
/// unless its writer is busy writing a large snapshot).
const SAMPLE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a snapshot asked with `d` may take to be written.
const DUMP_TIMEOUT: Duration = Duration::from_secs(120);

/// One sample of `pid`, without the first `known` (frames, stacks) the caller holds.
pub fn sample(uid: u32, pid: u32, known: (u32, u32)) -> Result<Sample> {
    let request = Request::Sample {
        known_frames: known.0,
        known_stacks: known.1,
    };
    match reach::ask(uid, pid, &request, SAMPLE_TIMEOUT)? {
        Answer::Sample(s) => Ok(s),
        Answer::Failed { reason } => bail!("pid {pid}: {reason}"),
        Answer::Dumped { .. } => bail!("pid {pid} answered a sample request with a dump"),
    }
}

/// Asks `pid` for a snapshot now; its path once written.
pub fn dump_now(uid: u32, pid: u32) -> Result<String> {
    match reach::ask(uid, pid, &Request::Dump, DUMP_TIMEOUT)? {
        Answer::Dumped { path, .. } => Ok(path),
        Answer::Failed { reason } => bail!("pid {pid} could not write a snapshot: {reason}"),
        Answer::Sample(_) => bail!("pid {pid} answered a dump request with a sample"),
    }
}

/// Takes a new sample of every watched process that is still there; returns the OOM
/// events and the processes that went away, as lines.
pub fn refresh(uid: u32, watched: &mut [Watched]) -> Vec<String> {
    let mut lines = Vec::new();
    for w in watched.iter_mut().filter(|w| w.gone.is_none()) {
        match sample(uid, w.pid, w.known()) {
            Ok(s) => lines.extend(w.update(s)),
            Err(e) => {
                let why = format!("{e:#}");
                lines.push(format!("pid {}: gone: {why}", w.pid));
                w.gone = Some(why);
            }
        }
    }
    lines
}

pub fn top(args: TopArgs) -> Result<ExitCode> {
    let uid = std::fs::metadata("/proc/self")?.uid();
    let pids = if args.scope.all {
        let recording = |pid| live::socket_path(uid, pid).exists();
        match reach::in_scope(uid, args.scope.user, "recording with memsnap", recording) {
            Some((_, pids, _)) => pids,
            None => return Ok(ExitCode::from(1)),
        }
    } else {
        args.pids.clone()
    };
    let mut watched = Vec::new();
    let mut failed = 0;
    for pid in pids {
        match sample(uid, pid, (0, 0)) {
            Ok(s) => watched.push(Watched::new(s, args.attr.rules())),
            Err(e) => {
                eprintln!("memsnap: {e:#}");
                failed += 1;
            }
        }
    }
    if watched.is_empty() {
        return Ok(ExitCode::from(1));
    }
    let interval = Duration::try_from_secs_f64(args.interval.max(0.1)).unwrap_or(Duration::MAX);
    let stdout = std::io::stdout();
    if args.once {
        let mut out = stdout.lock();
        if args.json {
            for w in &watched {
                serde_json::to_writer(&mut out, &model::process_json(w))?;
                writeln!(out)?;
            }
        } else {
            for line in model::plain_lines(&watched, args.top, false) {
                writeln!(out, "{line}")?;
            }
        }
    } else if stdout.is_terminal() {
        ui::run(uid, &mut watched, interval)?;
    } else {
        // One sample per refresh as plain lines, until every process is gone.
        loop {
            let mut out = stdout.lock();
            for line in model::plain_lines(&watched, args.top, true) {
                writeln!(out, "{line}")?;
            }
            out.flush()?;
            drop(out);
            let next = Instant::now() + interval;
            std::thread::sleep(next.saturating_duration_since(Instant::now()));
            for line in refresh(uid, &mut watched) {
                writeln!(stdout.lock(), "{line}")?;
            }
            if watched.iter().all(|w| w.gone.is_some()) {
                break;
            }
        }
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

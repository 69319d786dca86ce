//! `memsnap dump [PID ...|--all]`: asks running processes for a snapshot now.
//!
//! Cold, no unsafe. `--all` reaches the processes of the caller's own session or job: the
//! same session id (/proc/PID/stat), a descendant of a process of that session (launchers
//! such as torchrun may start their workers in sessions of their own), or the same
//! `SLURM_JOB_ID`; `--user` widens it to every process of the user on the host (under a
//! shared account that includes other people's jobs). The list is printed before anything
//! is asked. For each process: checks that it exists, is the user's, has `libmemsnap.so`
//! mapped and is recording (its `memsnap-writer` thread exists), reads where it writes from
//! `/proc/PID/environ` with the library's own parser (for `--folder`), then asks:
//!
//! - through its live socket (`reach::ask`, the client `memsnap top` uses) when it has
//!   one: no signal, so nothing in the program is interrupted (a `sleep()` is not cut
//!   short), and the answer is the file's path;
//! - else with the dump signal, only when it catches it (sending SIGUSR1 to a process that
//!   does not would kill it), following its acknowledgement file (`memsnap_format::ack`):
//!   the process says at once that the signal arrived, then which file it wrote or why it
//!   could not. A process that exits before saying so, with the file written, still counts
//!   as dumped: the file is looked for in its folder.
//!
//! A pid without memsnap whose descendants record (the `memsnap run` launcher, which is
//! what `pgrep -f train.py` finds first) stands for those descendants: they are dumped
//! instead, and named.
//!
//! Signals are sent with the `kill` program: the CLI has no unsafe code, and `libc::kill`
//! is an unsafe FFI call.

use crate::reach::{
    self, ScopeArgs, describe_pids, has_memsnap, has_socket, has_writer_thread, in_scope, plural,
    read_environ, recording_descendants,
};
use anyhow::{Result, bail};
use memsnap_format::ack::{self, Ack, Outcome};
use memsnap_format::config::{self, Config, var};
use memsnap_format::live::{Answer, Request};
use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant, SystemTime};

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Examples:\n  memsnap dump 12345\n  memsnap dump --all          # the recording processes of this session or job (all ranks)\n  memsnap dump --all --folder snaps   # only those writing to ./snaps\n  memsnap dump --all --user   # every process of yours on this host recording with memsnap"
)]
pub struct DumpArgs {
    /// Processes to dump
    #[arg(value_name = "PID", required_unless_present = "all")]
    pub pids: Vec<u32>,
    #[command(flatten)]
    pub scope: ScopeArgs,
    /// With --all: only processes whose snapshot folder is DIR (one job's ranks)
    #[arg(long, value_name = "DIR", requires = "all")]
    pub folder: Option<PathBuf>,
    /// Seconds to wait for each snapshot
    #[arg(long, value_name = "SECS", default_value_t = 60.0)]
    pub timeout: f64,
}

/// How long a process has to acknowledge the signal: its writer answers within
/// milliseconds unless the signal never reached it.
const ACK_WAIT: Duration = Duration::from_secs(3);

/// A process about to be dumped.
struct Target {
    pid: u32,
    /// Asked through its live socket (no signal).
    via_socket: bool,
    /// Where it writes, and its file-name template: a file written by a process that
    /// exited before acknowledging is looked for there.
    folder: PathBuf,
    filename: String,
    asked_at: SystemTime,
    signal: i32,
    /// Its acknowledgement file, and what it said before the signal.
    ack_path: PathBuf,
    started: u64,
    received_before: u64,
    /// Set once the process acknowledged: the signal count that covers ours.
    received: Option<u64>,
}

pub fn dump(args: DumpArgs) -> Result<ExitCode> {
    let uid = std::fs::metadata("/proc/self")?.uid();
    let mut failed = 0usize;
    let mut targets = Vec::new();

    if args.scope.all {
        let Some((scope, pids, outside)) =
            in_scope(uid, args.scope.user, "with memsnap loaded", |_| true)
        else {
            return Ok(ExitCode::from(1));
        };
        let mut chosen = Vec::new();
        for pid in pids {
            match prepare(pid, uid, args.folder.as_deref()) {
                Ok(t) => {
                    chosen.push(t.pid);
                    targets.push(t);
                }
                // The scan found memsnap loaded in each of them: one without it now has
                // exited or replaced its program since, and is no longer a target.
                Err(Prepare::Excluded | Prepare::Gone(_) | Prepare::NoMemsnap(_)) => {}
                // Launchers (torchrun's agent) and helpers that never touch CUDA load the
                // library too: skipping them is not a failure.
                Err(Prepare::NotRecording(msg)) => eprintln!("memsnap: skipping: {msg}"),
                Err(Prepare::Failed(msg)) => {
                    eprintln!("memsnap: {msg}");
                    failed += 1;
                }
            }
        }
        if targets.is_empty() && failed == 0 && args.folder.is_some() {
            eprintln!("memsnap: no recording process writes to that folder");
            return Ok(ExitCode::from(1));
        }
        if targets.is_empty() && failed == 0 {
            eprintln!("memsnap: none of the processes with memsnap loaded is recording");
            return Ok(ExitCode::from(1));
        }
        if !chosen.is_empty() {
            eprintln!(
                "memsnap: dumping {} {}: {}",
                plural(chosen.len(), "process", "processes"),
                if args.scope.user {
                    "of yours on this host".to_string()
                } else {
                    format!("in {}", scope.describe())
                },
                describe_pids(&chosen)
            );
        }
        if !args.scope.user && !outside.is_empty() {
            eprintln!(
                "memsnap: left alone: {} with memsnap loaded outside {} ({}; --user includes them)",
                plural(outside.len(), "process", "processes"),
                scope.describe(),
                describe_pids(&outside)
            );
        }
    } else {
        for &pid in &args.pids {
            match prepare(pid, uid, None) {
                Ok(t) => targets.push(t),
                Err(Prepare::Excluded) => {}
                Err(Prepare::NoMemsnap(msg)) => {
                    // A launcher (`memsnap run`, torchrun's agent) stands for the processes
                    // it started that record.
                    let children = recording_descendants(uid, pid);
                    if children.is_empty() {
                        eprintln!("memsnap: {msg}");
                        failed += 1;
                        continue;
                    }
                    eprintln!(
                        "memsnap: pid {pid} has no memsnap loaded (a launcher); dumping {} it started: {}",
                        plural(children.len(), "process", "processes"),
                        describe_pids(&children)
                    );
                    for child in children {
                        match prepare(child, uid, None) {
                            Ok(t) => targets.push(t),
                            Err(Prepare::Excluded | Prepare::Gone(_)) => {}
                            Err(Prepare::NotRecording(msg)) => {
                                eprintln!("memsnap: skipping: {msg}")
                            }
                            Err(Prepare::NoMemsnap(msg) | Prepare::Failed(msg)) => {
                                eprintln!("memsnap: {msg}");
                                failed += 1;
                            }
                        }
                    }
                }
                Err(Prepare::NotRecording(msg) | Prepare::Failed(msg) | Prepare::Gone(msg)) => {
                    eprintln!("memsnap: {msg}");
                    failed += 1;
                }
            }
        }
    }

    // `--timeout inf` (or any value past what a Duration holds) waits as long as it takes.
    let timeout = Duration::try_from_secs_f64(args.timeout.max(0.0)).unwrap_or(Duration::MAX);
    let (by_socket, by_signal): (Vec<Target>, Vec<Target>) =
        targets.into_iter().partition(|t| t.via_socket);
    // Each socket request on a thread of its own: the processes write at once.
    let asked: Vec<_> = by_socket
        .into_iter()
        .map(|t| std::thread::spawn(move || ask_through_socket(uid, &t, timeout)))
        .collect();

    let mut waiting = Vec::new();
    for mut t in by_signal {
        t.asked_at = SystemTime::now();
        match send_signal(t.pid, t.signal) {
            Ok(()) => waiting.push(t),
            Err(e) => {
                eprintln!("memsnap: {e:#}");
                failed += 1;
            }
        }
    }

    let start = Instant::now();
    while !waiting.is_empty() {
        waiting.retain_mut(|t| match poll(t, start.elapsed()) {
            Poll::Waiting => true,
            Poll::Done(Ok(path)) => {
                println!("{}", path.display());
                false
            }
            Poll::Done(Err(msg)) => {
                eprintln!("memsnap: {msg}");
                failed += 1;
                false
            }
        });
        if waiting.is_empty() {
            break;
        }
        if start.elapsed() > timeout {
            for t in &waiting {
                eprintln!(
                    "memsnap: pid {} acknowledged the signal but wrote no snapshot within {:.0} s",
                    t.pid,
                    timeout.as_secs_f64()
                );
                failed += 1;
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for handle in asked {
        match handle.join() {
            Ok(Ok(path)) => println!("{}", path.display()),
            Ok(Err(msg)) => {
                eprintln!("memsnap: {msg}");
                failed += 1;
            }
            Err(_) => failed += 1,
        }
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

enum Poll {
    Waiting,
    Done(Result<PathBuf, String>),
}

/// Where `t` stands: acknowledged or not, written or failed.
fn poll(t: &mut Target, elapsed: Duration) -> Poll {
    let proc = PathBuf::from(format!("/proc/{}", t.pid));
    let ack = Ack::read(&t.ack_path).filter(|a| a.pid == t.pid && a.started == t.started);
    if t.received.is_none() {
        match &ack {
            Some(a) if a.received > t.received_before => {
                t.received = Some(a.received);
                eprintln!("memsnap: pid {} received the signal; writing", t.pid);
            }
            _ if !alive(&proc) => {
                return Poll::Done(written_since(t).ok_or_else(|| {
                    format!("pid {} exited before acknowledging the signal", t.pid)
                }));
            }
            _ if elapsed > ACK_WAIT => return Poll::Done(Err(not_acknowledged(t, &proc))),
            _ => return Poll::Waiting,
        }
    }
    let ours = t.received.unwrap_or(u64::MAX);
    match ack {
        Some(a) if a.served >= ours => match a.last {
            Some(Outcome::Written(path)) => {
                shared(t.pid, a.requests);
                Poll::Done(Ok(path))
            }
            Some(Outcome::Failed(reason)) => Poll::Done(Err(format!(
                "pid {} received the signal but could not write its snapshot: {reason}",
                t.pid
            ))),
            None => Poll::Done(Err(format!(
                "pid {} said nothing about its snapshot",
                t.pid
            ))),
        },
        _ if !alive(&proc) => Poll::Done(
            written_since(t)
                .ok_or_else(|| format!("pid {} exited before its snapshot was written", t.pid)),
        ),
        _ => Poll::Waiting,
    }
}

/// Why a process may not have answered, from what /proc shows.
fn not_acknowledged(t: &Target, proc: &Path) -> String {
    let status = std::fs::read_to_string(proc.join("status")).unwrap_or_default();
    let has_bit = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
            .is_some_and(|mask| mask & (1u64 << (t.signal - 1)) != 0)
    };
    let why = if has_bit("ShdPnd:") || has_bit("SigPnd:") {
        "the signal is pending: the program blocks it (sigprocmask) and will be dumped when it \
         unblocks it"
            .to_string()
    } else if !catches(proc, t.signal) {
        format!("it no longer catches signal {}", t.signal)
    } else {
        "its writer did not answer (busy, or stopped)".to_string()
    };
    format!(
        "pid {} did not acknowledge signal {} within {} s: {why}",
        t.pid,
        t.signal,
        ACK_WAIT.as_secs()
    )
}

/// Whether the process is there and not a zombie (one that exited and that its parent has
/// not reaped yet still has a /proc entry).
fn alive(proc: &Path) -> bool {
    std::fs::read_to_string(proc.join("stat")).is_ok_and(|stat| {
        let state = stat
            .rfind(')')
            .and_then(|at| stat[at + 1..].split_whitespace().next());
        !matches!(state, Some("Z" | "X") | None)
    })
}

/// Asks `t` for a snapshot through its live socket; the file's path once written.
fn ask_through_socket(uid: u32, t: &Target, timeout: Duration) -> Result<PathBuf, String> {
    let pid = t.pid;
    match reach::ask(uid, pid, &Request::Dump, timeout) {
        Ok(Answer::Dumped { path, requests }) => {
            shared(pid, requests);
            Ok(PathBuf::from(path))
        }
        Ok(Answer::Failed { reason }) => {
            Err(format!("pid {pid} could not write its snapshot: {reason}"))
        }
        Ok(Answer::Sample(_)) => Err(format!("pid {pid} answered a dump request with a sample")),
        // It may have written the file and exited before answering.
        Err(e) => written_since(t).ok_or_else(|| format!("{e:#}")),
    }
}

/// Says when the snapshot that answered also served other requests: requests that arrive
/// within the process's floor between request snapshots (docs/SIGNALS.md) share the next one.
fn shared(pid: u32, requests: u64) {
    if requests > 1 {
        eprintln!(
            "memsnap: pid {pid}: one snapshot served {requests} dump requests (signals and socket requests that arrive within a second of the last one share the next)"
        );
    }
}

/// A `signal` snapshot of `t` written since it was asked (the newest), for a process that
/// exited before it could say so: a file that was written is never reported as a failure.
fn written_since(t: &Target) -> Option<PathBuf> {
    let pid = t.pid.to_string();
    let names_pid = t.filename.contains("{pid}");
    std::fs::read_dir(&t.folder)
        .ok()?
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let meta = e.metadata().ok()?;
            let modified = meta.modified().ok()?;
            let ours = !name.starts_with('.')
                && name.contains("signal")
                && (!names_pid || has_number(&name, &pid));
            (meta.is_file() && ours && modified >= t.asked_at).then(|| (modified, e.path()))
        })
        .max()
        .map(|(_, path)| path)
}

/// Whether `number` appears in `name` as a whole number (not inside a longer one).
fn has_number(name: &str, number: &str) -> bool {
    name.match_indices(number).any(|(at, _)| {
        let before = name[..at].chars().next_back();
        let after = name[at + number.len()..].chars().next();
        !before.is_some_and(|c| c.is_ascii_digit()) && !after.is_some_and(|c| c.is_ascii_digit())
    })
}

enum Prepare {
    /// The process exists but has no memsnap loaded: it may be a launcher whose children
    /// record.
    NoMemsnap(String),
    /// memsnap is loaded but not recording (no CUDA allocation yet, a forked child, or
    /// signals off): nothing would answer the signal.
    NotRecording(String),
    Failed(String),
    /// The process no longer exists. An error for a pid the user named; with `--all`, a
    /// process that exited between the scan and its check is simply not there any more.
    Gone(String),
    /// `--all --folder DIR`: writes somewhere else.
    Excluded,
}

/// Whether two folders are the same (resolving links where they exist).
fn same_dir(a: &Path, b: &Path) -> bool {
    let resolve = |p: &Path| {
        p.canonicalize()
            .or_else(|_| std::path::absolute(p))
            .unwrap_or_else(|_| p.to_path_buf())
    };
    resolve(a) == resolve(b)
}

fn prepare(pid: u32, uid: u32, only_folder: Option<&Path>) -> Result<Target, Prepare> {
    let proc = PathBuf::from(format!("/proc/{pid}"));
    let meta = std::fs::metadata(&proc).map_err(|_| Prepare::Gone(format!("no process {pid}")))?;
    if meta.uid() != uid {
        return Err(Prepare::Failed(format!(
            "pid {pid} belongs to another user (uid {}); you can only dump your own processes",
            meta.uid()
        )));
    }
    let maps = std::fs::read_to_string(proc.join("maps")).map_err(|e| {
        if e.kind() == std::io::ErrorKind::PermissionDenied {
            Prepare::Failed(format!(
                "permission denied reading /proc/{pid}/maps: cannot tell whether pid {pid} has memsnap loaded"
            ))
        } else {
            Prepare::Gone(format!("no process {pid} ({e})"))
        }
    })?;
    if maps.is_empty() {
        // A process that is exiting, or exited and not yet reaped, has no memory left to map.
        return Err(Prepare::Gone(format!("pid {pid} has exited")));
    }
    if !has_memsnap(&maps) {
        return Err(Prepare::NoMemsnap(format!(
            "pid {pid} does not have memsnap loaded (start it with `memsnap run -- ...` or LD_PRELOAD=libmemsnap.so)"
        )));
    }

    let env = read_environ(&proc.join("environ"));
    let (cfg, _) = Config::from_lookup(|k| env.get(k).cloned());
    let folder = expand_folder(&cfg.folder, pid, &env).map_err(|msg| match only_folder {
        Some(_) => Prepare::Excluded, // not provably this job's
        None => Prepare::Failed(msg),
    })?;
    let folder = if folder.is_absolute() {
        folder
    } else {
        let cwd = std::fs::read_link(proc.join("cwd")).map_err(|e| {
            if !proc.exists() {
                return Prepare::Gone(format!("no process {pid}"));
            }
            Prepare::Failed(format!(
                "cannot read the working directory of pid {pid} ({e}), which {} is relative to",
                var::FOLDER
            ))
        })?;
        // `.` components only make the printed paths longer.
        cwd.join(folder)
            .components()
            .filter(|c| *c != std::path::Component::CurDir)
            .collect()
    };
    if let Some(only) = only_folder
        && !same_dir(&folder, only)
    {
        return Err(Prepare::Excluded);
    }
    // The writer names itself a moment after it starts: give a process that has just
    // started recording a second to show it.
    let start = Instant::now();
    while !has_writer_thread(&proc) && start.elapsed() < Duration::from_secs(1) {
        std::thread::sleep(Duration::from_millis(10));
    }
    if !has_writer_thread(&proc) {
        return Err(Prepare::NotRecording(format!(
            "pid {pid} has memsnap loaded but is not recording (no CUDA allocation yet, or \
             already exiting); not signalling it"
        )));
    }
    let mut target = Target {
        pid,
        via_socket: false,
        folder,
        filename: cfg.filename.clone(),
        asked_at: SystemTime::now(),
        signal: 0,
        ack_path: ack::path(uid, pid),
        started: 0,
        received_before: 0,
        received: None,
    };
    if has_socket(uid, pid) {
        target.via_socket = true;
        return Ok(target);
    }
    let Some(signal) = cfg.signal else {
        return Err(Prepare::NotRecording(format!(
            "signals are off for pid {pid} ({}=none) and it has no live socket",
            var::SIGNAL
        )));
    };
    if !catches(&proc, signal) {
        return Err(Prepare::NotRecording(format!(
            "pid {pid} does not catch signal {signal} yet; sending it could kill the process"
        )));
    }

    target.signal = signal;
    target.started = std::fs::read_to_string(proc.join("stat"))
        .ok()
        .and_then(|s| ack::start_time(&s))
        .unwrap_or(0);
    target.received_before = Ack::read(&target.ack_path)
        .filter(|a| a.pid == pid && a.started == target.started)
        .map_or(0, |a| a.received);
    Ok(target)
}

/// Whether the process has a handler for `signal` (`SigCgt` in /proc/PID/status).
fn catches(proc: &Path, signal: i32) -> bool {
    let Ok(status) = std::fs::read_to_string(proc.join("status")) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|mask| (1..=64).contains(&signal) && mask & (1u64 << (signal - 1)) != 0)
}

/// `MEMSNAP_FOLDER` for this process. Placeholders that are fixed for a process are
/// expanded; ones that change per file (`{seq}`, `{step}`, `{time}`, ...) cannot be.
fn expand_folder(folder: &str, pid: u32, env: &HashMap<String, String>) -> Result<PathBuf, String> {
    // The library's own rules (crates/format/src/config.rs), applied to the other process's
    // environment.
    let (rank, local_rank) = config::ranks(|k| env.get(k).cloned(), pid);
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".to_string());
    let value = |key: &str| match key {
        "pid" => Some(pid.to_string()),
        "rank" => Some(config::sanitize(&rank)),
        "local_rank" => Some(config::sanitize(&local_rank)),
        "host" => Some(config::sanitize(&host)),
        "reason" | "tag" | "label" => Some("signal".to_string()),
        _ => None,
    };
    config::expand_template(folder, value)
        .map(PathBuf::from)
        .map_err(|key| {
            format!(
                "cannot tell where pid {pid} writes: {}={folder} uses {{{key}}}",
                var::FOLDER
            )
        })
}

fn send_signal(pid: u32, signal: i32) -> Result<()> {
    let out = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .stdin(Stdio::null())
        .output();
    match out {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => bail!(
            "could not signal pid {pid}: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => bail!("could not run `kill` to signal pid {pid}: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process that has exited but is not yet reaped still has its /proc entry, with no
    /// mappings: `--all` met one while other jobs' processes exited beside it, and called it
    /// a process without memsnap (a failure) instead of one that is gone.
    #[test]
    fn an_exited_process_not_yet_reaped_is_gone() {
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("run true");
        let pid = child.id();
        let stat = PathBuf::from(format!("/proc/{pid}/stat"));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !std::fs::read_to_string(&stat).is_ok_and(|s| {
            s.rsplit(')')
                .next()
                .is_some_and(|rest| rest.trim_start().starts_with('Z'))
        }) {
            assert!(
                std::time::Instant::now() < deadline,
                "pid {pid} never exited"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let uid = std::fs::metadata("/proc/self").unwrap().uid();
        assert!(
            matches!(prepare(pid, uid, None), Err(Prepare::Gone(_))),
            "an exited process"
        );
        child.wait().unwrap();
    }

    #[test]
    fn folder_placeholders() {
        let env: HashMap<String, String> = [("SLURM_PROCID".to_string(), "5".to_string())].into();
        assert_eq!(
            expand_folder("/s/r{rank}-p{pid}", 42, &env).unwrap(),
            PathBuf::from("/s/r5-p42")
        );
        assert!(expand_folder("/s/{step}", 42, &env).is_err());
    }
}

//! Finding and reaching the processes that record with memsnap, for `memsnap dump` and
//! `memsnap top`: the processes of a user with the library loaded, which of them `--all`
//! reaches (the caller's session or job; every one with `--user`), whether one is
//! recording, and asking one through its live socket (`memsnap_format::live`), or saying
//! why it cannot be reached.
//!
//! Cold, no unsafe. Everything here reads /proc and the user's private folder; nothing is
//! signalled.

use anyhow::{Context, Result, bail};
use memsnap_format::ack;
use memsnap_format::live::{self, Answer, MAX_ANSWER, PROTOCOL_VERSION, Request};
use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// `--all` and `--user`: the processes a command reaches when it is given no pids.
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct ScopeArgs {
    /// The processes with memsnap in this session or job: same session id, a descendant of
    /// this session (a launcher's workers), or the same SLURM_JOB_ID
    #[arg(long, conflicts_with = "pids")]
    pub all: bool,
    /// With --all: every process of yours on this host with memsnap, whatever its session
    /// (under a shared account: other people's jobs too)
    #[arg(long, requires = "all")]
    pub user: bool,
}

/// The processes of `uid` (other than this one) with memsnap loaded that `keep` accepts,
/// split into those `--all` reaches (the caller's session or job; every one with `--user`)
/// and the rest, with the caller's scope. When `--all` reaches none, says so on stderr,
/// naming the processes outside the scope (`what`: how the processes are described, e.g.
/// "with memsnap loaded"), and returns `None`.
pub fn in_scope(
    uid: u32,
    user: bool,
    what: &str,
    keep: impl Fn(u32) -> bool,
) -> Option<(Scope, Vec<u32>, Vec<u32>)> {
    let scope = Scope::of_caller();
    let (pids, outside): (Vec<u32>, Vec<u32>) = memsnap_processes(uid, std::process::id())
        .into_iter()
        .filter(|&pid| keep(pid))
        .partition(|&pid| user || scope.contains(pid));
    if !pids.is_empty() {
        return Some((scope, pids, outside));
    }
    if outside.is_empty() {
        eprintln!("memsnap: no process of yours on this host {what}");
    } else {
        eprintln!(
            "memsnap: no process {what} in {}; {} of yours elsewhere on this host: {} (add --user to include them, or name the pids)",
            scope.describe(),
            plural(outside.len(), "process", "processes"),
            describe_pids(&outside)
        );
    }
    None
}

/// The caller's session and job: what `--all` reaches without `--user`.
pub struct Scope {
    session: Option<u32>,
    slurm_job: Option<String>,
}

/// Parent links followed at most when looking for an ancestor.
const MAX_ANCESTORS: usize = 64;

impl Scope {
    fn of_caller() -> Self {
        Scope {
            session: stat_fields(Path::new("/proc/self")).map(|f| f.session),
            slurm_job: std::env::var("SLURM_JOB_ID").ok().filter(|j| !j.is_empty()),
        }
    }

    /// Whether `pid` is in the caller's session (or descends from a process that is), or
    /// in the caller's SLURM job.
    fn contains(&self, pid: u32) -> bool {
        let proc = PathBuf::from(format!("/proc/{pid}"));
        if let Some(job) = &self.slurm_job
            && read_environ(&proc.join("environ")).get("SLURM_JOB_ID") == Some(job)
        {
            return true;
        }
        let Some(mine) = self.session else {
            return false;
        };
        in_lineage(pid, |f| f.session == mine)
    }

    pub fn describe(&self) -> String {
        match (&self.slurm_job, self.session) {
            (Some(job), Some(s)) => format!("this session ({s}) or SLURM job {job}"),
            (Some(job), None) => format!("SLURM job {job}"),
            (None, Some(s)) => format!("this session ({s})"),
            (None, None) => "this session".to_string(),
        }
    }
}

/// The fields of /proc/PID/stat that say where a process belongs.
struct StatFields {
    ppid: u32,
    session: u32,
}

/// Parent pid and session id from `proc/stat` (fields 4 and 6; the command name in field
/// 2 may hold spaces and parentheses, so fields are counted from its closing parenthesis).
fn stat_fields(proc: &Path) -> Option<StatFields> {
    parse_stat(&std::fs::read_to_string(proc.join("stat")).ok()?)
}

fn parse_stat(stat: &str) -> Option<StatFields> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut f = rest.split_whitespace();
    let _state = f.next()?;
    let ppid = f.next()?.parse().ok()?;
    let _pgrp = f.next()?;
    let session = f.next()?.parse().ok()?;
    Some(StatFields { ppid, session })
}

/// `pid 12 (python), pid 13 (python)`.
pub fn describe_pids(pids: &[u32]) -> String {
    pids.iter()
        .map(|pid| {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            match comm.trim() {
                "" => format!("pid {pid}"),
                c => format!("pid {pid} ({c})"),
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

pub fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// The processes descending from `pid` that have memsnap loaded and are recording.
pub fn recording_descendants(uid: u32, pid: u32) -> Vec<u32> {
    memsnap_processes(uid, std::process::id())
        .into_iter()
        .filter(|&p| descends_from(p, pid))
        .filter(|&p| has_writer_thread(&PathBuf::from(format!("/proc/{p}"))))
        .collect()
}

/// Whether `ancestor` is `pid`'s parent, grandparent, ...
fn descends_from(pid: u32, ancestor: u32) -> bool {
    in_lineage(pid, |f| f.ppid == ancestor)
}

/// Whether `found` holds for the stat fields of `pid` or of one of its ancestors, following
/// parent links up to init (at most [`MAX_ANCESTORS`] of them). False when a process on the
/// way cannot be read.
fn in_lineage(pid: u32, found: impl Fn(&StatFields) -> bool) -> bool {
    let mut at = pid;
    for _ in 0..MAX_ANCESTORS {
        let Some(f) = stat_fields(&PathBuf::from(format!("/proc/{at}"))) else {
            return false;
        };
        if found(&f) {
            return true;
        }
        if f.ppid <= 1 {
            return false;
        }
        at = f.ppid;
    }
    false
}

/// Whether `pid` serves a live socket in this user's private folder (what `memsnap top`
/// connects to): only this user can have made it there.
pub fn has_socket(uid: u32, pid: u32) -> bool {
    private_folder(uid)
        && std::fs::symlink_metadata(live::socket_path(uid, pid))
            .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
}

/// Whether `uid`'s folder for sockets and acknowledgements is a directory of theirs that
/// only they can open.
fn private_folder(uid: u32) -> bool {
    std::fs::symlink_metadata(ack::folder(uid))
        .is_ok_and(|m| m.is_dir() && m.uid() == uid && m.mode() & 0o077 == 0)
}

/// Whether a process's /proc/PID/maps text maps `libmemsnap.so`.
pub fn has_memsnap(maps: &str) -> bool {
    maps.lines().any(|l| {
        l.split_whitespace()
            .nth(5)
            .is_some_and(|path| path.rsplit('/').next() == Some("libmemsnap.so"))
    })
}

/// The process's environment at exec time (what `MEMSNAP_*` the library most likely read).
pub fn read_environ(path: &Path) -> HashMap<String, String> {
    std::fs::read(path)
        .unwrap_or_default()
        .split(|&b| b == 0)
        .filter_map(|kv| {
            let kv = String::from_utf8_lossy(kv);
            kv.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect()
}

/// The library's writer thread is named `memsnap-writer`; it exists only while recording.
pub fn has_writer_thread(proc: &Path) -> bool {
    let Ok(tasks) = std::fs::read_dir(proc.join("task")) else {
        return false;
    };
    tasks.flatten().any(|t| {
        std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == "memsnap-writer")
    })
}

/// Every process of `uid` except `me` with libmemsnap.so mapped.
pub fn memsnap_processes(uid: u32, me: u32) -> Vec<u32> {
    let mut pids: Vec<u32> = std::fs::read_dir("/proc")
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .collect()
        })
        .unwrap_or_default();
    pids.sort_unstable();
    pids.into_iter()
        .filter(|&pid| pid != me)
        .filter(|pid| {
            let proc = PathBuf::from(format!("/proc/{pid}"));
            std::fs::metadata(&proc).is_ok_and(|m| m.uid() == uid)
                && std::fs::read_to_string(proc.join("maps")).is_ok_and(|m| has_memsnap(&m))
        })
        .collect()
}

/// Sends one request to process `pid` and reads its answer.
pub fn ask(uid: u32, pid: u32, request: &Request, timeout: Duration) -> Result<Answer> {
    // Only this user can have made a socket in a private folder of theirs: the process at
    // the other end is one of ours (the process checks our credentials in turn).
    let private = private_folder(uid);
    let path = live::socket_path(uid, pid);
    // The writer opens the socket a moment after the first CUDA call: give a process that
    // has just started recording a second to show it.
    let start = Instant::now();
    while private && !path.exists() && start.elapsed() < Duration::from_secs(1) {
        std::thread::sleep(Duration::from_millis(10));
    }
    if !private || !path.exists() {
        bail!("{}", why_unreachable(pid));
    }
    let mut stream = UnixStream::connect(&path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::ConnectionRefused {
            anyhow::anyhow!("pid {pid} does not answer (it exited, or its recording stopped)")
        } else {
            anyhow::anyhow!("cannot connect to pid {pid} ({}): {e}", path.display())
        }
    })?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream
        .write_all(&live::encode(request))
        .with_context(|| format!("asking pid {pid}"))?;
    let answer: Answer = live::read_message(&mut stream, MAX_ANSWER).with_context(|| {
        format!(
            "reading the answer of pid {pid} (a process closes connections while too many \
             clients are still sending or waiting for a snapshot, and from other users)"
        )
    })?;
    if let Answer::Sample(s) = &answer
        && s.version != PROTOCOL_VERSION
    {
        bail!(
            "pid {pid} speaks live-protocol version {} (this memsnap: {PROTOCOL_VERSION}); use the memsnap that came with its library",
            s.version
        );
    }
    Ok(answer)
}

/// Why a process has no socket, from what /proc shows.
fn why_unreachable(pid: u32) -> String {
    match std::fs::read_to_string(format!("/proc/{pid}/maps")) {
        Err(_) if !std::path::Path::new(&format!("/proc/{pid}")).exists() => {
            format!("no process {pid}")
        }
        Err(e) => format!("cannot read /proc/{pid}/maps ({e}): not your process?"),
        Ok(maps) if !has_memsnap(&maps) => format!(
            "pid {pid} does not have memsnap loaded (start it with `memsnap run -- ...` or LD_PRELOAD=libmemsnap.so)"
        ),
        Ok(_) => format!(
            "pid {pid} has memsnap loaded but is not recording yet (it starts on the first CUDA allocation)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_library_in_maps() {
        let maps = "7f00-7f10 r-xp 00000000 08:01 123 /opt/x/lib/libmemsnap.so\n";
        assert!(has_memsnap(maps));
        assert!(has_memsnap(
            "7f00-7f10 r-xp 00000000 08:01 123 /t/libmemsnap.so (deleted)\n"
        ));
        assert!(!has_memsnap(
            "7f00-7f10 r-xp 00000000 08:01 123 /usr/lib/libmemsnap.so.bak\n"
        ));
        assert!(!has_memsnap("7f00-7f10 rw-p 00000000 00:00 0 \n"));
    }

    #[test]
    fn session_and_parent_from_stat() {
        // The command name may hold spaces and parentheses.
        let stat = "4242 (my (odd) prog) S 4200 4242 4100 34816 4242 4194304 120 0";
        let f = parse_stat(stat).unwrap();
        assert_eq!((f.ppid, f.session), (4200, 4100));
        assert!(parse_stat("4242 (x").is_none());
        let me = stat_fields(Path::new("/proc/self")).unwrap();
        assert_eq!(me.ppid, std::os::unix::process::parent_id());
    }
}

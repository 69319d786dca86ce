//! The acknowledgement file: how a recording process tells `memsnap dump` that its dump
//! signal arrived and how the snapshot it asked for ended. The library writes it (a
//! private folder per user, one file per process, replaced atomically); the CLI reads it.
//!
//! Cold. A file of `key value` lines:
//!
//! ```text
//! pid 4242
//! started 123456          # the process's start time (field 22 of /proc/PID/stat)
//! received 3              # dump signals seen so far
//! served 2                # signals whose snapshot is done (written or failed)
//! written /abs/path.pickle    (or: failed REASON)
//! requests 5              # dump requests (signals and socket) that snapshot served
//! ```
//!
//! Requests that arrive within the writer's floor between request snapshots wait for the
//! next one and share it: `requests` above 1 says so (absent: 1).

use std::path::{Path, PathBuf};

/// The per-user folder. A fixed place (not `$TMPDIR`): the CLI and the process must agree
/// without sharing an environment.
pub fn folder(uid: u32) -> PathBuf {
    PathBuf::from(format!("/tmp/memsnap-{uid}"))
}

/// The file of process `pid`.
pub fn path(uid: u32, pid: u32) -> PathBuf {
    folder(uid).join(format!("{pid}.ack"))
}

/// How the last signal's snapshot ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Written(PathBuf),
    Failed(String),
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ack {
    pub pid: u32,
    /// Start time of the process in clock ticks since boot: tells a reused pid apart.
    pub started: u64,
    pub received: u64,
    pub served: u64,
    pub last: Option<Outcome>,
    /// How many dump requests (signals and socket requests together) the last snapshot
    /// served; 0 when not said.
    pub requests: u64,
}

impl Ack {
    pub fn to_text(&self) -> String {
        let mut s = format!(
            "pid {}\nstarted {}\nreceived {}\nserved {}\n",
            self.pid, self.started, self.received, self.served
        );
        match &self.last {
            Some(Outcome::Written(p)) => s += &format!("written {}\n", p.display()),
            // One line: a reason never carries a newline into the next key.
            Some(Outcome::Failed(r)) => s += &format!("failed {}\n", r.replace('\n', " ")),
            None => {}
        }
        if self.requests > 0 {
            s += &format!("requests {}\n", self.requests);
        }
        s
    }

    /// `None` when the text is not a whole acknowledgement (a file being replaced is never
    /// seen half-written, but a stranger's file could be anything).
    pub fn parse(text: &str) -> Option<Ack> {
        let mut ack = Ack::default();
        let (mut pid, mut started, mut received, mut served) = (false, false, false, false);
        for line in text.lines() {
            let (key, value) = line.split_once(' ')?;
            match key {
                "pid" => (ack.pid, pid) = (value.parse().ok()?, true),
                "started" => (ack.started, started) = (value.parse().ok()?, true),
                "received" => (ack.received, received) = (value.parse().ok()?, true),
                "served" => (ack.served, served) = (value.parse().ok()?, true),
                "written" => ack.last = Some(Outcome::Written(PathBuf::from(value))),
                "failed" => ack.last = Some(Outcome::Failed(value.to_string())),
                "requests" => ack.requests = value.parse().ok()?,
                _ => {}
            }
        }
        (pid && started && received && served).then_some(ack)
    }

    /// Reads `path`; `None` when absent, not a regular file or not an acknowledgement.
    /// Opened without blocking and checked once open: a FIFO (or any other special file)
    /// put in its place is refused, never waited on.
    pub fn read(path: &Path) -> Option<Ack> {
        use std::io::Read;
        use std::os::unix::fs::OpenOptionsExt;
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .ok()?;
        if !file.metadata().ok()?.is_file() {
            return None;
        }
        let mut text = String::new();
        // An acknowledgement is a few lines: more is not one.
        (&mut file).take(64 << 10).read_to_string(&mut text).ok()?;
        Ack::parse(&text)
    }
}

/// Field 22 of `/proc/PID/stat` (start time in clock ticks); the command name before it
/// may hold spaces and parentheses, so fields are counted after the last `)`.
pub fn start_time(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // After ")": field 3 (state) is the first; field 22 is the 20th.
    rest.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_partial_text() {
        let ack = Ack {
            pid: 42,
            started: 987,
            received: 3,
            served: 2,
            last: Some(Outcome::Failed("no space\nleft".into())),
            requests: 0,
        };
        let back = Ack::parse(&ack.to_text()).unwrap();
        assert_eq!(back.last, Some(Outcome::Failed("no space left".into())));
        assert_eq!(
            (back.pid, back.started, back.received, back.served),
            (42, 987, 3, 2)
        );
        let written = Ack {
            last: Some(Outcome::Written("/x/a b.pickle".into())),
            requests: 7,
            ..ack
        };
        assert_eq!(Ack::parse(&written.to_text()).unwrap(), written);
        assert_eq!(Ack::parse("pid 42\nstarted 1\n"), None);
        assert_eq!(Ack::parse("pid x\nstarted 1\nreceived 1\nserved 1\n"), None);
    }

    #[test]
    fn a_fifo_or_a_folder_in_its_place_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("1.ack");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            // Would block forever in a plain open for reading.
            assert_eq!(Ack::read(&fifo), None);
        }
        assert_eq!(Ack::read(dir.path()), None);
        let good = dir.path().join("2.ack");
        std::fs::write(&good, "pid 2\nstarted 1\nreceived 1\nserved 0\n").unwrap();
        assert_eq!(Ack::read(&good).map(|a| a.pid), Some(2));
    }

    #[test]
    fn start_time_skips_a_command_name_with_spaces() {
        let stat = "77 (a) b) S 1 77 77 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 5555 1000 10";
        assert_eq!(start_time(stat), Some(5555));
        assert_eq!(start_time("garbage"), None);
    }
}

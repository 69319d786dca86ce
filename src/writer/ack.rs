//! The writer's side of the acknowledgement file (`memsnap_format::ack`): written when a
//! dump signal is first seen and again when its snapshot is done, removed at exit.
//!
//! Cold, writer thread only. Created on the first dump signal, in a folder only this user
//! can use (made 0700; refused when it is a link, someone else's, or open to others).
//! Failures are silent: `memsnap dump` then says the signal was not acknowledged. Removed at
//! exit, and by the signal handler before a signal's default action ends the process;
//! what a process killed outright leaves is removed by the next one that starts
//! ([`forget_dead_processes`]).

use crate::snapshot::ack::{self, Ack, Outcome};
use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::PathBuf;

pub struct AckFile {
    state: Ack,
    uid: u32,
    /// `None` until the first signal; `Some(None)` when the folder cannot be trusted.
    path: Option<Option<PathBuf>>,
}

impl AckFile {
    pub fn new(pid: u32) -> AckFile {
        let started = fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|s| ack::start_time(&s))
            .unwrap_or(0);
        AckFile {
            state: Ack {
                pid,
                started,
                ..Ack::default()
            },
            // SAFETY: getuid has no preconditions and cannot fail.
            uid: unsafe { libc::getuid() },
            path: None,
        }
    }

    /// The dump signals seen so far (`received` tickets); written only when that changed.
    pub fn received(&mut self, received: u64) {
        if received == self.state.received {
            return;
        }
        self.state.received = received;
        self.write();
    }

    /// Signals up to `served` are done, with this outcome, by a snapshot that served
    /// `requests` dump requests (signals and socket requests together).
    pub fn served(&mut self, served: u64, outcome: &Result<PathBuf, String>, requests: u64) {
        self.state.served = served;
        self.state.requests = requests;
        self.state.last = Some(match outcome {
            Ok(path) => Outcome::Written(fs::canonicalize(path).unwrap_or_else(|_| path.clone())),
            Err(reason) => Outcome::Failed(reason.clone()),
        });
        self.write();
    }

    pub fn remove(&mut self) {
        if let Some(Some(path)) = &self.path {
            let _ = fs::remove_file(path);
        }
    }

    fn write(&mut self) {
        let path = self.path.get_or_insert_with(|| {
            private_folder(self.uid).map(|_| ack::path(self.uid, self.state.pid))
        });
        let Some(path) = path else { return };
        let tmp = path.with_extension("ack.tmp");
        let written = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)
            .and_then(|mut f| f.write_all(self.state.to_text().as_bytes()));
        if written.is_ok() {
            let _ = fs::rename(&tmp, &*path);
        }
    }
}

/// When recording starts: removes the sockets and acknowledgement files (`PID.sock`,
/// `PID.ack`, `PID.ack.tmp`) that processes of this user which no longer exist left in the
/// private folder (killed outright, or ended by a handler of their own that exited).
pub fn forget_dead_processes(uid: u32) {
    let Some(dir) = private_folder(uid) else {
        return;
    };
    let Ok(entries) = fs::read_dir(&dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let Some((pid, kind)) = name.split_once('.') else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else {
            continue;
        };
        if matches!(kind, "sock" | "ack" | "ack.tmp") && !super::temporaries::process_exists(pid) {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// The per-user folder, made if missing; `None` unless it is a real directory of this
/// user that nobody else can write to.
pub(super) fn private_folder(uid: u32) -> Option<PathBuf> {
    let dir = ack::folder(uid);
    let _ = fs::DirBuilder::new().mode(0o700).create(&dir);
    let meta = fs::symlink_metadata(&dir).ok()?;
    (meta.is_dir() && meta.uid() == uid && meta.mode() & 0o077 == 0).then_some(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tells_received_then_served() {
        // A pid no process can have (above the kernel's largest pid_max, 2^22).
        let pid = u32::MAX - 7;
        let mut file = AckFile::new(pid);
        file.received(2);
        // SAFETY: getuid cannot fail.
        let path = ack::path(unsafe { libc::getuid() }, pid);
        let first = Ack::read(&path).expect("written on the first signal");
        assert_eq!(
            (first.received, first.served, first.last.clone()),
            (2, 0, None)
        );
        file.served(2, &Err("disk full".into()), 3);
        let second = Ack::read(&path).unwrap();
        assert_eq!(second.served, 2);
        assert_eq!(second.last, Some(Outcome::Failed("disk full".into())));
        assert_eq!(second.requests, 3);
        assert_eq!(fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        file.remove();
        assert!(!path.exists());
    }
}

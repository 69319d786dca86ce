//! `MEMSNAP_STATS`: one CSV row per device at every step, period and exit, appended to a
//! private file that is never reached through a symbolic link.
//!
//! Cold (writer thread). The file gets the care snapshot files get (`files.rs`): opened with
//! `O_NOFOLLOW`, created with mode 0600 whatever the umask, and refused unless it is a
//! regular file. Fields are written by RFC 4180: the rank (the one field taken from the
//! environment) is quoted when it holds a comma, a quote or a line break, so a row stays a
//! row. The program may close memsnap's descriptor: the file is then opened again by its
//! path (`own_fd`).

use super::files::{self, Identity, NameFields, Reason};
use super::own_fd::OwnFd;
use super::state::State;
use std::borrow::Cow;
use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

const HEADER: &str = "time_us,rank,step,reason,device,allocated_bytes,peak_bytes,reserved_bytes,total_bytes,utilization,events,ooms";

pub struct Stats {
    /// `None` once the file could not be used (one warning said so).
    file: Option<OwnFd<File>>,
    path: String,
    /// The rank as a CSV field, quoted where needed.
    rank_field: String,
}

impl Stats {
    /// Opens (or creates) the file `template` names for this process and writes the header
    /// into an empty one. A file that cannot be used is one warning; no stats then.
    pub fn new(template: &str, id: &Identity) -> Stats {
        // config.rs allows only per-process placeholders here; these fields are unused.
        let fields = NameFields {
            reason: Reason::Step,
            seq: 0,
            step: 0,
            tag: "",
            time_s: 0,
        };
        let path = files::expand(template, id, &fields);
        let file = match open_with_header(&path) {
            Ok(f) => Some(f),
            Err(e) => {
                eprintln!("memsnap: cannot use the MEMSNAP_STATS file {path}: {e}; no stats");
                None
            }
        };
        Stats {
            file,
            path,
            rank_field: csv_field(&id.rank).into_owned(),
        }
    }

    /// The file, if it can be written: still the one memsnap opened, or opened again by its
    /// path when the program closed memsnap's descriptor (`own_fd`).
    fn file(&mut self) -> Option<&File> {
        let own = self.file.as_mut()?;
        if own.ours().is_none() {
            match open_with_header(&self.path) {
                Ok(f) => self.file = Some(f),
                Err(e) => {
                    eprintln!(
                        "memsnap: cannot open the MEMSNAP_STATS file {} again: {e}; no more stats",
                        self.path
                    );
                    self.file = None;
                }
            }
        }
        self.file.as_ref()?.last_seen()
    }

    /// One row per device; `reason` says what produced it (`step`, `period`, `exit`).
    pub fn row(&mut self, step: u64, reason: Reason, state: &State) {
        if self.file.is_none() {
            return;
        }
        let rank = &self.rank_field;
        let now = crate::process::clock::wall_micros();
        let mut out = String::new();
        for (d, dev) in state.devices.iter().enumerate() {
            let total = crate::channel::handshake::device_total(d);
            // What the process holds from CUDA: allocations, plus VMM physical memory
            // whether mapped or not.
            let mapped: u64 = dev.mappings.values().map(|l| l.size).sum();
            let reserved =
                dev.live_bytes - mapped.min(dev.live_bytes) + dev.physical_bytes.max(mapped);
            let util = if total > 0 {
                reserved as f64 / total as f64
            } else {
                0.0
            };
            let _ = writeln!(
                out,
                "{now},{rank},{step},{},{d},{},{},{reserved},{total},{util:.4},{},{}",
                reason.as_str(),
                dev.live_bytes,
                dev.peak_bytes,
                dev.events,
                dev.ooms
            );
        }
        let written = self.file().map(|mut f| f.write_all(out.as_bytes()));
        if written.is_some_and(|w| w.is_err()) {
            eprintln!(
                "memsnap: cannot write MEMSNAP_STATS file {}; no more stats",
                self.path
            );
            self.file = None;
        }
    }
}

/// Opens `path` with [`open_private`], held as memsnap's own descriptor, and writes the
/// header into an empty file.
fn open_with_header(path: &str) -> io::Result<OwnFd<File>> {
    let mut file = open_private(Path::new(path))?;
    if file.metadata()?.len() == 0 {
        writeln!(file, "{HEADER}")?;
    }
    OwnFd::new(file).ok_or_else(|| io::Error::other("its descriptor cannot be looked at"))
}

/// Opens `path` for appending, creating it with mode 0600. Never follows a symbolic link in
/// the last component, never blocks on a FIFO, and refuses anything but a regular file, each
/// with a message saying what the path is.
fn open_private(path: &Path) -> io::Result<File> {
    // Its folder is created (with its parents, private) as a snapshot folder is:
    // `--folder snaps --stats snaps/mem.csv` before `snaps` exists.
    if let Some(parent) = path.parent()
        && !parent.as_os_str().is_empty()
        && !parent.is_dir()
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(parent)?;
    }
    let opened = OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        // O_NONBLOCK: opening a FIFO for writing would otherwise wait for a reader, and the
        // writer thread with it. It changes nothing for a regular file.
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path);
    let kind = |p: &Path| p.symlink_metadata().map(|m| m.file_type());
    let file = match opened {
        Ok(f) => f,
        Err(_) if kind(path).is_ok_and(|t| t.is_symlink()) => {
            return Err(io::Error::other(
                "it is a symbolic link, and memsnap does not follow links to the files it writes",
            ));
        }
        Err(_) if kind(path).is_ok_and(|t| !t.is_file()) => {
            return Err(io::Error::other("it is not a regular file"));
        }
        Err(e) => return Err(e),
    };
    if !file.metadata()?.is_file() {
        return Err(io::Error::other("it is not a regular file"));
    }
    Ok(file)
}

/// One CSV field by RFC 4180: in double quotes, inner quotes doubled, when it holds a comma,
/// a quote or a line break; as it is otherwise.
fn csv_field(s: &str) -> Cow<'_, str> {
    if s.contains([',', '"', '\n', '\r']) {
        Cow::Owned(format!("\"{}\"", s.replace('"', "\"\"")))
    } else {
        Cow::Borrowed(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::PermissionsExt;

    fn id(rank: &str) -> Identity {
        Identity {
            pid: 42,
            rank: rank.into(),
            local_rank: "0".into(),
            host: "node".into(),
            exe: "train".into(),
        }
    }

    #[test]
    fn fields_are_quoted_by_rfc_4180() {
        assert_eq!(csv_field("3"), "3");
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("say \"hi\""), "\"say \"\"hi\"\"\"");
        assert_eq!(csv_field("1\n2"), "\"1\n2\"");
        assert_eq!(csv_field("1\r2"), "\"1\r2\"");
    }

    #[test]
    fn a_symlink_is_not_followed_and_its_target_is_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        fs::write(&victim, b"keep").unwrap();
        let link = dir.path().join("stats.csv");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let mut stats = Stats::new(link.to_str().unwrap(), &id("0"));
        assert!(stats.file.is_none());
        stats.row(1, Reason::Step, &State::new(10));
        assert_eq!(fs::read(&victim).unwrap(), b"keep");
        let e = open_private(&link).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        // A dangling link is not created through either.
        let dangling = dir.path().join("dangling.csv");
        std::os::unix::fs::symlink(dir.path().join("made"), &dangling).unwrap();
        assert!(open_private(&dangling).is_err());
        assert!(!dir.path().join("made").exists());
    }

    #[test]
    fn the_file_is_private_and_regular() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stats.csv");
        Stats::new(path.to_str().unwrap(), &id("0"));
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(fs::read_to_string(&path).unwrap(), format!("{HEADER}\n"));
        let e = open_private(dir.path()).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }
}

//! Snapshot file names and atomic, private, never-clobbering writes.
//!
//! Cold (writer thread). Names come from `MEMSNAP_FOLDER` + `MEMSNAP_FILENAME` templates;
//! the default never collides across ranks, hosts, processes or repeated dumps. A file is
//! written to an anonymous temporary in its folder (`O_TMPFILE`, mode 0600: it has no name,
//! so nobody can pre-create or block it, and a process killed mid-write leaves nothing),
//! then published with `linkat` (fails if the name exists: nothing is ever overwritten), or
//! linked to an unpredictable hidden name and renamed over the target when
//! `MEMSNAP_OVERWRITE=1`. Where the filesystem has no `O_TMPFILE` the temporary is a hidden
//! file with an unpredictable name of memsnap's own (`temporaries`), created with
//! `O_CREAT|O_EXCL|O_NOFOLLOW`. Readers never see a partial file. Every file is made
//! relative to the folder's descriptor (`folder`), never through its path again.

use super::folder::Dir;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// Why a snapshot was written: `{reason}` in file names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    Exit,
    Oom,
    Signal,
    Step,
    Period,
    Api,
    /// SIGTERM: the job is being stopped.
    Term,
    /// SIGABRT, SIGSEGV or SIGBUS: the job is crashing.
    Crash,
    /// The program calls `execve` (or another of the exec family memsnap hooks): the
    /// record of the image about to be replaced, which has no exit of its own.
    Exec,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Exit => "exit",
            Reason::Oom => "oom",
            Reason::Signal => "signal",
            Reason::Step => "step",
            Reason::Period => "period",
            Reason::Api => "api",
            Reason::Term => "term",
            Reason::Crash => "crash",
            Reason::Exec => "exec",
        }
    }
}

/// Who this process is, for file names and metadata. Read once when recording starts.
#[derive(Clone, Debug)]
pub struct Identity {
    pub pid: u32,
    pub rank: String,
    pub local_rank: String,
    pub host: String,
    pub exe: String,
}

impl Identity {
    pub fn current() -> Identity {
        let pid = std::process::id();
        let (rank, local_rank) = crate::config::ranks(|k| std::env::var(k).ok(), pid);
        Identity {
            pid,
            rank,
            local_rank,
            host: crate::config::hostname(),
            exe: program_name(),
        }
    }
}

/// The program's name; for an interpreter (`python3 train.py`, `python -m pkg.mod`) the
/// script or module, which is what users recognise.
fn program_name() -> String {
    let args: Vec<String> = fs::read("/proc/self/cmdline")
        .map(|b| {
            b.split(|&c| c == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect()
        })
        .unwrap_or_default();
    program_name_of(&args)
}

/// [`program_name`] for a command line.
fn program_name_of(args: &[String]) -> String {
    let exe = args
        .first()
        .and_then(|a| file_name(a))
        .unwrap_or_else(|| "process".to_string());
    if exe.starts_with("python") {
        match python_runs(args.get(1..).unwrap_or_default()) {
            Some(PythonRuns::Script(path)) => {
                let script = file_name(path).unwrap_or_default();
                return sanitize(script.strip_suffix(".py").unwrap_or(&script));
            }
            Some(PythonRuns::Module(module)) => return sanitize(module),
            None => {}
        }
    }
    sanitize(&exe)
}

fn file_name(path: &str) -> Option<String> {
    Path::new(path)
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
}

enum PythonRuns<'a> {
    Script(&'a str),
    Module(&'a str),
}

/// What a Python command line runs; `None` for `-c`, standard input or no argument. Options
/// are skipped as CPython reads them: single-letter flags may be combined (`-uOO`, `-bbI`),
/// and `-c`, `-m`, `-W` and `-X` take the rest of their word or else the next one
/// (`-Wignore`, `-X faulthandler`), as does `--check-hash-based-pycs`; after `--` the next
/// word is the script.
fn python_runs(args: &[String]) -> Option<PythonRuns<'_>> {
    let mut words = args.iter().map(String::as_str);
    while let Some(word) = words.next() {
        let Some(letters) = word.strip_prefix('-') else {
            return Some(PythonRuns::Script(word));
        };
        match letters {
            // The script from standard input.
            "" => return None,
            "-" => return words.next().filter(|w| *w != "-").map(PythonRuns::Script),
            "-check-hash-based-pycs" => {
                words.next();
                continue;
            }
            // Other long options (`--help`, `--version`) take no value.
            _ if letters.starts_with('-') => continue,
            _ => {}
        }
        for (at, letter) in letters.char_indices() {
            if !matches!(letter, 'c' | 'm' | 'W' | 'X') {
                continue;
            }
            let rest = &letters[at + 1..];
            let value = if rest.is_empty() {
                words.next()
            } else {
                Some(rest)
            };
            match letter {
                'm' => return value.map(PythonRuns::Module),
                'c' => return None,
                _ => break,
            }
        }
    }
    None
}

pub use crate::config::sanitize;

/// Values for one file name.
pub struct NameFields<'a> {
    pub reason: Reason,
    pub seq: u64,
    pub step: u64,
    pub tag: &'a str,
    pub time_s: u64,
}

impl NameFields<'_> {
    /// `{label}`: what a person calls this snapshot. The tag of a tagged dump, `step<N>`
    /// for a step snapshot (N the program's step number, not the dump counter), else the
    /// reason.
    fn label(&self) -> String {
        if !self.tag.is_empty() {
            sanitize(self.tag)
        } else if self.reason == Reason::Step {
            format!("step{}", self.step)
        } else {
            self.reason.as_str().to_string()
        }
    }
}

/// Expands a template (`{rank}`, `{pid}`, ...; config.rs validated the keys).
pub fn expand(template: &str, id: &Identity, f: &NameFields) -> String {
    let value = |key: &str| {
        Some(match key {
            "rank" => sanitize(&id.rank),
            "local_rank" => sanitize(&id.local_rank),
            "pid" => id.pid.to_string(),
            "host" => sanitize(&id.host),
            "exe" => id.exe.clone(),
            "reason" => f.reason.as_str().to_string(),
            "seq" => f.seq.to_string(),
            "step" => f.step.to_string(),
            "tag" => sanitize(if f.tag.is_empty() {
                f.reason.as_str()
            } else {
                f.tag
            }),
            "label" => f.label(),
            "time" => f.time_s.to_string(),
            other => format!("{{{other}}}"),
        })
    };
    crate::config::expand_template(template, value).unwrap_or_else(|key| format!("{{{key}}}"))
}

/// The folder for snapshots, `template` expanded (`MEMSNAP_FOLDER`), created private if
/// missing.
pub fn folder(template: &str, id: &Identity, f: &NameFields) -> io::Result<Folder> {
    let path = PathBuf::from(expand(template, id, f));
    let mut created = false;
    if !path.is_dir() {
        if let Some(why) = not_a_directory(&path) {
            return Err(io::Error::new(io::ErrorKind::NotADirectory, why));
        }
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&path)?;
        created = true;
    }
    Ok(Folder { path, created })
}

/// The folder a snapshot goes to, and whether memsnap had to create it (with its parents,
/// as Composer does): the exit line says so, so that a mistyped folder is seen at once.
pub struct Folder {
    pub path: PathBuf,
    pub created: bool,
}

/// What stops `dir` from being a folder: the deepest path at or above it that exists and is
/// not a directory (a file, or a symbolic link to a file or to nothing), described.
/// Creating the folder would otherwise fail with a bare "File exists".
fn not_a_directory(dir: &Path) -> Option<String> {
    let existing = dir
        .ancestors()
        .filter(|p| !p.as_os_str().is_empty())
        .find(|p| p.symlink_metadata().is_ok())?;
    if existing.is_dir() {
        return None;
    }
    let is_link = existing
        .symlink_metadata()
        .is_ok_and(|m| m.file_type().is_symlink());
    let what = match (is_link, existing.metadata().is_ok()) {
        (true, true) => "a symbolic link to a file",
        (true, false) => "a dangling symbolic link",
        (false, _) => "a file",
    };
    Some(format!(
        "{} is {what}; memsnap needs a directory there",
        existing.display()
    ))
}

/// Writes `bytes` to `name` in `dir` atomically. Without `overwrite`, an existing file is
/// kept and the new one gets a `-N` suffix before its extension. Returns the final path.
pub fn write_atomic(dir: &Dir, name: &str, bytes: &[u8], overwrite: bool) -> io::Result<PathBuf> {
    if let Some(published) = write_anonymous(dir, name, bytes, overwrite) {
        return published;
    }
    write_named(dir, name, bytes, overwrite)
}

/// Through an `O_TMPFILE` temporary; `None` when the folder's filesystem (or a missing
/// `/proc`) does not allow it, so that a named temporary is used instead.
fn write_anonymous(
    dir: &Dir,
    name: &str,
    bytes: &[u8],
    overwrite: bool,
) -> Option<io::Result<PathBuf>> {
    let mut file = match dir.anonymous_file()? {
        Ok(file) => file,
        Err(e) => return Some(Err(e)),
    };
    if let Err(e) = written(&mut file, bytes) {
        return Some(Err(e));
    }
    if overwrite {
        // A name is needed to rename over the target: an unpredictable one, linked only
        // once the bytes are all there.
        let tmp = loop {
            let tmp = dir.temporary_name();
            match dir.link_open_file(&file, &tmp) {
                Ok(()) => break tmp,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) && !proc_fd_usable() => {
                    return None;
                }
                Err(e) => return Some(Err(e)),
            }
        };
        let renamed = dir.rename(&tmp, name);
        if renamed.is_err() {
            let _ = dir.remove(&tmp);
        }
        return Some(renamed.map(|()| dir.path(name)));
    }
    let mut candidates = numbered(name);
    loop {
        let Some(candidate) = candidates.next() else {
            return Some(Err(all_taken(dir, name)));
        };
        match dir.link_open_file(&file, &candidate) {
            Ok(()) => return Some(Ok(dir.path(&candidate))),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            // No /proc to link through: a named temporary will do.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) && !proc_fd_usable() => return None,
            Err(e) => return Some(Err(e)),
        }
    }
}

fn proc_fd_usable() -> bool {
    Path::new("/proc/self/fd").is_dir()
}

/// Writes the snapshot's bytes and stamps the file with the precise time: the kernel's own
/// modification times are coarse (milliseconds), and readers (`memsnap run`'s list of new
/// snapshots) order a run's files by them.
fn written(file: &mut fs::File, bytes: &[u8]) -> io::Result<()> {
    file.write_all(bytes)?;
    file.flush()?;
    file.set_modified(std::time::SystemTime::now())
}

/// Through a hidden temporary with an unpredictable name, created exclusively.
fn write_named(dir: &Dir, name: &str, bytes: &[u8], overwrite: bool) -> io::Result<PathBuf> {
    let mut tries = 0;
    let (tmp, mut file) = loop {
        let tmp = dir.temporary_name();
        match dir.create_new(&tmp) {
            Ok(file) => break (tmp, file),
            // Someone else's file under that name: another name, never theirs.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && tries < 16 => tries += 1,
            Err(e) => return Err(e),
        }
    };
    let result = written(&mut file, bytes);
    drop(file);
    if let Err(e) = result {
        let _ = dir.remove(&tmp);
        return Err(e);
    }
    let result = publish(dir, &tmp, name, overwrite);
    let _ = dir.remove(&tmp);
    result
}

/// `name`, then `stem-1.ext`, `stem-2.ext`, ... up to 9999.
fn numbered(name: &str) -> impl Iterator<Item = String> + '_ {
    let (stem, ext) = match name.rfind('.') {
        Some(i) if i > 0 => (&name[..i], &name[i..]),
        _ => (name, ""),
    };
    (0..10_000u32).map(move |n| {
        if n == 0 {
            name.to_string()
        } else {
            format!("{stem}-{n}{ext}")
        }
    })
}

fn all_taken(dir: &Dir, name: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::AlreadyExists,
        format!(
            "{} and 9999 numbered variants exist",
            dir.path(name).display()
        ),
    )
}

fn publish(dir: &Dir, tmp: &str, name: &str, overwrite: bool) -> io::Result<PathBuf> {
    if overwrite {
        dir.rename(tmp, name)?;
        return Ok(dir.path(name));
    }
    for candidate in numbered(name) {
        match dir.hard_link(tmp, &candidate) {
            Ok(()) => return Ok(dir.path(&candidate)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(_) => {
                // Filesystems without hard links: check-then-rename (tiny race window).
                if dir.exists(&candidate) {
                    continue;
                }
                dir.rename(tmp, &candidate)?;
                return Ok(dir.path(&candidate));
            }
        }
    }
    Err(all_taken(dir, name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::writer::folder::Folders;

    fn write(dir: &Path, name: &str, bytes: &[u8], overwrite: bool) -> io::Result<PathBuf> {
        write_atomic(&Folders::new().open(dir)?, name, bytes, overwrite)
    }

    fn id() -> Identity {
        Identity {
            pid: 42,
            rank: "3".into(),
            local_rank: "1".into(),
            host: "node/7".into(),
            exe: "train".into(),
        }
    }

    #[test]
    fn the_program_is_the_script_or_module_after_pythons_options() {
        let name = |line: &str| {
            let args: Vec<String> = line.split(' ').map(String::from).collect();
            program_name_of(&args)
        };
        assert_eq!(name("python3 -X faulthandler train.py"), "train");
        assert_eq!(name("python3 -Xfaulthandler train.py"), "train");
        assert_eq!(name("python -W ignore -u /jobs/train.py --lr 3"), "train");
        assert_eq!(
            name("python -Wignore::DeprecationWarning train.py"),
            "train"
        );
        assert_eq!(name("python3 -OO -I -bb -uB train.py"), "train");
        assert_eq!(name("python3 -uX dev train.py"), "train");
        assert_eq!(
            name("python3 --check-hash-based-pycs never train.py"),
            "train"
        );
        assert_eq!(
            name("python3 -X importtime -m torch.distributed.run x.py"),
            "torch.distributed.run"
        );
        assert_eq!(name("python3 -um pkg.mod"), "pkg.mod");
        assert_eq!(name("python3 -mpkg.mod"), "pkg.mod");
        assert_eq!(name("python3 -u -c print(1) train.py"), "python3");
        assert_eq!(name("python3 -uc print(1)"), "python3");
        assert_eq!(name("python3 -- -weird.py"), "-weird");
        assert_eq!(name("python3.12 - train.py"), "python3.12");
        assert_eq!(name("python3 -X"), "python3");
        assert_eq!(name("/usr/bin/torchrun -X train.py"), "torchrun");
        assert_eq!(program_name_of(&[]), "process");
    }

    #[test]
    fn expands_every_placeholder() {
        let f = NameFields {
            reason: Reason::Oom,
            seq: 5,
            step: 12,
            tag: "before opt",
            time_s: 99,
        };
        let s = expand(
            "{exe}-{host}-r{rank}-l{local_rank}-p{pid}-{reason}-{seq}-{step}-{tag}-{time}.pickle",
            &id(),
            &f,
        );
        assert_eq!(s, "train-node_7-r3-l1-p42-oom-5-12-before_opt-99.pickle");
    }

    #[test]
    fn the_default_name_says_the_tag_or_the_real_step() {
        let name = |reason, step, tag| {
            let f = NameFields {
                reason,
                seq: 7,
                step,
                tag,
                time_s: 0,
            };
            expand(crate::config::DEFAULT_FILENAME, &id(), &f)
        };
        assert_eq!(
            name(Reason::Step, 12, ""),
            "memsnap-train-node_7-r3-p42-step12-7.pickle"
        );
        assert_eq!(
            name(Reason::Api, 12, "before opt"),
            "memsnap-train-node_7-r3-p42-before_opt-7.pickle"
        );
        assert_eq!(
            name(Reason::Api, 12, ""),
            "memsnap-train-node_7-r3-p42-api-7.pickle"
        );
        assert_eq!(
            name(Reason::Oom, 3, ""),
            "memsnap-train-node_7-r3-p42-oom-7.pickle"
        );
    }

    #[test]
    fn placeholder_values_cannot_climb_out_of_the_folder() {
        let f = NameFields {
            reason: Reason::Api,
            seq: 1,
            step: 0,
            tag: "..",
            time_s: 0,
        };
        let mut who = id();
        who.rank = "..".into();
        who.local_rank = ".".into();
        assert_eq!(
            expand("snaps/{rank}/{local_rank}/.{tag}", &who, &f),
            "snaps/_./_/._."
        );
    }

    fn folder_in(template: &str) -> io::Result<PathBuf> {
        let f = NameFields {
            reason: Reason::Exit,
            seq: 1,
            step: 0,
            tag: "",
            time_s: 0,
        };
        folder(template, &id(), &f).map(|f| f.path)
    }

    #[test]
    fn a_folder_that_is_not_a_directory_is_named_in_the_error() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("file");
        fs::write(&file, b"x").unwrap();
        let to_file = dir.path().join("to-file");
        std::os::unix::fs::symlink(&file, &to_file).unwrap();
        let dangling = dir.path().join("dangling");
        std::os::unix::fs::symlink(dir.path().join("gone"), &dangling).unwrap();
        for (path, below, what) in [
            (&to_file, "", "a symbolic link to a file"),
            (&dangling, "", "a dangling symbolic link"),
            (&file, "", "a file"),
            (&dangling, "/r{rank}", "a dangling symbolic link"),
        ] {
            let template = format!("{}{below}", path.display());
            let e = folder_in(&template).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::NotADirectory, "{template}");
            assert_eq!(
                e.to_string(),
                format!(
                    "{} is {what}; memsnap needs a directory there",
                    path.display()
                )
            );
        }
        // A link to a directory is a folder like any other.
        let to_dir = dir.path().join("to-dir");
        std::os::unix::fs::symlink(dir.path(), &to_dir).unwrap();
        let made = folder_in(&format!("{}/r{{rank}}", to_dir.display())).unwrap();
        assert!(made.is_dir());
        assert!(dir.path().join("r3").is_dir());
    }

    #[test]
    fn never_overwrites_unless_asked() {
        let dir = tempfile::tempdir().unwrap();
        let a = write(dir.path(), "snap.pickle", b"one", false).unwrap();
        let b = write(dir.path(), "snap.pickle", b"two", false).unwrap();
        assert_eq!(a, dir.path().join("snap.pickle"));
        assert_eq!(b, dir.path().join("snap-1.pickle"));
        assert_eq!(fs::read(&a).unwrap(), b"one");
        assert_eq!(fs::read(&b).unwrap(), b"two");
        let c = write(dir.path(), "snap.pickle", b"three", true).unwrap();
        assert_eq!(c, a);
        assert_eq!(fs::read(&a).unwrap(), b"three");
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "no temporaries left: {names:?}");
    }

    #[test]
    fn a_named_temporary_publishes_and_leaves_nothing_behind() {
        // What a filesystem without `O_TMPFILE` gets.
        let dir = tempfile::tempdir().unwrap();
        let mut folders = Folders::new();
        let held = folders.open(dir.path()).unwrap();
        let a = write_named(&held, "snap.pickle", b"one", false).unwrap();
        let b = write_named(&held, "snap.pickle", b"two", false).unwrap();
        let c = write_named(&held, "snap.pickle", b"three", true).unwrap();
        assert_eq!(a, dir.path().join("snap.pickle"));
        assert_eq!(b, dir.path().join("snap-1.pickle"));
        assert_eq!(c, a);
        assert_eq!(fs::read(&a).unwrap(), b"three");
        assert_eq!(fs::read(&b).unwrap(), b"two");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 2);
    }

    #[test]
    fn files_are_private_and_symlinks_are_not_followed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        fs::write(&victim, b"keep").unwrap();
        std::os::unix::fs::symlink(&victim, dir.path().join("snap.pickle")).unwrap();
        let p = write(dir.path(), "snap.pickle", b"data", false).unwrap();
        assert_eq!(p, dir.path().join("snap-1.pickle"));
        assert_eq!(fs::read(&victim).unwrap(), b"keep");
        assert_eq!(
            fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }
}

//! Snapshot folders held by descriptor, so that a path swapped mid-run cannot redirect files.
//!
//! Cold (writer thread). The first write into a folder opens it (`O_PATH|O_DIRECTORY`,
//! through a symbolic link only if the user's path was one from the start) and keeps the
//! descriptor; every file is then created, linked, renamed and removed relative
//! to it (`openat`, `linkat`, `renameat`, `unlinkat`). If the path is later moved away and
//! replaced (by a symbolic link to somewhere else, say), snapshots go on into the folder
//! memsnap opened, one warning says where that folder now is, and files are reported there.
//! The descriptor is memsnap's, but the program may close it (`close_range`) and reuse the
//! number: before each use it must still be an `O_PATH` descriptor of the same folder
//! (device and inode), else the number is forgotten without being closed and the folder is
//! opened again by path. Opened again, a folder whose last component has become a symbolic
//! link is used only if the link leads to the folder held before. A folder that another user
//! owns or that its group or others can write is used, with one warning per process.

use super::temporaries::{self, Maker};
use std::ffi::{CString, OsStr};
use std::fs::{self, File};
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Folders held at once; beyond that (a `MEMSNAP_FOLDER` template with `{seq}`, say) the
/// least recently used one is let go.
const MAX_HELD: usize = 4;

/// The folders this process writes into.
pub struct Folders {
    held: Vec<Held>,
    maker: Maker,
    warned_others_control: bool,
}

/// A folder opened once, and what it was.
struct Held {
    path: PathBuf,
    /// `None` once the descriptor was found closed or reused by the program.
    fd: Option<RawFd>,
    id: FolderId,
    /// The path no longer leads to the folder and a warning said so.
    moved: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct FolderId {
    dev: u64,
    ino: u64,
}

/// One held folder, ready to write into: files go to it by descriptor, and are reported
/// under `shown` (the configured path, or where the folder really is once it was moved).
pub struct Dir<'a> {
    fd: RawFd,
    shown: PathBuf,
    maker: &'a Maker,
}

impl Default for Folders {
    fn default() -> Self {
        Folders::new()
    }
}

impl Folders {
    pub fn new() -> Folders {
        Folders {
            held: Vec::new(),
            maker: Maker::current(),
            warned_others_control: false,
        }
    }

    /// The folder at `path` (an existing directory), held from the first call on.
    pub fn open(&mut self, path: &Path) -> io::Result<Dir<'_>> {
        let shown = path;
        // Held by absolute path: a relative folder follows the working directory as it
        // always did, and a program's `chdir` is not a moved folder.
        let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        let path = absolute.as_path();
        let at = match self.held.iter().position(|h| h.path == path) {
            Some(at) => at,
            None => {
                if self.held.len() == MAX_HELD {
                    let oldest = self.held.remove(0);
                    oldest.let_go();
                }
                let fd = open_dir(path, true)?;
                let id = self.adopt(path, fd)?;
                self.held.push(Held {
                    path: path.to_path_buf(),
                    fd: Some(fd),
                    id,
                    moved: false,
                });
                self.held.len() - 1
            }
        };
        // Most recently used last.
        let mut held = self.held.remove(at);
        let ready = self.ready(&mut held);
        self.held.push(held);
        let held = self.held.last().expect("just pushed");
        let fd = ready?;
        let shown = if held.moved {
            fs::read_link(format!("/proc/self/fd/{fd}")).unwrap_or_else(|_| held.path.clone())
        } else {
            shown.to_path_buf()
        };
        Ok(Dir {
            fd,
            shown,
            maker: &self.maker,
        })
    }

    /// The held folder's descriptor, checked; opened again by path if the program took it
    /// or the folder was removed.
    fn ready(&mut self, held: &mut Held) -> io::Result<RawFd> {
        if let Some(fd) = held.fd {
            match fd_identity(fd) {
                Some((id, true)) if id == held.id => {
                    let leads_here =
                        fs::metadata(&held.path).is_ok_and(|m| identity(&m) == held.id);
                    if !leads_here && !held.moved {
                        held.moved = true;
                        let now = fs::read_link(format!("/proc/self/fd/{fd}")).map_or_else(
                            |_| "where it was moved".into(),
                            |p| p.display().to_string(),
                        );
                        eprintln!(
                            "memsnap: {} is no longer the snapshot folder memsnap opened (moved, or replaced by a link); snapshots go on into that folder, now {now}",
                            held.path.display()
                        );
                    } else if leads_here {
                        held.moved = false;
                    }
                    return Ok(fd);
                }
                // Removed: the descriptor is still memsnap's to close.
                Some((id, _)) if id == held.id => close(fd),
                // Closed or reused by the program: not memsnap's any more.
                _ => {}
            }
            held.fd = None;
        }
        let fd = match open_dir(&held.path, false) {
            Ok(fd) => fd,
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTDIR | libc::ELOOP)) => {
                // The last component is a link now: only to the folder held before.
                let fd = open_dir(&held.path, true)?;
                if fd_identity(fd).map(|(id, _)| id) != Some(held.id) {
                    close(fd);
                    return Err(io::Error::other(format!(
                        "{} was replaced by a symbolic link to another folder since memsnap opened it; memsnap does not follow it",
                        held.path.display()
                    )));
                }
                fd
            }
            Err(e) => return Err(e),
        };
        let id = self.adopt(&held.path, fd)?;
        held.fd = Some(fd);
        held.id = id;
        held.moved = false;
        Ok(fd)
    }

    /// A folder just opened: its identity, a warning if others control it (once), and its
    /// stale temporaries removed.
    fn adopt(&mut self, path: &Path, fd: RawFd) -> io::Result<FolderId> {
        let Some(stat) = super::own_fd::stat_of(fd) else {
            let e = io::Error::last_os_error();
            close(fd);
            return Err(e);
        };
        if !self.warned_others_control {
            // SAFETY: geteuid has no preconditions and cannot fail.
            let me = unsafe { libc::geteuid() };
            if let Some(why) = others_control(stat.st_uid, stat.st_mode, me) {
                self.warned_others_control = true;
                eprintln!(
                    "memsnap: the snapshot folder {} {why}: others can remove or replace snapshots there (memsnap still writes each one privately, never over an existing file; MEMSNAP_FOLDER picks another folder)",
                    path.display()
                );
            }
        }
        let dir = Dir {
            fd,
            shown: path.to_path_buf(),
            maker: &self.maker,
        };
        dir.forget_stale_temporaries();
        Ok(FolderId {
            dev: stat.st_dev,
            ino: stat.st_ino,
        })
    }
}

impl Drop for Folders {
    fn drop(&mut self) {
        for held in self.held.drain(..) {
            held.let_go();
        }
    }
}

impl Held {
    /// Closes the descriptor if it is still memsnap's; forgets it otherwise.
    fn let_go(self) {
        if let Some(fd) = self.fd
            && fd_identity(fd).is_some_and(|(id, _)| id == self.id)
        {
            close(fd);
        }
    }
}

/// Why a folder with this owner and mode is not this user's alone; `None` when it is.
fn others_control(owner: u32, mode: u32, me: u32) -> Option<String> {
    let mut why = Vec::new();
    if owner != me {
        why.push(format!("belongs to user {owner}"));
    }
    match (mode & 0o020 != 0, mode & 0o002 != 0) {
        (true, true) => why.push("can be written by its group and by everyone".into()),
        (true, false) => why.push("can be written by its group".into()),
        (false, true) => why.push("can be written by everyone".into()),
        (false, false) => {}
    }
    (!why.is_empty()).then(|| why.join(" and "))
}

impl Dir<'_> {
    /// A new temporary's name (see `temporaries`): this process's, and unpredictable.
    pub fn temporary_name(&self) -> String {
        self.maker
            .name(std::process::id(), temporaries::random_u64())
    }

    /// Where `name` in this folder is reported to be.
    pub fn path(&self, name: &str) -> PathBuf {
        self.shown.join(name)
    }

    /// An anonymous temporary (`O_TMPFILE`, mode 0600) in this folder; `None` when its
    /// filesystem has none.
    pub fn anonymous_file(&self) -> Option<io::Result<File>> {
        match self.open_at(".", libc::O_TMPFILE | libc::O_WRONLY) {
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EOPNOTSUPP | libc::EISDIR | libc::EINVAL)
                ) =>
            {
                None
            }
            other => Some(other),
        }
    }

    /// A new file `name` (mode 0600); fails with `AlreadyExists` if the name is taken, and
    /// never follows a link.
    pub fn create_new(&self, name: &str) -> io::Result<File> {
        self.open_at(
            name,
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
        )
    }

    fn open_at(&self, name: &str, flags: i32) -> io::Result<File> {
        let name = c_name(name)?;
        // SAFETY: a NUL-terminated name that lives across the call.
        let fd = unsafe { libc::openat(self.fd, name.as_ptr(), flags | libc::O_CLOEXEC, 0o600) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: openat just returned this descriptor, and nothing else holds it.
        Ok(unsafe { File::from_raw_fd(fd) })
    }

    /// Gives the open anonymous `file` the name `name` (`linkat` through `/proc/self/fd`,
    /// which needs no privilege, unlike `AT_EMPTY_PATH`). `AlreadyExists` if it is taken.
    pub fn link_open_file(&self, file: &File, name: &str) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let from = CString::new(format!("/proc/self/fd/{}", file.as_raw_fd()))?;
        let to = c_name(name)?;
        // SAFETY: two NUL-terminated paths that live across the call.
        let rc = unsafe {
            libc::linkat(
                libc::AT_FDCWD,
                from.as_ptr(),
                self.fd,
                to.as_ptr(),
                libc::AT_SYMLINK_FOLLOW,
            )
        };
        result(rc)
    }

    /// A second name `to` for `from`; `AlreadyExists` if `to` is taken.
    pub fn hard_link(&self, from: &str, to: &str) -> io::Result<()> {
        let (from, to) = (c_name(from)?, c_name(to)?);
        // SAFETY: two NUL-terminated names that live across the call.
        result(unsafe { libc::linkat(self.fd, from.as_ptr(), self.fd, to.as_ptr(), 0) })
    }

    pub fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let (from, to) = (c_name(from)?, c_name(to)?);
        // SAFETY: two NUL-terminated names that live across the call.
        result(unsafe { libc::renameat(self.fd, from.as_ptr(), self.fd, to.as_ptr()) })
    }

    pub fn remove(&self, name: &str) -> io::Result<()> {
        let name = c_name(name)?;
        // SAFETY: a NUL-terminated name that lives across the call.
        result(unsafe { libc::unlinkat(self.fd, name.as_ptr(), 0) })
    }

    /// `name`'s own status (a link's, not its target's).
    fn stat(&self, name: &str) -> Option<libc::stat> {
        let name = c_name(name).ok()?;
        let mut stat = MaybeUninit::<libc::stat>::uninit();
        // SAFETY: a NUL-terminated name and a stat buffer, both live across the call.
        let rc = unsafe {
            libc::fstatat(
                self.fd,
                name.as_ptr(),
                stat.as_mut_ptr(),
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        // SAFETY: fstatat filled the buffer when it returned 0.
        (rc == 0).then(|| unsafe { stat.assume_init() })
    }

    /// Whether anything (a link included) is named `name`.
    pub fn exists(&self, name: &str) -> bool {
        self.stat(name).is_some()
    }

    /// Removes the temporaries that processes of this host, boot and user which no longer
    /// exist left here (killed while they wrote); nothing else (see `temporaries`).
    fn forget_stale_temporaries(&self) {
        // The listing goes through a descriptor of its own: reading the held one would
        // move a position the program could share if it ever took the number.
        let Ok(entries) = fs::read_dir(format!("/proc/self/fd/{}", self.fd)) else {
            return;
        };
        let names: Vec<String> = entries
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .collect();
        // SAFETY: geteuid has no preconditions and cannot fail.
        let me = unsafe { libc::geteuid() };
        for name in temporaries::stale(self.maker, names.iter().map(String::as_str)) {
            let ours = self
                .stat(name)
                .is_some_and(|s| s.st_mode & libc::S_IFMT == libc::S_IFREG && s.st_uid == me);
            if ours {
                let _ = self.remove(name);
            }
        }
    }
}

/// Opens a folder to hold (`O_PATH`: a descriptor that can only name, not read or write);
/// through a symbolic link as its last component only when `follow`.
fn open_dir(path: &Path, follow: bool) -> io::Result<RawFd> {
    let c_path = CString::new(path.as_os_str().as_bytes())?;
    let nofollow = if follow { 0 } else { libc::O_NOFOLLOW };
    let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC | nofollow;
    // SAFETY: a NUL-terminated path that lives across the call.
    let fd = unsafe { libc::open(c_path.as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// The folder `fd` holds and whether it still exists (has a link), if `fd` is still an `O_PATH` descriptor of a
/// directory (what memsnap opened: a program's own descriptors are hardly ever that).
fn fd_identity(fd: RawFd) -> Option<(FolderId, bool)> {
    // SAFETY: F_GETFL only reads the descriptor's flags; a closed number makes it fail.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 || flags & libc::O_PATH == 0 {
        return None;
    }
    let stat = super::own_fd::stat_of(fd)?;
    (stat.st_mode & libc::S_IFMT == libc::S_IFDIR).then_some((
        FolderId {
            dev: stat.st_dev,
            ino: stat.st_ino,
        },
        stat.st_nlink > 0,
    ))
}

fn identity(meta: &fs::Metadata) -> FolderId {
    use std::os::unix::fs::MetadataExt;
    FolderId {
        dev: meta.dev(),
        ino: meta.ino(),
    }
}

fn close(fd: RawFd) {
    // SAFETY: called only on a descriptor memsnap opened and has just checked is still
    // the folder it opened.
    unsafe { libc::close(fd) };
}

/// A file name for the `*at` calls: one component, never a path.
fn c_name(name: &str) -> io::Result<CString> {
    if name.is_empty() || name.contains('/') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} is not a file name"),
        ));
    }
    Ok(CString::new(OsStr::new(name).as_bytes())?)
}

fn result(rc: i32) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn says_who_else_controls_a_folder() {
        assert_eq!(others_control(1000, 0o40700, 1000), None);
        assert_eq!(others_control(1000, 0o40755, 1000), None);
        assert_eq!(
            others_control(0, 0o41777, 1000).as_deref(),
            Some("belongs to user 0 and can be written by its group and by everyone")
        );
        assert_eq!(
            others_control(1000, 0o40707, 1000).as_deref(),
            Some("can be written by everyone")
        );
        assert_eq!(
            others_control(1000, 0o40775, 1000).as_deref(),
            Some("can be written by its group")
        );
    }

    use crate::writer::files::write_atomic;
    use crate::writer::temporaries::process_exists;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::symlink;

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_folder_swapped_for_a_link_mid_run_keeps_the_snapshots() {
        let (top, snaps, mut folders) = held_snaps();
        let elsewhere = top.path().join("elsewhere");
        let moved = top.path().join("moved");
        fs::create_dir(&elsewhere).unwrap();
        fs::rename(&snaps, &moved).unwrap();
        symlink(&elsewhere, &snaps).unwrap();
        let second = write_atomic(&folders.open(&snaps).unwrap(), "b.pickle", b"2", false).unwrap();
        // Written into the folder memsnap opened, and reported where that folder now is.
        assert_eq!(second, moved.join("b.pickle"));
        assert_eq!(fs::read(&second).unwrap(), b"2");
        assert_eq!(names(&moved), ["a.pickle", "b.pickle"]);
        assert!(names(&elsewhere).is_empty());
        // The program closes memsnap's descriptor: the path is opened again, and a link to
        // another folder is not followed.
        let fd = folders.held[0].fd.unwrap();
        // SAFETY: the test plays the program closing every descriptor it did not open.
        unsafe { libc::close(fd) };
        let refused = folders
            .open(&snaps)
            .err()
            .expect("a swapped link is refused");
        assert!(
            refused.to_string().contains("replaced by a symbolic link"),
            "{refused}"
        );
        assert!(names(&elsewhere).is_empty());
        assert_eq!(names(&moved), ["a.pickle", "b.pickle"]);
    }

    /// A folder `snaps` in a new temporary folder, held, with `a.pickle` written into it.
    fn held_snaps() -> (tempfile::TempDir, PathBuf, Folders) {
        let top = tempfile::tempdir().unwrap();
        let snaps = top.path().join("snaps");
        fs::create_dir(&snaps).unwrap();
        let mut folders = Folders::new();
        write_atomic(&folders.open(&snaps).unwrap(), "a.pickle", b"1", false).unwrap();
        (top, snaps, folders)
    }

    #[test]
    fn a_descriptor_the_program_took_over_is_never_used_or_closed() {
        let (top, snaps, mut folders) = held_snaps();
        let fd = folders.held[0].fd.unwrap();
        // The test plays the program putting a file of its own at memsnap's number.
        let theirs_path = top.path().join("theirs");
        fs::write(&theirs_path, b"program data").unwrap();
        let theirs = fs::OpenOptions::new()
            .append(true)
            .open(&theirs_path)
            .unwrap();
        // SAFETY: dup2 onto a number this test's `folders` holds; nothing else uses it.
        assert_eq!(unsafe { libc::dup2(theirs.as_raw_fd(), fd) }, fd);
        let b = write_atomic(&folders.open(&snaps).unwrap(), "b.pickle", b"2", false).unwrap();
        assert_eq!(b, snaps.join("b.pickle"));
        assert_eq!(fs::read(&b).unwrap(), b"2");
        drop(folders);
        // Still open (memsnap did not close it), and nothing was written to it.
        // SAFETY: F_GETFD only reads the descriptor's flags.
        assert!(unsafe { libc::fcntl(fd, libc::F_GETFD) } >= 0);
        assert_eq!(fs::read(&theirs_path).unwrap(), b"program data");
        // SAFETY: the test's own duplicate, closed once.
        unsafe { libc::close(fd) };
    }

    #[test]
    fn a_folder_removed_and_made_again_is_opened_again() {
        let (_top, snaps, mut folders) = held_snaps();
        fs::remove_dir_all(&snaps).unwrap();
        fs::create_dir(&snaps).unwrap();
        let b = write_atomic(&folders.open(&snaps).unwrap(), "b.pickle", b"2", false).unwrap();
        assert_eq!(b, snaps.join("b.pickle"));
        assert_eq!(names(&snaps), ["b.pickle"]);
    }

    #[test]
    fn only_temporaries_provably_memsnaps_and_stale_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let maker = Maker::current();
        // A pid no process can have (above the kernel's largest pid_max, 2^22).
        let dead = u32::MAX - 7;
        assert!(!process_exists(dead));
        let stale = maker.name(dead, 0x1234);
        let alive = maker.name(1, 0x1234);
        // The same temporary as another host or another boot of this one would name it.
        let host = crate::config::sanitize(&crate::config::hostname());
        let other_host = stale.replacen(&format!(".{host}."), ".otherhost.", 1);
        let boot = fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
        let other_boot = stale.replacen(&boot.trim().replace('-', ""), &"0".repeat(32), 1);
        assert!(other_host != stale && other_boot != stale);
        let users = [
            ".notes.tmp.99999999",
            ".config.json.tmp.3141592653",
            ".report.md.tmp.424242.bak",
        ];
        for name in users.iter().copied().chain([
            stale.as_str(),
            alive.as_str(),
            other_host.as_str(),
            other_boot.as_str(),
        ]) {
            fs::write(dir.path().join(name), b"x").unwrap();
        }
        let link = maker.name(dead, 0x5678);
        symlink(
            dir.path().join(".notes.tmp.99999999"),
            dir.path().join(&link),
        )
        .unwrap();
        write_atomic(
            &Folders::new().open(dir.path()).unwrap(),
            "s.pickle",
            b"1",
            false,
        )
        .unwrap();
        let left = names(dir.path());
        assert!(!left.contains(&stale), "{left:?}");
        let mut kept: Vec<String> = users.iter().map(|n| n.to_string()).collect();
        kept.extend([alive, other_host, other_boot, link, "s.pickle".to_string()]);
        kept.sort();
        assert_eq!(left, kept);
    }
}

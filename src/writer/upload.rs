//! Copies of published snapshots to `MEMSNAP_REMOTE`, handed to a helper process.
//!
//! Cold, writer thread only. The copying itself runs in `memsnap upload-agent`, a child
//! process started on the first published snapshot, so the host process gains no I/O
//! beyond one line per file on a socket: the writer sends `LOCAL\tURL\n`, the agent
//! answers `ok\tLOCAL` or `failed\tLOCAL\tREASON` once the copy is confirmed or given up.
//! The writer never waits for an answer except at exit, and then at most
//! `MEMSNAP_REMOTE_WAIT`; what did not finish is named with its local path. The agent gets
//! no `LD_PRELOAD` (it must not record itself) and ends when its input closes, which also
//! happens when this process dies: it finishes the lines it already has, then exits. It
//! starts with no signal blocked (not the writer's mask), so SIGTERM stops it. It holds
//! none of the program's descriptors: its stderr is /dev/null and every descriptor above
//! stderr is closed in it, so a pipe the program writes to (`prog 2>&1 | tee log`) ends
//! with the program, whatever the helper still does. What it could not send (a failure,
//! before or after the program's exit, or a stop by a signal) it lists, each file with the
//! reason, in `memsnap-unsent-HOST-PID.txt` beside the snapshots, which the exit line names.
//! With `MEMSNAP_REMOTE_ONLY=1` the files it confirmed are gone locally, and the exit line
//! names their URLs instead ([`Uploader::moved_to`]).

use super::own_fd::OwnFd;
use std::ffi::CStr;
use std::io::{ErrorKind, Read};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The name of the CLI binary that carries the agent.
const CLI_NAME: &str = "memsnap";

pub struct Uploader {
    /// The URL template each file is copied to (`MEMSNAP_REMOTE`).
    remote: String,
    /// `MEMSNAP_REMOTE_ONLY`: the agent removes each file it copied.
    remove_local: bool,
    /// How long exit waits for the copies under way (`MEMSNAP_REMOTE_WAIT`).
    wait: Duration,
    /// The name of the list of files not uploaded (`memsnap-unsent-HOST-PID.txt`).
    unsent_name: String,
    /// That list, beside the first snapshot handed over, once the helper started.
    unsent: Option<PathBuf>,
    agent: Agent,
    /// Local paths sent to the agent and not yet answered, with their URLs.
    pending: Vec<(PathBuf, String)>,
    /// Bytes of answers read but not yet ending in a newline.
    partial: Vec<u8>,
    /// Files handed over (or refused before), answered or not.
    handed: u64,
    uploaded: u64,
    failed: u64,
    /// With `remove_local`: files the agent confirmed (and then removed locally), with their
    /// URLs.
    moved: Vec<(PathBuf, String)>,
}

enum Agent {
    NotStarted,
    Running {
        child: Child,
        /// memsnap's end of the agent's input and output, checked before each use
        /// (`own_fd`: the program may close it and reuse its number).
        socket: OwnFd<UnixStream>,
    },
    /// Could not start or went away: said once on stderr; snapshots stay local.
    Gone,
}

impl Uploader {
    /// Copies to `remote`, a URL template; `host` and `pid` name the list of files not
    /// uploaded.
    pub fn new(
        remote: String,
        remove_local: bool,
        wait: Duration,
        host: &str,
        pid: u32,
    ) -> Uploader {
        let host: String = host
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        Uploader {
            remote,
            remove_local,
            wait,
            unsent_name: format!("memsnap-unsent-{host}-{pid}.txt"),
            unsent: None,
            agent: Agent::NotStarted,
            pending: Vec::new(),
            partial: Vec::new(),
            handed: 0,
            uploaded: 0,
            failed: 0,
            moved: Vec::new(),
        }
    }

    /// The URL template files are copied to.
    pub fn remote(&self) -> &str {
        &self.remote
    }

    /// Hands one published file to the agent (started now if this is the first); never
    /// waits for the copy. Answers that already arrived are read and reported.
    pub fn send(&mut self, local: &Path, url: &str) {
        self.collect(Duration::ZERO);
        self.handed += 1;
        let line = format!("{}\t{url}\n", local.display());
        if line.matches(['\t', '\n']).count() != 2 {
            self.fail(local, url, "the path or URL contains a tab or newline");
            return;
        }
        if let Agent::NotStarted = self.agent {
            let dir = local.parent().unwrap_or(Path::new("."));
            let unsent = super::absolute(&dir.join(&self.unsent_name));
            self.agent = match start_agent(self.remove_local, &unsent) {
                Ok((child, socket)) => match OwnFd::new(socket) {
                    Some(socket) => {
                        self.unsent = Some(unsent);
                        Agent::Running { child, socket }
                    }
                    None => Agent::Gone,
                },
                Err(why) => {
                    eprintln!(
                        "memsnap: snapshots are not uploaded to MEMSNAP_REMOTE: {why}; they stay local"
                    );
                    Agent::Gone
                }
            };
        }
        let Some(socket) = self.agent_socket() else {
            return;
        };
        match send_all(socket, line.as_bytes()) {
            Ok(()) => self.pending.push((local.to_path_buf(), url.to_string())),
            Err(e) => {
                self.agent_gone(&format!("the upload helper stopped ({e})"));
                self.fail(local, url, "the upload helper stopped");
            }
        }
    }

    /// At exit: waits at most `MEMSNAP_REMOTE_WAIT` for the copies under way, then names the
    /// local path of each one that did not finish and the list of files not uploaded, and
    /// ends the agent's input.
    pub fn finish(&mut self) {
        self.collect(self.wait);
        let running = matches!(self.agent, Agent::Running { .. });
        if !self.pending.is_empty() {
            let paths: Vec<String> = self
                .pending
                .iter()
                .map(|(p, _)| p.display().to_string())
                .collect();
            eprintln!(
                "memsnap: {} upload{} to MEMSNAP_REMOTE did not finish within {:?} (MEMSNAP_REMOTE_WAIT){}; {}: {}",
                paths.len(),
                if paths.len() == 1 { "" } else { "s" },
                self.wait,
                if running {
                    "; the upload helper goes on with them after this process ends"
                } else {
                    ""
                },
                if paths.len() == 1 {
                    "the local file stays"
                } else {
                    "the local files stay"
                },
                paths.join(", ")
            );
        }
        if self.failed > 1 {
            eprintln!(
                "memsnap: {} of {} uploads to MEMSNAP_REMOTE failed; their local files stay",
                self.failed, self.handed
            );
        }
        // The helper writes its list before it answers a failure, and when a signal stops
        // it: a list on disk is named, as is the one files still under way may go into.
        if let Some(unsent) = &self.unsent
            && (unsent.exists() || (running && !self.pending.is_empty()))
        {
            eprintln!(
                "memsnap: {} lists each file the upload helper could not send, with the reason{}",
                unsent.display(),
                if running && !self.pending.is_empty() {
                    " (those still under way are added if they fail)"
                } else {
                    ""
                }
            );
        }
        // Closing our end is the agent's signal to finish what it has and exit; it is not
        // waited for (a copy that outlives the wait goes on after this process is gone).
        if let Some(socket) = self.agent_socket() {
            let _ = socket.shutdown(std::net::Shutdown::Write);
        }
        self.agent = Agent::Gone;
    }

    /// Where `local` went when the agent copied it and removed the local file
    /// (`MEMSNAP_REMOTE_ONLY=1`): its URL.
    pub fn moved_to(&self, local: &Path) -> Option<&str> {
        self.moved
            .iter()
            .find(|(p, _)| p == local)
            .map(|(_, url)| url.as_str())
    }

    /// Reads the agent's answers, waiting at most `wait` for the pending ones.
    fn collect(&mut self, wait: Duration) {
        let deadline = Instant::now() + wait;
        while !self.pending.is_empty() {
            let Some(socket) = self.agent_socket() else {
                return;
            };
            let left = deadline.saturating_duration_since(Instant::now());
            let read = if left.is_zero() {
                socket.set_nonblocking(true).and_then(|_| read_some(socket))
            } else {
                socket
                    .set_nonblocking(false)
                    .and_then(|_| socket.set_read_timeout(Some(left)))
                    .and_then(|_| read_some(socket))
            };
            match read {
                Ok(bytes) if bytes.is_empty() => {
                    self.agent_gone("the upload helper exited");
                    return;
                }
                Ok(bytes) => {
                    self.partial.extend_from_slice(&bytes);
                    self.take_answers();
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    self.agent_gone(&format!("the upload helper's answers broke off ({e})"));
                    return;
                }
            }
        }
    }

    fn take_answers(&mut self) {
        while let Some(end) = self.partial.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line[..line.len() - 1]).into_owned();
            let mut parts = line.splitn(3, '\t');
            let (status, local, reason) = (parts.next(), parts.next(), parts.next());
            let Some(local) = local else { continue };
            let Some(at) = self
                .pending
                .iter()
                .position(|(p, _)| p.as_os_str() == local)
            else {
                continue;
            };
            let (path, url) = self.pending.remove(at);
            if status == Some("ok") {
                self.uploaded += 1;
                if self.remove_local {
                    self.moved.push((path, url));
                }
            } else {
                self.fail(&path, &url, reason.unwrap_or("no reason given"));
            }
        }
    }

    /// One failed copy; only the first is said at once (the count comes at exit).
    fn fail(&mut self, local: &Path, url: &str, reason: &str) {
        self.failed += 1;
        if self.failed == 1 {
            eprintln!(
                "memsnap: could not upload {} to {url}: {reason}; the local file stays (further upload failures are counted at exit)",
                local.display()
            );
        }
    }

    /// The agent's socket while it is still memsnap's. Once the program closed it (and its
    /// number may be a file of the program's now), the agent has seen its input end and
    /// finishes what it was given; nothing more is sent.
    fn agent_socket(&mut self) -> Option<&UnixStream> {
        let Agent::Running { socket, .. } = &mut self.agent else {
            return None;
        };
        if socket.ours().is_none() {
            self.agent = Agent::Gone;
            eprintln!(
                "memsnap: the program closed memsnap's socket to the upload helper; later snapshots stay local"
            );
            return None;
        }
        match &self.agent {
            Agent::Running { socket, .. } => socket.last_seen(),
            _ => None,
        }
    }

    fn agent_gone(&mut self, why: &str) {
        if let Agent::Running { mut child, .. } = std::mem::replace(&mut self.agent, Agent::Gone) {
            // Its socket is closed or broken: it has ended or ends now; no zombie is left.
            let _ = child.kill();
            let _ = child.wait();
            eprintln!("memsnap: {why}; snapshots are no longer uploaded and stay local");
        }
    }
}

/// Reads whatever the socket has (blocking or not, as it is set).
fn read_some(mut socket: &UnixStream) -> std::io::Result<Vec<u8>> {
    let mut buf = [0u8; 4096];
    let n = socket.read(&mut buf)?;
    Ok(buf[..n].to_vec())
}

/// Writes all of `bytes` without SIGPIPE: a vanished agent is an error, never a signal
/// that would end the host program.
fn send_all(socket: &UnixStream, mut bytes: &[u8]) -> std::io::Result<()> {
    socket.set_nonblocking(false)?;
    socket.set_write_timeout(Some(Duration::from_secs(1)))?;
    while !bytes.is_empty() {
        // SAFETY: a valid connected socket fd and a live byte slice of the given length.
        let n = unsafe {
            libc::send(
                socket.as_raw_fd(),
                bytes.as_ptr().cast(),
                bytes.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        bytes = &bytes[n as usize..];
    }
    Ok(())
}

/// Starts `memsnap upload-agent` with one end of a socket pair as its stdin and stdout,
/// stderr on /dev/null and none of the program's other descriptors; it lists what it could
/// not send in `unsent`.
fn start_agent(remove_local: bool, unsent: &Path) -> Result<(Child, UnixStream), String> {
    let cli = find_cli().ok_or_else(|| {
        format!(
            "the `{CLI_NAME}` command that copies them was not found beside libmemsnap.so, in ../bin or on PATH"
        )
    })?;
    let (ours, theirs) = UnixStream::pair().map_err(|e| format!("no socket pair: {e}"))?;
    let theirs = OwnedFd::from(theirs);
    let theirs_out = theirs
        .try_clone()
        .map_err(|e| format!("no socket pair: {e}"))?;
    let mut cmd = Command::new(&cli);
    // SAFETY: the closure runs in the forked child before exec and calls only
    // async-signal-safe functions (sigemptyset, pthread_sigmask, the close_range system
    // call) on a local set.
    unsafe {
        cmd.pre_exec(|| {
            // This thread (the writer) blocks every signal, and a child inherits its mask:
            // unblocked, the helper can be stopped (SIGTERM) like any process.
            let mut none: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut none);
            libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
            // The program's descriptors that lack close-on-exec (a pipe it writes to, a
            // file it holds) are closed at exec: the helper must not keep them open after
            // the program ends. Marked, not closed, so the exec error report still works;
            // a kernel without close_range (before 5.11) leaves them as they are.
            libc::syscall(
                libc::SYS_close_range,
                3 as libc::c_uint,
                libc::c_uint::MAX,
                libc::CLOSE_RANGE_CLOEXEC,
            );
            Ok(())
        });
    }
    cmd.arg("upload-agent")
        .arg("--unsent")
        .arg(unsent)
        .env_remove("LD_PRELOAD")
        .stdin(Stdio::from(theirs))
        .stdout(Stdio::from(theirs_out))
        // Never the program's stderr: a pipe held by the helper would outlive the program.
        .stderr(Stdio::null());
    if remove_local {
        cmd.arg("--remove-local");
    }
    let child = cmd
        .spawn()
        .map_err(|e| format!("could not start {}: {e}", cli.display()))?;
    Ok((child, ours))
}

/// The `memsnap` binary: beside libmemsnap.so, in `../bin`, or on PATH.
fn find_cli() -> Option<PathBuf> {
    if let Some(dir) = own_dir() {
        for candidate in [dir.join(CLI_NAME), dir.join("../bin").join(CLI_NAME)] {
            if candidate.is_file() {
                return Some(candidate);
            }
        }
    }
    std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|d| d.join(CLI_NAME))
            .find(|c| c.is_file())
    })
}

/// The folder libmemsnap.so was loaded from.
fn own_dir() -> Option<PathBuf> {
    // SAFETY: `info` is a plain C struct that dladdr fills; the address is a function of
    // this library, so the answer names this library.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: see above.
    let found = unsafe { libc::dladdr(own_dir as *const libc::c_void, &mut info) } != 0;
    if !found || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated path owned by the dynamic loader.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    let path = PathBuf::from(name.to_str().ok()?);
    path.parent().map(Path::to_path_buf)
}

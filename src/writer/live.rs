//! The live-view socket (`memsnap top`): a Unix socket the writer thread serves from its
//! drain loop, answering what is live now from its own state (protocol:
//! `memsnap_format::live`, design: docs/LIVE.md).
//!
//! Cold, writer thread only; no hook ever touches it. Opened when the writer starts (the
//! first CUDA event), in the per-user 0700 folder, and removed at exit. Every socket is
//! non-blocking: the writer accepts, reads and writes only what is ready, so a client that
//! stalls, floods or sends garbage costs it nothing but a closed connection. Only a peer
//! with this process's uid (SO_PEERCRED, from the kernel) is served. Its descriptors are
//! looked at before each pass (`own_fd`): one the program closed is never used again, and a
//! listener it closed is opened again.

use crate::snapshot::live::{self, MAX_REQUEST, Request};
use crate::writer::ack::private_folder;
use crate::writer::own_fd::OwnFd;
use std::io::{ErrorKind, Read};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Clients still sending their request at once; a connection past that cuts off the one
/// that has been sending longest (a flood of stalled clients cannot lock out the next
/// `memsnap top`, whose request follows its connection at once).
const MAX_CLIENTS: usize = 8;
/// Connections accepted per pass of the drain loop (a flood cannot keep the writer here,
/// and a flood of clients that ask and leave is taken from the kernel's backlog faster
/// than it comes, so a `memsnap top` behind it is reached in the next passes).
const ACCEPTS_PER_PASS: usize = 64;
/// Time a client has from its connection to its whole request, and then for each part of
/// the answer the socket takes (a client that stops reading is cut off after this long).
const CLIENT_DEADLINE: Duration = Duration::from_secs(2);
/// Longest time between two looks at the listener while the writer is too busy draining
/// to sleep (a sleeping writer is woken by the listener itself): one `accept` syscall per
/// millisecond at most, not one per pass of the drain loop.
const ACCEPT_EVERY: Duration = Duration::from_millis(1);
/// How long the listener is left alone after `accept` failed for want of resources (out of
/// fds): it stays readable meanwhile, and polling it would spin the writer.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(200);

/// How often a listener the program closed is opened again at most.
const REBIND_EVERY: Duration = Duration::from_secs(1);

/// An accepted client: its request as it arrives, then its answer as it leaves.
struct Client {
    /// Unique for the life of the server: what the writer answers by.
    id: u64,
    stream: OwnFd<UnixStream>,
    inbox: Vec<u8>,
    /// The encoded answer and how much of it was sent; empty until answered.
    outbox: Vec<u8>,
    sent: usize,
    /// Asked and waiting for the writer's answer.
    asked: bool,
    /// A request read in full when the connection was accepted, not yet handed out.
    pending: Option<Request>,
    /// Answered in full (or gone): dropped on the next pass.
    done: bool,
    deadline: Instant,
}

/// A request read in full, for the writer to answer with [`LiveServer::answer`].
pub struct Asked {
    pub client: u64,
    pub request: Request,
    /// The client closed its end after asking: there is nobody to answer (the request
    /// still counts), and its descriptor is already closed.
    pub gone: bool,
}

pub struct LiveServer {
    listener: Option<OwnFd<UnixListener>>,
    pid: u32,
    /// When the listener was last opened again after the program closed it.
    last_rebind: Option<Instant>,
    /// Set after `accept` failed with something other than "nobody waiting".
    accept_paused_until: Option<Instant>,
    /// The drain loop's sleep saw the listener readable.
    listener_ready: bool,
    last_accept: Instant,
    path: Option<PathBuf>,
    pub uid: u32,
    clients: Vec<Client>,
    next_id: u64,
    /// Connections cut off (refused peer, garbage, stall, flood), for tests and benches.
    pub refused: u64,
    /// Requests answered.
    pub answered: u64,
}

impl LiveServer {
    /// This process's uid, whose private folder holds the socket.
    pub fn own_uid() -> u32 {
        // SAFETY: getuid has no preconditions and cannot fail.
        unsafe { libc::getuid() }
    }

    /// Opens `{pid}.sock` in the per-user folder. A failure is one warning line: the
    /// process records as before, only `memsnap top` cannot reach it.
    pub fn open(pid: u32) -> LiveServer {
        // SAFETY: getuid has no preconditions and cannot fail.
        let uid = unsafe { libc::getuid() };
        let mut server = LiveServer {
            listener: None,
            pid,
            last_rebind: None,
            accept_paused_until: None,
            listener_ready: false,
            last_accept: Instant::now(),
            path: None,
            uid,
            clients: Vec::new(),
            next_id: 0,
            refused: 0,
            answered: 0,
        };
        match Self::bind(uid, pid) {
            Ok((listener, path)) => {
                server.listener = Some(listener);
                server.path = Some(path);
            }
            Err(e) => eprintln!(
                "memsnap: `memsnap top` cannot reach this process (live socket: {e}); recording continues"
            ),
        }
        server
    }

    fn bind(uid: u32, pid: u32) -> std::io::Result<(OwnFd<UnixListener>, PathBuf)> {
        if private_folder(uid).is_none() {
            return Err(std::io::Error::other(format!(
                "{} is not a private folder of this user",
                crate::snapshot::ack::folder(uid).display()
            )));
        }
        let path = live::socket_path(uid, pid);
        // A socket left by an earlier process with this pid (it died without cleaning up):
        // the folder is this user's alone, so whatever is there is ours to replace.
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path)?;
        listener.set_nonblocking(true)?;
        let listener = OwnFd::new(listener)
            .ok_or_else(|| std::io::Error::other("the socket cannot be looked at"))?;
        Ok((listener, path))
    }

    /// Before each pass: the clients whose descriptor the program closed are dropped (their
    /// numbers are the program's now, `own_fd`), and a listener it closed is opened again,
    /// at most once a second, so `memsnap top` and `memsnap dump` still reach the process.
    pub fn keep_descriptors(&mut self) {
        self.clients.retain_mut(|c| c.stream.ours().is_some());
        let lost = self.listener.as_mut().is_some_and(|l| l.ours().is_none());
        if !lost || self.last_rebind.is_some_and(|t| t.elapsed() < REBIND_EVERY) {
            return;
        }
        self.last_rebind = Some(Instant::now());
        self.listener = None;
        if let Ok((listener, path)) = Self::bind(self.uid, self.pid) {
            self.listener = Some(listener);
            self.path = Some(path);
        }
    }

    /// Removes the socket (at exit): nobody can connect any more.
    pub fn close(&mut self) {
        self.listener = None;
        self.clients.clear();
        if let Some(path) = self.path.take() {
            let _ = std::fs::remove_file(path);
        }
    }

    /// Whether a client is connected.
    pub fn busy(&self) -> bool {
        !self.clients.is_empty()
    }

    /// The fds the drain loop's sleep also waits on: the listener, and each client that
    /// has something to read or to be sent.
    pub fn poll_fds(&self, fds: &mut Vec<libc::pollfd>) {
        let fd = |fd: i32, events: i16| libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        if let Some(l) = self.listener.as_ref().and_then(OwnFd::last_seen)
            && self.accept_paused_until.is_none()
        {
            fds.push(fd(l.as_raw_fd(), libc::POLLIN));
        }
        for c in &self.clients {
            if c.asked && c.outbox.is_empty() {
                continue;
            }
            let events = if c.outbox.is_empty() {
                libc::POLLIN
            } else {
                libc::POLLOUT
            };
            if let Some(stream) = c.stream.last_seen() {
                fds.push(fd(stream.as_raw_fd(), events));
            }
        }
    }

    /// After the drain loop's `poll` on [`Self::poll_fds`]: notes whether the listener has
    /// a connection waiting.
    pub fn after_poll(&mut self, fds: &[libc::pollfd]) {
        if let Some(l) = self.listener.as_ref().and_then(OwnFd::last_seen) {
            let fd = l.as_raw_fd();
            self.listener_ready |= fds.iter().any(|p| p.fd == fd && p.revents != 0);
        }
    }

    /// One pass: accepts new clients, reads what arrived, sends what can be sent, cuts off
    /// the ones past their deadline or misbehaving. Returns the requests read in full. A
    /// client that asked waits for its answer without a deadline (the writer answers a
    /// sample in the same pass, a dump within the floor between request snapshots).
    pub fn poll(&mut self) -> Vec<Asked> {
        self.keep_descriptors();
        self.accept();
        let now = Instant::now();
        let mut asked = Vec::new();
        let mut keep = Vec::with_capacity(self.clients.len());
        for mut c in std::mem::take(&mut self.clients) {
            let request = if c.done || c.asked || !c.outbox.is_empty() {
                None
            } else if let Some(request) = c.pending.take() {
                Some(request)
            } else {
                match c.receive() {
                    Received::Waiting => None,
                    Received::Request(request) => Some(request),
                    Received::Bad => {
                        self.refused += 1;
                        continue;
                    }
                }
            };
            if let Some(request) = request {
                c.asked = true;
                let gone = c.peer_gone();
                asked.push(Asked {
                    client: c.id,
                    request,
                    gone,
                });
                if !gone {
                    keep.push(c);
                }
                continue;
            }
            let stalled = now > c.deadline && !(c.asked && c.outbox.is_empty());
            let alive = if c.done {
                // Answered in full: closed without counting it.
                false
            } else if stalled {
                self.refused += 1;
                false
            } else if !c.outbox.is_empty() {
                c.send()
            } else {
                true
            };
            if alive {
                keep.push(c);
            }
        }
        self.clients = keep;
        asked
    }

    /// Queues `answer` (already encoded) for client `client` and sends what fits now. A
    /// client that is gone is skipped.
    pub fn answer(&mut self, client: u64, answer: Vec<u8>) {
        self.answered += 1;
        if let Some(c) = self.clients.iter_mut().find(|c| c.id == client) {
            c.outbox = answer;
            c.sent = 0;
            // Sent in full, or the peer is gone: either way this client is done.
            c.done = !c.send();
        }
    }

    /// Closes client `client`'s connection without an answer (on the next pass).
    pub fn close_client(&mut self, client: u64) {
        if let Some(c) = self.clients.iter_mut().find(|c| c.id == client) {
            c.done = true;
        }
    }

    fn accept(&mut self) {
        let Some(listener) = self.listener.as_ref().and_then(OwnFd::last_seen) else {
            return;
        };
        if let Some(until) = self.accept_paused_until {
            if Instant::now() < until {
                return;
            }
            self.accept_paused_until = None;
        }
        if !self.listener_ready && self.last_accept.elapsed() < ACCEPT_EVERY {
            return;
        }
        self.listener_ready = false;
        self.last_accept = Instant::now();
        for _ in 0..ACCEPTS_PER_PASS {
            let stream = match listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break, // nobody else waiting
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => {
                    self.accept_paused_until = Some(Instant::now() + ACCEPT_BACKOFF);
                    break;
                }
            };
            if !peer_allowed(peer_uid(&stream), self.uid) || stream.set_nonblocking(true).is_err() {
                self.refused += 1;
                continue; // dropped: closed without a word
            }
            self.next_id += 1;
            let Some(mut client) = Client::new(self.next_id, stream) else {
                self.refused += 1;
                continue;
            };
            // Read at once: a client that already sent its whole request is answered in
            // this pass whatever the others do; one that closed or sent garbage never takes
            // a place. Only clients still sending count against the limit, so a flood of
            // stalled connections cannot lock out the next `memsnap top`.
            match client.receive() {
                Received::Request(request) => client.pending = Some(request),
                Received::Bad => {
                    self.refused += 1;
                    continue;
                }
                Received::Waiting => {
                    let still_sending = |c: &Client| !c.asked && c.pending.is_none() && !c.done;
                    let waiting = self.clients.iter().filter(|c| still_sending(c)).count();
                    if waiting >= MAX_CLIENTS
                        && let Some(oldest) = self.clients.iter().position(still_sending)
                    {
                        // The newest connection is the likeliest to ask at once.
                        self.clients.remove(oldest);
                        self.refused += 1;
                    }
                }
            }
            self.clients.push(client);
        }
    }
}

enum Received {
    Waiting,
    Request(Request),
    Bad,
}

impl Client {
    fn new(id: u64, stream: UnixStream) -> Option<Client> {
        Some(Client {
            id,
            stream: OwnFd::new(stream)?,
            inbox: Vec::new(),
            outbox: Vec::new(),
            sent: 0,
            asked: false,
            pending: None,
            done: false,
            deadline: Instant::now() + CLIENT_DEADLINE,
        })
    }

    fn receive(&mut self) -> Received {
        let Some(stream) = self.stream.last_seen() else {
            return Received::Bad;
        };
        let mut buf = [0u8; 512];
        loop {
            match (&mut &*stream).read(&mut buf) {
                Ok(0) => return Received::Bad, // closed before asking
                Ok(n) => {
                    if self.inbox.len() + n > MAX_REQUEST + 4 {
                        return Received::Bad;
                    }
                    self.inbox.extend_from_slice(&buf[..n]);
                    match live::decode::<Request>(&self.inbox, MAX_REQUEST) {
                        Ok(Some(r)) => return Received::Request(r),
                        Ok(None) => continue,
                        Err(_) => return Received::Bad,
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Received::Waiting,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return Received::Bad,
            }
        }
    }

    /// Whether the peer closed its end (after sending its request): nothing is left to
    /// read and the next read would see the end.
    fn peer_gone(&self) -> bool {
        let Some(stream) = self.stream.last_seen() else {
            return true;
        };
        let mut byte = 0u8;
        // SAFETY: a valid socket fd and a one-byte buffer; MSG_PEEK leaves the data queued.
        let n = unsafe {
            libc::recv(
                stream.as_raw_fd(),
                (&mut byte as *mut u8).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        n == 0
    }

    /// Sends what the socket takes now; `false` once done (all sent) or failed.
    fn send(&mut self) -> bool {
        let Some(stream) = self.stream.last_seen() else {
            return false;
        };
        while self.sent < self.outbox.len() {
            let rest = &self.outbox[self.sent..];
            // SAFETY: a valid socket fd and a live byte slice of the given length.
            // MSG_NOSIGNAL: a client that left is an error here, never a SIGPIPE that would
            // end the program.
            let n = unsafe {
                libc::send(
                    stream.as_raw_fd(),
                    rest.as_ptr().cast(),
                    rest.len(),
                    libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
                )
            };
            let written = if n < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(n as usize)
            };
            match written {
                Ok(0) => return false,
                Ok(n) => {
                    self.sent += n;
                    // A large answer may take longer than the deadline to leave; only a
                    // client that stops reading is a stall.
                    self.deadline = Instant::now() + CLIENT_DEADLINE;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return false,
            }
        }
        false
    }
}

/// The uid of the process at the other end, as the kernel recorded it when it connected.
fn peer_uid(stream: &UnixStream) -> Option<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a valid socket fd, an out-buffer of the size passed, which the kernel fills.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0 && len as usize == std::mem::size_of::<libc::ucred>()).then_some(cred.uid)
}

/// Only this process's own user is served: not root, not anyone else. An unknown peer
/// (no credentials) is refused too.
pub fn peer_allowed(peer_uid: Option<u32>, own_uid: u32) -> bool {
    peer_uid == Some(own_uid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn only_the_same_user_is_served() {
        assert!(peer_allowed(Some(1000), 1000));
        assert!(!peer_allowed(Some(0), 1000), "root is someone else");
        assert!(!peer_allowed(Some(1001), 1000));
        assert!(!peer_allowed(None, 1000));
        assert!(!peer_allowed(Some(1000), 0));
    }

    #[test]
    fn the_kernel_reports_our_own_uid_for_a_local_peer() {
        let (a, _b) = UnixStream::pair().unwrap();
        // SAFETY: getuid cannot fail.
        let me = unsafe { libc::getuid() };
        assert_eq!(peer_uid(&a), Some(me));
        assert!(peer_allowed(peer_uid(&a), me));
    }

    /// A server on a socket pair's far end, without the listener.
    fn client_pair() -> (LiveServer, UnixStream) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let server = LiveServer {
            listener: None,
            pid: std::process::id(),
            last_rebind: None,
            accept_paused_until: None,
            listener_ready: false,
            last_accept: Instant::now(),
            path: None,
            uid: 0,
            clients: vec![Client::new(1, ours).unwrap()],
            next_id: 1,
            refused: 0,
            answered: 0,
        };
        (server, theirs)
    }

    #[test]
    fn garbage_and_oversized_requests_are_cut_off() {
        let (mut server, mut peer) = client_pair();
        peer.write_all(&[0xff; 4]).unwrap(); // announces 4 GiB
        assert!(server.poll().is_empty());
        assert_eq!((server.clients.len(), server.refused), (0, 1));

        let (mut server, mut peer) = client_pair();
        let mut bytes = 3u32.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{{{");
        peer.write_all(&bytes).unwrap();
        assert!(server.poll().is_empty());
        assert_eq!(server.clients.len(), 0);
    }

    #[test]
    fn a_request_in_pieces_is_read_and_answered() {
        let (mut server, mut peer) = client_pair();
        let ask = Request::Sample {
            known_frames: 0,
            known_stacks: 0,
        };
        let bytes = live::encode(&ask);
        peer.write_all(&bytes[..3]).unwrap();
        assert!(server.poll().is_empty());
        assert_eq!(server.clients.len(), 1, "a partial request waits");
        peer.write_all(&bytes[3..]).unwrap();
        let asked = server.poll();
        assert_eq!(asked.len(), 1);
        assert_eq!(asked[0].request, ask);
        server.answer(asked[0].client, live::encode(&"ok"));
        let answer: String = live::read_message(&mut peer, 64).unwrap();
        assert_eq!(answer, "ok");
    }
}

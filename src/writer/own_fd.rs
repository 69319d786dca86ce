//! The writer's long-lived descriptors (the live socket and its clients, the stats file),
//! each checked to be still memsnap's before it is used, and never closed once it is not.
//!
//! Cold (writer thread). A descriptor is a number in the program's table, and the program
//! may close every number it did not open itself (daemonizing code, `close_range`) and
//! open files of its own, which then get memsnap's numbers. Using such a number would write
//! into the program's files or read its data away; closing it would close the program's
//! file. So each descriptor remembers what it named when memsnap opened it (the device and
//! inode `fstat` gives: unique to a socket, and to a file on its filesystem), and is looked
//! at again before each use. Once it names something else it is let go without a `close`:
//! the number is the program's now. Its owner reopens what it needs by path.

use std::os::fd::{AsRawFd, IntoRawFd};

/// A descriptor memsnap opened, with what it named then.
pub struct OwnFd<T: AsRawFd + IntoRawFd> {
    inner: Option<T>,
    identity: (u64, u64),
}

/// What `fd` names now (`fstat`); `None` when it is closed. Shared with `folder`, which
/// holds its folders the same way.
pub(super) fn stat_of(fd: i32) -> Option<libc::stat> {
    // SAFETY: all-zero is a valid `struct stat`; fstat fills it or fails, on any number.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out-pointer; fstat only reads the descriptor table.
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some(st)
}

/// The device and inode `fd` names now; `None` when it is closed.
fn identity(fd: i32) -> Option<(u64, u64)> {
    stat_of(fd).map(|st| (st.st_dev, st.st_ino))
}

impl<T: AsRawFd + IntoRawFd> OwnFd<T> {
    /// Takes `inner`, just opened by memsnap; `None` if it cannot be looked at.
    pub fn new(inner: T) -> Option<OwnFd<T>> {
        let identity = identity(inner.as_raw_fd())?;
        Some(OwnFd {
            inner: Some(inner),
            identity,
        })
    }

    /// The descriptor, if it still names what memsnap opened; otherwise `None` from now on
    /// (let go without a close).
    pub fn ours(&mut self) -> Option<&mut T> {
        let fd = self.inner.as_ref()?.as_raw_fd();
        if identity(fd) != Some(self.identity) {
            self.let_go();
            return None;
        }
        self.inner.as_mut()
    }

    /// The descriptor without looking again: for a use right after [`Self::ours`] in the
    /// same pass (a `poll` set), where a second `fstat` would only narrow the same window.
    pub fn last_seen(&self) -> Option<&T> {
        self.inner.as_ref()
    }

    /// Forgets the number without closing it.
    fn let_go(&mut self) {
        if let Some(inner) = self.inner.take() {
            let _ = inner.into_raw_fd();
        }
    }
}

impl<T: AsRawFd + IntoRawFd> Drop for OwnFd<T> {
    /// Closes the descriptor only while it is still memsnap's.
    fn drop(&mut self) {
        let _ = self.ours();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::FromRawFd;
    use std::os::unix::net::UnixStream;

    /// The program closes memsnap's descriptor and opens its own, which gets the same
    /// number: memsnap neither uses nor closes it, and the program's stream is intact.
    #[test]
    fn a_number_the_program_took_over_is_neither_used_nor_closed() {
        let (ours, mut our_peer) = UnixStream::pair().unwrap();
        let number = ours.as_raw_fd();
        let mut own = OwnFd::new(ours).unwrap();
        assert!(own.ours().is_some());
        let (theirs, mut their_peer) = UnixStream::pair().unwrap();
        // dup2 closes memsnap's socket and puts the program's under its number, in one step
        // (as a close_range followed by an open would, without a window for other threads).
        // SAFETY: both numbers are open; `number` is then the program's.
        assert_eq!(unsafe { libc::dup2(theirs.as_raw_fd(), number) }, number);
        let mut gone = [0u8; 1];
        assert_eq!(
            our_peer.read(&mut gone).unwrap(),
            0,
            "memsnap's socket is closed"
        );
        assert!(own.ours().is_none(), "another socket under the same number");
        drop(own);
        // The program's socket still works under that number: memsnap did not close it.
        // SAFETY: `number` is open (the program's duplicate) and owned by this test now.
        let mut program = unsafe { UnixStream::from_raw_fd(number) };
        program.write_all(b"program data").unwrap();
        let mut got = [0u8; 12];
        their_peer.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"program data");
    }

    #[test]
    fn a_descriptor_still_ours_is_closed_on_drop() {
        let (ours, mut peer) = UnixStream::pair().unwrap();
        drop(OwnFd::new(ours).unwrap());
        let mut gone = [0u8; 1];
        assert_eq!(
            peer.read(&mut gone).unwrap(),
            0,
            "closed: the peer sees the end"
        );
    }
}

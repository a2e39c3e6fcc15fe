//! The two connections of a rank in the ring and the loop that moves bytes over them.
//!
//! Every rank sends right and receives left at the same time. With blocking sockets that
//! deadlocks as soon as a message outgrows the socket buffers (every rank blocked in `write`,
//! nobody reading), so both sockets are non-blocking and one `poll` loop writes whatever the
//! right socket takes and reads whatever the left one has, in pieces of at most [`PIECE`]
//! bytes, handing each received piece to the reduction at once: the kernel keeps sending
//! while we add. (A sender thread was the alternative; it needs the outgoing bytes owned or
//! copied, which poll does not.)

use std::io::{ErrorKind, Read};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::io::Errno;
use rustix::net::{SendFlags, send};

use crate::error::{CollectiveError, Result};

/// Largest read or write per system call: small enough that a reduction starts early and
/// reads interleave with writes, large enough that system calls cost little.
pub(crate) const PIECE: usize = 256 * 1024;

/// What a transfer sends and where its received bytes go.
pub(crate) trait Flow {
    /// Bytes ready to send now (may be empty while waiting for received ones to forward).
    fn pending(&self) -> &[u8];
    /// `n` bytes of [`pending`](Self::pending) went out.
    fn sent(&mut self, n: usize);
    /// Whether everything has been sent.
    fn send_done(&self) -> bool;
    /// Where the next received bytes go (empty once everything arrived).
    fn space(&mut self) -> &mut [u8];
    /// `n` bytes arrived in [`space`](Self::space).
    fn received(&mut self, n: usize);
}

/// A rank's two connections: to the left neighbour (receive) and the right one (send).
#[derive(Debug)]
pub(crate) struct Link {
    pub(crate) left: UnixStream,
    pub(crate) right: UnixStream,
    pub(crate) left_rank: usize,
    pub(crate) right_rank: usize,
    pub(crate) timeout: Duration,
    /// Bytes written so far.
    pub(crate) bytes_sent: u64,
}

impl Link {
    /// Runs `flow` to completion.
    ///
    /// # Errors
    /// [`CollectiveError::PeerExited`] on end-of-file or a broken pipe,
    /// [`CollectiveError::Timeout`] when no byte moved for `timeout`.
    pub(crate) fn pump(&mut self, op: &'static str, flow: &mut dyn Flow) -> Result<()> {
        let mut last_progress = Instant::now();
        loop {
            let want_recv = !flow.space().is_empty();
            let want_send = !flow.pending().is_empty();
            if !want_recv && flow.send_done() {
                return Ok(());
            }
            let waited = last_progress.elapsed();
            if waited >= self.timeout {
                return Err(CollectiveError::Timeout {
                    op,
                    // Waiting to receive means the left neighbour's bytes never came;
                    // otherwise the right one never took ours.
                    peer: if want_recv {
                        self.left_rank
                    } else {
                        self.right_rank
                    },
                    bound: self.timeout,
                });
            }
            let left_events = if want_recv {
                PollFlags::IN
            } else {
                PollFlags::empty()
            };
            let right_events = if want_send {
                PollFlags::OUT
            } else {
                PollFlags::empty()
            };
            let mut fds = [
                PollFd::new(&self.left, left_events),
                PollFd::new(&self.right, right_events),
            ];
            // Only watch a socket we need: a closed one reports HUP whether asked or not, and a
            // neighbour that finished and exited is no error while we have nothing for it.
            let watched = match (want_recv, want_send) {
                (true, true) => &mut fds[..],
                (true, false) => &mut fds[..1],
                (false, _) => &mut fds[1..],
            };
            let left_tm = self.timeout - waited;
            let timeout = Timespec {
                tv_sec: left_tm.as_secs() as _,
                tv_nsec: left_tm.subsec_nanos() as _,
            };
            match poll(watched, Some(&timeout)) {
                Ok(0) => continue,
                Ok(_) => {}
                Err(Errno::INTR) => continue,
                Err(e) => return Err(CollectiveError::io(format!("{op}: poll"), e.into())),
            }
            let (left_ready, right_ready) = match (want_recv, want_send) {
                (true, true) => (!fds[0].revents().is_empty(), !fds[1].revents().is_empty()),
                (true, false) => (!fds[0].revents().is_empty(), false),
                (false, _) => (false, !fds[1].revents().is_empty()),
            };
            if right_ready {
                let pending = flow.pending();
                let piece = &pending[..pending.len().min(PIECE)];
                match send(&self.right, piece, SendFlags::NOSIGNAL) {
                    Ok(n) => {
                        self.bytes_sent += n as u64;
                        flow.sent(n);
                        last_progress = Instant::now();
                    }
                    Err(Errno::AGAIN | Errno::INTR) => {}
                    Err(Errno::PIPE | Errno::CONNRESET) => return Err(self.peer_exited(op, false)),
                    Err(e) => {
                        return Err(CollectiveError::io(
                            format!("{op}: send to rank {}", self.right_rank),
                            e.into(),
                        ));
                    }
                }
            }
            if left_ready {
                let space = flow.space();
                let len = space.len().min(PIECE);
                match self.left.read(&mut space[..len]) {
                    Ok(0) => return Err(self.peer_exited(op, true)),
                    Ok(n) => {
                        flow.received(n);
                        last_progress = Instant::now();
                    }
                    Err(e)
                        if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
                    Err(e) if e.kind() == ErrorKind::ConnectionReset => {
                        return Err(self.peer_exited(op, true));
                    }
                    Err(e) => {
                        return Err(CollectiveError::io(
                            format!("{op}: receive from rank {}", self.left_rank),
                            e,
                        ));
                    }
                }
            }
        }
    }

    fn peer_exited(&self, op: &'static str, left: bool) -> CollectiveError {
        CollectiveError::PeerExited {
            rank: if left {
                self.left_rank
            } else {
                self.right_rank
            },
            op,
        }
    }

    /// Closes both connections so that the neighbours fail at once rather than at their
    /// timeout.
    pub(crate) fn shutdown(&self) {
        // Errors here mean the socket is already gone, which is what we want.
        let _ = self.left.shutdown(std::net::Shutdown::Both);
        let _ = self.right.shutdown(std::net::Shutdown::Both);
    }
}

/// Sends one buffer and receives into another (disjoint) one.
pub(crate) struct Exchange<'a> {
    pub(crate) out: &'a [u8],
    pub(crate) out_done: usize,
    pub(crate) into: &'a mut [u8],
    pub(crate) in_done: usize,
}

impl<'a> Exchange<'a> {
    pub(crate) fn new(out: &'a [u8], into: &'a mut [u8]) -> Self {
        Exchange {
            out,
            out_done: 0,
            into,
            in_done: 0,
        }
    }
}

impl Flow for Exchange<'_> {
    fn pending(&self) -> &[u8] {
        &self.out[self.out_done..]
    }
    fn sent(&mut self, n: usize) {
        self.out_done += n;
    }
    fn send_done(&self) -> bool {
        self.out_done == self.out.len()
    }
    fn space(&mut self) -> &mut [u8] {
        &mut self.into[self.in_done..]
    }
    fn received(&mut self, n: usize) {
        self.in_done += n;
    }
}

/// Sends one buffer and receives another into scratch space, handing every piece of
/// received bytes (whole elements) to `reduce` as it completes.
pub(crate) struct ReduceExchange<'a, F: FnMut(std::ops::Range<usize>, &[u8])> {
    pub(crate) inner: Exchange<'a>,
    pub(crate) element: usize,
    pub(crate) reduced: usize,
    pub(crate) reduce: F,
}

impl<F: FnMut(std::ops::Range<usize>, &[u8])> Flow for ReduceExchange<'_, F> {
    fn pending(&self) -> &[u8] {
        self.inner.pending()
    }
    fn sent(&mut self, n: usize) {
        self.inner.sent(n);
    }
    fn send_done(&self) -> bool {
        self.inner.send_done()
    }
    fn space(&mut self) -> &mut [u8] {
        self.inner.space()
    }
    fn received(&mut self, n: usize) {
        self.inner.received(n);
        let whole = self.inner.in_done / self.element * self.element;
        if whole > self.reduced {
            (self.reduce)(self.reduced..whole, &self.inner.into[self.reduced..whole]);
            self.reduced = whole;
        }
    }
}

/// Receives a buffer and sends on what has arrived (a broadcast's relay), or only sends
/// (the root) or only receives (the last rank).
pub(crate) struct Relay<'a> {
    pub(crate) buf: &'a mut [u8],
    pub(crate) receive: bool,
    pub(crate) send: bool,
    pub(crate) out_done: usize,
    pub(crate) in_done: usize,
}

impl Flow for Relay<'_> {
    fn pending(&self) -> &[u8] {
        if !self.send {
            return &[];
        }
        let available = if self.receive {
            self.in_done
        } else {
            self.buf.len()
        };
        &self.buf[self.out_done..available]
    }
    fn sent(&mut self, n: usize) {
        self.out_done += n;
    }
    fn send_done(&self) -> bool {
        !self.send || self.out_done == self.buf.len()
    }
    fn space(&mut self) -> &mut [u8] {
        if !self.receive {
            return &mut [];
        }
        &mut self.buf[self.in_done..]
    }
    fn received(&mut self, n: usize) {
        self.in_done += n;
    }
}

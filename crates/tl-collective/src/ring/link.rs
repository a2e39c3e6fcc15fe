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

use super::writer::Writer;
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

/// One of a rank's two connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    /// To the left neighbour, rank − 1: the collectives receive on it.
    Left,
    /// To the right neighbour, rank + 1: the collectives send on it.
    Right,
}

/// A rank's two connections: to the left neighbour and the right one. The collectives
/// receive on the left and send on the right; point-to-point messages go either way (see
/// `messages.rs`), each after the messages queued before it on the same connection.
#[derive(Debug)]
pub(crate) struct Link {
    pub(crate) left: UnixStream,
    pub(crate) right: UnixStream,
    pub(crate) left_rank: usize,
    pub(crate) right_rank: usize,
    pub(crate) timeout: Duration,
    /// Bytes the collectives wrote so far (the messages' writers count their own).
    pub(crate) bytes_sent: u64,
    /// The point-to-point messages' writers, of the left connection then the right one.
    pub(crate) writers: [Writer; 2],
}

impl Link {
    /// A link over two connected, non-blocking sockets, with a writer of messages on each.
    ///
    /// # Errors
    /// [`CollectiveError::Io`] if a socket cannot be shared with its writer.
    pub(crate) fn new(
        (left, left_rank): (UnixStream, usize),
        (right, right_rank): (UnixStream, usize),
        timeout: Duration,
    ) -> Result<Self> {
        let writer = |socket: &UnixStream, peer| {
            let clone = socket
                .try_clone()
                .map_err(|e| CollectiveError::io("share a connection with its writer", e))?;
            Writer::start(clone, peer, timeout)
        };
        let writers = [writer(&left, left_rank)?, writer(&right, right_rank)?];
        Ok(Link {
            left,
            right,
            left_rank,
            right_rank,
            timeout,
            bytes_sent: 0,
            writers,
        })
    }

    /// Every byte this rank wrote: the collectives' and the messages'.
    pub(crate) fn total_sent(&self) -> u64 {
        self.bytes_sent + self.writers.iter().map(Writer::bytes_sent).sum::<u64>()
    }

    /// Runs `flow` to completion: its sends go right, its receives come from the left.
    ///
    /// # Errors
    /// [`CollectiveError::PeerExited`] on end-of-file or a broken pipe,
    /// [`CollectiveError::Timeout`] when no byte moved for `timeout`.
    pub(crate) fn pump(&mut self, op: &'static str, flow: &mut dyn Flow) -> Result<()> {
        self.transfer(op, flow, Side::Left)
    }

    /// Runs `flow` to completion, receiving from the connection `from` (its sends go right).
    ///
    /// # Errors
    /// As [`pump`](Self::pump).
    pub(crate) fn transfer(
        &mut self,
        op: &'static str,
        flow: &mut dyn Flow,
        from: Side,
    ) -> Result<()> {
        let mut last_progress = Instant::now();
        let mut written = self.total_sent();
        loop {
            for writer in &self.writers {
                writer.check(op)?;
            }
            let want_recv = !flow.space().is_empty();
            let want_send = !flow.pending().is_empty();
            if !want_recv && flow.send_done() {
                return Ok(());
            }
            // A flow holding its bytes back (a header behind the messages' writer) waits
            // for the writer: its bytes count as progress, and the poll wakes up to look.
            let held_back = !want_send && !flow.send_done();
            if self.total_sent() != written {
                (written, last_progress) = (self.total_sent(), Instant::now());
            }
            let waited = last_progress.elapsed();
            if waited >= self.timeout {
                // Waiting to receive means the peer's bytes never came; otherwise a peer
                // never took ours.
                let peer = match (want_recv, from) {
                    (true, Side::Left) => self.left_rank,
                    _ => self.right_rank,
                };
                return Err(CollectiveError::Timeout {
                    op,
                    peer,
                    bound: self.timeout,
                });
            }
            let events = |read: bool, write: bool| {
                let mut flags = PollFlags::empty();
                if read {
                    flags |= PollFlags::IN;
                }
                if write {
                    flags |= PollFlags::OUT;
                }
                flags
            };
            let wanted = [
                events(want_recv && from == Side::Left, false),
                events(want_recv && from == Side::Right, want_send),
            ];
            // Only watch a socket we need: a closed one reports HUP whether asked or not, and a
            // neighbour that finished and exited is no error while we have nothing for it.
            let mut fds = [
                PollFd::new(&self.left, wanted[0]),
                PollFd::new(&self.right, wanted[1]),
            ];
            let watched = match (wanted[0].is_empty(), wanted[1].is_empty()) {
                (false, false) => &mut fds[..],
                (false, true) => &mut fds[..1],
                (true, _) => &mut fds[1..],
            };
            let mut left_tm = self.timeout - waited;
            if held_back {
                left_tm = left_tm.min(Duration::from_millis(1));
            }
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
            let ready = |i: usize| !wanted[i].is_empty() && !fds[i].revents().is_empty();
            let (left_ready, right_ready) = (ready(0), ready(1));
            if right_ready && want_send && self.write_flow(op, flow)? {
                last_progress = Instant::now();
            }
            let readable = match from {
                Side::Left => left_ready,
                Side::Right => right_ready,
            };
            if want_recv && readable && self.read(op, flow, from)? {
                last_progress = Instant::now();
            }
        }
    }

    fn socket(&self, side: Side) -> (&UnixStream, usize) {
        match side {
            Side::Left => (&self.left, self.left_rank),
            Side::Right => (&self.right, self.right_rank),
        }
    }

    /// Writes what the socket takes of `bytes`: `Ok(None)` if it takes nothing now.
    fn write(&mut self, op: &'static str, side: Side, bytes: &[u8]) -> Result<Option<usize>> {
        let (socket, rank) = self.socket(side);
        let piece = &bytes[..bytes.len().min(PIECE)];
        match send(socket, piece, SendFlags::NOSIGNAL) {
            Ok(n) => {
                self.bytes_sent += n as u64;
                Ok(Some(n))
            }
            Err(Errno::AGAIN | Errno::INTR) => Ok(None),
            Err(Errno::PIPE | Errno::CONNRESET) => Err(self.peer_exited(op, side == Side::Left)),
            Err(e) => Err(CollectiveError::io(
                format!("{op}: send to rank {rank}"),
                e.into(),
            )),
        }
    }

    fn write_flow(&mut self, op: &'static str, flow: &mut dyn Flow) -> Result<bool> {
        let written = self.write(op, Side::Right, flow.pending())?;
        if let Some(n) = written {
            flow.sent(n);
        }
        Ok(written.is_some())
    }

    /// Reads what the socket `from` has into the flow: whether any byte came.
    fn read(&mut self, op: &'static str, flow: &mut dyn Flow, from: Side) -> Result<bool> {
        let left = from == Side::Left;
        let (mut socket, rank) = self.socket(from);
        let space = flow.space();
        let len = space.len().min(PIECE);
        match socket.read(&mut space[..len]) {
            Ok(0) => Err(self.peer_exited(op, left)),
            Ok(n) => {
                flow.received(n);
                Ok(true)
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                Ok(false)
            }
            Err(e) if e.kind() == ErrorKind::ConnectionReset => Err(self.peer_exited(op, left)),
            Err(e) => Err(CollectiveError::io(
                format!("{op}: receive from rank {rank}"),
                e,
            )),
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

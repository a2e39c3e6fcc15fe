//! A connection's point-to-point messages, written by a thread of their own.
//!
//! A send hands its frame to the connection's writer and returns. The writer writes it
//! whenever the peer reads, while this rank computes. Written only from inside the
//! communicator's calls, a message larger than the socket's buffers would stop halfway
//! until the sender's next call. A pipeline stage that sends an activation and then
//! computes for a second would hold the next stage idle for that second, and the pipeline
//! would run its stages one after the other (measured: 47% idle against the simulator's
//! 11%, on the capstone at pp 2).
//!
//! The collectives send on the right connection too. A collective's header goes out only
//! once the right writer has written every message queued before it ([`Drained`]), while
//! the rank reads its left neighbour's messages into its inbox. So the messages come
//! first on the connection, and neighbours that both wait for their writers still read
//! each other's messages: the wait cannot deadlock.

use std::collections::VecDeque;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::io::Errno;
use rustix::net::{SendFlags, send};

use super::link::PIECE;
use crate::error::{CollectiveError, Result};

/// Why a writer stopped.
#[derive(Clone, Debug)]
enum Failure {
    /// The peer closed its end or exited.
    PeerExited,
    /// The peer read nothing for the communicator's timeout.
    Timeout,
    /// Another error of the operating system.
    Io(String),
}

#[derive(Debug, Default)]
struct State {
    queue: VecDeque<Vec<u8>>,
    /// A message taken off the queue and not yet written whole.
    writing: bool,
    stop: bool,
    failure: Option<Failure>,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    /// The writer waits here for a message, or to stop.
    work: Condvar,
    /// Callers wait here for the queue to empty.
    idle: Condvar,
    bytes_sent: std::sync::atomic::AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A writer never panics while it holds the lock; a poisoned lock still holds state.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A view of a writer for a flow to ask whether it is done, without borrowing the link.
#[derive(Clone, Debug)]
pub(crate) struct Drained(Arc<Shared>);

impl Drained {
    /// Whether every message queued so far is written (also when the writer failed: the
    /// link reports that failure).
    pub(crate) fn done(&self) -> bool {
        let state = self.0.lock();
        state.failure.is_some() || (state.queue.is_empty() && !state.writing)
    }
}

/// The writer of one connection.
#[derive(Debug)]
pub(crate) struct Writer {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// The rank at the other end, for errors.
    peer: usize,
    timeout: Duration,
}

impl Writer {
    /// A writer of `socket` (a clone of the connection's, non-blocking), to rank `peer`.
    ///
    /// # Errors
    /// [`CollectiveError::Io`] if the thread cannot start.
    pub(crate) fn start(socket: UnixStream, peer: usize, timeout: Duration) -> Result<Self> {
        let shared = Arc::new(Shared::default());
        let thread = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("ring-send-{peer}"))
                .spawn(move || run(&socket, &shared, timeout))
                .map_err(|e| CollectiveError::io("start a connection's writer", e))?
        };
        Ok(Self {
            shared,
            thread: Some(thread),
            peer,
            timeout,
        })
    }

    /// Queues a message.
    ///
    /// # Errors
    /// The failure of an earlier message (the peer exited, or read nothing for the timeout).
    pub(crate) fn push(&self, op: &'static str, message: Vec<u8>) -> Result<()> {
        let mut state = self.shared.lock();
        if let Some(failure) = &state.failure {
            return Err(self.error(op, failure.clone()));
        }
        state.queue.push_back(message);
        self.shared.work.notify_one();
        Ok(())
    }

    /// Waits until every message queued so far is written.
    ///
    /// # Errors
    /// The failure of a message; [`CollectiveError::Timeout`] if the peer read nothing for
    /// the communicator's timeout.
    pub(crate) fn drained(&self, op: &'static str) -> Result<()> {
        let mut state = self.shared.lock();
        let mut written = self.bytes_sent();
        let mut progress_at = Instant::now();
        loop {
            if let Some(failure) = &state.failure {
                return Err(self.error(op, failure.clone()));
            }
            if state.queue.is_empty() && !state.writing {
                return Ok(());
            }
            // The timeout counts from the last byte written, as the ring's does.
            let now = self.bytes_sent();
            if now != written {
                (written, progress_at) = (now, Instant::now());
            }
            if progress_at.elapsed() >= self.timeout {
                return Err(self.error(op, Failure::Timeout));
            }
            state = (self
                .shared
                .idle
                .wait_timeout(state, Duration::from_millis(50)))
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0;
        }
    }

    /// A view that says when the queue has drained.
    pub(crate) fn watch(&self) -> Drained {
        Drained(Arc::clone(&self.shared))
    }

    /// The failure of a message, if one failed.
    ///
    /// # Errors
    /// That failure, as the error of `op`.
    pub(crate) fn check(&self, op: &'static str) -> Result<()> {
        match self.shared.lock().failure.clone() {
            Some(failure) => Err(self.error(op, failure)),
            None => Ok(()),
        }
    }

    /// Bytes written so far.
    pub(crate) fn bytes_sent(&self) -> u64 {
        self.shared
            .bytes_sent
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    fn error(&self, op: &'static str, failure: Failure) -> CollectiveError {
        match failure {
            Failure::PeerExited => CollectiveError::PeerExited {
                rank: self.peer,
                op,
            },
            Failure::Timeout => CollectiveError::Timeout {
                op,
                peer: self.peer,
                bound: self.timeout,
            },
            Failure::Io(what) => CollectiveError::io(
                format!("{op}: send to rank {}", self.peer),
                std::io::Error::other(what),
            ),
        }
    }
}

impl Drop for Writer {
    /// Lets the writer finish what is queued (it stops at the timeout if the peer reads
    /// nothing, or at once if the connection is shut), then joins it.
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.work.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The writer's loop: each queued message written whole, in order.
fn run(socket: &UnixStream, shared: &Shared, timeout: Duration) {
    loop {
        let message = {
            let mut state = shared.lock();
            loop {
                if let Some(message) = state.queue.pop_front() {
                    state.writing = true;
                    break message;
                }
                if state.stop || state.failure.is_some() {
                    return;
                }
                state =
                    (shared.work.wait(state)).unwrap_or_else(std::sync::PoisonError::into_inner);
            }
        };
        let outcome = write_all(socket, &message, shared, timeout);
        let mut state = shared.lock();
        state.writing = false;
        if let Err(failure) = outcome {
            state.failure = Some(failure);
            state.queue.clear();
        }
        shared.idle.notify_all();
        if state.failure.is_some() {
            return;
        }
    }
}

/// Writes `bytes` to the non-blocking `socket`, waiting for room with `poll`.
fn write_all(
    socket: &UnixStream,
    bytes: &[u8],
    shared: &Shared,
    timeout: Duration,
) -> std::result::Result<(), Failure> {
    let mut done = 0;
    let mut progress_at = Instant::now();
    while done < bytes.len() {
        let piece = &bytes[done..bytes.len().min(done + PIECE)];
        match send(socket, piece, SendFlags::NOSIGNAL) {
            Ok(n) => {
                done += n;
                shared
                    .bytes_sent
                    .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
                progress_at = Instant::now();
                continue;
            }
            Err(Errno::AGAIN | Errno::INTR) => {}
            Err(Errno::PIPE | Errno::CONNRESET) => return Err(Failure::PeerExited),
            Err(e) => return Err(Failure::Io(e.to_string())),
        }
        let left = (progress_at + timeout).saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Failure::Timeout);
        }
        let wait = Timespec {
            tv_sec: left.as_secs() as _,
            tv_nsec: left.subsec_nanos() as _,
        };
        let mut fds = [PollFd::new(socket, PollFlags::OUT)];
        match poll(&mut fds, Some(&wait)) {
            Ok(_) | Err(Errno::INTR) => {}
            Err(e) => return Err(Failure::Io(e.to_string())),
        }
        if fds[0].revents().intersects(PollFlags::HUP | PollFlags::ERR) {
            return Err(Failure::PeerExited);
        }
    }
    Ok(())
}

//! The listener's side of forming the ring: every connection to a rank's socket served at
//! once by one `poll` loop, each through the listener's side of the
//! [handshake](super::handshake), until the left neighbour has passed it.
//!
//! Served one at a time, with 2 s each for a greeting, 8 connections that said nothing
//! pushed the start past a 10 s timeout; served together, a stranger that says nothing
//! delays nobody.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec, poll};

use super::handshake::{
    ACCEPTED, CHALLENGE_LEN, HELLO_LEN, Hello, NONCE_LEN, Role, Transcript, nonce,
};
use crate::env::RingConfig;
use crate::error::{CollectiveError, Result};

/// How long one connection may take over its handshake before it is refused.
const HANDSHAKE_BOUND: Duration = Duration::from_secs(2);
/// Connections served at once; past this the oldest silent one is refused, so that a flood
/// of strangers cannot exhaust the rank's file descriptors.
const MAX_PENDING: usize = 64;

/// Serves every connection to this rank's socket at once until the left neighbour has
/// passed the handshake: `Ok(None)` if the dialler failed first (its error is the one to
/// report).
pub(super) fn accept_left(
    config: &RingConfig,
    listener: &UnixListener,
    path: &Path,
    left_rank: usize,
    deadline: Instant,
    dial_failed: &AtomicBool,
    refused: &mut Vec<String>,
) -> Result<Option<UnixStream>> {
    listener
        .set_nonblocking(true)
        .map_err(|e| CollectiveError::io("listen", e))?;
    let mut pending: Vec<Incoming> = Vec::new();
    let mut refuse = |reason: String| {
        eprintln!(
            "tl-collective: rank {} refused a connection on {}: {reason}",
            config.rank,
            path.display()
        );
        refused.push(reason);
    };
    loop {
        if dial_failed.load(Ordering::SeqCst) {
            return Ok(None);
        }
        loop {
            match listener.accept() {
                Ok((stream, _)) => {
                    stream
                        .set_nonblocking(true)
                        .map_err(|e| CollectiveError::io("accept", e))?;
                    // Read its hello at once if it came with the connection, as a rank's
                    // does: then it is no longer silent, and never the one dropped below.
                    let mut incoming = Incoming::new(stream);
                    match incoming.advance(config, left_rank) {
                        Progress::Waiting => pending.push(incoming),
                        Progress::Refused(reason) => refuse(reason),
                        // Its proof came back within this same call: a quick neighbour.
                        Progress::Accepted => return Ok(Some(incoming.stream)),
                    }
                    if pending.len() > MAX_PENDING {
                        // The oldest that has said nothing yet: never a neighbour part-way
                        // through its handshake.
                        let silent = pending.iter().position(Incoming::silent).unwrap_or(0);
                        pending.remove(silent);
                        refuse("too many connections at once".into());
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    let context = format!("accept on {}", path.display());
                    return Err(CollectiveError::io(context, e));
                }
            }
        }
        let mut i = 0;
        while i < pending.len() {
            match pending[i].advance(config, left_rank) {
                Progress::Accepted => return Ok(Some(pending.swap_remove(i).stream)),
                Progress::Refused(reason) => {
                    pending.remove(i);
                    refuse(reason);
                }
                Progress::Waiting if pending[i].since.elapsed() >= HANDSHAKE_BOUND => {
                    pending.remove(i);
                    refuse(format!(
                        "no handshake within {} s",
                        HANDSHAKE_BOUND.as_secs()
                    ));
                }
                Progress::Waiting => i += 1,
            }
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(match refused.last() {
                Some(reason) => CollectiveError::Refused {
                    path: path.to_path_buf(),
                    reason: reason.clone(),
                },
                None => CollectiveError::Timeout {
                    op: "accept the left neighbour",
                    peer: left_rank,
                    bound: config.timeout,
                },
            });
        }
        // Short waits: the dialler's failure is noticed and the bounds kept within 50 ms.
        let wait = (deadline - now).min(Duration::from_millis(50));
        let timeout = Timespec {
            tv_sec: 0,
            tv_nsec: wait.subsec_nanos() as _,
        };
        let mut fds: Vec<PollFd<'_>> = std::iter::once(PollFd::new(listener, PollFlags::IN))
            .chain(
                pending
                    .iter()
                    .map(|p| PollFd::new(&p.stream, PollFlags::IN)),
            )
            .collect();
        // An interrupted or failed poll only means we look again.
        let _ = poll(&mut fds, Some(&timeout));
    }
}

/// A connection to this rank's socket, part-way through the listener's side of the
/// handshake.
struct Incoming {
    stream: UnixStream,
    since: Instant,
    /// Bytes of the message under way.
    got: Vec<u8>,
    /// Once the hello is in: what the dialler's answer must cover.
    transcript: Option<Transcript>,
}

/// Where a connection's handshake stands.
enum Progress {
    Waiting,
    Accepted,
    Refused(String),
}

impl Incoming {
    fn new(stream: UnixStream) -> Self {
        Incoming {
            stream,
            since: Instant::now(),
            got: Vec::with_capacity(HELLO_LEN),
            transcript: None,
        }
    }

    /// Whether nothing has arrived on it yet.
    fn silent(&self) -> bool {
        self.got.is_empty() && self.transcript.is_none()
    }

    /// Reads what has arrived (without blocking) and answers it.
    fn advance(&mut self, config: &RingConfig, left_rank: usize) -> Progress {
        loop {
            let want = if self.transcript.is_some() {
                NONCE_LEN
            } else {
                HELLO_LEN
            };
            if self.got.len() < want {
                let mut chunk = [0u8; HELLO_LEN];
                match self.stream.read(&mut chunk[..want - self.got.len()]) {
                    Ok(0) => return Progress::Refused("closed during the handshake".into()),
                    Ok(k) => self.got.extend_from_slice(&chunk[..k]),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return Progress::Waiting,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Progress::Refused(format!("handshake failed ({e})")),
                }
                continue;
            }
            let done = match self.transcript {
                None => self.challenge(config, left_rank).map(|()| false),
                Some(transcript) => self.check_answer(config, &transcript).map(|()| true),
            };
            match done {
                Err(reason) => return Progress::Refused(reason),
                Ok(true) => return Progress::Accepted,
                Ok(false) => {}
            }
        }
    }

    /// Checks the hello and sends the listener's challenge and answer.
    fn challenge(
        &mut self,
        config: &RingConfig,
        left_rank: usize,
    ) -> std::result::Result<(), String> {
        let hello = Hello::decode(self.got[..].try_into().expect("a whole hello"))?;
        let expected = (left_rank as u64, config.world_size as u64);
        if (hello.rank, hello.world_size) != expected {
            return Err(format!(
                "claims rank {} of {}, expected rank {left_rank} of {}",
                hello.rank, hello.world_size, config.world_size
            ));
        }
        let transcript = Transcript {
            dialler: hello.rank,
            listener: config.rank as u64,
            world_size: hello.world_size,
            dialler_nonce: hello.nonce,
            listener_nonce: nonce().map_err(|e| e.to_string())?,
        };
        let mut challenge = [0u8; CHALLENGE_LEN];
        challenge[..NONCE_LEN].copy_from_slice(&transcript.listener_nonce);
        challenge[NONCE_LEN..].copy_from_slice(&transcript.answer(&config.secret, Role::Listener));
        // A fresh connection's send buffer takes these 64 bytes at once.
        match self.stream.write(&challenge) {
            Ok(CHALLENGE_LEN) => {}
            other => return Err(format!("could not send the challenge ({other:?})")),
        }
        self.got.clear();
        self.transcript = Some(transcript);
        Ok(())
    }

    /// Checks the dialler's answer and accepts it.
    fn check_answer(
        &self,
        config: &RingConfig,
        transcript: &Transcript,
    ) -> std::result::Result<(), String> {
        if !transcript.verify(&config.secret, Role::Dialler, &self.got) {
            return Err("wrong secret".into());
        }
        match (&self.stream).write(&[ACCEPTED]) {
            Ok(1) => {}
            other => return Err(format!("could not accept ({other:?})")),
        }
        Ok(())
    }
}

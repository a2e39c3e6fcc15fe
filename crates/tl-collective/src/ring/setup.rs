//! Forming the ring: each rank listens on `<rendezvous>/rank-<r>.sock`, dials its right
//! neighbour's socket and accepts its left neighbour's connection.
//!
//! The rendezvous directory must be the user's own and writable by nobody else (see
//! [`rendezvous`](super::rendezvous)), and each connection opens with a challenge–response on
//! the run's secret (see [`handshake`](super::handshake)): a stray process, or a rank of
//! another run pointed at the wrong directory, is closed unread (and reported on stderr and in
//! [`RingComm::refused`](crate::RingComm::refused)), and a rank never dials on into a
//! listener that cannot prove it knows the secret.
//!
//! Dialling and accepting run at once (the dialler on its own thread): each rank's
//! handshake waits on its right neighbour while that neighbour's own handshake waits on the
//! rank after it, around the ring. Accepting serves every pending connection together (see
//! `accept.rs`).

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::sleep;
use std::time::{Duration, Instant};

use super::accept::accept_left;
use super::handshake::{ACCEPTED, CHALLENGE_LEN, Hello, NONCE_LEN, Role, Transcript, nonce};
use super::rendezvous::{self, socket_path};
use crate::env::RingConfig;
use crate::error::{CollectiveError, Result};
use crate::ring::link::Link;

/// Forms the ring described by `config`; returns the rank's link and the refusals met.
pub(crate) fn connect(config: &RingConfig) -> Result<(Link, Vec<String>)> {
    let n = config.world_size;
    let rank = config.rank;
    rendezvous::check(&config.rendezvous)?;
    rendezvous::check_socket_paths(&config.rendezvous, n)?;
    let deadline = Instant::now() + config.timeout;
    let own = socket_path(&config.rendezvous, rank);
    let listener = UnixListener::bind(&own)
        .map_err(|e| CollectiveError::io(format!("listen on {}", own.display()), e))?;
    let right_rank = (rank + 1) % n;
    let left_rank = (rank + n - 1) % n;

    let dial_failed = Arc::new(AtomicBool::new(false));
    let dialler = {
        let (config, failed) = (config.clone(), Arc::clone(&dial_failed));
        std::thread::Builder::new()
            .name(format!("ring-dial-{rank}"))
            .spawn(move || {
                let outcome = dial_right(&config, right_rank, deadline);
                failed.store(outcome.is_err(), Ordering::SeqCst);
                outcome
            })
            .map_err(|e| CollectiveError::io("start the ring's dialling thread", e))?
    };
    let mut refused = Vec::new();
    let left = accept_left(
        config,
        &listener,
        &own,
        left_rank,
        deadline,
        &dial_failed,
        &mut refused,
    );
    // Nobody else may connect once the ring is formed (or failed to).
    let _ = std::fs::remove_file(&own);
    // On an accepting failure the dialler is left to end by itself, by the deadline.
    let left = left?;
    let right = dialler
        .join()
        .map_err(|_| CollectiveError::io("dial the right neighbour", ErrorKind::Other.into()))?;
    let (left, right) = match (left, right) {
        (Some(left), Ok(right)) => (left, right),
        (_, Err(e)) => return Err(e),
        (None, Ok(_)) => unreachable!("accepting stops early only when dialling failed"),
    };
    for stream in [&left, &right] {
        stream
            .set_nonblocking(true)
            .and_then(|()| stream.set_read_timeout(None))
            .map_err(|e| CollectiveError::io("set the ring's sockets non-blocking", e))?;
    }
    let link = Link::new((left, left_rank), (right, right_rank), config.timeout)?;
    Ok((link, refused))
}

/// Dials the right neighbour and runs the dialler's side of the handshake.
fn dial_right(config: &RingConfig, right_rank: usize, deadline: Instant) -> Result<UnixStream> {
    let path = socket_path(&config.rendezvous, right_rank);
    let timeout = |op| CollectiveError::Timeout {
        op,
        peer: right_rank,
        bound: config.timeout,
    };
    let mut stream = loop {
        match UnixStream::connect(&path) {
            Ok(stream) => break stream,
            // The neighbour has not bound its socket yet.
            Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::ConnectionRefused) => {
                if Instant::now() >= deadline {
                    return Err(timeout("connect to the right neighbour"));
                }
                sleep(Duration::from_millis(2));
            }
            Err(e) => {
                let context = format!("connect to {}", path.display());
                return Err(CollectiveError::io(context, e));
            }
        }
    };
    let hello = Hello {
        rank: config.rank as u64,
        world_size: config.world_size as u64,
        nonce: nonce()?,
    };
    stream
        .write_all(&hello.encode())
        .map_err(|e| CollectiveError::io(format!("greet rank {right_rank}"), e))?;
    let mut challenge = [0u8; CHALLENGE_LEN];
    read_by(&mut stream, &mut challenge, deadline, right_rank)
        .map_err(|e| e.unwrap_or_else(|| timeout("wait for the right neighbour's challenge")))?;
    let transcript = Transcript {
        dialler: hello.rank,
        listener: right_rank as u64,
        world_size: hello.world_size,
        dialler_nonce: hello.nonce,
        listener_nonce: challenge[..NONCE_LEN].try_into().expect("32 bytes"),
    };
    if !transcript.verify(&config.secret, Role::Listener, &challenge[NONCE_LEN..]) {
        return Err(CollectiveError::Refused {
            path,
            reason: format!(
                "the listener did not prove it knows the run's secret: it is not rank \
                 {right_rank} of this run, and was told nothing"
            ),
        });
    }
    stream
        .write_all(&transcript.answer(&config.secret, Role::Dialler))
        .map_err(|e| CollectiveError::io(format!("answer rank {right_rank}"), e))?;
    let mut byte = [0u8];
    read_by(&mut stream, &mut byte, deadline, right_rank)
        .map_err(|e| e.unwrap_or_else(|| timeout("wait for the right neighbour to accept")))?;
    if byte[0] != ACCEPTED {
        return Err(CollectiveError::PeerExited {
            rank: right_rank,
            op: "forming the ring (unexpected reply)",
        });
    }
    Ok(stream)
}

/// Fills `buf` from `stream` by `deadline`: `Err(None)` when the deadline passed.
fn read_by(
    stream: &mut UnixStream,
    buf: &mut [u8],
    deadline: Instant,
    peer: usize,
) -> std::result::Result<(), Option<CollectiveError>> {
    let left = deadline.saturating_duration_since(Instant::now());
    stream
        .set_read_timeout(Some(left.max(Duration::from_millis(1))))
        .and_then(|()| stream.read_exact(buf))
        .map_err(|e| match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => None,
            ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset => {
                Some(CollectiveError::PeerExited {
                    rank: peer,
                    op: "forming the ring (our greeting was refused, or the neighbour exited)",
                })
            }
            _ => Some(CollectiveError::io(
                format!("handshake with rank {peer}"),
                e,
            )),
        })
}

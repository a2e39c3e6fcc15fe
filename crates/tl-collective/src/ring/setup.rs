//! Forming the ring: each rank listens on `<rendezvous>/rank-<r>.sock`, connects to its right
//! neighbour's socket and accepts its left neighbour's connection.
//!
//! The rendezvous directory is made 0700 by the launcher, so only the user's own processes
//! can reach the sockets; on top of that, a connection must open with the run's secret and
//! the rank it claims to be, or it is closed unread (and reported on stderr and in
//! [`RingComm::refused`](crate::RingComm::refused)): a stray process of the same user, or a
//! rank of another run pointed at the wrong directory, never gets its bytes read as data.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec, poll};

use crate::env::RingConfig;
use crate::error::{CollectiveError, Result};
use crate::ring::link::Link;

const HELLO_MAGIC: &[u8; 8] = b"TLRING01";
const HELLO_LEN: usize = 8 + 32 + 8 + 8;
const ACCEPTED: u8 = 0xA5;

/// How long a connection may take to present itself before it is refused.
const HELLO_BOUND: Duration = Duration::from_secs(2);

/// The socket path of `rank` in `dir`.
pub fn socket_path(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank}.sock"))
}

/// The bytes a connecting rank sends first.
fn hello(secret: &[u8; 32], rank: usize, world_size: usize) -> [u8; HELLO_LEN] {
    let mut out = [0u8; HELLO_LEN];
    out[..8].copy_from_slice(HELLO_MAGIC);
    out[8..40].copy_from_slice(secret);
    out[40..48].copy_from_slice(&(rank as u64).to_le_bytes());
    out[48..56].copy_from_slice(&(world_size as u64).to_le_bytes());
    out
}

/// Compares without stopping at the first difference, so the time taken says nothing about
/// how much of a guessed secret was right.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Forms the ring described by `config`; returns the rank's link and the refusals met.
pub(crate) fn connect(config: &RingConfig) -> Result<(Link, Vec<String>)> {
    let n = config.world_size;
    let rank = config.rank;
    let deadline = Instant::now() + config.timeout;
    let own = socket_path(&config.rendezvous, rank);
    let listener = UnixListener::bind(&own)
        .map_err(|e| CollectiveError::io(format!("listen on {}", own.display()), e))?;
    let right_rank = (rank + 1) % n;
    let left_rank = (rank + n - 1) % n;

    let right = connect_right(config, right_rank, deadline)?;
    let mut refused = Vec::new();
    let left = accept_left(config, &listener, &own, left_rank, deadline, &mut refused);
    // Nobody else may connect once the ring is formed.
    let _ = std::fs::remove_file(&own);
    let mut left = left?;
    left.write_all(&[ACCEPTED])
        .map_err(|e| CollectiveError::io(format!("accept rank {left_rank}"), e))?;
    await_accepted(&right, right_rank, deadline)?;

    for stream in [&left, &right] {
        stream
            .set_nonblocking(true)
            .map_err(|e| CollectiveError::io("set the ring's sockets non-blocking", e))?;
    }
    let link = Link {
        left,
        right,
        left_rank,
        right_rank,
        timeout: config.timeout,
        bytes_sent: 0,
    };
    Ok((link, refused))
}

fn connect_right(config: &RingConfig, right_rank: usize, deadline: Instant) -> Result<UnixStream> {
    let path = socket_path(&config.rendezvous, right_rank);
    let mut stream = loop {
        match UnixStream::connect(&path) {
            Ok(stream) => break stream,
            // The neighbour has not bound its socket yet.
            Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::ConnectionRefused) => {
                if Instant::now() >= deadline {
                    return Err(CollectiveError::Timeout {
                        op: "connect to the right neighbour",
                        bound: config.timeout,
                    });
                }
                sleep(Duration::from_millis(2));
            }
            Err(e) => {
                return Err(CollectiveError::io(
                    format!("connect to {}", path.display()),
                    e,
                ));
            }
        }
    };
    stream
        .write_all(&hello(&config.secret, config.rank, config.world_size))
        .map_err(|e| CollectiveError::io(format!("greet rank {right_rank}"), e))?;
    Ok(stream)
}

fn accept_left(
    config: &RingConfig,
    listener: &UnixListener,
    path: &Path,
    left_rank: usize,
    deadline: Instant,
    refused: &mut Vec<String>,
) -> Result<UnixStream> {
    listener
        .set_nonblocking(true)
        .map_err(|e| CollectiveError::io("listen", e))?;
    loop {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                let now = Instant::now();
                if now >= deadline {
                    return Err(match refused.last() {
                        Some(reason) => CollectiveError::Refused {
                            path: path.to_path_buf(),
                            reason: reason.clone(),
                        },
                        None => CollectiveError::Timeout {
                            op: "accept the left neighbour",
                            bound: config.timeout,
                        },
                    });
                }
                let wait = (deadline - now).min(Duration::from_millis(100));
                let timeout = Timespec {
                    tv_sec: 0,
                    tv_nsec: wait.subsec_nanos() as _,
                };
                let mut fds = [PollFd::new(listener, PollFlags::IN)];
                // An interrupted or failed poll only means we look again.
                let _ = poll(&mut fds, Some(&timeout));
                continue;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(CollectiveError::io(
                    format!("accept on {}", path.display()),
                    e,
                ));
            }
        };
        match check_hello(config, stream, left_rank) {
            Ok(stream) => return Ok(stream),
            Err(reason) => {
                eprintln!(
                    "tl-collective: rank {} refused a connection on {}: {reason}",
                    config.rank,
                    path.display()
                );
                refused.push(reason);
            }
        }
    }
}

/// Reads and checks a connection's hello; the stream is dropped (closed) unless it passes.
fn check_hello(
    config: &RingConfig,
    mut stream: UnixStream,
    left_rank: usize,
) -> std::result::Result<UnixStream, String> {
    let mut got = [0u8; HELLO_LEN];
    stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_read_timeout(Some(HELLO_BOUND)))
        .and_then(|()| stream.read_exact(&mut got))
        .map_err(|e| format!("no valid greeting ({e})"))?;
    let expected = hello(&config.secret, left_rank, config.world_size);
    if got[..8] != expected[..8] {
        return Err("not a tl-collective ring connection".into());
    }
    if !same_secret(&got[8..40], &expected[8..40]) {
        return Err("wrong secret".into());
    }
    if got[40..] != expected[40..] {
        let claimed = u64::from_le_bytes(got[40..48].try_into().expect("8 bytes"));
        let world = u64::from_le_bytes(got[48..56].try_into().expect("8 bytes"));
        return Err(format!(
            "claims rank {claimed} of {world}, expected rank {left_rank} of {}",
            config.world_size
        ));
    }
    stream
        .set_read_timeout(None)
        .map_err(|e| format!("socket option ({e})"))?;
    Ok(stream)
}

fn await_accepted(right: &UnixStream, right_rank: usize, deadline: Instant) -> Result<()> {
    let bound = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    let mut byte = [0u8];
    let mut reader = right;
    reader
        .set_read_timeout(Some(bound))
        .and_then(|()| reader.read_exact(&mut byte))
        .map_err(|e| match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => CollectiveError::Timeout {
                op: "wait for the right neighbour to accept",
                bound,
            },
            ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset => CollectiveError::PeerExited {
                rank: right_rank,
                op: "forming the ring (our greeting was refused, or the neighbour exited)",
            },
            _ => CollectiveError::io(format!("wait for rank {right_rank} to accept"), e),
        })?;
    if byte[0] != ACCEPTED {
        return Err(CollectiveError::PeerExited {
            rank: right_rank,
            op: "forming the ring (unexpected reply)",
        });
    }
    right
        .set_read_timeout(None)
        .map_err(|e| CollectiveError::io("socket option", e))
}

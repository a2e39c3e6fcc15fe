//! What can go wrong in a collective, as one typed error.

use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;

/// Errors of tl-collective.
///
/// A ring collective that fails leaves its communicator unusable (it closes its sockets so
/// that the neighbours learn of it at once instead of waiting for their timeout); every
/// later call returns [`CollectiveError::Closed`]. The MPI backend stays usable after a
/// [`CollectiveError::Mismatch`] (every rank stopped at the header); MPI itself aborts the
/// job on a dead rank.
#[derive(Debug, Error)]
pub enum CollectiveError {
    /// A peer exited, was killed, or closed its end of the connection.
    #[error("rank {rank} {} during {op}", NEIGHBOUR_FAILED[0])]
    PeerExited {
        /// The neighbour whose connection closed (it may itself have stopped because another
        /// rank failed first).
        rank: usize,
        /// The operation under way.
        op: &'static str,
    },
    /// No byte moved for longer than the communicator's timeout.
    #[error(
        "{op} {} for {} ms (the communicator's timeout) waiting for rank {peer}",
        NEIGHBOUR_FAILED[1],
        bound.as_millis()
    )]
    Timeout {
        /// The operation under way.
        op: &'static str,
        /// The neighbour that went silent: the one whose bytes never came (or that never
        /// took ours). It may itself wait for another rank.
        peer: usize,
        /// The timeout that was exceeded.
        bound: Duration,
    },
    /// The ranks called different collectives, on different element types or lengths.
    #[error("ranks disagree on the collective: {}", describe(calls))]
    Mismatch {
        /// What each rank called, indexed by rank.
        calls: Vec<CallHeader>,
    },
    /// A world size of zero, a rank outside it, or a root outside it.
    #[error("invalid {what}: {value} (world size {world_size})")]
    InvalidRank {
        /// Which number is wrong (`rank`, `root`, `world size`).
        what: &'static str,
        /// The value given.
        value: usize,
        /// The world size.
        world_size: usize,
    },
    /// Buffers whose lengths do not fit the collective on this rank (for example an
    /// `all_gather` output that is not world-size shards long), or whose element types
    /// differ.
    #[error("{op}: {reason}")]
    BadBuffer {
        /// The operation.
        op: &'static str,
        /// What does not fit.
        reason: String,
    },
    /// A shape-only buffer ([`Slice::Shape`](crate::Slice::Shape)) given to a backend that
    /// moves bytes ([`RingComm`](crate::RingComm), `MpiComm`): it has no values to send.
    /// Refused before the call's header is exchanged, so no rank waits on it.
    #[error("{op}: a shape-only buffer has no values to send (only Single and Phantom take one)")]
    ShapeOnly {
        /// The operation.
        op: &'static str,
    },
    /// A [`ReduceOp::SumIn`](crate::ReduceOp::SumIn) of a format that has no sum on the
    /// wire here: the fp8 ones. (NCCL adds fp8 values through fp16 and rounds twice, and
    /// sends one byte each; nothing in tinyllm reduces in fp8, so that is not emulated.)
    /// Refused before the call's header is exchanged on the ring, after it on MPI (so every
    /// rank that makes the same call refuses it alike).
    #[error("{op}: no sum in {format} (only bf16 and fp16 have a 16-bit sum)")]
    UnsupportedReduction {
        /// The operation.
        op: &'static str,
        /// The format asked for.
        format: tl_numerics::Format,
    },
    /// An environment variable that is set but cannot be used.
    #[error("environment variable {name}={value:?}: {reason}")]
    BadEnv {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// What was expected.
        reason: String,
    },
    /// A connection to a rank's socket that did not present the run's secret (or did not
    /// present itself as the expected neighbour). It was closed unread; this error is only
    /// returned when no rightful neighbour connected before the timeout.
    #[error("refused a connection on {}: {reason}", path.display())]
    Refused {
        /// The listening socket.
        path: PathBuf,
        /// What the connection got wrong.
        reason: String,
    },
    /// A rendezvous directory where a stranger could listen in a rank's place: another
    /// user's, or one that others can write.
    #[error(
        "rendezvous directory {} (mode {mode:04o}, owner uid {owner}): {reason}",
        path.display()
    )]
    UnsafeRendezvous {
        /// The directory.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
        /// Its owner's user id.
        owner: u32,
        /// Why it is refused.
        reason: String,
    },
    /// A rank's socket path longer than Unix sockets allow.
    #[error(
        "socket path {} is {len} bytes, over the {limit}-byte limit of Unix socket paths: set \
         TMPDIR (under tinyllm launch) or TINYLLM_RENDEZVOUS to a shorter directory",
        path.display()
    )]
    SocketPathTooLong {
        /// The longest socket path of the run.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
        /// The longest path allowed.
        limit: usize,
    },
    /// A rank of a launched job failed.
    #[error("rank {rank} failed: {status}{}", others_note(*others))]
    RankFailed {
        /// The rank whose failure most likely ended the job (see
        /// [`LaunchOutcome::first_failure`](crate::launch::LaunchOutcome::first_failure)).
        rank: usize,
        /// Its exit status or signal, as text.
        status: String,
        /// Its exit code, when it exited (rather than being killed or stopped by a signal).
        code: Option<i32>,
        /// How many other ranks failed after it.
        others: usize,
    },
    /// A [`split`](crate::Communicator::split) whose groups do not partition the world: a
    /// group that does not hold the calling rank, names a rank twice or one outside the
    /// world, or ranks that disagree on who is in their group.
    #[error("split into groups: {reason}")]
    BadGroup {
        /// What is wrong, naming the ranks.
        reason: String,
    },
    /// A [`Mesh`](crate::Mesh) whose axes do not fit: an axis of size 0, a product that is
    /// not the world size, a world size that a fixed axis does not divide.
    #[error("device mesh: {reason}")]
    BadMesh {
        /// What is wrong, naming the sizes.
        reason: String,
    },
    /// A point-to-point message to or from a rank the backend has no connection to: the
    /// ring joins each rank to the ranks next to it only (a pipeline's neighbours).
    #[error(
        "{op}: rank {rank} of a ring of {world_size} is joined to ranks {} and {} only, not to \
         rank {peer}",
        (rank + world_size - 1) % world_size,
        (rank + 1) % world_size
    )]
    NotNeighbour {
        /// `send` or `recv`.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The rank asked for.
        peer: usize,
        /// The ring's size.
        world_size: usize,
    },
    /// A point-to-point message that does not fit its receive: another element type or
    /// length than the buffer's, or a peer that began a collective where this rank waits for
    /// its message.
    #[error("the message of rank {from} with tag {tag} does not fit its receive: {reason}")]
    MessageMismatch {
        /// The sender.
        from: usize,
        /// The tag.
        tag: u32,
        /// What differs.
        reason: String,
    },
    /// The communicator was used after an earlier collective failed.
    #[error("the communicator is closed after an earlier error")]
    Closed,
    /// An error of the MPI backend.
    #[error("MPI: {0}")]
    Mpi(String),
    /// An operating-system error, with what was being done.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// What the operating system said.
        source: std::io::Error,
    },
}

/// Words of the errors by which a rank reports that a neighbour, not itself, failed (exited,
/// or went silent): the launcher looks for them in the ranks' error output to blame the rank
/// that failed first rather than the first that noticed.
pub(crate) const NEIGHBOUR_FAILED: [&str; 2] =
    ["exited or closed its connection", "made no progress"];

/// What one rank announced for a collective: every collective starts by exchanging these,
/// so that a disagreement is an error on every rank and never a misread buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallHeader {
    /// The collective's name (`all_reduce_sum`, `broadcast`, ...).
    pub op: &'static str,
    /// `f32` or `f64`.
    pub element: &'static str,
    /// The length that must agree between ranks (the full buffer's length).
    pub len: usize,
    /// The root of a broadcast, 0 otherwise.
    pub root: usize,
    /// How many collectives this rank made before this one.
    pub seq: u64,
}

fn describe(calls: &[CallHeader]) -> String {
    calls
        .iter()
        .enumerate()
        .map(|(rank, c)| {
            format!(
                "rank {rank}: {}<{}>(len {}, root {}) as call #{}",
                c.op, c.element, c.len, c.root, c.seq
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn others_note(others: usize) -> String {
    match others {
        0 => String::new(),
        1 => " (and 1 other rank after it)".to_string(),
        n => format!(" (and {n} other ranks after it)"),
    }
}

impl CollectiveError {
    /// An [`CollectiveError::Io`] with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        CollectiveError::Io {
            context: context.into(),
            source,
        }
    }

    /// A [`CollectiveError::BadBuffer`] for an `op` whose input and output slices hold
    /// different element types.
    pub(crate) fn mismatched_types(
        op: &'static str,
        input: &'static str,
        output: &'static str,
    ) -> Self {
        CollectiveError::BadBuffer {
            op,
            reason: format!("input is {input} but output is {output}"),
        }
    }
}

/// The result of tl-collective's fallible functions.
pub type Result<T> = std::result::Result<T, CollectiveError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_neighbours_failure_reads_as_one_in_the_message() {
        let exited = CollectiveError::PeerExited {
            rank: 2,
            op: "all_reduce_sum",
        };
        let silent = CollectiveError::Timeout {
            op: "all_reduce_sum",
            peer: 2,
            bound: Duration::from_secs(1),
        };
        for error in [exited, silent] {
            let text = error.to_string();
            assert!(
                NEIGHBOUR_FAILED.iter().any(|mark| text.contains(mark)),
                "{text}"
            );
            assert!(text.contains("rank 2"), "{text}");
        }
    }
}

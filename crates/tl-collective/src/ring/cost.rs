//! What one rank of the ring sends for each collective, to the byte: the arithmetic that
//! [`Phantom`](crate::Phantom) counts and planners print, kept beside the ring it describes.
//!
//! The ring splits a buffer of `L` elements into the shards of
//! [`shard_range`](crate::shard_range) (the first `L mod N` one element longer). A
//! reduce-scatter runs `N − 1` steps; at each, rank `r` sends one shard and receives another,
//! and over the steps it sends every shard but its own (`r`). An all-gather sends every shard
//! but the one of its right neighbour (`r + 1`), which that neighbour already holds. An
//! all-reduce is the two in turn. A broadcast relays the whole buffer from the root round the
//! ring: every rank sends it on but the one just before the root. Before its payload every
//! collective all-gathers a [`RING_HEADER_BYTES`]-byte header round the ring (`N − 1` sends),
//! so that ranks whose calls disagree all fail the same way; a barrier is that header alone.
//! A world of one sends nothing at all.
//!
//! So rank `r` sends, for `e` bytes an element on the wire (the element's size, or 2 for a
//! sum in a 16-bit format, [`ReduceOp::wire_bytes`](crate::ReduceOp::wire_bytes)) and shard
//! lengths `s(q)`,
//!
//! ```text
//! reduce-scatter   40(N−1) + e·(L − s(r))
//! all-gather       40(N−1) + e·(L − s(r+1))
//! all-reduce       40(N−1) + e·(2L − s(r) − s(r+1))      ≈ 2(N−1)/N · e·L
//! broadcast        40(N−1) + e·L, or 40(N−1) on the rank before the root (r + 1 = root)
//! barrier          40(N−1)
//! ```

use crate::ring::header::HEADER_LEN;
use crate::shard::shard_range;

/// Bytes of the header each ring collective gathers round the ring, per hop: the length of
/// the header the ring itself encodes.
pub const RING_HEADER_BYTES: u64 = HEADER_LEN as u64;

/// A collective of [`Communicator`](crate::Communicator), as far as its cost on the ring
/// goes: the reduction (sum or max) costs the same bytes, a broadcast's root decides who
/// sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Collective {
    /// [`all_reduce`](crate::Communicator::all_reduce) and the scalar helpers.
    AllReduce,
    /// [`reduce_scatter`](crate::Communicator::reduce_scatter); `elements` is the full input.
    ReduceScatter,
    /// [`all_gather`](crate::Communicator::all_gather); `elements` is the full output.
    AllGather,
    /// [`broadcast`](crate::Communicator::broadcast) from rank `root`.
    Broadcast {
        /// The rank whose buffer every rank receives.
        root: usize,
    },
    /// [`barrier`](crate::Communicator::barrier): the header alone.
    Barrier,
    /// A point-to-point [`send`](crate::Communicator::send) of `elements` to another rank:
    /// its frame header and its values, whatever the world's size.
    Send,
}

/// Bytes rank `rank` of a ring of `world_size` sends for one `collective` over a buffer of
/// `elements` elements of `element_bytes` bytes on the wire, headers included (see the
/// [module docs](self)): exactly what [`RingComm::stats`](crate::Communicator::stats) of
/// that rank grows by when the call succeeds. For a reduction, `element_bytes` is
/// [`ReduceOp::wire_bytes`](crate::ReduceOp::wire_bytes): 2 for a sum in bf16 or fp16,
/// whatever the buffer's element type.
///
/// ```
/// use tl_collective::{Collective, RING_HEADER_BYTES, ring_bytes_sent};
///
/// // 10 floats over 4 ranks (shards 3, 3, 2, 2): rank 0 sends all but shards 0 and 1,
/// // 2·10 − 3 − 3 = 14 floats, and three 40-byte headers.
/// assert_eq!(ring_bytes_sent(Collective::AllReduce, 10, 4, 4, 0), 3 * 40 + 14 * 4);
/// // Rank 3 is just before root 0: it sends the headers only.
/// let broadcast = Collective::Broadcast { root: 0 };
/// assert_eq!(ring_bytes_sent(broadcast, 10, 4, 4, 3), 3 * RING_HEADER_BYTES);
/// assert_eq!(ring_bytes_sent(Collective::AllGather, 10, 4, 1, 0), 0);
/// ```
///
/// # Panics
/// If `world_size` is 0, `rank` or a broadcast's root is not below it, or `elements` does
/// not fit a `usize` (only on targets narrower than 64 bits).
pub fn ring_bytes_sent(
    collective: Collective,
    elements: u64,
    element_bytes: u64,
    world_size: usize,
    rank: usize,
) -> u64 {
    assert!(
        rank < world_size,
        "ring_bytes_sent: rank {rank} outside a world of {world_size}"
    );
    if let Collective::Broadcast { root } = collective {
        assert!(
            root < world_size,
            "ring_bytes_sent: root {root} outside a world of {world_size}"
        );
    }
    let len = usize::try_from(elements).expect("ring_bytes_sent: elements fit a usize");
    let shard = |q: usize| shard_range(len, world_size, q).len() as u64;
    let right = (rank + 1) % world_size;
    let payload = match collective {
        Collective::ReduceScatter => elements - shard(rank),
        Collective::AllGather => elements - shard(right),
        Collective::AllReduce => 2 * elements - shard(rank) - shard(right),
        Collective::Broadcast { root } if right == root => 0,
        Collective::Broadcast { .. } => elements,
        Collective::Barrier => 0,
        Collective::Send => return RING_HEADER_BYTES + element_bytes * elements,
    };
    RING_HEADER_BYTES * (world_size as u64 - 1) + element_bytes * payload
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_is_forty_bytes_as_the_docs_say() {
        assert_eq!(RING_HEADER_BYTES, 40);
    }

    #[test]
    fn an_all_reduce_sends_two_n_minus_one_over_n_of_the_buffer() {
        // 1000 floats over 4 ranks, shards of 250: 2·750 floats and 3 headers.
        for rank in 0..4 {
            assert_eq!(
                ring_bytes_sent(Collective::AllReduce, 1000, 4, 4, rank),
                3 * 40 + 1500 * 4
            );
        }
    }

    #[test]
    fn uneven_shards_make_ranks_send_different_amounts() {
        // 5 elements over 2 ranks: shards of 3 and 2. Rank 0 owns 3, its neighbour 2.
        let sent = |c, rank| ring_bytes_sent(c, 5, 4, 2, rank);
        assert_eq!(sent(Collective::ReduceScatter, 0), 40 + 2 * 4);
        assert_eq!(sent(Collective::ReduceScatter, 1), 40 + 3 * 4);
        assert_eq!(sent(Collective::AllGather, 0), 40 + 3 * 4);
        assert_eq!(sent(Collective::AllGather, 1), 40 + 2 * 4);
        // All-reduce: 2·5 − 3 − 2 = 5 elements on either rank.
        assert_eq!(sent(Collective::AllReduce, 0), 40 + 5 * 4);
        assert_eq!(sent(Collective::AllReduce, 1), 40 + 5 * 4);
    }

    #[test]
    fn a_broadcast_is_relayed_by_all_but_the_rank_before_the_root() {
        // 7 doubles over 3 ranks from root 1: ranks 1 and 2 send the buffer, rank 0 does not.
        let sent = |rank| ring_bytes_sent(Collective::Broadcast { root: 1 }, 7, 8, 3, rank);
        assert_eq!(sent(0), 2 * 40);
        assert_eq!(sent(1), 2 * 40 + 7 * 8);
        assert_eq!(sent(2), 2 * 40 + 7 * 8);
    }

    #[test]
    fn a_barrier_sends_the_headers_and_a_world_of_one_nothing() {
        assert_eq!(ring_bytes_sent(Collective::Barrier, 0, 4, 5, 2), 4 * 40);
        for collective in [
            Collective::AllReduce,
            Collective::ReduceScatter,
            Collective::AllGather,
            Collective::Broadcast { root: 0 },
            Collective::Barrier,
        ] {
            assert_eq!(ring_bytes_sent(collective, 1000, 8, 1, 0), 0);
        }
    }

    #[test]
    #[should_panic(expected = "root 3 outside a world of 3")]
    fn a_root_outside_the_world_panics() {
        ring_bytes_sent(Collective::Broadcast { root: 3 }, 1, 4, 3, 0);
    }
}

//! What one rank of tl-collective's ring sends for each collective, to the byte.
//!
//! The ring splits a buffer of `L` elements into the shards of
//! [`tl_collective::shard_range`] (the first `L mod N` one element longer). A reduce-scatter
//! runs `N − 1` steps; at each, rank `r` sends one shard and receives another, and over the
//! steps it sends every shard but its own (`r`). An all-gather sends every shard but the one
//! of its right neighbour (`r + 1`), which that neighbour already holds. An all-reduce is the
//! two in turn. Before its payload every collective all-gathers a 40-byte header round the
//! ring (`N − 1` sends of 40 bytes) so that ranks whose calls disagree all fail the same way.
//! A world of one sends nothing at all.
//!
//! So rank `r` sends, for `e`-byte elements and shard lengths `s(q)`,
//!
//! ```text
//! reduce-scatter   40(N−1) + e·(L − s(r))
//! all-gather       40(N−1) + e·(L − s(r+1))
//! all-reduce       40(N−1) + e·(2L − s(r) − s(r+1))      ≈ 2(N−1)/N · e·L
//! ```

use serde::Serialize;
use tl_collective::shard_range;

/// Bytes of the header each collective gathers round the ring, per hop.
pub const RING_HEADER_BYTES: u64 = 40;

/// A collective of tl-collective's [`Communicator`](tl_collective::Communicator).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Collective {
    /// Every rank ends with the elementwise sum of all ranks' buffers.
    AllReduce,
    /// Every rank ends with its shard of the sum.
    ReduceScatter,
    /// Every rank ends with all ranks' shards, concatenated.
    AllGather,
}

impl Collective {
    /// The collective's name, as tables print it.
    pub fn label(self) -> &'static str {
        match self {
            Collective::AllReduce => "all-reduce",
            Collective::ReduceScatter => "reduce-scatter",
            Collective::AllGather => "all-gather",
        }
    }
}

/// Bytes rank `rank` of a ring of `world_size` sends for one `collective` over a buffer of
/// `elements` elements of `element_bytes` bytes, headers included (see the [module
/// docs](self)).
///
/// ```
/// use tl_train::plan::{Collective, ring_bytes_sent};
///
/// // 10 floats over 4 ranks (shards 3, 3, 2, 2): rank 0 sends all but shards 0 and 1,
/// // 2·10 − 3 − 3 = 14 floats, and three 40-byte headers.
/// assert_eq!(ring_bytes_sent(Collective::AllReduce, 10, 4, 4, 0), 3 * 40 + 14 * 4);
/// assert_eq!(ring_bytes_sent(Collective::AllGather, 10, 4, 1, 0), 0);
/// ```
///
/// # Panics
/// If `world_size` is 0 or `rank` is not below it.
pub fn ring_bytes_sent(
    collective: Collective,
    elements: u64,
    element_bytes: u64,
    world_size: usize,
    rank: usize,
) -> u64 {
    assert!(rank < world_size, "rank {rank} outside {world_size}");
    if world_size == 1 {
        return 0;
    }
    let shard = |q: usize| {
        // Shards are at most `elements / N + 1` long: compute them without a usize buffer
        // length when `elements` exceeds usize (never on 64-bit targets).
        shard_range(elements as usize, world_size, q).len() as u64
    };
    let own = shard(rank);
    let right = shard((rank + 1) % world_size);
    let payload = match collective {
        Collective::ReduceScatter => elements - own,
        Collective::AllGather => elements - right,
        Collective::AllReduce => 2 * elements - own - right,
    };
    RING_HEADER_BYTES * (world_size as u64 - 1) + element_bytes * payload
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(
            ring_bytes_sent(Collective::ReduceScatter, 5, 4, 2, 0),
            40 + 2 * 4
        );
        assert_eq!(
            ring_bytes_sent(Collective::ReduceScatter, 5, 4, 2, 1),
            40 + 3 * 4
        );
        assert_eq!(
            ring_bytes_sent(Collective::AllGather, 5, 4, 2, 0),
            40 + 3 * 4
        );
        assert_eq!(
            ring_bytes_sent(Collective::AllGather, 5, 4, 2, 1),
            40 + 2 * 4
        );
    }
}

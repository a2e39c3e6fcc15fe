//! The collectives a plan counts, by the names its tables and JSON print, and what one rank of
//! tl-collective's ring sends for each: the arithmetic is tl-collective's own
//! ([`tl_collective::ring_bytes_sent`], whose docs give the formulas), so that the plan and
//! the ring (and the [`Phantom`](tl_collective::Phantom) that stands for it) share one count.

use serde::Serialize;

/// Bytes of the header each collective gathers round the ring, per hop (tl-collective's).
pub use tl_collective::RING_HEADER_BYTES;

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
    /// A point-to-point message to one rank (a pipeline's activations and gradients).
    Send,
}

impl Collective {
    /// The collective's name, as tables print it.
    pub fn label(self) -> &'static str {
        match self {
            Collective::AllReduce => "all-reduce",
            Collective::ReduceScatter => "reduce-scatter",
            Collective::AllGather => "all-gather",
            Collective::Send => "send",
        }
    }
}

impl From<Collective> for tl_collective::Collective {
    fn from(collective: Collective) -> Self {
        match collective {
            Collective::AllReduce => tl_collective::Collective::AllReduce,
            Collective::ReduceScatter => tl_collective::Collective::ReduceScatter,
            Collective::AllGather => tl_collective::Collective::AllGather,
            Collective::Send => tl_collective::Collective::Send,
        }
    }
}

/// Bytes rank `rank` of a ring of `world_size` sends for one `collective` over a buffer of
/// `elements` elements of `element_bytes` bytes, headers included:
/// [`tl_collective::ring_bytes_sent`] for the plan's collectives.
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
    tl_collective::ring_bytes_sent(collective.into(), elements, element_bytes, world_size, rank)
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

    /// Each collective maps onto its own: with uneven shards the three differ on a rank.
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

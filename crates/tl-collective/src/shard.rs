//! The shard layout of the sharded collectives.

use std::ops::Range;

/// The elements of a buffer of `len` elements that rank `rank` of `world_size` owns in
/// [`reduce_scatter`](crate::Communicator::reduce_scatter) and
/// [`all_gather`](crate::Communicator::all_gather): contiguous shards in rank order, the
/// first `len % world_size` of them one element longer, so shards differ by at most one
/// element (and some are empty when `len < world_size`).
///
/// ```
/// use tl_collective::shard_range;
///
/// // 10 elements over 4 ranks: 3 + 3 + 2 + 2.
/// let shards: Vec<_> = (0..4).map(|rank| shard_range(10, 4, rank)).collect();
/// assert_eq!(shards, [0..3, 3..6, 6..8, 8..10]);
/// assert_eq!(shard_range(2, 4, 3), 2..2);
/// ```
///
/// # Panics
/// If `world_size` is 0 or `rank >= world_size` (a communicator never has such ranks).
pub fn shard_range(len: usize, world_size: usize, rank: usize) -> Range<usize> {
    assert!(
        rank < world_size,
        "shard_range: rank {rank} outside a world of {world_size}"
    );
    let base = len / world_size;
    let longer = len % world_size;
    let start = rank * base + rank.min(longer);
    let end = start + base + usize::from(rank < longer);
    start..end
}

/// Two disjoint parts of `data`: one to read, one to write.
pub(crate) fn split_pair<T>(
    data: &mut [T],
    read: Range<usize>,
    write: Range<usize>,
) -> (&[T], &mut [T]) {
    if read.end <= write.start {
        let (low, high) = data.split_at_mut(write.start);
        (&low[read], &mut high[..write.len()])
    } else {
        debug_assert!(write.end <= read.start, "ring ranges overlap");
        let (low, high) = data.split_at_mut(read.start);
        (&high[..read.len()], &mut low[write])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn shards_tile_the_buffer_and_differ_by_at_most_one(
            len in 0usize..10_000,
            world_size in 1usize..17,
        ) {
            let shards: Vec<_> = (0..world_size).map(|r| shard_range(len, world_size, r)).collect();
            prop_assert_eq!(shards[0].start, 0);
            prop_assert_eq!(shards[world_size - 1].end, len);
            for pair in shards.windows(2) {
                prop_assert_eq!(pair[0].end, pair[1].start);
            }
            let longest = shards.iter().map(|s| s.len()).max().unwrap();
            let shortest = shards.iter().map(|s| s.len()).min().unwrap();
            prop_assert!(longest - shortest <= 1);
            // The longer shards come first.
            for pair in shards.windows(2) {
                prop_assert!(pair[0].len() >= pair[1].len());
            }
        }
    }

    #[test]
    #[should_panic(expected = "outside a world")]
    fn rank_outside_the_world_panics() {
        shard_range(4, 2, 2);
    }
}

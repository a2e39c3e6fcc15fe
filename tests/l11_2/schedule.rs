//! The schedule: which shard each rank sends and receives at each step (§2, §3).

use tl_collective::{all_gather_step, reduce_scatter_step, shard_range};

/// Each rank's `(send, receive)` at every step of a phase.
fn table(
    n: usize,
    step: impl Fn(usize, usize, usize) -> (usize, usize),
) -> Vec<Vec<(usize, usize)>> {
    (0..n.saturating_sub(1))
        .map(|k| (0..n).map(|r| step(r, k, n)).collect())
        .collect()
}

#[test]
fn test_three_ranks_schedule_by_hand() {
    // §3's tables: reduce-scatter step 0 has ranks 0, 1, 2 send shards 2, 0, 1 and receive
    // 1, 2, 0; step 1 sends 1, 2, 0 and receives 0, 1, 2.
    assert_eq!(
        table(3, reduce_scatter_step),
        [vec![(2, 1), (0, 2), (1, 0)], vec![(1, 0), (2, 1), (0, 2)]]
    );
    // All-gather: step 0 sends each rank's own shard.
    assert_eq!(
        table(3, all_gather_step),
        [vec![(0, 2), (1, 0), (2, 1)], vec![(2, 1), (0, 2), (1, 0)]]
    );
}

#[test]
fn test_four_ranks_rank_0_sends_3_2_1_then_0_3_2() {
    let sends = |step: fn(usize, usize, usize) -> (usize, usize)| -> Vec<usize> {
        (0..3).map(|k| step(0, k, 4).0).collect()
    };
    assert_eq!(sends(reduce_scatter_step), [3, 2, 1]);
    assert_eq!(sends(all_gather_step), [0, 3, 2]);
}

#[test]
fn test_every_rank_receives_what_its_left_neighbour_sends() {
    for n in 1..=8 {
        for phase in [reduce_scatter_step, all_gather_step] {
            for (k, step) in table(n, phase).iter().enumerate() {
                for r in 0..n {
                    let left = (r + n - 1) % n;
                    assert_eq!(step[r].1, step[left].0, "N = {n}, step {k}, rank {r}");
                }
            }
        }
    }
}

#[test]
fn test_shard_c_ends_at_rank_c() {
    for n in 2..=8 {
        for c in 0..n {
            // The partial sum of shard c leaves rank c + 1 first and reaches rank c last.
            assert_eq!(reduce_scatter_step((c + 1) % n, 0, n).0, c);
            assert_eq!(reduce_scatter_step(c, n - 2, n).1, c);
            // Rank c never sends shard c during the reduce-scatter: it is still collecting.
            assert!((0..n - 1).all(|k| reduce_scatter_step(c, k, n).0 != c));
            // And it starts the all-gather with it, complete.
            assert_eq!(all_gather_step(c, 0, n).0, c);
        }
    }
}

#[test]
fn test_shards_of_unequal_length() {
    // n = 7 over N = 3: 3, 2, 2. n = 2 < N = 3: shard 2 is empty.
    let shards = |n: usize, world: usize| -> Vec<_> {
        (0..world).map(|c| shard_range(n, world, c)).collect()
    };
    assert_eq!(shards(7, 3), [0..3, 3..5, 5..7]);
    assert_eq!(shards(2, 3), [0..1, 1..2, 2..2]);
    assert_eq!(shards(0, 3), [0..0, 0..0, 0..0]);
}

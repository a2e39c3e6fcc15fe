//! The ring's steps (`ring_steps.rs`, the functions L11.2 has a learner write) on their own:
//! the schedule's rules, and the three collectives over a ring of channels against the
//! sequential reference, with the bytes each rank sends. Fast, so that every pitfall of the
//! chapter planted in the steps is caught in seconds.

use std::time::Duration;

use proptest::prelude::*;
use tl_collective::{
    ReduceOp, all_gather_step, on_channel_ring, reduce_scatter_step, reference_all_reduce,
    ring_all_gather, ring_all_reduce, ring_reduce_scatter, shard_range,
};

const TIMEOUT: Duration = Duration::from_secs(20);

/// What one rank ends with, and how many bytes and steps it sent.
struct Ran {
    data: Vec<f32>,
    bytes_sent: u64,
    steps: u64,
}

/// Runs `collective` on each rank's copy of `inputs`, ranks on threads over a ring of
/// channels handing on `piece` elements at a time.
fn on_ring(
    inputs: &[Vec<f32>],
    piece: usize,
    collective: impl Fn(&mut tl_collective::ChannelLink, usize, usize, &mut [f32]) + Sync,
) -> Vec<Ran> {
    let n = inputs.len();
    on_channel_ring(n, piece, TIMEOUT, |link, rank| {
        let mut data = inputs[rank].clone();
        collective(link, rank, n, &mut data);
        Ran {
            data,
            bytes_sent: link.bytes_sent,
            steps: link.steps,
        }
    })
}

/// Rank r's input: element i is (r + 1)·1000 + i, so every sum says who contributed.
fn inputs(n: usize, len: usize) -> Vec<Vec<f32>> {
    (0..n)
        .map(|r| (0..len).map(|i| ((r + 1) * 1000 + i) as f32).collect())
        .collect()
}

fn all_reduce(link: &mut tl_collective::ChannelLink, rank: usize, n: usize, d: &mut [f32]) {
    ring_all_reduce(link, rank, n, d, ReduceOp::Sum).unwrap();
}

#[test]
fn every_rank_receives_what_its_left_neighbour_sends() {
    for n in 1usize..9 {
        for step in 0..n.saturating_sub(1) {
            for r in 0..n {
                let left = (r + n - 1) % n;
                assert_eq!(
                    reduce_scatter_step(r, step, n).1,
                    reduce_scatter_step(left, step, n).0
                );
                assert_eq!(
                    all_gather_step(r, step, n).1,
                    all_gather_step(left, step, n).0
                );
            }
        }
    }
}

#[test]
fn the_last_reduce_step_completes_the_owners_shard_and_the_gather_starts_from_it() {
    for n in 2..9 {
        for r in 0..n {
            assert_eq!(reduce_scatter_step(r, n - 2, n).1, r);
            assert_eq!(all_gather_step(r, 0, n).0, r);
            // Each shard is sent once by each rank in each phase.
            let mut sent: Vec<usize> = (0..n - 1).map(|k| reduce_scatter_step(r, k, n).0).collect();
            sent.sort_unstable();
            sent.dedup();
            assert_eq!(sent.len(), n - 1, "rank {r} of {n}");
            assert!(
                !sent.contains(&r),
                "rank {r} keeps its own shard until it is complete"
            );
        }
    }
}

#[test]
fn the_four_rank_schedule_by_hand() {
    // Rank 1 of 4: reduce-scatter sends shards 0, 3, 2 and receives 3, 2, 1.
    let rs: Vec<_> = (0..3).map(|k| reduce_scatter_step(1, k, 4)).collect();
    assert_eq!(rs, [(0, 3), (3, 2), (2, 1)]);
    let ag: Vec<_> = (0..3).map(|k| all_gather_step(1, k, 4)).collect();
    assert_eq!(ag, [(1, 0), (0, 3), (3, 2)]);
}

#[test]
fn reduce_scatter_leaves_each_owner_its_complete_shard() {
    for n in 1usize..6 {
        for len in [0, 1, n.saturating_sub(1), n, n + 1, 23] {
            let inputs = inputs(n, len);
            let refs: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
            let want = reference_all_reduce(&refs, ReduceOp::Sum);
            let ran = on_ring(&inputs, 2, |link, rank, n, d| {
                ring_reduce_scatter(link, rank, n, d, ReduceOp::Sum).unwrap();
            });
            for (rank, r) in ran.iter().enumerate() {
                let own = shard_range(len, n, rank);
                assert_eq!(
                    r.data[own.clone()],
                    want[own],
                    "rank {rank} of {n}, len {len}"
                );
                assert_eq!(r.steps, n as u64 - 1);
            }
        }
    }
}

#[test]
fn all_gather_fills_every_shard_from_its_owner() {
    for n in 1usize..6 {
        for len in [0, 1, n + 1, 17] {
            let full: Vec<f32> = (0..len).map(|i| i as f32 + 0.5).collect();
            let inputs: Vec<Vec<f32>> = (0..n)
                .map(|rank| {
                    let mut mine = vec![f32::NAN; len];
                    let own = shard_range(len, n, rank);
                    mine[own.clone()].copy_from_slice(&full[own]);
                    mine
                })
                .collect();
            let ran = on_ring(&inputs, 3, |link, rank, n, d| {
                ring_all_gather(link, rank, n, d).unwrap();
            });
            for r in &ran {
                assert_eq!(r.data, full, "{n} ranks, len {len}");
            }
        }
    }
}

#[test]
fn all_reduce_gives_every_rank_the_references_bits_and_sends_the_least() {
    for n in 1usize..6 {
        for len in [0, 1, n.saturating_sub(1), n, n + 1, 40] {
            let inputs = inputs(n, len);
            let refs: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
            let want = reference_all_reduce(&refs, ReduceOp::Sum);
            for piece in [1, 3, 64] {
                let ran = on_ring(&inputs, piece, all_reduce);
                let longest = shard_range(len, n, 0).len();
                for (rank, r) in ran.iter().enumerate() {
                    assert_eq!(
                        r.data, want,
                        "rank {rank} of {n}, len {len}, pieces {piece}"
                    );
                    // 2(N − 1) shards, each at most the longest: 2(N − 1)/N of the buffer.
                    assert!(r.bytes_sent <= (2 * (n - 1) * longest * 4) as u64);
                    assert_eq!(r.steps, 2 * (n as u64 - 1));
                }
                if len % n == 0 {
                    let bound = (2 * (n - 1) * len / n * 4) as u64;
                    assert!(ran.iter().all(|r| r.bytes_sent == bound));
                }
            }
        }
    }
}

#[test]
fn the_order_of_the_sum_is_the_rings_in_bf16() {
    // Rank 1 holds 1 and the others 2^-8 (docs/course/L11.2.md §3.3): where each shard's sum
    // starts decides between 1 and 1.015625.
    let small = 2f32.powi(-8);
    let inputs = vec![vec![small; 4], vec![1.0; 4], vec![small; 4], vec![small; 4]];
    let op = ReduceOp::SumIn(tl_numerics::Format::Bf16);
    let ran = on_ring(&inputs, 1, |link, rank, n, d| {
        ring_all_reduce(link, rank, n, d, op).unwrap();
    });
    for r in &ran {
        assert_eq!(r.data, [1.0, 1.015625, 1.015625, 1.0]);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn any_world_and_length_all_reduces_to_the_reference(
        n in 1usize..6,
        len in 0usize..50,
        piece in 1usize..9,
        seed in any::<u32>(),
    ) {
        let inputs: Vec<Vec<f32>> = (0..n)
            .map(|r| (0..len).map(|i| ((seed as usize + r * 31 + i * 7) % 97) as f32 * 0.37 - 11.0).collect())
            .collect();
        let refs: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
        let want = reference_all_reduce(&refs, ReduceOp::Sum);
        for r in on_ring(&inputs, piece, all_reduce) {
            prop_assert_eq!(&r.data, &want);
        }
    }
}

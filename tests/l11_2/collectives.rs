//! The three collectives on a ring of channels (`tl_collective::channel_ring`): the hand
//! examples of §3 step by step, the reference's bits on every rank, the bytes.

use std::ops::Range;
use std::time::Duration;

use proptest::prelude::*;
use tl_collective::{
    ChannelLink, CollectiveError, Element, ReduceOp, RingLink, on_channel_ring,
    reference_all_reduce, ring_all_gather, ring_all_reduce, ring_reduce_scatter, shard_range,
};
use tl_numerics::Format;

/// What a rank ends with, and what it sent.
struct Ran<T> {
    data: Vec<T>,
    bytes_sent: u64,
}

/// Runs `collective` on every rank's copy of `inputs`, on threads over a ring of channels
/// that hands on `piece` elements at a time.
fn on_ring<T: tl_collective::Element + Send + Sync>(
    inputs: &[Vec<T>],
    piece: usize,
    collective: impl Fn(&mut ChannelLink, usize, usize, &mut [T]) + Sync,
) -> Vec<Ran<T>> {
    let n = inputs.len();
    on_channel_ring(n, piece, Duration::from_secs(20), |link, rank| {
        let mut data = inputs[rank].clone();
        collective(link, rank, n, &mut data);
        Ran {
            data,
            bytes_sent: link.bytes_sent,
        }
    })
}

fn sum(op: ReduceOp) -> impl Fn(&mut ChannelLink, usize, usize, &mut [f32]) + Sync {
    move |link, rank, n, data| ring_all_reduce(link, rank, n, data, op).unwrap()
}

fn reduce_scatter(link: &mut ChannelLink, rank: usize, n: usize, data: &mut [f32]) {
    ring_reduce_scatter(link, rank, n, data, ReduceOp::Sum).unwrap();
}

fn all_gather(link: &mut ChannelLink, rank: usize, n: usize, data: &mut [f32]) {
    ring_all_gather(link, rank, n, data).unwrap();
}

/// A link that lets `steps` exchanges through and fails at the next one, before it sends:
/// every rank stops after the same step, and its buffer shows that step of §3's tables.
struct StopAfter<'a> {
    link: &'a mut ChannelLink,
    steps: usize,
}

impl RingLink for StopAfter<'_> {
    fn exchange<T: Element>(
        &mut self,
        out: &[T],
        into: &mut [T],
        arrived: &mut dyn FnMut(Range<usize>, &[T]),
    ) -> tl_collective::Result<()> {
        if self.steps == 0 {
            return Err(CollectiveError::BadBuffer {
                op: "the test's link",
                reason: "stopped after the step under test".into(),
            });
        }
        self.steps -= 1;
        self.link.exchange(out, into, arrived)
    }
}

/// Each rank's buffer after the first `steps` steps of an all-reduce of `inputs`.
fn after_steps(inputs: &[Vec<f32>], steps: usize) -> Vec<Vec<f32>> {
    on_ring(inputs, 1, |link, rank, n, data| {
        let mut stopping = StopAfter { link, steps };
        let stopped = ring_all_reduce(&mut stopping, rank, n, data, ReduceOp::Sum);
        assert!(stopped.is_err(), "rank {rank} returns the link's error");
    })
    .into_iter()
    .map(|r| r.data)
    .collect()
}

/// Rank r holds `(i + 1)·10^r`: the digits of a sum say who contributed.
fn powers(n: usize, len: usize) -> Vec<Vec<f32>> {
    (0..n)
        .map(|r| {
            (0..len)
                .map(|i| ((i + 1) * 10usize.pow(r as u32)) as f32)
                .collect()
        })
        .collect()
}

#[test]
fn test_hand_example_three_ranks_step_by_step() {
    let inputs = powers(3, 6);
    // §3's tables, row by row: ranks 0, 1 and 2 after each step of the all-reduce.
    assert_eq!(
        after_steps(&inputs, 1),
        [
            [1.0, 2.0, 303.0, 404.0, 5.0, 6.0],
            [10.0, 20.0, 30.0, 40.0, 55.0, 66.0],
            [110.0, 220.0, 300.0, 400.0, 500.0, 600.0],
        ],
        "after reduce-scatter step 0"
    );
    let scattered = [
        [111.0, 222.0, 303.0, 404.0, 5.0, 6.0],
        [10.0, 20.0, 333.0, 444.0, 55.0, 66.0],
        [110.0, 220.0, 300.0, 400.0, 555.0, 666.0],
    ];
    assert_eq!(
        after_steps(&inputs, 2),
        scattered,
        "after reduce-scatter step 1"
    );
    assert_eq!(
        after_steps(&inputs, 3),
        [
            [111.0, 222.0, 303.0, 404.0, 555.0, 666.0],
            [111.0, 222.0, 333.0, 444.0, 55.0, 66.0],
            [110.0, 220.0, 333.0, 444.0, 555.0, 666.0],
        ],
        "after all-gather step 0"
    );
    // The reduce-scatter alone ends as the all-reduce's first two steps did: each rank
    // holds its own shard complete, and the partial sums it forwarded.
    let ran = on_ring(&inputs, 2, reduce_scatter);
    let after: Vec<&[f32]> = ran.iter().map(|r| r.data.as_slice()).collect();
    assert_eq!(after, scattered);
    // The all-reduce: every rank 111 222 333 444 555 666, having sent 8 elements.
    for r in on_ring(&inputs, 1, sum(ReduceOp::Sum)) {
        assert_eq!(r.data, [111.0, 222.0, 333.0, 444.0, 555.0, 666.0]);
        assert_eq!(r.bytes_sent, 8 * 4);
    }
}

#[test]
fn test_hand_example_four_ranks() {
    let inputs = powers(4, 8);
    let ran = on_ring(&inputs, 2, reduce_scatter);
    let owned: Vec<&[f32]> = ran
        .iter()
        .enumerate()
        .map(|(r, ran)| &ran.data[shard_range(8, 4, r)])
        .collect();
    assert_eq!(
        owned,
        [
            &[1111.0, 2222.0][..],
            &[3333.0, 4444.0],
            &[5555.0, 6666.0],
            &[7777.0, 8888.0]
        ]
    );
    for r in on_ring(&inputs, 3, sum(ReduceOp::Sum)) {
        assert_eq!(
            r.data,
            [
                1111.0, 2222.0, 3333.0, 4444.0, 5555.0, 6666.0, 7777.0, 8888.0
            ]
        );
        assert_eq!(r.bytes_sent, 12 * 4, "6 steps × 2 elements = 2 · 3/4 · 8");
    }
}

#[test]
fn test_all_reduce_equals_the_reference_on_every_rank() {
    for n in 1..=8usize {
        for len in [0, 1, n - 1, n, n + 1, 1000] {
            let inputs: Vec<Vec<f32>> = (0..n)
                .map(|r| {
                    (0..len)
                        .map(|i| ((r * 7919 + i * 104_729) % 1013) as f32 / 7.0 - 70.0)
                        .collect()
                })
                .collect();
            let refs: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
            let want = reference_all_reduce(&refs, ReduceOp::Sum);
            for (rank, r) in on_ring(&inputs, 5, sum(ReduceOp::Sum)).iter().enumerate() {
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&r.data),
                    bits(&want),
                    "N = {n}, n = {len}, rank {rank}"
                );
            }
        }
    }
}

#[test]
fn test_bytes_sent_meet_the_bound() {
    for n in 1..=6usize {
        // An empty buffer sends nothing, and one rank has no one to send to.
        for r in on_ring(&powers(n, 0), 1, sum(ReduceOp::Sum)) {
            assert_eq!(r.bytes_sent, 0, "N = {n}, n = 0");
        }
    }
    for n in 2..=6usize {
        let len = 60 * n;
        for r in on_ring(&powers(n, len), 7, sum(ReduceOp::Sum)) {
            // 2(N − 1)/N · n elements of 4 bytes, on every rank.
            assert_eq!(r.bytes_sent, (2 * (n - 1) * len / n * 4) as u64, "N = {n}");
        }
    }
}

#[test]
fn test_reduce_scatter_and_all_gather_alone() {
    for n in 1..=5usize {
        for len in [0, 2, n + 1, 31] {
            let inputs = powers(n, len);
            let refs: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
            let want = reference_all_reduce(&refs, ReduceOp::Sum);
            let scattered = on_ring(&inputs, 2, reduce_scatter);
            let mut gathered_inputs = Vec::new();
            for (rank, r) in scattered.iter().enumerate() {
                let own = shard_range(len, n, rank);
                assert_eq!(r.data[own.clone()], want[own.clone()], "N = {n}, n = {len}");
                // The all-gather alone: only the own shard is known, the rest is noise.
                let mut mine = vec![-1.0f32; len];
                mine[own.clone()].copy_from_slice(&r.data[own]);
                gathered_inputs.push(mine);
            }
            for r in on_ring(&gathered_inputs, 3, all_gather) {
                assert_eq!(r.data, want, "N = {n}, n = {len}");
            }
        }
    }
}

#[test]
fn test_the_order_shows_in_bf16_and_fp16() {
    // §3: rank 1 holds 1, the others half the format's spacing at 1.
    let case = |format: Format, half_spacing: f32| -> Vec<Vec<f32>> {
        let inputs = vec![
            vec![half_spacing; 4],
            vec![1.0; 4],
            vec![half_spacing; 4],
            vec![half_spacing; 4],
        ];
        on_ring(&inputs, 1, sum(ReduceOp::SumIn(format)))
            .into_iter()
            .map(|r| r.data)
            .collect()
    };
    for data in case(Format::Bf16, 2f32.powi(-8)) {
        assert_eq!(data, [1.0, 1.015625, 1.015625, 1.0]);
    }
    for data in case(Format::Fp16, 2f32.powi(-11)) {
        // 1 + 2^-9 = 1.001953125: the even neighbour of the tie 1 + 3·2^-11.
        let up = 1.0 + 2f32.powi(-9);
        assert_eq!(data, [1.0, up, up, 1.0]);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn test_any_world_and_length_is_the_references_on_every_rank(
        n in 1usize..7,
        len in 0usize..70,
        piece in 1usize..11,
        seed in any::<u16>(),
    ) {
        let inputs: Vec<Vec<f64>> = (0..n)
            .map(|r| (0..len).map(|i| f64::from(seed) * 1e-3 + (r * 131 + i * 17) as f64 / 9.0).collect())
            .collect();
        let refs: Vec<&[f64]> = inputs.iter().map(Vec::as_slice).collect();
        let want = reference_all_reduce(&refs, ReduceOp::Sum);
        let ran = on_ring(&inputs, piece, |link, rank, n, data: &mut [f64]| {
            ring_all_reduce(link, rank, n, data, ReduceOp::Sum).unwrap();
        });
        for r in ran {
            prop_assert_eq!(&r.data, &want);
        }
    }
}

//! The sequential reference the ring must match. The ring's schedule itself (which shard
//! each rank sends and receives at each step), shared by the socket ring and the ring over
//! MPI, is in [`ring_steps`](crate::ring_steps).
//!
//! Ranks sit in a ring, each sending to `rank + 1` and receiving from `rank - 1` (mod N).
//! Reduce-scatter takes N−1 steps: at step k rank r sends shard r−k−1 and receives shard
//! r−k−2, which it reduces into its own copy; so the partial sum of shard c starts at rank
//! c+1, goes once round the ring, and ends, complete, at rank c — the owner that
//! [`shard_range`](crate::shard_range) names. All-gather takes N−1 more steps: at step k rank
//! r sends shard r−k and receives shard r−k−1. Each step moves one shard per rank, so an
//! all-reduce sends 2(N−1)/N of the buffer per rank: bandwidth-optimal.

use crate::element::{Element, ReduceOp, prepare};
use crate::shard::shard_range;

/// What the ring's all-reduce computes from every rank's input, computed sequentially in the
/// same order: element i of shard c is `x[c] ⊕ (… ⊕ (x[c+2] ⊕ x[c+1]))`, ranks taken
/// mod N. Every rank of a ring all-reduce ends with exactly these bits.
///
/// ```
/// use tl_collective::{ReduceOp, reference_all_reduce};
///
/// let inputs = [vec![1.0f32, 10.0], vec![2.0, 20.0], vec![4.0, 40.0]];
/// let refs: Vec<&[f32]> = inputs.iter().map(|x| x.as_slice()).collect();
/// assert_eq!(reference_all_reduce(&refs, ReduceOp::Sum), [7.0, 70.0]);
/// ```
///
/// With [`ReduceOp::SumIn`] every input is first rounded to the format and every `⊕` is
/// rounded to it ([`sum_in`](crate::sum_in)), so where a shard's sum starts changes the
/// result. Four ranks, rank 1 holding 1 and the others `2^-8`, half the bf16 spacing at 1:
/// added to 1 first, each `2^-8` makes a tie that goes to the even 1, and all three are
/// lost; added to each other first they make `3·2^-8`, and `1 + 3·2^-8` is a tie between
/// `1 + 2^-7` and the even `1 + 2^-6`. One rounding of the exact sum gives `1 + 2^-6`
/// (as does every order in f32, which holds `1 + 3·2^-8`, before its one rounding).
///
/// ```
/// use tl_collective::{ReduceOp, reference_all_reduce};
/// use tl_numerics::{Format, round_to_bf16};
///
/// let small = 2f32.powi(-8);
/// let inputs = [vec![small; 4], vec![1.0; 4], vec![small; 4], vec![small; 4]];
/// let refs: Vec<&[f32]> = inputs.iter().map(|x| x.as_slice()).collect();
/// // Element c is shard c, whose sum starts at rank c + 1: rank 1's 1 comes first for
/// // element 0, last for element 1, third for element 2 and second for element 3.
/// let ring = reference_all_reduce(&refs, ReduceOp::SumIn(Format::Bf16));
/// assert_eq!(ring, [1.0, 1.015625, 1.015625, 1.0]);
/// let exact = reference_all_reduce(&refs, ReduceOp::Sum);
/// assert_eq!(exact, [1.01171875; 4]); // 1 + 3·2^-8
/// assert_eq!(round_to_bf16(exact[0]), 1.015625);
/// ```
///
/// # Panics
/// If `inputs` is empty or their lengths differ.
pub fn reference_all_reduce<T: Element>(inputs: &[&[T]], op: ReduceOp) -> Vec<T> {
    let world_size = inputs.len();
    assert!(world_size > 0, "reference_all_reduce: no inputs");
    let len = inputs[0].len();
    assert!(
        inputs.iter().all(|x| x.len() == len),
        "reference_all_reduce: lengths differ"
    );
    let prepared: Vec<Vec<T>> = inputs
        .iter()
        .map(|x| {
            let mut x = x.to_vec();
            prepare(op, &mut x);
            x
        })
        .collect();
    let mut out = Vec::with_capacity(len);
    for shard in 0..world_size {
        for i in shard_range(len, world_size, shard) {
            let mut acc = prepared[(shard + 1) % world_size][i];
            for hop in 2..=world_size {
                acc = T::reduce(op, prepared[(shard + hop) % world_size][i], acc);
            }
            out.push(acc);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_sums_shard_c_starting_at_rank_c_plus_one() {
        // Three ranks, one element each shard; 1e8 + 1 - 1e8 loses the 1 in f32 when the
        // big values meet first.
        let inputs = [
            vec![1e8f32, 1e8, 1e8],
            vec![1.0, 1.0, 1.0],
            vec![-1e8, -1e8, -1e8],
        ];
        let refs: Vec<&[f32]> = inputs.iter().map(|x| x.as_slice()).collect();
        let out = reference_all_reduce(&refs, ReduceOp::Sum);
        // shard 0: x1 + x2 = -1e8 + 1 = -1e8 (f32), then + x0 -> 0
        // shard 1: x2 + x0 = 0, then + x1 -> 1
        // shard 2: x0 + x1 = 1e8, then + x2 -> 0
        assert_eq!(out, [0.0, 1.0, 0.0]);
    }
}

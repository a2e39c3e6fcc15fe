//! fp8 on several ranks: what each rank's casts observed in a step, made global before the
//! scales are stepped, so that every rank scales as one process would.
//!
//! A rank sees only its part of a step: its rows of the global batch (data parallelism),
//! its slice of a split layer's weight, of its input or of its output's gradient (tensor
//! parallelism). Its own amaxes would give it scales of its own, and its casts would no
//! longer be the casts one process makes. So after every optimizer step, taken or skipped,
//! the amaxes of every fp8 tensor go through one all-reduce (max) over every rank of the
//! run, as Transformer Engine's `reduce_amax` does over its data- and tensor-parallel
//! groups, and then every rank steps the same histories to the same scales.
//!
//! On a pipeline a rank casts only its stages' layers, yet holds every layer's state (block
//! `i`'s layers are `7i..7i + 7` on whichever rank holds the block). The same all-reduce
//! spans the pipeline's ranks: a rank that does not hold a layer adds an amax of 0 and no
//! counts, so every rank ends the step with the holder's observations. No stage reads
//! another's scales; what needs them is rank 0, which logs the counts and writes the whole
//! state into checkpoints.
//!
//! The same all-reduce carries the range counts, so that `metrics.jsonl` reports the whole
//! step's. A maximum cannot add, so each rank writes its counts into a block of the buffer
//! that is its alone (zeros in every other rank's block): the maximum of one value and
//! zeros is that value, and every rank then adds the blocks up in rank order. The buffer is
//! `3L + 6L·N` values for `L` fp8 layers on `N` ranks: one collective a step, whatever the
//! number of layers, at a few kilobytes. A tensor that every rank of a tensor-parallel
//! group casts whole (a column-parallel layer's input, a row-parallel layer's output
//! gradient) is counted by the group's first rank only, so each value one process would
//! cast is counted once.

use tl_collective::{Element, ReduceOp};
use tl_numerics::RangeCounts;
use tl_parallel::DataParallel;
use tl_precision::Fp8State;
use tl_tensor::memory;

use crate::error::Result;
use crate::model::parallel::{Placement, placement};

/// The memory meter's label while the amaxes are all-reduced: how the plan's traffic table
/// tells the call apart.
pub(crate) const FP8_AMAXES_LABEL: &str = "fp8 amaxes";

/// Which of the fp8 layer `name`'s tensors (input, weight, grad) every rank of a
/// tensor-parallel group casts whole: a column-parallel layer reads the whole activation,
/// a row-parallel layer gets the whole gradient of its (summed) output.
fn whole_on_every_tensor_rank(name: &str) -> [bool; 3] {
    match placement(&format!("{name}.weight")) {
        Placement::Split { axis: 1 } => [true, false, false],
        Placement::Split { .. } => [false, false, true],
        Placement::Replicated => [true, true, true],
    }
}

/// Makes the step's observations in `state` global over `world`'s ranks: every tensor's
/// amax becomes the largest any rank saw (a NaN on one rank, NaN everywhere), its counts
/// their sum. `names` are the fp8 layers' names ([`Llama::fp8_layer_names`]) and
/// `tensor_rank` this rank's place in its tensor-parallel group (0 without one). Nothing
/// is communicated in a world of one.
///
/// [`Llama::fp8_layer_names`]: crate::model::Llama::fp8_layer_names
///
/// # Errors
/// [`TrainError::Parallel`](crate::TrainError::Parallel) when the collective fails; the
/// state is then unchanged.
///
/// # Panics
/// If `names` is not one name per layer of `state`.
pub(crate) fn make_global(
    world: &mut DataParallel,
    state: &mut Fp8State,
    names: &[String],
    tensor_rank: usize,
) -> Result<()> {
    let (rank, ranks) = (world.rank(), world.world_size());
    if ranks == 1 {
        return Ok(());
    }
    assert_eq!(names.len(), state.layers.len(), "one name per fp8 layer");
    let tensors = 3 * state.layers.len();
    // [amaxes: 3 per layer | N blocks of counts: 2 per tensor, rank r's in block r]
    let mut buffer = vec![0.0f64; tensors + 2 * tensors * ranks];
    let (amaxes, counts) = buffer.split_at_mut(tensors);
    let own = &mut counts[2 * tensors * rank..2 * tensors * (rank + 1)];
    for (i, (layer, name)) in state.layers.iter().zip(names).enumerate() {
        let whole = whole_on_every_tensor_rank(name);
        for (j, scales) in layer.all().into_iter().enumerate() {
            let k = 3 * i + j;
            amaxes[k] = f64::from(scales.pending);
            if tensor_rank == 0 || !whole[j] {
                // Exact: a step's counts stay far below 2^53.
                own[2 * k] = scales.counts.saturated as f64;
                own[2 * k + 1] = scales.counts.flushed as f64;
            }
        }
    }
    {
        let _label = memory::label_scope(FP8_AMAXES_LABEL);
        world
            .with_communicator(|comm| comm.all_reduce(f64::view_mut(&mut buffer), ReduceOp::Max))?;
    }
    let (amaxes, counts) = buffer.split_at(tensors);
    for (i, layer) in state.layers.iter_mut().enumerate() {
        for (j, scales) in layer.all_mut().into_iter().enumerate() {
            let k = 3 * i + j;
            // Exact: the largest of f32 values, carried in an f64.
            scales.pending = amaxes[k] as f32;
            scales.counts = (0..ranks)
                .map(|r| {
                    let block = &counts[2 * tensors * r..];
                    RangeCounts {
                        saturated: block[2 * k] as u64,
                        flushed: block[2 * k + 1] as u64,
                    }
                })
                .sum();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tl_collective::{RingComm, RingConfig};
    use tl_precision::Fp8Recipe;

    use super::*;

    /// Runs `program` on `n` ranks of a ring, one thread each.
    fn world<T: Send>(n: usize, program: impl Fn(DataParallel) -> T + Sync) -> Vec<T> {
        let dir = tempfile::tempdir().unwrap();
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..n)
                .map(|rank| {
                    let (dir, program) = (dir.path(), &program);
                    scope.spawn(move || {
                        let config = RingConfig::new(rank, n, dir, [7; 32])
                            .unwrap()
                            .timeout(Duration::from_secs(30));
                        let ring = RingComm::connect(config).unwrap();
                        program(DataParallel::new(Box::new(ring)))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn counts(saturated: u64, flushed: u64) -> RangeCounts {
        RangeCounts { saturated, flushed }
    }

    /// Rank `r` of 3 (tensor rank `r % 3`, a tensor group of 3) saw, in one block's `wq`
    /// (column-parallel) and `wo` (row-parallel): amaxes `1 + r` apart from rank 1's NaN
    /// in `wo`'s input and rank 2's 9 in `wq`'s gradient; `r + 1` saturated and `10·r`
    /// flushed values in every tensor.
    fn observed(rank: usize) -> Fp8State {
        let mut state = Fp8State::new(Fp8Recipe::default(), 2).unwrap();
        for layer in &mut state.layers {
            for scales in layer.all_mut() {
                scales.observe(1.0 + rank as f32);
                scales.counts = counts(rank as u64 + 1, 10 * rank as u64);
            }
        }
        if rank == 1 {
            state.layers[1].input.observe(f32::NAN);
        }
        if rank == 2 {
            state.layers[0].grad.observe(9.0);
        }
        state
    }

    #[test]
    fn every_rank_gets_the_largest_amax_and_the_counts_of_each_value_once() {
        let names = ["blocks.0.wq".to_string(), "blocks.0.wo".to_string()];
        let states = world(3, |mut world| {
            let rank = world.rank();
            let mut state = observed(rank);
            make_global(&mut world, &mut state, &names, rank).unwrap();
            state
        });
        // Compared as text: a NaN is not equal to itself.
        let alike = |states: &[Fp8State]| {
            let first = format!("{:?}", states[0].layers);
            states.iter().all(|s| format!("{:?}", s.layers) == first)
        };
        assert!(alike(&states), "every rank alike");
        let [wq, wo] = [&states[0].layers[0], &states[0].layers[1]];
        // The largest of 1, 2 and 3 (and rank 2's 9); rank 1's NaN poisons wo's input.
        assert_eq!(
            (wq.input.pending, wq.weight.pending, wq.grad.pending),
            (3.0, 3.0, 9.0)
        );
        assert!(wo.input.pending.is_nan());
        assert_eq!((wo.weight.pending, wo.grad.pending), (3.0, 3.0));
        // Summed over the ranks: 1 + 2 + 3 saturated, 0 + 10 + 20 flushed; a tensor cast
        // whole on every rank of the tensor group (wq's input, wo's gradient) is counted
        // by tensor rank 0 alone: 1 and 0.
        let (all, first) = (counts(6, 30), counts(1, 0));
        assert_eq!(
            (wq.input.counts, wq.weight.counts, wq.grad.counts),
            (first, all, all)
        );
        assert_eq!(
            (wo.input.counts, wo.weight.counts, wo.grad.counts),
            (all, all, first)
        );
        // Then every rank steps to the same scales: 448 / 3 for wq's input.
        let mut stepped: Vec<Fp8State> = states.clone();
        for state in &mut stepped {
            state.update();
        }
        assert_eq!(stepped[0].layers[0].input.scale, 448.0 / 3.0);
        assert!(alike(&stepped));
    }

    #[test]
    fn a_world_of_one_communicates_nothing() {
        let mut world = DataParallel::new(Box::new(tl_collective::Single::new()));
        let mut state = observed(2);
        let before = state.clone();
        let names = ["blocks.0.wq".to_string(), "blocks.0.wo".to_string()];
        make_global(&mut world, &mut state, &names, 0).unwrap();
        assert_eq!(state, before);
        assert_eq!(world.stats().bytes_sent, 0);
    }

    #[test]
    fn the_tensors_cast_whole_on_every_tensor_rank() {
        for (name, whole) in [
            ("blocks.3.wq", [true, false, false]),
            ("blocks.3.w3", [true, false, false]),
            ("blocks.0.wo", [false, false, true]),
            ("blocks.0.w2", [false, false, true]),
        ] {
            assert_eq!(whole_on_every_tensor_rank(name), whole, "{name}");
        }
    }
}

//! Dropout inside checkpointed segments: the rerun draws the forward pass's masks, and the
//! stream ends where it ends without checkpointing.

use std::rc::Rc;
use std::slice::from_ref;

use tl_recompute::{checkpoint, checkpoint_schedule};
use tl_tensor::nn::Module;
use tl_tensor::{Generator, Tensor, no_grad};

use crate::common::{Block, LoggedDropout, Stack, blocks, data, parameters, step};

/// Six blocks, each followed by a dropout drawing from one shared generator: 12 layers, with
/// typed handles on the blocks and the dropouts.
struct DropoutStack {
    layers: Stack<f64>,
    blocks: Vec<Rc<Block<f64>>>,
    dropouts: Vec<Rc<LoggedDropout>>,
}

fn stack(dropout_rng: &Generator) -> DropoutStack {
    let blocks = blocks::<f64>(6, 4, 60);
    let dropouts: Vec<Rc<LoggedDropout>> = (0..6)
        .map(|_| Rc::new(LoggedDropout::new(0.5, dropout_rng.clone())))
        .collect();
    let mut layers: Stack<f64> = Vec::new();
    for (block, dropout) in blocks.iter().zip(&dropouts) {
        layers.push(Rc::clone(block) as Rc<dyn Module<f64>>);
        layers.push(Rc::clone(dropout) as Rc<dyn Module<f64>>);
    }
    DropoutStack {
        layers,
        blocks,
        dropouts,
    }
}

#[test]
fn dropout_masks_replay_and_the_stream_ends_where_the_plain_runs_does() {
    let dropout_rng = Generator::new(61);
    let DropoutStack {
        layers,
        blocks,
        dropouts,
    } = stack(&dropout_rng);
    let (x, target) = (data::<f64>(&[3, 4], 62), data(&[3, 4], 63));
    let params = parameters(&blocks);
    let start = dropout_rng.state();

    let plain = step(&layers, &x, &target, None, &[], &params);
    let plain_end = dropout_rng.state();
    let plain_masks: Vec<Vec<bool>> = dropouts.iter().map(|d| d.masks()[0].clone()).collect();
    assert_ne!(
        plain_masks[0], plain_masks[1],
        "each layer draws its own mask"
    );

    dropout_rng.set_state(&start);
    dropouts.iter().for_each(|d| d.forget_masks());
    // 12 layers in 5 units: segments 0..5 and 5..9 are checkpointed, 9..12 is not, and it
    // draws after them (dropout layers 4 and 5), so a stream left at the rerun's end shows.
    let schedule = checkpoint_schedule(12, 5).unwrap();
    assert_eq!(schedule, [0, 5, 9]);
    let checkpointed = step(
        &layers,
        &x,
        &target,
        Some(&schedule),
        from_ref(&dropout_rng),
        &params,
    );

    // Dropout layer i is layer 2i + 1: layers 1, 3 (segment 0) and 5, 7 (segment 1) ran
    // twice, with the same mask both times; layers 9 and 11 once.
    for (i, dropout) in dropouts.iter().enumerate() {
        let expected_calls = if 2 * i + 1 < 9 { 2 } else { 1 };
        let masks = dropout.masks();
        assert_eq!(masks.len(), expected_calls, "dropout {i}");
        assert!(
            masks.iter().all(|mask| *mask == plain_masks[i]),
            "dropout {i}: masks differ"
        );
    }
    assert_eq!(checkpointed, plain);
    assert_eq!(dropout_rng.state(), plain_end);
}

#[test]
fn later_draws_are_those_of_a_run_without_checkpointing() {
    // The segment draws 3 numbers, the caller 1 more before backward; afterwards the next
    // draw must be the 5th, as without checkpointing, although the rerun drew 3 again.
    let rng = Generator::new(70);
    let reference = Generator::new(70);
    let expected: Vec<u64> = (0..5).map(|_| reference.next_u64()).collect();
    let w = Tensor::<f64>::param(data::<f64>(&[3], 71).to_array());
    let (draws, weight) = (rng.clone(), w.clone());
    let f = move |_: &[Tensor<f64>]| {
        let noise: Vec<f64> = (0..3).map(|_| draws.next_u64() as f64 / 1e19).collect();
        &weight * &Tensor::from_vec(noise, &[3]).unwrap()
    };
    let y = checkpoint(f, &[], from_ref(&w), from_ref(&rng));
    assert_eq!(rng.next_u64(), expected[3]);
    y.sum_all().backward();
    assert_eq!(rng.next_u64(), expected[4]);
    // d(Σ w ⊙ noise)/dw = noise: the rerun drew the forward pass's three numbers again.
    let noise: Vec<f64> = expected[..3]
        .iter()
        .map(|&bits| bits as f64 / 1e19)
        .collect();
    assert_eq!(w.grad().unwrap().as_slice().unwrap(), noise.as_slice());
}

#[test]
fn under_no_grad_the_generator_advances_once() {
    let rng = Generator::new(80);
    let reference = Generator::new(80);
    reference.next_u64();
    let draws = rng.clone();
    let w = Tensor::<f32>::param(data::<f32>(&[2], 81).to_array());
    let y = {
        let _off = no_grad();
        checkpoint(
            move |xs| xs[0].add_scalar(draws.next_u64() as f32),
            from_ref(&w),
            &[],
            from_ref(&rng),
        )
    };
    assert!(!y.requires_grad());
    assert_eq!(rng.state(), reference.state());
}

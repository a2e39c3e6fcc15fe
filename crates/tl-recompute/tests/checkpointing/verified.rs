//! Verified mode: a rerun that does not reproduce its forward pass is reported, by segment.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::rc::Rc;
use std::slice::from_ref;

use tl_recompute::{
    CheckpointOptions, RecomputeError, backward_verified, checkpoint_sequential_with,
    checkpoint_with, uniform_schedule,
};
use tl_tensor::losses::mse;
use tl_tensor::nn::Module;
use tl_tensor::{Generator, Tensor};

use crate::common::{Block, Noise, Stack, blocks, data, grad_bits, parameters};

/// Seven layers with a noise layer at index 4, inside the second of the √7 schedule's
/// segments [0, 3, 6] (layers 3..6).
fn noisy_stack(noise_rng: &Generator) -> (Stack<f32>, Vec<Rc<Block<f32>>>) {
    let blocks = blocks::<f32>(6, 3, 90);
    let mut layers: Stack<f32> = blocks
        .iter()
        .map(|b| Rc::clone(b) as Rc<dyn Module<f32>>)
        .collect();
    layers.insert(4, Rc::new(Noise::new(noise_rng.clone())));
    (layers, blocks)
}

fn loss_of(output: &Tensor<f32>) -> Tensor<f32> {
    mse(output, &data(&[2, 3], 91))
}

#[test]
fn an_unreplayed_draw_is_an_error_naming_the_segment() {
    let noise_rng = Generator::new(92);
    let (layers, _) = noisy_stack(&noise_rng);
    let x = data::<f32>(&[2, 3], 93);
    let schedule = uniform_schedule(7).unwrap();
    assert_eq!(schedule, [0, 3, 6]);
    // The noise generator is not among the rngs: the rerun draws new numbers.
    let output = checkpoint_sequential_with(&layers, &x, &schedule, &[], true).unwrap();
    let error = backward_verified(&loss_of(&output)).unwrap_err();
    let RecomputeError::RecomputeMismatch { segment, .. } = &error else {
        panic!("unexpected error {error}");
    };
    assert_eq!(segment, "segment 1 (layers 3..6)");
    assert!(error.to_string().contains("rngs"), "{error}");
}

#[test]
fn outside_backward_verified_a_mismatch_panics_with_the_segment() {
    let noise_rng = Generator::new(94);
    let (layers, _) = noisy_stack(&noise_rng);
    let x = data::<f32>(&[2, 3], 95);
    let output = checkpoint_sequential_with(&layers, &x, &[0, 3, 6], &[], true).unwrap();
    let loss = loss_of(&output);
    let panic = catch_unwind(AssertUnwindSafe(|| loss.backward())).unwrap_err();
    let message = panic.downcast_ref::<String>().expect("a formatted message");
    assert!(message.contains("segment 1 (layers 3..6)"), "{message}");
}

#[test]
fn a_replayed_draw_verifies_and_trains_like_the_plain_run() {
    let noise_rng = Generator::new(96);
    let (layers, blocks) = noisy_stack(&noise_rng);
    let x = data::<f32>(&[2, 3], 97);
    let params = parameters(&blocks);
    let start = noise_rng.state();
    let plain = layers.iter().fold(x.clone(), |h, layer| layer.forward(&h));
    loss_of(&plain).backward();
    let plain_grads: Vec<_> = params.iter().map(grad_bits).collect();

    params.iter().for_each(Tensor::zero_grad);
    noise_rng.set_state(&start);
    let rngs = [noise_rng.clone()];
    let output = checkpoint_sequential_with(&layers, &x, &[0, 3, 6], &rngs, true).unwrap();
    assert_eq!(backward_verified(&loss_of(&output)), Ok(()));
    assert_eq!(
        params.iter().map(grad_bits).collect::<Vec<_>>(),
        plain_grads
    );
}

#[test]
fn a_parameter_changed_between_the_passes_is_caught() {
    let w = Tensor::<f64>::param(data::<f64>(&[2, 2], 98).to_array());
    let x = data::<f64>(&[3, 2], 99);
    let weight = w.clone();
    let y = checkpoint_with(
        move |xs| xs[0].matmul(&weight),
        &[x],
        from_ref(&w),
        &[],
        &CheckpointOptions::verified("attention block 2"),
    );
    // An optimizer step before backward: the rerun computes with the new weight.
    w.update_value(|value| value.mapv_inplace(|v| v * 0.5));
    match backward_verified(&y.sum_all()) {
        Err(RecomputeError::RecomputeMismatch { segment, detail }) => {
            assert_eq!(segment, "attention block 2");
            assert!(detail.contains("fingerprint"), "{detail}");
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
}

#[test]
fn a_rerun_of_another_shape_is_named_by_its_shapes() {
    // A segment whose output shape depends on state that changed between the passes.
    let rows = Rc::new(std::cell::Cell::new(2));
    let w = Tensor::<f64>::param(data::<f64>(&[4], 100).to_array());
    let (weight, rows_now) = (w.clone(), Rc::clone(&rows));
    let y = checkpoint_with(
        move |_| weight.reshape(&[rows_now.get(), 4 / rows_now.get()]),
        &[],
        from_ref(&w),
        &[],
        &CheckpointOptions::verified("reshape"),
    );
    rows.set(1);
    let message = catch_unwind(AssertUnwindSafe(|| y.sum_all().backward()))
        .unwrap_err()
        .downcast_ref::<String>()
        .cloned()
        .unwrap();
    assert!(
        message.contains("shape [2, 2] in forward, [1, 4] in the rerun"),
        "{message}"
    );
}

#[test]
fn a_panic_inside_backward_verified_stops_the_collecting() {
    // backward_verified on a graph already swept panics; afterwards, a mismatch in a plain
    // backward must still panic rather than be collected for nobody.
    let w = Tensor::<f64>::param(data::<f64>(&[2], 101).to_array());
    let loss = (&w * &w).sum_all();
    loss.backward();
    assert!(catch_unwind(AssertUnwindSafe(|| backward_verified(&loss))).is_err());

    let noise_rng = Generator::new(102);
    let (layers, _) = noisy_stack(&noise_rng);
    let output =
        checkpoint_sequential_with(&layers, &data(&[2, 3], 103), &[0, 3, 6], &[], true).unwrap();
    let loss = loss_of(&output);
    assert!(catch_unwind(AssertUnwindSafe(|| loss.backward())).is_err());
}

//! A checkpointed stack under a split backward (`backward_input_from`, a zero-bubble
//! schedule's `I`, then `WeightGradients::run`, its `W`): the segments rerun once, in the
//! first half, their parameters' gradients wait for the second, and the gradients are the
//! plain backward's bit for bit.

use std::rc::Rc;

use tl_recompute::checkpoint_sequential_with;
use tl_tensor::losses::mse;
use tl_tensor::nn::Module;
use tl_tensor::{Element, Tensor};

use crate::common::{Block, blocks, data, grad_bits, parameters};

/// An input that requires grad, as a pipeline stage's received activation.
fn input<E: Element>(shape: &[usize], seed: u64) -> Tensor<E> {
    let x = data::<E>(shape, seed);
    x.set_requires_grad(true);
    x
}

fn loss<E: Element>(
    layers: &[Rc<Block<E>>],
    x: &Tensor<E>,
    schedule: Option<&[usize]>,
) -> Tensor<E> {
    let output = match schedule {
        Some(schedule) => checkpoint_sequential_with(layers, x, schedule, &[], false).unwrap(),
        None => layers.iter().fold(x.clone(), |h, layer| layer.forward(&h)),
    };
    mse(&output, &data(&output.shape(), 99))
}

fn checkpointed_split_equals_plain<E: Element>() {
    let layers = blocks::<E>(5, 4, 1);
    let params = parameters(&layers);
    let x = input::<E>(&[3, 4], 2);
    loss(&layers, &x, None).backward();
    let expected: Vec<_> = params.iter().map(grad_bits).collect();
    let expected_x = grad_bits(&x);
    for p in &params {
        p.zero_grad();
    }
    let calls = || layers.iter().map(|b| b.calls().len()).sum::<usize>();
    // How many blocks an unsplit backward reruns (every checkpointed one).
    let schedule: &[usize] = &[0, 2, 4];
    let output = loss(&layers, &input::<E>(&[3, 4], 2), Some(schedule));
    layers.iter().for_each(|b| b.forget_calls());
    output.backward();
    let reruns = calls();
    assert!(reruns > 0);
    for p in &params {
        p.zero_grad();
    }

    let x = input::<E>(&[3, 4], 2);
    let output = loss(&layers, &x, Some(schedule));
    layers.iter().for_each(|b| b.forget_calls());
    let weights = output.backward_input();
    assert_eq!(grad_bits(&x), expected_x, "the input's gradient, first");
    assert!(params.iter().all(|p| p.grad().is_none()), "no weight yet");
    assert_eq!(
        calls(),
        reruns,
        "every segment reran once, in the first half"
    );
    weights.run();
    assert_eq!(calls(), reruns, "the second half reruns nothing");
    let got: Vec<_> = params.iter().map(grad_bits).collect();
    assert_eq!(got, expected);
}

#[test]
fn a_checkpointed_stack_splits_into_the_plain_gradients_f32() {
    checkpointed_split_equals_plain::<f32>();
}

#[test]
fn a_checkpointed_stack_splits_into_the_plain_gradients_f64() {
    checkpointed_split_equals_plain::<f64>();
}

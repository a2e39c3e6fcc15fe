//! Gradient accumulation: micro-batches of any sizes give the gradient of one big batch.

use tl_precision::{MicroBatch, PrecisionError, grad_accumulate};
use tl_tensor::losses::mse;
use tl_tensor::ndarray::{ArrayD, IxDyn};
use tl_tensor::nn::{Linear, Module};
use tl_tensor::{Element, Generator, Tensor, memory};

use crate::common::{assert_close, normal, values};

type Batch<E> = (Tensor<E>, Tensor<E>);

/// 32 rows of a regression problem with 3 inputs and 2 outputs.
fn problem<E: Element>(seed: u64) -> (Linear<E>, Batch<E>) {
    let rng = Generator::new(seed);
    let layer = Linear::new(3, 2, true, &rng);
    let x = Tensor::from_array(normal(&[32, 3], 1.0, &rng));
    let target = Tensor::from_array(normal(&[32, 2], 1.0, &rng));
    (layer, (x, target))
}

/// The rows `start..start + len` of a batch.
fn slice<E: Element>((x, target): &Batch<E>, start: usize, len: usize) -> Batch<E> {
    (x.narrow(0, start, len), target.narrow(0, start, len))
}

fn loss_fn<E: Element>(model: &Linear<E>, (x, target): &Batch<E>) -> Tensor<E> {
    mse(&model.forward(x), target)
}

/// The loss and every parameter's gradient, widened to f64.
fn loss_and_grads<E: Element>(model: &Linear<E>, micro_batches: &[Batch<E>]) -> Vec<f64> {
    model.zero_grad();
    let loss = grad_accumulate(model, micro_batches, loss_fn, None).unwrap();
    let grads = model
        .parameters()
        .into_iter()
        .flat_map(|p| values(&p.grad().unwrap()))
        .map(|g| g.to_f64());
    std::iter::once(loss).chain(grads).collect()
}

fn check_micro_batches_equal_one_batch<E: Element>(tol: f64) {
    let (model, batch) = problem::<E>(21);
    let whole = loss_and_grads(&model, std::slice::from_ref(&batch));
    let split = [
        slice(&batch, 0, 5),
        slice(&batch, 5, 11),
        slice(&batch, 16, 16),
    ];
    let accumulated = loss_and_grads(&model, &split);
    assert_close(&accumulated, &whole, tol);
    // The split changes the numbers enough that a wrong weighting would show: the
    // micro-batch losses differ from one another.
    let losses: Vec<f64> = split
        .iter()
        .map(|b| loss_and_grads(&model, std::slice::from_ref(b))[0])
        .collect();
    assert!((losses[0] - losses[2]).abs() > 0.05, "{losses:?}");
}

#[test]
fn micro_batches_of_5_11_and_16_rows_equal_one_batch_of_32() {
    check_micro_batches_equal_one_batch::<f32>(1e-6);
    check_micro_batches_equal_one_batch::<f64>(1e-13);
}

#[test]
fn gradients_add_onto_what_is_already_there() {
    // The caller zeroes before a step; accumulation itself only adds.
    let (model, batch) = problem::<f64>(4);
    let once = loss_and_grads(&model, std::slice::from_ref(&batch));
    grad_accumulate(
        &model,
        &[slice(&batch, 0, 12), slice(&batch, 12, 20)],
        loss_fn,
        None,
    )
    .unwrap();
    let twice: Vec<f64> = model
        .parameters()
        .iter()
        .flat_map(|p| values(&p.grad().unwrap()))
        .collect();
    let doubled: Vec<f64> = once[1..].iter().map(|g| 2.0 * g).collect();
    assert_close(&twice, &doubled, 1e-13);
}

#[test]
fn empty_input_and_empty_micro_batches_are_errors_before_any_backward() {
    let (model, batch) = problem::<f32>(1);
    let none: [Batch<f32>; 0] = [];
    assert_eq!(
        grad_accumulate(&model, &none, loss_fn, None),
        Err(PrecisionError::NoMicroBatches)
    );
    let with_empty = [slice(&batch, 0, 4), slice(&batch, 4, 0)];
    assert_eq!(
        grad_accumulate(&model, &with_empty, loss_fn, None),
        Err(PrecisionError::EmptyMicroBatch { index: 1 })
    );
    assert!(model.parameters().iter().all(|p| p.grad().is_none()));
}

#[test]
fn rows_are_the_first_axis_of_the_input() {
    let x = Tensor::<f32>::zeros(&[7, 3]);
    assert_eq!(x.rows(), 7);
    assert_eq!((x.clone(), Tensor::<f32>::zeros(&[7, 1])).rows(), 7);
    assert_eq!((x.clone(), vec![0usize; 21]).rows(), 7);
    assert_eq!(Tensor::<f32>::scalar(1.0).rows(), 1);
    // A borrowed micro-batch has the rows of what it borrows.
    let borrowed = &(x.clone(), vec![0usize; 21]);
    assert_eq!(MicroBatch::rows(&borrowed), 7);
}

/// A model whose forward pass keeps a large activation alive until backward.
fn wide_problem() -> (Linear<f32>, Vec<Batch<f32>>) {
    let rng = Generator::new(9);
    let layer = Linear::new(64, 64, false, &rng);
    let micro_batches = (0..4)
        .map(|_| {
            let x = Tensor::from_array(normal(&[32, 64], 1.0, &rng));
            (x, Tensor::from_array(ArrayD::zeros(IxDyn(&[32, 64]))))
        })
        .collect();
    (layer, micro_batches)
}

#[test]
fn only_one_micro_batch_graph_is_alive_at_a_time() {
    let (model, micro_batches) = wide_problem();
    // Warm up so that the gradients (which stay) exist before measuring.
    grad_accumulate(&model, &micro_batches[..1], loss_fn, None).unwrap();
    let (_, one) =
        memory::measure_peak(|| grad_accumulate(&model, &micro_batches[..1], loss_fn, None));
    let (_, four) = memory::measure_peak(|| grad_accumulate(&model, &micro_batches, loss_fn, None));
    assert!(one > 0);
    assert_eq!(four, one, "four micro-batches peak no higher than one");
}

#[test]
fn the_accumulated_gradient_is_the_derivative_of_the_batch_loss() {
    // Central differences of the whole batch's loss, in f64, against the gradient that two
    // unequal micro-batches (7 and 25 rows) accumulate.
    let (model, batch) = problem::<f64>(13);
    let split = [slice(&batch, 0, 7), slice(&batch, 7, 25)];
    model.zero_grad();
    grad_accumulate(&model, &split, loss_fn, None).unwrap();
    let h = 1e-6;
    for param in model.parameters() {
        let analytic = values(&param.grad().unwrap());
        for (i, &g) in analytic.iter().enumerate() {
            let original = param.value().as_slice().unwrap()[i];
            let loss_at = |w: f64| {
                param.update_value(|v| v.as_slice_mut().unwrap()[i] = w);
                let _no_graph = tl_tensor::no_grad();
                loss_fn(&model, &batch).item()
            };
            let numeric = (loss_at(original + h) - loss_at(original - h)) / (2.0 * h);
            loss_at(original);
            assert!((g - numeric).abs() < 1e-7, "element {i}: {g} vs {numeric}");
        }
    }
}
